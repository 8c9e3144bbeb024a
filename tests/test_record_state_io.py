"""Record state typed all the way out, without Spark: the state reader returns it as struct columns (nested, named,
typed), the savepoint writer takes struct columns for it, ``keygroups inspect`` prints its schema, and a job's
record state written by the writer restores into a backend as the job's dataclasses."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
from typing import Annotated, Optional

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups import assign_to_key_group, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.runtime.state_reader import KeyedStateReader, metadata_table
from keygroups.runtime.state_writer import StateColumn, commit_savepoint, plan_savepoint, write_savepoint_subtask
from keygroups.serializers import Int64Serializer, RecordSerializer, StrSerializer
from keygroups.serializers.schema import INT32, DecimalType
from keygroups.state import HeapKeyedStateBackend, MapStateDescriptor, ValueStateDescriptor
from record_strategies import record_types, values_of

MAXP = 16
UTC = dt.timezone.utc


@dataclasses.dataclass
class Line:
    quantity: Annotated[int, INT32]
    price: Annotated[decimal.Decimal, DecimalType(10, 2)]


@dataclasses.dataclass
class Session:
    user: str
    started: dt.datetime
    pages: list[str]
    lines: dict[str, Line]
    closed: Optional[dt.date] = None


def session(i: int) -> Session:
    return Session(f"u{i}", dt.datetime(2024, 1, 1, tzinfo=UTC) + dt.timedelta(minutes=i), [f"p{i}", "home"],
                   {"sku": Line(i, decimal.Decimal(i) / 4)}, dt.date(2024, 2, 1) if i % 2 else None)


def as_row(s: Session) -> dict:
    d = dataclasses.asdict(s)
    d["lines"] = [(k, v) for k, v in d["lines"].items()]   # Arrow's form of a map
    return d


def written_by_backend(tmp_path) -> tuple[CheckpointStorage, CheckpointMetadata]:
    storage = CheckpointStorage(tmp_path)
    be = HeapKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer())
    value = be.get_state(ValueStateDescriptor("session", RecordSerializer(Session)))
    lines = be.get_state(MapStateDescriptor("lines", StrSerializer(), RecordSerializer(Line)))
    for i in range(20):
        be.set_current_key(i)
        value.update(session(i))
        lines.put("a", Line(i, decimal.Decimal("0.25")))
    handle = be.snapshot(1, storage).result(30)
    be.dispose()
    storage.commit(CheckpointMetadata(checkpoint_id=1, job_id="records", timestamp_ms=0, max_parallelism=MAXP,
                                      parallelism=1, keyed_handles=[handle], operator_handles=[], properties={}))
    return storage, storage.load(1)


def test_reader_returns_record_state_as_named_struct_columns(tmp_path):
    storage, md = written_by_backend(tmp_path)
    reader = KeyedStateReader(storage, md, "session")
    value_type = reader.schema.field("value").type
    assert pa.types.is_struct(value_type)
    assert [value_type.field(i).name for i in range(value_type.num_fields)] == ["user", "started", "pages", "lines",
                                                                               "closed"]
    assert value_type.field("started").type == pa.timestamp("us", tz="UTC")
    assert value_type.field("user").nullable is False and value_type.field("closed").nullable is True
    assert value_type.field("lines").type.item_type.field("price").type == pa.decimal128(10, 2)
    table = pa.Table.from_batches(list(reader.read(key_group_range(MAXP, 1, 0))))
    rows = {r["key"]: r["value"] for r in table.to_pylist()}
    assert rows == {i: as_row(session(i)) for i in range(20)}
    flat = KeyedStateReader(storage, md, "lines", flatten=True)
    flat_rows = pa.Table.from_batches(list(flat.read(key_group_range(MAXP, 1, 0)))).to_pylist()
    assert sorted((r["key"], r["map_key"], r["value"]["quantity"]) for r in flat_rows) == [(i, "a", i)
                                                                                            for i in range(20)]
    described = [pair for row in metadata_table(storage, md).column("serializers").to_pylist() for pair in row]
    assert ("value", "RecordSerializer('user string not null, started timestamp not null, pages array<string not "
                     "null> not null, lines map<string, struct<quantity int not null, price decimal(10,2) not null> "
                     "not null> not null, closed date')") in described


def test_writer_takes_struct_columns_and_the_job_reads_its_dataclasses(tmp_path):
    storage, md = written_by_backend(tmp_path / "src")
    table = pa.Table.from_batches(list(KeyedStateReader(storage, md, "session").read(key_group_range(MAXP, 1, 0))))
    table = table.select(["key", "value"]).rename_columns(["user_id", "session"])
    plan = plan_savepoint(table.schema, str(tmp_path / "dst"), "boot", key_columns="user_id",
                          states={"session": StateColumn("session", serializer=RecordSerializer(Session))},
                          max_parallelism=MAXP, parallelism=2)
    keys = table.column("user_id").to_pylist()
    handles = []
    for subtask in range(2):
        groups = key_group_range(MAXP, 2, subtask)
        mine = [i for i, k in enumerate(keys) if assign_to_key_group(k, MAXP) in groups]
        handles.append(write_savepoint_subtask(plan, subtask, table.take(pa.array(mine, pa.int64())).to_batches()))
    commit_savepoint(plan, handles)
    dst = CheckpointStorage(str(tmp_path / "dst"))
    be = HeapKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer())
    be.restore(dst, dst.load_savepoint("boot"))
    state = be.get_state(ValueStateDescriptor("session", RecordSerializer(Session)))
    for i in range(20):
        be.set_current_key(i)
        assert state.value() == session(i)


def test_inspect_prints_record_schemas(tmp_path, capsys):
    from keygroups.cli import main

    written_by_backend(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "  lines map value: record<quantity int not null, price decimal(10,2) not null>" in out
    assert "  session value: record<user string not null, started timestamp not null" in out


def test_operator_state_of_records_reads_as_struct_rows(tmp_path):
    from keygroups.checkpoint import SerializedState, write_operator_snapshot
    from keygroups.checkpoint.metadata import DistributionMode
    from keygroups.runtime.state_reader import operator_state_table

    storage = CheckpointStorage(str(tmp_path))
    ser = RecordSerializer("partition int not null, offset bigint not null, seen timestamp")
    positions = [{"partition": p, "offset": 10 * p, "seen": None if p else dt.datetime(2024, 1, 1, tzinfo=UTC)}
                 for p in range(3)]
    data, offsets = ser.serialize_many(positions)
    handle = write_operator_snapshot(storage, storage.new_file(1, "operator-0"), [
        SerializedState("positions", DistributionMode.SPLIT_DISTRIBUTE, {"serializer": ser.snapshot().to_json()},
                        data, offsets)], subtask=0, operator_id="source")
    storage.commit(CheckpointMetadata(1, "j", 0, MAXP, 1, [], [handle]))
    table = operator_state_table(storage, storage.load(1), "positions")
    assert pa.types.is_struct(table.schema.field("value").type)
    assert table.column("value").to_pylist() == positions


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_records_cross_arrow_both_ways_unchanged(data):
    from keygroups.runtime.state_types import arrow_type, python_values, reading_serializer

    schema = data.draw(record_types())
    ser = RecordSerializer(schema)
    values = data.draw(st.lists(st.one_of(st.none(), values_of(schema)), max_size=4))
    snapshot = ser.snapshot()
    reader = reading_serializer(snapshot)
    decoded = [None if v is None else reader.deserialize(ser.serialize(v)) for v in values]
    column = pa.array(decoded, type=arrow_type(snapshot))     # what the state reader builds
    back = python_values(column, snapshot)                     # what the savepoint writer encodes
    assert back == values
    assert [None if v is None else ser.deserialize(ser.serialize(v)) for v in back] == values
