# cython: auto_pickle=False, autotestdict=False
# Compiled hot paths of the RocksDB keyed state backend (keygroups.state.rocksdb): a value state's value(), update()
# and clear() on the table's per-batch cache of decoded values, with the current key and its key group read from the
# backend's KeyContext in C. A key not in the cache is loaded by the table (Python: a database read); everything
# else (TTL, maps, lists, the flush to the database) stays in rocksdb.py. Also the bulk forms the declarative
# aggregates use (values of many keys, writes of many keys): one C loop over the batch's keys instead of a Python
# call per key; and the flush of a value table's pending keys (database keys built, sorted and values encoded in C),
# whose rows a large flush writes into one SST file in key order (write_sorted_rows).
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem, PyDict_Next, PyDict_SetItem
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject, PyObject_DelItem, PyObject_SetItem
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

from javahash cimport hash_str as _hash_str, kg_hash_long, kg_key_group
from keysearch cimport kg_key_cmp
from indexsort cimport kg_stable_sort
from writer cimport Writer, w_bytes, w_free, w_init, w_reserve

from keygroups._native.framing cimport Encoder, ValueWriter
from keygroups._native.hashing cimport java_hash_object
from keygroups._native.statecore cimport KeyContext

import numpy as _np

from keygroups._native.statecore import MISSING as _MISSING_OBJ
from keygroups.errors import no_current_key_error as _no_current_key_error

cdef extern from *:
    uint64_t _bswap64 "__builtin_bswap64" (uint64_t) nogil

cdef object _MISSING = _MISSING_OBJ   # a C global: no module-dict lookup on the hot paths


cdef class RocksValueCore:
    """A value state without TTL on a RocksDB table's cache (``_RocksTable``: ``cache`` key -> decoded value or
    MISSING, ``pending`` key -> key-group index of the keys to write at the next flush, ``load()`` for a key the
    cache does not hold). A mutable value handed out is pending too: changed in place, it is written back."""

    cdef object _t
    cdef KeyContext _ctx
    cdef dict _cache
    cdef dict _pending
    cdef object _default
    cdef object _copy
    cdef bint _mutable

    def __init__(self, store, descriptor, backend):
        self._t = store
        self._ctx = store.ctx
        self._cache = store.cache
        self._pending = store.pending
        self._default = descriptor.default
        ser = descriptor.serializers["value"]
        self._copy = None if ser.is_immutable else ser.copy
        self._mutable = store.mutable

    cdef inline object _default_value(self):
        d = self._default
        return d if d is None or self._copy is None else self._copy(d)

    def value(self):
        cdef KeyContext c = self._ctx
        cdef PyObject *found = PyDict_GetItem(self._cache, c.key) if c.kgi < c.n else NULL
        if found == NULL:
            v = self._t.load()   # raises for no current key
        else:
            v = <object>found
            if self._mutable and v is not _MISSING:
                self._pending[c.key] = c.kgi
        if v is _MISSING:
            return self._default_value()
        return v

    def update(self, value):
        cdef KeyContext c = self._ctx
        if c.kgi >= c.n:
            raise _no_current_key_error()
        PyDict_SetItem(self._cache, c.key, _MISSING if value is None else value)
        PyDict_SetItem(self._pending, c.key, c.kgi)

    def clear(self):
        self.update(None)


def cached_values(dict cache, dict pending, list keys, list group_indexes, bint mutable, object default,
                  object copy):
    """The cached values of ``keys`` (each must be in ``cache``), as ``value()`` reads them one key at a time: the
    default (``copy(default)`` when ``copy`` is not None) where the cache holds MISSING; with ``mutable``, each key
    with a value goes into ``pending`` with its key-group index (``group_indexes[i]``)."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(keys)
    cdef PyObject *found
    if PyList_GET_SIZE(group_indexes) != n:
        raise ValueError(f"cached_values: {n} keys but {PyList_GET_SIZE(group_indexes)} key-group indexes")
    out = [None] * n
    for i in range(n):
        key = <object>PyList_GET_ITEM(keys, i)
        found = PyDict_GetItem(cache, key)
        if found == NULL:
            raise KeyError(key)
        v = <object>found
        if v is _MISSING:
            v = default if default is None or copy is None else copy(default)
        elif mutable:
            PyDict_SetItem(pending, key, <object>PyList_GET_ITEM(group_indexes, i))
        out[i] = v
    return out


def cache_writes(dict cache, dict pending, list keys, list group_indexes, list values):
    """Set each of ``keys`` to the matching value in ``cache`` (None: MISSING, a delete) and mark it pending with its
    key-group index, as ``update()`` does one key at a time (later keys win when a key repeats)."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(keys)
    if PyList_GET_SIZE(group_indexes) != n or PyList_GET_SIZE(values) != n:
        raise ValueError(f"cache_writes: {n} keys, {PyList_GET_SIZE(group_indexes)} key-group indexes and "
                         f"{PyList_GET_SIZE(values)} values")
    for i in range(n):
        key = <object>PyList_GET_ITEM(keys, i)
        v = <object>PyList_GET_ITEM(values, i)
        PyDict_SetItem(cache, key, _MISSING if v is None else v)
        PyDict_SetItem(pending, key, <object>PyList_GET_ITEM(group_indexes, i))


def uncached(dict cache, list keys):
    """The positions in ``keys`` of the keys ``cache`` does not hold, ascending."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(keys)
    out = []
    for i in range(n):
        if PyDict_GetItem(cache, <object>PyList_GET_ITEM(keys, i)) == NULL:
            out.append(i)
    return out


ctypedef struct _Row:
    uint64_t h0          # the database key's bytes 0-7 and 8-15 as big-endian integers (zero past its end): most
    uint64_t h1          # comparisons end on them, without a call to memcmp
    const uint8_t *key   # the database key's bytes (in the flush's key arena)
    Py_ssize_t n
    Py_ssize_t off       # where they start in the arena (the pointer is set once the arena stops growing)
    Py_ssize_t voff      # the stored value's bytes in the value arena: offset and length; -1: a delete
    Py_ssize_t vn
    Py_ssize_t i         # its position in the pending dict's order
    Py_ssize_t group     # its key-group index


cdef int _row_cmp(const void *a, const void *b) noexcept nogil:
    """Bytewise order of two database keys, as RocksDB's default comparator orders them. Two keys whose first 16
    bytes differ are ordered by them (a shorter key's missing bytes read as 0: where it is a prefix of the other, the
    other's bytes there are >= 0, and a tie falls through to the full comparison, which puts the prefix first)."""
    cdef const _Row *x = <const _Row *>a
    cdef const _Row *y = <const _Row *>b
    if x.h0 != y.h0:
        return -1 if x.h0 < y.h0 else 1
    if x.h1 != y.h1:
        return -1 if x.h1 < y.h1 else 1
    return kg_key_cmp(x.key, x.n, y.key, y.n)


cdef inline uint64_t _be64(const uint8_t *p, Py_ssize_t n) noexcept nogil:
    """Up to 8 bytes at ``p`` (``n`` of them, n <= 0: none) as a big-endian integer, zero-padded on the right."""
    cdef uint64_t v = 0
    cdef Py_ssize_t i
    if n >= 8:
        memcpy(&v, p, 8)
        return _bswap64(v)   # little-endian hosts only, as writer.pxd writes
    for i in range(8):
        v = (v << 8) | (p[i] if i < n else 0)
    return v


cdef int _row_at(const void *items, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    """``_row_cmp`` of rows ``a`` and ``b`` of the array ``items``, for ``kg_stable_sort``."""
    return _row_cmp(&(<const _Row *>items)[a], &(<const _Row *>items)[b])


cdef int _sort_rows(_Row *rows, Py_ssize_t n, Py_ssize_t groups) except -1:
    """Order ``rows`` by database key. Their positions are counted into key groups (the database key starts with
    the key group, ascending with its index: a stable counting sort in two linear passes), each key group's sorted
    apart (a few hundred at a time in the CPU's caches, fewer compares than one sort of them all), positions only
    (8 bytes moved per step, not a row); then the rows are moved once into that order."""
    cdef Py_ssize_t *at = <Py_ssize_t *>PyMem_Malloc((groups + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *idx = <Py_ssize_t *>PyMem_Malloc((n if n else 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *tmp = <Py_ssize_t *>PyMem_Malloc((n if n else 1) * sizeof(Py_ssize_t))
    cdef _Row *moved = <_Row *>PyMem_Malloc((n if n else 1) * sizeof(_Row))
    cdef Py_ssize_t i, g, total = 0, c, lo
    if at == NULL or idx == NULL or tmp == NULL or moved == NULL:
        PyMem_Free(at)
        PyMem_Free(idx)
        PyMem_Free(tmp)
        PyMem_Free(moved)
        raise MemoryError()
    for g in range(groups + 1):
        at[g] = 0
    for i in range(n):
        at[rows[i].group] += 1
    for g in range(groups):
        c = at[g]
        at[g] = total
        total += c
    at[groups] = total
    for i in range(n):
        idx[at[rows[i].group]] = i
        at[rows[i].group] += 1
    # at[g] is now where key group g ends (and g + 1 starts)
    lo = 0
    for g in range(groups):
        if at[g] - lo > 1:
            kg_stable_sort(idx + lo, tmp, at[g] - lo, _row_at, rows)
        lo = at[g]
    for i in range(n):
        moved[i] = rows[idx[i]]
    memcpy(rows, moved, n * sizeof(_Row))
    PyMem_Free(at)
    PyMem_Free(idx)
    PyMem_Free(tmp)
    PyMem_Free(moved)
    return 0


cdef Py_ssize_t _encode_pending(dict pending, dict cache, Encoder keys, ValueWriter values, list group_prefixes,
                                bytes state_id, Writer *kw, Writer *vw, _Row *rows, list user_keys,
                                dict skip=None, Py_ssize_t *encoded=NULL) except -1:
    """Encode each pending key's database key into ``kw`` and its cached value (unless MISSING: a delete) into
    ``vw``, one ``rows`` entry per key (``len(pending)`` of them), then sort the rows in database-key order;
    ``user_keys[i]`` receives the i-th pending key. Returns how many are deletes. ``skip``: the keys of ``pending``
    also in it are left out (``encoded`` receives how many rows were made)."""
    cdef Py_ssize_t n = len(pending), pos = 0, count = 0, gones = 0, i, gi, klen
    cdef Py_ssize_t groups = PyList_GET_SIZE(group_prefixes)
    cdef PyObject *pkey
    cdef PyObject *pgi
    cdef PyObject *found
    cdef uint8_t *lp
    cdef uint32_t be
    cdef bint ascending = True
    cdef _Row *r
    if len(state_id) != 2:
        raise ValueError(f"flush_values: a state id is 2 bytes, got {len(state_id)}")
    while PyDict_Next(pending, &pos, &pkey, &pgi):
        if count >= n:
            raise RuntimeError("flush_values: the pending keys changed during the flush")
        if skip is not None and PyDict_GetItem(skip, <object>pkey) != NULL:
            continue
        key = <object>pkey   # strong references: a serializer in Python may run below
        group_index = <object>pgi
        gi = <Py_ssize_t>group_index
        if gi < 0 or gi >= groups:
            raise IndexError(f"flush_values: key-group index {gi} outside the backend's {groups} key groups")
        prefix = <object>PyList_GET_ITEM(group_prefixes, gi)
        if type(prefix) is not bytes or PyBytes_GET_SIZE(prefix) != 2:
            raise ValueError("flush_values: a key group's prefix is 2 bytes")
        r = &rows[count]
        r.off = kw.pos
        w_bytes(kw, PyBytes_AS_STRING(prefix), 2)
        w_bytes(kw, PyBytes_AS_STRING(state_id), 2)
        w_reserve(kw, 4)
        keys.write(kw, key)
        klen = kw.pos - r.off - 8
        if klen > 0xFFFFFFFF:
            raise ValueError(f"a key of {klen} bytes is too long for a database key")
        be = <uint32_t>klen
        lp = kw.buf + r.off + 4
        lp[0] = <uint8_t>(be >> 24)
        lp[1] = <uint8_t>(be >> 16)
        lp[2] = <uint8_t>(be >> 8)
        lp[3] = <uint8_t>be
        r.n = kw.pos - r.off
        r.h0 = _be64(kw.buf + r.off, r.n)
        r.h1 = _be64(kw.buf + r.off + 8, r.n - 8)
        r.i = count
        r.group = gi
        user_keys[count] = key
        found = PyDict_GetItem(cache, key)
        if found == NULL:
            raise KeyError(key)
        value = <object>found
        if value is _MISSING:
            r.voff = -1
            r.vn = 0
            gones += 1
        else:
            r.voff = vw.pos
            values.write(vw, value)
            r.vn = vw.pos - r.voff
        count += 1
    if (count != n and skip is None) or len(pending) != n:
        raise RuntimeError("flush_values: the pending keys changed during the flush")
    n = count
    if encoded != NULL:
        encoded[0] = n
    for i in range(n):   # the arena stopped growing: its rows' addresses hold from here
        rows[i].key = kw.buf + rows[i].off
    for i in range(1, n):
        if _row_cmp(&rows[i - 1], &rows[i]) > 0:
            ascending = False
            break
    if not ascending:
        _sort_rows(rows, n, groups)
    return gones


def flush_values(dict pending, dict cache, Encoder keys, ValueWriter values, list group_prefixes, bytes state_id,
                 dict skip=None):
    """The database writes of a value, list, reducing or aggregating table's pending keys, in one pass: each
    pending key (``pending``: key -> key-group index) gets its database key ``group_prefixes[index] | state_id |
    u32 BE length | key bytes`` (``keys`` writes the key's bytes, as the key serializer's ``serialize``) and, unless
    ``cache`` holds MISSING for it (a delete), its stored value (``values``: ``ValueFraming.encode``'s bytes).
    Returns ``(put database keys, put values, deleted database keys, the pending keys, put positions, deleted
    positions)``: the first three in ascending database-key order, the pending keys in the pending dict's order,
    and the positions (int64 arrays) of the put and the deleted keys among them, in the same ascending order. A
    value the serializer cannot write raises its error (nothing returned). ``skip`` (a dict): the pending keys it
    holds are left out (write-back's unwritten keys that a pending write covers), as if not pending.

    The keys and values are encoded in the pending order into two arenas, their rows sorted there, and the bytes
    objects made in sorted order at the end: each object is made as it is handed out, and no key object is touched
    again in sorted order (positions instead: at a batch's size those reads miss the CPU's caches)."""
    cdef Py_ssize_t n = len(pending), puts = 0, gones, i
    cdef Writer kw
    cdef Writer vw
    cdef _Row *rows
    cdef _Row *r
    cdef int64_t[::1] put_at
    cdef int64_t[::1] gone_at
    user_keys = [None] * n
    rows = <_Row *>PyMem_Malloc((n if n else 1) * sizeof(_Row))
    if rows == NULL:
        raise MemoryError()
    w_init(&kw)
    w_init(&vw)
    try:
        gones = _encode_pending(pending, cache, keys, values, group_prefixes, state_id, &kw, &vw, rows, user_keys,
                                skip, &n)
        if n < PyList_GET_SIZE(user_keys):
            del user_keys[n:]
        put_db_keys, put_values = [None] * (n - gones), [None] * (n - gones)
        gone_db_keys = [None] * gones
        put_positions = _np.empty(n - gones, dtype=_np.int64)
        gone_positions = _np.empty(gones, dtype=_np.int64)
        put_at = put_positions
        gone_at = gone_positions
        gones = 0
        for i in range(n):
            r = &rows[i]
            db_key = PyBytes_FromStringAndSize(<const char *>r.key, r.n)
            if r.voff < 0:
                gone_db_keys[gones] = db_key
                gone_at[gones] = r.i
                gones += 1
            else:
                put_db_keys[puts] = db_key
                put_values[puts] = PyBytes_FromStringAndSize(<const char *>vw.buf + r.voff, r.vn)
                put_at[puts] = r.i
                puts += 1
    finally:
        w_free(&kw)
        w_free(&vw)
        PyMem_Free(rows)
    return put_db_keys, put_values, gone_db_keys, user_keys, put_positions, gone_positions


cdef object _section(Writer *data, Writer *offsets):
    """(bytes, int64 offsets) of one section's keys or values, as ``Packed`` takes them."""
    return (PyBytes_FromStringAndSize(<const char *>data.buf, data.pos),
            _np.frombuffer(PyBytes_FromStringAndSize(<const char *>offsets.buf, offsets.pos), dtype=_np.int64))


def delta_values(dict pending, dict cache, Encoder keys, ValueWriter values, list group_prefixes, bytes state_id,
                 int start, object full, bint ttl, object deadline):
    """The pending keys' changes (as ``flush_values`` encodes them) as one state's delta sections per key group,
    with no database key or value made a bytes object: what ``sstload.delta_sections`` cuts from ``flush_values``'
    rows, for a snapshot that does not write the database (write-back). ``start``: the absolute key group of index 0;
    key groups in ``full`` (a container) are left out; with a TTL ``deadline``, a put whose timestamp is at or
    before it becomes a delete. Returns ``[(key group, puts, deletes), ...]`` ascending, ``puts`` None or ``((key
    bytes, offsets), (value bytes, offsets))``, ``deletes`` None or ``(key bytes, offsets)``."""
    cdef Py_ssize_t n = len(pending), i = 0, j
    cdef Writer kw
    cdef Writer vw
    cdef Writer bufs[6]   # put keys, put key offsets, put values, value offsets, deleted keys, deleted offsets
    cdef _Row *rows
    cdef _Row *r
    cdef int64_t pos, ts, cutoff = 0
    cdef bint has_deadline = ttl and deadline is not None
    cdef Py_ssize_t group
    cdef int b
    if has_deadline:
        cutoff = deadline
    rows = <_Row *>PyMem_Malloc((n if n else 1) * sizeof(_Row))
    if rows == NULL:
        raise MemoryError()
    w_init(&kw)
    w_init(&vw)
    for b in range(6):
        w_init(&bufs[b])
    out = []
    try:
        _encode_pending(pending, cache, keys, values, group_prefixes, state_id, &kw, &vw, rows, [None] * n)
        while i < n:
            group = rows[i].group
            j = i
            while j < n and rows[j].group == group:
                j += 1
            if start + group in full:
                i = j
                continue
            for b in range(6):
                bufs[b].pos = 0
            pos = 0
            w_bytes(&bufs[1], <const char *>&pos, 8)
            w_bytes(&bufs[3], <const char *>&pos, 8)
            w_bytes(&bufs[5], <const char *>&pos, 8)
            while i < j:
                r = &rows[i]
                i += 1
                if r.voff >= 0 and has_deadline:
                    if r.vn < 8:
                        raise ValueError(f"a TTL value of {r.vn} bytes, shorter than its timestamp")
                    memcpy(&ts, vw.buf + r.voff, 8)
                    if ts <= cutoff:   # expired: a delete
                        w_bytes(&bufs[4], <const char *>r.key + 8, r.n - 8)
                        pos = bufs[4].pos
                        w_bytes(&bufs[5], <const char *>&pos, 8)
                        continue
                if r.voff < 0:
                    w_bytes(&bufs[4], <const char *>r.key + 8, r.n - 8)
                    pos = bufs[4].pos
                    w_bytes(&bufs[5], <const char *>&pos, 8)
                    continue
                w_bytes(&bufs[0], <const char *>r.key + 8, r.n - 8)
                pos = bufs[0].pos
                w_bytes(&bufs[1], <const char *>&pos, 8)
                w_bytes(&bufs[2], <const char *>vw.buf + r.voff, r.vn)
                pos = bufs[2].pos
                w_bytes(&bufs[3], <const char *>&pos, 8)
            puts = None if bufs[1].pos == 8 else (_section(&bufs[0], &bufs[1]), _section(&bufs[2], &bufs[3]))
            deletes = None if bufs[5].pos == 8 else _section(&bufs[4], &bufs[5])
            if puts is not None or deletes is not None:
                out.append((start + group, puts, deletes))
    finally:
        w_free(&kw)
        w_free(&vw)
        for b in range(6):
            w_free(&bufs[b])
        PyMem_Free(rows)
    return out


cdef Py_ssize_t _unpack_runs(list runs, list key_lists, list value_lists, str what, bint deletes,
                             Py_ssize_t min_key) except -1:
    """Check ``runs`` (``(keys, values)`` tuples of lists of bytes; with ``deletes``, ``values`` may be None: a run of
    deletes) and put each run's lists in ``key_lists``/``value_lists``; returns the total number of keys. Keys
    shorter than ``min_key`` bytes are refused (ValueError), so that the merge may read their first ``min_key``."""
    cdef Py_ssize_t i, total = 0
    for i in range(PyList_GET_SIZE(runs)):
        run = <object>PyList_GET_ITEM(runs, i)
        if type(run) is not tuple or len(run) != 2:
            raise TypeError(f"{what}: a run is a (keys, values{' or None' if deletes else ''}) tuple")
        run_keys, run_values = run
        if type(run_keys) is not list or not (type(run_values) is list or (deletes and run_values is None)):
            raise TypeError(f"{what}: a run's keys and values are lists")
        if run_values is not None and PyList_GET_SIZE(run_values) != PyList_GET_SIZE(run_keys):
            raise ValueError(f"{what}: {PyList_GET_SIZE(run_keys)} keys but {PyList_GET_SIZE(run_values)} values")
        for key in <list>run_keys:
            if type(key) is not bytes:
                raise TypeError(f"{what}: a key must be bytes, got {type(key).__name__}")
            if PyBytes_GET_SIZE(key) < min_key:
                raise ValueError(f"{what}: a key of {PyBytes_GET_SIZE(key)} bytes, shorter than its {min_key}-byte "
                                 "prefix")
        if run_values is not None:
            for value in <list>run_values:
                if type(value) is not bytes:
                    raise TypeError(f"{what}: a value must be bytes, got {type(value).__name__}")
        key_lists[i] = run_keys
        value_lists[i] = run_values
        total += PyList_GET_SIZE(run_keys)
    return total


def write_sorted_rows(object writer, list runs):
    """Write the rows of ``runs`` into ``writer`` (an open ``rocksdict.SstFileWriter``: ``writer[key] = value``,
    ``del writer[key]`` for a tombstone), merged into one strictly ascending order (RocksDB's bytewise order), in
    one C loop. Each run is ``(keys, values)``: ``keys`` a list of bytes in strictly ascending order, ``values`` the
    list of their values (bytes), or None for a run of deletes. Returns the rows written; ValueError if a run is
    out of order or two runs share a key (nothing is then finished: the caller drops the file)."""
    cdef Py_ssize_t k = PyList_GET_SIZE(runs), i, best, total = 0, rows = 0
    cdef Py_ssize_t *at
    cdef Py_ssize_t *size
    cdef const uint8_t *best_p = NULL
    cdef Py_ssize_t best_n = 0
    cdef const uint8_t *last_p = NULL
    cdef Py_ssize_t last_n = -1
    cdef int c
    last_key = None
    key_lists = [None] * k
    value_lists = [None] * k
    total = _unpack_runs(runs, key_lists, value_lists, "write_sorted_rows", True, 0)
    at = <Py_ssize_t *>PyMem_Malloc((k if k else 1) * sizeof(Py_ssize_t))
    size = <Py_ssize_t *>PyMem_Malloc((k if k else 1) * sizeof(Py_ssize_t))
    if at == NULL or size == NULL:
        PyMem_Free(at)
        PyMem_Free(size)
        raise MemoryError()
    try:
        for i in range(k):
            at[i] = 0
            size[i] = PyList_GET_SIZE(<list>key_lists[i])
        while rows < total:
            best = -1
            for i in range(k):
                if at[i] < size[i]:
                    key = <object>PyList_GET_ITEM(<list>key_lists[i], at[i])
                    if best < 0:
                        c = -1
                    else:
                        c = kg_key_cmp(<const uint8_t *>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), best_p, best_n)
                    if c < 0:
                        best, best_p, best_n = i, <const uint8_t *>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)
            if last_n >= 0 and kg_key_cmp(last_p, last_n, best_p, best_n) >= 0:
                raise ValueError("write_sorted_rows: the runs' keys are not strictly ascending and distinct")
            key = <object>PyList_GET_ITEM(<list>key_lists[best], at[best])
            if value_lists[best] is None:
                PyObject_DelItem(writer, key)
            else:
                PyObject_SetItem(writer, key, <object>PyList_GET_ITEM(<list>value_lists[best], at[best]))
            last_key = key   # holds the bytes last_p points into
            last_p, last_n = best_p, best_n
            at[best] += 1
            rows += 1
    finally:
        PyMem_Free(at)
        PyMem_Free(size)
    return rows


def current_keys(KeyContext ctx, list keys):
    """Each of ``keys`` made current in turn (``ctx.set_current_key``: its key group checked against the range):
    ``(the keys as the backend keys them (Java's equality), their key-group indexes)``. Leaves the last key
    current."""
    cdef Py_ssize_t i, n = PyList_GET_SIZE(keys)
    set_key = ctx.set_current_key
    out_keys = [None] * n
    out_groups = [None] * n
    for i in range(n):
        set_key(<object>PyList_GET_ITEM(keys, i))
        out_keys[i] = ctx.key
        out_groups[i] = ctx.kgi
    return out_keys, out_groups


def fill_cache(dict cache, dict pending, list keys, list order, list raw, object decode_many, bint mutable,
               list group_indexes):
    """Cache a batch read from the database: ``raw[i]`` is the stored value (None: not stored) of the key
    ``keys[order[i]]``, whose key-group index is ``group_indexes[order[i]]``. The stored values are decoded together
    (``decode_many(block, offsets)``: the values packed in one bytes object at n + 1 offsets), each key cached with
    its value or MISSING; with ``mutable``, each key with a value goes into ``pending`` too (it is handed out live)."""
    cdef Py_ssize_t n = PyList_GET_SIZE(raw), i, j, size = 0, at = 0, found = 0, k
    cdef object r
    cdef char *block_p
    cdef int64_t[::1] offsets
    if PyList_GET_SIZE(order) != n:
        raise ValueError(f"fill_cache: {n} stored values but {PyList_GET_SIZE(order)} positions")
    for i in range(n):
        r = <object>PyList_GET_ITEM(raw, i)
        if r is not None:
            if type(r) is not bytes:
                raise TypeError(f"a stored value must be bytes, got {type(r).__name__}")
            size += PyBytes_GET_SIZE(r)
            found += 1
    values = []
    if found:
        block = PyBytes_FromStringAndSize(NULL, size)
        block_p = PyBytes_AS_STRING(block)
        offsets_array = _np.empty(found + 1, dtype=_np.int64)
        offsets = offsets_array
        j = 0
        offsets[0] = 0
        for i in range(n):
            r = <object>PyList_GET_ITEM(raw, i)
            if r is not None:
                memcpy(block_p + at, PyBytes_AS_STRING(r), PyBytes_GET_SIZE(r))
                at += PyBytes_GET_SIZE(r)
                j += 1
                offsets[j] = at
        values = decode_many(block, offsets_array)
        if type(values) is not list:   # a user serializer's deserialize_many may return any sequence
            values = list(values)
        if len(values) != found:
            raise ValueError(f"fill_cache: {found} stored values decoded into {len(values)}")
    j = 0
    for i in range(n):
        k = <Py_ssize_t>(<object>PyList_GET_ITEM(order, i))
        if k < 0 or k >= PyList_GET_SIZE(keys) or k >= PyList_GET_SIZE(group_indexes):
            raise IndexError(f"fill_cache: position {k} outside the {PyList_GET_SIZE(keys)} keys")
        key = <object>PyList_GET_ITEM(keys, k)
        if <object>PyList_GET_ITEM(raw, i) is None:
            PyDict_SetItem(cache, key, _MISSING)
        else:
            PyDict_SetItem(cache, key, <object>PyList_GET_ITEM(values, j))
            j += 1
            if mutable:
                PyDict_SetItem(pending, key, <object>PyList_GET_ITEM(group_indexes, k))


def cached_in_groups(dict cache, KeyContext ctx, object mark, object key_groups, tuple skip=()):
    """The keys ``cache`` holds (but ``mark``, a sentinel key it may hold, and the keys of the dicts in ``skip``)
    whose key group is one of ``key_groups`` (absolute, in ``ctx``'s range), as ``{key: key-group index}`` in the
    cache's order: each key group computed in C as ``ctx.set_current_key`` computes it (the cache is keyed by the
    keys it makes current), ``ctx`` left as it is. For a snapshot's full key groups taken from a cache that holds
    its state whole (``skip``: the keys whose rows it has already, from its flush)."""
    cdef Py_ssize_t pos = 0, kgi, n = ctx.n
    cdef PyObject *pkey
    cdef PyObject *pvalue
    cdef int32_t h
    cdef int overflow
    cdef long long v
    cdef uint8_t[::1] wanted = _np.zeros(n if n else 1, dtype=_np.uint8)
    cdef bint skipped
    for d in skip:
        if type(d) is not dict:
            raise TypeError(f"cached_in_groups: skip holds dicts, got {type(d).__name__}")
    for g in key_groups:
        kgi = <Py_ssize_t>g - ctx.start
        if kgi < 0 or kgi >= n:
            raise ValueError(f"cached_in_groups: key group {g} outside the context's {n} from {ctx.start}")
        wanted[kgi] = 1
    out = {}
    while PyDict_Next(cache, &pos, &pkey, &pvalue):
        key = <object>pkey
        if key is mark:
            continue
        if ctx._infer and type(key) is int:
            overflow = 0
            v = PyLong_AsLongLongAndOverflow(key, &overflow)
            h = java_hash_object(key, None) if overflow else kg_hash_long(v)
        elif ctx._infer and type(key) is str:
            h = _hash_str(key)
        else:
            h = java_hash_object(key, ctx._type_code)
        kgi = kg_key_group(h, ctx.max_parallelism, ctx._inv) - ctx.start
        if kgi < 0 or kgi >= n:
            raise ValueError(f"cached_in_groups: cached key {key!r} is outside the context's key groups")
        if not wanted[kgi]:
            continue
        # only then the dicts of keys to leave out (a lookup each, which misses the CPU's caches at a cache's size)
        skipped = False
        for d in skip:
            if PyDict_GetItem(<dict>d, key) != NULL:
                skipped = True
                break
        if not skipped:
            out[key] = kgi
    return out


def full_sections(list runs, object full, bint ttl, object deadline):
    """One state's full-block sections of the key groups in ``full`` (absolute), cut from rows a flush wrote:
    ``runs`` is a list of ``(database keys, stored values)`` (lists of bytes, each strictly ascending, no key in two
    runs), merged in key order; the rows of other key groups are left out, and so are, with a TTL ``deadline``,
    values whose timestamp is at or before it (a full block holds no expired value). Returns ``[(key group, ((key
    bytes, offsets), (value bytes, offsets))), ...]`` ascending, as ``delta_values`` gives puts: the serialized
    keys (the database key without its 8-byte prefix), ready for ``Packed``; a key group without rows is left out.
    ValueError if a run is out of order, two runs share a key, or a key is shorter than its prefix."""
    cdef Py_ssize_t k = PyList_GET_SIZE(runs), i, best, total = 0, done = 0, kn, vn
    cdef Py_ssize_t *at
    cdef Py_ssize_t *size
    cdef const uint8_t *best_p = NULL
    cdef Py_ssize_t best_n = 0
    cdef const uint8_t *last_p = NULL
    cdef Py_ssize_t last_n = -1
    cdef const uint8_t *vp
    cdef int64_t pos, ts, cutoff = 0
    cdef bint has_deadline = ttl and deadline is not None
    cdef int group, current = -1, b
    cdef Writer bufs[4]   # keys, key offsets, values, value offsets
    cdef uint8_t[::1] wanted = _np.zeros(0x10000, dtype=_np.uint8)
    if has_deadline:
        cutoff = deadline
    for g in full:
        if g < 0 or g > 0xFFFF:
            raise ValueError(f"full_sections: key group {g} outside 0..65535")
        wanted[<Py_ssize_t>g] = 1
    key_lists = [None] * k
    value_lists = [None] * k
    total = _unpack_runs(runs, key_lists, value_lists, "full_sections", False, 8)
    at = <Py_ssize_t *>PyMem_Malloc((k if k else 1) * sizeof(Py_ssize_t))
    size = <Py_ssize_t *>PyMem_Malloc((k if k else 1) * sizeof(Py_ssize_t))
    if at == NULL or size == NULL:
        PyMem_Free(at)
        PyMem_Free(size)
        raise MemoryError()
    for b in range(4):
        w_init(&bufs[b])
    out = []
    try:
        for i in range(k):
            at[i] = 0
            size[i] = PyList_GET_SIZE(<list>key_lists[i])
        while done <= total:
            best = -1
            if done < total:
                for i in range(k):
                    if at[i] < size[i]:
                        key = <object>PyList_GET_ITEM(<list>key_lists[i], at[i])
                        if best < 0 or kg_key_cmp(<const uint8_t *>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key),
                                                  best_p, best_n) < 0:
                            best, best_p, best_n = i, <const uint8_t *>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)
                if last_n >= 0 and kg_key_cmp(last_p, last_n, best_p, best_n) >= 0:
                    raise ValueError("full_sections: the runs' keys are not strictly ascending and distinct")
                group = best_p[0] << 8 | best_p[1]
            else:
                group = -2   # past the last row: the last key group's section is closed
            if group != current:
                if current >= 0 and bufs[1].pos > 8:
                    out.append((current, (_section(&bufs[0], &bufs[1]), _section(&bufs[2], &bufs[3]))))
                current = group
                for b in range(4):
                    bufs[b].pos = 0
                pos = 0
                w_bytes(&bufs[1], <const char *>&pos, 8)
                w_bytes(&bufs[3], <const char *>&pos, 8)
            if done == total:
                break
            key = <object>PyList_GET_ITEM(<list>key_lists[best], at[best])
            last_key = key   # holds the bytes last_p points into
            last_p, last_n = best_p, best_n
            at[best] += 1
            done += 1
            if not wanted[group]:
                continue
            value = <object>PyList_GET_ITEM(<list>value_lists[best], at[best] - 1)
            vp = <const uint8_t *>PyBytes_AS_STRING(value)
            vn = PyBytes_GET_SIZE(value)
            if has_deadline:
                if vn < 8:
                    raise ValueError(f"a TTL value of {vn} bytes, shorter than its timestamp")
                memcpy(&ts, vp, 8)
                if ts <= cutoff:   # expired: no row of a full block
                    continue
            kn = best_n - 8
            w_bytes(&bufs[0], <const char *>best_p + 8, kn)
            pos = bufs[0].pos
            w_bytes(&bufs[1], <const char *>&pos, 8)
            w_bytes(&bufs[2], <const char *>vp, vn)
            pos = bufs[2].pos
            w_bytes(&bufs[3], <const char *>&pos, 8)
    finally:
        PyMem_Free(at)
        PyMem_Free(size)
        for b in range(4):
            w_free(&bufs[b])
    return out
