"""The partitioned-log source: framing, the writer, and FLIP-8's Kafka-source plan on real files."""

from __future__ import annotations

import os
from collections import Counter

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.errors import CorruptLogError, CorruptSnapshotError
from keygroups.sources import (
    HEADER_SIZE,
    OFFSETS_STATE_NAME,
    PartitionedLogReader,
    PartitionedLogSource,
    PartitionedLogWriter,
    write_partitioned_log,
)
from keygroups.serializers import StrSerializer
from keygroups.state import ListStateDescriptor, OperatorStateStore, checkpoint_function, initialize_function


def records(partition: int, n: int, start: int = 0) -> list[dict]:
    return [{"p": partition, "seq": i, "text": "é" * (i % 5), "nested": {"i": [i]}} for i in range(start, n)]


# ---- framing ----------------------------------------------------------------------------------------------------


def test_read_returns_records_offsets_and_the_resume_point(tmp_path):
    src = write_partitioned_log(tmp_path / "log", {0: records(0, 5), 2: records(2, 3)})
    assert src.partitions == [0, 2]
    head = src.read(0, max_records=2)
    assert head.records() == records(0, 2)
    assert head.offsets[0] == HEADER_SIZE and len(head) == 2
    rest = src.read(0, head.next_offset)
    assert rest.records() == records(0, 5, start=2)
    assert rest.next_offset == src.end_offset(0)
    assert len(src.read(0, rest.next_offset)) == 0
    assert src.read(0, head.offsets[1], max_records=1).records() == [records(0, 2)[1]]
    assert list(src.iter_records(2)) == records(2, 3)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=8)
                    | st.floats(allow_nan=False, allow_infinity=False),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                max_size=3), max_leaves=6)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.dictionaries(st.text(max_size=5), JSON, max_size=4), max_size=25),
       st.lists(st.integers(0, 6), min_size=1, max_size=10))
def test_reading_in_bounded_steps_returns_every_record_once_in_order(batch, steps):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src = write_partitioned_log(tmp, {7: batch})
        got, offset, i = [], HEADER_SIZE, 0
        while offset < src.end_offset(7):
            bound = steps[i % len(steps)] or None     # 0 stands for "no bound"
            piece = src.read(7, offset, bound)
            assert 0 < len(piece) <= (bound or len(batch))
            assert piece.payloads == piece.ndjson.split(b"\n")[:-1] and len(piece.payloads) == len(piece)
            got += piece.records()
            offset, i = piece.next_offset, i + 1
        assert got == batch


def test_appends_continue_the_partition(tmp_path):
    writer = PartitionedLogWriter(tmp_path)
    end = writer.append(1, records(1, 3))
    assert end == os.path.getsize(tmp_path / "partition-00001.kglog")
    PartitionedLogWriter(tmp_path).append(1, records(1, 6, start=3))
    src = PartitionedLogSource(tmp_path)
    assert src.read(1, end).records() == records(1, 6, start=3)
    writer.create(4)
    assert src.partitions == [1, 4] and len(src.read(4)) == 0


def test_to_arrow_parses_the_payloads_with_positions(tmp_path):
    src = write_partitioned_log(tmp_path, {3: [{"a": 1, "b": "x"}, {"a": 2, "b": None}]})
    piece = src.read(3)
    table = piece.to_arrow()
    assert table.column("a").to_pylist() == [1, 2]
    assert table.column("b").to_pylist() == ["x", None]
    assert table.column("_partition").to_pylist() == [3, 3]
    assert table.column("_offset").to_pylist() == piece.offsets
    schema = pa.schema([("a", pa.int32()), ("b", pa.string())])
    assert piece.to_arrow(schema, with_position=False).schema == schema
    batch = piece.to_record_batch(schema)
    assert isinstance(batch, pa.RecordBatch) and batch.num_rows == 2
    assert batch.column("a").type == pa.int32()
    empty = src.read(3, piece.next_offset).to_record_batch(schema)
    assert empty.num_rows == 0 and empty.schema.field("a").type == pa.int32()


def test_a_torn_tail_is_invisible_and_the_next_writer_cuts_it(tmp_path):
    src = write_partitioned_log(tmp_path, {0: records(0, 3)})
    with open(src.path(0), "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02")      # a crashed writer's half frame
    assert src.read(0).records() == records(0, 3)
    PartitionedLogWriter(tmp_path).append(0, [{"after": "crash"}])
    assert src.read(0).records() == records(0, 3) + [{"after": "crash"}]


@pytest.mark.parametrize("damage", ["payload", "length", "header"])
def test_corrupt_logs_raise(tmp_path, damage):
    src = write_partitioned_log(tmp_path, {0: records(0, 4)})
    data = bytearray(open(src.path(0), "rb").read())
    first = src.read(0, max_records=1)
    if damage == "payload":
        data[first.next_offset + 12] ^= 1           # inside the second record's payload
    elif damage == "length":
        data[first.next_offset + 7] = 0x7F          # a length far beyond any record
    else:
        data[1] ^= 1
    open(src.path(0), "wb").write(data)
    with pytest.raises(CorruptLogError) as err:
        src.read(0)
    assert isinstance(err.value, CorruptSnapshotError)


def test_offsets_outside_the_log_and_bad_records_are_refused(tmp_path):
    src = write_partitioned_log(tmp_path, {0: records(0, 1)})
    with pytest.raises(CorruptLogError, match="outside"):
        src.read(0, src.end_offset(0) + 10)
    with pytest.raises(CorruptLogError, match="outside"):
        src.read(0, 3)
    with pytest.raises(TypeError, match="JSON"):
        PartitionedLogWriter(tmp_path).append(0, [{"b": b"bytes"}])
    with pytest.raises(TypeError, match="dict"):
        PartitionedLogWriter(tmp_path).append(0, [[1, 2]])
    with pytest.raises(ValueError, match="max_records"):
        src.read(0, max_records=-1)


# ---- the FLIP-8 plan: subtasks own partitions, offsets in split-distribute state --------------------------------


class Job:
    """Subtasks of the source at one parallelism, checkpointing into real storage."""

    def __init__(self, source, storage, parallelism, metadata=None):
        self.storage = storage
        self.stores, self.readers = [], []
        for i in range(parallelism):
            store = OperatorStateStore(i, parallelism)
            if metadata is not None:
                store.restore(storage, metadata)
            reader = PartitionedLogReader(source)
            initialize_function(reader, store)
            self.stores.append(store)
            self.readers.append(reader)

    def poll(self, max_records):
        got = []
        for reader in self.readers:
            for piece in reader.poll(max_records):
                got.extend((r["p"], r["seq"]) for r in piece.records())
        return got

    def checkpoint(self, checkpoint_id):
        handles = [checkpoint_function(r, s, checkpoint_id, 1000 * checkpoint_id, self.storage).result(timeout=60)
                   for r, s in zip(self.readers, self.stores)]
        self.storage.commit(CheckpointMetadata(
            checkpoint_id=checkpoint_id, job_id="source-tests", timestamp_ms=1000 * checkpoint_id,
            max_parallelism=128, parallelism=len(self.stores), keyed_handles=[], operator_handles=handles,
            properties={}))
        return self.storage.load(checkpoint_id)


@pytest.fixture
def four_partitions(tmp_path):
    return write_partitioned_log(tmp_path / "log", {p: records(p, 10 + p) for p in range(4)})


def _all(source):
    return Counter((p, r["seq"]) for p in source.partitions for r in source.iter_records(p))


def test_flip8_scale_down_2_to_1_continues_every_partition(four_partitions, tmp_path):
    storage = CheckpointStorage(tmp_path / "chk")
    job = Job(four_partitions, storage, 2)
    assert [r.partitions for r in job.readers] == [[0, 2], [1, 3]]
    consumed = job.poll(3) + job.poll(4)
    positions = {p: o for r in job.readers for p, o in r.positions.items()}
    md = job.checkpoint(1)
    job.poll(5)                                   # read after the checkpoint, then "fail": these are replayed
    (one,) = Job(four_partitions, storage, 1, md).readers
    assert one.positions == positions             # all four partitions, each at its stored offset
    while True:
        more = [(r["p"], r["seq"]) for piece in one.poll(6) for r in piece.records()]
        if not more:
            break
        consumed += more
    assert Counter(consumed) == _all(four_partitions)     # nothing skipped, nothing twice


def test_flip8_scale_up_2_to_4_gives_each_subtask_one_partition(four_partitions, tmp_path):
    storage = CheckpointStorage(tmp_path / "chk")
    job = Job(four_partitions, storage, 2)
    consumed = job.poll(5)
    md = job.checkpoint(1)
    four = Job(four_partitions, storage, 4, md)
    assert sorted(len(r.partitions) for r in four.readers) == [1, 1, 1, 1]
    assert sorted(p for r in four.readers for p in r.partitions) == [0, 1, 2, 3]
    consumed += four.poll(None)
    assert Counter(consumed) == _all(four_partitions)


def test_rescale_3_to_7_to_2_with_ten_partitions(tmp_path):
    source = write_partitioned_log(tmp_path / "log", {p: records(p, 3 * p + 4) for p in range(10)})
    storage = CheckpointStorage(tmp_path / "chk")
    job = Job(source, storage, 3)
    consumed = job.poll(4)
    job = Job(source, storage, 7, job.checkpoint(1))
    counts = sorted(len(r.partitions) for r in job.readers)
    assert counts == [1, 1, 1, 1, 2, 2, 2]
    consumed += job.poll(3)
    job = Job(source, storage, 2, job.checkpoint(2))
    assert [len(r.partitions) for r in job.readers] == [5, 5]
    consumed += job.poll(None)
    assert Counter(consumed) == _all(source)
    md = job.checkpoint(3)
    (last,) = Job(source, storage, 1, md).readers
    assert last.positions == {p: source.end_offset(p) for p in range(10)}
    assert last.poll(None) == []


def test_poll_bounds_records_and_rotates_partitions(four_partitions, tmp_path):
    job = Job(four_partitions, CheckpointStorage(tmp_path / "chk"), 1)
    reader = job.readers[0]
    first = reader.poll(3)
    assert sum(len(s) for s in first) == 3 and [s.partition for s in first] == [0]
    second = reader.poll(3)
    assert [s.partition for s in second] == [1]
    table = reader.poll_arrow(5)
    assert table.num_rows == 5 and set(table.column("_partition").to_pylist()) == {2}
    assert OFFSETS_STATE_NAME in job.stores[0].registered_state_names


def test_more_subtasks_than_partitions_leaves_some_idle_but_loses_nothing(tmp_path):
    source = write_partitioned_log(tmp_path / "log", {0: records(0, 3), 1: records(1, 2)})
    storage = CheckpointStorage(tmp_path / "chk")
    job = Job(source, storage, 5)
    assert [r.partitions for r in job.readers] == [[0], [1], [], [], []]
    consumed = job.poll(1)
    job = Job(source, storage, 3, job.checkpoint(1))
    consumed += job.poll(None)
    assert Counter(consumed) == _all(source)


def test_a_checkpoint_without_source_offsets_starts_the_source_fresh(tmp_path):
    source = write_partitioned_log(tmp_path / "log", {p: records(p, 2) for p in range(3)})
    storage = CheckpointStorage(tmp_path / "chk")
    other = OperatorStateStore(0, 1, operator_id="something-else")
    other.get_union_list_state(ListStateDescriptor("x", StrSerializer())).add("x")
    handle = other.snapshot(1, storage).result(timeout=60)
    storage.commit(CheckpointMetadata(checkpoint_id=1, job_id="t", timestamp_ms=0, max_parallelism=128,
                                      parallelism=1, keyed_handles=[], operator_handles=[handle], properties={}))
    job = Job(source, storage, 2, storage.load(1))
    assert [r.partitions for r in job.readers] == [[0, 2], [1]]
    assert Counter(job.poll(None)) == _all(source)
