"""Keyed state semantics on both backends: the five state types, registration rules, the current key, copy-on-write
snapshots, cancellation, lazy restore, and TTL with a fake clock."""

from __future__ import annotations

import concurrent.futures
import copy
import inspect
import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange, assign_to_key_group, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.errors import KeyGroupOutOfRangeError, StateMigrationError
from keygroups.serializers import Int64Serializer, StrSerializer, ValueSerializer
from keygroups.state import (
    AggregateFunction,
    AggregatingStateDescriptor,
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    SnapshotFuture,
    ValueStateDescriptor,
)

MAXP = 128
BACKENDS = {"heap": HeapKeyedStateBackend, "rocksdb": RocksDBKeyedStateBackend}


class Avg(AggregateFunction):
    """Mean of ints; the accumulator is a mutable [sum, count] list changed in place (exercises copy-on-write)."""

    def create_accumulator(self):
        return [0, 0]

    def add(self, value, acc):
        acc[0] += value
        acc[1] += 1
        return acc

    def get_result(self, acc):
        return acc[0] / acc[1]

    def merge(self, a, b):
        return [a[0] + b[0], a[1] + b[1]]


def descriptors(ttl: StateTtlConfig | None = None):
    ds = {
        "value": ValueStateDescriptor("value", ValueSerializer()),
        "list": ListStateDescriptor("list", ValueSerializer()),
        "map": MapStateDescriptor("map", StrSerializer(), ValueSerializer()),
        "reducing": ReducingStateDescriptor("reducing", lambda a, b: a + b, Int64Serializer()),
        "aggregating": AggregatingStateDescriptor("aggregating", Avg(), ValueSerializer()),
    }
    if ttl is not None:
        for d in ds.values():
            d.enable_time_to_live(ttl)
    return ds


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=sorted(BACKENDS))
def kind(request):
    return request.param


def make(kind, kgr=KeyGroupRange(0, MAXP - 1), **kw):
    return BACKENDS[kind](kgr, MAXP, Int64Serializer(), **kw)


def commit(storage, handles, checkpoint_id=1, parallelism=1, maxp=MAXP):
    """Commit ``handles`` as the checkpoint after the latest one in ``storage``, carrying forward the files their
    incremental chains still need (as the driver does)."""
    storage.commit(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="test", timestamp_ms=0,
                                      max_parallelism=maxp, parallelism=parallelism,
                                      keyed_handles=carry_forward(storage.latest(), handles),
                                      operator_handles=[], properties={}))
    return storage.load(checkpoint_id)


def snapshot_restore(backend, kind, storage, checkpoint_id=1, descs=None, **kw):
    handle = backend.snapshot(checkpoint_id, storage).result(30)
    md = commit(storage, [handle], checkpoint_id)
    new = make(kind, **kw)
    new.restore(storage, md)
    states = {n: new.get_state(d) for n, d in (descs or descriptors()).items()}
    return new, states


def dump(backend, states, keys):
    out = {}
    for k in keys:
        backend.set_current_key(k)
        out[k] = (states["value"].value(), list(states["list"].get()), dict(states["map"].items()),
                  states["reducing"].get(), states["aggregating"].get())
    return out


# ---- state types ---------------------------------------------------------------------------------------------------
def test_five_state_types(kind):
    b = make(kind)
    s = {n: b.get_state(d) for n, d in descriptors().items()}
    b.set_current_key(7)
    assert s["value"].value() is None
    s["value"].update({"a": [1]})
    assert s["value"].value() == {"a": [1]}
    s["value"].update(None)
    assert s["value"].value() is None

    assert s["list"].get() == []
    s["list"].add(1)
    s["list"].add_all([2, 3])
    assert s["list"].get() == [1, 2, 3]
    s["list"].update([9])
    assert s["list"].get() == [9]
    s["list"].update([])
    assert s["list"].get() == []
    with pytest.raises(ValueError, match="None"):
        s["list"].add(None)

    m = s["map"]
    assert m.is_empty() and m.get("x") is None and not m.contains("x")
    m.put("x", 1)
    m.put_all({"y": [2], "z": 3})
    assert m.contains("y") and m.get("y") == [2]
    assert sorted(m.keys()) == ["x", "y", "z"] and sorted(m.items()) == [("x", 1), ("y", [2]), ("z", 3)]
    m.remove("y")
    m.remove("nope")
    assert sorted(m.values()) == [1, 3]
    m.remove("x")
    m.remove("z")
    assert m.is_empty()

    assert s["reducing"].get() is None
    for v in (1, 2, 3):
        s["reducing"].add(v)
    assert s["reducing"].get() == 6
    assert s["aggregating"].get() is None
    for v in (1, 2, 6):
        s["aggregating"].add(v)
    assert s["aggregating"].get() == 3.0

    b.set_current_key(8)  # another key sees nothing
    assert s["reducing"].get() is None and s["list"].get() == [] and s["aggregating"].get() is None
    b.set_current_key(7)
    for st in s.values():
        st.clear()
    assert dump(b, s, [7]) == {7: (None, [], {}, None, None)}


def test_value_default_and_keys(kind):
    b = make(kind)
    v = b.get_state(ValueStateDescriptor("v", Int64Serializer(), default=5))
    for k in range(50):
        b.set_current_key(k)
        assert v.value() == 5
        if k % 2:
            v.update(k)
    assert sorted(b.keys("v")) == list(range(1, 50, 2))
    with pytest.raises(KeyError, match="nope"):
        list(b.keys("nope"))


def test_registration_rules(kind):
    b = make(kind)
    d = ValueStateDescriptor("s", Int64Serializer())
    s1 = b.get_state(d)
    assert b.get_state(d) is s1
    assert b.get_state(ValueStateDescriptor("s", Int64Serializer())) is s1
    with pytest.raises(StateMigrationError, match="'s'.*value state.*list state"):
        b.get_state(ListStateDescriptor("s", Int64Serializer()))
    with pytest.raises(StateMigrationError, match="serializer"):
        b.get_state(ValueStateDescriptor("s", StrSerializer()))
    with pytest.raises(StateMigrationError, match="TTL"):
        d2 = ValueStateDescriptor("s", Int64Serializer())
        d2.enable_time_to_live(StateTtlConfig.new_builder(10).build())
        b.get_state(d2)
    with pytest.raises(StateMigrationError, match="namespace"):
        b.get_state(d, namespace="window-1")


def test_key_outside_range_and_no_key(kind):
    kgr = key_group_range(MAXP, 4, 1)
    b = make(kind, kgr)
    v = b.get_state(ValueStateDescriptor("v", Int64Serializer()))
    with pytest.raises(RuntimeError, match="set_current_key"):
        v.value()
    outside = next(k for k in range(1000) if assign_to_key_group(k, MAXP) not in kgr)
    with pytest.raises(KeyGroupOutOfRangeError, match=rf"key {outside} .*key group {assign_to_key_group(outside, MAXP)}"
                                                      rf".*KeyGroupRange\({kgr.start}, {kgr.end}\)"):
        b.set_current_key(outside)
    inside = next(k for k in range(1000) if assign_to_key_group(k, MAXP) in kgr)
    b.set_current_key(inside)
    assert b.current_key == inside and b.current_key_group == assign_to_key_group(inside, MAXP)


# ---- snapshots -----------------------------------------------------------------------------------------------------
class HeldStorage(CheckpointStorage):
    """Real checkpoint storage whose files opened off the main thread (by the snapshot worker) wait for
    ``release``: a test acts while a snapshot is provably captured but not yet written, without relying on timing."""

    def __init__(self, location):
        super().__init__(location)
        self.release = threading.Event()
        self.waiting = threading.Event()

    def open_write(self, relpath):
        if threading.current_thread() is not threading.main_thread():
            self.waiting.set()
            assert self.release.wait(30), "the test never released the snapshot writer"
        return super().open_write(relpath)


@pytest.mark.parametrize("writer", ["held", "finished"])
def test_writes_after_capture_never_reach_the_snapshot(kind, writer, tmp_path):
    """Both interleavings are forced: the writer is held until every write below is done (the writes then go
    through copy-on-write), or has finished before the first one (they then change live objects in place).
    ``expected`` is a deep copy: objects read before the snapshot are the live state, and once the snapshot has
    finished, in-place changes legitimately reach them (comparing against those same objects made this test fail
    about one run in ten, when the writer happened to finish early; the snapshot itself was right)."""
    storage = HeldStorage(tmp_path)
    b = make(kind)
    s = {n: b.get_state(d) for n, d in descriptors().items()}
    keys = list(range(40))
    for k in keys:
        b.set_current_key(k)
        s["value"].update([k])
        s["list"].add_all([k, [k]])
        s["map"].put("a", {"k": k})
        s["reducing"].add(k)
        s["aggregating"].add(k)
    expected = copy.deepcopy(dump(b, s, keys))
    future = b.snapshot(1, storage)
    if writer == "held":
        assert storage.waiting.wait(30)
    else:
        storage.release.set()
        future.result(30)
    try:
        for k in keys:  # every way of changing state after the synchronous capture
            b.set_current_key(k)
            v = s["value"].value()
            v.append("LEAK")  # mutate an object obtained from state, then write it back
            s["value"].update(v)
            got = s["list"].get()
            got.append("LEAK")
            s["list"].update(got)
            s["list"].add("LEAK")
            s["list"].get()[1].append("LEAK")
            s["map"].get("a")["k"] = "LEAK"
            s["map"].put("b", "LEAK")
            s["reducing"].add(1000)
            s["aggregating"].add(1000)
        b.set_current_key(1000)
        s["value"].update("new key")
        assert future.done() == (writer == "finished")
    finally:
        storage.release.set()
    handle = future.result(30)
    md = commit(storage, [handle])
    new = make(kind)
    new.restore(storage, md)
    ns = {n: new.get_state(d) for n, d in descriptors().items()}
    assert dump(new, ns, keys) == expected
    assert sorted(new.keys("value")) == keys
    # and the live backend kept its own writes
    b.set_current_key(3)
    assert s["value"].value() == [3, "LEAK"] and s["map"].get("b") == "LEAK"


def _read_paths_mutated(s):
    """Change, in place and without writing back, every mutable object each read path of ``s`` hands out."""
    s["value"].value().append("LEAK")
    s["list"].get().append("LEAK")
    s["list"].get()[1].append("LEAK")
    s["map"].get("a")["k"] = "LEAK"
    for v in s["map"].values():
        v["values"] = "LEAK"
    for _, v in s["map"].items():
        v["items"] = "LEAK"
    s["aggregating"].add(1000)  # Avg.add changes its accumulator in place


@pytest.mark.parametrize("origin", ["fresh", "restored lazily", "restored eagerly"])
@pytest.mark.parametrize("ttl", [None, "on write", "on read and write"])
def test_objects_read_during_a_snapshot_are_not_the_snapshots(kind, origin, ttl, tmp_path):
    """While a snapshot is captured but not written, every read path of every state kind hands out objects the
    snapshot does not hold (Flink's CopyOnWriteStateMap copies an entry older than the snapshot on access), whether
    the value was written in this run, or restored and still undecoded bytes (lazily) or decoded (eagerly)."""
    clock = FakeClock()
    cfg = None
    if ttl is not None:
        builder = StateTtlConfig.new_builder(60)
        cfg = (builder.update_ttl_on_read_and_write() if ttl == "on read and write" else builder).build()
    keys = list(range(40))
    source = make(kind, clock=clock)
    src = {n: source.get_state(d) for n, d in descriptors(cfg).items()}
    for k in keys:
        source.set_current_key(k)
        src["value"].update([k])
        src["list"].add_all([k, [k]])
        src["map"].put_all({"a": {"k": k}, "b": {"k": -k}})
        src["aggregating"].add(k)
    expected = copy.deepcopy(dump(source, src, keys))
    if origin == "fresh":
        b, s = source, src
    else:
        plain = CheckpointStorage(tmp_path)
        md = commit(plain, [source.snapshot(1, plain).result(30)])
        b = make(kind, clock=clock)
        b.restore(plain, md, lazy=origin == "restored lazily")
        s = {n: b.get_state(d) for n, d in descriptors(cfg).items()}  # nothing read: lazily, still bytes
    storage = HeldStorage(tmp_path)
    future = b.snapshot(2, storage)
    assert storage.waiting.wait(30)
    try:
        for k in keys:
            b.set_current_key(k)
            _read_paths_mutated(s)
        assert not future.done()
    finally:
        storage.release.set()
    md = commit(storage, [future.result(30)], 2)
    new = make(kind, clock=clock)
    new.restore(storage, md)
    assert dump(new, {n: new.get_state(d) for n, d in descriptors(cfg).items()}, keys) == expected


def test_two_overlapping_snapshots(kind, tmp_path):
    storage = CheckpointStorage(tmp_path)
    b = make(kind)
    v = b.get_state(ValueStateDescriptor("v", ValueSerializer()))
    for k in range(20):
        b.set_current_key(k)
        v.update([k])
    f1 = b.snapshot(1, storage)
    for k in range(20):
        b.set_current_key(k)
        x = v.value()
        x.append(1)
        v.update(x)
    f2 = b.snapshot(2, storage)
    for k in range(20):
        b.set_current_key(k)
        v.value().append(2)
        v.update(None)
    for cid, fut, exp in ((1, f1, lambda k: [k]), (2, f2, lambda k: [k, 1])):
        md = commit(storage, [fut.result(30)], cid)
        new = make(kind)
        new.restore(storage, md)
        nv = new.get_state(ValueStateDescriptor("v", ValueSerializer()))
        for k in range(20):
            new.set_current_key(k)
            assert nv.value() == exp(k)


class GatedKeys(Int64Serializer):
    """An Int64 key serializer that waits for a gate when called off the main thread (i.e. by the snapshot
    writer), so a test can act while the asynchronous part is provably running."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _wait(self):
        if threading.current_thread() is not threading.main_thread():
            self.entered.set()
            self.gate.wait(30)

    def serialize(self, value):
        self._wait()
        return super().serialize(value)

    def serialize_many(self, values):
        self._wait()
        return super().serialize_many(values)


def test_cancel_a_running_snapshot(tmp_path):
    storage = CheckpointStorage(tmp_path)
    keys = GatedKeys()
    b = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, keys)
    v = b.get_state(ValueStateDescriptor("v", Int64Serializer()))
    for k in range(100):
        b.set_current_key(k)
        v.update(k)
    fut = b.snapshot(1, storage)
    assert keys.entered.wait(30)
    assert not fut.done()
    assert fut.cancel()
    keys.gate.set()
    with pytest.raises(concurrent.futures.CancelledError):
        fut.result(30)
    assert fut.done()
    # the backend is usable and the next snapshot is complete
    b.set_current_key(1)
    v.update(-1)
    md = commit(storage, [b.snapshot(2, storage).result(30)], 2)
    new = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, keys)  # gate open now
    new.restore(storage, md)
    nv = new.get_state(ValueStateDescriptor("v", Int64Serializer()))
    new.set_current_key(1)
    assert nv.value() == -1 and len(list(new.keys("v"))) == 100


def test_snapshots_run_one_at_a_time_on_the_snapshot_worker():
    order = []
    gate = threading.Event()

    def first(future):
        order.append(("first", threading.current_thread().name))
        assert gate.wait(30)
        return 1

    a = SnapshotFuture.start(first, name="first")
    b = SnapshotFuture.start(lambda future: order.append(("second", threading.current_thread().name)) or 2,
                             name="second")
    assert not b.done()  # queued behind the first on the single worker
    gate.set()
    assert (a.result(30), b.result(30)) == (1, 2)
    assert [who for who, _ in order] == ["first", "second"]
    assert all(thread.startswith("keygroups-snapshot") for _, thread in order)


def test_a_snapshot_waiting_for_a_later_one_fails_instead_of_deadlocking():
    def outer(future):
        later = SnapshotFuture.start(lambda f: "later", name="later")
        with pytest.raises(RuntimeError, match="'later' has not finished.*wait forever"):
            later.result()
        return later

    later = SnapshotFuture.start(outer, name="outer").result(30)
    assert later.result(30) == "later"


def test_a_snapshot_cancelled_before_it_starts_still_releases_its_capture(tmp_path):
    storage = CheckpointStorage(tmp_path)
    b = make("heap")
    v = b.get_state(ValueStateDescriptor("v", ValueSerializer()))
    b.set_current_key(1)
    v.update([1])
    gate = threading.Event()
    blocker = SnapshotFuture.start(lambda f: gate.wait(30), name="blocker")
    fut = b.snapshot(1, storage)
    assert b._tables["v"].cow  # copy-on-write while the snapshot holds the dicts
    assert fut.cancel() and fut.cancel_requested and not fut.done()
    gate.set()
    assert blocker.result(30)
    with pytest.raises(concurrent.futures.CancelledError):
        fut.result(30)
    assert fut.cancelled() and not b._tables["v"].cow and not b._tables["v"].slow  # back on the fast path
    assert not list(tmp_path.glob("shared/keyed-*"))  # cancelled before it began: no file was even started


def test_backends_spell_out_their_signature_and_dispose_as_context_managers(kind, tmp_path):
    params = inspect.signature(BACKENDS[kind]).parameters
    assert list(params)[:3] == ["key_group_range", "max_parallelism", "key_serializer"]
    assert {"key_type", "clock", "allow_pickle", "subtask_index"} <= {
        n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert ("db_dir" in params) == (kind == "rocksdb")
    assert not hasattr(BACKENDS[kind], "close") and not hasattr(BACKENDS[kind], "get_partitioned_state")
    extra = {"db_dir": tmp_path} if kind == "rocksdb" else {}
    with make(kind, **extra) as b:
        v = b.get_state(ValueStateDescriptor("v", Int64Serializer()))
        b.set_current_key(1)
        v.update(5)
        assert v.value() == 5
    if kind == "rocksdb":
        assert os.listdir(tmp_path) == []  # the local database is gone
    b.dispose()  # again: nothing happens
    with pytest.raises(ZeroDivisionError):
        with make(kind, **extra):
            1 / 0
    assert kind == "heap" or os.listdir(tmp_path) == []


def test_state_use_without_a_current_key_names_the_fix(kind):
    b = make(kind)
    s = {n: b.get_state(d) for n, d in descriptors().items()}
    with pytest.raises(RuntimeError, match=r"no current key: call set_current_key\(key\)"):
        s["value"].value()
    with pytest.raises(RuntimeError, match=r"no current key: call set_current_key\(key\)"):
        s["map"].put("a", 1)
    b.set_current_key(1)
    with pytest.raises(ValueError, match="'list': cannot add None to a ListState"):
        s["list"].add(None)
    with pytest.raises(ValueError, match="'reducing': cannot add None to a ReducingState"):
        s["reducing"].add(None)


class CountingValues(ValueSerializer):
    def __init__(self):
        super().__init__()
        self.decoded = 0

    def deserialize(self, data):
        self.decoded += 1
        return super().deserialize(data)


def test_lazy_restore_decodes_on_first_access(tmp_path):
    storage = CheckpointStorage(tmp_path)
    b = make("heap")
    v = b.get_state(ValueStateDescriptor("v", ValueSerializer()))
    for k in range(300):
        b.set_current_key(k)
        v.update({"k": k})
    md = commit(storage, [b.snapshot(1, storage).result(30)])
    counting = CountingValues()
    new = make("heap")
    stats = new.restore(storage, md)
    assert stats.key_groups == MAXP and stats.bytes_read > 0
    nv = new.get_state(ValueStateDescriptor("v", counting))
    assert counting.decoded == 0
    new.set_current_key(17)
    assert nv.value() == {"k": 17} and counting.decoded == 1
    assert nv.value() == {"k": 17} and counting.decoded == 1
    # a snapshot of a mostly untouched restore passes the original bytes through, and restores the same state
    md2 = commit(storage, [new.snapshot(2, storage).result(30)], 2)
    assert counting.decoded == 1
    again = make("heap")
    again.restore(storage, md2, lazy=False)
    av = again.get_state(ValueStateDescriptor("v", ValueSerializer()))
    for k in range(300):
        again.set_current_key(k)
        assert av.value() == {"k": k}


def test_restore_refuses_changed_max_parallelism_and_kind(kind, tmp_path):
    storage = CheckpointStorage(tmp_path)
    b = make(kind)
    b.get_state(ValueStateDescriptor("v", Int64Serializer()))
    b.set_current_key(1)
    b.get_state(ValueStateDescriptor("v", Int64Serializer())).update(1)
    md = commit(storage, [b.snapshot(1, storage).result(30)])
    other = BACKENDS[kind](KeyGroupRange(0, 199), 200, Int64Serializer())
    with pytest.raises(StateMigrationError, match="max_parallelism=128.*max_parallelism=200.*integer factor"):
        other.restore(storage, md)
    other.dispose()
    new = make(kind)
    new.restore(storage, md)
    with pytest.raises(StateMigrationError, match="'v'.*value state.*list state"):
        new.get_state(ListStateDescriptor("v", Int64Serializer()))
    d = ValueStateDescriptor("v", Int64Serializer())
    d.enable_time_to_live(StateTtlConfig.new_builder(5).build())
    with pytest.raises(StateMigrationError, match="TTL"):
        new.get_state(d)
    with pytest.raises(StateMigrationError, match="key"):  # keys are never migrated
        BACKENDS[kind](KeyGroupRange(0, MAXP - 1), MAXP, StrSerializer()).restore(storage, md)


def test_key_serializer_must_be_compatible_as_is(kind, tmp_path):
    from keygroups.serializers import Int32Serializer

    storage = CheckpointStorage(tmp_path)
    b = BACKENDS[kind](KeyGroupRange(0, MAXP - 1), MAXP, Int32Serializer())
    v = b.get_state(ValueStateDescriptor("v", Int64Serializer()))
    b.set_current_key(5)
    v.update(1)
    md = commit(storage, [b.snapshot(1, storage).result(30)])
    # Int32 -> Int64 would be fine for a value (after migration), but key bytes identify keys: refused
    with pytest.raises(StateMigrationError, match="key serializer .*compatible as.is"):
        make(kind).restore(storage, md)


# ---- TTL -----------------------------------------------------------------------------------------------------------
def ttl(seconds=10, **kw):
    b = StateTtlConfig.new_builder(seconds)
    if kw.get("on_read"):
        b.update_ttl_on_read_and_write()
    if kw.get("return_expired"):
        b.return_expired_if_not_cleaned_up()
    if kw.get("cleanup"):
        b.cleanup_full_snapshot()
    return b.build()


def test_ttl_value_expiry_and_visibility(kind):
    clock = FakeClock()
    b = make(kind, clock=clock)
    never = ValueStateDescriptor("never", Int64Serializer())
    never.enable_time_to_live(ttl(10))
    ret = ValueStateDescriptor("ret", Int64Serializer())
    ret.enable_time_to_live(ttl(10, return_expired=True))
    sn, sr = b.get_state(never), b.get_state(ret)
    b.set_current_key(1)
    sn.update(1)
    sr.update(2)
    clock.t += 9.999
    assert (sn.value(), sr.value()) == (1, 2)
    clock.t += 0.001  # ts + ttl <= now: expired
    assert sn.value() is None
    assert sr.value() == 2  # returned once; the access cleaned it up
    assert sr.value() is None
    assert list(b.keys("never")) == [] and list(b.keys("ret")) == []


def test_ttl_update_on_read_vs_on_write(kind):
    clock = FakeClock()
    b = make(kind, clock=clock)
    on_write = ValueStateDescriptor("w", Int64Serializer())
    on_write.enable_time_to_live(ttl(10))
    on_read = ValueStateDescriptor("r", Int64Serializer())
    on_read.enable_time_to_live(ttl(10, on_read=True))
    w, r = b.get_state(on_write), b.get_state(on_read)
    b.set_current_key(1)
    w.update(1)
    r.update(1)
    clock.t += 8
    assert w.value() == 1 and r.value() == 1  # r's timestamp moves to now
    clock.t += 8
    assert w.value() is None and r.value() == 1
    w.update(5)  # a write always refreshes
    clock.t += 8
    assert w.value() == 5


def test_ttl_list_map_reducing_aggregating(kind):
    clock = FakeClock()
    b = make(kind, clock=clock)
    s = {n: b.get_state(d) for n, d in descriptors(ttl(10)).items()}
    b.set_current_key(1)
    s["list"].add(1)
    s["map"].put("old", 1)
    s["reducing"].add(5)
    s["aggregating"].add(4)
    clock.t += 6
    s["list"].add(2)
    s["map"].put("new", 2)
    assert s["list"].get() == [1, 2] and s["map"].get("old") == 1
    clock.t += 5  # the first writes are 11 s old, the second 5 s
    assert s["list"].get() == [2]
    assert s["map"].get("old") is None and not s["map"].contains("old")
    assert dict(s["map"].items()) == {"new": 2}
    assert s["reducing"].get() is None
    s["reducing"].add(7)  # an expired value never takes part
    assert s["reducing"].get() == 7
    s["aggregating"].add(10)  # expired accumulator: starts over
    assert s["aggregating"].get() == 10.0
    clock.t += 100
    assert s["list"].get() == [] and s["map"].is_empty()
    assert list(b.keys("list")) == [] and list(b.keys("map")) == []


def test_ttl_cleanup_on_snapshot_and_restore(kind, tmp_path):
    storage = CheckpointStorage(tmp_path)
    clock = FakeClock()
    for cleanup, cid in ((True, 1), (False, 2)):
        descs = descriptors(ttl(10, cleanup=cleanup, return_expired=True))
        b = make(kind, clock=clock)
        s = {n: b.get_state(d) for n, d in descs.items()}
        for k in range(10):
            b.set_current_key(k)
            s["value"].update(k)
            s["list"].add_all([k, k])
            s["map"].put("a", k)
            s["reducing"].add(k)
            s["aggregating"].add(k)
        clock.t += 5
        for k in range(5):  # refresh half of them
            b.set_current_key(k)
            s["value"].update(k)
            s["list"].add(k)
            s["map"].put("b", k)
        clock.t += 6  # first writes expired, refreshed ones live
        new, ns = snapshot_restore(b, kind, storage, cid, descs, clock=clock)
        if cleanup:
            assert sorted(new.keys("value")) == list(range(5))
            assert sorted(new.keys("reducing")) == []
            new.set_current_key(2)
            assert ns["list"].get() == [2] and dict(ns["map"].items()) == {"b": 2}
        else:  # expired entries survive the snapshot; ReturnExpiredIfNotCleanedUp shows them once
            assert sorted(new.keys("value")) == list(range(10))
            new.set_current_key(7)
            assert ns["value"].value() == 7
            assert ns["value"].value() is None


def test_ttl_config_builder():
    cfg = (StateTtlConfig.new_builder(1.5).set_update_type(StateTtlConfig.UpdateType.OnReadAndWrite)
           .set_state_visibility(StateTtlConfig.StateVisibility.ReturnExpiredIfNotCleanedUp).build())
    assert cfg.ttl_ms == 1500 and cfg.update_on_read and cfg.return_expired
    with pytest.raises(ValueError, match="positive"):
        StateTtlConfig.new_builder(0)
    with pytest.raises(TypeError, match="timedelta"):
        StateTtlConfig.new_builder("10s")
    d = ValueStateDescriptor("x", Int64Serializer())
    d.enable_time_to_live(StateTtlConfig(1000, StateTtlConfig.UpdateType.Disabled))
    assert d.ttl_config is None


# ---- serializer evolution on restore -------------------------------------------------------------------------------
def test_value_serializer_migration_reads_old_writes_new(kind, tmp_path):
    from keygroups.serializers import Int32Serializer

    storage = CheckpointStorage(tmp_path)
    old = make(kind)
    v = old.get_state(ValueStateDescriptor("v", Int32Serializer()))
    lst = old.get_state(ListStateDescriptor("l", Int32Serializer()))
    m = old.get_state(MapStateDescriptor("m", Int32Serializer(), StrSerializer()))
    for k in range(30):
        old.set_current_key(k)
        v.update(k)
        lst.add_all([k, -k])
        m.put(k, str(k))
    md = commit(storage, [old.snapshot(1, storage).result(30)])

    def reopen(md):
        new = make(kind)
        new.restore(storage, md)
        return new, (new.get_state(ValueStateDescriptor("v", Int64Serializer())),
                     new.get_state(ListStateDescriptor("l", Int64Serializer())),
                     new.get_state(MapStateDescriptor("m", Int64Serializer(), StrSerializer())))

    new, (nv, nl, nm) = reopen(md)  # Int32 -> Int64: compatible after migration
    new.set_current_key(3)
    assert (nv.value(), nl.get(), nm.items()) == (3, [3, -3], [(3, "3")])
    nv.update(2**40)  # only the new serializer can write this
    md2 = commit(storage, [new.snapshot(2, storage).result(30)], 2)
    assert all(st["serializers"].get("value", st["serializers"].get("element", st["serializers"].get("map key")))
               ["identifier"] == Int64Serializer().snapshot().identifier for st in md2.keyed_handles[0].states)
    again, (av, al, am) = reopen(md2)  # as is now
    for k in range(30):
        again.set_current_key(k)
        assert (av.value(), al.get(), am.get(k)) == (2**40 if k == 3 else k, [k, -k], str(k))

    bad = make(kind)
    bad.restore(storage, md)
    with pytest.raises(StateMigrationError, match="'v'"):
        bad.get_state(ValueStateDescriptor("v", StrSerializer()))


def test_statecore_stub_matches_runtime():
    """The .pyi stub of the compiled helper names exactly the runtime's public classes, functions and methods
    (a cheap check; ``python -m mypy.stubtest keygroups._native.statecore`` is the full one)."""
    import ast
    import pathlib

    import keygroups
    from keygroups._native import statecore

    stub = ast.parse((pathlib.Path(keygroups.__file__).parent / "_native" / "statecore.pyi").read_text())
    declared = {}
    for node in stub.body:
        if isinstance(node, ast.ClassDef):
            declared[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} | {
                n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
        elif isinstance(node, ast.AnnAssign):
            declared[node.target.id] = set()
        elif isinstance(node, ast.FunctionDef):
            declared[node.name] = set()
    runtime = {n for n in vars(statecore) if not n.startswith("_")} - {"KeyGroupOutOfRangeError"}
    assert runtime == set(declared)
    for name, members in declared.items():
        obj = getattr(statecore, name)
        if isinstance(obj, type):
            public = {m for m in vars(obj) if not m.startswith("_")} | ({"__init__"} & members)
            assert public == members, name


@pytest.mark.parametrize("src,dst", [("heap", "rocksdb"), ("rocksdb", "heap")])
def test_snapshots_restore_across_backends(src, dst, tmp_path):
    """Both backends write the same file format: either restores the other's snapshot (at another parallelism)."""
    storage = CheckpointStorage(tmp_path)
    b = make(src)
    s = {n: b.get_state(d) for n, d in descriptors().items()}
    keys = list(range(60))
    for k in keys:
        b.set_current_key(k)
        s["value"].update({"k": [k]})
        s["list"].add_all([k, str(k)])
        s["map"].put_all({"a": k, "b": None})
        s["reducing"].add(k)
        s["aggregating"].add(k)
    expected = copy.deepcopy(dump(b, s, keys))
    md = commit(storage, [b.snapshot(1, storage).result(30)])
    got = {}
    for i in range(3):
        new = make(dst, key_group_range(MAXP, 3, i))
        new.restore(storage, md)
        ns = {n: new.get_state(d) for n, d in descriptors().items()}
        got.update(dump(new, ns, sorted(new.keys("value"))))
    assert got == expected


# ---- untrusted bytes -----------------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["value", "list", "map"]), ttl_on=st.booleans())
def test_value_framing_rejects_damage_cleanly(data, kind, ttl_on):
    """Flipped bytes and truncations of a key's encoded value either decode or raise CorruptSnapshotError."""
    from keygroups.errors import CorruptSnapshotError
    from keygroups.state._codec import ValueFraming

    ser, key_ser = ValueSerializer(), StrSerializer()
    codec = ValueFraming("s", kind, ser, key_ser if kind == "map" else None, ttl=ttl_on)
    vals = data.draw(st.lists(st.one_of(st.integers(), st.text(max_size=3)), min_size=1, max_size=4))
    if kind == "value":
        obj = vals
    elif kind == "list":
        obj = list(vals)
    else:
        obj = {str(i): v for i, v in enumerate(vals)}
    if ttl_on:
        obj = {k: (v, 7) for k, v in obj.items()} if kind == "map" else (
            [(v, 7) for v in obj] if kind == "list" else (obj, 7))
    raw = bytearray(codec.encode(obj))
    assert codec.decode(bytes(raw)) == obj
    cut = data.draw(st.integers(0, len(raw)))
    flips = data.draw(st.lists(st.tuples(st.integers(0, max(len(raw) - 1, 0)), st.integers(1, 255)), max_size=3))
    for pos, x in flips:
        if raw:
            raw[pos] ^= x
    for damaged in (bytes(raw), bytes(raw[:cut])):
        try:
            codec.decode(damaged)
            if ttl_on:
                codec.drop_expired_bytes(damaged, 0)
        except CorruptSnapshotError:
            pass


def test_rocksdb_layout_key_group_first_one_row_per_map_entry():
    """RocksDB keys start with the key group (big-endian u16), then the state id: a key group is one contiguous
    range; a map keeps one row per entry."""
    b = make("rocksdb")
    v = b.get_state(ValueStateDescriptor("v", Int64Serializer()))
    m = b.get_state(MapStateDescriptor("m", StrSerializer(), Int64Serializer()))
    for k in range(50):
        b.set_current_key(k)
        v.update(k)
        m.put_all({"a": 1, "b": 2, "c": 3})
    b.set_current_key(7)
    m.remove("b")
    assert sorted(m.items()) == [("a", 1), ("c", 3)] and not m.is_empty()
    b._flush()  # the batch's cache goes to the database (a snapshot does this)
    rows = [bytes(k) for k in b._db.keys()]
    groups = [int.from_bytes(k[:2], "big") for k in rows]
    assert groups == sorted(groups)
    assert all(assign_to_key_group(k, MAXP) in set(groups) for k in range(50))
    by_state = {}
    for k in rows:
        by_state[int.from_bytes(k[2:4], "big")] = by_state.get(int.from_bytes(k[2:4], "big"), 0) + 1
    assert by_state == {0: 50, 1: 50 * 3 - 1}
    m.clear()
    assert m.is_empty() and m.items() == []
    b.dispose()


def test_ttl_refresh_after_capture_stays_out_of_the_snapshot(kind, tmp_path):
    """OnReadAndWrite refreshes timestamps on reads; reads after the synchronous capture (while the write runs)
    change only the live state: the snapshot keeps the captured timestamps."""
    storage = CheckpointStorage(tmp_path)
    clock = FakeClock()
    descs = descriptors(ttl(10, on_read=True))
    b = make(kind, clock=clock)
    s = {n: b.get_state(d) for n, d in descs.items()}
    for k in range(20):
        b.set_current_key(k)
        s["value"].update([k])
        s["list"].add(k)
        s["map"].put("a", [k])
    clock.t += 8
    future = b.snapshot(1, storage)
    for k in range(20):  # refresh every timestamp to t+8, and mutate what the reads return
        b.set_current_key(k)
        s["value"].value().append("LEAK")
        s["list"].get()
        s["map"].get("a").append("LEAK")
    md = commit(storage, [future.result(30)])
    clock.t += 5  # 13 s after the writes, 5 s after the refresh
    b.set_current_key(3)
    assert s["list"].get() == [3] and s["map"].get("a") is not None  # live state was refreshed
    new, ns = snapshot_restore(b, kind, storage, 2, descs, clock=clock)
    new.set_current_key(3)
    assert ns["list"].get() == [3]  # the second snapshot carries the refreshed timestamps
    restored = make(kind, clock=clock)
    restored.restore(storage, md)
    rs = {n: restored.get_state(d) for n, d in descs.items()}
    for k in range(20):  # the first snapshot has the old ones: everything expired
        restored.set_current_key(k)
        assert rs["value"].value() is None and rs["list"].get() == [] and rs["map"].get("a") is None
