"""The operator state file format: one file per subtask, its states' serialized elements back to back.

Layout (little-endian; version :data:`~keygroups.checkpoint.metadata.OPERATOR_FORMAT_VERSION`)::

    header   magic b"KGOP" | u16 format version | u16 zero
    states   each state's elements, serialized, back to back (a broadcast map as ``u32 key length | key | value``
             elements, see ``keygroups._native.splitter.encode_entries``)

The file has no index: its :class:`~keygroups.checkpoint.metadata.OperatorStateHandle` (in ``_metadata``) holds,
per state, the mode, the serializer snapshots, one absolute offset per element plus the end, and CRC32C checksums
of blocks of whole elements (about :data:`BLOCK_BYTES` each), so a reader of a slice verifies only the blocks it
reads.

Reading executes a plan of :class:`~keygroups.checkpoint.planning.ElementRun` (see ``planning.py``) and moves no
element through a deserializer: the compiled splitter validates each run's offsets against the file, the run's
checksum blocks are verified, and the run is sliced in place out of the mapped file (ranged reads on remote
storage). :meth:`RestoredList.to_bytes` copies a share into one buffer when it must travel.
"""

from __future__ import annotations

import bisect
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from keygroups._native import splitter
from keygroups.checkpoint.metadata import (
    OPERATOR_FORMAT_VERSION,
    DistributionMode,
    OperatorStateHandle,
    OperatorStateMeta,
)
from keygroups.checkpoint.planning import ElementRun
from keygroups.checkpoint.storage import CheckpointStorage
from keygroups.errors import CorruptSnapshotError

__all__ = [
    "HEADER_SIZE",
    "BLOCK_BYTES",
    "SerializedState",
    "write_operator_snapshot",
    "RestoredList",
    "OperatorRestoreStats",
    "read_operator_runs",
]

_MAGIC = b"KGOP"
_HEADER = struct.Struct("<4sHH")
HEADER_SIZE = _HEADER.size
BLOCK_BYTES = 256 * 1024   # a run reads at most two blocks beyond its own bytes; fewer blocks, less per-block overhead


# ---- writing ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SerializedState:
    """One state as a snapshot captured it: ``data`` holds its elements back to back, ``offsets`` their n+1
    boundaries (int64, from 0); ``serializers`` are the snapshots of the serializers that wrote them, by the JSON key
    of :data:`~keygroups.checkpoint.metadata.SERIALIZER_KEYS`."""

    name: str
    mode: DistributionMode
    serializers: dict[str, dict[str, Any]]
    data: Any
    offsets: np.ndarray


def write_operator_snapshot(storage: CheckpointStorage, relpath: str, states: Iterable[SerializedState], *,
                            subtask: int, operator_id: str) -> OperatorStateHandle:
    """Write one subtask's operator state file at ``relpath`` (from ``storage.new_file``) and return its handle."""
    metas: dict[str, OperatorStateMeta] = {}
    pos = HEADER_SIZE
    with storage.open_write(relpath) as out:
        out.write(_HEADER.pack(_MAGIC, OPERATOR_FORMAT_VERSION, 0))
        for state in states:
            offsets = state.offsets
            n = len(offsets) - 1
            view = memoryview(state.data)
            # cut blocks where an element starts past the next BLOCK_BYTES boundary
            cuts = np.flatnonzero(np.diff(offsets[:-1] // BLOCK_BYTES)) + 1 if n else np.empty(0, np.int64)
            block_starts = [0] + [int(c) for c in cuts] if n else []
            bounds = block_starts + [n]
            blocks = [(block_starts[i], crc32c.crc32c(view[int(offsets[bounds[i]]):int(offsets[bounds[i + 1]])]))
                      for i in range(len(block_starts))]
            out.write(view)
            metas[state.name] = OperatorStateMeta(mode=state.mode, serializers=state.serializers,
                                                  offsets=(offsets[:-1] + pos).tolist(), end=pos + int(offsets[-1]),
                                                  blocks=blocks)
            pos += int(offsets[-1])
    return OperatorStateHandle(file=relpath, subtask=subtask, size=pos, operator_id=operator_id, states=metas)


# ---- reading: validated, checksummed runs sliced out of the old files; nothing decoded ----------------------------


@dataclass
class RestoredList:
    """One state's share for this subtask, still serialized: ``segments`` of ``(buffer, base, bounds)``, where
    ``buffer`` holds file bytes ``[base, base + len(buffer))`` (the mapped file itself when local: no copy) and
    ``bounds`` are the n+1 absolute file offsets of the segment's element boundaries, already validated."""

    name: str
    mode: DistributionMode
    meta: OperatorStateMeta       # the state's entry in its handle (serializer snapshots)
    segments: list[tuple[Any, int, np.ndarray]]

    def __len__(self) -> int:
        return sum(len(b) - 1 for _, _, b in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(int(b[-1] - b[0]) for _, _, b in self.segments)

    def relative(self) -> Iterator[tuple[Any, np.ndarray]]:
        """Per segment ``(buffer, offsets relative to buffer)``, the form ``deserialize_many`` takes."""
        for buf, base, bounds in self.segments:
            yield buf, (bounds - base if base else bounds)

    def to_bytes(self) -> tuple[bytes, np.ndarray]:
        """The elements back to back in one new buffer with n+1 offsets (the compiled splitter copies the runs):
        what a subtask's share looks like when it must travel as one piece."""
        return splitter.gather(list(self.segments), f"operator state {self.name!r}")


@dataclass
class OperatorRestoreStats:
    """What a restore read: bytes (whole checksum blocks), elements restored, states restored."""

    bytes_read: int = 0
    elements: int = 0
    states: int = 0


def _is_local(storage: CheckpointStorage) -> bool:
    return os.path.isdir(os.fspath(storage.location))


class _FileReader:
    """Reads the runs of old operator files: a local file is mapped once (size and header checked) and sliced in
    place; a remote one is read range by range (only the checksum blocks a run needs). Each block's CRC32C is
    verified once per restore, before any of its bytes are used."""

    def __init__(self, storage: CheckpointStorage) -> None:
        self._storage = storage
        self._local = _is_local(storage)
        self._buffers: dict[str, Any] = {}
        self._sizes: dict[str, int] = {}
        self._verified: set[tuple[str, str, int]] = set()
        self.bytes_read = 0

    def _check_size(self, file: str, actual: int, size: int) -> None:
        if actual != size:
            raise CorruptSnapshotError(f"operator state file {file}: {actual} bytes, but its handle says {size}; "
                                       "the file is truncated or was replaced")

    def _missing(self, file: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(f"operator state file {file!r} is missing from {self._storage.location}: the "
                                    "checkpoint references it, so the checkpoint is damaged (restore an earlier one)")

    def _mapped(self, file: str, size: int) -> Any:
        buf = self._buffers.get(file)
        if buf is None:
            try:
                buf = self._storage.open_buffer(file)
            except FileNotFoundError:
                raise self._missing(file) from None
            self._check_size(file, len(buf), size)
            magic, version, _ = _HEADER.unpack_from(buf, 0)
            if magic != _MAGIC or version < 1 or version > OPERATOR_FORMAT_VERSION:
                raise CorruptSnapshotError(f"operator state file {file}: header {bytes(buf[:HEADER_SIZE])!r} is not "
                                           f"a keygroups operator state file of version <= {OPERATOR_FORMAT_VERSION}")
            self._buffers[file] = buf
        return buf

    def bounds(self, handle: OperatorStateHandle, run: ElementRun) -> np.ndarray:
        """The run's n+1 element boundaries as int64, validated by the compiled checker (ascending, inside the
        file's data) before anything reads by them."""
        if handle.size < HEADER_SIZE:
            raise CorruptSnapshotError(f"operator state file {handle.file}: {handle.size} bytes, shorter than its "
                                       "header")
        meta = handle.states[run.state]
        try:
            arr = np.empty(run.stop - run.first + 1, dtype=np.int64)
            arr[:-1] = meta.offsets[run.first:run.stop]
            arr[-1] = meta.bound(run.stop)
        except OverflowError as e:
            raise CorruptSnapshotError(f"operator state {run.state!r} in {handle.file}: offsets beyond int64 "
                                       f"({e})") from None
        splitter.check_offsets(arr, HEADER_SIZE, handle.size,
                               f"operator state {run.state!r} in {handle.file}, elements {run.first}..{run.stop}")
        return arr

    def segment(self, handle: OperatorStateHandle, run: ElementRun) -> tuple[Any, int, np.ndarray]:
        """``(buffer, base, bounds)`` of a non-empty run, its checksum blocks verified."""
        bounds = self.bounds(handle, run)
        lo, hi = run.read_range
        if self._local:
            buf, base = self._mapped(run.file, handle.size), 0
        else:
            if run.file not in self._sizes:
                try:
                    self._sizes[run.file] = self._storage.file_size(run.file)
                except FileNotFoundError:
                    raise self._missing(run.file) from None
                self._check_size(run.file, self._sizes[run.file], handle.size)
            buf, base = self._storage.read_bytes(run.file, lo, hi), lo
            if len(buf) != hi - lo:
                raise CorruptSnapshotError(f"operator state file {run.file}: bytes {lo}..{hi} came back as "
                                           f"{len(buf)} bytes; the file is truncated")
        self._verify(handle.states[run.state], run, buf, base)
        return buf, base, bounds

    def _verify(self, meta: OperatorStateMeta, run: ElementRun, buf: Any, base: int) -> None:
        starts = meta.block_starts
        b = bisect.bisect_right(starts, run.first) - 1
        with memoryview(buf) as view:
            while b < len(starts) and starts[b] < run.stop:
                key = (run.file, run.state, b)
                lo = meta.bound(starts[b])
                hi = meta.bound(starts[b + 1]) if b + 1 < len(starts) else meta.end
                if key not in self._verified or not self._local:
                    if crc32c.crc32c(view[lo - base:hi - base]) != meta.blocks[b][1]:
                        raise CorruptSnapshotError(f"operator state {run.state!r} in {run.file}: checksum mismatch "
                                                   f"in block {b} (bytes {lo}..{hi}); the file is corrupt")
                    self._verified.add(key)
                    self.bytes_read += hi - lo
                b += 1


def read_operator_runs(storage: CheckpointStorage, handles: Sequence[OperatorStateHandle],
                       runs: Sequence[ElementRun]) -> tuple[dict[str, RestoredList], OperatorRestoreStats]:
    """Read and verify one subtask's ``runs`` (its part of a :func:`~keygroups.checkpoint.plan_operator_restore`
    plan over ``handles``); per state, the segments holding its elements, not decoded. CorruptSnapshotError when a
    file is truncated, fails a checksum or disagrees with its handle."""
    by_file = {h.file: h for h in handles}
    reader = _FileReader(storage)
    restored: dict[str, RestoredList] = {}
    stats = OperatorRestoreStats()
    for run in runs:
        handle = by_file[run.file]
        entry = restored.get(run.state)
        if entry is None:
            meta = handle.states[run.state]
            entry = restored[run.state] = RestoredList(run.state, meta.mode, meta, [])
            stats.states += 1
        if run.stop > run.first:
            entry.segments.append(reader.segment(handle, run))
            stats.elements += run.stop - run.first
    stats.bytes_read = reader.bytes_read
    return restored, stats
