"""The subtask runtime: what one parallel instance of a keyed job does in one micro-batch, independent of Spark."""

from keygroups.runtime.functions import KeyedProcessFunction, ProcessContext, RuntimeContext

__all__ = ["KeyedProcessFunction", "ProcessContext", "RuntimeContext"]
