"""What a declarative aggregate keeps is ordinary keyed state: the state reader, ``keygroups verify`` and the Flink
export read it as they read a per-record job's; a savepoint moves a job between the two forms (either direction,
either backend); heap backends kept between batches resume the columns (catching up on blocks other workers wrote,
taking over moved key groups) exactly as a restore would give them; every key type works; bad arguments are refused
naming what is allowed."""

from __future__ import annotations

import datetime
import os

import numpy as np
import pyarrow as pa
import pytest

from keygroups import KeyGroupRange
from keygroups.aggregates import aggregate, count, first, last, max_of, mean, min_of, reduce_with, sum_of
from keygroups.aggregates.table import ColumnarStates
from keygroups.checkpoint import CheckpointStorage
from keygroups.cli import main as cli
from keygroups.errors import CorruptSnapshotError
from keygroups.runtime.state_reader import KeyedStateReader
from keygroups.state import StateTtlConfig
from keygroups.testing import KeyedFunctionHarness
from test_aggregates import INPUT, PerRecord, _rows, _same_tables, _same_value, run_both

RNG = np.random.default_rng(7)


def _batch(n: int, keys: int = 40) -> list[dict]:
    return [{"key": int(RNG.integers(0, keys)), "amount": int(RNG.integers(-50, 50)),
             "price": None if RNG.random() < 0.1 else float(RNG.normal()), "flag": bool(RNG.random() < 0.5)}
            for _ in range(n)]


def _job(**options):
    return aggregate(count(), sum_of("amount", name="total"), mean("price"), max_of("flag"), first("price"),
                     input_schema=INPUT, key_columns="key", **options)


def _read(snapshot, state: str) -> pa.Table:
    storage = CheckpointStorage(snapshot.location)
    metadata = storage.load_savepoint(snapshot.name)
    reader = KeyedStateReader(storage, metadata, state)
    batches = list(reader.read(KeyGroupRange(0, metadata.max_parallelism - 1)))
    return pa.Table.from_batches(batches, schema=reader.schema)


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_state_reader_verify_and_flink_export_see_the_per_record_jobs_state(backend, tmp_path):
    job = _job()
    with KeyedFunctionHarness(job, "key", output_schema=job.output_schema, parallelism=2, backend=backend,
                              input_schema=INPUT) as d, \
            KeyedFunctionHarness(PerRecord(job), "key", output_schema=job.output_schema, parallelism=2,
                                 backend=backend, input_schema=INPUT) as p:
        for i in range(3):
            table = _rows(_batch(300), 300 * i)
            d.process(table)
            p.process(table)
        _same_tables(d.output_table(), p.output_table())
        ds, ps = d.snapshot(), p.snapshot()
        for state in ("count", "total", "avg_price", "max_flag", "first_price"):
            _same_tables(_read(ds, state), _read(ps, state))
        assert _read(ds, "avg_price").schema.field("value").type == pa.struct(
            [pa.field("sum", pa.float64(), nullable=False), pa.field("count", pa.int64(), nullable=False)])
        assert cli(["verify", d.storage.location]) == 0
        reports = [__import__("keygroups.flink.exporter", fromlist=["x"]).export_savepoint(
            s.location, tmp_path / name, uid="agg", savepoint=s.name) for s, name in ((ds, "d"), (ps, "p"))]
        assert reports[0].entries == reports[1].entries > 0
        assert set(reports[0].keyed_states) == set(reports[1].keyed_states)


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_a_savepoint_moves_a_job_between_the_per_record_and_the_declarative_form(backend):
    job = _job()
    batches = [_rows(_batch(200), 200 * i) for i in range(4)]
    options = dict(output_schema=job.output_schema, parallelism=2, backend=backend, input_schema=INPUT)
    with KeyedFunctionHarness(job, "key", **options) as reference:
        for t in batches:
            reference.process(t)
        want = reference.output_table()
        states = {k: [reference.state(k, n) for n in ("count", "total", "avg_price")] for k in range(40)}
    # per record, then declarative (other parallelism and backend), then per record again
    with KeyedFunctionHarness(PerRecord(job), "key", **options) as a:
        a.process(batches[0])
        b = a.restore(a.snapshot(), function=job, parallelism=3, backend="rocksdb" if backend == "heap" else "heap")
        b.process(batches[1])
        b.process(batches[2])
        c = b.restore(b.snapshot(), function=PerRecord(job), parallelism=1, backend=backend)
        c.process(batches[3])
        got = pa.concat_tables([a.output_table(), b.output_table(), c.output_table()])
        # subtasks emit in key-group order: compare per key, in record order
        def by_key(t: pa.Table) -> dict:
            rows: dict = {}
            for r in t.to_pylist():
                rows.setdefault(r["key"], []).append(r)
            return rows
        assert by_key(got).keys() == by_key(want).keys()
        for k, rows in by_key(want).items():
            assert all(_same_value(tuple(x.values()), tuple(y.values())) for x, y in zip(rows, by_key(got)[k]))
        for k, values in states.items():
            assert all(_same_value(c.state(k, n), v) for n, v in zip(("count", "total", "avg_price"), values))


def test_kept_heap_backends_resume_the_columns_across_batches():
    """The harness keeps heap backends between batches (warm); the columns are resumed, not restored, and stay
    equal to a cold restore's state: checked against the per-record form over many batches."""
    job = _job()
    steps = [("batch", _batch(120)) for _ in range(6)]
    run_both(job, steps, backend="heap", warm_heap_backends=4)
    with KeyedFunctionHarness(job, "key", output_schema=job.output_schema, parallelism=2,
                              input_schema=INPUT) as h:
        h.process(_rows(_batch(50), 0))
        assert h.process(_rows(_batch(50), 50)).restored_modes == ["warm", "warm"]


@pytest.mark.parametrize("key_type,keys", [
    (pa.string(), ["a", "b", "", "ü", "long key " * 3]),
    (pa.int32(), [0, -1, 2**31 - 1, 7]),
    (pa.float64(), [0.0, -0.0, float("nan"), 1.5, -2.0]),
    (pa.bool_(), [True, False]),
    (pa.binary(), [b"", b"\x00", b"ab"]),
])
@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_every_key_type(key_type, keys, backend):
    schema = pa.schema([("key", key_type), ("amount", pa.int64()), ("price", pa.float64()), ("flag", pa.bool_()),
                        ("ts", pa.int64())])
    job = aggregate(count(), sum_of("amount"), min_of("price"), input_schema=schema, key_columns="key")
    rows = [{"key": keys[int(RNG.integers(0, len(keys)))], "amount": int(RNG.integers(0, 9)),
             "price": float(RNG.normal()), "flag": True, "ts": 0} for _ in range(60)]
    table = pa.Table.from_pylist(rows, schema=schema)
    options = dict(output_schema=job.output_schema, parallelism=2, backend=backend, input_schema=schema,
                   max_parallelism=8)
    with KeyedFunctionHarness(job, "key", **options) as d, KeyedFunctionHarness(PerRecord(job), "key",
                                                                                  **options) as p:
        for h in (d, p):
            h.process(table.slice(0, 30))
        r = d.restore(d.snapshot(), parallelism=3)
        s = p.restore(p.snapshot(), parallelism=3)
        for h in (r, s):
            h.process(table.slice(30))
        _same_tables(pa.concat_tables([d.output_table(), r.output_table()]),
                     pa.concat_tables([p.output_table(), s.output_table()]))
        for k in keys:
            for name in ("count", "sum_amount", "min_price"):
                assert _same_value(r.state(k, name), s.state(k, name)), (k, name)


def test_tuple_keys():
    schema = pa.schema([("a", pa.string()), ("b", pa.int64()), ("amount", pa.int64())])
    job = aggregate(count(), last("amount"), input_schema=schema, key_columns=["a", "b"], emit="per_key")
    rows = [{"a": "xy"[i % 2], "b": i % 3, "amount": i} for i in range(30)]
    with KeyedFunctionHarness(job, ["a", "b"], output_schema=job.output_schema, parallelism=2,
                              input_schema=schema) as h:
        h.process(pa.Table.from_pylist(rows, schema=schema))
        out = sorted(h.output_table().to_pylist(), key=lambda r: (r["a"], r["b"]))
        assert len(out) == 6
        assert {(r["a"], r["b"]): (r["count"], r["last_amount"]) for r in out} == {
            (a, b): (5, max(i for i in range(30) if "xy"[i % 2] == a and i % 3 == b)) for a in "xy" for b in range(3)}
        assert h.state(("x", 0), "count") == 5


def test_timestamps_dates_and_narrow_columns_come_back_in_their_types():
    schema = pa.schema([("key", pa.int64()), ("t", pa.timestamp("us", "UTC")), ("d", pa.date32()),
                        ("small", pa.int8()), ("f", pa.float32())])
    job = aggregate(min_of("t"), max_of("d"), last("small"), max_of("f"), input_schema=schema, key_columns="key",
                    emit="per_key")
    t0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    rows = [{"key": 1, "t": t0 + datetime.timedelta(seconds=i), "d": datetime.date(2026, 1, 1 + i),
             "small": -i, "f": 0.5 * i} for i in range(5)]
    with KeyedFunctionHarness(job, "key", output_schema=job.output_schema, input_schema=schema) as h:
        h.process(pa.Table.from_pylist(rows, schema=schema))
        assert h.output_table().to_pylist() == [{"key": 1, "min_t": t0, "max_d": datetime.date(2026, 1, 5),
                                                 "last_small": -4, "max_f": 2.0}]
        assert h.output_table().schema == job.output_schema
        assert h.state(1, "min_t") == int(t0.timestamp() * 1_000_000)   # kept as the column's int64 count


def test_an_integer_sum_past_the_long_range_fails_the_batch_naming_the_key():
    schema = pa.schema([("key", pa.int64()), ("v", pa.int64())])
    job = aggregate(sum_of("v"), input_schema=schema, key_columns="key")
    with KeyedFunctionHarness(job, "key", output_schema=job.output_schema, input_schema=schema) as h:
        h.process(pa.table({"key": [5, 6], "v": [2**62, 1]}))
        with pytest.raises(ArithmeticError, match=r"'sum_v'.*key 5 does not fit a long"):
            h.process(pa.table({"key": [5, 5], "v": [2**62, 2**62]}))
        h.process(pa.table({"key": [5], "v": [1]}))   # the failed batch left nothing behind
        assert h.state(5, "sum_v") == 2**62 + 1


def test_bad_arguments_are_refused_naming_what_is_allowed():
    schema = pa.schema([("key", pa.int64()), ("v", pa.int64()), ("s", pa.string()), ("b", pa.bool_()),
                        ("u", pa.uint64())])
    ok = dict(input_schema=schema, key_columns="key")
    with pytest.raises(TypeError, match="at least one aggregation"):
        aggregate(**ok)
    with pytest.raises(TypeError, match="takes aggregations"):
        aggregate("count", **ok)
    with pytest.raises(ValueError, match="has no column 'x'"):
        aggregate(sum_of("x"), **ok)
    with pytest.raises(TypeError, match="column 's' is string; sum takes integer or floating-point columns"):
        aggregate(sum_of("s"), **ok)
    with pytest.raises(TypeError, match="sum takes integer or floating-point"):
        aggregate(sum_of("b"), **ok)
    with pytest.raises(TypeError, match="column 'u' is uint64"):
        aggregate(max_of("u"), **ok)
    with pytest.raises(TypeError, match="binary numpy ufunc"):
        reduce_with(np.sqrt, "v")
    with pytest.raises(ValueError, match="emit must be one of"):
        aggregate(count(), emit="per_batch", **ok)
    with pytest.raises(ValueError, match="give expire_after"):
        aggregate(count(), emit="final", **ok)
    with pytest.raises(ValueError, match="keep_columns .* per-record rows only"):
        aggregate(count(), emit="per_key", keep_columns="v", **ok)
    with pytest.raises(ValueError, match=r"repeat \['count'\]"):
        aggregate(count(), count(), **ok)
    with pytest.raises(ValueError, match=r"repeat \['key'\]"):
        aggregate(sum_of("v", name="key"), **ok)
    with pytest.raises(ValueError, match="reserved"):
        aggregate(sum_of("v", name="expires_at"), expire_after=1000, **ok)
    with pytest.raises(ValueError, match="ReturnExpiredIfNotCleanedUp is not supported"):
        aggregate(count(), ttl=StateTtlConfig.new_builder(1).return_expired_if_not_cleaned_up().build(), **ok)
    with pytest.raises(TypeError, match="expire_after must be a datetime.timedelta or an int"):
        aggregate(count(), expire_after="1h", **ok)
    with pytest.raises(ValueError, match="key_columns"):
        aggregate(count(), input_schema=schema, key_columns="nope")
    assert aggregate(count("s"), **ok).output_schema.field("count_s").type == pa.int64()   # count takes any column


def test_restored_values_of_another_width_are_refused_as_corrupt():
    class FakeBackend:
        from keygroups.serializers import Int64Serializer as _K
        key_serializer = _K()
        max_parallelism = 8
        key_type = "long"

        def _state_meta(self, d):
            return {"name": d.name}

    from keygroups.aggregates.function import _layout
    job = aggregate(count(), input_schema=INPUT, key_columns="key")
    table = ColumnarStates(FakeBackend(), job.descriptors, [_layout(a) for a in job.aggregations])
    keys = np.array([1, 2], dtype="<i8").tobytes()
    values = b"\x01" * 15
    with pytest.raises(CorruptSnapshotError, match="not 8 bytes long"):
        table.load(3, False, [(0, (keys, np.array([0, 8, 16])), (values, np.array([0, 8, 15])))], [])
    with pytest.raises(CorruptSnapshotError, match="key of i8 keys is not 8 bytes"):
        table.load(3, False, [(0, (keys, np.array([0, 7, 16])), (values, np.array([0, 8, 16])))], [])


@pytest.mark.parametrize("key_type", ["long", "int"])
def test_captured_keys_come_in_block_order(key_type):
    """A capture hands each key group's long or int keys over in the order of their bytes (the order a snapshot
    block keeps, so the block encoder has nothing to sort), deltas and full key groups alike, negative keys too."""
    from keygroups.aggregates.function import _layout
    from keygroups.serializers import Int32Serializer, Int64Serializer

    class FakeBackend:
        key_serializer = Int64Serializer() if key_type == "long" else Int32Serializer()
        max_parallelism = 8

        def _state_meta(self, d):
            return {"name": d.name}

        def _snapshot_ttl_deadline(self, d):
            return None

    job = aggregate(count(), input_schema=INPUT, key_columns="key")
    table = ColumnarStates(FakeBackend(), job.descriptors, [_layout(a) for a in job.aggregations])
    rng = np.random.default_rng(7)
    bound = 2 ** 62 if key_type == "long" else 2 ** 31 - 1
    keys = np.unique(np.concatenate([rng.integers(-bound, bound, 300), [-1, 0, 1, 255, 256, -256]]))
    rows = table.rows(keys, rng.integers(0, 8, len(keys)).astype(np.int32))
    table.present[0][rows] = True
    table.mark(0, rows[::-1].copy())
    width, fmt = (8, "<i8") if key_type == "long" else (4, "<i4")
    for full in ([], [2, 5]):
        sections = table.capture(len(full) + 1, full)
        seen = 0
        for kg, (puts, deletes) in sections.items():
            assert not deletes
            (_, packed, _), = puts
            data = bytes(packed.data)
            off = np.asarray(packed.offsets)
            items = [data[off[i]:off[i + 1]] for i in range(len(off) - 1)]
            assert all(len(b) == width for b in items) and items == sorted(items), kg
            assert all(table.group[table._lookup(np.frombuffer(b"".join(items), fmt).astype(np.int64))] == kg)
            seen += len(items)
        assert seen == (len(keys) if not full else int(np.isin(table.group[rows], full).sum()))
        table.confirm(1)


def test_the_state_objects_read_and_write_the_columns():
    """``results()`` and ``clear()`` (a subclass's ``on_timer`` uses them) and the state objects the harness reads
    go through the columns' per-key stores."""
    from keygroups.aggregates import KeyedAggregate

    class ClearOnTimer(KeyedAggregate):
        def process_batch(self, records, runs, keys, select_key, context):
            out = super().process_batch(records, runs, keys, select_key, context)
            for i in range(len(keys)):
                select_key(i)
                context.timer_service.register_processing_time_timer(10)
            return out

        def on_timer(self, timestamp, context):
            row = (context.current_key, *self.results().values())
            self.clear()
            return [row]

    base = _job(emit="per_key")
    job = ClearOnTimer(base.aggregations, input_schema=INPUT, key_columns=("key",), emit="per_key")
    with KeyedFunctionHarness(job, "key", output_schema=job.output_schema, input_schema=INPUT) as h:
        h.process(_rows([{"key": 1, "amount": 3, "price": 2.0, "flag": True}], 0))
        assert h.state(1, "total") == 3
        h.advance_processing_time(10)
        assert h.output_table().to_pylist()[-1] == {"key": 1, "count": 1, "total": 3, "avg_price": 2.0,
                                                     "max_flag": True, "first_price": 2.0}
        assert h.state(1, "total") is None and h.state(1, "count") is None
        h.process(_rows([{"key": 1, "amount": 4, "price": None, "flag": False}], 1))
        assert h.output_table().to_pylist()[-1]["count"] == 1


def test_columns_go_back_to_the_backend_when_the_state_is_registered_the_ordinary_way():
    """A kept backend whose next function registers the aggregate's states as plain value states (another job
    version) takes the entries back from the columns: nothing is lost."""
    from keygroups.runtime.backends import create_backend
    from keygroups.aggregates.function import _layout

    job = _job()
    backend = create_backend("heap", KeyGroupRange(0, 7), 8, "long")
    layouts = [_layout(a) for a in job.aggregations]
    table = backend.bind_external_states(job.descriptors, lambda b: ColumnarStates(b, job.descriptors, layouts))
    assert table is not None
    states = [backend.get_state(d) for d in job.descriptors]
    for key in range(20):
        backend.set_current_key(key)
        states[0].update(key + 1)
        states[2].update((1.5 * key, key + 1))
    storage = CheckpointStorage(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"agg-release-{os.getpid()}"))
    backend.snapshot(1, storage).result()
    backend._forget_registrations()   # what resuming a kept backend for its next batch does
    from keygroups.state import ValueStateDescriptor
    plain = backend.get_state(ValueStateDescriptor("count", job.descriptors[0].serializers["value"]))
    for key in range(20):
        backend.set_current_key(key)
        assert plain.value() == key + 1
    assert sorted(backend.keys("avg_price")) == list(range(20))
    assert "count" not in backend._externals and "avg_price" not in backend._externals


# ---- kept heap backends across workers: caught up, moved ----------------------------------------------------------
W_INPUT = pa.schema([("key", pa.int64()), ("seq", pa.int64()), ("value", pa.int64())])
W_MP = 16


def _w_batch(location, job, records, parallelism, workers):
    import pickle

    import keygroups as kg
    from keygroups.runtime import begin_batch, commit_batch
    from keygroups.runtime.subtask import run_keyed_subtask

    storage = CheckpointStorage(location)
    plan = begin_batch(storage, job_name="agg", max_parallelism=W_MP, parallelism=parallelism)
    spec = plan.keyed_task(key_columns=("key",), function=pickle.dumps(job), input_schema=W_INPUT,
                           output_schema=job.output_schema, order_columns=("seq",), warm_heap_backends=4)
    table = pa.table({"key": [k for k, _ in records], "seq": list(range(len(records))),
                      "value": [v for _, v in records]}, schema=W_INPUT)
    owners = kg.assign_operators(table.column("key"), W_MP, parallelism)
    reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches(), warm=workers[i])
               for i in range(parallelism)]
    metadata = commit_batch(plan, reports)
    from keygroups._parquet import read_parquet
    rows = []
    for f in metadata.outputs:
        t = read_parquet(storage.read_bytes(f))
        rows += list(zip(*(t.column(c).to_pylist() for c in job.output_schema.names)))
    return [r.restored.mode for r in reports], sorted(rows)


def test_kept_backends_catch_up_and_move_with_their_columns(tmp_path):
    from keygroups.runtime.backends import create_backend
    from keygroups.runtime.subtask_state import HeapBackendRegistry
    from keygroups.state import ValueStateDescriptor
    from keygroups.serializers import Int64Serializer

    job = aggregate(count(), sum_of("value"), input_schema=W_INPUT, key_columns="key")
    location = str(tmp_path / "c")
    totals: dict[int, list[int]] = {}

    def expect(records):
        out = []
        for k, v in records:
            c, s = totals.get(k, [0, 0])
            totals[k] = [c + 1, s + v]
            out.append((k, c + 1, s + v))
        return sorted(out)

    def step(records, parallelism, workers, modes):
        got_modes, rows = _w_batch(location, job, records, parallelism, workers)
        assert rows == expect(records)
        assert got_modes == modes

    a, b = HeapBackendRegistry(), HeapBackendRegistry()
    step([(k, k) for k in range(200)], 2, [a, a], ["new", "new"])
    step([(k, 1) for k in range(0, 200, 7)], 2, [b, b], ["cold", "cold"])     # worker b writes newer blocks
    step([(k, 2) for k in range(0, 200, 3)], 2, [b, b], ["warm", "warm"])
    step([(k, 3) for k in range(1, 200, 5)], 2, [a, a], ["caught-up", "caught-up"])
    # 2 -> 3: the best global matching gives the second old range to subtask 2 (it shares more of it than subtask 1)
    step([(k, 4) for k in range(200)], 3, [a, a, a], ["moved", "cold", "moved"])
    step([(k, 5) for k in range(0, 200, 2)], 3, [a, a, a], ["warm", "warm", "warm"])
    # a cold restore of the latest checkpoint holds what the columns held
    storage = CheckpointStorage(location)
    backend = create_backend("heap", KeyGroupRange(0, W_MP - 1), W_MP, "long")
    backend.restore(storage, storage.latest())
    count_state = backend.get_state(ValueStateDescriptor("count", Int64Serializer()))
    sum_state = backend.get_state(ValueStateDescriptor("sum_value", Int64Serializer()))
    for k, (c, s) in totals.items():
        backend.set_current_key(k)
        assert (count_state.value(), sum_state.value()) == (c, s)
