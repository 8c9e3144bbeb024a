"""What a job's checkpoint keeps beside its state, in ``_metadata``'s ``properties``: one codec, one version.

:class:`BatchProperties` is written (:meth:`~BatchProperties.encode`) by the driver's commit and read
(:meth:`~BatchProperties.of`) by everything that reads a batch back: the next batch's plan (its watermark, ranges,
load figures, streaming batch, savepoint lineage), a replay (its input digest), the report. Its keys, and what each
holds::

    properties_version      2 (absent: version 1, written before this codec; read the same, see below)
    watermark               the batch's watermark (epoch ms; NO_WATERMARK before any event time)
    start_watermark         the watermark the batch started with
    processing_time         the batch's processing time (epoch ms)
    timers                  per time domain: registered, fired, pending (after the batch), queued, earliest
    records_late            records at or before start_watermark
    reports                 every keyed subtask's report, without handles and counts (SubtaskReport.stored)
    source_reports          every source subtask's report, without its handle (SourceReport.stored)
    key_group_ranges        the batch's ranges as boundaries (keygroups.runtime.assignment)
    key_group_loads         per key group load figures (keygroups.runtime.assignment), compact arrays
    key_group_assignment    why the ranges are what they are (AssignmentDecision.to_json)
    streaming_batch         the Structured Streaming batch the checkpoint is (StreamingBatch)
    input_digest            the records' count and xxhash64 sum, checked when the batch is replayed
    started_from_savepoint  the savepoint the job's checkpoints descend from (restore_from_savepoint)
    parallelism_policy      what a parallelism policy saw and chose
    driver_seconds          the driver's read and plan seconds

Any other key is the caller's own (``KeyedJob.run_batch(properties=...)``, or another writer's, such as
``write_savepoint``'s key columns) and is kept as it is, in ``extra``. Version 1 lacks the version key, the timers'
``pending`` figure and, in early reports, the per-key-group restore runs; those read as unknown (None).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from keygroups.errors import CorruptSnapshotError
from keygroups.runtime.assignment import (
    DECISION_PROPERTY,
    LOADS_PROPERTY,
    RANGES_PROPERTY,
    AssignmentDecision,
    checkpoint_boundaries,
)
from keygroups.runtime.report import InputDigest, SourceReport, SubtaskReport, TimerFigures
from keygroups.state.timers import NO_WATERMARK, TimeDomain

#: The version this keygroups writes, and the key that holds it.
PROPERTIES_VERSION = 2
VERSION_PROPERTY = "properties_version"
STREAMING_PROPERTY = "streaming_batch"
LINEAGE_PROPERTY = "started_from_savepoint"

_KNOWN = frozenset({VERSION_PROPERTY, "watermark", "start_watermark", "processing_time", "timers", "records_late",
                    "reports", "source_reports", RANGES_PROPERTY, LOADS_PROPERTY, DECISION_PROPERTY,
                    STREAMING_PROPERTY, "input_digest", LINEAGE_PROPERTY, "parallelism_policy", "driver_seconds"})


@dataclass(frozen=True)
class StreamingBatch:
    """A Structured Streaming micro-batch as ``foreachBatch`` hands it over: Spark's ``batch_id`` and the id of the
    query it belongs to (``query_id``; None where Spark does not say, as over Spark Connect).

    Spark numbers a query's batches from 0 and replays the last one after a failure; a checkpoint location outlives
    queries (a job continued from a savepoint, a query started again with a new Spark checkpoint). So a batch's
    checkpoint id is Spark's batch id plus an offset fixed by the first batch of a query on the location: 0 when the
    location has no checkpoint and no savepoint is restored (the checkpoint id is the batch id), else whatever puts
    the query's first batch right after the newest checkpoint or restored savepoint. Every checkpoint records its
    batch (``properties["streaming_batch"]``), so the same query, restarted, finds its offset again: a replayed
    batch maps to the checkpoint that committed it (and returns that checkpoint's output), the next one to the next
    id. Where a query id is missing (on either side), a batch continues the query of the latest checkpoint when it
    is that checkpoint's batch again (a replay) or the one after it."""

    batch_id: int
    query_id: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.batch_id, bool) or not isinstance(self.batch_id, int) or self.batch_id < 0:
            raise ValueError(f"a streaming batch id must be an int >= 0, got {self.batch_id!r}")
        if self.query_id is not None and (not isinstance(self.query_id, str) or not self.query_id):
            raise ValueError(f"a streaming query id must be a non-empty str or None, got {self.query_id!r}")

    def to_json(self) -> dict[str, Any]:
        return {"query": self.query_id, "batch_id": self.batch_id}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StreamingBatch:
        return cls(d["batch_id"], d.get("query"))

    @classmethod
    def committed_by(cls, metadata: Any) -> StreamingBatch | None:
        """The batch checkpoint ``metadata`` committed (None: not a streaming batch's checkpoint, one written
        before batches were recorded, or no checkpoint)."""
        return None if metadata is None else BatchProperties.of(metadata).streaming

    def continues(self, committed: StreamingBatch) -> bool:
        """Whether this batch belongs to the query that committed ``committed``: the same query id; where either
        has none, the same batch again (a replay) or the next one."""
        if self.query_id is not None and committed.query_id is not None:
            return self.query_id == committed.query_id
        return self.batch_id - committed.batch_id in (0, 1)

    def describe(self) -> str:
        query = f"query {self.query_id}" if self.query_id is not None else "a streaming query"
        return f"batch {self.batch_id} of {query}"


@dataclass(frozen=True)
class PolicyChoice:
    """What a parallelism policy saw (``records``) and chose (``chose``); ``policy`` is its ``repr``."""

    policy: str
    records: int
    chose: int

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "records": self.records, "chose": self.chose}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PolicyChoice:
        return cls(str(d["policy"]), int(d["records"]), int(d["chose"]))

    def __str__(self) -> str:
        return f"{self.policy} chose {self.chose} for {self.records} records"


@dataclass(frozen=True)
class BatchProperties:
    """A job checkpoint's properties, typed (see the module docs for each key). ``decision_json`` and ``loads``
    stay in their stored JSON form: :mod:`keygroups.runtime.assignment` reads them (the decision: with
    :meth:`decision`)."""

    watermark: int = NO_WATERMARK
    start_watermark: int | None = None
    processing_time: int = 0
    timers: Mapping[TimeDomain, TimerFigures] = field(default_factory=dict)
    records_late: int = 0
    reports: tuple[SubtaskReport, ...] = ()
    source_reports: tuple[SourceReport, ...] = ()
    ranges: tuple[int, ...] | None = None
    loads: Mapping[str, Any] | None = None
    decision_json: Mapping[str, Any] | None = None
    streaming: StreamingBatch | None = None
    input_digest: InputDigest | None = None
    savepoint_lineage: str | None = None
    parallelism_policy: PolicyChoice | None = None
    driver_seconds: Mapping[str, float] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    version: int = PROPERTIES_VERSION

    @property
    def parallelism_reason(self) -> str:
        """``"fixed"``, or what the parallelism policy saw and chose."""
        return "fixed" if self.parallelism_policy is None else str(self.parallelism_policy)

    def decision(self, metadata: Any) -> AssignmentDecision | None:
        """The assignment's decision (None: not stored), with ``metadata``'s ranges."""
        if self.decision_json is None:
            return None
        try:
            return AssignmentDecision.from_json(dict(self.decision_json), checkpoint_boundaries(metadata))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptSnapshotError(f"checkpoint {metadata.checkpoint_id}: properties[{DECISION_PROPERTY!r}] is "
                                       f"not an assignment decision: {e}") from None

    def encode(self) -> dict[str, Any]:
        """The JSON ``properties`` of ``_metadata`` (the caller's ``extra`` keys beside keygroups' own)."""
        out: dict[str, Any] = dict(self.extra)
        out.update({
            VERSION_PROPERTY: PROPERTIES_VERSION, "watermark": self.watermark, "processing_time": self.processing_time,
            "timers": {d.value: t.to_json() for d, t in self.timers.items()}, "records_late": self.records_late,
            "reports": [r.stored() for r in self.reports],
            "source_reports": [r.stored() for r in self.source_reports],
        })
        optional = {"start_watermark": self.start_watermark,
                    RANGES_PROPERTY: None if self.ranges is None else list(self.ranges),
                    LOADS_PROPERTY: None if self.loads is None else dict(self.loads),
                    DECISION_PROPERTY: None if self.decision_json is None else dict(self.decision_json),
                    STREAMING_PROPERTY: None if self.streaming is None else self.streaming.to_json(),
                    "input_digest": None if self.input_digest is None else self.input_digest.to_json(),
                    LINEAGE_PROPERTY: self.savepoint_lineage,
                    "parallelism_policy": None if self.parallelism_policy is None else self.parallelism_policy.to_json(),
                    "driver_seconds": dict(self.driver_seconds) if self.driver_seconds else None}
        out.update({k: v for k, v in optional.items() if v is not None})
        return out

    @classmethod
    def decode(cls, properties: Mapping[str, Any], *, checkpoint_id: int | str = "?") -> BatchProperties:
        """The properties of a checkpoint (any version this keygroups wrote; a savepoint or a checkpoint written
        by another writer reads with defaults); CorruptSnapshotError naming the key that is not what it must be."""
        where = f"checkpoint {checkpoint_id}"
        version = properties.get(VERSION_PROPERTY, 1)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise CorruptSnapshotError(f"{where}: properties[{VERSION_PROPERTY!r}] is {version!r}, not a version")
        if version > PROPERTIES_VERSION:
            raise CorruptSnapshotError(f"{where}: its properties are of version {version}, written by a newer "
                                       f"keygroups; this one reads versions 1 to {PROPERTIES_VERSION}")
        key = ""
        try:
            key = "watermark"
            watermark = _int_or(properties.get("watermark"), NO_WATERMARK)
            key = "start_watermark"
            start = properties.get("start_watermark")
            start = None if start is None else _int_or(start, NO_WATERMARK)
            key = "processing_time"
            processing_time = _int_or(properties.get("processing_time"), 0)
            key = "timers"
            timers = {TimeDomain(name): TimerFigures.from_json(t)
                      for name, t in (properties.get("timers") or {}).items()}
            key = "records_late"
            records_late = _int_or(properties.get("records_late"), 0)
            key = "reports"
            reports = tuple(SubtaskReport.from_json(r) for r in properties.get("reports") or ())
            key = "source_reports"
            sources = tuple(SourceReport.from_json(r) for r in properties.get("source_reports") or ())
            key = RANGES_PROPERTY
            ranges = properties.get(RANGES_PROPERTY)
            ranges = None if ranges is None else tuple(int(b) for b in ranges)
            key = LOADS_PROPERTY
            loads = _mapping_or_none(properties.get(LOADS_PROPERTY))
            key = DECISION_PROPERTY
            decision = _mapping_or_none(properties.get(DECISION_PROPERTY))
            key = STREAMING_PROPERTY
            streaming = properties.get(STREAMING_PROPERTY)
            streaming = StreamingBatch.from_json(streaming) if isinstance(streaming, Mapping) else None
            key = "input_digest"
            digest = properties.get("input_digest")
            digest = InputDigest.from_json(digest) if isinstance(digest, Mapping) else None
            key = LINEAGE_PROPERTY
            lineage = properties.get(LINEAGE_PROPERTY)
            if lineage is not None and not isinstance(lineage, str):
                raise TypeError(f"expected a savepoint name, got {lineage!r}")
            key = "parallelism_policy"
            policy = properties.get("parallelism_policy")
            policy = PolicyChoice.from_json(policy) if isinstance(policy, Mapping) else None
            key = "driver_seconds"
            driver = {str(k): float(v) for k, v in (properties.get("driver_seconds") or {}).items()}
        except CorruptSnapshotError as e:
            raise CorruptSnapshotError(f"{where}: properties[{key!r}]: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CorruptSnapshotError(f"{where}: properties[{key!r}] is not what a keygroups checkpoint stores "
                                       f"there ({type(e).__name__}: {e})") from None
        return cls(watermark=watermark, start_watermark=start, processing_time=processing_time, timers=timers,
                   records_late=records_late, reports=reports, source_reports=sources, ranges=ranges, loads=loads,
                   decision_json=decision, streaming=streaming, input_digest=digest, savepoint_lineage=lineage,
                   parallelism_policy=policy, driver_seconds=driver,
                   extra={k: v for k, v in properties.items() if k not in _KNOWN}, version=version)

    @classmethod
    def of(cls, metadata: Any) -> BatchProperties:
        """The properties of ``metadata`` (a :class:`~keygroups.checkpoint.CheckpointMetadata`)."""
        return cls.decode(metadata.properties, checkpoint_id=metadata.checkpoint_id)


def check_user_properties(properties: Mapping[str, Any] | None) -> dict[str, Any]:
    """The caller's own properties for a checkpoint: a JSON object whose keys are not keygroups' own (those are
    refused, naming them: a batch writes them itself)."""
    if properties is None:
        return {}
    if not isinstance(properties, Mapping):
        raise TypeError(f"properties must be a dict of JSON values, got {type(properties).__name__}")
    taken = sorted(k for k in properties if k in _KNOWN)
    if taken:
        raise ValueError(f"properties {taken} are keygroups' own (the batch writes them); give your properties "
                         f"other names. keygroups' own: {sorted(_KNOWN)}")
    return dict(properties)


def _int_or(value: Any, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an int, got {value!r}")
    return value


def _mapping_or_none(value: Any) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


__all__ = ["BatchProperties", "StreamingBatch", "PolicyChoice", "PROPERTIES_VERSION", "check_user_properties"]
