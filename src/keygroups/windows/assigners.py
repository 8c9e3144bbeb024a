"""Time windows and the assigners that put records into them (Flink's ``TimeWindow`` and ``WindowAssigner``s),
vectorized: an assigner maps a numpy array of timestamps (epoch ms) to (row, window start, window end) arrays.

Windows are half-open ``[start, end)``; a window fires once the watermark (event time) or the batch's processing
time reaches ``end - 1`` (:meth:`TimeWindow.max_timestamp`), as Flink's default triggers do.
"""

from __future__ import annotations

import datetime
from typing import Any, NamedTuple

import numpy as np

from keygroups.serializers import Int64Serializer, TupleSerializer, TypeSerializer


class TimeWindow(NamedTuple):
    """A window of time ``[start, end)`` in epoch ms. Stored in state as a tuple of two longs (a window read back
    from a snapshot is a plain ``(start, end)`` tuple, equal to its ``TimeWindow``)."""

    start: int
    end: int

    def max_timestamp(self) -> int:
        """The last millisecond inside the window: it fires when time reaches it."""
        return self.end - 1

    def intersects(self, other: tuple[int, int]) -> bool:
        """Whether the windows overlap or touch (Flink merges touching session windows too)."""
        return self.start <= other[1] and self.end >= other[0]

    def cover(self, other: tuple[int, int]) -> TimeWindow:
        """The smallest window holding both."""
        return TimeWindow(min(self.start, other[0]), max(self.end, other[1]))

    @staticmethod
    def serializer() -> TypeSerializer:
        """The namespace serializer of windows: (start, end) as two longs."""
        return TupleSerializer(Int64Serializer(), Int64Serializer())


def to_millis(duration: Any, what: str) -> int:
    """A duration as int milliseconds: a ``timedelta`` or an int of ms. TypeError otherwise."""
    if isinstance(duration, datetime.timedelta):
        return int(duration / datetime.timedelta(milliseconds=1))
    if isinstance(duration, (int, np.integer)) and not isinstance(duration, bool):
        return int(duration)
    raise TypeError(f"{what} must be a datetime.timedelta or an int of milliseconds, got {duration!r}")


def _positive(ms: int, what: str) -> int:
    if ms <= 0:
        raise ValueError(f"{what} must be > 0 ms, got {ms}")
    return ms


class WindowAssigner:
    """Assigns each timestamp to zero or more windows. ``event_time``: windows follow the records' event time and
    the watermark (else the batch's processing time); ``merging``: windows of a key that overlap are merged
    (sessions)."""

    event_time: bool = True
    merging: bool = False

    def assign(self, timestamps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row index, window start, window end) for every window of every timestamp, int64 arrays."""
        raise NotImplementedError

    def last_end(self, timestamps: np.ndarray) -> np.ndarray:
        """The latest window end of each timestamp (a record is late once that window has expired)."""
        raise NotImplementedError


class _Tumbling(WindowAssigner):
    def __init__(self, size: Any, offset: Any = 0) -> None:
        self.size = _positive(to_millis(size, "a tumbling window's size"), "a tumbling window's size")
        self.offset = to_millis(offset, "a window offset") % self.size

    @classmethod
    def of(cls, size: Any, offset: Any = 0) -> _Tumbling:
        """Windows of ``size`` (a timedelta or ms) that do not overlap, aligned to the epoch plus ``offset``."""
        return cls(size, offset)

    def assign(self, timestamps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ts = np.asarray(timestamps, dtype=np.int64)
        starts = ts - np.mod(ts - self.offset, self.size)
        return np.arange(len(ts), dtype=np.int64), starts, starts + self.size

    def last_end(self, timestamps: np.ndarray) -> np.ndarray:
        ts = np.asarray(timestamps, dtype=np.int64)
        return ts - np.mod(ts - self.offset, self.size) + self.size

    def __repr__(self) -> str:
        return f"{type(self).__name__}.of({self.size}, offset={self.offset})"


class _Sliding(WindowAssigner):
    def __init__(self, size: Any, slide: Any, offset: Any = 0) -> None:
        self.size = _positive(to_millis(size, "a sliding window's size"), "a sliding window's size")
        self.slide = _positive(to_millis(slide, "a sliding window's slide"), "a sliding window's slide")
        self.offset = to_millis(offset, "a window offset") % self.slide

    @classmethod
    def of(cls, size: Any, slide: Any, offset: Any = 0) -> _Sliding:
        """Windows of ``size`` starting every ``slide`` (timedeltas or ms): a record is in ceil(size / slide) of
        them."""
        return cls(size, slide, offset)

    def assign(self, timestamps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ts = np.asarray(timestamps, dtype=np.int64)
        last = ts - np.mod(ts - self.offset, self.slide)
        per = -(-self.size // self.slide)
        starts = last[:, None] - np.arange(per, dtype=np.int64)[None, :] * self.slide
        inside = starts > (ts - self.size)[:, None]
        rows = np.broadcast_to(np.arange(len(ts), dtype=np.int64)[:, None], starts.shape)[inside]
        starts = starts[inside]
        return rows, starts, starts + self.size

    def last_end(self, timestamps: np.ndarray) -> np.ndarray:
        ts = np.asarray(timestamps, dtype=np.int64)
        return ts - np.mod(ts - self.offset, self.slide) + self.size

    def __repr__(self) -> str:
        return f"{type(self).__name__}.of({self.size}, {self.slide}, offset={self.offset})"


class _Session(WindowAssigner):
    merging = True

    def __init__(self, gap: Any) -> None:
        self.gap = _positive(to_millis(gap, "a session gap"), "a session gap")

    @classmethod
    def with_gap(cls, gap: Any) -> _Session:
        """Sessions of a key: a record opens ``[t, t + gap)``, and windows that overlap or touch merge."""
        return cls(gap)

    def assign(self, timestamps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ts = np.asarray(timestamps, dtype=np.int64)
        return np.arange(len(ts), dtype=np.int64), ts, ts + self.gap

    def last_end(self, timestamps: np.ndarray) -> np.ndarray:
        return np.asarray(timestamps, dtype=np.int64) + self.gap

    def __repr__(self) -> str:
        return f"{type(self).__name__}.with_gap({self.gap})"


class TumblingEventTimeWindows(_Tumbling):
    """Tumbling windows in event time: ``TumblingEventTimeWindows.of(timedelta(minutes=1))``."""


class TumblingProcessingTimeWindows(_Tumbling):
    """Tumbling windows of the batches' processing time."""

    event_time = False


class SlidingEventTimeWindows(_Sliding):
    """Sliding windows in event time: ``SlidingEventTimeWindows.of(timedelta(minutes=10), timedelta(minutes=1))``."""


class SlidingProcessingTimeWindows(_Sliding):
    """Sliding windows of the batches' processing time."""

    event_time = False


class EventTimeSessionWindows(_Session):
    """Session windows in event time: ``EventTimeSessionWindows.with_gap(timedelta(minutes=30))``."""


class ProcessingTimeSessionWindows(_Session):
    """Session windows of the batches' processing time (a batch's records all share its time)."""

    event_time = False


__all__ = [
    "TimeWindow",
    "WindowAssigner",
    "TumblingEventTimeWindows",
    "TumblingProcessingTimeWindows",
    "SlidingEventTimeWindows",
    "SlidingProcessingTimeWindows",
    "EventTimeSessionWindows",
    "ProcessingTimeSessionWindows",
]
