"""Spark's Python workers keep the collector off keygroups' long-lived objects (``keygroups.spark._worker_gc``):
PySpark's daemon collects after every task of a reused worker, and walked ~100k module objects each time (issue 32:
50-120 ms per task, on the critical path of a stage with more tasks than slots). From a worker's second task on its
long-lived objects are frozen; every ``UNFREEZE_EVERY``-th task runs unfrozen, so cycles that died meanwhile are
still freed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from hypothesis import given
from hypothesis import strategies as st

from keygroups.spark._worker_gc import worker_gc_action
from keygroups.spark.executor import run_tasks


@given(st.integers(2, 50), st.integers(1, 400))
def test_from_the_second_task_every_task_runs_frozen_but_every_nth(unfreeze_every, tasks):
    frozen = False
    for n in range(1, tasks + 1):
        action = worker_gc_action(n, frozen, unfreeze_every)
        assert action != ("freeze" if frozen else "unfreeze"), (n, frozen)   # never a no-op call
        frozen = {"freeze": True, "unfreeze": False, None: frozen}[action]
        assert frozen == (n > 1 and n % unfreeze_every != 0), (n, unfreeze_every)


def test_a_process_freezes_from_its_second_task_and_unfreezes_every_nth():
    """``settle_worker_heap`` in a process of its own (it freezes that process's heap), with a period of 3."""
    program = textwrap.dedent("""
        import gc, json
        from keygroups.spark import _worker_gc
        _worker_gc.UNFREEZE_EVERY = 3
        counts = []
        for _ in range(7):
            _worker_gc.settle_worker_heap()
            counts.append(gc.get_freeze_count())
            gc.collect()   # as PySpark's daemon does after each task
        print(json.dumps(counts))
    """)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout
    counts = json.loads(out)
    assert counts[0] == 0   # the first task's imports are not done yet
    assert all(c > 1000 for c in (counts[1], counts[3], counts[4], counts[6])), counts
    assert counts[2] == counts[5] == 0, counts   # tasks 3 and 6 run unfrozen: the collection after them sees all


def test_spark_workers_run_their_tasks_with_their_modules_frozen(spark):
    def task(_: int) -> str:
        import gc
        import os
        return json.dumps({"pid": os.getpid(), "frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects())})

    seen: dict[int, list[dict]] = {}
    for _ in range(6):
        for report in map(json.loads, run_tasks(spark, 2, task)):
            seen.setdefault(report["pid"], []).append(report)
    reused = {pid: reports for pid, reports in seen.items() if len(reports) >= 3}
    assert reused, f"no Python worker ran 3 of the 12 tasks: {sorted((p, len(r)) for p, r in seen.items())}"
    for pid, reports in reused.items():
        # a worker may have run other tests' tasks before: from its second task here on it has run two at least
        for report in reports[1:]:
            if report["frozen"] == 0:
                continue   # the one task in UNFREEZE_EVERY that runs unfrozen
            assert report["frozen"] > 20_000, (pid, report)   # pyarrow, numpy, pyspark, keygroups
            assert report["tracked"] < report["frozen"] // 4, (pid, report)   # what the daemon's collect walks
        assert sum(r["frozen"] > 0 for r in reports[1:]) >= len(reports) - 2, (pid, reports)
