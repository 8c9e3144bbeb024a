"""Serializer snapshots: what is stored beside state so that a later job can read it back.

A snapshot names the serializer (``identifier``), the version of its format, its configuration and the snapshots of
the serializers nested in it. It is plain JSON, so checkpoint metadata never needs pickle to describe its state, and
``restore_serializer`` rebuilds the serializer that wrote the data (the OLD one), which is what reads state that must
be migrated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from keygroups.errors import CorruptSnapshotError, StateMigrationError, UnsafeDeserializationError

if TYPE_CHECKING:
    from keygroups.serializers.base import TypeSerializer

#: The identifier of ``PickleSerializer``; a snapshot holding it anywhere ``uses_pickle``.
PICKLE_IDENTIFIER = "pickle"

#: Nesting deeper than this in stored JSON is refused (stored data is untrusted; recursion must stay bounded).
MAX_SNAPSHOT_DEPTH = 64

# identifier -> serializer class; filled by TypeSerializer.__init_subclass__.
_REGISTRY: dict[str, type[TypeSerializer]] = {}


def register_serializer_class(cls: type[TypeSerializer]) -> None:
    """Make ``cls`` restorable from snapshots carrying ``cls.identifier``.

    Called automatically for every ``TypeSerializer`` subclass that sets ``identifier``; an identifier can belong to
    one class only (re-registering the same qualified name is allowed, so modules can be reloaded).
    """
    ident = cls.identifier
    if ident is None:
        raise TypeError(f"{cls.__qualname__} has no identifier to register")
    old = _REGISTRY.get(ident)
    if old is not None and old is not cls and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"serializer identifier {ident!r} is already used by {old.__module__}.{old.__qualname__}; "
                         f"choose another identifier for {cls.__module__}.{cls.__qualname__}")
    _REGISTRY[ident] = cls


def serializer_class(identifier: str) -> type[TypeSerializer] | None:
    """The class registered for ``identifier``, or None."""
    return _REGISTRY.get(identifier)


class SerializerSnapshot:
    """Identity, format version, configuration and nested snapshots of a serializer. Frozen, hashable, JSON-able.

    ``config`` holds JSON values only (str, int, float, bool, None, lists, dicts with str keys).
    """

    __slots__ = ("identifier", "version", "config", "nested", "_key")

    identifier: str
    version: int
    config: dict[str, Any]
    nested: tuple[SerializerSnapshot, ...]
    _key: tuple[str, int, str, tuple[SerializerSnapshot, ...]]

    def __init__(self, identifier: str, version: int, config: Mapping[str, Any] | None = None,
                 nested: tuple[SerializerSnapshot, ...] | list[SerializerSnapshot] = ()) -> None:
        if not isinstance(identifier, str) or not identifier:
            raise TypeError(f"a serializer identifier must be a non-empty str, got {identifier!r}")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise TypeError(f"a serializer version must be an int >= 0, got {version!r}")
        nested = tuple(nested)
        for n in nested:
            if not isinstance(n, SerializerSnapshot):
                raise TypeError(f"nested snapshots must be SerializerSnapshot, got {type(n).__name__}")
        cfg = dict(config or {})
        try:
            key = json.dumps(cfg, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"serializer config must be JSON (str keys; str/int/float/bool/None/list/dict values): "
                            f"{cfg!r}: {e}") from None
        object.__setattr__(self, "identifier", identifier)
        object.__setattr__(self, "version", version)
        object.__setattr__(self, "config", json.loads(key))   # a private copy: callers cannot mutate it
        object.__setattr__(self, "nested", nested)
        object.__setattr__(self, "_key", (identifier, version, key, nested))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"SerializerSnapshot is frozen; cannot set {name}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"SerializerSnapshot is frozen; cannot delete {name}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SerializerSnapshot):
            return NotImplemented
        return self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return (f"SerializerSnapshot({self.identifier!r}, {self.version}, {self.config!r}"
                + (f", {list(self.nested)!r})" if self.nested else ")"))

    def __reduce__(self) -> tuple:
        return (SerializerSnapshot, (self.identifier, self.version, self.config, self.nested))

    def describe(self) -> str:
        """A short human form in the style of the serializers' repr, e.g. ``TupleSerializer(Int64Serializer(),
        StrSerializer())``, with `` v1`` when the stored format version differs from the current one."""
        cls = _REGISTRY.get(self.identifier)
        own = getattr(cls, "describe_stored", None)
        if cls is None:
            head = f"unknown serializer {self.identifier!r}"
        elif own is not None:   # a class whose config reads better in its own words (a record's schema)
            head = own(self)
        else:
            args = [n.describe() for n in self.nested] + [f"{k}={v!r}" for k, v in self.config.items()]
            head = f"{cls.__name__}({', '.join(args)})"
        if cls is None or self.version != cls.version:
            head += f" v{self.version}"
        return head

    # -- JSON ------------------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict (the inverse of ``from_json``)."""
        return {
            "identifier": self.identifier,
            "version": self.version,
            "config": json.loads(self._key[2]),
            "nested": [n.to_json() for n in self.nested],
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> SerializerSnapshot:
        """Parse a dict written by ``to_json``; anything malformed raises ``CorruptSnapshotError``."""
        return _from_json(d, 0)

    # -- restore ---------------------------------------------------------------------------------------------------

    @property
    def uses_pickle(self) -> bool:
        """True when this serializer or one nested in it stores pickled bytes."""
        return self.identifier == PICKLE_IDENTIFIER or any(n.uses_pickle for n in self.nested)

    def restore_serializer(self, *, allow_pickle: bool = False) -> TypeSerializer:
        """The serializer that wrote the data (the OLD one), rebuilt from this snapshot.

        Raises ``UnsafeDeserializationError`` if it would unpickle and ``allow_pickle`` is False, and
        ``StateMigrationError`` if the identifier is unknown here or the class cannot restore this version.
        """
        if self.uses_pickle and not allow_pickle:
            raise UnsafeDeserializationError(
                f"the stored serializer {self.describe()} reads pickled data, and unpickling runs arbitrary code; "
                "pass allow_pickle=True only if you trust where this checkpoint came from")
        cls = _REGISTRY.get(self.identifier)
        if cls is None:
            raise StateMigrationError(
                f"the stored serializer identifier {self.identifier!r} is not registered in this process; import "
                f"the module that defines its TypeSerializer subclass (known: {sorted(_REGISTRY)})")
        nested = tuple(n.restore_serializer(allow_pickle=allow_pickle) for n in self.nested)
        return cls.restore(self, nested)


def _from_json(d: Any, depth: int) -> SerializerSnapshot:
    if depth > MAX_SNAPSHOT_DEPTH:
        raise CorruptSnapshotError(f"a serializer snapshot nested deeper than {MAX_SNAPSHOT_DEPTH} levels")
    if not isinstance(d, dict):
        raise CorruptSnapshotError(f"a serializer snapshot must be a JSON object, got {type(d).__name__}")
    ident = d.get("identifier")
    version = d.get("version")
    config = d.get("config", {})
    nested = d.get("nested", [])
    if not isinstance(ident, str) or not ident:
        raise CorruptSnapshotError(f"a serializer snapshot has no valid identifier: {d!r:.200}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise CorruptSnapshotError(f"serializer snapshot {ident!r} has an invalid version {version!r}")
    if not isinstance(config, dict):
        raise CorruptSnapshotError(f"serializer snapshot {ident!r} has a config that is not an object: {config!r:.200}")
    if not isinstance(nested, list):
        raise CorruptSnapshotError(f"serializer snapshot {ident!r} has nested snapshots that are not a list")
    try:
        return SerializerSnapshot(ident, version, config, tuple(_from_json(n, depth + 1) for n in nested))
    except RecursionError:
        raise CorruptSnapshotError(f"serializer snapshot {ident!r} has a config nested too deeply") from None
    except TypeError as e:
        raise CorruptSnapshotError(f"serializer snapshot {ident!r} is malformed: {e}") from None


__all__ = ["SerializerSnapshot", "register_serializer_class", "serializer_class", "PICKLE_IDENTIFIER",
           "MAX_SNAPSHOT_DEPTH"]
