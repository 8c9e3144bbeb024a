"""User code type-checks: the state handles follow their descriptors' serializers, ``context.timestamp`` is an int,
and the guides' Python (docs/*.md, extracted as tests/test_guide.py runs it) passes ``mypy --strict`` and pyright
(basedpyright, pyright's checker with node from a wheel: nothing downloaded at run time) in its standard mode.
The generic classes subscript at run time as well (``ValueState[int]``)."""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import re
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_guide import GUIDES, STREAMING_JOB, file_block, padded_source

from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime import ProcessContext, begin_batch, commit_batch
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.serializers import (
    Int64Serializer,
    ListSerializer,
    MapSerializer,
    NullableSerializer,
    StrSerializer,
    TupleSerializer,
    TypeSerializer,
)
from keygroups.state import (
    AggregateFunction,
    AggregatingState,
    AggregatingStateDescriptor,
    ListState,
    ListStateDescriptor,
    MapState,
    MapStateDescriptor,
    ReduceFunction,
    ReducingState,
    ReducingStateDescriptor,
    ValueState,
    ValueStateDescriptor,
)

#: pyarrow ships no type information (no py.typed, no stubs): checked as Any, as a user's own config would say.
MYPY_CONFIG = """\
[mypy]
strict = True

[mypy-pyarrow.*]
ignore_missing_imports = True
"""

#: What the handles' types must be, asserted by the type checkers themselves (typing.assert_type), and two misuses
#: each checker must refuse (so that the check can fail).
TYPED_FUNCTION = '''
from collections.abc import Iterator
from typing import Any, assert_type

from keygroups.runtime import KeyedProcessFunction, ProcessContext, RuntimeContext
from keygroups.serializers import (Float64Serializer, Int64Serializer, ListSerializer, MapSerializer,
                                   NullableSerializer, StrSerializer, TupleSerializer, ValueSerializer)
from keygroups.state import (AggregateFunction, AggregatingState, AggregatingStateDescriptor, ListState,
                             ListStateDescriptor, MapState, MapStateDescriptor, ReducingState,
                             ReducingStateDescriptor, ValueState, ValueStateDescriptor)

Acc = tuple[float, int]


class Mean(AggregateFunction[float, Acc, float]):
    def create_accumulator(self) -> Acc:
        return (0.0, 0)

    def add(self, value: float, accumulator: Acc) -> Acc:
        return (accumulator[0] + value, accumulator[1] + 1)

    def get_result(self, accumulator: Acc) -> float:
        return accumulator[0] / accumulator[1]

    def merge(self, a: Acc, b: Acc) -> Acc:
        return (a[0] + b[0], a[1] + b[1])


class Typed(KeyedProcessFunction):
    def open(self, context: RuntimeContext) -> None:
        self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))
        assert_type(self.count, ValueState[int])
        self.prices = context.get_map_state(MapStateDescriptor("prices", StrSerializer(), Float64Serializer()))
        assert_type(self.prices, MapState[str, float])
        self.seen = context.get_list_state(ListStateDescriptor("seen", TupleSerializer(StrSerializer(),
                                                                                       Int64Serializer())))
        assert_type(self.seen, ListState[tuple[str, int]])
        self.total = context.get_reducing_state(ReducingStateDescriptor("total", lambda a, b: a + b,
                                                                        Int64Serializer()))
        assert_type(self.total, ReducingState[int])
        self.mean = context.get_aggregating_state(
            AggregatingStateDescriptor("mean", Mean(), TupleSerializer(Float64Serializer(), Int64Serializer())))
        assert_type(self.mean, AggregatingState[float, float])
        # get_state takes every kind, typed per descriptor
        assert_type(context.get_state(MapStateDescriptor("m", StrSerializer(), Int64Serializer())),
                    MapState[str, int])
        assert_type(context.get_state(ListStateDescriptor("l", ListSerializer(StrSerializer()))),
                    ListState[list[str]])
        assert_type(context.get_state(ValueStateDescriptor("o", NullableSerializer(
            MapSerializer(StrSerializer(), Int64Serializer())))), ValueState[dict[str, int] | None])
        assert_type(context.get_state(ValueStateDescriptor("any", ValueSerializer())), ValueState[Any])

    def process_element(self, record: dict[str, Any], context: ProcessContext) -> Iterator[tuple[str, int]]:
        assert_type(self.count.value(), int | None)
        assert_type(self.prices.get("book"), float | None)
        assert_type(self.prices.items(), list[tuple[str, float]])
        assert_type(self.seen.get(), list[tuple[str, int]])
        assert_type(self.total.get(), int | None)
        assert_type(self.mean.get(), float | None)
        assert_type(context.timestamp, int)          # no cast, no None check
        self.count.update((self.count.value() or 0) + 1)
        self.seen.add((record["item"], context.timestamp))
        context.timer_service.register_event_time_timer(context.timestamp + 1000)
        yield (str(context.current_key), context.timestamp)


class Renamed(KeyedProcessFunction):
    """Overrides may name the parameters as they like (the runtime passes them by position)."""

    def open(self, ctx: RuntimeContext) -> None:
        self.last = ctx.get_state(ValueStateDescriptor("last", Int64Serializer()))

    def process_element(self, event: dict[str, Any], ctx: ProcessContext) -> None:
        self.last.update(ctx.timestamp)

    def on_timer(self, when: int, ctx: ProcessContext) -> Iterator[tuple[str, int]]:
        yield (str(ctx.current_key), when)
'''

MISUSES = '''
def misuse(f: Typed) -> None:
    f.count.update("one")          # a str into a ValueState[int]
    f.prices.put(1, 2.0)           # an int key into a MapState[str, float]
'''


#: An error line of either checker: mypy's ``file.py:12: error: ...``, pyright's ``/dir/file.py:12:5 - error: ...``.
ERROR = re.compile(r"(?P<file>[\w-]+\.py):(?P<line>\d+)(?::\d+)?(?: - |: )error")


def _mypy(directory: pathlib.Path, files: list[str]) -> subprocess.CompletedProcess[str]:
    (directory / "mypy.ini").write_text(MYPY_CONFIG)
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", *files], cwd=directory,
                          capture_output=True, text=True, timeout=600)


def _pyright(directory: pathlib.Path, files: list[str]) -> subprocess.CompletedProcess[str]:
    (directory / "pyrightconfig.json").write_text(json.dumps({"typeCheckingMode": "standard",
                                                               "pythonVersion": "3.11"}))
    exe = shutil.which("basedpyright", path=str(pathlib.Path(sys.executable).parent))
    assert exe is not None, "basedpyright is not installed: pip install '.[test]'"
    return subprocess.run([exe, "--pythonpath", sys.executable, "-p", "pyrightconfig.json", *files], cwd=directory,
                          capture_output=True, text=True, timeout=600)


CHECKERS = {"mypy --strict": _mypy, "pyright": _pyright}


def _sources() -> dict[str, str]:
    """Every file the checkers see, by name: the guides' blocks (at the guides' line numbers), the deployment
    script, the typed function, and the typed function with two misuses appended."""
    sources = {f"{g.stem.replace('-', '_')}.py": padded_source(g.read_text(encoding="utf-8")) for g in GUIDES}
    sources["sessions_job.py"] = file_block(STREAMING_JOB.read_text(encoding="utf-8"), "sessions_job.py")
    sources["typed_function.py"] = TYPED_FUNCTION
    sources["misused_function.py"] = TYPED_FUNCTION + MISUSES
    return sources


@pytest.fixture(scope="module", params=CHECKERS)
def checked(request, tmp_path_factory):
    """One run of a checker over all the sources (each checker analyses pyspark and keygroups once): the error
    lines per file, and the checker's output for messages."""
    directory = tmp_path_factory.mktemp("typecheck")
    sources = _sources()
    for name, text in sources.items():
        (directory / name).write_text(text)
    result = CHECKERS[request.param](directory, sorted(sources))
    errors: dict[str, set[int]] = {name: set() for name in sources}
    for m in ERROR.finditer(result.stdout):
        errors[m["file"]].add(int(m["line"]))
    return request.param, errors, result.stdout + result.stderr


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_the_guides_python_passes_the_type_checker(guide, checked):
    checker, errors, output = checked
    assert errors[f"{guide.stem.replace('-', '_')}.py"] == set(), f"{guide.name} under {checker}:\n{output}"


def test_the_deployment_script_passes_the_type_checker(checked):
    checker, errors, output = checked
    assert errors["sessions_job.py"] == set(), f"{checker}:\n{output}"


def test_state_handles_are_typed_by_their_serializers(checked):
    checker, errors, output = checked
    assert errors["typed_function.py"] == set(), f"{checker}:\n{output}"
    # and the same checker refuses values of the wrong type, on exactly the two lines that misuse the handles
    first = TYPED_FUNCTION.count("\n") + 3
    assert errors["misused_function.py"] == {first, first + 1}, f"{checker}:\n{output}"


def test_generic_classes_subscript_at_run_time():
    assert ValueState[int].__origin__ is ValueState
    assert MapState[str, int].__args__ == (str, int)
    assert AggregatingState[int, float].__args__ == (int, float)
    for cls in (ListState, ReducingState, ValueStateDescriptor, ListStateDescriptor, ReducingStateDescriptor,
                TypeSerializer, ReduceFunction, ListSerializer, NullableSerializer):
        assert cls[int].__origin__ is cls
    assert MapStateDescriptor[str, int].__origin__ is MapStateDescriptor
    assert AggregatingStateDescriptor[int, tuple[int, int], float].__origin__ is AggregatingStateDescriptor
    assert AggregateFunction[int, int, int].__origin__ is AggregateFunction
    assert MapSerializer[str, int].__origin__ is MapSerializer
    assert TupleSerializer[tuple[str, int]].__origin__ is TupleSerializer
    # a typed subclass of a serializer is registered and serializes as before
    assert Int64Serializer().deserialize(Int64Serializer().serialize(-7)) == -7
    assert isinstance(Int64Serializer(), TypeSerializer)


def test_state_instances_have_no_dict():
    """Generic adds nothing per instance: the handles keep their __slots__ (no __dict__ on the hot path)."""
    from keygroups.state.states import STATE_CLASSES

    for cls in STATE_CLASSES.values():
        assert "__dict__" not in dir(cls), cls


def test_timestamp_is_an_int_or_a_clear_error():
    context = ProcessContext(checkpoint_id=1, subtask_index=0)
    assert not context.has_timestamp
    with pytest.raises(ValueError, match=r"no event time.*timestamp_column.*has_timestamp"):
        _ = context.timestamp
    context.timestamp = 1_700_000_000_000
    assert context.has_timestamp and context.timestamp == 1_700_000_000_000
    context.timestamp = None
    assert not context.has_timestamp


def test_the_typed_function_runs_on_event_time_and_refuses_without(tmp_path, monkeypatch):
    """The checked code is real code: it runs through the runtime's subtask on event time with int timestamps; in a
    job without event time, its first read of ``context.timestamp`` raises the error naming the fix."""
    (tmp_path / "typed_function.py").write_text(TYPED_FUNCTION)
    monkeypatch.syspath_prepend(str(tmp_path))
    from typed_function import Typed  # type: ignore[import-not-found]

    schema = pa.schema([("user", pa.string()), ("item", pa.string()), ("ts", pa.int64())])
    output = pa.schema([("user", pa.string()), ("ts", pa.int64())])
    table = pa.table({"user": ["a", "b", "a"], "item": ["x", "y", "z"], "ts": [1_000, 2_000, 3_000]}, schema=schema)
    for name, timestamp_column in (("event-time", "ts"), ("no-event-time", None)):
        storage = CheckpointStorage(str(tmp_path / name))
        plan = begin_batch(storage, job_name=name, max_parallelism=8, parallelism=1)
        spec = plan.keyed_task(key_columns=("user",), function=pickle.dumps(Typed()), input_schema=schema,
                               output_schema=output, order_columns=("ts",), timestamp_column=timestamp_column,
                               watermark=None)
        if timestamp_column is None:
            with pytest.raises(ValueError, match="no event time"):
                run_keyed_subtask(spec, 0, table.to_batches())
            continue
        metadata = commit_batch(plan, [run_keyed_subtask(spec, 0, table.to_batches())])
        out = pq.read_table(io.BytesIO(storage.read_bytes(metadata.outputs[0]))).to_pylist()
        assert sorted((r["user"], r["ts"]) for r in out) == [("a", 1_000), ("a", 3_000), ("b", 2_000)]
