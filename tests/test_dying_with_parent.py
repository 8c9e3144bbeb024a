"""keygroups._subprocess.dying_with_parent: a helper process (the local Kafka broker, the test suite's S3 server) is
killed by the kernel when the process that started it dies, without Python code between fork and exec."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from keygroups._subprocess import _setpriv, dying_with_parent


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().split(")")[-1].split()[0] != "Z"   # a zombie has died
    except FileNotFoundError:
        return False


def _program(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0]


@pytest.mark.skipif(_setpriv() is None, reason="needs Linux and util-linux's setpriv with --pdeathsig")
def test_the_helper_dies_when_the_process_that_started_it_is_killed(tmp_path):
    setpriv = os.fsencode(_setpriv())
    pid_file = tmp_path / "helper.pid"
    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, time
        from keygroups._subprocess import dying_with_parent
        helper = subprocess.Popen(dying_with_parent(["sleep", "300"]))
        open({str(pid_file)!r}, "w").write(str(helper.pid))
        time.sleep(300)
    """)])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the starter never started its helper"
            time.sleep(0.05)
        helper = int(pid_file.read_text())
        assert _alive(helper)
        # setpriv execs the helper in its own process; the pid file can be written before that exec
        deadline = time.monotonic() + 30
        while (program := _program(helper)) != b"sleep":
            assert program == setpriv, f"the helper runs {program!r}, neither setpriv nor sleep"
            assert time.monotonic() < deadline, "setpriv never exec'd the helper"
            time.sleep(0.05)
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait()
        deadline = time.monotonic() + 30
        while _alive(helper):
            assert time.monotonic() < deadline, f"the helper {helper} outlived the process that started it"
            time.sleep(0.05)
    finally:
        starter.kill()
        starter.wait()


def test_without_setpriv_the_command_is_unchanged(monkeypatch):
    monkeypatch.setattr("keygroups._subprocess._setpriv", lambda: None)
    assert dying_with_parent(["tansu", "broker"]) == ["tansu", "broker"]


def test_helpers_start_beside_grpc_threads():
    """The S3 server failed to start with SIGABRT in a test process where Spark Connect's gRPC client had threads
    (``preexec_fn`` ran gRPC's fork handlers in the child); started through ``dying_with_parent`` every start
    execs."""
    grpc = pytest.importorskip("grpc")
    channel = grpc.insecure_channel("127.0.0.1:1")   # a channel trying to connect: gRPC's threads are busy
    try:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channel).result(timeout=0.5)
        codes = [subprocess.run(dying_with_parent(["true"]), capture_output=True).returncode for _ in range(20)]
    finally:
        channel.close()
    assert codes == [0] * 20
