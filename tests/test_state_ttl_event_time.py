"""Event-time TTL: state that expires as the watermark passes, beside processing-time TTL, chosen per state. A model
test (random writes, reads, watermark advances, snapshots, restores and rescales, also of the max parallelism,
against plain dicts) on both backends; the clocks, the restore checks, and one job through the runtime's driver
protocol whose state expires across rescales."""

from __future__ import annotations

import pickle
import tempfile

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from keygroups._parquet import read_parquet
import keygroups as kg
from keygroups import KeyGroupRange, assign_to_operator, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.errors import StateMigrationError
from keygroups.runtime import begin_batch, commit_batch
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.serializers import Int64Serializer, StrSerializer
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    TtlTimeCharacteristic,
    ValueStateDescriptor,
)
from keygroups.state.timers import NO_WATERMARK
from keygroups.state.ttl import EVENT_TIME_NOT_STARTED

BACKENDS = {"heap": HeapKeyedStateBackend, "rocksdb": RocksDBKeyedStateBackend}
EVENT_TIME = TtlTimeCharacteristic.EventTime
TTL_MS = 10


@pytest.fixture(params=sorted(BACKENDS))
def kind(request):
    return request.param


def event_ttl(ms=TTL_MS, *, on_read=False, return_expired=False, cleanup=False):
    b = StateTtlConfig.new_builder(ms / 1000).set_ttl_time_characteristic(EVENT_TIME)
    if on_read:
        b.update_ttl_on_read_and_write()
    if return_expired:
        b.return_expired_if_not_cleaned_up()
    if cleanup:
        b.cleanup_full_snapshot()
    return b.build()


def descriptors(cfg):
    ds = {
        "value": ValueStateDescriptor("value", Int64Serializer()),
        "list": ListStateDescriptor("list", Int64Serializer()),
        "map": MapStateDescriptor("map", StrSerializer(), Int64Serializer()),
        "reducing": ReducingStateDescriptor("reducing", lambda a, b: a + b, Int64Serializer()),
    }
    for d in ds.values():
        d.enable_time_to_live(cfg)
    return ds


def commit(storage, handles, checkpoint_id, parallelism, maxp):
    storage.commit(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="ttl", timestamp_ms=0,
                                      max_parallelism=maxp, parallelism=parallelism,
                                      keyed_handles=carry_forward(storage.latest(), handles, max_parallelism=maxp),
                                      operator_handles=[], properties={}))
    return storage.load(checkpoint_id)


# ---- the model ---------------------------------------------------------------------------------------------------
class Model:
    """The event-time TTL contract on plain dicts: entries are (value, timestamp); a write stamps the watermark (or
    EVENT_TIME_NOT_STARTED before the first one); an entry is expired once timestamp + ttl <= watermark (never
    without a watermark); an access removes expired entries (returning them once under ReturnExpiredIfNotCleanedUp)
    and stamps the live ones it reads under OnReadAndWrite, and the not-started ones once there is a watermark."""

    def __init__(self, ttl, on_read, return_expired):
        self.ttl, self.on_read, self.return_expired = ttl, on_read, return_expired
        self.watermark = NO_WATERMARK
        self.s = {"value": {}, "list": {}, "map": {}, "reducing": {}}
        self.written = {name: set() for name in self.s}   # keys ever written, per state

    def stamp(self):
        return EVENT_TIME_NOT_STARTED if self.watermark == NO_WATERMARK else self.watermark

    def expired(self, ts):
        return ts + self.ttl <= self.watermark

    def read_stamp(self, ts):
        if self.on_read or (ts == EVENT_TIME_NOT_STARTED and self.stamp() != EVENT_TIME_NOT_STARTED):
            return self.stamp()
        return ts

    def read_single(self, name, k):
        m = self.s[name]
        e = m.get(k)
        if e is None:
            return None
        if self.expired(e[1]):
            del m[k]
            return e[0] if self.return_expired else None
        m[k] = (e[0], self.read_stamp(e[1]))
        return e[0]

    def read_list(self, k):
        w = self.s["list"].get(k)
        if w is None:
            return []
        keep = [x for x in w if not self.expired(x[1])]
        out = [x[0] for x in (w if self.return_expired else keep)]
        if keep:
            self.s["list"][k] = [(x[0], self.read_stamp(x[1])) for x in keep]
        else:
            del self.s["list"][k]
        return out

    def read_map_entry(self, k, uk):
        m = self.s["map"].get(k)
        if m is None or uk not in m:
            return None
        x = m[uk]
        if self.expired(x[1]):
            del m[uk]
            if not m:
                del self.s["map"][k]
            return x[0] if self.return_expired else None
        m[uk] = (x[0], self.read_stamp(x[1]))
        return x[0]

    def read_map(self, k):
        m = self.s["map"].get(k)
        if m is None:
            return {}
        live = {u: x for u, x in m.items() if not self.expired(x[1])}
        out = {u: x[0] for u, x in (m if self.return_expired else live).items()}
        if live:
            self.s["map"][k] = {u: (x[0], self.read_stamp(x[1])) for u, x in live.items()}
        else:
            del self.s["map"][k]
        return out

    def reducing_add(self, k, v):
        e = self.s["reducing"].get(k)
        total = v if e is None or self.expired(e[1]) else e[0] + v
        self.s["reducing"][k] = (total, self.stamp())
        self.written["reducing"].add(k)

    def stored_keys(self, name):
        return set(self.s[name])

    def live_keys(self, name):
        def live(entry):
            if name == "list":
                return any(not self.expired(x[1]) for x in entry)
            if name == "map":
                return any(not self.expired(x[1]) for x in entry.values())
            return not self.expired(entry[1])
        return {k for k, e in self.s[name].items() if live(e)}


class Job:
    """p subtasks (a backend each) at max parallelism maxp, all at one watermark, the four TTL states each."""

    def __init__(self, kind, maxp, p, cfg, watermark, storage=None, metadata=None):
        self.kind, self.maxp, self.p = kind, maxp, p
        self.backends = [BACKENDS[kind](key_group_range(maxp, p, i), maxp, Int64Serializer(), subtask_index=i)
                         for i in range(p)]
        for b in self.backends:
            if metadata is not None:
                b.restore(storage, metadata)
            b.watermark = watermark   # as the runtime: after the restore, before the function opens its state
        self.states = [{n: b.get_state(d) for n, d in descriptors(cfg).items()} for b in self.backends]

    def set_watermark(self, watermark):
        for b in self.backends:
            b.watermark = watermark

    def at(self, key):
        i = assign_to_operator(key, self.maxp, self.p)
        self.backends[i].set_current_key(key)
        return self.states[i]

    def keys(self, name):
        return {k for b in self.backends for k in b.keys(name)}

    def checkpoint(self, storage, checkpoint_id):
        handles = [b.snapshot(checkpoint_id, storage).result(60) for b in self.backends]
        return commit(storage, handles, checkpoint_id, self.p, self.maxp)

    def dispose(self):
        for b in self.backends:
            b.dispose()


NKEYS = 12
KEYS = st.integers(0, NKEYS - 1)


class EventTimeTtlModel(RuleBasedStateMachine):
    """Every read of every TTL state equals the model's, across watermark advances, snapshots (incremental: the
    chains grow), restores and rescales (of the parallelism and of the max parallelism)."""

    KIND = "heap"
    PARALLELISM = st.sampled_from([1, 2, 3, 5, 8])

    @initialize(data=st.data())
    def start(self, data):
        on_read = data.draw(st.booleans(), label="on_read")
        cleanup = data.draw(st.booleans(), label="cleanup")
        # snapshot cleanup may drop an expired entry before a read would have returned it once: not modelled
        return_expired = not cleanup and data.draw(st.booleans(), label="return_expired")
        self.cfg = event_ttl(on_read=on_read, return_expired=return_expired, cleanup=cleanup)
        self.model = Model(TTL_MS, on_read, return_expired)
        self.tmp = tempfile.TemporaryDirectory(prefix="kg-ttl-")
        self.storage = CheckpointStorage(self.tmp.name)
        self.checkpoint_id = 0
        self.job = Job(self.KIND, 128, data.draw(self.PARALLELISM, label="p"), self.cfg, NO_WATERMARK)

    def teardown(self):
        if hasattr(self, "job"):
            self.job.dispose()
            self.tmp.cleanup()

    @rule(delta=st.integers(0, 2 * TTL_MS))
    def advance_watermark(self, delta):
        m = self.model
        m.watermark = 1_000 + delta if m.watermark == NO_WATERMARK else m.watermark + delta
        self.job.set_watermark(m.watermark)

    @rule(k=KEYS, v=st.one_of(st.none(), st.integers(-50, 50)))
    def value_update(self, k, v):
        self.job.at(k)["value"].update(v)
        if v is None:
            self.model.s["value"].pop(k, None)
        else:
            self.model.s["value"][k] = (v, self.model.stamp())
            self.model.written["value"].add(k)

    @rule(k=KEYS)
    def value_read(self, k):
        assert self.job.at(k)["value"].value() == self.model.read_single("value", k)

    @rule(k=KEYS, vs=st.lists(st.integers(-5, 5), min_size=1, max_size=3))
    def list_add(self, k, vs):
        s = self.job.at(k)["list"]
        s.add(vs[0]) if len(vs) == 1 else s.add_all(vs)
        self.model.s["list"].setdefault(k, []).extend((v, self.model.stamp()) for v in vs)
        self.model.written["list"].add(k)

    @rule(k=KEYS)
    def list_read(self, k):
        assert self.job.at(k)["list"].get() == self.model.read_list(k)

    @rule(k=KEYS, uk=st.sampled_from("abc"), v=st.integers(-5, 5))
    def map_put(self, k, uk, v):
        self.job.at(k)["map"].put(uk, v)
        self.model.s["map"].setdefault(k, {})[uk] = (v, self.model.stamp())
        self.model.written["map"].add(k)

    @rule(k=KEYS, uk=st.sampled_from("abc"))
    def map_get(self, k, uk):
        assert self.job.at(k)["map"].get(uk) == self.model.read_map_entry(k, uk)

    @rule(k=KEYS)
    def map_items(self, k):
        assert dict(self.job.at(k)["map"].items()) == self.model.read_map(k)

    @rule(k=KEYS, v=st.integers(-5, 5))
    def reducing_add(self, k, v):
        self.job.at(k)["reducing"].add(v)
        self.model.reducing_add(k, v)

    @rule(k=KEYS)
    def reducing_get(self, k):
        assert self.job.at(k)["reducing"].get() == self.model.read_single("reducing", k)

    @rule()
    def stored_keys_between_live_and_written(self):
        for name in self.model.s:
            found = self.job.keys(name)
            if not self.cfg.cleanup_full_snapshot:   # entries go only when accessed: exactly the model's
                assert found == self.model.stored_keys(name), name
                continue
            # snapshot cleanup drops expired entries the model still holds, never a live one; restored entries it
            # filters out as they are read may leave their key listed
            assert self.model.live_keys(name) <= found, name
            assert found <= self.model.written[name], name

    @rule()
    def snapshot_and_go_on(self):
        self.checkpoint_id += 1
        self.job.checkpoint(self.storage, self.checkpoint_id)

    @rule(data=st.data())
    def snapshot_restore_rescale(self, data):
        self.checkpoint_id += 1
        old = self.job
        md = old.checkpoint(self.storage, self.checkpoint_id)
        old.dispose()
        maxp = data.draw(st.sampled_from([old.maxp, old.maxp, 64, 128, 256]), label="max parallelism")
        p = data.draw(self.PARALLELISM, label="p'")
        self.job = Job(self.KIND, maxp, p, self.cfg, self.model.watermark, self.storage, md)
        self.stored_keys_between_live_and_written()

    @rule()
    def read_everything(self):
        for k in range(NKEYS):
            s = self.job.at(k)
            m = self.model
            assert (s["value"].value(), s["list"].get(), dict(s["map"].items()), s["reducing"].get()) == (
                m.read_single("value", k), m.read_list(k), m.read_map(k), m.read_single("reducing", k)), k


class RocksDBEventTimeTtlModel(EventTimeTtlModel):
    KIND = "rocksdb"
    PARALLELISM = st.integers(1, 3)


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
EventTimeTtlModel.TestCase.settings = settings(max_examples=25, stateful_step_count=25, **_SETTINGS)
RocksDBEventTimeTtlModel.TestCase.settings = settings(max_examples=8, stateful_step_count=20, **_SETTINGS)
test_heap_event_time_ttl_model = EventTimeTtlModel.TestCase
test_rocksdb_event_time_ttl_model = RocksDBEventTimeTtlModel.TestCase


# ---- clocks ------------------------------------------------------------------------------------------------------
class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(kind, **kw):
    return BACKENDS[kind](KeyGroupRange(0, 127), 128, Int64Serializer(), **kw)


def test_each_state_expires_by_its_own_clock(kind):
    clock = FakeClock()
    b = make(kind, clock=clock)
    by_event = ValueStateDescriptor("event", Int64Serializer())
    by_event.enable_time_to_live(event_ttl(10_000))
    by_processing = ValueStateDescriptor("processing", Int64Serializer())
    by_processing.enable_time_to_live(StateTtlConfig.new_builder(10).build())
    e, p = b.get_state(by_event), b.get_state(by_processing)
    b.watermark = 50_000
    b.set_current_key(1)
    e.update(1)
    p.update(2)
    clock.t += 3600   # processing time passes, event time does not
    assert (e.value(), p.value()) == (1, None)
    b.set_current_key(2)
    e.update(3)
    p.update(4)
    b.watermark += 10_000   # event time passes, processing time does not
    assert (e.value(), p.value()) == (None, 4)
    b.dispose()


def test_without_a_watermark_nothing_expires_and_the_clock_starts_at_the_first_access(kind):
    b = make(kind)
    s = b.get_state(descriptors(event_ttl())["value"])
    b.set_current_key(1)
    s.update(7)
    b.set_current_key(2)
    s.update(8)
    assert b.watermark == NO_WATERMARK and s.value() == 8   # no watermark: nothing expires
    b.watermark = 5_000   # the first watermark: neither entry is expired yet (it would be if stamped NO_WATERMARK)
    b.set_current_key(1)
    assert s.value() == 7   # key 1's clock starts here, at 5 000
    b.watermark = 5_000 + TTL_MS - 1
    assert s.value() == 7
    b.set_current_key(2)
    assert s.value() == 8   # key 2's clock starts only now
    b.watermark = 5_000 + TTL_MS
    b.set_current_key(1)
    assert s.value() is None
    b.set_current_key(2)
    assert s.value() == 8
    b.dispose()


def test_snapshot_cleanup_measures_event_time_state_in_event_time(kind, tmp_path):
    storage = CheckpointStorage(tmp_path)
    clock = FakeClock()
    ds = descriptors(event_ttl(cleanup=True))
    b = make(kind, clock=clock)
    s = {n: b.get_state(d) for n, d in ds.items()}
    b.set_current_key(0)
    s["value"].update(0)   # before any watermark: never dropped by cleanup
    b.watermark = 1_000
    for k in range(1, 6):
        b.set_current_key(k)
        s["value"].update(k)
        s["list"].add(k)
    b.watermark = 1_005
    for k in range(3, 6):
        b.set_current_key(k)
        s["value"].update(k)
        s["list"].add(-k)
    b.watermark = 1_000 + TTL_MS   # the writes at 1 000 expired, those at 1 005 live
    clock.t += 10 ** 6   # processing time is irrelevant to these states
    md = commit(storage, [b.snapshot(1, storage).result(30)], 1, 1, 128)
    b.dispose()
    new = make(kind, clock=clock)
    new.restore(storage, md)
    new.watermark = 1_000 + TTL_MS
    ns = {n: new.get_state(d) for n, d in ds.items()}
    assert sorted(new.keys("value")) == [0, 3, 4, 5]
    assert sorted(new.keys("list")) == [3, 4, 5]
    new.set_current_key(4)
    assert ns["list"].get() == [-4]
    new.dispose()


def test_the_config_names_its_clock_and_stores_it():
    cfg = event_ttl(1500, on_read=True)
    assert cfg.time_characteristic is StateTtlConfig.TtlTimeCharacteristic.EventTime and cfg.event_time
    assert cfg.to_json()["time_characteristic"] == "EventTime"
    default = StateTtlConfig.new_builder(1).build()
    # processing time is what a meta without the field means: the metas of such states stay as they were
    assert not default.event_time and "time_characteristic" not in default.to_json()
    with pytest.raises(TypeError, match="ProcessingTime or .EventTime"):
        StateTtlConfig.new_builder(1).set_ttl_time_characteristic("EventTime")
    with pytest.raises(TypeError, match="time_characteristic"):
        StateTtlConfig(1000, time_characteristic="EventTime")


def _snapshot_one_value(kind, storage, cfg):
    b = make(kind)
    d = ValueStateDescriptor("v", Int64Serializer())
    d.enable_time_to_live(cfg)
    b.watermark = 100
    s = b.get_state(d)
    b.set_current_key(1)
    s.update(1)
    md = commit(storage, [b.snapshot(1, storage).result(30)], 1, 1, 128)
    b.dispose()
    return md


@pytest.mark.parametrize("before,after", [("ProcessingTime", "EventTime"), ("EventTime", "ProcessingTime")])
def test_restore_refuses_a_changed_time_characteristic(kind, tmp_path, before, after):
    storage = CheckpointStorage(tmp_path)
    cfg = StateTtlConfig.new_builder(60).set_ttl_time_characteristic(TtlTimeCharacteristic(before)).build()
    md = _snapshot_one_value(kind, storage, cfg)
    new = make(kind)
    new.restore(storage, md)
    d = ValueStateDescriptor("v", Int64Serializer())
    d.enable_time_to_live(StateTtlConfig.new_builder(60).set_ttl_time_characteristic(TtlTimeCharacteristic(after))
                          .build())
    with pytest.raises(StateMigrationError,
                       match=f"'v' was snapshotted with {before} TTL.*{after}.*TtlTimeCharacteristic.{before}"):
        new.get_state(d)
    # the duration, update type and visibility may change, as before
    same = ValueStateDescriptor("v", Int64Serializer())
    same.enable_time_to_live(StateTtlConfig.new_builder(120).set_ttl_time_characteristic(TtlTimeCharacteristic(before))
                             .update_ttl_on_read_and_write().return_expired_if_not_cleaned_up().build())
    new.watermark = 100
    s = new.get_state(same)
    new.set_current_key(1)
    assert s.value() == 1
    new.dispose()


def test_a_meta_without_a_time_characteristic_is_processing_time(kind, tmp_path):
    storage = CheckpointStorage(tmp_path)
    md = _snapshot_one_value(kind, storage, StateTtlConfig.new_builder(60).build())
    assert all("time_characteristic" not in meta["ttl"] for h in md.keyed_handles for meta in h.states)
    new = make(kind)
    new.restore(storage, md)
    d = ValueStateDescriptor("v", Int64Serializer())
    d.enable_time_to_live(event_ttl(60_000))
    with pytest.raises(StateMigrationError, match="ProcessingTime TTL"):
        new.get_state(d)
    new.dispose()


# ---- through the runtime ---------------------------------------------------------------------------------------
class LastSeen(KeyedProcessFunction):
    """Per record: whether the key's last value is still held by an event-time TTL state (10 s of event time) and
    by a processing-time one (an hour), then stores the record's value in both."""

    def open(self, ctx):
        by_event = ValueStateDescriptor("by-event-time", Int64Serializer())
        by_event.enable_time_to_live(StateTtlConfig.new_builder(10).set_ttl_time_characteristic(EVENT_TIME).build())
        by_processing = ValueStateDescriptor("by-processing-time", Int64Serializer())
        by_processing.enable_time_to_live(StateTtlConfig.new_builder(3600).build())
        self.event = ctx.get_state(by_event)
        self.processing = ctx.get_state(by_processing)

    def process_element(self, record, ctx):
        yield {"k": record["k"], "event": self.event.value(), "processing": self.processing.value()}
        self.event.update(record["v"])
        self.processing.update(record["v"])


OUT = pa.schema([("k", pa.int64()), ("event", pa.int64()), ("processing", pa.int64())])


def _batch(location, parallelism, keys, t, v, watermark):
    """One batch of LastSeen over one record per key (event time ``t`` ms, value ``v``) at ``parallelism``; the
    batch's watermark is ``watermark``. Its output rows, sorted."""
    table = pa.table({"k": pa.array(keys, pa.int64()), "t": pa.array([t] * len(keys), pa.int64()),
                      "v": pa.array([v] * len(keys), pa.int64())})
    plan = begin_batch(CheckpointStorage(location), job_name="ttl", max_parallelism=16, parallelism=parallelism)
    spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(LastSeen()), input_schema=table.schema,
                           output_schema=OUT, timestamp_column="t", watermark=watermark)
    owners = kg.operator_index_for_key_group(16, parallelism, kg.assign_key_groups(table.column("k"), 16, spec.key_type))
    reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches())
               for i in range(parallelism)]
    metadata = commit_batch(plan, reports, watermark=watermark)
    assert metadata.properties["watermark"] == watermark
    storage = CheckpointStorage(location)
    out = pa.concat_tables(read_parquet(storage.read_bytes(f)) for f in metadata.outputs)
    return sorted(zip(*[c.to_pylist() for c in out.columns]))


def test_a_value_expires_when_the_watermark_passes_it_across_rescales(tmp_path):
    location = str(tmp_path / "chk")
    keys = list(range(10))
    # batch 1, parallelism 2: written before the job has a watermark; the batch ends at watermark 100 s
    assert _batch(location, 2, keys, 100_000, 1, 100_000) == [(k, None, None) for k in keys]
    # batch 2, parallelism 4: all still there (their clock starts now, at 100 s); rewritten at watermark 100 s
    assert _batch(location, 4, keys, 101_000, 2, 105_000) == [(k, 1, 1) for k in keys]
    # batch 3, parallelism 1: keys 0-4 rewritten at watermark 105 s (100 s + 10 s > 105 s: alive)
    assert _batch(location, 1, keys[:5], 106_000, 3, 110_000) == [(k, 2, 2) for k in keys[:5]]
    # batch 4, parallelism 3, starting at watermark 110 s: keys 5-9 (written at 100 s) expired in event time;
    # keys 0-4 (written at 105 s) live; the processing-time state (an hour) holds every key
    assert _batch(location, 3, keys, 111_000, 4, 111_000) == (
        [(k, 3, 3) for k in keys[:5]] + [(k, None, 2) for k in keys[5:]])
