# cython: auto_pickle=False
# The heap backend's snapshot sections, compiled: one state's entries of one key group as the bytes a keyed
# snapshot block holds (keys and values back to back, with their offsets), encoded in C with the state's compiled
# value writer (framing.pxd) and the key serializer's encoder, without one Python object per entry.
#
# * delta_section: the changed keys of a delta block (their values, and the keys deleted), in the order given (the
#   block encoder sorts them);
# * full_section: a full block's entries, the decoded values merged with the restored layers (statecore.pxd), newest
#   first, sorted by key bytes as the block encoder sorts them (stably: equal keys keep their order). A kept backend
#   then keeps the result as the key group's one layer, as it is (``Layer(..., copy=False)``).
#
# The bytes are those the Python definition makes (keygroups/state/heap.py: serialize each key, ValueFraming.encode
# each value, Layer.collect_puts for the layers' entries not shadowed by a newer source; the block encoder sorts);
# tests/test_heap_snapshot_encoding.py holds both to each other over every serializer kind.
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.dict cimport PyDict_Next, PyDict_Size
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcpy

from indexsort cimport kg_sorted_order
from keysearch cimport kg_key_cmp
from writer cimport Writer, w_bytes, w_free, w_init

from keygroups._native.framing cimport Encoder, FK_VALUE, ValueWriter
from keygroups._native.statecore cimport Layer, layer_deleted, layer_key, layer_value

import numpy as _np

from keygroups.errors import CorruptSnapshotError


cdef struct Vec:
    int64_t *p
    Py_ssize_t n
    Py_ssize_t cap


cdef inline int vec_push(Vec *v, int64_t x) except -1:
    cdef int64_t *p
    cdef Py_ssize_t cap
    if v.n == v.cap:
        cap = v.cap * 2 if v.cap else 64
        p = <int64_t *>PyMem_Realloc(v.p, cap * sizeof(int64_t))
        if p == NULL:
            raise MemoryError(f"cannot grow a snapshot section's index to {cap} entries")
        v.p = p
        v.cap = cap
    v.p[v.n] = x
    v.n += 1
    return 0


cdef inline void vec_free(Vec *v) noexcept:
    PyMem_Free(v.p)
    v.p = NULL
    v.n = v.cap = 0


cdef object _packed(const uint8_t *buf, Vec *offsets):
    """(bytes of buf[offsets[0]:offsets[-1]], the offsets from 0 as an int64 array); None when there is no item."""
    cdef Py_ssize_t n = offsets.n, i
    cdef int64_t base
    cdef int64_t[::1] o
    if n <= 1:
        return None
    base = offsets.p[0]
    data = PyBytes_FromStringAndSize(<const char *>buf + base, offsets.p[n - 1] - base)
    arr = _np.empty(n, dtype=_np.int64)
    o = arr
    for i in range(n):
        o[i] = offsets.p[i] - base
    return data, arr


cdef inline bint _has_deadline(object deadline, int64_t *out) except -1:
    if deadline is None:
        return False
    out[0] = deadline
    return True


def delta_section(dict delta, Encoder keys, ValueWriter values, object missing, object deadline=None):
    """The changed entries of one state in one key group, for a delta block: ``delta`` maps each changed key to its
    value, or to ``missing`` for a key deleted since. With ``deadline`` (a TTL state: now - ttl), a value's expired
    parts are left out, and a value that expired whole is a delete (so that no older block brings it back).

    Returns ``(put keys, put values, deleted keys)``, each ``(data, offsets)`` (item i is
    ``data[offsets[i]:offsets[i + 1]]``, in ``delta``'s order) or None when there is none. A key or value its
    serializer refuses raises what the serializer raises."""
    cdef Writer kw, vw, gw
    cdef Vec ko, vo, go
    cdef Py_ssize_t pos = 0, n = PyDict_Size(delta), at
    cdef PyObject *k
    cdef PyObject *v
    cdef int64_t limit = 0
    cdef bint ttl = _has_deadline(deadline, &limit)
    cdef bint live
    w_init(&kw)
    w_init(&vw)
    w_init(&gw)
    ko.p = vo.p = go.p = NULL
    ko.n = ko.cap = vo.n = vo.cap = go.n = go.cap = 0
    try:
        vec_push(&ko, 0)
        vec_push(&vo, 0)
        vec_push(&go, 0)
        while PyDict_Next(delta, &pos, &k, &v):
            value = <object>v    # owned while encoded
            at = kw.pos
            keys.write(&kw, <object>k)   # the key first, then its value (as the Python definition fails first)
            live = value is not missing
            if live:
                if ttl:
                    live = values.write_live(&vw, value, limit)
                else:
                    values.write(&vw, value)
            if live:
                vec_push(&ko, kw.pos)
                vec_push(&vo, vw.pos)
            else:   # a delete: the key moves to the deleted keys
                w_bytes(&gw, kw.buf + at, kw.pos - at)
                kw.pos = at
                vec_push(&go, gw.pos)
            if PyDict_Size(delta) != n:
                raise RuntimeError("dictionary changed size during iteration")
        return _packed(kw.buf, &ko), _packed(vw.buf, &vo), _packed(gw.buf, &go)
    finally:
        w_free(&kw)
        w_free(&vw)
        w_free(&gw)
        vec_free(&ko)
        vec_free(&vo)
        vec_free(&go)


cdef struct Run:
    # the decoded entries, encoded: key i at keys[ko[i]:ko[i + 1]], its value at values[vo[i]:vo[i + 1]] (empty and
    # not live for a tombstone or an expired value), in the stable order that sorts the keys
    const uint8_t *keys
    const uint8_t *values
    const int64_t *ko
    const int64_t *vo
    const uint8_t *live
    const Py_ssize_t *order
    Py_ssize_t n


cdef int _run_order(const void *items, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    cdef const Run *r = <const Run *>items
    return kg_key_cmp(r.keys + r.ko[a], r.ko[a + 1] - r.ko[a], r.keys + r.ko[b], r.ko[b + 1] - r.ko[b])


cdef struct Out:
    # the entries of the merged section, in order: (key, value) as pointers into the run or a layer
    const uint8_t **kp
    const uint8_t **vp
    int64_t *kn
    int64_t *vn
    Py_ssize_t n
    Py_ssize_t cap
    int64_t key_bytes
    int64_t value_bytes


cdef int _emit(Out *o, const uint8_t *k, int64_t kn, const uint8_t *v, int64_t vn) except -1:
    cdef Py_ssize_t cap
    if o.n == o.cap:
        cap = o.cap * 2 if o.cap else 256
        o.kp = <const uint8_t **>PyMem_Realloc(o.kp, cap * sizeof(uint8_t *))
        o.vp = <const uint8_t **>PyMem_Realloc(o.vp, cap * sizeof(uint8_t *))
        o.kn = <int64_t *>PyMem_Realloc(o.kn, cap * sizeof(int64_t))
        o.vn = <int64_t *>PyMem_Realloc(o.vn, cap * sizeof(int64_t))
        if o.kp == NULL or o.vp == NULL or o.kn == NULL or o.vn == NULL:
            raise MemoryError(f"cannot grow a snapshot section to {cap} entries")
        o.cap = cap
    o.kp[o.n] = k
    o.kn[o.n] = kn
    o.vp[o.n] = v
    o.vn[o.n] = vn
    o.key_bytes += kn
    o.value_bytes += vn
    o.n += 1
    return 0


cdef inline bint _value_lives(const uint8_t *v, Py_ssize_t n, int64_t deadline) except -1:
    """A TTL value's bytes (i64 timestamp first) outlive ``deadline``."""
    cdef int64_t ts
    if n < 8:
        raise CorruptSnapshotError(f"a TTL value needs an 8-byte timestamp, got {n} bytes")
    memcpy(&ts, v, 8)
    return ts > deadline


def full_section(dict entries, list layers, Encoder keys, ValueWriter values, object missing, object deadline=None):
    """Every live entry of one state in one key group, for a full block: ``entries`` (the decoded values; key ->
    value, or ``missing`` for a key deleted since the restore) merged with ``layers`` (the restored layers, newest
    first, all sorted; None or empty: none). A key's entry is its newest: the decoded one, else that of the newest
    layer that puts or deletes it (a layer's delete wins over its own put). With ``deadline`` (a TTL state; with
    layers only for value, reducing and aggregating states) what expired is left out.

    Returns ``(data, key_offsets, value_offsets)``, the keys then the values back to back in ``data`` (item i's key
    is ``data[key_offsets[i]:key_offsets[i + 1]]``), sorted by key bytes (stably), or None when no entry is live. A
    key or value its serializer refuses raises what the serializer raises."""
    cdef Writer kw, vw
    cdef Vec ko, vo
    cdef Run run
    cdef Out out
    cdef Py_ssize_t pos = 0, n = PyDict_Size(entries), i, j, d = 0, nl, li, kn, mn, best_src
    cdef PyObject *k
    cdef PyObject *v
    cdef int64_t limit = 0
    cdef bint ttl = _has_deadline(deadline, &limit)
    cdef uint8_t *live = NULL
    cdef Py_ssize_t *order = NULL
    cdef Py_ssize_t *puts = NULL      # per layer: the next put
    cdef Py_ssize_t *dels = NULL      # per layer: the next delete
    cdef const uint8_t *mk
    cdef const uint8_t *p
    cdef uint8_t *dst
    cdef Py_ssize_t last
    cdef bint found, deleted, lives
    cdef Layer layer
    cdef int c
    layers = [] if layers is None else layers
    nl = len(layers)
    for li in range(nl):
        layer = <Layer?>layers[li]
        if not layer.sorted:
            raise ValueError("full_section merges sorted layers only (keyed format 2 or later)")
    if ttl and nl and values.kind != FK_VALUE:
        raise ValueError("full_section drops what expired from layers of value states only")
    w_init(&kw)
    w_init(&vw)
    ko.p = vo.p = NULL
    ko.n = ko.cap = vo.n = vo.cap = 0
    out.kp = out.vp = NULL
    out.kn = out.vn = NULL
    out.n = out.cap = 0
    out.key_bytes = out.value_bytes = 0
    try:
        live = <uint8_t *>PyMem_Malloc(n if n else 1)
        puts = <Py_ssize_t *>PyMem_Malloc((nl if nl else 1) * sizeof(Py_ssize_t))
        dels = <Py_ssize_t *>PyMem_Malloc((nl if nl else 1) * sizeof(Py_ssize_t))
        if live == NULL or puts == NULL or dels == NULL:
            raise MemoryError(f"cannot merge {n} entries")
        vec_push(&ko, 0)
        vec_push(&vo, 0)
        # the decoded entries, encoded (a tombstone's key too: it shadows the layers)
        while PyDict_Next(entries, &pos, &k, &v):
            value = <object>v
            keys.write(&kw, <object>k)
            if value is missing:
                live[d] = 0
            elif ttl:
                live[d] = values.write_live(&vw, value, limit)
            else:
                values.write(&vw, value)
                live[d] = 1
            vec_push(&ko, kw.pos)
            vec_push(&vo, vw.pos)
            d += 1
            if PyDict_Size(entries) != n:
                raise RuntimeError("dictionary changed size during iteration")
        run.keys = kw.buf
        run.values = vw.buf
        run.ko = ko.p
        run.vo = vo.p
        run.live = live
        run.n = d
        order = kg_sorted_order(run.n, _run_order, &run)
        for li in range(nl):
            puts[li] = 0
            dels[li] = 0
        i = 0   # the next decoded entry, in sorted order
        while True:
            # the smallest key still to merge (best_src: -1 the decoded entries, 2 * li a layer's put, 2 * li + 1
            # its delete)
            mk = NULL
            mn = 0
            if i < d:
                j = order[i]
                mk = run.keys + run.ko[j]
                mn = run.ko[j + 1] - run.ko[j]
            for li in range(nl):
                layer = <Layer>layers[li]
                if puts[li] < layer._n_puts:
                    p = layer_key(layer, puts[li], &kn)
                    if mk == NULL or kg_key_cmp(p, kn, mk, mn) < 0:
                        mk, mn = p, kn
                if dels[li] < layer._n_deletes:
                    p = layer_deleted(layer, dels[li], &kn)
                    if mk == NULL or kg_key_cmp(p, kn, mk, mn) < 0:
                        mk, mn = p, kn
            if mk == NULL:
                break
            found = False
            # decoded entries of this key, all of them in order (equal key bytes from unequal keys: as given)
            while i < d:
                j = order[i]
                if kg_key_cmp(run.keys + run.ko[j], run.ko[j + 1] - run.ko[j], mk, mn) != 0:
                    break
                found = True
                if live[j]:
                    _emit(&out, run.keys + run.ko[j], run.ko[j + 1] - run.ko[j], run.values + run.vo[j],
                          run.vo[j + 1] - run.vo[j])
                i += 1
            for li in range(nl):
                layer = <Layer>layers[li]
                deleted = False
                while dels[li] < layer._n_deletes:
                    p = layer_deleted(layer, dels[li], &kn)
                    if kg_key_cmp(p, kn, mk, mn) != 0:
                        break
                    deleted = True
                    dels[li] += 1
                last = -1
                while puts[li] < layer._n_puts:
                    p = layer_key(layer, puts[li], &kn)
                    if kg_key_cmp(p, kn, mk, mn) != 0:
                        break
                    last = puts[li]   # of equal keys in a layer, the last counts (as Layer.find finds it)
                    puts[li] += 1
                if found or not (deleted or last >= 0):
                    continue
                found = True
                if deleted:
                    continue
                p = layer_value(layer, last, &kn)
                if ttl and not _value_lives(p, kn, limit):
                    continue
                mk = layer_key(layer, last, &mn)
                _emit(&out, mk, mn, p, kn)
        if out.n == 0:
            return None
        data = PyBytes_FromStringAndSize(NULL, out.key_bytes + out.value_bytes)
        dst = <uint8_t *>PyBytes_AS_STRING(data)
        key_offsets = _np.empty(out.n + 1, dtype=_np.int64)
        value_offsets = _np.empty(out.n + 1, dtype=_np.int64)
        _fill(dst, 0, out.kp, out.kn, out.n, key_offsets)
        _fill(dst, out.key_bytes, out.vp, out.vn, out.n, value_offsets)
        return data, key_offsets, value_offsets
    finally:
        w_free(&kw)
        w_free(&vw)
        vec_free(&ko)
        vec_free(&vo)
        PyMem_Free(live)
        PyMem_Free(order)
        PyMem_Free(puts)
        PyMem_Free(dels)
        PyMem_Free(out.kp)
        PyMem_Free(out.vp)
        PyMem_Free(out.kn)
        PyMem_Free(out.vn)


cdef void _fill(uint8_t *dst, int64_t at, const uint8_t **ptr, const int64_t *length, Py_ssize_t n,
                int64_t[::1] offsets) noexcept:
    cdef Py_ssize_t i
    for i in range(n):
        offsets[i] = at
        if length[i]:
            memcpy(dst + at, ptr[i], <size_t>length[i])
        at += length[i]
    offsets[n] = at


def estimated_entries(list maps, list layers, Py_ssize_t n):
    """Over key groups ``i < n``: the sum of the most entries that ``maps[i]`` (a dict) or one of ``layers[i]`` (None,
    or a list of ``Layer``) holds. What ``HeapKeyedStateBackend.estimated_entries`` reports per state, without a
    Python step per key group (a batch's report asks for it at every max parallelism)."""
    cdef Py_ssize_t i, total = 0, largest
    cdef Layer layer
    cdef object group
    if n < 0 or n > len(maps) or n > len(layers):
        raise ValueError(f"n must be in [0, {min(len(maps), len(layers))}] (one dict and one layer list per key "
                         f"group), got {n}")
    for i in range(n):
        largest = len(maps[i])
        group = layers[i]
        if group is not None:
            for layer in <list?>group:
                if layer._n_puts > largest:
                    largest = layer._n_puts
        total += largest
    return total
