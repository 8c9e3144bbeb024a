"""Key-group ranges and Flink's assignment arithmetic (``KeyGroupRangeAssignment``), bit-exact."""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from keygroups._native import hashing

#: Flink's upper bound for max parallelism (``KeyGroupRangeAssignment.UPPER_BOUND_MAX_PARALLELISM``, 2^15), as the
#: compiled kernels define it.
UPPER_BOUND_MAX_PARALLELISM: int = hashing.UPPER_BOUND_MAX_PARALLELISM
#: Flink's lower bound for a *default* max parallelism (``DEFAULT_LOWER_BOUND_MAX_PARALLELISM``).
DEFAULT_LOWER_BOUND_MAX_PARALLELISM = 1 << 7


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    return operator.index(value)


def check_max_parallelism(max_parallelism: Any) -> int:
    """max_parallelism as an int, or a ValueError naming the allowed range."""
    mp = _as_int(max_parallelism, "max_parallelism")
    if not 1 <= mp <= UPPER_BOUND_MAX_PARALLELISM:
        raise ValueError(
            f"max_parallelism must be in [1, {UPPER_BOUND_MAX_PARALLELISM}] (Flink's upper bound, 2^15), got {mp}"
        )
    return mp


def check_parallelism(parallelism: Any, max_parallelism: Any) -> tuple[int, int]:
    """(parallelism, max_parallelism) as ints, or a ValueError naming the allowed range."""
    mp = check_max_parallelism(max_parallelism)
    p = _as_int(parallelism, "parallelism")
    if not 1 <= p <= mp:
        raise ValueError(
            f"parallelism must be in [1, max_parallelism={mp}], got {p}: a subtask owns at least one key group"
        )
    return p, mp


class KeyGroupRange:
    """An inclusive range of key groups ``[start, end]``, as Flink's ``KeyGroupRange``.

    The empty range is ``KeyGroupRange.empty()`` (Flink's ``EMPTY_KEY_GROUP_RANGE``, stored as ``[0, -1]``);
    ``KeyGroupRange(s, s - 1)`` also builds it.
    """

    __slots__ = ("_start", "_end")

    def __init__(self, start: int, end: int) -> None:
        start = _as_int(start, "start")
        end = _as_int(end, "end")
        if start < 0:
            raise ValueError(f"a key group range starts at a key group >= 0, got start={start}")
        if end < start - 1:
            raise ValueError(f"a key group range needs start <= end (or end = start - 1 for empty), got [{start}, {end}]")
        if end > UPPER_BOUND_MAX_PARALLELISM - 1:
            raise ValueError(f"key group {end} is past the last possible key group {UPPER_BOUND_MAX_PARALLELISM - 1}")
        if end == start - 1:
            start, end = 0, -1
        self._start = start
        self._end = end

    @classmethod
    def empty(cls) -> KeyGroupRange:
        return cls(0, -1)

    @property
    def start(self) -> int:
        """First key group (inclusive)."""
        return self._start

    @property
    def end(self) -> int:
        """Last key group (inclusive); ``start - 1`` for the empty range."""
        return self._end

    def __len__(self) -> int:
        return self._end - self._start + 1

    def __bool__(self) -> bool:
        return self._end >= self._start

    def __contains__(self, key_group: object) -> bool:
        if isinstance(key_group, bool) or not isinstance(key_group, (int, np.integer)):
            return False
        return self._start <= int(key_group) <= self._end

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._start, self._end + 1))

    def intersection(self, other: KeyGroupRange) -> KeyGroupRange:
        """The key groups in both ranges (empty if they do not overlap)."""
        start = max(self._start, other._start)
        end = min(self._end, other._end)
        return KeyGroupRange(start, end) if start <= end else KeyGroupRange.empty()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyGroupRange):
            return NotImplemented
        return self._start == other._start and self._end == other._end

    def __hash__(self) -> int:
        return hash((KeyGroupRange, self._start, self._end))

    def __repr__(self) -> str:
        if not self:
            return "KeyGroupRange.empty()"
        return f"KeyGroupRange({self._start}, {self._end})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (KeyGroupRange, (self._start, self._end))


def key_group_range(max_parallelism: int, parallelism: int, operator_index: int) -> KeyGroupRange:
    """The key groups subtask ``operator_index`` of ``parallelism`` owns (Flink's
    ``computeKeyGroupRangeForOperatorIndex``): contiguous, and together the subtasks cover ``[0, max_parallelism)``."""
    p, mp = check_parallelism(parallelism, max_parallelism)
    i = _as_int(operator_index, "operator_index")
    if not 0 <= i < p:
        raise ValueError(f"operator_index must be in [0, parallelism={p}), got {i}")
    start = (i * mp + p - 1) // p
    end = ((i + 1) * mp - 1) // p
    return KeyGroupRange(start, end)


@overload
def operator_index_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int: ...
@overload
def operator_index_for_key_group(
    max_parallelism: int, parallelism: int, key_group: npt.ArrayLike
) -> npt.NDArray[np.int32]: ...
def operator_index_for_key_group(max_parallelism: int, parallelism: int, key_group: Any) -> Any:
    """The subtask that owns ``key_group`` (Flink's ``computeOperatorIndexForKeyGroup``: kg * p / max_p).

    ``key_group`` may be an int or an array of key groups (then an int32 array comes back)."""
    p, mp = check_parallelism(parallelism, max_parallelism)
    if isinstance(key_group, (int, np.integer)) and not isinstance(key_group, bool):
        kg = int(key_group)
        if not 0 <= kg < mp:
            raise ValueError(f"key_group must be in [0, max_parallelism={mp}), got {kg}")
        return kg * p // mp
    groups = np.asarray(key_group)
    if groups.ndim != 1 or groups.dtype.kind not in "iu":
        raise TypeError(f"key_group must be an int or a 1-D integer array, got {type(key_group).__name__}"
                        f"{' of dtype ' + str(groups.dtype) if groups.ndim else ''}")
    if groups.size:
        lo, hi = int(groups.min()), int(groups.max())
        if lo < 0 or hi >= mp:
            pos = int(np.argmax((groups < 0) | (groups >= mp)))
            bad = int(groups[pos])
            raise ValueError(f"key_group at position {pos} must be in [0, max_parallelism={mp}), got {bad}")
    return hashing.operators_from_groups(np.ascontiguousarray(groups, dtype=np.int16), mp, p)


def default_max_parallelism(parallelism: int) -> int:
    """Flink's ``computeDefaultMaxParallelism``: ``parallelism * 1.5`` rounded up to a power of two, within
    [128, 32768]."""
    p = _as_int(parallelism, "parallelism")
    if not 1 <= p <= UPPER_BOUND_MAX_PARALLELISM:
        raise ValueError(f"parallelism must be in [1, {UPPER_BOUND_MAX_PARALLELISM}], got {p}")
    target = p + p // 2
    power = 1 << (target - 1).bit_length() if target > 1 else 1
    return min(max(power, DEFAULT_LOWER_BOUND_MAX_PARALLELISM), UPPER_BOUND_MAX_PARALLELISM)


# ---- explicit assignments: any contiguous ranges, Flink's or balanced ---------------------------------------------


def flink_boundaries(max_parallelism: int, parallelism: int) -> tuple[int, ...]:
    """Flink's ranges as boundaries: ``b[i]`` is the first key group of subtask ``i`` (``key_group_range``'s start)
    and ``b[parallelism] == max_parallelism``, so subtask ``i`` owns ``[b[i], b[i + 1] - 1]``."""
    p, mp = check_parallelism(parallelism, max_parallelism)
    return (*((i * mp + p - 1) // p for i in range(p)), mp)


def check_boundaries(boundaries: Any, max_parallelism: int) -> tuple[int, ...]:
    """``boundaries`` as a tuple of ints if they cut ``[0, max_parallelism)`` into contiguous non-empty ranges (the
    first 0, the last ``max_parallelism``, strictly ascending, at most ``max_parallelism + 1`` of them); a
    ValueError naming what is wrong otherwise."""
    mp = check_max_parallelism(max_parallelism)
    if isinstance(boundaries, (str, bytes)) or not hasattr(boundaries, "__len__"):
        raise TypeError(f"key-group boundaries must be a sequence of ints, got {type(boundaries).__name__}")
    values = [_as_int(b, "a key-group boundary") for b in boundaries]
    if len(values) < 2 or values[0] != 0 or values[-1] != mp:
        raise ValueError(f"key-group boundaries must run from 0 to max_parallelism={mp} (one more than the "
                         f"parallelism), got {values[:8]}{'...' if len(values) > 8 else ''}")
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            raise ValueError(f"key-group boundaries must be strictly ascending (every subtask owns at least one key "
                             f"group), got {values[i - 1]} then {values[i]} at position {i}")
    return tuple(values)


def ranges_of(boundaries: tuple[int, ...]) -> list[KeyGroupRange]:
    """The key-group range of each subtask of checked ``boundaries`` (see :func:`check_boundaries`)."""
    return [KeyGroupRange(boundaries[i], boundaries[i + 1] - 1) for i in range(len(boundaries) - 1)]


def operator_indexes_for_boundaries(boundaries: tuple[int, ...], key_groups: npt.ArrayLike) -> npt.NDArray[np.int32]:
    """The subtask that owns each of ``key_groups`` under checked ``boundaries`` (Flink's boundaries give
    :func:`operator_index_for_key_group`'s answer)."""
    groups = np.asarray(key_groups)
    if groups.size and (int(groups.min()) < 0 or int(groups.max()) >= boundaries[-1]):
        raise ValueError(f"key groups must be in [0, max_parallelism={boundaries[-1]})")
    starts = np.asarray(boundaries[:-1], dtype=np.int64)
    return (np.searchsorted(starts, groups, side="right") - 1).astype(np.int32)
