"""Hostile Flink savepoints: a ``_metadata`` that claims impossible sizes, names a FIFO, a directory, a file outside
the savepoint or a URL; state files whose names would echo what a file holds. Each is refused with keygroups' own
error naming the file and what was expected, before anything is allocated, blocks or is written; nothing outside
the savepoint directory is read unless the caller allows it. Also the CLI's refusals (a wrong uid, an export into
a non-empty directory or for an empty uid): one line, exit code 2, nothing written."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import threading

import pytest

from flink_harness import FIXTURES
from keygroups.errors import CheckpointNotFoundError, CorruptSnapshotError, KeyGroupsError
from keygroups.flink import (
    OperatorNotFoundError,
    PathOutsideSavepointError,
    UnsupportedFlinkTypeError,
    import_savepoint,
    read_savepoint,
)
from keygroups.flink._cursor import SHOWN_CHARACTERS
from keygroups.flink.metadata import FileStateHandle, RelativeFileStateHandle, read_metadata, write_metadata

FILES = FIXTURES / "p1-mp128-long-hashmap-files-snappy" / "savepoint"   # every handle a relative file handle


def _copy(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "sp"
    shutil.copytree(FILES, root)
    return root


def _rewrite_handles(root: pathlib.Path, change) -> None:
    """Rewrite ``root/_metadata`` (as version 3) with every file stream handle replaced by ``change(handle)``."""
    md = read_metadata((root / "_metadata").read_bytes())
    operators = []
    for op in md.operators:
        subtasks = []
        for st in op.subtasks:
            fields = {}
            for name in ("managed_keyed_state", "managed_operator_state"):
                h = getattr(st, name)
                if h is not None and isinstance(h.stream, (RelativeFileStateHandle, FileStateHandle)):
                    fields[name] = dataclasses.replace(h, stream=change(h.stream))
            subtasks.append(dataclasses.replace(st, **fields))
        operators.append(dataclasses.replace(op, subtasks=tuple(subtasks)))
    (root / "_metadata").write_bytes(write_metadata(md.checkpoint_id, operators))


def _keyed_file(root: pathlib.Path) -> pathlib.Path:
    sp = read_savepoint(root)
    (st,) = sp.operator("keyed").subtasks
    return root / st.managed_keyed_state.stream.relative_path


def _nothing_written(location: pathlib.Path, name: str = "x") -> bool:
    return not (location / "savepoints" / name).exists()


def _entries(report) -> tuple:
    return report.key_groups, report.entries, report.timers, report.operator_states


# ---------------------------------------------------------------------------------------------- sizes and kinds


@pytest.mark.parametrize("which", ["keyed", "operator"])
def test_a_handle_claiming_2_to_the_62_bytes_is_refused_before_anything_is_allocated(tmp_path, which):
    root = _copy(tmp_path)
    target = _keyed_file(root).name if which == "keyed" else None
    op_file = read_savepoint(root).operator("keyed").subtasks[0].managed_operator_state.stream.relative_path
    target = target or op_file
    _rewrite_handles(root, lambda h: dataclasses.replace(h, size=2**62) if h.relative_path == target else h)
    sp = read_savepoint(root)
    with pytest.raises(CorruptSnapshotError) as refused:
        if which == "keyed":
            list(sp.key_groups("keyed"))
        else:
            sp.read_operator_state("keyed", "op_split")
    message = str(refused.value)
    assert target in message and str(2**62) in message and str((root / target).stat().st_size) in message
    with pytest.raises(CorruptSnapshotError, match=str(2**62)):
        import_savepoint(root, str(tmp_path / "out"), "x", uid="keyed")
    assert _nothing_written(tmp_path / "out")


def test_a_claimed_size_is_never_allocated_where_the_file_system_does_not_say_a_files_size(tmp_path, monkeypatch):
    """Some file systems list no size: the claim cannot be checked first, so the file is read in bounded chunks and
    found short, never allocated whole."""
    from fsspec.implementations.local import LocalFileSystem

    root = _copy(tmp_path)
    target = read_savepoint(root).operator("keyed").subtasks[0].managed_operator_state.stream.relative_path
    _rewrite_handles(root, lambda h: dataclasses.replace(h, size=2**62) if h.relative_path == target else h)
    info = LocalFileSystem.info
    monkeypatch.setattr(LocalFileSystem, "info", lambda self, path, **kw: {
        k: v for k, v in info(self, path, **kw).items() if k != "size"})
    with pytest.raises(CorruptSnapshotError, match=f"expected {2**62} \\(the file is truncated\\)"):
        read_savepoint(root).read_operator_state("keyed", "op_split")


def test_a_negative_handle_size_is_corrupt(tmp_path):
    root = _copy(tmp_path)
    _rewrite_handles(root, lambda h: dataclasses.replace(h, size=-5))
    with pytest.raises(CorruptSnapshotError, match="-5 bytes"):
        import_savepoint(root, str(tmp_path / "out"), "x", uid="keyed")


def _within(seconds: float, call):
    """``call()``'s exception (or None), failing the test if it does not return in ``seconds`` (a FIFO would block
    the reader forever: the thread is left behind, the test fails)."""
    outcome: list = []

    def run():
        try:
            call()
            outcome.append(None)
        except BaseException as e:   # handed to the test
            outcome.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert outcome, f"still blocked after {seconds} s"
    return outcome[0]


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_directory_in_place_of_a_state_file_is_refused_naming_it(tmp_path, kind):
    root = _copy(tmp_path)
    victim = _keyed_file(root)
    victim.unlink()
    os.mkfifo(victim) if kind == "fifo" else victim.mkdir()
    error = _within(60, lambda: import_savepoint(root, str(tmp_path / "out"), "x", uid="keyed"))
    assert isinstance(error, CorruptSnapshotError), error
    assert str(victim) in str(error) and "regular file" in str(error)
    said = str(error).split(str(victim))[1]
    assert ("FIFO" in said) == (kind == "fifo") and ("is a directory" in said) == (kind == "directory")
    assert _nothing_written(tmp_path / "out")
    error = _within(60, lambda: list(read_savepoint(root).key_groups("keyed")))
    assert isinstance(error, CorruptSnapshotError) and "regular file" in str(error)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_directory_as_metadata_is_refused(tmp_path, kind):
    root = _copy(tmp_path)
    (root / "_metadata").unlink()
    os.mkfifo(root / "_metadata") if kind == "fifo" else (root / "_metadata").mkdir()
    error = _within(60, lambda: read_savepoint(root))
    assert isinstance(error, CorruptSnapshotError) and "_metadata" in str(error) and "regular file" in str(error)


# ---------------------------------------------------------------------------------------------- paths


def test_absolute_paths_inside_the_savepoint_read_as_relative_ones(tmp_path):
    """A non-relocatable savepoint where Flink wrote it: absolute paths into its own directory need no opt-in."""
    root = _copy(tmp_path)
    want = _entries(import_savepoint(FILES, str(tmp_path / "a"), "x", uid="keyed"))
    forms = iter([str(root / "{}"), "file:" + str(root / "{}"), "file://" + str(root / "{}")])
    form_of: dict[str, str] = {}

    def absolute(h):
        form = form_of.setdefault(h.relative_path, next(forms, str(root / "{}")))
        return FileStateHandle(form.format(h.relative_path), h.size)

    _rewrite_handles(root, absolute)
    got = import_savepoint(root, str(tmp_path / "b"), "x", uid="keyed")
    assert _entries(got) == want and got.bytes_read > 0


def test_a_file_outside_the_savepoint_is_refused_unless_allowed(tmp_path):
    root = _copy(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    keyed = _keyed_file(root)
    moved = elsewhere / keyed.name
    keyed.rename(moved)
    _rewrite_handles(root, lambda h: FileStateHandle(str(moved), h.size) if h.relative_path == keyed.name else h)
    with pytest.raises(PathOutsideSavepointError) as refused:
        import_savepoint(root, str(tmp_path / "out"), "x", uid="keyed")
    message = str(refused.value)
    assert str(moved) in message and "allow_paths_outside=True" in message and "--allow-paths-outside" in message
    assert _nothing_written(tmp_path / "out")
    with pytest.raises(PathOutsideSavepointError):
        read_savepoint(root).states("keyed")
    want = _entries(import_savepoint(FILES, str(tmp_path / "a"), "x", uid="keyed"))
    got = import_savepoint(root, str(tmp_path / "out"), "x", uid="keyed", allow_paths_outside=True)
    assert _entries(got) == want


@pytest.mark.parametrize("path", ["http://127.0.0.1:9/state", "s3://bucket/state", "/etc/hostname",
                                  "file:///etc/hostname", "file:/etc/../etc/hostname"])
def test_urls_and_system_files_named_by_a_crafted_metadata_are_never_touched(tmp_path, path):
    root = _copy(tmp_path)
    _rewrite_handles(root, lambda h: FileStateHandle(path, h.size))
    sp = read_savepoint(root)
    with pytest.raises(PathOutsideSavepointError, match="allow_paths_outside"):
        sp.states("keyed")
    with pytest.raises(PathOutsideSavepointError):
        import_savepoint(root, str(tmp_path / "out"), "x", uid="keyed")
    assert _nothing_written(tmp_path / "out")


def test_a_symbolic_link_out_of_the_savepoint_is_outside(tmp_path):
    root = _copy(tmp_path)
    keyed = _keyed_file(root)
    outside = tmp_path / "outside-copy"
    keyed.rename(outside)
    keyed.symlink_to(outside)
    with pytest.raises(PathOutsideSavepointError, match="symbolic link"):
        import_savepoint(root, str(tmp_path / "out"), "x", uid="keyed")
    assert import_savepoint(root, str(tmp_path / "out"), "x", uid="keyed", allow_paths_outside=True).entries > 0


def test_a_relative_handle_climbing_out_is_corrupt(tmp_path):
    root = _copy(tmp_path)
    _rewrite_handles(root, lambda h: RelativeFileStateHandle("../" + h.relative_path, h.size))
    with pytest.raises(CorruptSnapshotError, match="outside the savepoint"):
        read_savepoint(root)


def test_a_flink_savepoint_object_keeps_its_own_choice(tmp_path):
    sp = read_savepoint(FILES)
    with pytest.raises(ValueError, match="read_savepoint\\(path, allow_paths_outside=True\\)"):
        import_savepoint(sp, str(tmp_path), "x", uid="keyed", allow_paths_outside=True)


# ---------------------------------------------------------------------------------------------- what messages show


def test_an_error_never_echoes_what_a_file_holds(tmp_path):
    """A serializer class name made of escape sequences and text: the message shows it escaped and cut, not raw."""
    root = _copy(tmp_path)
    keyed = _keyed_file(root)
    old = b"org.apache.flink.api.common.typeutils.base.BooleanSerializer$BooleanSerializerSnapshot"
    payload = (b"\x1b[2J\x07" + b"s3cr3t-" * 20)[:len(old)]
    data = keyed.read_bytes()
    assert old in data
    keyed.write_bytes(data.replace(old, payload, 1))
    with pytest.raises(UnsupportedFlinkTypeError) as refused:
        read_savepoint(root).states("keyed")
    message = str(refused.value)
    assert "\x1b" not in message and "\x07" not in message and "\\x1b" in message
    assert message.count("s3cr3t") * len("s3cr3t-") <= SHOWN_CHARACTERS
    assert f"({len(old)} characters)" in message


def test_a_state_name_of_65535_characters_is_shown_cut(tmp_path):
    from keygroups.flink._cursor import shown

    name = "n" * 65535
    assert len(shown(name)) < 2 * SHOWN_CHARACTERS and "65535 characters" in shown(name)
    assert shown(b"\x00secret") == "<7 bytes>"
    assert shown("row") == "'row'"


# ---------------------------------------------------------------------------------------------- the CLI


def test_a_wrong_uid_prints_one_line_listing_the_operators(tmp_path, capsys):
    from keygroups.cli import main

    assert main(["flink", "import", str(FILES), str(tmp_path), "--name", "x", "--uid", "WRONG"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "no operator with uid 'WRONG'" in err
    for uid in ("keyed", "window", "source"):
        assert f"uid '{uid}'" in err
    assert "name 'keyed state'" in err and "stores no uids" not in err
    assert "uid not stored, name 'Timestamps/Watermarks'" in err and "found by its id" in err
    assert _nothing_written(tmp_path)
    with pytest.raises(OperatorNotFoundError) as refused:
        read_savepoint(FILES).operator("WRONG")
    assert isinstance(refused.value, KeyError) and isinstance(refused.value, KeyGroupsError)
    assert str(refused.value).startswith("the savepoint")   # not a KeyError's quoted repr


def test_an_old_savepoint_without_uids_says_how_to_find_the_operator(tmp_path):
    root = _copy(tmp_path)
    _rewrite_handles(root, lambda h: h)   # version 3: no uids stored
    with pytest.raises(OperatorNotFoundError, match="version 3, stores no uids.*hash, or an operator id"):
        read_savepoint(root).operator("WRONG")
    assert read_savepoint(root).operator("keyed").max_parallelism == 128   # found by its uid's hash


def _a_keygroups_savepoint(tmp_path: pathlib.Path) -> pathlib.Path:
    location = tmp_path / "kg"
    import_savepoint(FILES, str(location), "sp", uid="keyed", skip_states=["bytes"])
    return location


@pytest.mark.parametrize("present", ["a file", "_metadata"])
def test_export_into_a_non_empty_directory_is_refused_and_writes_nothing(tmp_path, capsys, present):
    from keygroups.cli import main

    location = _a_keygroups_savepoint(tmp_path)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / ("notes.txt" if present == "a file" else "_metadata")).write_text("mine")
    before = sorted(p.name for p in dest.iterdir())
    assert main(["flink", "export", str(location), str(dest), "--savepoint", "sp", "--uid", "keyed"]) == 2
    err = capsys.readouterr().err
    assert str(dest) in err and "new or empty directory" in err and "Traceback" not in err
    assert sorted(p.name for p in dest.iterdir()) == before and (dest / before[0]).read_text() == "mine"


@pytest.mark.parametrize("uid", ["", "  "])
def test_export_for_an_empty_uid_is_refused_and_writes_nothing(tmp_path, capsys, uid):
    from keygroups.cli import main

    location = _a_keygroups_savepoint(tmp_path)
    dest = tmp_path / "dest"
    assert main(["flink", "export", str(location), str(dest), "--savepoint", "sp", "--uid", uid]) == 2
    assert "is empty: give the uid" in capsys.readouterr().err
    assert not dest.exists()


def test_a_failed_export_leaves_its_directory_empty(tmp_path):
    """A damaged keygroups state file is found while the Flink files are being written: what was written goes, so
    the same directory takes the next try."""
    from keygroups.flink import export_savepoint

    location = _a_keygroups_savepoint(tmp_path)
    (keyed,) = (location / "savepoints" / "sp").glob("keyed-*")
    data = keyed.read_bytes()
    keyed.write_bytes(data[: len(data) // 2])
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(CorruptSnapshotError):
        export_savepoint(str(location), dest, uid="keyed", savepoint="sp")
    assert list(dest.iterdir()) == []
    keyed.write_bytes(data)
    assert export_savepoint(str(location), dest, uid="keyed", savepoint="sp").entries > 0
    with pytest.raises(CorruptSnapshotError):
        keyed.write_bytes(data[: len(data) // 2])
        export_savepoint(str(location), tmp_path / "new", uid="keyed", savepoint="sp")
    assert not (tmp_path / "new").exists()


def test_missing_state_file_is_named(tmp_path):
    root = _copy(tmp_path)
    victim = _keyed_file(root)
    victim.unlink()
    with pytest.raises(CheckpointNotFoundError, match=victim.name):
        import_savepoint(root, str(tmp_path / "out"), "x", uid="keyed")
    assert _nothing_written(tmp_path / "out")


def test_a_count_refusal_says_which_bound_it_broke():
    """'N items: more than the R remaining bytes can hold' was said of a negative count and of one above the limit
    too; each bound is named now."""
    import struct

    from keygroups.flink._cursor import Cursor

    def count(n: int, tail: int = 0, limit: int = 100) -> str:
        with pytest.raises(CorruptSnapshotError) as refused:
            Cursor(struct.pack(">i", n) + bytes(tail), "f").count("the number of things", 8, limit=limit)
        return str(refused.value)

    assert "is -3, below 0" in count(-3, tail=1000)
    assert "is 500, above the most keygroups reads (100)" in count(500, tail=10_000)
    said = count(5, tail=16)
    assert "5 items of at least 8 bytes each need 40 bytes, but 16 remain" in said


def test_too_few_bytes_for_the_subtask_states_is_not_blamed_on_the_parallelism(tmp_path):
    md = read_metadata((FILES / "_metadata").read_bytes())
    data = write_metadata(md.checkpoint_id, list(md.operators))
    cut = data[: data.index(md.operators[-1].operator_id) + 16 + 4 + 4 + 1 + 4 + 2]
    with pytest.raises(CorruptSnapshotError) as refused:
        read_metadata(cut)
    assert "for an operator of parallelism" not in str(refused.value)
    assert "1 subtask states need at least 4 bytes, but 2 remain" in str(refused.value)
