"""A chain (full block, then deltas) of TTL state restored on every path gives "apply every block in order, then drop
what expired at restore time": an expired newer write of a key shadows an older live write of it, never lets it
come back (Flink's restore with ``cleanupFullSnapshot`` drops what expired, after the chain is applied).

TTL stamps need not grow along a chain, so a key's older block can hold a value that outlives the newer block's:
the processing-time clock may step back (a clock set back, the next batch on a host whose clock is behind), and an
event-time entry written before the first watermark is stamped ``EVENT_TIME_NOT_STARTED`` (later than any
watermark) while the same key written once there is a watermark is stamped with it; no clock moves back for that.

Paths: RocksDB's compiled restore (``SstRestore``, states registered before or after), its row-by-row restore of
migrating states (registered before the restore with new serializers: the chain's Int32 values are read and
re-written as Int64 in Python), the migration at registration of a state restored unregistered, restores across a
max-parallelism change, the heap backend's lazy and eager restores, the full snapshot a restored backend writes
(its merge drops what expired), and the warm paths: a kept heap backend resuming (its own states, and a declarative
aggregate's columns, ``ColumnarStates.load``) and a kept RocksDB database catching up on blocks another backend wrote.
The runtime restores before the job's ``open`` registers its states, so a cold restore there drops nothing while it
applies the chain; the row-by-row drop is met by a backend whose states are registered before ``restore()`` (and by
RocksDB's cold fall-back under registered states), and the columns' drop by every kept heap backend that resumes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
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
    TtlTimeCharacteristic,
    ValueStateDescriptor,
)
from keygroups.state import rocksdb as rocksdb_module
from keygroups.state.timers import NO_WATERMARK
from keygroups.state.warm import WarmResume
from test_rocksdb_warm_corruption import rot

MAXP = 8
TTL_S = 10
STORED = Int32Serializer      # the values' serializer the chain is written with
MIGRATED = Int64Serializer    # registered on restore: the stored bytes migrate (read as Int32, written as Int64)
KEYS = range(3)


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def descriptors(value_serializer: Callable[[], Any], event_time: bool) -> dict[str, Any]:
    builder = StateTtlConfig.new_builder(TTL_S).cleanup_full_snapshot()
    if event_time:
        builder.set_ttl_time_characteristic(TtlTimeCharacteristic.EventTime)
    config = builder.build()
    out = {"value": ValueStateDescriptor("value", value_serializer()),
           "list": ListStateDescriptor("list", value_serializer()),
           "map": MapStateDescriptor("map", Int64Serializer(), value_serializer())}
    for d in out.values():
        d.enable_time_to_live(config)
    return out


def register(b: Any, value_serializer: Callable[[], Any], event_time: bool = False) -> dict[str, Any]:
    return {name: b.get_state(d) for name, d in descriptors(value_serializer, event_time).items()}


def heap(clock: Clock, maxp: int = MAXP, **kw: Any) -> HeapKeyedStateBackend:
    return HeapKeyedStateBackend(key_group_range(maxp, 1, 0), maxp, Int64Serializer(), clock=clock,
                                 **{"max_chain": 1000, **kw})


def rocks(clock: Clock, maxp: int = MAXP, **kw: Any) -> RocksDBKeyedStateBackend:
    return RocksDBKeyedStateBackend(key_group_range(maxp, 1, 0), maxp, Int64Serializer(), clock=clock,
                                    **{"max_chain": 1000, **kw})


def checkpoint(b: Any, storage: CheckpointStorage, checkpoint_id: int) -> CheckpointMetadata:
    handle = b.snapshot(checkpoint_id, storage).result(60)
    previous = storage.latest()
    handles = carry_forward(previous, [handle]) if previous is not None else [handle]
    storage.commit(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="ttl-chain", timestamp_ms=0,
                                      max_parallelism=b.max_parallelism, parallelism=1, keyed_handles=handles,
                                      operator_handles=[], properties={}))
    return storage.load(checkpoint_id)


def read(states: dict[str, Any], b: Any, keys: range = KEYS) -> dict[int, tuple[Any, list[Any], dict[Any, Any]]]:
    out = {}
    for k in keys:
        b.set_current_key(k)
        got = (states["value"].value(), list(states["list"].get() or []), dict(states["map"].items()))
        if got != (None, [], {}):
            out[k] = got
    return out


# ---- the cold restore paths: each yields a backend restored at ``now`` and its registered states ----------------
@dataclass(frozen=True)
class Restore:
    storage: CheckpointStorage
    metadata: CheckpointMetadata
    now: float              # seconds: the clock, and (event time) the watermark
    event_time: bool
    tmp: str

    def backend(self, make: Callable[..., Any], **kw: Any) -> Any:
        b = make(Clock(self.now), **kw)
        if self.event_time:
            b.watermark = round(self.now * 1000)
        return b

    def register(self, b: Any, value_serializer: Callable[[], Any]) -> dict[str, Any]:
        return register(b, value_serializer, self.event_time)


Restored = Iterator[tuple[Any, dict[str, Any]]]


@contextlib.contextmanager
def rocks_compiled(r: Restore) -> Restored:
    """Registered before the restore with the stored serializers: SstRestore merges the chain, drops what expired."""
    with r.backend(rocks) as b:
        states = r.register(b, STORED)
        b.restore(r.storage, r.metadata)
        yield b, states


@contextlib.contextmanager
def rocks_compiled_unregistered(r: Restore) -> Restored:
    with r.backend(rocks) as b:
        b.restore(r.storage, r.metadata)
        yield b, r.register(b, STORED)


@contextlib.contextmanager
def rocks_migrating_rows(r: Restore) -> Restored:
    """Registered before the restore with new serializers: the blocks are applied row by row, migrated in Python."""
    with r.backend(rocks) as b:
        states = r.register(b, MIGRATED)
        b.restore(r.storage, r.metadata)
        yield b, states


@contextlib.contextmanager
def rocks_migrated_on_registration(r: Restore) -> Restored:
    with r.backend(rocks) as b:
        b.restore(r.storage, r.metadata)
        yield b, r.register(b, MIGRATED)


@contextlib.contextmanager
def rocks_rekeyed(r: Restore) -> Restored:
    """Another max parallelism: each old key group's chain merged, then re-keyed (applied row by row: migrating)."""
    with r.backend(rocks, maxp=2 * MAXP) as b:
        states = r.register(b, MIGRATED)
        b.restore(r.storage, r.metadata)
        yield b, states


@contextlib.contextmanager
def heap_lazy_migrating(r: Restore) -> Restored:
    with r.backend(heap) as b:
        states = r.register(b, MIGRATED)
        b.restore(r.storage, r.metadata)
        yield b, states


@contextlib.contextmanager
def heap_eager(r: Restore) -> Restored:
    with r.backend(heap) as b:
        states = r.register(b, STORED)
        b.restore(r.storage, r.metadata, lazy=False)
        yield b, states


@contextlib.contextmanager
def heap_rekeyed(r: Restore) -> Restored:
    with r.backend(heap, maxp=2 * MAXP) as b:
        states = r.register(b, STORED)
        b.restore(r.storage, r.metadata)
        yield b, states


def _snapshot_of_restored(make: Callable[..., Any], serializer: Callable[[], Any]) -> Callable[[Restore], Any]:
    @contextlib.contextmanager
    def path(r: Restore) -> Restored:
        """A backend restored (nothing read) writes a full snapshot (its merge drops what expired), read back."""
        again = CheckpointStorage(tempfile.mkdtemp(prefix="again-", dir=r.tmp))
        with r.backend(make, incremental=False) as b:
            r.register(b, serializer)
            b.restore(r.storage, r.metadata)
            written = checkpoint(b, again, r.metadata.checkpoint_id + 1)
        with r.backend(heap) as b:
            b.restore(again, written)
            yield b, r.register(b, MIGRATED)
    path.__name__ = f"{make.__name__}_full_snapshot_of_restored_{serializer.__name__}"
    return path


COLD_PATHS = [rocks_compiled, rocks_compiled_unregistered, rocks_migrating_rows, rocks_migrated_on_registration,
              rocks_rekeyed, heap_lazy_migrating, heap_eager, heap_rekeyed,
              _snapshot_of_restored(heap, STORED), _snapshot_of_restored(heap, MIGRATED),
              _snapshot_of_restored(rocks, STORED), _snapshot_of_restored(rocks, MIGRATED)]


# ---- one chain where a key's newer write expires before its older one -------------------------------------------
def older_outlives_newer(b: Any, storage: CheckpointStorage, event_time: bool, first_id: int = 1,
                         then: Any = None) -> CheckpointMetadata:
    """Key 1 written first (checkpoint ``first_id``), then again (checkpoint ``first_id + 1``, a delta; by ``then``,
    restored from the first checkpoint, if given): processing time at t = 20 s, then at t = 5 s (the clock stepped
    back); event time before the first watermark (stamped "not started"), then at watermark 5 s. At 20 s the newer
    values expired (5 + 10 <= 20), the older did not. Key 2, written once with key 1's first values, lives on."""
    if event_time:
        b.watermark = NO_WATERMARK
    else:
        b.clock.now = 20.0
    s = register(b, STORED, event_time)
    b.set_current_key(1)
    s["value"].update(1)
    s["list"].add(1)
    s["map"].put(1, 1)
    b.set_current_key(2)
    s["value"].update(7)
    first = checkpoint(b, storage, first_id)
    if then is not None:
        b = then
        b.restore(storage, first)
        s = register(b, STORED, event_time)
    if event_time:
        b.watermark = 5000
    else:
        b.clock.now = 5.0
    b.set_current_key(1)
    s["value"].update(2)
    s["list"].clear()
    s["list"].add(2)
    s["map"].put(1, 2)
    return checkpoint(b, storage, first_id + 1)


AT_20 = {2: (7, [], {})}                          # key 1's newest values expired: nothing of key 1 remains
AT_12 = {1: (2, [2], {1: 2}), 2: (7, [], {})}    # nothing expired yet


@pytest.mark.parametrize("path", COLD_PATHS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("writer", [heap, rocks], ids=["heap writes", "rocksdb writes"])
@pytest.mark.parametrize("event_time", [False, True], ids=["processing time", "event time"])
def test_an_expired_newer_write_is_not_replaced_by_an_older_live_one(tmp_path, path, writer, event_time):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    with writer(Clock()) as b:
        metadata = older_outlives_newer(b, storage, event_time)
    newest = [h for h in metadata.keyed_handles if h.checkpoint_id == 2]
    assert newest and not any(h.is_full(kg) for h in newest for kg in range(MAXP))   # a chain: full, then a delta
    for now, expected in ((20.0, AT_20), (12.0, AT_12)):
        with path(Restore(storage, metadata, now, event_time, str(tmp_path))) as (restored, states):
            assert read(states, restored) == expected, now


@pytest.mark.parametrize("event_time", [False, True], ids=["processing time", "event time"])
def test_a_kept_heap_backend_resuming_drops_the_older_value_under_an_expired_newer_one(tmp_path, event_time):
    """The kept heap backend wrote the first checkpoint (and holds key 1 decoded); a RocksDB backend wrote the
    second; the kept one resumes at 20 s."""
    storage = CheckpointStorage(str(tmp_path / "chk"))
    with heap(Clock()) as kept, rocks(Clock()) as other:
        second = older_outlives_newer(kept, storage, event_time, then=other)
        kept.clock.now = 20.0
        if event_time:
            kept.watermark = 20000
        assert kept.resume(storage, second) is not None
        assert read(register(kept, STORED, event_time), kept) == AT_20


@pytest.mark.parametrize("event_time", [False, True], ids=["processing time", "event time"])
def test_a_kept_heap_backend_resuming_a_declarative_aggregates_columns_drops_the_older_value(tmp_path, event_time):
    """The columns of a declarative aggregate (external states of a kept heap backend) take the newer blocks as the
    backend resumes: key 1's count from the first checkpoint must not outlive its expired newer count."""
    from keygroups.aggregates import aggregate, count
    from keygroups.aggregates.function import _layout
    from keygroups.aggregates.table import ColumnarStates
    from test_aggregates import INPUT

    builder = StateTtlConfig.new_builder(TTL_S).cleanup_full_snapshot()
    if event_time:
        builder.set_ttl_time_characteristic(TtlTimeCharacteristic.EventTime)
    job = aggregate(count(), input_schema=INPUT, key_columns="key", ttl=builder.build())
    descriptors, layouts = job.descriptors, [_layout(a) for a in job.aggregations]

    def bind(b: Any) -> Any:
        assert isinstance(b.bind_external_states(descriptors, lambda b: ColumnarStates(b, descriptors, layouts)),
                          ColumnarStates)
        return b.get_state(descriptors[0])

    storage = CheckpointStorage(str(tmp_path / "chk"))
    with heap(Clock(20.0)) as kept, rocks(Clock(5.0)) as other:
        if event_time:
            kept.watermark = NO_WATERMARK
        state = bind(kept)
        kept.set_current_key(1)
        state.update(1)
        first = checkpoint(kept, storage, 1)
        other.restore(storage, first)
        if event_time:
            other.watermark = 5000
        state = other.get_state(descriptors[0])
        other.set_current_key(1)
        state.update(2)
        second = checkpoint(other, storage, 2)
        if event_time:
            kept.watermark = 20000
        assert kept.resume(storage, second) is not None
        state = bind(kept)
        kept.set_current_key(1)
        assert state.value() is None


@pytest.mark.parametrize("serializer", [STORED, MIGRATED], ids=["as stored", "migrated on registration"])
@pytest.mark.parametrize("event_time", [False, True], ids=["processing time", "event time"])
def test_a_kept_rocksdb_database_catching_up_drops_the_older_value_under_an_expired_newer_one(
        tmp_path, monkeypatch, serializer, event_time):
    """The kept database wrote the first checkpoint; a heap backend wrote the second; caught up at 20 s."""
    monkeypatch.setattr(rocksdb_module, "CATCH_UP_DELTA_FRACTION", float("inf"))
    storage = CheckpointStorage(str(tmp_path / "chk"))
    host = str(tmp_path / "host")
    with rocks(Clock(), warm_dir=host) as kept, heap(Clock()) as other:
        second = older_outlives_newer(kept, storage, event_time, then=other)
        kept.dispose()   # kept on disk, sealed at checkpoint 1
    with rocks(Clock(20.0), warm_dir=host) as back:
        if event_time:
            back.watermark = 20000
        stats = back.restore(storage, second)
        assert isinstance(stats, WarmResume) and stats.caught_up
        assert read(register(back, serializer, event_time), back) == AT_20


# ---- model: random writes across checkpoints, the clock stepping back, restored on every path --------------------
TIMES = [0.0, 5.0, 20.0]   # seconds; in any order: the clock may step back

write_op = st.tuples(st.just("write"), st.integers(KEYS.start, KEYS.stop - 1),
                     st.sampled_from(["value", "value", "add", "replace", "put", "put", "remove", "clear value",
                                      "clear list", "clear map"]),
                     st.integers(-3, 3), st.integers(0, 2))
#: batches as a job runs them: the clock (processing time, fixed per batch) set, some writes, a checkpoint
batches = st.lists(st.tuples(st.sampled_from(TIMES), st.lists(write_op, max_size=6)), min_size=1, max_size=6)
#: key 1 written at 20 s, checkpointed, written again at 5 s: at 20 s its newer value expired, its older did not
STEPPED_BACK = [(20.0, [("write", 1, "value", 1, 0), ("write", 1, "add", 1, 0)]),
                (5.0, [("write", 1, "value", 2, 0), ("write", 1, "replace", 2, 0)])]


def last_time(batches: list[tuple[float, Any]]) -> float:
    """The latest time the clock was set to (the restores below are never earlier)."""
    return max(now for now, _ in batches)


class Model:
    """The writes as stored: value key -> (v, stamp ms); list key -> [(v, stamp)]; map key -> {mk: (v, stamp)}."""

    def __init__(self) -> None:
        self.value: dict[int, tuple[int, int]] = {}
        self.list: dict[int, list[tuple[int, int]]] = {}
        self.map: dict[int, dict[int, tuple[int, int]]] = {}

    def live_at(self, now: float) -> dict[int, tuple[Any, list[Any], dict[Any, Any]]]:
        """Every write applied in order, then what expired at ``now`` dropped (live: stamp + ttl > now)."""
        deadline = round(now * 1000) - TTL_S * 1000
        out = {}
        for k in KEYS:
            v = self.value.get(k)
            got = (v[0] if v is not None and v[1] > deadline else None,
                   [e for e, t in self.list.get(k, []) if t > deadline],
                   {mk: e for mk, (e, t) in self.map.get(k, {}).items() if t > deadline})
            if got != (None, [], {}):
                out[k] = got
        return out


def run(b: Any, batches: list[tuple[float, list[tuple[Any, ...]]]], storage: CheckpointStorage, model: Model,
        next_id: int) -> tuple[CheckpointMetadata, int]:
    """Run ``batches`` on ``b`` and ``model``, each checkpointed at its end; (the last checkpoint, the next id)."""
    s = register(b, STORED)
    metadata = None
    for now, writes in batches:
        b.clock.now = now
        stamp = round(now * 1000)
        for _, k, what, v, mk in writes:
            b.set_current_key(k)
            if what == "value":
                s["value"].update(v)
                model.value[k] = (v, stamp)
            elif what == "add":
                s["list"].add(v)
                model.list.setdefault(k, []).append((v, stamp))
            elif what == "replace":
                s["list"].update([v])
                model.list[k] = [(v, stamp)]
            elif what == "put":
                s["map"].put(mk, v)
                model.map.setdefault(k, {})[mk] = (v, stamp)
            elif what == "remove":
                s["map"].remove(mk)
                model.map.get(k, {}).pop(mk, None)
            else:
                s[what.split()[1]].clear()
                getattr(model, what.split()[1]).pop(k, None)
        metadata = checkpoint(b, storage, next_id)
        next_id += 1
    # a snapshot drops what expired at its own time; the restores below are never earlier than any batch, so what a
    # snapshot (or an access) dropped early is expired there too
    assert metadata is not None
    return metadata, next_id


MODEL_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                 HealthCheck.function_scoped_fixture])


@MODEL_SETTINGS
@given(ops=batches, writer=st.sampled_from([heap, rocks]), max_chain=st.sampled_from([2, 1000]),
       later=st.sampled_from([0.0, 0.0, 4.0, 10.0]))
@example(ops=STEPPED_BACK, writer=heap, max_chain=1000, later=0.0)
def test_model_every_cold_restore_path(ops, writer, max_chain, later):
    with tempfile.TemporaryDirectory(prefix="kg-ttl-chain-") as tmp:
        storage = CheckpointStorage(os.path.join(tmp, "chk"), retain=100)
        with writer(Clock(), max_chain=max_chain) as b:
            model = Model()
            metadata, _ = run(b, ops, storage, model, 1)
        now = last_time(ops) + later
        expected = model.live_at(now)
        for path in COLD_PATHS:
            with path(Restore(storage, metadata, now, False, tmp)) as (restored, states):
                assert read(states, restored) == expected, path.__name__


@MODEL_SETTINGS
@given(first=batches, second=batches, max_chain=st.sampled_from([2, 1000]),
       later=st.sampled_from([0.0, 0.0, 4.0, 10.0]))
@example(first=STEPPED_BACK[:1], second=STEPPED_BACK[1:], max_chain=1000, later=0.0)
@pytest.mark.parametrize("warm", ["heap resumes", "rocksdb catches up"])
def test_model_warm_paths(monkeypatch, warm, first, second, max_chain, later):
    """The kept backend writes ``first``; another (restored from its last checkpoint) writes ``second``; the kept one
    resumes (heap) or catches up (RocksDB) at the latest checkpoint."""
    monkeypatch.setattr(rocksdb_module, "CATCH_UP_DELTA_FRACTION", float("inf"))
    with tempfile.TemporaryDirectory(prefix="kg-ttl-chain-") as tmp:
        storage = CheckpointStorage(os.path.join(tmp, "chk"), retain=100)   # the kept checkpoint stays
        host = os.path.join(tmp, "host")
        kept = heap(Clock(), max_chain=max_chain) if warm == "heap resumes" else rocks(Clock(), warm_dir=host,
                                                                                      max_chain=max_chain)
        try:
            model = Model()
            kept_at, next_id = run(kept, first, storage, model, 1)
            if warm != "heap resumes":
                kept.dispose()   # kept on disk, sealed at kept_at
            other_kind = rocks if warm == "heap resumes" else heap
            with other_kind(Clock(), max_chain=max_chain) as other:
                other.restore(storage, kept_at)
                metadata, _ = run(other, second, storage, model, next_id)
            now = last_time(first + second) + later
            if warm == "heap resumes":
                kept.clock.now = now
                assert kept.resume(storage, metadata) is not None
                assert read(register(kept, STORED), kept) == model.live_at(now)
            else:
                with rocks(Clock(now), warm_dir=host) as back:
                    assert isinstance(back.restore(storage, metadata), WarmResume)
                    assert read(register(back, STORED), back) == model.live_at(now)
        finally:
            kept.dispose()


#: Keys written beside KEYS so that the kept database has a file of many data blocks, the one damaged (a tiny file's
#: meta blocks, which RocksDB reads when it opens the database, would sit where the damage goes).
FILLERS = range(1000, 5000)


@pytest.mark.parametrize("serializer", [STORED, MIGRATED], ids=["as stored", "migrating"])
@pytest.mark.parametrize("registered", ["before restore", "after restore"])
@pytest.mark.parametrize("event_time", [False, True], ids=["processing time", "event time"])
def test_a_damaged_kept_rocksdb_database_restored_cold_drops_the_older_value_under_an_expired_newer_one(
        tmp_path, caplog, serializer, registered, event_time):
    """The kept database wrote both checkpoints and rotted on disk; resumed at 20 s, its first read finds the damage
    and the backend restores the chain cold under the states already registered (compiled, or row by row where the
    registered serializers migrate the values): key 1's expired newer write still shadows its older live one."""
    storage = CheckpointStorage(str(tmp_path / "chk"))
    host = str(tmp_path / "host")
    with rocks(Clock(20.0), warm_dir=host) as kept:
        if event_time:
            kept.watermark = NO_WATERMARK
        value = register(kept, STORED, event_time)["value"]
        for k in FILLERS:
            kept.set_current_key(k)
            value.update(k)
        second = older_outlives_newer(kept, storage, event_time)
        kept.dispose()   # kept on disk, sealed at checkpoint 2
    rocksdb_module._KEPT_CACHES.clear()   # the next batch in another process: no decoded values beside the files
    rot(host, min_size=16384)
    with rocks(Clock(20.0), warm_dir=host) as back:
        if event_time:
            back.watermark = 20000
        states = register(back, serializer, event_time) if registered == "before restore" else None
        stats = back.restore(storage, second)
        assert back.warm and stats.bytes_read == 0   # the seal held: resumed, the damage not yet met
        if states is None:
            states = register(back, serializer, event_time)
        with caplog.at_level(logging.WARNING, logger="keygroups.state.rocksdb"):
            back.prefetch(list(FILLERS))
            got = read(states, back)
        assert "damaged" in caplog.text and "restored cold from checkpoint 2" in caplog.text
        assert not back.warm
        assert got == AT_20
