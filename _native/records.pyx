# Record codecs, compiled: the bytes of keygroups.serializers.RecordSerializer.
#
# A Node is one position of a record schema (a field, a list element, a map key or value), built as a tree by
# keygroups.serializers.record from a RecordType. Encoding writes through writer.pxd; decoding reads only through the
# checked cursor of cursor.pxd, so truncated or corrupt bytes raise CorruptSnapshotError and nothing is read past the
# buffer. Every count is checked against the bytes that remain before a list or dict is allocated for it. Recursion
# follows the schema (bounded when it is built), never the data.
#
# Wire format (little-endian; counts and lengths u32):
#   a nullable position: 0 (null) or 1, then the value
#   int8/16/32/64: 1/2/4/8 bytes | float32/64: 4/8 (NaN canonical) | bool: 0/1
#   string, binary: u32 length + bytes | date: i32 days since 1970-01-01
#   timestamp: i64 count of its unit since 1970-01-01T00:00Z (a naive one: of wall-clock time)
#   decimal: the unscaled integer, i64 for precision <= 18, else 16 bytes two's complement
#   list: u32 count + elements | map: u32 count + (key, value) pairs | record: its fields in order
import sys

cimport cython

import numpy as np

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE, PyBytes_FromStringAndSize, PyBytes_CheckExact
from cpython.datetime cimport (import_datetime, datetime_new, date_new, PyDateTime_Check, PyDate_Check,
                               PyDelta_Check, datetime_tzinfo, datetime_year, datetime_month, datetime_day,
                               datetime_hour, datetime_minute, datetime_second, datetime_microsecond,
                               date_year, date_month, date_day, timedelta_days, timedelta_seconds,
                               timedelta_microseconds)
from cpython.dict cimport PyDict_Check, PyDict_GetItem, PyDict_SetItem, PyDict_Size, PyDict_New
from cpython.float cimport PyFloat_AsDouble, PyFloat_FromDouble, PyFloat_CheckExact
from cpython.list cimport PyList_New, PyList_SET_ITEM, PyList_GET_ITEM, PyList_GET_SIZE, PyList_CheckExact
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_FromLongLong, PyLong_Check, PyLong_CheckExact
from cpython.object cimport PyObject, PyObject_GenericSetAttr
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM, PyTuple_GET_ITEM, PyTuple_GET_SIZE, PyTuple_CheckExact
from cpython.unicode cimport PyUnicode_DecodeUTF8, PyUnicode_Check
from libc.math cimport isnan, isfinite
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from cursor cimport (Cursor, cur_init, cur_read, cur_u8, cur_count, cur_corrupt, cur_remaining,
                    cur_i64 as r_i64, cur_i32 as r_i32)
from writer cimport (Writer, w_bytes, w_f64, w_free, w_i64, w_init, w_len, w_reserve, w_result, w_u8, w_u32,
                    short_repr as _short)

cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object s, Py_ssize_t *size) except NULL
    # CPython's dict with room for n items (what dict(**kwargs) uses): a record of more than five fields would
    # otherwise resize its dict while it is filled
    object _PyDict_NewPresized(Py_ssize_t minused)

if sys.byteorder != "little":   # the format is little-endian and the cursor reads with memcpy
    raise ImportError("keygroups._native.records needs a little-endian host")

import_datetime()

import datetime as _datetime
import decimal as _decimal

from keygroups.errors import CorruptSnapshotError

cdef object _utc = _datetime.timezone.utc
cdef object _Decimal = _decimal.Decimal
cdef object _np_bool = np.bool_
cdef object _np_integer = np.integer
cdef object _np_floating = np.floating
cdef object _object_new = object.__new__

# Node kinds; keygroups.serializers.record builds nodes with the Python names below.
cdef enum:
    R_INT8 = 1
    R_INT16 = 2
    R_INT32 = 3
    R_INT64 = 4
    R_FLOAT32 = 5
    R_FLOAT64 = 6
    R_BOOL = 7
    R_STRING = 8
    R_BINARY = 9
    R_DATE = 10
    R_TIMESTAMP = 11
    R_DECIMAL = 12
    R_LIST = 13
    R_MAP = 14
    R_RECORD = 15

# How a record is returned.
cdef enum:
    FORM_TUPLE = 0
    FORM_DICT = 1
    FORM_CLASS = 2
    FORM_FACTORY = 3

INT8 = R_INT8
INT16 = R_INT16
INT32 = R_INT32
INT64 = R_INT64
FLOAT32 = R_FLOAT32
FLOAT64 = R_FLOAT64
BOOL = R_BOOL
STRING = R_STRING
BINARY = R_BINARY
DATE = R_DATE
TIMESTAMP = R_TIMESTAMP
DECIMAL = R_DECIMAL
LIST = R_LIST
MAP = R_MAP
RECORD = R_RECORD
TUPLE_FORM = FORM_TUPLE
DICT_FORM = FORM_DICT
CLASS_FORM = FORM_CLASS
FACTORY_FORM = FORM_FACTORY

cdef int64_t US_PER_DAY = 86400000000LL
# datetime's range, 0001-01-01 .. 9999-12-31T23:59:59.999999, as microseconds since the epoch
cdef int64_t MIN_US = -62135596800000000LL
cdef int64_t MAX_US = 253402300799999999LL


cdef inline int64_t unit_div(int unit) noexcept nogil:
    """Microseconds per unit of s (0), ms (1) and us (2); ns (3) is handled apart (a unit is smaller)."""
    return 1000000 if unit == 0 else (1000 if unit == 1 else 1)


# ---- calendar arithmetic (H. Hinnant's days_from_civil / civil_from_days; exact for every proleptic date) ----

cdef inline int64_t days_from_civil(int64_t y, int64_t m, int64_t d) noexcept nogil:
    cdef int64_t era, yoe, doy, doe
    if m <= 2:
        y -= 1
    era = (y if y >= 0 else y - 399) // 400
    yoe = y - era * 400
    doy = (153 * (m - 3 if m > 2 else m + 9) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


cdef inline void civil_from_days(int64_t z, int *y, int *m, int *d) noexcept nogil:
    cdef int64_t era, doe, yoe, doy, mp
    z += 719468
    era = (z if z >= 0 else z - 146096) // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    d[0] = <int>(doy - (153 * mp + 2) // 5 + 1)
    m[0] = <int>(mp + 3 if mp < 10 else mp - 9)
    y[0] = <int>(yoe + era * 400 + (1 if m[0] <= 2 else 0))


cdef inline int64_t floor_div(int64_t a, int64_t b) noexcept nogil:
    cdef int64_t q = a // b   # C truncates (cdivision): step down for a negative remainder
    if (a % b != 0) and ((a < 0) != (b < 0)):
        q -= 1
    return q


@cython.final
@cython.auto_pickle(False)   # RecordSerializer pickles by its schema and rebuilds the nodes
cdef class Node:
    """One position of a record schema (see keygroups.serializers.record, which builds the tree)."""
    cdef readonly int kind
    cdef readonly bint nullable
    cdef readonly str what                # how messages name this position, e.g. "field 'a.b' (bigint)"
    cdef readonly Py_ssize_t min_size     # the fewest bytes a value here takes
    cdef readonly tuple children          # record: one node per field; list: (element,); map: (key, value)
    cdef readonly tuple names             # record: the field names
    cdef readonly int form                # record: TUPLE_FORM, DICT_FORM, CLASS_FORM or FACTORY_FORM
    cdef readonly object cls              # record: the class built (CLASS_FORM), or the callable that builds a
                                          # value from the record's dict (FACTORY_FORM, e.g. a Spark Row)
    cdef bint cls_dict                    # instances of cls keep their fields in a __dict__
    cdef Py_ssize_t nfields
    cdef int unit                         # timestamp: 0 s, 1 ms, 2 us, 3 ns
    cdef object tz                        # timestamp: None (naive) or the tzinfo values are returned in
    cdef bint tz_utc
    cdef int precision, scale             # decimal
    cdef object limit                     # decimal: 10 ** precision
    cdef Node a, b                        # list element / map key and value

    def __init__(self, int kind, bint nullable, str what, tuple children=(), tuple names=(), int form=FORM_TUPLE,
                 object cls=None, int unit=2, object tz=None, int precision=0, int scale=0):
        cdef Node ch
        if not R_INT8 <= kind <= R_RECORD:
            raise ValueError(f"unknown node kind {kind}")
        self.kind = kind
        self.nullable = nullable
        self.what = what
        self.children = children
        self.names = tuple(sys.intern(n) for n in names)
        self.form = form
        self.cls = cls
        self.nfields = len(children)
        for ch in children:
            if ch is None:
                raise TypeError("node children must be Node objects")
        if kind == R_RECORD:
            if len(children) == 0 or len(names) != len(children):
                raise ValueError("a record node needs one name per field and at least one field")
            if form == FORM_CLASS:
                if not isinstance(cls, type):
                    raise TypeError(f"a record built as a class needs the class, got {cls!r}")
                self.cls_dict = cls.__dictoffset__ != 0
            elif form == FORM_FACTORY:
                if not callable(cls):
                    raise TypeError(f"a record built by a factory needs a callable, got {cls!r}")
            elif form != FORM_TUPLE and form != FORM_DICT:
                raise ValueError(f"unknown record form {form}")
        elif kind == R_LIST:
            if len(children) != 1:
                raise ValueError("a list node has one child, its element")
            self.a = children[0]
        elif kind == R_MAP:
            if len(children) != 2:
                raise ValueError("a map node has two children, its key and value")
            self.a, self.b = children
            if self.a.nullable:
                raise ValueError("map keys cannot be nullable")
        elif len(children) != 0:
            raise ValueError(f"node kind {kind} has no children")
        if kind == R_TIMESTAMP:
            if not 0 <= unit <= 3:
                raise ValueError(f"unknown timestamp unit {unit}")
            self.unit = unit
            self.tz = tz
            self.tz_utc = tz is _utc
        if kind == R_DECIMAL:
            if not 1 <= precision <= 38 or not 0 <= scale <= precision:
                raise ValueError(f"bad decimal({precision}, {scale})")
            self.precision = precision
            self.scale = scale
            self.limit = (<object>10) ** (<object>precision)   # a Python int: 10**38 overflows C types
        self.min_size = self._value_size()
        if nullable:
            self.min_size = 1

    cdef Py_ssize_t _value_size(self):
        cdef Py_ssize_t total = 0
        cdef Node ch
        if self.kind == R_INT8 or self.kind == R_BOOL:
            return 1
        if self.kind == R_INT16:
            return 2
        if self.kind == R_INT32 or self.kind == R_FLOAT32 or self.kind == R_DATE:
            return 4
        if self.kind == R_INT64 or self.kind == R_FLOAT64 or self.kind == R_TIMESTAMP:
            return 8
        if self.kind == R_DECIMAL:
            return 8 if self.precision <= 18 else 16
        if self.kind == R_RECORD:
            for ch in self.children:
                total += ch.min_size
            return total
        return 4   # string, binary, list, map: a u32 length

    def __repr__(self):
        return f"<Node {self.what}>"

    def encode(self, value) -> bytes:
        """One value → its bytes."""
        cdef Writer w
        w_init(&w)
        try:
            enc(self, &w, value)
            return w_result(&w)
        finally:
            w_free(&w)

    def check(self, value) -> None:
        """Raise what encode would raise for value (TypeError or ValueError naming the field), without making the
        bytes: the check of a value on write. It runs the encoder itself into a buffer on the C stack (a heap one only
        past W_STACK bytes), so what it accepts is exactly what a snapshot can write."""
        cdef Writer w
        w_init(&w)
        try:
            enc(self, &w, value)
        finally:
            w_free(&w)

    def decode(self, data):
        """Bytes holding exactly one value → the value; CorruptSnapshotError if they are not that."""
        cdef Py_buffer view
        cdef Cursor cur
        if PyBytes_CheckExact(data):
            cur_init(&cur, <const uint8_t *>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
            return dec_whole(self, &cur)
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            cur_init(&cur, <const uint8_t *>view.buf, view.len)
            return dec_whole(self, &cur)
        finally:
            PyBuffer_Release(&view)

    def encode_many(self, values):
        """Values → (one buffer, int64 offsets of length n + 1); value i is buffer[offsets[i]:offsets[i + 1]]."""
        cdef Writer w
        cdef Py_ssize_t n, i
        cdef int64_t[::1] o
        if not isinstance(values, (list, tuple)):
            values = list(values)
        n = len(values)
        offsets = np.empty(n + 1, dtype=np.int64)
        o = offsets
        w_init(&w)
        try:
            for i in range(n):
                o[i] = w.pos
                enc(self, &w, values[i])
            o[n] = w.pos
            return w_result(&w), offsets
        finally:
            w_free(&w)

    def decode_many(self, data, offsets) -> list:
        """The inverse of encode_many; offsets are untrusted (they come from files) and checked first."""
        cdef Py_buffer view
        cdef Cursor cur
        cdef const int64_t[::1] o = np.ascontiguousarray(offsets, dtype=np.int64)
        cdef Py_ssize_t n = o.shape[0] - 1, i
        cdef list out
        cdef object item
        if n < 0:
            raise ValueError("offsets must hold n + 1 entries (one start, then one end per value)")
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            if o[0] < 0 or o[0] > view.len:
                raise CorruptSnapshotError(f"value offset {o[0]} is outside the {view.len}-byte buffer: the data "
                                           "is truncated or corrupt")
            for i in range(1, n + 1):
                if o[i] < o[i - 1] or o[i] > view.len:
                    raise CorruptSnapshotError(f"value offsets are not ascending inside the {view.len}-byte buffer "
                                               f"(offset {i}: {o[i]}): the data is truncated or corrupt")
            out = PyList_New(n)
            for i in range(n):
                cur_init(&cur, <const uint8_t *>view.buf + o[i], o[i + 1] - o[i])
                item = dec_whole(self, &cur)
                Py_INCREF(item)
                PyList_SET_ITEM(out, i, item)
            return out
        finally:
            PyBuffer_Release(&view)


cdef object dec_whole(Node n, Cursor *cur):
    cdef object v = dec(n, cur)
    if cur.pos != cur.length:
        cur_corrupt(cur, f"{cur.length - cur.pos} trailing bytes after a record")
    return v


# ---- encoding ---------------------------------------------------------------------------------------------------

cdef int type_error(Node n, str expected, object v) except -1:
    raise TypeError(f"{n.what} expects {expected}, got {_short(v)} of type {type(v).__name__}")


cdef int64_t as_int(Node n, object v, int64_t lo, int64_t hi) except? -1:
    cdef int overflow = 0
    cdef long long x
    if not PyLong_CheckExact(v):
        if v is True or v is False or not (PyLong_Check(v) or isinstance(v, _np_integer)):
            type_error(n, "an int", v)
        v = int(v)
    x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow or x < lo or x > hi:
        raise ValueError(f"{n.what}: {_short(v)} is out of range; allowed are integers in [{lo}, {hi}]")
    return x


cdef double as_float(Node n, object v) except? -1.0:
    if PyFloat_CheckExact(v):
        return PyFloat_AsDouble(v)
    if v is True or v is False or not (isinstance(v, (float, int)) or isinstance(v, _np_floating)
                                       or isinstance(v, _np_integer)):
        type_error(n, "a float (or an int)", v)
    try:
        return PyFloat_AsDouble(v)
    except OverflowError:
        raise ValueError(f"{n.what}: {_short(v)} is out of range for a double") from None


cdef int w_f32(Writer *w, Node n, double v) except -1:
    cdef float f = <float>v
    cdef uint32_t bits
    if isnan(v):
        bits = 0x7FC00000u
    else:
        if isfinite(v) and not isfinite(f):
            raise ValueError(f"{n.what}: {v!r} is out of range for a float (at most about 3.4e38)")
        memcpy(&bits, &f, 4)
    memcpy(w_reserve(w, 4), &bits, 4)
    return 0


cdef int64_t timestamp_us(Node n, object v) except? -1:
    """A datetime → microseconds since the epoch (UTC for zoned types, wall clock for naive ones)."""
    cdef object tz, off
    cdef int64_t us
    if not PyDateTime_Check(v):
        type_error(n, "a datetime.datetime", v)
    us = (days_from_civil(datetime_year(v), datetime_month(v), datetime_day(v)) * US_PER_DAY
          + (datetime_hour(v) * 3600LL + datetime_minute(v) * 60LL + datetime_second(v)) * 1000000LL
          + datetime_microsecond(v))
    tz = datetime_tzinfo(v)
    if n.tz is None:
        if tz is not None:
            raise TypeError(f"{n.what} is a timestamp without time zone and takes naive datetimes, got "
                            f"{_short(v)}; drop the zone (.replace(tzinfo=None)) or declare the field with a zone")
        return us
    if tz is None:
        raise TypeError(f"{n.what} is a timestamp with time zone and takes timezone-aware datetimes, got the naive "
                        f"{_short(v)}; give it a zone, e.g. .replace(tzinfo=datetime.timezone.utc)")
    if tz is not _utc:
        off = v.utcoffset()
        if off is not None:
            us -= (timedelta_days(off) * 86400LL + timedelta_seconds(off)) * 1000000LL + timedelta_microseconds(off)
    return us


cdef int enc_timestamp(Node n, Writer *w, object v) except -1:
    cdef int64_t us = timestamp_us(n, v)
    cdef int64_t per
    if n.unit == 3:
        if us > 9223372036854775LL or us < -9223372036854775LL:
            raise ValueError(f"{n.what}: {_short(v)} is out of range for nanoseconds (years 1677 to 2262)")
        return w_i64(w, us * 1000)
    per = unit_div(n.unit)
    if us % per != 0:
        raise ValueError(f"{n.what}: {_short(v)} has digits below the type's unit ({('s', 'ms')[n.unit]}); round "
                         "it first, or declare a finer unit")
    return w_i64(w, us // per)


cdef int enc_decimal(Node n, Writer *w, object v) except -1:
    cdef int64_t small
    if type(v) is not _Decimal:
        if PyLong_Check(v) and v is not True and v is not False:
            v = _Decimal(v)
        elif not isinstance(v, _Decimal):
            type_error(n, "a decimal.Decimal (or an int)", v)
    if not v.is_finite():
        raise ValueError(f"{n.what}: {v!r} is not a finite number")
    sign, digits, exponent = v.as_tuple()
    unscaled = 0
    for digit in digits:
        unscaled = unscaled * 10 + digit
    shift = exponent + n.scale
    if shift >= 0:
        unscaled *= 10 ** shift
    else:
        unscaled, dropped = divmod(unscaled, 10 ** -shift)
        if dropped:
            raise ValueError(f"{n.what}: {v} has more than {n.scale} digits after the point; round it first "
                             f"(e.g. value.quantize(Decimal('1e-{n.scale}')))")
    if unscaled >= n.limit:
        raise ValueError(f"{n.what}: {v} has more than {n.precision} digits; allowed are decimals of at most "
                         f"{n.precision - n.scale} digits before the point and {n.scale} after it")
    if sign:
        unscaled = -unscaled
    if n.precision <= 18:
        small = unscaled
        return w_i64(w, small)
    raw = unscaled.to_bytes(16, "little", signed=True)
    return w_bytes(w, PyBytes_AS_STRING(raw), 16)


cdef int enc_bytes(Node n, Writer *w, object v) except -1:
    cdef Py_buffer view
    if PyBytes_CheckExact(v):
        w_len(w, PyBytes_GET_SIZE(v), "a binary length")
        return w_bytes(w, PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v))
    if not isinstance(v, (bytes, bytearray, memoryview)):
        type_error(n, "bytes (or bytearray, memoryview)", v)
    PyObject_GetBuffer(v, &view, PyBUF_SIMPLE)
    try:
        w_len(w, view.len, "a binary length")
        return w_bytes(w, <const char *>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef int enc_record(Node n, Writer *w, object v) except -1:
    cdef Py_ssize_t i, found = 0
    cdef PyObject *item
    cdef tuple names = n.names, children = n.children
    if PyDict_Check(v):
        for i in range(n.nfields):
            item = PyDict_GetItem(v, <object>PyTuple_GET_ITEM(names, i))
            if item == NULL:
                enc(<Node>PyTuple_GET_ITEM(children, i), w, None)
            else:
                found += 1
                enc(<Node>PyTuple_GET_ITEM(children, i), w, <object>item)
        if found != PyDict_Size(v):
            unknown = sorted(str(k) for k in v if k not in names)
            raise ValueError(f"{n.what} has no field(s) {unknown}; its fields: {list(names)}")
        return 0
    if PyTuple_CheckExact(v) or PyList_CheckExact(v):
        if len(v) != n.nfields:
            raise ValueError(f"{n.what} has {n.nfields} fields {list(names)}, got a {type(v).__name__} of "
                             f"{len(v)}: {_short(v)}")
        for i in range(n.nfields):
            enc(<Node>PyTuple_GET_ITEM(children, i), w, v[i])
        return 0
    if isinstance(v, (str, bytes, int, float)) or v is None:
        type_error(n, "a dict, a tuple or an object with its fields as attributes", v)
    for i in range(n.nfields):   # a dataclass instance, a namedtuple, a Spark Row: fields by name
        name = <object>PyTuple_GET_ITEM(names, i)
        try:
            field = getattr(v, name)
        except AttributeError:
            raise TypeError(f"{n.what} expects a dict, a tuple or an object with the attributes {list(names)}; "
                            f"{_short(v)} of type {type(v).__name__} has no attribute {name!r}") from None
        enc(<Node>PyTuple_GET_ITEM(children, i), w, field)
    return 0


cdef int enc(Node n, Writer *w, object v) except -1:
    """One value at position n (with its null flag when n is nullable)."""
    cdef int k = n.kind
    cdef Py_ssize_t size, i
    cdef const char *p
    cdef Node f
    cdef object item
    if v is None:
        if n.nullable:
            return w_u8(w, 0)
        raise TypeError(f"{n.what} is not nullable, got None")
    if n.nullable:
        w_u8(w, 1)
    if k == R_INT64:
        return w_i64(w, as_int(n, v, -9223372036854775807LL - 1, 9223372036854775807LL))
    if k == R_FLOAT64:
        return w_f64(w, as_float(n, v))
    if k == R_STRING:
        if not PyUnicode_Check(v):
            type_error(n, "a str", v)
        p = PyUnicode_AsUTF8AndSize(v, &size)
        w_len(w, size, "a string length")
        return w_bytes(w, p, size)
    if k == R_BOOL:
        if v is True:
            return w_u8(w, 1)
        if v is False:
            return w_u8(w, 0)
        if isinstance(v, _np_bool):
            return w_u8(w, 1 if v else 0)
        return type_error(n, "a bool", v)
    if k == R_TIMESTAMP:
        return enc_timestamp(n, w, v)
    if k == R_LIST:
        f = n.a
        if PyList_CheckExact(v):
            # in place (no copy): each element is held while it is encoded, and a list that encoding it (Python code
            # of an element) resized is refused, as a dict is
            size = PyList_GET_SIZE(v)
            w_len(w, size, "a list length")
            for i in range(size):
                if i >= PyList_GET_SIZE(v):
                    break
                item = <object>PyList_GET_ITEM(v, i)
                enc(f, w, item)
            if PyList_GET_SIZE(v) != size:
                raise RuntimeError("list changed size during serialization")
            return 0
        if not PyTuple_CheckExact(v):
            if not isinstance(v, (list, tuple)):
                type_error(n, "a list (or tuple)", v)
            v = tuple(v)   # a snapshot of the elements: encoding them may run Python code
        size = PyTuple_GET_SIZE(v)
        w_len(w, size, "a list length")
        for i in range(size):
            enc(f, w, <object>PyTuple_GET_ITEM(v, i))
        return 0
    if k == R_RECORD:
        return enc_record(n, w, v)
    if k == R_INT32:
        return w_u32(w, <uint32_t><int32_t>as_int(n, v, -2147483648LL, 2147483647LL))
    if k == R_INT16:
        i = <Py_ssize_t>as_int(n, v, -32768, 32767)
        memcpy(w_reserve(w, 2), &i, 2)   # the low two bytes: little-endian
        return 0
    if k == R_INT8:
        return w_u8(w, <uint8_t><int8_t>as_int(n, v, -128, 127))
    if k == R_FLOAT32:
        return w_f32(w, n, as_float(n, v))
    if k == R_BINARY:
        return enc_bytes(n, w, v)
    if k == R_DATE:
        if PyDateTime_Check(v) or not PyDate_Check(v):
            type_error(n, "a datetime.date", v)
        return w_u32(w, <uint32_t><int32_t>days_from_civil(date_year(v), date_month(v), date_day(v)))
    if k == R_DECIMAL:
        return enc_decimal(n, w, v)
    if k == R_MAP:
        if not PyDict_Check(v):
            type_error(n, "a dict", v)
        w_len(w, PyDict_Size(v), "a map size")
        size = 0
        for key, item in v.items():
            if key is None:
                raise TypeError(f"{n.what} cannot hold a None key")
            enc(n.a, w, key)
            enc(n.b, w, item)
            size += 1
        if size != PyDict_Size(v):
            raise RuntimeError("dictionary changed size during serialization")
        return 0
    raise AssertionError(f"unknown node kind {k}")


# ---- decoding ---------------------------------------------------------------------------------------------------

cdef object r_str(Cursor *c, Py_ssize_t n):
    cdef const uint8_t *p = cur_read(c, n)
    try:
        return PyUnicode_DecodeUTF8(<const char *>p, n, NULL)
    except UnicodeDecodeError as e:
        raise CorruptSnapshotError(f"a string of {n} bytes is not valid UTF-8 ({e.reason} at byte {e.start}): "
                                   "the data is truncated or corrupt") from None


cdef object dec_timestamp(Node n, Cursor *cur):
    cdef int64_t raw = r_i64(cur), us, days, rest
    cdef int y, m, d
    cdef object out
    if n.unit == 3:
        us = floor_div(raw, 1000)
    elif n.unit == 2:
        us = raw
    else:
        if raw > MAX_US // unit_div(n.unit) or raw < MIN_US // unit_div(n.unit):
            cur.pos -= 8
            cur_corrupt(cur, f"a timestamp of {raw} {('s', 'ms')[n.unit]} (outside years 1 to 9999)")
        us = raw * unit_div(n.unit)
    if us > MAX_US or us < MIN_US:
        cur.pos -= 8
        cur_corrupt(cur, f"a timestamp of {us} microseconds (outside years 1 to 9999)")
    days = floor_div(us, US_PER_DAY)
    rest = us - days * US_PER_DAY
    civil_from_days(days, &y, &m, &d)
    out = datetime_new(y, m, d, <int>(rest // 3600000000LL), <int>((rest // 60000000LL) % 60),
                       <int>((rest // 1000000LL) % 60), <int>(rest % 1000000LL),
                       None if n.tz is None else _utc)
    if n.tz is None or n.tz_utc:
        return out
    return out.astimezone(n.tz)


cdef object dec_date(Cursor *cur):
    cdef int32_t days = r_i32(cur)
    cdef int y, m, d
    if days < -719162 or days > 2932896:   # 0001-01-01 .. 9999-12-31
        cur.pos -= 4
        cur_corrupt(cur, f"a date of {days} days since 1970 (outside years 1 to 9999)")
    civil_from_days(days, &y, &m, &d)
    return date_new(y, m, d)


cdef object dec_decimal(Node n, Cursor *cur):
    cdef int64_t small
    if n.precision <= 18:
        small = r_i64(cur)
        unscaled = small
    else:
        unscaled = int.from_bytes(PyBytes_FromStringAndSize(<const char *>cur_read(cur, 16), 16), "little",
                                  signed=True)
    if abs(unscaled) >= n.limit:
        cur_corrupt(cur, f"a decimal of more than {n.precision} digits")
    return _Decimal(f"{unscaled}E-{n.scale}") if n.scale else _Decimal(unscaled)


cdef object dec_record(Node n, Cursor *cur):
    cdef Py_ssize_t i, nf = n.nfields
    cdef tuple children = n.children, names = n.names
    cdef object out, item, obj
    if n.form == FORM_TUPLE:
        out = PyTuple_New(nf)
        for i in range(nf):
            item = dec(<Node>PyTuple_GET_ITEM(children, i), cur)
            Py_INCREF(item)
            PyTuple_SET_ITEM(out, i, item)
        return out
    out = _PyDict_NewPresized(nf)
    for i in range(nf):
        PyDict_SetItem(out, <object>PyTuple_GET_ITEM(names, i), dec(<Node>PyTuple_GET_ITEM(children, i), cur))
    if n.form == FORM_DICT:
        return out
    if n.form == FORM_FACTORY:
        return n.cls(out)
    # a class instance as unpickling builds one: __new__, then the fields (no __init__, no __post_init__; a frozen
    # dataclass's __setattr__ is bypassed as pickle bypasses it)
    obj = _object_new(n.cls)
    if n.cls_dict:
        obj.__dict__.update(out)
    else:
        for i in range(nf):
            name = <object>PyTuple_GET_ITEM(names, i)
            PyObject_GenericSetAttr(obj, name, <object>PyDict_GetItem(out, name))
    return obj


cdef object dec(Node n, Cursor *cur):
    """One value at position n (after its null flag when n is nullable)."""
    cdef int k = n.kind
    cdef Py_ssize_t size, i
    cdef uint8_t flag
    cdef int16_t i16
    cdef float f32
    cdef double f64
    cdef object out, item, key
    cdef Node f
    if n.nullable:
        flag = cur_u8(cur)
        if flag == 0:
            return None
        if flag != 1:
            cur.pos -= 1
            cur_corrupt(cur, f"a null flag of {flag} (only 0 and 1 are valid)")
    if k == R_INT64:
        return PyLong_FromLongLong(r_i64(cur))
    if k == R_FLOAT64:
        memcpy(&f64, cur_read(cur, 8), 8)
        return PyFloat_FromDouble(f64)
    if k == R_STRING:
        size = cur_count(cur, 1, "a string length")
        return r_str(cur, size)
    if k == R_BOOL:
        flag = cur_u8(cur)
        if flag > 1:
            cur.pos -= 1
            cur_corrupt(cur, f"a bool byte of {flag} (only 0 and 1 are valid)")
        return flag == 1
    if k == R_TIMESTAMP:
        return dec_timestamp(n, cur)
    if k == R_LIST:
        f = n.a
        size = cur_count(cur, f.min_size, "a list length")
        out = PyList_New(size)
        for i in range(size):
            item = dec(f, cur)
            Py_INCREF(item)
            PyList_SET_ITEM(out, i, item)
        return out
    if k == R_RECORD:
        return dec_record(n, cur)
    if k == R_INT32:
        return PyLong_FromLongLong(r_i32(cur))
    if k == R_INT16:
        memcpy(&i16, cur_read(cur, 2), 2)
        return PyLong_FromLongLong(i16)
    if k == R_INT8:
        return PyLong_FromLongLong(<int8_t>cur_u8(cur))
    if k == R_FLOAT32:
        memcpy(&f32, cur_read(cur, 4), 4)
        return PyFloat_FromDouble(f32)
    if k == R_BINARY:
        size = cur_count(cur, 1, "a binary length")
        return PyBytes_FromStringAndSize(<const char *>cur_read(cur, size), size)
    if k == R_DATE:
        return dec_date(cur)
    if k == R_DECIMAL:
        return dec_decimal(n, cur)
    if k == R_MAP:
        size = cur_count(cur, n.a.min_size + n.b.min_size, "a map size")
        out = {}
        for i in range(size):
            key = dec(n.a, cur)
            out[key] = dec(n.b, cur)
        if len(out) != size:
            cur_corrupt(cur, f"a map of {size} entries with duplicate keys")
        return out
    raise AssertionError(f"unknown node kind {k}")
