# cython: auto_pickle=False
# Keyed snapshot blocks into a RocksDB SST file, compiled: what a RocksDB backend's restore ingests instead of
# writing its rows one Python call at a time (keygroups/state/rocksdb_ingest.py drives it).
#
# Input: one key group's chain of blocks as the keyed file reader returns them (keygroups/checkpoint/format.py,
# ``read_key_group_offsets``: sections as int64 offsets into the block, keys sorted by their bytes since format 2;
# the newest full block starts the key group anew, a put replaces a key's value, a delete removes the key, and of
# equal keys the last one counts). Output: the key group's live rows in the database's key order, each handed to an
# ``rocksdict.SstFileWriter`` (``writer[key] = value``), which needs strictly ascending keys:
#
#   database key = u16 key group | u16 state id | u32 key length | key bytes [| user key bytes, a map's row]
#                  (big-endian: RocksDB orders keys bytewise; see keygroups/state/rocksdb.py)
#   value        = the framed value as the snapshot stores it; a map keeps one row per entry, its value being
#                  [i64 timestamp |] user value bytes (little-endian, as ValueFraming.map_rows builds it)
#
# Within one state the database orders keys by (length, bytes), the file by bytes alone: a section whose keys are
# not already in the database's order (keys of different lengths) is sorted by index first (a stable merge sort, so
# the last of equal keys stays last). The sections of a chain are merged k ways, the newest entry of each key
# winning; deletes only remove. TTL states drop what expired by the deadline given (as the Python restore does), a
# map's entries are sorted by user key bytes (a map value keeps insertion order).
#
# Every offset is checked against its block before it is used, and every framed value goes through the checked
# cursor (cursor.pxd): bytes that say otherwise raise CorruptSnapshotError; nothing is read outside a buffer.
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject, PyObject_DelItem, PyObject_SetItem
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

cimport numpy as cnp

from cursor cimport Cursor, cur_corrupt, cur_init, cur_read, cur_remaining, cur_u32, cur_u64
from entryframe cimport ENTRY_HEAD
from indexsort cimport kg_sorted_order, kg_stable_sort
from keysearch cimport kg_key_cmp

import sys
from operator import itemgetter

import numpy as np

cnp.import_array()

if sys.byteorder != "little":   # the cursor reads integers in host order
    raise ImportError("keygroups._native.sstload supports little-endian hosts only")

#: State kinds as ``write_key_group`` takes them.
VALUE = 0
LIST = 1
MAP = 2

cdef enum:
    K_VALUE = 0
    K_LIST = 1
    K_MAP = 2
    PREFIX = 8          # u16 key group | u16 state id | u32 key length
    FRAME_HEAD = 4
    TS_SIZE = 8


cdef struct Run:
    # One section of the chain for one state: n keys (and values, a put) at offsets into buf.
    const uint8_t *buf
    Py_ssize_t size
    const int64_t *keys
    const int64_t *values      # NULL: a delete section
    Py_ssize_t n
    Py_ssize_t *order          # the entries in database order; NULL: already in it
    Py_ssize_t head            # the next position in that order
    bint unique                # no two keys equal (known without a sort: the keys ascend strictly)


cdef struct Entry:
    # One map entry while a map's rows are built.
    const uint8_t *key
    Py_ssize_t key_len
    const uint8_t *value
    Py_ssize_t value_len
    const uint8_t *ts          # NULL without TTL


cdef inline int _db_cmp(const uint8_t *a, Py_ssize_t na, const uint8_t *b, Py_ssize_t nb) noexcept nogil:
    """The database's order of two keys of one state: by length (the u32 big-endian length comes first), then
    bytes."""
    if na != nb:
        return -1 if na < nb else 1
    if na == 0:
        return 0
    return memcmp(a, b, <size_t>na)


cdef inline const uint8_t *_key(const Run *r, Py_ssize_t i, Py_ssize_t *n) noexcept nogil:
    cdef int64_t a = r.keys[i]
    n[0] = <Py_ssize_t>(r.keys[i + 1] - a)
    return r.buf + a


# ---- the orders entries are sorted in (by index, with indexsort's stable sort) ----------------------------------

cdef int _run_order(const void *items, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    """The database's key order of entries ``a`` and ``b`` of a run."""
    cdef const Run *r = <const Run *>items
    cdef Py_ssize_t la, lb
    cdef const uint8_t *x = _key(r, a, &la)
    cdef const uint8_t *y = _key(r, b, &lb)
    return _db_cmp(x, la, y, lb)


cdef int _entry_order(const void *items, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    """Map entries by user key bytes."""
    cdef const Entry *e = <const Entry *>items
    return kg_key_cmp(e[a].key, e[a].key_len, e[b].key, e[b].key_len)


# ---- the writer ----------------------------------------------------------------------------------------------------

cdef extern from *:
    """
    /* A bytes object refilled in place forgets any hash cached of its old bytes (no one hashes these: the
       writer only reads them; this keeps it true anyway). */
    static inline void kg_bytes_forget_hash(PyObject *o) {
    #if PY_VERSION_HEX < 0x030F0000
    #if defined(__GNUC__)
    #pragma GCC diagnostic push
    #pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    #endif
        ((PyBytesObject *)o)->ob_shash = -1;
    #if defined(__GNUC__)
    #pragma GCC diagnostic pop
    #endif
    #endif
    }
    static inline Py_ssize_t kg_refcnt(PyObject *o) { return Py_REFCNT(o); }
    """
    void kg_bytes_forget_hash(PyObject *o) noexcept nogil
    Py_ssize_t kg_refcnt(PyObject *o) noexcept nogil


cdef enum:
    REUSED_MAX = 64     # keys and values of up to this many bytes go through bytes objects refilled in place


cdef class _Out:
    """Where rows go: the SST writer, and the key group and state of the rows being written.

    Each row is handed to the writer as two bytes objects, which it copies and lets go of. Making them anew per row
    was a sixth of a restore's CPU; instead, one bytes object per length (up to REUSED_MAX bytes) is refilled in
    place for the next row of that length, as long as this writer is the only holder (its reference count says so;
    otherwise a new one is made): no one ever sees a bytes object change."""
    cdef object writer
    cdef uint8_t prefix[4]     # u16 key group | u16 state id, big-endian
    cdef Py_ssize_t rows
    cdef Py_ssize_t payload    # key and value bytes handed to the writer
    cdef PyObject *keys[REUSED_MAX + 1]     # owned references, by length (NULL: none yet)
    cdef PyObject *values[REUSED_MAX + 1]

    def __cinit__(self):
        memset(self.keys, 0, sizeof(self.keys))
        memset(self.values, 0, sizeof(self.values))

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(REUSED_MAX + 1):
            Py_XDECREF(self.keys[i])
            Py_XDECREF(self.values[i])

    cdef inline object _buffer(self, PyObject **slots, Py_ssize_t size):
        """A bytes object of ``size`` bytes that no one else holds, for the caller to fill."""
        cdef PyObject *o
        cdef object b
        if size > REUSED_MAX:
            return PyBytes_FromStringAndSize(NULL, size)
        o = slots[size]
        if o != NULL and kg_refcnt(o) == 1:
            kg_bytes_forget_hash(o)
            return <object>o
        b = PyBytes_FromStringAndSize(NULL, size)
        Py_XDECREF(o)
        Py_INCREF(b)
        slots[size] = <PyObject *>b
        return b

    cdef object _db_key(self, Py_ssize_t size, const uint8_t *key, Py_ssize_t key_len):
        """A database key buffer of ``size`` bytes, its head (prefix, u32 key length) and ``key`` written; the
        caller writes what follows (a map row's user key)."""
        cdef object k
        cdef uint8_t *p
        cdef uint32_t n
        if key_len > 0xFFFFFFFF:
            raise OverflowError(f"a key of {key_len} bytes is longer than a database key can say")
        k = self._buffer(self.keys, size)
        p = <uint8_t *>PyBytes_AS_STRING(k)
        n = <uint32_t>key_len
        memcpy(p, self.prefix, 4)
        p[4] = (n >> 24) & 0xFF
        p[5] = (n >> 16) & 0xFF
        p[6] = (n >> 8) & 0xFF
        p[7] = n & 0xFF
        if key_len:
            memcpy(p + PREFIX, key, key_len)
        return k

    cdef int put(self, const uint8_t *key, Py_ssize_t key_len, const uint8_t *user_key, Py_ssize_t user_key_len,
                 const uint8_t *ts, const uint8_t *value, Py_ssize_t value_len) except -1:
        """One row: database key (prefix, key [, user key]) -> [ts |] value."""
        cdef Py_ssize_t size = PREFIX + key_len + user_key_len
        cdef Py_ssize_t vsize = value_len + (TS_SIZE if ts != NULL else 0)
        cdef object k, v
        cdef uint8_t *p
        k = self._db_key(size, key, key_len)
        v = self._buffer(self.values, vsize)
        p = <uint8_t *>PyBytes_AS_STRING(k)
        if user_key_len:
            memcpy(p + PREFIX + key_len, user_key, user_key_len)
        p = <uint8_t *>PyBytes_AS_STRING(v)
        if ts != NULL:
            memcpy(p, ts, TS_SIZE)
            p += TS_SIZE
        if value_len:
            memcpy(p, value, value_len)
        PyObject_SetItem(self.writer, k, v)
        self.rows += 1
        self.payload += size + vsize
        return 0

    cdef int delete(self, const uint8_t *key, Py_ssize_t key_len) except -1:
        """One tombstone: database key (prefix, key) deleted (a catch-up's delete, over a kept row)."""
        cdef Py_ssize_t size = PREFIX + key_len
        cdef object k = self._db_key(size, key, key_len)
        PyObject_DelItem(self.writer, k)
        self.rows += 1
        self.payload += size
        return 0


cdef int _check_offsets(const int64_t *offsets, Py_ssize_t n, Py_ssize_t size, str what) except -1:
    cdef Py_ssize_t i
    cdef Cursor c
    for i in range(n):
        if offsets[i] < 0 or offsets[i + 1] < offsets[i] or offsets[i + 1] > size:
            cur_init(&c, NULL, size)
            c.pos = <Py_ssize_t>offsets[i] if offsets[i] >= 0 else 0
            cur_corrupt(&c, f"{what} {i} at offsets [{offsets[i]}, {offsets[i + 1]})")
    return 0


cdef const int64_t *_offsets(object array, Py_ssize_t *n, list keep) except NULL:
    """The data of an int64 offset array (n + 1 positions: n is set), kept alive by ``keep``."""
    cdef cnp.ndarray a = np.ascontiguousarray(array, dtype=np.int64)
    keep.append(a)
    if a.ndim != 1 or a.shape[0] < 1:
        from keygroups.errors import CorruptSnapshotError
        raise CorruptSnapshotError("a section's offsets are not n + 1 positions")
    n[0] = a.shape[0] - 1
    return <const int64_t *>cnp.PyArray_DATA(a)


cdef int _write_value(_Out out, int kind, bint ttl, bint has_deadline, int64_t deadline, const uint8_t *key,
                      Py_ssize_t key_len, const uint8_t *value, Py_ssize_t value_len) except -1:
    """Hand one key's stored value to the writer as the database keeps it (TTL: what expired left out)."""
    cdef Cursor c
    cdef int64_t ts
    if kind == K_VALUE:
        if ttl:
            if value_len < TS_SIZE:
                cur_init(&c, value, value_len)
                cur_corrupt(&c, f"a TTL value of {value_len} bytes, shorter than its timestamp")
            if has_deadline:
                memcpy(&ts, value, TS_SIZE)
                if ts <= deadline:
                    return 0
        return out.put(key, key_len, NULL, 0, NULL, value, value_len)
    if kind == K_LIST:
        return _write_list(out, ttl, has_deadline, deadline, key, key_len, value, value_len)
    return _write_map(out, ttl, has_deadline, deadline, key, key_len, value, value_len)


cdef int _write_list(_Out out, bint ttl, bint has_deadline, int64_t deadline, const uint8_t *key,
                     Py_ssize_t key_len, const uint8_t *value, Py_ssize_t value_len) except -1:
    cdef Cursor c
    cdef uint32_t length
    cdef int64_t ts = 0
    cdef Py_ssize_t head = FRAME_HEAD + (TS_SIZE if ttl else 0), live = 0, start, pos
    cdef bytes kept
    cdef uint8_t *p
    cur_init(&c, value, value_len)
    while cur_remaining(&c):   # every frame checked before anything below trusts its length
        if cur_remaining(&c) < head:
            cur_corrupt(&c, "a truncated list element header")
        length = cur_u32(&c)
        if ttl:
            ts = <int64_t>cur_u64(&c)
        cur_read(&c, length)
        if not (ttl and has_deadline) or ts > deadline:
            live += head + length
    if live == value_len:
        return out.put(key, key_len, NULL, 0, NULL, value, value_len)
    if live == 0:
        return 0
    kept = PyBytes_FromStringAndSize(NULL, live)
    p = <uint8_t *>PyBytes_AS_STRING(kept)
    c.pos = 0
    pos = 0
    while cur_remaining(&c):
        start = c.pos
        length = cur_u32(&c)
        ts = <int64_t>cur_u64(&c)
        cur_read(&c, length)
        if ts > deadline:
            memcpy(p + pos, value + start, head + length)
            pos += head + length
    return out.put(key, key_len, NULL, 0, NULL, p, live)


cdef int _write_map(_Out out, bint ttl, bint has_deadline, int64_t deadline, const uint8_t *key,
                    Py_ssize_t key_len, const uint8_t *value, Py_ssize_t value_len) except -1:
    cdef Cursor c, e
    cdef uint32_t length, ukey_len
    cdef Py_ssize_t n = 0, i, j, head = FRAME_HEAD + (TS_SIZE if ttl else 0)
    cdef Entry *entries = NULL
    cdef Py_ssize_t *idx = NULL
    cdef Py_ssize_t *tmp = NULL
    cdef const uint8_t *ts = NULL
    cdef int64_t stamp
    cdef Entry *x
    cur_init(&c, value, value_len)
    while cur_remaining(&c):
        if cur_remaining(&c) < head:
            cur_corrupt(&c, "a truncated map entry header")
        length = cur_u32(&c)
        c.pos += head - FRAME_HEAD
        cur_read(&c, length)
        n += 1
    if n == 0:
        return 0
    entries = <Entry *>PyMem_Malloc(n * sizeof(Entry))
    idx = <Py_ssize_t *>PyMem_Malloc(n * sizeof(Py_ssize_t))
    tmp = <Py_ssize_t *>PyMem_Malloc(n * sizeof(Py_ssize_t))
    try:
        if entries == NULL or idx == NULL or tmp == NULL:
            raise MemoryError()
        c.pos = 0
        for i in range(n):
            length = cur_u32(&c)
            ts = cur_read(&c, TS_SIZE) if ttl else NULL
            if length < 4:
                cur_corrupt(&c, f"a map entry of {length} bytes, shorter than its key length")
            cur_init(&e, cur_read(&c, length), length)
            ukey_len = cur_u32(&e)
            entries[i].key = cur_read(&e, ukey_len)
            entries[i].key_len = ukey_len
            entries[i].value = e.buf + e.pos
            entries[i].value_len = cur_remaining(&e)
            entries[i].ts = ts
            idx[i] = i
        kg_stable_sort(idx, tmp, n, _entry_order, entries)
        i = 0
        while i < n:
            j = i
            while j + 1 < n and kg_key_cmp(entries[idx[j + 1]].key, entries[idx[j + 1]].key_len,
                                           entries[idx[i]].key, entries[idx[i]].key_len) == 0:
                j += 1   # equal user keys: the last one counts
            x = &entries[idx[j]]
            i = j + 1
            if ttl and has_deadline:
                memcpy(&stamp, x.ts, TS_SIZE)
                if stamp <= deadline:
                    continue
            out.put(key, key_len, x.key, x.key_len, x.ts, x.value, x.value_len)
    finally:
        PyMem_Free(entries)
        PyMem_Free(idx)
        PyMem_Free(tmp)
    return 0


cdef int _order_run(Run *r) except -1:
    """Leave ``r.order`` NULL when the keys are already in the database's order (non-decreasing), else sort."""
    cdef Py_ssize_t i, la, lb
    cdef const uint8_t *a
    cdef const uint8_t *b
    cdef int c
    r.unique = True
    for i in range(1, r.n):
        a = _key(r, i - 1, &la)
        b = _key(r, i, &lb)
        c = _db_cmp(a, la, b, lb)
        if c > 0:
            break
        if c == 0:
            r.unique = False
    else:
        return 0
    r.unique = False
    r.order = kg_sorted_order(r.n, _run_order, r)
    return 0


cdef inline Py_ssize_t _at(const Run *r, Py_ssize_t pos) noexcept nogil:
    return pos if r.order == NULL else r.order[pos]


cdef int _merge_state(_Out out, Run *runs, Py_ssize_t k, int kind, bint ttl, bint has_deadline,
                      int64_t deadline, bint tombstones) except -1:
    """Write one state's rows of a key group from its ``k`` runs (oldest first): each key's newest entry, if a put;
    if a delete, a tombstone when ``tombstones`` (the runs are deltas over rows the database holds), else nothing."""
    cdef Py_ssize_t i, best, la, lb, e, win_entry
    cdef const uint8_t *a
    cdef const uint8_t *b
    cdef const uint8_t *mk
    cdef Py_ssize_t ml
    cdef int c
    cdef Run *r
    cdef Run *win
    if k == 1 and runs[0].values != NULL:   # the common case: one full block, nothing to merge
        r = &runs[0]
        i = 0
        if r.unique:   # keys ascending strictly: every entry is a row
            for i in range(r.n):
                _write_value(out, kind, ttl, has_deadline, deadline, r.buf + r.keys[i],
                             <Py_ssize_t>(r.keys[i + 1] - r.keys[i]), r.buf + r.values[i],
                             <Py_ssize_t>(r.values[i + 1] - r.values[i]))
            return 0
        while i < r.n:
            e = _at(r, i)
            while i + 1 < r.n:   # equal keys: the last one counts
                a = _key(r, e, &la)
                b = _key(r, _at(r, i + 1), &lb)
                if _db_cmp(a, la, b, lb) != 0:
                    break
                i += 1
                e = _at(r, i)
            a = _key(r, e, &la)
            _write_value(out, kind, ttl, has_deadline, deadline, a, la, r.buf + r.values[e],
                         <Py_ssize_t>(r.values[e + 1] - r.values[e]))
            i += 1
        return 0
    while True:
        best = -1
        for i in range(k):   # the smallest head key; chains are short, so a linear scan
            r = &runs[i]
            if r.head >= r.n:
                continue
            a = _key(r, _at(r, r.head), &la)
            if best < 0:
                best, mk, ml = i, a, la
            elif _db_cmp(a, la, mk, ml) < 0:
                best, mk, ml = i, a, la
        if best < 0:
            return 0
        win = NULL
        win_entry = -1
        for i in range(k):   # every run's entries of that key, the newest run's last one winning
            r = &runs[i]
            while r.head < r.n:
                e = _at(r, r.head)
                a = _key(r, e, &la)
                if _db_cmp(a, la, mk, ml) != 0:
                    break
                win, win_entry = r, e
                r.head += 1
        if win.values != NULL:
            a = _key(win, win_entry, &la)
            _write_value(out, kind, ttl, has_deadline, deadline, a, la, win.buf + win.values[win_entry],
                         <Py_ssize_t>(win.values[win_entry + 1] - win.values[win_entry]))
        elif tombstones:
            a = _key(win, win_entry, &la)
            out.delete(a, la)


def write_key_group(object writer, int key_group, list chain, list states, bint tombstones=False):
    """Write key group ``key_group``'s live rows to ``writer`` (an ``rocksdict.SstFileWriter``, raw mode) in the
    database's key order; returns ``(rows, bytes)`` handed to it. ``tombstones``: the chain is delta blocks only,
    to be applied over the rows the database holds (a kept database's catch-up): a key whose newest entry is a
    delete gets a tombstone, and every put is written as it is (ValueError for a full block, a map state, whose put
    replaces rows a tombstone per key would not remove, or a TTL deadline: an expired put left out would let the
    older row it replaces live on).

    ``chain``: the key group's blocks, oldest first, each ``(block, full, puts, deletes, slots)`` with ``block``
    the block's bytes (any buffer), ``puts`` ``[(state_index, key_offsets, value_offsets), ...]``, ``deletes``
    ``[(state_index, key_offsets), ...]`` (int64 offsets into ``block``, as ``read_key_group_offsets`` gives them)
    and ``slots[state_index]`` the position in ``states`` of the file's state (-1: not restored). Only the blocks
    from the newest full one on count.

    ``states``: ``[(state_id, kind, ttl, deadline[, name]), ...]`` in ascending state id: ``kind`` one of VALUE
    (value, reducing, aggregating), LIST, MAP; ``deadline`` None or the time (ms) at or before which a TTL entry
    expired; ``name`` the state's, for errors. CorruptSnapshotError for bytes that are not a valid chain (a value's
    framing it cannot split names the state, when given, and the key group)."""
    cdef Py_ssize_t n_states = len(states), n_blocks = len(chain), first = 0, b, s, k, total = 0, i
    cdef list keep = []
    cdef Py_buffer *views = NULL
    cdef Py_ssize_t n_views = 0
    cdef Run *runs = NULL
    cdef _Out out = _Out()
    cdef int kind
    cdef bint ttl, has_deadline
    cdef int64_t deadline
    cdef object state_id, item, name
    cdef tuple entry
    cdef list slots_of = []
    if not 0 <= key_group < 0x8000:
        raise ValueError(f"key group {key_group} is outside [0, 32767]")
    out.writer = writer
    for b in range(n_blocks):
        if chain[b][1]:
            if tombstones:
                raise ValueError(f"key group {key_group}: a full block among deltas written over kept rows")
            first = b
    for b in range(first, n_blocks):
        entry = chain[b]
        total += len(entry[2]) + len(entry[3])
        slots_of.append(entry[4])
    views = <Py_buffer *>PyMem_Malloc((n_blocks - first + 1) * sizeof(Py_buffer))
    runs = <Run *>PyMem_Malloc((total + 1) * sizeof(Run))
    try:
        if views == NULL or runs == NULL:
            raise MemoryError()
        for b in range(first, n_blocks):
            PyObject_GetBuffer(chain[b][0], &views[n_views], PyBUF_SIMPLE)
            n_views += 1
        for s in range(n_states):
            state_id, kind, ttl, item = states[s][:4]
            name = states[s][4] if len(states[s]) > 4 else None
            if not 0 <= state_id <= 0xFFFF or kind not in (K_VALUE, K_LIST, K_MAP):
                raise ValueError(f"state {states[s]!r}: a state id in [0, 65535] and a kind in (0, 1, 2)")
            has_deadline = item is not None
            deadline = 0
            if has_deadline:
                deadline = item
            out.prefix[0] = (key_group >> 8) & 0xFF
            out.prefix[1] = key_group & 0xFF
            out.prefix[2] = (state_id >> 8) & 0xFF
            out.prefix[3] = state_id & 0xFF
            k = 0
            for b in range(first, n_blocks):   # the state's runs in file order: each block's puts, then deletes
                entry = chain[b]
                for item in entry[2]:
                    if _slot(slots_of[b - first], item[0]) != s:
                        continue
                    _fill_run(&runs[k], &views[b - first], item[1], item[2], keep)
                    k += 1
                for item in entry[3]:
                    if _slot(slots_of[b - first], item[0]) != s:
                        continue
                    _fill_run(&runs[k], &views[b - first], item[1], None, keep)
                    k += 1
            if k == 0:
                continue
            if tombstones and (kind == K_MAP or has_deadline):
                raise ValueError(f"state {states[s]!r}: deltas written over kept rows take no map state's entries (a "
                                 "put replaces every row of the key) and no TTL deadline (every put is written)")
            try:
                for i in range(k):
                    _order_run(&runs[i])
                _merge_state(out, runs, k, kind, ttl, has_deadline, deadline, tombstones)
            except Exception as e:
                from keygroups.errors import CorruptSnapshotError
                if name is None or type(e) is not CorruptSnapshotError:
                    raise
                # values framed otherwise than the state's meta says (a damaged file, or a crafted meta: a TTL the
                # values were written without): named as the restore's Python paths and the state reader name it
                raise CorruptSnapshotError(f"state {name!r}, key group {key_group}: {e}") from None
            finally:
                for i in range(k):
                    PyMem_Free(runs[i].order)
                    runs[i].order = NULL
    finally:
        for b in range(n_views):
            PyBuffer_Release(&views[b])
        PyMem_Free(views)
        PyMem_Free(runs)
    return out.rows, out.payload


cdef inline Py_ssize_t _slot(object slots, object state_index) except? -2:
    cdef Py_ssize_t i = state_index
    if not 0 <= i < len(slots):
        from keygroups.errors import CorruptSnapshotError
        raise CorruptSnapshotError(f"a section for state index {i}, but the file has {len(slots)} states")
    return slots[i]


cdef int _fill_run(Run *r, Py_buffer *view, object key_offsets, object value_offsets, list keep) except -1:
    cdef Py_ssize_t nv
    r.buf = <const uint8_t *>view.buf
    r.size = view.len
    r.keys = _offsets(key_offsets, &r.n, keep)
    _check_offsets(r.keys, r.n, r.size, "key")
    r.values = NULL
    if value_offsets is not None:
        r.values = _offsets(value_offsets, &nv, keep)
        if nv != r.n:
            from keygroups.errors import CorruptSnapshotError
            raise CorruptSnapshotError(f"a section has {r.n} keys but {nv} values")
        _check_offsets(r.values, nv, r.size, "value")
    r.order = NULL
    r.head = 0
    r.unique = False
    return 0


# ---- the other direction: a key group's rows back into snapshot sections ---------------------------------------------

cdef struct Grow:
    # A growable byte buffer (PyMem).
    uint8_t *data
    Py_ssize_t size
    Py_ssize_t cap


cdef int _grow_add(Grow *g, const void *p, Py_ssize_t n) except -1:
    cdef Py_ssize_t cap
    cdef uint8_t *q
    if n > g.cap - g.size:
        cap = g.cap * 2 if g.cap else 4096
        while cap < g.size + n:
            cap *= 2
        q = <uint8_t *>PyMem_Realloc(g.data, cap)
        if q == NULL:
            raise MemoryError(f"cannot grow a section buffer to {cap} bytes")
        g.data = q
        g.cap = cap
    if n:
        memcpy(g.data + g.size, p, n)
    g.size += n
    return 0


cdef object _grow_bytes(Grow *g):
    return PyBytes_FromStringAndSize(<const char *>g.data, g.size)


cdef object _grow_offsets(Grow *g):
    """The int64 offsets gathered in ``g`` as a numpy array."""
    return np.frombuffer(_grow_bytes(g), dtype=np.int64)


cdef int _add_entry(Grow *keys, Grow *key_offsets, const uint8_t *k, Py_ssize_t kn) except -1:
    cdef int64_t pos
    _grow_add(keys, k, kn)
    pos = keys.size
    return _grow_add(key_offsets, &pos, 8)


cdef int _close_value(Grow *values, Grow *value_offsets) except -1:
    cdef int64_t pos = values.size
    return _grow_add(value_offsets, &pos, 8)


cdef Py_ssize_t _live_frames(const uint8_t *v, Py_ssize_t vn, int64_t deadline) except -1:
    """The bytes of a TTL list value's frames stamped after ``deadline`` (every frame checked first)."""
    cdef Cursor c
    cdef uint32_t length
    cdef int64_t ts
    cdef Py_ssize_t live = 0
    cur_init(&c, v, vn)
    while cur_remaining(&c):
        if cur_remaining(&c) < FRAME_HEAD + TS_SIZE:
            cur_corrupt(&c, "a truncated TTL list element header")
        length = cur_u32(&c)
        ts = <int64_t>cur_u64(&c)
        cur_read(&c, length)
        if ts > deadline:
            live += FRAME_HEAD + TS_SIZE + length
    return live


cdef int _add_live_frames(Grow *g, const uint8_t *v, Py_ssize_t vn, int64_t deadline) except -1:
    """Append the frames of a (checked) TTL list value stamped after ``deadline``."""
    cdef Cursor c
    cdef uint32_t length
    cdef Py_ssize_t start
    cur_init(&c, v, vn)
    while cur_remaining(&c):
        start = c.pos
        length = cur_u32(&c)
        if <int64_t>cur_u64(&c) > deadline:
            _grow_add(g, v + start, FRAME_HEAD + TS_SIZE + length)
        cur_read(&c, length)
    return 0


cdef struct ScanSlot:
    # One state's sections being built by value_sections.
    Py_ssize_t index            # the state's index in the snapshot
    int kind
    bint ttl
    bint has_deadline
    int64_t deadline
    Grow keys                   # serialized keys, their offsets (n + 1), values, their offsets
    Grow key_offsets
    Grow values
    Grow value_offsets
    Grow open_key               # a map: the key whose rows are being joined
    bint is_open                # a map: open_key is set
    bint open_live              # a map: open_key has a live entry (its key is in ``keys``)


cdef int _close_map(ScanSlot *s) except -1:
    if s.is_open and s.open_live:
        _close_value(&s.values, &s.value_offsets)
    s.is_open = False
    s.open_live = False
    return 0


cdef int _scan_row(ScanSlot *s, int key_group, int state_id, const uint8_t *kp, Py_ssize_t kn,
                   const uint8_t *vp, Py_ssize_t vn) except -1:
    """One database row of state ``s`` into its sections."""
    cdef Cursor c
    cdef uint32_t key_len = (<uint32_t>kp[4] << 24) | (<uint32_t>kp[5] << 16) | (<uint32_t>kp[6] << 8) | kp[7]
    cdef const uint8_t *key = kp + PREFIX
    cdef const uint8_t *user_key
    cdef Py_ssize_t user_key_len, live
    cdef uint32_t frame[2]
    cdef int64_t ts
    if s.kind != K_MAP:
        if key_len != kn - PREFIX:
            cur_init(&c, kp, kn)
            cur_corrupt(&c, f"a database key of state {state_id} that says {key_len} key bytes")
        if s.ttl and s.has_deadline:
            if s.kind == K_LIST:
                live = _live_frames(vp, vn, s.deadline)
                if live == 0:
                    return 0
                _add_entry(&s.keys, &s.key_offsets, key, key_len)
                if live == vn:
                    _grow_add(&s.values, vp, vn)
                else:
                    _add_live_frames(&s.values, vp, vn, s.deadline)
                return _close_value(&s.values, &s.value_offsets)
            if vn < TS_SIZE:
                cur_init(&c, vp, vn)
                cur_corrupt(&c, f"a TTL value of {vn} bytes, shorter than its timestamp")
            memcpy(&ts, vp, TS_SIZE)
            if ts <= s.deadline:
                return 0
        _add_entry(&s.keys, &s.key_offsets, key, key_len)
        _grow_add(&s.values, vp, vn)
        return _close_value(&s.values, &s.value_offsets)
    # a map: one row per entry, the key's rows adjacent; joined into the map's value (entry frames in row order)
    if key_len > kn - PREFIX:
        cur_init(&c, kp, kn)
        cur_corrupt(&c, f"a map row of state {state_id} whose key says {key_len} key bytes of {kn - PREFIX}")
    user_key = key + key_len
    user_key_len = kn - PREFIX - key_len
    if not (s.is_open and s.open_key.size == key_len
            and (key_len == 0 or memcmp(s.open_key.data, key, key_len) == 0)):
        _close_map(s)
        s.open_key.size = 0
        _grow_add(&s.open_key, key, key_len)
        s.is_open = True
    if s.ttl:
        if vn < TS_SIZE:
            cur_init(&c, vp, vn)
            cur_corrupt(&c, f"a TTL map entry of {vn} bytes has no timestamp")
        if s.has_deadline:
            memcpy(&ts, vp, TS_SIZE)
            if ts <= s.deadline:
                return 0
    if vn - (TS_SIZE if s.ttl else 0) + user_key_len + 4 > 0xFFFFFFFF:
        raise OverflowError(f"a map entry of state {state_id} is longer than a frame can say")
    if not s.open_live:
        _add_entry(&s.keys, &s.key_offsets, key, key_len)
        s.open_live = True
    frame[0] = <uint32_t>(ENTRY_HEAD + user_key_len + vn - (TS_SIZE if s.ttl else 0))
    frame[1] = <uint32_t>user_key_len
    _grow_add(&s.values, &frame[0], 4)
    if s.ttl:
        _grow_add(&s.values, vp, TS_SIZE)
    _grow_add(&s.values, &frame[1], 4)
    _grow_add(&s.values, user_key, user_key_len)
    if s.ttl:
        return _grow_add(&s.values, vp + TS_SIZE, vn - TS_SIZE)
    return _grow_add(&s.values, vp, vn)


def value_sections(object iterator, int key_group, dict states):
    """The rows of key group ``key_group`` as the keyed snapshot's sections: ``iterator`` is a rocksdict iterator
    positioned at the key group's first row and bounded to its rows (it is advanced to the end; its status is
    checked, so a damaged block raises RocksDB's error). ``states``: state id -> ``(state index, kind, ttl,
    deadline)``, ``kind`` one of VALUE, LIST, MAP, ``deadline`` None or the time at or before which a TTL entry
    expired (left out: a value-like state's value, a list's elements, a map's entries; a key left with none is
    left out). A map key's rows (one per entry) are joined into the map's value, its entries in row order, as
    ``ValueFraming.map_from_rows`` joins them. Returns ``[(state index, keys, values), ...]`` in state order, keys
    and values as ``(bytes, int64 offsets)`` pairs for ``Packed``; None when a row belongs to a state not in
    ``states``. CorruptSnapshotError for a row whose key does not frame its key bytes, or a TTL value without its
    timestamp."""
    cdef object valid = iterator.valid, key = iterator.key, value = iterator.value, advance = iterator.next
    cdef object k, v, spec
    cdef const uint8_t *kp
    cdef const uint8_t *vp
    cdef Py_ssize_t kn, vn, n_slots = 0, i, n_states = len(states)
    cdef int state_id, last_state = -1
    cdef int64_t pos = 0
    cdef ScanSlot *slots = NULL
    cdef ScanSlot *cur = NULL
    cdef dict slot_of = {}
    cdef Cursor c
    out = []
    slots = <ScanSlot *>PyMem_Malloc((n_states + 1) * sizeof(ScanSlot))
    if slots == NULL:
        raise MemoryError()
    memset(slots, 0, (n_states + 1) * sizeof(ScanSlot))
    try:
        while valid():
            k = key()
            v = value()
            if type(k) is not bytes or type(v) is not bytes:
                raise TypeError(f"value_sections reads a raw-mode database (bytes keys and values), got {k!r}")
            kp = <const uint8_t *>PyBytes_AS_STRING(k)
            kn = len(<bytes>k)
            vp = <const uint8_t *>PyBytes_AS_STRING(v)
            vn = len(<bytes>v)
            if kn < PREFIX or ((kp[0] << 8) | kp[1]) != key_group:
                cur_init(&c, kp, kn)
                cur_corrupt(&c, f"a database row of key group {key_group} with key {k!r}")
            state_id = (kp[2] << 8) | kp[3]
            if state_id != last_state:
                if cur != NULL:
                    _close_map(cur)
                spec = states.get(state_id)
                if spec is None:
                    return None
                item = slot_of.get(state_id)
                if item is None:
                    if n_slots == n_states:
                        raise ValueError(f"value_sections: more states in the rows than the {n_states} given")
                    cur = &slots[n_slots]
                    slot_of[state_id] = n_slots
                    n_slots += 1
                    cur.index, cur.kind, cur.ttl, item = spec
                    if cur.kind not in (K_VALUE, K_LIST, K_MAP):
                        raise ValueError(f"state {state_id}: kind {cur.kind} is not one of (0, 1, 2)")
                    cur.has_deadline = item is not None
                    cur.deadline = item if cur.has_deadline else 0
                    _grow_add(&cur.key_offsets, &pos, 8)
                    _grow_add(&cur.value_offsets, &pos, 8)
                else:
                    cur = &slots[<Py_ssize_t>item]
                last_state = state_id
            _scan_row(cur, key_group, state_id, kp, kn, vp, vn)
            advance()
        if cur != NULL:
            _close_map(cur)
        iterator.status()
        for i in range(n_slots):
            if slots[i].key_offsets.size > 8:
                out.append((slots[i].index,
                            (_grow_bytes(&slots[i].keys), _grow_offsets(&slots[i].key_offsets)),
                            (_grow_bytes(&slots[i].values), _grow_offsets(&slots[i].value_offsets))))
    finally:
        for i in range(n_states + 1):
            PyMem_Free(slots[i].keys.data)
            PyMem_Free(slots[i].key_offsets.data)
            PyMem_Free(slots[i].values.data)
            PyMem_Free(slots[i].value_offsets.data)
            PyMem_Free(slots[i].open_key.data)
        PyMem_Free(slots)
    out.sort(key=itemgetter(0))
    return out


cdef int _group_of(object db_key, const uint8_t **p, Py_ssize_t *n) except -1:
    if type(db_key) is not bytes:
        raise TypeError(f"a database key must be bytes, got {type(db_key).__name__}")
    p[0] = <const uint8_t *>PyBytes_AS_STRING(db_key)
    n[0] = len(<bytes>db_key)
    if n[0] < PREFIX:
        raise ValueError(f"database key {db_key!r} is shorter than its {PREFIX}-byte prefix")
    return (p[0][0] << 8) | p[0][1]


def delta_sections(list put_keys, list put_values, list deleted_keys, object full, bint ttl, object deadline):
    """One state's changes of a flush as delta sections per key group: ``put_keys`` (database keys, ascending) and
    ``put_values`` (their stored values), ``deleted_keys`` (ascending). Key groups in ``full`` (a container) are left
    out (their blocks are written whole); with a TTL ``deadline``, a put whose timestamp is at or before it becomes a
    delete. Returns ``[(key group, puts, deletes), ...]`` ascending, ``puts`` None or ``((key bytes, offsets), (value
    bytes, offsets))``, ``deletes`` None or ``(key bytes, offsets)``: the serialized keys (the database key without
    its prefix), ready for ``Packed``."""
    cdef Py_ssize_t n_put = len(put_keys), n_del = len(deleted_keys), i = 0, j = 0, kn, vn
    cdef const uint8_t *kp
    cdef const uint8_t *vp
    cdef int group, gp, gd
    cdef int64_t pos, ts, cutoff = 0
    cdef bint has_deadline = ttl and deadline is not None
    cdef Grow bufs[6]   # put keys, put key offsets, put values, value offsets, deleted keys, deleted offsets
    cdef object v
    cdef Cursor c
    cdef int b
    if len(put_values) != n_put:
        raise ValueError(f"{n_put} put keys but {len(put_values)} values")
    if has_deadline:
        cutoff = deadline
    memset(bufs, 0, sizeof(bufs))
    out = []
    try:
        while i < n_put or j < n_del:
            gp = _group_of(put_keys[i], &kp, &kn) if i < n_put else 0x10000
            gd = _group_of(deleted_keys[j], &kp, &kn) if j < n_del else 0x10000
            group = gp if gp < gd else gd
            for b in range(6):
                bufs[b].size = 0
            pos = 0
            _grow_add(&bufs[1], &pos, 8)
            _grow_add(&bufs[3], &pos, 8)
            _grow_add(&bufs[5], &pos, 8)
            while i < n_put and _group_of(put_keys[i], &kp, &kn) == group:
                v = put_values[i]
                if type(v) is not bytes:
                    raise TypeError(f"a stored value must be bytes, got {type(v).__name__}")
                vp = <const uint8_t *>PyBytes_AS_STRING(v)
                vn = len(<bytes>v)
                i += 1
                if has_deadline:
                    if vn < TS_SIZE:
                        cur_init(&c, vp, vn)
                        cur_corrupt(&c, f"a TTL value of {vn} bytes, shorter than its timestamp")
                    memcpy(&ts, vp, TS_SIZE)
                    if ts <= cutoff:   # expired: a delete
                        _grow_add(&bufs[4], kp + PREFIX, kn - PREFIX)
                        pos = bufs[4].size
                        _grow_add(&bufs[5], &pos, 8)
                        continue
                _grow_add(&bufs[0], kp + PREFIX, kn - PREFIX)
                pos = bufs[0].size
                _grow_add(&bufs[1], &pos, 8)
                _grow_add(&bufs[2], vp, vn)
                pos = bufs[2].size
                _grow_add(&bufs[3], &pos, 8)
            while j < n_del and _group_of(deleted_keys[j], &kp, &kn) == group:
                j += 1
                _grow_add(&bufs[4], kp + PREFIX, kn - PREFIX)
                pos = bufs[4].size
                _grow_add(&bufs[5], &pos, 8)
            if group in full:
                continue
            puts = None
            if bufs[1].size > 8:
                puts = ((_grow_bytes(&bufs[0]), _grow_offsets(&bufs[1])),
                        (_grow_bytes(&bufs[2]), _grow_offsets(&bufs[3])))
            deletes = None
            if bufs[5].size > 8:
                deletes = (_grow_bytes(&bufs[4]), _grow_offsets(&bufs[5]))
            out.append((group, puts, deletes))
    finally:
        for b in range(6):
            PyMem_Free(bufs[b].data)
    return out


cdef int _add_map_rows(Grow *g, object iterator, Py_ssize_t prefix_len, bint ttl, bint has_deadline,
                       int64_t deadline) except -1:
    """Append the entry frames of one map key's rows (``iterator``: positioned at its first row, bounded to its
    rows; advanced to the end, its status checked) to ``g``, entries expired by ``deadline`` left out."""
    cdef object valid = iterator.valid, key = iterator.key, value = iterator.value, advance = iterator.next
    cdef object k, v
    cdef const uint8_t *kp
    cdef const uint8_t *vp
    cdef Py_ssize_t kn, vn, user_key_len, value_len
    cdef uint32_t frame[2]
    cdef int64_t ts
    cdef Cursor c
    while valid():
        k = key()
        v = value()
        if type(k) is not bytes or type(v) is not bytes:
            raise TypeError(f"map_delta_sections reads a raw-mode database (bytes keys and values), got {k!r}")
        kp = <const uint8_t *>PyBytes_AS_STRING(k)
        kn = len(<bytes>k)
        vp = <const uint8_t *>PyBytes_AS_STRING(v)
        vn = len(<bytes>v)
        if kn < prefix_len:
            cur_init(&c, kp, kn)
            cur_corrupt(&c, f"a map row {k!r} outside the key's rows")
        advance()
        user_key_len = kn - prefix_len
        value_len = vn
        if ttl:
            if vn < TS_SIZE:
                cur_init(&c, vp, vn)
                cur_corrupt(&c, f"a TTL map entry of {vn} bytes has no timestamp")
            value_len = vn - TS_SIZE
            if has_deadline:
                memcpy(&ts, vp, TS_SIZE)
                if ts <= deadline:
                    continue
        if ENTRY_HEAD + user_key_len + value_len > 0xFFFFFFFF:
            raise OverflowError("a map entry is longer than a frame can say")
        frame[0] = <uint32_t>(ENTRY_HEAD + user_key_len + value_len)
        frame[1] = <uint32_t>user_key_len
        _grow_add(g, &frame[0], 4)
        if ttl:
            _grow_add(g, vp, TS_SIZE)
        _grow_add(g, &frame[1], 4)
        _grow_add(g, kp + prefix_len, user_key_len)
        _grow_add(g, vp + (vn - value_len), value_len)
    iterator.status()
    return 0


def map_delta_sections(list db_keys, list values, object read_rows, object full, bint ttl, object deadline):
    """One map state's changed keys as delta sections per key group, as ``delta_sections`` gives them:
    ``db_keys`` (ascending) are the keys' database keys (a map key's rows all start with it), ``values[i]`` the
    map's value encoding when it was written whole (bytes), None when the key was deleted, or anything else when the
    map is to be read back from the database: ``read_rows(db_key)`` returns an iterator positioned at the key's
    first row and bounded to its rows, joined here into the map's value (entries in row order, as
    ``ValueFraming.map_from_rows`` joins them). With a TTL ``deadline``, entries stamped at or before it are left
    out, and a map left with none (or with no rows) becomes a delete. Key groups in ``full`` are left out (nothing
    of theirs is read)."""
    cdef Py_ssize_t n = len(db_keys), i = 0, kn, vn, live, start
    cdef const uint8_t *kp
    cdef const uint8_t *vp
    cdef int group
    cdef int64_t pos, cutoff = 0
    cdef bint has_deadline = ttl and deadline is not None, deleted
    cdef Grow bufs[6]   # put keys, put key offsets, put values, value offsets, deleted keys, deleted offsets
    cdef object v
    cdef int b
    if len(values) != n:
        raise ValueError(f"{n} database keys but {len(values)} values")
    if has_deadline:
        cutoff = deadline
    memset(bufs, 0, sizeof(bufs))
    out = []
    try:
        while i < n:
            group = _group_of(db_keys[i], &kp, &kn)
            if group in full:
                while i < n and _group_of(db_keys[i], &kp, &kn) == group:
                    i += 1
                continue
            for b in range(6):
                bufs[b].size = 0
            pos = 0
            _grow_add(&bufs[1], &pos, 8)
            _grow_add(&bufs[3], &pos, 8)
            _grow_add(&bufs[5], &pos, 8)
            while i < n and _group_of(db_keys[i], &kp, &kn) == group:
                v = values[i]
                i += 1
                start = bufs[2].size
                if type(v) is bytes:   # (an empty map's value is a put, as the snapshot of a heap writes it)
                    vp = <const uint8_t *>PyBytes_AS_STRING(v)
                    vn = len(<bytes>v)
                    live = _live_frames(vp, vn, cutoff) if has_deadline and vn else vn
                    if live == vn:
                        _grow_add(&bufs[2], vp, vn)
                    elif live:
                        _add_live_frames(&bufs[2], vp, vn, cutoff)
                    deleted = live == 0 and vn > 0
                elif v is not None:
                    _add_map_rows(&bufs[2], read_rows(db_keys[i - 1]), kn, ttl, has_deadline, cutoff)
                    deleted = bufs[2].size == start   # no rows, or none live
                else:
                    deleted = True
                if deleted:
                    _grow_add(&bufs[4], kp + PREFIX, kn - PREFIX)
                    pos = bufs[4].size
                    _grow_add(&bufs[5], &pos, 8)
                    continue
                _grow_add(&bufs[0], kp + PREFIX, kn - PREFIX)
                pos = bufs[0].size
                _grow_add(&bufs[1], &pos, 8)
                pos = bufs[2].size
                _grow_add(&bufs[3], &pos, 8)
            puts = None
            if bufs[1].size > 8:
                puts = ((_grow_bytes(&bufs[0]), _grow_offsets(&bufs[1])),
                        (_grow_bytes(&bufs[2]), _grow_offsets(&bufs[3])))
            deletes = None
            if bufs[5].size > 8:
                deletes = (_grow_bytes(&bufs[4]), _grow_offsets(&bufs[5]))
            out.append((group, puts, deletes))
    finally:
        for b in range(6):
            PyMem_Free(bufs[b].data)
    return out
