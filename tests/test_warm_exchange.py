"""The warm exchange (keygroups.runtime.warm_exchange) between real worker processes, without Spark: two spawned
processes stand for Spark's Python workers, the test places each subtask on one of them as Spark's idle-worker queue
might, and the batch spine drives the batches. A subtask placed where its state is not held runs where it is; the
report says so; and every failure (holder gone, no longer holding, an error in the served run, a requester that
vanished, a peer of another uid) either runs the subtask where it was placed or fails the task, never anything
in between."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import pickle
import socket
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime import warm_exchange as wx
from keygroups.runtime.batch import JobDriver, JobOptions
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.local import LocalExecutor
from keygroups.runtime.report import SubtaskReport
from keygroups.serializers import Int64Serializer
from keygroups.state import ValueStateDescriptor

OUT = pa.schema([("k", pa.int64()), ("total", pa.int64())])


class FailingTotal(KeyedProcessFunction):
    """Per key the running sum of ``v``; a record with ``v == -1`` raises."""

    def open(self, context):
        self.total = context.get_state(ValueStateDescriptor("total", Int64Serializer()))

    def process_element(self, record, context):
        if record["v"] == -1:
            raise ValueError("a poisoned record")
        total = (self.total.value() or 0) + record["v"]
        self.total.update(total)
        return [(context.current_key, total)]


def _worker(conn, directory):
    """A stand-in for a Spark Python worker: runs the subtasks it is sent with ``forward=True``."""
    from keygroups.runtime import subtask
    from keygroups.runtime.subtask_state import HEAP_BACKENDS

    wx._PROCESS = wx.WarmExchange(directory, subtask._run_served)
    while True:
        command, *args = conn.recv()
        if command == "run":
            spec, index, batches = args
            try:
                report = subtask.run_keyed_subtask(spec, index, batches, forward=True)
                conn.send(("ok", json.dumps(report.to_json())))
            except Exception as e:   # noqa: BLE001 - sent back to the test
                conn.send(("error", f"{type(e).__name__}: {e}"))
        elif command == "run_here":   # as a task whose forwarding found no one (e.g. every holder busy elsewhere)
            spec, index, batches = args
            report = subtask.run_keyed_subtask(spec, index, batches, forward=False)
            conn.send(("ok", json.dumps(report.to_json())))
        elif command == "held":
            conn.send(("ok", [(k[3], k[4]) for k in HEAP_BACKENDS.keys()]))
        elif command == "forget":   # drop what is held, but leave the advertisement as it was
            HEAP_BACKENDS.clear()
            conn.send(("ok", None))
        elif command == "pid":
            conn.send(("ok", os.getpid()))
        else:
            return


class Worker:
    def __init__(self, ctx, directory):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, directory), daemon=True)
        self.process.start()
        self.pid = self.call("pid")

    def call(self, *command):
        self.conn.send(command)
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(value)
        return value

    def stop(self):
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)


class RunsHere:
    """A worker placed a subtask that it runs without asking the exchange."""

    def __init__(self, worker):
        self.worker, self.pid = worker, worker.pid

    def call(self, command, *args):
        return self.worker.call("run_here" if command == "run" else command, *args)


class PlacedExecutor(LocalExecutor):
    """A batch whose subtask i runs in ``placement[i]`` (as Spark places a task on an idle Python worker)."""

    def __init__(self, table, placement):
        super().__init__(table)
        self.placement = placement

    def _run(self, index, batches):
        assert self._spec is not None
        return SubtaskReport.from_json(json.loads(self.placement[index].call("run", self._spec, index, batches)))


@pytest.fixture
def workers(tmp_path):
    directory = str(tmp_path / "exchange")
    os.mkdir(directory, 0o700)
    ctx = multiprocessing.get_context("spawn")
    started = [Worker(ctx, directory), Worker(ctx, directory)]
    yield directory, started
    for w in started:
        w.stop()


def _driver(tmp_path, function=None):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    options = JobOptions(name="j", key_columns=("k",), function=pickle.dumps(function or FailingTotal()),
                         output_schema=OUT, max_parallelism=16)
    return JobDriver(options, storage, fence=False, background_retention=False)


def _batch(keys, v=1):
    return pa.table({"k": pa.array(keys, pa.int64()), "v": pa.array([v] * len(keys), pa.int64())})


def _run(driver, model, keys, placement, v=1):
    batch = driver.run(PlacedExecutor(_batch(keys, v), placement), parallelism=len(placement))
    for k in keys:
        model[k] = model.get(k, 0) + v
    got = {}
    for r in batch.reports:
        if r.output_file:
            rows = pq.read_table(pa.BufferReader(driver.storage.open_buffer(r.output_file))).to_pylist()
            for row in rows:
                got[row["k"]] = row["total"]
    assert got == {k: model[k] for k in keys}
    return {r.subtask: r for r in batch.reports}


def test_a_subtask_placed_away_from_its_state_runs_where_the_state_is(tmp_path, workers):
    _, (a, b) = workers
    driver, model = _driver(tmp_path), {}
    keys = list(range(200))
    first = _run(driver, model, keys, [a, b])
    assert {r.restored.mode for r in first.values()} == {"new"}
    assert first[0].process == a.pid and first[1].process == b.pid and first[0].forwarded_from is None
    for placement in ([b, a], [b, b], [a, a], [a, b]):   # every placement Spark's idle queue could make
        reports = _run(driver, model, keys, placement)
        assert reports[0].process == a.pid and reports[1].process == b.pid   # state never moves
        assert all(r.restored.mode == "warm" and r.restored.bytes_read == 0 for r in reports.values())
        for i, r in reports.items():
            placed = placement[i].pid
            assert r.forwarded_from == (None if placed == r.process else placed)
    assert sorted(a.call("held")) == [(0, 7)] and sorted(b.call("held")) == [(8, 15)]   # one copy of each range

    # 2 -> 3 with the new subtasks placed anywhere: each range's key groups stay where they were held
    reports = _run(driver, model, keys, [b, b, a])
    assert all(r.restored.mode in ("warm", "moved") for r in reports.values())
    assert reports[0].process == a.pid and reports[2].process == b.pid
    moved = sum(r.restored.bytes_restored for r in reports.values())
    assert moved > 0 and all(r.restored.bytes_caught_up == 0 for r in reports.values())
    reports = _run(driver, model, keys, [a, a, a])
    assert all(r.restored.mode == "warm" for r in reports.values()), reports


def test_a_holder_gone_or_no_longer_holding_leaves_the_run_where_it_was_placed(tmp_path, workers):
    directory, (a, b) = workers
    driver, model = _driver(tmp_path), {}
    keys = list(range(100))
    _run(driver, model, keys, [a, b])
    a.call("forget")   # a still advertises range 0, holds nothing: it declines
    reports = _run(driver, model, keys, [b, a])
    assert reports[0].process == b.pid and reports[0].restored.mode == "cold" and reports[0].forwarded_from is None
    assert reports[1].process == b.pid and reports[1].forwarded_from == a.pid

    b.stop()   # b holds both ranges and is gone (killed: its advertisement stays behind)
    assert os.path.exists(os.path.join(directory, f"{b.pid}.json"))
    reports = _run(driver, model, keys, [a, a])
    assert all(r.process == a.pid and r.restored.mode == "cold" for r in reports.values())
    assert not os.path.exists(os.path.join(directory, f"{b.pid}.json"))   # removed by the reader that found it dead

    # a live process that advertises but serves nothing (refused connection): ignored and removed
    a.call("forget")
    with open(os.path.join(directory, f"{os.getpid()}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "socket": "", "held": [[wx.job_id(_key(driver, 0)), 0, 15, 3, True]]}, f)
    reports = _run(driver, model, keys, [a, a])
    assert all(r.process == a.pid and r.restored.mode == "cold" for r in reports.values())
    assert not os.path.exists(os.path.join(directory, f"{os.getpid()}.json"))


def test_a_holder_behind_the_restore_point_catches_up_rather_than_declining(tmp_path, workers):
    _, (a, b) = workers
    driver, model = _driver(tmp_path), {}
    keys = list(range(100))
    _run(driver, model, keys, [a, b])
    reports = _run(driver, model, keys, [RunsHere(b), b])   # range 0 now also in b, at the newer checkpoint
    assert reports[0].process == b.pid and reports[0].restored.mode == "cold"
    b.call("forget")
    # a holds range 0 one checkpoint behind: catching up there reads the last delta, not the whole range
    reports = _run(driver, model, keys, [b, b])
    assert reports[0].process == a.pid and reports[0].forwarded_from == b.pid
    assert reports[0].restored.mode == "caught-up" and reports[0].restored.bytes_caught_up > 0
    assert reports[1].process == b.pid and reports[1].restored.mode == "cold"


def _key(driver, index):
    from keygroups.runtime.subtask_state import heap_backend_key
    from keygroups.runtime.spec import KeyedTaskSpec
    spec = KeyedTaskSpec(job_name="j", key_columns=("k",), key_type=_key_type(), function=b"", input_schema=None,
                         output_schema=OUT, max_parallelism=16, parallelism=2,
                         checkpoint_location=driver.storage.location, checkpoint_id=1, restore_from=None)
    return heap_backend_key(spec, spec.own_key_groups(index))


def _key_type():
    from keygroups.runtime.backends import key_type_for_schema
    return key_type_for_schema(_batch([1]).schema, ("k",))


def test_an_error_in_the_served_run_fails_the_task_and_nothing_half_done_stays_warm(tmp_path, workers):
    _, (a, b) = workers
    driver, model = _driver(tmp_path), {}
    keys = list(range(100))
    _run(driver, model, keys, [a, b])
    with pytest.raises(RuntimeError) as failed:
        driver.run(PlacedExecutor(_batch(keys, -1), [b, a]), parallelism=2)
    message = str(failed.value)
    assert "ForwardError" in message and f"process {a.pid}" in message and "a poisoned record" in message
    assert a.call("held") == []   # the failed run kept nothing
    reports = _run(driver, model, keys, [b, b])   # the retry: b holds range 1, nobody range 0
    assert reports[0].process == b.pid and reports[0].restored.mode == "cold"
    assert reports[1].restored.mode == "warm"


def test_a_requester_that_vanishes_leaves_no_state_kept(tmp_path, workers):
    directory, (a, b) = workers
    driver, model = _driver(tmp_path), {}
    keys = list(range(100))
    _run(driver, model, keys, [a, b])
    spec, batches = _next_spec(driver, keys, [a, b])
    # a raw requester: asks a to run subtask 0 of a next batch, sends its input, and closes without confirming
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(os.path.join(directory, f"{a.pid}.sock"))
        wx._send(conn, wx._REQUEST, pickle.dumps((spec, 0, 0, os.getpid())))
        assert wx._recv(conn)[0] == wx._ACCEPT
        wx._send(conn, wx._BATCHES, wx._ipc_stream(batches))
        assert wx._recv(conn)[0] == wx._REPORT
    deadline = time.time() + 30
    while a.call("held") and time.time() < deadline:
        time.sleep(0.05)
    assert a.call("held") == []


def _next_spec(driver, keys, placement):
    """Subtask 0's spec and input for the batch after the next one (which runs), restoring from the next one."""
    captured = {}

    class Capture(PlacedExecutor):
        def _run(self, index, batches):
            captured[index] = (self._spec, batches)
            return super()._run(index, batches)

    driver.run(Capture(_batch(keys), placement), parallelism=len(placement))
    spec, batches = captured[0]
    return dataclasses.replace(spec, checkpoint_id=spec.checkpoint_id + 1, restore_from=spec.checkpoint_id,
                               restore_metadata=None, restore_metadata_size=None), batches


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_peer_of_another_uid_is_refused(tmp_path, workers):
    directory, (a, b) = workers
    driver, model = _driver(tmp_path), {}
    _run(driver, model, list(range(50)), [a, b])
    spec, _ = _next_spec(driver, list(range(50)), [a, b])
    request = pickle.dumps((spec, 0, 0, os.getpid()))   # a request a would accept from this uid
    # let the other uid reach the socket (a hard link in a directory it can search, the socket's mode opened): the
    # peer check alone must refuse it
    reachable = tempfile.mkdtemp()
    os.chmod(reachable, 0o755)
    path = os.path.join(reachable, "holder.sock")
    os.link(os.path.join(directory, f"{a.pid}.sock"), path)
    os.chmod(path, 0o777)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: another uid asks a to run something
        answer = b"?"
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as conn:
                conn.connect(path)
                wx._send(conn, wx._REQUEST, request)
                conn.settimeout(10)
                answer = conn.recv(1) or b"closed"
        except BaseException as e:   # noqa: BLE001
            answer = repr(e).encode()
        os.write(write, answer)
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    answer = os.read(read, 200)
    os.close(read)
    os.remove(path)
    os.rmdir(reachable)
    assert answer in (b"closed", b"ConnectionResetError(104, 'Connection reset by peer')",
                      b"BrokenPipeError(32, 'Broken pipe')"), answer   # closed unanswered, never accepted
    assert sorted(a.call("held")) == [(0, 7)]


def test_a_task_counts_what_a_process_holds_of_its_range_as_its_takeover_allows():
    from keygroups.runtime.spec import KeyedTaskSpec

    spec = KeyedTaskSpec(job_name="j", key_columns=("k",), key_type=_key_type(), function=b"", input_schema=None,
                         output_schema=OUT, max_parallelism=32, parallelism=3, checkpoint_location="/x",
                         checkpoint_id=5, restore_from=4, warm_takeover=((0, 15), (16, 31), None))
    job = wx.job_id((spec.checkpoint_location, spec.job_name, 32, 0, 0, spec.key_type, False))
    other_job = wx.job_id(("/y", spec.job_name, 32, 0, 0, spec.key_type, False))
    own = spec.own_key_groups(1)   # [11, 21]; its takeover: the previous range [16, 31]
    assert (own.start, own.end) == (11, 21)
    whole = wx.HeldRange(job, 16, 31, 4, False)
    assert wx.usable_key_groups([whole], spec, 1) == (6, 6)
    # subtask 0's previous range: usable only when it can be split (the rest stays for subtask 0)
    assert wx.usable_key_groups([wx.HeldRange(job, 0, 15, 4, False)], spec, 1) == (0, 0)
    assert wx.usable_key_groups([wx.HeldRange(job, 0, 15, 4, True)], spec, 1) == (5, 5)
    # overlapping copies count once; a piece of an older checkpoint counts, but not as up to date
    stale = wx.HeldRange(job, 11, 15, 3, True)
    assert wx.usable_key_groups([whole, stale, wx.HeldRange(job, 18, 21, 4, True)], spec, 1) == (11, 6)
    assert wx.usable_key_groups([wx.HeldRange(other_job, 0, 31, 4, True)], spec, 1) == (0, 0)
    assert (11, 6) > (6, 6) and (6, 6) > (6, 5)   # the order tasks compare processes by
