"""``ValueSerializer``: any JSON-like Python value, self-describing, deterministic.

Each value starts with a tag byte: None, False, True, int64 (8 bytes), big int (u32 length + two's complement,
little-endian: ints of any size are supported; those in int64 range always use the 8-byte form), float64 (8 bytes,
canonical NaN), str (u32 length + UTF-8), bytes (u32 length + bytes), list, tuple (u32 count + values), dict (u32
count + (key, value) pairs sorted by the key's bytes).

Equal values of the same types give equal bytes whatever a dict's insertion order, so the bytes can serve as
keyed-state keys. Subclasses are stored as their base type (a namedtuple comes back as a tuple, an IntEnum as an
int, a bytearray as bytes) and numpy scalars as bool/int/float. Nesting deeper than 100 levels is refused (and a
list that contains itself with it).
"""

from __future__ import annotations

from typing import Any

from keygroups._native import codec as _codec
from keygroups.serializers.base import AFTER_MIGRATION, CodecSerializer
from keygroups.serializers.compatibility import Compatibility
from keygroups.serializers.snapshot import SerializerSnapshot

# Built-in serializers whose values ValueSerializer can represent, so it can take over their state by migration.
_JSON_LIKE = frozenset({"int64", "int32", "float64", "bool", "str", "bytes", "nullable", "tuple", "list", "map",
                        "value"})


def _json_like(snapshot: SerializerSnapshot) -> bool:
    return snapshot.identifier in _JSON_LIKE and all(_json_like(n) for n in snapshot.nested)


class ValueSerializer(CodecSerializer[Any]):
    """JSON-like values: None, bool, int (any size), float, str, bytes, list, tuple and dict, nested freely.

    Reads, after migration, the data of any serializer built only from the built-in JSON-like ones.
    """

    identifier = "value"
    is_immutable = False

    def __init__(self) -> None:
        self._use_codec(_codec.Codec(_codec.VALUE, "ValueSerializer()"))

    def copy(self, value: Any) -> Any:
        return _codec.copy_json_value(value)

    def compatibility_with_other(self, old: SerializerSnapshot) -> tuple[Compatibility, str]:
        if _json_like(old):
            return AFTER_MIGRATION, f"{old.describe()} values are rewritten in the self-describing value format"
        return super().compatibility_with_other(old)


__all__ = ["ValueSerializer"]
