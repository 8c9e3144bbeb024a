# The compiled per-record loop of a keyed subtask (issue 33 item 1).
#
# Records reach process_element as Row objects: a row is a batch (the columns' Arrow buffers, read in place) and an
# index, so no dict and no per-column Python list is built per batch. Primitive columns (integers, floats, booleans,
# strings, binary) are read from their buffers on access; other types (timestamps, dates, decimals, nested) are
# converted per column with to_pylist the first time one of their values is read. A row nobody kept after its call is
# reused for the next record (its reference count says so), so rows cost no allocation and none outlives its call
# unless the function kept it, which keeps the values it shows valid (the batch lives as long as its rows).
#
# The function is called with vectorcall, the key switched with the backend's compiled set_current_key, and the
# context's slots set from C. Outputs go to an OutputSink: per column typed buffers in Arrow's layout for the common
# types (integers, floats, bool, strings, binary, timestamps, dates; nulls in a validity bitmap), made into the batch's
# Arrow arrays with pa.Array.from_buffers; from the first value a column's buffers do not take exactly (a numpy
# scalar, a value out of range, a wrong type) its values go to a list that pyarrow converts, so the column accepts and
# refuses what the Python path did, with its errors. The timers that are due fire in this module too (fire_timers).
#
# Every index read is below the array's length, and a buffer's address is read only for arrays of the types above.

cimport cython
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_DECREF
from cpython.long cimport PyLong_FromLongLong, PyLong_AsLongLongAndOverflow, PyLong_AsLongLong, PyLong_CheckExact
from cpython.float cimport PyFloat_FromDouble, PyFloat_CheckExact, PyFloat_AS_DOUBLE
from cpython.bool cimport PyBool_FromLong
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_CheckExact, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8, PyUnicode_CheckExact
from cpython.tuple cimport PyTuple_GET_SIZE, PyTuple_GET_ITEM, PyTuple_CheckExact
from cpython.list cimport PyList_GET_SIZE, PyList_GET_ITEM, PyList_CheckExact
from cpython.dict cimport PyDict_GetItem, PyDict_Size, PyDict_CheckExact
from cpython.mem cimport PyMem_Malloc, PyMem_Realloc, PyMem_Free
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy

from collections.abc import ItemsView, Mapping, ValuesView

import numpy as np
import pyarrow as pa

cdef extern from "Python.h":
    object PyObject_Vectorcall(object callable, PyObject **args, size_t nargsf, PyObject *kwnames)
    Py_ssize_t Py_REFCNT(object o)

cdef enum:
    K_PYLIST = 0
    K_INT8
    K_INT16
    K_INT32
    K_INT64
    K_UINT8
    K_UINT16
    K_UINT32
    K_UINT64
    K_FLOAT32
    K_FLOAT64
    K_BOOL
    K_STRING
    K_LARGE_STRING
    K_BINARY
    K_LARGE_BINARY

_FIXED = {pa.int8(): K_INT8, pa.int16(): K_INT16, pa.int32(): K_INT32, pa.int64(): K_INT64, pa.uint8(): K_UINT8,
          pa.uint16(): K_UINT16, pa.uint32(): K_UINT32, pa.uint64(): K_UINT64, pa.float32(): K_FLOAT32,
          pa.float64(): K_FLOAT64, pa.bool_(): K_BOOL, pa.string(): K_STRING, pa.large_string(): K_LARGE_STRING,
          pa.binary(): K_BINARY, pa.large_binary(): K_LARGE_BINARY}


cdef inline const uint8_t* _address(object buffer):
    return NULL if buffer is None else <const uint8_t*><uintptr_t>buffer.address


cdef class _Column:
    """One column of a batch: its Arrow array (kept alive) and where its buffers are, or its values as a list."""
    cdef int kind
    cdef object array
    cdef object values          # K_PYLIST: the column's to_pylist(), made on the first read
    cdef const uint8_t* validity
    cdef const uint8_t* data
    cdef const uint8_t* offsets
    cdef Py_ssize_t offset
    cdef Py_ssize_t length

    cdef object get(self, Py_ssize_t i):
        cdef Py_ssize_t k
        cdef int64_t start, end
        if self.kind == K_PYLIST:
            if self.values is None:
                self.values = self.array.to_pylist()
            return <object>PyList_GET_ITEM(self.values, i)
        k = i + self.offset
        if self.validity != NULL and not (self.validity[k >> 3] >> (k & 7)) & 1:
            return None
        if self.kind == K_INT64:
            return PyLong_FromLongLong((<const int64_t*>self.data)[k])
        if self.kind == K_FLOAT64:
            return PyFloat_FromDouble((<const double*>self.data)[k])
        if self.kind == K_STRING or self.kind == K_BINARY:
            start = (<const int32_t*>self.offsets)[k]
            end = (<const int32_t*>self.offsets)[k + 1]
        elif self.kind == K_LARGE_STRING or self.kind == K_LARGE_BINARY:
            start = (<const int64_t*>self.offsets)[k]
            end = (<const int64_t*>self.offsets)[k + 1]
        elif self.kind == K_INT32:
            return PyLong_FromLongLong((<const int32_t*>self.data)[k])
        elif self.kind == K_INT16:
            return PyLong_FromLongLong((<const int16_t*>self.data)[k])
        elif self.kind == K_INT8:
            return PyLong_FromLongLong((<const int8_t*>self.data)[k])
        elif self.kind == K_UINT8:
            return PyLong_FromLongLong((<const uint8_t*>self.data)[k])
        elif self.kind == K_UINT16:
            return PyLong_FromLongLong((<const uint16_t*>self.data)[k])
        elif self.kind == K_UINT32:
            return PyLong_FromLongLong((<const uint32_t*>self.data)[k])
        elif self.kind == K_UINT64:
            return int((<const uint64_t*>self.data)[k])
        elif self.kind == K_FLOAT32:
            return PyFloat_FromDouble((<const float*>self.data)[k])
        else:  # K_BOOL
            return PyBool_FromLong((self.data[k >> 3] >> (k & 7)) & 1)
        if self.kind == K_STRING or self.kind == K_LARGE_STRING:
            return PyUnicode_DecodeUTF8(<const char*>self.data + start, end - start, NULL)
        return PyBytes_FromStringAndSize(<const char*>self.data + start, end - start)


cdef _Column _column(object array):
    cdef _Column c = _Column.__new__(_Column)
    c.array = array
    c.length = len(array)
    c.kind = _FIXED.get(array.type, K_PYLIST)
    if c.kind == K_PYLIST:
        return c
    buffers = array.buffers()
    c.offset = array.offset
    c.validity = _address(buffers[0]) if array.null_count else NULL
    if c.kind in (K_STRING, K_LARGE_STRING, K_BINARY, K_LARGE_BINARY):
        c.offsets = _address(buffers[1])
        c.data = _address(buffers[2])
    else:
        c.data = _address(buffers[1])
    if c.length and (c.data == NULL and c.kind not in (K_STRING, K_LARGE_STRING, K_BINARY, K_LARGE_BINARY)
                     or c.kind in (K_STRING, K_LARGE_STRING, K_BINARY, K_LARGE_BINARY) and c.offsets == NULL):
        c.kind = K_PYLIST   # no buffer where one was expected: let pyarrow read it
    if c.kind in (K_STRING, K_LARGE_STRING, K_BINARY, K_LARGE_BINARY) and c.data == NULL:
        c.kind = K_PYLIST   # every value empty or null, with no data buffer
    return c


cdef class RecordBatchView:
    """A table's columns as the rows of one batch read them: field names, their positions, their readers."""
    cdef readonly tuple names
    cdef dict index
    cdef list columns
    cdef readonly Py_ssize_t num_rows

    def __init__(self, table):
        if isinstance(table, pa.Table):
            table = table.combine_chunks()
            arrays = [c.chunks[0] if c.num_chunks else pa.array([], type=c.type) for c in table.columns]
        else:
            arrays = list(table.columns)
        self.names = tuple(table.schema.names)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.columns = [_column(a) for a in arrays]
        self.num_rows = table.num_rows

    def row(self, Py_ssize_t i):
        """Row ``i`` (IndexError outside the batch)."""
        if i < 0 or i >= self.num_rows:
            raise IndexError(f"row {i} of a batch of {self.num_rows}")
        return _row(self, i)


cdef inline Row _row(RecordBatchView view, Py_ssize_t i):
    cdef Row r = Row.__new__(Row)
    r.view = view
    r.i = i
    return r


cdef class Row:
    """One input record as ``process_element`` receives it: a read-only mapping of field name to value, as a dict of
    the record's columns would be (``record["amount"]``, ``get``, ``in``, ``keys``/``values``/``items``,
    ``dict(record)``, equal to a dict of the same items), and each field also an attribute (``record.amount``;
    methods of the mapping win over a field of the same name). Values are read from the batch's Arrow buffers when
    asked for. ``dict(record)`` is a copy to keep or change."""

    cdef RecordBatchView view
    cdef Py_ssize_t i

    def __getitem__(self, key):
        cdef object pos = self.view.index.get(key) if isinstance(key, str) else None
        if pos is None:
            raise KeyError(key)
        return (<_Column>self.view.columns[<Py_ssize_t>pos]).get(self.i)

    def __getattr__(self, name):
        pos = self.view.index.get(name)
        if pos is None:
            raise AttributeError(f"the record has no field {name!r}; its fields are {list(self.view.names)}")
        return (<_Column>self.view.columns[<Py_ssize_t>pos]).get(self.i)

    def get(self, key, default=None):
        """The value of field ``key``, or ``default`` if the record has no such field."""
        pos = self.view.index.get(key) if isinstance(key, str) else None
        if pos is None:
            return default
        return (<_Column>self.view.columns[<Py_ssize_t>pos]).get(self.i)

    def __contains__(self, key):
        return isinstance(key, str) and key in self.view.index

    def __len__(self):
        return len(self.view.names)

    def __iter__(self):
        return iter(self.view.names)

    def keys(self):
        """The field names, in the schema's order (a set-like view, as a dict's)."""
        return self.view.index.keys()

    def values(self):
        """The values, in the schema's order."""
        return ValuesView(self)

    def items(self):
        """(name, value) pairs, in the schema's order (set-like, as a dict's)."""
        return ItemsView(self)

    def copy(self):
        """The record as a new dict."""
        return self._dict()

    cdef dict _dict(self):
        cdef Py_ssize_t k
        cdef dict d = {}
        for k in range(len(self.view.names)):
            d[self.view.names[k]] = (<_Column>self.view.columns[k]).get(self.i)
        return d

    def __eq__(self, other):
        if isinstance(other, Row):
            return self._dict() == (<Row>other)._dict()
        if isinstance(other, Mapping):
            return self._dict() == dict(other)
        return NotImplemented

    def __ne__(self, other):
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    __hash__ = None

    def __repr__(self):
        return repr(self._dict())

    def __reduce__(self):
        return dict, (self._dict(),)

    def __dir__(self):
        return sorted(set(dir(type(self))) | {n for n in self.view.names if isinstance(n, str) and n.isidentifier()})


Mapping.register(Row)


# ---- outputs --------------------------------------------------------------------------------------------------------
#
# An output column is a _Builder: while every value is one its Arrow type takes exactly (below), it is written into
# buffers in Arrow's own layout (a validity bitmap; fixed-width values, bits for booleans, or offsets and UTF-8/bytes
# data), and the batch's array is made from those buffers with pa.Array.from_buffers. The first value it does not take
# (a numpy scalar, a float in an int column, a datetime with another time zone, a value out of range, a wrong type)
# ends the typed part: it and every later value of the batch go to a list that pyarrow converts, as the Python path
# converted everything, so whatever that path accepted is accepted and whatever it refused raises its error. What the
# buffers take, each exactly as pyarrow converts it:
#   integers     an int (not a bool) within the type's range
#   floats       a float; an int within +-2**53 (float64) or +-2**24 (float32), the range pyarrow converts exactly
#   bool         True or False
#   string       a str that encodes as UTF-8;  binary: bytes
#   timestamp    an int in int64 (the value in the type's unit); a datetime, naive or in datetime.timezone.utc,
#                truncated to the unit (a naive one is UTC, as pyarrow reads it)
#   date32/64    an int in the type's range (days / ms); a date (not a datetime)
# and None is a null in every one. Every write is below the capacity just checked; memory is the builder's own until
# the array is made, then copied into Arrow buffers.

from cpython.datetime cimport (import_datetime, PyDateTime_CheckExact, PyDate_CheckExact, PyDateTime_GET_YEAR,
                               PyDateTime_GET_MONTH, PyDateTime_GET_DAY, PyDateTime_DATE_GET_HOUR,
                               PyDateTime_DATE_GET_MINUTE, PyDateTime_DATE_GET_SECOND,
                               PyDateTime_DATE_GET_MICROSECOND, PyDateTime_DATE_GET_TZINFO)
from libc.string cimport memset
from libc.stdint cimport INT64_MAX, INT64_MIN, INT32_MAX

import_datetime()

import datetime as _datetime

cdef extern from "Python.h":
    const char* _utf8_of "PyUnicode_AsUTF8AndSize"(object unicode, Py_ssize_t* size)
    void PyErr_Clear()
    bint PyBool_Check(object o)
    unsigned long long PyLong_AsUnsignedLongLong(object o)
    PyObject* PyErr_Occurred()

cdef object _UTC = _datetime.timezone.utc

cdef enum:
    B_LIST = 0
    B_INTEGER       # signed or unsigned up to 64 bits, within [lo, hi] (uint64 above int64: B_UINT64)
    B_UINT64
    B_FLOAT32
    B_FLOAT64
    B_BOOL
    B_STRING
    B_BINARY
    B_TIMESTAMP
    B_DATE32
    B_DATE64

cdef int64_t _TWO_53 = (<int64_t>1) << 53
cdef int64_t _TWO_24 = (<int64_t>1) << 24
cdef Py_ssize_t PY_SSIZE_T_MAX_HALF = (<Py_ssize_t>1) << 62
cdef dict _UNITS = {"s": 0, "ms": 1, "us": 2, "ns": 3}


cdef inline int64_t _days_from_civil(int64_t y, int64_t m, int64_t d) noexcept:
    # Days since 1970-01-01 of a proleptic Gregorian date (years 1..9999, as datetime holds: never negative here).
    y -= m <= 2
    cdef int64_t era = y // 400
    cdef int64_t yoe = y - era * 400
    cdef int64_t doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    cdef int64_t doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


cdef inline void _set_bits(uint8_t* bitmap, Py_ssize_t n) noexcept:
    # bits [0, n) set; the bitmap's bytes past them are zero already
    memset(bitmap, 0xFF, n >> 3)
    if n & 7:
        bitmap[n >> 3] = <uint8_t>((1 << (n & 7)) - 1)


cdef object _arrow_buffer(const uint8_t* data, Py_ssize_t nbytes):
    """A new Arrow buffer (Arrow's allocator: aligned as Arrow wants) holding ``nbytes`` bytes of ``data``."""
    buffer = pa.allocate_buffer(nbytes)
    if nbytes:
        memcpy(<void*><uintptr_t>buffer.address, data, nbytes)
    return buffer


cdef int _grow(void** buffer, Py_ssize_t* capacity, Py_ssize_t needed, Py_ssize_t item_size,
               Py_ssize_t first) except -1:
    """Make ``*buffer`` hold at least ``needed`` items of ``item_size`` bytes, doubling ``*capacity`` (from ``first``)
    until it does: amortized O(1) per item appended. The caller bounds ``needed`` first, so nothing overflows."""
    cdef Py_ssize_t grown = capacity[0] if capacity[0] else first
    cdef void* p
    while grown < needed:
        grown *= 2
    if grown != capacity[0]:
        p = PyMem_Realloc(buffer[0], grown * item_size)
        if p == NULL:
            raise MemoryError()
        buffer[0] = p
        capacity[0] = grown
    return 0


cdef class _Builder:
    """One output column of the batch: typed buffers while every value is one its type takes exactly, then a list
    for pyarrow (see above)."""
    cdef int kind               # B_LIST once the typed part has ended (or from the start for other types)
    cdef int typed              # the kind a new batch starts with
    cdef object type
    cdef list rest              # the values from the first one the buffers did not take
    cdef uint8_t* valid         # validity bitmap of capacity bits, zero beyond n; kept only once a null came
    cdef uint8_t* data          # fixed width: capacity values (bool: bits, zero beyond n); else the bytes
    cdef uint8_t* offsets       # string/binary: capacity + 1 offsets of `width` bytes
    cdef Py_ssize_t n, capacity, nulls, data_len, data_capacity
    cdef int width              # bytes per value (fixed) or per offset (string/binary); 0 for bool
    cdef int64_t lo, hi         # B_INTEGER / B_DATE32: the values the type holds
    cdef int unit               # B_TIMESTAMP: 0 s, 1 ms, 2 us, 3 ns

    def __dealloc__(self):
        PyMem_Free(self.valid)
        PyMem_Free(self.data)
        PyMem_Free(self.offsets)

    cdef int _grow(self) except -1:
        cdef Py_ssize_t old = self.capacity
        cdef Py_ssize_t capacity = old * 2 if old else 1024
        cdef void* p
        if capacity > (<Py_ssize_t>1 << 58):
            raise MemoryError("an output column past 2**58 values")
        p = PyMem_Realloc(self.valid, (capacity + 7) >> 3)
        if p == NULL:
            raise MemoryError()
        self.valid = <uint8_t*>p
        memset(self.valid + ((old + 7) >> 3), 0, ((capacity + 7) >> 3) - ((old + 7) >> 3))
        if self.typed == B_STRING or self.typed == B_BINARY:
            p = PyMem_Realloc(self.offsets, (capacity + 1) * self.width)
            if p == NULL:
                raise MemoryError()
            self.offsets = <uint8_t*>p
            if old == 0:
                memset(self.offsets, 0, self.width)
        elif self.typed == B_BOOL:
            p = PyMem_Realloc(self.data, (capacity + 7) >> 3)
            if p == NULL:
                raise MemoryError()
            self.data = <uint8_t*>p
            memset(self.data + ((old + 7) >> 3), 0, ((capacity + 7) >> 3) - ((old + 7) >> 3))
        else:
            p = PyMem_Realloc(self.data, capacity * self.width)
            if p == NULL:
                raise MemoryError()
            self.data = <uint8_t*>p
        self.capacity = capacity
        return 0

    cdef int _reserve_bytes(self, Py_ssize_t more) except -1:
        if more > PY_SSIZE_T_MAX_HALF - self.data_len:
            raise MemoryError("an output column past 2**62 bytes")
        return _grow(<void**>&self.data, &self.data_capacity, self.data_len + more, 1, 4096)

    cdef inline void _store(self, int64_t v) noexcept:
        # the value's low `width` bytes at n: two's complement, so unsigned values in range store as they are
        if self.width == 8:
            (<int64_t*>self.data)[self.n] = v
        elif self.width == 4:
            (<uint32_t*>self.data)[self.n] = <uint32_t>v
        elif self.width == 2:
            (<uint16_t*>self.data)[self.n] = <uint16_t>v
        else:
            self.data[self.n] = <uint8_t>v

    cdef inline int _bytes(self, const char* p, Py_ssize_t size) except -1:
        # one string/binary value at n: its bytes, then the offset after them (False: past int32 offsets)
        if self.width == 4 and size > INT32_MAX - self.data_len:
            return 0
        if self.data_len + size > self.data_capacity:
            self._reserve_bytes(size)
        if size:
            memcpy(self.data + self.data_len, p, size)
        self.data_len += size
        if self.width == 4:
            (<int32_t*>self.offsets)[self.n + 1] = <int32_t>self.data_len
        else:
            (<int64_t*>self.offsets)[self.n + 1] = self.data_len
        return 1

    cdef int _put(self, object value) except -1:
        """Write ``value`` (not None) at n: 1 if the buffers take it exactly, 0 if pyarrow must convert it."""
        cdef int overflow = 0
        cdef long long v
        cdef double d
        cdef Py_ssize_t size
        cdef const char* p
        cdef int64_t days, seconds, micros
        cdef unsigned long long u
        cdef PyObject* tz
        cdef int kind = self.kind
        if kind == B_INTEGER or kind == B_UINT64:
            if not PyLong_CheckExact(value):
                return 0
            v = PyLong_AsLongLongAndOverflow(value, &overflow)
            if overflow == 0:
                if v < self.lo or v > self.hi:
                    return 0
                self._store(v)
                return 1
            if overflow > 0 and kind == B_UINT64:
                u = PyLong_AsUnsignedLongLong(value)
                if u == <unsigned long long>-1 and PyErr_Occurred() != NULL:
                    PyErr_Clear()
                    return 0
                (<uint64_t*>self.data)[self.n] = u
                return 1
            return 0
        if kind == B_FLOAT64 or kind == B_FLOAT32:
            if PyFloat_CheckExact(value):
                d = PyFloat_AS_DOUBLE(value)
            elif PyLong_CheckExact(value):
                v = PyLong_AsLongLongAndOverflow(value, &overflow)
                if overflow or v > self.hi or v < -self.hi:
                    return 0
                d = <double>v
            else:
                return 0
            if kind == B_FLOAT64:
                (<double*>self.data)[self.n] = d
            else:
                (<float*>self.data)[self.n] = <float>d
            return 1
        if kind == B_STRING:
            if not PyUnicode_CheckExact(value):
                return 0
            p = _utf8_of(value, &size)
            if p == NULL:   # not UTF-8 (a lone surrogate): pyarrow raises its own error
                PyErr_Clear()
                return 0
            return self._bytes(p, size)
        if kind == B_BOOL:
            if value is True:
                self.data[self.n >> 3] |= <uint8_t>(1 << (self.n & 7))
                return 1
            return value is False
        if kind == B_BINARY:
            if not PyBytes_CheckExact(value):
                return 0
            return self._bytes(PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))
        if kind == B_TIMESTAMP:
            if PyLong_CheckExact(value):
                v = PyLong_AsLongLongAndOverflow(value, &overflow)
                if overflow:
                    return 0
                (<int64_t*>self.data)[self.n] = v
                return 1
            if not PyDateTime_CheckExact(value):
                return 0
            tz = PyDateTime_DATE_GET_TZINFO(value)
            if tz != <PyObject*>None and tz != <PyObject*>_UTC:
                return 0
            days = _days_from_civil(PyDateTime_GET_YEAR(value), PyDateTime_GET_MONTH(value),
                                    PyDateTime_GET_DAY(value))
            seconds = days * 86400 + PyDateTime_DATE_GET_HOUR(value) * 3600 \
                + PyDateTime_DATE_GET_MINUTE(value) * 60 + PyDateTime_DATE_GET_SECOND(value)
            micros = PyDateTime_DATE_GET_MICROSECOND(value)
            if self.unit == 0:
                v = seconds
            elif self.unit == 1:
                v = seconds * 1000 + micros // 1000
            else:
                v = seconds * 1000000 + micros
                if self.unit == 3:
                    if v > INT64_MAX // 1000 or v < INT64_MIN // 1000:
                        return 0   # past nanoseconds' range: pyarrow's error
                    v *= 1000
            (<int64_t*>self.data)[self.n] = v
            return 1
        if kind == B_DATE32 or kind == B_DATE64:
            if PyLong_CheckExact(value):
                v = PyLong_AsLongLongAndOverflow(value, &overflow)
                if overflow or v < self.lo or v > self.hi:
                    return 0
            elif PyDate_CheckExact(value):
                v = _days_from_civil(PyDateTime_GET_YEAR(value), PyDateTime_GET_MONTH(value),
                                     PyDateTime_GET_DAY(value))
                if kind == B_DATE64:
                    v *= 86400000
            else:
                return 0
            self._store(v)
            return 1
        return 0

    cdef inline int append(self, object value) except -1:
        cdef int overflow = 0
        cdef long long v
        cdef int kind = self.kind
        if kind == B_LIST:
            self.rest.append(value)
            return 0
        if self.n == self.capacity:
            self._grow()
        if value is None:
            if self.nulls == 0:   # the first null: the bitmap starts, every value before it valid
                _set_bits(self.valid, self.n)
            self.nulls += 1
            if kind == B_STRING or kind == B_BINARY:
                self._bytes(NULL, 0)
            self.n += 1
            return 0
        # the commonest two without the general dispatch
        if kind == B_INTEGER and self.width == 8 and PyLong_CheckExact(value):
            v = PyLong_AsLongLongAndOverflow(value, &overflow)
            if overflow:
                return self._end_typed(value)
            (<int64_t*>self.data)[self.n] = v
        elif kind == B_FLOAT64 and PyFloat_CheckExact(value):
            (<double*>self.data)[self.n] = PyFloat_AS_DOUBLE(value)
        elif not self._put(value):
            return self._end_typed(value)
        if self.nulls:
            self.valid[self.n >> 3] |= <uint8_t>(1 << (self.n & 7))
        self.n += 1
        return 0

    cdef int _end_typed(self, object value) except -1:
        self.kind = B_LIST   # the typed part ends here: this value and the rest go to pyarrow
        self.rest = [value]
        return 0

    cdef object _typed_array(self):
        """The typed part as an Arrow array; the buffers are then empty (their capacity kept for the next part)."""
        cdef Py_ssize_t n = self.n
        cdef Py_ssize_t bitmap = (n + 7) >> 3
        if n == 0:
            return pa.array([], type=self.type)
        validity = _arrow_buffer(self.valid, bitmap) if self.nulls else None
        if self.typed == B_STRING or self.typed == B_BINARY:
            buffers = [validity, _arrow_buffer(self.offsets, (n + 1) * self.width),
                       _arrow_buffer(self.data, self.data_len)]
        elif self.typed == B_BOOL:
            buffers = [validity, _arrow_buffer(self.data, bitmap)]
            memset(self.data, 0, bitmap)
        else:
            buffers = [validity, _arrow_buffer(self.data, n * self.width)]
        array = pa.Array.from_buffers(self.type, n, buffers, null_count=self.nulls)
        if self.nulls:
            memset(self.valid, 0, bitmap)
        self.n = self.nulls = self.data_len = 0
        return array

    cdef object finish(self):
        """The column's values since the last finish, as one Arrow array of its type (a chunked array only where
        pyarrow made one: past 2 GiB of strings)."""
        head = self._typed_array() if self.typed != B_LIST else None
        if self.kind != B_LIST:
            return head
        rest, self.rest = self.rest, []
        self.kind = self.typed
        tail = pa.array(rest, type=self.type)
        if head is None or len(head) == 0:
            return tail
        if isinstance(tail, pa.ChunkedArray):
            return pa.chunked_array([head, *tail.chunks], type=self.type)
        return pa.concat_arrays([head, tail])


_INTEGERS = {pa.int8(): (1, -(2**7), 2**7 - 1), pa.int16(): (2, -(2**15), 2**15 - 1),
             pa.int32(): (4, -(2**31), 2**31 - 1), pa.int64(): (8, -(2**63), 2**63 - 1),
             pa.uint8(): (1, 0, 2**8 - 1), pa.uint16(): (2, 0, 2**16 - 1), pa.uint32(): (4, 0, 2**32 - 1)}


cdef _Builder _builder(object type):
    cdef _Builder b = _Builder.__new__(_Builder)
    b.type = type
    b.rest = []
    b.typed = B_LIST
    if type in _INTEGERS:
        b.typed = B_INTEGER
        b.width, b.lo, b.hi = _INTEGERS[type]
    elif type == pa.uint64():
        b.typed, b.width, b.lo, b.hi = B_UINT64, 8, 0, INT64_MAX
    elif type == pa.float64():
        b.typed, b.width, b.hi = B_FLOAT64, 8, _TWO_53
    elif type == pa.float32():
        b.typed, b.width, b.hi = B_FLOAT32, 4, _TWO_24
    elif type == pa.bool_():
        b.typed = B_BOOL
    elif type == pa.string() or type == pa.large_string():
        b.typed, b.width = B_STRING, 4 if type == pa.string() else 8
    elif type == pa.binary() or type == pa.large_binary():
        b.typed, b.width = B_BINARY, 4 if type == pa.binary() else 8
    elif pa.types.is_timestamp(type):
        b.typed, b.width, b.unit = B_TIMESTAMP, 8, _UNITS[type.unit]
    elif type == pa.date32():
        b.typed, b.width, b.lo, b.hi = B_DATE32, 4, -(2**31), 2**31 - 1
    elif type == pa.date64():
        b.typed, b.width, b.lo, b.hi = B_DATE64, 8, INT64_MIN, INT64_MAX
    b.kind = b.typed
    return b


cdef class OutputSink:
    """The function's output records, in order, as one Arrow table of the output schema (:meth:`table`). A record is
    a dict with exactly the schema's field names, a tuple (or list) of its width in its order, or an Arrow table
    holding at least its columns (others are dropped). Anything else raises, naming the record and the schema: a
    misspelled field must never become a silent null."""

    cdef readonly object schema
    cdef tuple names
    cdef frozenset wanted
    cdef Py_ssize_t width
    cdef list builders
    cdef Py_ssize_t pending
    cdef list parts

    def __init__(self, schema):
        self.schema = schema
        self.names = tuple(schema.names)
        self.wanted = frozenset(self.names)
        self.width = len(self.names)
        self.builders = [_builder(f.type) for f in schema]
        self.pending = 0
        self.parts = []

    cdef int _flush(self) except -1:
        if self.pending:
            self.parts.append(pa.Table.from_arrays(self._arrays(), schema=self.schema))
            self.pending = 0
        return 0

    cdef list _arrays(self):
        cdef Py_ssize_t k
        arrays = []
        for k in range(self.width):
            try:
                arrays.append((<_Builder>self.builders[k]).finish())
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
                self._reset()
                field = self.schema.field(k)
                where = f"output field {field.name!r} (of type {field.type})"
                try:
                    named = type(e)(f"{where}: {e}")
                except TypeError:   # an error made of other arguments (UnicodeEncodeError): the field in a note
                    named = None
                if named is None:
                    e.add_note(where)
                    raise
                raise named from e
        return arrays

    cdef void _reset(self):
        self.builders = [_builder(f.type) for f in self.schema]
        self.pending = 0

    cdef int _add_sequence(self, object record) except -1:
        cdef Py_ssize_t k, n
        cdef list builders = self.builders
        if PyTuple_CheckExact(record):
            n = PyTuple_GET_SIZE(record)
            if n == self.width:
                for k in range(n):
                    (<_Builder>builders[k]).append(<object>PyTuple_GET_ITEM(record, k))
                self.pending += 1
                return 0
        elif PyList_CheckExact(record):
            n = PyList_GET_SIZE(record)
            if n == self.width:
                for k in range(n):
                    (<_Builder>builders[k]).append(<object>PyList_GET_ITEM(record, k))
                self.pending += 1
                return 0
        else:
            n = len(record)
            if n == self.width:
                for k in range(n):
                    (<_Builder>builders[k]).append(record[k])
                self.pending += 1
                return 0
        raise ValueError(f"output record {record!r} has {n} fields; the output schema has {self.width}: "
                         f"{list(self.names)}")

    cdef int _add_dict(self, object record) except -1:
        cdef Py_ssize_t k
        cdef PyObject* value
        cdef list builders = self.builders
        if PyDict_CheckExact(record) and PyDict_Size(record) == self.width:
            for k in range(self.width):
                value = PyDict_GetItem(record, self.names[k])
                if value == NULL:
                    break
            else:
                for k in range(self.width):
                    (<_Builder>builders[k]).append(<object>PyDict_GetItem(record, self.names[k]))
                self.pending += 1
                return 0
        if record.keys() != self.wanted:
            unknown = sorted(str(k) for k in record.keys() - self.wanted)
            missing = [n for n in self.names if n not in record]
            raise ValueError(f"output record {record!r} does not match the output schema {list(self.names)}: "
                             f"unknown fields {unknown}, missing fields {missing} (give every field, None for "
                             "a null)")
        for k in range(self.width):
            (<_Builder>builders[k]).append(record[self.names[k]])
        self.pending += 1
        return 0

    cdef int _add_table(self, object table) except -1:
        self._flush()
        missing = [n for n in self.names if n not in table.column_names]
        if missing:
            raise ValueError(f"an output table lacks the output schema's columns {missing}; it has "
                             f"{table.column_names}, the schema {list(self.names)}")
        self.parts.append(table.select(list(self.names)).cast(self.schema))
        return 0

    cdef inline int add(self, object record) except -1:
        if PyTuple_CheckExact(record):
            return self._add_sequence(record)
        if PyDict_CheckExact(record):
            return self._add_dict(record)
        if isinstance(record, dict):
            return self._add_dict(record)
        if isinstance(record, (tuple, list)):
            return self._add_sequence(record)
        if isinstance(record, pa.Table):
            return self._add_table(record)
        raise TypeError(f"output record {record!r} is a {type(record).__name__}; records are dicts (field "
                        f"names {list(self.names)}), tuples in that order, or Arrow tables")

    cdef int _extend(self, object records) except -1:
        cdef Py_ssize_t k
        if PyTuple_CheckExact(records):
            for k in range(PyTuple_GET_SIZE(records)):
                self.add(<object>PyTuple_GET_ITEM(records, k))
        elif PyList_CheckExact(records):
            for k in range(PyList_GET_SIZE(records)):
                self.add(<object>PyList_GET_ITEM(records, k))
        else:
            for record in records:
                self.add(record)
        return 0

    def append(self, record):
        """Add one output record (a dict, a tuple or list, or an Arrow table)."""
        self.add(record)

    def extend(self, records):
        """Add each of ``records`` (any iterable of output records), in order."""
        self._extend(records)

    def table(self):
        """Everything added since the last call, as one table of the schema, in order; the sink is then empty."""
        self._flush()
        parts, self.parts = self.parts, []
        if not parts:
            return self.schema.empty_table()
        return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


# ---- the loop -------------------------------------------------------------------------------------------------------

def process_records(process, set_current_key, context, table, const int64_t[::1] runs, list keys,
                    const int32_t[::1] groups, const int64_t[::1] stamps, int64_t no_timestamp, OutputSink sink):
    """Call ``process(row, context)`` for every record of ``table`` (sorted by key), key by key: ``keys[i]`` is the
    key of records ``runs[i]`` to ``runs[i + 1]``, made current with ``set_current_key`` and set on ``context`` with
    its key group (``groups``, per record); ``context._timestamp`` is each record's event time (``stamps``, per
    record; empty: none; ``no_timestamp``: None). What each call returns (None, or an iterable of output records)
    goes to ``sink``."""
    cdef Py_ssize_t i, j, lo, hi
    cdef Py_ssize_t nkeys = len(keys)
    cdef bint stamped = stamps.shape[0] != 0
    cdef int64_t stamp
    cdef PyObject* args[2]
    cdef RecordBatchView view
    cdef Row row = None
    cdef object key, result
    if nkeys == 0:
        return
    if runs.shape[0] != nkeys + 1 or runs[nkeys] > table.num_rows or groups.shape[0] < runs[nkeys] \
            or stamped and stamps.shape[0] < runs[nkeys]:
        raise ValueError("process_records: runs, groups and stamps do not fit the table")
    view = RecordBatchView(table)
    args[1] = <PyObject*>context
    for i in range(nkeys):
        key = <object>PyList_GET_ITEM(keys, i)
        lo, hi = runs[i], runs[i + 1]
        if lo < 0 or hi < lo:
            raise ValueError("process_records: runs must ascend from 0")
        args[0] = <PyObject*>key
        PyObject_Vectorcall(set_current_key, args, 1, NULL)
        context.current_key = key
        context.current_key_group = groups[lo]
        for j in range(lo, hi):
            if stamped:
                stamp = stamps[j]
                context._timestamp = None if stamp == no_timestamp else PyLong_FromLongLong(stamp)
            if row is None or Py_REFCNT(row) != 1:   # kept by the function: a new row, never one changed under it
                row = _row(view, j)
            else:
                row.i = j
            args[0] = <PyObject*>row
            result = PyObject_Vectorcall(process, args, 2, NULL)
            if result is not None:
                sink._extend(result)


# ---- the timers that are due ----------------------------------------------------------------------------------------

cdef struct _Timer:
    int64_t time
    int64_t group
    int64_t seq
    PyObject* key           # a reference the heap owns


cdef inline bint _before(const _Timer* a, const _Timer* b) noexcept nogil:
    # (time, key group, registration order): the order timers fire in; seq is unique, so never a tie
    if a.time != b.time:
        return a.time < b.time
    if a.group != b.group:
        return a.group < b.group
    return a.seq < b.seq


@cython.auto_pickle(False)   # in-process only (kept warm by the registry), never pickled
cdef class TimerHeap:
    """One time domain's timers of a subtask as a priority queue: ``(timestamp, key group, sequence, key)`` entries
    in C, ordered by timestamp, then key group, then sequence (the order they were registered), so a pop costs
    integer comparisons, not tuple ones. An entry may outlive its timer (deleted, or fired from a duplicate): the
    hidden state is the truth, checked when the entry reaches the head."""

    cdef _Timer* heap
    cdef Py_ssize_t n, capacity

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self.n):
            Py_DECREF(<object>self.heap[i].key)
        PyMem_Free(self.heap)

    def __len__(self):
        return self.n

    cdef int _reserve(self, Py_ssize_t more) except -1:
        if more > (<Py_ssize_t>1 << 40) - self.n:
            raise MemoryError("a timer queue past 2**40 entries")
        return _grow(<void**>&self.heap, &self.capacity, self.n + more, sizeof(_Timer), 64)

    cdef inline void _sift_up(self, Py_ssize_t i) noexcept:
        cdef _Timer item = self.heap[i]
        cdef Py_ssize_t parent
        while i > 0:
            parent = (i - 1) >> 1
            if not _before(&item, &self.heap[parent]):
                break
            self.heap[i] = self.heap[parent]
            i = parent
        self.heap[i] = item

    cdef inline void _sift_down(self, Py_ssize_t i) noexcept:
        cdef _Timer item = self.heap[i]
        cdef Py_ssize_t child
        while True:
            child = 2 * i + 1
            if child >= self.n:
                break
            if child + 1 < self.n and _before(&self.heap[child + 1], &self.heap[child]):
                child += 1
            if not _before(&self.heap[child], &item):
                break
            self.heap[i] = self.heap[child]
            i = child
        self.heap[i] = item

    cdef int _push(self, int64_t time, int64_t group, int64_t seq, object key) except -1:
        if self.n == self.capacity:
            self._reserve(1)
        Py_INCREF(key)
        self.heap[self.n].time, self.heap[self.n].group, self.heap[self.n].seq = time, group, seq
        self.heap[self.n].key = <PyObject*>key
        self.n += 1
        self._sift_up(self.n - 1)
        return 0

    cdef inline _Timer _pop(self) noexcept:
        # the head, its key reference now the caller's (n > 0: the caller checked)
        cdef _Timer head = self.heap[0]
        self.n -= 1
        if self.n:
            self.heap[0] = self.heap[self.n]
            self._sift_down(0)
        return head

    def push(self, int64_t timestamp, int64_t key_group, int64_t sequence, key):
        """Add a timer of ``key`` at ``timestamp`` (its ``key_group``, ``sequence`` its registration order)."""
        self._push(timestamp, key_group, sequence, key)

    def extend(self, entries):
        """Add ``(timestamp, key group, sequence, key)`` entries, then restore the order once (O(n))."""
        cdef Py_ssize_t i
        cdef int64_t time, group, seq
        for timestamp, key_group, sequence, key in entries:
            time, group, seq = timestamp, key_group, sequence
            if self.n == self.capacity:
                self._reserve(1)
            Py_INCREF(key)
            self.heap[self.n].time, self.heap[self.n].group, self.heap[self.n].seq = time, group, seq
            self.heap[self.n].key = <PyObject*>key
            self.n += 1
        for i in range(self.n // 2 - 1, -1, -1):
            self._sift_down(i)

    def head(self):
        """The first entry, ``(timestamp, key group, sequence, key)``, or None if the queue is empty."""
        if self.n == 0:
            return None
        return (self.heap[0].time, self.heap[0].group, self.heap[0].seq, <object>self.heap[0].key)

    def pop(self):
        """Remove and return the first entry (IndexError if the queue is empty)."""
        if self.n == 0:
            raise IndexError("pop from an empty timer queue")
        cdef _Timer t = self._pop()
        key = <object>t.key
        Py_DECREF(key)   # the reference the heap held; ``key`` holds its own
        return (t.time, t.group, t.seq, key)

    def entries(self):
        """Every entry, in no particular order."""
        cdef Py_ssize_t i
        return [(self.heap[i].time, self.heap[i].group, self.heap[i].seq, <object>self.heap[i].key)
                for i in range(self.n)]


def fire_timers(on_timer, set_current_key, prefetch, context, timers, int64_t until, OutputSink sink,
                list fired_groups):
    """Fire the timers of ``timers`` (one domain's :class:`~keygroups.state.timers.DomainTimers`: its ``queue``, a
    :class:`TimerHeap`, and its hidden ``state``) due at or before ``until``: in timestamp order (then key group, then
    the order they were registered), each made current with ``set_current_key``, skipped if its state no longer
    holds it (deleted, or a duplicate entry of one already fired), else removed from the state and passed to
    ``on_timer(timestamp, context)`` with the context's key, key group and timestamp set; what that returns (None,
    or output records) goes to ``sink`` and each fired timer's key group to ``fired_groups``. Timers registered
    while firing at or before ``until`` fire too, in order, as Flink fires them within the same advance.
    ``prefetch(keys, key_groups)`` (None: no call) is given each run of due entries before the first of them is
    checked (RocksDB reads them together). Counts the fired timers in ``timers.fired`` and ``timers.pending``."""
    cdef TimerHeap queue = timers.queue
    cdef object state = timers.state
    cdef object contains = state.contains, remove = state.remove
    cdef _Timer* run = NULL
    cdef _Timer entry
    cdef void* p
    cdef Py_ssize_t fired = 0, i, n = 0, taken = 0, size = 0
    cdef int32_t[::1] groups
    cdef object key, timestamp, group, result
    cdef PyObject* args[2]
    try:
        while queue.n and queue.heap[0].time <= until:
            n = taken = 0
            while queue.n and queue.heap[0].time <= until:   # the run: every entry due now
                if n == size:
                    size = size * 2 if size else 256
                    p = PyMem_Realloc(run, size * sizeof(_Timer))
                    if p == NULL:
                        raise MemoryError()
                    run = <_Timer*>p
                run[n] = queue._pop()   # its key reference now the run's
                n += 1
            if prefetch is not None:
                group_array = np.empty(n, dtype=np.int32)
                groups = group_array
                for i in range(n):
                    groups[i] = <int32_t>run[i].group
                prefetch([<object>run[i].key for i in range(n)], group_array)
            while taken < n:
                # A timer registered while this run fires may be due before the run's next one.
                if queue.n and _before(&queue.heap[0], &run[taken]):
                    entry = queue._pop()
                else:
                    entry = run[taken]
                    taken += 1
                key = <object>entry.key
                Py_DECREF(key)   # the heap's (or run's) reference; ``key`` holds its own
                timestamp = PyLong_FromLongLong(entry.time)
                args[0] = <PyObject*>key
                PyObject_Vectorcall(set_current_key, args, 1, NULL)
                args[0] = <PyObject*>timestamp
                if not PyObject_Vectorcall(contains, args, 1, NULL):
                    continue
                PyObject_Vectorcall(remove, args, 1, NULL)
                fired += 1
                group = PyLong_FromLongLong(entry.group)
                context.current_key = key
                context.current_key_group = group
                fired_groups.append(group)
                context._timestamp = timestamp
                args[1] = <PyObject*>context
                result = PyObject_Vectorcall(on_timer, args, 2, NULL)
                if result is not None:
                    sink._extend(result)
            n = taken = 0
    finally:
        for i in range(taken, n):   # an error left these unfired: back to the queue, as a retry will need them
            queue._push(run[i].time, run[i].group, run[i].seq, <object>run[i].key)
            Py_DECREF(<object>run[i].key)
        PyMem_Free(run)
        timers.fired += fired
        timers.pending -= fired
