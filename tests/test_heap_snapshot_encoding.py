"""The heap snapshot's compiled encoding against its Python definition, over every built-in serializer (nested
freely) and random records: the compiled value writer (``ValueFraming.encode``, ``framing.Encoder``) writes exactly
the bytes of the serializers' ``serialize`` and ``ValueFraming.reference_encode``, refuses exactly what they refuse,
``heapsnap``'s delta and full sections (merged with restored layers) are the Python merge, byte for byte; and the
compiled value reader (``ValueFraming.decode``, ``framing.ValueReader``) decodes what ``ValueFraming.reference_decode``
decodes and raises what it raises, on any bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from keygroups._native import heapsnap
from keygroups._native.framing import Encoder
from keygroups._native.statecore import Layer
from keygroups.errors import CorruptSnapshotError
from keygroups.serializers import Int64Serializer, RecordSerializer, StrSerializer
from keygroups.serializers.base import checks_on_write
from keygroups.state._codec import UNWRITABLE, ValueFraming
from keygroups.state.states import MISSING
from record_strategies import record_types, values_of
from test_serializers_strategies import hashable_leaf, serializers_and_values

records = record_types().map(lambda t: (RecordSerializer(t), values_of(t)))
any_serializer = st.one_of(serializers_and_values, records)
timestamps = st.integers(-(2**40), 2**40)
KEYS = Int64Serializer()


def _outcome(fn: Any, v: Any) -> Any:
    """What ``fn(v)`` gives: its bytes, or the kind of refusal (a serializer's UNWRITABLE errors)."""
    try:
        return bytes(fn(v))
    except UNWRITABLE:
        return "refused"


@st.composite
def framings(draw: Any, kinds: tuple[str, ...] = ("value", "list", "map"), ttl: Any = None) -> tuple[Any, Any]:
    """(a state's ValueFraming of a random kind and serializers, a strategy of its stored values)."""
    kind = draw(st.sampled_from(kinds))
    ttl = draw(st.booleans()) if ttl is None else ttl
    ser, values = draw(any_serializer)
    stamped = st.tuples(values, timestamps) if ttl else values
    if kind == "value":
        return ValueFraming("s", "value", ser, ttl=ttl), stamped
    if kind == "list":
        return ValueFraming("s", "list", ser, ttl=ttl), st.lists(stamped, min_size=1, max_size=4)
    key_ser, keys = draw(hashable_leaf)
    return ValueFraming("s", "map", ser, key_ser, ttl=ttl), st.dictionaries(keys, stamped, min_size=1, max_size=4)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_compiled_encoder_writes_what_serialize_writes(data):
    ser, values = data.draw(any_serializer)
    encoder = Encoder(ser)
    for v in data.draw(st.lists(values, min_size=1, max_size=4)):
        assert encoder.encode(v) == ser.serialize(v)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_compiled_value_writer_writes_the_reference_framing(data):
    framing, values = data.draw(framings())
    for v in data.draw(st.lists(values, min_size=1, max_size=3)):
        assert framing.encode(v) == framing.reference_encode(v)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_compiled_encoder_refuses_what_serialize_refuses(data):
    # a value drawn for another serializer: both paths write the same bytes or both refuse it
    ser, _ = data.draw(any_serializer)
    _, other = data.draw(any_serializer)
    v = data.draw(other)
    expected = _outcome(ser.serialize, v)
    assert _outcome(Encoder(ser).encode, v) == expected
    check = checks_on_write(ser)
    if check is not None:   # the check on write refuses exactly what a snapshot could not write
        encoder = Encoder(ser, check)
        assert encoder.checks
        assert _outcome(lambda x: (encoder.check_value(x), b"")[1], v) == ("refused" if expected == "refused" else b"")
    for kind in ("value", "list"):
        framing = ValueFraming("s", kind, ser)
        stored = v if kind == "value" else [v]
        assert _outcome(framing.encode, stored) == _outcome(framing.reference_encode, stored)


def _python_delta(delta: dict, framing: ValueFraming, deadline: int | None) -> tuple[list, list, list]:
    keys, values, gone = [], [], []
    for k, v in delta.items():
        kb = KEYS.serialize(k)
        if v is MISSING or (deadline is not None and framing.drop_expired(v, deadline) is None):
            gone.append(kb)
            continue
        if deadline is not None:
            v = framing.drop_expired(v, deadline)
        keys.append(kb)
        values.append(framing.reference_encode(v))
    return keys, values, gone


def _items(packed: Any) -> list[bytes]:
    if packed is None:
        return []
    data, offsets = packed
    return [bytes(data[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)]


int64_keys = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_delta_section_is_the_python_delta(data):
    framing, values = data.draw(framings())
    delta = data.draw(st.dictionaries(int64_keys, st.just(MISSING) | values, max_size=6))
    deadline = data.draw(timestamps) if framing.ttl else None
    keys, vals, gone = heapsnap.delta_section(delta, Encoder(KEYS), framing.writer, MISSING, deadline)
    assert (_items(keys), _items(vals), _items(gone)) == _python_delta(delta, framing, deadline)


def _layer(puts: dict[bytes, bytes], deletes: set[bytes]) -> Layer:
    """A restored layer as a keyed block holds it: sorted keys, then their values, then the sorted deletes."""
    keys = sorted(puts)
    parts = keys + [puts[k] for k in keys] + sorted(deletes)
    offsets = [0]
    for p in parts:
        offsets.append(offsets[-1] + len(p))
    n, d = len(keys), len(deletes)
    return Layer(b"".join(parts), offsets[:n + 1], offsets[n:2 * n + 1], offsets[2 * n:2 * n + d + 1], True)


def _python_full(m: dict, layers: list[tuple[dict, set]], framing: ValueFraming, deadline: int | None) -> list:
    """The full section's definition (HeapKeyedStateBackend._full_section_merged_in_python, then the block
    encoder's sort): the decoded entries, then each layer's puts not shadowed by a newer source."""
    out: dict[bytes, bytes] = {}
    shadow: set[bytes] = set()
    for k, v in m.items():
        kb = KEYS.serialize(k)
        shadow.add(kb)
        if v is MISSING:
            continue
        if deadline is not None:
            v = framing.drop_expired(v, deadline)
            if v is None:
                continue
        out[kb] = framing.reference_encode(v)
    for puts, deletes in layers:
        shadow |= deletes
        for kb, vb in puts.items():
            if kb not in shadow:
                if deadline is None or framing.drop_expired_bytes(vb, deadline) is not None:
                    out[kb] = vb
        shadow |= set(puts)
    return sorted(out.items())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_full_section_is_the_python_merge_with_the_layers(data):
    framing, values = data.draw(framings())
    key_pool = data.draw(st.lists(int64_keys, min_size=1, max_size=10, unique=True))
    some_key = st.sampled_from(key_pool)
    m = data.draw(st.dictionaries(some_key, st.just(MISSING) | values, max_size=6))
    n_layers = data.draw(st.integers(0, 3))
    layers = []
    for depth in range(n_layers):
        puts = {KEYS.serialize(k): framing.encode(v)
                for k, v in data.draw(st.dictionaries(some_key, values, max_size=6)).items()}
        oldest = depth == n_layers - 1   # a chain's oldest block is full: it deletes nothing
        deletes = set() if oldest else {KEYS.serialize(k) for k in data.draw(st.sets(some_key, max_size=3))}
        layers.append((puts, deletes))
    # TTL with layers is merged in C for value states only (lists and maps drop expired parts in Python)
    ttl_in_c = framing.ttl and (not layers or framing.kind == "value")
    deadline = data.draw(timestamps) if ttl_in_c else None
    if framing.ttl and deadline is None:
        return
    merged = heapsnap.full_section(m, [_layer(p, d) for p, d in layers], Encoder(KEYS), framing.writer, MISSING,
                                   deadline)
    expected = _python_full(m, layers, framing, deadline)
    if merged is None:
        assert expected == []
        return
    block, key_offsets, value_offsets = merged
    got = list(zip(_items((block, key_offsets)), _items((block, value_offsets))))
    assert got == expected


# ---- decoding ------------------------------------------------------------------------------------------------------

def _decoded(fn: Any, b: Any) -> Any:
    """What ``fn(b)`` gives: ("ok", the value as the reference encoder writes it, its repr), or the error's type and
    message. A value's bytes and repr tell apart what ``==`` cannot (NaN, 1 against True against 1.0, key types)."""
    try:
        v = fn(b)
    except Exception as e:   # noqa: BLE001 -- the comparison is the point: same type, same message
        return type(e), str(e)
    return "ok", type(v), repr(v)


def _same(framing: ValueFraming, b: Any) -> Any:
    got = _decoded(framing.decode, b)
    assert got == _decoded(framing.reference_decode, b)
    return got


def _damaged(data: Any, b: bytes) -> bytes:
    """``b`` truncated, with bytes flipped, or with bytes appended, or random bytes."""
    how = data.draw(st.sampled_from(["cut", "flip", "append", "random"]))
    if how == "cut":
        return b[:data.draw(st.integers(0, max(len(b) - 1, 0)))]
    if how == "flip" and b:
        out = bytearray(b)
        for _ in range(data.draw(st.integers(1, 3))):
            i = data.draw(st.integers(0, len(out) - 1))
            out[i] = data.draw(st.integers(0, 255))
        return bytes(out)
    if how == "append":
        return b + data.draw(st.binary(min_size=1, max_size=12))
    return data.draw(st.binary(max_size=40))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_compiled_value_reader_decodes_what_the_reference_decodes(data):
    framing, values = data.draw(framings())
    for v in data.draw(st.lists(values, min_size=1, max_size=3)):
        b = framing.encode(v)
        got = _same(framing, b)
        assert got[0] == "ok"
        assert framing.encode(framing.decode(b)) == framing.reference_encode(framing.reference_decode(b))
        assert _same(framing, memoryview(b"--" + b)[2:]) == got   # a slice of a block, as restored layers give


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_compiled_value_reader_refuses_damaged_bytes_as_the_reference_does(data):
    framing, values = data.draw(framings())
    b = framing.encode(data.draw(values))
    for _ in range(3):
        _same(framing, _damaged(data, b))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_decoding_a_block_of_values_is_decoding_each(data):
    framing, values = data.draw(framings())
    assume(framing.kind != "value" or framing.ttl)   # plain values: the serializer's own deserialize_many
    stored = [framing.encode(v) for v in data.draw(st.lists(values, max_size=4))]
    if stored and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(stored) - 1))
        stored[i] = _damaged(data, stored[i])
    offsets = [0]
    for b in stored:
        offsets.append(offsets[-1] + len(b))
    block = b"".join(stored)

    def each(block: Any) -> list[Any]:
        return [framing.reference_decode(b) for b in stored]

    assert _decoded(lambda blk: framing.decode_many(blk, np.array(offsets)), block) == _decoded(each, block)


class _PythonInts(Int64Serializer):
    """A user's serializer: its deserialize (Python) is what decodes, and it refuses a wrong size itself."""

    def deserialize(self, data: Any) -> Any:
        if len(data) != 8:
            raise CorruptSnapshotError(f"{len(data)} bytes are not an int64")
        return int.from_bytes(bytes(data), "little", signed=True) * 10


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_user_serializer_decodes_through_its_deserialize(data):
    kind = data.draw(st.sampled_from(["value", "list", "map"]))
    ttl = data.draw(st.booleans())
    user, builtin = _PythonInts(), StrSerializer()
    value_ser, key_ser = data.draw(st.sampled_from([(user, user), (user, builtin), (builtin, user)]))
    framing = ValueFraming("s", kind, value_ser, key_ser if kind == "map" else None, ttl=ttl)
    leaf = st.integers(-(2**40), 2**40) if value_ser is user else st.text(max_size=4)
    key = st.integers(-(2**40), 2**40) if key_ser is user else st.text(max_size=4)
    stamped = st.tuples(leaf, timestamps) if ttl else leaf
    v = data.draw({"value": stamped, "list": st.lists(stamped, min_size=1, max_size=3),
                   "map": st.dictionaries(key, stamped, min_size=1, max_size=3)}[kind])
    b = framing.encode(v)
    assert _same(framing, b)[0] == "ok"
    assert framing.reader.value_how == 2 or value_ser is builtin
    for _ in range(3):
        _same(framing, _damaged(data, b))


def test_decoded_map_keys_are_canonical_as_java_keys_makes_them():
    from keygroups._javakeys import NAN_KEY, NEGATIVE_ZERO_KEY
    from keygroups.serializers import Float64Serializer, TupleSerializer

    framing = ValueFraming("s", "map", Int64Serializer(), Float64Serializer())
    stored = framing.encode({NAN_KEY: 1, NEGATIVE_ZERO_KEY: 2, 0.0: 3})   # decoded: plain floats, then canonical
    got = framing.decode(stored)
    assert got == {NAN_KEY: 1, NEGATIVE_ZERO_KEY: 2, 0.0: 3}
    assert [type(k) for k in got] == [type(k) for k in framing.reference_decode(stored)]
    assert next(iter(got)) is NAN_KEY
    pairs = ValueFraming("s", "map", Int64Serializer(), TupleSerializer(Float64Serializer(), StrSerializer()))
    got = pairs.decode(pairs.encode({(-0.0, "a"): 1}))
    assert list(got) == [(NEGATIVE_ZERO_KEY, "a")] and list(got)[0][0] is NEGATIVE_ZERO_KEY


def test_a_corrupt_value_is_named_by_its_state_and_kind():
    framing = ValueFraming("prices", "map", Int64Serializer(), StrSerializer(), ttl=True)
    b = framing.encode({"a": (1, 5)})
    for damaged in (b[:-3], b + b"\x01"):
        try:
            framing.decode(damaged)
        except CorruptSnapshotError as e:
            assert str(e).startswith("state 'prices': a map value: ")
        else:
            raise AssertionError("decoded damaged bytes")
