"""Stub for the compiled writer of keyed snapshot blocks into RocksDB SST files (``_native/sstload.pyx``)."""

from collections.abc import Callable
from typing import Any

VALUE: int
LIST: int
MAP: int

def write_key_group(writer: Any, key_group: int, chain: list[tuple[Any, bool, list[Any], list[Any], list[int]]],
                    states: list[tuple[int, int, bool, int | None] | tuple[int, int, bool, int | None, str]],
                    tombstones: bool = False) -> tuple[int, int]: ...
def value_sections(iterator: Any, key_group: int, states: dict[int, tuple[int, int, bool, int | None]]
                   ) -> list[tuple[int, tuple[bytes, Any], tuple[bytes, Any]]] | None: ...
def delta_sections(put_keys: list[bytes], put_values: list[bytes], deleted_keys: list[bytes], full: Any, ttl: bool,
                   deadline: int | None) -> list[tuple[int, Any, Any]]: ...
def map_delta_sections(db_keys: list[bytes], values: list[Any], read_rows: Callable[[bytes], Any], full: Any,
                       ttl: bool, deadline: int | None) -> list[tuple[int, Any, Any]]: ...
