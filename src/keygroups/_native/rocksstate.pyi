"""Stub for the compiled hot paths of the RocksDB keyed state backend (``_native/rocksstate.pyx``)."""

from typing import Any

import numpy as np
from numpy.typing import NDArray

from typing_extensions import disjoint_base

from keygroups._native.framing import Encoder, ValueWriter
from keygroups._native.statecore import KeyContext

@disjoint_base
class RocksValueCore:
    def __init__(self, store: Any, descriptor: Any, backend: Any) -> None: ...
    def value(self) -> Any: ...
    def update(self, value: Any) -> None: ...
    def clear(self) -> None: ...

def cached_values(cache: dict[Any, Any], pending: dict[Any, int], keys: list[Any], group_indexes: list[int],
                  mutable: bool, default: Any, copy: Any) -> list[Any]:
    """The cached values of ``keys`` as ``value()`` reads them (the default where the cache holds MISSING)."""

def cache_writes(cache: dict[Any, Any], pending: dict[Any, int], keys: list[Any], group_indexes: list[int],
                 values: list[Any]) -> None:
    """Set each key's cached value (None: deleted) and mark it pending, as ``update()`` does per key."""

def uncached(cache: dict[Any, Any], keys: list[Any]) -> list[int]:
    """The positions in ``keys`` of the keys ``cache`` does not hold, ascending."""

def flush_values(pending: dict[Any, int], cache: dict[Any, Any], keys: Encoder, values: ValueWriter,
                 group_prefixes: list[bytes], state_id: bytes, skip: dict[Any, Any] | None = None
                 ) -> tuple[list[bytes], list[bytes], list[bytes], list[Any], NDArray[np.int64], NDArray[np.int64]]:
    """A value table's pending writes: (put database keys, values, deleted database keys, each ascending by
    database key; the pending keys in pending order; the positions among them of the put and the deleted keys, in
    the same ascending order). ``skip``: pending keys it holds are left out, as if not pending."""

def delta_values(pending: dict[Any, int], cache: dict[Any, Any], keys: Encoder, values: ValueWriter,
                 group_prefixes: list[bytes], state_id: bytes, start: int, full: Any, ttl: bool, deadline: int | None
                 ) -> list[tuple[int, tuple[tuple[bytes, NDArray[np.int64]], tuple[bytes, NDArray[np.int64]]] | None,
                                 tuple[bytes, NDArray[np.int64]] | None]]:
    """The pending keys' changes as one state's delta sections per key group (key groups in ``full`` left out; a
    TTL put stamped at or before ``deadline``: a delete), encoded straight into them: (key group, puts, deletes)."""

def write_sorted_rows(writer: Any, runs: list[tuple[list[bytes], list[bytes] | None]]) -> int:
    """Write the runs' rows (sorted keys with their values; None: deletes) into an open SST file writer, merged
    into one ascending order; the rows written."""

def current_keys(ctx: KeyContext, keys: list[Any]) -> tuple[list[Any], list[int]]:
    """``keys`` made current in turn: (the keys as the backend keys them, their key-group indexes)."""

def fill_cache(cache: dict[Any, Any], pending: dict[Any, int], keys: list[Any], order: list[int],
               raw: list[bytes | None], decode_many: Any, mutable: bool, group_indexes: list[int]) -> None:
    """Cache the values read for ``keys[order[i]]`` (``raw[i]``; None: not stored), decoded together."""

def cached_in_groups(cache: dict[Any, Any], ctx: KeyContext, mark: Any, key_groups: Any,
                     skip: tuple[dict[Any, Any], ...] = ()) -> dict[Any, int]:
    """The cached keys (but ``mark`` and the keys of the dicts in ``skip``) in ``key_groups`` (absolute), key ->
    key-group index, hashed in C as ``ctx.set_current_key`` hashes them."""

def full_sections(runs: list[tuple[list[bytes], list[bytes]]], full: Any, ttl: bool, deadline: int | None
                  ) -> list[tuple[int, tuple[tuple[bytes, NDArray[np.int64]], tuple[bytes, NDArray[np.int64]]]]]:
    """One state's full-block sections of the key groups in ``full``, cut from a flush's rows (runs of ascending
    database keys with their values, merged; a TTL value stamped at or before ``deadline`` left out): (key group,
    puts)."""
