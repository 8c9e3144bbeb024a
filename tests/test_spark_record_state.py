"""Record state through Spark, classic and Connect: ``spark.read.format("keygroups")`` returns it as struct columns
that SQL queries by nested field, and ``write_savepoint`` takes a struct column for it."""

from __future__ import annotations

import sys

import pytest
from pyspark import cloudpickle

import keygroups.spark as kspark
from keygroups.serializers import RecordSerializer
from keygroups.spark import StateColumn, write_savepoint
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
