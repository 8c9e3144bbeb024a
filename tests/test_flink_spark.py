"""A Flink 2.3 savepoint imported into keygroups is continued by a KeyedJob on Spark at another parallelism: every
key finds the state Flink held, and changes it."""

from __future__ import annotations

import sys

import pyarrow as pa
import pytest
from pyspark import cloudpickle

from flink_harness import FIXTURES
from keygroups.flink import read_savepoint
from keygroups.flink.importer import import_savepoint
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import Int64Serializer, RecordSerializer, StrSerializer
from keygroups.spark import KeyedJob
from keygroups.state import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor

cloudpickle.register_pickle_by_value(sys.modules[__name__])

OUT = pa.schema([("k", pa.int64()), ("long", pa.int64()), ("list", pa.int64()), ("map_a", pa.int64()),
                 ("label", pa.string())])


class ContinueFlinkState(KeyedProcessFunction):
    """Reads the imported Flink states of each key, emits them, and adds the record's v to 'long'; the Flink Row
    state 'row' is a record state, declared with the field names it was imported with."""

    def open(self, context):
        self.long = context.get_state(ValueStateDescriptor("long", Int64Serializer()))
        self.list = context.get_list_state(ListStateDescriptor("list", Int64Serializer()))
        self.map = context.get_map_state(MapStateDescriptor("map", StrSerializer(), Int64Serializer()))
        self.row = context.get_state(ValueStateDescriptor("row", RecordSerializer("id bigint, label string")))

    def process_element(self, record, context):
        value = self.long.value()
        if value is not None:
            self.long.update(value + record["v"])
        row = self.row.value()
        if row is not None and row["label"] is None:
            self.row.update({"id": row["id"], "label": "filled"})
        return [(context.current_key, value, sum(self.list.get() or []), self.map.get("a"),
                 None if row is None else row["label"])]


@pytest.mark.spark
def test_keyed_job_continues_an_imported_flink_savepoint_at_another_parallelism(spark, tmp_path):
    src = FIXTURES / "p2-mp128-long-hashmap-inline-plain" / "savepoint"
    sp = read_savepoint(src)
    flink = {}
    for kg in sp.key_groups("keyed", {"long", "list", "map"}):
        for state, entries in kg.entries.items():
            for e in entries:
                slot = flink.setdefault(e[0], {"long": None, "list": 0, "map_a": None})
                if state == "map":
                    if e[2] == "a":
                        slot["map_a"] = e[3]
                else:
                    slot[state] = e[2] if state == "long" else sum(e[2])
    location = str(tmp_path / "chk")
    import_savepoint(sp, location, "from-flink", uid="keyed", field_names={"row": ["id", "label"]})
    from keygroups.spark import state_source

    state_source.register(spark)
    read = spark.read.format("keygroups").option("savepoint", "from-flink")
    assert {r["key"]: r["value"] for r in read.option("state", "long").load(location).collect()} == \
        {k: v["long"] for k, v in flink.items() if v["long"] is not None}
    rows = read.option("state", "row").load(location)      # Flink's Row: a struct column of the named fields
    assert rows.schema["value"].dataType.simpleString() == "struct<id:bigint,label:string>"
    flink_rows = {e[0]: e[2] for kg in sp.key_groups("keyed", {"row"}) for e in kg.entries["row"]}
    assert {r["key"]: (r["id"], r["label"]) for r in rows.select("key", "value.id", "value.label").collect()} == \
        flink_rows
    assert rows.where("value.label is null").count() == sum(v[1] is None for v in flink_rows.values()) > 0
    assert read.option("view", "timers").load(location).count() == \
        sum(len(e) for kg in sp.key_groups("keyed", {"_timer_state/event_user-timers",
                                                     "_timer_state/processing_user-timers"})
            for e in kg.entries.values())
    job = KeyedJob("continued", "k", ContinueFlinkState(), output_schema=OUT, max_parallelism=128,
                   checkpoint_location=location, restore_from_savepoint="from-flink")
    keys = sorted(flink)
    out = job.run_batch(spark.createDataFrame([(k, 1) for k in keys], "k long, v long"), parallelism=3).output
    got = {r["k"]: {"long": r["long"], "list": r["list"], "map_a": r["map_a"]} for r in out.collect()}
    assert got == flink
    assert {r["k"]: r["label"] for r in out.collect()} == {k: flink_rows[k][1] if k in flink_rows else None
                                                          for k in keys}
    out = job.run_batch(spark.createDataFrame([(k, 1) for k in keys], "k long, v long"), parallelism=1).output
    assert {r["k"]: r["long"] for r in out.collect()} == \
        {k: (v["long"] + 1 if v["long"] is not None else None) for k, v in flink.items()}
    assert {r["k"]: r["label"] for r in out.collect()} == \
        {k: (flink_rows[k][1] or "filled") if k in flink_rows else None for k in keys}
