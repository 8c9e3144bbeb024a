"""Serializers cross process boundaries by pickle: Spark ships a job's function (and the serializers it holds) with
cloudpickle, by value when it comes from a script's ``__main__``. Every kind of serializer must come back equal and
behave alike (the same bytes, the same values in the same form, the same evolution: defaults, aliases, refusals), and
``NO_DEFAULT`` must stay itself: a field that has no default must not gain one on the way (issue 31: a pickled
NO_DEFAULT made a restore fail with ``TypeError: ... got NO_DEFAULT``)."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups import assign_to_operator, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.errors import StateMigrationError
from keygroups.serializers import (
    Int64Serializer,
    ListSerializer,
    PickleSerializer,
    RecordMigrationReader,
    RecordSerializer,
    SerializerSnapshot,
    TypeSerializer,
    ValueSerializer,
    resolve_compatibility,
)
from keygroups.serializers.schema import NO_DEFAULT, ListType, MapType, RecordType
from keygroups.state import HeapKeyedStateBackend, RocksDBKeyedStateBackend, ValueStateDescriptor
from record_strategies import evolution_steps, record_types, values_of
from test_serializers_strategies import canon, json_values, serializers_and_values

cloudpickle = pytest.importorskip("pyspark.cloudpickle")


@dataclasses.dataclass
class Visit:
    page: str
    visits: int = 0
    tags: list[str] = dataclasses.field(default_factory=list)


def picklers() -> list[Any]:
    return [lambda s: pickle.loads(pickle.dumps(s)), lambda s: pickle.loads(pickle.dumps(s, protocol=2)),
            lambda s: cloudpickle.loads(cloudpickle.dumps(s))]


def test_no_default_is_itself_after_pickle_cloudpickle_and_copies():
    for again in picklers():
        assert again(NO_DEFAULT) is NO_DEFAULT
    assert copy.deepcopy(NO_DEFAULT) is NO_DEFAULT and copy.copy(NO_DEFAULT) is NO_DEFAULT


def evolution_view(t: Any, path: str = "") -> list[tuple[str, Any, tuple[str, ...]]]:
    """Every field's (path, default, aliases): what equality of schemas leaves out and evolution depends on."""
    out = []
    if isinstance(t, RecordType):
        for f in t.fields:
            default = f.default if f.default is NO_DEFAULT else ("default", repr(f.default))
            out.append((path + f.name, default, f.aliases))
            out += evolution_view(f.type, path + f.name + ".")
    elif isinstance(t, ListType):
        out += evolution_view(t.element, path + "[].")
    elif isinstance(t, MapType):
        out += evolution_view(t.value, path + "{}.")
    return out


@st.composite
def records_and_values(draw: Any) -> tuple[TypeSerializer, st.SearchStrategy[Any], SerializerSnapshot | None]:
    """A record serializer whose schema came out of an evolution step (so it has defaults and aliases), the values it
    writes, and the snapshot of the schema before the step (what it migrates from)."""
    before = draw(record_types(max_fields=4))
    step = draw(evolution_steps(before))
    form = draw(st.sampled_from(["dict", "tuple"]))
    ser = RecordSerializer(step.schema, form=form)
    values = values_of(step.schema)
    if form == "tuple":
        values = values.map(lambda v, names=step.schema.names: tuple(v[n] for n in names))
    return ser, values, RecordSerializer(before).snapshot()


every_kind = st.one_of(
    serializers_and_values.map(lambda p: (p[0], p[1], None)),
    records_and_values(),
    st.just((PickleSerializer(), json_values, None)),
    st.just((RecordSerializer(Visit), st.builds(Visit, st.text(max_size=5), st.integers(-9, 9),
                                                st.lists(st.text(max_size=3), max_size=2)), None)),
    st.just((ListSerializer(RecordSerializer("a bigint not null, b string")),
             st.lists(st.fixed_dictionaries({"a": st.integers(-9, 9), "b": st.none() | st.text(max_size=3)})),
             None)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), case=every_kind, which=st.integers(0, 2))
def test_every_serializer_comes_back_equal_and_behaves_alike(data, case, which):
    ser, values, before = case
    clone = picklers()[which](ser)
    assert type(clone) is type(ser) and clone == ser and hash(clone) == hash(ser)
    assert clone.snapshot() == ser.snapshot() and repr(clone) == repr(ser)
    for value in data.draw(st.lists(values, max_size=3), label="values"):
        written = ser.serialize(value)
        assert clone.serialize(value) == written
        assert canon(clone.deserialize(written)) == canon(ser.deserialize(written))
        assert type(clone.deserialize(written)) is type(ser.deserialize(written))
    if isinstance(ser, RecordSerializer):
        assert clone.form == ser.form or (isinstance(ser.form, type) and clone.form.__qualname__ ==
                                          ser.form.__qualname__)
        assert evolution_view(clone.schema) == evolution_view(ser.schema)
    if before is not None:   # the same evolution from the schema before the step
        try:
            outcome, reader = resolve_compatibility("s", before, ser)
        except StateMigrationError as e:
            with pytest.raises(StateMigrationError) as again:
                resolve_compatibility("s", before, clone)
            assert str(again.value) == str(e)
            return
        outcome2, reader2 = resolve_compatibility("s", before, clone)
        assert outcome2 is outcome
        old = RecordSerializer(RecordType.from_json(before.config["schema"]))
        for value in data.draw(st.lists(values_of(old.schema), max_size=3), label="old values"):
            assert canon(reader2.deserialize(old.serialize(value))) == canon(reader.deserialize(old.serialize(value)))


def test_a_migration_reader_pickles():
    old = RecordSerializer("a bigint not null, b string")
    new = RecordSerializer("b string, a double not null, c bigint default 3")
    _, reader = resolve_compatibility("s", old.snapshot(), new)
    assert isinstance(reader, RecordMigrationReader)
    for again in picklers():
        clone = again(reader)
        assert clone == reader and clone.state == "s" and clone.snapshot() == reader.snapshot()
        assert clone.deserialize(old.serialize({"a": 1, "b": "x"})) == {"b": "x", "a": 1.0, "c": 3}


# ---- a function from a script's __main__, as Spark ships it ------------------------------------------------------

SCRIPT = '''
import dataclasses
import sys

from pyspark import cloudpickle

from keygroups.runtime import KeyedProcessFunction
from keygroups.serializers import RecordSerializer
from keygroups.serializers.schema import INT64, STRING, Field, RecordType
from keygroups.state import ValueStateDescriptor


@dataclasses.dataclass
class Visit:
    page: str
    visits: int = 7


class Remember(KeyedProcessFunction):
    def __init__(self):
        # 'added' has no default and is not nullable: adding it to stored state must be refused
        self.strict = RecordSerializer(RecordType((Field("page", STRING, False), Field("added", INT64, False))))
        self.lenient = RecordSerializer("page string not null, referrer string, hits bigint not null default 1")
        self.visit = RecordSerializer(Visit)

    def open(self, context):
        self.state = context.get_state(ValueStateDescriptor("visit", self.visit))


with open(sys.argv[1], "wb") as f:
    f.write(cloudpickle.dumps(Remember()))
'''


@pytest.fixture(scope="module")
def function_from_main(tmp_path_factory) -> Any:
    tmp = tmp_path_factory.mktemp("main")
    (tmp / "job.py").write_text(textwrap.dedent(SCRIPT))
    subprocess.run([sys.executable, str(tmp / "job.py"), str(tmp / "function.pkl")], check=True, timeout=120)
    return cloudpickle.loads((tmp / "function.pkl").read_bytes())


def test_a_function_from_main_keeps_its_serializers(function_from_main):
    fn = function_from_main
    assert type(fn).__module__ == "__main__" or type(fn).__name__ == "Remember"
    assert fn.strict.schema.field("added").default is NO_DEFAULT
    assert fn.lenient.schema.field("hits").default == 1
    v1 = RecordSerializer("page string not null")
    _, reader = resolve_compatibility("s", v1.snapshot(), fn.lenient)
    assert reader.deserialize(v1.serialize({"page": "home"})) == {"page": "home", "referrer": None, "hits": 1}
    with pytest.raises(StateMigrationError) as refused:
        resolve_compatibility("s", v1.snapshot(), fn.strict)
    assert "State 's'" in str(refused.value) and "field 'added'" in str(refused.value)
    _, reader = resolve_compatibility("s", v1.snapshot(), fn.visit)
    visit = reader.deserialize(v1.serialize({"page": "home"}))
    assert type(visit).__name__ == "Visit" and (visit.page, visit.visits) == ("home", 7)


@pytest.mark.parametrize("backend", [HeapKeyedStateBackend, RocksDBKeyedStateBackend])
def test_a_restore_with_a_pickled_serializer_refuses_with_state_migration_error(function_from_main, backend,
                                                                                 tmp_path):
    storage = CheckpointStorage(tmp_path)
    v1 = RecordSerializer("page string not null")
    with backend(key_group_range(16, 1, 0), 16, Int64Serializer()) as b:
        state = b.get_state(ValueStateDescriptor("visits", v1))
        for k in range(5):
            b.set_current_key(k)
            state.update({"page": f"p{k}"})
        handle = b.snapshot(1, storage).result(60)
    storage.commit(CheckpointMetadata(checkpoint_id=1, job_id="j", timestamp_ms=0, max_parallelism=16,
                                      parallelism=1, keyed_handles=[handle], operator_handles=[], properties={}))
    for p in (1, 2):   # restored at another parallelism too
        seen = {}
        for i in range(p):
            with backend(key_group_range(16, p, i), 16, Int64Serializer()) as b:
                b.restore(storage, storage.load(1))
                with pytest.raises(StateMigrationError) as refused:
                    b.get_state(ValueStateDescriptor("visits", function_from_main.strict))
                assert "State 'visits'" in str(refused.value) and "field 'added'" in str(refused.value)
                state = b.get_state(ValueStateDescriptor("visits", function_from_main.lenient))
                for k in range(5):
                    if assign_to_operator(k, 16, p) == i:
                        b.set_current_key(k)
                        seen[k] = state.value()
        assert seen == {k: {"page": f"p{k}", "referrer": None, "hits": 1} for k in range(5)}


def test_value_serializer_pickles_with_its_values():
    ser = ValueSerializer()
    for again in picklers():
        assert again(ser).deserialize(ser.serialize({"x": [1, (2, 3)]})) == {"x": [1, (2, 3)]}
