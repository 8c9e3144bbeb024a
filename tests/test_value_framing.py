"""Keyed format 3's per-key value framing (little-endian, a map value being a list of entries in the one map-entry
framing), the upgrade of format 1 and 2 values as their blocks are read, and the format-2 chain of
tests/data/keyed-checkpoint-v2 (written by the code before format 3), which must keep restoring."""

from __future__ import annotations

import json
import pathlib
import shutil
import struct

import crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange, assign_to_key_group, key_group_range
from keygroups._native import framing, splitter
from keygroups._native import snapshot as native
from keygroups.checkpoint import (
    CheckpointMetadata,
    CheckpointStorage,
    KeyedSnapshotWriter,
    carry_forward,
    open_snapshot,
    read_key_group_offsets,
    read_key_groups,
)
from keygroups.errors import CorruptSnapshotError
from keygroups.serializers import Int64Serializer, StrSerializer, ValueSerializer
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    RocksDBKeyedStateBackend,
    StateTtlConfig,
    ValueStateDescriptor,
)
from keygroups.state._codec import ValueFraming

V2_CHECKPOINT = pathlib.Path(__file__).parent / "data" / "keyed-checkpoint-v2"
V2_CLOCK_S = 1_700_000_000.0   # as make_checkpoint.py wrote it
V2_TTL_S = 3600
MAXP = 16
SERS = {"value": ValueSerializer(), "element": StrSerializer(), "map key": StrSerializer(),
        "map value": ValueSerializer()}

timestamps = st.integers(-2**63, 2**63 - 1)
plain = st.one_of(st.none(), st.integers(-2**70, 2**70), st.text(max_size=5), st.lists(st.integers(), max_size=3))
lists = st.lists(st.text(max_size=6), min_size=1, max_size=6)
maps = st.dictionaries(st.text(max_size=4), plain, min_size=1, max_size=6)


def le(fmt: str, *values) -> bytes:
    return struct.pack("<" + fmt, *values)


# ---- the framing, byte for byte ------------------------------------------------------------------------------------

def test_value_framing_is_little_endian_and_a_map_entry_is_the_operator_states_entry():
    s = StrSerializer()
    lst = ValueFraming("l", "list", s, ttl=False)
    assert lst.encode(["ab", ""]) == le("I", 2) + b"ab" + le("I", 0)
    lst_ttl = ValueFraming("l", "list", s, ttl=True)
    assert lst_ttl.encode([("ab", 5)]) == le("Iq", 2, 5) + b"ab"
    val_ttl = ValueFraming("v", "value", Int64Serializer(), ttl=True)
    assert val_ttl.encode((7, -3)) == le("qq", -3, 7)
    m = ValueFraming("m", "map", Int64Serializer(), StrSerializer(), ttl=False)
    m_ttl = ValueFraming("m", "map", Int64Serializer(), StrSerializer(), ttl=True)
    entry = le("I", 1) + b"k" + le("q", 9)
    assert m.encode({"k": 9}) == le("I", len(entry)) + entry
    assert m_ttl.encode({"k": (9, 4)}) == le("Iq", len(entry), 4) + entry
    # the entry is exactly what operator state's broadcast maps store per element
    data, offsets = splitter.encode_entries(b"k", np.array([0, 1]), le("q", 9), np.array([0, 8]))
    assert data == entry and offsets.tolist() == [0, len(entry)]
    # a map value is a list value whose elements are entries
    keys, values, _ = framing.split_map(m.encode({"k": 9, "j": 1}), False)
    elements, _ = framing.split_list(m.encode({"k": 9, "j": 1}), False)
    data, offsets = b"".join(elements), np.cumsum([0] + [len(e) for e in elements])
    assert splitter.decode_entries(data, offsets)[0] == b"".join(keys) == b"kj"
    assert values == [le("q", 9), le("q", 1)]


@settings(max_examples=120, deadline=None)
@given(kind=st.sampled_from(["value", "list", "map"]), ttl=st.booleans(), data=st.data())
def test_every_kind_round_trips_and_rows_rebuild_the_map(kind, ttl, data):
    f = ValueFraming.for_state("s", kind, SERS, ttl=ttl)
    obj = data.draw({"value": plain, "list": lists, "map": maps}[kind])
    if ttl:
        if kind == "value":
            obj = (obj, data.draw(timestamps))
        elif kind == "list":
            obj = [(e, data.draw(timestamps)) for e in obj]
        else:
            obj = {k: (v, data.draw(timestamps)) for k, v in obj.items()}
    raw = f.encode(obj)
    assert f.decode(raw) == obj
    assert f.decode(memoryview(b"xx" + raw)[2:]) == obj   # a slice of a bigger buffer, as blocks hand them out
    if kind == "map":
        assert f.map_from_rows(f.map_rows(raw)) == raw
    if kind == "list":   # concatenating encodings concatenates the lists (RocksDB appends without decoding)
        assert f.decode(raw + raw) == obj + obj
    if ttl and kind != "value":
        deadline = data.draw(timestamps)
        kept = f.drop_expired_bytes(raw, deadline)
        live = ([x for x in obj if x[1] > deadline] if kind == "list"
                else {k: x for k, x in obj.items() if x[1] > deadline})
        if live:
            assert f.decode(kept) == live
        else:
            assert kept is None
        assert (kept is raw) == (len(live) == len(obj))


# ---- untrusted bytes -------------------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80), st.booleans(), st.integers(-2**63, 2**63 - 1))
def test_compiled_framing_never_reads_past_its_buffer(raw, ttl, deadline):
    """Any bytes split, clean up or upgrade into a consistent result or raise CorruptSnapshotError (the compiled
    code checks every length against the bytes that remain; a debug build checks every index as well)."""
    head = 12 if ttl else 4
    try:
        elements, ts = framing.split_list(raw, ttl)
        assert sum(map(len, elements)) + head * len(elements) == len(raw) and (ts is None) != ttl
    except CorruptSnapshotError:
        pass
    try:
        keys, values, ts = framing.split_map(raw, ttl)
        assert sum(map(len, keys + values)) + (head + 4) * len(keys) == len(raw) and len(keys) == len(values)
    except CorruptSnapshotError:
        pass
    try:
        kept = framing.drop_expired(raw, deadline)
        assert kept is None or kept is raw or len(kept) < len(raw)
    except CorruptSnapshotError:
        pass
    for code in (framing.VALUE | framing.TTL, framing.LIST, framing.LIST | framing.TTL, framing.MAP,
                 framing.MAP | framing.TTL):
        block = b"\0" * 3 + raw + b"\0" * 3
        try:
            out = framing.upgrade_block(block, [(0, None, np.array([3, 3 + len(raw)]))], [code])
            assert len(out) == len(block) and out[:3] == out[-3:] == b"\0" * 3
        except CorruptSnapshotError:
            pass


@settings(max_examples=150, deadline=None)
@given(data=st.data(), kind=st.sampled_from(["list", "map"]), ttl=st.booleans())
def test_damaged_values_of_the_new_framing_fail_cleanly(data, kind, ttl):
    f = ValueFraming.for_state("s", kind, SERS, ttl=ttl)
    obj = data.draw(lists if kind == "list" else maps)
    if ttl:
        obj = [(e, 7) for e in obj] if kind == "list" else {k: (v, 7) for k, v in obj.items()}
    raw = bytearray(f.encode(obj))
    for pos, x in data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(1, 255)), max_size=3)):
        raw[pos] ^= x
    for damaged in (bytes(raw), bytes(raw[:data.draw(st.integers(0, len(raw)))])):
        try:
            f.decode(damaged)
            if ttl:
                f.drop_expired_bytes(damaged, 0)
        except CorruptSnapshotError:
            pass


@pytest.mark.parametrize("kind", ["list", "map"])
def test_a_damaged_frame_names_its_state(kind):
    f = ValueFraming.for_state("visits", kind, SERS, ttl=True)
    raw = f.encode([("a", 1)] if kind == "list" else {"a": (1, 1)})
    for damaged in (raw[:-1], raw[:5], b"\xff" + raw[1:]):
        with pytest.raises(CorruptSnapshotError, match=f"state 'visits': a {kind} value: .*truncated or corrupt"):
            f.decode(damaged)
        with pytest.raises(CorruptSnapshotError, match=f"state 'visits': a {kind} value"):
            f.drop_expired_bytes(damaged, 0)


def test_upgrade_refuses_bad_arguments_and_names_the_damage():
    with pytest.raises(ValueError, match="framing code"):
        framing.upgrade_block(b"abcd", [(0, None, np.array([0, 4]))], [3])
    with pytest.raises(ValueError, match="no framing code"):
        framing.upgrade_block(b"abcd", [(1, None, np.array([0, 4]))], [framing.LIST])
    with pytest.raises(ValueError, match="offsets must ascend"):
        framing.upgrade_block(b"abcd", [(0, None, np.array([0, 9]))], [framing.LIST])
    with pytest.raises(CorruptSnapshotError, match="list element of 255 bytes"):
        framing.upgrade_block(b"\0\0\0\xffab", [(0, None, np.array([0, 6]))], [framing.LIST])
    with pytest.raises(CorruptSnapshotError, match="shorter than its timestamp"):
        framing.upgrade_block(b"abcd", [(0, None, np.array([0, 4]))], [framing.VALUE | framing.TTL])
    assert framing.upgrade_block(b"abcd", [(0, None, np.array([0, 4]))], [framing.VALUE]) == b"abcd"


# ---- formats 1 and 2: values upgraded as blocks are read -------------------------------------------------------------

def old_encode(kind: str, ttl: bool, obj) -> bytes:
    """The value framing of keyed formats 1 and 2 (big-endian), as the code before format 3 wrote it."""
    s, ks = SERS["element" if kind == "list" else "map value" if kind == "map" else "value"], SERS["map key"]
    if kind == "value":
        return struct.pack(">q", obj[1]) + s.serialize(obj[0]) if ttl else s.serialize(obj)
    out = b""
    if kind == "list":
        for e in obj:
            eb = s.serialize(e[0] if ttl else e)
            out += (struct.pack(">Iq", len(eb), e[1]) if ttl else struct.pack(">I", len(eb))) + eb
        return out
    for k, v in obj.items():
        kb, vb = ks.serialize(k), s.serialize(v[0] if ttl else v)
        out += struct.pack(">I", len(kb)) + kb + (struct.pack(">Iq", len(vb), v[1]) if ttl else
                                                  struct.pack(">I", len(vb))) + vb
    return out


STATES = [{"name": f"{kind}{'-ttl' if ttl else ''}", "kind": kind, "ttl": {"ttl_ms": 1} if ttl else None}
          for kind in ("value", "list", "map") for ttl in (False, True)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=4), plain, lists, maps, timestamps), min_size=1,
                max_size=5, unique_by=lambda t: t[0]),
       st.sampled_from([1, 2]), st.booleans())
def test_format_1_and_2_values_read_as_format_3(entries, version, offsets):
    """A block written with the old framing reads (CRC checked first) as if written with the new one."""
    old_sections, new_sections = [], []
    for i, meta in enumerate(STATES):
        kind, ttl = meta["kind"], meta["ttl"] is not None
        f = ValueFraming.for_state(meta["name"], kind, SERS, ttl=ttl)
        objs = []
        for k, p, lst, m, ts in entries:
            obj = {"value": p, "list": lst, "map": m}[kind]
            if ttl:
                obj = ((obj, ts) if kind == "value" else [(e, ts) for e in obj] if kind == "list"
                       else {a: (b, ts) for a, b in obj.items()})
            objs.append(obj)
        keys = [k for k, *_ in entries]
        old_sections.append((i, keys, [old_encode(kind, ttl, o) for o in objs]))
        new_sections.append((i, keys, [f.encode(o) for o in objs]))
    block = native.encode_block(3, old_sections, len(STATES), version=2)
    if version == 1:   # format 1: no flags, no op, keys unsorted; rebuilt from format 2's parts
        block = v1_block(block)
    buf = bytearray()
    w = KeyedSnapshotWriter(buf_stream(buf), KeyGroupRange(3, 3), STATES)
    w.write_key_group(3, new_sections)
    w.finish()
    new = next(open_snapshot(bytes(buf)).key_groups())
    header = native.encode_header(3, 1, json.dumps({"states": STATES}).encode())
    old_file = header[:4] + struct.pack("<I", version) + header[8:-4]
    old_file += struct.pack("<I", crc32c.crc32c(old_file))
    index = native.encode_index([len(old_file), len(old_file) + len(block)])
    snap = open_snapshot(old_file + block + index)
    assert snap.version == version
    got = next(snap.key_groups(copy=True))
    assert [(i, [bytes(k) for k in ks], [bytes(v) for v in vs]) for i, ks, vs in got.puts] == \
        [(i, [bytes(k) for k in ks], [bytes(v) for v in vs]) for i, ks, vs in new.puts]


def buf_stream(buf: bytearray):
    class Stream:
        def write(self, b):
            buf.extend(b)

        def tell(self):
            return len(buf)
    return Stream()


def v1_block(block: bytes) -> bytes:
    """A format 2 block (full, puts only) re-laid-out as format 1: no flags word, no op per section."""
    _, puts, _ = native.parse_block(block, 3, len(STATES), copy=True, version=2)
    out = struct.pack("<II", 3, len(puts))
    for i, ks, vs in puts:
        out += struct.pack("<II", i, len(ks)) + b"".join(struct.pack("<I", len(k)) for k in ks)
        out += b"".join(struct.pack("<I", len(v)) for v in vs) + b"".join(ks) + b"".join(vs)
    return out + struct.pack("<I", crc32c.crc32c(out))


# ---- tests/data/keyed-checkpoint-v2: a format-2 chain written before format 3 -----------------------------------------

def v2_descriptors() -> dict:
    ttl = StateTtlConfig.new_builder(V2_TTL_S).build()
    out = {"count": ValueStateDescriptor("count", Int64Serializer()),
           "events": ListStateDescriptor("events", StrSerializer()),
           "attrs": MapStateDescriptor("attrs", StrSerializer(), ValueSerializer()),
           "seen": ValueStateDescriptor("seen", Int64Serializer()),
           "log": ListStateDescriptor("log", StrSerializer()),
           "tags": MapStateDescriptor("tags", StrSerializer(), Int64Serializer())}
    for name in ("seen", "log", "tags"):
        out[name].enable_time_to_live(ttl)
    return out


def v2_expected(clock: str) -> dict[int, list]:
    return {int(k): v for k, v in json.loads((V2_CHECKPOINT / "expected.json").read_text())[clock].items()}


CLOCKS = {"live": V2_CLOCK_S + 200, "expiring": V2_CLOCK_S + V2_TTL_S + 30}


@pytest.fixture
def v2_storage(tmp_path):
    shutil.copytree(V2_CHECKPOINT / "chk", tmp_path / "chk")
    return CheckpointStorage(tmp_path / "chk", retain=100)


def read_all(backend_cls, storage, md, p_new, clock_s, keys, **kw):
    got = {}
    for i in range(p_new):
        r = key_group_range(MAXP, p_new, i)
        with backend_cls(r, MAXP, Int64Serializer(), subtask_index=i, clock=lambda: clock_s, **kw) as b:
            b.restore(storage, md)
            s = {n: b.get_state(d) for n, d in v2_descriptors().items()}
            for k in keys:
                if assign_to_key_group(k, MAXP) in r:
                    b.set_current_key(k)
                    got[k] = [s["count"].value(), list(s["events"].get()), dict(s["attrs"].items()),
                              s["seen"].value(), list(s["log"].get()), dict(s["tags"].items())]
    return got


def test_the_format_2_chain_is_format_2_with_deltas(v2_storage):
    md = v2_storage.load(2)
    assert sorted((h.checkpoint_id, h.format_version) for h in md.keyed_handles) == [(1, 2), (1, 2), (2, 2), (2, 2)]
    deltas = [h for h in md.keyed_handles if h.checkpoint_id == 2]
    for h in deltas:
        blocks, _ = read_key_group_offsets(v2_storage, h, h.key_group_range)
        assert any(b.deletes for b in blocks) and not h.full_key_groups


@pytest.mark.parametrize("backend", [HeapKeyedStateBackend, RocksDBKeyedStateBackend])
@pytest.mark.parametrize("p_new", [1, 3])
@pytest.mark.parametrize("clock", ["live", "expiring"])
def test_the_format_2_chain_restores_at_any_parallelism(v2_storage, backend, p_new, clock):
    """Timestamps of TTL values, list elements and map entries are read right: at the "expiring" clock exactly
    what the code that wrote them saw expired is gone."""
    expected = v2_expected(clock)
    assert read_all(backend, v2_storage, v2_storage.load(2), p_new, CLOCKS[clock], expected) == expected


@pytest.mark.parametrize("backend", [HeapKeyedStateBackend, RocksDBKeyedStateBackend])
def test_the_first_snapshot_after_a_format_2_chain_is_full(v2_storage, backend):
    """The first snapshot after the upgrade writes every key group full (a delta of format 4 names the block it
    applies on by a checksum, which a format-2 block does not carry), so the old files drop out of the next
    checkpoint; a restore reads it with either backend, and so does a savepoint merged from it."""
    clock_s = CLOCKS["live"]
    expected = v2_expected("live")
    last = v2_storage.load(2)
    handles = []
    for i in range(2):
        r = key_group_range(MAXP, 2, i)
        b = backend(r, MAXP, Int64Serializer(), subtask_index=i, clock=lambda: clock_s)
        b.restore(v2_storage, last)
        s = {n: b.get_state(d) for n, d in v2_descriptors().items()}
        for k in expected:
            if assign_to_key_group(k, MAXP) not in r or k % 7:
                continue
            b.set_current_key(k)
            s["count"].update(k * 100)
            s["events"].add("h")
            s["attrs"].put("z", [k])
            s["log"].add("n")
            s["tags"].remove("t")
            s["seen"].clear()
            want = expected[k]
            want[0], want[1], want[2], want[3] = k * 100, want[1] + ["h"], {**want[2], "z": [k]}, None
            want[4] = want[4] + ["n"]
            want[5] = {t: v for t, v in want[5].items() if t != "t"}
        handles.append(b.snapshot(3, v2_storage).result(30))
        b.dispose()
    assert all(h.format_version == native.FORMAT_VERSION and h.is_all_full for h in handles)
    v2_storage.commit(CheckpointMetadata(checkpoint_id=3, job_id="format-2", timestamp_ms=0, max_parallelism=MAXP,
                                         parallelism=2, keyed_handles=carry_forward(last, handles),
                                         operator_handles=[], properties={}))
    md = v2_storage.load(3)
    assert sorted({h.format_version for h in md.keyed_handles}) == [native.FORMAT_VERSION]
    for other in (HeapKeyedStateBackend, RocksDBKeyedStateBackend):
        assert read_all(other, v2_storage, md, 3, clock_s, expected) == expected
    v2_storage.savepoint(3, "sp")
    sp = v2_storage.load_savepoint("sp")
    assert all(h.format_version == native.FORMAT_VERSION and h.is_all_full for h in sp.keyed_handles)
    assert read_all(HeapKeyedStateBackend, v2_storage, sp, 1, clock_s, expected) == expected


def test_format_2_blocks_are_checked_before_their_values_are_upgraded(v2_storage):
    md = v2_storage.load(2)
    h = md.keyed_handles[0]
    raw = bytearray(v2_storage.read_bytes(h.file))
    start, end = h.byte_range(KeyGroupRange(h.key_group_range.start, h.key_group_range.start))
    raw[(start + end) // 2] ^= 0x40
    with v2_storage.open_write(h.file) as f:
        f.write(bytes(raw))
    with pytest.raises(CorruptSnapshotError, match=rf"{h.file}.*CRC32C"):
        list(read_key_groups(v2_storage, h, h.key_group_range)[0])
