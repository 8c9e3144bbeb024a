"""The user-facing function API of a keyed job, in Flink's shape (``KeyedProcessFunction``) and Python casing.

A function declares its state in :meth:`KeyedProcessFunction.open` through descriptors, then sees one record at a
time (or, vectorized, all of one key's records of a micro-batch as an Arrow table) with the key already set, so every
state it reads or writes is the current key's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa


class RuntimeContext:
    """What :meth:`KeyedProcessFunction.open` receives: state registration and where the function runs."""

    def __init__(self, backend: Any, *, job_name: str, subtask_index: int, parallelism: int, max_parallelism: int,
                 checkpoint_id: int) -> None:
        self._backend = backend
        self.job_name = job_name
        self.subtask_index = subtask_index
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.checkpoint_id = checkpoint_id

    @property
    def key_group_range(self) -> Any:
        return self._backend.key_group_range

    def get_state(self, descriptor: Any) -> Any:
        """The keyed state for ``descriptor`` (any of the five kinds); like Flink's ``getState`` and friends."""
        return self._backend.get_state(descriptor)

    # Flink's per-kind names, for readers coming from Flink; they all resolve by the descriptor's kind.
    get_list_state = get_state
    get_map_state = get_state
    get_reducing_state = get_state
    get_aggregating_state = get_state


class ProcessContext:
    """What :meth:`KeyedProcessFunction.process_element` receives along with each record."""

    __slots__ = ("current_key", "current_key_group", "timestamp", "checkpoint_id", "subtask_index")

    def __init__(self, *, checkpoint_id: int, subtask_index: int) -> None:
        self.current_key: Any = None
        self.current_key_group: int = -1
        self.timestamp: int | None = None
        self.checkpoint_id = checkpoint_id
        self.subtask_index = subtask_index


class KeyedProcessFunction:
    """Subclass and implement :meth:`process_element` (or :meth:`process_key_batch` for the vectorized form).

    Output records are tuples or dicts in the order / with the names of the job's output schema. A function must be
    deterministic given its state and input: a micro-batch that fails is run again from the last checkpoint."""

    def open(self, context: RuntimeContext) -> None:
        """Declare state here: ``self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))``."""

    def process_element(self, record: dict[str, Any], context: ProcessContext) -> Iterable[Any] | None:
        """Handle one record of the current key; return (or yield) output records, or None."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement process_element(record, context) or process_key_batch(...)"
        )

    def process_key_batch(self, key: Any, records: pa.Table, context: ProcessContext) -> Iterable[Any] | pa.Table | None:
        """Vectorized form: all records of one key in this micro-batch, in order, as an Arrow table. Override it
        instead of process_element to work on columns; the default calls process_element per record."""
        out: list[Any] = []
        columns = [records.column(i).to_pylist() for i in range(records.num_columns)]
        names = records.column_names
        for values in zip(*columns):
            result = self.process_element(dict(zip(names, values)), context)
            if result is not None:
                out.extend(result)
        return out

    def close(self) -> None:
        """Called once the subtask's records are processed, before its snapshot."""
