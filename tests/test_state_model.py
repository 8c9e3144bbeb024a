"""Model-based test: random operations on all five state types over random keys against a plain-dict model, with
snapshot -> restore -> rescale (random p -> random p', max parallelism 128) in between, and writes racing the
asynchronous snapshot; on both backends (RocksDB with fewer subtasks: each one is a database on disk)."""

from __future__ import annotations

import copy
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_state_rescale import Job, descriptors

from keygroups.checkpoint import CheckpointStorage

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
