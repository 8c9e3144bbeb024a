"""The keyed snapshot file format: round trips, ranged reads, read-only buffers, writer checks, the compiled stub."""

from __future__ import annotations

import ast
import inspect
import io
import mmap
import pathlib
import uuid

import fsspec
import numpy as np
import pytest
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange
from keygroups._native import snapshot as native
from keygroups.checkpoint import (
    CheckpointStorage,
    KeyedSnapshotWriter,
    KeyedStateHandle,
    KeyGroupBlock,
    Packed,
    open_snapshot,
    read_key_group_offsets,
    read_key_groups,
    write_keyed_snapshot,
)
from keygroups.errors import CorruptSnapshotError

STATES = [{"name": "v", "kind": "value"}, {"name": "l", "kind": "list"}, {"name": "m", "kind": "map"}]


def as_plain(blocks) -> dict[int, list]:
    """The put sections of blocks (KeyGroupBlock, or ``(key_group, parse_block(...))``) with memoryviews turned into
    bytes, for comparison."""
    out = {}
    for b in blocks:
        kg, puts = (b.key_group, b.puts) if isinstance(b, KeyGroupBlock) else (b[0], b[1][1])
        out[kg] = [(i, [bytes(k) for k in ks], [bytes(v) for v in vs]) for i, ks, vs in puts]
    return out


def key_sorted(keys, values) -> tuple[list, list]:
    """A section's entries as the encoder writes them: stably sorted by key bytes."""
    pairs = sorted(zip(keys, values), key=lambda kv: bytes(kv[0]))
    return [k for k, _ in pairs], [v for _, v in pairs]


def write_to_bytes(kgr: KeyGroupRange, states: list[dict], data: dict[int, list]) -> tuple[bytes, list[int], int]:
    buf = io.BytesIO()
    w = KeyedSnapshotWriter(buf, kgr, states)
    for kg in sorted(data):
        w.write_key_group(kg, data[kg])
    offsets, size = w.finish()
    return buf.getvalue(), offsets, size


@pytest.fixture
def mem_storage():
    location = f"memory://kg-format-{uuid.uuid4().hex}"
    yield CheckpointStorage(location)
    fs, root = fsspec.core.url_to_fs(location)
    if fs.exists(root):
        fs.rm(root, recursive=True)


# -- round trips ---------------------------------------------------------------------------------------------------

payload = st.binary(max_size=24) | st.binary(min_size=200, max_size=600)


@st.composite
def snapshots(draw):
    start = draw(st.integers(0, 40))
    kgr = KeyGroupRange(start, start + draw(st.integers(0, 24)) - 1)   # possibly empty
    n_states = draw(st.integers(1, 3))
    states = STATES[:n_states]
    groups = draw(st.lists(st.sampled_from(list(kgr)), unique=True, max_size=len(kgr))) if kgr else []
    data = {}
    for kg in groups:
        sections = []
        for idx in draw(st.lists(st.integers(0, n_states - 1), max_size=3)):
            n = draw(st.integers(0, 4))
            sections.append((idx, draw(st.lists(payload, min_size=n, max_size=n)),
                             draw(st.lists(payload, min_size=n, max_size=n))))
        data[kg] = sections
    return kgr, states, data


def expected_blocks(kgr: KeyGroupRange, data: dict[int, list], wanted: KeyGroupRange) -> dict[int, list]:
    part = kgr.intersection(wanted)
    return {kg: [(i, *key_sorted(ks, vs)) for i, ks, vs in data.get(kg, [])] for kg in part}


@settings(max_examples=120, deadline=None)
@given(snapshots())
def test_round_trip_whole_file(snap):
    kgr, states, data = snap
    raw, offsets, size = write_to_bytes(kgr, states, data)
    assert size == len(raw) and len(offsets) == len(kgr) + 1
    f = open_snapshot(raw)
    assert f.key_group_range == kgr and f.states == states and f.offsets == offsets
    assert f.version == native.FORMAT_VERSION
    assert as_plain(f.key_groups()) == expected_blocks(kgr, data, kgr)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(snapshots(), st.integers(0, 70), st.integers(0, 30))
def test_round_trip_ranged(mem_storage, snap, q_start, q_len):
    kgr, states, data = snap
    h = write_keyed_snapshot(mem_storage, 1, 0, kgr, states, sorted(data.items()))
    wanted = KeyGroupRange(q_start, q_start + q_len - 1)
    blocks, nread = read_key_groups(mem_storage, h, wanted)
    got = as_plain(blocks)
    assert got == expected_blocks(kgr, data, wanted)
    copies, nread_copy = read_key_groups(mem_storage, h, wanted, copy=True)
    copies = list(copies)
    assert all(type(x) is bytes for b in copies for _, ks, vs in b.puts for x in ks + vs)
    assert as_plain(copies) == got and nread_copy == nread
    arrays, nread_arrays = read_key_group_offsets(mem_storage, h, wanted)
    from_arrays = {b.key_group: [(i, [bytes(b.block[x:y]) for x, y in zip(ko[:-1], ko[1:])],
                                  [bytes(b.block[x:y]) for x, y in zip(vo[:-1], vo[1:])]) for i, ko, vo in b.puts]
                   for b in arrays}
    assert from_arrays == got and nread_arrays == nread
    part = kgr.intersection(wanted)
    if part:
        a, b = h.byte_range(part)
        assert nread == b - a
    else:
        assert nread == 0


def test_values_are_lazy_slices_of_the_read_buffer():
    kgr = KeyGroupRange(0, 3)
    raw, offsets, _ = write_to_bytes(kgr, STATES, {2: [(2, [b"k" * 5], [b"value-bytes"])]})
    f = open_snapshot(raw)
    (kg, [(idx, keys, values)]), = [(b.key_group, b.puts) for b in f.key_groups() if b.puts]
    assert (kg, idx) == (2, 2)
    assert isinstance(keys[0], memoryview) and isinstance(values[0], memoryview)
    assert keys[0].obj is raw and values[0].obj is raw   # no copy: a view into the file's bytes
    assert keys[0].readonly and bytes(values[0]) == b"value-bytes"


def test_parser_leaves_the_garbage_collector_as_it_found_it():
    import gc

    good = native.encode_block(1, [(0, [b"k"] * 1000, [b"v"] * 1000)], 1)
    assert gc.isenabled()
    native.parse_block(good, 1, 1)
    assert gc.isenabled()
    with pytest.raises(CorruptSnapshotError, match="state index 0"):   # raised while the collector is paused
        native.parse_block(good, 1, 0)
    assert gc.isenabled()
    gc.disable()
    try:
        native.parse_block(good, 1, 1)
        assert not gc.isenabled()
    finally:
        gc.enable()


def packed(items: list[bytes], lead: bytes = b"") -> Packed:
    offsets = np.cumsum([len(lead)] + [len(x) for x in items], dtype=np.int64)
    return Packed(lead + b"".join(items) + b"tail", offsets)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(payload, payload), max_size=12), st.binary(max_size=5))
def test_packed_input_writes_the_same_bytes_as_lists(entries, lead):
    keys = [k for k, _ in entries]
    values = [v for _, v in entries]
    as_lists = native.encode_block(9, [(1, keys, values)], 2)
    assert native.encode_block(9, [(1, packed(keys, lead), packed(values))], 2) == as_lists
    assert native.encode_block(9, [(1, keys, packed(values, lead))], 2) == as_lists


def test_packed_validates_its_offsets():
    assert len(Packed(b"abc", [0, 1, 3])) == 2
    assert len(Packed(memoryview(b"abc").toreadonly(), np.array([3], dtype=np.int32))) == 0
    with pytest.raises(ValueError, match="item 0 spans offsets \\[2, 1\\)"):
        Packed(b"abc", [2, 1, 3])
    with pytest.raises(ValueError, match="offsets\\[2\\] = 4 is outside the 3 bytes"):
        Packed(b"abc", [0, 1, 4])
    with pytest.raises(ValueError, match="outside"):
        Packed(b"abc", [-1, 1])
    for bad in [[0.0, 1.0], [[0, 1]], [], np.array([0, 1], dtype=np.uint64)]:
        with pytest.raises(TypeError, match="offsets must be a 1-D int array"):
            Packed(b"abc", bad)
    with pytest.raises(ValueError, match="1 keys but 2 values"):
        native.encode_block(0, [(0, Packed(b"ab", [0, 2]), [b"x", b"y"])], 1)


def test_offset_arrays_feed_a_bulk_decoder():
    keys = [b"", b"a", b"ccc"]   # in key order: the encoder sorts
    values = [b"1" * 5, b"22", b""]
    block = native.encode_block(4, [(1, keys, values), (0, [], [])], 2)
    _, ((idx, ko, vo), (idx0, ko0, vo0)), _ = native.parse_block_offsets(block, 4, 2)
    assert (idx, idx0) == (1, 0) and ko.dtype == vo.dtype == np.int64
    assert ko.tolist() == [ko[0], ko[0], ko[0] + 1, ko[0] + 4] and vo[0] == ko[-1]   # keys, then values
    assert [block[a:b] for a, b in zip(vo[:-1], vo[1:])] == values
    assert len(ko0) == len(vo0) == 1


def test_empty_range_and_untouched_groups_get_blocks():
    raw, offsets, size = write_to_bytes(KeyGroupRange.empty(), STATES, {})
    f = open_snapshot(raw)
    assert not f.key_group_range and len(offsets) == 1 and list(f.key_groups()) == []
    raw, offsets, size = write_to_bytes(KeyGroupRange(5, 9), STATES, {7: [(0, [b"a"], [b"b"])]})
    assert len(offsets) == 6 and all(b - a >= native.BLOCK_OVERHEAD for a, b in zip(offsets, offsets[1:]))
    assert as_plain(open_snapshot(raw).key_groups()) == {5: [], 6: [], 7: [(0, [b"a"], [b"b"])], 8: [], 9: []}


def test_offsets_are_absolute_in_the_stream():
    buf = io.BytesIO()
    buf.write(b"x" * 100)
    w = KeyedSnapshotWriter(buf, KeyGroupRange(0, 1), STATES)
    w.write_key_group(1, [(0, [b"k"], [b"v"])])
    offsets, size = w.finish()
    assert size == len(buf.getvalue()) and offsets[0] > 100
    tail = buf.getvalue()[offsets[1]:offsets[2]]
    seed = crc32c(bytes.fromhex(w.file_id))   # a block's checksum covers its file's id
    assert as_plain([(1, native.parse_block(tail, 1, 3, file_seed=seed))]) == {1: [(0, [b"k"], [b"v"])]}
    with pytest.raises(CorruptSnapshotError, match="fails its CRC32C checksum.*written for another file"):
        native.parse_block(tail, 1, 3)


def test_bytes_like_keys_and_values_are_accepted():
    raw, _, _ = write_to_bytes(KeyGroupRange(0, 0), STATES,
                               {0: [(1, [bytearray(b"ab"), memoryview(b"cd")], [b"1", memoryview(b"x2")[1:]])]})
    assert as_plain(open_snapshot(raw).key_groups()) == {0: [(1, [b"ab", b"cd"], [b"1", b"2"])]}


# -- ranged reads read only what they need ----------------------------------------------------------------------

class RecordingStorage(CheckpointStorage):
    """The real storage, recording the byte ranges asked of it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads: list[tuple[str, int | None, int | None]] = []

    def read_bytes(self, relpath, start=None, end=None, *, verify=None):
        self.reads.append((relpath, start, end))
        return super().read_bytes(relpath, start, end, verify=verify)


def _big_snapshot(storage, kgr=KeyGroupRange(0, 127)) -> KeyedStateHandle:
    data = {kg: [(0, [b"key%d" % kg], [bytes([kg % 256]) * (50 + kg)]), (2, [b"a", b"b"], [b"1", b"2"])]
            for kg in kgr if kg % 3}
    return write_keyed_snapshot(storage, 1, 0, kgr, STATES, sorted(data.items())), data


def test_one_ranged_read_of_exactly_the_requested_groups(tmp_path):
    storage = RecordingStorage(tmp_path)
    h, data = _big_snapshot(storage)
    wanted = KeyGroupRange(40, 71)
    blocks, nread = read_key_groups(storage, h, wanted)
    got = as_plain(blocks)
    assert storage.reads == [(h.file, h.offsets[40], h.offsets[72])]
    assert nread == h.offsets[72] - h.offsets[40] < h.size * 33 // 100
    assert got == expected_blocks(h.key_group_range, data, wanted)


def test_bytes_outside_the_requested_groups_are_never_looked_at(tmp_path):
    storage = CheckpointStorage(tmp_path)
    h, data = _big_snapshot(storage)
    wanted = KeyGroupRange(10, 20)
    a, b = h.byte_range(wanted)
    path = pathlib.Path(tmp_path) / h.file
    raw = bytearray(path.read_bytes())
    for i in list(range(0, a)) + list(range(b, len(raw))):
        raw[i] ^= 0xA5   # header, other blocks, index, footer: all garbage now
    path.write_bytes(bytes(raw))
    blocks, nread = read_key_groups(storage, h, wanted)
    assert as_plain(blocks) == expected_blocks(h.key_group_range, data, wanted) and nread == b - a
    with pytest.raises(CorruptSnapshotError):
        open_snapshot(storage.open_buffer(h.file))


def test_disjoint_request_reads_nothing(mem_storage):
    h, _ = _big_snapshot(mem_storage, KeyGroupRange(0, 9))
    blocks, nread = read_key_groups(mem_storage, h, KeyGroupRange(10, 20))
    assert list(blocks) == [] and nread == 0


# -- buffers: read-only, mmap, writable ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["bytes", "bytearray", "readonly-memoryview", "mmap", "numpy-readonly"])
def test_parsers_accept_read_only_and_writable_buffers(kind, tmp_path):
    import numpy as np

    kgr = KeyGroupRange(3, 6)
    data = {4: [(1, [b"k1", b""], [b"v1", b"\x00" * 300])], 6: [(0, [b"z"], [b"y"])]}
    raw, offsets, _ = write_to_bytes(kgr, STATES, data)
    if kind == "bytes":
        buf = raw
    elif kind == "bytearray":
        buf = bytearray(raw)
    elif kind == "readonly-memoryview":
        buf = memoryview(bytearray(raw)).toreadonly()
    elif kind == "numpy-readonly":
        buf = np.frombuffer(raw, dtype=np.uint8)
        assert not buf.flags.writeable
    else:
        p = tmp_path / "snap"
        p.write_bytes(raw)
        fh = open(p, "rb")
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        fh.close()
    f = open_snapshot(buf)
    assert as_plain(f.key_groups()) == expected_blocks(kgr, data, kgr)
    assert as_plain(f.key_groups(KeyGroupRange(6, 100))) == {6: [(0, [b"z"], [b"y"])]}
    seed = crc32c(bytes.fromhex(f.file_id))
    assert as_plain([(4, native.parse_block(memoryview(buf)[offsets[1]:offsets[2]], 4, 3, file_seed=seed))]) == {
        4: [(1, *key_sorted(*data[4][0][1:]))]}


def test_local_storage_buffers_are_mmaps(tmp_path):
    storage = CheckpointStorage(tmp_path)
    h, data = _big_snapshot(storage, KeyGroupRange(0, 5))
    buf = storage.open_buffer(h.file)
    assert isinstance(buf, mmap.mmap)
    f = open_snapshot(buf)
    assert as_plain(f.key_groups()) == expected_blocks(h.key_group_range, data, h.key_group_range)
    assert f.offsets == h.offsets


# -- writer errors ---------------------------------------------------------------------------------------------

def test_writer_refuses_bad_input():
    w = KeyedSnapshotWriter(io.BytesIO(), KeyGroupRange(10, 19), STATES)
    with pytest.raises(ValueError, match=r"key group 9 is outside this snapshot's KeyGroupRange\(10, 19\)"):
        w.write_key_group(9, [])
    with pytest.raises(ValueError, match="outside"):
        w.write_key_group(20, [])
    with pytest.raises(ValueError, match=r"state_index must be an int in \[0, 3\)"):
        w.write_key_group(10, [(3, [b"k"], [b"v"])])
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        w.write_key_group(10, [(0, [b"k", b"j"], [b"v"])])
    with pytest.raises(TypeError, match="key 0 must be bytes"):
        w.write_key_group(10, [(0, ["text"], [b"v"])])
    with pytest.raises(TypeError, match="value 1 must be bytes"):
        w.write_key_group(10, [(0, [b"a", b"b"], [b"v", 7])])
    with pytest.raises(TypeError, match="section is a"):
        w.write_key_group(10, [(0, [b"a"])])
    w.write_key_group(12, [(0, [b"a"], [b"b"])])
    with pytest.raises(ValueError, match="ascending"):
        w.write_key_group(12, [])
    with pytest.raises(ValueError, match="ascending"):
        w.write_key_group(11, [])
    w.finish()
    with pytest.raises(ValueError, match="after finish"):
        w.write_key_group(15, [])
    with pytest.raises(TypeError, match="plain JSON"):
        KeyedSnapshotWriter(io.BytesIO(), KeyGroupRange(0, 1), [{"ttl": float("nan")}])
    with pytest.raises(TypeError, match="KeyGroupRange"):
        KeyedSnapshotWriter(io.BytesIO(), (0, 1), STATES)


def test_failed_write_key_group_writes_nothing():
    buf = io.BytesIO()
    w = KeyedSnapshotWriter(buf, KeyGroupRange(0, 3), STATES)
    before = buf.tell()
    with pytest.raises(TypeError):
        w.write_key_group(1, [(0, [b"ok"], [None])])
    assert buf.tell() == before
    w.write_key_group(1, [(0, [b"ok"], [b"fine"])])
    offsets, size = w.finish()
    assert as_plain(open_snapshot(buf.getvalue()).key_groups(KeyGroupRange(1, 1))) == {1: [(0, [b"ok"], [b"fine"])]}


def test_handle_validates_offsets():
    with pytest.raises(ValueError, match="offsets must be a list of 3 ints"):
        KeyedStateHandle("chk-1/k", 0, KeyGroupRange(0, 1), [0, 1], 10, [], checkpoint_id=1)
    with pytest.raises(ValueError, match=r"offsets\[1\] = 5 must be an int in \[7, size=10\]"):
        KeyedStateHandle("chk-1/k", 0, KeyGroupRange(0, 1), [7, 5, 9], 10, [], checkpoint_id=1)
    with pytest.raises(ValueError, match=r"offsets\[2\] = 11"):
        KeyedStateHandle("chk-1/k", 0, KeyGroupRange(0, 1), [7, 8, 11], 10, [], checkpoint_id=1)
    with pytest.raises(ValueError, match="relative path"):
        KeyedStateHandle("/abs/k", 0, KeyGroupRange(0, 1), [7, 8, 9], 10, [], checkpoint_id=1)
    h = KeyedStateHandle("chk-1/k", 2, KeyGroupRange(4, 5), [7, 8, 9], 10, [{"name": "x"}], checkpoint_id=3)
    assert KeyedStateHandle.from_json(h.to_json()) == h


# -- the compiled module's stub --------------------------------------------------------------------------------

def test_stub_matches_the_compiled_module():
    stub = pathlib.Path(native.__file__).parent / "snapshot.pyi"
    if not stub.exists():   # editable installs keep the stub in the source tree
        stub = pathlib.Path(__file__).parents[1] / "src" / "keygroups" / "_native" / "snapshot.pyi"
    tree = ast.parse(stub.read_text())
    funcs = {n.name: [a.arg for a in n.args.args + n.args.kwonlyargs] for n in tree.body
             if isinstance(n, ast.FunctionDef)}
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    consts = {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    public = {n for n in dir(native) if not n.startswith("_") and not inspect.ismodule(getattr(native, n))}
    runtime_funcs = {n for n in public if callable(getattr(native, n))}
    assert set(funcs) | classes == runtime_funcs
    assert all(isinstance(getattr(native, c), type) for c in classes)
    assert consts == public - runtime_funcs
    for name, params in funcs.items():
        assert list(inspect.signature(getattr(native, name)).parameters) == params, name
