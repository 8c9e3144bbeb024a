"""Issue 33 item 2: decoding one key's stored state value, compiled (``ValueFraming.decode``, ``framing.ValueReader``)
against the Python reference (``ValueFraming.reference_decode``: ``split_list``/``split_map``, then a serializer's
``deserialize`` per element and ``java_keys`` for map keys).

    python benchmarks/bench_value_decode.py                  # 200k values per case, medians of 3
    python benchmarks/bench_value_decode.py --values 50000 --runs 5

Cases (``--values`` stored values each, decoded one by one as a backend reads them):

- map int64 -> bool, 1-4 entries: the hidden timer map (``keygroups.state.timers``), whose first read per key is
  what a profile of timer firing found decoding in Python;
- map str -> float64, 1-4 entries (with TTL too: the ``(value, timestamp)`` pairs);
- list int64 and list str, 1-4 elements (with TTL too);
- value int64 with TTL.

CPU (``time.process_time``) beside wall, per value, medians of ``--runs``; the machine is shared, so CPU is the
steadier figure. Each run checks that both decoders returned the same values.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from keygroups.serializers import BoolSerializer, Float64Serializer, Int64Serializer, StrSerializer
from keygroups.state._codec import ValueFraming


def _cases(n: int) -> list[tuple[str, ValueFraming, list[bytes]]]:
    rnd = random.Random(33)

    def sizes() -> int:
        return rnd.randint(1, 4)

    def word() -> str:
        return "".join(rnd.choice("abcdefghij") for _ in range(rnd.randint(3, 10)))

    cases: list[tuple[str, ValueFraming, Callable[[], Any]]] = [
        ("map int64 -> bool (timers)", ValueFraming("t", "map", BoolSerializer(), Int64Serializer()),
         lambda: {rnd.randrange(1 << 40): True for _ in range(sizes())}),
        ("map str -> float64", ValueFraming("m", "map", Float64Serializer(), StrSerializer()),
         lambda: {word(): rnd.random() for _ in range(sizes())}),
        ("map str -> float64, TTL", ValueFraming("m", "map", Float64Serializer(), StrSerializer(), ttl=True),
         lambda: {word(): (rnd.random(), rnd.randrange(1 << 40)) for _ in range(sizes())}),
        ("list int64", ValueFraming("l", "list", Int64Serializer()),
         lambda: [rnd.randrange(-(1 << 62), 1 << 62) for _ in range(sizes())]),
        ("list int64, TTL", ValueFraming("l", "list", Int64Serializer(), ttl=True),
         lambda: [(rnd.randrange(1 << 40), rnd.randrange(1 << 40)) for _ in range(sizes())]),
        ("list str", ValueFraming("l", "list", StrSerializer()), lambda: [word() for _ in range(sizes())]),
        ("value int64, TTL", ValueFraming("v", "value", Int64Serializer(), ttl=True),
         lambda: (rnd.randrange(1 << 40), rnd.randrange(1 << 40))),
    ]
    return [(name, framing, [framing.encode(make()) for _ in range(n)]) for name, framing, make in cases]


def _timed(decode: Callable[[Any], Any], stored: list[bytes]) -> tuple[float, float, list[Any]]:
    gc.collect()
    gc.disable()   # the values decoded are kept: the collector's passes over them would be timed, not the decoding
    try:
        c, t = time.process_time(), time.perf_counter()
        out = [decode(b) for b in stored]
        return time.process_time() - c, time.perf_counter() - t, out
    finally:
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--values", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    n = args.values
    print(f"{n:,} stored values per case, decoded one by one, medians of {args.runs}; "
          f"load {os.getloadavg()[0]:.1f} (2 cores, shared machine)")
    print(f"{'case':30} {'compiled CPU µs':>16} {'wall':>7} {'reference CPU µs':>17} {'wall':>7} {'CPU ratio':>10}")
    for name, framing, stored in _cases(n):
        fast: list[tuple[float, float]] = []
        slow: list[tuple[float, float]] = []
        for _ in range(args.runs):   # interleaved, so that load shifts hit both alike
            c, w, got = _timed(framing.decode, stored)
            fast.append((c, w))
            c, w, expected = _timed(framing.reference_decode, stored)
            slow.append((c, w))
            assert got == expected, name
            del got, expected
        fc, fw = (statistics.median(x) * 1e6 / n for x in zip(*fast))
        sc, sw = (statistics.median(x) * 1e6 / n for x in zip(*slow))
        print(f"{name:30} {fc:16.3f} {fw:7.3f} {sc:17.3f} {sw:7.3f} {sc / fc:9.2f}x")


if __name__ == "__main__":
    main()
