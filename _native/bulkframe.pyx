# cython: auto_pickle=False
# Many keys' state values framed at once, compiled: what the savepoint writer (keygroups/runtime/state_writer.py)
# builds from a whole column of serialized parts instead of framing one value at a time in Python. The framing is
# the one of keygroups/state/_codec.py (keyed file format 3, little-endian):
#
#   value (TTL)  = i64 timestamp | value bytes
#   list         = frame*, frame = u32 element length | [i64 timestamp] | element bytes
#   map          = frame*, the payload an entry: u32 key length | key bytes | value bytes (entryframe.pxd)
#
# Every offset array is checked against its buffer before anything is copied (CorruptSnapshotError is not the error
# here: these are the caller's own arrays, so a bad one is a ValueError); nothing is read or written outside a buffer.
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t, uint8_t, uint32_t
from libc.string cimport memcpy

cimport numpy as cnp

from entryframe cimport ENTRY_HEAD
from indexsort cimport kg_stable_sort
from keysearch cimport kg_key_cmp

import sys

import numpy as np

cnp.import_array()

if sys.byteorder != "little":   # integers are copied in host order
    raise ImportError("keygroups._native.bulkframe supports little-endian hosts only")

#: Kinds of value ``frame_values`` builds.
VALUE = 0
LIST = 1
MAP = 2

cdef enum:
    K_VALUE = 0
    K_LIST = 1
    K_MAP = 2
    FRAME_HEAD = 4
    TS_SIZE = 8


cdef class _Parts:
    """n serialized parts: a buffer and n + 1 int64 offsets into it, checked."""
    cdef Py_buffer view
    cdef bint held
    cdef cnp.ndarray offsets_array
    cdef const int64_t *offsets
    cdef Py_ssize_t n
    cdef const uint8_t *buf

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)

    cdef int open(self, object data, object offsets, str what) except -1:
        cdef Py_ssize_t i
        PyObject_GetBuffer(data, &self.view, PyBUF_SIMPLE)
        self.held = True
        self.buf = <const uint8_t *>self.view.buf
        self.offsets_array = np.ascontiguousarray(offsets, dtype=np.int64)
        if self.offsets_array.ndim != 1 or self.offsets_array.shape[0] < 1:
            raise ValueError(f"{what}: offsets must be n + 1 positions")
        self.n = self.offsets_array.shape[0] - 1
        self.offsets = <const int64_t *>cnp.PyArray_DATA(self.offsets_array)
        for i in range(self.n):
            if self.offsets[i] < 0 or self.offsets[i + 1] < self.offsets[i] or self.offsets[i + 1] > self.view.len:
                raise ValueError(f"{what}: part {i} at [{self.offsets[i]}, {self.offsets[i + 1]}) is outside its "
                                 f"{self.view.len}-byte buffer")
        return 0

    cdef inline Py_ssize_t size(self, Py_ssize_t i) noexcept nogil:
        return <Py_ssize_t>(self.offsets[i + 1] - self.offsets[i])


cdef const int64_t *_int64s(object array, Py_ssize_t n, list keep, str what) except NULL:
    cdef cnp.ndarray a = np.ascontiguousarray(array, dtype=np.int64)
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"{what}: {n} positions expected, got {a.shape[0] if a.ndim == 1 else a.ndim}")
    keep.append(a)
    return <const int64_t *>cnp.PyArray_DATA(a)


def frame_values(int kind, object rows, object elements, object keys=None, object stamps=None):
    """The framed values of n keys, from their parts serialized back to back: key ``r``'s parts are
    ``rows[r]:rows[r + 1]`` (an int64 array of n + 1 ascending positions), part ``j`` being element ``j`` of
    ``elements`` (``(buffer, offsets)``: a value, a list's element or a map's value), for a map with its key
    ``j`` of ``keys``, and with a TTL (``stamps``: int64 ms per part, else None) its timestamp. A value key has one
    part. Returns ``(bytes, int64 offsets)``: key ``r``'s value is ``bytes[offsets[r]:offsets[r + 1]]``, framed as
    ``ValueFraming.encode`` frames it."""
    cdef _Parts e = _Parts(), k = None
    cdef list keep = []
    cdef const int64_t *row = NULL
    cdef const int64_t *ts = NULL
    cdef Py_ssize_t n, j, r, total = 0, pos = 0, size, head
    cdef bint ttl = stamps is not None
    cdef uint8_t *out
    cdef uint32_t length
    cdef cnp.ndarray offsets
    cdef int64_t *value_offsets
    if kind not in (K_VALUE, K_LIST, K_MAP):
        raise ValueError(f"kind {kind} is not one of VALUE, LIST, MAP")
    e.open(elements[0], elements[1], "elements")
    if kind == K_MAP:
        if keys is None:
            raise ValueError("a map's values need their keys")
        k = _Parts()
        k.open(keys[0], keys[1], "map keys")
        if k.n != e.n:
            raise ValueError(f"{k.n} map keys but {e.n} map values")
    rows_array = np.ascontiguousarray(rows, dtype=np.int64)
    if rows_array.ndim != 1 or rows_array.shape[0] < 1:
        raise ValueError("rows must be n + 1 positions")
    n = rows_array.shape[0] - 1
    row = _int64s(rows_array, n + 1, keep, "rows")
    if row[0] != 0 or row[n] != e.n:
        raise ValueError(f"rows must run from part 0 to part {e.n}, got {row[0]} .. {row[n]}")
    for r in range(n):
        if row[r + 1] < row[r] or (kind == K_VALUE and row[r + 1] - row[r] != 1):
            raise ValueError(f"rows: key {r} has parts [{row[r]}, {row[r + 1]})")
    if ttl:
        ts = _int64s(stamps, e.n, keep, "stamps")
    head = (TS_SIZE if ttl else 0) + (0 if kind == K_VALUE else FRAME_HEAD) + (ENTRY_HEAD if kind == K_MAP else 0)
    for j in range(e.n):
        size = e.size(j) + (k.size(j) if kind == K_MAP else 0)
        if kind != K_VALUE and size + (ENTRY_HEAD if kind == K_MAP else 0) > 0xFFFFFFFF:
            raise OverflowError(f"part {j} of {size} bytes is longer than a frame can say")
        if kind == K_MAP and k.size(j) > 0xFFFFFFFF:
            raise OverflowError(f"map key {j} of {k.size(j)} bytes is longer than its length can say")
        total += head + size
    data = PyBytes_FromStringAndSize(NULL, total)
    out = <uint8_t *>PyBytes_AS_STRING(data)
    offsets = np.empty(n + 1, dtype=np.int64)
    value_offsets = <int64_t *>cnp.PyArray_DATA(offsets)
    value_offsets[0] = 0
    for r in range(n):
        for j in range(row[r], row[r + 1]):
            if kind == K_LIST:
                length = <uint32_t>e.size(j)
                memcpy(out + pos, &length, FRAME_HEAD)
                pos += FRAME_HEAD
            elif kind == K_MAP:
                length = <uint32_t>(ENTRY_HEAD + k.size(j) + e.size(j))
                memcpy(out + pos, &length, FRAME_HEAD)
                pos += FRAME_HEAD
            if ttl:
                memcpy(out + pos, &ts[j], TS_SIZE)
                pos += TS_SIZE
            if kind == K_MAP:
                length = <uint32_t>k.size(j)
                memcpy(out + pos, &length, ENTRY_HEAD)
                pos += ENTRY_HEAD
                if length:
                    memcpy(out + pos, k.buf + k.offsets[j], length)
                    pos += length
            size = e.size(j)
            if size:
                memcpy(out + pos, e.buf + e.offsets[j], size)
                pos += size
        value_offsets[r + 1] = pos
    if pos != total:
        raise SystemError(f"keygroups: {pos} bytes framed into a buffer sized for {total}")
    return data, offsets


def gather(object data, object offsets, object indices):
    """Parts ``indices`` (int64, each in [0, n)) of n parts ``(data, offsets)``, back to back:
    ``(bytes, int64 offsets)``."""
    cdef _Parts p = _Parts()
    cdef list keep = []
    cdef Py_ssize_t m, i, total = 0, pos = 0, size
    cdef const int64_t *idx
    cdef uint8_t *out
    cdef cnp.ndarray result_offsets
    cdef int64_t *o
    p.open(data, offsets, "parts")
    index_array = np.ascontiguousarray(indices, dtype=np.int64)
    m = index_array.shape[0]
    idx = _int64s(index_array, m, keep, "indices")
    for i in range(m):
        if not 0 <= idx[i] < p.n:
            raise ValueError(f"index {idx[i]} is outside [0, {p.n})")
        total += p.size(idx[i])
    result = PyBytes_FromStringAndSize(NULL, total)
    out = <uint8_t *>PyBytes_AS_STRING(result)
    result_offsets = np.empty(m + 1, dtype=np.int64)
    o = <int64_t *>cnp.PyArray_DATA(result_offsets)
    o[0] = 0
    for i in range(m):
        size = p.size(idx[i])
        if size:
            memcpy(out + pos, p.buf + p.offsets[idx[i]], size)
        pos += size
        o[i + 1] = pos
    return result, result_offsets


ctypedef struct _PartsView:
    const uint8_t *buf
    const int64_t *offsets


cdef int _part_order(const void *items, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    cdef const _PartsView *k = <const _PartsView *>items
    return kg_key_cmp(k.buf + k.offsets[a], k.offsets[a + 1] - k.offsets[a],
                      k.buf + k.offsets[b], k.offsets[b + 1] - k.offsets[b])


def has_repeated_keys(object rows, object keys):
    """Whether some key's parts ``rows[r]:rows[r + 1]`` hold two equal serialized map keys of ``keys``
    (``(buffer, offsets)``)."""
    cdef _Parts k = _Parts()
    cdef list keep = []
    cdef Py_ssize_t n, r, i, m, widest = 0
    cdef _PartsView view
    cdef const int64_t *row
    cdef Py_ssize_t *idx = NULL
    cdef Py_ssize_t *tmp = NULL
    k.open(keys[0], keys[1], "map keys")
    view.buf = k.buf
    view.offsets = k.offsets
    rows_array = np.ascontiguousarray(rows, dtype=np.int64)
    n = rows_array.shape[0] - 1
    row = _int64s(rows_array, n + 1, keep, "rows")
    for r in range(n):
        if row[r] < 0 or row[r + 1] < row[r] or row[r + 1] > k.n:
            raise ValueError(f"rows: key {r} has parts [{row[r]}, {row[r + 1]}) of {k.n}")
        if row[r + 1] - row[r] > widest:
            widest = row[r + 1] - row[r]
    if widest < 2:
        return False
    idx = <Py_ssize_t *>PyMem_Malloc(widest * sizeof(Py_ssize_t))
    tmp = <Py_ssize_t *>PyMem_Malloc(widest * sizeof(Py_ssize_t))
    try:
        if idx == NULL or tmp == NULL:
            raise MemoryError()
        for r in range(n):
            m = row[r + 1] - row[r]
            if m < 2:
                continue
            for i in range(m):
                idx[i] = row[r] + i
            kg_stable_sort(idx, tmp, m, _part_order, &view)   # the map's keys by their bytes
            for i in range(1, m):
                if _part_order(&view, idx[i - 1], idx[i]) == 0:
                    return True
        return False
    finally:
        PyMem_Free(idx)
        PyMem_Free(tmp)
