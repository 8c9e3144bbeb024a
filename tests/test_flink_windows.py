"""Flink's window state in and out: a ``WindowOperator``'s ``window-contents`` (keyed state in ``TimeWindow``
namespaces) and window timers (tests/flink/SavepointJob.java, operator ``uid("window")``: 10 s tumbling event-time
windows summing record n at n * 1000 ms) are imported so that a keygroups ``window(...)`` job continues the Flink
windows and fires them with the Flink-era sums, and exported so that Flink's own WindowOperator fires what
keygroups held (the flink-marked tests run Flink 2.3)."""

from __future__ import annotations

import json
import pathlib

import pyarrow as pa
import pytest

import flink_harness
from flink_harness import FIXTURE_SET, FIXTURES
from test_flink_read import _flink_key   # SavepointJob.key: the key of record n
from keygroups.checkpoint import CheckpointStorage
from keygroups.flink import TtlValue, UnsupportedFlinkTypeError, export_savepoint, import_savepoint, read_savepoint
from keygroups.flink.windows import FlinkWindows
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import Int64Serializer, StrSerializer, TupleSerializer
from keygroups.state import (
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtlConfig,
    ValueStateDescriptor,
)
from keygroups.state.timers import TimeDomain
from keygroups.testing import KeyedFunctionHarness
from keygroups.testing.harness import HarnessSnapshot
from keygroups.windows import (
    Count,
    ProcessWindowFunction,
    Sum,
    TimeWindow,
    TumblingEventTimeWindows,
    TumblingProcessingTimeWindows,
    window,
)
from keygroups.windows.assigners import EventTimeSessionWindows

needs_flink = pytest.mark.skipif(flink_harness.flink_lib() is None, reason=flink_harness.missing_reason())
FIXTURE = {f.name: f for f in FIXTURE_SET}
SIZE = 10_000


def flink_windows(name: str) -> dict[tuple, int]:
    """What the Flink job holds: (key, (start, end)) -> the sum of its window."""
    f = FIXTURE[name]
    return {(_flink_key(f.key_type, n), (n * 1000 // SIZE * SIZE, n * 1000 // SIZE * SIZE + SIZE)): n
            for n in range(f.keys)}


def window_entries(sp, uid: str = "window") -> dict[str, set]:
    out: dict[str, set] = {}
    for kg in sp.key_groups(uid):
        for state, entries in kg.entries.items():
            out.setdefault(state, set()).update(tuple(tuple(x) if isinstance(x, list) else x for x in e)
                                                for e in entries)
    return out


def add(a: int, b: int) -> int:
    return a + b


def input_schema(key_type: str) -> pa.Schema:
    return pa.schema([("k", pa.int64() if key_type == "long" else pa.string()), ("t", pa.int64()),
                      ("n", pa.int64())])


def continued(location: pathlib.Path, name: str, function, key_type: str, output_schema, parallelism: int,
              max_parallelism: int) -> KeyedFunctionHarness:
    """A keygroups harness continuing from keygroups savepoint ``name`` of ``location`` (as a KeyedJob restoring it
    would), at ``parallelism``."""
    schema = input_schema(key_type)
    harness = KeyedFunctionHarness(function, "k", output_schema=output_schema, input_schema=schema,
                                   timestamp_column="t", max_parallelism=max_parallelism)
    snapshot = HarnessSnapshot(str(location), name, CheckpointStorage(str(location)).load_savepoint(name), 0, schema)
    return harness.restore(snapshot, parallelism=parallelism)


def reduce_job(key_type: str):
    return window(TumblingEventTimeWindows.of(SIZE), input_schema=input_schema(key_type), key_columns="k",
                  timestamp_column="t").reduce(add, "n", Int64Serializer())


QUICK = ["p2-mp128-long-hashmap-inline-plain", "p3-mp256-string-rocksdb-files-snappy",
         "p2-mp4096-long-rocksdb-inline-plain"]


@pytest.mark.parametrize("name", QUICK)
def test_a_keygroups_window_job_continues_the_flink_windows_and_fires_them_with_their_flink_sums(tmp_path, name):
    f = FIXTURE[name]
    report = import_savepoint(FIXTURES / name / "savepoint", str(tmp_path), "w", uid="window")
    assert report.keyed_states == ("window-contents",) and report.timers == f.keys
    job = reduce_job(f.key_type)
    harness = continued(tmp_path, "w", job.function, f.key_type, job.output_schema, 3, f.max_parallelism)
    held = flink_windows(name)
    # every Flink window timer is the key's event-time timer at the window's end - 1
    assert sorted((t.key, t.timestamp) for t in harness.timers()) == sorted((k, w[1] - 1) for k, w in held)
    assert {t.domain for t in harness.timers()} == {TimeDomain.EVENT_TIME}
    k0, k5 = _flink_key(f.key_type, 0), _flink_key(f.key_type, 5)
    harness.process([{"k": k0, "t": 500, "n": 100}, {"k": k5, "t": 9_999, "n": 1},    # into Flink's windows
                     {"k": k0, "t": 25_000, "n": 7}])                                   # a window of its own
    assert harness.output() == []
    harness.advance_watermark(19_999)
    fired = {(r["k"], (r["window_start"], r["window_end"])): r["n"] for r in harness.output()}
    expected = dict(held)
    expected[(k0, (0, SIZE))] += 100
    expected[(k5, (0, SIZE))] += 1
    assert fired == expected
    harness.advance_watermark(30_000)
    assert harness.output() == [{"k": k0, "window_start": 20_000, "window_end": 30_000, "n": 7}]


def test_sum_reads_the_imported_reduced_values_after_migration(tmp_path):
    name = QUICK[0]
    import_savepoint(FIXTURES / name / "savepoint", str(tmp_path), "w", uid="window")
    job = window(TumblingEventTimeWindows.of(SIZE), input_schema=input_schema("long"), key_columns="k",
                 timestamp_column="t").aggregate(Sum("n", name="n"))
    harness = continued(tmp_path, "w", job.function, "long", job.output_schema, 2, 128)
    harness.advance_watermark(19_999)
    assert {(r["k"], (r["window_start"], r["window_end"])): r["n"] for r in harness.output()} == flink_windows(name)


class FlinkWindowSums(KeyedProcessFunction):
    """Reads the Flink windows' sums as plain namespaced state when the key's timer fires."""

    def open(self, context):
        self.sums = context.get_namespaced_state(ReducingStateDescriptor("window-contents", add, Int64Serializer()),
                                                 TimeWindow(0, 0), TimeWindow.serializer())

    def on_timer(self, timestamp, context):
        out = []
        for w in sorted(self.sums.namespaces()):
            if w[1] - 1 == timestamp:
                self.sums.set_current_namespace(w)
                out.append((context.current_key, w[0], w[1], self.sums.get()))
                self.sums.clear()
        return out


def test_the_state_layout_keeps_flink_values_for_a_function_of_ones_own(tmp_path):
    name = QUICK[1]
    f = FIXTURE[name]
    import_savepoint(FIXTURES / name / "savepoint", str(tmp_path), "w", uid="window",
                     windows=FlinkWindows(layout="state"))
    schema = pa.schema([("k", pa.string()), ("window_start", pa.int64()), ("window_end", pa.int64()),
                        ("n", pa.int64())])
    harness = continued(tmp_path, "w", FlinkWindowSums(), f.key_type, schema, 2, f.max_parallelism)
    harness.advance_watermark(2**62)
    assert {(r["k"], (r["window_start"], r["window_end"])): r["n"] for r in harness.output()} == flink_windows(name)


@pytest.mark.parametrize("name", [f.name for f in FIXTURE_SET])
@pytest.mark.parametrize("layout", ["operator", "state"])
def test_flink_to_keygroups_to_flink_is_exact_for_the_window_operator(tmp_path, name, layout):
    src = FIXTURES / name / "savepoint"
    import_savepoint(src, str(tmp_path / "loc"), "w", uid="window", windows=FlinkWindows(layout=layout))
    report = export_savepoint(str(tmp_path / "loc"), tmp_path / "flink", uid="window", savepoint="w", like=src,
                              windows=FlinkWindows(layout=layout))
    assert (report.entries, report.timers) == (FIXTURE[name].keys, FIXTURE[name].keys)
    original, back = read_savepoint(src), read_savepoint(tmp_path / "flink")
    assert window_entries(back) == window_entries(original)
    assert {(s.name, s.kind, repr(s.namespace_type)) for s in back.states("window") if s.name != "_timer_state/" +
            "processing_window-timers"} == {(s.name, s.kind, repr(s.namespace_type)) for s in original.states("window")
                                             if s.name != "_timer_state/processing_window-timers"}


def fire_in_flink(savepoint: pathlib.Path, parallelism: int, key_type: str, out: pathlib.Path) -> dict[tuple, int]:
    """Flink 2.3 restores the window operator from ``savepoint`` and fires every window it holds (SavepointJob
    ``windows``): (key, (start, end)) -> sum."""
    r = flink_harness._run(["windows", savepoint, parallelism, key_type, out])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return read_firings(out)


def read_firings(out: pathlib.Path) -> dict[tuple, int]:
    """The firings SavepointJob wrote: (key, (start, end)) -> sum."""
    fired = {}
    for line in out.read_text(encoding="utf-8").splitlines():
        key, start, end, total = line.split("\t")
        k = json.loads(key)
        fired[(tuple(k) if isinstance(k, list) else k, (int(start), int(end)))] = int(total)
    return fired


def fire_in_flink_sessions(savepoint: pathlib.Path, parallelism: int, out: pathlib.Path) -> dict[tuple, int]:
    """SavepointJob ``sessions``: Flink restores the session operator and fires every session."""
    r = flink_harness._run(["sessions", savepoint, parallelism, out])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return read_firings(out)


@pytest.mark.flink
@needs_flink
@pytest.mark.parametrize("name,parallelism,compression,like", [
    ("p2-mp128-long-hashmap-inline-plain", 3, False, True),
    ("p3-mp256-string-rocksdb-files-snappy", 1, True, False)])
def test_flink_fires_the_windows_keygroups_continued(tmp_path, name, parallelism, compression, like):
    """Flink -> keygroups (continues: more records, fires the first windows, rescales) -> Flink, which fires the
    remaining windows exactly as keygroups fires them from the same state. Without like=, keygroups' Sum (a
    nullable accumulator) goes to Flink as the Long a reduce holds."""
    f = FIXTURE[name]
    src = FIXTURES / name / "savepoint"
    import_savepoint(src, str(tmp_path / "loc"), "w", uid="window")
    job = reduce_job(f.key_type) if like else window(
        TumblingEventTimeWindows.of(SIZE), input_schema=input_schema(f.key_type), key_columns="k",
        timestamp_column="t").aggregate(Sum("n", name="n"))
    harness = continued(tmp_path / "loc", "w", job.function, f.key_type, job.output_schema, 2, f.max_parallelism)
    k3, k15 = _flink_key(f.key_type, 3), _flink_key(f.key_type, 15)
    harness.process([{"k": k3, "t": 1_000, "n": 1_000}, {"k": k15, "t": 19_000, "n": 2_000},
                     {"k": k3, "t": 25_000, "n": 3_000}])
    harness.advance_watermark(SIZE - 1)          # keygroups fires the first windows itself
    first = {(r["k"], (r["window_start"], r["window_end"])): r["n"] for r in harness.output()}
    held = flink_windows(name)
    assert first == {kw: v + (1_000 if kw[0] == k3 else 0) for kw, v in held.items() if kw[1] == (0, SIZE)}
    snapshot = harness.snapshot()
    export_savepoint(snapshot.location, tmp_path / "flink", uid="window", savepoint=snapshot.name,
                     like=src if like else None, windows=None if like else FlinkWindows(), compression=compression)
    harness.advance_watermark(2**62)
    rest = {(r["k"], (r["window_start"], r["window_end"])): r["n"] for r in harness.output()}
    expected = {kw: v + (2_000 if kw[0] == k15 else 0) for kw, v in held.items() if kw[1] == (SIZE, 2 * SIZE)}
    expected[(k3, (20_000, 30_000))] = 3_000
    assert rest == expected
    assert fire_in_flink(tmp_path / "flink", parallelism, f.key_type, tmp_path / "fired.txt") == rest


class SumRecords(ProcessWindowFunction):
    def process(self, key, window, records, context):
        return [(key, window.start, window.end, sum(records.column("n").to_pylist()), records.num_rows)]


RECORDS_OUT = pa.schema([("k", pa.int64()), ("window_start", pa.int64()), ("window_end", pa.int64()),
                         ("n", pa.int64()), ("count", pa.int64())])


def records_job():
    """A keygroups whole-window job (allowed lateness 5 s) that has taken records for keys 1-3 into two windows."""
    schema = input_schema("long")
    job = window(TumblingEventTimeWindows.of(SIZE), input_schema=schema, key_columns="k", timestamp_column="t",
                 allowed_lateness=5_000).process(SumRecords(), RECORDS_OUT)
    harness = KeyedFunctionHarness(job.function, "k", output_schema=job.output_schema, input_schema=schema,
                                   timestamp_column="t", parallelism=2)
    records = [{"k": k, "t": t, "n": k * 100 + t} for k in (1, 2, 3) for t in (10, 9_999, 10_000, 15_000 + k)]
    harness.process(records[:5])
    harness.process(records[5:])
    return job, schema, harness, records


def test_process_window_records_go_to_flink_as_list_contents_and_come_back(tmp_path):
    """keygroups' whole-window records (Arrow batches) -> Flink ListState contents of Tuple3 records -> keygroups,
    and the windows fire alike; allowed lateness places the cleanup timers."""
    job, schema, original, records = records_job()
    snapshot = original.snapshot()
    spec = FlinkWindows(states={"window-contents": "list"}, record_schema=schema, allowed_lateness=5_000)
    report = export_savepoint(snapshot.location, tmp_path / "flink", uid="w", savepoint=snapshot.name, windows=spec)
    flink = read_savepoint(tmp_path / "flink")
    infos = {s.name: s for s in flink.states("w")}
    assert infos["window-contents"].kind == "LIST" and repr(infos["window-contents"].namespace_type) == "TimeWindow"
    assert repr(infos["window-contents"].value_type) == "List(Tuple3(Long, Long, Long))"
    entries = window_entries(flink, "w")
    windows_of = {(k, (s, s + SIZE)) for k in (1, 2, 3) for s in (0, SIZE)}
    assert {(k, w) for k, w, _ in entries["window-contents"]} == windows_of
    for k, w, elements in entries["window-contents"]:
        assert sorted(elements) == sorted((r["k"], r["t"], r["n"]) for r in records
                                          if r["k"] == k and w[0] <= r["t"] < w[1])
    # the trigger's timer and the cleanup timer of every window
    assert entries["_timer_state/event_window-timers"] == {(k, w, ts) for k, w in windows_of
                                                          for ts in (w[1] - 1, w[1] - 1 + 5_000)}
    assert report.timers == 2 * len(windows_of)

    with pytest.raises(UnsupportedFlinkTypeError, match="record_schema"):
        import_savepoint(tmp_path / "flink", str(tmp_path / "back"), "x", uid="w")
    import_savepoint(tmp_path / "flink", str(tmp_path / "back"), "back", uid="w",
                     windows=FlinkWindows(record_schema=schema))
    back = continued(tmp_path / "back", "back", job.function, "long", job.output_schema, 3, 128)
    fired = []
    for h in (original, back):
        h.process([{"k": 2, "t": 12_000, "n": 5}])
        h.advance_watermark(2**62)
        fired.append(sorted(h.output(), key=lambda r: (r["k"], r["window_start"])))
    assert fired[1] == fired[0]
    assert [(r["k"], r["window_start"], r["count"]) for r in fired[0]] == \
        [(1, 0, 2), (1, SIZE, 2), (2, 0, 2), (2, SIZE, 3), (3, 0, 2), (3, SIZE, 2)]


def test_several_aggregations_are_one_flink_tuple_accumulator_never_a_reducing_state(tmp_path):
    schema = input_schema("long")
    job = window(TumblingEventTimeWindows.of(SIZE), input_schema=schema, key_columns="k",
                 timestamp_column="t").aggregate(Count(), Sum("n"))
    h = KeyedFunctionHarness(job.function, "k", output_schema=job.output_schema, input_schema=schema,
                             timestamp_column="t")
    h.process([{"k": 1, "t": 5, "n": 4}, {"k": 1, "t": 6, "n": 5}])
    snapshot = h.snapshot()
    with pytest.raises(UnsupportedFlinkTypeError, match="window state 'window-contents'.*several aggregations.*"
                                                        "'aggregating'"):
        export_savepoint(snapshot.location, tmp_path / "a", uid="w", savepoint=snapshot.name, windows=FlinkWindows())
    assert not (tmp_path / "a" / "_metadata").exists()
    export_savepoint(snapshot.location, tmp_path / "b", uid="w", savepoint=snapshot.name,
                     windows=FlinkWindows(states={"window-contents": "aggregating"}))
    entries = window_entries(read_savepoint(tmp_path / "b"), "w")
    assert entries["window-contents"] == {(1, (0, SIZE), (2, 9))}
    assert entries["_timer_state/event_window-timers"] == {(1, (0, SIZE), SIZE - 1)}


def test_window_options_are_checked_by_name(tmp_path):
    with pytest.raises(ValueError, match="layout 'ops' is unknown; allowed: \\['operator', 'state'\\]"):
        FlinkWindows(layout="ops")
    with pytest.raises(ValueError, match="unknown Flink state kinds"):
        FlinkWindows(states={"window-contents": "sum"})
    with pytest.raises(ValueError, match="allowed_lateness"):
        FlinkWindows(allowed_lateness=-1)
    import_savepoint(FIXTURES / QUICK[0] / "savepoint", str(tmp_path), "w", uid="window")
    with pytest.raises(ValueError, match="FlinkWindows states \\['nope'\\] are not in the restore point"):
        export_savepoint(str(tmp_path), tmp_path / "out", uid="window", savepoint="w",
                         windows=FlinkWindows(states={"nope": "value"}))
    import_savepoint(FIXTURES / QUICK[0] / "savepoint", str(tmp_path), "k", uid="keyed", skip_states=["row"])
    with pytest.raises(ValueError, match="windows= is given but the restore point has no 'window-contents'"):
        export_savepoint(str(tmp_path), tmp_path / "out", uid="keyed", savepoint="k", windows=FlinkWindows())
    assert not (tmp_path / "out" / "_metadata").exists()


@pytest.mark.flink
@needs_flink
def test_flink_fires_keygroups_whole_window_records_with_their_lateness(tmp_path):
    """keygroups' whole-window records and cleanup timers -> Flink 2.3's WindowOperator (a process window function
    over Tuple3 records, allowed lateness 5 s), which fires each window once with keygroups' records."""
    job, schema, harness, _ = records_job()
    snapshot = harness.snapshot()
    export_savepoint(snapshot.location, tmp_path / "flink", uid="w", savepoint=snapshot.name,
                     windows=FlinkWindows(states={"window-contents": "list"}, record_schema=schema,
                                          allowed_lateness=5_000))
    harness.advance_watermark(2**62)
    kept = {(r["k"], r["window_start"], r["window_end"]): (r["n"], r["count"]) for r in harness.output()}
    assert len(kept) == 6
    r = flink_harness._run(["window-records", tmp_path / "flink", 3, 5_000, tmp_path / "fired.txt"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    fired = {}
    for line in (tmp_path / "fired.txt").read_text(encoding="utf-8").splitlines():
        k, start, end, total, count = map(int, line.split("\t"))
        fired[(k, start, end)] = (total, count)
    assert fired == kept


def test_the_cli_imports_and_exports_window_state(tmp_path, capsys):
    from keygroups.cli import main

    src = FIXTURES / QUICK[0] / "savepoint"
    assert main(["flink", "import", str(src), str(tmp_path / "loc"), "--name", "w", "--uid", "window",
                 "--windows", "state"]) == 0
    assert "keyed states window-contents" in capsys.readouterr().out
    assert main(["flink", "export", str(tmp_path / "loc"), str(tmp_path / "flink"), "--savepoint", "w", "--uid",
                 "window", "--windows", "state", "--window-state", "window-contents=reducing",
                 "--allowed-lateness", "0"]) == 0
    assert window_entries(read_savepoint(tmp_path / "flink")) == window_entries(read_savepoint(src))
    with pytest.raises(SystemExit):
        main(["flink", "export", str(tmp_path / "loc"), str(tmp_path / "x"), "--uid", "window", "--window-state",
              "window-contents"])
    assert "--window-state takes STATE=KIND" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["flink", "import", str(src), str(tmp_path / "loc"), "--name", "x", "--uid", "window",
              "--window-records", "k lung"])
    assert "--window-records takes the records' columns as Spark DDL" in capsys.readouterr().err


def test_processing_time_windows_go_to_flink_processing_window_timers_and_back(tmp_path):
    schema = input_schema("long")
    job = window(TumblingProcessingTimeWindows.of(SIZE), input_schema=schema,
                 key_columns="k").reduce(add, "n", Int64Serializer())
    h = KeyedFunctionHarness(job.function, "k", output_schema=job.output_schema, input_schema=schema,
                             processing_time=123_000)
    h.process([{"k": 7, "t": 0, "n": 2}, {"k": 8, "t": 0, "n": 3}, {"k": 7, "t": 0, "n": 4}])
    snapshot = h.snapshot()
    export_savepoint(snapshot.location, tmp_path / "flink", uid="w", savepoint=snapshot.name,
                     windows=FlinkWindows())
    entries = window_entries(read_savepoint(tmp_path / "flink"), "w")
    assert entries["window-contents"] == {(7, (120_000, 130_000), 6), (8, (120_000, 130_000), 3)}
    assert entries["_timer_state/processing_window-timers"] == {(7, (120_000, 130_000), 129_999),
                                                                (8, (120_000, 130_000), 129_999)}
    assert "_timer_state/event_window-timers" not in entries
    import_savepoint(tmp_path / "flink", str(tmp_path / "back"), "back", uid="w")
    back = continued(tmp_path / "back", "back", job.function, "long", job.output_schema, 1, 128)
    assert {(t.key, t.domain, t.timestamp) for t in back.timers()} == \
        {(7, TimeDomain.PROCESSING_TIME, 129_999), (8, TimeDomain.PROCESSING_TIME, 129_999)}
    back.advance_processing_time(130_000)
    assert sorted((r["k"], r["n"]) for r in back.output()) == [(7, 6), (8, 3)]


def test_a_flink_aggregate_accumulator_is_one_part_of_the_keygroups_accumulator(tmp_path):
    """Flink's AggregatingState holds one accumulator (here a Tuple2 of the counts and sums keygroups exported):
    imported, it is the one part of keygroups' accumulator tuple; exported again, it is the same Tuple2."""
    schema = input_schema("long")
    job = window(TumblingEventTimeWindows.of(SIZE), input_schema=schema, key_columns="k",
                 timestamp_column="t").aggregate(Count(), Sum("n"))
    h = KeyedFunctionHarness(job.function, "k", output_schema=job.output_schema, input_schema=schema,
                             timestamp_column="t")
    h.process([{"k": 1, "t": 5, "n": 4}, {"k": 1, "t": 6, "n": 5}, {"k": 2, "t": 10_001, "n": 1}])
    snapshot = h.snapshot()
    spec = FlinkWindows(states={"window-contents": "aggregating"})
    export_savepoint(snapshot.location, tmp_path / "a", uid="w", savepoint=snapshot.name, windows=spec)
    import_savepoint(tmp_path / "a", str(tmp_path / "loc"), "w", uid="w")
    storage = CheckpointStorage(str(tmp_path / "loc"))
    meta = storage.load_savepoint("w").keyed_handles[0].states
    contents = next(m for m in meta if m["name"] == "window-contents")
    value = contents["serializers"]["map value"]
    assert value["identifier"] == "tuple" and len(value["nested"]) == 1 and value["nested"][0]["identifier"] == "tuple"
    export_savepoint(str(tmp_path / "loc"), tmp_path / "b", uid="w", savepoint="w", like=tmp_path / "a")
    assert window_entries(read_savepoint(tmp_path / "b"), "w") == window_entries(read_savepoint(tmp_path / "a"), "w")


class SessionLike(KeyedProcessFunction):
    """Writes window contents and a state named merging-window-set that is not Flink's record of sessions."""

    def open(self, context):
        self.sums = context.get_namespaced_state(ReducingStateDescriptor("window-contents", add, Int64Serializer()),
                                                 TimeWindow(0, 0), TimeWindow.serializer())
        self.merged = context.get_state(ListStateDescriptor("merging-window-set", TupleSerializer(
            Int64Serializer(), Int64Serializer(), Int64Serializer(), Int64Serializer())))

    def process_element(self, record, context):
        self.sums.set_current_namespace(TimeWindow(0, 5))
        self.sums.add(record["n"])
        self.merged.update([(0, 9, 0, 5)])
        context.timer_service.register_event_time_timer(8)
        return []


def test_a_merging_window_set_that_is_not_flinks_is_refused_by_name(tmp_path):
    h = KeyedFunctionHarness(SessionLike(), "k", output_schema="k long", input_schema=input_schema("long"))
    h.process([{"k": 1, "t": 0, "n": 3}])
    snapshot = h.snapshot()
    export_savepoint(snapshot.location, tmp_path / "flink", uid="s", savepoint=snapshot.name,
                     windows=FlinkWindows(layout="state"))
    with pytest.raises(UnsupportedFlinkTypeError, match="operator 's': state 'merging-window-set' is "
                                                        "List\\(Tuple4.*not Flink's.*layout='state'"):
        import_savepoint(tmp_path / "flink", str(tmp_path / "loc"), "x", uid="s")
    assert not (tmp_path / "loc" / "savepoints" / "x" / "_metadata").exists()
    report = import_savepoint(tmp_path / "flink", str(tmp_path / "loc"), "y", uid="s",
                              windows=FlinkWindows(layout="state"))
    # the timer at 8 ends no window of the key: it fires nothing in keygroups, and Flink gets no window timer
    assert set(report.keyed_states) == {"window-contents", "merging-window-set"} and report.timers == 0


def session_job():
    return window(EventTimeSessionWindows.with_gap(3_000), input_schema=input_schema("long"), key_columns="k",
                  timestamp_column="t").reduce(add, "n", Int64Serializer())


def sessions_of(output) -> dict[tuple, int]:
    return {(r["k"], (r["window_start"], r["window_end"])): r["n"] for r in output}


def test_keygroups_sessions_go_to_flink_each_its_own_state_window_and_come_back(tmp_path):
    job = session_job()
    original = KeyedFunctionHarness(job.function, "k", output_schema=job.output_schema,
                                    input_schema=input_schema("long"), timestamp_column="t", parallelism=2)
    original.process([{"k": 1, "t": 0, "n": 1}, {"k": 1, "t": 2_000, "n": 2}, {"k": 1, "t": 9_000, "n": 4},
                      {"k": 2, "t": 500, "n": 8}])
    snapshot = original.snapshot()
    export_savepoint(snapshot.location, tmp_path / "flink", uid="s", savepoint=snapshot.name,
                     windows=FlinkWindows(merging=True))
    entries = window_entries(read_savepoint(tmp_path / "flink"), "s")
    assert entries["merging-window-set"] == {
        (1, None, (((0, 5_000), (0, 5_000)), ((9_000, 12_000), (9_000, 12_000)))),
        (2, None, (((500, 3_500), (500, 3_500)),))}
    assert entries["window-contents"] == {(1, (0, 5_000), 3), (1, (9_000, 12_000), 4), (2, (500, 3_500), 8)}
    import_savepoint(tmp_path / "flink", str(tmp_path / "back"), "back", uid="s")
    back = continued(tmp_path / "back", "back", job.function, "long", job.output_schema, 3, 128)
    fired = []
    for h in (original, back):
        h.process([{"k": 1, "t": 4_000, "n": 16}, {"k": 1, "t": 6_500, "n": 32}])   # key 1's sessions join
        h.advance_watermark(2**62)
        fired.append(sessions_of(h.output()))
    assert fired[0] == fired[1] == {(1, (0, 12_000)): 55, (2, (500, 3_500)): 8}


@pytest.mark.flink
@needs_flink
def test_flink_sessions_continue_in_keygroups_and_flink_fires_them_as_keygroups_does(tmp_path):
    """Flink 2.3 writes session windows (contents under Flink's state windows); keygroups moves them to their
    sessions, merges new records into them, and Flink restores the export and fires what keygroups fires."""
    r = flink_harness._run(["write-sessions", tmp_path / "out", 2, 24])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    src = tmp_path / "out" / "savepoint"
    assert any(state_window != session for kg in read_savepoint(src).key_groups("sessions")
               for _, _, pairs in kg.entries["merging-window-set"] for session, state_window in pairs)
    import_savepoint(src, str(tmp_path / "loc"), "s", uid="sessions")
    job = session_job()
    harness = continued(tmp_path / "loc", "s", job.function, "long", job.output_schema, 2, 128)
    harness.process([{"k": 1, "t": 5_000, "n": 1_000}, {"k": 2, "t": 14_000, "n": 2_000},
                     {"k": 3, "t": 40_000, "n": 3_000}])
    snapshot = harness.snapshot()
    export_savepoint(snapshot.location, tmp_path / "flink", uid="sessions", savepoint=snapshot.name, like=src)
    harness.advance_watermark(2**62)
    kept = sessions_of(harness.output())
    # SavepointJob.sessionTime: key k has records k, k+4, k+8 at 0, 2, 4 s and k+12, k+16, k+20 at 16, 18, 20 s
    expected = {(k, (0, 7_000)): 3 * k + 12 for k in range(4)} | {(k, (16_000, 23_000)): 3 * k + 48 for k in range(4)}
    expected[(1, (0, 8_000))] = expected.pop((1, (0, 7_000))) + 1_000
    expected[(2, (14_000, 23_000))] = expected.pop((2, (16_000, 23_000))) + 2_000
    expected[(3, (40_000, 43_000))] = 3_000
    assert kept == expected
    assert fire_in_flink_sessions(tmp_path / "flink", 3, tmp_path / "fired.txt") == kept


TTL = StateTtlConfig(ttl_ms=3_600_000)


class PerWindow(KeyedProcessFunction):
    """Namespaced value, list and map states (with TTL) per window; a record with n < 0 lists them instead."""

    def open(self, context):
        value = ValueStateDescriptor("v", Int64Serializer())
        value.enable_time_to_live(TTL)
        per_key = MapStateDescriptor("m", StrSerializer(), Int64Serializer())
        per_key.enable_time_to_live(TTL)
        elements = ListStateDescriptor("l", StrSerializer())
        elements.enable_time_to_live(TTL)
        ns = TimeWindow.serializer()
        self.value = context.get_namespaced_state(value, TimeWindow(0, 0), ns)
        self.list = context.get_namespaced_state(elements, TimeWindow(0, 0), ns)
        self.map = context.get_namespaced_state(per_key, TimeWindow(0, 0), ns)

    def process_element(self, record, context):
        windows = [TimeWindow(0, SIZE), TimeWindow(SIZE, 2 * SIZE)]
        if record["n"] < 0:
            out = []
            for w in windows:
                for s in (self.value, self.list, self.map):
                    s.set_current_namespace(w)
                out.append((context.current_key, w.start, repr((self.value.value(), self.list.get(),
                                                                 sorted(self.map.items())))))
            return out
        w = windows[record["t"] // SIZE]
        for s in (self.value, self.list, self.map):
            s.set_current_namespace(w)
        self.value.update(record["n"])
        self.list.add(f"x{record['n']}")
        self.map.put(f"k{record['n'] % 2}", record["n"])
        return []


def test_namespaced_value_list_and_map_states_with_ttl_go_to_flink_and_back(tmp_path):
    schema = input_schema("long")
    out = "k long, window_start long, states string"
    original = KeyedFunctionHarness(PerWindow(), "k", output_schema=out, input_schema=schema, processing_time=1_000)
    original.process([{"k": k, "t": t, "n": k * 10 + t // 1000} for k in (1, 2) for t in (0, 3_000, 12_000)])
    snapshot = original.snapshot()
    export_savepoint(snapshot.location, tmp_path / "flink", uid="p", savepoint=snapshot.name,
                     windows=FlinkWindows(layout="state", states={"v": "value", "l": "list", "m": "map"}))
    flink = read_savepoint(tmp_path / "flink")
    infos = {s.name: s for s in flink.states("p")}
    assert {n: (infos[n].kind, infos[n].ttl, repr(infos[n].namespace_type)) for n in "vlm"} == {
        "v": ("VALUE", True, "TimeWindow"), "l": ("LIST", True, "TimeWindow"), "m": ("MAP", True, "TimeWindow")}
    entries = window_entries(flink, "p")
    assert (1, (0, SIZE), TtlValue(13, 1_000)) in entries["v"]
    assert (2, (SIZE, 2 * SIZE), (TtlValue("x32", 1_000),)) in entries["l"]
    assert (1, (0, SIZE), "k1", TtlValue(13, 1_000)) in entries["m"]
    import_savepoint(tmp_path / "flink", str(tmp_path / "back"), "back", uid="p", ttl_ms=TTL.ttl_ms,
                     windows=FlinkWindows(layout="state"))
    back = continued(tmp_path / "back", "back", PerWindow(), "long", out, 2, 128)
    listed = []
    for h in (original, back):
        h.process([{"k": 1, "t": 0, "n": -1}, {"k": 2, "t": 0, "n": -1}])
        listed.append(sorted(h.output(), key=lambda r: (r["k"], r["window_start"])))
    assert listed[0] == listed[1]
    assert listed[0][0]["states"] == "(13, ['x10', 'x13'], [('k0', 10), ('k1', 13)])"
