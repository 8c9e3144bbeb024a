"""Record evolution as a job meets it, through the test harness (``KeyedFunctionHarness``: the subtask code a job
runs, a fresh unpickled function every batch): state written with one schema, a savepoint, the job restarted from it
with a new version of its function at another parallelism and on either backend, whose schema swaps two fields
through aliases, renames a field away and reuses its name, adds fields with DDL defaults, widens and turns binary into
string. The new version reads every key as Avro's rules say, keeps doing so batch after batch (an alias is applied
once), and a change the rules refuse stops the first batch with ``StateMigrationError`` naming state and field."""

from __future__ import annotations

import json

import pytest

from keygroups.errors import StateMigrationError
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import RecordSerializer
from keygroups.serializers.schema import BINARY, INT64, STRING, Field, RecordType
from keygroups.serializers.schema_formats import parse_ddl
from keygroups.state import ValueStateDescriptor
from keygroups.testing import KeyedFunctionHarness

V1 = "a bigint not null, b bigint not null, old_name string, blob binary, small int not null"


def v2_schema() -> RecordType:
    extra = parse_ddl("region string not null default 'eu', since date default DATE'2024-01-01'")
    return RecordType((
        Field("a", INT64, False, aliases=("b",)),           # a and b swap
        Field("b", INT64, False, aliases=("a",)),
        Field("new_name", STRING, True, aliases=("old_name",)),
        Field("old_name", STRING, False, default="reused"),  # the old name, free again
        Field("blob", STRING, True),                         # binary -> string
        Field("small", INT64, False),                        # int -> bigint
        *extra.fields,
    ))


class Profile(KeyedProcessFunction):
    """``set`` stores the record the input describes; ``get`` emits the stored record as JSON."""

    def __init__(self, schema: object) -> None:
        self.serializer = RecordSerializer(schema)

    def open(self, context):
        self.state = context.get_state(ValueStateDescriptor("profile", self.serializer))

    def process_element(self, record, context):
        k = record["k"]
        if record["op"] == "set":
            self.state.update({"a": k, "b": -k, "old_name": f"n{k}", "blob": f"é{k}".encode(), "small": k * 3})
            return None
        value = self.state.value()
        return [(k, json.dumps(value, sort_keys=True, default=str))]


def expected_v2(k: int) -> dict:
    return {"a": -k, "b": k, "new_name": f"n{k}", "old_name": "reused", "blob": f"é{k}", "small": k * 3,
            "region": "eu", "since": "2024-01-01"}


KEYS = range(24)
OUTPUT = "k long, value string"
INPUT = "k long, op string"


def gets(keys) -> list[dict]:
    return [{"k": k, "op": "get"} for k in keys]


@pytest.mark.parametrize("backend, parallelism", [("heap", 3), ("rocksdb", 2)])
def test_a_new_version_reads_the_savepoint_by_avro_s_rules_batch_after_batch(backend, parallelism):
    with KeyedFunctionHarness(Profile(V1), "k", output_schema=OUTPUT, input_schema=INPUT, max_parallelism=16,
                              parallelism=2) as h1:
        h1.process([{"k": k, "op": "set"} for k in KEYS])
        snapshot = h1.snapshot()
        h2 = h1.restore(snapshot, parallelism=parallelism, backend=backend, function=Profile(v2_schema()))
        for part in (KEYS[::2], KEYS[1::2], KEYS):   # each batch restores (or resumes) what the one before wrote
            h2.process(gets(part))
            assert sorted((r["k"], json.loads(r["value"])) for r in h2.output()) == [
                (k, expected_v2(k)) for k in part]
        # a savepoint of the new version, restored by the same version elsewhere: read as it is
        h3 = h2.restore(h2.snapshot(), parallelism=1, backend="heap" if backend == "rocksdb" else "rocksdb")
        h3.process(gets(KEYS))
        assert sorted((r["k"], json.loads(r["value"])) for r in h3.output()) == [(k, expected_v2(k)) for k in KEYS]


@pytest.mark.parametrize("schema, field", [
    ("a bigint not null, b bigint not null, old_name string, blob binary, small int not null, "
     "must bigint not null", "must"),
    ("a int not null, b bigint not null, old_name string, blob binary, small int not null", "a"),
    (RecordType((Field("b", INT64, False, aliases=("a",)), Field("old_name", STRING), Field("blob", BINARY),
                 Field("small", INT64, False))), "b"),
])
def test_a_refused_change_stops_the_first_batch_naming_state_and_field(schema, field):
    with KeyedFunctionHarness(Profile(V1), "k", output_schema=OUTPUT, input_schema=INPUT, max_parallelism=16) as h1:
        h1.process([{"k": k, "op": "set"} for k in KEYS])
        h2 = h1.restore(h1.snapshot(), parallelism=2, function=Profile(schema))
        with pytest.raises(StateMigrationError) as info:
            h2.process(gets(KEYS))
        assert "State 'profile'" in str(info.value) and f"field {field!r}" in str(info.value)
