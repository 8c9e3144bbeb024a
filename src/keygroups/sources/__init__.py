"""Replayable, partitioned inputs whose read positions live in operator state (FLIP-8).

Layer: above ``keygroups.state`` (the reader keeps its offsets in an operator state store), below
``keygroups.spark``; no pyspark here.
"""

from keygroups.sources.log import (
    HEADER_SIZE,
    LogSlice,
    PartitionedLogSource,
    PartitionedLogWriter,
    partition_path,
    write_partitioned_log,
)
from keygroups.sources.reader import OFFSETS_STATE_NAME, PartitionedLogReader

__all__ = [
    "LogSlice",
    "PartitionedLogSource",
    "PartitionedLogWriter",
    "PartitionedLogReader",
    "write_partitioned_log",
    "partition_path",
    "HEADER_SIZE",
    "OFFSETS_STATE_NAME",
]
