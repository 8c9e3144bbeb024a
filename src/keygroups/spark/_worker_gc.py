"""Keeps the cyclic garbage collector of Spark's Python workers off the long-lived objects of keygroups' tasks.

Why: PySpark's worker daemon runs ``gc.collect()`` after every task of a reused worker, and it walks every object
the process tracks: on this project's 2-core machines, 50-120 ms per task for the ~100k objects of the imported
modules (pyarrow, numpy, pyspark, keygroups), none of which is ever garbage. The worker reads its next task only after
that collection, so a stage with more tasks than slots paid it on its critical path once per wave, and every task
paid it in CPU (measured: in a 2-wave p=4 batch of 600 records the second wave's tasks took 83-165 ms, 53-79 ms
with the modules frozen; the workers' CPU per 1,000 events of a 1k events/s stream fell from 0.47 to 0.12-0.19 s).

:func:`settle_worker_heap`, called as each task starts, moves the objects alive then into the permanent generation
(``gc.freeze()``), from the process's second task on (the first task's own imports are done by then, and the
daemon's collection after it has swept the first task's garbage). Frozen objects are still freed by their reference
counts; a cycle among them that dies while frozen is freed only by a collection that walks them. Heap backends are
such cycles, and they hold a subtask's state. So a task starts unfrozen (``gc.unfreeze()``: the daemon's collection
after it walks everything, as it did after every task before) when an object a warm registry kept at the freeze is
no longer kept (:func:`~keygroups.state.warm.kept_object_ids`: dropped, or taken over), and every
:data:`UNFREEZE_EVERY` tasks whatever happened; the next task freezes again.
"""

from __future__ import annotations

import gc
import os
from typing import Literal

from keygroups.state.warm import kept_object_ids

#: At the latest every this many tasks a worker runs one task unfrozen, for cycles of frozen objects other than the
#: warm registries' (the task's function as it was unpickled when the worker froze, say): at most this many tasks late.
UNFREEZE_EVERY = 1000

_process = 0
_tasks_in_process = 0
_kept_when_frozen: frozenset[int] | None = None   # None: not frozen


def worker_gc_action(task_number: int, frozen: bool, warm_dropped: bool, unfreeze_every: int = UNFREEZE_EVERY
                     ) -> Literal["freeze", "unfreeze"] | None:
    """What the ``task_number``-th task of a worker process (from 1) does to the collector as it starts, given
    whether the process's objects are ``frozen`` now and whether ``warm_dropped`` (an object a warm registry kept at
    the freeze is no longer kept): nothing on the first task (its imports are not done yet); ``"unfreeze"`` when
    frozen and warm state was dropped or on every ``unfreeze_every``-th task; ``"freeze"`` when not frozen."""
    if task_number <= 1:
        return None
    if frozen:
        return "unfreeze" if warm_dropped or task_number % unfreeze_every == 0 else None
    return "freeze"


def settle_worker_heap() -> None:
    """Called as each keygroups task starts in a Spark Python worker (see the module's docstring)."""
    global _process, _tasks_in_process, _kept_when_frozen
    pid = os.getpid()
    if pid != _process:   # a worker forked from a process that had run tasks counts its own from 1
        _process, _tasks_in_process, _kept_when_frozen = pid, 0, None
    _tasks_in_process += 1
    frozen = _kept_when_frozen is not None
    dropped = frozen and not _kept_when_frozen <= kept_object_ids()
    action = worker_gc_action(_tasks_in_process, frozen, dropped, UNFREEZE_EVERY)
    if action == "freeze":
        gc.freeze()
        _kept_when_frozen = kept_object_ids()
    elif action == "unfreeze":
        gc.unfreeze()
        _kept_when_frozen = None
