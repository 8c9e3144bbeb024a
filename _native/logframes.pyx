# The record frames of the partitioned log (keygroups.sources.log), compiled: ``u32 CRC32C | u32 length | payload``,
# the CRC over the length and the payload. Every byte read goes through the checked cursor, every byte written
# through writer.pxd.
from libc.stdint cimport int64_t, uint8_t, uint32_t

from cursor cimport Cursor, cur_init, cur_read, cur_u32
from writer cimport Writer, w_bytes, w_finish_bytes, w_init_bytes, w_u8

import numpy as np

from keygroups.errors import CorruptSnapshotError


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
    cdef Py_ssize_t size = buf.shape[0], pos = start, n = 0, i, total = 0, length
    cdef uint32_t crc
    cdef Cursor cur
    cdef Writer w
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
    out = w_init_bytes(&w, total)
    st = starts
    for i in range(n if payloads else 0):
        cur.pos = <Py_ssize_t>st[i] + 4
        length = cur_u32(&cur)
        w_bytes(&w, cur_read(&cur, length), length)
        w_u8(&w, 10)   # '\n'
    w_finish_bytes(&w)
    return starts, pos, out
