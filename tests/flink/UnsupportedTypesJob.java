import java.io.IOException;
import java.math.BigDecimal;
import java.math.BigInteger;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.nio.file.StandardCopyOption;
import java.time.Duration;
import java.time.Instant;
import java.time.LocalDate;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.atomic.AtomicLong;
import java.util.stream.Stream;

import org.apache.flink.api.common.state.ListState;
import org.apache.flink.api.common.state.ListStateDescriptor;
import org.apache.flink.api.common.state.MapState;
import org.apache.flink.api.common.state.MapStateDescriptor;
import org.apache.flink.api.common.state.State;
import org.apache.flink.api.common.state.StateDescriptor;
import org.apache.flink.api.common.state.StateTtlConfig;
import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.api.common.typeutils.TypeSerializerSchemaCompatibility;
import org.apache.flink.api.common.typeutils.TypeSerializerSnapshot;
import org.apache.flink.api.common.typeutils.base.TypeSerializerSingleton;
import org.apache.flink.configuration.CheckpointingOptions;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.MemorySize;
import org.apache.flink.configuration.StateBackendOptions;
import org.apache.flink.configuration.StateRecoveryOptions;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.core.execution.SavepointFormatType;
import org.apache.flink.core.memory.DataInputView;
import org.apache.flink.core.memory.DataOutputView;
import org.apache.flink.runtime.state.FunctionInitializationContext;
import org.apache.flink.runtime.state.FunctionSnapshotContext;
import org.apache.flink.runtime.state.VoidNamespace;
import org.apache.flink.runtime.state.VoidNamespaceSerializer;
import org.apache.flink.streaming.api.checkpoint.CheckpointedFunction;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.streaming.api.functions.sink.v2.DiscardingSink;
import org.apache.flink.streaming.api.functions.source.legacy.RichSourceFunction;
import org.apache.flink.streaming.api.operators.KeyedProcessOperator;
import org.apache.flink.types.Value;

/**
 * Ground truth for keygroups' handling of Flink types it does not map (tests/test_flink_unsupported.py).
 *
 * <pre>
 * write OUT_DIR KEYS
 *     runs a job (parallelism 2, max parallelism 128, heap backend, everything inlined in _metadata) whose operator
 *     "keyed" holds, beside plain Long and String value states, a POJO, a Kryo (generic type), an enum, primitive
 *     arrays, BigInteger/BigDecimal/Instant/LocalDate, a String[], a Long[] (GenericArraySerializer), a user Value
 *     type, a TTL-wrapped POJO, a list of POJOs and a map of Kryo values, and operator state of a Kryo type (split), a POJO (union) and Long
 *     (split); operator "custom" holds a state whose serializer is the job's own (its snapshot has no length
 *     prefix) between two Long states. Stops with a canonical savepoint into OUT_DIR/savepoint and writes
 *     OUT_DIR/expected.txt (tab-separated: keyed STATE KEY VALUE | split|union STATE SUBTASK ELEMENT, values as
 *     JSON, doubles as "d:" + the hex of their bits, POJO/Kryo/Value values as their toString()).
 * check SAVEPOINT PARALLELISM EXPECTED DUMP_DIR
 *     restores SAVEPOINT (keygroups' export of the states keygroups maps) into operator "keyed" at PARALLELISM,
 *     lists every key of the states it maps (MAPPED) and op_long's elements into DUMP_DIR/restored.txt and compares
 *     them with those lines of EXPECTED; exit status 0 when equal, 1 (with the first differences) when not.
 * </pre>
 */
public class UnsupportedTypesJob {

    static final AtomicLong PROCESSED = new AtomicLong();

    /** A POJO: public fields and a no-argument constructor (Flink's PojoSerializer). */
    public static class Point {
        public long x;
        public String label;

        public Point() {}

        Point(long x, String label) {
            this.x = x;
            this.label = label;
        }

        @Override
        public String toString() {
            return "Point(" + x + "," + label + ")";
        }
    }

    /** Not a POJO (private fields without accessors): Flink falls back to Kryo. */
    public static class Opaque {
        private long id;
        private List<String> tags;

        public Opaque() {}

        Opaque(long id, List<String> tags) {
            this.id = id;
            this.tags = new ArrayList<>(tags);
        }

        @Override
        public String toString() {
            return "Opaque(" + id + "," + tags + ")";
        }
    }

    public enum Color { RED, GREEN, BLUE }

    /** A user Value type (Flink's ValueSerializer). */
    public static class Counter implements Value {
        long count;

        public Counter() {}

        Counter(long count) {
            this.count = count;
        }

        @Override
        public void write(DataOutputView out) throws IOException {
            out.writeLong(count);
        }

        @Override
        public void read(DataInputView in) throws IOException {
            count = in.readLong();
        }

        @Override
        public String toString() {
            return "Counter(" + count + ")";
        }
    }

    /** A user serializer of Longs (written as their negation) with a snapshot of its own: no length prefix. */
    public static final class NegatedLongSerializer extends TypeSerializerSingleton<Long> {
        public static final NegatedLongSerializer INSTANCE = new NegatedLongSerializer();

        @Override public boolean isImmutableType() { return true; }
        @Override public Long createInstance() { return 0L; }
        @Override public Long copy(Long from) { return from; }
        @Override public Long copy(Long from, Long reuse) { return from; }
        @Override public int getLength() { return 8; }
        @Override public void serialize(Long v, DataOutputView out) throws IOException { out.writeLong(-v); }
        @Override public Long deserialize(DataInputView in) throws IOException { return -in.readLong(); }
        @Override public Long deserialize(Long reuse, DataInputView in) throws IOException { return -in.readLong(); }
        @Override public void copy(DataInputView in, DataOutputView out) throws IOException { out.writeLong(in.readLong()); }
        @Override public TypeSerializerSnapshot<Long> snapshotConfiguration() { return new NegatedSnapshot(); }
    }

    /** Writes a payload keygroups cannot know the length of. */
    public static final class NegatedSnapshot implements TypeSerializerSnapshot<Long> {
        @Override public int getCurrentVersion() { return 7; }

        @Override
        public void writeSnapshot(DataOutputView out) throws IOException {
            out.writeUTF("negated longs");
            out.writeInt(42);
        }

        @Override
        public void readSnapshot(int version, DataInputView in, ClassLoader cl) throws IOException {
            in.readUTF();
            in.readInt();
        }

        @Override public TypeSerializer<Long> restoreSerializer() { return NegatedLongSerializer.INSTANCE; }

        @Override
        public TypeSerializerSchemaCompatibility<Long> resolveSchemaCompatibility(TypeSerializerSnapshot<Long> old) {
            return TypeSerializerSchemaCompatibility.compatibleAsIs();
        }
    }

    // ---------------------------------------------------------------------------------------------- the state

    @SuppressWarnings({"unchecked", "rawtypes"})
    static List<StateDescriptor<?, ?>> descriptors() {
        List<StateDescriptor<?, ?>> d = new ArrayList<>();
        d.add(new ValueStateDescriptor<>("long", Types.LONG));
        d.add(new ValueStateDescriptor<>("pojo", Types.POJO(Point.class)));
        d.add(new ValueStateDescriptor<>("kryo", Types.GENERIC(Opaque.class)));
        d.add(new ValueStateDescriptor<>("enum", Types.ENUM(Color.class)));
        d.add(new ValueStateDescriptor<>("longs", Types.PRIMITIVE_ARRAY(Types.LONG)));
        d.add(new ValueStateDescriptor<>("ints", Types.PRIMITIVE_ARRAY(Types.INT)));
        d.add(new ValueStateDescriptor<>("doubles", Types.PRIMITIVE_ARRAY(Types.DOUBLE)));
        d.add(new ValueStateDescriptor<>("big_int", Types.BIG_INT));
        d.add(new ValueStateDescriptor<>("big_dec", Types.BIG_DEC));
        d.add(new ValueStateDescriptor<>("instant", Types.INSTANT));
        d.add(new ValueStateDescriptor<>("local_date", Types.LOCAL_DATE));
        d.add(new ValueStateDescriptor<>("strings", (TypeInformation) Types.OBJECT_ARRAY(Types.STRING)));
        d.add(new ValueStateDescriptor<>("value", Types.VALUE(Counter.class)));
        d.add(new ValueStateDescriptor<>("boxed", (TypeInformation) Types.OBJECT_ARRAY(Types.LONG)));
        ValueStateDescriptor<Point> ttlPojo = new ValueStateDescriptor<>("ttl_pojo", Types.POJO(Point.class));
        ttlPojo.enableTimeToLive(StateTtlConfig.newBuilder(Duration.ofDays(3650)).build());
        d.add(ttlPojo);
        d.add(new ListStateDescriptor<>("pojo_list", Types.POJO(Point.class)));
        d.add(new MapStateDescriptor<>("kryo_map", Types.STRING, Types.GENERIC(Opaque.class)));
        d.add(new ValueStateDescriptor<>("string", Types.STRING));
        return d;
    }

    static List<StateDescriptor<?, ?>> customDescriptors() {
        List<StateDescriptor<?, ?>> d = new ArrayList<>();
        d.add(new ValueStateDescriptor<>("before", Types.LONG));
        d.add(new ValueStateDescriptor<>("negated", NegatedLongSerializer.INSTANCE));
        d.add(new ValueStateDescriptor<>("after", Types.LONG));
        d.add(new ValueStateDescriptor<>("last", Types.STRING));
        return d;
    }

    /** The states keygroups maps (read and written): what an export of the import holds. */
    static final List<String> MAPPED = List.of("long", "string", "enum", "longs", "ints", "doubles", "strings", "boxed");

    static long key(long n) {
        return n * 31L - 100L;
    }

    /** The value of state `name` for key n (a list for list states, a TreeMap for map states). */
    static Object value(String name, long n) {
        switch (name) {
            case "long": case "before": case "negated": case "after": return n * 1_000_003L - 7;
            case "string": case "last": return "s" + n + (n % 3 == 0 ? "\u00e9\uD83D\uDE00" : "");
            case "pojo": return new Point(n * 2, n % 4 == 0 ? null : "p" + n);
            case "kryo": return new Opaque(n, List.of("t" + n, "u"));
            case "enum": return Color.values()[(int) (n % 3)];
            case "longs": {
                long[] a = new long[(int) (n % 4)];
                for (int i = 0; i < a.length; i++) a[i] = (n - 5) * 1_000_000_000_000L + i;
                return a;
            }
            case "ints": return new int[] {(int) n, -(int) n * 1000, Integer.MIN_VALUE};
            case "doubles": return n % 5 == 0 ? new double[] {Double.NaN, -0.0} : new double[] {n * 0.5};
            case "big_int": return BigInteger.valueOf(n).pow(20).negate();
            case "big_dec": return new BigDecimal("1" + n + ".25");
            case "instant": return Instant.ofEpochSecond(1_700_000_000L + n, n * 1000);
            case "local_date": return LocalDate.of(2020, 1, 1).plusDays(n);
            case "strings": return new String[] {"a" + n, null, "b"};
            case "value": return new Counter(n * 3);
            case "boxed": return new Long[] {n, null, -n * 1_000_000_000_000L};
            case "ttl_pojo": return new Point(-n, "ttl" + n);
            case "pojo_list": return List.of(new Point(n, "l" + n), new Point(-n, null));
            case "kryo_map": {
                Map<String, Opaque> m = new TreeMap<>();
                m.put("k" + n, new Opaque(-n, List.of()));
                return m;
            }
            default: throw new IllegalArgumentException(name);
        }
    }

    // ---------------------------------------------------------------------------------------------- the functions

    public static class StateFunction extends KeyedProcessFunction<Long, Long, Long> implements CheckpointedFunction {
        final boolean custom;
        transient List<State> states;
        transient ListState<Opaque> opKryo;
        transient ListState<Point> opPojo;
        transient ListState<Long> opLong;

        StateFunction(boolean custom) {
            this.custom = custom;
        }

        List<StateDescriptor<?, ?>> mine() {
            return custom ? customDescriptors() : descriptors();
        }

        @Override
        @SuppressWarnings("unchecked")
        public void open(org.apache.flink.api.common.functions.OpenContext ctx) {
            states = new ArrayList<>();
            for (StateDescriptor<?, ?> d : mine()) {
                if (d instanceof ValueStateDescriptor) states.add(getRuntimeContext().getState((ValueStateDescriptor<Object>) d));
                else if (d instanceof ListStateDescriptor) states.add(getRuntimeContext().getListState((ListStateDescriptor<Object>) d));
                else states.add(getRuntimeContext().getMapState((MapStateDescriptor<Object, Object>) d));
            }
        }

        @Override
        @SuppressWarnings("unchecked")
        public void processElement(Long n, Context ctx, org.apache.flink.util.Collector<Long> out) throws Exception {
            List<StateDescriptor<?, ?>> ds = mine();
            for (int i = 0; i < ds.size(); i++) {
                if ((n + i) % 5 == 0) continue;   // not every key holds every state
                Object v = value(ds.get(i).getName(), n);
                State s = states.get(i);
                if (s instanceof ValueState) ((ValueState<Object>) s).update(v);
                else if (s instanceof ListState) ((ListState<Object>) s).update((List<Object>) v);
                else ((MapState<Object, Object>) s).putAll((Map<Object, Object>) v);
            }
            PROCESSED.incrementAndGet();
        }

        @Override
        public void snapshotState(FunctionSnapshotContext ctx) throws Exception {
            if (custom) return;
            int subtask = getRuntimeContext().getTaskInfo().getIndexOfThisSubtask();
            opKryo.update(List.of(new Opaque(subtask, List.of("op"))));
            opPojo.update(List.of(new Point(subtask, "op" + subtask)));
            opLong.update(List.of(subtask * 10L, subtask * 10L + 1));
        }

        @Override
        public void initializeState(FunctionInitializationContext ctx) throws Exception {
            if (custom) return;
            opKryo = ctx.getOperatorStateStore().getListState(
                    new ListStateDescriptor<>("op_kryo", Types.GENERIC(Opaque.class)));
            opPojo = ctx.getOperatorStateStore().getUnionListState(
                    new ListStateDescriptor<>("op_pojo", Types.POJO(Point.class)));
            opLong = ctx.getOperatorStateStore().getListState(new ListStateDescriptor<>("op_long", Types.LONG));
        }
    }

    /** Emits 0..keys-1 once, then idles until cancelled. */
    public static class NumberSource extends RichSourceFunction<Long> {
        final long keys;
        volatile boolean running = true;

        NumberSource(long keys) {
            this.keys = keys;
        }

        @Override
        public void run(SourceContext<Long> ctx) throws Exception {
            for (long n = 0; n < keys && running; n++) {
                synchronized (ctx.getCheckpointLock()) {
                    ctx.collect(n);
                }
            }
            while (running) Thread.sleep(20);
        }

        @Override
        public void cancel() {
            running = false;
        }
    }

    /** An empty source for the checking job: it only restores. */
    public static class EmptySource extends RichSourceFunction<Long> {
        @Override public void run(SourceContext<Long> ctx) {}
        @Override public void cancel() {}
    }

    /** The "keyed" operator, listing what it restored of the MAPPED states and op_long when it opens. */
    public static class DumpingOperator extends KeyedProcessOperator<Long, Long, Long> {
        final String dumpDir;

        DumpingOperator(String dumpDir) {
            super(new StateFunction(false));
            this.dumpDir = dumpDir;
        }

        @Override
        @SuppressWarnings({"unchecked", "rawtypes"})
        public void open() throws Exception {
            super.open();
            List<String> lines = new ArrayList<>();
            for (StateDescriptor<?, ?> d : descriptors()) {
                String name = d.getName();
                if (!MAPPED.contains(name)) continue;
                getKeyedStateBackend().applyToAllKeys(VoidNamespace.INSTANCE, VoidNamespaceSerializer.INSTANCE,
                        (StateDescriptor) d, (k, s) -> {
                            Object v = ((ValueState<?>) s).value();
                            if (v != null) lines.add("keyed\t" + name + "\t" + k + "\t" + json(v));
                        });
            }
            int subtask = getRuntimeContext().getTaskInfo().getIndexOfThisSubtask();
            List<Long> elements = new ArrayList<>();
            for (Long e : ((StateFunction) userFunction).opLong.get()) elements.add(e);
            Collections.sort(elements);
            lines.add("op_long\t" + json(elements));
            Files.write(Paths.get(dumpDir, "subtask-" + subtask + ".txt"), lines, StandardCharsets.UTF_8);
        }
    }

    static int check(String savepoint, int parallelism, Path expectedFile, Path dumpDir) throws Exception {
        Files.createDirectories(dumpDir);
        Configuration conf = new Configuration();
        conf.set(StateRecoveryOptions.SAVEPOINT_PATH, Paths.get(savepoint).toAbsolutePath().toString());
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(parallelism);
        env.addSource(new EmptySource(), "empty", Types.LONG).setParallelism(1).uid("check-source")
                .keyBy(n -> key(n), Types.LONG)
                .transform("keyed state", Types.LONG, new DumpingOperator(dumpDir.toString())).uid("keyed")
                .sinkTo(new DiscardingSink<>()).uid("keyed-sink");
        env.execute("keygroups unsupported types checker");
        List<String> restored = new ArrayList<>();
        List<Long> opLong = new ArrayList<>();
        for (int s = 0; s < parallelism; s++) {
            for (String line : Files.readAllLines(dumpDir.resolve("subtask-" + s + ".txt"), StandardCharsets.UTF_8)) {
                if (!line.startsWith("op_long\t")) {
                    restored.add(line);
                    continue;
                }
                for (String e : line.substring(9).replaceAll("[\\[\\]]", "").split(",")) {
                    if (!e.isEmpty()) opLong.add(Long.parseLong(e));
                }
            }
        }
        Collections.sort(opLong);
        restored.add("op_long\t" + json(opLong));
        List<String> expected = new ArrayList<>();
        List<Long> expectedOpLong = new ArrayList<>();
        for (String line : Files.readAllLines(expectedFile, StandardCharsets.UTF_8)) {
            String[] f = line.split("\t");
            if (f[0].equals("keyed") && MAPPED.contains(f[1])) expected.add(line);
            if (f[0].equals("split") && f[1].equals("op_long")) {
                for (String e : f[3].replaceAll("[\\[\\]]", "").split(",")) expectedOpLong.add(Long.parseLong(e));
            }
        }
        Collections.sort(expectedOpLong);
        expected.add("op_long\t" + json(expectedOpLong));
        Collections.sort(restored);
        Collections.sort(expected);
        Files.write(dumpDir.resolve("restored.txt"), restored, StandardCharsets.UTF_8);
        if (restored.equals(expected)) {
            System.out.println("OK " + restored.size() + " lines restored as expected");
            return 0;
        }
        List<String> missing = new ArrayList<>(expected);
        missing.removeAll(restored);
        List<String> extra = new ArrayList<>(restored);
        extra.removeAll(expected);
        System.out.println("MISMATCH expected " + expected.size() + " lines, restored " + restored.size());
        for (String l : missing.subList(0, Math.min(10, missing.size()))) System.out.println("missing: " + l);
        for (String l : extra.subList(0, Math.min(10, extra.size()))) System.out.println("unexpected: " + l);
        return 1;
    }

    // ---------------------------------------------------------------------------------------------- expected lines

    static String json(Object v) {
        if (v == null) return "null";
        if (v instanceof Long || v instanceof Integer) return v.toString();
        if (v instanceof Double) return "\"d:" + String.format("%016x", Double.doubleToRawLongBits((Double) v)) + "\"";
        if (v instanceof String) {
            StringBuilder b = new StringBuilder("\"");
            for (char c : ((String) v).toCharArray()) {
                if (c == '"' || c == '\\') b.append('\\').append(c);
                else if (c < 0x20 || c > 0x7e) b.append(String.format("\\u%04x", (int) c));
                else b.append(c);
            }
            return b.append('"').toString();
        }
        if (v instanceof Enum) return json(((Enum<?>) v).name());
        if (v instanceof long[]) {
            List<Object> l = new ArrayList<>();
            for (long x : (long[]) v) l.add(x);
            return json(l);
        }
        if (v instanceof int[]) {
            List<Object> l = new ArrayList<>();
            for (int x : (int[]) v) l.add(x);
            return json(l);
        }
        if (v instanceof double[]) {
            List<Object> l = new ArrayList<>();
            for (double x : (double[]) v) l.add(x);
            return json(l);
        }
        if (v instanceof Object[]) return json(java.util.Arrays.asList((Object[]) v));
        if (v instanceof List) {
            List<String> parts = new ArrayList<>();
            for (Object x : (List<?>) v) parts.add(json(x));
            return "[" + String.join(",", parts) + "]";
        }
        if (v instanceof Map) {
            List<String> parts = new ArrayList<>();
            for (Map.Entry<?, ?> e : ((Map<?, ?>) v).entrySet()) parts.add("[" + json(e.getKey()) + "," + json(e.getValue()) + "]");
            Collections.sort(parts);
            return "[" + String.join(",", parts) + "]";
        }
        return json(v.toString());   // POJO, Kryo, Value, BigInteger, BigDecimal, Instant, LocalDate
    }

    static List<String> expectedLines(long keys) {
        List<String> lines = new ArrayList<>();
        for (String op : List.of("keyed", "custom")) {
            List<StateDescriptor<?, ?>> ds = op.equals("keyed") ? descriptors() : customDescriptors();
            for (long n = 0; n < keys; n++) {
                for (int i = 0; i < ds.size(); i++) {
                    if ((n + i) % 5 == 0) continue;
                    String name = ds.get(i).getName();
                    lines.add(op + "\t" + name + "\t" + key(n) + "\t" + json(value(name, n)));
                }
            }
        }
        for (int s = 0; s < 2; s++) {
            lines.add("split\top_kryo\t" + s + "\t" + json(new Opaque(s, List.of("op"))));
            lines.add("union\top_pojo\t" + s + "\t" + json(new Point(s, "op" + s)));
            lines.add("split\top_long\t" + s + "\t" + json(List.of(s * 10L, s * 10L + 1)));
        }
        Collections.sort(lines);
        return lines;
    }

    // ---------------------------------------------------------------------------------------------- the job

    static void write(Path out, long keys) throws Exception {
        Configuration conf = new Configuration();
        conf.set(StateBackendOptions.STATE_BACKEND, "hashmap");
        conf.set(CheckpointingOptions.CHECKPOINT_STORAGE, "filesystem");
        conf.set(CheckpointingOptions.CHECKPOINTS_DIRECTORY,
                Files.createTempDirectory("keygroups-flink-chk").toUri().toString());
        conf.set(CheckpointingOptions.FS_SMALL_FILE_THRESHOLD, MemorySize.parse("1mb"));
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(2);
        env.setMaxParallelism(128);
        for (String op : List.of("keyed", "custom")) {
            env.addSource(new NumberSource(keys), op + " numbers", Types.LONG).setParallelism(1).uid(op + "-source")
                    .keyBy(n -> key(n), Types.LONG)
                    .process(new StateFunction(op.equals("custom")), Types.LONG).uid(op).name(op + " state")
                    .sinkTo(new DiscardingSink<>()).uid(op + "-sink");
        }
        JobClient job = env.executeAsync("keygroups unsupported types writer");
        long deadline = System.currentTimeMillis() + 120_000;
        while (PROCESSED.get() < 2 * keys) {
            if (System.currentTimeMillis() > deadline) throw new IllegalStateException("records not processed in time");
            Thread.sleep(20);
        }
        Path tmp = Files.createTempDirectory("keygroups-flink-savepoint");
        String savepoint = null;
        long savepointDeadline = System.currentTimeMillis() + 120_000;
        while (savepoint == null) {
            try {   // bounded: a savepoint that cannot complete fails the run instead of waiting ten minutes
                savepoint = job.stopWithSavepoint(false, tmp.toUri().toString(), SavepointFormatType.CANONICAL)
                        .get(Math.max(1, savepointDeadline - System.currentTimeMillis()), TimeUnit.MILLISECONDS);
            } catch (java.util.concurrent.ExecutionException e) {
                // a subtask still deploying (a loaded machine) refuses the savepoint and the job goes on: ask again
                if (!notAllTasksRunning(e) || System.currentTimeMillis() > savepointDeadline) throw e;
                Thread.sleep(200);
            }
        }
        Path target = out.resolve("savepoint");
        Files.createDirectories(target);
        Path from = Paths.get(java.net.URI.create(savepoint.startsWith("file:") ? savepoint : "file:" + savepoint));
        try (Stream<Path> files = Files.list(from)) {
            for (Path f : (Iterable<Path>) files::iterator) {
                Files.move(f, target.resolve(f.getFileName()), StandardCopyOption.REPLACE_EXISTING);
            }
        }
        Files.write(out.resolve("expected.txt"), expectedLines(keys), StandardCharsets.UTF_8);
        System.out.println("savepoint " + target);
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

    public static void main(String[] a) {
        int status;
        try {
            if (a.length == 3 && a[0].equals("write")) {
                write(Paths.get(a[1]).toAbsolutePath(), Long.parseLong(a[2]));
                status = 0;
            } else if (a.length == 5 && a[0].equals("check")) {
                status = check(a[1], Integer.parseInt(a[2]), Paths.get(a[3]), Paths.get(a[4]).toAbsolutePath());
            } else {
                System.err.println("usage: write OUT_DIR KEYS | check SAVEPOINT PARALLELISM EXPECTED DUMP_DIR");
                status = 2;
            }
        } catch (Throwable t) {
            // a failed command ends the JVM too: the threads of the job it started would keep it running
            t.printStackTrace();
            status = 1;
        }
        System.out.flush();
        System.err.flush();
        Runtime.getRuntime().halt(status);   // outputs are written; Flink's shutdown hooks hold nothing of ours
    }
}
