"""Chain completeness (issue 22): a checkpoint whose keyed handles list a delta block for a key group but not the full
block it applies to is refused at commit and at restore; checkpoints of earlier versions still restore; a backend
restored from a checkpoint without blocks for its key groups writes them full, so its chains are complete."""

from __future__ import annotations

import dataclasses
import pathlib
import shutil

import pytest
from test_checkpoint_storage import MAXP, STATES, _entries, read_all, write_checkpoint

from keygroups import KeyGroupRange, key_group_range
from keygroups.checkpoint import (
    CheckpointMetadata,
    KeyedStateHandle,
    CheckpointStorage,
    carry_forward,
    chain_tips,
    plan_keyed_restore,
    write_keyed_snapshot,
)
from keygroups.checkpoint.metadata import encode_metadata
from keygroups.errors import CorruptSnapshotError
from keygroups.serializers import Int64Serializer
from keygroups.runtime.backends import create_backend
from keygroups.state import ValueStateDescriptor

COUNT = ValueStateDescriptor("count", Int64Serializer())
V3 = pathlib.Path(__file__).parent / "data" / "keyed-checkpoint-v3"


def _delta(storage: CheckpointStorage, cid: int, fresh: tuple[int, ...] = ()) -> KeyedStateHandle:
    """A delta of every key group on top of the newest checkpoint (each naming its key group's newest block there)."""
    r = key_group_range(MAXP, 1, 0)
    latest = storage.latest()
    tips = {} if latest is None else chain_tips(latest, r)
    return write_keyed_snapshot(storage, cid, 0, r, STATES, ((kg, _entries(kg, cid)) for kg in r),
                                full_key_groups=set(), fresh_key_groups=fresh,
                                predecessors={kg: t for kg, t in tips.items() if kg not in fresh})


def _metadata(cid: int, handles: list) -> CheckpointMetadata:
    return CheckpointMetadata(checkpoint_id=cid, job_id="chains", timestamp_ms=0, max_parallelism=MAXP,
                              parallelism=1, keyed_handles=handles)


def _publish_unchecked(storage: CheckpointStorage, md: CheckpointMetadata) -> None:
    """Write ``_metadata`` as a tool of its own would, without the commit's checks."""
    storage._fs.makedirs(f"chk-{md.checkpoint_id}")
    storage._fs.write_exclusive(f"chk-{md.checkpoint_id}/_metadata", encode_metadata(md, f"chk-{md.checkpoint_id}"))


def test_a_commit_that_forgot_carry_forward_is_refused_and_publishes_nothing(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    write_checkpoint(storage, 1, parallelism=1, operator=False)
    delta = _delta(storage, 2)
    with pytest.raises(ValueError, match=r"checkpoint 2 lists a delta block of key group 0 .*written by checkpoint 2"
                                         r".* but not the block it applies to.*16 key groups.*carry_forward"):
        storage.commit(_metadata(2, [delta]))
    assert storage.checkpoint_ids() == [1]
    md = _metadata(2, carry_forward(storage.load(1), [delta]))   # the same batch, with its chains: committed
    storage.commit(md)
    assert set(read_all(storage, storage.load(2))) == set(range(MAXP))


def test_a_delta_of_key_groups_without_state_needs_no_base(tmp_path):
    """A writer that says so (``fresh_key_groups``: the key group had no state) may start a chain with a delta."""
    storage = CheckpointStorage(str(tmp_path / "chk"))
    storage.commit(_metadata(1, [_delta(storage, 1, fresh=tuple(range(MAXP)))]))
    assert storage.load(1).keyed_handles[0].fresh_key_groups == [KeyGroupRange(0, MAXP - 1)]
    with pytest.raises(ValueError, match=r"key group 4 .*\(12 key groups: 4, 5, 6"):
        storage.commit(_metadata(2, [_delta(storage, 2, fresh=(0, 1, 2, 3))]))


def test_a_restore_refuses_a_checked_chain_without_its_base(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    write_checkpoint(storage, 1, parallelism=1, operator=False)
    _publish_unchecked(storage, _metadata(2, [_delta(storage, 2)]))
    with pytest.raises(CorruptSnapshotError, match="checkpoint 2 lists a delta block of key group 3"):
        plan_keyed_restore(storage.load(2), KeyGroupRange(3, 5))
    backend = create_backend("heap", key_group_range(MAXP, 2, 0), MAXP, "string")
    with pytest.raises(CorruptSnapshotError, match="not the block it applies to"):
        backend.restore(storage, storage.load(2))


def test_checkpoints_of_earlier_versions_restore_as_before(tmp_path):
    """A format-3 chain (tests/data/keyed-checkpoint-v3: its deltas name no predecessor) plans, commits carried
    forward and restores as it always did; its handles say which deltas are fresh, so a dropped base is still
    refused."""
    shutil.copytree(V3 / "chk", tmp_path / "chk")
    storage = CheckpointStorage(str(tmp_path / "chk"), retain=10)
    loaded = storage.load(3)
    assert {h.format_version for h in loaded.keyed_handles} == {3}
    assert all(h.checksums is None and h.predecessors is None for h in loaded.keyed_handles)
    assert plan_keyed_restore(loaded, KeyGroupRange(0, 15))
    storage.commit(dataclasses.replace(_metadata(4, carry_forward(loaded, [])), max_parallelism=16, parallelism=2))
    assert storage.load(4).keyed_handles == loaded.keyed_handles
    without_base = [h for h in loaded.keyed_handles if h.checkpoint_id > 1]
    with pytest.raises(ValueError, match="but not the block it applies to"):
        storage.commit(dataclasses.replace(_metadata(5, without_base), max_parallelism=16, parallelism=2))


def test_dropping_the_base_of_an_older_delta_is_refused_too(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    one = write_checkpoint(storage, 1, parallelism=1, operator=False)
    two = _metadata(2, carry_forward(one, [_delta(storage, 2)]))
    storage.commit(two)
    three_delta = _delta(storage, 3)
    storage.commit(_metadata(3, carry_forward(storage.load(2), [three_delta])))
    without_base = [h for h in storage.load(3).keyed_handles if h.checkpoint_id != 1]
    storage4 = _delta(storage, 4)
    with pytest.raises(ValueError, match="written by checkpoint 2"):
        storage.commit(_metadata(4, [*without_base, storage4]))


@pytest.mark.parametrize("backend_kind", ["heap", "rocksdb"])
def test_a_backend_restored_without_blocks_for_its_key_groups_writes_them_full(tmp_path, backend_kind):
    """A checkpoint without keyed files (a savepoint bootstrapped with no state for these key groups, say): the
    next snapshot writes every key group full, so its commit (checked) succeeds and restores what was written."""
    storage = CheckpointStorage(str(tmp_path / "chk"))
    storage.commit(_metadata(1, []))
    r = key_group_range(MAXP, 1, 0)
    backend = create_backend(backend_kind, r, MAXP, "string")
    backend.restore(storage, storage.load(1))
    state = backend.get_state(COUNT)
    for key in ("a", "b", "c"):
        backend.set_current_key(key)
        state.update(len(key) + 10)
    handle = backend.snapshot(2, storage).result()
    assert handle.is_all_full
    storage.commit(_metadata(2, carry_forward(storage.load(1), [handle])))
    again = create_backend(backend_kind, r, MAXP, "string")
    again.restore(storage, storage.load(2))
    values = again.get_state(COUNT)
    for key in ("a", "b", "c"):
        again.set_current_key(key)
        assert values.value() == 11
    backend.dispose()
    again.dispose()
