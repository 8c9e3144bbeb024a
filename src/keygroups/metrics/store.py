"""The metrics of the last batches, kept beside the checkpoints: :class:`MetricsStore`.

Layout under a checkpoint location (a local path or any fsspec URL)::

    _metrics/batch-00000000000000000017.arrow    the metrics of the batch that committed checkpoint 17

One file per batch, written once after the batch's commit (a temporary name renamed into place on a local disk; one
whole-object write on object stores), so a reader never sees half a file; the oldest are deleted once more than
``keep`` are there. A file is an Arrow IPC file: one row per key group (:meth:`BatchMetrics.key_group_arrow`), the
batch and subtask figures as JSON in the schema's metadata, with a format version. The store costs a batch one small
write and, once full, one delete; it never lists the directory again after its first write.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import uuid
from typing import Any

import pyarrow as pa

from keygroups.errors import CorruptDataError
from keygroups.metrics.model import BatchMetrics

log = logging.getLogger("keygroups.metrics")

METRICS_DIR = "_metrics"
#: How many batches a store keeps by default.
DEFAULT_KEEP = 100
FORMAT_VERSION = 1
_BATCH_KEY, _VERSION_KEY = b"keygroups.metrics.batch", b"keygroups.metrics.version"
_FILE_RE = re.compile(r"^batch-([0-9]{20})\.arrow$")
#: A metrics file larger than this is refused unread (one holds a row per key group: 32768 at most).
MAX_FILE_BYTES = 64 << 20
_COMPRESSION = "zstd" if pa.Codec.is_available("zstd") else None


def _file_name(checkpoint_id: int) -> str:
    return f"batch-{checkpoint_id:020d}.arrow"


def encode_metrics(metrics: BatchMetrics) -> bytes:
    """``metrics`` as the bytes of one metrics file."""
    table = metrics.key_group_arrow()
    schema = table.schema.with_metadata({_VERSION_KEY: str(FORMAT_VERSION).encode(),
                                         _BATCH_KEY: json.dumps(metrics.batch_json()).encode()})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema, options=pa.ipc.IpcWriteOptions(compression=_COMPRESSION)) as writer:
        writer.write_table(table.replace_schema_metadata(schema.metadata))
    return sink.getvalue().to_pybytes()   # type: ignore[no-any-return]


def decode_metrics(data: bytes, where: str) -> BatchMetrics:
    """The metrics of one file's bytes; CorruptDataError naming ``where`` when they are not a metrics file this
    version reads."""
    try:
        reader = pa.ipc.open_file(pa.py_buffer(data))
        metadata = reader.schema.metadata or {}
        version = metadata.get(_VERSION_KEY)
        if version is None or _BATCH_KEY not in metadata:
            raise ValueError("no keygroups metrics in its schema")
        if int(version) > FORMAT_VERSION:
            raise ValueError(f"format version {int(version)} is newer than this keygroups reads ({FORMAT_VERSION})")
        batch = json.loads(metadata[_BATCH_KEY])
        if not isinstance(batch, dict):
            raise ValueError("its batch figures are not a JSON object")
        return BatchMetrics.from_parts(batch, reader.read_all())
    except (pa.ArrowException, ValueError, KeyError, TypeError, IndexError) as e:
        raise CorruptDataError(f"{where} is not a readable keygroups metrics file ({type(e).__name__}: {e})") from None


class _LocalFiles:
    def __init__(self, root: str) -> None:
        self.root = root

    def url(self, name: str) -> str:
        return os.path.join(self.root, name)

    def listdir(self) -> list[str]:
        try:
            return os.listdir(self.root)
        except FileNotFoundError:
            return []

    def write(self, name: str, data: bytes) -> None:
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, f".{name}.inprogress-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, os.path.join(self.root, name))
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    def read(self, name: str) -> bytes:
        path = os.path.join(self.root, name)
        if os.path.getsize(path) > MAX_FILE_BYTES:
            raise CorruptDataError(f"{path} is larger than a metrics file can be ({MAX_FILE_BYTES:,} bytes)")
        with open(path, "rb") as f:
            return f.read()

    def remove(self, name: str) -> None:
        try:
            os.remove(os.path.join(self.root, name))
        except FileNotFoundError:
            pass


class _RemoteFiles:
    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        import fsspec  # type: ignore[import-untyped]

        # every listing fresh, as the checkpoint storage's: another process writes here
        self.fs, self.root = fsspec.core.url_to_fs(url, **{**storage_options, "use_listings_cache": False})
        self._url = url.rstrip("/")

    def url(self, name: str) -> str:
        return f"{self._url}/{name}"

    def listdir(self) -> list[str]:
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []

    def write(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(f"{self.root}/{name}", data)   # an object appears whole or not at all

    def read(self, name: str) -> bytes:
        path = f"{self.root}/{name}"
        if self.fs.size(path) > MAX_FILE_BYTES:
            raise CorruptDataError(f"{self.url(name)} is larger than a metrics file can be ({MAX_FILE_BYTES:,} bytes)")
        return bytes(self.fs.cat_file(path))

    def remove(self, name: str) -> None:
        try:
            self.fs.rm_file(f"{self.root}/{name}")
        except FileNotFoundError:
            pass


class MetricsStore:
    """The metrics of a job's last ``keep`` batches in ``<location>/_metrics/`` (see the module docs):
    ``location`` is the job's checkpoint location, ``storage_options`` its fsspec options."""

    def __init__(self, location: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,
                 keep: int = DEFAULT_KEEP) -> None:
        self.keep = check_keep(keep)
        loc = os.fspath(location)
        if not isinstance(loc, str) or not loc:
            raise ValueError(f"location must be a non-empty path or URL, got {location!r}")
        self.location = loc
        self.storage_options = dict(storage_options or {})
        self._files: _LocalFiles | _RemoteFiles
        if "://" not in loc or loc.startswith("file://"):
            root = loc[len("file://"):] if loc.startswith("file://") else loc
            self._files = _LocalFiles(os.path.join(os.path.abspath(os.path.expanduser(root)), METRICS_DIR))
        else:
            self._files = _RemoteFiles(f"{loc.rstrip('/')}/{METRICS_DIR}", self.storage_options)
        self._ids: list[int] | None = None   # what is stored, once listed
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MetricsStore({self.location!r}, keep={self.keep})"

    def __reduce__(self) -> tuple[Any, ...]:   # pickles as its arguments (a Spark task reads the store too)
        return (_rebuild_store, (self.location, self.storage_options, self.keep))

    def checkpoint_ids(self) -> list[int]:
        """The checkpoint ids of the batches stored, ascending (listed afresh)."""
        ids = sorted(int(m.group(1)) for m in map(_FILE_RE.match, self._files.listdir()) if m)
        with self._lock:
            self._ids = list(ids)
        return ids

    def write(self, metrics: BatchMetrics) -> None:
        """Keep ``metrics`` (replacing a batch of the same checkpoint id), then delete the oldest batches beyond
        ``keep``."""
        data = encode_metrics(metrics)
        if self._ids is None:
            self.checkpoint_ids()
        self._files.write(_file_name(metrics.checkpoint_id), data)
        with self._lock:
            ids = self._ids if self._ids is not None else []
            if metrics.checkpoint_id not in ids:
                ids.append(metrics.checkpoint_id)
                ids.sort()
            drop, self._ids = ids[:-self.keep], ids[-self.keep:]
        for cid in drop:
            self._files.remove(_file_name(cid))

    def read(self, checkpoint_id: int) -> BatchMetrics:
        """The metrics of the batch of checkpoint ``checkpoint_id``; FileNotFoundError if the store has none,
        CorruptDataError if its file is unreadable."""
        name = _file_name(checkpoint_id)
        return decode_metrics(self._files.read(name), self._files.url(name))

    def history(self, last: int | None = None) -> list[BatchMetrics]:
        """The stored batches (the ``last`` ones: all by default), oldest first. A batch deleted by another writer's
        pruning between the listing and its read is left out."""
        ids = self.checkpoint_ids()
        if last is not None:
            ids = ids[-last:] if last > 0 else []
        out = []
        for cid in ids:
            try:
                out.append(self.read(cid))
            except FileNotFoundError:
                continue
        return out

    def url(self, checkpoint_id: int) -> str:
        """Where the metrics of checkpoint ``checkpoint_id`` are (or would be)."""
        return self._files.url(_file_name(checkpoint_id))


def _rebuild_store(location: str, storage_options: dict[str, Any], keep: int) -> MetricsStore:
    return MetricsStore(location, storage_options=storage_options, keep=keep)


def check_keep(keep: Any) -> int:
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1 (how many batches' metrics to keep), got {keep!r}")
    return keep


__all__ = ["MetricsStore", "METRICS_DIR", "DEFAULT_KEEP", "encode_metrics", "decode_metrics"]
