"""The runtime, independent of Spark: the driver's batch protocol (plan a micro-batch, commit it), what one parallel
instance of a keyed job does in one micro-batch, and the function API."""

from keygroups.runtime.driver import BatchPlan, DriverFence, begin_batch, commit_batch
from keygroups.runtime.functions import KeyedProcessFunction, ProcessContext, RuntimeContext
from keygroups.runtime.scaling import BatchFigures, ParallelismPolicy, RecordsPerSubtask, TargetBatchDuration

__all__ = ["BatchPlan", "DriverFence", "KeyedProcessFunction", "ProcessContext", "RuntimeContext", "begin_batch",
           "commit_batch", "BatchFigures", "ParallelismPolicy", "RecordsPerSubtask", "TargetBatchDuration"]
