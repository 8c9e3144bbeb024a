"""Namespaced keyed state (Flink's ``InternalKvState`` namespaces): state per (key, namespace), e.g. per window.

A namespaced state of any kind is stored as an ordinary ``MapState`` of the same name per key whose map key is the
namespace (serialized by the namespace serializer) and whose map value is what the state holds in that namespace:
the value (value state), the element list (list state), the reduced value or the accumulator (reducing and
aggregating states). A namespaced map state maps ``(namespace, user key)`` to the user value. Being a map state, it
is in every snapshot, written incrementally, restored lazily and moved with its key group on a rescale, on both
backends, like the timers (``keygroups.state.timers``); the state reader shows it as a map state whose ``map_key``
is the namespace (a window ``(start, end)`` is a struct ``{_1: start, _2: end}``).

Get one with ``backend.get_state(descriptor, namespace=ns, namespace_serializer=ser)``; the same object comes back
for every namespace (its current namespace set to ``ns``), as Flink's ``getPartitionedState``. Every read and write
acts on the backend's current key and the state's current namespace (:meth:`NamespacedState.set_current_namespace`).
Appending states merge namespaces (:meth:`NamespacedState.merge_namespaces`, what session windows need). TTL, when
the descriptor has it, applies per namespace (a namespaced list's elements expire together).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from keygroups.errors import StateMigrationError, none_added_error
from keygroups.serializers import ListSerializer, TupleSerializer, TypeSerializer
from keygroups.state.descriptors import MapStateDescriptor, StateDescriptor
from keygroups.state.states import AggregatingState, ListState, MapState, ReducingState, ValueState


def backing_descriptor(descriptor: StateDescriptor, namespace_serializer: TypeSerializer) -> MapStateDescriptor:
    """The map state that stores ``descriptor``'s namespaced state: same name and TTL, namespace -> what the state
    holds in it (for a map state: (namespace, user key) -> user value)."""
    sers = descriptor.serializers
    if descriptor.kind == "map":
        backing = MapStateDescriptor(descriptor.name, TupleSerializer(namespace_serializer, sers["map key"]),
                                     sers["map value"])
    elif descriptor.kind == "list":
        backing = MapStateDescriptor(descriptor.name, namespace_serializer, ListSerializer(sers["element"]))
    else:
        backing = MapStateDescriptor(descriptor.name, namespace_serializer, sers["value"])
    if descriptor.ttl_config is not None:
        backing.enable_time_to_live(descriptor.ttl_config)
    return backing


class NamespacedState:
    """Base of the namespaced states: the backing map of the current key and the current namespace."""

    __slots__ = ("_m", "_ns", "descriptor", "namespace_serializer")

    def __init__(self, backing: MapState, descriptor: StateDescriptor, namespace_serializer: TypeSerializer,
                 namespace: Any) -> None:
        self._m = backing
        self._ns = namespace
        self.descriptor = descriptor
        self.namespace_serializer = namespace_serializer

    def set_current_namespace(self, namespace: Any) -> None:
        """Make ``namespace`` the one every read and write of this state acts on (for the current key)."""
        self._ns = namespace

    @property
    def current_namespace(self) -> Any:
        return self._ns

    def namespaces(self) -> list[Any]:
        """The current key's namespaces that hold a value (as the namespace serializer gives them back: a window
        restored from a snapshot is a plain ``(start, end)`` tuple, equal to the ``TimeWindow``)."""
        return self._m.keys()

    def clear(self) -> None:
        """Remove the current key's value in the current namespace."""
        self._m.remove(self._ns)

    def get_internal(self) -> Any:
        """What is stored for the current key and namespace (the accumulator of an aggregating state, the list of a
        list state), None if nothing: Flink's ``getInternal``, for operators that combine values themselves."""
        return self._m.get(self._ns)

    def update_internal(self, value: Any) -> None:
        """Store ``value`` as the current key and namespace's internal value (None clears it)."""
        if value is None:
            self._m.remove(self._ns)
        else:
            self._m.put(self._ns, value)

    def merge_namespaces(self, target: Any, sources: Iterable[Any]) -> None:
        """Merge the current key's values in ``sources`` into ``target`` and clear the sources (Flink's
        ``mergeNamespaces``): lists are concatenated, reduced values reduced, accumulators merged."""
        if not self.mergeable:
            raise TypeError(f"state {self.descriptor.name!r} is a namespaced {self.descriptor.kind} state, whose "
                            "values cannot be merged; merge_namespaces needs a list, reducing or aggregating state")
        m = self._m
        merged = m.get(target)
        for source in sources:
            if source == target:
                continue
            value = m.get(source)
            if value is None:
                continue
            merged = value if merged is None else self._merge(merged, value)
            m.remove(source)
        if merged is not None:
            m.put(target, merged)

    #: Whether values of two namespaces combine (:meth:`merge_namespaces`).
    mergeable = False

    def _merge(self, a: Any, b: Any) -> Any:
        raise NotImplementedError


class NamespacedValueState(NamespacedState, ValueState):
    __slots__ = ()

    def value(self) -> Any:
        v = self._m.get(self._ns)
        return self.descriptor.default if v is None else v  # type: ignore[attr-defined]

    def update(self, value: Any) -> None:
        self.update_internal(value)


class NamespacedListState(NamespacedState, ListState):
    __slots__ = ()
    mergeable = True

    def get(self) -> list[Any]:
        v = self._m.get(self._ns)
        return [] if v is None else list(v)

    def add(self, value: Any) -> None:
        self.add_all([value])

    def add_all(self, values: Iterable[Any]) -> None:
        vals = list(values)
        if None in vals:
            raise none_added_error(self.descriptor.name, "ListState")
        if vals:
            current = self._m.get(self._ns)
            self._m.put(self._ns, vals if current is None else [*current, *vals])

    def update(self, values: Iterable[Any]) -> None:
        vals = list(values)
        if None in vals:
            raise none_added_error(self.descriptor.name, "ListState")
        self.update_internal(vals or None)

    def _merge(self, a: Any, b: Any) -> Any:
        return [*a, *b]


class NamespacedReducingState(NamespacedState, ReducingState):
    __slots__ = ()
    mergeable = True

    def get(self) -> Any:
        return self._m.get(self._ns)

    def add(self, value: Any) -> None:
        if value is None:
            raise none_added_error(self.descriptor.name, "ReducingState")
        current = self._m.get(self._ns)
        self._m.put(self._ns, value if current is None else self._merge(current, value))

    def _merge(self, a: Any, b: Any) -> Any:
        return self.descriptor.reduce_function(a, b)  # type: ignore[attr-defined]


class NamespacedAggregatingState(NamespacedState, AggregatingState):
    __slots__ = ()
    mergeable = True

    def get(self) -> Any:
        acc = self._m.get(self._ns)
        return None if acc is None else self.descriptor.aggregate_function.get_result(acc)  # type: ignore

    def add(self, value: Any) -> None:
        agg = self.descriptor.aggregate_function  # type: ignore[attr-defined]
        acc = self._m.get(self._ns)
        self._m.put(self._ns, agg.add(value, agg.create_accumulator() if acc is None else acc))

    def _merge(self, a: Any, b: Any) -> Any:
        merge = getattr(self.descriptor.aggregate_function, "merge", None)  # type: ignore[attr-defined]
        if not callable(merge):
            raise TypeError(f"state {self.descriptor.name!r}: merging namespaces needs the aggregate function's "
                            "merge(a, b) method")
        return merge(a, b)


class NamespacedMapState(NamespacedState, MapState):
    """A map per (key, namespace), stored as (namespace, user key) -> user value."""

    __slots__ = ()

    def get(self, key: Any) -> Any:
        return self._m.get((self._ns, key))

    def put(self, key: Any, value: Any) -> None:
        self._m.put((self._ns, key), value)

    def put_all(self, mapping: dict[Any, Any]) -> None:
        self._m.put_all({(self._ns, k): v for k, v in mapping.items()})

    def remove(self, key: Any) -> None:
        self._m.remove((self._ns, key))

    def contains(self, key: Any) -> bool:
        return self._m.contains((self._ns, key))

    def items(self) -> list[tuple[Any, Any]]:
        ns = self._ns
        return [(k[1], v) for k, v in self._m.items() if k[0] == ns]

    def namespaces(self) -> list[Any]:
        return list(dict.fromkeys(k[0] for k in self._m.keys()))

    def clear(self) -> None:
        ns = self._ns
        for k in [k for k in self._m.keys() if k[0] == ns]:
            self._m.remove(k)

    def get_internal(self) -> Any:
        return dict(self.items()) or None

    def update_internal(self, value: Any) -> None:
        self.clear()
        if value:
            self.put_all(value)


NAMESPACED_CLASSES: dict[str, type[NamespacedState]] = {
    "value": NamespacedValueState,
    "list": NamespacedListState,
    "map": NamespacedMapState,
    "reducing": NamespacedReducingState,
    "aggregating": NamespacedAggregatingState,
}


def namespaced_state(backend: Any, descriptor: StateDescriptor, namespace: Any,
                     namespace_serializer: TypeSerializer | None) -> NamespacedState:
    """``descriptor``'s namespaced state on ``backend`` with its current namespace set to ``namespace``; created on
    first use (the backing map state registered), the same object afterwards. ``namespace_serializer`` is needed the
    first time; later calls may omit it, and one that differs from the first raises."""
    known: dict[str, NamespacedState] = backend.__dict__.setdefault("_namespaced_states", {})
    state = known.get(descriptor.name)
    if state is None:
        if descriptor.name in backend._descriptors:
            raise StateMigrationError(
                f"state {descriptor.name!r} is registered without a namespace; it cannot be used with namespace "
                f"{namespace!r} too: give the namespaced state its own name")
        if not isinstance(namespace_serializer, TypeSerializer):
            raise TypeError(f"state {descriptor.name!r}: a namespaced state needs namespace_serializer=, a "
                            f"TypeSerializer of its namespaces (e.g. TimeWindow.serializer()), got "
                            f"{namespace_serializer!r}")
        backing = backend.get_state(backing_descriptor(descriptor, namespace_serializer))
        state = NAMESPACED_CLASSES[descriptor.kind](backing, descriptor, namespace_serializer, namespace)
        known[descriptor.name] = state
    else:
        if state.descriptor is not descriptor:
            backend._check_same(state.descriptor, descriptor)
        if namespace_serializer is not None and namespace_serializer != state.namespace_serializer:
            raise ValueError(f"state {descriptor.name!r} is registered with namespace serializer "
                             f"{state.namespace_serializer!r}; it cannot be used with {namespace_serializer!r}")
        state.set_current_namespace(namespace)
    return state


__all__ = [
    "NamespacedState",
    "NamespacedValueState",
    "NamespacedListState",
    "NamespacedMapState",
    "NamespacedReducingState",
    "NamespacedAggregatingState",
    "backing_descriptor",
    "namespaced_state",
]
