"""keygroups.metrics without Spark, through the test harness (the subtask code a job runs): every figure of a batch
per batch, subtask and key group against what the batch did; a rescale with its moved bytes; the store beside the
checkpoints (bounded, read back whole, refusing what it cannot read, never failing a batch); the tables; the
Prometheus exposition (a real server scrapes it in tests/test_metrics_prometheus.py); the running totals against a
model over random batches and rescales."""

from __future__ import annotations

import logging
import os
import uuid
from datetime import timedelta

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

import keygroups as kg
from keygroups.checkpoint import chain_stats
from keygroups.errors import CorruptDataError
from keygroups.metrics import (
    BATCH_SCHEMA,
    KEY_GROUP_SCHEMA,
    RESTORE_MODES,
    SERIES,
    SUBTASK_SCHEMA,
    MetricsStore,
    PrometheusExporter,
    batch_table,
    job_metrics,
    key_group_table,
    metrics_table,
    subtask_table,
)
from keygroups.metrics.store import encode_metrics
from keygroups.runtime import KeyedProcessFunction, WatermarkStrategy
from keygroups.runtime.assignment import checkpoint_loads
from keygroups.serializers import Int64Serializer
from keygroups.state import ValueStateDescriptor
from keygroups.testing import KeyedFunctionHarness

from test_assignment_runtime import FixedRanges   # an assignment that runs the ranges it is given

MP = 16
OUT = "k long, n long"
NONE, WARM, CAUGHT_UP, COLD = (RESTORE_MODES.index(m) for m in ("none", "warm", "caught-up", "cold"))


class Count(KeyedProcessFunction):
    """Counts each key's records; every record registers an event-time timer 1000 ms after it."""

    def open(self, context):
        self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))

    def process_element(self, record, context):
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        context.timer_service.register_event_time_timer(context.timestamp + 1000)
        return [(context.current_key, n)]


def harness(name=None, parallelism=2, **kwargs):
    return KeyedFunctionHarness(Count(), "k", output_schema=OUT, max_parallelism=MP, parallelism=parallelism,
                                timestamp_column="t", name=name or f"metrics-{uuid.uuid4().hex[:8]}",
                                watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(
                                    timedelta(milliseconds=20)), **kwargs)


def records(keys, stamps):
    return pa.table({"k": pa.array(keys, pa.int64()), "t": pa.array(stamps, pa.int64())})


def key_groups(keys):
    return np.bincount(kg.assign_key_groups(np.asarray(keys, dtype=np.int64), MP, "long"), minlength=MP)


def test_every_figure_of_a_batch_per_batch_subtask_and_key_group():
    with harness() as h:
        recorder = job_metrics(h)
        keys = list(range(40)) * 2
        first = h.process(records(keys, list(range(1000, 1080))))
        m = recorder.latest
        assert m.checkpoint_id == first.checkpoint_id == 1 and m.job == h.name
        assert (m.records_in, m.records_late, m.records_out) == (80, 0, 80)
        assert np.array_equal(m.key_groups.records, key_groups(keys))
        # a step per key of the batch plus one per record (process_element is called per record)
        assert np.array_equal(m.key_groups.calls, key_groups(range(40)) + key_groups(keys))
        assert not m.key_groups.timers_fired.any() and m.timers_registered == 80
        assert (m.key_groups.restore == NONE).all()   # the first batch: nothing to restore
        assert m.key_groups.state_bytes.sum() == m.state_bytes == first.report.state_bytes > 0
        assert m.previous_parallelism is None and not m.rescaled and m.moved_bytes == 0
        assert m.watermark_before is None and m.watermark_after == first.watermark
        assert m.wall_seconds > 0 and m.spark_seconds is None and m.ours_seconds is None
        for s in m.subtasks:
            own = kg.key_group_range(MP, 2, s.subtask)
            assert (s.first_key_group, s.last_key_group) == (own.start, own.end)
            assert s.records_in == m.key_groups.records[own.start:own.end + 1].sum()
            assert s.restore_mode == "new" and s.process_seconds > 0 and s.spark_task_seconds is None
        assert m.decision["assignment"] == "flink" and m.assignment == "flink"

        # 10 records behind the watermark (1059), the first batch's timers (2000-2079) fire at watermark 2109
        late_keys = list(range(10))
        on_time = list(range(40))
        second = h.process(records(late_keys + on_time, [1040 + i for i in range(10)] + [2100 + i for i in range(40)]))
        m = recorder.latest
        report = second.report
        assert (m.records_in, m.records_late, m.records_out) == (50, 10, 40) == (
            report.records_in, report.records_late, report.records_out)
        assert sum(s.records_late for s in m.subtasks) == 10
        assert np.array_equal(m.key_groups.records, key_groups(on_time))   # what the function processed
        assert np.array_equal(m.key_groups.timers_fired, key_groups(keys)) and m.timers_fired == 80
        assert m.timers_pending == report.timers_pending == 40
        assert (m.key_groups.restore == WARM).all()   # the harness keeps heap backends warm
        assert (m.watermark_before, m.watermark_after) == (report.watermark_before, report.watermark_after)
        assert (m.bytes_written, m.bytes_restored, m.state_bytes) == (
            report.bytes_written, report.bytes_restored, report.state_bytes)
        loads = checkpoint_loads(h.checkpoint)   # what the balanced assignment weighs
        assert np.allclose(m.key_groups.decayed_work, loads.calls + loads.timers)
        assert [c.checkpoint_id for c in recorder.recent()] == [1, 2]


def test_a_rescale_with_the_bytes_it_moved():
    name = f"rescale-{uuid.uuid4().hex[:8]}"
    with harness(name) as h:
        for b in range(2):
            h.process(records(list(range(100)), [1000 * b + i for i in range(100)]))
        snapshot = h.snapshot()
        previous = snapshot.metadata
        with h.restore(snapshot, parallelism=3) as wider:
            recorder = job_metrics(wider)
            wider.process(records(list(range(100, 150)), [5000 + i for i in range(50)]))
            m = recorder.latest
            assert m.rescaled and (m.previous_parallelism, m.parallelism) == (2, 3)
            assert m.boundaries == (0, *(kg.key_group_range(MP, 3, i).end + 1 for i in range(3)))
            assert m.decision["moved_key_groups"] == m.moved_key_groups > 0
            # a key group moved when its holder changed: warm state belongs to a range, and each new subtask takes over
            # the warm state of at most one old range (the decision's takeover), whatever the subtasks' numbers. 0-7,
            # 8-15 -> 0-5, 6-10, 11-15: the first keeps 0-5, the third takes over 8-15 (it shares the most with it)
            # and keeps 11-15, the second holds nothing before: 6-10 moved. Its bytes are its chain in the restore point
            assert m.decision["takeover"] == [0, None, 1]
            old = np.searchsorted(np.asarray([kg.key_group_range(MP, 2, i).start for i in range(2)]), np.arange(MP),
                                  side="right") - 1
            holder = np.asarray([-1 if j is None else j for j in m.decision["takeover"]])[m.subtask_of_key_groups()]
            moved = old != holder
            assert np.flatnonzero(moved).tolist() == list(range(6, 11))
            assert moved.sum() == m.moved_key_groups
            chains = chain_stats(previous, kg.KeyGroupRange(0, MP - 1))
            expected = np.zeros(MP, dtype=np.int64)
            for g, chain in chains.items():
                expected[g] = chain.full_bytes + chain.delta_bytes if moved[g] else 0
            assert np.array_equal(m.key_groups.moved_bytes, expected)
            assert m.key_groups.moved_bytes.sum() == m.moved_bytes == m.decision["moved_bytes"] > 0
            assert (m.key_groups.restore == COLD).all() and m.bytes_restored > 0
            assert all(s.restore_mode == "cold" for s in m.subtasks)
            wider.process(records([1], [9000]))
            assert not recorder.latest.rescaled and recorder.latest.moved_bytes == 0
        totals = SERIES.get(name)
        assert totals.rescales == 1 and totals.moved_bytes == m.moved_bytes
        assert totals.batches == 2   # the restored harness's two batches: the first harness recorded none


def _groups(runs):
    return {g for run in runs for g in range(run.start, run.end + 1)}


def test_moved_key_groups_are_those_the_warm_takeover_did_not_hold_and_the_subtasks_read():
    """The key groups a rescale moved are those the warm takeover did not hold, whatever the subtasks' numbers:
    0-1, 2-3, 4-15 -> 0-11, 12-13, 14-15 gives the third subtask's warm state to the first, which keeps 4-11 and
    drops 12-15; 0-3 and 12-15 moved (by subtask number 2-15 would have). The harness runs every subtask in one
    process, where the kept backends are split among the subtasks: what moved comes from their pieces, and the
    metrics say so (every key group warm, nothing read)."""
    assignment = FixedRanges((0, 2, 4, MP))
    with harness(parallelism=3, assignment=assignment) as h:
        recorder = job_metrics(h)
        h.process(records(list(range(100)), [1000 + i for i in range(100)]))
        assignment.boundaries = (0, 12, 14, MP)
        batch = h.process(records(list(range(100)), [2000 + i for i in range(100)]))
        m = recorder.latest
        assert m.rescaled and m.ranges_moved and m.parallelism == m.previous_parallelism == 3
        assert m.decision["takeover"] == [2, None, None]
        assert [r.restored.mode for r in batch.reports] == ["moved", "moved", "warm"]
        read = set().union(*(_groups(r.restored.restored_key_groups) for r in batch.reports))
        dropped = set().union(*(_groups(r.restored.dropped_key_groups) for r in batch.reports))
        moved = set(np.flatnonzero(m.key_groups.moved_bytes).tolist())
        assert moved == {0, 1, 2, 3, 12, 13, 14, 15} and m.moved_key_groups == len(moved) and read == set()
        assert dropped == {12, 13, 14, 15}   # the old ranges 0-1 and 2-3 nobody took over dropped nothing
        assert m.key_groups.moved_bytes.sum() == m.moved_bytes == m.decision["moved_bytes"] > 0 == m.bytes_restored
        assert m.bytes_restored == sum(r.restored.bytes_restored for r in batch.reports)
        for s, r in zip(m.subtasks, batch.reports):
            assert s.restore_mode == r.restored.mode and s.bytes_restored == r.restored.bytes_read
        assert not np.any(m.key_groups.restore == COLD) and np.all(m.key_groups.restore == WARM)


def test_the_store_keeps_the_last_batches_and_reads_them_back_whole():
    with harness(parallelism=3) as h:
        recorder = job_metrics(h)
        recorder.keep = 3
        for b in range(5):
            h.process(records([b * 7 + i for i in range(30)], [1000 * b + i for i in range(30)]))
        store = MetricsStore(h.storage.location)
        assert store.checkpoint_ids() == [3, 4, 5]
        assert sorted(os.listdir(os.path.join(h.storage.location, "_metrics"))) == [
            f"batch-{i:020d}.arrow" for i in (3, 4, 5)]
        for kept, recorded in zip(store.history(), recorder.recent()[-3:]):
            assert kept.batch_json() == recorded.batch_json()
            for name in ("records", "calls", "timers_fired", "state_bytes", "moved_bytes", "decayed_work",
                         "restore"):
                got, want = getattr(kept.key_groups, name), getattr(recorded.key_groups, name)
                assert got.dtype == want.dtype and np.array_equal(got, want), name
        assert [m.checkpoint_id for m in recorder.history()] == [3, 4, 5]
        assert [m.checkpoint_id for m in store.history(last=2)] == [4, 5]


def test_a_metrics_file_it_cannot_read_is_refused_by_name(tmp_path):
    with harness() as h:
        job_metrics(h)
        h.process(records([1, 2, 3], [1, 2, 3]))
        store = MetricsStore(h.storage.location)
        path = store.url(1)
        with open(path, "rb") as f:
            good = f.read()
        for bad in (b"", b"not arrow at all", good[: len(good) // 2]):
            with open(path, "wb") as f:
                f.write(bad)
            with pytest.raises(CorruptDataError, match="not a readable keygroups metrics file") as e:
                store.read(1)
            assert path in str(e.value)
        newer = pa.table({"x": [1]}).schema.with_metadata({b"keygroups.metrics.version": b"99",
                                                         b"keygroups.metrics.batch": b"{}"})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, newer) as w:
            w.write_table(pa.table({"x": [1]}, schema=newer))
        with open(path, "wb") as f:
            f.write(sink.getvalue().to_pybytes())
        with pytest.raises(CorruptDataError, match="newer than this keygroups reads"):
            store.read(1)


def test_a_failure_to_record_never_fails_the_batch(caplog):
    with harness() as h:
        recorder = job_metrics(h)
        os.makedirs(h.storage.location, exist_ok=True)
        with open(os.path.join(h.storage.location, "_metrics"), "w") as f:   # a file where the directory goes
            f.write("in the way")
        with caplog.at_level(logging.ERROR, logger="keygroups.metrics"):
            batch = h.process(records([1, 2, 3], [1, 2, 3]))
        assert batch.checkpoint_id == 1 and h.storage.checkpoint_ids() == [1]
        assert "recording the metrics of checkpoint 1" in caplog.text
        assert recorder.latest is not None and recorder.latest.checkpoint_id == 1   # in memory all the same


def test_recording_is_off_for_a_harness_until_asked_and_can_be_turned_off():
    with harness() as h:
        h.process(records([1], [1]))
        assert not os.path.exists(os.path.join(h.storage.location, "_metrics"))
        recorder = job_metrics(h)
        h.process(records([2], [2]))
        recorder.enabled = False
        h.process(records([3], [3]))
        assert MetricsStore(h.storage.location).checkpoint_ids() == [2]


def test_the_tables_have_a_row_per_batch_subtask_and_key_group():
    with harness(parallelism=2) as h:
        recorder = job_metrics(h)
        for b in range(3):
            h.process(records(list(range(20)), [100 * b + i for i in range(20)]))
        history = recorder.history()
        batches, subtasks, groups = batch_table(history), subtask_table(history), key_group_table(history)
        assert batches.schema == BATCH_SCHEMA and subtasks.schema == SUBTASK_SCHEMA
        assert groups.schema == KEY_GROUP_SCHEMA
        assert batches.column("checkpoint_id").to_pylist() == [1, 2, 3]
        assert batches.column("records_in").to_pylist() == [20, 20, 20]
        assert batches.column("key_groups_warm").to_pylist() == [0, MP, MP]
        assert subtasks.num_rows == 3 * 2 and groups.num_rows == 3 * MP
        per_batch = groups.group_by("checkpoint_id").aggregate([("records", "sum"), ("state_bytes", "sum")])
        assert per_batch.sort_by("checkpoint_id").column("records_sum").to_pylist() == [20, 20, 20]
        assert set(groups.column("restore_mode").to_pylist()) == {"none", "warm"}
        state = subtasks.group_by("checkpoint_id").aggregate([("state_bytes", "sum")]).sort_by("checkpoint_id")
        assert state.column("state_bytes_sum").to_pylist() == batches.column("state_bytes").to_pylist()
        assert metrics_table(history, "keygroup").equals(groups)
        with pytest.raises(ValueError, match="level must be one of batch, subtask, keygroup"):
            metrics_table(history, "partition")


def _samples(text, job):
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("job_name") == job:
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_the_prometheus_exposition_has_every_batch_and_the_hot_key_groups():
    name = f"prom-{uuid.uuid4().hex[:8]}"
    with harness(name, parallelism=2) as h:
        job_metrics(h).store = False   # the totals need no store
        hot = [3] * 50 + list(range(100, 110))
        for b in range(4):
            h.process(records(hot, [1000 * b + i for i in range(len(hot))]))
        top = _samples(PrometheusExporter(top_key_groups=2).text(), name)
        assert top["keygroups_batches_total"] == [({"job_name": name}, 4.0)]
        groups = {labels["key_group"] for labels, _ in top["keygroups_key_group_records_total"]}
        assert len(groups) == 2 and str(kg.assign_to_key_group(3, MP, "long")) in groups   # the hot key's first
        records_in = {labels["subtask_index"]: v for labels, v in top["keygroups_records_in_total"]}
        assert sum(records_in.values()) == 4 * len(hot)
        everything = _samples(PrometheusExporter(key_groups=True).text(), name)
        per_group = {int(labels["key_group"]): v for labels, v in everything["keygroups_key_group_records_total"]}
        assert sorted(per_group) == list(range(MP))
        assert np.array_equal([per_group[g] for g in range(MP)], 4 * key_groups(hot))
        assert _samples(PrometheusExporter(top_key_groups=0).text(), name).get(
            "keygroups_key_group_records_total") is None
    with pytest.raises(ValueError, match="top_key_groups must be an int >= 0"):
        PrometheusExporter(top_key_groups=-1)


def test_encoding_is_deterministic_for_one_batch():
    with harness() as h:
        recorder = job_metrics(h)
        recorder.store = False
        h.process(records([1, 2], [1, 2]))
        assert encode_metrics(recorder.latest) == encode_metrics(recorder.latest)


operations = st.lists(st.one_of(st.tuples(st.just("batch"), st.lists(st.integers(0, 300), max_size=60)),
                                st.tuples(st.just("rescale"), st.integers(1, 4))), min_size=1, max_size=7)


@settings(max_examples=12)
@given(operations, st.integers(1, 3))
def test_running_totals_match_a_model_over_random_batches_and_rescales(ops, parallelism):
    """Random batches and rescales (a snapshot restored at another parallelism) against a plain model: every batch
    counted once, every rescale with its moved bytes, every key group's records."""
    name = f"model-{uuid.uuid4().hex[:8]}"
    model = {"batches": 0, "rescales": 0, "records": np.zeros(MP, dtype=np.int64)}
    moved = 0
    h = harness(name, parallelism=parallelism)
    open_harnesses = [h]
    job_metrics(h).store = False
    stamp, committed_parallelism = 0, None   # the parallelism of the state the next batch restores
    try:
        for op, arg in ops:
            if op == "rescale":
                if h.checkpoint is None:
                    continue
                h = h.restore(h.snapshot(), parallelism=arg)   # a snapshot of a harness without batches: its restore point
                open_harnesses.append(h)
                job_metrics(h).store = False
                continue
            h.process(records(arg, [stamp + i for i in range(len(arg))]))
            stamp += len(arg) + 1
            m = job_metrics(h).latest
            assert m.key_groups.records.sum() == m.records_in == len(arg)
            rescaled = committed_parallelism is not None and h.parallelism != committed_parallelism
            assert m.rescaled == rescaled
            model["batches"] += 1
            model["rescales"] += int(rescaled)
            model["records"] += key_groups(arg)
            moved += m.moved_bytes
            committed_parallelism = h.parallelism
    finally:
        for x in open_harnesses:
            x.close()
    totals = SERIES.get(name)
    if model["batches"] == 0:
        assert totals is None
        return
    assert (totals.batches, totals.rescales, totals.moved_bytes) == (model["batches"], model["rescales"], moved)
    assert np.array_equal(totals.key_group_counts[:, 0], model["records"])


def test_the_store_on_s3_keeps_the_last_batches(s3_server):
    """The store beside checkpoints on an object store (a real S3 server): whole-object writes, listing, pruning."""
    with harness(parallelism=2) as h:
        recorder = job_metrics(h)
        recorder.store = False
        for b in range(4):
            h.process(records([b, b + 1, b + 2], [10 * b, 10 * b + 1, 10 * b + 2]))
        batches = recorder.recent()
    url = s3_server.url()
    store = MetricsStore(url, storage_options=s3_server.storage_options, keep=2)
    assert store.checkpoint_ids() == [] and store.history() == []
    for m in batches:
        store.write(m)
    again = MetricsStore(url, storage_options=s3_server.storage_options)
    assert again.checkpoint_ids() == [3, 4]
    assert [m.batch_json() for m in again.history()] == [m.batch_json() for m in batches[2:]]
    assert again.url(4) == f"{url}/_metrics/batch-{4:020d}.arrow"


def test_the_spine_calls_its_commit_listener_once_per_committed_batch_and_never_fails_the_batch(tmp_path, caplog):
    """Metrics are recorded from one call in the batch's spine (JobDriver's ``on_commit``), for KeyedJob and the
    harness alike: once per committed batch, not for a replay (its first run recorded it), and a listener that
    raises is logged while the batch stands; the adapter builds the metrics from the typed batch it is handed."""
    import pickle

    from keygroups.checkpoint import CheckpointStorage
    from keygroups.metrics import batch_metrics
    from keygroups.runtime.batch import JobDriver, JobOptions
    from keygroups.runtime.local import LocalExecutor

    seen = []
    storage = CheckpointStorage(str(tmp_path / "chk"))
    driver = JobDriver(JobOptions(name="listened", key_columns=("k",), function=pickle.dumps(Count()),
                                  output_schema=pa.schema([("k", pa.int64()), ("n", pa.int64())]),
                                  max_parallelism=MP, timestamp_column="t"),
                       storage, fence=False, on_commit=lambda batch, executor: seen.append(batch_metrics(batch)))
    first = driver.run(LocalExecutor(records([1, 2, 3], [5, 6, 7])), parallelism=2, checkpoint_id=1)
    second = driver.run(LocalExecutor(records([1, 4], [8, 9])), parallelism=3)
    driver.run(LocalExecutor(records([1, 2, 3], [5, 6, 7])), parallelism=2, checkpoint_id=1)   # a replay
    assert [m.checkpoint_id for m in seen] == [1, 2]
    assert [m.records_in for m in seen] == [first.report.records_in, second.report.records_in] == [3, 2]
    assert seen[1].rescaled and seen[1].moved_bytes == second.report.assignment.moved_bytes > 0
    assert seen[1].wall_seconds == second.report.wall_seconds
    with pytest.raises(ValueError, match="replayed"):
        batch_metrics(driver.run(LocalExecutor(records([1, 4], [8, 9])), parallelism=3, checkpoint_id=2))

    def failing(batch, executor):
        raise RuntimeError("listener down")

    driver.on_commit = failing
    with caplog.at_level(logging.ERROR, logger="keygroups"):
        third = driver.run(LocalExecutor(records([5], [10])), parallelism=1)
    assert third.checkpoint_id == 3 and storage.latest().checkpoint_id == 3
    assert "the commit listener of job listened failed on checkpoint 3" in caplog.text
