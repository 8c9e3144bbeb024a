"""Record state through Spark, classic and Connect: ``spark.read.format("keygroups")`` returns it as struct columns
that SQL queries by nested field, and ``write_savepoint`` takes a struct column for it; a job whose record schema
changes while Spark's workers keep its heap state warm; Spark DDL's DEFAULT."""

from __future__ import annotations

import sys

import pytest
from pyspark import cloudpickle

import keygroups.spark as kspark
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import RecordSerializer, resolve_compatibility
from keygroups.spark import KeyedJob, StateColumn, write_savepoint
from keygroups.state import ValueStateDescriptor
from test_record_state_io import Session, as_row, session, written_by_backend

pytestmark = pytest.mark.spark
cloudpickle.register_pickle_by_value(sys.modules[__name__])



@pytest.fixture
def registered(any_spark):
    kspark.register()
    return any_spark


def test_record_state_is_queried_by_nested_field_with_sql(registered, tmp_path):
    spark = registered
    written_by_backend(tmp_path)
    df = spark.read.format("keygroups").option("state", "session").load(str(tmp_path))
    value = df.schema["value"].dataType
    assert [f.name for f in value.fields] == ["user", "started", "pages", "lines", "closed"]
    df.createOrReplaceTempView("sessions")
    rows = spark.sql("SELECT key, value.user AS user, value.lines['sku'].quantity AS quantity, "
                     "value.lines['sku'].price AS price FROM sessions WHERE value.pages[0] = 'p3' "
                     "OR value.closed IS NOT NULL AND key < 4").collect()
    got = sorted((r["key"], r["user"], r["quantity"], r["price"]) for r in rows)
    assert got == sorted((i, f"u{i}", i, session(i).lines["sku"].price) for i in (1, 3))
    spark.catalog.dropTempView("sessions")


def test_write_savepoint_takes_a_struct_column(registered, tmp_path):
    spark = registered
    src = tmp_path / "src"
    written_by_backend(src)
    df = (spark.read.format("keygroups").option("state", "session").load(str(src))
          .withColumnRenamed("key", "user_id").withColumnRenamed("value", "session").drop("key_group"))
    write_savepoint(df, str(tmp_path / "dst"), "boot", key_columns="user_id", max_parallelism=16, parallelism=2,
                    states={"session": StateColumn("session", serializer=RecordSerializer(Session, form="dict"))})
    back = (spark.read.format("keygroups").option("state", "session").option("savepoint", "boot")
            .load(str(tmp_path / "dst")).collect())
    by_key = {r["user_id"]: r["value"].asDict(recursive=True) for r in back}
    expected = {i: as_row(session(i)) for i in range(20)}
    for row in expected.values():
        row["lines"] = dict(row["lines"])
        row["lines"]["sku"] = dict(row["lines"]["sku"])
    for v in by_key.values():
        v["started"] = v["started"].replace(tzinfo=None)
    for v in expected.values():
        v["started"] = v["started"].replace(tzinfo=None)
    assert by_key == expected


def test_row_records_take_a_struct_type_and_give_rows():
    import pickle

    from pyspark.sql import Row
    from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType

    from keygroups.spark import row_records

    schema = StructType([StructField("user", StringType(), False),
                         StructField("visits", ArrayType(StructType([StructField("page", StringType()),
                                                                     StructField("ms", LongType())])))])
    ser = row_records(schema)
    assert ser.schema.field("user").nullable is False
    row = Row(user="ann", visits=[Row(page="home", ms=5)])
    back = pickle.loads(pickle.dumps(ser)).deserialize(ser.serialize(row))
    assert back == row and isinstance(back, Row) and isinstance(back.visits[0], Row)
    assert back.visits[0].page == "home"
    assert ser.deserialize(ser.serialize({"user": "bo", "visits": None})) == Row(user="bo", visits=None)


class KeepRecord(KeyedProcessFunction):
    """One record per key (``op`` 'set' stores {a: v, b: 10 v, c: 100 v} in the fields the schema has; 'get' emits
    the stored fields), values as tuples: a change of schema that is not applied to a value shows as swapped or
    failing fields."""

    def __init__(self, ddl: str) -> None:
        self.serializer = RecordSerializer(ddl, form="tuple")

    def open(self, context):
        self.state = context.get_state(ValueStateDescriptor("rec", self.serializer))

    def process_element(self, record, context):
        names = self.serializer.schema.names
        v = record["v"]
        if record["op"] == "set":
            full = {"a": v, "b": 10 * v, "c": 100 * v}
            self.state.update(tuple(full[n] for n in names))
            return None
        stored = dict(zip(names, self.state.value()))
        return [(context.current_key, stored.get("a"), stored.get("b"), stored.get("c"), context.checkpoint_id)]


def test_a_new_job_with_another_record_schema_on_warm_heap_state(spark, tmp_path):
    """Issue 31's probe: a new KeyedJob (same name and location) whose record schema reordered the fields, while
    Spark's Python workers keep the heap backends of the old job warm. Every key, touched by the new job's batches or
    not, reads as a cold restore reads it."""
    output = "k long, a long, b long, c long, batch long"
    location = str(tmp_path / "chk")

    def job(ddl: str) -> KeyedJob:
        return KeyedJob("records", "k", KeepRecord(ddl), output_schema=output, max_parallelism=16,
                        checkpoint_location=location)

    def run(j: KeyedJob, rows: list[tuple[int, str, int]]) -> tuple[list[tuple], list[str]]:
        result = j.run_batch(spark.createDataFrame(rows, "k long, op string, v long"), parallelism=1)
        return sorted(tuple(r)[:4] for r in result.output.collect()), [r.restored.mode for r in result.reports]

    keys = range(30)
    old = job("a bigint not null, b bigint not null, c bigint")
    run(old, [(k, "set", k) for k in keys])
    modes = []
    for _ in range(2):   # both of Spark's Python workers hold the old job's state, decoded
        got, m = run(old, [(k, "get", 0) for k in keys])
        modes += m
        assert got == [(k, k, 10 * k, 100 * k) for k in keys]
    # reordered: values the new serializer took in the old order would come out swapped, silently (a dropped field
    # failed the first attempt instead, and Spark's retry restored cold)
    new = job("c bigint, b bigint not null, a bigint not null")
    for part in (keys[::2], keys[1::2], keys):
        got, m = run(new, [(k, "get", 0) for k in part])
        modes += m
        assert got == [(k, k, 10 * k, 100 * k) for k in part]
    assert {"warm", "caught-up"} & set(modes), modes   # the kept backends were resumed


def test_spark_column_defaults_give_record_fields_their_default(spark, tmp_path):
    """A table's column defaults (Spark 4 DDL: ``b STRING DEFAULT 'x'``) are in its schema's field metadata; a record
    serializer of that schema gives the fields those defaults, as the same DDL string does."""
    ddl = "a INT, b STRING DEFAULT 'x', c BIGINT NOT NULL DEFAULT 5"
    spark.sql(f"CREATE TABLE kg_defaults ({ddl}) USING parquet LOCATION '{tmp_path / 'table'}'")
    try:
        schema = spark.table("kg_defaults").schema
    finally:
        spark.sql("DROP TABLE kg_defaults")
    for ser in (RecordSerializer(schema), RecordSerializer(ddl)):
        assert (ser.schema.field("b").default, ser.schema.field("c").default) == ("x", 5)
        old = RecordSerializer("a int")
        _, reader = resolve_compatibility("s", old.snapshot(), ser)
        assert reader.deserialize(old.serialize({"a": 1})) == {"a": 1, "b": "x", "c": 5}
