"""Serializer throughput: keygroups' compiled serializers beside pickle and json doing the same work.

"The same work" is N separately addressable encodings (what keyed state stores: one value per key), so the
baselines are ``[pickle.dumps(v) for v in values]`` and ``[json.dumps(v).encode() for v in values]`` (and their
loads). Ours is shown both in bulk (``serialize_many``: one buffer + offsets, how snapshots write) and per value
(``serialize`` in a Python loop, how a state update writes). Medians of several runs (GC paused while timing, as timeit does); ratio = baseline / ours, so
> 1 means we are faster.

    python benchmarks/bench_serializers.py [--n 1000000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from keygroups.serializers import Int64Serializer, ValueSerializer


def median_seconds(fn: Callable[[], Any], repeat: int) -> float:
    """Median wall time of fn; the cyclic GC is off while timing (as timeit does), so that its passes over the
    millions of fresh containers do not decide the figures of whichever run they happen to fall into."""
    times = []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        finally:
            gc.enable()
    return statistics.median(times)


def row(label: str, seconds: float, n: int, baseline: float | None = None) -> None:
    rate = n / seconds / 1e6
    ratio = f"{baseline / seconds:7.2f}x" if baseline is not None else "   (base)"
    print(f"  {label:<44} {seconds * 1e3:9.1f} ms  {rate:7.2f} M/s  {ratio}")


def bench_case(title: str, values: list, ser, repeat: int, *, with_json: bool = True) -> None:
    n = len(values)
    print(f"\n{title}  (n = {n:,}, median of {repeat})")
    pk = [pickle.dumps(v, protocol=5) for v in values]
    js = [json.dumps(v).encode() for v in values] if with_json else None
    buf, offsets = ser.serialize_many(values)
    ours_each = [ser.serialize(v) for v in values]

    print(" serialize")
    t_pickle = median_seconds(lambda: [pickle.dumps(v, protocol=5) for v in values], repeat)
    row("pickle.dumps per value (baseline)", t_pickle, n)
    if with_json:
        t_json = median_seconds(lambda: [json.dumps(v).encode() for v in values], repeat)
        row("json.dumps per value", t_json, n, t_pickle)
    t_many = median_seconds(lambda: ser.serialize_many(values), repeat)
    row("keygroups serialize_many (bulk)", t_many, n, t_pickle)
    s = ser.serialize
    t_each = median_seconds(lambda: [s(v) for v in values], repeat)
    row("keygroups serialize per value", t_each, n, t_pickle)

    print(" deserialize")
    t_pickle_l = median_seconds(lambda: [pickle.loads(b) for b in pk], repeat)
    row("pickle.loads per value (baseline)", t_pickle_l, n)
    if with_json:
        t_json_l = median_seconds(lambda: [json.loads(b) for b in js], repeat)
        row("json.loads per value", t_json_l, n, t_pickle_l)
    t_many_l = median_seconds(lambda: ser.deserialize_many(buf, offsets), repeat)
    row("keygroups deserialize_many (bulk)", t_many_l, n, t_pickle_l)
    d = ser.deserialize
    t_each_l = median_seconds(lambda: [d(b) for b in ours_each], repeat)
    row("keygroups deserialize per value", t_each_l, n, t_pickle_l)

    sizes = {"pickle": sum(map(len, pk)), "keygroups": len(buf)}
    if with_json:
        sizes["json"] = sum(map(len, js))
    print("  bytes: " + ", ".join(f"{k} {v / n:.1f}/value" for k, v in sizes.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    n = args.n
    rng = np.random.default_rng(42)

    ints = rng.integers(-(2**62), 2**62, size=n).tolist()
    bench_case("int64 (Python ints)", ints, Int64Serializer(), args.repeat)

    dicts = [{"user": f"u{i % 1000}", "count": int(c), "score": float(c) / 7.0, "tags": ["a", "b"], "ok": bool(c & 1)}
             for i, c in enumerate(rng.integers(0, 10**6, size=n))]
    bench_case("small dicts (ValueSerializer)", dicts, ValueSerializer(), args.repeat)

    print("\nratio = baseline time / our time (higher is better for keygroups)")


if __name__ == "__main__":
    main()
