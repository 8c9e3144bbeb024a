"""The subtask runtime end to end without Spark: source subtasks, key-group placement, keyed subtasks and the commit,
rescaled between batches, against the plain reference computation. (The same code runs inside Spark tasks; the
Spark runner is tested in test_spark_job.py.)"""

from __future__ import annotations

import io
import math
import pickle
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import keygroups as kg
from keygroups.checkpoint import CheckpointStorage
from keygroups.cli import shop
from keygroups.errors import KeyGroupOutOfRangeError, KeyGroupsError, StateMigrationError
from keygroups.runtime import begin_batch, commit_batch
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.spec import KeyedTaskSpec
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.serializers import Int64Serializer
from keygroups.sources import write_partitioned_log
from keygroups.state import ValueStateDescriptor
from shop_runtime import MAX_PARALLELISM, final_states, rows, run_batch


class Boom(RuntimeError):
    pass


class FailingCart(shop.CartFunction):
    """Fails on one user's events (a task that dies mid-batch)."""

    def __init__(self, victim: str) -> None:
        self.victim = victim

    def process_element(self, event, context):
        if event["user"] == self.victim:
            raise Boom(f"task died while processing {self.victim}")
        return super().process_element(event, context)


@pytest.fixture
def events(tmp_path):
    partitions = shop.generate_events(3000, 150, partitions=5, seed=3)
    write_partitioned_log(tmp_path / "log", partitions)
    return partitions, str(tmp_path / "log")


def run_schedule(location, log_dir, schedule, **kwargs):
    orders, total = [], 0
    for parallelism, max_records in schedule:
        _, out, n = run_batch(location, log_dir, shop.CartFunction(), parallelism, max_records, **kwargs)
        orders += rows(out)
        total += n
    return sorted(orders), total


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_rescaling_4_2_8_1_gives_exactly_the_reference(events, tmp_path, backend):
    partitions, log_dir = events
    expected_state, expected_orders = shop.reference(partitions)
    location = str(tmp_path / "chk")
    orders, total = run_schedule(location, log_dir, [(4, 200), (4, 150), (2, 400), (8, 60), (8, 100), (1, None)],
                                 backend=backend)
    assert total == 3000
    assert orders == sorted(expected_orders)
    assert final_states(location) == expected_state


def test_retried_subtasks_never_apply_a_batch_twice(events, tmp_path):
    partitions, log_dir = events
    expected_state, expected_orders = shop.reference(partitions)
    location = str(tmp_path / "chk")
    orders, _ = run_schedule(location, log_dir, [(3, 300), (5, 300), (2, None)], retry_subtasks=True)
    assert orders == sorted(expected_orders)
    assert final_states(location) == expected_state


def test_a_crashed_batch_leaves_the_previous_checkpoint_and_can_run_again(events, tmp_path):
    partitions, log_dir = events
    expected_state, expected_orders = shop.reference(partitions)
    location = str(tmp_path / "chk")
    orders, _ = run_schedule(location, log_dir, [(4, 250)])
    storage = CheckpointStorage(location)
    before = storage.latest()
    victim = next(iter(partitions[0]))["user"]
    with pytest.raises(Boom):
        run_batch(location, log_dir, FailingCart(victim), 2, None)
    assert storage.latest().checkpoint_id == before.checkpoint_id  # the half-run batch does not exist
    more, _ = run_schedule(location, log_dir, [(2, None)])  # the same batch, run again at another parallelism
    assert orders + more and sorted(orders + more) == sorted(expected_orders)
    assert final_states(location) == expected_state


def test_a_subtask_refuses_records_outside_its_key_groups(events, tmp_path):
    _, log_dir = events
    location = str(tmp_path / "chk")
    table = pa.table({"user": ["user-000001", "user-000002", "user-000003", "user-000004"]})
    groups = kg.assign_key_groups(table.column("user"), MAX_PARALLELISM)
    owner = kg.operator_index_for_key_group(MAX_PARALLELISM, 2, groups)
    spec = KeyedTaskSpec(job_name="x", key_columns=("user",), key_type="string",
                         function=pickle.dumps(shop.CartFunction()), input_schema=table.schema,
                         output_schema=shop.ORDER_SCHEMA, max_parallelism=MAX_PARALLELISM, parallelism=2,
                         checkpoint_location=location, checkpoint_id=1, restore_from=None)
    wrong = int(np.flatnonzero(owner == 1)[0])
    with pytest.raises(KeyGroupOutOfRangeError, match=r"subtask 0 of 2 owns key groups .* but received key"):
        run_keyed_subtask(spec, 0, table.slice(wrong, 1).to_batches())


class Counter(KeyedProcessFunction):
    """Vectorized form: one call per key with that key's records as an Arrow table."""

    def open(self, context):
        self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))

    def process_key_batch(self, key, records, context):
        total = (self.count.value() or 0) + records.num_rows
        self.count.update(total)
        return pa.table({"k": pa.array([key[0]], pa.int64()), "g": pa.array([key[1]], pa.int32()),
                         "n": pa.array([total], pa.int64())})


def test_vectorized_function_and_composite_int_keys(tmp_path):
    location = str(tmp_path / "chk")
    table = pa.table({"k": pa.array([1, 2, 1, 3, 1, 2], pa.int64()), "g": pa.array([7, 7, 7, 8, 7, 7], pa.int32())})
    key_type = ("long", "int")
    out_schema = pa.schema([("k", pa.int64()), ("g", pa.int32()), ("n", pa.int64())])
    owners = kg.operator_index_for_key_group(
        16, 3, kg.assign_key_groups_for_tuples([table.column("k"), table.column("g")], 16, key_type))
    results = []
    for cid, restore in ((1, None), (2, 1)):
        plan = begin_batch(CheckpointStorage(location), job_name="c", max_parallelism=16, parallelism=3)
        assert (plan.checkpoint_id, plan.restore_from) == (cid, restore)
        spec = plan.keyed_task(key_columns=("k", "g"), function=pickle.dumps(Counter()), input_schema=table.schema,
                               output_schema=out_schema)
        assert spec.key_type == key_type
        reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches()) for i in range(3)]
        metadata = commit_batch(plan, reports)
        storage = CheckpointStorage(location)
        results.append(sorted(rows_of(pa.concat_tables(
            pq.read_table(io.BytesIO(storage.read_bytes(f))) for f in metadata.outputs))))
    assert results[0] == [(1, 7, 3), (2, 7, 2), (3, 8, 1)]
    assert results[1] == [(1, 7, 6), (2, 7, 4), (3, 8, 2)]


def rows_of(table):
    return list(zip(*[c.to_pylist() for c in table.columns]))


# ---- the driver's protocol ---------------------------------------------------------------------------------------

def _totals_batch(location, parallelism, table, *, checkpoint_id=None, max_parallelism=16):
    """One batch of Counter over ``table`` through the driver; returns the plan and the committed metadata."""
    plan = begin_batch(CheckpointStorage(location), job_name="c", max_parallelism=max_parallelism,
                       parallelism=parallelism, checkpoint_id=checkpoint_id)
    if plan.replay is not None:
        return plan, plan.replay
    spec = plan.keyed_task(key_columns=("k", "g"), function=pickle.dumps(Counter()), input_schema=table.schema,
                           output_schema=pa.schema([("k", pa.int64()), ("g", pa.int32()), ("n", pa.int64())]))
    owners = kg.operator_index_for_key_group(
        max_parallelism, parallelism,
        kg.assign_key_groups_for_tuples([table.column("k"), table.column("g")], max_parallelism, spec.key_type))
    reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches())
               for i in sorted(set(owners.tolist()))]
    reports += [run_keyed_subtask(spec, i, []) for i in plan.idle_subtasks(reports)]
    return plan, commit_batch(plan, reports)


def _keys(n):
    return pa.table({"k": pa.array(range(n), pa.int64()), "g": pa.array([7] * n, pa.int32())})


def test_explicit_ids_replay_a_complete_checkpoint_and_refuse_older_ones(tmp_path):
    location = str(tmp_path / "chk")
    _, first = _totals_batch(location, 2, _keys(5), checkpoint_id=4)
    plan, again = _totals_batch(location, 3, _keys(5), checkpoint_id=4)   # replayed, even at another parallelism
    assert plan.replay is not None and again == first and again.outputs == first.outputs
    with pytest.raises(KeyGroupsError, match="already complete"):
        commit_batch(plan, [])
    nxt, _ = _totals_batch(location, 3, _keys(5))
    assert (nxt.checkpoint_id, nxt.restore_from) == (5, 4)
    with pytest.raises(KeyGroupsError, match=r"checkpoint 3 is older than the latest complete checkpoint 5 .*"
                                              r"retained: \[4, 5\]"):
        _totals_batch(location, 2, _keys(5), checkpoint_id=3)
    with pytest.raises(ValueError, match="checkpoint_id must be an int >= 0"):
        _totals_batch(location, 2, _keys(5), checkpoint_id=-1)


def test_another_max_parallelism_is_refused_before_any_subtask_runs(tmp_path):
    location = str(tmp_path / "chk")
    _totals_batch(location, 2, _keys(5))
    with pytest.raises(StateMigrationError,
                       match=r"written with max_parallelism=16, into a job with max_parallelism=24.*Allowed: 16 "
                             r"\(unchanged\); a multiple of 16 .*\(32, 48, 64, \.\.\., 32768\); a divisor of 16 "
                             r"\(1, 2, 4, 8\)"):
        begin_batch(CheckpointStorage(location), job_name="c", max_parallelism=24, parallelism=2)


def test_idle_subtasks_carry_their_key_groups_into_the_new_checkpoint(tmp_path):
    location = str(tmp_path / "chk")
    _, first = _totals_batch(location, 4, _keys(40))
    plan, empty = _totals_batch(location, 6, _keys(0))   # a rescale with no records: every subtask is idle
    assert plan.idle_subtasks([]) == list(range(6))
    assert [r["subtask"] for r in empty.properties["reports"]] == list(range(6))
    _, after = _totals_batch(location, 3, _keys(40))
    storage = CheckpointStorage(location)
    counts = pa.concat_tables(pq.read_table(io.BytesIO(storage.read_bytes(f))) for f in after.outputs)
    assert sorted(counts.column("n").to_pylist()) == [2] * 40


def test_commit_needs_exactly_one_report_per_subtask(tmp_path):
    location = str(tmp_path / "chk")
    storage = CheckpointStorage(location)
    plan = begin_batch(storage, job_name="c", max_parallelism=16, parallelism=3)
    spec = plan.keyed_task(key_columns=("k", "g"), function=pickle.dumps(Counter()), input_schema=_keys(0).schema,
                           output_schema=pa.schema([("k", pa.int64()), ("g", pa.int32()), ("n", pa.int64())]))
    reports = [run_keyed_subtask(spec, i, []) for i in range(3)]
    for bad in (reports[:2], reports + reports[1:2]):
        with pytest.raises(KeyGroupsError, match=r"keyed reports came from subtasks .* exactly one from each of 0..2"):
            commit_batch(plan, bad)
    assert storage.checkpoint_ids() == []
    metadata = commit_batch(plan, reports)
    assert storage.checkpoint_ids() == [1] and len(metadata.outputs) == 3 and metadata.inputs == []
    assert all(f.startswith("chk-1/output-") for f in metadata.outputs)


class Emits(KeyedProcessFunction):
    """Emits, for every record, whatever the test gives it (records of the output schema, or wrong ones)."""

    def __init__(self, records):
        self.records = records

    def process_element(self, record, context):
        return list(self.records)


OUT = pa.schema([("user", pa.string()), ("n", pa.int64())])


def run_emitting(tmp_path, records):
    table = pa.table({"user": ["u1"]})
    spec = KeyedTaskSpec(job_name="x", key_columns=("user",), key_type="string", function=pickle.dumps(Emits(records)),
                         input_schema=table.schema, output_schema=OUT, max_parallelism=MAX_PARALLELISM,
                         parallelism=1, checkpoint_location=str(tmp_path / "chk"), checkpoint_id=1, restore_from=None)
    report = run_keyed_subtask(spec, 0, table.to_batches())
    return pq.read_table(io.BytesIO(CheckpointStorage(str(tmp_path / "chk")).read_bytes(report.output_file)))


def test_output_records_of_every_form_keep_their_order(tmp_path):
    records = [{"user": "a", "n": 1}, ("b", 2), ["c", 3], pa.table({"n": [4, 5], "user": ["d", "e"], "extra": [0, 0]}),
               {"n": 6, "user": "f"}, {"user": None, "n": None}]
    out = run_emitting(tmp_path, records)
    assert out.schema == OUT
    assert out.to_pylist() == [{"user": u, "n": n} for u, n in
                               [("a", 1), ("b", 2), ("c", 3), ("d", 4), ("e", 5), ("f", 6), (None, None)]]


@pytest.mark.parametrize("record, message", [
    ({"usr": "a", "n": 1}, r"unknown fields \['usr'\], missing fields \['user'\]"),
    ({"user": "a"}, r"unknown fields \[\], missing fields \['n'\]"),
    ({"user": "a", "n": 1, "extra": 2}, r"unknown fields \['extra'\], missing fields \[\]"),
    (("a", 1, 2), r"has 3 fields; the output schema has 2: \['user', 'n'\]"),
    (pa.table({"user": ["a"]}), r"lacks the output schema's columns \['n'\]"),
])
def test_an_output_record_that_does_not_fit_the_schema_is_refused_by_name(tmp_path, record, message):
    with pytest.raises(ValueError, match=message):
        run_emitting(tmp_path, [{"user": "ok", "n": 0}, record])


def test_an_output_record_of_another_kind_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"output record 7 is a int; records are dicts \(field names \['user', 'n'\]\)"):
        run_emitting(tmp_path, [7])


# ---- keys compare as Java compares them ---------------------------------------------------------------------------

class CountPerKey(KeyedProcessFunction):
    """Counts each key's records and emits the running count, with the batch's key as the function saw it."""

    def open(self, context):
        self.count = context.get_state(ValueStateDescriptor("n", Int64Serializer()))

    def process_element(self, record, context):
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        return [(record["seq"], n)]


def _java_bits(x: float) -> int:
    """Java's doubleToLongBits: the IEEE bits, every NaN the one canonical NaN."""
    return 0x7FF8000000000000 if math.isnan(x) else struct.unpack("<q", struct.pack("<d", x))[0]


@pytest.mark.parametrize("parallelisms", [(1, 1), (4, 1), (1, 3), (2, 4)])
def test_float_keys_group_as_java_equals_at_every_parallelism(tmp_path, parallelisms):
    payload_nan = struct.unpack("<d", bytes.fromhex("010000000000f07f"))[0]   # a NaN with another payload
    floats = [math.nan, 0.0, -0.0, payload_nan, -0.0, 1.5, -math.nan, 0.0, math.nan, -1.5, -0.0]
    location = str(tmp_path / "chk")
    schema = pa.schema([("k", pa.float64()), ("seq", pa.int64())])
    out_schema = pa.schema([("seq", pa.int64()), ("n", pa.int64())])
    model: dict[int, int] = {}
    for round_, p in enumerate(parallelisms):
        table = pa.table({"k": pa.array(floats, pa.float64()),
                          "seq": pa.array(range(round_ * 100, round_ * 100 + len(floats)), pa.int64())}, schema=schema)
        plan = begin_batch(CheckpointStorage(location), job_name="floats", max_parallelism=4, parallelism=p)
        spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(CountPerKey()), input_schema=schema,
                               output_schema=out_schema)
        owners = kg.operator_index_for_key_group(4, p, kg.assign_key_groups(table.column("k"), 4))
        reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches()) for i in range(p)]
        metadata = commit_batch(plan, reports)
        storage = CheckpointStorage(location)
        got = dict(rows_of(pa.concat_tables(pq.read_table(io.BytesIO(storage.read_bytes(f)))
                                            for f in metadata.outputs)))
        # the model: records are counted in input order per Java key (one NaN key; -0.0 and 0.0 apart)
        expected = {}
        for seq, x in zip(table.column("seq").to_pylist(), floats):
            model[_java_bits(x)] = model.get(_java_bits(x), 0) + 1
            expected[seq] = model[_java_bits(x)]
        assert got == expected
    assert len(model) == 5   # NaN, 0.0, -0.0, 1.5, -1.5
