"""Two small in-task sinks: :class:`CountingSink` (the output's rows per checkpoint, exactly once: what a benchmark
compares with Spark's ``count()``, and what a test checks a batch against) and :class:`TaskFunctionSink` (a
function called with each output record batch in the task, at least once: Spark's ``foreach`` writer without a
commit)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from keygroups.runtime.sink import Sink, SinkCommittable, SinkContext, SinkWriter


class CountingSink(Sink):
    """Counts the output rows of each committed checkpoint. Each subtask counts its rows in the task and
    pre-commits the count; the commit, on the driver, records the checkpoint's total in :attr:`committed`
    (``checkpoint id -> rows``; committing again sets the same total, so a checkpoint counts once). The counts live
    in the driver's copy of the sink (the one given to the job)."""

    def __init__(self) -> None:
        self.committed: dict[int, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"committed": {}}   # a task's copy starts empty: its counts travel in the committables

    @property
    def name(self) -> str:
        return "keygroups.counting"

    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _CountingWriter()

    def commit(self, checkpoint_id: int, committables: Sequence[SinkCommittable]) -> None:
        self.committed[checkpoint_id] = sum(int(c.data["rows"]) for c in committables)

    @property
    def rows(self) -> int:
        """The rows of every checkpoint committed so far."""
        return sum(self.committed.values())


class _CountingWriter(SinkWriter):
    def __init__(self) -> None:
        self.rows = 0

    def write(self, batch: pa.RecordBatch) -> None:
        self.rows += batch.num_rows

    def prepare_commit(self) -> Any:
        return {"rows": self.rows} if self.rows else None


class TaskFunctionSink(Sink):
    """Calls ``function(batch, context)`` in the task with each record batch of a subtask's output (a
    :class:`~keygroups.runtime.sink.SinkContext` says which subtask, checkpoint and attempt). At least once: the
    function runs before the checkpoint commits, so a batch that fails afterwards, or a task Spark retries, calls it
    again with the same records; make what it does idempotent (key it by ``context.checkpoint_id`` and
    ``context.subtask_index``) or use a two-phase sink such as :class:`~keygroups.sinks.ParquetSink`. The function
    is pickled with the job (cloudpickle on Spark), as a ``foreach`` function is."""

    def __init__(self, function: Callable[[pa.RecordBatch, SinkContext], Any]) -> None:
        if not callable(function):
            raise TypeError(f"TaskFunctionSink takes a function (batch, context) -> None, got "
                            f"{type(function).__name__}")
        self.function = function

    @property
    def name(self) -> str:
        return "keygroups.task-function"

    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _FunctionWriter(self.function, context)

    def commit(self, checkpoint_id: int, committables: Sequence[SinkCommittable]) -> None:
        """Nothing to publish: the function has seen the records already."""


class _FunctionWriter(SinkWriter):
    def __init__(self, function: Callable[[pa.RecordBatch, SinkContext], Any], context: SinkContext) -> None:
        self._function = function
        self._context = context

    def write(self, batch: pa.RecordBatch) -> None:
        self._function(batch, self._context)

    def prepare_commit(self) -> Any:
        return None


__all__ = ["CountingSink", "TaskFunctionSink"]
