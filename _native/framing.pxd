# The C-level contract of keygroups._native.framing: a state value's encoder and decoder, compiled.
#
# ``Encoder`` writes the bytes one serializer's ``serialize`` returns for a value (a built-in serializer's codec or a
# record's node in C, any other serializer through its ``serialize``), and checks a value on write as the
# serializer's ``check`` does. ``ValueWriter`` writes a whole per-key value of one state in the keyed format-3
# framing (value, list or map, with or without TTL) around its Encoders; ``ValueReader`` is its twin, decoding such
# a value (a built-in serializer's codec or a record's node in C, any other serializer through its ``deserialize``).
# statecore.pyx cimports Encoder and ValueWriter (as keygroups._native.framing, its full name): the heap backend
# checks records on write and encodes its snapshots with them.
from libc.stdint cimport int64_t, uint8_t

from cursor cimport Cursor

from writer cimport Writer

cdef enum EncoderHow:
    HOW_CODEC = 0       # a built-in serializer: its compiled codec (codec.pyx)
    HOW_NODE = 1        # a RecordSerializer: its compiled record node (records.pyx)
    HOW_PYTHON = 2      # any other serializer: its serialize, called per value

cdef enum FramingKind:
    FK_VALUE = 0
    FK_LIST = 1
    FK_MAP = 2
    FK_TTL = 4


cdef class Encoder:
    cdef readonly int how
    cdef readonly object serializer
    cdef object _target      # the Codec, the Node, or the serializer's serialize
    cdef object _check       # HOW_PYTHON: the serializer's own check (None: it checks nothing)
    cdef readonly bint checks   # whether check() checks anything (a serializer that checks on write)

    # The bytes ``serializer.serialize(v)`` returns, appended to ``w``.
    cdef int write(self, Writer *w, object v) except -1
    # What ``serializer.check(v)`` raises for a value it could not write (nothing when it checks nothing).
    cdef int check(self, object v) except -1


cdef class ValueWriter:
    cdef readonly int kind      # FK_VALUE, FK_LIST or FK_MAP
    cdef readonly bint ttl
    cdef readonly Encoder value   # of the value, list element or map value
    cdef readonly Encoder key     # of a map's keys (None otherwise)

    # One state value framed (ValueFraming.encode), appended to ``w``.
    cdef int write(self, Writer *w, object v) except -1
    # As write, for a TTL state, without the parts whose timestamp is <= deadline; 0 when nothing is left (then
    # nothing was appended), 1 otherwise.
    cdef int write_live(self, Writer *w, object v, int64_t deadline) except -1
    cdef int _write_list(self, Writer *w, object v, int64_t deadline, bint drop) except -1
    cdef int _write_map(self, Writer *w, object v, int64_t deadline, bint drop) except -1
    cdef int _element(self, Writer *w, object element, Py_ssize_t i, str what) except -1
    cdef int _map_key(self, Writer *w, object key, Py_ssize_t i) except -1


cdef class ValueReader:
    cdef readonly str state
    cdef readonly int kind      # FK_VALUE, FK_LIST or FK_MAP
    cdef readonly bint ttl
    cdef readonly str what      # how errors name the value: "a value", "a list value", "a map value"
    cdef readonly int value_how   # HOW_CODEC, HOW_NODE or HOW_PYTHON: what decodes the value, element, map value
    cdef readonly int key_how     # the same for a map's keys
    cdef object _value          # the Codec, the Node, or the serializer's deserialize
    cdef object _key

    cdef object _corrupt(self, object error, str what)
    # One framed state value of ``n`` bytes at ``p`` (held by ``owner``) -> the value (ValueFraming.decode).
    cdef object read(self, const uint8_t *p, Py_ssize_t n, object owner)
    cdef list _read_list(self, Cursor *c)
    cdef dict _read_map(self, Cursor *c)
