# The C-level contract of keygroups._native.records: one position of a record schema, and the encoder of one value
# at it (what ``Node.encode`` returns, written into a writer.pxd buffer). framing.pyx cimports it (as
# keygroups._native.records, its full name) so that a snapshot, and the check of a record on write, encode in C.
cimport cython

from cursor cimport Cursor
from writer cimport Writer


@cython.final
cdef class Node:
    cdef readonly int kind
    cdef readonly bint nullable
    cdef readonly str what                # how messages name this position, e.g. "field 'a.b' (bigint)"
    cdef readonly Py_ssize_t min_size     # the fewest bytes a value here takes
    cdef readonly tuple children          # record: one node per field; list: (element,); map: (key, value)
    cdef readonly tuple names             # record: the field names
    cdef readonly int form                # record: TUPLE_FORM, DICT_FORM, CLASS_FORM or FACTORY_FORM
    cdef readonly object cls              # record: the class built (CLASS_FORM), or the callable that builds a
                                          # value from the record's dict (FACTORY_FORM, e.g. a Spark Row)
    cdef bint cls_dict                    # instances of cls keep their fields in a __dict__
    cdef Py_ssize_t nfields
    cdef int unit                         # timestamp: 0 s, 1 ms, 2 us, 3 ns
    cdef object tz                        # timestamp: None (naive) or the tzinfo values are returned in
    cdef bint tz_utc
    cdef int precision, scale             # decimal
    cdef object limit                     # decimal: 10 ** precision
    cdef Node a, b                        # list element / map key and value

    cdef Py_ssize_t _value_size(self)


# One value at position ``n`` (with its null flag when ``n`` is nullable) appended to ``w``: for the root node,
# exactly the bytes ``n.encode(v)`` returns. TypeError/ValueError (naming the field) for a value that does not fit.
cdef int enc(Node n, Writer *w, object v) except -1

# One whole record value read from all of ``cur`` at root node ``n``: exactly what ``n.decode(bytes)`` returns (and
# raises). framing.pyx's ValueReader decodes state values with it.
cdef object dec_whole(Node n, Cursor *cur)
