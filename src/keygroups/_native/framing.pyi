"""Stub for the compiled per-key value framing of keyed state (``_native/framing.pyx``)."""

from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

VALUE: int
LIST: int
MAP: int
TTL: int

def split_list(value: Buffer, ttl: bool) -> tuple[list[bytes], list[int] | None]: ...
def split_map(value: Buffer, ttl: bool) -> tuple[list[bytes], list[bytes], list[int] | None]: ...
def join_list(elements: list[bytes], timestamps: list[int] | None = None) -> bytes: ...
def join_map(keys: list[bytes], values: list[bytes], timestamps: list[int] | None = None) -> bytes: ...
def drop_expired(value: Buffer, deadline: int) -> Any: ...   # value itself, None, or bytes
def upgrade_block(block: Buffer, puts: list[tuple[int, Any, npt.NDArray[np.int64]]], codes: list[int]) -> Any: ...
