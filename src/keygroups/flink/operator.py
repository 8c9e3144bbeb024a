"""Flink's operator state stream (``OperatorBackendSerializationProxy`` + ``DefaultOperatorStateBackend``'s
snapshot): a header of list-state and broadcast-state meta info, then the elements at the offsets the metadata's
``OperatorStreamStateHandle`` lists. With snapshot compression everything after the header is one Snappy framed
stream (``CompressibleFSDataOutputStream``) flushed before each offset is taken, so each element (and each broadcast
map) is whole chunks from its offset to the next: they decode alone once the stream identifier is put in front."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

from keygroups.errors import CorruptSnapshotError
from keygroups.flink._cursor import Cursor, shown
from keygroups.flink.keyed import StateMetaInfoSnapshot, read_block, read_state_meta_infos, write_state_meta_info
from keygroups.flink.types import FlinkType, UnsupportedFlinkTypeError

SNAPPY_STREAM_IDENTIFIER = b"\xff\x06\x00\x00sNaPpY"
HEADER_VERSION = 6                   # OperatorBackendSerializationProxy.VERSION (compression flag since Flink 1.18)
# Version 5 (Flink 1.7 to 1.17) is version 6 without the compression flag: operator state was never compressed.
READ_HEADER_VERSIONS = frozenset({5, HEADER_VERSION})
_I32 = struct.Struct(">i")


@dataclasses.dataclass(frozen=True)
class OperatorBackendHeader:
    """``OperatorBackendSerializationProxy``: compression, list (split/union) states and broadcast states."""

    compression: bool
    states: dict[str, StateMetaInfoSnapshot]
    broadcast_states: dict[str, StateMetaInfoSnapshot]


def read_operator_header(c: Cursor) -> OperatorBackendHeader:
    version = c.i32("the operator state header version")
    if version not in READ_HEADER_VERSIONS:
        raise UnsupportedFlinkTypeError(f"{c.where}: operator state header version {version} is not supported; "
                                        "keygroups reads versions 5 and 6 (written by Flink 1.7 to 2.3)")
    compression = c.boolean("the snapshot compression flag") if version >= 6 else False
    states = {}
    n = c.u16("the number of operator states")
    for m in read_state_meta_infos(c, n, "operator state header", ends_header=False):
        if m.backend_type != "OPERATOR" or m.kind not in ("SPLIT_DISTRIBUTE", "UNION"):
            raise c.fail(f"operator state {shown(m.name)} is {m.backend_type} with mode {shown(m.kind)} (expected "
                         "OPERATOR, SPLIT_DISTRIBUTE or UNION)")
        states[m.name] = m
    broadcast = {}
    n = c.u16("the number of broadcast states")
    for m in read_state_meta_infos(c, n, "broadcast state header", ends_header=False):
        if m.backend_type != "BROADCAST" or m.kind != "BROADCAST" or "KEY_SERIALIZER" not in m.serializers:
            raise c.fail(f"broadcast state {shown(m.name)} is {m.backend_type} with mode {shown(m.kind)} and "
                         f"serializers {shown(sorted(m.serializers))} (expected BROADCAST with a KEY_SERIALIZER)")
        broadcast[m.name] = m
    return OperatorBackendHeader(compression, states, broadcast)


def write_operator_header(out: bytearray, h: OperatorBackendHeader) -> None:
    """Version 5 for uncompressed operator state, which every Flink from 1.7 to 2.3 restores (versions 1.15 to 1.17
    refuse version 6); version 6 only when the flag is needed."""
    if h.compression:
        out += _I32.pack(HEADER_VERSION)
        out.append(1)
    else:
        out += _I32.pack(5)
    for group in (h.states, h.broadcast_states):
        out += struct.pack(">H", len(group))
        for m in group.values():
            write_state_meta_info(out, m)


def read_elements(data: bytes | memoryview, offsets: tuple[int, ...], all_offsets: list[int], value_type: FlinkType,
                  compression: bool, where: str) -> list[Any]:
    """The elements of one list (split or union) state of one subtask."""
    return [_read_at(data, o, all_offsets, compression, where, value_type.read) for o in offsets]


def read_broadcast(data: bytes | memoryview, offsets: tuple[int, ...], all_offsets: list[int], key_type: FlinkType,
                   value_type: FlinkType, compression: bool, where: str) -> dict[Any, Any]:
    """One subtask's copy of a broadcast state: int count, then (key, value) pairs (values not null)."""
    if len(offsets) != 1:
        raise UnsupportedFlinkTypeError(f"{where}: a broadcast state with {len(offsets)} offsets (expected 1)")

    def read_map(c: Cursor) -> dict:
        n = c.count("a broadcast state's size", max(1, key_type.length))
        return {key_type.read(c): value_type.read(c) for _ in range(n)}

    return _read_at(data, offsets[0], all_offsets, compression, where, read_map)


def _read_at(data, offset, all_offsets, compression, where, read):
    later = [o for o in all_offsets if o > offset]
    end = min(later) if later else len(data)
    if compression:
        if not 0 <= offset < end <= len(data):
            raise CorruptSnapshotError(f"{where}: operator state element [{offset}, {end}) lies outside its "
                                       f"{len(data)} bytes")
        chunks = bytes(memoryview(data)[offset:end])
        if not chunks.startswith(SNAPPY_STREAM_IDENTIFIER):
            chunks = SNAPPY_STREAM_IDENTIFIER + chunks
        c = Cursor(read_block(chunks, 0, len(chunks), True, where), where)
    else:
        c = Cursor(data, where, offset, end)
    value = read(c)
    if compression and c.remaining:
        raise c.fail(f"{c.remaining} bytes follow an operator state element")
    return value
