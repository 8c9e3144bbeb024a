# The C-level contract of keygroups._native.hashing: the key type codes and the Java hash of one Python key.
# statecore cimports it (as keygroups._native.hashing, its full name) so that set_current_key calls the hash in C,
# not through a Python attribute lookup and call.
from libc.stdint cimport int32_t


# How a key is hashed: as the Java type Flink would see (keygroups._hashing maps the names "long", "int", ... onto
# these), or KT_AUTO to infer it from the Python value.
cdef enum KeyTypeCode:
    KT_AUTO = 0
    KT_LONG = 1
    KT_INT = 2
    KT_SHORT = 3
    KT_BYTE = 4
    KT_BOOLEAN = 5
    KT_DOUBLE = 6
    KT_FLOAT = 7
    KT_STRING = 8
    KT_BYTES = 9


# key_type: None (infer), a KeyTypeCode, or a tuple of them for a tuple key.
cpdef int32_t java_hash_object(object value, object key_type=*) except? -1
