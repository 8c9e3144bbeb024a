"""Stub for the kernels of the declarative keyed aggregates (``_native/aggregates.pyx``)."""

from typing import Any, final

import numpy as np
import numpy.typing as npt

SUM: int
MIN: int
MAX: int
FIRST: int
LAST: int

def fold_runs(
    op: int,
    values: npt.NDArray[Any],
    valid: npt.NDArray[np.uint8],
    runs: npt.NDArray[np.int64],
    acc: npt.NDArray[Any],
    has: npt.NDArray[np.uint8],
    row_acc: npt.NDArray[Any],
    row_has: npt.NDArray[np.uint8],
) -> int:
    """Fold each run's valid values into its accumulator in row order; -1, or the row an int64 sum overflowed at."""

def count_runs(
    valid: npt.NDArray[np.uint8],
    runs: npt.NDArray[np.int64],
    acc: npt.NDArray[np.int64],
    has: npt.NDArray[np.uint8],
    row_acc: npt.NDArray[np.int64],
    row_has: npt.NDArray[np.uint8],
    n_rows: int,
) -> int:
    """Count each run's valid rows onto its accumulator; -1, or the row a count would overflow at."""

@final
class Int64Index:
    """A hash index from int64 keys to rows (>= 0)."""

    def __init__(self, capacity: int = 0) -> None: ...
    def __len__(self) -> int: ...
    def get(self, key: int) -> int: ...
    def lookup(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]: ...
    def insert(self, keys: npt.NDArray[np.int64], rows: npt.NDArray[np.int64]) -> None: ...
    def remove(self, keys: npt.NDArray[np.int64]) -> None: ...
    def clear(self) -> None: ...
    def __reduce__(self) -> Any: ...

def group_key_order(groups: npt.NDArray[np.int32], keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The stable order that sorts rows by key group (0 <= g < 32768), then by signed int64 key."""
