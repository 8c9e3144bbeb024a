"""A small batch's task cost at a large max parallelism, beside the same batch at max parallelism 128 (issue 32's
task side: a cost that grows with max parallelism where it should grow with the batch is a defect).

    python benchmarks/bench_task_maxp.py                       # max p 128 and 4096, 100 carried files, 5 runs
    python benchmarks/bench_task_maxp.py --fill 20 --runs 3    # quicker

Spark-free, through the public API: ``KeyedFunctionHarness`` runs the same subtask code a Spark task runs (restore
or warm resume from the restore point's ``_metadata``, the records, the snapshot), p=2, heap state of ``--keys``
keys (one ValueState each, :class:`_jobs.RunningValue`), then ``--fill`` untimed batches of ``--batch`` records (so
that the restore point carries that many delta files), then ``--runs`` timed batches of the same size. Printed per
batch, medians: the subtasks' wall time (both, one after another, as the harness runs them), the CPU seconds of
the process over the batch (driver included), and from the subtasks' reports the seconds of their restore (decoding
the shipped ``_metadata``, planning, the warm resume) and snapshot (waiting for the snapshot thread). The row for
max parallelism 128 is the baseline: the batch does the same work at both (same records, same keys, same state);
the ratio says what max parallelism alone adds. In a Spark job every worker process decodes each batch's
``_metadata`` itself; here both subtasks share one process, as a Spark worker that runs both would.

The machine may be shared: the load is printed, and CPU beside wall.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _jobs import VALUE_OUTPUT, RunningValue  # noqa: E402
from _peers import load  # noqa: E402

from keygroups.testing import KeyedFunctionHarness  # noqa: E402

PARALLELISM = 2


def _batch(rng: np.random.Generator, keys: int, n: int) -> pa.Table:
    return pa.table({"key": pa.array(rng.integers(0, keys, n), pa.int64()), "value": pa.array(np.ones(n, np.int64)),
                     "ts": pa.array(np.zeros(n, np.int64))})


def measure(max_p: int, args: argparse.Namespace) -> dict[str, float]:
    rng = np.random.default_rng(7)
    rows: dict[str, list[float]] = {"subtasks": [], "cpu": [], "restore": [], "snapshot": [], "process": []}
    with KeyedFunctionHarness(RunningValue(), "key", output_schema=VALUE_OUTPUT, max_parallelism=max_p,
                              parallelism=PARALLELISM) as h:
        h.process(pa.table({"key": pa.array(np.arange(args.keys), pa.int64()),
                            "value": pa.array(np.ones(args.keys, np.int64)),
                            "ts": pa.array(np.zeros(args.keys, np.int64))}))
        for _ in range(args.fill):
            h.process(_batch(rng, args.keys, args.batch))
        carried = len(h.process(_batch(rng, args.keys, args.batch)).metadata.keyed_handles)
        for _ in range(args.runs):
            table = _batch(rng, args.keys, args.batch)
            c = time.process_time()
            batch = h.process(table)
            rows["cpu"].append(time.process_time() - c)
            rows["subtasks"].append(batch.phases["subtasks"])
            rows["restore"].append(sum(r.seconds.restore for r in batch.reports))
            rows["snapshot"].append(sum(r.seconds.snapshot for r in batch.reports))
            rows["process"].append(sum(r.seconds.process for r in batch.reports))
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["handles"] = carried
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-parallelism", type=int, nargs=2, default=[128, 4096], metavar=("BASELINE", "LARGE"))
    parser.add_argument("--fill", type=int, default=100, help="untimed batches first (delta files carried)")
    parser.add_argument("--runs", type=int, default=5, help="timed batches")
    parser.add_argument("--keys", type=int, default=20_000, help="keys of state loaded first")
    parser.add_argument("--batch", type=int, default=10, help="records per batch")
    args = parser.parse_args(argv)
    import keygroups
    print(f"keygroups from {os.path.dirname(keygroups.__file__)}; {args.batch}-record batches, p={PARALLELISM}, "
          f"{args.keys:,} keys of heap state, {args.fill} fill batches, {args.runs} timed; {load()} (2 cores, shared)")
    small, large = args.max_parallelism
    results = {mp: measure(mp, args) for mp in (small, large)}
    print(f"\nper batch, medians of {args.runs} (ms); {load()}")
    print(f"{'max p':>6}{'handles':>8}{'subtasks wall':>14}{'batch CPU':>10}{'restore':>9}{'process':>9}"
          f"{'snapshot':>9}")
    for mp, r in results.items():
        print(f"{mp:>6}{r['handles']:>8.0f}{r['subtasks'] * 1e3:>14.1f}{r['cpu'] * 1e3:>10.1f}"
              f"{r['restore'] * 1e3:>9.1f}{r['process'] * 1e3:>9.1f}{r['snapshot'] * 1e3:>9.1f}")
    a, b = results[small], results[large]
    print(f"{'ratio':>6}{'':>8}{b['subtasks'] / a['subtasks']:>13.2f}x{b['cpu'] / a['cpu']:>9.2f}x"
          f"{b['restore'] / a['restore']:>8.2f}x{b['process'] / a['process']:>8.2f}x{b['snapshot'] / a['snapshot']:>8.2f}x"
          f"   ({large} over {small})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
