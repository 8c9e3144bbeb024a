"""What a micro-batch did, typed from the task to the user.

A keyed subtask reports a :class:`SubtaskReport` (its handles, files and figures, with a :class:`RestoreInfo`
saying how its state came, its :class:`TimerFigures` per time domain and its :class:`SubtaskSeconds`); a source
subtask a :class:`SourceReport`. Reports travel from a Spark task to the driver as JSON (``to_json``/``from_json``),
and a checkpoint stores them without their handles and per-key-group counts (``stored``); a misspelt field fails
where the report is built, never as a silent 0 where it is read.

:class:`BatchReport` is the batch as a user reads it. Spark's ``StreamingQueryProgress`` is the model (input rows, the
watermark, rows dropped by it, state rows, per-phase durations); Flink's checkpoint statistics add what a rescalable
job needs (how each subtask's state came: warm, caught up or restored cold, and the bytes read and written).
Everything in it comes from the reports, the plan and the driver's clocks: building one opens no state file, so its
cost grows with the number of subtasks and key groups, never with the state.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from keygroups._ranges import KeyGroupRange
from keygroups.checkpoint import KeyedStateHandle, OperatorStateHandle, RawKeyedStateHandle
from keygroups.checkpoint.metadata import key_group_runs
from keygroups.errors import CorruptSnapshotError
from keygroups.runtime.assignment import AssignmentDecision, key_group_state_bytes
from keygroups.runtime.sink import SinkCommittable
from keygroups.state.timers import NO_WATERMARK, TimeDomain

#: How a subtask's state came: ``warm`` (a backend kept from the previous batch, nothing read), ``caught-up``
#: (kept, and the blocks other workers committed since read), ``moved`` (a kept backend of an overlapping range: the
#: key groups still owned stay warm, those that arrived are restored, those that left dropped), ``cold`` (restored
#: from the checkpoint files), ``new`` (nothing to restore: the job's first batch).
RestoreMode = Literal["warm", "caught-up", "moved", "cold", "new"]
_MODES = ("warm", "caught-up", "moved", "cold", "new")

#: The phases a batch's time is reported in, in the order they run.
PHASES = ("read", "plan", "restore", "process", "snapshot", "commit")

_U64 = 1 << 64


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r}")
    return value


def _optional_int(value: Any, what: str) -> int | None:
    return None if value is None else _int(value, what)


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, got {value!r}")
    return float(value)


def _runs(runs: tuple[KeyGroupRange, ...] | None) -> list[list[int]] | None:
    return None if runs is None else [[r.start, r.end] for r in runs]


def _read_runs(value: Any, what: str) -> tuple[KeyGroupRange, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise TypeError(f"{what} must be a list of [start, end] runs, got {value!r}")
    return tuple(KeyGroupRange(_int(a, what), _int(b, what)) for a, b in value)


def runs_size(runs: Iterable[KeyGroupRange] | None) -> int:
    """Key groups in ``runs``."""
    return sum(len(r) for r in runs or ())


# ---- one subtask -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RestoreInfo:
    """How a subtask's state came (``mode``, see :data:`RestoreMode`), the bytes of checkpoint files it read and the
    key groups it read them for; ``warm``: nothing had to be rebuilt (warm, caught up or moved). Which key groups came
    how, as ``[start, end]`` runs of absolute key groups: ``warm_key_groups`` (kept, nothing read),
    ``caught_up_key_groups`` (kept, newer blocks read: ``bytes_caught_up``), ``restored_key_groups`` (read from the
    checkpoint: ``bytes_restored``) and ``dropped_key_groups`` (left for another subtask). The runs are None in
    reports written before they were recorded."""

    mode: RestoreMode
    bytes_read: int = 0
    key_groups: int = 0
    warm: bool = False
    warm_key_groups: tuple[KeyGroupRange, ...] | None = ()
    caught_up_key_groups: tuple[KeyGroupRange, ...] | None = ()
    restored_key_groups: tuple[KeyGroupRange, ...] | None = ()
    dropped_key_groups: tuple[KeyGroupRange, ...] | None = ()
    bytes_caught_up: int = 0
    bytes_restored: int = 0

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"a restore mode is one of {_MODES}, got {self.mode!r}")

    @classmethod
    def new(cls) -> RestoreInfo:
        """Nothing to restore (no checkpoint yet)."""
        return cls("new")

    @classmethod
    def cold(cls, own: KeyGroupRange, bytes_read: int, key_groups: int) -> RestoreInfo:
        """A backend restored whole for its key groups ``own``."""
        runs = (own,) if own else ()
        return cls("cold", int(bytes_read), int(key_groups), False, (), (), runs, (), 0, int(bytes_read))

    @classmethod
    def kept(cls, own: KeyGroupRange, bytes_read: int = 0, key_groups: int = 0) -> RestoreInfo:
        """A backend whose every key group was kept warm (on local disk: it may have read ``bytes_read``)."""
        return cls("warm", int(bytes_read), int(key_groups), True, (own,) if own else (), (), (), (), 0, 0)

    @classmethod
    def resumed(cls, mode: RestoreMode, resume: Any) -> RestoreInfo:
        """A kept backend resumed (``resume``: the :class:`~keygroups.state.warm.WarmResume` of the resume)."""
        return cls(mode, int(resume.bytes_read), int(resume.key_groups), True,
                   tuple(key_group_runs(resume.warm)), tuple(key_group_runs(resume.caught_up)),
                   tuple(key_group_runs(resume.restored)), tuple(key_group_runs(resume.dropped)),
                   int(resume.bytes_caught_up), int(resume.bytes_restored))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "bytes_read": self.bytes_read, "key_groups": self.key_groups,
                               "warm": self.warm}
        if self.warm_key_groups is not None:
            out.update(warm_key_groups=_runs(self.warm_key_groups),
                       caught_up_key_groups=_runs(self.caught_up_key_groups),
                       restored_key_groups=_runs(self.restored_key_groups),
                       dropped_key_groups=_runs(self.dropped_key_groups),
                       bytes_caught_up=self.bytes_caught_up, bytes_restored=self.bytes_restored)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RestoreInfo:
        runs = "warm_key_groups" in d
        return cls(
            mode=d["mode"], bytes_read=_int(d["bytes_read"], "restored.bytes_read"),
            key_groups=_int(d.get("key_groups", 0), "restored.key_groups"), warm=bool(d.get("warm", False)),
            warm_key_groups=_read_runs(d.get("warm_key_groups"), "warm_key_groups") if runs else None,
            caught_up_key_groups=_read_runs(d.get("caught_up_key_groups"), "caught_up_key_groups") if runs else None,
            restored_key_groups=_read_runs(d.get("restored_key_groups"), "restored_key_groups") if runs else None,
            dropped_key_groups=_read_runs(d.get("dropped_key_groups"), "dropped_key_groups") if runs else None,
            bytes_caught_up=_int(d.get("bytes_caught_up", 0), "bytes_caught_up"),
            bytes_restored=_int(d.get("bytes_restored", 0), "bytes_restored"))


@dataclass(frozen=True)
class TimerFigures:
    """One time domain's timers of a subtask (or, summed, of a batch): ``registered`` and ``fired`` this batch,
    ``pending`` (registered after the batch: exactly what the checkpoint holds; None in reports written before it
    was counted), ``queued`` (queue entries, deleted timers' included until they come up), the ``earliest`` still
    registered (None: none), and whether the queues were ``rebuilt`` from state (not kept from the last batch)."""

    registered: int = 0
    fired: int = 0
    pending: int | None = 0
    queued: int = 0
    earliest: int | None = None
    rebuilt: bool | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"registered": self.registered, "fired": self.fired, "queued": self.queued,
                               "earliest": self.earliest}
        if self.pending is not None:
            out["pending"] = self.pending
        if self.rebuilt is not None:
            out["rebuilt"] = self.rebuilt
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TimerFigures:
        return cls(registered=_int(d.get("registered", 0), "timers.registered"),
                   fired=_int(d.get("fired", 0), "timers.fired"),
                   pending=_optional_int(d.get("pending"), "timers.pending"),
                   queued=_int(d.get("queued", 0), "timers.queued"),
                   earliest=_optional_int(d.get("earliest"), "timers.earliest"),
                   rebuilt=None if d.get("rebuilt") is None else bool(d["rebuilt"]))

    @classmethod
    def total(cls, parts: Iterable[TimerFigures]) -> TimerFigures:
        """The figures of several subtasks together (``pending`` None if any part lacks it)."""
        parts = list(parts)
        earliest = [p.earliest for p in parts if p.earliest is not None]
        pending = [p.pending for p in parts]
        return cls(registered=sum(p.registered for p in parts), fired=sum(p.fired for p in parts),
                   pending=None if None in pending else sum(p for p in pending if p is not None),
                   queued=sum(p.queued for p in parts), earliest=min(earliest) if earliest else None)


def _timers_to_json(timers: Mapping[TimeDomain, TimerFigures]) -> dict[str, Any]:
    return {domain.value: figures.to_json() for domain, figures in timers.items()}


def _timers_from_json(d: Any) -> dict[TimeDomain, TimerFigures]:
    if not d:
        return {}
    return {TimeDomain(name): TimerFigures.from_json(figures) for name, figures in d.items()}


@dataclass(frozen=True)
class SubtaskSeconds:
    """Seconds a subtask spent: ``restore`` (its state: warm, caught up or read), ``prepare`` (its records split
    into late and on time, placed by key group and sorted), ``process`` (the function over the records), ``timers``
    (the due timers fired) and ``snapshot`` (its output, late output and state files written)."""

    restore: float = 0.0
    prepare: float = 0.0
    process: float = 0.0
    timers: float = 0.0
    snapshot: float = 0.0

    def to_json(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SubtaskSeconds:
        return cls(**{name: _seconds(d.get(name, 0.0), f"seconds.{name}")
                      for name in ("restore", "prepare", "process", "timers", "snapshot")})


@dataclass(frozen=True)
class InputDigest:
    """What identifies a batch's records, whatever their order and partitioning: their count and the sum (mod
    2^64) of each record's xxhash64 over all its columns. A replay is checked against the digest its checkpoint
    committed."""

    records: int
    xxhash64_sum: int

    def __add__(self, other: InputDigest) -> InputDigest:
        return InputDigest(self.records + other.records, (self.xxhash64_sum + other.xxhash64_sum) % _U64)

    def to_json(self) -> dict[str, int]:
        return {"records": self.records, "xxhash64_sum": self.xxhash64_sum}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> InputDigest:
        return cls(_int(d["records"], "input_digest.records"), _int(d["xxhash64_sum"], "input_digest.xxhash64_sum"))


NO_DIGEST = InputDigest(0, 0)


@dataclass(frozen=True)
class SubtaskReport:
    """What one keyed subtask did in one batch (see the module docs).

    ``key_group_range`` its key groups; ``keyed_handle`` and ``raw_keyed_handle`` the state files it wrote (None:
    none; a subtask that changed nothing writes no keyed file); ``output_file`` and ``late_file`` (None: no late
    record kept) its Parquet files; ``records_in`` the records it got, ``records_late`` those at or before the batch's
    start watermark (dropped, or in ``late_file``), ``records_out`` the output records; ``max_event_time`` its
    largest on-time event time and ``event_time_range`` the smallest and largest event time it got, late ones
    included (None: no event time); ``timers`` per time domain; ``restored`` how its state came; ``snapshot_bytes``
    and ``raw_keyed_bytes`` the bytes of its state files; ``state_entries`` its backend's estimate of the entries it
    holds (None: the backend gives none); ``seconds`` per phase; ``key_group_records``, ``key_group_calls`` and
    ``key_group_timers`` its per-key-group load counts (compact arrays, see :mod:`keygroups.runtime.assignment`);
    ``input_digest`` the digest of its records, where the executor computes one; ``sink_committable`` what its
    sink's writer pre-committed (None: no sink, or nothing to commit; see :mod:`keygroups.runtime.sink`), stored
    with the checkpoint so that a restarted driver commits it. ``output_file`` is None when the job's output goes
    only to its sink. ``process``: the pid of the process that ran the subtask (None in reports written before it
    was recorded); ``forwarded_from``: the pid of the Spark task's process when that task forwarded the subtask to
    ``process``, which held its state warm (see :mod:`keygroups.runtime.warm_exchange`), else None."""

    subtask: int
    key_group_range: KeyGroupRange
    output_file: str | None
    restored: RestoreInfo
    keyed_handle: KeyedStateHandle | None = None
    raw_keyed_handle: RawKeyedStateHandle | None = None
    late_file: str | None = None
    records_in: int = 0
    records_late: int = 0
    records_out: int = 0
    max_event_time: int | None = None
    event_time_range: tuple[int, int] | None = None
    timers: Mapping[TimeDomain, TimerFigures] = field(default_factory=dict)
    snapshot_bytes: int = 0
    raw_keyed_bytes: int = 0
    state_entries: int | None = None
    seconds: SubtaskSeconds = SubtaskSeconds()
    key_group_records: str | None = None
    key_group_calls: str | None = None
    key_group_timers: str | None = None
    input_digest: InputDigest | None = None
    sink_committable: SinkCommittable | None = None
    process: int | None = None
    forwarded_from: int | None = None

    def with_digest(self, digest: InputDigest) -> SubtaskReport:
        return replace(self, input_digest=digest)

    def to_json(self) -> dict[str, Any]:
        """Everything, as the task sends it to the driver."""
        out = self.stored()
        out.update(keyed_handle=None if self.keyed_handle is None else self.keyed_handle.to_json(),
                   raw_keyed_handle=None if self.raw_keyed_handle is None else self.raw_keyed_handle.to_json(),
                   key_group_records=self.key_group_records, key_group_calls=self.key_group_calls,
                   key_group_timers=self.key_group_timers)
        return out

    def stored(self) -> dict[str, Any]:
        """What a checkpoint keeps of the report: everything but the handles (the checkpoint lists them) and the
        per-key-group counts (merged into its load figures)."""
        out: dict[str, Any] = {
            "subtask": self.subtask, "key_group_range": [self.key_group_range.start, self.key_group_range.end],
            "output_file": self.output_file, "late_file": self.late_file, "records_in": self.records_in,
            "records_late": self.records_late, "records_out": self.records_out,
            "max_event_time": self.max_event_time,
            "event_time_range": None if self.event_time_range is None else list(self.event_time_range),
            "timers": _timers_to_json(self.timers), "restored": self.restored.to_json(),
            "snapshot_bytes": self.snapshot_bytes, "raw_keyed_bytes": self.raw_keyed_bytes,
            "state_entries": self.state_entries, "seconds": self.seconds.to_json()}
        if self.input_digest is not None:
            out["input_digest"] = self.input_digest.to_json()
        if self.sink_committable is not None:
            out["sink_committable"] = self.sink_committable.to_json()
        if self.process is not None:
            out["process"] = self.process
        if self.forwarded_from is not None:
            out["forwarded_from"] = self.forwarded_from
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SubtaskReport:
        """A report from :meth:`to_json` or :meth:`stored` (handles and counts then None); CorruptSnapshotError
        naming the field on anything else."""
        try:
            start, end = d["key_group_range"]
            event_range = d.get("event_time_range")
            return cls(
                subtask=_int(d["subtask"], "subtask"), key_group_range=KeyGroupRange(start, end),
                output_file=d.get("output_file"), restored=RestoreInfo.from_json(d["restored"]),
                keyed_handle=KeyedStateHandle.from_json(d["keyed_handle"]) if d.get("keyed_handle") else None,
                raw_keyed_handle=(RawKeyedStateHandle.from_json(d["raw_keyed_handle"]) if d.get("raw_keyed_handle")
                                  else None),
                late_file=d.get("late_file"), records_in=_int(d.get("records_in", 0), "records_in"),
                records_late=_int(d.get("records_late", 0), "records_late"),
                records_out=_int(d.get("records_out", 0), "records_out"),
                max_event_time=_optional_int(d.get("max_event_time"), "max_event_time"),
                event_time_range=None if event_range is None else (int(event_range[0]), int(event_range[1])),
                timers=_timers_from_json(d.get("timers")),
                snapshot_bytes=_int(d.get("snapshot_bytes", 0), "snapshot_bytes"),
                raw_keyed_bytes=_int(d.get("raw_keyed_bytes", 0), "raw_keyed_bytes"),
                state_entries=_optional_int(d.get("state_entries"), "state_entries"),
                seconds=SubtaskSeconds.from_json(d.get("seconds") or {}),
                key_group_records=d.get("key_group_records"), key_group_calls=d.get("key_group_calls"),
                key_group_timers=d.get("key_group_timers"),
                input_digest=InputDigest.from_json(d["input_digest"]) if d.get("input_digest") else None,
                sink_committable=(SinkCommittable.from_json(d["sink_committable"]) if d.get("sink_committable")
                                  is not None else None),
                process=_optional_int(d.get("process"), "process"),
                forwarded_from=_optional_int(d.get("forwarded_from"), "forwarded_from"))
        except CorruptSnapshotError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptSnapshotError(f"a subtask report is malformed ({type(e).__name__}: {e}): {dict(d)!r:.300}"
                                       ) from None

    @property
    def key_groups_by_mode(self) -> dict[str, int]:
        """Key groups that came warm, caught up or cold (restored), per key group: a subtask whose range moved keeps
        some warm and restores the ones that arrived. A report without the runs counts its whole range under its
        mode; a job's first batch (``new``) counts in none."""
        r = self.restored
        if r.warm_key_groups is not None and r.mode != "new":
            return {"warm": runs_size(r.warm_key_groups), "caught-up": runs_size(r.caught_up_key_groups),
                    "cold": runs_size(r.restored_key_groups)}
        out = {"warm": 0, "caught-up": 0, "cold": 0}
        if r.mode in out:
            out[r.mode] = len(self.key_group_range)
        return out


@dataclass(frozen=True)
class SplitPosition:
    """Where a source subtask goes on in one split: its ``topic`` (None: a partition of the file log), its
    ``partition`` and the ``offset`` of the next record to read (a byte offset in a log partition, a Kafka
    offset)."""

    topic: str | None
    partition: int
    offset: int


#: What a source reader notes besides its positions, each a list of JSON objects as the reader reported them
#: (Kafka: records skipped as undecodable, positions reset after a lost offset, partitions discovered, dropped).
SOURCE_NOTES = ("skipped", "resets", "discovered", "dropped")


@dataclass(frozen=True)
class SourceReport:
    """What one source subtask did (:func:`keygroups.runtime.source.run_source_subtask`): the operator state it
    wrote (its positions), the staged input file (None: no record), the ``records`` it read of its ``partitions``
    (``(topic, partition)``, topic None for the file log), its new ``positions`` (one :class:`SplitPosition` per
    split), the bytes its restore read, its seconds, the records it skipped (Kafka's ``on_decode_error='skip'``)
    and its reader's ``notes`` (see :data:`SOURCE_NOTES`).

    A checkpoint stores it as the reader reported it: a log's ``partitions`` as ints and ``positions`` as
    ``{"<partition>": offset}``, Kafka's as ``[topic, partition]`` and ``[topic, partition, offset]`` lists."""

    subtask: int
    operator_handle: OperatorStateHandle | None
    input_file: str | None
    records: int
    partitions: tuple[tuple[str | None, int], ...] = ()
    positions: tuple[SplitPosition, ...] = ()
    restored_bytes: int = 0
    seconds: float = 0.0
    records_skipped: int = 0
    notes: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SourceReport:
        try:
            return cls(subtask=_int(d["subtask"], "subtask"),
                       operator_handle=(OperatorStateHandle.from_json(d["operator_handle"])
                                        if d.get("operator_handle") else None),
                       input_file=d.get("input_file"), records=_int(d["records"], "records"),
                       partitions=tuple(_split_id(p) for p in d.get("partitions") or ()),
                       positions=_read_positions(d.get("positions")),
                       restored_bytes=_int(d.get("restored_bytes", 0), "restored_bytes"),
                       seconds=_seconds(d.get("seconds", 0.0), "seconds"),
                       records_skipped=_int(d.get("records_skipped", 0), "records_skipped"),
                       notes={k: tuple(d[k]) for k in SOURCE_NOTES if d.get(k)})
        except CorruptSnapshotError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptSnapshotError(f"a source report is malformed ({type(e).__name__}: {e}): {dict(d)!r:.300}"
                                       ) from None

    def offsets(self) -> dict[tuple[str | None, int], int]:
        """``(topic, partition) -> next offset`` of every split this subtask holds."""
        return {(p.topic, p.partition): p.offset for p in self.positions}

    def stored(self) -> dict[str, Any]:
        """What a checkpoint keeps of the report: everything but the handle (the checkpoint lists it)."""
        log = all(t is None for t, _ in self.partitions) and all(p.topic is None for p in self.positions)
        out: dict[str, Any] = {
            "subtask": self.subtask, "input_file": self.input_file, "records": self.records,
            "partitions": [p if log else [t, p] for t, p in self.partitions],
            "positions": ({str(p.partition): p.offset for p in self.positions} if log
                          else [[p.topic, p.partition, p.offset] for p in self.positions]),
            "restored_bytes": self.restored_bytes, "seconds": self.seconds}
        if self.records_skipped:
            out["records_skipped"] = self.records_skipped
        out.update({k: list(v) for k, v in self.notes.items()})
        return out

    def to_json(self) -> dict[str, Any]:
        return {**self.stored(), "operator_handle": None if self.operator_handle is None
                else self.operator_handle.to_json()}


def _split_id(value: Any) -> tuple[str | None, int]:
    """A log partition (an int) or a Kafka ``[topic, partition]``."""
    if isinstance(value, list | tuple):
        topic, partition = value
        return str(topic), _int(partition, "partition")
    return None, _int(value, "partition")


def _read_positions(value: Any) -> tuple[SplitPosition, ...]:
    """A log's ``{"<partition>": offset}`` or Kafka's ``[[topic, partition, offset], ...]``."""
    if not value:
        return ()
    if isinstance(value, Mapping):
        return tuple(SplitPosition(None, int(p), _int(o, "offset")) for p, o in value.items())
    return tuple(SplitPosition(str(t), _int(p, "partition"), _int(o, "offset")) for t, p, o in value)


# ---- the batch -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PhaseSeconds:
    """Seconds a batch spent per phase.

    On the driver: ``read`` (reading the input before the batch is planned: the Spark job that counts it and finds
    its largest event time, or the source subtasks' job; 0 when nothing needs reading first), ``plan`` (finding the
    restore point, choosing ranges, checking the input and the function's states, building the placement and the
    task spec) and ``commit`` (writing ``_metadata``, then the sink's commit where the job has an in-task sink). In
    the subtasks, the slowest one's (they run side by side): ``restore``, ``process`` (its records, then its timers)
    and ``snapshot`` (its output, to the checkpoint or its sink's writer, and its state files)."""

    plan: float = 0.0
    restore: float = 0.0
    process: float = 0.0
    snapshot: float = 0.0
    commit: float = 0.0
    read: float = 0.0


@dataclass(frozen=True)
class BatchReport:
    """One committed micro-batch in figures (see the module docs). Times are epoch milliseconds; a watermark or an
    event time is None where there is none (no event time seen yet, or no timestamp column)."""

    #: The checkpoint the batch committed, and the job's name.
    checkpoint_id: int
    job: str
    #: Whether the batch was a replay of a checkpoint already complete (nothing ran; the figures are the original
    #: run's).
    replayed: bool
    #: Records the batch got, on time and late.
    records_in: int
    #: Records at or before ``watermark_before``: dropped, or written to the late output.
    records_late: int
    #: Records the function returned (records and timers).
    records_out: int
    #: The watermark the batch started with, and the one it ended with (where the next batch starts).
    watermark_before: int | None
    watermark_after: int | None
    #: The smallest and largest event time among the batch's records, late ones included (None: no event time).
    event_time_min: int | None
    event_time_max: int | None
    #: The subtasks the batch ran, and the job's key groups.
    parallelism: int
    #: Why this parallelism: ``"fixed"``, or what the parallelism policy saw and chose.
    parallelism_reason: str
    max_parallelism: int
    #: Key groups whose state was resumed in memory or on local disk (nothing read), caught up (read only the blocks
    #: committed since), or restored cold from the checkpoint files, counted per key group (a subtask whose range
    #: moved keeps some warm and restores only those that arrived); key groups of a job's first batch are in none.
    key_groups_warm: int
    key_groups_caught_up: int
    key_groups_cold: int
    #: Bytes of checkpoint files the subtasks read to restore their state.
    bytes_restored: int
    #: Bytes of state files this checkpoint wrote itself (keyed and raw keyed; an incremental checkpoint writes only
    #: what changed).
    bytes_written: int
    #: Timers registered and fired in this batch (every time domain).
    timers_registered: int
    timers_fired: int
    #: Timers registered after the batch, every time domain: exactly those the checkpoint holds (None for a
    #: checkpoint written before keygroups counted them).
    timers_pending: int | None
    #: Entries of keyed state after the batch, the timers' own state included: an estimate where restored blocks
    #: are not merged yet (heap) and RocksDB's own estimate; a heap map state counts once per key; None when a
    #: backend gives none.
    state_entries: int | None
    #: Bytes a full restore of the checkpoint reads (every key group's chain: its full block and deltas).
    state_bytes: int
    #: Seconds per phase (see :class:`PhaseSeconds`).
    seconds: PhaseSeconds
    #: The key-group ranges the batch ran with and why (see :class:`~keygroups.runtime.AssignmentDecision`: the
    #: assignment, whether the ranges moved, the load's max/mean under them, before, and under Flink's ranges, the
    #: key groups and bytes that changed owner); None for a checkpoint written before decisions were stored.
    assignment: AssignmentDecision | None = None
    #: The batch's wall time on the driver, from the call to its result (0.0 where not measured: a report read back
    #: from a checkpoint).
    wall_seconds: float = 0.0
    #: Spark's own time for the batch's jobs: the union of their runs, submission to completion, from Spark's status
    #: store (None where it is not known: Spark Connect, the test harness, a report read back). ``wall_seconds``
    #: minus it is the driver's time outside Spark's jobs: keygroups' own, plus Spark's planning of the jobs.
    spark_seconds: float | None = None

    @property
    def total_seconds(self) -> float:
        """The sum of the phases (subtasks' phases overlap the driver's wait for them: see ``wall_seconds``)."""
        return sum(getattr(self.seconds, p) for p in PHASES)

    @property
    def driver_seconds(self) -> float | None:
        """The batch's time on the driver outside Spark's jobs (``wall_seconds - spark_seconds``; None without
        ``spark_seconds``)."""
        return None if self.spark_seconds is None else max(0.0, self.wall_seconds - self.spark_seconds)

    @property
    def late_share(self) -> float:
        """The share of the batch's records that were late (0.0 for an empty batch)."""
        return self.records_late / self.records_in if self.records_in else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able plain values (``seconds`` a dict of its phases, ``assignment`` its JSON)."""
        out = asdict(self)
        out["assignment"] = None if self.assignment is None else self.assignment.to_json()
        return out

    def __str__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        """One line for logs and the console."""
        late = f", {self.records_late:,} late ({self.late_share:.0%})" if self.records_late else ""
        watermark = ""
        if self.watermark_after is not None:
            watermark = f", watermark {format_time(self.watermark_before)} -> {format_time(self.watermark_after)}"
        restored = f"warm {self.key_groups_warm}/caught-up {self.key_groups_caught_up}/cold {self.key_groups_cold}"
        phases = " ".join(f"{p} {getattr(self.seconds, p):.2f}" for p in PHASES)
        spark = "" if self.spark_seconds is None else f", Spark jobs {self.spark_seconds:.2f}s"
        wall = f"; {self.wall_seconds:.2f}s{spark} (" if self.wall_seconds else f"; {self.total_seconds:.2f}s ("
        return (f"checkpoint {self.checkpoint_id}{' (replayed)' if self.replayed else ''}: {self.records_in:,} in"
                f"{late}, {self.records_out:,} out{watermark}; p={self.parallelism} ({self.parallelism_reason}); "
                f"key groups {restored}; {self.bytes_restored:,} B restored, {self.bytes_written:,} B written; timers "
                f"+{self.timers_registered} fired {self.timers_fired} pending "
                f"{'?' if self.timers_pending is None else self.timers_pending}; state "
                f"{'?' if self.state_entries is None else f'{self.state_entries:,}'} entries "
                f"{self.state_bytes:,} B{wall}{phases})"
                f"{'' if self.assignment is None else '; ranges ' + self.assignment.summary()}")

    @classmethod
    def of(cls, *, checkpoint_id: int, job: str, replayed: bool, parallelism: int, max_parallelism: int,
           reports: Sequence[SubtaskReport], records_late: int, timers: Mapping[TimeDomain, TimerFigures],
           watermark_before: int | None, watermark_after: int | None, parallelism_reason: str, state_bytes: int,
           assignment: AssignmentDecision | None, driver: Mapping[str, float], wall_seconds: float = 0.0,
           spark_seconds: float | None = None) -> BatchReport:
        """The report of a batch from its subtasks' reports and the driver's figures (``driver``: seconds of
        ``read``, ``plan`` and ``commit``)."""
        modes = {"warm": 0, "caught-up": 0, "cold": 0}
        for r in reports:
            for mode, n in r.key_groups_by_mode.items():
                modes[mode] += n
        entries = [r.state_entries for r in reports]
        ranges = [r.event_time_range for r in reports if r.event_time_range is not None]
        pending = [t.pending for t in timers.values()]
        return cls(
            checkpoint_id=checkpoint_id, job=job, replayed=replayed,
            records_in=sum(r.records_in for r in reports), records_late=records_late,
            records_out=sum(r.records_out for r in reports),
            watermark_before=_watermark(watermark_before), watermark_after=_watermark(watermark_after),
            event_time_min=min(lo for lo, _ in ranges) if ranges else None,
            event_time_max=max(hi for _, hi in ranges) if ranges else None,
            parallelism=parallelism, parallelism_reason=parallelism_reason, max_parallelism=max_parallelism,
            key_groups_warm=modes["warm"], key_groups_caught_up=modes["caught-up"], key_groups_cold=modes["cold"],
            bytes_restored=sum(r.restored.bytes_read for r in reports),
            bytes_written=sum(r.snapshot_bytes + r.raw_keyed_bytes for r in reports),
            timers_registered=sum(t.registered for t in timers.values()),
            timers_fired=sum(t.fired for t in timers.values()),
            timers_pending=None if not timers or None in pending else sum(p for p in pending if p is not None),
            state_entries=sum(e for e in entries if e is not None) if entries and None not in entries else None,
            state_bytes=state_bytes,
            seconds=PhaseSeconds(
                read=float(driver.get("read", 0.0)), plan=float(driver.get("plan", 0.0)),
                restore=_slowest(reports, "restore"), process=_slowest(reports, "prepare", "process", "timers"),
                snapshot=_slowest(reports, "snapshot"), commit=float(driver.get("commit", 0.0))),
            assignment=assignment, wall_seconds=wall_seconds, spark_seconds=spark_seconds)

    @classmethod
    def from_checkpoint(cls, metadata: Any, *, replayed: bool = False, plan_seconds: float | None = None,
                        commit_seconds: float | None = None) -> BatchReport:
        """The report of the committed checkpoint ``metadata``, read from what it stores (its subtask reports, timer
        summary, decision and driver timings: :class:`~keygroups.runtime.properties.BatchProperties`); the driver's
        ``plan_seconds`` and ``commit_seconds`` default to what the batch stored (commit: 0.0, as the metadata is
        written by the commit it would time)."""
        from keygroups.runtime.properties import BatchProperties

        props = BatchProperties.of(metadata)
        driver = dict(props.driver_seconds)
        if plan_seconds is not None:
            driver["plan"] = plan_seconds
        if commit_seconds is not None:
            driver["commit"] = commit_seconds
        return cls.of(checkpoint_id=metadata.checkpoint_id, job=metadata.job_id, replayed=replayed,
                      parallelism=metadata.parallelism, max_parallelism=metadata.max_parallelism,
                      reports=props.reports, records_late=props.records_late, timers=props.timers,
                      watermark_before=props.start_watermark, watermark_after=props.watermark,
                      parallelism_reason=props.parallelism_reason,
                      state_bytes=int(key_group_state_bytes(metadata).sum()),
                      assignment=props.decision(metadata), driver=driver)


def format_time(ms: int | None) -> str:
    """Epoch milliseconds as an ISO UTC time; ``none`` for None."""
    if ms is None:
        return "none"
    try:
        return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        return f"{ms} ms (outside the calendar)"


def _watermark(value: int | None) -> int | None:
    return None if value is None or value == NO_WATERMARK else value


def _slowest(reports: Sequence[SubtaskReport], *phases: str) -> float:
    """The largest time over subtasks of the sum of ``phases`` of their seconds."""
    return max((sum(getattr(r.seconds, p) for p in phases) for r in reports), default=0.0)


__all__ = ["BatchReport", "PhaseSeconds", "PHASES", "format_time", "SubtaskReport", "SourceReport", "SplitPosition",
           "SOURCE_NOTES", "RestoreInfo", "RestoreMode", "TimerFigures", "SubtaskSeconds", "InputDigest"]
