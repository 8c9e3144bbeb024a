"""What the driver ships to every keyed subtask of a batch: :class:`KeyedTaskSpec` (small: no state; the restore
point's ``_metadata`` as its own bytes, decoded once per worker process)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from keygroups._hashing import KeyType
from keygroups._ranges import KeyGroupRange, check_boundaries, key_group_range
from keygroups.checkpoint import CheckpointMetadata
from keygroups.checkpoint.metadata import decode_metadata
from keygroups.errors import CorruptSnapshotError
from keygroups.runtime.backends import StateBackendName
from keygroups.runtime.watermarks import LateRecords, check_late_records
from keygroups.state.timers import NO_WATERMARK


def check_warm_heap_backends(n: Any) -> int:
    """``n`` if it is a valid number of heap backends to keep per worker process, else ValueError."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"warm_heap_backends must be an int >= 0 (heap backends a worker process keeps between "
                         f"batches; 0 keeps none), got {n!r}")
    return n


def check_write_back_batches(n: Any, backend: str) -> int | None:
    """``n`` if it is a valid RocksDB write-back interval or None (the backend's default), else ValueError; one for
    another ``backend`` than RocksDB is refused too (it would be ignored)."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"write_back_batches must be an int >= 1 (a RocksDB subtask writes its kept database at "
                         f"most every this many batches; 1: every batch) or None (the backend's default), got {n!r}")
    if n is not None and backend != "rocksdb":
        raise ValueError(f"write_back_batches={n!r} applies to backend='rocksdb' only (a database kept on local disk "
                         f"between batches); backend={backend!r} has none to write back: leave it None")
    return n


@dataclass(frozen=True)
class KeyedTaskSpec:
    """Everything a keyed subtask needs, shipped to it by Spark (small: no state)."""

    job_name: str
    key_columns: tuple[str, ...]
    key_type: KeyType
    function: bytes  # the job's KeyedProcessFunction, pickled by the driver: each subtask unpickles a fresh copy
    input_schema: pa.Schema
    output_schema: pa.Schema
    max_parallelism: int
    parallelism: int
    checkpoint_location: str
    checkpoint_id: int
    restore_from: int | str | None   # a checkpoint id, a savepoint name, or None (no state yet)
    backend: StateBackendName = "heap"
    order_columns: tuple[str, ...] = ()
    #: The event-time column (a timestamp, or a long of epoch ms): ``context.timestamp``, lateness, the watermark.
    timestamp_column: str | None = None
    #: The watermark the batch started with: records at or before it are late (see ``late_records``).
    start_watermark: int = NO_WATERMARK
    #: The batch's watermark once its records are in: event-time timers up to it fire after the records.
    watermark: int = NO_WATERMARK
    #: The batch's processing time (epoch ms, fixed by the driver): processing-time timers up to it fire.
    processing_time: int = 0
    #: Late records are dropped (and counted) or written to the batch's late output.
    late_records: LateRecords = "drop"
    storage_options: dict[str, Any] | None = None
    allow_pickle: bool = False
    #: The executors' local directory for warm state (RocksDB keeps its database there between batches); None:
    #: the system temporary directory.
    local_dir: str | None = None
    #: Keep RocksDB databases warm between batches (False: a fresh database per batch, as before).
    warm_state: bool = True
    #: Heap backends a Python worker process keeps between batches (each holds one subtask's state in memory); 0:
    #: none, every batch restores.
    warm_heap_backends: int = 4
    #: A RocksDB subtask's kept database is written at most every this many batches (write-back); None: the
    #: backend's default (``keygroups.state.rocksdb.DEFAULT_WRITE_BACK_BATCHES``).
    write_back_batches: int | None = None
    #: The batch's ranges as boundaries (subtask i owns ``[b[i], b[i + 1] - 1]``; see
    #: :mod:`keygroups.runtime.assignment`); None: Flink's equal ranges.
    key_group_boundaries: tuple[int, ...] | None = None
    #: The restore point's ``_metadata``, as the driver read it (its bytes, and the directory it lies in): the
    #: subtask decodes it (once per worker process) instead of reading it from the storage. None: the subtask
    #: reads ``restore_from`` itself.
    restore_metadata: bytes | None = None
    restore_base: str = ""
    #: ``restore_metadata`` is zstd-compressed from this many bytes (None: it is not compressed; see
    #: :meth:`compact`).
    restore_metadata_size: int | None = None
    #: Per subtask, the ``(first, last)`` key groups of the previous batch's range whose warm state it takes over
    #: (None: none, it restores what it owns): the assignment's best global matching
    #: (:meth:`~keygroups.runtime.assignment.AssignmentDecision.warm_ranges`), so that the bytes read are the moved
    #: bytes. A subtask never takes a range given to another. None: each subtask takes the kept state that
    #: overlaps its range most.
    warm_takeover: tuple[tuple[int, int] | None, ...] | None = None
    #: Where the output goes in the task (a :class:`~keygroups.runtime.sink.Sink`; None: none), and the id of this
    #: run of the batch its writers are opened with.
    sink: Any = None
    sink_run_id: str = ""
    #: Whether the subtask writes its output into the checkpoint (``output-<i>`` Parquet files; False: only to the
    #: sink).
    checkpoint_output: bool = True

    def __post_init__(self) -> None:
        check_warm_heap_backends(self.warm_heap_backends)
        check_late_records(self.late_records)
        if self.key_group_boundaries is not None:
            b = check_boundaries(self.key_group_boundaries, self.max_parallelism)
            if len(b) != self.parallelism + 1:
                raise ValueError(f"key_group_boundaries must hold parallelism + 1 = {self.parallelism + 1} "
                                 f"boundaries, got {len(b)}")
            object.__setattr__(self, "key_group_boundaries", b)
        if self.warm_takeover is not None and len(self.warm_takeover) != self.parallelism:
            raise ValueError(f"warm_takeover must name one previous range (or None) per subtask, got "
                             f"{len(self.warm_takeover)} for parallelism {self.parallelism}")

    def own_key_groups(self, subtask_index: int) -> KeyGroupRange:
        """The key groups subtask ``subtask_index`` owns this batch: its range of ``key_group_boundaries``, or
        Flink's ``key_group_range`` without them."""
        b = self.key_group_boundaries
        if b is None:
            return key_group_range(self.max_parallelism, self.parallelism, subtask_index)
        if not 0 <= subtask_index < self.parallelism:
            raise ValueError(f"subtask_index must be in [0, parallelism={self.parallelism}), got {subtask_index}")
        return KeyGroupRange(b[subtask_index], b[subtask_index + 1] - 1)

    def warm_claims(self, subtask_index: int) -> tuple[tuple[int, int] | None, frozenset[tuple[int, int]]]:
        """``(the previous range subtask_index takes over or None, the previous ranges given to other subtasks)``;
        ``(None, frozenset())`` without a takeover (:attr:`warm_takeover`)."""
        if self.warm_takeover is None:
            return None, frozenset()
        mine = self.warm_takeover[subtask_index]
        return mine, frozenset(r for i, r in enumerate(self.warm_takeover) if r is not None and i != subtask_index)

    def compact(self) -> KeyedTaskSpec:
        """This spec with its restore point's ``_metadata`` zstd-compressed, for shipping to tasks: at a large max
        parallelism the ``_metadata`` of an incremental checkpoint is megabytes (every handle's offsets and block
        checksums per key group), and Spark broadcasts a task's pickled function once it passes 1 MB
        (``spark.broadcast.UDFCompressionThreshold``), a cost paid on every batch. Compressed once per bytes
        object; the task decompresses it once per worker process (:meth:`shipped_restore_point`)."""
        data = self.restore_metadata
        if data is None or self.restore_metadata_size is not None:
            return self
        return replace(self, restore_metadata=_compressed(data), restore_metadata_size=len(data))

    def shipped_restore_point(self) -> CheckpointMetadata | None:
        """The restore point shipped in the spec (None: none shipped), decoded once per worker process."""
        if self.restore_metadata is None:
            return None
        return _decoded(self.checkpoint_location, self.restore_base, self.restore_metadata,
                        self.restore_metadata_size)


#: zstd at level 1: a few ms for megabytes of ``_metadata``, about a quarter of its size (the block checksums,
#: random bytes, are most of what is left).
_CODEC = pa.Codec("zstd", compression_level=1)
_COMPRESSED: dict[int, tuple[bytes, bytes]] = {}
_COMPRESSED_KEEP = 4


def _compressed(data: bytes) -> bytes:
    found = _COMPRESSED.get(id(data))
    if found is not None and found[0] is data:
        return found[1]
    out = _CODEC.compress(data, asbytes=True)
    _COMPRESSED[id(data)] = (data, out)
    while len(_COMPRESSED) > _COMPRESSED_KEEP:
        _COMPRESSED.pop(next(iter(_COMPRESSED)))
    return out


_DECODED: dict[tuple[str, str, bytes], CheckpointMetadata] = {}
_DECODED_LOCK = threading.Lock()
_DECODED_KEEP = 4


def _decoded(location: str, base: str, data: bytes, size: int | None = None) -> CheckpointMetadata:
    key = (location, base, data)
    with _DECODED_LOCK:
        found = _DECODED.get(key)
    if found is not None:
        return found
    what = f"the restore point's _metadata shipped from the driver ({base})"
    if size is not None:
        try:
            data = _CODEC.decompress(data, decompressed_size=size, asbytes=True)
        except (OSError, ValueError) as e:   # Arrow raises OSError (ArrowIOError) on a corrupt frame
            raise CorruptSnapshotError(f"{what} does not decompress: {e}") from None
    metadata = decode_metadata(data, base, what)
    with _DECODED_LOCK:
        _DECODED[key] = metadata
        while len(_DECODED) > _DECODED_KEEP:
            _DECODED.pop(next(iter(_DECODED)))
    return metadata


__all__ = ["KeyedTaskSpec", "check_warm_heap_backends"]
