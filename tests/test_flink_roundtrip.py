"""Flink -> keygroups -> Flink: a savepoint written by a real Flink 2.3 job is imported, exported again, and restored
by Flink (tests/flink/SavepointJob.java ``check``) at another parallelism, which compares every key, timer and
operator-state element with what the first job wrote; also after a keygroups job rescaled and changed the state."""

from __future__ import annotations

import pathlib
import shutil
import sys

import pyarrow as pa
import pytest
from pyspark import cloudpickle

import flink_harness
from flink_canonical import savepoint_lines
from flink_harness import FIXTURE_SET, FIXTURES, check_savepoint
from keygroups.cli import main
from keygroups.flink import UnsupportedFlinkTypeError, read_savepoint
from keygroups.flink.exporter import export_savepoint
from keygroups.flink.importer import import_savepoint
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import Int64Serializer, ValueSerializer
from keygroups.state import ValueStateDescriptor

cloudpickle.register_pickle_by_value(sys.modules[__name__])

needs_flink = pytest.mark.skipif(flink_harness.flink_lib() is None, reason=flink_harness.missing_reason())


def _expected(name: str) -> pathlib.Path:
    """What the Flink job wrote: every state, Row included (keygroups holds it as a record)."""
    return FIXTURES / name / "expected.txt"


CASES = [  # fixture, parallelism Flink restores at, Snappy on the way back
    ("p2-mp128-long-hashmap-inline-plain", 3, False),
    ("p3-mp256-string-rocksdb-files-snappy", 2, True),
    ("p2-mp4096-long-rocksdb-inline-plain", 5, False),
    ("p2-mp128-tuple-hashmap-files-plain", 3, True),
]


@pytest.mark.parametrize("name,parallelism,compression", CASES)
def test_exported_savepoint_rereads_equal_without_flink(tmp_path, name, parallelism, compression):
    src = FIXTURES / name / "savepoint"
    import_savepoint(src, str(tmp_path / "loc"), "sp", uid="keyed", field_names={"row": ["id", "label"]})
    export_savepoint(str(tmp_path / "loc"), tmp_path / "flink", uid="keyed", savepoint="sp", like=src,
                     compression=compression)
    expected = _expected(name)
    assert any("\trow\t" in ln for ln in expected.read_text(encoding="utf-8").splitlines())
    assert savepoint_lines(read_savepoint(tmp_path / "flink")) == \
        sorted(expected.read_text(encoding="utf-8").splitlines())


@pytest.mark.flink
@needs_flink
@pytest.mark.parametrize("name,parallelism,compression", CASES)
def test_flink_restores_the_round_trip_exactly(tmp_path, name, parallelism, compression):
    fixture = next(f for f in FIXTURE_SET if f.name == name)
    src = FIXTURES / name / "savepoint"
    assert main(["flink", "import", str(src), str(tmp_path / "loc"), "--name", "sp", "--uid", "keyed"]) == 0
    args = ["flink", "export", str(tmp_path / "loc"), str(tmp_path / "flink"), "--savepoint", "sp", "--uid", "keyed",
            "--like", str(src)] + (["--compression"] if compression else [])
    assert main(args) == 0
    ok, report = check_savepoint(tmp_path / "flink", parallelism, fixture.key_type,
                                 _expected(name), tmp_path / "dump")
    assert ok, report


class AddOne(KeyedProcessFunction):
    """Adds the record's v to the imported Flink state 'long' of its key."""

    def open(self, context):
        self.long = context.get_state(ValueStateDescriptor("long", Int64Serializer()))

    def process_element(self, record, context):
        value = self.long.value()
        if value is not None:
            self.long.update(value + record["v"])
        return [(context.current_key,)]


@pytest.mark.spark
@pytest.mark.flink
@needs_flink
def test_round_trip_after_a_keygroups_job_rescaled_and_changed_the_state(spark, tmp_path):
    from keygroups.spark import KeyedJob

    name = "p2-mp128-long-hashmap-inline-plain"
    src = FIXTURES / name / "savepoint"
    location = str(tmp_path / "loc")
    import_savepoint(src, location, "sp", uid="keyed")
    expected = _expected(name).read_text(encoding="utf-8").splitlines()
    keys = sorted({int(ln.split("\t")[2]) for ln in expected if ln.startswith("keyed\tlong\t")})
    job = KeyedJob("moved", "k", AddOne(), output_schema=pa.schema([("k", pa.int64())]), max_parallelism=128,
                   checkpoint_location=location, restore_from_savepoint="sp")
    job.run_batch(spark.createDataFrame([(k, 5) for k in keys], "k long, v long"), parallelism=3)
    job.run_batch(spark.createDataFrame([(k, 2) for k in keys[::2]], "k long, v long"), parallelism=1)
    changed = []
    bump = {k: 5 + (2 if i % 2 == 0 else 0) for i, k in enumerate(keys)}
    # AddOne registers no operator state, so the job's first snapshot drops the imported one, as Flink would
    for ln in (ln for ln in expected if ln.startswith(("keyed\t", "timer\t"))):
        parts = ln.split("\t")
        if parts[:2] == ["keyed", "long"]:
            parts[3] = str(int(parts[3]) + bump[int(parts[2])])
        changed.append("\t".join(parts))
    (tmp_path / "changed.txt").write_text("\n".join(changed) + "\n", encoding="utf-8")
    export_savepoint(location, tmp_path / "flink", uid="keyed", like=src)     # the latest checkpoint
    ok, report = check_savepoint(tmp_path / "flink", 2, "long", tmp_path / "changed.txt", tmp_path / "dump")
    assert ok, report


def test_states_flink_cannot_hold_are_refused_by_name(tmp_path):
    from keygroups.runtime.state_writer import StateColumn, commit_savepoint, plan_savepoint, write_savepoint_subtask

    ser = ValueSerializer()
    batch = pa.record_batch({"k": pa.array([1, 2], pa.int64()),
                             "v": pa.array([ser.serialize({"a": 1}), ser.serialize([1, 2])], pa.binary()),
                             "n": pa.array([10, 20], pa.int64())})
    plan = plan_savepoint(batch.schema, str(tmp_path / "loc"), "sp", key_columns="k",
                          states={"json": StateColumn("v", serializer=ser), "n": "n"}, max_parallelism=128,
                          parallelism=1)
    commit_savepoint(plan, [write_savepoint_subtask(plan, 0, [batch])])
    with pytest.raises(UnsupportedFlinkTypeError, match="state 'json'.*ValueSerializer.*skip"):
        export_savepoint(str(tmp_path / "loc"), tmp_path / "out", uid="op", savepoint="sp")
    assert not (tmp_path / "out" / "_metadata").exists()
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    report = export_savepoint(str(tmp_path / "loc"), tmp_path / "out", uid="op", savepoint="sp", skip_states=["json"])
    assert report.keyed_states == ("n",) and report.entries == 2
    sp = read_savepoint(tmp_path / "out")
    assert sorted(e[2] for kg in sp.key_groups("op") for e in kg.entries["n"]) == [10, 20]


@pytest.mark.flink
@needs_flink
def test_a_savepoint_flink_writes_now_reads_equal_to_what_it_holds(tmp_path):
    """Beyond the committed fixtures: Flink writes one now (3 subtasks, max parallelism 1000, Snappy, heap, files)
    and the reader lists exactly what the job says it holds."""
    fixture = flink_harness.Fixture(3, 1000, True, 60, "string", "hashmap", False)
    savepoint = flink_harness.write_savepoint(tmp_path / "out", fixture)
    expected = sorted((tmp_path / "out" / "expected.txt").read_text(encoding="utf-8").splitlines())
    assert savepoint_lines(read_savepoint(savepoint)) == expected


@pytest.mark.flink
@needs_flink
def test_a_wide_row_goes_flink_to_spark_records_and_back_exactly(tmp_path):
    """Flink writes a savepoint now with 40 keys of `row_wide` (a Row of 13 fields, every type a Row maps, nulls, a
    nested Tuple and Row; the committed fixtures hold 17, from RocksDB too); it imports as a record with named
    fields, exports with like= and Flink restores every value exactly, at another parallelism."""
    from keygroups.checkpoint import CheckpointStorage
    from keygroups.runtime.state_reader import KeyedStateReader, load_restore_point

    fixture = flink_harness.Fixture(2, 128, False, 40, "long", "rocksdb", False)
    savepoint = flink_harness.write_savepoint(tmp_path / "out", fixture)
    expected = tmp_path / "out" / "expected.txt"
    wide = [ln for ln in expected.read_text(encoding="utf-8").splitlines() if ln.startswith("keyed\trow_wide\t")]
    assert len(wide) > 20 and any(",null," in ln for ln in wide)
    names = ["i", "s", "b", "f", "d", "flag", "c", "text", "raw", "longs", "counts", "pair", "inner"]
    import_savepoint(savepoint, str(tmp_path / "loc"), "sp", uid="keyed", field_names={"row_wide": names})
    storage = CheckpointStorage(str(tmp_path / "loc"))
    reader = KeyedStateReader(storage, load_restore_point(storage, savepoint="sp"), "row_wide")
    value_type = reader.schema.field("value").type
    assert [value_type.field(i).name for i in range(value_type.num_fields)] == names
    assert str(value_type.field("s").type) == "int16" and str(value_type.field("f").type) == "float"
    export_savepoint(str(tmp_path / "loc"), tmp_path / "flink", uid="keyed", savepoint="sp", like=savepoint)
    assert savepoint_lines(read_savepoint(tmp_path / "flink")) == \
        sorted(expected.read_text(encoding="utf-8").splitlines())
    ok, report = check_savepoint(tmp_path / "flink", 3, "long", expected, tmp_path / "dump")
    assert ok, report


def test_a_record_value_flink_cannot_hold_is_refused_naming_state_and_key(tmp_path):
    """A record's nullable array<bigint> exports as Flink's List<Long>, whose elements cannot be null: the export
    names the state, the key and the value, and leaves no _metadata behind."""
    from keygroups.runtime.state_writer import StateColumn, commit_savepoint, plan_savepoint, write_savepoint_subtask
    from keygroups.serializers import RecordSerializer

    ser = RecordSerializer("id bigint, tags array<bigint>")
    batch = pa.record_batch({"k": pa.array([1, 2], pa.int64()),
                             "r": pa.array([{"id": 1, "tags": [1, None]}, {"id": 2, "tags": [3]}],
                                           pa.struct([("id", pa.int64()), ("tags", pa.list_(pa.int64()))]))})
    plan = plan_savepoint(batch.schema, str(tmp_path / "loc"), "sp", key_columns="k",
                          states={"r": StateColumn("r", serializer=ser)}, max_parallelism=128, parallelism=1)
    commit_savepoint(plan, [write_savepoint_subtask(plan, 0, [batch])])
    with pytest.raises(UnsupportedFlinkTypeError, match="state 'r', key 1: Flink's Row.*cannot hold the value"):
        export_savepoint(str(tmp_path / "loc"), tmp_path / "out", uid="op", savepoint="sp")
    assert not (tmp_path / "out" / "_metadata").exists()
