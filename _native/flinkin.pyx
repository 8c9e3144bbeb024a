# cython: auto_pickle=False
# Flink canonical savepoint -> keygroups, compiled: the checked scanner of one key-group block and the transcoder of
# Flink values into the bytes keygroups' serializers write for the same values, with no Python object per entry.
#
# A key-group block (documented in keygroups/flink/keyed.py): a state id (big-endian short), then (int length, key,
# int length, value) pairs; the last pair of a state's run has bit 0x80 set in its first key byte and is followed by
# the next state id, or 0xFFFF at the end of the key group. ``scan_block`` checks every length against the bytes that
# remain before it is used and records where each entry's key and value lie; nothing is copied.
#
# A ``Node`` is one position of a Flink serializer tree (keygroups/flink/transcode.py builds it from a FlinkType):
# it reads Flink's bytes (big-endian, Java's DataOutput; every read checked against the end of the value) and writes
# what keygroups' serializer of that FlinkType (``FlinkType.keygroups_serializer()``) writes for the same value,
# little-endian: the codec format of _native/codec.pyx, or inside a Row the RecordSerializer format of
# _native/records.pyx (``record`` nodes). A ``StatePlan`` transcodes one state's entries of a scanned block into
# keygroups' keyed-state keys and framed values (keygroups/state/_codec.py ValueFraming), grouping a map state's
# entries and a key's timers into one value per key.
#
# Corrupt bytes raise CorruptSnapshotError naming the byte offset in the block; a value keygroups' serializer cannot
# hold (a lone UTF-16 surrogate, a null where its serializer takes none) raises StateSerializationError.
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport qsort
from libc.string cimport memcmp, memcpy

from writer cimport Writer, w_bytes, w_f64, w_free, w_i64, w_init, w_reserve, w_result, w_u8, w_u32
from keysearch cimport kg_key_cmp

import sys

import numpy as np

from keygroups.errors import CorruptSnapshotError, StateSerializationError

if sys.byteorder != "little":   # the writer copies integers in host order; keygroups' formats are little-endian
    raise ImportError("keygroups._native.flinkin supports little-endian hosts only")

cdef extern from *:
    """
    static inline uint16_t kgf_be16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return __builtin_bswap16(v); }
    static inline uint32_t kgf_be32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return __builtin_bswap32(v); }
    static inline uint64_t kgf_be64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return __builtin_bswap64(v); }
    """
    uint16_t be16 "kgf_be16"(const uint8_t *p) nogil
    uint32_t be32 "kgf_be32"(const uint8_t *p) nogil
    uint64_t be64 "kgf_be64"(const uint8_t *p) nogil

cdef enum:
    END_OF_KEY_GROUP = 0xFFFF
    FIRST_BIT = 0x80
    LIST_DELIMITER = 0x2C

# Flink serializer kinds (Node.kind); keygroups/flink/transcode.py builds nodes with the Python names below.
cdef enum:
    F_LONG = 1
    F_INT = 2
    F_SHORT = 3
    F_BYTE = 4
    F_DOUBLE = 5
    F_FLOAT = 6
    F_BOOL = 7
    F_CHAR = 8
    F_STRING = 9
    F_BYTES = 10
    F_TUPLE = 11
    F_ROW = 12
    F_LIST = 13
    F_MAP = 14
    F_NULLABLE = 15

LONG = F_LONG
INT = F_INT
SHORT = F_SHORT
BYTE = F_BYTE
DOUBLE = F_DOUBLE
FLOAT = F_FLOAT
BOOL = F_BOOL
CHAR = F_CHAR
STRING = F_STRING
BYTES = F_BYTES
TUPLE = F_TUPLE
ROW = F_ROW
LIST = F_LIST
MAP = F_MAP
NULLABLE = F_NULLABLE

# State kinds of a StatePlan.
cdef enum:
    S_VALUE = 0
    S_LIST = 1
    S_MAP = 2
    S_TIMER = 3

VALUE_STATE = S_VALUE
LIST_STATE = S_LIST
MAP_STATE = S_MAP
TIMER_STATE = S_TIMER

# How a node writes (bits of ``mode``).
cdef enum:
    M_TOP = 1        # a whole keygroups value: a top-level str/bytes/record carries no length (its frame has it)
    M_NULLPOS = 2    # a nullable position: a 0 (null) or 1 (present) flag first


# ---- the checked Flink reader ------------------------------------------------------------------------------------

cdef struct FCur:
    const uint8_t *buf    # the whole block: positions are offsets in it, as errors name them
    Py_ssize_t pos
    Py_ssize_t end        # the end of the value being read


cdef int _corrupt(Py_ssize_t pos, str what) except -1:
    raise CorruptSnapshotError(f"at byte {pos}: {what}")


cdef inline const uint8_t *f_take(FCur *c, Py_ssize_t n, str what) except NULL:
    cdef const uint8_t *p
    if n < 0 or n > c.end - c.pos:
        _corrupt(c.pos, f"{what} needs {n} bytes but {c.end - c.pos} remain (truncated or corrupt)")
    p = c.buf + c.pos
    c.pos += n
    return p


cdef inline int f_flag(FCur *c, str what) except -1:
    """A Java boolean: 0 or 1."""
    cdef uint8_t b = f_take(c, 1, what)[0]
    if b > 1:
        _corrupt(c.pos - 1, f"{what} is {b}, not 0 or 1")
    return b


cdef inline int32_t f_count(FCur *c, Py_ssize_t min_size, str what) except? -1:
    """An int count of items of at least ``min_size`` bytes each, checked against what remains."""
    cdef int32_t n = <int32_t>be32(f_take(c, 4, what))
    if n < 0 or <int64_t>n * min_size > c.end - c.pos:
        _corrupt(c.pos - 4, f"{what} is {n}: more than the {c.end - c.pos} remaining bytes can hold")
    return n


cdef inline uint32_t f_varint(FCur *c, uint32_t limit, str what) except? 0xFFFFFFFF:
    """Flink's StringValue varint: 7 bits per byte, least significant first; over ``limit`` is corrupt."""
    cdef uint64_t value = 0
    cdef uint8_t b
    cdef int shift = 0
    while True:
        if c.pos >= c.end:
            _corrupt(c.pos, f"{what} needs a byte but none remains (truncated or corrupt)")
        b = c.buf[c.pos]
        c.pos += 1
        if b & 0x7F:
            if shift >= 32:
                _corrupt(c.pos - 1, f"{what} exceeds {limit}")
            value |= (<uint64_t>(b & 0x7F)) << shift
            if value > limit:
                _corrupt(c.pos - 1, f"{what} exceeds {limit}")
        if b < 0x80:
            return <uint32_t>value
        shift += 7


# ---- writing keygroups' bytes ------------------------------------------------------------------------------------

cdef inline Py_ssize_t w_open_len(Writer *w) except -1:
    """Room for a u32 length filled in by w_close_len once what it measures is written."""
    w_reserve(w, 4)
    return w.pos


cdef inline int w_set_len(Writer *w, Py_ssize_t at, Py_ssize_t n) except -1:
    """The u32 length ``n`` at byte ``at`` (reserved before)."""
    cdef uint32_t n32
    if n > 0xFFFFFFFF:
        raise StateSerializationError(f"a value of {n} bytes is too large for a u32 length")
    n32 = <uint32_t>n
    memcpy(w.buf + at, &n32, 4)
    return 0


cdef inline int w_close_len(Writer *w, Py_ssize_t start) except -1:
    return w_set_len(w, start - 4, w.pos - start)


cdef int _lone_surrogate(Py_ssize_t pos, uint32_t unit) except -1:
    raise StateSerializationError(f"at byte {pos}: a String or Character holding the lone UTF-16 surrogate "
                                  f"{unit:#06x}; keygroups' Str holds valid Unicode only")


cdef int w_string_body(FCur *c, Py_ssize_t n, Writer *w) except -1:
    """The ``n`` UTF-16 units of a StringValue (each a varint) as UTF-8, surrogate pairs joined."""
    cdef uint8_t *out
    cdef Py_ssize_t q = 0, i, start
    cdef uint32_t unit, high = 0, cp
    cdef uint8_t b
    if n > c.end - c.pos:
        _corrupt(c.pos, f"a String of {n} characters is longer than the {c.end - c.pos} remaining bytes")
    out = w_reserve(w, 3 * n)
    start = w.pos - 3 * n
    for i in range(n):
        if c.pos < c.end and c.buf[c.pos] < 0x80:
            unit = c.buf[c.pos]
            c.pos += 1
        else:
            unit = f_varint(c, 0xFFFF, "a String's character")
        if high:
            if 0xDC00 <= unit <= 0xDFFF:
                cp = 0x10000 + ((high - 0xD800) << 10) + (unit - 0xDC00)
                out[q] = 0xF0 | (cp >> 18)
                out[q + 1] = 0x80 | ((cp >> 12) & 0x3F)
                out[q + 2] = 0x80 | ((cp >> 6) & 0x3F)
                out[q + 3] = 0x80 | (cp & 0x3F)
                q += 4
                high = 0
                continue
            _lone_surrogate(c.pos, high)
        if unit < 0x80:
            out[q] = <uint8_t>unit
            q += 1
        elif unit < 0x800:
            out[q] = 0xC0 | (unit >> 6)
            out[q + 1] = 0x80 | (unit & 0x3F)
            q += 2
        elif 0xD800 <= unit <= 0xDBFF:
            high = unit
        elif 0xDC00 <= unit <= 0xDFFF:
            _lone_surrogate(c.pos, unit)
        else:
            out[q] = 0xE0 | (unit >> 12)
            out[q + 1] = 0x80 | ((unit >> 6) & 0x3F)
            out[q + 2] = 0x80 | (unit & 0x3F)
            q += 3
    if high:
        _lone_surrogate(c.pos, high)
    w.pos = start + q
    return 0


cdef int w_char(FCur *c, Writer *w) except -1:
    cdef uint32_t unit = be16(f_take(c, 2, "a Character"))
    cdef uint8_t *out
    if 0xD800 <= unit <= 0xDFFF:
        _lone_surrogate(c.pos - 2, unit)
    if unit < 0x80:
        w_u8(w, <uint8_t>unit)
    elif unit < 0x800:
        out = w_reserve(w, 2)
        out[0] = 0xC0 | (unit >> 6)
        out[1] = 0x80 | (unit & 0x3F)
    else:
        out = w_reserve(w, 3)
        out[0] = 0xE0 | (unit >> 12)
        out[1] = 0x80 | ((unit >> 6) & 0x3F)
        out[2] = 0x80 | (unit & 0x3F)
    return 0


cdef inline int w_f32(Writer *w, uint32_t bits) except -1:
    """RecordSerializer's float: every NaN written as the one canonical quiet NaN."""
    if (bits & 0x7F800000u) == 0x7F800000u and (bits & 0x007FFFFFu):
        bits = 0x7FC00000u
    memcpy(w_reserve(w, 4), &bits, 4)
    return 0


cdef inline double as_double64(uint64_t bits) noexcept nogil:
    cdef double d
    memcpy(&d, &bits, 8)
    return d


cdef inline double as_double32(uint32_t bits) noexcept nogil:
    cdef float f
    memcpy(&f, &bits, 4)
    return <double>f


cdef int _no_null(FCur *c, str what) except -1:
    raise StateSerializationError(f"at byte {c.pos}: a null {what} where keygroups' serializer takes none")


# ---- nodes -------------------------------------------------------------------------------------------------------

cdef class Node:
    """One position of a Flink serializer tree, compiled: reads Flink's bytes, writes keygroups' (see the top)."""
    cdef readonly int kind
    cdef readonly bint record      # inside a Row: RecordSerializer's format
    cdef readonly tuple children
    cdef readonly int padding      # a Nullable's padding bytes after a null
    cdef readonly bint row_kind    # a Row's mask has two RowKind bits
    cdef readonly Py_ssize_t length  # Flink's fixed length in bytes, or -1
    cdef Node a                    # List element, Map key, Nullable inner
    cdef Node b                    # Map value
    cdef Py_ssize_t nfields

    def __init__(self, int kind, bint record=False, tuple children=(), int padding=0, bint row_kind=False):
        cdef Node ch
        for ch in children:
            if ch is None:
                raise TypeError("node children must be Node objects")
        want = {F_LIST: 1, F_MAP: 2, F_NULLABLE: 1}.get(kind)
        if kind < F_LONG or kind > F_NULLABLE:
            raise ValueError(f"unknown Flink node kind {kind}")
        if want is not None and len(children) != want:
            raise ValueError(f"a node of kind {kind} takes {want} children, got {len(children)}")
        if want is None and kind not in (F_TUPLE, F_ROW) and children:
            raise ValueError(f"a scalar node of kind {kind} takes no children")
        if kind == F_TUPLE and not children:
            raise ValueError("a Tuple node needs at least one field")
        if padding < 0 or padding > 1024:
            raise ValueError(f"a Nullable's padding of {padding} bytes")
        self.kind = kind
        self.record = record
        self.children = children
        self.padding = padding
        self.row_kind = row_kind
        self.nfields = len(children)
        if want is not None:
            self.a = children[0]
        if want == 2:
            self.b = children[1]
        self.length = {F_LONG: 8, F_INT: 4, F_SHORT: 2, F_BYTE: 1, F_DOUBLE: 8, F_FLOAT: 4, F_BOOL: 1,
                       F_CHAR: 2}.get(kind, -1)

    def __repr__(self):
        return f"<flinkin.Node kind={self.kind}{' record' if self.record else ''} children={len(self.children)}>"

    def transcode(self, value) -> bytes:
        """The bytes of one whole Flink value (all of ``value``) as keygroups' serializer writes the same value."""
        cdef Py_buffer view
        cdef FCur c
        cdef Writer w
        PyObject_GetBuffer(value, &view, PyBUF_SIMPLE)
        w_init(&w)
        try:
            c.buf = <const uint8_t *>view.buf
            c.pos = 0
            c.end = view.len
            tc(self, &c, &w, M_TOP)
            if c.pos != c.end:
                _corrupt(c.pos, f"{c.end - c.pos} bytes follow the value")
            return w_result(&w)
        finally:
            w_free(&w)
            PyBuffer_Release(&view)


cdef int tc(Node n, FCur *c, Writer *w, int mode) except -1:
    """One Flink value of node ``n`` → keygroups' bytes (codec or record format, as ``n.record`` says)."""
    cdef int k = n.kind
    cdef uint32_t u32
    cdef uint64_t u64
    cdef int32_t count, i
    cdef int16_t s16
    cdef Py_ssize_t start
    cdef const uint8_t *p
    cdef Node field
    if k == F_NULLABLE:
        if f_flag(c, "a Nullable's null flag"):
            f_take(c, n.padding, "a Nullable's padding")
            if n.record and not (mode & M_NULLPOS):
                _no_null(c, "Nullable value")
            return w_u8(w, 0)
        if n.record:   # present: the inner value fills the record's nullable position, its own null included
            return tc(n.a, c, w, mode)
        # a NullableSerializer: a null anywhere inside (a Nullable's, a String's) is its null, written by the
        # outermost one; present, each level writes its 1
        if mode & M_NULLPOS:
            w_u8(w, 1)
        return tc(n.a, c, w, M_NULLPOS)
    if k == F_STRING:
        u32 = f_varint(c, 0x7FFFFFFF, "a String's length")
        if u32 == 0:
            if not (mode & M_NULLPOS):
                _no_null(c, "String")
            return w_u8(w, 0)
        if mode & M_NULLPOS:
            w_u8(w, 1)
        if mode & M_TOP:
            return w_string_body(c, u32 - 1, w)
        start = w_open_len(w)
        w_string_body(c, u32 - 1, w)
        return w_close_len(w, start)
    if mode & M_NULLPOS:
        w_u8(w, 1)
    if k == F_LONG:
        return w_i64(w, <int64_t>be64(f_take(c, 8, "a Long")))
    if k == F_INT:
        return w_u32(w, be32(f_take(c, 4, "an Integer")))
    if k == F_DOUBLE:
        return w_f64(w, as_double64(be64(f_take(c, 8, "a Double"))))
    if k == F_FLOAT:
        u32 = be32(f_take(c, 4, "a Float"))
        if n.record:
            return w_f32(w, u32)
        return w_f64(w, as_double32(u32))
    if k == F_SHORT:
        s16 = <int16_t>be16(f_take(c, 2, "a Short"))
        if n.record:
            memcpy(w_reserve(w, 2), &s16, 2)
            return 0
        return w_u32(w, <uint32_t><int32_t>s16)
    if k == F_BYTE:
        p = f_take(c, 1, "a Byte")
        if n.record:
            return w_u8(w, p[0])
        return w_u32(w, <uint32_t><int32_t><int8_t>p[0])
    if k == F_BOOL:
        return w_u8(w, <uint8_t>f_flag(c, "a Boolean"))
    if k == F_CHAR:
        if mode & M_TOP:
            return w_char(c, w)
        start = w_open_len(w)
        w_char(c, w)
        return w_close_len(w, start)
    if k == F_BYTES:
        count = <int32_t>be32(f_take(c, 4, "a byte[] length"))
        p = f_take(c, count, "a byte[]")
        if not (mode & M_TOP):
            w_u32(w, <uint32_t>count)
        return w_bytes(w, p, count)
    if k == F_TUPLE:
        for i in range(n.nfields):
            field = <Node>n.children[i]
            # a Tuple's fields are never null in Flink; in a record, a Nullable field is a nullable position
            tc(field, c, w, M_NULLPOS if (n.record and field.kind == F_NULLABLE) else 0)
        return 0
    if k == F_ROW:
        if n.record:
            return tc_row(n, c, w)
        if mode & M_TOP:     # a record at the top of a value: its bytes are the value
            return tc_row(n, c, w)
        start = w_open_len(w)   # a record nested in a codec value: an external serializer's u32 length + bytes
        tc_row(n, c, w)
        return w_close_len(w, start)
    if k == F_LIST:
        count = f_count(c, n.a.length if n.a.length > 1 else 1, "a List's size")
        w_u32(w, <uint32_t>count)
        for i in range(count):
            tc(n.a, c, w, M_NULLPOS if (n.record and n.a.kind == F_NULLABLE) else 0)
        return 0
    if k == F_MAP:
        if not n.record:
            return tc_sorted_map(n, c, w)
        count = f_count(c, (n.a.length if n.a.length > 1 else 1) + 1, "a Map's size")
        w_u32(w, <uint32_t>count)
        for i in range(count):
            tc(n.a, c, w, 0)
            if f_flag(c, "a Map value's null flag"):
                w_u8(w, 0)
            else:
                tc(n.b, c, w, M_NULLPOS)
        return 0
    raise AssertionError(f"unknown Flink node kind {k}")


cdef int tc_sorted_map(Node n, FCur *c, Writer *w) except -1:
    """A Map as keygroups' MapSerializer writes it: u32 count, then (key, value) pairs sorted by the key's bytes;
    no null values, no two keys of the same bytes (Flink's keys are distinct by Java's equals, and so are their
    bytes)."""
    cdef int32_t count = f_count(c, (n.a.length if n.a.length > 1 else 1) + 1, "a Map's size")
    cdef Py_ssize_t i, base, pos, size
    cdef int64_t *bounds = NULL      # entry i: [bounds[2i], bounds[2i + 1]) is its key, bounds[2i + 2] its end
    cdef Span *spans = NULL
    cdef uint8_t *tmp = NULL
    w_u32(w, <uint32_t>count)
    if count == 0:
        return 0
    base = w.pos
    try:
        bounds = <int64_t *>_realloc(NULL, (2 * count + 1) * sizeof(int64_t))
        for i in range(count):
            bounds[2 * i] = w.pos
            tc(n.a, c, w, 0)
            bounds[2 * i + 1] = w.pos
            if f_flag(c, "a Map value's null flag"):
                if n.b.kind != F_NULLABLE:
                    raise StateSerializationError(f"at byte {c.pos - 1}: a Map holding a null value; keygroups' "
                                                  f"MapSerializer of non-nullable values holds no nulls")
                w_u8(w, 0)     # the value's NullableSerializer writes the null
            else:
                tc(n.b, c, w, 0)
        bounds[2 * count] = w.pos
        size = w.pos - base
        tmp = <uint8_t *>_realloc(NULL, size if size else 1)
        memcpy(tmp, w.buf + base, size)
        spans = <Span *>_realloc(NULL, count * sizeof(Span))
        for i in range(count):
            spans[i].key = tmp + (bounds[2 * i] - base)
            spans[i].key_len = bounds[2 * i + 1] - bounds[2 * i]
            spans[i].index = i
        if not _sorted(spans, count):
            _sort_spans(spans, count)
        pos = base
        for i in range(count):
            if i and spans[i].key_len == spans[i - 1].key_len and memcmp(spans[i].key, spans[i - 1].key,
                                                                         spans[i].key_len) == 0:
                raise StateSerializationError(f"at byte {c.pos}: a Map with two keys of the same bytes")
            size = bounds[2 * spans[i].index + 2] - bounds[2 * spans[i].index]
            memcpy(w.buf + pos, tmp + (bounds[2 * spans[i].index] - base), size)
            pos += size
    finally:
        PyMem_Free(bounds)
        PyMem_Free(spans)
        PyMem_Free(tmp)
    return 0


cdef int tc_row(Node n, FCur *c, Writer *w) except -1:
    """A Row as a record: Flink's null mask (RowKind bits first, most significant bit first), then the present
    fields; keygroups writes every field as a nullable position."""
    cdef Py_ssize_t offset = 2 if n.row_kind else 0
    cdef Py_ssize_t nbits = n.nfields + offset
    cdef Py_ssize_t nbytes = (nbits + 7) // 8, i, bit
    cdef const uint8_t *mask = f_take(c, nbytes, "a Row's null mask")
    if offset and (mask[0] & 0xC0):
        _corrupt(c.pos - nbytes, "a Row whose RowKind is not INSERT (keygroups keeps only inserted rows)")
    for i in range(n.nfields):
        bit = offset + i
        if (mask[bit >> 3] >> (7 - (bit & 7))) & 1:
            w_u8(w, 0)
        else:
            tc(<Node>n.children[i], c, w, M_NULLPOS)
    return 0


# ---- the block scanner -------------------------------------------------------------------------------------------

cdef class BlockScan:
    """Where each entry of one key group's block lies: its state id, key (without the key-group prefix) and value,
    as offsets into the block. ``scan_block`` makes it; every span is inside the block."""
    cdef readonly object block
    cdef readonly Py_ssize_t n
    cdef Py_buffer view
    cdef bint has_view
    cdef int32_t *sid
    cdef int64_t *ks      # key start (after the prefix), key end = value length's offset
    cdef int64_t *ke
    cdef int64_t *vs
    cdef int64_t *ve
    cdef Py_ssize_t cap

    def __dealloc__(self):
        PyMem_Free(self.sid)
        PyMem_Free(self.ks)
        PyMem_Free(self.ke)
        PyMem_Free(self.vs)
        PyMem_Free(self.ve)
        if self.has_view:
            PyBuffer_Release(&self.view)

    def __len__(self):
        return self.n

    cdef int _grow(self) except -1:
        cdef Py_ssize_t cap = self.cap * 2 if self.cap else 256
        self.sid = <int32_t *>_realloc(self.sid, cap * sizeof(int32_t))
        self.ks = <int64_t *>_realloc(self.ks, cap * sizeof(int64_t))
        self.ke = <int64_t *>_realloc(self.ke, cap * sizeof(int64_t))
        self.vs = <int64_t *>_realloc(self.vs, cap * sizeof(int64_t))
        self.ve = <int64_t *>_realloc(self.ve, cap * sizeof(int64_t))
        self.cap = cap
        return 0

    def arrays(self):
        """(state ids, key starts, key ends, value starts, value ends) as numpy arrays of length n."""
        cdef Py_ssize_t i
        sid = np.empty(self.n, dtype=np.int32)
        spans = np.empty((4, self.n), dtype=np.int64)
        cdef int32_t[::1] s = sid
        cdef int64_t[:, ::1] o = spans
        for i in range(self.n):
            s[i] = self.sid[i]
            o[0, i] = self.ks[i]
            o[1, i] = self.ke[i]
            o[2, i] = self.vs[i]
            o[3, i] = self.ve[i]
        return sid, spans[0], spans[1], spans[2], spans[3]

    def counts(self, Py_ssize_t n_states):
        """The number of entries of each state id (a list of ``n_states`` ints)."""
        cdef Py_ssize_t i
        counts = np.zeros(n_states, dtype=np.int64)
        cdef int64_t[::1] c = counts
        for i in range(self.n):
            if 0 <= self.sid[i] < n_states:
                c[self.sid[i]] += 1
        return counts.tolist()


cdef void *_realloc(void *p, size_t size) except NULL:
    cdef void *q = PyMem_Realloc(p, size)
    if q == NULL:
        raise MemoryError()
    return q


def scan_block(object block, int key_group, int prefix_bytes, int n_states, str where):
    """Scan one key group's block (bytes-like; kept alive by the scan): every entry's state id and the spans of its
    key (after the key-group prefix) and value. CorruptSnapshotError names the byte offset of anything that does not
    fit: a length past the end, a state id the header does not list, an entry of another key group, trailing
    bytes."""
    cdef BlockScan s = BlockScan.__new__(BlockScan)
    cdef const uint8_t *buf
    cdef Py_ssize_t end, pos, kpos, vpos
    cdef int32_t klen, vlen
    cdef int state_id, nxt
    cdef uint8_t kg0, kg1
    cdef bint last
    if prefix_bytes != 1 and prefix_bytes != 2:
        raise ValueError(f"the key-group prefix is 1 or 2 bytes, not {prefix_bytes}")
    PyObject_GetBuffer(block, &s.view, PyBUF_SIMPLE)
    s.has_view = True
    s.block = block
    buf = <const uint8_t *>s.view.buf
    end = s.view.len
    kg0 = <uint8_t>((key_group >> 8) & 0xFF) if prefix_bytes == 2 else <uint8_t>(key_group & 0xFF)
    kg1 = <uint8_t>(key_group & 0xFF)
    if end < 2:
        raise CorruptSnapshotError(f"{where}: a key-group block of {end} bytes has no state id")
    state_id = <int16_t>be16(buf)
    if not 0 <= state_id < n_states:
        raise CorruptSnapshotError(f"{where} at byte 0: state id {state_id}; the header lists {n_states} states")
    pos = 2
    while True:
        if pos + 4 > end:
            raise CorruptSnapshotError(f"{where} at byte {pos}: a key length needs 4 bytes, {end - pos} remain "
                                       "(truncated or corrupt)")
        klen = <int32_t>be32(buf + pos)
        kpos = pos + 4
        if klen < prefix_bytes or klen > end - kpos - 4:
            raise CorruptSnapshotError(f"{where} at byte {pos}: a key of {klen} bytes (at least {prefix_bytes}) "
                                       f"does not fit the {end - kpos} remaining bytes")
        vlen = <int32_t>be32(buf + kpos + klen)
        vpos = kpos + klen + 4
        if vlen < 0 or vlen > end - vpos:
            raise CorruptSnapshotError(f"{where} at byte {kpos + klen}: a value of {vlen} bytes does not fit the "
                                       f"{end - vpos} remaining bytes")
        if (buf[kpos] & ~FIRST_BIT) != kg0 or (prefix_bytes == 2 and buf[kpos + 1] != kg1):
            kg = (buf[kpos] & ~FIRST_BIT & 0xFF) if prefix_bytes == 1 else \
                (((buf[kpos] & ~FIRST_BIT & 0xFF) << 8) | buf[kpos + 1])
            raise CorruptSnapshotError(f"{where} at byte {kpos}: an entry of key group {kg} in the block of key "
                                       f"group {key_group}")
        last = (buf[kpos] & FIRST_BIT) != 0
        if s.n == s.cap:
            s._grow()
        s.sid[s.n] = state_id
        s.ks[s.n] = kpos + prefix_bytes
        s.ke[s.n] = kpos + klen
        s.vs[s.n] = vpos
        s.ve[s.n] = vpos + vlen
        s.n += 1
        pos = vpos + vlen
        if last:
            if pos + 2 > end:
                raise CorruptSnapshotError(f"{where} at byte {pos}: the next state id needs 2 bytes, {end - pos} "
                                           "remain (truncated or corrupt)")
            nxt = be16(buf + pos)
            pos += 2
            if nxt == END_OF_KEY_GROUP:
                break
            if nxt >= n_states:
                raise CorruptSnapshotError(f"{where} at byte {pos - 2}: state id {nxt}; the header lists {n_states} "
                                           "states")
            state_id = nxt
    if pos != end:
        raise CorruptSnapshotError(f"{where} at byte {pos}: {end - pos} bytes follow the end of key group "
                                   f"{key_group}")
    return s


# ---- states ------------------------------------------------------------------------------------------------------

cdef struct Span:
    const uint8_t *key
    Py_ssize_t key_len
    Py_ssize_t index


cdef int _cmp_span(const void *a, const void *b) noexcept nogil:
    cdef const Span *x = <const Span *>a
    cdef const Span *y = <const Span *>b
    cdef int r = kg_key_cmp(x.key, x.key_len, y.key, y.key_len)
    if r:
        return r
    return -1 if x.index < y.index else (1 if x.index > y.index else 0)


cdef int _sort_spans(Span *spans, Py_ssize_t m) except -1:
    """Sort ``spans`` by key bytes, stably (ties keep their order). Keys of one length up to 8 bytes (a Long,
    Integer or Double key; a timestamp) are radix-sorted as big-endian integers; others by qsort."""
    cdef Py_ssize_t i, j, width = spans[0].key_len if m else 0, p
    cdef uint64_t v
    cdef uint64_t *keys = NULL
    cdef uint64_t *tmp_keys = NULL
    cdef Span *tmp = NULL
    cdef uint64_t *kswap
    cdef Span *sswap
    cdef Py_ssize_t counts[256]
    cdef Py_ssize_t total, c
    cdef unsigned int shift, b
    if m < 2:
        return 0
    for i in range(1, m):
        if spans[i].key_len != width:
            width = 9
            break
    if width > 8:
        qsort(spans, m, sizeof(Span), _cmp_span)
        return 0
    try:
        keys = <uint64_t *>_realloc(NULL, m * sizeof(uint64_t))
        tmp_keys = <uint64_t *>_realloc(NULL, m * sizeof(uint64_t))
        tmp = <Span *>_realloc(NULL, m * sizeof(Span))
        for i in range(m):
            v = 0
            for j in range(width):
                v = (v << 8) | spans[i].key[j]
            keys[i] = v
        for p in range(width):         # least significant byte (the key's last) first: LSD, stable
            shift = 8 * p
            for b in range(256):
                counts[b] = 0
            for i in range(m):
                counts[(keys[i] >> shift) & 0xFF] += 1
            if counts[keys[0] >> shift & 0xFF] == m:
                continue                   # every key has this byte: nothing to reorder
            total = 0
            for b in range(256):
                c = counts[b]
                counts[b] = total
                total += c
            for i in range(m):
                b = (keys[i] >> shift) & 0xFF
                tmp_keys[counts[b]] = keys[i]
                tmp[counts[b]] = spans[i]
                counts[b] += 1
            memcpy(keys, tmp_keys, m * sizeof(uint64_t))
            memcpy(spans, tmp, m * sizeof(Span))
    finally:
        PyMem_Free(keys)
        PyMem_Free(tmp_keys)
        PyMem_Free(tmp)
    return 0


cdef class KeyOrder:
    """The last order a key group's keys were sorted in (see ``StatePlan.transcode``)."""
    cdef bytes keys
    cdef int64_t *offsets
    cdef Py_ssize_t *perm
    cdef Py_ssize_t m

    def __dealloc__(self):
        PyMem_Free(self.offsets)
        PyMem_Free(self.perm)

    cdef bint same_keys(self, const uint8_t *keys, const int64_t *offsets, Py_ssize_t m):
        return self.keys is not None and self.m == m and PyBytes_GET_SIZE(self.keys) == offsets[m] and \
            memcmp(PyBytes_AS_STRING(self.keys), keys, offsets[m]) == 0 and \
            memcmp(self.offsets, offsets, (m + 1) * sizeof(int64_t)) == 0


cdef class StatePlan:
    """One keyed state's compiled import: its kind (VALUE_STATE for value, reducing and aggregating; LIST_STATE;
    MAP_STATE; TIMER_STATE), the job key's node, the value's (list element's, map value's; None for timers) and the
    map key's, and whether the values carry a TTL timestamp. Without ``namespace`` the state is in VoidNamespace
    (the one byte after the key); with it (a TimeWindow's node: a fixed-length namespace, so Flink writes no
    lengths between key and namespace) a state becomes keygroups' namespaced state, one map per key in entry
    order: namespace -> value (VALUE_STATE), namespace -> list (LIST_STATE; with TTL the list's latest timestamp),
    (namespace, user key) -> value (MAP_STATE); and a TIMER_STATE drops the namespace: a key's timers of several
    windows at one timestamp are its one timer there (the first kept)."""
    cdef readonly int kind
    cdef readonly bint ttl
    cdef readonly str name
    cdef Node key
    cdef Node value
    cdef Node user_key
    cdef Node namespace
    cdef Py_ssize_t namespace_length   # a namespace of fixed-length fields (a TimeWindow): its bytes, else -1

    def __init__(self, int kind, Node key, Node value=None, Node user_key=None, bint ttl=False, str name="",
                 Node namespace=None):
        cdef Node field
        if kind < S_VALUE or kind > S_TIMER:
            raise ValueError(f"unknown state kind {kind}")
        if key is None or key.record:
            raise ValueError("a state plan needs the job key's (codec) node")
        if kind != S_TIMER and value is None:
            raise ValueError("value, list and map states need the value's node")
        if kind == S_MAP and user_key is None:
            raise ValueError("a map state needs the map key's node")
        if kind == S_TIMER and ttl:
            raise ValueError("timers have no TTL")
        if namespace is not None and namespace.record:
            raise ValueError("a namespace is a codec node")
        self.kind = kind
        self.key = key
        self.value = value
        self.user_key = user_key
        self.ttl = ttl
        self.name = name
        self.namespace = namespace
        self.namespace_length = -1
        if namespace is not None:
            self.namespace_length = namespace.length
            if namespace.kind == F_TUPLE:
                self.namespace_length = 0
                for field in namespace.children:
                    if field.length < 0:
                        self.namespace_length = -1
                        break
                    self.namespace_length += field.length

    @property
    def namespaced(self) -> bool:
        return self.namespace is not None

    def transcode(self, BlockScan scan, int state_id, KeyOrder order=None):
        """This state's entries of ``scan`` (those of ``state_id``) as keygroups' keyed-state entries sorted by key
        bytes: ``(entries, key data, key offsets, value data, value offsets)``, entry i's key is
        ``key_data[key_offsets[i]:key_offsets[i + 1]]`` (one per key: a map state's entries and a key's timers are
        grouped into one value); ``entries`` counts Flink's entries. ``order`` (one per key group) remembers the
        last sort: the states of a key group mostly hold the same keys in the same order, sorted once."""
        cdef Py_ssize_t i, m = 0, j
        cdef Writer kw, vw
        cdef int64_t *ko = NULL
        cdef int64_t *vo = NULL
        cdef const uint8_t *buf = <const uint8_t *>scan.view.buf
        for i in range(scan.n):
            if scan.sid[i] == state_id:
                m += 1
        w_init(&kw)
        w_init(&vw)
        try:
            ko = <int64_t *>_realloc(NULL, (m + 1) * sizeof(int64_t))
            vo = <int64_t *>_realloc(NULL, (m + 1) * sizeof(int64_t))
            j = 0
            for i in range(scan.n):
                if scan.sid[i] != state_id:
                    continue
                ko[j] = kw.pos
                vo[j] = vw.pos
                self._entry(buf, scan.ks[i], scan.ke[i], scan.vs[i], scan.ve[i], &kw, &vw)
                j += 1
            ko[m] = kw.pos
            vo[m] = vw.pos
            if self.kind == S_TIMER and self.namespace is not None:
                return (m,) + _distinct_timers(_grouped(&kw, ko, &vw, vo, m))
            if self.kind == S_MAP or self.kind == S_TIMER or self.namespace is not None:   # a map per key
                return (m,) + _grouped(&kw, ko, &vw, vo, m)
            return (m,) + _sorted_entries(&kw, ko, &vw, vo, m, order)
        finally:
            PyMem_Free(ko)
            PyMem_Free(vo)
            w_free(&kw)
            w_free(&vw)

    cdef int _entry(self, const uint8_t *buf, Py_ssize_t ks, Py_ssize_t ke, Py_ssize_t vs, Py_ssize_t ve,
                    Writer *kw, Writer *vw) except -1:
        cdef FCur c
        cdef FCur v
        cdef Py_ssize_t frame, entry, key_start
        cdef uint64_t ts
        cdef int32_t j
        c.buf = buf
        c.pos = ks
        c.end = ke
        v.buf = buf
        v.pos = vs
        v.end = ve
        if self.kind == S_TIMER:
            ts = be64(f_take(&c, 8, "a timer timestamp")) ^ (<uint64_t>1 << 63)
            tc(self.key, &c, kw, M_TOP)
            if self.namespace_length >= 0:     # a window timer's window: dropped
                f_take(&c, self.namespace_length, "a timer's namespace")
            elif self.namespace is not None:
                _skip_namespace(self.namespace, &c)
            else:
                f_take(&c, 1, "a VoidNamespace")
            if c.pos != c.end:
                _corrupt(c.pos, f"{c.end - c.pos} bytes follow a timer's key and namespace")
            if v.end != v.pos:
                _corrupt(v.pos, f"a timer entry with a {v.end - v.pos}-byte value")
            # one entry of the timer map: timestamp (Int64) -> True (Bool)
            w_u32(vw, 4 + 8 + 1)
            w_u32(vw, 8)
            w_i64(vw, <int64_t>ts)
            return w_u8(vw, 1)
        tc(self.key, &c, kw, M_TOP)
        if self.namespace is not None and self.kind == S_LIST:
            return _list_entry(self, &c, &v, vw)
        if self.namespace is not None:   # one entry of the key's map: namespace (and user key) -> value
            return _map_frame(self, &c, &v, vw, True)
        f_take(&c, 1, "a VoidNamespace")
        if self.kind == S_MAP:
            return _map_frame(self, &c, &v, vw, False)
        if c.pos != c.end:
            _corrupt(c.pos, f"{c.end - c.pos} bytes follow the key and namespace")
        if self.kind == S_LIST:
            while v.pos < v.end:
                frame = w_open_len(vw)
                if self.ttl:
                    w_i64(vw, <int64_t>be64(f_take(&v, 8, "a TTL timestamp")))
                entry = vw.pos
                tc(self.value, &v, vw, M_TOP)
                w_set_len(vw, frame - 4, vw.pos - entry)   # a frame's length counts its element, not the timestamp
                if v.pos < v.end:
                    if f_take(&v, 1, "a list delimiter")[0] != LIST_DELIMITER:
                        _corrupt(v.pos - 1, f"list elements are separated by {LIST_DELIMITER:#x}, found "
                                            f"{buf[v.pos - 1]:#x}")
            return 0
        if self.ttl:
            w_i64(vw, <int64_t>be64(f_take(&v, 8, "a TTL timestamp")))
        tc(self.value, &v, vw, M_TOP)
        if v.pos != v.end:
            _corrupt(v.pos, f"{v.end - v.pos} bytes follow the value")
        return 0


cdef int _map_frame(StatePlan plan, FCur *c, FCur *v, Writer *vw, bint namespaced) except -1:
    """One frame of the key's keygroups map (u32 length, TTL timestamp, u32 key length, key, value): a map
    state's (user key -> value), a namespaced one's ((namespace, user key) -> value: a tuple's fields) or a
    namespaced value's (namespace -> value). ``c`` is past the job key (and VoidNamespace)."""
    cdef Py_ssize_t frame, key_start
    cdef bint user_key = plan.kind == S_MAP
    cdef uint64_t ts
    frame = w_open_len(vw)
    if plan.ttl:
        w_reserve(vw, 8)
    key_start = w_open_len(vw)
    if namespaced:
        tc(plan.namespace, c, vw, 0 if user_key else M_TOP)
    if user_key:
        tc(plan.user_key, c, vw, 0 if namespaced else M_TOP)
    w_close_len(vw, key_start)
    if c.pos != c.end:
        _corrupt(c.pos, f"{c.end - c.pos} bytes follow the key, namespace and user key" if user_key else
                 f"{c.end - c.pos} bytes follow the key and namespace")
    if user_key and f_flag(v, "a map value's null flag"):
        raise StateSerializationError(f"at byte {v.pos - 1}: map state {plan.name!r} holds a null value; "
                                      "keygroups map states hold no nulls")
    if plan.ttl:
        ts = be64(f_take(v, 8, "a TTL timestamp"))
        memcpy(vw.buf + frame, &ts, 8)
    tc(plan.value, v, vw, M_TOP)
    if v.pos != v.end:
        _corrupt(v.pos, f"{v.end - v.pos} bytes follow a map value" if user_key else
                 f"{v.end - v.pos} bytes follow the value")
    return w_set_len(vw, frame - 4, vw.pos - key_start + 4)   # the entry: key length, key, value


cdef int _list_entry(StatePlan plan, FCur *c, FCur *v, Writer *vw) except -1:
    """A namespaced list state's entry: one frame of the key's map, namespace -> the elements (a ListSerializer's
    u32 count and elements); with TTL the frame's timestamp is the elements' latest (keygroups keeps one)."""
    cdef Py_ssize_t frame, key_start, count_at, value_start
    cdef uint32_t count = 0
    cdef int64_t ts, latest = 0
    frame = w_open_len(vw)
    if plan.ttl:
        w_reserve(vw, 8)
    key_start = w_open_len(vw)
    tc(plan.namespace, c, vw, M_TOP)
    w_close_len(vw, key_start)
    if c.pos != c.end:
        _corrupt(c.pos, f"{c.end - c.pos} bytes follow the key and namespace")
    value_start = v.pos
    count_at = w_open_len(vw)
    while v.pos < v.end:
        if plan.ttl:
            ts = <int64_t>be64(f_take(v, 8, "a TTL timestamp"))
            if count == 0 or ts > latest:
                latest = ts
        tc(plan.value, v, vw, 0)
        count += 1
        if v.pos < v.end:
            if f_take(v, 1, "a list delimiter")[0] != LIST_DELIMITER:
                _corrupt(v.pos - 1, f"list elements are separated by {LIST_DELIMITER:#x}, found "
                                    f"{v.buf[v.pos - 1]:#x}")
    if plan.ttl:
        if count == 0:
            _corrupt(value_start, "an empty list with TTL (Flink writes no empty list)")
        memcpy(vw.buf + frame, &latest, 8)
    memcpy(vw.buf + count_at - 4, &count, 4)
    return w_set_len(vw, frame - 4, vw.pos - key_start + 4)


cdef int _skip_namespace(Node ns, FCur *c) except -1:
    """Past a namespace the plan drops (a window timer's window), checked as it would be read."""
    cdef Writer scratch
    w_init(&scratch)
    try:
        tc(ns, c, &scratch, M_TOP)
    finally:
        w_free(&scratch)
    return 0


cdef struct Stamp:
    int64_t ts
    Py_ssize_t index


cdef int _cmp_stamp(const void *a, const void *b) noexcept nogil:
    cdef const Stamp *x = <const Stamp *>a
    cdef const Stamp *y = <const Stamp *>b
    if x.ts != y.ts:
        return -1 if x.ts < y.ts else 1
    return -1 if x.index < y.index else (1 if x.index > y.index else 0)


cdef enum:
    TIMER_FRAME = 17     # a timer map entry: u32 frame length, u32 key length, i64 timestamp, bool True


cdef tuple _distinct_timers(tuple grouped):
    """Grouped timer maps with each key's repeated timestamps dropped (the first kept, in order): a key's window
    timers at one timestamp (two windows' cleanup and trigger) are one keygroups timer."""
    cdef bytes kd = grouped[0]
    cdef bytes vd = grouped[2]
    cdef int64_t[::1] vo = grouped[3]
    cdef Py_ssize_t g = vo.shape[0] - 1, i, j, n
    cdef const uint8_t *src = <const uint8_t *>PyBytes_AS_STRING(vd)
    cdef Stamp *stamps = NULL
    cdef uint8_t *keep = NULL
    cdef Writer ow
    cdef int64_t ts
    out_offsets = np.empty(g + 1, dtype=np.int64)
    cdef int64_t[::1] oo = out_offsets
    w_init(&ow)
    try:
        w_reserve(&ow, PyBytes_GET_SIZE(vd))
        ow.pos = 0
        for i in range(g):
            oo[i] = ow.pos
            n = (vo[i + 1] - vo[i]) // TIMER_FRAME
            if n < 2:
                w_bytes(&ow, src + vo[i], vo[i + 1] - vo[i])
                continue
            stamps = <Stamp *>_realloc(stamps, n * sizeof(Stamp))
            keep = <uint8_t *>_realloc(keep, n)
            for j in range(n):
                memcpy(&ts, src + vo[i] + j * TIMER_FRAME + 8, 8)
                stamps[j].ts = ts
                stamps[j].index = j
                keep[j] = 0
            qsort(stamps, n, sizeof(Stamp), _cmp_stamp)
            for j in range(n):
                if j == 0 or stamps[j].ts != stamps[j - 1].ts:
                    keep[stamps[j].index] = 1
            for j in range(n):
                if keep[j]:
                    w_bytes(&ow, src + vo[i] + j * TIMER_FRAME, TIMER_FRAME)
        oo[g] = ow.pos
        return kd, grouped[1], w_result(&ow), out_offsets
    finally:
        PyMem_Free(stamps)
        PyMem_Free(keep)
        w_free(&ow)


cdef object _offsets(const int64_t *o, Py_ssize_t m):
    out = np.empty(m + 1, dtype=np.int64)
    cdef int64_t[::1] view = out
    memcpy(&view[0], o, (m + 1) * sizeof(int64_t))
    return out


cdef tuple _sorted_entries(Writer *kw, const int64_t *ko, Writer *vw, const int64_t *vo, Py_ssize_t m,
                           KeyOrder order):
    """One entry per key, sorted by key bytes (stably)."""
    cdef Span *spans = NULL
    cdef Py_ssize_t *perm
    cdef Py_ssize_t i, s
    cdef int64_t *nk = NULL
    cdef int64_t *nv = NULL
    cdef Writer ow, okw
    if m < 2 or _sorted_offsets(kw.buf, ko, m):
        return w_result(kw), _offsets(ko, m), w_result(vw), _offsets(vo, m)
    if order is None:
        order = KeyOrder.__new__(KeyOrder)
    if not order.same_keys(kw.buf, ko, m):
        spans = <Span *>_realloc(NULL, m * sizeof(Span))
        try:
            for i in range(m):
                spans[i].key = kw.buf + ko[i]
                spans[i].key_len = ko[i + 1] - ko[i]
                spans[i].index = i
            _sort_spans(spans, m)
            order.perm = <Py_ssize_t *>_realloc(order.perm, m * sizeof(Py_ssize_t))
            order.offsets = <int64_t *>_realloc(order.offsets, (m + 1) * sizeof(int64_t))
            for i in range(m):
                order.perm[i] = spans[i].index
            memcpy(order.offsets, ko, (m + 1) * sizeof(int64_t))
            order.keys = PyBytes_FromStringAndSize(<const char *>kw.buf, ko[m])
            order.m = m
        finally:
            PyMem_Free(spans)
    perm = order.perm
    w_init(&ow)
    w_init(&okw)
    try:
        nk = <int64_t *>_realloc(NULL, (m + 1) * sizeof(int64_t))
        nv = <int64_t *>_realloc(NULL, (m + 1) * sizeof(int64_t))
        w_reserve(&okw, ko[m])
        w_reserve(&ow, vo[m])
        okw.pos = 0
        ow.pos = 0
        for i in range(m):
            s = perm[i]
            nk[i] = okw.pos
            nv[i] = ow.pos
            w_bytes(&okw, kw.buf + ko[s], ko[s + 1] - ko[s])
            w_bytes(&ow, vw.buf + vo[s], vo[s + 1] - vo[s])
        nk[m] = okw.pos
        nv[m] = ow.pos
        return w_result(&okw), _offsets(nk, m), w_result(&ow), _offsets(nv, m)
    finally:
        PyMem_Free(nk)
        PyMem_Free(nv)
        w_free(&ow)
        w_free(&okw)


cdef bint _sorted_offsets(const uint8_t *buf, const int64_t *o, Py_ssize_t m) noexcept nogil:
    cdef Span a, b
    cdef Py_ssize_t i
    for i in range(1, m):
        a.key = buf + o[i - 1]
        a.key_len = o[i] - o[i - 1]
        a.index = i - 1
        b.key = buf + o[i]
        b.key_len = o[i + 1] - o[i]
        b.index = i
        if _cmp_span(&a, &b) > 0:
            return False
    return True


cdef inline bint _same_key(const uint8_t *buf, const int64_t *o, Py_ssize_t i, Py_ssize_t j) noexcept nogil:
    cdef int64_t n = o[i + 1] - o[i]
    return n == o[j + 1] - o[j] and (n == 0 or memcmp(buf + o[i], buf + o[j], n) == 0)


cdef tuple _grouped(Writer *kw, const int64_t *ko, Writer *vw, const int64_t *vo, Py_ssize_t m):
    """Entries with equal keys (a map state's entries of one key, a key's timers) as one entry per key, sorted by
    key bytes, its value the concatenation of their frames in entry order (a map value is its entries' frames back
    to back). Runs of equal keys (a key's map entries are adjacent in Flink's blocks) are grouped first."""
    cdef Span *runs = NULL
    cdef int64_t *run_end = NULL
    cdef Py_ssize_t i, r = 0, g = 0, j, s
    cdef Writer ow, okw
    cdef int64_t *gk = NULL
    cdef int64_t *gv = NULL
    w_init(&ow)
    w_init(&okw)
    try:
        runs = <Span *>_realloc(NULL, (m if m else 1) * sizeof(Span))
        run_end = <int64_t *>_realloc(NULL, (m + 1) * sizeof(int64_t))   # by first entry: one past its last
        gk = <int64_t *>_realloc(NULL, (m + 1) * sizeof(int64_t))
        gv = <int64_t *>_realloc(NULL, (m + 1) * sizeof(int64_t))
        i = 0
        while i < m:
            j = i + 1
            while j < m and _same_key(kw.buf, ko, i, j):
                j += 1
            runs[r].key = kw.buf + ko[i]
            runs[r].key_len = ko[i + 1] - ko[i]
            runs[r].index = i
            run_end[i] = j
            r += 1
            i = j
        if not _sorted(runs, r):
            _sort_spans(runs, r)
        i = 0
        w_reserve(&ow, vo[m])
        ow.pos = 0
        while i < r:
            gk[g] = okw.pos
            gv[g] = ow.pos
            w_bytes(&okw, runs[i].key, runs[i].key_len)
            j = i
            while j < r and runs[j].key_len == runs[i].key_len and (
                    runs[i].key_len == 0 or memcmp(runs[j].key, runs[i].key, runs[i].key_len) == 0):
                s = runs[j].index   # the run's entries' frames are adjacent: one copy
                w_bytes(&ow, vw.buf + vo[s], vo[run_end[s]] - vo[s])
                j += 1
            g += 1
            i = j
        gk[g] = okw.pos
        gv[g] = ow.pos
        return w_result(&okw), _offsets(gk, g), w_result(&ow), _offsets(gv, g)
    finally:
        PyMem_Free(runs)
        PyMem_Free(run_end)
        PyMem_Free(gk)
        PyMem_Free(gv)
        w_free(&ow)
        w_free(&okw)


cdef bint _sorted(const Span *spans, Py_ssize_t m) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(1, m):
        if _cmp_span(&spans[i - 1], &spans[i]) > 0:
            return False
    return True
