"""Serializer throughput: keygroups' compiled serializers beside pickle and json doing the same work.

"The same work" is N separately addressable encodings (what keyed state stores: one value per key), so the
baselines are ``[pickle.dumps(v) for v in values]`` and ``[json.dumps(v).encode() for v in values]`` (and their
loads). Ours is shown both in bulk (``serialize_many``: one buffer + offsets, how snapshots write) and per value
(``serialize`` in a Python loop, how a state update writes). Medians of several interleaved runs (GC paused while timing, as timeit does); ratio = baseline / ours, so
> 1 means we are faster.

    python benchmarks/bench_serializers.py [--n 1000000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from keygroups.serializers import Int64Serializer, ValueSerializer
from _util import measure


def report(title: str, fns: dict[str, Callable[[], Any]], n: int, repeat: int) -> None:
    """Times fns (the first is the baseline) and prints time, rate and baseline/ours per line."""
    print(f" {title}")
    m = {label: t.seconds for label, t in measure(fns, repeat, keep_results=False).items()}
    base = next(iter(m.values()))
    for i, (label, sec) in enumerate(m.items()):
        ratio = "   (base)" if i == 0 else f"{base / sec:7.2f}x"
        print(f"  {label:<44} {sec * 1e3:9.1f} ms  {n / sec / 1e6:7.2f} M/s  {ratio}")


def bench_case(title: str, values: list, ser, repeat: int) -> None:
    n = len(values)
    print(f"\n{title}  (n = {n:,}, median of {repeat})")
    pk = [pickle.dumps(v, protocol=5) for v in values]
    js = [json.dumps(v).encode() for v in values]
    buf, offsets = ser.serialize_many(values)
    ours_each = [ser.serialize(v) for v in values]
    s, d = ser.serialize, ser.deserialize

    report("serialize", {
        "pickle.dumps per value (baseline)": lambda: [pickle.dumps(v, protocol=5) for v in values],
        "json.dumps per value": lambda: [json.dumps(v).encode() for v in values],
        "keygroups serialize_many (bulk)": lambda: ser.serialize_many(values),
        "keygroups serialize per value": lambda: [s(v) for v in values],
    }, n, repeat)
    report("deserialize", {
        "pickle.loads per value (baseline)": lambda: [pickle.loads(b) for b in pk],
        "json.loads per value": lambda: [json.loads(b) for b in js],
        "keygroups deserialize_many (bulk)": lambda: ser.deserialize_many(buf, offsets),
        "keygroups deserialize per value": lambda: [d(b) for b in ours_each],
    }, n, repeat)
    sizes = {"pickle": sum(map(len, pk)), "json": sum(map(len, js)), "keygroups": len(buf)}
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
