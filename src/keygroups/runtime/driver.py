"""The driver's half of a micro-batch, independent of Spark: plan the batch, then commit what its subtasks reported.

:func:`begin_batch` picks the next checkpoint id (or finds that an explicitly numbered batch is already complete:
an idempotent replay), refuses a max parallelism that is not the restore point's multiplied or divided by an integer
factor (:func:`~keygroups.checkpoint.planning.check_restore_max_parallelism`), and returns a
:class:`BatchPlan`: the checkpoint to restore, the task specs every subtask gets, and which subtasks still have to
run. The caller runs the subtasks (Spark tasks, or plain calls in tests) and hands their reports to
:func:`commit_batch`, which builds the checkpoint's metadata and commits it only if each subtask reported exactly
once. Until then the checkpoint does not exist, so a failed batch can simply run again.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa

from keygroups._ranges import KeyGroupRange, check_parallelism, flink_boundaries, ranges_of
from keygroups.checkpoint import (
    CheckpointMetadata,
    CheckpointStorage,
    KeyedStateHandle,
    OperatorStateHandle,
    RawKeyedStateHandle,
)
from keygroups.checkpoint.planning import carry_forward, check_restore_max_parallelism
from keygroups.errors import ConcurrentCommitError, DriverFencedError, KeyGroupsError
from keygroups.runtime.assignment import (
    CALLS_REPORT,
    DECISION_PROPERTY,
    DEFAULT_HALF_LIFE,
    LOADS_PROPERTY,
    RANGES_PROPERTY,
    RECORDS_REPORT,
    TIMERS_REPORT,
    Assignment,
    AssignmentDecision,
    FlinkRanges,
    merged_loads,
)
from keygroups.runtime.source import Source, SourceTaskSpec, prepared_source
from keygroups.runtime.subtask import KeyedTaskSpec, StateBackendName, key_type_for_schema
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
class BatchPlan:
    """One micro-batch as the driver planned it: checkpoint ``checkpoint_id`` at ``parallelism``, restoring from
    ``previous`` (None: the job starts without state).

    ``replay`` is set when ``checkpoint_id`` was given and is already complete: nothing runs, the caller returns
    that checkpoint's committed output instead."""

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

    def at_parallelism(self, parallelism: int, assignment: Assignment | None = None) -> BatchPlan:
        """This plan at another ``parallelism`` (a policy chose it once the batch's input was counted), with its
        ranges chosen again by ``assignment`` (default: Flink's) from the same restore point."""
        p, mp = check_parallelism(parallelism, self.max_parallelism)
        if self.replay is not None:
            return dataclasses.replace(self, parallelism=p)
        chooser = assignment if assignment is not None else FlinkRanges()
        decision = chooser.choose(self.previous, mp, p)
        return dataclasses.replace(self, parallelism=p, boundaries=decision.boundaries, assignment=decision,
                                   load_half_life=getattr(chooser, "half_life", DEFAULT_HALF_LIFE))

    @property
    def ranges(self) -> list[KeyGroupRange]:
        """The key groups each subtask owns this batch."""
        return ranges_of(self.boundaries or flink_boundaries(self.max_parallelism, self.parallelism))

    @property
    def start_watermark(self) -> int:
        """The watermark the restore point committed (``NO_WATERMARK`` before any event time): this batch's records
        at or before it are late."""
        if self.previous is None:
            return NO_WATERMARK
        watermark = self.previous.properties.get("watermark", NO_WATERMARK)
        return watermark if isinstance(watermark, int) and not isinstance(watermark, bool) else NO_WATERMARK

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
                   late_records: LateRecords = "drop") -> KeyedTaskSpec:
        """What every keyed subtask of this batch gets; ``function`` is the job's KeyedProcessFunction, pickled;
        ``local_dir`` is the executors' directory for warm state (None: the system temporary directory);
        ``warm_heap_backends`` how many heap backends a worker process keeps between batches (0: none);
        ``watermark`` the batch's watermark once its records are in (see
        :meth:`~keygroups.runtime.watermarks.WatermarkStrategy.next_watermark`; never below ``start_watermark``;
        None keeps it); ``late_records`` what happens to records at or before ``start_watermark``."""
        start = self.start_watermark
        return KeyedTaskSpec(
            job_name=self.job_name, key_columns=key_columns, key_type=key_type_for_schema(input_schema, key_columns),
            function=function, input_schema=input_schema, output_schema=output_schema,
            max_parallelism=self.max_parallelism, parallelism=self.parallelism,
            checkpoint_location=self.storage.location, checkpoint_id=self.checkpoint_id,
            restore_from=self.restore_from, backend=backend, order_columns=order_columns,
            timestamp_column=timestamp_column, storage_options=self.storage.storage_options,
            allow_pickle=allow_pickle, local_dir=local_dir, warm_heap_backends=warm_heap_backends,
            start_watermark=start, watermark=start if watermark is None else max(start, watermark),
            processing_time=self.processing_time, late_records=late_records, key_group_boundaries=self.boundaries,
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

    def idle_subtasks(self, reports: Sequence[dict[str, Any]]) -> list[int]:
        """The subtasks without a report: they had no records (Spark runs no task for a partition it knows is empty),
        but must still run, with none, to carry their key groups' state into the new checkpoint."""
        return sorted(set(range(self.parallelism)) - {r["subtask"] for r in reports})


def _next_checkpoint_id(storage: CheckpointStorage, newest: int | None, checkpoint_id: int | None) -> int:
    """The id of the coming checkpoint: ``checkpoint_id`` if given (checked), else one past ``newest``, the id of
    the latest complete checkpoint (or of the savepoint restored from, if newer)."""
    if checkpoint_id is None:
        return newest + 1 if newest is not None else 1
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int) or checkpoint_id < 0:
        raise ValueError(f"checkpoint_id must be an int >= 0, got {checkpoint_id!r}")
    if newest is not None and checkpoint_id <= newest and checkpoint_id not in storage.checkpoint_ids():
        raise KeyGroupsError(
            f"checkpoint {checkpoint_id} is older than the latest complete checkpoint {newest} "
            f"and is no longer retained (retained: {storage.checkpoint_ids()}): it cannot be replayed"
        )
    return checkpoint_id


def begin_batch(storage: CheckpointStorage, *, job_name: str, max_parallelism: int, parallelism: int,
                checkpoint_id: int | None = None, fence: DriverFence | None = None,
                savepoint: str | None = None, assignment: Assignment | None = None) -> BatchPlan:
    """Plan the next micro-batch of job ``job_name`` at ``parallelism``.

    Without ``checkpoint_id`` the batch becomes the checkpoint after the latest complete one. With one (e.g. Spark's
    streaming batch id) the batch is idempotent: if that checkpoint is already complete, the plan's ``replay`` holds
    it; an id older than the latest complete checkpoint is refused. ``max_parallelism`` may differ from the restore
    point's by an integer factor (its subtasks re-key the state as they restore it, and write it full);
    StateMigrationError naming the allowed values for any other change. With a ``fence`` (:meth:`DriverFence.claim`), a fenced driver is refused
    here and again right before its commit.

    With ``savepoint`` (a savepoint's name in ``storage``) the batch restores from that savepoint instead of the
    latest checkpoint, and its id follows both; its subtasks write their state in full (the new checkpoint never
    depends on the savepoint's files, which the user may delete: Flink's no-claim mode).

    ``assignment`` chooses the key-group ranges of the batch's subtasks from the restore point's load figures
    (:mod:`keygroups.runtime.assignment`; default :class:`~keygroups.runtime.assignment.FlinkRanges`, Flink's
    equal ranges); the plan's ``boundaries`` and ``assignment`` (the decision) say which and why."""
    p, mp = check_parallelism(parallelism, max_parallelism)
    if fence is not None:
        fence.check()
    storage.finish_interrupted_commit()   # a checkpoint claimed by a writer that died before publishing it
    if checkpoint_id is not None and checkpoint_id in storage.checkpoint_ids():
        return BatchPlan(storage, job_name, checkpoint_id, mp, p, previous=None, replay=storage.load(checkpoint_id),
                         fence=fence)
    latest = storage.latest()
    previous = storage.load_savepoint(savepoint) if savepoint is not None else latest
    if previous is not None:
        check_restore_max_parallelism(previous, mp)
    newest = max([c.checkpoint_id for c in (latest, previous) if c is not None], default=None)
    chooser = assignment if assignment is not None else FlinkRanges()
    decision = chooser.choose(previous, mp, p)
    return BatchPlan(storage, job_name, _next_checkpoint_id(storage, newest, checkpoint_id), mp, p, previous,
                     fence=fence, savepoint=savepoint, planned_from=None if latest is None else latest.checkpoint_id,
                     boundaries=decision.boundaries, assignment=decision,
                     load_half_life=getattr(chooser, "half_life", DEFAULT_HALF_LIFE))


def _exactly_one_per_subtask(reports: Sequence[dict[str, Any]], parallelism: int, what: str,
                             checkpoint_id: int, ranges: Sequence[KeyGroupRange] | None = None
                             ) -> list[dict[str, Any]]:
    ordered = sorted(reports, key=lambda r: r["subtask"])
    got = [r["subtask"] for r in ordered]
    if got != list(range(parallelism)):
        raise KeyGroupsError(
            f"checkpoint {checkpoint_id}: {what} reports came from subtasks {got}, but exactly one from each of "
            f"0..{parallelism - 1} is needed; nothing was committed"
        )
    for r, own in zip(ordered, ranges or ()):
        if "key_group_range" in r and r["key_group_range"] != [own.start, own.end]:
            raise KeyGroupsError(
                f"checkpoint {checkpoint_id}: subtask {r['subtask']} ran with key groups {r['key_group_range']}, "
                f"but the batch was planned with {own}; nothing was committed")
    return ordered


def timer_summary(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per time domain, over the subtasks' reports: timers queued (registered, plus deleted ones not yet dropped),
    registered and fired this batch, and the earliest still registered (None: none)."""
    summary: dict[str, Any] = {}
    for domain in TimeDomain:
        parts = [r["timers"][domain.value] for r in reports if r.get("timers")]
        earliest = [p["earliest"] for p in parts if p.get("earliest") is not None]
        summary[domain.value] = {
            "queued": sum(p.get("queued", 0) for p in parts),
            "registered": sum(p.get("registered", 0) for p in parts),
            "fired": sum(p.get("fired", 0) for p in parts),
            "earliest": min(earliest) if earliest else None,
        }
    return summary


#: What a report holds that the checkpoint keeps elsewhere: handles, and the per key group counts (merged into
#: ``properties[LOADS_PROPERTY]``).
_NOT_IN_PROPERTIES = frozenset({"keyed_handle", "raw_keyed_handle", RECORDS_REPORT, CALLS_REPORT, TIMERS_REPORT})


def commit_batch(plan: BatchPlan, keyed_reports: Sequence[dict[str, Any]],
                 source_reports: Sequence[dict[str, Any]] = (), *,
                 properties: dict[str, Any] | None = None, watermark: int | None = None) -> CheckpointMetadata:
    """Commit the planned checkpoint from its subtasks' reports: their keyed and operator handles, output and
    staged input files, and figures (``properties["reports"]``, ``["source_reports"]``, beside ``properties``).
    Raw keyed state (``raw_keyed_handle`` in a report) is written whole every checkpoint, so only the new handles
    are listed. Refuses (raises, committing nothing) unless each subtask reported exactly once; ConcurrentCommitError when
    another writer committed this id, or any checkpoint after the one the batch was planned from, while the batch ran
    (compare-and-swap: the commit succeeds only if ``plan.planned_from`` is still the newest complete checkpoint, so
    a batch built on a stale restore point never hides another driver's batch). This holds with and without a
    :class:`DriverFence`, on local disk and on object stores (see :meth:`CheckpointStorage.commit`); the fence
    additionally refuses a driver once a newer one has started, before its batch runs.

    Keyed handles are incremental: the checkpoint lists the new ones (a subtask that changed nothing may report
    none) and every handle of the restored checkpoint that some key group's chain still needs (``carry_forward``).

    Time: ``properties["watermark"]`` is ``watermark`` (the batch's, as its subtasks got it; None keeps the restore
    point's), which the next batch starts from; ``["processing_time"]`` the batch's; ``["timers"]`` the
    :func:`timer_summary`; ``["records_late"]`` how many records were late.

    Ranges: ``properties[RANGES_PROPERTY]`` are the batch's ranges (boundaries), ``[LOADS_PROPERTY]`` the per key
    group load figures (the restored checkpoint's, decayed, plus this batch's), ``[DECISION_PROPERTY]`` why the
    ranges are what they are (see :mod:`keygroups.runtime.assignment`). A report whose ``key_group_range`` is not
    its planned range is refused."""
    if plan.replay is not None:
        raise KeyGroupsError(f"checkpoint {plan.checkpoint_id} is already complete: a replayed batch commits nothing")
    cid, p = plan.checkpoint_id, plan.parallelism
    keyed = _exactly_one_per_subtask(keyed_reports, p, "keyed", cid, plan.ranges)
    boundaries = plan.boundaries or flink_boundaries(plan.max_parallelism, p)
    sources = _exactly_one_per_subtask(source_reports, p, "source", cid) if source_reports else []
    metadata = CheckpointMetadata(
        checkpoint_id=cid,
        job_id=plan.job_name,
        timestamp_ms=int(time.time() * 1000),
        max_parallelism=plan.max_parallelism,
        parallelism=p,
        keyed_handles=carry_forward(plan.previous, [KeyedStateHandle.from_json(r["keyed_handle"]) for r in keyed
                                                    if r.get("keyed_handle")], max_parallelism=plan.max_parallelism),
        operator_handles=[OperatorStateHandle.from_json(r["operator_handle"]) for r in sources
                          if r.get("operator_handle")],
        # raw keyed state is written whole every checkpoint: nothing of the previous one carries forward
        raw_keyed_handles=[RawKeyedStateHandle.from_json(r["raw_keyed_handle"]) for r in keyed
                           if r.get("raw_keyed_handle")],
        properties={
            **(properties or {}),
            "watermark": plan.start_watermark if watermark is None else max(plan.start_watermark, watermark),
            "processing_time": plan.processing_time,
            "timers": timer_summary(keyed),
            "records_late": sum(r.get("records_late", 0) for r in keyed),
            "reports": [{k: v for k, v in r.items() if k not in _NOT_IN_PROPERTIES} for r in keyed],
            RANGES_PROPERTY: list(boundaries),
            LOADS_PROPERTY: merged_loads(plan.previous, keyed, plan.max_parallelism, boundaries,
                                         plan.load_half_life),
            **({DECISION_PROPERTY: plan.assignment.to_json()} if plan.assignment is not None else {}),
            "source_reports": [{k: v for k, v in r.items() if k != "operator_handle"} for r in sources],
        },
        outputs=[r["output_file"] for r in keyed],
        inputs=[r["input_file"] for r in sources if r.get("input_file")],
        late_outputs=[r["late_file"] for r in keyed if r.get("late_file")],
    )
    if plan.fence is not None:
        try:
            plan.fence.check()
        except DriverFencedError:
            plan.storage.discard(metadata)
            raise
    try:
        plan.storage.commit(metadata, planned_from=plan.planned_from)
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
