"""A kept RocksDB database sealed at an earlier checkpoint of the same lineage catches up: the batches between ran
elsewhere (another host's warm directory, a second attempt in a temporary one), and the backend that finds it applies
only the blocks committed since (``RocksDBKeyedStateBackend._catch_up``), never taking it as it is. A failed or
uncommitted attempt, a process that dies between any two steps (a catch-up included) and TTL values that expired
in between leave the state equal to the model."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from keygroups import assign_to_operator, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.serializers import Int64Serializer
from keygroups.state import MapStateDescriptor, RocksDBKeyedStateBackend, StateTtlConfig, ValueStateDescriptor
from keygroups.state import rocksdb as rocksdb_module
from keygroups.state.warm import WarmResume
from test_rocksdb_incremental import five, write_five

MAXP = 128
TTL = 10   # seconds; an entry written at t reads as absent once now - t >= TTL


def descriptors():
    d = five()
    ttl = ValueStateDescriptor("ttl", Int64Serializer())
    ttl.enable_time_to_live(StateTtlConfig.new_builder(TTL).build())
    d["ttl"] = ttl
    return d


def end_model(model):
    """A model run's teardown: its live backends disposed, the process's kept values forgotten, the catch-up limit
    and the temporary directory put back."""
    for b, _ in model.backends:
        if b._finalizer.alive:
            b.dispose()
    rocksdb_module._KEPT_CACHES.clear()
    rocksdb_module.CATCH_UP_DELTA_FRACTION = model.fraction
    model.tmp.cleanup()


def assert_five_match(model, keys: int) -> None:
    """A model's invariant: the five states of keys ``0 .. keys - 1`` read what its dict model holds (a TTL value
    only until it expires)."""
    m = model.model
    for k in range(keys):
        s = model.at(k)
        ttl = m["ttl"].get(k)
        got = (s["value"].value(), s["list"].get(), s["reducing"].get(), s["aggregating"].get(), s["ttl"].value())
        assert got == (m["value"].get(k), m["list"].get(k, []), m["reducing"].get(k), m["aggregating"].get(k),
                       ttl[0] if ttl and model.now - ttl[1] < TTL else None), k


def write_value_like(model, k, v, op) -> None:
    """A model's write of ``v`` to key ``k``'s state ``op`` (a TTL value stamped with the model's clock), on the
    backend and in its dict model alike."""
    if op == "ttl":
        model.at(k)["ttl"].update(v)
        model.model["ttl"][k] = (v, model.now)
    else:
        write_five(model.at(k), model.model, k, v, op)


def abandon(backends):
    """The process dies: nothing flushed, closed, sealed or kept (its locks go with it)."""
    for b, _ in backends:
        b._finalizer.detach()
        if b._db_box[0] is not None:   # one never opened (lazy open) stays exactly as sealed
            b._db_box[0].close()
        if b._warm is not None:
            b._warm.lock_file.close()
    rocksdb_module._KEPT_CACHES.clear()


class CatchUpModel(RuleBasedStateMachine):
    """Random writes on six states (the five kinds and a TTL value) against dicts; each batch runs on one of two
    hosts (warm directories), so a host's database falls behind while the other runs batches and catches up when
    the subtask comes back. A batch's checkpoint commits, or fails (its snapshot written, never committed, the id
    used again), or its process dies before the snapshot, after it, after the commit, or in the middle of the next
    catch-up."""

    @staticmethod
    def states():
        return descriptors()

    def __init__(self):
        super().__init__()
        # every catch-up the lineage allows, however large its deltas against these small states
        self.fraction, rocksdb_module.CATCH_UP_DELTA_FRACTION = rocksdb_module.CATCH_UP_DELTA_FRACTION, float("inf")
        self.tmp = tempfile.TemporaryDirectory(prefix="kg-catch-up-")
        self.storage = CheckpointStorage(os.path.join(self.tmp.name, "chk"))
        self.hosts = [os.path.join(self.tmp.name, "host-a"), os.path.join(self.tmp.name, "host-b")]
        self.host = 0
        self.now = 1000.0
        self.model = {n: {} for n in self.states()}   # ttl: key -> (value, written at)
        self.committed = copy.deepcopy(self.model)
        self.checkpoint_id = 0
        self.p = 2
        self.caught_up = 0
        self.backends = self.open(None)

    def open(self, metadata, fail_after=None):
        out = self.opening = []   # what a process that dies while opening leaves behind
        for i in range(self.p):
            b = RocksDBKeyedStateBackend(key_group_range(MAXP, self.p, i), MAXP, Int64Serializer(), subtask_index=i,
                                         max_chain=3, warm_dir=self.hosts[self.host], cache_limit=6,
                                         clock=lambda: self.now)
            out.append((b, None))
            if metadata is not None:
                if fail_after is not None:
                    self.fail_catch_up(b, fail_after)
                stats = b.restore(self.storage, metadata)
                if isinstance(stats, WarmResume) and stats.caught_up:
                    self.caught_up += 1
            out[-1] = (b, {n: b.get_state(d) for n, d in self.states().items()})
        return out

    @staticmethod
    def fail_catch_up(b, after):
        """Make ``b``'s catch-up die after ``after`` blocks applied row by row or files ingested (the process dies
        there)."""
        applied = [0]

        def dying(apply):
            def step(*args):
                if b._catching_up:
                    if applied[0] >= after:
                        raise SystemExit("the process dies in the middle of a catch-up")
                    applied[0] += 1
                apply(*args)
            return step
        b._apply_block = dying(b._apply_block)
        b._ingest_gathered = dying(b._ingest_gathered)

    def at(self, k):
        b, s = self.backends[assign_to_operator(k, MAXP, self.p)]
        b.set_current_key(k)
        return s

    @rule(k=st.integers(0, 30), v=st.integers(-5, 5),
          op=st.sampled_from(["value", "list", "map", "reducing", "aggregating", "remove", "ttl"]))
    def write(self, k, v, op):
        if op in ("map", "remove") and "map" not in self.model:
            op = "value"
        write_value_like(self, k, v, op)

    @rule(k=st.integers(0, 30), name=st.sampled_from(sorted(descriptors())))
    def clear(self, k, name):
        if name in self.model:
            self.at(k)[name].clear()
            self.model[name].pop(k, None)

    @rule(seconds=st.sampled_from([1, 4, 30]))
    def tick(self, seconds):
        self.now += seconds

    @rule(host=st.sampled_from([0, 1]),
          fate=st.sampled_from(["commit", "commit", "commit", "fail", "die before the snapshot",
                                "die after the snapshot", "die after the commit", "die in the next catch-up"]),
          blocks=st.integers(0, 3))
    def batch_ends(self, host, fate, blocks):
        """The batch ends (as ``fate`` says); the next one runs on ``host``."""
        if fate == "die before the snapshot":
            abandon(self.backends)
        else:
            handles = [b.snapshot(self.checkpoint_id + 1, self.storage).result(30) for b, _ in self.backends]
            if fate in ("commit", "die after the commit", "die in the next catch-up"):
                self.checkpoint_id += 1
                previous = self.storage.latest()
                self.storage.commit(CheckpointMetadata(
                    checkpoint_id=self.checkpoint_id, job_id="catch-up", timestamp_ms=0, max_parallelism=MAXP,
                    parallelism=self.p, keyed_handles=carry_forward(previous, handles), operator_handles=[],
                    properties={}))
                self.committed = copy.deepcopy(self.model)
            if fate in ("die after the snapshot", "die after the commit"):
                abandon(self.backends)
            else:
                for b, _ in self.backends:
                    b.dispose()
        self.model = copy.deepcopy(self.committed)
        self.host = host
        latest = self.storage.latest()
        if fate == "die in the next catch-up" and latest is not None:
            try:
                self.open(latest, fail_after=blocks)
            except SystemExit:
                pass
            abandon(self.opening)   # it died in (or just after) a catch-up: its process took everything with it
        self.backends = self.open(latest)

    @invariant()
    def matches(self):
        for k in range(31):
            s = self.at(k)
            m = self.model
            ttl = m["ttl"].get(k)
            got = (s["value"].value(), s["list"].get(), s["reducing"].get(), s["aggregating"].get(), s["ttl"].value())
            assert got == (m["value"].get(k), m["list"].get(k, []), m["reducing"].get(k), m["aggregating"].get(k),
                           ttl[0] if ttl and self.now - ttl[1] < TTL else None), k
            if "map" in s:
                assert dict(s["map"].items()) == m["map"].get(k, {}), k

    def teardown(self):
        end_model(self)


CatchUpModel.TestCase.settings = settings(max_examples=10, stateful_step_count=25, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_rocksdb_catch_up_model = CatchUpModel.TestCase


class ValueStatesCatchUpModel(CatchUpModel):
    """The same, without the map state: every delta block a catch-up applies is written as one ingested file of
    puts and tombstones (a map state's entries send a block down the row path)."""

    @staticmethod
    def states():
        return {n: d for n, d in descriptors().items() if n != "map"}

    @rule(host=st.sampled_from([0, 1]))
    def commit_and_move(self, host):
        """More batches that commit and move between hosts: a catch-up needs a database left behind."""
        self.batch_ends(host, "commit", 0)


ValueStatesCatchUpModel.TestCase.settings = CatchUpModel.TestCase.settings
test_rocksdb_value_states_catch_up_model = ValueStatesCatchUpModel.TestCase


# ---- through the runtime: a subtask that comes back to a host catches up ------------------------------------------
def test_a_subtask_back_on_a_host_catches_up_its_database_with_the_blocks_committed_elsewhere(tmp_path, monkeypatch):
    from test_rocksdb_incremental import run_counting_batch

    monkeypatch.setattr(rocksdb_module, "CATCH_UP_DELTA_FRACTION", 1.0)

    storage = CheckpointStorage(tmp_path / "chk")
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    keys = list(range(300))
    run_counting_batch(storage, host_a, keys)
    reports, _ = run_counting_batch(storage, host_b, keys[::3])   # host a's databases fall behind
    assert [r.restored.mode for r in reports] == ["cold", "cold"]
    run_counting_batch(storage, host_b, keys[::5])
    reports, counts = run_counting_batch(storage, host_a, keys)
    assert [r.restored.mode for r in reports] == ["caught-up", "caught-up"]
    assert all(r.restored.warm and r.restored.bytes_caught_up == r.restored.bytes_read > 0 for r in reports)
    assert all(r.restored.caught_up_key_groups and not r.restored.restored_key_groups for r in reports)
    assert counts == {k: 2 + (k % 3 == 0) + (k % 5 == 0) for k in keys}
    reports, counts = run_counting_batch(storage, host_a, keys)   # and is warm again
    assert [r.restored.mode for r in reports] == ["warm", "warm"]
    assert counts == {k: 3 + (k % 3 == 0) + (k % 5 == 0) for k in keys}


def _count_state(b):
    return b.get_state(ValueStateDescriptor("n", Int64Serializer()))


def _batch(b, storage, checkpoint_id, keys, plus):
    n = _count_state(b)
    for k in keys:
        b.set_current_key(k)
        n.update((n.value() or 0) + plus)
    handle = b.snapshot(checkpoint_id, storage).result(30)
    previous = storage.latest()
    storage.commit(CheckpointMetadata(
        checkpoint_id=checkpoint_id, job_id="catch-up", timestamp_ms=0, max_parallelism=MAXP, parallelism=1,
        keyed_handles=carry_forward(previous, [handle]) if previous is not None else [handle], operator_handles=[],
        properties={}))
    b.dispose()
    return storage.load(checkpoint_id)


def _backend(warm, **options):
    return RocksDBKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer(), warm_dir=warm, **options)


def _values(b, keys):
    n = _count_state(b)
    out = {}
    for k in keys:
        b.set_current_key(k)
        out[k] = n.value()
    return out


@pytest.mark.parametrize("marker", ["without chains", "a failed attempt"])
def test_a_database_behind_that_cannot_show_its_chains_is_restored_not_caught_up(tmp_path, marker):
    """A marker that names no chains (written before catch-ups existed), or one written
    by an attempt whose checkpoint never committed (another took its id), is restored cold."""
    import json

    from keygroups._local_dirs import directory_secret, seal
    from keygroups.state.rocksdb_warm import _marker_body

    storage = CheckpointStorage(tmp_path / "chk")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    md1 = _batch(_backend(a), storage, 1, range(50), 1)       # host a holds checkpoint 1
    if marker == "without chains":
        path = os.path.join(a, f"0-{MAXP - 1}", "marker.json")
        with open(path) as f:
            body = json.load(f)
        del body["chains"]
        body["mac"] = seal(directory_secret(a), _marker_body(body))   # sealed again: only the chains are missing
        with open(path, "w") as f:
            json.dump(body, f)
    else:   # host a's attempt at checkpoint 2 writes its snapshot, which never commits, and its database
        w = _backend(a, write_back_batches=1)
        w.restore(storage, md1)
        n = _count_state(w)
        for k in range(50):
            w.set_current_key(k)
            n.update(1000)
        w.snapshot(2, storage).result(30)
        w.dispose()
    x = _backend(b)
    x.restore(storage, md1)
    _batch(x, storage, 2, range(0, 50, 2), 10)
    x = _backend(b)
    x.restore(storage, storage.latest())
    md = _batch(x, storage, 3, range(0, 50, 5), 100)
    z = _backend(a)
    stats = z.restore(storage, md)
    assert not isinstance(stats, WarmResume) and not z.warm and stats.bytes_read > 0
    assert _values(z, range(50)) == {k: 1 + 10 * (k % 2 == 0) + 100 * (k % 5 == 0) for k in range(50)}
    z.dispose()


def test_key_groups_a_later_full_block_restarted_are_replaced_by_a_catch_up(tmp_path):
    """A key group whose chain restarted with a full block after the kept database's checkpoint takes that chain
    whole: here every key group (the later checkpoint was written by a backend that restored nothing)."""
    storage = CheckpointStorage(tmp_path / "chk")
    a = str(tmp_path / "a")
    _batch(_backend(a), storage, 1, range(50), 1)
    md = _batch(_backend(str(tmp_path / "b")), storage, 2, range(0, 50, 2), 100)
    z = _backend(a)
    stats = z.restore(storage, md)
    assert isinstance(stats, WarmResume) and z.warm and len(stats.caught_up) == MAXP
    assert _values(z, range(50)) == {k: 100 if k % 2 == 0 else None for k in range(50)}
    z.dispose()


@pytest.mark.parametrize("fraction", [0.125, 1.0])
def test_a_database_far_behind_with_a_map_state_is_restored_cold_not_caught_up_row_by_row(tmp_path, monkeypatch,
                                                                                         fraction):
    """A map state's delta blocks are applied row by row (a put replaces the key's rows): past
    CATCH_UP_DELTA_FRACTION of the chains' bytes that costs more than a compiled cold restore, and the backend
    restores cold; below it, it catches up. The state is the same either way."""
    monkeypatch.setattr(rocksdb_module, "CATCH_UP_DELTA_FRACTION", fraction)
    storage = CheckpointStorage(tmp_path / "chk")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    first = _backend(a)
    _map_state(first)
    md = _batch(first, storage, 1, range(400), 1)
    x = _backend(b)
    x.restore(storage, md)
    _map_state(x)
    md = _batch(x, storage, 2, range(0, 400, 4), 10)   # about a fifth of the chains' bytes
    z = _backend(a)
    stats = z.restore(storage, md)
    assert isinstance(stats, WarmResume) == (fraction == 1.0) == z.warm
    assert _values(z, range(400)) == {k: 1 + 10 * (k % 4 == 0) for k in range(400)}
    z.dispose()


def _map_state(b):
    return b.get_state(MapStateDescriptor("m", Int64Serializer(), Int64Serializer()))


def test_value_states_catch_up_in_one_file_of_puts_and_tombstones_however_far_behind(tmp_path, monkeypatch):
    """Without a map state, the delta blocks a kept database is behind by become one ingested file (each key's
    newest entry: its row, or a tombstone over the kept row): no Python row path, so no fraction limit, even when
    every key changed; deletes remove kept rows, later writes win over earlier ones across checkpoints."""
    monkeypatch.setattr(rocksdb_module, "CATCH_UP_DELTA_FRACTION", 0.0)
    applied = []
    monkeypatch.setattr(RocksDBKeyedStateBackend, "_apply_block",
                        lambda self, *args: applied.append(args))   # the row path would lose these writes
    storage = CheckpointStorage(tmp_path / "chk")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    md = _batch(_backend(a), storage, 1, range(400), 1)
    x = _backend(b)
    x.restore(storage, md)
    md = _batch(x, storage, 2, range(400), 10)             # every key changed
    y = _backend(b)
    y.restore(storage, md)
    assert y.warm
    n = _count_state(y)
    for k in range(0, 400, 3):                              # deleted: tombstones over host a's rows
        y.set_current_key(k)
        n.clear()
    md = _batch(y, storage, 3, range(1, 400, 6), 100)      # some of them written again after
    z = _backend(a)
    stats = z.restore(storage, md)
    assert isinstance(stats, WarmResume) and z.warm and stats.caught_up and not applied
    expected = {k: None if k % 3 == 0 else 11 + 100 * (k % 6 == 1) for k in range(400)}
    assert _values(z, range(400)) == expected   # read from the database: nothing of it was cached
    md = _batch(z, storage, 4, [], 0)
    again = _backend(a)   # the caught-up database, snapshotted, resumes warm with the same values
    again.restore(storage, md)
    assert again.warm and _values(again, range(400)) == expected
    again.dispose()
