"""Skew-aware key-group ranges through the real driver and subtasks (no Spark), as a hypothesis model: batches of
skewed keys at random parallelisms and max parallelisms, switching between Flink's and balanced ranges, on both
backends (and now and then a batch on the other one). After every batch the committed state equals a plain-dict
model, the ranges cut the key groups into one owner each, a restore reads only its own key groups (an unchanged
range stays warm; a moved one keeps the key groups it still owns and reads only the chains of those that arrived),
the load figures add up, and Flink's ranges are Flink's ownership exactly."""

from __future__ import annotations

import pickle
import shutil
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import keygroups as kg
from keygroups._ranges import KeyGroupRange, check_boundaries, flink_boundaries, operator_indexes_for_boundaries
from keygroups.checkpoint import CheckpointStorage, chain_stats
from keygroups.runtime import begin_batch, commit_batch
from keygroups.runtime.assignment import (
    DECISION_PROPERTY,
    RANGES_PROPERTY,
    BalancedRanges,
    FlinkRanges,
    checkpoint_boundaries,
    checkpoint_loads,
)
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.backends import create_backend
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.runtime.subtask_state import HeapBackendRegistry
from keygroups.serializers import Int64Serializer
from keygroups.state import ValueStateDescriptor
from keygroups.state.timers import TimerQueueRegistry

COUNT = ValueStateDescriptor("count", Int64Serializer())
FIRED = ValueStateDescriptor("fired", Int64Serializer())
SCHEMA = pa.schema([("key", pa.int64()), ("n", pa.int64())])
OUT = pa.schema([("key", pa.int64()), ("total", pa.int64())])
ASSIGNMENTS = {"flink": FlinkRanges(), "balanced": BalancedRanges(),
               # trusts its forecast after one batch and keeps moving boundaries, so restores of moved ranges run
               "eager": BalancedRanges(tolerance=0.0, min_gain=0.0, move_cost=0.0, evidence=1, caution=0.0,
                                       allowance=1.0)}


class SkewCounter(KeyedProcessFunction):
    """Sums ``n`` per key and counts, with a processing-time timer, the batches that saw the key."""

    def open(self, context):
        self.count = context.get_state(COUNT)
        self.fired = context.get_state(FIRED)

    def process_key_batch(self, key, records, context):
        total = (self.count.value() or 0) + int(pc.sum(records.column("n")).as_py())
        self.count.update(total)
        context.timer_service.register_processing_time_timer(context.timer_service.current_processing_time())
        return pa.table({"key": pa.array([key], pa.int64()), "total": pa.array([total], pa.int64())})

    def on_timer(self, timestamp, context):
        self.fired.update((self.fired.value() or 0) + 1)


def committed_state(storage: CheckpointStorage) -> tuple[dict[int, int], dict[int, int]]:
    """Every key's count and fired figure in the latest checkpoint, restored into one heap backend."""
    metadata = storage.latest()
    mp = metadata.max_parallelism
    backend = create_backend("heap", KeyGroupRange(0, mp - 1), mp, "long")
    backend.restore(storage, metadata)
    count, fired = backend.get_state(COUNT), backend.get_state(FIRED)
    counts, fires = {}, {}
    for key in list(backend.keys("count")):
        backend.set_current_key(key)
        counts[key] = count.value()
        fires[key] = fired.value()
    return counts, fires


OTHER = {"heap": "rocksdb", "rocksdb": "heap"}


class AssignmentModel(RuleBasedStateMachine):
    backend = "heap"

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="kg-assign-")
        self.storage = CheckpointStorage(f"{self.directory}/chk", retain=2)
        self.kept = HeapBackendRegistry()
        self.kept_timers = TimerQueueRegistry()
        self.counts: dict[int, int] = {}
        self.fired: dict[int, int] = {}
        self.switched = False   # the last batch ran on the other backend (warm state of this one is then stale)

    def teardown(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    @rule(hot=st.lists(st.integers(0, 299), max_size=4), spread=st.integers(0, 80),
          seed=st.integers(0, 2**16), parallelism=st.integers(1, 6), assignment=st.sampled_from(sorted(ASSIGNMENTS)),
          max_parallelism=st.sampled_from([24, 24, 24, 48, 12]), switch=st.sampled_from([False, False, False, True]))
    def batch(self, hot, spread, seed, parallelism, assignment, max_parallelism, switch):
        previous = self.storage.latest()
        if previous is not None and max_parallelism % previous.max_parallelism and \
                previous.max_parallelism % max_parallelism:
            max_parallelism = previous.max_parallelism
        rng = np.random.default_rng(seed)
        keys = np.concatenate([np.repeat(np.array(hot, dtype=np.int64), 40),
                               rng.integers(0, 300, spread)]).astype(np.int64)
        table = pa.table({"key": pa.array(keys, pa.int64()), "n": pa.array(rng.integers(1, 5, len(keys)), pa.int64())})
        plan = begin_batch(self.storage, job_name="skew", max_parallelism=max_parallelism, parallelism=parallelism,
                           assignment=ASSIGNMENTS[assignment])
        boundaries = check_boundaries(plan.boundaries, max_parallelism)
        assert len(boundaries) == parallelism + 1
        if assignment == "flink":   # Flink's ownership exactly, whatever the restored checkpoint's ranges were
            assert plan.ranges == [kg.key_group_range(max_parallelism, parallelism, i) for i in range(parallelism)]
        spec = plan.keyed_task(key_columns=("key",), function=pickle.dumps(SkewCounter()), input_schema=SCHEMA,
                               output_schema=OUT, backend=OTHER[self.backend] if switch else self.backend,
                               local_dir=f"{self.directory}/local",
                               warm_heap_backends=8)
        groups = kg.assign_key_groups(table.column("key"), max_parallelism, "long")
        owners = operator_indexes_for_boundaries(boundaries, groups)
        previous_ranges = set()
        if previous is not None and previous.max_parallelism == max_parallelism:
            b = checkpoint_boundaries(previous)
            previous_ranges = {KeyGroupRange(b[i], b[i + 1] - 1) for i in range(len(b) - 1)}
        reports = []
        for i, own in enumerate(plan.ranges):
            part = table.filter(pa.array(owners == i))
            report = run_keyed_subtask(spec, i, part.to_batches(), warm=self.kept, warm_timers=self.kept_timers)
            assert report.key_group_range == own
            restored = report.restored.to_json()
            if previous is None:
                assert restored["mode"] == "new"
            else:
                # a restore reads its own key groups' chains and nothing else
                own_chains = chain_stats(previous, own) if previous.max_parallelism == max_parallelism else None
                if own_chains is not None:
                    assert restored["bytes_read"] <= sum(c.full_bytes + c.delta_bytes for c in own_chains.values())
                    assert restored["key_groups"] <= len(own)
                if own in previous_ranges and not switch and not self.switched:   # an unchanged range stays warm
                    assert restored["mode"] == "warm", (own, restored)
                else:
                    assert restored["mode"] != "new", (own, restored)   # warm only if resumed exactly
                # every key group it owns came one way (kept warm, caught up, or restored), none it does not own
                came = {name: [kg for a, b in restored[f"{name}_key_groups"] for kg in range(a, b + 1)]
                        for name in ("warm", "caught_up", "restored")}
                assert sorted(sum(came.values(), [])) == list(own), (own, restored)
                assert restored["bytes_caught_up"] + restored["bytes_restored"] == restored["bytes_read"]
                if own_chains is not None:   # a range that moved reads the chains of the key groups that arrived
                    arrived = [own_chains[g] for g in came["restored"] if g in own_chains]
                    assert restored["bytes_restored"] <= sum(c.full_bytes + c.delta_bytes for c in arrived)
                    if restored["mode"] == "moved" and self.backend == "rocksdb" and not switch:
                        # a kept database behind the checkpoint (write-back, or batches on the other backend) catches
                        # up the key groups it keeps: their blocks newer than it, never more than their chains
                        caught = [own_chains[g] for g in came["caught_up"] if g in own_chains]
                        assert restored["bytes_caught_up"] <= sum(c.full_bytes + c.delta_bytes for c in caught)
            reports.append(report)
        metadata = commit_batch(plan, reports)
        self.switched = switch
        for key, n in zip(table.column("key").to_pylist(), table.column("n").to_pylist()):
            self.counts[key] = self.counts.get(key, 0) + n
        for key in set(table.column("key").to_pylist()):
            self.fired[key] = self.fired.get(key, 0) + 1
        # the checkpoint keeps its ranges and why; its handles are exactly those ranges
        assert metadata.properties[RANGES_PROPERTY] == list(boundaries)
        assert metadata.properties[DECISION_PROPERTY]["assignment"] == ASSIGNMENTS[assignment].name
        for h in metadata.keyed_handles:
            if h.checkpoint_id == metadata.checkpoint_id:
                assert h.key_group_range == plan.ranges[h.subtask]
        # the load figures: the previous ones decayed, plus this batch's records per key group
        counted = np.bincount(groups, minlength=max_parallelism).astype(np.float64)
        expected = counted
        decay = 0.5 ** (1 / plan.load_half_life)
        if previous is not None:
            expected = counted + decay * checkpoint_loads(previous).rekeyed(max_parallelism).records
        loads = checkpoint_loads(metadata)
        np.testing.assert_allclose(loads.records, expected, rtol=1e-5, atol=1e-3)
        # SkewCounter is vectorized: one call per key (of the batch) and key group
        calls = np.bincount(kg.assign_key_groups(pa.array(np.unique(keys), pa.int64()), max_parallelism, "long"),
                            minlength=max_parallelism).astype(np.float64)
        if previous is not None:
            calls += decay * checkpoint_loads(previous).rekeyed(max_parallelism).calls
        np.testing.assert_allclose(loads.calls, calls, rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(loads.timers, calls, rtol=1e-5, atol=1e-3)   # one timer fired per key too

    @invariant()
    def state_equals_the_model(self):
        if self.storage.latest() is None:
            return
        counts, fired = committed_state(self.storage)
        assert counts == self.counts
        assert fired == self.fired


class RocksDBAssignmentModel(AssignmentModel):
    backend = "rocksdb"


_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much]}
AssignmentModel.TestCase.settings = settings(max_examples=20, stateful_step_count=8, **_SETTINGS)
RocksDBAssignmentModel.TestCase.settings = settings(max_examples=8, stateful_step_count=6, **_SETTINGS)
TestAssignmentModel = AssignmentModel.TestCase
TestRocksDBAssignmentModel = RocksDBAssignmentModel.TestCase


def test_flink_ranges_stay_flinks_ownership_of_every_key():
    """Every key is owned by exactly the subtask Flink's KeyGroupRangeAssignment names, under the default."""
    keys = pa.array(np.arange(5000), pa.int64())
    for mp, p in ((128, 4), (128, 7), (24, 5)):
        groups = kg.assign_key_groups(keys, mp, "long")
        assert (operator_indexes_for_boundaries(flink_boundaries(mp, p), groups)
                == kg.operator_index_for_key_group(mp, p, groups)).all()
