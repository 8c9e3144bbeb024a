"""Checkpoints written by the real backends, and what those backends show of them: the reference the state reader
is checked against (tests/test_state_reader.py without Spark, tests/test_spark_state_source.py on Spark).

:func:`build_chain` runs a few batches of all five state kinds on one backend, each batch at its own parallelism
(every subtask restores its key groups from the previous checkpoint, writes an incremental snapshot: deltas with
puts and deletes), and commits them as a job would. :func:`backend_view` restores the last checkpoint into one
backend over every key group and reads each state through the state API; ``Model.stamps`` are the TTL timestamps
the batches gave each entry (the backends' clock), which the state API does not show.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

from keygroups import KeyGroupRange, assign_to_key_group, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.runtime.backends import create_backend
from keygroups.serializers import Float64Serializer, Int64Serializer, StrSerializer, TupleSerializer
from keygroups.state import (
    AggregateFunction,
    AggregatingStateDescriptor,
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    ValueStateDescriptor,
)

MAXP = 16
BACKENDS = {"heap": HeapKeyedStateBackend, "rocksdb": RocksDBKeyedStateBackend}
STATES = ("v", "l", "m", "r", "a")
KINDS = {"v": "value", "l": "list", "m": "map", "r": "reducing", "a": "aggregating"}
T0 = 1_700_000_000.0   # the backends' clock at batch 0, seconds; batch b writes at T0 + b


class CountSum(AggregateFunction):
    """Accumulator (count, sum); its result is the accumulator, so the stored value is what ``get()`` shows."""

    def create_accumulator(self):
        return (0, 0)

    def add(self, value, acc):
        return (acc[0] + 1, acc[1] + value)

    def get_result(self, acc):
        return acc

    def merge(self, a, b):
        return (a[0] + b[0], a[1] + b[1])


def descriptors(ttl: bool) -> dict[str, Any]:
    ds = {
        "v": ValueStateDescriptor("v", TupleSerializer(Int64Serializer(), StrSerializer())),
        "l": ListStateDescriptor("l", Int64Serializer()),
        "m": MapStateDescriptor("m", StrSerializer(), Float64Serializer()),
        "r": ReducingStateDescriptor("r", operator.add, Int64Serializer()),
        "a": AggregatingStateDescriptor("a", CountSum(), TupleSerializer(Int64Serializer(), Int64Serializer())),
    }
    if ttl:
        for d in ds.values():
            d.enable_time_to_live(StateTtlConfig.new_builder(86400).build())
    return ds


@dataclass
class Model:
    """What the batches did, per state and key: the value as the state API shows it, and its TTL stamps (ms):
    one per key (value, reducing, aggregating), one per element (list), one per map key (map)."""

    values: dict[str, dict[Any, Any]] = field(default_factory=lambda: {s: {} for s in STATES})
    stamps: dict[str, dict[Any, Any]] = field(default_factory=lambda: {s: {} for s in STATES})


def _apply(states: dict[str, Any], model: Model, key: int, b: int) -> None:
    """Batch ``b``'s operations on ``key`` (the backend's current key), mirrored in ``model``."""
    now = int((T0 + b) * 1000)
    vals, stamps = model.values, model.stamps
    if (key + b) % 5 == 0 and key in vals["v"]:   # clear everything: deletes in the next delta
        for s in STATES:
            states[s].clear()
            vals[s].pop(key, None)
            stamps[s].pop(key, None)
        return
    if (key + b) % 3 == 0:
        return   # untouched this batch
    states["v"].update((key * 10 + b, f"k{key}b{b}"))
    vals["v"][key], stamps["v"][key] = (key * 10 + b, f"k{key}b{b}"), now
    states["l"].add(b)
    vals["l"].setdefault(key, []).append(b)
    stamps["l"].setdefault(key, []).append(now)
    if b % 2 and key in vals["m"] and len(vals["m"][key]) > 1:
        gone = sorted(vals["m"][key])[0]
        states["m"].remove(gone)
        del vals["m"][key][gone]
        del stamps["m"][key][gone]
    states["m"].put(f"m{b}", key + b / 4)
    vals["m"].setdefault(key, {})[f"m{b}"] = key + b / 4
    stamps["m"].setdefault(key, {})[f"m{b}"] = now
    states["r"].add(key + b)
    vals["r"][key], stamps["r"][key] = vals["r"].get(key, 0) + key + b, now
    states["a"].add(b)
    count, total = vals["a"].get(key, (0, 0))
    vals["a"][key], stamps["a"][key] = (count + 1, total + b), now


def build_chain(location: str, backend: str, ttl: bool, parallelisms: list[int], keys: list[int], *,
                job: str = "view") -> tuple[CheckpointStorage, CheckpointMetadata, Model]:
    """Batch ``b`` at ``parallelisms[b]`` applies :func:`_apply` to every key, committed as checkpoint ``b + 1``."""
    storage = CheckpointStorage(location, retain=10)
    model = Model()
    previous: CheckpointMetadata | None = None
    for b, p in enumerate(parallelisms):
        handles = []
        for subtask in range(p):
            r = key_group_range(MAXP, p, subtask)
            be = BACKENDS[backend](r, MAXP, Int64Serializer(), clock=lambda b=b: T0 + b, subtask_index=subtask)
            try:
                if previous is not None:
                    be.restore(storage, previous)
                states = {name: be.get_state(d) for name, d in descriptors(ttl).items()}
                for key in keys:
                    if assign_to_key_group(key, MAXP) in r:
                        be.set_current_key(key)
                        _apply(states, model, key, b)
                handles.append(be.snapshot(b + 1, storage).result())
            finally:
                be.dispose()
        storage.commit(CheckpointMetadata(b + 1, job, 0, MAXP, p, carry_forward(previous, handles)))
        previous = storage.load(b + 1)
    assert previous is not None
    return storage, previous, model


def latest_values(location: str | CheckpointStorage, state: ValueStateDescriptor, max_parallelism: int,
                  key_type: str) -> dict[Any, Any]:
    """Each key's value of ``state`` in the latest checkpoint at ``location`` (a path, or the storage itself),
    restored into one heap backend over all key groups (``key_type`` as ``create_backend`` takes it)."""
    storage = location if isinstance(location, CheckpointStorage) else CheckpointStorage(location)
    backend = create_backend("heap", key_group_range(max_parallelism, 1, 0), max_parallelism, key_type)
    try:
        backend.restore(storage, storage.latest())
        values = backend.get_state(state)
        out = {}
        for key in list(backend.keys(state.name)):
            backend.set_current_key(key)
            out[key] = values.value()
        return out
    finally:
        backend.dispose()


def backend_view(storage: CheckpointStorage, metadata: CheckpointMetadata, backend: str, ttl: bool
                 ) -> dict[str, dict[Any, Any]]:
    """Each state's keys and values as a backend restored from ``metadata`` over every key group shows them."""
    clock = T0 + 10   # later than every write, well inside the TTL
    be = BACKENDS[backend](KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer(), clock=lambda: clock)
    try:
        be.restore(storage, metadata)
        states = {name: be.get_state(d) for name, d in descriptors(ttl).items()}
        view: dict[str, dict[Any, Any]] = {}
        for name in STATES:
            view[name] = {}
            for key in list(be.keys(name)):
                be.set_current_key(key)
                s = states[name]
                view[name][key] = (s.value() if name == "v" else list(s.get()) if name == "l"
                                   else dict(s.items()) if name == "m" else s.get())
        return view
    finally:
        be.dispose()


def expected_rows(view: dict[str, dict[Any, Any]], model: Model, state: str, *, ttl: bool, flatten: bool
                  ) -> list[tuple]:
    """The reader's rows for ``state`` (as plain tuples, sorted) from the backend's view and the model's stamps:
    (key, key_group, value[, ttl stamps]) or, flattened, (key, key_group, index / map_key, value[, stamp])."""
    rows = []
    for key, value in view[state].items():
        kg = assign_to_key_group(key, MAXP)
        stamps = model.stamps[state][key]
        if state == "l" and flatten:
            rows += [(key, kg, i, e) + ((stamps[i],) if ttl else ()) for i, e in enumerate(value)]
        elif state == "m" and flatten:
            rows += [(key, kg, k, x) + ((stamps[k],) if ttl else ()) for k, x in value.items()]
        elif state == "m":
            rows.append((key, kg, value) + ((dict(stamps),) if ttl else ()))
        else:
            rows.append((key, kg, value) + ((stamps,) if ttl else ()))
    return sorted(rows, key=repr)
