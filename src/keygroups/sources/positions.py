"""The read positions a checkpoint holds, read from its operator state: what ``keygroups inspect`` shows."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage

__all__ = ["SourcePosition", "source_positions"]


@dataclass(frozen=True)
class SourcePosition:
    """One split of a source in a checkpoint: the subtask that held it, its topic (None for the file log), its
    partition and the offset of the next record to read (a byte offset in a log partition, a Kafka offset)."""

    subtask: int
    topic: str | None
    partition: int
    offset: int


def source_positions(storage: CheckpointStorage, metadata: CheckpointMetadata) -> list[SourcePosition]:
    """Every source split in ``metadata``'s operator state (Kafka's and the file log's), by subtask, topic and
    partition. Reads only the operator state files, which hold a few bytes per split."""
    from keygroups.serializers import Int64Serializer, StrSerializer, TupleSerializer
    from keygroups.sources.kafka import KAFKA_SPLITS_STATE
    from keygroups.sources.reader import OFFSETS_STATE_NAME
    from keygroups.state import ListStateDescriptor, OperatorStateStore

    kinds: dict[str, Any] = {
        KAFKA_SPLITS_STATE: TupleSerializer(StrSerializer(), Int64Serializer(), Int64Serializer()),
        OFFSETS_STATE_NAME: TupleSerializer(Int64Serializer(), Int64Serializer()),
    }
    out: list[SourcePosition] = []
    for handle in metadata.operator_handles:
        names = [n for n in kinds if n in handle.states]
        if not names:
            continue
        store = OperatorStateStore(0, 1, operator_id=handle.operator_id)
        store.restore(storage, dataclasses.replace(metadata, operator_handles=[handle]))
        for name in names:
            for element in store.get_list_state(ListStateDescriptor(name, kinds[name])).get():
                if name == KAFKA_SPLITS_STATE:
                    topic, partition, offset = element
                    out.append(SourcePosition(handle.subtask, str(topic), int(partition), int(offset)))
                else:
                    partition, offset = element
                    out.append(SourcePosition(handle.subtask, None, int(partition), int(offset)))
    return sorted(out, key=lambda p: (p.topic or "", p.partition, p.subtask))
