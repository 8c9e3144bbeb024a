"""Changing max parallelism at restore (issue 14, item 2): bytes read per new subtask against its share of the state,
beside Spark's offline repartition of the same state.

    python benchmarks/bench_rescale.py [--keys 1000000] [--events 2000000] [--runs 3] [--skip-spark]

One event log (benchmarks/_events.py) is reduced to per-key (count, sum): Spark's transformWithStateInPandas baseline
(spark_tws_baseline.py, RocksDB provider) keeps it in 4 state partitions; keygroups keeps the same (count, sum) per
key in a heap backend's checkpoint at max parallelism 128, parallelism 4. Then, medians of ``--runs``:

* keygroups: every subtask of the new job (parallelism 8) restores from that checkpoint with max parallelism 128
  (unchanged: the reference), 256 and 512 (key groups split by k = 2, 4) and 64 (merged by 2), one after another,
  as one host running them would. Per subtask: bytes read (``RestoreStats``) against its share, the state's keyed
  bytes times its part of the new key groups (target: at most k times its share when splitting, its share when
  merging; never the whole state), and the wall time of its restore (read, merge, re-key, load). Keys are checked
  against the reference after each change: every key in its subtask, with its (count, sum).
* Spark: ``spark._streamingCheckpointManager.repartition(checkpoint, 8)`` on a copy of the p=4 checkpoint
  (spark_repartition_baseline.run_spark_repartition): it reads the whole state, shuffles and rewrites it (Spark has no
  max parallelism: its state partitions are its key groups, and a repartition rewrites all of them).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _events import generate_events, reference_state  # noqa: E402

from keygroups import assign_operators, key_group_range  # noqa: E402
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, chain_stats, plan_keyed_restore  # noqa: E402
from keygroups.serializers import Int64Serializer  # noqa: E402
from keygroups.state import HeapKeyedStateBackend, ValueStateDescriptor  # noqa: E402

OLD_MAX_PARALLELISM = 128
OLD_PARALLELISM = 4
NEW_PARALLELISM = 8
CHANGES = [128, 256, 512, 64]


def descriptors() -> tuple[ValueStateDescriptor, ValueStateDescriptor]:
    return ValueStateDescriptor("count", Int64Serializer()), ValueStateDescriptor("sum", Int64Serializer())


def write_checkpoint(storage: CheckpointStorage, keys: np.ndarray, counts: np.ndarray, sums: np.ndarray) -> None:
    """The reference (count, sum) per key as checkpoint 1 of a job at max parallelism 128, parallelism 4."""
    owners = assign_operators(keys, OLD_MAX_PARALLELISM, OLD_PARALLELISM)
    handles = []
    for i in range(OLD_PARALLELISM):
        backend = HeapKeyedStateBackend(key_group_range(OLD_MAX_PARALLELISM, OLD_PARALLELISM, i),
                                        OLD_MAX_PARALLELISM, Int64Serializer(), subtask_index=i)
        count, total = (backend.get_state(d) for d in descriptors())
        mine = owners == i
        for k, c, s in zip(keys[mine].tolist(), counts[mine].tolist(), sums[mine].tolist()):
            backend.set_current_key(k)
            count.update(c)
            total.update(s)
        handles.append(backend.snapshot(1, storage).result())
    storage.commit(CheckpointMetadata(1, "rescale-bench", 0, OLD_MAX_PARALLELISM, OLD_PARALLELISM, handles))


def restore_all(storage: CheckpointStorage, max_parallelism: int, sample: dict[int, tuple[int, int]] | None
                ) -> list[tuple[int, float, int]]:
    """Restore every new subtask in turn; per subtask (bytes read, seconds, old key groups read, from the plan).
    With ``sample`` (key ->
    (count, sum)), checks those keys in their subtask."""
    md = storage.latest()
    out = []
    for i in range(NEW_PARALLELISM):
        r = key_group_range(max_parallelism, NEW_PARALLELISM, i)
        backend = HeapKeyedStateBackend(r, max_parallelism, Int64Serializer(), subtask_index=i)
        start = time.perf_counter()
        stats = backend.restore(storage, md)
        seconds = time.perf_counter() - start
        if sample is not None:
            count, total = (backend.get_state(d) for d in descriptors())
            keys = np.fromiter(sample, dtype=np.int64)
            mine = keys[assign_operators(keys, max_parallelism, NEW_PARALLELISM) == i]
            for k in mine.tolist():
                backend.set_current_key(k)
                if (count.value(), total.value()) != sample[k]:
                    raise AssertionError(f"max parallelism {max_parallelism}, subtask {i}: key {k} holds "
                                         f"{(count.value(), total.value())}, the reference says {sample[k]}")
            n = sum(1 for _ in backend.keys("count"))
            expected = int(np.count_nonzero(assign_operators(ALL_KEYS, max_parallelism, NEW_PARALLELISM) == i))
            if n != expected:
                raise AssertionError(f"max parallelism {max_parallelism}, subtask {i}: {n} keys, expected {expected}")
        read = {kg for _, part in plan_keyed_restore(md, r, max_parallelism=max_parallelism) for kg in part}
        out.append((stats.bytes_read, seconds, len(read)))
        backend.dispose()
    return out


ALL_KEYS = np.empty(0, dtype=np.int64)


def main(argv: list[str] | None = None) -> int:
    global ALL_KEYS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--skip-spark", action="store_true")
    args = ap.parse_args(argv)
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="bench-rescale-"))
    data = work / "events"
    files = generate_events(data, args.events, args.keys, 2)
    ref = reference_state(data, files)
    ALL_KEYS = ref.index.to_numpy(dtype=np.int64)
    counts, sums = ref["count"].to_numpy(np.int64), ref["sum"].to_numpy(np.int64)
    print(f"state: {len(ALL_KEYS):,} keys with (count, sum) from {args.events:,} events", flush=True)

    storage = CheckpointStorage(str(work / "keygroups"))
    t = time.perf_counter()
    write_checkpoint(storage, ALL_KEYS, counts, sums)
    md = storage.latest()
    total = sum(c.full_bytes + c.delta_bytes for c in chain_stats(
        md, key_group_range(OLD_MAX_PARALLELISM, 1, 0)).values())
    print(f"keygroups checkpoint: max parallelism {OLD_MAX_PARALLELISM}, p={OLD_PARALLELISM}, {total:,} bytes of "
          f"keyed state ({time.perf_counter() - t:.1f}s to write)", flush=True)
    rng = np.random.default_rng(7)
    picks = rng.choice(len(ALL_KEYS), size=min(20_000, len(ALL_KEYS)), replace=False)
    sample = {int(ALL_KEYS[j]): (int(counts[j]), int(sums[j])) for j in picks}

    rows = []
    for mp in CHANGES:
        restore_all(storage, mp, sample)   # checked (and warms the page cache); not timed
        runs = [restore_all(storage, mp, None) for _ in range(args.runs)]
        per_subtask = []
        for i in range(NEW_PARALLELISM):
            owned = len(key_group_range(mp, NEW_PARALLELISM, i))
            nbytes, _, groups = runs[-1][i]
            # its share: of the bytes, by its part of the new key groups; of the old key groups, exactly
            per_subtask.append((nbytes, total * owned / mp, statistics.median(r[i][1] for r in runs),
                                groups / (owned * OLD_MAX_PARALLELISM / mp)))
        k = mp // OLD_MAX_PARALLELISM if mp >= OLD_MAX_PARALLELISM else 1
        worst = max(g for *_, g in per_subtask)
        ok = worst <= k and max(b for b, *_ in per_subtask) < total
        rows.append((mp, k, per_subtask, ok))
        print(f"max parallelism {OLD_MAX_PARALLELISM} -> {mp}: worst subtask read {worst:.2f}x its share of the "
              f"old key groups (target <= {k}x, never the whole state: {'OK' if ok else 'MISSED'})", flush=True)

    spark_result = None
    if not args.skip_spark:
        from spark_repartition_baseline import run_spark_repartition
        from spark_tws_baseline import build_session, run_tws

        spark = build_session()
        try:
            base = work / "spark-base"
            r = run_tws(spark, str(data), str(base), OLD_PARALLELISM)
            print(f"Spark checkpoint at p={OLD_PARALLELISM}: {r['events']:,} events in {r['seconds']:.1f}s", flush=True)
            results = []
            for i in range(args.runs):
                ck = work / f"spark-repartition-{i}"
                shutil.rmtree(ck, ignore_errors=True)
                shutil.copytree(base, ck)
                results.append(run_spark_repartition(spark, str(ck), NEW_PARALLELISM))
                shutil.rmtree(ck, ignore_errors=True)
            spark_result = (statistics.median(x["seconds"] for x in results), results[-1])
        finally:
            spark.stop()

    print(f"\n== Max-parallelism change at restore: {len(ALL_KEYS):,} keys, {total:,} B of keyed state, "
          f"p={OLD_PARALLELISM} -> p'={NEW_PARALLELISM}, medians of {args.runs} runs")
    print(f"{'change':<32}{'key groups read / share':>25}{'bytes read / share':>22}{'bytes read, sum':>17}"
          f"{'restore s/subtask (median, max)':>34}")
    for mp, k, per_subtask, _ in rows:
        label = f"keygroups maxP {OLD_MAX_PARALLELISM}->{mp}" + (" (same)" if mp == OLD_MAX_PARALLELISM else
                                                                  f" (x{mp // OLD_MAX_PARALLELISM})" if mp > 128
                                                                  else f" (/{OLD_MAX_PARALLELISM // mp})")
        ratios = [b / s for b, s, _, _ in per_subtask]
        groups = [g for *_, g in per_subtask]
        secs = [t for _, _, t, _ in per_subtask]
        print(f"{label:<32}{f'{max(groups):.2f}x (target <= {k}x)':>25}{f'{min(ratios):.2f}x - {max(ratios):.2f}x':>22}"
              f"{sum(b for b, *_ in per_subtask):>17,}{f'{statistics.median(secs):.3f}, {max(secs):.3f}':>34}")
    if spark_result is not None:
        secs, last = spark_result
        print(f"{'Spark repartition 4->8':<32}{'all (one job)':>25}{'whole state':>22}{last['bytes_read']:>17,}"
              f"{f'{secs:.2f} (whole job)':>34}")
        print(f"  Spark: {last['records_read']:,} rows read, {last['shuffle_bytes']:,} B shuffled, state dir "
              f"{last['state_bytes_before']:,} -> {last['state_bytes_after']:,} B, partitions "
              f"{last['partitions_before']} -> {last['partitions_after']}")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
