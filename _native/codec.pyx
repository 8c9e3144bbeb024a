# The serializer codecs, compiled.
#
# A Codec is a small tree that mirrors a typed serializer (Int64, Str, Nullable, Tuple, List, Map, ...) or is the
# self-describing ValueSerializer format. Encoding writes into a growable buffer that starts on the C stack; decoding
# reads ONLY through the checked cursor of cursor.pxd, so truncated or corrupt bytes raise CorruptSnapshotError
# instead of reading past the end, every count is checked against the bytes that remain before anything is allocated,
# and nesting is capped so hostile input cannot exhaust the C stack.
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
from cpython.mem cimport PyMem_Malloc, PyMem_Realloc, PyMem_Free
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM, PyTuple_GET_ITEM, PyTuple_GET_SIZE, PyTuple_Check
from cpython.unicode cimport PyUnicode_DecodeUTF8, PyUnicode_Check
from libc.math cimport isnan
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t, INT32_MIN, INT32_MAX
from libc.stdlib cimport qsort
from libc.string cimport memcpy, memcmp

from cursor cimport Cursor, cur_init, cur_read, cur_u8, cur_u32, cur_count, cur_corrupt, cur_remaining

cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object s, Py_ssize_t *size) except NULL

if sys.byteorder != "little":   # the formats are little-endian and the cursor reads with memcpy
    raise ImportError("keygroups._native.codec needs a little-endian host")

from keygroups.errors import CorruptSnapshotError

# Codec kinds (also exported to Python for keygroups.serializers).
INT64 = 1
INT32 = 2
FLOAT64 = 3
BOOL = 4
STR = 5
BYTES = 6
NULLABLE = 7
TUPLE = 8
LIST = 9
MAP = 10
VALUE = 11
EXTERNAL = 12

cdef enum:
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
MAX_DEPTH = 100
cdef enum:
    C_MAX_DEPTH = 100
    W_STACK = 256
    SMALL_DICT = 16     # dicts up to this size sort on the C stack, by insertion
    SMALL_TMP = 512
    KEY_CACHE_SIZE = 1024   # a power of two
    KEY_CACHE_MAX_LEN = 40
    U32_MAX = 0xFFFFFFFF

cdef uint64_t CANONICAL_NAN = 0x7FF8000000000000ULL

cdef object _np_bool = np.bool_
cdef object _np_integer = np.integer
cdef object _np_floating = np.floating
cdef object _index = operator.index

ALLOWED_VALUE_TYPES = "None, bool, int, float, str, bytes (or bytearray/memoryview), list, tuple, dict"


# ---------------------------------------------------------------------------------------------------------------------
# The writer: a growable output buffer whose first W_STACK bytes live on the C stack (most values are small).

cdef struct Writer:
    uint8_t *buf
    Py_ssize_t pos
    Py_ssize_t cap
    bint on_heap
    uint8_t stack[W_STACK]


cdef inline void w_init(Writer *w) noexcept nogil:
    w.buf = w.stack
    w.pos = 0
    w.cap = W_STACK
    w.on_heap = False


cdef inline void w_free(Writer *w) noexcept:
    if w.on_heap:
        PyMem_Free(w.buf)
    w.buf = w.stack
    w.on_heap = False


cdef int w_grow(Writer *w, Py_ssize_t need) except -1:
    cdef Py_ssize_t cap = w.cap * 2
    cdef uint8_t *p
    if cap < w.pos + need:
        cap = w.pos + need
    if w.on_heap:
        p = <uint8_t *>PyMem_Realloc(w.buf, cap)
    else:
        p = <uint8_t *>PyMem_Malloc(cap)
        if p != NULL:
            memcpy(p, w.stack, w.pos)
    if p == NULL:
        raise MemoryError(f"cannot grow the serializer buffer to {cap} bytes")
    w.buf = p
    w.cap = cap
    w.on_heap = True
    return 0


cdef inline uint8_t *w_reserve(Writer *w, Py_ssize_t n) except NULL:
    """Room for n bytes at the end; the pointer is valid until the next reserve."""
    cdef uint8_t *p
    if n > w.cap - w.pos:
        w_grow(w, n)
    p = w.buf + w.pos
    w.pos += n
    return p


cdef inline int w_u8(Writer *w, uint8_t v) except -1:
    w_reserve(w, 1)[0] = v
    return 0


cdef inline int w_u32(Writer *w, uint32_t v) except -1:
    memcpy(w_reserve(w, 4), &v, 4)
    return 0


cdef inline int w_i64(Writer *w, int64_t v) except -1:
    memcpy(w_reserve(w, 8), &v, 8)
    return 0


cdef inline int w_f64(Writer *w, double v) except -1:
    cdef uint64_t bits
    if isnan(v):
        bits = CANONICAL_NAN   # one NaN, so equal values give equal bytes
    else:
        memcpy(&bits, &v, 8)
    memcpy(w_reserve(w, 8), &bits, 8)
    return 0


cdef inline int w_bytes(Writer *w, const char *p, Py_ssize_t n) except -1:
    if n > 0:
        memcpy(w_reserve(w, n), p, n)
    return 0


cdef int w_len(Writer *w, Py_ssize_t n, str what) except -1:
    if n > U32_MAX:
        raise ValueError(f"{what} of {n} is too large to serialize: at most {U32_MAX} (u32) is allowed")
    return w_u32(w, <uint32_t>n)


cdef inline bytes w_result(Writer *w):
    return PyBytes_FromStringAndSize(<const char *>w.buf, w.pos)


# ---------------------------------------------------------------------------------------------------------------------
# Reading helpers over the checked cursor.

cdef inline int64_t r_i64(Cursor *c) except? -1:
    cdef int64_t v
    memcpy(&v, cur_read(c, 8), 8)
    return v


cdef inline int32_t r_i32(Cursor *c) except? -1:
    cdef int32_t v
    memcpy(&v, cur_read(c, 4), 4)
    return v


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
    cdef Py_ssize_t n = x.key_len if x.key_len < y.key_len else y.key_len
    cdef int r = memcmp(x.key, y.key, n)
    if r != 0:
        return r
    return (x.key_len > y.key_len) - (x.key_len < y.key_len)


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


cdef str _short(object v):
    cdef str r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


# ---------------------------------------------------------------------------------------------------------------------
# The ValueSerializer format.

cdef inline int enc_v_str(Writer *w, object v) except -1:
    cdef Py_ssize_t n
    cdef const char *p = PyUnicode_AsUTF8AndSize(v, &n)   # a str subclass: its stored text, not its __str__
    w_u8(w, T_STR)
    w_len(w, n, "a str length")
    return w_bytes(w, p, n)


cdef inline int enc_v_int(Writer *w, object v) except -1:
    cdef int overflow = 0
    cdef long long x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow:
        return enc_bigint(w, v)
    w_u8(w, T_INT64)
    return w_i64(w, x)


cdef int enc_v_list(Writer *w, object v, int depth) except -1:
    cdef Py_ssize_t n = PyList_GET_SIZE(v), i = 0
    cdef object item
    w_u8(w, T_LIST)
    w_len(w, n, "a list length")
    # Index, not iterate: encoding an element may run Python code that changes the list.
    while i < PyList_GET_SIZE(v):
        if i >= n:
            break
        item = <object>PyList_GET_ITEM(v, i)   # owned, in case that code drops it from the list
        enc_value(w, item, depth + 1)
        i += 1
    if i != n or PyList_GET_SIZE(v) != n:
        raise RuntimeError("list changed size during serialization")
    return 0


cdef int enc_v_tuple(Writer *w, object v, int depth) except -1:
    cdef Py_ssize_t n = PyTuple_GET_SIZE(v), i
    w_u8(w, T_TUPLE)
    w_len(w, n, "a tuple length")
    for i in range(n):
        enc_value(w, <object>PyTuple_GET_ITEM(v, i), depth + 1)
    return 0


cdef inline int enc_v_bytes(Writer *w, object v) except -1:
    cdef Py_ssize_t n = PyBytes_GET_SIZE(v)
    w_u8(w, T_BYTES)
    w_len(w, n, "a bytes length")
    return w_bytes(w, PyBytes_AS_STRING(v), n)


cdef int enc_value(Writer *w, object v, int depth) except -1:
    cdef type t = type(v)
    if depth > C_MAX_DEPTH:
        raise ValueError(f"the value nests deeper than {C_MAX_DEPTH} levels (or contains itself); "
                         "ValueSerializer refuses it")
    if v is None:
        return w_u8(w, T_NONE)
    if t is str:
        return enc_v_str(w, v)
    if t is int:
        return enc_v_int(w, v)
    if t is float:
        w_u8(w, T_FLOAT64)
        return w_f64(w, PyFloat_AsDouble(v))
    if t is bool:
        return w_u8(w, T_TRUE if v is True else T_FALSE)
    if t is dict:
        w_u8(w, T_DICT)
        return enc_dict(w, v, None, None, depth)
    if t is list:
        return enc_v_list(w, v, depth)
    if t is tuple:
        return enc_v_tuple(w, v, depth)
    if t is bytes:
        return enc_v_bytes(w, v)
    return enc_value_slow(w, v, depth)


cdef int enc_bigint(Writer *w, object v) except -1:
    cdef bytes b = int.to_bytes(v, (int.bit_length(v) + 8) // 8, "little", signed=True)
    w_u8(w, T_BIGINT)
    w_len(w, PyBytes_GET_SIZE(b), "an int's byte length")
    return w_bytes(w, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))


cdef int enc_value_slow(Writer *w, object v, int depth) except -1:
    """Subclasses of the JSON-like types, stored as their base type from the value they hold (never from methods
    they may override: a str subclass's __str__, a list subclass's __iter__), and numpy scalars."""
    if PyUnicode_Check(v):
        return enc_v_str(w, v)
    if PyLong_Check(v):   # IntEnum & co.; bool is handled before (it cannot be subclassed)
        return enc_v_int(w, v)
    if PyFloat_Check(v):
        w_u8(w, T_FLOAT64)
        return w_f64(w, PyFloat_AsDouble(v))
    if PyDict_Check(v):   # OrderedDict, defaultdict, ...: a plain copy of what they store (not their items())
        w_u8(w, T_DICT)
        return enc_dict(w, PyDict_Copy(v), None, None, depth)
    if PyList_Check(v):
        return enc_v_list(w, v, depth)
    if PyTuple_Check(v):   # namedtuples become plain tuples
        return enc_v_tuple(w, v, depth)
    if PyBytes_Check(v):
        return enc_v_bytes(w, v)
    if isinstance(v, (bytearray, memoryview)):
        return enc_v_bytes(w, bytes(v))
    if isinstance(v, _np_bool):
        return w_u8(w, T_TRUE if v else T_FALSE)
    if isinstance(v, _np_integer):
        return enc_v_int(w, int(v))
    if isinstance(v, _np_floating):
        w_u8(w, T_FLOAT64)
        return w_f64(w, float(v))
    raise TypeError(f"ValueSerializer cannot serialize {_short(v)} of type {type(v).__name__}; allowed: "
                    f"{ALLOWED_VALUE_TYPES} (nested freely). Use a typed serializer or an explicit PickleSerializer "
                    "for other types")


cdef object dec_value(Cursor *c, int depth):
    cdef uint8_t tag
    cdef Py_ssize_t n, i
    cdef object item, key, out
    if depth > C_MAX_DEPTH:
        cur_corrupt(c, f"a value nested deeper than {C_MAX_DEPTH} levels")
    tag = cur_u8(c)
    if tag == T_STR:
        n = cur_count(c, 1, "a str length")
        return r_str(c, n)
    if tag == T_INT64:
        return PyLong_FromLongLong(r_i64(c))
    if tag == T_NONE:
        return None
    if tag == T_TRUE:
        return True
    if tag == T_FALSE:
        return False
    if tag == T_FLOAT64:
        return PyFloat_FromDouble(r_f64(c))
    if tag == T_DICT:
        n = cur_count(c, 2, "a dict size")
        out = {}
        for i in range(n):
            if cur_u8(c) == T_STR:
                key = r_key_str(c, cur_count(c, 1, "a str length"))
            else:
                c.pos -= 1
                key = dec_value(c, depth + 1)
            item = dec_value(c, depth + 1)
            _dict_put(c, out, key, item)
        if len(out) != n:
            cur_corrupt(c, f"a dict of {n} entries with duplicate keys")
        return out
    if tag == T_LIST:
        n = cur_count(c, 1, "a list length")
        out = PyList_New(n)
        for i in range(n):
            item = dec_value(c, depth + 1)
            Py_INCREF(item)
            PyList_SET_ITEM(out, i, item)
        return out
    if tag == T_TUPLE:
        n = cur_count(c, 1, "a tuple length")
        out = PyTuple_New(n)
        for i in range(n):
            item = dec_value(c, depth + 1)
            Py_INCREF(item)
            PyTuple_SET_ITEM(out, i, item)
        return out
    if tag == T_BYTES:
        n = cur_count(c, 1, "a bytes length")
        return r_bytes(c, n)
    if tag == T_BIGINT:
        n = cur_count(c, 1, "an int's byte length")
        return int.from_bytes(r_bytes(c, n), "little", signed=True)
    c.pos -= 1
    cur_corrupt(c, f"unknown value tag {tag}")


cdef int _dict_put(Cursor *c, dict d, object key, object value) except -1:
    try:
        d[key] = value
    except TypeError:
        cur_corrupt(c, f"an unhashable dict key of type {type(key).__name__}")
    return 0


cdef object copy_value(object v, int depth):
    cdef type t = type(v)
    if depth > C_MAX_DEPTH:
        raise ValueError(f"the value nests deeper than {C_MAX_DEPTH} levels (or contains itself)")
    if t is list:
        return [copy_value(x, depth + 1) for x in <list>v]
    if t is dict:
        return {copy_value(k, depth + 1): copy_value(x, depth + 1) for k, x in (<dict>v).items()}
    if t is tuple:
        return tuple([copy_value(x, depth + 1) for x in <tuple>v])
    if t is bytearray:
        return bytearray(v)
    if isinstance(v, (list, dict, tuple)):   # subclasses: let the copy module keep their type
        import copy
        return copy.deepcopy(v)
    return v


# ---------------------------------------------------------------------------------------------------------------------
# Typed codecs.

@cython.auto_pickle(False)   # serializers pickle by their constructor arguments and rebuild the codec
cdef class Codec:
    """The compiled form of one serializer (a tree for nested ones). Built by keygroups.serializers."""
    cdef readonly int kind
    cdef readonly str name
    cdef readonly Py_ssize_t min_size     # the fewest bytes one nested value can take (>= 1)
    cdef readonly Py_ssize_t fixed_size   # bytes of every value when constant, else -1
    cdef readonly tuple children
    cdef readonly object external         # K_EXTERNAL: the Python serializer called for each value
    cdef Codec a                          # NULLABLE/LIST inner, MAP key
    cdef Codec b                          # MAP value

    def __init__(self, int kind, str name, tuple children=(), object external=None):
        cdef Codec ch
        cdef Py_ssize_t total = 0
        cdef bint fixed = True
        self.kind = kind
        self.name = name
        self.children = children
        self.external = external
        self.fixed_size = -1
        for ch in children:
            if ch is None:
                raise TypeError("codec children must be Codec objects")
        nchildren = {K_NULLABLE: 1, K_LIST: 1, K_MAP: 2}.get(kind, 0)
        if kind == K_TUPLE:
            if len(children) == 0:
                raise ValueError("a tuple codec needs at least one field")
        elif len(children) != nchildren:
            raise ValueError(f"codec kind {kind} takes {nchildren} children, got {len(children)}")
        if kind == K_EXTERNAL and external is None:
            raise ValueError("an external codec needs the serializer it calls")
        if nchildren >= 1:
            self.a = children[0]
        if nchildren == 2:
            self.b = children[1]
        if kind == K_INT64 or kind == K_FLOAT64:
            self.min_size = self.fixed_size = 8
        elif kind == K_INT32:
            self.min_size = self.fixed_size = 4
        elif kind == K_BOOL:
            self.min_size = self.fixed_size = 1
        elif kind == K_STR or kind == K_BYTES or kind == K_LIST or kind == K_MAP or kind == K_EXTERNAL:
            self.min_size = 4
        elif kind == K_NULLABLE or kind == K_VALUE:
            self.min_size = 1
        elif kind == K_TUPLE:
            for ch in children:
                total += ch.min_size
                fixed = fixed and ch.fixed_size >= 0
            self.min_size = total
            if fixed:
                self.fixed_size = total
        else:
            raise ValueError(f"unknown codec kind {kind}")

    def __repr__(self):
        return f"<Codec {self.name}>"

    def encode(self, value) -> bytes:
        """One value → its bytes."""
        cdef Writer w
        w_init(&w)
        try:
            enc_top(self, &w, value)
            return w_result(&w)
        finally:
            w_free(&w)

    def decode(self, data):
        """Bytes holding exactly one value → the value; CorruptSnapshotError if they are not that."""
        cdef Py_buffer view
        cdef Cursor cur
        if PyBytes_CheckExact(data):
            cur_init(&cur, <const uint8_t *>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
            return dec_top(self, &cur)
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            cur_init(&cur, <const uint8_t *>view.buf, view.len)
            return dec_top(self, &cur)
        finally:
            PyBuffer_Release(&view)

    def encode_many(self, values):
        """Values → (one buffer, int64 offsets of length n + 1); value i is buffer[offsets[i]:offsets[i + 1]]."""
        cdef Writer w
        cdef Py_ssize_t n, i
        cdef int64_t[::1] o
        fast = self._encode_array(values)
        if fast is not None:
            return fast
        if not isinstance(values, (list, tuple)):
            values = list(values)
        n = len(values)
        offsets = np.empty(n + 1, dtype=np.int64)
        o = offsets
        w_init(&w)
        try:
            for i in range(n):
                o[i] = w.pos
                enc_top(self, &w, values[i])
            o[n] = w.pos
            return w_result(&w), offsets
        finally:
            w_free(&w)

    cdef object _encode_array(self, object values):
        """numpy arrays of a matching dtype are copied in bulk (fixed-width kinds only)."""
        cdef object arr
        if not isinstance(values, np.ndarray) or values.ndim != 1:
            return None
        dt = values.dtype
        if self.kind == K_INT64 and dt.kind in "iu" and (dt.kind == "i" or dt.itemsize < 8):
            arr = values.astype("<i8")
        elif self.kind == K_INT32 and dt.kind in "iu" and (dt.itemsize < 4 or (dt.kind == "i" and dt.itemsize == 4)):
            arr = values.astype("<i4")
        elif self.kind == K_FLOAT64 and dt.kind == "f" and dt.itemsize <= 8:
            arr = values.astype("<f8")
            nan = np.isnan(arr)
            if nan.any():
                arr[nan] = np.nan   # np.nan is the canonical quiet NaN
        elif self.kind == K_BOOL and dt.kind == "b":
            arr = values.astype(np.uint8)
        else:
            return None
        offsets = np.arange(len(arr) + 1, dtype=np.int64) * self.fixed_size
        return np.ascontiguousarray(arr).tobytes(), offsets

    def decode_many(self, data, offsets) -> list:
        """The inverse of encode_many; offsets are untrusted (they come from files) and checked first."""
        cdef Py_buffer view
        cdef Cursor cur
        cdef const int64_t[::1] o = np.ascontiguousarray(offsets, dtype=np.int64)
        cdef Py_ssize_t n = o.shape[0] - 1, i, bad
        cdef list out
        cdef object item
        if n < 0:
            raise ValueError("offsets must hold n + 1 entries (the first 0 or more, then one end per value)")
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            with nogil:
                bad = check_offsets(&o[0], n, view.len)
            if bad >= 0:
                raise CorruptSnapshotError(
                    f"value offsets are not ascending inside the {view.len}-byte buffer (offset {bad}: "
                    f"{o[bad]}): the data is truncated or corrupt")
            if self.fixed_size > 0 and self.kind != K_TUPLE and n > 0:
                fast = self._decode_array(data, &o[0], n)
                if fast is not None:
                    return fast
            out = PyList_New(n)
            for i in range(n):
                cur_init(&cur, <const uint8_t *>view.buf + o[i], o[i + 1] - o[i])
                item = dec_top(self, &cur)
                Py_INCREF(item)
                PyList_SET_ITEM(out, i, item)
            return out
        finally:
            PyBuffer_Release(&view)

    cdef object _decode_array(self, object data, const int64_t *o, Py_ssize_t n):
        cdef Py_ssize_t i
        cdef int64_t w = self.fixed_size
        for i in range(n + 1):
            if o[i] != o[0] + i * w:
                return None   # not one contiguous run: decode one by one (that also reports bad lengths)
        dtype = {K_INT64: "<i8", K_INT32: "<i4", K_FLOAT64: "<f8", K_BOOL: "u1"}[self.kind]
        arr = np.frombuffer(data, dtype=dtype, count=n, offset=o[0])
        if self.kind == K_BOOL:
            if n and arr.max() > 1:
                raise CorruptSnapshotError(f"a bool byte of {int(arr.max())} (only 0 and 1 are valid): "
                                           "the data is truncated or corrupt")
            return arr.astype(bool).tolist()
        return arr.tolist()


cdef Py_ssize_t check_offsets(const int64_t *o, Py_ssize_t n, Py_ssize_t length) noexcept nogil:
    """-1 when 0 <= o[0] <= o[1] <= ... <= o[n] <= length, else the index of the first bad offset."""
    cdef Py_ssize_t i
    if o[0] < 0 or o[0] > length:
        return 0
    for i in range(1, n + 1):
        if o[i] < o[i - 1] or o[i] > length:
            return i
    return -1


cdef int enc_top(Codec c, Writer *w, object v) except -1:
    """A whole value: like enc, except that a top-level str/bytes needs no length (the frame has it)."""
    cdef Py_ssize_t n
    cdef const char *p
    cdef bytes b
    if c.kind == K_STR:
        p = _utf8(c, v, &n)
        return w_bytes(w, p, n)
    if c.kind == K_BYTES:
        return enc_bytes(c, w, v, False)
    if c.kind == K_EXTERNAL:
        b = _external_bytes(c, v)
        return w_bytes(w, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))
    return enc(c, w, v, 0)


cdef object dec_top(Codec c, Cursor *cur):
    cdef object v
    cdef Py_ssize_t n = cur_remaining(cur)
    if c.kind == K_STR:
        return r_str(cur, n)
    if c.kind == K_BYTES:
        return r_bytes(cur, n)
    if c.kind == K_EXTERNAL:
        return c.external.deserialize(r_bytes(cur, n))
    v = dec(c, cur, 0)
    if cur.pos != cur.length:
        cur_corrupt(cur, f"{cur.length - cur.pos} trailing bytes after a {c.name} value")
    return v


cdef inline const char *_utf8(Codec c, object v, Py_ssize_t *n) except NULL:
    if not isinstance(v, str):
        raise TypeError(f"{c.name} expects a str, got {_short(v)} of type {type(v).__name__}")
    return PyUnicode_AsUTF8AndSize(v, n)


cdef int enc_bytes(Codec c, Writer *w, object v, bint prefixed) except -1:
    cdef Py_buffer view
    if PyBytes_CheckExact(v):
        if prefixed:
            w_len(w, PyBytes_GET_SIZE(v), "a bytes length")
        return w_bytes(w, PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v))
    if not isinstance(v, (bytes, bytearray, memoryview)):
        raise TypeError(f"{c.name} expects bytes, bytearray or memoryview, got {_short(v)} of type "
                        f"{type(v).__name__}")
    PyObject_GetBuffer(v, &view, PyBUF_SIMPLE)
    try:
        if prefixed:
            w_len(w, view.len, "a bytes length")
        return w_bytes(w, <const char *>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef bytes _external_bytes(Codec c, object v):
    b = c.external.serialize(v)
    if not PyBytes_CheckExact(b):
        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise TypeError(f"{c.name}.serialize returned {type(b).__name__}, not bytes")
        b = bytes(b)
    return b


cdef inline int64_t _as_int(Codec c, object v, int64_t lo, int64_t hi) except? -1:
    cdef int overflow = 0
    cdef long long x
    if not PyLong_Check(v):
        if isinstance(v, float) or isinstance(v, _np_floating) or isinstance(v, str):
            raise TypeError(f"{c.name} expects an int, got {_short(v)} of type {type(v).__name__}")
        try:
            v = _index(v)
        except TypeError:
            raise TypeError(f"{c.name} expects an int, got {_short(v)} of type {type(v).__name__}") from None
    x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow or x < lo or x > hi:
        raise ValueError(f"{v!r} is out of range for {c.name}: allowed are integers in [{lo}, {hi}]")
    return x


cdef int enc(Codec c, Writer *w, object v, int depth) except -1:
    """One nested value of codec c."""
    cdef int k = c.kind
    cdef Py_ssize_t n, i
    cdef const char *p
    cdef bytes b
    cdef Codec f
    if k == K_INT64:
        return w_i64(w, _as_int(c, v, -9223372036854775807LL - 1, 9223372036854775807LL))
    if k == K_INT32:
        i = <Py_ssize_t>_as_int(c, v, INT32_MIN, INT32_MAX)
        return w_u32(w, <uint32_t><int32_t>i)
    if k == K_STR:
        p = _utf8(c, v, &n)
        w_len(w, n, "a str length")
        return w_bytes(w, p, n)
    if k == K_FLOAT64:
        if type(v) is float:
            return w_f64(w, PyFloat_AsDouble(v))
        if isinstance(v, str) or isinstance(v, (bytes, bytearray)) or v is None:
            raise TypeError(f"{c.name} expects a float, got {_short(v)} of type {type(v).__name__}")
        try:
            return w_f64(w, PyFloat_AsDouble(v))
        except TypeError:
            raise TypeError(f"{c.name} expects a float, got {_short(v)} of type {type(v).__name__}") from None
        except OverflowError:
            raise ValueError(f"{_short(v)} is out of range for {c.name}: allowed are floats and ints of magnitude "
                             "up to about 1.8e308") from None
    if k == K_BOOL:
        if v is True:
            return w_u8(w, 1)
        if v is False:
            return w_u8(w, 0)
        if isinstance(v, _np_bool):
            return w_u8(w, 1 if v else 0)
        raise TypeError(f"{c.name} expects a bool, got {_short(v)} of type {type(v).__name__}")
    if k == K_BYTES:
        return enc_bytes(c, w, v, True)
    if k == K_NULLABLE:
        if v is None:
            return w_u8(w, 0)
        w_u8(w, 1)
        return enc(c.a, w, v, depth + 1)
    if k == K_TUPLE:
        n = len(c.children)
        if type(v) is tuple:
            if PyTuple_GET_SIZE(v) != n:
                raise ValueError(f"{c.name} expects a tuple of {n} fields, got {PyTuple_GET_SIZE(v)}: {_short(v)}")
            for i in range(n):
                enc(<Codec>PyTuple_GET_ITEM(c.children, i), w, <object>PyTuple_GET_ITEM(v, i), depth + 1)
            return 0
        if not isinstance(v, (tuple, list)):
            raise TypeError(f"{c.name} expects a tuple (or list) of {n} fields, got {_short(v)} of type "
                            f"{type(v).__name__}")
        return enc(c, w, tuple(v), depth)
    if k == K_LIST:
        if not isinstance(v, (list, tuple)):
            raise TypeError(f"{c.name} expects a list (or tuple), got {_short(v)} of type {type(v).__name__}")
        if type(v) is not tuple:
            v = tuple(v)   # a snapshot of the elements: encoding them may run Python code
        n = PyTuple_GET_SIZE(v)
        w_len(w, n, "a list length")
        f = c.a
        for i in range(n):
            enc(f, w, <object>PyTuple_GET_ITEM(v, i), depth + 1)
        return 0
    if k == K_MAP:
        if not isinstance(v, dict):
            raise TypeError(f"{c.name} expects a dict, got {_short(v)} of type {type(v).__name__}")
        return enc_dict(w, v if type(v) is dict else PyDict_Copy(v), c.a, c.b, depth)
    if k == K_VALUE:
        return enc_value(w, v, depth)
    if k == K_EXTERNAL:
        b = _external_bytes(c, v)
        w_len(w, PyBytes_GET_SIZE(b), "an external value length")
        return w_bytes(w, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))
    raise AssertionError(f"unknown codec kind {k}")


cdef object dec(Codec c, Cursor *cur, int depth):
    """One nested value of codec c."""
    cdef int k = c.kind
    cdef Py_ssize_t n, i
    cdef uint8_t flag
    cdef object item, key, out
    cdef Codec f
    if k == K_INT64:
        return PyLong_FromLongLong(r_i64(cur))
    if k == K_STR:
        n = cur_count(cur, 1, "a str length")
        return r_str(cur, n)
    if k == K_INT32:
        return PyLong_FromLongLong(r_i32(cur))
    if k == K_FLOAT64:
        return PyFloat_FromDouble(r_f64(cur))
    if k == K_BOOL:
        flag = cur_u8(cur)
        if flag > 1:
            cur.pos -= 1
            cur_corrupt(cur, f"a bool byte of {flag} (only 0 and 1 are valid)")
        return flag == 1
    if k == K_BYTES:
        n = cur_count(cur, 1, "a bytes length")
        return r_bytes(cur, n)
    if k == K_NULLABLE:
        flag = cur_u8(cur)
        if flag == 0:
            return None
        if flag != 1:
            cur.pos -= 1
            cur_corrupt(cur, f"a null flag of {flag} (only 0 and 1 are valid)")
        return dec(c.a, cur, depth + 1)
    if k == K_TUPLE:
        n = PyTuple_GET_SIZE(c.children)
        out = PyTuple_New(n)
        for i in range(n):
            item = dec(<Codec>PyTuple_GET_ITEM(c.children, i), cur, depth + 1)
            Py_INCREF(item)
            PyTuple_SET_ITEM(out, i, item)
        return out
    if k == K_LIST:
        f = c.a
        n = cur_count(cur, f.min_size, "a list length")
        out = PyList_New(n)
        for i in range(n):
            item = dec(f, cur, depth + 1)
            Py_INCREF(item)
            PyList_SET_ITEM(out, i, item)
        return out
    if k == K_MAP:
        n = cur_count(cur, c.a.min_size + c.b.min_size, "a map size")
        out = {}
        for i in range(n):
            if c.a.kind == K_STR:
                key = r_key_str(cur, cur_count(cur, 1, "a str length"))
            else:
                key = dec(c.a, cur, depth + 1)
            item = dec(c.b, cur, depth + 1)
            _dict_put(cur, out, key, item)
        if len(out) != n:
            cur_corrupt(cur, f"a map of {n} entries with duplicate keys")
        return out
    if k == K_VALUE:
        return dec_value(cur, depth)
    if k == K_EXTERNAL:
        n = cur_count(cur, 1, "an external value length")
        return c.external.deserialize(r_bytes(cur, n))
    raise AssertionError(f"unknown codec kind {k}")


def copy_json_value(value):
    """A deep copy of a ValueSerializer value (lists, dicts and bytearrays are new; immutables are shared)."""
    return copy_value(value, 0)
