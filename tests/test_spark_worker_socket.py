"""The JVM's data is acknowledged at once on a Spark Python worker's loopback TCP connections
(keygroups.spark._worker_socket): the options are set on the real sockets, only on loopback TCP connections, and the
connections carry on as before."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys

import pytest

from keygroups.spark._worker_socket import acknowledged, loopback_connections

with contextlib.suppress(ImportError):   # the Spark test's task is defined here, which Spark's workers cannot import
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK") or not os.path.isdir("/proc/self/fd"),
                                 reason="TCP_QUICKACK and /proc/self/fd are Linux's")


def _nodelay(s: socket.socket) -> int:
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def _non_loopback_address() -> str | None:
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))   # no packet is sent: this only picks the outgoing interface
        address = probe.getsockname()[0]
        return None if address.startswith("127.") else address
    return None


def test_loopback_tcp_connections_get_the_options_and_carry_on():
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        client = stack.enter_context(socket.create_connection(server.getsockname()))
        accepted = stack.enter_context(server.accept()[0])
        left, right = socket.socketpair(socket.AF_UNIX)
        stack.enter_context(left)
        stack.enter_context(right)
        elsewhere = _non_loopback_address()
        far_pair = None
        if elsewhere is not None:
            far_server = stack.enter_context(socket.create_server((elsewhere, 0)))
            far_client = stack.enter_context(socket.create_connection(far_server.getsockname()))
            far_pair = (far_client, stack.enter_context(far_server.accept()[0]))
        assert _nodelay(client) == _nodelay(accepted) == 0
        found = loopback_connections()
        for duplicate in found:
            duplicate.close()
        assert len(found) >= 2
        assert _nodelay(client) == _nodelay(accepted) == 1
        assert _nodelay(server) == 0   # listening: no peer
        if far_pair is not None:
            assert _nodelay(far_pair[0]) == _nodelay(far_pair[1]) == 0
        # the connections are the same and open (the function closed only its duplicates)
        client.sendall(b"ping")
        assert accepted.recv(4) == b"ping"
        left.sendall(b"unix")
        assert right.recv(4) == b"unix"


@pytest.mark.spark
def test_a_keygroups_task_acknowledges_on_its_workers_connection_to_the_jvm(spark):
    from keygroups.spark.executor import run_tasks

    def task(index: int) -> str:
        connections = []
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    with socket.socket(fileno=os.dup(int(name))) as s:
                        if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                            connections.append((s.getpeername()[0], _nodelay(s)))
        return json.dumps(connections)

    for report in run_tasks(spark, 3, task):
        connections = json.loads(report)
        # the worker's connection to its JVM (PySpark's default: TCP on loopback), set as the task started
        loopback = [nodelay for peer, nodelay in connections if peer.startswith("127.")]
        assert loopback and all(nodelay == 1 for nodelay in loopback)


def test_acknowledged_passes_the_input_through_and_closes_its_duplicates():
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        client = stack.enter_context(socket.create_connection(server.getsockname()))
        accepted = stack.enter_context(server.accept()[0])
        open_fds = set(os.listdir("/proc/self/fd"))
        seen = []
        for item in acknowledged(iter(range(5))):
            seen.append((item, _nodelay(client)))   # set before the first item is handed on
        assert seen == [(i, 1) for i in range(5)]
        assert set(os.listdir("/proc/self/fd")) <= open_fds   # the duplicates are closed
        assert list(acknowledged([])) == []
        client.sendall(b"still open")
        assert accepted.recv(10) == b"still open"
