"""Serializers of single scalar values: Int64, Int32, Float64, Bool, Str (UTF-8) and Bytes.

Fixed little-endian formats (int64: 8 bytes, int32: 4, float64: 8 with one canonical NaN, bool: one byte 0/1). A
str or bytes value alone is stored as its raw bytes; nested in a composite it carries a u32 length. Equal values of
the same type always give equal bytes, which keys need.
"""

from __future__ import annotations

from typing import ClassVar

from keygroups._native import codec as _codec
from keygroups._typing import T
from keygroups.serializers.base import AFTER_MIGRATION, CodecSerializer
from keygroups.serializers.compatibility import Compatibility
from keygroups.serializers.snapshot import SerializerSnapshot


class _Primitive(CodecSerializer[T]):
    is_immutable = True
    _kind: ClassVar[int]

    def __init__(self) -> None:
        self._use_codec(_codec.Codec(self._kind, f"{type(self).__name__}()"))

    def copy(self, value: T) -> T:
        return value


class Int64Serializer(_Primitive[int]):
    """Python ints in [-2**63, 2**63 - 1] (Java ``long``): 8 bytes. Reads Int32 data after migration."""

    identifier = "int64"
    _kind = _codec.INT64

    def compatibility_with_other(self, old: SerializerSnapshot) -> tuple[Compatibility, str]:
        if old.identifier == "int32":
            return AFTER_MIGRATION, "Int32 values are widened to Int64"
        return super().compatibility_with_other(old)


class Int32Serializer(_Primitive[int]):
    """Python ints in [-2**31, 2**31 - 1] (Java ``int``): 4 bytes."""

    identifier = "int32"
    _kind = _codec.INT32


class Float64Serializer(_Primitive[float]):
    """Python floats (ints are converted): 8 bytes IEEE 754, every NaN stored as the one canonical quiet NaN.
    Reads Int32 data after migration (exact); not Int64, which a double cannot hold exactly."""

    identifier = "float64"
    _kind = _codec.FLOAT64

    def compatibility_with_other(self, old: SerializerSnapshot) -> tuple[Compatibility, str]:
        if old.identifier == "int32":
            return AFTER_MIGRATION, "Int32 values are converted exactly to Float64"
        return super().compatibility_with_other(old)


class BoolSerializer(_Primitive[bool]):
    """``True``/``False`` (and numpy bools): one byte, 1 or 0; any other byte is corrupt."""

    identifier = "bool"
    _kind = _codec.BOOL


class StrSerializer(_Primitive[str]):
    """Python str as UTF-8 (strings with lone surrogates cannot be stored and raise ``UnicodeEncodeError``)."""

    identifier = "str"
    _kind = _codec.STR


class BytesSerializer(_Primitive[bytes]):
    """bytes (bytearray and memoryview are accepted and come back as bytes)."""

    identifier = "bytes"
    _kind = _codec.BYTES


__all__ = ["Int64Serializer", "Int32Serializer", "Float64Serializer", "BoolSerializer", "StrSerializer",
           "BytesSerializer"]
