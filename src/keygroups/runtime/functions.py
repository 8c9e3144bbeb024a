"""The user-facing function API of a keyed job, in Flink's shape (``KeyedProcessFunction``) and Python casing.

A function declares its state in :meth:`KeyedProcessFunction.open` through descriptors, then sees one record at a
time (or, vectorized, all of one key's records of a micro-batch as an Arrow table) with the key already set, so every
state it reads or writes is the current key's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, overload

from keygroups._typing import ACC, IN, OUT, K, T, V
from keygroups.checkpoint.raw_keyed import RawKeyedStateReader, RawKeyedStateWriter
from keygroups.serializers import TypeSerializer
from keygroups.state import (
    AggregatingState,
    AggregatingStateDescriptor,
    ListState,
    ListStateDescriptor,
    MapState,
    MapStateDescriptor,
    ReducingState,
    ReducingStateDescriptor,
    State,
    StateDescriptor,
    ValueState,
    ValueStateDescriptor,
)
from keygroups.state.timers import (
    NO_WATERMARK,
    TIMER_STATE_PREFIX,
    DomainTimers,
    TimeDomain,
    TimerQueues,
    check_timestamp,
)

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

#: The getter of each descriptor kind, named in the message when a descriptor reaches the wrong one.
_GETTERS = {
    "value": ("get_state", "ValueStateDescriptor"),
    "list": ("get_list_state", "ListStateDescriptor"),
    "map": ("get_map_state", "MapStateDescriptor"),
    "reducing": ("get_reducing_state", "ReducingStateDescriptor"),
    "aggregating": ("get_aggregating_state", "AggregatingStateDescriptor"),
}


class RuntimeContext:
    """What :meth:`KeyedProcessFunction.open` receives: state registration and where the function runs.

    One getter per state kind, as Flink's ``RuntimeContext`` (``get_list_state(ListStateDescriptor)`` returns a
    ``ListState``, ...); each refuses a descriptor of another kind. ``get_state`` also takes every kind (the
    backend's generic form), typed per descriptor. The handles are typed by the descriptor's serializers:
    ``get_state(ValueStateDescriptor("n", Int64Serializer()))`` is a ``ValueState[int]``,
    ``get_map_state(MapStateDescriptor("m", StrSerializer(), Float64Serializer()))`` a ``MapState[str, float]``."""

    def __init__(self, backend: Any, *, job_name: str, subtask_index: int, parallelism: int, max_parallelism: int,
                 checkpoint_id: int) -> None:
        self._backend = backend
        self.job_name = job_name
        self.subtask_index = subtask_index
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.checkpoint_id = checkpoint_id

    @property
    def key_group_range(self) -> Any:
        return self._backend.key_group_range

    @overload
    def get_state(self, descriptor: ValueStateDescriptor[T]) -> ValueState[T]: ...
    @overload
    def get_state(self, descriptor: ListStateDescriptor[T]) -> ListState[T]: ...
    @overload
    def get_state(self, descriptor: MapStateDescriptor[K, V]) -> MapState[K, V]: ...
    @overload
    def get_state(self, descriptor: ReducingStateDescriptor[T]) -> ReducingState[T]: ...
    @overload
    def get_state(self, descriptor: AggregatingStateDescriptor[IN, ACC, OUT]) -> AggregatingState[IN, OUT]: ...

    def get_state(self, descriptor: StateDescriptor) -> State:
        """The keyed state for ``descriptor``, of any of the five kinds (Flink's ``getState`` takes a
        ``ValueStateDescriptor`` only; here it is also the generic form). Prefer the per-kind getters, which check
        the descriptor's kind."""
        _check_user_state(descriptor)
        return self._backend.get_state(descriptor)  # type: ignore[no-any-return]

    def get_namespaced_state(self, descriptor: StateDescriptor, namespace: Any,
                             namespace_serializer: TypeSerializer[Any]) -> Any:
        """The keyed state for ``descriptor`` scoped to (key, namespace), e.g. per window (Flink's internal
        namespaced state, which its window operator builds on): a ``keygroups.state.namespaced.NamespacedState``
        whose current namespace starts as ``namespace`` (``set_current_namespace`` moves it; namespaces merge with
        ``merge_namespaces``). ``namespace_serializer`` writes the namespaces (a window: ``TimeWindow.serializer()``).
        Stored as a map state of the descriptor's name, so it rescales and checkpoints like any keyed state."""
        _check_user_state(descriptor)
        return self._backend.get_state(descriptor, namespace=namespace, namespace_serializer=namespace_serializer)

    def get_list_state(self, descriptor: ListStateDescriptor[T]) -> ListState[T]:
        """The keyed ``ListState`` for a ``ListStateDescriptor`` (Flink's ``getListState``)."""
        return self._get_checked(descriptor, "list")  # type: ignore[return-value]

    def get_map_state(self, descriptor: MapStateDescriptor[K, V]) -> MapState[K, V]:
        """The keyed ``MapState`` for a ``MapStateDescriptor`` (Flink's ``getMapState``)."""
        return self._get_checked(descriptor, "map")  # type: ignore[return-value]

    def get_reducing_state(self, descriptor: ReducingStateDescriptor[T]) -> ReducingState[T]:
        """The keyed ``ReducingState`` for a ``ReducingStateDescriptor`` (Flink's ``getReducingState``)."""
        return self._get_checked(descriptor, "reducing")  # type: ignore[return-value]

    def get_aggregating_state(self, descriptor: AggregatingStateDescriptor[IN, ACC, OUT]
                              ) -> AggregatingState[IN, OUT]:
        """The keyed ``AggregatingState`` for an ``AggregatingStateDescriptor`` (Flink's
        ``getAggregatingState``)."""
        return self._get_checked(descriptor, "aggregating")  # type: ignore[return-value]

    def _get_checked(self, descriptor: Any, kind: str) -> State:
        if not isinstance(descriptor, StateDescriptor) or descriptor.kind != kind:
            method, wanted = _GETTERS[kind]
            fix = ""
            if isinstance(descriptor, StateDescriptor) and descriptor.kind in _GETTERS:
                fix = f"; use {_GETTERS[descriptor.kind][0]}() for a {_GETTERS[descriptor.kind][1]}"
            raise TypeError(f"{method} takes a keygroups.state.{wanted}, got {descriptor!r}{fix}")
        _check_user_state(descriptor)
        return self._backend.get_state(descriptor)  # type: ignore[no-any-return]


def _check_user_state(descriptor: Any) -> None:
    name = getattr(descriptor, "name", None)
    if isinstance(name, str) and name.startswith(TIMER_STATE_PREFIX):
        raise ValueError(f"state name {name!r} is reserved: names starting with {TIMER_STATE_PREFIX!r} hold the "
                         "job's timers; choose another name")


class TimerService:
    """The timers and clocks of the current key (Flink's ``TimerService``), on every context as
    ``context.timer_service``.

    A timer is (key, timestamp in epoch ms, domain); registering one that exists changes nothing, deleting one that
    does not exist does nothing. An event-time timer fires once the watermark reaches its timestamp, a
    processing-time timer once the batch's processing time does: in the micro-batch that gets there, after its
    records, through :meth:`KeyedProcessFunction.on_timer` with its key set. Timers are keyed state: they are in
    every checkpoint and move with their key group when the job's parallelism changes."""

    __slots__ = ("_queues", "_event", "_processing", "_watermark", "_processing_time")

    def __init__(self, queues: TimerQueues | Callable[[], TimerQueues] | None, *, watermark: int = NO_WATERMARK,
                 processing_time: int = 0) -> None:
        # A factory defers building the subtask's queues (reading every timer) until a timer is first touched.
        self._queues = queues
        self._event: DomainTimers | None = None
        self._processing: DomainTimers | None = None
        self._watermark = watermark
        self._processing_time = processing_time

    def current_processing_time(self) -> int:
        """The batch's processing time in epoch ms: fixed by the driver when it planned the batch, so that a batch
        run again after a failure sees the same time."""
        return self._processing_time

    def current_watermark(self) -> int:
        """The event-time watermark in epoch ms: no record at or before it is expected any more. While a batch's
        records are processed it is the watermark the batch started with (records at or before it are late and
        never reach the function); while timers fire, the batch's new watermark. ``NO_WATERMARK`` (Java's
        Long.MIN_VALUE) before any event time was seen."""
        return self._watermark

    def register_event_time_timer(self, timestamp: int) -> None:
        """Call ``on_timer`` for the current key once the watermark reaches ``timestamp`` (ms)."""
        (self._event or self._resolve()[0]).register(_checked(timestamp))

    def register_processing_time_timer(self, timestamp: int) -> None:
        """Call ``on_timer`` for the current key in the first batch whose processing time reaches ``timestamp``."""
        (self._processing or self._resolve()[1]).register(_checked(timestamp))

    def delete_event_time_timer(self, timestamp: int) -> None:
        """Delete the current key's event-time timer at ``timestamp``, if there is one."""
        (self._event or self._resolve()[0]).delete(_checked(timestamp))

    def delete_processing_time_timer(self, timestamp: int) -> None:
        """Delete the current key's processing-time timer at ``timestamp``, if there is one."""
        (self._processing or self._resolve()[1]).delete(_checked(timestamp))

    def registered_timers(self, domain: TimeDomain = TimeDomain.EVENT_TIME) -> list[int]:
        """The current key's registered timers of ``domain``, earliest first (Spark's ``listTimers``)."""
        event, processing = self._resolve()
        return (event if domain is TimeDomain.EVENT_TIME else processing).timestamps()

    def _resolve(self) -> tuple[DomainTimers, DomainTimers]:
        queues = self._queues
        if queues is None:
            raise RuntimeError("timers are available while the job's function processes records or timers, not "
                               "in open() or close()")
        if callable(queues):
            queues = self._queues = queues()
        self._event, self._processing = queues.event_time, queues.processing_time
        return self._event, self._processing


def _checked(timestamp: Any) -> int:
    # The common case (an int in range) without a call; check_timestamp names the problem otherwise.
    if type(timestamp) is int and -0x8000000000000000 <= timestamp <= 0x7FFFFFFFFFFFFFFF:
        return timestamp
    return check_timestamp(timestamp)


class ProcessContext:
    """What :meth:`KeyedProcessFunction.process_element` (and ``on_timer``) receives along with each record (timer):
    the current key and its key group, the record's event time (:attr:`timestamp`, epoch ms; the timer's time in
    ``on_timer``), the timer service, and in ``on_timer`` the timer's ``time_domain`` (None while records are
    processed)."""

    __slots__ = ("current_key", "current_key_group", "_timestamp", "checkpoint_id", "subtask_index",
                 "timer_service", "time_domain")

    def __init__(self, *, checkpoint_id: int, subtask_index: int, timer_service: TimerService | None = None) -> None:
        self.current_key: Any = None
        self.current_key_group: int = -1
        self._timestamp: int | None = None
        self.checkpoint_id = checkpoint_id
        self.subtask_index = subtask_index
        self.timer_service = timer_service if timer_service is not None else TimerService(None)
        self.time_domain: TimeDomain | None = None

    @property
    def timestamp(self) -> int:
        """The current record's event time in epoch ms (in ``on_timer``: the timer's time), as an ``int``, so that
        event-time code needs no cast or None check. Records have one when the job runs on event time
        (``KeyedJob(timestamp_column=...)``); reading it otherwise, or for a record whose event-time column is null,
        raises ``ValueError`` saying so. Test for it with :attr:`has_timestamp` (Flink's ``ctx.timestamp()`` returns
        null there instead)."""
        stamp = self._timestamp
        if stamp is None:
            raise ValueError(
                "context.timestamp: this record has no event time: the job has no timestamp_column (give "
                "KeyedJob(timestamp_column=...) to run on event time) or the record's event-time column is null; "
                "check context.has_timestamp first where either can happen")
        return stamp

    @timestamp.setter
    def timestamp(self, value: int | None) -> None:
        self._timestamp = value

    @property
    def has_timestamp(self) -> bool:
        """Whether :attr:`timestamp` has a value for the current record (or timer)."""
        return self._timestamp is not None


class KeyedProcessFunction:
    """Subclass and implement :meth:`process_element` (or :meth:`process_key_batch` for the vectorized form).
    The runtime passes every argument by position, so an override may name its parameters as it likes
    (``process_element(self, event, ctx)``) and type checkers accept it.

    Output records are tuples or dicts in the order / with the names of the job's output schema. A function must be
    deterministic given its state and input: a micro-batch that fails is run again from the last checkpoint."""

    def open(self, context: RuntimeContext, /) -> None:
        """Declare state here: ``self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))``."""

    def process_element(self, record: dict[str, Any], context: ProcessContext, /) -> Iterable[Any] | None:
        """Handle one record of the current key; return (or yield) output records, or None. ``record`` is a read-only
        mapping of the input's field names to the record's values (``record["amount"]``, ``get``, ``in``, ``keys``,
        ``items``, equal to the dict of the same items), each field also an attribute (``record.amount``); it is read
        from the batch's Arrow buffers, so ``dict(record)`` is the copy to change."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement process_element(record, context) or process_key_batch(...)"
        )

    def process_key_batch(self, key: Any, records: pa.Table, context: ProcessContext, /
                          ) -> Iterable[Any] | pa.Table | None:
        """Vectorized form: all records of one key in this micro-batch, in order, as an Arrow table. Override it
        instead of process_element to work on columns; the default calls process_element per record."""
        out: list[Any] = []
        columns = [records.column(i).to_pylist() for i in range(records.num_columns)]
        names = records.column_names
        for values in zip(*columns):
            result = self.process_element(dict(zip(names, values)), context)
            if result is not None:
                out.extend(result)
        return out

    def process_batch(self, records: pa.Table, runs: np.ndarray, keys: list[Any],
                      select_key: Callable[[int], None], context: ProcessContext, /) -> Iterable[Any] | None:
        """Whole-subtask form, for functions whose per-key Python overhead dominates (windows pre-aggregate every
        key's records at once): all the subtask's records of the batch, sorted by key group then key, key ``i``'s
        rows at ``runs[i]:runs[i + 1]``; ``select_key(i)`` makes ``keys[i]`` the current key (state, timers,
        ``context.current_key``) before its state is touched. Overriding it replaces process_key_batch /
        process_element."""
        raise NotImplementedError

    def late_mask(self, event_times: np.ndarray, watermark: int, /) -> np.ndarray:
        """Which records are late (a bool array over their event times, epoch ms) when the batch starts at
        ``watermark``: late records never reach the function (dropped and counted, or the job's late output). The
        default: at or before the watermark. A function that still accepts some of them overrides it (windows with
        allowed lateness: a record is late once every window it belongs to has expired)."""
        return event_times <= watermark

    def on_timer(self, timestamp: int, context: ProcessContext, /) -> Iterable[Any] | None:
        """A timer of the current key fired: ``timestamp`` is its time, ``context.time_domain`` its domain. State
        reads and writes are the key's, new timers may be registered, and output records are returned (or
        yielded) as from :meth:`process_element`. The default does nothing."""
        return None

    def close(self) -> None:
        """Called once the subtask's records are processed and its due timers fired, before its snapshot."""

    def snapshot_raw_keyed_state(self, writer: RawKeyedStateWriter) -> None:
        """Write raw keyed state (Flink's raw state): bytes this function keeps itself, per key group, stored in the
        checkpoint beside the managed state. Called after :meth:`close`, at every checkpoint (raw state is written
        whole each time: what is not written again is gone). ``writer.key_groups`` are the subtask's key groups;
        ``writer.stream(key_group)`` is a binary stream to ``write`` that key group's bytes to, in ascending key
        group order. The bytes move with their key group when the parallelism changes (never across a change of the
        max parallelism, which is refused while raw state exists). The default writes none."""

    def restore_raw_keyed_state(self, reader: RawKeyedStateReader) -> None:
        """Read back the raw keyed state :meth:`snapshot_raw_keyed_state` wrote, for this subtask's key groups, from
        whichever subtasks wrote them at the old parallelism. Called after :meth:`open` in every batch that restores
        a checkpoint (or savepoint) holding raw keyed state. ``reader.key_groups`` are the subtask's key groups the
        restore point holds raw state for; ``reader.stream(key_group)`` is a readable binary stream of that key
        group's bytes. The default reads nothing."""
