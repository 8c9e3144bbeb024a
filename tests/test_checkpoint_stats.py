"""The figures ``keygroups inspect --plot`` draws, without Spark or matplotlib: bytes per key group equal the bytes
of the blocks a restore reads, keys per key group equal the keys written (deltas and deletes applied), and the
load and skew at a parallelism follow Flink's assignment of key groups to subtasks."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keygroups import KeyGroupRange, assign_to_key_group, key_group_range, operator_index_for_key_group
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward, plan_keyed_restore
from keygroups.checkpoint.stats import checkpoint_figures, count_keys, size_history, skew, subtask_loads
from keygroups.serializers import Int64Serializer, StrSerializer
from keygroups.state import HeapKeyedStateBackend, MapStateDescriptor, ValueStateDescriptor

V1 = pathlib.Path(__file__).parent / "data" / "keyed-checkpoint-v1"


def brute_loads(per_key_group, parallelism):
    """Each subtask's load, key group by key group through Flink's operator index (not through ranges)."""
    loads = [0] * parallelism
    for kg, n in enumerate(per_key_group):
        loads[operator_index_for_key_group(len(per_key_group), parallelism, kg)] += n
    return loads


def restore_read_bytes(metadata):
    """The bytes a restore of every key group reads, from the restore plan's ranged reads."""
    everything = key_group_range(metadata.max_parallelism, 1, 0)
    return sum(end - start for handle, part in plan_keyed_restore(metadata, everything)
               for start, end in [handle.byte_range(part)])


@pytest.fixture
def v1(tmp_path):
    shutil.copytree(V1 / "chk-1", tmp_path / "chk-1")
    storage = CheckpointStorage(tmp_path)
    return storage, storage.latest()


def test_the_committed_checkpoint_bytes_and_keys_per_key_group(v1):
    storage, md = v1
    figures = checkpoint_figures(storage, md, with_keys=True)
    assert (figures.max_parallelism, figures.parallelism, len(figures.bytes_per_key_group)) == (16, 2, 16)
    # every block full: a key group's bytes are its block's, and they sum to the files' block bytes
    assert figures.bytes_per_key_group == [h.block_size(kg) for h in md.keyed_handles for kg in h.key_group_range]
    assert figures.keyed_bytes == sum(h.offsets[-1] - h.offsets[0] for h in md.keyed_handles)
    assert figures.delta_bytes == [0] * 16 and figures.chain_blocks == [1] * 16
    assert figures.written_bytes == sum(h.size for h in md.keyed_handles)
    expected = [0] * 16
    for key in json.loads((V1 / "expected.json").read_text()):
        expected[assign_to_key_group(int(key), 16)] += 1
    assert figures.keys == expected and sum(expected) == 200
    assert checkpoint_figures(storage, md).keys is None


@pytest.mark.parametrize("parallelism", [1, 2, 3, 5, 7, 16])
def test_loads_and_skew_at_several_parallelisms(v1, parallelism):
    storage, md = v1
    figures = checkpoint_figures(storage, md, with_keys=True)
    for measure, per_kg in (("bytes", figures.bytes_per_key_group), ("keys", figures.keys)):
        loads = brute_loads(per_kg, parallelism)
        assert figures.loads(parallelism, measure) == loads
        assert figures.skew(parallelism, measure) == pytest.approx(max(loads) / (sum(loads) / parallelism))
    assert figures.skew(1) == 1.0
    # at the checkpoint's own parallelism each subtask's load is its file's blocks
    assert figures.loads(2) == [h.offsets[-1] - h.offsets[0] for h in md.keyed_handles]


@given(st.integers(1, 64).flatmap(lambda mp: st.tuples(st.lists(st.integers(0, 10**6), min_size=mp, max_size=mp),
                                                        st.integers(1, mp))))
def test_subtask_loads_follow_flinks_operator_index(case):
    per_key_group, parallelism = case
    loads = subtask_loads(per_key_group, parallelism)
    assert loads == brute_loads(per_key_group, parallelism)
    assert sum(loads) == sum(per_key_group)
    assert 1.0 <= skew(loads) <= parallelism


def test_skew_bounds_and_bad_arguments(v1):
    assert skew([5, 5, 5]) == 1.0
    assert skew([0, 9, 0]) == 3.0
    assert skew([0, 0]) == 1.0   # no load: nothing uneven
    with pytest.raises(ValueError, match="at least one subtask"):
        skew([])
    with pytest.raises(ValueError, match=r"parallelism must be in \[1, max_parallelism=4\], got 5"):
        subtask_loads([1, 2, 3, 4], 5)
    storage, md = v1
    figures = checkpoint_figures(storage, md)
    with pytest.raises(ValueError, match="count_keys=True"):
        figures.loads(2, "keys")
    with pytest.raises(ValueError, match="'bytes' or 'keys', got 'rows'"):
        figures.skew(2, "rows")


MAXP = 32
P = 3


def write_two_checkpoints(storage):
    """Checkpoint 1 (full) and 2 (deltas: changed, new, partly and wholly deleted keys) at parallelism 3, written by
    heap backends; returns each checkpoint's live keys."""
    last = None
    live = {}
    backends = []
    for i in range(P):
        b = HeapKeyedStateBackend(key_group_range(MAXP, P, i), MAXP, Int64Serializer(), subtask_index=i)
        backends.append((b, b.get_state(ValueStateDescriptor("count", Int64Serializer())),
                         b.get_state(MapStateDescriptor("seen", StrSerializer(), Int64Serializer()))))

    def owner(key):
        return backends[operator_index_for_key_group(MAXP, P, assign_to_key_group(key, MAXP))]

    def commit(cid):
        nonlocal last
        handles = [b.snapshot(cid, storage).result(30) for b, _, _ in backends]
        storage.commit(CheckpointMetadata(checkpoint_id=cid, job_id="stats", timestamp_ms=0, max_parallelism=MAXP,
                                          parallelism=P, keyed_handles=carry_forward(last, handles),
                                          operator_handles=[], properties={}))
        last = storage.load(cid)
        live[cid] = {k for k, states in model.items() if states}

    model = {}
    for k in range(600):
        b, count, seen = owner(k)
        b.set_current_key(k)
        count.update(k)
        model[k] = {"count"}
        if k % 3 == 0:
            seen.put(f"page-{k}", k)
            model[k].add("seen")
    commit(1)
    for k in range(0, 900, 7):
        b, count, seen = owner(k)
        b.set_current_key(k)
        if k < 600 and k % 2:
            count.clear()            # a key with map state (k % 3 == 0) stays, unless that is cleared too
            model[k].discard("count")
            if k % 9 == 0:
                seen.clear()
                model[k].discard("seen")
        else:
            count.update(-k)
            model.setdefault(k, set()).add("count")
    commit(2)
    assert any(states == {"seen"} for states in model.values())
    return live


def test_a_written_incremental_checkpoint(tmp_path):
    storage = CheckpointStorage(tmp_path, retain=10)
    live = write_two_checkpoints(storage)
    md = storage.load(2)
    figures = checkpoint_figures(storage, md, with_keys=True)
    assert sum(figures.delta_bytes) > 0 and max(figures.chain_blocks) == 2   # deltas on top of checkpoint 1
    assert figures.keyed_bytes == restore_read_bytes(md)
    assert figures.written_bytes == sum(h.size for h in md.keyed_handles if h.checkpoint_id == 2)
    for cid in (1, 2):
        expected = [0] * MAXP
        for k in live[cid]:
            expected[assign_to_key_group(k, MAXP)] += 1
        assert count_keys(storage, storage.load(cid)) == expected
    assert sum(figures.keys) == len(live[2]) != len(live[1])
    for p in (1, 3, 4, 32):
        assert figures.loads(p, "keys") == brute_loads(figures.keys, p)
    history = size_history(storage)
    assert [h.checkpoint_id for h in history] == [1, 2]
    assert [h.keyed_bytes for h in history] == [restore_read_bytes(storage.load(c)) for c in (1, 2)]
    assert history[0].written_bytes == sum(h.size for h in storage.load(1).keyed_handles)
    assert all(h.keys is None for h in history)


def test_a_key_group_without_state_has_no_bytes_and_no_keys(tmp_path):
    storage = CheckpointStorage(tmp_path)
    storage.commit(CheckpointMetadata(checkpoint_id=1, job_id="empty", timestamp_ms=0, max_parallelism=8,
                                      parallelism=2, keyed_handles=[], operator_handles=[], properties={}))
    figures = checkpoint_figures(storage, storage.latest(), with_keys=True)
    assert figures.bytes_per_key_group == [0] * 8 and figures.keys == [0] * 8
    assert figures.skew(3) == 1.0 and figures.written_bytes == 0
    assert KeyGroupRange(0, 7) == key_group_range(8, 1, 0)
