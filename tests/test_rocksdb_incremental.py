"""The RocksDB backend across batches: the per-batch cache (bounded, flushed, prefetched) and the warm database kept
on local disk, reused only at the exact checkpoint and snapshot file its marker names (real files, real RocksDB)."""

from __future__ import annotations

import json
import operator
import os
import pickle
import shutil
import tempfile

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from keygroups import KeyGroupRange, assign_operators, assign_to_key_group, assign_to_operator, key_group_range
from keygroups._parquet import read_parquet
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.runtime import KeyedProcessFunction
from keygroups.runtime.driver import begin_batch, commit_batch
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.serializers import Int64Serializer, StrSerializer, ValueSerializer
from keygroups.state import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    ValueStateDescriptor,
)
from test_state_getters import Sum

MAXP = 128
FULL = KeyGroupRange(0, MAXP - 1)


def make(warm_dir=None, kgr=FULL, **kw):
    return RocksDBKeyedStateBackend(kgr, MAXP, Int64Serializer(), warm_dir=warm_dir, **kw)


def commit(storage, handles, checkpoint_id):
    previous = storage.latest()
    if previous is not None:  # as the driver does: delta files need the earlier files of their chains
        handles = carry_forward(previous, handles)
    storage.commit(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="test", timestamp_ms=0,
                                      max_parallelism=MAXP, parallelism=1, keyed_handles=handles,
                                      operator_handles=[], properties={}))
    return storage.load(checkpoint_id)


def states(b):
    return (b.get_state(ValueStateDescriptor("v", Int64Serializer())),
            b.get_state(ListStateDescriptor("l", ValueSerializer())),
            b.get_state(MapStateDescriptor("m", StrSerializer(), Int64Serializer())))


def write(b, keys, delta):
    v, lst, m = states(b)
    for k in keys:
        b.set_current_key(k)
        v.update((v.value() or 0) + delta)
        lst.add(delta)
        m.put(str(delta), k)


def read(b, keys):
    v, lst, m = states(b)
    out = {}
    for k in keys:
        b.set_current_key(k)
        out[k] = (v.value(), lst.get(), sorted(m.items()))
    return out


KEYS = range(200)


def first_checkpoint(tmp_path, warm):
    """Checkpoint 1 written by a backend kept warm in ``warm``; (storage, metadata, expected state)."""
    storage = CheckpointStorage(tmp_path / "chk")
    b = make(warm)
    write(b, KEYS, 1)
    md = commit(storage, [b.snapshot(1, storage).result(30)], 1)
    expected = read(b, KEYS)
    b.dispose()
    return storage, md, expected


def test_the_batch_after_a_committed_one_reuses_the_database_and_reads_nothing(tmp_path):
    warm = tmp_path / "warm"
    storage, md, expected = first_checkpoint(tmp_path, warm)
    b = make(warm)
    stats = b.restore(storage, md)
    assert b.warm and stats.bytes_read == 0
    assert read(b, KEYS) == expected
    write(b, KEYS, 2)  # and it goes on: checkpoint 2 from the warm database, then warm again
    after = read(b, KEYS)
    md2 = commit(storage, [b.snapshot(2, storage).result(30)], 2)
    b.dispose()
    b = make(warm)
    assert b.restore(storage, md2).bytes_read == 0 and b.warm
    assert read(b, KEYS) == after
    b.dispose()
    cold = make()
    assert cold.restore(storage, md2).bytes_read > 0 and not cold.warm
    assert read(cold, KEYS) == after
    cold.dispose()


@pytest.mark.parametrize("how", ["uncommitted", "failed", "failed after an early flush"])
def test_a_database_past_the_restore_point_is_not_reused(tmp_path, how):
    """A batch that snapshotted but was never committed, or failed (with or without writing to the database):
    the retry restores checkpoint 1 from its files and sees exactly checkpoint 1."""
    warm = tmp_path / "warm"
    storage, md, expected = first_checkpoint(tmp_path, warm)
    b = make(warm, cache_limit=10 if how == "failed after an early flush" else 1 << 20)
    b.restore(storage, md)
    write(b, KEYS, 5)
    if how == "uncommitted":
        b.snapshot(2, storage).result(30)  # the driver never commits checkpoint 2
    b.dispose()
    retry = make(warm)
    stats = retry.restore(storage, md)
    if how == "failed":  # nothing reached the database: it still is checkpoint 1, and may be reused
        assert retry.warm and stats.bytes_read == 0
    else:
        assert not retry.warm and stats.bytes_read > 0
    assert read(retry, KEYS) == expected
    retry.dispose()


def test_a_retried_attempts_database_is_not_reused(tmp_path):
    """Two attempts of one subtask wrote checkpoint 2; the driver committed the other attempt's file."""
    warm = tmp_path / "warm"
    storage, md, _ = first_checkpoint(tmp_path, warm)
    here = make(warm)
    here.restore(storage, md)
    write(here, KEYS, 7)
    here.snapshot(2, storage).result(30)
    here.dispose()
    elsewhere = make()
    elsewhere.restore(storage, md)
    write(elsewhere, KEYS, 9)
    expected = read(elsewhere, KEYS)
    md2 = commit(storage, [elsewhere.snapshot(2, storage).result(30)], 2)
    elsewhere.dispose()
    b = make(warm)
    assert b.restore(storage, md2).bytes_read > 0 and not b.warm
    assert read(b, KEYS) == expected
    b.dispose()


def test_another_range_or_location_is_not_reused(tmp_path):
    warm = tmp_path / "warm"
    storage, md, expected = first_checkpoint(tmp_path, warm)
    half = KeyGroupRange(0, MAXP // 2 - 1)
    b = make(warm, kgr=half)  # a rescale: the overlapping range's database is taken over, the other half dropped
    stats = b.restore(storage, md)
    assert b.warm and stats.bytes_read == 0 and stats.dropped == tuple(range(MAXP // 2, MAXP))
    mine = [k for k in KEYS if assign_to_key_group(k, MAXP) in half]
    assert read(b, mine) == {k: expected[k] for k in mine}
    assert all(int.from_bytes(k[:2], "big") in half for k in b._db.keys())   # a ranged delete of those that left
    b.dispose()
    b = make(warm)  # back to the whole range: the half's database vouches for no snapshot, so all is restored
    assert b.restore(storage, md).bytes_read > 0 and not b.warm
    assert read(b, KEYS) == expected
    b.dispose()
    other = CheckpointStorage(tmp_path / "elsewhere")  # the same files under another location
    md_other = commit(other, [], 1)
    b = make(warm)
    b.restore(other, md_other)
    assert not b.warm and read(b, [1]) == {1: (None, [], [])}
    b.dispose()


@pytest.mark.parametrize("damage", [b"{not json", b"[]", b'{"version": 1}', b""])
def test_a_damaged_marker_is_refused_cleanly(tmp_path, damage):
    warm = tmp_path / "warm"
    storage, md, expected = first_checkpoint(tmp_path, warm)
    marker = warm / f"0-{MAXP - 1}" / "marker.json"
    assert json.loads(marker.read_text())["checkpoint_id"] == 1
    marker.write_bytes(damage)
    b = make(warm)
    assert b.restore(storage, md).bytes_read > 0 and not b.warm
    assert read(b, KEYS) == expected
    b.dispose()


def test_a_job_that_does_not_restore_starts_empty_even_over_a_kept_database(tmp_path):
    warm = tmp_path / "warm"
    first_checkpoint(tmp_path, warm)
    b = make(warm)
    assert read(b, [1, 2]) == {1: (None, [], []), 2: (None, [], [])}
    b.dispose()


def test_a_second_backend_on_a_held_directory_works_apart(tmp_path):
    """A second attempt running beside the first on one host does not share its database."""
    warm = tmp_path / "warm"
    storage, md, expected = first_checkpoint(tmp_path, warm)
    a, b = make(warm), make(warm)
    assert a.restore(storage, md).bytes_read == 0 and a.warm
    assert b.restore(storage, md).bytes_read > 0 and not b.warm
    write(a, KEYS, 3)
    assert read(b, KEYS) == expected
    a.dispose()
    b.dispose()
    assert sorted(os.listdir(warm)) == [".keygroups-secret", f"0-{MAXP - 1}", f"0-{MAXP - 1}.lock"]


# ---- the cache ---------------------------------------------------------------------------------------------------
def test_prefetch_and_a_small_cache_limit_change_nothing_but_memory(tmp_path):
    storage = CheckpointStorage(tmp_path)
    big, small = make(), make(cache_limit=7)
    for b in (big, small):
        write(b, KEYS, 1)
    small.prefetch(list(KEYS))  # more keys than the limit: the rest load on first use
    big.prefetch(list(KEYS), [assign_to_key_group(k, MAXP) for k in KEYS])
    for b in (big, small):
        write(b, KEYS, 2)
        assert all(len(t.cache) <= (7 if b is small else 1 << 20) for t in b._tables.values())
    assert read(big, KEYS) == read(small, KEYS)
    mds = [commit(CheckpointStorage(tmp_path / str(i)), [b.snapshot(1, CheckpointStorage(tmp_path / str(i)))
                                                         .result(30)], 1) for i, b in enumerate((big, small))]
    restored = []
    for i, md in enumerate(mds):
        r = make()
        r.restore(CheckpointStorage(tmp_path / str(i)), md)
        restored.append(read(r, KEYS))
        r.dispose()
    assert restored[0] == restored[1] == read(big, KEYS)
    with pytest.raises(ValueError, match="cache_limit"):
        make(cache_limit=0)
    with pytest.raises(ValueError, match="not in this backend's key groups"):
        make(kgr=KeyGroupRange(0, 0)).prefetch([k for k in KEYS if assign_to_key_group(k, MAXP) != 0][:1])
    big.dispose()
    small.dispose()
    del storage


def test_a_mutable_value_changed_in_place_sticks_as_on_the_heap():
    b = make()
    v = b.get_state(ValueStateDescriptor("v", ValueSerializer()))
    b.set_current_key(1)
    v.update([1])
    b._flush(evict=True)
    v.value().append(2)  # loaded into the cache and changed in place
    b._flush(evict=True)
    assert v.value() == [1, 2]
    b.dispose()


# ---- the runner ------------------------------------------------------------------------------------------------
class Count(KeyedProcessFunction):
    """Counts records per key; emits (key, count) per record."""

    def open(self, context):
        self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))

    def process_element(self, record, context):
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        return [(record["k"], n)]


def run_counting_batch(storage, local_dir, keys, parallelism=2):
    schema = pa.schema([("k", pa.int64())])
    plan = begin_batch(storage, job_name="count", max_parallelism=MAXP, parallelism=parallelism)
    spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(Count()), input_schema=schema,
                           output_schema=pa.schema([("k", pa.int64()), ("n", pa.int64())]), backend="rocksdb",
                           local_dir=str(local_dir))
    table = pa.table({"k": keys}, schema=schema)
    owners = assign_operators(table.column("k"), MAXP, parallelism)
    reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches())
               for i in range(parallelism)]
    metadata = commit_batch(plan, reports)
    out = pa.concat_tables(read_parquet(storage.read_bytes(f)) for f in metadata.outputs)
    return reports, dict(zip(out.column("k").to_pylist(), out.column("n").to_pylist()))


def test_the_runner_keeps_rocksdb_warm_between_batches_and_restores_after_a_rescale(tmp_path):
    storage = CheckpointStorage(tmp_path / "chk")
    local = tmp_path / "local"
    keys = list(range(300))
    run_counting_batch(storage, local, keys)
    reports, counts = run_counting_batch(storage, local, keys)
    assert [r.restored.warm for r in reports] == [True, True]
    assert [r.restored.bytes_read for r in reports] == [0, 0]
    assert counts == {k: 2 for k in keys}
    # a rescale (2 -> 3): the best matching gives each old database to the new range sharing most of it (the first
    # and the third), which only drop what left them; the second restores from the files the key groups that changed
    # owner, and nothing else is read
    reports, counts = run_counting_batch(storage, local, keys, parallelism=3)
    assert [r.restored.mode for r in reports] == ["moved", "cold", "moved"]
    assert [bool(r.restored.bytes_read) for r in reports] == [False, True, False]
    assert reports[0].restored.restored_key_groups == reports[2].restored.restored_key_groups == ()
    assert reports[0].restored.dropped_key_groups and reports[2].restored.dropped_key_groups
    assert counts == {k: 3 for k in keys}


# ---- chains: a model test ----------------------------------------------------------------------------------------
def five():
    return {"value": ValueStateDescriptor("value", ValueSerializer()),
            "list": ListStateDescriptor("list", Int64Serializer()),
            "map": MapStateDescriptor("map", StrSerializer(), Int64Serializer()),
            "reducing": ReducingStateDescriptor("reducing", operator.add, Int64Serializer()),
            "aggregating": AggregatingStateDescriptor("aggregating", Sum(), Int64Serializer())}


def write_five(s, m, k, v, op):
    """Operation ``op`` (a state of :func:`five`, or "remove": a map entry) with ``v`` on key ``k``'s states ``s`` and
    on the model ``m`` (state name -> key -> what the state shows)."""
    if op == "value":
        s["value"].update(v)
        m["value"][k] = v
    elif op == "list":
        s["list"].add(v)
        m["list"].setdefault(k, []).append(v)
    elif op == "map":
        s["map"].put(str(v), v)
        m["map"].setdefault(k, {})[str(v)] = v
    elif op == "remove":
        s["map"].remove(str(v))
        if str(v) in m["map"].get(k, {}):
            del m["map"][k][str(v)]
            if not m["map"][k]:
                del m["map"][k]
    else:
        s[op].add(v)
        m[op][k] = m[op].get(k, 0) + v


class ChainModel(RuleBasedStateMachine):
    """Random operations on the five state kinds against dicts; checkpoints are incremental (chains of at most two
    blocks, so key groups materialize often), and each continues warm, cold at the same parallelism, or cold at
    another one."""

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory(prefix="kg-chains-")
        self.storage = CheckpointStorage(os.path.join(self.tmp.name, "chk"))
        self.warm = os.path.join(self.tmp.name, "warm")
        self.model = {n: {} for n in five()}
        self.checkpoint_id = 0
        self.p = 2
        self.backends = self.open(None)

    def open(self, metadata):
        out = []
        for i in range(self.p):
            b = RocksDBKeyedStateBackend(key_group_range(MAXP, self.p, i), MAXP, Int64Serializer(), subtask_index=i,
                                         max_chain=2, warm_dir=self.warm, cache_limit=5)
            if metadata is not None:
                b.restore(self.storage, metadata)
            out.append((b, {n: b.get_state(d) for n, d in five().items()}))
        return out

    def at(self, k):
        b, s = self.backends[assign_to_operator(k, MAXP, self.p)]
        b.set_current_key(k)
        return s

    @rule(k=st.integers(0, 30), v=st.integers(-5, 5), op=st.sampled_from(["value", "list", "map", "reducing",
                                                                          "aggregating", "remove"]))
    def write(self, k, v, op):
        write_five(self.at(k), self.model, k, v, op)

    @rule(k=st.integers(0, 30), name=st.sampled_from(sorted(five())))
    def clear(self, k, name):
        self.at(k)[name].clear()
        self.model[name].pop(k, None)

    @rule(how=st.sampled_from(["warm", "cold", "rescale"]), p2=st.integers(1, 3))
    def checkpoint(self, how, p2):
        self.checkpoint_id += 1
        handles = [b.snapshot(self.checkpoint_id, self.storage).result(30) for b, _ in self.backends]
        previous = self.storage.latest()
        self.storage.commit(CheckpointMetadata(
            checkpoint_id=self.checkpoint_id, job_id="chains", timestamp_ms=0, max_parallelism=MAXP,
            parallelism=self.p, keyed_handles=carry_forward(previous, handles), operator_handles=[], properties={}))
        for b, _ in self.backends:
            b.dispose()
        if how == "cold":
            shutil.rmtree(self.warm)
        elif how == "rescale":
            self.p = p2
        self.backends = self.open(self.storage.load(self.checkpoint_id))
        if how == "warm":
            assert all(b.warm for b, _ in self.backends)

    @invariant()
    def matches(self):
        for k in range(31):
            s = self.at(k)
            got = (s["value"].value(), s["list"].get(), dict(s["map"].items()), s["reducing"].get(),
                   s["aggregating"].get())
            m = self.model
            assert got == (m["value"].get(k), m["list"].get(k, []), m["map"].get(k, {}), m["reducing"].get(k),
                           m["aggregating"].get(k)), k

    def teardown(self):
        for b, _ in self.backends:
            b.dispose()
        self.tmp.cleanup()


ChainModel.TestCase.settings = settings(max_examples=15, stateful_step_count=25, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
test_rocksdb_chains_model = ChainModel.TestCase


def test_ttl_deletes_never_come_back(tmp_path):
    """An entry TTL expired is a delete in the next delta: restoring the chain does not bring it back, even once
    the clock is turned back (so a value that came back would not look expired)."""
    now = [1000.0]
    ttl = StateTtlConfig.new_builder(10).build()
    d = ValueStateDescriptor("v", Int64Serializer())
    d.enable_time_to_live(ttl)
    storage = CheckpointStorage(tmp_path / "chk")
    b = make(clock=lambda: now[0])
    v = b.get_state(d)
    for k in range(20):
        b.set_current_key(k)
        v.update(k)
    md = commit(storage, [b.snapshot(1, storage).result(30)], 1)
    b.dispose()
    now[0] += 20  # everything expired
    b = make(clock=lambda: now[0])
    b.restore(storage, md)
    v = b.get_state(d)
    for k in range(10):  # read (expired: dropped) half of them
        b.set_current_key(k)
        assert v.value() is None
    h = b.snapshot(2, storage).result(30)
    assert h.full_key_groups == []  # a delta
    md2 = commit(storage, [h], 2)
    b.dispose()
    now[0] = 1001.0  # back in time: a value that came back would be alive
    r = make(clock=lambda: now[0])
    r.restore(storage, md2)
    rv = r.get_state(d)
    for k in range(20):
        r.set_current_key(k)
        assert rv.value() == (None if k < 10 else k)
    r.dispose()
