"""The balanced assignment's load forecast, its fallback to Flink's ranges and the warm-state takeover, without
Spark or files: load sequences run through ``BalancedRanges.choose`` and the commit's load figures
(``merged_loads``) exactly as a job's batches run them, each batch's checkpoint built from the last."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups._ranges import check_boundaries, flink_boundaries
from keygroups.checkpoint import CheckpointMetadata
from keygroups.errors import CorruptSnapshotError
from keygroups.runtime.assignment import (
    CALLS_REPORT,
    DECISION_PROPERTY,
    LOADS_PROPERTY,
    RANGES_PROPERTY,
    RECORDS_REPORT,
    TIMERS_REPORT,
    AssignmentDecision,
    BalancedRanges,
    FlinkRanges,
    checkpoint_batch_work,
    encode_counts,
    max_over_mean,
    merged_loads,
    moved_figures,
    range_loads,
    warm_takeover,
)


def run_batches(assignment, works, parallelisms, mp):
    """Each batch's decision from the checkpoint of the batch before (its loads, ranges and decision, as
    ``commit_batch`` stores them), and the max/mean of the batch's work under the ranges it ran with and under
    Flink's ranges."""
    previous, out = None, []
    for n, (work, p) in enumerate(zip(works, parallelisms)):
        decision = assignment.choose(previous, mp, p)
        b = decision.boundaries
        # what merged_loads reads of a SubtaskReport
        reports = [SimpleNamespace(subtask=i, **{RECORDS_REPORT: encode_counts(work[b[i]:b[i + 1]]),
                                                 CALLS_REPORT: encode_counts(work[b[i]:b[i + 1]]),
                                                 TIMERS_REPORT: encode_counts(np.zeros(b[i + 1] - b[i]))})
                   for i in range(p)]
        previous = CheckpointMetadata(
            checkpoint_id=n + 1, job_id="j", timestamp_ms=0, max_parallelism=mp, parallelism=p, keyed_handles=[],
            properties={LOADS_PROPERTY: merged_loads(previous, reports, mp, b, getattr(assignment, "half_life", 3.0)),
                        RANGES_PROPERTY: list(b), DECISION_PROPERTY: decision.to_json()})
        out.append((decision, max_over_mean(range_loads(work, b)),
                    max_over_mean(range_loads(work, flink_boundaries(mp, p)))))
    return out


@st.composite
def load_sequences(draw):
    """Per batch work over the key groups: a background level plus hot key groups, which a batch keeps from the
    batch before or moves (so runs of a steady hot spot, hot spots moving at any pace, idle batches)."""
    mp = draw(st.sampled_from([8, 16, 32, 64]))
    n = draw(st.integers(1, 28))
    p = draw(st.integers(1, min(mp, 8)))
    works, parallelisms, hot = [], [], []
    for _ in range(n):
        if draw(st.integers(0, 9)) == 0:
            p = draw(st.integers(1, min(mp, 8)))     # now and then another parallelism
        if not hot or draw(st.booleans()):
            hot = draw(st.lists(st.tuples(st.integers(0, mp - 1), st.integers(1, 3000)), max_size=4))
        work = np.full(mp, float(draw(st.integers(0, 30))))
        for kg, weight in hot:
            work[kg] += weight
        works.append(work)
        parallelisms.append(p)
    return mp, works, parallelisms


ASSIGNMENTS = [BalancedRanges(), BalancedRanges(allowance=0.1, evidence=2, score_half_life=2.0),
               BalancedRanges(allowance=0.0, evidence=1, min_gain=0.0, tolerance=0.0, score_half_life=1.0, caution=0.0)]


@settings(max_examples=250, deadline=None)
@given(sequence=load_sequences(), assignment=st.sampled_from(ASSIGNMENTS))
def test_balanced_ranges_never_run_more_than_the_allowance_above_flinks_ranges(sequence, assignment):
    """Over any sequence of batches, the summed max/mean of the balanced ranges stays within ``allowance`` of Flink's
    ranges' on the same batches, plus one batch's excess (the one batch a forecast can lose before the account
    stops it); Flink's ranges run exactly whenever no forecast is trusted; a move for balance gains at least
    ``min_gain`` on the forecast it serves."""
    mp, works, parallelisms = sequence
    total, flink_total, worst = 0.0, 0.0, 0.0
    for (decision, ran, flink), p in zip(run_batches(assignment, works, parallelisms, mp), parallelisms):
        check_boundaries(decision.boundaries, mp)
        record = decision.forecast
        assert record is not None
        if record.used is None:
            assert decision.boundaries == flink_boundaries(mp, p)
        else:
            assert record.account >= 0 and record.measured[record.used] >= assignment.evidence
            if decision.moved and decision.max_over_mean_before is not None:
                assert decision.max_over_mean <= decision.max_over_mean_before * (1 - assignment.min_gain) + 1e-9
        total, flink_total = total + ran, flink_total + flink
        worst = max(worst, ran - (1 + assignment.allowance) * flink)
        assert total <= (1 + assignment.allowance) * flink_total + worst + 1e-9


def skewed_work(mp, rng, hot, share, n=20000):
    """``n`` records: ``share`` of them on the key groups ``hot``, the rest spread over all key groups."""
    background = np.bincount(rng.integers(0, mp, int(n * (1 - share))), minlength=mp)
    spot = np.bincount(rng.choice(hot, int(n * share)), minlength=mp) if len(hot) else 0
    return (background + spot).astype(float)


def workload(name, mp, batches, seed):
    rng = np.random.default_rng(seed)
    if name == "steady":       # a fixed set of hot key groups, as a Zipf stream's heaviest keys are
        hot = rng.choice(mp, 6, replace=False)
        return [skewed_work(mp, rng, hot, 0.6) for _ in range(batches)]
    if name == "hot key":      # one key carries 30% of the records
        hot = rng.choice(mp, 1)
        return [skewed_work(mp, rng, hot, 0.3) for _ in range(batches)]
    period = {"moving every batch": 1, "moving every 2 batches": 2, "moving every 3 batches": 3}[name]
    works = []
    for b in range(batches):
        if b % period == 0:
            hot = rng.choice(mp, 2, replace=False)
        works.append(skewed_work(mp, rng, hot, 0.5))
    return works


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("name", ["steady", "hot key", "moving every batch", "moving every 2 batches",
                                  "moving every 3 batches"])
def test_balanced_ranges_do_not_lose_to_flinks_on_skew_steady_or_moving(name, p):
    """The runs the trust review measured (max/mean 2.30 against Flink's 2.13 for a hot spot moving every two
    batches): over 10 runs of 30 batches, the balanced ranges' mean max/mean stays within the allowance of Flink's
    on a moving hot spot (the forecast's ranges are used only while they keep winning: a hot spot that moves every
    batch or two is left on Flink's ranges; one that stays three batches is won on or lost on by a fraction of a
    percent, run by run) and far below it on steady skew."""
    mp = 128
    assignment = BalancedRanges()
    runs = [run_batches(assignment, works, [p] * len(works), mp)
            for works in (workload(name, mp, 30, seed) for seed in range(10))]
    ran = np.mean([r for run in runs for _, r, _ in run])
    flink = np.mean([f for run in runs for _, _, f in run])
    assert ran <= flink * (1 + assignment.allowance)
    if name in ("moving every batch", "moving every 2 batches"):
        assert ran == pytest.approx(flink, rel=1e-9)      # never trusted: Flink's ranges exactly
    if not name.startswith("moving"):
        settled = np.mean([r for run in runs for _, r, _ in run[8:]])
        assert settled < 0.85 * np.mean([f for run in runs for _, _, f in run[8:]])


def test_the_forecast_is_dropped_when_the_past_stops_predicting_and_taken_up_again_when_it_does():
    mp, p = 64, 4
    rng = np.random.default_rng(3)
    steady = rng.choice(mp, 4, replace=False)
    works = [skewed_work(mp, rng, steady, 0.6) for _ in range(10)]
    works += [skewed_work(mp, rng, rng.choice(mp, 2, replace=False), 0.6) for _ in range(10)]   # moves every batch
    works += [skewed_work(mp, rng, steady, 0.6) for _ in range(12)]
    out = run_batches(BalancedRanges(), works, [p] * len(works), mp)
    used = [d.forecast.used for d, _, _ in out]
    assert used[:5] == [None] * 5                       # measured on 4 batches before its ranges are used
    assert "until the load forecast has been measured on 4 batches (3 so far)" in out[4][0].reason
    assert all(u is not None for u in used[5:11])
    dropped = next(i for i in range(11, 20) if used[i] is None)
    assert dropped <= 16 and all(u is None for u in used[dropped:20])
    assert out[dropped][0].boundaries == flink_boundaries(mp, p)
    assert ("Flink's equal ranges: the past does not predict the batches" in out[dropped][0].reason
            or "above Flink's ranges and the 2% allowed" in out[dropped][0].reason)
    assert any(u is not None for u in used[24:])        # the steady skew predicts again
    # what the last batch really did is in each decision, beside what Flink's ranges would have done
    for (decision, _, _), (_, ran, flink) in zip(out[1:], out):
        assert decision.last_batch_max_over_mean == pytest.approx(ran)
        assert decision.last_batch_flink_max_over_mean == pytest.approx(flink)


def test_the_record_carries_through_the_checkpoint_and_a_malformed_one_is_corrupt():
    mp, p = 32, 4
    rng = np.random.default_rng(5)
    works = [skewed_work(mp, rng, [3, 17], 0.5) for _ in range(3)]
    out = run_batches(BalancedRanges(), works, [p] * 3, mp)
    stored = out[-1][0].to_json()
    assert stored["takeover"] == [0, 1, 2, 3] and stored["last_batch"]["flink_max_over_mean"] > 1
    assert set(stored["forecast"]["forecasts"]) == {"decayed", "recent"}
    assert stored["forecast"]["forecasts"]["decayed"]["measured"] == 1
    metadata = CheckpointMetadata(checkpoint_id=7, job_id="j", timestamp_ms=0, max_parallelism=mp, parallelism=p,
                                  keyed_handles=[], properties={DECISION_PROPERTY: stored})
    assert checkpoint_batch_work(metadata) is None
    for damage, message in [
        (lambda f: f.update(used="psychic"), "'used' must be one of \\['decayed', 'recent'\\] or null"),
        (lambda f: f["forecasts"]["decayed"].update(ranges=[0, 8, 32]),
         "forecast 'decayed' has 2 ranges for parallelism 4"),
        (lambda f: f["forecasts"]["recent"].update(score=float("nan")), "recent.score must be a finite number"),
        (lambda f: f["forecasts"]["recent"].update(measured=-1), "forecast 'recent': 'measured' must be an int >= 0"),
        (lambda f: f.update(account="lots"), "account must be a finite number"),
    ]:
        broken = {**stored, "forecast": {**stored["forecast"], "forecasts": {
            k: dict(v) for k, v in stored["forecast"]["forecasts"].items()}}}
        damage(broken["forecast"])
        metadata.properties[DECISION_PROPERTY] = broken
        with pytest.raises(CorruptSnapshotError, match=r"checkpoint 7: properties\['key_group_assignment'\]"
                                                       r"\['forecast'\] is not a forecast record: " + message):
            BalancedRanges().choose(metadata, mp, p)
    assert FlinkRanges().choose(metadata, mp, p).forecast is None    # Flink's ranges never read the record


# ---- warm takeover -------------------------------------------------------------------------------------------------

@st.composite
def two_sets_of_ranges(draw):
    mp = draw(st.integers(1, 12))

    def ranges():
        p = draw(st.integers(1, min(mp, 5)))
        return (0, *sorted(draw(st.sets(st.integers(1, mp - 1), min_size=p - 1, max_size=p - 1))), mp) \
            if p > 1 else (0, mp)

    return ranges(), ranges(), np.array(draw(st.lists(st.sampled_from([0, 1, 7, 1000]), min_size=mp,
                                                      max_size=mp)), dtype=float)


def _kept(before, after, state, takeover):
    """(bytes, key groups) each new range keeps of the old range it takes over."""
    kept_bytes = kept_groups = 0
    for i, j in enumerate(takeover):
        if j is not None:
            low, high = max(after[i], before[j]), min(after[i + 1], before[j + 1])
            assert high > low, "a range takes over only a range it overlaps"
            kept_bytes, kept_groups = kept_bytes + state[low:high].sum(), kept_groups + high - low
    return kept_bytes, kept_groups


@settings(max_examples=400, deadline=None)
@given(case=two_sets_of_ranges())
def test_warm_takeover_is_the_best_matching_and_moved_bytes_are_what_is_read(case):
    before, after, state = case
    takeover = warm_takeover(before, after, state)
    taken = [j for j in takeover if j is not None]
    assert len(takeover) == len(after) - 1 and len(taken) == len(set(taken))
    best = max(_kept(before, after, state, match)
               for match in itertools.product([None, *range(len(before) - 1)], repeat=len(after) - 1)
               if len([j for j in match if j is not None]) == len({j for j in match if j is not None})
               and all(j is None or min(after[i + 1], before[j + 1]) > max(after[i], before[j])
                       for i, j in enumerate(match)))
    assert _kept(before, after, state, takeover) == best
    moved_groups, moved_bytes, _ = moved_figures(before, after, state)
    assert moved_bytes == state.sum() - best[0] and moved_groups == before[-1] - best[1]


def test_the_decision_names_the_warm_state_each_subtask_takes_over():
    mp = 16
    state = np.arange(mp, dtype=float)
    decision = AssignmentDecision("balanced", (0, 3, 9, 16), (0, 4, 8, 12, 16), True, "", 1, None, 1,
                                  takeover=warm_takeover((0, 4, 8, 12, 16), (0, 3, 9, 16), state))
    assert [decision.warm_range(i) for i in range(3)] == [
        decision.ranges[0].__class__(0, 3), decision.ranges[0].__class__(4, 7), decision.ranges[0].__class__(12, 15)]
    fresh = FlinkRanges().choose(None, mp, 3)
    assert fresh.takeover == (None, None, None) and fresh.warm_range(0) is None
