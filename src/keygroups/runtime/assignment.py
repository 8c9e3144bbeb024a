"""Which key groups each subtask owns: Flink's equal ranges (the default), or contiguous ranges balanced by the load
each key group was measured to carry.

Every assignment is contiguous ranges, written as **boundaries**: ``b[0] = 0 < b[1] < ... < b[p] = max_parallelism``,
subtask ``i`` owning key groups ``[b[i], b[i + 1] - 1]`` (:func:`keygroups._ranges.flink_boundaries` gives Flink's).
So a subtask still restores only its own key groups, with the restore plans of any range
(:func:`~keygroups.checkpoint.plan_keyed_restore`), and warm state (kept heap backends, warm RocksDB databases,
timer queues), which is kept per key-group range, stays warm exactly where a range did not change.

**Load figures** (:class:`KeyGroupLoads`), kept with every checkpoint whatever the assignment:

* ``records``: records each key group processed, decayed over batches (``half_life`` batches: a key group's weight
  halves after that many batches without records); ``calls``: the steps a batch takes per key group, one per key
  of the batch (switching to it, reaching its state) plus one per record when the job's function is called per record
  (``process_element``; ``process_key_batch`` and ``process_batch`` take a key's records at once), decayed alike. The subtasks count
  both from the key-group column and the runs of equal keys they compute anyway (a ``bincount`` each); the driver
  adds the decayed figures of the checkpoint it restored.
* ``timers``: timers fired per key group, decayed the same way (a firing is work like a record).
* ``state_bytes``: bytes of each key group's chain (its newest full block and the deltas after it), from the keyed
  handles' offsets: no file is read.

Records, calls and timers are stored in the checkpoint's ``properties[LOADS_PROPERTY]`` as compact arrays (float32,
zlib, base64); the ranges in ``properties[RANGES_PROPERTY]``; why they were chosen in
``properties[DECISION_PROPERTY]`` (:class:`AssignmentDecision`). The binary ``_metadata`` format is unchanged.

**Balanced ranges** (:class:`BalancedRanges`): a key group's load is a blend of its share of the work
(``calls + timers``: what a batch's time grows with once state is warm; a vectorized function handles a hot key's
records in one step) and its share of the state (``state_bytes``: what memory, and restores after a rescale, grow
with): ``load = (1 - state_weight) * work_share + state_weight * bytes_share``, ``state_weight`` 0.1 by default.
:func:`balanced_boundaries` cuts ``[0, max_parallelism)`` into ``p`` contiguous non-empty ranges whose largest sum of
load is the smallest possible (the linear partition problem, solved exactly: loads are quantized to integers, the
optimum is found by binary search over the largest sum, each candidate checked greedily over prefix sums with
``numpy.searchsorted``). A key group cannot be split: when one alone carries more than a subtask's mean load, no
ranges reach balance, and the decision names it and the max parallelism that would split it (an integer multiple,
which keygroups restores into).

**Hysteresis**: boundaries move only when it pays. Among the ranges within ``tolerance`` of the optimum, the one
closest to the current boundaries is taken (each boundary moves as little as it can), and it replaces the current
ranges only when the largest load drops by at least ``min_gain + move_cost * restore_share`` of it, where
``restore_share`` is the share of the state held by the ranges that change (what their subtasks then read again),
or, whatever the cost, when the current ranges' max/mean load is above ``max_skew`` (1.10 by default).
A parallelism or max parallelism change makes every range new anyway: then the balanced ranges are taken at once
(with a policy of :mod:`keygroups.runtime.scaling`, a batch may change both its parallelism and its boundaries).
"""

from __future__ import annotations

import base64
import binascii
import math
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from keygroups._ranges import (
    UPPER_BOUND_MAX_PARALLELISM,
    KeyGroupRange,
    check_boundaries,
    check_parallelism,
    flink_boundaries,
    ranges_of,
)
from keygroups.checkpoint import CheckpointMetadata, chain_stats
from keygroups.errors import CorruptSnapshotError

#: ``properties`` key of a checkpoint's per key group load figures (records, calls and timers, decayed).
LOADS_PROPERTY = "key_group_loads"
#: ``properties`` key of a checkpoint's ranges, as boundaries (``[0, b1, ..., max_parallelism]``).
RANGES_PROPERTY = "key_group_ranges"
#: ``properties`` key of why the batch's ranges are what they are (:meth:`AssignmentDecision.to_json`).
DECISION_PROPERTY = "key_group_assignment"
#: Report keys of a subtask's per key group counts (encoded, over its own range).
RECORDS_REPORT, CALLS_REPORT, TIMERS_REPORT = "key_group_records", "key_group_calls", "key_group_timers"

#: Batches after which a key group's measured records count half (the default of :class:`BalancedRanges`).
DEFAULT_HALF_LIFE = 3.0
_QUANTUM = float(1 << 40)   # total load in integer units: exact sums, well inside int64


# ---- compact arrays ------------------------------------------------------------------------------------------------

def encode_counts(values: npt.ArrayLike) -> str:
    """Non-negative figures as compact text for JSON: float32 little-endian, zlib, base64."""
    array = np.ascontiguousarray(values, dtype="<f4")
    return base64.b64encode(zlib.compress(array.tobytes(), 6)).decode("ascii")


def decode_counts(text: Any, length: int, what: str) -> npt.NDArray[np.float64]:
    """:func:`encode_counts`'s figures back (``length`` of them, each finite and >= 0); CorruptSnapshotError naming
    ``what`` otherwise."""
    try:
        if not isinstance(text, str):
            raise ValueError(f"expected a string, got {type(text).__name__}")
        raw = zlib.decompressobj().decompress(base64.b64decode(text, validate=True), 4 * length + 1)
    except (ValueError, binascii.Error, zlib.error) as e:
        raise CorruptSnapshotError(f"{what} cannot be decoded: {e}") from None
    if len(raw) != 4 * length:
        raise CorruptSnapshotError(f"{what} holds {len(raw) // 4} figures, expected {length} (one per key group)")
    values = np.frombuffer(raw, dtype="<f4").astype(np.float64)
    if not np.isfinite(values).all() or (values < 0).any():
        raise CorruptSnapshotError(f"{what} holds a negative or non-finite figure")
    return values


# ---- load figures --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KeyGroupLoads:
    """Per key group load figures of one checkpoint (arrays of ``max_parallelism``), the first three decayed over
    the last batches: ``records`` processed, ``calls`` (steps: one per key of a batch, plus one per record for a
    function called per record), ``timers`` fired, and ``state_bytes`` of the key group's chain."""

    max_parallelism: int
    records: npt.NDArray[np.float64]
    calls: npt.NDArray[np.float64]
    timers: npt.NDArray[np.float64]
    state_bytes: npt.NDArray[np.float64]

    @classmethod
    def empty(cls, max_parallelism: int) -> KeyGroupLoads:
        return cls(max_parallelism, *(np.zeros(max_parallelism, dtype=np.float64) for _ in range(4)))

    def work(self) -> npt.NDArray[np.float64]:
        """Steps (keys, and records of a function called per record) plus timers fired, per key group: what a
        batch's time grows with (a vectorized function takes all of a key's records at once, so a single hot key
        costs one step)."""
        return self.calls + self.timers

    def blend(self, state_weight: float) -> npt.NDArray[np.float64]:
        """Each key group's share of the load: ``(1 - state_weight)`` of its share of the work plus ``state_weight``
        of its share of the state bytes (a part without figures passes its weight to the other; zeros when there
        are none at all)."""
        work, state = self.work(), self.state_bytes
        total_work, total_state = float(work.sum()), float(state.sum())
        if total_work <= 0 and total_state <= 0:
            return np.zeros(self.max_parallelism)
        if total_work <= 0:
            return state / total_state
        if total_state <= 0:
            return work / total_work
        return (1 - state_weight) * work / total_work + state_weight * state / total_state

    def rekeyed(self, max_parallelism: int) -> KeyGroupLoads:
        """The figures for ``max_parallelism`` key groups, a multiple or divisor of this one's: a key group split
        in ``k`` gives each child ``1/k`` of it (child ``g``'s parent is ``g % old``), merged ones add up."""
        old, new = self.max_parallelism, max_parallelism
        arrays = (self.records, self.calls, self.timers, self.state_bytes)
        if new == old:
            return self
        if new % old == 0:
            return KeyGroupLoads(new, *(np.tile(a, new // old) / (new // old) for a in arrays))
        if old % new == 0:
            return KeyGroupLoads(new, *(a.reshape(old // new, new).sum(axis=0) for a in arrays))
        raise ValueError(f"max parallelism {old} -> {new} is not a change by an integer factor")


def checkpoint_boundaries(metadata: CheckpointMetadata) -> tuple[int, ...]:
    """The ranges ``metadata``'s subtasks owned, as boundaries: those stored with it, Flink's for a checkpoint
    written before ranges were stored. CorruptSnapshotError if the stored ones are not valid ranges."""
    stored = metadata.properties.get(RANGES_PROPERTY)
    if stored is None:
        return flink_boundaries(metadata.max_parallelism, metadata.parallelism)
    try:
        boundaries = check_boundaries(stored, metadata.max_parallelism)
    except (TypeError, ValueError) as e:
        raise CorruptSnapshotError(f"checkpoint {metadata.checkpoint_id}: properties[{RANGES_PROPERTY!r}] is not "
                                   f"a valid set of ranges: {e}") from None
    if len(boundaries) != metadata.parallelism + 1:
        raise CorruptSnapshotError(f"checkpoint {metadata.checkpoint_id}: properties[{RANGES_PROPERTY!r}] has "
                                   f"{len(boundaries) - 1} ranges for parallelism {metadata.parallelism}")
    return boundaries


#: The decayed figures a checkpoint stores, with the subtask report key each batch's counts come in.
_STORED = (("records", RECORDS_REPORT), ("calls", CALLS_REPORT), ("timers", TIMERS_REPORT))


_Counts = tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]


def _stored_counts(metadata: CheckpointMetadata) -> _Counts:
    """The decayed records, calls and timers ``metadata`` stores (zeros when it has none; calls are its records
    when it has none)."""
    mp = metadata.max_parallelism
    stored = metadata.properties.get(LOADS_PROPERTY)
    if stored is None:
        return np.zeros(mp), np.zeros(mp), np.zeros(mp)
    what = f"checkpoint {metadata.checkpoint_id}: properties[{LOADS_PROPERTY!r}]"
    if not isinstance(stored, dict):
        raise CorruptSnapshotError(f"{what} must be a JSON object, got {type(stored).__name__}")
    records = decode_counts(stored.get("records"), mp, f"{what}['records']")
    calls = records if "calls" not in stored else decode_counts(stored["calls"], mp, f"{what}['calls']")
    return records, calls, decode_counts(stored.get("timers"), mp, f"{what}['timers']")


#: key_group_state_bytes's figures, per metadata object (dropped with it).
_STATE_BYTES: dict[int, npt.NDArray[np.float64]] = {}


def key_group_state_bytes(metadata: CheckpointMetadata) -> npt.NDArray[np.float64]:
    """Bytes of each key group's chain (its newest full block and the deltas after it) in ``metadata``, from its
    keyed handles alone (no file is read). Worked out once per metadata object: the batch that commits a checkpoint
    reports it, and the next batch plans its ranges from it."""
    key = id(metadata)
    cached = _STATE_BYTES.get(key)
    if cached is not None:
        return cached
    mp = metadata.max_parallelism
    state = np.zeros(mp, dtype=np.float64)
    if metadata.keyed_handles:
        for kg, chain in chain_stats(metadata, KeyGroupRange(0, mp - 1)).items():
            state[kg] = chain.full_bytes + chain.delta_bytes
    state.setflags(write=False)
    _STATE_BYTES[key] = state
    weakref.finalize(metadata, _STATE_BYTES.pop, key, None)
    return state


def checkpoint_loads(metadata: CheckpointMetadata) -> KeyGroupLoads:
    """The load figures of ``metadata``: records, calls and timers from its properties (zeros when it has none),
    state bytes from its keyed handles (no file is read)."""
    records, calls, timers = _stored_counts(metadata)
    return KeyGroupLoads(metadata.max_parallelism, records, calls, timers, key_group_state_bytes(metadata))


def merged_loads(previous: CheckpointMetadata | None, reports: Sequence[Any], max_parallelism: int,
                 boundaries: tuple[int, ...], half_life: float) -> dict[str, Any]:
    """The ``properties[LOADS_PROPERTY]`` of a new checkpoint: the restored checkpoint's records, calls and timers
    (re-keyed to ``max_parallelism`` if it changed), decayed by one batch, plus what the subtasks' reports
    (:class:`~keygroups.runtime.report.SubtaskReport`) counted over their ranges (``boundaries``)."""
    decay = 0.5 ** (1.0 / half_life)
    figures = [np.zeros(max_parallelism) for _ in _STORED]
    if previous is not None:
        records, calls, timers = _stored_counts(previous)
        old = KeyGroupLoads(previous.max_parallelism, records, calls, timers,
                            np.zeros(previous.max_parallelism)).rekeyed(max_parallelism)
        for target, value in zip(figures, (old.records, old.calls, old.timers)):
            target += decay * value
    for r in reports:
        own = KeyGroupRange(boundaries[r.subtask], boundaries[r.subtask + 1] - 1)
        for (_, key), target in zip(_STORED, figures):
            counts = getattr(r, key)
            if counts is not None:
                target[own.start:own.end + 1] += decode_counts(counts, len(own), f"subtask {r.subtask}'s {key}")
    return {**{name: encode_counts(v) for (name, _), v in zip(_STORED, figures)}, "half_life": half_life}


def range_loads(per_key_group: npt.ArrayLike, boundaries: Sequence[int]) -> npt.NDArray[np.float64]:
    """The sum of ``per_key_group`` over each range of ``boundaries``."""
    values = np.asarray(per_key_group, dtype=np.float64)
    return np.add.reduceat(values, np.asarray(boundaries[:-1], dtype=np.int64)) if len(values) else values


def max_over_mean(loads: npt.ArrayLike) -> float:
    """The largest load over the mean load (1.0 when there is none)."""
    values = np.asarray(loads, dtype=np.float64)
    total = float(values.sum())
    return float(values.max()) * len(values) / total if total > 0 else 1.0


# ---- the linear partition ------------------------------------------------------------------------------------------

def _quantized(weights: npt.ArrayLike) -> npt.NDArray[np.int64]:
    values = np.asarray(weights, dtype=np.float64)
    if values.ndim != 1 or not np.isfinite(values).all() or (values < 0).any():
        raise ValueError("key-group loads must be a 1-D array of finite figures >= 0")
    total = float(values.sum())
    if total <= 0:
        return np.zeros(len(values), dtype=np.int64)
    return np.rint(values * (_QUANTUM / total)).astype(np.int64)


def _reach(prefix: npt.NDArray[np.int64], limit: int) -> npt.NDArray[np.int64]:
    """For every start ``j`` (0..n), the largest end ``e`` with ``sum(w[j:e]) <= limit``."""
    return np.searchsorted(prefix, prefix + limit, side="right") - 1


def _pieces_needed(reach: npt.NDArray[np.int64], n: int, most: int) -> int:
    """Ranges the greedy cut needs (each as long as ``reach`` allows), stopping once past ``most``."""
    position, pieces = 0, 0
    while position < n and pieces <= most:
        position = int(reach[position])
        pieces += 1
    return pieces if position >= n else most + 1


def _optimum(w: npt.NDArray[np.int64], prefix: npt.NDArray[np.int64], p: int) -> int:
    """The smallest possible largest range sum of ``p`` contiguous ranges (binary search, greedy check)."""
    low, high = int(w.max(initial=0)), int(prefix[-1])
    while low < high:
        middle = (low + high) // 2
        if _pieces_needed(_reach(prefix, middle), len(w), p) <= p:
            high = middle
        else:
            low = middle + 1
    return low


def balanced_boundaries(weights: npt.ArrayLike, parallelism: int, *, previous: Sequence[int] | None = None,
                        tolerance: float = 0.0) -> tuple[int, ...]:
    """``parallelism`` contiguous non-empty ranges of the key groups (``len(weights)`` of them) whose largest sum of
    ``weights`` is at most ``(1 + tolerance)`` times the smallest possible, as boundaries.

    Among those, each boundary is placed, first to last, as close as it can be to ``previous[i]`` (boundaries of
    as many ranges; Flink's when None), so that an optimum that is already near is kept. Loads are quantized to
    integers (``2^40`` units in total) so the optimum is exact and the same on every machine. Without any load,
    Flink's ranges come back."""
    p, mp = check_parallelism(parallelism, len(np.asarray(weights)))
    w = _quantized(weights)
    anchor = tuple(previous) if previous is not None else flink_boundaries(mp, p)
    if len(anchor) != p + 1:
        raise ValueError(f"previous boundaries must number parallelism + 1 = {p + 1}, got {len(anchor)}")
    if not w.any():
        return flink_boundaries(mp, p)
    prefix = np.concatenate([[0], np.cumsum(w)]).astype(np.int64)
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a number in [0, 1), got {tolerance!r}")
    limit = max(int(w.max()), math.floor(_optimum(w, prefix, p) * (1 + tolerance)))
    reach = _reach(prefix, limit)
    # earliest[i]: the first key group range i may start at so that ranges i.. still fit (greedy from the right)
    back = np.searchsorted(prefix, prefix - limit, side="left")    # smallest start j with sum(w[j:e]) <= limit
    earliest = np.zeros(p + 1, dtype=np.int64)
    earliest[p] = mp
    for i in range(p - 1, 0, -1):
        earliest[i] = back[earliest[i + 1]]
    bounds = [0]
    for i in range(1, p):
        low = max(int(earliest[i]), bounds[-1] + 1)
        high = min(int(reach[bounds[-1]]), mp - (p - i))
        bounds.append(min(max(int(anchor[i]), low), high))
    bounds.append(mp)
    return tuple(bounds)


# ---- decisions -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HotKeyGroup:
    """A key group that alone carries more than a subtask's mean load (``times_mean`` times it): no ranges can
    balance it; a max parallelism ``suggested_max_parallelism`` would split it into enough key groups, if its load
    is spread over several keys (one hot key stays one key whatever the max parallelism)."""

    key_group: int
    share: float
    times_mean: float
    suggested_max_parallelism: int | None

    def to_json(self) -> dict[str, Any]:
        return {"key_group": self.key_group, "share": round(self.share, 6), "times_mean": round(self.times_mean, 4),
                "suggested_max_parallelism": self.suggested_max_parallelism}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HotKeyGroup:
        return cls(int(data["key_group"]), float(data["share"]), float(data["times_mean"]),
                   None if data.get("suggested_max_parallelism") is None else int(data["suggested_max_parallelism"]))


def hot_key_groups(load: npt.ArrayLike, parallelism: int, *, limit: int = 8) -> list[HotKeyGroup]:
    """The key groups (heaviest first, at most ``limit``) whose load alone exceeds the mean subtask load."""
    values = np.asarray(load, dtype=np.float64)
    total = float(values.sum())
    if total <= 0:
        return []
    mean = total / parallelism
    mp = len(values)
    hot = np.flatnonzero(values > mean * (1 + 1e-9))
    out = []
    for kg in hot[np.argsort(-values[hot], kind="stable")][:limit]:
        factor = math.ceil(values[kg] / mean)
        suggested = mp * factor if mp * factor <= UPPER_BOUND_MAX_PARALLELISM else None
        out.append(HotKeyGroup(int(kg), float(values[kg] / total), float(values[kg] / mean), suggested))
    return out


@dataclass(frozen=True)
class AssignmentDecision:
    """The ranges a batch runs with and why: ``boundaries`` (``previous``: the restored checkpoint's, None
    without one); ``moved`` whether they differ from ``previous``; ``reason`` in words; the blended load's
    max/mean under the chosen ranges, under ``previous`` (None when the parallelism changed) and under Flink's
    ranges at this parallelism; ``moved_key_groups`` and ``moved_bytes`` (key groups whose owner changed and their
    state), ``restore_bytes`` (the state of the ranges that changed, which their subtasks read again: warm state
    is kept per range); ``hot_key_groups`` that no range can balance."""

    assignment: str
    boundaries: tuple[int, ...]
    previous: tuple[int, ...] | None
    moved: bool
    reason: str
    max_over_mean: float
    max_over_mean_before: float | None
    flink_max_over_mean: float
    moved_key_groups: int = 0
    moved_bytes: int = 0
    restore_bytes: int = 0
    state_bytes: int = 0
    hot_key_groups: list[HotKeyGroup] = field(default_factory=list)

    @property
    def ranges(self) -> list[KeyGroupRange]:
        return ranges_of(self.boundaries)

    def summary(self) -> str:
        """The decision in a few words, for the batch's log line."""
        before = "" if self.max_over_mean_before is None else f", {self.max_over_mean_before:.2f} before"
        moved = f"; {self.moved_key_groups} key groups moved ({self.moved_bytes:,} B)" if self.moved else ""
        hot = f"; hot key groups {[h.key_group for h in self.hot_key_groups]}" if self.hot_key_groups else ""
        return (f"{self.assignment}: {self.reason}; load max/mean {self.max_over_mean:.2f}{before} (Flink's ranges "
                f"{self.flink_max_over_mean:.2f}){moved}{hot}")

    def to_json(self) -> dict[str, Any]:
        """The decision as the checkpoint's ``properties[DECISION_PROPERTY]`` holds it (the boundaries themselves
        are ``properties[RANGES_PROPERTY]``)."""
        return {"assignment": self.assignment, "moved": self.moved, "reason": self.reason,
                "previous": None if self.previous is None else list(self.previous),
                "max_over_mean": round(self.max_over_mean, 4),
                "max_over_mean_before": (None if self.max_over_mean_before is None
                                         else round(self.max_over_mean_before, 4)),
                "flink_max_over_mean": round(self.flink_max_over_mean, 4),
                "moved_key_groups": self.moved_key_groups, "moved_bytes": self.moved_bytes,
                "restore_bytes": self.restore_bytes, "state_bytes": self.state_bytes,
                "hot_key_groups": [h.to_json() for h in self.hot_key_groups]}

    @classmethod
    def from_json(cls, data: dict[str, Any], boundaries: Sequence[int]) -> AssignmentDecision:
        """The decision a checkpoint stored (:meth:`to_json`), with its ``boundaries`` (its ranges property);
        ``previous`` is None for a checkpoint written before it was stored. KeyError/TypeError/ValueError on a
        malformed one."""
        before = data.get("max_over_mean_before")
        previous = data.get("previous")
        return cls(assignment=str(data["assignment"]), boundaries=tuple(int(b) for b in boundaries),
                   previous=None if previous is None else tuple(int(b) for b in previous), moved=bool(data["moved"]),
                   reason=str(data["reason"]), max_over_mean=float(data["max_over_mean"]),
                   max_over_mean_before=None if before is None else float(before),
                   flink_max_over_mean=float(data["flink_max_over_mean"]),
                   moved_key_groups=int(data.get("moved_key_groups", 0)), moved_bytes=int(data.get("moved_bytes", 0)),
                   restore_bytes=int(data.get("restore_bytes", 0)), state_bytes=int(data.get("state_bytes", 0)),
                   hot_key_groups=[HotKeyGroup.from_json(h) for h in data.get("hot_key_groups") or ()])


def moved_figures(before: Sequence[int], after: Sequence[int], state_bytes: npt.ArrayLike
                  ) -> tuple[int, int, int]:
    """``(key groups whose owner changed, their state bytes, state bytes of the ranges that changed)`` from ranges
    ``before`` to ``after`` (both boundaries over the same key groups). A range is unchanged when the same range
    existed before, whichever subtask owned it: warm state is found by range."""
    state = np.asarray(state_bytes, dtype=np.float64)
    mp = len(state)
    groups = np.arange(mp)
    owner_before = np.searchsorted(np.asarray(before[:-1]), groups, side="right") - 1
    owner_after = np.searchsorted(np.asarray(after[:-1]), groups, side="right") - 1
    moved = owner_before != owner_after
    kept = {(before[i], before[i + 1]) for i in range(len(before) - 1)}   # warm state is kept per range
    changed = np.zeros(mp, dtype=bool)
    for i in range(len(after) - 1):
        if (after[i], after[i + 1]) not in kept:
            changed[after[i]:after[i + 1]] = True
    return int(moved.sum()), int(state[moved].sum()), int(state[changed].sum())


@runtime_checkable
class Assignment(Protocol):
    """Chooses each batch's ranges from the checkpoint it restores (None for a job's first batch)."""

    name: str

    def choose(self, previous: CheckpointMetadata | None, max_parallelism: int,
               parallelism: int) -> AssignmentDecision: ...


def _context(previous: CheckpointMetadata | None, max_parallelism: int
             ) -> tuple[KeyGroupLoads, tuple[int, ...] | None]:
    """The restored checkpoint's loads (for ``max_parallelism``) and its ranges (None when there is none, or its
    max parallelism differs: its ranges then number other key groups)."""
    if previous is None:
        return KeyGroupLoads.empty(max_parallelism), None
    loads = checkpoint_loads(previous).rekeyed(max_parallelism)
    before = checkpoint_boundaries(previous) if previous.max_parallelism == max_parallelism else None
    return loads, before


def _decision(name: str, boundaries: tuple[int, ...], before: tuple[int, ...] | None, reason: str,
              load: npt.NDArray[np.float64], loads: KeyGroupLoads, parallelism: int) -> AssignmentDecision:
    mp = loads.max_parallelism
    moved = (0, 0, 0) if before is None else moved_figures(before, boundaries, loads.state_bytes)
    same_p = before is not None and len(before) == len(boundaries)
    return AssignmentDecision(
        assignment=name, boundaries=boundaries, previous=before, moved=before is not None and before != boundaries,
        reason=reason, max_over_mean=max_over_mean(range_loads(load, boundaries)),
        max_over_mean_before=max_over_mean(range_loads(load, before)) if same_p and before is not None else None,
        flink_max_over_mean=max_over_mean(range_loads(load, flink_boundaries(mp, parallelism))),
        moved_key_groups=moved[0], moved_bytes=moved[1], restore_bytes=moved[2],
        state_bytes=int(loads.state_bytes.sum()), hot_key_groups=hot_key_groups(load, parallelism))


@dataclass(frozen=True)
class FlinkRanges:
    """Flink's equal ranges (``KeyGroupRangeAssignment``), whatever the load: ownership exactly as Flink's. The
    default. ``state_weight`` only blends the load figures the decision reports."""

    state_weight: float = 0.1
    name: str = field(default="flink", init=False)

    def choose(self, previous: CheckpointMetadata | None, max_parallelism: int,
               parallelism: int) -> AssignmentDecision:
        p, mp = check_parallelism(parallelism, max_parallelism)
        loads, before = _context(previous, mp)
        boundaries = flink_boundaries(mp, p)
        reason = ("Flink's equal ranges" if before is None or before == boundaries
                  else "Flink's equal ranges (the restored checkpoint had other ranges)")
        return _decision(self.name, boundaries, before, reason, loads.blend(self.state_weight), loads, p)


@dataclass(frozen=True)
class BalancedRanges:
    """Contiguous ranges balanced by measured load (see the module docs): ``state_weight`` (in [0, 1]) is the
    state bytes' part of a key group's load, the rest being its work (calls of the function and timers); ``tolerance`` how far above the
    optimum the largest load may stay to keep boundaries where they are; boundaries move when the largest load
    drops by ``min_gain + move_cost * restore_share`` of it, or whenever the current ranges' max/mean load is above
    ``max_skew`` and the move lowers it; ``half_life`` (batches) how fast old records count less."""

    state_weight: float = 0.1
    tolerance: float = 0.03
    min_gain: float = 0.05
    move_cost: float = 0.1
    half_life: float = DEFAULT_HALF_LIFE
    max_skew: float = 1.10
    name: str = field(default="balanced", init=False)

    def __post_init__(self) -> None:
        for label, value, low, high in (("state_weight", self.state_weight, 0, 1), ("tolerance", self.tolerance, 0, 1),
                                        ("min_gain", self.min_gain, 0, 1), ("move_cost", self.move_cost, 0, 100)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"BalancedRanges.{label} must be a number in [{low}, {high}], got {value!r}")
        if self.tolerance >= 1:
            raise ValueError(f"BalancedRanges.tolerance must be below 1, got {self.tolerance!r}")
        if isinstance(self.max_skew, bool) or not isinstance(self.max_skew, (int, float)) or self.max_skew < 1:
            raise ValueError(f"BalancedRanges.max_skew must be a number >= 1 (max over mean load), got "
                             f"{self.max_skew!r}")
        if isinstance(self.half_life, bool) or not isinstance(self.half_life, (int, float)) or self.half_life <= 0:
            raise ValueError(f"BalancedRanges.half_life must be a number of batches > 0, got {self.half_life!r}")

    def choose(self, previous: CheckpointMetadata | None, max_parallelism: int,
               parallelism: int) -> AssignmentDecision:
        p, mp = check_parallelism(parallelism, max_parallelism)
        loads, before = _context(previous, mp)
        load = loads.blend(self.state_weight)
        flink = flink_boundaries(mp, p)

        def decide(boundaries: tuple[int, ...], reason: str) -> AssignmentDecision:
            return _decision(self.name, boundaries, before, reason, load, loads, p)

        if not load.any():
            return decide(before if before is not None and len(before) == p + 1 else flink,
                          "no load measured yet: " + ("ranges kept" if before is not None and len(before) == p + 1
                                                      else "Flink's equal ranges"))
        if before is None or len(before) != p + 1:
            anchor = before if before is not None and len(before) == p + 1 else flink
            what = ("first balanced batch" if before is None else
                    f"parallelism {len(before) - 1} -> {p}: every range is new")
            return decide(balanced_boundaries(load, p, previous=anchor, tolerance=self.tolerance),
                          f"{what}; ranges cut by load")
        candidate = balanced_boundaries(load, p, previous=before, tolerance=self.tolerance)
        current_max = float(range_loads(load, before).max())
        new_max = float(range_loads(load, candidate).max())
        if candidate == before:
            return decide(before, f"ranges kept: within {self.tolerance:.0%} of the best balance")
        _, _, restore = moved_figures(before, candidate, loads.state_bytes)
        total_state = float(loads.state_bytes.sum())
        restore_share = restore / total_state if total_state > 0 else 0.0
        gain = (current_max - new_max) / current_max if current_max > 0 else 0.0
        needed = self.min_gain + self.move_cost * restore_share
        current_skew = current_max * p / float(load.sum())
        if current_skew > self.max_skew and new_max < current_max:
            return decide(candidate, f"boundaries moved: max/mean {current_skew:.3f} is above max_skew "
                                     f"{self.max_skew}; the largest load drops by {gain:.1%}")
        if gain < needed:
            return decide(before, f"ranges kept: moving would cut the largest load by {gain:.1%}, less than the "
                                  f"{needed:.1%} it must gain to move {restore_share:.1%} of the state")
        return decide(candidate, f"boundaries moved: the largest load drops by {gain:.1%} (needed {needed:.1%} "
                                 f"to move {restore_share:.1%} of the state)")


_BY_NAME: dict[str, type] = {"flink": FlinkRanges, "balanced": BalancedRanges}


def resolve_assignment(assignment: Any) -> Assignment:
    """``"flink"``, ``"balanced"`` (with default settings) or an :class:`Assignment` (e.g. ``BalancedRanges(...)``)
    as an Assignment; TypeError/ValueError naming the allowed values otherwise."""
    if isinstance(assignment, str):
        if assignment not in _BY_NAME:
            raise ValueError(f"assignment must be one of {sorted(_BY_NAME)} or an Assignment such as "
                             f"BalancedRanges(...), got {assignment!r}")
        return _BY_NAME[assignment]()  # type: ignore[no-any-return]
    if isinstance(assignment, Assignment):
        return assignment
    raise TypeError(f"assignment must be 'flink', 'balanced' or an Assignment (FlinkRanges(), BalancedRanges(...)), "
                    f"got {assignment!r}")


__all__ = ["Assignment", "AssignmentDecision", "BalancedRanges", "FlinkRanges", "HotKeyGroup", "KeyGroupLoads",
           "DECISION_PROPERTY", "LOADS_PROPERTY", "RANGES_PROPERTY", "balanced_boundaries", "checkpoint_boundaries",
           "checkpoint_loads", "hot_key_groups", "max_over_mean", "merged_loads", "moved_figures", "range_loads",
           "resolve_assignment"]
