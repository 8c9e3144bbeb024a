"""Shared helpers for the benchmarks: medians of repeated runs, printed side by side with ratios."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def median_seconds(fn: Callable[[], Any], runs: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``runs`` calls of fn, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_table(title: str, rows: list[tuple[str, float, int]], baseline: str | None = None) -> None:
    """rows: (label, seconds, items); prints ns/item, items/s and the ratio to every other row against the first."""
    print(f"\n== {title}")
    print(f"{'candidate':<44} {'ns/key':>10} {'keys/s':>14} {'vs first':>10}")
    first = rows[0][1] / rows[0][2]
    for label, seconds, items in rows:
        per = seconds / items
        print(f"{label:<44} {per * 1e9:>10.2f} {1 / per:>14,.0f} {per / first:>9.1f}x")
