"""Crafted or damaged state metas in ``_metadata`` (serializer snapshots, kinds, TTL) give a ``CorruptSnapshotError``
or ``StateMigrationError`` naming the state and what is wrong, on both backends and in the state reader, never a raw
KeyError / AttributeError / TypeError; values a serializer cannot hold name the state, the serializer and the range
(operator state too)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.checkpoint.metadata import decode_metadata, encode_metadata
from keygroups.errors import CorruptSnapshotError, KeyGroupsError, StateMigrationError, StateSerializationError
from keygroups.runtime.state_reader import KeyedStateReader
from keygroups.serializers import Int32Serializer, Int64Serializer, StrSerializer, TupleSerializer
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    OperatorStateStore,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    ValueStateDescriptor,
)

MAXP = 8
BACKENDS = [HeapKeyedStateBackend, RocksDBKeyedStateBackend]


def descriptors():
    ttl_list = ListStateDescriptor("l", Int64Serializer())
    ttl_list.enable_time_to_live(StateTtlConfig.new_builder(100).build())
    return [ValueStateDescriptor("v", Int64Serializer()),
            MapStateDescriptor("m", StrSerializer(), TupleSerializer(Int64Serializer(), StrSerializer())), ttl_list]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    storage = CheckpointStorage(str(tmp_path_factory.mktemp("chk")))
    backend = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    states = [backend.get_state(d) for d in descriptors()]
    for k in range(20):
        backend.set_current_key(k)
        states[0].update(k)
        states[1].put("a", (k, "x"))
        states[2].add(k)
    handle = backend.snapshot(1, storage).result()
    backend.dispose()
    md = CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=MAXP, parallelism=1,
                            keyed_handles=[handle], operator_handles=[])
    return storage, md


def with_meta(md: CheckpointMetadata, index: int, meta) -> CheckpointMetadata:
    (handle,) = md.keyed_handles
    states = list(handle.states)
    states[index] = meta
    return dataclasses.replace(md, keyed_handles=[dataclasses.replace(handle, states=states)])


def use(storage, md, backend_class) -> None:
    """Restore, register every state, read every key, snapshot."""
    backend = backend_class(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    try:
        backend.restore(storage, md)
        states = [backend.get_state(d) for d in descriptors()]
        for k in range(20):
            backend.set_current_key(k)
            states[0].value()
            states[1].items()
            states[2].get()
        backend.snapshot(2, storage).result()
    finally:
        backend.dispose()


def read(storage, md) -> None:
    for name in ("v", "m", "l"):
        list(KeyedStateReader(storage, md, name).read(KeyGroupRange(0, MAXP - 1)))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(["", "x", "value", "map", "list",
                                                                                       "int64", "tuple"]),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
                        ["identifier", "version", "config", "nested", "ttl_ms", "x"]), inner, max_size=3),
                    max_leaves=6)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


@st.composite
def crafted(draw, meta):
    """``meta`` with one part replaced by arbitrary JSON, or deleted."""
    meta = copy.deepcopy(meta)
    paths = [p for p in _paths(meta) if p]
    path = draw(st.sampled_from(paths))
    parent = meta
    for step in path[:-1]:
        parent = parent[step]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(JSON)
    return meta


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), index=st.integers(0, 2))
def test_crafted_state_metas_give_clear_errors(checkpoint, data, index):
    storage, md = checkpoint
    meta = data.draw(crafted(md.keyed_handles[0].states[index]), label="meta")
    bad = with_meta(md, index, meta)
    for run in [lambda: use(storage, bad, HeapKeyedStateBackend), lambda: use(storage, bad, RocksDBKeyedStateBackend),
                lambda: read(storage, bad)]:
        try:
            run()
        except KeyGroupsError as e:
            name = meta.get("name")
            if isinstance(name, str) and name:
                assert repr(name) in str(e) or f"'{name}'" in str(e), str(e)


@pytest.mark.parametrize("change,message", [
    (lambda m: m.pop("serializers"), "state 'v' has no serializers object"),
    (lambda m: m["serializers"].pop("value"), "state 'v' (value state) has no 'value' serializer"),
    (lambda m: m.__setitem__("kind", "queue"), "state 'v' has kind 'queue'"),
    (lambda m: m.__setitem__("ttl", "forever"), "state 'v' has a TTL that is not a JSON object"),
    (lambda m: m["serializers"].__setitem__("value", {"identifier": "tuple", "version": 1, "nested": []}),
     "state 'v': its 'value' serializer snapshot (TupleSerializer()) does not rebuild"),
    (lambda m: m["serializers"].__setitem__("key", True), "state 'v': its 'key' serializer snapshot is malformed"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_malformed_part_is_named(checkpoint, backend, change, message):
    storage, md = checkpoint
    meta = copy.deepcopy(md.keyed_handles[0].states[0])
    change(meta)
    bad = with_meta(md, 0, meta)
    with pytest.raises(CorruptSnapshotError, match="state 'v'") as e:
        use(storage, bad, backend)
    assert message in str(e.value)
    with pytest.raises(CorruptSnapshotError, match="state 'v'"):
        KeyedStateReader(storage, bad, "v")


@pytest.mark.parametrize("change", [
    lambda m: m.pop("ttl"),   # TTL-framed values read without TTL: RocksDB's compiled SST ingest splits them
    lambda m: m["serializers"].__setitem__("element", {"identifier": "int32", "version": 1, "config": {},
                                                       "nested": []}),  # migrated, decoded lazily on a read
], ids=["ttl dropped", "element int32"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_values_a_crafted_meta_cannot_decode_name_the_state(checkpoint, backend, change):
    """The bytes fail in compiled code (SST ingest, a restored layer's lazy decode, a migration), far from the
    restore's Python checks: the error still names the state (hypothesis found both)."""
    storage, md = checkpoint
    meta = copy.deepcopy(md.keyed_handles[0].states[2])
    change(meta)
    with pytest.raises((CorruptSnapshotError, StateMigrationError), match="state 'l'"):
        use(storage, with_meta(md, 2, meta), backend)


def test_a_crafted_meta_in_a_metadata_file_is_refused_on_restore(checkpoint):
    """Through the bytes of a ``_metadata`` (checksummed, so only a crafted one gets this far)."""
    storage, md = checkpoint
    meta = copy.deepcopy(md.keyed_handles[0].states[1])
    meta["serializers"]["map value"] = {"identifier": "int64", "version": 1, "config": {"x": 1}, "nested": [{}]}
    loaded = decode_metadata(encode_metadata(with_meta(md, 1, meta), "chk-1"), "chk-1", "crafted")
    with pytest.raises((CorruptSnapshotError, StateMigrationError), match="state 'm'"):
        use(storage, loaded, HeapKeyedStateBackend)


def test_operator_state_values_out_of_range_name_the_state_serializer_and_range(tmp_path):
    store = OperatorStateStore(0, 1)
    store.get_list_state(ListStateDescriptor("offsets", Int32Serializer())).add(2**40)
    with pytest.raises(StateSerializationError, match=r"operator state 'offsets' \(list state, serializer "
                                                      r"Int32Serializer\(\)\).*\[-2147483648, 2147483647\]"):
        store.snapshot(1, CheckpointStorage(str(tmp_path)))
    store = OperatorStateStore(0, 1)
    store.get_broadcast_state(MapStateDescriptor("rules", Int64Serializer(), Int64Serializer())).put(1, -2**63 - 1)
    with pytest.raises(StateSerializationError, match=r"operator state 'rules' \(broadcast state, serializer "
                                                      r"Int64Serializer\(\) -> Int64Serializer\(\)\).*"
                                                      r"\[-9223372036854775808, 9223372036854775807\]"):
        store.snapshot(1, CheckpointStorage(str(tmp_path)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_keyed_values_out_of_range_name_the_state_serializer_and_range(tmp_path, backend):
    b = backend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    state = b.get_state(MapStateDescriptor("totals", StrSerializer(), Int64Serializer()))
    b.set_current_key(1)
    state.put("x", 2**63)
    with pytest.raises(StateSerializationError, match=r"state 'totals' \(map state, serializer StrSerializer\(\) -> "
                                                      r"Int64Serializer\(\)\).*\[-9223372036854775808, "
                                                      r"9223372036854775807\]"):
        b.snapshot(1, CheckpointStorage(str(tmp_path))).result()
    b.dispose()
