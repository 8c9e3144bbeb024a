"""The five keyed state types (Flink's ``ValueState``, ``ListState``, ``MapState``, ``ReducingState``,
``AggregatingState``), written once over a small per-state *store* that both backends provide.

Every method acts on the backend's current key (``set_current_key``). A store exposes, for the current key,
``get()`` (the stored object or ``MISSING``; a private copy when a snapshot still holds the original),
``put(obj)``, ``delete()`` and ``append(items)``. With TTL the stored objects carry timestamps (see
``_codec.ValueFraming``), and the TTL variants below follow Flink's ``AbstractTtlDecorator``: an expired entry is
removed when it is accessed and returned that once only under ``ReturnExpiredIfNotCleanedUp``; ``OnReadAndWrite``
refreshes timestamps on reads. Each TTL state reads two clocks of its backend: ``now`` decides expiry, ``stamp`` is
what a write records; they differ only for event-time TTL before the first watermark (``now`` is ``NO_WATERMARK``,
under which nothing expires, and ``stamp`` is ``EVENT_TIME_NOT_STARTED``; such an entry is stamped on its first access
under a watermark, see ``keygroups.state.ttl``).

Map keys compare as Java's ``equals`` (``keygroups._javakeys``): every user key passes through ``java_key`` on its way
in, and stored maps are decoded with canonical keys (``_codec``), so every NaN is one entry and ``0.0``/``-0.0`` two.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any, Generic

from keygroups._native.statecore import MISSING, java_key, java_map
from keygroups._typing import IN, OUT, K, T, V
from keygroups.errors import none_added_error
from keygroups.state.ttl import EVENT_TIME_NOT_STARTED




class State(abc.ABC):
    """Base of all keyed states: ``clear()`` removes the current key's value."""

    __slots__ = ()

    @abc.abstractmethod
    def clear(self) -> None: ...


class ValueState(State, Generic[T]):
    """One value of type ``T`` per key (Flink's ``ValueState<T>``); ``T`` follows the descriptor's serializer."""

    __slots__ = ()

    @abc.abstractmethod
    def value(self) -> T | None:
        """The current key's value, or the descriptor's default (None unless set) if it has none."""

    @abc.abstractmethod
    def update(self, value: T | None) -> None:
        """Set the current key's value; ``None`` clears it (as in Flink)."""


class ListState(State, Generic[T]):
    """A list of elements of type ``T`` per key (Flink's ``ListState<T>``)."""

    __slots__ = ()

    @abc.abstractmethod
    def get(self) -> list[T]:
        """The current key's elements (an empty list if none). Change them through ``update``/``add`` only."""

    @abc.abstractmethod
    def add(self, value: T) -> None: ...

    @abc.abstractmethod
    def add_all(self, values: Iterable[T]) -> None: ...

    @abc.abstractmethod
    def update(self, values: Iterable[T]) -> None:
        """Replace the elements; an empty list clears the state."""


class MapState(State, Generic[K, V]):
    """A map from ``K`` to ``V`` per key (Flink's ``MapState<UK, UV>``)."""

    __slots__ = ()

    @abc.abstractmethod
    def get(self, key: K) -> V | None:
        """The value of ``key`` in the current key's map, or None."""

    @abc.abstractmethod
    def put(self, key: K, value: V) -> None: ...

    @abc.abstractmethod
    def put_all(self, mapping: dict[K, V]) -> None: ...

    @abc.abstractmethod
    def remove(self, key: K) -> None: ...

    @abc.abstractmethod
    def contains(self, key: K) -> bool: ...

    @abc.abstractmethod
    def items(self) -> list[tuple[K, V]]: ...

    def keys(self) -> list[K]:
        return [k for k, _ in self.items()]

    def values(self) -> list[V]:
        return [v for _, v in self.items()]

    def is_empty(self) -> bool:
        return not self.items()


class ReducingState(State, Generic[T]):
    """One value of type ``T`` per key that every added value is reduced into (Flink's ``ReducingState<T>``)."""

    __slots__ = ()

    @abc.abstractmethod
    def get(self) -> T | None:
        """The reduced value, or None."""

    @abc.abstractmethod
    def add(self, value: T) -> None: ...


class AggregatingState(State, Generic[IN, OUT]):
    """Values of type ``IN`` folded into an accumulator per key, read as ``OUT`` (Flink's
    ``AggregatingState<IN, OUT>``)."""

    __slots__ = ()

    @abc.abstractmethod
    def get(self) -> OUT | None:
        """``get_result`` of the accumulator, or None if nothing was added."""

    @abc.abstractmethod
    def add(self, value: IN) -> None: ...


# ---------------------------------------------------------------------------------------------------------------------
# Plain (no TTL)
# ---------------------------------------------------------------------------------------------------------------------
class _Stored:
    """What every state implementation holds: the table ``_t`` that stores the current key's entry; clearing the
    state deletes that entry."""

    __slots__ = ("_t",)
    _t: Any

    def clear(self) -> None:
        self._t.delete()


class _Value(_Stored, ValueState):
    __slots__ = ("_default", "_copy")

    def __init__(self, store: Any, descriptor: Any, backend: Any) -> None:
        self._t = store
        self._default = descriptor.default
        ser = descriptor.serializers["value"]
        self._copy = None if ser.is_immutable else ser.copy

    def value(self) -> Any:
        v = self._t.get()
        if v is MISSING:
            d = self._default
            return d if d is None or self._copy is None else self._copy(d)
        return v

    def update(self, value: Any) -> None:
        if value is None:
            self._t.delete()
        else:
            self._t.put(value)


class _List(_Stored, ListState):
    __slots__ = ("_name",)

    def __init__(self, store: Any, descriptor: Any, backend: Any) -> None:
        self._t = store
        self._name = descriptor.name

    def get(self) -> list[Any]:
        v = self._t.get()
        return [] if v is MISSING else v

    def add(self, value: Any) -> None:
        if value is None:
            raise none_added_error(self._name, "ListState")
        self._t.append([value])

    def add_all(self, values: Iterable[Any]) -> None:
        vals = list(values)
        if None in vals:
            raise none_added_error(self._name, "ListState")
        if vals:
            self._t.append(vals)

    def update(self, values: Iterable[Any]) -> None:
        vals = list(values)
        if None in vals:
            raise none_added_error(self._name, "ListState")
        if vals:
            self._t.put(vals)
        else:
            self._t.delete()


class _Map(_Stored, MapState):
    __slots__ = ()

    def __init__(self, store: Any, descriptor: Any, backend: Any) -> None:
        self._t = store

    def get(self, key: Any) -> Any:
        key = java_key(key)
        m = self._t.get()
        return None if m is MISSING else m.get(key)

    def put(self, key: Any, value: Any) -> None:
        key = java_key(key)
        t = self._t
        m = t.get()
        if m is MISSING:
            t.put({key: value})
        else:
            m[key] = value
            t.put(m)

    def put_all(self, mapping: dict[Any, Any]) -> None:
        if not mapping:
            return
        mapping = java_map(mapping)
        t = self._t
        m = t.get()
        if m is MISSING:
            t.put(dict(mapping))
        else:
            m.update(mapping)
            t.put(m)

    def remove(self, key: Any) -> None:
        key = java_key(key)
        t = self._t
        m = t.get()
        if m is MISSING or key not in m:
            return
        del m[key]
        if m:
            t.put(m)
        else:
            t.delete()

    def contains(self, key: Any) -> bool:
        key = java_key(key)
        m = self._t.get()
        return m is not MISSING and key in m

    def items(self) -> list[tuple[Any, Any]]:
        m = self._t.get()
        return [] if m is MISSING else list(m.items())

    def keys(self) -> list[Any]:
        m = self._t.get()
        return [] if m is MISSING else list(m)

    def values(self) -> list[Any]:
        m = self._t.get()
        return [] if m is MISSING else list(m.values())

    def is_empty(self) -> bool:
        return self._t.get() is MISSING


class _Reducing(_Stored, ReducingState):
    __slots__ = ("_reduce", "_name")

    def __init__(self, store: Any, descriptor: Any, backend: Any) -> None:
        self._t = store
        self._reduce = descriptor.reduce_function
        self._name = descriptor.name

    def get(self) -> Any:
        v = self._t.get()
        return None if v is MISSING else v

    def add(self, value: Any) -> None:
        if value is None:
            raise none_added_error(self._name, "ReducingState")
        t = self._t
        cur = t.get()
        t.put(value if cur is MISSING else self._reduce(cur, value))


class _Aggregating(_Stored, AggregatingState):
    __slots__ = ("_agg",)

    def __init__(self, store: Any, descriptor: Any, backend: Any) -> None:
        self._t = store
        self._agg = descriptor.aggregate_function

    def get(self) -> Any:
        acc = self._t.get()
        return None if acc is MISSING else self._agg.get_result(acc)

    def add(self, value: Any) -> None:
        t = self._t
        acc = t.get()
        if acc is MISSING:
            acc = self._agg.create_accumulator()
        t.put(self._agg.add(value, acc))


# ---------------------------------------------------------------------------------------------------------------------
# With TTL: stored objects are (value, timestamp_ms); lists hold such tuples; maps map user keys to them.
# ---------------------------------------------------------------------------------------------------------------------
class _TtlBase(_Stored):
    __slots__ = ("_now", "_stamp", "_ttl", "_on_read", "_ret_expired", "_name")

    def __init__(self, store: Any, descriptor: Any, backend: Any) -> None:
        cfg = descriptor.ttl_config
        self._t = store
        self._now, self._stamp = backend._ttl_clocks(cfg)
        self._ttl = cfg.ttl_ms
        self._on_read = cfg.update_on_read
        self._ret_expired = cfg.return_expired
        self._name = descriptor.name

    def _get_unexpired(self) -> Any:
        """Flink's getWithTtlCheckAndUpdate for single-value states: the user value or MISSING."""
        t = self._t
        w = t.get()
        if w is MISSING:
            return MISSING
        if w[1] + self._ttl <= self._now():
            t.delete()
            return w[0] if self._ret_expired else MISSING
        if self._on_read:
            t.put((w[0], self._stamp()))
        elif w[1] == EVENT_TIME_NOT_STARTED:   # its clock starts at the first read under a watermark
            stamp = self._stamp()
            if stamp != EVENT_TIME_NOT_STARTED:
                t.put((w[0], stamp))
        return w[0]

    def _restamped(self, entries: Iterable[tuple[Any, int]]) -> list[tuple[Any, int]] | None:
        """``entries`` (live (value, timestamp) pairs) with the timestamps a read gives them (all of them refreshed
        under ``OnReadAndWrite``, the not-started ones under a watermark); None if the read changes none."""
        stamp = self._stamp()
        if self._on_read:
            return [(x[0], stamp) for x in entries]
        if stamp == EVENT_TIME_NOT_STARTED or all(x[1] != EVENT_TIME_NOT_STARTED for x in entries):
            return None
        return [(x[0], stamp) if x[1] == EVENT_TIME_NOT_STARTED else x for x in entries]


class _TtlValue(_TtlBase, ValueState):
    __slots__ = ("_default", "_copy")

    def __init__(self, store: Any, descriptor: Any, backend: Any) -> None:
        super().__init__(store, descriptor, backend)
        self._default = descriptor.default
        ser = descriptor.serializers["value"]
        self._copy = None if ser.is_immutable else ser.copy

    def value(self) -> Any:
        v = self._get_unexpired()
        if v is MISSING:
            d = self._default
            return d if d is None or self._copy is None else self._copy(d)
        return v

    def update(self, value: Any) -> None:
        if value is None:
            self._t.delete()
        else:
            self._t.put((value, self._stamp()))


class _TtlList(_TtlBase, ListState):
    __slots__ = ()

    def get(self) -> list[Any]:
        t = self._t
        w = t.get()
        if w is MISSING:
            return []
        now = self._now()
        ttl = self._ttl
        keep = [x for x in w if x[1] + ttl > now]
        out = [x[0] for x in (w if self._ret_expired else keep)]
        restamped = self._restamped(keep) if keep else None
        if restamped is not None:
            t.put(restamped)
        elif len(keep) != len(w):
            if keep:
                t.put(keep)
            else:
                t.delete()
        return out

    def add(self, value: Any) -> None:
        if value is None:
            raise none_added_error(self._name, "ListState")
        self._t.append([(value, self._stamp())])

    def add_all(self, values: Iterable[Any]) -> None:
        vals = list(values)
        if None in vals:
            raise none_added_error(self._name, "ListState")
        if vals:
            stamp = self._stamp()
            self._t.append([(v, stamp) for v in vals])

    def update(self, values: Iterable[Any]) -> None:
        vals = list(values)
        if None in vals:
            raise none_added_error(self._name, "ListState")
        if vals:
            stamp = self._stamp()
            self._t.put([(v, stamp) for v in vals])
        else:
            self._t.delete()


class _TtlMap(_TtlBase, MapState):
    __slots__ = ()

    def _store(self, m: dict[Any, Any]) -> None:
        if m:
            self._t.put(m)
        else:
            self._t.delete()

    def _entry(self, key: Any) -> Any:
        key = java_key(key)
        t = self._t
        m = t.get()
        if m is MISSING:
            return MISSING
        x = m.get(key, MISSING)
        if x is MISSING:
            return MISSING
        if x[1] + self._ttl <= self._now():
            del m[key]
            self._store(m)
            return x[0] if self._ret_expired else MISSING
        if self._on_read or x[1] == EVENT_TIME_NOT_STARTED:
            stamp = self._stamp()
            if self._on_read or stamp != EVENT_TIME_NOT_STARTED:
                m[key] = (x[0], stamp)
                t.put(m)
        return x[0]

    def get(self, key: Any) -> Any:
        v = self._entry(key)
        return None if v is MISSING else v

    def contains(self, key: Any) -> bool:
        return self._entry(key) is not MISSING

    def put(self, key: Any, value: Any) -> None:
        key = java_key(key)
        t = self._t
        m = t.get()
        if m is MISSING:
            m = {}
        m[key] = (value, self._stamp())
        t.put(m)

    def put_all(self, mapping: dict[Any, Any]) -> None:
        if not mapping:
            return
        mapping = java_map(mapping)
        t = self._t
        m = t.get()
        if m is MISSING:
            m = {}
        stamp = self._stamp()
        for k, v in mapping.items():
            m[k] = (v, stamp)
        t.put(m)

    def remove(self, key: Any) -> None:
        key = java_key(key)
        m = self._t.get()
        if m is MISSING or key not in m:
            return
        del m[key]
        self._store(m)

    def items(self) -> list[tuple[Any, Any]]:
        t = self._t
        m = t.get()
        if m is MISSING:
            return []
        now = self._now()
        ttl = self._ttl
        live = {k: x for k, x in m.items() if x[1] + ttl > now}
        out = [(k, x[0]) for k, x in (m if self._ret_expired else live).items()]
        restamped = self._restamped(live.values()) if live else None
        if restamped is not None:
            t.put(dict(zip(live, restamped)))
        elif len(live) != len(m):
            self._store(live)
        return out

    def keys(self) -> list[Any]:
        return [k for k, _ in self.items()]

    def values(self) -> list[Any]:
        return [v for _, v in self.items()]

    def is_empty(self) -> bool:
        return not self.items()


class _TtlReducing(_TtlBase, ReducingState):
    __slots__ = ("_reduce",)

    def __init__(self, store: Any, descriptor: Any, backend: Any) -> None:
        super().__init__(store, descriptor, backend)
        self._reduce = descriptor.reduce_function

    def get(self) -> Any:
        v = self._get_unexpired()
        return None if v is MISSING else v

    def add(self, value: Any) -> None:
        if value is None:
            raise none_added_error(self._name, "ReducingState")
        t = self._t
        w = t.get()
        if w is MISSING or w[1] + self._ttl <= self._now():  # an expired value never takes part (TtlReduceFunction)
            t.put((value, self._stamp()))
        else:
            t.put((self._reduce(w[0], value), self._stamp()))


class _TtlAggregating(_TtlBase, AggregatingState):
    __slots__ = ("_agg",)

    def __init__(self, store: Any, descriptor: Any, backend: Any) -> None:
        super().__init__(store, descriptor, backend)
        self._agg = descriptor.aggregate_function

    def get(self) -> Any:
        acc = self._get_unexpired()
        return None if acc is MISSING else self._agg.get_result(acc)

    def add(self, value: Any) -> None:
        t = self._t
        w = t.get()
        acc = self._agg.create_accumulator() if w is MISSING or w[1] + self._ttl <= self._now() else w[0]
        t.put((self._agg.add(value, acc), self._stamp()))


STATE_CLASSES: dict[tuple[str, bool], type] = {
    ("value", False): _Value,
    ("list", False): _List,
    ("map", False): _Map,
    ("reducing", False): _Reducing,
    ("aggregating", False): _Aggregating,
    ("value", True): _TtlValue,
    ("list", True): _TtlList,
    ("map", True): _TtlMap,
    ("reducing", True): _TtlReducing,
    ("aggregating", True): _TtlAggregating,
}

__all__ = ["State", "ValueState", "ListState", "MapState", "ReducingState", "AggregatingState"]
