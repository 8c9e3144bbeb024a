# Java hashCode() and Flink key-group assignment, compiled.
#
# The def functions take typed, const memoryviews (so read-only Arrow and mmap buffers are accepted), check what the
# C kernels cannot, and hand raw pointers inward; the loops run without the GIL.
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.tuple cimport PyTuple_GET_SIZE, PyTuple_GET_ITEM
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint32_t

import numpy as np

from javahash cimport (
    KG_BOOLEAN_FALSE_HASH,
    KG_BOOLEAN_TRUE_HASH,
    KG_UPPER_BOUND_MAX_PARALLELISM,
    hash_str as _hash_str,
    kg_hash_bytes,
    kg_hash_double,
    kg_hash_float,
    kg_hash_long,
    kg_hash_ucs4,
    kg_hash_utf8,
    kg_key_group,
    kg_murmur,
)

cdef extern from "kg_hash.h" nogil:
    void kg_groups_from_int64(const int64_t *values, Py_ssize_t n, int32_t maxp, int16_t *out)
    void kg_groups_from_hashes(const int32_t *hashes, Py_ssize_t n, int32_t maxp, int16_t *out)
    Py_ssize_t kg_hashes_var_binary32(const int32_t *offsets, Py_ssize_t n, const uint8_t *data, int64_t data_len,
                                      int utf8, int32_t *out, int *status)
    Py_ssize_t kg_hashes_var_binary64(const int64_t *offsets, Py_ssize_t n, const uint8_t *data, int64_t data_len,
                                      int utf8, int32_t *out, int *status)
    Py_ssize_t kg_hashes_var_binary32_groups(const int32_t *offsets, Py_ssize_t n, const uint8_t *data,
                                             int64_t data_len, int utf8, int32_t maxp, int16_t *out, int *status)
    Py_ssize_t kg_hashes_var_binary64_groups(const int64_t *offsets, Py_ssize_t n, const uint8_t *data,
                                             int64_t data_len, int utf8, int32_t maxp, int16_t *out, int *status)
    void kg_operators_from_groups(const int16_t *groups, Py_ssize_t n, int32_t maxp, int32_t parallelism,
                                  int32_t *out)
    int kg_simd_allowed
    int kg_simd_available()

# The key type codes (KeyTypeCode, declared in hashing.pxd) under Python names; keygroups._hashing maps the public
# names ("long", "int", ...) onto them.
KEY_TYPE_AUTO = KT_AUTO
KEY_TYPE_LONG = KT_LONG
KEY_TYPE_INT = KT_INT
KEY_TYPE_SHORT = KT_SHORT
KEY_TYPE_BYTE = KT_BYTE
KEY_TYPE_BOOLEAN = KT_BOOLEAN
KEY_TYPE_DOUBLE = KT_DOUBLE
KEY_TYPE_FLOAT = KT_FLOAT
KEY_TYPE_STRING = KT_STRING
KEY_TYPE_BYTES = KT_BYTES

#: Flink's upper bound for max parallelism (2^15), from kg_hash.h.
UPPER_BOUND_MAX_PARALLELISM = KG_UPPER_BOUND_MAX_PARALLELISM

SUPPORTED_KEY_TYPES = (
    "int (java.lang.Long), bool (Boolean), float (Double), str (String), bytes (byte[]), tuple (Flink TupleN), "
    "numpy integer/float/bool scalars"
)

cdef object _np_integer = np.integer
cdef object _np_signedinteger = np.signedinteger
cdef object _np_floating = np.floating
cdef object _np_bool = np.bool_
cdef object _np_float32 = np.float32
cdef object _np_float16 = np.float16


cdef inline int64_t _as_int64(object value) except? -1:
    cdef int overflow = 0
    cdef long long v = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow:
        raise ValueError(
            f"key {value!r} is outside the 64-bit range of java.lang.Long [-2**63, 2**63 - 1]; "
            "use a str or bytes key for larger integers")
    return v


cdef inline int32_t _hash_bytes_like(object value) except? -1:
    cdef const uint8_t[::1] view
    if type(value) is bytes:
        return kg_hash_bytes(<const uint8_t *>PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))
    view = memoryview(value).cast("B")
    if view.shape[0] == 0:
        return 1
    return kg_hash_bytes(&view[0], view.shape[0])


cdef int _check_int_range(object value, int64_t v, int kt) except -1:
    cdef int64_t lo, hi
    cdef str name
    if kt == KT_INT:
        lo, hi, name = -2147483648, 2147483647, "int (java.lang.Integer)"
    elif kt == KT_SHORT:
        lo, hi, name = -32768, 32767, "short (java.lang.Short)"
    else:
        lo, hi, name = -128, 127, "byte (java.lang.Byte)"
    if v < lo or v > hi:
        raise ValueError(f"key {value!r} does not fit key_type {name}: allowed range is [{lo}, {hi}]")
    return 0


cdef int32_t _hash_typed(object value, int kt) except? -1:
    """The hash of value as the Java type kt (never KT_AUTO)."""
    cdef int64_t v
    if value is None:
        raise ValueError("a key must not be None (Flink refuses null keys)")
    if kt == KT_LONG or kt == KT_INT or kt == KT_SHORT or kt == KT_BYTE:
        if isinstance(value, bool) or isinstance(value, _np_bool) or not (
                isinstance(value, int) or isinstance(value, _np_integer)):
            raise TypeError(f"key {value!r} of type {type(value).__name__} is not an integer, as its key type needs")
        v = _as_int64(int(value))
        if kt == KT_LONG:
            return kg_hash_long(v)
        _check_int_range(value, v, kt)
        return <int32_t>v
    if kt == KT_BOOLEAN:
        if not (isinstance(value, bool) or isinstance(value, _np_bool)):
            raise TypeError(f"key {value!r} of type {type(value).__name__} is not a bool, as key_type 'boolean' needs")
        return KG_BOOLEAN_TRUE_HASH if value else KG_BOOLEAN_FALSE_HASH
    if kt == KT_DOUBLE or kt == KT_FLOAT:
        if isinstance(value, bool) or isinstance(value, _np_bool) or not (
                isinstance(value, (int, float)) or isinstance(value, _np_integer) or isinstance(value, _np_floating)):
            raise TypeError(f"key {value!r} of type {type(value).__name__} is not a real number, as its key type needs")
        if kt == KT_DOUBLE:
            return kg_hash_double(<double>float(value))
        return kg_hash_float(<float>float(value))
    if kt == KT_STRING:
        if not isinstance(value, str):
            raise TypeError(f"key {value!r} of type {type(value).__name__} is not a str, as key_type 'string' needs")
        return _hash_str(value)
    if kt == KT_BYTES:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"key {value!r} of type {type(value).__name__} is not bytes, as key_type 'bytes' needs")
        return _hash_bytes_like(value)
    raise ValueError(f"unknown key type code {kt}")


cdef int32_t _hash_tuple(tuple value, object key_type) except? -1:
    cdef Py_ssize_t n = PyTuple_GET_SIZE(value)
    cdef Py_ssize_t i
    cdef uint32_t h = 0
    if n == 0:
        raise ValueError("a tuple key must have at least one field (Flink's Tuple1 .. Tuple25)")
    if key_type is not None and (type(key_type) is not tuple or len(<tuple>key_type) != n):
        raise TypeError(f"key {value!r} is a {n}-tuple, so key_type must be a {n}-tuple of key types, "
                        f"not {key_type!r}")
    for i in range(n):
        # Flink's TupleN.hashCode: h = f0.hashCode(); h = 31 * h + fi.hashCode()
        h = h * 31u + <uint32_t>java_hash_object(<object>PyTuple_GET_ITEM(value, i),
                                                 None if key_type is None else (<tuple>key_type)[i])
    return <int32_t>h


cpdef int32_t java_hash_object(object value, object key_type=None) except? -1:
    """The Java hashCode() Flink would see for value; key_type is None, a key type code or a tuple of them."""
    cdef type t = type(value)
    if key_type is not None and type(key_type) is not tuple and key_type != KT_AUTO:
        if t is tuple:
            raise TypeError(f"key {value!r} is a tuple, so key_type must be a tuple of key types, not a single one")
        return _hash_typed(value, key_type)
    if t is tuple:
        return _hash_tuple(value, key_type)
    if key_type is not None and type(key_type) is tuple:
        raise TypeError(f"key_type {key_type!r} is a tuple, but key {value!r} is not")
    # The common exact types first; subclasses and numpy scalars after.
    if t is int:
        return kg_hash_long(_as_int64(value))
    if t is str:
        return _hash_str(value)
    if t is bool:
        return KG_BOOLEAN_TRUE_HASH if value else KG_BOOLEAN_FALSE_HASH
    if t is float:
        return kg_hash_double(value)
    if t is bytes:
        return kg_hash_bytes(<const uint8_t *>PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))
    if value is None:
        raise ValueError("a key must not be None (Flink refuses null keys)")
    if isinstance(value, _np_bool):
        return KG_BOOLEAN_TRUE_HASH if value else KG_BOOLEAN_FALSE_HASH
    if isinstance(value, _np_integer):
        if isinstance(value, _np_signedinteger):
            size = value.dtype.itemsize
            if size == 4 or size == 2 or size == 1:   # Integer, Short, Byte: hashCode() is the value
                return <int32_t>int(value)
        return kg_hash_long(_as_int64(int(value)))   # int64 -> Long; unsigned values hash as Python ints do
    if isinstance(value, _np_float32) or isinstance(value, _np_float16):
        return kg_hash_float(<float>float(value))
    if isinstance(value, bool):
        return KG_BOOLEAN_TRUE_HASH if value else KG_BOOLEAN_FALSE_HASH
    if isinstance(value, int):
        return kg_hash_long(_as_int64(int(value)))
    if isinstance(value, float):
        return kg_hash_double(float(value))
    if isinstance(value, str):
        return _hash_str(value)
    if isinstance(value, (bytes, bytearray)):
        return _hash_bytes_like(value)
    if isinstance(value, tuple):
        return _hash_tuple(tuple(value), key_type)
    raise TypeError(f"unsupported key type {t.__module__}.{t.__qualname__} for key {value!r}; "
                    f"supported: {SUPPORTED_KEY_TYPES}")


def murmur_hash(int32_t code):
    """Flink's MathUtils.murmurHash(int): non-negative."""
    return kg_murmur(code)


def key_group_for_hash(int32_t java_hash, int32_t max_parallelism):
    return kg_key_group(java_hash, max_parallelism, 1.0 / max_parallelism)


def java_hashes_objects(object keys, object key_type=None):
    """Java hashes of a sequence of Python keys; errors name the position of the offending key."""
    cdef Py_ssize_t n = len(keys), i = 0
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    try:
        for i in range(n):
            o[i] = java_hash_object(keys[i], key_type)
    except (ValueError, TypeError) as e:
        raise type(e)(f"key at position {i}: {e}") from None
    return out


cdef object _groups_out(object out, Py_ssize_t n):
    """``out`` once checked as room for n int16 key groups, or a new array when it is None."""
    if out is None:
        return np.empty(n, dtype=np.int16)
    fix = f"pass np.empty({n}, dtype=np.int16) (and reuse it for every batch of {n} keys)"
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy int16 array, got {type(out).__name__}; {fix}")
    if out.dtype != np.int16:
        raise TypeError(f"out has dtype {out.dtype}, but key groups are native int16; {fix}")
    if out.ndim != 1 or out.shape[0] != n:
        raise ValueError(f"out has shape {out.shape}, but there are {n} keys: it needs shape ({n},); {fix}")
    if not out.flags.writeable:
        raise ValueError(f"out is read-only; {fix}")
    if not out.flags.c_contiguous:
        raise ValueError(f"out is not contiguous (a strided view, such as a[::2]); {fix}")
    return out


def groups_from_int64(const int64_t[::1] values, int32_t max_parallelism, out=None):
    """Key groups of int64 keys hashed as java.lang.Long, into ``out`` (checked) or a new int16 array."""
    cdef Py_ssize_t n = values.shape[0]
    out = _groups_out(out, n)
    cdef int16_t[::1] o = out
    if n:
        with nogil:
            kg_groups_from_int64(&values[0], n, max_parallelism, &o[0])
    return out


def groups_from_hashes(const int32_t[::1] hashes, int32_t max_parallelism, out=None):
    """Key groups from Java hashes (also the hashes of Integer, Short and Byte keys, which are their values), into
    ``out`` (checked) or a new int16 array."""
    cdef Py_ssize_t n = hashes.shape[0]
    out = _groups_out(out, n)
    cdef int16_t[::1] o = out
    if n:
        with nogil:
            kg_groups_from_hashes(&hashes[0], n, max_parallelism, &o[0])
    return out


def operators_from_groups(const int16_t[::1] groups, int32_t max_parallelism, int32_t parallelism):
    cdef Py_ssize_t n = groups.shape[0]
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    if n:
        with nogil:
            kg_operators_from_groups(&groups[0], n, max_parallelism, parallelism, &o[0])
    return out


def java_hashes_int64(const int64_t[::1] values):
    cdef Py_ssize_t n = values.shape[0], i
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    with nogil:
        for i in range(n):
            o[i] = kg_hash_long(values[i])
    return out


def java_hashes_float64(const double[::1] values):
    cdef Py_ssize_t n = values.shape[0], i
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    with nogil:
        for i in range(n):
            o[i] = kg_hash_double(values[i])
    return out


def java_hashes_float32(const float[::1] values):
    cdef Py_ssize_t n = values.shape[0], i
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    with nogil:
        for i in range(n):
            o[i] = kg_hash_float(values[i])
    return out


def java_hashes_bool(const uint8_t[::1] values):
    cdef Py_ssize_t n = values.shape[0], i
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    with nogil:
        for i in range(n):
            o[i] = KG_BOOLEAN_TRUE_HASH if values[i] else KG_BOOLEAN_FALSE_HASH
    return out


def _set_simd(int level):
    """Cap the vector path (Arrow strings; int64 keys and Java hashes to key groups): 2 allows AVX-512 (the
    default), 1 AVX2 at most, 0 none. Returns the previous cap. For tests, which check each narrower path against
    the others on a CPU that has the widest."""
    global kg_simd_allowed
    if level < 0 or level > 2:
        raise ValueError(f"vector level is 0 (none), 1 (AVX2) or 2 (AVX-512), got {level}")
    previous = kg_simd_allowed
    kg_simd_allowed = level
    return previous


def _simd_active():
    """The vector path the kernels take on this CPU now: 2 AVX-512, 1 AVX2, 0 none (scalar)."""
    return kg_simd_available()


ctypedef fused offset_t:
    int32_t
    int64_t


def java_hashes_var_binary(const offset_t[::1] offsets, const uint8_t[::1] data, bint utf8,
                           int32_t max_parallelism=0, out=None):
    """Hashes of n = len(offsets) - 1 variable-length values laid out as Arrow's (large_)utf8 and (large_)binary:
    value i is data[offsets[i]:offsets[i + 1]]. utf8 values hash as java.lang.String, others as byte[]. With
    max_parallelism > 0, the int16 key groups come back instead of the int32 hashes (one fused pass), written into
    ``out`` when it is given."""
    if offsets.shape[0] == 0:
        raise ValueError("an Arrow offsets buffer holds at least one offset")
    cdef Py_ssize_t n = offsets.shape[0] - 1, bad = -1
    cdef Py_ssize_t data_len = data.shape[0]
    cdef const uint8_t *base = &data[0] if data_len else <const uint8_t *>b""
    cdef int status = 0
    cdef bint fused = max_parallelism > 0
    if out is not None and not fused:
        raise ValueError("out holds key groups: pass it together with max_parallelism > 0")
    out = _groups_out(out, n) if fused else np.empty(n, dtype=np.int32)
    cdef int32_t[::1] hashes
    cdef int16_t[::1] groups
    if n == 0:
        return out
    if fused:
        groups = out
    else:
        hashes = out
    with nogil:
        if offset_t is int32_t:
            if fused:
                bad = kg_hashes_var_binary32_groups(&offsets[0], n, base, data_len, utf8, max_parallelism,
                                                    &groups[0], &status)
            else:
                bad = kg_hashes_var_binary32(&offsets[0], n, base, data_len, utf8, &hashes[0], &status)
        else:
            if fused:
                bad = kg_hashes_var_binary64_groups(&offsets[0], n, base, data_len, utf8, max_parallelism,
                                                    &groups[0], &status)
            else:
                bad = kg_hashes_var_binary64(&offsets[0], n, base, data_len, utf8, &hashes[0], &status)
    if bad >= 0:
        if status == 2:
            raise ValueError(f"string at position {bad} is not valid UTF-8")
        raise ValueError(f"value at position {bad} has offsets [{offsets[bad]}, {offsets[bad + 1]}) outside its "
                         f"{data_len}-byte data buffer: the Arrow array is corrupt")
    return out


def java_hashes_binary_view(const uint8_t[::1] views, list data_buffers, bint utf8):
    """Hashes of Arrow string_view / binary_view values: 16-byte views (length, then 12 inline bytes, or a 4-byte
    prefix, a buffer index and an offset), each checked against the buffers it points into."""
    cdef Py_ssize_t n = views.shape[0] // 16, i, nbuf = len(data_buffers)
    cdef int32_t length, buf_index, offset
    cdef const uint8_t[::1] buf
    cdef const uint8_t *p
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    cdef list bufs = [memoryview(b).cast("B") for b in data_buffers]
    for i in range(n):
        p = &views[i * 16]
        length = (<const int32_t *>p)[0]
        if length < 0:
            raise ValueError(f"view at position {i} has negative length {length}: the Arrow array is corrupt")
        if length <= 12:
            p = p + 4
        else:
            buf_index = (<const int32_t *>p)[2]
            offset = (<const int32_t *>p)[3]
            if buf_index < 0 or buf_index >= nbuf:
                raise ValueError(f"view at position {i} points to data buffer {buf_index} of {nbuf}: "
                                 "the Arrow array is corrupt")
            buf = bufs[buf_index]
            if offset < 0 or <Py_ssize_t>offset + length > buf.shape[0]:
                raise ValueError(f"view at position {i} points past its data buffer: the Arrow array is corrupt")
            p = &buf[offset]
        if utf8:
            if kg_hash_utf8(p, length, &o[i]) != 0:
                raise ValueError(f"string at position {i} is not valid UTF-8")
        else:
            o[i] = kg_hash_bytes(p, length)
    return out


def java_hashes_ucs4(const uint32_t[:, ::1] chars):
    """Hashes of a numpy 'U' array viewed as (n, width) code points; trailing NULs are padding, as numpy treats them."""
    cdef Py_ssize_t n = chars.shape[0], width = chars.shape[1], i, length
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    with nogil:
        for i in range(n):
            length = width
            while length > 0 and chars[i, length - 1] == 0:
                length -= 1
            o[i] = kg_hash_ucs4(&chars[i, 0], length) if length else 0
    return out


def java_hashes_fixed_bytes(const uint8_t[:, ::1] data):
    """Hashes of a numpy 'S' array viewed as (n, width) bytes; trailing NULs are padding, as numpy treats them."""
    cdef Py_ssize_t n = data.shape[0], width = data.shape[1], i, length
    out = np.empty(n, dtype=np.int32)
    cdef int32_t[::1] o = out
    with nogil:
        for i in range(n):
            length = width
            while length > 0 and data[i, length - 1] == 0:
                length -= 1
            o[i] = kg_hash_bytes(&data[i, 0], length) if length else 1
    return out


def combine_tuple_hashes(int32_t[::1] acc, const int32_t[::1] field_hashes):
    """acc = 31 * acc + field_hashes, in place: folds one more field into Flink TupleN hashes."""
    cdef Py_ssize_t n = acc.shape[0], i
    if field_hashes.shape[0] != n:
        raise ValueError(f"tuple fields differ in length: {n} and {field_hashes.shape[0]}")
    with nogil:
        for i in range(n):
            acc[i] = <int32_t>(<uint32_t>acc[i] * 31u + <uint32_t>field_hashes[i])
