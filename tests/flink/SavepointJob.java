import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.StandardCopyOption;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.stream.Stream;

import org.apache.flink.api.common.functions.ReduceFunction;
import org.apache.flink.api.common.state.BroadcastState;
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
import org.apache.flink.api.java.functions.KeySelector;
import org.apache.flink.api.java.tuple.Tuple;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.api.java.tuple.Tuple3;
import org.apache.flink.api.java.typeutils.RowTypeInfo;
import org.apache.flink.api.java.typeutils.runtime.NullableSerializer;
import org.apache.flink.configuration.CheckpointingOptions;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.MemorySize;
import org.apache.flink.configuration.StateBackendOptions;
import org.apache.flink.configuration.StateRecoveryOptions;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.core.execution.SavepointFormatType;
import org.apache.flink.runtime.state.FunctionInitializationContext;
import org.apache.flink.runtime.state.FunctionSnapshotContext;
import org.apache.flink.runtime.state.VoidNamespace;
import org.apache.flink.runtime.state.VoidNamespaceSerializer;
import org.apache.flink.streaming.api.checkpoint.CheckpointedFunction;
import org.apache.flink.streaming.api.datastream.KeyedStream;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.streaming.api.functions.sink.v2.DiscardingSink;
import org.apache.flink.streaming.api.functions.source.legacy.RichSourceFunction;
import org.apache.flink.streaming.api.operators.InternalTimerService;
import org.apache.flink.streaming.api.operators.KeyedProcessOperator;
import org.apache.flink.types.Row;

/**
 * Ground truth for keygroups' Flink savepoint reader and writer (tests/flink/README.md).
 *
 * <pre>
 * write OUT_DIR PARALLELISM MAX_PARALLELISM COMPRESSION(true|false) KEYS KEY_TYPE(long|string|tuple) BACKEND(hashmap|rocksdb) INLINE(true|false)
 *     runs a job whose operator "keyed" holds keyed state of every supported type, timers and operator state
 *     (split, union, broadcast), stops it with a canonical savepoint into OUT_DIR/savepoint and writes
 *     OUT_DIR/expected.txt: every entry, timer and operator-state element, one canonical line each.
 * restore SAVEPOINT_DIR|- PARALLELISM KEY_TYPE BACKEND
 *     restores the savepoint (or nothing) into the job and prints the job's net runtime (for benchmarks).
 * windows SAVEPOINT_DIR PARALLELISM KEY_TYPE OUT_FILE
 *     restores the savepoint's window operator uid("window") (10 s tumbling event-time windows, Long::sum) at
 *     PARALLELISM with a source that ends at once, so the final watermark fires every restored window; writes one
 *     line per firing to OUT_FILE, sorted: KEY START END SUM (KEY as JSON).
 * window-records SAVEPOINT_DIR PARALLELISM LATENESS_MS OUT_FILE
 *     the same for a process window function over Tuple3(key, t, n) records keyed by f0 (operator uid("w"),
 *     window-contents a ListState of the records) with allowed lateness LATENESS_MS: KEY START END SUM(n) COUNT.
 * write-sessions OUT_DIR PARALLELISM KEYS
 *     runs event-time session windows (gap 3 s, Long::sum, operator uid("sessions")) over records n = 0..KEYS-1,
 *     keyed by n % 4 at event time sessionTime(n) (two sessions per key, each merged from several records), never
 *     fired, and stops with a canonical savepoint into OUT_DIR/savepoint.
 * sessions SAVEPOINT_DIR PARALLELISM OUT_FILE
 *     restores that operator and fires every session it restored: KEY START END SUM lines, as `windows` does.
 * check SAVEPOINT_DIR PARALLELISM KEY_TYPE EXPECTED DUMP_DIR
 *     restores the savepoint into the same operator at PARALLELISM, lists everything it restored (every key of
 *     every state, every timer, every operator-state element) into DUMP_DIR/restored.txt and compares it with
 *     EXPECTED; exit status 0 when equal, 1 (with the first differences) when not.
 * </pre>
 *
 * Lines (sorted, tab-separated, JSON values as Python's json.dumps(ensure_ascii=True, separators=(",", ":"))
 * writes them; doubles and floats as "d:"/"f:" + hex of their raw bits, byte[] as "b:" + hex):
 * keyed STATE KEY VALUE | timer event|processing KEY TIMESTAMP | split STATE ELEMENT | union STATE ELEMENT |
 * broadcast STATE KEY VALUE. TTL states list their values (Flink's API hides the TTL timestamps).
 */
public class SavepointJob {

    static final String UID = "keyed";
    static final String SOURCE_UID = "source";
    static final long EVENT_TIMER_BASE = 1_000_000L;
    static final long PROCESSING_TIMER_BASE = 4_000_000_000_000L; // year 2096: never fires during a test
    static final AtomicLong PROCESSED = new AtomicLong();
    static final AtomicLong WINDOW_PROCESSED = new AtomicLong();

    // ---------------------------------------------------------------------------------------------- the state

    static StateTtlConfig ttl() {
        return StateTtlConfig.newBuilder(Duration.ofDays(3650)).build();
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
        // 13 fields: a two-byte null mask after the RowKind bits; every field type a Row maps, nested ones too
        d.add(new ValueStateDescriptor<>("row_wide", (TypeInformation) new RowTypeInfo(
                Types.INT, Types.SHORT, Types.BYTE, Types.FLOAT, Types.DOUBLE, Types.BOOLEAN, Types.CHAR, Types.STRING,
                Types.PRIMITIVE_ARRAY(Types.BYTE), Types.LIST(Types.LONG), Types.MAP(Types.STRING, Types.LONG),
                Types.TUPLE(Types.LONG, Types.STRING), Types.ROW(Types.LONG, Types.STRING))));
        return d;
    }

    /** Key n of KEYS holds state i unless (n + i) % 6 == 0; m = n - KEYS / 2 makes half the numbers negative. */
    static boolean has(long n, int state) {
        return (n + state) % 6 != 0;
    }

    static Object key(String keyType, long n) {
        if (keyType.equals("long")) {
            return n * 7919L - 50_000L;
        }
        if (keyType.equals("tuple")) {
            return Tuple2.of(n - 7, n % 3 == 0 ? "t\uD83D\uDE00" : "t" + n % 5);
        }
        return "key-" + n + (n % 4 == 0 ? "\uD83D\uDE00" : "") + (n % 9 == 0 ? "\u00e9" : "");
    }

    static String stringValue(long n) {
        if (n % 9 == 0) {
            return "";
        }
        return "s" + n + (n % 3 == 0 ? "\uD83D\uDE00" : "") + (n % 5 == 0 ? "\u0000nul" : "")
                + (n % 7 == 0 ? "\u00e9\u4e2d" : "");
    }

    /** The value of state `name` for key n (a list for list states, a TreeMap for map states). */
    static Object value(String name, long n, long keys) {
        long m = n - keys / 2;
        switch (name) {
            case "long": return m * 1_000_000_007L;
            case "int": return (int) (m * 10007);
            case "short": return (short) (m * 7);
            case "byte": return (byte) m;
            case "double":
                if (n % 13 == 0) return Double.NaN;
                if (n % 17 == 0) return Double.NEGATIVE_INFINITY;
                if (n % 11 == 0) return -0.0d;
                return m * 0.25 + 1e-3;
            case "float": return n % 11 == 0 ? -0.0f : m * 0.5f;
            case "bool": return n % 2 == 0;
            case "char": return n % 10 == 0 ? '\u00e9' : n % 15 == 0 ? '\u4e2d' : (char) ('A' + n % 26);
            case "string": return stringValue(n);
            case "bytes": {
                byte[] b = new byte[(int) (n % 5)];
                for (int i = 0; i < b.length; i++) b[i] = (byte) ((n + i) * 37);
                return b;
            }
            case "tuple2": return Tuple2.of(m * 3L, "t" + n);
            case "tuple3": return Tuple3.of((int) n, n * 1.5, n % 2 == 1);
            case "row": return Row.of(m, n % 4 == 0 ? null : "r" + n);
            case "nullable": return m;
            case "list": {
                List<Long> l = new ArrayList<>();
                for (long i = 0; i <= n % 4; i++) l.add(m + i);
                return l;
            }
            case "list_str": return List.of("x" + n, "\uD83D\uDE00");
            case "map": {
                Map<String, Long> map = new TreeMap<>();
                map.put("a", n);
                map.put("b", -n);   // a null map value breaks heap canonical savepoints (HeapKeyValueStateIterator)
                map.put("\uD83D\uDE00" + (n % 2), n * 2);
                return map;
            }
            case "reducing": return n + 1;   // add(n) then add(1)
            case "ttl_value": return n * 5;
            case "ttl_list": return List.of("a" + n);
            case "ttl_map": return new TreeMap<>(Map.of("k", n));
            case "row_wide": {
                Map<String, Long> map = new TreeMap<>();
                map.put("k" + n % 3, n % 4 == 0 ? null : n);   // a null map value inside a Row is fine
                Row r = Row.of((int) (m * 10007), (short) (m * 7), (byte) m, n % 11 == 0 ? -0.0f : m * 0.5f,
                        n % 13 == 0 ? Double.NaN : m * 0.25, n % 2 == 0, n % 10 == 0 ? '\u4e2d' : (char) ('a' + n % 26),
                        stringValue(n), new byte[] {(byte) n, 7}, List.of(m, m + 1), map, Tuple2.of(m, "w" + n),
                        Row.of(n, n % 3 == 0 ? null : "v" + n));
                for (int i = 0; i < r.getArity(); i++) {
                    if ((n + i) % 7 == 0) r.setField(i, null);
                }
                return r;
            }
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
    public static class StateFunction extends KeyedProcessFunction<Object, Long, Long>
            implements CheckpointedFunction {
        final long keys;
        transient List<State> states;
        transient ListState<Long> split;
        transient ListState<String> union;
        transient BroadcastState<String, Long> broadcast;
        transient List<String> restoredOperatorLines;

        public StateFunction(long keys) {
            this.keys = keys;
        }

        @Override
        public void open(org.apache.flink.api.common.functions.OpenContext ctx) {
            states = new ArrayList<>();
            for (StateDescriptor<?, ?> d : descriptors()) {
                states.add(getState(d));
            }
        }

        @SuppressWarnings("unchecked")
        State getState(StateDescriptor<?, ?> d) {
            if (d instanceof ValueStateDescriptor) return getRuntimeContext().getState((ValueStateDescriptor<Object>) d);
            if (d instanceof ListStateDescriptor) return getRuntimeContext().getListState((ListStateDescriptor<Object>) d);
            if (d instanceof MapStateDescriptor) return getRuntimeContext().getMapState((MapStateDescriptor<Object, Object>) d);
            return getRuntimeContext().getReducingState((ReducingStateDescriptor<Object>) d);
        }

        @Override
        @SuppressWarnings("unchecked")
        public void processElement(Long n, Context ctx, org.apache.flink.util.Collector<Long> out) throws Exception {
            List<StateDescriptor<?, ?>> ds = descriptors();
            for (int i = 0; i < ds.size(); i++) {
                if (!has(n, i)) continue;
                String name = ds.get(i).getName();
                Object v = value(name, n, keys);
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
            int subtask = getRuntimeContext().getTaskInfo().getIndexOfThisSubtask();
            split.update(splitElements(subtask));
            union.update(unionElements(subtask));
            broadcast.putAll(broadcastEntries());
        }

        @Override
        public void initializeState(FunctionInitializationContext ctx) throws Exception {
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

    /** Emits 0..keys-1 once, then idles until cancelled; its split state "source_offset" holds how many it sent. */
    public static class NumberSource extends RichSourceFunction<Long> implements CheckpointedFunction {
        final long keys;
        volatile boolean running = true;
        transient ListState<Long> offset;
        long sent;

        public NumberSource(long keys) {
            this.keys = keys;
        }

        @Override
        public void run(SourceContext<Long> ctx) throws Exception {
            while (running && sent < keys) {
                synchronized (ctx.getCheckpointLock()) {
                    ctx.collect(sent++);
                }
            }
            while (running) Thread.sleep(20);
        }

        @Override
        public void cancel() {
            running = false;
        }

        @Override
        public void snapshotState(FunctionSnapshotContext ctx) throws Exception {
            offset.update(List.of(sent));
        }

        @Override
        public void initializeState(FunctionInitializationContext ctx) throws Exception {
            offset = ctx.getOperatorStateStore().getListState(new ListStateDescriptor<>("source_offset", Types.LONG));
        }
    }

    /** An empty source for the checking job: it only restores. */
    public static class EmptySource extends RichSourceFunction<Long> {
        @Override public void run(SourceContext<Long> ctx) {}
        @Override public void cancel() {}
    }

    /** The same operator as `process(StateFunction)`, which lists everything it restored when it opens. */
    public static class DumpingOperator extends KeyedProcessOperator<Object, Long, Long> {
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
            int subtask = getRuntimeContext().getTaskInfo().getIndexOfThisSubtask();
            Files.write(Paths.get(dumpDir, "subtask-" + subtask + ".txt"), lines, StandardCharsets.UTF_8);
        }
    }

    // ---------------------------------------------------------------------------------------------- canonical lines

    /** JSON exactly as Python's json.dumps(v, ensure_ascii=True, separators=(",", ":")) writes it. */
    static final class Json {
        static String of(Object v) {
            StringBuilder b = new StringBuilder();
            write(b, v);
            return b.toString();
        }

        static void write(StringBuilder b, Object v) {
            if (v == null) b.append("null");
            else if (v instanceof Double) b.append('"').append("d:").append(String.format("%016x", Double.doubleToRawLongBits((Double) v))).append('"');
            else if (v instanceof Float) b.append('"').append("f:").append(String.format("%08x", Float.floatToRawIntBits((Float) v))).append('"');
            else if (v instanceof Long || v instanceof Integer || v instanceof Short || v instanceof Byte) b.append(v);
            else if (v instanceof Boolean) b.append(v);
            else if (v instanceof Character) string(b, String.valueOf(v));
            else if (v instanceof String) string(b, (String) v);
            else if (v instanceof byte[]) {
                StringBuilder h = new StringBuilder("b:");
                for (byte x : (byte[]) v) h.append(String.format("%02x", x & 0xff));
                string(b, h.toString());
            } else if (v instanceof Tuple) {
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
                // [[key, value], ...] sorted by the key's JSON text
                List<String> entries = new ArrayList<>();
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
                switch (c) {
                    case '"': b.append("\\\""); break;
                    case '\\': b.append("\\\\"); break;
                    case '\n': b.append("\\n"); break;
                    case '\r': b.append("\\r"); break;
                    case '\t': b.append("\\t"); break;
                    case '\b': b.append("\\b"); break;
                    case '\f': b.append("\\f"); break;
                    default:
                        if (c < 0x20 || c > 0x7e) b.append(String.format("\\u%04x", (int) c));
                        else b.append(c);
                }
            }
            b.append('"');
        }
    }

    static List<String> expectedLines(long keys, String keyType, int parallelism) {
        List<String> lines = new ArrayList<>();
        List<StateDescriptor<?, ?>> ds = descriptors();
        for (long n = 0; n < keys; n++) {
            String k = Json.of(key(keyType, n));
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

    // ---------------------------------------------------------------------------------------------- the jobs

    static KeySelector<Long, Object> keySelector(String keyType) {
        switch (keyType) {
            case "long": return n -> (Object) key("long", n);
            case "tuple": return n -> (Object) key("tuple", n);
            default: return n -> (Object) key("string", n);
        }
    }

    @SuppressWarnings({"unchecked", "rawtypes"})
    static TypeInformation<Object> keyType(String keyType) {
        switch (keyType) {
            case "long": return (TypeInformation) Types.LONG;
            case "tuple": return (TypeInformation) Types.TUPLE(Types.LONG, Types.STRING);
            default: return (TypeInformation) Types.STRING;
        }
    }

    static void write(String[] a) throws Exception {
        Path out = Paths.get(a[1]).toAbsolutePath();
        int parallelism = Integer.parseInt(a[2]);
        int maxParallelism = Integer.parseInt(a[3]);
        boolean compression = Boolean.parseBoolean(a[4]);
        long keys = Long.parseLong(a[5]);
        String keyType = a[6];
        String backend = a[7];
        boolean inline = Boolean.parseBoolean(a[8]);

        Configuration conf = new Configuration();
        conf.set(StateBackendOptions.STATE_BACKEND, backend);
        // Everything inlined in _metadata, or every chunk in a file of its own (both are what Flink writes).
        conf.set(CheckpointingOptions.CHECKPOINT_STORAGE, "filesystem");
        conf.set(CheckpointingOptions.CHECKPOINTS_DIRECTORY, Files.createTempDirectory("keygroups-flink-chk").toUri().toString());
        conf.set(CheckpointingOptions.FS_SMALL_FILE_THRESHOLD, inline ? MemorySize.parse("1mb") : MemorySize.ZERO);
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(parallelism);
        env.setMaxParallelism(maxParallelism);
        env.getConfig().setUseSnapshotCompression(compression);
        KeyedStream<Long, Object> keyed = env.addSource(new NumberSource(keys), "numbers", Types.LONG)
                .setParallelism(1).uid(SOURCE_UID)
                .keyBy(keySelector(keyType), keyType(keyType));
        keyed.process(new StateFunction(keys), Types.LONG).uid(UID).name("keyed state")
                .sinkTo(new DiscardingSink<>()).uid("sink");
        // window state and window timers (TimeWindow namespaces): record n at event time n * 1000 ms, 10 s
        // tumbling windows that never fire (no watermark), summed per key and window
        env.addSource(new NumberSource(keys), "window numbers", Types.LONG).setParallelism(1).uid("window-source")
                .assignTimestampsAndWatermarks(
                        org.apache.flink.api.common.eventtime.WatermarkStrategy.<Long>noWatermarks()
                                .withTimestampAssigner((n, ts) -> n * 1000))
                .map(n -> {
                    WINDOW_PROCESSED.incrementAndGet();
                    return n;
                }).returns(Types.LONG).uid("window-count")
                .keyBy(keySelector(keyType), keyType(keyType))
                .window(org.apache.flink.streaming.api.windowing.assigners.TumblingEventTimeWindows.of(
                        Duration.ofSeconds(10)))
                .reduce((ReduceFunction<Long>) Long::sum).uid("window").name("window sums")
                .sinkTo(new DiscardingSink<>()).uid("window-sink");
        JobClient job = env.executeAsync("keygroups savepoint writer");
        long deadline = System.currentTimeMillis() + 120_000;
        while (PROCESSED.get() < keys || WINDOW_PROCESSED.get() < keys) {
            if (System.currentTimeMillis() > deadline) throw new IllegalStateException("records not processed in time");
            Thread.sleep(20);
        }
        String savepoint = stopWithSavepoint(job);
        Path target = out.resolve("savepoint");
        Files.createDirectories(out);
        move(Paths.get(java.net.URI.create(savepoint.startsWith("file:") ? savepoint : "file:" + savepoint)), target);
        Files.write(out.resolve("expected.txt"), expectedLines(keys, keyType, parallelism), StandardCharsets.UTF_8);
        System.out.println("savepoint " + target);
    }

    /** Stops the job with a canonical savepoint, within SAVEPOINT_TIMEOUT_S (a savepoint that cannot complete fails
     * the run with a message instead of waiting for Flink's ten-minute checkpoint timeout); its path. */
    static String stopWithSavepoint(JobClient job) throws Exception {
        Path tmp = Files.createTempDirectory("keygroups-flink-savepoint");
        long deadline = System.currentTimeMillis() + SAVEPOINT_TIMEOUT_S * 1000;
        for (int attempt = 1; ; attempt++) {
            System.out.println("records processed; stopping job " + job.getJobID() + " with a savepoint (attempt "
                    + attempt + ")");
            try {
                return job.stopWithSavepoint(false, tmp.toUri().toString(), SavepointFormatType.CANONICAL)
                        .get(Math.max(1, deadline - System.currentTimeMillis()), TimeUnit.MILLISECONDS);
            } catch (java.util.concurrent.TimeoutException e) {
                throw new IllegalStateException("the savepoint of job " + job.getJobID() + " did not complete within "
                        + SAVEPOINT_TIMEOUT_S + " s (job status " + job.getJobStatus().get(10, TimeUnit.SECONDS) + ")");
            } catch (java.util.concurrent.ExecutionException e) {
                // A subtask that received no record yet may still be deploying (a loaded machine): Flink refuses
                // the savepoint until every task runs, and the job goes on; ask again.
                if (!notAllTasksRunning(e) || System.currentTimeMillis() > deadline) throw e;
                Thread.sleep(200);
            }
        }
    }

    static boolean notAllTasksRunning(Throwable e) {
        for (Throwable t = e; t != null; t = t.getCause()) {
            if (t instanceof org.apache.flink.runtime.checkpoint.CheckpointException
                    && ((org.apache.flink.runtime.checkpoint.CheckpointException) t).getCheckpointFailureReason()
                    == org.apache.flink.runtime.checkpoint.CheckpointFailureReason.NOT_ALL_REQUIRED_TASKS_RUNNING) {
                return true;
            }
        }
        return false;
    }

    static final long SAVEPOINT_TIMEOUT_S = 120;

    /** Every thread's stack, as jstack lists them: what a run past its deadline was doing. */
    static String threadDump() {
        StringBuilder b = new StringBuilder();
        for (Map.Entry<Thread, StackTraceElement[]> e : Thread.getAllStackTraces().entrySet()) {
            Thread t = e.getKey();
            b.append('"').append(t.getName()).append("\" ").append(t.getState())
                    .append(t.isDaemon() ? " daemon" : "").append('\n');
            for (StackTraceElement f : e.getValue()) b.append("\tat ").append(f).append('\n');
            b.append('\n');
        }
        return b.toString();
    }

    /** Ends the JVM, whatever it is doing, once a command has run DEADLINE_S seconds (system property
     * keygroups.deadline.s; 240 by default, below the tests' 300 s timeout): it prints every thread's stack first, so
     * that a run that hangs on a loaded machine says where. */
    static void startDeadline(String[] a) {
        long seconds = Long.getLong("keygroups.deadline.s", 240L);
        Thread watchdog = new Thread(() -> {
            try {
                Thread.sleep(seconds * 1000);
            } catch (InterruptedException e) {
                return;
            }
            System.err.println("SavepointJob " + String.join(" ", a) + ": still running after " + seconds
                    + " s; every thread's stack:\n" + threadDump());
            System.err.flush();
            System.out.flush();
            Runtime.getRuntime().halt(3);
        }, "keygroups-deadline");
        watchdog.setDaemon(true);
        watchdog.start();
    }

    static void move(Path from, Path to) throws IOException {
        Files.createDirectories(to);
        try (Stream<Path> files = Files.list(from)) {
            for (Path f : (Iterable<Path>) files::iterator) {
                Files.move(f, to.resolve(f.getFileName()), StandardCopyOption.REPLACE_EXISTING);
            }
        }
    }

    static int check(String[] a) throws Exception {
        String savepoint = Paths.get(a[1]).toAbsolutePath().toString();
        int parallelism = Integer.parseInt(a[2]);
        String keyType = a[3];
        List<String> expected = new ArrayList<>(Files.readAllLines(Paths.get(a[4]), StandardCharsets.UTF_8));
        Path dumpDir = Paths.get(a[5]).toAbsolutePath();
        Files.createDirectories(dumpDir);

        Configuration conf = new Configuration();
        conf.set(StateRecoveryOptions.SAVEPOINT_PATH, savepoint);
        conf.set(StateRecoveryOptions.SAVEPOINT_IGNORE_UNCLAIMED_STATE, true);
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(parallelism);
        KeyedStream<Long, Object> keyed = env.addSource(new EmptySource(), "empty", Types.LONG)
                .setParallelism(1).uid("check-source")
                .keyBy(keySelector(keyType), keyType(keyType));
        keyed.transform("keyed state", Types.LONG, new DumpingOperator(new StateFunction(0), dumpDir.toString()))
                .uid(UID).sinkTo(new DiscardingSink<>()).uid("sink");
        env.execute("keygroups savepoint checker");

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
            if (broadcastSeen != null && !broadcastSeen.equals(broadcast)) restored.add("! subtask " + s + " broadcast differs " + broadcast);
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

    /** Restores SAVEPOINT (or nothing, for "-") into the job and prints its net runtime: Flink's restore cost. */
    static void restore(String[] a) throws Exception {
        Configuration conf = new Configuration();
        if (!a[1].equals("-")) {
            conf.set(StateRecoveryOptions.SAVEPOINT_PATH, Paths.get(a[1]).toAbsolutePath().toString());
            conf.set(StateRecoveryOptions.SAVEPOINT_IGNORE_UNCLAIMED_STATE, true);
        }
        conf.set(StateBackendOptions.STATE_BACKEND, a[4]);
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(Integer.parseInt(a[2]));
        env.addSource(new EmptySource(), "empty", Types.LONG).setParallelism(1).uid("check-source")
                .keyBy(keySelector(a[3]), keyType(a[3]))
                .process(new StateFunction(0), Types.LONG).uid(UID).name("keyed state")
                .sinkTo(new DiscardingSink<>()).uid("sink");
        long start = System.nanoTime();
        long net = env.execute("keygroups restore timing").getNetRuntime();
        System.out.println("netRuntimeMs=" + net + " wallMs=" + (System.nanoTime() - start) / 1_000_000);
    }

    static final java.util.concurrent.ConcurrentLinkedQueue<String> WINDOW_FIRINGS =
            new java.util.concurrent.ConcurrentLinkedQueue<>();

    /** Emits what a restored window holds when it fires: key, window and the reduced sum. */
    public static class FiringLines extends org.apache.flink.streaming.api.functions.windowing.ProcessWindowFunction<
            Long, Long, Object, org.apache.flink.streaming.api.windowing.windows.TimeWindow> {
        @Override
        public void process(Object key, Context ctx, Iterable<Long> sums, org.apache.flink.util.Collector<Long> out) {
            for (Long sum : sums) {
                WINDOW_FIRINGS.add(Json.of(key) + "\t" + ctx.window().getStart() + "\t" + ctx.window().getEnd()
                        + "\t" + sum);
                out.collect(sum);
            }
        }
    }

    /** A job restoring savepoint a[1] at parallelism a[2] (state of operators it lacks ignored). */
    static StreamExecutionEnvironment restoring(String[] a) {
        Configuration conf = new Configuration();
        conf.set(StateRecoveryOptions.SAVEPOINT_PATH, Paths.get(a[1]).toAbsolutePath().toString());
        conf.set(StateRecoveryOptions.SAVEPOINT_IGNORE_UNCLAIMED_STATE, true);
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(Integer.parseInt(a[2]));
        return env;
    }

    /** Runs the job (its source ends at once, so the final watermark fires every restored window) and writes the
     * firings, sorted, to `out`. */
    static void writeFirings(StreamExecutionEnvironment env, String out) throws Exception {
        long net = env.execute("keygroups window checker").getNetRuntime();
        List<String> lines = new ArrayList<>(WINDOW_FIRINGS);
        Collections.sort(lines);
        Files.write(Paths.get(out), lines, StandardCharsets.UTF_8);
        System.out.println("fired " + lines.size() + " windows netRuntimeMs=" + net);
    }

    /** Restores the window operator uid("window") and fires every window it restored. */
    static void windows(String[] a) throws Exception {
        StreamExecutionEnvironment env = restoring(a);
        env.addSource(new EmptySource(), "empty", Types.LONG).setParallelism(1).uid("check-source")
                .keyBy(keySelector(a[3]), keyType(a[3]))
                .window(org.apache.flink.streaming.api.windowing.assigners.TumblingEventTimeWindows.of(
                        Duration.ofSeconds(10)))
                .reduce((ReduceFunction<Long>) Long::sum, new FiringLines(), Types.LONG).uid("window")
                .name("window sums").sinkTo(new DiscardingSink<>()).uid("window-sink");
        writeFirings(env, a[4]);
    }

    /** An empty source of Tuple3(key, t, n) records: the window-records job only restores. */
    public static class EmptyRecords extends RichSourceFunction<Tuple3<Long, Long, Long>> {
        @Override public void run(SourceContext<Tuple3<Long, Long, Long>> ctx) {}
        @Override public void cancel() {}
    }

    /** Emits a restored window's records when it fires: key, window, the sum of n and the number of records. */
    public static class RecordLines extends org.apache.flink.streaming.api.functions.windowing.ProcessWindowFunction<
            Tuple3<Long, Long, Long>, Long, Long, org.apache.flink.streaming.api.windowing.windows.TimeWindow> {
        @Override
        public void process(Long key, Context ctx, Iterable<Tuple3<Long, Long, Long>> records,
                            org.apache.flink.util.Collector<Long> out) {
            long sum = 0;
            long count = 0;
            for (Tuple3<Long, Long, Long> r : records) {
                sum += r.f2;
                count++;
            }
            WINDOW_FIRINGS.add(key + "\t" + ctx.window().getStart() + "\t" + ctx.window().getEnd() + "\t" + sum
                    + "\t" + count);
            out.collect(sum);
        }
    }

    /** Restores the process window operator uid("w") and fires every window it restored. */
    static void windowRecords(String[] a) throws Exception {
        StreamExecutionEnvironment env = restoring(a);
        env.addSource(new EmptyRecords(), "empty", Types.TUPLE(Types.LONG, Types.LONG, Types.LONG))
                .setParallelism(1).uid("check-source")
                .keyBy((KeySelector<Tuple3<Long, Long, Long>, Long>) r -> r.f0, Types.LONG)
                .window(org.apache.flink.streaming.api.windowing.assigners.TumblingEventTimeWindows.of(
                        Duration.ofSeconds(10)))
                .allowedLateness(Duration.ofMillis(Long.parseLong(a[3])))
                .process(new RecordLines(), Types.LONG).uid("w")
                .sinkTo(new DiscardingSink<>()).uid("window-sink");
        writeFirings(env, a[4]);
    }

    static final java.time.Duration SESSION_GAP = Duration.ofSeconds(3);

    /** Record n's event time in the session job: per key, records 2 s apart, then a 12 s pause. */
    static long sessionTime(long n) {
        long i = n / 4;
        return i * 2000 + (i >= 3 ? 10_000 : 0);
    }

    @SuppressWarnings({"unchecked", "rawtypes"})
    static KeyedStream<Long, Object> bySessionKey(org.apache.flink.streaming.api.datastream.DataStream<Long> s) {
        return s.keyBy((KeySelector<Long, Object>) n -> (Object) (n % 4), (TypeInformation) Types.LONG);
    }

    static void writeSessions(String[] a) throws Exception {
        Path out = Paths.get(a[1]).toAbsolutePath();
        long keys = Long.parseLong(a[3]);
        Configuration conf = new Configuration();
        conf.set(CheckpointingOptions.CHECKPOINT_STORAGE, "filesystem");
        conf.set(CheckpointingOptions.CHECKPOINTS_DIRECTORY,
                Files.createTempDirectory("keygroups-flink-chk").toUri().toString());
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(Integer.parseInt(a[2]));
        env.setMaxParallelism(128);
        bySessionKey(env.addSource(new NumberSource(keys), "session numbers", Types.LONG).setParallelism(1)
                .uid("session-source")
                .assignTimestampsAndWatermarks(
                        org.apache.flink.api.common.eventtime.WatermarkStrategy.<Long>noWatermarks()
                                .withTimestampAssigner((n, ts) -> sessionTime(n)))
                .map(n -> {
                    WINDOW_PROCESSED.incrementAndGet();
                    return n;
                }).returns(Types.LONG).uid("session-count"))
                .window(org.apache.flink.streaming.api.windowing.assigners.EventTimeSessionWindows.withGap(
                        SESSION_GAP))
                .reduce((ReduceFunction<Long>) Long::sum).uid("sessions").name("session sums")
                .sinkTo(new DiscardingSink<>()).uid("session-sink");
        JobClient job = env.executeAsync("keygroups session writer");
        long deadline = System.currentTimeMillis() + 120_000;
        while (WINDOW_PROCESSED.get() < keys) {
            if (System.currentTimeMillis() > deadline) throw new IllegalStateException("records not processed in time");
            Thread.sleep(20);
        }
        String savepoint = stopWithSavepoint(job);
        move(Paths.get(java.net.URI.create(savepoint.startsWith("file:") ? savepoint : "file:" + savepoint)),
                out.resolve("savepoint"));
        System.out.println("savepoint " + out.resolve("savepoint"));
    }

    static void sessions(String[] a) throws Exception {
        StreamExecutionEnvironment env = restoring(a);
        bySessionKey(env.addSource(new EmptySource(), "empty", Types.LONG).setParallelism(1).uid("check-source"))
                .window(org.apache.flink.streaming.api.windowing.assigners.EventTimeSessionWindows.withGap(
                        SESSION_GAP))
                .reduce((ReduceFunction<Long>) Long::sum, new FiringLines(), Types.LONG).uid("sessions")
                .sinkTo(new DiscardingSink<>()).uid("session-sink");
        writeFirings(env, a[3]);
    }

    public static void main(String[] a) {
        startDeadline(a);
        int status;
        try {
            status = run(a);
        } catch (Throwable t) {
            // A failed command ends the JVM too: the threads of the job it started would keep it running.
            t.printStackTrace();
            status = 1;
        }
        // Every output is written: end now. Flink's shutdown hooks (its mini cluster, when a job client started one,
        // is still shutting down) are what a loaded machine waits on at System.exit; they hold nothing of ours.
        System.out.flush();
        System.err.flush();
        Runtime.getRuntime().halt(status);
    }

    static int run(String[] a) throws Exception {
        if (a.length == 4 && a[0].equals("write-sessions")) {
            writeSessions(a);
        } else if (a.length == 4 && a[0].equals("sessions")) {
            sessions(a);
        } else if (a.length == 5 && a[0].equals("windows")) {
            windows(a);
        } else if (a.length == 5 && a[0].equals("window-records")) {
            windowRecords(a);
        } else if (a.length == 5 && a[0].equals("restore")) {
            restore(a);
        } else if (a.length == 9 && a[0].equals("write")) {
            write(a);
        } else if (a.length == 6 && a[0].equals("check")) {
            return check(a);
        } else {
            System.err.println("usage: write OUT P MAXP COMPRESSION KEYS long|string hashmap|rocksdb INLINE"
                    + " | check SAVEPOINT P long|string EXPECTED DUMP_DIR | windows SAVEPOINT P long|string OUT_FILE"
                    + " | window-records SAVEPOINT P LATENESS_MS OUT_FILE | write-sessions OUT P KEYS"
                    + " | sessions SAVEPOINT P OUT_FILE");
            return 2;
        }
        return 0;
    }
}
