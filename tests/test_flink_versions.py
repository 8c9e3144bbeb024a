"""keygroups.flink reads the canonical savepoints of every Flink version from 1.15 to 2.2 (tests/flink/fixtures/versions,
written by VersionsJob.java on each version's own MiniCluster; 2.3's are tests/flink/fixtures): every operator, state,
key, timer and operator-state element equals what the job wrote (expected.txt), and each imports into keygroups and
restores, through the runtime's own backends at another parallelism, to the same values. No JVM runs here."""

from __future__ import annotations

import pathlib
import re
import shutil
import struct
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flink_canonical import dumps, plain, savepoint_lines
from flink_harness import FIXTURES
from keygroups.checkpoint import CheckpointStorage
from keygroups.errors import CorruptSnapshotError, KeyGroupsError
from keygroups.flink import (
    UnsupportedFlinkTypeError,
    UnsupportedSavepointError,
    export_savepoint,
    operator_id_for_uid,
    read_savepoint,
)
from keygroups.flink.importer import _plan, import_savepoint
from keygroups.flink.metadata import ByteStreamStateHandle, read_metadata
from keygroups.flink.types import MapType, NullableType, RowType, TtlType, TupleType
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.state_reader import operator_state_table
from keygroups.testing.harness import HarnessSnapshot, KeyedFunctionHarness
from test_flink_fuzz import EDITS, mutate, read_everything

VERSIONS = FIXTURES / "versions"
FIXTURE_DIRS = sorted(p.parent for p in VERSIONS.glob("*/*/expected.txt"))
IDS = [f"{p.parent.name}/{p.name}" for p in FIXTURE_DIRS]

#: The _metadata version each Flink line writes (MetadataV3..V6Serializer).
METADATA_VERSION = {"1.15": 3, "1.16": 4, "1.17": 4, "1.18": 4, "1.19": 4, "1.20": 4, "2.0": 5, "2.1": 6, "2.2": 6}


def _params(fixture: pathlib.Path) -> tuple[int, int]:
    """(parallelism, max parallelism) from the fixture's name (generate_version_fixtures.VersionFixture.name)."""
    m = re.match(r"p(\d+)-mp(\d+)-", fixture.name)
    assert m, fixture
    return int(m[1]), int(m[2])


def _expected(fixture: pathlib.Path) -> list[str]:
    return sorted((fixture / "expected.txt").read_text(encoding="utf-8").splitlines())


def test_every_flink_minor_version_from_1_15_to_2_2_has_a_fixture():
    minors = {".".join(p.parent.name.split(".")[:2]) for p in FIXTURE_DIRS}
    assert minors == set(METADATA_VERSION)
    names = {p.name for p in FIXTURE_DIRS}
    assert any("rocksdb" in n for n in names) and any("snappy" in n for n in names)
    assert any(_params(p)[1] > 128 for p in FIXTURE_DIRS) and any("inline" in n for n in names)


@pytest.mark.parametrize("fixture", FIXTURE_DIRS, ids=IDS)
def test_every_entry_timer_and_operator_state_element_reads_back_as_written(fixture):
    sp = read_savepoint(fixture / "savepoint")
    assert savepoint_lines(sp) == _expected(fixture)


@pytest.mark.parametrize("fixture", FIXTURE_DIRS, ids=IDS)
def test_operators_states_and_metadata_version(fixture):
    version = ".".join(fixture.parent.name.split(".")[:2])
    parallelism, max_parallelism = _params(fixture)
    meta = read_metadata((fixture / "savepoint" / "_metadata").read_bytes())
    assert meta.version == METADATA_VERSION[version]
    sp = read_savepoint(fixture / "savepoint")
    op = sp.operator("keyed")                      # by uid: its id is the uid's hash, in every version
    assert op.operator_id == operator_id_for_uid("keyed")
    assert (op.parallelism, op.max_parallelism) == (parallelism, max_parallelism)
    # uid and name are stored from metadata version 5 (Flink 2.0) on
    assert (op.uid, op.name) == (("keyed", "keyed state") if meta.version >= 5 else (None, None))
    states = {s.name: s for s in sp.states("keyed")}
    assert {n for n, s in states.items() if s.ttl} == {"ttl_value", "ttl_list", "ttl_map"}
    assert (states["list"].kind, states["map"].kind, states["reducing"].kind, states["row"].kind) == \
        ("LIST", "MAP", "REDUCING", "VALUE")
    assert states["_timer_state/event_user-timers"].kind == "TIMER"
    assert (states["op_split"].kind, states["op_union"].kind, states["op_broadcast"].kind) == \
        ("SPLIT_DISTRIBUTE", "UNION", "BROADCAST")
    assert sp.read_operator_state("keyed", "op_split") == \
        {s: [s * 100 + j for j in range(s + 1)] for s in range(parallelism)}
    kg_batches = list(sp.read_state("keyed", "ttl_value"))
    assert all(len(set(b.column("key_group").to_pylist())) == 1 for b in kg_batches)
    assert all(ts > 1_600_000_000_000 for b in kg_batches for ts in b.column("ttl_timestamp").to_pylist())


# ---------------------------------------------------------------------------------------------- import and restore

class DeclaresStates(KeyedProcessFunction):
    """Declares the imported states (as a job continuing from the savepoint would) and does nothing else."""

    def __init__(self, descriptors: list) -> None:
        self.descriptors = descriptors

    def open(self, context: Any) -> None:
        for d in self.descriptors:
            context.get_state(d)

    def process_element(self, record: dict[str, Any], context: Any) -> list:
        return []


def _flink_shaped(t: Any, v: Any) -> Any:
    """A value as keygroups' serializers give it back, shaped as the Flink reader gives it (records as sequences)."""
    if v is None:
        return None
    if isinstance(t, TtlType):
        return _flink_shaped(t.value, v)
    if isinstance(t, NullableType):
        return _flink_shaped(t.inner, v)
    if isinstance(t, (TupleType, RowType)):
        fields = v.values() if isinstance(v, dict) else v
        return tuple(_flink_shaped(f, x) for f, x in zip(t.fields, fields))
    if isinstance(t, MapType):
        return {k: _flink_shaped(t.value, x) for k, x in v.items()}
    if isinstance(v, list):
        return [_flink_shaped(t.element, x) for x in v]
    return v


@pytest.mark.parametrize("fixture", FIXTURE_DIRS, ids=IDS)
def test_imports_and_a_keygroups_restore_at_another_parallelism_reads_the_same_values(tmp_path, fixture):
    sp = read_savepoint(fixture / "savepoint")
    parallelism, max_parallelism = _params(fixture)
    report = import_savepoint(sp, str(tmp_path), "fromflink", uid="keyed")
    assert (report.parallelism, report.max_parallelism, report.skipped_states) == (parallelism, max_parallelism, ())
    infos = {s.name: s for s in sp.states("keyed")}
    plans = {name: _plan(infos[name], i, 7 * 24 * 3600 * 1000) for i, name in enumerate(report.keyed_states)}
    harness = KeyedFunctionHarness(DeclaresStates([p.descriptor for p in plans.values()]), "k", output_schema="k long",
                                   max_parallelism=max_parallelism)
    storage = CheckpointStorage(str(tmp_path))
    snapshot = HarnessSnapshot(str(tmp_path), "fromflink", storage.load_savepoint("fromflink"), 0,
                               pa.schema([("k", pa.int64())]))
    restored = harness.restore(snapshot, parallelism=parallelism + 1)
    try:
        expected = _expected(fixture)
        keys = sorted({int(line.split("\t")[2]) for line in expected if line.startswith(("keyed", "timer"))})
        lines = []
        for key in keys:
            for name in report.keyed_states:
                value = restored.state(key, name)
                if value is not None and value != [] and value != {}:
                    shaped = _flink_shaped(infos[name].value_type, value)
                    lines.append(f"keyed\t{name}\t{key}\t{dumps(plain(infos[name].value_type, shaped))}")
            for timer in restored.timers(key):
                domain = "event" if timer.domain.value == "event-time" else "processing"
                lines.append(f"timer\t{domain}\t{key}\t{timer.timestamp}")
        md = storage.load_savepoint("fromflink")
        lines += [f"split\top_split\t{r['value']}" for r in operator_state_table(storage, md, "op_split").to_pylist()]
        lines += [f"union\top_union\t{dumps(r['value'])}"
                  for r in operator_state_table(storage, md, "op_union").to_pylist()]
        broadcast = operator_state_table(storage, md, "op_broadcast").to_pylist()   # one copy per subtask
        copies = [sorted((r["key"], r["value"]) for r in broadcast if r["subtask"] == s) for s in range(parallelism)]
        assert all(c == copies[0] for c in copies)
        lines += [f"broadcast\top_broadcast\t{dumps(k)}\t{v}" for k, v in copies[0]]
        assert sorted(lines) == expected
    finally:
        restored.close()
        harness.close()


@pytest.mark.parametrize("fixture", [VERSIONS / "1.15.4" / "p2-mp128-rocksdb-files-plain",
                                     VERSIONS / "1.19.3" / "p2-mp128-hashmap-files-snappy"], ids=["1.15", "1.19"])
def test_an_export_like_an_old_savepoint_keeps_its_format_and_reads_back_equal(tmp_path, fixture):
    """Exports write operator state header version 5 (no compression flag), which Flink 1.15 to 1.17 restore and
    version 6 cannot give them (generate_version_fixtures.py --check-export has each version restore an export)."""
    flink = read_savepoint(fixture / "savepoint")
    import_savepoint(flink, str(tmp_path / "loc"), "sp", uid="keyed")
    export_savepoint(str(tmp_path / "loc"), tmp_path / "out", uid="keyed", savepoint="sp", like=flink)
    back = read_savepoint(tmp_path / "out")
    assert savepoint_lines(back) == _expected(fixture)
    streams = [st.managed_operator_state.stream for st in back.operator("keyed").subtasks if st.managed_operator_state]
    assert len(streams) == flink.operator("keyed").parallelism
    for stream in streams:
        data = stream.data if isinstance(stream, ByteStreamStateHandle) else \
            (tmp_path / "out" / stream.relative_path).read_bytes()
        assert struct.unpack(">i", data[:4]) == (5,)


# ---------------------------------------------------------------------------------------------- what is refused

def _copy(fixture: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    target = tmp_path / "sp"
    shutil.copytree(fixture / "savepoint", target)
    return target


def test_metadata_versions_outside_3_to_6_are_refused_naming_the_version_and_what_is_supported(tmp_path):
    sp = _copy(VERSIONS / "1.15.4" / "p2-mp128-hashmap-files-plain", tmp_path)
    data = bytearray((sp / "_metadata").read_bytes())
    for version, advice in ((2, "restore it in Flink 1.15 or later"), (1, "restore it in Flink 1.15 or later"),
                            (7, "newer Flink")):
        data[4:8] = version.to_bytes(4, "big")
        (sp / "_metadata").write_bytes(data)
        with pytest.raises(UnsupportedSavepointError,
                           match=rf"metadata version {version} is not supported; keygroups reads versions 3-6, the "
                                 rf"canonical savepoints of Flink 1.15 to 2.3 .*{advice}"):
            read_savepoint(sp)


def test_an_operator_state_header_older_than_flink_1_7_is_refused_by_version(tmp_path):
    sp = _copy(VERSIONS / "1.16.3" / "p2-mp128-hashmap-files-plain", tmp_path)
    # the operator state files are the small ones: header version 5, no compression flag (Flink 1.7 to 1.17)
    operator_files = [p for p in sp.iterdir() if p.name != "_metadata" and p.stat().st_size < 2000]
    assert operator_files and all(struct.unpack(">i", p.read_bytes()[:4]) == (5,) for p in operator_files)
    for p in operator_files:
        p.write_bytes(struct.pack(">i", 4) + p.read_bytes()[4:])
    with pytest.raises(UnsupportedFlinkTypeError, match="operator state header version 4 is not supported; keygroups "
                                                        r"reads versions 5 and 6 \(written by Flink 1.7 to 2.3\)"):
        read_savepoint(sp).states("keyed")


def test_a_truncated_old_metadata_file_is_corrupt(tmp_path):
    sp = _copy(VERSIONS / "1.15.4" / "p2-mp128-hashmap-files-plain", tmp_path)
    data = (sp / "_metadata").read_bytes()
    for cut in (10, len(data) // 2, len(data) - 3):
        (sp / "_metadata").write_bytes(data[:cut])
        with pytest.raises(CorruptSnapshotError):
            read_savepoint(sp).states("keyed")


#: One savepoint per metadata version below 6, and the snappy ones (operator state header 5 and 6 compressed).
FUZZED = [VERSIONS / "1.15.4" / "p2-mp128-hashmap-files-snappy", VERSIONS / "1.16.3" / "p3-mp256-rocksdb-files-plain",
          VERSIONS / "1.19.3" / "p2-mp128-hashmap-files-snappy", VERSIONS / "2.0.1" / "p2-mp128-hashmap-files-plain"]


@settings(max_examples=200, deadline=None)
@given(source=st.sampled_from(FUZZED), edits=EDITS)
def test_fuzzed_old_metadata_raises_only_keygroups_errors(source, edits):
    try:
        read_metadata(mutate((source / "savepoint" / "_metadata").read_bytes(), edits))
    except KeyGroupsError:
        pass


@settings(max_examples=100, deadline=None)
@given(source=st.sampled_from(FUZZED), target=st.integers(0, 100), edits=EDITS)
def test_fuzzed_old_savepoints_read_whole_raise_only_keygroups_errors(tmp_path_factory, source, target, edits):
    root = tmp_path_factory.mktemp("fuzz") / "sp"
    shutil.copytree(source / "savepoint", root)
    files = sorted(root.iterdir())
    victim = files[target % len(files)]
    victim.write_bytes(mutate(victim.read_bytes(), edits))
    try:
        read_everything(root)
    except (KeyGroupsError, KeyError):
        pass


def test_version_fixtures_stay_small():
    total = sum(p.stat().st_size for p in VERSIONS.rglob("*") if p.is_file())
    assert total < 1_000_000
