"""The heap snapshot's compiled encoding against its Python definition, over every built-in serializer (nested
freely) and random records: the compiled value writer (``ValueFraming.encode``, ``framing.Encoder``) writes exactly
the bytes of the serializers' ``serialize`` and ``ValueFraming.reference_encode``, refuses exactly what they refuse,
and ``heapsnap``'s delta and full sections (merged with restored layers) are the Python merge, byte for byte."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups._native import heapsnap
from keygroups._native.framing import Encoder
from keygroups._native.statecore import Layer
from keygroups.serializers import Int64Serializer, RecordSerializer
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
