"""Fuzzed Flink savepoints: flipped, inserted and cut bytes in ``_metadata`` and in the keyed and operator state
files never crash the reader, never read past a buffer and never raise anything but keygroups' own errors (or a
KeyError when the operator's uid itself was hit)."""

from __future__ import annotations

import shutil

from hypothesis import given, settings
from hypothesis import strategies as st

from flink_harness import FIXTURES
from keygroups.errors import KeyGroupsError
from keygroups.flink import read_savepoint
from keygroups.flink.metadata import read_metadata

SOURCES = {name: FIXTURES / name / "savepoint" for name in
           ("p1-mp128-long-hashmap-files-snappy", "p2-mp128-long-hashmap-inline-plain",
            "p3-mp256-string-rocksdb-files-snappy")}


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    out = bytearray(data)
    for kind, pos, value in edits:
        if not out:
            break
        pos %= len(out)
        if kind == 0:
            out[pos] ^= value or 1
        elif kind == 1:
            out.insert(pos, value)
        elif kind == 2:
            del out[pos:pos + value % 9 + 1]
        else:
            del out[pos:]
    return bytes(out)


def read_everything(path) -> None:
    sp = read_savepoint(path)
    for op in sp.operators:
        uid = op.uid or op.operator_id_hex
        states = sp.states(uid)
        for s in states:
            if s.keyed:
                for _ in sp.read_state(uid, s.name):
                    pass
            else:
                sp.read_operator_state(uid, s.name)


EDITS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1,
                 max_size=4)


@settings(max_examples=300)
@given(name=st.sampled_from(sorted(SOURCES)), edits=EDITS)
def test_fuzzed_metadata_raises_only_keygroups_errors(name, edits):
    data = mutate((SOURCES[name] / "_metadata").read_bytes(), edits)
    try:
        read_metadata(data)
    except KeyGroupsError:
        pass


@settings(max_examples=150)
@given(name=st.sampled_from(sorted(SOURCES)), target=st.integers(0, 100), edits=EDITS, data=st.data())
def test_fuzzed_savepoints_read_whole_raise_only_keygroups_errors(tmp_path_factory, name, target, edits, data):
    root = tmp_path_factory.mktemp("fuzz") / "sp"
    shutil.copytree(SOURCES[name], root)
    files = sorted(root.iterdir())
    victim = files[target % len(files)]
    victim.write_bytes(mutate(victim.read_bytes(), edits))
    try:
        read_everything(root)
    except (KeyGroupsError, KeyError):
        pass


@settings(max_examples=60)
@given(name=st.sampled_from(sorted(SOURCES)), target=st.integers(0, 100), edits=EDITS)
def test_fuzzed_savepoints_import_raise_only_keygroups_errors(tmp_path_factory, name, target, edits):
    """The compiled import (block scanner and transcoder) on damaged keyed and operator state files: keygroups'
    errors, never a crash or a read past a buffer; nothing half-written becomes a savepoint."""
    from keygroups.flink import import_savepoint

    root = tmp_path_factory.mktemp("fuzz") / "sp"
    shutil.copytree(SOURCES[name], root)
    files = sorted(root.iterdir())   # inline state lives in _metadata
    victim = files[target % len(files)]
    victim.write_bytes(mutate(victim.read_bytes(), edits))
    location = root.parent / "imported"
    try:
        import_savepoint(root, str(location), "sp", uid="keyed")
    except (KeyGroupsError, KeyError):
        assert not (location / "savepoints" / "sp" / "_metadata").exists()
