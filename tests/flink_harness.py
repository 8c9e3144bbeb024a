"""Runs tests/flink/SavepointJob.java on a real Flink 2.3 (the jars of the `apache-flink-libraries` package, or of the
directory in KEYGROUPS_FLINK_LIB): compiles it once per source version into a cache directory, then starts a JVM
per job. Each job runs on Flink's embedded MiniCluster, so nothing else needs to be installed besides Java 17."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile

from jvm_options import JVM_OPTIONS

FLINK_DIR = pathlib.Path(__file__).parent / "flink"
SOURCE = FLINK_DIR / "SavepointJob.java"
FIXTURES = FLINK_DIR / "fixtures"


def flink_lib() -> pathlib.Path | None:
    """The directory holding flink-dist-*.jar, or None when Flink or Java is missing."""
    if shutil.which("java") is None or shutil.which("javac") is None:
        return None
    configured = os.environ.get("KEYGROUPS_FLINK_LIB")
    candidates = [pathlib.Path(configured)] if configured else []
    spec = importlib.util.find_spec("pyflink")
    if spec is not None and spec.submodule_search_locations:
        candidates += [pathlib.Path(p) / "lib" for p in spec.submodule_search_locations]
    for lib in candidates:
        if list(lib.glob("flink-dist-*.jar")):
            return lib
    return None


def missing_reason() -> str:
    return ("Flink is not installed: pip install apache-flink-libraries==2.3.0 (it ships flink-dist), or set "
            "KEYGROUPS_FLINK_LIB to a directory holding flink-dist-2.3.0.jar; java and javac 17 must be on PATH")


def _classpath(lib: pathlib.Path) -> list[str]:
    return sorted(str(p) for p in lib.glob("*.jar") if p.name.startswith(("flink-dist", "log4j")))


def build() -> str:
    """Compile the job (once per source and Flink version) and return the classpath to run it with."""
    lib = flink_lib()
    if lib is None:
        raise RuntimeError(missing_reason())
    jars = _classpath(lib)
    digest = hashlib.sha256(SOURCE.read_bytes() + "\n".join(jars).encode()).hexdigest()[:16]
    classes = pathlib.Path(tempfile.gettempdir()) / f"keygroups-flink-job-{digest}"
    if not (classes / "SavepointJob.class").exists():
        staging = pathlib.Path(tempfile.mkdtemp(prefix="keygroups-flink-build-"))
        subprocess.run(["javac", "-nowarn", "-d", str(staging), "-cp", os.pathsep.join(jars), str(SOURCE)],
                       check=True, capture_output=True, text=True)
        try:
            staging.rename(classes)   # atomic: two test processes never see a half-compiled directory
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return os.pathsep.join([str(classes), *jars])


class FlinkJobTimeout(AssertionError):
    """A Flink job's JVM ran past its timeout; the message holds its output and every thread's stack."""


def run_java(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a JVM; one still running after ``timeout`` seconds is asked for a thread dump (SIGQUIT: the JVM prints
    every thread's stack on its stdout and goes on), killed, and reported with that dump and its output, so that a
    hang says where it hung. The JVM gets a temporary directory of its own (``java.io.tmpdir``), removed when it
    exits: Flink's MiniCluster and the jobs' checkpoint directories would otherwise stay in /tmp (the jobs move what
    they return into the output directory given to them)."""
    with tempfile.TemporaryDirectory(prefix="keygroups-jvm-") as tmp:
        cmd = [cmd[0], f"-Djava.io.tmpdir={tmp}", *cmd[1:]]
        return _run_java(cmd, timeout)


def _run_java(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGQUIT)
        try:
            out, err = proc.communicate(timeout=5)   # a JVM that exits on its own meanwhile
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise FlinkJobTimeout(
            f"{' '.join(cmd[cmd.index('-cp') + 2:])} ran more than {timeout:g} s and was killed; its stdout (with the "
            f"JVM's thread dump at the end):\n{out[-40_000:]}\n--- its stderr:\n{err[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = ["java", "-Xmx768m", *JVM_OPTIONS, "-cp", build(), "SavepointJob", *map(str, args)]
    return run_java(cmd, timeout)


@dataclasses.dataclass(frozen=True)
class Fixture:
    """One savepoint written by SavepointJob: its parameters name it."""

    parallelism: int
    max_parallelism: int
    compression: bool
    keys: int
    key_type: str        # long | string | tuple (Tuple2<Long, String>)
    backend: str         # hashmap | rocksdb
    inline: bool         # every chunk inlined in _metadata, or each in a file of its own

    @property
    def name(self) -> str:
        return (f"p{self.parallelism}-mp{self.max_parallelism}-{self.key_type}-{self.backend}-"
                f"{'inline' if self.inline else 'files'}-{'snappy' if self.compression else 'plain'}")


def write_savepoint(out: pathlib.Path, f: Fixture) -> pathlib.Path:
    """Run the writing job; `out/savepoint` is the savepoint, `out/expected.txt` what it holds."""
    r = _run(["write", out, f.parallelism, f.max_parallelism, str(f.compression).lower(), f.keys, f.key_type,
              f.backend, str(f.inline).lower()])
    if r.returncode != 0:
        raise RuntimeError(f"the Flink writer job failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return out / "savepoint"


def check_savepoint(savepoint: pathlib.Path, parallelism: int, key_type: str, expected: pathlib.Path,
                    dump_dir: pathlib.Path) -> tuple[bool, str]:
    """Restore `savepoint` into the Flink job at `parallelism` and compare everything it restored with `expected`.
    Returns (equal, the job's report); what Flink restored is in `dump_dir/restored.txt`."""
    r = _run(["check", savepoint, parallelism, key_type, expected, dump_dir])
    if r.returncode not in (0, 1):
        raise RuntimeError(f"the Flink checking job failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return r.returncode == 0, r.stdout[-4000:]


def restore_runtime_ms(savepoint: pathlib.Path | None, parallelism: int, key_type: str, backend: str) -> int:
    """Flink's net runtime (ms) of the job restoring ``savepoint`` (None: restoring nothing) and then finishing."""
    r = _run(["restore", savepoint if savepoint is not None else "-", parallelism, key_type, backend])
    if r.returncode != 0:
        raise RuntimeError(f"the Flink restore job failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("netRuntimeMs="))
    return int(line.split()[0].split("=")[1])


#: The committed fixtures (tests/flink/fixtures/<name>/): small, written by generate_fixtures.py.
FIXTURE_SET = [
    Fixture(2, 128, False, 20, "long", "hashmap", True),
    Fixture(1, 128, True, 20, "long", "hashmap", False),
    Fixture(3, 256, True, 20, "string", "rocksdb", False),
    Fixture(2, 4096, False, 20, "long", "rocksdb", True),
    Fixture(2, 128, False, 20, "tuple", "hashmap", False),
]


def _run_unsupported_types_job(args: list[str]) -> subprocess.CompletedProcess:
    """Compile tests/flink/UnsupportedTypesJob.java (once per source and Flink version) and run it with ``args``."""
    lib = flink_lib()
    if lib is None:
        raise RuntimeError(missing_reason())
    source = FLINK_DIR / "UnsupportedTypesJob.java"
    jars = _classpath(lib)
    digest = hashlib.sha256(source.read_bytes() + "\n".join(jars).encode()).hexdigest()[:16]
    classes = pathlib.Path(tempfile.gettempdir()) / f"keygroups-flink-unsupported-{digest}"
    if not (classes / "UnsupportedTypesJob.class").exists():
        staging = pathlib.Path(tempfile.mkdtemp(prefix="keygroups-flink-build-"))
        subprocess.run(["javac", "-nowarn", "-d", str(staging), "-cp", os.pathsep.join(jars), str(source)],
                       check=True, capture_output=True, text=True)
        try:
            staging.rename(classes)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    cmd = ["java", "-Xmx768m", *JVM_OPTIONS, "-cp", os.pathsep.join([str(classes), *jars]),
           "UnsupportedTypesJob", *args]
    return run_java(cmd, 300)


def write_unsupported_types_savepoint(out: pathlib.Path, keys: int = 12) -> pathlib.Path:
    """Run UnsupportedTypesJob's writer (types keygroups does not map: POJO, Kryo, a user serializer, ..., beside
    enums, arrays, Long and String): `out/savepoint` is its savepoint, `out/expected.txt` what it holds."""
    r = _run_unsupported_types_job(["write", str(out), str(keys)])
    if r.returncode != 0:
        raise RuntimeError(f"UnsupportedTypesJob failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return out / "savepoint"


def check_unsupported_types_savepoint(savepoint: pathlib.Path, parallelism: int, expected: pathlib.Path,
                                      dump_dir: pathlib.Path) -> tuple[bool, str]:
    """Restore `savepoint` (an export of the states keygroups maps) into UnsupportedTypesJob's operator at
    `parallelism` and compare what Flink restored with `expected`'s lines of those states. (equal, the report)"""
    r = _run_unsupported_types_job(["check", str(savepoint), str(parallelism), str(expected), str(dump_dir)])
    if r.returncode not in (0, 1):
        raise RuntimeError(f"the checking job failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return r.returncode == 0, r.stdout[-4000:]
