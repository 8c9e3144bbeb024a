"""The keyed snapshot file format: one file per subtask, one checksummed block per key group, an index at the end.

Layout (little-endian integers; version :data:`FORMAT_VERSION`)::

    header   magic b"\\x89KGS" | u32 version | u32 first key group | u32 key-group count | u32 meta length
             | meta (UTF-8 JSON: {"file_id": "<32 hex digits>", "states": [...]}) | u32 CRC32C(header)
    blocks   for each key group of the range, ascending (empty ones too):
             u32 key group | u32 flags (bit 0: full, bit 1: linked) | u64 predecessor checkpoint id
             | u32 predecessor checksum | u32 section count
             | per section: u32 state index | u32 op (0 put, 1 delete) | u32 entry count n | n x u32 key length
                            | [n x u32 value length] | the n keys back to back | [the n values back to back]
                            (values for a put only)
             | u32 CRC32C(file id | block)
    index    u32 offset count (= key groups + 1) | u64 absolute offset of each block, then the end of the last one
             | u32 CRC32C(index)
    footer   u64 index position | magic b"KGSI"

A **full** block holds every entry of its key group; a **delta** block holds the entries written since the key
group's previous block (put sections) and the keys deleted since then (delete sections). A block applies its
sections in file order (puts, then deletes), and of equal keys in a section the last one counts. Every section's
keys are sorted by their bytes (the encoder sorts them), so a reader finds a key by binary search
(:func:`find_key`) without decoding the others.

Chains. Each file has a random 16-byte id (``file_id``, in its header and its handle), and a block's checksum is the
CRC32C of that id followed by the block: a block read from another file than the one written for it fails it, even
when the two files are byte for byte alike otherwise (a twin run's delta put in place of this run's). A delta block
that continues an earlier block is *linked*: it names that block (:class:`~keygroups.checkpoint.metadata.BlockLink`:
the checkpoint that wrote it and the checksum it stores), which :func:`write_keyed_snapshot` takes from
``predecessors``; its own checksum then covers its predecessor's, and so on down to the chain's full block. An empty
delta (nothing changed) names the block its chain ends with, so a file attests the end of every chain it continues,
and losing the file that holds a chain's newest block is refused like losing any other. The
handle repeats what the file says (``checksums`` per key group, ``predecessors`` of its linked blocks), so the
chains of a checkpoint are checked from its ``_metadata`` alone (at commit and when a restore is planned,
:func:`~keygroups.checkpoint.planning.chain_breaks`) and every ranged read against the handle before a byte of it is
used (:func:`read_key_groups`, :func:`read_key_group_offsets`; the read cache of a remote location is checked the
same way). The checks cost a CRC32C of the bytes read, which the block checksum costs anyway, and a comparison per
block: O(bytes read), never O(state).

Versions. 4 (written) adds the file id, the predecessor fields and the seeded checksum above; blocks of 4 are 12 bytes
longer than those of 3 (an empty one is 28 bytes). 3 (still read) has the layout of 2; its values use the little-endian
per-key value framing of ``keygroups.state._codec`` (a map value being a list of entries in the one map-entry framing).
2 (still read) framed values big-endian, a map entry as ``u32 key length | key | u32 value length | [i64 timestamp] |
value``: its blocks are rewritten into format 3's framing as they are read (``_native/framing.pyx``, ``upgrade_block``;
every old value has the size of its new form, so offsets hold), after their checksum is verified, so everything above
this module (restores, lazy heap layers, RocksDB ingestion, :func:`merged_key_groups`) sees one framing, even in a chain
whose older files are format 2. 1 (still read, likewise upgraded) had no flags and no ops: every block full, every
section a put, keys in any order.

Byte order and framing of every keygroups format. The rule: little-endian everywhere, big-endian only where byte
order is sort order; one map-entry framing, ``u32 key length | key | value`` with the value running to the end of
the entry (whatever holds the entry gives its length; ``_native/entryframe.pxd``).

* ``_metadata``: little-endian; magic | u32 version | u32 length | JSON | CRC32C. Written by
  ``metadata.encode_metadata``, read by ``decode_metadata``.
* Keyed snapshot file: little-endian; the layout above. Written by :class:`KeyedSnapshotWriter` (``_native/
  snapshot.pyx``: ``encode_header``, ``encode_block``, ``encode_index``), read by :func:`read_key_groups`,
  :func:`read_key_group_offsets`, :func:`open_snapshot` (``parse_header``, ``parse_block``, ``parse_block_offsets``,
  ``parse_index``).
* Per-key value framing (the values of keyed files and of RocksDB): little-endian since format 3 (big-endian in 1
  and 2, upgraded as read, see above). A value is ``[i64 timestamp |] value``; a list, frames ``u32 length | [i64
  timestamp] | element``; a map, such frames whose elements are entries. Written and read by
  ``state._codec.ValueFraming`` over ``_native/framing.pyx`` (``join_list``, ``join_map``, ``split_list``,
  ``split_map``, ``drop_expired``; ``upgrade_block`` for formats 1 and 2).
* Serialized keys in keyed blocks: the key serializer's bytes as they are, sorted by those bytes (memcmp order,
  ``_native/keysearch.pxd``) so that :func:`find_key` and the heap backend's ``Layer.find`` search them. The order
  only has to agree between the encoder's sort and the search, never with the keys' numeric order, so the key
  serialization stays as it is (little-endian for ints).
* Operator state file: little-endian; ``<4sHH`` header, each state's elements back to back, a broadcast map's
  element being one entry. Written by ``operator_format.write_operator_snapshot`` (entries by
  ``splitter.encode_entries``), read by ``read_operator_runs`` (``splitter.decode_entries``).
* Serializer formats: little-endian; ``_native/codec.pyx`` (``_value_format.pxi``, ``_typed_codecs.pxi``): u32
  lengths and counts; a dict *value* is a u32 count and its (key, value) pairs sorted by key bytes, each part
  self-delimiting (a serialized value, not a map state's entries). Written and read by ``serializers`` through
  ``codec.Codec``.
* Partitioned log: little-endian; ``<4sHHI`` header and CRC, records ``u32 CRC32C | u32 length | payload``.
  Written by ``sources.log``, read by ``_native/logframes.scan_frames``.
* RocksDB keys: **big-endian**, ``u16 key group | u16 state id | u32 key length | key [| user key]``: RocksDB orders
  keys bytewise, so one key group is one contiguous range and its rows one ordered scan (``state/rocksdb.py``).
* RocksDB values: a state's framed value; a map keeps one row per entry, the user key in the database key and
  ``[i64 timestamp |] value`` (little-endian) as the row's value (``ValueFraming.map_rows``, ``map_from_rows``).

No keygroups format follows a Java (Flink) serializer's byte layout: Flink compatibility is in the key-group
arithmetic and the hashes (``_native/hashing.pyx``, ``kg_hash.h``), which compute on values, not on stored bytes.

The offsets are also returned by :meth:`KeyedSnapshotWriter.finish` and kept in the
:class:`~keygroups.checkpoint.KeyedStateHandle` (with the state meta, the full key groups and the format version),
so a restoring subtask reads exactly the contiguous bytes of the key groups it owns, in one ranged read, without the
header or the index. :func:`open_snapshot` reads a whole file standalone (header and index included), for tools and
for checking.

Keys and values are opaque bytes (serialized by the state layer); they come back as ``memoryview`` slices of the
read buffer, so nothing is deserialized or copied until the state layer touches a value (or, on request, as bytes
copies, or as int64 offset arrays for a serializer's ``deserialize_many``: a section's keys are contiguous, as are
its values). Every block is verified (CRC32C, key group, structure, key order) by the compiled parser in
``_native/snapshot.pyx`` before any of it is returned.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
from crc32c import crc32c

from keygroups._native import framing as _framing
from keygroups._native import snapshot as _snap
from keygroups._ranges import KeyGroupRange
from keygroups.checkpoint.metadata import NOT_RECORDED, BlockLink, BlockLinks, KeyedStateHandle, key_group_runs
from keygroups.errors import CorruptSnapshotError

if TYPE_CHECKING:
    from keygroups.checkpoint.storage import CheckpointStorage

FORMAT_VERSION: int = _snap.FORMAT_VERSION
FILE_MAGIC: bytes = _snap.FILE_MAGIC

#: n serialized items back to back (``Packed(data, offsets)``, item i = ``data[offsets[i]:offsets[i + 1]]``), as a
#: serializer's ``serialize_many`` returns them; the writer takes it in place of a list of n bytes objects.
Packed = _snap.Packed

#: ``find_key(block, key_offsets, key) -> int``: the index of ``key`` among a sorted section's keys (the last of
#: equal ones), -1 if absent; a binary search over the raw bytes that never reads outside ``block``.
find_key = _snap.find_key

#: A put section as a block parses into: ``(state_index, keys, values)`` (memoryviews or bytes, or int64 offsets).
PutSection = tuple[int, Any, Any]
#: A delete section: ``(state_index, keys)``.
DeleteSection = tuple[int, Any]


_LINK = struct.Struct("<IQI")   # a format-4 block's flags and predecessor fields, from byte 4


class KeyGroupBlock:
    """One key group's block as read: ``key_group``; ``full`` (every entry of the key group, else the changes since
    its previous block); ``sorted`` (keys of every section sorted by bytes, so :func:`find_key` works: formats 2 to 4;
    format 1 blocks are not); ``block`` (a memoryview of the block's bytes); ``puts``, ``[(state_index, keys,
    values), ...]``, and ``deletes``, ``[(state_index, keys), ...]``, in file order (apply puts, then deletes);
    ``predecessor``, the :class:`~keygroups.checkpoint.metadata.BlockLink` a linked delta block names (None
    otherwise, and before format 4).

    Keys and values are memoryviews or bytes (:func:`read_key_groups`) or int64 arrays of n + 1 offsets into
    ``block`` (:func:`read_key_group_offsets`)."""

    __slots__ = ("key_group", "full", "sorted", "block", "puts", "deletes", "predecessor")

    def __init__(self, key_group: int, full: bool, sorted: bool, block: memoryview, puts: list[PutSection],
                 deletes: list[DeleteSection], predecessor: BlockLink | None = None) -> None:
        self.key_group = key_group
        self.full = full
        self.sorted = sorted
        self.block = block
        self.puts = puts
        self.deletes = deletes
        self.predecessor = predecessor

    def __repr__(self) -> str:
        kind = "full" if self.full else "delta"
        return (f"KeyGroupBlock({self.key_group}, {kind}, {len(self.block)} bytes, {len(self.puts)} put and "
                f"{len(self.deletes)} delete sections)")


def _old_framings(states: Sequence[dict[str, Any]], version: int) -> list[int] | None:
    """For a file of format 1 or 2, the framing code of each state's values (``_native/framing.pyx``), so that its
    blocks are read in format 3's framing; None when no value needs rewriting (format 3, or plain values only)."""
    if version >= 3:
        return None
    codes = [_FRAMING_KINDS.get(s.get("kind"), _framing.VALUE) | (_framing.TTL if s.get("ttl") is not None else 0)
             for s in states]
    return codes if any(codes) else None


_FRAMING_KINDS = {"list": _framing.LIST, "map": _framing.MAP}


def _named_predecessor(mv: memoryview, version: int) -> BlockLink | None:
    """The block a (structurally checked) format-4 block names as its predecessor, None if it is not linked."""
    if version < _snap.FORMAT_VERSION:
        return None
    flags, checkpoint_id, checksum = _LINK.unpack_from(mv, 4)
    return BlockLink(checkpoint_id, checksum) if flags & _snap.BLOCK_LINKED else None


def _block(mv: memoryview, key_group: int, n_states: int, version: int, copy: bool,
           old_framings: list[int] | None, seed: int, verify: bool = True) -> KeyGroupBlock:
    if old_framings is None:
        flags, puts, deletes = _snap.parse_block(mv, key_group, n_states, verify, copy, version, seed)
        return KeyGroupBlock(key_group, bool(flags & _snap.BLOCK_FULL), version >= 2, mv, puts, deletes,
                             _named_predecessor(mv, version))
    # checked as it is (CRC included) first, then parsed again from the rewritten copy, whose CRC no longer matches
    upgraded = _offsets_block(mv, key_group, n_states, version, old_framings, seed, verify).block
    flags, puts, deletes = _snap.parse_block(upgraded, key_group, n_states, False, copy, version)
    return KeyGroupBlock(key_group, bool(flags & _snap.BLOCK_FULL), version >= 2, upgraded, puts, deletes)


def _offsets_block(mv: memoryview, key_group: int, n_states: int, version: int,
                   old_framings: list[int] | None, seed: int, verify: bool = True) -> KeyGroupBlock:
    flags, puts, deletes = _snap.parse_block_offsets(mv, key_group, n_states, verify, version, seed)
    predecessor = _named_predecessor(mv, version)
    if old_framings is not None:
        mv = memoryview(_framing.upgrade_block(mv, puts, old_framings))
    return KeyGroupBlock(key_group, bool(flags & _snap.BLOCK_FULL), version >= 2, mv, puts, deletes, predecessor)


def new_file_id() -> bytes:
    """A new file's id: 16 random bytes (a module function so that a test can make two writes' ids equal)."""
    return os.urandom(16)


def _link_arrays(links: Mapping[int, Any], key_group_range: KeyGroupRange) -> tuple[Any, Any]:
    """``(checkpoints, checksums)``: int64 arrays over ``key_group_range`` of the links ``links`` (key group ->
    ``(checkpoint id, checksum)``) names for its key groups (-1 and 0 where it names none; key groups outside the
    range are not this file's and are left out). ValueError naming a link that is not a checkpoint id >= 0 and a
    u32 checksum."""
    n, start = len(key_group_range), key_group_range.start
    if isinstance(links, BlockLinks) and links.start == start and len(links.checkpoints) == n:
        return links.checkpoints.copy(), np.where(links.checkpoints >= 0, links.checksums, 0)
    checkpoints, checksums = np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64)
    if not links:
        return checkpoints, checksums
    try:
        kgs = np.fromiter(links.keys(), dtype=np.int64, count=len(links))
        pairs = np.array([tuple(v) for v in links.values()], dtype=np.int64).reshape(len(links), 2)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"predecessors must map key groups to (checkpoint id, u32 checksum) links: {e}") from None
    bad = (pairs[:, 0] < 0) | (pairs[:, 1] < 0) | (pairs[:, 1] > 0xFFFFFFFF)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"predecessor of key group {int(kgs[i])} must be (checkpoint id >= 0, u32 checksum), got "
                         f"{tuple(pairs[i].tolist())}")
    inside = (kgs >= start) & (kgs < start + n)
    checkpoints[kgs[inside] - start] = pairs[inside, 0]
    checksums[kgs[inside] - start] = pairs[inside, 1]
    return checkpoints, checksums


class KeyedSnapshotWriter:
    """Writes one keyed snapshot file to ``stream`` (the header at once; blocks as key groups are given).

    ``states`` is the per-state meta (name, kind, serializer snapshots by role, TTL) as a JSON list; a section's
    ``state_index`` indexes it. Offsets are absolute positions in the stream (``stream.tell()`` at construction is
    taken as the start, 0 if the stream cannot tell). A key group never written gets an empty block, full unless
    ``default_full`` is False (a delta file's untouched key groups are empty deltas: nothing changed) or, given as
    a collection of key groups, full for those only. The stream is not closed.

    The empty blocks of a run of untouched key groups are encoded in one compiled call (``encode_empty_blocks``,
    the same bytes as a block each), and the links blocks name are kept as arrays: a delta file of a large range
    costs its few changed key groups plus a few microseconds per untouched one.

    ``file_id`` (16 bytes; random by default) is the file's id, which every block's checksum covers: the handle
    names it (:attr:`file_id`, :attr:`checksums`, :attr:`predecessors` give what it records). ``predecessors`` maps
    a key group to the block its delta continues: the empty delta block of a key group never written names it
    (:meth:`write_key_group` takes a written block's own)."""

    def __init__(self, stream: BinaryIO, key_group_range: KeyGroupRange, states: list[dict[str, Any]], *,
                 default_full: bool | Collection[int] = True, file_id: bytes | None = None,
                 predecessors: Mapping[int, BlockLink] | None = None) -> None:
        if not isinstance(key_group_range, KeyGroupRange):
            raise TypeError(f"key_group_range must be a KeyGroupRange, got {type(key_group_range).__name__}")
        if not isinstance(states, list) or not all(isinstance(s, dict) for s in states):
            raise TypeError("states must be a list of JSON dicts (one per state: name, kind, serializers, ttl)")
        if file_id is None:
            file_id = new_file_id()
        if not isinstance(file_id, bytes) or len(file_id) != 16:
            raise TypeError(f"file_id must be 16 bytes, got {file_id!r:.60}")
        try:
            meta = json.dumps({"file_id": file_id.hex(), "states": states}, sort_keys=True, separators=(",", ":"),
                              allow_nan=False, ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise TypeError(f"states must be plain JSON: {e}") from e
        self._stream = stream
        self._range = key_group_range
        self._n_states = len(states)
        self._default_full: bool | Collection[int] = (
            default_full if isinstance(default_full, bool) else frozenset(default_full))
        self._full: list[int] = []
        self._file_id = file_id.hex()
        self._seed = crc32c(file_id)
        self._checksums: list[int] = []
        # the links the blocks written name (-1: none), and those ``predecessors`` gives, per key group of the range
        self._link_checkpoints = np.full(len(key_group_range), -1, dtype=np.int64)
        self._link_checksums = np.zeros(len(key_group_range), dtype=np.int64)
        self._given_checkpoints, self._given_checksums = _link_arrays(predecessors or {}, key_group_range)
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

    def _write_block(self, block: bytes) -> None:
        self._write(block)
        self._offsets.append(self._pos)
        self._checksums.append(int.from_bytes(block[-4:], "little"))

    def _write_empty(self, stop: int) -> None:
        """Empty blocks (full as ``default_full`` says) for the key groups from ``self._next`` to ``stop`` - 1, each
        run of equally full ones in one compiled call (``encode_empty_blocks``): a delta file of a large range is
        mostly such blocks."""
        default, kg = self._default_full, self._next
        while kg < stop:
            full = default if isinstance(default, bool) else kg in default
            end = stop if isinstance(default, bool) else kg + 1
            while end < stop and (end in default) == full:   # type: ignore[operator]
                end += 1
            n = end - kg
            lo, hi = kg - self._range.start, end - self._range.start
            if full:
                checkpoints, checksums = np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64)
            else:
                checkpoints, checksums = self._given_checkpoints[lo:hi], self._given_checksums[lo:hi]
                self._link_checkpoints[lo:hi] = checkpoints
                self._link_checksums[lo:hi] = checksums
            data, stored = _snap.encode_empty_blocks(kg, full, checkpoints, checksums, self._seed)
            self._write(data)
            self._offsets.extend(range(self._pos - len(data) + _snap.BLOCK_OVERHEAD, self._pos + 1,
                                       _snap.BLOCK_OVERHEAD))
            self._checksums.extend(stored.tolist())
            if full:
                self._full.extend(range(kg, end))
            kg = end

    def write_key_group(self, key_group: int,
                        sections: Iterable[tuple[int, Sequence[bytes] | Packed, Sequence[bytes] | Packed]], *,
                        full: bool = True,
                        deletes: Iterable[tuple[int, Sequence[bytes] | Packed]] = (),
                        predecessor: BlockLink | tuple[int, int] | None = None) -> None:
        """Write ``key_group``'s block: ``sections`` are ``(state_index, serialized keys, serialized values)``;
        keys or values may also be a :data:`Packed` (``serialize_many``'s output), which avoids n bytes objects.
        ``full=False`` writes a delta block: ``sections`` are the entries written since the key group's previous
        block and ``deletes``, ``(state_index, serialized keys)``, the keys deleted since then. Keys need not be
        sorted: the encoder sorts them. ``predecessor`` is the block such a delta continues (the checkpoint that
        wrote it and its checksum); a delta without one applies to no earlier block.

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
        # bad input fails before any write
        block = _snap.encode_block(key_group, sections, self._n_states, full=full, deletes=deletes,
                                   predecessor=None if predecessor is None else (predecessor[0], predecessor[1]),
                                   file_seed=self._seed)
        self._write_empty(key_group)
        self._write_block(block)
        if full:
            self._full.append(key_group)
        elif predecessor is not None:
            i = key_group - self._range.start
            self._link_checkpoints[i], self._link_checksums[i] = predecessor[0], predecessor[1]
        self._next = key_group + 1

    @property
    def file_id(self) -> str:
        """The file's id as 32 hex digits (every block's checksum covers it)."""
        return self._file_id

    @property
    def checksums(self) -> list[int]:
        """The checksum each block written so far stores, in key-group order (all of them after :meth:`finish`)."""
        return list(self._checksums)

    @property
    def predecessors(self) -> BlockLinks:
        """Key group -> the block its linked delta block names, for the blocks written so far (a mapping held as
        arrays, one link per key group of the range)."""
        return BlockLinks(self._range.start, self._link_checkpoints.copy(), self._link_checksums.copy())

    @property
    def full_key_groups(self) -> list[KeyGroupRange]:
        """The key groups written so far whose block is full, as ascending ranges (for the handle)."""
        return key_group_runs(self._full)

    def finish(self) -> tuple[list[int], int]:
        """Write empty blocks for the remaining key groups, the index and the footer; flush. Returns
        ``(offsets, file size)``: ``len(range) + 1`` absolute offsets, for the :class:`KeyedStateHandle`."""
        if self._finished:
            raise ValueError("finish() called twice")
        self._write_empty(self._range.end + 1)
        self._next = self._range.end + 1
        self._write(_snap.encode_index(self._offsets))
        self._finished = True
        flush = getattr(self._stream, "flush", None)
        if flush is not None:
            flush()
        return list(self._offsets), self._pos


def _iter_blocks(data: memoryview, base: int, offsets: Sequence[int], first_index: int, groups: KeyGroupRange,
                 states: Sequence[dict[str, Any]], version: int, copy: bool, seed: int,
                 verify: bool = True) -> Iterator[KeyGroupBlock]:
    # offsets[first_index + i] is key group groups.start + i's block start; ``data`` starts at file offset ``base``.
    old_framings = _old_framings(states, version)
    for i, kg in enumerate(groups):
        a = offsets[first_index + i] - base
        b = offsets[first_index + i + 1] - base
        yield _block(data[a:b], kg, len(states), version, copy, old_framings, seed, verify)


def _hex(checksum: int | None) -> str:
    return "none" if checksum is None else f"{checksum:#010x}"


def check_blocks(handle: KeyedStateHandle, data: Any, key_groups: KeyGroupRange) -> None:
    """Check the bytes of ``key_groups`` (a part of ``handle.key_group_range``) read from ``handle.file`` with one
    ranged read (``data``: exactly ``handle.byte_range(key_groups)``) against the handle, before any of it is used:
    each block's CRC32C (in format 4, of the file's id and the block) and, where the handle records them, the
    checksum the block stores and the block it names as its predecessor. A cost of one CRC32C pass over the bytes.

    CorruptSnapshotError naming the key group, the file, the checkpoint that wrote it and what was expected: a short
    read, a block that stores another checksum than the handle names (the file was replaced, say by a twin run's
    file of the same layout), a block that fails its checksum (corrupt bytes, or a block written for another file),
    or a delta that names another predecessor than its handle."""
    start, end = handle.byte_range(key_groups)
    where = f"keyed state file {handle.file!r} (subtask {handle.subtask}, written by checkpoint {handle.checkpoint_id})"
    if len(data) != end - start:
        raise CorruptSnapshotError(f"{where} is truncated: bytes [{start}, {end}) of key groups {key_groups} gave "
                                   f"only {len(data)} bytes")
    mv = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    version = handle.format_version
    minimum = _snap.BLOCK_OVERHEADS[version]
    seed = handle.crc_seed if version >= _snap.FORMAT_VERSION else 0
    checksums, offsets, first = handle.checksums, handle.offsets, key_groups.start - handle.key_group_range.start
    for i, kg in enumerate(key_groups):
        a, b = offsets[first + i] - start, offsets[first + i + 1] - start
        if b - a < minimum:
            raise CorruptSnapshotError(f"{where}: the block of key group {kg} is {b - a} bytes long, shorter than the "
                                       f"{minimum}-byte minimum of keyed format {version}: the handle's offsets or "
                                       "the file are corrupt")
        stored = int.from_bytes(mv[b - 4:b], "little")
        expected = None if checksums is None else checksums[first + i]
        if expected == NOT_RECORDED:   # a quiet block of a handle read from _metadata version 7
            expected = None
        if expected is not None and stored != expected:
            raise CorruptSnapshotError(f"{where}: the block of key group {kg} stores checksum {_hex(stored)}, the "
                                       f"checkpoint's handle names {_hex(expected)}: the file is not the one the "
                                       "checkpoint wrote (replaced by another of the same layout, of another run "
                                       "or attempt of this job?), or it is corrupt")
        if crc32c(mv[a:b - 4], seed) != stored:
            raise CorruptSnapshotError(
                f"{where}: the block of key group {kg} fails its CRC32C checksum ({b - a} bytes): the file is corrupt"
                + (f", or the block was written for another file (its checksum covers the id {handle.file_id} of the "
                   "file it was written for)" if seed else ""))
        if version >= _snap.FORMAT_VERSION:
            named = _named_predecessor(mv[a:b], version)
            if named is not None and named != handle.predecessor(kg) and expected is not None:
                raise CorruptSnapshotError(
                    f"{where}: the delta block of key group {kg} applies on {named}, but the checkpoint's handle "
                    f"says it applies on {handle.predecessor(kg) or 'no earlier block'}")


def _ranged_read(storage: CheckpointStorage, handle: KeyedStateHandle, wanted: KeyGroupRange) -> tuple[bytes, int, int]:
    start, end = handle.byte_range(wanted)
    try:
        data = storage.read_bytes(handle.file, start, end, verify=lambda got: check_blocks(handle, got, wanted))
    except FileNotFoundError:
        raise CorruptSnapshotError(f"keyed state file {handle.file!r} of subtask {handle.subtask} (written by "
                                   f"checkpoint {handle.checkpoint_id}) is missing from {storage.location}") from None
    return data, start, end


def _read_wanted(storage: CheckpointStorage, handle: KeyedStateHandle, key_groups: KeyGroupRange
                 ) -> tuple[Any, int, int, int, KeyGroupRange] | None:
    """The one ranged read of the handle's key groups that ``key_groups`` asks for, checked against the handle
    (:func:`check_blocks`): (data, start, end, index of the first wanted group in the handle, the wanted range), or
    None when the handle holds none of them."""
    if not isinstance(handle, KeyedStateHandle):
        raise TypeError(f"handle must be a KeyedStateHandle, got {type(handle).__name__}")
    wanted = handle.key_group_range.intersection(key_groups)
    if not wanted:
        return None
    data, start, end = _ranged_read(storage, handle, wanted)
    return data, start, end, wanted.start - handle.key_group_range.start, wanted


def _naming_the_file(blocks: Iterator[KeyGroupBlock], handle: KeyedStateHandle) -> Iterator[KeyGroupBlock]:
    """``blocks``, a damaged one raising CorruptSnapshotError that names the file it came from."""
    try:
        yield from blocks
    except CorruptSnapshotError as e:
        raise CorruptSnapshotError(f"keyed state file {handle.file!r} (subtask {handle.subtask}, checkpoint "
                                   f"{handle.checkpoint_id}): {e}") from e


def read_key_groups(storage: CheckpointStorage, handle: KeyedStateHandle, key_groups: KeyGroupRange, *,
                    copy: bool = False) -> tuple[Iterator[KeyGroupBlock], int]:
    """Read the blocks of ``key_groups ∩ handle.key_group_range`` from ``handle.file`` with ONE ranged read.

    Returns ``(blocks, bytes_read)``: ``blocks`` yields a :class:`KeyGroupBlock` per key group, in key-group order,
    keys and values as memoryview slices of the bytes read. The bytes are checked against the handle before this
    returns (:func:`check_blocks`: checksums, the file's id, predecessors), each block's structure as it is yielded.
    A missing or short file, or a damaged or foreign block, raises CorruptSnapshotError naming the file.

    ``copy=True`` yields ``bytes`` copies instead of memoryviews: still not deserialized, about 3x faster to create
    and about 3x smaller to hold for small values (a memoryview object alone is ~180 bytes), and they do not pin
    the read buffer. Prefer it for keys and small values that are kept for a long time."""
    read = _read_wanted(storage, handle, key_groups)
    if read is None:
        return iter(()), 0
    data, start, end, first, wanted = read
    blocks = _iter_blocks(memoryview(data), start, handle.offsets, first, wanted, handle.states,
                          handle.format_version, copy, handle.crc_seed, verify=False)
    return _naming_the_file(blocks, handle), end - start


def read_key_group_offsets(storage: CheckpointStorage, handle: KeyedStateHandle, key_groups: KeyGroupRange
                           ) -> tuple[Iterator[KeyGroupBlock], int]:
    """As :func:`read_key_groups` (one ranged read, checked against the handle, every block's structure checked),
    but without one object per entry: each :class:`KeyGroupBlock`'s sections hold int64 arrays of n + 1 offsets
    into its ``block`` (a memoryview of the key group's bytes): ``puts`` ``[(state_index, key_offsets,
    value_offsets), ...]``, ``deletes`` ``[(state_index, key_offsets), ...]``. Keys are contiguous in the block, as
    are values, so ``serializer.deserialize_many(block, key_offsets)`` decodes a state's keys in one call, a lazy
    backend can keep ``(block, value_offsets)`` instead of n value objects, and :func:`find_key` finds one key in a
    sorted block."""
    read = _read_wanted(storage, handle, key_groups)
    if read is None:
        return iter(()), 0
    data, start, end, first, wanted = read
    n_states = len(handle.states)
    version = handle.format_version
    old_framings = _old_framings(handle.states, version)

    def blocks() -> Iterator[KeyGroupBlock]:
        mv = memoryview(data)
        for i, kg in enumerate(wanted):
            block = mv[handle.offsets[first + i] - start:handle.offsets[first + i + 1] - start]
            yield _offsets_block(block, kg, n_states, version, old_framings, 0, verify=False)   # checked on read

    return _naming_the_file(blocks(), handle), end - start


@dataclass
class SnapshotFile:
    """A whole keyed snapshot file opened standalone (header and index read from the file itself); ``file_id`` is
    the id in its header (format 4; None before)."""

    buffer: Any
    version: int
    key_group_range: KeyGroupRange
    states: list[dict[str, Any]]
    offsets: list[int]
    file_id: str | None = None

    def key_groups(self, key_groups: KeyGroupRange | None = None, *,
                   copy: bool = False) -> Iterator[KeyGroupBlock]:
        """Yield a :class:`KeyGroupBlock` for each of ``key_groups`` (all of the file's by default), each block
        checked (its checksum with the file's id of the header); ``copy`` as in :func:`read_key_groups`."""
        wanted = self.key_group_range if key_groups is None else self.key_group_range.intersection(key_groups)
        if not wanted:
            return iter(())
        first = wanted.start - self.key_group_range.start
        seed = crc32c(bytes.fromhex(self.file_id)) if self.file_id is not None else 0
        return _iter_blocks(memoryview(self.buffer).cast("B"), 0, self.offsets, first, wanted, self.states,
                            self.version, copy, seed)

    def checksums(self) -> list[int]:
        """The checksum each block stores (its last four bytes), in key-group order, as a handle names them."""
        mv = memoryview(self.buffer).cast("B")
        return [int.from_bytes(mv[end - 4:end], "little") for end in self.offsets[1:]]


def open_snapshot(buffer: Any) -> SnapshotFile:
    """Open a whole keyed snapshot file held in ``buffer`` (bytes, mmap, ``storage.open_buffer(...)``): checks
    the magic, version, header and index checksums and the offsets. CorruptSnapshotError otherwise."""
    version, first, count, meta, header_size = _snap.parse_header(buffer)
    try:
        header = json.loads(meta.decode("utf-8"))
        states = header["states"]
        if not isinstance(states, list) or not all(isinstance(s, dict) for s in states):
            raise TypeError("'states' is not a list of dicts")
        file_id = header.get("file_id")
        if version >= _snap.FORMAT_VERSION and (not isinstance(file_id, str) or len(file_id) != 32
                                                or file_id != file_id.lower() or bytes.fromhex(file_id) is None):
            raise TypeError(f"the 'file_id' of a format-{version} file must be 32 hex digits, got {file_id!r:.60}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptSnapshotError(f"the snapshot header's state meta passes its checksum but is not valid: {e}") from e
    offsets = _snap.parse_index(buffer, header_size, count)
    kgr = KeyGroupRange(first, first + count - 1) if count else KeyGroupRange.empty()
    return SnapshotFile(buffer=buffer, version=version, key_group_range=kgr, states=states, offsets=offsets,
                        file_id=file_id if version >= _snap.FORMAT_VERSION else None)


def write_keyed_snapshot(storage: CheckpointStorage, checkpoint_id: int, subtask: int,
                         key_group_range: KeyGroupRange, states: list[dict[str, Any]],
                         key_groups: Iterable[tuple[int, Iterable[tuple[int, Any, Any]]]
                                              | tuple[int, Iterable[tuple[int, Any, Any]], Iterable[tuple[int, Any]]]],
                         *, full_key_groups: Collection[int] | None = None, prefix: str | None = None,
                         on_key_group: Callable[[], object] | None = None,
                         fresh_key_groups: Collection[int] = (),
                         predecessors: Mapping[int, BlockLink] | None = None) -> KeyedStateHandle:
    """Write a whole keyed snapshot file for checkpoint ``checkpoint_id`` and return its handle: the one-call form
    of ``new_shared_file`` + ``open_write`` + :class:`KeyedSnapshotWriter`. ``key_groups`` yields
    ``(key_group, sections)`` or ``(key_group, sections, deletes)`` in ascending key-group order.

    ``full_key_groups`` are the key groups written full (None: all of them, a full snapshot); the others are delta
    blocks, and key groups not yielded get empty blocks, full or delta as ``full_key_groups`` says. A delta block
    changes the key group's previous block, which every checkpoint that lists this file must list too, unless its
    key group is in ``fresh_key_groups`` (it had no state: the delta applies to nothing). The file is named
    ``shared/<prefix or "keyed-<subtask>">-<id>-<uuid>``: later checkpoints may reference it.

    ``predecessors`` maps a key group to the block its delta changes (a
    :class:`~keygroups.checkpoint.metadata.BlockLink`: :func:`~keygroups.checkpoint.planning.chain_tips` of the
    checkpoint the writer restored, or a backend's chain tips): each delta block names it, an empty one too (the
    block its chain ends with), and so does the handle, so that a chain that lacks a delta or holds a foreign one is
    refused. Given, every non-empty delta of a key group that is not fresh must have one (ValueError otherwise,
    before the file is finished). None: the deltas name no predecessor (the caller may still name them on the
    handle; a checkpoint refuses a format-4 delta that names none in the middle of a chain).

    ``on_key_group`` is called before each key group is written and once more before the file is finished; an
    exception it raises abandons the file (a cancelled snapshot stops this way) and propagates."""
    relpath = storage.new_shared_file(checkpoint_id, prefix or f"keyed-{subtask}")
    full = None if full_key_groups is None else frozenset(full_key_groups)
    return _write_file(storage, relpath, checkpoint_id, subtask, key_group_range, states, key_groups, full,
                       on_key_group, fresh_key_groups, predecessors)


def write_full_snapshot(storage: CheckpointStorage, relpath: str, checkpoint_id: int, subtask: int,
                        key_group_range: KeyGroupRange, states: list[dict[str, Any]],
                        key_groups: Iterable[tuple[int, Iterable[tuple[int, Any, Any]]]]) -> KeyedStateHandle:
    """Write a full keyed snapshot file at ``relpath`` (a savepoint's, which lives in its own directory) and return
    its handle; ``key_groups`` as in :func:`write_keyed_snapshot`, puts only."""
    return _write_file(storage, relpath, checkpoint_id, subtask, key_group_range, states, key_groups, None, None)


def _write_file(storage: CheckpointStorage, relpath: str, checkpoint_id: int, subtask: int,
                key_group_range: KeyGroupRange, states: list[dict[str, Any]], key_groups: Iterable[Any],
                full: frozenset[int] | None, on_key_group: Callable[[], object] | None,
                fresh_key_groups: Collection[int] = (),
                predecessors: Mapping[int, BlockLink] | None = None) -> KeyedStateHandle:
    fresh_set = frozenset(kg for kg in fresh_key_groups if kg in key_group_range and not (full is None or kg in full))
    if predecessors is not None:
        both = sorted(fresh_set & set(predecessors))
        if both:
            raise ValueError(f"key groups {both} are fresh (their deltas apply to no earlier block) yet predecessors "
                             f"names a block for them")
    with storage.open_write(relpath) as stream:
        writer = KeyedSnapshotWriter(stream, key_group_range, states, default_full=True if full is None else full,
                                     predecessors=None if predecessors is None else
                                     {kg: p for kg, p in predecessors.items() if kg not in fresh_set})
        for item in key_groups:
            if on_key_group is not None:
                on_key_group()
            kg, sections = item[0], item[1]
            deletes = item[2] if len(item) > 2 else ()
            is_full = full is None or kg in full
            predecessor = None if is_full or predecessors is None else predecessors.get(kg)
            writer.write_key_group(kg, sections, full=is_full, deletes=deletes, predecessor=predecessor)
            if (predecessor is None and predecessors is not None and not is_full and kg not in fresh_set
                    and writer._offsets[-1] - writer._offsets[-2] > _snap.BLOCK_OVERHEAD):
                raise ValueError(f"the delta block of key group {kg} (checkpoint {checkpoint_id}, subtask {subtask}) "
                                 f"changes an earlier block, but predecessors names none: a delta must name the block "
                                 f"it applies on (or its key group be fresh)")
        if on_key_group is not None:
            on_key_group()
        offsets, size = writer.finish()
    return KeyedStateHandle(file=relpath, subtask=subtask, key_group_range=key_group_range, offsets=offsets,
                            size=size, states=states, checkpoint_id=checkpoint_id,
                            full_key_groups=writer.full_key_groups, fresh_key_groups=key_group_runs(fresh_set),
                            file_id=writer.file_id, checksums=writer.checksums, predecessors=writer.predecessors)


def merged_key_groups(storage: CheckpointStorage, plan: Sequence[tuple[KeyedStateHandle, KeyGroupRange]],
                      key_groups: KeyGroupRange
                      ) -> tuple[list[dict[str, Any]], Iterator[tuple[int, list[tuple[int, list[bytes], list[bytes]]]]]]:
    """Each key group's chain merged into one full block's sections, bytes in, bytes out: ``plan`` is
    :func:`~keygroups.checkpoint.planning.plan_keyed_restore`'s (chain order) for ``key_groups``. A full block
    starts a key group anew, a put replaces a key's value, a delete removes the key (keys compare as serialized
    bytes). Returns ``(states, key groups)`` for :func:`write_full_snapshot`: the states by name (the meta of the
    newest file that has each) and ``(key_group, [(state_index, keys, values), ...])`` ascending. Reads every
    block of the plan first (one ranged read per entry): it holds one subtask's chains in memory.

    ValueError if one state has different metas in different key groups' chains (then restore it with a backend,
    which migrates it, and snapshot that instead)."""
    blocks: dict[int, list[tuple[KeyedStateHandle, KeyGroupBlock]]] = {}
    metas: dict[str, dict[str, Any]] = {}
    for handle, part in plan:
        read, _ = read_key_groups(storage, handle, part.intersection(key_groups), copy=True)
        for block in read:
            blocks.setdefault(block.key_group, []).append((handle, block))
        for meta in handle.states:
            known = metas.setdefault(meta["name"], meta)
            if known != meta:
                raise ValueError(f"state {meta['name']!r} has different metas (serializers, TTL) in the chains of "
                                 f"different key groups (see {handle.file!r}): it cannot be merged as bytes; restore "
                                 f"the checkpoint with a backend and snapshot that instead")
    names = list(metas)
    index = {name: i for i, name in enumerate(names)}

    def merged() -> Iterator[tuple[int, list[tuple[int, list[bytes], list[bytes]]]]]:
        for kg in sorted(blocks):
            entries: dict[str, dict[bytes, bytes]] = {}
            for handle, block in blocks[kg]:
                if block.full:
                    entries = {}
                for state_index, keys, values in block.puts:
                    entries.setdefault(handle.states[state_index]["name"], {}).update(zip(keys, values))
                for state_index, keys in block.deletes:
                    state = entries.get(handle.states[state_index]["name"], {})
                    for k in keys:
                        state.pop(k, None)
            yield kg, [(index[name], list(e), list(e.values())) for name, e in entries.items() if e]

    return [metas[n] for n in names], merged()
