"""Incremental snapshots of the heap backend (issue 11): restored key groups stay bytes and are read one key at a
time, snapshots write what changed (deltas with deletes) plus the key groups the materialization policy names, and
chains of them restore at any parallelism to exactly what was written, on real files."""

from __future__ import annotations

import copy
import json
import pathlib
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from keygroups import KeyGroupRange, assign_to_key_group, assign_to_operator, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward, open_snapshot
from keygroups.serializers import Int64Serializer, StrSerializer, ValueSerializer
from keygroups.state import (
    AggregatingStateDescriptor,
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtlConfig,
    ValueStateDescriptor,
)
from test_state_rescale import SumCount

MAXP = 128


class Chain:
    """Commits checkpoints one after another, each carrying forward the files its chains still need."""

    def __init__(self, storage, maxp=MAXP):
        self.storage, self.maxp, self.last = storage, maxp, None

    def commit(self, checkpoint_id, handles, parallelism):
        self.storage.commit(CheckpointMetadata(
            checkpoint_id=checkpoint_id, job_id="incremental", timestamp_ms=0, max_parallelism=self.maxp,
            parallelism=parallelism, keyed_handles=carry_forward(self.last, handles), operator_handles=[],
            properties={}))
        self.last = self.storage.load(checkpoint_id)
        return self.last


class Counting(Int64Serializer):
    """A real Int64 serializer that counts the values it decodes, one by one or many at once."""

    def __init__(self):
        super().__init__()
        self.decoded = 0

    def deserialize(self, data):
        self.decoded += 1
        return super().deserialize(data)

    def deserialize_many(self, data, offsets):
        self.decoded += len(offsets) - 1
        return super().deserialize_many(data, offsets)


def _fill(backend, state, keys, value=lambda k: k):
    for k in keys:
        backend.set_current_key(k)
        state.update(value(k))


def test_delta_holds_the_changes_and_deletes_shadow_older_blocks(tmp_path):
    storage = CheckpointStorage(tmp_path, retain=100)
    chain = Chain(storage)
    b = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    v = b.get_state(ValueStateDescriptor("v", Int64Serializer()))
    lst = b.get_state(ListStateDescriptor("l", Int64Serializer()))
    keys = range(2000)
    _fill(b, v, keys)
    for k in keys:
        b.set_current_key(k)
        lst.add(k)
    first = b.snapshot(1, storage).result(30)
    assert first.full_key_groups == [KeyGroupRange(0, MAXP - 1)]
    chain.commit(1, [first], 1)
    for k in range(0, 2000, 100):  # changed, deleted, appended
        b.set_current_key(k)
        v.update(-k)
        b.set_current_key(k + 1)
        v.clear()
        lst.clear()
        b.set_current_key(k + 2)
        lst.add(-1)
    second = b.snapshot(2, storage).result(30)
    assert second.full_key_groups == []
    assert second.size < first.size / 4
    delta = open_snapshot(storage.read_bytes(second.file, 0, second.size))
    puts = deletes = 0
    for block in delta.key_groups():
        assert not block.full
        puts += sum(len(keys) for _, keys, _ in block.puts)
        deletes += sum(len(keys) for _, keys in block.deletes)
    assert (puts, deletes) == (20 + 20, 20 + 20)  # v: 20 changed, 20 deleted; l: 20 appended, 20 deleted
    md = chain.commit(2, [second], 1)
    assert [h.checkpoint_id for h in md.keyed_handles] == [1, 2]

    def expected(k):
        value = -k if k % 100 == 0 else None if k % 100 == 1 else k
        items = [] if k % 100 == 1 else [k, -1] if k % 100 == 2 else [k]
        return value, items

    for kgr in (KeyGroupRange(0, MAXP - 1), KeyGroupRange(40, 90)):  # the same range and another one
        new = HeapKeyedStateBackend(kgr, MAXP, Int64Serializer())
        new.restore(storage, md)
        nv = new.get_state(ValueStateDescriptor("v", Int64Serializer()))
        nl = new.get_state(ListStateDescriptor("l", Int64Serializer()))
        mine = [k for k in keys if assign_to_key_group(k, MAXP) in kgr]
        for k in mine:
            new.set_current_key(k)
            assert (nv.value(), nl.get()) == expected(k), k
        assert sorted(new.keys("v")) == [k for k in mine if expected(k)[0] is not None]
        assert sorted(new.keys("l")) == [k for k in mine if expected(k)[1]]


def test_restoring_a_million_keys_and_touching_ten_thousand_decodes_ten_thousand_values(tmp_path):
    storage = CheckpointStorage(tmp_path, retain=100)
    chain = Chain(storage)
    n, touched = 1_000_000, range(0, 1_000_000, 100)
    b = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    _fill(b, b.get_state(ValueStateDescriptor("v", Int64Serializer())), range(n))
    md = chain.commit(1, [b.snapshot(1, storage).result(60)], 1)
    del b
    keys = Counting()
    values = Counting()
    new = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, keys)
    new.restore(storage, md)
    v = new.get_state(ValueStateDescriptor("v", values))
    for k in touched:
        new.set_current_key(k)
        v.update(v.value() + 1)
    assert values.decoded == len(touched)
    assert keys.decoded == 0  # keys are found by their bytes, not decoded
    handle = new.snapshot(2, storage).result(60)
    assert values.decoded == len(touched)
    assert handle.full_key_groups == [] and handle.size < md.keyed_handles[0].size / 20
    md2 = chain.commit(2, [handle], 1)
    check = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    check.restore(storage, md2)
    cv = check.get_state(ValueStateDescriptor("v", Int64Serializer()))
    for k in (0, 1, 99, 100, 101, 999_900, 999_999):
        check.set_current_key(k)
        assert cv.value() == (k + 1 if k % 100 == 0 else k)


@pytest.mark.parametrize("decoded_first", [False, True])
def test_deleting_a_restored_key_shadows_its_older_block(tmp_path, decoded_first):
    """Every way to delete, on a key still in a restored block or already decoded from it: the key stays gone in the
    live backend, in its next (delta) snapshot and after restoring that."""
    storage = CheckpointStorage(tmp_path, retain=100)
    chain = Chain(storage)
    descs = {"v": ValueStateDescriptor("v", Int64Serializer()), "l": ListStateDescriptor("l", Int64Serializer()),
             "m": MapStateDescriptor("m", StrSerializer(), Int64Serializer())}
    b = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    s = {n: b.get_state(d) for n, d in descs.items()}
    for k in range(50):
        b.set_current_key(k)
        s["v"].update(k)
        s["l"].add(k)
        s["m"].put("a", k)
    md = chain.commit(1, [b.snapshot(1, storage).result(30)], 1)
    deletes = {"v": lambda st: st.clear(), "l": lambda st: st.update([]), "m": lambda st: st.remove("a")}
    reads = {"v": lambda st: st.value(), "l": lambda st: (st.get() or [None])[0], "m": lambda st: st.get("a")}
    restored = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    restored.restore(storage, md)
    r = {n: restored.get_state(d) for n, d in descs.items()}
    for k in range(0, 50, 2):
        restored.set_current_key(k)
        for name in descs:
            if decoded_first:
                assert reads[name](r[name]) == k
            deletes[name](r[name])
    for k in range(50):
        restored.set_current_key(k)
        for name in descs:
            assert reads[name](r[name]) == (None if k % 2 == 0 else k), (name, k)
    md2 = chain.commit(2, [restored.snapshot(2, storage).result(30)], 1)
    assert md2.keyed_handles[-1].full_key_groups == []
    again = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    again.restore(storage, md2)
    a = {n: again.get_state(d) for n, d in descs.items()}
    for k in range(50):
        again.set_current_key(k)
        for name in descs:
            assert reads[name](a[name]) == (None if k % 2 == 0 else k), (name, k)
    assert sorted(again.keys("v")) == list(range(1, 50, 2))


def test_a_format_1_checkpoint_continues_as_a_chain(tmp_path):
    """Format 1 blocks are unsorted: their keys are decoded on a key group's first lookup, as before. The first
    snapshot after such a restore is full; the chain continues from it with deltas."""
    v1 = pathlib.Path(__file__).parent / "data" / "keyed-checkpoint-v1"
    shutil.copytree(v1, tmp_path / "chk")
    storage = CheckpointStorage(tmp_path / "chk", retain=100)
    chain = Chain(storage, 16)
    chain.last = storage.load(1)
    expected = {int(k): v for k, v in json.loads((v1 / "expected.json").read_text()).items()}
    descs = {"count": ValueStateDescriptor("count", Int64Serializer()),
             "events": ListStateDescriptor("events", StrSerializer()),
             "attrs": MapStateDescriptor("attrs", StrSerializer(), ValueSerializer())}

    def backend(metadata):
        b = HeapKeyedStateBackend(KeyGroupRange(0, 15), 16, Int64Serializer())
        b.restore(storage, metadata)
        return b, {n: b.get_state(d) for n, d in descs.items()}

    def check(b, s):
        for k, want in expected.items():
            b.set_current_key(k)
            assert [s["count"].value(), s["events"].get(), dict(s["attrs"].items())] == want, k

    b, s = backend(chain.last)
    for cid, keys in ((2, list(expected)[::3]), (3, list(expected)[1::5])):
        for k in keys:  # clear or change state still in the restored (unsorted or delta) blocks
            b.set_current_key(k)
            if k % 2:
                s["count"].clear()
                s["events"].clear()
                s["attrs"].clear()
                expected[k] = [None, [], {}]
            else:
                s["count"].update(-k)
                s["events"].add("g")
                expected[k] = [-k, expected[k][1] + ["g"], expected[k][2]]
        handle = b.snapshot(cid, storage).result(30)
        assert handle.is_all_full == (cid == 2)
        check(b, s)
        b, s = backend(chain.commit(cid, [handle], 1))
        check(b, s)


def test_a_failed_snapshot_gives_its_changes_to_the_next_one(tmp_path):
    class Failing(CheckpointStorage):
        fail = True

        def open_write(self, relpath):
            if self.fail:
                raise OSError("disk full")
            return super().open_write(relpath)

    storage = Failing(tmp_path, retain=100)
    chain = Chain(storage)
    storage.fail = False
    b = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    v = b.get_state(ValueStateDescriptor("v", Int64Serializer()))
    _fill(b, v, range(500))
    chain.commit(1, [b.snapshot(1, storage).result(30)], 1)
    _fill(b, v, range(0, 500, 7), lambda k: -k)
    storage.fail = True
    with pytest.raises(OSError, match="disk full"):
        b.snapshot(2, storage).result(30)
    storage.fail = False
    _fill(b, v, range(3, 500, 11), lambda k: 1000 + k)
    md = chain.commit(3, [b.snapshot(3, storage).result(30)], 1)
    new = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    new.restore(storage, md)
    nv = new.get_state(ValueStateDescriptor("v", Int64Serializer()))
    for k in range(500):
        new.set_current_key(k)
        assert nv.value() == (1000 + k if k % 11 == 3 else -k if k % 7 == 0 else k)


def test_not_incremental_writes_every_snapshot_full_and_tracks_nothing(tmp_path):
    storage = CheckpointStorage(tmp_path, retain=100)
    b = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer(), incremental=False)
    v = b.get_state(ValueStateDescriptor("v", Int64Serializer()))
    _fill(b, v, range(100))
    b.snapshot(1, storage).result(30)
    _fill(b, v, range(10))
    assert not any(b._tables["v"].dirty)
    assert b.snapshot(2, storage).result(30).full_key_groups == [KeyGroupRange(0, MAXP - 1)]


# ---- the model: chains of incremental snapshots, restores at any parallelism, materialization, TTL -------------
TTL_SECONDS = 100


def descriptors():
    ttl = StateTtlConfig.new_builder(TTL_SECONDS).cleanup_full_snapshot().build()
    ds = {
        "value": ValueStateDescriptor("value", ValueSerializer()),
        "list": ListStateDescriptor("list", Int64Serializer()),
        "map": MapStateDescriptor("map", StrSerializer(), ValueSerializer()),
        "reducing": ReducingStateDescriptor("reducing", lambda a, b: a + b, Int64Serializer()),
        "aggregating": AggregatingStateDescriptor("aggregating", SumCount(), ValueSerializer()),
        "ttl_value": ValueStateDescriptor("ttl_value", Int64Serializer()),
        "ttl_list": ListStateDescriptor("ttl_list", Int64Serializer()),
        "ttl_map": MapStateDescriptor("ttl_map", StrSerializer(), Int64Serializer()),
    }
    for name, d in ds.items():
        if name.startswith("ttl_"):
            d.enable_time_to_live(ttl)
    return ds


TTL_STATES = [n for n in descriptors() if n.startswith("ttl_")]
NKEYS = 40
KEYS = st.integers(min_value=0, max_value=NKEYS - 1)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class IncrementalModel(RuleBasedStateMachine):
    """Every state of every key equals a dict model, across chains of incremental checkpoints (deltas, deletes,
    materialized key groups), restores at the same or another parallelism, warm backends kept between
    checkpoints, writes racing the asynchronous snapshot, and TTL expiry. A small max parallelism puts several
    keys in most key groups, so that chains have deltas to stack."""

    MAXP = 16
    PARALLELISM = st.sampled_from([1, 2, 3, 5, 8, 16])

    def __init__(self):
        super().__init__()
        self.backends = None
        self.checkpoint_id = 0
        self.model = {n: {} for n in descriptors()}
        self.clock = Clock()

    @initialize(p=PARALLELISM, max_chain=st.sampled_from([1, 2, 3, 8]))
    def start(self, p, max_chain):
        self.tmp = tempfile.TemporaryDirectory(prefix="kg-incremental-")
        self.storage = CheckpointStorage(self.tmp.name, retain=1000)
        self.chain = Chain(self.storage, self.MAXP)
        self.max_chain = max_chain
        self.open(p, None)

    def open(self, p, metadata):
        self.p = p
        maxp = self.MAXP
        self.backends = [HeapKeyedStateBackend(key_group_range(maxp, p, i), maxp, Int64Serializer(), subtask_index=i,
                                               clock=self.clock, max_chain=self.max_chain) for i in range(p)]
        if metadata is not None:
            for b in self.backends:
                b.restore(self.storage, metadata)
        self.states = [{n: b.get_state(d) for n, d in descriptors().items()} for b in self.backends]

    def teardown(self):
        if self.backends is not None:
            self.tmp.cleanup()

    def at(self, k):
        i = assign_to_operator(k, self.MAXP, self.p)
        self.backends[i].set_current_key(k)
        return self.states[i]

    @rule(k=KEYS, v=st.one_of(st.none(), st.integers(), st.lists(st.integers(), max_size=3)))
    def value_update(self, k, v):
        self.at(k)["value"].update(v)
        if v is None:
            self.model["value"].pop(k, None)
        else:
            self.model["value"][k] = copy.deepcopy(v)

    @rule(k=KEYS)
    def value_mutate_in_place(self, k):
        v = self.at(k)["value"].value()
        if isinstance(v, list):
            v.append(7)  # not written back: the heap state holds this very object, and the delta must see it
            self.model["value"][k] = self.model["value"][k] + [7]

    @rule(k=KEYS, vs=st.lists(st.integers(-5, 5), max_size=3), name=st.sampled_from(["list", "ttl_list"]))
    def list_add_all(self, k, vs, name):
        s = self.at(k)[name]
        if len(vs) == 1:
            s.add(vs[0])
        else:
            s.add_all(vs)
        if vs:
            self.model[name].setdefault(k, []).extend(vs)

    @rule(k=KEYS, vs=st.lists(st.integers(-5, 5), max_size=3), name=st.sampled_from(["list", "ttl_list"]))
    def list_update(self, k, vs, name):
        self.at(k)[name].update(vs)
        if vs:
            self.model[name][k] = list(vs)
        else:
            self.model[name].pop(k, None)

    @rule(k=KEYS, uk=st.sampled_from("abc"), uv=st.integers(-1000, 1000), name=st.sampled_from(["map", "ttl_map"]))
    def map_put(self, k, uk, uv, name):
        self.at(k)[name].put(uk, uv)
        self.model[name].setdefault(k, {})[uk] = uv

    @rule(k=KEYS, uk=st.sampled_from("abc"), name=st.sampled_from(["map", "ttl_map"]))
    def map_remove(self, k, uk, name):
        self.at(k)[name].remove(uk)
        m = self.model[name].get(k)
        if m is not None:
            m.pop(uk, None)
            if not m:
                del self.model[name][k]

    @rule(k=KEYS, v=st.integers(-100, 100))
    def ttl_value_update(self, k, v):
        self.at(k)["ttl_value"].update(v)
        self.model["ttl_value"][k] = v

    @rule(k=KEYS, v=st.integers(-100, 100))
    def reducing_add(self, k, v):
        self.at(k)["reducing"].add(v)
        self.model["reducing"][k] = self.model["reducing"].get(k, 0) + v

    @rule(k=KEYS, v=st.integers(-100, 100))
    def aggregating_add(self, k, v):
        self.at(k)["aggregating"].add(v)
        s, c = self.model["aggregating"].get(k, (0, 0))
        self.model["aggregating"][k] = (s + v, c + 1)

    @rule(k=KEYS, name=st.sampled_from(sorted(descriptors())))
    def clear(self, k, name):
        self.at(k)[name].clear()
        self.model[name].pop(k, None)

    @rule(data=st.data(), name=st.sampled_from(sorted(descriptors())))
    def clear_a_present_key(self, data, name):
        """Deletes that hit a key with a value (perhaps still in a restored block): the ones that matter."""
        present = sorted(self.model[name])
        if present:
            self.clear(data.draw(st.sampled_from(present), label="k"), name)

    @rule()
    def ttl_expires(self):
        """Every TTL entry written so far expires (nothing of it may come back from an older block)."""
        self.clock.t += TTL_SECONDS + 1
        for name in TTL_STATES:
            self.model[name].clear()

    @rule(k=KEYS)
    def read(self, k):
        assert self.read_all(k) == self.expected(k)

    @rule(data=st.data(), scribble=st.booleans(), restore=st.booleans())
    def checkpoint(self, data, scribble, restore):
        self.checkpoint_id += 1
        futures = [b.snapshot(self.checkpoint_id, self.storage) for b in self.backends]
        if scribble:  # writes after the synchronous capture reach neither the snapshot nor (undone) the model
            saved = copy.deepcopy(self.model)
            for k in range(NKEYS):
                s = self.at(k)
                s["value"].update(["garbage"])
                s["list"].add(99)
                s["map"].put("z", "garbage")
                s["ttl_value"].update(12345)
        metadata = self.chain.commit(self.checkpoint_id, [f.result(60) for f in futures], self.p)
        if scribble or restore:
            p = data.draw(self.PARALLELISM, label="p'") if restore else self.p
            self.open(p, metadata)
            if scribble:
                self.model = saved

    @precondition(lambda self: self.chain.last is not None)
    @rule()
    def restored_reads_stay_within_the_chains(self):
        """A restore reads each key group's chain and nothing else: at most every block of its checkpoints."""
        fresh = HeapKeyedStateBackend(KeyGroupRange(0, self.MAXP - 1), self.MAXP, Int64Serializer(), clock=self.clock)
        stats = fresh.restore(self.storage, self.chain.last)
        assert stats.bytes_read <= sum(h.size for h in self.chain.last.keyed_handles)

    def read_all(self, k):
        s = self.at(k)
        return tuple(s[n].value() if n.endswith("value") else s[n].get() if n.endswith("list") or n in (
            "reducing", "aggregating") else dict(s[n].items()) for n in descriptors())

    def expected(self, k):
        out = []
        for n in descriptors():
            v = self.model[n].get(k)
            if n.endswith("list"):
                v = list(v or [])
            elif n.endswith("map"):
                v = dict(v or {})
            out.append(v)
        return tuple(out)

    @invariant()
    def all_keys_match(self):
        if self.backends is None:
            return
        for k in range(NKEYS):
            assert self.read_all(k) == self.expected(k), k
        for name in ("value", "list", "map", "reducing", "aggregating"):
            found = sorted(k for b in self.backends for k in b.keys(name))
            assert found == sorted(self.model[name]), name


# 50 runs of 50 steps: chains, restores and rescales against a dict are also searched at the format layer
# (test_incremental_checkpoints' random histories) and through batches (test_heap_warm's model); CI time is budgeted.
IncrementalModel.TestCase.settings = settings(
    max_examples=50, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_incremental_model = IncrementalModel.TestCase
