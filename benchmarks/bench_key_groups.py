"""Key-group assignment speed, single thread: keygroups' compiled kernels beside (a) numpy doing the same formula and
(b) a per-key Python loop over mmh3. Medians of --runs runs.

    python benchmarks/bench_key_groups.py [--n 10000000] [--runs 5]

numpy's murmur is keygroups.spark.partitioner.spark_hash_int with seed 0 (Spark's Murmur3 of an int is Flink's
MathUtils.murmurHash before its sign rule), so importing this needs pyspark installed (a bench dependency), not a
Spark session.

The per-key Python loop is timed on a --loop-sample subset (the work per key is the same; timing 10M keys of it would
take minutes) and reported per key.
"""

from __future__ import annotations

import argparse
import os
import struct
from typing import Any

import mmh3
import numpy as np
import pyarrow as pa

import keygroups as kg
from _util import measure, median_seconds, print_table
from keygroups._native import hashing
from keygroups.spark.partitioner import spark_hash_int

MAX_PARALLELISM = 128
U32 = np.uint32


def numpy_murmur(h: np.ndarray) -> np.ndarray:
    """Flink's MathUtils.murmurHash over an array of Java int hashes (uint32 bits): Spark's Murmur3 of an int with
    seed 0, then Flink's sign rule (-m for negative m, 0 for Integer.MIN_VALUE)."""
    m = spark_hash_int(h.view(np.int32), seed=0).astype(np.int64)
    return np.where(m >= 0, m, np.where(m != -(2**31), -m, 0))


def numpy_int64_groups(values: np.ndarray) -> np.ndarray:
    u = values.view(np.uint64)
    return (numpy_murmur((u ^ (u >> np.uint64(32))).astype(U32)) % MAX_PARALLELISM).astype(np.int16)


def numpy_string_hashes(arr: pa.Array) -> np.ndarray:
    """String.hashCode over ASCII Arrow strings: Horner's rule across a padded (n, width) byte matrix."""
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8)
    lengths = np.diff(offsets)
    width = int(lengths.max())
    h = np.zeros(len(arr), dtype=U32)
    for j in range(width):
        live = lengths > j
        idx = np.where(live, offsets[:-1] + j, 0)
        h = np.where(live, h * U32(31) + data[idx].astype(U32), h)
    return h


def numpy_string_groups(arr: pa.Array) -> np.ndarray:
    return (numpy_murmur(numpy_string_hashes(arr)) % MAX_PARALLELISM).astype(np.int16)


def numpy_tuple_groups(tuples: list) -> np.ndarray:
    users, counts = zip(*tuples)
    h_user = numpy_string_hashes(pa.array(users, pa.string()))
    c = np.array(counts, dtype=np.int64).view(np.uint64)
    h_count = (c ^ (c >> np.uint64(32))).astype(U32)
    return (numpy_murmur(h_user * U32(31) + h_count) % MAX_PARALLELISM).astype(np.int16)


def flink_mod(h: int) -> int:
    m = mmh3.hash(struct.pack("<i", h), seed=0, signed=True)
    m = m if m >= 0 else (-m if m != -(2**31) else 0)
    return m % MAX_PARALLELISM


def py_long_hash(v: int) -> int:
    u = v & 0xFFFFFFFFFFFFFFFF
    x = (u ^ (u >> 32)) & 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


def py_string_hash(s: str) -> int:
    h = 0
    for ch in s:
        h = (31 * h + ord(ch)) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def python_loop_int64(values: list[int]) -> list[int]:
    return [flink_mod(py_long_hash(v)) for v in values]


def python_loop_strings(values: list[str]) -> list[int]:
    return [flink_mod(py_string_hash(s)) for s in values]


def python_loop_tuples(values: list[tuple]) -> list[int]:
    out = []
    for user, count in values:
        h = (31 * py_string_hash(user) + py_long_hash(count)) & 0xFFFFFFFF
        out.append(flink_mod(h - (1 << 32) if h >= 1 << 31 else h))
    return out


def by_vector_path(label: str, run: Any, n: int, runs: int) -> list[tuple[str, float, int]]:
    """``run`` timed under each vector path this CPU has (widest first), as rows for print_table."""
    rows = []
    for level, path in ((2, "AVX-512"), (1, "AVX2"), (0, "scalar")):
        if level > hashing._simd_active():
            continue
        previous = hashing._set_simd(level)
        try:
            rows.append((f"{label}, {path} path", median_seconds(run, runs), n))
        finally:
            hashing._set_simd(previous)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10_000_000, help="keys for int64 and strings (tuples: n / 10)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--loop-sample", type=int, default=200_000)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rng = np.random.default_rng(42)
    n, sample = args.n, args.loop_sample
    print(f"keygroups {kg.__version__}, max_parallelism={MAX_PARALLELISM}, medians of {args.runs} runs, 1 thread")

    ints = rng.integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)
    ours = kg.assign_key_groups(ints, MAX_PARALLELISM)
    assert np.array_equal(ours, numpy_int64_groups(ints))
    assert python_loop_int64(ints[:1000].tolist()) == ours[:1000].tolist()
    ints_list = ints[:sample].tolist()
    reused = np.empty(n, dtype=np.int16)
    # Interleaved runs: the ratio to numpy is what the target is about, so both see the same machine load.
    timings = measure(
        {
            "fresh": lambda: kg.assign_key_groups(ints, MAX_PARALLELISM),
            "reused": lambda: kg.assign_key_groups(ints, MAX_PARALLELISM, out=reused),
            "numpy": lambda: numpy_int64_groups(ints),
        },
        args.runs, warmup=1, keep_results=False,
    )
    fresh_s, reused_s, numpy_s = (timings[k].seconds for k in ("fresh", "reused", "numpy"))
    print_table(
        f"{n:,} random int64 keys (numpy)",
        [
            ("keygroups.assign_key_groups", fresh_s, n),
            ("keygroups.assign_key_groups(out=one buffer)", reused_s, n),
            ("(a) numpy, same formula", numpy_s, n),
            (f"(b) Python loop over mmh3 ({sample:,} keys)", median_seconds(lambda: python_loop_int64(ints_list), args.runs), sample),
        ],
    )
    print(f"int64, {n:,} keys: keygroups is {numpy_s / fresh_s:.1f}x numpy ({numpy_s / reused_s:.1f}x with out=); "
          "target >= 20x")
    print_table(f"the same {n:,} int64 keys, by vector path (this CPU's widest first)",
                by_vector_path("assign_key_groups(out=)",
                               lambda: kg.assign_key_groups(ints, MAX_PARALLELISM, out=reused), n, args.runs))

    ids = rng.integers(1_000_000, 10_000_000, size=n)
    strings = pa.array(np.char.add("user-", ids.astype(str)).astype(object), pa.string())
    ours = kg.assign_key_groups(strings, MAX_PARALLELISM)
    assert np.array_equal(ours, numpy_string_groups(strings))
    strings_list = strings.slice(0, sample).to_pylist()
    assert python_loop_strings(strings_list[:1000]) == ours[:1000].tolist()
    avg = (len(strings.buffers()[2]) if strings.buffers()[2] else 0) / n
    print_table(
        f"{n:,} Arrow utf8 keys like 'user-1234567' ({avg:.1f} bytes on average)",
        [
            ("keygroups.assign_key_groups", median_seconds(lambda: kg.assign_key_groups(strings, MAX_PARALLELISM), args.runs), n),
            ("(a) numpy, same formula", median_seconds(lambda: numpy_string_groups(strings), args.runs), n),
            (f"(b) Python loop over mmh3 ({sample:,} keys)", median_seconds(lambda: python_loop_strings(strings_list), args.runs), sample),
        ],
    )

    # The same call with the vector path capped narrower: what a CPU without AVX-512 (or without AVX2) would run.
    print_table(f"the same {n:,} Arrow utf8 keys, by vector path (this CPU's widest first)",
                by_vector_path("assign_key_groups", lambda: kg.assign_key_groups(strings, MAX_PARALLELISM), n,
                               args.runs))

    m = n // 10
    tuples = list(zip(strings.slice(0, m).to_pylist(), ints[:m].tolist()))
    ours = kg.assign_key_groups(tuples, MAX_PARALLELISM)
    assert np.array_equal(ours, numpy_tuple_groups(tuples))
    tuples_sample = tuples[:sample]
    print_table(
        f"{m:,} 2-tuples (str, int) as a Python list",
        [
            ("keygroups.assign_key_groups", median_seconds(lambda: kg.assign_key_groups(tuples, MAX_PARALLELISM), args.runs), m),
            ("(a) numpy, same formula (incl. unzip)", median_seconds(lambda: numpy_tuple_groups(tuples), args.runs), m),
            (f"(b) Python loop over mmh3 ({sample:,} keys)", median_seconds(lambda: python_loop_tuples(tuples_sample), args.runs), sample),
        ],
    )
    print("\nReference (Flink's own JVM loop on this kind of machine): ~10 ns/key boxed Long, ~22 ns/key fresh String.")


if __name__ == "__main__":
    main()
