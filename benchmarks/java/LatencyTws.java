import java.util.ArrayList;
import java.util.concurrent.TimeoutException;

import org.apache.spark.api.java.function.MapFunction;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Encoders;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.SparkSession;
import org.apache.spark.sql.streaming.OutputMode;
import org.apache.spark.sql.streaming.StatefulProcessor;
import org.apache.spark.sql.streaming.StreamingQuery;
import org.apache.spark.sql.streaming.TTLConfig;
import org.apache.spark.sql.streaming.TimeMode;
import org.apache.spark.sql.streaming.TimerValues;
import org.apache.spark.sql.streaming.Trigger;
import org.apache.spark.sql.streaming.ValueState;

import scala.Tuple2;
import scala.collection.Iterator;
import scala.jdk.javaapi.CollectionConverters;

/**
 * Spark's JVM transformWithState, the anchor of benchmarks/bench_latency.py: per key a running sum in one
 * ValueState, read and updated once per record, one output row (key, sum) per record, in micro-batch mode.
 *
 * The benchmark calls {@link #start} through py4j in its own Spark session (this class on the driver's class
 * path): file source (Parquet, "key long, value long, ts long") -> groupByKey(key) -> transformWithState
 * (TimeMode.None, OutputMode.Append, RocksDB state store) -> Parquet file sink, processing-time trigger. A batch's
 * output is committed when the file sink writes _spark_metadata/BATCH_ID (or BATCH_ID.compact).
 */
public class LatencyTws {
    public static class RunningSum extends StatefulProcessor<Long, Row, Tuple2<Long, Long>> {
        private transient ValueState<Long> sum;

        @Override
        public void init(OutputMode outputMode, TimeMode timeMode) {
            sum = getHandle().getValueState("sum", Encoders.LONG(), TTLConfig.NONE());
        }

        @Override
        public Iterator<Tuple2<Long, Long>> handleInputRows(Long key, Iterator<Row> rows, TimerValues timerValues) {
            ArrayList<Tuple2<Long, Long>> out = new ArrayList<>();
            while (rows.hasNext()) {
                Row row = rows.next();
                Long current = sum.get();   // null for a key without state
                long next = (current == null ? 0L : current) + row.getLong(1);
                sum.update(next);
                out.add(new Tuple2<>(key, next));
            }
            return CollectionConverters.asScala(out.iterator());
        }
    }

    public static StreamingQuery start(SparkSession spark, String source, String checkpoint, String output,
                                       long triggerMs) throws TimeoutException {
        Dataset<Row> events = spark.readStream().schema("key long, value long, ts long").parquet(source);
        Dataset<Tuple2<Long, Long>> sums = events
                .groupByKey((MapFunction<Row, Long>) r -> r.getLong(0), Encoders.LONG())
                .transformWithState(new RunningSum(), TimeMode.None(), OutputMode.Append(),
                        Encoders.tuple(Encoders.LONG(), Encoders.LONG()));
        return sums.toDF("key", "sum").writeStream()
                .format("parquet")
                .option("checkpointLocation", checkpoint)
                .option("path", output)
                .outputMode("append")
                .trigger(Trigger.ProcessingTime(triggerMs))
                .start();
    }
}
