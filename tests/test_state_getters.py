"""RuntimeContext's state getters: one per kind, as Flink's RuntimeContext, each returning its own state type and
refusing a descriptor of another kind with a message that names the getter to use."""

from __future__ import annotations

import pytest

from keygroups import KeyGroupRange
from keygroups.runtime.functions import RuntimeContext
from keygroups.serializers import Int64Serializer
from keygroups.state import (
    AggregateFunction,
    AggregatingState,
    AggregatingStateDescriptor,
    HeapKeyedStateBackend,
    ListState,
    ListStateDescriptor,
    MapState,
    MapStateDescriptor,
    ReducingState,
    ReducingStateDescriptor,
    StateTtlConfigBuilder,
    ValueState,
    ValueStateDescriptor,
)


class Sum(AggregateFunction):
    def create_accumulator(self):
        return 0

    def add(self, value, acc):
        return acc + value

    def get_result(self, acc):
        return acc

    def merge(self, a, b):
        return a + b


def descriptors():
    return {
        "value": ValueStateDescriptor("v", Int64Serializer()),
        "list": ListStateDescriptor("l", Int64Serializer()),
        "map": MapStateDescriptor("m", Int64Serializer(), Int64Serializer()),
        "reducing": ReducingStateDescriptor("r", lambda a, b: a + b, Int64Serializer()),
        "aggregating": AggregatingStateDescriptor("a", Sum(), Int64Serializer()),
    }


GETTERS = {
    "list": ("get_list_state", "ListStateDescriptor", ListState),
    "map": ("get_map_state", "MapStateDescriptor", MapState),
    "reducing": ("get_reducing_state", "ReducingStateDescriptor", ReducingState),
    "aggregating": ("get_aggregating_state", "AggregatingStateDescriptor", AggregatingState),
}
FIX = {"value": "get_state", **{kind: method for kind, (method, _, _) in GETTERS.items()}}


def context():
    backend = HeapKeyedStateBackend(KeyGroupRange(0, 127), 128, Int64Serializer())
    return RuntimeContext(backend, job_name="j", subtask_index=0, parallelism=1, max_parallelism=128,
                          checkpoint_id=1)


@pytest.mark.parametrize("kind", sorted(GETTERS))
def test_each_getter_returns_its_state_and_refuses_every_other_kind(kind):
    method, wanted, state_type = GETTERS[kind]
    ctx = context()
    descs = descriptors()
    state = getattr(ctx, method)(descs[kind])
    assert isinstance(state, state_type)
    assert getattr(ctx, method)(descs[kind]) is state  # registered once
    for other, d in descs.items():
        if other == kind:
            continue
        with pytest.raises(TypeError, match=rf"{method} takes a keygroups\.state\.{wanted}, got .*'{d.name}'.*; "
                                            rf"use {FIX[other]}\(\)"):
            getattr(ctx, method)(d)
    with pytest.raises(TypeError, match=rf"{method} takes a keygroups\.state\.{wanted}, got 'oops'$"):
        getattr(ctx, method)("oops")


def test_get_state_takes_every_kind():
    ctx = context()
    types = {"value": ValueState, **{kind: t for kind, (_, _, t) in GETTERS.items()}}
    for kind, d in descriptors().items():
        assert isinstance(ctx.get_state(d), types[kind])


def test_ttl_config_builder_is_exported():
    cfg = StateTtlConfigBuilder(5).update_ttl_on_read_and_write().build()
    assert cfg.ttl_ms == 5000
