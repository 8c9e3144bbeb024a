"""Record state in both keyed backends: value, list and map states of records (with and without TTL) are written,
checkpointed (a full checkpoint, then an incremental one), restored at another parallelism with an evolved schema
(add, drop, reorder, widen, rename: random steps), read back equal to a plain-dict model, checkpointed again and
restored with a second random step; the checkpoint after a migration holds only the new shape; a refused change
raises StateMigrationError and leaves the checkpoint usable."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups import assign_to_operator, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.errors import StateMigrationError
from keygroups.serializers import Int64Serializer, RecordSerializer, StrSerializer
from keygroups.serializers.schema import RecordType
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    ValueStateDescriptor,
)
from record_strategies import evolution_steps, record_types, values_of

BACKENDS = {"heap": HeapKeyedStateBackend, "rocksdb": RocksDBKeyedStateBackend}
MAXP = 16
NAMES = ("v", "l", "m")


def descriptors(ser: RecordSerializer, ttl: bool) -> dict:
    ds = {"v": ValueStateDescriptor("v", ser), "l": ListStateDescriptor("l", ser),
          "m": MapStateDescriptor("m", StrSerializer(), ser)}
    if ttl:   # long enough that nothing expires during the test: the TTL framing is what is exercised
        for d in ds.values():
            d.enable_time_to_live(StateTtlConfig.new_builder(10**6).build())
    return ds


class Job:
    """p subtasks: one backend each, keys routed by key group."""

    def __init__(self, backend: str, p: int, ser: RecordSerializer, ttl: bool, storage=None, metadata=None):
        self.p = p
        self.backends = [BACKENDS[backend](key_group_range(MAXP, p, i), MAXP, Int64Serializer(), subtask_index=i)
                         for i in range(p)]
        if metadata is not None:
            for b in self.backends:
                b.restore(storage, metadata)
        self.states = [{n: b.get_state(d) for n, d in descriptors(ser, ttl).items()} for b in self.backends]

    def at(self, key: int) -> dict:
        i = assign_to_operator(key, MAXP, self.p)
        self.backends[i].set_current_key(key)
        return self.states[i]

    def write(self, key: int, value: dict) -> None:
        s = self.at(key)
        s["v"].update(value)
        s["l"].update([value, value])
        s["m"].put(str(key), value)

    def read(self, key: int) -> tuple:
        s = self.at(key)
        return s["v"].value(), s["l"].get(), s["m"].get(str(key))

    def checkpoint(self, storage: CheckpointStorage, checkpoint_id: int) -> CheckpointMetadata:
        handles = [b.snapshot(checkpoint_id, storage).result(60) for b in self.backends]
        storage.commit(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="records", timestamp_ms=0,
                                          max_parallelism=MAXP, parallelism=self.p,
                                          keyed_handles=carry_forward(storage.latest(), handles),
                                          operator_handles=[], properties={}))
        return storage.load(checkpoint_id)

    def dispose(self) -> None:
        for b in self.backends:
            b.dispose()


def stored_schemas(metadata: CheckpointMetadata) -> set[str]:
    """Every record schema any file of the checkpoint's chains stores its states with."""
    return {json.dumps(meta["serializers"][role]["config"]["schema"], sort_keys=True)
            for h in metadata.keyed_handles for meta in h.states
            for role in ("value", "element", "map value") if role in meta["serializers"]}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data(), backend=st.sampled_from(sorted(BACKENDS)), ttl=st.booleans(),
       parallelisms=st.tuples(st.integers(1, 3), st.integers(1, 4)))
def test_evolved_schema_restores_at_a_new_parallelism_like_the_model(data, backend, ttl, parallelisms, tmp_path_factory):
    storage = CheckpointStorage(tmp_path_factory.mktemp("records"))
    p, p2 = parallelisms
    schema = data.draw(record_types(max_fields=4), label="schema")
    pool = data.draw(st.lists(values_of(schema), min_size=1, max_size=4), label="values")
    keys = list(range(24))
    model = {k: pool[k % len(pool)] for k in keys}

    old = Job(backend, p, RecordSerializer(schema), ttl)
    for k in keys:
        old.write(k, model[k])
    old.checkpoint(storage, 1)
    for k in keys[::3]:                        # an incremental checkpoint on top: chains of a base and a delta
        model[k] = pool[(k + 1) % len(pool)]
        old.write(k, model[k])
    md = old.checkpoint(storage, 2)
    old.dispose()

    step = data.draw(evolution_steps(schema), label="step")
    new_ser = RecordSerializer(step.schema)
    new = Job(backend, p2, new_ser, ttl, storage, md)
    expected = {k: step.apply(v) for k, v in model.items()}
    for k in keys:
        assert new.read(k) == (expected[k], [expected[k]] * 2, expected[k])
    new.write(keys[0], expected[keys[1]])     # the new shape written by the new serializer
    expected[keys[0]] = expected[keys[1]]
    md3 = new.checkpoint(storage, 3)
    new.dispose()
    # the migrated state was rewritten whole: no file of the new checkpoint's chains holds the old shape
    assert stored_schemas(md3) == {json.dumps(step.schema.to_json(), sort_keys=True)}

    # a second step on top, back at the first parallelism: the chain of migrations reads like the model too
    step2 = data.draw(evolution_steps(step.schema), label="second step")
    again = Job(backend, p, RecordSerializer(step2.schema), ttl, storage, md3)
    for k in keys:
        want = step2.apply(expected[k])
        assert again.read(k) == (want, [want] * 2, want)
    again.dispose()


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_refused_change_raises_and_leaves_the_checkpoint_usable(backend, tmp_path):
    storage = CheckpointStorage(tmp_path)
    ser = RecordSerializer("user string not null, visits bigint")
    job = Job(backend, 2, ser, False)
    for k in range(10):
        job.write(k, {"user": f"u{k}", "visits": k})
    md = job.checkpoint(storage, 1)
    job.dispose()
    with pytest.raises(StateMigrationError) as info:
        Job(backend, 3, RecordSerializer("user string not null, visits int"), False, storage, md)
    assert "State 'v' cannot be restored" in str(info.value)
    assert "field 'visits' changed from bigint to int" in str(info.value)
    ok = Job(backend, 3, ser, False, storage, md)
    assert [ok.read(k)[0] for k in range(10)] == [{"user": f"u{k}", "visits": k} for k in range(10)]
    ok.dispose()


def test_record_schema_is_stored_in_the_state_meta(tmp_path):
    storage = CheckpointStorage(tmp_path)
    job = Job("heap", 1, RecordSerializer("a bigint"), False)
    job.write(1, {"a": 1})
    md = job.checkpoint(storage, 1)
    job.dispose()
    assert RecordType.from_json(json.loads(next(iter(stored_schemas(md))))).fields_ddl() == "a bigint"
