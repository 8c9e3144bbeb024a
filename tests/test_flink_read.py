"""keygroups.flink reads savepoints written by a real Flink 2.3 job (tests/flink/fixtures): every entry, timer and
operator-state element equals what Flink says it holds (expected.txt, written by SavepointJob.java and checked by
Flink restoring the savepoint)."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pytest

from flink_canonical import savepoint_lines
from flink_harness import FIXTURE_SET, FIXTURES
from keygroups.errors import CheckpointNotFoundError, CorruptSnapshotError
from keygroups.flink import (
    UnsupportedFlinkTypeError,
    UnsupportedSavepointError,
    operator_id_for_uid,
    read_savepoint,
)
from keygroups.flink.types import RowType, TtlValue

FIXTURE_NAMES = [f.name for f in FIXTURE_SET]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_every_entry_timer_and_operator_state_element_equals_what_flink_holds(name):
    sp = read_savepoint(FIXTURES / name / "savepoint")
    expected = sorted((FIXTURES / name / "expected.txt").read_text(encoding="utf-8").splitlines())
    got = savepoint_lines(sp)
    assert got == expected


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_operators_are_listed_by_uid_name_and_id(name):
    fixture = next(f for f in FIXTURE_SET if f.name == name)
    sp = read_savepoint(FIXTURES / name / "savepoint")
    op = sp.operator("keyed")
    assert (op.uid, op.name, op.parallelism, op.max_parallelism) == \
        ("keyed", "keyed state", fixture.parallelism, fixture.max_parallelism)
    assert op.operator_id == operator_id_for_uid("keyed")
    assert sp.operator(op.operator_id_hex) is op
    assert sp.read_operator_state("source", "source_offset") == {0: [fixture.keys]}
    with pytest.raises(KeyError, match="no operator with uid 'nope'.*keyed"):
        sp.operator("nope")


def test_states_list_kinds_types_and_ttl():
    sp = read_savepoint(FIXTURES / FIXTURE_NAMES[0] / "savepoint")
    states = {s.name: s for s in sp.states("keyed")}
    assert states["list"].kind == "LIST" and states["map"].kind == "MAP" and states["reducing"].kind == "REDUCING"
    assert states["_timer_state/event_user-timers"].kind == "TIMER"
    assert {n for n, s in states.items() if s.ttl} == {"ttl_value", "ttl_list", "ttl_map"}
    assert (states["op_split"].kind, states["op_union"].kind, states["op_broadcast"].kind) == \
        ("SPLIT_DISTRIBUTE", "UNION", "BROADCAST")
    assert isinstance(states["row"].value_type, RowType)


def test_read_state_streams_arrow_batches_one_key_group_at_a_time():
    sp = read_savepoint(FIXTURES / "p3-mp256-string-rocksdb-files-snappy" / "savepoint")
    batches = list(sp.read_state("keyed", "ttl_map"))
    kgs = [b.column("key_group")[0].as_py() for b in batches]
    assert kgs == sorted(kgs) and len(set(kgs)) == len(kgs)
    assert all(len(set(b.column("key_group").to_pylist())) == 1 for b in batches)
    table = pa.Table.from_batches(batches)
    assert table.schema.names == ["key_group", "key", "user_key", "value", "ttl_timestamp"]
    assert table.schema.field("key").type == pa.string()
    assert all(ts > 1_600_000_000_000 for ts in table.column("ttl_timestamp").to_pylist())
    timers = pa.Table.from_batches(list(sp.read_state("keyed", "_timer_state/event_user-timers")))
    assert timers.schema.names == ["key_group", "key", "timestamp"]
    row = pa.Table.from_batches(list(sp.read_state("keyed", "row")))
    assert row.schema.field("value").type == pa.struct([("f0", pa.int64()), ("f1", pa.string())])
    assert any(v["f1"] is None for v in row.column("value").to_pylist())


def test_key_groups_keep_ttl_timestamps():
    sp = read_savepoint(FIXTURES / FIXTURE_NAMES[1] / "savepoint")
    values = [e[2] for kg in sp.key_groups("keyed", {"ttl_value"}) for e in kg.entries["ttl_value"]]
    assert values and all(isinstance(v, TtlValue) and v.timestamp > 0 for v in values)


def test_missing_savepoint_and_missing_state_file(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no _metadata"):
        read_savepoint(tmp_path)
    src = FIXTURES / "p1-mp128-long-hashmap-files-snappy" / "savepoint"
    shutil.copytree(src, tmp_path / "sp")
    for f in (tmp_path / "sp").iterdir():
        if f.name != "_metadata" and f.stat().st_size > 5000:
            f.unlink()
    sp = read_savepoint(tmp_path / "sp")
    with pytest.raises(CheckpointNotFoundError, match="missing"):
        list(sp.key_groups("keyed"))


def test_unsupported_metadata_version_and_bad_magic_are_named(tmp_path):
    data = bytearray((FIXTURES / FIXTURE_NAMES[0] / "savepoint" / "_metadata").read_bytes())
    data[4:8] = (9).to_bytes(4, "big")
    (tmp_path / "_metadata").write_bytes(data)
    with pytest.raises(UnsupportedSavepointError, match="metadata version 9 is not supported.*3-6"):
        read_savepoint(tmp_path)
    data[0] ^= 0xFF
    (tmp_path / "_metadata").write_bytes(data)
    with pytest.raises(CorruptSnapshotError, match="not a Flink checkpoint metadata file"):
        read_savepoint(tmp_path)


def test_unknown_serializer_is_refused_by_state_and_class(tmp_path):
    src = FIXTURES / "p1-mp128-long-hashmap-files-snappy" / "savepoint"
    shutil.copytree(src, tmp_path / "sp")
    keyed = max((tmp_path / "sp").iterdir(), key=lambda p: p.stat().st_size)
    data = keyed.read_bytes()
    old = b"org.apache.flink.api.common.typeutils.base.BooleanSerializer$BooleanSerializerSnapshot"
    new = b"org.apache.flink.api.java.typeutils.runtime.kryo.KryoSerializerSnapshotXXXXXXXXXXXXXXX"
    assert len(old) == len(new) and old in data
    keyed.write_bytes(data.replace(old, new, 1))
    sp = read_savepoint(tmp_path / "sp")
    with pytest.raises(UnsupportedFlinkTypeError, match=r"state 'bool' \(VALUE_SERIALIZER\).*Kryo"):
        sp.states("keyed")


def test_truncated_keyed_state_file_is_corrupt(tmp_path):
    src = FIXTURES / "p1-mp128-long-hashmap-files-snappy" / "savepoint"
    shutil.copytree(src, tmp_path / "sp")
    keyed = max((tmp_path / "sp").iterdir(), key=lambda p: p.stat().st_size)
    keyed.write_bytes(keyed.read_bytes()[:-100])
    sp = read_savepoint(tmp_path / "sp")
    with pytest.raises(CorruptSnapshotError, match="truncated"):
        list(sp.key_groups("keyed"))


def test_fixtures_stay_small():
    total = sum(p.stat().st_size for f in FIXTURE_SET for p in (FIXTURES / f.name).rglob("*") if p.is_file())
    assert total < 400_000


def _flink_key(key_type: str, n: int):
    """SavepointJob.key(keyType, n)."""
    if key_type == "long":
        return n * 7919 - 50_000
    if key_type == "tuple":
        return (n - 7, "t\U0001F600" if n % 3 == 0 else f"t{n % 5}")
    return f"key-{n}" + ("\U0001F600" if n % 4 == 0 else "") + ("\u00e9" if n % 9 == 0 else "")


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_window_state_and_window_timers_read_with_their_time_windows(name):
    fixture = next(f for f in FIXTURE_SET if f.name == name)
    sp = read_savepoint(FIXTURES / name / "savepoint")
    infos = {s.name: s for s in sp.states("window")}
    assert infos["window-contents"].kind == "REDUCING"
    contents, timers = {}, {}
    for kg in sp.key_groups("window"):
        for key, window, value in kg.entries.get("window-contents", []):
            contents[(key, window)] = value
        for key, window, ts in kg.entries.get("_timer_state/event_window-timers", []):
            timers[(key, window)] = ts
    expected = {}
    for n in range(fixture.keys):
        start = n * 1000 // 10_000 * 10_000
        expected[(_flink_key(fixture.key_type, n), (start, start + 10_000))] = n
    assert contents == expected
    assert timers == {kw: kw[1][1] - 1 for kw in expected}
    batch = next(sp.read_state("window", "window-contents"))
    assert batch.schema.field("namespace").type == pa.struct([("start", pa.int64()), ("end", pa.int64())])
