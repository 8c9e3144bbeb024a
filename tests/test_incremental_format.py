"""Keyed formats 2 to 4: full and delta blocks, put and delete sections, keys sorted and found by binary search, a
delta's predecessor (format 4), the handle's checkpoint id, full key groups, file id, checksums and predecessors, and
the checkpoints of format 1 (metadata 2) that must still restore."""

from __future__ import annotations

import base64
import io
import json
import pathlib
import random
import shutil
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange, assign_to_key_group, key_group_range
from keygroups._native import snapshot as native
from keygroups.checkpoint import (
    BlockLink,
    CheckpointMetadata,
    CheckpointStorage,
    KeyedSnapshotWriter,
    KeyedStateHandle,
    find_key,
    open_snapshot,
    read_key_group_offsets,
    read_key_groups,
    write_keyed_snapshot,
)
from keygroups.checkpoint.metadata import decode_metadata, encode_metadata
from keygroups.errors import CorruptSnapshotError
from keygroups.serializers import Int64Serializer, StrSerializer, ValueSerializer
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    RocksDBKeyedStateBackend,
    ValueStateDescriptor,
)

STATES = [{"name": "v", "kind": "value"}, {"name": "l", "kind": "list"}]
V1_CHECKPOINT = pathlib.Path(__file__).parent / "data" / "keyed-checkpoint-v1"

key = st.binary(max_size=6)
payload = st.binary(max_size=20)


def plain_block(flags_puts_deletes) -> tuple[bool, list, list]:
    flags, puts, deletes = flags_puts_deletes
    return (bool(flags & native.BLOCK_FULL),
            [(i, [bytes(k) for k in ks], [bytes(v) for v in vs]) for i, ks, vs in puts],
            [(i, [bytes(k) for k in ks]) for i, ks in deletes])


def key_sorted(keys, values=None):
    order = sorted(range(len(keys)), key=lambda i: bytes(keys[i]))   # stable: equal keys keep their order
    return [keys[i] for i in order], None if values is None else [values[i] for i in order]


# ---- blocks ----------------------------------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.lists(st.tuples(key, payload), max_size=12)), max_size=3),
       st.lists(st.tuples(st.integers(0, 1), st.lists(key, max_size=8)), max_size=3), st.binary(max_size=6))
def test_delta_blocks_round_trip_sorted_and_searchable(puts, deletes, probe):
    sections = [(i, [k for k, _ in kv], [v for _, v in kv]) for i, kv in puts]
    block = native.encode_block(7, sections, 2, full=False, deletes=deletes)
    full, got_puts, got_deletes = plain_block(native.parse_block(block, 7, 2))
    assert not full
    assert got_puts == [(i, *key_sorted(ks, vs)) for i, ks, vs in sections]
    assert got_deletes == [(i, key_sorted(ks)[0]) for i, ks in deletes]
    _, offset_puts, offset_deletes = native.parse_block_offsets(block, 7, 2)
    for s_idx, ((i, ks, vs), (_, ko, _)) in enumerate(zip(sections, offset_puts)):
        for k in set(ks) | {probe}:
            found = find_key(block, ko, k)
            if k in ks:   # the last of equal keys: the one that counts
                assert block[ko[found]:ko[found + 1]] == k
                assert got_puts[s_idx][2][found] == [v for kk, v in zip(ks, vs) if kk == k][-1]
                assert found == len(ks) - 1 or block[ko[found + 1]:ko[found + 2]] != k
            else:
                assert found == -1
    for (i, ks), (_, ko) in zip(deletes, offset_deletes):
        for k in set(ks) | {probe}:
            assert (find_key(block, ko, k) >= 0) == (k in ks)


def test_full_blocks_have_no_deletes_and_empty_blocks_have_a_fixed_size():
    with pytest.raises(ValueError, match="full block .* has no deletes"):
        native.encode_block(1, [], 1, full=True, deletes=[(0, [b"k"])])
    with pytest.raises(TypeError, match="delete section is a"):
        native.encode_block(1, [], 1, full=False, deletes=[(0, [b"k"], [b"v"])])
    with pytest.raises(ValueError, match="state_index"):
        native.encode_block(1, [], 1, full=False, deletes=[(1, [b"k"])])
    assert len(native.encode_block(3, [], 2, full=False)) == len(native.encode_block(3, [], 2)) \
        == native.BLOCK_OVERHEAD == native.BLOCK_OVERHEADS[4] == 28
    linked_empty = native.encode_block(3, [], 2, full=False, predecessor=(1, 2))   # names the chain's end it keeps
    assert len(linked_empty) == native.BLOCK_OVERHEAD and struct.unpack_from("<IQI", linked_empty, 4) == (
        native.BLOCK_LINKED, 1, 2)
    with pytest.raises(ValueError, match="full block applies on no earlier block"):
        native.encode_block(3, [(0, [b"k"], [b"v"])], 2, predecessor=(1, 2))
    with pytest.raises(ValueError, match="predecessor must be"):
        native.encode_block(3, [(0, [b"k"], [b"v"])], 2, full=False, predecessor=(1, 2 ** 32))
    full, puts, deletes = plain_block(native.parse_block(native.encode_block(3, [], 2), 3, 2))
    assert full and puts == deletes == []


def test_find_key_never_reads_outside_the_block():
    block = native.encode_block(1, [(0, [b"b", b"a", b"c"], [b"1", b"2", b"3"])], 1)
    _, [(_, ko, _)], _ = native.parse_block_offsets(block, 1, 1)
    assert [find_key(block, ko, k) for k in (b"a", b"b", b"c", b"d", b"")] == [0, 1, 2, -1, -1]
    for bad, probe in (([0, 5, len(block) + 1, len(block) + 2], b"b"), ([-4, 1, 2, 3], b""), ([9, 8, 7, 6], b"b")):
        with pytest.raises(CorruptSnapshotError, match="outside"):
            find_key(block, np.array(bad, dtype=np.int64), probe)
    rng = random.Random(3)
    for _ in range(2000):   # whatever the offsets say: an index, -1, or CorruptSnapshotError; never a crash
        bad = np.array([rng.randint(-3, len(block) + 3) for _ in range(rng.randint(1, 6))], dtype=np.int64)
        try:
            assert -1 <= find_key(block, bad, rng.randbytes(rng.randint(0, 2))) < len(bad) - 1
        except CorruptSnapshotError:
            pass
    assert find_key(block, np.array([0], dtype=np.int64), b"x") == -1   # no keys
    with pytest.raises(ValueError, match="n \\+ 1"):
        find_key(block, np.array([], dtype=np.int64), b"x")


def test_structure_errors_name_what_is_wrong():
    good = native.encode_block(5, [(0, [b"a", b"b"], [b"1", b"2"])], 1, full=False, deletes=[(0, [b"c"])],
                               predecessor=(3, 0xABCDEF))
    body = bytearray(good[:-4])
    assert struct.unpack_from("<IQI", body, 4) == (native.BLOCK_LINKED, 3, 0xABCDEF)

    def parse(data):
        return native.parse_block(bytes(data) + b"\0\0\0\0", 5, 1, verify_checksum=False)

    flags = bytearray(body)
    flags[4:8] = struct.pack("<I", 6)
    with pytest.raises(CorruptSnapshotError, match="block flags 0x6"):
        parse(flags)
    linked_full = bytearray(body)
    linked_full[4:8] = struct.pack("<I", 3)
    with pytest.raises(CorruptSnapshotError, match="full block of key group 5 linked to a predecessor"):
        parse(linked_full)
    unlinked = bytearray(body)
    unlinked[4:8] = struct.pack("<I", 0)
    with pytest.raises(CorruptSnapshotError, match="predecessor fields set in an unlinked block of key group 5"):
        parse(unlinked)
    op = bytearray(body)
    op[28:32] = struct.pack("<I", 7)   # the first section's op
    with pytest.raises(CorruptSnapshotError, match="section op 7"):
        parse(op)
    unsorted = bytearray(body)
    keys_at = 24 + 12 + 8 + 8
    unsorted[keys_at:keys_at + 2] = b"ba"
    with pytest.raises(CorruptSnapshotError, match="key 1 of a section of state 0 sorting before key 0"):
        parse(unsorted)
    full_with_delete = bytearray(body)
    full_with_delete[4:20] = struct.pack("<IQI", 1, 0, 0)
    with pytest.raises(CorruptSnapshotError, match="delete section in the full block"):
        parse(full_with_delete)
    huge = struct.pack("<IIQIIIII", 5, 0, 0, 0, 1, 0, 1, 0x7FFFFFFF)   # a delete section of two billion keys
    with pytest.raises(CorruptSnapshotError, match="entry count 2147483647"):
        native.parse_block_offsets(huge + b"\0\0\0\0", 5, 1, verify_checksum=False)
    with pytest.raises(CorruptSnapshotError, match="section count 4294967295"):
        parse(struct.pack("<IIQII", 5, 0, 0, 0, 0xFFFFFFFF))
    with pytest.raises(CorruptSnapshotError, match="shorter than the 28-byte minimum"):
        native.parse_block(good[:24], 5, 1)
    with pytest.raises(CorruptSnapshotError, match="shorter than the 16-byte minimum"):
        native.parse_block(good[:12], 5, 1, version=3)
    assert plain_block(native.parse_block(good, 5, 1)) == (False, [(0, [b"a", b"b"], [b"1", b"2"])], [(0, [b"c"])])


def test_fuzz_delta_blocks_behind_the_checksum():
    rng = random.Random(11)
    blocks = []
    for kg in range(40):
        puts = [(i, [rng.randbytes(rng.randint(0, 5)) for _ in range(rng.randint(0, 5))]) for i in rng.sample(
            range(3), rng.randint(0, 3))]
        puts = [(i, ks, [rng.randbytes(rng.choice([0, 1, 9, 60])) for _ in ks]) for i, ks in puts]
        deletes = [(i, [rng.randbytes(rng.randint(0, 5)) for _ in range(rng.randint(0, 4))])
                   for i in rng.sample(range(3), rng.randint(0, 2))]
        full = rng.random() < 0.2
        predecessor = None if full or rng.random() < 0.3 else (rng.randrange(2 ** 40), rng.randrange(2 ** 32))
        blocks.append((kg, native.encode_block(kg, puts, 3, full=full, deletes=() if full else deletes,
                                               predecessor=predecessor)))
    outcomes = {"ok": 0, "corrupt": 0}
    for _ in range(4000):
        kg, block = rng.choice(blocks)
        bad = bytearray(block)
        how = rng.random()
        if how < 0.4:   # the flags, op and count fields live in the first words of a block and a section
            for _ in range(rng.randint(1, 3)):
                pos = rng.randrange(min(len(bad), 48)) if rng.random() < 0.6 else rng.randrange(len(bad))
                bad[pos] ^= rng.randint(1, 255)
        elif how < 0.6:
            bad = bad[:rng.randrange(len(bad))] + b"\0\0\0\0"
        elif how < 0.85:
            pos = rng.randrange(0, max(1, len(bad) - 8), 4)
            bad[pos:pos + 4] = struct.pack("<I", rng.choice([0xFFFFFFFF, 0x7FFFFFFF, 1, 2, 3, len(bad)]))
        else:
            pos = rng.randrange(len(bad))
            bad[pos:pos] = rng.randbytes(rng.randint(1, 16))
        bad = bytes(bad)
        try:
            flags, puts, deletes = native.parse_block(bad, kg, 3, verify_checksum=False)
        except CorruptSnapshotError:
            outcomes["corrupt"] += 1
            with pytest.raises(CorruptSnapshotError):
                native.parse_block_offsets(bad, kg, 3, verify_checksum=False)
            continue
        outcomes["ok"] += 1
        flags2, oputs, odeletes = native.parse_block_offsets(bad, kg, 3, verify_checksum=False)
        assert flags == flags2 and flags in (0, 1, 2) and not (flags & native.BLOCK_FULL and deletes)
        for (i, ks, vs), (i2, ko, vo) in zip(puts, oputs, strict=True):
            assert 0 <= i == i2 < 3 and [bytes(k) for k in ks] == [bad[a:b] for a, b in zip(ko[:-1], ko[1:])]
            assert [bytes(v) for v in vs] == [bad[a:b] for a, b in zip(vo[:-1], vo[1:])]
            assert [bytes(k) for k in ks] == sorted(bytes(k) for k in ks)   # what parses is sorted
            for k in ks[:3]:
                assert bytes(ks[find_key(bad, ko, k)]) == bytes(k)
        for (i, ks), (i2, ko) in zip(deletes, odeletes, strict=True):
            assert 0 <= i == i2 < 3 and [bytes(k) for k in ks] == [bad[a:b] for a, b in zip(ko[:-1], ko[1:])]
    assert outcomes["corrupt"] > 2000 and outcomes["ok"] > 50


# ---- writer and handle ----------------------------------------------------------------------------------------------

def test_writer_writes_deltas_and_untouched_groups_as_default_full_says(tmp_path):
    buf = io.BytesIO()
    w = KeyedSnapshotWriter(buf, KeyGroupRange(10, 15), STATES, default_full=False)
    w.write_key_group(11, [(0, [b"k2", b"k1"], [b"2", b"1"])], full=False, deletes=[(1, [b"gone"])])
    w.write_key_group(13, [(1, [b"x"], [b"y"])])   # full
    offsets, size = w.finish()
    assert w.full_key_groups == [KeyGroupRange(13, 13)]
    f = open_snapshot(buf.getvalue())
    assert f.version == 4 and f.file_id == w.file_id and f.checksums() == w.checksums
    blocks = {b.key_group: b for b in f.key_groups()}
    assert [kg for kg, b in blocks.items() if b.full] == [13] and all(b.sorted for b in blocks.values())
    assert [(i, [bytes(k) for k in ks]) for i, ks, _ in blocks[11].puts] == [(0, [b"k1", b"k2"])]
    assert [(i, [bytes(k) for k in ks]) for i, ks in blocks[11].deletes] == [(1, [b"gone"])]
    assert all(offsets[i + 1] - offsets[i] == native.BLOCK_OVERHEAD for i in (0, 2, 4, 5))

    storage = CheckpointStorage(tmp_path)
    h = write_keyed_snapshot(storage, 4, 1, KeyGroupRange(0, 7), STATES,
                             [(2, [(0, [b"a"], [b"1"])]), (3, [], [(0, [b"b"])]), (6, [(1, [b"c"], [b"2"])])],
                             full_key_groups={2, 5, 6, 7})
    assert h.checkpoint_id == 4 and h.format_version == 4 and h.predecessors == {}
    assert h.checksums == open_snapshot(storage.read_bytes(h.file)).checksums()
    assert h.full_key_groups == [KeyGroupRange(2, 2), KeyGroupRange(5, 7)]
    assert [h.is_full(kg) for kg in range(-1, 9)] == [False, False, False, True, False, False, True, True, True,
                                                        False]
    assert [h.changes(kg) for kg in range(8)] == [False, False, True, True, False, True, True, True]
    blocks, _ = read_key_group_offsets(storage, h, KeyGroupRange(0, 7))
    assert [(b.key_group, b.full, len(b.puts), len(b.deletes)) for b in blocks] == [
        (0, False, 0, 0), (1, False, 0, 0), (2, True, 1, 0), (3, False, 0, 1), (4, False, 0, 0), (5, True, 0, 0),
        (6, True, 1, 0), (7, True, 0, 0)]
    assert KeyedStateHandle.from_json(json.loads(json.dumps(h.to_json()))) == h
    everything = write_keyed_snapshot(storage, 5, 0, KeyGroupRange(0, 3), STATES, [])
    assert everything.is_all_full and everything.full_key_groups == [KeyGroupRange(0, 3)]


def test_handle_checks_its_new_fields():
    def handle(**kw):
        return KeyedStateHandle("chk-1/k", 0, KeyGroupRange(4, 7), [0, 16, 32, 48, 64], 80, [], **kw)

    assert handle(checkpoint_id=1).full_key_groups == [KeyGroupRange(4, 7)]
    with pytest.raises(ValueError, match="checkpoint_id must be an int >= 0"):
        handle(checkpoint_id=-1)
    with pytest.raises(ValueError, match="ascending, disjoint ranges inside"):
        handle(checkpoint_id=1, full_key_groups=[KeyGroupRange(3, 4)])
    with pytest.raises(ValueError, match="ascending, disjoint"):
        handle(checkpoint_id=1, full_key_groups=[KeyGroupRange(5, 6), KeyGroupRange(4, 4)])
    with pytest.raises(ValueError, match="format_version must be one of"):
        handle(checkpoint_id=1, format_version=5)
    with pytest.raises(ValueError, match="format 1 holds full blocks only"):
        handle(checkpoint_id=1, format_version=1, full_key_groups=[])
    with pytest.raises(CorruptSnapshotError, match="not a valid keyed state handle"):
        KeyedStateHandle.from_json({k: v for k, v in handle(checkpoint_id=1).to_json().items()
                                    if k != "checkpoint_id"})


def test_handle_checks_its_chain_fields():
    def handle(**kw):
        kw = {"checkpoint_id": 3, "full_key_groups": [KeyGroupRange(4, 4)], "file_id": "ab" * 16,
              "checksums": [1, 2, 3, 4], **kw}
        return KeyedStateHandle("chk-1/k", 0, KeyGroupRange(4, 7), [0, 28, 28 + 40, 28 + 80, 28 + 80 + 28], 200, [],
                                **kw)

    linked = handle(predecessors={5: BlockLink(2, 7), 6: BlockLink(0, 2 ** 32 - 1)})
    assert linked.predecessor(5) == (2, 7) and linked.predecessor(7) is None and linked.link(6) == (3, 3)
    assert KeyedStateHandle.from_json(json.loads(json.dumps(linked.to_json()))) == linked
    as_json = linked.to_json()   # u32s as base64: checkpoint distances (0: names none) and checksums
    assert base64.b64decode(as_json["predecessors"]["distances"]) == struct.pack("<4I", 0, 1, 3, 0)
    assert base64.b64decode(as_json["predecessors"]["checksums"]) == struct.pack("<4I", 0, 7, 2 ** 32 - 1, 0)
    assert base64.b64decode(as_json["checksums"]) == struct.pack("<4I", 1, 2, 3, 4)
    assert dict(linked.predecessors) == {5: (2, 7), 6: (0, 2 ** 32 - 1)} and len(linked.predecessors) == 2
    for bad, match in [({"file_id": "AB" * 16}, "file_id must be 32 lowercase hex digits"),
                       ({"file_id": "ab" * 15}, "file_id must be 32"),
                       ({"checksums": [1, 2, 3]}, "checksums must be a list of 4 ints"),
                       ({"checksums": [1, 2, 3, 2 ** 32]}, "checksums must be u32"),
                       ({"checksums": [1, 2, 3, True]}, "checksums must be u32"),
                       ({"predecessors": {4: BlockLink(2, 7)}}, "key group 4, which is not a delta block"),
                       ({"predecessors": {9: BlockLink(2, 7)}}, "key group 9, outside the handle's"),
                       ({"predecessors": {5: BlockLink(3, 7)}}, r"an older checkpoint \(id in \[0, 3\)\)"),
                       ({"predecessors": {5: ("2", 7)}}, "must be a BlockLink"),
                       ({"predecessors": {5: BlockLink(2, -1)}}, "must be a BlockLink"),
                       ({"predecessors": {5: BlockLink(2, 7)}, "fresh_key_groups": [KeyGroupRange(5, 5)]},
                        "key group 5, which is not a delta block"),
                       ({"format_version": 3, "file_id": None, "checksums": [1, 2, 3, 4]}, "format 4 and later")]:
        with pytest.raises(ValueError, match=match):
            handle(**bad)
    md = CheckpointMetadata(3, "j", 0, 8, 1, [handle(checksums=None)])
    with pytest.raises(ValueError, match="names no file id or block checksums"):
        md.validate()
    four = base64.b64encode(bytes(16)).decode()
    for bad, match in [({"predecessors": {"distances": base64.b64encode(bytes(12)).decode(), "checksums": four}},
                        "one link per key group of"),
                       ({"predecessors": {"distances": base64.b64encode(struct.pack("<4I", 0, 4, 0, 0)).decode(),
                                          "checksums": four}}, r"predecessors\[5\] names the block of checkpoint -1"),
                       ({"predecessors": {"distances": four, "checksums": "not base64!"}}, "not base64"),
                       ({"predecessors": [[5, 2, 7]]}, "must be an object of 'distances' and 'checksums'"),
                       ({"checksums": "AAAAAAA="}, "not a whole number of u32"),
                       ({"checksums": [1, 2, 3, 4]}, "base64 string of u32")]:
        with pytest.raises(CorruptSnapshotError, match=match):
            KeyedStateHandle.from_json(dict(as_json, **bad))


# ---- format 1 and metadata 2, as written before incremental checkpoints (tests/data/keyed-checkpoint-v1) -----------

@pytest.fixture
def v1_checkpoint(tmp_path):
    shutil.copytree(V1_CHECKPOINT, tmp_path / "chk")
    return CheckpointStorage(tmp_path / "chk")


def test_a_format_1_checkpoint_loads_as_full_handles(v1_checkpoint):
    raw = (V1_CHECKPOINT / "chk-1" / "_metadata").read_bytes()
    assert struct.unpack_from("<I", raw, 4) == (2,)   # metadata version 2, as written then
    md = v1_checkpoint.load(1)
    assert [(h.checkpoint_id, h.format_version, h.is_all_full) for h in md.keyed_handles] == [(1, 1, True)] * 2
    for h in md.keyed_handles:
        assert h.file.startswith("chk-1/keyed-")
        assert open_snapshot(v1_checkpoint.open_buffer(h.file)).version == 1
        blocks, _ = read_key_groups(v1_checkpoint, h, h.key_group_range)
        assert all(b.full and not b.sorted and not b.deletes for b in blocks)
    # written back as version 3, it reads the same
    assert decode_metadata(encode_metadata(md, "chk-1"), "chk-1", "again") == md


@pytest.mark.parametrize("backend", [HeapKeyedStateBackend, RocksDBKeyedStateBackend])
@pytest.mark.parametrize("p_new", [1, 3])
def test_a_format_1_checkpoint_restores_at_any_parallelism(v1_checkpoint, backend, p_new):
    expected = {int(k): v for k, v in json.loads((V1_CHECKPOINT / "expected.json").read_text()).items()}
    md = v1_checkpoint.load(1)
    descs = {"count": ValueStateDescriptor("count", Int64Serializer()),
             "events": ListStateDescriptor("events", StrSerializer()),
             "attrs": MapStateDescriptor("attrs", StrSerializer(), ValueSerializer())}
    got = {}
    for i in range(p_new):
        r = key_group_range(16, p_new, i)
        with backend(r, 16, Int64Serializer(), subtask_index=i) as b:
            b.restore(v1_checkpoint, md)
            s = {n: b.get_state(d) for n, d in descs.items()}
            for k in expected:
                if assign_to_key_group(k, 16) in r:
                    b.set_current_key(k)
                    got[k] = [s["count"].value(), list(s["events"].get()), dict(s["attrs"].items())]
            # restored from files outside shared/: the next snapshot is full, so no chain keeps them
            assert b._full_key_groups_for_snapshot() == set(r)
    assert got == expected
