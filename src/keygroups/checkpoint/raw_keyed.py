"""Raw keyed state: bytes a job's function writes itself, per key group, at snapshot time (Flink's "raw state").

Managed keyed state is serialized by the backend; raw keyed state is a byte stream per key group that the function
writes (``KeyedProcessFunction.snapshot_raw_keyed_state``) and reads back at restore
(``restore_raw_keyed_state``), key group by key group. Because every stream belongs to one key group, it is
rescaled exactly like managed state: a subtask of any new parallelism reads the blocks of exactly its key groups,
from whichever old files hold them (:func:`plan_raw_keyed_restore`: one ranged read per old file). What the bytes
mean is the function's business, so they cannot be re-keyed: a change of the max parallelism is refused while raw
keyed state exists (Flink cannot do it either).

One file per subtask and checkpoint (Flink's ``KeyGroupsStateHandle``), written whole at every checkpoint, in the
checkpoint's directory; its :class:`~keygroups.checkpoint.metadata.RawKeyedStateHandle` in ``_metadata`` holds one
offset per key group. Layout (little-endian; version :data:`~keygroups.checkpoint.metadata.RAW_KEYED_FORMAT_VERSION`)::

    header   magic b"\\x89KGR" | u32 version | u32 first key group | u32 key-group count | u32 CRC32C(header)
    blocks   for each key group of the range, ascending (empty ones too):
             u32 key group | u64 payload length | payload | u32 CRC32C(block)

Blocks are self-delimiting, so :func:`open_raw_keyed` reads a file standalone (tools, checks); a restore reads a
byte range found by the handle's offsets and checks that the blocks fill it exactly. Anything that is not what this
module wrote (a flipped byte, a truncation, a length past the end) is a
:class:`~keygroups.errors.CorruptSnapshotError`.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO

from crc32c import crc32c

from keygroups._ranges import UPPER_BOUND_MAX_PARALLELISM, KeyGroupRange
from keygroups.checkpoint.metadata import RAW_KEYED_FORMAT_VERSION, CheckpointMetadata, RawKeyedStateHandle
from keygroups.checkpoint.planning import plan_raw_keyed_restore
from keygroups.errors import CorruptSnapshotError

if TYPE_CHECKING:
    from keygroups.checkpoint.storage import CheckpointStorage

RAW_KEYED_MAGIC = b"\x89KGR"
_HEADER = struct.Struct("<4sIII")
_CRC = struct.Struct("<I")
_BLOCK_HEAD = struct.Struct("<IQ")
#: Bytes of the header, and of a block around its payload.
HEADER_SIZE = _HEADER.size + _CRC.size
BLOCK_OVERHEAD = _BLOCK_HEAD.size + _CRC.size


# ---- writing ------------------------------------------------------------------------------------------------------


class RawKeyedStateWriter:
    """What :meth:`~keygroups.runtime.functions.KeyedProcessFunction.snapshot_raw_keyed_state` gets: one subtask's
    raw keyed state file being written.

    ``key_groups`` are the subtask's key groups; ``stream(key_group)`` is a binary file-like object (``write``)
    for one of them. Open the key groups in ascending order (opening one finishes the previous one's block); a key
    group never opened is stored empty. Each key group's bytes are held in memory until the next one is opened."""

    def __init__(self, out: BinaryIO, key_groups: KeyGroupRange) -> None:
        if not isinstance(key_groups, KeyGroupRange) or not key_groups:
            raise ValueError(f"a raw keyed state file holds a non-empty KeyGroupRange, got {key_groups!r}")
        self._out = out
        self._key_groups = key_groups
        self._offsets: list[int] = []
        self._current: tuple[int, io.BytesIO] | None = None
        self._pos = 0
        header = _HEADER.pack(RAW_KEYED_MAGIC, RAW_KEYED_FORMAT_VERSION, key_groups.start, len(key_groups))
        self._write(header + _CRC.pack(crc32c(header)))

    @property
    def key_groups(self) -> KeyGroupRange:
        """The key groups this subtask owns: the streams it may write."""
        return self._key_groups

    def stream(self, key_group: int) -> BinaryIO:
        """The binary stream of ``key_group`` (the same one again while it is the current key group). ValueError
        for a key group outside :attr:`key_groups` or one before the current one (blocks are stored ascending)."""
        if isinstance(key_group, bool) or not isinstance(key_group, int) or key_group not in self._key_groups:
            raise ValueError(f"key group {key_group!r} is not one of this subtask's key groups {self._key_groups}")
        if self._current is not None and self._current[0] == key_group:
            return self._current[1]
        if key_group < self._key_groups.start + len(self._offsets):   # its block is already in the file
            raise ValueError(f"raw keyed state streams are written in ascending key group order: key group "
                             f"{key_group} was already finished (the current one is "
                             f"{self._current[0] if self._current else 'none'}); write the key groups of "
                             f"writer.key_groups in order")
        self._finish_until(key_group)
        buffer = io.BytesIO()
        self._current = (key_group, buffer)
        return buffer

    def finish(self) -> list[int]:
        """Write every remaining block; the offsets (one per key group plus the end). The caller closes the file."""
        self._finish_until(self._key_groups.end + 1)
        self._offsets.append(self._pos)
        return self._offsets

    def _finish_until(self, key_group: int) -> None:
        """Write the blocks of every key group before ``key_group`` not written yet (the current one's bytes, empty
        ones for those never opened)."""
        current = self._current
        self._current = None
        for kg in range(self._key_groups.start + len(self._offsets), key_group):
            payload = b""
            if current is not None and current[0] == kg:
                payload = current[1].getvalue()
                current[1].close()   # a write after the block is out fails instead of vanishing
            head = _BLOCK_HEAD.pack(kg, len(payload))
            self._offsets.append(self._pos)
            self._write(head)
            self._write(payload)
            self._write(_CRC.pack(crc32c(payload, crc32c(head))))

    def _write(self, data: bytes) -> None:
        self._out.write(data)
        self._pos += len(data)


def write_raw_keyed_snapshot(storage: CheckpointStorage, relpath: str, *, subtask: int,
                             key_groups: KeyGroupRange, write: Callable[[RawKeyedStateWriter], None]
                             ) -> RawKeyedStateHandle:
    """Write one subtask's raw keyed state file at ``relpath`` (from ``storage.new_file``): ``write`` fills the
    :class:`RawKeyedStateWriter`; the file's handle is returned once it is complete (and durable, locally)."""
    with storage.open_write(relpath) as out:
        writer = RawKeyedStateWriter(out, key_groups)
        write(writer)
        offsets = writer.finish()
    return RawKeyedStateHandle(file=relpath, subtask=subtask, key_group_range=key_groups, offsets=offsets,
                               size=offsets[-1])


# ---- reading ------------------------------------------------------------------------------------------------------


def parse_raw_blocks(data: bytes | memoryview, key_groups: KeyGroupRange, where: str) -> list[memoryview]:
    """The payloads of ``key_groups``' blocks, which must fill ``data`` exactly, in order; ``where`` names the file
    in errors. CorruptSnapshotError on a wrong key group, a length past the end, a checksum mismatch, trailing
    bytes."""
    view = memoryview(data).cast("B")
    payloads: list[memoryview] = []
    pos = 0
    for kg in key_groups:
        if len(view) - pos < BLOCK_OVERHEAD:
            raise CorruptSnapshotError(f"{where}: the block of key group {kg} is truncated ({len(view) - pos} bytes "
                                       f"left, a block takes at least {BLOCK_OVERHEAD})")
        stored_kg, length = _BLOCK_HEAD.unpack_from(view, pos)
        if stored_kg != kg:
            raise CorruptSnapshotError(f"{where}: the block expected for key group {kg} says key group {stored_kg}")
        if length > len(view) - pos - BLOCK_OVERHEAD:
            raise CorruptSnapshotError(f"{where}: key group {kg}'s block declares {length} bytes, past the "
                                       f"{len(view) - pos - BLOCK_OVERHEAD} left: truncated or corrupt")
        end = pos + _BLOCK_HEAD.size + length
        (stored,) = _CRC.unpack_from(view, end)
        if stored != crc32c(view[pos:end]):
            raise CorruptSnapshotError(f"{where}: key group {kg}'s block fails its CRC32C checksum: the file is "
                                       "corrupt")
        payloads.append(view[pos + _BLOCK_HEAD.size:end])
        pos = end + _CRC.size
    if pos != len(view):
        raise CorruptSnapshotError(f"{where}: {len(view) - pos} bytes after the block of key group "
                                   f"{key_groups.end if key_groups else '-'}: the blocks do not fill their range")
    return payloads


def open_raw_keyed(data: bytes | memoryview, where: str = "raw keyed state file"
                   ) -> tuple[KeyGroupRange, list[memoryview]]:
    """A whole raw keyed state file, standalone: its key groups and each one's payload, every checksum verified.
    CorruptSnapshotError on anything this module did not write."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER_SIZE:
        raise CorruptSnapshotError(f"{where} is {len(view)} bytes long, too short for a raw keyed state header "
                                   f"({HEADER_SIZE} bytes): truncated")
    magic, version, first, count = _HEADER.unpack_from(view)
    if magic != RAW_KEYED_MAGIC:
        raise CorruptSnapshotError(f"{where} starts with {bytes(magic)!r}, not the raw keyed state magic "
                                   f"{RAW_KEYED_MAGIC!r}")
    (stored,) = _CRC.unpack_from(view, _HEADER.size)
    if stored != crc32c(view[:_HEADER.size]):
        raise CorruptSnapshotError(f"{where}: the header fails its CRC32C checksum: the file is corrupt")
    if version != RAW_KEYED_FORMAT_VERSION:
        raise CorruptSnapshotError(f"{where} has raw keyed format version {version}; this keygroups reads version "
                                   f"{RAW_KEYED_FORMAT_VERSION} (written by a newer keygroups, or corrupt)")
    if not 1 <= count <= UPPER_BOUND_MAX_PARALLELISM or first + count > UPPER_BOUND_MAX_PARALLELISM:
        raise CorruptSnapshotError(f"{where} declares key groups {first}..{first + count - 1}; key groups are 0.."
                                   f"{UPPER_BOUND_MAX_PARALLELISM - 1} and a file holds at least one")
    if count * BLOCK_OVERHEAD > len(view) - HEADER_SIZE:
        raise CorruptSnapshotError(f"{where} declares {count} key groups but holds {len(view) - HEADER_SIZE} bytes "
                                   f"of blocks, fewer than {count} empty blocks take: truncated")
    key_groups = KeyGroupRange(first, first + count - 1)
    return key_groups, parse_raw_blocks(view[HEADER_SIZE:], key_groups, where)


class RawKeyedStateReader:
    """What :meth:`~keygroups.runtime.functions.KeyedProcessFunction.restore_raw_keyed_state` gets: the raw keyed
    state a subtask owning ``own`` restores from ``metadata``, at any parallelism.

    ``key_groups`` are the subtask's key groups that the restore point holds raw state for (ascending; a block may
    be empty); ``stream(key_group)`` is that key group's bytes as a readable binary stream (empty for a key group
    of the subtask without raw state). Each old file is read when one of its key groups is first asked for, one
    ranged read for all of this subtask's key groups in it, every block's checksum verified.

    ``max_parallelism`` is the restoring job's (None: the checkpoint's); raw bytes cannot be re-keyed, so another
    one raises StateMigrationError."""

    def __init__(self, storage: CheckpointStorage, metadata: CheckpointMetadata, own: KeyGroupRange, *,
                 max_parallelism: int | None = None) -> None:
        self._storage = storage
        self._own = own
        self._checkpoint = (f"savepoint {metadata.base.rsplit('/', 1)[-1]!r}" if metadata.base.startswith("savepoints/")
                            else f"checkpoint {metadata.checkpoint_id}")
        self._plan = plan_raw_keyed_restore(metadata, own, max_parallelism=max_parallelism)
        self._read: dict[int, memoryview] = {}
        self.bytes_read = 0

    @property
    def key_groups(self) -> list[int]:
        """The subtask's key groups with raw state in the restore point, ascending."""
        return [kg for _, part in self._plan for kg in part]

    def stream(self, key_group: int) -> BinaryIO:
        """``key_group``'s raw bytes as a readable binary stream. ValueError for a key group the subtask does not
        own; CorruptSnapshotError if its file is damaged or missing."""
        if isinstance(key_group, bool) or not isinstance(key_group, int) or key_group not in self._own:
            raise ValueError(f"key group {key_group!r} is not one of this subtask's key groups {self._own}")
        if key_group not in self._read:
            for handle, part in self._plan:
                if key_group in part:
                    self._load(handle, part)
                    break
        return io.BytesIO(self._read.get(key_group, b""))

    def _load(self, handle: RawKeyedStateHandle, part: KeyGroupRange) -> None:
        start, end = handle.byte_range(part)
        where = f"raw keyed state file {handle.file} (subtask {handle.subtask}), key groups {part.start}-{part.end}"
        try:
            data = self._storage.read_bytes(handle.file, start, end)
        except FileNotFoundError:
            raise CorruptSnapshotError(
                f"{where} of {self._checkpoint} is missing from {self._storage.location}: the checkpoint references "
                "it, so it is damaged; restore an earlier checkpoint or a savepoint") from None
        if len(data) != end - start:
            raise CorruptSnapshotError(f"{where}: {len(data)} bytes where its handle says {end - start}: truncated")
        self.bytes_read += len(data)
        for kg, payload in zip(part, parse_raw_blocks(data, part, where)):
            self._read[kg] = payload


__all__ = ["RawKeyedStateWriter", "RawKeyedStateReader", "write_raw_keyed_snapshot", "open_raw_keyed",
           "parse_raw_blocks", "RAW_KEYED_MAGIC", "HEADER_SIZE", "BLOCK_OVERHEAD"]
