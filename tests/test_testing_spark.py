"""The harness and ``KeyedJob`` on local Spark run one function alike: the demo's event-time cart function over the
same batches, rescaled the same way (the harness through snapshot and restore), give the same output, late
records, watermarks, and the same state and timers (both read with the state reader from their checkpoints)."""

from __future__ import annotations

import datetime

import pyarrow as pa
import pytest

from keygroups.checkpoint import CheckpointStorage
from keygroups.cli import shop
from keygroups.runtime import WatermarkStrategy
from keygroups.runtime.state_reader import KeyedStateReader, read_timers
from keygroups import KeyGroupRange

pytestmark = pytest.mark.spark

INPUT = pa.schema([*shop.EVENT_SCHEMA, ("seq", pa.int64())])
HOUR = 3_600_000
MAX_PARALLELISM = 32
STATES = ("cart", "last_seen", "spent", "viewed_price")


def batches():
    arrivals = shop.generate_arrivals(1500, 80, 3, 4, seed=27, span_ms=4 * HOUR, delayed=0.05, max_delay_ms=HOUR)
    seq, out = 0, []
    for arriving in arrivals:
        rows = []
        for partition in sorted(arriving):
            for e in arriving[partition]:
                rows.append({**e, "seq": seq})
                seq += 1
        out.append(pa.Table.from_pylist(rows, schema=INPUT))
    return out


def state_rows(location, metadata):
    storage = CheckpointStorage(location)
    everything = KeyGroupRange(0, metadata.max_parallelism - 1)
    rows = {}
    for state in STATES:
        reader = KeyedStateReader(storage, metadata, state, key_columns=["user"])
        rows[state] = sorted((repr(r) for b in reader.read(everything) for r in b.to_pylist()))
    rows["timers"] = sorted(repr(r) for r in read_timers(storage, metadata, key_columns=["user"]).to_pylist())
    return rows


def test_a_function_behaves_in_the_harness_as_in_a_keyed_job_on_spark(spark, tmp_path, keygroups_harness):
    from keygroups.spark import KeyedJob

    strategy = WatermarkStrategy.for_bounded_out_of_orderness(datetime.timedelta(minutes=5))
    options = dict(output_schema=shop.CART_OUTPUT_SCHEMA, max_parallelism=MAX_PARALLELISM, order_by=["seq"],
                   timestamp_column="ts", watermark_strategy=strategy, late_records="output")
    job = KeyedJob("carts", "user", shop.AbandonedCartFunction(), checkpoint_location=str(tmp_path / "job"),
                   **options)
    schedule = [2, 3, 1, 4]
    harness = keygroups_harness(shop.AbandonedCartFunction(), "user", input_schema=INPUT,
                                parallelism=schedule[0], **options)
    kinds, late = set(), 0
    for parallelism, table in zip(schedule, batches()):
        if parallelism != harness.parallelism:
            harness = harness.restore(harness.snapshot(), parallelism=parallelism)
        ours = harness.process(table)
        theirs = job.run_batch(spark.createDataFrame(table.to_pandas()), parallelism=parallelism)
        out = harness.output()
        kinds |= {r["kind"] for r in out}
        late += ours.records_late
        assert sorted(map(repr, out)) == sorted(repr(r.asDict()) for r in theirs.output.collect())
        assert sorted(map(repr, harness.late())) == sorted(repr(r.asDict()) for r in theirs.late_output.collect())
        assert ours.watermark == theirs.watermark and ours.records_late == theirs.records_late
        assert ours.records_in == theirs.records_in == table.num_rows
        assert ours.metadata.properties["timers"]["event-time"]["fired"] == (
            theirs.metadata.properties["timers"]["event-time"]["fired"])
    assert kinds == {"order", "abandoned"} and late > 0   # orders, abandoned carts and late events all compared
    assert state_rows(harness.storage.location, harness.checkpoint) == state_rows(str(tmp_path / "job"),
                                                                                  job.latest_checkpoint())
    # the harness's own reading of a user's state is the state reader's view of the job's checkpoint
    job_carts = {}
    reader = KeyedStateReader(CheckpointStorage(str(tmp_path / "job")), job.latest_checkpoint(), "cart",
                              key_columns=["user"])
    for batch in reader.read(KeyGroupRange(0, MAX_PARALLELISM - 1)):
        for row in batch.to_pylist():
            job_carts[row["user"]] = {k: shop.CartLine(**v) for k, v in row["value"]}   # struct -> record
    users = {u for t in batches() for u in t.column("user").to_pylist()}
    assert any(job_carts.values())
    for user in sorted(users):
        assert harness.state(user, "cart") == job_carts.get(user, {}), user
