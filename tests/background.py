"""Processes some tests wait for, started in the background as soon as collection ends: builds and end-to-end runs
whose only input is the checkout (each in a directory of its own), so that they run while the rest of the run
waits on sleeps, sockets and JVMs (the suite uses well under its two cores on average) instead of in front of the
tests that need them. A pytest plugin (conftest's ``pytest_plugins``): a process starts only when a selected test
uses its fixture, at most ``AT_ONCE`` at a time in the order the tests need them, at the lowest CPU priority
(raised back when a test waits for it, where that is allowed); it is killed and its directory removed when the run
ends (kept when the process failed, for its logs). The test judges its exit code and output as before. Under
pytest-xdist each process runs once for the whole run, whichever worker claims it first (see ``_SHARED_ROOT``).

Registered here (session fixtures):

- ``shipped_environment``: the .tar.gz docs/streaming-job.md ships with ``--archives``, a virtualenv holding the
  keygroups wheel built from this checkout and its dependencies (two minutes of compiling the Cython modules):

      python -m pip wheel --no-deps [--no-build-isolation] -w wheels <checkout>
      python -m venv --copies env
      env/bin/python -m pip install <wheel> "pandas>=2.2,<3"
      tar czf environment.tar.gz -C env .

- ``api_reference_build``: ``python docs/build_api.py <directory>/api``, as CI builds the API reference.

A test module registers its own with ``background_fixture(name, argv)`` (``{dir}`` in ``argv`` is the process's
directory), e.g. the ``keygroups demo`` runs of tests/test_cli.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).parents[1]
#: The modules of pyproject.toml's build requirements (scikit-build-core, cython, cython-cmake, numpy).
_BUILD_MODULES = ("scikit_build_core", "Cython", "cython_cmake", "numpy")


def build_shipped_environment(root: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The archive of a fresh virtualenv with the wheel of ``root`` and its dependencies, in ``out``."""
    wheels = out / "wheels"
    # Without build isolation only where every build requirement of pyproject.toml is already installed (a
    # contributor's editable set-up); on a fresh machine pip builds the wheel in an isolated environment.
    isolation = ["--no-build-isolation"] if all(importlib.util.find_spec(m) is not None for m in _BUILD_MODULES) else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                    "-w", str(wheels), str(root)], cwd=root, check=True, timeout=1200)
    env_dir = out / "env"
    subprocess.run([sys.executable, "-m", "venv", "--copies", str(env_dir)], check=True, timeout=300)
    [wheel] = wheels.glob("keygroups-*.whl")
    subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel), "pandas>=2.2,<3"],
                   check=True, timeout=1200)
    archive = out / "environment.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:   # entries relative to the environment's root
        for entry in sorted(env_dir.iterdir()):
            tar.add(entry, arcname=entry.name)
    shutil.rmtree(env_dir)   # only the archive is shipped
    return archive


@dataclasses.dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]       # "{dir}" stands for the process's directory
    env: Mapping[str, str]      # on top of this process's environment
    timeout: float              # seconds from its start


@dataclasses.dataclass(frozen=True)
class Finished:
    """A background process that ended: its directory, exit code and output (like ``subprocess.CompletedProcess``)."""

    directory: pathlib.Path
    returncode: int
    stdout: str
    stderr: str


_COMMANDS: dict[str, Command] = {
    "shipped_environment": Command((sys.executable, __file__, "shipped-environment", str(ROOT), "{dir}"), {}, 1800),
    "api_reference_build": Command((sys.executable, str(ROOT / "docs" / "build_api.py"), "{dir}/api"), {}, 600),
}


#: Under pytest-xdist, the directory the controller makes for the run's background processes, named in this variable
#: for its workers: each process runs once for the whole run, in ``<root>/<name>``, started by the first worker to
#: claim it (an atomic ``mkdir``); any worker waits for it through the files it leaves there.
_SHARED_ROOT = "KEYGROUPS_TEST_BACKGROUND_ROOT"


def _shared_root() -> pathlib.Path | None:
    root = os.environ.get(_SHARED_ROOT)
    return pathlib.Path(root) if root else None


class BackgroundProcess:
    """A registered command in a child process: its own process group, niceness 19 unless a test already waits for
    it, its output, process group and (when it ends) exit code in files of its directory, so that any process of
    the run can wait for it."""

    def __init__(self, name: str, *, niced: bool = True) -> None:
        command = _COMMANDS[name]
        self.name, self.timeout = name, command.timeout
        self.finished: Finished | None = None
        root = _shared_root()
        if root is None:
            self.dir = pathlib.Path(tempfile.mkdtemp(prefix=f"kg-{name.replace('_', '-')}-"))
        else:
            self.dir = root / name
            try:
                self.dir.mkdir()
            except FileExistsError:   # another worker started it: its files say when it ends
                return
        nice = ["nice", "-n", "19"] if niced and shutil.which("nice") else []
        argv = [a.replace("{dir}", str(self.dir)) for a in command.argv]
        with open(self.dir / ".stdout", "wb") as out, open(self.dir / ".stderr", "wb") as err:
            proc = subprocess.Popen([*nice, sys.executable, __file__, "record", str(self.dir), *argv],
                                    stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT,
                                    env={**os.environ, **command.env}, start_new_session=True)
        _write(self.dir / ".pgid", str(proc.pid))   # its group: start_new_session
        self._proc = proc   # kept: a Popen collected while its process runs warns

    def running(self) -> bool:
        return not (self.dir / ".returncode").exists()

    def wait(self) -> Finished:
        if self.finished is not None:
            return self.finished
        pgid = _pgid(self.dir)
        if self.running() and pgid is not None:   # the run waits on it now: normal priority, where allowed
            try:
                for pid in _group(pgid):
                    os.setpriority(os.PRIO_PROCESS, pid, 0)
            except OSError:
                pass
        waited = time.time()
        started = (self.dir / ".pgid").stat().st_mtime if pgid is not None else waited
        while self.running():
            if time.time() - started > self.timeout:
                _kill(self.dir)
                pytest.fail(f"the background process {self.name!r} took over {self.timeout:.0f} s")
            time.sleep(0.2)
        sys.stderr.write(f"\nbackground {self.name}: started {waited - started:.0f} s before a test needed it, "
                         f"then {time.time() - waited:.0f} s of waiting\n")
        self.finished = Finished(self.dir, int((self.dir / ".returncode").read_text()),
                                 (self.dir / ".stdout").read_text(errors="replace"),
                                 (self.dir / ".stderr").read_text(errors="replace"))
        return self.finished


def _write(path: pathlib.Path, text: str) -> None:
    """``text`` in ``path``, seen whole or not at all by another process."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _pgid(directory: pathlib.Path) -> int | None:
    try:
        return int((directory / ".pgid").read_text())
    except (OSError, ValueError):
        return None


def _kill(directory: pathlib.Path) -> None:
    """Kill the process group of the background process in ``directory`` if it still runs."""
    pgid = _pgid(directory)
    if pgid is not None and not (directory / ".returncode").exists():
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _clean(directory: pathlib.Path) -> None:
    """Stop the background process in ``directory`` and remove the directory, kept when the process failed."""
    _kill(directory)
    try:
        code = int((directory / ".returncode").read_text())
    except (OSError, ValueError):
        code = 0   # killed before it ended: nothing to judge
    if code != 0:
        sys.stderr.write(f"\nbackground {directory.name} failed: its directory is kept, {directory}\n")
        return
    shutil.rmtree(directory, ignore_errors=True)


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (a build and the compilers it runs)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


#: At most this many run at once in the background, over all workers (a demo's JVMs take a GiB or two; the machine
#: has two cores).
AT_ONCE = 3
_running: dict[str, BackgroundProcess] = {}
_queued: list[str] = []   # in the order the run's tests first need them


def _running_count() -> int:
    root = _shared_root()
    if root is None:
        return sum(p.running() for p in _running.values())
    return sum(not (d / ".returncode").exists() for d in root.iterdir() if d.is_dir())


def _pump() -> None:
    """Start queued processes while fewer than ``AT_ONCE`` are still running."""
    while _queued and _running_count() < AT_ONCE:
        name = _queued.pop(0)
        _running[name] = BackgroundProcess(name)


def _started(name: str) -> BackgroundProcess:
    if name not in _running:   # needed now: it goes ahead of the queue, at normal priority
        if name in _queued:
            _queued.remove(name)
        _running[name] = BackgroundProcess(name, niced=False)
    return _running[name]


def background_fixture(name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                       timeout: float = 900, scope: Any = "module") -> Any:
    """A fixture ``name`` giving the ``Finished`` run of ``argv`` (started when collection ends if a selected test
    uses the fixture, else when first asked for). Assign it to a module attribute of a test module."""
    if name in _COMMANDS and _COMMANDS[name].argv != tuple(argv):
        raise ValueError(f"background command {name!r} is already registered with other arguments")
    _COMMANDS[name] = Command(tuple(argv), dict(env or {}), timeout)

    @pytest.fixture(scope=scope, name=name)
    def finished() -> Finished:
        return _started(name).wait()

    return finished


def _is_xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and getattr(config.option, "dist", "no") != "no"


def pytest_configure(config: pytest.Config) -> None:
    if _is_xdist_controller(config) and _SHARED_ROOT not in os.environ:   # the workers inherit the variable
        os.environ[_SHARED_ROOT] = tempfile.mkdtemp(prefix="kg-background-")


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    # Under xdist every worker collects every test: the workers queue the same processes, and each starts once.
    for item in session.items:
        for name in getattr(item, "fixturenames", ()):
            if name in _COMMANDS and name not in _queued and name not in _running:
                _queued.append(name)
    _pump()


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _pump()


def pytest_unconfigure(config: pytest.Config) -> None:
    _queued.clear()
    root = _shared_root()
    if root is None:
        while _running:
            _clean(_running.popitem()[1].dir)
    elif _is_xdist_controller(config):   # every worker has ended: no test waits for these any more
        for directory in sorted(root.iterdir()):
            if directory.is_dir():
                _clean(directory)
        if not any(root.iterdir()):   # a failed process's directory stays for its logs
            root.rmdir()
    # a worker leaves the processes it started to the controller: another worker may still wait for them


@pytest.fixture(scope="session")
def shipped_environment() -> pathlib.Path:
    """The .tar.gz of a virtualenv with keygroups (the wheel built from this checkout) and its dependencies."""
    done = _started("shipped_environment").wait()
    assert done.returncode == 0, f"building the shipped environment failed ({done.returncode}):\n" + \
        (done.stdout + done.stderr)[-6000:]
    return done.directory / "environment.tar.gz"


@pytest.fixture(scope="session")
def api_reference_build() -> Finished:
    """``python docs/build_api.py`` run into ``<directory>/api``: judge ``returncode``, ``stdout``, ``stderr``."""
    return _started("api_reference_build").wait()


def _record(directory: pathlib.Path, argv: list[str]) -> int:
    """Run ``argv`` (output and environment inherited) and leave its exit code in ``directory/.returncode``."""
    code = subprocess.call(argv)
    _write(directory / ".returncode", str(code))
    return code


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"] and len(sys.argv) > 3:
        sys.exit(0 if _record(pathlib.Path(sys.argv[2]), sys.argv[3:]) == 0 else 1)
    if sys.argv[1:2] != ["shipped-environment"] or len(sys.argv) != 4:
        sys.exit("usage: background.py shipped-environment CHECKOUT DIRECTORY | record DIRECTORY COMMAND...")
    build_shipped_environment(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]))
