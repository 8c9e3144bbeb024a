"""The demo's workload: shopping events per user, a keyed cart function, and a plain reference computation.

Events live in a partitioned log, each user's events in one partition in arrival order (as a Kafka topic keyed by
user). The cart function keeps, per user: the cart (MapState item -> a :class:`CartLine` record of quantity and unit
price, stored with ``RecordSerializer``, so the state reader shows it as a struct), the last event time
(ValueState), the lifetime amount spent (ReducingState, a sum) and the average price of viewed items
(AggregatingState). Every checkout emits an order row. On event time, :class:`AbandonedCartFunction` also keeps an
event-time timer per user and emits an "abandoned" row for a cart left alone too long. The references compute the
same with dicts in one process.
"""

from __future__ import annotations

import datetime
import operator
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from keygroups.runtime.functions import KeyedProcessFunction, ProcessContext, RuntimeContext
from keygroups.serializers import Int64Serializer, RecordSerializer, StrSerializer, TupleSerializer
from keygroups.state import (
    AggregateFunction,
    AggregatingStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from keygroups.state.timers import TimeDomain, timer_descriptor

KINDS = ("view", "add", "remove", "checkout")
KIND_WEIGHTS = (0.55, 0.25, 0.08, 0.12)
N_ITEMS = 500
START_MS = 1_700_000_000_000   # event time of the first event (epoch ms, November 2023)

#: How long after a user's latest activity (in event time) a cart still in use counts as abandoned.
ABANDONED_AFTER = datetime.timedelta(minutes=30)

EVENT_SCHEMA = pa.schema([
    ("user", pa.string()),
    ("ts", pa.int64()),
    ("kind", pa.string()),
    ("item", pa.string()),
    ("qty", pa.int64()),
    ("price", pa.int64()),
])

ORDER_SCHEMA = pa.schema([
    ("user", pa.string()),
    ("ts", pa.int64()),
    ("items", pa.int64()),
    ("total", pa.int64()),
    ("lifetime", pa.int64()),
])

#: The output of :class:`AbandonedCartFunction`: ``kind`` ("order" or "abandoned"), then an order's columns.
CART_OUTPUT_SCHEMA = pa.schema([("kind", pa.string()), *ORDER_SCHEMA])


def user_name(i: int) -> str:
    return f"user-{i:06d}"


def partition_of(user: str, partitions: int) -> int:
    """The log partition of a user's events (a stable hash, unrelated to key groups on purpose)."""
    return zlib.crc32(user.encode()) % partitions


def generate_arrivals(n_events: int, n_users: int, partitions: int, batches: int, seed: int = 7, *,
                      span_ms: int | None = None, delayed: float = 0.0,
                      max_delay_ms: int = 0) -> list[dict[int, list[dict[str, Any]]]]:
    """Realistic-looking events: a skewed user popularity, a few hundred items with fixed prices, in the order they
    arrive in the log, split into ``batches`` equal runs of arrivals (what the log gains before each micro-batch),
    each run per partition.

    Event time follows arrival: consecutive events are 1-49 ms apart, or, with ``span_ms``, spread in the same
    proportions over ``span_ms``. A fraction ``delayed`` of the events arrives late: its event time lies up to
    ``max_delay_ms`` before its place in the log (out of order, and behind the watermark if delayed enough)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.power(np.arange(1, n_users + 1), 0.6)
    users = rng.choice(n_users, size=n_events, p=weights / weights.sum())
    kinds = rng.choice(len(KINDS), size=n_events, p=KIND_WEIGHTS)
    items = rng.integers(0, N_ITEMS, size=n_events)
    qty = rng.integers(1, 4, size=n_events)
    prices = 100 + (items * 7919) % 9900
    steps = np.cumsum(rng.integers(1, 50, size=n_events))
    if span_ms is not None:
        steps = steps * span_ms // max(int(steps[-1]) if n_events else 1, 1)
    ts = START_MS + steps
    if delayed:
        lag = np.where(rng.random(n_events) < delayed, rng.integers(0, max_delay_ms + 1, size=n_events), 0)
        ts = ts - lag
    names = [user_name(i) for i in range(n_users)]
    kind_names = list(KINDS)
    arrivals: list[dict[int, list[dict[str, Any]]]] = []
    for b in range(batches):
        out: dict[int, list[dict[str, Any]]] = {p: [] for p in range(partitions)}
        start, stop = b * n_events // batches, (b + 1) * n_events // batches
        for u, k, it, q, pr, t in zip(users[start:stop].tolist(), kinds[start:stop].tolist(),
                                      items[start:stop].tolist(), qty[start:stop].tolist(),
                                      prices[start:stop].tolist(), ts[start:stop].tolist()):
            user = names[u]
            out[partition_of(user, partitions)].append(
                {"user": user, "ts": t, "kind": kind_names[k], "item": f"item-{it:03d}", "qty": q, "price": pr})
        arrivals.append(out)
    return arrivals


def generate_events(n_events: int, n_users: int, partitions: int, seed: int = 7) -> dict[int, list[dict[str, Any]]]:
    """The events of :func:`generate_arrivals` all at once, per partition in time order."""
    return generate_arrivals(n_events, n_users, partitions, 1, seed)[0]


class AveragePrice(AggregateFunction):
    """Average of prices, with a (sum, count) accumulator."""

    def create_accumulator(self) -> tuple[int, int]:
        return (0, 0)

    def add(self, value: int, accumulator: tuple[int, int]) -> tuple[int, int]:
        return (accumulator[0] + value, accumulator[1] + 1)

    def get_result(self, accumulator: tuple[int, int]) -> int:
        return accumulator[0] // accumulator[1] if accumulator[1] else 0

    def merge(self, a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
        return (a[0] + b[0], a[1] + b[1])


@dataclass(frozen=True)
class CartLine:
    """One line of a cart: how many of the item, at what unit price (cents)."""

    quantity: int
    unit_price: int


PAIR = TupleSerializer(Int64Serializer(), Int64Serializer())
#: Carts of checkpoints written before carts were records (a TupleSerializer of two longs) restore into CartLine
#: records: RecordSerializer migrates tuple state field by field.
CART = MapStateDescriptor("cart", StrSerializer(), RecordSerializer(CartLine))
LAST_SEEN = ValueStateDescriptor("last_seen", Int64Serializer())
SPENT = ReducingStateDescriptor("spent", operator.add, Int64Serializer())
VIEWED = AggregatingStateDescriptor("viewed_price", AveragePrice(), PAIR)


def cart_totals(cart: Any) -> tuple[int, int]:
    """(items, value) of a cart's ``(item, line)`` pairs, a line a CartLine or a (quantity, unit price) pair."""
    items = value = 0
    for _, line in cart:
        quantity, price = (line.quantity, line.unit_price) if isinstance(line, CartLine) else line
        items += quantity
        value += quantity * price
    return items, value


class CartFunction(KeyedProcessFunction):
    """The per-user cart, keyed by ``user``; emits an ``ORDER_SCHEMA`` row per checkout of a non-empty cart."""

    def open(self, context: RuntimeContext) -> None:
        self.cart = context.get_state(CART)
        self.last_seen = context.get_state(LAST_SEEN)
        self.spent = context.get_state(SPENT)
        self.viewed = context.get_state(VIEWED)

    def process_element(self, event: dict[str, Any], context: ProcessContext) -> list[tuple] | None:
        self.last_seen.update(event["ts"])
        kind, item = event["kind"], event["item"]
        if kind == "view":
            self.viewed.add(event["price"])
        elif kind == "add":
            held = self.cart.get(item)
            self.cart.put(item, CartLine((held.quantity if held else 0) + event["qty"], event["price"]))
        elif kind == "remove":
            held = self.cart.get(item)
            if held is not None:
                left = held.quantity - event["qty"]
                if left > 0:
                    self.cart.put(item, CartLine(left, held.unit_price))
                else:
                    self.cart.remove(item)
        elif kind == "checkout":
            items, total = cart_totals(self.cart.items())
            if items:
                self.spent.add(total)
                self.cart.clear()
                return [(context.current_key, event["ts"], items, total, self.spent.get())]
        return None


class AbandonedCartFunction(CartFunction):
    """The cart on event time (the job's timestamp column is ``ts``), with abandoned carts.

    Every event moves the user's one event-time timer to ``abandoned_after`` past the user's latest activity (the
    previous timer is deleted; an event older than the latest activity leaves it). When the watermark passes the
    timer and the cart still holds items (no checkout emptied it since), an "abandoned" row is emitted: the timer's
    time, the cart's items and value, the lifetime spend. Output: ``CART_OUTPUT_SCHEMA``, orders as kind "order"."""

    def __init__(self, abandoned_after: datetime.timedelta = ABANDONED_AFTER) -> None:
        self.abandoned_after_ms = abandoned_after // datetime.timedelta(milliseconds=1)

    def process_element(self, event: dict[str, Any], context: ProcessContext) -> list[tuple] | None:
        orders = super().process_element(event, context)
        if not context.has_timestamp:
            raise ValueError("AbandonedCartFunction runs on event time: give the job timestamp_column='ts'")
        timers = context.timer_service
        deadline = context.timestamp + self.abandoned_after_ms
        pending = timers.registered_timers(TimeDomain.EVENT_TIME)
        if not pending or pending[-1] < deadline:
            for timestamp in pending:
                timers.delete_event_time_timer(timestamp)
            timers.register_event_time_timer(deadline)
        return [("order", *order) for order in orders] if orders else None

    def on_timer(self, timestamp: int, context: ProcessContext) -> list[tuple] | None:
        items, value = cart_totals(self.cart.items())
        if not items:
            return None
        return [("abandoned", context.current_key, timestamp, items, value, self.spent.get())]


@dataclass
class UserState:
    """One user's state, as the reference keeps it and as it is read back from a checkpoint."""

    cart: dict[str, tuple[int, int]] = field(default_factory=dict)
    last_seen: int | None = None
    spent: int | None = None
    viewed_price: int | None = None
    timers: tuple[int, ...] = ()   # event-time timers still registered, earliest first


def _apply(users: dict[str, UserState], viewed: dict[str, tuple[int, int]], e: dict[str, Any]) -> tuple | None:
    """One event on the reference's dicts; the order it places (an ``ORDER_SCHEMA`` tuple), if any."""
    u = users.setdefault(e["user"], UserState())
    u.last_seen = e["ts"]
    kind, item = e["kind"], e["item"]
    if kind == "view":
        s, c = viewed.get(e["user"], (0, 0))
        viewed[e["user"]] = (s + e["price"], c + 1)
        u.viewed_price = (s + e["price"]) // (c + 1)
    elif kind == "add":
        q = u.cart.get(item, (0, 0))[0]
        u.cart[item] = (q + e["qty"], e["price"])
    elif kind == "remove" and item in u.cart:
        left = u.cart[item][0] - e["qty"]
        if left > 0:
            u.cart[item] = (left, u.cart[item][1])
        else:
            del u.cart[item]
    elif kind == "checkout" and u.cart:
        items, total = cart_totals(u.cart.items())
        u.spent = (u.spent or 0) + total
        u.cart = {}
        return (e["user"], e["ts"], items, total, u.spent)
    return None


def reference(partitions: dict[int, list[dict[str, Any]]]) -> tuple[dict[str, UserState], list[tuple]]:
    """The same computation with plain dicts, one event after another: final state per user and all orders."""
    users: dict[str, UserState] = {}
    viewed: dict[str, tuple[int, int]] = {}
    orders: list[tuple] = []
    for records in partitions.values():
        for e in records:
            order = _apply(users, viewed, e)
            if order is not None:
                orders.append(order)
    return users, orders


@dataclass
class EventTimeReference:
    """What :func:`event_time_reference` computes."""

    users: dict[str, UserState]
    orders: list[tuple]
    #: (batch the timer was set in, batch it fired in, ``ORDER_SCHEMA`` row with the timer's time as ``ts``)
    abandoned: list[tuple[int, int, tuple]]
    late: int   # events dropped: at or before the watermark their batch started with


def event_time_reference(batches: list[dict[int, list[dict[str, Any]]]], *, out_of_orderness_ms: int,
                         abandoned_after_ms: int) -> EventTimeReference:
    """:class:`AbandonedCartFunction` over micro-batches with plain dicts, written from the semantics: a batch
    drops the events at or before the watermark it started with, applies the rest in log order, moves the
    watermark to (its largest event time - ``out_of_orderness_ms`` - 1 ms) if that is later, and then fires
    every timer at or before it: a non-empty cart is abandoned."""
    users: dict[str, UserState] = {}
    viewed: dict[str, tuple[int, int]] = {}
    orders: list[tuple] = []
    abandoned: list[tuple[int, int, tuple]] = []
    timers: dict[str, tuple[int, int]] = {}   # user -> (deadline, batch it was set in)
    watermark: int | None = None
    late = 0
    for number, batch in enumerate(batches):
        latest: int | None = None
        for records in batch.values():
            for e in records:
                latest = e["ts"] if latest is None else max(latest, e["ts"])
                if watermark is not None and e["ts"] <= watermark:
                    late += 1
                    continue
                order = _apply(users, viewed, e)
                if order is not None:
                    orders.append(order)
                deadline = e["ts"] + abandoned_after_ms
                if e["user"] not in timers or timers[e["user"]][0] < deadline:
                    timers[e["user"]] = (deadline, number)
        if latest is not None:
            candidate = latest - out_of_orderness_ms - 1
            watermark = candidate if watermark is None else max(watermark, candidate)
        for user, (deadline, set_in) in list(timers.items()):
            if watermark is not None and deadline <= watermark:
                del timers[user]
                u = users[user]
                if u.cart:
                    abandoned.append((set_in, number, (user, deadline, *cart_totals(u.cart.items()), u.spent)))
    for user, (deadline, _) in timers.items():
        users[user].timers = (deadline,)
    return EventTimeReference(users, orders, abandoned, late)


def read_user_states(backend: Any) -> Iterator[tuple[str, UserState]]:
    """Every user's state from a restored keyed backend (e.g. one backend over all key groups), with the user's
    registered event-time timers (the hidden timer state)."""
    cart, last_seen, spent, viewed, timers = (backend.get_state(d) for d in (
        CART, LAST_SEEN, SPENT, VIEWED, timer_descriptor(TimeDomain.EVENT_TIME)))
    for user in list(backend.keys(LAST_SEEN.name)):
        backend.set_current_key(user)
        yield user, UserState(
            cart={k: (v.quantity, v.unit_price) for k, v in cart.items()},
            last_seen=last_seen.value(),
            spent=spent.get(),
            viewed_price=viewed.get(),
            timers=tuple(sorted(timers.keys())),
        )
