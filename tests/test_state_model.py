"""Model-based test: random operations on all five state types over random keys against a plain-dict model, with
snapshot -> restore -> rescale (random p -> random p', max parallelism 128) in between, and writes racing the
asynchronous snapshot; on both backends (RocksDB with fewer subtasks: each one is a database on disk). Then the same
for float job keys and float map keys against a model of Java's equality (NaN payloads, signed zeros)."""

from __future__ import annotations

import copy
import math
import os
import struct
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_state_rescale import Job, descriptors

from keygroups import assign_to_key_group, key_group_range, operator_index_for_key_group
from keygroups.checkpoint import CheckpointStorage
from keygroups.serializers import Float64Serializer, Int64Serializer
from keygroups.state import (
    HeapKeyedStateBackend,
    MapStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    ValueStateDescriptor,
)

BACKENDS = {"heap": HeapKeyedStateBackend, "rocksdb": RocksDBKeyedStateBackend}

NKEYS = 25
KEYS = st.integers(min_value=0, max_value=NKEYS - 1)


class StateModel(RuleBasedStateMachine):
    """Every state of every key always equals a plain-dict model, across snapshots, restores and rescales."""

    KIND = "heap"
    # Mostly small (cheap), sometimes large: every subtask is a backend, a snapshot file and a restore.
    PARALLELISM = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 13, 64, 127, 128])

    def __init__(self):
        super().__init__()
        self.job = None
        self.checkpoint_id = 0
        self.model = {n: {} for n in descriptors()}

    @initialize(data=st.data())
    def start(self, data):
        p = data.draw(self.PARALLELISM, label="p")
        self.tmp = tempfile.TemporaryDirectory(prefix="kg-model-")
        self.storage = CheckpointStorage(self.tmp.name)
        self.job = Job(self.KIND, 128, p)

    def teardown(self):
        if self.job is not None:
            self.job.dispose()
            self.tmp.cleanup()

    @rule(k=KEYS, v=st.one_of(st.none(), st.integers(), st.lists(st.integers(), max_size=3)))
    def value_update(self, k, v):
        self.job.at(k)["value"].update(v)
        if v is None:
            self.model["value"].pop(k, None)
        else:  # the heap backend keeps the object it is given (as Flink's heap backend): the model keeps its own
            self.model["value"][k] = copy.deepcopy(v)

    @rule(k=KEYS)
    def value_mutate_in_place(self, k):
        s = self.job.at(k)["value"]
        v = s.value()
        if isinstance(v, list):
            v.append(7)
            s.update(v)
            self.model["value"][k] = self.model["value"][k] + [7]

    @rule(k=KEYS, vs=st.lists(st.integers(-5, 5), max_size=3))
    def list_add_all(self, k, vs):
        s = self.job.at(k)["list"]
        if len(vs) == 1:
            s.add(vs[0])
        else:
            s.add_all(vs)
        if vs:
            self.model["list"].setdefault(k, []).extend(vs)

    @rule(k=KEYS, vs=st.lists(st.integers(-5, 5), max_size=3))
    def list_update(self, k, vs):
        self.job.at(k)["list"].update(vs)
        if vs:
            self.model["list"][k] = list(vs)
        else:
            self.model["list"].pop(k, None)

    @rule(k=KEYS, uk=st.sampled_from("abc"), uv=st.one_of(st.integers(), st.text(max_size=2)))
    def map_put(self, k, uk, uv):
        self.job.at(k)["map"].put(uk, uv)
        self.model["map"].setdefault(k, {})[uk] = uv

    @rule(k=KEYS, uk=st.sampled_from("abc"))
    def map_remove(self, k, uk):
        self.job.at(k)["map"].remove(uk)
        m = self.model["map"].get(k)
        if m is not None:
            m.pop(uk, None)
            if not m:
                del self.model["map"][k]

    @rule(k=KEYS, v=st.integers(-100, 100))
    def reducing_add(self, k, v):
        self.job.at(k)["reducing"].add(v)
        self.model["reducing"][k] = self.model["reducing"].get(k, 0) + v

    @rule(k=KEYS, v=st.integers(-100, 100))
    def aggregating_add(self, k, v):
        self.job.at(k)["aggregating"].add(v)
        s, c = self.model["aggregating"].get(k, (0, 0))
        self.model["aggregating"][k] = (s + v, c + 1)

    @rule(k=KEYS, name=st.sampled_from(sorted(descriptors())))
    def clear(self, k, name):
        self.job.at(k)[name].clear()
        self.model[name].pop(k, None)

    @rule(k=KEYS)
    def read(self, k):
        assert self.job.read(k) == self.expected(k)

    @rule(data=st.data(), scribble=st.booleans())
    def snapshot_restore_rescale(self, data, scribble):
        p2 = data.draw(self.PARALLELISM, label="p'")
        self.checkpoint_id += 1
        job = self.job

        def write_garbage():  # writes after the synchronous capture must not reach the snapshot
            for k in range(NKEYS):
                s = job.at(k)
                s["value"].update(["garbage"])
                s["list"].add(99)
                s["map"].put("z", "garbage")
                s["reducing"].add(1000)
                s["aggregating"].add(1000)

        md = job.checkpoint(self.storage, self.checkpoint_id, write_garbage if scribble else None)
        job.dispose()
        self.job = Job(job.kind, 128, p2, self.storage, md)
        for name in descriptors():
            found = sorted(k for b in self.job.backends for k in b.keys(name))
            assert found == sorted(self.model[name]), name

    def expected(self, k):
        m = self.model
        return (m["value"].get(k), list(m["list"].get(k, [])), dict(m["map"].get(k, {})), m["reducing"].get(k),
                m["aggregating"].get(k))

    @invariant()
    def all_keys_match(self):
        if self.job is None:
            return
        for k in range(NKEYS):
            assert self.job.read(k) == self.expected(k)


class RocksDBStateModel(StateModel):
    KIND = "rocksdb"
    PARALLELISM = st.integers(min_value=1, max_value=4)


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
StateModel.TestCase.settings = settings(max_examples=30, stateful_step_count=20, **_SETTINGS)
RocksDBStateModel.TestCase.settings = settings(max_examples=10, stateful_step_count=15, **_SETTINGS)
test_heap_state_model = StateModel.TestCase
test_rocksdb_state_model = RocksDBStateModel.TestCase


# ---------------------------------------------------------------------------------------------------------------------
# Float keys: job keys and map keys compare as Java's equals (every NaN one key, whatever its payload; 0.0 and -0.0
# two), on both backends, through snapshots, restores at another parallelism, and warm reuse (a heap backend resumed,
# a RocksDB database kept in its warm directory). The model keys everything by Java's doubleToLongBits.
# ---------------------------------------------------------------------------------------------------------------------
def java_bits(x: float) -> int:
    """Java's doubleToLongBits: the IEEE bits, every NaN the one canonical NaN."""
    return 0x7FF8000000000000 if math.isnan(x) else struct.unpack("<q", struct.pack("<d", x))[0]


def _from_hex(h: str) -> float:
    return struct.unpack(">d", bytes.fromhex(h))[0]


#: NaNs with several payloads and both signs, both zeros, and a few ordinary values.
FLOATS = st.sampled_from([_from_hex("7ff8000000000000"), _from_hex("fff8000000000000"), _from_hex("7ff0000000000001"),
                          _from_hex("7fffffffffffffff"), 0.0, -0.0, 1.5, -1.5, math.inf])
TTL = StateTtlConfig.new_builder(3600).build()
MAXP = 16


def float_descriptors():
    ttl_map = MapStateDescriptor("ttl map", Float64Serializer(), Int64Serializer())
    ttl_map.enable_time_to_live(TTL)
    return {"value": ValueStateDescriptor("value", Int64Serializer()),
            "map": MapStateDescriptor("map", Float64Serializer(), Int64Serializer()),
            "ttl map": ttl_map}


class FloatJob(Job):
    """p subtasks keyed by Float64 job keys, each with a value state and two Float64-keyed map states (one with
    TTL); checkpoints as ``Job`` does. With ``warm_dir``, RocksDB databases are kept there and reused by a restore
    at the same parallelism; with ``previous``, its heap backends are resumed instead of restored."""

    def __init__(self, kind, p, storage=None, metadata=None, warm_dir=None, previous=None):
        self.kind, self.maxp, self.p = kind, MAXP, p
        self.resumed = False
        if previous is not None:   # heap: continue with the backends the previous job kept
            stats = [b.resume(storage, metadata) for b in previous.backends]
            assert all(s is not None for s in stats)
            self.backends, self.resumed = previous.backends, True
        else:
            extra = {"warm_dir": warm_dir} if warm_dir is not None else {}
            self.backends = [BACKENDS[kind](key_group_range(MAXP, p, i), MAXP, Float64Serializer(),
                                            key_type="double", subtask_index=i, **extra) for i in range(p)]
            if metadata is not None:
                for b in self.backends:
                    b.restore(storage, metadata)
        self.states = [{n: b.get_state(d) for n, d in float_descriptors().items()} for b in self.backends]

    def at(self, key):
        i = operator_index_for_key_group(MAXP, self.p, assign_to_key_group(key, MAXP, "double"))
        self.backends[i].set_current_key(key)
        return self.states[i]



class FloatKeyModel(RuleBasedStateMachine):
    """Float job keys and float map keys against a model keyed by Java's doubleToLongBits."""

    KIND = "heap"

    def __init__(self):
        super().__init__()
        self.job = None
        self.checkpoint_id = 0
        self.model = {n: {} for n in float_descriptors()}   # state -> java bits -> value / {java bits: value}

    @initialize(p=st.integers(1, 3))
    def start(self, p):
        self.tmp = tempfile.TemporaryDirectory(prefix="kg-float-model-")
        self.storage = CheckpointStorage(os.path.join(self.tmp.name, "chk"))
        self.warm_dir = os.path.join(self.tmp.name, "warm")
        self.job = FloatJob(self.KIND, p, warm_dir=self.warm_dir if self.KIND == "rocksdb" else None)

    def teardown(self):
        if self.job is not None:
            self.job.dispose()
            self.tmp.cleanup()

    @rule(k=FLOATS, v=st.integers(-9, 9))
    def value_add(self, k, v):
        s = self.job.at(k)["value"]
        s.update((s.value() or 0) + v)
        m = self.model["value"]
        m[java_bits(k)] = m.get(java_bits(k), 0) + v

    @rule(k=FLOATS, uk=FLOATS, v=st.integers(-9, 9), name=st.sampled_from(["map", "ttl map"]))
    def map_put(self, k, uk, v, name):
        self.job.at(k)[name].put(uk, v)
        self.model[name].setdefault(java_bits(k), {})[java_bits(uk)] = v

    @rule(k=FLOATS, entries=st.lists(st.tuples(FLOATS, st.integers(-9, 9)), max_size=4),
          name=st.sampled_from(["map", "ttl map"]))
    def map_put_all(self, k, entries, name):
        mapping = dict(entries)   # a Python dict: 0.0 and -0.0 are one key of it, NaN objects apart
        self.job.at(k)[name].put_all(mapping)
        if mapping:
            target = self.model[name].setdefault(java_bits(k), {})
            for uk, v in mapping.items():
                target[java_bits(uk)] = v

    @rule(k=FLOATS, uk=FLOATS, name=st.sampled_from(["map", "ttl map"]))
    def map_remove(self, k, uk, name):
        self.job.at(k)[name].remove(uk)
        m = self.model[name].get(java_bits(k))
        if m is not None:
            m.pop(java_bits(uk), None)
            if not m:
                del self.model[name][java_bits(k)]

    @rule(k=FLOATS, uk=FLOATS, name=st.sampled_from(["map", "ttl map"]))
    def map_get(self, k, uk, name):
        s = self.job.at(k)[name]
        want = self.model[name].get(java_bits(k), {}).get(java_bits(uk))
        assert s.get(uk) == want
        assert s.contains(uk) == (want is not None)

    @rule(k=FLOATS, name=st.sampled_from(sorted(float_descriptors())))
    def clear(self, k, name):
        self.job.at(k)[name].clear()
        self.model[name].pop(java_bits(k), None)

    @rule(p2=st.integers(1, 3), warm=st.booleans())
    def snapshot_restore_rescale(self, p2, warm):
        """Snapshot, then restore at p2 (cold), or continue warm at the same parallelism."""
        self.checkpoint_id += 1
        job = self.job
        md = job.checkpoint(self.storage, self.checkpoint_id)
        if warm and self.KIND == "heap":
            self.job = FloatJob(self.KIND, job.p, self.storage, md, previous=job)
        else:
            p = job.p if warm else p2
            job.dispose()
            self.job = FloatJob(self.KIND, p, self.storage, md,
                                warm_dir=self.warm_dir if self.KIND == "rocksdb" else None)
        for name in float_descriptors():
            found = [java_bits(k) for b in self.job.backends for k in b.keys(name)]
            assert sorted(found) == sorted(self.model[name]), name   # each key once

    def expected_map(self, name, bits):
        return self.model[name].get(bits, {})

    @invariant()
    def all_keys_match(self):
        if self.job is None:
            return
        for k in (_from_hex("7ff8000000000000"), _from_hex("fff0000000000123"), 0.0, -0.0, 1.5, -1.5, math.inf):
            s = self.job.at(k)
            bits = java_bits(k)
            assert s["value"].value() == self.model["value"].get(bits)
            for name in ("map", "ttl map"):
                got = {java_bits(uk): v for uk, v in s[name].items()}
                assert len(got) == len(s[name].items())   # each map key once
                assert got == self.expected_map(name, bits), name


class RocksDBFloatKeyModel(FloatKeyModel):
    KIND = "rocksdb"


FloatKeyModel.TestCase.settings = settings(max_examples=40, stateful_step_count=25, **_SETTINGS)
RocksDBFloatKeyModel.TestCase.settings = settings(max_examples=20, stateful_step_count=20, **_SETTINGS)
test_heap_float_key_model = FloatKeyModel.TestCase
test_rocksdb_float_key_model = RocksDBFloatKeyModel.TestCase
