import java.io.IOException;
import java.lang.management.ManagementFactory;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.LongBuffer;
import java.nio.channels.FileChannel;
import java.nio.file.Paths;
import java.nio.file.StandardOpenOption;
import java.util.concurrent.atomic.AtomicLong;

import org.apache.flink.api.common.JobExecutionResult;
import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.functions.RichMapFunction;
import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.api.java.tuple.Tuple3;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.StateBackendOptions;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.streaming.api.functions.sink.v2.DiscardingSink;
import org.apache.flink.util.Collector;

/**
 * The peer job of benchmarks/bench_record_path.py on Flink's DataStream API: a keyed running sum with two
 * ValueStates (count, sum) and one output record (key, count, sum) per input record.
 *
 * Usage: RecordPathJob EVENTS_BIN PARALLELISM MAX_PARALLELISM BACKEND(hashmap|rocksdb)
 *
 * EVENTS_BIN holds the events as little-endian int64 pairs (key, value), written by the benchmark from the same
 * Arrow data every other candidate reads. The events reach the keyed operator through a parallel sequence source
 * and a map that looks each index up in that array (loaded once per JVM). Checkpoints are off: the job is timed
 * as it processes, start to finish, and prints one line of figures:
 * records=N checksum=C netRuntimeMs=T executeCpuMs=U
 * where the checksum is the sum over outputs of the running count (order-independent: per key 1 + 2 + ... + n),
 * and executeCpuMs is the JVM's process CPU time spent during env.execute (MiniCluster start included).
 */
public class RecordPathJob {
    static volatile long[] pairs;
    static final AtomicLong RECORDS = new AtomicLong();
    static final AtomicLong CHECKSUM = new AtomicLong();

    static synchronized long[] load(String path) throws IOException {
        if (pairs == null) {
            try (FileChannel ch = FileChannel.open(Paths.get(path), StandardOpenOption.READ)) {
                ByteBuffer bytes = ByteBuffer.allocate((int) ch.size()).order(ByteOrder.LITTLE_ENDIAN);
                while (bytes.hasRemaining() && ch.read(bytes) >= 0) { }
                bytes.flip();
                LongBuffer longs = bytes.asLongBuffer();
                long[] all = new long[longs.remaining()];
                longs.get(all);
                pairs = all;
            }
        }
        return pairs;
    }

    static class Lookup extends RichMapFunction<Long, Tuple2<Long, Long>> {
        private final String path;
        private transient long[] data;

        Lookup(String path) { this.path = path; }

        @Override
        public void open(OpenContext context) throws Exception { data = load(path); }

        @Override
        public Tuple2<Long, Long> map(Long i) {
            int at = (int) (2 * i);
            return Tuple2.of(data[at], data[at + 1]);
        }
    }

    static class RunningSum extends KeyedProcessFunction<Long, Tuple2<Long, Long>, Tuple3<Long, Long, Long>> {
        private transient ValueState<Long> count;
        private transient ValueState<Long> sum;
        private long records;
        private long checksum;

        @Override
        public void open(OpenContext context) {
            count = getRuntimeContext().getState(new ValueStateDescriptor<>("count", Types.LONG));
            sum = getRuntimeContext().getState(new ValueStateDescriptor<>("sum", Types.LONG));
        }

        @Override
        public void processElement(Tuple2<Long, Long> event, Context ctx, Collector<Tuple3<Long, Long, Long>> out)
                throws Exception {
            Long c = count.value();
            Long s = sum.value();
            long newCount = (c == null ? 0L : c) + 1;
            long newSum = (s == null ? 0L : s) + event.f1;
            count.update(newCount);
            sum.update(newSum);
            records++;
            checksum += newCount;
            out.collect(Tuple3.of(event.f0, newCount, newSum));
        }

        @Override
        public void close() {
            RECORDS.addAndGet(records);
            CHECKSUM.addAndGet(checksum);
        }
    }

    public static void main(String[] args) throws Exception {
        String path = args[0];
        int parallelism = Integer.parseInt(args[1]);
        int maxParallelism = Integer.parseInt(args[2]);
        String backend = args[3];
        long n = load(path).length / 2;

        Configuration conf = new Configuration();
        conf.set(StateBackendOptions.STATE_BACKEND, backend);
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(parallelism);
        env.setMaxParallelism(maxParallelism);
        env.fromSequence(0, n - 1)
                .map(new Lookup(path)).returns(Types.TUPLE(Types.LONG, Types.LONG))
                .keyBy(e -> e.f0, Types.LONG)
                .process(new RunningSum()).returns(Types.TUPLE(Types.LONG, Types.LONG, Types.LONG))
                .sinkTo(new DiscardingSink<>());
        com.sun.management.OperatingSystemMXBean os =
                (com.sun.management.OperatingSystemMXBean) ManagementFactory.getOperatingSystemMXBean();
        long cpu0 = os.getProcessCpuTime();
        JobExecutionResult result = env.execute("keygroups record-path peer (" + backend + ")");
        long cpu = (os.getProcessCpuTime() - cpu0) / 1_000_000;
        System.out.println("records=" + RECORDS.get() + " checksum=" + CHECKSUM.get() + " netRuntimeMs="
                + result.getNetRuntime() + " executeCpuMs=" + cpu);
    }
}
