"""The demo's cart job on event time (AbandonedCartFunction) through the driver and subtasks without Spark, against
the plain event-time reference: state and timers, orders, each abandoned cart in the batch it fired in, late
events; timers set at one parallelism fire at another."""

from __future__ import annotations

import datetime

import pytest

from keygroups.cli import shop
from keygroups.runtime import WatermarkStrategy
from keygroups.sources import PartitionedLogWriter

from shop_runtime import final_states, run_batch

HOUR_MS = 3_600_000
DELAY = datetime.timedelta(minutes=5)


def run_on_event_time(tmp_path, schedule, backend, n_events=2400, n_users=200, partitions=4, seed=5):
    """Run one batch per entry of ``schedule`` (its parallelism), the log growing by an hour of events before
    each; returns the reference and what the job emitted: orders, (batch, abandoned row), late events."""
    arrivals = shop.generate_arrivals(n_events, n_users, partitions, len(schedule), seed=seed,
                                      span_ms=len(schedule) * HOUR_MS, delayed=0.03, max_delay_ms=HOUR_MS)
    expected = shop.event_time_reference(arrivals, out_of_orderness_ms=DELAY // datetime.timedelta(milliseconds=1),
                                         abandoned_after_ms=shop.ABANDONED_AFTER // datetime.timedelta(milliseconds=1))
    log_dir, location = str(tmp_path / "log"), str(tmp_path / "chk")
    log = PartitionedLogWriter(log_dir)
    for partition in range(partitions):
        log.create(partition)
    orders, abandoned, late = [], [], 0
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(DELAY)
    for batch, (parallelism, arriving) in enumerate(zip(schedule, arrivals)):
        for partition, records in arriving.items():
            log.append(partition, records)
        metadata, table, _ = run_batch(location, log_dir, shop.AbandonedCartFunction(), parallelism, None,
                                       backend=backend, watermark_strategy=strategy,
                                       output_schema=shop.CART_OUTPUT_SCHEMA)
        late += metadata.properties["records_late"]
        for row in zip(*[table.column(n).to_pylist() for n in shop.CART_OUTPUT_SCHEMA.names]):
            if row[0] == "order":
                orders.append(row[1:])
            else:
                abandoned.append((batch, row[1:]))
    return expected, final_states(location), orders, abandoned, late


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_abandoned_carts_match_the_reference_across_rescales(tmp_path, backend):
    schedule = [3, 3, 1, 4, 4, 2]
    expected, state, orders, abandoned, late = run_on_event_time(tmp_path, schedule, backend)
    assert state == expected.users
    assert sorted(orders) == sorted(expected.orders)
    assert sorted(abandoned) == sorted((fired, row) for _, fired, row in expected.abandoned)
    assert late == expected.late > 0
    # timers still pending at the end are in the state, and some fired at another parallelism than they were set at
    assert any(u.timers for u in state.values())
    assert any(schedule[set_in] != schedule[fired] for set_in, fired, _ in expected.abandoned)
    assert any(schedule[set_in] == schedule[fired] for set_in, fired, _ in expected.abandoned)


def test_the_reference_drops_late_events_and_fires_after_the_watermark():
    base = shop.START_MS
    minute = 60_000

    def event(user, ts, kind="add"):
        return {"user": user, "ts": ts, "kind": kind, "item": "item-001", "qty": 1, "price": 100}

    batches = [
        {0: [event("a", base), event("b", base + 10 * minute), event("c", base + 40 * minute, "view")]},
        # watermark now base + 35 min - 1 ms: a's timer (base + 30 min) fired; b's (base + 40 min) did not
        {0: [event("b", base + 36 * minute, "checkout"), event("a", base + 35 * minute - 1),
             event("c", base + 100 * minute, "view")]},
    ]
    expected = shop.event_time_reference(batches, out_of_orderness_ms=5 * minute, abandoned_after_ms=30 * minute)
    assert expected.late == 1                       # a at the watermark exactly
    # b checked out before its timer (moved to 66 min) fired; c never had a cart
    assert expected.abandoned == [(0, 0, ("a", base + 30 * minute, 1, 100, None))]
    assert [u.timers for u in expected.users.values()] == [(), (), (base + 130 * minute,)]
    assert expected.orders == [("b", base + 36 * minute, 1, 100, 100)]
