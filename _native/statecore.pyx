# cython: auto_pickle=False, autotestdict=False
# Compiled hot paths of the heap keyed state backend: the current key (Java hash -> key group, no Python-level hop
# for int and str keys) and the value / list / map operations on the fast path (no snapshot running, nothing lazily
# restored). Everything else (copy-on-write, lazy restore, TTL) stays in Python: each fast method checks the table's
# `slow` flag and hands over to the table's Python methods.
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.stdint cimport int32_t

from keygroups.errors import KeyGroupOutOfRangeError
from keygroups.errors import no_current_key_error as _no_current_key_error, none_added_error as _none_added_error

from javahash cimport hash_str as _hash_str, kg_hash_long, kg_key_group
from keygroups._native.hashing cimport java_hash_object


cdef class _Missing:
    def __repr__(self):
        return "MISSING"

    def __reduce__(self):
        return "MISSING"


#: What a state store returns for a key without a value (None is a legal value for some serializers).
MISSING = _Missing()


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
    'no key'), whether a snapshot holds the dicts (``cow``), which key groups still hold restored entries that are
    not decoded (``lazy``, per key group), ``slow`` (either), and the backend's key context."""

    cdef public list maps
    cdef public bint slow
    cdef public bint cow
    cdef public list lazy
    cdef public KeyContext ctx


cdef inline dict _group(TableCore t, KeyContext c):
    if c.kgi >= c.n or c.kgi >= PyList_GET_SIZE(t.maps):
        raise _no_current_key_error()
    return <dict>PyList_GET_ITEM(t.maps, c.kgi)


cdef inline bint _must_prepare(TableCore t, KeyContext c):
    """A write needs the Python slow path: a snapshot holds the dicts, or this key group is still being restored."""
    if not t.slow:
        return False
    if t.cow:
        return True
    return c.kgi < c.n and c.kgi < PyList_GET_SIZE(t.lazy) and <bint>(<object>PyList_GET_ITEM(t.lazy, c.kgi))


cdef inline object _read(TableCore t, KeyContext c):
    """The current key's stored object or MISSING; decoded values in ``maps`` are read directly unless a snapshot
    needs copy-on-read."""
    if t.slow and t.cow and c.kgi < c.n:
        return t._get_slow(c.kgi, c.key)
    v = _group(t, c).get(c.key, MISSING)
    if v is MISSING and t.slow and _must_prepare(t, c):
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
        if v is MISSING:
            d = self._default
            return d if d is None or self._copy is None else self._copy(d)
        return v

    def update(self, value):
        cdef TableCore t = self._t
        cdef KeyContext c = t.ctx
        if _must_prepare(t, c):
            t._prepare_write(c.kgi, c.key)
        cdef dict m = _group(t, c)
        if value is None:
            m.pop(c.key, None)
        else:
            m[c.key] = value

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
        return [] if v is MISSING else v

    cdef _extend(self, list vals):
        cdef TableCore t = self._t
        cdef KeyContext c = t.ctx
        if _must_prepare(t, c):
            t.append(vals)
            return
        cdef dict m = _group(t, c)
        cur = m.get(c.key)
        if cur is None:
            m[c.key] = vals
        else:
            (<list>cur).extend(vals)

    def add(self, value):
        if value is None:
            raise _none_added_error(self._name, "ListState")
        cdef TableCore t = self._t
        cdef KeyContext c = t.ctx
        if _must_prepare(t, c):
            self._extend([value])
            return
        cdef dict m = _group(t, c)
        cur = m.get(c.key)
        if cur is None:
            m[c.key] = [value]
        else:
            (<list>cur).append(value)

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
        if _must_prepare(t, c):
            t._prepare_write(c.kgi, c.key)
        cdef dict m = _group(t, c)
        if vals:
            m[c.key] = vals
        else:
            m.pop(c.key, None)

    def clear(self):
        self.update(())


cdef class HeapMapCore:
    cdef TableCore _t

    def __init__(self, TableCore store, descriptor, backend):
        self._t = store

    cdef object _map(self):
        """The current key's dict (a private one while a snapshot runs) or MISSING."""
        cdef TableCore t = self._t
        return _read(t, t.ctx)

    cdef _store(self, m):
        cdef TableCore t = self._t
        cdef KeyContext c = t.ctx
        if _must_prepare(t, c):
            t._prepare_write(c.kgi, c.key)
        cdef dict g = _group(t, c)
        if m:
            g[c.key] = m
        else:
            g.pop(c.key, None)

    def get(self, key):
        m = self._map()
        return None if m is MISSING else (<dict>m).get(key)

    def contains(self, key):
        m = self._map()
        return m is not MISSING and key in <dict>m

    def put(self, key, value):
        cdef TableCore t = self._t
        cdef KeyContext c = t.ctx
        cdef dict g
        if not _must_prepare(t, c):
            g = _group(t, c)
            cur = g.get(c.key)
            if cur is None:
                g[c.key] = {key: value}
            else:
                (<dict>cur)[key] = value
            return
        m = self._map()
        if m is MISSING:
            m = {}
        (<dict>m)[key] = value
        self._store(m)

    def put_all(self, mapping):
        if not mapping:
            return
        m = self._map()
        m = dict(mapping) if m is MISSING else m
        if m is not mapping:
            (<dict>m).update(mapping)
        self._store(m)

    def remove(self, key):
        m = self._map()
        if m is MISSING or key not in <dict>m:
            return
        del (<dict>m)[key]
        self._store(m)

    def items(self):
        m = self._map()
        return [] if m is MISSING else list((<dict>m).items())

    def keys(self):
        m = self._map()
        return [] if m is MISSING else list(<dict>m)

    def values(self):
        m = self._map()
        return [] if m is MISSING else list((<dict>m).values())

    def is_empty(self):
        return self._map() is MISSING

    def clear(self):
        self._store(None)
