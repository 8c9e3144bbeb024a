"""Flink states of types keygroups does not map (POJO, Kryo, a Flink Value type, BigInteger, java.time, ...), written
by a real Flink 2.3 job (tests/flink/UnsupportedTypesJob.java; fixture tests/flink/fixtures/unsupported-types): the
header reads on past them, they list, using one refuses by name with the advice, ``skip_states`` leaves them out of
an import that a keyed job then continues; enums, primitive arrays, String[] and Long[] map and read exactly; a
user's own serializer still stops the header, naming the states it hides; damaged snapshots raise clear errors.

Remake the fixture (Java 17 and apache-flink-libraries): ``python -c "import pathlib, sys; sys.path.insert(0,
'tests'); import flink_harness as h; h.write_unsupported_types_savepoint(pathlib.Path('tests/flink/fixtures/
unsupported-types'), keys=8)"`` (it replaces savepoint/ and expected.txt; the flink-marked tests here check a fresh
one against the job too)."""

from __future__ import annotations

import json
import pathlib
import struct
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flink_harness
from flink_harness import FIXTURES
from keygroups.checkpoint import CheckpointStorage
from keygroups.errors import CorruptSnapshotError
from keygroups.flink import UnsupportedFlinkTypeError, read_savepoint
from keygroups.flink import savepoint as savepoint_module
from keygroups.flink._cursor import Cursor, encode_modified_utf8
from keygroups.flink.exporter import export_savepoint
from keygroups.flink.importer import import_savepoint
from keygroups.flink.keyed import read_keyed_header, write_keyed_header
from keygroups.flink.types import (
    EnumType,
    GenericArrayType,
    LongArrayType,
    LongType,
    StringType,
    UnknownSerializerSnapshotError,
    UnsupportedType,
    read_nested_snapshot,
)
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import Int64Serializer, ListSerializer, NullableSerializer, StrSerializer
from keygroups.state import ValueStateDescriptor
from keygroups.testing.harness import HarnessSnapshot, KeyedFunctionHarness

FIXTURE = FIXTURES / "unsupported-types"
JOB = "UnsupportedTypesJob"
#: state → (Flink serializer class, user class) of every state keygroups lists but refuses to use
UNSUPPORTED = {
    "pojo": ("org.apache.flink.api.java.typeutils.runtime.PojoSerializer", f"{JOB}$Point"),
    "kryo": ("org.apache.flink.api.java.typeutils.runtime.kryo.KryoSerializer", f"{JOB}$Opaque"),
    "value": ("org.apache.flink.api.java.typeutils.runtime.ValueSerializer", f"{JOB}$Counter"),
    "pojo_list": ("org.apache.flink.api.java.typeutils.runtime.PojoSerializer", f"{JOB}$Point"),
    "kryo_map": ("org.apache.flink.api.java.typeutils.runtime.kryo.KryoSerializer", f"{JOB}$Opaque"),
    "ttl_pojo": ("org.apache.flink.api.java.typeutils.runtime.PojoSerializer", f"{JOB}$Point"),
    "big_int": ("org.apache.flink.api.common.typeutils.base.BigIntSerializer", None),
    "big_dec": ("org.apache.flink.api.common.typeutils.base.BigDecSerializer", None),
    "instant": ("org.apache.flink.api.common.typeutils.base.InstantSerializer", None),
    "local_date": ("org.apache.flink.api.common.typeutils.base.LocalDateSerializer", None),
}
UNSUPPORTED_OPERATOR = {
    "op_kryo": ("org.apache.flink.api.java.typeutils.runtime.kryo.KryoSerializer", f"{JOB}$Opaque"),
    "op_pojo": ("org.apache.flink.api.java.typeutils.runtime.PojoSerializer", f"{JOB}$Point"),
}
MAPPED = ("long", "string", "enum", "longs", "ints", "doubles", "strings", "boxed")


def _expected(directory: pathlib.Path) -> dict[tuple[str, str], dict]:
    """(operator or 'split'/'union', state) → {key or subtask: value} from the job's expected.txt."""
    out: dict[tuple[str, str], dict] = {}
    for line in (directory / "expected.txt").read_text("utf-8").splitlines():
        kind, state, key, value = line.split("\t")
        out.setdefault((kind, state), {})[int(key)] = json.loads(value)
    return out


def _canonical(v):
    """A value as the job's expected.txt writes it: doubles as "d:" + the hex of their bits."""
    if isinstance(v, float):
        return "d:" + struct.pack(">d", v).hex()
    if isinstance(v, list):
        return [_canonical(x) for x in v]
    return v


def _header_bytes(sp, uid: str) -> tuple[bytes, str]:
    """The keyed header of the operator's first subtask, as Flink wrote it."""
    handle = sp._keyed_handles(sp.operator(uid))[0]
    stream = savepoint_module._Stream(handle.stream, sp._files)
    return bytes(stream.read(0, min(o for o in handle.offsets if o))), stream.where


# ---------------------------------------------------------------------------------------------- reading

def _check_against_job(directory: pathlib.Path) -> None:
    sp = read_savepoint(directory / "savepoint")
    expected = _expected(directory)
    infos = {s.name: s for s in sp.states("keyed")}
    assert set(MAPPED) | set(UNSUPPORTED) | set(UNSUPPORTED_OPERATOR) | {"op_long"} <= set(infos)
    for name in MAPPED:
        got = {r["key"]: _canonical(r["value"]) for b in sp.read_state("keyed", name) for r in b.to_pylist()}
        assert got == expected[("keyed", name)], name
    assert sp.read_operator_state("keyed", "op_long") == expected[("split", "op_long")]
    for name, (serializer, user_class) in {**UNSUPPORTED, **UNSUPPORTED_OPERATOR}.items():
        found = [u for u in _unsupported_in(infos[name].value_type)]
        assert [(u.serializer_class, u.user_class, u.state) for u in found] == [(serializer, user_class, name)]


def _unsupported_in(t):
    from keygroups.flink.types import unsupported_types
    return unsupported_types(t)


def test_states_of_unmapped_types_list_and_the_mapped_ones_read_exactly():
    _check_against_job(FIXTURE)


def test_the_types_flink_wrote_are_recognised():
    infos = {s.name: s for s in read_savepoint(FIXTURE / "savepoint").states("keyed")}
    assert infos["enum"].value_type == EnumType(f"{JOB}$Color", ("RED", "GREEN", "BLUE"))
    assert isinstance(infos["longs"].value_type, LongArrayType)
    assert infos["boxed"].value_type == GenericArrayType(LongType(), "java.lang.Long")
    pojo = infos["pojo"].value_type
    assert isinstance(pojo, UnsupportedType) and pojo.fields == (("label", StringType()), ("x", LongType()))
    assert repr(infos["kryo_map"].value_type) == f"Map(String, KryoSerializer({JOB}$Opaque))"
    assert infos["ttl_pojo"].ttl


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_reading_an_unmapped_state_refuses_by_name_with_the_advice(name):
    serializer, user_class = UNSUPPORTED[name]
    sp = read_savepoint(FIXTURE / "savepoint")
    with pytest.raises(UnsupportedFlinkTypeError) as e:
        list(sp.read_state("keyed", name))
    message = str(e.value)
    assert f"state {name!r}" in message and serializer in message
    assert user_class is None or user_class in message
    assert "State Processor API" in message and f"--skip-state {name}" in message and \
        f"skip_states=[{name!r}]" in message


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_OPERATOR))
def test_reading_unmapped_operator_state_refuses_by_name(name):
    serializer, user_class = UNSUPPORTED_OPERATOR[name]
    with pytest.raises(UnsupportedFlinkTypeError, match=f"state {name!r} uses Flink's {serializer} of "
                       rf"{user_class.replace('$', '[$]')}.*--skip-state {name}"):
        read_savepoint(FIXTURE / "savepoint").read_operator_state("keyed", name)


def test_the_header_writes_back_byte_for_byte():
    """An unmapped serializer's snapshot is kept as Flink wrote it."""
    raw, where = _header_bytes(read_savepoint(FIXTURE / "savepoint"), "keyed")
    header = read_keyed_header(Cursor(raw, where))
    out = bytearray()
    write_keyed_header(out, header)
    assert bytes(out) == raw


def test_a_user_serializer_stops_the_header_naming_the_states_it_hides():
    sp = read_savepoint(FIXTURE / "savepoint")
    with pytest.raises(UnknownSerializerSnapshotError) as e:
        sp.states("custom")
    message = str(e.value)
    assert "state 'negated' (VALUE_SERIALIZER)" in message and f"{JOB}$NegatedSnapshot" in message
    raw, where = _header_bytes(sp, "custom")
    # the states after it, in header order (found past the unknown snapshot); the states before it read
    order = [s for s in ("before", "negated", "after", "last") if encode_modified_utf8(s) in raw]
    after = sorted(order, key=lambda s: raw.index(encode_modified_utf8(s) + b"\x00\x00\x00\x00"))
    hidden = after[after.index("negated") + 1:]
    assert hidden and all(repr(s) in message.split("after it")[1] for s in hidden)


# ---------------------------------------------------------------------------------------------- import

def test_an_import_without_skipping_refuses_by_name_and_leaves_nothing(tmp_path):
    with pytest.raises(UnsupportedFlinkTypeError) as e:
        import_savepoint(FIXTURE / "savepoint", str(tmp_path), "x", uid="keyed")
    for name in UNSUPPORTED:   # every one at once, each with its serializer and its skip
        assert f"state {name!r}" in str(e.value) and UNSUPPORTED[name][0] in str(e.value)
        assert f"--skip-state {name}" in str(e.value)
    assert not (tmp_path / "savepoints" / "x" / "_metadata").exists()
    with pytest.raises(UnsupportedFlinkTypeError, match="operator state 'op_(kryo|pojo)'.*--skip-state op_"):
        import_savepoint(FIXTURE / "savepoint", str(tmp_path), "y", uid="keyed", skip_states=list(UNSUPPORTED))


class ContinueImported(KeyedProcessFunction):
    """Reads the imported states of each key and adds the record's v to 'long'."""

    def open(self, context):
        self.long = context.get_state(ValueStateDescriptor("long", Int64Serializer()))
        self.enum = context.get_state(ValueStateDescriptor("enum", StrSerializer()))
        self.longs = context.get_state(ValueStateDescriptor("longs", ListSerializer(Int64Serializer())))
        self.boxed = context.get_state(ValueStateDescriptor(
            "boxed", ListSerializer(NullableSerializer(Int64Serializer()))))

    def process_element(self, record, context):
        long = self.long.value()
        if long is not None:
            self.long.update(long + record["v"])
        return [(context.current_key, long, self.enum.value(), json.dumps(self.longs.value()),
                 json.dumps(self.boxed.value()))]


def _import_skipping(location: str, name: str):
    return import_savepoint(FIXTURE / "savepoint", location, name, uid="keyed",
                            skip_states=[*UNSUPPORTED, *UNSUPPORTED_OPERATOR])


def test_skipped_states_stay_out_and_a_keyed_job_continues_from_the_rest():
    expected = _expected(FIXTURE)
    location = tempfile.mkdtemp(prefix="keygroups-flink-skip-")   # the HarnessSnapshot deletes it
    report = _import_skipping(location, "from-flink")
    assert set(report.skipped_states) == set(UNSUPPORTED) | set(UNSUPPORTED_OPERATOR)
    assert set(MAPPED) <= set(report.keyed_states) and report.operator_states == ("op_long",)
    snapshot = HarnessSnapshot(location, "from-flink", CheckpointStorage(location).load_savepoint("from-flink"), 0,
                               None)
    schema = "k long, long long, enum string, longs string, boxed string"
    with KeyedFunctionHarness(ContinueImported(), "k", output_schema=schema, input_schema="k long, v long",
                              max_parallelism=128) as base:
        job = base.restore(snapshot, parallelism=3)
        keys = sorted(set(expected[("keyed", "long")]) | set(expected[("keyed", "enum")]))
        job.process([{"k": k, "v": 1} for k in keys])
        got = {r["k"]: r for r in job.output()}
        for k in keys:
            assert got[k]["long"] == expected[("keyed", "long")].get(k)
            assert got[k]["enum"] == expected[("keyed", "enum")].get(k)
            assert json.loads(got[k]["longs"]) == expected[("keyed", "longs")].get(k)
            assert json.loads(got[k]["boxed"]) == expected[("keyed", "boxed")].get(k)
        job.process([{"k": k, "v": 1} for k in keys])
        assert {r["k"]: r["long"] for r in job.output()} == \
            {k: (v + 1 if (v := expected[("keyed", "long")].get(k)) is not None else None) for k in keys}


def test_cli_refuses_by_name_then_imports_with_skip_state(tmp_path, capsys):
    from keygroups.cli import main

    src = str(FIXTURE / "savepoint")
    assert main(["flink", "list", src]) == 0
    out = capsys.readouterr().out
    assert f"KryoSerializer({JOB}$Opaque)" in out and "ttl_pojo" in out
    assert "(its states cannot be listed: " in out and "state 'negated'" in out   # the other operators list
    assert main(["flink", "import", src, str(tmp_path), "--name", "a", "--uid", "keyed"]) == 2
    err = capsys.readouterr().err
    assert "--skip-state" in err and any(f"state {n!r}" in err for n in UNSUPPORTED)
    skips = [a for n in [*UNSUPPORTED, *UNSUPPORTED_OPERATOR] for a in ("--skip-state", n)]
    assert main(["flink", "import", src, str(tmp_path), "--name", "a", "--uid", "keyed", *skips]) == 0
    assert (tmp_path / "savepoints" / "a" / "_metadata").exists()


def test_export_against_the_original_writes_enums_and_arrays_as_flink_had_them(tmp_path):
    """Imported (skipping the unmapped states), then exported with the original savepoint as the template: the
    enum is an ordinal again, long[] and Long[] arrays again, and the values are Flink's."""
    location = str(tmp_path / "kg")
    _import_skipping(location, "from-flink")
    dest = tmp_path / "back"
    export_savepoint(location, dest, uid="keyed", savepoint="from-flink", like=FIXTURE / "savepoint")
    back = read_savepoint(dest)
    infos = {s.name: s for s in back.states("keyed")}
    original = {s.name: s for s in read_savepoint(FIXTURE / "savepoint").states("keyed")}
    expected = _expected(FIXTURE)
    for name in MAPPED:
        assert infos[name].value_type == original[name].value_type, name
        got = {r["key"]: _canonical(r["value"]) for b in back.read_state("keyed", name) for r in b.to_pylist()}
        assert got == expected[("keyed", name)], name


class WritePojoNamedState(KeyedProcessFunction):
    """Keeps a Long state named like the template's POJO state."""

    def open(self, context):
        self.pojo = context.get_state(ValueStateDescriptor("pojo", Int64Serializer()))

    def process_element(self, record, context):
        self.pojo.update(record["v"])
        return []


def test_exporting_into_an_unmapped_state_of_the_template_refuses_by_name(tmp_path):
    """A keygroups state that the template (the original Flink savepoint) holds as a POJO cannot be exported
    like it: refused naming the state and the POJO serializer."""
    with KeyedFunctionHarness(WritePojoNamedState(), "k", output_schema="k long",
                              input_schema="k long, v long") as job:
        job.process([{"k": 1, "v": 5}])
        snapshot = job.snapshot()
        with pytest.raises(UnsupportedFlinkTypeError, match="'pojo'.*PojoSerializer"):
            export_savepoint(snapshot.location, tmp_path / "out", uid="keyed", savepoint=snapshot.name,
                             like=FIXTURE / "savepoint")
    assert not (tmp_path / "out" / "_metadata").exists()


# ---------------------------------------------------------------------------------------------- damaged bytes

def _unsupported_snapshots() -> list[bytes]:
    """Each unmapped serializer's versioned snapshot (class, version, payload) as Flink wrote it."""
    header = read_savepoint(FIXTURE / "savepoint").keyed_header("keyed")
    assert header is not None
    out = []
    for s in header.states:
        for t in _unsupported_in(s.value_type):
            b = bytearray()
            t.write_snapshot(b)
            out.append(bytes(b))
    for t in (next(s for s in header.states if s.name == n).value_type for n in ("enum", "boxed")):
        b = bytearray()
        t.write_snapshot(b)
        out.append(bytes(b))
    return out


SNAPSHOTS = _unsupported_snapshots()


@pytest.mark.parametrize("index", range(len(SNAPSHOTS)))
def test_every_truncation_of_a_snapshot_is_corrupt(index):
    raw = SNAPSHOTS[index]
    assert read_nested_snapshot(Cursor(raw, "snapshot")) is not None
    for cut in range(len(raw)):
        with pytest.raises(CorruptSnapshotError):
            read_nested_snapshot(Cursor(raw[:cut], "snapshot"))


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(index=st.integers(0, len(SNAPSHOTS) - 1), flips=st.lists(st.tuples(st.integers(0, 1 << 20),
                                                                            st.integers(0, 255)), min_size=1,
                                                                  max_size=4))
def test_damaged_snapshots_raise_clear_errors(index, flips):
    raw = bytearray(SNAPSHOTS[index])
    for pos, value in flips:
        raw[pos % len(raw)] = value
    try:
        read_nested_snapshot(Cursor(bytes(raw), "snapshot"))
    except (CorruptSnapshotError, UnsupportedFlinkTypeError):
        pass


HEADERS = [_header_bytes(read_savepoint(FIXTURE / "savepoint"), uid)[0] for uid in ("keyed", "custom")]


@settings(max_examples=200, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, 1), cut=st.integers(0, 1 << 20),
       flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=3))
def test_damaged_headers_raise_clear_errors(which, cut, flips):
    """Truncated or damaged keyed headers (the one of Flink's serializers and the one with a user's serializer,
    whose hidden states are searched for) raise a clear error and never hang."""
    raw = bytearray(HEADERS[which])
    for pos, value in flips:
        raw[pos % len(raw)] = value
    raw = raw[: cut % (len(raw) + 1)]
    try:
        read_keyed_header(Cursor(bytes(raw), "header"))
    except (CorruptSnapshotError, UnsupportedFlinkTypeError):
        pass


# ---------------------------------------------------------------------------------------------- against Flink

@pytest.mark.flink
@pytest.mark.skipif(flink_harness.flink_lib() is None, reason=flink_harness.missing_reason())
def test_a_savepoint_written_now_by_flink_reads_as_its_job_says(tmp_path):
    flink_harness.write_unsupported_types_savepoint(tmp_path / "out", keys=10)
    _check_against_job(tmp_path / "out")
    sp = read_savepoint(tmp_path / "out" / "savepoint")
    with pytest.raises(UnknownSerializerSnapshotError, match="state 'negated'"):
        sp.states("custom")


# ---------------------------------------------------------------------------------------------- from Flink's source

def _versioned(cls: str, version: int, payload: bytes) -> bytes:
    return encode_modified_utf8(cls) + struct.pack(">i", version) + payload


def test_a_version_2_simple_snapshot_names_its_serializer_class():
    """Flink 1.7's SimpleTypeSerializerSnapshot wrote the serializer's class (version 2); 3 writes nothing."""
    cls = "org.apache.flink.api.common.typeutils.base.LongSerializer$LongSerializerSnapshot"
    raw = _versioned(cls, 2, encode_modified_utf8("org.apache.flink.api.common.typeutils.base.LongSerializer"))
    c = Cursor(raw, "snapshot")
    assert read_nested_snapshot(c) == LongType() and c.remaining == 0


def test_an_avro_snapshot_is_skipped_and_refuses_naming_the_record_class():
    """AvroSerializerSnapshot version 2 (flink-avro; not in the apache-flink-libraries wheel, so from Flink's
    source): the runtime type, then the schema, each a writeUTF string."""
    schema = '{"type":"record","name":"Click","fields":[{"name":"url","type":"string"}]}'
    cls = "org.apache.flink.formats.avro.typeutils.AvroSerializerSnapshot"
    raw = _versioned(cls, 2, encode_modified_utf8("com.example.Click") + encode_modified_utf8(schema)) + b"after"
    c = Cursor(raw, "snapshot")
    t = read_nested_snapshot(c)
    assert bytes(c.take(c.remaining)) == b"after"
    assert isinstance(t, UnsupportedType) and t.user_class == "com.example.Click" and "Click" in t.kind
    t.state = "clicks"
    with pytest.raises(UnsupportedFlinkTypeError, match="state 'clicks' uses Flink's org.apache.flink.formats.avro."
                       "typeutils.AvroSerializer of com.example.Click .*--skip-state clicks"):
        t.arrow_type()


def test_enums_and_arrays_inside_a_row_become_record_fields():
    """A Row holding an enum and arrays imports as a record (string, list fields) and writes back as Flink's."""
    from keygroups.flink.types import RowType, StringArrayType, flink_value

    row = RowType((EnumType("Color", ("RED", "GREEN")), LongArrayType(), StringArrayType(),
                   GenericArrayType(LongType(), "java.lang.Long")), names=("color", "ids", "tags", "boxed"))
    value = ("GREEN", [1, -2], ["a", None], [None, 3])
    out = bytearray()
    row.write(out, value)
    assert row.read(Cursor(bytes(out), "row")) == value
    serializer = row.keygroups_serializer()
    record = dict(zip(row.names, value))
    assert serializer.deserialize(serializer.serialize(record)) == record
    again = bytearray()
    row.write(again, flink_value(row, record))
    assert bytes(again) == bytes(out)
    with pytest.raises(ValueError, match="not a constant of enum Color"):
        row.write(bytearray(), ("BLUE", [], [], []))


@pytest.mark.flink
@pytest.mark.skipif(flink_harness.flink_lib() is None, reason=flink_harness.missing_reason())
def test_flink_restores_the_mapped_states_exported_back_after_an_import_that_skipped_the_rest(tmp_path):
    """Import (skipping every unmapped state), export like= the original, and Flink 2.3 restores the enum, the
    arrays, Long and String states and the operator state at another parallelism, equal to what its job wrote."""
    location = str(tmp_path / "kg")
    _import_skipping(location, "from-flink")
    export_savepoint(location, tmp_path / "back", uid="keyed", savepoint="from-flink", like=FIXTURE / "savepoint")
    ok, report = flink_harness.check_unsupported_types_savepoint(tmp_path / "back", 3, FIXTURE / "expected.txt",
                                                                 tmp_path / "dump")
    assert ok, report


def test_a_job_keyed_by_an_unmapped_type_lists_its_states_and_refuses_to_read_any():
    """A keyed header whose key serializer is Kryo (the job keyed by a generic type): it reads, its states list,
    and reading one says the key is the problem (skipping states would not help)."""
    from keygroups.flink.keyed import KeyedBackendHeader

    header = read_savepoint(FIXTURE / "savepoint").keyed_header("keyed")
    assert header is not None
    kryo = next(s for s in header.states if s.name == "kryo").value_type
    long_state = next(s for s in header.states if s.name == "long")
    out = bytearray()
    write_keyed_header(out, KeyedBackendHeader(False, kryo, (long_state,)))
    again = read_keyed_header(Cursor(bytes(out), "header"))
    assert [s.name for s in again.states] == ["long"] and again.key_type == kryo
    with pytest.raises(UnsupportedFlinkTypeError, match=r"the job is keyed by Flink's .*KryoSerializer of "
                       r"UnsupportedTypesJob\$Opaque.*key the job by a basic type"):
        again.key_type.read(Cursor(b"\x00" * 8, "key"))


@pytest.mark.spark
def test_a_keyed_job_on_spark_continues_the_import_that_skipped_the_unmapped_states(spark, tmp_path):
    import sys

    from pyspark import cloudpickle

    from keygroups.spark import KeyedJob

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    expected = _expected(FIXTURE)
    location = str(tmp_path / "chk")
    _import_skipping(location, "from-flink")
    job = KeyedJob("continued", "k", ContinueImported(),
                   output_schema="k long, long long, enum string, longs string, boxed string", max_parallelism=128,
                   checkpoint_location=location, restore_from_savepoint="from-flink")
    keys = sorted(expected[("keyed", "long")])
    out = job.run_batch(spark.createDataFrame([(k, 1) for k in keys], "k long, v long"), parallelism=2).output
    got = {r["k"]: (r["long"], r["enum"], json.loads(r["longs"])) for r in out.collect()}
    assert got == {k: (expected[("keyed", "long")][k], expected[("keyed", "enum")].get(k),
                       expected[("keyed", "longs")].get(k)) for k in keys}


@pytest.mark.parametrize(("snapshot", "serializer"), [
    ("org.apache.flink.streaming.api.windowing.windows.GlobalWindow$Serializer$GlobalWindowSerializerSnapshot",
     "org.apache.flink.streaming.api.windowing.windows.GlobalWindow$Serializer"),
    ("org.apache.flink.api.common.typeutils.base.LocalDateTimeSerializer$LocalDateTimeSerializerSnapshot",
     "org.apache.flink.api.common.typeutils.base.LocalDateTimeSerializer"),
])
def test_simple_snapshots_of_unmapped_serializers_skip_and_name_their_serializer(snapshot, serializer):
    c = Cursor(_versioned(snapshot, 3, b"") + b"next", "snapshot")
    t = read_nested_snapshot(c)
    assert isinstance(t, UnsupportedType) and t.serializer_class == serializer and c.remaining == 4
