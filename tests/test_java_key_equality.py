"""Keys compare as Java's ``equals`` compares them in both backends, before and after a snapshot and a restore at
another parallelism: every NaN is one key (``Double.equals``), ``-0.0`` and ``0.0`` are two, alone or inside tuple
keys; the backends hash them by the same rule they compare them by."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange, key_group_range
from keygroups._javakeys import NAN_KEY, NEGATIVE_ZERO_KEY
from keygroups._native.statecore import java_key
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.errors import KeyGroupOutOfRangeError
from keygroups.serializers import Float64Serializer, Int64Serializer, TupleSerializer
from keygroups.state import HeapKeyedStateBackend, RocksDBKeyedStateBackend, ValueStateDescriptor

MAXP = 8
BACKENDS = {"heap": HeapKeyedStateBackend, "rocksdb": RocksDBKeyedStateBackend}


def java_bits(x: float) -> int:
    return 0x7FF8000000000000 if math.isnan(x) else struct.unpack("<q", struct.pack("<d", x))[0]


def model_key(key):
    return tuple(model_key(k) for k in key) if isinstance(key, tuple) else java_bits(key)


nans = st.sampled_from(["7ff8000000000000", "fff8000000000000", "7ff0000000000001", "7fffffffffffffff"]).map(
    lambda h: struct.unpack(">d", bytes.fromhex(h))[0])
floats = st.one_of(nans, st.sampled_from([0.0, -0.0, 1.0, -1.0]), st.floats(allow_nan=False, width=64))


def test_java_key_canonical_objects():
    assert java_key(float("nan")) is NAN_KEY and java_key(-math.nan) is NAN_KEY
    assert java_key(-0.0) is NEGATIVE_ZERO_KEY and java_key(0.0) == 0.0
    assert NEGATIVE_ZERO_KEY != 0.0 and 0.0 != NEGATIVE_ZERO_KEY and hash(NEGATIVE_ZERO_KEY) != hash(0.0)
    assert java_key((1, -0.0)) != (1, 0.0) and java_key((1, math.nan)) == java_key((1, float("nan")))
    key = (1, "a", 2.5)
    assert java_key(key) is key   # nothing to change: the same object


def _owns(backend, key) -> bool:
    """Whether ``backend`` owns ``key``'s key group (it becomes the current key there)."""
    try:
        backend.set_current_key(key)
        return True
    except KeyGroupOutOfRangeError:
        return False


@pytest.mark.parametrize("name", sorted(BACKENDS))
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(floats, st.integers(0, 2)), min_size=1, max_size=40), new_p=st.integers(1, 3),
       tuples=st.booleans())
def test_float_keys_are_java_keys_through_snapshot_and_rescale(tmp_path_factory, name, ops, new_p, tuples):
    key_ser = TupleSerializer(Int64Serializer(), Float64Serializer()) if tuples else Float64Serializer()
    backend = BACKENDS[name](KeyGroupRange(0, MAXP - 1), MAXP, key_ser)
    desc = ValueStateDescriptor("n", Int64Serializer())
    state = backend.get_state(desc)
    model: dict = {}
    for x, tag in ops:
        key = (tag, x) if tuples else x
        backend.set_current_key(key)
        state.update((state.value() or 0) + 1)
        model[model_key(key)] = model.get(model_key(key), 0) + 1
    storage = CheckpointStorage(str(tmp_path_factory.mktemp("chk")))
    handle = backend.snapshot(1, storage).result()
    backend.dispose()
    md = CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=MAXP, parallelism=1,
                            keyed_handles=[handle], operator_handles=[])
    for other in BACKENDS.values():
        restored = []
        for i in range(new_p):
            b = other(key_group_range(MAXP, new_p, i), MAXP, key_ser)
            b.restore(storage, md)
            restored.append(b)
        for x, tag in ops:
            key = (tag, x) if tuples else x
            owners = [b for b in restored if _owns(b, key)]
            assert len(owners) == 1
            assert owners[0].get_state(desc).value() == model[model_key(key)]
        for b in restored:
            b.dispose()
