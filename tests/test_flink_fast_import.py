"""The compiled import (``keygroups._native.flinkin``, ``keygroups.flink.transcode``): Flink's bytes go straight to
the bytes keygroups' serializers write for the same values.

* differential: the compiled path writes exactly the keyed files the Python path (decode, then encode with the
  keygroups serializers) writes, on every committed fixture and on a savepoint the real Flink job writes;
* properties: random values of random Flink serializer trees, written by ``FlinkType.write``, transcode to the bytes
  of ``FlinkType.keygroups_serializer()``; corrupt and truncated bytes raise keygroups' errors, never crash;
* the block scanner agrees with the block format and names the offset of what is wrong.
"""

from __future__ import annotations

import math
import pathlib
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flink_harness import FIXTURE_SET, FIXTURES
from keygroups._native import flinkin
from keygroups.errors import CorruptSnapshotError, KeyGroupsError, StateSerializationError
from keygroups.flink import importer, read_savepoint
from keygroups.flink.importer import import_savepoint
from keygroups.flink.keyed import iter_block_entries
from keygroups.flink.transcode import NotCompiled, compile_type
from keygroups.flink.types import (
    BooleanType,
    ByteType,
    BytesType,
    CharType,
    DoubleType,
    FloatType,
    IntType,
    ListType,
    LongType,
    MapType,
    NullableType,
    RowType,
    ShortType,
    StringType,
    TupleType,
    VoidNamespaceType,
)

FIXTURE_NAMES = [f.name for f in FIXTURE_SET]


# ---------------------------------------------------------------------------------------------- differential

def _python_path_only(monkeypatch):
    def no_fast_plan(st, key_type):
        raise NotCompiled("the Python path, for comparison")
    monkeypatch.setattr(importer, "_fast_plan", no_fast_plan)


def same_file_ids(monkeypatch) -> None:
    """The next files written get the ids 0, 1, 2, ... (each file's id is random otherwise, and every block's checksum
    covers it): two imports written after a call each write the same bytes when their contents are equal."""
    from keygroups.checkpoint import format as fmt
    counter = iter(range(1 << 30))
    monkeypatch.setattr(fmt, "new_file_id", lambda: next(counter).to_bytes(16, "big"))


def _keyed_files(location: pathlib.Path, name: str) -> dict[int, bytes]:
    """The keyed files of savepoint ``name`` by subtask (their names carry a random suffix)."""
    out = {}
    for p in (location / "savepoints" / name).glob("keyed-*"):
        out[int(p.name.split("-")[1])] = p.read_bytes()
    return out


def _block_sections(location: pathlib.Path, name: str) -> dict[tuple[int, str], tuple[list[bytes], list[bytes]]]:
    """(key group, state) -> (keys, values) of every keyed file: what to compare when the files differ."""
    from keygroups.checkpoint import CheckpointStorage
    from keygroups.checkpoint.format import read_key_groups
    from keygroups.runtime.state_reader import load_restore_point

    storage = CheckpointStorage(str(location))
    md = load_restore_point(storage, savepoint=name)
    out = {}
    for handle in md.keyed_handles:
        blocks, _ = read_key_groups(storage, handle, handle.key_group_range, copy=True)
        for block in blocks:
            for state_index, keys, values in block.puts:
                out[(block.key_group, handle.states[state_index]["name"])] = (list(keys), list(values))
    return out


def _assert_same_import(tmp_path, monkeypatch, savepoint, **kwargs):
    sp = read_savepoint(savepoint)
    same_file_ids(monkeypatch)
    fast = import_savepoint(sp, str(tmp_path / "fast"), "sp", uid="keyed", **kwargs)
    with monkeypatch.context() as m:
        _python_path_only(m)
        same_file_ids(m)
        slow = import_savepoint(sp, str(tmp_path / "slow"), "sp", uid="keyed", **kwargs)
    assert (fast.entries, fast.timers, fast.key_groups, fast.keyed_states) == \
        (slow.entries, slow.timers, slow.key_groups, slow.keyed_states)
    assert fast.entries > 0 and fast.timers > 0
    a, b = _keyed_files(tmp_path / "fast", "sp"), _keyed_files(tmp_path / "slow", "sp")
    assert sorted(a) == sorted(b)
    if a != b:   # name the first state and key group that differ
        sa, sb = _block_sections(tmp_path / "fast", "sp"), _block_sections(tmp_path / "slow", "sp")
        assert sa.keys() == sb.keys()
        for where in sorted(sa):
            assert sa[where] == sb[where], f"key group {where[0]}, state {where[1]!r}"
        pytest.fail("the keyed files differ outside their sections")
    return fast


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_compiled_import_writes_what_the_python_path_writes(tmp_path, monkeypatch, name):
    report = _assert_same_import(tmp_path, monkeypatch, FIXTURES / name / "savepoint")
    assert "row" in report.keyed_states and "ttl_map" in report.keyed_states


def test_every_fixture_state_is_compiled():
    """The fixtures' keyed states (every type the importer maps, TTL, lists, maps, timers) take the compiled path."""
    sp = read_savepoint(FIXTURES / FIXTURE_NAMES[0] / "savepoint")
    plans = [importer._plan(info, i, 1000) for i, info in enumerate(s for s in sp.states("keyed") if s.keyed)]
    key_type = sp.keyed_header("keyed").key_type
    assert set(importer._fast_plans(plans, key_type)) == {st.info.name for st in plans}


@pytest.mark.flink
def test_compiled_import_of_a_real_flink_savepoint_equals_the_python_path(tmp_path, monkeypatch):
    from flink_harness import Fixture, flink_lib, missing_reason, write_savepoint

    if flink_lib() is None:
        pytest.skip(missing_reason())
    out = write_savepoint(tmp_path / "flink", Fixture(2, 300, True, 500, "tuple", "rocksdb", False))
    _assert_same_import(tmp_path, monkeypatch, out)


# ---------------------------------------------------------------------------------------------- properties

SCALARS = [LongType(), IntType(), ShortType(), ByteType(), DoubleType(), FloatType(), BooleanType(), CharType(),
           StringType(), BytesType()]


def _nullable(inner):
    return st.builds(NullableType, st.just(inner), st.sampled_from([0, inner.length] if inner.length > 0 else [0]))


def _record_types():
    """Flink types a Row's field can be (every one the importer maps)."""
    return st.recursive(
        st.sampled_from(SCALARS),
        lambda inner: st.one_of(
            st.lists(inner, min_size=1, max_size=4).map(lambda fs: TupleType(tuple(fs))),
            st.builds(lambda fs, rk: RowType(tuple(fs), rk), st.lists(inner, min_size=1, max_size=5), st.booleans()),
            inner.map(ListType),
            st.builds(MapType, st.sampled_from(SCALARS), inner),
            inner.flatmap(_nullable)),
        max_leaves=8)


def _codec_types():
    """Flink types a keyed state's value can be (keygroups' codec serializers; a Row inside is a record)."""
    return st.recursive(
        st.one_of(st.sampled_from(SCALARS),
                  st.builds(lambda fs, rk: RowType(tuple(fs), rk), st.lists(_record_types(), min_size=1,
                                                                              max_size=4), st.booleans())),
        lambda inner: st.one_of(
            st.lists(inner, min_size=1, max_size=4).map(lambda fs: TupleType(tuple(fs))),
            inner.map(ListType),
            st.builds(MapType, _hashable_types(), inner),
            inner.flatmap(_nullable)),
        max_leaves=8)


def _hashable_types():
    """Map key types: their values are Python dict keys."""
    return st.one_of(st.sampled_from(SCALARS),
                     st.lists(st.sampled_from(SCALARS), min_size=1, max_size=3).map(lambda fs: TupleType(tuple(fs))))


def _float32(x: float) -> float:
    return struct.unpack(">f", struct.pack(">f", x))[0]


def values(t, in_record=False):
    """Values of Flink type ``t`` as both FlinkType.write and the keygroups serializer take them."""
    if isinstance(t, LongType):
        return st.integers(-(1 << 63), (1 << 63) - 1)
    if isinstance(t, IntType):
        return st.integers(-(1 << 31), (1 << 31) - 1)
    if isinstance(t, ShortType):
        return st.integers(-(1 << 15), (1 << 15) - 1)
    if isinstance(t, ByteType):
        return st.integers(-128, 127)
    if isinstance(t, DoubleType):
        return st.floats(allow_nan=True, allow_infinity=True)
    if isinstance(t, FloatType):
        return st.floats(width=32, allow_nan=True).map(_float32)
    if isinstance(t, BooleanType):
        return st.booleans()
    if isinstance(t, CharType):
        return st.characters(max_codepoint=0xFFFF, blacklist_categories=("Cs",))
    if isinstance(t, StringType):
        return st.text(max_size=12)     # supplementary characters included, no lone surrogates
    if isinstance(t, BytesType):
        return st.binary(max_size=12)
    if isinstance(t, TupleType):     # Flink's Tuple fields are never null, Nullable ones included
        return st.tuples(*(values(f, in_record).filter(lambda x: x is not None) for f in t.fields))
    if isinstance(t, RowType):
        return st.tuples(*(st.one_of(st.none(), values(f, True)) for f in t.fields))
    if isinstance(t, ListType):
        return st.lists(values(t.element, in_record), max_size=4)
    if isinstance(t, MapType):
        return st.dictionaries(values(t.key, True), st.one_of(st.none(), values(t.value, True)), max_size=4)
    if isinstance(t, NullableType):
        return st.one_of(st.none(), values(t.inner, in_record))
    raise AssertionError(t)


def _same_bytes(t, v) -> tuple[bytes, bytes]:
    """(transcoded, keygroups serializer's) bytes of ``v``; a value the serializer refuses (a null map value, two
    map keys of the same bytes) must be refused by the transcoder too."""
    out = bytearray()
    t.write(out, v)
    node = compile_type(t)
    try:
        want = t.keygroups_serializer().serialize(v)
    except (ValueError, TypeError):
        with pytest.raises(StateSerializationError):
            node.transcode(bytes(out))
        return b"", b""
    return node.transcode(bytes(out)), want


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_transcoded_values_are_the_keygroups_serializers_bytes(data):
    t = data.draw(_codec_types(), "type")
    v = data.draw(values(t), "value")
    got, want = _same_bytes(t, v)
    assert got == want


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_transcoded_rows_are_the_record_serializers_bytes(data):
    t = RowType(tuple(data.draw(st.lists(_record_types(), min_size=1, max_size=6), "fields")),
                data.draw(st.booleans(), "row kind"))
    v = data.draw(values(t), "row")
    got, want = _same_bytes(t, v)
    assert got == want


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_a_tuple_at_the_top_of_a_value_transcodes_to_its_records_bytes(data):
    """A state's Tuple value is imported as the record f0, f1, ... (``state_serializer``): the compiled node of the
    whole value writes that record's bytes; a Tuple deeper in a List, Map or Nullable has no compiled import."""
    from keygroups.flink import state_serializer
    from keygroups.flink.transcode import compile_value

    t = TupleType(tuple(data.draw(st.lists(_record_types(), min_size=1, max_size=5), "fields")))
    v = data.draw(values(t), "tuple")
    out = bytearray()
    t.write(out, v)
    assert compile_value(t, True).transcode(bytes(out)) == state_serializer(t).serialize(v)
    with pytest.raises(NotCompiled):
        compile_value(ListType(t), True)
    assert compile_value(MapType(t, LongType()), True) is not None   # a map's keys stay tuples


@pytest.mark.parametrize("text", ["", "plain", "naïve", "日本語", "emoji 😀 and 𝄞", "\x00nul", "\U0010ffff"])
def test_strings_transcode_to_utf8_with_supplementary_characters_joined(text):
    got, want = _same_bytes(StringType(), text)
    assert got == want == text.encode("utf-8")
    got, want = _same_bytes(TupleType((StringType(), LongType())), (text, 1))
    assert got == want


def test_floats_keep_their_bits_and_nan_is_canonical():
    for x in (0.0, -0.0, math.inf, -math.inf, 1.5, float("nan")):
        for t in (DoubleType(), FloatType()):
            assert _same_bytes(t, x)[0] == _same_bytes(t, x)[1]
    signalling = struct.pack(">I", 0x7F800001)   # a float NaN with a payload: keygroups writes its one NaN
    assert compile_type(FloatType()).transcode(signalling) == struct.pack("<d", math.nan)
    row = RowType((FloatType(),), False)
    assert compile_type(row).transcode(b"\x00" + signalling) == b"\x01" + struct.pack("<I", 0x7FC00000)


def test_values_keygroups_cannot_hold_are_refused_by_name():
    lone = bytes([2, 0xED, 0xA0, 0x80])     # a String of one unit 0xD800 (a varint of three bytes)
    lone = bytes([2]) + bytes([0x80 | (0xD800 & 0x7F), 0x80 | ((0xD800 >> 7) & 0x7F), 0xD800 >> 14])
    with pytest.raises(StateSerializationError, match="lone UTF-16 surrogate 0xd800"):
        compile_type(StringType()).transcode(lone)
    with pytest.raises(StateSerializationError, match="lone UTF-16 surrogate"):
        compile_type(CharType()).transcode(b"\xdc\x00")
    with pytest.raises(StateSerializationError, match="null String"):
        compile_type(StringType()).transcode(b"\x00")
    # a null String inside a non-null Nullable is keygroups' null, as the Python path decodes it
    assert compile_type(NullableType(StringType())).transcode(b"\x00\x00") == b"\x00"


def test_rows_that_are_not_inserts_are_corrupt():
    with pytest.raises(CorruptSnapshotError, match="RowKind is not INSERT"):
        compile_type(RowType((LongType(),))).transcode(b"\x40" + bytes(8))


def test_maps_outside_a_row_are_sorted_by_key_bytes_and_nested_nullables_keep_their_flags():
    t = MapType(StringType(), LongType())
    got, want = _same_bytes(t, {"b": 1, "a": 2, "ab": 3, "": 4})
    assert got == want and got.startswith(struct.pack("<I", 4) + struct.pack("<I", 0))
    t = NullableType(NullableType(LongType()))
    assert compile_type(t).transcode(b"\x00\x00" + struct.pack(">q", 5)) == b"\x01\x01" + struct.pack("<q", 5)
    assert compile_type(t).transcode(b"\x00\x01") == compile_type(t).transcode(b"\x01") == b"\x00"
    with pytest.raises(NotCompiled):
        compile_type(VoidNamespaceType())


def test_map_state_keys_are_distinct_as_java_sees_them():
    """0.0 and -0.0 are two map keys (Java's Double.equals), NaN is one: the compiled path keeps Flink's entries as
    they are, and keygroups reads them back as two keys."""
    from keygroups.flink.types import DoubleType as D
    from keygroups.state._codec import ValueFraming
    from keygroups.serializers import Float64Serializer, Int64Serializer
    from keygroups._javakeys import NEGATIVE_ZERO_KEY

    key = struct.pack(">q", 7) + b"\x00"
    entries = [(0, key + struct.pack(">d", 0.0), b"\x00" + struct.pack(">q", 1)),
               (0, key + struct.pack(">d", -0.0), b"\x00" + struct.pack(">q", 2)),
               (0, key + struct.pack(">d", math.nan), b"\x00" + struct.pack(">q", 3))]
    scan = flinkin.scan_block(_block(entries, 3, 1), 3, 1, 1, "b")
    plan = flinkin.StatePlan(flinkin.MAP_STATE, compile_type(LongType()), compile_type(LongType()),
                             compile_type(D()), False, "m")
    n, kd, ko, vd, vo = plan.transcode(scan, 0)
    assert (n, kd, list(ko)) == (3, struct.pack("<q", 7), [0, 8])
    framing = ValueFraming("m", "map", Int64Serializer(), Float64Serializer())
    m = framing.decode(vd)
    assert len(m) == 3 and m[0.0] == 1 and m[NEGATIVE_ZERO_KEY] == 2


ANY_TYPE = st.one_of(_codec_types(), st.lists(_record_types(), min_size=1, max_size=4).map(
    lambda fs: RowType(tuple(fs))))


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_truncated_and_flipped_values_raise_keygroups_errors_never_crash(data):
    t = data.draw(ANY_TYPE, "type")
    out = bytearray()
    t.write(out, data.draw(values(t), "value"))
    raw = bytes(out)
    cut = data.draw(st.integers(0, len(raw)), "cut")
    node = compile_type(t)
    try:
        node.transcode(raw)
        holdable = True
    except StateSerializationError:      # a value keygroups cannot hold may be refused before the cut is reached
        holdable = False
    if cut < len(raw):
        with pytest.raises(CorruptSnapshotError if holdable else KeyGroupsError):
            node.transcode(raw[:cut])
    flipped = bytearray(raw)
    for pos, bit in data.draw(st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 7)), max_size=3), "flips"):
        if flipped:
            flipped[pos % len(flipped)] ^= 1 << bit
    try:
        node.transcode(bytes(flipped) + data.draw(st.binary(max_size=4), "tail"))
    except KeyGroupsError:
        pass


# ---------------------------------------------------------------------------------------------- block scanner

def _block(entries: list[tuple[int, bytes, bytes]], key_group: int, prefix: int) -> bytes:
    """A key-group block of (state id, key, value) runs, as Flink's FullSnapshotAsyncWriter writes it."""
    out = bytearray()
    kg = key_group.to_bytes(prefix, "big")
    for i, (sid, key, value) in enumerate(entries):
        if i == 0 or entries[i - 1][0] != sid:
            out += struct.pack(">h", sid)
        last = i + 1 == len(entries) or entries[i + 1][0] != sid
        k = bytearray(kg + key)
        if last:
            k[0] |= 0x80
        out += struct.pack(">i", len(k)) + k + struct.pack(">i", len(value)) + value
        if i + 1 == len(entries):
            out += b"\xff\xff"
    return bytes(out)


ENTRIES = st.lists(st.tuples(st.integers(0, 3), st.binary(max_size=6), st.binary(max_size=6)), min_size=1,
                   max_size=12).map(lambda es: sorted(es, key=lambda e: e[0]))


@settings(max_examples=200)
@given(entries=ENTRIES, key_group=st.integers(0, 127), prefix=st.sampled_from([1, 2]))
def test_scanned_blocks_give_back_their_entries(entries, key_group, prefix):
    block = _block(entries, key_group, prefix)
    assert list(iter_block_entries(block, key_group, prefix, 4, "b")) == entries
    scan = flinkin.scan_block(block, key_group, prefix, 4, "b")
    assert scan.counts(4) == [sum(1 for e in entries if e[0] == s) for s in range(4)]


@settings(max_examples=300)
@given(entries=ENTRIES, key_group=st.integers(0, 127), prefix=st.sampled_from([1, 2]), cut=st.integers(0, 1 << 12),
       flips=st.lists(st.tuples(st.integers(0, 1 << 12), st.integers(0, 7)), max_size=3))
def test_truncated_and_flipped_blocks_raise_corrupt_snapshot_errors(entries, key_group, prefix, cut, flips):
    block = _block(entries, key_group, prefix)
    with pytest.raises(CorruptSnapshotError, match=r"^b(:| at byte \d+)"):
        flinkin.scan_block(block[:cut % len(block)], key_group, prefix, 4, "b")
    bad = bytearray(block)
    for pos, bit in flips:
        bad[pos % len(bad)] ^= 1 << bit
    try:
        scan = flinkin.scan_block(bytes(bad), key_group, prefix, 4, "b")
    except CorruptSnapshotError:
        return
    sid, ks, ke, vs, ve = scan.arrays()
    assert all(0 <= s < 4 for s in sid) and all(0 <= a <= b <= len(bad) for a, b in zip(ks, ke)) and \
        all(ke[i] < vs[i] <= ve[i] <= len(bad) for i in range(len(sid)))


def test_scanner_names_the_offset_of_what_is_wrong():
    block = _block([(0, b"k", b"v")], 5, 1)
    with pytest.raises(CorruptSnapshotError, match="b at byte 0: state id 7; the header lists 4 states"):
        flinkin.scan_block(b"\x00\x07" + block[2:], 5, 1, 4, "b")
    with pytest.raises(CorruptSnapshotError, match="b at byte 6: an entry of key group 5 in the block of key group 6"):
        flinkin.scan_block(block, 6, 1, 4, "b")
    with pytest.raises(CorruptSnapshotError, match="b at byte 2: a key of 1000 bytes"):
        flinkin.scan_block(block[:2] + struct.pack(">i", 1000) + block[6:], 5, 1, 4, "b")
    with pytest.raises(CorruptSnapshotError, match="2 bytes follow the end of key group 5"):
        flinkin.scan_block(block + b"xx", 5, 1, 4, "b")


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(target=st.integers(0, 1 << 20), flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 7)),
                                                      min_size=1, max_size=3))
def test_fuzzed_blocks_through_every_state_plan_raise_only_keygroups_errors(target, flips):
    """Every state of a real block, transcoded after its bytes were flipped: keygroups' errors or a clean result."""
    sp = read_savepoint(FIXTURES / "p2-mp128-long-hashmap-inline-plain" / "savepoint")
    blocks = list(sp.key_group_blocks("keyed"))
    raw = blocks[target % len(blocks)]
    plans = [importer._plan(info, i, 1000) for i, info in enumerate(s for s in sp.states("keyed") if s.keyed)]
    fast = importer._fast_plans(plans, raw.header.key_type)
    bad = bytearray(raw.block)
    for pos, bit in flips:
        bad[pos % len(bad)] ^= 1 << bit
    try:
        scan = flinkin.scan_block(bytes(bad), raw.key_group, raw.prefix_bytes, len(raw.header.states), "b")
    except CorruptSnapshotError:
        return
    for state_id, m in enumerate(raw.header.states):
        plan = fast.get(m.name)
        if plan is not None:
            try:
                plan.transcode(scan, state_id)
            except KeyGroupsError:
                pass


def test_the_python_path_keeps_map_keys_apart_as_java_does_too():
    """The Python path (window states, types not compiled) builds a map value from Flink's entries as the compiled
    path does: 0.0 and -0.0 two keys, every NaN one."""
    from keygroups._javakeys import NEGATIVE_ZERO_KEY
    from keygroups.flink.savepoint import FlinkStateInfo
    from keygroups.flink.types import DoubleType, MapType
    from keygroups.runtime.backends import key_serializer_for

    info = FlinkStateInfo("m", "MAP", MapType(DoubleType(), LongType()), LongType(), VoidNamespaceType(), False)
    st = importer._plan(info, 0, 1000)
    entries = [(7, None, 0.0, 1), (7, None, -0.0, 2), (7, None, math.nan, 3), (7, None, -math.nan, 4)]
    keys, values = importer._encode(st, entries, key_serializer_for("long"), LongType(), {})
    assert len(keys) == 1
    m = st.framing.decode(values[0])
    assert len(m) == 3 and m[0.0] == 1 and m[NEGATIVE_ZERO_KEY] == 2
