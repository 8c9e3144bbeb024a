"""A record schema that changes between batches while a worker keeps its heap backend warm (issue 31, hostile probe:
keys the batch did not touch were written from their decoded values under the new serializer; a reorder swapped
fields, a dropped field failed every batch). Every batch runs the driver protocol and the subtask code a job and the
test harness run (``begin_batch``, ``run_keyed_subtask`` with a worker's ``HeapBackendRegistry``, ``commit_batch``);
a new function (a new job of the same name and location) brings the new serializer. The state must be what a cold
restore with the new schema gives: in the batch's output, and in the checkpoint, for touched and untouched keys."""

from __future__ import annotations

import io
import json
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import keygroups as kg
from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime import begin_batch, commit_batch
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.backends import create_backend
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.runtime.subtask_state import HeapBackendRegistry
from keygroups.serializers import RecordSerializer
from keygroups.serializers.schema import INT64, Field, RecordType
from keygroups.state import ValueStateDescriptor

MP = 16
INPUT = pa.schema([("key", pa.int64()), ("op", pa.string())])
OUTPUT = pa.schema([("key", pa.int64()), ("value", pa.string())])


class Keeper(KeyedProcessFunction):
    """One record per key: ``set`` stores {a: key, b: 10 * key, ...} (the fields the schema has), ``get``
    emits the stored value as JSON (a dict, whatever the form)."""

    def __init__(self, schema: object, form: str = "tuple") -> None:
        self.serializer = RecordSerializer(schema, form=form)
        self.form = form

    def open(self, context):
        self.state = context.get_state(ValueStateDescriptor("rec", self.serializer))

    def process_element(self, record, context):
        key = record["key"]
        names = self.serializer.schema.names
        if record["op"] == "set":
            full = {"a": key, "b": 10 * key, "c": 100 * key, "d": -key, "x": key}
            value = {n: full.get(n) for n in names}
            self.state.update(value if self.form == "dict" else tuple(value[n] for n in names))
            return None
        v = self.state.value()
        if not isinstance(v, dict if self.form == "dict" else tuple):
            raise TypeError(f"the {self.form} form gave {v!r}")
        as_dict = v if isinstance(v, dict) else dict(zip(names, v))
        return [(key, json.dumps(as_dict, sort_keys=True))]


def run_batch(location: str, worker: HeapBackendRegistry, function: Keeper, records: list[tuple[int, str]]
              ) -> tuple[list[tuple[int, dict]], str]:
    storage = CheckpointStorage(location)
    plan = begin_batch(storage, job_name="keeper", max_parallelism=MP, parallelism=1)
    spec = plan.keyed_task(key_columns=("key",), function=pickle.dumps(function), input_schema=INPUT,
                           output_schema=OUTPUT, warm_heap_backends=4)
    table = pa.table({"key": [r[0] for r in records], "op": [r[1] for r in records]}, schema=INPUT)
    report = run_keyed_subtask(spec, 0, table.to_batches(), warm=worker)
    metadata = commit_batch(plan, [report])
    rows = []
    for f in metadata.outputs:
        t = pq.read_table(io.BytesIO(storage.read_bytes(f)))
        rows += [(k, json.loads(v)) for k, v in zip(t.column("key").to_pylist(), t.column("value").to_pylist())]
    return sorted(rows), report.restored.mode


def cold_values(location: str, schema: object, keys: range) -> dict[int, dict]:
    """Every key's value in the latest checkpoint, read by a new backend with ``schema`` (as dicts)."""
    storage = CheckpointStorage(location)
    backend = create_backend("heap", kg.key_group_range(MP, 1, 0), MP, "long")
    backend.restore(storage, storage.latest())
    state = backend.get_state(ValueStateDescriptor("rec", RecordSerializer(schema)))
    out = {}
    for k in keys:
        backend.set_current_key(k)
        out[k] = state.value()
    return out


KEYS = range(40)


def expected(names: tuple[str, ...], k: int) -> dict:
    full = {"a": k, "b": 10 * k, "c": 100 * k, "d": -k, "x": k}
    return {n: full.get(n) for n in names}


RENAMED = RecordType((Field("b", INT64, False), Field("x", INT64, False, aliases=("a",))))

CHANGES = {
    "reorder": ("a bigint not null, b bigint not null, c bigint", "c bigint, b bigint not null, a bigint not null",
                lambda v: v),
    "drop": ("a bigint not null, b bigint not null, c bigint", "a bigint not null, c bigint",
             lambda v: {"a": v["a"], "c": v["c"]}),
    "add with a default": ("a bigint not null, b bigint not null", "a bigint not null, b bigint not null, "
                           "d bigint not null default -1", lambda v: {**v, "d": -1}),
    "widen": ("a int not null, b int not null", "a bigint not null, b double not null",
              lambda v: {"a": v["a"], "b": float(v["b"])}),
    "rename": ("a bigint not null, b bigint not null", RENAMED, lambda v: {"b": v["b"], "x": v["a"]}),
}


@pytest.mark.parametrize("form", ["tuple", "dict"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_schema_change_on_a_warm_heap_backend_reads_as_a_cold_restore(tmp_path, change, form):
    old, new, step = CHANGES[change]
    location, worker = str(tmp_path / "chk"), HeapBackendRegistry()
    old_names = RecordSerializer(old).schema.names
    new_names = RecordSerializer(new).schema.names
    run_batch(location, worker, Keeper(old, form), [(k, "set") for k in KEYS])
    # a second batch with the old schema: the backend is kept warm and decodes the keys it reads
    rows, mode = run_batch(location, worker, Keeper(old, form), [(k, "get") for k in KEYS[::3]])
    assert mode == "warm" and rows == [(k, expected(old_names, k)) for k in KEYS[::3]]
    # a new job, same name and location, new schema: the warm backend is resumed and half the keys are touched
    rows, mode = run_batch(location, worker, Keeper(new, form), [(k, "get") for k in KEYS[::2]])
    assert mode == "warm"
    assert rows == [(k, step(expected(old_names, k))) for k in KEYS[::2]]
    # the checkpoint holds every key in the new shape, touched or not, as a cold restore reads it
    assert cold_values(location, new, KEYS) == {k: step(expected(old_names, k)) for k in KEYS}
    # and the job goes on: new values in the new shape, old ones unchanged
    rows, _ = run_batch(location, worker, Keeper(new, form), [(0, "set"), *((k, "get") for k in KEYS[:6])])
    assert rows == [(k, expected(new_names, k) if k == 0 else step(expected(old_names, k))) for k in KEYS[:6]]


def test_another_form_on_a_warm_backend_gives_values_in_that_form(tmp_path):
    """Same schema, as is: the decoded values are the old form's (dicts); the new function gets tuples."""
    location, worker = str(tmp_path / "chk"), HeapBackendRegistry()
    schema = "a bigint not null, b bigint not null"
    run_batch(location, worker, Keeper(schema, "dict"), [(k, "set") for k in KEYS])
    run_batch(location, worker, Keeper(schema, "dict"), [(k, "get") for k in KEYS])
    rows, mode = run_batch(location, worker, Keeper(schema, "tuple"), [(k, "get") for k in KEYS[::2]])
    assert mode == "warm" and rows == [(k, expected(("a", "b"), k)) for k in KEYS[::2]]


def test_swapped_names_stay_swapped_over_warm_and_cold_batches(tmp_path):
    """A swap through aliases is applied once: the state written after it stores the aliases, so the next batches
    (warm or cold) read it as it is."""
    location, warm, cold = str(tmp_path / "chk"), HeapBackendRegistry(), HeapBackendRegistry()
    swapped = RecordType((Field("a", INT64, False, aliases=("b",)), Field("b", INT64, False, aliases=("a",))))
    run_batch(location, warm, Keeper("a bigint not null, b bigint not null"), [(k, "set") for k in KEYS])
    want = {k: {"a": 10 * k, "b": k} for k in KEYS}
    for worker in (warm, warm, cold, warm):
        rows, _ = run_batch(location, worker, Keeper(swapped), [(k, "get") for k in KEYS[::5]])
        assert rows == [(k, want[k]) for k in KEYS[::5]]
        assert cold_values(location, swapped, KEYS) == want
