"""How one key's state value becomes bytes in a snapshot (and in RocksDB), per state kind: the per-key value framing.

The user parts are encoded by the registered serializers; this module only adds framing (keyed file format 3;
little-endian, as every keygroups format whose byte order is not a sort order):

* value / reducing / aggregating: the serialized value; with TTL, an i64 timestamp (ms) first.
* list: one frame per element, ``u32 length | [i64 timestamp] | element bytes``; concatenating two encodings gives the
  encoding of the concatenated list (RocksDB appends without decoding).
* map: a list whose elements are the entries, each in the one map-entry framing of keygroups (operator state's
  broadcast maps use it too): ``u32 entry length | [i64 timestamp] | u32 key length | key bytes | value bytes``.

Keyed files of formats 1 and 2 framed values big-endian, and a map entry as ``u32 key length | key | u32 value
length | [i64 timestamp] | value``; ``keygroups.checkpoint.format`` rewrites their values into this framing as it reads
them (``_native/framing.pyx``, ``upgrade_block``), so nothing above the file format ever sees the old one.

Splitting and joining frames is compiled (``_native/framing.pyx``, over the checked cursor): every length is checked
against the bytes that remain; anything inconsistent raises ``CorruptSnapshotError``. So are whole values, both ways
(``ValueWriter`` encodes, ``ValueReader`` decodes: the built-in serializers' codecs and records' nodes in C, any other
serializer through its ``serialize``/``deserialize``); the Python methods below stay as ``reference_encode`` and
``reference_decode``, the definition the tests hold the compiled ones to. In memory, TTL values are
``(value, timestamp)`` tuples (lists: of such tuples; maps: user key -> such a tuple). RocksDB keeps a map's entries
as rows (:meth:`ValueFraming.map_rows`): the user key in the database key, ``[i64 timestamp |] value bytes`` as the
row's value. A decoded map's keys are canonical (``java_keys``): they compare as Java's ``equals``, as the states'
lookups do.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from typing import Any

from keygroups._native import framing as _framing
from keygroups._native.statecore import java_keys
from keygroups.errors import CorruptSnapshotError, StateSerializationError

#: What a serializer raises for a value (or key) it cannot write.
UNWRITABLE = (ValueError, TypeError, OverflowError, UnicodeEncodeError)

_I64 = struct.Struct("<q")
_pack_i64 = _I64.pack


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
        #: The compiled encoder of this framing (``_native/framing.pyx``): what :meth:`encode` and the heap
        #: backend's snapshots encode with, in C for the built-in serializers and records.
        self.writer = _framing.ValueWriter("value" if kind in ("value", "reducing", "aggregating") else kind, ttl,
                                           ser, key_ser)
        #: One value -> its bytes (compiled). ``reference_encode`` makes the same bytes in Python, through the
        #: serializers' ``serialize`` and ``join_list``/``join_map``: the definition the tests hold it to.
        self.encode: Callable[[Any], bytes] = self.writer.encode
        self.reference_encode: Callable[[Any], bytes] = enc
        #: The compiled decoder of this framing (``_native/framing.pyx``): in C for the built-in serializers and
        #: records, through ``deserialize`` for any other serializer; map keys canonical (``java_keys``).
        self.reader = _framing.ValueReader(state, "value" if kind in ("value", "reducing", "aggregating") else kind,
                                           ttl, ser, key_ser)
        #: One stored value -> the value (compiled). ``reference_decode`` decodes in Python, through the
        #: serializers' ``deserialize`` and ``split_list``/``split_map``: the definition the tests hold it to (same
        #: values, same errors).
        self.decode: Callable[[Any], Any] = self.reader.decode
        self.reference_decode: Callable[[Any], Any] = dec
        # Deep copy of one in-memory value, for copy-on-write; None when values are never mutated in place.
        self.copy: Callable[[Any], Any] | None = self._make_copy()

    def decode_many(self, block: Any, offsets: Any) -> list[Any]:
        """Decode n values packed in ``block`` at ``offsets`` (n + 1 positions): compiled (plain value states through
        the serializer's ``deserialize_many``, any other through the compiled reader)."""
        if not self.ttl and self.kind in ("value", "reducing", "aggregating"):
            try:
                return self.ser.deserialize_many(block, offsets)
            except CorruptSnapshotError as e:
                raise self._undecodable(e) from None
        values = self.reader.decode_many(block, offsets)
        if values is not None:
            return values
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

    def _undecodable(self, error: CorruptSnapshotError) -> CorruptSnapshotError:
        """``error`` (a serializer's, for the bytes of a value's user part) naming the state and the value's kind:
        restored layers are decoded lazily, on a read or a migration, far from the restore that named the state."""
        what = "a value" if self.kind in ("value", "reducing", "aggregating") else f"a {self.kind} value"
        return _corrupt(self.state, f"{what}: {error}")

    def _dec_value(self, b: Any) -> Any:
        try:
            return self.ser.deserialize(b)
        except CorruptSnapshotError as e:
            raise self._undecodable(e) from None

    def _enc_value_ttl(self, v: Any) -> bytes:
        return _pack_i64(v[1]) + self.ser.serialize(v[0])

    def _dec_value_ttl(self, b: Any) -> Any:
        if len(b) < 8:
            raise _corrupt(self.state, f"a TTL value needs an 8-byte timestamp, got {len(b)} bytes")
        mv = memoryview(b)
        try:
            return (self.ser.deserialize(mv[8:]), _I64.unpack_from(mv, 0)[0])
        except CorruptSnapshotError as e:
            raise self._undecodable(e) from None

    # ---- list ---------------------------------------------------------------------------------------------------
    def _enc_list(self, v: Any) -> bytes:
        s = self.ser.serialize
        return _framing.join_list([s(e) for e in v])

    def _enc_list_ttl(self, v: Any) -> bytes:
        s = self.ser.serialize
        return _framing.join_list([s(e) for e, _ in v], [ts for _, ts in v])

    def _dec_list(self, b: Any) -> Any:
        d = self.ser.deserialize
        elements = self._split_list(b, False)[0]
        try:
            return [d(e) for e in elements]
        except CorruptSnapshotError as e:
            raise self._undecodable(e) from None

    def _dec_list_ttl(self, b: Any) -> Any:
        d = self.ser.deserialize
        elements, ts = self._split_list(b, True)
        try:
            return [(d(e), t) for e, t in zip(elements, ts)]
        except CorruptSnapshotError as e:
            raise self._undecodable(e) from None

    def _split_list(self, b: Any, ttl: bool) -> tuple[list[bytes], Any]:
        try:
            return _framing.split_list(b, ttl)
        except CorruptSnapshotError as e:
            raise _corrupt(self.state, f"a list value: {e}") from None

    # ---- map ----------------------------------------------------------------------------------------------------
    def _enc_map(self, v: Any) -> bytes:
        ks, vs = self.key_ser.serialize, self.ser.serialize
        return _framing.join_map([ks(k) for k in v], [vs(x) for x in v.values()])

    def _enc_map_ttl(self, v: Any) -> bytes:
        ks, vs = self.key_ser.serialize, self.ser.serialize
        entries = v.values()
        return _framing.join_map([ks(k) for k in v], [vs(x) for x, _ in entries], [ts for _, ts in entries])

    def _dec_map(self, b: Any) -> Any:
        kd, vd = self.key_ser.deserialize, self.ser.deserialize
        keys, values, _ = self._split_map(b, False)
        try:
            return dict(zip(java_keys([kd(k) for k in keys]), [vd(x) for x in values]))
        except CorruptSnapshotError as e:
            raise self._undecodable(e) from None

    def _dec_map_ttl(self, b: Any) -> Any:
        kd, vd = self.key_ser.deserialize, self.ser.deserialize
        keys, values, ts = self._split_map(b, True)
        try:
            return dict(zip(java_keys([kd(k) for k in keys]), [(vd(x), t) for x, t in zip(values, ts)]))
        except CorruptSnapshotError as e:
            raise self._undecodable(e) from None

    def _split_map(self, b: Any, ttl: bool) -> tuple[list[bytes], list[bytes], Any]:
        try:
            return _framing.split_map(b, ttl)
        except CorruptSnapshotError as e:
            raise _corrupt(self.state, f"a map value: {e}") from None

    def unwritable(self, key: Any, error: Exception, *, what: str = "snapshot") -> StateSerializationError:
        """The error for an entry of ``key`` whose value (or key) a serializer refused: it names the state, its
        kind and serializers, and the key."""
        serializer = repr(self.ser) if self.key_ser is None else f"{self.key_ser!r} -> {self.ser!r}"
        return StateSerializationError(
            f"state {self.state!r} ({self.kind} state, serializer {serializer}) cannot write the entry of key "
            f"{key!r}: {error}. The {what} fails and nothing is committed; store a value the serializer accepts, "
            "or register the state with one that fits it")

    def first_unwritable(self, entries: Iterable[tuple[Any, Any]], serialize_key: Callable[[Any], bytes],
                         missing: Any) -> Any:
        """The key of the first entry (key, value; ``missing`` for a deletion) that cannot be written on its own,
        ``"(unknown)"`` if each can: the slow search behind :meth:`unwritable` after a batched write failed."""
        for key, value in entries:
            try:
                serialize_key(key)
                if value is not missing:
                    self.encode(value)
            except UNWRITABLE:
                return key
        return "(unknown)"

    def element_count(self, b: Any) -> int:
        """How many elements (a list) or entries (a map) a stored value holds, without deserializing them."""
        if self.kind == "list":
            return len(self._split_list(b, self.ttl)[0])
        if self.kind == "map":
            return len(self._split_map(b, self.ttl)[0])
        raise ValueError(f"state {self.state!r} is a {self.kind} state: only list and map values have elements")

    # ---- RocksDB's rows of a map ----------------------------------------------------------------------------------
    def map_rows(self, b: Any) -> list[tuple[bytes, bytes]]:
        """A map value's entries as RocksDB rows: (user key bytes, ``[i64 timestamp |] user value bytes``)."""
        keys, values, ts = self._split_map(b, self.ttl)
        if ts is None:
            return list(zip(keys, values))
        return [(k, _pack_i64(t) + x) for k, x, t in zip(keys, values, ts)]

    def map_from_rows(self, rows: Iterable[tuple[bytes, bytes]]) -> bytes:
        """The map value of RocksDB rows (:meth:`map_rows`), in row order."""
        rows = list(rows)
        keys = [bytes(k) for k, _ in rows]
        if not self.ttl:
            return _framing.join_map(keys, [bytes(x) for _, x in rows])
        for _, stored in rows:
            if len(stored) < 8:
                raise _corrupt(self.state, f"a TTL map entry of {len(stored)} bytes has no timestamp")
        return _framing.join_map(keys, [bytes(x[8:]) for _, x in rows], [_I64.unpack_from(x)[0] for _, x in rows])

    # ---- TTL cleanup on bytes (snapshot / restore) ----------------------------------------------------------------
    def drop_expired_bytes(self, b: Any, deadline: int) -> Any:
        """``b`` without the entries whose timestamp is <= ``deadline`` (= now - ttl); None if nothing is left."""
        if self.kind in ("list", "map"):
            try:
                return _framing.drop_expired(b, deadline)
            except CorruptSnapshotError as e:
                raise _corrupt(self.state, f"a {self.kind} value: {e}") from None
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
