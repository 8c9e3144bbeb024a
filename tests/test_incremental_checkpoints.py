"""Incremental checkpoints at the format and checkpoint layer: chain planning (order, only what a chain needs, one
meta per chain), chain statistics and the materialization policy, carrying handles forward, retention of shared
files, savepoints as merged full files, the driver's commit, ``keygroups plan``; and a model test of random chains,
rescales, failed batches and retention against a dict."""

from __future__ import annotations

import random
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange, key_group_range
from keygroups.checkpoint import (
    ChainStats,
    CheckpointMetadata,
    CheckpointStorage,
    carry_forward,
    chain_stats,
    chain_tips,
    choose_full_key_groups,
    plan_keyed_restore,
    read_key_groups,
    write_keyed_snapshot,
)
from keygroups.checkpoint.metadata import is_shared_path
from keygroups.cli import main as cli_main
from keygroups.errors import CorruptSnapshotError
from keygroups.runtime.driver import begin_batch, commit_batch
from keygroups.runtime.report import RestoreInfo, SubtaskReport
from keygroups.serializers import BytesSerializer, Int64Serializer
from keygroups.state import HeapKeyedStateBackend, ValueStateDescriptor

MAXP = 8
STATES = [{"name": "a", "kind": "value"}, {"name": "b", "kind": "map"}]


def write(storage, cid, subtask, r, groups, full=None, states=STATES, fresh=()):
    """groups: kg -> ({state: {key: value}}, {state: [deleted keys]}); ``fresh``: key groups whose delta applies
    to no earlier block. The deltas continue the newest committed checkpoint: each names its key group's newest
    block there (``chain_tips``), as a backend restored from it would."""
    def items():
        for kg in sorted(groups):
            puts, deletes = groups[kg]
            yield (kg, [(i, list(puts[s]), list(puts[s].values())) for i, s in enumerate(n["name"] for n in states)
                        if s in puts],
                   [(i, list(deletes[s])) for i, s in enumerate(n["name"] for n in states) if s in deletes])
    try:
        latest = storage.latest()
    except CorruptSnapshotError:   # a test that damaged it writes no delta that needs it
        latest = None
    tips = chain_tips(latest, r) if latest is not None and r else {}
    return write_keyed_snapshot(storage, cid, subtask, r, states, items(), full_key_groups=full,
                                fresh_key_groups=fresh,
                                predecessors={kg: t for kg, t in tips.items() if kg not in fresh})


def commit(storage, cid, handles, previous=None, parallelism=1):
    md = CheckpointMetadata(cid, "job", 0, MAXP, parallelism, carry_forward(previous, handles))
    storage.commit(md)
    return storage.load(cid)


def restore(storage, md, r=KeyGroupRange(0, MAXP - 1)) -> dict[int, dict[str, dict[bytes, bytes]]]:
    """Apply each key group's chain, as a backend would: an independent reading of plan_keyed_restore's answer."""
    state: dict[int, dict[str, dict[bytes, bytes]]] = {}
    for h, part in plan_keyed_restore(md, r, max_parallelism=MAXP):
        blocks, _ = read_key_groups(storage, h, part, copy=True)
        for b in blocks:
            if b.full:
                state[b.key_group] = {}
            group = state.setdefault(b.key_group, {})
            for i, ks, vs in b.puts:
                group.setdefault(h.states[i]["name"], {}).update(zip(ks, vs))
            for i, ks in b.deletes:
                for k in ks:
                    group.get(h.states[i]["name"], {}).pop(k, None)
    return {kg: {s: e for s, e in g.items() if e} for kg, g in state.items() if any(g.values())}


# ---- planning ------------------------------------------------------------------------------------------------------

def test_plan_reads_each_chain_in_checkpoint_order_and_nothing_else(tmp_path):
    storage = CheckpointStorage(tmp_path)
    r = KeyGroupRange(0, MAXP - 1)
    h1 = write(storage, 1, 0, r, {kg: ({"a": {b"k%d" % kg: b"1"}}, {}) for kg in r})
    md = commit(storage, 1, [h1])
    # 2: deltas for 0-3 (2 changes nothing), full for 4-5
    h2 = write(storage, 2, 0, r, {0: ({"a": {b"k0": b"2"}}, {}), 1: ({}, {"a": [b"k1"]}), 3: ({"b": {b"m": b"x"}}, {}),
                                  4: ({"a": {b"new": b"4"}}, {})}, full={4, 5})
    md = commit(storage, 2, [h2], md)
    # 3: at parallelism 2, subtask 1 (4-7) changed nothing and reports nothing; subtask 0 rewrites 0 full
    h3 = write(storage, 3, 0, KeyGroupRange(0, 3), {0: ({"a": {b"z": b"3"}}, {}), 3: ({}, {"b": [b"m"]})}, full={0})
    md = commit(storage, 3, [h3], md, parallelism=2)
    assert [h.checkpoint_id for h in md.keyed_handles] == [1, 2, 3]
    plan = plan_keyed_restore(md, r)
    assert [(h.checkpoint_id, p) for h, p in plan] == [
        (1, KeyGroupRange(1, 3)), (1, KeyGroupRange(6, 7)),         # not 0 (full in 3), 4-5 (full in 2)
        (2, KeyGroupRange(1, 1)), (2, KeyGroupRange(3, 5)),         # not 0 (full in 3), 2 (empty delta)
        (3, KeyGroupRange(0, 0)), (3, KeyGroupRange(3, 3))]         # not 1-2 (empty deltas)
    assert restore(storage, md) == {
        0: {"a": {b"z": b"3"}}, 2: {"a": {b"k2": b"1"}}, 3: {"a": {b"k3": b"1"}},
        4: {"a": {b"new": b"4"}}, 6: {"a": {b"k6": b"1"}}, 7: {"a": {b"k7": b"1"}}}
    assert plan_keyed_restore(md, KeyGroupRange(6, 7)) == [(md.keyed_handles[0], KeyGroupRange(6, 7))]
    stats = chain_stats(md, r)
    assert stats[0] == ChainStats(1, h3.block_size(0), 0)
    assert stats[3] == ChainStats(3, h1.block_size(3), h2.block_size(3) + h3.block_size(3))
    assert stats[5] == ChainStats(1, h2.block_size(5), 0) and stats[2] == ChainStats(1, h1.block_size(2), 0)
    # a 4th checkpoint writing 1-3 and 6-7 full leaves checkpoint 1's file unneeded: it drops out
    h4 = write(storage, 4, 0, r, {}, full={1, 2, 3, 6, 7})
    assert [h.checkpoint_id for h in carry_forward(md, [h4])] == [2, 3, 4]
    h4b = write(storage, 4, 0, r, {}, full={1, 2, 3, 6})
    assert [h.checkpoint_id for h in carry_forward(md, [h4b])] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="a new file belongs to a newer checkpoint"):
        carry_forward(md, [h3])


def test_a_chain_must_keep_one_meta_per_state(tmp_path):
    storage = CheckpointStorage(tmp_path)
    r = KeyGroupRange(0, MAXP - 1)
    md = commit(storage, 1, [write(storage, 1, 0, r, {0: ({"a": {b"k": b"v"}}, {})})])
    other = [dict(STATES[0], serializers={"value": "another"}), STATES[1]]
    mixed = commit(storage, 2, [write(storage, 2, 0, r, {0: ({"a": {b"k": b"w"}}, {})}, full=set(), states=other)],
                   md)
    with pytest.raises(CorruptSnapshotError, match="state 'a' has one meta in .* and another in"):
        plan_keyed_restore(mixed, r)
    with pytest.raises(CorruptSnapshotError, match="one meta in"):
        storage.savepoint(mixed, "mixed")
    assert plan_keyed_restore(mixed, KeyGroupRange(1, 7)) != []   # only key group 0's chain mixes them
    # key group 0 written full with the other meta: each chain is consistent, a merged file could not be
    full = commit(storage, 3, [write(storage, 3, 0, r, {0: ({"a": {b"k": b"w"}}, {})}, full={0}, states=other)], md)
    assert restore(storage, full)[0] == {"a": {b"k": b"w"}}
    with pytest.raises(ValueError, match="cannot be merged as bytes"):
        storage.savepoint(full, "across")


def test_materialization_picks_the_worst_chains_within_a_budget():
    chains = {0: ChainStats(9, 100, 10), 1: ChainStats(3, 100, 60), 2: ChainStats(2, 100, 10),
              3: ChainStats(12, 100, 5), 4: ChainStats(2, 0, 30), 5: ChainStats(8, 100, 50)}
    assert choose_full_key_groups(chains, 16, max_chain=8, delta_fraction=0.5) == {4, 3}   # ceil(16 / 8) = 2
    assert choose_full_key_groups(chains, 64, max_chain=8, delta_fraction=0.5) == {0, 1, 3, 4}
    assert choose_full_key_groups(chains, 64, max_chain=20, delta_fraction=0.5) == {1, 4}
    assert choose_full_key_groups({}, 64, max_chain=8, delta_fraction=0.5) == set()


def test_backend_policy_and_chain_bookkeeping(tmp_path):
    storage = CheckpointStorage(tmp_path)
    r = KeyGroupRange(0, MAXP - 1)
    fresh = HeapKeyedStateBackend(r, MAXP, Int64Serializer())
    assert fresh._full_key_groups_for_snapshot() == set(r)   # never restored: everything full
    fresh.get_state(ValueStateDescriptor("a", BytesSerializer()))
    states = [fresh._tables["a"].meta]   # a real state's meta, as a backend writes it

    def write(storage, cid, subtask, r, groups, full=None):
        return globals()["write"](storage, cid, subtask, r, groups, full, states)

    md = commit(storage, 1, [write(storage, 1, 0, r, {kg: ({"a": {b"k": b"v" * 2000}}, {}) for kg in r})])
    for cid in range(2, 12):   # key group 1 gets a delta each time, key group 2 a big one once
        groups = {1: ({"a": {b"k": b"w"}}, {})}
        if cid == 5:
            groups[2] = ({"a": {b"x" * 40: b"y" * 1200}}, {})
        md = commit(storage, cid, [write(storage, cid, 0, r, groups, full=set())], md)
    b = HeapKeyedStateBackend(r, MAXP, Int64Serializer(), max_chain=8, delta_fraction=0.5)
    b.restore(storage, md)
    assert b._chains[1].length == 11 and b._chains[2].length == 2 and b._chains[0].length == 1
    # ceil(8 / 8) = 1 per snapshot, the worst: 1 by length (11 / 8), before 2 by bytes (1.2 x half its full block)
    assert b._full_key_groups_for_snapshot() == {1}
    b.max_chain = 20
    assert b._full_key_groups_for_snapshot() == {2}   # 1's chain is short enough now, and its deltas small
    b.incremental = False
    assert b._full_key_groups_for_snapshot() == set(r)
    b.incremental = True
    h = write(storage, 12, 0, r, {2: ({"a": {b"k": b"v"}}, {}), 3: ({"a": {b"q": b"r"}}, {})}, full={2})
    b._after_snapshot(h)
    assert b._chains[2] == ChainStats(1, h.block_size(2), 0)
    assert b._chains[3] == ChainStats(2, md.keyed_handles[0].block_size(3), h.block_size(3))
    assert b._full_key_groups_for_snapshot() == set()
    b._tables["a"].meta = dict(b._tables["a"].meta, ttl={"ttl_ms": 5})   # as a migrated serializer would
    assert b._full_key_groups_for_snapshot() == set(r)


# ---- storage: retention, savepoints, the driver, plan ---------------------------------------------------------------

def test_retention_keeps_every_shared_file_a_retained_checkpoint_needs(tmp_path):
    storage = CheckpointStorage(tmp_path, retain=2)
    r = KeyGroupRange(0, MAXP - 1)
    md = commit(storage, 1, [write(storage, 1, 0, r, {kg: ({"a": {b"k": b"1"}}, {}) for kg in r})])
    base = md.keyed_handles[0].file
    for cid in range(2, 6):
        md = commit(storage, cid, [write(storage, cid, 0, r, {0: ({"a": {b"k": str(cid).encode()}}, {})},
                                         full=set())], md)
        assert base in storage.shared_files()   # every retained checkpoint's chains start there
    in_progress = write(storage, 6, 0, r, {})   # a newer checkpoint being written: untouched by retention
    orphan = write(storage, 5, 0, r, {})        # a retried attempt of checkpoint 5: deleted at the next commit
    md = commit(storage, 6, [write(storage, 6, 0, r, {}, full=set(r))], md)
    assert storage.checkpoint_ids() == [5, 6]
    shared = storage.shared_files()
    assert base in shared   # checkpoint 5 still needs it
    assert in_progress.file not in shared and orphan.file not in shared   # 6 is committed, they are unreferenced
    md = commit(storage, 7, [write(storage, 7, 0, r, {1: ({"a": {b"k": b"7"}}, {})}, full=set())], md)
    referenced = {h.file for cid in storage.checkpoint_ids() for h in storage.load(cid).keyed_handles}
    assert set(storage.shared_files()) == referenced and base not in referenced
    assert restore(storage, md) == {1: {"a": {b"k": b"7"}}}   # checkpoint 6 emptied every key group


def test_an_unreadable_retained_metadata_stops_shared_cleanup(tmp_path):
    storage = CheckpointStorage(tmp_path, retain=2)
    r = KeyGroupRange(0, MAXP - 1)
    md = commit(storage, 1, [write(storage, 1, 0, r, {})])
    orphan = write(storage, 2, 0, r, {})
    (tmp_path / "chk-1" / "_metadata").write_bytes(b"garbage")
    # a driver that has not read checkpoint 1 before (one storage object reads each retained _metadata once)
    restarted = CheckpointStorage(tmp_path, retain=2)
    restarted.commit(CheckpointMetadata(2, "job", 0, MAXP, 1, carry_forward(None, [write(storage, 2, 0, r, {})])))
    assert orphan.file in storage.shared_files() and md.keyed_handles[0].file in storage.shared_files()


def test_savepoint_merges_chains_into_full_files_either_backend_restores(tmp_path):
    storage = CheckpointStorage(tmp_path, retain=1)
    r = KeyGroupRange(0, MAXP - 1)
    md = commit(storage, 1, [write(storage, 1, 0, r, {kg: ({"a": {b"k": b"1", b"j": b"2"}}, {}) for kg in r})])
    md = commit(storage, 2, [write(storage, 2, 0, r, {0: ({"b": {b"m": b"x"}}, {"a": [b"j"]}),
                                                      5: ({}, {"a": [b"k", b"j"]})}, full=set())], md)
    expected = restore(storage, md)
    assert 5 not in expected and expected[0] == {"a": {b"k": b"1"}, "b": {b"m": b"x"}}
    storage.savepoint(2, "sp")
    sp = storage.load_savepoint("sp")
    assert all(h.is_all_full and h.file.startswith("savepoints/sp/") and not is_shared_path(h.file)
               for h in sp.keyed_handles)
    assert restore(storage, sp) == expected
    for h in sp.keyed_handles:   # merged blocks are sorted full blocks
        blocks, _ = read_key_groups(storage, h, h.key_group_range)
        assert all(b.full and b.sorted and not b.deletes for b in blocks)
    storage.commit(CheckpointMetadata(3, "job", 0, MAXP, 1, carry_forward(md, [write(storage, 3, 0, r, {}, full=set(r))])))
    assert storage.checkpoint_ids() == [3] and restore(storage, storage.load_savepoint("sp")) == expected


def _report(storage, cid, subtask, handle, own):
    output = storage.new_file(cid, f"output-{subtask}") + ".parquet"
    with storage.open_write(output) as f:
        f.write(b"x")
    return SubtaskReport(subtask, own, output, RestoreInfo.new(), keyed_handle=handle)


def test_commit_batch_carries_forward_and_plan_prints_the_chains(tmp_path, capsys):
    storage = CheckpointStorage(tmp_path, retain=3)
    plan = begin_batch(storage, job_name="job", max_parallelism=MAXP, parallelism=2)
    reports = []
    for i in range(2):
        r = key_group_range(MAXP, 2, i)
        reports.append(_report(storage, 1, i, write(storage, 1, i, r, {kg: ({"a": {b"k": b"v"}}, {}) for kg in r}), r))
    commit_batch(plan, reports)
    plan = begin_batch(storage, job_name="job", max_parallelism=MAXP, parallelism=2)
    r0 = key_group_range(MAXP, 2, 0)
    reports = [_report(storage, 2, 0, write(storage, 2, 0, r0, {1: ({"a": {b"k": b"w"}}, {})}, full=set()), r0),
               _report(storage, 2, 1, None, key_group_range(MAXP, 2, 1))]   # subtask 1 changed nothing
    md = commit_batch(plan, reports)
    assert [(h.checkpoint_id, h.subtask) for h in md.keyed_handles] == [(1, 0), (1, 1), (2, 0)]
    assert restore(storage, storage.load(2))[1] == {"a": {b"k": b"w"}}
    assert cli_main(["plan", str(tmp_path), "3"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint 2: p=2 -> p'=3" in out and "3 keyed files" in out
    assert "new subtask 0 (key groups 0-2)" in out and "chains of 1-2 blocks" in out
    assert "(checkpoint 2, old subtask 0, delta) groups 1-1" in out


# ---- the model: random chains, rescales, failures, retention --------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_incremental_histories_restore_like_a_dict(data):
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    with tempfile.TemporaryDirectory(prefix="kg-model-") as d:
        model: dict[int, dict[str, dict[bytes, bytes]]] = {}   # the state of the latest commit
        history: dict[int, dict] = {}
        md = None
        for step in range(data.draw(st.integers(3, 14), label="steps")):
            storage = CheckpointStorage(d, retain=data.draw(st.integers(1, 3), label="retain"))
            p = data.draw(st.integers(1, 4), label="parallelism")
            plan = begin_batch(storage, job_name="job", max_parallelism=MAXP, parallelism=p)
            cid = plan.checkpoint_id
            new_model = {kg: {s: dict(e) for s, e in g.items()} for kg, g in model.items()}
            reports = []
            for i in range(p):
                r = key_group_range(MAXP, p, i)
                if md is not None:   # the subtask restores its key groups: exactly the model's
                    assert restore(storage, md, r) == {kg: g for kg, g in model.items() if kg in r}
                dirty: dict[int, tuple[dict, dict]] = {}
                for _ in range(rng.randint(0, 6)):   # random puts and deletes
                    kg = rng.choice(list(r))
                    s = rng.choice(["a", "b"])
                    k = bytes([rng.randrange(6)])
                    puts, deletes = dirty.setdefault(kg, ({}, {}))
                    group = new_model.setdefault(kg, {}).setdefault(s, {})
                    if rng.random() < 0.35:
                        group.pop(k, None)
                        puts.get(s, {}).pop(k, None)
                        deletes.setdefault(s, []).append(k)
                    else:
                        group[k] = v = rng.randbytes(rng.randint(0, 4))
                        puts.setdefault(s, {})[k] = v
                        if s in deletes:   # a block applies its puts, then its deletes
                            deletes[s] = [x for x in deletes[s] if x != k]
                full = {kg for kg in r if rng.random() < 0.3}
                if not dirty and not full and rng.random() < 0.5:
                    reports.append(_report(storage, cid, i, None, r))   # changed nothing: no handle
                    continue
                groups = {kg: dirty.get(kg, ({}, {})) for kg in r if kg in dirty}
                for kg in full:   # a full block holds the whole key group
                    groups[kg] = ({s: dict(e) for s, e in new_model.get(kg, {}).items()}, {})
                # a delta of a key group without a chain applies to no block (one whose chain nets out to no state
                # still names the chain's newest block: a fresh delta after a block is another lineage's)
                fresh = set(r) - (set(chain_stats(md, r)) if md is not None else set())
                if rng.random() < 0.2:   # a retried attempt's file nobody reports
                    write(storage, cid, i, r, groups, full=full, fresh=fresh)
                reports.append(_report(storage, cid, i, write(storage, cid, i, r, groups, full=full, fresh=fresh), r))
            if rng.random() < 0.15:
                continue   # the batch fails before its commit: nothing of it becomes visible
            md = commit_batch(plan, reports)
            model = {kg: {s: e for s, e in g.items() if e} for kg, g in new_model.items()}
            model = {kg: g for kg, g in model.items() if g}
            history[cid] = model
            retained = storage.checkpoint_ids()
            for kept in retained:   # every retained checkpoint restores to what it held
                assert restore(storage, storage.load(kept)) == history[kept], (step, kept)
            referenced = {h.file for kept in retained for h in storage.load(kept).keyed_handles}
            older = {f for f in storage.shared_files() if int(f.rsplit("-", 2)[1]) <= cid}
            assert older == referenced   # nothing unreferenced remains, nothing referenced is gone
            if rng.random() < 0.2:
                name = f"sp-{cid}"
                storage.savepoint(cid, name)
                assert restore(storage, storage.load_savepoint(name)) == model
