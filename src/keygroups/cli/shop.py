"""The demo's workload: shopping events per user, a keyed cart function, and a plain reference computation.

Events live in a partitioned log, each user's events in one partition in time order (as a Kafka topic keyed by
user). The cart function keeps, per user: the cart (MapState item -> (quantity, unit price)), the last event time
(ValueState), the lifetime amount spent (ReducingState, a sum) and the average price of viewed items
(AggregatingState). Every checkout emits an order row. The reference computes the same with dicts in one process.
"""

from __future__ import annotations

import operator
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from keygroups.runtime.functions import KeyedProcessFunction, ProcessContext, RuntimeContext
from keygroups.serializers import Int64Serializer, StrSerializer, TupleSerializer
from keygroups.state import (
    AggregateFunction,
    AggregatingStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)

KINDS = ("view", "add", "remove", "checkout")
KIND_WEIGHTS = (0.55, 0.25, 0.08, 0.12)
N_ITEMS = 500

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


def user_name(i: int) -> str:
    return f"user-{i:06d}"


def partition_of(user: str, partitions: int) -> int:
    """The log partition of a user's events (a stable hash, unrelated to key groups on purpose)."""
    return zlib.crc32(user.encode()) % partitions


def generate_events(n_events: int, n_users: int, partitions: int, seed: int = 7) -> dict[int, list[dict[str, Any]]]:
    """Realistic-looking events: a skewed user popularity, a few hundred items with fixed prices, per partition in
    time order."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.power(np.arange(1, n_users + 1), 0.6)
    users = rng.choice(n_users, size=n_events, p=weights / weights.sum())
    kinds = rng.choice(len(KINDS), size=n_events, p=KIND_WEIGHTS)
    items = rng.integers(0, N_ITEMS, size=n_events)
    qty = rng.integers(1, 4, size=n_events)
    prices = 100 + (items * 7919) % 9900
    ts = 1_700_000_000_000 + np.cumsum(rng.integers(1, 50, size=n_events))
    out: dict[int, list[dict[str, Any]]] = {p: [] for p in range(partitions)}
    names = [user_name(i) for i in range(n_users)]
    kind_names = list(KINDS)
    for u, k, it, q, pr, t in zip(users.tolist(), kinds.tolist(), items.tolist(), qty.tolist(), prices.tolist(),
                                  ts.tolist()):
        user = names[u]
        out[partition_of(user, partitions)].append(
            {"user": user, "ts": t, "kind": kind_names[k], "item": f"item-{it:03d}", "qty": q, "price": pr})
    return out


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


PAIR = TupleSerializer(Int64Serializer(), Int64Serializer())
CART = MapStateDescriptor("cart", StrSerializer(), PAIR)
LAST_SEEN = ValueStateDescriptor("last_seen", Int64Serializer())
SPENT = ReducingStateDescriptor("spent", operator.add, Int64Serializer())
VIEWED = AggregatingStateDescriptor("viewed_price", AveragePrice(), PAIR)


class CartFunction(KeyedProcessFunction):
    """The per-user cart, keyed by ``user``."""

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
            self.cart.put(item, ((held[0] if held else 0) + event["qty"], event["price"]))
        elif kind == "remove":
            held = self.cart.get(item)
            if held is not None:
                left = held[0] - event["qty"]
                if left > 0:
                    self.cart.put(item, (left, held[1]))
                else:
                    self.cart.remove(item)
        elif kind == "checkout":
            lines = list(self.cart.items())
            if lines:
                total = sum(q * p for _, (q, p) in lines)
                self.spent.add(total)
                self.cart.clear()
                return [(context.current_key, event["ts"], sum(q for _, (q, _p) in lines), total, self.spent.get())]
        return None


@dataclass
class UserState:
    """One user's state, as the reference keeps it and as it is read back from a checkpoint."""

    cart: dict[str, tuple[int, int]] = field(default_factory=dict)
    last_seen: int | None = None
    spent: int | None = None
    viewed_price: int | None = None


def reference(partitions: dict[int, list[dict[str, Any]]]) -> tuple[dict[str, UserState], list[tuple]]:
    """The same computation with plain dicts, one event after another: final state per user and all orders."""
    users: dict[str, UserState] = {}
    viewed: dict[str, tuple[int, int]] = {}
    orders: list[tuple] = []
    for records in partitions.values():
        for e in records:
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
                total = sum(q * p for q, p in u.cart.values())
                u.spent = (u.spent or 0) + total
                orders.append((e["user"], e["ts"], sum(q for q, _ in u.cart.values()), total, u.spent))
                u.cart = {}
    return users, orders


def read_user_states(backend: Any) -> Iterator[tuple[str, UserState]]:
    """Every user's state from a restored keyed backend (e.g. one backend over all key groups)."""
    cart, last_seen, spent, viewed = (backend.get_state(d) for d in (CART, LAST_SEEN, SPENT, VIEWED))
    for user in list(backend.keys(LAST_SEEN.name)):
        backend.set_current_key(user)
        yield user, UserState(
            cart={k: tuple(v) for k, v in cart.items()},
            last_seen=last_seen.value(),
            spent=spent.get(),
            viewed_price=viewed.get(),
        )
