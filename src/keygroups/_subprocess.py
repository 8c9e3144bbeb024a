"""Helper processes (a local broker, the test suite's servers) that die with the process that started them."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from collections.abc import Sequence


@functools.cache
def _setpriv() -> str | None:
    """util-linux's ``setpriv`` where it has ``--pdeathsig`` (util-linux 2.33+), else None."""
    found = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    if found is None:
        return None
    try:
        ok = subprocess.run([found, "--pdeathsig", "KILL", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return found if ok else None


def dying_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv`` run so that the kernel kills it with SIGKILL when the thread that started it dies (Linux's
    ``PR_SET_PDEATHSIG``, set by ``setpriv`` just before it execs ``argv``), so that no helper outlives a killed
    run. Not through ``subprocess``'s ``preexec_fn``: Python code in the forked child runs gRPC's fork handlers
    where Spark Connect's client has threads, and the child can abort before its exec. Where ``setpriv`` is
    missing, ``argv`` unchanged: the caller stops the process itself."""
    setpriv = _setpriv()
    return [setpriv, "--pdeathsig", "KILL", *argv] if setpriv is not None else list(argv)
