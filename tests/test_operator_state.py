"""Operator state (FLIP-8) end to end: real checkpoint files, real metadata, the compiled splitter."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, DistributionMode, OperatorStateHandle
from keygroups.checkpoint.operator_format import BLOCK_BYTES
from keygroups.errors import CorruptSnapshotError, StateMigrationError
from keygroups.serializers import Int64Serializer, StrSerializer, TupleSerializer, ValueSerializer
from keygroups.state import (
    CheckpointedFunction,
    FunctionInitializationContext,
    FunctionSnapshotContext,
    ListCheckpointed,
    ListStateDescriptor,
    MapStateDescriptor,
    OperatorStateStore,
    checkpoint_function,
    initialize_function,
)

PAIRS = ListStateDescriptor("pairs", TupleSerializer(Int64Serializer(), Int64Serializer()))
UNION = ListStateDescriptor("everyone", StrSerializer())
CONFIG = MapStateDescriptor("config", StrSerializer(), ValueSerializer())


def checkpoint(storage: CheckpointStorage, stores: list[OperatorStateStore], checkpoint_id: int):
    """Snapshot every subtask, commit the metadata, and load it back (so handles go through _metadata JSON)."""
    handles = [s.snapshot(checkpoint_id, storage).result(timeout=60) for s in stores]
    storage.commit(CheckpointMetadata(
        checkpoint_id=checkpoint_id, job_id="operator-tests", timestamp_ms=1_700_000_000_000 + checkpoint_id,
        max_parallelism=128, parallelism=len(stores), keyed_handles=[], operator_handles=handles, properties={}))
    return storage.load(checkpoint_id)


def restored(storage, metadata, parallelism: int) -> list[OperatorStateStore]:
    stores = []
    for i in range(parallelism):
        store = OperatorStateStore(i, parallelism)
        store.restore(storage, metadata)
        stores.append(store)
    return stores


@pytest.fixture
def storage(tmp_path):
    return CheckpointStorage(tmp_path / "checkpoints", retain=100)


def _old_job(storage, lists: list[list[tuple[int, int]]], checkpoint_id: int = 1):
    stores = []
    for i, elements in enumerate(lists):
        store = OperatorStateStore(i, len(lists))
        store.get_list_state(PAIRS).update(elements)
        store.get_union_list_state(UNION).add(f"subtask-{i}")
        store.get_broadcast_state(CONFIG).put_all({"rate": 0.5, "names": ["a", "b"], "owner": None})
        stores.append(store)
    return checkpoint(storage, stores, checkpoint_id)


def test_split_list_state_scales_down_and_up(storage):
    lists = [[(0, 10), (1, 11)], [(2, 12), (3, 13)]]
    md = _old_job(storage, lists)
    (one,) = restored(storage, md, 1)
    assert one.get_list_state(PAIRS).get() == [(0, 10), (1, 11), (2, 12), (3, 13)]
    four = restored(storage, md, 4)
    assert [s.get_list_state(PAIRS).get() for s in four] == [[(0, 10)], [(1, 11)], [(2, 12)], [(3, 13)]]
    assert all(s.is_restored and s.restored_checkpoint_id == 1 for s in four)


@pytest.mark.parametrize("new_parallelism", [1, 2, 5])
def test_union_and_broadcast_restore_everywhere(storage, new_parallelism):
    md = _old_job(storage, [[(0, 0)], [], [(1, 1), (2, 2)]])
    for store in restored(storage, md, new_parallelism):
        assert sorted(store.get_union_list_state(UNION).get()) == ["subtask-0", "subtask-1", "subtask-2"]
        config = store.get_broadcast_state(CONFIG)
        assert dict(config.items()) == {"rate": 0.5, "names": ["a", "b"], "owner": None}
        assert config.mode == DistributionMode.BROADCAST


def test_broadcast_copies_are_independent(storage):
    md = _old_job(storage, [[], []])
    a, b = restored(storage, md, 2)
    a.get_broadcast_state(CONFIG).put("rate", 1.0)
    assert b.get_broadcast_state(CONFIG).get("rate") == 0.5


def test_extra_elements_rotate_across_states(storage):
    first = ListStateDescriptor("a", Int64Serializer())
    second = ListStateDescriptor("b", Int64Serializer())
    old = OperatorStateStore(0, 1)
    old.get_list_state(first).update(range(5))
    old.get_list_state(second).update(range(100, 105))
    md = checkpoint(storage, [old], 1)
    stores = restored(storage, md, 3)
    assert [s.get_list_state(first).get() for s in stores] == [[0, 1], [2, 3], [4]]
    # Flink's round robin: the next state starts handing out at the first subtask that got no extra element
    assert [s.get_list_state(second).get() for s in stores] == [[102, 103], [104], [100, 101]]


def test_rescale_chain_3_to_7_to_2_keeps_every_element_once(storage):
    md = _old_job(storage, [[(i, j) for j in range(i * 3)] for i in range(3)])
    expected = Counter((i, j) for i in range(3) for j in range(i * 3))
    seven = restored(storage, md, 7)
    assert Counter(e for s in seven for e in s.get_list_state(PAIRS).get()) == expected
    for s in seven:
        s.get_union_list_state(UNION)
        s.get_broadcast_state(CONFIG)
    md2 = checkpoint(storage, seven, 2)
    two = restored(storage, md2, 2)
    sizes = [len(s.get_list_state(PAIRS)) for s in two]
    assert Counter(e for s in two for e in s.get_list_state(PAIRS).get()) == expected
    assert max(sizes) - min(sizes) <= 1
    # the union state was unioned at 7 (each had all 3), so now each holds all 7 copies
    assert Counter(two[0].get_union_list_state(UNION).get()) == Counter(
        {"subtask-0": 7, "subtask-1": 7, "subtask-2": 7})


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=6), st.integers(1, 8), st.integers(0, 3))
def test_restore_property(sizes, new_parallelism, union_size):
    """Any old sizes and parallelism -> any new parallelism: split restores the same multiset, balanced; union
    gives everything to everyone."""
    with tempfile.TemporaryDirectory() as tmp:
        storage = CheckpointStorage(os.path.join(tmp, "c"), retain=100)
        stores = []
        for i, n in enumerate(sizes):
            store = OperatorStateStore(i, len(sizes))
            store.get_list_state(PAIRS).update((i, j) for j in range(n))
            store.get_union_list_state(UNION).update(f"{i}/{j}" for j in range(union_size))
            stores.append(store)
        md = checkpoint(storage, stores, 1)
        new = restored(storage, md, new_parallelism)
        lists = [s.get_list_state(PAIRS).get() for s in new]
        assert Counter(e for lst in lists for e in lst) == Counter((i, j) for i, n in enumerate(sizes)
                                                                    for j in range(n))
        assert max(map(len, lists)) - min(map(len, lists)) <= 1
        everything = sorted(f"{i}/{j}" for i in range(len(sizes)) for j in range(union_size))
        for s in new:
            assert sorted(s.get_union_list_state(UNION).get()) == everything


def test_snapshot_captures_the_state_at_the_call(storage):
    store = OperatorStateStore(0, 1)
    state = store.get_list_state(PAIRS)
    state.update([(1, 1)])
    future = store.snapshot(1, storage)
    state.add((2, 2))
    handle = future.result(timeout=60)
    assert handle.file.startswith("chk-1/") and not os.path.isabs(handle.file)
    assert handle.states["pairs"].mode == DistributionMode.SPLIT_DISTRIBUTE
    assert len(handle.states["pairs"].offsets) == 1
    json.dumps(handle.to_json())   # plain JSON
    md = checkpoint(storage, [store], 2)
    (again,) = restored(storage, md, 1)
    assert again.get_list_state(PAIRS).get() == [(1, 1), (2, 2)]


def test_registering_again_returns_the_same_state_or_raises(storage):
    store = OperatorStateStore(0, 1)
    state = store.get_list_state(PAIRS)
    assert store.get_list_state(PAIRS) is state
    with pytest.raises(StateMigrationError, match="pairs"):
        store.get_union_list_state(PAIRS)
    with pytest.raises(StateMigrationError, match="pairs"):
        store.get_list_state(ListStateDescriptor("pairs", StrSerializer()))
    store.get_union_list_state(UNION)
    with pytest.raises(StateMigrationError, match="everyone"):
        store.get_broadcast_state(MapStateDescriptor("everyone", StrSerializer(), StrSerializer()))


def test_restored_mode_and_serializer_must_match(storage):
    md = _old_job(storage, [[(1, 2)]])
    (store,) = restored(storage, md, 1)
    with pytest.raises(StateMigrationError, match="pairs"):
        store.get_union_list_state(PAIRS)
    (store,) = restored(storage, md, 1)
    with pytest.raises(StateMigrationError, match="pairs"):
        store.get_list_state(ListStateDescriptor("pairs", StrSerializer()))


def test_restore_must_come_first(storage):
    md = _old_job(storage, [[(1, 2)]])
    store = OperatorStateStore(0, 1)
    store.get_list_state(PAIRS)
    with pytest.raises(ValueError, match="restore"):
        store.restore(storage, md)
    with pytest.raises(ValueError, match="subtask_index"):
        OperatorStateStore(3, 3)


def test_operators_sharing_a_checkpoint_restore_their_own_state(storage):
    source = OperatorStateStore(0, 1, operator_id="source")
    sink = OperatorStateStore(0, 1, operator_id="sink")
    source.get_list_state(PAIRS).add((1, 1))
    sink.get_list_state(PAIRS).add((2, 2))
    md = checkpoint(storage, [source, sink], 1)
    again = OperatorStateStore(0, 2, operator_id="sink")
    again.restore(storage, md)
    assert again.get_list_state(PAIRS).get() == [(2, 2)]


def test_a_subtask_reads_only_the_blocks_of_its_share(storage):
    elements = ListStateDescriptor("blobs", StrSerializer())
    store = OperatorStateStore(0, 1)
    store.get_list_state(elements).update(f"{i:08d}" + "x" * 200 for i in range(24000))
    md = checkpoint(storage, [store], 1)
    size = md.operator_handles[0].size
    assert size > 16 * BLOCK_BYTES
    for i in range(4):
        new = OperatorStateStore(i, 4)
        stats = new.restore(storage, md)
        got = new.get_list_state(elements).get()
        assert [int(s[:8]) for s in got] == list(range(i * 6000, (i + 1) * 6000))
        assert stats.elements == 6000
        # its quarter, widened to whole checksum blocks: at most one block more on each side
        assert size / 4 - 8 <= stats.bytes_read < size / 4 + 2 * BLOCK_BYTES


# ---- corruption -------------------------------------------------------------------------------------------------


def _file(storage, md) -> str:
    return os.path.join(storage.location, md.operator_handles[0].file)


@pytest.mark.parametrize("damage", ["flip-element-byte", "truncate", "extend", "magic"])
def test_damaged_operator_files_raise_corrupt_snapshot(storage, damage):
    md = _old_job(storage, [[(i, i) for i in range(50)]])
    path = _file(storage, md)
    data = bytearray(open(path, "rb").read())
    if damage == "flip-element-byte":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        del data[-3:]
    elif damage == "extend":
        data += b"\0"
    else:
        data[0:4] = b"XXXX"
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(CorruptSnapshotError):
        store = OperatorStateStore(0, 1)
        store.restore(storage, md)
        store.get_list_state(PAIRS).get()


@pytest.mark.parametrize("location", ["local", "memory"])
def test_a_missing_operator_file_is_a_corrupt_snapshot_naming_it(tmp_path, location):
    storage = CheckpointStorage(str(tmp_path / "chk") if location == "local" else f"memory://{tmp_path.name}/chk")
    md = _old_job(storage, [[(i, i) for i in range(10)]])
    fs, path = fsspec.core.url_to_fs(storage.url(md.operator_handles[0].file))
    fs.rm(path)
    with pytest.raises(CorruptSnapshotError, match=rf"operator state file '{md.operator_handles[0].file}' is "
                                                   r"missing from .*chk"):
        store = OperatorStateStore(0, 1)
        store.restore(storage, md)
        store.get_list_state(PAIRS).get()


@pytest.mark.parametrize("tamper", ["offset-past-end", "offsets-descending", "end-past-file", "bad-mode"])
def test_damaged_handles_raise_corrupt_snapshot(storage, tamper):
    md = _old_job(storage, [[(i, i) for i in range(10)]])
    raw = md.operator_handles[0].to_json()   # handles come from JSON: tamper there
    meta = raw["states"]["pairs"]
    if tamper == "offset-past-end":
        meta["offsets"][3] = 10**9
    elif tamper == "offsets-descending":
        meta["offsets"][3], meta["offsets"][4] = meta["offsets"][4], meta["offsets"][3]
    elif tamper == "end-past-file":
        meta["end"] = raw["size"] + 100
    else:
        meta["mode"] = "SOMETIMES"
    with pytest.raises(CorruptSnapshotError):
        md.operator_handles[0] = OperatorStateHandle.from_json(raw)
        for i in range(2):
            store = OperatorStateStore(i, 2)
            store.restore(storage, md)
            store.get_list_state(PAIRS).get()


# ---- CheckpointedFunction / ListCheckpointed ---------------------------------------------------------------------


class CountingSource(ListCheckpointed):
    def __init__(self):
        self.counts: dict[str, int] = {}
        self.restored_with = None

    def snapshot_state(self, checkpoint_id, timestamp_ms):
        return [[k, v] for k, v in sorted(self.counts.items())]

    def restore_state(self, state):
        self.restored_with = state
        self.counts = {k: v for k, v in state}


class RememberingFunction(CheckpointedFunction):
    def __init__(self):
        self.contexts = []
        self.seen: list[str] = []

    def initialize_state(self, context: FunctionInitializationContext):
        self.contexts.append(context)
        self.state = context.operator_state_store.get_union_list_state(UNION)
        self.seen = self.state.get()

    def snapshot_state(self, context: FunctionSnapshotContext):
        self.contexts.append(context)
        self.state.update(self.seen)


def test_list_checkpointed_round_trip_and_redistribution(storage):
    stores, functions = [], []
    for i in range(2):
        store, fn = OperatorStateStore(i, 2), CountingSource()
        initialize_function(fn, store)
        assert fn.restored_with is None           # restore_state is called on restore only
        fn.counts = {f"p{i}a": i, f"p{i}b": 10 + i}
        stores.append(store)
        functions.append(fn)
    handles = [checkpoint_function(fn, s, 7, 1234, storage).result(timeout=60) for fn, s in zip(functions, stores)]
    storage.commit(CheckpointMetadata(checkpoint_id=7, job_id="t", timestamp_ms=1234, max_parallelism=128,
                                      parallelism=2, keyed_handles=[], operator_handles=handles, properties={}))
    md = storage.load(7)
    merged = {}
    for i in range(3):
        store, fn = OperatorStateStore(i, 3), CountingSource()
        store.restore(storage, md)
        initialize_function(fn, store)
        assert fn.restored_with is not None
        merged.update(fn.counts)
    assert merged == {"p0a": 0, "p0b": 10, "p1a": 1, "p1b": 11}


def test_checkpointed_function_gets_its_contexts(storage):
    store, fn = OperatorStateStore(0, 1), RememberingFunction()
    initialize_function(fn, store, keyed_state_store="keyed-store")
    ctx = fn.contexts[0]
    assert (ctx.is_restored, ctx.restored_checkpoint_id, ctx.operator_state_store, ctx.keyed_state_store) == (
        False, None, store, "keyed-store")
    fn.seen = ["x", "y"]
    handle = checkpoint_function(fn, store, 3, 99, storage).result(timeout=60)
    assert fn.contexts[1] == FunctionSnapshotContext(checkpoint_id=3, timestamp_ms=99)
    storage.commit(CheckpointMetadata(checkpoint_id=3, job_id="t", timestamp_ms=99, max_parallelism=128,
                                      parallelism=1, keyed_handles=[], operator_handles=[handle], properties={}))
    again_store, again = OperatorStateStore(0, 1), RememberingFunction()
    again_store.restore(storage, storage.load(3))
    initialize_function(again, again_store)
    assert again.contexts[0].is_restored and again.contexts[0].restored_checkpoint_id == 3
    assert again.seen == ["x", "y"]


def test_a_function_cannot_be_both_kinds():
    class Both(CheckpointedFunction, ListCheckpointed):
        def snapshot_state(self, *args):
            return []

        def initialize_state(self, context):
            pass

        def restore_state(self, state):
            pass

    with pytest.raises(TypeError, match="only one"):
        initialize_function(Both(), OperatorStateStore(0, 1))
    initialize_function(object(), OperatorStateStore(0, 1))     # neither kind: nothing to do


# ---- remote storage: ranged reads instead of mapping ------------------------------------------------------------


@pytest.fixture
def memory_storage():
    import uuid

    import fsspec

    root = f"memory://operator-tests-{uuid.uuid4().hex}"
    yield CheckpointStorage(root, retain=100)
    fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


def test_remote_storage_restores_by_ranged_reads(memory_storage):
    elements = ListStateDescriptor("blobs", StrSerializer())
    old = []
    for i in range(2):
        store = OperatorStateStore(i, 2)
        store.get_list_state(elements).update(f"{i}-{j:06d}" + "y" * 300 for j in range(1500))
        store.get_broadcast_state(CONFIG).put("k", [1, 2])
        old.append(store)
    md = checkpoint(memory_storage, old, 1)
    size = md.operator_handles[0].size
    got = []
    for i in range(3):
        store = OperatorStateStore(i, 3)
        stats = store.restore(memory_storage, md)
        assert stats.bytes_read < size             # a share, not whole files
        got += store.get_list_state(elements).get()
        assert store.get_broadcast_state(CONFIG).items() == [("k", [1, 2])]
    assert sorted(got) == sorted(f"{i}-{j:06d}" + "y" * 300 for i in range(2) for j in range(1500))


def test_remote_corruption_is_detected(memory_storage):
    import fsspec

    md = _old_job(memory_storage, [[(i, i) for i in range(50)]])
    fs = fsspec.filesystem("memory")
    path = f"{memory_storage.location.removeprefix('memory://')}/{md.operator_handles[0].file}"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(path, bytes(data))
    with pytest.raises(CorruptSnapshotError, match="checksum"):
        OperatorStateStore(0, 1).restore(memory_storage, md)
    fs.pipe_file(path, bytes(data[:-5]))
    with pytest.raises(CorruptSnapshotError, match="truncated"):
        OperatorStateStore(0, 1).restore(memory_storage, md)


def test_a_share_moves_as_bytes_without_decoding(storage):
    md = _old_job(storage, [[(i, i) for i in range(7)], [(i, -i) for i in range(7, 10)]])
    store = OperatorStateStore(1, 2)
    store.restore(storage, md)
    share = store.restored_share("pairs")
    assert len(share) == 5
    data, offsets = share.to_bytes()
    assert len(data) == share.nbytes and len(offsets) == 6
    assert PAIRS.serializers["element"].deserialize_many(data, offsets) == [(5, 5), (6, 6), (7, -7), (8, -8),
                                                                            (9, -9)]
    assert store.get_list_state(PAIRS).get() == [(5, 5), (6, 6), (7, -7), (8, -8), (9, -9)]
    assert store.restored_share("pairs") is None      # registered: decoded, the share is let go
