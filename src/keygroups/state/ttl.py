"""State time-to-live, as Flink's ``StateTtlConfig``.

A TTL-enabled state stores the last-access timestamp (milliseconds) beside every value (every element of a list, every
entry of a map). An entry is expired once ``timestamp + ttl <= now``. Each state chooses its clock
(``TtlTimeCharacteristic``):

- ``ProcessingTime`` (the default, and Flink's only one): the backend's clock (wall time); in a job, the batch's
  processing time, which the driver fixes when it plans the batch (``BatchPlan.processing_time``).
- ``EventTime``: the job's watermark (``KeyedStateBackendBase.watermark``, set by the runtime as a batch proceeds), so
  state expires as event time passes, however fast the job replays. While the job has no watermark yet
  (``NO_WATERMARK``: no event time, or no event seen so far) nothing expires, and an entry written then has no time
  yet: it is stamped ``EVENT_TIME_NOT_STARTED`` and its clock starts at the watermark of its first access once
  there is one (a read then writes the stamp, whatever the update type). Stamping it ``NO_WATERMARK`` instead would
  expire it the moment the first watermark arrives, before it lived ``ttl`` in event time; this way no entry ever
  expires early. (An entry never accessed again keeps no time and is not dropped by ``cleanup_full_snapshot``.)

The TTL *duration*, update type and visibility are not part of the stored data (change them freely between runs);
whether a state has TTL at all, and its time characteristic, are: the stored timestamps mean one clock or the other.
Restoring across either difference raises ``StateMigrationError`` (Flink does the same for TTL on/off).
"""

from __future__ import annotations

import datetime
import enum
from dataclasses import dataclass
from typing import Any


class UpdateType(enum.Enum):
    """When an entry's timestamp is refreshed."""

    #: TTL is off (Flink's ``Disabled``); a config with it behaves as no TTL at all.
    Disabled = "Disabled"
    #: On creation and on every write (the default).
    OnCreateAndWrite = "OnCreateAndWrite"
    #: Also on every read.
    OnReadAndWrite = "OnReadAndWrite"


class StateVisibility(enum.Enum):
    """Whether an expired value that is still stored may be returned (once: the access also cleans it up)."""

    ReturnExpiredIfNotCleanedUp = "ReturnExpiredIfNotCleanedUp"
    NeverReturnExpired = "NeverReturnExpired"


class TtlTimeCharacteristic(enum.Enum):
    """The clock a state's TTL is measured in (Flink has ``ProcessingTime`` only)."""

    #: The backend's clock (wall time, ``time.time`` unless the backend was given another).
    ProcessingTime = "ProcessingTime"
    #: The job's watermark; nothing expires while there is none (see the module docstring).
    EventTime = "EventTime"


#: The timestamp of an event-time TTL entry written while the job had no watermark: later than any watermark, so it
#: never expires (nor is dropped by snapshot cleanup) until an access under a watermark stamps it with that watermark.
EVENT_TIME_NOT_STARTED = 2**63 - 1


def _ttl_ms(ttl: Any) -> int:
    if isinstance(ttl, datetime.timedelta):
        ms = round(ttl.total_seconds() * 1000)
    elif isinstance(ttl, (int, float)) and not isinstance(ttl, bool):
        ms = round(ttl * 1000)
    else:
        raise TypeError(f"ttl must be seconds (int or float) or a datetime.timedelta, got {ttl!r}")
    if ms <= 0:
        raise ValueError(f"ttl must be positive (at least 1 ms), got {ttl!r}")
    return int(ms)


@dataclass(frozen=True)
class StateTtlConfig:
    """TTL settings of one state (Flink's ``StateTtlConfig``); build one with :meth:`new_builder`.

    ``ttl_ms``: the time to live in milliseconds. ``cleanup_full_snapshot``: expired entries are dropped when a
    snapshot is written and when one is restored (Flink's ``cleanupFullSnapshot``); expired entries are in any case
    removed whenever they are accessed.
    """

    ttl_ms: int
    update_type: UpdateType = UpdateType.OnCreateAndWrite
    state_visibility: StateVisibility = StateVisibility.NeverReturnExpired
    time_characteristic: TtlTimeCharacteristic = TtlTimeCharacteristic.ProcessingTime
    cleanup_full_snapshot: bool = False

    UpdateType = UpdateType
    StateVisibility = StateVisibility
    TtlTimeCharacteristic = TtlTimeCharacteristic

    def __post_init__(self) -> None:
        if isinstance(self.ttl_ms, bool) or not isinstance(self.ttl_ms, int) or self.ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be a positive int, got {self.ttl_ms!r}")
        if not isinstance(self.update_type, UpdateType):
            raise TypeError(f"update_type must be a StateTtlConfig.UpdateType, got {self.update_type!r}")
        if not isinstance(self.state_visibility, StateVisibility):
            raise TypeError(f"state_visibility must be a StateTtlConfig.StateVisibility, got {self.state_visibility!r}")
        if not isinstance(self.time_characteristic, TtlTimeCharacteristic):
            raise TypeError("time_characteristic must be a StateTtlConfig.TtlTimeCharacteristic (ProcessingTime or "
                            f"EventTime), got {self.time_characteristic!r}")

    @staticmethod
    def new_builder(ttl: float | datetime.timedelta) -> StateTtlConfigBuilder:
        """A builder for a config with time to live ``ttl`` (seconds or a timedelta)."""
        return StateTtlConfigBuilder(ttl)

    @property
    def is_enabled(self) -> bool:
        return self.update_type is not UpdateType.Disabled

    @property
    def update_on_read(self) -> bool:
        return self.update_type is UpdateType.OnReadAndWrite

    @property
    def return_expired(self) -> bool:
        return self.state_visibility is StateVisibility.ReturnExpiredIfNotCleanedUp

    @property
    def event_time(self) -> bool:
        """Whether the TTL is measured in event time (the watermark)."""
        return self.time_characteristic is TtlTimeCharacteristic.EventTime

    def to_json(self) -> dict[str, Any]:
        """The copy stored in a snapshot's state meta; restore checks its time characteristic
        (:func:`stored_time_characteristic`), the rest is informational. ``"time_characteristic"`` is written for
        event time only: the metas of processing-time states stay as they were before event-time TTL, so their
        incremental chains continue (a changed meta would write every key group full)."""
        out: dict[str, Any] = {
            "ttl_ms": self.ttl_ms,
            "update_type": self.update_type.value,
            "state_visibility": self.state_visibility.value,
            "cleanup_full_snapshot": self.cleanup_full_snapshot,
        }
        if self.event_time:
            out["time_characteristic"] = self.time_characteristic.value
        return out


def stored_time_characteristic(ttl_json: dict[str, Any]) -> TtlTimeCharacteristic:
    """The time characteristic of a state meta's ``"ttl"`` (:meth:`StateTtlConfig.to_json`): processing time when it
    names none (processing-time states, and every meta written before event-time TTL existed)."""
    return TtlTimeCharacteristic(ttl_json.get("time_characteristic", TtlTimeCharacteristic.ProcessingTime.value))


class StateTtlConfigBuilder:
    """Flink's ``StateTtlConfig.Builder``, in Python casing."""

    def __init__(self, ttl: float | datetime.timedelta) -> None:
        self._ttl_ms = _ttl_ms(ttl)
        self._update_type = UpdateType.OnCreateAndWrite
        self._visibility = StateVisibility.NeverReturnExpired
        self._cleanup_full_snapshot = False
        self._time_characteristic = TtlTimeCharacteristic.ProcessingTime

    def set_ttl(self, ttl: float | datetime.timedelta) -> StateTtlConfigBuilder:
        self._ttl_ms = _ttl_ms(ttl)
        return self

    def set_update_type(self, update_type: UpdateType) -> StateTtlConfigBuilder:
        self._update_type = update_type
        return self

    def update_ttl_on_create_and_write(self) -> StateTtlConfigBuilder:
        return self.set_update_type(UpdateType.OnCreateAndWrite)

    def update_ttl_on_read_and_write(self) -> StateTtlConfigBuilder:
        return self.set_update_type(UpdateType.OnReadAndWrite)

    def set_state_visibility(self, visibility: StateVisibility) -> StateTtlConfigBuilder:
        self._visibility = visibility
        return self

    def return_expired_if_not_cleaned_up(self) -> StateTtlConfigBuilder:
        return self.set_state_visibility(StateVisibility.ReturnExpiredIfNotCleanedUp)

    def never_return_expired(self) -> StateTtlConfigBuilder:
        return self.set_state_visibility(StateVisibility.NeverReturnExpired)

    def set_ttl_time_characteristic(self, characteristic: TtlTimeCharacteristic) -> StateTtlConfigBuilder:
        """Measure the TTL in processing time (the default) or in event time (the job's watermark)."""
        if not isinstance(characteristic, TtlTimeCharacteristic):
            raise TypeError("the time characteristic must be StateTtlConfig.TtlTimeCharacteristic.ProcessingTime or "
                            f".EventTime, got {characteristic!r}")
        self._time_characteristic = characteristic
        return self

    def cleanup_full_snapshot(self) -> StateTtlConfigBuilder:
        """Drop expired entries when writing and when restoring a snapshot."""
        self._cleanup_full_snapshot = True
        return self

    def disable_cleanup_in_background(self) -> StateTtlConfigBuilder:
        """Accepted for Flink compatibility: there is no background cleanup to disable (cleanup happens on access)."""
        return self

    def build(self) -> StateTtlConfig:
        return StateTtlConfig(self._ttl_ms, self._update_type, self._visibility, self._time_characteristic,
                              self._cleanup_full_snapshot)


__all__ = ["StateTtlConfig", "StateTtlConfigBuilder", "UpdateType", "StateVisibility", "TtlTimeCharacteristic",
           "EVENT_TIME_NOT_STARTED", "stored_time_characteristic"]
