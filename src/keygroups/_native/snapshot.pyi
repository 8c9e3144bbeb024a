"""Stub for the compiled keyed snapshot format (``_native/snapshot.pyx``)."""

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer, disjoint_base

FILE_MAGIC: bytes
INDEX_MAGIC: bytes
FORMAT_VERSION: int
READ_VERSIONS: tuple[int, ...]
HEADER_FIXED_SIZE: int
FOOTER_SIZE: int
BLOCK_OVERHEAD: int
BLOCK_OVERHEADS: dict[int, int]
MAX_ITEM_SIZE: int
BLOCK_FULL: int
BLOCK_LINKED: int
PREDECESSOR_OFFSET: int
FLAGS_OFFSET: int
OP_PUT: int
OP_DELETE: int

@disjoint_base
class Packed:
    """n serialized items back to back: item i is ``data[offsets[i]:offsets[i + 1]]``."""

    @property
    def data(self) -> Buffer: ...
    @property
    def offsets(self) -> npt.NDArray[np.int64]: ...
    def __init__(self, data: Buffer, offsets: npt.ArrayLike) -> None: ...
    def __len__(self) -> int: ...

def encode_block(
    key_group: int,
    sections: Iterable[tuple[int, Sequence[Buffer] | Packed, Sequence[Buffer] | Packed]],
    n_states: int,
    *,
    full: bool = True,
    deletes: Iterable[tuple[int, Sequence[Buffer] | Packed]] = (),
    predecessor: tuple[int, int] | None = None,
    file_seed: int = 0,
    version: int = 4,
) -> bytes: ...
def find_key(buffer: Buffer, key_offsets: npt.NDArray[np.int64], key: Buffer) -> int: ...
def parse_block(
    buffer: Buffer,
    expected_key_group: int,
    n_states: int,
    verify_checksum: bool = True,
    copy: bool = False,
    version: int = 4,
    file_seed: int = 0,
) -> tuple[int, list[tuple[int, list[Any], list[Any]]], list[tuple[int, list[Any]]]]: ...   # memoryview or bytes items
def parse_block_offsets(
    buffer: Buffer,
    expected_key_group: int,
    n_states: int,
    verify_checksum: bool = True,
    version: int = 4,
    file_seed: int = 0,
) -> tuple[
    int,
    list[tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64]]],
    list[tuple[int, npt.NDArray[np.int64]]],
]: ...
def encode_empty_blocks(
    first_key_group: int,
    full: bool,
    pred_checkpoints: npt.NDArray[np.int64],
    pred_checksums: npt.NDArray[np.int64],
    file_seed: int = 0,
) -> tuple[bytes, npt.NDArray[np.uint32]]: ...
def encode_header(first_key_group: int, key_group_count: int, meta: bytes) -> bytes: ...
def parse_header(buffer: Buffer) -> tuple[int, int, int, bytes, int]: ...
def encode_index(offsets: list[int]) -> bytes: ...
def parse_index(buffer: Buffer, header_size: int, key_group_count: int) -> list[int]: ...
