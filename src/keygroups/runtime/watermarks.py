"""Event time: how a job's watermark follows the event times it has seen, once per micro-batch.

Spark keeps one global watermark per query: the driver combines what every partition saw. keygroups does the same
with Flink's strategy in Flink's terms: before a batch's subtasks run, the driver learns the largest event time in
the batch's input, and the batch's watermark becomes ``max(previous watermark, largest event time - out-of-orderness
- 1)`` (Flink's ``forBoundedOutOfOrderness``: no record at or before the watermark is expected any more). The batch
judges lateness against the watermark it *started* with, and fires event-time timers up to the one it *ends* with,
after its records; the new watermark is stored in the checkpoint, so it survives restarts and rescales.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from keygroups.state.timers import NO_WATERMARK, check_timestamp

#: What a job does with records at or before the watermark it started the batch with: ``"drop"`` counts and drops
#: them, ``"output"`` keeps them in the batch's late output.
LateRecords = Literal["drop", "output"]
LATE_RECORD_MODES: tuple[LateRecords, ...] = get_args(LateRecords)


def _delay_ms(delay: Any) -> int:
    if isinstance(delay, datetime.timedelta):
        ms = delay // datetime.timedelta(milliseconds=1)
    elif isinstance(delay, (int, float)) and not isinstance(delay, bool):
        ms = int(delay * 1000) if isinstance(delay, float) else int(delay) * 1000
    else:
        raise TypeError(f"out-of-orderness must be a datetime.timedelta or a number of seconds, got {delay!r}")
    if ms < 0:
        raise ValueError(f"out-of-orderness must be >= 0, got {delay!r}")
    return ms


@dataclass(frozen=True)
class WatermarkStrategy:
    """How far event time may run out of order: the watermark trails the largest event time seen by
    ``out_of_orderness_ms`` (plus Flink's 1 ms: a watermark W promises no more records at or before W).

    Build it as in Flink: ``WatermarkStrategy.for_bounded_out_of_orderness(timedelta(minutes=5))`` or
    ``WatermarkStrategy.for_monotonous_timestamps()``."""

    out_of_orderness_ms: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.out_of_orderness_ms, bool) or not isinstance(self.out_of_orderness_ms, int) or (
                self.out_of_orderness_ms < 0):
            raise ValueError(f"out_of_orderness_ms must be an int >= 0, got {self.out_of_orderness_ms!r}")

    @classmethod
    def for_bounded_out_of_orderness(cls, max_out_of_orderness: datetime.timedelta | float) -> WatermarkStrategy:
        """Records may arrive up to ``max_out_of_orderness`` (a timedelta, or seconds) behind the latest one."""
        return cls(_delay_ms(max_out_of_orderness))

    @classmethod
    def for_monotonous_timestamps(cls) -> WatermarkStrategy:
        """Event time never decreases: the watermark follows the latest event time (minus 1 ms)."""
        return cls(0)

    def next_watermark(self, previous: int, max_event_time: int | None) -> int:
        """The watermark after a batch whose largest event time is ``max_event_time`` (None: the batch had no
        event time); never lower than ``previous``."""
        if max_event_time is None:
            return previous
        candidate = check_timestamp(max_event_time, "an event time") - self.out_of_orderness_ms - 1
        return max(previous, candidate)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "bounded-out-of-orderness", "out_of_orderness_ms": self.out_of_orderness_ms}


def check_late_records(mode: Any) -> LateRecords:
    """``mode`` if it is a known way to handle late records; ValueError naming the allowed ones otherwise."""
    if mode not in LATE_RECORD_MODES:
        raise ValueError(f"late_records must be one of {LATE_RECORD_MODES} ('drop' counts and drops records at or "
                         f"before the watermark; 'output' keeps them in the batch's late output), got {mode!r}")
    return cast(LateRecords, str(mode))


__all__ = ["NO_WATERMARK", "WatermarkStrategy", "LateRecords", "LATE_RECORD_MODES", "check_late_records"]
