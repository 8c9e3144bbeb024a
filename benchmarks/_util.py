"""Shared helpers for the benchmarks: the one timer (medians of repeated, interleaved runs) and a side-by-side table."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Timing:
    """The median wall time of a benchmarked call, and what its last timed call returned (to check outputs)."""

    seconds: float
    result: Any


def measure(
    fns: Mapping[str, Callable[[], Any]], runs: int = 5, warmup: int = 0, keep_results: bool = True
) -> dict[str, Timing]:
    """Times every fn ``runs`` times and returns each one's median, by label.

    Runs are interleaved (round r calls every fn once), so that a change in the load of the shared machine lands on
    all candidates alike. Before each call the cyclic GC collects, and it is paused while the call is timed, as
    ``timeit`` does: its passes over millions of fresh objects would otherwise land on whichever call made them.
    ``warmup`` untimed rounds come first (caches, page faults of a first allocation). ``keep_results=False`` drops
    every result at once (``Timing.result`` is then None), so that no candidate's objects stay alive beside the
    others' calls."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {label: [] for label in fns}
    results: dict[str, Any] = dict.fromkeys(fns)
    for _ in range(runs):
        for label, fn in fns.items():
            results[label] = None  # the previous result's memory is free before the next call
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter()
                result = fn()
                times[label].append(time.perf_counter() - start)
            finally:
                gc.enable()
            results[label] = result if keep_results else None
            result = None
    return {label: Timing(statistics.median(times[label]), results[label]) for label in fns}


def median_seconds(fn: Callable[[], Any], runs: int = 5, warmup: int = 1) -> float:
    """:func:`measure` of one call: its median wall time in seconds."""
    return measure({"fn": fn}, runs, warmup)["fn"].seconds


def print_table(title: str, rows: list[tuple[str, float, int]]) -> None:
    """rows: (label, seconds, items); prints ns/item, items/s and each row's time per item against the first row's."""
    print(f"\n== {title}")
    print(f"{'candidate':<48} {'ns/key':>10} {'keys/s':>14} {'vs first':>10}")
    first = rows[0][1] / rows[0][2]
    for label, seconds, items in rows:
        per = seconds / items
        print(f"{label:<48} {per * 1e9:>10.2f} {1 / per:>14,.0f} {per / first:>9.1f}x")
