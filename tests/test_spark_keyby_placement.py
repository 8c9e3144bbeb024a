"""Exact placement on a real local Spark session: Spark partition i holds exactly subtask i's records.

RDDs through KeyGroupPartitioner / key_by, DataFrames through partition_by_key_group (repartitionById, and the
hash-partitioning route for Spark versions without it); determinism across processes and PYTHONHASHSEED values.
The DataFrame tests that take ``any_spark`` run over Spark Connect too (test_spark_connect.py checks exact placement
there): empty input on both routes, sorting without a key-group column, and the errors."""

from __future__ import annotations

import decimal
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import keygroups as kg
from conftest import is_connect, load_jsonl

pyspark = pytest.importorskip("pyspark")
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql import types as T  # noqa: E402

from keygroups.spark import KeyGroupPartitioner, key_by, partition_by_key_group  # noqa: E402
from keygroups.spark.partitioner import hash_partitioning_stand_ins, spark_hash_int  # noqa: E402
from test_spark_keyby_columns import ENGINES_BY_SESSION  # noqa: E402

pytestmark = pytest.mark.spark

MAX_PARALLELISM = 64
PARALLELISMS = [1, 3, 7, MAX_PARALLELISM]

# Keys whose Python hash() depends on PYTHONHASHSEED (str, bytes, tuples of them) plus ints and floats.
MIXED_KEYS = [f"user-{i}" for i in range(200)] + [("user", i) for i in range(100)] + list(range(-50, 250)) + [
    b"\x00\xff",
    1.5,
    -0.0,
    True,
    "😀",
]


# ---- KeyGroupPartitioner ------------------------------------------------------------------------------------------


def test_partitioner_agrees_with_flink_golden_vectors():
    rows = [r for r in load_jsonl("key_groups.jsonl") if r["type"] in ("long", "string", "tuple<string,long>")]
    for row in rows:
        key = tuple(row["key"]) if row["type"].startswith("tuple") else row["key"]
        if isinstance(key, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in key):
            continue
        for mp_s, group in row["key_groups"].items():
            mp = int(mp_s)
            for p in {1, max(1, mp // 3), mp}:
                part = KeyGroupPartitioner(mp, p)
                assert part(key) == group * p // mp, (key, mp, p)


def test_partitioner_agrees_with_assign_to_operator():
    for p in PARALLELISMS:
        part = KeyGroupPartitioner(MAX_PARALLELISM, p)
        for key in MIXED_KEYS:
            assert part(key) == kg.assign_to_operator(key, MAX_PARALLELISM, p), key
    typed = KeyGroupPartitioner(128, 5, key_type="int")
    assert [typed(k) for k in range(-20, 20)] == [kg.assign_to_operator(k, 128, 5, "int") for k in range(-20, 20)]


def test_partitioner_pickles_compares_and_validates():
    part = KeyGroupPartitioner(128, 7, key_type=("string", "long"))
    clone = pickle.loads(pickle.dumps(part))
    assert clone == part and hash(clone) == hash(part)
    assert clone(("a", 1)) == part(("a", 1))
    assert (clone.max_parallelism, clone.parallelism, clone.key_type) == (128, 7, ("string", "long"))
    assert KeyGroupPartitioner(128, 7) != KeyGroupPartitioner(128, 8)
    assert KeyGroupPartitioner(128, 7) != KeyGroupPartitioner(256, 7)
    assert "max_parallelism=128" in repr(part)
    with pytest.raises(ValueError, match="parallelism must be in"):
        KeyGroupPartitioner(8, 9)
    with pytest.raises(ValueError, match="unknown key_type"):
        KeyGroupPartitioner(8, 2, key_type="uuid")
    with pytest.raises(ValueError, match="must not be None"):
        KeyGroupPartitioner(8, 2)(None)


_CHILD = """
import json, sys
from keygroups.spark import KeyGroupPartitioner
keys = json.loads(sys.stdin.read())
keys = [tuple(k) if isinstance(k, list) else k for k in keys]
part = KeyGroupPartitioner(64, 7)
with open(sys.argv[1], "w") as out:  # a file, not stdout: nothing else the interpreter prints can get mixed in
    json.dump([part(k) for k in keys] + [hash("probe")], out)
"""


def test_partitioner_is_deterministic_across_processes_and_hash_seeds(tmp_path):
    keys = [k for k in MIXED_KEYS if not isinstance(k, bytes)]
    part = KeyGroupPartitioner(64, 7)
    expected = [part(k) for k in keys]
    probes = set()
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        path = tmp_path / f"placement-{seed}.json"
        subprocess.run([sys.executable, "-c", _CHILD, str(path)], input=json.dumps(keys), capture_output=True,
                       text=True, env=env, check=True)
        result = json.loads(path.read_text())
        probes.add(result.pop())
        assert result == expected, seed
    assert len(probes) > 1  # the seeds really did change Python's own str hash


# ---- RDDs -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("parallelism", PARALLELISMS)
def test_key_by_places_every_key_in_its_subtask(spark, parallelism):
    values = [{"id": i, "user": f"u{i % 97}"} for i in range(600)]
    rdd = spark.sparkContext.parallelize(values, 4)
    keyed = key_by(rdd, lambda v: v["user"], max_parallelism=MAX_PARALLELISM, parallelism=parallelism)
    assert keyed.getNumPartitions() == parallelism
    parts = keyed.glom().collect()
    assert len(parts) == parallelism
    assert sum(len(part) for part in parts) == len(values)
    for i, part in enumerate(parts):
        owned = kg.key_group_range(MAX_PARALLELISM, parallelism, i)
        for key, value in part:
            assert key == value["user"]
            assert kg.assign_to_key_group(key, MAX_PARALLELISM) in owned


def test_key_by_defaults_and_workers_agree_with_the_driver(spark):
    """Default parallelism is the RDD's partition count, default max parallelism Flink's default; the Python
    workers (other processes) place keys exactly where the driver computes them."""
    rdd = spark.sparkContext.parallelize([(f"k{i}", i) for i in range(300)], 5)
    keyed = key_by(rdd, lambda v: v[0])
    assert keyed.getNumPartitions() == 5
    mp = kg.default_max_parallelism(5)
    for i, part in enumerate(keyed.glom().collect()):
        assert all(kg.assign_to_operator(key, mp, 5) == i for key, _ in part)


def test_key_by_tuple_keys_and_partitioner_reuse(spark):
    rdd = spark.sparkContext.parallelize([("a", i % 13, i) for i in range(200)], 3)
    keyed = key_by(rdd, lambda v: (v[0], v[1]), max_parallelism=32, parallelism=3)
    again = keyed.partitionBy(3, KeyGroupPartitioner(32, 3))
    assert again is keyed  # equal partitioners: PySpark skips the second shuffle
    for i, part in enumerate(keyed.glom().collect()):
        assert all(kg.assign_to_operator(key, 32, 3) == i for key, _ in part)


def test_key_by_null_key_fails(spark):
    rdd = spark.sparkContext.parallelize([1, 2, None], 2)
    with pytest.raises(Exception, match="must not be None"):
        key_by(rdd, lambda v: v, max_parallelism=8, parallelism=2).collect()
    with pytest.raises(TypeError, match="key_fn must be callable"):
        key_by(rdd, "v", max_parallelism=8, parallelism=2)


# ---- DataFrames -----------------------------------------------------------------------------------------------------


def _check_placement(df, key_fn, key_type, max_parallelism, parallelism):
    """Every row is in Spark partition == its Flink subtask, and carries its Flink key group. One Spark job: collect()
    returns the partitions in order, each in its own row order."""
    rows = df.withColumn("pid", F.spark_partition_id()).collect()
    keys = [key_fn(r) for r in rows]
    groups = kg.assign_key_groups(keys, max_parallelism, key_type) if keys else np.zeros(0, np.int16)
    assert [r["key_group"] for r in rows] == groups.tolist()
    operators = kg.operator_index_for_key_group(max_parallelism, parallelism, groups) if keys else []
    assert [r["pid"] for r in rows] == list(operators)
    return rows


@pytest.fixture(scope="module")
def users(spark):
    return spark.range(0, 2000).select(
        F.col("id"), F.concat(F.lit("user-"), (F.col("id") % 331).cast("string")).alias("user")
    )


@pytest.mark.parametrize(
    ("parallelism", "method", "engine"),
    [(p, "by_id", "auto") for p in PARALLELISMS]
    + [(7, "hash", "auto"), (MAX_PARALLELISM, "hash", "auto")]  # "hash": Spark 4.0's route
    + [(7, method, engine) for method in ("by_id", "hash") for engine in ("jvm", "sql", "arrow")],
)
def test_partition_by_key_group_exact_placement(users, parallelism, method, engine):
    out = partition_by_key_group(
        users, "user", "id", max_parallelism=MAX_PARALLELISM, parallelism=parallelism, method=method, engine=engine,
        key_group_col="key_group",
    )
    assert out.rdd.getNumPartitions() == parallelism
    rows = _check_placement(out, lambda r: (r["user"], r["id"]), ("string", "long"), MAX_PARALLELISM, parallelism)
    assert sorted(r["id"] for r in rows) == list(range(2000))


@pytest.mark.parametrize("parallelism", [3, MAX_PARALLELISM])
def test_partition_by_key_group_long_keys_and_sorting(spark, parallelism):
    df = spark.range(-3000, 3000, 7).withColumnRenamed("id", "k")
    out = partition_by_key_group(
        df, "k", max_parallelism=MAX_PARALLELISM, parallelism=parallelism, sort_within=True, operator_col="op",
        key_group_col="key_group",
    )
    rows = _check_placement(out, lambda r: r["k"], "long", MAX_PARALLELISM, parallelism)
    assert len(rows) == len(range(-3000, 3000, 7))
    for i in range(parallelism):
        groups = [r["key_group"] for r in rows if r["pid"] == i]
        assert groups == sorted(groups)
        assert all(r["op"] == i for r in rows if r["pid"] == i)
        owned = kg.key_group_range(MAX_PARALLELISM, parallelism, i)
        assert all(g in owned for g in groups)


def test_partition_by_key_group_max_parallelism_partitions_even_when_empty(spark):
    """Parallelism above the number of distinct keys: every partition exists, most are empty."""
    df = spark.createDataFrame([(1,), (2,), (3,)], "k long")
    out = partition_by_key_group(df, "k", max_parallelism=128, parallelism=128, key_group_col="key_group")
    assert out.rdd.getNumPartitions() == 128
    rows = _check_placement(out, lambda r: r["k"], "long", 128, 128)
    assert sorted(r["k"] for r in rows) == [1, 2, 3]


@pytest.mark.parametrize("method", ["by_id", "hash"])
def test_partition_by_key_group_empty_dataframe(any_spark, method):
    df = any_spark.createDataFrame([], "k string, v double")
    out = partition_by_key_group(df, "k", max_parallelism=16, parallelism=5, method=method, key_group_col="g")
    if not is_connect(any_spark):   # the plan's partitions: Connect has no df.rdd (and an empty query runs no tasks)
        assert out.rdd.getNumPartitions() == 5
    assert out.collect() == []
    assert out.columns == ["k", "v", "g"]


@pytest.mark.parametrize("engine", ["jvm", "arrow"])
def test_partition_by_key_group_binary_keys(spark, engine):
    df = spark.range(300).select(F.col("id").cast("string").cast("binary").alias("b"))
    out = partition_by_key_group(df, "b", max_parallelism=MAX_PARALLELISM, parallelism=7, engine=engine,
                                 key_group_col="key_group")
    _check_placement(out, lambda r: bytes(r["b"]), "bytes", MAX_PARALLELISM, 7)


@pytest.mark.parametrize(("any_spark", "engine"), ENGINES_BY_SESSION, indirect=["any_spark"])
def test_partition_by_key_group_without_a_key_group_column(any_spark, engine):
    """By default the input's columns only (as df.repartition), exactly placed, sorted by key group on request."""
    df = any_spark.range(0, 900).select(F.concat(F.lit("k"), (F.col("id") % 97).cast("string")).alias("k"), "id")
    out = partition_by_key_group(df, F.col("k"), max_parallelism=MAX_PARALLELISM, parallelism=5, sort_within=True,
                                 operator_col="op", engine=engine)
    assert out.columns == ["k", "id", "op"]
    rows = out.withColumn("pid", F.spark_partition_id()).collect()
    groups = kg.assign_key_groups([r["k"] for r in rows], MAX_PARALLELISM)
    assert [r["pid"] for r in rows] == kg.operator_index_for_key_group(MAX_PARALLELISM, 5, groups).tolist()
    assert [r["op"] for r in rows] == [r["pid"] for r in rows]
    assert groups.tolist() == sorted(groups.tolist())  # partitions in order, each sorted: sorted overall
    assert sorted(r["id"] for r in rows) == list(range(900))


def test_partition_by_key_group_errors(any_spark):
    df = any_spark.createDataFrame([(1, decimal.Decimal("2.50"))], T.StructType([T.StructField("k", T.LongType()),
                                                         T.StructField("d", T.DecimalType(5, 2))]))
    with pytest.raises(TypeError, match="key column 'd'"):
        partition_by_key_group(df, "d", max_parallelism=8, parallelism=2)
    with pytest.raises(ValueError, match="method must be one of"):
        partition_by_key_group(df, "k", max_parallelism=8, parallelism=2, method="range")
    with pytest.raises(ValueError, match="key_group_col and operator_col must differ"):
        partition_by_key_group(df, "k", max_parallelism=8, parallelism=2, key_group_col="g", operator_col="g")
    with pytest.raises(ValueError, match="key_group_col 'd' already exists"):
        partition_by_key_group(df, "k", max_parallelism=8, parallelism=2, key_group_col="d")
    with pytest.raises(TypeError, match="operator_col is a non-empty column name or None"):
        partition_by_key_group(df, "k", max_parallelism=8, parallelism=2, operator_col="")
    with pytest.raises(ValueError, match="parallelism must be in"):
        partition_by_key_group(df, "k", max_parallelism=8, parallelism=0)


def test_null_key_fails_at_run_time_naming_the_column(any_spark):
    df = any_spark.createDataFrame([(1,), (None,)], "k long")
    with pytest.raises(Exception, match="key column 'k' holds a null key"):
        partition_by_key_group(df, "k", max_parallelism=8, parallelism=2).collect()


# ---- the hash-partitioning route's arithmetic -----------------------------------------------------------------------


def test_spark_hash_int_matches_spark(spark):
    values = [0, 1, -1, 42, 2**31 - 1, -(2**31), 123456789, -987654321] + list(range(-100, 100, 7))
    df = spark.createDataFrame([(v,) for v in values], "v int")
    got = [r[0] for r in df.select(F.hash("v")).collect()]
    assert got == spark_hash_int(np.array(values)).tolist()


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
def test_hash_partitioning_stand_ins_cover_every_partition(n):
    stand_ins = hash_partitioning_stand_ins(n)
    assert len(stand_ins) == n
    assert (np.mod(spark_hash_int(stand_ins).astype(np.int64), n) == np.arange(n)).all()
