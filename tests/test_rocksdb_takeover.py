"""A rescale's new range takes over a kept RocksDB database that lags its newest checkpoint (write-back left it a few
snapshots behind, or the batches between ran on another host) in a process that does not hold the decoded values
parked beside it (``_KeptCaches``: Spark ran the new subtask in another worker): the key groups it keeps catch up
from the checkpoint chain, reading only the delta blocks newer than the checkpoint the database holds
(``RocksDBKeyedStateBackend._resume_moved`` with ``_catch_up_plan``), the key groups that arrived are read whole,
those that left dropped. A hypothesis model runs random batches against dicts with snapshots written back every 1-4,
rescales between parallelism 1 and 4 on one or two hosts, the kept values dropped before most of them (a new
worker process); direct tests show the rows equal a cold restore's and each case that cannot catch up exactly
(another meta, a marker's checkpoint not committed, another lineage) restored cold, still exact."""

from __future__ import annotations

import copy
import json
import os
import tempfile

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from keygroups import assign_to_operator, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.runtime.assignment import warm_takeover
from keygroups.serializers import Int64Serializer
from keygroups.state import RocksDBKeyedStateBackend, StateTtlConfig, ValueStateDescriptor
from keygroups.state import rocksdb as rocksdb_module
from keygroups.state._base import _committed_chains
from keygroups.state.warm import WarmResume
from test_rocksdb_catch_up import assert_five_match, descriptors, end_model, write_value_like
from test_rocksdb_incremental import write_five

MAXP = 128


def takeovers(old_p, new_p):
    """Per new subtask, the ``(warm_takeover given, given to the others)`` the driver's best matching ships
    (``KeyedTaskSpec.warm_claims``); no takeover at an unchanged parallelism."""
    if old_p == new_p:
        return [(None, frozenset())] * new_p
    before = [key_group_range(MAXP, old_p, i).start for i in range(old_p)] + [MAXP]
    after = [key_group_range(MAXP, new_p, i).start for i in range(new_p)] + [MAXP]
    match = warm_takeover(before, after, [1] * MAXP)
    given = [None if j is None else (before[j], before[j + 1] - 1) for j in match]
    return [(mine, frozenset(g for n, g in enumerate(given) if g is not None and n != i))
            for i, mine in enumerate(given)]


def markers(host):
    """Per kept range on ``host`` ((first, last)), the checkpoint its sealed marker names."""
    out = {}
    if not os.path.isdir(host):
        return out
    for name in os.listdir(host):
        path = os.path.join(host, name, "marker.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                marker = json.load(f)
            out[tuple(marker["key_group_range"])] = marker["checkpoint_id"]
    return out


def check_reads(stats, b, metadata, kept_at):
    """What a restore of ``b`` from ``metadata`` read: a moved resume reads the chains of the key groups that
    arrived, whole, and of those it kept only the blocks newer than the checkpoint its database held (``kept_at``);
    never the kept key groups' chains from the start."""
    chains = _committed_chains(metadata, b.key_group_range)

    def chain_bytes(kgs, after=-1):
        return sum(h.block_size(kg) for kg in kgs for h in chains.get(kg, ()) if h.checkpoint_id > after)

    assert stats.bytes_read == stats.bytes_restored + stats.bytes_caught_up
    assert stats.bytes_restored == chain_bytes(stats.restored)
    if stats.caught_up:
        assert kept_at is not None
        assert stats.bytes_caught_up <= chain_bytes(stats.caught_up, kept_at)
    assert set(stats.warm) | set(stats.caught_up) | set(stats.restored) == set(b.key_group_range)


class TakeoverModel(RuleBasedStateMachine):
    """Random writes on value-like states (TTL included) against dicts; every batch commits, on one of two hosts,
    its snapshots writing the database every 1-4 (write-back); between batches the job may rescale (p 1-4) and the
    process may be a new one (the kept values gone: most rescales)."""

    @staticmethod
    def states():
        return {n: d for n, d in descriptors().items() if n != "map"}

    def __init__(self):
        super().__init__()
        self.fraction, rocksdb_module.CATCH_UP_DELTA_FRACTION = rocksdb_module.CATCH_UP_DELTA_FRACTION, float("inf")
        rocksdb_module._KEPT_CACHES.clear()
        self.tmp = tempfile.TemporaryDirectory(prefix="kg-takeover-")
        self.storage = CheckpointStorage(os.path.join(self.tmp.name, "chk"))
        self.hosts = [os.path.join(self.tmp.name, "host-a"), os.path.join(self.tmp.name, "host-b")]
        self.host = 0
        self.now = 1000.0
        self.write_back = 3
        self.model = {n: {} for n in self.states()}
        self.committed = None   # the last committed checkpoint id
        self.next_id = 1
        self.p = 2
        self.caught_up_moves = 0
        self.backends = self.open(None, self.p)

    def open(self, checkpoint_id, old_p):
        metadata = None if checkpoint_id is None else self.storage.load(checkpoint_id)
        kept = markers(self.hosts[self.host])
        out = []
        for i, claims in enumerate(takeovers(old_p, self.p)):
            b = RocksDBKeyedStateBackend(key_group_range(MAXP, self.p, i), MAXP, Int64Serializer(), subtask_index=i,
                                         max_chain=3, warm_dir=self.hosts[self.host], cache_limit=40,
                                         clock=lambda: self.now, write_back_batches=self.write_back,
                                         warm_takeover=claims)
            moved_from = None if b._warm is None else b._warm.moved_from
            out.append((b, None))
            if metadata is not None:
                stats = b.restore(self.storage, metadata)
                if isinstance(stats, WarmResume) and (stats.restored or stats.dropped):
                    check_reads(stats, b, metadata, kept.get((moved_from.start, moved_from.end)))
                    if stats.caught_up:
                        self.caught_up_moves += 1
                        event("a taken-over database caught up")
            out[-1] = (b, {n: b.get_state(d) for n, d in self.states().items()})
        return out

    def at(self, k):
        b, s = self.backends[assign_to_operator(k, MAXP, self.p)]
        b.set_current_key(k)
        return s

    @rule(k=st.integers(0, 40), v=st.integers(-5, 5),
          op=st.sampled_from(["value", "list", "reducing", "aggregating", "ttl"]))
    def write(self, k, v, op):
        write_value_like(self, k, v, op)

    @rule(k=st.integers(0, 40), name=st.sampled_from(["value", "list", "reducing", "aggregating", "ttl"]))
    def clear(self, k, name):
        self.at(k)[name].clear()
        self.model[name].pop(k, None)

    @rule(seconds=st.sampled_from([1, 4, 30]))
    def tick(self, seconds):
        self.now += seconds

    @rule(p=st.sampled_from([1, 2, 3, 4]), next_host=st.sampled_from([0, 0, 0, 1]),
          new_process=st.sampled_from([True, True, True, False]), write_back=st.sampled_from([1, 2, 3, 4]))
    def batch_ends(self, p, next_host, new_process, write_back):
        """The batch commits; the next runs on ``next_host`` at parallelism ``p`` (a rescale when it changes),
        written back every ``write_back`` snapshots, in a new process (the kept values gone) or not."""
        checkpoint_id = self.next_id
        self.next_id += 1
        handles = [b.snapshot(checkpoint_id, self.storage).result(30) for b, _ in self.backends]
        previous = None if self.committed is None else self.storage.load(self.committed)
        self.storage.commit(CheckpointMetadata(
            checkpoint_id=checkpoint_id, job_id="takeover", timestamp_ms=0, max_parallelism=MAXP,
            parallelism=self.p, keyed_handles=carry_forward(previous, handles) if previous else handles,
            operator_handles=[], properties={}))
        self.committed = checkpoint_id
        for b, _ in self.backends:
            b.dispose()
        if new_process:
            rocksdb_module._KEPT_CACHES.clear()
        old_p, self.p, self.host, self.write_back = self.p, p, next_host, write_back
        self.backends = self.open(checkpoint_id, old_p)

    @invariant()
    def matches(self):
        assert_five_match(self, 41)

    def teardown(self):
        end_model(self)


TakeoverModel.TestCase.settings = settings(max_examples=16, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_rocksdb_takeover_model = TakeoverModel.TestCase


class TakeoverMapModel(TakeoverModel):
    """The same with a map state beside them: its database is written at every snapshot (no write-back), so it lags
    only when the batches between ran on the other host; its kept map rows catch up row by row."""

    @staticmethod
    def states():
        return descriptors()

    @rule(k=st.integers(0, 40), v=st.integers(-5, 5), op=st.sampled_from(["map", "remove"]))
    def write_map(self, k, v, op):
        write_five(self.at(k), self.model, k, v, op)

    @invariant()
    def maps_match(self):
        for k in range(41):
            assert dict(self.at(k)["map"].items()) == self.model["map"].get(k, {}), k


TakeoverMapModel.TestCase.settings = settings(max_examples=10, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_rocksdb_takeover_map_model = TakeoverMapModel.TestCase


# ---- direct: a 2 -> 3 takeover in another process, bit for bit, and each refusal -----------------------------------
KEYS = list(range(600))


def _job(tmp_path):
    return CheckpointStorage(tmp_path / "chk"), str(tmp_path / "warm")


def run_batch(storage, warm, restore, checkpoint_id, p, plus, keys=KEYS, descriptor=None, write_back=4, clock=None):
    """One batch at parallelism ``p`` (backends made one after the other, with the driver's takeover when the
    parallelism changed): restored from checkpoint ``restore`` (None: nothing), ``plus`` added to each of ``keys``,
    snapshotted and committed as ``checkpoint_id``. Its restore stats, per subtask."""
    previous = storage.load(restore) if restore is not None else None
    d = descriptor or ValueStateDescriptor("n", Int64Serializer())
    handles, stats = [], []
    claims = takeovers(previous.parallelism if previous is not None else p, p)
    for i in range(p):
        b = RocksDBKeyedStateBackend(key_group_range(MAXP, p, i), MAXP, Int64Serializer(), subtask_index=i,
                                     warm_dir=warm, write_back_batches=write_back, warm_takeover=claims[i],
                                     **({} if clock is None else {"clock": clock}))
        stats.append(b.restore(storage, previous) if previous is not None else None)
        n = b.get_state(d)
        for k in keys:
            if assign_to_operator(k, MAXP, p) == i:
                b.set_current_key(k)
                n.update((n.value() or 0) + plus)
        handles.append(b.snapshot(checkpoint_id, storage).result(30))
        b.dispose()
    storage.commit(CheckpointMetadata(
        checkpoint_id=checkpoint_id, job_id="takeover", timestamp_ms=0, max_parallelism=MAXP, parallelism=p,
        keyed_handles=carry_forward(previous, handles) if previous else handles, operator_handles=[],
        properties={}))
    return stats


def _rows(b):
    b._flush()
    return list(rocksdb_module._scan(b._db))


def _takeover_rows(storage, warm, checkpoint_id, p, descriptor=None):
    """Restore checkpoint ``checkpoint_id`` at ``p`` from the kept databases (with the driver's takeover) and,
    beside each, cold into a temporary database: (per subtask the restore stats, whether the rows are equal)."""
    metadata = storage.load(checkpoint_id)
    claims = takeovers(metadata.parallelism, p)
    out = []
    for i in range(p):
        r = key_group_range(MAXP, p, i)
        warm_b = RocksDBKeyedStateBackend(r, MAXP, Int64Serializer(), subtask_index=i, warm_dir=warm,
                                          warm_takeover=claims[i])
        cold_b = RocksDBKeyedStateBackend(r, MAXP, Int64Serializer(), subtask_index=i)
        stats = warm_b.restore(storage, metadata)
        cold_b.restore(storage, metadata)
        if descriptor is not None:
            warm_b.get_state(descriptor)
            cold_b.get_state(descriptor)
        out.append((stats, _rows(warm_b) == _rows(cold_b) and len(_rows(cold_b)) > 0))
        warm_b.dispose()
        cold_b.dispose()
    return out


def _value_of(storage, checkpoint_id, keys=KEYS, descriptor=None):
    metadata = storage.load(checkpoint_id)
    b = RocksDBKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer())
    b.restore(storage, metadata)
    n = b.get_state(descriptor or ValueStateDescriptor("n", Int64Serializer()))
    out = {}
    for k in keys:
        b.set_current_key(k)
        out[k] = n.value()
    b.dispose()
    return out


def test_a_lagging_database_taken_over_in_another_process_catches_up_its_kept_key_groups(tmp_path):
    """2 -> 3 after two deferred snapshots, the kept values not in this process: each taken-over database reads
    the two delta blocks of the key groups it keeps and the chains of those that arrived; its rows are a cold
    restore's, byte for byte (TTL values included)."""
    rocksdb_module._KEPT_CACHES.clear()
    storage, warm = _job(tmp_path)
    ttl = ValueStateDescriptor("n", Int64Serializer())
    ttl.enable_time_to_live(StateTtlConfig.new_builder(3600).build())
    run_batch(storage, warm, None, 1, 2, 1, descriptor=ttl)
    run_batch(storage, warm, 1, 2, 2, 10, keys=KEYS[::10], descriptor=ttl)   # deferred: the databases stay at 1
    run_batch(storage, warm, 2, 3, 2, 100, keys=KEYS[::15], descriptor=ttl)  # deferred
    assert markers(warm) == {(0, 63): 1, (64, 127): 1}
    rocksdb_module._KEPT_CACHES.clear()   # Spark runs the new subtasks in another worker process
    resumed = _takeover_rows(storage, warm, 3, 3, descriptor=ttl)
    taken = [stats for stats, _ in resumed if isinstance(stats, WarmResume) and stats.caught_up]
    assert len(taken) == 2 and all(same for _, same in resumed)
    metadata = storage.load(3)
    for i, (stats, _) in enumerate(resumed):
        if stats in taken:
            r = key_group_range(MAXP, 3, i)
            chains = _committed_chains(metadata, r)
            kept = [kg for kg in r if kg not in stats.restored]
            cold = sum(h.block_size(kg) for kg in kept for h in chains[kg])
            deltas = sum(h.block_size(kg) for kg in kept for h in chains[kg] if h.checkpoint_id > 1)
            assert stats.bytes_caught_up == deltas < cold / 2
            assert set(stats.caught_up) <= set(kept) and stats.dropped
    assert _value_of(storage, 3, descriptor=ttl) == {k: 1 + 10 * (k % 10 == 0) + 100 * (k % 15 == 0) for k in KEYS}


def test_a_taken_over_database_the_batches_between_ran_elsewhere_catches_up(tmp_path):
    """Written at every snapshot, but on host a while two batches ran on host b: the rescale on host a catches
    the taken-over databases up (the path a map state takes too), and 3 -> 2 after it as well."""
    rocksdb_module._KEPT_CACHES.clear()
    storage = CheckpointStorage(tmp_path / "chk")
    host_a, host_b = str(tmp_path / "a"), str(tmp_path / "b")
    run_batch(storage, host_a, None, 1, 2, 1, write_back=1)
    run_batch(storage, host_b, 1, 2, 2, 10, keys=KEYS[::2], write_back=1)
    run_batch(storage, host_b, 2, 3, 2, 100, keys=KEYS[::5], write_back=1)
    stats = run_batch(storage, host_a, 3, 4, 3, 1000, keys=KEYS[::7], write_back=1)
    assert sum(isinstance(s, WarmResume) and bool(s.caught_up) and bool(s.dropped) for s in stats) == 2
    run_batch(storage, host_b, 4, 5, 3, 0, keys=[], write_back=1)   # host a's databases fall behind again, at 3
    stats = run_batch(storage, host_a, 5, 6, 2, 0, keys=[], write_back=1)
    assert any(isinstance(s, WarmResume) and s.caught_up and (s.restored or s.dropped) for s in stats)
    assert _value_of(storage, 6) == {k: 1 + 10 * (k % 2 == 0) + 100 * (k % 5 == 0) + 1000 * (k % 7 == 0)
                                     for k in KEYS}


def _cold_everywhere(stats):
    return all(not isinstance(s, WarmResume) and s.bytes_read > 0 for s in stats)


def _refusals(monkeypatch):
    """The catch-up plans of taken-over databases, as ``_catch_up_plan`` returns them (None: refused)."""
    plans = []
    plan = RocksDBKeyedStateBackend._catch_up_plan

    def observed(self, *args):
        plans.append(plan(self, *args))
        return plans[-1]
    monkeypatch.setattr(RocksDBKeyedStateBackend, "_catch_up_plan", observed)
    return plans


def test_a_taken_over_database_whose_state_meta_changed_since_is_restored_cold(tmp_path, monkeypatch):
    """Checkpoint 2 was written with another TTL on the state (another meta): the database at 1 cannot catch up
    onto it."""
    rocksdb_module._KEPT_CACHES.clear()
    storage = CheckpointStorage(tmp_path / "chk")
    host_a, host_b = str(tmp_path / "a"), str(tmp_path / "b")

    def with_ttl(seconds):
        d = ValueStateDescriptor("n", Int64Serializer())
        d.enable_time_to_live(StateTtlConfig.new_builder(seconds).build())
        return d

    run_batch(storage, host_a, None, 1, 2, 1, descriptor=with_ttl(3600), write_back=1)
    run_batch(storage, host_b, 1, 2, 2, 10, keys=KEYS[::2], descriptor=with_ttl(7200))
    rocksdb_module._KEPT_CACHES.clear()
    assert markers(host_a) == {(0, 63): 1, (64, 127): 1}
    plans = _refusals(monkeypatch)
    stats = run_batch(storage, host_a, 2, 3, 3, 0, keys=[], descriptor=with_ttl(7200))
    assert len(plans) == 2 and plans == [None, None] and _cold_everywhere(stats)
    assert _value_of(storage, 3, descriptor=with_ttl(7200)) == {k: 1 + 10 * (k % 2 == 0) for k in KEYS}


def _go_on_from_1_on_host_b_then_take_over_on_host_a_cold(storage, host_a, host_b, monkeypatch):
    """The job goes on from checkpoint 1 on host b (3, 4), then rescales to 3 on host a, whose databases hold
    checkpoint 2: both takeovers are refused (nothing vouches for those rows), restore cold, and read exactly."""
    run_batch(storage, host_b, 1, 3, 2, 10, keys=KEYS[::2], write_back=1)
    run_batch(storage, host_b, 3, 4, 2, 100, keys=KEYS[::3], write_back=1)
    rocksdb_module._KEPT_CACHES.clear()
    plans = _refusals(monkeypatch)
    stats = run_batch(storage, host_a, 4, 5, 3, 0, keys=[])
    assert plans == [None, None] and _cold_everywhere(stats)
    assert _value_of(storage, 5) == {k: 1 + 10 * (k % 2 == 0) + 100 * (k % 3 == 0) for k in KEYS}


def test_a_taken_over_database_whose_marker_checkpoint_was_never_committed_is_restored_cold(tmp_path, monkeypatch):
    """Host a's databases hold checkpoint 2, whose commit failed; the job went on from 1 on host b (3, 4): the
    marker's snapshot file is in no committed checkpoint, so nothing vouches for the rows."""
    rocksdb_module._KEPT_CACHES.clear()
    storage = CheckpointStorage(tmp_path / "chk")
    host_a, host_b = str(tmp_path / "a"), str(tmp_path / "b")
    run_batch(storage, host_a, None, 1, 2, 1, write_back=1)
    metadata = storage.load(1)
    for i in range(2):   # the batch of checkpoint 2 writes its snapshot and databases; the commit never happens
        b = RocksDBKeyedStateBackend(key_group_range(MAXP, 2, i), MAXP, Int64Serializer(), subtask_index=i,
                                     warm_dir=host_a, write_back_batches=1)
        b.restore(storage, metadata)
        n = b.get_state(ValueStateDescriptor("n", Int64Serializer()))
        for k in KEYS:
            if assign_to_operator(k, MAXP, 2) == i:
                b.set_current_key(k)
                n.update(n.value() + 50)
        b.snapshot(2, storage).result(30)
        b.dispose()
    assert markers(host_a) == {(0, 63): 2, (64, 127): 2}
    _go_on_from_1_on_host_b_then_take_over_on_host_a_cold(storage, host_a, host_b, monkeypatch)


def test_a_taken_over_database_of_another_lineage_is_restored_cold(tmp_path, monkeypatch):
    """Host a's databases hold checkpoint 2 (committed); the job then restored checkpoint 1 on host b and went on
    (3, 4): checkpoint 4's chains do not begin with the files the databases hold."""
    rocksdb_module._KEPT_CACHES.clear()
    storage = CheckpointStorage(tmp_path / "chk")
    host_a, host_b = str(tmp_path / "a"), str(tmp_path / "b")
    run_batch(storage, host_a, None, 1, 2, 1, write_back=1)
    run_batch(storage, host_a, 1, 2, 2, 50, write_back=1)
    assert markers(host_a) == {(0, 63): 2, (64, 127): 2}
    _go_on_from_1_on_host_b_then_take_over_on_host_a_cold(storage, host_a, host_b, monkeypatch)


def test_the_process_holding_the_kept_values_still_completes_the_taken_over_database_from_them(tmp_path):
    """The cheaper path stays: in the process that parked the caches, the deferred keys are written from them and
    no delta block is read for the kept key groups."""
    rocksdb_module._KEPT_CACHES.clear()
    storage, warm = _job(tmp_path)
    run_batch(storage, warm, None, 1, 2, 1)
    run_batch(storage, warm, 1, 2, 2, 10, keys=KEYS[::2])
    stats = run_batch(storage, warm, 2, 3, 3, 0, keys=[])
    moved = [s for s in stats if isinstance(s, WarmResume) and s.dropped]
    assert len(moved) == 2 and all(not s.caught_up and s.bytes_read == 0 for s in moved)
    assert _value_of(storage, 3) == {k: 1 + 10 * (k % 2 == 0) for k in KEYS}
    rocksdb_module._KEPT_CACHES.clear()
