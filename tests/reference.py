"""A slow, plain-Python reference of Flink's key-group arithmetic, written from the Java definitions.

The compiled core is tested against this, and ``murmur_hash`` against ``mmh3`` (an independent implementation), so
no test compares our compiled code with itself.
"""

from __future__ import annotations

import math
import struct

MASK32 = 0xFFFFFFFF


def to_int32(x: int) -> int:
    x &= MASK32
    return x - (1 << 32) if x >= 1 << 31 else x


def string_hash(s: str) -> int:
    h = 0
    units = s.encode("utf-16-le", "surrogatepass")
    for (u,) in struct.iter_unpack("<H", units):
        h = (31 * h + u) & MASK32
    return to_int32(h)


def bytes_hash(b: bytes) -> int:
    h = 1
    for byte in b:
        h = (31 * h + (byte - 256 if byte > 127 else byte)) & MASK32
    return to_int32(h)


def long_hash(v: int) -> int:
    u = v & 0xFFFFFFFFFFFFFFFF
    return to_int32(u ^ (u >> 32))


def double_hash(d: float) -> int:
    bits = 0x7FF8000000000000 if math.isnan(d) else struct.unpack("<Q", struct.pack("<d", d))[0]
    return to_int32(bits ^ (bits >> 32))


def float_hash(f: float) -> int:
    bits = 0x7FC00000 if math.isnan(f) else struct.unpack("<I", struct.pack("<f", f))[0]
    return to_int32(bits)


def java_hash(key: object, key_type: object = None) -> int:
    if isinstance(key, tuple):
        types = key_type if isinstance(key_type, tuple) else (None,) * len(key)
        h = 0
        for field, t in zip(key, types):
            h = (31 * h + java_hash(field, t)) & MASK32
        return to_int32(h)
    if key_type in ("int", "short", "byte"):
        return int(key)
    if key_type == "double":
        return double_hash(float(key))
    if key_type == "float":
        return float_hash(float(key))
    if isinstance(key, bool):
        return 1231 if key else 1237
    if isinstance(key, int):
        return long_hash(key)
    if isinstance(key, float):
        return double_hash(key)
    if isinstance(key, str):
        return string_hash(key)
    if isinstance(key, bytes):
        return bytes_hash(key)
    raise TypeError(type(key))


def murmur_hash(code: int) -> int:
    """Flink's MathUtils.murmurHash, transcribed step by step."""

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & MASK32

    c = code & MASK32
    c = (c * 0xCC9E2D51) & MASK32
    c = rotl(c, 15)
    c = (c * 0x1B873593) & MASK32
    c = rotl(c, 13)
    c = (c * 5 + 0xE6546B64) & MASK32
    c ^= 4
    c ^= c >> 16
    c = (c * 0x85EBCA6B) & MASK32
    c ^= c >> 13
    c = (c * 0xC2B2AE35) & MASK32
    c ^= c >> 16
    s = to_int32(c)
    if s >= 0:
        return s
    if s != -(1 << 31):
        return -s
    return 0


def key_group(key: object, max_parallelism: int, key_type: object = None) -> int:
    return murmur_hash(java_hash(key, key_type)) % max_parallelism
