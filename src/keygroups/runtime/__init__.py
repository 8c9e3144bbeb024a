"""The runtime, independent of Spark: the driver's batch protocol (plan a micro-batch, commit it), what one parallel
instance of a keyed job does in one micro-batch, the function API with its timer service, and watermarks."""

from keygroups.runtime.assignment import Assignment, AssignmentDecision, BalancedRanges, FlinkRanges
from keygroups.runtime.driver import BatchPlan, DriverFence, begin_batch, commit_batch
from keygroups.runtime.report import BatchReport, PhaseSeconds
from keygroups.runtime.functions import KeyedProcessFunction, ProcessContext, RuntimeContext, TimerService
from keygroups.runtime.scaling import BatchFigures, ParallelismPolicy, RecordsPerSubtask, TargetBatchDuration
from keygroups.runtime.backends import StateBackendName
from keygroups.runtime.watermarks import LateRecords, WatermarkStrategy
from keygroups.state.timers import NO_WATERMARK, TimeDomain

__all__ = ["BatchPlan", "DriverFence", "KeyedProcessFunction", "ProcessContext", "RuntimeContext", "TimerService",
           "TimeDomain", "WatermarkStrategy", "NO_WATERMARK", "begin_batch", "commit_batch", "BatchFigures",
           "ParallelismPolicy", "RecordsPerSubtask", "TargetBatchDuration", "LateRecords", "StateBackendName",
           "Assignment", "AssignmentDecision", "BalancedRanges", "FlinkRanges", "BatchReport", "PhaseSeconds"]
