"""Moving a heap subtask's batch to the process that holds its state, instead of its state to the batch.

Spark places a task on whichever of its host's idle Python worker processes comes first (see
:mod:`keygroups.runtime.subtask_state`), while a heap backend lives in the process that ran its subtask last. A
batch's input is small beside its state (100k events against 10M keys) and the subtask writes its output and
snapshot to storage itself, returning only a :class:`~keygroups.runtime.report.SubtaskReport`; so a task whose state
another process of the host holds warm sends that process the subtask (its spec, index, attempt and its input as an
Arrow IPC stream) over a Unix socket and returns the report that process sends back.

* Each process that keeps a heap backend serves a Unix socket (a daemon thread, started on the first backend kept)
  in a directory private to this user (mode 0700, :func:`keygroups._local_dirs.private_directory`), and only to
  peers of its own uid (``SO_PEERCRED``): the spec carries the job's pickled function. Beside the socket,
  ``<pid>.json`` says what its registry holds (per kept backend or parked piece: the job, its key-group range, the
  checkpoint it reflects, whether it can be split), rewritten atomically after every keyed subtask it runs. An entry
  whose process is gone, or whose socket refuses, is removed by the first reader that finds it so.
* A task forwards only when another live process holds strictly more of its range (the key groups its takeover
  claim lets it use) than its own process does, and never from a served run (no chains). A holder that no longer
  holds any of it declines, and a connection that fails before the holder accepts runs the subtask where Spark put
  it: correctness never depends on forwarding (a resumed backend is always checked to be exactly the committed
  state). Once the holder has accepted, a failure is the task's failure (raised, with the holder's traceback text),
  so that Spark retries it.
* :data:`RUN_LOCK`: at most one keyed subtask runs in a process at a time, local and served alike; a task that
  forwards holds no lock while it waits, so no two processes ever wait on each other. Spark's Python worker blocks
  on its JVM socket between tasks with the GIL released, so the server thread runs while the worker is idle.
* A served run whose requester does not confirm its report (gone, killed) leaves nothing kept: the backend and
  timer queues it kept are dropped, so the retry restores from the committed checkpoint.

No pyspark here: the Spark task calls :func:`keygroups.runtime.subtask.run_keyed_subtask` with ``forward=True``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import socket
import struct
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from keygroups._local_dirs import private_directory
from keygroups._ranges import KeyGroupRange
from keygroups.runtime.report import SubtaskReport
from keygroups.runtime.spec import KeyedTaskSpec
from keygroups.runtime.subtask_state import HEAP_BACKENDS, HeapBackendRegistry, heap_backend_key
from keygroups.state.timers import TIMER_QUEUES, TimerQueueRegistry

log = logging.getLogger("keygroups")

#: Whether this platform has what the exchange needs (Unix sockets and their peer's credentials: Linux).
SUPPORTED = hasattr(socket, "AF_UNIX") and hasattr(socket, "SO_PEERCRED")

#: At most one keyed subtask runs in a process at a time (the task's own and those served for other processes).
RUN_LOCK = threading.Lock()

#: Runs a served subtask here: ``(spec, subtask index, input batches, attempt) -> report``.
Runner = Callable[[KeyedTaskSpec, int, list[pa.RecordBatch], int], SubtaskReport]

_REQUEST, _ACCEPT, _DECLINE, _BATCHES, _REPORT, _ERROR, _ACK = (b"Q", b"A", b"D", b"B", b"R", b"E", b"K")
_HEADER = struct.Struct("<cQ")
_MAX_FRAME = 1 << 34
_CONNECT_SECONDS = 5.0
_ACK_SECONDS = 60.0


class ForwardError(RuntimeError):
    """A subtask forwarded to the process holding its state failed there (the message holds that process's
    traceback), or the connection broke after that process accepted it."""


@dataclass(frozen=True)
class HeldRange:
    """One warm heap backend or parked piece a process holds: its job (:func:`job_id`), key groups ``start`` to
    ``end``, the checkpoint its state reflects (None: not known) and whether it can be split."""

    job: str
    start: int
    end: int
    checkpoint_id: int | None
    splittable: bool


@dataclass(frozen=True)
class Holder:
    """Another process of this host: its ``pid``, ``socket`` path and what it holds (its advertisement)."""

    pid: int
    socket: str
    held: tuple[HeldRange, ...]


def job_id(key: tuple[Any, ...]) -> str:
    """The job part of a heap registry key (:func:`heap_backend_key` without its range), as a short digest."""
    return hashlib.sha256(repr((*key[:3], *key[5:])).encode()).hexdigest()[:32]


def held_ranges(registry: HeapBackendRegistry) -> list[HeldRange]:
    """What ``registry`` holds, kept backends and parked pieces alike."""
    out = []
    for key in registry.keys():
        backend = registry.peek(key)
        if backend is None or not (isinstance(key, tuple) and len(key) == 7):
            continue
        point = backend._kept_point()
        out.append(HeldRange(job_id(key), int(key[3]), int(key[4]), None if point is None else int(point[0]),
                             bool(backend.splittable)))
    return out


def usable_key_groups(held: Iterable[HeldRange], spec: KeyedTaskSpec, subtask_index: int) -> tuple[int, int]:
    """How many key groups of the subtask's range ``held`` covers that its task may use (of its job, not a range the
    batch's takeover gives another subtask unless it can be split: see ``KeyedTaskSpec.warm_claims``): ``(all,
    those at the checkpoint the batch restores)``, in the order a task compares processes by: a key group not held
    is restored whole, one held at an older checkpoint only catches up."""
    own = spec.own_key_groups(subtask_index)
    job = job_id(heap_backend_key(spec, own))
    others = spec.warm_claims(subtask_index)[1]
    usable = [h for h in held if h.job == job and (h.splittable or (h.start, h.end) not in others)
              and h.start <= own.end and own.start <= h.end]
    point = spec.restore_from if isinstance(spec.restore_from, int) else None
    return (_covered(usable, own),
            _covered([h for h in usable if h.checkpoint_id is not None and h.checkpoint_id == point], own))


def _covered(held: list[HeldRange], own: KeyGroupRange) -> int:
    """The key groups of ``own`` that ``held`` covers (ranges may overlap)."""
    spans = sorted((max(h.start, own.start), min(h.end, own.end)) for h in held)
    total, reached = 0, own.start - 1
    for a, b in spans:
        if b > reached:
            total += b - max(a, reached + 1) + 1
            reached = b
    return total


def default_directory() -> str:
    """This host's exchange directory for this user: ``keygroups-exchange-<uid>`` in the system temporary
    directory (short: a Unix socket's path has at most 107 bytes), private (mode 0700)."""
    return private_directory(os.path.join(tempfile.gettempdir(), f"keygroups-exchange-{os.geteuid()}"),
                             what="warm exchange")


class WarmExchange:
    """This process's side of the exchange: the server for other processes' subtasks and the advertisement of
    ``registry`` in ``directory``, and the forwarding of this process's tasks (see the module docs)."""

    def __init__(self, directory: str, runner: Runner, registry: HeapBackendRegistry = HEAP_BACKENDS,
                 timers: TimerQueueRegistry = TIMER_QUEUES) -> None:
        self.directory = directory
        self.registry = registry
        self.timers = timers
        self._runner = runner
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._advertise_lock = threading.Lock()
        self._server: socket.socket | None = None
        self._advertised: list[HeldRange] | None = None

    @property
    def socket_path(self) -> str:
        return os.path.join(self.directory, f"{self._pid}.sock")

    @property
    def advertisement_path(self) -> str:
        return os.path.join(self.directory, f"{self._pid}.json")

    # ---- serving ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Serve the socket (once; a no-op when serving already)."""
        with self._lock:
            if self._server is not None:
                return
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.socket_path)   # a dead process's of the same pid
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(self.socket_path)
            os.chmod(self.socket_path, 0o600)
            server.listen(16)
            self._server = server
            atexit.register(self.stop)
            threading.Thread(target=self._accept, args=(server,), name="keygroups-warm-exchange",
                             daemon=True).start()

    def stop(self) -> None:
        """Stop serving and withdraw the advertisement."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()
        for path in (self.advertisement_path, self.socket_path):
            with contextlib.suppress(OSError):
                os.remove(path)

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:   # closed by stop()
                return
            threading.Thread(target=self._serve, args=(conn,), name="keygroups-warm-exchange-run",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                if peer_uid(conn) != os.geteuid():
                    return   # refused before reading anything
                kind, payload = _recv(conn)
                if kind != _REQUEST:
                    return
                spec, subtask_index, attempt, requester = pickle.loads(payload)   # our own user's process wrote it
                with RUN_LOCK:
                    self._run_for(conn, spec, subtask_index, attempt, requester)
            except (OSError, EOFError) as e:
                log.debug("warm exchange: a connection ended early: %s", e)
            except Exception:   # e.g. a request whose classes this process cannot import: the requester runs it
                log.warning("warm exchange: a request failed before it was accepted", exc_info=True)

    def _run_for(self, conn: socket.socket, spec: KeyedTaskSpec, subtask_index: int, attempt: int,
                 requester: int) -> None:
        """Under RUN_LOCK: decline if nothing of the subtask's range is held here any more, else run it and send
        the report (or the error). A range held at an older checkpoint counts, as in the requester's ranking:
        catching it up here reads only the deltas the requester would read whole."""
        if usable_key_groups(held_ranges(self.registry), spec, subtask_index)[0] == 0:
            _send(conn, _DECLINE, b"")
            return
        _send(conn, _ACCEPT, b"")
        kind, data = _recv(conn)
        if kind != _BATCHES:
            raise ValueError(f"expected the input batches, got frame {kind!r}")
        batches = list(pa.ipc.open_stream(data)) if data else []
        delivered = False
        try:
            report = self._runner(spec, subtask_index, batches, attempt)
        except BaseException:
            with contextlib.suppress(OSError):
                _send(conn, _ERROR, traceback.format_exc().encode())
            self.advertise()
            return
        try:
            report = dataclasses.replace(report, forwarded_from=requester)
            _send(conn, _REPORT, json.dumps(report.to_json()).encode())
            conn.settimeout(_ACK_SECONDS)
            delivered = _recv(conn)[0] == _ACK
        finally:
            if not delivered:   # its checkpoint will never be committed: keep nothing of it warm
                self.discard(spec, subtask_index, requester)
            self.advertise()

    def discard(self, spec: KeyedTaskSpec, subtask_index: int, requester: int) -> None:
        """Drop the backend and timer queues the subtask's run for process ``requester`` kept here."""
        key = heap_backend_key(spec, spec.own_key_groups(subtask_index))
        self.registry.take(key)
        self.timers.take_matching((spec.backend, *key), None, spec.own_key_groups(subtask_index))   # dropped
        log.warning("warm exchange: subtask %d of job %r ran here for process %d, which did not confirm its "
                    "report; its state is not kept warm", subtask_index, spec.job_name, requester)

    # ---- advertising --------------------------------------------------------------------------------------------

    def advertise(self) -> None:
        """Write what the registry holds to this process's advertisement (only when it changed), serving the socket
        from the first backend held. A failure (a full or read-only disk) is logged: this process then serves no
        other, and runs its own tasks as before."""
        try:
            self._advertise()
        except OSError as e:
            log.warning("warm exchange: cannot advertise this process's warm state in %s: %s", self.directory, e)

    def _advertise(self) -> None:
        with self._advertise_lock:
            held = held_ranges(self.registry)
            if held == self._advertised and (not held or os.path.exists(self.advertisement_path)):
                return
            if held:
                self.start()
            body = json.dumps({"pid": self._pid, "socket": self.socket_path,
                               "held": [dataclasses.astuple(h) for h in held]})
            tmp = f"{self.advertisement_path}.tmp"
            with open(tmp, "w") as f:
                f.write(body)
            os.replace(tmp, self.advertisement_path)
            self._advertised = held

    def holders(self) -> list[Holder]:
        """The other live processes' advertisements in the directory (those of dead processes removed)."""
        out = []
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        for name in names:
            if not name.endswith(".json") or not name[:-5].isdigit() or int(name[:-5]) == self._pid:
                continue
            pid, path = int(name[:-5]), os.path.join(self.directory, name)
            if not _alive(pid):
                _remove_holder(self.directory, pid)
                continue
            try:
                with open(path) as f:
                    d = json.load(f)
                held = tuple(HeldRange(str(h[0]), int(h[1]), int(h[2]), None if h[3] is None else int(h[3]),
                                       bool(h[4])) for h in d["held"])
                out.append(Holder(pid, os.path.join(self.directory, f"{pid}.sock"), held))
            except (OSError, ValueError, KeyError, TypeError, IndexError):
                continue   # being replaced, or not ours to read
        return out

    # ---- forwarding ---------------------------------------------------------------------------------------------

    def forward(self, spec: KeyedTaskSpec, subtask_index: int, batches: Iterable[pa.RecordBatch],
                attempt: int) -> SubtaskReport | None:
        """The report of the subtask run by the live process that holds strictly more of its range than this one,
        or None (run it here: no such process, or each declined or could not be reached; ``batches`` then not
        read). ForwardError when the subtask failed there."""
        own = usable_key_groups(held_ranges(self.registry), spec, subtask_index)
        scored = sorted(((usable_key_groups(h.held, spec, subtask_index), h) for h in self.holders()),
                        key=lambda sh: sh[0], reverse=True)
        candidates = [h for score, h in scored if score > own]
        if not candidates:
            return None
        try:
            request = pickle.dumps((spec, subtask_index, attempt, self._pid), protocol=5)
        except (pickle.PicklingError, TypeError, AttributeError) as e:   # e.g. a sink of a class not importable
            log.debug("warm exchange: the spec does not pickle (%s); running the subtask here", e)
            return None
        for holder in candidates:
            report = self._forward_to(holder, request, batches)
            if report is not None:
                return report
        return None

    def _forward_to(self, holder: Holder, request: bytes, batches: Iterable[pa.RecordBatch]) -> SubtaskReport | None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with conn:
            try:
                conn.settimeout(_CONNECT_SECONDS)
                conn.connect(holder.socket)
                conn.settimeout(None)   # the holder may be running another subtask first
                _send(conn, _REQUEST, request)
                answer = _recv(conn)[0]
            except (ConnectionRefusedError, FileNotFoundError):
                _remove_holder(self.directory, holder.pid)
                return None
            except (OSError, EOFError):
                return None
            if answer != _ACCEPT:
                return None
            try:
                _send(conn, _BATCHES, _ipc_stream(batches))
                kind, payload = _recv(conn)
                if kind == _ERROR:
                    raise ForwardError(f"the subtask failed in process {holder.pid}, which holds its state:\n"
                                       f"{payload.decode(errors='replace')}")
                if kind != _REPORT:
                    raise ForwardError(f"process {holder.pid} answered frame {kind!r}, not a report")
                report = SubtaskReport.from_json(json.loads(payload))
                _send(conn, _ACK, b"")
                return report
            except (OSError, EOFError) as e:
                raise ForwardError(f"process {holder.pid}, which accepted the subtask, was lost while running it "
                                   f"({type(e).__name__}: {e})") from e


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of Unix socket ``conn`` (``SO_PEERCRED``)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's: not one of ours
        return False
    return True


def _remove_holder(directory: str, pid: int) -> None:
    for suffix in (".json", ".sock"):
        with contextlib.suppress(OSError):
            os.remove(os.path.join(directory, f"{pid}{suffix}"))


def _ipc_stream(batches: Iterable[pa.RecordBatch]) -> bytes:
    it: Iterator[pa.RecordBatch] = iter(batches)
    first = next(it, None)
    if first is None:
        return b""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, first.schema) as writer:
        writer.write_batch(first)
        for batch in it:
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _send(conn: socket.socket, kind: bytes, payload: bytes) -> None:
    conn.sendall(_HEADER.pack(kind, len(payload)))
    if payload:
        conn.sendall(payload)


def _recv(conn: socket.socket) -> tuple[bytes, bytes]:
    kind, size = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
    if size > _MAX_FRAME:
        raise ValueError(f"a warm exchange frame of {size} bytes (at most {_MAX_FRAME})")
    return kind, _recv_exact(conn, size)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise EOFError(f"the peer closed the connection ({got} of {n} bytes)")
        got += k
    return bytes(buf)


_PROCESS: WarmExchange | None = None
_PROCESS_LOCK = threading.Lock()


def process_exchange(runner: Runner) -> WarmExchange:
    """This process's exchange in :func:`default_directory` (made once per process; after a fork, anew)."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None or _PROCESS._pid != os.getpid():
            _PROCESS = WarmExchange(default_directory(), runner)
        return _PROCESS


__all__ = ["ForwardError", "HeldRange", "Holder", "RUN_LOCK", "SUPPORTED", "WarmExchange", "default_directory",
           "held_ranges", "job_id", "peer_uid", "process_exchange", "usable_key_groups"]
