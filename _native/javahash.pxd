# The C-level contract of the Java-hash kernels (kg_hash.h) and the one place that knows how to hash a Python str
# over its internal representation. Inline-only: cimporting it adds no runtime import.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t

cdef extern from "Python.h":
    int PyUnicode_KIND(object)
    void *PyUnicode_DATA(object)
    Py_ssize_t PyUnicode_GET_LENGTH(object)
    int PyUnicode_1BYTE_KIND
    int PyUnicode_2BYTE_KIND

cdef extern from "kg_hash.h" nogil:
    int32_t kg_murmur(int32_t code)
    int32_t kg_key_group(int32_t java_hash, int32_t max_parallelism, double inv_max_parallelism)
    int32_t kg_hash_long(int64_t v)
    int32_t kg_hash_double(double d)
    int32_t kg_hash_float(float f)
    int32_t kg_hash_bytes(const uint8_t *p, int64_t length)
    int kg_hash_utf8(const uint8_t *p, int64_t length, int32_t *out)
    int32_t kg_hash_ucs4(const uint32_t *p, int64_t length)
    int32_t kg_hash_ucs2(const uint16_t *p, int64_t length)
    int32_t kg_hash_latin1(const uint8_t *p, int64_t length)
    int KG_UPPER_BOUND_MAX_PARALLELISM
    int KG_BOOLEAN_TRUE_HASH
    int KG_BOOLEAN_FALSE_HASH


cdef inline int32_t hash_str(str s) noexcept:
    """String.hashCode() of s, read straight from CPython's 1-, 2- or 4-byte representation (an astral character
    counts as its UTF-16 surrogate pair, as in Java)."""
    cdef int kind = PyUnicode_KIND(s)
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(s)
    cdef void *data = PyUnicode_DATA(s)
    if kind == PyUnicode_1BYTE_KIND:
        return kg_hash_latin1(<const uint8_t *>data, n)
    if kind == PyUnicode_2BYTE_KIND:
        return kg_hash_ucs2(<const uint16_t *>data, n)
    return kg_hash_ucs4(<const uint32_t *>data, n)
