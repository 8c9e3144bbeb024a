# A checked cursor over untrusted bytes (snapshot files, serialized values). Every read goes through cur_read, which
# raises CorruptSnapshotError instead of reading past the end; counts are checked against what remains before any
# allocation or loop they size.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy


cdef struct Cursor:
    const uint8_t *buf
    Py_ssize_t length
    Py_ssize_t pos


cdef inline int cur_corrupt(Cursor *c, str what) except -1:
    from keygroups.errors import CorruptSnapshotError
    raise CorruptSnapshotError(f"{what} at byte {c.pos} of {c.length}: the data is truncated or corrupt")


cdef inline void cur_init(Cursor *c, const uint8_t *buf, Py_ssize_t length) noexcept nogil:
    c.buf = buf
    c.length = length
    c.pos = 0


cdef inline Py_ssize_t cur_remaining(const Cursor *c) noexcept nogil:
    return c.length - c.pos


cdef inline const uint8_t *cur_read(Cursor *c, Py_ssize_t n) except NULL:
    cdef const uint8_t *p
    if n < 0 or n > c.length - c.pos:
        cur_corrupt(c, f"a read of {n} bytes with {c.length - c.pos} left")
    p = c.buf + c.pos
    c.pos += n
    return p


cdef inline uint8_t cur_u8(Cursor *c) except? 0xFF:
    return cur_read(c, 1)[0]


cdef inline uint32_t cur_u32(Cursor *c) except? 0xFFFFFFFF:
    cdef uint32_t v
    memcpy(&v, cur_read(c, 4), 4)   # little-endian hosts only (x86-64, aarch64); checked at import in codec
    return v


cdef inline uint64_t cur_u64(Cursor *c) except? 0xFFFFFFFFFFFFFFFF:
    cdef uint64_t v
    memcpy(&v, cur_read(c, 8), 8)
    return v


cdef inline Py_ssize_t cur_count(Cursor *c, Py_ssize_t min_item_size, str what) except -1:
    """A u32 element count, refused unless count * min_item_size bytes can still follow."""
    cdef uint32_t n = cur_u32(c)
    if min_item_size > 0 and <uint64_t>n * <uint64_t>min_item_size > <uint64_t>(c.length - c.pos):
        cur_corrupt(c, f"{what} count {n} (at least {min_item_size} bytes each) exceeds what remains")
    return n


cdef inline int64_t cur_i64(Cursor *c) except? -1:
    cdef int64_t v
    memcpy(&v, cur_read(c, 8), 8)
    return v


cdef inline int32_t cur_i32(Cursor *c) except? -1:
    cdef int32_t v
    memcpy(&v, cur_read(c, 4), 4)
    return v
