# The one byte writer of the compiled encoders (codec values, snapshot blocks and headers, split operator state):
# little-endian integers and byte runs appended with a bounds check each. Inline-only, like cursor.pxd, its reading
# counterpart: cimporting it adds no runtime import.
#
# Two modes. w_init: a growable buffer whose first W_STACK bytes live on the C stack (most values are small); read
# it with w_result, release it with w_free. w_init_bytes: a new bytes object of a size the caller computed first
# (a snapshot block, a run of split elements), filled in place with no copy; writing past its end, or finishing it
# short (w_finish_bytes), is a bug in that size computation and raises SystemError instead of corrupting memory.
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.math cimport isnan
from libc.string cimport memcpy

cdef enum:
    W_STACK = 256

cdef extern from *:
    """
    #define KG_U32_MAX 0xFFFFFFFFu
    """
    const uint32_t U32_MAX "KG_U32_MAX"   # the largest u32 length or count (typed: a C enum would be a signed int)


cdef struct Writer:
    uint8_t *buf
    Py_ssize_t pos
    Py_ssize_t cap
    bint on_heap           # buf is ours (PyMem), not the stack array
    bint fixed             # buf is a bytes object of exactly cap bytes: no growing
    uint8_t stack[W_STACK]


cdef inline void w_init(Writer *w) noexcept nogil:
    w.buf = w.stack
    w.pos = 0
    w.cap = W_STACK
    w.on_heap = False
    w.fixed = False


cdef inline bytes w_init_bytes(Writer *w, Py_ssize_t size):
    """A new bytes object of ``size`` bytes for ``w`` to fill; keep it private until it is filled."""
    cdef bytes out = PyBytes_FromStringAndSize(NULL, size)
    w.buf = <uint8_t *>PyBytes_AS_STRING(out)
    w.pos = 0
    w.cap = size
    w.on_heap = False
    w.fixed = True
    return out


cdef inline int w_finish_bytes(Writer *w) except -1:
    if w.pos != w.cap:
        raise SystemError(f"keygroups: {w.pos} bytes written into a {w.cap}-byte buffer sized for them")
    return 0


cdef inline void w_free(Writer *w) noexcept:
    if w.on_heap:
        PyMem_Free(w.buf)
    w.buf = w.stack
    w.on_heap = False


cdef inline int w_grow(Writer *w, Py_ssize_t need) except -1:
    cdef Py_ssize_t cap = w.cap * 2
    cdef uint8_t *p
    if w.fixed:
        raise SystemError(f"keygroups: a write of {need} bytes at byte {w.pos} overruns the {w.cap}-byte buffer "
                          "sized for it")
    if cap < w.pos + need:
        cap = w.pos + need
    if w.on_heap:
        p = <uint8_t *>PyMem_Realloc(w.buf, cap)
    else:
        p = <uint8_t *>PyMem_Malloc(cap)
        if p != NULL:
            memcpy(p, w.stack, w.pos)
    if p == NULL:
        raise MemoryError(f"cannot grow the serializer buffer to {cap} bytes")
    w.buf = p
    w.cap = cap
    w.on_heap = True
    return 0


cdef inline uint8_t *w_reserve(Writer *w, Py_ssize_t n) except NULL:
    """Room for n bytes at the end; the pointer is valid until the next reserve."""
    cdef uint8_t *p
    if n > w.cap - w.pos:
        w_grow(w, n)
    p = w.buf + w.pos
    w.pos += n
    return p


cdef inline int w_u8(Writer *w, uint8_t v) except -1:
    w_reserve(w, 1)[0] = v
    return 0


cdef inline int w_u32(Writer *w, uint32_t v) except -1:
    memcpy(w_reserve(w, 4), &v, 4)   # little-endian hosts only, as cursor.cur_u32 reads it back
    return 0


cdef inline int w_u64(Writer *w, uint64_t v) except -1:
    memcpy(w_reserve(w, 8), &v, 8)
    return 0


cdef inline int w_i64(Writer *w, int64_t v) except -1:
    memcpy(w_reserve(w, 8), &v, 8)
    return 0


cdef inline int w_bytes(Writer *w, const void *p, Py_ssize_t n) except -1:
    if n > 0:
        memcpy(w_reserve(w, n), p, n)
    return 0


cdef inline int w_len(Writer *w, Py_ssize_t n, str what) except -1:
    """A u32 length or count, refused (ValueError) past U32_MAX."""
    if n > U32_MAX:
        raise ValueError(f"{what} of {n} is too large to serialize: at most {U32_MAX} (u32) is allowed")
    return w_u32(w, <uint32_t>n)


cdef inline bytes w_result(Writer *w):
    return PyBytes_FromStringAndSize(<const char *>w.buf, w.pos)


cdef inline int w_f64(Writer *w, double v) except -1:
    """A double, every NaN written as the one canonical quiet NaN (so equal values give equal bytes)."""
    cdef uint64_t bits = 0x7FF8000000000000ULL
    if not isnan(v):
        memcpy(&bits, &v, 8)
    memcpy(w_reserve(w, 8), &bits, 8)
    return 0


cdef inline str short_repr(object v):
    """repr(v), cut to 80 characters, for messages about a value that cannot be written."""
    cdef str r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."
