"""Processes some tests wait for, started in the background as soon as collection ends: builds and end-to-end runs
whose only input is the checkout (each in a directory of its own), so that they run while the rest of the run
waits on sleeps, sockets and JVMs (the suite uses well under its two cores on average) instead of in front of the
tests that need them. A pytest plugin (conftest's ``pytest_plugins``): a process starts only when a selected test
uses its fixture, at most ``AT_ONCE`` at a time in the order the tests need them, at the lowest CPU priority
(raised back when a test waits for it, where that is allowed); it is killed and its directory removed when the run
ends (kept when the process failed, for its logs). The test judges its exit code and output as before.

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


class BackgroundProcess:
    """A registered command in a child process: its own process group, niceness 19 unless a test already waits for
    it, its output in its directory."""

    def __init__(self, name: str, *, niced: bool = True) -> None:
        command = _COMMANDS[name]
        self.name, self.timeout = name, command.timeout
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix=f"kg-{name.replace('_', '-')}-"))
        nice = ["nice", "-n", "19"] if niced and shutil.which("nice") else []
        argv = [a.replace("{dir}", str(self.dir)) for a in command.argv]
        with open(self.dir / ".stdout", "wb") as out, open(self.dir / ".stderr", "wb") as err:
            self.proc = subprocess.Popen([*nice, *argv], stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT,
                                         env={**os.environ, **command.env}, start_new_session=True)
        self.started = time.monotonic()
        self.finished: Finished | None = None

    def wait(self) -> Finished:
        if self.finished is not None:
            return self.finished
        if self.proc.poll() is None:   # the run waits on it now: normal priority, where that is allowed
            try:
                for pid in _group(self.proc.pid):
                    os.setpriority(os.PRIO_PROCESS, pid, 0)
            except OSError:
                pass
        waited = time.monotonic()
        try:
            code = self.proc.wait(timeout=max(1.0, self.timeout - (waited - self.started)))
        except subprocess.TimeoutExpired:
            self.close()
            pytest.fail(f"the background process {self.name!r} took over {self.timeout:.0f} s")
        sys.stderr.write(f"\nbackground {self.name}: started {waited - self.started:.0f} s before a test needed "
                         f"it, then {time.monotonic() - waited:.0f} s of waiting\n")
        self.finished = Finished(self.dir, code, (self.dir / ".stdout").read_text(errors="replace"),
                                 (self.dir / ".stderr").read_text(errors="replace"))
        return self.finished

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        if self.finished is not None and self.finished.returncode != 0:
            sys.stderr.write(f"\nbackground {self.name} failed: its directory is kept, {self.dir}\n")
            return
        shutil.rmtree(self.dir, ignore_errors=True)


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


#: At most this many run at once in the background (a demo's JVMs take a GiB or two; the machine has two cores).
AT_ONCE = 3
_running: dict[str, BackgroundProcess] = {}
_queued: list[str] = []   # in the order the run's tests first need them


def _pump() -> None:
    """Start queued processes while fewer than ``AT_ONCE`` are still running."""
    while _queued and sum(p.proc.poll() is None for p in _running.values()) < AT_ONCE:
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


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    for item in session.items:
        for name in getattr(item, "fixturenames", ()):
            if name in _COMMANDS and name not in _queued and name not in _running:
                _queued.append(name)
    _pump()


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _pump()


def pytest_unconfigure(config: pytest.Config) -> None:
    _queued.clear()
    while _running:
        _running.popitem()[1].close()


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


if __name__ == "__main__":
    if sys.argv[1:2] != ["shipped-environment"] or len(sys.argv) != 4:
        sys.exit("usage: background.py shipped-environment CHECKOUT DIRECTORY")
    build_shipped_environment(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]))
