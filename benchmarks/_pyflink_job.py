"""The peer job on PyFlink, run by the benchmarks under the PyFlink virtualenv's python (``_peers.pyflink_python``),
never in the project's environment: it imports nothing of keygroups.

    <pyflink-venv>/bin/python _pyflink_job.py EVENTS_BIN PARALLELISM MAX_PARALLELISM BACKEND MODE JOB OUT_DIR

EVENTS_BIN holds the events as little-endian int64 pairs (key, value). A parallel number sequence source and a
Python map that looks each index up in that array (loaded once per Python interpreter with numpy) feed
``key_by(key)`` and a Python ``KeyedProcessFunction``:

- JOB ``count-sum``: two ValueStates (count, sum), one output ``(key, count, sum)`` per record (issue 33's job);
- JOB ``value``: one ValueState (running sum), one output ``(key, sum)`` per record (issue 32's job);

into Flink's DiscardingSink. MODE is ``thread`` (``python.execution-mode: thread``: Python runs inside the JVM,
no Beam/gRPC hop) or ``process``. BACKEND is ``hashmap`` or ``rocksdb``. Checkpoints are off. Each subtask writes
``records checksum`` to OUT_DIR (checksum: the sum of the running counts, or of the running sums for ``value``...
which is order-dependent, so for ``value`` the checksum is the number of keys seen instead); the script prints
``records=N checksum=C netRuntimeMs=T executeCpuMs=U`` (U: the CPU time of the JVM process during execute,
from /proc: the Python functions included in thread mode, where they run inside the JVM).
"""

import os
import sys
import time

from pyflink.common import Configuration, Types, WatermarkStrategy
from pyflink.datastream import KeyedProcessFunction, MapFunction, RuntimeContext, StreamExecutionEnvironment
from pyflink.datastream.connectors import Sink
from pyflink.datastream.connectors.number_seq import NumberSequenceSource
from pyflink.datastream.state import ValueStateDescriptor
from pyflink.java_gateway import get_gateway

_PAIRS = {}


def _pairs(path):
    if path not in _PAIRS:
        import numpy as np

        _PAIRS[path] = np.fromfile(path, dtype="<i8").tolist()
    return _PAIRS[path]


class Lookup(MapFunction):
    def __init__(self, path):
        self.path = path
        self.data = None

    def open(self, runtime_context: RuntimeContext):
        self.data = _pairs(self.path)

    def map(self, i):
        return self.data[2 * i], self.data[2 * i + 1]


class _Counting(KeyedProcessFunction):
    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.records = 0
        self.checksum = 0

    def close(self):
        with open(os.path.join(self.out_dir, f"subtask-{os.getpid()}-{id(self)}"), "w") as f:
            f.write(f"{self.records} {self.checksum}\n")


class RunningCountSum(_Counting):
    def open(self, runtime_context: RuntimeContext):
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.LONG()))
        self.sum = runtime_context.get_state(ValueStateDescriptor("sum", Types.LONG()))

    def process_element(self, value, ctx):
        count = (self.count.value() or 0) + 1
        total = (self.sum.value() or 0) + value[1]
        self.count.update(count)
        self.sum.update(total)
        self.records += 1
        self.checksum += count
        yield value[0], count, total


class RunningValue(_Counting):
    def open(self, runtime_context: RuntimeContext):
        self.sum = runtime_context.get_state(ValueStateDescriptor("sum", Types.LONG()))

    def process_element(self, value, ctx):
        current = self.sum.value()
        if current is None:
            self.checksum += 1
            current = 0
        total = current + value[1]
        self.sum.update(total)
        self.records += 1
        yield value[0], total


def _jvm_cpu_ms():
    """CPU milliseconds (user + system) of the JVM PyFlink started for this script (a child process), from /proc;
    -1 when none is found."""
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0", 1)[0]
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and os.path.basename(argv0) == b"java":
            return (int(fields[11]) + int(fields[12])) * 1000 // tick
    return -1


def main(argv):
    # Thread mode embeds the base interpreter's libpython in the JVM: it sees this virtualenv's packages (pemja,
    # pyflink) only through PYTHONPATH, which the JVM started below inherits.
    import site

    os.environ["PYTHONPATH"] = os.pathsep.join([*site.getsitepackages(), os.path.dirname(os.path.abspath(__file__))])
    path, parallelism, max_parallelism, backend, mode, job, out_dir = argv
    n = os.path.getsize(path) // 16
    conf = Configuration()
    conf.set_string("python.execution-mode", mode)
    conf.set_string("python.executable", sys.executable)   # thread mode finds libpython through it
    conf.set_string("state.backend.type", backend)
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    env.set_parallelism(int(parallelism))
    env.set_max_parallelism(int(max_parallelism))
    pairs = env.from_source(NumberSequenceSource(0, n - 1), WatermarkStrategy.no_watermarks(), "events").map(
        Lookup(path), output_type=Types.TUPLE([Types.LONG(), Types.LONG()]))
    keyed = pairs.key_by(lambda e: e[0], key_type=Types.LONG())
    if job == "count-sum":
        out = keyed.process(RunningCountSum(out_dir),
                            output_type=Types.TUPLE([Types.LONG(), Types.LONG(), Types.LONG()]))
    else:
        out = keyed.process(RunningValue(out_dir), output_type=Types.TUPLE([Types.LONG(), Types.LONG()]))
    jvm = get_gateway().jvm
    out.sink_to(Sink(jvm.org.apache.flink.streaming.api.functions.sink.v2.DiscardingSink()))
    cpu0 = _jvm_cpu_ms()
    start = time.perf_counter()
    result = env.execute(f"keygroups peer {job} ({mode}, {backend})")
    wall_ms = int((time.perf_counter() - start) * 1000)
    cpu1 = _jvm_cpu_ms()
    cpu_ms = cpu1 - cpu0 if cpu0 >= 0 and cpu1 >= 0 else -1
    records = checksum = 0
    for name in os.listdir(out_dir):
        r, c = open(os.path.join(out_dir, name)).read().split()
        records += int(r)
        checksum += int(c)
    print(f"records={records} checksum={checksum} netRuntimeMs={result.get_net_runtime()} executeWallMs={wall_ms} "
          f"executeCpuMs={cpu_ms}")


if __name__ == "__main__":
    main(sys.argv[1:])
