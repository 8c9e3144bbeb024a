"""The cost of checking record values on write (issue 31): heap ``ValueState.update`` of a record, with the check the
heap now runs on every write (``RecordSerializer.check``: the compiled encoder into a stack buffer, bytes not kept),
beside the same updates through the compiled state class without it (the baseline: what an update cost before),
in one run. For scale: the check alone, the encode a snapshot pays per changed value anyway, and an Int64 state's
update (a serializer that checks nothing keeps the compiled path).

The same work: ``--n`` updates of one record value, (a) to ``--n`` distinct keys (``set_current_key`` + ``update``,
the state growing to n keys) and (b) to one resident key (the update alone). Medians of ``--repeat`` interleaved runs
(GC paused while timing); CPU time (``time.process_time``) beside wall time, since the machine may be shared.

    python benchmarks/bench_record_write_check.py [--n 1000000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from keygroups import key_group_range
from keygroups.serializers import Int64Serializer, RecordSerializer
from keygroups.state import HeapKeyedStateBackend, ValueStateDescriptor
from keygroups.state.heap import _HeapValue

RECORDS = {
    "6 fields": ("user string not null, visits bigint not null, score double, active boolean not null, "
                 "at timestamp, tags array<string>",
                 {"user": "alice", "visits": 12, "score": 0.5, "active": True,
                  "at": dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc), "tags": ["a", "b"]}),
    "3 fields": ("user string not null, visits bigint not null, score double",
                 {"user": "alice", "visits": 12, "score": 0.5}),
}


def timed(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, tuple[float, float]]:
    """Median (wall, cpu) seconds per label; runs interleaved, GC collected before and paused during each."""
    walls: dict[str, list[float]] = {k: [] for k in fns}
    cpus: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for label, fn in fns.items():
            gc.collect()
            gc.disable()
            try:
                w, c = time.perf_counter(), time.process_time()
                fn()
                walls[label].append(time.perf_counter() - w)
                cpus[label].append(time.process_time() - c)
            finally:
                gc.enable()
    return {k: (statistics.median(walls[k]), statistics.median(cpus[k])) for k in fns}


def updates(n: int, state: Any, backend: HeapKeyedStateBackend, value: Any, distinct: bool) -> Callable[[], None]:
    keys = list(range(n))

    def run() -> None:
        set_key, update = backend.set_current_key, state.update
        if distinct:
            for k in keys:
                set_key(k)
                update(value)
        else:
            set_key(1)
            for _ in keys:
                update(value)

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n = args.n
    for title, (ddl, value) in RECORDS.items():
        ser = RecordSerializer(ddl)
        fns: dict[str, Callable[[], Any]] = {}
        for distinct in (True, False):
            where = f"{n:,} keys" if distinct else "one key"
            checked_backend = HeapKeyedStateBackend(key_group_range(128, 1, 0), 128, Int64Serializer())
            checked = checked_backend.get_state(ValueStateDescriptor("v", ser))
            plain_backend = HeapKeyedStateBackend(key_group_range(128, 1, 0), 128, Int64Serializer())
            descriptor = ValueStateDescriptor("v", ser)
            plain_backend.get_state(descriptor)
            plain = _HeapValue(plain_backend._store("v"), descriptor, plain_backend)   # the class without the check
            assert type(checked).__name__ == "_CheckedHeapValue" and type(plain) is _HeapValue
            fns[f"update, {where}, unchecked (baseline)"] = updates(n, plain, plain_backend, value, distinct)
            fns[f"update, {where}, checked"] = updates(n, checked, checked_backend, value, distinct)
        check, encode = ser.check, ser.serialize
        fns["RecordSerializer.check alone"] = lambda: [check(value) for _ in range(n)]
        fns["RecordSerializer.serialize alone"] = lambda: [encode(value) for _ in range(n)]
        ints = HeapKeyedStateBackend(key_group_range(128, 1, 0), 128, Int64Serializer())
        fns["Int64 state update, one key (unchanged path)"] = updates(
            n, ints.get_state(ValueStateDescriptor("i", Int64Serializer())), ints, 12, False)
        result = timed(fns, args.repeat)
        print(f"\n== heap ValueState.update of a {title} record: {n:,} calls each, median of {args.repeat} "
              "(ns per call)")
        print(f"{'':<48} {'wall':>9} {'cpu':>9} {'cpu vs baseline':>16}")
        for label, (wall, cpu) in result.items():
            base = None
            if label.startswith("update"):
                base = result[label.replace("checked", "unchecked (baseline)")][1] if label.endswith("checked") and \
                    "unchecked" not in label else None
            ratio = f"{cpu / base:15.2f}x" if base else ""
            print(f"{label:<48} {wall / n * 1e9:9.1f} {cpu / n * 1e9:9.1f} {ratio:>16}")


if __name__ == "__main__":
    main()
