# cython: auto_pickle=False
# keygroups state -> Flink's canonical savepoint bytes, compiled: what keygroups.flink.exporter writes per key group.
#
# An Op is one position of a value (the value, a field, a list element, a map key or value), built by the exporter
# as a tree from the state's keygroups serializer (the source: codec.pyx's typed formats, records.pyx's record
# format, little-endian, u32 lengths) and the Flink serializer it is written as (the target: flink/types.py's
# formats, big-endian). It reads the keygroups bytes through the checked cursor (cursor.pxd) and writes Flink's
# bytes of the same value, without a Python object per value:
#
#   ints (1/2/4/8 bytes) -> Byte/Short/Integer/Long, range-checked | float32/64 -> Float (exact only)/Double
#   bool -> Boolean | UTF-8 str -> String (StringValue: varint length + 1, each UTF-16 unit a varint) or Character
#   bytes -> byte[] (int length) | tuple/record -> TupleN (no null field) or Row (null mask, RowKind bits first)
#   list -> List (int count) | map -> Map (int count, then key, null flag, value) | Flink Nullable: a flag first
#
# A BlockWriter writes one key group's block (FullSnapshotAsyncWriter's format, see keygroups/flink/keyed.py): per
# state its id, its (int length, key, int length, value) pairs, the first key byte of the run's last pair flagged
# 0x80, then the next state's id or 0xFFFF. A key is the key-group prefix (1 or 2 bytes), the Flink key, the
# VoidNamespace byte and, for map state, the user key; a timer's key is the prefix, the timestamp with its sign bit
# flipped, the key and the namespace.
#
# Every length and count read from keygroups bytes is checked against what remains (cursor.pxd), so corrupt input
# raises CorruptSnapshotError and nothing reads past a buffer; a value Flink's serializer cannot hold (a null list
# element, an int out of a Short's range, a double that is no float) raises UnrepresentableValue, whose ``index`` is
# the key's position in the state's entries: the exporter then names the state and the key.
cimport cython

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from libc.math cimport isnan
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport bsearch, qsort
from libc.string cimport memcmp, memcpy, memset

from cursor cimport Cursor, cur_corrupt, cur_count, cur_i32, cur_i64, cur_init, cur_read, cur_remaining, cur_u8, cur_u32
from writer cimport Writer, w_bytes, w_free, w_init, w_reserve, w_result, w_u8
from keysearch cimport kg_key_cmp

import sys

from keygroups.errors import CorruptSnapshotError

if sys.byteorder != "little":   # the cursor reads keygroups' little-endian integers with memcpy
    raise ImportError("keygroups._native.flinkout needs a little-endian host")

cdef extern from *:
    """
    static inline void kg_put_be16(uint8_t *p, uint16_t v) { v = __builtin_bswap16(v); memcpy(p, &v, 2); }
    static inline void kg_put_be32(uint8_t *p, uint32_t v) { v = __builtin_bswap32(v); memcpy(p, &v, 4); }
    static inline void kg_put_be64(uint8_t *p, uint64_t v) { v = __builtin_bswap64(v); memcpy(p, &v, 8); }
    """
    void kg_put_be16(uint8_t *p, uint16_t v) nogil
    void kg_put_be32(uint8_t *p, uint32_t v) nogil
    void kg_put_be64(uint8_t *p, uint64_t v) nogil

# Java's canonical NaNs (Double.doubleToLongBits, Float.floatToIntBits).
cdef uint64_t JAVA_NAN_64 = 0x7FF8000000000000ULL
cdef uint32_t JAVA_NAN_32 = 0x7FC00000U

# Source kinds: how keygroups stored the value.
cdef enum:
    S_I8 = 1
    S_I16 = 2
    S_I32 = 3
    S_I64 = 4
    S_F32 = 5
    S_F64 = 6
    S_BOOL = 7
    S_STR = 8
    S_BYTES = 9
    S_TUPLE = 10       # codec tuple: the fields in order
    S_RECORD = 11      # record: the fields in order, each nullable one behind its flag byte
    S_LIST = 12
    S_MAP = 13
    S_EXTERNAL = 14    # a record nested in a codec composite: u32 length, then the record

# Target kinds: the Flink serializer written.
cdef enum:
    D_DELEGATE = 0     # S_EXTERNAL: the child writes
    D_BYTE = 1
    D_SHORT = 2
    D_INT = 3
    D_LONG = 4
    D_FLOAT = 5
    D_DOUBLE = 6
    D_BOOL = 7
    D_CHAR = 8
    D_STRING = 9
    D_BYTES = 10
    D_TUPLE = 11
    D_ROW = 12
    D_LIST = 13
    D_MAP = 14

# What a null at a position becomes.
cdef enum:
    N_REFUSE = 0       # Flink's serializer there cannot write null
    N_PARENT = 1       # the parent marks it (a Row's null mask, a Map value's null flag)
    N_NULLABLE = 2     # Flink's NullableSerializer: flag 1, then its padding
    N_STRING = 3       # Flink's StringSerializer writes null as the length 0

# State kinds of a StateTranscoder.
cdef enum:
    K_VALUE = 0
    K_LIST = 1
    K_MAP = 2
    K_TIMER = 3
    K_WINDOW = 4         # keygroups' namespaced value state (a map window -> value): one Flink pair per window
    K_WINDOW_TIMER = 5   # keygroups' timers as a WindowOperator's: one per window of the key (see add_state)
    K_WINDOW_LIST = 6    # a namespaced list state (a map window -> list): one Flink list per window
    K_WINDOW_MAP = 7     # a namespaced map state (a map (window, user key) -> value): one Flink pair per entry

# How a namespaced map state's user keys sort (as Python sorts them): keygroups' codec bytes in a tuple.
cdef enum:
    UK_UTF8 = 1          # str or bytes: u32 length, then the bytes (UTF-8 sorts as code points do)
    UK_I64 = 2
    UK_I32 = 3

cdef enum:
    LIST_DELIMITER = 0x2C
    FIRST_BIT = 0x80
    END_OF_KEY_GROUP = 0xFFFF

I8, I16, I32, I64, F32, F64, BOOL, STR, BYTES = S_I8, S_I16, S_I32, S_I64, S_F32, S_F64, S_BOOL, S_STR, S_BYTES
TUPLE, RECORD, LIST, MAP, EXTERNAL = S_TUPLE, S_RECORD, S_LIST, S_MAP, S_EXTERNAL
DELEGATE, BYTE, SHORT, INT, LONG, FLOAT, DOUBLE = D_DELEGATE, D_BYTE, D_SHORT, D_INT, D_LONG, D_FLOAT, D_DOUBLE
BOOLEAN, CHAR, STRING, BYTE_ARRAY, FLINK_TUPLE, ROW = D_BOOL, D_CHAR, D_STRING, D_BYTES, D_TUPLE, D_ROW
FLINK_LIST, FLINK_MAP = D_LIST, D_MAP
NULL_REFUSED, NULL_TO_PARENT, NULL_AS_NULLABLE, NULL_AS_STRING = N_REFUSE, N_PARENT, N_NULLABLE, N_STRING
VALUE_STATE, LIST_STATE, MAP_STATE, TIMER_STATE = K_VALUE, K_LIST, K_MAP, K_TIMER
WINDOW_STATE, WINDOW_TIMER_STATE, WINDOW_LIST_STATE, WINDOW_MAP_STATE = K_WINDOW, K_WINDOW_TIMER, K_WINDOW_LIST, K_WINDOW_MAP
USER_KEY_UTF8, USER_KEY_I64, USER_KEY_I32 = UK_UTF8, UK_I64, UK_I32


class UnrepresentableValue(ValueError):
    """A value that Flink's serializer of its position cannot hold; ``index`` is its key's position among the
    state's entries of the key group (-1 outside ``BlockWriter.add_state``)."""

    def __init__(self, message: str, index: int = -1) -> None:
        super().__init__(message)
        self.index = index


cdef inline bint _is_int(int s) noexcept:
    return S_I8 <= s <= S_I64


cdef inline bint _is_float(int s) noexcept:
    return s == S_F32 or s == S_F64


cdef dict _TARGET_NAMES = {D_DELEGATE: "(the record)", D_BYTE: "Byte", D_SHORT: "Short", D_INT: "Integer",
                           D_LONG: "Long", D_FLOAT: "Float", D_DOUBLE: "Double", D_BOOL: "Boolean",
                           D_CHAR: "Character", D_STRING: "String", D_BYTES: "byte[]", D_TUPLE: "Tuple",
                           D_ROW: "Row", D_LIST: "List", D_MAP: "Map"}


@cython.final
cdef class Op:
    """One position's transcoding: read keygroups' ``src`` form, write Flink's ``dst`` serializer."""
    cdef readonly int src, dst, null_mode, padding
    cdef readonly bint src_nullable, dst_nullable, whole, row_kind
    cdef readonly tuple children
    cdef readonly str what
    cdef readonly Py_ssize_t min_size      # the fewest keygroups bytes a value here takes (count checks)
    cdef Py_ssize_t n
    cdef Op a, b

    def __init__(self, int src, int dst, tuple children=(), *, bint src_nullable=False, bint dst_nullable=False,
                 int padding=0, int null_mode=N_REFUSE, bint whole=False, bint row_kind=True, str what=""):
        cdef Op ch
        cdef Py_ssize_t total = 0
        if self.what is not None:   # built once: a child made later cannot contain its parent (no cycle to recurse)
            raise TypeError("an Op cannot be initialized twice")
        if not S_I8 <= src <= S_EXTERNAL:
            raise ValueError(f"unknown source kind {src}")
        if not D_DELEGATE <= dst <= D_MAP:
            raise ValueError(f"unknown target kind {dst}")
        if not N_REFUSE <= null_mode <= N_STRING:
            raise ValueError(f"unknown null mode {null_mode}")
        if not 0 <= padding <= 1024:
            raise ValueError(f"a Nullable's padding of {padding} bytes")
        for ch in children:
            if ch is None:
                raise TypeError("an Op's children must be Op objects")
        ok = ((_is_int(src) and D_BYTE <= dst <= D_LONG) or (_is_float(src) and dst in (D_FLOAT, D_DOUBLE))
              or (src == S_BOOL and dst == D_BOOL) or (src == S_STR and dst in (D_STRING, D_CHAR))
              or (src == S_BYTES and dst == D_BYTES)
              or (src in (S_TUPLE, S_RECORD) and dst in (D_TUPLE, D_ROW) and len(children) >= 1)
              or (src == S_LIST and dst == D_LIST and len(children) == 1)
              or (src == S_MAP and dst == D_MAP and len(children) == 2)
              or (src == S_EXTERNAL and dst == D_DELEGATE and len(children) == 1))
        if not ok:
            raise ValueError(f"source kind {src} cannot be written as Flink's {_TARGET_NAMES[dst]} with "
                             f"{len(children)} children")
        if len(children) and not (src in (S_TUPLE, S_RECORD, S_LIST, S_MAP, S_EXTERNAL)):
            raise ValueError(f"source kind {src} has no children")
        if whole and src not in (S_STR, S_BYTES):
            raise ValueError("only a str or bytes value runs to the end of its buffer")
        if whole and src_nullable:
            raise ValueError("a nullable value carries its own length")
        self.src, self.dst, self.children = src, dst, children
        self.src_nullable, self.dst_nullable, self.padding = src_nullable, dst_nullable, padding
        self.null_mode, self.whole, self.row_kind = null_mode, whole, row_kind
        self.what = what or _TARGET_NAMES[dst]
        self.n = len(children)
        if self.n >= 1:
            self.a = children[0]
        if self.n == 2:
            self.b = children[1]
        if src == S_I8 or src == S_BOOL:
            total = 1
        elif src == S_I16:
            total = 2
        elif src == S_I32 or src == S_F32:
            total = 4
        elif src == S_I64 or src == S_F64:
            total = 8
        elif src == S_TUPLE or src == S_RECORD:
            for ch in children:
                total += ch.min_size
        else:
            total = 0 if whole else 4
        self.min_size = 1 if src_nullable else total

    def __repr__(self):
        return f"<Op {self.what}>"

    def transcode(self, data) -> bytes:
        """The Flink bytes of the one keygroups value ``data`` holds (for tests and single values)."""
        cdef Py_buffer view
        cdef Writer w
        w_init(&w)
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            _whole(self, <const uint8_t *>view.buf, view.len, &w)
            return w_result(&w)
        finally:
            PyBuffer_Release(&view)
            w_free(&w)


# ---- writing Flink's big-endian forms -------------------------------------------------------------------------------

cdef extern from *:
    """
    #define KGO_INT64_MIN_ ((int64_t)(-9223372036854775807LL - 1))
    #define KGO_INT64_MAX_ ((int64_t)9223372036854775807LL)
    static inline int64_t kgo_load_i64(const uint8_t *p) { int64_t v; memcpy(&v, p, 8); return v; }
    """
    int64_t INT64_MIN_ "KGO_INT64_MIN_"
    int64_t INT64_MAX_ "KGO_INT64_MAX_"
    int64_t _load_i64 "kgo_load_i64"(const uint8_t *p) nogil


cdef inline int put_be16(Writer *w, uint16_t v) except -1:
    kg_put_be16(w_reserve(w, 2), v)
    return 0


cdef inline int put_be32(Writer *w, uint32_t v) except -1:
    kg_put_be32(w_reserve(w, 4), v)
    return 0


cdef inline int put_be64(Writer *w, uint64_t v) except -1:
    kg_put_be64(w_reserve(w, 8), v)
    return 0


cdef inline int put_varint(Writer *w, uint32_t v) except -1:
    while v >= 0x80:
        w_u8(w, <uint8_t>((v & 0x7F) | 0x80))
        v >>= 7
    return w_u8(w, <uint8_t>v)


cdef int refuse(Op op, str why) except -1:
    raise UnrepresentableValue(f"Flink's {op.what} cannot hold {why}")


# ---- strings -------------------------------------------------------------------------------------------------------

cdef inline Py_ssize_t utf8_next(const uint8_t *p, Py_ssize_t n, Py_ssize_t i, uint32_t *cp) noexcept nogil:
    """The code point at p[i] (strict UTF-8, as Python decodes it: no overlong form, no surrogate, at most
    U+10FFFF) and the index after it; -1 if the bytes there are not UTF-8."""
    cdef uint8_t b0 = p[i], b1, b2, b3
    if b0 < 0x80:
        cp[0] = b0
        return i + 1
    if b0 < 0xC2:
        return -1
    if b0 < 0xE0:
        if i + 1 >= n:
            return -1
        b1 = p[i + 1]
        if b1 & 0xC0 != 0x80:
            return -1
        cp[0] = ((b0 & 0x1F) << 6) | (b1 & 0x3F)
        return i + 2
    if b0 < 0xF0:
        if i + 2 >= n:
            return -1
        b1, b2 = p[i + 1], p[i + 2]
        if b2 & 0xC0 != 0x80:
            return -1
        if b0 == 0xE0:
            if not 0xA0 <= b1 <= 0xBF:
                return -1
        elif b0 == 0xED:
            if not 0x80 <= b1 <= 0x9F:
                return -1
        elif b1 & 0xC0 != 0x80:
            return -1
        cp[0] = ((b0 & 0x0F) << 12) | ((b1 & 0x3F) << 6) | (b2 & 0x3F)
        return i + 3
    if b0 < 0xF5:
        if i + 3 >= n:
            return -1
        b1, b2, b3 = p[i + 1], p[i + 2], p[i + 3]
        if b2 & 0xC0 != 0x80 or b3 & 0xC0 != 0x80:
            return -1
        if b0 == 0xF0:
            if not 0x90 <= b1 <= 0xBF:
                return -1
        elif b0 == 0xF4:
            if not 0x80 <= b1 <= 0x8F:
                return -1
        elif b1 & 0xC0 != 0x80:
            return -1
        cp[0] = ((b0 & 0x07) << 18) | ((b1 & 0x3F) << 12) | ((b2 & 0x3F) << 6) | (b3 & 0x3F)
        return i + 4
    return -1


cdef int bad_utf8(Cursor *c, Py_ssize_t n, Py_ssize_t at) except -1:
    return cur_corrupt(c, f"a string of {n} bytes is not valid UTF-8 (byte {at})")


cdef int write_string(Cursor *c, Writer *w, const uint8_t *p, Py_ssize_t n) except -1:
    """Flink's StringValue of the UTF-8 string p[0:n]: varint (UTF-16 units + 1), then each unit as a varint."""
    cdef Py_ssize_t i = 0, j, units = 0
    cdef uint32_t cp
    cdef bint ascii = True
    for i in range(n):
        if p[i] >= 0x80:
            ascii = False
            break
    if ascii:
        if n >= 0x7FFFFFFF:
            raise UnrepresentableValue(f"a String of {n} characters is longer than Java's")
        put_varint(w, <uint32_t>(n + 1))
        return w_bytes(w, p, n)
    i = 0
    while i < n:
        j = utf8_next(p, n, i, &cp)
        if j < 0:
            bad_utf8(c, n, i)
        units += 2 if cp > 0xFFFF else 1
        i = j
    if units >= 0x7FFFFFFF:
        raise UnrepresentableValue(f"a String of {units} characters is longer than Java's")
    put_varint(w, <uint32_t>(units + 1))
    i = 0
    while i < n:
        if p[i] < 0x80:
            w_u8(w, p[i])
            i += 1
            continue
        i = utf8_next(p, n, i, &cp)
        if cp > 0xFFFF:
            cp -= 0x10000
            put_varint(w, 0xD800 + (cp >> 10))
            put_varint(w, 0xDC00 + (cp & 0x3FF))
        else:
            put_varint(w, cp)
    return 0


cdef int write_char(Op op, Cursor *c, Writer *w, const uint8_t *p, Py_ssize_t n) except -1:
    cdef uint32_t cp = 0
    cdef Py_ssize_t j = utf8_next(p, n, 0, &cp) if n > 0 else 0
    if n > 0 and j < 0:
        bad_utf8(c, n, 0)
    if n == 0 or j != n or cp > 0xFFFF:
        if n > 0 and j != n:   # still check the rest is text: corrupt bytes are reported as such
            while j < n:
                j = utf8_next(p, n, j, &cp)
                if j < 0:
                    bad_utf8(c, n, 0)
        refuse(op, f"a string of {n} UTF-8 bytes: it holds one UTF-16 code unit")
    return put_be16(w, <uint16_t>cp)


# ---- one value -----------------------------------------------------------------------------------------------------

cdef int null_out(Op op, Writer *w) except -1:
    """A null at op's position: 1 when the parent marks it, else 0 after writing what Flink writes for null."""
    if op.null_mode == N_PARENT:
        return 1
    if op.null_mode == N_NULLABLE:
        w_u8(w, 1)
        if op.padding:
            memset(w_reserve(w, op.padding), 0, op.padding)
        return 0
    if op.null_mode == N_STRING:
        w_u8(w, 0)
        return 0
    refuse(op, "null")
    return -1


cdef int write_int(Op op, Writer *w, int64_t v) except -1:
    if op.dst == D_LONG:
        return put_be64(w, <uint64_t>v)
    if op.dst == D_INT:
        if v < -2147483648LL or v > 2147483647LL:
            refuse(op, f"{v}: outside [-2147483648, 2147483647]")
        return put_be32(w, <uint32_t><int32_t>v)
    if op.dst == D_SHORT:
        if v < -32768 or v > 32767:
            refuse(op, f"{v}: outside [-32768, 32767]")
        return put_be16(w, <uint16_t><int16_t>v)
    if v < -128 or v > 127:
        refuse(op, f"{v}: outside [-128, 127]")
    return w_u8(w, <uint8_t><int8_t>v)


cdef int xc(Op op, Cursor *c, Writer *w) except -1:
    """Transcode one value at op's position; 1 when it is null and the parent marks it, else 0."""
    cdef int s = op.src, r
    cdef uint8_t flag
    cdef int64_t iv
    cdef int16_t i16
    cdef uint32_t u32
    cdef uint64_t u64
    cdef float f32
    cdef double f64
    cdef Py_ssize_t n, i, mask_pos, nbytes, bit, flag_pos
    cdef const uint8_t *p
    cdef Cursor sub
    cdef Op ch
    if op.src_nullable:
        flag = cur_u8(c)
        if flag == 0:
            return null_out(op, w)
        if flag != 1:
            c.pos -= 1
            cur_corrupt(c, f"a null flag of {flag} (only 0 and 1 are valid)")
    if op.dst_nullable:
        w_u8(w, 0)
    if s == S_I64:
        return write_int(op, w, cur_i64(c))
    if s == S_I32:
        return write_int(op, w, cur_i32(c))
    if s == S_I16:
        memcpy(&i16, cur_read(c, 2), 2)
        return write_int(op, w, i16)
    if s == S_I8:
        return write_int(op, w, <int8_t>cur_u8(c))
    # Java's writeDouble/writeFloat write doubleToLongBits/floatToIntBits: every NaN as the one canonical NaN.
    if s == S_F64:
        memcpy(&u64, cur_read(c, 8), 8)
        memcpy(&f64, &u64, 8)
        if op.dst == D_DOUBLE:
            return put_be64(w, JAVA_NAN_64 if isnan(f64) else u64)
        f32 = <float>f64
        if not isnan(f64) and <double>f32 != f64:
            refuse(op, f"{f64!r}: it is not exactly a Java float")
        memcpy(&u32, &f32, 4)
        return put_be32(w, JAVA_NAN_32 if isnan(f64) else u32)
    if s == S_F32:
        memcpy(&u32, cur_read(c, 4), 4)
        memcpy(&f32, &u32, 4)
        if op.dst == D_FLOAT:
            return put_be32(w, JAVA_NAN_32 if isnan(f32) else u32)
        f64 = <double>f32
        memcpy(&u64, &f64, 8)
        return put_be64(w, JAVA_NAN_64 if isnan(f64) else u64)
    if s == S_BOOL:
        flag = cur_u8(c)
        if flag > 1:
            c.pos -= 1
            cur_corrupt(c, f"a bool byte of {flag} (only 0 and 1 are valid)")
        return w_u8(w, flag)
    if s == S_STR or s == S_BYTES:
        n = cur_remaining(c) if op.whole else cur_count(c, 1, "a str length" if s == S_STR else "a bytes length")
        p = cur_read(c, n)
        if s == S_BYTES:
            if n > 0x7FFFFFFF:
                refuse(op, f"{n} bytes: Java arrays hold at most 2^31 - 1")
            put_be32(w, <uint32_t>n)
            return w_bytes(w, p, n)
        if op.dst == D_CHAR:
            return write_char(op, c, w, p, n)
        return write_string(c, w, p, n)
    if s == S_TUPLE or s == S_RECORD:
        if op.dst == D_TUPLE:
            for i in range(op.n):
                ch = <Op>op.children[i]
                if xc(ch, c, w):
                    refuse(op, f"a null in field f{i} (Flink's Tuple fields cannot be null)")
            return 0
        # a Row: the null mask (RowKind's two bits first, INSERT = 0), then the non-null fields
        bit = 2 if op.row_kind else 0
        nbytes = (op.n + bit + 7) // 8
        mask_pos = w.pos
        memset(w_reserve(w, nbytes), 0, nbytes)
        for i in range(op.n):
            if xc(<Op>op.children[i], c, w):
                w.buf[mask_pos + (bit + i) // 8] |= <uint8_t>(0x80 >> ((bit + i) % 8))
        return 0
    if s == S_LIST:
        n = cur_count(c, op.a.min_size, "a list length")
        put_be32(w, <uint32_t>n)
        for i in range(n):
            if xc(op.a, c, w):
                refuse(op, "a null element")
        return 0
    if s == S_MAP:
        n = cur_count(c, op.a.min_size + op.b.min_size, "a map size")
        put_be32(w, <uint32_t>n)
        for i in range(n):
            if xc(op.a, c, w):
                refuse(op, "a null key")
            flag_pos = w.pos
            w_u8(w, 0)
            if xc(op.b, c, w):
                w.buf[flag_pos] = 1
        return 0
    if s == S_EXTERNAL:
        n = cur_count(c, 1, "a record length")
        cur_init(&sub, cur_read(c, n), n)
        r = xc(op.a, &sub, w)
        if sub.pos != sub.length:
            cur_corrupt(&sub, f"{sub.length - sub.pos} trailing bytes after a record")
        return r
    raise AssertionError(f"unknown source kind {s}")


cdef int _whole(Op op, const uint8_t *p, Py_ssize_t n, Writer *w) except -1:
    """One whole keygroups value (a key, a value, a list element, a map key or value): it must fill p[0:n]."""
    cdef Cursor c
    cur_init(&c, p, n)
    if xc(op, &c, w):
        refuse(op, "null")
    if c.pos != c.length:
        cur_corrupt(&c, f"{c.length - c.pos} trailing bytes after a value")
    return 0


# ---- states and key-group blocks -----------------------------------------------------------------------------------

@cython.final
cdef class StateTranscoder:
    """One keyed state's entries -> Flink pairs: ``kind`` VALUE_STATE (value, reducing, aggregating), LIST_STATE,
    MAP_STATE, TIMER_STATE, WINDOW_STATE (a namespaced value, reducing or aggregating state: keygroups' map of
    TimeWindow -> value, a Flink pair per window in window order), WINDOW_LIST_STATE (window -> list; a list per
    window, an empty one left out), WINDOW_MAP_STATE (map (window, user key) -> value, a pair per entry in window
    then user key order, ``user_key_order`` says how the user keys sort) or WINDOW_TIMER_STATE (keygroups' timers as a
    WindowOperator's window timers, see ``BlockWriter.add_state``); ``key`` transcodes the job's key; ``value`` the
    value, list element or map value; ``map_key`` a map state's user key; ``ttl``: each value, element or entry
    carries its timestamp; ``allowed_lateness`` (ms, window timers): where a window's cleanup timer is."""
    cdef readonly int kind
    cdef readonly bint ttl
    cdef readonly Op key, value, map_key
    cdef readonly int64_t allowed_lateness
    cdef readonly int user_key_order

    def __init__(self, int kind, Op key, Op value=None, Op map_key=None, *, bint ttl=False,
                 int64_t allowed_lateness=0, int user_key_order=0):
        cdef bint timers = kind == K_TIMER or kind == K_WINDOW_TIMER
        cdef bint maps = kind == K_MAP or kind == K_WINDOW_MAP
        if not K_VALUE <= kind <= K_WINDOW_MAP:
            raise ValueError(f"unknown state kind {kind}")
        if key is None or (value is None and not timers) or ((map_key is None) != (not maps)):
            raise ValueError("a state needs its key's Op, its value's (none for timers) and a map key's (map only)")
        if (kind == K_WINDOW_MAP) != (UK_UTF8 <= user_key_order <= UK_I32):
            raise ValueError("a window map state (only) needs its user keys' order: USER_KEY_UTF8, _I64 or _I32")
        self.user_key_order = user_key_order
        if timers and ttl:
            raise ValueError("timers have no TTL")
        if allowed_lateness < 0:
            raise ValueError(f"allowed_lateness must be >= 0, got {allowed_lateness}")
        self.kind, self.key, self.value, self.map_key, self.ttl = kind, key, value, map_key, ttl
        self.allowed_lateness = allowed_lateness


cdef int cmp_i64(const void *a, const void *b) noexcept nogil:
    cdef int64_t x = (<const int64_t *>a)[0], y = (<const int64_t *>b)[0]
    return (x > y) - (x < y)


cdef struct Win:
    int64_t start
    int64_t end
    Py_ssize_t at       # a window state entry: where its frame's value starts; a window timer: its timestamp
    Py_ssize_t n        # a window state entry: its value's length
    const uint8_t *uk   # a window map entry: its user key's codec bytes
    Py_ssize_t uk_n


cdef int _uk_order = 0      # the user key order of the window map being sorted (qsort has no context)


cdef int cmp_user_key(const Win *x, const Win *y) noexcept nogil:
    cdef int64_t a, b
    cdef int32_t a32, b32
    cdef Py_ssize_t n
    cdef int r
    if _uk_order == UK_I64 and x.uk_n == 8 and y.uk_n == 8:
        memcpy(&a, x.uk, 8)
        memcpy(&b, y.uk, 8)
        return (a > b) - (a < b)
    if _uk_order == UK_I32 and x.uk_n == 4 and y.uk_n == 4:
        memcpy(&a32, x.uk, 4)
        memcpy(&b32, y.uk, 4)
        return (a32 > b32) - (a32 < b32)
    n = x.uk_n if x.uk_n < y.uk_n else y.uk_n      # UTF-8 (past the equal-width length prefix: compared last)
    if n > 4:
        r = memcmp(x.uk + 4, y.uk + 4, n - 4)
        if r:
            return r
    return (x.uk_n > y.uk_n) - (x.uk_n < y.uk_n)


cdef int cmp_win_entry(const void *a, const void *b) noexcept nogil:
    cdef int r = cmp_win(a, b)
    if r or _uk_order == 0:
        return r
    return cmp_user_key(<const Win *>a, <const Win *>b)


cdef int cmp_win(const void *a, const void *b) noexcept nogil:
    cdef const Win *x = <const Win *>a
    cdef const Win *y = <const Win *>b
    if x.start != y.start:
        return -1 if x.start < y.start else 1
    return (x.end > y.end) - (x.end < y.end)


cdef int cmp_timer(const void *a, const void *b) noexcept nogil:
    cdef const Win *x = <const Win *>a
    cdef const Win *y = <const Win *>b
    if x.at != y.at:
        return -1 if x.at < y.at else 1
    return cmp_win(a, b)


cdef struct KeyWins:
    const uint8_t *key  # into BlockWriter.win_keys once all are recorded
    Py_ssize_t key_at, key_len
    Py_ssize_t first, count   # its windows in BlockWriter.wins


cdef int cmp_keywins(const void *a, const void *b) noexcept nogil:
    cdef const KeyWins *x = <const KeyWins *>a
    cdef const KeyWins *y = <const KeyWins *>b
    cdef int r = kg_key_cmp(x.key, x.key_len, y.key, y.key_len)
    if r:
        return r
    return (x.first > y.first) - (x.first < y.first)


cdef inline int cmp_keywins_key(const KeyWins *x, const KeyWins *y) noexcept nogil:
    """Equal key bytes: 0."""
    if x.key_len != y.key_len:
        return 1
    return memcmp(x.key, y.key, x.key_len) if x.key_len else 0


cdef inline int put_window(Writer *w, int64_t start, int64_t end) except -1:
    put_be64(w, <uint64_t>start)
    return put_be64(w, <uint64_t>end)


cdef int check_offsets(const int64_t[::1] o, Py_ssize_t size, str what) except -1:
    cdef Py_ssize_t i, n = o.shape[0]
    if n < 1:
        raise ValueError(f"{what} offsets must hold n + 1 >= 1 positions")
    for i in range(n):
        if o[i] < 0 or o[i] > size or (i and o[i] < o[i - 1]):
            raise CorruptSnapshotError(f"{what} offset {i} = {o[i]} is not ascending inside the {size}-byte buffer")
    return 0



@cython.final
cdef class BlockWriter:
    """One key group's block at a time: ``start(key_group)``, then per state in ascending id ``add_state`` (keygroups
    entries, transcoded here) or ``add_pairs`` (Flink pairs made elsewhere), then ``finish()``: the block's bytes, or
    None when no state wrote a pair. The buffer is kept from one key group to the next."""
    cdef Writer w
    cdef Writer kw                 # the current key's Flink bytes and namespace
    cdef readonly int prefix_bytes
    cdef int key_group
    cdef int last_state
    cdef bint any_section
    cdef Py_ssize_t section_start, last_key_pos, key_len_pos, pairs
    cdef int64_t *stamps
    cdef Py_ssize_t stamps_cap
    # the key group's windows per key, recorded by WINDOW_STATE for WINDOW_TIMER_STATE
    cdef Writer win_keys           # keygroups key bytes, back to back
    cdef KeyWins *key_wins
    cdef Py_ssize_t n_key_wins, key_wins_cap
    cdef bint key_wins_sorted
    cdef Win *wins                 # the recorded windows (and a key's windows or timers while it is written)
    cdef Py_ssize_t n_wins, wins_cap
    cdef Win *scratch
    cdef Py_ssize_t scratch_cap

    def __cinit__(self):
        w_init(&self.w)
        w_init(&self.kw)
        w_init(&self.win_keys)
        self.stamps = NULL
        self.stamps_cap = 0
        self.key_wins = NULL
        self.wins = NULL
        self.scratch = NULL

    def __dealloc__(self):
        w_free(&self.w)
        w_free(&self.kw)
        w_free(&self.win_keys)
        PyMem_Free(self.stamps)
        PyMem_Free(self.key_wins)
        PyMem_Free(self.wins)
        PyMem_Free(self.scratch)

    def __init__(self, int prefix_bytes):
        if prefix_bytes != 1 and prefix_bytes != 2:
            raise ValueError(f"a key-group prefix is 1 or 2 bytes, got {prefix_bytes}")
        self.prefix_bytes = prefix_bytes
        self.key_group = -1

    def start(self, int key_group):
        """Begin the block of ``key_group`` (the previous one's bytes are dropped)."""
        if not 0 <= key_group < (1 << (8 * self.prefix_bytes)):
            raise ValueError(f"key group {key_group} does not fit a {self.prefix_bytes}-byte prefix")
        self.key_group = key_group
        self.w.pos = 0
        self.any_section = False
        self.last_state = -1
        self.win_keys.pos = 0
        self.n_key_wins = 0
        self.n_wins = 0
        self.key_wins_sorted = True

    cdef int _begin(self, int state_id) except -1:
        if self.key_group < 0:
            raise ValueError("call start(key_group) first")
        if not self.last_state < state_id <= 0x7FFF:
            raise ValueError(f"state id {state_id} after {self.last_state}: ids ascend, each in [0, 32767]")
        self.last_state = state_id
        self.section_start = self.w.pos
        self.pairs = 0
        return put_be16(&self.w, <uint16_t>state_id)   # the first id, or the previous run's next-state id

    cdef int _end(self) except -1:
        if self.pairs == 0:
            self.w.pos = self.section_start
            return 0
        self.w.buf[self.last_key_pos] |= FIRST_BIT
        self.any_section = True
        return 0

    cdef inline int _prefix(self) except -1:
        cdef uint8_t *p = w_reserve(&self.w, self.prefix_bytes)
        if self.prefix_bytes == 1:
            p[0] = <uint8_t>self.key_group
        else:
            kg_put_be16(p, <uint16_t>self.key_group)
        return 0

    cdef inline Py_ssize_t _open(self) except -1:
        """Room for a length; returns where it goes (patched by _close)."""
        cdef Py_ssize_t at = self.w.pos
        w_reserve(&self.w, 4)
        return at

    cdef inline int _close(self, Py_ssize_t at) except -1:
        cdef Py_ssize_t length = self.w.pos - at - 4
        if length > 0x7FFFFFFF:
            raise UnrepresentableValue(f"a Flink key or value of {length} bytes: Flink's lengths are Java ints")
        kg_put_be32(self.w.buf + at, <uint32_t>length)
        return 0

    def add_pairs(self, int state_id, list pairs):
        """Flink (key, value) pairs of one state (keys with their key-group prefix), written as they are."""
        cdef object k, v
        self._begin(state_id)
        for k, v in pairs:
            if not PyBytes_CheckExact(k) or not PyBytes_CheckExact(v) or PyBytes_GET_SIZE(k) < 1:
                raise TypeError("pairs must be (key, value) bytes, every key holding at least its prefix")
            put_be32(&self.w, <uint32_t>PyBytes_GET_SIZE(k))
            self.last_key_pos = self.w.pos
            w_bytes(&self.w, PyBytes_AS_STRING(k), PyBytes_GET_SIZE(k))
            put_be32(&self.w, <uint32_t>PyBytes_GET_SIZE(v))
            w_bytes(&self.w, PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v))
            self.pairs += 1
        self._end()

    def add_state(self, int state_id, StateTranscoder t, keys, key_offsets, values, value_offsets):
        """Transcode one state's entries of this key group: key i is ``keys[key_offsets[i]:key_offsets[i + 1]]``
        (the job's key serializer), its value likewise (the state's framing). Returns ``(keys, timers)`` counted
        (a window state counts its windows). WINDOW_STATE records each key's windows; WINDOW_TIMER_STATE, added
        after the key group's window states, turns a key's timer at a window's ``end - 1`` or ``end - 1 +
        allowed_lateness`` into that window's timer (sorted by time, then window) and drops a timer of no window
        of the key, as keygroups.flink.windows.window_timers does. CorruptSnapshotError for damaged bytes; UnrepresentableValue (with the key's ``index``) for a value Flink
        cannot hold."""
        cdef Py_buffer kview, vview
        cdef const int64_t[::1] ko = key_offsets
        cdef const int64_t[::1] vo = value_offsets
        cdef Py_ssize_t n = ko.shape[0] - 1, i = 0
        cdef int64_t timers = 0
        if vo.shape[0] != ko.shape[0]:
            raise CorruptSnapshotError(f"{n} keys but {vo.shape[0] - 1} values")
        PyObject_GetBuffer(keys, &kview, PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(values, &vview, PyBUF_SIMPLE)
            try:
                check_offsets(ko, kview.len, "key")
                check_offsets(vo, vview.len, "value")
                self._begin(state_id)
                try:
                    for i in range(n):
                        timers += self._entry(t, <const uint8_t *>kview.buf + ko[i], ko[i + 1] - ko[i],
                                              <const uint8_t *>vview.buf + vo[i], vo[i + 1] - vo[i])
                except UnrepresentableValue as e:
                    e.index = i
                    raise
                self._end()
            finally:
                PyBuffer_Release(&vview)
        finally:
            PyBuffer_Release(&kview)
        if t.kind == K_TIMER or t.kind == K_WINDOW_TIMER:
            return 0, timers
        if t.kind == K_WINDOW or t.kind == K_WINDOW_LIST or t.kind == K_WINDOW_MAP:
            return timers, 0     # a pair per window (per map entry)
        return n, 0

    cdef int _pair_key(self) except -1:
        """Open a pair: room for its key's length (patched by _close(self.key_len_pos)), the prefix, the key."""
        self.key_len_pos = self._open()
        self.last_key_pos = self.w.pos
        self.pairs += 1
        self._prefix()
        return w_bytes(&self.w, self.kw.buf, self.kw.pos)

    cdef int64_t _entry(self, StateTranscoder t, const uint8_t *kp, Py_ssize_t kn, const uint8_t *vp,
                        Py_ssize_t vn) except -1:
        """The pairs of one key; the number of timers written (0 for other states)."""
        cdef Cursor c, e
        cdef Py_ssize_t at, count, i
        cdef uint32_t length, klen
        cdef int64_t ts
        cdef bint first
        self.kw.pos = 0
        _whole(t.key, kp, kn, &self.kw)
        if t.kind == K_WINDOW or t.kind == K_WINDOW_LIST or t.kind == K_WINDOW_MAP:
            return self._windows(t, kp, kn, vp, vn, False)
        if t.kind == K_WINDOW_TIMER:
            return self._window_timers(kp, kn, vp, vn, t.allowed_lateness)
        w_u8(&self.kw, 0)                                     # VoidNamespace
        cur_init(&c, vp, vn)
        if t.kind == K_VALUE:
            self._pair_key()
            self._close(self.key_len_pos)
            at = self._open()
            if t.ttl:
                put_be64(&self.w, <uint64_t>cur_i64(&c))
            _whole(t.value, vp + c.pos, vn - c.pos, &self.w)
            self._close(at)
            return 0
        if t.kind == K_LIST:
            if vn == 0:
                return 0                                      # Flink holds no empty list
            self._pair_key()
            self._close(self.key_len_pos)
            at = self._open()
            first = True
            while cur_remaining(&c):
                length = cur_u32(&c)
                if not first:
                    w_u8(&self.w, LIST_DELIMITER)
                first = False
                if t.ttl:
                    put_be64(&self.w, <uint64_t>cur_i64(&c))
                _whole(t.value, cur_read(&c, length), length, &self.w)
            self._close(at)
            return 0
        if t.kind == K_MAP:
            while cur_remaining(&c):
                length = cur_u32(&c)
                ts = cur_i64(&c) if t.ttl else 0
                if length < 4:
                    cur_corrupt(&c, f"a map entry of {length} bytes, shorter than its key length")
                cur_init(&e, cur_read(&c, length), length)
                klen = cur_u32(&e)
                self._pair_key()
                _whole(t.map_key, cur_read(&e, klen), klen, &self.w)
                self._close(self.key_len_pos)
                at = self._open()
                w_u8(&self.w, 0)
                if t.ttl:
                    put_be64(&self.w, <uint64_t>ts)
                _whole(t.value, e.buf + e.pos, cur_remaining(&e), &self.w)
                self._close(at)
            return 0
        # timers: a map of timestamp (int64) -> True; Flink's queue entries sorted by time, with empty values
        count = self._stamps(&c)
        for i in range(count):
            self.key_len_pos = self._open()
            self.last_key_pos = self.w.pos
            self.pairs += 1
            self._prefix()
            put_be64(&self.w, (<uint64_t>self.stamps[i]) ^ 0x8000000000000000ULL)
            w_bytes(&self.w, self.kw.buf, self.kw.pos)
            self._close(self.key_len_pos)
            put_be32(&self.w, 0)
        return count

    cdef Win *_room(self, Win **arr, Py_ssize_t *cap, Py_ssize_t need) except NULL:
        cdef Py_ssize_t n = cap[0]
        cdef Win *p
        if need > n:
            n = max(need, 2 * n, 64)
            p = <Win *>PyMem_Realloc(arr[0], n * sizeof(Win))
            if p == NULL:
                raise MemoryError()
            arr[0] = p
            cap[0] = n
        return arr[0]

    def note_windows(self, StateTranscoder t, keys, key_offsets, values, value_offsets):
        """Record the windows of one WINDOW_STATE's entries of this key group (as ``add_state`` takes them) for
        the window timers added after, whatever their state ids: writes nothing."""
        cdef Py_buffer kview, vview
        cdef const int64_t[::1] ko = key_offsets
        cdef const int64_t[::1] vo = value_offsets
        cdef Py_ssize_t i
        if t.kind != K_WINDOW and t.kind != K_WINDOW_LIST and t.kind != K_WINDOW_MAP:
            raise ValueError("note_windows takes a window state's transcoder")
        if self.key_group < 0:
            raise ValueError("call start(key_group) first")
        if vo.shape[0] != ko.shape[0]:
            raise CorruptSnapshotError(f"{ko.shape[0] - 1} keys but {vo.shape[0] - 1} values")
        PyObject_GetBuffer(keys, &kview, PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(values, &vview, PyBUF_SIMPLE)
            try:
                check_offsets(ko, kview.len, "key")
                check_offsets(vo, vview.len, "value")
                for i in range(ko.shape[0] - 1):
                    self._windows(t, <const uint8_t *>kview.buf + ko[i], ko[i + 1] - ko[i],
                                  <const uint8_t *>vview.buf + vo[i], vo[i + 1] - vo[i], True)
            finally:
                PyBuffer_Release(&vview)
        finally:
            PyBuffer_Release(&kview)

    cdef int64_t _windows(self, StateTranscoder t, const uint8_t *kp, Py_ssize_t kn, const uint8_t *vp,
                          Py_ssize_t vn, bint record) except -1:
        """One key's namespaced value (its map's frames, window -> value): ``record``, its windows noted for the
        window timers; else a Flink pair per window, in window order. Returns the windows."""
        cdef Cursor c, e
        cdef uint32_t length, klen, elements
        cdef Py_ssize_t count = 0, written = 0, i, j, first = self.n_wins, at
        cdef Win *ws
        cdef KeyWins *kwp
        cdef int kind = t.kind
        global _uk_order
        cur_init(&c, vp, vn)
        while cur_remaining(&c):
            length = cur_u32(&c)
            if t.ttl:
                cur_i64(&c)      # read again below, from the frame
            if length < 4:
                cur_corrupt(&c, f"a map entry of {length} bytes, shorter than its key length")
            cur_init(&e, cur_read(&c, length), length)
            klen = cur_u32(&e)
            if klen != 16 and not (kind == K_WINDOW_MAP and klen > 16):
                cur_corrupt(&e, f"a window (TimeWindow: two Int64) of {klen} bytes")
            ws = self._room(&self.wins, &self.wins_cap, first + count + 1)
            ws[first + count].start = cur_i64(&e)
            ws[first + count].end = cur_i64(&e)
            ws[first + count].uk = e.buf + e.pos
            ws[first + count].uk_n = klen - 16
            cur_read(&e, klen - 16)
            ws[first + count].at = (e.buf + e.pos) - vp
            ws[first + count].n = cur_remaining(&e)
            count += 1
        ws = self.wins + first
        if not record:
            _uk_order = t.user_key_order
            qsort(ws, count, sizeof(Win), cmp_win_entry)
            _uk_order = 0
        for i in range(0 if record else count):
            if kind == K_WINDOW_LIST:
                cur_init(&e, vp + ws[i].at, ws[i].n)
                elements = <uint32_t>cur_count(&e, t.value.min_size if t.value.min_size > 0 else 1, "a list")
                if elements == 0:
                    if cur_remaining(&e):
                        cur_corrupt(&e, f"{cur_remaining(&e)} bytes follow an empty list")
                    continue          # Flink holds no empty list
            self._pair_key()
            put_window(&self.w, ws[i].start, ws[i].end)
            if kind == K_WINDOW_MAP:
                _whole(t.map_key, ws[i].uk, ws[i].uk_n, &self.w)
            self._close(self.key_len_pos)
            at = self._open()
            if kind == K_WINDOW_MAP:
                w_u8(&self.w, 0)      # the value's null flag
            if kind == K_WINDOW_LIST:
                for j in range(elements):
                    if j:
                        w_u8(&self.w, LIST_DELIMITER)
                    if t.ttl:
                        put_be64(&self.w, <uint64_t>_load_i64(vp + ws[i].at - 16 - 4 - 8))
                    if xc(t.value, &e, &self.w):
                        refuse(t.value, "null")
                if cur_remaining(&e):
                    cur_corrupt(&e, f"{cur_remaining(&e)} bytes follow a list's {elements} elements")
            else:
                if t.ttl:     # the frame's timestamp: before its key length and the window (and user key)
                    put_be64(&self.w, <uint64_t>_load_i64(vp + ws[i].at - ws[i].uk_n - 16 - 4 - 8))
                _whole(t.value, vp + ws[i].at, ws[i].n, &self.w)
            self._close(at)
            written += 1
        if count and record:
            self.n_wins = first + count
            if self.n_key_wins == self.key_wins_cap:
                kwp = <KeyWins *>PyMem_Realloc(self.key_wins, max(64, 2 * self.key_wins_cap) * sizeof(KeyWins))
                if kwp == NULL:
                    raise MemoryError()
                self.key_wins = kwp
                self.key_wins_cap = max(64, 2 * self.key_wins_cap)
            kwp = self.key_wins + self.n_key_wins
            kwp.key_at = self.win_keys.pos
            kwp.key_len = kn
            kwp.first = first
            kwp.count = count
            w_bytes(&self.win_keys, kp, kn)
            self.n_key_wins += 1
            self.key_wins_sorted = False
        return count if record else written

    def add_merging(self, int state_id, Op key):
        """Flink's ``merging-window-set`` of the windows recorded by ``note_windows`` (sessions): per key (``key``
        transcodes the job's key), in key order, a list of (window, state window) pairs, each window its own
        state window, distinct and in window order; a key without windows has none."""
        cdef Py_ssize_t i = 0, j, k, nw, at
        self._begin(state_id)
        if not self.key_wins_sorted:
            self._sort_key_wins()
        while i < self.n_key_wins:
            nw = 0
            j = i
            while j < self.n_key_wins and cmp_keywins_key(&self.key_wins[j], &self.key_wins[i]) == 0:
                self._room(&self.scratch, &self.scratch_cap, nw + self.key_wins[j].count)
                memcpy(self.scratch + nw, self.wins + self.key_wins[j].first, self.key_wins[j].count * sizeof(Win))
                nw += self.key_wins[j].count
                j += 1
            qsort(self.scratch, nw, sizeof(Win), cmp_win)
            self.kw.pos = 0
            _whole(key, self.key_wins[i].key, self.key_wins[i].key_len, &self.kw)
            w_u8(&self.kw, 0)                                 # VoidNamespace
            self._pair_key()
            self._close(self.key_len_pos)
            at = self._open()
            for k in range(nw):
                if k and cmp_win(&self.scratch[k - 1], &self.scratch[k]) == 0:
                    continue
                if k:
                    w_u8(&self.w, LIST_DELIMITER)
                put_window(&self.w, self.scratch[k].start, self.scratch[k].end)
                put_window(&self.w, self.scratch[k].start, self.scratch[k].end)
            self._close(at)
            i = j
        self._end()

    cdef int _sort_key_wins(self) except -1:
        cdef Py_ssize_t i
        for i in range(self.n_key_wins):
            self.key_wins[i].key = self.win_keys.buf + self.key_wins[i].key_at
        qsort(self.key_wins, self.n_key_wins, sizeof(KeyWins), cmp_keywins)
        self.key_wins_sorted = True
        return 0

    cdef int64_t _window_timers(self, const uint8_t *kp, Py_ssize_t kn, const uint8_t *vp, Py_ssize_t vn,
                                int64_t lateness) except -1:
        """One key's timers (timestamp -> True frames) as the window timers of its recorded windows."""
        cdef Cursor c, e
        cdef uint32_t length
        cdef Py_ssize_t count = 0, lo, hi, mid, i, j, nw = 0, nt = 0
        cdef KeyWins probe
        cdef int64_t ts, end
        cdef int64_t cand[2]
        cdef int nc, q
        cur_init(&c, vp, vn)
        count = self._stamps(&c)
        if count == 0 or self.n_key_wins == 0:
            return 0
        if not self.key_wins_sorted:
            self._sort_key_wins()
        probe.key = kp
        probe.key_len = kn
        probe.first = -1
        lo, hi = 0, self.n_key_wins          # the first recorded key >= this key
        while lo < hi:
            mid = (lo + hi) // 2
            if cmp_keywins(&self.key_wins[mid], &probe) < 0:
                lo = mid + 1
            else:
                hi = mid
        # the key's windows (of every window state), distinct, then each one's trigger and cleanup timers
        i = lo
        while i < self.n_key_wins and self.key_wins[i].key_len == kn and (
                kn == 0 or memcmp(self.key_wins[i].key, kp, kn) == 0):
            self._room(&self.scratch, &self.scratch_cap, nw + self.key_wins[i].count)
            memcpy(self.scratch + nw, self.wins + self.key_wins[i].first, self.key_wins[i].count * sizeof(Win))
            nw += self.key_wins[i].count
            i += 1
        if nw == 0:
            return 0
        qsort(self.scratch, nw, sizeof(Win), cmp_win)
        j = 0
        for i in range(nw):
            if j and cmp_win(&self.scratch[j - 1], &self.scratch[i]) == 0:
                continue
            self.scratch[j] = self.scratch[i]
            j += 1
        nw = j
        self._room(&self.scratch, &self.scratch_cap, 3 * nw)   # the timers go after the windows
        for i in range(nw):
            end = self.scratch[i].end
            if end == INT64_MIN_:
                continue   # no end - 1 in Python's ints either: keygroups' windows end after they start
            cand[0] = end - 1
            nc = 1
            if lateness and end - 1 <= INT64_MAX_ - lateness:
                cand[1] = end - 1 + lateness
                nc = 2
            for q in range(nc):
                if bsearch(&cand[q], self.stamps, count, sizeof(int64_t), cmp_i64) != NULL:
                    self.scratch[nw + nt] = self.scratch[i]
                    self.scratch[nw + nt].at = <Py_ssize_t>cand[q]
                    nt += 1
        qsort(self.scratch + nw, nt, sizeof(Win), cmp_timer)
        for i in range(nt):
            self.key_len_pos = self._open()
            self.last_key_pos = self.w.pos
            self.pairs += 1
            self._prefix()
            put_be64(&self.w, (<uint64_t>self.scratch[nw + i].at) ^ 0x8000000000000000ULL)
            w_bytes(&self.w, self.kw.buf, self.kw.pos)
            put_window(&self.w, self.scratch[nw + i].start, self.scratch[nw + i].end)
            self._close(self.key_len_pos)
            put_be32(&self.w, 0)
        return nt

    cdef Py_ssize_t _stamps(self, Cursor *c) except -1:
        """A key's timer map (timestamp (int64) -> True frames) into ``self.stamps``, sorted; returns how many."""
        cdef Cursor e
        cdef uint32_t length
        cdef Py_ssize_t count = 0
        while cur_remaining(c):
            length = cur_u32(c)
            cur_init(&e, cur_read(c, length), length)
            if length != 4 + 8 + 1 or cur_u32(&e) != 8:
                cur_corrupt(c, f"a timer entry of {length} bytes (a timestamp and its flag take 13)")
            if count == self.stamps_cap:
                self._grow_stamps()
            self.stamps[count] = cur_i64(&e)
            if cur_u8(&e) > 1:
                cur_corrupt(&e, "a timer flag other than 0 or 1")
            count += 1
        qsort(self.stamps, count, sizeof(int64_t), cmp_i64)
        return count

    cdef int _grow_stamps(self) except -1:
        cdef Py_ssize_t cap = self.stamps_cap * 2 if self.stamps_cap else 64
        cdef int64_t *p = <int64_t *>PyMem_Realloc(self.stamps, cap * sizeof(int64_t))
        if p == NULL:
            raise MemoryError()
        self.stamps = p
        self.stamps_cap = cap
        return 0

    def finish(self):
        """The block of the key group started last (bytes), or None when it holds no pair."""
        if self.key_group < 0:
            raise ValueError("call start(key_group) first")
        self.key_group = -1
        if not self.any_section:
            return None
        put_be16(&self.w, END_OF_KEY_GROUP)
        return w_result(&self.w)
