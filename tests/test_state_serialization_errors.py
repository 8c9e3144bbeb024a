"""A value its serializer cannot write fails the snapshot with an error naming the state, the serializer and the
key — full and incremental snapshots alike — and the state stays usable: once the value is fixed, the next snapshot
writes it."""

from __future__ import annotations

import pytest

from keygroups import KeyGroupRange
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.errors import StateSerializationError
from keygroups.serializers import Int64Serializer, StrSerializer
from keygroups.state import HeapKeyedStateBackend, MapStateDescriptor, RocksDBKeyedStateBackend, ValueStateDescriptor

RANGE = KeyGroupRange(0, 15)
BACKENDS = {"heap": HeapKeyedStateBackend, "rocksdb": RocksDBKeyedStateBackend}


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("incremental", [False, True])
def test_an_unwritable_value_names_its_state_serializer_and_key(tmp_path, name, incremental):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    backend = BACKENDS[name](RANGE, 16, Int64Serializer())
    counter = backend.get_state(ValueStateDescriptor("counter", Int64Serializer()))
    names = backend.get_state(MapStateDescriptor("names", StrSerializer(), StrSerializer()))
    for k in range(20):
        backend.set_current_key(k)
        counter.update(k)
    if incremental:   # the bad value goes into a delta after a first checkpoint
        handle = backend.snapshot(1, storage).result()
        storage.commit(CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=16,
                                          parallelism=1, keyed_handles=[handle], operator_handles=[]))
    backend.set_current_key(7)
    counter.update(2**63)
    with pytest.raises(StateSerializationError, match=r"state 'counter' \(value state, serializer "
                                                      r"Int64Serializer\(\)\) cannot write the entry of key 7: "
                                                      r"9223372036854775808 is out of range"):
        backend.snapshot(2, storage).result()
    counter.update(-7)
    names.put("name", "\ud800")
    with pytest.raises(StateSerializationError, match=r"state 'names' \(map state, serializer StrSerializer\(\) -> "
                                                      r"StrSerializer\(\)\) cannot write the entry of key 7: .*"
                                                      r"surrogates not allowed"):
        backend.snapshot(2, storage).result()
    names.put("name", "Ada")
    handle = backend.snapshot(2, storage).result()
    backend.dispose()
    restored = BACKENDS[name](RANGE, 16, Int64Serializer())
    restored.restore(storage, CheckpointMetadata(
        checkpoint_id=2, job_id="j", timestamp_ms=0, max_parallelism=16, parallelism=1,
        keyed_handles=[handle] + ([] if not incremental else storage.load(1).keyed_handles), operator_handles=[]))
    restored.set_current_key(7)
    assert restored.get_state(ValueStateDescriptor("counter", Int64Serializer())).value() == -7
    assert dict(restored.get_state(MapStateDescriptor("names", StrSerializer(), StrSerializer())).items()) == {
        "name": "Ada"}
    restored.dispose()
