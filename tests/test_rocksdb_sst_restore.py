"""The RocksDB restore that ingests one SST file built in compiled code (``state/rocksdb_ingest.py``,
``_native/sstload.pyx``) writes exactly the rows the row-by-row restore writes: the same database, byte for byte,
for chains of full and delta blocks (puts, deletes, maps replaced whole), keys of different lengths (the database
orders them by length first, the file by bytes), TTL states with entries expired by the restore's deadline, and
restores at another parallelism or max parallelism. Bytes that pass the file's checksum but lie (crafted offsets,
map frames overrunning their value) raise CorruptSnapshotError, never read outside the block."""

from __future__ import annotations

import numpy as np
import pytest
import rocksdict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups import assign_to_operator, key_group_range
from keygroups._native import sstload
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.errors import CorruptSnapshotError
from keygroups.serializers import Int64Serializer, StrSerializer
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    ValueStateDescriptor,
)
from keygroups.state.rocksdb import _scan

TTL = StateTtlConfig.new_builder(1).cleanup_full_snapshot().build()   # 1 s; snapshots and restores drop what expired


def descriptors():
    out = [ValueStateDescriptor("value", Int64Serializer()), ListStateDescriptor("list", StrSerializer()),
           MapStateDescriptor("map", StrSerializer(), Int64Serializer())]
    for d in (ValueStateDescriptor("ttl value", Int64Serializer()), ListStateDescriptor("ttl list", Int64Serializer()),
              MapStateDescriptor("ttl map", Int64Serializer(), StrSerializer())):
        d.enable_time_to_live(TTL)
        out.append(d)
    return out


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class RowByRow(RocksDBKeyedStateBackend):
    """The reference: every restored block applied row by row (the path before SST ingestion)."""

    def _restore_block(self, handle, targets, block):
        self._apply_block(handle, targets, block)


KEYS = st.text(alphabet="ab\u00e9", min_size=0, max_size=6)   # lengths differ: (length, bytes) order is not bytes order
# time passed before a snapshot: 1.0 s after a tick expires exactly what that tick wrote (its stamp is the deadline)
LATER = st.one_of(st.just(1.0), st.floats(0, 3))
OPS = st.lists(st.tuples(st.sampled_from(["put", "clear", "add", "map put", "map remove", "tick"]), KEYS,
                         st.integers(-3, 3), st.sampled_from(["x", "yy", "zzz"])), max_size=40)


def apply(backend, states, clock, ops):
    for op, key, number, text in ops:
        if op == "tick":
            clock.now += 0.7
            continue
        backend.set_current_key(key)
        plain = number % 2 == 0
        if op == "put":
            states["value" if plain else "ttl value"].update(number)
        elif op == "clear":
            for s in states.values():
                s.clear()
        elif op == "add":
            states["list"].add(text)
            states["ttl list"].add(number)
        elif op == "map put":
            states["map"].put(text, number)
            states["ttl map"].put(number, text)
        else:
            states["map"].remove(text)
            states["ttl map"].remove(number)


def write_chain(storage, rounds, maxp, p):
    """Checkpoints 1..len(rounds) of p heap subtasks, incremental: the later ones are deltas on the first."""
    clock = Clock()
    backends = [HeapKeyedStateBackend(key_group_range(maxp, p, i), maxp, StrSerializer(), subtask_index=i,
                                      clock=clock) for i in range(p)]
    states = [{d.name: b.get_state(d) for d in descriptors()} for b in backends]
    metadata = None
    for checkpoint_id, ops in enumerate(rounds, start=1):
        for op in ops:
            i = assign_to_operator(op[1], maxp, p)
            apply(backends[i], states[i], clock, [op])
        handles = [b.snapshot(checkpoint_id, storage).result(60) for b in backends]
        storage.commit(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="sst", timestamp_ms=0,
                                          max_parallelism=maxp, parallelism=p,
                                          keyed_handles=carry_forward(storage.latest(), handles),
                                          operator_handles=[], properties={}))
        metadata = storage.load(checkpoint_id)
    return metadata, clock.now


def database(backend):
    backend._flush()
    return list(_scan(backend._db))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rounds=st.lists(OPS, min_size=1, max_size=4), p=st.integers(1, 3), p2=st.integers(1, 3),
       maxp2=st.sampled_from([8, 16, 4]), register_first=st.booleans(), later=st.floats(0, 3))
def test_sst_restore_writes_the_rows_the_row_by_row_restore_writes(tmp_path_factory, rounds, p, p2, maxp2,
                                                                   register_first, later):
    storage = CheckpointStorage(str(tmp_path_factory.mktemp("ck")))
    metadata, now = write_chain(storage, rounds, 8, p)
    clock = Clock()
    clock.now = now + later   # with states registered first, what expired by then is dropped by the restore
    for i in range(p2):
        r = key_group_range(maxp2, p2, i)
        fast = RocksDBKeyedStateBackend(r, maxp2, StrSerializer(), subtask_index=i, clock=clock)
        slow = RowByRow(r, maxp2, StrSerializer(), subtask_index=i, clock=clock)
        try:
            for b in (fast, slow):
                if register_first:
                    for d in descriptors():
                        b.get_state(d)
                b.restore(storage, metadata)
                for d in descriptors():
                    b.get_state(d)
            assert database(fast) == database(slow)
        finally:
            fast.dispose()
            slow.dispose()


# ---- the compiled writer on bytes that pass a checksum but lie -------------------------------------------------------

def writer(tmp_path):
    opts = rocksdict.Options(raw_mode=True)
    w = rocksdict.SstFileWriter(opts)
    w.open(str(tmp_path / "x.sst"))
    return w


def offsets(*values):
    return np.array(values, dtype=np.int64)


def test_offsets_outside_the_block_are_refused(tmp_path):
    block = b"abcdefgh"
    chain = [(block, True, [(0, offsets(0, 4, 99), offsets(4, 6, 8))], [], [0])]
    with pytest.raises(CorruptSnapshotError):
        sstload.write_key_group(writer(tmp_path), 3, chain, [(0, sstload.VALUE, False, None)])
    chain = [(block, True, [(0, offsets(0, 4), offsets(5, 4))], [], [0])]
    with pytest.raises(CorruptSnapshotError):
        sstload.write_key_group(writer(tmp_path), 3, chain, [(0, sstload.VALUE, False, None)])


def test_a_map_frame_overrunning_its_value_is_refused(tmp_path):
    value = (200).to_bytes(4, "little") + b"\x01\x00\x00\x00k" + b"v"
    block = b"key" + value
    chain = [(block, True, [(0, offsets(0, 3), offsets(3, len(block)))], [], [0])]
    with pytest.raises(CorruptSnapshotError):
        sstload.write_key_group(writer(tmp_path), 0, chain, [(0, sstload.MAP, False, None)])


def test_a_ttl_value_without_its_timestamp_is_refused(tmp_path):
    block = b"key" + b"1234"
    chain = [(block, True, [(0, offsets(0, 3), offsets(3, 7))], [], [0])]
    with pytest.raises(CorruptSnapshotError):
        sstload.write_key_group(writer(tmp_path), 0, chain, [(0, sstload.VALUE, True, 0)])


def test_a_section_for_a_state_the_file_does_not_have_is_refused(tmp_path):
    block = b"kv"
    chain = [(block, True, [(5, offsets(0, 1), offsets(1, 2))], [], [0])]
    with pytest.raises(CorruptSnapshotError):
        sstload.write_key_group(writer(tmp_path), 0, chain, [(0, sstload.VALUE, False, None)])


def test_keys_are_written_in_the_database_order_and_the_newest_entry_wins(tmp_path):
    """Full block {aa: 2, b: 1, c: 3} (bytes order), then a delta putting aa = 9 and deleting c: rows b = 1 and
    aa = 9, in that order (the database orders keys by length first)."""
    full = b"aabc" + b"2" + b"1" + b"3"
    delta = b"aa9" + b"c"
    chain = [(full, True, [(0, offsets(0, 2, 3, 4), offsets(4, 5, 6, 7))], [], [0]),
             (delta, False, [(0, offsets(0, 2), offsets(2, 3))], [(0, offsets(3, 4))], [0])]
    w = writer(tmp_path)
    rows, _ = sstload.write_key_group(w, 1, chain, [(7, sstload.VALUE, False, None)])
    w.finish()
    assert rows == 2
    db = rocksdict.Rdict(str(tmp_path / "db"), rocksdict.Options(raw_mode=True))
    try:
        db.ingest_external_file([str(tmp_path / "x.sst")])
        assert list(_scan(db)) == [(b"\x00\x01\x00\x07\x00\x00\x00\x01b", b"1"),
                                   (b"\x00\x01\x00\x07\x00\x00\x00\x02aa", b"9")]
    finally:
        db.close()


class PythonScan(RocksDBKeyedStateBackend):
    """The reference: full key groups scanned row by row in Python."""

    @staticmethod
    def _compiled_sections(view, key_group, states):
        return None


def snapshot_entries(storage, handle):
    """(key group, state name, key bytes) -> value bytes of a full snapshot file."""
    from keygroups.checkpoint import read_key_groups
    blocks, _ = read_key_groups(storage, handle, handle.key_group_range, copy=True)
    out = {}
    for block in blocks:
        assert block.full and not block.deletes
        for index, keys, values in block.puts:
            for k, v in zip(keys, values):
                out[(block.key_group, handle.states[index]["name"], k)] = v
    return out


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=OPS, later=LATER)
def test_the_compiled_full_scan_writes_what_the_python_scan_writes(tmp_path_factory, ops, later):
    storage = CheckpointStorage(str(tmp_path_factory.mktemp("ck")))
    handles = []
    for cls in (RocksDBKeyedStateBackend, PythonScan):
        clock = Clock()
        b = cls(key_group_range(8, 1, 0), 8, StrSerializer(), clock=clock)
        try:
            states = {d.name: b.get_state(d) for d in descriptors()}
            apply(b, states, clock, ops)
            clock.now += later   # TTL values expired by then are left out of the snapshot
            handles.append(b.snapshot(len(handles) + 1, storage).result(60))
        finally:
            b.dispose()
    assert snapshot_entries(storage, handles[0]) == snapshot_entries(storage, handles[1])


READ = object()


class PythonDeltas(RocksDBKeyedStateBackend):
    """The reference: deltas built key by key in Python (not cut from the snapshot's flush, nor a map's joined from
    its rows, in compiled code)."""

    def _capture_deltas(self, tables, full, encoded, cut=None):
        assert not cut   # no write-back here: every snapshot flushes
        for t in tables:
            t.flushed_rows = None
        return super()._capture_deltas(tables, full, encoded)

    def _capture_map_deltas(self, t, index, full, known, deadline, out):
        framing = t.write_framing
        for key, group_index in t.changed.items():
            g = self._start + group_index
            if g in full:
                continue
            value = known.get(key, READ)
            if value is READ:   # written entry by entry: its rows joined
                rows = t.rows(t.db_key(group_index, key))
                value = framing.map_from_rows(rows) if rows else None
            if value is not None and deadline is not None:
                value = framing.drop_expired_bytes(value, deadline)
            puts, deletes = out.get(g) or out.setdefault(g, ({}, {}))
            if value is None:
                deletes.setdefault(index, []).append(self._serialize_key(key))
            else:
                keys, values = puts.get(index) or puts.setdefault(index, ([], []))
                keys.append(self._serialize_key(key))
                values.append(value)


def delta_entries(storage, handle):
    """(key group, state name) -> (puts as key -> value, deleted keys) of a snapshot file's delta blocks."""
    from keygroups.checkpoint import read_key_groups
    blocks, _ = read_key_groups(storage, handle, handle.key_group_range, copy=True)
    out = {}
    for block in blocks:
        for index, keys, values in block.puts:
            out.setdefault((block.key_group, block.full, handle.states[index]["name"]), [{}, set()])[0].update(
                zip(keys, values))
        for index, keys in block.deletes:
            out.setdefault((block.key_group, block.full, handle.states[index]["name"]), [{}, set()])[1].update(keys)
    return out


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(first=OPS, second=OPS, later=LATER, cache_limit=st.sampled_from([1, 2, 1 << 20]))
def test_deltas_cut_from_the_flush_are_the_deltas_built_key_by_key(tmp_path_factory, first, second, later,
                                                                   cache_limit):
    """(A small cache limit flushes keys before the snapshot: their values, TTL maps too, are read back.)"""
    storage = CheckpointStorage(str(tmp_path_factory.mktemp("ck")))
    files = []
    for cls in (RocksDBKeyedStateBackend, PythonDeltas):
        clock = Clock()
        b = cls(key_group_range(8, 1, 0), 8, StrSerializer(), clock=clock, max_chain=100, delta_fraction=100.0,
                cache_limit=cache_limit)
        try:
            states = {d.name: b.get_state(d) for d in descriptors()}
            apply(b, states, clock, first)
            # the first snapshot of a backend that did not restore is written full; the second is a delta
            b.snapshot(10 * len(files) + 1, storage).result(60)
            apply(b, states, clock, second)
            clock.now += later   # TTL values expired by then become deletes in the delta
            files.append(b.snapshot(10 * len(files) + 2, storage).result(60))
        finally:
            b.dispose()
    compiled, reference = delta_entries(storage, files[0]), delta_entries(storage, files[1])
    assert compiled == reference
    assert not any(full for _, full, _ in compiled)   # deltas, every one
