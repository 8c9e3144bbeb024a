# The keyed snapshot file format, compiled: block encoding for the writer, and the parsers for the header, the blocks
# and the key-group index for the reader.
#
# Layout (all integers little-endian; described in keygroups/checkpoint/format.py, which owns the version):
#   header  = magic "\x89KGS" | u32 version | u32 first key group | u32 key-group count | u32 meta length | meta JSON
#             | u32 crc32c(header so far)
#   block   = u32 key group | u32 flags (bit 0: full, bit 1: linked) | u64 predecessor checkpoint
#             | u32 predecessor checksum | u32 section count | section* | u32 crc32c(file id | block so far)
#             (one per key group; versions 2 and 3 had no predecessor and a crc32c of the block alone, version 1 no
#             flags either: every block was full)
#   section = u32 state index | u32 op (0 put, 1 delete) | u32 entry count n | u32 key length * n
#             | [u32 value length * n, puts only] | the n keys, back to back | [the n values, back to back, puts only]
#             (version 1: u32 state index | u32 n | key lengths | value lengths | keys | values; always a put)
#   index   = u32 offset count | u64 offset* | u32 crc32c(index so far)
#   footer  = u64 index position | magic "KGSI"
#
# Version 2 sorts every section's keys by their bytes (keysearch.pxd's order), so a key is found with a binary
# search, and checks that order when parsing. A block applies its sections in file order (the encoder writes puts,
# then deletes), each section its entries in order: of equal keys the last one counts. Version 3 has version 2's
# layout; what changed is inside the values (the per-key value framing, little-endian: framing.pyx), which this
# module never looks into. Keys are the key serializer's bytes as they are: their order is the search order.
#
# Version 4 ties each block to its file and to the block it applies on. Its checksum is the CRC32C of the file's
# 16-byte id (a random id in the header's meta and in the handle) followed by the block, computed by seeding the CRC
# with crc32c(file id) (``file_seed``): a block copied into another file, even a byte-identical one of a twin run,
# fails it. A delta block that continues an earlier block is *linked* (flag bit 1): it names that block, the
# checkpoint that wrote it and its checksum, so a chain that lacks a delta, or holds one of another lineage, is
# refused. An empty delta (no sections) is linked too: it changes nothing, and names the block its key group's chain
# ends with, so the newest file attests each chain's end. A full block and a delta that applies to no earlier block
# are not linked, their predecessor fields zero. The checksum of a linked block covers its predecessor's, so the
# newest block of a chain vouches for the whole chain.
#
# Every read of file bytes goes through the checked cursor (cursor.pxd), every count is checked against the bytes
# that remain before it sizes a list or a loop, and every failure is a CorruptSnapshotError. Keys and values come
# back as memoryview slices of the caller's buffer (bytes, mmap, ...) or bytes copies, or as int64 offset arrays
# into the block (keys, like values, are contiguous, so ``deserialize_many(block, offsets)`` can take them whole):
# nothing is deserialized here.
from cpython.buffer cimport PyObject_CheckBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy

cimport cython
cimport numpy as cnp

from cursor cimport Cursor, cur_corrupt, cur_count, cur_init, cur_read, cur_remaining, cur_u32, cur_u64
from javahash cimport KG_UPPER_BOUND_MAX_PARALLELISM
from indexsort cimport kg_sorted_order
from keysearch cimport kg_find_key, kg_key_cmp
from writer cimport U32_MAX, Writer, w_bytes, w_finish_bytes, w_init_bytes, w_u32, w_u64

import sys

import numpy as np
from crc32c import crc32c as _crc32c

cnp.import_array()

if sys.byteorder != "little":   # the cursor and the encoder copy integers in host order
    raise ImportError("keygroups._native.snapshot supports little-endian hosts only")

FILE_MAGIC = b"\x89KGS"
INDEX_MAGIC = b"KGSI"
cdef enum:
    VERSION = 4
    VERSION_3 = 3
    VERSION_2 = 2
    VERSION_1 = 1
    HEADER_FIXED = 20          # magic + version + first key group + count + meta length
    FOOTER = 12                # index position + magic
    BLOCK_MIN = 28             # key group + flags + predecessor (checkpoint, checksum) + section count + crc
    BLOCK_MIN_V2 = 16          # key group + flags + section count + crc (versions 2 and 3)
    BLOCK_MIN_V1 = 12          # key group + section count + crc
    PREDECESSOR_AT = 8         # where a version-4 block's predecessor fields start
    FLAG_FULL = 1
    FLAG_LINKED = 2
    OP_PUT_ = 0
    OP_DELETE_ = 1

FORMAT_VERSION = VERSION
#: The keyed file versions this module reads.
READ_VERSIONS = (VERSION_1, VERSION_2, VERSION_3, VERSION)
HEADER_FIXED_SIZE = HEADER_FIXED
FOOTER_SIZE = FOOTER
#: The size of an empty block (no sections) in the format written: a delta block of that size changes nothing.
BLOCK_OVERHEAD = BLOCK_MIN
#: The size of an empty block in each format read. No block of any of them that holds a section is as small as
#: ``BLOCK_OVERHEAD``: a block of at most that many bytes holds nothing, whatever its format.
BLOCK_OVERHEADS = {VERSION_1: BLOCK_MIN_V1, VERSION_2: BLOCK_MIN_V2, VERSION_3: BLOCK_MIN_V2, VERSION: BLOCK_MIN}
MAX_ITEM_SIZE = U32_MAX        # u32 lengths and counts
#: Block flag bit: the block holds every entry of its key group (else it holds the changes since the previous one).
BLOCK_FULL = FLAG_FULL
#: Block flag bit (format 4): the delta block names the block it applies on (its predecessor fields are set).
BLOCK_LINKED = FLAG_LINKED
#: Where a format-4 block's predecessor fields (u64 checkpoint id, u32 checksum) start, and where its flags are.
PREDECESSOR_OFFSET = PREDECESSOR_AT
FLAGS_OFFSET = 4
#: Section ops: a put section holds keys and values, a delete section keys only.
OP_PUT = OP_PUT_
OP_DELETE = OP_DELETE_

cdef bytes _FILE_MAGIC = FILE_MAGIC
cdef bytes _INDEX_MAGIC = INDEX_MAGIC
cdef Py_ssize_t SECTION_MIN_V1 = 8    # state index + entry count
cdef Py_ssize_t SECTION_MIN = 12      # state index + op + entry count
cdef Py_ssize_t ENTRY_MIN = 8         # key length + value length
cdef Py_ssize_t DELETE_ENTRY_MIN = 4  # key length


cdef object _as_byte_view(object buffer):
    """A 1-D unsigned-byte memoryview of any C-contiguous buffer (read-only ones included)."""
    cdef object mv = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
    if mv.ndim != 1 or mv.format != "B":
        if not mv.c_contiguous:
            raise TypeError("a snapshot buffer must be C-contiguous")
        mv = mv.cast("B")
    return mv


cdef uint32_t _checked_u32(object value, str what) except? 0xFFFFFFFF:
    """A Python int as u32, or a ValueError naming the value and the bounds."""
    if not 0 <= value <= MAX_ITEM_SIZE:
        raise ValueError(f"{what} must be in [0, {MAX_ITEM_SIZE}], got {value!r}")
    return <uint32_t>value


cdef list _byte_items(object seq, str what):
    """seq as a list of bytes objects (bytes-like items are copied once; anything else is a TypeError)."""
    cdef list items = seq if type(seq) is list else list(seq)
    cdef Py_ssize_t i, n = len(items)
    cdef object x
    cdef list out = None
    for i in range(n):
        x = items[i]
        if PyBytes_CheckExact(x):
            if out is not None:
                out.append(x)
            continue
        if not PyObject_CheckBuffer(x) or isinstance(x, str):
            raise TypeError(f"{what} {i} must be bytes (a serialized value), got {type(x).__name__}")
        if out is None:
            out = items[:i]
        out.append(memoryview(x).tobytes())
    return items if out is None else out


cdef class Packed:
    """n serialized items packed back to back, as a serializer's ``serialize_many`` returns them: item i is
    ``data[offsets[i]:offsets[i + 1]]``. Hand it to the writer instead of a list of n bytes objects."""

    cdef readonly object data
    cdef readonly object offsets
    cdef const uint8_t[::1] _bytes
    cdef const int64_t[::1] _offsets

    def __init__(self, data, offsets):
        arr = np.asarray(offsets)
        if arr.ndim != 1 or arr.shape[0] < 1 or arr.dtype.kind not in "iu" or (
                arr.dtype.kind == "u" and arr.dtype.itemsize == 8):
            raise TypeError(f"offsets must be a 1-D int array (int64 or narrower) of n + 1 positions, got "
                            f"{arr.dtype} of shape {arr.shape}")
        arr = np.ascontiguousarray(arr, dtype=np.int64)
        view = _as_byte_view(data)
        self._bytes = view
        self._offsets = arr
        cdef Py_ssize_t n = arr.shape[0] - 1, size = view.shape[0], i
        cdef int64_t a, b
        for i in range(n + 1):
            a = self._offsets[i]
            if a < 0 or a > size:
                raise ValueError(f"offsets[{i}] = {a} is outside the {size} bytes of data")
        for i in range(n):
            a = self._offsets[i]
            b = self._offsets[i + 1]
            if b < a or b - a > U32_MAX:
                raise ValueError(f"item {i} spans offsets [{a}, {b}): offsets must ascend and an item is at most "
                                 f"{MAX_ITEM_SIZE} bytes")
        self.data = data
        self.offsets = arr

    def __len__(self):
        return self._offsets.shape[0] - 1


@cython.auto_pickle(False)
cdef class _Items:
    """The n items of one part of a section (keys or values: a Packed, or a list of bytes the caller keeps alive) as
    C pointers and lengths, and, for keys, the stable order that sorts them (NULL when they already are sorted)."""

    cdef Py_ssize_t n
    cdef const uint8_t **ptr
    cdef uint32_t *length
    cdef Py_ssize_t *order
    cdef uint64_t total
    cdef object part          # keeps the bytes alive
    cdef bint packed

    def __dealloc__(self):
        PyMem_Free(self.ptr)
        PyMem_Free(self.length)
        PyMem_Free(self.order)


cdef _Items _items(object part, str what):
    cdef _Items it = _Items.__new__(_Items)
    cdef Packed pk
    cdef list items
    cdef Py_ssize_t i, n, ln
    cdef const uint8_t *base = NULL
    cdef object item
    it.part = part
    it.packed = isinstance(part, Packed)
    n = len(<Packed>part) if it.packed else len(<list>part)
    it.n = n
    it.ptr = <const uint8_t **>PyMem_Malloc((n + 1) * sizeof(const uint8_t *))
    it.length = <uint32_t *>PyMem_Malloc((n + 1) * sizeof(uint32_t))
    if it.ptr == NULL or it.length == NULL:
        raise MemoryError(f"cannot index {n} {what}s")
    it.total = 0
    if it.packed:
        pk = <Packed>part
        if pk._bytes.shape[0] > 0:
            base = &pk._bytes[0]
        for i in range(n):
            it.ptr[i] = base + pk._offsets[i] if base != NULL else NULL
            it.length[i] = <uint32_t>(pk._offsets[i + 1] - pk._offsets[i])   # checked <= U32_MAX by Packed
            it.total += it.length[i]
        return it
    items = <list>part
    for i in range(n):
        item = items[i]
        ln = PyBytes_GET_SIZE(item)
        if ln > U32_MAX:
            raise ValueError(f"{what} {i} is {ln} bytes long; a key or value is at most {U32_MAX} bytes")
        it.ptr[i] = <const uint8_t *>PyBytes_AS_STRING(item)
        it.length[i] = <uint32_t>ln
        it.total += <uint64_t>ln
    return it


ctypedef struct _KeyList:
    const uint8_t **ptr
    const uint32_t *length


cdef int _key_order(const void *items, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    cdef const _KeyList *k = <const _KeyList *>items
    return kg_key_cmp(k.ptr[a], k.length[a], k.ptr[b], k.length[b])


cdef int _sort_keys(_Items keys) except -1:
    """Set ``keys.order`` to the stable order that sorts the keys (left NULL when they already are sorted)."""
    cdef Py_ssize_t n = keys.n, i
    cdef _KeyList view
    view.ptr = keys.ptr
    view.length = keys.length
    for i in range(1, n):
        if _key_order(&view, i - 1, i) > 0:
            break
    else:
        return 0
    keys.order = kg_sorted_order(n, _key_order, &view)
    return 0


cdef int _put_block_head(Writer *w, uint32_t key_group, uint32_t flags, uint64_t pred_checkpoint,
                         uint32_t pred_checksum) except -1:
    """A format-4 block's head: its key group, flags and the block it continues (checkpoint id, checksum; 0 and 0
    for none). The section count follows."""
    w_u32(w, key_group)
    w_u32(w, flags)
    w_u64(w, pred_checkpoint)
    w_u32(w, pred_checksum)
    return 0


cdef int _put_lengths(Writer *w, _Items it, const Py_ssize_t *order) except -1:
    cdef Py_ssize_t i
    for i in range(it.n):
        w_u32(w, it.length[order[i] if order != NULL else i])
    return 0


cdef int _put_data(Writer *w, _Items it, const Py_ssize_t *order) except -1:
    cdef Py_ssize_t i, j
    cdef Packed pk
    if order == NULL and it.packed:   # one copy of the whole run
        pk = <Packed>it.part
        if it.total:
            w_bytes(w, &pk._bytes[pk._offsets[0]], <Py_ssize_t>it.total)
        return 0
    for i in range(it.n):
        j = order[i] if order != NULL else i
        w_bytes(w, it.ptr[j], it.length[j])
    return 0


cdef uint32_t _state_index(object idx_obj, uint32_t n_states) except? 0xFFFFFFFF:
    if isinstance(idx_obj, bool) or not isinstance(idx_obj, int) or not 0 <= idx_obj < n_states:
        raise ValueError(f"state_index must be an int in [0, {n_states}) (the states given to the writer), "
                         f"got {idx_obj!r}")
    return <uint32_t>idx_obj


def encode_block(uint32_t key_group, object sections, uint32_t n_states, *, bint full=True, object deletes=(),
                 object predecessor=None, uint32_t file_seed=0, uint32_t version=VERSION):
    """One key group's block (format 4, with its trailing CRC32C) as bytes; ``version=3`` (or 2, the same layout)
    writes the older layout, without predecessor fields and with a checksum of the block alone, for tools and tests
    that make files of those formats.

    ``sections`` is an iterable of put sections ``(state_index, keys, values)``: ``keys`` and ``values`` are equally
    long sequences of bytes-like objects, or :class:`Packed`; ``state_index < n_states``. ``full`` says whether the
    block holds every entry of its key group (else it is a delta: the entries written since the previous block, and
    ``deletes``, an iterable of ``(state_index, keys)`` removed since then; a full block has no deletes). Every
    section's entries are sorted by key bytes here (stably: of equal keys the last one given counts), so callers
    need not sort.

    ``predecessor``, for a delta block that continues an earlier block, is ``(checkpoint id, checksum)`` of that
    block: the block is then linked (names it), an empty one too (it leaves that block as the chain's end); a delta
    block without one applies to no earlier block. ``file_seed`` is ``crc32c(file id)`` of the file the
    block goes into: the block's checksum covers the file's id (0: no id, for blocks that are not part of a file).
    Raises ValueError/TypeError on bad input."""
    cdef uint64_t pred_checkpoint = 0
    cdef uint32_t pred_checksum = 0, flags = FLAG_FULL if full else 0
    cdef list secs = []     # (state index, op, keys, values or None)
    if version != VERSION and version != VERSION_3 and version != VERSION_2:
        raise ValueError(f"version must be {VERSION_2}, {VERSION_3} or {VERSION} (format 1 is read only), got "
                         f"{version}")
    if version != VERSION and (predecessor is not None or file_seed):
        raise ValueError(f"a block of format {version} names no predecessor and its checksum covers no file id")
    cdef object sec, keys, values
    cdef _Items k_items, v_items
    cdef uint32_t idx
    cdef uint64_t total = BLOCK_MIN if version == VERSION else BLOCK_MIN_V2
    for sec in sections:
        if not isinstance(sec, tuple) or len(sec) != 3:
            raise TypeError(f"a section is a (state_index, keys, values) tuple, got {sec!r:.80}")
        idx = _state_index(sec[0], n_states)
        keys = sec[1] if isinstance(sec[1], Packed) else _byte_items(sec[1], "key")
        values = sec[2] if isinstance(sec[2], Packed) else _byte_items(sec[2], "value")
        k_items = _items(keys, "key")
        v_items = _items(values, "value")
        if k_items.n != v_items.n:
            raise ValueError(f"state {idx}: {k_items.n} keys but {v_items.n} values; they must pair up")
        _checked_u32(k_items.n, "the number of entries of a state in one key group")
        total += SECTION_MIN + 8 * <uint64_t>k_items.n + k_items.total + v_items.total
        secs.append((idx, OP_PUT_, k_items, v_items))
    for sec in deletes:
        if full:
            raise ValueError("a full block holds every entry of its key group: it has no deletes (a deleted key is "
                             "simply absent); pass full=False for a delta block")
        if not isinstance(sec, tuple) or len(sec) != 2:
            raise TypeError(f"a delete section is a (state_index, keys) tuple, got {sec!r:.80}")
        idx = _state_index(sec[0], n_states)
        keys = sec[1] if isinstance(sec[1], Packed) else _byte_items(sec[1], "key")
        k_items = _items(keys, "deleted key")
        _checked_u32(k_items.n, "the number of deleted keys of a state in one key group")
        total += SECTION_MIN + 4 * <uint64_t>k_items.n + k_items.total
        secs.append((idx, OP_DELETE_, k_items, None))
    _checked_u32(len(secs), "the number of sections in one key group")
    if predecessor is not None:
        if full:
            raise ValueError("a full block applies on no earlier block: it has no predecessor")
        if (not isinstance(predecessor, tuple) or len(predecessor) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in predecessor)
                or not 0 <= predecessor[0] < 2 ** 63 or not 0 <= predecessor[1] <= U32_MAX):
            raise ValueError(f"predecessor must be (checkpoint id >= 0, u32 checksum), got {predecessor!r:.80}")
        pred_checkpoint = <uint64_t>predecessor[0]
        pred_checksum = <uint32_t>predecessor[1]
        flags |= FLAG_LINKED
    if total > <uint64_t>sys.maxsize:
        raise ValueError(f"the block of key group {key_group} would be {total} bytes long")
    for sec in secs:
        _sort_keys(<_Items>sec[2])

    cdef Writer w
    cdef bytes out = w_init_bytes(&w, <Py_ssize_t>total)
    if version == VERSION:
        _put_block_head(&w, key_group, flags, pred_checkpoint, pred_checksum)
    else:
        w_u32(&w, key_group)
        w_u32(&w, flags)
    w_u32(&w, <uint32_t>len(secs))
    for sec in secs:
        k_items = <_Items>sec[2]
        w_u32(&w, <uint32_t>sec[0])
        w_u32(&w, <uint32_t>sec[1])
        w_u32(&w, <uint32_t>k_items.n)
        _put_lengths(&w, k_items, k_items.order)
        if sec[3] is not None:
            _put_lengths(&w, <_Items>sec[3], k_items.order)
        _put_data(&w, k_items, k_items.order)
        if sec[3] is not None:
            _put_data(&w, <_Items>sec[3], k_items.order)
    # The bytes object is still private to us: fill in its checksum in place.
    w_u32(&w, <uint32_t>_crc32c(memoryview(out)[:<Py_ssize_t>total - 4], file_seed))
    w_finish_bytes(&w)
    return out


def find_key(object buffer, object key_offsets, object key):
    """Index of ``key`` (bytes-like) among a sorted section's keys ``buffer[key_offsets[i]:key_offsets[i + 1]]``
    (a format-2 section, as :func:`parse_block_offsets` gives them), the last one if several are equal; -1 if it
    is absent. A binary search over the raw bytes: nothing is decoded, and nothing outside ``buffer`` is read
    (offsets that point outside it raise CorruptSnapshotError)."""
    cdef const uint8_t[::1] data = _as_byte_view(buffer)
    cdef const int64_t[::1] offsets = key_offsets
    cdef const uint8_t[::1] k = _as_byte_view(key)
    cdef Py_ssize_t n = offsets.shape[0] - 1, found
    cdef const uint8_t *buf = &data[0] if data.shape[0] else NULL
    cdef const uint8_t *kp = &k[0] if k.shape[0] else NULL
    if n < 0:
        raise ValueError("key_offsets must hold n + 1 positions (at least one)")
    with nogil:
        found = kg_find_key(buf, data.shape[0], &offsets[0], n, kp, k.shape[0])
    if found == -2:
        from keygroups.errors import CorruptSnapshotError
        raise CorruptSnapshotError(f"key offsets point outside the {data.shape[0]}-byte block they index")
    return found


cdef extern from "Python.h":
    void PyObject_GC_Track(object)
    void PyObject_GC_UnTrack(object)
    int PyGC_Enable()
    int PyGC_Disable()


cdef inline uint32_t _u32_at(const uint8_t *p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v


cdef uint64_t _sum_lengths(const uint8_t *lengths, Py_ssize_t n, uint64_t limit) noexcept nogil:
    # Stops as soon as the sum passes ``limit`` (so it cannot overflow: each term is < 2^32).
    cdef uint64_t total = 0
    cdef Py_ssize_t i
    for i in range(n):
        total += _u32_at(lengths + 4 * i)
        if total > limit:
            break
    return total


cdef void _offsets_from_lengths(const uint8_t *lengths, Py_ssize_t n, int64_t start, int64_t *out) noexcept nogil:
    cdef Py_ssize_t i
    out[0] = start
    for i in range(n):
        out[i + 1] = out[i] + _u32_at(lengths + 4 * i)


cdef Py_ssize_t _first_unsorted(const uint8_t *base, const uint8_t *lengths, Py_ssize_t n,
                                Py_ssize_t pos) noexcept nogil:
    """The first i whose key sorts before key i - 1 (keys back to back from ``pos``, already bounds-checked);
    -1 if they ascend."""
    cdef Py_ssize_t i, prev_at = pos, prev_len, ln
    if n == 0:
        return -1
    prev_len = _u32_at(lengths)
    pos += prev_len
    for i in range(1, n):
        ln = _u32_at(lengths + 4 * i)
        if kg_key_cmp(base + prev_at, prev_len, base + pos, ln) > 0:
            return i
        prev_at = pos
        prev_len = ln
        pos += ln
    return -1


cdef struct Section:
    uint32_t state_index
    uint32_t op
    Py_ssize_t n
    const uint8_t *key_lengths     # n u32
    const uint8_t *value_lengths   # n u32 (NULL for a delete section)
    Py_ssize_t keys_at             # position of the first key in the block
    Py_ssize_t values_at           # position of the first value in the block


cdef int _read_section(Cursor *c, uint32_t n_states, uint32_t version, Section *sec) except -1:
    """One section's header and length arrays, checked: every key and value lies inside the section, and (since
    format 2) the op is known and the keys ascend."""
    cdef uint64_t key_bytes, value_bytes
    cdef Py_ssize_t bad
    sec.state_index = cur_u32(c)
    if sec.state_index >= n_states:
        cur_corrupt(c, f"state index {sec.state_index} (the snapshot has {n_states} states)")
    sec.op = OP_PUT_
    if version != VERSION_1:
        sec.op = cur_u32(c)
        if sec.op != OP_PUT_ and sec.op != OP_DELETE_:
            cur_corrupt(c, f"section op {sec.op} (0 is a put, 1 a delete)")
    sec.n = cur_count(c, ENTRY_MIN if sec.op == OP_PUT_ else DELETE_ENTRY_MIN, "entry")
    sec.key_lengths = cur_read(c, 4 * sec.n)
    sec.value_lengths = cur_read(c, 4 * sec.n) if sec.op == OP_PUT_ else NULL
    key_bytes = _sum_lengths(sec.key_lengths, sec.n, <uint64_t>cur_remaining(c))
    if key_bytes > <uint64_t>cur_remaining(c):
        cur_corrupt(c, f"{sec.n} keys of more than the {cur_remaining(c)} bytes left")
    sec.keys_at = c.pos
    cur_read(c, <Py_ssize_t>key_bytes)
    if version != VERSION_1:
        with nogil:
            bad = _first_unsorted(c.buf, sec.key_lengths, sec.n, sec.keys_at)
        if bad >= 0:
            cur_corrupt(c, f"key {bad} of a section of state {sec.state_index} sorting before key {bad - 1} (keys "
                           f"are sorted since format 2)")
    sec.values_at = c.pos
    if sec.op == OP_PUT_:
        value_bytes = _sum_lengths(sec.value_lengths, sec.n, <uint64_t>cur_remaining(c))
        if value_bytes > <uint64_t>cur_remaining(c):
            cur_corrupt(c, f"{sec.n} values of more than the {cur_remaining(c)} bytes left")
        cur_read(c, <Py_ssize_t>value_bytes)
    return 0


cdef Py_ssize_t _block_min(uint32_t version) except -1:
    if version == VERSION:
        return BLOCK_MIN
    if version == VERSION_3 or version == VERSION_2:
        return BLOCK_MIN_V2
    if version == VERSION_1:
        return BLOCK_MIN_V1
    raise ValueError(f"version must be one of {READ_VERSIONS}, got {version}")


cdef object _check_block(object buffer, uint32_t expected_key_group, bint verify_checksum, uint32_t version,
                         Cursor *c, uint32_t *flags, uint32_t file_seed):
    """The block as a byte memoryview, its checksum verified (seeded with ``file_seed`` in format 4), ``flags`` read
    (format 1: full) and, in format 4, its predecessor fields checked against them; ``c`` positioned at the section
    count, over the block without its CRC."""
    cdef object mv = _as_byte_view(buffer)
    cdef const uint8_t[::1] data = mv
    cdef Py_ssize_t size = data.shape[0]
    cdef Py_ssize_t minimum = _block_min(version)
    cdef uint32_t stored, kg, pred_checksum
    cdef uint64_t pred_checkpoint
    if size < minimum:
        from keygroups.errors import CorruptSnapshotError
        raise CorruptSnapshotError(f"the block of key group {expected_key_group} is {size} bytes long, shorter than "
                                   f"the {minimum}-byte minimum: the data is truncated or corrupt")
    # Checksum first: a flipped length byte is reported as a checksum failure, not as a strange length.
    cur_init(c, &data[0], size)
    c.pos = size - 4
    stored = cur_u32(c)
    if verify_checksum and stored != <uint32_t>_crc32c(mv[:size - 4], file_seed if version == VERSION else 0):
        from keygroups.errors import CorruptSnapshotError
        raise CorruptSnapshotError(f"the block of key group {expected_key_group} fails its CRC32C checksum "
                                   f"({size} bytes): the snapshot file is corrupt"
                                   + (", or the block was written for another file (a format-4 checksum covers "
                                      "the id of the file it was written for)" if version == VERSION else ""))
    cur_init(c, &data[0], size - 4)
    kg = cur_u32(c)
    if kg != expected_key_group:
        cur_corrupt(c, f"a block of key group {kg} where key group {expected_key_group} belongs")
    flags[0] = FLAG_FULL
    if version == VERSION:
        flags[0] = cur_u32(c)
        if flags[0] & ~(<uint32_t>(FLAG_FULL | FLAG_LINKED)):
            cur_corrupt(c, f"block flags {flags[0]:#x} (only bit 0, full, and bit 1, linked, are defined)")
        if flags[0] & FLAG_FULL and flags[0] & FLAG_LINKED:
            cur_corrupt(c, f"a full block of key group {expected_key_group} linked to a predecessor (a full block "
                           "applies on no earlier block)")
        pred_checkpoint = cur_u64(c)
        pred_checksum = cur_u32(c)
        if not flags[0] & FLAG_LINKED and (pred_checkpoint or pred_checksum):
            cur_corrupt(c, f"predecessor fields set in an unlinked block of key group {expected_key_group}")
    elif version != VERSION_1:
        flags[0] = cur_u32(c)
        if flags[0] & ~(<uint32_t>FLAG_FULL):
            cur_corrupt(c, f"block flags {flags[0]:#x} (only bit 0, full, is defined)")
    return mv


cdef int _check_op(Cursor *c, uint32_t flags, const Section *sec, uint32_t key_group) except -1:
    if sec.op == OP_DELETE_ and flags & FLAG_FULL:
        cur_corrupt(c, f"a delete section in the full block of key group {key_group}")
    return 0


cdef inline object _piece(object mv, const uint8_t *base, Py_ssize_t pos, Py_ssize_t ln, bint copy):
    # A view of the caller's buffer (keeps it alive), or a bytes copy (cheaper to create and to hold when small).
    if copy:
        return PyBytes_FromStringAndSize(<const char *>(base + pos), ln)
    return mv[pos:pos + ln]


cdef list _pieces(object mv, const uint8_t *base, const uint8_t *lengths, Py_ssize_t n, Py_ssize_t pos, bint copy):
    cdef list out = PyList_New(n)
    cdef Py_ssize_t i, ln
    cdef object piece
    # Untracked while half filled (NULL items); tracked again once complete.
    PyObject_GC_UnTrack(out)
    try:
        for i in range(n):
            ln = _u32_at(lengths + 4 * i)
            piece = _piece(mv, base, pos, ln, copy)
            Py_INCREF(piece)
            PyList_SET_ITEM(out, i, piece)
            pos += ln
    finally:
        PyObject_GC_Track(out)
    return out


def parse_block(object buffer, uint32_t expected_key_group, uint32_t n_states, bint verify_checksum=True,
                bint copy=False, uint32_t version=VERSION, uint32_t file_seed=0):
    """Parse one block of a file of format ``version`` (the exact bytes from its offset to the next one, CRC
    included).

    Returns ``(flags, puts, deletes)``: ``puts`` is ``[(state_index, keys, values), ...]`` and ``deletes``
    ``[(state_index, keys), ...]``, in file order, with keys/values as memoryview slices of ``buffer`` (or, with
    ``copy=True``, as bytes copies); ``flags & BLOCK_FULL`` is set for a full block (always in format 1). Any
    mismatch (checksum, key group, unknown flags or op, a state index >= n_states, a length past the block, keys
    out of order, trailing bytes) raises CorruptSnapshotError. ``file_seed`` is ``crc32c(file id)`` of the file a
    format-4 block belongs to (its checksum covers the id). ``verify_checksum=False`` skips the CRC, for a block
    whose checksum was verified already (``format.py`` checks a whole ranged read first) or to fuzz the structural
    checks behind it."""
    cdef Cursor c
    cdef Section sec
    cdef uint32_t flags
    cdef Py_ssize_t n_sections, s
    cdef list puts = [], deletes = []
    cdef object mv = _check_block(buffer, expected_key_group, verify_checksum, version, &c, &flags, file_seed)
    cdef const uint8_t *base = c.buf
    n_sections = cur_count(&c, SECTION_MIN_V1 if version == VERSION_1 else SECTION_MIN, "section")
    # The pieces cannot form reference cycles, yet each (memoryviews are GC-tracked) counts towards the cyclic
    # collector's thresholds, and collections during a large block multiply the parse time. Pause it; restore it.
    cdef int gc_was_enabled = PyGC_Disable()
    try:
        for s in range(n_sections):
            _read_section(&c, n_states, version, &sec)
            _check_op(&c, flags, &sec, expected_key_group)
            if sec.op == OP_PUT_:
                puts.append((sec.state_index,
                             _pieces(mv, base, sec.key_lengths, sec.n, sec.keys_at, copy),
                             _pieces(mv, base, sec.value_lengths, sec.n, sec.values_at, copy)))
            else:
                deletes.append((sec.state_index, _pieces(mv, base, sec.key_lengths, sec.n, sec.keys_at, copy)))
    finally:
        if gc_was_enabled:
            PyGC_Enable()
    if cur_remaining(&c) != 0:
        cur_corrupt(&c, f"{cur_remaining(&c)} unexpected trailing bytes in the block of key group "
                        f"{expected_key_group}")
    return flags, puts, deletes


def parse_block_offsets(object buffer, uint32_t expected_key_group, uint32_t n_states, bint verify_checksum=True,
                        uint32_t version=VERSION, uint32_t file_seed=0):
    """Parse one block into offset arrays instead of objects: ``(flags, puts, deletes)`` with ``puts``
    ``[(state_index, key_offsets, value_offsets), ...]`` and ``deletes`` ``[(state_index, key_offsets), ...]``,
    each an int64 array of n + 1 positions in ``buffer``, so key i is ``buffer[key_offsets[i]:key_offsets[i + 1]]``
    (keys are contiguous, as are values: a serializer's ``deserialize_many(buffer, offsets)`` takes them whole; in
    formats 2 to 4 they are sorted, for :func:`find_key`). Same checks and errors as :func:`parse_block`."""
    cdef Cursor c
    cdef Section sec
    cdef uint32_t flags
    cdef Py_ssize_t n_sections, s
    cdef list puts = [], deletes = []
    cdef cnp.ndarray ko, vo
    cdef object mv = _check_block(buffer, expected_key_group, verify_checksum, version, &c, &flags, file_seed)
    n_sections = cur_count(&c, SECTION_MIN_V1 if version == VERSION_1 else SECTION_MIN, "section")
    for s in range(n_sections):
        _read_section(&c, n_states, version, &sec)
        _check_op(&c, flags, &sec, expected_key_group)
        ko = np.empty(sec.n + 1, dtype=np.int64)
        with nogil:
            _offsets_from_lengths(sec.key_lengths, sec.n, sec.keys_at, <int64_t *>cnp.PyArray_DATA(ko))
        if sec.op == OP_PUT_:
            vo = np.empty(sec.n + 1, dtype=np.int64)
            with nogil:
                _offsets_from_lengths(sec.value_lengths, sec.n, sec.values_at, <int64_t *>cnp.PyArray_DATA(vo))
            puts.append((sec.state_index, ko, vo))
        else:
            deletes.append((sec.state_index, ko))
    if cur_remaining(&c) != 0:
        cur_corrupt(&c, f"{cur_remaining(&c)} unexpected trailing bytes in the block of key group "
                        f"{expected_key_group}")
    return flags, puts, deletes


def encode_empty_blocks(uint32_t first_key_group, bint full, const int64_t[::1] pred_checkpoints,
                        const int64_t[::1] pred_checksums, uint32_t file_seed=0):
    """The empty blocks (format 4, no sections) of ``len(pred_checkpoints)`` consecutive key groups from
    ``first_key_group``, back to back, as bytes of :data:`BLOCK_OVERHEAD` each, and the checksum each stores (a
    uint32 array): one call for a file's untouched key groups, not one :func:`encode_block` each. ``full`` makes
    them full blocks (whose ``pred_checkpoints`` must all be -1), else empty deltas; delta ``i`` is linked to
    ``(pred_checkpoints[i], pred_checksums[i])`` where ``pred_checkpoints[i] >= 0``, and names nothing where it is
    -1 (its checksum then 0). The bytes equal those of :func:`encode_block` for each key group.
    ValueError/TypeError on bad input."""
    cdef Py_ssize_t n = pred_checkpoints.shape[0], i
    cdef int64_t cp, ck
    if pred_checksums.shape[0] != n:
        raise ValueError(f"pred_checkpoints and pred_checksums must be equally long, got {n} and "
                         f"{pred_checksums.shape[0]}")
    if <uint64_t>first_key_group + <uint64_t>n > KG_UPPER_BOUND_MAX_PARALLELISM:
        raise ValueError(f"key groups [{first_key_group}, {<uint64_t>first_key_group + n}) past Flink's "
                         f"{KG_UPPER_BOUND_MAX_PARALLELISM}")
    for i in range(n):
        cp = pred_checkpoints[i]
        ck = pred_checksums[i]
        if cp < -1 or (cp == -1 and ck != 0) or ck < 0 or ck > <int64_t>U32_MAX or (full and cp != -1):
            raise ValueError(f"the predecessor of key group {first_key_group + i} must be (checkpoint id >= 0, u32 "
                             f"checksum), or (-1, 0) for none (a full block names none), got ({cp}, {ck})")
    checksums = np.empty(n, dtype=np.uint32)
    cdef uint32_t[::1] out_checksums = checksums
    cdef Writer w
    cdef bytes out = w_init_bytes(&w, BLOCK_MIN * n)
    cdef object view = memoryview(out)
    cdef uint32_t crc
    for i in range(n):
        cp = pred_checkpoints[i]
        _put_block_head(&w, first_key_group + <uint32_t>i, FLAG_FULL if full else (FLAG_LINKED if cp >= 0 else 0),
                        <uint64_t>cp if cp >= 0 else 0, <uint32_t>pred_checksums[i])
        w_u32(&w, 0)   # no sections
        crc = <uint32_t>_crc32c(view[BLOCK_MIN * i:BLOCK_MIN * (i + 1) - 4], file_seed)
        w_u32(&w, crc)
        out_checksums[i] = crc
    w_finish_bytes(&w)
    return out, checksums


def encode_header(uint32_t first_key_group, uint32_t key_group_count, bytes meta):
    """The file header (magic, version :data:`FORMAT_VERSION`, range, meta JSON, CRC32C) as bytes."""
    cdef Py_ssize_t ln = PyBytes_GET_SIZE(meta)
    _checked_u32(ln, "the state meta JSON's length")
    cdef Writer w
    cdef bytes out = w_init_bytes(&w, HEADER_FIXED + ln + 4)
    w_bytes(&w, PyBytes_AS_STRING(_FILE_MAGIC), 4)
    w_u32(&w, VERSION)
    w_u32(&w, first_key_group)
    w_u32(&w, key_group_count)
    w_u32(&w, <uint32_t>ln)
    w_bytes(&w, PyBytes_AS_STRING(meta), ln)
    w_u32(&w, <uint32_t>_crc32c(memoryview(out)[:HEADER_FIXED + ln]))
    w_finish_bytes(&w)
    return out


def parse_header(object buffer):
    """``(version, first_key_group, key_group_count, meta_json_bytes, header_size)`` from the start of a file.

    CorruptSnapshotError on a wrong magic, an unknown version, a truncation or a checksum failure."""
    cdef object mv = _as_byte_view(buffer)
    cdef const uint8_t[::1] data = mv
    cdef Cursor c
    cdef const uint8_t *magic
    cdef uint32_t version, first, count, stored
    cdef Py_ssize_t meta_len, meta_pos
    if data.shape[0] == 0:
        from keygroups.errors import CorruptSnapshotError
        raise CorruptSnapshotError("the snapshot file is empty")
    cur_init(&c, &data[0], data.shape[0])
    magic = cur_read(&c, 4)
    if (<const char *>magic)[:4] != FILE_MAGIC:
        cur_corrupt(&c, f"magic {(<const char *>magic)[:4]!r} (a keyed snapshot starts with {FILE_MAGIC!r})")
    version = cur_u32(&c)
    if version != VERSION and version != VERSION_3 and version != VERSION_2 and version != VERSION_1:
        cur_corrupt(&c, f"format version {version} (this keygroups reads versions {READ_VERSIONS})")
    first = cur_u32(&c)
    count = cur_u32(&c)
    meta_len = cur_u32(&c)
    meta_pos = c.pos
    cur_read(&c, meta_len)
    stored = cur_u32(&c)
    if stored != <uint32_t>_crc32c(mv[:c.pos - 4]):
        cur_corrupt(&c, "a header that fails its CRC32C checksum")
    if <uint64_t>first + <uint64_t>count > KG_UPPER_BOUND_MAX_PARALLELISM:
        cur_corrupt(&c, f"key groups [{first}, {<uint64_t>first + count}) past Flink's "
                        f"{KG_UPPER_BOUND_MAX_PARALLELISM}")
    return version, first, count, bytes(mv[meta_pos:meta_pos + meta_len]), c.pos


def encode_index(list offsets):
    """The index (offset count, u64 offsets, CRC32C) followed by the footer (index position, magic).

    ``offsets[-1]`` is where the index starts (the end of the last block)."""
    cdef Py_ssize_t n = len(offsets), i
    _checked_u32(n, "the number of offsets")
    cdef Py_ssize_t size = 4 + 8 * n + 4 + FOOTER
    cdef Writer w
    cdef bytes out = w_init_bytes(&w, size)
    w_u32(&w, <uint32_t>n)
    for i in range(n):
        w_u64(&w, <uint64_t>offsets[i])
    w_u32(&w, <uint32_t>_crc32c(memoryview(out)[:4 + 8 * n]))
    w_u64(&w, <uint64_t>offsets[n - 1] if n else 0)
    w_bytes(&w, PyBytes_AS_STRING(_INDEX_MAGIC), 4)
    w_finish_bytes(&w)
    return out


def parse_index(object buffer, Py_ssize_t header_size, uint32_t key_group_count):
    """The per-key-group offsets (``key_group_count + 1`` ints) from a whole file's index and footer.

    Checks the footer magic, the index checksum, the count, and that offsets ascend from ``header_size`` to the
    index position; CorruptSnapshotError otherwise."""
    cdef object mv = _as_byte_view(buffer)
    cdef const uint8_t[::1] data = mv
    cdef Py_ssize_t size = data.shape[0]
    cdef Cursor c
    cdef const uint8_t *magic
    cdef uint64_t index_pos, v, prev
    cdef Py_ssize_t n, i, start
    cdef uint32_t stored
    cdef list offsets
    cdef object piece
    if size < FOOTER:
        from keygroups.errors import CorruptSnapshotError
        raise CorruptSnapshotError(f"the snapshot file is {size} bytes long, too short for its "
                                   f"{FOOTER}-byte footer: it is truncated")
    cur_init(&c, &data[0], size)
    c.pos = size - FOOTER
    index_pos = cur_u64(&c)
    magic = cur_read(&c, 4)
    if (<const char *>magic)[:4] != INDEX_MAGIC:
        cur_corrupt(&c, f"footer magic {(<const char *>magic)[:4]!r} (expected {INDEX_MAGIC!r}); the file is "
                        f"truncated or not a keyed snapshot")
    if index_pos < <uint64_t>header_size or index_pos > <uint64_t>(size - FOOTER):
        cur_corrupt(&c, f"index position {index_pos} outside [{header_size}, {size - FOOTER}]")
    start = <Py_ssize_t>index_pos
    cur_init(&c, &data[0], size - FOOTER)
    c.pos = start
    n = cur_count(&c, 8, "offset")
    if n != <Py_ssize_t>key_group_count + 1:
        cur_corrupt(&c, f"{n} offsets in the index for {key_group_count} key groups (expected "
                        f"{<Py_ssize_t>key_group_count + 1})")
    offsets = PyList_New(n)
    prev = <uint64_t>header_size
    for i in range(n):
        v = cur_u64(&c)
        if v < prev or v > index_pos:
            cur_corrupt(&c, f"offset {i} = {v} outside [{prev}, {index_pos}]: offsets must ascend within the file")
        prev = v
        piece = v
        Py_INCREF(piece)
        PyList_SET_ITEM(offsets, i, piece)
    stored = cur_u32(&c)
    if stored != <uint32_t>_crc32c(mv[start:c.pos - 4]):
        cur_corrupt(&c, "an index that fails its CRC32C checksum")
    if cur_remaining(&c) != 0:
        cur_corrupt(&c, f"{cur_remaining(&c)} unexpected bytes between the index and the footer")
    if n and offsets[0] != header_size:
        cur_corrupt(&c, f"the first block at {offsets[0]}, not right after the {header_size}-byte header")
    if n and offsets[n - 1] != index_pos:
        cur_corrupt(&c, f"the last block ending at {offsets[n - 1]}, not where the index starts ({index_pos})")
    return offsets
