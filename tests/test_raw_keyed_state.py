"""Raw keyed state (Flink's "raw state"): bytes a function writes itself per key group at snapshot time and reads
back at restore, rescaled with their key groups like managed state. The file format (round trip, checksums, every
corruption a CorruptSnapshotError), its handle in ``_metadata``, the commit/retention/savepoint lifecycle of its
files, and whole batches through the driver and subtasks (no Spark) across rescales 2 -> 3 -> 1."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import random
import struct
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keygroups as kg
from keygroups import KeyGroupRange, key_group_range
from keygroups.checkpoint import (
    CheckpointMetadata,
    CheckpointStorage,
    RawKeyedStateHandle,
    RawKeyedStateReader,
    RawKeyedStateWriter,
    checkpoint_figures,
    open_raw_keyed,
    plan_raw_keyed_restore,
    write_raw_keyed_snapshot,
)
from keygroups.checkpoint.metadata import METADATA_MAGIC, decode_metadata, encode_metadata
from keygroups.checkpoint.raw_keyed import BLOCK_OVERHEAD, HEADER_SIZE, parse_raw_blocks
from keygroups.errors import CorruptSnapshotError, StateMigrationError
from keygroups.runtime import begin_batch, commit_batch
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.serializers import Int64Serializer
from keygroups.state import ValueStateDescriptor

MAXP = 16
SCHEMA = pa.schema([("k", pa.int64())])
OUT = pa.schema([("k", pa.int64()), ("key_group", pa.int64()), ("seen", pa.int64()), ("per_key", pa.int64())])


class GroupCounter(KeyedProcessFunction):
    """Counts records per key group in raw keyed state (8 bytes per key group that saw any) and per key in a managed
    ValueState; emits both after each record."""

    def open(self, ctx):
        self.counts: dict[int, int] = {}
        self.restored_groups: list[int] = []
        self.per_key = ctx.get_state(ValueStateDescriptor("per_key", Int64Serializer()))

    def restore_raw_keyed_state(self, reader):
        for group in reader.key_groups:
            data = reader.stream(group).read()
            if data:
                self.counts[group] = int.from_bytes(data, "little")

    def process_element(self, row, ctx):
        group = ctx.current_key_group
        self.counts[group] = self.counts.get(group, 0) + 1
        n = (self.per_key.value() or 0) + 1
        self.per_key.update(n)
        return [{"k": row["k"], "key_group": group, "seen": self.counts[group], "per_key": n}]

    def snapshot_raw_keyed_state(self, writer):
        for group in writer.key_groups:
            if group in self.counts:
                writer.stream(group).write(self.counts[group].to_bytes(8, "little"))


class ManagedOnly(GroupCounter):
    """Keeps its per-key-group counters in memory only: no raw keyed state."""

    snapshot_raw_keyed_state = KeyedProcessFunction.snapshot_raw_keyed_state


class Forgetful(GroupCounter):
    def snapshot_raw_keyed_state(self, writer):
        pass   # writes nothing: every block empty


def run_batch(storage, keys, parallelism, *, function=None, savepoint=None):
    """One batch of ``keys`` at ``parallelism`` through begin_batch / run_keyed_subtask / commit_batch."""
    plan = begin_batch(storage, job_name="raw", max_parallelism=MAXP, parallelism=parallelism, savepoint=savepoint)
    spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(function or GroupCounter()),
                           input_schema=SCHEMA, output_schema=OUT, warm_heap_backends=0)
    table = pa.table({"k": pa.array(keys, pa.int64())})
    owners = kg.operator_index_for_key_group(MAXP, parallelism, kg.assign_key_groups(table.column("k"), MAXP))
    reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches())
               for i in range(parallelism)]
    metadata = commit_batch(plan, reports)
    rows = []
    for f in metadata.outputs:
        rows += pq.read_table(storage.url(f)).to_pylist()
    return metadata, rows


def raw_counts(storage, metadata, parallelism=1):
    """The per-key-group counters stored in ``metadata``'s raw keyed state, read at ``parallelism``."""
    counts = {}
    for i in range(parallelism):
        reader = RawKeyedStateReader(storage, metadata, key_group_range(MAXP, parallelism, i))
        for group in reader.key_groups:
            data = reader.stream(group).read()
            if data:
                counts[group] = int.from_bytes(data, "little")
    return counts


# ---- the file format ------------------------------------------------------------------------------------------------


def write_file(storage, name, key_groups, payloads):
    def write(writer):
        assert writer.key_groups == key_groups
        for group, data in sorted(payloads.items()):
            stream = writer.stream(group)
            for i in range(0, len(data), 3):   # several writes per key group
                stream.write(data[i:i + 3])
    return write_raw_keyed_snapshot(storage, storage.new_file(1, name), subtask=0, key_groups=key_groups, write=write)


def test_round_trip_every_key_group_and_each_byte_range(tmp_path):
    storage = CheckpointStorage(str(tmp_path))
    r = KeyGroupRange(3, 9)
    payloads = {3: b"abc", 5: b"", 6: bytes(range(256)) * 3, 9: b"\x00"}
    handle = write_file(storage, "raw-keyed-0", r, payloads)
    assert handle.size == storage.file_size(handle.file) == handle.offsets[-1]
    assert handle.offsets[0] == HEADER_SIZE
    found_range, blocks = open_raw_keyed(storage.read_bytes(handle.file))
    assert found_range == r
    assert [bytes(b) for b in blocks] == [payloads.get(g, b"") for g in r]
    for a in r:   # every contiguous part of the range parses alone from its byte range
        for b in range(a, r.end + 1):
            start, end = handle.byte_range(KeyGroupRange(a, b))
            got = parse_raw_blocks(storage.read_bytes(handle.file, start, end), KeyGroupRange(a, b), "test")
            assert [bytes(x) for x in got] == [payloads.get(g, b"") for g in range(a, b + 1)]


def test_writer_refuses_key_groups_out_of_order_or_outside_and_late_writes(tmp_path):
    buffer = io.BytesIO()
    writer = RawKeyedStateWriter(buffer, KeyGroupRange(0, 3))
    first = writer.stream(1)
    first.write(b"x")
    assert writer.stream(1) is first
    writer.stream(2).write(b"y")
    with pytest.raises(ValueError, match="ascending key group order"):
        writer.stream(1)
    with pytest.raises(ValueError, match="not one of this subtask's key groups"):
        writer.stream(4)
    with pytest.raises(ValueError):   # the block of key group 1 is in the file: a late write cannot vanish silently
        first.write(b"late")
    offsets = writer.finish()
    assert len(offsets) == 5 and offsets[-1] == len(buffer.getvalue())
    _, blocks = open_raw_keyed(buffer.getvalue())
    assert [bytes(b) for b in blocks] == [b"", b"x", b"y", b""]


def valid_file(payloads=(b"one", b"", b"three", b"\xff" * 40)):
    buffer = io.BytesIO()
    writer = RawKeyedStateWriter(buffer, KeyGroupRange(4, 4 + len(payloads) - 1))
    for i, data in enumerate(payloads):
        writer.stream(4 + i).write(data)
    writer.finish()
    return buffer.getvalue()


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_random_bytes_are_corrupt_never_a_crash(data):
    with pytest.raises(CorruptSnapshotError):
        open_raw_keyed(data)
    try:
        parse_raw_blocks(data, KeyGroupRange(0, 2), "fuzz")
    except CorruptSnapshotError:
        pass


@settings(max_examples=300)
@given(st.data())
def test_every_truncation_or_changed_byte_is_corrupt(data):
    good = valid_file()
    cut = data.draw(st.integers(0, len(good) - 1))
    with pytest.raises(CorruptSnapshotError):
        open_raw_keyed(good[:cut])
    at = data.draw(st.integers(0, len(good) - 1))
    flip = data.draw(st.integers(1, 255))
    bad = bytearray(good)
    bad[at] ^= flip
    with pytest.raises(CorruptSnapshotError):
        open_raw_keyed(bytes(bad))
    blocks = good[HEADER_SIZE:]   # the ranged form a restore reads: blocks without the header
    with pytest.raises(CorruptSnapshotError):
        parse_raw_blocks(blocks[:data.draw(st.integers(0, len(blocks) - 1))], KeyGroupRange(4, 7), "fuzz")
    if at >= HEADER_SIZE:
        with pytest.raises(CorruptSnapshotError):
            parse_raw_blocks(bytes(bad[HEADER_SIZE:]), KeyGroupRange(4, 7), "fuzz")


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_damaged_file_on_storage_is_corrupt_through_the_reader(tmp_path, data):
    storage = CheckpointStorage(str(tmp_path))
    handle = write_file(storage, "raw-keyed-0", KeyGroupRange(0, 3), {0: b"a" * 10, 2: b"b" * 5})
    md = CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=4, parallelism=1,
                            raw_keyed_handles=[handle])
    good = storage.read_bytes(handle.file)
    at = data.draw(st.integers(handle.offsets[0], len(good) - 1))
    bad = bytearray(good)
    bad[at] ^= data.draw(st.integers(1, 255))
    with open(os.path.join(str(tmp_path), handle.file), "wb") as f:
        f.write(bytes(bad) if data.draw(st.booleans()) else good[:at])
    reader = RawKeyedStateReader(storage, md, KeyGroupRange(0, 3))
    with pytest.raises(CorruptSnapshotError):
        for group in reader.key_groups:
            reader.stream(group)


# ---- the handle in _metadata, planning --------------------------------------------------------------------------------


def handle(file="chk-1/raw-keyed-0-" + "a" * 32, r=KeyGroupRange(0, 1), subtask=0):
    step = BLOCK_OVERHEAD
    offsets = [HEADER_SIZE + i * step for i in range(len(r) + 1)]
    return RawKeyedStateHandle(file=file, subtask=subtask, key_group_range=r, offsets=offsets, size=offsets[-1])


def test_metadata_round_trips_raw_handles_and_reads_without_the_field():
    md = CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=5, max_parallelism=4, parallelism=2,
                            raw_keyed_handles=[handle(), handle("chk-1/raw-keyed-1-" + "b" * 32, KeyGroupRange(2, 3),
                                                                1)])
    data = encode_metadata(md, "chk-1")
    back = decode_metadata(data, "chk-1", "test")
    assert back.raw_keyed_handles == md.raw_keyed_handles
    assert set(back.files()) >= {h.file for h in md.raw_keyed_handles}
    plain = CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=5, max_parallelism=4, parallelism=2)
    assert b"raw_keyed_handles" not in encode_metadata(plain, "chk-1")   # absent = none
    assert decode_metadata(encode_metadata(plain, "chk-1"), "chk-1", "test").raw_keyed_handles == []


@pytest.mark.parametrize("bad", [
    {"offsets": [1, 0, 2]}, {"size": -1}, {"key_group_range": [3, 1]}, {"format_version": 2}, {"subtask": "0"},
    {"file": "../x"}, {"offsets": None},
])
def test_a_bad_raw_handle_is_corrupt(bad):
    d = dict(handle().to_json(), **bad)
    with pytest.raises(CorruptSnapshotError, match="raw keyed state handle"):
        RawKeyedStateHandle.from_json(d)
    with pytest.raises(CorruptSnapshotError):
        RawKeyedStateHandle.from_json({k: v for k, v in handle().to_json().items() if k != "size"})


def test_overlapping_or_outside_raw_handles_are_refused():
    base = {"checkpoint_id": 1, "job_id": "j", "timestamp_ms": 0, "max_parallelism": 4, "parallelism": 2}
    with pytest.raises(ValueError, match="overlap"):
        CheckpointMetadata(**base, raw_keyed_handles=[handle(r=KeyGroupRange(0, 2)),
                                                      handle(r=KeyGroupRange(2, 3), subtask=1)]).validate()
    with pytest.raises(ValueError, match="outside"):
        CheckpointMetadata(**base, raw_keyed_handles=[handle(r=KeyGroupRange(3, 4))]).validate()


def test_plan_reads_exactly_the_new_range_from_the_old_files():
    md = CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=8, parallelism=2,
                            raw_keyed_handles=[handle(r=KeyGroupRange(0, 3)),
                                               handle("chk-1/raw-keyed-1-" + "b" * 32, KeyGroupRange(4, 7), 1)])
    for p in (1, 2, 3, 5, 8):
        covered = []
        for i in range(p):
            own = key_group_range(8, p, i)
            plan = plan_raw_keyed_restore(md, own)
            assert all(part and part.start >= own.start and part.end <= own.end for _, part in plan)
            covered += [g for _, part in plan for g in part]
        assert covered == list(range(8))
    with pytest.raises(StateMigrationError, match="raw keyed state"):
        plan_raw_keyed_restore(md, KeyGroupRange(0, 3), max_parallelism=16)


# ---- batches: rescale 2 -> 3 -> 1, lifecycle of the files -------------------------------------------------------------


def test_raw_state_follows_its_key_groups_across_rescales(tmp_path):
    storage = CheckpointStorage(str(tmp_path), retain=2)
    rng = random.Random(7)
    expected_groups: Counter[int] = Counter()
    expected_keys: Counter[int] = Counter()
    for parallelism in (2, 3, 1, 2):
        keys = [rng.randrange(40) for _ in range(120)]
        metadata, rows = run_batch(storage, keys, parallelism)
        # the output shows each key group's counter continuing from the restored raw state
        groups = [int(g) for g in kg.assign_key_groups(pa.array(keys, pa.int64()), MAXP)]
        want = []
        for k, g in sorted(zip(keys, groups), key=lambda kg_: (kg_[1], kg_[0])):   # a subtask's order
            expected_groups[g] += 1
            expected_keys[k] += 1
            want.append((k, g, expected_groups[g], expected_keys[k]))
        got = [(r["k"], r["key_group"], r["seen"], r["per_key"]) for r in rows]
        assert sorted(got) == sorted(want)
        # one file per subtask, holding exactly its key groups, in this checkpoint's directory
        assert sorted((h.subtask, h.key_group_range) for h in metadata.raw_keyed_handles) == [
            (i, key_group_range(MAXP, parallelism, i)) for i in range(parallelism)]
        assert all(h.file.startswith(f"chk-{metadata.checkpoint_id}/") for h in metadata.raw_keyed_handles)
        for p in (1, 3, 5):
            assert raw_counts(storage, metadata, p) == dict(expected_groups)
    # retention removed the old checkpoints' raw files with their directories; the retained ones are intact
    retained = {h.file for cid in storage.checkpoint_ids() for h in storage.load(cid).raw_keyed_handles}
    on_disk = {f"{d}/{n}" for d in os.listdir(tmp_path) if d.startswith("chk-")
               for n in os.listdir(tmp_path / d) if n.startswith("raw-keyed-")}
    assert on_disk == retained


def test_a_max_parallelism_change_is_refused_only_with_raw_state(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "raw"))
    run_batch(storage, [1, 2, 3], 2)
    with pytest.raises(StateMigrationError, match="raw keyed state") as e:
        begin_batch(storage, job_name="raw", max_parallelism=MAXP * 2, parallelism=2)
    assert f"max_parallelism={MAXP}" in str(e.value)

    other = CheckpointStorage(str(tmp_path / "managed"))
    md, _ = run_batch(other, [1, 2, 3], 2, function=ManagedOnly())
    assert md.raw_keyed_handles == []
    assert begin_batch(other, job_name="raw", max_parallelism=MAXP * 2, parallelism=2).max_parallelism == MAXP * 2


def test_a_function_that_stops_writing_raw_state_leaves_none(tmp_path):
    storage = CheckpointStorage(str(tmp_path))
    run_batch(storage, [1, 2, 3], 2)

    md, rows = run_batch(storage, [1], 1, function=Forgetful())
    assert [r["seen"] for r in rows] == [2]   # restored from the previous checkpoint's raw state
    assert raw_counts(storage, md) == {}


def test_savepoint_copies_raw_files_and_restores_from_them(tmp_path):
    storage = CheckpointStorage(str(tmp_path))
    md, _ = run_batch(storage, [1, 2, 3, 1], 2)
    storage.savepoint(md, "sp")
    saved = storage.load_savepoint("sp")
    assert [h.file.split("/")[:2] for h in saved.raw_keyed_handles] == [["savepoints", "sp"]] * 2
    assert raw_counts(storage, saved) == raw_counts(storage, md)
    for d in [d for d in os.listdir(tmp_path) if d.startswith("chk-")]:
        for n in os.listdir(tmp_path / d):
            os.remove(tmp_path / d / n)   # the checkpoint is gone: the savepoint stands alone
    _, rows = run_batch(storage, [1], 3, savepoint="sp")
    group = int(kg.assign_key_groups(pa.array([1], pa.int64()), MAXP)[0])
    same_group = sum(int(g) == group for g in kg.assign_key_groups(pa.array([1, 2, 3, 1], pa.int64()), MAXP))
    assert rows[0]["seen"] == same_group + 1


def test_commit_checks_raw_files_and_a_lost_commit_discards_them(tmp_path):
    storage = CheckpointStorage(str(tmp_path))
    plan = begin_batch(storage, job_name="raw", max_parallelism=MAXP, parallelism=1)
    spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(GroupCounter()), input_schema=SCHEMA,
                           output_schema=OUT, warm_heap_backends=0)
    report = run_keyed_subtask(spec, 0, pa.table({"k": pa.array([5], pa.int64())}).to_batches())
    raw_file = report.raw_keyed_handle.file
    os.remove(tmp_path / raw_file)
    with pytest.raises(ValueError, match="raw keyed state file"):
        commit_batch(plan, [report])
    report = run_keyed_subtask(spec, 0, pa.table({"k": pa.array([5], pa.int64())}).to_batches())   # a retry
    md = commit_batch(plan, [report])
    assert report.raw_keyed_handle.file in md.files()
    assert storage.discard(md) >= 1 and not os.path.exists(tmp_path / report.raw_keyed_handle.file)


def test_checkpoint_figures_count_the_raw_files_as_written(tmp_path):
    storage = CheckpointStorage(str(tmp_path))
    md, _ = run_batch(storage, list(range(30)), 2)
    figures = checkpoint_figures(storage, md)
    state_files = {h.file: h.size for h in [*md.keyed_handles, *md.raw_keyed_handles]}
    assert figures.written_bytes == sum(state_files.values())
    assert sum(h.size for h in md.raw_keyed_handles) > 0


def test_a_checkpoint_with_raw_state_or_late_output_is_version_4_and_others_stay_3():
    def version(md):
        data = encode_metadata(md, "chk-1")
        assert data[:4] == METADATA_MAGIC
        assert decode_metadata(data, "chk-1", "test") == md
        return struct.unpack_from("<I", data, 4)[0]

    plain = CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=8, parallelism=1)
    assert version(plain) == 3   # what every older keygroups reads
    assert version(dataclasses.replace(plain, late_outputs=["chk-1/late-0-x.parquet"])) == 4
    assert version(dataclasses.replace(plain, max_parallelism=4, raw_keyed_handles=[handle()])) == 4
