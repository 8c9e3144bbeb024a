"""The compiled byte-level splitter and the metadata-only restore planner of operator state."""

from __future__ import annotations

import dataclasses
import mmap
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups.checkpoint import OperatorStateHandle, plan_operator_restore, split_sizes
from keygroups.checkpoint.metadata import OPERATOR_FORMAT_NAME, OPERATOR_FORMAT_VERSION, SERIALIZER_KEYS
from keygroups.checkpoint.metadata import DistributionMode as Mode
from keygroups.checkpoint.operator_format import HEADER_SIZE
from keygroups.errors import CorruptSnapshotError
from keygroups._native import splitter


def _bounds(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


@pytest.fixture(params=["bytes", "bytearray", "readonly-memoryview", "mmap"])
def as_buffer(request, tmp_path):
    """Buffers of every kind the splitter meets: writable, read-only, memory-mapped files."""
    opened = []

    def make(data: bytes):
        if request.param == "bytes":
            return data
        if request.param == "bytearray":
            return bytearray(data)
        if request.param == "readonly-memoryview":
            view = memoryview(bytes(data)).toreadonly()
            assert view.readonly
            return view
        path = tmp_path / f"buf{len(opened)}"
        path.write_bytes(data if data else b"\0")
        f = open(path, "rb")
        opened.append(f)
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return m if data else memoryview(m)[:0]

    yield make
    for f in opened:
        f.close()


# ---- splitter ---------------------------------------------------------------------------------------------------


def test_gather_concatenates_runs_and_rebases_offsets(as_buffer):
    a = as_buffer(b"HEADERaabbbc")          # file bytes [100, 112)
    b = as_buffer(b"xyz")                   # file bytes [0, 3)
    data, offsets = splitter.gather([(a, 100, _bounds(106, 108, 111)), (b, 0, _bounds(0, 1, 3))])
    assert data == b"aabbbxyz"
    assert offsets.tolist() == [0, 2, 5, 6, 8]
    assert offsets.dtype == np.int64


def test_gather_of_nothing_and_of_empty_elements(as_buffer):
    data, offsets = splitter.gather([])
    assert data == b"" and offsets.tolist() == [0]
    data, offsets = splitter.gather([(as_buffer(b"ab"), 0, _bounds(1, 1, 1, 2))])
    assert data == b"b" and offsets.tolist() == [0, 0, 0, 1]


@pytest.mark.parametrize(
    "bounds, base, why",
    [
        ((0, 5), 0, "past the end"),
        ((2, 1), 0, "descending"),
        ((-1, 2), 0, "negative"),
        ((5, 6), 10, "before the buffer"),
        ((10, 14, 12), 10, "descending inside"),
    ],
)
def test_gather_refuses_offsets_outside_the_buffer(as_buffer, bounds, base, why):
    with pytest.raises(CorruptSnapshotError, match="offset #"):
        splitter.gather([(as_buffer(b"abcd"), base, _bounds(*bounds))])


def test_check_offsets_names_the_bad_offset():
    splitter.check_offsets(_bounds(8, 8, 9, 20), 8, 20)
    with pytest.raises(CorruptSnapshotError, match="offset #2 is 7"):
        splitter.check_offsets(_bounds(8, 9, 7), 8, 20, "my state")


def test_map_entries_round_trip_and_reject_overrunning_keys(as_buffer):
    keys, key_off = b"k1key22", _bounds(0, 2, 7)
    values, value_off = b"vv", _bounds(0, 0, 2)
    data, offsets = splitter.encode_entries(keys, key_off, values, value_off)
    assert offsets.tolist() == [0, 6, 17]
    kd, ko, vd, vo = splitter.decode_entries(as_buffer(data), offsets)
    assert (kd, ko.tolist(), vd, vo.tolist()) == (keys, [0, 2, 7], values, [0, 0, 2])
    bad = bytearray(data)
    bad[0] = 200                              # the first key claims 200 bytes of a 6-byte entry
    with pytest.raises(CorruptSnapshotError):
        splitter.decode_entries(bytes(bad), offsets)
    with pytest.raises(CorruptSnapshotError):
        splitter.decode_entries(data[:5], _bounds(0, 5))   # key longer than the entry


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=20), max_size=30), st.data())
def test_gather_of_arbitrary_cuts_reassembles_the_list(elements, data):
    blob = b"".join(elements)
    bounds = np.concatenate([[0], np.cumsum([len(e) for e in elements], dtype=np.int64)]).astype(np.int64)
    n = len(elements)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=5)))
    edges = [0, *cuts, n]
    pieces = [(blob, 0, bounds[a:b + 1]) for a, b in zip(edges, edges[1:])]
    out, offsets = splitter.gather(pieces)
    assert out == blob
    assert [out[offsets[i]:offsets[i + 1]] for i in range(n)] == elements


# ---- planner ----------------------------------------------------------------------------------------------------


def _json(subtask: int, states: dict[str, tuple[str, int]], elem: int = 10) -> dict:
    """A well-formed handle's JSON with fixed-size elements (planning never opens the file)."""
    pos = HEADER_SIZE
    metas = {}
    for name, (mode, n) in states.items():
        offsets = [pos + i * elem for i in range(n)]
        metas[name] = {"mode": mode, **{key: {"id": "x"} for key in SERIALIZER_KEYS[Mode(mode)]},
                       "offsets": offsets, "end": pos + n * elem, "blocks": [[i, 0] for i in range(0, n, 3)]}
        pos += n * elem
    return {"format": OPERATOR_FORMAT_NAME, "version": OPERATOR_FORMAT_VERSION, "operator_id": "operator",
            "subtask": subtask, "file": f"chk-1/operator-{subtask}", "size": pos, "states": metas}


def _handle(subtask: int, states: dict[str, tuple[str, int]], elem: int = 10) -> OperatorStateHandle:
    return OperatorStateHandle.from_json(_json(subtask, states, elem))


def test_split_sizes_rotates_the_extra_elements_like_flink():
    # Flink's RoundRobinOperatorStateRepartitioner, worked by hand: 5 elements on 3 subtasks, twice.
    order, start = split_sizes(5, 3, 0)
    assert order == [(0, 2), (1, 2), (2, 1)] and start == 2
    order, start = split_sizes(5, 3, start)
    assert order == [(2, 2), (0, 2), (1, 1)] and start == 1
    order, start = split_sizes(6, 3, 1)
    assert order == [(1, 2), (2, 2), (0, 2)] and start == 1
    with pytest.raises(ValueError, match="parallelism"):
        split_sizes(1, 0)


def test_plan_hands_out_contiguous_runs_in_rotation():
    handles = [_handle(0, {"a": (Mode.SPLIT_DISTRIBUTE, 3), "b": (Mode.SPLIT_DISTRIBUTE, 2)}),
               _handle(1, {"a": (Mode.SPLIT_DISTRIBUTE, 2), "b": (Mode.SPLIT_DISTRIBUTE, 3)})]
    plan = plan_operator_restore(handles, 3)
    got = {(i, r.state): [] for i in range(3) for r in plan[i]}
    for i, runs in enumerate(plan):
        for r in runs:
            got[(i, r.state)].extend((r.old_subtask, e) for e in range(r.first, r.stop))
    # "a": 5 elements -> subtasks 0, 1, 2 get 2, 2, 1; "b" starts at subtask 2
    assert got[(0, "a")] == [(0, 0), (0, 1)]
    assert got[(1, "a")] == [(0, 2), (1, 0)]
    assert got[(2, "a")] == [(1, 1)]
    assert got[(2, "b")] == [(0, 0), (0, 1)]
    assert got[(0, "b")] == [(1, 0), (1, 1)]
    assert got[(1, "b")] == [(1, 2)]
    run = plan[1][0]
    assert run.byte_range == (HEADER_SIZE + 20, HEADER_SIZE + 30)      # element 2 of subtask 0's "a"
    assert run.read_range == (HEADER_SIZE + 0, HEADER_SIZE + 30)       # its checksum block: elements 0..2


def test_plan_gives_every_subtask_the_state_even_without_elements():
    plan = plan_operator_restore([_handle(0, {"a": (Mode.SPLIT_DISTRIBUTE, 1), "u": (Mode.UNION, 0)})], 3)
    for runs in plan:
        assert {r.state for r in runs} == {"a", "u"}


def test_plan_refuses_handles_that_disagree_or_are_not_handles():
    h0 = _handle(0, {"a": (Mode.SPLIT_DISTRIBUTE, 1)})
    h1 = _handle(1, {"a": (Mode.UNION, 1)})
    with pytest.raises(CorruptSnapshotError, match="disagree"):
        plan_operator_restore([h0, h1], 2)
    with pytest.raises(CorruptSnapshotError, match="same subtask"):
        plan_operator_restore([h0, dataclasses.replace(h0)], 2)
    with pytest.raises(CorruptSnapshotError, match="not an operator state handle"):
        plan_operator_restore([OperatorStateHandle.from_json({"file": "x"})], 2)
    bad = _json(0, {"a": (Mode.SPLIT_DISTRIBUTE, 1)})
    bad["states"]["a"]["mode"] = "SHUFFLE"
    with pytest.raises(CorruptSnapshotError, match="unknown mode"):
        plan_operator_restore([OperatorStateHandle.from_json(bad)], 2)
    with pytest.raises(TypeError, match="OperatorStateHandle"):
        plan_operator_restore([_json(0, {"a": (Mode.SPLIT_DISTRIBUTE, 1)})], 2)
    with pytest.raises(ValueError, match="new_parallelism"):
        plan_operator_restore([h0], 0)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 12), min_size=3, max_size=3), min_size=1, max_size=6),
    st.integers(1, 9),
)
def test_plan_property_split_union_broadcast(sizes, new_p):
    """Split: every old element goes to exactly one new subtask, sizes differ by at most one. Union: all to all.
    Broadcast: each new subtask gets one whole old copy."""
    handles = [_handle(i, {"s1": (Mode.SPLIT_DISTRIBUTE, s1), "s2": (Mode.SPLIT_DISTRIBUTE, s2),
                           "u": (Mode.UNION, u), "b": (Mode.BROADCAST, 4)})
               for i, (s1, s2, u) in enumerate(sizes)]
    plan = plan_operator_restore(handles, new_p)
    for name, column in (("s1", 0), ("s2", 1)):
        owners: Counter = Counter()
        per_subtask = []
        for runs in plan:
            mine = [(r.old_subtask, e) for r in runs if r.state == name for e in range(r.first, r.stop)]
            owners.update(mine)
            per_subtask.append(len(mine))
        assert set(owners) == {(i, e) for i, s in enumerate(sizes) for e in range(s[column])}
        assert set(owners.values()) <= {1}
        assert max(per_subtask) - min(per_subtask) <= 1
    everything = sorted((i, e) for i, s in enumerate(sizes) for e in range(s[2]))
    for i, runs in enumerate(plan):
        assert sorted((r.old_subtask, e) for r in runs if r.state == "u" for e in range(r.first, r.stop)) \
            == everything
        (b,) = [r for r in runs if r.state == "b"]
        assert (b.old_subtask, b.first, b.stop) == (i % len(sizes), 0, 4)


def test_the_stub_matches_the_compiled_module():
    import ast
    import inspect
    import pathlib

    import keygroups._native as native

    stub = pathlib.Path(native.__file__).with_name("splitter.pyi")
    declared = {n.name: [a.arg for a in n.args.args] for n in ast.parse(stub.read_text()).body
                if isinstance(n, ast.FunctionDef)}
    public = {name for name in dir(splitter) if not name.startswith("_") and callable(getattr(splitter, name))
              and getattr(getattr(splitter, name), "__module__", None) == splitter.__name__}
    assert set(declared) == public
    for name, args in declared.items():
        assert list(inspect.signature(getattr(splitter, name)).parameters) == args
