"""One checked cursor over untrusted bytes (asyncpg's ``ReadBuffer`` habit): every read of a Flink file goes through
it, each read checks the bytes that remain first, and a short or nonsensical read raises ``CorruptSnapshotError``
naming the file and the offset. Integers are big-endian, as Java's ``DataOutputStream`` writes them."""

from __future__ import annotations

import struct

from keygroups.errors import CorruptSnapshotError

_I16 = struct.Struct(">h")
_U16 = struct.Struct(">H")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")


class Cursor:
    """Reads Java ``DataInput`` values from ``data[pos:end]``; ``where`` names the data in errors."""

    __slots__ = ("data", "pos", "end", "where")

    def __init__(self, data: bytes | memoryview, where: str, pos: int = 0, end: int | None = None) -> None:
        self.data = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        self.pos = pos
        self.end = len(self.data) if end is None else end
        self.where = where
        if not 0 <= pos <= self.end <= len(self.data):
            raise CorruptSnapshotError(f"{where}: range [{pos}, {end}) lies outside its {len(self.data)} bytes")

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def fail(self, what: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(f"{self.where} at byte {self.pos}: {what}")

    def _need(self, n: int, what: str) -> int:
        if n < 0 or n > self.end - self.pos:
            raise self.fail(f"{what} needs {n} bytes but {self.end - self.pos} remain (truncated or corrupt)")
        p = self.pos
        self.pos = p + n
        return p

    def u8(self, what: str = "a byte") -> int:
        return self.data[self._need(1, what)]

    def boolean(self, what: str = "a boolean") -> bool:
        b = self.u8(what)
        if b > 1:
            raise self.fail(f"{what} is {b}, not 0 or 1")
        return b == 1

    def i16(self, what: str = "a short") -> int:
        return _I16.unpack_from(self.data, self._need(2, what))[0]

    def u16(self, what: str = "an unsigned short") -> int:
        return _U16.unpack_from(self.data, self._need(2, what))[0]

    def i32(self, what: str = "an int") -> int:
        return _I32.unpack_from(self.data, self._need(4, what))[0]

    def i64(self, what: str = "a long") -> int:
        return _I64.unpack_from(self.data, self._need(8, what))[0]

    def count(self, what: str, min_size: int, limit: int = 1 << 31) -> int:
        """An int count of items of at least ``min_size`` bytes each, checked against what remains before a loop."""
        n = self.i32(what)
        if n < 0:
            raise self.fail(f"{what} is {n}, below 0")
        if n > limit:
            raise self.fail(f"{what} is {n}, above the most keygroups reads ({limit})")
        if n * min_size > self.remaining:
            raise self.fail(f"{what} is {n}: {n} items of at least {min_size} bytes each need {n * min_size} bytes, "
                            f"but {self.remaining} remain (truncated or corrupt)")
        return n

    def take(self, n: int, what: str = "bytes") -> memoryview:
        p = self._need(n, what)
        return memoryview(self.data)[p:p + n]

    def utf(self, what: str = "a string") -> str:
        """Java's ``readUTF``: u16 length, then modified UTF-8 (NUL as C0 80, supplementary characters as two
        3-byte surrogates)."""
        n = self.u16(f"the length of {what}")
        raw = bytes(self.take(n, what))
        try:
            return decode_modified_utf8(raw)
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not modified UTF-8") from None


#: The most characters of a string read from a file that an error message shows.
SHOWN_CHARACTERS = 80


def shown(value: object, limit: int = SHOWN_CHARACTERS) -> str:
    """A value read from a file, as an error message may show it: its ``repr`` (control characters and quotes
    escaped), cut to ``limit`` characters with the full length said; bytes only as their length. A message never
    echoes more of what a file holds than a short, escaped name."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value)} bytes>"
    text = repr(value)
    if len(text) <= limit:
        return text
    length = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters as text"
    return f"{text[:limit]}... ({length})"


def plain(name: str, limit: int = SHOWN_CHARACTERS) -> str:
    """A name read from a file (a Java class, an enum constant) as a message shows it: as it is when printable and
    short, else as ``shown`` gives it (quoted, escaped, cut)."""
    return name if name.isprintable() and len(name) <= limit else shown(name, limit)


def decode_modified_utf8(raw: bytes) -> str:
    """Java's modified UTF-8 → str. Surrogate pairs written as two 3-byte sequences are joined."""
    if raw.isascii():
        return raw.decode("ascii")
    text = raw.replace(b"\xc0\x80", b"\x00").decode("utf-8", "surrogatepass")
    return text.encode("utf-16", "surrogatepass").decode("utf-16")


def encode_modified_utf8(text: str) -> bytes:
    """str → Java's ``writeUTF`` bytes with their u16 length prefix."""
    if text.isascii() and "\x00" not in text:
        body = text.encode("ascii")
    else:
        units = text.encode("utf-16-be", "surrogatepass")
        chars = "".join(chr(int.from_bytes(units[i:i + 2], "big")) for i in range(0, len(units), 2))
        body = chars.encode("utf-8", "surrogatepass").replace(b"\x00", b"\xc0\x80")
    if len(body) > 0xFFFF:
        raise ValueError(f"a string of {len(body)} encoded bytes is longer than Java's writeUTF allows (65535)")
    return _U16.pack(len(body)) + body
