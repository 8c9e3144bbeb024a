"""RocksDB write-back: a kept database is written at most every ``write_back_batches`` snapshots; the snapshots in
between leave their keys unwritten in the caches this process parks, and the database's marker at the last
checkpoint written. A hypothesis model (random batches on value-like states, TTL included, against dicts) runs
them with the process's kept values dropped now and then (another process opens the database: it catches up from
its marker), reads in bulk and keys never written (a cache that holds every value of its state answers them
without a read: ``_cache_complete``), rescales (a lagging database taken over by a new range), restores of older
checkpoints, failed attempts and processes dying; and direct tests show what is (not) written and what is adopted."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from keygroups import assign_to_operator, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.serializers import Int64Serializer
from keygroups.state import RocksDBKeyedStateBackend, ValueStateDescriptor
from keygroups.state import rocksdb as rocksdb_module
from keygroups.state.warm import WarmResume
from test_rocksdb_catch_up import abandon, assert_five_match, descriptors, end_model, write_value_like
from test_rocksdb_takeover import run_batch

MAXP = 128


def states():
    return {n: d for n, d in descriptors().items() if n != "map"}


class WriteBackModel(RuleBasedStateMachine):
    """Batches on one or two hosts (warm directories) at parallelism 1-3, each ending committed, failed (its
    snapshot never committed), or with its process dead; between batches the process may lose its kept values (a
    new worker process), the job may restore an older checkpoint, or rescale."""

    def __init__(self):
        super().__init__()
        self.fraction, rocksdb_module.CATCH_UP_DELTA_FRACTION = rocksdb_module.CATCH_UP_DELTA_FRACTION, float("inf")
        rocksdb_module._KEPT_CACHES.clear()
        self.tmp = tempfile.TemporaryDirectory(prefix="kg-write-back-")
        self.storage = CheckpointStorage(os.path.join(self.tmp.name, "chk"))
        self.hosts = [os.path.join(self.tmp.name, "host-a"), os.path.join(self.tmp.name, "host-b")]
        self.host = 0
        self.now = 1000.0
        self.write_back = 3
        self.model = {n: {} for n in states()}   # ttl: key -> (value, written at)
        self.history = {}    # committed checkpoint id -> (model, parallelism)
        self.restored_from = None   # the checkpoint the running batch restored (None: none)
        self.next_id = 1
        self.p = 2
        self.backends = self.open(None)

    def open(self, checkpoint_id):
        metadata = None if checkpoint_id is None else self.storage.load(checkpoint_id)
        out = self.opening = []
        for i in range(self.p):
            b = RocksDBKeyedStateBackend(key_group_range(MAXP, self.p, i), MAXP, Int64Serializer(), subtask_index=i,
                                         max_chain=3, warm_dir=self.hosts[self.host], cache_limit=40,
                                         clock=lambda: self.now, write_back_batches=self.write_back)
            out.append((b, None))
            if metadata is not None:
                stats = b.restore(self.storage, metadata)
                if b.warm and not isinstance(stats, WarmResume):
                    # resumed as it is (with or without kept values): not opened until something reads or writes it
                    assert b._db_opens == 0
            out[-1] = (b, {n: b.get_state(d) for n, d in states().items()})
        self.restored_from = checkpoint_id
        return out

    def at(self, k):
        b, s = self.backends[assign_to_operator(k, MAXP, self.p)]
        b.set_current_key(k)
        return s

    @rule(k=st.integers(0, 40), v=st.integers(-5, 5),
          op=st.sampled_from(["value", "list", "reducing", "aggregating", "ttl"]))
    def write(self, k, v, op):
        write_value_like(self, k, v, op)

    @rule(keys=st.lists(st.integers(0, 45), max_size=20, unique=True))
    def prefetch(self, keys):
        """A batch's read of its keys in bulk (one multi-get per state, or none: a cache that holds every value of
        its state answers a never-seen key itself, ``_cache_complete``); keys 41-45 are never written."""
        for i, (b, _) in enumerate(self.backends):
            b.prefetch([k for k in keys if assign_to_operator(k, MAXP, self.p) == i])
            event(f"caches complete: {sum(b._cache_complete(t) for t in b._tables.values())}")

    @rule(k=st.integers(0, 40), name=st.sampled_from(sorted(states())))
    def clear(self, k, name):
        self.at(k)[name].clear()
        self.model[name].pop(k, None)

    @rule(seconds=st.sampled_from([1, 4, 30]))
    def tick(self, seconds):
        self.now += seconds

    @rule(fate=st.sampled_from(["commit", "commit", "commit", "commit", "fail", "die before the snapshot",
                                "die after the commit"]),
          next_host=st.sampled_from([0, 0, 0, 1]), new_process=st.booleans(), p=st.sampled_from([2, 2, 2, 1, 3]),
          older=st.booleans(), write_back=st.sampled_from([3, 3, 2, 1]))
    def batch_ends(self, fate, next_host, new_process, p, older, write_back):
        """The batch ends as ``fate`` says; the next one runs on ``next_host`` at parallelism ``p`` (a rescale
        when it changes), in a new process (the kept values gone) or not, from the latest committed checkpoint or,
        ``older``, the one before it."""
        if fate == "die before the snapshot":
            abandon(self.backends)
        else:
            checkpoint_id = self.next_id
            self.next_id += 1
            handles = [b.snapshot(checkpoint_id, self.storage).result(30) for b, _ in self.backends]
            if fate != "fail":
                previous = None if self.restored_from is None else self.storage.load(self.restored_from)
                self.storage.commit(CheckpointMetadata(
                    checkpoint_id=checkpoint_id, job_id="write-back", timestamp_ms=0, max_parallelism=MAXP,
                    parallelism=self.p, keyed_handles=carry_forward(previous, handles) if previous else handles,
                    operator_handles=[], properties={}))
                self.history[checkpoint_id] = (copy.deepcopy(self.model), self.p)
            if fate == "die after the commit":
                abandon(self.backends)
            else:
                for b, _ in self.backends:
                    b.dispose()
        if new_process:
            rocksdb_module._KEPT_CACHES.clear()
        committed = sorted(self.history)
        restore = None
        if committed:
            restore = committed[-2] if older and len(committed) > 1 else committed[-1]
        self.model = copy.deepcopy(self.history[restore][0]) if restore is not None else {n: {} for n in states()}
        self.host, self.p, self.write_back = next_host, p, write_back
        self.backends = self.open(restore)

    @invariant()
    def matches(self):
        assert_five_match(self, 46)

    def teardown(self):
        end_model(self)


WriteBackModel.TestCase.settings = settings(max_examples=12, stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
test_rocksdb_write_back_model = WriteBackModel.TestCase


# ---- direct: what is written, what is adopted ------------------------------------------------------------------
COUNT = ValueStateDescriptor("n", Int64Serializer())


def _backend(warm, **options):
    return RocksDBKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer(), warm_dir=warm, **options)


def _batch(storage, warm, restore, checkpoint_id, keys, plus, **options):
    """One batch on a new backend of ``warm``: restored from ``restore`` (a checkpoint id, or None), ``plus`` added
    to each of ``keys``, snapshotted and committed as ``checkpoint_id``; (its restore stats, database writes)."""
    b = _backend(warm, **options)
    stats = b.restore(storage, storage.load(restore)) if restore is not None else None
    n = b.get_state(COUNT)
    for k in keys:
        b.set_current_key(k)
        n.update((n.value() or 0) + plus)
    handle = b.snapshot(checkpoint_id, storage).result(30)
    previous = storage.load(restore) if restore is not None else None
    storage.commit(CheckpointMetadata(
        checkpoint_id=checkpoint_id, job_id="write-back", timestamp_ms=0, max_parallelism=MAXP, parallelism=1,
        keyed_handles=carry_forward(previous, [handle]) if previous else [handle], operator_handles=[],
        properties={}))
    writes = b._writes
    b.dispose()
    return stats, writes


def _values(storage, checkpoint_id, keys, **options):
    b = RocksDBKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer(), **options)
    b.restore(storage, storage.load(checkpoint_id))
    n = b.get_state(COUNT)
    out = {}
    for k in keys:
        b.set_current_key(k)
        out[k] = n.value()
    b.dispose()
    return out


def test_snapshots_between_write_backs_write_nothing_and_the_next_backend_adopts_their_values(tmp_path):
    rocksdb_module._KEPT_CACHES.clear()
    storage, warm = CheckpointStorage(tmp_path / "chk"), str(tmp_path / "warm")
    keys = range(300)
    _, writes = _batch(storage, warm, None, 1, keys, 1, write_back_batches=3)
    assert writes > 0   # the first snapshot writes the database: no marker vouched for it before
    for checkpoint_id in (2, 3):   # deferred: nothing written, the kept values adopted at the next restore
        stats, writes = _batch(storage, warm, checkpoint_id - 1, checkpoint_id, keys, 10, write_back_batches=3)
        assert stats.bytes_read == 0 and writes == 0
    stats, writes = _batch(storage, warm, 3, 4, keys[::2], 100, write_back_batches=3)   # the third: written
    assert stats.bytes_read == 0 and writes > 0
    expected = {k: 21 + 100 * (k % 2 == 0) for k in keys}
    rocksdb_module._KEPT_CACHES.clear()   # another process: the database alone, at checkpoint 4
    stats, writes = _batch(storage, warm, 4, 5, [], 0, write_back_batches=3)
    assert stats.bytes_read == 0 and not isinstance(stats, WarmResume)
    assert _values(storage, 5, keys) == expected


def test_a_lagging_database_without_its_kept_values_catches_up_and_an_older_restore_is_exact(tmp_path):
    rocksdb_module._KEPT_CACHES.clear()
    storage, warm = CheckpointStorage(tmp_path / "chk"), str(tmp_path / "warm")
    keys = range(200)
    _batch(storage, warm, None, 1, keys, 1)
    _batch(storage, warm, 1, 2, keys[::2], 10)      # deferred: the database stays at checkpoint 1
    b = _backend(warm)
    b.get_state(COUNT)
    b.restore(storage, storage.load(2))
    n = b.get_state(COUNT)
    for k in keys[::3]:                              # deferred too, then the process dies: nothing parked
        b.set_current_key(k)
        n.clear()
    b.snapshot(3, storage).result(30)
    rocksdb_module._KEPT_CACHES.clear()
    b.dispose()
    # checkpoint 3 never committed; the job restores checkpoint 2 in a new process: the database (at 1) catches up
    stats, _ = _batch(storage, warm, 2, 4, [], 0)
    assert isinstance(stats, WarmResume) and stats.caught_up
    assert _values(storage, 4, keys) == {k: 1 + 10 * (k % 2 == 0) for k in keys}
    # then an older checkpoint again (1): the database, now at 4, is not reused, and the values are checkpoint 1's
    stats, _ = _batch(storage, warm, 1, 5, [], 0)
    assert stats.bytes_read > 0
    assert _values(storage, 5, keys) == dict.fromkeys(keys, 1)


def test_a_rescale_takes_over_a_lagging_database_with_this_process_s_kept_values(tmp_path):
    """p = 2 -> 1: the new range takes over the database of the old range sharing most of it; that database is
    behind (a deferred snapshot), and this process's kept values of it complete it before the move."""
    rocksdb_module._KEPT_CACHES.clear()
    storage, warm = CheckpointStorage(tmp_path / "chk"), str(tmp_path / "warm")
    keys = list(range(400))

    run_batch(storage, warm, None, 1, 2, 1, keys, COUNT)
    run_batch(storage, warm, 1, 2, 2, 10, keys, COUNT)   # deferred on both ranges
    stats = run_batch(storage, warm, 2, 3, 1, 100, keys, COUNT)
    assert isinstance(stats[0], WarmResume) and stats[0].warm and stats[0].restored
    assert _values(storage, 3, keys) == dict.fromkeys(keys, 111)


# ---- the deferred snapshot's delta: the same sections as cut from a flush's rows ----------------------------------
@settings(max_examples=60, deadline=None)
@given(entries=st.dictionaries(st.integers(-2**40, 2**40), st.tuples(st.integers(0, 7), st.one_of(
    st.none(), st.integers(-2**62, 2**62))), max_size=60),
       full=st.sets(st.integers(10, 17), max_size=3), ttl=st.booleans(), deadline=st.one_of(st.none(), st.integers(0, 4)))
def test_delta_values_encodes_the_sections_delta_sections_cuts_from_the_flush_rows(entries, full, ttl, deadline):
    from keygroups._native import rocksstate, sstload
    from keygroups._native.framing import Encoder
    from keygroups.state._codec import ValueFraming
    from keygroups.state.states import MISSING

    framing = ValueFraming.for_state("n", "value", {"value": Int64Serializer()}, ttl=ttl)
    pending = {k: g for k, (g, _) in entries.items()}
    # TTL values carry their timestamp: the value itself, clipped, so that some are at or before the deadline
    cache = {k: MISSING if v is None else ((v, min(abs(v), 9)) if ttl else v) for k, (_, v) in entries.items()}
    if ttl:
        cache = {k: v if v is MISSING else framing.decode(_ttl_bytes(*v)) for k, v in cache.items()}
    prefixes = [bytes([0, 10 + g]) for g in range(8)]
    args = (pending, cache, Encoder(Int64Serializer()), framing.writer, prefixes, b"\x00\x03")
    rows = rocksstate.flush_values(*args)[:3]
    expected = sstload.delta_sections(*rows, full, ttl, deadline if ttl else None)
    got = rocksstate.delta_values(*args, 10, full, ttl, deadline if ttl else None)
    # the puts byte for byte; the deletes as the keys they name (delta_sections lists expired puts first)
    assert [(g, None if p is None else tuple((b, o.tolist()) for b, o in p), _keys(d)) for g, p, d in got] == [
        (g, None if p is None else tuple((b, o.tolist()) for b, o in p), _keys(d)) for g, p, d in expected]


def _keys(section):
    if section is None:
        return None
    data, offsets = section
    bounds = offsets.tolist()
    return sorted(data[a:b] for a, b in zip(bounds, bounds[1:]))


def _ttl_bytes(value, stamp):
    import struct
    return struct.pack("<q", stamp) + Int64Serializer().serialize(value)


# ---- full key groups from caches that hold every state whole --------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.integers(-300, 300), st.sampled_from(["value", "list", "reducing", "aggregating",
                                                                      "ttl", "clear"]), st.integers(-9, 9)),
                    max_size=120),
       now=st.sampled_from([1000.0, 1000.0 + 3500]), split=st.integers(0, 60), every=st.sampled_from([1, 2, 3]),
       from_rows=st.booleans())
def test_full_key_groups_from_complete_caches_are_the_rows_a_database_scan_reads(tmp_path, ops, now, split, every,
                                                                                 from_rows):
    """A backend started from nothing holds every value in its caches: the full blocks it encodes from them are,
    section by section and byte for byte, what the compiled scan of the database reads once the caches are written
    (TTL-expired values left out of both, cleared keys absent from both). ``from_rows``: cut from the rows of the
    flush just made (``_flush``'s ``rows_out``), which wrote the writes after the first ``split`` only: the other
    cached keys of the full key groups encoded from the caches."""
    _check_full_from_caches(tmp_path, ops, now, split, every, from_rows)


@pytest.mark.parametrize("seed", range(4))
def test_full_key_groups_cut_from_a_large_flush_s_rows_are_the_rows_a_database_scan_reads(tmp_path, seed):
    """As above at a write-back's scale: hundreds of keys, most written again after an earlier flush (cut from the
    last flush's rows), the others only in the caches (encoded), some key groups full."""
    import random
    rng = random.Random(seed)
    ops = [(rng.randrange(-300, 301), rng.choice(["value", "list", "reducing", "aggregating", "ttl", "clear"]),
            rng.randrange(-9, 10)) for _ in range(1500)]
    _check_full_from_caches(tmp_path, ops, 1000.0 + 3500 * (seed % 2), 700, 1 + seed % 3, True)


def _check_full_from_caches(tmp_path, ops, now, split, every, from_rows):
    from keygroups import assign_to_key_group
    from keygroups._native import sstload
    from keygroups.state.rocksdb import _COMPLETE
    from keygroups.state.rocksdb_ingest import STORED_KINDS

    clock = [1000.0]
    b = RocksDBKeyedStateBackend(key_group_range(MAXP, 2, 1), MAXP, Int64Serializer(), db_dir=str(tmp_path),
                                 clock=lambda: clock[0])
    try:
        s = {n: b.get_state(d) for n, d in states().items()}
        r = b.key_group_range
        model = _Writes(s, clock)
        for i, (k, op, v) in enumerate(ops):
            if i == split:
                b._flush()   # written before: in the cache, not in the last flush's rows
            k = k * 2 + (k % 2)   # spread over key groups, some outside the range: skipped
            if not r.start <= assign_to_key_group(k, MAXP) <= r.end:
                continue
            b.set_current_key(k)
            if op == "clear":
                for name in ("value", "ttl"):
                    s[name].clear()
            else:
                write_value_like(model, k, v, op)
        clock[0] = now   # the TTL value (ttl 3 s) expired or not at the snapshot
        flushed = {}
        b._flush(rows_out=flushed if from_rows else None)
        tables = list(b._tables.values())
        assert all(_COMPLETE in t.cache for t in tables)
        deadlines = {t.state_id: t.ttl_deadline() for t in tables}
        full = set(range(r.start, r.end + 1, every))
        got = b._full_from_caches(tables, full, deadlines, flushed if from_rows else None)
        assert got is not None
        compiled = {t.state_id: (t.state_id, STORED_KINDS.get(t.meta["kind"], sstload.VALUE), t.write_framing.ttl,
                                 deadlines[t.state_id]) for t in tables}
        for g in sorted(full):
            scanned = b._compiled_sections(b._db, g, compiled)
            assert [(s_, bytes(k.data), k.offsets.tolist(), bytes(v.data), v.offsets.tolist())
                    for s_, k, v in got[g]] == [
                (s_, bytes(k.data), k.offsets.tolist(), bytes(v.data), v.offsets.tolist()) for s_, k, v in scanned], g
    finally:
        b.dispose()


def test_the_write_back_makes_the_chain_compactions_the_deferred_snapshots_left_and_every_checkpoint_restores(tmp_path):
    """Write-back with caches that hold the whole state (a job started from nothing): the deferred snapshots write no
    full key group; the snapshot that writes the database back makes their chain compactions with its own (encoded
    from the caches), and every checkpoint restores exactly, in this process or another."""
    rocksdb_module._KEPT_CACHES.clear()
    storage, warm = CheckpointStorage(tmp_path / "chk"), str(tmp_path / "warm")
    keys = range(2000)
    _batch(storage, warm, None, 1, keys, 1, write_back_batches=4, max_chain=1)
    fulls = []
    for checkpoint_id in range(2, 7):
        _, writes = _batch(storage, warm, checkpoint_id - 1, checkpoint_id, keys[checkpoint_id::3], checkpoint_id,
                           write_back_batches=4, max_chain=1)
        fulls.append((writes > 0, _full_groups(storage, checkpoint_id)))
    # checkpoints 2-4 deferred (nothing written, no full key group); 5 writes back, with the compactions 3 and 4
    # left (2 had none due: every chain one block long) and its own: an eighth of the 128 key groups each
    assert fulls == [(False, 0), (False, 0), (False, 0), (True, 48), (False, 0)]
    expected = {k: 1 + sum(c for c in range(2, 7) if k >= c and k % 3 == c % 3) for k in keys}
    rocksdb_module._KEPT_CACHES.clear()   # another process: the database (at 5) catches up to 6
    assert _values(storage, 6, keys) == expected
    for checkpoint_id in range(4, 7):     # each checkpoint retained, cold
        assert _values(storage, checkpoint_id, keys) == {
            k: 1 + sum(c for c in range(2, checkpoint_id + 1) if k >= c and k % 3 == c % 3) for k in keys}


class _Writes:
    """What ``write_value_like`` writes through: one backend's states, a throwaway dict model, the TTL clock."""

    def __init__(self, states, clock):
        self.states, self.clock = states, clock
        self.model = {n: {} for n in states}

    def at(self, k):
        return self.states

    @property
    def now(self):
        return self.clock[0]


def _full_groups(storage, checkpoint_id):
    """How many key groups checkpoint ``checkpoint_id``'s snapshot wrote full."""
    (handle,) = [h for h in storage.load(checkpoint_id).keyed_handles if h.checkpoint_id == checkpoint_id]
    return sum(r.end - r.start + 1 for r in handle.full_key_groups)


@settings(max_examples=40, deadline=None)
@given(pending=st.dictionaries(st.integers(-2**40, 2**40), st.integers(0, 7), max_size=40),
       skip=st.sets(st.integers(-2**40, 2**40), max_size=10), take=st.integers(0, 40))
def test_flush_values_skips_the_keys_it_is_told_to(pending, skip, take):
    from keygroups._native import rocksstate
    from keygroups._native.framing import Encoder
    from keygroups.state._codec import ValueFraming

    framing = ValueFraming.for_state("n", "value", {"value": Int64Serializer()}, ttl=False)
    skip = dict.fromkeys(set(skip) | set(list(pending)[:take]), 0)
    cache = {k: k // 3 for k in pending}
    prefixes = [bytes([0, g]) for g in range(8)]
    args = (cache, Encoder(Int64Serializer()), framing.writer, prefixes, b"\x00\x01")
    got = rocksstate.flush_values(pending, *args, skip)
    expected = rocksstate.flush_values({k: g for k, g in pending.items() if k not in skip}, *args)
    assert got[:4] == expected[:4]
    assert got[4].tolist() == expected[4].tolist() and got[5].tolist() == expected[5].tolist()


@settings(max_examples=40, deadline=None)
@given(keys=st.lists(st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=6),
                               st.tuples(st.integers(-9, 9), st.text(max_size=3))), max_size=40),
       groups=st.sets(st.integers(64, 127), max_size=30), typed=st.booleans())
def test_cached_in_groups_hashes_the_cached_keys_as_set_current_key_does(keys, groups, typed):
    from keygroups import assign_to_key_group
    from keygroups._hashing import key_type_code
    from keygroups._native import rocksstate
    from keygroups._native.statecore import KeyContext, java_keys

    r = key_group_range(MAXP, 2, 1)
    key_type = None
    if typed:   # declared Java types: ints as "int" (Integer.hashCode), strings as "string", no tuples
        keys = [k % 2**31 for k in keys if type(k) is int] or [s for s in keys if type(s) is str]
        key_type = "int" if keys and type(keys[0]) is int else "string"
        keys = [k for k in keys if type(k) is (int if key_type == "int" else str)]
    ctx = KeyContext(r, MAXP, key_type_code(key_type))
    mine = [k for k in java_keys(keys) if r.start <= assign_to_key_group(k, MAXP, key_type) <= r.end]
    mark = object()
    cache = dict.fromkeys(mine, 0)
    cache[mark] = None
    got = rocksstate.cached_in_groups(cache, ctx, mark, groups)
    expected = {}
    for k in mine:
        ctx.set_current_key(k)
        if ctx.kgi + r.start in groups:
            expected[k] = ctx.kgi
    assert got == expected and list(got) == list(expected)


def test_full_sections_merges_runs_and_refuses_rows_out_of_order_or_sharing_a_key():
    """``rocksstate.full_sections`` merges a flush's runs per key group of ``full`` (others left out, expired TTL
    values dropped); runs out of order, a key in two runs, or a key shorter than its prefix are refused by name."""
    import struct

    from keygroups._native.rocksstate import full_sections

    def key(g, kb):
        return struct.pack(">HHI", g, 0, len(kb)) + kb

    got = full_sections([([key(5, b"a"), key(7, b"c")], [b"1", b"3"]), ([key(5, b"b"), key(6, b"z")], [b"2", b"9"])],
                        {5, 7}, False, None)
    assert [(g, bytes(k[0]), k[1].tolist(), bytes(v[0]), v[1].tolist()) for g, (k, v) in got] == [
        (5, b"ab", [0, 1, 2], b"12", [0, 1, 2]), (7, b"c", [0, 1], b"3", [0, 1])]
    stamped = [struct.pack("<q", 10) + b"x", struct.pack("<q", 20) + b"y"]
    got = full_sections([([key(5, b"a"), key(5, b"b")], stamped)], {5}, True, 10)
    assert [(g, bytes(k[0]), bytes(v[0])) for g, (k, v) in got] == [(5, b"b", stamped[1])]
    assert full_sections([([key(5, b"a")], [b"1"])], {6}, False, None) == []
    with pytest.raises(ValueError, match="ascending"):
        full_sections([([key(5, b"b"), key(5, b"a")], [b"1", b"2"])], {5}, False, None)
    with pytest.raises(ValueError, match="ascending"):
        full_sections([([key(5, b"a")], [b"1"]), ([key(5, b"a")], [b"2"])], {5}, False, None)
    with pytest.raises(ValueError, match="prefix"):
        full_sections([([b"\x00\x05"], [b"1"])], {5}, False, None)
