"""A warm heap backend resumed from a checkpoint holds exactly what a cold restore of that checkpoint holds, and
writes the same next snapshot, byte for byte, whichever way it resumed: from its own last checkpoint without
planning its chains again (``HeapKeyedStateBackend._resume_own``), catching up on blocks another process committed,
moved to another range (rescale), or refused (a failed attempt's snapshot, an older checkpoint, a savepoint).

A hypothesis model over two worker processes, each keeping the backends its batches ended with: random writes on
six states (the five kinds and a TTL value, with a clock) go to the warm backend and to a shadow restored cold from
the same checkpoint; at the batch's end both snapshot with the same file id and must write the same bytes and
handle. Chains are at most three blocks long, so key groups materialize (the chains compact) every few batches."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from keygroups import assign_to_operator, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.checkpoint import format as format_module
from keygroups.errors import CheckpointNotFoundError
from keygroups.serializers import Int64Serializer
from keygroups.state import HeapKeyedStateBackend, ValueStateDescriptor
from keygroups.state import heap as heap_module
from test_rocksdb_catch_up import TTL, descriptors
from test_rocksdb_incremental import write_five

KEYS = 40


def visible(backend, states, k):
    """What key ``k``'s six states show."""
    backend.set_current_key(k)
    return (states["value"].value(), states["list"].get(), dict(states["map"].items()), states["reducing"].get(),
            states["aggregating"].get(), states["ttl"].value())


class _Live:
    """A subtask's backend for the running batch, and its shadow: a backend restored cold from the same point."""

    def __init__(self, backend, shadow):
        self.backend, self.shadow = backend, shadow
        self.states = {n: backend.get_state(d) for n, d in descriptors().items()}
        self.shadow_states = {n: shadow.get_state(d) for n, d in descriptors().items()}


class WarmMaxpModel(RuleBasedStateMachine):
    MAXP = 128

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory(prefix="kg-heap-warm-")
        self.storage = CheckpointStorage(os.path.join(self.tmp.name, "chk"))
        self.now = 1000.0
        self.model = {n: {} for n in descriptors()}   # ttl: key -> (value, written at)
        self.models: dict[int, dict] = {}             # checkpoint id -> the model it holds
        self.checkpoint_id = 0
        self.savepoints = 0
        self.point = None                             # the batch's restore point
        self.procs = [{}, {}]                         # per worker process: range -> the backend it kept
        self.proc = 0
        self.p = 2
        self.live = self.open(None)

    # ---- backends ---------------------------------------------------------------------------------------------
    def backend(self, r, i):
        return HeapKeyedStateBackend(r, self.MAXP, Int64Serializer(), subtask_index=i, max_chain=3,
                                     clock=lambda: self.now, compact_full_groups=True)

    def take(self, r):
        """The kept backend of this process the runtime would try first: of range ``r``, else the largest overlap."""
        kept = self.procs[self.proc]
        if r in kept:
            return kept.pop(r)
        best = max(kept, key=lambda o: min(o.end, r.end) - max(o.start, r.start), default=None)
        if best is not None and min(best.end, r.end) >= max(best.start, r.start):
            return kept.pop(best)
        return None

    def open(self, point):
        out = []
        for i in range(self.p):
            r = key_group_range(self.MAXP, self.p, i)
            shadow = self.backend(r, i)
            if point is not None:
                shadow.restore(self.storage, point)
            warm = self.take(r) if point is not None else None
            backend = None
            if warm is not None and warm.resume(self.storage, point, r) is not None:
                warm.subtask_index = i
                backend = warm
                RESUMES["warm"] += 1
            if backend is None:
                backend = self.backend(r, i)
                if point is not None:
                    backend.restore(self.storage, point)
            live = _Live(backend, shadow)
            if backend is warm:   # every key a cold restore shows, the warm one shows alike
                keys = set()
                for name in descriptors():
                    keys.update(shadow.keys(name))
                    keys.update(backend.keys(name))
                for k in sorted(keys):
                    assert visible(backend, live.states, k) == visible(shadow, live.shadow_states, k), k
            out.append(live)
        return out

    def at(self, k):
        return self.live[assign_to_operator(k, self.MAXP, self.p)]

    # ---- rules ------------------------------------------------------------------------------------------------
    @rule(k=st.integers(0, KEYS - 1), v=st.integers(-5, 5),
          op=st.sampled_from(["value", "list", "map", "reducing", "aggregating", "remove", "ttl"]))
    def write(self, k, v, op):
        live = self.at(k)
        scratch = {n: {} for n in descriptors()}
        for backend, states, model in ((live.backend, live.states, self.model),
                                       (live.shadow, live.shadow_states, scratch)):
            backend.set_current_key(k)
            if op == "ttl":
                states["ttl"].update(v)
                model["ttl"][k] = (v, self.now)
            else:
                write_five(states, model, k, v, op)

    @rule(k=st.integers(0, KEYS - 1), name=st.sampled_from(sorted(descriptors())))
    def clear(self, k, name):
        live = self.at(k)
        for backend, states in ((live.backend, live.states), (live.shadow, live.shadow_states)):
            backend.set_current_key(k)
            states[name].clear()
        self.model[name].pop(k, None)

    @rule(seconds=st.sampled_from([1, 4, 30]))
    def tick(self, seconds):
        self.now += seconds

    @rule(fate=st.sampled_from(["commit", "commit", "commit", "fail"]), proc=st.sampled_from([0, 0, 1]),
          p=st.sampled_from([2, 2, 2, 3]), point=st.sampled_from(["latest"] * 5 + ["older", "savepoint"]),
          back=st.integers(1, 3))
    def batch_ends(self, fate, proc, p, point, back):
        """The batch snapshots (warm and shadow alike, byte for byte), commits or fails (its snapshot written, never
        committed: the next attempt takes the id), and its backends stay in their process; the next batch runs in
        process ``proc`` at parallelism ``p`` from ``point``."""
        cid = self.checkpoint_id + 1
        handles = []
        for live in self.live:
            file_id = os.urandom(16)
            original = format_module.new_file_id
            format_module.new_file_id = lambda: file_id
            try:
                h = live.backend.snapshot(cid, self.storage).result(30)
                s = live.shadow.snapshot(cid, self.storage).result(30)
            finally:
                format_module.new_file_id = original
            assert self.storage.read_bytes(h.file) == self.storage.read_bytes(s.file)
            assert dict(h.to_json(), file=None) == dict(s.to_json(), file=None)
            handles.append(h)
        if fate == "commit":
            self.checkpoint_id = cid
            self.storage.commit(CheckpointMetadata(
                checkpoint_id=cid, job_id="warm-maxp", timestamp_ms=0, max_parallelism=self.MAXP, parallelism=self.p,
                keyed_handles=carry_forward(self.point, handles) if self.point is not None else handles,
                operator_handles=[], properties={}))
            self.models[cid] = copy.deepcopy(self.model)
        for live in self.live:
            self.procs[self.proc][live.backend.key_group_range] = live.backend
        restore = self.storage.latest()
        if restore is not None and point == "older":
            try:
                restore = self.storage.load(max(1, restore.checkpoint_id - back))
            except CheckpointNotFoundError:
                pass
        elif restore is not None and point == "savepoint":
            self.savepoints += 1
            name = f"sp-{self.savepoints}"
            self.storage.savepoint(restore.checkpoint_id, name)
            restore = self.storage.load_savepoint(name)
        self.point = restore
        self.model = copy.deepcopy(self.models[restore.checkpoint_id]) if restore is not None else {
            n: {} for n in descriptors()}
        self.proc, self.p = proc, p
        self.live = self.open(restore)

    @invariant()
    def matches(self):
        m = self.model
        for k in range(KEYS):
            live = self.at(k)
            ttl = m["ttl"].get(k)
            shown = visible(live.backend, live.states, k)
            assert shown == (m["value"].get(k), m["list"].get(k, []), m["map"].get(k, {}), m["reducing"].get(k),
                             m["aggregating"].get(k), ttl[0] if ttl and self.now - ttl[1] < TTL else None), k
            # the shadow reads alike (a read of an expired TTL value cleans it up: both must see the same reads)
            assert visible(live.shadow, live.shadow_states, k) == shown, k

    def teardown(self):
        self.tmp.cleanup()


class WarmMaxp4096Model(WarmMaxpModel):
    MAXP = 4096


#: resumes counted over a test's examples: the model must exercise the warm paths, not only fall back to cold
#: restores (the examples are derandomized, so that this holds on every run, not on most)
RESUMES = {"warm": 0}
_SETTINGS = settings(max_examples=12, stateful_step_count=30, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture
def own_resumes(monkeypatch):
    """Counts the resumes from a backend's own last checkpoint that took the chains it kept (no planning)."""
    counted = {"own": 0}
    resume_own = heap_module.HeapKeyedStateBackend._resume_own

    def counting(self, *args):
        out = resume_own(self, *args)
        counted["own"] += out is not None
        return out
    monkeypatch.setattr(heap_module.HeapKeyedStateBackend, "_resume_own", counting)
    RESUMES["warm"] = 0
    return counted


@pytest.mark.slow
def test_warm_resume_equals_a_cold_restore_max_p_128(own_resumes):
    run_state_machine_as_test(WarmMaxpModel, settings=_SETTINGS)
    assert own_resumes["own"] > 0 and RESUMES["warm"] > own_resumes["own"]   # other warm paths ran too


@pytest.mark.slow
def test_warm_resume_equals_a_cold_restore_max_p_4096(own_resumes):
    run_state_machine_as_test(WarmMaxp4096Model, settings=settings(_SETTINGS, max_examples=6))
    assert own_resumes["own"] > 0


# ---- what the resume from its own checkpoint must not take as it is -----------------------------------------------
def _batches(tmp_path, n):
    """A backend (p=1) through ``n`` committed checkpoints, each changing key 3 (the first also keys 0-4999), and the
    storage; the backend kept warm after the last."""
    storage = CheckpointStorage(str(tmp_path / "chk"))
    r = key_group_range(128, 1, 0)
    b = HeapKeyedStateBackend(r, 128, Int64Serializer(), max_chain=10)
    previous = None
    for cid in range(1, n + 1):
        if previous is not None:
            assert b.resume(storage, previous) is not None
        s = b.get_state(ValueStateDescriptor("value", Int64Serializer()))
        for k in range(5000) if cid == 1 else [3]:
            b.set_current_key(k)
            s.update(k * 100 + cid)
        h = b.snapshot(cid, storage).result(30)
        storage.commit(CheckpointMetadata(
            checkpoint_id=cid, job_id="own", timestamp_ms=0, max_parallelism=128, parallelism=1,
            keyed_handles=carry_forward(previous, [h]) if previous is not None else [h], operator_handles=[],
            properties={}))
        previous = storage.load(cid)
    return storage, b, previous


def test_its_own_checkpoint_that_lost_a_chain_file_is_refused_as_a_restore_refuses_it(tmp_path):
    """The checkpoint names the backend's own snapshot, but the delta before it is gone from key 3's chain: a
    restore refuses the broken chain, and so must the resume (not take the chains it keeps as they are)."""
    from keygroups.errors import CorruptSnapshotError

    storage, b, latest = _batches(tmp_path, 3)
    files = [h.file for h in sorted(latest.keyed_handles, key=lambda h: h.checkpoint_id)]
    assert len(files) == 3   # the full block, then key 3's two deltas
    broken = CheckpointMetadata(
        checkpoint_id=3, job_id="own", timestamp_ms=0, max_parallelism=128, parallelism=1,
        keyed_handles=[h for h in latest.keyed_handles if h.file != files[1]], operator_handles=[], properties={})
    with pytest.raises(CorruptSnapshotError):
        HeapKeyedStateBackend(b.key_group_range, 128, Int64Serializer()).restore(storage, broken)
    with pytest.raises(CorruptSnapshotError):
        b.resume(storage, broken)


def test_its_own_checkpoint_resumes_without_planning_and_reads_nothing(tmp_path, own_resumes):
    storage, b, latest = _batches(tmp_path, 4)
    assert own_resumes["own"] == 3
    stats = b.resume(storage, latest)
    assert own_resumes["own"] == 4 and stats.bytes_read == 0 and stats.warm == tuple(b.key_group_range)
    s = b.get_state(ValueStateDescriptor("value", Int64Serializer()))
    b.set_current_key(3)
    assert s.value() == 304


def test_same_handle_compares_every_block_or_as_a_checkpoint_carries_it(tmp_path):
    """A handle read back equals the one written; a changed checksum or predecessor of a block that changed makes
    them differ either way; one of a quiet block only when compared in full (a carried handle leaves it out)."""
    import dataclasses

    import numpy as np

    from keygroups.checkpoint.metadata import BlockLinks, same_handle

    storage, b, latest = _batches(tmp_path, 2)
    delta = max(latest.keyed_handles, key=lambda h: h.checkpoint_id)
    r = delta.key_group_range
    _, changed = delta.changed_key_groups()
    quiet = next(kg for kg in r if kg not in changed)
    copy_of = dataclasses.replace(delta)
    assert copy_of is not delta and same_handle(delta, copy_of) and same_handle(delta, copy_of, carried=True)

    def with_link(kg, checksum):
        links = BlockLinks.of(delta.predecessors, r)
        checksums = links.checksums.copy()
        checkpoints = links.checkpoints.copy()
        checkpoints[kg - r.start], checksums[kg - r.start] = 1, checksum
        return dataclasses.replace(delta, predecessors=BlockLinks(r.start, checkpoints, checksums))

    assert not same_handle(delta, with_link(changed[0], 12345)) and not same_handle(
        delta, with_link(changed[0], 12345), carried=True)
    assert not same_handle(delta, with_link(quiet, 12345)) and same_handle(delta, with_link(quiet, 12345),
                                                                           carried=True)
    checksums = np.asarray(delta.checksums).copy()
    checksums[changed[0] - r.start] ^= 1
    assert not same_handle(delta, dataclasses.replace(delta, checksums=checksums.tolist()), carried=True)
    assert not same_handle(delta, dataclasses.replace(delta, subtask=1))


def test_estimated_entries_compiled_as_defined(tmp_path):
    """``heapsnap.estimated_entries`` is the sum over key groups of the most entries their dict or one of their
    layers holds, on a backend with restored layers, decoded entries and deletes."""
    from keygroups._native import heapsnap

    storage, b, latest = _batches(tmp_path, 3)
    s = b.get_state(ValueStateDescriptor("value", Int64Serializer()))
    for k in (3, 7, 11, 5001, 5002):
        b.set_current_key(k)
        s.update(1) if k != 11 else s.clear()
    t = b._tables["value"]
    n = b._n
    python = sum(max([len(t.maps[i]), *(layer.n_puts for layer in t.layers[i] or ())]) for i in range(n))
    assert heapsnap.estimated_entries(t.maps, t.layers, n) == python == b.estimated_entries() > 4000
    with pytest.raises(ValueError, match="n must be in"):
        heapsnap.estimated_entries(t.maps, t.layers, n + 5)


def test_a_backend_that_snapshots_without_resuming_keeps_no_growing_list_of_files(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    b = HeapKeyedStateBackend(key_group_range(128, 1, 0), 128, Int64Serializer(), max_chain=2)
    s = b.get_state(ValueStateDescriptor("value", Int64Serializer()))
    for cid in range(1, 41):
        for k in range(cid % 5, 400, 7):
            b.set_current_key(k)
            s.update(cid)
        b.snapshot(cid, storage).result(30)
    # the files its chains hold (bounded by the materialization policy) and the last one written: not all 40
    assert set(b._file_uses) <= set(b._known_handles) and len(b._known_handles) <= len(b._file_uses) + 1 <= 20
