"""Stub for the compiled writer of keyed snapshot blocks into RocksDB SST files (``_native/sstload.pyx``)."""

from typing import Any

VALUE: int
LIST: int
MAP: int

def write_key_group(writer: Any, key_group: int, chain: list[tuple[Any, bool, list[Any], list[Any], list[int]]],
                    states: list[tuple[int, int, bool, int | None]]) -> tuple[int, int]: ...
