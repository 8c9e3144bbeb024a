"""Keeps the cyclic garbage collector of Spark's Python workers off the long-lived objects of keygroups' tasks.

Why: PySpark's worker daemon runs ``gc.collect()`` after every task of a reused worker, and it walks every object
the process tracks: on this project's 2-core machines, 50-120 ms per task for the ~100k objects of the imported
modules (pyarrow, numpy, pyspark, keygroups), none of which is ever garbage. The worker reads its next task only after
that collection, so a stage with more tasks than slots paid it on its critical path once per wave, and every task
paid it in CPU (measured: a 2-wave p=4 batch of 600 records, tasks of 40-60 ms took 100-165 ms in the second wave).

:func:`settle_worker_heap`, called as each task starts, moves the objects alive then into the permanent generation
(``gc.freeze()``), from the process's second task on (the first task's own imports are done by then, and the
daemon's collection after it has swept the first task's garbage). Frozen objects are still freed by their reference
counts; only a cycle among them that dies while frozen waits. So every :data:`UNFREEZE_EVERY` tasks the process
starts a task unfrozen (``gc.unfreeze()``), and the daemon's collection after it sweeps everything, as it did on
every task before; the next task freezes again. The state a task keeps between batches (heap backends) holds its
data in native buffers, which the collector never walks either way.
"""

from __future__ import annotations

import gc
import os
from typing import Literal

#: Every this many tasks a worker runs one task unfrozen, so that the daemon's collection after it can free cycles
#: that died while frozen (at most this many tasks late): one full collection per this many tasks, not one per task.
UNFREEZE_EVERY = 100

_tasks_in_process = 0
_process = 0
_frozen = False


def worker_gc_action(task_number: int, frozen: bool, unfreeze_every: int = UNFREEZE_EVERY
                     ) -> Literal["freeze", "unfreeze"] | None:
    """What the ``task_number``-th task of a worker process (from 1) does to the collector as it starts, given
    whether the process's objects are ``frozen`` now: nothing on the first task (its imports are not done yet),
    ``"unfreeze"`` on every ``unfreeze_every``-th, otherwise ``"freeze"`` unless already frozen."""
    if task_number <= 1:
        return None
    if task_number % unfreeze_every == 0:
        return "unfreeze" if frozen else None
    return None if frozen else "freeze"


def settle_worker_heap() -> None:
    """Called as each keygroups task starts in a Spark Python worker (see the module's docstring)."""
    global _tasks_in_process, _process, _frozen
    pid = os.getpid()
    if pid != _process:   # a worker forked from a process that had run tasks counts its own from 1
        _process, _tasks_in_process, _frozen = pid, 0, False
    _tasks_in_process += 1
    action = worker_gc_action(_tasks_in_process, _frozen, UNFREEZE_EVERY)
    if action == "freeze":
        gc.freeze()
        _frozen = True
    elif action == "unfreeze":
        gc.unfreeze()
        _frozen = False
