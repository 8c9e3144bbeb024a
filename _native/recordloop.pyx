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
# context's slots set from C. Outputs go to an OutputSink: per column a typed buffer (int64, float64) or a Python list,
# converted to Arrow once per batch; a value the typed buffer does not take exactly (a bool, a numpy scalar, an int past
# int64) turns that column into a list, so pyarrow converts it and errs as it always did.
#
# Every index read is below the array's length, and a buffer's address is read only for arrays of the types above.

from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_DECREF
from cpython.long cimport PyLong_FromLongLong, PyLong_AsLongLongAndOverflow, PyLong_CheckExact
from cpython.float cimport PyFloat_FromDouble, PyFloat_CheckExact, PyFloat_AS_DOUBLE
from cpython.bool cimport PyBool_FromLong
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.unicode cimport PyUnicode_DecodeUTF8
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

cdef enum:
    B_LIST = 0
    B_INT64
    B_FLOAT64


cdef class _Builder:
    """One output column: an int64 or float64 buffer (with a validity byte per value) while every value is of that
    exact type or None, else a list for pyarrow."""
    cdef int kind
    cdef object type
    cdef list values
    cdef char* data
    cdef uint8_t* valid
    cdef Py_ssize_t n, capacity, nulls

    def __dealloc__(self):
        PyMem_Free(self.data)
        PyMem_Free(self.valid)

    cdef int _grow(self) except -1:
        cdef Py_ssize_t capacity = self.capacity * 2 if self.capacity else 1024
        cdef char* data = <char*>PyMem_Realloc(self.data, capacity * 8)
        if data == NULL:
            raise MemoryError()
        self.data = data
        cdef uint8_t* valid = <uint8_t*>PyMem_Realloc(self.valid, capacity)
        if valid == NULL:
            raise MemoryError()
        self.valid = valid
        self.capacity = capacity
        return 0

    cdef int _to_list(self) except -1:
        cdef Py_ssize_t k
        cdef list values = []
        for k in range(self.n):
            if not self.valid[k]:
                values.append(None)
            elif self.kind == B_INT64:
                values.append(PyLong_FromLongLong((<int64_t*>self.data)[k]))
            else:
                values.append(PyFloat_FromDouble((<double*>self.data)[k]))
        self.values = values
        self.kind = B_LIST
        self.n = self.nulls = 0
        return 0

    cdef inline int append(self, object value) except -1:
        cdef int overflow = 0
        cdef long long v
        if self.kind == B_LIST:
            self.values.append(value)
            return 0
        if self.n == self.capacity:
            self._grow()
        if value is None:
            self.valid[self.n] = 0
            self.nulls += 1
            self.n += 1
            return 0
        if self.kind == B_INT64 and PyLong_CheckExact(value):
            v = PyLong_AsLongLongAndOverflow(value, &overflow)
            if not overflow:
                (<int64_t*>self.data)[self.n] = v
                self.valid[self.n] = 1
                self.n += 1
                return 0
        elif self.kind == B_FLOAT64 and PyFloat_CheckExact(value):
            (<double*>self.data)[self.n] = PyFloat_AS_DOUBLE(value)
            self.valid[self.n] = 1
            self.n += 1
            return 0
        self._to_list()
        self.values.append(value)
        return 0

    cdef object finish(self):
        cdef object array, mask = None
        if self.kind == B_LIST:
            values, self.values = self.values, []
            return pa.array(values, type=self.type)
        dtype = np.int64 if self.kind == B_INT64 else np.float64
        out = np.empty(self.n, dtype=dtype)
        if self.n:
            memcpy(<char*><uintptr_t>out.ctypes.data, self.data, self.n * 8)
        if self.nulls:
            valid = np.empty(self.n, dtype=np.uint8)
            memcpy(<char*><uintptr_t>valid.ctypes.data, self.valid, self.n)
            mask = valid == 0
        array = pa.array(out, type=self.type, mask=mask)
        self.n = self.nulls = 0
        return array


cdef _Builder _builder(object type):
    cdef _Builder b = _Builder.__new__(_Builder)
    b.type = type
    b.kind = B_INT64 if type == pa.int64() else B_FLOAT64 if type == pa.float64() else B_LIST
    b.values = []
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
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
                self._reset()
                field = self.schema.field(k)
                raise type(e)(f"output field {field.name!r} (of type {field.type}): {e}") from e
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
