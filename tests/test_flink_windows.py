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
from keygroups.checkpoint import CheckpointStorage
from keygroups.flink import UnsupportedFlinkTypeError, export_savepoint, import_savepoint, read_savepoint
from keygroups.flink.windows import FlinkWindows
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import Int64Serializer
from keygroups.state import ReducingStateDescriptor
from keygroups.state.timers import TimeDomain
from keygroups.testing import KeyedFunctionHarness
from keygroups.testing.harness import HarnessSnapshot
from keygroups.windows import Sum, TumblingEventTimeWindows, TimeWindow, window

needs_flink = pytest.mark.skipif(flink_harness.flink_lib() is None, reason=flink_harness.missing_reason())
FIXTURE = {f.name: f for f in FIXTURE_SET}
SIZE = 10_000


def flink_key(key_type: str, n: int):
    """SavepointJob.key: the key of record n."""
    if key_type == "long":
        return n * 7919 - 50_000
    if key_type == "tuple":
        return (n - 7, "t\U0001F600" if n % 3 == 0 else f"t{n % 5}")
    return f"key-{n}" + ("\U0001F600" if n % 4 == 0 else "") + ("\u00e9" if n % 9 == 0 else "")


def flink_windows(name: str) -> dict[tuple, int]:
    """What the Flink job holds: (key, (start, end)) -> the sum of its window."""
    f = FIXTURE[name]
    return {(flink_key(f.key_type, n), (n * 1000 // SIZE * SIZE, n * 1000 // SIZE * SIZE + SIZE)): n
            for n in range(f.keys)}


def window_entries(sp, uid: str = "window") -> dict[str, set]:
    out: dict[str, set] = {}
    for kg in sp.key_groups(uid):
        for state, entries in kg.entries.items():
            out.setdefault(state, set()).update(entries)
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
    k0, k5 = flink_key(f.key_type, 0), flink_key(f.key_type, 5)
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
    if r.returncode != 0:
        raise RuntimeError(f"the Flink window job failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    fired = {}
    for line in out.read_text(encoding="utf-8").splitlines():
        key, start, end, total = line.split("\t")
        k = json.loads(key)
        fired[(tuple(k) if isinstance(k, list) else k, (int(start), int(end)))] = int(total)
    return fired


@pytest.mark.flink
@needs_flink
@pytest.mark.parametrize("name,parallelism,compression", [("p2-mp128-long-hashmap-inline-plain", 3, False),
                                                           ("p3-mp256-string-rocksdb-files-snappy", 1, True)])
def test_flink_fires_the_windows_keygroups_continued(tmp_path, name, parallelism, compression):
    """Flink -> keygroups (continues: more records, fires the first windows, rescales) -> Flink, which fires the
    remaining windows exactly as keygroups fires them from the same state."""
    f = FIXTURE[name]
    src = FIXTURES / name / "savepoint"
    import_savepoint(src, str(tmp_path / "loc"), "w", uid="window")
    job = reduce_job(f.key_type)
    harness = continued(tmp_path / "loc", "w", job.function, f.key_type, job.output_schema, 2, f.max_parallelism)
    k3, k15 = flink_key(f.key_type, 3), flink_key(f.key_type, 15)
    harness.process([{"k": k3, "t": 1_000, "n": 1_000}, {"k": k15, "t": 19_000, "n": 2_000},
                     {"k": k3, "t": 25_000, "n": 3_000}])
    harness.advance_watermark(SIZE - 1)          # keygroups fires the first windows itself
    first = {(r["k"], (r["window_start"], r["window_end"])): r["n"] for r in harness.output()}
    held = flink_windows(name)
    assert first == {kw: v + (1_000 if kw[0] == k3 else 0) for kw, v in held.items() if kw[1] == (0, SIZE)}
    snapshot = harness.snapshot()
    export_savepoint(snapshot.location, tmp_path / "flink", uid="window", savepoint=snapshot.name, like=src,
                     compression=compression)
    harness.advance_watermark(2**62)
    rest = {(r["k"], (r["window_start"], r["window_end"])): r["n"] for r in harness.output()}
    expected = {kw: v + (2_000 if kw[0] == k15 else 0) for kw, v in held.items() if kw[1] == (SIZE, 2 * SIZE)}
    expected[(k3, (20_000, 30_000))] = 3_000
    assert rest == expected
    assert fire_in_flink(tmp_path / "flink", parallelism, f.key_type, tmp_path / "fired.txt") == rest
