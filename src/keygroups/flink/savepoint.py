"""``read_savepoint``: a Flink canonical savepoint (or aligned full checkpoint) as Python values and Arrow batches.

The savepoint's operators are listed from ``_metadata``; an operator's keyed state is read one key group at a time
(each subtask's stream is read by ranges: only one key group's block is in memory), its operator state per subtask.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
from collections.abc import Iterator
from typing import Any

import fsspec
import mmh3
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import get_protocol

from keygroups._native import flinkin
from keygroups._ranges import KeyGroupRange
from keygroups.errors import CheckpointNotFoundError, CorruptSnapshotError, KeyGroupsError
from keygroups.flink._cursor import Cursor, plain, shown
from keygroups.flink.keyed import (
    KeyedBackendHeader,
    StateMetaInfoSnapshot,
    decode_key,
    decode_list_value,
    decode_value,
    key_group_prefix_bytes,
    list_element_type,
    map_value_type,
    read_block,
    read_keyed_header,
    timer_type,
)
from keygroups.flink.metadata import (
    ByteStreamStateHandle,
    CheckpointMetadata,
    FileStateHandle,
    KeyGroupsStateHandle,
    OperatorState,
    OperatorStreamStateHandle,
    RelativeFileStateHandle,
    StreamStateHandle,
    read_metadata,
)
from keygroups.flink.operator import OperatorBackendHeader, read_broadcast, read_elements, read_operator_header
from keygroups.flink.types import (
    FlinkType,
    ListType,
    MapType,
    NullableType,
    RowType,
    TimeWindowType,
    TtlType,
    TtlValue,
    TupleType,
    VoidNamespaceType,
)

log = logging.getLogger("keygroups.flink")


def operator_id_for_uid(uid: str) -> bytes:
    """The 16-byte ``OperatorID`` Flink derives from a user-given uid (``StreamGraphHasherV2``: murmur3 x64 128,
    seed 0, over the uid's UTF-8 bytes)."""
    return mmh3.hash_bytes(uid.encode("utf-8"))


@dataclasses.dataclass(frozen=True)
class FlinkStateInfo:
    """One state of an operator: what ``FlinkSavepoint.states`` lists."""

    name: str
    kind: str                      # VALUE, LIST, MAP, REDUCING, AGGREGATING, TIMER, SPLIT_DISTRIBUTE, UNION, BROADCAST
    value_type: FlinkType
    key_type: FlinkType | None     # the job's key (keyed states) or the broadcast map's key
    namespace_type: FlinkType | None
    ttl: bool

    @property
    def keyed(self) -> bool:
        return self.kind not in ("SPLIT_DISTRIBUTE", "UNION", "BROADCAST")


@dataclasses.dataclass(frozen=True)
class KeyGroupData:
    """The entries of one key group, per state name. Entries by kind: value-like ``(key, namespace, value)``, list
    ``(key, namespace, [elements])``, map ``(key, namespace, user_key, value)``, timer ``(key, namespace, ts)``;
    TTL values and elements are ``TtlValue``; the namespace of non-windowed state is None."""

    key_group: int
    entries: dict[str, list[tuple]]


@dataclasses.dataclass(frozen=True)
class KeyGroupBlock:
    """One key group's block as read (Snappy-decoded): what ``FlinkSavepoint.key_group_blocks`` yields."""

    key_group: int
    block: bytes | memoryview
    header: KeyedBackendHeader
    prefix_bytes: int                # of the key-group prefix of its keys
    where: str                       # names the block in errors

    def scan(self) -> flinkin.BlockScan:
        """Where each entry's state id, key and value lie (compiled and checked: ``flinkin.scan_block``)."""
        return flinkin.scan_block(self.block, self.key_group, self.prefix_bytes, len(self.header.states),
                                  self.where)


def decode_entries(raw: KeyGroupBlock, scan: flinkin.BlockScan, state_ids: list[int],
                   decoders: list | None = None) -> dict[str, list[tuple]]:
    """The entries of states ``state_ids`` of a scanned block, decoded to Python values (``KeyGroupData``'s
    tuples), per state name, in block order; states without entries are left out."""
    header = raw.header
    if decoders is None:
        decoders = [_decoder(m, header.key_type) if i in state_ids else None for i, m in enumerate(header.states)]
    wanted = set(state_ids)
    data = bytes(raw.block)
    sid, ks, ke, vs, ve = (a.tolist() for a in scan.arrays())
    entries: dict[str, list[tuple]] = {}
    keys: dict[bytes, tuple[Any, Any]] = {}   # the states of one key share its key bytes
    where = raw.where
    for i, state_id in enumerate(sid):
        if state_id not in wanted:
            continue
        name = header.states[state_id].name
        out = entries.get(name)
        if out is None:
            out = entries[name] = []
        out.append(decoders[state_id](data[ks[i]:ke[i]], data[vs[i]:ve[i]], where, keys))
    return entries


class PathOutsideSavepointError(KeyGroupsError):
    """A state handle of a Flink ``_metadata`` names a file outside the savepoint's directory (an absolute path
    elsewhere, another file system, a URL). keygroups reads only the savepoint's own files unless the caller opts in
    (``allow_paths_outside=True``, ``--allow-paths-outside``): a crafted ``_metadata`` could otherwise make it read any
    file or URL the process can reach. Flink's non-relocatable savepoints (absolute ``FileStateHandle`` paths) that
    were moved, or whose files lie elsewhere, need the opt-in."""


class OperatorNotFoundError(KeyGroupsError, KeyError):
    """The savepoint holds no operator of that uid (or id); the message lists the operators it holds."""

    def __str__(self) -> str:   # a KeyError's str is the repr of its argument: keep the message readable
        return str(self.args[0]) if self.args else ""


#: A path read from ``_metadata`` is shown whole up to this length (escaped, as any text read from a file).
_PATH_CHARACTERS = 400


class _Files:
    """The file system of one savepoint directory: where each stream handle's bytes are, refused outside the
    directory unless allowed; each file checked once (a regular file, at least as long as its handle says) before
    anything is read from it."""

    def __init__(self, base: str, allow_paths_outside: bool) -> None:
        self.base = base
        self.allow_paths_outside = allow_paths_outside
        self.fs, self.root = fsspec.core.url_to_fs(base)
        self.local = isinstance(self.fs, LocalFileSystem)
        protocol = self.fs.protocol
        self.protocols = set(protocol) if isinstance(protocol, (tuple, list)) else {protocol}
        self._inside = self._comparable(self.root).rstrip("/")
        self._checked: dict[str, int] = {}     # path -> its size on the file system
        self.bytes_read = 0                    # of state, from files and inline handles

    def _comparable(self, path: str) -> str:
        """``path`` as containment is decided on: symbolic links resolved for local files (a link out of the
        directory is outside), ``.`` and ``..`` folded elsewhere."""
        return os.path.realpath(path) if self.local else posixpath.normpath(path)

    def _is_inside(self, path: str) -> bool:
        p = self._comparable(path)
        return p.startswith(self._inside + "/")

    def locate(self, handle: FileStateHandle | RelativeFileStateHandle) -> tuple[Any, str, str]:
        """(file system, path on it, the name errors give) of a file handle's bytes."""
        if isinstance(handle, RelativeFileStateHandle):
            path = posixpath.join(self.root, handle.relative_path)
            if not self.allow_paths_outside and not self._is_inside(path):
                raise self._outside(f"relative state handle {shown(handle.relative_path, _PATH_CHARACTERS)}",
                                    "resolves (through a symbolic link)")
            return self.fs, path, plain(path, _PATH_CHARACTERS)
        path = handle.path
        if path.startswith("file:") and not path.startswith("file://"):
            path = path[len("file:"):]
        if get_protocol(path) in self.protocols:
            on_fs = type(self.fs)._strip_protocol(path)
            if self.allow_paths_outside or self._is_inside(on_fs):
                return self.fs, on_fs, plain(on_fs, _PATH_CHARACTERS)
        if not self.allow_paths_outside:
            raise self._outside(f"file state handle {shown(handle.path, _PATH_CHARACTERS)}", "points")
        fs, on_fs = fsspec.core.url_to_fs(path)
        return fs, on_fs, plain(path, _PATH_CHARACTERS)

    def _outside(self, what: str, verb: str) -> PathOutsideSavepointError:
        return PathOutsideSavepointError(
            f"the savepoint {self.base}: its {what} {verb} outside the savepoint directory; keygroups reads only the "
            "savepoint's own files unless told otherwise. If you trust this savepoint (Flink's non-relocatable "
            "savepoints name their files by absolute path, and a moved one points to where it was written), pass "
            "allow_paths_outside=True (keygroups flink: --allow-paths-outside)")

    def check(self, fs: Any, path: str, where: str, claimed: int) -> None:
        """Refuse a file that is not a regular file, or shorter than the ``claimed`` bytes its handle says it holds,
        before any byte of it is read (a FIFO would block the read, a claimed size is never allocated)."""
        size = self._checked.get(path)
        if size is None:
            try:
                info = fs.info(path)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"state file {where} of the savepoint is missing") from None
            kind = info.get("type")
            if kind != "file":
                found = {"directory": "a directory", "other": "not a regular file (a FIFO, socket or device)"}.get(
                    kind, f"of type {kind!r}")
                raise CorruptSnapshotError(f"state file {where} of the savepoint is {found}; a savepoint's state "
                                           "files are regular files")
            known = info.get("size")
            size = self._checked[path] = -1 if known is None else int(known)   # -1: the file system does not say
        if 0 <= size < claimed:
            raise CorruptSnapshotError(f"state file {where} holds {size} bytes, but its state handle in _metadata "
                                       f"says {claimed} (the file is truncated, or _metadata is corrupt)")


class _Stream:
    """Ranged reads of one stream handle: inline bytes, or a file read by seek (one key group at a time)."""

    def __init__(self, handle: StreamStateHandle, files: _Files) -> None:
        self.handle = handle
        self.files = files
        if isinstance(handle, ByteStreamStateHandle):
            self.where = f"inline state {shown(handle.name)}"
            self.size = len(handle.data)
            self.path: str | None = None
        else:
            self.fs, self.path, self.where = files.locate(handle)
            self.size = handle.size
            if self.size < 0:
                raise CorruptSnapshotError(f"state file {self.where}: its state handle in _metadata says it holds "
                                           f"{self.size} bytes")
            files.check(self.fs, self.path, self.where, self.size)

    def read(self, start: int, end: int) -> bytes:
        if not 0 <= start <= end <= self.size:
            raise CorruptSnapshotError(f"{self.where}: range [{start}, {end}) lies outside its {self.size} bytes")
        self.files.bytes_read += end - start
        if self.path is None:
            return self.handle.data[start:end]   # type: ignore[union-attr]
        try:
            with self.fs.open(self.path, "rb") as f:
                f.seek(start)
                data = _read_up_to(f, end - start)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"state file {self.where} of the savepoint is missing") from None
        if len(data) != end - start:
            raise CorruptSnapshotError(f"{self.where}: {len(data)} bytes at {start}, expected {end - start} "
                                       "(the file is truncated)")
        return data


#: The most bytes one read asks a file for: a length taken from a file is never allocated before the bytes exist.
_READ_CHUNK = 1 << 26


def _read_up_to(f: Any, n: int) -> bytes:
    """Up to ``n`` bytes of ``f``, read in chunks (fewer at the end of the file)."""
    if n <= _READ_CHUNK:
        return f.read(n)
    parts = []
    while n > 0:
        part = f.read(min(n, _READ_CHUNK))
        if not part:
            break
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


class FlinkSavepoint:
    """A Flink savepoint directory: its operators and their states (see ``read_savepoint``)."""

    def __init__(self, path: str, metadata: CheckpointMetadata, *, allow_paths_outside: bool = False) -> None:
        self.path = path
        self.metadata = metadata
        self.allow_paths_outside = allow_paths_outside
        self._files = _Files(path, allow_paths_outside)

    @property
    def operators(self) -> tuple[OperatorState, ...]:
        return self.metadata.operators

    def operator(self, uid: str) -> OperatorState:
        """The operator of that uid (or whose id, in hex, is ``uid``)."""
        want = operator_id_for_uid(uid)
        for op in self.operators:
            if op.uid == uid or op.operator_id == want or op.operator_id_hex == uid.lower():
                return op
        raise OperatorNotFoundError(f"the savepoint {self.path} has no operator with uid {shown(uid)}; "
                                    f"{self.operators_described()}")

    def operators_described(self) -> str:
        """The operators, as an error naming a wrong uid lists them: uid, name and id (uid and name are stored
        from Flink 2.0 on; before, an operator is found by its uid's hash or by its id)."""
        if not self.operators:
            return "it holds no operators"
        parts = []
        for op in self.operators:
            label = f"uid {shown(op.uid)}" if op.uid else "uid not stored"
            if op.name and op.name != op.uid:
                label += f", name {shown(op.name)}"
            parts.append(f"{label}, id {op.operator_id_hex}")
        if self.metadata.version < 5:
            note = (f" (this savepoint's metadata, version {self.metadata.version}, stores no uids: give the uid the "
                    "Flink job set, which keygroups matches by its hash, or an operator id)")
        elif not all(op.uid for op in self.operators):
            note = " (an operator without a uid is found by its id)"
        else:
            note = ""
        return f"its operators: {'; '.join(parts)}{note}"

    @property
    def bytes_read(self) -> int:
        """Bytes of state read so far (from state files and inline handles; ``_metadata`` not counted)."""
        return self._files.bytes_read

    def check_files(self, uid: str) -> None:
        """Check every state file of operator ``uid`` before anything is read or written: inside the savepoint
        directory (unless ``allow_paths_outside``), a regular file, as long as its handle says. Raises
        ``PathOutsideSavepointError``, ``CheckpointNotFoundError`` or ``CorruptSnapshotError`` naming the file."""
        for st in self.operator(uid).subtasks:
            for handle in (st.managed_keyed_state, st.managed_operator_state):
                if handle is not None:
                    _Stream(handle.stream, self._files)

    # -- headers -----------------------------------------------------------------------------------------------

    def _keyed_handles(self, op: OperatorState) -> list[KeyGroupsStateHandle]:
        return sorted((st.managed_keyed_state for st in op.subtasks if st.managed_keyed_state is not None),
                      key=lambda h: h.start_key_group)

    def _keyed_header(self, handle: KeyGroupsStateHandle) -> tuple[KeyedBackendHeader, _Stream]:
        stream = _Stream(handle.stream, self._files)
        firsts = [o for o in handle.offsets if o]
        end = min(firsts) if firsts else stream.size
        c = Cursor(stream.read(0, end), stream.where)
        return read_keyed_header(c), stream

    def keyed_header(self, uid: str) -> KeyedBackendHeader | None:
        """The keyed state header of the operator (the same for every subtask), or None without keyed state."""
        handles = self._keyed_handles(self.operator(uid))
        return self._keyed_header(handles[0])[0] if handles else None

    def _operator_handles(self, op: OperatorState) -> list[tuple[int, OperatorStreamStateHandle]]:
        return [(st.index, st.managed_operator_state) for st in op.subtasks if st.managed_operator_state is not None]

    def _operator_header(self, handle: OperatorStreamStateHandle) -> tuple[OperatorBackendHeader, bytes, str]:
        stream = _Stream(handle.stream, self._files)
        data = stream.read(0, stream.size)   # operator state is small: whole per subtask
        return read_operator_header(Cursor(data, stream.where)), data, stream.where

    def states(self, uid: str) -> list[FlinkStateInfo]:
        """Every state of the operator: keyed states and timers (in header order), then operator states."""
        op = self.operator(uid)
        out = []
        header = self.keyed_header(uid)
        if header is not None:
            for m in header.states:
                if m.kind == "TIMER":
                    t = timer_type(m)
                    out.append(FlinkStateInfo(m.name, "TIMER", t, t.key, t.namespace, False))
                else:
                    ttl = _is_ttl_state(m)
                    out.append(FlinkStateInfo(m.name, m.kind, m.value_type, header.key_type, m.namespace_type, ttl))
        seen = set()
        for _, handle in self._operator_handles(op):
            h, _, _ = self._operator_header(handle)
            for m in h.states.values():
                if m.name not in seen:
                    seen.add(m.name)
                    out.append(FlinkStateInfo(m.name, m.kind, m.value_type, None, None, False))
            for m in h.broadcast_states.values():
                if m.name not in seen:
                    seen.add(m.name)
                    out.append(FlinkStateInfo(m.name, "BROADCAST", m.value_type, m.serializers["KEY_SERIALIZER"],
                                              None, False))
        return out

    # -- keyed state -------------------------------------------------------------------------------------------

    def key_group_blocks(self, uid: str, key_groups: KeyGroupRange | None = None) -> Iterator[KeyGroupBlock]:
        """Every non-empty key group's block of the operator (of ``key_groups`` when given), in order, undecoded
        (Snappy-decoded when compressed) with the header of the stream it is in. Holds one block at a time."""
        op = self.operator(uid)
        prefix = key_group_prefix_bytes(op.max_parallelism)
        for handle in self._keyed_handles(op):
            if key_groups is not None and (handle.end_key_group < key_groups.start
                                           or handle.start_key_group > key_groups.end):
                continue
            header, stream = self._keyed_header(handle)
            nonzero = sorted(o for o in handle.offsets if o)
            ends = dict(zip(nonzero, nonzero[1:] + [stream.size]))
            for i, offset in enumerate(handle.offsets):
                if not offset:
                    continue
                kg = handle.start_key_group + i
                if key_groups is not None and not key_groups.start <= kg <= key_groups.end:
                    continue
                where = f"{stream.where}, key group {kg}"
                block = read_block(stream.read(offset, ends[offset]), 0, ends[offset] - offset, header.compression,
                                   where)
                yield KeyGroupBlock(kg, block, header, prefix, where)

    def key_groups(self, uid: str, states: set[str] | None = None,
                   key_groups: KeyGroupRange | None = None) -> Iterator[KeyGroupData]:
        """Every non-empty key group of the operator (of ``key_groups`` when given), in order, decoded (only the
        named ``states`` when given). Holds one key group's block at a time."""
        decoders: dict[int, list] = {}
        for raw in self.key_group_blocks(uid, key_groups):
            header = raw.header
            if id(header) not in decoders:
                decoders.clear()
                decoders[id(header)] = [_decoder(m, header.key_type) for m in header.states]
            scan = raw.scan()
            wanted = [i for i, m in enumerate(header.states) if states is None or m.name in states]
            entries = decode_entries(raw, scan, wanted, decoders[id(header)])
            if entries:
                yield KeyGroupData(raw.key_group, entries)

    def read_state(self, uid: str, name: str) -> Iterator[pa.RecordBatch]:
        """A keyed state (or timer state) as Arrow record batches, one per key group that holds it. Columns:
        ``key_group``, ``key``, ``namespace`` (windowed state only), ``user_key`` (map state), ``value``
        (``timestamp`` for timers), ``ttl_timestamp`` (TTL states)."""
        info = {s.name: s for s in self.states(uid)}.get(name)
        if info is None or not info.keyed:
            raise KeyError(f"operator {uid!r} has no keyed state {name!r}; its states: "
                           f"{', '.join(shown(s.name) for s in self.states(uid))} (operator state: "
                           "read_operator_state)")
        schema = state_schema(info)
        for kg in self.key_groups(uid, {name}):
            yield _batch(info, schema, kg.key_group, kg.entries.get(name, []))

    # -- operator state ----------------------------------------------------------------------------------------

    def read_operator_state(self, uid: str, name: str) -> dict[int, Any]:
        """Operator state ``name`` per subtask: a list of elements (split, union), or a dict (broadcast)."""
        op = self.operator(uid)
        out: dict[int, Any] = {}
        for index, handle in self._operator_handles(op):
            meta = handle.states.get(name)
            if meta is None:
                continue
            header, data, where = self._operator_header(handle)
            all_offsets = sorted(o for m in handle.states.values() for o in m.offsets)
            if meta.mode == "BROADCAST":
                m = header.broadcast_states[name]
                out[index] = read_broadcast(data, meta.offsets, all_offsets, m.serializers["KEY_SERIALIZER"],
                                            m.value_type, header.compression, where)
            else:
                m = header.states[name]
                out[index] = read_elements(data, meta.offsets, all_offsets, m.value_type, header.compression, where)
        return out

    def operator_state_modes(self, uid: str) -> dict[str, str]:
        """Operator state name → SPLIT_DISTRIBUTE, UNION or BROADCAST."""
        modes = {}
        for _, handle in self._operator_handles(self.operator(uid)):
            for name, meta in handle.states.items():
                modes[name] = meta.mode
        return modes

    def __repr__(self) -> str:
        ops = ", ".join(f"{op.uid or op.operator_id_hex}(p={op.parallelism})" for op in self.operators)
        return f"FlinkSavepoint({self.path!r}, checkpoint {self.metadata.checkpoint_id}, operators: {ops})"


def read_savepoint(path: str | os.PathLike, *, allow_paths_outside: bool = False) -> FlinkSavepoint:
    """Open a Flink canonical savepoint directory (or its ``_metadata`` file); local paths or fsspec URLs.

    State is read only from files inside the savepoint directory: a state handle naming any other file or URL is
    refused (``PathOutsideSavepointError``) unless ``allow_paths_outside`` (Flink's non-relocatable savepoints name
    their files by absolute path)."""
    path = os.fspath(path)
    meta_path = path if path.rstrip("/").endswith("_metadata") else path.rstrip("/") + "/_metadata"
    base = meta_path[: -len("/_metadata")] if meta_path.endswith("/_metadata") else "."
    fs, on_fs = fsspec.core.url_to_fs(meta_path)
    try:
        kind = fs.info(on_fs).get("type")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path} is not a Flink savepoint: it has no _metadata file") from None
    if kind != "file":
        found = "a directory" if kind == "directory" else "not a regular file (a FIFO, socket or device)"
        raise CorruptSnapshotError(f"{meta_path} is {found}; a Flink savepoint's _metadata is a regular file")
    with fs.open(on_fs, "rb") as f:
        data = f.read()
    return FlinkSavepoint(base, read_metadata(data, meta_path), allow_paths_outside=allow_paths_outside)


# ---------------------------------------------------------------------------------------------- decoding

def _is_ttl_state(m: StateMetaInfoSnapshot) -> bool:
    t = m.value_type
    if m.kind == "LIST":
        t = list_element_type(m)
    elif m.kind == "MAP":
        t = map_value_type(m)[1]
    return isinstance(t, TtlType)


def _decoder(m: StateMetaInfoSnapshot, key_type: FlinkType):
    """A function (key bytes, value bytes, where, decoded keys of this key group) → the entry tuple of one state."""
    ns_type = m.namespace_type
    if m.kind == "TIMER":
        t = timer_type(m)

        def timer(key: bytes, value: bytes, where: str, keys: dict) -> tuple:
            ts, k, ns = decode_value(memoryview(key), t, where)
            if len(value):
                raise CorruptSnapshotError(f"{where}: a timer entry with a {len(value)}-byte value")
            return k, ns, ts
        return timer
    if m.kind == "LIST":
        element = list_element_type(m)

        def list_entry(key: bytes, value: bytes, where: str, keys: dict) -> tuple:
            kn = keys.get(key)
            if kn is None:
                kn = keys[key] = decode_key(key, key_type, ns_type, None, where)[:2]
            k, ns = kn
            return k, ns, decode_list_value(value, element, where)
        return list_entry
    if m.kind == "MAP":
        user_key, user_value = map_value_type(m)

        def map_entry(key: bytes, value: bytes, where: str, keys: dict) -> tuple:
            k, ns, uk = decode_key(key, key_type, ns_type, user_key, where)
            c = Cursor(value, where)
            v = None if c.boolean("a map value's null flag") else user_value.read(c)
            if c.remaining:
                raise c.fail(f"{c.remaining} bytes follow a map value")
            return k, ns, uk, v
        return map_entry
    vt = m.value_type

    def value_entry(key: bytes, value: bytes, where: str, keys: dict) -> tuple:
        kn = keys.get(key)
        if kn is None:
            kn = keys[key] = decode_key(key, key_type, ns_type, None, where)[:2]
        return kn[0], kn[1], decode_value(value, vt, where)
    return value_entry


# ---------------------------------------------------------------------------------------------- Arrow

def _unwrap_ttl(t: FlinkType) -> FlinkType:
    return t.value if isinstance(t, TtlType) else t


def state_schema(info: FlinkStateInfo) -> pa.Schema:
    fields = [pa.field("key_group", pa.int32(), nullable=False), pa.field("key", info.key_type.arrow_type())]
    if info.namespace_type is not None and not isinstance(info.namespace_type, VoidNamespaceType):
        fields.append(pa.field("namespace", info.namespace_type.arrow_type()))
    vt = info.value_type
    if info.kind == "TIMER":
        fields.append(pa.field("timestamp", pa.int64(), nullable=False))
    elif info.kind == "MAP":
        assert isinstance(vt, MapType)
        fields.append(pa.field("user_key", vt.key.arrow_type()))
        fields.append(pa.field("value", _unwrap_ttl(vt.value).arrow_type()))
    elif info.kind == "LIST":
        fields.append(pa.field("value", pa.list_(_unwrap_ttl(vt.element).arrow_type())))   # type: ignore[attr-defined]
    else:
        fields.append(pa.field("value", _unwrap_ttl(vt).arrow_type()))
    if info.ttl:
        fields.append(pa.field("ttl_timestamp", pa.list_(pa.int64()) if info.kind == "LIST" else pa.int64()))
    return pa.schema(fields)


def to_arrow_value(t: FlinkType, v: Any) -> Any:
    """A decoded value in the shape ``pa.array`` takes for ``t.arrow_type()``."""
    if v is None:
        return None
    if isinstance(t, RowType):
        return {n: to_arrow_value(f, x) for n, f, x in zip(t.names, t.fields, v)}
    if isinstance(t, TupleType):
        return {f"f{i}": to_arrow_value(f, x) for i, (f, x) in enumerate(zip(t.fields, v))}
    if isinstance(t, TimeWindowType):
        return {"start": v[0], "end": v[1]}
    if isinstance(t, MapType):
        return [(to_arrow_value(t.key, k), to_arrow_value(t.value, x)) for k, x in v.items()]
    if isinstance(t, ListType):
        return [to_arrow_value(t.element, x) for x in v]
    if isinstance(t, NullableType):
        return to_arrow_value(t.inner, v)
    return v


def _batch(info: FlinkStateInfo, schema: pa.Schema, kg: int, entries: list[tuple]) -> pa.RecordBatch:
    cols: dict[str, list] = {name: [] for name in schema.names}
    has_ns = "namespace" in cols
    ns_type = info.namespace_type
    for e in entries:
        cols["key_group"].append(kg)
        cols["key"].append(to_arrow_value(info.key_type, e[0]))
        if has_ns:
            cols["namespace"].append(to_arrow_value(ns_type, e[1]))
        if info.kind == "TIMER":
            cols["timestamp"].append(e[2])
            continue
        if info.kind == "MAP":
            vt = info.value_type
            cols["user_key"].append(to_arrow_value(vt.key, e[2]))    # type: ignore[attr-defined]
            value, value_type = e[3], _unwrap_ttl(vt.value)           # type: ignore[attr-defined]
        elif info.kind == "LIST":
            element = _unwrap_ttl(info.value_type.element)            # type: ignore[attr-defined]
            elems = e[2]
            if info.ttl:
                cols["ttl_timestamp"].append([x.timestamp for x in elems])
                elems = [x.value for x in elems]
            cols["value"].append([to_arrow_value(element, x) for x in elems])
            continue
        else:
            value, value_type = e[2], _unwrap_ttl(info.value_type)
        if info.ttl and isinstance(value, TtlValue):
            cols["ttl_timestamp"].append(value.timestamp)
            value = value.value
        elif info.ttl:
            cols["ttl_timestamp"].append(None)
        cols["value"].append(to_arrow_value(value_type, value))
    return pa.RecordBatch.from_pydict(cols, schema=schema)
