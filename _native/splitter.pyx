# The byte-level list splitter of operator state (FLIP-8).
#
# A snapshot stores each operator list state as its elements' serialized bytes back to back, with one byte offset per
# element in the handle. Redistributing such a list to a new parallelism never needs the elements' values: each new
# subtask takes contiguous runs of elements, so this module validates the offsets it is given against the buffer they
# point into and copies the runs, rebasing the offsets. No element is deserialized here.
#
# Offsets come from checkpoint metadata and buffers from files: both are untrusted. Every byte read goes through the
# checked cursor; every offset is checked (monotonic, inside the buffer) before a single byte is copied. Every byte
# written goes through writer.pxd, into a bytes object sized beforehand.
from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcpy

from cursor cimport Cursor, cur_init, cur_read
from entryframe cimport ENTRY_HEAD, ent_read_key, ent_write
from writer cimport Writer, w_bytes, w_finish_bytes, w_init_bytes, w_reserve

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
    cdef Py_ssize_t i, j, k, n_total = 0, total = 0, out_idx = 0, run
    cdef const uint8_t[::1] buf
    cdef const int64_t[::1] bounds
    cdef int64_t base, shift
    cdef Cursor cur
    cdef const uint8_t *src
    cdef int64_t[::1] out_off
    cdef uint8_t *dst
    cdef Writer w
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

    data = w_init_bytes(&w, total)
    offsets = np.empty(n_total + 1, dtype=np.int64)
    out_off = offsets
    out_off[0] = 0

    # Pass 2: copy each contiguous run once and rebase its offsets.
    for i in range(len(views)):
        buf, base, bounds = views[i]
        k = bounds.shape[0] - 1
        run = <Py_ssize_t>(bounds[k] - bounds[0])
        shift = w.pos - bounds[0]
        if run > 0:   # validated: then the buffer is not empty
            cur_init(&cur, &buf[0], buf.shape[0])
            cur.pos = <Py_ssize_t>(bounds[0] - base)
            src = cur_read(&cur, run)
            dst = w_reserve(&w, run)
            with nogil:
                memcpy(dst, src, <size_t>run)
        with nogil:
            for j in range(1, k + 1):
                out_off[out_idx + j] = bounds[j] + shift
        out_idx += k
    w_finish_bytes(&w)
    return data, offsets


def encode_entries(const uint8_t[::1] key_data, const int64_t[::1] key_offsets,
                   const uint8_t[::1] value_data, const int64_t[::1] value_offsets):
    """Frame n serialized (key, value) pairs as n elements, each in the one map-entry framing (entryframe.pxd):
    ``u32 key length | key | value``.

    The value's length is implied by the element's boundaries, so a map becomes an ordinary list of elements that
    the splitter can move byte by byte. Returns ``(data, offsets)`` with n+1 offsets.
    """
    cdef Py_ssize_t n = key_offsets.shape[0] - 1, i, total, klen, vlen
    cdef Writer w
    cdef int64_t[::1] out_off
    if n < 0 or value_offsets.shape[0] != n + 1:
        raise ValueError(f"encode_entries: {key_offsets.shape[0]} key offsets and {value_offsets.shape[0]} value "
                         "offsets; both must have n+1 entries for n pairs")
    _check_bounds(key_offsets, 0, key_data.shape[0], "map keys")
    _check_bounds(value_offsets, 0, value_data.shape[0], "map values")
    total = (ENTRY_HEAD * n + <Py_ssize_t>(key_offsets[n] - key_offsets[0])
             + <Py_ssize_t>(value_offsets[n] - value_offsets[0]))
    data = w_init_bytes(&w, total)
    offsets = np.empty(n + 1, dtype=np.int64)
    out_off = offsets
    out_off[0] = 0
    for i in range(n):
        klen = <Py_ssize_t>(key_offsets[i + 1] - key_offsets[i])
        vlen = <Py_ssize_t>(value_offsets[i + 1] - value_offsets[i])
        ent_write(&w, &key_data[key_offsets[i]] if klen else NULL, klen,
                  &value_data[value_offsets[i]] if vlen else NULL, vlen)
        out_off[i + 1] = w.pos
    w_finish_bytes(&w)
    return data, offsets


def decode_entries(const uint8_t[::1] data, const int64_t[::1] offsets):
    """Inverse of :func:`encode_entries`: ``(key_data, key_offsets, value_data, value_offsets)``.

    Every element is read through the checked cursor; a key length that overruns its element raises
    CorruptSnapshotError.
    """
    cdef Py_ssize_t n = offsets.shape[0] - 1, i, klen, vlen
    cdef Cursor cur
    cdef const uint8_t *p
    cdef Writer keys, values
    cdef int64_t[::1] ko, vo
    if n < 0:
        raise ValueError("decode_entries: offsets must have n+1 entries for n entries")
    _check_bounds(offsets, 0, data.shape[0], "map entries")
    total = <Py_ssize_t>(offsets[n] - offsets[0])
    if total < ENTRY_HEAD * n:
        raise CorruptSnapshotError(f"map entries: {n} entries in {total} bytes; each needs at least {ENTRY_HEAD}")
    # Each gets room for all the payload bytes; both are cut to what they hold at the end.
    key_data = w_init_bytes(&keys, total - ENTRY_HEAD * n)
    value_data = w_init_bytes(&values, total - ENTRY_HEAD * n)
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
        p = ent_read_key(&cur, &klen)
        w_bytes(&keys, p, klen)
        vlen = cur.length - cur.pos
        w_bytes(&values, cur_read(&cur, vlen), vlen)
        ko[i + 1] = keys.pos
        vo[i + 1] = values.pos
    return key_data[:keys.pos], key_offsets, value_data[:values.pos], value_offsets
