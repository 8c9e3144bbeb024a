"""keygroups on Spark: Flink-exact keyBy for RDDs and DataFrames, the job runner, and state as DataFrames. The only
package, with ``keygroups.cli``, that imports pyspark.

- :class:`KeyGroupPartitioner` and :func:`key_by`: RDDs partitioned so that partition *i* holds subtask *i*'s keys.
- :func:`with_key_groups`: a DataFrame plus Flink-exact key-group (and operator-index) columns, computed in the JVM.
- :func:`partition_by_key_group`: a DataFrame whose Spark partition *i* holds exactly subtask *i*'s records.
- :class:`KeyedJob`: the stateful job runner (one micro-batch = one checkpoint, any parallelism per batch), a thin
  layer over :mod:`keygroups.runtime`'s driver; :class:`BatchResult` is what one batch did.
- :func:`read_checkpoint_files`: Parquet files a batch wrote under a checkpoint location (its output, its staged
  input) as a DataFrame, on any location the storage reaches (``s3://`` without Hadoop's S3A connector too).
- ``spark.read.format("keygroups")`` (:class:`KeyGroupsDataSource`, registered with the active session on import,
  :func:`register` for a later one): a checkpoint's or savepoint's state as a DataFrame; :func:`write_savepoint`
  (with :class:`StateColumn`): a savepoint from a DataFrame, which a ``KeyedJob`` starts from.
- Metrics (:mod:`keygroups.metrics`) where Spark users look: ``.option("view", "metrics")`` of that source reads the
  metrics a job keeps beside its checkpoints; :class:`KeyGroupsProgressListener` pairs each streaming query progress
  with the keygroups metrics of the same batch (:mod:`keygroups.spark.metrics`).

Everything but the RDD half works over Spark Connect too, with the same bits: there is no py4j gateway there, so
the key-group engine "auto" picks the portable ones, and the runner starts its tasks from ``spark.range`` rather than
a SparkContext. Connect has no RDDs: :func:`key_by` refuses a DataFrame and names :func:`partition_by_key_group`.
:mod:`keygroups.spark.local_connect` serves a Connect session from a local classic session's JVM (tests, the demo's
``--connect``, benchmarks). The state data source works there too (:func:`register` it with the Connect session),
and :func:`write_savepoint` asks the server for Spark's default parallelism, which a Connect client cannot read.
"""

from keygroups.runtime.state_writer import StateColumn
from keygroups.spark.columns import with_key_groups
from keygroups.spark.job import BatchResult, KeyedJob, read_checkpoint_files
from keygroups.spark.metrics import KeyGroupsProgressListener, ProgressWithMetrics
from keygroups.spark.partitioner import KeyGroupPartitioner, key_by, partition_by_key_group
from keygroups.spark.records import row_records
from keygroups.spark.state_source import KeyGroupsDataSource, _register_with_active_session, register, write_savepoint

_register_with_active_session()

__all__ = ["BatchResult", "KeyGroupPartitioner", "KeyGroupsDataSource", "KeyGroupsProgressListener", "KeyedJob",
           "ProgressWithMetrics", "StateColumn", "key_by",
           "partition_by_key_group", "read_checkpoint_files", "register", "row_records", "with_key_groups",
           "write_savepoint"]
