"""Stub for the compiled framing of many keys' state values at once (``_native/bulkframe.pyx``), what the savepoint
writer builds from whole columns of serialized parts."""

from typing import Any

import numpy as np
import numpy.typing as npt

VALUE: int
LIST: int
MAP: int

def frame_values(kind: int, rows: npt.ArrayLike, elements: tuple[Any, npt.ArrayLike],
                 keys: tuple[Any, npt.ArrayLike] | None = None, stamps: npt.ArrayLike | None = None
                 ) -> tuple[bytes, npt.NDArray[np.int64]]: ...
def gather(data: Any, offsets: npt.ArrayLike, indices: npt.ArrayLike) -> tuple[bytes, npt.NDArray[np.int64]]: ...
def has_repeated_keys(rows: npt.ArrayLike, keys: tuple[Any, npt.ArrayLike]) -> bool: ...
