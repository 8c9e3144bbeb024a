"""The compiled import and export of Flink window state (``window-contents`` in ``TimeWindow`` namespaces, window
timers; _native/flinkin.pyx, _native/flinkout.pyx) against the Python path of keygroups.flink.windows, which is
their reference: both write byte-identical files, for the committed Flink fixtures (operator ``window``) and for
keygroups window jobs' state; corrupt window entries raise CorruptSnapshotError."""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flink_harness import FIXTURE_SET, FIXTURES
from test_flink_fast_import import _block_sections, _keyed_files
from keygroups.errors import CorruptSnapshotError, KeyGroupsError
from keygroups.flink import import_savepoint, read_savepoint
from keygroups.flink import importer
from keygroups.flink.transcode import NotCompiled, state_plan
from keygroups.flink.types import IntType, LongType, StringType, TimeWindowType, TupleType
from keygroups.flink.windows import FlinkWindows

FIXTURE_NAMES = [f.name for f in FIXTURE_SET]


def _python_import_only(monkeypatch):
    def no_fast_plan(st, key_type):
        raise NotCompiled("the Python path, for comparison")
    monkeypatch.setattr(importer, "_fast_plan", no_fast_plan)


def _assert_same_files(fast_dir: pathlib.Path, slow_dir: pathlib.Path, name: str) -> None:
    a, b = _keyed_files(fast_dir, name), _keyed_files(slow_dir, name)
    assert sorted(a) == sorted(b) and a
    if a != b:   # name the first state and key group that differ
        sa, sb = _block_sections(fast_dir, name), _block_sections(slow_dir, name)
        assert sa.keys() == sb.keys()
        for where in sorted(sa):
            assert sa[where] == sb[where], f"key group {where[0]}, state {where[1]!r}"
        pytest.fail("the keyed files differ outside their sections")


def _same_import(tmp_path, monkeypatch, savepoint, uid="window", **kwargs):
    sp = read_savepoint(savepoint)
    fast = import_savepoint(sp, str(tmp_path / "fast"), "sp", uid=uid, **kwargs)
    with monkeypatch.context() as m:
        _python_import_only(m)
        slow = import_savepoint(sp, str(tmp_path / "slow"), "sp", uid=uid, **kwargs)
    assert (fast.entries, fast.timers, fast.key_groups, fast.keyed_states) == \
        (slow.entries, slow.timers, slow.key_groups, slow.keyed_states)
    _assert_same_files(tmp_path / "fast", tmp_path / "slow", "sp")
    return fast


# ---------------------------------------------------------------------------------------------- import

@pytest.mark.parametrize("layout", ["operator", "state"])
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_compiled_window_import_writes_what_the_python_path_writes(tmp_path, monkeypatch, name, layout):
    report = _same_import(tmp_path, monkeypatch, FIXTURES / name / "savepoint", windows=FlinkWindows(layout=layout))
    assert report.entries > 0 and report.timers > 0


@pytest.mark.parametrize("layout", ["operator", "state"])
def test_window_contents_and_window_timers_take_the_compiled_import(layout):
    sp = read_savepoint(FIXTURES / FIXTURE_NAMES[0] / "savepoint")
    infos = [s for s in sp.states("window") if s.keyed]
    plans = [importer._plan(info, i, 1000, windows=FlinkWindows(layout=layout)) for i, info in enumerate(infos)]
    fast = importer._fast_plans(plans, sp.keyed_header("window").key_type)
    assert "window-contents" in fast and any(n.endswith("window-timers") for n in fast)
    assert set(fast) == {st.info.name for st in plans}
    assert all(p.namespaced for p in fast.values())
    # sessions' contents move to their sessions the Python way (operator layout); their timers stay compiled
    sessions = importer._fast_plans(plans, sp.keyed_header("window").key_type, sessions=True)
    moved = {"window-contents"} if layout == "operator" else set()
    assert set(sessions) == set(fast) - moved
