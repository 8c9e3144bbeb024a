"""Unit tests of the demo's cart functions (keygroups.cli.shop), written with the harness as a user would write
them for their own function: a few events in, orders and abandoned carts out, the state of a user checked, time
moved by hand, and the carts carried through a rescale and a backend switch."""

from __future__ import annotations

import datetime

import pytest

from keygroups.cli import shop
from keygroups.runtime import WatermarkStrategy

T0 = shop.START_MS
MINUTE = 60_000


def event(user, kind, minute=0, item="item-001", qty=1, price=100):
    return {"user": user, "ts": T0 + minute * MINUTE, "kind": kind, "item": item, "qty": qty, "price": price}


@pytest.fixture
def cart(keygroups_harness):
    return keygroups_harness(shop.CartFunction(), "user", output_schema=shop.ORDER_SCHEMA,
                             input_schema=shop.EVENT_SCHEMA, order_by=["ts"])


@pytest.fixture
def abandoned(keygroups_harness):
    return keygroups_harness(shop.AbandonedCartFunction(), "user", output_schema=shop.CART_OUTPUT_SCHEMA,
                             input_schema=shop.EVENT_SCHEMA, order_by=["ts"], timestamp_column="ts",
                             watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(
                                 datetime.timedelta(minutes=1)))


def test_a_checkout_orders_the_cart_and_empties_it(cart):
    cart.process([event("ann", "add", 0, "item-001", 2, 150), event("ann", "add", 1, "item-002", 1, 400),
                  event("bob", "add", 1, "item-003", 5, 10)])
    assert cart.output() == []
    assert cart.state("ann", "cart") == {"item-001": shop.CartLine(2, 150), "item-002": shop.CartLine(1, 400)}
    cart.process([event("ann", "checkout", 2)])
    assert cart.output() == [{"user": "ann", "ts": T0 + 2 * MINUTE, "items": 3, "total": 700, "lifetime": 700}]
    assert cart.state("ann", "cart") == {}
    assert cart.state("ann", "spent") == 700
    assert cart.state("ann", "last_seen") == T0 + 2 * MINUTE
    assert cart.state("bob", "cart") == {"item-003": shop.CartLine(5, 10)}   # another user's cart is untouched


def test_the_lifetime_spend_adds_up_over_orders_and_batches(cart):
    cart.process([event("ann", "add", 0, qty=1, price=300), event("ann", "checkout", 1)])
    cart.process([event("ann", "add", 2, qty=2, price=50), event("ann", "checkout", 3)])
    assert [(o["total"], o["lifetime"]) for o in cart.output()] == [(300, 300), (100, 400)]


def test_removing_more_than_the_cart_holds_drops_the_line_and_an_empty_checkout_orders_nothing(cart):
    cart.process([event("ann", "add", 0, qty=2), event("ann", "remove", 1, qty=1)])
    assert cart.state("ann", "cart") == {"item-001": shop.CartLine(1, 100)}
    cart.process([event("ann", "remove", 2, qty=5), event("ann", "remove", 3, "item-009"),
                  event("ann", "checkout", 4)])
    assert cart.state("ann", "cart") == {}
    assert cart.output() == []
    assert cart.state("ann", "spent") is None


def test_the_viewed_price_is_the_average_of_the_views(cart):
    cart.process([event("ann", "view", 0, price=100), event("ann", "view", 1, price=301)])
    assert cart.state("ann", "viewed_price") == 200
    assert cart.state("nobody", "viewed_price") is None   # no view: no aggregate (as in Flink)


def test_an_idle_cart_is_reported_abandoned_once_the_watermark_passes_its_deadline(abandoned):
    abandoned.process([event("ann", "add", 0, qty=2, price=150)])
    deadline = T0 + 30 * MINUTE
    assert [(t.key, t.timestamp) for t in abandoned.timers()] == [("ann", deadline)]
    abandoned.advance_watermark(deadline - 1)
    assert abandoned.output() == []
    abandoned.advance_watermark(deadline)
    assert abandoned.output() == [{"kind": "abandoned", "user": "ann", "ts": deadline, "items": 2, "total": 300,
                                   "lifetime": None}]
    assert abandoned.timers() == []


def test_activity_moves_the_deadline_and_a_checkout_leaves_nothing_to_abandon(abandoned):
    abandoned.process([event("ann", "add", 0), event("bob", "add", 0)])
    abandoned.process([event("ann", "view", 20), event("bob", "checkout", 5)])
    assert [(t.key, t.timestamp) for t in abandoned.timers()] == [("bob", T0 + 35 * MINUTE),
                                                                 ("ann", T0 + 50 * MINUTE)]
    assert [o["kind"] for o in abandoned.output()] == ["order"]
    abandoned.advance_watermark(T0 + 60 * MINUTE)
    assert [(o["kind"], o["user"], o["ts"]) for o in abandoned.output()] == [("abandoned", "ann",
                                                                             T0 + 50 * MINUTE)]


def test_events_behind_the_watermark_are_late_and_never_reach_the_cart(abandoned):
    abandoned.process([event("ann", "add", 10)])   # watermark: 10 minutes - 1 minute - 1 ms
    report = abandoned.process([event("ann", "add", 5, "item-002"), event("ann", "add", 11, "item-003")])
    assert report.records_late == 1
    assert [e["item"] for e in abandoned.late()] == ["item-002"]
    assert set(abandoned.state("ann", "cart")) == {"item-001", "item-003"}


@pytest.mark.parametrize(("parallelism", "max_parallelism", "backend"), [(4, 128, "rocksdb"), (3, 256, "heap"),
                                                                         (1, 64, "rocksdb")])
def test_carts_and_deadlines_survive_a_rescale_and_a_backend_switch(abandoned, parallelism, max_parallelism,
                                                                    backend):
    users = [f"user-{i:03d}" for i in range(40)]
    abandoned.process([event(u, "add", i % 7, qty=1 + i % 3) for i, u in enumerate(users)])
    before = {u: abandoned.state(u, "cart") for u in users}
    restored = abandoned.restore(abandoned.snapshot(), parallelism=parallelism, max_parallelism=max_parallelism,
                                 backend=backend)
    assert {u: restored.state(u, "cart") for u in users} == before
    assert restored.timers() == abandoned.timers()
    restored.advance_watermark(T0 + 40 * MINUTE)
    out = restored.output()
    assert sorted(o["user"] for o in out) == users and {o["kind"] for o in out} == {"abandoned"}
    assert restored.timers() == []
