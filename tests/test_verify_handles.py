"""``keygroups verify`` checks every handle against its file (issue 22): a ``_metadata`` whose sizes, offsets, full
blocks or chains do not match the files exits 1 naming the handle and what is wrong; a missing raw keyed file is a
CorruptSnapshotError naming the file, the checkpoint and the subtask, at restore as in verify."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import pytest
from test_raw_keyed_state import raw_counts
from test_raw_keyed_state import run_batch as run_raw_keyed_batch

from keygroups import KeyGroupRange
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, RawKeyedStateReader
from keygroups.checkpoint.metadata import encode_metadata
from keygroups.cli import main
from keygroups.errors import CorruptSnapshotError


@pytest.fixture
def checkpoint(tmp_path):
    """A real checkpoint with keyed and raw keyed state (three subtasks), which verify passes."""
    storage = CheckpointStorage(str(tmp_path))
    run_raw_keyed_batch(storage, list(range(60)), 3)
    md, _ = run_raw_keyed_batch(storage, list(range(40, 90)), 3)
    assert main(["verify", str(tmp_path)]) == 0
    return storage, md


def _tamper(storage: CheckpointStorage, md: CheckpointMetadata, change: Callable[[CheckpointMetadata], None]) -> None:
    """Rewrite the checkpoint's ``_metadata`` (a valid one, checksum and all) with ``change`` applied."""
    altered = dataclasses.replace(md, keyed_handles=list(md.keyed_handles),
                                  raw_keyed_handles=list(md.raw_keyed_handles))
    change(altered)
    path = os.path.join(storage.location, md.base, "_metadata")
    with open(path, "wb") as f:
        f.write(encode_metadata(altered, md.base))


def _verify(storage: CheckpointStorage, capsys) -> str:
    capsys.readouterr()
    assert main(["verify", storage.location]) == 1
    return capsys.readouterr().err


def _keyed(md: CheckpointMetadata, subtask: int):
    return next(h for h in md.keyed_handles if h.subtask == subtask and h.checkpoint_id == md.checkpoint_id)


def _replace_keyed(md: CheckpointMetadata, old, new) -> None:
    md.keyed_handles = [new if h is old else h for h in md.keyed_handles]


def test_a_keyed_handle_size_that_does_not_match_its_file(checkpoint, capsys):
    storage, md = checkpoint
    h = _keyed(md, 1)
    _tamper(storage, md, lambda m: _replace_keyed(m, h, dataclasses.replace(h, size=h.size + 7)))
    err = _verify(storage, capsys)
    assert (f"CORRUPT keyed state file {h.file} (handle of subtask 1, written by checkpoint {md.checkpoint_id}): "
            f"the file is {h.size} bytes, its handle says {h.size + 7}") in err


def test_a_keyed_handle_offset_that_does_not_match_the_file_index(checkpoint, capsys):
    storage, md = checkpoint
    h = _keyed(md, 2)
    i = next(i for i in range(1, len(h.offsets) - 1) if h.offsets[i] < h.offsets[i + 1])
    offsets = list(h.offsets)
    offsets[i] += 1
    _tamper(storage, md, lambda m: _replace_keyed(m, h, dataclasses.replace(h, offsets=offsets)))
    err = _verify(storage, capsys)
    assert (f"CORRUPT keyed state file {h.file} (handle of subtask 2, written by checkpoint {md.checkpoint_id}): its "
            f"index puts key group {h.key_group_range.start + i} at byte {h.offsets[i]}, its handle says "
            f"{h.offsets[i] + 1}") in err


def test_a_keyed_handle_that_calls_full_blocks_deltas(checkpoint, capsys):
    storage, md = checkpoint
    full = next(h for h in md.keyed_handles if h.is_full(h.key_group_range.start))
    kg = full.key_group_range.start
    rest = [r for r in (KeyGroupRange(kg + 1, fr.end) if fr.start == kg else fr for fr in full.full_key_groups) if r]
    _tamper(storage, md, lambda m: _replace_keyed(m, full, dataclasses.replace(full, full_key_groups=rest)))
    err = _verify(storage, capsys)
    assert f"key group {kg}'s block is full, its handle says a delta" in err
    assert f"keyed state chains: checkpoint {md.checkpoint_id} lists a delta block of key group {kg}" in err


def test_raw_keyed_handle_size_and_offsets(checkpoint, capsys):
    storage, md = checkpoint
    h = md.raw_keyed_handles[0]
    _tamper(storage, md, lambda m: setattr(m, "raw_keyed_handles",
                                           [dataclasses.replace(h, size=h.size - 1, offsets=[*h.offsets[:-1],
                                                                                              h.size - 1]),
                                            *m.raw_keyed_handles[1:]]))
    err = _verify(storage, capsys)
    assert (f"CORRUPT raw keyed state file {h.file} (handle of subtask {h.subtask}): the file is {h.size} bytes, its "
            f"handle says {h.size - 1}") in err
    offsets = list(h.offsets)
    offsets[1] += 2
    offsets[2] = max(offsets[2], offsets[1])
    _tamper(storage, md, lambda m: setattr(m, "raw_keyed_handles",
                                           [dataclasses.replace(h, offsets=offsets), *m.raw_keyed_handles[1:]]))
    err = _verify(storage, capsys)
    assert (f"CORRUPT raw keyed state file {h.file} (handle of subtask {h.subtask}): key group "
            f"{h.key_group_range.start + 1}'s block starts at byte {h.offsets[1]}, its handle says {offsets[1]}") in err


def test_a_missing_raw_keyed_file_names_file_checkpoint_and_subtask(checkpoint, capsys):
    storage, md = checkpoint
    assert raw_counts(storage, md, 3)   # readable before
    victim = md.raw_keyed_handles[1]
    os.remove(os.path.join(storage.location, victim.file))
    err = _verify(storage, capsys)
    assert f"CORRUPT raw keyed state file {victim.file} (handle of subtask {victim.subtask}): missing from" in err
    reader = RawKeyedStateReader(storage, md, victim.key_group_range)
    with pytest.raises(CorruptSnapshotError, match=rf"raw keyed state file {victim.file} \(subtask "
                                                   rf"{victim.subtask}\), key groups .* of checkpoint "
                                                   rf"{md.checkpoint_id} is missing from"):
        reader.stream(victim.key_group_range.start)
