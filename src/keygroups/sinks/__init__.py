"""Sinks that run inside a keyed job's tasks: each subtask writes its output where no reader looks, pre-commits it
with the checkpoint, and the driver makes it visible once the checkpoint is committed (Flink's two-phase-commit
sinks; see :mod:`keygroups.runtime.sink` for the protocol and the guarantee).

- :class:`ParquetSink`: Parquet files in a directory (local or an fsspec URL such as ``s3://``), exactly once:
  a reader of the directory (``spark.read.parquet``, ``pyarrow.dataset``) sees a batch's files only once its
  checkpoint is committed, and never twice;
- :class:`CountingSink`: counts the output rows per checkpoint (exactly once; for tests and benchmarks);
- :class:`TaskFunctionSink`: calls a function with each output record batch in the task (at least once).

Give one to ``KeyedJob(..., sink=...)`` (or the test harness's ``sink=``); write your own by subclassing
:class:`Sink` and :class:`SinkWriter`.
"""

from keygroups.runtime.sink import Sink, SinkCommitError, SinkCommittable, SinkContext, SinkWriter
from keygroups.sinks.counting import CountingSink, TaskFunctionSink
from keygroups.sinks.parquet import ParquetSink

__all__ = ["CountingSink", "ParquetSink", "Sink", "SinkCommitError", "SinkCommittable", "SinkContext", "SinkWriter",
           "TaskFunctionSink"]
