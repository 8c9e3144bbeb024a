# The order of serialized keys in a keyed snapshot block (since format 2), and the binary search over it.
# Inline-only, like cursor.pxd: cimport it by its bare name (the heap backend's compiled core searches restored
# blocks with it).
#
# The keys are the key serializer's bytes as they are (little-endian ints, UTF-8 strings), and their order is this
# byte order, not the keys' natural order: the search only needs the encoder's sort and itself to agree, so the key
# serialization never changes for the search's sake (and must not change under existing files).
#
# Order: bytes compared with memcmp, a key that is a prefix of another first (Python's bytes order). Sections keep
# equal keys in the order they were given (the encoder sorts stably), and the LAST of equal keys is the one that
# counts, as if the entries were applied one after another.
from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcmp


cdef inline int kg_key_cmp(const uint8_t *a, Py_ssize_t na, const uint8_t *b, Py_ssize_t nb) noexcept nogil:
    """<0, 0, >0 as key a sorts before, equal to, or after key b."""
    cdef Py_ssize_t n = na if na < nb else nb
    cdef int c = 0
    if n > 0:
        c = memcmp(a, b, <size_t>n)
    if c != 0:
        return c
    return (na > nb) - (na < nb)


cdef inline Py_ssize_t kg_find_key(const uint8_t *buf, Py_ssize_t size, const int64_t *offsets, Py_ssize_t n,
                                   const uint8_t *key, Py_ssize_t key_len) noexcept nogil:
    """Index of the last of the ``n`` sorted keys ``buf[offsets[i]:offsets[i + 1]]`` equal to ``key``; -1 if none is;
    -2 if a probed offset pair does not lie inside the ``size`` bytes of ``buf`` (nothing outside is ever read)."""
    cdef Py_ssize_t lo = 0, hi = n, mid
    cdef int64_t a, b
    while lo < hi:   # the first key that sorts after ``key``
        mid = lo + (hi - lo) // 2
        a = offsets[mid]
        b = offsets[mid + 1]
        if a < 0 or b < a or b > size:
            return -2
        if kg_key_cmp(buf + a, <Py_ssize_t>(b - a), key, key_len) <= 0:
            lo = mid + 1
        else:
            hi = mid
    if lo == 0:
        return -1
    a = offsets[lo - 1]
    b = offsets[lo]
    if a < 0 or b < a or b > size:
        return -2
    if kg_key_cmp(buf + a, <Py_ssize_t>(b - a), key, key_len) == 0:
        return lo - 1
    return -1
