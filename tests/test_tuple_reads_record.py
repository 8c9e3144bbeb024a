"""A Flink Tuple imported as a record (fields f0, f1, ...) and declared with the ``TupleSerializer`` Flink users know:
read by position after migration, element i from field i (each element as is or after its own migration), on both
backends, and rewritten as tuples; any other record, or an element that cannot read its field, is refused with a
``StateMigrationError`` naming the state and what does not fit."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flink_harness import FIXTURES
from keygroups import assign_to_operator, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.errors import StateMigrationError
from keygroups.flink import read_savepoint
from keygroups.flink.importer import import_savepoint
from keygroups.runtime import KeyedProcessFunction
from keygroups.serializers import (
    BoolSerializer,
    BytesSerializer,
    Compatibility,
    Float64Serializer,
    Int32Serializer,
    Int64Serializer,
    ListSerializer,
    MapSerializer,
    NullableSerializer,
    RecordSerializer,
    StrSerializer,
    TupleSerializer,
    ValueSerializer,
    resolve_compatibility,
)
from keygroups.serializers.schema import (
    BINARY,
    BOOL,
    DATE,
    FLOAT32,
    FLOAT64,
    INT8,
    INT16,
    INT32,
    INT64,
    STRING,
    DataType,
    DecimalType,
    Field,
    ListType,
    MapType,
    PrimitiveType,
    RecordType,
)
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    RocksDBKeyedStateBackend,
    ValueStateDescriptor,
)
from keygroups.testing import KeyedFunctionHarness
from keygroups.testing.harness import HarnessSnapshot
from record_strategies import values_of

TUPLES = FIXTURES / "p2-mp128-tuple-hashmap-files-plain" / "savepoint"
BACKENDS = {"heap": HeapKeyedStateBackend, "rocksdb": RocksDBKeyedStateBackend}
AFTER = Compatibility.COMPATIBLE_AFTER_MIGRATION

# The serializers the old guide had users declare for the fixture's Tuple2<Long, String> and
# Tuple3<Integer, Double, Boolean> (``TupleType.keygroups_serializer()``), and a Row(Long, String) read as a tuple
# of nullable elements.
PAIR = TupleSerializer(Int64Serializer(), StrSerializer())
TRIPLE = TupleSerializer(Int32Serializer(), Float64Serializer(), BoolSerializer())
ROW = TupleSerializer(NullableSerializer(Int64Serializer()), NullableSerializer(StrSerializer()))


class ReadsTuples(KeyedProcessFunction):
    """Outputs the key's Tuple2, Tuple3 and Row as read (and whether each came back as a tuple), then bumps the
    Tuple2's f0."""

    def open(self, context):
        self.pair = context.get_state(ValueStateDescriptor("tuple2", PAIR))
        self.triple = context.get_state(ValueStateDescriptor("tuple3", TRIPLE))
        self.row = context.get_state(ValueStateDescriptor("row", ROW))

    def process_element(self, record, context):
        values = [self.pair.value(), self.triple.value(), self.row.value()]
        if values[0] is not None:
            self.pair.update((values[0][0] + 1, values[0][1]))
        return [(record["k1"], record["k2"], all(v is None or type(v) is tuple for v in values), json.dumps(values))]


def _flink_values(state):
    sp = read_savepoint(TUPLES)
    return {e[0]: e[2] for kg in sp.key_groups("keyed", {state}) for e in kg.entries[state]}


def _read_all(harness, keys):
    harness.process([{"k1": k[0], "k2": k[1]} for k in keys])
    out = harness.output()
    assert all(row["tuples"] for row in out)
    return {(row["k1"], row["k2"]): json.loads(row["values"]) for row in out}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_flink_tuple_state_declared_with_tuple_serializer_reads_as_tuples(tmp_path, backend):
    sp = read_savepoint(TUPLES)
    infos = {s.name: s for s in sp.states("keyed")}
    assert infos["tuple2"].value_type.keygroups_serializer() == PAIR     # what the old guide said to declare
    assert infos["tuple3"].value_type.keygroups_serializer() == TRIPLE
    report = import_savepoint(sp, str(tmp_path), "t", uid="keyed")
    pairs, triples, rows = _flink_values("tuple2"), _flink_values("tuple3"), _flink_values("row")
    keys = sorted(set(pairs) | set(triples) | set(rows))
    assert min(len(pairs), len(triples), len(rows)) > 10

    def expected(bumped):
        return {k: [None if k not in pairs else [pairs[k][0] + bumped, pairs[k][1]],
                    None if k not in triples else list(triples[k]), None if k not in rows else list(rows[k])]
                for k in keys}

    harness = KeyedFunctionHarness(ReadsTuples(), ["k1", "k2"], input_schema="k1 long, k2 string",
                                   output_schema="k1 long, k2 string, tuples boolean, values string",
                                   max_parallelism=report.max_parallelism, backend=backend)
    storage = CheckpointStorage(str(tmp_path))
    moved = harness.restore(HarnessSnapshot(str(tmp_path), "t", storage.load_savepoint("t"), 0, None),
                            parallelism=3)
    try:
        # every key, in one batch: Flink's values as tuples (JSON turns tuples into lists)
        first = _read_all(moved, keys)
        assert first == expected(0)
        # the checkpoint after the migration holds the states as tuples only
        for state in ("tuple2", "tuple3", "row"):
            stored = {m["serializers"]["value"]["identifier"] for h in moved.checkpoint.keyed_handles
                      for m in h.states if m["name"] == state}
            assert stored == {"tuple"}, state
        # a second batch reads what the first wrote (and what it rewrote without touching it) ...
        second = _read_all(moved, keys)
        assert second == expected(1)
        # ... and so does a restore on the other backend at another parallelism, as is now
        again = moved.restore(moved.snapshot(), parallelism=2, backend="heap" if backend == "rocksdb" else "rocksdb")
        key = next(iter(pairs))
        assert again.state(key, "tuple2") == (pairs[key][0] + 2, pairs[key][1])
        assert _read_all(again, keys) == expected(2)
    finally:
        moved.close()
        harness.close()


class DeclaresOne(KeyedProcessFunction):
    def __init__(self, serializer):
        self.serializer = serializer

    def open(self, context):
        self.pair = context.get_state(ValueStateDescriptor("tuple2", self.serializer))

    def process_element(self, record, context):
        return [(str(self.pair.value()),)]


@pytest.mark.parametrize("declared, words", [
    (TupleSerializer(StrSerializer(), StrSerializer()),
     "element 0 (StrSerializer()) cannot read field 'f0' (bigint not null)"),
    (TupleSerializer(Int32Serializer(), StrSerializer()),
     "element 0 (Int32Serializer()) cannot read field 'f0' (bigint not null)"),   # never narrowed
    (TupleSerializer(Int64Serializer()), "the stored record has 2 field(s), the tuple 1"),
])
def test_a_tuple_that_cannot_read_the_record_is_refused_naming_state_and_element(tmp_path, declared, words):
    report = import_savepoint(TUPLES, str(tmp_path), "t", uid="keyed")
    harness = KeyedFunctionHarness(DeclaresOne(declared), ["k1", "k2"], input_schema="k1 long, k2 string",
                                   output_schema="v string", max_parallelism=report.max_parallelism)
    storage = CheckpointStorage(str(tmp_path))
    moved = harness.restore(HarnessSnapshot(str(tmp_path), "t", storage.load_savepoint("t"), 0, None))
    key = next(iter(_flink_values("tuple2")))
    try:
        with pytest.raises(StateMigrationError) as info:
            moved.process([{"k1": key[0], "k2": key[1]}])
        assert "state 'tuple2'" in str(info.value) and words in str(info.value)
    finally:
        moved.close()
        harness.close()


def test_only_a_tuples_record_reads_as_a_tuple():
    named = RecordSerializer("id bigint not null, label string not null")
    with pytest.raises(StateMigrationError, match="fields are a Tuple's, named f0, f1, ... .* the stored record's "
                                                  "are id, label: declare the state with RecordSerializer"):
        resolve_compatibility("s", named.snapshot(), PAIR)
    swapped = RecordSerializer("f1 bigint not null, f0 string not null")   # not in order
    with pytest.raises(StateMigrationError, match="are f1, f0"):
        resolve_compatibility("s", swapped.snapshot(), PAIR)
    with pytest.raises(StateMigrationError, match="field 'f0' \\(date\\) has no tuple element serializer"):
        resolve_compatibility("s", RecordSerializer("f0 date").snapshot(), TupleSerializer(Int64Serializer()))
    with pytest.raises(StateMigrationError, match="cannot read field 'f0' \\(bigint\\).*NullableSerializer"):
        resolve_compatibility("s", RecordSerializer("f0 bigint").snapshot(), TupleSerializer(Int64Serializer()))
    with pytest.raises(StateMigrationError, match="must be compatible as is"):   # keys never migrate
        resolve_compatibility("s", RecordSerializer("f0 bigint not null").snapshot(),
                              TupleSerializer(Int64Serializer()), role="key")


# ---- random record <-> tuple shapes, both backends ------------------------------------------------------------------

_HELD = {"int8": Int32Serializer, "int16": Int32Serializer, "int32": Int32Serializer, "int64": Int64Serializer,
         "float32": Float64Serializer, "float64": Float64Serializer, "bool": BoolSerializer, "string": StrSerializer,
         "binary": BytesSerializer}
_READABLE = [INT8, INT16, INT32, INT64, FLOAT32, FLOAT64, BOOL, STRING, BINARY]
_MAP_KEYS = [INT32, INT64, STRING, BINARY, BOOL]


def _tuple_names(n, scala):
    return [f"_{i + 1}" if scala else f"f{i}" for i in range(n)]


@st.composite
def tuple_records(draw, depth=0):
    """A record a Tuple became: fields f0, f1, ... (or _1, _2, ...) of types every tuple element can read."""
    n = draw(st.integers(1, 4 if depth == 0 else 2))
    scala = draw(st.booleans())
    fields = []
    for name in _tuple_names(n, scala):
        t = draw(readable_types(depth))
        fields.append(Field(name, t, draw(st.booleans())))
    return RecordType(tuple(fields))


def readable_types(depth):
    leaves = st.sampled_from(_READABLE)
    if depth >= 2:
        return leaves
    return st.one_of(
        leaves, leaves,
        st.builds(ListType, leaves, st.booleans()),
        st.builds(MapType, st.sampled_from(_MAP_KEYS), leaves, st.booleans()),
        tuple_records(depth + 1),
        st.builds(ListType, tuple_records(depth + 1), st.booleans()),
    )


@st.composite
def element_for(draw, t: DataType, nullable: bool):
    """(a serializer reading a position of type ``t``, what it makes of a dict-form record value there)."""
    ser, convert = draw(_non_null_element(t))
    if nullable or draw(st.booleans()):   # X -> Nullable(X') after migration; a nullable field needs Nullable
        return NullableSerializer(ser), (lambda v: None if v is None else convert(v))
    return ser, convert


def _same(v):
    return v


@st.composite
def _non_null_element(draw, t: DataType):
    if isinstance(t, PrimitiveType):
        held = _HELD[t.name]
        choices = [(held(), _same)]
        if held is Int32Serializer:    # widened
            choices += [(Int64Serializer(), _same), (Float64Serializer(), float)]
        if t.name in ("int32", "int64", "string", "bool"):
            choices.append((ValueSerializer(), _same))
        return draw(st.sampled_from(choices))
    if isinstance(t, ListType):
        element, convert = draw(element_for(t.element, t.element_nullable))
        return ListSerializer(element), lambda v: [convert(x) for x in v]
    if isinstance(t, MapType):
        key = _HELD[t.key.name]()
        value, convert = draw(element_for(t.value, t.value_nullable))
        return MapSerializer(key, value), lambda v: {k: convert(x) for k, x in v.items()}
    assert isinstance(t, RecordType)
    if draw(st.booleans()):   # a nested Tuple: read by position too
        return draw(tuple_for(t))
    form = draw(st.sampled_from(["dict", "tuple"]))   # a nested record, read as is in the form declared
    ser = RecordSerializer(t, form=form)
    return ser, (_same if form == "dict" else lambda v: ser.deserialize(ser.serialize(v)))


@st.composite
def tuple_for(draw, record: RecordType):
    """A TupleSerializer that reads ``record`` by position, and the tuple it makes of a dict-form value."""
    parts = [draw(element_for(f.type, f.nullable)) for f in record.fields]
    names = record.names

    def convert(v):
        return tuple(c(v[n]) for n, (_, c) in zip(names, parts))
    return TupleSerializer(*(s for s, _ in parts)), convert


@st.composite
def refused_tuple_for(draw, record: RecordType):
    """(the stored record, a TupleSerializer that cannot read it by position, words the refusal holds)."""
    ser, _ = draw(tuple_for(record))
    elements = list(ser.fields)
    how = draw(st.sampled_from(["arity", "element", "names", "date", "nullable"]))
    i = draw(st.integers(0, len(elements) - 1))
    f = record.fields[i]
    if how == "arity":
        elements = elements + [Int64Serializer()] if draw(st.booleans()) or len(elements) == 1 else elements[1:]
        return record, TupleSerializer(*elements), f"the stored record has {len(record.fields)} field(s)"
    if how == "names":
        renamed = RecordType(tuple(Field(f"x{j}", g.type, g.nullable) for j, g in enumerate(record.fields)))
        return renamed, ser, "fields are a Tuple's"
    if how == "date":
        dated = RecordType(record.fields[:i] + (Field(f.name, draw(st.sampled_from([DATE, DecimalType(10, 2)])),
                                                      f.nullable),) + record.fields[i + 1:])
        return dated, ser, f"field {f.name!r} ("
    if how == "nullable" and not isinstance(_inner(elements[i]), ValueSerializer):   # (a ValueSerializer reads None)
        elements[i] = _inner(elements[i])
        if f.nullable:
            return record, TupleSerializer(*elements), f"element {i} ("
        nulled = RecordType(record.fields[:i] + (Field(f.name, f.type, True),) + record.fields[i + 1:])
        return nulled, TupleSerializer(*elements), f"element {i} ("
    wrong = BoolSerializer() if f.type != BOOL else StrSerializer()
    return record, TupleSerializer(*elements[:i], wrong, *elements[i + 1:]), f"element {i} ({wrong!r})"


def _inner(ser):
    return ser.inner if isinstance(ser, NullableSerializer) else ser


MAXP = 16


class Job:
    """p subtasks with value, list and map states of one serializer; keys routed by key group."""

    def __init__(self, backend, p, ser, storage=None, metadata=None):
        self.p = p
        self.backends = [BACKENDS[backend](key_group_range(MAXP, p, i), MAXP, Int64Serializer(), subtask_index=i)
                         for i in range(p)]
        try:
            if metadata is not None:
                for b in self.backends:
                    b.restore(storage, metadata)
            self.states = [{"v": b.get_state(ValueStateDescriptor("v", ser)),
                            "l": b.get_state(ListStateDescriptor("l", ser)),
                            "m": b.get_state(MapStateDescriptor("m", StrSerializer(), ser))} for b in self.backends]
        except BaseException:
            self.dispose()
            raise

    def at(self, key):
        i = assign_to_operator(key, MAXP, self.p)
        self.backends[i].set_current_key(key)
        return self.states[i]

    def write(self, key, value):
        s = self.at(key)
        s["v"].update(value)
        s["l"].update([value, value])
        s["m"].put(str(key), value)

    def read(self, key):
        s = self.at(key)
        return s["v"].value(), s["l"].get(), s["m"].get(str(key))

    def checkpoint(self, storage, checkpoint_id):
        handles = [b.snapshot(checkpoint_id, storage).result(60) for b in self.backends]
        storage.commit(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="tuples", timestamp_ms=0,
                                          max_parallelism=MAXP, parallelism=self.p,
                                          keyed_handles=carry_forward(storage.latest(), handles),
                                          operator_handles=[], properties={}))
        return storage.load(checkpoint_id)

    def dispose(self):
        for b in self.backends:
            b.dispose()


def _stored_identifiers(metadata):
    return {m["serializers"][role]["identifier"] for h in metadata.keyed_handles for m in h.states
            for role in ("value", "element", "map value") if role in m["serializers"]}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data(), backend=st.sampled_from(sorted(BACKENDS)), parallelisms=st.tuples(st.integers(1, 3),
                                                                                           st.integers(1, 3)))
def test_random_records_read_as_tuples_by_position_on_both_backends(data, backend, parallelisms, tmp_path_factory):
    storage = CheckpointStorage(tmp_path_factory.mktemp("tuples"))
    record = data.draw(tuple_records(), label="record")
    pool = data.draw(st.lists(values_of(record), min_size=1, max_size=4), label="values")
    keys = list(range(20))
    model = {k: pool[k % len(pool)] for k in keys}
    p, p2 = parallelisms

    old = Job(backend, p, RecordSerializer(record))
    try:
        for k in keys:
            old.write(k, model[k])
        old.checkpoint(storage, 1)
        for k in keys[::3]:                 # a delta on top: chains of a base and a delta
            model[k] = pool[(k + 1) % len(pool)]
            old.write(k, model[k])
        md = old.checkpoint(storage, 2)
    finally:
        old.dispose()

    declared, convert = data.draw(tuple_for(record), label="declared")
    outcome, _ = resolve_compatibility("v", md.keyed_handles[0].states[0]["serializers"]["value"], declared)
    assert outcome is AFTER
    expected = {k: convert(v) for k, v in model.items()}
    new = Job(backend, p2, declared, storage, md)
    try:
        for k in keys:
            assert new.read(k) == (expected[k], [expected[k]] * 2, expected[k])
            assert type(new.read(k)[0]) is tuple
        md = new.checkpoint(storage, 3)   # every key rewritten as tuples, none touched
    finally:
        new.dispose()
    assert _stored_identifiers(md) == {"tuple"}
    again = Job("rocksdb" if backend == "heap" else "heap", p, declared, storage, md)
    try:
        assert all(again.read(k) == (expected[k], [expected[k]] * 2, expected[k]) for k in keys)
    finally:
        again.dispose()

    stored, refused, words = data.draw(refused_tuple_for(record), label="refused")
    with pytest.raises(StateMigrationError) as info:
        resolve_compatibility("v", RecordSerializer(stored).snapshot(), refused)
    assert "state 'v'" in str(info.value) and words in str(info.value)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_random_records_and_tuples_through_the_reader_one_by_one_and_in_bulk(data):
    record = data.draw(tuple_records(), label="record")
    values = data.draw(st.lists(values_of(record), max_size=5), label="values")
    declared, convert = data.draw(tuple_for(record), label="declared")
    old = RecordSerializer(record)
    stored = json.loads(json.dumps(old.snapshot().to_json()))
    outcome, reader = resolve_compatibility("s", stored, declared)
    assert outcome is AFTER and reader.snapshot() == old.snapshot()
    expected = [convert(v) for v in values]
    assert reader.deserialize_many(*old.serialize_many(values)) == expected
    assert [reader.deserialize(old.serialize(v)) for v in values] == expected
    assert declared.deserialize_many(*declared.serialize_many(expected)) == expected
