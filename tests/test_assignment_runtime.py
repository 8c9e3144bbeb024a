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
    AssignmentDecision,
    checkpoint_boundaries,
    checkpoint_loads,
    decode_counts,
    max_over_mean,
    moved_figures,
    range_loads,
    warm_takeover,
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


def run(location, table, p, assignment, kept, kept_timers, tamper=None, function=None, **spec_changes):
    storage = CheckpointStorage(location)
    plan = begin_batch(storage, job_name="skew", max_parallelism=MP, parallelism=p, assignment=assignment)
    spec = plan.keyed_task(key_columns=("key",), function=pickle.dumps(function or SkewCounter()),
                           input_schema=SCHEMA, output_schema=OUT, warm_heap_backends=8)
    spec = dataclasses.replace(spec, **spec_changes)
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
    for n in range(2, 6):   # the forecast is measured on 4 batches before its ranges are used
        plan, second, reports = run(location, skewed(n), 4, BalancedRanges(), kept, timers)
        decision = second.properties[DECISION_PROPERTY]
        assert plan.boundaries == flink_boundaries(MP, 4)
        assert f"until the load forecast has been measured on 4 batches ({n - 2} so far)" in decision["reason"]
    plan, second, reports = run(location, skewed(6), 4, BalancedRanges(), kept, timers)
    decision = second.properties[DECISION_PROPERTY]
    assert decision["moved"] and "boundaries moved" in decision["reason"]
    assert decision["flink_max_over_mean"] > 1.5 and decision["max_over_mean"] <= 1.15
    assert second.properties[RANGES_PROPERTY] == list(plan.boundaries) != list(flink_boundaries(MP, 4))
    before = set(zip(flink_boundaries(MP, 4), flink_boundaries(MP, 4)[1:]))
    for i, r in enumerate(reports):
        unchanged = (plan.boundaries[i], plan.boundaries[i + 1]) in before
        # a range that changed resumes the kept backend overlapping it most, if one is left
        assert r.restored.mode in (("warm",) if unchanged else ("moved", "cold"))
    # each subtask takes over the warm state the decision's best matching gives it; all four ran in this one process,
    # so the key groups that changed owner come from the pieces the other kept backends were split into: nothing is
    # read, where a subtask in another process would read the decision's moved bytes
    assert [kg for r in reports for run in r.restored.restored_key_groups for kg in run] == []
    assert sum(r.restored.bytes_read for r in reports) == 0 < decision["moved_bytes"]
    assert sum(len(run) for r in reports for run in r.restored.warm_key_groups) == MP
    # the load figures reach the records each range got
    counted = range_loads(checkpoint_loads(second).records, plan.boundaries)
    assert counted.sum() == pytest.approx(4000 * sum(0.5 ** (k / 3) for k in range(6)), rel=1e-5)

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
        own = reports[1].key_group_range
        reports[1] = dataclasses.replace(reports[1], key_group_range=KeyGroupRange(own.start + 1, own.end))

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


def stream(name: str, batches: int, seed: int, n: int = 4000) -> list[pa.Table]:
    """``batches`` tables of ``n`` records: Zipf (s = 1.2 over 20,000 keys), one hot key with 30% of the records, or
    4 hot keys with half the records, moving to 4 others every 2 batches."""
    rng = np.random.default_rng(seed)
    pool = rng.permutation(20000).astype(np.int64)
    out = []
    for b in range(batches):
        if name == "zipf":
            cdf = np.cumsum(np.arange(1, len(pool) + 1, dtype=np.float64) ** -1.2)
            keys = pool[np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"), len(pool) - 1)]
        else:
            if name == "hot key":
                hot = pool[:1]
            elif b % 2 == 0:
                hot = rng.choice(pool, 4, replace=False)
            keys = rng.choice(pool, n)
            spike = rng.random(n) < (0.3 if name == "hot key" else 0.5)
            keys[spike] = rng.choice(hot, int(spike.sum()))
        out.append(pa.table({"key": pa.array(keys, pa.int64()), "n": pa.array(np.ones(n, dtype=np.int64))}))
    return out


@pytest.mark.parametrize("name", ["zipf", "hot key", "moving hot spot"])
def test_skew_runs_stay_within_flinks_ranges_and_read_exactly_what_changed_owner(tmp_path, name):
    """The skew runs of issue 31 through the driver and subtasks: per batch, the max/mean of the work the subtasks
    counted, under the ranges the batch ran with and under Flink's ranges (the same counts, summed over Flink's
    ranges). Over the run, balanced stays within its allowance of Flink's ranges, far below them on steady skew; a
    hot spot moving every 2 batches is left on Flink's ranges. The subtasks read exactly the bytes that changed
    owner when they run in other processes (they take over the warm state the decision's best matching gives them);
    here, all in one process, nothing: the kept backends are split among them."""
    location = str(tmp_path / "chk")
    kept, timers = HeapBackendRegistry(), TimerQueueRegistry()
    assignment = BalancedRanges()
    ran, flink, moved, read = [], [], 0, 0
    for n, table in enumerate(stream(name, 12, 7)):
        plan, _, reports = run(location, table, 4, assignment, kept, timers, function=PerRecordCounter())
        b = plan.boundaries
        work = np.concatenate([decode_counts(r.key_group_calls, b[i + 1] - b[i], "calls")
                               for i, r in enumerate(reports)])
        ran.append(max_over_mean(range_loads(work, b)))
        flink.append(max_over_mean(range_loads(work, flink_boundaries(MP, 4))))
        if n:
            moved += plan.assignment.moved_bytes
            read += sum(r.restored.bytes_read for r in reports)
    assert np.mean(ran) <= np.mean(flink) * (1 + assignment.allowance)
    if name == "moving hot spot":
        assert ran == flink and moved == read == 0
    else:
        assert np.mean(ran[6:]) < 0.85 * np.mean(flink[6:])
        assert read == 0 < moved   # one process: what changed owner comes from the kept backends' pieces


class FixedRanges:
    """An assignment that runs the ranges it is given (any Assignment may), with the decision's best takeover."""

    name = "fixed"

    def __init__(self, boundaries):
        self.boundaries = tuple(boundaries)

    def choose(self, previous, max_parallelism, parallelism):
        b = self.boundaries
        if previous is None:
            return AssignmentDecision("fixed", b, None, False, "given", 1.0, None, 1.0)
        before, state = checkpoint_boundaries(previous), checkpoint_loads(previous).state_bytes
        takeover = warm_takeover(before, b, state)
        groups, moved, restore = moved_figures(before, b, state, takeover)
        return AssignmentDecision("fixed", b, before, before != b, "given", 1.0, None, 1.0, moved_key_groups=groups,
                                  moved_bytes=moved, restore_bytes=restore, takeover=takeover)


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
@pytest.mark.parametrize("honoured", [True, False])
def test_several_moved_boundaries_read_exactly_the_moved_bytes(tmp_path, honoured, backend):
    """Two of three boundaries move so that the first subtask's largest overlap is the range the second needs: the
    subtasks take the warm state the decision's best matching gives them and read exactly the moved bytes. The same
    batch with each subtask choosing greedily (the largest overlap first, as before the takeover was shipped) reads
    more: the second subtask finds its only overlapping range taken and restores its whole range cold. So for
    RocksDB databases kept on local disk; heap backends kept in this one process are split among the subtasks, which
    then read nothing either way."""
    location = str(tmp_path / "chk")
    kept, timers = HeapBackendRegistry(), TimerQueueRegistry()
    table = pa.table({"key": pa.array(np.arange(3000), pa.int64()), "n": pa.array(np.ones(3000, np.int64))})
    local = {"backend": backend, "local_dir": str(tmp_path / "local")}
    run(location, table, 3, FixedRanges((0, 4, 25, MP)), kept, timers, **local)
    plan, second, reports = run(location, table, 3, FixedRanges((0, 15, 24, MP)), kept, timers, **local,
                                **({} if honoured else {"warm_takeover": None}))
    decision = second.properties[DECISION_PROPERTY]
    assert decision["takeover"] == [0, 1, 2]
    read = sum(r.restored.bytes_read for r in reports)
    arrived = sorted(kg for r in reports for run_ in r.restored.restored_key_groups for kg in run_)
    if backend == "heap":
        # one process holds every kept heap backend: a subtask takes the rest of its range from the pieces the
        # others were split into, whichever it resumed first, so nothing is read either way
        assert [r.restored.mode for r in reports] == ["moved", "moved", "moved"]
        assert read == 0 and arrived == []
        return
    assert [r.restored.mode for r in reports] == (["moved", "moved", "moved"] if honoured else
                                                  ["moved", "cold", "moved"])
    if honoured:
        assert arrived == [*range(4, 15), *range(24, 25)] and len(arrived) == decision["moved_key_groups"]
        assert read == decision["moved_bytes"] > 0
    else:
        assert read > 1.1 * decision["moved_bytes"]


def test_harness_takes_over_warm_state_as_the_decision_says(tmp_path):
    """The test harness (the batch spine's local executor) ships the decision's takeover to its subtasks: after two
    boundaries moved, the bytes the batch restored are the decision's moved bytes, and the report carries the
    decision."""
    from keygroups.testing import KeyedFunctionHarness

    assignment = FixedRanges((0, 4, 25, MP))
    records = [{"key": k, "n": 1} for k in range(3000)]
    with KeyedFunctionHarness(SkewCounter(), "key", output_schema=OUT, input_schema=SCHEMA, max_parallelism=MP,
                              parallelism=3, assignment=assignment, directory=tmp_path) as harness:
        harness.process(records)
        assignment.boundaries = (0, 15, 24, MP)
        report = harness.process(records).report
        decision = report.assignment
        assert decision is not None and decision.boundaries == (0, 15, 24, MP) and decision.takeover == (0, 1, 2)
        # the harness runs every subtask in one process: the moved key groups come from the kept backends' pieces
        assert report.bytes_restored == 0 < decision.moved_bytes
        assert report.key_groups_cold == 0 and decision.moved_key_groups == 12
        assert harness.state(7, "count") == 2   # key 7's state came through whichever way it went


def test_a_subtask_restoring_cold_does_not_push_out_warm_state_another_takes_over(tmp_path):
    """Three heap backends kept (the limit): the first subtask's new range overlaps only a range the decision gives
    to the second, so it takes its key group as a piece split off that backend (the rest stays parked for the second)
    and keeps one backend more; what is dropped to stay within the limit is never the range the third subtask is
    about to resume, and the batch reads no more than the decision's moved bytes."""
    location = str(tmp_path / "chk")
    kept, timers = HeapBackendRegistry(), TimerQueueRegistry()
    table = pa.table({"key": pa.array(np.arange(3000), pa.int64()), "n": pa.array(np.ones(3000, np.int64))})
    run(location, table, 3, FixedRanges((0, 10, 20, MP)), kept, timers, warm_heap_backends=3)
    plan, second, reports = run(location, table, 3, FixedRanges((0, 1, 15, MP)), kept, timers,
                                warm_heap_backends=3)
    decision = second.properties[DECISION_PROPERTY]
    assert decision["takeover"] == [None, 0, 2]
    assert [r.restored.mode for r in reports] == ["moved", "moved", "moved"]
    assert reports[0].restored.bytes_read == 0 and reports[1].restored.warm_key_groups == (KeyGroupRange(1, 9),)
    assert reports[2].restored.warm_key_groups == (KeyGroupRange(20, MP - 1),)
    assert reports[2].restored.restored_key_groups == (KeyGroupRange(15, 19),)
    assert 0 < sum(r.restored.bytes_read for r in reports) <= decision["moved_bytes"]


def test_the_decision_reads_back_from_its_checkpoint_whole(tmp_path):
    """What a report read back from a checkpoint says of its ranges is the decision the batch ran with: takeover,
    the last batch's measured figures and the forecast's record included (BatchReport.assignment)."""
    from keygroups.runtime.properties import BatchProperties

    location = str(tmp_path / "chk")
    kept, timers = HeapBackendRegistry(), TimerQueueRegistry()
    for n in range(1, 4):
        plan, metadata, _ = run(location, skewed(n), 4, BalancedRanges(evidence=1, caution=0), kept, timers)
    decision = plan.assignment
    assert decision.forecast is not None and decision.last_batch_max_over_mean is not None
    back = BatchProperties.of(metadata).decision(metadata)
    assert back.to_json() == decision.to_json() and back.takeover == decision.takeover
    assert back.forecast == type(decision.forecast).from_json(decision.forecast.to_json(), MP, 4, "forecast")
    assert "the last batch measured" in back.summary()
