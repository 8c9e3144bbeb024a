"""Keys compare as Java's ``equals`` compares them in both backends, before and after a snapshot and a restore at
another parallelism: every NaN is one key (``Double.equals``), ``-0.0`` and ``0.0`` are two, alone or inside tuple
keys; the backends hash them by the same rule they compare them by. Map keys follow the same rule (keyed MapState on
both backends, operator broadcast state), on every path a batch, the state reader and the savepoint writer take."""

from __future__ import annotations

import math
import pickle
import struct

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange, assign_key_groups, key_group_range, operator_index_for_key_group
from keygroups._parquet import read_parquet
from keygroups._javakeys import NAN_KEY, NEGATIVE_ZERO_KEY
from keygroups._native.statecore import java_key
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.errors import KeyGroupOutOfRangeError
from keygroups.serializers import Float64Serializer, Int64Serializer, TupleSerializer
from keygroups.runtime.driver import begin_batch, commit_batch
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.state_reader import KeyedStateReader
from keygroups.runtime.state_writer import StateColumn, commit_savepoint, plan_savepoint, write_savepoint_subtask
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.state import (
    HeapKeyedStateBackend,
    MapStateDescriptor,
    OperatorStateStore,
    RocksDBKeyedStateBackend,
    ValueStateDescriptor,
)

MAXP = 8
BACKENDS = {"heap": HeapKeyedStateBackend, "rocksdb": RocksDBKeyedStateBackend}


def java_bits(x: float) -> int:
    return 0x7FF8000000000000 if math.isnan(x) else struct.unpack("<q", struct.pack("<d", x))[0]


def model_key(key):
    return tuple(model_key(k) for k in key) if isinstance(key, tuple) else java_bits(key)


nans = st.sampled_from(["7ff8000000000000", "fff8000000000000", "7ff0000000000001", "7fffffffffffffff"]).map(
    lambda h: struct.unpack(">d", bytes.fromhex(h))[0])
floats = st.one_of(nans, st.sampled_from([0.0, -0.0, 1.0, -1.0]), st.floats(allow_nan=False, width=64))


def test_java_key_canonical_objects():
    assert java_key(float("nan")) is NAN_KEY and java_key(-math.nan) is NAN_KEY
    assert java_key(-0.0) is NEGATIVE_ZERO_KEY and java_key(0.0) == 0.0
    assert NEGATIVE_ZERO_KEY != 0.0 and 0.0 != NEGATIVE_ZERO_KEY and hash(NEGATIVE_ZERO_KEY) != hash(0.0)
    assert java_key((1, -0.0)) != (1, 0.0) and java_key((1, math.nan)) == java_key((1, float("nan")))
    key = (1, "a", 2.5)
    assert java_key(key) is key   # nothing to change: the same object


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(floats, max_size=8), tuples=st.booleans())
def test_a_map_value_with_float_keys_round_trips_as_java_keeps_them(keys, tuples):
    """A map *value* (``MapSerializer``) keeps ``0.0`` and ``-0.0`` apart and every NaN as one key, as Java's
    ``HashMap<Double, _>`` does: it decodes whole (not as a corrupt map of duplicate keys) and encodes back the same."""
    from keygroups.serializers import Int64Serializer, Float64Serializer
    from keygroups.serializers.composite import MapSerializer, TupleSerializer

    key_ser = TupleSerializer(Int64Serializer(), Float64Serializer()) if tuples else Float64Serializer()
    ser = MapSerializer(key_ser, Int64Serializer())
    value = {}
    for i, k in enumerate(keys):
        value[java_key((i % 2, k) if tuples else k)] = i
    data = ser.serialize(value)
    decoded = ser.deserialize(data)
    assert len(decoded) == len(value)
    assert {model_key(k): v for k, v in decoded.items()} == {model_key(k): v for k, v in value.items()}
    assert ser.serialize(decoded) == data


def _owns(backend, key) -> bool:
    """Whether ``backend`` owns ``key``'s key group (it becomes the current key there)."""
    try:
        backend.set_current_key(key)
        return True
    except KeyGroupOutOfRangeError:
        return False


@pytest.mark.parametrize("name", sorted(BACKENDS))
@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(floats, st.integers(0, 2)), min_size=1, max_size=40), new_p=st.integers(1, 3),
       tuples=st.booleans())
def test_float_keys_are_java_keys_through_snapshot_and_rescale(tmp_path_factory, name, ops, new_p, tuples):
    key_ser = TupleSerializer(Int64Serializer(), Float64Serializer()) if tuples else Float64Serializer()
    backend = BACKENDS[name](KeyGroupRange(0, MAXP - 1), MAXP, key_ser)
    desc = ValueStateDescriptor("n", Int64Serializer())
    state = backend.get_state(desc)
    model: dict = {}
    for x, tag in ops:
        key = (tag, x) if tuples else x
        backend.set_current_key(key)
        state.update((state.value() or 0) + 1)
        model[model_key(key)] = model.get(model_key(key), 0) + 1
    storage = CheckpointStorage(str(tmp_path_factory.mktemp("chk")))
    handle = backend.snapshot(1, storage).result()
    backend.dispose()
    md = CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=MAXP, parallelism=1,
                            keyed_handles=[handle], operator_handles=[])
    for other in BACKENDS.values():
        restored = []
        for i in range(new_p):
            b = other(key_group_range(MAXP, new_p, i), MAXP, key_ser)
            b.restore(storage, md)
            restored.append(b)
        for x, tag in ops:
            key = (tag, x) if tuples else x
            owners = [b for b in restored if _owns(b, key)]
            assert len(owners) == 1
            assert owners[0].get_state(desc).value() == model[model_key(key)]
        for b in restored:
            b.dispose()


# ---- map keys, and every path a batch takes (run_keyed_subtask, reader, writer) --------------------------------------
class CountPerKeyAndMapKey(KeyedProcessFunction):
    """Counts each job key's records (a value state) and, per job key, each map key's records (a map state)."""

    def open(self, context):
        self.count = context.get_state(ValueStateDescriptor("n", Int64Serializer()))
        self.per_map_key = context.get_state(MapStateDescriptor("m", Float64Serializer(), Int64Serializer()))

    def process_element(self, record, context):
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        uk = record["uk"]
        m = (self.per_map_key.get(uk) or 0) + 1
        self.per_map_key.put(uk, m)
        return [(record["seq"], n, m)]


PAYLOAD_NAN = struct.unpack("<d", bytes.fromhex("010000000000f07f"))[0]
BATCH_FLOATS = [math.nan, 0.0, -0.0, PAYLOAD_NAN, -0.0, 1.5, -math.nan, 0.0, math.nan, -1.5, -0.0]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("parallelisms", [(1, 1, 1), (2, 2), (1, 2, 1)])
def test_batches_keep_float_job_and_map_keys_apart_as_java_does(tmp_path, backend, parallelisms):
    """Job keys and map keys both from the float list, in several rounds at parallelism 1 and 2 (restores and
    rescales between them): each record's counts, and the state a reader finds after every round, follow a model
    keyed by Java's doubleToLongBits."""
    location = str(tmp_path / "chk")
    schema = pa.schema([("k", pa.float64()), ("uk", pa.float64()), ("seq", pa.int64())])
    out_schema = pa.schema([("seq", pa.int64()), ("n", pa.int64()), ("m", pa.int64())])
    counts: dict[int, int] = {}
    per_map_key: dict[int, dict[int, int]] = {}
    map_keys = BATCH_FLOATS[3:] + BATCH_FLOATS[:3]
    for round_, p in enumerate(parallelisms):
        seqs = list(range(round_ * 100, round_ * 100 + len(BATCH_FLOATS)))
        table = pa.table({"k": pa.array(BATCH_FLOATS, pa.float64()), "uk": pa.array(map_keys, pa.float64()),
                          "seq": pa.array(seqs, pa.int64())}, schema=schema)
        plan = begin_batch(CheckpointStorage(location), job_name="floats", max_parallelism=MAXP, parallelism=p)
        spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(CountPerKeyAndMapKey()), input_schema=schema,
                               output_schema=out_schema, backend=backend, local_dir=str(tmp_path / "local"))
        owners = operator_index_for_key_group(MAXP, p, assign_key_groups(table.column("k"), MAXP))
        reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches()) for i in range(p)]
        metadata = commit_batch(plan, reports)
        storage = CheckpointStorage(location)
        got = {row["seq"]: (row["n"], row["m"]) for f in metadata.outputs
               for row in read_parquet(storage.read_bytes(f)).to_pylist()}
        expected = {}
        for seq, k, uk in zip(seqs, BATCH_FLOATS, map_keys):
            counts[java_bits(k)] = counts.get(java_bits(k), 0) + 1
            m = per_map_key.setdefault(java_bits(k), {})
            m[java_bits(uk)] = m.get(java_bits(uk), 0) + 1
            expected[seq] = (counts[java_bits(k)], m[java_bits(uk)])
        assert got == expected
        # what is stored, as the state reader shows it: one row per Java key, one map entry per Java map key
        values = pa.concat_tables(pa.Table.from_batches([b]) for b in
                                  KeyedStateReader(storage, metadata, "n").read(KeyGroupRange(0, MAXP - 1)))
        stored = [(java_bits(k), n) for k, n in zip(values.column("key").to_pylist(),
                                                   values.column("value").to_pylist())]
        assert sorted(stored) == sorted(counts.items())
        entries = pa.concat_tables(pa.Table.from_batches([b]) for b in KeyedStateReader(
            storage, metadata, "m", flatten=True).read(KeyGroupRange(0, MAXP - 1)))
        stored_entries = [(java_bits(k), java_bits(uk), n) for k, uk, n in zip(
            entries.column("key").to_pylist(), entries.column("map_key").to_pylist(), entries.column("value").to_pylist())]
        assert sorted(stored_entries) == sorted((k, uk, n) for k, m in per_map_key.items() for uk, n in m.items())


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_written_savepoint_keeps_float_map_keys_apart_as_java_does(tmp_path, name):
    """The savepoint writer takes a map column with two NaNs of different payloads (one Java key: the later value
    wins, as a second put would) and both zeros (two keys); a backend restored from it finds them so."""
    keys = [1.0, 2.0]
    maps = [[(math.nan, 1), (PAYLOAD_NAN, 2), (0.0, 3), (-0.0, 4)], [(-0.0, 5)]]
    table = pa.table({"k": pa.array(keys, pa.float64()),
                      "m": pa.array(maps, pa.map_(pa.float64(), pa.int64()))})
    plan = plan_savepoint(table.schema, str(tmp_path), "boot", key_columns="k", max_parallelism=MAXP, parallelism=1,
                          states={"m": StateColumn("m", key_serializer=Float64Serializer(),
                                                   serializer=Int64Serializer())})
    commit_savepoint(plan, [write_savepoint_subtask(plan, 0, table.to_batches())])
    storage = CheckpointStorage(str(tmp_path))
    metadata = storage.load_savepoint("boot")
    backend = BACKENDS[name](KeyGroupRange(0, MAXP - 1), MAXP, Float64Serializer())
    backend.restore(storage, metadata)
    state = backend.get_state(MapStateDescriptor("m", Float64Serializer(), Int64Serializer()))
    backend.set_current_key(1.0)
    assert sorted((java_bits(k), v) for k, v in state.items()) == sorted(
        [(java_bits(math.nan), 2), (java_bits(0.0), 3), (java_bits(-0.0), 4)])
    assert state.get(float("nan")) == 2 and state.get(-0.0) == 4 and state.get(0.0) == 3
    backend.set_current_key(2.0)
    assert state.get(0.0) is None and state.get(-0.0) == 5
    backend.dispose()


def test_broadcast_state_keys_compare_as_java_does(tmp_path):
    """Operator broadcast maps follow the same equality, before and after a snapshot and restore."""
    descriptor = MapStateDescriptor("b", Float64Serializer(), Int64Serializer())
    store = OperatorStateStore(0, 1)
    state = store.get_broadcast_state(descriptor)
    state.put(math.nan, 1)
    state.put(PAYLOAD_NAN, 2)
    state.put(0.0, 3)
    state.put(-0.0, 4)
    assert len(state.items()) == 3 and state.get(float("nan")) == 2 and state.get(-0.0) == 4
    storage = CheckpointStorage(str(tmp_path))
    handle = store.snapshot(1, storage).result()
    md = CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=MAXP, parallelism=1,
                            keyed_handles=[], operator_handles=[handle])
    restored = OperatorStateStore(0, 1)
    restored.restore(storage, md)
    again = restored.get_broadcast_state(descriptor)
    assert sorted((java_bits(k), v) for k, v in again.items()) == sorted(
        [(java_bits(math.nan), 2), (java_bits(0.0), 3), (java_bits(-0.0), 4)])
    assert again.contains(PAYLOAD_NAN) and again.get(0.0) == 3


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_keys_lists_a_nan_key_once_after_a_chain_restore(tmp_path, name):
    """NaN (two payloads) and both zeros written in a full snapshot, then again in a delta on top of it: a backend
    restored from the chain lists each Java key once."""
    desc = ValueStateDescriptor("n", Int64Serializer())
    storage = CheckpointStorage(str(tmp_path / "chk"))
    keys = [math.nan, PAYLOAD_NAN, 0.0, -0.0]
    backend = BACKENDS[name](KeyGroupRange(0, MAXP - 1), MAXP, Float64Serializer())
    md = None
    for checkpoint_id in (1, 2):
        if md is not None:
            backend = BACKENDS[name](KeyGroupRange(0, MAXP - 1), MAXP, Float64Serializer())
            backend.restore(storage, md)
        state = backend.get_state(desc)
        for k in keys:
            backend.set_current_key(k)
            state.update((state.value() or 0) + 1)
        handle = backend.snapshot(checkpoint_id, storage).result()
        backend.dispose()
        md = CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="j", timestamp_ms=0, max_parallelism=MAXP,
                                parallelism=1, keyed_handles=carry_forward(storage.latest(), [handle]),
                                operator_handles=[])
        storage.commit(md)
        md = storage.load(checkpoint_id)
    assert len(md.keyed_handles) == 2   # a chain: the full block and the delta on top of it
    for other in BACKENDS.values():
        restored = other(KeyGroupRange(0, MAXP - 1), MAXP, Float64Serializer())
        restored.restore(storage, md)
        listed = sorted(java_bits(k) for k in restored.keys("n"))
        assert listed == sorted({java_bits(k) for k in keys})
        state = restored.get_state(desc)
        for k in keys:
            restored.set_current_key(k)
            assert state.value() == (4 if math.isnan(k) else 2)
        restored.dispose()


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_float_parts_of_tuple_map_keys_compare_as_java_does(tmp_path, name):
    """Map keys that are tuples with float fields: (1, NaN) of any payload is one entry, (1, 0.0) and (1, -0.0) two,
    before and after a snapshot and a restore at another parallelism."""
    desc = MapStateDescriptor("m", TupleSerializer(Int64Serializer(), Float64Serializer()), Int64Serializer())
    backend = BACKENDS[name](KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    state = backend.get_state(desc)
    backend.set_current_key(7)
    state.put((1, math.nan), 1)
    state.put((1, PAYLOAD_NAN), 2)
    state.put((1, 0.0), 3)
    state.put((1, -0.0), 4)
    state.put_all({(2, -0.0): 5, (2, float("nan")): 6})
    state.remove((2, -math.nan))

    def check(s):
        assert sorted((k[0], java_bits(k[1]), v) for k, v in s.items()) == sorted(
            [(1, java_bits(math.nan), 2), (1, java_bits(0.0), 3), (1, java_bits(-0.0), 4), (2, java_bits(-0.0), 5)])
        assert s.get((1, -math.nan)) == 2 and s.contains((2, -0.0)) and not s.contains((2, 0.0))

    check(state)
    storage = CheckpointStorage(str(tmp_path))
    handle = backend.snapshot(1, storage).result()
    backend.dispose()
    md = CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=MAXP, parallelism=1,
                            keyed_handles=[handle], operator_handles=[])
    for other in BACKENDS.values():
        for i in range(2):
            b = other(key_group_range(MAXP, 2, i), MAXP, Int64Serializer())
            b.restore(storage, md)
            if _owns(b, 7):
                check(b.get_state(desc))
            b.dispose()
