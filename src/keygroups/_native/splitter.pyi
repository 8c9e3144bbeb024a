"""Type stub of the compiled byte-level list splitter (``_native/splitter.pyx``)."""

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer  # collections.abc.Buffer only exists from Python 3.12

def check_offsets(bounds: npt.NDArray[np.int64], lo: int, hi: int, what: str = ...) -> None: ...
def gather(
    pieces: list[tuple[Buffer, int, npt.NDArray[np.int64]]], what: str = ...
) -> tuple[bytes, npt.NDArray[np.int64]]: ...
def encode_entries(
    key_data: Buffer,
    key_offsets: npt.NDArray[np.int64],
    value_data: Buffer,
    value_offsets: npt.NDArray[np.int64],
) -> tuple[bytes, npt.NDArray[np.int64]]: ...
def decode_entries(
    data: Buffer, offsets: npt.NDArray[np.int64]
) -> tuple[bytes, npt.NDArray[np.int64], bytes, npt.NDArray[np.int64]]: ...
