"""One parallel subtask reading a partitioned log, its positions kept in split-distribute operator state.

This is FLIP-8's Kafka-source example: each subtask owns some partitions and keeps a ``(partition, offset)`` pair
per partition in a split-distribute list state. After a rescale the pairs are spread evenly over the new subtasks,
so scaling down loses no partition and scaling up leaves no subtask idle (while there are at least as many
partitions as subtasks); every partition continues exactly at its stored offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keygroups.sources.log import HEADER_SIZE, LogSlice, PartitionedLogSource
from keygroups.state.checkpointed import (
    CheckpointedFunction,
    FunctionInitializationContext,
    FunctionSnapshotContext,
)

__all__ = ["PartitionedLogReader", "OFFSETS_STATE_NAME"]

OFFSETS_STATE_NAME = "partitioned-log-offsets"


class PartitionedLogReader(CheckpointedFunction):
    """The source function of one subtask. Drive it with :func:`keygroups.state.initialize_function` /
    :func:`~keygroups.state.checkpoint_function`, and call :meth:`poll` for each micro-batch.

    On a fresh start subtask ``i`` of ``p`` owns the partitions ``q`` with ``q % p == i``, from their first record.
    Partitions created after the first start are not picked up (a split-distribute state cannot tell which ones
    another subtask holds; Flink's Kafka consumer uses union state for discovery).
    """

    def __init__(self, source: PartitionedLogSource) -> None:
        self.source = source
        self._positions: dict[int, int] = {}
        self._state: Any = None
        self._next = 0   # which owned partition the next poll starts with, so small budgets still rotate

    def initialize_state(self, context: FunctionInitializationContext) -> None:
        from keygroups.serializers import Int64Serializer, TupleSerializer
        from keygroups.state import ListStateDescriptor

        store = context.operator_state_store
        # a checkpoint taken before this source existed has no offsets: start fresh rather than read nothing
        resumed = context.is_restored and OFFSETS_STATE_NAME in store.restored_state_names
        self._state = store.get_list_state(
            ListStateDescriptor(OFFSETS_STATE_NAME, TupleSerializer(Int64Serializer(), Int64Serializer())))
        if resumed:
            self._positions = {int(p): int(o) for p, o in self._state.get()}
        else:
            self._positions = {q: HEADER_SIZE for q in self.source.partitions
                               if q % store.parallelism == store.subtask_index}

    def snapshot_state(self, context: FunctionSnapshotContext) -> None:
        self._state.update(sorted(self._positions.items()))

    @property
    def positions(self) -> dict[int, int]:
        """Owned partition -> byte offset of its next record."""
        return dict(self._positions)

    @property
    def partitions(self) -> list[int]:
        return sorted(self._positions)

    def poll(self, max_records: int | None = None) -> list[LogSlice]:
        """Read up to ``max_records`` records in all (None: everything there is now) across the owned partitions,
        and advance the positions past them. Partitions take turns in being read first."""
        if max_records is not None and max_records < 0:
            raise ValueError(f"max_records must be >= 0 or None, got {max_records}")
        owned: Sequence[int] = self.partitions
        if not owned:
            return []
        k = self._next % len(owned)
        order = list(owned[k:]) + list(owned[:k])
        self._next = k + 1
        slices = []
        budget = max_records
        for partition in order:
            if budget == 0:
                break
            piece = self.source.read(partition, self._positions[partition], budget)
            self._positions[partition] = piece.next_offset
            if len(piece):
                slices.append(piece)
            if budget is not None:
                budget -= len(piece)
        return slices

    def report(self) -> dict[str, Any]:
        """What the batch report keeps of this subtask's source (JSON)."""
        return {"partitions": self.partitions, "positions": {str(p): o for p, o in self._positions.items()}}

    def close(self) -> None:
        """Nothing is held open between polls."""

    def poll_arrow(self, max_records: int | None = None, schema: Any = None) -> Any:
        """:meth:`poll` as one ``pyarrow.Table`` with ``_partition`` and ``_offset`` columns."""
        import pyarrow as pa

        tables = [s.to_arrow(schema) for s in self.poll(max_records)]
        if not tables:
            return pa.table({"_partition": pa.array([], pa.int32()), "_offset": pa.array([], pa.int64())})
        return pa.concat_tables(tables, promote_options="default")
