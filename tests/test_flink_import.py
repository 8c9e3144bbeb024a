"""Import: a Flink 2.3 savepoint (tests/flink/fixtures) becomes a keygroups savepoint whose keyed state, TTL
timestamps, timers and operator state read back, through keygroups' own state reader, equal to what Flink holds; every
key sits in the key group keygroups computes for it, so a KeyedJob restoring it finds its keys at any parallelism."""

from __future__ import annotations

import struct

import pyarrow as pa
import pytest

from flink_harness import FIXTURE_SET, FIXTURES
from keygroups import assign_key_groups, assign_key_groups_for_tuples
from keygroups.checkpoint import CheckpointStorage
from keygroups.flink import read_savepoint
from keygroups.flink.importer import import_savepoint
from keygroups.flink.types import TtlValue
from keygroups.runtime.state_reader import KeyedStateReader, load_restore_point, operator_state_table, read_timers

FIXTURE_NAMES = [f.name for f in FIXTURE_SET]


def _bits(v):
    """Floats compared by their bits (NaN equals NaN, -0.0 differs from 0.0)."""
    return struct.pack(">d", v) if isinstance(v, float) else v


def _flink_value(v):
    if isinstance(v, float):
        return _bits(v)
    if isinstance(v, TtlValue):
        return _flink_value(v.value)
    if isinstance(v, tuple):
        return tuple(_flink_value(x) for x in v)
    if isinstance(v, list):
        return [_flink_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _flink_value(x) for k, x in v.items()}
    return v


def _kg_value(v):
    if isinstance(v, float):
        return _bits(v)
    if isinstance(v, dict):                       # a struct (tuple) column
        return tuple(_kg_value(x) for x in v.values())
    if isinstance(v, list) and v and isinstance(v[0], tuple):
        return {k: _kg_value(x) for k, x in v}    # a map column
    if isinstance(v, list):
        return [_kg_value(x) for x in v]
    return v


def _key(row):
    """A row's key: one column, or a Tuple key's columns key_1, key_2."""
    return row["key"] if "key" in row else (row["key_1"], row["key_2"])


def _key_groups(rows, fixture):
    """The key groups keygroups computes for the rows' keys (as a KeyedJob placing them would)."""
    if fixture.key_type == "tuple":
        return assign_key_groups_for_tuples([pa.array([r["key_1"] for r in rows], pa.int64()),
                                             pa.array([r["key_2"] for r in rows], pa.string())],
                                            fixture.max_parallelism)
    keys = pa.array([r["key"] for r in rows], type=pa.int64() if fixture.key_type == "long" else pa.string())
    return assign_key_groups(keys, fixture.max_parallelism)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_imported_state_reads_back_equal_to_flinks(tmp_path, name):
    fixture = next(f for f in FIXTURE_SET if f.name == name)
    sp = read_savepoint(FIXTURES / name / "savepoint")
    report = import_savepoint(sp, str(tmp_path), "fromflink", uid="keyed")
    assert (report.parallelism, report.max_parallelism, report.skipped_states) == \
        (fixture.parallelism, fixture.max_parallelism, ())
    assert "row" in report.keyed_states
    storage = CheckpointStorage(str(tmp_path))
    md = load_restore_point(storage, savepoint="fromflink")
    infos = {s.name: s for s in sp.states("keyed")}
    flink: dict[str, dict] = {}
    ttl: dict[str, dict] = {}
    for kg in sp.key_groups("keyed"):
        for state, entries in kg.entries.items():
            for e in entries:
                if infos[state].kind == "MAP":
                    flink.setdefault(state, {}).setdefault(e[0], {})[e[2]] = _flink_value(e[3])
                    ttl.setdefault(state, {}).setdefault(e[0], {})[e[2]] = getattr(e[3], "timestamp", None)
                elif infos[state].kind == "TIMER":
                    flink.setdefault(state, {}).setdefault(e[0], set()).add(e[2])
                else:
                    flink.setdefault(state, {})[e[0]] = _flink_value(e[2])
                    stamp = [x.timestamp for x in e[2]] if infos[state].kind == "LIST" and infos[state].ttl \
                        else getattr(e[2], "timestamp", None)
                    ttl.setdefault(state, {})[e[0]] = stamp
    for state in report.keyed_states:
        reader = KeyedStateReader(storage, md, state)
        rows = [r for part in reader.partitions() for b in reader.read(part) for r in b.to_pylist()]
        got = {_key(r): _kg_value(r["value"]) for r in rows}
        assert got == flink[state], state
        assert _key_groups(rows, fixture).tolist() == [r["key_group"] for r in rows]
        if infos[state].ttl and infos[state].kind == "VALUE":
            assert {_key(r): int(r["ttl_timestamp"].timestamp() * 1000) for r in rows} == ttl[state]
        if infos[state].ttl and infos[state].kind == "LIST":
            assert {_key(r): [int(t.timestamp() * 1000) for t in r["ttl_timestamps"]] for r in rows} == ttl[state]
    timers = read_timers(storage, md).to_pylist()
    for domain, state in (("event-time", "_timer_state/event_user-timers"),
                          ("processing-time", "_timer_state/processing_user-timers")):
        got: dict = {}
        for t in timers:
            if t["domain"] == domain:
                got.setdefault(_key(t), set()).add(t["timestamp"])
        assert got == flink[state]
    for state in ("op_split", "op_union"):
        table = operator_state_table(storage, md, state).to_pylist()
        assert sorted(r["value"] for r in table) == \
            sorted(e for elems in sp.read_operator_state("keyed", state).values() for e in elems)


def test_import_of_a_source_operator_state_uid(tmp_path):
    sp = read_savepoint(FIXTURES / FIXTURE_NAMES[0] / "savepoint")
    report = import_savepoint(sp, str(tmp_path), "withsource", uid="keyed", operator_state_uid="source")
    assert report.operator_states == ("source_offset",)
    storage = CheckpointStorage(str(tmp_path))
    md = load_restore_point(storage, savepoint="withsource")
    assert [r["value"] for r in operator_state_table(storage, md, "source_offset").to_pylist()] == [20]


def test_row_state_becomes_a_record_with_the_given_field_names(tmp_path):
    sp = read_savepoint(FIXTURES / FIXTURE_NAMES[0] / "savepoint")
    import_savepoint(sp, str(tmp_path), "named", uid="keyed", field_names={"row": ["id", "label"]})
    storage = CheckpointStorage(str(tmp_path))
    md = load_restore_point(storage, savepoint="named")
    reader = KeyedStateReader(storage, md, "row")
    table = pa.Table.from_batches([b for part in reader.partitions() for b in reader.read(part)])
    assert table.schema.field("value").type == pa.struct([("id", pa.int64()), ("label", pa.string())])
    flink = {e[0]: e[2] for kg in sp.key_groups("keyed", {"row"}) for e in kg.entries["row"]}
    got = {_key(r): r["value"] for r in table.to_pylist()}
    assert got == {k: {"id": v[0], "label": v[1]} for k, v in flink.items()}
    assert any(v["label"] is None for v in got.values())     # Row fields are nullable: Flink's nulls stay null
    (meta,) = [m for m in md.keyed_handles[0].states if m["name"] == "row"]
    assert meta["serializers"]["value"]["identifier"] == "record"


def test_field_names_that_do_not_fit_are_refused_by_name(tmp_path):
    src = FIXTURES / FIXTURE_NAMES[0] / "savepoint"
    with pytest.raises(ValueError, match="field_names for state 'row'.*2 fields needs 2 distinct"):
        import_savepoint(src, str(tmp_path), "a", uid="keyed", field_names={"row": ["only_one"]})
    with pytest.raises(ValueError, match="field_names gives names for state 'long'.*not a Row or Tuple"):
        import_savepoint(src, str(tmp_path), "b", uid="keyed", field_names={"long": ["x"]})
    with pytest.raises(ValueError, match="field_names names \\['nope'\\]"):
        import_savepoint(src, str(tmp_path), "c", uid="keyed", field_names={"nope": ["x"]})
    with pytest.raises(ValueError, match="skip_states names \\['nope'\\]"):
        import_savepoint(src, str(tmp_path), "d", uid="keyed", skip_states=["row", "nope"])
    assert not (tmp_path / "savepoints").exists() or not list((tmp_path / "savepoints").glob("*/_metadata"))


def test_cli_lists_and_imports_and_refuses_by_name(tmp_path, capsys):
    from keygroups.cli import main

    src = str(FIXTURES / FIXTURE_NAMES[1] / "savepoint")
    assert main(["flink", "list", src]) == 0
    out = capsys.readouterr().out
    assert "operator uid=keyed name=keyed state id=e7beec23fd9f6ed5e1b8395129d43728" in out
    assert "TIMER            _timer_state/event_user-timers: Timer(Long, VoidNamespace)" in out
    assert main(["flink", "import", src, str(tmp_path), "--name", "w", "--uid", "window", "--skip-state",
                 "nope"]) == 2
    assert "skip_states names ['nope']" in capsys.readouterr().err
    assert main(["flink", "import", src, str(tmp_path), "--name", "a", "--uid", "keyed", "--skip-state", "bytes",
                 "--operator-state-uid", "source", "--field-names", "row=id,label"]) == 0
    assert "operator states source_offset; skipped bytes" in capsys.readouterr().out
    assert (tmp_path / "savepoints" / "a" / "_metadata").exists()


def test_keygroups_inspect_reads_an_imported_savepoint(tmp_path, capsys):
    from keygroups.cli import main

    import_savepoint(FIXTURES / FIXTURE_NAMES[0] / "savepoint", str(tmp_path), "fromflink", uid="keyed")
    assert main(["inspect", str(tmp_path), "--savepoint", "fromflink"]) == 0
    out = capsys.readouterr().out
    assert "ttl_map" in out and "128" in out
    assert main(["inspect", str(tmp_path), "--savepoint", "fromflink", "--json"]) == 0
    assert '"event-time"' in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- the watermark

WATERMARK_MS = 1_795_681_600_000            # 2026-11-26T08:26:40Z


@pytest.mark.parametrize("given", [WATERMARK_MS, str(WATERMARK_MS), "2026-11-26T08:26:40Z",
                                   "2026-11-26T09:26:40+01:00", "2026-11-26 08:26:40",
                                   "2026-11-26T08:26:40.000+00:00"])
def test_a_watermark_is_epoch_ms_or_an_iso_time(given):
    import datetime

    from keygroups.flink.importer import parse_watermark

    assert parse_watermark(given) == WATERMARK_MS
    utc = datetime.datetime(2026, 11, 26, 8, 26, 40, 250_000, tzinfo=datetime.timezone.utc)
    assert parse_watermark(utc) == WATERMARK_MS + 250
    assert parse_watermark(utc.replace(tzinfo=None)) == WATERMARK_MS + 250      # a naive time is UTC
    assert parse_watermark("1969-12-31T23:59:59.999Z") == -1


@pytest.mark.parametrize("given, error, says", [
    ("tomorrow", ValueError, "neither epoch milliseconds"),
    (True, TypeError, "int of epoch milliseconds"),
    (2**63, ValueError, "64-bit"),
    (-(2**63), ValueError, "Long.MIN_VALUE, which means no watermark"),
    (1.5, TypeError, "int of epoch milliseconds"),
])
def test_a_watermark_that_is_not_a_time_is_refused_by_name(given, error, says):
    from keygroups.flink.importer import parse_watermark

    with pytest.raises(error, match=says):
        parse_watermark(given)
    import datetime
    with pytest.raises(TypeError, match="a date has no time of day"):
        parse_watermark(datetime.date(2026, 11, 26))


def test_an_import_with_a_watermark_starts_the_first_batch_from_it(tmp_path):
    """Flink's savepoint holds no watermark; the one given is the restore point's, as a checkpoint's would be: the
    runtime's plan starts from it, and a continuing job finds records at or before it late."""
    from datetime import timedelta

    from keygroups.runtime import KeyedProcessFunction, WatermarkStrategy, begin_batch
    from keygroups.testing import KeyedFunctionHarness
    from keygroups.testing.harness import HarnessSnapshot

    src = FIXTURES / FIXTURE_NAMES[0] / "savepoint"
    report = import_savepoint(src, str(tmp_path / "plain"), "x", uid="keyed")
    assert report.watermark is None
    storage = CheckpointStorage(str(tmp_path / "plain"))
    assert "watermark" not in storage.load_savepoint("x").properties
    report = import_savepoint(src, str(tmp_path / "wm"), "x", uid="keyed", watermark="2026-11-26T08:26:40Z")
    assert report.watermark == WATERMARK_MS
    storage = CheckpointStorage(str(tmp_path / "wm"))
    plan = begin_batch(storage, job_name="moved", max_parallelism=report.max_parallelism, parallelism=3,
                       savepoint="x")
    assert plan.start_watermark == WATERMARK_MS

    class Echo(KeyedProcessFunction):
        def process_element(self, record, context):
            return [(context.current_key, record["t"])]

        def on_timer(self, timestamp, context):
            return [(context.current_key, timestamp)]

    harness = KeyedFunctionHarness(Echo(), "k", output_schema="k long, t long", input_schema="k long, t long",
                                   max_parallelism=report.max_parallelism, timestamp_column="t",
                                   watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(timedelta(0)))
    snapshot = HarnessSnapshot(str(tmp_path / "wm"), "x", storage.load_savepoint("x"), 0, None)
    assert snapshot.watermark == WATERMARK_MS
    moved = harness.restore(snapshot, parallelism=2)
    try:
        moved.process([{"k": 1, "t": WATERMARK_MS}, {"k": 2, "t": WATERMARK_MS + 1}])
        assert [r["t"] for r in moved.late()] == [WATERMARK_MS]
        flink_timers = sorted((e[0], e[2]) for kg in read_savepoint(src).key_groups("keyed")
                              for e in kg.entries.get("_timer_state/event_user-timers", []))
        assert flink_timers and all(t <= WATERMARK_MS for _, t in flink_timers)
        out = sorted((r["k"], r["t"]) for r in moved.output())
        assert out == sorted(flink_timers + [(2, WATERMARK_MS + 1)])    # every Flink-era timer fired
    finally:
        moved.close()
        harness.close()


def test_cli_import_takes_a_watermark_and_says_when_there_is_none(tmp_path, capsys):
    from keygroups.cli import main

    src = str(FIXTURES / FIXTURE_NAMES[0] / "savepoint")
    assert main(["flink", "import", src, str(tmp_path), "--name", "a", "--uid", "keyed", "--watermark",
                 "2026-11-26T08:26:40Z"]) == 0
    assert f"watermark {WATERMARK_MS}" in capsys.readouterr().out
    assert CheckpointStorage(str(tmp_path)).load_savepoint("a").properties["watermark"] == WATERMARK_MS
    assert main(["flink", "import", src, str(tmp_path), "--name", "b", "--uid", "keyed"]) == 0
    assert "no watermark (give --watermark" in capsys.readouterr().out
    with pytest.raises(SystemExit) as usage:
        main(["flink", "import", src, str(tmp_path), "--name", "c", "--uid", "keyed", "--watermark", "soon"])
    assert usage.value.code == 2
    assert "--watermark 'soon' is neither epoch milliseconds" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- Tuples: f0, f1, ...

TUPLES = FIXTURES / "p2-mp128-tuple-hashmap-files-plain" / "savepoint"


def test_a_tuple_state_reads_with_flinks_field_names(tmp_path):
    """Flink's Tuple2 value is a record f0, f1 (never null): the state reader (and SQL) has value.f0, as a Flink
    user writes it; its values are Flink's."""
    import_savepoint(TUPLES, str(tmp_path), "t", uid="keyed")
    storage = CheckpointStorage(str(tmp_path))
    md = load_restore_point(storage, savepoint="t")
    sp = read_savepoint(TUPLES)
    for state, fields in (("tuple2", [("f0", pa.int64()), ("f1", pa.string())]),
                          ("tuple3", [("f0", pa.int32()), ("f1", pa.float64()), ("f2", pa.bool_())])):
        reader = KeyedStateReader(storage, md, state)
        table = pa.Table.from_batches([b for part in reader.partitions() for b in reader.read(part)])
        assert table.schema.field("value").type == pa.struct([pa.field(n, t, nullable=False) for n, t in fields])
        flink = {e[0]: e[2] for kg in sp.key_groups("keyed", {state}) for e in kg.entries[state]}
        got = {_key(r): tuple(r["value"].values()) for r in table.to_pylist()}
        assert got == flink and len(got) > 10
        (meta,) = [m for m in md.keyed_handles[0].states if m["name"] == state]
        assert meta["serializers"]["value"]["identifier"] == "record"


def test_a_job_continues_tuple_state_as_a_record_of_f0_f1(tmp_path):
    """The job declares the Tuple state as the record it became (``FlinkStateInfo.value_type`` says which:
    ``state_serializer``), as dicts or, with form='tuple', as tuples; it reads Flink's values and updates them."""
    from keygroups.flink import state_serializer
    from keygroups.runtime import KeyedProcessFunction
    from keygroups.serializers import RecordSerializer
    from keygroups.state import ValueStateDescriptor
    from keygroups.testing import KeyedFunctionHarness
    from keygroups.testing.harness import HarnessSnapshot

    sp = read_savepoint(TUPLES)
    info = {s.name: s for s in sp.states("keyed")}["tuple2"]
    declared = RecordSerializer("f0 bigint not null, f1 string not null")
    assert state_serializer(info.value_type).snapshot() == declared.snapshot()
    report = import_savepoint(sp, str(tmp_path), "t", uid="keyed")
    flink = {e[0]: e[2] for kg in sp.key_groups("keyed", {"tuple2"}) for e in kg.entries["tuple2"]}
    key, before = next(iter(flink.items()))

    class Bump(KeyedProcessFunction):
        def open(self, context):
            self.dicts = context.get_state(ValueStateDescriptor("tuple2", declared))

        def process_element(self, record, context):
            value = self.dicts.value()
            self.dicts.update({"f0": value["f0"] + 1, "f1": value["f1"]})
            return [(value["f0"], value["f1"])]

    harness = KeyedFunctionHarness(Bump(), ["k1", "k2"], output_schema="f0 long, f1 string",
                                   input_schema="k1 long, k2 string", max_parallelism=report.max_parallelism)
    storage = CheckpointStorage(str(tmp_path))
    moved = harness.restore(HarnessSnapshot(str(tmp_path), "t", storage.load_savepoint("t"), 0, None),
                            parallelism=3)
    try:
        moved.process([{"k1": key[0], "k2": key[1]}])
        assert moved.output() == [{"f0": before[0], "f1": before[1]}]
        assert moved.state(key, "tuple2") == {"f0": before[0] + 1, "f1": before[1]}
    finally:
        moved.close()
        harness.close()


def test_tuple_state_goes_back_to_flink_as_its_tuple_without_like(tmp_path):
    """A record of a Tuple's shape (f0, f1, ... none null) is exported as that Flink Tuple even without like=, so
    Flink's TupleSerializer restores it; a Row's record (nullable fields) stays a Row."""
    from keygroups.flink import export_savepoint
    from keygroups.flink.types import RowType, TupleType

    import_savepoint(TUPLES, str(tmp_path / "loc"), "t", uid="keyed")
    export_savepoint(str(tmp_path / "loc"), tmp_path / "flink", uid="keyed", savepoint="t",
                     skip_states=["short", "byte", "float", "char", "row_wide"])
    before = {s.name: s.value_type for s in read_savepoint(TUPLES).states("keyed")}
    after = {s.name: s.value_type for s in read_savepoint(tmp_path / "flink").states("keyed")}
    assert isinstance(after["tuple2"], TupleType) and after["tuple2"] == before["tuple2"]
    assert after["tuple3"] == before["tuple3"] and isinstance(after["row"], RowType)
    flink = {e[0]: e[2] for kg in read_savepoint(TUPLES).key_groups("keyed", {"tuple2"}) for e in kg.entries["tuple2"]}
    back = {e[0]: e[2] for kg in read_savepoint(tmp_path / "flink").key_groups("keyed", {"tuple2"})
            for e in kg.entries["tuple2"]}
    assert back == flink


def test_a_tuples_fields_take_the_names_given_at_the_import_and_go_back_like_the_original(tmp_path):
    from keygroups.flink import export_savepoint

    import_savepoint(TUPLES, str(tmp_path / "loc"), "t", uid="keyed", field_names={"tuple2": ["id", "label"]})
    storage = CheckpointStorage(str(tmp_path / "loc"))
    md = load_restore_point(storage, savepoint="t")
    reader = KeyedStateReader(storage, md, "tuple2")
    table = pa.Table.from_batches([b for part in reader.partitions() for b in reader.read(part)])
    assert table.schema.field("value").type == pa.struct([pa.field("id", pa.int64(), nullable=False),
                                                          pa.field("label", pa.string(), nullable=False)])
    with pytest.raises(ValueError, match="field_names for state 'tuple3': a Tuple of 3 fields needs 3"):
        import_savepoint(TUPLES, str(tmp_path / "bad"), "t", uid="keyed", field_names={"tuple3": ["a", "b"]})
    with pytest.raises(ValueError, match="window state.*only a Row's fields are named"):
        import_savepoint(TUPLES, str(tmp_path / "bad"), "w", uid="window", field_names={"window-contents": ["a"]})
    export_savepoint(str(tmp_path / "loc"), tmp_path / "flink", uid="keyed", savepoint="t", like=TUPLES)
    before = read_savepoint(TUPLES)
    after = read_savepoint(tmp_path / "flink")
    assert {s.name: s.value_type for s in after.states("keyed")}["tuple2"] == \
        {s.name: s.value_type for s in before.states("keyed")}["tuple2"]
    flink = {e[0]: e[2] for kg in before.key_groups("keyed", {"tuple2"}) for e in kg.entries["tuple2"]}
    back = {e[0]: e[2] for kg in after.key_groups("keyed", {"tuple2"}) for e in kg.entries["tuple2"]}
    assert back == flink
