# The byte-level list splitter of operator state (FLIP-8).
#
# A snapshot stores each operator list state as its elements' serialized bytes back to back, with one byte offset per
# element in the handle. Redistributing such a list to a new parallelism never needs the elements' values: each new
# subtask takes contiguous runs of elements, so this module validates the offsets it is given against the buffer they
# point into and copies the runs, rebasing the offsets. No element is deserialized here.
#
# Offsets come from checkpoint metadata and buffers from files: both are untrusted. Every byte read goes through the
# checked cursor; every offset is checked (monotonic, inside the buffer) before a single byte is copied.
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint8_t, uint32_t
from libc.string cimport memcpy

cimport cursor
from cursor cimport Cursor, cur_init, cur_read, cur_u32

import numpy as np

from keygroups.errors import CorruptSnapshotError


cdef int _first_bad_offset(const int64_t *bounds, Py_ssize_t n, int64_t lo, int64_t hi,
                           Py_ssize_t *where) noexcept nogil:
    """0 when lo <= bounds[0] <= ... <= bounds[n-1] <= hi; else 1 and the index of the first bad offset."""
    cdef Py_ssize_t i
    cdef int64_t prev = lo
    for i in range(n):
        if bounds[i] < prev or bounds[i] > hi:
            where[0] = i
            return 1
        prev = bounds[i]
    return 0


cdef int _check_bounds(const int64_t[::1] bounds, int64_t lo, int64_t hi, str what) except -1:
    cdef Py_ssize_t where = 0
    cdef int bad
    if bounds.shape[0] == 0:
        return 0
    with nogil:
        bad = _first_bad_offset(&bounds[0], bounds.shape[0], lo, hi, &where)
    if bad:
        prev = lo if where == 0 else bounds[where - 1]
        raise CorruptSnapshotError(
            f"{what}: offset #{where} is {bounds[where]}, but offsets must ascend from {prev} and stay within "
            f"bytes [{lo}, {hi}]; the snapshot file is truncated or its metadata is corrupt")
    return 0


def check_offsets(const int64_t[::1] bounds, int64_t lo, int64_t hi, str what="element offsets") -> None:
    """Raise CorruptSnapshotError unless ``lo <= bounds[0] <= ... <= bounds[-1] <= hi``."""
    _check_bounds(bounds, lo, hi, what)


def gather(list pieces, str what="operator state"):
    """Concatenate runs of serialized elements from several buffers into one list.

    ``pieces``: ``(buffer, base, bounds)`` triples. ``buffer`` holds the file bytes ``[base, base + len(buffer))``;
    ``bounds`` (int64, k+1 entries) are the absolute file offsets of the k elements' boundaries (the last one is
    where the k-th element ends). Returns ``(data, offsets)``: the elements' bytes back to back and their n+1
    boundaries relative to ``data``. Raises CorruptSnapshotError, naming the piece, if any offset is not ascending or
    falls outside its buffer.
    """
    cdef Py_ssize_t i, j, k, n_total = 0, total = 0, out_pos = 0, out_idx = 0
    cdef const uint8_t[::1] buf
    cdef const int64_t[::1] bounds
    cdef int64_t base, shift
    cdef Cursor cur
    cdef const uint8_t *src
    cdef int64_t[::1] out_off
    cdef char *dst
    cdef list views = []

    # Pass 1: validate every piece and size the output, before allocating anything.
    for i in range(len(pieces)):
        piece = pieces[i]
        if len(piece) != 3:
            raise TypeError(f"gather: piece #{i} must be a (buffer, base, bounds) triple, got {len(piece)} items")
        buf = piece[0]
        base = piece[1]
        bounds = piece[2]
        if base < 0:
            raise ValueError(f"gather: piece #{i} has base {base}; a file offset must be >= 0")
        if bounds.shape[0] == 0:
            raise ValueError(f"gather: piece #{i} has no bounds; k elements need k+1 offsets")
        _check_bounds(bounds, base, base + buf.shape[0], f"{what}, piece #{i}")
        n_total += bounds.shape[0] - 1
        total += <Py_ssize_t>(bounds[bounds.shape[0] - 1] - bounds[0])
        views.append((buf, base, bounds))

    data = PyBytes_FromStringAndSize(NULL, total)
    dst = PyBytes_AS_STRING(data)
    offsets = np.empty(n_total + 1, dtype=np.int64)
    out_off = offsets
    out_off[0] = 0

    # Pass 2: copy each contiguous run once and rebase its offsets.
    for i in range(len(views)):
        buf, base, bounds = views[i]
        k = bounds.shape[0] - 1
        if bounds[k] > bounds[0]:   # validated: then the buffer is not empty
            cur_init(&cur, &buf[0], buf.shape[0])
            cur.pos = <Py_ssize_t>(bounds[0] - base)
            src = cur_read(&cur, <Py_ssize_t>(bounds[k] - bounds[0]))
            with nogil:
                memcpy(dst + out_pos, src, <size_t>(bounds[k] - bounds[0]))
        with nogil:
            shift = out_pos - bounds[0]
            for j in range(1, k + 1):
                out_off[out_idx + j] = bounds[j] + shift
        out_pos += <Py_ssize_t>(bounds[k] - bounds[0])
        out_idx += k
    return data, offsets


def encode_entries(const uint8_t[::1] key_data, const int64_t[::1] key_offsets,
                   const uint8_t[::1] value_data, const int64_t[::1] value_offsets):
    """Frame n serialized (key, value) pairs as n elements: ``u32 key length | key | value`` each.

    The value's length is implied by the element's boundaries, so a map becomes an ordinary list of elements that
    the splitter can move byte by byte. Returns ``(data, offsets)`` with n+1 offsets.
    """
    cdef Py_ssize_t n = key_offsets.shape[0] - 1, i, pos = 0, total, klen, vlen
    cdef uint32_t klen32
    cdef char *dst
    cdef int64_t[::1] out_off
    if n < 0 or value_offsets.shape[0] != n + 1:
        raise ValueError(f"encode_entries: {key_offsets.shape[0]} key offsets and {value_offsets.shape[0]} value "
                         "offsets; both must have n+1 entries for n pairs")
    _check_bounds(key_offsets, 0, key_data.shape[0], "map keys")
    _check_bounds(value_offsets, 0, value_data.shape[0], "map values")
    total = 4 * n + <Py_ssize_t>(key_offsets[n] - key_offsets[0]) + <Py_ssize_t>(value_offsets[n] - value_offsets[0])
    data = PyBytes_FromStringAndSize(NULL, total)
    dst = PyBytes_AS_STRING(data)
    offsets = np.empty(n + 1, dtype=np.int64)
    out_off = offsets
    out_off[0] = 0
    for i in range(n):
        klen = <Py_ssize_t>(key_offsets[i + 1] - key_offsets[i])
        vlen = <Py_ssize_t>(value_offsets[i + 1] - value_offsets[i])
        if klen > 0xFFFFFFFF:
            raise ValueError(f"encode_entries: key #{i} is {klen} bytes; at most 4294967295 are allowed")
        klen32 = <uint32_t>klen
        memcpy(dst + pos, &klen32, 4)   # little-endian, as cursor.cur_u32 reads it
        if klen:
            memcpy(dst + pos + 4, &key_data[key_offsets[i]], klen)
        if vlen:
            memcpy(dst + pos + 4 + klen, &value_data[value_offsets[i]], vlen)
        pos += 4 + klen + vlen
        out_off[i + 1] = pos
    return data, offsets


def decode_entries(const uint8_t[::1] data, const int64_t[::1] offsets):
    """Inverse of :func:`encode_entries`: ``(key_data, key_offsets, value_data, value_offsets)``.

    Every element is read through the checked cursor; a key length that overruns its element raises
    CorruptSnapshotError.
    """
    cdef Py_ssize_t n = offsets.shape[0] - 1, i, klen, vlen, kpos = 0, vpos = 0
    cdef Cursor cur
    cdef const uint8_t *p
    cdef char *kdst
    cdef char *vdst
    cdef int64_t[::1] ko, vo
    if n < 0:
        raise ValueError("decode_entries: offsets must have n+1 entries for n entries")
    _check_bounds(offsets, 0, data.shape[0], "map entries")
    total = <Py_ssize_t>(offsets[n] - offsets[0])
    if total < 4 * n:
        raise CorruptSnapshotError(f"map entries: {n} entries in {total} bytes; each needs at least 4")
    key_data = PyBytes_FromStringAndSize(NULL, total - 4 * n)
    value_data = PyBytes_FromStringAndSize(NULL, total - 4 * n)
    kdst = PyBytes_AS_STRING(key_data)
    vdst = PyBytes_AS_STRING(value_data)
    key_offsets = np.empty(n + 1, dtype=np.int64)
    value_offsets = np.empty(n + 1, dtype=np.int64)
    ko = key_offsets
    vo = value_offsets
    ko[0] = 0
    vo[0] = 0
    for i in range(n):
        if offsets[i + 1] == offsets[i]:
            raise CorruptSnapshotError(f"map entry #{i} is empty; an entry holds at least its 4-byte key length")
        cur_init(&cur, &data[offsets[i]], <Py_ssize_t>(offsets[i + 1] - offsets[i]))
        klen = cur_u32(&cur)
        p = cur_read(&cur, klen)
        if klen:
            memcpy(kdst + kpos, p, klen)
        kpos += klen
        vlen = cur.length - cur.pos
        p = cur_read(&cur, vlen)
        if vlen:
            memcpy(vdst + vpos, p, vlen)
        vpos += vlen
        ko[i + 1] = kpos
        vo[i + 1] = vpos
    return key_data[:kpos], key_offsets, value_data[:vpos], value_offsets


def scan_frames(object data, Py_ssize_t start, Py_ssize_t max_records, Py_ssize_t max_record_bytes,
                object crc32c_fn, bint payloads=True):
    """Walk the record frames of a partitioned log (``u32 CRC32C | u32 length | payload``, the CRC over the
    length and payload bytes) from byte ``start``; at most ``max_records`` (< 0: no limit).

    Returns ``(starts, next_offset, ndjson)``: the start offset of each complete record (int64), where the next
    record starts, and the payloads each followed by ``\\n`` in one buffer (JSON payloads hold no raw newline, so
    this is newline-delimited JSON as Arrow's reader takes it). Stops quietly at an incomplete frame at the end (a
    record being written); raises CorruptSnapshotError on a length above ``max_record_bytes`` or a bad checksum.
    ``crc32c_fn(buffer, value=0) -> int`` is the CRC32C function (the ``crc32c`` package's: hardware-accelerated).
    ``payloads=False`` only verifies (the third value is then empty).
    """
    cdef const uint8_t[::1] buf = data
    cdef Py_ssize_t size = buf.shape[0], pos = start, n = 0, i, total = 0, length, out_pos = 0
    cdef uint32_t crc
    cdef Cursor cur
    cdef char *dst
    cdef int64_t[::1] st
    if start < 0 or start > size:
        raise ValueError(f"scan_frames: start {start} is outside the {size}-byte buffer")
    view = memoryview(data)
    found = []
    if size > 0:
        cur_init(&cur, &buf[0], size)
    while (max_records < 0 or n < max_records) and size - pos >= 8:
        cur.pos = pos
        crc = cur_u32(&cur)
        length = cur_u32(&cur)
        if length > max_record_bytes:
            raise CorruptSnapshotError(f"the record at offset {pos} claims {length} bytes (at most "
                                       f"{max_record_bytes})")
        if length > size - cur.pos:
            break   # the tail is still being written
        if crc32c_fn(view[pos + 4:pos + 8 + length]) != crc:
            raise CorruptSnapshotError(f"checksum mismatch in the record at offset {pos}")
        found.append(pos)
        if payloads:
            total += length + 1
        pos += 8 + length
        n += 1
    starts = np.array(found, dtype=np.int64)
    out = PyBytes_FromStringAndSize(NULL, total)
    dst = PyBytes_AS_STRING(out)
    st = starts
    for i in range(n if payloads else 0):
        cur.pos = <Py_ssize_t>st[i] + 4
        length = cur_u32(&cur)
        memcpy(dst + out_pos, cur_read(&cur, length), length)
        dst[out_pos + length] = 10   # '\n'
        out_pos += length + 1
    return starts, pos, out
