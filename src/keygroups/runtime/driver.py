"""The driver's half of a micro-batch, independent of Spark: plan the batch, then commit what its subtasks reported.

:func:`locate_batch` finds where the batch starts: the checkpoint it restores (the latest, or a savepoint), the id
of the checkpoint it will be (or that an explicitly numbered or streaming batch is already complete: an idempotent
replay), and refuses a max parallelism that is not the restore point's multiplied or divided by an integer factor
(:func:`~keygroups.checkpoint.planning.check_restore_max_parallelism`). :meth:`BatchStart.plan` then chooses the
batch's parallelism's ranges (once: a parallelism policy first counts the batch's records) and returns a
:class:`BatchPlan`: the task specs every subtask gets, and which subtasks still have to run; :func:`begin_batch` does
both. The caller runs the subtasks (Spark tasks, or plain calls) and hands their reports to :func:`commit_batch`,
which builds the checkpoint's metadata and commits it only if each subtask reported exactly once. Until then the
checkpoint does not exist, so a failed batch can simply run again.

A driver that committed the latest checkpoint itself knows it (:class:`Checkpoints`): the next batch plans from it
without listing the storage or reading its ``_metadata`` again (the commit's compare-and-swap still refuses a batch
planned from a checkpoint that is no longer the newest).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import pyarrow as pa

from keygroups._ranges import KeyGroupRange, check_parallelism, flink_boundaries, key_group_range, ranges_of
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.checkpoint.metadata import encode_metadata
from keygroups.checkpoint.planning import carry_forward, check_restore_max_parallelism
from keygroups.errors import (
    ConcurrentCommitError,
    DriverFencedError,
    KeyGroupsError,
    StateMigrationError,
    UnsafeDeserializationError,
)
from keygroups.runtime.assignment import DEFAULT_HALF_LIFE, Assignment, AssignmentDecision, FlinkRanges, merged_loads
from keygroups.runtime.backends import StateBackendName, create_backend, key_type_for_schema
from keygroups.runtime.functions import RuntimeContext
from keygroups.runtime.properties import BatchProperties, PolicyChoice, StreamingBatch
from keygroups.runtime.report import InputDigest, SourceReport, SubtaskReport, TimerFigures
from keygroups.runtime.source import Source, SourceTaskSpec, prepared_source
from keygroups.runtime.spec import KeyedTaskSpec
from keygroups.runtime.watermarks import LateRecords
from keygroups.state.timers import NO_WATERMARK, TimeDomain


@dataclass(frozen=True)
class DriverFence:
    """One driver's claim on a job's checkpoint location: its fencing token (``epoch``). A driver that starts later
    claims the next epoch, and from then on this one may not commit (:meth:`check` raises): a restarted driver takes
    over at once, and a driver that lost its place (a network partition, a hung process coming back) cannot
    overwrite what the new one does. Flink fences its JobManager leaders the same way.

    The fence is checked when a batch is planned and right before its commit, not atomically with the publish: a
    driver fenced between its check and its publish is stopped by the commit's compare-and-swap instead
    (:meth:`CheckpointStorage.commit`), which refuses any commit whose planned-from checkpoint is no longer the
    newest. Fences say which driver may go on; the compare-and-swap guarantees that no commit, fenced or not, loses
    another's batch."""

    storage: CheckpointStorage
    job_name: str
    epoch: int
    owner: dict[str, Any] = field(repr=False)

    @classmethod
    def claim(cls, storage: CheckpointStorage, job_name: str) -> DriverFence:
        """Claim ``storage``'s location for a new driver of ``job_name``, fencing every earlier one."""
        owner = {"job": job_name, "driver": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                 "claimed_ms": int(time.time() * 1000)}
        return cls(storage, job_name, storage.claim(owner), owner)

    def check(self) -> None:
        """DriverFencedError naming the newer driver if one has claimed the location since this one did."""
        newer = self.storage.newer_claim(self.epoch)
        if newer is not None:
            who = ", ".join(f"{k}={newer[k]!r}" for k in ("job", "host", "pid", "claimed_ms", "unreadable")
                            if k in newer)
            raise DriverFencedError(
                f"this driver of job {self.job_name!r} (fencing token {self.epoch}) was fenced: a newer driver "
                f"claimed {self.storage.location} with token {newer.get('epoch', self.epoch + 1)} ({who}); it may "
                "no longer commit checkpoints there. Run one driver per job and location; the newer one continues "
                "from the latest complete checkpoint")


@dataclass(frozen=True)
class Checkpoints:
    """What a driver knows of its location's complete checkpoints: their ids (ascending) and the latest's metadata
    (None: there is none). Listed from the storage, or kept by the driver that committed the latest one."""

    ids: tuple[int, ...]
    latest: CheckpointMetadata | None

    @classmethod
    def listed(cls, storage: CheckpointStorage) -> Checkpoints:
        """The location's checkpoints, listed; the latest's files checked to exist
        (:meth:`CheckpointStorage.check_complete`: a restore point that lost a file is refused, naming it)."""
        ids = tuple(storage.checkpoint_ids())
        latest = storage.load(ids[-1]) if ids else None
        if latest is not None:
            storage.check_complete(latest)
        return cls(ids, latest)

    def after_commit(self, metadata: CheckpointMetadata, retain: int) -> Checkpoints:
        """What the storage holds once ``metadata`` is committed and retention kept the newest ``retain``."""
        return Checkpoints((*self.ids, metadata.checkpoint_id)[-retain:], metadata)

    def load(self, storage: CheckpointStorage, checkpoint_id: int) -> CheckpointMetadata:
        latest = self.latest
        return latest if latest is not None and latest.checkpoint_id == checkpoint_id else storage.load(checkpoint_id)


@dataclass(frozen=True)
class BatchPlan:
    """One micro-batch as the driver planned it: checkpoint ``checkpoint_id`` at ``parallelism``, restoring from
    ``previous`` (None: the job starts without state).

    ``replay`` is set when ``checkpoint_id`` was given (or follows from a streaming batch) and is already complete:
    nothing runs, the caller returns that checkpoint's committed output instead."""

    storage: CheckpointStorage
    job_name: str
    checkpoint_id: int
    max_parallelism: int
    parallelism: int
    previous: CheckpointMetadata | None
    replay: CheckpointMetadata | None = None
    fence: DriverFence | None = None
    #: The savepoint ``previous`` is (None: ``previous`` is a checkpoint).
    savepoint: str | None = None
    #: The newest complete checkpoint when the batch was planned (None: there was none): the commit succeeds only if
    #: it is still the newest (compare-and-swap, see :meth:`CheckpointStorage.commit`). "latest": no such check.
    planned_from: int | None | Literal["latest"] = "latest"
    #: The batch's processing time (epoch ms), fixed here so that every subtask, and a subtask run again after a
    #: failure, fires the same processing-time timers.
    processing_time: int = field(default_factory=lambda: int(time.time() * 1000))
    #: The batch's ranges as boundaries (subtask i owns ``[b[i], b[i + 1] - 1]``); None: Flink's equal ranges.
    boundaries: tuple[int, ...] | None = None
    #: Why the ranges are what they are (the assignment's decision; None for a replay).
    assignment: AssignmentDecision | None = None
    #: Batches after which a key group's measured records count half (see :mod:`keygroups.runtime.assignment`).
    load_half_life: float = DEFAULT_HALF_LIFE
    #: The Structured Streaming batch this is (None: not one); its checkpoint records it.
    streaming: StreamingBatch | None = None
    #: The location's complete checkpoints when the batch was planned.
    checkpoints: Checkpoints | None = field(default=None, repr=False)

    @property
    def ranges(self) -> list[KeyGroupRange]:
        """The key groups each subtask owns this batch."""
        return ranges_of(self.boundaries or flink_boundaries(self.max_parallelism, self.parallelism))

    @cached_property
    def start_watermark(self) -> int:
        """The watermark the restore point committed (``NO_WATERMARK`` before any event time): this batch's records
        at or before it are late. Read once per plan (the restore point's properties are decoded whole)."""
        return NO_WATERMARK if self.previous is None else BatchProperties.of(self.previous).watermark

    @property
    def restore_from(self) -> int | str | None:
        """What the subtasks restore from: a checkpoint id, a savepoint's name, or None for the first batch."""
        if self.previous is None:
            return None
        return self.savepoint if self.savepoint is not None else self.previous.checkpoint_id

    def keyed_task(self, *, key_columns: tuple[str, ...], function: bytes, input_schema: pa.Schema,
                   output_schema: pa.Schema, backend: StateBackendName = "heap", order_columns: tuple[str, ...] = (),
                   timestamp_column: str | None = None, allow_pickle: bool = False,
                   local_dir: str | None = None, warm_heap_backends: int = 4, watermark: int | None = None,
                   late_records: LateRecords = "drop", key_type: Any = None) -> KeyedTaskSpec:
        """What every keyed subtask of this batch gets; ``function`` is the job's KeyedProcessFunction, pickled;
        ``local_dir`` is the executors' directory for warm state (None: the system temporary directory);
        ``warm_heap_backends`` how many heap backends a worker process keeps between batches (0: none);
        ``watermark`` the batch's watermark once its records are in (see
        :meth:`~keygroups.runtime.watermarks.WatermarkStrategy.next_watermark`; never below ``start_watermark``;
        None keeps it); ``late_records`` what happens to records at or before ``start_watermark``; ``key_type``
        the key columns' (worked out from ``input_schema`` when None). The restore point's ``_metadata`` goes with
        the spec: the subtasks read it from there, not from the storage."""
        start = self.start_watermark
        previous = self.previous
        return KeyedTaskSpec(
            job_name=self.job_name, key_columns=key_columns,
            key_type=key_type if key_type is not None else key_type_for_schema(input_schema, key_columns),
            function=function, input_schema=input_schema, output_schema=output_schema,
            max_parallelism=self.max_parallelism, parallelism=self.parallelism,
            checkpoint_location=self.storage.location, checkpoint_id=self.checkpoint_id,
            restore_from=self.restore_from, backend=backend, order_columns=order_columns,
            timestamp_column=timestamp_column, storage_options=self.storage.storage_options,
            allow_pickle=allow_pickle, local_dir=local_dir, warm_heap_backends=warm_heap_backends,
            start_watermark=start, watermark=start if watermark is None else max(start, watermark),
            processing_time=self.processing_time, late_records=late_records, key_group_boundaries=self.boundaries,
            restore_metadata=None if previous is None or not previous.base else encoded_metadata(previous),
            restore_base=previous.base if previous is not None else "",
            warm_takeover=None if self.assignment is None else self.assignment.warm_ranges(),
        )

    def source_task(self, source: Source | str | os.PathLike[str], *, record_schema: pa.Schema | None,
                    max_records_per_subtask: int | None = None) -> SourceTaskSpec:
        """What every source subtask of this batch gets: read up to ``max_records_per_subtask`` records of its share
        of the source's splits (all that is left with None). ``source`` is a partitioned-log directory or a
        :class:`~keygroups.runtime.source.Source` (Kafka), prepared here, once, for this batch."""
        return SourceTaskSpec(
            source=prepared_source(source, self.previous), record_schema=record_schema,
            parallelism=self.parallelism, max_records=max_records_per_subtask,
            checkpoint_location=self.storage.location,
            checkpoint_id=self.checkpoint_id, restore_from=self.restore_from,
            storage_options=self.storage.storage_options,
        )

    def idle_subtasks(self, reports: Sequence[SubtaskReport]) -> list[int]:
        """The subtasks without a report: they had no records (Spark runs no task for a partition it knows is empty),
        but must still run, with none, to carry their key groups' state into the new checkpoint."""
        return sorted(set(range(self.parallelism)) - {r.subtask for r in reports})


_ENCODED: dict[int, bytes] = {}


def encoded_metadata(metadata: CheckpointMetadata, base: str | None = None) -> bytes:
    """``metadata``'s ``_metadata`` bytes in directory ``base`` (its own by default), encoded once per metadata
    object: the commit writes them, and every subtask of the batches that restore it gets them."""
    key = id(metadata)
    data = _ENCODED.get(key)
    if data is None:
        data = encode_metadata(metadata, metadata.base if base is None else base)
        _ENCODED[key] = data
        weakref.finalize(metadata, _ENCODED.pop, key, None)
    return data


def _streaming_checkpoint_id(latest: CheckpointMetadata | None, restoring: CheckpointMetadata | None,
                             batch: StreamingBatch, savepoint: str | None) -> int:
    """The checkpoint id of streaming ``batch`` (see :class:`StreamingBatch`): ``latest`` is the latest complete
    checkpoint, ``restoring`` the savepoint the batch restores (None: it restores ``latest``)."""
    committed = StreamingBatch.committed_by(latest)
    if latest is not None and committed is not None and batch.continues(committed):
        return latest.checkpoint_id + batch.batch_id - committed.batch_id
    if (latest is not None and committed is None and savepoint is None
            and batch.batch_id == latest.checkpoint_id):
        # written before batches were recorded, when the checkpoint id was the batch id: a replay of the last batch
        return batch.batch_id
    newest = max([c.checkpoint_id for c in (latest, restoring) if c is not None], default=None)
    return batch.batch_id if newest is None else max(batch.batch_id, newest + 1)


def check_key_columns(columns: Sequence[str]) -> tuple[str, ...]:
    """``columns`` as a tuple if they name at least one column, each once; ValueError naming the repeated ones."""
    columns = tuple(columns)
    if not columns:
        raise ValueError("key_columns must name at least one input column (several form a Flink tuple key), got none")
    repeated = sorted({c for c in columns if columns.count(c) > 1})
    if repeated:
        raise ValueError(f"key_columns {list(columns)} name {', '.join(map(repr, repeated))} more than once; each "
                         "key column is named once (several different columns form a Flink tuple key)")
    return columns


def check_output_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` if it can be a job's output: at least one field, no two of one name (Spark compares column names
    case-insensitively, so neither may two differ only in case); ValueError naming what is wrong otherwise."""
    if not len(schema):
        raise ValueError("output_schema has no fields; give the fields of the records the function returns, e.g. "
                         "'k long, total long'")
    seen: dict[str, str] = {}
    for name in schema.names:
        other = seen.setdefault(name.lower(), name)
        if other != name or schema.names.count(name) > 1:
            same = "twice" if other == name else f"as {other!r} and {name!r} (Spark compares names case-insensitively)"
            raise ValueError(f"output_schema names field {name!r} {same}; each output field needs its own name. "
                             f"The fields: {schema.names}")
    return schema


def _next_checkpoint_id(checkpoints: Checkpoints, restoring: CheckpointMetadata | None, savepoint: str | None,
                        checkpoint_id: int | None, streaming: StreamingBatch | None) -> int:
    """The id of the coming checkpoint: ``checkpoint_id`` if given (checked), the streaming batch's, else one past
    the latest complete checkpoint (or the savepoint restored from, ``restoring``, if newer)."""
    latest = checkpoints.latest
    newest = max([c.checkpoint_id for c in (latest, restoring) if c is not None], default=None)
    if streaming is not None:
        checkpoint_id = _streaming_checkpoint_id(latest, restoring, streaming, savepoint)
    if checkpoint_id is None:
        return newest + 1 if newest is not None else 1
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int) or checkpoint_id < 0:
        raise ValueError(f"checkpoint_id must be an int >= 0, got {checkpoint_id!r}")
    if newest is None or checkpoint_id > newest or checkpoint_id in checkpoints.ids:
        return checkpoint_id
    what, last = f"checkpoint {checkpoint_id}", ""
    if streaming is not None:
        committed = StreamingBatch.committed_by(latest)
        last = f" ({committed.describe()})" if committed is not None else ""
        what = f"{streaming.describe()} is checkpoint {checkpoint_id}, which"
    if latest is not None and checkpoint_id <= latest.checkpoint_id:
        raise KeyGroupsError(
            f"{what} is older than the latest complete checkpoint {latest.checkpoint_id}{last} and is no longer "
            f"retained (retained: {list(checkpoints.ids)}): it cannot be replayed")
    assert restoring is not None and savepoint is not None
    raise KeyGroupsError(
        f"{what} does not follow savepoint {savepoint!r} (checkpoint {restoring.checkpoint_id}), which this batch "
        f"restores: the checkpoints after a savepoint must have larger ids; give an id above "
        f"{restoring.checkpoint_id}, or none to take the next one")


@dataclass(frozen=True)
class BatchStart:
    """Where a batch starts (see :func:`locate_batch`): the id of the checkpoint it will be, the checkpoint or
    savepoint it restores (``previous``), the location's checkpoints, or the complete checkpoint it replays."""

    storage: CheckpointStorage
    job_name: str
    checkpoint_id: int
    max_parallelism: int
    checkpoints: Checkpoints
    previous: CheckpointMetadata | None = None
    replay: CheckpointMetadata | None = None
    savepoint: str | None = None
    fence: DriverFence | None = None
    streaming: StreamingBatch | None = None

    def plan(self, parallelism: int, assignment: Assignment | None = None) -> BatchPlan:
        """The batch at ``parallelism``, its ranges chosen by ``assignment`` (default: Flink's) from the restore
        point's load figures."""
        p, mp = check_parallelism(parallelism, self.max_parallelism)
        if self.replay is not None:
            return BatchPlan(self.storage, self.job_name, self.checkpoint_id, mp, p, previous=None,
                             replay=self.replay, fence=self.fence, streaming=self.streaming,
                             checkpoints=self.checkpoints)
        chooser = assignment if assignment is not None else FlinkRanges()
        decision = chooser.choose(self.previous, mp, p)
        latest = self.checkpoints.latest
        return BatchPlan(self.storage, self.job_name, self.checkpoint_id, mp, p, self.previous, fence=self.fence,
                         savepoint=self.savepoint, planned_from=None if latest is None else latest.checkpoint_id,
                         boundaries=decision.boundaries, assignment=decision,
                         load_half_life=getattr(chooser, "half_life", DEFAULT_HALF_LIFE), streaming=self.streaming,
                         checkpoints=self.checkpoints)


def locate_batch(storage: CheckpointStorage, *, job_name: str, max_parallelism: int,
                 checkpoint_id: int | None = None, fence: DriverFence | None = None, savepoint: str | None = None,
                 streaming: StreamingBatch | None = None, known: Checkpoints | None = None) -> BatchStart:
    """Where the next batch of job ``job_name`` starts (see :func:`begin_batch`); ``known``: the location's
    checkpoints as this driver left them after its last commit (None: list them, and first complete a commit a
    writer that died left claimed)."""
    mp = check_parallelism(1, max_parallelism)[1]
    if streaming is not None and checkpoint_id is not None:
        raise ValueError("give checkpoint_id or streaming, not both: a streaming batch's checkpoint id follows from "
                         "its batch id")
    if fence is not None:
        fence.check()
    if known is None:
        storage.finish_interrupted_commit()   # a checkpoint claimed by a writer that died before publishing it
        known = Checkpoints.listed(storage)
    if checkpoint_id is not None and checkpoint_id in known.ids:
        return BatchStart(storage, job_name, checkpoint_id, mp, known, replay=known.load(storage, checkpoint_id),
                          fence=fence)
    restoring = storage.load_savepoint(savepoint) if savepoint is not None else None
    if restoring is not None:
        storage.check_complete(restoring)
    cid = _next_checkpoint_id(known, restoring, savepoint, checkpoint_id, streaming)
    if streaming is not None and cid in known.ids:
        return BatchStart(storage, job_name, cid, mp, known, replay=known.load(storage, cid), fence=fence,
                          streaming=streaming)
    previous = restoring if restoring is not None else known.latest
    if previous is not None:
        check_restore_max_parallelism(previous, mp)
    return BatchStart(storage, job_name, cid, mp, known, previous=previous, savepoint=savepoint, fence=fence,
                      streaming=streaming)


def begin_batch(storage: CheckpointStorage, *, job_name: str, max_parallelism: int, parallelism: int,
                checkpoint_id: int | None = None, fence: DriverFence | None = None,
                savepoint: str | None = None, assignment: Assignment | None = None,
                streaming: StreamingBatch | None = None, known: Checkpoints | None = None) -> BatchPlan:
    """Plan the next micro-batch of job ``job_name`` at ``parallelism``.

    Without ``checkpoint_id`` the batch becomes the checkpoint after the latest complete one. With one (e.g. Spark's
    streaming batch id) the batch is idempotent: if that checkpoint is already complete, the plan's ``replay`` holds
    it; an id older than the latest complete checkpoint is refused. ``max_parallelism`` may differ from the restore
    point's by an integer factor (its subtasks re-key the state as they restore it, and write it full);
    StateMigrationError naming the allowed values for any other change. With a ``fence``
    (:meth:`DriverFence.claim`), a fenced driver is refused here and again right before its commit.

    With ``savepoint`` (a savepoint's name in ``storage``) the batch restores from that savepoint instead of the
    latest checkpoint, and its id follows both; its subtasks write their state in full (the new checkpoint never
    depends on the savepoint's files, which the user may delete: Flink's no-claim mode).

    ``assignment`` chooses the key-group ranges of the batch's subtasks from the restore point's load figures
    (:mod:`keygroups.runtime.assignment`; default :class:`~keygroups.runtime.assignment.FlinkRanges`, Flink's
    equal ranges); the plan's ``boundaries`` and ``assignment`` (the decision) say which and why.

    ``streaming`` (instead of ``checkpoint_id``): the batch is Structured Streaming batch ``streaming`` and its
    checkpoint id follows from it (see :class:`StreamingBatch`): idempotent as with an explicit id, and continuing a
    location's checkpoints or a savepoint whatever id Spark's first batch has. ``known``: see
    :func:`locate_batch`."""
    check_parallelism(parallelism, max_parallelism)
    return locate_batch(storage, job_name=job_name, max_parallelism=max_parallelism, checkpoint_id=checkpoint_id,
                        fence=fence, savepoint=savepoint, streaming=streaming, known=known
                        ).plan(parallelism, assignment)


def check_restored_states(function: bytes, metadata: CheckpointMetadata, *, key_type: Any,
                          job_name: str, max_parallelism: int, allow_pickle: bool, checkpoint_id: int) -> None:
    """Run the job's ``open`` on the driver against an empty heap backend that holds only ``metadata``'s state
    metas (no state is read): every state it declares is matched with the restored one as a task would match it, so
    a changed kind, TTL, key or value serializer raises StateMigrationError (and stored pickled serializers without
    ``allow_pickle`` UnsafeDeserializationError) before any task starts. States a function declares only while
    processing records are checked by the tasks, as before; any other error of ``open`` is left for the tasks to
    raise where it belongs."""
    metas: dict[str, dict[str, Any]] = {}
    for handle in sorted(metadata.keyed_handles, key=lambda h: h.checkpoint_id):
        for meta in handle.states:
            metas[meta["name"]] = meta
    if not metas:
        return
    user = pickle.loads(function)   # the job's own function, pickled by this driver: never bytes from a checkpoint
    everything = key_group_range(max_parallelism, 1, 0)
    with create_backend("heap", everything, max_parallelism, key_type, allow_pickle=allow_pickle) as backend:
        for meta in metas.values():
            backend._restore_target(meta)   # as a restore meets each state: the key serializer checked
        try:
            user.open(RuntimeContext(backend, job_name=job_name, subtask_index=0, parallelism=1,
                                     max_parallelism=max_parallelism, checkpoint_id=checkpoint_id))
        except (StateMigrationError, UnsafeDeserializationError):
            raise
        except Exception:   # noqa: BLE001  # open may need what only an executor has: the tasks will say
            return


def _exactly_one_per_subtask(reports: Sequence[Any], parallelism: int, what: str, checkpoint_id: int,
                             ranges: Sequence[KeyGroupRange] | None = None) -> list[Any]:
    ordered = sorted(reports, key=lambda r: r.subtask)
    got = [r.subtask for r in ordered]
    if got != list(range(parallelism)):
        raise KeyGroupsError(
            f"checkpoint {checkpoint_id}: {what} reports came from subtasks {got}, but exactly one from each of "
            f"0..{parallelism - 1} is needed; nothing was committed"
        )
    for r, own in zip(ordered, ranges or ()):
        if r.key_group_range != own:
            raise KeyGroupsError(
                f"checkpoint {checkpoint_id}: subtask {r.subtask} ran with key groups "
                f"[{r.key_group_range.start}, {r.key_group_range.end}], but the batch was planned with {own}; "
                "nothing was committed")
    return ordered


def timer_summary(reports: Sequence[SubtaskReport]) -> dict[TimeDomain, TimerFigures]:
    """Per time domain, the subtasks' timer figures together (see :class:`~keygroups.runtime.report.TimerFigures`:
    registered and fired this batch, registered after it, queued, the earliest still registered)."""
    return {domain: TimerFigures.total(r.timers[domain] for r in reports if domain in r.timers)
            for domain in TimeDomain}


def commit_batch(plan: BatchPlan, keyed_reports: Sequence[SubtaskReport],
                 source_reports: Sequence[SourceReport] = (), *, properties: Mapping[str, Any] | None = None,
                 watermark: int | None = None, input_digest: InputDigest | None = None,
                 savepoint_lineage: str | None = None, parallelism_policy: PolicyChoice | None = None,
                 driver_seconds: Mapping[str, float] | None = None, prune: bool = True) -> CheckpointMetadata:
    """Commit the planned checkpoint from its subtasks' reports: their keyed and operator handles, output and
    staged input files, and figures (:class:`~keygroups.runtime.properties.BatchProperties`, beside the caller's own
    ``properties``). Raw keyed state (a report's ``raw_keyed_handle``) is written whole every checkpoint, so only the
    new handles are listed. Refuses (raises, committing nothing) unless each subtask reported exactly once, with the
    key groups it was planned with; ConcurrentCommitError when another writer committed this id, or any checkpoint
    after the one the batch was planned from, while the batch ran (compare-and-swap: the commit succeeds only if
    ``plan.planned_from`` is still the newest complete checkpoint, so a batch built on a stale restore point never
    hides another driver's batch). This holds with and without a :class:`DriverFence`, on local disk and on object
    stores (see :meth:`CheckpointStorage.commit`); the fence additionally refuses a driver once a newer one has
    started, before its batch runs. ``prune=False`` leaves retention to the caller
    (:meth:`CheckpointStorage.prune`, off the batch's critical path).

    Keyed handles are incremental: the checkpoint lists the new ones (a subtask that changed nothing may report
    none) and every handle of the restored checkpoint that some key group's chain still needs (``carry_forward``).

    Stored (see :mod:`keygroups.runtime.properties`): the watermark ``watermark`` (the batch's, as its subtasks got
    it; None keeps the restore point's), which the next batch starts from, and the one the batch started with; the
    batch's processing time; the timer figures; the late records; the reports; the ranges, the per key group load
    figures (the restored checkpoint's, decayed, plus this batch's) and the assignment's decision; the streaming
    batch; ``input_digest``, ``savepoint_lineage``, ``parallelism_policy`` and ``driver_seconds``."""
    if plan.replay is not None:
        raise KeyGroupsError(f"checkpoint {plan.checkpoint_id} is already complete: a replayed batch commits nothing")
    cid, p = plan.checkpoint_id, plan.parallelism
    keyed: list[SubtaskReport] = _exactly_one_per_subtask(keyed_reports, p, "keyed", cid, plan.ranges)
    boundaries = plan.boundaries or flink_boundaries(plan.max_parallelism, p)
    sources: list[SourceReport] = (_exactly_one_per_subtask(source_reports, p, "source", cid)
                                   if source_reports else [])
    figures = BatchProperties(
        watermark=plan.start_watermark if watermark is None else max(plan.start_watermark, watermark),
        start_watermark=plan.start_watermark, processing_time=plan.processing_time, timers=timer_summary(keyed),
        records_late=sum(r.records_late for r in keyed), reports=tuple(keyed), source_reports=tuple(sources),
        ranges=tuple(boundaries),
        loads=merged_loads(plan.previous, keyed, plan.max_parallelism, boundaries, plan.load_half_life),
        decision_json=plan.assignment.to_json() if plan.assignment is not None else None,
        streaming=plan.streaming, input_digest=input_digest, savepoint_lineage=savepoint_lineage,
        parallelism_policy=parallelism_policy, driver_seconds=dict(driver_seconds or {}),
        extra=dict(properties or {}))
    metadata = CheckpointMetadata(
        checkpoint_id=cid,
        job_id=plan.job_name,
        timestamp_ms=int(time.time() * 1000),
        max_parallelism=plan.max_parallelism,
        parallelism=p,
        keyed_handles=carry_forward(plan.previous, [r.keyed_handle for r in keyed if r.keyed_handle is not None],
                                    max_parallelism=plan.max_parallelism),
        operator_handles=[r.operator_handle for r in sources if r.operator_handle is not None],
        # raw keyed state is written whole every checkpoint: nothing of the previous one carries forward
        raw_keyed_handles=[r.raw_keyed_handle for r in keyed if r.raw_keyed_handle is not None],
        properties=figures.encode(),
        outputs=[r.output_file for r in keyed if r.output_file is not None],   # None: to the sink only
        inputs=[r.input_file for r in sources if r.input_file],
        late_outputs=[r.late_file for r in keyed if r.late_file],
    )
    if plan.fence is not None:
        try:
            plan.fence.check()
        except DriverFencedError:
            plan.storage.discard(metadata)
            raise
    try:
        plan.storage.commit(metadata, planned_from=plan.planned_from, prune=prune,
                            encoded=encoded_metadata(metadata, f"chk-{cid}"))
    except ConcurrentCommitError:
        raise
    except ValueError as e:
        # Another driver committed a newer checkpoint while this batch ran (and its retention may have removed
        # this batch's files): the same lost race as a commit of the same id, so the same error, which tells the
        # caller to plan its input again from the latest checkpoint rather than give up.
        newer = [i for i in plan.storage.checkpoint_ids() if i >= cid]
        if not newer:
            raise
        raise ConcurrentCommitError(
            f"checkpoint {cid} cannot be committed: another writer committed checkpoints {newer} in "
            f"{plan.storage.location} while this batch (restored from checkpoint {plan.restore_from}) ran; nothing "
            f"of it was published ({e}). Two drivers must not run one job on one checkpoint location at once; to "
            "apply this input, plan a new batch from the latest checkpoint") from e
    return metadata


__all__ = ["BatchPlan", "BatchStart", "Checkpoints", "DriverFence", "StreamingBatch", "begin_batch",
           "check_key_columns", "check_output_schema", "check_restored_states", "commit_batch", "encoded_metadata",
           "locate_batch", "timer_summary"]
