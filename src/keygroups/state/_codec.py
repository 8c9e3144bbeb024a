"""How one key's state value becomes bytes in a snapshot (and in RocksDB), per state kind.

The user parts are encoded by the registered serializers; this module only adds framing:

* value / reducing / aggregating: the serialized value; with TTL, an int64 big-endian timestamp (ms) first.
* list: one frame per element, ``u32 length | [i64 timestamp] | element bytes``; concatenating two encodings gives the
  encoding of the concatenated list (RocksDB appends without decoding).
* map: one frame per entry, ``u32 key length | key bytes | u32 value length | [i64 timestamp] | value bytes``.

Every length is checked against the bytes that remain; anything inconsistent raises ``CorruptSnapshotError``.
In memory, TTL values are ``(value, timestamp)`` tuples (lists: of such tuples; maps: user key -> such a tuple).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from keygroups.errors import CorruptSnapshotError

_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_U32_I64 = struct.Struct(">Iq")
_pack_u32 = _U32.pack
_pack_i64 = _I64.pack
_pack_u32_i64 = _U32_I64.pack


def _corrupt(state: str, what: str) -> CorruptSnapshotError:
    return CorruptSnapshotError(f"state {state!r}: {what}")


class ValueFraming:
    """Encoder/decoder of one state's per-key values: the framing above around the registered serializers (not a
    serializer itself; ``keygroups._native.codec.Codec`` is the compiled form of one). ``ser`` is the value (or
    element / map value) serializer; ``key_ser`` the map-key serializer (maps only)."""

    @classmethod
    def for_state(cls, name: str, kind: str, serializers: dict[str, Any], *, ttl: bool) -> ValueFraming:
        """The framing of state ``name`` of ``kind`` with its serializers by role (a descriptor's ``serializers``,
        or those restored from a snapshot's state meta)."""
        if kind == "list":
            return cls(name, "list", serializers["element"], ttl=ttl)
        if kind == "map":
            return cls(name, "map", serializers["map value"], serializers["map key"], ttl=ttl)
        return cls(name, kind, serializers["value"], ttl=ttl)

    def needs_migration_to(self, write: ValueFraming) -> bool:
        """Whether bytes read with this framing must be rewritten with ``write``: the serializers they were stored with
        are not the ones registered now (read with the old, write with the new)."""
        return not (self.ser.snapshot() == write.ser.snapshot() and
                    (self.key_ser is None or self.key_ser.snapshot() == write.key_ser.snapshot()))

    def __init__(self, state: str, kind: str, ser: Any, key_ser: Any = None, ttl: bool = False) -> None:
        self.state = state
        self.kind = kind
        self.ser = ser
        self.key_ser = key_ser
        self.ttl = ttl
        enc, dec = {
            ("value", False): (self._enc_value, self._dec_value),
            ("value", True): (self._enc_value_ttl, self._dec_value_ttl),
            ("list", False): (self._enc_list, self._dec_list),
            ("list", True): (self._enc_list_ttl, self._dec_list_ttl),
            ("map", False): (self._enc_map, self._dec_map),
            ("map", True): (self._enc_map_ttl, self._dec_map_ttl),
        }[("value" if kind in ("value", "reducing", "aggregating") else kind, ttl)]
        self.encode: Callable[[Any], bytes] = enc
        self.decode: Callable[[Any], Any] = dec
        # Deep copy of one in-memory value, for copy-on-write; None when values are never mutated in place.
        self.copy: Callable[[Any], Any] | None = self._make_copy()

    def decode_many(self, block: Any, offsets: Any) -> list[Any]:
        """Decode n values packed in ``block`` at ``offsets`` (n + 1 positions): compiled for plain value states."""
        if not self.ttl and self.kind in ("value", "reducing", "aggregating"):
            return self.ser.deserialize_many(block, offsets)
        o = list(offsets)
        dec = self.decode
        return [dec(block[o[j]:o[j + 1]]) for j in range(len(o) - 1)]

    # ---- copies -------------------------------------------------------------------------------------------------
    def _make_copy(self) -> Callable[[Any], Any] | None:
        imm = self.ser.is_immutable
        c = self.ser.copy
        if self.kind == "list":  # lists are appended to in place
            if self.ttl:
                return (lambda v: list(v)) if imm else (lambda v: [(c(e), t) for e, t in v])
            return (lambda v: list(v)) if imm else (lambda v: [c(e) for e in v])
        if self.kind == "map":  # maps are updated in place; user keys are immutable (hashable)
            if self.ttl:
                return (lambda v: dict(v)) if imm else (lambda v: {k: (c(x), t) for k, (x, t) in v.items()})
            return (lambda v: dict(v)) if imm else (lambda v: {k: c(x) for k, x in v.items()})
        if imm:
            return None
        if self.ttl:
            return lambda v: (c(v[0]), v[1])
        return c

    # ---- value --------------------------------------------------------------------------------------------------
    def _enc_value(self, v: Any) -> bytes:
        return self.ser.serialize(v)

    def _dec_value(self, b: Any) -> Any:
        return self.ser.deserialize(b)

    def _enc_value_ttl(self, v: Any) -> bytes:
        return _pack_i64(v[1]) + self.ser.serialize(v[0])

    def _dec_value_ttl(self, b: Any) -> Any:
        if len(b) < 8:
            raise _corrupt(self.state, f"a TTL value needs an 8-byte timestamp, got {len(b)} bytes")
        mv = memoryview(b)
        return (self.ser.deserialize(mv[8:]), _I64.unpack_from(mv, 0)[0])

    # ---- list ---------------------------------------------------------------------------------------------------
    def _enc_list(self, v: Any) -> bytes:
        s = self.ser.serialize
        parts = []
        for e in v:
            eb = s(e)
            parts.append(_pack_u32(len(eb)))
            parts.append(eb)
        return b"".join(parts)

    def _enc_list_ttl(self, v: Any) -> bytes:
        s = self.ser.serialize
        parts = []
        for e, ts in v:
            eb = s(e)
            parts.append(_pack_u32_i64(len(eb), ts))
            parts.append(eb)
        return b"".join(parts)

    def frames(self, b: Any) -> list[tuple[int, memoryview]]:
        """A list encoding split into (timestamp or 0, element bytes), checked."""
        mv = memoryview(b).cast("B") if not isinstance(b, memoryview) else b.cast("B") if b.format != "B" else b
        n = len(mv)
        pos = 0
        head = 12 if self.ttl else 4
        out = []
        while pos < n:
            if n - pos < head:
                raise _corrupt(self.state, f"list element header truncated at byte {pos} of {n}")
            if self.ttl:
                ln, ts = _U32_I64.unpack_from(mv, pos)
            else:
                ln, ts = _U32.unpack_from(mv, pos)[0], 0
            pos += head
            if ln > n - pos:
                raise _corrupt(self.state, f"list element of {ln} bytes at byte {pos} overruns the {n}-byte value")
            out.append((ts, mv[pos:pos + ln]))
            pos += ln
        return out

    def _dec_list(self, b: Any) -> Any:
        d = self.ser.deserialize
        return [d(e) for _, e in self.frames(b)]

    def _dec_list_ttl(self, b: Any) -> Any:
        d = self.ser.deserialize
        return [(d(e), ts) for ts, e in self.frames(b)]

    # ---- map ----------------------------------------------------------------------------------------------------
    def _enc_map(self, v: Any) -> bytes:
        ks, vs = self.key_ser.serialize, self.ser.serialize
        parts: list[bytes] = []
        for k, x in v.items():
            kb, xb = ks(k), vs(x)
            parts += (_pack_u32(len(kb)), kb, _pack_u32(len(xb)), xb)
        return b"".join(parts)

    def _enc_map_ttl(self, v: Any) -> bytes:
        ks, vs = self.key_ser.serialize, self.ser.serialize
        parts: list[bytes] = []
        for k, (x, ts) in v.items():
            kb, xb = ks(k), vs(x)
            parts += (_pack_u32(len(kb)), kb, _pack_u32_i64(len(xb), ts), xb)
        return b"".join(parts)

    def entries(self, b: Any) -> list[tuple[memoryview, int, memoryview]]:
        """A map encoding split into (user key bytes, timestamp or 0, user value bytes), checked."""
        mv = memoryview(b)
        if mv.format != "B":
            mv = mv.cast("B")
        n = len(mv)
        pos = 0
        vhead = 12 if self.ttl else 4
        out = []
        while pos < n:
            if n - pos < 4:
                raise _corrupt(self.state, f"map key header truncated at byte {pos} of {n}")
            kl = _U32.unpack_from(mv, pos)[0]
            pos += 4
            if kl > n - pos:
                raise _corrupt(self.state, f"map key of {kl} bytes at byte {pos} overruns the {n}-byte value")
            kb = mv[pos:pos + kl]
            pos += kl
            if n - pos < vhead:
                raise _corrupt(self.state, f"map value header truncated at byte {pos} of {n}")
            if self.ttl:
                vl, ts = _U32_I64.unpack_from(mv, pos)
            else:
                vl, ts = _U32.unpack_from(mv, pos)[0], 0
            pos += vhead
            if vl > n - pos:
                raise _corrupt(self.state, f"map value of {vl} bytes at byte {pos} overruns the {n}-byte value")
            out.append((kb, ts, mv[pos:pos + vl]))
            pos += vl
        return out

    def _dec_map(self, b: Any) -> Any:
        kd, vd = self.key_ser.deserialize, self.ser.deserialize
        return {kd(k): vd(x) for k, _, x in self.entries(b)}

    def _dec_map_ttl(self, b: Any) -> Any:
        kd, vd = self.key_ser.deserialize, self.ser.deserialize
        return {kd(k): (vd(x), ts) for k, ts, x in self.entries(b)}

    # ---- TTL cleanup on bytes (snapshot / restore) ----------------------------------------------------------------
    def drop_expired_bytes(self, b: Any, deadline: int) -> Any:
        """``b`` without the entries whose timestamp is <= ``deadline`` (= now - ttl); None if nothing is left."""
        if self.kind == "list":
            fr = self.frames(b)
            keep = [(ts, e) for ts, e in fr if ts > deadline]
            if len(keep) == len(fr):
                return b
            if not keep:
                return None
            return b"".join(_pack_u32_i64(len(e), ts) + bytes(e) for ts, e in keep)
        if self.kind == "map":
            en = self.entries(b)
            live = [x for x in en if x[1] > deadline]
            if len(live) == len(en):
                return b
            if not live:
                return None
            return b"".join(_pack_u32(len(k)) + bytes(k) + _pack_u32_i64(len(x), ts) + bytes(x) for k, ts, x in live)
        if len(b) < 8:
            raise _corrupt(self.state, f"a TTL value needs an 8-byte timestamp, got {len(b)} bytes")
        return b if _I64.unpack_from(b, 0)[0] > deadline else None

    def drop_expired(self, v: Any, deadline: int) -> Any:
        """In-memory counterpart of :meth:`drop_expired_bytes` (returns a new object when something is dropped)."""
        if self.kind == "list":
            keep = [x for x in v if x[1] > deadline]
            return v if len(keep) == len(v) else (keep or None)
        if self.kind == "map":
            live = {k: x for k, x in v.items() if x[1] > deadline}
            return v if len(live) == len(v) else (live or None)
        return v if v[1] > deadline else None


__all__ = ["ValueFraming"]
