"""The driver's half of a micro-batch, independent of Spark: plan the batch, then commit what its subtasks reported.

:func:`begin_batch` picks the next checkpoint id (or finds that an explicitly numbered batch is already complete:
an idempotent replay), refuses a max parallelism other than the latest checkpoint's, and returns a
:class:`BatchPlan`: the checkpoint to restore, the task specs every subtask gets, and which subtasks still have to
run. The caller runs the subtasks (Spark tasks, or plain calls in tests) and hands their reports to
:func:`commit_batch`, which builds the checkpoint's metadata and commits it only if each subtask reported exactly
once. Until then the checkpoint does not exist, so a failed batch can simply run again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from keygroups._ranges import check_parallelism
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, KeyedStateHandle, OperatorStateHandle
from keygroups.checkpoint.planning import carry_forward, check_restore_max_parallelism
from keygroups.errors import ConcurrentCommitError, KeyGroupsError
from keygroups.runtime.source import SourceTaskSpec
from keygroups.runtime.subtask import KeyedTaskSpec, key_type_for_schema


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

    @property
    def restore_from(self) -> int | None:
        """The id of the checkpoint the subtasks restore from, None for the first batch."""
        return self.previous.checkpoint_id if self.previous is not None else None

    def keyed_task(self, *, key_columns: tuple[str, ...], function: bytes, input_schema: pa.Schema,
                   output_schema: pa.Schema, backend: str = "heap", order_columns: tuple[str, ...] = (),
                   timestamp_column: str | None = None, allow_pickle: bool = False,
                   local_dir: str | None = None) -> KeyedTaskSpec:
        """What every keyed subtask of this batch gets; ``function`` is the job's KeyedProcessFunction, pickled;
        ``local_dir`` is the executors' directory for warm state (None: the system temporary directory)."""
        return KeyedTaskSpec(
            job_name=self.job_name, key_columns=key_columns, key_type=key_type_for_schema(input_schema, key_columns),
            function=function, input_schema=input_schema, output_schema=output_schema,
            max_parallelism=self.max_parallelism, parallelism=self.parallelism,
            checkpoint_location=self.storage.location, checkpoint_id=self.checkpoint_id,
            restore_from=self.restore_from, backend=backend, order_columns=order_columns,
            timestamp_column=timestamp_column, storage_options=self.storage.storage_options,
            allow_pickle=allow_pickle, local_dir=local_dir,
        )

    def source_task(self, log_directory: str, *, record_schema: pa.Schema | None,
                    max_records_per_subtask: int | None = None) -> SourceTaskSpec:
        """What every source subtask of this batch gets: read up to ``max_records_per_subtask`` records of its share
        of the log's partitions (all that is left with None)."""
        return SourceTaskSpec(
            log_directory=str(log_directory), record_schema=record_schema, parallelism=self.parallelism,
            max_records=max_records_per_subtask, checkpoint_location=self.storage.location,
            checkpoint_id=self.checkpoint_id, restore_from=self.restore_from,
            storage_options=self.storage.storage_options,
        )

    def idle_subtasks(self, reports: Sequence[dict[str, Any]]) -> list[int]:
        """The subtasks without a report: they had no records (Spark runs no task for a partition it knows is empty),
        but must still run, with none, to carry their key groups' state into the new checkpoint."""
        return sorted(set(range(self.parallelism)) - {r["subtask"] for r in reports})


def _next_checkpoint_id(storage: CheckpointStorage, previous: CheckpointMetadata | None,
                        checkpoint_id: int | None) -> int:
    if checkpoint_id is None:
        return previous.checkpoint_id + 1 if previous is not None else 1
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int) or checkpoint_id < 0:
        raise ValueError(f"checkpoint_id must be an int >= 0, got {checkpoint_id!r}")
    if previous is not None and checkpoint_id < previous.checkpoint_id:
        raise KeyGroupsError(
            f"checkpoint {checkpoint_id} is older than the latest complete checkpoint {previous.checkpoint_id} "
            f"and is no longer retained (retained: {storage.checkpoint_ids()}): it cannot be replayed"
        )
    return checkpoint_id


def begin_batch(storage: CheckpointStorage, *, job_name: str, max_parallelism: int, parallelism: int,
                checkpoint_id: int | None = None) -> BatchPlan:
    """Plan the next micro-batch of job ``job_name`` at ``parallelism``.

    Without ``checkpoint_id`` the batch becomes the checkpoint after the latest complete one. With one (e.g. Spark's
    streaming batch id) the batch is idempotent: if that checkpoint is already complete, the plan's ``replay`` holds
    it; an id older than the latest complete checkpoint is refused. StateMigrationError if ``max_parallelism``
    differs from the latest checkpoint's."""
    p, mp = check_parallelism(parallelism, max_parallelism)
    if checkpoint_id is not None and checkpoint_id in storage.checkpoint_ids():
        return BatchPlan(storage, job_name, checkpoint_id, mp, p, previous=None, replay=storage.load(checkpoint_id))
    previous = storage.latest()
    if previous is not None:
        check_restore_max_parallelism(previous, mp)
    return BatchPlan(storage, job_name, _next_checkpoint_id(storage, previous, checkpoint_id), mp, p, previous)


def _exactly_one_per_subtask(reports: Sequence[dict[str, Any]], parallelism: int, what: str,
                             checkpoint_id: int) -> list[dict[str, Any]]:
    ordered = sorted(reports, key=lambda r: r["subtask"])
    got = [r["subtask"] for r in ordered]
    if got != list(range(parallelism)):
        raise KeyGroupsError(
            f"checkpoint {checkpoint_id}: {what} reports came from subtasks {got}, but exactly one from each of "
            f"0..{parallelism - 1} is needed; nothing was committed"
        )
    return ordered


def commit_batch(plan: BatchPlan, keyed_reports: Sequence[dict[str, Any]],
                 source_reports: Sequence[dict[str, Any]] = (), *,
                 properties: dict[str, Any] | None = None) -> CheckpointMetadata:
    """Commit the planned checkpoint from its subtasks' reports: their keyed and operator handles, output and
    staged input files, and figures (``properties["reports"]``, ``["source_reports"]``, beside ``properties``).
    Refuses (raises, committing nothing) unless each subtask reported exactly once; ConcurrentCommitError when
    another writer committed this id, or a newer one, while the batch ran.

    Keyed handles are incremental: the checkpoint lists the new ones (a subtask that changed nothing may report
    none) and every handle of the restored checkpoint that some key group's chain still needs (``carry_forward``)."""
    if plan.replay is not None:
        raise KeyGroupsError(f"checkpoint {plan.checkpoint_id} is already complete: a replayed batch commits nothing")
    cid, p = plan.checkpoint_id, plan.parallelism
    keyed = _exactly_one_per_subtask(keyed_reports, p, "keyed", cid)
    sources = _exactly_one_per_subtask(source_reports, p, "source", cid) if source_reports else []
    metadata = CheckpointMetadata(
        checkpoint_id=cid,
        job_id=plan.job_name,
        timestamp_ms=int(time.time() * 1000),
        max_parallelism=plan.max_parallelism,
        parallelism=p,
        keyed_handles=carry_forward(plan.previous, [KeyedStateHandle.from_json(r["keyed_handle"]) for r in keyed
                                                    if r.get("keyed_handle")]),
        operator_handles=[OperatorStateHandle.from_json(r["operator_handle"]) for r in sources
                          if r.get("operator_handle")],
        properties={
            **(properties or {}),
            "reports": [{k: v for k, v in r.items() if k != "keyed_handle"} for r in keyed],
            "source_reports": [{k: v for k, v in r.items() if k != "operator_handle"} for r in sources],
        },
        outputs=[r["output_file"] for r in keyed],
        inputs=[r["input_file"] for r in sources if r.get("input_file")],
    )
    try:
        plan.storage.commit(metadata)
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
