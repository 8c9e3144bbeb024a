"""Type stub of the compiled serializer codecs (_native/codec.pyx)."""

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

INT64: int
INT32: int
FLOAT64: int
BOOL: int
STR: int
BYTES: int
NULLABLE: int
TUPLE: int
LIST: int
MAP: int
VALUE: int
EXTERNAL: int
MAX_DEPTH: int
ALLOWED_VALUE_TYPES: str

@disjoint_base
class Codec:
    """The compiled form of one serializer (a tree for nested ones)."""

    @property
    def kind(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def min_size(self) -> int: ...
    @property
    def fixed_size(self) -> int: ...
    @property
    def children(self) -> tuple[Codec, ...]: ...
    @property
    def external(self) -> Any: ...
    def __init__(self, kind: int, name: str, children: tuple[Codec, ...] = ..., external: Any = ...) -> None: ...
    def encode(self, value: Any) -> bytes: ...
    def decode(self, data: Any) -> Any: ...
    def encode_many(self, values: Sequence[Any] | npt.NDArray[Any]) -> tuple[bytes, npt.NDArray[np.int64]]: ...
    def decode_many(self, data: Any, offsets: Sequence[int] | npt.NDArray[np.int64]) -> list[Any]: ...

def copy_json_value(value: Any) -> Any: ...
