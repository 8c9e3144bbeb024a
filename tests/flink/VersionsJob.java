import java.io.IOException;
import java.io.OutputStream;
import java.lang.reflect.Method;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.StandardCopyOption;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.atomic.AtomicLong;
import java.util.stream.Stream;

import org.apache.flink.api.common.functions.ReduceFunction;
import org.apache.flink.api.common.functions.RuntimeContext;
import org.apache.flink.api.common.state.BroadcastState;
import org.apache.flink.api.common.state.KeyedStateStore;
import org.apache.flink.api.common.state.ListState;
import org.apache.flink.api.common.state.ListStateDescriptor;
import org.apache.flink.api.common.state.MapState;
import org.apache.flink.api.common.state.MapStateDescriptor;
import org.apache.flink.api.common.state.ReducingState;
import org.apache.flink.api.common.state.ReducingStateDescriptor;
import org.apache.flink.api.common.state.State;
import org.apache.flink.api.common.state.StateDescriptor;
import org.apache.flink.api.common.state.StateTtlConfig;
import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.common.typeutils.base.LongSerializer;
import org.apache.flink.api.java.tuple.Tuple;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.api.java.tuple.Tuple3;
import org.apache.flink.api.java.typeutils.RowTypeInfo;
import org.apache.flink.api.java.typeutils.runtime.NullableSerializer;
import org.apache.flink.configuration.CheckpointingOptions;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.MemorySize;
import org.apache.flink.configuration.StateBackendOptions;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.core.execution.SavepointFormatType;
import org.apache.flink.runtime.state.FunctionInitializationContext;
import org.apache.flink.runtime.state.FunctionSnapshotContext;
import org.apache.flink.runtime.state.VoidNamespace;
import org.apache.flink.runtime.state.VoidNamespaceSerializer;
import org.apache.flink.streaming.api.checkpoint.CheckpointedFunction;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.streaming.api.operators.InternalTimerService;
import org.apache.flink.streaming.api.operators.KeyedProcessOperator;
import org.apache.flink.types.Row;
import org.apache.flink.util.Collector;

/**
 * Flink savepoints of every Flink version keygroups reads (tests/flink/README.md): one source file that compiles
 * against Flink 1.15 to 2.3. It uses only API both lines share (no open(), no legacy SourceFunction, whose package
 * moved in 2.0: the records come through socketTextStream from a socket this JVM serves) and reflection where they
 * differ (StateTtlConfig.newBuilder(Time|Duration), the subtask index).
 *
 * <pre>
 * write OUT_DIR PARALLELISM MAX_PARALLELISM COMPRESSION(true|false) KEYS BACKEND(hashmap|rocksdb) INLINE(true|false)
 * check SAVEPOINT_DIR PARALLELISM EXPECTED DUMP_DIR
 * </pre>
 *
 * takes a canonical savepoint into OUT_DIR/savepoint and writes OUT_DIR/expected.txt in SavepointJob's
 * format: keyed STATE KEY VALUE | timer event|processing KEY TS | split STATE ELEM | union STATE ELEM |
 * broadcast STATE K V. The keyed operator has uid "keyed" and Long keys. `check` restores the savepoint into the same
 * operator at PARALLELISM, lists every key of every state, every timer and every operator-state element it restored
 * (DUMP_DIR/restored.txt) and exits 0 when that equals EXPECTED, 1 (naming the first differences) when not.
 */
public class VersionsJob {

    static final String UID = "keyed";
    static final long EVENT_TIMER_BASE = 1_000_000L;
    static final long PROCESSING_TIMER_BASE = 4_000_000_000_000L; // year 2096: never fires
    static final AtomicLong PROCESSED = new AtomicLong();

    // ---------------------------------------------------------------------------------------------- the state

    /** StateTtlConfig.newBuilder(Duration) from Flink 1.19, newBuilder(Time) before (Time is gone in 2.0). */
    static StateTtlConfig ttl() {
        try {
            Object b;
            try {
                b = StateTtlConfig.class.getMethod("newBuilder", java.time.Duration.class)
                        .invoke(null, java.time.Duration.ofDays(3650));
            } catch (NoSuchMethodException e) {
                Class<?> time = Class.forName("org.apache.flink.api.common.time.Time");
                Object days = time.getMethod("days", long.class).invoke(null, 3650L);
                b = StateTtlConfig.class.getMethod("newBuilder", time).invoke(null, days);
            }
            return (StateTtlConfig) b.getClass().getMethod("build").invoke(b);
        } catch (ReflectiveOperationException e) {
            throw new IllegalStateException(e);
        }
    }

    /** getTaskInfo().getIndexOfThisSubtask() from Flink 1.19, getIndexOfThisSubtask() before (gone in 2.0). */
    static int subtaskIndex(RuntimeContext ctx) {
        try {
            try {
                Object info = RuntimeContext.class.getMethod("getTaskInfo").invoke(ctx);
                return (Integer) info.getClass().getMethod("getIndexOfThisSubtask").invoke(info);
            } catch (NoSuchMethodException e) {
                return (Integer) RuntimeContext.class.getMethod("getIndexOfThisSubtask").invoke(ctx);
            }
        } catch (ReflectiveOperationException e) {
            throw new IllegalStateException(e);
        }
    }

    @SuppressWarnings({"unchecked", "rawtypes"})
    static List<StateDescriptor<?, ?>> descriptors() {
        List<StateDescriptor<?, ?>> d = new ArrayList<>();
        d.add(new ValueStateDescriptor<>("long", Types.LONG));
        d.add(new ValueStateDescriptor<>("int", Types.INT));
        d.add(new ValueStateDescriptor<>("short", Types.SHORT));
        d.add(new ValueStateDescriptor<>("byte", Types.BYTE));
        d.add(new ValueStateDescriptor<>("double", Types.DOUBLE));
        d.add(new ValueStateDescriptor<>("float", Types.FLOAT));
        d.add(new ValueStateDescriptor<>("bool", Types.BOOLEAN));
        d.add(new ValueStateDescriptor<>("char", Types.CHAR));
        d.add(new ValueStateDescriptor<>("string", Types.STRING));
        d.add(new ValueStateDescriptor<>("bytes", Types.PRIMITIVE_ARRAY(Types.BYTE)));
        d.add(new ValueStateDescriptor<>("tuple2", Types.TUPLE(Types.LONG, Types.STRING)));
        d.add(new ValueStateDescriptor<>("tuple3", Types.TUPLE(Types.INT, Types.DOUBLE, Types.BOOLEAN)));
        d.add(new ValueStateDescriptor<>("row", (TypeInformation) new RowTypeInfo(Types.LONG, Types.STRING)));
        // 10 fields (a two-byte null mask after the RowKind bits), nested types too
        d.add(new ValueStateDescriptor<>("row_nested", (TypeInformation) new RowTypeInfo(
                Types.INT, Types.SHORT, Types.BYTE, Types.FLOAT, Types.CHAR, Types.PRIMITIVE_ARRAY(Types.BYTE),
                Types.LIST(Types.LONG), Types.MAP(Types.STRING, Types.LONG), Types.TUPLE(Types.LONG, Types.STRING),
                Types.ROW(Types.LONG, Types.STRING))));
        d.add(new ValueStateDescriptor<>("nullable", NullableSerializer.wrap(LongSerializer.INSTANCE, false)));
        d.add(new ListStateDescriptor<>("list", Types.LONG));
        d.add(new ListStateDescriptor<>("list_str", Types.STRING));
        d.add(new MapStateDescriptor<>("map", Types.STRING, Types.LONG));
        d.add(new ReducingStateDescriptor<>("reducing", (ReduceFunction<Long>) Long::sum, Types.LONG));
        ValueStateDescriptor<Long> ttlValue = new ValueStateDescriptor<>("ttl_value", Types.LONG);
        ttlValue.enableTimeToLive(ttl());
        d.add(ttlValue);
        ListStateDescriptor<String> ttlList = new ListStateDescriptor<>("ttl_list", Types.STRING);
        ttlList.enableTimeToLive(ttl());
        d.add(ttlList);
        MapStateDescriptor<String, Long> ttlMap = new MapStateDescriptor<>("ttl_map", Types.STRING, Types.LONG);
        ttlMap.enableTimeToLive(ttl());
        d.add(ttlMap);
        return d;
    }

    /** Key n holds state i unless (n + i) % 5 == 0. */
    static boolean has(long n, int state) {
        return (n + state) % 5 != 0;
    }

    static long key(long n) {
        return n * 7919L - 50_000L;
    }

    /** The value of state `name` for key n (a list for list states, a TreeMap for map states). */
    static Object value(String name, long n, long keys) {
        long m = n - keys / 2;
        switch (name) {
            case "long": return m * 1_000_000_007L;
            case "int": return (int) (m * 10007);
            case "short": return (short) (m * 7);
            case "byte": return (byte) m;
            case "float": return n % 4 == 0 ? -0.0f : m * 0.5f;
            case "char": return n % 3 == 0 ? '\u4e2d' : (char) ('A' + n);
            case "bytes": {
                byte[] b = new byte[(int) (n % 4)];
                for (int i = 0; i < b.length; i++) b[i] = (byte) ((n + i) * 37);
                return b;
            }
            case "tuple3": return Tuple3.of((int) n, n * 1.5, n % 2 == 1);
            case "row_nested": {
                Map<String, Long> map = new TreeMap<>();
                map.put("k" + n % 3, n % 4 == 0 ? null : n);   // a null map value inside a Row is fine
                Row r = Row.of((int) m, (short) n, (byte) -n, m * 0.5f, (char) ('a' + n), new byte[] {(byte) n, 7},
                        List.of(m, m + 1), map, Tuple2.of(m, "w" + n), Row.of(n, n % 3 == 0 ? null : "v" + n));
                for (int i = 0; i < r.getArity(); i++) {
                    if ((n + i) % 6 == 0) r.setField(i, null);
                }
                return r;
            }
            case "nullable": return m;
            case "list_str": return List.of("x" + n, "\uD83D\uDE00");
            case "double":
                if (n % 7 == 0) return Double.NaN;
                if (n % 4 == 0) return -0.0d;
                return m * 0.25 + 1e-3;
            case "bool": return n % 2 == 0;
            case "string": return n % 6 == 0 ? "" : "s" + n + (n % 3 == 0 ? "\uD83D\uDE00" : "") + (n % 4 == 1 ? "\u00e9\u4e2d" : "");
            case "tuple2": return Tuple2.of(m * 3L, "t" + n);
            case "row": return Row.of(m, n % 4 == 0 ? null : "r" + n);
            case "list": {
                List<Long> l = new ArrayList<>();
                for (long i = 0; i <= n % 4; i++) l.add(m + i);
                return l;
            }
            case "map": {
                Map<String, Long> map = new TreeMap<>();
                map.put("a", n);
                map.put("\uD83D\uDE00" + (n % 2), -n);
                return map;
            }
            case "reducing": return n + 1;   // add(n) then add(1)
            case "ttl_value": return n * 5;
            case "ttl_list": return List.of("a" + n, "b");
            case "ttl_map": return new TreeMap<>(Map.of("k", n));
            default: throw new IllegalArgumentException(name);
        }
    }

    static List<Long> eventTimers(long n) {
        return n % 3 == 0 ? List.of(EVENT_TIMER_BASE + n * 10, EVENT_TIMER_BASE + n * 10 + 1)
                          : List.of(EVENT_TIMER_BASE + n * 10);
    }

    static long processingTimer(long n) {
        return PROCESSING_TIMER_BASE + n;
    }

    static List<Long> splitElements(int subtask) {
        List<Long> l = new ArrayList<>();
        for (int j = 0; j <= subtask; j++) l.add(subtask * 100L + j);
        return l;
    }

    static List<String> unionElements(int subtask) {
        return List.of("u" + subtask + "-0", "u" + subtask + "-\uD83D\uDE00");
    }

    static Map<String, Long> broadcastEntries() {
        return new TreeMap<>(Map.of("a", 1L, "b", -2L));
    }

    // ---------------------------------------------------------------------------------------------- the function

    /** Writes every state for each record (a record is the number n of its key). */
    public static class StateFunction extends KeyedProcessFunction<Long, Long, Long> implements CheckpointedFunction {
        final long keys;
        transient List<State> states;
        transient ListState<Long> split;
        transient ListState<String> union;
        transient BroadcastState<String, Long> broadcast;
        transient List<String> restoredOperatorLines;

        public StateFunction(long keys) {
            this.keys = keys;
        }

        @SuppressWarnings("unchecked")
        static State getState(KeyedStateStore store, StateDescriptor<?, ?> d) {
            if (d instanceof ValueStateDescriptor) return store.getState((ValueStateDescriptor<Object>) d);
            if (d instanceof ListStateDescriptor) return store.getListState((ListStateDescriptor<Object>) d);
            if (d instanceof MapStateDescriptor) return store.getMapState((MapStateDescriptor<Object, Object>) d);
            return store.getReducingState((ReducingStateDescriptor<Object>) d);
        }

        @Override
        @SuppressWarnings("unchecked")
        public void processElement(Long n, Context ctx, Collector<Long> out) throws Exception {
            List<StateDescriptor<?, ?>> ds = descriptors();
            for (int i = 0; i < ds.size(); i++) {
                if (!has(n, i)) continue;
                Object v = value(ds.get(i).getName(), n, keys);
                State s = states.get(i);
                if (s instanceof ValueState) ((ValueState<Object>) s).update(v);
                else if (s instanceof ListState) ((ListState<Object>) s).update((List<Object>) v);
                else if (s instanceof MapState) ((MapState<Object, Object>) s).putAll((Map<Object, Object>) v);
                else {
                    ((ReducingState<Long>) s).add(n);
                    ((ReducingState<Long>) s).add(1L);
                }
            }
            for (long t : eventTimers(n)) ctx.timerService().registerEventTimeTimer(t);
            ctx.timerService().registerProcessingTimeTimer(processingTimer(n));
            PROCESSED.incrementAndGet();
        }

        @Override
        public void snapshotState(FunctionSnapshotContext ctx) throws Exception {
            if (restoredOperatorLines != null) return;   // a checking job keeps what it restored
            int subtask = subtaskIndex(getRuntimeContext());
            split.update(splitElements(subtask));
            union.update(unionElements(subtask));
            broadcast.putAll(broadcastEntries());
        }

        @Override
        public void initializeState(FunctionInitializationContext ctx) throws Exception {
            states = new ArrayList<>();
            for (StateDescriptor<?, ?> d : descriptors()) states.add(getState(ctx.getKeyedStateStore(), d));
            split = ctx.getOperatorStateStore().getListState(new ListStateDescriptor<>("op_split", Types.LONG));
            union = ctx.getOperatorStateStore().getUnionListState(new ListStateDescriptor<>("op_union", Types.STRING));
            broadcast = ctx.getOperatorStateStore().getBroadcastState(
                    new MapStateDescriptor<>("op_broadcast", Types.STRING, Types.LONG));
            if (ctx.isRestored()) {
                restoredOperatorLines = new ArrayList<>();
                for (Long e : split.get()) restoredOperatorLines.add("split\top_split\t" + Json.of(e));
                for (String e : union.get()) restoredOperatorLines.add("union\top_union\t" + Json.of(e));
                for (Map.Entry<String, Long> e : broadcast.entries()) {
                    restoredOperatorLines.add("broadcast\top_broadcast\t" + Json.of(e.getKey()) + "\t"
                            + Json.of(e.getValue()));
                }
            }
        }
    }

    /** The same operator as `process(StateFunction)`, which lists everything it restored when it opens. */
    public static class DumpingOperator extends KeyedProcessOperator<Long, Long, Long> {
        final String dumpDir;

        DumpingOperator(StateFunction fn, String dumpDir) {
            super(fn);
            this.dumpDir = dumpDir;
        }

        @Override
        @SuppressWarnings({"unchecked", "rawtypes"})
        public void open() throws Exception {
            super.open();
            List<String> lines = new ArrayList<>();
            for (StateDescriptor<?, ?> d : descriptors()) {
                String name = d.getName();
                getKeyedStateBackend().applyToAllKeys(VoidNamespace.INSTANCE, VoidNamespaceSerializer.INSTANCE,
                        (StateDescriptor) d, (k, s) -> {
                            Object v;
                            if (s instanceof ValueState) v = ((ValueState<?>) s).value();
                            else if (s instanceof ListState) {
                                List<Object> l = new ArrayList<>();
                                for (Object e : ((ListState<?>) s).get()) l.add(e);
                                v = l;
                            } else if (s instanceof MapState) {
                                Map<Object, Object> map = new TreeMap<>();
                                for (Map.Entry<?, ?> e : ((MapState<?, ?>) s).entries()) map.put(e.getKey(), e.getValue());
                                v = map;
                            } else v = ((ReducingState<?>) s).get();
                            if (v != null) lines.add("keyed\t" + name + "\t" + Json.of(k) + "\t" + Json.of(v));
                        });
            }
            InternalTimerService<VoidNamespace> timers =
                    getInternalTimerService("user-timers", VoidNamespaceSerializer.INSTANCE, this);
            timers.forEachEventTimeTimer((ns, t) -> lines.add("timer\tevent\t" + Json.of(getCurrentKey()) + "\t" + t));
            timers.forEachProcessingTimeTimer(
                    (ns, t) -> lines.add("timer\tprocessing\t" + Json.of(getCurrentKey()) + "\t" + t));
            List<String> operator = ((StateFunction) userFunction).restoredOperatorLines;
            if (operator != null) lines.addAll(operator);
            int subtask = subtaskIndex(getRuntimeContext());
            Path tmp = Paths.get(dumpDir, "subtask-" + subtask + ".partial");
            Files.write(tmp, lines, StandardCharsets.UTF_8);   // then renamed: the checker never sees half of it
            Files.move(tmp, Paths.get(dumpDir, "subtask-" + subtask + ".txt"), StandardCopyOption.ATOMIC_MOVE);
        }
    }

    // ---------------------------------------------------------------------------------------------- canonical lines

    /** JSON exactly as Python's json.dumps(v, ensure_ascii=True, separators=(",", ":")) writes it (as SavepointJob). */
    static final class Json {
        static String of(Object v) {
            StringBuilder b = new StringBuilder();
            write(b, v);
            return b.toString();
        }

        static void write(StringBuilder b, Object v) {
            if (v == null) b.append("null");
            else if (v instanceof Double) b.append("\"d:").append(String.format("%016x", Double.doubleToRawLongBits((Double) v))).append('"');
            else if (v instanceof Float) b.append("\"f:").append(String.format("%08x", Float.floatToRawIntBits((Float) v))).append('"');
            else if (v instanceof Long || v instanceof Integer || v instanceof Short || v instanceof Byte) b.append(v);
            else if (v instanceof Boolean) b.append(v);
            else if (v instanceof Character) string(b, String.valueOf(v));
            else if (v instanceof String) string(b, (String) v);
            else if (v instanceof byte[]) {
                StringBuilder h = new StringBuilder("b:");
                for (byte x : (byte[]) v) h.append(String.format("%02x", x & 0xff));
                string(b, h.toString());
            }
            else if (v instanceof Tuple) {
                Tuple t = (Tuple) v;
                List<Object> l = new ArrayList<>();
                for (int i = 0; i < t.getArity(); i++) l.add(t.getField(i));
                write(b, l);
            } else if (v instanceof Row) {
                Row r = (Row) v;
                List<Object> l = new ArrayList<>();
                for (int i = 0; i < r.getArity(); i++) l.add(r.getField(i));
                write(b, l);
            } else if (v instanceof List) {
                b.append('[');
                boolean first = true;
                for (Object e : (List<?>) v) {
                    if (!first) b.append(',');
                    first = false;
                    write(b, e);
                }
                b.append(']');
            } else if (v instanceof Map) {
                List<String> entries = new ArrayList<>();   // [[key, value], ...] sorted by the key's JSON text
                for (Map.Entry<?, ?> e : ((Map<?, ?>) v).entrySet()) {
                    entries.add("[" + of(e.getKey()) + "," + of(e.getValue()) + "]");
                }
                Collections.sort(entries);
                b.append('[').append(String.join(",", entries)).append(']');
            } else throw new IllegalArgumentException("no canonical form for " + v.getClass());
        }

        static void string(StringBuilder b, String s) {
            b.append('"');
            for (int i = 0; i < s.length(); i++) {
                char c = s.charAt(i);
                if (c == '"') b.append("\\\"");
                else if (c == '\\') b.append("\\\\");
                else if (c < 0x20 || c > 0x7e) b.append(String.format("\\u%04x", (int) c));
                else b.append(c);
            }
            b.append('"');
        }
    }

    static List<String> expectedLines(long keys, int parallelism) {
        List<String> lines = new ArrayList<>();
        List<StateDescriptor<?, ?>> ds = descriptors();
        for (long n = 0; n < keys; n++) {
            String k = Json.of(key(n));
            for (int i = 0; i < ds.size(); i++) {
                if (has(n, i)) {
                    String name = ds.get(i).getName();
                    lines.add("keyed\t" + name + "\t" + k + "\t" + Json.of(value(name, n, keys)));
                }
            }
            for (long t : eventTimers(n)) lines.add("timer\tevent\t" + k + "\t" + t);
            lines.add("timer\tprocessing\t" + k + "\t" + processingTimer(n));
        }
        for (int s = 0; s < parallelism; s++) {
            for (Long e : splitElements(s)) lines.add("split\top_split\t" + Json.of(e));
            for (String e : unionElements(s)) lines.add("union\top_union\t" + Json.of(e));
        }
        for (Map.Entry<String, Long> e : broadcastEntries().entrySet()) {
            lines.add("broadcast\top_broadcast\t" + Json.of(e.getKey()) + "\t" + Json.of(e.getValue()));
        }
        Collections.sort(lines);
        return lines;
    }

    // ---------------------------------------------------------------------------------------------- the job

    /** Serves "0\n1\n...\n" to the one connection socketTextStream opens, then keeps it open (an endless source). */
    static ServerSocket serveNumbers(long keys) throws IOException {
        ServerSocket server = new ServerSocket(0, 1, InetAddress.getLoopbackAddress());
        Thread t = new Thread(() -> {
            try (Socket s = server.accept(); OutputStream out = s.getOutputStream()) {
                StringBuilder b = new StringBuilder();
                for (long n = 0; n < keys; n++) b.append(n).append('\n');
                out.write(b.toString().getBytes(StandardCharsets.UTF_8));
                out.flush();
                while (s.getInputStream().read() >= 0) { /* until the source closes it */ }
            } catch (IOException ignored) {
                // the job stopped
            }
        }, "numbers");
        t.setDaemon(true);
        t.start();
        return server;
    }

    static void write(String[] a) throws Exception {
        Path out = Paths.get(a[1]).toAbsolutePath();
        int parallelism = Integer.parseInt(a[2]);
        int maxParallelism = Integer.parseInt(a[3]);
        boolean compression = Boolean.parseBoolean(a[4]);
        long keys = Long.parseLong(a[5]);
        String backend = a[6];
        boolean inline = Boolean.parseBoolean(a[7]);

        Configuration conf = new Configuration();
        conf.set(StateBackendOptions.STATE_BACKEND, backend);
        conf.set(CheckpointingOptions.CHECKPOINT_STORAGE, "filesystem");
        conf.set(CheckpointingOptions.CHECKPOINTS_DIRECTORY, Files.createTempDirectory("keygroups-flink-chk").toUri().toString());
        conf.set(CheckpointingOptions.FS_SMALL_FILE_THRESHOLD, inline ? MemorySize.parse("1mb") : MemorySize.ZERO);
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(parallelism);
        env.setMaxParallelism(maxParallelism);
        env.getConfig().setUseSnapshotCompression(compression);
        ServerSocket server = serveNumbers(keys);
        env.socketTextStream(server.getInetAddress().getHostAddress(), server.getLocalPort()).uid("source")
                .map(Long::parseLong).returns(Types.LONG).setParallelism(1).uid("parse")
                .keyBy(n -> key(n), Types.LONG)
                .process(new StateFunction(keys), Types.LONG).uid(UID).name("keyed state")
                .print().uid("sink");
        JobClient job = env.executeAsync("keygroups versions savepoint writer");
        java.util.concurrent.CompletableFuture<?> result = job.getJobExecutionResult();
        long deadline = System.currentTimeMillis() + 120_000;
        while (PROCESSED.get() < keys) {
            if (result.isDone()) result.get();   // throws the job's failure
            if (System.currentTimeMillis() > deadline) throw new IllegalStateException("records not processed in time");
            Thread.sleep(20);
        }
        Path tmp = Files.createTempDirectory("keygroups-flink-savepoint");
        // a triggered savepoint, then cancel: Flink 1.15-1.17 fail a stop-with-savepoint of the socket source
        // (stopping it closes the socket under its reading thread); the savepoint's format is the same
        String savepoint = job.triggerSavepoint(tmp.toUri().toString(), SavepointFormatType.CANONICAL).get();
        job.cancel().get();
        server.close();
        Path target = out.resolve("savepoint");
        Files.createDirectories(target);
        Path from = Paths.get(java.net.URI.create(savepoint.startsWith("file:") ? savepoint : "file:" + savepoint));
        try (Stream<Path> files = Files.list(from)) {
            for (Path f : (Iterable<Path>) files::iterator) {
                Files.move(f, target.resolve(f.getFileName()), StandardCopyOption.REPLACE_EXISTING);
            }
        }
        Files.write(out.resolve("expected.txt"), expectedLines(keys, parallelism), StandardCharsets.UTF_8);
        System.out.println("savepoint " + target);
    }

    static int check(String[] a) throws Exception {
        String savepoint = Paths.get(a[1]).toAbsolutePath().toString();
        int parallelism = Integer.parseInt(a[2]);
        List<String> expected = new ArrayList<>(Files.readAllLines(Paths.get(a[3]), StandardCharsets.UTF_8));
        Path dumpDir = Paths.get(a[4]).toAbsolutePath();
        Files.createDirectories(dumpDir);

        Configuration conf = new Configuration();
        // the option's key before Flink 2.0, and from 2.0 on
        for (String prefix : List.of("execution.savepoint.", "execution.state-recovery.")) {
            conf.setString(prefix + "path", savepoint);
            conf.setString(prefix + "ignore-unclaimed-state", "true");
        }
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(parallelism);
        ServerSocket server = serveNumbers(0);   // no records; cancelled once every subtask listed what it restored
        env.socketTextStream(server.getInetAddress().getHostAddress(), server.getLocalPort()).uid("check-source")
                .map(Long::parseLong).returns(Types.LONG).setParallelism(1).uid("check-parse")
                .keyBy(n -> key(n), Types.LONG)
                .transform("keyed state", Types.LONG, new DumpingOperator(new StateFunction(0), dumpDir.toString()))
                .uid(UID).print().uid("sink");
        JobClient job = env.executeAsync("keygroups versions savepoint checker");
        java.util.concurrent.CompletableFuture<?> result = job.getJobExecutionResult();
        long deadline = System.currentTimeMillis() + 120_000;
        while (!allDumped(dumpDir, parallelism)) {
            if (result.isDone()) result.get();   // throws the job's failure
            if (System.currentTimeMillis() > deadline) throw new IllegalStateException("nothing restored in time");
            Thread.sleep(20);
        }
        job.cancel().get();
        server.close();

        List<String> restored = new ArrayList<>();
        List<String> unionSeen = null;
        List<String> broadcastSeen = null;
        for (int s = 0; s < parallelism; s++) {
            List<String> union = new ArrayList<>();
            List<String> broadcast = new ArrayList<>();
            for (String line : Files.readAllLines(dumpDir.resolve("subtask-" + s + ".txt"), StandardCharsets.UTF_8)) {
                if (line.startsWith("union\t")) union.add(line);
                else if (line.startsWith("broadcast\t")) broadcast.add(line);
                else restored.add(line);
            }
            Collections.sort(union);
            Collections.sort(broadcast);
            // every subtask restores the whole union list and the same broadcast state
            if (unionSeen != null && !unionSeen.equals(union)) restored.add("! subtask " + s + " union differs " + union);
            if (broadcastSeen != null && !broadcastSeen.equals(broadcast)) restored.add("! subtask " + s + " broadcast differs");
            unionSeen = union;
            broadcastSeen = broadcast;
        }
        restored.addAll(unionSeen);
        restored.addAll(broadcastSeen);
        Collections.sort(restored);
        Collections.sort(expected);
        Files.write(dumpDir.resolve("restored.txt"), restored, StandardCharsets.UTF_8);
        if (restored.equals(expected)) {
            System.out.println("OK " + restored.size() + " lines restored as expected");
            return 0;
        }
        List<String> missing = new ArrayList<>(expected);
        missing.removeAll(new java.util.HashSet<>(restored));
        List<String> extra = new ArrayList<>(restored);
        extra.removeAll(new java.util.HashSet<>(expected));
        System.out.println("MISMATCH expected " + expected.size() + " lines, restored " + restored.size());
        for (String l : missing.subList(0, Math.min(10, missing.size()))) System.out.println("missing: " + l);
        for (String l : extra.subList(0, Math.min(10, extra.size()))) System.out.println("unexpected: " + l);
        return 1;
    }

    static boolean allDumped(Path dumpDir, int parallelism) {
        for (int s = 0; s < parallelism; s++) {
            if (!Files.exists(dumpDir.resolve("subtask-" + s + ".txt"))) return false;
        }
        return true;
    }

    public static void main(String[] a) throws Exception {
        if (a.length == 8 && a[0].equals("write")) {
            write(a);
            System.exit(0);
        }
        if (a.length == 5 && a[0].equals("check")) {
            System.exit(check(a));
        }
        System.err.println("usage: write OUT P MAXP COMPRESSION KEYS hashmap|rocksdb INLINE | check SAVEPOINT P EXPECTED DUMP_DIR");
        System.exit(2);
    }
}
