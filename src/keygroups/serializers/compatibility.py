"""Schema compatibility: can the serializer registered now read the state written with the stored one?

This follows Flink's ``TypeSerializerSnapshot.resolveSchemaCompatibility``: the NEW serializer judges the OLD
serializer's snapshot, with three outcomes.

* ``COMPATIBLE_AS_IS``: the new serializer reads the old bytes directly.
* ``COMPATIBLE_AFTER_MIGRATION``: the old bytes are read with the OLD serializer (restored from its snapshot) and
  written again with the new one.
* ``INCOMPATIBLE``: the state cannot be restored with this serializer → ``StateMigrationError``.

The rules of the built-in serializers (each class decides; see ``TypeSerializer.compatibility_with``):

* same identifier, version and config, nested serializers all as is → as is;
* a composite (Nullable, Tuple, List, Map) is the worst of its nested serializers; a changed tuple arity is
  incompatible;
* widening: ``Int32`` → ``Int64`` and ``Int32`` → ``Float64`` after migration (exact); never narrowing;
* ``X`` → ``Nullable(X')`` after migration when ``X'`` can read ``X`` (``Nullable(X)`` → ``X`` is incompatible: a
  stored None could not be written);
* any serializer built only from the JSON-like built-ins → ``ValueSerializer`` after migration;
* an older format version is as is or after migration as the class declares (``as_is_versions``,
  ``migratable_versions``); a newer one (written by newer code) is incompatible;
* everything else (e.g. ``Str`` → ``Int64``) is incompatible.

Keys must be compatible as is: their bytes decide the key group and every lookup, so they are never migrated.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from keygroups.errors import StateMigrationError, UnsafeDeserializationError
from keygroups.serializers.snapshot import SerializerSnapshot

if TYPE_CHECKING:
    from keygroups.serializers.base import TypeSerializer


class Compatibility(enum.Enum):
    """The outcome of resolving a new serializer against a stored snapshot, best first."""

    COMPATIBLE_AS_IS = "compatible as is"
    COMPATIBLE_AFTER_MIGRATION = "compatible after migration"
    INCOMPATIBLE = "incompatible"

    @property
    def rank(self) -> int:
        """0 (as is) < 1 (after migration) < 2 (incompatible), so that ``max`` gives the worst outcome."""
        return _RANK[self]

    @staticmethod
    def worst(*outcomes: Compatibility) -> Compatibility:
        """The worst of the outcomes (as is when there are none)."""
        return max(outcomes, key=_RANK.__getitem__, default=Compatibility.COMPATIBLE_AS_IS)


_RANK = {
    Compatibility.COMPATIBLE_AS_IS: 0,
    Compatibility.COMPATIBLE_AFTER_MIGRATION: 1,
    Compatibility.INCOMPATIBLE: 2,
}


def resolve_compatibility(state_name: str, old: SerializerSnapshot | dict[str, Any], new: TypeSerializer, *,
                          allow_pickle: bool = False, role: str = "value",
                          require_as_is: bool | None = None) -> tuple[Compatibility, TypeSerializer]:
    """Resolve the serializer registered now (``new``) against the stored snapshot (``old``) of state ``state_name``.

    Returns ``(outcome, read_serializer)``: the serializer to READ the existing bytes with: ``new`` when compatible
    as is; after migration (then write with ``new``) the reader ``new.migration_reader(old)`` gives (a record
    serializer's: old bytes into the new shape), else the old serializer restored from ``old``.

    ``role`` names the serializer in messages ("key", "value", "map key", "element", ...). ``require_as_is`` refuses
    anything but as is (for keys); it defaults to True for ``role="key"`` and False otherwise.

    Raises ``StateMigrationError`` (naming the state, the role and both serializers) when incompatible, and
    ``UnsafeDeserializationError`` when the old data is pickled and ``allow_pickle`` is False.
    """
    from keygroups.serializers.base import TypeSerializer

    if isinstance(old, dict):
        old = SerializerSnapshot.from_json(old)
    if not isinstance(old, SerializerSnapshot):
        raise TypeError(f"old must be a SerializerSnapshot (or its JSON dict), got {type(old).__name__}")
    if not isinstance(new, TypeSerializer):
        raise TypeError(f"new must be a TypeSerializer, got {type(new).__name__}")
    if require_as_is is None:
        require_as_is = role == "key"
    if old.uses_pickle and not allow_pickle:
        raise UnsafeDeserializationError(
            f"state {state_name!r}: the stored {role} serializer ({old.describe()}) holds pickled data, and "
            "unpickling runs arbitrary code; pass allow_pickle=True only if you trust where this checkpoint came from")
    outcome, why = new.compatibility_with(old)
    if outcome is Compatibility.INCOMPATIBLE:
        own = new.refusal_message(state_name, role, old, why)
        if own is not None:
            raise StateMigrationError(own)
        raise StateMigrationError(
            f"For state {state_name!r}, the new {role} serializer ({new!r}) cannot read what the old {role} "
            f"serializer ({old.describe()}) wrote: {why}. Register a {role} serializer that reads the old data "
            "(keygroups.serializers.compatibility lists the migrations), or restore without this state.")
    if require_as_is and outcome is not Compatibility.COMPATIBLE_AS_IS:
        raise StateMigrationError(
            f"For state {state_name!r}, the new {role} serializer ({new!r}) must be compatible as is with the previous "
            f"{role} serializer ({old.describe()}), but it is only {outcome.value} ({why}). {role.capitalize()}s are "
            "never migrated: their bytes decide the key group and every lookup. Keep the old serializer.")
    if outcome is Compatibility.COMPATIBLE_AS_IS:
        return outcome, new
    reader = new.migration_reader(old)
    if reader is None:
        return outcome, old.restore_serializer(allow_pickle=allow_pickle)
    from keygroups.serializers.record import RecordMigrationReader

    if isinstance(reader, RecordMigrationReader) and reader.state is None:
        reader.state = state_name   # named when a stored value cannot take the new shape (binary that is not UTF-8)
    return outcome, reader


__all__ = ["Compatibility", "resolve_compatibility"]
