"""The built-in parallelism policies, without Spark: what each picks from a batch's records and earlier figures."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keygroups.runtime.scaling import BatchFigures, RecordsPerSubtask, TargetBatchDuration


@given(records=st.integers(0, 10**7), per=st.integers(1, 10**5), low=st.integers(1, 8), span=st.integers(0, 64))
def test_records_per_subtask_is_the_rounded_up_share_within_bounds(records, per, low, span):
    policy = RecordsPerSubtask(per, min_parallelism=low, max_parallelism=low + span)
    assert policy(records, ()) == min(max(math.ceil(records / per), low), low + span)


def test_target_duration_starts_keeps_and_moves():
    policy = TargetBatchDuration(10.0, min_parallelism=1, max_parallelism=32, start_parallelism=4)
    assert policy(1000, ()) == 4
    assert policy(1000, [BatchFigures(1, 4, 0, 1.0)]) == 4            # an empty batch says nothing
    assert policy(1000, [BatchFigures(1, 4, 1000, 11.0)]) == 4        # within 25%: no rescale for noise
    assert policy(1000, [BatchFigures(1, 4, 1000, 20.0)]) == 8        # twice too slow: twice the subtasks
    assert policy(2000, [BatchFigures(1, 4, 1000, 10.0)]) == 8        # twice the records
    assert policy(250, [BatchFigures(1, 8, 1000, 10.0)]) == 2         # a quarter of the records
    assert policy(10**6, [BatchFigures(1, 4, 1000, 10.0)]) == 32      # capped
    assert policy(1, [BatchFigures(1, 4, 1000, 10.0)]) == 1
    # the newest batch with records decides
    assert policy(1000, [BatchFigures(1, 4, 1000, 40.0), BatchFigures(2, 16, 1000, 10.0)]) == 16


@pytest.mark.parametrize("make, message", [
    (lambda: RecordsPerSubtask(0), "records_per_subtask must be an int >= 1, got 0"),
    (lambda: RecordsPerSubtask(10, min_parallelism=0), "min_parallelism must be an int >= 1, got 0"),
    (lambda: RecordsPerSubtask(10, min_parallelism=4, max_parallelism=2), r"max_parallelism must be None or an "
                                                                        r"int >= min_parallelism \(4\), got 2"),
    (lambda: TargetBatchDuration(0), "target_seconds must be a number > 0, got 0"),
    (lambda: TargetBatchDuration(1.0, tolerance=1.5), r"tolerance must be a number in \[0, 1\), got 1.5"),
])
def test_bad_policy_arguments_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("chosen", [0, 33, 2.0, True, None])
def test_the_runner_refuses_a_policy_answer_outside_its_max_parallelism(chosen):
    from keygroups.runtime.batch import _checked_choice

    with pytest.raises(ValueError, match=rf"chose {chosen!r} for a batch of 7 records; a parallelism is an int in "
                                         r"\[1, 32\]"):
        _checked_choice(lambda records, history: chosen, chosen, 7, 32)
