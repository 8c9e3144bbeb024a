"""Restore planning at any parallelism (in the spirit of Flink's RescalingITCase), with real files and real key
groups, and the refusal of a changed max parallelism."""

from __future__ import annotations

import uuid

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange, assign_to_key_group, key_group_range
from keygroups.checkpoint import (
    CheckpointMetadata,
    CheckpointStorage,
    KeyedStateHandle,
    check_restore_max_parallelism,
    parent_key_groups,
    plan_keyed_restore,
    read_key_groups,
    write_keyed_snapshot,
)
from keygroups.errors import CorruptSnapshotError, StateMigrationError

STATES = [{"name": "sum", "kind": "value"}, {"name": "seen", "kind": "map"}]
RESCALES = [(2, 4), (4, 2), (3, 1), (1, 7), (15, 77), (77, 15)]


@pytest.fixture
def storage():
    location = f"memory://kg-plan-{uuid.uuid4().hex}"
    yield CheckpointStorage(location)
    fs, root = fsspec.core.url_to_fs(location)
    if fs.exists(root):
        fs.rm(root, recursive=True)


def fake_handles(maxp: int, p: int) -> list[KeyedStateHandle]:
    """Handles with plausible offsets (no files): planning only looks at ranges."""
    out = []
    for i in range(p):
        r = key_group_range(maxp, p, i)
        out.append(KeyedStateHandle(f"chk-1/keyed-{i}-x", i, r, [100 + 10 * j for j in range(len(r) + 1)],
                                    100 + 10 * len(r) + 50, STATES, checkpoint_id=1))
    return out


@pytest.mark.parametrize("p_old,p_new", RESCALES)
def test_plan_partitions_the_key_groups_exactly(p_old, p_new):
    maxp = 128
    md = CheckpointMetadata(1, "job", 0, maxp, p_old, fake_handles(maxp, p_old))
    covered: list[int] = []
    for j in range(p_new):
        new_range = key_group_range(maxp, p_new, j)
        plan = plan_keyed_restore(md, new_range, max_parallelism=maxp)
        parts = [part for _, part in plan]
        # this subtask reads exactly its own key groups, each once, in order
        assert [kg for part in parts for kg in part] == list(new_range)
        for h, part in plan:
            assert part == h.key_group_range.intersection(new_range) and part
        # ... and only from the old handles that intersect it
        used = {h.subtask for h, _ in plan}
        assert used == {h.subtask for h in md.keyed_handles if h.key_group_range.intersection(new_range)}
        covered.extend(kg for part in parts for kg in part)
    assert sorted(covered) == list(range(maxp)) and len(covered) == maxp


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_plan_partitions_for_any_parallelisms(data):
    maxp = data.draw(st.integers(1, 400), label="max_parallelism")
    p_old = data.draw(st.integers(1, maxp), label="p_old")
    p_new = data.draw(st.integers(1, maxp), label="p_new")
    md = CheckpointMetadata(1, "job", 0, maxp, p_old, fake_handles(maxp, p_old))
    covered = []
    for j in range(p_new):
        new_range = key_group_range(maxp, p_new, j)
        plan = plan_keyed_restore(md, new_range, max_parallelism=maxp)
        assert [kg for _, part in plan for kg in part] == list(new_range)
        # a contiguous range intersects at most the old subtasks its ends fall into, and every one between
        first = new_range.start * p_old // maxp
        last = new_range.end * p_old // maxp
        assert [h.subtask for h, _ in plan] == list(range(first, last + 1))
        covered.extend(new_range)
    assert covered == list(range(maxp))


def test_plan_skips_subtasks_without_keyed_state():
    md = CheckpointMetadata(1, "job", 0, 16, 4, [h for h in fake_handles(16, 4) if h.subtask != 2])
    plan = plan_keyed_restore(md, KeyGroupRange(0, 15))
    assert [h.subtask for h, _ in plan] == [0, 1, 3]
    assert plan_keyed_restore(md, KeyGroupRange(8, 11)) == []


def test_max_parallelism_changes_only_by_an_integer_factor():
    md = CheckpointMetadata(42, "job-7", 0, 128, 4, fake_handles(128, 4))
    with pytest.raises(StateMigrationError) as e:
        check_restore_max_parallelism(md, 200)
    msg = str(e.value)
    assert "max_parallelism=128" in msg and "max_parallelism=200" in msg
    assert "only change by an integer factor" in msg and "checkpoint 42" in msg
    assert "256, 384, 512, ..., 32768" in msg and "(1, 2, 4, 8, 16, 32, 64)" in msg   # the allowed values
    with pytest.raises(StateMigrationError, match="only change by an integer factor"):
        plan_keyed_restore(md, KeyGroupRange(0, 10), max_parallelism=96)
    with pytest.raises(StateMigrationError, match="max_parallelism=128"):
        plan_keyed_restore(md, KeyGroupRange(100, 200))   # key groups the old job never had
    assert [check_restore_max_parallelism(md, m) for m in (128, 256, 384, 32768, 64, 1)] == [128, 256, 384, 32768,
                                                                                               64, 1]
    with pytest.raises(ValueError, match=r"max_parallelism must be in.*a divisor of 128 \(1, 2, 4"):
        check_restore_max_parallelism(md, 0)
    with pytest.raises(ValueError, match="max_parallelism must be in"):
        check_restore_max_parallelism(CheckpointMetadata(1, "j", 0, 32768, 1, []), 65536)


@pytest.mark.parametrize("old,new,new_range,parents", [
    (128, 512, KeyGroupRange(0, 511), [KeyGroupRange(0, 127)]),
    (128, 512, KeyGroupRange(100, 150), [KeyGroupRange(100, 127), KeyGroupRange(0, 22)][::-1]),
    (128, 512, KeyGroupRange(300, 340), [KeyGroupRange(44, 84)]),
    (128, 256, KeyGroupRange(0, 127), [KeyGroupRange(0, 127)]),
    (512, 128, KeyGroupRange(10, 20), [KeyGroupRange(10 + j * 128, 20 + j * 128) for j in range(4)]),
    (128, 128, KeyGroupRange(5, 9), [KeyGroupRange(5, 9)]),
])
def test_parent_key_groups(old, new, new_range, parents):
    assert parent_key_groups(new_range, old, new) == parents
    # every key group of new_range has its parents inside them (g % old, or g + j * new)
    covered = {kg for r in parents for kg in r}
    for g in new_range:
        want = {g % old} if new >= old else {g + j * new for j in range(old // new)}
        assert want <= covered
    if new >= old:
        assert len(covered) <= len(new_range)   # at most one parent per new key group: at most k x the share
    else:
        assert len(covered) == len(new_range) * (old // new)   # the merged groups, exactly the share


def test_plan_across_a_max_parallelism_change_reads_only_parent_key_groups():
    md = CheckpointMetadata(1, "job", 0, 128, 4, fake_handles(128, 4))
    plan = plan_keyed_restore(md, KeyGroupRange(300, 340), max_parallelism=512)
    assert {kg for _, part in plan for kg in part} == set(range(44, 85))
    plan = plan_keyed_restore(md, KeyGroupRange(10, 11), max_parallelism=32)
    assert {kg for _, part in plan for kg in part} == {10, 11, 42, 43, 74, 75, 106, 107}


def test_overlapping_handles_are_corrupt_metadata():
    a, b = fake_handles(16, 2)
    bad = KeyedStateHandle("chk-1/keyed-1-y", 1, KeyGroupRange(7, 15), [0] * 10, 10, STATES, checkpoint_id=1)
    md = CheckpointMetadata(1, "job", 0, 16, 2, [a, bad])
    with pytest.raises(CorruptSnapshotError, match="overlapping"):
        plan_keyed_restore(md, KeyGroupRange(0, 15))


# -- end to end: write at p, restore at p', every key where it belongs -------------------------------------------

def snapshot_job(storage, keys: list[int], maxp: int, p: int, cid: int = 1) -> CheckpointMetadata:
    """Each of p subtasks writes the keys of its key groups: value state = key * 3, map state {key: "k<key>"}."""
    by_group: dict[int, list[int]] = {}
    for k in keys:
        by_group.setdefault(assign_to_key_group(k, maxp), []).append(k)
    handles = []
    for i in range(p):
        r = key_group_range(maxp, p, i)
        blocks = []
        for kg in r:
            ks = sorted(by_group.get(kg, []))
            if ks:
                kb = [k.to_bytes(8, "little", signed=True) for k in ks]
                blocks.append((kg, [(0, kb, [(3 * k).to_bytes(8, "little", signed=True) for k in ks]),
                                    (1, kb, [b"k%d" % k for k in ks])]))
        handles.append(write_keyed_snapshot(storage, cid, i, r, STATES, blocks))
    md = CheckpointMetadata(cid, "job", 0, maxp, p, handles)
    storage.commit(md)
    return md


def restore_subtask(storage, md, maxp: int, p_new: int, j: int) -> tuple[dict[int, tuple], int]:
    new_range = key_group_range(maxp, p_new, j)
    found: dict[int, tuple] = {}
    total = 0
    for h, part in plan_keyed_restore(md, new_range, max_parallelism=maxp):
        blocks, nread = read_key_groups(storage, h, part)
        total += nread
        for block in blocks:
            kg, sections = block.key_group, block.puts
            assert kg in new_range
            for idx, ks, vs in sections:
                for kb, vb in zip(ks, vs):
                    k = int.from_bytes(kb, "little", signed=True)
                    assert assign_to_key_group(k, maxp) == kg
                    entry = found.setdefault(k, [None, None])
                    entry[idx] = bytes(vb)
    return {k: tuple(v) for k, v in found.items()}, total


@pytest.mark.parametrize("p_old,p_new", RESCALES)
def test_rescaled_restore_finds_every_key_in_its_owner_only(storage, p_old, p_new):
    maxp = 128
    keys = list(range(-300, 700))
    md = snapshot_job(storage, keys, maxp, p_old)
    md = storage.load(1)
    seen: dict[int, int] = {}
    state_bytes = sum(h.offsets[-1] - h.offsets[0] for h in md.keyed_handles)
    read_total = 0
    for j in range(p_new):
        found, nread = restore_subtask(storage, md, maxp, p_new, j)
        read_total += nread
        for k, (v, m) in found.items():
            assert k not in seen, f"key {k} restored by subtasks {seen[k]} and {j}"
            seen[k] = j
            assert v == (3 * k).to_bytes(8, "little", signed=True) and m == b"k%d" % k
            assert j == assign_to_key_group(k, maxp) * p_new // maxp
    assert sorted(seen) == keys
    assert read_total == state_bytes   # together the new subtasks read every block exactly once


def test_max_parallelism_13_with_42_keys(storage):
    keys = list(range(1000, 1042))
    md = snapshot_job(storage, keys, 13, 5)
    for p_new in range(1, 14):
        seen = {}
        for j in range(p_new):
            found, _ = restore_subtask(storage, md, 13, p_new, j)
            for k in found:
                assert k not in seen
                seen[k] = j
        assert sorted(seen) == keys
