"""What a batch's task pays at a large max parallelism follows the batch (issue 32's task side): a delta file's
untouched key groups are encoded in one compiled call per run, byte for byte as one ``encode_block`` each wrote them;
the links a writer's blocks name are arrays; a restore point's carried keyed handles are decoded once per process,
then reused from every later ``_metadata`` that lists them; a handle's changed key groups are worked out with numpy.
The format itself is unchanged (keyed format 4), so every older file still reads as before."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange
from keygroups._native import snapshot as native
from keygroups.checkpoint import KeyedSnapshotWriter, open_snapshot
from keygroups.checkpoint import metadata as md
from keygroups.checkpoint.metadata import (
    EMPTY_BLOCK_SIZE,
    BlockLink,
    BlockLinks,
    CheckpointMetadata,
    KeyedStateHandle,
    decode_metadata,
    encode_metadata,
)
from keygroups.errors import CorruptSnapshotError

STATES = [{"name": "sum", "kind": "value"}, {"name": "seen", "kind": "list"}]
U32 = (1 << 32) - 1

links = st.one_of(st.none(), st.tuples(st.integers(0, (1 << 63) - 1), st.integers(0, U32)))


@settings(max_examples=150, deadline=None)
@given(first=st.integers(0, 32768 - 64), full=st.booleans(), named=st.lists(links, max_size=64),
       file_id=st.binary(min_size=16, max_size=16))
def test_empty_blocks_in_one_call_are_the_blocks_encode_block_writes(first, full, named, file_id):
    if full:
        named = [None] * len(named)
    seed = crc32c(file_id)
    checkpoints = np.array([-1 if x is None else x[0] for x in named], dtype=np.int64)
    checksums = np.array([0 if x is None else x[1] for x in named], dtype=np.int64)
    data, stored = native.encode_empty_blocks(first, full, checkpoints, checksums, seed)
    blocks = [native.encode_block(first + i, (), 2, full=full, predecessor=x, file_seed=seed)
              for i, x in enumerate(named)]
    assert data == b"".join(blocks)
    assert stored.dtype == np.uint32
    assert stored.tolist() == [int.from_bytes(b[-4:], "little") for b in blocks]
    for i, x in enumerate(named):   # and each parses back as the empty block it is, linked as named
        block = data[i * native.BLOCK_OVERHEAD:(i + 1) * native.BLOCK_OVERHEAD]
        flags, puts, deletes = native.parse_block(block, first + i, 2, file_seed=seed)
        assert (puts, deletes, bool(flags & native.BLOCK_FULL)) == ([], [], full)
        assert bool(flags & native.BLOCK_LINKED) == (x is not None)


@pytest.mark.parametrize(("full", "checkpoints", "checksums", "message"), [
    (False, [-2], [0], "must be"),
    (False, [-1], [5], "must be"),
    (False, [3], [1 << 32], "must be"),
    (False, [3], [-1], "must be"),
    (True, [3], [7], "a full block names none"),
    (False, [3, 4], [7], "equally long"),
])
def test_empty_blocks_refuse_links_no_block_can_name(full, checkpoints, checksums, message):
    with pytest.raises(ValueError, match=message):
        native.encode_empty_blocks(0, full, np.array(checkpoints, dtype=np.int64),
                                   np.array(checksums, dtype=np.int64))


def test_empty_blocks_stay_inside_flinks_key_groups():
    with pytest.raises(ValueError, match="past Flink's 32768"):
        native.encode_empty_blocks(32760, False, np.full(9, -1, dtype=np.int64), np.zeros(9, dtype=np.int64))
    data, stored = native.encode_empty_blocks(32760, False, np.full(8, -1, dtype=np.int64),
                                              np.zeros(8, dtype=np.int64))
    assert len(data) == 8 * native.BLOCK_OVERHEAD and len(stored) == 8


def _reference_file(key_group_range, written, default_full, predecessors, file_id):
    """The file as a writer that encodes one ``encode_block`` per key group (the one before this change) wrote it:
    header, every block in key-group order, index; with the links and checksums it records."""
    seed = crc32c(file_id)
    meta = json.dumps({"file_id": file_id.hex(), "states": STATES}, sort_keys=True, separators=(",", ":"),
                      allow_nan=False, ensure_ascii=False).encode("utf-8")
    out = native.encode_header(key_group_range.start, len(key_group_range), meta)
    offsets, named, full_groups = [len(out)], {}, []
    for kg in key_group_range:
        if kg in written:
            sections, full, link = written[kg]
        else:
            sections = ()
            full = default_full if isinstance(default_full, bool) else kg in default_full
            link = None if full else predecessors.get(kg)
        out += native.encode_block(kg, sections, len(STATES), full=full, predecessor=link, file_seed=seed)
        offsets.append(len(out))
        if full:
            full_groups.append(kg)
        elif link is not None:
            named[kg] = BlockLink(*link)
    return out + native.encode_index(offsets), offsets, named, full_groups


@settings(max_examples=60, deadline=None)
@given(data=st.data(), start=st.integers(0, 4000), n=st.integers(0, 70),
       default=st.one_of(st.booleans(), st.just("some")))
def test_the_writer_writes_the_file_one_block_per_key_group_did(data, start, n, default):
    r = KeyGroupRange(start, start + n - 1) if n else KeyGroupRange.empty()
    kgs = list(r)
    default_full = (set(data.draw(st.lists(st.sampled_from(kgs), unique=True))) if default == "some" and kgs
                    else bool(default) if default != "some" else True)
    predecessors = {kg: data.draw(st.tuples(st.integers(0, 1000), st.integers(0, U32)))
                    for kg in data.draw(st.lists(st.sampled_from(kgs), unique=True) if kgs else st.just([]))}
    predecessors[start + n + 5] = (1, 1)   # a key group outside the range is not this file's: ignored
    written = {}
    for kg in sorted(data.draw(st.lists(st.sampled_from(kgs), unique=True) if kgs else st.just([]))):
        full = data.draw(st.booleans())
        sections = [(0, [b"k%d" % kg], [b"v"])] if data.draw(st.booleans()) else []
        written[kg] = (sections, full, None if full else predecessors.get(kg))
    file_id = data.draw(st.binary(min_size=16, max_size=16))
    stream = io.BytesIO()
    writer = KeyedSnapshotWriter(stream, r, STATES, default_full=default_full, file_id=file_id,
                                 predecessors={kg: BlockLink(*x) for kg, x in predecessors.items()})
    for kg, (sections, full, link) in written.items():
        writer.write_key_group(kg, sections, full=full, predecessor=link)
    offsets, size = writer.finish()
    expected, expected_offsets, named, full_groups = _reference_file(r, written, default_full, predecessors, file_id)
    assert stream.getvalue() == expected
    assert (offsets, size) == (expected_offsets, len(expected))
    assert writer.predecessors == named
    assert writer.full_key_groups == md.key_group_runs(full_groups)
    opened = open_snapshot(expected)
    assert writer.checksums == opened.checksums()
    for block in opened.key_groups():   # every block checks against the file's id
        assert block.predecessor == named.get(block.key_group)


def test_the_writer_refuses_a_link_no_block_can_name():
    with pytest.raises(ValueError, match="u32 checksum"):
        KeyedSnapshotWriter(io.BytesIO(), KeyGroupRange(0, 3), STATES, default_full=False,
                            predecessors={1: BlockLink(3, 1 << 32)})
    with pytest.raises(ValueError, match="checkpoint id"):
        KeyedSnapshotWriter(io.BytesIO(), KeyGroupRange(0, 3), STATES, default_full=False,
                            predecessors={1: ("x", 3)})


# ---- the handles of a restore point, decoded once per process ---------------------------------------------------

def _delta_handle(checkpoint_id: int, r: KeyGroupRange, changed: dict[int, int], *, subtask: int = 0,
                  full: list[KeyGroupRange] | None = None) -> KeyedStateHandle:
    """A format-4 handle over ``r`` whose blocks are empty deltas but those of ``changed`` (key group -> bytes)."""
    sizes = [changed.get(kg, EMPTY_BLOCK_SIZE) for kg in r]
    offsets = [100 + sum(sizes[:i]) for i in range(len(sizes) + 1)]
    full = full or []
    unlinked = {kg for f in full for kg in f}
    return KeyedStateHandle(
        file=f"shared/keyed-{subtask}-{checkpoint_id}", subtask=subtask, key_group_range=r, offsets=offsets,
        size=offsets[-1] + 20, states=STATES, checkpoint_id=checkpoint_id, full_key_groups=full,
        fresh_key_groups=[], file_id=f"{checkpoint_id:032x}",
        checksums=[(checkpoint_id * 7919 + kg) % U32 for kg in r],
        predecessors={kg: BlockLink(checkpoint_id - 1, kg) for kg in r if kg not in unlinked} if checkpoint_id else {})


def _checkpoint(checkpoint_id: int, handles: list[KeyedStateHandle]) -> bytes:
    return encode_metadata(CheckpointMetadata(checkpoint_id=checkpoint_id, job_id="j", timestamp_ms=0,
                                              max_parallelism=4096, parallelism=2, keyed_handles=handles),
                           f"chk-{checkpoint_id}")


def test_carried_handles_decode_once_and_are_the_same_objects_after():
    r = KeyGroupRange(0, 2047)
    base = _delta_handle(0, r, {}, full=[r])
    one = _delta_handle(1, r, {5: 90})
    two = _delta_handle(2, r, {7: 60})
    three = _delta_handle(3, r, {9: 70})
    at2 = decode_metadata(_checkpoint(2, [base, one, two]), "chk-2", "chk-2/_metadata")
    at3 = decode_metadata(_checkpoint(3, [base, one, two, three]), "chk-3", "chk-3/_metadata")
    # base and one are carried (stored alike) in both: the same objects; two is carried from 3 on (its quiet blocks'
    # checksums then left out), so a new object with what the carried form records
    assert at3.keyed_handles[0] is at2.keyed_handles[0] and at3.keyed_handles[1] is at2.keyed_handles[1]
    assert at3.keyed_handles[2] is not at2.keyed_handles[2]
    assert at3.keyed_handles[2].checksum(7) == two.checksum(7) and at3.keyed_handles[2].checksum(8) is None
    for decoded, written in zip(at3.keyed_handles, (base, one, two, three)):
        assert decoded.offsets == written.offsets and decoded.file_id == written.file_id
        assert decoded.changed_key_groups() == written.changed_key_groups()
    again = decode_metadata(_checkpoint(3, [base, one, two, three]), "chk-3", "chk-3/_metadata")
    assert all(a is b for a, b in zip(again.keyed_handles, at3.keyed_handles))


def test_a_handle_that_differs_in_any_field_is_decoded_anew_and_a_corrupt_one_is_still_refused():
    r = KeyGroupRange(0, 63)
    base = _delta_handle(0, r, {}, full=[r])
    one = _delta_handle(1, r, {5: 90})
    first = decode_metadata(_checkpoint(1, [base, one]), "chk-1", "chk-1/_metadata")
    other = _delta_handle(1, r, {5: 90})
    other.checksums = [c ^ 1 for c in other.checksums]   # a twin run's file: another checksum per block
    second = decode_metadata(_checkpoint(1, [base, other]), "chk-1", "chk-1/_metadata")
    assert second.keyed_handles[1] is not first.keyed_handles[1]
    assert second.keyed_handles[1].checksum(5) == one.checksum(5) ^ 1
    moved = decode_metadata(_checkpoint(1, [base, one]), "savepoints/x", "x/_metadata")   # same JSON, other base
    assert moved.keyed_handles[1] is first.keyed_handles[1]   # a shared file's path does not depend on the base
    data = bytearray(_checkpoint(1, [base, one]))
    text = data.replace(b'"subtask":0', b'"subtask":-1', 1)
    body = bytes(text[12:-4])
    import struct
    head = struct.pack("<4sII", md.METADATA_MAGIC, md.METADATA_VERSION, len(body)) + body
    with pytest.raises(CorruptSnapshotError, match="subtask"):
        decode_metadata(head + struct.pack("<I", crc32c(head)), "chk-1", "chk-1/_metadata")


def test_the_handle_cache_is_bounded_by_the_key_groups_it_holds(monkeypatch):
    monkeypatch.setattr(md, "HANDLE_CACHE_KEY_GROUPS", 3 * 65)
    r = KeyGroupRange(0, 63)
    base = _delta_handle(0, r, {}, full=[r])
    for i in range(1, 8):
        decode_metadata(_checkpoint(i, [base] + [_delta_handle(c, r, {c: 40}) for c in range(1, i + 1)]),
                        f"chk-{i}", "_metadata")
        assert md._HANDLES_KEY_GROUPS[0] <= 3 * 65
        assert md._HANDLES_KEY_GROUPS[0] == sum(len(h.key_group_range) + 1 for h in md._HANDLES.values())


@settings(max_examples=100, deadline=None)
@given(data=st.data(), start=st.integers(0, 100), n=st.integers(0, 90))
def test_changed_key_groups_are_the_full_blocks_and_the_non_empty_deltas(data, start, n):
    r = KeyGroupRange(start, start + n - 1) if n else KeyGroupRange.empty()
    kgs = list(r)
    changed = {kg: data.draw(st.integers(EMPTY_BLOCK_SIZE + 1, 200))
               for kg in data.draw(st.lists(st.sampled_from(kgs), unique=True) if kgs else st.just([]))}
    full = md.key_group_runs(data.draw(st.lists(st.sampled_from(kgs), unique=True)) if kgs else [])
    h = _delta_handle(3, r, changed, full=full)
    assert h.changed_key_groups() == ([kg for kg in kgs if h.is_full(kg)],
                                      [kg for kg in kgs if not h.is_full(kg) and h.changes(kg)])
    h.offsets = list(h.offsets)   # a changed field: worked out anew
    assert "_changed" not in h.__dict__


def test_block_links_from_the_writer_are_kept_as_arrays_by_the_handle():
    r = KeyGroupRange(10, 20)
    stream = io.BytesIO()
    writer = KeyedSnapshotWriter(stream, r, STATES, default_full=False, predecessors={12: BlockLink(4, 9)})
    writer.write_key_group(15, [(0, [b"a"], [b"b"])], full=False, predecessor=BlockLink(4, 11))
    offsets, size = writer.finish()
    links = writer.predecessors
    assert isinstance(links, BlockLinks) and dict(links) == {12: BlockLink(4, 9), 15: BlockLink(4, 11)}
    h = KeyedStateHandle(file="shared/f", subtask=0, key_group_range=r, offsets=offsets, size=size, states=STATES,
                         checkpoint_id=5, full_key_groups=writer.full_key_groups, file_id=writer.file_id,
                         checksums=writer.checksums, predecessors=links)
    assert h.predecessors is links
