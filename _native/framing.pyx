# cython: auto_pickle=False
# The per-key value framing of keyed state, compiled: how one key's list or map value becomes bytes in a keyed
# snapshot (format 3) and in RocksDB, around the bytes the registered serializers produce. Described in
# keygroups/state/_codec.py, whose ValueFraming is the only caller besides the reader of older files
# (keygroups/checkpoint/format.py, through upgrade_block).
#
# Format 3 (little-endian, as every keygroups format whose byte order is not a sort order):
#   list value = frame*, frame = u32 payload length | [i64 timestamp, TTL states] | payload (one element)
#   map value  = frame*, the payload being one entry in the one map-entry framing (entryframe.pxd):
#                u32 key length | key | value
# A map value is thus a list value whose elements are entries, and concatenating two list encodings gives the
# encoding of the concatenated list (RocksDB appends without decoding).
#
# Formats 1 and 2 framed the same values big-endian, and a map entry as u32 key length | key | u32 value length |
# [i64 timestamp] | value; a TTL value's timestamp was big-endian too. upgrade_block rewrites such values into
# format 3 in a copy of their block: every old value has exactly the size of its format-3 form, so the block's
# offsets stay valid.
#
# Reading goes through the checked cursor (cursor.pxd) and every length is checked against the bytes that remain, so
# no bytes, whatever they say, make this module read or write outside its buffers: a damaged value raises
# CorruptSnapshotError.
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_CheckBuffer, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_Next, PyDict_Size
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE, PyList_New, PyList_SET_ITEM
from cpython.long cimport PyLong_AsLongLong, PyLong_FromLongLong
from cpython.dict cimport PyDict_SetItem
from cpython.float cimport PyFloat_Check
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_Check, PyTuple_New, PyTuple_SET_ITEM
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memmove

from cursor cimport Cursor, cur_corrupt, cur_init, cur_read, cur_remaining, cur_u32, cur_u64
from entryframe cimport ENTRY_HEAD, ent_read_key, ent_write
from writer cimport (U32_MAX, Writer, w_bytes, w_finish_bytes, w_free, w_i64, w_init, w_init_bytes, w_len,
                    w_reserve, w_result)

from keygroups._native.codec cimport Codec, dec_top, enc_top
from keygroups._native.records cimport Node, dec_whole, enc as enc_record

import sys

import numpy as np

from keygroups.errors import CorruptSnapshotError


if sys.byteorder != "little":   # the cursor and the writer copy integers in host order
    raise ImportError("keygroups._native.framing supports little-endian hosts only")

cdef extern from *:
    """
    static inline uint32_t kg_be32(const uint8_t *p) {
        uint32_t v; memcpy(&v, p, 4); return __builtin_bswap32(v);
    }
    static inline uint64_t kg_be64(const uint8_t *p) {
        uint64_t v; memcpy(&v, p, 8); return __builtin_bswap64(v);
    }
    """
    # Formats 1 and 2 only: their big-endian value framing, read while upgrading a block.
    uint32_t kg_be32(const uint8_t *p) nogil
    uint64_t kg_be64(const uint8_t *p) nogil

cdef enum:
    FRAME_HEAD = 4     # the payload length
    TS_SIZE = 8        # the timestamp of a TTL state's element or entry
    K_VALUE = 0
    K_LIST = 1
    K_MAP = 2
    K_TTL = 4

#: Framing codes for :func:`upgrade_block`: the kind (VALUE, LIST or MAP), plus TTL for a TTL state.
VALUE = K_VALUE
LIST = K_LIST
MAP = K_MAP
TTL = K_TTL


cdef object _byte_view(object buffer):
    cdef object mv = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
    if mv.ndim != 1 or mv.format != "B":
        if not mv.c_contiguous:
            raise TypeError("a framed value must be a C-contiguous buffer")
        mv = mv.cast("B")
    return mv


cdef inline Py_ssize_t _head(bint ttl) noexcept nogil:
    return FRAME_HEAD + TS_SIZE if ttl else FRAME_HEAD


cdef int _acquire(object value, Py_buffer *view) except -1:
    """The bytes of a framed value (bytes, a memoryview slice of a block, ...): one buffer acquisition, which is
    several times cheaper than a typed memoryview for the short values framed here. Release with PyBuffer_Release."""
    PyObject_GetBuffer(value, view, PyBUF_SIMPLE)
    return 0


cdef Py_ssize_t _count_frames(Cursor *c, bint ttl, str what) except -1:
    """The number of frames of the value under ``c`` (left at its start), each checked to lie inside it."""
    cdef Py_ssize_t n = 0, start = c.pos
    cdef uint32_t length
    while cur_remaining(c):
        if cur_remaining(c) < _head(ttl):
            cur_corrupt(c, f"a truncated {what} header")
        length = cur_u32(c)
        c.pos += _head(ttl) - FRAME_HEAD
        cur_read(c, length)
        n += 1
    c.pos = start
    return n


cdef inline object _copy(const uint8_t *p, Py_ssize_t n):
    return PyBytes_FromStringAndSize(<const char *>p, n)


def split_list(object value, bint ttl):
    """A list value's elements: ``(elements, timestamps)``, a list of bytes and, for a TTL state, a list of int
    timestamps (else None). CorruptSnapshotError if a frame overruns the value."""
    cdef Py_buffer view
    cdef Cursor c
    cdef Py_ssize_t n, i
    cdef uint32_t length
    cdef list elements, timestamps = None
    _acquire(value, &view)
    try:
        cur_init(&c, <const uint8_t *>view.buf, view.len)
        n = _count_frames(&c, ttl, "list element")
        elements = PyList_New(n)
        if ttl:
            timestamps = PyList_New(n)
        for i in range(n):
            length = cur_u32(&c)
            if ttl:
                _set_item(timestamps, i, PyLong_FromLongLong(<int64_t>cur_u64(&c)))
            _set_item(elements, i, _copy(cur_read(&c, length), length))
    finally:
        PyBuffer_Release(&view)
    return elements, timestamps


def split_map(object value, bint ttl):
    """A map value's entries: ``(keys, values, timestamps)``, lists of bytes and, for a TTL state, a list of int
    timestamps (else None). CorruptSnapshotError if a frame overruns the value or a key its entry."""
    cdef Py_buffer view
    cdef Cursor c, e
    cdef Py_ssize_t n, i, key_len
    cdef uint32_t length
    cdef const uint8_t *key
    cdef list keys, values, timestamps = None
    _acquire(value, &view)
    try:
        cur_init(&c, <const uint8_t *>view.buf, view.len)
        n = _count_frames(&c, ttl, "map entry")
        keys = PyList_New(n)
        values = PyList_New(n)
        if ttl:
            timestamps = PyList_New(n)
        for i in range(n):
            length = cur_u32(&c)
            if ttl:
                _set_item(timestamps, i, PyLong_FromLongLong(<int64_t>cur_u64(&c)))
            if length < ENTRY_HEAD:
                cur_corrupt(&c, f"a map entry of {length} bytes, shorter than its key length")
            cur_init(&e, cur_read(&c, length), length)
            key = ent_read_key(&e, &key_len)
            _set_item(keys, i, _copy(key, key_len))
            _set_item(values, i, _copy(e.buf + e.pos, cur_remaining(&e)))
    finally:
        PyBuffer_Release(&view)
    return keys, values, timestamps


cdef inline int _set_item(list items, Py_ssize_t i, object item) except -1:
    # items come from PyList_New(n): every slot is filled before the list is returned
    Py_INCREF(item)
    PyList_SET_ITEM(items, i, item)
    return 0


cdef Py_ssize_t _total(list items, Py_ssize_t n, str what) except -1:
    cdef Py_ssize_t i, total = 0
    cdef object item
    if len(items) != n:
        raise ValueError(f"{len(items)} {what}s for {n} items: give one per item")
    for i in range(n):
        item = <object>PyList_GET_ITEM(items, i)
        if not PyBytes_CheckExact(item):
            raise TypeError(f"{what} {i} must be bytes (serialized), got {type(item).__name__}")
        total += PyBytes_GET_SIZE(item)
    return total


cdef int _check_timestamps(object timestamps, Py_ssize_t n) except -1:
    if timestamps is not None and (type(timestamps) is not list or len(timestamps) != n):
        raise ValueError(f"timestamps must be a list of one int per item ({n}), or None without TTL; got "
                         f"{type(timestamps).__name__} of {len(timestamps)}")
    return 0


def join_list(list elements, list timestamps=None):
    """The list value of serialized ``elements`` (bytes), with one int timestamp each from ``timestamps`` for a TTL
    state (None otherwise)."""
    cdef Py_ssize_t n = len(elements), i, length
    cdef bint ttl = timestamps is not None
    cdef Py_ssize_t total = _total(elements, n, "element")
    cdef object item
    cdef Writer w
    _check_timestamps(timestamps, n)
    out = w_init_bytes(&w, n * _head(ttl) + total)
    for i in range(n):
        item = <object>PyList_GET_ITEM(elements, i)
        length = PyBytes_GET_SIZE(item)
        w_len(&w, length, "a list element's length")
        if ttl:
            w_i64(&w, PyLong_AsLongLong(<object>PyList_GET_ITEM(timestamps, i)))
        w_bytes(&w, PyBytes_AS_STRING(item), length)
    w_finish_bytes(&w)
    return out


def join_map(list keys, list values, list timestamps=None):
    """The map value of n entries, serialized ``keys`` and ``values`` (bytes) in entry order, with one int
    timestamp each from ``timestamps`` for a TTL state (None otherwise)."""
    cdef Py_ssize_t n = len(keys), i
    cdef bint ttl = timestamps is not None
    cdef Py_ssize_t total = _total(keys, n, "key") + _total(values, n, "value")
    cdef object k, v
    cdef Writer w
    _check_timestamps(timestamps, n)
    out = w_init_bytes(&w, n * (_head(ttl) + ENTRY_HEAD) + total)
    for i in range(n):
        k = <object>PyList_GET_ITEM(keys, i)
        v = <object>PyList_GET_ITEM(values, i)
        w_len(&w, ENTRY_HEAD + PyBytes_GET_SIZE(k) + PyBytes_GET_SIZE(v), "a map entry's length")
        if ttl:
            w_i64(&w, PyLong_AsLongLong(<object>PyList_GET_ITEM(timestamps, i)))
        ent_write(&w, PyBytes_AS_STRING(k), PyBytes_GET_SIZE(k), PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v))
    w_finish_bytes(&w)
    return out


def drop_expired(object value, int64_t deadline):
    """A TTL list or map value without the frames whose timestamp is <= ``deadline``: ``value`` itself when none
    is, None when all are, else a new bytes object of the live frames in order. CorruptSnapshotError if a frame
    overruns the value."""
    cdef Py_buffer view
    cdef const uint8_t *buf
    cdef Py_ssize_t start, live = 0, n = 0, kept = 0
    cdef Cursor c
    cdef uint32_t length
    cdef Writer w
    cdef object out = None
    _acquire(value, &view)
    try:
        buf = <const uint8_t *>view.buf
        cur_init(&c, buf, view.len)
        _count_frames(&c, True, "TTL frame")   # checks every frame before anything below trusts its length
        while cur_remaining(&c):
            length = cur_u32(&c)
            n += 1
            if <int64_t>cur_u64(&c) > deadline:
                live += FRAME_HEAD + TS_SIZE + length
                kept += 1
            cur_read(&c, length)
        if kept == n:
            return value
        if kept == 0:
            return None
        out = w_init_bytes(&w, live)
        c.pos = 0
        while cur_remaining(&c):
            start = c.pos
            length = cur_u32(&c)
            if <int64_t>cur_u64(&c) > deadline:
                w_bytes(&w, buf + start, FRAME_HEAD + TS_SIZE + length)
            cur_read(&c, length)
        w_finish_bytes(&w)
    finally:
        PyBuffer_Release(&view)
    return out


# ---- formats 1 and 2 ---------------------------------------------------------------------------------------------

cdef int _upgrade_value(uint8_t *p, Py_ssize_t size, int code) except -1:
    """Rewrite one value of format 1 or 2 at ``p`` in place into format 3 (same size)."""
    cdef Cursor c
    cdef Py_ssize_t pos = 0, head, ts_size = TS_SIZE if code & K_TTL else 0
    cdef uint32_t key_len, value_len, entry_len
    cdef uint64_t ts = 0
    cur_init(&c, p, size)
    if code & 3 == K_VALUE:
        if code & K_TTL:
            if size < TS_SIZE:
                cur_corrupt(&c, f"a TTL value of {size} bytes, shorter than its timestamp")
            ts = kg_be64(p)
            memcpy(p, &ts, TS_SIZE)
        return 0
    if code & 3 == K_LIST:
        head = FRAME_HEAD + ts_size
        while pos < size:
            c.pos = pos
            if size - pos < head:
                cur_corrupt(&c, "a truncated list element header")
            value_len = kg_be32(p + pos)
            if ts_size:
                ts = kg_be64(p + pos + FRAME_HEAD)
            if <uint64_t>value_len > <uint64_t>(size - pos - head):
                cur_corrupt(&c, f"a list element of {value_len} bytes past the end of its value")
            memcpy(p + pos, &value_len, FRAME_HEAD)
            if ts_size:
                memcpy(p + pos + FRAME_HEAD, &ts, TS_SIZE)
            pos += head + value_len
        return 0
    # a map: u32 key length | key | u32 value length | [i64 timestamp] | value
    #     -> u32 entry length | [i64 timestamp] | u32 key length | key | value   (the value does not move)
    while pos < size:
        c.pos = pos
        if size - pos < FRAME_HEAD:
            cur_corrupt(&c, "a truncated map key header")
        key_len = kg_be32(p + pos)
        if <uint64_t>key_len + FRAME_HEAD + ts_size + FRAME_HEAD > <uint64_t>(size - pos):
            cur_corrupt(&c, f"a map key of {key_len} bytes and its value header past the end of its value")
        value_len = kg_be32(p + pos + FRAME_HEAD + key_len)
        if ts_size:
            ts = kg_be64(p + pos + 2 * FRAME_HEAD + key_len)
        if <uint64_t>value_len > <uint64_t>(size - pos - 2 * FRAME_HEAD - ts_size - key_len):
            cur_corrupt(&c, f"a map value of {value_len} bytes past the end of its value")
        memmove(p + pos + FRAME_HEAD + ts_size + ENTRY_HEAD, p + pos + FRAME_HEAD, key_len)
        entry_len = ENTRY_HEAD + key_len + value_len   # checked above: inside the value, so < 2^32
        memcpy(p + pos, &entry_len, FRAME_HEAD)
        if ts_size:
            memcpy(p + pos + FRAME_HEAD, &ts, TS_SIZE)
        memcpy(p + pos + FRAME_HEAD + ts_size, &key_len, ENTRY_HEAD)
        pos += FRAME_HEAD + ts_size + ENTRY_HEAD + key_len + value_len
    return 0


cdef int _check_offsets(const int64_t[::1] offsets, Py_ssize_t size, str what) except -1:
    cdef Py_ssize_t i, n = offsets.shape[0]
    if n < 1:
        raise ValueError(f"{what} offsets must hold n + 1 >= 1 positions, got {n}")
    for i in range(n):
        if offsets[i] < 0 or offsets[i] > size or (i and offsets[i] < offsets[i - 1]):
            raise ValueError(f"{what} offset {i} = {offsets[i]}: offsets must ascend inside the {size}-byte buffer")
    return 0


def upgrade_block(object block, list puts, list codes):
    """A block of keyed format 1 or 2 with its values rewritten into format 3's framing: a new bytes object (the
    block is not changed; its CRC is not recomputed), or ``block`` itself when no value needs it. ``puts`` are the
    block's put sections as ``parse_block_offsets`` returns them, ``codes`` the framing code of each state index
    (VALUE, LIST or MAP, plus TTL); a plain value (VALUE without TTL) is the same in every format.
    CorruptSnapshotError if a value's old framing is damaged."""
    cdef object mv = _byte_view(block)
    cdef const uint8_t[::1] src = mv
    cdef Py_ssize_t size = src.shape[0], i, n, state
    cdef const int64_t[::1] vo
    cdef uint8_t *p
    cdef int code
    cdef bytes out = None
    if size == 0:
        return block
    for put in puts:
        state = put[0]
        if not 0 <= state < len(codes):
            raise ValueError(f"state index {state} has no framing code (codes for {len(codes)} states)")
        code = codes[state]
        if code == K_VALUE:
            continue
        if code & ~(3 | K_TTL) or code & 3 == 3:
            raise ValueError(f"framing code {code} is not VALUE, LIST or MAP, plus TTL")
        vo = put[2]
        n = vo.shape[0] - 1
        _check_offsets(vo, size, "value")
        if out is None:
            out = PyBytes_FromStringAndSize(<const char *>&src[0], size)
        p = <uint8_t *>PyBytes_AS_STRING(out)
        for i in range(n):
            _upgrade_value(p + vo[i], <Py_ssize_t>(vo[i + 1] - vo[i]), code)
    return block if out is None else out


# ---- encoding values: Encoder and ValueWriter (declared in framing.pxd) -------------------------------------------

cdef str _KIND_NAMES = "value, list or map"


cdef inline int _patch_u32(Writer *w, Py_ssize_t at, Py_ssize_t length, str what) except -1:
    """Write ``length`` as the u32 at ``w.buf + at`` (room reserved earlier), refused past U32_MAX."""
    cdef uint32_t v
    if length > U32_MAX:
        raise ValueError(f"{what} of {length} is too large to serialize: at most {U32_MAX} (u32) is allowed")
    v = <uint32_t>length
    memcpy(w.buf + at, &v, 4)
    return 0


cdef inline tuple _ttl_pair(object stored):
    """A TTL state's stored ``(value, timestamp)`` as a tuple of two (the error unpacking gives otherwise)."""
    if type(stored) is tuple and PyTuple_GET_SIZE(stored) == 2:
        return <tuple>stored
    value, ts = stored
    return (value, ts)


cdef class Encoder:
    """The encoder of one serializer's values, in C where the serializer is compiled: ``Encoder(serializer,
    check=None)``.

    A built-in serializer (``CodecSerializer``) is encoded by its codec and a ``RecordSerializer`` by its record
    node, exactly as their ``serialize`` (which is that codec's or node's ``encode``); any other serializer, or one
    whose ``serialize`` was overridden, through its ``serialize``. ``check`` is what checks a value on write (the
    serializer's ``check`` when it checks: ``keygroups.serializers.base.checks_on_write``), or None; a record node's
    own check runs in C, its encoder into a buffer on the C stack. :meth:`check_value` runs it."""

    def __init__(self, serializer, check=None):
        fn = serializer.serialize
        owner = getattr(fn, "__self__", None)
        named_encode = getattr(fn, "__name__", None) == "encode"
        self.serializer = serializer
        if named_encode and type(owner) is Codec:
            self.how = HOW_CODEC
            self._target = owner
        elif named_encode and type(owner) is Node:
            self.how = HOW_NODE
            self._target = owner
        else:
            self.how = HOW_PYTHON
            self._target = fn
        self.checks = check is not None
        if (self.how == HOW_NODE and type(getattr(check, "__self__", None)) is Node
                and getattr(check, "__self__", None) is owner and getattr(check, "__name__", None) == "check"):
            self._check = None      # the node's own check: its encoder into a scratch buffer, in C
        else:
            self._check = check

    def __repr__(self):
        return f"Encoder({self.serializer!r}, {('codec', 'record node', 'Python')[self.how]})"

    cdef int write(self, Writer *w, object v) except -1:
        cdef object b
        cdef Py_buffer view
        if self.how == HOW_CODEC:
            return enc_top(<Codec>self._target, w, v)
        if self.how == HOW_NODE:
            return enc_record(<Node>self._target, w, v)
        b = self._target(v)
        if PyBytes_CheckExact(b):
            return w_bytes(w, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))
        if isinstance(b, str) or not PyObject_CheckBuffer(b):
            raise TypeError(f"{self.serializer!r}.serialize returned {type(b).__name__}, not bytes")
        PyObject_GetBuffer(b, &view, PyBUF_SIMPLE)
        try:
            w_bytes(w, view.buf, view.len)
        finally:
            PyBuffer_Release(&view)
        return 0

    cdef int check(self, object v) except -1:
        cdef Writer w
        if not self.checks:
            return 0
        if self._check is not None:
            self._check(v)
            return 0
        w_init(&w)
        try:
            enc_record(<Node>self._target, &w, v)
        finally:
            w_free(&w)
        return 0

    def encode(self, value):
        """``serializer.serialize(value)``, as bytes."""
        cdef Writer w
        w_init(&w)
        try:
            self.write(&w, value)
            return w_result(&w)
        finally:
            w_free(&w)

    def check_value(self, value):
        """What ``serializer.check(value)`` raises for a value it could not write; None otherwise."""
        self.check(value)


cdef class ValueWriter:
    """One state's per-key values in the keyed format-3 framing (see the top of this file and
    ``keygroups.state._codec``), compiled: ``ValueWriter(kind, ttl, value_serializer, key_serializer=None)`` with
    ``kind`` ``"value"`` (value, reducing and aggregating states), ``"list"`` or ``"map"``; ``value_serializer`` the
    serializer of the value, list element or map value, ``key_serializer`` of a map's keys. :meth:`encode` gives the
    bytes ``ValueFraming.encode`` gives, byte for byte; a snapshot encodes every changed value with it in C."""

    def __init__(self, str kind, bint ttl, value_serializer, key_serializer=None):
        if kind == "value":
            self.kind = FK_VALUE
        elif kind == "list":
            self.kind = FK_LIST
        elif kind == "map":
            self.kind = FK_MAP
            if key_serializer is None:
                raise ValueError("a map's value writer needs the map-key serializer")
            self.key = Encoder(key_serializer)
        else:
            raise ValueError(f"kind must be {_KIND_NAMES}, got {kind!r}")
        self.ttl = ttl
        self.value = Encoder(value_serializer)

    def __repr__(self):
        kind = ("value", "list", "map")[self.kind]
        return f"ValueWriter({kind!r}, ttl={bool(self.ttl)}, {self.value!r}" + (
            f", key={self.key!r})" if self.key is not None else ")")

    cdef int write(self, Writer *w, object v) except -1:
        cdef object item
        if self.kind == FK_VALUE:
            if self.ttl:
                pair = _ttl_pair(v)
                w_i64(w, PyLong_AsLongLong(pair[1]))
                return self.value.write(w, pair[0])
            return self.value.write(w, v)
        if self.kind == FK_LIST:
            return self._write_list(w, v, 0, False)
        return self._write_map(w, v, 0, False)

    cdef int write_live(self, Writer *w, object v, int64_t deadline) except -1:
        cdef tuple pair
        cdef int64_t ts
        if self.kind == FK_VALUE:
            pair = _ttl_pair(v)
            ts = PyLong_AsLongLong(pair[1])
            if ts <= deadline:
                return 0
            w_i64(w, ts)
            self.value.write(w, pair[0])
            return 1
        if self.kind == FK_LIST:
            return self._write_list(w, v, deadline, True)
        return self._write_map(w, v, deadline, True)

    cdef int _write_list(self, Writer *w, object v, int64_t deadline, bint drop) except -1:
        """The elements of ``v`` (a list; with TTL of ``(element, timestamp)``), each in its frame; with ``drop``,
        only those whose timestamp is > ``deadline`` (0 returned when none is, and there were some)."""
        cdef Py_ssize_t i, n, at, live = 0
        cdef object element
        cdef tuple pair
        cdef int64_t ts = 0
        cdef bint ttl = self.ttl
        if type(v) is not list and type(v) is not tuple:
            v = list(v)
        n = len(v)
        if drop:
            for i in range(n):
                if PyLong_AsLongLong(_ttl_pair(v[i])[1]) > deadline:
                    live += 1
            if live == 0 and n > 0:
                return 0
        for i in range(n):
            if i >= len(v):
                break
            element = v[i]   # owned while it is encoded (its serializer may run Python code)
            if ttl:
                pair = _ttl_pair(element)
                ts = PyLong_AsLongLong(pair[1])
                if drop and ts <= deadline:
                    continue
                element = pair[0]
            at = w.pos
            w_reserve(w, FRAME_HEAD)
            if ttl:
                w_i64(w, ts)
            self._element(w, element, i, "element")
            _patch_u32(w, at, w.pos - at - _head(ttl), "a list element's length")
        if len(v) != n:
            raise RuntimeError("list changed size during serialization")
        return 1

    cdef int _write_map(self, Writer *w, object v, int64_t deadline, bint drop) except -1:
        """The entries of ``v`` (a dict; with TTL its values are ``(value, timestamp)``) in dict order, each in its
        frame; with ``drop`` only those whose timestamp is > ``deadline`` (0 returned when none is)."""
        cdef Py_ssize_t pos = 0, i = 0, n, at, key_at, live = 0
        cdef PyObject *k
        cdef PyObject *x
        cdef object key, value
        cdef tuple pair
        cdef int64_t ts = 0
        cdef bint ttl = self.ttl
        if type(v) is not dict:
            v = dict(v)
        n = PyDict_Size(v)
        if drop:
            while PyDict_Next(v, &pos, &k, &x):
                if PyLong_AsLongLong(_ttl_pair(<object>x)[1]) > deadline:
                    live += 1
            if live == 0 and n > 0:
                return 0
            pos = 0
        while PyDict_Next(v, &pos, &k, &x):
            key = <object>k     # owned while encoded
            value = <object>x
            if ttl:
                pair = _ttl_pair(value)
                ts = PyLong_AsLongLong(pair[1])
                if drop and ts <= deadline:
                    i += 1
                    continue
                value = pair[0]
            at = w.pos
            w_reserve(w, FRAME_HEAD)
            if ttl:
                w_i64(w, ts)
            key_at = w.pos
            w_reserve(w, ENTRY_HEAD)
            self._map_key(w, key, i)
            _patch_u32(w, key_at, w.pos - key_at - ENTRY_HEAD, "a map key's length")
            self._element(w, value, i, "value")
            _patch_u32(w, at, w.pos - at - _head(ttl), "a map entry's length")
            i += 1
            if PyDict_Size(v) != n:
                raise RuntimeError("dictionary changed size during iteration")
        return 1

    cdef inline int _element(self, Writer *w, object element, Py_ssize_t i, str what) except -1:
        cdef Encoder e = self.value
        if e.how != HOW_PYTHON:
            return e.write(w, element)
        return _python_element(w, e, element, i, what)

    cdef inline int _map_key(self, Writer *w, object key, Py_ssize_t i) except -1:
        cdef Encoder e = self.key
        if e.how != HOW_PYTHON:
            return e.write(w, key)
        return _python_element(w, e, key, i, "key")

    def encode(self, value):
        """The framed bytes of one state value (``ValueFraming.encode``)."""
        cdef Writer w
        w_init(&w)
        try:
            self.write(&w, value)
            return w_result(&w)
        finally:
            w_free(&w)

    def encode_live(self, value, int64_t deadline):
        """The framed bytes of a TTL state's value without what expired at ``deadline`` (timestamps <= it), or None
        when all of it did (``ValueFraming.encode(ValueFraming.drop_expired(value, deadline))``)."""
        cdef Writer w
        if not self.ttl:
            raise ValueError("encode_live is for TTL states")
        w_init(&w)
        try:
            if not self.write_live(&w, value, deadline):
                return None
            return w_result(&w)
        finally:
            w_free(&w)


cdef int _python_element(Writer *w, Encoder e, object element, Py_ssize_t i, str what) except -1:
    """A list element, map key or map value of a Python serializer: its bytes, which must be bytes (as join_list and
    join_map require of serialized parts)."""
    cdef object b = e._target(element)
    if not PyBytes_CheckExact(b):
        raise TypeError(f"{what} {i} must be bytes (serialized), got {type(b).__name__}")
    return w_bytes(w, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))


# ---- decoding values: ValueReader (declared in framing.pxd) -------------------------------------------------------

cdef object _decoder_of(object serializer, int *how):
    """What decodes ``serializer``'s values: its codec or record node when its ``deserialize`` is theirs (a built-in
    serializer, a RecordSerializer, neither overridden), else its ``deserialize`` (``how`` says which)."""
    fn = serializer.deserialize
    owner = getattr(fn, "__self__", None)
    if getattr(fn, "__name__", None) == "decode":
        if type(owner) is Codec:
            how[0] = HOW_CODEC
            return owner
        if type(owner) is Node:
            how[0] = HOW_NODE
            return owner
    how[0] = HOW_PYTHON
    return fn


cdef inline object _dec_part(int how, object target, const uint8_t *p, Py_ssize_t n):
    """One element, map key or map value of ``n`` bytes at ``p``, as its serializer's ``deserialize`` reads it from
    bytes (a Python serializer is given a bytes copy, as ``split_list``/``split_map`` give the reference decoder)."""
    cdef Cursor c
    if how == HOW_CODEC:
        cur_init(&c, p, n)
        return dec_top(<Codec>target, &c)
    if how == HOW_NODE:
        cur_init(&c, p, n)
        return dec_whole(<Node>target, &c)
    return target(_copy(p, n))


# java_keys (statecore.pyx), the one canonicalizer of map keys: imported on first use, as statecore cimports this
# module.
cdef object _java_keys = None


cdef list _canonical(list keys):
    """``keys`` as ``java_keys`` gives them; its call skipped when every key is an int or a str (it would return the
    same list: only float and tuple keys change)."""
    global _java_keys
    cdef Py_ssize_t i
    cdef object k
    cdef type t
    for i in range(PyList_GET_SIZE(keys)):
        k = <object>PyList_GET_ITEM(keys, i)
        t = type(k)
        if t is int or t is str:
            continue
        if PyFloat_Check(k) or PyTuple_Check(k):
            break
    else:
        return keys
    if _java_keys is None:
        from keygroups._native.statecore import java_keys
        _java_keys = java_keys
    return _java_keys(keys)


cdef inline tuple _pair(object value, int64_t ts):
    cdef tuple t = PyTuple_New(2)
    cdef object stamp = PyLong_FromLongLong(ts)
    Py_INCREF(value)
    PyTuple_SET_ITEM(t, 0, value)
    Py_INCREF(stamp)
    PyTuple_SET_ITEM(t, 1, stamp)
    return t


cdef inline const uint8_t *_next_entry(Cursor *c, bint ttl, int64_t *ts, Py_ssize_t *key_len, const uint8_t **value,
                                       Py_ssize_t *value_len) except NULL:
    """The next map entry of ``c`` (checked by _count_frames): its key, with its length, timestamp (TTL), value and
    the value's length; the checks and messages of ``split_map``."""
    cdef Cursor e
    cdef uint32_t length = cur_u32(c)
    cdef const uint8_t *key
    if ttl:
        ts[0] = <int64_t>cur_u64(c)
    if length < ENTRY_HEAD:
        cur_corrupt(c, f"a map entry of {length} bytes, shorter than its key length")
    cur_init(&e, cur_read(c, length), length)
    key = ent_read_key(&e, key_len)
    value[0] = e.buf + e.pos
    value_len[0] = cur_remaining(&e)
    return key


cdef class ValueReader:
    """The compiled twin of :class:`ValueWriter`: ``ValueReader(state, kind, ttl, value_serializer,
    key_serializer=None)`` decodes one state's per-key values from the keyed format-3 framing, in C for the built-in
    serializers and records (their codec or record node, as their ``deserialize``), through ``deserialize`` for any
    other serializer. :meth:`decode` returns what ``ValueFraming.reference_decode`` returns and raises what it raises:
    CorruptSnapshotError naming the state and the value's kind, framing errors before any element's; map keys
    canonical as ``java_keys`` makes them. Every read goes through the checked cursor."""

    def __init__(self, str state, str kind, bint ttl, value_serializer, key_serializer=None):
        if kind == "value":
            self.kind = FK_VALUE
            self.what = "a value"
        elif kind == "list":
            self.kind = FK_LIST
            self.what = "a list value"
        elif kind == "map":
            self.kind = FK_MAP
            self.what = "a map value"
            if key_serializer is None:
                raise ValueError("a map's value reader needs the map-key serializer")
            self._key = _decoder_of(key_serializer, &self.key_how)
        else:
            raise ValueError(f"kind must be {_KIND_NAMES}, got {kind!r}")
        self.state = state
        self.ttl = ttl
        self._value = _decoder_of(value_serializer, &self.value_how)

    def __repr__(self):
        kind = ("value", "list", "map")[self.kind]
        hows = ("codec", "record node", "Python")
        return (f"ValueReader({self.state!r}, {kind!r}, ttl={bool(self.ttl)}, {hows[self.value_how]}"
                + (f", key={hows[self.key_how]})" if self.kind == FK_MAP else ")"))

    cdef object _corrupt(self, object error, str what):
        return CorruptSnapshotError(f"state {self.state!r}: {what}: {error}")

    def decode(self, value):
        """One framed state value -> the value (``ValueFraming.decode``)."""
        cdef Py_buffer view
        if self.kind == FK_VALUE and not self.ttl and self.value_how == HOW_PYTHON:
            try:   # the bytes as given, as the reference gives them
                return self._value(value)
            except CorruptSnapshotError as e:
                raise self._corrupt(e, self.what) from None
        _acquire(value, &view)
        try:
            return self.read(<const uint8_t *>view.buf, view.len, value)
        finally:
            PyBuffer_Release(&view)

    def decode_many(self, block, offsets):
        """The n values packed in ``block`` at ``offsets`` (n + 1 positions), decoded as :meth:`decode` decodes each
        (``ValueFraming.decode_many``); None, for the caller's slicing to decide, when the offsets are not n + 1
        ascending positions inside the block or a plain value's serializer is a Python one."""
        cdef Py_buffer view
        cdef const int64_t[::1] o
        cdef Py_ssize_t n, i
        cdef list out
        if self.kind == FK_VALUE and self.value_how == HOW_PYTHON:
            return None
        try:
            o = np.ascontiguousarray(offsets, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            return None
        if o.ndim != 1 or o.shape[0] < 1:
            return None
        n = o.shape[0] - 1
        _acquire(block, &view)
        try:
            for i in range(n + 1):
                if o[i] < 0 or o[i] > view.len or (i and o[i] < o[i - 1]):
                    return None
            out = PyList_New(n)   # a slot an error leaves NULL is skipped when the list is freed
            for i in range(n):
                _set_item(out, i, self.read(<const uint8_t *>view.buf + o[i], <Py_ssize_t>(o[i + 1] - o[i]), None))
            return out
        finally:
            PyBuffer_Release(&view)

    cdef object read(self, const uint8_t *p, Py_ssize_t n, object owner):
        cdef Cursor c
        cdef int64_t ts
        cdef object v
        if self.kind == FK_VALUE:
            if not self.ttl:
                try:
                    return _dec_part(self.value_how, self._value, p, n)
                except CorruptSnapshotError as e:
                    raise self._corrupt(e, self.what) from None
            if n < TS_SIZE:
                raise CorruptSnapshotError(
                    f"state {self.state!r}: a TTL value needs an 8-byte timestamp, got {n} bytes")
            memcpy(&ts, p, TS_SIZE)
            try:
                if self.value_how == HOW_PYTHON:
                    v = self._value(memoryview(owner)[TS_SIZE:])
                else:
                    v = _dec_part(self.value_how, self._value, p + TS_SIZE, n - TS_SIZE)
            except CorruptSnapshotError as e:
                raise self._corrupt(e, self.what) from None
            return _pair(v, ts)
        cur_init(&c, p, n)
        if self.kind == FK_LIST:
            return self._read_list(&c)
        return self._read_map(&c)

    cdef list _read_list(self, Cursor *c):
        cdef Py_ssize_t n, i
        cdef uint32_t length
        cdef int64_t ts = 0
        cdef bint ttl = self.ttl
        cdef list out
        cdef object v
        try:
            n = _count_frames(c, ttl, "list element")
        except CorruptSnapshotError as e:
            raise self._corrupt(e, self.what) from None
        out = PyList_New(n)   # a slot an error leaves NULL is skipped when the list is freed
        try:
            for i in range(n):   # every frame lies inside the value (checked above)
                length = cur_u32(c)
                if ttl:
                    ts = <int64_t>cur_u64(c)
                v = _dec_part(self.value_how, self._value, cur_read(c, length), length)
                _set_item(out, i, _pair(v, ts) if ttl else v)
        except CorruptSnapshotError as e:
            raise self._corrupt(e, self.what) from None
        return out

    cdef dict _read_map(self, Cursor *c):
        cdef Py_ssize_t n, i = 0, start, key_len, value_len
        cdef int64_t ts = 0
        cdef bint ttl = self.ttl
        cdef const uint8_t *key
        cdef const uint8_t *value
        cdef list keys = None, values = None
        cdef dict out
        cdef object v
        try:
            n = _count_frames(c, ttl, "map entry")
            start = c.pos
            for i in range(n):   # every entry's key checked before any is decoded, as split_map does
                _next_entry(c, ttl, &ts, &key_len, &value, &value_len)
            c.pos = start
        except CorruptSnapshotError as e:
            raise self._corrupt(e, self.what) from None
        keys = PyList_New(n)   # a slot an error leaves NULL is skipped when the list is freed
        values = PyList_New(n)
        try:
            for i in range(n):   # the keys first, then the values, as the reference decodes them
                key = _next_entry(c, ttl, &ts, &key_len, &value, &value_len)
                _set_item(keys, i, _dec_part(self.key_how, self._key, key, key_len))
            c.pos = start
            for i in range(n):
                _next_entry(c, ttl, &ts, &key_len, &value, &value_len)
                v = _dec_part(self.value_how, self._value, value, value_len)
                _set_item(values, i, _pair(v, ts) if ttl else v)
        except CorruptSnapshotError as e:
            raise self._corrupt(e, self.what) from None
        keys = _canonical(keys)
        out = {}
        for i in range(n):
            PyDict_SetItem(out, <object>PyList_GET_ITEM(keys, i), <object>PyList_GET_ITEM(values, i))
        return out

