"""Serializer evolution: as is, after migration (old bytes read by the old serializer, rewritten by the new one) and
incompatible (StateMigrationError with a helpful message), keys, versions and pickle refusal."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups.errors import StateMigrationError, UnsafeDeserializationError
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
    PickleSerializer,
    SerializerSnapshot,
    StrSerializer,
    TupleSerializer,
    TypeSerializer,
    ValueSerializer,
    resolve_compatibility,
)
from test_serializers_strategies import canon

AS_IS = Compatibility.COMPATIBLE_AS_IS
AFTER = Compatibility.COMPATIBLE_AFTER_MIGRATION


def stored(snapshot: SerializerSnapshot) -> SerializerSnapshot:
    """The snapshot as a restore sees it: through JSON, as checkpoint metadata stores it."""
    return SerializerSnapshot.from_json(json.loads(json.dumps(snapshot.to_json())))


def migrate(state, old_ser, new_ser, values, *, role="value", expected):
    """Write values with old_ser, resolve, read with the returned serializer, write with new_ser, read back."""
    old_bytes = [old_ser.serialize(v) for v in values]
    outcome, reader = resolve_compatibility(state, stored(old_ser.snapshot()), new_ser, role=role)
    assert outcome is expected
    if outcome is AS_IS:
        assert reader is new_ser
    else:
        assert reader == old_ser and reader is not new_ser
    read = [reader.deserialize(b) for b in old_bytes]
    rewritten = [new_ser.serialize(v) for v in read]
    return [new_ser.deserialize(b) for b in rewritten]


# -- as is ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ser, values", [
    (Int64Serializer(), [0, -(2**63), 2**63 - 1]),
    (StrSerializer(), ["", "ä"]),
    (TupleSerializer(Int32Serializer(), NullableSerializer(BytesSerializer())), [(1, None), (2, b"x")]),
    (MapSerializer(StrSerializer(), ListSerializer(Float64Serializer())), [{"a": [1.5]}, {}]),
    (ValueSerializer(), [{"a": [1, (2, None)]}, 10**30]),
])
def test_same_serializer_is_as_is(ser, values):
    fresh = type(ser).restore(ser.snapshot(), ser.nested_serializers())   # an equal, separately built serializer
    assert migrate("s", ser, fresh, values, expected=AS_IS) == values


def test_as_is_for_keys_passes():
    outcome, reader = resolve_compatibility("counts", Int64Serializer().snapshot(), Int64Serializer(), role="key")
    assert outcome is AS_IS and reader == Int64Serializer()


# -- after migration -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("old, new, values, expected_values", [
    (Int32Serializer(), Int64Serializer(), [-(2**31), 7], [-(2**31), 7]),
    (Int32Serializer(), Float64Serializer(), [3, -(2**31)], [3.0, float(-(2**31))]),
    (StrSerializer(), NullableSerializer(StrSerializer()), ["a", ""], ["a", ""]),
    (Int32Serializer(), NullableSerializer(Int64Serializer()), [5], [5]),
    (NullableSerializer(Int32Serializer()), NullableSerializer(Int64Serializer()), [None, 4], [None, 4]),
    (TupleSerializer(Int32Serializer(), StrSerializer()),
     TupleSerializer(Int64Serializer(), NullableSerializer(StrSerializer())), [(1, "a")], [(1, "a")]),
    (ListSerializer(Int32Serializer()), ListSerializer(Int64Serializer()), [[1, 2], []], [[1, 2], []]),
    (MapSerializer(StrSerializer(), Int32Serializer()), MapSerializer(StrSerializer(), Float64Serializer()),
     [{"a": 1}], [{"a": 1.0}]),
    (MapSerializer(StrSerializer(), ListSerializer(TupleSerializer(BoolSerializer(), BytesSerializer()))),
     ValueSerializer(), [{"k": [(True, b"x")]}], [{"k": [(True, b"x")]}]),
    (Int64Serializer(), ValueSerializer(), [2**63 - 1], [2**63 - 1]),
])
def test_after_migration_reads_old_bytes_with_old_serializer(old, new, values, expected_values):
    out = migrate("state", old, new, values, expected=AFTER)
    assert canon(out) == canon(expected_values)


def test_worst_of_nested_fields_wins():
    old = TupleSerializer(Int64Serializer(), Int32Serializer(), StrSerializer())
    new = TupleSerializer(Int64Serializer(), Int64Serializer(), StrSerializer())
    assert new.compatibility_with(old.snapshot())[0] is AFTER
    bad = TupleSerializer(Int64Serializer(), Int64Serializer(), Int64Serializer())
    outcome, why = bad.compatibility_with(old.snapshot())
    assert outcome is Compatibility.INCOMPATIBLE and "field 2" in why


# -- incompatible --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("old, new, role, words", [
    (StrSerializer(), Int64Serializer(), "value", ["Int64Serializer cannot read data written by StrSerializer()"]),
    (Int64Serializer(), Int32Serializer(), "value", ["Int32Serializer cannot read"]),
    (Int64Serializer(), Float64Serializer(), "value", ["Float64Serializer cannot read"]),
    (NullableSerializer(Int64Serializer()), Int64Serializer(), "value", ["old value serializer (NullableSerializer(Int64Serializer()))"]),
    (TupleSerializer(Int64Serializer()), TupleSerializer(Int64Serializer(), Int64Serializer()), "value",
     ["2 nested serializers, the stored one 1"]),
    (MapSerializer(StrSerializer(), Int64Serializer()), MapSerializer(Int64Serializer(), Int64Serializer()),
     "value", ["map key: Int64Serializer cannot read data written by StrSerializer()"]),
    (ListSerializer(StrSerializer()), ListSerializer(BytesSerializer()), "element", ["element: "]),
    (ValueSerializer(), Int64Serializer(), "value", ["ValueSerializer"]),
    (PickleSerializer(), ValueSerializer(), "value", ["PickleSerializer"]),
])
def test_incompatible_raises_state_migration_error(old, new, role, words):
    with pytest.raises(StateMigrationError) as info:
        resolve_compatibility("my-state", stored(old.snapshot()), new, role=role, allow_pickle=True)
    msg = str(info.value)
    assert "'my-state'" in msg and f"new {role} serializer ({new!r})" in msg
    assert f"old {role} serializer (" in msg and "cannot read what the old" in msg
    for w in words:
        assert w in msg


@pytest.mark.parametrize("old, new", [
    (Int32Serializer(), Int64Serializer()),
    (StrSerializer(), NullableSerializer(StrSerializer())),
    (TupleSerializer(Int32Serializer()), TupleSerializer(Int64Serializer())),
])
def test_keys_must_be_compatible_as_is(old, new):
    with pytest.raises(StateMigrationError) as info:
        resolve_compatibility("by-user", old.snapshot(), new, role="key")
    msg = str(info.value)
    assert "'by-user'" in msg and "new key serializer" in msg and "must be compatible as is" in msg
    assert "compatible after migration" in msg
    # the same pair is fine for values, and for an explicit role with require_as_is=False
    assert resolve_compatibility("by-user", old.snapshot(), new)[0] is AFTER
    with pytest.raises(StateMigrationError):
        resolve_compatibility("m", old.snapshot(), new, role="map key", require_as_is=True)


def test_unknown_identifier_is_a_migration_error():
    snap = SerializerSnapshot("com.example.Gone", 1)
    with pytest.raises(StateMigrationError, match="com.example.Gone"):
        snap.restore_serializer()
    with pytest.raises(StateMigrationError, match="cannot read what the old"):
        resolve_compatibility("s", snap, Int64Serializer())


def test_old_snapshot_as_json_dict_accepted():
    outcome, _ = resolve_compatibility("s", Int32Serializer().snapshot().to_json(), Int64Serializer())
    assert outcome is AFTER


# -- versions ------------------------------------------------------------------------------------------------------


class _PointV1(TypeSerializer):
    """Format v1: 'x,y' as ASCII."""

    identifier = "tests.point"
    version = 1
    is_immutable = True

    def serialize(self, value):
        return f"{value[0]},{value[1]}".encode()

    def deserialize(self, data):
        x, y = bytes(data).decode().split(",")
        return (int(x), int(y))


def _point_class(version, *, as_is=(), migratable=()):
    """The same identifier at a later format version (a new code release), as the registry would hold it."""

    class Point(_PointV1):
        pass

    Point.version = version
    Point.as_is_versions = frozenset(as_is)
    Point.migratable_versions = frozenset(migratable)

    def serialize(self, value):
        return b"P" + TupleSerializer(Int64Serializer(), Int64Serializer()).serialize(tuple(value))

    if migratable:   # v2 changed the bytes
        Point.serialize = serialize
        Point.deserialize = lambda self, data: TupleSerializer(Int64Serializer(), Int64Serializer()).deserialize(
            memoryview(data)[1:])
    return Point


def test_version_bump_as_is():
    Point = _point_class(2, as_is=[1])
    outcome, reader = resolve_compatibility("p", _PointV1().snapshot(), Point())
    assert outcome is AS_IS and isinstance(reader, Point)
    assert reader.deserialize(_PointV1().serialize((1, 2))) == (1, 2)


def test_version_bump_after_migration_reads_with_old_format():
    Point = _point_class(2, migratable=[1])
    old_bytes = _PointV1().serialize((3, -4))
    snap = _PointV1().snapshot()
    outcome, reader = resolve_compatibility("p", snap, Point())
    assert outcome is AFTER
    # the registry restores the class registered for the identifier; its restore sees the stored version
    assert reader.deserialize(old_bytes) == (3, -4)
    assert Point().deserialize(Point().serialize((3, -4))) == (3, -4)


class PairV2(TypeSerializer):
    """A registered serializer at format v2 (two int64, fixed width) that still reads v1 ('x,y' ASCII) data: its
    restore returns a v1 reader for v1 snapshots, so migration reads the old bytes with the old format."""

    identifier = "tests.pair"
    version = 2
    migratable_versions = frozenset({1})
    is_immutable = True

    def __init__(self, fmt: int = 2):
        self.fmt = fmt
        self._t = TupleSerializer(Int64Serializer(), Int64Serializer())

    def serialize(self, value):
        return self._t.serialize(tuple(value)) if self.fmt == 2 else f"{value[0]},{value[1]}".encode()

    def deserialize(self, data):
        if self.fmt == 2:
            return self._t.deserialize(data)
        x, y = bytes(data).decode().split(",")
        return (int(x), int(y))

    @classmethod
    def restore(cls, snapshot, nested):
        return cls(fmt=snapshot.version)


def test_registered_class_version_bump_migrates_with_its_old_format_reader():
    v1_snapshot = SerializerSnapshot("tests.pair", 1)
    old_bytes = [PairV2(fmt=1).serialize(p) for p in [(1, 2), (-3, 40)]]
    outcome, reader = resolve_compatibility("pairs", stored(v1_snapshot), PairV2())
    assert outcome is AFTER and reader.fmt == 1
    new = PairV2()
    assert [new.deserialize(new.serialize(reader.deserialize(b))) for b in old_bytes] == [(1, 2), (-3, 40)]
    with pytest.raises(StateMigrationError, match="compatible as is"):
        resolve_compatibility("pairs", v1_snapshot, PairV2(), role="key")


def test_default_restore_refuses_an_old_format_it_cannot_read():
    class Later(Int64Serializer):
        identifier = "tests.later"
        version = 3
        migratable_versions = frozenset({2})

    with pytest.raises(StateMigrationError, match="override Later.restore"):
        resolve_compatibility("s", SerializerSnapshot("tests.later", 2), Later())


def test_version_bump_incompatible_and_newer_versions():
    Point = _point_class(3)   # declares neither: v1 unreadable
    with pytest.raises(StateMigrationError, match="no longer reads its format v1"):
        resolve_compatibility("p", _PointV1().snapshot(), Point())
    newer = SerializerSnapshot("int64", 7)
    with pytest.raises(StateMigrationError, match="newer than the v1"):
        resolve_compatibility("p", newer, Int64Serializer())


# -- pickle --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ser", [
    PickleSerializer(), TupleSerializer(Int64Serializer(), PickleSerializer()),
    MapSerializer(StrSerializer(), ListSerializer(PickleSerializer())),
], ids=repr)
def test_pickled_state_refused_without_opt_in(ser):
    snap = stored(ser.snapshot())
    assert snap.uses_pickle
    with pytest.raises(UnsafeDeserializationError, match="allow_pickle=True"):
        snap.restore_serializer()
    with pytest.raises(UnsafeDeserializationError, match="'pickled-state'"):
        resolve_compatibility("pickled-state", snap, ser)
    outcome, reader = resolve_compatibility("pickled-state", snap, ser, allow_pickle=True)
    assert outcome is AS_IS and reader is ser
    assert snap.restore_serializer(allow_pickle=True) == ser


def test_pickle_serializer_round_trip_only_when_constructed_explicitly():
    ser = PickleSerializer()
    value = {"set": {1, 2}, "obj": complex(1, 2)}
    assert ser.deserialize(ser.serialize(value)) == value
    nested = TupleSerializer(StrSerializer(), PickleSerializer())
    assert nested.deserialize(nested.serialize(("a", {3}))) == ("a", {3})


# -- property: widening migrations keep every value ------------------------------------------------------------------

_WIDEN_LEAVES = [
    (Int32Serializer(), st.integers(-(2**31), 2**31 - 1), Int64Serializer()),
    (Int32Serializer(), st.integers(-(2**31), 2**31 - 1), Float64Serializer()),
    (StrSerializer(), st.text(max_size=10), StrSerializer()),
    (BoolSerializer(), st.booleans(), BoolSerializer()),
]


def _widen_tree():
    leaf = st.sampled_from(_WIDEN_LEAVES)

    def extend(ch):
        return st.one_of(
            ch.map(lambda t: (t[0], t[1], NullableSerializer(t[2]))),
            ch.map(lambda t: (NullableSerializer(t[0]), st.none() | t[1], NullableSerializer(t[2]))),
            ch.map(lambda t: (ListSerializer(t[0]), st.lists(t[1], max_size=4), ListSerializer(t[2]))),
            st.lists(ch, min_size=1, max_size=3).map(lambda ts: (
                TupleSerializer(*[t[0] for t in ts]), st.tuples(*[t[1] for t in ts]),
                TupleSerializer(*[t[2] for t in ts]))),
            ch.map(lambda t: (MapSerializer(StrSerializer(), t[0]), st.dictionaries(st.text(max_size=4), t[1],
                                                                                    max_size=3),
                              MapSerializer(StrSerializer(), t[2]))),
        )

    return st.recursive(leaf, extend, max_leaves=4)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_widening_migrations_keep_every_value(data):
    old, values, new = data.draw(_widen_tree())
    items = data.draw(st.lists(values, min_size=1, max_size=4))
    outcome, reader = resolve_compatibility("w", stored(old.snapshot()), new)
    assert outcome is (AS_IS if old == new else AFTER)
    for v in items:
        migrated = new.deserialize(new.serialize(reader.deserialize(old.serialize(v))))
        assert migrated == v
    # and ValueSerializer takes over any of these
    assert resolve_compatibility("w", old.snapshot(), ValueSerializer())[0] is AFTER
