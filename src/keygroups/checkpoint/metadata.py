"""Checkpoint metadata, the keyed and operator state handles, and the versioned ``_metadata`` file that holds them.

``_metadata`` layout (little-endian): magic ``b"\\x89KGM"`` | u32 format version | u32 body length | body (UTF-8 JSON)
| u32 CRC32C of everything before it. Anything else (a flipped byte, a truncation, an unknown version, a body that is
not the expected JSON shape) is a :class:`~keygroups.errors.CorruptSnapshotError`.

Handles are dataclasses validated once, when built (``__post_init__``): a handle read from JSON with
``from_json`` is either valid or a CorruptSnapshotError naming the bad field, so no reader checks fields again.
:func:`decode_metadata` builds each keyed handle once per process: a handle stored alike in a later ``_metadata``
(an incremental checkpoint carries nearly all of its handles from the one before) is the same object, with what was
worked out from it (its changed key groups, block sizes, checksums as arrays), so what a reader of each batch's
restore point pays follows the handles that are new, not the files a chain carries times their key groups.

Paths: in memory, every file a checkpoint references (``KeyedStateHandle.file``, ``OperatorStateHandle.file``,
``outputs`` and ``inputs``) is relative to the storage location, e.g. ``"shared/keyed-0-17-<uuid>"`` or
``"chk-17/operator-0-<uuid>"``, so ``storage.read_bytes(handle.file)`` works without more context. In the
``_metadata`` file, keyed files of ``shared/`` (which outlive the checkpoint that wrote them: incremental
checkpoints reference older ones) are stored as ``shared/<name>``; every other file relative to the directory
holding that ``_metadata`` (the checkpoint or savepoint directory). A savepoint references no shared file, so its
directory is self-contained and can be moved.

Versions: 5 (written when a keyed handle is of keyed format 4, so by every checkpoint with keyed state since) has
version 4's fields and gives each keyed handle of format 4 its file's ``file_id``, the ``checksums`` of its blocks (one
per key group, the CRC32C each block stores; base64 of u32 little-endian) and the ``predecessors`` of its linked delta
blocks (``{"distances": base64, "checksums": base64}``: per key group, the handle's checkpoint id minus that of the
block it applies on, 0 for none, and that block's checksum), so a chain that lacks a delta, or holds one of another run,
is refused from the metadata alone (``planning.chain_breaks``) and a block read is checked against the checksum its
handle names. 4 (written when a checkpoint without keyed handles of format 4 has raw keyed state or late outputs, else
3) adds ``raw_keyed_handles`` and ``late_outputs``. 3 (written) stores keyed files of ``shared/`` and gives each keyed
handle its ``checkpoint_id``, ``full_key_groups`` and keyed ``format_version``. Version 2 (still read) has the
``outputs`` and ``inputs`` fields; its keyed handles are read as full files of keyed format 1 written by that
checkpoint. Version 1 (still read) also kept the runner's files in ``properties["outputs"]``/``["inputs"]`` as
storage-relative paths; reading moves those inside the directory into the fields. A keyed handle's ``fresh_key_groups``
(optional in versions 3 and 4: a reader that ignores it only skips a check) says which of its delta blocks apply to no
earlier block. Each version changed so that an older keygroups refuses the file instead of misreading it (version 2:
treating output files as orphans; version 3: restoring a delta as the whole state; version 4: restoring without raw
keyed state, deleting late outputs as orphans; version 5: reading blocks of keyed format 4, whose layout it does not
know, and checking no chain; version 6: reading offsets it does not find; version 7: reading a carried handle's
checksums, stored for some of its blocks only, as one per block). Version 6 (written when version 5 was)
stores the same handles in a third of the bytes: a keyed handle's ``offsets`` become ``first_offset`` and
``block_sizes`` (base64 of zlib of u64 little-endian: most blocks of a delta file are empty ones of one size), and its
predecessors' ``distances`` are zlib'd before base64 too (``distances_z``); the checksums, random, stay as they are.
An incremental checkpoint lists every older file its chains still need, so ``_metadata`` grows with key groups times
files: what every commit writes and every task decodes. Version 7 (written when version 6 was) leaves out what no
reader needs twice: each *quiet* block's checksum and predecessor (a quiet block is an empty delta, a key group its
file changed nothing in: at max parallelism 4096 nearly every block of a small batch's file) in every handle carried
from an older checkpoint (``"quiet_unrecorded": true``; its ``checksums`` and predecessors' ``distances_z`` and
``checksums`` then hold the other blocks' values only, in key-group order; which blocks are quiet follows from
``block_sizes`` and ``full_key_groups``). The handles the checkpoint itself wrote keep them all: their quiet blocks name
every key group's chain end as the checkpoint before left it, and every block that is not quiet names the block it
continues, so a chain that lost a delta (its newest too) or holds a foreign one is still refused from the metadata
alone, with a ``_metadata`` that grows with the checkpoint's changes, not with key groups times retained files. A
handle read with them left out records :data:`NOT_RECORDED` as those blocks' checksums and no predecessor for them
(no restore reads a quiet block). Checkpoints of every earlier version still restore; their chains are checked only as far
as they say (a delta of format 3 or older names no predecessor), and a backend restored from them writes its next
snapshot full, so that the chains it continues are checked from their base.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import collections
import enum
import functools
import json
import re
import struct
import threading
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from crc32c import crc32c

from keygroups._native import snapshot as _snap
from keygroups._ranges import UPPER_BOUND_MAX_PARALLELISM, KeyGroupRange, check_max_parallelism
from keygroups.errors import CorruptSnapshotError

METADATA_MAGIC = b"\x89KGM"
METADATA_VERSION = 7
_COMPACT_VERSION = 6   # offsets as compressed block sizes, predecessor distances compressed
_CHAINED_VERSION = 5   # keyed handles of format 4 with their per key group arrays uncompressed
_LEGACY_VERSION = 1   # outputs and inputs in properties
_UNSHARED_VERSION = 2   # keyed handles without checkpoint_id, full_key_groups, format_version (format 1 files)
_SHARED_VERSION = 3   # written when there is neither raw keyed state nor late output: older readers read it
_RAW_KEYED_VERSION = 4   # raw keyed handles and late outputs, keyed handles without checksums
#: The directory (under the storage location) of keyed state files, which outlive the checkpoint that wrote them.
SHARED_DIR = "shared"
_PREFIX = struct.Struct("<4sII")

#: The keyed file format written, the ones read, and the size of a block that holds nothing (in the format written;
#: no block of an older format that holds a section is that small either, so it tells empty blocks of any format).
KEYED_FORMAT_VERSION: int = _snap.FORMAT_VERSION
#: In a keyed handle's ``checksums``: the checksum of this quiet block (an empty delta) is not recorded, as in a handle
#: read from a ``_metadata`` of version 7 (see the module docs).
NOT_RECORDED: int = -1
KEYED_READ_VERSIONS: tuple[int, ...] = tuple(_snap.READ_VERSIONS)
EMPTY_BLOCK_SIZE: int = _snap.BLOCK_OVERHEAD
#: The first keyed format whose blocks carry a checksum of their file's id and name their predecessor.
CHAINED_FORMAT_VERSION = 4
_FILE_ID_RE = re.compile(r"^[0-9a-f]{32}$")

#: The file format an operator handle describes; its JSON carries both, and its file header the version.
OPERATOR_FORMAT_NAME = "keygroups-operator-state"
OPERATOR_FORMAT_VERSION = 1
#: The raw keyed state file format (``raw_keyed.py``) a :class:`RawKeyedStateHandle` describes.
RAW_KEYED_FORMAT_VERSION = 1
#: The operator id of a handle whose JSON names none.
DEFAULT_OPERATOR_ID = "operator"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_relpath(relpath: Any, what: str = "path") -> str:
    """A storage-relative path (``"chk-3/keyed-0-ab12"``): a non-empty str of ``/``-separated names, never absolute,
    never ``.``/``..``. ValueError otherwise (such a path could escape the checkpoint location)."""
    if not isinstance(relpath, str) or not relpath:
        raise ValueError(f"{what} must be a non-empty relative path string, got {relpath!r}")
    parts = relpath.split("/")
    if relpath.startswith("/") or "\\" in relpath or ":" in parts[0] or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{what} must be a relative path of plain names separated by '/' (no '..', no leading "
                         f"'/', no drive or URL scheme), got {relpath!r}")
    return relpath


def _full_ranges(value: Any, key_group_range: KeyGroupRange, name: str = "full_key_groups") -> list[KeyGroupRange]:
    """``value`` checked as key groups (``name``: the full ones, or the fresh ones) of a handle of
    ``key_group_range``: non-empty ranges inside it, ascending and disjoint. ValueError/TypeError otherwise."""
    if not isinstance(value, list) or not all(isinstance(r, KeyGroupRange) for r in value):
        raise TypeError(f"KeyedStateHandle.{name} must be a list of KeyGroupRange, got {str(value)[:100]}")
    prev = -1
    for r in value:
        if not r or r.start <= prev or r.start < key_group_range.start or r.end > key_group_range.end:
            raise ValueError(f"KeyedStateHandle.{name} must be non-empty, ascending, disjoint ranges inside "
                             f"{key_group_range}, got {value}")
        prev = r.end
    return value


class BlockLink(NamedTuple):
    """A block as a delta names the block it applies on (its predecessor): the checkpoint that wrote it and its
    checksum, the CRC32C the block stores (in keyed format 4, of its file's id and its bytes)."""

    checkpoint_id: int
    checksum: int

    def __str__(self) -> str:
        return f"the block of checkpoint {self.checkpoint_id} with checksum {self.checksum:#010x}"


class BlockLinks(Mapping[int, BlockLink]):
    """Key group -> the :class:`BlockLink` its delta block names, for the key groups of a handle's range, held as two
    int64 arrays (``checkpoints[i]``, -1 where key group ``start + i`` names none, and ``checksums[i]``, 0 there)
    rather than one object per key group: every batch decodes every handle of a checkpoint, at up to 32768 key groups
    each. Built from any mapping with :meth:`of`; compares equal to any mapping of the same links."""

    __slots__ = ("start", "checkpoints", "checksums")

    def __init__(self, start: int, checkpoints: Any, checksums: Any) -> None:
        self.start = start
        self.checkpoints = np.asarray(checkpoints, dtype=np.int64)
        self.checksums = np.asarray(checksums, dtype=np.int64)

    @classmethod
    def of(cls, links: Mapping[int, Any], key_group_range: KeyGroupRange) -> BlockLinks:
        """The links of ``links`` (key group -> BlockLink or ``(checkpoint id, checksum)``) over ``key_group_range``;
        ValueError naming a key group outside it or a link that is not two ints."""
        n = len(key_group_range)
        if isinstance(links, BlockLinks):
            if links.start != key_group_range.start or links.checkpoints.shape != (n,) \
                    or links.checksums.shape != (n,):
                raise ValueError(f"KeyedStateHandle.predecessors must hold one link per key group of "
                                 f"{key_group_range}, got {len(links.checkpoints)} checkpoints and "
                                 f"{len(links.checksums)} checksums from key group {links.start}")
            return links
        checkpoints, checksums = np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for kg, link in links.items():
            i = kg - key_group_range.start if _is_int(kg) else -1
            if not 0 <= i < n:
                raise ValueError(f"KeyedStateHandle.predecessors names key group {kg!r}, outside the handle's "
                                 f"{key_group_range}")
            if not isinstance(link, tuple) or len(link) != 2 or not all(_is_int(x) for x in link) \
                    or not 0 <= link[0] < 1 << 62 or not 0 <= link[1] < 1 << 32:
                raise ValueError(f"KeyedStateHandle.predecessors[{kg}] must be a BlockLink (checkpoint id, u32 "
                                 f"checksum), got {link!r:.100}")
            checkpoints[i], checksums[i] = link
        return cls(key_group_range.start, checkpoints, checksums)

    def __getitem__(self, key_group: int) -> BlockLink:
        i = key_group - self.start if _is_int(key_group) else -1
        if 0 <= i < len(self.checkpoints) and self.checkpoints[i] >= 0:
            return BlockLink(int(self.checkpoints[i]), int(self.checksums[i]))
        raise KeyError(key_group)

    def __iter__(self) -> Iterator[int]:
        return iter((np.flatnonzero(self.checkpoints >= 0) + self.start).tolist())

    def __len__(self) -> int:
        return int(np.count_nonzero(self.checkpoints >= 0))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockLinks):
            return dict(self.items()) == dict(other.items())
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockLinks({dict(self.items())!r})"

    def to_json(self, checkpoint_id: int) -> dict[str, Any]:
        """``{"distances": ..., "checksums": ...}``, u32 arrays as base64: per key group ``checkpoint_id`` (the
        handle's) minus the checkpoint of the block it names (0: names none), and that block's checksum."""
        distances = np.where(self.checkpoints >= 0, checkpoint_id - self.checkpoints, 0)
        return {"distances": _pack_u32(distances), "checksums": _pack_u32(self.checksums)}

    @classmethod
    def from_json(cls, d: Any, key_group_range: KeyGroupRange, checkpoint_id: int) -> BlockLinks:
        if not isinstance(d, dict):
            raise TypeError(f"predecessors must be an object of 'distances' and 'checksums', got {str(d)[:100]}")
        distances = np.asarray(_unpack_u32(d.get("distances"), "predecessors.distances"), dtype=np.int64)
        checksums = np.asarray(_unpack_u32(d.get("checksums"), "predecessors.checksums"), dtype=np.int64)
        if (distances > checkpoint_id).any():
            i = int(np.flatnonzero(distances > checkpoint_id)[0])
            raise ValueError(f"predecessors[{key_group_range.start + i}] names the block of checkpoint "
                             f"{checkpoint_id - int(distances[i])}: it must be a BlockLink of an older checkpoint "
                             f"(id in [0, {checkpoint_id}))")
        return cls(key_group_range.start, np.where(distances > 0, checkpoint_id - distances, -1), checksums)


def _pack_u32(values: Any) -> str:
    """u32 values as base64 of their little-endian bytes: a quarter of their JSON, decoded in one call."""
    return base64.b64encode(np.asarray(values, dtype="<u4").tobytes()).decode("ascii")


def _unpack_u32(text: Any, what: str) -> Any:
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a base64 string of u32 values, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{what} is not base64: {e}") from None
    if len(raw) % 4:
        raise ValueError(f"{what} holds {len(raw)} bytes, not a whole number of u32 values")
    return np.frombuffer(raw, dtype="<u4")


def key_group_runs(key_groups: Any) -> list[KeyGroupRange]:
    """Key groups (any iterable of ints) as the ascending list of maximal contiguous ranges that hold them."""
    runs: list[KeyGroupRange] = []
    ordered = sorted(set(key_groups))
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            runs.append(KeyGroupRange(ordered[start], ordered[i - 1]))
            start = i
    return runs


def _check_offsets(what: str, offsets: Any, key_group_range: KeyGroupRange, size: int) -> None:
    """ValueError unless ``offsets`` are one absolute file offset per key group of ``key_group_range`` plus the end,
    ascending, inside a file of ``size`` bytes (a handle's seek index)."""
    expected = len(key_group_range) + 1
    if not isinstance(offsets, list) or len(offsets) != expected:
        raise ValueError(f"{what}.offsets must be a list of {expected} ints (one per key group of "
                         f"{key_group_range} plus the end), got "
                         f"{len(offsets) if isinstance(offsets, list) else type(offsets).__name__}")
    if (all(type(off) is int for off in offsets) and 0 <= offsets[0] and offsets[-1] <= size
            and offsets == sorted(offsets)):
        return   # the common case at C speed: every batch decodes every handle of the checkpoint
    prev = 0
    for i, off in enumerate(offsets):
        if not _is_int(off) or not prev <= off <= size:
            raise ValueError(f"{what}.offsets[{i}] = {off!r} must be an int in [{prev}, size={size}]: offsets "
                             f"ascend within the file")
        prev = off


def _byte_range(r: KeyGroupRange, offsets: list[int], key_groups: KeyGroupRange) -> tuple[int, int]:
    """``(start, end)`` byte offsets of the blocks of ``key_groups`` in a file indexed by ``offsets`` for ``r``."""
    if not key_groups or key_groups.start < r.start or key_groups.end > r.end:
        raise ValueError(f"key groups {key_groups} must be a non-empty range inside this handle's {r}")
    return offsets[key_groups.start - r.start], offsets[key_groups.end - r.start + 1]


@dataclass
class KeyedStateHandle:
    """Where one subtask's keyed snapshot lives and how to seek in it.

    ``offsets[i]`` is the absolute byte offset of key group ``key_group_range.start + i``'s block in ``file``;
    ``offsets[-1]`` is the end of the last block, so the bytes of key groups ``[a, b]`` are
    ``offsets[a - start] : offsets[b - start + 1]``. ``states`` is the per-state meta (name, kind, serializer
    snapshots, TTL) as JSON, the same list as in the file header, so a reader of a byte range needs no header.

    Incremental checkpoints: ``checkpoint_id`` is the checkpoint that wrote the file (a key group's chain is ordered
    by it); ``full_key_groups`` are the key groups whose block in the file is full (every entry; None when built
    means all of them), the others hold the changes since the key group's previous block. ``format_version`` is the
    keyed file format of ``file`` (1: every block full, keys unsorted), needed to parse a byte range without the
    header.

    Chain completeness: ``fresh_key_groups`` are the key groups whose delta block applies to no earlier block (the
    key group had no state where the writer started from); every other delta block changes the block before it in
    its key group's chain, so a chain that starts with one lacks its base and is refused at commit and at restore
    (:func:`~keygroups.checkpoint.planning.baseless_deltas`). None: not recorded (files of earlier versions, whose
    chains are not checked).

    Chain integrity (keyed format 4): ``file_id`` is the random id of the file (32 hex digits), which each block's
    checksum covers; ``checksums[i]`` is the CRC32C block ``i`` stores, so a reader checks the bytes the offsets
    delimit against the metadata (a file replaced by another, even one of the same layout, is refused); and
    ``predecessors`` maps each linked delta block's key group to the :class:`BlockLink` it applies on (an empty
    delta's: the block its chain ends with, which it leaves as it is), so a chain that lacks a delta or holds a
    foreign one is refused from the metadata alone
    (:func:`~keygroups.checkpoint.planning.chain_breaks`). All three are None for files of earlier formats (their
    chains are checked as far as ``fresh_key_groups`` goes); a handle of format 4 must carry the first two.
    """

    file: str
    subtask: int
    key_group_range: KeyGroupRange
    offsets: list[int]
    size: int
    states: list[dict[str, Any]]
    checkpoint_id: int = field(kw_only=True)
    full_key_groups: list[KeyGroupRange] = field(default=None, kw_only=True)  # type: ignore[arg-type]  # None: all
    format_version: int = field(default=KEYED_FORMAT_VERSION, kw_only=True)
    fresh_key_groups: list[KeyGroupRange] | None = field(default=None, kw_only=True)
    file_id: str | None = field(default=None, kw_only=True)
    checksums: list[int] | None = field(default=None, kw_only=True)
    predecessors: Mapping[int, BlockLink] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        check_relpath(self.file, "KeyedStateHandle.file")
        if not _is_int(self.subtask) or self.subtask < 0:
            raise ValueError(f"KeyedStateHandle.subtask must be an int >= 0, got {self.subtask!r}")
        if not isinstance(self.key_group_range, KeyGroupRange):
            raise TypeError(f"KeyedStateHandle.key_group_range must be a KeyGroupRange, got "
                            f"{type(self.key_group_range).__name__}")
        if not _is_int(self.size) or self.size < 0:
            raise ValueError(f"KeyedStateHandle.size must be an int >= 0, got {self.size!r}")
        _check_offsets("KeyedStateHandle", self.offsets, self.key_group_range, self.size)
        if not isinstance(self.states, list) or not all(isinstance(s, dict) for s in self.states):
            raise TypeError("KeyedStateHandle.states must be a list of JSON dicts (the state meta)")
        if not _is_int(self.checkpoint_id) or self.checkpoint_id < 0:
            raise ValueError(f"KeyedStateHandle.checkpoint_id must be an int >= 0 (the checkpoint that wrote the "
                             f"file), got {self.checkpoint_id!r}")
        if self.format_version not in KEYED_READ_VERSIONS:
            raise ValueError(f"KeyedStateHandle.format_version must be one of {KEYED_READ_VERSIONS} (the keyed file "
                             f"formats this keygroups reads), got {self.format_version!r}")
        everything = [self.key_group_range] if self.key_group_range else []
        if self.full_key_groups is None:
            self.full_key_groups = everything
        _full_ranges(self.full_key_groups, self.key_group_range)
        if self.fresh_key_groups is not None:
            _full_ranges(self.fresh_key_groups, self.key_group_range, "fresh_key_groups")
        if self.format_version == 1 and self.full_key_groups != everything:
            raise ValueError("a KeyedStateHandle of keyed format 1 holds full blocks only (full_key_groups must be "
                             f"its whole range {self.key_group_range}), got {self.full_key_groups}")
        self._full_starts = [r.start for r in self.full_key_groups]
        self._check_chain_fields()

    def _check_chain_fields(self) -> None:
        """ValueError/TypeError naming the first of ``file_id``, ``checksums``, ``predecessors`` that is not what a
        handle of its format can hold (each may be None here: :meth:`CheckpointMetadata.validate` requires the first
        two of a format-4 handle a checkpoint holds)."""
        chained = self.format_version >= CHAINED_FORMAT_VERSION
        for name in ("file_id", "checksums", "predecessors"):
            if getattr(self, name) is not None and not chained:
                raise ValueError(f"KeyedStateHandle.{name} belongs to keyed format {CHAINED_FORMAT_VERSION} and later; "
                                 f"this handle is of format {self.format_version}")
        if self.file_id is not None and (not isinstance(self.file_id, str) or not _FILE_ID_RE.match(self.file_id)):
            raise ValueError(f"KeyedStateHandle.file_id must be 32 lowercase hex digits (the file's id), got "
                             f"{self.file_id!r:.80}")
        checksums = self.checksums
        if checksums is not None:
            n = len(self.key_group_range)
            if not isinstance(checksums, list) or len(checksums) != n:
                raise ValueError(f"KeyedStateHandle.checksums must be a list of {n} ints (one per key group of "
                                 f"{self.key_group_range}), got "
                                 f"{len(checksums) if isinstance(checksums, list) else type(checksums).__name__}")
            lowest = min(checksums) if checksums and set(map(type, checksums)) == {int} else None
            if checksums and (lowest is None or lowest < NOT_RECORDED or max(checksums) >= 1 << 32):
                raise ValueError("KeyedStateHandle.checksums must be u32 ints (the CRC32C each block stores)")
            if lowest == NOT_RECORDED:
                unrecorded = np.asarray(checksums, dtype=np.int64) == NOT_RECORDED
                loud = np.flatnonzero(unrecorded & ~self._quiet_blocks())
                if len(loud):
                    raise ValueError(f"KeyedStateHandle.checksums records no checksum for key group "
                                     f"{self.key_group_range.start + int(loud[0])}, whose block is full or not "
                                     f"empty: only a quiet block (an empty delta) may go unrecorded")
        if self.predecessors is None:
            return
        if not isinstance(self.predecessors, Mapping):
            raise TypeError(f"KeyedStateHandle.predecessors must be a mapping of key group -> BlockLink, got "
                            f"{type(self.predecessors).__name__}")
        links = self.predecessors = BlockLinks.of(self.predecessors, self.key_group_range)
        cps, cks = links.checkpoints, links.checksums   # vectorized: one link per key group of the range
        wrong = (cps < -1) | (cps >= self.checkpoint_id) | (cks < 0) | (cks >= 1 << 32) | ((cps < 0) & (cks != 0))
        if wrong.any():
            bad = int(np.flatnonzero(wrong)[0])
            raise ValueError(f"KeyedStateHandle.predecessors[{self.key_group_range.start + bad}] must be a BlockLink "
                             f"of an older checkpoint (id in [0, {self.checkpoint_id})) and a u32 checksum, got "
                             f"({cps[bad]}, {cks[bad]})")
        for r in list(self.full_key_groups) + list(self.fresh_key_groups or []):
            lo = r.start - self.key_group_range.start
            named = np.flatnonzero(cps[lo:lo + len(r)] >= 0)
            if len(named):
                raise ValueError(f"KeyedStateHandle.predecessors names key group {r.start + int(named[0])}, which is "
                                 f"not a delta block of {self.key_group_range} that changes an earlier block (full: "
                                 f"{self.full_key_groups}, fresh: {self.fresh_key_groups})")

    def block_sizes(self) -> Any:
        """The size of each block, in key-group order: a read-only int64 array, worked out once per handle (chain
        checks and plans read it for every handle of a checkpoint, every batch)."""
        sizes = self.__dict__.get("_sizes")
        if sizes is None:
            sizes = np.diff(np.asarray(self.offsets, dtype=np.int64))
            sizes.flags.writeable = False
            self.__dict__["_sizes"] = sizes
        return sizes

    def checksum_array(self) -> Any:
        """:attr:`checksums` as a read-only int64 array (:data:`NOT_RECORDED` where not recorded), worked out once
        per handle; None when the handle records none (a format before 4)."""
        if self.checksums is None:
            return None
        found = self.__dict__.get("_checksum_array")
        if found is None:
            found = np.asarray(self.checksums, dtype=np.int64)
            found.flags.writeable = False
            self.__dict__["_checksum_array"] = found
        return found

    def _quiet_blocks(self) -> Any:
        """A bool per key group of the range: whether its block is quiet (an empty delta: nothing changed there)."""
        return _quiet(np.diff(np.asarray(self.offsets, dtype=np.int64)), self.key_group_range, self.full_key_groups)

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__.pop("_encoded", None)   # a field changed (a writer naming predecessors): encode it again
        for derived in ("_changed", "_sizes", "_checksum_array", "_states_checked", "_canonical_states"):
            self.__dict__.pop(derived, None)
        super().__setattr__(name, value)

    @functools.cached_property
    def crc_seed(self) -> int:
        """``crc32c(file id)``, the seed of each format-4 block's checksum (0 for earlier formats or no id)."""
        return crc32c(bytes.fromhex(self.file_id)) if self.file_id is not None else 0

    def checksum(self, key_group: int) -> int | None:
        """The checksum ``key_group``'s block stores, as the handle names it (None: not recorded, format < 4 or a
        quiet block of a handle read from version 7)."""
        if self.checksums is None:
            return None
        checksum = self.checksums[key_group - self.key_group_range.start]
        return None if checksum == NOT_RECORDED else checksum

    def link(self, key_group: int) -> BlockLink | None:
        """``key_group``'s block of this file as a later delta names it (None: its checksum is not recorded)."""
        checksum = self.checksum(key_group)
        return None if checksum is None else BlockLink(self.checkpoint_id, checksum)

    def predecessor(self, key_group: int) -> BlockLink | None:
        """The block ``key_group``'s delta block applies on, if the handle names one."""
        return None if self.predecessors is None else self.predecessors.get(key_group)

    @property
    def is_all_full(self) -> bool:
        """Whether every block of the file is full (a file that needs no older file)."""
        return self.full_key_groups == ([self.key_group_range] if self.key_group_range else [])

    def is_full(self, key_group: int) -> bool:
        """Whether ``key_group``'s block in this file is full (False for a delta, and outside the range)."""
        i = bisect.bisect_right(self._full_starts, key_group) - 1
        return i >= 0 and key_group <= self.full_key_groups[i].end

    def is_fresh(self, key_group: int) -> bool:
        """Whether ``key_group``'s delta block in this file applies to no earlier block (True when not recorded:
        files of earlier versions did not say)."""
        if self.fresh_key_groups is None:
            return True
        return any(r.start <= key_group <= r.end for r in self.fresh_key_groups)

    def block_size(self, key_group: int) -> int:
        """Bytes of ``key_group``'s block (which must lie in ``key_group_range``)."""
        i = key_group - self.key_group_range.start
        if not (type(key_group) is int and 0 <= i < len(self.offsets) - 1) and key_group not in self.key_group_range:
            raise ValueError(f"key group {key_group} is outside this handle's {self.key_group_range}")
        return self.offsets[i + 1] - self.offsets[i]

    def changes(self, key_group: int) -> bool:
        """Whether ``key_group``'s block matters to a restore: a full block always does, a delta block unless it is
        empty (a delta file writes an empty block for every key group nothing changed in)."""
        return self.is_full(key_group) or self.block_size(key_group) > EMPTY_BLOCK_SIZE

    def changed_key_groups(self) -> tuple[list[int], list[int]]:
        """``(full, deltas)``: the key groups whose block is full, and those whose block is a non-empty delta (the
        key groups :meth:`changes` is true of), each ascending. Worked out once per handle: every batch plans its
        chains from them, over every handle of the checkpoint."""
        cached = self.__dict__.get("_changed")
        if cached is None:
            r = self.key_group_range
            full = np.zeros(len(r), dtype=bool)
            for f in self.full_key_groups:
                full[f.start - r.start:f.end - r.start + 1] = True
            nonempty = self.block_sizes() > EMPTY_BLOCK_SIZE
            cached = self.__dict__["_changed"] = ((np.flatnonzero(full) + r.start).tolist(),
                                                  (np.flatnonzero(nonempty & ~full) + r.start).tolist())
        return cached

    def byte_range(self, key_groups: KeyGroupRange) -> tuple[int, int]:
        """``(start, end)`` byte offsets in ``file`` of the blocks of ``key_groups`` (which must lie inside
        ``key_group_range``), end exclusive."""
        return _byte_range(self.key_group_range, self.offsets, key_groups)

    def to_json(self) -> dict[str, Any]:
        r = self.key_group_range
        out = {"file": self.file, "subtask": self.subtask, "key_group_range": [r.start, r.end],
               "offsets": list(self.offsets), "size": self.size, "states": self.states,
               "checkpoint_id": self.checkpoint_id,
               "full_key_groups": [[f.start, f.end] for f in self.full_key_groups],
               "format_version": self.format_version}
        if self.fresh_key_groups is not None:   # an older reader ignores it (and checks no chain)
            out["fresh_key_groups"] = [[f.start, f.end] for f in self.fresh_key_groups]
        if self.file_id is not None:
            out["file_id"] = self.file_id
        if self.checksums is not None:
            checksums = np.asarray(self.checksums, dtype=np.int64)
            if self.checksums and min(self.checksums) == NOT_RECORDED:   # of a handle read from version 7
                checksums = checksums[~self._quiet_blocks()]
                out["quiet_unrecorded"] = True   # the quiet blocks' checksums are left out
            out["checksums"] = _pack_u32(checksums)
        if self.predecessors is not None:
            out["predecessors"] = BlockLinks.of(self.predecessors, r).to_json(self.checkpoint_id)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KeyedStateHandle:
        """The handle back from :meth:`to_json`; CorruptSnapshotError if ``d`` is not one."""
        try:
            start, end = d["key_group_range"]
            full = [KeyGroupRange(a, b) for a, b in d["full_key_groups"]]
            fresh = d.get("fresh_key_groups")
            r = KeyGroupRange(start, end)
            checksums = d.get("checksums")
            links = d.get("predecessors")
            if checksums is not None:
                checksums = _unpack_u32(checksums, "checksums")
                if d.get("quiet_unrecorded") is True:   # the quiet blocks' checksums left out (version 7)
                    sizes = np.diff(np.asarray(d["offsets"], dtype=np.int64))
                    if len(sizes) != len(r):
                        raise ValueError(f"offsets must be {len(r) + 1} positions for {r}, got {len(sizes) + 1}")
                    kept = ~_quiet(sizes, r, full)
                    if len(checksums) != int(kept.sum()):
                        raise ValueError(f"checksums holds {len(checksums)} values, not one per block that is not "
                                         f"quiet ({int(kept.sum())})")
                    expanded = np.full(len(r), NOT_RECORDED, dtype=np.int64)
                    expanded[kept] = checksums
                    checksums = expanded
                checksums = checksums.tolist()
            return cls(file=d["file"], subtask=d["subtask"], key_group_range=r,
                       offsets=d["offsets"], size=d["size"], states=d["states"], checkpoint_id=d["checkpoint_id"],
                       full_key_groups=full, format_version=d["format_version"],
                       fresh_key_groups=None if fresh is None else [KeyGroupRange(a, b) for a, b in fresh],
                       file_id=d.get("file_id"),
                       checksums=checksums,
                       predecessors=None if links is None else BlockLinks.from_json(links, r, d["checkpoint_id"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptSnapshotError(f"not a valid keyed state handle ({e}): {str(d)[:200]}") from e


def keyed_handles_by_range(handles: list[KeyedStateHandle]) -> list[KeyedStateHandle]:
    """The handles that hold key groups, ordered by checkpoint id, then by first key group. ValueError naming the
    first two of one checkpoint whose ranges overlap: in one checkpoint each key group belongs to one subtask (files
    of different checkpoints overlap: a key group's chain)."""
    ranged = sorted((h for h in handles if h.key_group_range),
                    key=lambda h: (h.checkpoint_id, h.key_group_range.start))
    for a, b in zip(ranged, ranged[1:]):
        if a.checkpoint_id == b.checkpoint_id and a.key_group_range.end >= b.key_group_range.start:
            raise ValueError(f"keyed handles overlap: subtask {a.subtask} {a.key_group_range} and subtask "
                             f"{b.subtask} {b.key_group_range}, both written by checkpoint {a.checkpoint_id}; in "
                             f"one checkpoint each key group belongs to one subtask")
    return ranged


@dataclass
class RawKeyedStateHandle:
    """Where one subtask's raw keyed state lives (Flink's ``KeyGroupsStateHandle`` of raw keyed state): the bytes the
    job's function wrote itself, per key group, at snapshot time.

    ``offsets[i]`` is the absolute byte offset of key group ``key_group_range.start + i``'s block in ``file`` and
    ``offsets[-1]`` the end of the last one, so a subtask of any parallelism reads exactly the blocks of its key
    groups. The file lies in its checkpoint's directory: raw state is written whole at every checkpoint (the bytes
    are opaque, so there is nothing to write incrementally), and no later checkpoint references it.
    """

    file: str
    subtask: int
    key_group_range: KeyGroupRange
    offsets: list[int]
    size: int
    format_version: int = field(default=RAW_KEYED_FORMAT_VERSION, kw_only=True)

    def __post_init__(self) -> None:
        check_relpath(self.file, "RawKeyedStateHandle.file")
        if not _is_int(self.subtask) or self.subtask < 0:
            raise ValueError(f"RawKeyedStateHandle.subtask must be an int >= 0, got {self.subtask!r}")
        if not isinstance(self.key_group_range, KeyGroupRange) or not self.key_group_range:
            raise TypeError(f"RawKeyedStateHandle.key_group_range must be a non-empty KeyGroupRange, got "
                            f"{self.key_group_range!r}")
        if not _is_int(self.size) or self.size < 0:
            raise ValueError(f"RawKeyedStateHandle.size must be an int >= 0, got {self.size!r}")
        _check_offsets("RawKeyedStateHandle", self.offsets, self.key_group_range, self.size)
        if self.format_version != RAW_KEYED_FORMAT_VERSION:
            raise ValueError(f"RawKeyedStateHandle.format_version must be {RAW_KEYED_FORMAT_VERSION} (the raw keyed "
                             f"format this keygroups reads), got {self.format_version!r}")

    def byte_range(self, key_groups: KeyGroupRange) -> tuple[int, int]:
        """``(start, end)`` byte offsets in ``file`` of the blocks of ``key_groups`` (a non-empty part of
        ``key_group_range``), end exclusive."""
        return _byte_range(self.key_group_range, self.offsets, key_groups)

    def to_json(self) -> dict[str, Any]:
        r = self.key_group_range
        return {"file": self.file, "subtask": self.subtask, "key_group_range": [r.start, r.end],
                "offsets": list(self.offsets), "size": self.size, "format_version": self.format_version}

    @classmethod
    def from_json(cls, d: Any) -> RawKeyedStateHandle:
        """The handle back from :meth:`to_json`; CorruptSnapshotError naming the field if ``d`` is not one."""
        try:
            start, end = d["key_group_range"]
            return cls(file=d["file"], subtask=d["subtask"], key_group_range=KeyGroupRange(start, end),
                       offsets=d["offsets"], size=d["size"], format_version=d["format_version"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptSnapshotError(f"not a valid raw keyed state handle ({e}): {str(d)[:200]}") from e


class DistributionMode(enum.StrEnum):
    """How an operator state's elements are redistributed when the parallelism changes (Flink's
    ``OperatorStateHandle.Mode``). The values are what handles store in JSON."""

    #: The old lists, concatenated, are split evenly over the new subtasks (``get_list_state``).
    SPLIT_DISTRIBUTE = "SPLIT_DISTRIBUTE"
    #: Every new subtask gets every old element (``get_union_list_state``).
    UNION = "UNION"
    #: Every subtask holds the same map; each new subtask gets one old copy (``get_broadcast_state``).
    BROADCAST = "BROADCAST"


#: The serializer snapshots an operator state of each mode keeps, by JSON key.
SERIALIZER_KEYS: dict[DistributionMode, tuple[str, ...]] = {
    DistributionMode.SPLIT_DISTRIBUTE: ("serializer",),
    DistributionMode.UNION: ("serializer",),
    DistributionMode.BROADCAST: ("key_serializer", "value_serializer"),
}


@dataclass
class OperatorStateMeta:
    """One state in an operator handle (Flink's ``StateMetaInfo``, plus serializers and checksums).

    ``offsets[i]`` is the absolute byte offset of element ``i`` in the handle's file and ``end`` the end of the last
    one. ``blocks`` are ``(first element, CRC32C)`` of consecutive checksum blocks of whole elements: block ``b``
    covers elements ``[blocks[b][0], blocks[b + 1][0])`` (the last one up to ``end``), so a reader of a few elements
    verifies only the blocks holding them. ``serializers`` maps :data:`SERIALIZER_KEYS` of ``mode`` to serializer
    snapshots (JSON). Validated as part of its :class:`OperatorStateHandle`.
    """

    mode: DistributionMode
    serializers: dict[str, dict[str, Any]]
    offsets: list[int]
    end: int
    blocks: list[tuple[int, int]]

    def __len__(self) -> int:
        return len(self.offsets)

    def bound(self, i: int) -> int:
        """Byte offset where element ``i`` starts (``len(self)`` -> ``end``)."""
        return self.offsets[i] if i < len(self.offsets) else self.end

    @functools.cached_property
    def block_starts(self) -> list[int]:
        """The first element of each checksum block (ascending, from 0); computed once, as handles are not changed
        after they are built."""
        return [first for first, _ in self.blocks]

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode.value, **self.serializers, "offsets": list(self.offsets), "end": self.end,
                "blocks": [[first, crc] for first, crc in self.blocks]}

    @classmethod
    def _from_json(cls, d: Any, where: str) -> OperatorStateMeta:
        if not isinstance(d, dict):
            raise TypeError(f"{where} must be a JSON object, got {type(d).__name__}")
        value: Any = d.get("mode")
        try:
            mode = DistributionMode(value)
        except ValueError:
            raise ValueError(f"{where}.mode: unknown mode {value!r}; known: "
                             f"{', '.join(m.value for m in DistributionMode)}") from None
        missing = [k for k in (*SERIALIZER_KEYS[mode], "offsets", "end", "blocks") if k not in d]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}")
        blocks = d["blocks"]
        if not isinstance(blocks, list) or not all(isinstance(b, list) and len(b) == 2 for b in blocks):
            raise TypeError(f"{where}.blocks must be a list of [first element, CRC32C] pairs, got {str(blocks)[:100]}")
        return cls(mode=mode, serializers={k: d[k] for k in SERIALIZER_KEYS[mode]}, offsets=d["offsets"],
                   end=d["end"], blocks=[(first, crc) for first, crc in blocks])


def _check_operator_state(where: str, meta: Any, size: int) -> None:
    """ValueError/TypeError naming the first field of ``meta`` that a state of a ``size``-byte file cannot have."""
    if not isinstance(meta, OperatorStateMeta):
        raise TypeError(f"{where} must be an OperatorStateMeta, got {type(meta).__name__}")
    if not isinstance(meta.mode, DistributionMode):
        raise TypeError(f"{where}.mode must be a DistributionMode, got {meta.mode!r}")
    roles = SERIALIZER_KEYS[meta.mode]
    if not isinstance(meta.serializers, dict) or sorted(meta.serializers) != sorted(roles) \
            or not all(isinstance(v, dict) for v in meta.serializers.values()):
        raise TypeError(f"{where}.serializers must map {', '.join(roles)} (a {meta.mode} state's serializers) to "
                        f"serializer snapshots (JSON objects), got {str(meta.serializers)[:100]}")
    if not _is_int(meta.end) or not 0 <= meta.end <= size:
        raise ValueError(f"{where}.end = {meta.end!r} must be an int in [0, size={size}]")
    offsets = meta.offsets
    # one pass each in C: offsets lists hold one entry per element and can be long
    if not isinstance(offsets, list) or not set(map(type, offsets)) <= {int}:
        raise TypeError(f"{where}.offsets must be a list of ints (one per element)")
    if offsets and not 0 <= min(offsets) <= max(offsets) <= meta.end:
        raise ValueError(f"{where}.offsets must lie in [0, end={meta.end}], got {min(offsets)}..{max(offsets)}")
    if not isinstance(meta.blocks, list):
        raise TypeError(f"{where}.blocks must be a list of (first element, CRC32C) pairs")
    prev = -1
    for b, block in enumerate(meta.blocks):
        first, crc = block if isinstance(block, tuple) and len(block) == 2 else (None, None)
        if not _is_int(first) or not prev < first < len(offsets) or not _is_int(crc) or not 0 <= crc < 1 << 32:
            raise ValueError(f"{where}.blocks[{b}] = {block!r} must be (first element in ({prev}, {len(offsets)}), "
                             f"CRC32C as u32): blocks ascend over the elements")
        prev = first
    if offsets and (not meta.blocks or meta.blocks[0][0] != 0):
        raise ValueError(f"{where}.blocks must start at element 0, got "
                         f"{meta.blocks[0][0] if meta.blocks else 'no blocks'}")


@dataclass
class OperatorStateHandle:
    """Where one subtask's operator state file lives and what each of its states holds (Flink's
    ``OperatorStateHandle``): ``states`` maps a state name to its :class:`OperatorStateMeta`. ``operator_id`` tells
    apart the operators whose handles share one checkpoint.

    In JSON (:meth:`to_json`) the handle also names its file format and version, which :meth:`from_json` checks.
    """

    file: str
    subtask: int
    size: int
    operator_id: str
    states: dict[str, OperatorStateMeta]

    def __post_init__(self) -> None:
        check_relpath(self.file, "OperatorStateHandle.file")
        if not _is_int(self.subtask) or self.subtask < 0:
            raise ValueError(f"OperatorStateHandle.subtask must be an int >= 0, got {self.subtask!r}")
        if not _is_int(self.size) or self.size < 0:
            raise ValueError(f"OperatorStateHandle.size must be an int >= 0, got {self.size!r}")
        if not isinstance(self.operator_id, str) or not self.operator_id:
            raise ValueError(f"OperatorStateHandle.operator_id must be a non-empty str, got {self.operator_id!r}")
        if not isinstance(self.states, dict):
            raise TypeError(f"OperatorStateHandle.states must be a dict of state name -> OperatorStateMeta, got "
                            f"{type(self.states).__name__}")
        for name, meta in self.states.items():
            if not isinstance(name, str):
                raise TypeError(f"OperatorStateHandle.states keys must be state names (str), got {name!r}")
            _check_operator_state(f"OperatorStateHandle.states[{name!r}]", meta, self.size)

    def to_json(self) -> dict[str, Any]:
        return {"format": OPERATOR_FORMAT_NAME, "version": OPERATOR_FORMAT_VERSION, "operator_id": self.operator_id,
                "subtask": self.subtask, "file": self.file, "size": self.size,
                "states": {name: meta.to_json() for name, meta in self.states.items()}}

    @classmethod
    def from_json(cls, d: Any) -> OperatorStateHandle:
        """The handle back from :meth:`to_json` (also from handles written before this class existed, which carry
        ``checkpoint_id`` and ``parallelism`` as well); CorruptSnapshotError naming the field if ``d`` is not one."""
        if not isinstance(d, dict) or d.get("format") != OPERATOR_FORMAT_NAME:
            raise CorruptSnapshotError(f"not an operator state handle (format {OPERATOR_FORMAT_NAME!r} expected): "
                                       f"{str(d)[:200]}")
        version: Any = d.get("version")
        if not _is_int(version) or not 1 <= version <= OPERATOR_FORMAT_VERSION:
            raise CorruptSnapshotError(f"operator state handle version {version!r} is not one this library reads "
                                       f"(1..{OPERATOR_FORMAT_VERSION}); a newer keygroups wrote it, or it is corrupt")
        try:
            states = d["states"]
            if not isinstance(states, dict):
                raise TypeError(f"OperatorStateHandle.states must be a JSON object, got {type(states).__name__}")
            return cls(file=d["file"], subtask=d["subtask"], size=d["size"],
                       operator_id=d.get("operator_id", DEFAULT_OPERATOR_ID),
                       states={name: OperatorStateMeta._from_json(meta, f"OperatorStateHandle.states[{name!r}]")
                               for name, meta in states.items()})
        except KeyError as e:
            raise CorruptSnapshotError(f"not a valid operator state handle (no {e.args[0]!r} field): "
                                       f"{str(d)[:200]}") from None
        except (TypeError, ValueError) as e:
            raise CorruptSnapshotError(f"not a valid operator state handle ({e}): {str(d)[:200]}") from None


@dataclass
class CheckpointMetadata:
    """Everything a complete checkpoint (or savepoint) holds: the job, its parallelism, the state handles.

    ``outputs`` and ``inputs`` are the files a batch wrote beside its state (the runner's output and staged input,
    Parquet): retention keeps them as long as the checkpoint, and a savepoint (state only) does not copy them.
    ``properties`` is free JSON (the runner's per-subtask reports); nothing in it references a file.

    ``base`` is not serialized: it is the directory (relative to the storage location) this metadata was loaded
    from or committed to, ``"chk-<id>"`` or ``"savepoints/<name>"``; the handles' files lie inside it.
    """

    checkpoint_id: int
    job_id: str
    timestamp_ms: int
    max_parallelism: int
    parallelism: int
    keyed_handles: list[KeyedStateHandle] = field(default_factory=list)
    operator_handles: list[OperatorStateHandle] = field(default_factory=list)
    properties: dict[str, Any] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    #: The records each subtask found late (behind the watermark) and kept, Parquet like ``outputs``.
    late_outputs: list[str] = field(default_factory=list)
    #: The raw keyed state the job's function wrote (one file per subtask, in this checkpoint's directory).
    raw_keyed_handles: list[RawKeyedStateHandle] = field(default_factory=list)
    base: str = field(default="", compare=False)

    def runner_files(self) -> list[str]:
        """The files the runner wrote beside the state: ``outputs``, ``inputs`` and ``late_outputs``."""
        return [*self.outputs, *self.inputs, *self.late_outputs]

    def validate(self) -> None:
        """ValueError/TypeError naming the first field that is not what a checkpoint can hold."""
        if not _is_int(self.checkpoint_id) or self.checkpoint_id < 0:
            raise ValueError(f"checkpoint_id must be an int >= 0, got {self.checkpoint_id!r}")
        if not isinstance(self.job_id, str):
            raise TypeError(f"job_id must be a str, got {type(self.job_id).__name__}")
        if not _is_int(self.timestamp_ms):
            raise TypeError(f"timestamp_ms must be an int, got {self.timestamp_ms!r}")
        mp = check_max_parallelism(self.max_parallelism)
        if not _is_int(self.parallelism) or not 1 <= self.parallelism <= mp:
            raise ValueError(f"parallelism must be an int in [1, max_parallelism={mp}], got {self.parallelism!r}")
        for h in self.keyed_handles:
            if not isinstance(h, KeyedStateHandle):
                raise TypeError(f"keyed_handles must hold KeyedStateHandle objects, got {type(h).__name__}")
            if h.key_group_range and h.key_group_range.end >= mp:
                raise ValueError(f"the keyed handle of subtask {h.subtask} covers {h.key_group_range}, past "
                                 f"max_parallelism={mp} (key groups are [0, {mp - 1}])")
            if h.checkpoint_id > self.checkpoint_id:
                raise ValueError(f"checkpoint {self.checkpoint_id} references the keyed file {h.file!r} of a newer "
                                 f"checkpoint, {h.checkpoint_id}")
            if h.checkpoint_id == self.checkpoint_id and h.subtask >= self.parallelism:
                raise ValueError(f"a keyed handle of subtask {h.subtask} in a checkpoint of parallelism "
                                 f"{self.parallelism} (subtasks are 0..{self.parallelism - 1})")
            if h.format_version >= CHAINED_FORMAT_VERSION and (h.file_id is None or h.checksums is None):
                raise ValueError(f"the keyed handle of {h.file!r} (subtask {h.subtask}, checkpoint {h.checkpoint_id}) "
                                 f"is of keyed format {h.format_version} but names no file id or block checksums: "
                                 "they tie the file's bytes to the checkpoint (write_keyed_snapshot's handle has them)")
        keyed_handles_by_range(self.keyed_handles)
        for rh in self.raw_keyed_handles:
            if not isinstance(rh, RawKeyedStateHandle):
                raise TypeError(f"raw_keyed_handles must hold RawKeyedStateHandle objects (RawKeyedStateHandle."
                                f"from_json reads one from JSON), got {type(rh).__name__}")
        prev: RawKeyedStateHandle | None = None
        for rh in sorted(self.raw_keyed_handles, key=lambda h: h.key_group_range.start):
            if rh.key_group_range.end >= mp or rh.subtask >= self.parallelism:
                raise ValueError(f"the raw keyed handle of subtask {rh.subtask} covers {rh.key_group_range}, outside "
                                 f"a checkpoint of parallelism {self.parallelism} and max_parallelism={mp}")
            if prev is not None and prev.key_group_range.end >= rh.key_group_range.start:
                raise ValueError(f"raw keyed handles overlap: subtask {prev.subtask} {prev.key_group_range} and "
                                 f"subtask {rh.subtask} {rh.key_group_range}; each key group belongs to one subtask")
            prev = rh
        for oh in self.operator_handles:
            if not isinstance(oh, OperatorStateHandle):
                raise TypeError(f"operator_handles must hold OperatorStateHandle objects (OperatorStateHandle."
                                f"from_json reads one from JSON), got {type(oh).__name__}")
        if not isinstance(self.properties, dict):
            raise TypeError(f"properties must be a JSON dict, got {type(self.properties).__name__}")
        for name in ("outputs", "inputs", "late_outputs"):
            files = getattr(self, name)
            if not isinstance(files, list):
                raise TypeError(f"{name} must be a list of storage-relative paths, got {type(files).__name__}")
            for f in files:
                check_relpath(f, f"an entry of {name}")

    def files(self) -> list[str]:
        """Every state file this checkpoint references (storage-relative): keyed, operator and raw keyed."""
        return ([h.file for h in self.keyed_handles] + [h.file for h in self.operator_handles]
                + [h.file for h in self.raw_keyed_handles])


def is_shared_path(relpath: str) -> bool:
    """Whether ``relpath`` (storage-relative) names a file of ``shared/``: exactly ``shared/<name>``."""
    parts = relpath.split("/")
    return len(parts) == 2 and parts[0] == SHARED_DIR


def _strip_base(relpath: str, base: str, what: str = "state file") -> str:
    prefix = base + "/"
    if not relpath.startswith(prefix):
        raise ValueError(f"{what} {relpath!r} is not inside {base!r}/: a checkpoint references only files in its "
                         f"own directory (write them with storage.new_file(checkpoint_id, ...)) and keyed files in "
                         f"{SHARED_DIR}/ (storage.new_shared_file)")
    return relpath[len(prefix):]


def _keyed_path(relpath: str, base: str) -> str:
    """How ``_metadata`` in ``base`` stores a keyed file: ``shared/<name>`` as it is, anything else relative to
    ``base`` (and inside it)."""
    return relpath if is_shared_path(check_relpath(relpath)) else _strip_base(relpath, base)


def _keyed_file(stored: Any, base: str, version: int) -> str:
    """The storage-relative path of a keyed file as ``_metadata`` of ``version`` in ``base`` stores it."""
    rel = check_relpath(stored, "a keyed state file")
    if version >= _SHARED_VERSION and is_shared_path(rel):
        return rel
    return f"{base}/{rel}"


def _legacy_files(properties: dict[str, Any], key: str, base: str) -> list[str]:
    """Version 1's ``properties[key]`` (storage-relative paths), removed from ``properties``: those inside ``base``.
    A version-1 savepoint copied the properties but not these files, so its entries point elsewhere and are dropped."""
    files = properties.pop(key, [])
    if not isinstance(files, list):
        raise TypeError(f"properties[{key!r}] must be a list of paths in a version {_LEGACY_VERSION} _metadata")
    return [check_relpath(f, f"properties[{key!r}]") for f in files if f.startswith(base + "/")]


def _json_text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def _zipped(values: Any, dtype: str) -> str:
    # level 1: these arrays are runs of a few values, which it packs nearly as tightly as level 6 in a tenth of the
    # time (every commit encodes its new handles); readers inflate any level
    return base64.b64encode(zlib.compress(np.asarray(values, dtype=dtype).tobytes(), 1)).decode("ascii")


def _unzipped(text: Any, dtype: str, count: int, what: str) -> Any:
    """``count`` values of ``dtype`` from :func:`_zipped` text; ValueError for anything else (never inflating more
    than those values' bytes, whatever the text says)."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a base64 string of zlib'd values, got {type(text).__name__}")
    want = count * np.dtype(dtype).itemsize
    try:
        inflate = zlib.decompressobj()
        raw = inflate.decompress(base64.b64decode(text, validate=True), want + 1)
        if not inflate.eof:
            raise ValueError(f"{what} holds more than {count} values")
    except (binascii.Error, zlib.error) as e:
        raise ValueError(f"{what} is not base64 of zlib'd data: {e}") from None
    if len(raw) != want:
        raise ValueError(f"{what} holds {len(raw)} bytes, not the {want} of {count} values")
    return np.frombuffer(raw, dtype=dtype)


def _quiet(sizes: Any, key_group_range: KeyGroupRange, full_key_groups: Any) -> Any:
    """A bool per key group of ``key_group_range``: whether its block, of ``sizes[i]`` bytes, is quiet (a delta
    block that holds nothing); ``full_key_groups`` as ``[start, end]`` pairs or KeyGroupRanges."""
    quiet = np.asarray(sizes, dtype=np.int64) == EMPTY_BLOCK_SIZE
    for f in full_key_groups:
        start, end = (f.start, f.end) if isinstance(f, KeyGroupRange) else f
        if not (_is_int(start) and _is_int(end)):
            raise ValueError(f"full_key_groups must hold [start, end] pairs of ints, got {f!r:.60}")
        lo, hi = max(start, key_group_range.start), min(end, key_group_range.end)
        if lo <= hi:
            quiet[lo - key_group_range.start:hi - key_group_range.start + 1] = False
    return quiet


def _compact_keyed(d: dict[str, Any], elide: bool) -> dict[str, Any]:
    """A keyed handle's JSON (``to_json``) as versions 6 and 7 store it; ``elide`` (version 7, a handle carried
    from an older checkpoint) leaves out its quiet blocks' checksums and predecessors (see the module docs)."""
    offsets = d.pop("offsets")
    sizes = np.diff(np.asarray(offsets, dtype=np.int64))
    d["first_offset"] = offsets[0]
    d["block_sizes"] = _zipped(sizes, "<u8")
    links = d.get("predecessors")
    kept: Any = slice(None)
    if "checksums" in d and (elide or d.get("quiet_unrecorded")):
        start, end = d["key_group_range"]
        kept = ~_quiet(sizes, KeyGroupRange(start, end), d["full_key_groups"])
        if not d.get("quiet_unrecorded"):   # else left out already: the handle does not record them
            d["checksums"] = _pack_u32(_unpack_u32(d["checksums"], "checksums")[kept])
            d["quiet_unrecorded"] = True
    if links is not None:
        d["predecessors"] = {"distances_z": _zipped(_unpack_u32(links["distances"], "distances")[kept], "<u4"),
                             "checksums": _pack_u32(_unpack_u32(links["checksums"], "checksums")[kept])}
    return d


def _expand_keyed(d: dict[str, Any]) -> dict[str, Any]:
    """A keyed handle's JSON as versions 6 and 7 store it back as ``from_json`` reads it; ValueError/KeyError/
    TypeError if it is not one."""
    start, end = d["key_group_range"]
    # bounded before anything is inflated: a key group range of at most Flink's 32768 key groups sizes the arrays
    if not (_is_int(start) and _is_int(end) and 0 <= start and end < UPPER_BOUND_MAX_PARALLELISM):
        raise ValueError(f"key_group_range must be two ints in [0, {UPPER_BOUND_MAX_PARALLELISM}), got "
                         f"{[start, end]!r:.60}")
    n = max(0, end - start + 1)
    first = d.pop("first_offset")
    if not _is_int(first) or not 0 <= first < 1 << 62:
        raise ValueError(f"first_offset must be an int in [0, 2**62), got {first!r:.40}")
    sizes = _unzipped(d.pop("block_sizes"), "<u8", n, "block_sizes")
    if sizes.size and int(sizes.max()) >= 1 << 62:
        raise ValueError("block_sizes holds a block of 2**62 bytes or more")
    d["offsets"] = (first + np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))).tolist()
    links = d.get("predecessors")
    if links is not None:
        if not isinstance(links, dict):
            raise TypeError(f"predecessors must be a JSON object, got {type(links).__name__}")
        if d.get("quiet_unrecorded") is True:   # the links of the blocks that are not quiet only
            kept = ~_quiet(sizes, KeyGroupRange(start, end), d["full_key_groups"])
            count = int(kept.sum())
            distances, named = np.zeros(n, dtype=np.uint32), np.zeros(n, dtype=np.uint32)
            distances[kept] = _unzipped(links["distances_z"], "<u4", count, "predecessors.distances_z")
            checks = _unpack_u32(links["checksums"], "predecessors.checksums")
            if len(checks) != count:
                raise ValueError(f"predecessors.checksums holds {len(checks)} values, not one per block that is not "
                                 f"quiet ({count})")
            named[kept] = checks
            d["predecessors"] = {"distances": _pack_u32(distances), "checksums": _pack_u32(named)}
        else:
            distances = _unzipped(links["distances_z"], "<u4", n, "predecessors.distances_z")
            d["predecessors"] = {"distances": _pack_u32(distances), "checksums": links["checksums"]}
    return d


def _keyed_handle_text(handle: KeyedStateHandle, base: str, version: int, carried: bool) -> bytes:
    """``handle``'s JSON in a ``_metadata`` of directory ``base`` and ``version`` (6 and 7 compact it; 7 leaves
    out a ``carried`` handle's quiet blocks), encoded once per handle, stored path, version and role: an incremental
    checkpoint carries most of its handles forward from the one before, so a commit encodes only its new ones and
    those it carries for the first time (a handle is never changed once a checkpoint holds it)."""
    stored = _keyed_path(handle.file, base)
    elide = carried and version >= METADATA_VERSION
    cache = handle.__dict__.setdefault("_encoded", {})
    text = cache.get((stored, version, elide))
    if text is None:
        d = dict(handle.to_json(), file=stored)
        if version >= _COMPACT_VERSION:
            d = _compact_keyed(d, elide)
        text = cache[(stored, version, elide)] = _json_text(d).encode("utf-8")
    return text


def same_handle(a: KeyedStateHandle, b: KeyedStateHandle, *, carried: bool = False) -> bool:
    """Whether ``a`` and ``b`` describe one keyed file alike: every field, and each block's offsets, checksum and
    predecessor; with ``carried``, not the quiet blocks' checksums and predecessors, which a ``_metadata`` leaves
    out of the handles it carries from older checkpoints (no chain uses them). A handle a task wrote and the same
    handle read back from a checkpoint are two objects: compared field by field, the arrays as arrays."""
    if a is b:
        return True
    r = a.key_group_range
    if (a.file, a.subtask, r, a.size, a.checkpoint_id, a.format_version, a.file_id, a.full_key_groups,
            a.fresh_key_groups, a.states, a.offsets) != (
            b.file, b.subtask, b.key_group_range, b.size, b.checkpoint_id, b.format_version, b.file_id,
            b.full_key_groups, b.fresh_key_groups, b.states, b.offsets):
        return False
    if (a.checksums is None) != (b.checksums is None):
        return False
    blocks: Any = ~_quiet(a.block_sizes(), r, a.full_key_groups) if carried else slice(None)
    if a.checksums is not None and not np.array_equal(a.checksum_array()[blocks], b.checksum_array()[blocks]):
        return False
    links_a, links_b = BlockLinks.of(a.predecessors or {}, r), BlockLinks.of(b.predecessors or {}, r)
    return bool(np.array_equal(links_a.checkpoints[blocks], links_b.checkpoints[blocks])
                and np.array_equal(np.where(links_a.checkpoints >= 0, links_a.checksums, 0)[blocks],
                                   np.where(links_b.checkpoints >= 0, links_b.checksums, 0)[blocks]))


def encode_metadata(metadata: CheckpointMetadata, base: str) -> bytes:
    """The bytes of ``_metadata`` for ``metadata`` stored in directory ``base`` (files become relative to it)."""
    metadata.validate()
    # The oldest version whose readers lose nothing: a version-3 reader ignores raw keyed state and late outputs
    # (restoring without the one, deleting both as orphans) and a version-4 reader does not know keyed format 4, so
    # each must refuse such a checkpoint instead.
    if any(h.format_version >= CHAINED_FORMAT_VERSION for h in metadata.keyed_handles):
        version = METADATA_VERSION
    elif metadata.raw_keyed_handles or metadata.late_outputs:
        version = _RAW_KEYED_VERSION
    else:
        version = _SHARED_VERSION
    cid = metadata.checkpoint_id
    keyed = b",".join(_keyed_handle_text(h, base, version, h.checkpoint_id < cid) for h in metadata.keyed_handles)
    placeholder = f"\x00keyed-handles-{id(keyed):x}\x00"   # spliced in below: the handles are encoded already
    body = {
        "checkpoint_id": metadata.checkpoint_id,
        "job_id": metadata.job_id,
        "timestamp_ms": metadata.timestamp_ms,
        "max_parallelism": metadata.max_parallelism,
        "parallelism": metadata.parallelism,
        "keyed_handles": placeholder,
        "operator_handles": [dict(h.to_json(), file=_strip_base(h.file, base)) for h in metadata.operator_handles],
        "properties": metadata.properties,
        "outputs": [_strip_base(f, base, "output file") for f in metadata.outputs],
        "inputs": [_strip_base(f, base, "input file") for f in metadata.inputs],
        "late_outputs": [_strip_base(f, base, "late output file") for f in metadata.late_outputs],
    }
    if metadata.raw_keyed_handles:   # absent when there is none: such a _metadata reads as before
        body["raw_keyed_handles"] = [dict(h.to_json(), file=_strip_base(h.file, base, "raw keyed state file"))
                                     for h in metadata.raw_keyed_handles]
    try:
        text = _json_text(body)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint {metadata.checkpoint_id}'s metadata is not plain JSON: {e}") from e
    quoted = _json_text(placeholder)
    at = text.index(f'"keyed_handles":{quoted}') + len('"keyed_handles":')
    raw = b"".join((text[:at].encode("utf-8"), b"[", keyed, b"]", text[at + len(quoted):].encode("utf-8")))
    head = _PREFIX.pack(METADATA_MAGIC, version, len(raw)) + raw
    return head + struct.pack("<I", crc32c(head))


#: Keyed handles decoded lately, by their JSON as stored (with the file's path resolved) and the ``_metadata``
#: version: an incremental checkpoint carries nearly all of its handles from the one before, stored alike once carried,
#: so a reader of each batch's ``_metadata`` (every task, every batch) decodes and validates only the handles it has not
#: seen, and keeps what it works out per handle (its changed key groups, its chains' inputs) across batches: at max
#: parallelism 4096 and 100 carried files, hundreds of ms a task. Bounded by the key groups the handles cover (their
#: per key group arrays are the memory), least recently used first out. A handle is never changed once a checkpoint
#: holds it, so one object serves every checkpoint that lists it (as the driver's carried handles already do).
_HANDLES: collections.OrderedDict[tuple[int, str], KeyedStateHandle] = collections.OrderedDict()
_HANDLES_LOCK = threading.Lock()
_HANDLES_KEY_GROUPS = [0]
HANDLE_CACHE_KEY_GROUPS = 1 << 20


def _decoded_keyed_handle(d: dict[str, Any], version: int) -> KeyedStateHandle:
    """The handle of ``d`` (a keyed handle's JSON as a ``_metadata`` of ``version`` stores it, its file's path
    resolved): decoded and validated once (:data:`_HANDLES`), the same object after."""
    key = (version, _json_text(d))
    with _HANDLES_LOCK:
        found = _HANDLES.get(key)
        if found is not None:
            _HANDLES.move_to_end(key)
            return found
    handle = KeyedStateHandle.from_json(_expand_keyed(d) if version >= _COMPACT_VERSION else d)
    with _HANDLES_LOCK:
        if key not in _HANDLES:
            _HANDLES[key] = handle
            _HANDLES_KEY_GROUPS[0] += len(handle.key_group_range) + 1
            while _HANDLES_KEY_GROUPS[0] > HANDLE_CACHE_KEY_GROUPS and len(_HANDLES) > 1:
                _, old = _HANDLES.popitem(last=False)
                _HANDLES_KEY_GROUPS[0] -= len(old.key_group_range) + 1
    return handle


def decode_metadata(data: bytes, base: str, where: str) -> CheckpointMetadata:
    """:class:`CheckpointMetadata` from ``_metadata`` bytes read from directory ``base``; ``where`` names the file in
    errors. CorruptSnapshotError on anything but a well-formed, checksummed, known-version file."""
    if len(data) < _PREFIX.size + 4:
        raise CorruptSnapshotError(f"{where} is {len(data)} bytes long, too short for a _metadata file: truncated")
    magic, version, length = _PREFIX.unpack_from(data)
    if magic != METADATA_MAGIC:
        raise CorruptSnapshotError(f"{where} starts with {magic!r}, not the _metadata magic {METADATA_MAGIC!r}")
    if version not in (_LEGACY_VERSION, _UNSHARED_VERSION, _SHARED_VERSION, _RAW_KEYED_VERSION, _CHAINED_VERSION,
                       _COMPACT_VERSION, METADATA_VERSION):
        raise CorruptSnapshotError(f"{where} has format version {version}; this keygroups reads versions "
                                   f"{_LEGACY_VERSION} to {METADATA_VERSION} (written by a newer keygroups, or "
                                   f"corrupt)")
    if len(data) != _PREFIX.size + length + 4:
        raise CorruptSnapshotError(f"{where} declares a {length}-byte body but is {len(data)} bytes long: truncated "
                                   f"or corrupt")
    (stored,) = struct.unpack_from("<I", data, len(data) - 4)
    if stored != crc32c(data[:-4]):
        raise CorruptSnapshotError(f"{where} fails its CRC32C checksum: the file is corrupt")
    try:
        body = json.loads(data[_PREFIX.size:-4].decode("utf-8"))
        keyed = []
        for h in body["keyed_handles"]:
            h = dict(h, file=_keyed_file(h["file"], base, version))
            if version < _SHARED_VERSION:   # every file of format 1, full, written by this checkpoint
                start, end = h["key_group_range"]
                h.setdefault("checkpoint_id", body["checkpoint_id"])
                h.setdefault("format_version", 1)
                h.setdefault("full_key_groups", [[start, end]] if end >= start else [])
            keyed.append(_decoded_keyed_handle(h, version))
        operator = [OperatorStateHandle.from_json(dict(h, file=f"{base}/{check_relpath(h['file'])}"))
                    for h in body["operator_handles"]]
        properties = body["properties"]
        if version == _LEGACY_VERSION:
            outputs = _legacy_files(properties, "outputs", base)
            inputs = _legacy_files(properties, "inputs", base)
        else:
            outputs = [f"{base}/{check_relpath(f, 'an output file')}" for f in body["outputs"]]
            inputs = [f"{base}/{check_relpath(f, 'an input file')}" for f in body["inputs"]]
        # Absent before late outputs existed (same version: an older reader only loses track of late files).
        late = [f"{base}/{check_relpath(f, 'a late output file')}" for f in body.get("late_outputs", [])]
        raw = [RawKeyedStateHandle.from_json(dict(h, file=f"{base}/{check_relpath(h['file'])}"))
               for h in body.get("raw_keyed_handles", [])]
        md = CheckpointMetadata(
            checkpoint_id=body["checkpoint_id"], job_id=body["job_id"], timestamp_ms=body["timestamp_ms"],
            max_parallelism=body["max_parallelism"], parallelism=body["parallelism"], keyed_handles=keyed,
            operator_handles=operator, properties=properties, outputs=outputs, inputs=inputs,
            late_outputs=late, raw_keyed_handles=raw, base=base)
        md.validate()
    except CorruptSnapshotError:
        raise
    except (KeyError, TypeError, ValueError, UnicodeDecodeError, AttributeError, RecursionError, OverflowError) as e:
        raise CorruptSnapshotError(f"{where} passes its checksum but is not valid checkpoint metadata: {e}") from e
    return md
