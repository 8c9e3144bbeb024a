"""A chain (full block, then deltas) of TTL state restored on every path gives "apply every block in order, then drop
what expired at restore time": an expired later write shadows an older live write of the same key, never lets it come
back.

TTL stamps need not grow along a chain: the processing-time clock may step back (another host's skewed clock, a
clock set back), and an event-time entry written before the first watermark is stamped ``EVENT_TIME_NOT_STARTED``
(later than any watermark) while the same key written later is stamped with the watermark. So a key's older block
can hold a value that outlives the newer block's value; a restore that drops the newer expired value and then keeps
the older row brings back a value the job overwrote.

Paths: RocksDB's compiled restore (``SstRestore``), its row-by-row restore of migrating states (values read and
re-written in Python: a stored Int32 value state registered as Int64), the migration at registration of a state
restored unregistered, a restore across a max-parallelism change, a heap backend's lazy and eager restores and the
full snapshot a restored backend writes, and the warm paths: a kept heap backend resuming and a kept RocksDB
database catching up on blocks another backend wrote.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups import key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.serializers import Int32Serializer, Int64Serializer
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    ValueStateDescriptor,
)
from keygroups.state import rocksdb as rocksdb_module
from keygroups.state.warm import WarmResume

MAXP = 8
TTL_S = 10
STORED = Int32Serializer      # the values' serializer the chain is written with
MIGRATED = Int64Serializer    # registered on restore: the stored bytes migrate (read as Int32, written as Int64)


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def descriptors(value_serializer: Callable[[], Any]) -> dict[str, Any]:
    config = StateTtlConfig.new_builder(TTL_S).cleanup_full_snapshot().build()
    out = {"value": ValueStateDescriptor("value", value_serializer()),
           "list": ListStateDescriptor("list", value_serializer()),
           "map": MapStateDescriptor("map", Int64Serializer(), value_serializer())}
    for d in out.values():
        d.enable_time_to_live(config)
    return out


def register(b: Any, value_serializer: Callable[[], Any]) -> dict[str, Any]:
    return {name: b.get_state(d) for name, d in descriptors(value_serializer).items()}


def heap(clock: Clock, maxp: int = MAXP, **kw: Any) -> HeapKeyedStateBackend:
    return HeapKeyedStateBackend(key_group_range(maxp, 1, 0), maxp, Int64Serializer(), clock=clock, max_chain=1000,
                                 **kw)


def rocks(clock: Clock, maxp: int = MAXP, **kw: Any) -> RocksDBKeyedStateBackend:
    return RocksDBKeyedStateBackend(key_group_range(maxp, 1, 0), maxp, Int64Serializer(), clock=clock,
                                    max_chain=1000, **kw)


def checkpoint(b: Any, storage: CheckpointStorage, checkpoint_id: int) -> CheckpointMetadata:
    handle = b.snapshot(checkpoint_id, storage).result(60)
    previous = storage.latest()
    handles = carry_forward(previous, [handle]) if previous is not None else [handle]
    storage.commit(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="ttl-chain", timestamp_ms=0,
                                      max_parallelism=b.max_parallelism, parallelism=1, keyed_handles=handles,
                                      operator_handles=[], properties={}))
    return storage.load(checkpoint_id)


def read(states: dict[str, Any], b: Any, keys: range) -> dict[int, tuple[Any, list[Any], dict[Any, Any]]]:
    out = {}
    for k in keys:
        b.set_current_key(k)
        got = (states["value"].value(), list(states["list"].get() or []), dict(states["map"].items()))
        if got != (None, [], {}):
            out[k] = got
    return out


# ---- the restore paths: each gives a backend restored from ``metadata`` at ``now``, and its registered states ----
Restored = Iterator[tuple[Any, dict[str, Any]]]


@contextlib.contextmanager
def rocks_compiled(storage: CheckpointStorage, metadata: CheckpointMetadata, now: float, _: str) -> Restored:
    """Registered before the restore with the stored serializers: SstRestore merges the chain, drops what expired."""
    with rocks(Clock(now)) as b:
        states = register(b, STORED)
        b.restore(storage, metadata)
        yield b, states


@contextlib.contextmanager
def rocks_compiled_unregistered(storage, metadata, now, _) -> Restored:
    with rocks(Clock(now)) as b:
        b.restore(storage, metadata)
        yield b, register(b, STORED)


@contextlib.contextmanager
def rocks_migrating_rows(storage, metadata, now, _) -> Restored:
    """Registered before the restore with new serializers: the blocks are applied row by row, migrated in Python."""
    with rocks(Clock(now)) as b:
        states = register(b, MIGRATED)
        b.restore(storage, metadata)
        assert not b._gathered   # the row path, not the compiled restore
        yield b, states


@contextlib.contextmanager
def rocks_migrated_on_registration(storage, metadata, now, _) -> Restored:
    with rocks(Clock(now)) as b:
        b.restore(storage, metadata)
        yield b, register(b, MIGRATED)


@contextlib.contextmanager
def rocks_rekeyed(storage, metadata, now, _) -> Restored:
    """Another max parallelism: each old key group's chain is merged, then re-keyed (row by row: migrating)."""
    with rocks(Clock(now), maxp=2 * MAXP) as b:
        states = register(b, MIGRATED)
        b.restore(storage, metadata)
        yield b, states


@contextlib.contextmanager
def heap_lazy_migrating(storage, metadata, now, _) -> Restored:
    with heap(Clock(now)) as b:
        states = register(b, MIGRATED)
        b.restore(storage, metadata)
        yield b, states


@contextlib.contextmanager
def heap_eager(storage, metadata, now, _) -> Restored:
    with heap(Clock(now)) as b:
        states = register(b, STORED)
        b.restore(storage, metadata, lazy=False)
        yield b, states


@contextlib.contextmanager
def heap_rekeyed(storage, metadata, now, _) -> Restored:
    with heap(Clock(now), maxp=2 * MAXP) as b:
        states = register(b, STORED)
        b.restore(storage, metadata)
        yield b, states


def _snapshot_of_restored(make: Callable[..., Any], serializer: Callable[[], Any]):
    @contextlib.contextmanager
    def path(storage, metadata, now, tmp) -> Restored:
        """A backend restored (nothing read) writes a full snapshot (its merge drops what expired), read back."""
        again = CheckpointStorage(os.path.join(tmp, f"again-{make.__name__}-{serializer.__name__}-{now}"))
        with make(Clock(now), incremental=False) as b:
            register(b, serializer)
            b.restore(storage, metadata)
            written = checkpoint(b, again, metadata.checkpoint_id + 1)
        with heap(Clock(now)) as b:
            b.restore(again, written)
            yield b, register(b, MIGRATED)
    path.__name__ = f"{make.__name__}_full_snapshot_of_restored_{serializer.__name__}"
    return path


COLD_PATHS = [rocks_compiled, rocks_compiled_unregistered, rocks_migrating_rows, rocks_migrated_on_registration,
              rocks_rekeyed, heap_lazy_migrating, heap_eager, heap_rekeyed,
              _snapshot_of_restored(heap, STORED), _snapshot_of_restored(heap, MIGRATED),
              _snapshot_of_restored(rocks, STORED), _snapshot_of_restored(rocks, MIGRATED)]


# ---- one chain where a key's newer write expires before its older one -------------------------------------------
def older_outlives_newer(b: Any, clock: Clock, storage: CheckpointStorage, first_id: int = 1) -> CheckpointMetadata:
    """Key 1 written at t = 20 s (checkpoint first_id, full), then at t = 5 s, the clock having stepped back
    (checkpoint first_id + 1, a delta: still live at 5 s). At 20 s the newer write expired, the older did not."""
    s = register(b, STORED)
    clock.now = 20.0
    b.set_current_key(1)
    s["value"].update(1)
    s["list"].add(1)
    s["map"].put(1, 1)
    b.set_current_key(2)   # a key written once, still live at 20 s
    s["value"].update(7)
    checkpoint(b, storage, first_id)
    clock.now = 5.0
    b.set_current_key(1)
    s["value"].update(2)
    s["list"].clear()
    s["list"].add(2)
    s["map"].put(1, 2)
    return checkpoint(b, storage, first_id + 1)


EXPECTED_AT_20 = {2: (7, [], {})}   # key 1's newest values (t = 5 s) expired at 20 s: nothing of key 1 remains


@pytest.mark.parametrize("path", COLD_PATHS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("writer", [heap, rocks], ids=["heap writes", "rocksdb writes"])
def test_an_expired_newer_write_is_not_replaced_by_an_older_live_one(tmp_path, path, writer):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    clock = Clock()
    with writer(clock) as b:
        metadata = older_outlives_newer(b, clock, storage)
    newest = [h for h in metadata.keyed_handles if h.checkpoint_id == 2]
    assert newest and not any(h.is_full(kg) for h in newest for kg in range(MAXP))   # a chain: full, then a delta
    with path(storage, metadata, 20.0, str(tmp_path)) as (restored, states):
        assert read(states, restored, range(4)) == EXPECTED_AT_20
    with path(storage, metadata, 12.0, str(tmp_path)) as (restored, states):   # nothing expired at 12 s
        assert read(states, restored, range(4)) == {1: (2, [2], {1: 2}), 2: (7, [], {})}


def test_a_kept_heap_backend_resuming_drops_the_older_value_under_an_expired_newer_one(tmp_path):
    """The kept backend holds key 1 from t = 20 s; another backend wrote it again at t = 5 s; resumed at 20 s."""
    storage = CheckpointStorage(str(tmp_path / "chk"))
    clock = Clock()
    kept = heap(clock)
    try:
        s = register(kept, STORED)
        clock.now = 20.0
        kept.set_current_key(1)
        s["value"].update(1)
        s["list"].add(1)
        s["map"].put(1, 1)
        s["value"].value()   # decoded, in memory
        first = checkpoint(kept, storage, 1)
        with rocks(clock) as other:
            other.restore(storage, first)
            o = register(other, STORED)
            clock.now = 5.0
            other.set_current_key(1)
            o["value"].update(2)
            o["list"].clear()
            o["list"].add(2)
            o["map"].put(1, 2)
            second = checkpoint(other, storage, 2)
        clock.now = 20.0
        assert kept.resume(storage, second) is not None
        assert read(register(kept, STORED), kept, range(4)) == {}
    finally:
        kept.dispose()


@pytest.mark.parametrize("serializer", [STORED, MIGRATED], ids=["as stored", "migrated on registration"])
def test_a_kept_rocksdb_database_catching_up_drops_the_older_value_under_an_expired_newer_one(tmp_path, monkeypatch,
                                                                                           serializer):
    """The kept database holds key 1 from t = 20 s; a heap backend wrote it again at t = 5 s; caught up at 20 s."""
    monkeypatch.setattr(rocksdb_module, "CATCH_UP_DELTA_FRACTION", float("inf"))
    storage = CheckpointStorage(str(tmp_path / "chk"))
    host = str(tmp_path / "host")
    clock = Clock(20.0)
    with rocks(clock, warm_dir=host) as kept:
        s = register(kept, STORED)
        kept.set_current_key(1)
        s["value"].update(1)
        s["list"].add(1)
        s["map"].put(1, 1)
        first = checkpoint(kept, storage, 1)
    with heap(clock) as other:
        other.restore(storage, first)
        o = register(other, STORED)
        clock.now = 5.0
        other.set_current_key(1)
        o["value"].update(2)
        o["list"].clear()
        o["list"].add(2)
        o["map"].put(1, 2)
        second = checkpoint(other, storage, 2)
    clock.now = 20.0
    with rocks(clock, warm_dir=host) as back:
        stats = back.restore(storage, second)
        assert isinstance(stats, WarmResume) and stats.caught_up
        assert read(register(back, serializer), back, range(4)) == {}
