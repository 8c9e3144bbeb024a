"""Flink's keyed state in the canonical savepoint format (FLIP-41, the same for the heap and RocksDB backends): the
header of a subtask's keyed stream (``KeyedBackendSerializationProxy``) and its key-group blocks
(``FullSnapshotAsyncWriter``, read back by ``FullSnapshotRestoreOperation``).

A block starts with a state id (short), then (int length, key, int length, value) pairs; the last pair of each state
run has bit 0x80 set in its first key byte and is followed by the next state id, or 0xFFFF at the end of the key
group. A key is the key group (1 byte when max parallelism <= 128, else 2), the key, the namespace, and for map state
the user key (``CompositeKeySerializationUtils``). With snapshot compression each block is its own Snappy framed
stream (xerial's ``SnappyFramedOutputStream``), decoded by cramjam.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator
from typing import Any

import cramjam

from keygroups._native import flinkin
from keygroups.errors import CorruptSnapshotError, KeyGroupsError
from keygroups.flink._cursor import Cursor, encode_modified_utf8, plain, shown
from keygroups.flink.types import (
    FlinkType,
    ListType,
    MapType,
    TimerType,
    TtlType,
    UnknownSerializerSnapshotError,
    UnsupportedFlinkTypeError,
    read_serializer_snapshot,
    unsupported_types,
    write_serializer_snapshot,
)

HEADER_VERSION = 6                       # KeyedBackendSerializationProxy.VERSION (Flink 1.9+)
META_INFO_VERSION = 6                    # StateMetaInfoSnapshotReadersWriters.CURRENT_STATE_META_INFO_SNAPSHOT_VERSION
END_OF_KEY_GROUP = 0xFFFF
FIRST_BIT = 0x80
LIST_DELIMITER = 0x2C                    # ',' between list elements (ListDelimitedSerializer)
BACKEND_STATE_TYPES = ("KEY_VALUE", "OPERATOR", "BROADCAST", "PRIORITY_QUEUE")
KEYED_STATE_KINDS = frozenset({"VALUE", "LIST", "MAP", "REDUCING", "AGGREGATING"})

_I32 = struct.Struct(">i")


@dataclasses.dataclass(frozen=True)
class StateMetaInfoSnapshot:
    """``StateMetaInfoSnapshot``: one state's name, backend type, options and serializers."""

    name: str
    backend_type: str                      # KEY_VALUE | PRIORITY_QUEUE (OPERATOR/BROADCAST in operator files)
    options: dict[str, str]
    serializers: dict[str, FlinkType]

    @property
    def kind(self) -> str:
        """VALUE, LIST, MAP, REDUCING, AGGREGATING, or TIMER for a timer (priority queue) state."""
        if self.backend_type == "PRIORITY_QUEUE":
            return "TIMER"
        return self.options.get("KEYED_STATE_TYPE", self.options.get("OPERATOR_STATE_DISTRIBUTION_MODE", "?"))

    @property
    def value_type(self) -> FlinkType:
        return self.serializers["VALUE_SERIALIZER"]

    @property
    def namespace_type(self) -> FlinkType | None:
        return self.serializers.get("NAMESPACE_SERIALIZER")


def read_state_meta_info(c: Cursor) -> StateMetaInfoSnapshot:
    """One state's meta info. A serializer keygroups skips but does not map (Kryo, POJO, ...) becomes an
    ``UnsupportedType`` that knows its state's name (so using it refuses by name); one it cannot skip (a user's own
    serializer) raises ``UnknownSerializerSnapshotError`` naming the state."""
    name = c.utf("a state name")
    backend = c.i32(f"state {shown(name)}'s backend state type")
    if not 0 <= backend < len(BACKEND_STATE_TYPES):
        raise c.fail(f"state {shown(name)} has backend state type {backend}; known: "
                     f"{list(enumerate(BACKEND_STATE_TYPES))}")
    options = {}
    for _ in range(c.count(f"state {shown(name)}'s number of options", 4, limit=64)):
        k = c.utf("an option name")
        options[k] = c.utf("an option value")
    serializers = {}
    for _ in range(c.count(f"state {shown(name)}'s number of serializers", 8, limit=16)):
        k = c.utf("a serializer key")
        try:
            serializers[k] = read_serializer_snapshot(c)
        except UnsupportedFlinkTypeError as e:
            cls = getattr(e, "snapshot_class", "?")
            raise UnknownSerializerSnapshotError(
                cls, f"{c.where}: state {shown(name)} ({plain(k)}): {e}. keygroups skips the snapshots of Flink's own "
                "serializers (Kryo, POJO, Avro, Value types, ...) but not this one") from None
        for u in unsupported_types(serializers[k]):
            u.state = name
    if "VALUE_SERIALIZER" not in serializers:
        raise c.fail(f"state {shown(name)} has no VALUE_SERIALIZER")
    return StateMetaInfoSnapshot(name, BACKEND_STATE_TYPES[backend], options, serializers)


def read_state_meta_infos(c: Cursor, n: int, what: str, ends_header: bool) -> list[StateMetaInfoSnapshot]:
    """``n`` states' meta info; a snapshot keygroups cannot skip stops them all, and the error says which states
    it hides: their names when they end the header (``ends_header``: the cursor ends where the header does) and can
    be found after it, else how many."""
    states: list[StateMetaInfoSnapshot] = []
    for i in range(n):
        try:
            states.append(read_state_meta_info(c))
        except UnknownSerializerSnapshotError as e:
            after = n - i - 1
            hidden = _names_after(c, after) if after and ends_header else []
            if not after:
                tail = f"it is the last of the {what}'s {n} states"
            elif hidden:
                tail = (f"the {what}'s states after it ({', '.join(map(repr, hidden))}) cannot be read either: "
                        "convert the state in Flink first (State Processor API), or give it a serializer Flink ships")
            else:
                tail = (f"the {after} states of the {what} after it cannot be read either: convert the state in "
                        "Flink first (State Processor API), or give it a serializer Flink ships")
            raise UnknownSerializerSnapshotError(e.snapshot_class, f"{e}; {tail}") from None
    return states


def _names_after(c: Cursor, count: int) -> list[str]:
    """The names of the ``count`` states that follow an unknown serializer snapshot, found by looking for where
    the next state's meta info starts: a candidate counts only when the ``count`` states read from it end exactly
    where the header ends (any doubt: [])."""
    data, start, end = c.data, c.pos, c.end
    raw = bytes(data[start:end])
    marker = encode_modified_utf8("KEYED_STATE_TYPE")
    pos = raw.find(marker)
    for _ in range(3):    # the next state's is the first unless the unknown payload holds the marker: few tries
        if pos == -1:
            break
        # the state's name, backend type (int) and option count (int) come before its first option's name
        for name_len in range(0, min(pos - 8 - 2, 0xFFFF) + 1):
            at = pos - 8 - 2 - name_len
            if at < 0:
                break
            if int.from_bytes(raw[at:at + 2], "big") != name_len:
                continue
            probe = Cursor(data, c.where, start + at, end)
            try:
                states = [read_state_meta_info(probe) for _ in range(count)]
            except (KeyGroupsError, ValueError):
                continue
            if probe.remaining == 0:
                return [s.name for s in states]
        pos = raw.find(marker, pos + 1)
    return []


def write_state_meta_info(out: bytearray, m: StateMetaInfoSnapshot) -> None:
    out += encode_modified_utf8(m.name) + _I32.pack(BACKEND_STATE_TYPES.index(m.backend_type))
    out += _I32.pack(len(m.options))
    for k, v in m.options.items():
        out += encode_modified_utf8(k) + encode_modified_utf8(v)
    out += _I32.pack(len(m.serializers))
    for k, t in m.serializers.items():
        out += encode_modified_utf8(k)
        write_serializer_snapshot(out, t)


@dataclasses.dataclass(frozen=True)
class KeyedBackendHeader:
    """``KeyedBackendSerializationProxy``: compression, the key serializer, and the states in id order (a state's id
    in the blocks is its position here)."""

    compression: bool
    key_type: FlinkType
    states: tuple[StateMetaInfoSnapshot, ...]


def read_keyed_header(c: Cursor) -> KeyedBackendHeader:
    version = c.i32("the keyed state header version")
    if version != HEADER_VERSION:
        raise UnsupportedFlinkTypeError(f"{c.where}: keyed state header version {version} is not supported (only "
                                        f"{HEADER_VERSION}, written by Flink 1.9 and later)")
    compression = c.boolean("the snapshot compression flag")
    try:
        key_type = read_serializer_snapshot(c)
    except UnsupportedFlinkTypeError as e:
        raise UnsupportedFlinkTypeError(f"{c.where}: the key serializer: {e}; key the job by a basic type, String, "
                                        "byte[] or a Tuple of them") from None
    for u in unsupported_types(key_type):   # a Kryo or POJO key: the states list, none of them reads
        u.is_key = True
    n = c.u16("the number of states")
    states = tuple(read_state_meta_infos(c, n, "keyed header", ends_header=True))
    for s in states:
        if s.backend_type not in ("KEY_VALUE", "PRIORITY_QUEUE"):
            raise c.fail(f"state {shown(s.name)} of type {s.backend_type} in a keyed state stream")
        if s.kind == "TIMER":
            timer_type(s)
            continue
        if s.kind not in KEYED_STATE_KINDS:
            raise c.fail(f"keyed state {shown(s.name)} has KEYED_STATE_TYPE {shown(s.kind)}; known: "
                         f"{sorted(KEYED_STATE_KINDS)}")
        if s.namespace_type is None:
            raise c.fail(f"keyed state {shown(s.name)} has no NAMESPACE_SERIALIZER")
        if s.kind == "LIST":
            list_element_type(s)
        elif s.kind == "MAP":
            map_value_type(s)
    return KeyedBackendHeader(compression, key_type, states)


def write_keyed_header(out: bytearray, h: KeyedBackendHeader) -> None:
    out += _I32.pack(HEADER_VERSION)
    out.append(1 if h.compression else 0)
    write_serializer_snapshot(out, h.key_type)
    out += struct.pack(">H", len(h.states))
    for s in h.states:
        write_state_meta_info(out, s)


def key_group_prefix_bytes(max_parallelism: int) -> int:
    """``CompositeKeySerializationUtils.computeRequiredBytesInKeyGroupPrefix``."""
    return 1 if max_parallelism <= 128 else 2


# ---------------------------------------------------------------------------------------------- blocks

def read_block(data: bytes | memoryview, start: int, end: int, compressed: bool, where: str) -> bytes | memoryview:
    """The bytes of one key group's block: ``data[start:end]``, Snappy-decoded when compressed."""
    if not 0 <= start < end <= len(data):
        raise CorruptSnapshotError(f"{where}: key-group block [{start}, {end}) lies outside its {len(data)} bytes")
    raw = memoryview(data)[start:end]
    if not compressed:
        return raw
    try:
        return bytes(cramjam.snappy.decompress(raw))
    except Exception as e:   # cramjam raises its own DecompressionError for bad frames or checksums
        raise CorruptSnapshotError(f"{where}: the Snappy-compressed key-group block at byte {start} does not "
                                   f"decode: {e}") from None


def iter_block_entries(block: bytes | memoryview, key_group: int, prefix_bytes: int, n_states: int,
                       where: str) -> Iterator[tuple[int, bytes, bytes]]:
    """(state id, key without the key-group prefix, value) of every entry of one key group's block. The block is
    scanned first, compiled (``flinkin.scan_block``): every length is checked against the bytes that remain before it
    is used, and a corrupt block raises CorruptSnapshotError, naming the byte offset, before any entry is given."""
    data = bytes(block)
    scan = flinkin.scan_block(data, key_group, prefix_bytes, n_states, where)
    sid, ks, ke, vs, ve = (a.tolist() for a in scan.arrays())
    for i in range(len(sid)):
        yield sid[i], data[ks[i]:ke[i]], data[vs[i]:ve[i]]


def _variable_int_bytes(n: int) -> bytes:
    """``CompositeKeySerializationUtils.writeVariableIntBytes``: little-endian bytes until the rest is 0."""
    out = bytearray()
    while True:
        out.append(n & 0xFF)
        n >>= 8
        if n == 0:
            return bytes(out)


def composite_key_ambiguous(key_type: FlinkType, namespace_type: FlinkType | None) -> bool:
    """Flink appends the key's and namespace's lengths when both are variable-length."""
    return namespace_type is not None and key_type.length < 0 and namespace_type.length < 0


def decode_key(key: bytes, key_type: FlinkType, namespace_type: FlinkType | None, user_key_type: FlinkType | None,
               where: str) -> tuple[Any, Any, Any]:
    """(key, namespace, user key) of a composite key (its key-group prefix removed)."""
    c = Cursor(key, where)
    ambiguous = composite_key_ambiguous(key_type, namespace_type)
    start = c.pos
    k = key_type.read(c)
    if ambiguous:
        _expect(c, _variable_int_bytes(c.pos - start), "the key's length")
    ns = None
    if namespace_type is not None:
        start = c.pos
        ns = namespace_type.read(c)
        if ambiguous:
            _expect(c, _variable_int_bytes(c.pos - start), "the namespace's length")
    uk = user_key_type.read(c) if user_key_type is not None else None
    if c.remaining:
        raise c.fail(f"{c.remaining} bytes follow the key, namespace and user key")
    return k, ns, uk


def encode_key(out: bytearray, key: Any, namespace: Any, key_type: FlinkType, namespace_type: FlinkType) -> None:
    """The inverse of ``decode_key`` without the user key and prefix."""
    ambiguous = composite_key_ambiguous(key_type, namespace_type)
    start = len(out)
    key_type.write(out, key)
    if ambiguous:
        out += _variable_int_bytes(len(out) - start)
    start = len(out)
    namespace_type.write(out, namespace)
    if ambiguous:
        out += _variable_int_bytes(len(out) - start)


def _expect(c: Cursor, want: bytes, what: str) -> None:
    got = bytes(c.take(len(want), what))
    if got != want:
        raise c.fail(f"{what} is {got.hex()}, expected {want.hex()}")


def decode_list_value(value: memoryview, element: FlinkType, where: str) -> list:
    """A list state's value: elements separated by ',' (``ListDelimitedSerializer``)."""
    c = Cursor(value, where)
    out = []
    while c.remaining:
        out.append(element.read(c))
        if c.remaining:
            d = c.u8("a list delimiter")
            if d != LIST_DELIMITER:
                raise c.fail(f"list elements are separated by {LIST_DELIMITER:#x}, found {d:#x}")
    return out


def encode_list_value(out: bytearray, values: list, element: FlinkType) -> None:
    for i, v in enumerate(values):
        if i:
            out.append(LIST_DELIMITER)
        element.write(out, v)


def decode_value(value: bytes | memoryview, t: FlinkType, where: str) -> Any:
    fast = t.fixed_struct
    if fast is not None and len(value) == fast.size:
        return t.from_fixed(fast.unpack(value)[0])
    c = Cursor(value, where)
    v = t.read(c)
    if c.remaining:
        raise c.fail(f"{c.remaining} bytes follow a {t!r} value")
    return v


def map_value_type(meta: StateMetaInfoSnapshot) -> tuple[FlinkType, FlinkType]:
    """(user key type, user value type) of a map state."""
    t = meta.value_type
    if not isinstance(t, MapType):
        raise UnsupportedFlinkTypeError(f"map state {meta.name!r} has value serializer {t!r}, not a MapSerializer")
    return t.key, t.value


def list_element_type(meta: StateMetaInfoSnapshot) -> FlinkType:
    t = meta.value_type
    if not isinstance(t, ListType):
        raise UnsupportedFlinkTypeError(f"list state {meta.name!r} has value serializer {t!r}, not a ListSerializer")
    return t.element


def timer_type(meta: StateMetaInfoSnapshot) -> TimerType:
    t = meta.value_type
    if not isinstance(t, TimerType):
        raise UnsupportedFlinkTypeError(f"priority-queue state {meta.name!r} holds {t!r}, not timers; keygroups "
                                        "reads Flink's timer queues only")
    return t


def is_ttl(t: FlinkType) -> bool:
    return isinstance(t, TtlType)
