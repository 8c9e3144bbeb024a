"""State descriptors (Flink's ``StateDescriptor`` family): a state's name, kind and serializers.

A descriptor is all a backend needs to create a state or to match it against a restored one. Kinds are the strings
``"value"``, ``"list"``, ``"map"``, ``"reducing"``, ``"aggregating"``; they are stored in snapshots.

Descriptors are generic in the types their serializers hold, so a type checker follows a state's type from its
serializer: ``ValueStateDescriptor("n", Int64Serializer())`` is a ``ValueStateDescriptor[int]``, and
``context.get_state`` of it a ``ValueState[int]``. The parameters are for type checkers only (nothing is checked at
run time beyond the serializers' own checks); ``ValueStateDescriptor[int]`` subscripts at run time too.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Generic

from keygroups._typing import ACC, IN, OUT, K, T, V
from keygroups.serializers import TypeSerializer
from keygroups.state.ttl import StateTtlConfig




class ReduceFunction(abc.ABC, Generic[T]):
    """Combines two values of a ``ReducingState`` into one (Flink's ``ReduceFunction``); a plain callable works too."""

    @abc.abstractmethod
    def reduce(self, value1: T, value2: T) -> T: ...


class AggregateFunction(abc.ABC, Generic[IN, ACC, OUT]):
    """Folds values of type ``IN`` into an accumulator ``ACC`` and reads a result ``OUT`` from it (Flink's
    ``AggregateFunction<IN, ACC, OUT>``). ``add`` may mutate and return ``accumulator``."""

    @abc.abstractmethod
    def create_accumulator(self) -> ACC: ...

    @abc.abstractmethod
    def add(self, value: IN, accumulator: ACC) -> ACC: ...

    @abc.abstractmethod
    def get_result(self, accumulator: ACC) -> OUT: ...

    @abc.abstractmethod
    def merge(self, a: ACC, b: ACC) -> ACC: ...


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a state name must be a non-empty str, got {name!r}")
    return name


def _check_serializer(serializer: Any, role: str, name: str) -> TypeSerializer[Any]:
    if not isinstance(serializer, TypeSerializer):
        raise TypeError(
            f"state {name!r}: the {role} serializer must be a keygroups.serializers.TypeSerializer, got {serializer!r}"
        )
    return serializer


class StateDescriptor:
    """Base of the five descriptors. ``serializers`` maps a role ("value", "element", "map key", "map value") to its
    serializer; ``ttl_config`` is set by :meth:`enable_time_to_live`."""

    kind: str = ""

    def __init__(self, name: str, serializers: dict[str, TypeSerializer[Any]]) -> None:
        self.name = _check_name(name)
        self.serializers = {role: _check_serializer(s, role, self.name) for role, s in serializers.items()}
        self.ttl_config: StateTtlConfig | None = None

    def enable_time_to_live(self, ttl_config: StateTtlConfig) -> None:
        """Turn on TTL for this state (Flink's ``enableTimeToLive``)."""
        if not isinstance(ttl_config, StateTtlConfig):
            raise TypeError(f"enable_time_to_live takes a StateTtlConfig, got {ttl_config!r}")
        self.ttl_config = ttl_config if ttl_config.is_enabled else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class ValueStateDescriptor(StateDescriptor, Generic[T]):
    """A single value of type ``T`` per key. ``default`` is returned by ``value()`` for a key without a value (as
    Flink's deprecated default; prefer handling ``None``)."""

    kind = "value"

    def __init__(self, name: str, serializer: TypeSerializer[T], default: T | None = None) -> None:
        super().__init__(name, {"value": serializer})
        self.default = default


class ListStateDescriptor(StateDescriptor, Generic[T]):
    """A list of elements of type ``T`` per key."""

    kind = "list"

    def __init__(self, name: str, element_serializer: TypeSerializer[T]) -> None:
        super().__init__(name, {"element": element_serializer})


class MapStateDescriptor(StateDescriptor, Generic[K, V]):
    """A map from ``K`` to ``V`` per key. User-map keys must serialize deterministically, like keys."""

    kind = "map"

    def __init__(self, name: str, key_serializer: TypeSerializer[K], value_serializer: TypeSerializer[V]) -> None:
        super().__init__(name, {"map key": key_serializer, "map value": value_serializer})


class ReducingStateDescriptor(StateDescriptor, Generic[T]):
    """One value of type ``T`` per key, combined with every added value by ``reduce_function`` (a
    ``ReduceFunction`` or a callable ``(a, b) -> c``)."""

    kind = "reducing"

    def __init__(self, name: str, reduce_function: ReduceFunction[T] | Callable[[T, T], T],
                 serializer: TypeSerializer[T]) -> None:
        super().__init__(name, {"value": serializer})
        if isinstance(reduce_function, ReduceFunction):
            self.reduce_function: Callable[[T, T], T] = reduce_function.reduce
        elif callable(reduce_function):
            self.reduce_function = reduce_function
        else:
            raise TypeError(f"state {name!r}: reduce_function must be a ReduceFunction or a callable, "
                            f"got {reduce_function!r}")


class AggregatingStateDescriptor(StateDescriptor, Generic[IN, ACC, OUT]):
    """One accumulator (``ACC``) per key, fed values (``IN``) by ``aggregate_function``; ``get()`` returns its result
    (``OUT``). As Flink's ``AggregatingStateDescriptor<IN, ACC, OUT>``."""

    kind = "aggregating"

    def __init__(self, name: str, aggregate_function: AggregateFunction[IN, ACC, OUT],
                 accumulator_serializer: TypeSerializer[ACC]) -> None:
        super().__init__(name, {"value": accumulator_serializer})
        for method in ("create_accumulator", "add", "get_result"):
            if not callable(getattr(aggregate_function, method, None)):
                raise TypeError(f"state {name!r}: aggregate_function needs a {method}() method "
                                f"(see keygroups.state.AggregateFunction), got {aggregate_function!r}")
        self.aggregate_function = aggregate_function


__all__ = [
    "StateDescriptor",
    "ValueStateDescriptor",
    "ListStateDescriptor",
    "MapStateDescriptor",
    "ReducingStateDescriptor",
    "AggregatingStateDescriptor",
    "ReduceFunction",
    "AggregateFunction",
]
