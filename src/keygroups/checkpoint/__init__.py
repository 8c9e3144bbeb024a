"""Checkpoint storage, metadata and the keyed snapshot file format.

* :class:`CheckpointStorage` — ``chk-<id>/`` directories under a local path or fsspec URL, the atomic
  ``_metadata`` commit (compare-and-swap: only if the checkpoint it was planned from is still the newest),
  retention of the last N complete checkpoints, savepoints.
* :class:`CheckpointMetadata`, :class:`KeyedStateHandle`, :class:`OperatorStateHandle` (with
  :class:`OperatorStateMeta` per state and its :class:`DistributionMode`) — what a complete checkpoint holds.
* :class:`KeyedSnapshotWriter`, :func:`read_key_groups` — the keyed snapshot file: one checksummed block per key
  group (full, or a delta of puts and deletes; :class:`KeyGroupBlock` as read, keys sorted for :func:`find_key`)
  and an offset index, read back lazily (memoryview slices, or bytes with ``copy=True``) with one ranged read
  per old file; :func:`read_key_group_offsets` gives int64 offset arrays for bulk decoding instead, and
  :class:`Packed` lets the writer take ``serialize_many`` output as is. :func:`write_keyed_snapshot` is the one-call
  writer, :func:`open_snapshot` the standalone whole-file reader (tools, checks).
* :func:`write_operator_snapshot`, :func:`read_operator_runs` — the operator state file (``operator_format``):
  elements back to back, indexed and checksummed by its handle, read as validated slices without decoding.
* :func:`plan_keyed_restore` — which old files and key groups a subtask of a new parallelism reads (each key
  group's chain of full and delta blocks); :func:`chain_stats`, :func:`choose_full_key_groups` and
  :func:`carry_forward` keep chains bounded and the next checkpoint's handles exactly those still needed;
  :func:`plan_operator_restore` — which runs of old operator state elements it reads (Flink's round-robin
  repartitioner).
* :class:`BlockLink`, :func:`chain_tips`, :func:`chain_breaks` (:class:`ChainBreak`) — chain integrity: each delta
  block names the block it applies on (its checkpoint and checksum), a chain that lacks a delta or holds a foreign
  one is refused at restore, at commit and by ``keygroups verify``, and what the next deltas of a checkpoint name.
* :class:`RawKeyedStateHandle`, :class:`RawKeyedStateWriter`, :class:`RawKeyedStateReader` — raw keyed state
  (``raw_keyed``): per-key-group bytes a job's function writes itself, one checksummed block per key group, read
  back by any parallelism with :func:`plan_raw_keyed_restore`; :func:`write_raw_keyed_snapshot`,
  :func:`open_raw_keyed` (the standalone whole-file reader).
* :func:`checkpoint_figures` (:class:`CheckpointFigures`), :func:`size_history` — bytes and keys per key group,
  each subtask's load and its skew at any parallelism, the size over the retained checkpoints (``stats``).

This layer stores opaque bytes and JSON; it never imports ``keygroups.state`` or pyspark.
"""

from keygroups.checkpoint.format import (
    FORMAT_VERSION,
    KeyedSnapshotWriter,
    KeyGroupBlock,
    Packed,
    SnapshotFile,
    find_key,
    open_snapshot,
    read_key_group_offsets,
    read_key_groups,
    write_keyed_snapshot,
)
from keygroups.checkpoint.metadata import (
    METADATA_VERSION,
    OPERATOR_FORMAT_VERSION,
    BlockLink,
    CheckpointMetadata,
    DistributionMode,
    KeyedStateHandle,
    OperatorStateHandle,
    OperatorStateMeta,
    RawKeyedStateHandle,
)
from keygroups.checkpoint.operator_format import (
    OperatorRestoreStats,
    RestoredList,
    SerializedState,
    read_operator_runs,
    write_operator_snapshot,
)
from keygroups.checkpoint.planning import (
    ChainBreak,
    ChainStats,
    ElementRun,
    allowed_max_parallelisms,
    carry_forward,
    chain_breaks,
    chain_stats,
    chain_tips,
    check_restore_max_parallelism,
    choose_full_key_groups,
    parent_key_groups,
    plan_keyed_restore,
    plan_operator_restore,
    plan_raw_keyed_restore,
    split_sizes,
)
from keygroups.checkpoint.raw_keyed import (
    RawKeyedStateReader,
    RawKeyedStateWriter,
    open_raw_keyed,
    write_raw_keyed_snapshot,
)
from keygroups.checkpoint.stats import CheckpointFigures, checkpoint_figures, size_history
from keygroups.checkpoint.storage import CheckpointStorage

__all__ = [
    "CheckpointStorage",
    "CheckpointMetadata",
    "KeyedStateHandle",
    "OperatorStateHandle",
    "OperatorStateMeta",
    "RawKeyedStateHandle",
    "DistributionMode",
    "KeyedSnapshotWriter",
    "Packed",
    "KeyGroupBlock",
    "find_key",
    "read_key_groups",
    "read_key_group_offsets",
    "write_keyed_snapshot",
    "open_snapshot",
    "SnapshotFile",
    "plan_keyed_restore",
    "ChainStats",
    "chain_stats",
    "BlockLink",
    "chain_tips",
    "chain_breaks",
    "ChainBreak",
    "choose_full_key_groups",
    "carry_forward",
    "check_restore_max_parallelism",
    "allowed_max_parallelisms",
    "parent_key_groups",
    "plan_operator_restore",
    "split_sizes",
    "plan_raw_keyed_restore",
    "RawKeyedStateWriter",
    "RawKeyedStateReader",
    "write_raw_keyed_snapshot",
    "open_raw_keyed",
    "ElementRun",
    "write_operator_snapshot",
    "SerializedState",
    "read_operator_runs",
    "RestoredList",
    "OperatorRestoreStats",
    "FORMAT_VERSION",
    "OPERATOR_FORMAT_VERSION",
    "METADATA_VERSION",
    "CheckpointFigures",
    "checkpoint_figures",
    "size_history",
]
