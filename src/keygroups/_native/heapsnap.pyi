"""Stub for the heap backend's compiled snapshot sections (``_native/heapsnap.pyx``)."""

from typing import Any

from keygroups._native.framing import Encoder, ValueWriter
from keygroups._native.statecore import Layer

def delta_section(delta: dict[Any, Any], keys: Encoder, values: ValueWriter, missing: Any,
                  deadline: int | None = None) -> tuple[Any, Any, Any]: ...
def full_section(entries: dict[Any, Any], layers: list[Layer] | None, keys: Encoder, values: ValueWriter,
                 missing: Any, deadline: int | None = None) -> tuple[bytes, Any, Any] | None: ...
def estimated_entries(maps: list[dict[Any, Any]], layers: list[list[Layer] | None], n: int) -> int: ...
