"""Spark's Python workers keep the collector off keygroups' long-lived objects (``keygroups.spark._worker_gc``):
PySpark's daemon collects after every task of a reused worker, and walked ~100k module objects each time (issue 32:
50-120 ms per task, on the critical path of a stage with more tasks than slots). From a worker's second task on its
long-lived objects are frozen; a task runs unfrozen when warm state kept at the freeze was dropped (heap backends are
reference cycles) and every ``UNFREEZE_EVERY``-th task, so cycles that died meanwhile are still freed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from hypothesis import given
from hypothesis import strategies as st

from keygroups.spark._worker_gc import worker_gc_action
from keygroups.spark.executor import run_tasks


@given(st.integers(2, 50), st.lists(st.booleans(), min_size=1, max_size=400))
def test_from_the_second_task_tasks_run_frozen_until_warm_state_drops_or_every_nth(unfreeze_every, drops):
    """``drops[n - 1]``: whether warm state kept at the freeze was dropped before task ``n`` (seen only if frozen)."""
    frozen = False
    for n, drop in enumerate(drops, start=1):
        action = worker_gc_action(n, frozen, frozen and drop, unfreeze_every)
        assert action != ("freeze" if frozen else "unfreeze"), (n, frozen)   # never a no-op call
        if n == 1:
            assert action is None   # the first task's imports are not done yet
        elif not frozen:
            assert action == "freeze"   # the task after an unfrozen one freezes again
        else:
            assert (action == "unfreeze") == (drop or n % unfreeze_every == 0), (n, drop)
        frozen = {"freeze": True, "unfreeze": False, None: frozen}[action]


def _freeze_counts(program: str) -> list[int | bool]:
    """What ``program`` prints (a JSON list of freeze counts and checks), run in a process of its own: it freezes that process's heap."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(program)], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def test_a_process_freezes_from_its_second_task_and_unfreezes_every_nth():
    counts = _freeze_counts("""
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
    assert counts[0] == 0   # the first task's imports are not done yet
    assert all(c > 1000 for c in (counts[1], counts[3], counts[4], counts[6])), counts
    assert counts[2] == counts[5] == 0, counts   # tasks 3 and 6 run unfrozen: the collection after them sees all


def test_warm_state_dropped_while_frozen_is_freed_by_the_collection_after_the_next_task():
    """A kept object in a reference cycle (as a heap backend is), frozen with the rest, then dropped from its
    registry: the next task starts unfrozen, so the daemon's collection after it frees the object; kept again
    batch after batch (taken and kept back), nothing unfreezes."""
    counts = _freeze_counts("""
        import gc, json, weakref
        from keygroups.spark import _worker_gc
        from keygroups.state.warm import WarmRegistry

        class Backend:
            def __init__(self):
                self.me = self   # a cycle: only a collection frees it

        registry = WarmRegistry()
        registry.keep("a", Backend(), limit=4)
        registry.keep("b", Backend(), limit=4)
        dropped = weakref.ref(registry.peek("b"))
        counts = []

        def task():
            _worker_gc.settle_worker_heap()
            counts.append(gc.get_freeze_count())

        task(); gc.collect()
        task(); gc.collect()                                  # 2: frozen, "a" and "b" with the rest
        registry.keep("a", registry.take("a"), limit=4)       # taken and kept back: still kept
        task(); gc.collect()                                  # 3: stays frozen
        registry.take("b")                                    # dropped: frozen, in a cycle, not freed
        gc.collect()
        counts.append(dropped() is not None)
        task(); gc.collect()                                  # 4: unfrozen: this collection frees it
        counts.append(dropped() is None)
        task()                                                # 5: frozen again
        print(json.dumps(counts))
    """)
    assert counts[0] == 0 and counts[1] > 1000 and counts[2] > 1000, counts
    assert counts[3] is True, "the dropped object was freed while frozen: the test shows nothing"
    assert counts[4] == 0 and counts[5] is True, counts
    assert counts[6] > 1000, counts


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
                continue   # a task that runs unfrozen (every UNFREEZE_EVERY-th; or warm state was dropped)
            assert report["frozen"] > 20_000, (pid, report)   # pyarrow, numpy, pyspark, keygroups
            assert report["tracked"] < report["frozen"] // 4, (pid, report)   # what the daemon's collect walks
        assert sum(r["frozen"] > 0 for r in reports[1:]) >= len(reports) - 2, (pid, reports)
