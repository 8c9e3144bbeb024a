"""The savepoint writer streams (issue 34): a subtask's input larger than one chunk is spilled in runs ordered by
key group and encoded chunk by chunk of whole key groups, so its memory is bounded whatever the key count, and the
file it writes holds the same bytes as one written from the whole input at once."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups import assign_key_groups, key_group_range
from keygroups.checkpoint import CheckpointStorage
from keygroups.checkpoint import format as checkpoint_format
from keygroups.errors import KeyGroupsError
from keygroups.runtime import state_writer
from keygroups.runtime.state_writer import (
    DuplicateKeyError,
    StateColumn,
    plan_savepoint,
    write_savepoint_subtask,
)
from keygroups.state import StateTtlConfig

MAXP = 16
TTL = StateTtlConfig.new_builder(60).build()
STATES = {"count": "count", "tags": "tags", "seen": "seen", "label": StateColumn("label", ttl=TTL, ttl_column="at")}


def table_of(keys, rng):
    n = len(keys)
    return pa.table({
        "k": keys,
        "count": pa.array(np.where(rng.random(n) < 0.2, None, rng.integers(-2**40, 2**40, n)).tolist(), pa.int64()),
        "tags": pa.array([None if i % 7 == 0 else list(range(i % 4)) for i in range(n)], pa.list_(pa.int64())),
        "seen": pa.array([[("a", i), ("b", -i)][: i % 3] for i in range(n)], pa.map_(pa.string(), pa.int64())),
        "label": pa.array([None if i % 5 == 0 else f"l{i}" for i in range(n)], pa.string()),
        "at": pa.array(rng.integers(0, 2**41, n), pa.int64()),
    })


def written(location, table, parallelism=2, batch_rows=None, **options):
    """Per subtask: (the keyed file's bytes, its handle without the file name) or None."""
    plan = plan_savepoint(table.schema, location, "s", key_columns="k", states=STATES, max_parallelism=MAXP,
                          parallelism=parallelism)
    plan = dataclasses.replace(plan, written_ms=1_700_000_000_123)
    groups = np.asarray(assign_key_groups(table.column("k"), MAXP))
    storage = CheckpointStorage(location)
    out = []
    for subtask in range(parallelism):
        r = key_group_range(MAXP, parallelism, subtask)
        mine = table.take(pa.array(np.flatnonzero((groups >= r.start) & (groups <= r.end))))
        handle = write_savepoint_subtask(plan, subtask, mine.to_batches(max_chunksize=batch_rows), **options)
        if handle is None:
            out.append(None)
            continue
        described = handle.to_json()
        described.pop("file")
        out.append((storage.read_bytes(handle.file), described))
    return out


@pytest.fixture
def fixed_file_id(monkeypatch):
    """One file id for every file (it is random otherwise, and every block's checksum covers it)."""
    monkeypatch.setattr(checkpoint_format, "new_file_id", lambda: b"0123456789abcdef")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 400), string_keys=st.booleans(), chunk_rows=st.integers(1, 120),
       run_rows=st.integers(1, 90), batch_rows=st.integers(1, 60), seed=st.integers(0, 2**32 - 1))
def test_a_streamed_file_holds_the_bytes_of_one_written_at_once(tmp_path_factory, monkeypatch, fixed_file_id, n,
                                                                 string_keys, chunk_rows, run_rows, batch_rows,
                                                                 seed):
    rng = np.random.default_rng(seed)
    ids = rng.permutation(n * 3)[:n]
    keys = pa.array([f"key-{i}" for i in ids], pa.string()) if string_keys else pa.array(ids * 7919 - 500, pa.int64())
    table = table_of(keys, rng)
    whole = written(str(tmp_path_factory.mktemp("whole")), table, chunk_rows=10**9)
    monkeypatch.setattr(state_writer, "RUN_ROWS", run_rows)
    streamed = written(str(tmp_path_factory.mktemp("streamed")), table, batch_rows=batch_rows, chunk_rows=chunk_rows)
    assert streamed == whole


def test_the_default_chunk_spills_a_larger_input_and_writes_the_same_bytes(tmp_path, fixed_file_id, monkeypatch):
    n = state_writer.CHUNK_ROWS + 40_000   # subtask 0 of 1 gets them all: more than one chunk
    keys = pa.array(np.arange(n, dtype=np.int64) * 31 + 5)
    table = pa.table({"k": keys, "count": pa.array(np.arange(n) % 1000), "sum": pa.array(np.arange(n) * 3)})

    def run(location, **options):
        plan = plan_savepoint(table.schema, location, "s", key_columns="k", states={"count": "count", "sum": "sum"},
                              max_parallelism=128, parallelism=1)
        plan = dataclasses.replace(plan, written_ms=1)
        handle = write_savepoint_subtask(plan, 0, table.to_batches(max_chunksize=10_000), **options)
        return CheckpointStorage(location).read_bytes(handle.file), handle.offsets

    chunks = []
    real = state_writer._encoded_key_groups
    monkeypatch.setattr(state_writer, "_encoded_key_groups",
                        lambda plan, ks, enc, t, kgs: chunks.append(t.num_rows) or real(plan, ks, enc, t, kgs))
    streamed = run(str(tmp_path / "streamed"))
    assert len(chunks) > 1 and max(chunks) <= state_writer.CHUNK_ROWS and sum(chunks) == n
    assert streamed == run(str(tmp_path / "whole"), chunk_rows=10**9)
    assert chunks[-1] == n   # at once: one chunk


def test_chunks_are_whole_key_groups_ascending_and_bounded(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    n = 5000
    keys = pa.array(rng.permutation(10**6)[:n].astype(np.int64))
    table = table_of(keys, rng)
    spill = tmp_path / "spill"
    spill.mkdir()
    monkeypatch.setattr(state_writer, "RUN_ROWS", 300)
    seen = []
    real = state_writer._encoded_key_groups

    def record(plan, key_serializer, encoders, chunk, kgs):
        seen.append((chunk.num_rows, int(kgs.min()), int(kgs.max()), sorted(os.listdir(spill))))
        return real(plan, key_serializer, encoders, chunk, kgs)

    monkeypatch.setattr(state_writer, "_encoded_key_groups", record)
    written(str(tmp_path / "s"), table, parallelism=1, batch_rows=97, chunk_rows=700, spill_dir=str(spill))
    largest = int(np.bincount(np.asarray(assign_key_groups(keys, MAXP))).max())
    assert sum(rows for rows, *_ in seen) == n
    assert all(rows <= max(700, largest) for rows, *_ in seen)
    assert all(prev[2] < nxt[1] for prev, nxt in zip(seen, seen[1:]))   # ascending, no key group in two chunks
    assert all(len(files) == 1 for *_, files in seen)   # encoded from the spilled runs...
    assert os.listdir(spill) == []                        # ...which are gone once the file is written


def test_a_row_of_another_subtask_is_refused_before_anything_is_written(tmp_path):
    rng = np.random.default_rng(5)
    keys = np.arange(3000, dtype=np.int64)
    table = table_of(pa.array(keys), rng)
    plan = plan_savepoint(table.schema, str(tmp_path), "s", key_columns="k", states=STATES, max_parallelism=MAXP,
                          parallelism=2)
    groups = np.asarray(assign_key_groups(keys, MAXP))
    mine = np.flatnonzero(groups < 8)
    stray = int(np.flatnonzero(groups >= 8)[0])
    rows = table.take(pa.array(np.concatenate([mine, [stray]])))   # the stray row comes last, after a spill
    with pytest.raises(KeyGroupsError, match=f"subtask 0 owns key groups .* got a row of key group {groups[stray]}"):
        write_savepoint_subtask(plan, 0, rows.to_batches(max_chunksize=100), chunk_rows=200)
    assert [f for f in os.listdir(tmp_path / "savepoints" / "s") if f.startswith("keyed-")] == []


def test_a_key_in_two_runs_is_a_duplicate(tmp_path, monkeypatch):
    rng = np.random.default_rng(6)
    keys = np.arange(2000, dtype=np.int64)
    keys[1500] = keys[10]   # far apart: in different runs
    table = table_of(pa.array(keys), rng)
    plan = plan_savepoint(table.schema, str(tmp_path), "s", key_columns="k", states=STATES, max_parallelism=MAXP,
                          parallelism=1)
    monkeypatch.setattr(state_writer, "RUN_ROWS", 250)
    with pytest.raises(DuplicateKeyError, match="key 10 comes in more than one row"):
        write_savepoint_subtask(plan, 0, table.to_batches(max_chunksize=100), chunk_rows=300)


def test_chunk_rows_must_be_a_positive_int(tmp_path):
    table = pa.table({"k": [1], "count": [2]})
    plan = plan_savepoint(table.schema, str(tmp_path), "s", key_columns="k", states={"count": "count"},
                          max_parallelism=MAXP, parallelism=1)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="chunk_rows must be an int >= 1"):
            write_savepoint_subtask(plan, 0, table.to_batches(), chunk_rows=bad)
