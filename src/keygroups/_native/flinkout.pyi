"""Stub for the compiled keygroups → Flink transcoder and key-group block writer (``_native/flinkout.pyx``)."""

from typing import final

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

# source kinds (keygroups' stored forms)
I8: int
I16: int
I32: int
I64: int
F32: int
F64: int
BOOL: int
STR: int
BYTES: int
TUPLE: int
RECORD: int
LIST: int
MAP: int
EXTERNAL: int
# target kinds (Flink serializers)
DELEGATE: int
BYTE: int
SHORT: int
INT: int
LONG: int
FLOAT: int
DOUBLE: int
BOOLEAN: int
CHAR: int
STRING: int
BYTE_ARRAY: int
FLINK_TUPLE: int
ROW: int
FLINK_LIST: int
FLINK_MAP: int
# what a null becomes
NULL_REFUSED: int
NULL_TO_PARENT: int
NULL_AS_NULLABLE: int
NULL_AS_STRING: int
# state kinds
VALUE_STATE: int
LIST_STATE: int
MAP_STATE: int
TIMER_STATE: int
WINDOW_STATE: int
WINDOW_TIMER_STATE: int
WINDOW_LIST_STATE: int
WINDOW_MAP_STATE: int
# how a window map state's user keys sort
USER_KEY_UTF8: int
USER_KEY_I64: int
USER_KEY_I32: int

class UnrepresentableValue(ValueError):
    """A value Flink's serializer of its position cannot hold; ``index``: its key's position in the state."""

    index: int
    def __init__(self, message: str, index: int = -1) -> None: ...

@final
class Op:
    """One position's transcoding: keygroups' ``src`` form read, Flink's ``dst`` serializer written."""

    def __init__(self, src: int, dst: int, children: tuple[Op, ...] = (), *, src_nullable: bool = False,
                 dst_nullable: bool = False, padding: int = 0, null_mode: int = ..., whole: bool = False,
                 row_kind: bool = True, what: str = "") -> None: ...
    @property
    def src(self) -> int: ...
    @property
    def dst(self) -> int: ...
    @property
    def null_mode(self) -> int: ...
    @property
    def padding(self) -> int: ...
    @property
    def src_nullable(self) -> bool: ...
    @property
    def dst_nullable(self) -> bool: ...
    @property
    def whole(self) -> bool: ...
    @property
    def row_kind(self) -> bool: ...
    @property
    def children(self) -> tuple[Op, ...]: ...
    @property
    def what(self) -> str: ...
    @property
    def min_size(self) -> int: ...
    def transcode(self, data: Buffer) -> bytes: ...

@final
class StateTranscoder:
    """One keyed state's entries → Flink (key, value) pairs."""

    def __init__(self, kind: int, key: Op, value: Op | None = None, map_key: Op | None = None, *,
                 ttl: bool = False, allowed_lateness: int = 0, user_key_order: int = 0) -> None: ...
    @property
    def kind(self) -> int: ...
    @property
    def allowed_lateness(self) -> int: ...
    @property
    def user_key_order(self) -> int: ...
    @property
    def ttl(self) -> bool: ...
    @property
    def key(self) -> Op: ...
    @property
    def value(self) -> Op | None: ...
    @property
    def map_key(self) -> Op | None: ...

@final
class BlockWriter:
    """One key group's Flink block at a time."""

    def __init__(self, prefix_bytes: int) -> None: ...
    @property
    def prefix_bytes(self) -> int: ...
    def start(self, key_group: int) -> None: ...
    def add_pairs(self, state_id: int, pairs: list[tuple[bytes, bytes]]) -> None: ...
    def note_windows(self, t: StateTranscoder, keys: Buffer, key_offsets: npt.NDArray[np.int64], values: Buffer,
                     value_offsets: npt.NDArray[np.int64]) -> None: ...
    def add_merging(self, state_id: int, key: Op) -> None: ...
    def add_state(self, state_id: int, t: StateTranscoder, keys: Buffer, key_offsets: npt.NDArray[np.int64],
                  values: Buffer, value_offsets: npt.NDArray[np.int64]) -> tuple[int, int]: ...
    def finish(self) -> bytes | None: ...
