"""Type stub of the compiled Flink savepoint import (_native/flinkin.pyx): the checked key-group block scanner and
the Flink -> keygroups value transcoder."""

from typing import final

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

LONG: int
INT: int
SHORT: int
BYTE: int
DOUBLE: int
FLOAT: int
BOOL: int
CHAR: int
STRING: int
BYTES: int
TUPLE: int
ROW: int
LIST: int
MAP: int
NULLABLE: int
VALUE_STATE: int
LIST_STATE: int
MAP_STATE: int
TIMER_STATE: int

@final
class Node:
    """One position of a Flink serializer tree, compiled: reads Flink's bytes, writes keygroups' serializer's."""

    @property
    def kind(self) -> int: ...
    @property
    def record(self) -> bool: ...
    @property
    def children(self) -> tuple[Node, ...]: ...
    @property
    def padding(self) -> int: ...
    @property
    def row_kind(self) -> bool: ...
    @property
    def length(self) -> int: ...
    def __init__(self, kind: int, record: bool = False, children: tuple[Node, ...] = (), padding: int = 0,
                 row_kind: bool = False) -> None: ...
    def transcode(self, value: Buffer) -> bytes: ...

@final
class BlockScan:
    """Where each entry of one key group's block lies (state id, key and value spans)."""

    @property
    def block(self) -> Buffer: ...
    @property
    def n(self) -> int: ...
    def __len__(self) -> int: ...
    def arrays(self) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64], npt.NDArray[np.int64],
                              npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
    def counts(self, n_states: int) -> list[int]: ...

def scan_block(block: Buffer, key_group: int, prefix_bytes: int, n_states: int, where: str) -> BlockScan: ...

@final
class StatePlan:
    """One keyed state's compiled import: Flink entries -> keygroups' keys and framed values."""

    @property
    def kind(self) -> int: ...
    @property
    def ttl(self) -> bool: ...
    @property
    def name(self) -> str: ...
    @property
    def namespaced(self) -> bool: ...
    def __init__(self, kind: int, key: Node, value: Node | None = None, user_key: Node | None = None,
                 ttl: bool = False, name: str = "", namespace: Node | None = None) -> None: ...
    def transcode(self, scan: BlockScan, state_id: int, order: KeyOrder | None = None
                  ) -> tuple[int, bytes, npt.NDArray[np.int64], bytes, npt.NDArray[np.int64]]: ...

@final
class KeyOrder:
    """The last order a key group's keys were sorted in, shared by its states' ``StatePlan.transcode``."""

    def __init__(self) -> None: ...
