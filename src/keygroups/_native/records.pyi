"""Type stub of the compiled record codec (_native/records.pyx)."""

from collections.abc import Sequence
from typing import Any, final

import numpy as np
import numpy.typing as npt

INT8: int
INT16: int
INT32: int
INT64: int
FLOAT32: int
FLOAT64: int
BOOL: int
STRING: int
BINARY: int
DATE: int
TIMESTAMP: int
DECIMAL: int
LIST: int
MAP: int
RECORD: int
TUPLE_FORM: int
DICT_FORM: int
CLASS_FORM: int
FACTORY_FORM: int

@final
class Node:
    """One position of a record schema (a field, a list element, a map key or value)."""

    @property
    def kind(self) -> int: ...
    @property
    def nullable(self) -> bool: ...
    @property
    def what(self) -> str: ...
    @property
    def min_size(self) -> int: ...
    @property
    def children(self) -> tuple[Node, ...]: ...
    @property
    def names(self) -> tuple[str, ...]: ...
    @property
    def form(self) -> int: ...
    @property
    def cls(self) -> type | None: ...
    def __init__(self, kind: int, nullable: bool, what: str, children: tuple[Node, ...] = ...,
                 names: tuple[str, ...] = ..., form: int = ..., cls: type | None = ..., unit: int = ...,
                 tz: Any = ..., precision: int = ..., scale: int = ...) -> None: ...
    def encode(self, value: Any) -> bytes: ...
    def check(self, value: Any) -> None: ...
    def decode(self, data: Any) -> Any: ...
    def encode_many(self, values: Sequence[Any]) -> tuple[bytes, npt.NDArray[np.int64]]: ...
    def decode_many(self, data: Any, offsets: Sequence[int] | npt.NDArray[np.int64]) -> list[Any]: ...
