"""The partitioned log: a directory of N partition files of append-only, checksummed records.

It is the replayable input of a stateful job (the Kafka-topic stand-in of FLIP-8's example): a record's position
is its byte offset in its partition file, so a reader that stores ``(partition, offset)`` resumes exactly there.

File ``partition-<p:05d>.kglog``::

    header (16 bytes): magic b"KGLG" | u16 format version (1) | u16 payload encoding (1 = JSON UTF-8)
                       | u32 partition | u32 CRC32C of the 12 bytes before it
    record:            u32 CRC32C of the next (4 + length) bytes | u32 payload length | payload

All integers little-endian. The first record starts at offset 16. A record whose frame is incomplete at the end of
the file is not there yet (a writer may be appending, or crashed mid-record: the next writer cuts it off); a
complete frame with a bad checksum raises :class:`~keygroups.errors.CorruptLogError`. Payloads are compact JSON
objects, which never contain a raw newline: the compiled frame scanner (``keygroups._native.logframes.scan_frames``)
verifies a range of records and hands their payloads back as one newline-delimited JSON buffer, which Arrow's JSON
reader parses directly and ``json`` decodes in one call.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from keygroups._native import logframes
from keygroups.errors import CorruptLogError, CorruptSnapshotError

__all__ = [
    "LogSlice",
    "PartitionedLogSource",
    "PartitionedLogWriter",
    "write_partitioned_log",
    "partition_path",
    "staged_log_schema",
    "HEADER_SIZE",
    "MAX_RECORD_BYTES",
]

FORMAT_VERSION = 1
ENCODING_JSON = 1
_MAGIC = b"KGLG"
_HEADER = struct.Struct("<4sHHII")
HEADER_SIZE = _HEADER.size           # also the offset of a partition's first record
FRAME_SIZE = 8                       # u32 CRC32C | u32 length
MAX_RECORD_BYTES = 64 * 1024 * 1024  # a length above this is corruption, not a record
_NAME = re.compile(r"^partition-(\d{5,})\.kglog$")


def staged_log_schema(record_schema: Any) -> Any:
    """The schema of a log's records as a batch stages them: ``record_schema``'s columns, then ``_partition``
    (int32) and ``_offset`` (int64)."""
    import pyarrow as pa

    if not isinstance(record_schema, pa.Schema):
        raise ValueError(f"a partitioned-log source needs the record_schema its JSON records are read as (a pyarrow "
                         f"Schema), got {record_schema!r}")
    return pa.schema(list(record_schema) + [pa.field("_partition", pa.int32()), pa.field("_offset", pa.int64())])


def partition_path(directory: str | os.PathLike, partition: int) -> str:
    return os.path.join(os.fspath(directory), f"partition-{partition:05d}.kglog")


def _header(partition: int) -> bytes:
    head = struct.pack("<4sHHI", _MAGIC, FORMAT_VERSION, ENCODING_JSON, partition)
    return head + struct.pack("<I", crc32c.crc32c(head))


def _check_header(buf: Any, path: str, partition: int) -> None:
    if len(buf) < HEADER_SIZE:
        raise CorruptLogError(f"{path}: {len(buf)} bytes, shorter than the {HEADER_SIZE}-byte log header")
    magic, version, encoding, part, crc = _HEADER.unpack_from(buf, 0)
    if magic != _MAGIC or crc != crc32c.crc32c(bytes(buf[:HEADER_SIZE - 4])):
        raise CorruptLogError(f"{path}: not a keygroups partition log (bad magic or header checksum)")
    if version > FORMAT_VERSION or encoding != ENCODING_JSON:
        raise CorruptLogError(f"{path}: log format version {version}, encoding {encoding}; this library reads "
                              f"version <= {FORMAT_VERSION} with JSON payloads (encoding {ENCODING_JSON})")
    if part != partition:
        raise CorruptLogError(f"{path}: header says partition {part}, the file name says {partition}")


def _encode(record: Any) -> bytes:
    if not isinstance(record, Mapping):
        raise TypeError(f"a log record must be a dict of JSON values, got {type(record).__name__}: {record!r:.200}")
    try:
        payload = json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"a log record must hold only JSON values (str keys; None, bool, int, float, str, list, "
                        f"dict): {e}; record {record!r:.200}") from None
    if len(payload) > MAX_RECORD_BYTES:
        raise ValueError(f"a log record encodes to {len(payload)} bytes; at most {MAX_RECORD_BYTES} are allowed")
    return payload


def _frame(payload: bytes) -> bytes:
    length = struct.pack("<I", len(payload))
    return struct.pack("<I", crc32c.crc32c(payload, crc32c.crc32c(length))) + length + payload


def _scan(buf: Any, start: int, max_records: int | None, path: str, *, payloads: bool = True
          ) -> tuple[np.ndarray, int, bytes]:
    """The compiled scan of up to ``max_records`` complete records from ``start``: their start offsets, the next
    offset and their payloads as NDJSON. CorruptLogError (naming the file) on a bad checksum or length."""
    try:
        return logframes.scan_frames(buf, start, -1 if max_records is None else max_records, MAX_RECORD_BYTES,
                                    crc32c.crc32c, payloads)
    except CorruptSnapshotError as e:
        raise CorruptLogError(f"{path}: {e}; the log is corrupt") from None


@dataclass(frozen=True)
class LogSlice:
    """Records read from one partition: their start offsets, their payloads as newline-delimited JSON, and the
    offset where reading goes on."""

    partition: int
    offsets: list[int]
    ndjson: bytes
    next_offset: int

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def payloads(self) -> list[bytes]:
        """Each record's JSON bytes."""
        return self.ndjson.split(b"\n")[:-1]

    def records(self) -> list[dict]:
        """The records as dicts (one ``json.loads`` for the whole slice)."""
        if not self.offsets:
            return []
        return json.loads(b"[" + self.ndjson[:-1].replace(b"\n", b",") + b"]")

    def to_arrow(self, schema: Any = None, *, with_position: bool = True) -> Any:
        """The records as a ``pyarrow.Table``, parsed by Arrow's JSON reader straight from :attr:`ndjson`
        (``schema`` pins the column types; otherwise Arrow infers them).

        ``with_position`` adds ``_partition`` (int32) and ``_offset`` (int64) columns, so a consumer can dedupe or
        commit positions exactly.
        """
        import pyarrow as pa
        import pyarrow.json as pajson

        if self.offsets:
            opts = pajson.ParseOptions(explicit_schema=schema) if schema is not None else None
            table = pajson.read_json(pa.BufferReader(self.ndjson), parse_options=opts)
        else:
            table = pa.table({}) if schema is None else schema.empty_table()
        if with_position:
            table = table.append_column("_partition", pa.array(np.full(len(self), self.partition, np.int32)))
            table = table.append_column("_offset", pa.array(np.asarray(self.offsets, np.int64)))
        return table

    def to_record_batch(self, schema: Any = None, *, with_position: bool = True) -> Any:
        """:meth:`to_arrow` as one ``pyarrow.RecordBatch``."""
        import pyarrow as pa

        table = self.to_arrow(schema, with_position=with_position).combine_chunks()
        batches = table.to_batches()
        return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)


class PartitionedLogSource:
    """A partitioned log directory, for reading. Partitions are discovered from the file names."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise FileNotFoundError(f"partitioned log directory {self.directory!r} does not exist")

    @property
    def partitions(self) -> list[int]:
        """The partition ids present, ascending."""
        found = []
        for name in os.listdir(self.directory):
            m = _NAME.match(name)
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    def path(self, partition: int) -> str:
        return partition_path(self.directory, partition)

    def end_offset(self, partition: int) -> int:
        """The file size: an upper bound of the next record's offset (a torn tail is not a record)."""
        return os.path.getsize(self.path(partition))

    def read(self, partition: int, offset: int = HEADER_SIZE, max_records: int | None = None) -> LogSlice:
        """Up to ``max_records`` records of ``partition`` from byte ``offset`` (a record start, as returned in
        :attr:`LogSlice.next_offset`); all that are there when ``max_records`` is None."""
        if max_records is not None and max_records < 0:
            raise ValueError(f"max_records must be >= 0 or None, got {max_records}")
        path = self.path(partition)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise CorruptLogError(f"{path}: empty file, not even a log header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _check_header(buf, path, partition)
                if not HEADER_SIZE <= offset <= size:
                    raise CorruptLogError(f"{path}: stored offset {offset} is outside the log's records "
                                          f"[{HEADER_SIZE}, {size}]; the log was truncated or the offset is wrong")
                starts, next_offset, ndjson = _scan(buf, offset, max_records, path)
        return LogSlice(partition, starts.tolist(), ndjson, next_offset)

    def iter_records(self, partition: int, offset: int = HEADER_SIZE) -> Iterator[dict]:
        """Every record of ``partition`` from ``offset`` on."""
        yield from self.read(partition, offset).records()

    # ---- the job's source protocol (keygroups.runtime.source.Source) --------------------------------------------

    def prepare(self, previous: Any = None) -> PartitionedLogSource:
        """On the driver, once per batch: nothing to look up (partitions are found by each subtask's reader)."""
        return self

    def create_reader(self) -> Any:
        """In a source subtask: the reader of this subtask's partitions (a CheckpointedFunction)."""
        from keygroups.sources.reader import PartitionedLogReader

        return PartitionedLogReader(self)

    def staged_schema(self, record_schema: Any) -> Any:
        """The schema of a batch's staged input: the records' columns, then ``_partition`` (int32) and ``_offset``
        (int64)."""
        return staged_log_schema(record_schema)

    def notify_checkpoint_complete(self, metadata: Any) -> None:
        """Nothing to tell anyone: the positions live in the checkpoint only."""

    def describe(self) -> str:
        return f"partitioned log {self.directory}"

    def __repr__(self) -> str:
        return f"PartitionedLogSource({self.directory!r})"


class PartitionedLogWriter:
    """Appends records to the partitions of a log directory (created as needed).

    One writer per partition at a time. On first touching an existing partition the writer cuts off a torn tail
    left by a crashed writer, so that later records stay readable.
    """

    def __init__(self, directory: str | os.PathLike, *, fsync: bool = False) -> None:
        self.directory = os.fspath(directory)
        self.fsync = fsync
        os.makedirs(self.directory, exist_ok=True)
        self._checked: set[int] = set()

    def _prepare(self, partition: int) -> str:
        if not isinstance(partition, int) or partition < 0:
            raise ValueError(f"a partition id must be an int >= 0, got {partition!r}")
        path = partition_path(self.directory, partition)
        if partition in self._checked:
            return path
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            with open(path, "wb") as f:
                f.write(_header(partition))
        else:
            with open(path, "r+b") as f:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                    _check_header(buf, path, partition)
                    _, end, _ = _scan(buf, HEADER_SIZE, None, path, payloads=False)
                    size = len(buf)
                if end < size:
                    f.truncate(end)
        self._checked.add(partition)
        return path

    def append(self, partition: int, records: Iterable[Mapping[str, Any]]) -> int:
        """Append ``records`` to ``partition``; returns the offset after the last one."""
        path = self._prepare(partition)
        data = b"".join(_frame(_encode(r)) for r in records)
        with open(path, "ab") as f:
            f.write(data)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
            return f.tell()

    def create(self, partition: int) -> None:
        """Create an empty partition (header only) if it does not exist."""
        self._prepare(partition)


def write_partitioned_log(directory: str | os.PathLike, partitions: Mapping[int, Iterable[Mapping[str, Any]]], *,
                          fsync: bool = False) -> PartitionedLogSource:
    """Create (or append to) a log with the given records per partition; returns the source to read it."""
    writer = PartitionedLogWriter(directory, fsync=fsync)
    for partition, records in partitions.items():
        writer.append(partition, records)
    return PartitionedLogSource(directory)
