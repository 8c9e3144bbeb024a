"""Corruption fuzz: truncations, byte flips, insertions and random bytes fed to every compiled decoder. Each input
must either decode or raise CorruptSnapshotError: never crash, hang, read past the end or allocate by unchecked
counts."""

from __future__ import annotations

import random
import struct

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
    StrSerializer,
    TupleSerializer,
    ValueSerializer,
)
from test_serializers_strategies import json_values, serializers_and_values

NESTED = MapSerializer(StrSerializer(), ListSerializer(TupleSerializer(
    Int64Serializer(), NullableSerializer(StrSerializer()), BoolSerializer(), Float64Serializer(),
    BytesSerializer(), Int32Serializer())))
NESTED_VALUE = {f"k{i}": [(i, None if i % 2 else "s" * i, bool(i % 3), i / 3, b"\x00" * i, -i)] * (i % 4)
                for i in range(12)}

JSON_VALUE = {
    "name": "ünïcode ✓", "n": 42, "big": -(10**40), "f": -1.25, "none": None, "flags": [True, False],
    "raw": b"\x00\xff" * 5, "t": (1, (2, (3, [4, {"deep": {"er": [None]}}]))), 7: {(1, "a"): [1.5, "x"]},
}

CASES = [
    (NESTED, NESTED_VALUE),
    (ValueSerializer(), JSON_VALUE),
    (ListSerializer(ValueSerializer()), [JSON_VALUE, [], {}, "x", 2**70]),
    (TupleSerializer(StrSerializer(), ListSerializer(Int64Serializer()), MapSerializer(Int32Serializer(),
                                                                                     BytesSerializer())),
     ("key", list(range(-20, 20)), {i: bytes([i]) * i for i in range(10)})),
    (NullableSerializer(ListSerializer(NullableSerializer(Float64Serializer()))), [1.0, None, -0.0, 3.5] * 5),
    (StrSerializer(), "plain ✓ text"),
    (Int64Serializer(), -12345678901),
    (BoolSerializer(), True),
]


def _decode_or_corrupt(ser, data) -> bool:
    """True if data decoded, False if it raised CorruptSnapshotError; anything else fails the test."""
    try:
        ser.deserialize(data)
        return True
    except CorruptSnapshotError:
        return False


def _mutations(blob: bytes, rng: random.Random, count: int):
    n = len(blob)
    for cut in range(n):                      # every truncation
        yield blob[:cut]
    for _ in range(count):
        b = bytearray(blob)
        kind = rng.randrange(6)
        if kind == 0 and n:                   # one byte flipped to a random value
            b[rng.randrange(n)] = rng.randrange(256)
        elif kind == 1 and n:                 # a few bit flips
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(n)] ^= 1 << rng.randrange(8)
        elif kind == 2 and n >= 4:            # a huge length/count spliced in
            i = rng.randrange(n - 3)
            b[i:i + 4] = struct.pack("<I", rng.choice([0xFFFFFFFF, 0x7FFFFFFF, 0x10000, n, n + 1]))
        elif kind == 3:                       # random bytes inserted
            i = rng.randrange(n + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 6)))
        elif kind == 4 and n:                 # a slice deleted
            i = rng.randrange(n)
            del b[i:i + rng.randrange(1, 9)]
        else:                                 # truncated after a flip
            if n:
                b[rng.randrange(n)] = rng.randrange(256)
            del b[rng.randrange(len(b) + 1):]
        yield bytes(b)


@pytest.mark.parametrize("ser, value", CASES, ids=lambda x: repr(x)[:40])
def test_mutated_encodings_decode_or_raise_corrupt(ser, value):
    blob = ser.serialize(value)
    assert ser.deserialize(blob) == value
    rng = random.Random(len(blob))
    results = [_decode_or_corrupt(ser, m) for m in _mutations(blob, rng, 3000)]
    assert len(results) >= 3000
    if len(blob) > 8:
        assert results.count(False) > 0    # the fuzz did reach the error paths


@pytest.mark.parametrize("ser", [c[0] for c in CASES], ids=lambda x: repr(x)[:40])
def test_random_bytes_decode_or_raise_corrupt(ser):
    rng = random.Random(7)
    for _ in range(2000):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
        _decode_or_corrupt(ser, data)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_mutations_of_generated_encodings(data):
    ser, values = data.draw(serializers_and_values)
    blob = ser.serialize(data.draw(values))
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    for m in _mutations(blob, rng, 30):
        _decode_or_corrupt(ser, m)


@settings(max_examples=150, deadline=None)
@given(value=json_values, cut=st.integers(0, 1000))
def test_truncated_value_format_is_always_corrupt(value, cut):
    """A self-describing value never decodes from a strict prefix of its own bytes (no silent truncation)."""
    blob = ValueSerializer().serialize(value)
    cut = cut % max(len(blob), 1)
    with pytest.raises(CorruptSnapshotError):
        ValueSerializer().deserialize(blob[:cut])


def test_hostile_counts_are_refused_before_allocating():
    # a list claiming 4 billion int64 elements, a dict claiming 4 billion entries, a str of 4 GiB
    for ser, blob in [
        (ListSerializer(Int64Serializer()), struct.pack("<I", 0xFFFFFFFF) + b"\x00" * 16),
        (MapSerializer(Int64Serializer(), Int64Serializer()), struct.pack("<I", 0xFFFFFFFF)),
        (NullableSerializer(StrSerializer()), b"\x01" + struct.pack("<I", 0xFFFFFFFF) + b"abc"),
        (ValueSerializer(), b"\x08" + struct.pack("<I", 0xFFFFFFFF)),
        (ValueSerializer(), b"\x0a" + struct.pack("<I", 3) + b"\x00\x00\x00\x00"),
        (ValueSerializer(), b"\x04" + struct.pack("<I", 0xFFFFFFFF)),
    ]:
        with pytest.raises(CorruptSnapshotError, match="count|truncated|exceeds"):
            ser.deserialize(blob)


def test_a_list_of_8_byte_elements_needs_8_bytes_each():
    # 3 elements claimed, 23 bytes present: refused by the count check, not by a later short read
    blob = struct.pack("<I", 3) + b"\x00" * 23
    with pytest.raises(CorruptSnapshotError, match="at least 8 bytes each"):
        ListSerializer(Int64Serializer()).deserialize(blob)


def test_hostile_nesting_is_capped():
    deep = b"\x08\x01\x00\x00\x00" * 100_000 + b"\x00"   # a list in a list in a list ... 100k deep
    with pytest.raises(CorruptSnapshotError, match="deeper than 100"):
        ValueSerializer().deserialize(deep)
    ok = b"\x08\x01\x00\x00\x00" * 100 + b"\x00"
    assert ValueSerializer().deserialize(ok) is not None


@pytest.mark.parametrize("blob, words", [
    (b"\x0b", "unknown value tag 11"),
    (b"\x06\x02\x00\x00\x00\xff\xfe", "not valid UTF-8"),
    (b"\x0a\x01\x00\x00\x00\x08\x00\x00\x00\x00\x00", "unhashable dict key"),
    (b"\x0a\x02\x00\x00\x00\x00\x00\x00\x01", "duplicate keys"),
])
def test_value_format_errors_name_the_problem(blob, words):
    with pytest.raises(CorruptSnapshotError, match=words):
        ValueSerializer().deserialize(blob)


def test_typed_format_errors_name_the_problem():
    with pytest.raises(CorruptSnapshotError, match="bool byte of 2"):
        BoolSerializer().deserialize(b"\x02")
    with pytest.raises(CorruptSnapshotError, match="null flag of 7"):
        NullableSerializer(Int64Serializer()).deserialize(b"\x07")
    with pytest.raises(CorruptSnapshotError, match="a read of 8 bytes with 3 left"):
        Int64Serializer().deserialize(b"abc")
    with pytest.raises(CorruptSnapshotError, match="not valid UTF-8"):
        StrSerializer().deserialize(b"\xc3")
    m = MapSerializer(Int32Serializer(), BoolSerializer())
    with pytest.raises(CorruptSnapshotError, match="duplicate keys"):
        m.deserialize(struct.pack("<IiBiB", 2, 5, 1, 5, 0))


@pytest.mark.parametrize("ser, values", [
    (Int64Serializer(), list(range(50))),
    (BoolSerializer(), [True, False] * 25),
    (StrSerializer(), [f"s{i}" * (i % 5) for i in range(50)]),
    (ValueSerializer(), [JSON_VALUE, None, 3] * 10),
    (NESTED, [NESTED_VALUE, {}] * 5),
])
def test_deserialize_many_with_corrupt_offsets_and_data(ser, values):
    buf, offsets = ser.serialize_many(values)
    rng = random.Random(3)
    for _ in range(1500):
        o = offsets.copy()
        b = bytearray(buf)
        kind = rng.randrange(3)
        if kind == 0:
            o[rng.randrange(len(o))] = rng.randrange(-5, len(buf) + 10)
        elif kind == 1 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        else:
            b = b[:rng.randrange(len(b) + 1)]
        try:
            out = ser.deserialize_many(bytes(b), o)
            assert len(out) == len(values)
        except CorruptSnapshotError:
            pass


def test_deserialize_many_offsets_dtypes():
    buf, offsets = Int32Serializer().serialize_many([1, 2, 3])
    for dt in (np.int32, np.uint64, np.int16):
        assert Int32Serializer().deserialize_many(buf, offsets.astype(dt)) == [1, 2, 3]
