"""Which key groups each subtask owns: Flink's equal ranges (the default), or contiguous ranges balanced by the load
each key group was measured to carry.

Every assignment is contiguous ranges, written as **boundaries**: ``b[0] = 0 < b[1] < ... < b[p] = max_parallelism``,
subtask ``i`` owning key groups ``[b[i], b[i + 1] - 1]`` (:func:`keygroups._ranges.flink_boundaries` gives Flink's).
So a subtask still restores only its own key groups, with the restore plans of any range
(:func:`~keygroups.checkpoint.plan_keyed_restore`), and warm state (kept heap backends, warm RocksDB databases,
timer queues), which is kept per key-group range, stays warm where a range did not change, and for the key groups a
changed range shares with the previous range whose state it takes over (see *Warm state* below).

**Load figures** (:class:`KeyGroupLoads`), kept with every checkpoint whatever the assignment:

* ``records``: records each key group processed, decayed over batches (``half_life`` batches: a key group's weight
  halves after that many batches without records); ``calls``: the steps a batch takes per key group, one per key
  of the batch (switching to it, reaching its state) plus one per record when the job's function is called per record
  (``process_element``; ``process_key_batch`` and ``process_batch`` take a key's records at once), decayed alike.
  The subtasks count both from the key-group column and the runs of equal keys they compute anyway (a ``bincount``
  each); the driver adds the decayed figures of the checkpoint it restored.
* ``timers``: timers fired per key group, decayed the same way (a firing is work like a record).
* ``state_bytes``: bytes of each key group's chain (its newest full block and the deltas after it), from the keyed
  handles' offsets: no file is read.

Records, calls and timers are stored in the checkpoint's ``properties[LOADS_PROPERTY]`` as compact arrays (float32,
zlib, base64), with the work of the checkpoint's own batch (``batch_work``, not decayed); the ranges in
``properties[RANGES_PROPERTY]``; why they were chosen in ``properties[DECISION_PROPERTY]``
(:class:`AssignmentDecision`). The binary ``_metadata`` format is unchanged.

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

**The forecast, and Flink's ranges while it does not predict the batches.** Ranges are cut for a batch before its
records are seen, from a forecast of its load: ``decayed`` (the figures of the last batches, halving every
``half_life`` batches) or ``recent`` (the last batch alone: a hot spot that stays a few batches, then moves). A
forecast that is wrong costs more than no forecast: ranges narrowed around a hot spot that has moved on are wider
everywhere else, where the next hot spot lands (the trust review measured max/mean 2.30 against Flink's 2.13 for a
hot spot moving every two batches). So every decision measures each forecast's ranges for the last batch on the work
that batch really had: its *gain*, ``1 - largest load under its ranges / largest load under Flink's ranges``. A
forecast's ranges are used once it has been measured on ``evidence`` batches (4) and its average gain (newer batches
counting more: ``score_half_life`` 8 batches), less ``caution`` (2) standard errors of it, reaches ``min_gain``; they
stay in use while that stays at or above 0. Otherwise the batch runs Flink's equal ranges, and the decision says
why. Whatever the forecasts' record, an **account** keeps the promise: it adds, every batch, ``(1 + allowance) *``
the max/mean of the batch's work under Flink's ranges, less the max/mean under the ranges it ran with (capped at
:data:`ACCOUNT_CAP`); balanced ranges run only while it is not negative. Hence over any sequence of batches, the
summed max/mean under balanced ranges is at most ``1 + allowance`` (1.02) times Flink's, plus the excess of one
batch. Each decision also reports what the last batch really did (``last_batch_max_over_mean`` beside
``last_batch_flink_max_over_mean``), not only the forecast's figures.

**Hysteresis**: boundaries move only when it pays. Among the ranges within ``tolerance`` of the optimum, the one
closest to the current boundaries is taken (each boundary moves as little as it can), and it replaces the current
ranges only when the largest load drops by at least ``min_gain + move_cost * moved_share`` of it, where
``moved_share`` is the share of the state that changes owner (what the subtasks then read). When the current ranges'
max/mean load is above ``max_skew`` (1.10 by default), or worse than Flink's ranges, the move's cost is waived, but
never its gain: a move always gains ``min_gain``. A parallelism or max parallelism change makes every range new
anyway: then the forecast's ranges are taken at once (with a policy of :mod:`keygroups.runtime.scaling`, a batch may
change both its parallelism and its boundaries).

**Warm state** is kept per key-group range on the executors. When ranges change, each new range takes over the warm
state of one previous range (:func:`warm_takeover`): the matching, each previous range to at most one new range,
that keeps the most state bytes in place. The decision's ``takeover`` names it for every subtask
(:meth:`AssignmentDecision.warm_range`); its ``moved_bytes`` are the state of the key groups no takeover keeps,
exactly what the subtasks read.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
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
#: ``properties[LOADS_PROPERTY]`` key of the work (calls plus timers) of the checkpoint's own batch, not decayed.
BATCH_WORK = "batch_work"
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
    expected = 4 * length
    try:
        if not isinstance(text, str):
            raise ValueError(f"expected a string, got {type(text).__name__}")
        stream = zlib.decompressobj()
        # never inflate more than one byte past what ``length`` figures take, whatever the stream claims
        raw = stream.decompress(base64.b64decode(text, validate=True), expected + 1)
    except (ValueError, binascii.Error, zlib.error) as e:
        raise CorruptSnapshotError(f"{what} cannot be decoded: {e}") from None
    wanted = f"expected {length} figures of 4 bytes, one per key group ({expected} bytes)"
    if len(raw) > expected:
        raise CorruptSnapshotError(f"{what} holds more than {expected} bytes: {wanted}")
    if not stream.eof:
        raise CorruptSnapshotError(f"{what} is cut short: its compressed stream ends after {len(raw)} bytes, "
                                   f"{wanted}")
    if stream.unused_data:
        raise CorruptSnapshotError(f"{what} has {len(stream.unused_data)} bytes after its compressed stream")
    if len(raw) % 4:
        raise CorruptSnapshotError(f"{what} holds {len(raw)} bytes, not a whole number of 4-byte figures; "
                                   f"{wanted}")
    if len(raw) != expected:
        raise CorruptSnapshotError(f"{what} holds {len(raw) // 4} figures, {wanted}")
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


def key_group_state_bytes(metadata: CheckpointMetadata, previous: CheckpointMetadata | None = None
                          ) -> npt.NDArray[np.float64]:
    """Bytes of each key group's chain (its newest full block and the deltas after it) in ``metadata``, from its
    keyed handles alone (no file is read). Worked out once per metadata object: the batch that commits a checkpoint
    reports it, and the next batch plans its ranges from it. ``previous``: the checkpoint ``metadata`` continues
    (its batch restored it, at the same max parallelism), whose figures are known: then only the blocks
    ``metadata`` wrote itself are looked at (a full block starts its key group's chain anew, a non-empty delta
    adds to it), so a batch's cost grows with what it wrote, not with every key group's chain."""
    key = id(metadata)
    cached = _STATE_BYTES.get(key)
    if cached is not None:
        return cached
    mp = metadata.max_parallelism
    known = None if previous is None or previous.max_parallelism != mp else _STATE_BYTES.get(id(previous))
    if known is not None:
        state = known.copy()
        for h in metadata.keyed_handles:
            if h.checkpoint_id != metadata.checkpoint_id:
                continue
            full, deltas = h.changed_key_groups()
            sizes = np.diff(np.asarray(h.offsets, dtype=np.float64))
            start = h.key_group_range.start
            if full:
                kgs = np.asarray(full, dtype=np.int64)
                state[kgs] = sizes[kgs - start]
            if deltas:
                kgs = np.asarray(deltas, dtype=np.int64)
                state[kgs] += sizes[kgs - start]
    else:
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


def checkpoint_batch_work(metadata: CheckpointMetadata) -> npt.NDArray[np.float64] | None:
    """The work (calls plus timers fired, per key group, not decayed) of the batch that wrote ``metadata``: what
    the load forecast is measured against; None for a checkpoint written before it was stored."""
    stored = metadata.properties.get(LOADS_PROPERTY)
    if not isinstance(stored, dict) or stored.get(BATCH_WORK) is None:
        return None
    return decode_counts(stored[BATCH_WORK], metadata.max_parallelism,
                         f"checkpoint {metadata.checkpoint_id}: properties[{LOADS_PROPERTY!r}][{BATCH_WORK!r}]")


def merged_loads(previous: CheckpointMetadata | None, reports: Sequence[Any], max_parallelism: int,
                 boundaries: tuple[int, ...], half_life: float) -> dict[str, Any]:
    """The ``properties[LOADS_PROPERTY]`` of a new checkpoint: the restored checkpoint's records, calls and timers
    (re-keyed to ``max_parallelism`` if it changed), decayed by one batch, plus what the subtasks' reports
    (:class:`~keygroups.runtime.report.SubtaskReport`) counted over their ranges (``boundaries``); and this batch's
    own work (calls plus timers, ``BATCH_WORK``), which the next batch's decision measures its forecast against."""
    decay = 0.5 ** (1.0 / half_life)
    figures = [np.zeros(max_parallelism) for _ in _STORED]
    if previous is not None:
        records, calls, timers = _stored_counts(previous)
        old = KeyGroupLoads(previous.max_parallelism, records, calls, timers,
                            np.zeros(previous.max_parallelism)).rekeyed(max_parallelism)
        for target, value in zip(figures, (old.records, old.calls, old.timers)):
            target += decay * value
    batch = [np.zeros(max_parallelism) for _ in _STORED]
    for r in reports:
        own = KeyGroupRange(boundaries[r.subtask], boundaries[r.subtask + 1] - 1)
        for (_, key), target in zip(_STORED, batch):
            counts = getattr(r, key)
            if counts is not None:
                target[own.start:own.end + 1] += decode_counts(counts, len(own), f"subtask {r.subtask}'s {key}")
    return {**{name: encode_counts(old + new) for (name, _), old, new in zip(_STORED, figures, batch)},
            BATCH_WORK: encode_counts(batch[1] + batch[2]), "half_life": half_life}


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


#: The load forecasts a balanced assignment measures every batch: the decayed figures of the last batches, and the
#: last batch alone (which follows a hot spot that stays a few batches and then moves).
FORECASTS = ("decayed", "recent")
#: The least spread a forecast's gains are taken to have: a few batches that happened to agree prove little.
_SPREAD_FLOOR = 0.1
#: The most the account of a balanced assignment holds, in batches' max/mean: a long good run never buys a long
#: bad one.
ACCOUNT_CAP = 2.0


@dataclass(frozen=True)
class ForecastRecord:
    """How each load forecast's ranges did on the batches that came, carried from decision to decision (see the
    module docs). Per forecast: ``scores``, the gain of its ranges over Flink's ranges on the batches measured
    (1 - their largest load / Flink's ranges' largest load), averaged with the newer batches counting more, and
    ``weights`` (that average's weight), ``measured`` (batches measured, at most 1000), ``last_gains`` (the gain
    on the last batch). ``cuts``: each forecast's ranges for this batch, which the next decision measures on it.
    ``account``: the sum over the batches so far of ``(1 + allowance) * max/mean under Flink's ranges - max/mean
    under the ranges the batch ran with`` (capped at :data:`ACCOUNT_CAP`); balanced ranges run only while it is not
    negative. ``used``: the forecast whose ranges this batch runs, None for Flink's ranges."""

    used: str | None = None
    cuts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    measured: dict[str, int] = field(default_factory=dict)
    last_gains: dict[str, float] = field(default_factory=dict)
    account: float = 0.0
    squares: dict[str, float] = field(default_factory=dict)

    def spread(self, name: str) -> float:
        """How much ``name``'s gains vary from batch to batch (their standard deviation, newer batches counting
        more)."""
        return math.sqrt(max(0.0, self.squares.get(name, 0.0) - self.scores.get(name, 0.0) ** 2))

    def to_json(self) -> dict[str, Any]:
        return {"used": self.used, "account": round(self.account, 9),
                "forecasts": {name: {"ranges": list(self.cuts[name]) if name in self.cuts else None,
                                     "score": round(self.scores.get(name, 0.0), 9),
                                     "weight": round(self.weights.get(name, 0.0), 9),
                                     "square": round(self.squares.get(name, 0.0), 9),
                                     "measured": self.measured.get(name, 0),
                                     "last_gain": (None if name not in self.last_gains
                                                   else round(self.last_gains[name], 9))}
                              for name in FORECASTS if name in self.cuts or name in self.scores}}

    @classmethod
    def from_json(cls, data: Any, max_parallelism: int, parallelism: int, what: str) -> ForecastRecord:
        """The record a decision stored (:meth:`to_json`) for a batch at ``parallelism`` of ``max_parallelism`` key
        groups; CorruptSnapshotError naming ``what`` if it is malformed."""
        try:
            if not isinstance(data, dict) or not isinstance(data.get("forecasts"), dict):
                raise ValueError("expected an object with 'used', 'account' and 'forecasts'")
            used = data.get("used")
            if used is not None and used not in FORECASTS:
                raise ValueError(f"'used' must be one of {list(FORECASTS)} or null, got {used!r}")
            record = cls(used=used, account=_finite(data.get("account"), "account"))
            for name, figures in data["forecasts"].items():
                if name not in FORECASTS or not isinstance(figures, dict):
                    raise ValueError(f"unknown forecast {name!r}; known: {list(FORECASTS)}")
                if figures.get("ranges") is not None:
                    cut = check_boundaries(figures["ranges"], max_parallelism)
                    if len(cut) != parallelism + 1:
                        raise ValueError(f"forecast {name!r} has {len(cut) - 1} ranges for parallelism {parallelism}")
                    record.cuts[name] = cut
                measured = figures.get("measured")
                if isinstance(measured, bool) or not isinstance(measured, int) or measured < 0:
                    raise ValueError(f"forecast {name!r}: 'measured' must be an int >= 0, got {measured!r}")
                record.measured[name] = measured
                record.scores[name] = _finite(figures.get("score"), f"{name}.score")
                record.weights[name] = _finite(figures.get("weight"), f"{name}.weight")
                record.squares[name] = _finite(figures.get("square", 0.0), f"{name}.square")
                if figures.get("last_gain") is not None:
                    record.last_gains[name] = _finite(figures["last_gain"], f"{name}.last_gain")
            return record
        except (TypeError, ValueError) as e:
            raise CorruptSnapshotError(f"{what} is not a forecast record: {e}") from None


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class AssignmentDecision:
    """The ranges a batch runs with and why: ``boundaries`` (``previous``: the restored checkpoint's, None
    without one or when its max parallelism differs); ``moved`` whether they differ from ``previous``; ``reason``
    in words; the load's max/mean under the chosen ranges, under ``previous`` (None when the parallelism changed)
    and under Flink's ranges at this parallelism, all three on the load the ranges were chosen for (the forecast);
    ``takeover``: for each subtask, the subtask of ``previous`` whose warm state it takes over (None: it restores
    from the checkpoint), the matching that keeps the most state in place (:func:`warm_takeover`);
    ``moved_key_groups`` and ``moved_bytes``: the key groups that change owner under that takeover and their state,
    exactly what the subtasks read when warm state is at hand; ``restore_bytes``: the state of the ranges that
    changed (what they read without warm state); ``hot_key_groups`` that no range can balance.

    What the previous batch really did, measured on its own work (not a forecast): ``last_batch_max_over_mean``
    under the ranges it ran with and ``last_batch_flink_max_over_mean`` under Flink's ranges (None when not
    known). ``forecast``: how the balanced assignment's load forecasts did (None for Flink's ranges)."""

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
    takeover: tuple[int | None, ...] = ()
    last_batch_max_over_mean: float | None = None
    last_batch_flink_max_over_mean: float | None = None
    forecast: ForecastRecord | None = None

    @property
    def ranges(self) -> list[KeyGroupRange]:
        return ranges_of(self.boundaries)

    def warm_range(self, subtask: int) -> KeyGroupRange | None:
        """The range of the previous batch whose warm state ``subtask`` takes over (None: none; it restores)."""
        j = self.takeover[subtask] if subtask < len(self.takeover) else None
        if j is None or self.previous is None:
            return None
        return KeyGroupRange(self.previous[j], self.previous[j + 1] - 1)

    def warm_ranges(self) -> tuple[tuple[int, int] | None, ...] | None:
        """Per subtask, the ``(first, last)`` key groups of the previous batch's range whose warm state it takes
        over (None: none, it restores what it owns), as :class:`~keygroups.runtime.spec.KeyedTaskSpec` ships them;
        None when the decision knows no previous ranges (the first batch, another max parallelism)."""
        if self.previous is None:
            return None
        return tuple(None if r is None else (r.start, r.end)
                     for r in (self.warm_range(i) for i in range(len(self.boundaries) - 1)))

    def summary(self) -> str:
        """The decision in a few words, for the batch's log line: the forecast load's max/mean under the chosen
        ranges, and what the last batch measured under its ranges and Flink's."""
        before = "" if self.max_over_mean_before is None else f", {self.max_over_mean_before:.2f} before"
        moved = (f"; {self.moved_key_groups} key groups moved ({self.moved_bytes:,} B, read by the subtasks that take "
                 f"them over)" if self.moved else "")
        hot = f"; hot key groups {[h.key_group for h in self.hot_key_groups]}" if self.hot_key_groups else ""
        last = ("" if self.last_batch_max_over_mean is None else
                f"; the last batch measured {self.last_batch_max_over_mean:.2f} (Flink's ranges "
                f"{self.last_batch_flink_max_over_mean or 0.0:.2f})")
        return (f"{self.assignment}: {self.reason}; load max/mean {self.max_over_mean:.2f}{before} (Flink's ranges "
                f"{self.flink_max_over_mean:.2f}){moved}{last}{hot}")

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
                "hot_key_groups": [h.to_json() for h in self.hot_key_groups],
                "takeover": list(self.takeover),
                "last_batch": (None if self.last_batch_max_over_mean is None else
                               {"max_over_mean": round(self.last_batch_max_over_mean, 4),
                                "flink_max_over_mean": round(self.last_batch_flink_max_over_mean or 0.0, 4)}),
                "forecast": None if self.forecast is None else self.forecast.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any], boundaries: Sequence[int]) -> AssignmentDecision:
        """The decision a checkpoint stored (:meth:`to_json`), with its ``boundaries`` (its ranges property);
        ``previous`` is None for a checkpoint written before it was stored. KeyError/TypeError/ValueError on a
        malformed one."""
        before = data.get("max_over_mean_before")
        previous = data.get("previous")
        last, forecast = data.get("last_batch"), data.get("forecast")
        return cls(assignment=str(data["assignment"]), boundaries=tuple(int(b) for b in boundaries),
                   previous=None if previous is None else tuple(int(b) for b in previous), moved=bool(data["moved"]),
                   reason=str(data["reason"]), max_over_mean=float(data["max_over_mean"]),
                   max_over_mean_before=None if before is None else float(before),
                   flink_max_over_mean=float(data["flink_max_over_mean"]),
                   moved_key_groups=int(data.get("moved_key_groups", 0)), moved_bytes=int(data.get("moved_bytes", 0)),
                   restore_bytes=int(data.get("restore_bytes", 0)), state_bytes=int(data.get("state_bytes", 0)),
                   hot_key_groups=[HotKeyGroup.from_json(h) for h in data.get("hot_key_groups") or ()],
                   takeover=tuple(None if j is None else int(j) for j in data.get("takeover") or ()),
                   last_batch_max_over_mean=None if last is None else float(last["max_over_mean"]),
                   last_batch_flink_max_over_mean=None if last is None else float(last["flink_max_over_mean"]),
                   forecast=None if forecast is None else ForecastRecord.from_json(
                       forecast, int(boundaries[-1]), len(boundaries) - 1, "the decision's forecast"))


def warm_takeover(before: Sequence[int], after: Sequence[int], state_bytes: npt.ArrayLike
                  ) -> tuple[int | None, ...]:
    """For each range of ``after``, the range of ``before`` (by index) whose warm state its subtask takes over, or
    None (it restores what it owns from the checkpoint): the matching, each range of ``before`` taken by at most one
    range of ``after``, that keeps the most state bytes where they are (then the most key groups). A subtask then
    reads exactly the key groups its range does not share with the range it takes over, so the bytes read are the
    fewest any takeover allows (a greedy choice, subtask by subtask, reads up to the whole moved state again).

    Both sets of ranges are contiguous over the same key groups, so two overlapping pairs never cross (if range
    ``i`` of ``after`` overlaps ``j`` of ``before`` and ``i' > i`` overlaps ``j'``, then ``j' >= j``): the best
    matching is a longest-path pass over the ``p_before + p_after - 1`` overlapping pairs, in order."""
    state = np.asarray(state_bytes, dtype=np.float64)
    b, a = tuple(int(x) for x in before), tuple(int(x) for x in after)
    if b[-1] != a[-1] or len(state) != a[-1]:
        raise ValueError(f"ranges {b} and {a} must cover the same {len(state)} key groups")
    prefix = np.concatenate([[0.0], np.cumsum(state)])
    unit = a[-1] + 1   # a pair's weight: its bytes, then its key groups (exact integers)
    pairs: list[tuple[int, int, int]] = []
    i = j = 0
    while i < len(a) - 1 and j < len(b) - 1:
        low, high = max(a[i], b[j]), min(a[i + 1], b[j + 1])
        if high > low:
            pairs.append((i, j, int(round(prefix[high] - prefix[low])) * unit + (high - low)))
        i, j = i + (a[i + 1] <= b[j + 1]), j + (b[j + 1] <= a[i + 1])
    first_new: dict[int, int] = {}
    first_old: dict[int, int] = {}
    chain: list[int] = []          # best weight of a matching whose last pair is pair k
    previous: list[int] = []       # that matching's pair before k (-1: none)
    best: list[tuple[int, int]] = []   # best (weight, last pair) among pairs 0..k
    for k, (i, j, weight) in enumerate(pairs):
        first_new.setdefault(i, k)
        first_old.setdefault(j, k)
        # the pairs before both the first of range i and the first of range j are those left of (i, j) in both
        m = min(first_new[i], first_old[j])
        value, last = best[m - 1] if m > 0 else (0, -1)
        chain.append(value + weight)
        previous.append(last)
        best.append(max(best[k - 1], (chain[k], k)) if k else (chain[k], k))
    takeover: list[int | None] = [None] * (len(a) - 1)
    k = best[-1][1] if best else -1
    while k >= 0:
        takeover[pairs[k][0]] = pairs[k][1]
        k = previous[k]
    return tuple(takeover)


def moved_figures(before: Sequence[int], after: Sequence[int], state_bytes: npt.ArrayLike,
                  takeover: Sequence[int | None] | None = None) -> tuple[int, int, int]:
    """``(key groups that change owner, their state bytes, state bytes of the ranges that changed)`` from ranges
    ``before`` to ``after`` (both boundaries over the same key groups). A key group changes owner when the warm
    state its new subtask takes over (``takeover``, :func:`warm_takeover`'s best matching by default) does not hold
    it: those bytes are exactly what the subtasks read. A range is unchanged when the same range existed before,
    whichever subtask owned it; the ranges that changed hold what a restore without warm state reads."""
    state = np.asarray(state_bytes, dtype=np.float64)
    b, a = tuple(before), tuple(after)
    match = warm_takeover(b, a, state) if takeover is None else tuple(takeover)
    if len(match) != len(a) - 1:
        raise ValueError(f"takeover must name one previous range (or None) per range, got {len(match)} for "
                         f"{len(a) - 1} ranges")
    kept = np.zeros(len(state), dtype=bool)
    for i, j in enumerate(match):
        if j is not None:
            kept[max(a[i], b[j]):min(a[i + 1], b[j + 1])] = True
    unchanged = {(b[i], b[i + 1]) for i in range(len(b) - 1)}   # warm state is kept per range
    changed = np.zeros(len(state), dtype=bool)
    for i in range(len(a) - 1):
        if (a[i], a[i + 1]) not in unchanged:
            changed[a[i]:a[i + 1]] = True
    return int((~kept).sum()), int(state[~kept].sum()), int(state[changed].sum())


@runtime_checkable
class Assignment(Protocol):
    """Chooses each batch's ranges from the checkpoint it restores (None for a job's first batch)."""

    name: str

    def choose(self, previous: CheckpointMetadata | None, max_parallelism: int,
               parallelism: int) -> AssignmentDecision: ...


def _context(previous: CheckpointMetadata | None, max_parallelism: int
             ) -> tuple[KeyGroupLoads, tuple[int, ...] | None, KeyGroupLoads | None]:
    """The restored checkpoint's loads (for ``max_parallelism``), its ranges (None when there is none, or its max
    parallelism differs: its ranges then number other key groups) and its loads as it stores them (None without
    one)."""
    if previous is None:
        return KeyGroupLoads.empty(max_parallelism), None, None
    own = checkpoint_loads(previous)
    before = checkpoint_boundaries(previous) if previous.max_parallelism == max_parallelism else None
    return own.rekeyed(max_parallelism), before, own


@dataclass(frozen=True)
class _LastBatch:
    """What the batch that wrote the restored checkpoint did, on its own work (its key groups, its parallelism):
    ``load`` per key group (its work's share blended with the state's, as :meth:`KeyGroupLoads.blend`), the ranges
    it ran with and Flink's, and the max/mean under each."""

    work: npt.NDArray[np.float64]
    load: npt.NDArray[np.float64]
    boundaries: tuple[int, ...]
    flink: tuple[int, ...]
    max_over_mean: float
    flink_max_over_mean: float


def _last_batch(previous: CheckpointMetadata | None, own: KeyGroupLoads | None,
                state_weight: float) -> _LastBatch | None:
    """The restored checkpoint's own batch, measured; None without one, or when it stored no work or had none."""
    if previous is None or own is None:
        return None
    work = checkpoint_batch_work(previous)
    if work is None or not work.any():
        return None
    load = KeyGroupLoads(own.max_parallelism, work, work, np.zeros_like(work), own.state_bytes).blend(state_weight)
    ran, flink = checkpoint_boundaries(previous), flink_boundaries(previous.max_parallelism, previous.parallelism)
    return _LastBatch(work, load, ran, flink, max_over_mean(range_loads(load, ran)),
                      max_over_mean(range_loads(load, flink)))


def _decision(name: str, boundaries: tuple[int, ...], before: tuple[int, ...] | None, reason: str,
              load: npt.NDArray[np.float64], loads: KeyGroupLoads, parallelism: int, last: _LastBatch | None,
              forecast: ForecastRecord | None = None) -> AssignmentDecision:
    mp = loads.max_parallelism
    takeover = (warm_takeover(before, boundaries, loads.state_bytes) if before is not None
                else (None,) * parallelism)
    moved = (0, 0, 0) if before is None else moved_figures(before, boundaries, loads.state_bytes, takeover)
    same_p = before is not None and len(before) == len(boundaries)
    return AssignmentDecision(
        assignment=name, boundaries=boundaries, previous=before, moved=before is not None and before != boundaries,
        reason=reason, max_over_mean=max_over_mean(range_loads(load, boundaries)),
        max_over_mean_before=max_over_mean(range_loads(load, before)) if same_p and before is not None else None,
        flink_max_over_mean=max_over_mean(range_loads(load, flink_boundaries(mp, parallelism))),
        moved_key_groups=moved[0], moved_bytes=moved[1], restore_bytes=moved[2],
        state_bytes=int(loads.state_bytes.sum()), hot_key_groups=hot_key_groups(load, parallelism),
        takeover=takeover, last_batch_max_over_mean=None if last is None else last.max_over_mean,
        last_batch_flink_max_over_mean=None if last is None else last.flink_max_over_mean, forecast=forecast)


@dataclass(frozen=True)
class FlinkRanges:
    """Flink's equal ranges (``KeyGroupRangeAssignment``), whatever the load: ownership exactly as Flink's. The
    default. ``state_weight`` only blends the load figures the decision reports."""

    state_weight: float = 0.1
    name: str = field(default="flink", init=False)

    def choose(self, previous: CheckpointMetadata | None, max_parallelism: int,
               parallelism: int) -> AssignmentDecision:
        p, mp = check_parallelism(parallelism, max_parallelism)
        loads, before, own = _context(previous, mp)
        boundaries = flink_boundaries(mp, p)
        reason = ("Flink's equal ranges" if before is None or before == boundaries
                  else "Flink's equal ranges (the restored checkpoint had other ranges)")
        return _decision(self.name, boundaries, before, reason, loads.blend(self.state_weight), loads, p,
                         _last_batch(previous, own, self.state_weight))


def _number(owner: str, label: str, value: Any, low: float, high: float, *, low_open: bool = False) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not (low < value if low_open else low <= value) or not value <= high):
        bounds = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ValueError(f"{owner}.{label} must be a number in {bounds}, got {value!r}")


@dataclass(frozen=True)
class BalancedRanges:
    """Contiguous ranges balanced by a load forecast, used only while the forecast predicts the batches (see the
    module docs).

    ``state_weight`` (in [0, 1]) is the state bytes' part of a key group's load, the rest being its work (calls of
    the function and timers); ``half_life`` (batches) how fast old figures count less in the decayed forecast.
    ``tolerance``: how far above the optimum the largest load may stay to keep boundaries where they are;
    boundaries move when the largest load drops by ``min_gain + move_cost * moved_share`` of it (``moved_share``:
    the share of the state that changes owner, which the subtasks read), or by ``min_gain`` alone (the move's cost
    waived, never the gain) when the current ranges' max/mean is above ``max_skew`` or worse than Flink's ranges.

    The forecast's ranges are used once they have been measured on ``evidence`` batches and gained at least
    ``min_gain`` over Flink's ranges on them: on average (the newer batches counting more: ``score_half_life``
    batches), less ``caution`` standard errors of that average (a forecast whose gains swing from batch to batch
    is not trusted on a lucky run); and for as long as that stays at or above 0. Otherwise the batch runs Flink's
    ranges. Whatever the forecast's record, the batches on balanced ranges add up to at most ``allowance`` more
    max/mean than Flink's ranges would have had, plus one batch's excess: the decision keeps that account."""

    state_weight: float = 0.1
    tolerance: float = 0.03
    min_gain: float = 0.05
    move_cost: float = 0.1
    half_life: float = DEFAULT_HALF_LIFE
    max_skew: float = 1.10
    allowance: float = 0.02
    evidence: int = 4
    score_half_life: float = 8.0
    caution: float = 2.0
    name: str = field(default="balanced", init=False)

    def __post_init__(self) -> None:
        owner = "BalancedRanges"
        _number(owner, "state_weight", self.state_weight, 0, 1)
        _number(owner, "min_gain", self.min_gain, 0, 1)
        _number(owner, "move_cost", self.move_cost, 0, 100)
        _number(owner, "allowance", self.allowance, 0, 1)
        _number(owner, "caution", self.caution, 0, 100)
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, (int, float)) or not \
                0 <= self.tolerance < 1:
            raise ValueError(f"BalancedRanges.tolerance must be a number in [0, 1), got {self.tolerance!r}")
        if isinstance(self.max_skew, bool) or not isinstance(self.max_skew, (int, float)) or not self.max_skew >= 1:
            raise ValueError(f"BalancedRanges.max_skew must be a number >= 1 (max over mean load), got "
                             f"{self.max_skew!r}")
        for label, value in (("half_life", self.half_life), ("score_half_life", self.score_half_life)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"BalancedRanges.{label} must be a number of batches > 0, got {value!r}")
        if isinstance(self.evidence, bool) or not isinstance(self.evidence, int) or self.evidence < 1:
            raise ValueError(f"BalancedRanges.evidence must be an int >= 1 (batches the forecast is measured on "
                             f"before its ranges are used), got {self.evidence!r}")

    def choose(self, previous: CheckpointMetadata | None, max_parallelism: int,
               parallelism: int) -> AssignmentDecision:
        p, mp = check_parallelism(parallelism, max_parallelism)
        loads, before, own = _context(previous, mp)
        last = _last_batch(previous, own, self.state_weight)
        record = self.measure(previous, last)
        flink = flink_boundaries(mp, p)
        same_p = before is not None and len(before) == p + 1
        anchor = before if same_p and before is not None else flink
        forecasts = {}
        decayed = loads.blend(self.state_weight)
        if decayed.any():
            forecasts["decayed"] = decayed
        if last is not None and own is not None:
            forecasts["recent"] = KeyGroupLoads(own.max_parallelism, last.work, last.work, np.zeros_like(last.work),
                                                own.state_bytes).rekeyed(mp).blend(self.state_weight)
        cuts = {name: balanced_boundaries(load, p, previous=anchor, tolerance=self.tolerance)
                for name, load in forecasts.items()}

        def decide(boundaries: tuple[int, ...], reason: str, used: str | None = None) -> AssignmentDecision:
            load = forecasts.get(used or "decayed", decayed)
            return _decision(self.name, boundaries, before, reason, load, loads, p, last,
                             dataclasses.replace(record, used=used, cuts=cuts))

        if not forecasts:
            return decide(flink, "no load measured yet: Flink's equal ranges")
        used, why = self._trusted(record, [name for name in FORECASTS if name in forecasts])
        if used is None:
            return decide(flink, why)
        load, candidate = forecasts[used], cuts[used]
        if not same_p or before is None:
            what = ("first balanced ranges" if before is None else
                    f"parallelism {len(before) - 1} -> {p}: every range is new")
            return decide(candidate, f"{what}; ranges cut by the {used} load ({why})", used)
        if candidate == before:
            return decide(before, f"ranges kept: within {self.tolerance:.0%} of the best balance of the {used} "
                                  f"load ({why})", used)
        current_max, new_max = float(range_loads(load, before).max()), float(range_loads(load, candidate).max())
        flink_max = float(range_loads(load, flink).max())
        _, moved_bytes, _ = moved_figures(before, candidate, loads.state_bytes)
        total_state = float(loads.state_bytes.sum())
        moved_share = moved_bytes / total_state if total_state > 0 else 0.0
        gain = (current_max - new_max) / current_max if current_max > 0 else 0.0
        current_skew = current_max * p / float(load.sum())
        if current_skew > self.max_skew or current_max > flink_max:
            needed = self.min_gain
            because = (f"max/mean {current_skew:.3f} is above max_skew {self.max_skew}" if current_skew > self.max_skew
                       else "the current ranges are worse than Flink's")
            cost = f"{because}: the move's cost is waived, not the {self.min_gain:.1%} gain"
        else:
            needed = self.min_gain + self.move_cost * moved_share
            cost = f"needed {needed:.1%} to move {moved_share:.1%} of the state"
        if gain < needed:
            return decide(before, f"ranges kept: moving would cut the largest {used} load by {gain:.1%}, less than "
                                  f"the {needed:.1%} it must gain ({cost}; {why})", used)
        return decide(candidate, f"boundaries moved: the largest {used} load drops by {gain:.1%} ({cost}; {why})",
                      used)

    def measure(self, previous: CheckpointMetadata | None, last: _LastBatch | None) -> ForecastRecord:
        """The forecasts' record after the restored checkpoint's batch: each forecast's ranges for that batch (its
        decision's record) measured on the work it really had, and the account (see :class:`ForecastRecord`);
        ``used`` is still the forecast that batch used."""
        before = ForecastRecord()
        if previous is not None:
            stored = previous.properties.get(DECISION_PROPERTY)
            if isinstance(stored, dict) and stored.get("forecast") is not None:
                before = ForecastRecord.from_json(
                    stored["forecast"], previous.max_parallelism, previous.parallelism,
                    f"checkpoint {previous.checkpoint_id}: properties[{DECISION_PROPERTY!r}]['forecast']")
        if last is None:   # nothing to measure: the record stands as it was
            return dataclasses.replace(before, cuts={}, last_gains={})
        decay = 0.5 ** (1.0 / self.score_half_life)
        scores, weights, measured, gains = dict(before.scores), dict(before.weights), dict(before.measured), {}
        squares = dict(before.squares)
        flink_max = float(range_loads(last.load, last.flink).max())
        for name, cut in before.cuts.items():
            gain = 1.0 - float(range_loads(last.load, cut).max()) / flink_max
            weight = decay * weights.get(name, 0.0) + 1.0
            scores[name] = (decay * weights.get(name, 0.0) * scores.get(name, 0.0) + gain) / weight
            squares[name] = (decay * weights.get(name, 0.0) * squares.get(name, 0.0) + gain * gain) / weight
            weights[name], measured[name], gains[name] = weight, min(measured.get(name, 0) + 1, 1000), gain
        account = min(ACCOUNT_CAP, before.account + (1 + self.allowance) * last.flink_max_over_mean
                      - last.max_over_mean)
        return ForecastRecord(before.used, {}, scores, weights, measured, gains, account, squares)

    def _trusted(self, record: ForecastRecord, names: list[str]) -> tuple[str | None, str]:
        """The forecast whose ranges the batch may use (None: Flink's ranges), and why."""
        ready = [name for name in names if record.measured.get(name, 0) >= self.evidence]
        if not ready:
            most = max((record.measured.get(name, 0) for name in names), default=0)
            return None, (f"Flink's equal ranges until the load forecast has been measured on {self.evidence} "
                          f"batches ({most} so far)")
        def sure(name: str) -> float:
            spread = max(record.spread(name), _SPREAD_FLOOR)
            return record.scores.get(name, 0.0) - self.caution * spread / math.sqrt(max(record.weights[name], 1.0))

        best = max(ready, key=sure)
        score, average = sure(best), record.scores[best]
        gained = f"{'gained' if average >= 0 else 'lost'} {abs(average):.1%} against Flink's ranges on the last batches"
        needed = 0.0 if record.used is not None else self.min_gain
        if score < needed:
            return None, (f"Flink's equal ranges: the past does not predict the batches (ranges cut from the {best} "
                          f"load {gained}, {score:.1%} counting their spread; {needed:.1%} needed)")
        if record.account < 0:
            return None, (f"Flink's equal ranges: the batches on balanced ranges ran {-record.account:.3f} max/mean "
                          f"above Flink's ranges and the {self.allowance:.0%} allowed; Flink's ranges until that is "
                          f"made up")
        return best, f"its ranges {gained}, {score:.1%} counting their spread"


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


__all__ = ["Assignment", "AssignmentDecision", "BalancedRanges", "FlinkRanges", "ForecastRecord", "HotKeyGroup",
           "KeyGroupLoads", "ACCOUNT_CAP", "BATCH_WORK", "DECISION_PROPERTY", "FORECASTS", "LOADS_PROPERTY",
           "RANGES_PROPERTY", "balanced_boundaries", "checkpoint_batch_work", "checkpoint_boundaries",
           "checkpoint_loads", "hot_key_groups", "max_over_mean", "merged_loads", "moved_figures", "range_loads",
           "resolve_assignment", "warm_takeover"]
