"""Timers as keyed state: one subtask's event-time and processing-time timers, rescaled with their key groups.

Flink keeps timers in key-group-partitioned priority queues that are snapshotted and restored with the keyed state.
Here each time domain's timers are a hidden ``MapState`` of the backend (the key's timestamps -> True), so they
live in the key's key group on either backend, are written incrementally with the rest of the state, restore lazily,
and move with their key group when parallelism (or the max parallelism, by an integer factor) changes: a timer
registered at parallelism 4 fires in whichever subtask owns its key at parallelism 8. The map also gives Flink's
deduplication (one timer per key, timestamp and domain) and makes a delete an ordinary state write.

Finding the due timers without reading every key is what :class:`TimerQueues` adds: a priority queue per domain of
(timestamp, key group, key), built from the hidden states when a subtask's state is restored and kept in the worker
process with its validity token (:class:`TimerQueueRegistry`) so that the next batch of the same subtask reuses it
instead of rebuilding it. The hidden state stays the truth: a queue entry whose timer was deleted (or already fired)
is skipped when it reaches the head.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keygroups._native.recordloop import TimerHeap
from keygroups.checkpoint import CheckpointMetadata
from keygroups.serializers import BoolSerializer, Int64Serializer
from keygroups.state.descriptors import MapStateDescriptor

if TYPE_CHECKING:
    from keygroups.state.warm import WarmRegistry


class TimeDomain(enum.Enum):
    """The clock a timer follows (Flink's ``TimeDomain``): the watermark, or the batch's processing time."""

    EVENT_TIME = "event-time"
    PROCESSING_TIME = "processing-time"


#: The prefix of the hidden states that hold timers; user states may not start with it.
TIMER_STATE_PREFIX = "_timers/"

#: The hidden state of each domain's timers.
TIMER_STATE_NAMES = {domain: TIMER_STATE_PREFIX + domain.value for domain in TimeDomain}

#: Flink's ``Long.MIN_VALUE`` watermark: no event time seen yet, so no event-time timer is due.
NO_WATERMARK = -(2**63)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def timer_descriptor(domain: TimeDomain) -> MapStateDescriptor:
    """The descriptor of ``domain``'s hidden timer state (timestamp in ms -> True)."""
    return MapStateDescriptor(TIMER_STATE_NAMES[domain], Int64Serializer(), BoolSerializer())


def check_timestamp(timestamp: Any, what: str = "a timer's timestamp") -> int:
    """``timestamp`` if it is an int of epoch milliseconds in the 64-bit range; TypeError/ValueError otherwise."""
    if isinstance(timestamp, bool) or not isinstance(timestamp, int):
        raise TypeError(f"{what} must be an int of epoch milliseconds, got {timestamp!r}")
    if not _INT64_MIN <= timestamp <= _INT64_MAX:
        raise ValueError(f"{what} must fit in a signed 64-bit long (Java's long), got {timestamp}")
    return timestamp


@dataclass(frozen=True)
class QueueToken:
    """Which committed state a :class:`TimerQueues` reflects: the checkpoint its subtask's snapshot belongs to and
    the file that snapshot wrote (None: it wrote none, the state was unchanged since the restore it came from)."""

    checkpoint_id: int
    handle_file: str | None

    def matches(self, metadata: CheckpointMetadata, key_group_range: Any) -> bool:
        """Whether ``metadata`` (the checkpoint a new batch restores) committed exactly the snapshot this token
        names for ``key_group_range``; a retried, uncommitted or other attempt does not."""
        if metadata.checkpoint_id != self.checkpoint_id:
            return False
        mine = [h for h in metadata.keyed_handles
                if h.key_group_range == key_group_range and h.checkpoint_id == self.checkpoint_id]
        if self.handle_file is None:
            overlapping = [h for h in metadata.keyed_handles if h.checkpoint_id == self.checkpoint_id
                           and h.key_group_range and h.key_group_range.start <= key_group_range.end
                           and key_group_range.start <= h.key_group_range.end]
            return not overlapping
        return any(h.file == self.handle_file for h in mine)


class DomainTimers:
    """One time domain's timers of a subtask: the hidden state (the truth) and the priority queue over it."""

    __slots__ = ("backend", "state", "queue", "sequence", "registered", "fired", "pending")

    def __init__(self, backend: Any, domain: TimeDomain, queue: TimerHeap, sequence: Iterator[int],
                 pending: int = 0) -> None:
        self.backend = backend
        self.state = backend.get_state(timer_descriptor(domain))
        self.queue = queue
        self.sequence = sequence
        #: Timers registered and fired since this object was made (this batch).
        self.registered = 0
        self.fired = 0
        #: Timers registered now (the state's entries; the queue may also hold entries of deleted ones).
        self.pending = pending

    def register(self, timestamp: int) -> None:
        """A timer of the backend's current key at ``timestamp`` (ms); registering it again changes nothing."""
        state = self.state
        if state.contains(timestamp):
            return
        state.put(timestamp, True)
        b = self.backend
        self.queue.push(timestamp, b.current_key_group, next(self.sequence), b.current_key)
        self.registered += 1
        self.pending += 1

    def delete(self, timestamp: int) -> None:
        """Remove the current key's timer at ``timestamp`` (nothing if there is none), as Flink's delete*Timer."""
        state = self.state
        if state.contains(timestamp):
            state.remove(timestamp)
            self.pending -= 1

    def timestamps(self) -> list[int]:
        """The current key's timers, earliest first."""
        return sorted(self.state.keys())

    def earliest(self) -> int | None:
        """The earliest timer still registered, None if there is none (stale entries are dropped)."""
        queue, state, backend = self.queue, self.state, self.backend
        while len(queue):
            timestamp, _, _, key = queue.head()
            backend.set_current_key(key)
            if state.contains(timestamp):
                return timestamp
            queue.pop()
        return None

    # The due timers fire in the compiled loop: keygroups._native.recordloop.fire_timers reads queue and state.


class TimerQueues:
    """The timers of one subtask's backend, per domain (:class:`DomainTimers`: registration and deletion for the
    backend's current key, the earliest timer, the due timers in timestamp order).

    Create it after the backend is restored; it registers the hidden states and, unless ``reuse`` (an earlier
    instance for the same committed state) is given, builds its queues by reading every key of those states once."""

    def __init__(self, backend: Any, reuse: TimerQueues | None = None) -> None:
        self.backend = backend
        sequence = reuse.sequence if reuse is not None else itertools.count()
        self.sequence = sequence
        self.event_time = DomainTimers(backend, TimeDomain.EVENT_TIME,
                                       reuse.event_time.queue if reuse is not None else TimerHeap(), sequence,
                                       reuse.event_time.pending if reuse is not None else 0)
        self.processing_time = DomainTimers(backend, TimeDomain.PROCESSING_TIME,
                                            reuse.processing_time.queue if reuse is not None else TimerHeap(), sequence,
                                            reuse.processing_time.pending if reuse is not None else 0)
        self.rebuilt = reuse is None
        if reuse is None:
            for domain in TimeDomain:
                self._rebuild(self.of(domain), TIMER_STATE_NAMES[domain])

    def _rebuild(self, timers: DomainTimers, state_name: str) -> None:
        sequence = self.sequence
        timers.queue.extend((timestamp, group, next(sequence), key)
                            for group, key, timestamps in self.backend.map_keys(state_name) for timestamp in timestamps)
        timers.pending = len(timers.queue)   # read from the state: one entry per registered timer

    def of(self, domain: TimeDomain) -> DomainTimers:
        """The timers of ``domain``."""
        return self.event_time if domain is TimeDomain.EVENT_TIME else self.processing_time


class TimerQueueRegistry:
    """Timer queues kept warm in this worker process after their batch, with the token of the snapshot they
    reflect, for the next batch of the same subtask to reuse when it restores exactly that snapshot. Bounded as the
    heap backend registry (a :class:`~keygroups.state.warm.WarmRegistry`: least recently kept dropped first); taking
    removes the entry, so two tasks never share one."""

    def __init__(self) -> None:
        self._made: WarmRegistry[tuple[QueueToken, TimerQueues]] | None = None

    @property
    def _registry(self) -> WarmRegistry[tuple[QueueToken, TimerQueues]]:
        if self._made is None:   # made when first used: warm imports the backends' base, which imports this module
            from keygroups.state.warm import WarmRegistry

            # a new token and TimerQueues each batch around the same heaps (TimerQueues(reuse=...) adopts them)
            self._made = WarmRegistry(watch=lambda kept: (kept[1].event_time.queue, kept[1].processing_time.queue))
        return self._made

    def keep(self, key: Hashable, value: tuple[QueueToken, TimerQueues], limit: int) -> None:
        """Keep ``value`` under ``key``, dropping the least recently kept beyond ``limit`` (0 keeps nothing)."""
        self._registry.keep(key, value, limit)

    def keys(self) -> list[Hashable]:
        return list(self._registry.keys())

    def clear(self) -> None:
        self._registry.clear()

    def __len__(self) -> int:
        return len(self._registry)

    def take_matching(self, key: Hashable, metadata: CheckpointMetadata | None,
                      key_group_range: Any) -> TimerQueues | None:
        """The queues kept under ``key`` if they reflect exactly ``metadata``'s state of ``key_group_range``."""
        kept = self._registry.take(key)
        if kept is None or metadata is None:
            return None
        token, queues = kept
        return queues if token.matches(metadata, key_group_range) else None


#: This Python process's kept timer queues (Spark reuses a worker process for many tasks).
TIMER_QUEUES = TimerQueueRegistry()
