"""How a RocksDB backend restores: key-group blocks become one SST file, built in compiled code, that RocksDB
ingests whole, instead of rows written one Python call at a time.

A restore (cold, a rescale's arriving key groups, a max-parallelism change) hands each block it reads to
:meth:`SstRestore.add`, in chain order; :meth:`SstRestore.ingest` then walks the key groups in ascending order,
merges each one's chain (the newest full block, the deltas after it) in ``_native/sstload.pyx`` and writes its live
rows, already in the database's key order, through ``rocksdict.SstFileWriter``; the finished file is moved into the
database by ``ingest_external_file`` (RocksDB links it in; no row passes through the memtable or the write-ahead
log). Nothing is deserialized: values stay the framed bytes of the snapshot, a map's entries become its rows.

What the blocks hold must be RocksDB's at the end: the key groups ingested hold no rows before (a cold restore starts
from an empty database; a rescale dropped or never had them), and an ingested file is newer than every row already
there, so nothing older can shadow it.

The file is written uncompressed (RocksDB compresses what its own compactions rewrite): at a restore's rate,
compression would cost more CPU than the rows themselves. It is written without a bloom filter, which cost 22 of
the ~120 ns a row takes through the writer (``benchmarks/bench_rocksdb_restore.py``): a multi-get of keys the file
does not hold then reads the data block a key would be in instead of asking the filter (about what a key that is
there costs; keys the batches wrote since are in files of the database's own, filtered), until a compaction rewrites
the file with the database's table options, filter included. Flink's RocksDB backend builds no filters by default.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import Any

import rocksdict

from keygroups._native import sstload
from keygroups.checkpoint import KeyGroupBlock
from keygroups.errors import CorruptSnapshotError

#: The compiled code's kinds of stored value, by state kind (the others are stored as a value).
STORED_KINDS = {"list": sstload.LIST, "map": sstload.MAP}


def table_options() -> rocksdict.BlockBasedOptions:
    """The block-based table options of the backend's database and of the files it ingests."""
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)  # a batch's prefetch asks for many keys that are not there yet
    return table


def _writer_options() -> rocksdict.Options:
    opts = rocksdict.Options(raw_mode=True)
    opts.set_block_based_table_factory(rocksdict.BlockBasedOptions())   # the database's, less the filter
    opts.set_compression_type(rocksdict.DBCompressionType.none())
    return opts


class SstRestore:
    """The blocks of one restore, gathered per key group until :meth:`ingest` writes and ingests them.

    ``over_kept``: the blocks are the delta blocks a kept database is behind by (a catch-up), written over the rows
    it holds: each key's newest entry becomes its row, or a tombstone when it is a delete, TTL values as written
    (the file, ingested last, is newer than every row there, so its puts and tombstones win)."""

    __slots__ = ("_chains", "_tables", "_over_kept")

    def __init__(self, *, over_kept: bool = False) -> None:
        self._chains: dict[int, list[tuple[KeyGroupBlock, list[Any]]]] = {}
        self._tables: dict[int, Any] = {}   # state id -> the backend's table
        self._over_kept = over_kept

    def __bool__(self) -> bool:
        return bool(self._chains)

    def add(self, targets: list[Any], block: KeyGroupBlock) -> None:
        """One block (as ``read_key_group_offsets`` gives it) of a key group's chain, after the ones added before;
        ``targets[i]`` is the backend's table of the file's state ``i``."""
        self._chains.setdefault(block.key_group, []).append((block, targets))
        for t in targets:
            self._tables[t.state_id] = t

    def tables(self) -> list[Any]:
        return list(self._tables.values())

    def ingest(self, db: rocksdict.Rdict, directory: str, write: Callable[[Callable[[], None]], None]) -> int:
        """Write every gathered key group's rows into one SST file under ``directory`` and ingest it into ``db``
        (through ``write``, which runs the ingestion as the backend's other writes run); the rows written."""
        states = sorted(self._tables.values(), key=lambda t: t.state_id)
        slot = {t.state_id: i for i, t in enumerate(states)}
        over_kept = self._over_kept
        spec = [(t.state_id, STORED_KINDS.get(t.meta["kind"], sstload.VALUE), t.read_framing.ttl,
                 None if over_kept else t.ttl_deadline(), t.name)
                for t in states]
        fd, path = tempfile.mkstemp(prefix="restore-", suffix=".sst", dir=directory)
        os.close(fd)
        rows = 0
        try:
            writer = rocksdict.SstFileWriter(_writer_options())
            writer.open(path)
            try:
                for kg in sorted(self._chains):
                    chain = [(b.block, b.full, b.puts, b.deletes, [slot[t.state_id] for t in targets])
                             for b, targets in self._chains.pop(kg)]
                    rows += sstload.write_key_group(writer, kg, chain, spec, over_kept)[0]
            except Exception as e:
                if "ascending order" in str(e) or "must be added in" in str(e):
                    raise CorruptSnapshotError(f"restored rows out of order for RocksDB: {e}") from e
                raise
            if rows:
                writer.finish()
                options = rocksdict.IngestExternalFileOptions()
                options.set_move_files(True)
                write(lambda: db.ingest_external_file([path], options))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        return rows


__all__ = ["STORED_KINDS", "SstRestore", "table_options"]
