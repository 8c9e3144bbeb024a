# The C-level contract of keygroups._native.statecore, the heap backend's compiled core: the key context (the
# current key and its key group's index: what a compiled record loop sets per key, with set_current_key or, having
# hashed the key itself, directly), the part of a state table the fast paths read, and Layer, one restored or
# compacted block's entries of one state in one key group, kept as bytes. heapsnap.pyx cimports it (as
# keygroups._native.statecore, its full name) to merge layers into snapshot sections in C.
from libc.stdint cimport int32_t, int64_t, uint8_t

from keysearch cimport kg_key_cmp

from keygroups._native.framing cimport Encoder


cdef class KeyContext:
    cdef readonly object key
    cdef readonly Py_ssize_t kgi          # the key group's index in the range; n when no key is set
    cdef readonly int32_t start
    cdef readonly Py_ssize_t n
    cdef readonly int32_t max_parallelism
    cdef double _inv
    cdef object _type_code
    cdef bint _infer
    cdef object _range


cdef class TableCore:
    cdef public list maps
    cdef public bint slow
    cdef public bint cow
    cdef public list lazy
    cdef public KeyContext ctx
    cdef public bint track
    cdef public list dirty
    cdef public Py_ssize_t dirty_limit
    # Checks on write, in C: the encoder of the value (list element, map value) and of a map's keys whose
    # serializer checks values (``Encoder.checks``), else None. The value, list and map cores check each write.
    cdef public Encoder value_check
    cdef public Encoder key_check
    # A key missing from a layered key group's dict is looked up in the layers in C (``_read``) when ``layer_keys``
    # (the key serializer's encoder) is set: the state has no TTL, and ``layer_decode`` (the read framing's decode)
    # makes its value from the bytes found. None: the Python slow path (``_get_slow``) looks it up.
    cdef public Encoder layer_keys
    cdef public object layer_decode


cdef class Layer:
    cdef readonly object block            # bytes: the puts' keys, then their values, then the deleted keys
    cdef readonly bint sorted
    cdef public object index
    cdef public object deleted
    cdef const uint8_t *_base
    cdef Py_ssize_t _size
    cdef Py_ssize_t _n_puts, _n_deletes
    # Item i of a part (keys, values, deleted keys) is base[o[i]:o[i + 1]] with the part's n + 1 offsets o, or, when
    # the part's offsets are NULL (every item of the part has the same width w), base[start + i * w:][:w].
    cdef int64_t *_ko
    cdef int64_t *_vo
    cdef int64_t *_do
    cdef int64_t _k0, _kw, _v0, _vw, _d0, _dw

    cdef bint _has_puts(self)
    cdef bint _has_deletes(self)


cdef inline const uint8_t *layer_key(Layer l, Py_ssize_t i, Py_ssize_t *n) noexcept nogil:
    """Put ``i``'s key (``0 <= i < l._n_puts``) and its length in ``n``."""
    if l._ko == NULL:
        n[0] = <Py_ssize_t>l._kw
        return l._base + l._k0 + i * l._kw
    n[0] = <Py_ssize_t>(l._ko[i + 1] - l._ko[i])
    return l._base + l._ko[i]


cdef inline const uint8_t *layer_value(Layer l, Py_ssize_t i, Py_ssize_t *n) noexcept nogil:
    """Put ``i``'s value (``0 <= i < l._n_puts``) and its length in ``n``."""
    if l._vo == NULL:
        n[0] = <Py_ssize_t>l._vw
        return l._base + l._v0 + i * l._vw
    n[0] = <Py_ssize_t>(l._vo[i + 1] - l._vo[i])
    return l._base + l._vo[i]


cdef inline const uint8_t *layer_deleted(Layer l, Py_ssize_t i, Py_ssize_t *n) noexcept nogil:
    """Delete ``i``'s key (``0 <= i < l._n_deletes``) and its length in ``n``."""
    if l._do == NULL:
        n[0] = <Py_ssize_t>l._dw
        return l._base + l._d0 + i * l._dw
    n[0] = <Py_ssize_t>(l._do[i + 1] - l._do[i])
    return l._base + l._do[i]


cdef inline Py_ssize_t layer_search(Layer l, bint deletes, const uint8_t *key, Py_ssize_t key_len) noexcept nogil:
    """In a sorted layer: the index of the last put (``deletes``: delete) whose key equals ``key``, or -1. The
    offsets were checked when the layer was made: every probe lies inside its block."""
    cdef Py_ssize_t lo = 0, hi = l._n_deletes if deletes else l._n_puts, mid, n
    cdef const uint8_t *p
    while lo < hi:   # the first key that sorts after ``key``
        mid = lo + (hi - lo) // 2
        p = layer_deleted(l, mid, &n) if deletes else layer_key(l, mid, &n)
        if kg_key_cmp(p, n, key, key_len) <= 0:
            lo = mid + 1
        else:
            hi = mid
    if lo == 0:
        return -1
    p = layer_deleted(l, lo - 1, &n) if deletes else layer_key(l, lo - 1, &n)
    return lo - 1 if kg_key_cmp(p, n, key, key_len) == 0 else -1
