"""Parquet files held in memory, read into Arrow tables from a copy in memory Arrow owns.

``pq.read_table`` runs its scan on Arrow's thread pool, and the scan's last references (read-ahead futures, page
buffers) may be dropped on a worker thread after the call has returned. When those reference memory a Python object
exports (``bytes``, an ``mmap``, what ``io.BytesIO.read`` returns: Arrow's ``PyBuffer``), dropping them takes the
GIL; if the interpreter is exiting by then, Python ends that thread inside Arrow's destructor and the C++ runtime
aborts the process (SIGABRT, "terminate called without an active exception"), after the program's work is done.
A copy in Arrow's own memory needs no GIL to be released, whatever thread releases it.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def arrow_owned(data: Any) -> pa.Buffer:
    """``data`` (bytes, bytearray, memoryview, mmap, a pyarrow Buffer) copied into a buffer Arrow allocated."""
    sink = pa.BufferOutputStream()
    sink.write(data)   # the copy is made here, on this thread; the view of ``data`` is released before returning
    return sink.getvalue()


def read_parquet(data: Any, **options: Any) -> pa.Table:
    """The Parquet file ``data`` holds, as a table (``options`` as ``pyarrow.parquet.read_table`` takes them)."""
    return pq.read_table(pa.BufferReader(arrow_owned(data)), **options)
