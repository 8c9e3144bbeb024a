"""Balanced key-group ranges through the driver, subtasks and the ``keygroups`` command (no Spark): a skewed job moves
its boundaries and says why, unchanged ranges stay warm, a hot key group is named with its remedy, a subtask that
ran with other ranges is refused, and ``inspect`` / ``plan`` show the ranges and their loads."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pyarrow as pa
import pytest

import keygroups as kg
from keygroups._ranges import KeyGroupRange, flink_boundaries, operator_indexes_for_boundaries
from keygroups.checkpoint import CheckpointStorage
from keygroups.cli import main
from keygroups.errors import KeyGroupsError
from keygroups.runtime import begin_batch, commit_batch
from keygroups.runtime.assignment import (
    DECISION_PROPERTY,
    RANGES_PROPERTY,
    BalancedRanges,
    checkpoint_loads,
    range_loads,
)
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.runtime.subtask_state import HeapBackendRegistry
from keygroups.state.timers import TimerQueueRegistry
from keygroups.runtime.functions import KeyedProcessFunction
from test_assignment_model import COUNT, OUT, SCHEMA, SkewCounter

MP = 32


def skewed(seed: int, hot: int = 0, hot_share: float = 0.6, n: int = 4000) -> pa.Table:
    """Keys of which ``hot_share`` fall in the key groups of Flink's first range at p=4 (key groups 0..7)."""
    rng = np.random.default_rng(seed)
    pool = np.arange(20000, dtype=np.int64)
    groups = kg.assign_key_groups(pa.array(pool), MP, "long")
    hot_keys = pool[groups < 8] if hot == 0 else pool[groups == hot]
    keys = np.where(rng.random(n) < hot_share, rng.choice(hot_keys, n), rng.choice(pool, n))
    return pa.table({"key": pa.array(keys, pa.int64()), "n": pa.array(np.ones(n, dtype=np.int64))})


class PerRecordCounter(KeyedProcessFunction):
    """SkewCounter's count, called once per record."""

    def open(self, context):
        self.count = context.get_state(COUNT)

    def process_element(self, record, context):
        self.count.update((self.count.value() or 0) + record["n"])


def run(location, table, p, assignment, kept, kept_timers, tamper=None, function=None):
    storage = CheckpointStorage(location)
    plan = begin_batch(storage, job_name="skew", max_parallelism=MP, parallelism=p, assignment=assignment)
    spec = plan.keyed_task(key_columns=("key",), function=pickle.dumps(function or SkewCounter()),
                           input_schema=SCHEMA, output_schema=OUT, warm_heap_backends=8)
    owners = operator_indexes_for_boundaries(plan.boundaries, kg.assign_key_groups(table.column("key"), MP, "long"))
    reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches(), warm=kept,
                                 warm_timers=kept_timers) for i in range(p)]
    if tamper is not None:
        tamper(reports)
    return plan, commit_batch(plan, reports), reports


def test_skew_moves_boundaries_keeps_unchanged_ranges_warm_and_cli_shows_them(tmp_path, capsys):
    location = str(tmp_path / "chk")
    kept, timers = HeapBackendRegistry(), TimerQueueRegistry()
    plan, first, _ = run(location, skewed(1), 4, BalancedRanges(), kept, timers)
    assert plan.boundaries == flink_boundaries(MP, 4)            # nothing measured yet
    assert "no load measured yet" in first.properties[DECISION_PROPERTY]["reason"]
    plan, second, reports = run(location, skewed(2), 4, BalancedRanges(), kept, timers)
    decision = second.properties[DECISION_PROPERTY]
    assert decision["moved"] and "boundaries moved" in decision["reason"]
    assert decision["flink_max_over_mean"] > 1.5 and decision["max_over_mean"] <= 1.15
    assert second.properties[RANGES_PROPERTY] == list(plan.boundaries) != list(flink_boundaries(MP, 4))
    before = set(zip(flink_boundaries(MP, 4), flink_boundaries(MP, 4)[1:]))
    for i, r in enumerate(reports):
        unchanged = (plan.boundaries[i], plan.boundaries[i + 1]) in before
        # a range that changed resumes the kept backend overlapping it most, if one is left
        assert r.restored.mode in (("warm",) if unchanged else ("moved", "cold"))
    # a changed range keeps the key groups it still owns warm and reads only those that arrived, each once: at most
    # the moved key groups (fewer when a kept backend of another subtask overlaps more than its own did)
    arrived = [kg for r in reports for run in r.restored.restored_key_groups for kg in run]
    assert 0 < len(arrived) == len(set(arrived)) <= decision["moved_key_groups"]
    assert sum(r.restored.bytes_read for r in reports) <= decision["moved_bytes"]
    # the load figures reach the records each range got
    counted = range_loads(checkpoint_loads(second).records, plan.boundaries)
    assert counted.sum() == pytest.approx(4000 * (1 + 0.5 ** (1 / 3)), rel=1e-5)

    assert main(["inspect", location, "--no-timers"]) == 0
    out = capsys.readouterr().out
    assert "key-group ranges (balanced): boundaries moved" in out
    for i in range(4):
        assert f"subtask {i}: key groups {plan.boundaries[i]}-{plan.boundaries[i + 1] - 1}, records" in out
    assert f"moved {decision['moved_key_groups']} key groups holding {decision['moved_bytes']:,} B" in out
    assert main(["plan", location, "3", "--assignment", "balanced"]) == 0
    out = capsys.readouterr().out
    expected = BalancedRanges().choose(second, MP, 3)
    assert f"ranges (balanced): {expected.reason}" in out
    for i, r in enumerate(expected.ranges):
        assert f"new subtask {i} (key groups {r.start}-{r.end})" in out
    assert main(["plan", location, "3"]) == 0
    out = capsys.readouterr().out
    for i in range(3):
        r = kg.key_group_range(MP, 3, i)
        assert f"new subtask {i} (key groups {r.start}-{r.end})" in out


def test_a_key_group_heavier_than_the_mean_is_named_with_a_max_parallelism_that_splits_it(tmp_path, capsys):
    location = str(tmp_path / "chk")
    kept, timers = HeapBackendRegistry(), TimerQueueRegistry()
    run(location, skewed(3, hot=5, hot_share=0.7), 4, BalancedRanges(), kept, timers)
    _, metadata, _ = run(location, skewed(4, hot=5, hot_share=0.7), 4, BalancedRanges(), kept, timers)
    hot = metadata.properties[DECISION_PROPERTY]["hot_key_groups"]
    assert [h["key_group"] for h in hot] == [5]
    assert hot[0]["times_mean"] > 1 and hot[0]["suggested_max_parallelism"] == MP * int(np.ceil(hot[0]["times_mean"]))
    assert main(["inspect", location, "--no-timers"]) == 0
    assert (f"key group 5 alone carries {hot[0]['times_mean']:.2f}x a subtask's mean load: no ranges can split it; "
            f"a max parallelism of {hot[0]['suggested_max_parallelism']} would split it") in capsys.readouterr().out


def test_a_report_of_other_ranges_is_refused_and_nothing_commits(tmp_path):
    location = str(tmp_path / "chk")
    kept, timers = HeapBackendRegistry(), TimerQueueRegistry()
    run(location, skewed(1), 4, BalancedRanges(), kept, timers)

    def shift(reports):
        reports[1] = dataclasses.replace(reports[1], key_group_range=KeyGroupRange(reports[1].key_group_range.start + 1, reports[1].key_group_range.end))

    with pytest.raises(KeyGroupsError, match=r"subtask 1 ran with key groups \[9, 15\], but the batch was planned "
                                             r"with KeyGroupRange\(8, 15\); nothing was committed"):
        run(location, skewed(2), 4, None, kept, timers, tamper=shift)
    assert CheckpointStorage(location).latest().checkpoint_id == 1


def test_the_work_figure_counts_a_step_per_key_plus_one_per_record_for_a_per_record_function(tmp_path):
    table = skewed(5)
    groups = kg.assign_key_groups(table.column("key"), MP, "long")
    keys = np.bincount(kg.assign_key_groups(pa.array(np.unique(table.column("key").to_numpy())), MP, "long"),
                       minlength=MP)
    records = np.bincount(groups, minlength=MP)
    for function, expected in ((PerRecordCounter(), keys + records), (SkewCounter(), keys)):
        location = str(tmp_path / type(function).__name__)
        _, metadata, _ = run(location, table, 3, None, HeapBackendRegistry(), TimerQueueRegistry(), function=function)
        loads = checkpoint_loads(metadata)
        assert loads.records.tolist() == records.tolist()
        assert loads.calls.tolist() == expected.tolist()
