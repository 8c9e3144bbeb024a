"""Flink's checkpoint ``_metadata`` (format versions 3 to 6: 3 from Flink 1.11 to 1.15, 4 from 1.16 to 1.20, 5 from
2.0, 6 from 2.1 to 2.3; savepoints of Flink 1.15 to 2.3 are tested): operators, their subtasks' state handles, and the
stream handles that locate the bytes (inline, absolute file, or relative to the savepoint).

Mirrors ``Checkpoints`` and ``MetadataV2V3SerializerBase``/``MetadataV3..V6Serializer``. Each handle tag is read
by one small reader in ``KEYED_HANDLE_READERS``/``STREAM_HANDLE_READERS``; a tag keygroups cannot read (incremental
RocksDB, changelog, unaligned channel state) is refused by name.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable

from keygroups.errors import CorruptSnapshotError
from keygroups.flink._cursor import Cursor, encode_modified_utf8, shown
from keygroups.flink.types import UnsupportedFlinkTypeError

MAGIC = 0x4960672D
MASTER_STATE_MAGIC = -0x3694E96A          # 0xc96b1696 as a signed int
SUPPORTED_VERSIONS = frozenset({3, 4, 5, 6})
WRITTEN_VERSION = 3                      # what export writes (see write_metadata)

_I32, _I64 = struct.Struct(">i"), struct.Struct(">q")


class UnsupportedSavepointError(UnsupportedFlinkTypeError):
    """A Flink savepoint or checkpoint uses something keygroups cannot read: a metadata version, an incremental or
    changelog state handle, unaligned channel state. The message names it and what to do."""


# ---------------------------------------------------------------------------------------------- stream handles

@dataclasses.dataclass(frozen=True)
class ByteStreamStateHandle:
    """``ByteStreamStateHandle`` (tag 1): state small enough to be inlined in ``_metadata``."""

    name: str
    data: bytes


@dataclasses.dataclass(frozen=True)
class FileStateHandle:
    """``FileStateHandle`` (tag 2): a file by absolute path (``file:/...`` or another file system's URI)."""

    path: str
    size: int


@dataclasses.dataclass(frozen=True)
class RelativeFileStateHandle:
    """``RelativeFileStateHandle`` (tag 6): a file inside the savepoint directory (savepoints are relocatable)."""

    relative_path: str
    size: int


StreamStateHandle = ByteStreamStateHandle | FileStateHandle | RelativeFileStateHandle


def _byte_stream(c: Cursor) -> ByteStreamStateHandle:
    name = c.utf("a ByteStreamStateHandle's name")
    n = c.i32("a ByteStreamStateHandle's length")
    return ByteStreamStateHandle(name, bytes(c.take(n, "a ByteStreamStateHandle's bytes")))


def _file(c: Cursor) -> FileStateHandle:
    size = c.i64("a FileStateHandle's size")
    return FileStateHandle(c.utf("a FileStateHandle's path"), size)


def _relative(c: Cursor) -> RelativeFileStateHandle:
    path = c.utf("a RelativeFileStateHandle's path")
    if path.startswith("/") or ".." in path.split("/"):
        raise c.fail(f"a relative state handle points outside the savepoint: {shown(path)}")
    return RelativeFileStateHandle(path, c.i64("a RelativeFileStateHandle's size"))


STREAM_HANDLE_READERS: dict[int, Callable[[Cursor], StreamStateHandle]] = {
    1: _byte_stream,
    2: _file,
    6: _relative,
}
_STREAM_HANDLE_NAMES = {3: "KeyGroupsStateHandle", 15: "SegmentFileStateHandle (file merging)",
                        16: "EmptySegmentFileStateHandle (file merging)"}


def read_stream_handle(c: Cursor) -> StreamStateHandle | None:
    tag = c.u8("a stream state handle tag")
    if tag == 0:
        return None
    reader = STREAM_HANDLE_READERS.get(tag)
    if reader is None:
        name = _STREAM_HANDLE_NAMES.get(tag, "an unknown stream state handle")
        raise UnsupportedSavepointError(f"{c.where} at byte {c.pos - 1}: stream state handle tag {tag} ({name}) is "
                                        "not supported; take a canonical savepoint with file merging disabled")
    return reader(c)


# ---------------------------------------------------------------------------------------------- keyed handles

@dataclasses.dataclass(frozen=True)
class KeyGroupsStateHandle:
    """``KeyGroupsStateHandle``/``KeyGroupsSavepointStateHandle``: one subtask's key-group range, the offset of each
    key group's block in the stream (0 = the key group is empty), and the stream."""

    start_key_group: int
    offsets: tuple[int, ...]
    stream: StreamStateHandle
    savepoint: bool
    handle_id: str | None = None

    @property
    def end_key_group(self) -> int:
        """The last key group of the range (inclusive)."""
        return self.start_key_group + len(self.offsets) - 1


def _key_groups(c: Cursor, savepoint: bool, with_id: bool) -> KeyGroupsStateHandle:
    start = c.i32("a key-groups handle's first key group")
    n = c.count("a key-groups handle's number of key groups", 8, limit=1 << 15)
    if start < 0 or start + n > 1 << 15:
        raise c.fail(f"key-group range [{start}, {start + n}) lies outside [0, 32768)")
    offsets = struct.unpack_from(f">{n}q", c.take(8 * n, "key-group offsets")) if n else ()
    stream = read_stream_handle(c)
    if stream is None:
        raise c.fail("a key-groups handle without a stream")
    handle_id = c.utf("a key-groups handle's id") if with_id else None
    return KeyGroupsStateHandle(start, tuple(offsets), stream, savepoint, handle_id)


KEYED_HANDLE_READERS: dict[int, Callable[[Cursor], KeyGroupsStateHandle]] = {
    3: lambda c: _key_groups(c, savepoint=False, with_id=False),     # KEY_GROUPS_HANDLE (before 1.16)
    7: lambda c: _key_groups(c, savepoint=True, with_id=False),      # SAVEPOINT_KEY_GROUPS_HANDLE
    12: lambda c: _key_groups(c, savepoint=False, with_id=True),     # KEY_GROUPS_HANDLE_V2
}
_KEYED_HANDLE_NAMES = {
    5: "IncrementalRemoteKeyedStateHandle (an incremental RocksDB checkpoint or native savepoint)",
    11: "IncrementalRemoteKeyedStateHandle (an incremental RocksDB checkpoint or native savepoint)",
    8: "ChangelogStateBackendHandle", 14: "ChangelogStateBackendHandle",
    9: "InMemoryChangelogStateHandle", 10: "ChangelogStateHandleStreamImpl", 13: "ChangelogStateHandleStreamImpl",
}


def read_keyed_handle(c: Cursor) -> KeyGroupsStateHandle | None:
    tag = c.u8("a keyed state handle tag")
    if tag == 0:
        return None
    reader = KEYED_HANDLE_READERS.get(tag)
    if reader is None:
        name = _KEYED_HANDLE_NAMES.get(tag, "an unknown keyed state handle")
        raise UnsupportedSavepointError(
            f"{c.where} at byte {c.pos - 1}: keyed state handle tag {tag} ({name}) is not supported: keygroups reads "
            "canonical savepoints (flink stop --type canonical, or SavepointFormatType.CANONICAL)")
    return reader(c)


# ---------------------------------------------------------------------------------------------- operator handles

MODES = ("SPLIT_DISTRIBUTE", "UNION", "BROADCAST")   # OperatorStateHandle.Mode, by ordinal


@dataclasses.dataclass(frozen=True)
class OperatorStateMeta:
    """``OperatorStateHandle.StateMetaInfo``: a state's distribution mode and the offset of each element."""

    mode: str
    offsets: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class OperatorStreamStateHandle:
    """``OperatorStreamStateHandle`` (tag 4): per operator state name, its mode and element offsets; the stream."""

    states: dict[str, OperatorStateMeta]
    stream: StreamStateHandle


def read_operator_handle(c: Cursor) -> OperatorStreamStateHandle | None:
    tag = c.u8("an operator state handle tag")
    if tag == 0:
        return None
    if tag != 4:
        raise c.fail(f"operator state handle tag {tag} is not an OperatorStreamStateHandle (4)")
    n = c.count("the number of operator states", 7, limit=1 << 16)
    states = {}
    for _ in range(n):
        name = c.utf("an operator state name")
        mode = c.u8("an operator state's distribution mode")
        if mode >= len(MODES):
            raise c.fail(f"operator state {shown(name)} has distribution mode {mode}; known: {list(enumerate(MODES))}")
        k = c.count(f"operator state {shown(name)}'s number of elements", 8)
        offsets = struct.unpack_from(f">{k}q", c.take(8 * k, "element offsets")) if k else ()
        states[name] = OperatorStateMeta(MODES[mode], tuple(offsets))
    stream = read_stream_handle(c)
    if stream is None:
        raise c.fail("an operator state handle without a stream")
    return OperatorStreamStateHandle(states, stream)


# ---------------------------------------------------------------------------------------------- operators

@dataclasses.dataclass(frozen=True)
class OperatorSubtaskState:
    """``OperatorSubtaskState``: what one subtask of an operator snapshotted."""

    index: int
    managed_operator_state: OperatorStreamStateHandle | None
    raw_operator_state: OperatorStreamStateHandle | None
    managed_keyed_state: KeyGroupsStateHandle | None
    raw_keyed_state: KeyGroupsStateHandle | None


@dataclasses.dataclass(frozen=True)
class OperatorState:
    """``OperatorState``: one operator of the job (by id; name and uid from metadata version 5 on)."""

    operator_id: bytes        # 16 bytes, as stored (the murmur3 x64 128 hash of the uid for user-given uids)
    name: str | None
    uid: str | None
    parallelism: int
    max_parallelism: int
    subtasks: tuple[OperatorSubtaskState, ...]
    finished: bool = False

    @property
    def operator_id_hex(self) -> str:
        """The id as Flink prints it (``OperatorID.toHexString``)."""
        return self.operator_id.hex()


def _channel_state(c: Cursor, what: str) -> None:
    n = c.i32(f"the number of {what} handles")
    if n != 0:
        raise UnsupportedSavepointError(
            f"{c.where}: a subtask holds {n} {what} handles (in-flight data of an unaligned checkpoint); keygroups "
            "reads savepoints and aligned checkpoints only")


def _subtask(c: Cursor, index: int) -> OperatorSubtaskState:
    managed_op = read_operator_handle(c) if c.i32("has managed operator state") else None
    raw_op = read_operator_handle(c) if c.i32("has raw operator state") else None
    managed_keyed = read_keyed_handle(c)
    raw_keyed = read_keyed_handle(c)
    _channel_state(c, "input channel state")
    _channel_state(c, "result subpartition state")
    return OperatorSubtaskState(index, managed_op, raw_op, managed_keyed, raw_keyed)


def _operator(c: Cursor, version: int) -> OperatorState:
    name = uid = None
    if version >= 5:
        name = c.utf("an operator name") or None
        uid = c.utf("an operator uid") or None
    operator_id = bytes(c.take(16, "an operator id"))
    parallelism = c.i32("an operator's parallelism")
    max_parallelism = c.i32("an operator's max parallelism")
    if not (0 < parallelism <= max_parallelism <= 1 << 15):
        raise c.fail(f"operator {uid or operator_id.hex()} has parallelism {parallelism} and max parallelism "
                     f"{max_parallelism}; expected 0 < parallelism <= max parallelism <= 32768")
    coordinator = read_stream_handle(c)
    if coordinator is not None and not isinstance(coordinator, ByteStreamStateHandle):
        raise c.fail("an operator coordinator state that is not inlined")
    n = c.i32("the number of subtask states")
    if n == -1:
        return OperatorState(operator_id, name, uid, parallelism, max_parallelism, (), finished=True)
    if n < 0 or n > parallelism:
        raise c.fail(f"{n} subtask states for an operator of parallelism {parallelism}; expected 0 to {parallelism} "
                     "(or -1: a finished operator)")
    if n * 4 > c.remaining:
        raise c.fail(f"{n} subtask states need at least {n * 4} bytes, but {c.remaining} remain (truncated or "
                     "corrupt)")
    subtasks = []
    for _ in range(n):
        index = c.i32("a subtask index")
        if index < 0:        # -(i + 1): a finished subtask, no state follows
            continue
        if index >= parallelism:
            raise c.fail(f"subtask index {index} of an operator of parallelism {parallelism}")
        subtasks.append(_subtask(c, index))
    return OperatorState(operator_id, name, uid, parallelism, max_parallelism, tuple(subtasks))


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """``CheckpointMetadata``: the checkpoint id and the operators (master states are skipped)."""

    version: int
    checkpoint_id: int
    operators: tuple[OperatorState, ...]


def read_metadata(data: bytes, where: str = "_metadata") -> CheckpointMetadata:
    """Parse a ``_metadata`` file (``Checkpoints.loadCheckpointMetadata``)."""
    c = Cursor(data, where)
    magic = c.i32("the magic number")
    if magic & 0xFFFFFFFF != MAGIC:
        raise CorruptSnapshotError(f"{where} is not a Flink checkpoint metadata file (magic {magic & 0xFFFFFFFF:#x}, "
                                   f"expected {MAGIC:#x})")
    version = c.i32("the metadata version")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedSavepointError(
            f"{where}: Flink metadata version {version} is not supported; keygroups reads versions "
            f"{min(SUPPORTED_VERSIONS)}-{max(SUPPORTED_VERSIONS)}, the canonical savepoints of Flink 1.15 to 2.3 "
            f"(version 3: Flink 1.11-1.15, 4: 1.16-1.20, 5: 2.0, 6: 2.1-2.3){_version_advice(version)}")
    checkpoint_id = c.i64("the checkpoint id")
    if checkpoint_id < 0:
        raise c.fail(f"checkpoint id {checkpoint_id} is negative")
    masters = c.count("the number of master states", 8)
    for _ in range(masters):
        if c.i32("a master state's magic number") != MASTER_STATE_MAGIC:
            raise c.fail("a master state's magic number is wrong")
        c.take(c.i32("a master state's length"), "a master state")
    n = c.count("the number of operators", 30, limit=1 << 20)
    operators = tuple(_operator(c, version) for _ in range(n))
    # Versions 4+ end with Java-serialized CheckpointProperties: never deserialized here.
    return CheckpointMetadata(version, checkpoint_id, operators)


def _version_advice(version: int) -> str:
    if version < min(SUPPORTED_VERSIONS):
        return ("; restore it in Flink 1.15 or later and take a new canonical savepoint there (flink stop --type "
                "canonical)")
    return "; this savepoint comes from a newer Flink: take it with Flink 2.3 or earlier"


# ---------------------------------------------------------------------------------------------- writing

def write_stream_handle(out: bytearray, h: StreamStateHandle | None) -> None:
    if h is None:
        out.append(0)
    elif isinstance(h, ByteStreamStateHandle):
        out.append(1)
        out += encode_modified_utf8(h.name) + _I32.pack(len(h.data)) + h.data
    elif isinstance(h, RelativeFileStateHandle):
        out.append(6)
        out += encode_modified_utf8(h.relative_path) + _I64.pack(h.size)
    else:
        out.append(2)
        out += _I64.pack(h.size) + encode_modified_utf8(h.path)


def write_metadata(checkpoint_id: int, operators: list[OperatorState]) -> bytes:
    """A version-3 ``_metadata`` of a canonical savepoint (no master states; keyed handles are savepoint key-groups
    handles). Version 3, which Flink 2.3 still reads, because versions 4+ end with Java-serialized
    CheckpointProperties that keygroups neither reads nor writes; Flink finds operators by id, so the uid and name
    strings of version 5+ are not needed."""
    out = bytearray(_I32.pack(MAGIC) + _I32.pack(WRITTEN_VERSION))
    out += _I64.pack(checkpoint_id) + _I32.pack(0) + _I32.pack(len(operators))
    for op in operators:
        out += op.operator_id + _I32.pack(op.parallelism) + _I32.pack(op.max_parallelism)
        out.append(0)                                     # no coordinator state
        out += _I32.pack(len(op.subtasks))
        for st in op.subtasks:
            out += _I32.pack(st.index)
            for h in (st.managed_operator_state, st.raw_operator_state):
                if h is None:
                    out += _I32.pack(0)
                else:
                    out += _I32.pack(1)
                    out.append(4)
                    out += _I32.pack(len(h.states))
                    for name, meta in h.states.items():
                        out += encode_modified_utf8(name)
                        out.append(MODES.index(meta.mode))
                        out += _I32.pack(len(meta.offsets)) + b"".join(_I64.pack(o) for o in meta.offsets)
                    write_stream_handle(out, h.stream)
            for k in (st.managed_keyed_state, st.raw_keyed_state):
                if k is None:
                    out.append(0)
                else:
                    out.append(7)
                    out += _I32.pack(k.start_key_group) + _I32.pack(len(k.offsets))
                    out += b"".join(_I64.pack(o) for o in k.offsets)
                    write_stream_handle(out, k.stream)
            out += _I32.pack(0) + _I32.pack(0)              # no channel state
    return bytes(out)
