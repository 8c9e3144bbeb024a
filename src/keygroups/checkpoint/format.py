"""The keyed snapshot file format: one file per subtask, one checksummed block per key group, an index at the end.

Layout (little-endian integers; version :data:`FORMAT_VERSION`)::

    header   magic b"\\x89KGS" | u32 version | u32 first key group | u32 key-group count | u32 meta length
             | meta (UTF-8 JSON: {"states": [...]}) | u32 CRC32C(header)
    blocks   for each key group of the range, ascending (empty ones too):
             u32 key group | u32 section count
             | per section: u32 state index | u32 entry count n | n x u32 key length | n x u32 value length
                            | the n keys back to back | the n values back to back
             | u32 CRC32C(block)
    index    u32 offset count (= key groups + 1) | u64 absolute offset of each block, then the end of the last one
             | u32 CRC32C(index)
    footer   u64 index position | magic b"KGSI"

The offsets are also returned by :meth:`KeyedSnapshotWriter.finish` and kept in the
:class:`~keygroups.checkpoint.KeyedStateHandle` (with the state meta), so a restoring subtask reads exactly the
contiguous bytes of the key groups it owns, in one ranged read, without the header or the index.
:func:`open_snapshot` reads a whole file standalone (header and index included), for tools and for checking.

Keys and values are opaque bytes (serialized by the state layer); they come back as ``memoryview`` slices of the
read buffer, so nothing is deserialized or copied until the state layer touches a value (or, on request, as bytes
copies, or as int64 offset arrays for a serializer's ``deserialize_many``: a section's keys are contiguous, as are
its values). Every block is verified (CRC32C, key group, structure) by the compiled parser in
``_native/snapshot.pyx`` before any of it is returned.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import numpy.typing as npt

from keygroups._native import snapshot as _snap
from keygroups._ranges import KeyGroupRange
from keygroups.checkpoint.metadata import KeyedStateHandle
from keygroups.errors import CorruptSnapshotError

if TYPE_CHECKING:
    from keygroups.checkpoint.storage import CheckpointStorage

FORMAT_VERSION: int = _snap.FORMAT_VERSION
FILE_MAGIC: bytes = _snap.FILE_MAGIC

#: n serialized items back to back (``Packed(data, offsets)``, item i = ``data[offsets[i]:offsets[i + 1]]``), as a
#: serializer's ``serialize_many`` returns them; the writer takes it in place of a list of n bytes objects.
Packed = _snap.Packed

#: What one key group's block parses into: ``[(state_index, keys, values), ...]``.
Sections = list[tuple[int, list[memoryview], list[memoryview]]]   # bytes, not memoryview, with copy=True


class KeyedSnapshotWriter:
    """Writes one keyed snapshot file to ``stream`` (the header at once; blocks as key groups are given).

    ``states`` is the per-state meta (name, kind, serializer snapshots by role, TTL) as a JSON list; a section's
    ``state_index`` indexes it. Offsets are absolute positions in the stream (``stream.tell()`` at construction is
    taken as the start, 0 if the stream cannot tell). The stream is not closed."""

    def __init__(self, stream: BinaryIO, key_group_range: KeyGroupRange, states: list[dict[str, Any]]) -> None:
        if not isinstance(key_group_range, KeyGroupRange):
            raise TypeError(f"key_group_range must be a KeyGroupRange, got {type(key_group_range).__name__}")
        if not isinstance(states, list) or not all(isinstance(s, dict) for s in states):
            raise TypeError("states must be a list of JSON dicts (one per state: name, kind, serializers, ttl)")
        try:
            meta = json.dumps({"states": states}, sort_keys=True, separators=(",", ":"), allow_nan=False,
                              ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise TypeError(f"states must be plain JSON: {e}") from e
        self._stream = stream
        self._range = key_group_range
        self._n_states = len(states)
        try:
            self._pos = int(stream.tell())
        except (AttributeError, OSError, ValueError):
            self._pos = 0
        self._write(_snap.encode_header(key_group_range.start, len(key_group_range), meta))
        self._offsets = [self._pos]
        self._next = key_group_range.start
        self._finished = False

    def _write(self, data: bytes) -> None:
        self._stream.write(data)
        self._pos += len(data)

    def _write_block(self, key_group: int, sections: Iterable[Any]) -> None:
        self._write(_snap.encode_block(key_group, sections, self._n_states))
        self._offsets.append(self._pos)

    def write_key_group(self, key_group: int,
                        sections: Iterable[tuple[int, Sequence[bytes] | Packed, Sequence[bytes] | Packed]]) -> None:
        """Write ``key_group``'s block: ``sections`` are ``(state_index, serialized keys, serialized values)``;
        keys or values may also be a :data:`Packed` (``serialize_many``'s output), which avoids n bytes objects.

        Key groups must be strictly ascending and inside the range; skipped ones get empty blocks."""
        if self._finished:
            raise ValueError("write_key_group() after finish(): the snapshot file is complete")
        if isinstance(key_group, bool) or not isinstance(key_group, int):
            raise TypeError(f"key_group must be an int, got {type(key_group).__name__}")
        if key_group not in self._range:
            raise ValueError(f"key group {key_group} is outside this snapshot's {self._range}")
        if key_group < self._next:
            raise ValueError(f"key group {key_group} comes after key group {self._next - 1} was written: key groups "
                             f"must be written once each, in ascending order")
        block = _snap.encode_block(key_group, sections, self._n_states)   # bad input fails before any write
        for kg in range(self._next, key_group):
            self._write_block(kg, ())
        self._write(block)
        self._offsets.append(self._pos)
        self._next = key_group + 1

    def finish(self) -> tuple[list[int], int]:
        """Write empty blocks for the remaining key groups, the index and the footer; flush. Returns
        ``(offsets, file size)``: ``len(range) + 1`` absolute offsets, for the :class:`KeyedStateHandle`."""
        if self._finished:
            raise ValueError("finish() called twice")
        for kg in range(self._next, self._range.end + 1):
            self._write_block(kg, ())
        self._next = self._range.end + 1
        self._write(_snap.encode_index(self._offsets))
        self._finished = True
        flush = getattr(self._stream, "flush", None)
        if flush is not None:
            flush()
        return list(self._offsets), self._pos


def _iter_blocks(data: memoryview, base: int, offsets: Sequence[int], first_index: int, groups: KeyGroupRange,
                 n_states: int, copy: bool) -> Iterator[tuple[int, Sections]]:
    # offsets[first_index + i] is key group groups.start + i's block start; ``data`` starts at file offset ``base``.
    for i, kg in enumerate(groups):
        a = offsets[first_index + i] - base
        b = offsets[first_index + i + 1] - base
        yield kg, _snap.parse_block(data[a:b], kg, n_states, True, copy)


def _ranged_read(storage: CheckpointStorage, handle: KeyedStateHandle, wanted: KeyGroupRange) -> tuple[bytes, int, int]:
    start, end = handle.byte_range(wanted)
    try:
        data = storage.read_bytes(handle.file, start, end)
    except FileNotFoundError:
        raise CorruptSnapshotError(f"keyed state file {handle.file!r} of subtask {handle.subtask} is missing from "
                                   f"{storage.location}") from None
    if len(data) != end - start:
        raise CorruptSnapshotError(f"keyed state file {handle.file!r} is truncated: bytes [{start}, {end}) of key "
                                   f"groups {wanted} gave only {len(data)} bytes")
    return data, start, end


def _read_wanted(storage: CheckpointStorage, handle: KeyedStateHandle, key_groups: KeyGroupRange
                 ) -> tuple[Any, int, int, int, KeyGroupRange] | None:
    """The one ranged read of the handle's key groups that ``key_groups`` asks for: (data, start, end, index of the
    first wanted group in the handle, the wanted range), or None when the handle holds none of them."""
    if not isinstance(handle, KeyedStateHandle):
        raise TypeError(f"handle must be a KeyedStateHandle, got {type(handle).__name__}")
    wanted = handle.key_group_range.intersection(key_groups)
    if not wanted:
        return None
    data, start, end = _ranged_read(storage, handle, wanted)
    return data, start, end, wanted.start - handle.key_group_range.start, wanted


def read_key_groups(storage: CheckpointStorage, handle: KeyedStateHandle, key_groups: KeyGroupRange, *,
                    copy: bool = False) -> tuple[Iterator[tuple[int, Sections]], int]:
    """Read the blocks of ``key_groups ∩ handle.key_group_range`` from ``handle.file`` with ONE ranged read.

    Returns ``(blocks, bytes_read)``: ``blocks`` yields ``(key_group, [(state_index, keys, values), ...])`` in
    key-group order, keys and values as memoryview slices of the bytes read; each block is checked (CRC32C, key
    group, structure) as it is yielded. A missing or short file, or a damaged block, raises CorruptSnapshotError.

    ``copy=True`` yields ``bytes`` copies instead of memoryviews: still not deserialized, about 3x faster to create
    and about 3x smaller to hold for small values (a memoryview object alone is ~180 bytes), and they do not pin
    the read buffer. Prefer it for keys and small values that are kept for a long time."""
    read = _read_wanted(storage, handle, key_groups)
    if read is None:
        return iter(()), 0
    data, start, end, first, wanted = read
    blocks = _iter_blocks(memoryview(data), start, handle.offsets, first, wanted, len(handle.states), copy)
    return blocks, end - start


def read_key_group_offsets(
    storage: CheckpointStorage, handle: KeyedStateHandle, key_groups: KeyGroupRange
) -> tuple[Iterator[tuple[int, memoryview, list[tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64]]]]], int]:
    """As :func:`read_key_groups` (one ranged read, every block checked), but without one object per entry: yields
    ``(key_group, block, [(state_index, key_offsets, value_offsets), ...])`` where ``block`` is a memoryview of the
    key group's bytes and the offsets are int64 arrays of n + 1 positions in it. Keys are contiguous in the block,
    as are values, so ``serializer.deserialize_many(block, key_offsets)`` decodes a state's keys in one call, and
    a lazy backend can keep ``(block, value_offsets)`` instead of n value objects."""
    read = _read_wanted(storage, handle, key_groups)
    if read is None:
        return iter(()), 0
    data, start, end, first, wanted = read
    n_states = len(handle.states)

    def blocks() -> Iterator[tuple[int, memoryview, list[tuple[int, Any, Any]]]]:
        mv = memoryview(data)
        for i, kg in enumerate(wanted):
            block = mv[handle.offsets[first + i] - start:handle.offsets[first + i + 1] - start]
            yield kg, block, _snap.parse_block_offsets(block, kg, n_states)

    return blocks(), end - start


@dataclass
class SnapshotFile:
    """A whole keyed snapshot file opened standalone (header and index read from the file itself)."""

    buffer: Any
    version: int
    key_group_range: KeyGroupRange
    states: list[dict[str, Any]]
    offsets: list[int]

    def key_groups(self, key_groups: KeyGroupRange | None = None, *,
                   copy: bool = False) -> Iterator[tuple[int, Sections]]:
        """Yield ``(key_group, sections)`` for ``key_groups`` (all of the file's by default), each block checked;
        ``copy`` as in :func:`read_key_groups`."""
        wanted = self.key_group_range if key_groups is None else self.key_group_range.intersection(key_groups)
        if not wanted:
            return iter(())
        first = wanted.start - self.key_group_range.start
        return _iter_blocks(memoryview(self.buffer).cast("B"), 0, self.offsets, first, wanted, len(self.states),
                            copy)


def open_snapshot(buffer: Any) -> SnapshotFile:
    """Open a whole keyed snapshot file held in ``buffer`` (bytes, mmap, ``storage.open_buffer(...)``): checks
    the magic, version, header and index checksums and the offsets. CorruptSnapshotError otherwise."""
    version, first, count, meta, header_size = _snap.parse_header(buffer)
    try:
        states = json.loads(meta.decode("utf-8"))["states"]
        if not isinstance(states, list) or not all(isinstance(s, dict) for s in states):
            raise TypeError("'states' is not a list of dicts")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptSnapshotError(f"the snapshot header's state meta passes its checksum but is not valid: {e}") from e
    offsets = _snap.parse_index(buffer, header_size, count)
    kgr = KeyGroupRange(first, first + count - 1) if count else KeyGroupRange.empty()
    return SnapshotFile(buffer=buffer, version=version, key_group_range=kgr, states=states, offsets=offsets)


def write_keyed_snapshot(storage: CheckpointStorage, checkpoint_id: int, subtask: int,
                         key_group_range: KeyGroupRange, states: list[dict[str, Any]],
                         key_groups: Iterable[tuple[int, Iterable[tuple[int, Any, Any]]]], *,
                         prefix: str | None = None, on_key_group: Callable[[], object] | None = None
                         ) -> KeyedStateHandle:
    """Write a whole keyed snapshot file into checkpoint ``checkpoint_id`` and return its handle: the one-call form
    of ``new_file`` + ``open_write`` + :class:`KeyedSnapshotWriter`. ``key_groups`` yields ``(key_group, sections)``
    in ascending key-group order; the file is named ``chk-<id>/<prefix or "keyed-<subtask>">-<uuid>``.

    ``on_key_group`` is called before each key group is written and once more before the file is finished; an
    exception it raises abandons the file (a cancelled snapshot stops this way) and propagates."""
    relpath = storage.new_file(checkpoint_id, prefix or f"keyed-{subtask}")
    with storage.open_write(relpath) as stream:
        writer = KeyedSnapshotWriter(stream, key_group_range, states)
        for kg, sections in key_groups:
            if on_key_group is not None:
                on_key_group()
            writer.write_key_group(kg, sections)
        if on_key_group is not None:
            on_key_group()
        offsets, size = writer.finish()
    return KeyedStateHandle(file=relpath, subtask=subtask, key_group_range=key_group_range, offsets=offsets,
                            size=size, states=states)
