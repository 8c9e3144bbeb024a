"""Type stub of the compiled frame scanner of the partitioned log (``_native/logframes.pyx``)."""

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer  # collections.abc.Buffer only exists from Python 3.12

def scan_frames(
    data: Buffer,
    start: int,
    max_records: int,
    max_record_bytes: int,
    crc32c_fn: Callable[..., int],
    payloads: bool = ...,
) -> tuple[npt.NDArray[np.int64], int, bytes]: ...
