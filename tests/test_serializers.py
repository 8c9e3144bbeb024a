"""Serializers: round trips, determinism, bulk paths, input checking, copies, snapshots, read-only buffers."""

from __future__ import annotations

import math
import mmap
import pickle
import struct
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups.errors import CorruptSnapshotError
from keygroups.serializers import (
    BoolSerializer,
    BytesSerializer,
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
    serializer_for,
)
from test_serializers_strategies import canon, json_values, serializers_and_values

PROPS = settings(max_examples=150, deadline=None)


# -- round trips ---------------------------------------------------------------------------------------------------


@PROPS
@given(data=st.data())
def test_round_trip_every_serializer_nested(data):
    ser, values = data.draw(serializers_and_values)
    value = data.draw(values)
    blob = ser.serialize(value)
    assert type(blob) is bytes
    assert canon(ser.deserialize(blob)) == canon(value)
    # deterministic: the same value gives the same bytes, and decoding then encoding reproduces them
    assert ser.serialize(value) == blob
    assert ser.serialize(ser.deserialize(blob)) == blob


@PROPS
@given(data=st.data())
def test_serialize_many_matches_single_values(data):
    ser, values = data.draw(serializers_and_values)
    items = data.draw(st.lists(values, max_size=8))
    buf, offsets = ser.serialize_many(items)
    assert offsets.dtype == np.int64 and offsets.shape == (len(items) + 1,) and offsets[0] == 0
    assert buf == b"".join(ser.serialize(v) for v in items)
    for i, v in enumerate(items):
        assert buf[offsets[i]:offsets[i + 1]] == ser.serialize(v)
    assert canon(ser.deserialize_many(buf, offsets)) == canon(list(items))


@PROPS
@given(value=json_values)
def test_value_serializer_round_trip_keeps_types(value):
    ser = ValueSerializer()
    assert canon(ser.deserialize(ser.serialize(value))) == canon(value)


@pytest.mark.parametrize("value", [
    0, 1, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64, 10**100, -(10**100), 255, 256, -256,
])
def test_value_serializer_ints_of_any_size(value):
    ser = ValueSerializer()
    blob = ser.serialize(value)
    assert ser.deserialize(blob) == value and type(ser.deserialize(blob)) is int
    in_int64 = -(2**63) <= value < 2**63
    assert (blob[0] == 3 and len(blob) == 9) if in_int64 else blob[0] == 4   # int64 form whenever it fits


def test_top_level_str_and_bytes_are_raw():
    assert StrSerializer().serialize("héllo") == "héllo".encode()
    assert BytesSerializer().serialize(b"\x00\x01") == b"\x00\x01"
    assert StrSerializer().deserialize(b"") == ""
    assert BytesSerializer().deserialize(bytearray(b"ab")) == b"ab"


def test_fixed_formats_are_little_endian():
    assert Int64Serializer().serialize(1) == struct.pack("<q", 1)
    assert Int32Serializer().serialize(-2) == struct.pack("<i", -2)
    assert Float64Serializer().serialize(1.5) == struct.pack("<d", 1.5)
    assert BoolSerializer().serialize(True) == b"\x01"
    assert NullableSerializer(Int32Serializer()).serialize(None) == b"\x00"
    assert TupleSerializer(Int32Serializer(), StrSerializer()).serialize((7, "ab")) == \
        struct.pack("<iI", 7, 2) + b"ab"


# -- determinism ---------------------------------------------------------------------------------------------------


@PROPS
@given(d=st.dictionaries(st.text(max_size=5) | st.integers(), json_values, max_size=8), seed=st.randoms())
def test_dicts_serialize_the_same_whatever_the_insertion_order(d, seed):
    items = list(d.items())
    seed.shuffle(items)
    shuffled = dict(items)
    ser = ValueSerializer()
    assert ser.serialize(shuffled) == ser.serialize(d)
    assert ser.serialize({"k": shuffled}) == ser.serialize({"k": d})
    typed = MapSerializer(StrSerializer(), Int64Serializer())
    sd = {str(k): i for i, (k, _) in enumerate(items)}
    assert typed.serialize(dict(reversed(list(sd.items())))) == typed.serialize(sd)


def test_nan_is_canonical_and_negative_zero_kept():
    odd_nan = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000001))[0]
    for ser in (Float64Serializer(), ValueSerializer()):
        assert ser.serialize(odd_nan) == ser.serialize(float("nan")) == ser.serialize(-float("nan"))
        assert math.isnan(ser.deserialize(ser.serialize(odd_nan)))
        assert math.copysign(1.0, ser.deserialize(ser.serialize(-0.0))) == -1.0


def test_two_nan_keys_are_refused():
    with pytest.raises(ValueError, match="same bytes"):
        ValueSerializer().serialize({float("nan"): 1, float("nan"): 2})


def test_subclasses_and_numpy_scalars_stored_as_base_types():
    Point = namedtuple("Point", "x y")
    ser = ValueSerializer()
    assert ser.serialize(Point(1, 2)) == ser.serialize((1, 2))
    assert ser.serialize(OrderedDict(a=1)) == ser.serialize({"a": 1})
    assert ser.serialize(np.int64(5)) == ser.serialize(5)
    assert ser.serialize(np.float32(0.5)) == ser.serialize(0.5)
    assert ser.serialize(np.bool_(True)) == ser.serialize(True)
    assert ser.serialize(bytearray(b"x")) == ser.serialize(b"x")
    assert Int64Serializer().serialize(np.int32(7)) == Int64Serializer().serialize(7)
    assert BoolSerializer().serialize(np.bool_(False)) == b"\x00"


# -- input checking ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ser, value, exc, words", [
    (Int64Serializer(), 2**63, ValueError, "[-9223372036854775808, 9223372036854775807]"),
    (Int32Serializer(), 2**31, ValueError, "[-2147483648, 2147483647]"),
    (Int32Serializer(), -(2**31) - 1, ValueError, "out of range for Int32Serializer"),
    (Int64Serializer(), 1.5, TypeError, "expects an int, got 1.5 of type float"),
    (Int64Serializer(), "1", TypeError, "expects an int"),
    (Float64Serializer(), "x", TypeError, "expects a float"),
    (Float64Serializer(), 10**400, ValueError, "out of range for Float64Serializer"),
    (BoolSerializer(), 1, TypeError, "expects a bool, got 1"),
    (StrSerializer(), b"x", TypeError, "expects a str"),
    (BytesSerializer(), "x", TypeError, "expects bytes"),
    (TupleSerializer(Int64Serializer(), StrSerializer()), (1,), ValueError, "tuple of 2 fields, got 1"),
    (TupleSerializer(Int64Serializer()), 5, TypeError, "expects a tuple"),
    (ListSerializer(Int64Serializer()), {1}, TypeError, "expects a list"),
    (MapSerializer(StrSerializer(), Int64Serializer()), [("a", 1)], TypeError, "expects a dict"),
    (NullableSerializer(Int32Serializer()), "x", TypeError, "expects an int"),
    (ValueSerializer(), {1, 2}, TypeError, "allowed: None, bool, int"),
    (ValueSerializer(), object(), TypeError, "PickleSerializer"),
])
def test_bad_values_raise_clear_errors(ser, value, exc, words):
    with pytest.raises(exc) as info:
        ser.serialize(value)
    assert words in str(info.value)


def test_self_containing_and_too_deep_values_are_refused():
    a: list = []
    a.append(a)
    with pytest.raises(ValueError, match="deeper than 100"):
        ValueSerializer().serialize(a)
    deep: list = []
    for _ in range(150):
        deep = [deep]
    with pytest.raises(ValueError, match="deeper"):
        ValueSerializer().serialize(deep)
    ok: list = []
    for _ in range(90):
        ok = [ok]
    assert ValueSerializer().deserialize(ValueSerializer().serialize(ok)) == ok


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match="at least one field"):
        TupleSerializer()
    with pytest.raises(TypeError, match="must be a TypeSerializer instance"):
        ListSerializer(Int64Serializer)
    with pytest.raises(TypeError, match="field 1"):
        TupleSerializer(Int64Serializer(), int)


def test_trailing_bytes_are_corrupt():
    with pytest.raises(CorruptSnapshotError, match="trailing"):
        Int64Serializer().deserialize(b"\x00" * 9)
    with pytest.raises(CorruptSnapshotError):
        ValueSerializer().deserialize(ValueSerializer().serialize(1) + b"\x00")


# -- copies --------------------------------------------------------------------------------------------------------


def test_copy_is_identity_for_immutables_and_deep_otherwise():
    for ser, v in [(Int64Serializer(), 10**10), (StrSerializer(), "abc"), (BytesSerializer(), b"x"),
                   (TupleSerializer(Int64Serializer(), StrSerializer()), (1, "a")),
                   (NullableSerializer(StrSerializer()), "s")]:
        assert ser.is_immutable and ser.copy(v) is v
    nested = {"a": [1, {"b": [2]}], "t": (1, [2])}
    for ser in (ValueSerializer(), PickleSerializer()):
        assert not ser.is_immutable
        c = ser.copy(nested)
        assert c == nested
        c["a"][1]["b"].append(3)
        c["t"][1].append(3)
        assert nested == {"a": [1, {"b": [2]}], "t": (1, [2])}
    lst = ListSerializer(ListSerializer(Int64Serializer()))
    orig = [[1], [2]]
    c = lst.copy(orig)
    c[0].append(9)
    assert orig == [[1], [2]] and not lst.is_immutable
    m = MapSerializer(StrSerializer(), ListSerializer(Int64Serializer()))
    orig_m = {"a": [1]}
    cm = m.copy(orig_m)
    cm["a"].append(2)
    assert orig_m == {"a": [1]}
    t = TupleSerializer(StrSerializer(), ListSerializer(Int64Serializer()))
    assert not t.is_immutable
    ct = t.copy(("a", [1]))
    assert ct == ("a", [1])


# -- snapshots -----------------------------------------------------------------------------------------------------


ALL_SERIALIZERS = [
    Int64Serializer(), Int32Serializer(), Float64Serializer(), BoolSerializer(), StrSerializer(), BytesSerializer(),
    NullableSerializer(StrSerializer()), TupleSerializer(Int64Serializer(), NullableSerializer(BytesSerializer())),
    ListSerializer(Float64Serializer()), MapSerializer(StrSerializer(), ListSerializer(ValueSerializer())),
    ValueSerializer(), PickleSerializer(),
]


@pytest.mark.parametrize("ser", ALL_SERIALIZERS, ids=repr)
def test_snapshot_json_round_trip_and_restore(ser):
    import json

    snap = ser.snapshot()
    again = SerializerSnapshot.from_json(json.loads(json.dumps(snap.to_json())))
    assert again == snap and hash(again) == hash(snap)
    restored = again.restore_serializer(allow_pickle=True)
    assert restored == ser and type(restored) is type(ser)
    assert snap.uses_pickle == isinstance(ser, PickleSerializer)


@pytest.mark.parametrize("ser", ALL_SERIALIZERS, ids=repr)
def test_serializers_pickle_for_spark_executors(ser):
    clone = pickle.loads(pickle.dumps(ser))
    assert clone == ser
    value = {"x": [1]} if isinstance(ser, (ValueSerializer, PickleSerializer)) else None
    if value is not None:
        assert clone.deserialize(ser.serialize(value)) == value


def test_snapshot_is_frozen_and_config_private():
    cfg = {"a": 1}
    snap = SerializerSnapshot("int64", 1, cfg)
    cfg["a"] = 2
    assert snap.config == {"a": 1}
    with pytest.raises(AttributeError):
        snap.version = 2  # type: ignore[misc]


@pytest.mark.parametrize("bad", [
    [], {"identifier": 3, "version": 1}, {"identifier": "int64", "version": "1"},
    {"identifier": "int64", "version": -1}, {"identifier": "int64", "version": 1, "config": []},
    {"identifier": "int64", "version": 1, "nested": {}}, {"identifier": "int64", "version": True},
])
def test_malformed_snapshot_json_is_corrupt(bad):
    with pytest.raises(CorruptSnapshotError):
        SerializerSnapshot.from_json(bad)


def test_deeply_nested_snapshot_json_is_refused():
    cfg: list = []
    for _ in range(100_000):
        cfg = [cfg]
    with pytest.raises(CorruptSnapshotError, match="nested too deeply"):
        SerializerSnapshot.from_json({"identifier": "int64", "version": 1, "config": {"x": cfg}})
    d: dict = {"identifier": "int64", "version": 1}
    for _ in range(200):
        d = {"identifier": "list", "version": 1, "nested": [d]}
    with pytest.raises(CorruptSnapshotError, match="deeper"):
        SerializerSnapshot.from_json(d)


def test_serializer_for():
    assert serializer_for(int) == Int64Serializer()
    assert serializer_for("x") == StrSerializer()
    assert serializer_for(True) == BoolSerializer()
    assert serializer_for(1.0) == Float64Serializer()
    assert serializer_for(b"") == BytesSerializer()
    assert serializer_for({"a": 1}) == ValueSerializer()


def test_equality_and_hash():
    assert TupleSerializer(Int64Serializer(), StrSerializer()) == TupleSerializer(Int64Serializer(), StrSerializer())
    assert TupleSerializer(Int64Serializer(), StrSerializer()) != TupleSerializer(StrSerializer(), Int64Serializer())
    assert len({ListSerializer(Int32Serializer()), ListSerializer(Int32Serializer())}) == 1
    assert Int64Serializer() != Int32Serializer()


# -- custom serializers nested in compiled ones ----------------------------------------------------------------------


class Upper(TypeSerializer):
    """A user serializer: ASCII strings stored upper-case."""

    identifier = "tests.upper"
    is_immutable = True

    def serialize(self, value):
        return value.upper().encode("ascii")

    def deserialize(self, data):
        return bytes(data).decode("ascii")


def test_custom_serializer_nested_in_compiled_ones():
    ser = MapSerializer(StrSerializer(), TupleSerializer(Upper(), NullableSerializer(Upper())))
    value = {"k": ("ab", None), "j": ("c", "d")}
    assert ser.deserialize(ser.serialize(value)) == {"k": ("AB", None), "j": ("C", "D")}
    assert ser.snapshot().restore_serializer() == ser
    buf, offsets = ListSerializer(Upper()).serialize_many([["a"], []])
    assert ListSerializer(Upper()).deserialize_many(buf, offsets) == [["A"], []]
    assert Upper().deserialize_many(*Upper().serialize_many(["x", "yz"])) == ["X", "YZ"]


# -- buffers -------------------------------------------------------------------------------------------------------


def _read_only_buffers(blob: bytes, tmp_path):
    """The same bytes as bytes, bytearray, read-only memoryview, a memoryview slice, read-only mmap, pyarrow."""
    import pyarrow as pa

    path = tmp_path / "buf.bin"
    path.write_bytes(b"##" + blob + b"##")
    f = open(path, "rb")
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if len(blob) + 4 else None
    out = [blob, bytearray(blob), memoryview(blob), memoryview(b"##" + blob + b"##")[2:-2],
           memoryview(mm)[2:2 + len(blob)], pa.py_buffer(blob), memoryview(pa.py_buffer(b"##" + blob))[2:]]
    return out, (f, mm)


@pytest.mark.parametrize("ser, value", [
    (Int64Serializer(), -5), (StrSerializer(), "ünï"), (BytesSerializer(), b"\x00\xff"),
    (MapSerializer(StrSerializer(), ListSerializer(Float64Serializer())), {"a": [1.0, 2.0]}),
    (ValueSerializer(), {"a": [1, None, b"x", ("t", 2.5)]}),
], ids=lambda x: type(x).__name__)
def test_read_only_buffers_accepted(ser, value, tmp_path):
    blob = ser.serialize(value)
    buffers, (f, mm) = _read_only_buffers(blob, tmp_path)
    try:
        for buf in buffers:
            assert canon(ser.deserialize(buf)) == canon(value), type(buf)
        many, offsets = ser.serialize_many([value, value])
        ro = np.frombuffer(many, dtype=np.uint8)   # read-only numpy view as data
        assert not ro.flags.writeable
        ro_off = offsets.copy()
        ro_off.setflags(write=False)
        assert canon(ser.deserialize_many(memoryview(many), ro_off)) == canon([value, value])
        assert canon(ser.deserialize_many(ro, list(offsets))) == canon([value, value])
    finally:
        del buffers
        mm.close()
        f.close()


@pytest.mark.parametrize("dtype, ser", [
    ("int64", Int64Serializer()), ("int32", Int64Serializer()), ("uint16", Int64Serializer()),
    ("int32", Int32Serializer()), ("int8", Int32Serializer()), ("float64", Float64Serializer()),
    ("float32", Float64Serializer()), ("bool", BoolSerializer()),
])
@pytest.mark.parametrize("writable", [True, False])
def test_numpy_arrays_bulk_path(dtype, ser, writable):
    arr = (np.arange(-5, 6) % 2 == 0) if dtype == "bool" else np.arange(0, 11).astype(dtype)
    if dtype.startswith("float"):
        arr = arr / 4
    arr.setflags(write=writable)
    buf, offsets = ser.serialize_many(arr)
    assert buf == b"".join(ser.serialize(v.item()) for v in arr)
    assert np.array_equal(offsets, np.arange(len(arr) + 1) * len(ser.serialize(arr[0].item())))
    assert ser.deserialize_many(buf, offsets) == arr.tolist()


def test_int64_array_nan_and_uint64_fall_back_to_checked_path():
    with pytest.raises(ValueError, match="out of range"):
        Int64Serializer().serialize_many(np.array([2**64 - 1], dtype=np.uint64))
    with pytest.raises(ValueError, match="out of range"):
        Int32Serializer().serialize_many(np.array([2**40], dtype=np.int64))
    buf, _ = Float64Serializer().serialize_many(np.array([np.nan, -np.nan], dtype=np.float32))
    assert buf == Float64Serializer().serialize(float("nan")) * 2


def test_deserialize_many_checks_offsets():
    ser = StrSerializer()
    buf, offsets = ser.serialize_many(["ab", "c"])
    for bad in ([0, 2, 1], [0, 2, 4], [-1, 2, 3], [0, 1, 2, 3, 4]):
        with pytest.raises(CorruptSnapshotError, match="offsets"):
            ser.deserialize_many(buf, np.array(bad))
    with pytest.raises(ValueError, match="n \\+ 1"):
        ser.deserialize_many(buf, np.array([], dtype=np.int64))
    assert ser.deserialize_many(b"", [0]) == []
    # an int64 value cut in two by the offsets
    ibuf, _ = Int64Serializer().serialize_many([1, 2])
    with pytest.raises(CorruptSnapshotError):
        Int64Serializer().deserialize_many(ibuf, [0, 4, 16])


def test_subclasses_are_stored_by_the_value_they_hold_not_their_methods():
    class S(str):
        def __str__(self):
            return S("other")

    class L(list):
        def __iter__(self):
            return iter(())

    class D(dict):
        def items(self):
            return []

    class I(int):
        def __int__(self):
            return 0

        def __index__(self):
            return 0

    ser = ValueSerializer()
    assert ser.deserialize(ser.serialize(S("text"))) == "text"
    assert ser.deserialize(ser.serialize(L([1, 2]))) == [1, 2]
    assert ser.deserialize(ser.serialize(D(a=1))) == {"a": 1}
    assert ser.deserialize(ser.serialize(I(7))) == 7 and ser.serialize(I(2**70)) == ser.serialize(2**70)
    assert StrSerializer().serialize(S("text")) == b"text"
    assert Int64Serializer().serialize(I(7)) == Int64Serializer().serialize(7)


def test_a_list_mutated_during_serialization_does_not_crash():
    class Evil:
        """An int-like whose conversion empties the list being serialized."""

        def __index__(self):
            victim.clear()
            return 1

    ser = ListSerializer(Int64Serializer())
    victim = [1, Evil(), 3]
    assert ser.deserialize(ser.serialize(victim)) == [1, 1, 3]   # typed lists encode a snapshot of the elements
    victim = [1, Evil(), 3]
    m = MapSerializer(Int64Serializer(), Int64Serializer())
    victim_map = {1: Evil(), 2: 3}
    victim = [1]
    assert m.deserialize(m.serialize(victim_map)) == {1: 1, 2: 3}

    class Clear:
        def __index__(self):
            victim_map.clear()
            return 1

    victim_map = {1: Clear(), 2: 3, 4: 5}
    with pytest.raises(RuntimeError, match="changed size"):
        m.serialize(victim_map)


def test_subclass_overrides_are_not_shadowed_by_the_compiled_shortcut():
    class Offset(Int64Serializer):
        identifier = "tests.offset"

        def serialize(self, value):
            return super().serialize(value + 1)

    assert Offset().serialize(1) == Int64Serializer().serialize(2)
    assert Offset().deserialize(Offset().serialize(1)) == 2
    assert Int64Serializer().serialize.__self__ is not None   # the built-ins call the codec directly
