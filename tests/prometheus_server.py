"""A real Prometheus server for tests: Debian's ``prometheus`` binary (``apt-get install prometheus``), started on
127.0.0.1 with a scrape config naming the test's targets, queried through its HTTP API.

    with PrometheusServer.start({"keygroups": [f"127.0.0.1:{port}"]}) as prometheus:
        prometheus.wait_for('keygroups_batches_total{job_name="x"}', 3)

Every port is picked free at run time and bound to 127.0.0.1; the server's data and log live in a temporary
directory removed at the end. Start-up waits (bounded) for ``/-/ready``; a server that exits or does not answer in
time raises with the tail of its log. ``PROMETHEUS`` (environment) names another binary than ``/usr/bin/prometheus``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

START_TIMEOUT_S = 60.0


def binary() -> str | None:
    """The prometheus binary to run (None: not installed)."""
    path = os.environ.get("PROMETHEUS") or shutil.which("prometheus") or "/usr/bin/prometheus"
    return path if os.path.exists(path) and os.access(path, os.X_OK) else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PrometheusServer:
    url: str
    process: subprocess.Popen[bytes] = field(repr=False)
    workdir: str = field(repr=False)

    @classmethod
    @contextmanager
    def start(cls, targets: Mapping[str, Sequence[str]], *, scrape_interval: str = "2s") -> Iterator[PrometheusServer]:
        """A server scraping ``targets`` (scrape job name -> ``host:port`` targets) every ``scrape_interval``
        (also the scrape's timeout: 2 s, as a test process on a busy 2-core machine can take over 1 s to answer)."""
        path = binary()
        if path is None:
            raise FileNotFoundError("prometheus is not installed (apt-get install prometheus)")
        workdir = tempfile.mkdtemp(prefix="keygroups-prometheus-")
        jobs = "".join(f"  - job_name: {json.dumps(name)}\n    static_configs:\n      - targets: {json.dumps(list(t))}\n"
                       for name, t in targets.items())
        config = os.path.join(workdir, "prometheus.yml")
        with open(config, "w") as f:
            f.write(f"global:\n  scrape_interval: {scrape_interval}\n  evaluation_interval: {scrape_interval}\n"
                    f"scrape_configs:\n{jobs}")
        port = free_port()
        log = open(os.path.join(workdir, "prometheus.log"), "wb")
        process = subprocess.Popen(
            [path, f"--config.file={config}", f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        server = cls(f"http://127.0.0.1:{port}", process, workdir)
        try:
            server._wait_ready()
            yield server
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
            shutil.rmtree(workdir, ignore_errors=True)

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.workdir, "prometheus.log"), "rb") as f:
                return f.read()[-3000:].decode(errors="replace")
        except OSError:
            return ""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus did not get ready in {START_TIMEOUT_S} s:\n{self._log_tail()}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of ``promql`` now (``/api/v1/query``): each sample's labels and value."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus refused {promql!r}: {body}")
        return [{"labels": s["metric"], "value": float(s["value"][1])} for s in body["data"]["result"]]

    def value(self, promql: str) -> float | None:
        """The single value of ``promql`` (None: no sample)."""
        result = self.query(promql)
        if len(result) > 1:
            raise AssertionError(f"{promql!r} gave {len(result)} samples: {result}")
        return result[0]["value"] if result else None

    def wait_for(self, promql: str, expected: float, timeout: float = 60.0) -> None:
        """Wait until ``promql``'s single value is ``expected`` (a scrape after the change); AssertionError with
        what it last was otherwise."""
        deadline = time.monotonic() + timeout
        last: float | None = None
        while time.monotonic() < deadline:
            last = self.value(promql)
            if last == expected:
                return
            time.sleep(0.25)
        targets = urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10).read().decode()[:2000]
        raise AssertionError(f"{promql!r} is {last}, not {expected}, after {timeout} s; targets: {targets}")
