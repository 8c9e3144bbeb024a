"""Record values are checked where they are written (issue 31: the heap backend took a dict missing a not-null field
at ``update()``, returned it from ``value()``, and failed only at the snapshot, inside a Spark traceback). On the heap
every write of every state kind (with and without TTL) refuses a value the record serializer could not write, with
the ``StateSerializationError`` RocksDB raises for it (state, kind, serializers, key, and the field in the
serializer's words), and the state keeps what it had; a model-based run interleaves good and bad writes with
snapshots and restores. RocksDB refuses the same values when it writes them to its database, at the latest at the
snapshot, with the same message."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups import key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.errors import StateSerializationError
from keygroups.serializers import Int64Serializer, RecordSerializer, StrSerializer
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

SER = RecordSerializer("user string not null, visits bigint not null, tags array<string>")
KEY = RecordSerializer("user string not null, visits bigint not null", form="tuple")   # map keys: hashable
GOOD = {"user": "u", "visits": 1, "tags": ["a"]}
GOOD2 = {"user": "w", "visits": 2, "tags": None}
BAD = [
    ({"visits": 1}, "field 'user' (string not null) is not nullable, got None"),
    ({"user": "u", "visits": 2**64}, "field 'visits' (bigint not null): 18446744073709551616 is out of range"),
    ({"user": "u", "visits": "1"}, "field 'visits' (bigint not null) expects an int"),
    ({"user": "u", "visits": 1, "tags": "abc"}, "field 'tags' (array<string>) expects a list"),
    ({"user": "u", "visits": 1, "extra": 0}, "has no field(s) ['extra']"),
    (("u", 1), "has 3 fields"),
]


class Merge(AggregateFunction):
    """An aggregate whose accumulator is the record; ``add`` of a bad record leaves a bad accumulator."""

    def create_accumulator(self):
        return None

    def add(self, value, accumulator):
        return value

    def get_result(self, accumulator):
        return accumulator

    def merge(self, a, b):
        return b


def descriptors(ttl: bool) -> dict:
    ds = {"value": ValueStateDescriptor("value", SER), "list": ListStateDescriptor("list", SER),
          "map": MapStateDescriptor("map", StrSerializer(), SER),
          "map key": MapStateDescriptor("map key", KEY, StrSerializer()),
          "reducing": ReducingStateDescriptor("reducing", lambda a, b: b, SER),
          "aggregating": AggregatingStateDescriptor("aggregating", Merge(), SER)}
    if ttl:
        for d in ds.values():
            d.enable_time_to_live(StateTtlConfig.new_builder(10**6).build())
    return ds


def writes(states: dict, bad: object) -> dict:
    """Each write method of each state, with the bad value; and what the state should hold after (unchanged)."""
    return {
        "value.update": lambda: states["value"].update(bad),
        "list.add": lambda: states["list"].add(bad),
        "list.add_all": lambda: states["list"].add_all([GOOD2, bad]),
        "list.update": lambda: states["list"].update([GOOD2, bad]),
        "map.put": lambda: states["map"].put("k", bad),
        "map.put_all": lambda: states["map"].put_all({"j": GOOD2, "k": bad}),
        "map key.put": lambda: states["map key"].put(("u", 2**64), "x"),
        "reducing.add": lambda: states["reducing"].add(bad),
        "aggregating.add": lambda: states["aggregating"].add(bad),
    }


def contents(states: dict) -> tuple:
    return (states["value"].value(), states["list"].get(), sorted(states["map"].items()),
            [k for k, _ in states["map key"].items()], states["reducing"].get(), states["aggregating"].get())


@pytest.mark.parametrize("ttl", [False, True], ids=["plain", "ttl"])
@pytest.mark.parametrize("bad, words", BAD, ids=[w.split(":")[0][:30] for _, w in BAD])
def test_the_heap_refuses_a_bad_record_where_it_is_written(ttl, bad, words):
    with HeapKeyedStateBackend(key_group_range(16, 1, 0), 16, Int64Serializer()) as b:
        states = {n: b.get_state(d) for n, d in descriptors(ttl).items()}
        b.set_current_key(7)
        states["value"].update(GOOD)
        states["list"].add(GOOD)
        states["map"].put("k", GOOD)
        states["map key"].put(("u", 1), "x")
        states["reducing"].add(GOOD)
        states["aggregating"].add(GOOD)
        before = contents(states)
        for name, write in writes(states, bad).items():
            with pytest.raises(StateSerializationError) as info:
                write()
            msg = str(info.value)
            state = name.split(".")[0]
            assert f"state {state!r}" in msg and "cannot write the entry of key 7" in msg, msg
            if state == "map key":
                assert "field 'visits' (bigint not null): 18446744073709551616 is out of range" in msg
            else:
                assert "RecordSerializer('user string not null, visits bigint not null, tags array<string>')" in msg
                assert words in msg, msg
            assert contents(states) == before, name   # nothing of the refused write is kept


@pytest.mark.parametrize("bad, words", BAD[:2], ids=["null", "overflow"])
def test_rocksdb_refuses_the_same_values_with_the_same_words(bad, words, tmp_path):
    """RocksDB refuses at the write too, with the heap's words."""
    for backend in (HeapKeyedStateBackend, RocksDBKeyedStateBackend):
        with backend(key_group_range(16, 1, 0), 16, Int64Serializer()) as b:
            state = b.get_state(ValueStateDescriptor("value", SER))
            b.set_current_key(7)
            with pytest.raises(StateSerializationError) as info:
                state.update(bad)
                b.snapshot(1, CheckpointStorage(tmp_path / backend.__name__)).result(60)
            msg = str(info.value)
            assert msg.startswith("state 'value' (value state, serializer RecordSerializer(") and words in msg
            assert "cannot write the entry of key 7" in msg


def test_other_serializers_keep_the_compiled_state_classes():
    with HeapKeyedStateBackend(key_group_range(16, 1, 0), 16, Int64Serializer()) as b:
        plain = b.get_state(ValueStateDescriptor("n", Int64Serializer()))
        checked = b.get_state(ValueStateDescriptor("r", SER))
        assert type(plain).__name__ == "_HeapValue" and type(checked).__name__ == "_CheckedHeapValue"
        assert isinstance(checked, type(plain))


@dataclasses.dataclass
class Visit:
    user: str
    visits: int


def test_a_dataclass_record_is_checked_too():
    with HeapKeyedStateBackend(key_group_range(16, 1, 0), 16, Int64Serializer()) as b:
        state = b.get_state(ValueStateDescriptor("v", RecordSerializer(Visit)))
        b.set_current_key(1)
        state.update(Visit("a", 1))
        with pytest.raises(StateSerializationError, match="field 'visits' \\(bigint not null\\) expects an int"):
            state.update(Visit("a", "many"))   # type: ignore[arg-type]
        assert state.value() == Visit("a", 1)


# ---- a model: good and bad writes, snapshots and restores, heap and RocksDB alike --------------------------------

ops = st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["set", "bad", "clear", "append", "bad append",
                                                             "checkpoint"])), max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(ops=ops, backend=st.sampled_from([HeapKeyedStateBackend, RocksDBKeyedStateBackend]))
def test_refused_writes_never_reach_a_checkpoint(ops, backend, tmp_path_factory):
    storage = CheckpointStorage(tmp_path_factory.mktemp("checks"))
    model_v: dict[int, dict] = {}
    model_l: dict[int, list] = {}
    cid = 0

    def open_backend(metadata):
        b = backend(key_group_range(16, 1, 0), 16, Int64Serializer())
        if metadata is not None:
            b.restore(storage, metadata)
        return b, b.get_state(ValueStateDescriptor("v", SER)), b.get_state(ListStateDescriptor("l", SER))

    b, v, lst = open_backend(None)
    committed_v: dict[int, dict] = {}
    committed_l: dict[int, list] = {}
    try:
        for n, (key, op) in enumerate(ops):
            b.set_current_key(key)
            good = {"user": f"u{n}", "visits": n, "tags": [str(key)]}
            if op == "set":
                v.update(good)
                model_v[key] = good
            elif op == "append":
                lst.add(good)
                model_l.setdefault(key, []).append(good)
            elif op == "clear":
                v.clear()
                model_v.pop(key, None)
            elif op in ("bad", "bad append"):
                # both backends refuse at the write, keeping what the state held
                with pytest.raises(StateSerializationError):
                    (v.update if op == "bad" else lst.add)({"visits": n})
            else:
                cid += 1
                handle = b.snapshot(cid, storage).result(60)
                storage.commit(CheckpointMetadata(checkpoint_id=cid, job_id="j", timestamp_ms=0, max_parallelism=16,
                                                  parallelism=1, keyed_handles=carry_forward(storage.latest(),
                                                                                             [handle]),
                                                  operator_handles=[], properties={}))
                b.dispose()
                b, v, lst = open_backend(storage.load(cid))
            if op == "checkpoint":
                committed_v = {k: dict(x) for k, x in model_v.items()}
                committed_l = {k: list(x) for k, x in model_l.items()}
        for key in range(6):
            b.set_current_key(key)
            assert v.value() == model_v.get(key)
            assert lst.get() == model_l.get(key, [])
    finally:
        b.dispose()
