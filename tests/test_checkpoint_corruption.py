"""Corruption: thousands of random byte flips and truncations of real snapshot and metadata files. Each read either
returns exactly what was written or raises CorruptSnapshotError — never another exception, a crash or a hang.

The compiled parser is also fuzzed *behind* the checksum (``verify_checksum=False``), so its structural checks
(counts against remaining bytes, lengths, key groups, state indexes, trailing bytes) are exercised directly."""

from __future__ import annotations

import dataclasses
import random
import struct
import uuid

import fsspec
import pytest
from crc32c import crc32c

from keygroups import KeyGroupRange, key_group_range
from keygroups._native import snapshot as native
from keygroups.checkpoint import (
    CheckpointMetadata,
    CheckpointStorage,
    DistributionMode,
    KeyedStateHandle,
    KeyGroupBlock,
    OperatorStateHandle,
    OperatorStateMeta,
    open_snapshot,
    read_key_group_offsets,
    read_key_groups,
    write_keyed_snapshot,
)
from keygroups.checkpoint.metadata import METADATA_MAGIC, METADATA_VERSION, decode_metadata, encode_metadata
from keygroups.errors import CorruptSnapshotError

STATES = [{"name": "v", "kind": "value"}, {"name": "l", "kind": "list"}, {"name": "m", "kind": "map"}]
KGR = KeyGroupRange(8, 23)
SEED = 20261121


def make_data(rng: random.Random) -> dict[int, list]:
    data = {}
    for kg in KGR:
        if rng.random() < 0.25:
            continue   # an empty block
        sections = []
        for idx in rng.sample(range(3), rng.randint(1, 3)):
            n = rng.randint(0, 6)
            keys = [rng.randbytes(rng.randint(0, 12)) for _ in range(n)]
            values = [rng.randbytes(rng.choice([0, 1, 8, 40, 300])) for _ in range(n)]
            sections.append((idx, keys, values))
        data[kg] = sections
    return data


def plain(blocks) -> dict[int, list]:
    """Put sections of blocks (KeyGroupBlock, or ``(key_group, parse_block(...))``) as bytes, for comparison."""
    out = {}
    for b in blocks:
        kg, secs = (b.key_group, b.puts) if isinstance(b, KeyGroupBlock) else (b[0], b[1][1])
        out[kg] = [(i, [bytes(k) for k in ks], [bytes(v) for v in vs]) for i, ks, vs in secs]
    return out


@pytest.fixture(scope="module")
def snapshot():
    """A real snapshot file in memory:// storage, its handle, and everything it holds."""
    location = f"memory://kg-corrupt-{uuid.uuid4().hex}"
    storage = CheckpointStorage(location)
    data = make_data(random.Random(SEED))
    handle = write_keyed_snapshot(storage, 1, 0, KGR, STATES, sorted(data.items()))
    raw = storage.read_bytes(handle.file)
    expected = plain(open_snapshot(raw).key_groups())
    assert sum(len(v) for secs in expected.values() for _, ks, _ in secs for v in ks) > 50
    yield storage, handle, raw, expected
    fs, root = fsspec.core.url_to_fs(location)
    fs.rm(root, recursive=True)


def read_whole(buf: bytes) -> dict[int, list]:
    f = open_snapshot(buf)
    assert f.key_group_range == KGR and f.states == STATES
    return plain(f.key_groups())


def read_ranged(storage, handle: KeyedStateHandle, wanted: KeyGroupRange) -> dict[int, list]:
    blocks, _ = read_key_groups(storage, handle, wanted)
    return plain(blocks)


def subset(expected: dict, wanted: KeyGroupRange) -> dict:
    return {kg: v for kg, v in expected.items() if kg in wanted}


def random_range(rng: random.Random) -> KeyGroupRange:
    a = rng.randint(KGR.start, KGR.end)
    return KeyGroupRange(a, rng.randint(a, KGR.end))


def test_random_byte_flips_of_a_real_file(snapshot):
    storage, handle, raw, expected = snapshot
    rng = random.Random(SEED + 1)
    outcomes = {"ok": 0, "corrupt": 0}
    for trial in range(2500):
        bad = bytearray(raw)
        for _ in range(rng.choice([1, 1, 1, 2, 5])):
            bad[rng.randrange(len(bad))] ^= rng.randint(1, 255)
        bad = bytes(bad)
        # the standalone reader: header, index and every block
        try:
            got = read_whole(bad)
        except CorruptSnapshotError:
            outcomes["corrupt"] += 1
        else:
            assert got == expected, f"trial {trial}: a flipped file read back different data"
            outcomes["ok"] += 1
        # the ranged reader of a restoring subtask, through storage, with the (intact) handle
        rel = f"chk-1/flipped-{trial % 7}"
        with storage.open_write(rel) as f:
            f.write(bad)
        wanted = random_range(rng)
        h = dataclasses.replace(handle, file=rel)   # its file id and checksums: the bytes are checked against them
        try:
            got = read_ranged(storage, h, wanted)
        except CorruptSnapshotError:
            outcomes["corrupt"] += 1
            with pytest.raises(CorruptSnapshotError):
                for _ in read_key_group_offsets(storage, h, wanted)[0]:
                    pass
        else:
            assert got == subset(expected, wanted), f"trial {trial}: ranged read returned different data"
            outcomes["ok"] += 1
    assert outcomes["corrupt"] > 1000 and outcomes["ok"] > 100   # both kinds happen (flips outside a read range)


def test_random_truncations_of_a_real_file(snapshot):
    storage, handle, raw, expected = snapshot
    rng = random.Random(SEED + 2)
    cuts = sorted({rng.randrange(len(raw)) for _ in range(1200)} | {0, 1, 4, 19, 20, len(raw) - 1, len(raw) - 12})
    for cut in cuts:
        short = raw[:cut]
        with pytest.raises(CorruptSnapshotError):
            read_whole(short)
        rel = "chk-1/truncated"
        with storage.open_write(rel) as f:
            f.write(short)
        wanted = random_range(rng)
        h = dataclasses.replace(handle, file=rel)
        a, b = h.byte_range(wanted)
        if cut >= b:
            assert read_ranged(storage, h, wanted) == subset(expected, wanted)
        else:
            with pytest.raises(CorruptSnapshotError, match="truncated"):
                read_ranged(storage, h, wanted)


def test_missing_file_is_corrupt_not_oserror(snapshot):
    storage, handle, _, _ = snapshot
    h = KeyedStateHandle("chk-1/never-written", 3, KGR, handle.offsets, handle.size, STATES, checkpoint_id=1)
    with pytest.raises(CorruptSnapshotError, match="missing"):
        read_key_groups(storage, h, KGR)


def test_fuzz_the_block_parser_behind_the_checksum(snapshot):
    _, handle, raw, _ = snapshot
    rng = random.Random(SEED + 3)
    blocks = [(kg, raw[handle.offsets[i]:handle.offsets[i + 1]]) for i, kg in enumerate(KGR)]
    blocks = [(kg, b) for kg, b in blocks if len(b) > native.BLOCK_OVERHEAD]
    outcomes = {"ok": 0, "corrupt": 0}
    for _ in range(4000):
        kg, block = rng.choice(blocks)
        bad = bytearray(block)
        how = rng.random()
        if how < 0.5:   # flip bytes, especially the length and count fields near the front
            for _ in range(rng.randint(1, 3)):
                pos = rng.randrange(min(len(bad), 40)) if rng.random() < 0.5 else rng.randrange(len(bad))
                bad[pos] ^= rng.randint(1, 255)
        elif how < 0.7:   # truncate, keeping a (fake) checksum slot
            bad = bad[:rng.randrange(len(bad))] + b"\0\0\0\0"
        elif how < 0.85:   # a huge count or length at a random field
            pos = rng.randrange(0, max(1, len(bad) - 8), 4)
            bad[pos:pos + 4] = struct.pack("<I", rng.choice([0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, len(bad)]))
        else:   # garbage appended or inserted
            pos = rng.randrange(len(bad))
            bad[pos:pos] = rng.randbytes(rng.randint(1, 16))
        bad = bytes(bad)
        try:
            flags, sections, deletes = native.parse_block(bad, kg, 3, verify_checksum=False)
        except CorruptSnapshotError:
            outcomes["corrupt"] += 1
            with pytest.raises(CorruptSnapshotError):   # the offsets parser agrees
                native.parse_block_offsets(bad, kg, 3, verify_checksum=False)
        else:
            outcomes["ok"] += 1
            flags2, arrays, delete_arrays = native.parse_block_offsets(bad, kg, 3, verify_checksum=False)
            assert len(arrays) == len(sections) and flags == flags2 and len(deletes) == len(delete_arrays)
            for (idx, ks), (idx2, ko) in zip(deletes, delete_arrays):
                assert 0 <= idx == idx2 < 3 and len(ks) == len(ko) - 1
                assert [bytes(k) for k in ks] == [bad[a:b] for a, b in zip(ko[:-1], ko[1:])]
            for (idx, ks, vs), (idx2, ko, vo) in zip(sections, arrays):
                # what parses is well-formed, lies inside the block, and both parsers see the same entries
                assert 0 <= idx == idx2 < 3 and len(ks) == len(vs) == len(ko) - 1 == len(vo) - 1
                assert sum(len(k) + len(v) for k, v in zip(ks, vs)) <= len(bad)
                assert [bytes(k) for k in ks] == [bad[a:b] for a, b in zip(ko[:-1], ko[1:])]
                assert [bytes(v) for v in vs] == [bad[a:b] for a, b in zip(vo[:-1], vo[1:])]
    assert outcomes["corrupt"] > 2000


def test_huge_counts_are_refused_before_allocating():
    # format 1 blocks (still read): u32 key group | u32 section count | sections (no flags, no ops)
    body = struct.pack("<II", 5, 0xFFFFFFFF)   # key group 5, four billion sections in 8 bytes
    with pytest.raises(CorruptSnapshotError, match="section count 4294967295"):
        native.parse_block(body + b"\0\0\0\0", 5, 1, verify_checksum=False, version=1)
    body = struct.pack("<IIII", 5, 1, 0, 0x7FFFFFFF)   # one section of two billion entries
    with pytest.raises(CorruptSnapshotError, match="entry count 2147483647"):
        native.parse_block(body + b"\0\0\0\0", 5, 1, verify_checksum=False, version=1)
    body = struct.pack("<IIIIII", 5, 1, 0, 1, 0xFFFFFFF0, 0) + b"abcdefgh"   # a key longer than the block
    with pytest.raises(CorruptSnapshotError, match="1 keys of more than the 8 bytes left"):
        native.parse_block(body + struct.pack("<I", 0), 5, 1, verify_checksum=False, version=1)
    # many lengths whose sum would overflow 32 bits, and a value region past the end
    body = struct.pack("<IIII", 5, 1, 0, 4) + struct.pack("<4I", *[0xFFFFFFFF] * 4) + struct.pack("<4I", 0, 0, 0, 0)
    with pytest.raises(CorruptSnapshotError, match="4 keys of more than"):
        native.parse_block_offsets(body + b"\0" * 16 + b"\0\0\0\0", 5, 1, verify_checksum=False, version=1)
    body = struct.pack("<IIII", 5, 1, 0, 2) + struct.pack("<2I", 1, 1) + struct.pack("<2I", 3, 0xFFFFFFFF) + b"ab"
    with pytest.raises(CorruptSnapshotError, match="2 values of more than the 0 bytes left"):
        native.parse_block(body + b"\0\0\0\0", 5, 1, verify_checksum=False, version=1)


def test_structural_errors_name_what_is_wrong():
    good = native.encode_block(5, [(1, [b"k"], [b"v"])], 2)
    assert plain([(5, native.parse_block(good, 5, 2))]) == {5: [(1, [b"k"], [b"v"])]}
    with pytest.raises(CorruptSnapshotError, match="CRC32C"):
        native.parse_block(good[:-1] + bytes([good[-1] ^ 1]), 5, 2)
    with pytest.raises(CorruptSnapshotError, match="key group 5 where key group 6 belongs"):
        native.parse_block(good, 6, 2)
    with pytest.raises(CorruptSnapshotError, match="state index 1"):
        native.parse_block(good, 5, 1)
    with pytest.raises(CorruptSnapshotError, match="trailing"):
        native.parse_block(good[:-4] + b"xx" + good[-4:], 5, 2, verify_checksum=False)
    with pytest.raises(CorruptSnapshotError, match="shorter than"):
        native.parse_block(b"", 5, 2)


def test_unknown_version_and_wrong_magic(snapshot):
    _, _, raw, _ = snapshot
    with pytest.raises(CorruptSnapshotError, match="format version 5"):
        open_snapshot(raw[:4] + struct.pack("<I", 5) + raw[8:])
    with pytest.raises(CorruptSnapshotError, match="magic"):
        open_snapshot(b"PK\x03\x04" + raw[4:])
    with pytest.raises(CorruptSnapshotError, match="empty"):
        open_snapshot(b"")


def test_random_flips_and_truncations_of_metadata():
    rng = random.Random(SEED + 4)
    handles = []
    for i in range(3):
        r = key_group_range(128, 3, i)
        handles.append(KeyedStateHandle(f"chk-9/keyed-{i}-abc", i, r, list(range(100, 100 + len(r) + 1)),
                                        100 + len(r) + 10, STATES, checkpoint_id=9, file_id=f"{i:032x}",
                                        checksums=[rng.randrange(2 ** 32) for _ in r]))
    union = OperatorStateMeta(DistributionMode.UNION, {"serializer": {"identifier": "str"}}, [8, 20], 30,
                              [(0, 12345)])
    operator = OperatorStateHandle("chk-9/op-0", 0, 30, "operator", {"u": union})
    md = CheckpointMetadata(9, "job", 123, 128, 3, handles, [operator], {"x": [1, 2]})
    raw = encode_metadata(md, "chk-9")
    assert decode_metadata(raw, "chk-9", "test") == md
    for _ in range(1500):
        bad = bytearray(raw)
        if rng.random() < 0.8:
            bad[rng.randrange(len(bad))] ^= rng.randint(1, 255)
        else:
            bad = bad[:rng.randrange(len(bad))]
        try:
            got = decode_metadata(bytes(bad), "chk-9", "test")
        except CorruptSnapshotError:
            continue
        assert got == md


def test_a_handle_claiming_a_huge_size_is_corrupt_not_a_memory_error(snapshot, tmp_path):
    """A handle that passes its own checks but claims 2**62 bytes: the local read asks for what the file holds, and
    the short read is a CorruptSnapshotError naming the file, never an attempt to allocate 2**62 bytes."""
    _, handle, raw, _ = snapshot
    storage = CheckpointStorage(str(tmp_path))
    rel = storage.new_shared_file(1, "keyed-0")
    with storage.open_write(rel) as f:
        f.write(raw)
    huge = 2 ** 62
    offsets = list(handle.offsets[:-1]) + [huge]
    h = KeyedStateHandle(rel, 0, KGR, offsets, huge, STATES, checkpoint_id=1)
    with pytest.raises(CorruptSnapshotError, match=rf"{rel}.* is truncated"):
        read_key_groups(storage, h, KeyGroupRange(KGR.end, KGR.end))
    assert storage.read_bytes(rel, len(raw) - 4, huge) == raw[-4:]   # past the end: what the file holds


@pytest.mark.parametrize("body, what", [
    (b"[" * 100_000 + b"]" * 100_000, "deep nesting"),
    (b'{"checkpoint_id": 1}', "missing fields"),
    (b'{"checkpoint_id": "one", "job_id": 3, "timestamp_ms": [], "max_parallelism": {}, "parallelism": null, '
     b'"keyed_handles": 7, "operator_handles": "x", "properties": 1, "outputs": 2, "inputs": 3}', "mistyped fields"),
])
def test_metadata_that_passes_its_checksum_but_is_malformed_is_corrupt(body, what):
    head = METADATA_MAGIC + struct.pack("<II", METADATA_VERSION, len(body)) + body
    with pytest.raises(CorruptSnapshotError, match="chk-1/_metadata passes its checksum but is not valid"):
        decode_metadata(head + struct.pack("<I", crc32c(head)), "chk-1", "chk-1/_metadata")
