"""Choosing each micro-batch's parallelism: a streaming query may run every batch at another parallelism, since a
batch restores only the key groups its subtasks own, whatever the previous batch's parallelism was.

A policy is any callable ``policy(records, history) -> parallelism``: ``records`` is the coming batch's record count,
``history`` the figures of the query's earlier batches (oldest first, the newest :data:`HISTORY` of them). Two are
built in: :class:`RecordsPerSubtask` (deterministic: a fixed share of records per subtask) and
:class:`TargetBatchDuration` (aims at a batch duration from what the earlier batches took). Both stay between a
minimum and a maximum parallelism; the runner also refuses anything outside ``[1, max_parallelism]``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: How many earlier batches a policy is shown.
HISTORY = 16


@dataclass(frozen=True)
class BatchFigures:
    """What one earlier micro-batch did: its checkpoint, the parallelism it ran at, its records and its duration;
    ``max_over_mean``: its largest subtask load over the mean under the key-group ranges it ran with (None when not
    known). A batch's duration follows its largest subtask, so a policy may read ``seconds / max_over_mean`` as the
    duration balanced ranges would reach (the job's assignment chooses each batch's ranges after the policy has
    chosen its parallelism: one batch may change both)."""

    checkpoint_id: int
    parallelism: int
    records: int
    seconds: float
    max_over_mean: float | None = None


ParallelismPolicy = Callable[[int, Sequence[BatchFigures]], int]


def _check_bounds(min_parallelism: int, max_parallelism: int | None) -> None:
    if isinstance(min_parallelism, bool) or not isinstance(min_parallelism, int) or min_parallelism < 1:
        raise ValueError(f"min_parallelism must be an int >= 1, got {min_parallelism!r}")
    if max_parallelism is not None and (isinstance(max_parallelism, bool) or not isinstance(max_parallelism, int)
                                        or max_parallelism < min_parallelism):
        raise ValueError(f"max_parallelism must be None or an int >= min_parallelism ({min_parallelism}), got "
                         f"{max_parallelism!r}")


def _clamp(p: int, low: int, high: int | None) -> int:
    return max(low, p if high is None else min(p, high))


@dataclass(frozen=True)
class RecordsPerSubtask:
    """One subtask per ``records_per_subtask`` records of the batch (rounded up), between ``min_parallelism`` and
    ``max_parallelism``: predictable, and enough when a record costs about the same in every batch."""

    records_per_subtask: int
    min_parallelism: int = 1
    max_parallelism: int | None = None

    def __post_init__(self) -> None:
        if (isinstance(self.records_per_subtask, bool) or not isinstance(self.records_per_subtask, int)
                or self.records_per_subtask < 1):
            raise ValueError(f"records_per_subtask must be an int >= 1, got {self.records_per_subtask!r}")
        _check_bounds(self.min_parallelism, self.max_parallelism)

    def __call__(self, records: int, history: Sequence[BatchFigures]) -> int:
        return _clamp(math.ceil(records / self.records_per_subtask), self.min_parallelism, self.max_parallelism)


@dataclass(frozen=True)
class TargetBatchDuration:
    """Aims each batch at ``target_seconds``: from the newest earlier batch that had records, it assumes that a
    batch's time grows with its records and shrinks with its parallelism, and picks the smallest parallelism whose
    predicted time is within the target (``start_parallelism`` for the first batch). It moves only when the
    prediction is off by more than ``tolerance`` (a share of the target), so that noise does not rescale every
    batch."""

    target_seconds: float
    min_parallelism: int = 1
    max_parallelism: int | None = None
    start_parallelism: int = 1
    tolerance: float = 0.25

    def __post_init__(self) -> None:
        if not (isinstance(self.target_seconds, (int, float)) and self.target_seconds > 0):
            raise ValueError(f"target_seconds must be a number > 0, got {self.target_seconds!r}")
        if not (isinstance(self.tolerance, (int, float)) and 0 <= self.tolerance < 1):
            raise ValueError(f"tolerance must be a number in [0, 1), got {self.tolerance!r}")
        _check_bounds(self.min_parallelism, self.max_parallelism)
        _check_bounds(self.start_parallelism, None)

    def __call__(self, records: int, history: Sequence[BatchFigures]) -> int:
        last = next((b for b in reversed(history) if b.records > 0 and b.seconds > 0), None)
        if last is None:
            return _clamp(self.start_parallelism, self.min_parallelism, self.max_parallelism)
        predicted = last.seconds * records / last.records   # at the last batch's parallelism
        if abs(predicted - self.target_seconds) <= self.tolerance * self.target_seconds:
            return _clamp(last.parallelism, self.min_parallelism, self.max_parallelism)
        return _clamp(math.ceil(last.parallelism * predicted / self.target_seconds), self.min_parallelism,
                      self.max_parallelism)


__all__ = ["BatchFigures", "ParallelismPolicy", "RecordsPerSubtask", "TargetBatchDuration", "HISTORY"]
