"""Serializers built from other serializers: Nullable, Tuple, List and Map.

Formats: Nullable is a flag byte (0 = None, 1 = a value follows); Tuple is its fields in order; List is a u32 count
then the elements; Map is a u32 count then (key, value) pairs sorted by the key's bytes, so a dict serializes the
same whatever its insertion order (it deserializes in that sorted order). Any TypeSerializer may be nested; the
built-in ones are encoded by one compiled pass, others are called per value.

Compatibility: the worst of the nested serializers; a tuple whose arity changed is incompatible; a plain ``X`` is
read by ``Nullable(X')`` after migration when ``X'`` reads ``X``. A tuple reads a record's state after migration,
by position, when the record's fields are a Tuple's (``f0, f1, ...``: a Flink TupleN imported as a record) and each
element reads its field (``keygroups.serializers.record.record_as_tuple``). A nested serializer whose values change shape on
migration (a ``RecordSerializer`` whose schema evolved) reads old bytes through its migration reader, wrapped in the
same composite.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

from keygroups._native import codec as _codec
from keygroups._typing import K, V
from keygroups.serializers.base import AFTER_MIGRATION, INCOMPATIBLE, CodecSerializer, TypeSerializer, codec_of
from keygroups.serializers.compatibility import Compatibility
from keygroups.serializers.snapshot import SerializerSnapshot


_A = TypeVar("_A")
_B = TypeVar("_B")
_C = TypeVar("_C")
_D = TypeVar("_D")
_Tuple = TypeVar("_Tuple", bound=tuple[Any, ...])


def _check(serializer: Any, what: str) -> TypeSerializer[Any]:
    if not isinstance(serializer, TypeSerializer):
        raise TypeError(f"{what} must be a TypeSerializer instance (e.g. Int64Serializer()), got {serializer!r}")
    return serializer


def _nested_migration_reader(new: TypeSerializer, old: SerializerSnapshot) -> TypeSerializer | None:
    """A composite of ``new``'s class around its nested serializers' migration readers (the old serializer, restored,
    where one has none), when at least one nested serializer changes its values' shape on migration (a record
    nested in a list, say); None otherwise (the old serializer, restored, reads as is)."""
    mine = new.nested_serializers()
    if old.identifier != new.identifier or len(mine) != len(old.nested):
        return None
    readers = [child.migration_reader(o) for child, o in zip(mine, old.nested)]
    if all(r is None for r in readers):
        return None
    # resolve_compatibility, the only caller, has already refused pickled data unless the caller allowed it
    return type(new)(*(r if r is not None else o.restore_serializer(allow_pickle=True)
                       for r, o in zip(readers, old.nested)))


class NullableSerializer(CodecSerializer[V | None], Generic[V]):
    """``None`` or a value of ``inner``: one flag byte, then the inner bytes."""

    identifier = "nullable"

    def __init__(self, inner: TypeSerializer[V]) -> None:
        self.inner = _check(inner, "NullableSerializer's inner serializer")
        self.is_immutable = inner.is_immutable
        self._use_codec(_codec.Codec(_codec.NULLABLE, repr(self), (codec_of(inner),)))

    def nested_serializers(self) -> tuple[TypeSerializer[Any], ...]:
        return (self.inner,)

    def nested_role(self, index: int) -> str:
        return "the non-null value"

    def copy(self, value: V | None) -> V | None:
        return None if value is None else self.inner.copy(value)

    def migration_reader(self, old: SerializerSnapshot) -> TypeSerializer | None:
        if old.identifier != self.identifier:   # non-null values of the old serializer
            return self.inner.migration_reader(old)
        return _nested_migration_reader(self, old)

    def compatibility_with_other(self, old: SerializerSnapshot) -> tuple[Compatibility, str]:
        outcome, why = self.inner.compatibility_with(old)
        if outcome is INCOMPATIBLE:
            return outcome, f"the non-null value: {why}"
        return AFTER_MIGRATION, f"{old.describe()} values become non-null values of {self!r}"


class TupleSerializer(CodecSerializer[_Tuple], Generic[_Tuple]):
    """Fixed-arity tuples, field i by ``fields[i]`` (Flink's TupleN). Lists of the right length are accepted;
    values always come back as tuples. Typed per field up to four fields (``TupleSerializer(StrSerializer(),
    Int64Serializer())`` is a ``TypeSerializer[tuple[str, int]]``), as ``tuple[Any, ...]`` beyond."""

    identifier = "tuple"

    @overload
    def __init__(self: TupleSerializer[tuple[_A]], f0: TypeSerializer[_A], /) -> None: ...
    @overload
    def __init__(self: TupleSerializer[tuple[_A, _B]], f0: TypeSerializer[_A], f1: TypeSerializer[_B], /) -> None: ...
    @overload
    def __init__(self: TupleSerializer[tuple[_A, _B, _C]], f0: TypeSerializer[_A], f1: TypeSerializer[_B],
                 f2: TypeSerializer[_C], /) -> None: ...
    @overload
    def __init__(self: TupleSerializer[tuple[_A, _B, _C, _D]], f0: TypeSerializer[_A], f1: TypeSerializer[_B],
                 f2: TypeSerializer[_C], f3: TypeSerializer[_D], /) -> None: ...
    @overload
    def __init__(self: TupleSerializer[tuple[Any, ...]], *fields: TypeSerializer[Any]) -> None: ...

    def __init__(self, *fields: TypeSerializer[Any]) -> None:
        if not fields:
            raise ValueError("TupleSerializer needs at least one field serializer")
        self.fields = tuple(_check(f, f"TupleSerializer field {i}") for i, f in enumerate(fields))
        self.is_immutable = all(f.is_immutable for f in self.fields)
        self._use_codec(_codec.Codec(_codec.TUPLE, repr(self), tuple(codec_of(f) for f in self.fields)))

    def nested_serializers(self) -> tuple[TypeSerializer[Any], ...]:
        return self.fields

    def nested_role(self, index: int) -> str:
        return f"field {index}"

    def migration_reader(self, old: SerializerSnapshot) -> TypeSerializer | None:
        if old.identifier == "record":
            from keygroups.serializers.record import TupleMigrationReader

            return TupleMigrationReader(old, self)
        return _nested_migration_reader(self, old)

    def compatibility_with_other(self, old: SerializerSnapshot) -> tuple[Compatibility, str]:
        if old.identifier == "record":   # a Flink TupleN imported as a record f0, f1, ...: read by position
            from keygroups.serializers.record import record_as_tuple

            return record_as_tuple(old, self.fields)
        return super().compatibility_with_other(old)

    def copy(self, value: _Tuple) -> _Tuple:
        if self.is_immutable:
            return value
        return tuple(f.copy(v) for f, v in zip(self.fields, value, strict=True))  # type: ignore[return-value]


class ListSerializer(CodecSerializer[list[V]], Generic[V]):
    """Lists (tuples accepted) of ``element`` values; values come back as lists."""

    identifier = "list"

    def __init__(self, element: TypeSerializer[V]) -> None:
        self.element = _check(element, "ListSerializer's element serializer")
        self._use_codec(_codec.Codec(_codec.LIST, repr(self), (codec_of(element),)))

    def nested_serializers(self) -> tuple[TypeSerializer[Any], ...]:
        return (self.element,)

    def nested_role(self, index: int) -> str:
        return "element"

    def migration_reader(self, old: SerializerSnapshot) -> TypeSerializer | None:
        return _nested_migration_reader(self, old)

    def copy(self, value: list[V]) -> list[V]:
        if self.element.is_immutable:
            return list(value)
        copy = self.element.copy
        return [copy(v) for v in value]


class MapSerializer(CodecSerializer[dict[K, V]], Generic[K, V]):
    """Dicts with keys of ``key`` and values of ``value``; stored sorted by key bytes (deterministic)."""

    identifier = "map"

    def __init__(self, key: TypeSerializer[K], value: TypeSerializer[V]) -> None:
        self.key = _check(key, "MapSerializer's key serializer")
        self.value = _check(value, "MapSerializer's value serializer")
        self._use_codec(_codec.Codec(_codec.MAP, repr(self), (codec_of(key), codec_of(value))))

    def nested_serializers(self) -> tuple[TypeSerializer[Any], ...]:
        return (self.key, self.value)

    def nested_role(self, index: int) -> str:
        return "map key" if index == 0 else "map value"

    def migration_reader(self, old: SerializerSnapshot) -> TypeSerializer | None:
        return _nested_migration_reader(self, old)

    def copy(self, value: dict[K, V]) -> dict[K, V]:
        if self.key.is_immutable and self.value.is_immutable:
            return dict(value)
        kc, vc = self.key.copy, self.value.copy
        return {kc(k): vc(v) for k, v in value.items()}


__all__ = ["NullableSerializer", "TupleSerializer", "ListSerializer", "MapSerializer"]
