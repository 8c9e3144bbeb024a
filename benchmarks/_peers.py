"""The peers the benchmarks of issues 32 and 33 measure keygroups against, and how their CPU time is counted.

- :func:`build_java`: compiles a source of ``benchmarks/java/`` with ``javac`` into a cache directory (once per
  source and class path), never into the repository.
- :func:`flink_classpath` and :func:`spark_classpath`: the jars of the ``apache-flink-libraries`` wheel (flink-dist)
  and of the pyspark wheel (``pyspark/jars``).
- :func:`pyflink_python`: the interpreter of a virtualenv of its own holding ``apache-flink`` (PyFlink), made by
  the benchmark on first use under the cache directory (never at test time, never in the project's environment).
- :func:`run_child`: a child process's wall time and its own CPU time (``wait4``), with its output.
- :class:`TreeCPU`: CPU seconds of this process and every descendant (the Spark JVM, Spark's Python workers),
  per kind, read from ``/proc``: what one Spark batch cost each process.

The cache directory is ``$KEYGROUPS_BENCH_CACHE`` or ``~/.cache/keygroups-bench``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

JAVA_DIR = pathlib.Path(__file__).resolve().parent / "java"
PYFLINK_VERSION = "2.3.0"


def cache_dir() -> pathlib.Path:
    d = pathlib.Path(os.environ.get("KEYGROUPS_BENCH_CACHE", pathlib.Path.home() / ".cache" / "keygroups-bench"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _site_packages_dir(package: str) -> pathlib.Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def flink_lib() -> pathlib.Path | None:
    """The directory holding flink-dist-*.jar (``$KEYGROUPS_FLINK_LIB``, or the ``apache-flink-libraries`` wheel's
    ``pyflink/lib``); None without it or without java/javac."""
    if shutil.which("java") is None or shutil.which("javac") is None:
        return None
    candidates = [pathlib.Path(os.environ["KEYGROUPS_FLINK_LIB"])] if os.environ.get("KEYGROUPS_FLINK_LIB") else []
    pyflink = _site_packages_dir("pyflink")
    if pyflink is not None:
        candidates.append(pyflink / "lib")
    return next((lib for lib in candidates if list(lib.glob("flink-dist-*.jar"))), None)


def flink_classpath() -> list[str]:
    lib = flink_lib()
    if lib is None:
        raise RuntimeError("Flink is not installed: pip install apache-flink-libraries==2.3.0 (the test extra has "
                           "it), or set KEYGROUPS_FLINK_LIB to a directory holding flink-dist-2.3.0.jar; java and "
                           "javac 17 must be on PATH")
    return sorted(str(p) for p in lib.glob("*.jar") if p.name.startswith(("flink-dist", "log4j")))


def spark_classpath() -> list[str]:
    pyspark = _site_packages_dir("pyspark")
    if pyspark is None or not (pyspark / "jars").is_dir():
        raise RuntimeError("pyspark's jars are not found (pyspark/jars)")
    return [str(pyspark / "jars" / "*")]


def build_java(source: str, classpath: list[str]) -> str:
    """Compile ``benchmarks/java/<source>`` against ``classpath`` into the cache (once per source text and class
    path); returns the directory of its classes."""
    path = JAVA_DIR / source
    if shutil.which("javac") is None:
        raise RuntimeError(f"javac is not on PATH: a JDK 17 is needed to build {path.name}")
    digest = hashlib.sha256(path.read_bytes() + "\n".join(classpath).encode()).hexdigest()[:16]
    classes = cache_dir() / f"java-{path.stem}-{digest}"
    if not (classes / f"{path.stem}.class").exists():
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f"build-{path.stem}-", dir=cache_dir()))
        done = subprocess.run(["javac", "-nowarn", "-d", str(staging), "-cp", os.pathsep.join(classpath), str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise RuntimeError(f"javac {path.name} failed:\n{done.stderr[-4000:]}")
        try:
            staging.rename(classes)   # atomic: a concurrent build never sees half the classes
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return str(classes)


def pyflink_python(version: str = PYFLINK_VERSION) -> str:
    """The python of ``<cache>/pyflink-venv``, made on first use with ``apache-flink==<version>`` from PyPI (a few
    minutes, several hundred MB); later calls reuse it."""
    venv = cache_dir() / "pyflink-venv"
    python = venv / "bin" / "python"
    marker = venv / f"installed-apache-flink=={version}"
    if marker.exists() and python.exists():
        return str(python)
    base = pathlib.Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    print(f"making the PyFlink virtualenv {venv} (apache-flink=={version}; once, a few minutes)", flush=True)
    if not python.exists():
        subprocess.run([str(base if base.exists() else sys.executable), "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"apache-flink=={version}"], check=True)
    marker.touch()
    return str(python)


@dataclass(frozen=True)
class ChildRun:
    """A finished child process: its exit code, wall seconds, CPU seconds (user + system, its own and its waited-for
    descendants', from ``wait4``), and its output."""

    returncode: int
    wall: float
    cpu: float
    stdout: str
    stderr: str

    def check(self, what: str) -> ChildRun:
        if self.returncode != 0:
            raise RuntimeError(f"{what} failed ({self.returncode}):\n{self.stdout[-2000:]}\n{self.stderr[-4000:]}")
        return self

    def figures(self, prefix: str = "records=") -> dict[str, int]:
        """The ``name=int`` pairs of the last output line that starts with ``prefix``."""
        line = next(ln for ln in reversed(self.stdout.splitlines()) if ln.startswith(prefix))
        return {k: int(v) for k, v in (part.split("=", 1) for part in line.split())}


def run_child(cmd: list[str], *, timeout: float = 1800, env: dict[str, str] | None = None) -> ChildRun:
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return ChildRun(proc.returncode, wall, usage.ru_utime + usage.ru_stime, out.read(), err.read())


# ---- CPU of a process tree ------------------------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds: user + system of the process and of its reaped children) from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # after the command: state ppid ... utime(12) stime(13) cutime(14) cstime(15), counted from state = 0
    return int(fields[1]), sum(int(x) for x in fields[11:15]) / _TICK


def _kind(pid: int) -> str:
    if pid == os.getpid():
        return "driver"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return "other"
    if os.path.basename(argv0) == "java":
        return "jvm"
    if "python" in os.path.basename(argv0):
        return "python workers"
    return "other"


class TreeCPU:
    """CPU seconds of this process and all its descendants, by kind: ``driver`` (this Python process), ``jvm``
    (the Spark JVM), ``python workers`` (Spark's Python daemon and workers). A finished process's CPU stays counted
    in its parent's reaped-children figures (Spark's daemon reaps its workers), so nothing is lost or counted twice
    as long as every process in between lives. ``sample()`` returns the figures now; subtract two samples."""

    KINDS = ("driver", "jvm", "python workers", "other")

    def sample(self) -> dict[int, tuple[str, float]]:
        """Every process of the tree now: pid -> (kind, CPU seconds)."""
        stats: dict[int, tuple[int, float]] = {}
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                s = _stat(int(entry))
                if s is not None:
                    stats[int(entry)] = s
                    children.setdefault(s[0], []).append(int(entry))
        out: dict[int, tuple[str, float]] = {}
        todo = [os.getpid()]
        while todo:
            pid = todo.pop()
            if pid in stats:
                out[pid] = (_kind(pid), stats[pid][1])
            todo.extend(children.get(pid, []))
        return out

    @classmethod
    def delta(cls, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
        """CPU seconds per kind between two samples: each process's growth (a new one's whole CPU). A process that
        ended in between and was not reaped by a living one (whose reaped-children time then grows) is lost: the
        figures are a lower bound, never negative."""
        totals = dict.fromkeys(cls.KINDS, 0.0)
        for pid, (kind, cpu) in after.items():
            previous = before.get(pid)
            totals[kind] += cpu - (previous[1] if previous is not None and previous[0] == kind else 0.0)
        return totals


def load() -> str:
    return "load %.1f %.1f %.1f" % os.getloadavg()


# ---- Spark: the session, and Spark's own time for a call's jobs ---------------------------------------------------

def spark_session(master: str = "local[2]", app: str = "keygroups-bench", *, shuffle_partitions: int = 2,
                  driver_memory: str = "3g", extra_classpath: list[str] | None = None,
                  conf: dict[str, str] | None = None):  # noqa: ANN201 (pyspark is imported lazily)
    """A local session as the tests make it (Arrow on, UI off, UTC), with ``extra_classpath`` on the driver's class
    path (e.g. a benchmark's compiled Java classes)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master).appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.default.parallelism", str(shuffle_partitions))
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.driver.memory", driver_memory)
        .config("spark.sql.session.timeZone", "UTC")
    )
    if extra_classpath:
        builder = builder.config("spark.driver.extraClassPath", os.pathsep.join(extra_classpath))
    for k, v in (conf or {}).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def spark_setting(text: str) -> tuple[str, str]:
    """A ``--spark-conf KEY=VALUE`` argument, as ``(key, value)``."""
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (a Spark setting), got {text!r}")
    return key, value


@dataclass(frozen=True)
class SparkTime:
    """One timed call on the driver: its wall seconds, the seconds in which at least one of its Spark jobs ran
    (the union of the jobs' submission-to-completion intervals, from Spark's status store; a job's time includes
    its scheduling, its tasks, the Python workers and the shuffle), the number of jobs, and the CPU seconds of each
    kind of process (:class:`TreeCPU`) over the call."""

    wall: float
    spark_jobs: float
    jobs: int
    cpu: dict[str, float]

    @property
    def outside_jobs(self) -> float:
        """The call's wall seconds while none of its Spark jobs ran: the driver's own work (planning DataFrames
        in Catalyst, py4j calls, keygroups' driver code, storage round trips), and nothing of Spark's jobs."""
        return self.wall - self.spark_jobs


class SparkJobClock:
    """Times calls on the driver and splits each into Spark's jobs and the rest (see :class:`SparkTime`). Each call
    runs under a job group of its own, so that its jobs are found by id in Spark's status store (kept by Spark's
    listener whether or not the UI is on)."""

    def __init__(self, spark) -> None:  # noqa: ANN001
        self.sc = spark.sparkContext
        self.store = self.sc._jsc.sc().statusStore()
        self.tree = TreeCPU()
        self._n = 0

    def time(self, fn):  # noqa: ANN001, ANN201
        """``(fn(), SparkTime)``."""
        self._n += 1
        group = f"kg-bench-{os.getpid()}-{self._n}"
        self.sc.setJobGroup(group, group)
        cpu0 = self.tree.sample()
        start = time.time()
        t0 = time.perf_counter()
        try:
            result = fn()
        finally:
            wall = time.perf_counter() - t0
            end = time.time()
            cpu = TreeCPU.delta(cpu0, self.tree.sample())
            self.sc.setLocalProperty("spark.jobGroup.id", None)
            self.sc.setLocalProperty("spark.job.description", None)
        jobs = self._intervals(group)
        busy = _union([(max(a, start), min(b, end)) for a, b in jobs])
        return result, SparkTime(wall, busy, len(jobs), cpu)

    def _intervals(self, group: str) -> list[tuple[float, float]]:
        ids = list(self.sc.statusTracker().getJobIdsForGroup(group))
        out = []
        deadline = time.perf_counter() + 10
        for job_id in ids:
            while True:   # the status store hears of a job's end through the listener bus, a moment later
                data = self.store.job(job_id)
                if data.completionTime().isDefined() or time.perf_counter() > deadline:
                    break
                time.sleep(0.01)
            if data.submissionTime().isDefined() and data.completionTime().isDefined():
                out.append((data.submissionTime().get().getTime() / 1000, data.completionTime().get().getTime() / 1000))
        return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
