"""Operator state (FLIP-8): non-keyed, per-subtask state that survives a change of parallelism.

A subtask keeps its operator state as *lists of elements*; the lists are the unit of redistribution. Three modes,
named as in Flink's ``OperatorStateHandle.Mode``:

* ``SPLIT_DISTRIBUTE`` (:meth:`OperatorStateStore.get_list_state`): on restore the concatenation of all old
  subtasks' lists is split evenly over the new subtasks (sizes differ by at most one; which subtasks get the extra
  element rotates from one state to the next, as Flink's ``RoundRobinOperatorStateRepartitioner`` does).
* ``UNION`` (:meth:`OperatorStateStore.get_union_list_state`): every new subtask gets every element.
* ``BROADCAST`` (:meth:`OperatorStateStore.get_broadcast_state`): a map that is the same on every subtask; each new
  subtask restores one full copy.

Snapshot file (``chk-<id>/operator-<subtask>-<uuid>``): an 8-byte header (magic ``KGOP``, u16 format version,
u16 zero), then each state's elements, serialized, back to back. The handle (JSON, kept in the checkpoint
metadata) holds per state the mode, the serializer snapshot(s), one absolute byte offset per element plus the end,
and CRC32C checksums of blocks of whole elements (about 256 KiB each), so a reader of a slice verifies only the
blocks it reads. A broadcast map is stored as a list of ``u32 key length | key | value`` elements.

Restore is planned from the metadata alone (:func:`plan_operator_restore`: per new subtask, runs of elements with
their byte ranges). Executing the plan moves no element through a deserializer: the compiled splitter
(``keygroups._native.splitter``) validates each run's offsets against the file, the run's checksum blocks are
verified, and the run is sliced in place out of the mapped file (ranged reads on remote storage);
:meth:`RestoredList.to_bytes` copies a share into one buffer when it must travel. Elements are deserialized only
when the state is registered, with the serializer that compatibility resolution picks.
"""

from __future__ import annotations

import bisect
import os
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np

from keygroups._native import splitter
from keygroups.errors import CorruptSnapshotError, StateMigrationError

if TYPE_CHECKING:  # for annotations only: the store works with whatever storage and serializers it is handed
    from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
    from keygroups.serializers import TypeSerializer

__all__ = [
    "MODE_SPLIT_DISTRIBUTE",
    "MODE_UNION",
    "MODE_BROADCAST",
    "OperatorStateStore",
    "OperatorListState",
    "BroadcastState",
    "OperatorRestoreStats",
    "RestoredList",
    "ElementRun",
    "plan_operator_restore",
    "split_sizes",
]

MODE_SPLIT_DISTRIBUTE = "SPLIT_DISTRIBUTE"
MODE_UNION = "UNION"
MODE_BROADCAST = "BROADCAST"
_MODES = (MODE_SPLIT_DISTRIBUTE, MODE_UNION, MODE_BROADCAST)

FORMAT_NAME = "keygroups-operator-state"
FORMAT_VERSION = 1
_MAGIC = b"KGOP"
_HEADER = struct.Struct("<4sHH")
HEADER_SIZE = _HEADER.size
BLOCK_BYTES = 256 * 1024   # a run reads at most two blocks beyond its own bytes; fewer blocks, less per-block overhead
DEFAULT_OPERATOR_ID = "operator"


# --------------------------------------------------------------------------------------------------------------
# Planning: pure functions of the metadata.


@dataclass(frozen=True)
class ElementRun:
    """A contiguous run of one old subtask's elements of one state, to be read by one new subtask.

    ``first``/``stop``: element indices ``[first, stop)`` in the old subtask's list. ``byte_range``: the run's exact
    bytes in ``file``. ``read_range``: ``byte_range`` widened to whole checksum blocks (what is actually read).
    """

    file: str
    old_subtask: int
    state: str
    mode: str
    first: int
    stop: int
    byte_range: tuple[int, int]
    read_range: tuple[int, int]

    def __len__(self) -> int:
        return self.stop - self.first


def split_sizes(total: int, parallelism: int, start: int = 0) -> tuple[list[tuple[int, int]], int]:
    """How Flink's round-robin repartitioner cuts ``total`` elements for ``parallelism`` subtasks.

    Returns ``([(subtask, count), ...] in the order the concatenated list is handed out, next start)``: subtasks
    are visited from ``start`` on, wrapping; the first ``total % parallelism`` of them get one element more, and
    the first one that gets no extra element is where the next state starts, so extras rotate across states.
    """
    if parallelism < 1:
        raise ValueError(f"parallelism must be >= 1, got {parallelism}")
    base, remainder = divmod(total, parallelism)
    order: list[tuple[int, int]] = []
    next_start = start
    for i in range(parallelism):
        subtask = (i + start) % parallelism
        count = base
        if remainder > 0:
            count += 1
            remainder -= 1
        elif remainder == 0:
            next_start = subtask
            remainder -= 1
        order.append((subtask, count))
    return order, next_start


class _HandleState:
    """One state of one old handle, validated enough to plan with (offsets are checked against the file later)."""

    __slots__ = ("file", "subtask", "name", "meta", "offsets", "end", "block_starts")

    def __init__(self, handle: Mapping[str, Any], name: str, meta: Mapping[str, Any]) -> None:
        self.file = handle["file"]
        self.subtask = int(handle["subtask"])
        self.name = name
        self.meta = meta
        try:
            self.offsets = meta["offsets"]
            self.end = int(meta["end"])
            self.block_starts = [int(b[0]) for b in meta["blocks"]]
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise CorruptSnapshotError(f"operator state {name!r} of subtask {self.subtask}: malformed handle "
                                       f"({e!r})") from None
        if self.offsets and self.block_starts[:1] != [0]:
            raise CorruptSnapshotError(f"operator state {name!r} of subtask {self.subtask}: the first checksum "
                                       f"block must start at element 0, got {self.block_starts[:1]}")

    def __len__(self) -> int:
        return len(self.offsets)

    def bound(self, i: int) -> int:
        """Byte offset where element ``i`` starts (``len`` -> the end of the last element)."""
        return int(self.offsets[i]) if i < len(self.offsets) else self.end

    def run(self, first: int, stop: int) -> ElementRun:
        if first >= stop:   # nothing to read, but the state (mode, serializers) is still restored
            at = self.bound(first)
            return ElementRun(self.file, self.subtask, self.name, self.meta["mode"], first, first, (at, at),
                              (at, at))
        b_first = bisect.bisect_right(self.block_starts, first) - 1
        b_last = bisect.bisect_right(self.block_starts, stop - 1)   # block after the one holding stop-1
        read_lo = self.bound(self.block_starts[b_first])
        read_hi = self.bound(self.block_starts[b_last]) if b_last < len(self.block_starts) else self.end
        return ElementRun(self.file, self.subtask, self.name, self.meta["mode"], first, stop,
                          (self.bound(first), self.bound(stop)), (read_lo, read_hi))


def _check_handle(handle: Mapping[str, Any]) -> None:
    if not isinstance(handle, Mapping) or handle.get("format") != FORMAT_NAME:
        raise CorruptSnapshotError(f"not an operator state handle (format {FORMAT_NAME!r} expected): "
                                   f"{str(handle)[:200]}")
    if int(handle.get("version", -1)) > FORMAT_VERSION:
        raise CorruptSnapshotError(f"operator state handle version {handle.get('version')} is newer than this "
                                   f"library reads (<= {FORMAT_VERSION}); upgrade keygroups")


def _collect_states(handles: Sequence[Mapping[str, Any]], operator_id: str | None
                    ) -> dict[str, list[_HandleState]]:
    """State name -> its per-old-subtask pieces, in old subtask order; mode and serializers agree across them."""
    chosen = []
    for h in handles:
        _check_handle(h)
        if not isinstance(h.get("states"), Mapping) or not isinstance(h.get("file"), str) \
                or not isinstance(h.get("subtask"), int) or not isinstance(h.get("size"), int):
            raise CorruptSnapshotError(f"operator state handle without a valid file, size, subtask or states: "
                                       f"{str(h)[:200]}")
        if operator_id is None or h.get("operator_id", DEFAULT_OPERATOR_ID) == operator_id:
            chosen.append(h)
    chosen.sort(key=lambda h: int(h["subtask"]))
    subtasks = [int(h["subtask"]) for h in chosen]
    if len(set(subtasks)) != len(subtasks):
        raise CorruptSnapshotError(f"operator {operator_id!r}: two handles for the same subtask ({subtasks})")
    by_name: dict[str, list[_HandleState]] = {}
    for h in chosen:
        for name, meta in h["states"].items():
            if not isinstance(meta, Mapping) or meta.get("mode") not in _MODES:
                raise CorruptSnapshotError(f"operator state {name!r}: unknown mode {meta.get('mode') if isinstance(meta, Mapping) else meta!r}; "
                                           f"known: {', '.join(_MODES)}")
            pieces = by_name.setdefault(name, [])
            if pieces and _signature(pieces[0].meta) != _signature(meta):
                raise CorruptSnapshotError(f"operator state {name!r}: subtasks {pieces[0].subtask} and "
                                           f"{h['subtask']} disagree on its mode or serializers")
            pieces.append(_HandleState(h, name, meta))
    return by_name


def _signature(meta: Mapping[str, Any]) -> tuple:
    return (meta.get("mode"), repr(meta.get("serializer")), repr(meta.get("key_serializer")),
            repr(meta.get("value_serializer")))


def plan_operator_restore(handles: Sequence[Mapping[str, Any]], new_parallelism: int, *,
                          operator_id: str | None = None) -> list[list[ElementRun]]:
    """Which element runs each of ``new_parallelism`` subtasks reads, from the old handles alone (no file I/O).

    SPLIT_DISTRIBUTE states (in name order) are cut as :func:`split_sizes` says over the old lists concatenated in
    old subtask order; UNION states go whole to everyone; new subtask ``i`` reads a BROADCAST state from the
    ``i % k``-th of the ``k`` old subtasks that hold it (each holds a full copy), as Flink does. Unlike Flink, an
    unchanged parallelism is rebalanced too (Flink hands the old lists back as they were), so lists are always
    balanced after a restore. ``operator_id`` picks one operator's handles when several share a checkpoint.
    """
    if not isinstance(new_parallelism, int) or new_parallelism < 1:
        raise ValueError(f"new_parallelism must be an int >= 1, got {new_parallelism!r}")
    plan: list[list[ElementRun]] = [[] for _ in range(new_parallelism)]
    start = 0
    for name, pieces in sorted(_collect_states(handles, operator_id).items()):
        mode = pieces[0].meta["mode"]
        if mode == MODE_UNION:
            runs = [p.run(0, len(p)) for p in pieces if len(p)]
            for subtask_runs in plan:
                subtask_runs.extend(runs)
        elif mode == MODE_BROADCAST:
            for i, subtask_runs in enumerate(plan):
                p = pieces[i % len(pieces)]
                subtask_runs.append(p.run(0, len(p)))   # kept even when empty: the state exists
        else:
            order, start = split_sizes(sum(len(p) for p in pieces), new_parallelism, start)
            k, pos = 0, 0   # cursor into the concatenation: piece k, element pos
            for subtask, count in order:
                while count > 0:
                    while pos >= len(pieces[k]):
                        k, pos = k + 1, 0
                    take = min(count, len(pieces[k]) - pos)
                    plan[subtask].append(pieces[k].run(pos, pos + take))
                    pos += take
                    count -= take
        # a subtask that gets no elements must still know the state was restored, with its mode and serializers
        for subtask_runs in plan:
            if not subtask_runs or subtask_runs[-1].state != name:
                subtask_runs.append(pieces[0].run(0, 0))
    return plan


# --------------------------------------------------------------------------------------------------------------
# Execution: validated, checksummed runs sliced out of the old files; nothing decoded.


@dataclass
class RestoredList:
    """One state's share for this subtask, still serialized: ``segments`` of ``(buffer, base, bounds)``, where
    ``buffer`` holds file bytes ``[base, base + len(buffer))`` (the mapped file itself when local: no copy) and
    ``bounds`` are the n+1 absolute file offsets of the segment's element boundaries, already validated."""

    name: str
    mode: str
    meta: Mapping[str, Any]       # the state's handle entry (serializer snapshots)
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

    def _mapped(self, file: str, size: int) -> Any:
        buf = self._buffers.get(file)
        if buf is None:
            buf = self._storage.open_buffer(file)
            self._check_size(file, len(buf), size)
            magic, version, _ = _HEADER.unpack_from(buf, 0)
            if magic != _MAGIC or version < 1 or version > FORMAT_VERSION:
                raise CorruptSnapshotError(f"operator state file {file}: header {bytes(buf[:HEADER_SIZE])!r} is "
                                           f"not a keygroups operator state file of version <= {FORMAT_VERSION}")
            self._buffers[file] = buf
        return buf

    def bounds(self, piece: _HandleState, run: ElementRun, size: int) -> np.ndarray:
        """The run's n+1 element boundaries as int64, validated by the compiled checker (ascending, inside the
        file's data) before anything reads by them."""
        if size < HEADER_SIZE:
            raise CorruptSnapshotError(f"operator state file {piece.file}: {size} bytes, shorter than its header")
        try:
            arr = np.empty(run.stop - run.first + 1, dtype=np.int64)
            arr[:-1] = piece.offsets[run.first:run.stop]
            arr[-1] = piece.bound(run.stop)
        except (TypeError, ValueError, OverflowError) as e:
            raise CorruptSnapshotError(f"operator state {piece.name!r} in {piece.file}: offsets are not integers "
                                       f"({e})") from None
        splitter.check_offsets(arr, HEADER_SIZE, size,
                               f"operator state {piece.name!r} in {piece.file}, elements {run.first}..{run.stop}")
        return arr

    def segment(self, piece: _HandleState, run: ElementRun, size: int) -> tuple[Any, int, np.ndarray]:
        """``(buffer, base, bounds)`` of a non-empty run, its checksum blocks verified."""
        bounds = self.bounds(piece, run, size)
        lo, hi = run.read_range
        if self._local:
            buf, base = self._mapped(run.file, size), 0
        else:
            if run.file not in self._sizes:
                self._sizes[run.file] = self._storage.file_size(run.file)
                self._check_size(run.file, self._sizes[run.file], size)
            buf, base = self._storage.read_bytes(run.file, lo, hi), lo
            if len(buf) != hi - lo:
                raise CorruptSnapshotError(f"operator state file {run.file}: bytes {lo}..{hi} came back as "
                                           f"{len(buf)} bytes; the file is truncated")
        self._verify(piece, run, buf, base)
        return buf, base, bounds

    def _verify(self, piece: _HandleState, run: ElementRun, buf: Any, base: int) -> None:
        blocks = piece.meta["blocks"]
        b = bisect.bisect_right(piece.block_starts, run.first) - 1
        with memoryview(buf) as view:
            while b < len(blocks) and piece.block_starts[b] < run.stop:
                key = (piece.file, piece.name, b)
                lo = piece.bound(piece.block_starts[b])
                hi = piece.bound(piece.block_starts[b + 1]) if b + 1 < len(blocks) else piece.end
                if key not in self._verified or not self._local:
                    if crc32c.crc32c(view[lo - base:hi - base]) != int(blocks[b][1]):
                        raise CorruptSnapshotError(f"operator state {piece.name!r} in {piece.file}: checksum "
                                                   f"mismatch in block {b} (bytes {lo}..{hi}); the file is corrupt")
                    self._verified.add(key)
                    self.bytes_read += hi - lo
                b += 1


def _execute(storage: CheckpointStorage, handles: Sequence[Mapping[str, Any]], runs: Sequence[ElementRun],
             operator_id: str | None) -> tuple[dict[str, RestoredList], OperatorRestoreStats]:
    """Read and verify this subtask's runs; per state, the list of segments holding its elements (not decoded)."""
    pieces = {(p.file, p.name): p for ps in _collect_states(handles, operator_id).values() for p in ps}
    sizes = {h["file"]: int(h["size"]) for h in handles}
    reader = _FileReader(storage)
    restored: dict[str, RestoredList] = {}
    stats = OperatorRestoreStats()
    for run in runs:
        piece = pieces[(run.file, run.state)]
        entry = restored.get(run.state)
        if entry is None:
            entry = restored[run.state] = RestoredList(run.state, piece.meta["mode"], piece.meta, [])
            stats.states += 1
        if run.stop > run.first:
            entry.segments.append(reader.segment(piece, run, sizes[run.file]))
            stats.elements += run.stop - run.first
    stats.bytes_read = reader.bytes_read
    return restored, stats


# --------------------------------------------------------------------------------------------------------------
# The state objects a function sees.


class OperatorListState:
    """A list of elements kept per subtask (split-distribute or union, by how it was registered).

    Same methods as Flink's ``ListState``: :meth:`get`, :meth:`add`, :meth:`add_all`, :meth:`update`,
    :meth:`clear`. Elements are Python objects between checkpoints; a snapshot serializes them.
    """

    def __init__(self, name: str, mode: str, serializer: TypeSerializer, elements: list | None = None) -> None:
        self.name = name
        self.mode = mode
        self.serializer = serializer
        self._elements: list = elements if elements is not None else []

    def get(self) -> list:
        """The elements, in order (a new list: changing it does not change the state)."""
        return list(self._elements)

    def add(self, value: Any) -> None:
        self._elements.append(value)

    def add_all(self, values: Iterable[Any]) -> None:
        self._elements.extend(values)

    def update(self, values: Iterable[Any]) -> None:
        """Replace all elements."""
        self._elements = list(values)

    def clear(self) -> None:
        self._elements = []

    def __len__(self) -> int:
        return len(self._elements)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._elements))

    def __repr__(self) -> str:
        return f"OperatorListState({self.name!r}, {self.mode}, {len(self._elements)} elements)"


class BroadcastState:
    """A map that is the same on every subtask (Flink's ``BroadcastState``); each restored subtask gets a copy."""

    mode = MODE_BROADCAST

    def __init__(self, name: str, key_serializer: TypeSerializer, value_serializer: TypeSerializer,
                 entries: dict | None = None) -> None:
        self.name = name
        self.key_serializer = key_serializer
        self.value_serializer = value_serializer
        self._map: dict = entries if entries is not None else {}

    def get(self, key: Any, default: Any = None) -> Any:
        return self._map.get(key, default)

    def put(self, key: Any, value: Any) -> None:
        self._map[key] = value

    def put_all(self, entries: Mapping[Any, Any]) -> None:
        self._map.update(entries)

    def remove(self, key: Any) -> None:
        self._map.pop(key, None)

    def contains(self, key: Any) -> bool:
        return key in self._map

    def keys(self) -> list:
        return list(self._map.keys())

    def values(self) -> list:
        return list(self._map.values())

    def items(self) -> list[tuple[Any, Any]]:
        return list(self._map.items())

    def is_empty(self) -> bool:
        return not self._map

    def clear(self) -> None:
        self._map = {}

    def __contains__(self, key: Any) -> bool:
        return key in self._map

    def __len__(self) -> int:
        return len(self._map)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._map))

    def __repr__(self) -> str:
        return f"BroadcastState({self.name!r}, {len(self._map)} entries)"


# --------------------------------------------------------------------------------------------------------------
# The store.


def _descriptor(descriptor: Any, kind: str, method: str, roles: tuple[str, ...]) -> tuple[str, list]:
    """The name and the serializers (by role) of a ``keygroups.state`` descriptor of the given kind."""
    name = getattr(descriptor, "name", None)
    serializers = getattr(descriptor, "serializers", None)
    if getattr(descriptor, "kind", None) != kind or not isinstance(name, str) or not isinstance(serializers, dict):
        wanted = "ListStateDescriptor" if kind == "list" else "MapStateDescriptor"
        raise TypeError(f"{method} takes a keygroups.state.{wanted}, got {descriptor!r}")
    if getattr(descriptor, "ttl_config", None) is not None:
        raise ValueError(f"operator state {name!r}: time-to-live applies to keyed state only (as in Flink); "
                         "register the descriptor without enable_time_to_live")
    return name, [serializers[role] for role in roles]


def _snapshot_json(serializer: TypeSerializer) -> dict:
    return serializer.snapshot().to_json()


@dataclass
class _Registration:
    mode: str
    serializers: dict[str, dict]          # role -> serializer snapshot JSON
    state: OperatorListState | BroadcastState = field(repr=False)


class OperatorStateStore:
    """The operator state of one subtask: named list, union list and broadcast states, snapshot and restore.

    Restore first (:meth:`restore`, when resuming), then register states (``get_*``): a registered state that was
    restored starts with this subtask's share of the old elements, deserialized with the serializer that
    compatibility resolution picks for the registered one. :meth:`snapshot` captures every registered state
    synchronously and writes the file in the background.
    """

    def __init__(self, subtask_index: int, parallelism: int, *, allow_pickle: bool = False,
                 operator_id: str = DEFAULT_OPERATOR_ID) -> None:
        if not isinstance(parallelism, int) or parallelism < 1:
            raise ValueError(f"parallelism must be an int >= 1, got {parallelism!r}")
        if not isinstance(subtask_index, int) or not 0 <= subtask_index < parallelism:
            raise ValueError(f"subtask_index must be an int in [0, {parallelism - 1}], got {subtask_index!r}")
        self.subtask_index = subtask_index
        self.parallelism = parallelism
        self.allow_pickle = allow_pickle
        self.operator_id = operator_id
        self._registered: dict[str, _Registration] = {}
        self._restored: dict[str, RestoredList] = {}
        self.restored_checkpoint_id: int | None = None

    # -- restore -----------------------------------------------------------------------------------------------

    @property
    def is_restored(self) -> bool:
        return self.restored_checkpoint_id is not None

    def restore(self, storage: CheckpointStorage, metadata: CheckpointMetadata) -> OperatorRestoreStats:
        """Take this subtask's share of the operator state in ``metadata`` (any old parallelism).

        Reads only the checksum blocks that hold this subtask's elements; raises CorruptSnapshotError when a file
        is truncated, fails a checksum or disagrees with its handle.
        """
        if self._registered or self.is_restored:
            raise ValueError("restore() must come first, once, before any state is registered")
        handles = list(metadata.operator_handles)
        plan = plan_operator_restore(handles, self.parallelism, operator_id=self.operator_id)
        self._restored, stats = _execute(storage, handles, plan[self.subtask_index], self.operator_id)
        self.restored_checkpoint_id = int(metadata.checkpoint_id)
        return stats

    def _take_restored(self, name: str, mode: str) -> RestoredList | None:
        restored = self._restored.pop(name, None)
        if restored is not None and restored.mode != mode:
            self._restored[name] = restored
            raise StateMigrationError(f"operator state {name!r} was checkpointed as {restored.mode} and is now "
                                      f"registered as {mode}; register it with the same kind of state")
        return restored

    def _read_serializer(self, name: str, meta: Mapping[str, Any], role_key: str, new: TypeSerializer,
                         role: str) -> TypeSerializer:
        from keygroups.serializers import SerializerSnapshot, resolve_compatibility

        old = SerializerSnapshot.from_json(meta[role_key])
        _, read_with = resolve_compatibility(name, old, new, allow_pickle=self.allow_pickle, role=role)
        return read_with

    # -- registration ------------------------------------------------------------------------------------------

    def _existing(self, name: str, mode: str, serializers: dict[str, dict]) -> Any:
        reg = self._registered.get(name)
        if reg is None:
            return None
        if reg.mode != mode or reg.serializers != serializers:
            raise StateMigrationError(
                f"operator state {name!r} is already registered as {reg.mode} with serializers {reg.serializers}; "
                f"it cannot be registered again as {mode} with {serializers}")
        return reg.state

    def _get_list(self, descriptor: Any, mode: str) -> OperatorListState:
        method = "get_list_state" if mode == MODE_SPLIT_DISTRIBUTE else "get_union_list_state"
        name, (serializer,) = _descriptor(descriptor, "list", method, ("element",))
        snapshots = {"serializer": _snapshot_json(serializer)}
        existing = self._existing(name, mode, snapshots)
        if existing is not None:
            return existing
        elements: list = []
        restored = self._take_restored(name, mode)
        if restored is not None:
            read_with = self._read_serializer(name, restored.meta, "serializer", serializer, "list element")
            for buf, offsets in restored.relative():
                elements.extend(read_with.deserialize_many(buf, offsets))
        state = OperatorListState(name, mode, serializer, elements)
        self._registered[name] = _Registration(mode, snapshots, state)
        return state

    def get_list_state(self, descriptor: Any) -> OperatorListState:
        """A split-distribute list state: on restore, this subtask gets an even share of all old elements."""
        return self._get_list(descriptor, MODE_SPLIT_DISTRIBUTE)

    def get_union_list_state(self, descriptor: Any) -> OperatorListState:
        """A union list state: on restore, every subtask gets all old subtasks' elements."""
        return self._get_list(descriptor, MODE_UNION)

    def get_broadcast_state(self, descriptor: Any) -> BroadcastState:
        """A broadcast map state: the same map on every subtask; on restore each subtask gets a full copy."""
        name, (key_ser, value_ser) = _descriptor(descriptor, "map", "get_broadcast_state", ("map key", "map value"))
        snapshots = {"key_serializer": _snapshot_json(key_ser), "value_serializer": _snapshot_json(value_ser)}
        existing = self._existing(name, MODE_BROADCAST, snapshots)
        if existing is not None:
            return existing
        entries: dict = {}
        restored = self._take_restored(name, MODE_BROADCAST)
        if restored is not None:
            k_read = self._read_serializer(name, restored.meta, "key_serializer", key_ser, "map key")
            v_read = self._read_serializer(name, restored.meta, "value_serializer", value_ser, "map value")
            for buf, offsets in restored.relative():
                kd, ko, vd, vo = splitter.decode_entries(buf, offsets)
                entries.update(zip(k_read.deserialize_many(kd, ko), v_read.deserialize_many(vd, vo)))
        state = BroadcastState(name, key_ser, value_ser, entries)
        self._registered[name] = _Registration(MODE_BROADCAST, snapshots, state)
        return state

    @property
    def registered_state_names(self) -> list[str]:
        return sorted(self._registered)

    def restored_share(self, name: str) -> RestoredList | None:
        """The still-serialized share of a restored state that is not registered yet (None otherwise): for tools
        that move state without decoding it."""
        return self._restored.get(name)

    @property
    def restored_state_names(self) -> list[str]:
        """States restored but not registered (yet): they are dropped by the next snapshot, as in Flink."""
        return sorted(self._restored)

    # -- snapshot ----------------------------------------------------------------------------------------------

    def _capture(self) -> list[tuple[str, _Registration, bytes, np.ndarray]]:
        captured = []
        for name in sorted(self._registered):
            reg = self._registered[name]
            st = reg.state
            if isinstance(st, BroadcastState):
                keys, values = list(st._map.keys()), list(st._map.values())
                kd, ko = st.key_serializer.serialize_many(keys)
                vd, vo = st.value_serializer.serialize_many(values)
                data, offsets = splitter.encode_entries(kd, np.ascontiguousarray(ko, dtype=np.int64),
                                                        vd, np.ascontiguousarray(vo, dtype=np.int64))
            else:
                data, offsets = st.serializer.serialize_many(st._elements)
                offsets = np.ascontiguousarray(offsets, dtype=np.int64)
            captured.append((name, reg, data, offsets))
        return captured

    def snapshot(self, checkpoint_id: int, storage: CheckpointStorage) -> Future:
        """Capture all registered states now (serialized: later changes do not leak in); write the file in the
        background. The future's result is the operator handle (a JSON dict) for the checkpoint metadata."""
        captured = self._capture()
        relpath = storage.new_file(checkpoint_id, f"operator-{self.subtask_index}")
        future: Future = Future()
        future.set_running_or_notify_cancel()

        def write() -> None:
            try:
                future.set_result(self._write(storage, relpath, checkpoint_id, captured))
            except BaseException as e:  # noqa: BLE001  (handed to the waiter)
                future.set_exception(e)

        threading.Thread(target=write, name=f"operator-snapshot-{self.subtask_index}", daemon=True).start()
        return future

    def _write(self, storage: CheckpointStorage, relpath: str, checkpoint_id: int,
               captured: list[tuple[str, _Registration, bytes, np.ndarray]]) -> dict:
        states: dict[str, dict] = {}
        pos = HEADER_SIZE
        with storage.open_write(relpath) as out:
            out.write(_HEADER.pack(_MAGIC, FORMAT_VERSION, 0))
            for name, reg, data, offsets in captured:
                n = len(offsets) - 1
                view = memoryview(data)
                # cut blocks where an element starts past the next BLOCK_BYTES boundary
                starts = offsets[:-1]
                cuts = np.flatnonzero(np.diff(starts // BLOCK_BYTES)) + 1 if n else np.empty(0, np.int64)
                block_starts = [0] + [int(c) for c in cuts] if n else []
                bounds = block_starts + [n]
                blocks = [[int(block_starts[i]),
                           crc32c.crc32c(view[int(offsets[bounds[i]]):int(offsets[bounds[i + 1]])])]
                          for i in range(len(block_starts))]
                out.write(view)
                states[name] = {"mode": reg.mode, **reg.serializers,
                                "offsets": (offsets[:-1] + pos).tolist(), "end": pos + int(offsets[-1]),
                                "blocks": blocks}
                pos += int(offsets[-1])
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "operator_id": self.operator_id,
                "checkpoint_id": int(checkpoint_id), "subtask": self.subtask_index,
                "parallelism": self.parallelism, "file": relpath, "size": pos, "states": states}
