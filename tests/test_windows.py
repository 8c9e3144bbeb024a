"""Windows on namespaced state: namespaced keyed state on both backends, and hypothesis models of every assigner
(tumbling, sliding, session; event and processing time; late records, allowed lateness, merging sessions) driven
through the runtime's batch protocol against a plain-Python reference, with the parallelism (so restore and rescale)
changing between batches."""

from __future__ import annotations

import dataclasses
import datetime
import operator
import pickle
from collections import Counter as Multiset
from datetime import timedelta

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups._parquet import read_parquet
import keygroups as kg
from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime import begin_batch, commit_batch
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.serializers import Int64Serializer, StrSerializer, TupleSerializer
from keygroups.state import (
    AggregateFunction,
    AggregatingStateDescriptor,
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    RocksDBKeyedStateBackend,
    ValueStateDescriptor,
)
from keygroups.state.namespaced import NamespacedListState
from keygroups.windows import (
    Count,
    EventTimeSessionWindows,
    Max,
    Mean,
    Min,
    ProcessingTimeSessionWindows,
    ProcessWindowFunction,
    PythonAggregate,
    SlidingEventTimeWindows,
    SlidingProcessingTimeWindows,
    Sum,
    TimeWindow,
    TumblingEventTimeWindows,
    TumblingProcessingTimeWindows,
    window,
)

NO_WATERMARK = -(2**63)
SCHEMA = pa.schema([("k", pa.int64()), ("t", pa.int64()), ("v", pa.int64())])
MAXP = 8


def make_backend(kind, tmp_path, kgr=None):
    kgr = kgr or kg.KeyGroupRange(0, MAXP - 1)
    if kind == "heap":
        return HeapKeyedStateBackend(kgr, MAXP, Int64Serializer(), key_type="long")
    (tmp_path / "db").mkdir(parents=True, exist_ok=True)
    return RocksDBKeyedStateBackend(kgr, MAXP, Int64Serializer(), key_type="long", db_dir=str(tmp_path / "db"))


@pytest.fixture(params=["heap", "rocksdb"])
def kind(request):
    return request.param


class SumAgg(AggregateFunction):
    def create_accumulator(self):
        return 0

    def add(self, value, accumulator):
        return accumulator + value

    def get_result(self, accumulator):
        return accumulator

    def merge(self, a, b):
        return a + b


# ---- namespaced state ---------------------------------------------------------------------------------------------

def test_namespaced_states_per_key_and_namespace_survive_snapshot_and_rescale(kind, tmp_path):
    ns = TimeWindow.serializer()
    storage = CheckpointStorage(str(tmp_path / "chk"))
    with make_backend(kind, tmp_path) as b:
        value = b.get_state(ValueStateDescriptor("v", StrSerializer()), namespace=TimeWindow(0, 10),
                            namespace_serializer=ns)
        agg = b.get_state(AggregatingStateDescriptor("a", SumAgg(), Int64Serializer()), namespace=TimeWindow(0, 10),
                          namespace_serializer=ns)
        lst = b.get_state(ListStateDescriptor("l", Int64Serializer()), namespace=TimeWindow(0, 10),
                          namespace_serializer=ns)
        red = b.get_state(ReducingStateDescriptor("r", max, Int64Serializer()), namespace=TimeWindow(0, 10),
                          namespace_serializer=ns)
        mp = b.get_state(MapStateDescriptor("m", StrSerializer(), Int64Serializer()), namespace=TimeWindow(0, 10),
                         namespace_serializer=ns)
        assert isinstance(lst, NamespacedListState)
        for key in range(20):
            b.set_current_key(key)
            for w in (TimeWindow(0, 10), TimeWindow(10, 20), TimeWindow(20, 30)):
                for s in (value, agg, lst, red, mp):
                    s.set_current_namespace(w)
                value.update(f"{key}@{w.start}")
                agg.add(key)
                agg.add(w.start)
                lst.add_all([key, w.start])
                red.add(key)
                red.add(w.start)
                mp.put("k", key)
                mp.put("s", w.start)
            # merging moves the sources' values into the target and clears them
            for s in (agg, lst, red):
                s.merge_namespaces(TimeWindow(0, 20), [TimeWindow(0, 10), TimeWindow(10, 20)])
            mp.set_current_namespace(TimeWindow(20, 30))
            mp.clear()
        # same object for every namespace; a second get moves its namespace
        assert b.get_state(ValueStateDescriptor("v", StrSerializer()), namespace=TimeWindow(20, 30)) is value
        handle = b.snapshot(1, storage).result()
    metadata = kg.checkpoint.CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=MAXP,
                                                parallelism=1, keyed_handles=[handle])
    for sub in range(2):   # rescaled to two subtasks
        kgr = kg.key_group_range(MAXP, 2, sub)
        with make_backend(kind, tmp_path / f"r{sub}", kgr) as b:
            b.restore(storage, metadata)
            value = b.get_state(ValueStateDescriptor("v", StrSerializer()), namespace=TimeWindow(0, 10),
                                namespace_serializer=ns)
            agg = b.get_state(AggregatingStateDescriptor("a", SumAgg(), Int64Serializer()),
                              namespace=TimeWindow(0, 20), namespace_serializer=ns)
            lst = b.get_state(ListStateDescriptor("l", Int64Serializer()), namespace=TimeWindow(0, 20),
                              namespace_serializer=ns)
            red = b.get_state(ReducingStateDescriptor("r", max, Int64Serializer()), namespace=TimeWindow(0, 20),
                              namespace_serializer=ns)
            mp = b.get_state(MapStateDescriptor("m", StrSerializer(), Int64Serializer()),
                             namespace=TimeWindow(10, 20), namespace_serializer=ns)
            for key in range(20):
                if kg.assign_to_key_group(key, MAXP, "long") not in kgr:
                    continue
                b.set_current_key(key)
                assert value.value() == f"{key}@0"
                value.set_current_namespace(TimeWindow(20, 30))
                assert value.value() == f"{key}@20"
                assert sorted(value.namespaces()) == [(0, 10), (10, 20), (20, 30)]
                value.set_current_namespace(TimeWindow(0, 10))
                assert agg.get() == 2 * key + 10
                assert sorted(lst.get()) == sorted([key, 0, key, 10])
                assert red.get() == max(key, 10)
                assert sorted(agg.namespaces()) == [(0, 20), (20, 30)]
                assert dict(mp.items()) == {"k": key, "s": 10}
                assert mp.namespaces() == [(10, 20)] or sorted(mp.namespaces()) == [(0, 10), (10, 20)]
                mp.set_current_namespace(TimeWindow(20, 30))
                assert mp.items() == []
                mp.set_current_namespace(TimeWindow(10, 20))


def test_namespaced_state_refuses_misuse(tmp_path):
    with make_backend("heap", tmp_path) as b:
        d = ValueStateDescriptor("s", Int64Serializer())
        with pytest.raises(TypeError, match="namespace_serializer"):
            b.get_state(d, namespace=TimeWindow(0, 1))
        b.get_state(d, namespace=TimeWindow(0, 1), namespace_serializer=TimeWindow.serializer())
        with pytest.raises(ValueError, match="namespace serializer"):
            b.get_state(d, namespace=TimeWindow(0, 1), namespace_serializer=Int64Serializer())
        v = b.get_state(ValueStateDescriptor("plain", Int64Serializer()))
        assert v is not None
        with pytest.raises(kg.errors.StateMigrationError, match="without a namespace"):
            b.get_state(ValueStateDescriptor("plain", Int64Serializer()), namespace=1,
                        namespace_serializer=Int64Serializer())
        with pytest.raises(TypeError, match="cannot be merged"):
            b.set_current_key(1)
            vs = b.get_state(d, namespace=TimeWindow(0, 1))
            vs.update(3)
            vs.merge_namespaces(TimeWindow(0, 2), [TimeWindow(0, 1)])


# ---- the runtime harness ------------------------------------------------------------------------------------------

def run_batch(location, job, table, *, parallelism, backend, watermark, processing_time=0):
    """One batch of ``job`` (a WindowJob) through the driver protocol; (output rows, late rows)."""
    plan = begin_batch(CheckpointStorage(location), job_name="w", max_parallelism=MAXP, parallelism=parallelism)
    plan = dataclasses.replace(plan, processing_time=processing_time)
    spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(job.function), input_schema=SCHEMA,
                           output_schema=job.output_schema, backend=backend, timestamp_column="t",
                           watermark=watermark, late_records="output", warm_heap_backends=0)
    owners = kg.operator_index_for_key_group(
        MAXP, parallelism, kg.assign_key_groups(table.column("k"), MAXP, "long")) if table.num_rows else np.zeros(0)
    reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches())
               for i in range(parallelism)]
    metadata = commit_batch(plan, reports, watermark=spec.watermark)
    storage = CheckpointStorage(location)

    def rows(files):
        tables = [read_parquet(storage.read_bytes(f)) for f in files]
        return [tuple(r.values()) for t in tables for r in t.to_pylist()]

    return rows(metadata.outputs), rows(metadata.late_outputs)


# ---- the reference ------------------------------------------------------------------------------------------------

def windows_of(kind, ts, size, slide):
    if kind == "tumbling":
        start = ts - ts % size
        return [(start, start + size)]
    if kind == "sliding":
        last = ts - ts % slide
        return [(s, s + size) for s in range(last, ts - size, -slide)]
    return [(ts, ts + size)]   # session: size is the gap


class Reference:
    """Flink's window operator at batch granularity: records of a batch are applied, windows already past the
    start watermark fire at once, then the new watermark fires and cleans up windows."""

    def __init__(self, kind, size, slide, lateness):
        self.kind, self.size, self.slide, self.lateness = kind, size, slide, lateness
        self.windows = {}   # (key, start, end) -> list of values
        self.watermark = NO_WATERMARK

    def batch(self, records, new_watermark):
        w0, out, late = self.watermark, [], []
        touched = set()
        live_records = []
        for k, t, v in records:
            last_end = max(e for _, e in windows_of(self.kind, t, self.size, self.slide))
            if w0 != NO_WATERMARK and last_end - 1 + self.lateness <= w0:
                late.append((k, t, v))
            else:
                live_records.append((k, t, v))
        if self.kind == "session":
            for k in sorted({r[0] for r in live_records}):
                mine = sorted((t, v) for kk, t, v in live_records if kk == k)
                for t, v in mine:
                    w = (t, t + self.size)
                    vals = [v]
                    merged = True
                    while merged:
                        merged = False
                        for key in [x for x in self.windows if x[0] == k]:
                            if key[1] <= w[1] and key[2] >= w[0]:
                                w = (min(w[0], key[1]), max(w[1], key[2]))
                                vals += self.windows.pop(key)
                                touched.discard(key)
                                merged = True
                    self.windows[(k, *w)] = vals
                    touched.add((k, *w))
        else:
            for k, t, v in live_records:
                for s, e in windows_of(self.kind, t, self.size, self.slide):
                    if w0 != NO_WATERMARK and e - 1 + self.lateness <= w0:
                        continue
                    self.windows.setdefault((k, s, e), []).append(v)
                    touched.add((k, s, e))
        for key in touched:
            if w0 != NO_WATERMARK and key[2] - 1 <= w0:
                out.append(self.row(key))
        w1 = max(w0, new_watermark)
        for key in list(self.windows):
            if w0 < key[2] - 1 <= w1:
                out.append(self.row(key))
            if key[2] - 1 + self.lateness <= w1:
                del self.windows[key]
        self.watermark = w1
        return out, late

    def row(self, key):
        vals = self.windows[key]
        return (*key, len(vals), sum(vals), min(vals), max(vals), sum(vals) / len(vals))


def aggregate_job(assigner, lateness):
    return window(assigner, input_schema=SCHEMA, key_columns="k", timestamp_column="t",
                  allowed_lateness=lateness).aggregate(Count(), Sum("v"), Min("v"), Max("v"), Mean("v"))


batches_strategy = st.lists(
    # (records (key, event time relative to the batch's base, value), watermark advance, parallelism): records up to
    # 30 ms behind the base are late or within the allowed lateness, depending on the watermark
    st.tuples(st.lists(st.tuples(st.integers(0, 5), st.integers(-30, 40), st.integers(-5, 9)), max_size=12),
              st.integers(0, 40), st.integers(1, 3)),
    min_size=1, max_size=6)


@pytest.mark.parametrize("kind_", ["tumbling", "sliding", "session"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=batches_strategy, lateness=st.sampled_from([0, 7]), size=st.sampled_from([5, 10]))
def test_event_time_windows_match_the_reference(kind_, kind, tmp_path_factory, batches, lateness, size):
    location = str(tmp_path_factory.mktemp("w") / "chk")
    slide = 3
    assigner = {"tumbling": TumblingEventTimeWindows.of(size), "sliding": SlidingEventTimeWindows.of(size, slide),
                "session": EventTimeSessionWindows.with_gap(size)}[kind_]
    job = aggregate_job(assigner, lateness)
    ref = Reference(kind_, size, slide, lateness)
    base = 0
    for records, advance, parallelism in batches + [([], 10_000, 2)]:
        records = [(k, base + t, v) for k, t, v in records]
        watermark = ref.watermark if not records and advance != 10_000 else max(
            ref.watermark, base + advance - 1 if advance != 10_000 else 10**9)
        table = pa.table({"k": [r[0] for r in records], "t": [r[1] for r in records],
                          "v": [r[2] for r in records]}, schema=SCHEMA)
        out, late = run_batch(location, job, table, parallelism=parallelism, backend=kind, watermark=watermark)
        want_out, want_late = ref.batch(records, watermark)
        assert Multiset(_rounded(out)) == Multiset(_rounded(want_out))
        assert Multiset(late) == Multiset(want_late)
        base += 20


def _rounded(rows):
    return [(*r[:-1], round(r[-1], 9) if r[-1] is not None else None) for r in rows]


@pytest.mark.parametrize("kind_", ["tumbling", "sliding", "session"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 5), st.integers(-5, 9)), max_size=8),
                                  st.integers(0, 12), st.integers(1, 3)), min_size=1, max_size=6))
def test_processing_time_windows_match_the_reference(kind_, kind, tmp_path_factory, batches):
    """Every record of a batch is at the batch's processing time; windows fire once a batch's time reaches their
    end - 1 (the reference's watermark is the processing time)."""
    location = str(tmp_path_factory.mktemp("p") / "chk")
    size, slide = 10, 4
    assigner = {"tumbling": TumblingProcessingTimeWindows.of(size),
                "sliding": SlidingProcessingTimeWindows.of(size, slide),
                "session": ProcessingTimeSessionWindows.with_gap(size)}[kind_]
    job = aggregate_job(assigner, 0)
    ref = Reference(kind_, size, slide, 0)
    now = 1_000
    for records, advance, parallelism in batches:
        now += advance
        rows = [(k, now, v) for k, v in records]
        table = pa.table({"k": [r[0] for r in rows], "t": [0] * len(rows), "v": [r[2] for r in rows]},
                         schema=SCHEMA)
        out, late = run_batch(location, job, table, parallelism=parallelism, backend=kind, watermark=None,
                              processing_time=now)
        # no record is late in processing time, and a window whose end a batch time already passed fires at the
        # end of the batch that put a record in it (its timer is due at once): the reference with no watermark
        ref.watermark = NO_WATERMARK
        want_out, want_late = ref.batch(rows, now)
        assert late == want_late == []
        assert Multiset(_rounded(out)) == Multiset(_rounded(want_out))


def test_processing_time_tumbling_windows_fire_when_the_batch_time_passes(tmp_path):
    location = str(tmp_path / "chk")
    job = window(TumblingProcessingTimeWindows.of(timedelta(milliseconds=100)), input_schema=SCHEMA,
                 key_columns=["k"]).aggregate(Count(), Sum("v"))
    t1 = pa.table({"k": [1, 2, 1], "t": [0, 0, 0], "v": [1, 2, 3]}, schema=SCHEMA)
    out, _ = run_batch(location, job, t1, parallelism=2, backend="heap", watermark=None, processing_time=1050)
    assert out == []
    t2 = pa.table({"k": [1], "t": [0], "v": [10]}, schema=SCHEMA)
    out, _ = run_batch(location, job, t2, parallelism=3, backend="heap", watermark=None, processing_time=1099)
    assert sorted(out) == [(1, 1000, 1100, 3, 14), (2, 1000, 1100, 1, 2)]
    out, _ = run_batch(location, job, t2.slice(0, 0), parallelism=1, backend="heap", watermark=None,
                       processing_time=1250)
    assert out == []


class Listing(ProcessWindowFunction):
    def process(self, key, window, records, context):
        return [(key, window.start, window.end, sorted(records.column("v").to_pylist()))]


def test_process_window_function_gets_the_window_records_as_a_table_and_sessions_merge(kind, tmp_path):
    location = str(tmp_path / "chk")
    out_schema = pa.schema([("k", pa.int64()), ("start", pa.int64()), ("end", pa.int64()),
                            ("vs", pa.list_(pa.int64()))])
    job = window(EventTimeSessionWindows.with_gap(10), input_schema=SCHEMA, key_columns="k",
                 timestamp_column="t").process(Listing(), out_schema)
    t1 = pa.table({"k": [1, 1, 2], "t": [0, 30, 0], "v": [1, 2, 3]}, schema=SCHEMA)
    assert run_batch(location, job, t1, parallelism=2, backend=kind, watermark=5)[0] == []
    # [10, 20) and [20, 30) touch [0, 10), each other and [30, 40): key 1's sessions become [0, 40)
    t2 = pa.table({"k": [1, 1], "t": [20, 10], "v": [4, 5]}, schema=SCHEMA)
    out, _ = run_batch(location, job, t2, parallelism=3, backend=kind, watermark=9)
    assert sorted(out) == [(2, 0, 10, [3])]
    out, _ = run_batch(location, job, t2.slice(0, 0), parallelism=1, backend=kind, watermark=100)
    assert sorted(out) == [(1, 0, 40, [1, 2, 4, 5])]


class Spread(AggregateFunction):
    def create_accumulator(self):
        return (0, 0)

    def add(self, value, accumulator):
        return (accumulator[0] + 1, accumulator[1] + value["v"] * 2)

    def get_result(self, accumulator):
        return accumulator

    def merge(self, a, b):
        return (a[0] + b[0], a[1] + b[1])


def test_python_aggregate_and_reduce_functions(tmp_path):
    location = str(tmp_path / "chk")
    stream = window(TumblingEventTimeWindows.of(10), input_schema=SCHEMA, key_columns="k", timestamp_column="t")
    job = stream.aggregate(PythonAggregate(Spread(), TupleSerializer(Int64Serializer(), Int64Serializer()),
                                           [pa.field("n", pa.int64()), pa.field("twice", pa.int64())]))
    t = pa.table({"k": [1, 1, 1], "t": [1, 2, 11], "v": [1, 2, 5]}, schema=SCHEMA)
    out, _ = run_batch(location, job, t, parallelism=1, backend="heap", watermark=100)
    assert sorted(out) == [(1, 0, 10, 2, 6), (1, 10, 20, 1, 10)]
    job = stream.reduce(operator.mul, "v", Int64Serializer())
    out, _ = run_batch(str(tmp_path / "chk2"), job, t, parallelism=1, backend="heap", watermark=100)
    assert sorted(out) == [(1, 0, 10, 2), (1, 10, 20, 5)]


def test_window_builder_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="timestamp_column"):
        window(TumblingEventTimeWindows.of(10), input_schema=SCHEMA, key_columns="k")
    with pytest.raises(ValueError, match="key_columns"):
        window(TumblingEventTimeWindows.of(10), input_schema=SCHEMA, key_columns="x", timestamp_column="t")
    with pytest.raises(ValueError, match="size"):
        TumblingEventTimeWindows.of(0)
    stream = window(TumblingEventTimeWindows.of(10), input_schema=SCHEMA, key_columns="k", timestamp_column="t")
    with pytest.raises(ValueError, match="no column"):
        stream.aggregate(Sum("missing"))
    with pytest.raises(ValueError, match="repeat"):
        stream.aggregate(Count(), Count())


def test_state_reader_shows_open_windows_with_their_start_and_end(tmp_path):
    from keygroups.runtime.state_reader import KeyedStateReader, load_restore_point, with_window_columns

    location = str(tmp_path / "chk")
    job = aggregate_job(TumblingEventTimeWindows.of(10), 0)
    t = pa.table({"k": [1, 1, 2], "t": [1, 12, 25], "v": [4, 5, 6]}, schema=SCHEMA)
    out, _ = run_batch(location, job, t, parallelism=2, backend="rocksdb", watermark=15)
    assert out == [(1, 0, 10, 1, 4, 4, 4, 4.0)]
    storage = CheckpointStorage(location)
    reader = KeyedStateReader(storage, load_restore_point(storage), "window-contents", flatten=True)
    rows = with_window_columns(pa.Table.from_batches(list(reader.read(kg.KeyGroupRange(0, MAXP - 1))),
                                                     schema=reader.schema))
    assert rows.column_names[:4] == ["key", "key_group", "window_start", "window_end"]
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)

    def ms(t):
        return (t - epoch) // datetime.timedelta(milliseconds=1)

    seen = sorted((r["key"], ms(r["window_start"]), ms(r["window_end"]), r["value"]["_1"], r["value"]["_2"])
                  for r in rows.to_pylist())
    assert seen == [(1, 10, 20, 1, 5), (2, 20, 30, 1, 6)]   # [0, 10) fired and was cleaned up
    with pytest.raises(ValueError, match="flatten=True"):
        with_window_columns(pa.table({"x": [1]}))
