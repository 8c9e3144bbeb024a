"""The compiled import and export of Flink window state (``window-contents`` in ``TimeWindow`` namespaces, window
timers; _native/flinkin.pyx, _native/flinkout.pyx) against the Python path of keygroups.flink.windows, which is
their reference: both write byte-identical files, for the committed Flink fixtures (operator ``window``) and for
keygroups window jobs' state; corrupt window entries raise CorruptSnapshotError."""

from __future__ import annotations

import pathlib

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flink_harness import FIXTURE_SET, FIXTURES
from test_flink_fast_export import _both_paths, _data_files
from test_flink_fast_import import _block_sections, _keyed_files, same_file_ids
from keygroups.errors import CorruptSnapshotError, KeyGroupsError
from keygroups.flink import import_savepoint, read_savepoint
from keygroups.flink import importer
from keygroups.flink.transcode import NotCompiled, state_plan
from keygroups.flink.types import LongType, StringType, TimeWindowType
from keygroups.flink.windows import FlinkWindows
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import BytesSerializer, Int32Serializer, Int64Serializer, StrSerializer
from keygroups.state import ListStateDescriptor, MapStateDescriptor, StateTtlConfig, ValueStateDescriptor
from keygroups.testing import KeyedFunctionHarness
from keygroups.windows import SlidingEventTimeWindows, TimeWindow, TumblingEventTimeWindows, window
from keygroups.windows.assigners import EventTimeSessionWindows

FIXTURE_NAMES = [f.name for f in FIXTURE_SET]


def _python_import_only(monkeypatch):
    def no_fast_plan(st, key_type):
        raise NotCompiled("the Python path, for comparison")
    monkeypatch.setattr(importer, "_fast_plan", no_fast_plan)


def _assert_same_files(fast_dir: pathlib.Path, slow_dir: pathlib.Path, name: str) -> None:
    a, b = _keyed_files(fast_dir, name), _keyed_files(slow_dir, name)
    assert sorted(a) == sorted(b) and a
    if a != b:   # name the first state and key group that differ
        sa, sb = _block_sections(fast_dir, name), _block_sections(slow_dir, name)
        assert sa.keys() == sb.keys()
        for where in sorted(sa):
            assert sa[where] == sb[where], f"key group {where[0]}, state {where[1]!r}"
        pytest.fail("the keyed files differ outside their sections")


def _same_import(tmp_path, monkeypatch, savepoint, uid="window", **kwargs):
    sp = read_savepoint(savepoint)
    same_file_ids(monkeypatch)
    fast = import_savepoint(sp, str(tmp_path / "fast"), "sp", uid=uid, **kwargs)
    with monkeypatch.context() as m:
        same_file_ids(m)
        _python_import_only(m)
        slow = import_savepoint(sp, str(tmp_path / "slow"), "sp", uid=uid, **kwargs)
    assert (fast.entries, fast.timers, fast.key_groups, fast.keyed_states) == \
        (slow.entries, slow.timers, slow.key_groups, slow.keyed_states)
    _assert_same_files(tmp_path / "fast", tmp_path / "slow", "sp")
    return fast


# ---------------------------------------------------------------------------------------------- import

@pytest.mark.parametrize("layout", ["operator", "state"])
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_compiled_window_import_writes_what_the_python_path_writes(tmp_path, monkeypatch, name, layout):
    report = _same_import(tmp_path, monkeypatch, FIXTURES / name / "savepoint", windows=FlinkWindows(layout=layout))
    assert report.entries > 0 and report.timers > 0


@pytest.mark.parametrize("layout", ["operator", "state"])
def test_window_contents_and_window_timers_take_the_compiled_import(layout):
    sp = read_savepoint(FIXTURES / FIXTURE_NAMES[0] / "savepoint")
    infos = [s for s in sp.states("window") if s.keyed]
    plans = [importer._plan(info, i, 1000, windows=FlinkWindows(layout=layout)) for i, info in enumerate(infos)]
    fast = importer._fast_plans(plans, sp.keyed_header("window").key_type)
    assert "window-contents" in fast and any(n.endswith("window-timers") for n in fast)
    assert set(fast) == {st.info.name for st in plans}
    assert all(p.namespaced for p in fast.values())
    # sessions' contents move to their sessions the Python way (operator layout); their timers stay compiled
    sessions = importer._fast_plans(plans, sp.keyed_header("window").key_type, sessions=True)
    moved = {"window-contents"} if layout == "operator" else set()
    assert set(sessions) == set(fast) - moved


# ---------------------------------------------------------------------------------------------- export

def _same_export(monkeypatch, location: str, dest: pathlib.Path, **kwargs):
    """Export compiled (no state on the Python path), then with the Python path alone: the same files."""
    fast, slow = _both_paths(monkeypatch, location, dest, **kwargs)
    assert (fast.entries, fast.timers, fast.key_groups) == (slow.entries, slow.timers, slow.key_groups)
    assert _data_files(dest / "compiled") == _data_files(dest / "python")
    return fast


@pytest.mark.parametrize("layout", ["operator", "state"])
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_compiled_window_export_of_flink_fixtures_is_byte_identical(tmp_path, monkeypatch, name, layout):
    src = FIXTURES / name / "savepoint"
    import_savepoint(src, str(tmp_path / "loc"), "w", uid="window", windows=FlinkWindows(layout=layout))
    report = _same_export(monkeypatch, str(tmp_path / "loc"), tmp_path, uid="window", savepoint="w", like=src,
                          windows=FlinkWindows(layout=layout))
    assert report.entries > 0 and report.timers > 0
    # and the round trip through the compiled paths is Flink's bytes
    original, back = read_savepoint(src), read_savepoint(tmp_path / "compiled")
    assert _entries_of(back) == _entries_of(original)


def _entries_of(sp, uid: str = "window") -> dict[str, set]:
    out: dict[str, set] = {}
    for kg in sp.key_groups(uid):
        for state, entries in kg.entries.items():
            if state != "_timer_state/processing_window-timers":
                out.setdefault(state, set()).update(repr(e) for e in entries)
    return out


def add(a: int, b: int) -> int:
    return a + b


SCHEMA = pa.schema([("k", pa.string()), ("t", pa.int64()), ("n", pa.int64())])


def _window_job_checkpoint(tmp_path, records: list[tuple[str, int, int]], lateness: int, size: int,
                           slide: int | None, watermark: int | None, sessions: bool = False):
    assigner = TumblingEventTimeWindows.of(size) if slide is None else SlidingEventTimeWindows.of(size, slide)
    if sessions:
        assigner = EventTimeSessionWindows.with_gap(size)
    job = window(assigner, input_schema=SCHEMA, key_columns="k", timestamp_column="t",
                 allowed_lateness=lateness).reduce(add, "n", Int64Serializer())
    harness = KeyedFunctionHarness(job.function, "k", output_schema=job.output_schema, input_schema=SCHEMA,
                                   timestamp_column="t", parallelism=2, max_parallelism=128)
    harness.process(pa.table({"k": [r[0] for r in records], "t": [r[1] for r in records],
                              "n": [r[2] for r in records]}, schema=SCHEMA))
    if watermark is not None:      # some windows fired: their cleanup timers (end - 1 + lateness) remain
        harness.advance_watermark(watermark)
    return harness.snapshot()


RECORDS = st.lists(st.tuples(st.sampled_from(["a", "b", "\u00e9", "k" * 40, ""]), st.integers(-50_000, 50_000),
                             st.integers(-(2**40), 2**40)), min_size=1, max_size=60)


@settings(max_examples=15, deadline=None)
@given(records=RECORDS, lateness=st.sampled_from([0, 1, 3_000, 10_000]), size=st.sampled_from([1_000, 10_000]),
       slide=st.sampled_from([None, 500, 5_000]), watermark=st.none() | st.integers(-20_000, 40_000))
def test_compiled_window_export_of_keygroups_window_jobs_is_byte_identical(tmp_path_factory, records, lateness,
                                                                           size, slide, watermark):
    """keygroups window jobs (tumbling and sliding windows, so a key's windows share timestamps; lateness, so
    fired windows keep only their cleanup timer) exported compiled and the Python way: the same bytes."""
    tmp_path = tmp_path_factory.mktemp("job")
    snapshot = _window_job_checkpoint(tmp_path, records, lateness, size, slide if slide and slide < size else None,
                                      watermark)
    with pytest.MonkeyPatch.context() as m:
        _same_export(m, snapshot.location, tmp_path, uid="window", savepoint=snapshot.name,
                     windows=FlinkWindows(allowed_lateness=lateness))
        # and back in: the compiled import of what was exported is the Python path's
        if any(p.name != "_metadata" for p in (tmp_path / "compiled").iterdir()):
            _same_import(tmp_path / "in", m, tmp_path / "compiled")


@settings(max_examples=15, deadline=None)
@given(records=RECORDS, lateness=st.sampled_from([0, 2_000]), gap=st.sampled_from([1_000, 10_000]),
       watermark=st.none() | st.integers(-20_000, 40_000))
def test_compiled_session_export_of_keygroups_session_jobs_is_byte_identical(tmp_path_factory, records, lateness,
                                                                             gap, watermark):
    """Session windows: the compiled export writes Flink's merging-window-set (each session its own state window)
    beside the contents and timers, as the Python path does."""
    tmp_path = tmp_path_factory.mktemp("job")
    snapshot = _window_job_checkpoint(tmp_path, records, lateness, gap, None, watermark, sessions=True)
    with pytest.MonkeyPatch.context() as m:
        report = _same_export(m, snapshot.location, tmp_path, uid="window", savepoint=snapshot.name,
                              windows=FlinkWindows(allowed_lateness=lateness, merging=True))
    if report.entries:
        sp = read_savepoint(tmp_path / "compiled")
        assert any(n == "merging-window-set" for kg in sp.key_groups("window") for n in kg.entries)


def test_a_keys_window_timers_at_one_timestamp_are_one_keygroups_timer(tmp_path, monkeypatch):
    """Sliding windows with lateness = slide: a window's cleanup timer is the next one's trigger. Exported, they
    are two Flink window timers; imported back (compiled), one keygroups timer, as the Python path makes it."""
    records = [("a", 12_000, 1), ("b", 3_000, 2)]
    snapshot = _window_job_checkpoint(tmp_path, records, 5_000, 10_000, 5_000, 10_500)
    exported = _same_export(monkeypatch, snapshot.location, tmp_path, uid="window", savepoint=snapshot.name,
                            windows=FlinkWindows(allowed_lateness=5_000))
    imported = _same_import(tmp_path / "in", monkeypatch, tmp_path / "compiled")
    assert imported.timers == exported.timers
    stored = sum(len(v) for kg in read_savepoint(tmp_path / "compiled").key_groups("window")
                 for n, v in kg.entries.items() if n.endswith("window-timers"))
    harness_timers = sum(1 for _ in snapshot_timers(tmp_path / "in"))
    assert stored == exported.timers and harness_timers < stored


def snapshot_timers(location: pathlib.Path):
    """The keygroups event-time timers of the imported savepoint ``sp``: (key bytes, timestamp)."""
    from keygroups.checkpoint import CheckpointStorage
    from keygroups.runtime.state_reader import load_restore_point
    from keygroups.checkpoint.format import read_key_groups
    from keygroups.state.timers import TIMER_STATE_NAMES, TimeDomain

    storage = CheckpointStorage(str(location / "fast"))
    md = load_restore_point(storage, savepoint="sp")
    name = TIMER_STATE_NAMES[TimeDomain.EVENT_TIME]
    for handle in md.keyed_handles:
        index = [s["name"] for s in handle.states].index(name)
        blocks, _ = read_key_groups(storage, handle, handle.key_group_range, copy=True)
        for block in blocks:
            for state_index, keys, values in block.puts:
                if state_index == index:
                    for k, v in zip(keys, values):
                        yield from ((bytes(k), ts) for ts in _timer_map(v))


def _timer_map(value: bytes) -> list[int]:
    """A timer map's timestamps (frames of u32 length, u32 key length, i64 timestamp, bool)."""
    out, i = [], 0
    while i < len(value):
        out.append(int.from_bytes(value[i + 8:i + 16], "little", signed=True))
        i += 17
    return out


# ---------------------------------------------------------------------------------------------- corrupt bytes

from test_flink_fast_import import _block  # noqa: E402
from keygroups._native import flinkin, flinkout  # noqa: E402


def _window_plans():
    key = LongType()
    contents = state_plan("window-contents", "reducing", key, TimeWindowType(), LongType(), None, False, False, True)
    ttl = state_plan("window-contents", "reducing", key, TimeWindowType(), StringType(), None, True, False)
    timers = state_plan("_timer_state/event_window-timers", "map", key, TimeWindowType(), LongType(), None, False,
                        True)
    return contents, ttl, timers


def _flink_window_entries(n: int) -> list[tuple[int, bytes, bytes]]:
    import struct

    out = []
    for i in range(n):
        window = struct.pack(">qq", i * 10, i * 10 + 10)
        out.append((0, struct.pack(">q", i % 3) + window, struct.pack(">q", i)))
    for i in range(n):
        window = struct.pack(">qq", i * 10, i * 10 + 10)
        out.append((1, struct.pack(">q", i % 3) + window, struct.pack(">q", i) + b"\x04abc"))
    for i in range(n):
        out.append((2, struct.pack(">q", (i * 10 + 9) ^ -(1 << 63)) + struct.pack(">q", i % 3)
                    + struct.pack(">qq", i * 10, i * 10 + 10), b""))
    return out


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 6), cut=st.integers(0, 1 << 12), flips=st.lists(st.tuples(st.integers(0, 1 << 12),
                                                                                  st.integers(0, 7)), max_size=4))
def test_corrupt_flink_window_entries_raise_and_never_crash(n, cut, flips):
    plans = _window_plans()
    block = _block(_flink_window_entries(n), 3, 1)
    scan = flinkin.scan_block(block, 3, 1, 3, "b")
    for sid, plan in enumerate(plans):      # intact: every entry transcodes
        assert plan.transcode(scan, sid)[0] == n
    bad = bytearray(block)
    for pos, bit in flips:
        bad[pos % len(bad)] ^= 1 << bit
    for damaged in (bytes(bad), block[:cut % len(block)]):
        try:
            scan = flinkin.scan_block(damaged, 3, 1, 3, "b")
        except CorruptSnapshotError:
            continue
        for sid, plan in enumerate(plans):
            try:
                plan.transcode(scan, sid)
            except KeyGroupsError:     # CorruptSnapshotError, or a String keygroups cannot hold
                pass


def test_a_window_entry_without_its_window_is_corrupt():
    import struct

    contents, _, timers = _window_plans()
    block = _block([(0, struct.pack(">q", 1) + b"\x00" * 8, struct.pack(">q", 5))], 3, 1)
    with pytest.raises(CorruptSnapshotError, match="a Long needs 8 bytes but 0 remain"):
        contents.transcode(flinkin.scan_block(block, 3, 1, 1, "b"), 0)
    block = _block([(0, struct.pack(">q", 1) + b"\x00" * 16, struct.pack(">q", 5) + b"x")], 3, 1)
    with pytest.raises(CorruptSnapshotError, match="1 bytes follow the value"):
        contents.transcode(flinkin.scan_block(block, 3, 1, 1, "b"), 0)
    block = _block([(0, b"\x00" * 8 + struct.pack(">q", 1) + b"\x00" * 12, b"")], 3, 1)
    with pytest.raises(CorruptSnapshotError, match="a timer.s namespace needs 16 bytes but 12 remain"):
        timers.transcode(flinkin.scan_block(block, 3, 1, 1, "b"), 0)


def _keygroups_window_entries():
    """One key group's keygroups window-contents (Long key -> map TimeWindow -> (Long,)) and timers."""
    import struct

    keys = [struct.pack("<q", k) for k in (1, 2)]
    contents = []
    timers = []
    for k in (1, 2):
        frames = b""
        stamps = b""
        for w in range(k + 1):
            start, end = w * 10, w * 10 + 10
            frames += struct.pack("<II", 4 + 16 + 8, 16) + struct.pack("<qq", start, end) + struct.pack("<q", k)
            stamps += struct.pack("<IIq?", 13, 8, end - 1, True)
        contents.append(frames)
        timers.append(stamps)
    return keys, contents, timers


def _packed(parts: list[bytes]):
    import numpy as np

    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in parts])
    return b"".join(parts), offsets


def _damaged(values: list[bytes], damage: str, cut: int, flips: list[tuple[int, int]]) -> list[bytes]:
    """Each value cut short ("cut") or with the given bits flipped ("flip"), positions taken modulo its length."""
    out = []
    for v in values:
        b = bytearray(v)
        if damage == "cut":
            b = b[:cut % len(b)]
        else:
            for pos, bit in flips:
                b[pos % len(b)] ^= 1 << bit
        out.append(bytes(b))
    return out


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(0, 1 << 12), flips=st.lists(st.tuples(st.integers(0, 1 << 12), st.integers(0, 7)),
                                                    min_size=1, max_size=4))
def test_corrupt_keygroups_window_state_raises_and_never_crashes(cut, flips):
    key = flinkout.Op(flinkout.I64, flinkout.LONG)
    contents = flinkout.StateTranscoder(flinkout.WINDOW_STATE, key, flinkout.Op(
        flinkout.TUPLE, flinkout.FLINK_TUPLE, (flinkout.Op(flinkout.I64, flinkout.LONG),)))
    timers = flinkout.StateTranscoder(flinkout.WINDOW_TIMER_STATE, key, allowed_lateness=5)
    keys, values, stamps = _keygroups_window_entries()
    kd, ko = _packed(keys)
    writer = flinkout.BlockWriter(1)
    writer.start(7)
    writer.note_windows(contents, kd, ko, *_packed(values))
    assert writer.add_state(0, timers, kd, ko, *_packed(stamps)) == (0, 5)
    assert writer.add_state(1, contents, kd, ko, *_packed(values)) == (5, 0)
    assert writer.finish()
    for damage in ("cut", "flip"):
        damaged = _damaged(values, damage, cut, flips)
        writer.start(7)
        try:
            writer.note_windows(contents, kd, ko, *_packed(damaged))
            writer.add_state(0, timers, kd, ko, *_packed(stamps))
            writer.add_state(1, contents, kd, ko, *_packed(damaged))
        except (CorruptSnapshotError, flinkout.UnrepresentableValue):
            pass
        else:   # a flip inside a window or a value is still a window and a value; a cut between frames is a map
            assert damage == "flip" or all(len(v) % 32 == 0 for v in damaged)   # 32-byte frames


# ---------------------------------------------------------------------------------------------- the "state" layout

class PerWindowStates(KeyedProcessFunction):
    """Namespaced value, list and map states per window (the "state" layout's list and map kinds), with or
    without TTL; each record lands in the windows of its time, several per key."""

    def __init__(self, ttl: bool, user_keys: str = "str") -> None:
        self.ttl = ttl
        self.user_keys = user_keys

    def open(self, context):
        user_key = {"str": StrSerializer(), "bytes": BytesSerializer(), "int64": Int64Serializer(),
                    "int32": Int32Serializer()}[self.user_keys]
        descriptors = [ValueStateDescriptor("v", Int64Serializer()), ListStateDescriptor("l", StrSerializer()),
                       MapStateDescriptor("m", user_key, Int64Serializer())]
        ns = TimeWindow.serializer()
        for d in descriptors:
            if self.ttl:
                d.enable_time_to_live(StateTtlConfig(ttl_ms=3_600_000))
        self.states = [context.get_namespaced_state(d, TimeWindow(0, 0), ns) for d in descriptors]

    def process_element(self, record, context):
        value, elements, per_key = self.states
        for w in (TimeWindow(record["t"] // 1000 * 1000, record["t"] // 1000 * 1000 + 1000),
                  TimeWindow(record["t"] // 3000 * 3000, record["t"] // 3000 * 3000 + 3000)):
            for s in self.states:
                s.set_current_namespace(w)
            value.update(record["n"])
            elements.add(f"x{record['n']}\u00e9" * (record["n"] % 3))
            n = record["n"]
            per_key.put({"str": f"k{n % 4}" + "\u00e9" * (n % 3), "bytes": bytes([n % 5]) * (n % 3),
                         "int64": (n % 7 - 3) * 2**40, "int32": n % 9 - 4}[self.user_keys], n)
        return []


@pytest.mark.parametrize("ttl,user_keys", [(False, "str"), (True, "str"), (False, "bytes"), (True, "int64"),
                                           (False, "int32")])
def test_namespaced_list_and_map_states_take_the_compiled_paths(tmp_path, monkeypatch, ttl, user_keys):
    """The "state" layout's namespaced value, list and map states, exported and imported compiled: the Python
    path's bytes both ways."""
    schema = pa.schema([("k", pa.string()), ("t", pa.int64()), ("n", pa.int64())])
    harness = KeyedFunctionHarness(PerWindowStates(ttl, user_keys), "k", output_schema="k string",
                                   input_schema=schema, processing_time=1_000, max_parallelism=128, parallelism=2)
    harness.process([{"k": f"key{i % 37}", "t": (i * 7919) % 20_000, "n": i} for i in range(400)])
    snapshot = harness.snapshot()
    exported = _same_export(monkeypatch, snapshot.location, tmp_path, uid="p", savepoint=snapshot.name,
                            windows=FlinkWindows(layout="state", states={"v": "value", "l": "list", "m": "map"}))
    assert exported.entries > 400
    (tmp_path / "compiled").rename(tmp_path / "flink")
    sp = read_savepoint(tmp_path / "flink")
    infos = [s for s in sp.states("p") if s.keyed]
    plans = [importer._plan(info, i, 1000, windows=FlinkWindows(layout="state")) for i, info in enumerate(infos)]
    assert {"v", "l", "m"} <= set(importer._fast_plans(plans, sp.keyed_header("p").key_type))
    report = _same_import(tmp_path / "in", monkeypatch, tmp_path / "flink", uid="p",
                          windows=FlinkWindows(layout="state"))
    assert set(report.keyed_states) == {"v", "l", "m"} and report.entries > 400


def _list_and_map_frames(k: int) -> tuple[bytes, bytes]:
    """A key's keygroups window list (window -> [str]) and window map ((window, str) -> int64) values."""
    import struct

    lists = maps = b""
    for w in range(k + 1):
        window = struct.pack("<qq", w * 10, w * 10 + 10)
        elements = [f"e{j}\u00e9".encode() for j in range(w + 1)]
        body = struct.pack("<I", len(elements)) + b"".join(struct.pack("<I", len(e)) + e for e in elements)
        lists += struct.pack("<II", 4 + 16 + len(body), 16) + window + body
        user_key = f"u{w}".encode()
        key = window + struct.pack("<I", len(user_key)) + user_key
        maps += struct.pack("<II", 4 + len(key) + 8, len(key)) + key + struct.pack("<q", w)
    return lists, maps


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(0, 1 << 12), flips=st.lists(st.tuples(st.integers(0, 1 << 12), st.integers(0, 7)),
                                                    min_size=1, max_size=4))
def test_corrupt_keygroups_window_lists_and_maps_raise_and_never_crash(cut, flips):
    key = flinkout.Op(flinkout.I64, flinkout.LONG)
    string = flinkout.Op(flinkout.STR, flinkout.STRING, null_mode=flinkout.NULL_AS_STRING)
    lists = flinkout.StateTranscoder(flinkout.WINDOW_LIST_STATE, key, string)
    maps = flinkout.StateTranscoder(flinkout.WINDOW_MAP_STATE, key, flinkout.Op(flinkout.I64, flinkout.LONG),
                                    string, user_key_order=flinkout.USER_KEY_UTF8)
    keys = [k.to_bytes(8, "little") for k in (1, 2)]
    kd, ko = _packed(keys)
    values = [_list_and_map_frames(k) for k in (1, 2)]
    writer = flinkout.BlockWriter(2)
    for which, transcoder in ((0, lists), (1, maps)):
        intact = [v[which] for v in values]
        writer.start(300)
        assert writer.add_state(0, transcoder, kd, ko, *_packed(intact))[0] == 5   # a list or entry per window
        assert writer.finish()
        for damage in ("cut", "flip"):
            damaged = _damaged(intact, damage, cut, flips)
            writer.start(300)
            try:
                writer.note_windows(transcoder, kd, ko, *_packed(damaged))
                writer.add_state(0, transcoder, kd, ko, *_packed(damaged))
                writer.finish()
            except (CorruptSnapshotError, flinkout.UnrepresentableValue):
                pass
