"""Sinks that run inside the keyed stage, committed in two phases with the checkpoint (Flink's ``SinkWriter`` and
``Committer``; Spark's ``ForeachWriter`` without its lack of a commit).

A job's output goes to a :class:`Sink` in the task that produced it, not through a second Spark job after the batch:

1. **write** (in each keyed subtask): the sink makes a :class:`SinkWriter` for the subtask
   (:meth:`Sink.create_writer`, told the :class:`SinkContext`: job, subtask, parallelism, checkpoint id, the batch
   run's id and the task attempt), which gets the subtask's output as Arrow record batches once the subtask's records
   and due timers are processed (:meth:`SinkWriter.write`);
2. **pre-commit** (still in the task): :meth:`SinkWriter.prepare_commit` stages what it wrote where no reader looks
   and returns a *committable*: a small JSON value naming what to publish (file names, a transaction id; never the
   data). It travels in the subtask's :class:`~keygroups.runtime.report.SubtaskReport` and is stored in the
   checkpoint's ``_metadata`` with it;
3. **commit** (on the driver, once the checkpoint is committed): :meth:`Sink.commit` gets every subtask's committable
   and makes the output visible. It must be idempotent: a driver that dies between the checkpoint's commit and the
   sink's commits the same committables again when it restarts (the latest checkpoint's, read back from its
   ``_metadata``) or when the batch is replayed (a ``foreachBatch`` batch id Spark runs again);
4. **abort**: a task that fails after its writer started calls :meth:`SinkWriter.abort`; a batch that fails on the
   driver (a subtask failed, the checkpoint's compare-and-swap was lost, the driver was fenced) calls
   :meth:`Sink.abort` with the committables it got, so nothing staged by the failed run becomes visible.

The guarantee: the output of checkpoint *n* becomes visible exactly once, if and only if checkpoint *n* commits
(exactly-once end to end, as Flink's two-phase-commit sinks give it, with an idempotent committer). A Spark task
attempt that is retried stages under its own name; only the attempt whose report reached the driver is committed.
Until :meth:`Sink.commit` has run, the output is staged, not visible: a sink trades latency (visible after the
commit) for that guarantee. If :meth:`Sink.commit` raises, the checkpoint stays committed, the batch raises
:class:`SinkCommitError`, and the commit is retried before the driver's next batch (and by any driver that
restarts on the location), so a committer that fails for a while delays the output, never loses or duplicates it.

Where the output also goes: with a sink, a job by default writes no output files into its checkpoint (the sink is
the output; ``checkpoint_output=True`` writes both, so that ``BatchResult.output`` can read it back). A replayed
batch does not run again: its committables are committed again instead.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from keygroups.errors import CorruptSnapshotError, SinkCommitError

log = logging.getLogger("keygroups")

#: The most bytes a committable may take as JSON: it is stored in the checkpoint's ``_metadata`` with the
#: subtask's report (name files, not data).
MAX_COMMITTABLE_BYTES = 64 * 1024

#: The most rows of one record batch a writer gets.
SINK_BATCH_ROWS = 64 * 1024


@dataclass(frozen=True)
class SinkContext:
    """What a writer is opened with: the ``job_name``, the ``subtask_index`` of ``parallelism``, the
    ``checkpoint_id`` the output belongs to (Spark's batch id under ``foreachBatch``, plus the offset of the
    location), ``run_id`` (unique per run of the batch by a driver: a batch run again after a failure gets a new
    one) and ``attempt`` (Spark's task attempt number; 0 in the local runtime)."""

    job_name: str
    subtask_index: int
    parallelism: int
    checkpoint_id: int
    run_id: str
    attempt: int = 0


@dataclass(frozen=True)
class SinkCommittable:
    """One subtask's pre-committed output: ``data`` is what its writer's :meth:`SinkWriter.prepare_commit` returned
    (JSON), with where it came from (``subtask``, ``attempt``, ``run_id``) and the ``sink``'s name (see
    :attr:`Sink.name`)."""

    sink: str
    subtask: int
    attempt: int
    run_id: str
    data: Any

    def to_json(self) -> dict[str, Any]:
        return {"sink": self.sink, "subtask": self.subtask, "attempt": self.attempt, "run_id": self.run_id,
                "data": self.data}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SinkCommittable:
        if not isinstance(d, Mapping):
            raise CorruptSnapshotError(f"a sink committable is a JSON object, got {d!r:.200}")
        try:
            subtask, attempt = d["subtask"], d["attempt"]
            if any(isinstance(v, bool) or not isinstance(v, int) for v in (subtask, attempt)):
                raise TypeError(f"subtask and attempt must be ints, got {subtask!r} and {attempt!r}")
            return cls(str(d["sink"]), subtask, attempt, str(d["run_id"]), d.get("data"))
        except (KeyError, TypeError) as e:
            raise CorruptSnapshotError(f"a sink committable is malformed ({type(e).__name__}: {e}): {dict(d)!r:.300}"
                                       ) from None


class SinkWriter(ABC):
    """One subtask's writer for one batch (see the module docs); made by :meth:`Sink.create_writer` in the task."""

    @abstractmethod
    def write(self, batch: pa.RecordBatch) -> None:
        """Take one record batch of the output (the job's output schema), staged where no reader sees it."""

    @abstractmethod
    def prepare_commit(self) -> Any:
        """Finish staging and return the committable: a small JSON value (at most :data:`MAX_COMMITTABLE_BYTES`)
        that tells :meth:`Sink.commit` what to publish; None when there is nothing to commit (no output)."""

    def abort(self) -> None:  # noqa: B027  # a writer that stages nothing has nothing to abort
        """Discard what this writer staged (the task failed, before or after :meth:`prepare_commit`). Called at
        most once, instead of the batch being committed; it should not raise (a failure is logged)."""


class Sink(ABC):
    """Where a keyed job's output goes, in the task, committed with the checkpoint (see the module docs). A sink is
    pickled with the job and shipped to the tasks (each task makes its writers from its own copy), and the driver
    keeps its own copy for :meth:`commit` and :meth:`abort`. Subclasses implement :meth:`create_writer` and
    :meth:`commit`."""

    @property
    def name(self) -> str:
        """The sink's name in the committables a checkpoint stores: a restarted job commits the stored committables
        only with a sink of the same name (another sink could not read them). Default: the class's qualified
        name."""
        return f"{type(self).__module__}.{type(self).__qualname__}"

    @abstractmethod
    def create_writer(self, context: SinkContext) -> SinkWriter:
        """The writer of one subtask for one batch (in the task)."""

    @abstractmethod
    def commit(self, checkpoint_id: int, committables: Sequence[SinkCommittable]) -> None:
        """Make checkpoint ``checkpoint_id``'s staged output visible (on the driver, after the checkpoint committed):
        ``committables`` holds one per subtask that had something to commit, in subtask order. Idempotent: it may
        be called again with the same committables (after a driver crash, or a replay), after some or all of them
        were published."""

    def abort(self, checkpoint_id: int, run_id: str,  # noqa: B027  # nothing staged outside the committables
              committables: Sequence[SinkCommittable]) -> None:
        """Discard what run ``run_id`` of checkpoint ``checkpoint_id`` staged: the batch failed before or while its
        checkpoint committed. ``committables`` holds those the driver received (subtasks that failed, or whose
        report never arrived, had their writers aborted in the task, or left orphans this should also remove)."""


def check_sink(sink: Any) -> Sink | None:
    """``sink`` if it is a :class:`Sink` (or None); TypeError naming what was given and what is allowed."""
    if sink is None or isinstance(sink, Sink):
        return sink
    hint = ""
    if callable(sink):
        hint = (" (a function is not a sink: for a foreachBatch-style function over the committed output use "
                "KeyedJob.foreach_batch(sink); for a function called in each task use "
                "keygroups.sinks.TaskFunctionSink)")
    raise TypeError(f"sink must be a keygroups.sinks.Sink (e.g. ParquetSink(path)) or None, got "
                    f"{type(sink).__name__}{hint}")


def check_checkpoint_output(checkpoint_output: Any, sink: Sink | None) -> bool:
    """Whether a job with ``sink`` writes its output into its checkpoint too, given ``checkpoint_output`` (None: only
    without a sink); TypeError for anything but a bool or None, ValueError for False without a sink."""
    if checkpoint_output is None:
        return sink is None
    if not isinstance(checkpoint_output, bool):
        raise TypeError(f"checkpoint_output must be a bool or None, got {checkpoint_output!r}")
    if not checkpoint_output and sink is None:
        raise ValueError("checkpoint_output=False needs a sink: without one the checkpoint holds the job's only "
                         "output; give sink=... or leave checkpoint_output unset")
    return checkpoint_output


def sink_name(sink: Sink) -> str:
    """The sink's :attr:`Sink.name`, checked to be a non-empty str."""
    name = sink.name
    if not isinstance(name, str) or not name:
        raise TypeError(f"{type(sink).__name__}.name must be a non-empty str, got {name!r}")
    return name


class TaskSink:
    """A sink's writer inside one keyed subtask (used by :mod:`keygroups.runtime.subtask`): opened on the context,
    fed the output, pre-committed; aborted if the task fails before it returns its report (use it as a context
    manager around everything the task does after opening it)."""

    def __init__(self, sink: Sink, context: SinkContext) -> None:
        self._sink = sink
        self._name = sink_name(sink)
        self._context = context
        writer = sink.create_writer(context)
        if not isinstance(writer, SinkWriter):
            raise TypeError(f"{type(sink).__name__}.create_writer must return a keygroups.sinks.SinkWriter, got "
                            f"{type(writer).__name__}")
        self._writer: SinkWriter | None = writer

    def __enter__(self) -> TaskSink:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None and self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.abort()
            except Exception:   # noqa: BLE001  # the task's own error is what the driver must see
                log.exception("the sink %s could not abort the writer of subtask %d of checkpoint %d", self._name,
                              self._context.subtask_index, self._context.checkpoint_id)

    def write_table(self, table: pa.Table) -> None:
        """Give the writer ``table``'s rows, in record batches of at most :data:`SINK_BATCH_ROWS` rows."""
        assert self._writer is not None
        for batch in table.to_batches(max_chunksize=SINK_BATCH_ROWS):
            if batch.num_rows:
                self._writer.write(batch)

    def prepare_commit(self) -> SinkCommittable | None:
        """The writer's committable (None: nothing to commit), checked to be JSON of at most
        :data:`MAX_COMMITTABLE_BYTES`."""
        assert self._writer is not None
        data = self._writer.prepare_commit()
        if data is None:
            return None
        try:
            size = len(json.dumps(data, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise TypeError(f"{type(self._writer).__name__}.prepare_commit must return JSON (dicts, lists, strings, "
                            f"numbers, booleans, None): its committable is stored in the checkpoint's _metadata; "
                            f"got {type(data).__name__} ({e})") from None
        if size > MAX_COMMITTABLE_BYTES:
            raise ValueError(f"{type(self._writer).__name__}.prepare_commit returned a committable of {size} bytes "
                             f"of JSON; at most {MAX_COMMITTABLE_BYTES} are allowed (it is stored in _metadata: "
                             "name the staged output, do not hold it)")
        c = self._context
        return SinkCommittable(self._name, c.subtask_index, c.attempt, c.run_id, data)


def committables_of(reports: Sequence[Any]) -> list[SinkCommittable]:
    """The committables of subtask ``reports`` (:class:`~keygroups.runtime.report.SubtaskReport`), in subtask
    order."""
    return [r.sink_committable for r in sorted(reports, key=lambda r: r.subtask) if r.sink_committable is not None]


__all__ = ["MAX_COMMITTABLE_BYTES", "SINK_BATCH_ROWS", "Sink", "SinkCommitError", "SinkCommittable", "SinkContext",
           "SinkWriter", "TaskSink", "check_checkpoint_output", "check_sink", "committables_of", "sink_name"]
