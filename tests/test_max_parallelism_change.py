"""Changing max parallelism at restore by an integer factor (issue 14, item 2): key groups split (multiplied) or merge
(divided), each new subtask reads only the chains of its parent key groups, and every key then sits in the key
group Flink assigns it for the new max parallelism (checked against Flink 2.3.0's own murmur hashes in
tests/data/key_groups.jsonl), with every state equal to a plain-dict model, on both backends."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import load_jsonl
from keygroups import KeyGroupRange, assign_to_key_group, assign_to_operator, key_group_range
from keygroups.checkpoint import (
    CheckpointMetadata,
    CheckpointStorage,
    carry_forward,
    parent_key_groups,
    plan_keyed_restore,
)
from keygroups.checkpoint.format import merged_key_groups
from keygroups.cli import main
from keygroups.errors import StateMigrationError
from keygroups.serializers import Int64Serializer, StrSerializer
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    ValueStateDescriptor,
)

BACKENDS = {"heap": HeapKeyedStateBackend, "rocksdb": RocksDBKeyedStateBackend}
#: Long keys with Flink's own murmur hash of their hashCode (key group = murmur % max parallelism).
FLINK = {row["key"]: row for row in load_jsonl("key_groups.jsonl") if row["type"] == "long"}
KEYS = sorted(FLINK)[::4]
MAX_PARALLELISMS = [128, 512, 256, 1024, 128]
TTL_SECONDS = 100
STEP_SECONDS = 30   # the clock's advance per batch: an entry expires in its fourth batch after its write


def flink_key_group(key: int, max_parallelism: int) -> int:
    row = FLINK[key]
    return row["key_groups"].get(str(max_parallelism), row["murmur"] % max_parallelism)


def descriptors() -> dict[str, object]:
    ttl = ValueStateDescriptor("ttl", Int64Serializer())
    ttl.enable_time_to_live(StateTtlConfig.new_builder(TTL_SECONDS).build())
    return {"value": ValueStateDescriptor("value", Int64Serializer()),
            "list": ListStateDescriptor("list", Int64Serializer()),
            "map": MapStateDescriptor("map", StrSerializer(), Int64Serializer()),
            "ttl": ttl}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Model:
    """What the states must hold: plain dicts (the TTL state with each entry's write time)."""

    def __init__(self) -> None:
        self.value: dict[int, int] = {}
        self.list: dict[int, list[int]] = {}
        self.map: dict[int, dict[str, int]] = {}
        self.ttl: dict[int, tuple[int, float]] = {}

    def expected(self, key: int, now: float) -> tuple:
        ttl = self.ttl.get(key)
        return (self.value.get(key), self.list.get(key, []), self.map.get(key, {}),
                ttl[0] if ttl is not None and now - ttl[1] < TTL_SECONDS else None)


class Batch:
    """One batch of the job at (max_parallelism, p): a backend per subtask, restored from ``metadata``."""

    def __init__(self, kind: str, storage: CheckpointStorage, clock: Clock, mp: int, p: int,
                 metadata: CheckpointMetadata | None) -> None:
        self.mp, self.p = mp, p
        self.backends = [BACKENDS[kind](key_group_range(mp, p, i), mp, Int64Serializer(), subtask_index=i,
                                        clock=clock) for i in range(p)]
        self.stats = [b.restore(storage, metadata) for b in self.backends] if metadata is not None else []
        self.states = [{n: b.get_state(d) for n, d in descriptors().items()} for b in self.backends]

    def at(self, key: int) -> dict[str, object]:
        i = assign_to_operator(key, self.mp, self.p)
        self.backends[i].set_current_key(key)
        return self.states[i]

    def read(self, key: int) -> tuple:
        s = self.at(key)
        return s["value"].value(), list(s["list"].get() or []), dict(s["map"].items()), s["ttl"].value()

    def apply(self, ops: list[tuple[int, str, int]], model: Model, now: float) -> None:
        for index, op, v in ops:
            key = KEYS[index]
            s = self.at(key)
            if op == "value":
                s["value"].update(v)
                model.value[key] = v
            elif op == "list":
                s["list"].add(v)
                model.list.setdefault(key, []).append(v)
            elif op == "map" and v >= 0:
                s["map"].put(str(v % 5), v)
                model.map.setdefault(key, {})[str(v % 5)] = v
            elif op == "map":
                s["map"].remove(str(-v % 5))
                if model.map.get(key, {}).pop(str(-v % 5), None) is not None and not model.map[key]:
                    del model.map[key]
            elif op == "ttl":
                s["ttl"].update(v)
                model.ttl[key] = (v, now)
            else:   # clear every state of the key
                for state in s.values():
                    state.clear()
                for d in (model.value, model.list, model.map, model.ttl):
                    d.pop(key, None)

    def checkpoint(self, storage: CheckpointStorage, checkpoint_id: int) -> CheckpointMetadata:
        handles = [f.result(60) for f in [b.snapshot(checkpoint_id, storage) for b in self.backends]]
        md = CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="maxp", timestamp_ms=0, max_parallelism=self.mp,
                                parallelism=self.p, keyed_handles=carry_forward(storage.latest(), handles,
                                                                                max_parallelism=self.mp))
        storage.commit(md)
        return md

    def dispose(self) -> None:
        for b in self.backends:
            b.dispose()


def check_placement(storage: CheckpointStorage, md: CheckpointMetadata) -> None:
    """Every key stored in the checkpoint sits in the key group Flink assigns it for the checkpoint's max
    parallelism (and the scalar core agrees)."""
    everything = KeyGroupRange(0, md.max_parallelism - 1)
    _, groups = merged_key_groups(storage, plan_keyed_restore(md, everything), everything)
    ser = Int64Serializer()
    for kg, sections in groups:
        for _, keys, _ in sections:
            for key in map(ser.deserialize, keys):
                assert flink_key_group(key, md.max_parallelism) == kg == assign_to_key_group(key, md.max_parallelism)


def check_restore_reads(batch: Batch, previous: CheckpointMetadata) -> None:
    """Each subtask read the chains of its parent key groups and nothing else: at most one old key group per new
    one when splitting (at most k times its share), exactly its share when merging."""
    old, new = previous.max_parallelism, batch.mp
    for b, stats in zip(batch.backends, batch.stats):
        plan = plan_keyed_restore(previous, b.key_group_range, max_parallelism=new)
        read = {kg for _, part in plan for kg in part}
        parents = {kg for r in parent_key_groups(b.key_group_range, old, new) for kg in r}
        assert read <= parents
        assert len(parents) <= (len(b.key_group_range) if new >= old else len(b.key_group_range) * old // new)
        assert stats.bytes_read == sum(h.byte_range(part)[1] - h.byte_range(part)[0] for h, part in plan)


stages = st.lists(st.tuples(st.integers(1, 6), st.lists(
    st.tuples(st.integers(0, len(KEYS) - 1), st.sampled_from(["value", "list", "map", "ttl", "clear"]),
              st.integers(-1000, 1000)), max_size=40)), min_size=1, max_size=2)


@pytest.mark.parametrize("kind", BACKENDS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(stages, min_size=len(MAX_PARALLELISMS), max_size=len(MAX_PARALLELISMS)))
def test_keys_follow_their_key_groups_across_max_parallelism_changes(kind, tmp_path_factory, plan):
    storage = CheckpointStorage(tmp_path_factory.mktemp("chk"))
    clock, model = Clock(), Model()
    seed = [(i, op, KEYS[i] % 1000) for i in range(len(KEYS)) for op in ("value", "list", "map", "ttl")]
    md: CheckpointMetadata | None = None
    checkpoint_id = 0
    for mp, batches in zip(MAX_PARALLELISMS, plan):
        for p, ops in batches:
            clock.now += STEP_SECONDS
            batch = Batch(kind, storage, clock, mp, p, md)
            changed = md is not None and md.max_parallelism != mp
            try:
                if changed:
                    check_restore_reads(batch, md)
                for b in batch.backends:
                    for name in ("value", "list", "map"):
                        assert all(assign_to_key_group(k, mp) in b.key_group_range for k in b.keys(name))
                assert {k for b in batch.backends for k in b.keys("value")} == set(model.value)
                for key in KEYS:
                    assert batch.read(key) == model.expected(key, clock.now), key
                batch.apply(seed if md is None else ops, model, clock.now)
                checkpoint_id += 1
                md = batch.checkpoint(storage, checkpoint_id)
            finally:
                batch.dispose()
            assert md.max_parallelism == mp
            if changed:   # written full, nothing of the old numbering carried
                assert all(h.is_all_full and h.checkpoint_id == checkpoint_id for h in md.keyed_handles)
            check_placement(storage, md)
    last = Batch(kind, storage, clock, 128, 3, md)
    try:
        for key in KEYS:
            assert last.read(key) == model.expected(key, clock.now), key
    finally:
        last.dispose()


@pytest.mark.parametrize("kind", BACKENDS)
def test_first_checkpoint_after_a_change_is_full_and_stands_alone(kind, tmp_path):
    storage = CheckpointStorage(tmp_path)
    clock, model = Clock(), Model()
    first = Batch(kind, storage, clock, 128, 2, None)
    first.apply([(i, "value", i) for i in range(len(KEYS))], model, clock.now)
    md = first.checkpoint(storage, 1)
    first.dispose()
    second = Batch(kind, storage, clock, 256, 3, md)
    second.apply([(0, "value", -1)], model, clock.now)
    after = second.checkpoint(storage, 2)
    second.dispose()
    assert after.max_parallelism == 256
    assert {h.checkpoint_id for h in after.keyed_handles} == {2}   # nothing of the old numbering carried
    assert all(h.is_all_full for h in after.keyed_handles)
    third = Batch(kind, storage, clock, 256, 2, after)   # the next one is incremental again
    third.apply([(1, "value", -2)], model, clock.now)
    again = third.checkpoint(storage, 3)
    third.dispose()
    assert not all(h.is_all_full for h in again.keyed_handles if h.checkpoint_id == 3)
    assert {h.checkpoint_id for h in again.keyed_handles} == {2, 3}


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("old,new", [(128, 200), (512, 384), (128, 96)])
def test_other_changes_are_refused_naming_the_allowed_values(kind, tmp_path, old, new):
    storage = CheckpointStorage(tmp_path)
    clock, model = Clock(), Model()
    batch = Batch(kind, storage, clock, old, 2, None)
    batch.apply([(0, "value", 1)], model, clock.now)
    md = batch.checkpoint(storage, 1)
    batch.dispose()
    backend = BACKENDS[kind](KeyGroupRange(0, new - 1), new, Int64Serializer())
    try:
        with pytest.raises(StateMigrationError,
                           match=rf"max_parallelism={old}, into a job with max_parallelism={new}: .*integer factor"
                                 rf".*Allowed: {old} \(unchanged\); a multiple of {old} up to 32768 "
                                 rf"\({2 * old}, {3 * old}, .*\); a divisor of {old} \(1, 2, 4, .*{old // 2}\)"):
            backend.restore(storage, md)
    finally:
        backend.dispose()


def test_plan_command_shows_the_parent_key_groups_each_subtask_reads(tmp_path, capsys):
    storage = CheckpointStorage(tmp_path)
    clock, model = Clock(), Model()
    batch = Batch("heap", storage, clock, 128, 2, None)
    batch.apply([(i, "value", i) for i in range(len(KEYS))], model, clock.now)
    batch.checkpoint(storage, 1)
    batch.dispose()
    assert main(["plan", str(tmp_path), "2", "--max-parallelism", "32"]) == 0
    out = capsys.readouterr().out
    assert "(max parallelism 128 -> 32: key groups merged 4 into 1, a new one reads those it merges)" in out
    assert "new subtask 0 (key groups 0-15)" in out and "old key groups 0-15, 32-47, 64-79, 96-111" in out
    assert main(["plan", str(tmp_path), "8", "--max-parallelism", "512"]) == 0
    out = capsys.readouterr().out
    assert "new subtask 1 (key groups 64-127)" in out and "old key groups 64-127" in out
    assert main(["plan", str(tmp_path), "2", "--max-parallelism", "200"]) == 2
    err = capsys.readouterr().err
    assert "max_parallelism=200" in err and "a divisor of 128 (1, 2, 4, 8, 16, 32, 64)" in err
