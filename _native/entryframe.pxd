# The one map-entry framing of keygroups: ``u32 key length | key bytes | value bytes``, little-endian, the value
# running to the end of the entry. Whatever holds the entry gives its length: an operator state element's boundaries
# (a broadcast map, splitter.pyx) or a keyed map value's frame (framing.pyx). Inline-only, like cursor.pxd and
# writer.pxd: cimport it by its bare name.
#
# (RocksDB's rows of a map state split an entry differently on purpose: the user key goes into the database key, so
# that one entry is one row; see keygroups/state/rocksdb.py.)
from libc.stdint cimport uint8_t
from cursor cimport Cursor, cur_read, cur_u32
from writer cimport Writer, w_bytes, w_len

cdef enum:
    ENTRY_HEAD = 4     # the key length


cdef inline int ent_write(Writer *w, const void *key, Py_ssize_t key_len, const void *value,
                          Py_ssize_t value_len) except -1:
    w_len(w, key_len, "a map key's length")
    w_bytes(w, key, key_len)
    return w_bytes(w, value, value_len)


cdef inline const uint8_t *ent_read_key(Cursor *c, Py_ssize_t *key_len) except NULL:
    """The entry's key (``c`` spans exactly the entry, and is left at its value: the rest of ``c``). A key length
    that overruns the entry raises CorruptSnapshotError."""
    key_len[0] = cur_u32(c)
    return cur_read(c, key_len[0])
