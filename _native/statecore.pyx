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
from cpython.object cimport PyObject
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.set cimport PySet_Add, PySet_Contains
from libc.math cimport signbit
from libc.stdint cimport int32_t, int64_t, uint8_t

from keygroups._javakeys import NAN_KEY as _NAN_KEY_OBJ, NEGATIVE_ZERO_KEY as _NEG_ZERO_OBJ, NegativeZeroKey as _NegZeroClass
from keygroups.errors import KeyGroupOutOfRangeError
from keygroups.errors import no_current_key_error as _no_current_key_error, none_added_error as _none_added_error

from javahash cimport hash_str as _hash_str, kg_hash_long, kg_key_group
from keysearch cimport kg_find_key
from keygroups._native.hashing cimport java_hash_object


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
    """The current key of a backend and its key group's index in the backend's range (``n`` when no key is set)."""

    cdef readonly object key
    cdef readonly Py_ssize_t kgi
    cdef readonly int32_t start
    cdef readonly Py_ssize_t n
    cdef readonly int32_t max_parallelism
    cdef double _inv
    cdef object _type_code
    cdef bint _infer
    cdef object _range

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
    the layers' older value does not come back."""

    cdef public list maps
    cdef public bint slow
    cdef public bint cow
    cdef public list lazy
    cdef public KeyContext ctx
    cdef public bint track
    cdef public list dirty
    cdef public Py_ssize_t dirty_limit


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


cdef inline object _read(TableCore t, KeyContext c):
    """The current key's stored object or MISSING; decoded values in ``maps`` are read directly unless a snapshot
    needs copy-on-read. A key missing from a layered key group's dict is looked up in its layers (slow path)."""
    if t.slow and t.cow and c.kgi < c.n:
        return t._get_slow(c.kgi, c.key)
    v = _group(t, c).get(c.key, _MISSING)
    if v is _MISSING and _layered(t, c):
        return t._get_slow(c.kgi, c.key)
    return v


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
        if None in vals:
            raise _none_added_error(self._name, "ListState")
        if vals:
            self._extend(vals)

    def update(self, values):
        cdef list vals = list(values)
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
        key = _java_key(key)
        cdef TableCore t = self._t
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
    """One restored block's entries of one state in one key group, kept as the file's bytes: put ``i``'s key is
    ``block[key_offsets[i]:key_offsets[i + 1]]`` and its value likewise with ``value_offsets``; a deleted key
    likewise with ``delete_offsets`` (int64 arrays of n + 1 positions; None when the block has no puts / deletes of
    this state). The buffers are acquired once, here: a lookup is a binary search in C.

    ``sorted``: keys are in byte order (since format 2), so :meth:`find` locates one key without decoding the others. An
    unsorted (format 1) layer is searched by decoded key instead: the backend decodes its keys once into ``index``
    (key -> put index) and ``deleted``."""

    cdef readonly object block
    cdef readonly object key_offsets
    cdef readonly object value_offsets
    cdef readonly object delete_offsets
    cdef readonly bint sorted
    cdef public object index
    cdef public object deleted
    cdef const uint8_t[::1] _buf
    cdef const int64_t[::1] _ko
    cdef const int64_t[::1] _vo
    cdef const int64_t[::1] _do
    cdef Py_ssize_t _size, _n_puts, _n_deletes

    def __init__(self, block, key_offsets, value_offsets, delete_offsets, bint sorted):
        self._buf = block
        self._size = self._buf.shape[0]
        self._n_puts = self._n_deletes = 0
        if (key_offsets is None) != (value_offsets is None):
            raise ValueError("key_offsets and value_offsets must both be given or both be None")
        if key_offsets is not None:
            self._ko = key_offsets
            self._vo = value_offsets
            if self._ko.shape[0] < 1 or self._vo.shape[0] != self._ko.shape[0]:
                raise ValueError(f"key_offsets ({self._ko.shape[0]}) and value_offsets ({self._vo.shape[0]}) must "
                                 "both hold n + 1 >= 1 positions")
            _check_offsets(self._ko, self._size, "key")
            _check_offsets(self._vo, self._size, "value")
            self._n_puts = self._ko.shape[0] - 1
        if delete_offsets is not None:
            self._do = delete_offsets
            if self._do.shape[0] < 1:
                raise ValueError("delete_offsets must hold n + 1 >= 1 positions")
            _check_offsets(self._do, self._size, "delete")
            self._n_deletes = self._do.shape[0] - 1
        self.block = block
        self.key_offsets = key_offsets
        self.value_offsets = value_offsets
        self.delete_offsets = delete_offsets
        self.sorted = sorted
        self.index = None
        self.deleted = None

    cdef inline const uint8_t *_base(self):
        return &self._buf[0] if self._size else NULL

    def find(self, bytes key):
        """The put index of the serialized ``key`` in this (sorted) layer, ``DELETED`` if the layer deletes it,
        ``ABSENT`` if it does not mention it."""
        if not self.sorted:
            raise ValueError("find() needs a sorted layer (keyed format 2 or later); search an unsorted one by "
                             "decoded key")
        cdef const uint8_t *kp = <const uint8_t *>PyBytes_AS_STRING(key)
        cdef Py_ssize_t kn = PyBytes_GET_SIZE(key), found
        if self._n_deletes:
            found = kg_find_key(self._base(), self._size, &self._do[0], self._n_deletes, kp, kn)
            if found >= 0:
                return DELETED
        if self._n_puts:  # offsets were checked in __init__: the search never reports them bad (-2)
            found = kg_find_key(self._base(), self._size, &self._ko[0], self._n_puts, kp, kn)
            if found >= 0:
                return found
        return ABSENT

    def value(self, Py_ssize_t i):
        """Put ``i``'s value bytes (a copy: small, and not tracked by the garbage collector)."""
        if not 0 <= i < self._n_puts:
            raise IndexError(f"put index {i} is outside the layer's {self._n_puts} entries")
        return PyBytes_FromStringAndSize(<const char *>self._base() + self._vo[i], self._vo[i + 1] - self._vo[i])

    def collect_puts(self, set shadow, list keys, list values, bint record=True):
        """Append to ``keys`` / ``values`` (as bytes) every put whose key bytes are not in ``shadow``; with
        ``record``, add each appended key to ``shadow`` (so that older layers skip it). Returns how many.

        A full block merged from restored layers is written this way: one bytes object per key and value and
        nothing the garbage collector tracks, so a collection during the snapshot has nothing of the state to
        scan."""
        cdef const char *base = <const char *>self._base()
        cdef Py_ssize_t i, added = 0
        cdef object kb
        for i in range(self._n_puts):
            kb = PyBytes_FromStringAndSize(base + self._ko[i], self._ko[i + 1] - self._ko[i])
            if PySet_Contains(shadow, kb):
                continue
            if record:
                PySet_Add(shadow, kb)
            PyList_Append(keys, kb)
            PyList_Append(values, PyBytes_FromStringAndSize(base + self._vo[i], self._vo[i + 1] - self._vo[i]))
            added += 1
        return added

    def collect_deletes(self, set into):
        """Add the key bytes of every delete of this layer to ``into``: they shadow the older layers."""
        cdef const char *base = <const char *>self._base()
        cdef Py_ssize_t i
        for i in range(self._n_deletes):
            PySet_Add(into, PyBytes_FromStringAndSize(base + self._do[i], self._do[i + 1] - self._do[i]))


cdef int _check_offsets(const int64_t[::1] offsets, Py_ssize_t size, str what) except -1:
    cdef Py_ssize_t i, n = offsets.shape[0]
    for i in range(n):
        if offsets[i] < 0 or offsets[i] > size or (i and offsets[i] < offsets[i - 1]):
            raise ValueError(f"{what} offset {i} = {offsets[i]}: offsets must ascend inside the block's {size} bytes")
    return 0
