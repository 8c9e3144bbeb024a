"""Stub for the compiled per-key value framing of keyed state (``_native/framing.pyx``)."""

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

VALUE: int
LIST: int
MAP: int
TTL: int

def split_list(
    value: Buffer, ttl: bool
) -> tuple[bytes, npt.NDArray[np.int64], npt.NDArray[np.int64] | None]: ...
def split_map(
    value: Buffer, ttl: bool
) -> tuple[bytes, npt.NDArray[np.int64], bytes, npt.NDArray[np.int64], npt.NDArray[np.int64] | None]: ...
def join_list(data: Buffer, offsets: npt.NDArray[np.int64], timestamps: Sequence[int] | None = None) -> bytes: ...
def join_map(
    key_data: Buffer,
    key_offsets: npt.NDArray[np.int64],
    value_data: Buffer,
    value_offsets: npt.NDArray[np.int64],
    timestamps: Sequence[int] | None = None,
) -> bytes: ...
def drop_expired(value: Buffer, deadline: int) -> Any: ...   # value itself, None, or bytes
def upgrade_block(block: Buffer, puts: list[tuple[int, Any, npt.NDArray[np.int64]]], codes: list[int]) -> Any: ...
