# The serializer codecs, compiled.
#
# A Codec is a small tree that mirrors a typed serializer (Int64, Str, Nullable, Tuple, List, Map, ...) or is the
# self-describing ValueSerializer format. Encoding writes through writer.pxd (a growable buffer that starts on the C
# stack); decoding reads ONLY through the checked cursor of cursor.pxd, so truncated or corrupt bytes raise
# CorruptSnapshotError instead of reading past the end, every count is checked against the bytes that remain before
# anything is allocated, and nesting is capped so hostile input cannot exhaust the C stack.
#
# This file holds the constants, the read helpers and map sorting; the two formats are included at the end.
#
# Wire format (little-endian; lengths and counts are u32):
#   int64 8 bytes | int32 4 | float64 8 (NaN canonical) | bool 1 byte 0/1
#   str  u32 length + UTF-8 | bytes u32 length + bytes   (at top level: the raw bytes, the frame gives the length)
#   nullable: 0 (None) or 1 + inner | tuple: the fields in order | list: u32 count + elements
#   map: u32 count + (key, value) pairs sorted by the key's bytes (deterministic whatever the insertion order)
#   external (a Python serializer nested in a compiled one): u32 length + its bytes
#   value (ValueSerializer): a tag byte, then the payload (see the T_* tags below)
import operator
import sys

cimport cython

import numpy as np

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytes cimport (PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_FromStringAndSize, PyBytes_CheckExact,
                            PyBytes_Check)
from cpython.float cimport PyFloat_AsDouble, PyFloat_FromDouble, PyFloat_Check
from cpython.dict cimport PyDict_Check, PyDict_Copy
from cpython.list cimport PyList_New, PyList_SET_ITEM, PyList_GET_ITEM, PyList_GET_SIZE, PyList_Check
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_FromLongLong, PyLong_Check
from cpython.mem cimport PyMem_Malloc, PyMem_Free
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM, PyTuple_GET_ITEM, PyTuple_GET_SIZE, PyTuple_Check
from cpython.unicode cimport PyUnicode_DecodeUTF8, PyUnicode_Check
from libc.math cimport isnan
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, INT32_MIN, INT32_MAX
from libc.stdlib cimport qsort
from libc.string cimport memcpy, memcmp

from keysearch cimport kg_key_cmp
from cursor cimport (Cursor, cur_init, cur_read, cur_u8, cur_count, cur_corrupt, cur_remaining,
                    cur_i64 as r_i64, cur_i32 as r_i32)
from writer cimport (Writer, w_bytes, w_f64, w_free, w_i64, w_init, w_len, w_reserve, w_result, w_u8, w_u32,
                    short_repr as _short)

cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object s, Py_ssize_t *size) except NULL

if sys.byteorder != "little":   # the formats are little-endian and the cursor reads with memcpy
    raise ImportError("keygroups._native.codec needs a little-endian host")

from keygroups.errors import CorruptSnapshotError

# Codec kinds; keygroups.serializers builds codecs with the Python names below, derived from these.
from libc.math cimport signbit
from keygroups._javakeys import NAN_KEY as _NAN_KEY, NEGATIVE_ZERO_KEY as _NEG_ZERO, NegativeZeroKey as _NegZero


cdef object _map_key(object key):
    """A decoded map key as Java's ``HashMap`` tells keys apart (``Double.equals``): every NaN one key, ``-0.0`` a key
    of its own (see keygroups._javakeys), so a map holding both ``0.0`` and ``-0.0`` decodes whole."""
    cdef double v
    if type(key) is float:
        v = PyFloat_AsDouble(key)
        if isnan(v):
            return _NAN_KEY
        if v == 0.0 and signbit(v):
            return _NEG_ZERO
        return key
    if type(key) is tuple:
        return tuple([_map_key(x) for x in <tuple>key])
    return key


cdef enum CodecKind:
    K_INT64 = 1
    K_INT32 = 2
    K_FLOAT64 = 3
    K_BOOL = 4
    K_STR = 5
    K_BYTES = 6
    K_NULLABLE = 7
    K_TUPLE = 8
    K_LIST = 9
    K_MAP = 10
    K_VALUE = 11
    K_EXTERNAL = 12

INT64 = K_INT64
INT32 = K_INT32
FLOAT64 = K_FLOAT64
BOOL = K_BOOL
STR = K_STR
BYTES = K_BYTES
NULLABLE = K_NULLABLE
TUPLE = K_TUPLE
LIST = K_LIST
MAP = K_MAP
VALUE = K_VALUE
EXTERNAL = K_EXTERNAL

# ValueSerializer tags. Never renumber: they are stored in checkpoints.
cdef enum:
    T_NONE = 0
    T_FALSE = 1
    T_TRUE = 2
    T_INT64 = 3      # 8 bytes
    T_BIGINT = 4     # u32 length + two's complement little-endian, minimal length; only for ints outside int64
    T_FLOAT64 = 5    # 8 bytes
    T_STR = 6        # u32 length + UTF-8
    T_BYTES = 7      # u32 length + bytes
    T_LIST = 8       # u32 count + values
    T_TUPLE = 9      # u32 count + values
    T_DICT = 10      # u32 count + (key, value) pairs sorted by the key's bytes

# Deeper nesting is refused: on encode (ValueError; also catches self-containing lists) and on decode
# (CorruptSnapshotError), so neither can recurse without bound.
cdef enum:
    C_MAX_DEPTH = 100
    SMALL_DICT = 16     # dicts up to this size sort on the C stack, by insertion
    SMALL_TMP = 512
    KEY_CACHE_SIZE = 1024   # a power of two
    KEY_CACHE_MAX_LEN = 40
MAX_DEPTH = C_MAX_DEPTH


cdef object _np_bool = np.bool_
cdef object _np_integer = np.integer
cdef object _np_floating = np.floating
cdef object _index = operator.index

ALLOWED_VALUE_TYPES = "None, bool, int, float, str, bytes (or bytearray/memoryview), list, tuple, dict"


# ---------------------------------------------------------------------------------------------------------------------
# Reading helpers over the checked cursor.

cdef inline double r_f64(Cursor *c) except? -1:
    cdef double v
    memcpy(&v, cur_read(c, 8), 8)
    return v


cdef object utf8_str(const uint8_t *p, Py_ssize_t n):
    try:
        return PyUnicode_DecodeUTF8(<const char *>p, n, NULL)
    except UnicodeDecodeError as e:
        raise CorruptSnapshotError(f"a string of {n} bytes is not valid UTF-8 ({e.reason} at byte {e.start}): "
                                   "the data is truncated or corrupt") from None


cdef inline object r_str(Cursor *c, Py_ssize_t n):
    return utf8_str(cur_read(c, n), n)


# Short dict keys repeat across values (the same field names in a million dicts): decoding returns the str object
# decoded last time for the same bytes, as json's key memo does, which saves an allocation per key and the memory of
# duplicate strings after a restore. Direct-mapped by an FNV-1a hash; protected by the GIL.
cdef list _key_cache = [None] * KEY_CACHE_SIZE


cdef object r_key_str(Cursor *c, Py_ssize_t n):
    cdef const uint8_t *p
    cdef const char *q
    cdef uint32_t h = 2166136261u
    cdef Py_ssize_t i, m, slot
    cdef object s
    if n > KEY_CACHE_MAX_LEN:
        return r_str(c, n)
    p = cur_read(c, n)
    for i in range(n):
        h = (h ^ p[i]) * 16777619u
    slot = h & (KEY_CACHE_SIZE - 1)
    s = <object>PyList_GET_ITEM(_key_cache, slot)
    if s is not None:
        q = PyUnicode_AsUTF8AndSize(s, &m)
        if m == n and memcmp(q, p, n) == 0:
            return s
    s = utf8_str(p, n)
    _key_cache[slot] = s
    return s


cdef inline bytes r_bytes(Cursor *c, Py_ssize_t n):
    return PyBytes_FromStringAndSize(<const char *>cur_read(c, n), n)


# ---------------------------------------------------------------------------------------------------------------------
# Map entries are sorted by their key bytes after encoding, so a dict serializes the same whatever its insertion order.

cdef struct Entry:
    const uint8_t *key
    Py_ssize_t key_len
    Py_ssize_t start
    Py_ssize_t end


cdef int cmp_entry(const void *a, const void *b) noexcept nogil:
    cdef const Entry *x = <const Entry *>a
    cdef const Entry *y = <const Entry *>b
    return kg_key_cmp(x.key, x.key_len, y.key, y.key_len)


cdef inline void insertion_sort(Entry *e, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i, j
    cdef Entry x
    for i in range(1, n):
        x = e[i]
        j = i - 1
        while j >= 0 and cmp_entry(&e[j], &x) > 0:
            e[j + 1] = e[j]
            j -= 1
        e[j + 1] = x


cdef Py_ssize_t sort_entries(uint8_t *buf, Entry *e, Py_ssize_t n, uint8_t *tmp) noexcept nogil:
    """Sorts the n encoded entries of buf[e[0].start:e[n-1].end] by key bytes, in place (tmp: room for them all).
    Returns the index of a duplicated key, or -1."""
    cdef Py_ssize_t i, base, pos, ln
    cdef bint ordered = True
    for i in range(n):
        e[i].key = buf + e[i].start
    for i in range(1, n):
        if cmp_entry(&e[i - 1], &e[i]) >= 0:
            ordered = False
            break
    if ordered:
        return -1
    base = e[0].start
    memcpy(tmp, buf + base, e[n - 1].end - base)
    for i in range(n):
        e[i].key = tmp + (e[i].start - base)
    if n <= SMALL_DICT:
        insertion_sort(e, n)
    else:
        qsort(e, n, sizeof(Entry), cmp_entry)
    pos = base
    for i in range(n):
        if i > 0 and cmp_entry(&e[i - 1], &e[i]) == 0:
            return i
        ln = e[i].end - e[i].start
        memcpy(buf + pos, e[i].key, ln)
        pos += ln
    return -1


cdef int enc_dict(Writer *w, dict d, Codec kc, Codec vc, int depth) except -1:
    """A dict as u32 count + sorted (key, value) pairs; kc/vc None means the ValueSerializer format."""
    cdef Py_ssize_t n = len(d)
    cdef Py_ssize_t i = 0, base, dup
    cdef Entry small[SMALL_DICT]
    cdef uint8_t small_tmp[SMALL_TMP]
    cdef Entry *e = small
    cdef uint8_t *tmp = small_tmp
    w_len(w, n, "a dict size")
    if n == 0:
        return 0
    if n > SMALL_DICT:
        e = <Entry *>PyMem_Malloc(n * sizeof(Entry))
        if e == NULL:
            raise MemoryError()
    try:
        base = w.pos
        for k, v in d.items():   # exact dicts only (see the callers): iterated with PyDict_Next
            if i >= n:
                raise RuntimeError("dictionary changed size during serialization")
            e[i].start = w.pos
            if kc is None:
                enc_value(w, k, depth + 1)
            else:
                enc(kc, w, k, depth + 1)
            e[i].key_len = w.pos - e[i].start
            if vc is None:
                enc_value(w, v, depth + 1)
            else:
                enc(vc, w, v, depth + 1)
            e[i].end = w.pos
            i += 1
        if i != n:
            raise RuntimeError("dictionary changed size during serialization")
        if n > 1:
            if w.pos - base > SMALL_TMP:
                tmp = <uint8_t *>PyMem_Malloc(w.pos - base)
                if tmp == NULL:
                    raise MemoryError()
            dup = sort_entries(w.buf, e, n, tmp)
            if tmp != small_tmp:
                PyMem_Free(tmp)
            if dup >= 0:
                raise ValueError(f"two keys of the dict {_short(d)} serialize to the same bytes (e.g. two float NaN "
                                 "keys), so it cannot be stored deterministically")
    finally:
        if e != small:
            PyMem_Free(e)
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# The rest is assembled here as text (pyarrow's lib.pyx does the same with its .pxi files): one module, one namespace.

# The ValueSerializer format: self-describing values (a tag byte, then the payload).
include "_value_format.pxi"

# Typed codecs: the Codec class, a tree that mirrors a typed serializer, and its encoder and decoder.
include "_typed_codecs.pxi"
