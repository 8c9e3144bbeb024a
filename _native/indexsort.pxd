# A stable sort of an index array, shared by the compiled encoders and loaders that order keys by their bytes.
# Inline-only, like keysearch.pxd: cimport it by its bare name. The comparator is a plain C function over an opaque
# pointer to what the indexes refer to; each caller passes a constant one, which the C compiler (at -O3) inlines.
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memcpy

ctypedef int (*kg_index_cmp)(const void *items, Py_ssize_t a, Py_ssize_t b) noexcept nogil


cdef inline void kg_stable_sort(Py_ssize_t *idx, Py_ssize_t *tmp, Py_ssize_t n, kg_index_cmp cmp,
                                const void *items) noexcept nogil:
    """Sort ``idx[0:n]`` stably by ``cmp(items, a, b)`` (< 0: item a sorts before item b), with ``tmp`` (room for
    ``n`` indexes) as scratch; the order ends in ``idx``. A bottom-up merge sort: O(n log n) comparisons whatever
    the input, and equal items keep their order (where equal keys occur, the last one given counts)."""
    cdef Py_ssize_t width = 1, lo, mid, hi, i, j, k
    cdef Py_ssize_t *src = idx
    cdef Py_ssize_t *dst = tmp
    cdef Py_ssize_t *swap
    while width < n:
        lo = 0
        while lo < n:
            mid = lo + width if lo + width < n else n
            hi = lo + 2 * width if lo + 2 * width < n else n
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                if cmp(items, src[j], src[i]) < 0:   # strictly less: a tie takes the left one first
                    dst[k] = src[j]
                    j += 1
                else:
                    dst[k] = src[i]
                    i += 1
                k += 1
            while i < mid:
                dst[k] = src[i]
                i += 1
                k += 1
            while j < hi:
                dst[k] = src[j]
                j += 1
                k += 1
            lo = hi
        swap = src
        src = dst
        dst = swap
        width *= 2
    if src != idx:
        memcpy(idx, src, n * sizeof(Py_ssize_t))


cdef inline Py_ssize_t *kg_sorted_order(Py_ssize_t n, kg_index_cmp cmp, const void *items) except NULL:
    """A new array (free it with ``PyMem_Free``) of the indexes ``0..n-1`` in :func:`kg_stable_sort`'s order;
    the sort itself runs without the GIL."""
    cdef Py_ssize_t i
    cdef Py_ssize_t *order = <Py_ssize_t *>PyMem_Malloc((n if n else 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *tmp = <Py_ssize_t *>PyMem_Malloc((n if n else 1) * sizeof(Py_ssize_t))
    if order == NULL or tmp == NULL:
        PyMem_Free(order)
        PyMem_Free(tmp)
        raise MemoryError(f"cannot sort {n} keys")
    with nogil:
        for i in range(n):
            order[i] = i
        kg_stable_sort(order, tmp, n, cmp, items)
    PyMem_Free(tmp)
    return order
