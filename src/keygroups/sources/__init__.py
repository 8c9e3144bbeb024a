"""Replayable, partitioned inputs whose read positions live in operator state (FLIP-8): the file log (the embedded
default) and Kafka, and a Kafka sink for a job's output.

Layer: above ``keygroups.state`` (the readers keep their offsets in an operator state store), below
``keygroups.runtime`` (which drives them through its small source protocol); no pyspark here. The Kafka classes need
``confluent-kafka`` (the ``kafka`` extra) only when they are used.
"""

from keygroups.sources.kafka import (
    KAFKA_PARTITIONS_STATE,
    KAFKA_SPLITS_STATE,
    BrokerView,
    KafkaDecodeError,
    KafkaPositionError,
    KafkaSource,
    KafkaSourceError,
    produce_json,
    split_owner,
)
from keygroups.sources.kafka_reader import KafkaSplitReader
from keygroups.sources.kafka_sink import KafkaSink, SinkDelivery
from keygroups.sources.local_broker import LocalKafkaBroker, tansu_binary
from keygroups.sources.log import (
    HEADER_SIZE,
    LogSlice,
    PartitionedLogSource,
    PartitionedLogWriter,
    partition_path,
    staged_log_schema,
    write_partitioned_log,
)
from keygroups.sources.positions import SourcePosition, source_positions
from keygroups.sources.reader import OFFSETS_STATE_NAME, PartitionedLogReader

__all__ = [
    "LogSlice",
    "PartitionedLogSource",
    "PartitionedLogWriter",
    "PartitionedLogReader",
    "write_partitioned_log",
    "partition_path",
    "staged_log_schema",
    "HEADER_SIZE",
    "OFFSETS_STATE_NAME",
    "KafkaSource",
    "KafkaSplitReader",
    "KafkaSourceError",
    "KafkaPositionError",
    "KafkaDecodeError",
    "BrokerView",
    "split_owner",
    "produce_json",
    "KAFKA_SPLITS_STATE",
    "KAFKA_PARTITIONS_STATE",
    "KafkaSink",
    "SinkDelivery",
    "LocalKafkaBroker",
    "tansu_binary",
    "SourcePosition",
    "source_positions",
]
