# The C-level contract of keygroups._native.codec: the compiled codec of a built-in serializer, and the encoder of
# one whole value (what ``Codec.encode`` returns, written into a writer.pxd buffer). framing.pyx cimports it (as
# keygroups._native.codec, its full name) so that a snapshot encodes every value of a built-in serializer in C.
from libc.stdint cimport int64_t

from cursor cimport Cursor
from writer cimport Writer


cdef class Codec:
    cdef readonly int kind
    cdef readonly str name
    cdef readonly Py_ssize_t min_size     # the fewest bytes one nested value can take (>= 1)
    cdef readonly Py_ssize_t fixed_size   # bytes of every value when constant, else -1
    cdef readonly tuple children
    cdef readonly object external         # K_EXTERNAL: the Python serializer called for each value
    cdef Codec a                          # NULLABLE/LIST inner, MAP key
    cdef Codec b                          # MAP value

    cdef object _encode_array(self, object values)
    cdef object _decode_array(self, object data, const int64_t *o, Py_ssize_t n)


# One whole value of codec ``c`` appended to ``w``: exactly the bytes ``c.encode(v)`` returns.
cdef int enc_top(Codec c, Writer *w, object v) except -1
# One whole value of codec ``c`` read from all of ``cur``: exactly what ``c.decode(bytes)`` returns (and raises:
# CorruptSnapshotError for bytes that are not one value). framing.pyx's ValueReader decodes state values with it.
cdef object dec_top(Codec c, Cursor *cur)
