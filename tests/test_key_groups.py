"""The key-group core against Flink's own outputs (tests/data, computed by Flink 2.3.0), a plain-Python reference and
mmh3, through the scalar path and every vectorized input form."""

from __future__ import annotations

import math
import re
import struct

import mmh3
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keygroups as kg
import reference as ref
from conftest import load_jsonl

VECTORS = load_jsonl("key_groups.jsonl")
MAX_PARALLELISMS = [1, 2, 3, 7, 10, 128, 129, 1000, 4096, 32768]
FIELD_KEY_TYPES = {"int": "int", "long": "long", "string": "string", "double": "double", "boolean": "boolean",
                   "bytes": "bytes"}


def decode_scalar(value, java_type):
    if java_type == "double":
        return float(value)
    if java_type == "bytes":
        return bytes.fromhex(value)
    return value


def decode(row):
    """(python key, key_type) for one vector line."""
    t = row["type"]
    if t.startswith("tuple<"):
        fields = t[len("tuple<") : -1].split(",")
        key = tuple(decode_scalar(v, f) for v, f in zip(row["key"], fields))
        return key, tuple(FIELD_KEY_TYPES[f] for f in fields)
    return decode_scalar(row["key"], t), ("int" if t == "int" else None)


def rows_of(java_type):
    return [r for r in VECTORS if r["type"] == java_type]


def expected_groups(rows, mp):
    return np.array([r["key_groups"][str(mp)] for r in rows], dtype=np.int16)


def test_vectors_cover_every_type():
    assert {r["type"] for r in VECTORS} >= {"long", "int", "boolean", "double", "string", "bytes"}
    assert any(r["type"].startswith("tuple<") for r in VECTORS)


@pytest.mark.parametrize("row", VECTORS, ids=lambda r: f"{r['type']}:{str(r['key'])[:20]}")
def test_scalar_path_matches_flink(row):
    key, key_type = decode(row)
    assert kg.java_hash(key, key_type) == row["java_hash"]
    assert kg.murmur_hash(row["java_hash"]) == row["murmur"]
    for mp, group in row["key_groups"].items():
        assert kg.assign_to_key_group(key, int(mp), key_type) == group


def vector_inputs(java_type):
    """Every vectorized form a key column of this Java type can take: (label, keys, key_type)."""
    rows = rows_of(java_type)
    keys = [decode(r)[0] for r in rows]
    forms = [("list", keys, "int" if java_type == "int" else None)]
    if java_type == "long":
        forms += [("numpy-int64", np.array(keys, dtype=np.int64), None), ("arrow-int64", pa.array(keys, pa.int64()), None)]
    elif java_type == "int":
        forms += [
            ("numpy-int32", np.array(keys, dtype=np.int32), None),
            ("numpy-int64-as-int", np.array(keys, dtype=np.int64), "int"),
            ("arrow-int32", pa.array(keys, pa.int32()), None),
        ]
    elif java_type == "boolean":
        forms += [("numpy-bool", np.array(keys, dtype=bool), None), ("arrow-bool", pa.array(keys, pa.bool_()), None)]
    elif java_type == "double":
        forms += [("numpy-float64", np.array(keys, dtype=np.float64), None),
                  ("arrow-float64", pa.array(keys, pa.float64()), None)]
    elif java_type == "string":
        forms += [
            ("numpy-unicode", np.array(keys, dtype=str), None),
            ("numpy-object", np.array(keys, dtype=object), None),
            ("arrow-utf8", pa.array(keys, pa.string()), None),
            ("arrow-large-utf8", pa.array(keys, pa.large_string()), None),
            ("arrow-string-view", pa.array(keys, pa.string_view()), None),
            ("arrow-chunked", pa.chunked_array([keys[: len(keys) // 3], keys[len(keys) // 3 :]], pa.string()), None),
            ("arrow-dictionary", pa.array(keys, pa.string()).dictionary_encode(), None),
        ]
    elif java_type == "bytes":
        forms += [
            ("arrow-binary", pa.array(keys, pa.binary()), None),
            ("arrow-large-binary", pa.array(keys, pa.large_binary()), None),
            ("arrow-binary-view", pa.array(keys, pa.binary_view()), None),
        ]
    return rows, forms


@pytest.mark.parametrize("java_type", ["long", "int", "boolean", "double", "string", "bytes"])
def test_vectorized_paths_match_flink(java_type):
    rows, forms = vector_inputs(java_type)
    hashes = np.array([r["java_hash"] for r in rows], dtype=np.int32)
    for label, keys, key_type in forms:
        np.testing.assert_array_equal(kg.java_hashes(keys, key_type), hashes, err_msg=label)
        for mp in MAX_PARALLELISMS:
            got = kg.assign_key_groups(keys, mp, key_type)
            assert got.dtype == np.int16
            np.testing.assert_array_equal(got, expected_groups(rows, mp), err_msg=f"{label} mp={mp}")


def test_numpy_fixed_bytes_match_flink_where_numpy_can_hold_the_key():
    # numpy 'S' arrays drop trailing NUL bytes (numpy's own rule), so only keys without one can round-trip.
    rows = [r for r in rows_of("bytes") if not bytes.fromhex(r["key"]).endswith(b"\x00")]
    keys = np.array([bytes.fromhex(r["key"]) for r in rows], dtype="S")
    np.testing.assert_array_equal(kg.assign_key_groups(keys, 128), expected_groups(rows, 128))


def test_tuple_vectors_through_lists_and_object_arrays():
    by_type: dict[str, list] = {}
    for r in VECTORS:
        if r["type"].startswith("tuple<"):
            by_type.setdefault(r["type"], []).append(r)
    for rows in by_type.values():
        decoded = [decode(r) for r in rows]
        keys = [k for k, _ in decoded]
        key_type = decoded[0][1]
        obj = np.empty(len(keys), dtype=object)
        obj[:] = keys
        for form in (keys, obj):
            for mp in MAX_PARALLELISMS:
                np.testing.assert_array_equal(kg.assign_key_groups(form, mp, key_type), expected_groups(rows, mp))


def test_ranges_operator_indices_and_default_max_parallelism_match_flink():
    for r in load_jsonl("ranges.jsonl"):
        rng = kg.key_group_range(r["max_parallelism"], r["parallelism"], r["operator_index"])
        assert (rng.start, rng.end) == (r["start"], r["end"]), r
    rows = load_jsonl("operator_index.jsonl")
    for r in rows:
        assert kg.operator_index_for_key_group(r["max_parallelism"], r["parallelism"], r["key_group"]) == r[
            "operator_index"
        ]
    by_config: dict[tuple[int, int], list] = {}
    for r in rows:
        by_config.setdefault((r["max_parallelism"], r["parallelism"]), []).append(r)
    for (mp, p), group in by_config.items():
        got = kg.operator_index_for_key_group(mp, p, np.array([r["key_group"] for r in group]))
        np.testing.assert_array_equal(got, [r["operator_index"] for r in group])
    for r in load_jsonl("default_max_parallelism.jsonl"):
        assert kg.default_max_parallelism(r["parallelism"]) == r["max_parallelism"]


@pytest.mark.parametrize("mp,p", [(128, 1), (128, 3), (128, 7), (128, 128), (13, 5), (32768, 7), (1000, 999)])
def test_ranges_partition_all_key_groups_and_agree_with_operator_index(mp, p):
    seen = []
    for i in range(p):
        rng = kg.key_group_range(mp, p, i)
        assert len(rng) >= 1
        for group in (rng.start, rng.end):
            assert kg.operator_index_for_key_group(mp, p, group) == i
        seen.extend(rng)
    assert seen == list(range(mp))


# ---- properties against independent references ------------------------------------------------------------------

int32s = st.integers(-(2**31), 2**31 - 1)


def mmh3_flink(h: int) -> int:
    m = mmh3.hash(struct.pack("<i", h), seed=0, signed=True)
    return m if m >= 0 else (-m if m != -(2**31) else 0)


@given(int32s)
@settings(max_examples=2000)
def test_murmur_equals_mmh3_with_flinks_sign_rule(h):
    assert kg.murmur_hash(h) == mmh3_flink(h) == ref.murmur_hash(h)


def test_murmur_min_value_branch():
    # -2089875627 is the one int whose murmur hash is Integer.MIN_VALUE (Flink maps it to 0).
    assert kg.murmur_hash(-2089875627) == 0 == mmh3_flink(-2089875627)


scalar_keys = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
    st.binary(),
)
keys = st.one_of(scalar_keys, st.tuples(scalar_keys, scalar_keys), st.tuples(scalar_keys, st.tuples(st.text(), st.integers(-(2**63), 2**63 - 1))))


@given(keys, st.sampled_from(MAX_PARALLELISMS))
@settings(max_examples=1500)
def test_compiled_scalar_equals_reference(key, mp):
    assert kg.java_hash(key) == ref.java_hash(key)
    assert kg.assign_to_key_group(key, mp) == ref.key_group(key, mp)


@given(st.lists(keys, max_size=40), st.sampled_from(MAX_PARALLELISMS))
@settings(max_examples=300)
def test_vectorized_list_equals_scalar(batch, mp):
    expected = np.array([kg.assign_to_key_group(k, mp) for k in batch], dtype=np.int16)
    np.testing.assert_array_equal(kg.assign_key_groups(batch, mp), expected)


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=60), st.sampled_from(MAX_PARALLELISMS),
       st.integers(0, 5))
@settings(max_examples=300)
def test_vectorized_int64_forms_equal_scalar(values, mp, offset):
    expected = np.array([ref.key_group(v, mp) for v in values[offset:]], dtype=np.int16)
    arr = np.array(values, dtype=np.int64)
    np.testing.assert_array_equal(kg.assign_key_groups(arr[offset:], mp), expected)
    np.testing.assert_array_equal(kg.assign_key_groups(pa.array(values, pa.int64()).slice(offset), mp), expected)


@given(st.lists(st.text(), max_size=40), st.sampled_from(MAX_PARALLELISMS), st.integers(0, 5))
@settings(max_examples=300)
def test_vectorized_strings_equal_reference(values, mp, offset):
    values = [v for v in values if "\x00" not in v[-1:]]  # numpy 'U' cannot hold trailing NULs
    expected = np.array([ref.key_group(v, mp) for v in values[offset:]], dtype=np.int16)
    for arr in (pa.array(values, pa.string()), pa.array(values, pa.large_string()), pa.array(values, pa.string_view())):
        np.testing.assert_array_equal(kg.assign_key_groups(arr.slice(offset), mp), expected)
    if values:
        np.testing.assert_array_equal(kg.assign_key_groups(np.array(values, dtype=str)[offset:], mp), expected)


# ---- the vector path for Arrow strings (eight short ASCII strings at a time) and the scalar path beside it ----------

SIMD_MODES = [pytest.param(2, id="avx512"), pytest.param(1, id="avx2"), pytest.param(0, id="scalar")]


@pytest.fixture
def simd_mode(request):
    """Runs the test with the vector path capped at a width (a CPU without that width takes the next narrower)."""
    from keygroups._native import hashing

    previous = hashing._set_simd(request.param)
    yield request.param
    hashing._set_simd(previous)


def test_vector_path_caps():
    from keygroups._native import hashing

    widest = hashing._simd_active()
    previous = hashing._set_simd(0)
    try:
        assert previous == 2 and hashing._simd_active() == 0
        hashing._set_simd(1)
        assert hashing._simd_active() == min(widest, 1)
        with pytest.raises(ValueError, match="vector level is 0"):
            hashing._set_simd(3)
    finally:
        hashing._set_simd(previous)
    assert hashing._simd_active() == widest


# Mostly short ASCII (the vector path's case) with lengths around its limits (8 and 16 bytes), now and then a longer
# or non-ASCII string that sends its group of eight to the scalar code.
_short_ascii = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127), max_size=17)
_any_text = st.one_of(_short_ascii, _short_ascii, _short_ascii, st.text(max_size=30))


@pytest.mark.parametrize("simd_mode", SIMD_MODES, indirect=True)
@given(st.lists(_any_text, max_size=90), st.sampled_from(MAX_PARALLELISMS), st.integers(0, 9))
@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_arrow_strings_equal_reference_on_both_paths(simd_mode, values, mp, offset):
    expected_hashes = np.array([ref.java_hash(v) for v in values[offset:]], dtype=np.int32)
    expected = np.array([ref.key_group(v, mp) for v in values[offset:]], dtype=np.int16)
    for arr in (pa.array(values, pa.string()), pa.array(values, pa.large_string())):
        np.testing.assert_array_equal(kg.java_hashes(arr.slice(offset)), expected_hashes)
        np.testing.assert_array_equal(kg.assign_key_groups(arr.slice(offset), mp), expected)


@pytest.mark.parametrize("simd_mode", SIMD_MODES, indirect=True)
def test_many_short_strings_agree_on_both_paths(simd_mode):
    """Arrays longer than one block of the fused kernel (1024 values) and than the prefetch distance, every length
    from 0 to 20 bytes, and values that begin in the data buffer's first eight bytes."""
    rng = np.random.default_rng(7)
    values = ["".join(chr(c) for c in rng.integers(0, 128, size=rng.integers(0, 21))) for _ in range(5000)]
    values[2500:2510] = ["é" * k for k in range(10)]
    expected = np.array([ref.key_group(v, 32768) for v in values], dtype=np.int16)
    for typ in (pa.string(), pa.large_string()):
        np.testing.assert_array_equal(kg.assign_key_groups(pa.array(values, typ), 32768), expected)


@pytest.mark.parametrize("simd_mode", SIMD_MODES, indirect=True)
@pytest.mark.parametrize("bad_index", [0, 5, 13, 700, 1023, 1024, 1995])
def test_corrupt_offsets_inside_a_group_of_eight_are_reported_at_their_position(simd_mode, bad_index):
    """A vector group with one value out of bounds goes value by value, so the error names that value; an
    offset far out of bounds is also read as a prefetch hint 256 values earlier, which must be harmless."""
    from keygroups._native import hashing

    data = b"user-1234567" * 2000
    for width in (np.int32, np.int64):
        offsets = np.arange(0, 12 * 2001, 12, dtype=width)[:2001]
        offsets[bad_index + 1] = 10**9
        with pytest.raises(ValueError, match=f"value at position {bad_index} has offsets"):
            hashing.java_hashes_var_binary(offsets, memoryview(data), True, 128)
        with pytest.raises(ValueError, match=f"value at position {bad_index} has offsets"):
            hashing.java_hashes_var_binary(offsets, memoryview(data), True)


@pytest.mark.parametrize("simd_mode", SIMD_MODES, indirect=True)
def test_invalid_utf8_after_ascii_groups_is_reported_at_its_position(simd_mode):
    values = [b"user-1234567"] * 40 + [b"ab\xc3\x28"] + [b"ok"] * 7
    offsets = np.cumsum([0] + [len(v) for v in values]).astype(np.int32)
    from keygroups._native import hashing

    with pytest.raises(ValueError, match="string at position 40 is not valid UTF-8"):
        hashing.java_hashes_var_binary(offsets, memoryview(b"".join(values)), True, 128)


# ---- int64 keys and Java hashes to key groups: sixteen at a time (AVX-512, AVX2) and the scalar loop ----------------

# Around the folds and the sign rule: Long's two halves, Integer.MIN_VALUE, and keys whose Java hash is the one int
# whose murmur hash is Integer.MIN_VALUE (Flink maps it to key group 0).
_INT64_EDGES = [0, 1, -1, 2**31 - 1, -(2**31), 2**31, 2**32 - 1, 2**32, 2**63 - 1, -(2**63), 2**32 - 2089875627,
                -2089875627, 0x0000000180000000, -0x7FFFFFFF7FFFFFFF]
_INT32_EDGES = [0, 1, -1, 2**31 - 1, -(2**31), -2089875627, 32767, 32768, -32768]
int64s = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from(_INT64_EDGES))
int32s_and_edges = st.one_of(int32s, st.sampled_from(_INT32_EDGES))


@pytest.mark.parametrize("simd_mode", SIMD_MODES, indirect=True)
@given(st.lists(int64s, max_size=70), st.sampled_from(MAX_PARALLELISMS), st.integers(0, 17))
@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_int64_kernel_equals_reference_on_every_path(simd_mode, values, mp, offset):
    # Up to four blocks of sixteen, every tail length, and starts that are not vector-aligned.
    expected = np.array([ref.key_group(v, mp) for v in values[offset:]], dtype=np.int16)
    np.testing.assert_array_equal(kg.assign_key_groups(np.array(values, dtype=np.int64)[offset:], mp), expected)


@pytest.mark.parametrize("simd_mode", SIMD_MODES, indirect=True)
@given(st.lists(int32s_and_edges, max_size=70), st.sampled_from(MAX_PARALLELISMS), st.integers(0, 17))
@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_int32_and_hash_kernel_equals_reference_on_every_path(simd_mode, values, mp, offset):
    expected = np.array([ref.key_group(v, mp, "int") for v in values[offset:]], dtype=np.int16)
    np.testing.assert_array_equal(kg.assign_key_groups(np.array(values, dtype=np.int32)[offset:], mp), expected)


@pytest.mark.parametrize("mp", MAX_PARALLELISMS)
def test_vector_kernels_agree_with_the_scalar_loop_on_a_million_keys(mp):
    from keygroups._native import hashing

    rng = np.random.default_rng(mp)
    values = rng.integers(-(2**63), 2**63 - 1, size=1_000_003, dtype=np.int64)
    values[: len(_INT64_EDGES)] = _INT64_EDGES
    hashes = hashing.java_hashes_int64(values)
    previous = hashing._set_simd(0)
    try:
        scalar = (hashing.groups_from_int64(values, mp), hashing.groups_from_hashes(hashes, mp))
        for level in (1, 2):
            hashing._set_simd(level)
            np.testing.assert_array_equal(hashing.groups_from_int64(values, mp), scalar[0])
            np.testing.assert_array_equal(hashing.groups_from_hashes(hashes, mp), scalar[1])
    finally:
        hashing._set_simd(previous)
    np.testing.assert_array_equal(scalar[0], scalar[1])  # Long.hashCode first, or the int64 kernel's own fold
    sample = slice(0, 2000)
    np.testing.assert_array_equal(scalar[0][sample], [ref.key_group(int(v), mp) for v in values[sample]])


# ---- out=: key groups into the caller's buffer ---------------------------------------------------------------------

OUT_KEYS = [
    pytest.param(lambda: np.arange(-500, 537, dtype=np.int64) * 7919, id="numpy-int64"),
    pytest.param(lambda: pa.array(np.arange(1037, dtype=np.int64)), id="arrow-int64"),
    pytest.param(lambda: np.arange(1037, dtype=np.int32), id="numpy-int32"),
    pytest.param(lambda: pa.array([f"user-{i}" for i in range(1037)]), id="arrow-utf8"),
    pytest.param(lambda: pa.array([f"k{i}".encode() for i in range(1037)], pa.large_binary()), id="arrow-binary"),
    pytest.param(lambda: pa.chunked_array([["a", "b"], ["c"]]), id="chunked"),
    pytest.param(lambda: [("a", 1), ("b", 2), ("c", 3)], id="tuples"),
]


@pytest.mark.parametrize("make_keys", OUT_KEYS)
def test_out_receives_the_key_groups_and_is_returned(make_keys):
    keys = make_keys()
    out = np.full(len(keys), -1, dtype=np.int16)
    for mp in (1000, 128):  # one buffer, reused batch after batch
        got = kg.assign_key_groups(keys, mp, out=out)
        assert got is out
        np.testing.assert_array_equal(out, kg.assign_key_groups(keys, mp))


def _read_only(n):
    out = np.empty(n, dtype=np.int16)
    out.flags.writeable = False
    return out


@pytest.mark.parametrize("make_keys", [OUT_KEYS[0], OUT_KEYS[2], OUT_KEYS[3], OUT_KEYS[6]])
@pytest.mark.parametrize(
    "make_out,exc,match",
    [
        (lambda n: np.empty(n, dtype=np.int32), TypeError, "out has dtype int32, but key groups are native int16"),
        (lambda n: np.empty(n, dtype=">i2"), TypeError, "out has dtype >i2"),
        (lambda n: [0] * n, TypeError, "out must be a numpy int16 array, got list"),
        (lambda n: np.empty(n - 1, dtype=np.int16), ValueError, r"out has shape \(\d+,\), but there are \d+ keys"),
        (lambda n: np.empty((1, n), dtype=np.int16), ValueError, r"out has shape \(1, \d+\)"),
        (_read_only, ValueError, "out is read-only"),
        (lambda n: np.empty(2 * n, dtype=np.int16)[::2], ValueError, "out is not contiguous"),
    ],
)
def test_out_that_cannot_hold_the_key_groups_is_refused(make_keys, make_out, exc, match):
    keys = make_keys()
    with pytest.raises(exc, match=match + r".*np\.empty\(\d+, dtype=np\.int16\)"):
        kg.assign_key_groups(keys, 128, out=make_out(len(keys)))


# ---- one Java key type per Arrow type, for arrays and for keyed jobs --------------------------------------------

ARROW_KEY_COLUMNS = [
    pytest.param(pa.array([0, 1, -1, 2**63 - 1, -(2**63)], pa.int64()), "long", id="int64"),
    pytest.param(pa.array([0, 1, -1, 2**31 - 1, -(2**31)], pa.int32()), "int", id="int32"),
    pytest.param(pa.array([0, -1, 32767, -32768], pa.int16()), "short", id="int16"),
    pytest.param(pa.array([0, -1, 127, -128], pa.int8()), "byte", id="int8"),
    pytest.param(pa.array([0, 5, 2**63 - 1], pa.uint64()), "long", id="uint64"),
    pytest.param(pa.array([0, 5, 2**32 - 1, 2**31], pa.uint32()), "long", id="uint32"),
    pytest.param(pa.array([0, 5, 65535], pa.uint16()), "long", id="uint16"),
    pytest.param(pa.array([0, 5, 255], pa.uint8()), "long", id="uint8"),
    pytest.param(pa.array([True, False], pa.bool_()), "boolean", id="bool"),
    pytest.param(pa.array([1.5, -0.0, float("nan"), 1e300], pa.float64()), "double", id="float64"),
    pytest.param(pa.array([1.5, -0.0, float("nan")], pa.float32()), "float", id="float32"),
    pytest.param(pa.array(np.array([1.5, -0.0, 65504], dtype=np.float16)), "float", id="float16"),
    pytest.param(pa.array(["a", "", "ü😀"], pa.string()), "string", id="string"),
    pytest.param(pa.array(["a", "", "ü😀"], pa.large_string()), "string", id="large_string"),
    pytest.param(pa.array(["a", "", "a longer string than twelve"], pa.string_view()), "string", id="string_view"),
    pytest.param(pa.array([b"a", b"", b"\xff"], pa.binary()), "bytes", id="binary"),
    pytest.param(pa.array([b"a", b"", b"\xff"], pa.large_binary()), "bytes", id="large_binary"),
    pytest.param(pa.array([b"a", b"", b"\xff" * 20], pa.binary_view()), "bytes", id="binary_view"),
    pytest.param(pa.array(["b", "a", "b"]).dictionary_encode(), "string", id="dictionary"),
]


@pytest.mark.parametrize("column,java", ARROW_KEY_COLUMNS)
def test_a_column_hashes_alike_in_assign_key_groups_and_in_a_keyed_job(column, java):
    from keygroups._hashing import key_type_code, key_type_for_arrow
    from keygroups._native.statecore import KeyContext
    from keygroups.runtime.backends import key_type_for_schema

    key_type = key_type_for_schema(pa.schema([("k", column.type)]), ("k",))
    assert key_type == key_type_for_arrow(column.type) == java
    groups = kg.assign_key_groups(column, 1000)
    np.testing.assert_array_equal(kg.assign_key_groups(column, 1000, key_type), groups)
    np.testing.assert_array_equal(kg.assign_key_groups(pa.chunked_array([column]), 1000, key_type), groups)
    # A keyed job's backend hashes each record's key, as a Python value, under the key type of its schema.
    context = KeyContext(kg.KeyGroupRange(0, 999), 1000, key_type_code(key_type))
    for value, group in zip(column.to_pylist(), groups):
        context.set_current_key(value)
        assert context.kgi == group


def test_unsigned_keys_past_long_are_refused_alike():
    from keygroups._hashing import key_type_code
    from keygroups._native.statecore import KeyContext

    column = pa.array([1, 2**64 - 1], pa.uint64())
    with pytest.raises(ValueError, match="outside the 64-bit range of java.lang.Long"):
        kg.assign_key_groups(column, 128)
    context = KeyContext(kg.KeyGroupRange(0, 127), 128, key_type_code("long"))
    with pytest.raises(ValueError, match="outside the 64-bit range of java.lang.Long"):
        context.set_current_key(2**64 - 1)


@pytest.mark.parametrize(
    "column",
    [
        pytest.param(pa.array([0, 1], pa.date32()), id="date32"),
        pytest.param(pa.array([0, 1], pa.timestamp("ms")), id="timestamp"),
        pytest.param(pa.array([0, 1], pa.time32("s")), id="time32"),
        pytest.param(pa.array([1, 2], pa.decimal128(10, 2)), id="decimal"),
        pytest.param(pa.array([[1]], pa.list_(pa.int64())), id="list"),
    ],
)
def test_types_without_a_java_key_type_are_refused_alike(column):
    from keygroups.runtime.backends import key_type_for_schema

    match = re.escape(f"unsupported Arrow key type {column.type}: it has no Java key type") + ".*Cast the column"
    with pytest.raises(TypeError, match=match):
        kg.assign_key_groups(column, 128)
    with pytest.raises(TypeError, match="key column 'k': " + match):
        key_type_for_schema(pa.schema([("k", column.type)]), ("k",))


@given(st.lists(st.binary(max_size=40), max_size=40), st.sampled_from(MAX_PARALLELISMS), st.integers(0, 5))
@settings(max_examples=200)
def test_vectorized_binary_equals_reference(values, mp, offset):
    expected = np.array([ref.key_group(v, mp) for v in values[offset:]], dtype=np.int16)
    for arr in (pa.array(values, pa.binary()), pa.array(values, pa.large_binary()), pa.array(values, pa.binary_view())):
        np.testing.assert_array_equal(kg.assign_key_groups(arr.slice(offset), mp), expected)


@given(st.lists(st.floats(allow_nan=True), max_size=40), st.sampled_from(MAX_PARALLELISMS))
@settings(max_examples=200)
def test_vectorized_floats_equal_reference(values, mp):
    expected = np.array([ref.key_group(v, mp) for v in values], dtype=np.int16)
    np.testing.assert_array_equal(kg.assign_key_groups(np.array(values, dtype=np.float64), mp), expected)
    np.testing.assert_array_equal(kg.assign_key_groups(pa.array(values, pa.float64()), mp), expected)
    with np.errstate(over="ignore"):
        f32 = np.array(values, dtype=np.float32)
    expected32 = np.array([ref.murmur_hash(ref.float_hash(float(v))) % mp for v in f32], dtype=np.int16)
    np.testing.assert_array_equal(kg.assign_key_groups(f32, mp), expected32)


def test_nan_is_canonical_and_signed_zeros_differ():
    other_nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000123))[0]
    assert math.isnan(other_nan)
    assert kg.java_hash(other_nan) == kg.java_hash(float("nan")) == 2146959360
    assert kg.java_hash(-0.0) == -(2**31) and kg.java_hash(0.0) == 0


@pytest.mark.parametrize(
    "dtype,key_type,java",
    [(np.int8, None, "byte"), (np.int16, None, "short"), (np.int32, None, "int"), (np.int64, None, "long"),
     (np.uint8, None, "long"), (np.uint16, None, "long"), (np.uint32, None, "long"), (np.uint64, None, "long"),
     (np.int64, "int", "int"), (np.int32, "long", "long")],
)
@pytest.mark.parametrize("writable", [True, False])
def test_integer_dtypes_and_read_only_buffers(dtype, key_type, java, writable):
    info = np.iinfo(dtype)
    top = min(int(info.max), 2**63 - 1)  # uint64 values past Long's range are refused (tested below)
    values = np.array([0, 1, top, info.min, 7, top // 3], dtype=dtype)
    if key_type == "int":
        values = values.clip(-(2**31), 2**31 - 1)
    values.flags.writeable = writable
    ref_type = None if java == "long" else "int"
    expected = np.array([ref.key_group(int(v), 4096, ref_type) for v in values], dtype=np.int16)
    np.testing.assert_array_equal(kg.assign_key_groups(values, 4096, key_type), expected)
    scalars = [kg.assign_to_key_group(v, 4096, key_type) for v in values]  # numpy scalars map to Java types too
    np.testing.assert_array_equal(scalars, expected)


@pytest.mark.parametrize("writable", [True, False])
def test_read_only_string_float_bool_arrays(writable):
    arrays = [np.array(["a", "user-1", "ü😀"]), np.array([1.5, -0.0, np.nan]), np.array([True, False]),
              np.array([b"ab", b"\xff"], dtype="S")]
    for arr in arrays:
        arr.flags.writeable = writable
        np.testing.assert_array_equal(kg.assign_key_groups(arr, 128), [kg.assign_to_key_group(k, 128) for k in arr.tolist()])


def test_read_only_arrow_buffer_from_ipc_file(tmp_path):
    # Arrow arrays read from a memory-mapped IPC file point into read-only mapped memory.
    path = tmp_path / "keys.arrow"
    table = pa.table({"k": pa.array([f"user-{i}" for i in range(1000)]), "n": pa.array(range(1000), pa.int64())})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pa.memory_map(str(path)) as source:
        loaded = pa.ipc.open_file(source).read_all()
        got_s = kg.assign_key_groups(loaded.column("k"), 128)
        got_n = kg.assign_key_groups(loaded.column("n"), 128)
    np.testing.assert_array_equal(got_s, [ref.key_group(f"user-{i}", 128) for i in range(1000)])
    np.testing.assert_array_equal(got_n, [ref.key_group(i, 128) for i in range(1000)])


def test_assign_operators_matches_ranges():
    keys = np.arange(-5000, 5000, dtype=np.int64)
    ops = kg.assign_operators(keys, 128, 7)
    groups = kg.assign_key_groups(keys, 128)
    for op, group in zip(ops, groups):
        assert int(group) in kg.key_group_range(128, 7, int(op))
    assert kg.assign_to_operator("user-1", 128, 7) == kg.operator_index_for_key_group(128, 7, kg.assign_to_key_group("user-1", 128))


# ---- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: kg.java_hash(None), ValueError, "must not be None"),
        (lambda: kg.assign_to_key_group(None, 128), ValueError, "must not be None"),
        (lambda: kg.assign_key_groups(["a", None, "b"], 128), ValueError, "position 1"),
        (lambda: kg.assign_key_groups(np.array([1, None], dtype=object), 128), ValueError, "position 1"),
        (lambda: kg.assign_key_groups(pa.array(["a", "b", None]), 128), ValueError, "position 2 is null"),
        (lambda: kg.assign_key_groups(pa.chunked_array([["a"], ["b", None]]), 128), ValueError, "position 2 is null"),
        (lambda: kg.java_hash(object()), TypeError, "unsupported key type builtins.object.*supported"),
        (lambda: kg.java_hash([1, 2]), TypeError, "unsupported key type builtins.list"),
        (lambda: kg.assign_key_groups(np.array([1 + 2j]), 128), TypeError, "unsupported key array dtype complex128"),
        (lambda: kg.assign_key_groups(pa.array([[1]]), 128), TypeError, "unsupported Arrow key type list"),
        (lambda: kg.assign_to_key_group(1, 0), ValueError, r"max_parallelism must be in \[1, 32768\].*got 0"),
        (lambda: kg.assign_to_key_group(1, 32769), ValueError, r"max_parallelism must be in \[1, 32768\].*got 32769"),
        (lambda: kg.assign_key_groups([1], 40000), ValueError, "max_parallelism"),
        (lambda: kg.key_group_range(128, 129, 0), ValueError, r"parallelism must be in \[1, max_parallelism=128\]"),
        (lambda: kg.key_group_range(128, 0, 0), ValueError, "parallelism must be in"),
        (lambda: kg.key_group_range(128, 4, 4), ValueError, r"operator_index must be in \[0, parallelism=4\), got 4"),
        (lambda: kg.operator_index_for_key_group(128, 4, 128), ValueError, r"key_group must be in \[0, max_parallelism=128\)"),
        (lambda: kg.operator_index_for_key_group(128, 4, np.array([0, -1])), ValueError, "position 1"),
        (lambda: kg.operator_index_for_key_group(128, 4, np.array([200, -1])), ValueError, r"position 0 .*got 200$"),
        (lambda: kg.java_hash(2**63), ValueError, "outside the 64-bit range"),
        (lambda: kg.java_hash(-(2**63) - 1), ValueError, "outside the 64-bit range"),
        (lambda: kg.assign_key_groups(np.array([2**64 - 1], dtype=np.uint64), 128), ValueError, "outside the 64-bit"),
        (lambda: kg.java_hash(2**31, "int"), ValueError, r"does not fit key_type int.*\[-2147483648, 2147483647\]"),
        (lambda: kg.assign_key_groups(np.array([0, 2**40]), 128, "int"), ValueError, "position 1"),
        (lambda: kg.java_hash("x", "long"), TypeError, "not an integer"),
        (lambda: kg.java_hash(1, "varchar"), ValueError, "unknown key_type 'varchar'"),
        (lambda: kg.java_hash((1, 2), ("long",)), TypeError, "2-tuple"),
        (lambda: kg.java_hash(()), ValueError, "at least one field"),
        (lambda: kg.murmur_hash(2**31), ValueError, "signed 32-bit"),
        (lambda: kg.assign_key_groups("abc", 128), TypeError, "single str"),
        (lambda: kg.assign_key_groups(np.zeros((2, 2)), 128), ValueError, "1-D"),
        (lambda: kg.KeyGroupRange(-1, 3), ValueError, "start=-1"),
        (lambda: kg.KeyGroupRange(5, 2), ValueError, "start <= end"),
        (lambda: kg.default_max_parallelism(0), ValueError, "parallelism must be in"),
    ],
)
def test_bad_input_names_the_value_and_what_is_allowed(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_invalid_utf8_in_arrow_strings_is_an_error_not_a_crash():
    arr = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(np.array([0, 1, 3], np.int32).tobytes()),
                                                 pa.py_buffer(b"a\xc3\x28")])
    with pytest.raises(ValueError, match="position 1 is not valid UTF-8"):
        kg.assign_key_groups(arr, 128)


def test_offsets_past_the_data_buffer_are_refused_by_the_kernel():
    # pyarrow itself refuses to build such an array, so the compiled kernel is called with the raw buffers.
    from keygroups._native import hashing

    data = memoryview(b"abc")
    for width in (np.int32, np.int64):
        for offsets in ([0, 1, 500], [0, 2, 1], [-1, 0]):
            with pytest.raises(ValueError, match="outside its 3-byte data buffer"):
                hashing.java_hashes_var_binary(np.array(offsets, width), data, False)
    with pytest.raises(ValueError, match="points past its data buffer"):
        view = struct.pack("<iiii", 20, 0x61616161, 0, 0)
        hashing.java_hashes_binary_view(memoryview(view), [b"short"], True)
    with pytest.raises(ValueError, match="data buffer 3 of 1"):
        hashing.java_hashes_binary_view(memoryview(struct.pack("<iiii", 20, 0, 3, 0)), [b"x" * 40], True)


# ---- KeyGroupRange ----------------------------------------------------------------------------------------------

def test_key_group_range_behaves_like_flinks():
    r = kg.KeyGroupRange(3, 7)
    assert len(r) == 5 and list(r) == [3, 4, 5, 6, 7]
    assert 3 in r and 7 in r and 8 not in r and "3" not in r
    assert r.intersection(kg.KeyGroupRange(6, 10)) == kg.KeyGroupRange(6, 7)
    assert r.intersection(kg.KeyGroupRange(8, 10)) == kg.KeyGroupRange.empty()
    empty = kg.KeyGroupRange.empty()
    assert len(empty) == 0 and not empty and list(empty) == [] and kg.KeyGroupRange(4, 3) == empty
    assert hash(kg.KeyGroupRange(3, 7)) == hash(r) and {r: 1}[kg.KeyGroupRange(3, 7)] == 1
    assert repr(r) == "KeyGroupRange(3, 7)" and repr(empty) == "KeyGroupRange.empty()"
    import pickle

    assert pickle.loads(pickle.dumps(r)) == r


@given(st.lists(st.tuples(st.text(max_size=8), st.integers(-(2**63), 2**63 - 1), st.booleans()), max_size=30),
       st.sampled_from(MAX_PARALLELISMS))
@settings(max_examples=200)
def test_tuple_columns_equal_tuple_keys(rows, mp):
    columns = [pa.array([r[0] for r in rows], pa.string()), np.array([r[1] for r in rows], dtype=np.int64),
               [r[2] for r in rows]]
    expected = np.array([ref.key_group(r, mp) for r in rows], dtype=np.int16)
    if rows:
        np.testing.assert_array_equal(kg.assign_key_groups_for_tuples(columns, mp), expected)
        np.testing.assert_array_equal(kg.assign_key_groups_for_tuples(columns, mp, ("string", "long", "boolean")),
                                      expected)


def test_tuple_columns_must_agree():
    with pytest.raises(ValueError, match="differ in length"):
        kg.tuple_java_hashes([np.arange(3), np.arange(4)])
    with pytest.raises(TypeError, match="tuple of 2 key types"):
        kg.tuple_java_hashes([np.arange(3), np.arange(3)], "long")
