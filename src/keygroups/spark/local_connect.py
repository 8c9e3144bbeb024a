"""A Spark Connect session served by a classic session's own JVM, for tests, the demo and benchmarks.

``SparkSession.builder.remote("local[2]")`` starts an in-process Connect server too, but it refuses to start when a
classic session already exists, and the tests, the demo (whose JVM writes to a log file) and the benchmark (which
compares both kinds of session) start one first. This module starts Spark's Connect service
(``SparkConnectService``, the one ``spark-connect_*.jar`` ships and ``sbin/start-connect-server.sh`` runs) inside
that JVM, on a free port of the loopback interface only, and connects a Connect client to it: the client has no
py4j gateway and no SparkContext, exactly as a remote one, while both sessions share one JVM.

PySpark decides per process whether ``pyspark.sql.functions`` build Connect or classic Columns (the environment
variable ``SPARK_CONNECT_MODE_ENABLED``, which creating a Connect session sets): :func:`connect_mode` switches
between the two for a process that uses both.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

_SERVICE = "org.apache.spark.sql.connect.service.SparkConnectService"
_MODE = "SPARK_CONNECT_MODE_ENABLED"


def _service_object(jvm: Any) -> Any:
    """The Scala ``object SparkConnectService`` (its ``MODULE$``), whose methods include ``localPort``."""
    return getattr(getattr(jvm, _SERVICE + "$"), "MODULE$")


def local_connect_session(classic: SparkSession) -> RemoteSparkSession:
    """A Spark Connect session whose server is ``classic``'s JVM (started there on the first call, on a free port of
    127.0.0.1). Leaves the process in Connect mode (see :func:`connect_mode`); :func:`stop_local_connect` stops
    the server."""
    jvm = getattr(classic, "_jvm", None)
    if jvm is None:
        raise TypeError(f"local_connect_session needs a classic SparkSession (with a JVM gateway), got "
                        f"{type(classic).__module__}.{type(classic).__name__}")
    context = classic.sparkContext._jsc.sc()
    conf = context.conf()   # the live SparkConf, which the service reads as it starts (getConf() is a copy)
    conf.set("spark.connect.grpc.binding.address", "127.0.0.1")   # never reachable from another host
    conf.set("spark.connect.grpc.binding.port", "0")              # a free port: several runs may share the machine
    getattr(jvm, _SERVICE).start(context)  # does nothing when already started
    port = _service_object(jvm).localPort()
    # Connect's own builder: pyspark.sql.SparkSession's refuses a remote session while a classic one runs.
    session = RemoteSparkSession.builder.remote(f"sc://127.0.0.1:{port}").getOrCreate()
    os.environ[_MODE] = "1"
    return session


def stop_local_connect(classic: SparkSession) -> None:
    """Stop the Connect service :func:`local_connect_session` started in ``classic``'s JVM (the classic session
    goes on) and leave Connect mode."""
    jvm = classic._jvm
    service = getattr(jvm, _SERVICE)
    service.stop(getattr(service, "stop$default$1")(), getattr(service, "stop$default$2")())
    os.environ.pop(_MODE, None)


@contextlib.contextmanager
def connect_mode(enabled: bool) -> Iterator[None]:
    """Within the block, ``pyspark.sql.functions`` build Connect Columns (``enabled``) or classic ones; the mode the
    process had is restored after it."""
    before = os.environ.get(_MODE)
    if enabled:
        os.environ[_MODE] = "1"
    else:
        os.environ.pop(_MODE, None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_MODE, None)
        else:
            os.environ[_MODE] = before
