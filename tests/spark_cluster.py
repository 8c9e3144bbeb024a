"""Multi-process Spark deployments for tests: executors in their own JVMs and Python workers, never the driver's.

A test process may hold only one SparkContext, and the test session already has a ``local[2]`` one (conftest's
``spark`` fixture). So a cluster job runs in a CHILD Python process (``sys.executable``) that owns its own
SparkSession on a multi-process master and serves calls:

    with ClusterDriver() as cluster:                    # starts the child, waits until both executors registered
        result = cluster.call(my_job, n=1000)           # runs my_job(spark, n=1000) in the child; JSON back

``my_job`` must be a module-level function of an importable file (a test module is fine): the child imports that
file by path, registers it with cloudpickle to be pickled BY VALUE (executors cannot import a test file), calls the
function with the child's ``spark`` and returns its JSON-serializable result. Errors come back as ``ClusterCallError``
with the child's traceback; the child's log (Spark's driver log) is at ``ClusterDriver.log_path``, kept after a
failure and removed with its directory on a clean close.

Masters:
- ``local-cluster[2,1,1024]`` (default): Spark's own multi-process test deployment; the driver JVM hosts a
  master and two workers, each worker launches ONE executor JVM (1 core, 1 GiB) which starts its own Python
  daemon and workers. Works from the pip-installed pyspark (SPARK_HOME = the package directory).
- ``"standalone"``: ``StandaloneCluster`` starts a real master and two workers on 127.0.0.1 as separate processes
  with ``spark-class org.apache.spark.deploy.master.Master`` / ``...worker.Worker``, random free ports.
- ``"auto"``: local-cluster, falling back to standalone when executors do not register in time.
The environment variable ``KEYGROUPS_SPARK_CLUSTER`` overrides the default (``local-cluster``/``standalone``/``auto``
or any master URL).

Every start-up wait is bounded. Teardown is guaranteed: each launched process gets its own session (process group);
on close the whole tree of descendants is recorded, the groups are sent SIGTERM, then SIGKILL after a grace period,
and every recorded descendant (Spark's Python daemon makes its own process group) is killed by pid.

``pytest`` use: ``cluster = cluster_fixture()`` in a test module gives a module-scoped ``ClusterDriver`` fixture.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import pathlib
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

LOCAL_CLUSTER = "local-cluster[2,1,1024]"
ENV_MASTER = "KEYGROUPS_SPARK_CLUSTER"


class ClusterError(RuntimeError):
    """The multi-process deployment could not be started or stopped as asked."""


class ClusterStartError(ClusterError):
    """A master, worker or the child driver did not come up within its start-up timeout."""


class ClusterCallError(ClusterError):
    """A function called in the cluster driver raised; the message carries the child's traceback."""


# ----------------------------------------------------------------------------------------------------------------
# processes


def spark_home() -> str:
    """The pip-installed pyspark package directory: it ships bin/spark-class and the jars."""
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name (field 2) may hold spaces and parentheses; fields after the last ')' are safe
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children first), from /proc."""
    children = _children_map()
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


Identity = tuple[int, int]  # (pid, start time in clock ticks): a pid alone may be reused by someone else


def _identity(pid: int) -> Identity | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] == b"Z":
        return None  # a zombie is already dead
    return pid, int(fields[19])  # field 22 of stat: start time


def _same(ident: Identity) -> bool:
    return _identity(ident[0]) == ident


def tree_identities(pid: int) -> list[Identity]:
    """Identities of ``pid``'s live descendants; record them BEFORE stopping anything (orphans lose the link)."""
    return [i for i in map(_identity, descendants(pid)) if i is not None]


def kill_tree(proc: subprocess.Popen, grace: float = 10.0, recorded: Sequence[Identity] = ()) -> None:
    """Stop ``proc`` (started with ``start_new_session=True``), its process group and all its descendants.

    SIGTERM first so that Spark can remove its temporary directories, SIGKILL for whatever is left after ``grace``
    seconds. Descendants found now plus ``recorded`` ones are signalled by pid only while their start time still
    matches, so a reused pid is never hit; group leaders among them (Spark's Python daemon makes its own process
    group for its workers) get their whole group signalled.
    """
    tree = list(dict.fromkeys([*recorded, *(tree_identities(proc.pid) if proc.poll() is None else [])]))
    own_group = os.getpgid(0)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.pid != own_group:
            try:
                os.killpg(proc.pid, sig)  # the group outlives its leader's pid, so the number cannot be reused
            except (ProcessLookupError, PermissionError):
                pass
        for ident in tree:
            if not _same(ident):
                continue
            pid = ident[0]
            try:
                if os.getpgid(pid) == pid and pid != own_group:
                    os.killpg(pid, sig)
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            if proc.poll() is not None and not any(_same(i) for i in tree):
                break
            time.sleep(0.1)
        else:
            continue
        break
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _tail(path: str | os.PathLike, lines: int = 40) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def _spark_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "SPARK_HOME": spark_home(),
            "SPARK_LOCAL_IP": "127.0.0.1",  # loopback only; the hostname may resolve elsewhere
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "SPARK_NO_DAEMONIZE": "1",
        }
    )
    env.update(extra or {})
    return env


# ----------------------------------------------------------------------------------------------------------------
# standalone cluster


class StandaloneCluster:
    """A Spark standalone master and ``workers`` workers on 127.0.0.1, from the pip-installed pyspark.

    Use as a context manager; ``master_url`` is ``spark://127.0.0.1:<port>``. Each daemon runs in the foreground
    in its own session, logging to ``work_dir``.
    """

    def __init__(
        self,
        workers: int = 2,
        cores: int = 1,
        memory: str = "1g",
        *,
        start_timeout: float = 120.0,
        work_dir: str | os.PathLike | None = None,
        daemon_memory: str = "256m",
    ) -> None:
        if workers < 1 or cores < 1:
            raise ValueError(f"need workers >= 1 and cores >= 1, got workers={workers}, cores={cores}")
        self.workers, self.cores, self.memory = workers, cores, memory
        self.start_timeout = start_timeout
        self.work_dir = pathlib.Path(work_dir or tempfile.mkdtemp(prefix="kg-standalone-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.daemon_memory = daemon_memory
        self.procs: list[subprocess.Popen] = []
        self.port = self.webui_port = 0
        self.master_url = ""

    def _launch(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.work_dir / f"{name}.log", "wb")
        cmd = [os.path.join(spark_home(), "bin", "spark-class"), *args]
        env = _spark_env({"SPARK_DAEMON_MEMORY": self.daemon_memory, "SPARK_LOG_DIR": str(self.work_dir)})
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, cwd=self.work_dir)
        finally:
            log.close()
        self.procs.append(proc)
        return proc

    def _status(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.webui_port}/json/", timeout=2) as r:
                return json.load(r)
        except (OSError, ValueError):
            return None

    def _wait(self, what: str, ready: Callable[[], bool], deadline: float) -> None:
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    name = "master" if i == 0 else f"worker-{i}"
                    raise ClusterStartError(
                        f"standalone {name} exited with {p.returncode} while waiting for {what}:\n"
                        + _tail(self.work_dir / f"{name}.log")
                    )
            if ready():
                return
            time.sleep(0.5)
        raise ClusterStartError(
            f"standalone cluster: {what} not within {self.start_timeout:.0f}s; master log:\n"
            + _tail(self.work_dir / "master.log")
        )

    def start(self) -> StandaloneCluster:
        deadline = time.monotonic() + self.start_timeout
        self.port, self.webui_port = free_port(), free_port()
        self.master_url = f"spark://127.0.0.1:{self.port}"
        self._launch("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                "--port", str(self.port), "--webui-port", str(self.webui_port)])
        self._wait("the master's status page", lambda: (self._status() or {}).get("status") == "ALIVE", deadline)
        for i in range(1, self.workers + 1):
            wdir = self.work_dir / f"worker-{i}"
            wdir.mkdir(exist_ok=True)
            self._launch(f"worker-{i}", ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                                         "--port", str(free_port()), "--webui-port", str(free_port()),
                                         "--cores", str(self.cores), "--memory", self.memory,
                                         "--work-dir", str(wdir), self.master_url])
        self._wait(f"{self.workers} alive workers",
                   lambda: (self._status() or {}).get("aliveworkers", 0) >= self.workers, deadline)
        return self

    def close(self) -> None:
        for p in reversed(self.procs):  # workers first, so they do not try to reconnect to a dead master
            kill_tree(p)
        self.procs.clear()

    def __enter__(self) -> StandaloneCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------------------
# the driver in a child process


def _function_ref(fn: Callable[..., Any]) -> tuple[str, str]:
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"cluster calls need a module-level function, got {fn!r}")
    return os.path.abspath(inspect.getfile(fn)), qualname


def _expected_executors(master: str) -> int:
    if master.startswith("local-cluster["):
        return int(master[len("local-cluster[") :].split(",")[0])
    return 2


class ClusterDriver:
    """A SparkSession on a multi-process master, owned by a child Python process; see the module docstring.

    ``master``: a master URL, ``"local-cluster"`` (= ``local-cluster[2,1,1024]``), ``"standalone"`` or ``"auto"``;
    default from ``KEYGROUPS_SPARK_CLUSTER``, else local-cluster. ``conf``: extra Spark conf for the session.
    ``executors``: how many executors must have registered before the driver counts as started.
    """

    def __init__(
        self,
        master: str | None = None,
        *,
        conf: dict[str, str] | None = None,
        executors: int | None = None,
        start_timeout: float = 150.0,
        call_timeout: float = 600.0,
        driver_memory: str = "1g",
        log_dir: str | os.PathLike | None = None,
    ) -> None:
        master = master or os.environ.get(ENV_MASTER) or "local-cluster"
        self.requested = LOCAL_CLUSTER if master == "local-cluster" else master
        self.conf = {"spark.driver.memory": driver_memory, **(conf or {})}
        self.executors = executors
        self.start_timeout, self.call_timeout = start_timeout, call_timeout
        self._own_log_dir = log_dir is None   # removed on a clean close; kept, for its driver.log, after a failure
        self._keep_logs = False
        self.log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="kg-cluster-driver-"))
        self.log_path = self.log_dir / "driver.log"
        self.master = ""
        self.info: dict = {}
        self.standalone: StandaloneCluster | None = None
        self._proc: subprocess.Popen | None = None
        self._reply: int | None = None
        self._buf = b""
        self._next_id = 0

    # -- lifecycle
    def start(self) -> ClusterDriver:
        if self.requested == "auto":
            try:
                return self._start_on(LOCAL_CLUSTER)
            except ClusterStartError as e:
                sys.stderr.write(f"local-cluster did not start ({e}); trying a standalone cluster\n")
                self.close(keep_logs=True)
                self.requested = "standalone"
        if self.requested == "standalone":
            self.standalone = StandaloneCluster(work_dir=self.log_dir / "standalone",
                                                start_timeout=self.start_timeout).__enter__()
            return self._start_on(self.standalone.master_url)
        return self._start_on(self.requested)

    def _start_on(self, master: str) -> ClusterDriver:
        self.master = master
        expected = self.executors or _expected_executors(master)
        read_end, write_end = os.pipe()
        self._reply = read_end
        cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--master", master,
               "--executors", str(expected), "--timeout", str(self.start_timeout),
               "--conf", json.dumps(self.conf), "--reply-fd", str(write_end)]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                          env=_spark_env(), pass_fds=(write_end,), start_new_session=True,
                                          cwd=self.log_dir)
        os.close(write_end)
        try:
            self.info = self._receive(self.start_timeout + 30, "the cluster driver to start", ClusterStartError)
        except BaseException:
            self.close(keep_logs=True)
            raise
        if not self.info.get("ok"):
            err = self.info.get("error", "")
            self.close(keep_logs=True)
            raise ClusterStartError(f"cluster driver on {master} failed to start:\n{err}")
        return self

    def close(self, *, keep_logs: bool = False) -> None:
        """Stops the child and its cluster; the log directory this driver made is removed unless ``keep_logs``."""
        proc, self._proc = self._proc, None
        if proc is not None:
            recorded = tree_identities(proc.pid) if proc.poll() is None else []
            if proc.poll() is None and proc.stdin is not None:
                try:  # polite stop: the child stops its SparkContext, which stops local-cluster's executors
                    proc.stdin.write(b'{"op": "stop"}\n')
                    proc.stdin.flush()
                    proc.stdin.close()
                    proc.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            kill_tree(proc, recorded=recorded)  # whatever is left, including the executors' Python daemons
        if self._reply is not None:
            os.close(self._reply)
            self._reply = None
        self._buf = b""
        if self.standalone is not None:
            self.standalone.close()
            self.standalone = None
        self._keep_logs = self._keep_logs or keep_logs
        if self._own_log_dir and not self._keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> ClusterDriver:
        try:
            return self.start()
        except BaseException:
            self.close(keep_logs=True)
            raise

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(keep_logs=exc_type is not None)

    # -- calls
    def _receive(self, timeout: float, what: str, timeout_error: type[ClusterError] = ClusterError) -> dict:
        """The child's next JSON line; ``timeout_error`` on timeout or if the child exits first."""
        deadline = time.monotonic() + timeout
        assert self._reply is not None and self._proc is not None
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise timeout_error(f"timed out after {timeout:.0f}s waiting for {what}; driver log "
                                    f"{self.log_path}:\n{_tail(self.log_path)}")
            ready, _, _ = select.select([self._reply], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._reply, 1 << 16)
                if not chunk:
                    raise timeout_error(f"the cluster driver exited (code {self._proc.poll()}) while waiting for "
                                       f"{what}; driver log {self.log_path}:\n{_tail(self.log_path)}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def call(self, fn: Callable[..., Any], /, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``fn(spark, **kwargs)`` in the cluster driver; returns its result (a JSON round trip)."""
        if self._proc is None or self._proc.poll() is not None:
            raise ClusterError("the cluster driver is not running; use ClusterDriver as a context manager")
        path, qualname = _function_ref(fn)
        self._next_id += 1
        request = {"op": "call", "id": self._next_id, "file": path, "qualname": qualname, "kwargs": kwargs}
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        try:
            reply = self._receive(timeout or self.call_timeout, f"{qualname} to return")
        except ClusterError:
            self.close(keep_logs=True)  # a late reply would answer the next call: this driver cannot be used any more
            raise
        if not reply.get("ok"):
            raise ClusterCallError(f"{qualname}(**{kwargs!r}) failed in the cluster driver:\n{reply.get('error')}")
        return reply["result"]


def run_in_cluster(fn: Callable[..., Any], /, master: str | None = None, **kwargs: Any) -> Any:
    """One-shot: start a ``ClusterDriver`` on ``master``, return ``fn(spark, **kwargs)``'s result, tear it all down."""
    with ClusterDriver(master) as driver:
        return driver.call(fn, **kwargs)


def cluster_fixture(scope: Literal["session", "package", "module", "class", "function"] = "module",
                    **driver_kwargs: Any) -> Any:
    """A pytest fixture (default module-scoped) yielding a started ``ClusterDriver``; skips if pyspark is missing."""
    import pytest

    @pytest.fixture(scope=scope)
    def cluster() -> Iterator[ClusterDriver]:
        pytest.importorskip("pyspark")
        with ClusterDriver(**driver_kwargs) as driver:
            yield driver

    return cluster


# ----------------------------------------------------------------------------------------------------------------
# functions that run inside the cluster driver (module level, so they can be called like any other)


def _executor_jvm(pid: int) -> tuple[int | None, str | None]:
    """(pid, executor id) of the executor JVM among ``pid``'s ancestors, from their command lines."""
    while pid > 1:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return None, None
        if b"org.apache.spark.executor.CoarseGrainedExecutorBackend" in argv:
            i = argv.index(b"--executor-id")
            return pid, argv[i + 1].decode()
        pid = int(stat[stat.rindex(b")") + 2 :].split()[1])
    return None, None


def task_processes(spark: Any, tasks: int = 8, seconds_per_task: float = 0.3) -> dict:
    """Where tasks run: for each of ``tasks`` tasks, the Python worker's pid and its executor JVM's pid and id.

    Each task sleeps a little, so that every executor is offered work. Also returns the driver's Python and JVM pids.
    """

    def probe(index: int, _rows: Iterator[Any]) -> Iterator[dict]:
        import os as _os
        import time as _time

        _time.sleep(seconds_per_task)
        jvm_pid, executor_id = _executor_jvm(_os.getpid())
        yield {"task": index, "python_pid": _os.getpid(), "jvm_pid": jvm_pid, "executor_id": executor_id}

    sc = spark.sparkContext
    rows = sc.parallelize(range(tasks), tasks).mapPartitionsWithIndex(probe).collect()
    return {"driver_python_pid": os.getpid(), "driver_jvm_pid": sc._gateway.proc.pid, "tasks": rows}


def registered_executors(spark: Any) -> list[str]:
    """Ids of the active executors registered with the driver (the driver itself excluded)."""
    summaries = spark.sparkContext._jsc.sc().statusStore().executorList(True)
    ids = [summaries.apply(i).id() for i in range(summaries.size())]
    return sorted(i for i in ids if i != "driver")


def _serve(args: argparse.Namespace) -> int:
    reply = os.fdopen(args.reply_fd, "wb", buffering=0)

    def send(msg: dict) -> None:
        reply.write(json.dumps(msg).encode() + b"\n")

    try:
        from pyspark.sql import SparkSession

        builder = (
            SparkSession.builder.master(args.master)
            .appName("keygroups-cluster-tests")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            # wait for every executor at start-up (bounded), so jobs really spread over separate processes
            .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
            .config("spark.scheduler.maxRegisteredResourcesWaitingTime", f"{int(args.timeout)}s")
        )
        for k, v in json.loads(args.conf).items():
            builder = builder.config(k, v)
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("WARN")
        deadline = time.monotonic() + args.timeout
        while len(registered_executors(spark)) < args.executors:
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    f"only {registered_executors(spark)} of {args.executors} executors registered with "
                    f"{args.master} within {args.timeout:.0f}s"
                )
            time.sleep(0.5)
    except BaseException:
        send({"ok": False, "error": traceback.format_exc()})
        return 1
    send({"ok": True, "master": args.master, "executors": registered_executors(spark), "pid": os.getpid(),
          "jvm_pid": spark.sparkContext._gateway.proc.pid,  # type: ignore[union-attr]
          "spark_version": spark.version})

    from pyspark import cloudpickle

    modules: dict[str, Any] = {}
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "stop":
            break
        try:
            path = request["file"]
            if path not in modules:
                name = f"_kg_cluster_call_{len(modules)}_{pathlib.Path(path).stem}"
                sys.path.insert(0, os.path.dirname(path))  # its sibling imports (conftest, helpers)
                spec = importlib.util.spec_from_file_location(name, path)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
                modules[path] = module
                # Executors cannot import a test file, nor the helpers beside it that it imported by name.
                here = os.path.dirname(path)
                for m in list(sys.modules.values()):
                    f = getattr(m, "__file__", None)
                    if f and os.path.dirname(os.path.abspath(f)) == here and m.__name__ != "__main__":
                        cloudpickle.register_pickle_by_value(m)
            target: Any = modules[path]
            for part in request["qualname"].split("."):
                target = getattr(target, part)
            result = target(spark, **request["kwargs"])
            send({"id": request["id"], "ok": True, "result": result})
        except BaseException:
            send({"id": request.get("id"), "ok": False, "error": traceback.format_exc()})
    spark.stop()
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="cluster driver child process (started by ClusterDriver)")
    ap.add_argument("--serve", action="store_true", required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--executors", type=int, required=True)
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--conf", default="{}")
    ap.add_argument("--reply-fd", type=int, required=True)
    sys.exit(_serve(ap.parse_args()))
