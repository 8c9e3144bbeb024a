"""``TypeSerializer``: turns state values into bytes and back, and describes itself with a snapshot.

A serializer class has an ``identifier`` (stored in checkpoints, so never change it), a format ``version`` and a
JSON ``config``; together with its nested serializers they form its ``SerializerSnapshot``. Subclasses that set
``identifier`` are registered automatically, so ``SerializerSnapshot.restore_serializer`` can rebuild them.

Write a custom serializer by subclassing ``TypeSerializer`` and implementing ``serialize``/``deserialize`` (plus
``snapshot_config``/``restore`` when it has configuration, and ``compatibility_with`` for migrations it supports).
The built-in ones are compiled (``keygroups._native.codec``); a custom one nested inside them is called per value.
"""

from __future__ import annotations

import abc
import copy as _copy
from collections.abc import Sequence
from typing import Any, ClassVar, Generic

import numpy as np

from keygroups._typing import T
from keygroups.errors import CorruptSnapshotError
from keygroups.serializers.compatibility import Compatibility
from keygroups.serializers.snapshot import SerializerSnapshot, register_serializer_class

AS_IS = Compatibility.COMPATIBLE_AS_IS
AFTER_MIGRATION = Compatibility.COMPATIBLE_AFTER_MIGRATION
INCOMPATIBLE = Compatibility.INCOMPATIBLE


class TypeSerializer(abc.ABC, Generic[T]):
    """Serializes values of type ``T``; see the module docstring for how to write one.

    The type parameter is for type checkers: a state declared with ``Int64Serializer()`` (a
    ``TypeSerializer[int]``) is a ``ValueState[int]``. A custom serializer names its type when it subclasses:
    ``class PointSerializer(TypeSerializer[Point])``."""

    #: Stored in snapshots; unique per class. Abstract classes leave it None.
    identifier: ClassVar[str | None] = None
    #: The format version written now.
    version: ClassVar[int] = 1
    #: Older versions this class reads directly (as is) and ones it can only read with the old serializer.
    as_is_versions: ClassVar[frozenset[int]] = frozenset()
    migratable_versions: ClassVar[frozenset[int]] = frozenset()
    #: True when values are never mutated in place, so ``copy`` may return them unchanged.
    is_immutable: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("identifier") is not None:
            register_serializer_class(cls)

    # -- bytes -----------------------------------------------------------------------------------------------------

    @abc.abstractmethod
    def serialize(self, value: T) -> bytes:
        """One value → bytes. Wrong types raise ``TypeError``, out-of-range values ``ValueError``."""

    @abc.abstractmethod
    def deserialize(self, data: bytes | memoryview) -> T:
        """Bytes holding exactly one value → the value; bad or truncated bytes raise ``CorruptSnapshotError``."""

    def serialize_many(self, values: Sequence[T]) -> tuple[bytes, np.ndarray]:
        """Values → (one buffer, int64 offsets of length n + 1): value i is ``buffer[offsets[i]:offsets[i + 1]]``."""
        parts = [self.serialize(v) for v in values]
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        if parts:
            np.cumsum([len(p) for p in parts], out=offsets[1:])
        return b"".join(parts), offsets

    def check(self, value: T) -> None:
        """Raise the ``TypeError``/``ValueError`` :meth:`serialize` would raise for ``value``, without keeping its
        bytes. The keyed state backends call it on every write when a serializer overrides it (``RecordSerializer``
        does, compiled), so that a value that does not fit is refused where it is written, not at the snapshot. The
        default checks nothing (the value is checked when a snapshot serializes it)."""

    def deserialize_many(self, data: bytes | memoryview, offsets: Sequence[int] | np.ndarray) -> list[T]:
        """The inverse of ``serialize_many``. The offsets are checked (ascending, inside ``data``) before use."""
        o = np.ascontiguousarray(offsets, dtype=np.int64)
        view = memoryview(data).cast("B")
        n = len(o) - 1
        if n < 0:
            raise ValueError("offsets must hold n + 1 entries (one start, then one end per value)")
        if o[0] < 0 or o[-1] > len(view) or (n > 0 and bool(np.any(np.diff(o) < 0))):
            raise CorruptSnapshotError(f"value offsets are not ascending inside the {len(view)}-byte buffer: "
                                       "the data is truncated or corrupt")
        return [self.deserialize(view[o[i]:o[i + 1]]) for i in range(n)]

    def copy(self, value: T) -> T:
        """A copy safe to mutate while the original is kept (e.g. by a snapshot); the value itself if immutable."""
        if self.is_immutable:
            return value
        return _copy.deepcopy(value)

    # -- snapshot and compatibility ------------------------------------------------------------------------------

    def nested_serializers(self) -> tuple[TypeSerializer[Any], ...]:
        """The serializers this one is built from (their snapshots nest in ours)."""
        return ()

    def snapshot_config(self) -> dict[str, Any]:
        """The JSON configuration stored in the snapshot (besides the nested serializers)."""
        return {}

    def snapshot(self) -> SerializerSnapshot:
        """Identity, version, configuration and nested snapshots: stored beside the state this serializer writes."""
        if self.identifier is None:
            raise TypeError(f"{type(self).__name__} has no identifier, so it cannot be snapshotted; set the class "
                            "attribute identifier to a stable, unique name")
        return SerializerSnapshot(self.identifier, self.version, self.snapshot_config(),
                                  tuple(s.snapshot() for s in self.nested_serializers()))

    @classmethod
    def restore(cls, snapshot: SerializerSnapshot, nested: tuple[TypeSerializer[Any], ...]) -> TypeSerializer[Any]:
        """Rebuild the serializer that wrote ``snapshot`` (its nested serializers already restored).

        The default calls ``cls(*nested, **snapshot.config)``, which reads the current format (and the
        ``as_is_versions``); a class that lists ``migratable_versions`` must override it to return a reader of
        those older formats: that reader is what migration reads the old bytes with.
        """
        from keygroups.errors import StateMigrationError

        if snapshot.version != cls.version and snapshot.version not in cls.as_is_versions:
            raise StateMigrationError(
                f"{cls.__name__} writes format v{cls.version} and cannot restore a reader of its format "
                f"v{snapshot.version}: override {cls.__name__}.restore to return one")
        try:
            return cls(*nested, **snapshot.config)
        except TypeError as e:
            raise StateMigrationError(f"cannot restore {cls.__name__} from the stored snapshot {snapshot!r}: {e}") \
                from None

    def compatibility_with(self, old: SerializerSnapshot) -> tuple[Compatibility, str]:
        """Can this (new) serializer read data written by the serializer of ``old``? (outcome, reason).

        The default: same identifier, then the version rules (``version``, ``as_is_versions``,
        ``migratable_versions``), then an equal config, then the worst of the nested serializers pairwise. A
        different identifier goes to ``compatibility_with_other``.
        """
        if old.identifier != self.identifier:
            return self.compatibility_with_other(old)
        outcome, why = self.version_compatibility(old.version)
        if outcome is INCOMPATIBLE:
            return outcome, why
        if old.config != self.snapshot_config():
            return INCOMPATIBLE, (f"its configuration changed from {old.config} to {self.snapshot_config()}")
        nested_outcome, nested_why = self.nested_compatibility(old)
        if Compatibility.worst(outcome, nested_outcome) is outcome:
            return outcome, why
        return nested_outcome, nested_why

    def migration_reader(self, old: SerializerSnapshot) -> TypeSerializer | None:
        """After migration, the serializer that reads data written with ``old`` (Flink's reconfigured serializer):
        None (the default) reads it with the old serializer restored from ``old``; a serializer whose values change
        shape on migration (``RecordSerializer``) returns one that decodes the old bytes into its new shape."""
        return None

    def refusal_message(self, state_name: str, role: str, old: SerializerSnapshot, why: str) -> str | None:
        """The whole ``StateMigrationError`` message when this serializer cannot read ``old``'s data, or None
        for the generic one."""
        return None

    def compatibility_with_other(self, old: SerializerSnapshot) -> tuple[Compatibility, str]:
        """Data written by a serializer of another identifier: incompatible unless a subclass knows better."""
        return INCOMPATIBLE, f"{type(self).__name__} cannot read data written by {old.describe()}"

    def version_compatibility(self, old_version: int) -> tuple[Compatibility, str]:
        """The outcome for data written by format ``old_version`` of this same class."""
        name = type(self).__name__
        if old_version == self.version or old_version in self.as_is_versions:
            return AS_IS, "same format"
        if old_version in self.migratable_versions:
            return AFTER_MIGRATION, f"{name} format v{old_version} is read with the old serializer, then rewritten"
        if old_version > self.version:
            return INCOMPATIBLE, (f"the data was written by {name} format v{old_version}, newer than the v"
                                  f"{self.version} this code knows (restore with newer keygroups code)")
        return INCOMPATIBLE, f"{name} no longer reads its format v{old_version} (it writes v{self.version})"

    def nested_compatibility(self, old: SerializerSnapshot) -> tuple[Compatibility, str]:
        """The worst outcome of the nested serializers, pairwise with the old nested snapshots."""
        mine = self.nested_serializers()
        if len(mine) != len(old.nested):
            return INCOMPATIBLE, (f"{type(self).__name__} has {len(mine)} nested serializers, the stored one "
                                  f"{len(old.nested)}")
        worst, why = AS_IS, "same format"
        for i, (new_child, old_child) in enumerate(zip(mine, old.nested)):
            outcome, child_why = new_child.compatibility_with(old_child)
            if outcome.rank > worst.rank:
                worst, why = outcome, f"{self.nested_role(i)}: {child_why}"
        return worst, why

    def nested_role(self, index: int) -> str:
        """How nested serializer ``index`` is named in messages."""
        return f"nested serializer {index}"

    # -- identity --------------------------------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TypeSerializer):
            return NotImplemented
        return type(self) is type(other) and self.snapshot() == other.snapshot()

    def __hash__(self) -> int:
        return hash((type(self), self.snapshot()))

    def __repr__(self) -> str:
        args = [repr(s) for s in self.nested_serializers()]
        args += [f"{k}={v!r}" for k, v in self.snapshot_config().items()]
        return f"{type(self).__name__}({', '.join(args)})"


class CodecSerializer(TypeSerializer[T]):
    """A serializer whose bytes are made by a compiled codec (``keygroups._native.codec.Codec``)."""

    _codec: Any

    def _use_codec(self, codec: Any) -> None:
        """Install the compiled codec. Its bound methods also shadow the four methods below on this instance, which
        saves a Python-level call on every value (a third of the cost of serializing an int)."""
        self._codec = codec
        cls = type(self)
        for name, fast in (("serialize", codec.encode), ("deserialize", codec.decode),
                           ("serialize_many", codec.encode_many), ("deserialize_many", codec.decode_many)):
            if getattr(cls, name) is getattr(CodecSerializer, name):   # a subclass's override stays in charge
                self.__dict__[name] = fast

    def serialize(self, value: T) -> bytes:
        return self._codec.encode(value)  # type: ignore[no-any-return]

    def deserialize(self, data: bytes | memoryview) -> T:
        return self._codec.decode(data)  # type: ignore[no-any-return]

    def serialize_many(self, values: Sequence[T]) -> tuple[bytes, np.ndarray]:
        return self._codec.encode_many(values)  # type: ignore[no-any-return]

    def deserialize_many(self, data: bytes | memoryview, offsets: Sequence[int] | np.ndarray) -> list[T]:
        return self._codec.decode_many(data, offsets)  # type: ignore[no-any-return]

    def __reduce__(self) -> tuple:
        # Rebuilt from the constructor arguments: the compiled codec is not picklable, the arguments are.
        return (_rebuild, (type(self), self.nested_serializers(), self.snapshot_config()))


def _rebuild(cls: type, nested: tuple, config: dict) -> TypeSerializer[Any]:
    return cls(*nested, **config)


def checks_on_write(serializer: TypeSerializer[Any]) -> Any:
    """``serializer.check`` when its class overrides :meth:`TypeSerializer.check`, else None (nothing to call)."""
    if type(serializer).check is TypeSerializer.check:
        return None
    return serializer.check


def codec_of(serializer: TypeSerializer[Any]) -> Any:
    """The compiled codec that encodes ``serializer``'s values when nested in a compiled serializer: its own for the
    built-ins, else one that calls its ``serialize``/``deserialize`` per value (length-prefixed)."""
    from keygroups._native import codec as _codec

    if not isinstance(serializer, TypeSerializer):
        raise TypeError(f"expected a TypeSerializer, got {serializer!r} of type {type(serializer).__name__}")
    own = getattr(serializer, "_codec", None)
    if isinstance(own, _codec.Codec):
        return own
    return _codec.Codec(_codec.EXTERNAL, repr(serializer), (), serializer)


__all__ = ["TypeSerializer", "CodecSerializer", "codec_of", "checks_on_write"]
