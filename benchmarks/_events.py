"""The shared event log of the stateful benchmarks: one deterministic data set that every runner consumes.

Workload: per-key running count and sum. The events are Parquet files ``part-NNNNN.parquet`` in one directory,
columns

    key    int64   uniform over [0, n_keys)         (int64, not "user-…" strings: keygroups and Spark both hash
                                                    and group a long cheaply, so the benchmark measures state
                                                    handling rather than string handling)
    value  int64   uniform over [0, 1000)
    ts     int64   event time, epoch milliseconds, strictly increasing across the whole log (file i follows i-1)

File ``i`` is generated from ``numpy.random.default_rng([seed, i])``, so a file depends only on (seed, i, its size,
n_keys): any runner can regenerate or check it. A ``_events.json`` manifest records the parameters; calling
``generate_events`` again with the same parameters reuses the files. The reference state comes from pandas.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST = "_events.json"
TS_START_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
SCHEMA = pa.schema([("key", pa.int64()), ("value", pa.int64()), ("ts", pa.int64())])


def _file_sizes(n_events: int, n_files: int) -> list[int]:
    base, extra = divmod(n_events, n_files)
    return [base + (1 if i < extra else 0) for i in range(n_files)]


def generate_events(
    directory: str | os.PathLike,
    n_events: int = 5_000_000,
    n_keys: int = 100_000,
    n_files: int = 10,
    seed: int = 42,
) -> list[str]:
    """Write (or reuse) the event log in ``directory``; returns the Parquet file paths in log order.

    Files are written under a temporary name and renamed, so a streaming file source watching the directory never
    sees a partial file. A directory holding a different data set is rejected rather than overwritten.
    """
    if n_events < 1 or n_keys < 1 or not 1 <= n_files <= n_events:
        raise ValueError(
            f"need n_events >= 1, n_keys >= 1 and 1 <= n_files <= n_events; got n_events={n_events}, "
            f"n_keys={n_keys}, n_files={n_files}"
        )
    d = pathlib.Path(directory)
    params = {"n_events": n_events, "n_keys": n_keys, "n_files": n_files, "seed": seed, "format": 1}
    names = [f"part-{i:05d}.parquet" for i in range(n_files)]
    manifest = d / MANIFEST
    if manifest.exists():
        old = json.loads(manifest.read_text())
        if old == params and all((d / n).exists() for n in names):
            return [str(d / n) for n in names]
        raise ValueError(f"{d} holds another event log ({old}); wanted {params}. Use an empty directory.")
    d.mkdir(parents=True, exist_ok=True)
    if any(p.suffix == ".parquet" for p in d.iterdir()):
        raise ValueError(f"{d} has Parquet files but no {MANIFEST}; use an empty directory")
    offset = 0
    for i, size in enumerate(_file_sizes(n_events, n_files)):
        rng = np.random.default_rng([seed, i])
        table = pa.table(
            {
                "key": rng.integers(0, n_keys, size, dtype=np.int64),
                "value": rng.integers(0, 1000, size, dtype=np.int64),
                "ts": np.arange(TS_START_MS + offset, TS_START_MS + offset + size, dtype=np.int64),
            },
            schema=SCHEMA,
        )
        tmp = d / f".{names[i]}.tmp"
        pq.write_table(table, tmp, row_group_size=1 << 20)
        os.replace(tmp, d / names[i])
        offset += size
    manifest.write_text(json.dumps(params))
    return [str(d / n) for n in names]


def read_manifest(directory: str | os.PathLike) -> dict:
    """The parameters the event log in ``directory`` was generated with."""
    return json.loads((pathlib.Path(directory) / MANIFEST).read_text())


def event_files(directory: str | os.PathLike) -> list[str]:
    """The log's Parquet files, in log order."""
    n = read_manifest(directory)["n_files"]
    return [str(pathlib.Path(directory) / f"part-{i:05d}.parquet") for i in range(n)]


def reference_state(directory: str | os.PathLike, files: list[str] | None = None) -> pd.DataFrame:
    """Per-key (count, sum) over the given files (default: the whole log), by pandas; index ``key``, sorted."""
    files = event_files(directory) if files is None else files
    df = pq.read_table(files, columns=["key", "value"]).to_pandas()
    ref = df.groupby("key", sort=True)["value"].agg(["count", "sum"])
    return ref.astype("int64")


def compare_state(actual: pd.DataFrame, expected: pd.DataFrame) -> list[str]:
    """Differences between two per-key (count, sum) frames indexed by key; empty list when equal."""
    problems = []
    a = actual[["count", "sum"]].astype("int64").sort_index()
    e = expected[["count", "sum"]].astype("int64").sort_index()
    missing = e.index.difference(a.index)
    extra = a.index.difference(e.index)
    if len(missing):
        problems.append(f"{len(missing)} keys missing, e.g. {list(missing[:5])}")
    if len(extra):
        problems.append(f"{len(extra)} unexpected keys, e.g. {list(extra[:5])}")
    common = e.index.intersection(a.index)
    diff = (a.loc[common] != e.loc[common]).any(axis=1)
    if diff.any():
        bad = common[diff.to_numpy()][:5]
        problems.append(
            f"{int(diff.sum())} keys with wrong (count, sum), e.g. "
            + ", ".join(f"{k}: {tuple(a.loc[k])} != {tuple(e.loc[k])}" for k in bad)
        )
    return problems


def copy_files(files: list[str], directory: str | os.PathLike) -> None:
    """Copy log files into a streaming source directory, each atomically (temp name, then rename)."""
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for f in files:
        name = pathlib.Path(f).name
        tmp = d / f".{name}.tmp"
        shutil.copyfile(f, tmp)
        os.replace(tmp, d / name)
