# cython: auto_pickle=False, autotestdict=False
# Compiled hot paths of the heap keyed state backend: the current key (Java hash -> key group, no Python-level hop
# for int and str keys) and the value / list / map operations on the fast path (no snapshot running, the key's value
# in the key group's dict), with their dirty tracking (every written, deleted or appended key, and every key whose
# mutable value was handed out, goes into its key group's dirty set: the next incremental snapshot writes those).
# Everything else (copy-on-write, lookups in restored layers, TTL) stays in Python: each fast method checks the
# table's `slow` flag and hands over to the table's Python methods. Also here: ``Layer``, a restored block's
# entries of one state kept as bytes, searched by key in C and merged into full blocks at snapshot time without one
# GC-tracked object per entry.
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.set cimport PySet_Add, PySet_Contains
from libc.math cimport signbit
from libc.stdint cimport int32_t, int64_t, uint8_t
from libc.string cimport memcpy

from writer cimport Writer, w_free, w_init

import numpy as _np

from keygroups._javakeys import NAN_KEY as _NAN_KEY_OBJ, NEGATIVE_ZERO_KEY as _NEG_ZERO_OBJ, NegativeZeroKey as _NegZeroClass
from keygroups.errors import KeyGroupOutOfRangeError
from keygroups.errors import no_current_key_error as _no_current_key_error, none_added_error as _none_added_error

from javahash cimport hash_str as _hash_str, kg_hash_long, kg_key_group
from keygroups._native.hashing cimport java_hash_object
from keygroups._native.framing cimport Encoder


cdef class _Missing:
    def __repr__(self):
        return "MISSING"

    def __reduce__(self):
        return "MISSING"


#: What a state store returns for a key without a value (None is a legal value for some serializers).
cdef object _MISSING = _Missing()  # a C global: no module-dict lookup on the hot paths
MISSING = _MISSING


cdef object _NAN_KEY = _NAN_KEY_OBJ
cdef object _NEG_ZERO = _NEG_ZERO_OBJ
cdef type _NegZeroType = _NegZeroClass


cdef inline object _java_float_key(object key):
    """A float key as Java's Double.equals sees it: every NaN is one key, -0.0 is not 0.0."""
    cdef double v = <double>key
    if v != v:
        return _NAN_KEY
    if v == 0.0 and signbit(v) and type(key) is not _NegZeroType:
        return _NEG_ZERO
    return key


cdef object _java_key(object key):
    """``key`` with its float parts canonical (see keygroups._javakeys); the same object when none needs it."""
    cdef type t = type(key)
    cdef Py_ssize_t i, n
    cdef object item, canon
    cdef list items
    if t is float or (isinstance(key, float) and t is not _NegZeroType):
        return _java_float_key(key)
    if isinstance(key, tuple):
        n = len(key)
        items = None
        for i in range(n):
            item = key[i]
            canon = _java_key(item)
            if canon is not item and items is None:
                items = list(key[:i])
            if items is not None:
                items.append(canon)
        if items is not None:
            return tuple(items)
    return key


def java_key(key):
    """``key`` as the backends compare it (Java's equality): float parts canonical, anything else unchanged."""
    return _java_key(key)


def java_keys(list keys):
    """``keys`` with every key as :func:`java_key` gives it: the same list when none changes (int and str keys,
    the common case, cost one type check each), else a new one."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(keys)
    cdef object key, canon
    cdef list out = None
    for i in range(n):
        key = <object>PyList_GET_ITEM(keys, i)
        canon = _java_key(key)
        if canon is not key and out is None:
            out = list(keys)
        if out is not None:
            out[i] = canon
    return keys if out is None else out


cdef object _java_map(object mapping):
    """``mapping`` as a dict whose keys are canonical (:func:`java_key`): the dict itself when none changes. Keys
    that Java sees as one (two NaN objects) become one entry, the later value winning, as a second ``put`` would."""
    cdef object key, canon
    cdef dict out
    if type(mapping) is dict:
        for key in <dict>mapping:
            canon = _java_key(key)
            if canon is not key:
                break
        else:
            return mapping
    out = {}
    for key, value in mapping.items():
        out[_java_key(key)] = value
    return out


def java_map(mapping):
    """``mapping`` (a mapping) as a dict with canonical keys (:func:`java_key`); the dict itself when none changes."""
    return _java_map(mapping)


cdef class KeyContext:
    """The current key of a backend and its key group's index in the backend's range (``n`` when no key is set).
    Attributes: statecore.pxd, the C contract compiled code sets keys through."""

    def __init__(self, key_group_range, int32_t max_parallelism, type_code):
        if max_parallelism < 1:
            raise ValueError(f"max_parallelism must be >= 1, got {max_parallelism}")
        self.start = key_group_range.start
        self.n = len(key_group_range)
        if self.n < 1 or self.start < 0 or self.start + self.n > max_parallelism:
            raise ValueError(f"key_group_range must be a non-empty range inside [0, {max_parallelism - 1}], "
                             f"got {key_group_range!r}")
        self.max_parallelism = max_parallelism
        self._inv = 1.0 / max_parallelism
        self._type_code = type_code
        self._infer = type_code is None
        self._range = key_group_range
        self.key = None
        self.kgi = self.n

    def set_current_key(self, object key):
        """Make ``key`` current; ``KeyGroupOutOfRangeError`` if its key group is not in the backend's range."""
        cdef int32_t h
        cdef int overflow = 0
        cdef long long v
        cdef type t = type(key)
        if self._infer and t is int:
            v = PyLong_AsLongLongAndOverflow(key, &overflow)
            h = java_hash_object(key, None) if overflow else kg_hash_long(v)
        elif self._infer and t is str:
            h = _hash_str(key)
        else:
            h = java_hash_object(key, self._type_code)
            key = _java_key(key)
        cdef int32_t kg = kg_key_group(h, self.max_parallelism, self._inv)
        cdef Py_ssize_t kgi = kg - self.start
        if kgi < 0 or kgi >= self.n:
            raise KeyGroupOutOfRangeError(
                f"key {key!r} belongs to key group {kg}, which is outside this backend's range {self._range!r} "
                f"(max_parallelism={self.max_parallelism}): the records were not partitioned by key group, or the "
                "key's hash is not deterministic")
        self.key = key
        self.kgi = kgi


cdef class TableCore:
    """The part of a heap state table the compiled fast paths read: one dict per key group (plus a final slot for
    'no key'), whether a snapshot holds the dicts (``cow``), which key groups have restored layers that a key missing
    from the dict must be looked up in (``lazy``, per key group), ``slow`` (either), the backend's key context, and
    the dirty tracking: ``track`` (on once incremental snapshots need it) and ``dirty`` (per key group, the keys
    changed since the last snapshot's capture, as a list that may repeat a key; ``_compact_dirty(i)`` removes the
    repeats once the list reaches ``dirty_limit``).

    In a key group with layers, a deleted key stays in the dict with the value ``MISSING`` (a tombstone), so that
    the layers' older value does not come back. (Attributes: statecore.pxd.)"""


cdef inline dict _group(TableCore t, KeyContext c):
    if c.kgi >= c.n or c.kgi >= PyList_GET_SIZE(t.maps):
        raise _no_current_key_error()
    return <dict>PyList_GET_ITEM(t.maps, c.kgi)


cdef inline bint _cow(TableCore t) noexcept:
    """A write needs the Python slow path: a running snapshot may hold the dicts."""
    return t.slow and t.cow


cdef inline bint _layered(TableCore t, KeyContext c) noexcept:
    """The current key group has restored layers: a key missing from its dict may be in them."""
    return (t.slow and c.kgi < c.n and c.kgi < PyList_GET_SIZE(t.lazy)
            and <bint>(<object>PyList_GET_ITEM(t.lazy, c.kgi)))


cdef extern from "Python.h":
    # Borrowed-pointer forms for _mark, the one path every tracked write takes: no reference counting.
    Py_ssize_t _list_size "PyList_GET_SIZE"(PyObject *lst)
    PyObject *_list_item "PyList_GET_ITEM"(PyObject *lst, Py_ssize_t i)
    int _list_append "PyList_Append"(PyObject *lst, PyObject *item) except -1
    bint _is_list "PyList_Check"(PyObject *obj)


cdef inline int _mark(TableCore t, KeyContext c) except -1:
    """The current key goes into the next incremental snapshot (call after ``_group``: the key group is valid).
    Appending to a list is cheaper than adding to a set (no probe, no key comparison); the same key twice in a row
    is appended once, the table de-duplicates a list that grows past ``dirty_limit`` entries, and the snapshot's
    capture de-duplicates the rest."""
    cdef PyObject *dirty = <PyObject *>t.dirty   # borrowed: the table holds them
    cdef PyObject *keys
    cdef Py_ssize_t n
    if t.track and t.dirty is not None and c.kgi < _list_size(dirty):
        keys = _list_item(dirty, c.kgi)
        if not _is_list(keys):
            raise TypeError(f"dirty[{c.kgi}] must be a list")
        n = _list_size(keys)
        if n and _list_item(keys, n - 1) == <PyObject *>c.key:  # the same key again (a read, then its update)
            return 0
        _list_append(keys, <PyObject *>c.key)
        if n + 1 >= t.dirty_limit:
            t._compact_dirty(c.kgi)
    return 0


cdef inline int _remove(TableCore t, KeyContext c, dict m) except -1:
    """Delete the current key's value (a tombstone where restored layers could still hold an older one)."""
    if _layered(t, c):
        m[c.key] = _MISSING
    else:
        m.pop(c.key, None)
    return _mark(t, c)


cdef object _layer_read(TableCore t, KeyContext c, dict m):
    """The current key's value from its key group's layers (newest first), decoded and kept in ``m``, or MISSING:
    what ``_get_slow`` does while no snapshot runs, in C for sorted layers of a state without TTL."""
    cdef Encoder keys = t.layer_keys
    cdef Writer w
    cdef Layer l
    cdef Py_ssize_t found, n
    cdef const uint8_t *p
    cdef object raw = None
    if keys is None:
        return t._get_slow(c.kgi, c.key)
    if c.key in m:   # deleted since the restore: the tombstone shadows the layers
        return _MISSING
    layers = (<object>t).layers[c.kgi]
    if layers is None:
        return _MISSING
    for l in layers:
        if not l.sorted:
            return t._get_slow(c.kgi, c.key)
    w_init(&w)
    try:
        keys.write(&w, c.key)
        for l in layers:
            if l._n_deletes and layer_search(l, True, w.buf, w.pos) >= 0:
                return _MISSING
            if l._n_puts:
                found = layer_search(l, False, w.buf, w.pos)
                if found >= 0:
                    p = layer_value(l, found, &n)
                    raw = PyBytes_FromStringAndSize(<const char *>p, n)
                    break
    finally:
        w_free(&w)
    if raw is None:
        return _MISSING
    v = t.layer_decode(raw)
    m[c.key] = v
    return v


cdef inline object _read(TableCore t, KeyContext c):
    """The current key's stored object or MISSING; decoded values in ``maps`` are read directly unless a snapshot
    needs copy-on-read. A key missing from a layered key group's dict is looked up in its layers."""
    if t.slow and t.cow and c.kgi < c.n:
        return t._get_slow(c.kgi, c.key)
    cdef dict m = _group(t, c)
    v = m.get(c.key, _MISSING)
    if v is _MISSING and _layered(t, c):
        return _layer_read(t, c, m)
    return v


cdef int _refuse(TableCore t, Encoder check, object v, str what) except -1:
    """``check`` refuses ``v``: raise what the table's framing names for the current key (``unwritable``)."""
    try:
        check.check(v)
    except (ValueError, TypeError, OverflowError) as e:   # what a serializer raises for a value it cannot write
        raise (<object>t).write_framing.unwritable(t.ctx.key, e, what=what) from e
    return 0


cdef inline int _check(TableCore t, Encoder check, object v, str what) except -1:
    """A write's check (``TableCore.value_check``/``key_check``): nothing when the serializer checks nothing, the
    serializer's encoder into a scratch buffer otherwise (a record's, in C): what it accepts a snapshot can write."""
    if check is not None:
        _refuse(t, check, v, what)
    return 0


cdef int _check_all(TableCore t, list vals, str what) except -1:
    cdef Encoder check = t.value_check
    if check is not None:
        for v in vals:
            if v is not None:   # the state refuses None itself, naming it
                _refuse(t, check, v, what)
    return 0


# HeapValueCore, HeapListCore and HeapMapCore take (store, descriptor, backend) whether or not they use the backend:
# the heap backend builds every state through one factory signature.
cdef class HeapValueCore:
    cdef TableCore _t
    cdef object _default
    cdef object _copy

    def __init__(self, TableCore store, descriptor, backend):
        self._t = store
        self._default = descriptor.default
        ser = descriptor.serializers["value"]
        self._copy = None if ser.is_immutable else ser.copy

    def value(self):
        cdef TableCore t = self._t
        v = _read(t, t.ctx)
        if v is _MISSING:
            d = self._default
            return d if d is None or self._copy is None else self._copy(d)
        if self._copy is not None:  # a mutable value may be changed in place: it is dirty
            _mark(t, t.ctx)
        return v

    def update(self, value):
        cdef TableCore t = self._t
        cdef KeyContext c = t.ctx
        if value is not None:
            _check(t, t.value_check, value, "update")
        if _cow(t):
            t._prepare_write(c.kgi, c.key)
        cdef dict m = _group(t, c)
        if value is None:
            _remove(t, c, m)
        else:
            m[c.key] = value
            _mark(t, c)

    def clear(self):
        self.update(None)


cdef class HeapListCore:
    cdef TableCore _t
    cdef str _name

    def __init__(self, TableCore store, descriptor, backend):
        self._t = store
        self._name = descriptor.name

    def get(self):
        cdef TableCore t = self._t
        v = _read(t, t.ctx)
        if v is _MISSING:
            return []
        _mark(t, t.ctx)  # the stored list itself is handed out
        return v

    cdef _extend(self, list vals):
        cdef TableCore t = self._t
        cdef KeyContext c = t.ctx
        cdef dict m
        if not _cow(t):
            m = _group(t, c)
            cur = m.get(c.key)
            if cur is None and not _layered(t, c) or cur is _MISSING:
                m[c.key] = vals
                _mark(t, c)
                return
            if cur is not None:
                (<list>cur).extend(vals)
                _mark(t, c)
                return
        t.append(vals)  # a snapshot runs, or the list may be in a restored layer

    def add(self, value):
        if value is None:
            raise _none_added_error(self._name, "ListState")
        cdef TableCore t = self._t
        _check(t, t.value_check, value, "add")
        cdef KeyContext c = t.ctx
        cdef dict m
        if not _cow(t):
            m = _group(t, c)
            cur = m.get(c.key)
            if cur is None and not _layered(t, c) or cur is _MISSING:
                m[c.key] = [value]
                _mark(t, c)
                return
            if cur is not None:
                (<list>cur).append(value)
                _mark(t, c)
                return
        t.append([value])

    def add_all(self, values):
        cdef list vals = list(values)
        _check_all(self._t, vals, "add_all")
        if None in vals:
            raise _none_added_error(self._name, "ListState")
        if vals:
            self._extend(vals)

    def update(self, values):
        cdef list vals = list(values)
        _check_all(self._t, vals, "update")
        if None in vals:
            raise _none_added_error(self._name, "ListState")
        cdef TableCore t = self._t
        cdef KeyContext c = t.ctx
        if _cow(t):
            t._prepare_write(c.kgi, c.key)
        cdef dict m = _group(t, c)
        if vals:
            m[c.key] = vals
            _mark(t, c)
        else:
            _remove(t, c, m)

    def clear(self):
        self.update(())


cdef class HeapMapCore:
    cdef TableCore _t
    cdef bint _mutable_values

    def __init__(self, TableCore store, descriptor, backend):
        self._t = store
        self._mutable_values = not descriptor.serializers["map value"].is_immutable

    cdef object _map(self):
        """The current key's dict (a private one while a snapshot runs) or MISSING. The dict itself never leaves
        this class; its values do (``get``, ``values``, ``items``): ``_values`` marks the key dirty for those."""
        cdef TableCore t = self._t
        return _read(t, t.ctx)

    cdef object _values(self):
        m = self._map()
        if m is not _MISSING and self._mutable_values:
            _mark(self._t, self._t.ctx)
        return m

    cdef _store(self, m):
        cdef TableCore t = self._t
        cdef KeyContext c = t.ctx
        if _cow(t):
            t._prepare_write(c.kgi, c.key)
        cdef dict g = _group(t, c)
        if m:
            g[c.key] = m
            _mark(t, c)
        else:
            _remove(t, c, g)

    def get(self, key):
        key = _java_key(key)
        m = self._values()
        return None if m is _MISSING else (<dict>m).get(key)

    def contains(self, key):
        key = _java_key(key)
        m = self._map()
        return m is not _MISSING and key in <dict>m

    def put(self, key, value):
        cdef TableCore t = self._t
        if t.key_check is not None or t.value_check is not None:
            _check(t, t.key_check, key, "put")
            _check(t, t.value_check, value, "put")
        key = _java_key(key)
        cdef KeyContext c = t.ctx
        cdef dict g
        if not _cow(t):
            g = _group(t, c)
            cur = g.get(c.key)
            if cur is None and not _layered(t, c) or cur is _MISSING:
                g[c.key] = {key: value}
                _mark(t, c)
                return
            if cur is not None:
                (<dict>cur)[key] = value
                _mark(t, c)
                return
        m = self._map()
        if m is _MISSING:
            m = {}
        (<dict>m)[key] = value
        self._store(m)

    def put_all(self, mapping):
        cdef TableCore t = self._t
        if t.key_check is not None or t.value_check is not None:
            for k, v in mapping.items():
                _check(t, t.key_check, k, "put_all")
                _check(t, t.value_check, v, "put_all")
        if not mapping:
            return
        mapping = _java_map(mapping)
        m = self._map()
        m = dict(mapping) if m is _MISSING else m
        if m is not mapping:
            (<dict>m).update(mapping)
        self._store(m)

    def remove(self, key):
        key = _java_key(key)
        m = self._map()
        if m is _MISSING or key not in <dict>m:
            return
        del (<dict>m)[key]
        self._store(m)

    def items(self):
        m = self._values()
        return [] if m is _MISSING else list((<dict>m).items())

    def keys(self):
        m = self._map()
        return [] if m is _MISSING else list(<dict>m)

    def values(self):
        m = self._values()
        return [] if m is _MISSING else list((<dict>m).values())

    def is_empty(self):
        return self._map() is _MISSING

    def clear(self):
        self._store(None)


#: What :meth:`Layer.find` returns for a key the layer does not mention / deletes.
ABSENT = -1
DELETED = -2


cdef class Layer:
    """One restored block's entries of one state in one key group (or those a full snapshot wrote, when a kept
    backend compacts a key group), kept as bytes: ``Layer(block, key_offsets, value_offsets, delete_offsets,
    sorted)`` takes the puts' keys and values and the deleted keys of a block at their offsets (int64 arrays of n + 1
    positions, as the file reader gives them; None when the block has no puts / deletes of this state).

    The layer keeps them in one bytes object of its own (``block``: the keys, then the values, then the deleted
    keys, back to back; with ``copy=False`` the given ``block``, which must then be bytes, is kept as it is), so it
    never pins the buffer of a whole file's read, and a part (keys, values, deleted keys) whose items all have one
    width keeps no offsets at all: a key group of 8-byte keys and values costs 16 bytes per entry. ``key_offsets``,
    ``value_offsets`` and ``delete_offsets`` give the offsets into ``block`` (computed for such a part). A lookup is
    a binary search in C (statecore.pxd's ``layer_search``).

    ``sorted``: keys are in byte order (since format 2), so :meth:`find` locates one key without decoding the
    others. An unsorted (format 1) layer is searched by decoded key instead: the backend decodes its keys once into
    ``index`` (key -> put index) and ``deleted``."""

    def __cinit__(self):
        self._kw = self._vw = self._dw = -2   # no such part (-1: a part with offsets; >= 0: one width)

    def __init__(self, block, key_offsets, value_offsets, delete_offsets, bint sorted, *, bint copy=True):
        cdef const uint8_t[::1] src = _byte_view(block)
        cdef Py_ssize_t size = src.shape[0], total
        cdef const int64_t[::1] ko, vo, do_
        cdef object parts
        if (key_offsets is None) != (value_offsets is None):
            raise ValueError("key_offsets and value_offsets must both be given or both be None")
        if key_offsets is not None:
            ko = _offsets_view(key_offsets, size, "key")
            vo = _offsets_view(value_offsets, size, "value")
            if vo.shape[0] != ko.shape[0]:
                raise ValueError(f"key_offsets ({ko.shape[0]}) and value_offsets ({vo.shape[0]}) must both hold "
                                 "n + 1 >= 1 positions")
            self._n_puts = ko.shape[0] - 1
        if delete_offsets is not None:
            do_ = _offsets_view(delete_offsets, size, "delete")
            self._n_deletes = do_.shape[0] - 1
        self.sorted = sorted
        self.index = None
        self.deleted = None
        if not copy:
            if type(block) is not bytes:
                raise TypeError(f"a layer made without a copy keeps its block, which must be bytes, got "
                                f"{type(block).__name__}")
            self.block = block
            self._base = <const uint8_t *>PyBytes_AS_STRING(block)
            self._size = size
            if key_offsets is not None:
                self._ko = _part(ko, 0, &self._k0, &self._kw)
                self._vo = _part(vo, 0, &self._v0, &self._vw)
            if delete_offsets is not None:
                self._do = _part(do_, 0, &self._d0, &self._dw)
            return
        # one bytes object of the three parts, back to back
        total = 0
        if key_offsets is not None:
            total += (ko[ko.shape[0] - 1] - ko[0]) + (vo[vo.shape[0] - 1] - vo[0])
        if delete_offsets is not None:
            total += do_[do_.shape[0] - 1] - do_[0]
        out = PyBytes_FromStringAndSize(NULL, total)
        cdef uint8_t *dst = <uint8_t *>PyBytes_AS_STRING(out)
        cdef Py_ssize_t at = 0
        if key_offsets is not None:
            at = _copy_part(dst, at, src, ko)
            self._ko = _part(ko, ko[0], &self._k0, &self._kw)
            _rebase(self._ko, &self._k0, self._n_puts, 0)
            self._vo = _part(vo, vo[0], &self._v0, &self._vw)
            _rebase(self._vo, &self._v0, self._n_puts, at)
            at = _copy_part(dst, at, src, vo)
        if delete_offsets is not None:
            self._do = _part(do_, do_[0], &self._d0, &self._dw)
            _rebase(self._do, &self._d0, self._n_deletes, at)
            at = _copy_part(dst, at, src, do_)
        self.block = out
        self._base = <const uint8_t *>PyBytes_AS_STRING(out)
        self._size = total

    def __dealloc__(self):
        PyMem_Free(self._ko)
        PyMem_Free(self._vo)
        PyMem_Free(self._do)

    @property
    def n_puts(self):
        """How many keys the layer puts."""
        return self._n_puts

    @property
    def n_deletes(self):
        """How many keys the layer deletes."""
        return self._n_deletes

    @property
    def key_offsets(self):
        """The n + 1 offsets of the put keys in ``block`` (a new int64 array), or None when the layer puts none."""
        return _offsets_array(self._ko, self._k0, self._kw, self._n_puts) if self._has_puts() else None

    @property
    def value_offsets(self):
        """The n + 1 offsets of the put values in ``block`` (a new int64 array), or None when the layer puts none."""
        return _offsets_array(self._vo, self._v0, self._vw, self._n_puts) if self._has_puts() else None

    @property
    def delete_offsets(self):
        """The n + 1 offsets of the deleted keys in ``block`` (a new int64 array), or None when it deletes none."""
        return _offsets_array(self._do, self._d0, self._dw, self._n_deletes) if self._has_deletes() else None

    @property
    def fixed_width(self):
        """(key width, value width) when every put's key has one width and every value one width (then the layer
        keeps no offsets for them), else None."""
        if self._ko == NULL and self._vo == NULL and self._has_puts():
            return (self._kw, self._vw)
        return None

    cdef bint _has_puts(self):
        return self._ko != NULL or self._kw >= 0

    cdef bint _has_deletes(self):
        return self._do != NULL or self._dw >= 0

    def find(self, bytes key):
        """The put index of the serialized ``key`` in this (sorted) layer, ``DELETED`` if the layer deletes it,
        ``ABSENT`` if it does not mention it."""
        if not self.sorted:
            raise ValueError("find() needs a sorted layer (keyed format 2 or later); search an unsorted one by "
                             "decoded key")
        cdef const uint8_t *kp = <const uint8_t *>PyBytes_AS_STRING(key)
        cdef Py_ssize_t kn = PyBytes_GET_SIZE(key), found
        if self._n_deletes and layer_search(self, True, kp, kn) >= 0:
            return DELETED
        if self._n_puts:
            found = layer_search(self, False, kp, kn)
            if found >= 0:
                return found
        return ABSENT

    def value(self, Py_ssize_t i):
        """Put ``i``'s value bytes (a copy: small, and not tracked by the garbage collector)."""
        cdef Py_ssize_t n
        cdef const uint8_t *p
        if not 0 <= i < self._n_puts:
            raise IndexError(f"put index {i} is outside the layer's {self._n_puts} entries")
        p = layer_value(self, i, &n)
        return PyBytes_FromStringAndSize(<const char *>p, n)

    def collect_puts(self, set shadow, list keys, list values, bint record=True):
        """Append to ``keys`` / ``values`` (as bytes) every put whose key bytes are not in ``shadow``; with
        ``record``, add each appended key to ``shadow`` (so that older layers skip it). Returns how many.

        The slow path of a full snapshot's merge (a migration or TTL on a list or map state; else
        ``heapsnap.full_section`` merges in C): one bytes object per key and value, none the garbage collector
        tracks."""
        cdef Py_ssize_t i, added = 0, kn, vn
        cdef const uint8_t *kp
        cdef const uint8_t *vp
        cdef object kb
        for i in range(self._n_puts):
            kp = layer_key(self, i, &kn)
            kb = PyBytes_FromStringAndSize(<const char *>kp, kn)
            if PySet_Contains(shadow, kb):
                continue
            if record:
                PySet_Add(shadow, kb)
            PyList_Append(keys, kb)
            vp = layer_value(self, i, &vn)
            PyList_Append(values, PyBytes_FromStringAndSize(<const char *>vp, vn))
            added += 1
        return added

    def collect_deletes(self, set into):
        """Add the key bytes of every delete of this layer to ``into``: they shadow the older layers."""
        cdef Py_ssize_t i, n
        cdef const uint8_t *p
        for i in range(self._n_deletes):
            p = layer_deleted(self, i, &n)
            PySet_Add(into, PyBytes_FromStringAndSize(<const char *>p, n))

    def __repr__(self):
        return (f"<Layer {self._n_puts} puts, {self._n_deletes} deletes, {self._size} bytes"
                f"{'' if self.sorted else ', unsorted'}>")


cdef object _byte_view(object buffer):
    cdef object mv = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
    if mv.ndim != 1 or mv.format != "B":
        if not mv.c_contiguous:
            raise TypeError("a layer's block must be a C-contiguous buffer")
        mv = mv.cast("B")
    return mv


cdef const int64_t[::1] _offsets_view(object offsets, Py_ssize_t size, str what):
    cdef const int64_t[::1] o = _np.ascontiguousarray(offsets, dtype=_np.int64)
    cdef Py_ssize_t i, n = o.shape[0]
    if n < 1:
        raise ValueError(f"{what}_offsets must hold n + 1 >= 1 positions")
    for i in range(n):
        if o[i] < 0 or o[i] > size or (i and o[i] < o[i - 1]):
            raise ValueError(f"{what} offset {i} = {o[i]}: offsets must ascend inside the block's {size} bytes")
    return o


cdef int64_t *_part(const int64_t[::1] o, int64_t base, int64_t *start, int64_t *width) except? NULL:
    """A part's offsets as the layer keeps them: NULL with ``start``/``width`` set when every item has one width,
    else a PyMem copy (the caller rebases it). ``width`` is -1 for a part with offsets."""
    cdef Py_ssize_t i, n = o.shape[0] - 1
    cdef int64_t w = o[1] - o[0] if n > 0 else 0
    cdef int64_t *out
    for i in range(1, n):
        if o[i + 1] - o[i] != w:
            break
    else:
        start[0] = o[0] - base
        width[0] = w
        return NULL
    out = <int64_t *>PyMem_Malloc((n + 1) * sizeof(int64_t))
    if out == NULL:
        raise MemoryError(f"cannot keep {n + 1} offsets")
    for i in range(n + 1):
        out[i] = o[i] - base
    width[0] = -1
    start[0] = 0
    return out


cdef void _rebase(int64_t *o, int64_t *start, Py_ssize_t n, int64_t at) noexcept:
    """Move a part (its offsets, or its start) by ``at`` bytes."""
    cdef Py_ssize_t i
    if o == NULL:
        start[0] += at
        return
    for i in range(n + 1):
        o[i] += at


cdef Py_ssize_t _copy_part(uint8_t *dst, Py_ssize_t at, const uint8_t[::1] src, const int64_t[::1] o) noexcept:
    cdef int64_t a = o[0], b = o[o.shape[0] - 1]
    if b > a:
        memcpy(dst + at, &src[a], <size_t>(b - a))
    return at + <Py_ssize_t>(b - a)


cdef object _offsets_array(const int64_t *o, int64_t start, int64_t width, Py_ssize_t n):
    cdef object out = _np.empty(n + 1, dtype=_np.int64)
    cdef int64_t[::1] view = out
    cdef Py_ssize_t i
    for i in range(n + 1):
        view[i] = o[i] if o != NULL else start + i * width
    return out
