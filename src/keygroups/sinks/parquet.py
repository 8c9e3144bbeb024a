"""A Parquet file sink with a two-phase commit: Flink's ``FileSink`` for a keyed job's output.

Layout under the sink's directory (a local path or an fsspec URL; ``storage_options`` go to fsspec)::

    part-0000000017-00003-<token>.parquet        subtask 3's output of checkpoint 17, published
    _staging/<job>/chk-17-<run>/part-...-<attempt>-<token>.parquet   staged by a task attempt, not committed yet

A subtask's writer stages its output under ``_staging/`` (a local file is fsync'd before the task reports), and its
committable names the staged file and the published name. The driver's commit, once the checkpoint is committed,
moves each staged file to its published name (a rename on a local filesystem, atomic; on an object store a copy then
a delete, where an object appears only once complete) and removes what is left in the job's ``_staging/<job>/`` for
that checkpoint and earlier ones (attempts Spark retried, runs that failed; several jobs may share a directory, each
cleans only its own). Committing again is harmless: a file already moved is found published and left alone.

Readers see only committed output: Spark's and Arrow's readers of the directory skip names that start with ``_`` or
``.``, so ``spark.read.parquet(path)`` or ``pyarrow.dataset.dataset(path)`` read every committed batch, each once.
The published name holds the checkpoint id and the subtask (files sort by checkpoint), and a token the writer drew,
so that a job started again on a new checkpoint location (whose ids start again) never overwrites the files of
an earlier run; a subtask without output publishes no file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import posixpath
import re
import uuid
from collections.abc import Sequence
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from keygroups.checkpoint.storage import LocationFilesystem, location_filesystem
from keygroups.runtime.sink import Sink, SinkCommittable, SinkContext, SinkWriter

log = logging.getLogger("keygroups")

STAGING = "_staging"
_STAGING_DIR = re.compile(r"chk-(\d+)-([0-9a-z]+)")
_COMPRESSIONS = ("none", "snappy", "gzip", "brotli", "lz4", "zstd")


class ParquetSink(Sink):
    """Exactly-once Parquet files in ``path`` (see the module docs): a local directory or an fsspec URL
    (``s3://bucket/prefix``; ``storage_options`` go to fsspec, in the driver and in every task). ``compression`` is
    Parquet's (``"zstd"`` by default; ``"none"``, ``"snappy"``, ``"gzip"``, ``"brotli"``, ``"lz4"``);
    ``row_group_rows`` caps a row group."""

    def __init__(self, path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,
                 compression: str = "zstd", row_group_rows: int = 1 << 20) -> None:
        location = os.fspath(path)
        if not isinstance(location, str) or not location:
            raise ValueError(f"path must be a non-empty directory path or URL, got {path!r}")
        if compression not in _COMPRESSIONS:
            raise ValueError(f"compression must be one of {_COMPRESSIONS}, got {compression!r}")
        if isinstance(row_group_rows, bool) or not isinstance(row_group_rows, int) or row_group_rows < 1:
            raise ValueError(f"row_group_rows must be an int >= 1, got {row_group_rows!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict (fsspec's options) or None, got {storage_options!r}")
        self.path = location
        self.storage_options = dict(storage_options or {})
        self.compression = compression
        self.row_group_rows = row_group_rows
        self._files: LocationFilesystem | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_files"] = None   # a filesystem client is made again where the sink is unpickled
        return state

    def __repr__(self) -> str:
        return f"ParquetSink({self.path!r})"

    @property
    def name(self) -> str:
        return "keygroups.parquet"

    @property
    def files(self) -> LocationFilesystem:
        """The sink's directory (shared with checkpoint storage: renames and fsyncs locally, fsspec elsewhere)."""
        if self._files is None:
            self._files = location_filesystem(self.path, self.storage_options)
        return self._files

    def create_writer(self, context: SinkContext) -> SinkWriter:
        return _ParquetWriter(self, context)

    def committed_files(self) -> list[str]:
        """The published files, by name (relative to ``path``): in checkpoint order, then subtask order."""
        return [n for n in self.files.listdir("") if n.endswith(".parquet") and not n.startswith(("_", "."))]

    def commit(self, checkpoint_id: int, committables: Sequence[SinkCommittable]) -> None:
        files = self.files
        moved = 0
        for c in committables:
            staged, final = _paths(c)
            if files.exists(staged):
                files.move(staged, final)
                moved += 1
            elif not files.exists(final):
                log.warning("ParquetSink %s: checkpoint %d's file of subtask %d is neither staged (%s) nor published "
                            "(%s): removed from outside the sink since it was committed", self.path, checkpoint_id,
                            c.subtask, staged, final)
        if moved:
            files.sync_dir("")
        # this job's leftovers (known from the staged names: another job's are its own to clean)
        jobs = sorted({_paths(c)[0].split("/")[1] for c in committables})
        self._clean_staging(lambda cid, run: cid <= checkpoint_id, jobs)

    def abort(self, checkpoint_id: int, run_id: str, committables: Sequence[SinkCommittable]) -> None:
        for c in committables:   # (a run's directory holds them; named here too in case it moved)
            self.files.remove(_paths(c)[0])
        self._clean_staging(lambda cid, run: cid == checkpoint_id and run == run_id)

    def _clean_staging(self, doomed: Any, job_dirs: Sequence[str] | None = None) -> None:
        """Remove the staging directories ``doomed(checkpoint_id, run_id)`` selects in ``job_dirs`` (every job's
        staging directory: None)."""
        for job in self.files.listdir(STAGING) if job_dirs is None else job_dirs:
            for name in self.files.listdir(f"{STAGING}/{job}"):
                m = _STAGING_DIR.fullmatch(name)
                if m is not None and doomed(int(m.group(1)), m.group(2)):
                    self.files.rmtree(f"{STAGING}/{job}/{name}")


def _paths(c: SinkCommittable) -> tuple[str, str]:
    """The staged and published names a committable holds, checked to be what this sink writes."""
    data = c.data
    if not isinstance(data, dict) or not isinstance(data.get("staged"), str) or not isinstance(data.get("file"), str):
        raise ValueError(f"not a ParquetSink committable (subtask {c.subtask}): {data!r:.200}")
    staged, final = data["staged"], data["file"]
    parts = staged.split("/")
    if (len(parts) != 4 or parts[0] != STAGING or ".." in parts or "/" in final or final.startswith(("_", "."))):
        raise ValueError(f"a ParquetSink committable names files outside its directory: {data!r:.200}")
    return staged, final


def _job_dir(job_name: str) -> str:
    """A job's staging directory name: its name made safe for a path, and a hash of it (two names made alike stay
    apart)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job_name)[:48].lstrip("._") or "job"
    return f"{safe}-{hashlib.sha1(job_name.encode()).hexdigest()[:8]}"


class _ParquetWriter(SinkWriter):
    """One subtask's staged Parquet file, opened at its first record batch (no output: no file)."""

    def __init__(self, sink: ParquetSink, context: SinkContext) -> None:
        self._sink = sink
        token = uuid.uuid4().hex[:12]
        cid, i = context.checkpoint_id, context.subtask_index
        self.file = f"part-{cid:010d}-{i:05d}-{token}.parquet"
        run = context.run_id or "run"
        self.staged = (f"{STAGING}/{_job_dir(context.job_name)}/chk-{cid}-{run}/"
                       f"part-{cid:010d}-{i:05d}-{context.attempt}-{token}.parquet")
        self._out: BinaryIO | None = None
        self._writer: pq.ParquetWriter | None = None
        self.rows = 0

    def write(self, batch: pa.RecordBatch) -> None:
        if self._writer is None:
            files = self._sink.files
            files.makedirs(posixpath.dirname(self.staged))
            self._out = files.open_write(self.staged)
            self._writer = pq.ParquetWriter(self._out, batch.schema, compression=self._sink.compression)
        self._writer.write_batch(batch, row_group_size=self._sink.row_group_rows)
        self.rows += batch.num_rows

    def prepare_commit(self) -> Any:
        if self._writer is None:
            return None
        assert self._out is not None
        self._writer.close()
        self._out.close()   # a local file is fsync'd as it closes
        rel = self.staged
        while rel:   # and the directories on its way, which may be new: a committable never names a file a crash loses
            rel = posixpath.dirname(rel)
            self._sink.files.sync_dir(rel)
        self._writer = self._out = None
        return {"staged": self.staged, "file": self.file, "rows": self.rows}

    def abort(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        if self._out is not None:
            with contextlib.suppress(Exception):
                self._out.close()
        self._writer = self._out = None
        self._sink.files.remove(self.staged)


__all__ = ["ParquetSink", "STAGING"]
