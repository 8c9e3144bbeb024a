"""Exact placement: Spark partition *i* holds exactly the records of subtask *i*, for RDDs and DataFrames.

RDDs go through :class:`KeyGroupPartitioner`, a picklable partition function for ``rdd.partitionBy`` that hashes
each key as Flink does (never Python's salted ``hash``), so placement is the same in every process, on every machine
and under every ``PYTHONHASHSEED``.

DataFrames stay in the JVM: :func:`partition_by_key_group` shuffles on the operator index with
``DataFrame.repartitionById`` (Spark 4.1+), whose target partition is ``pmod(id, numPartitions)``: for an id already
in ``[0, parallelism)``, the id itself. With the ``"jvm"`` engine (:mod:`keygroups.spark.catalyst`) the whole key
group is one expression, so the operator index is computed inside the shuffle's partitioning and nothing extra
crosses the shuffle; the key-group column, when asked for, is computed again after it, which costs less than
shuffling it. The other engines compute the key group in a chain of projections (their expressions reuse
intermediate values), so it crosses the shuffle as a column. Where ``repartitionById`` is missing (Spark 4.0), the
operator index is mapped to a stand-in integer whose Spark hash lands in that very partition, and
``repartition(parallelism, stand_in)`` (hash partitioning, ``pmod(murmur3(v, 42), n)``) places it exactly: see
:func:`hash_partitioning_stand_ins`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from pyspark import RDD
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from keygroups._hashing import KeyType, key_type_code
from keygroups._native import hashing as _h
from keygroups._ranges import check_boundaries, check_parallelism, default_max_parallelism, flink_boundaries
from keygroups.spark.catalyst import CatalystHashes, operator_index_of
from keygroups.spark.columns import (
    ColumnOrName,
    choose_engine,
    jvm_key_group,
    quote_identifier,
    resolve_key_columns,
    temp_column_name,
    with_key_groups,
)

_METHODS = ("auto", "by_id", "hash")


#: key_by's refusal of anything but an RDD: a DataFrame, and above all one of a Spark Connect session, which has no
#: RDDs at all (so no ``rdd.partitionBy`` to hand a KeyGroupPartitioner to).
_NOT_AN_RDD = (
    "key_by partitions an RDD with a KeyGroupPartitioner, got a {got}. RDD partitioners cannot exist over Spark "
    "Connect (it has no RDDs); for a DataFrame, on a classic or a Connect session alike, use "
    "keygroups.spark.partition_by_key_group(df, *key_columns, max_parallelism=..., parallelism=...) for exact "
    "placement, or with_key_groups(df, ...) for the key-group columns"
)


class KeyGroupPartitioner:
    """A partition function for ``rdd.partitionBy(parallelism, partitioner)``: key -> the subtask that owns its key
    group, so partition *i* holds exactly the keys of ``key_group_range(max_parallelism, parallelism, i)`` (or, with
    ``key_group_boundaries``, of the range ``[b[i], b[i + 1] - 1]``: see :mod:`keygroups.runtime.assignment`).

    Keys hash as the Java types Flink would see (``key_type`` as in :func:`keygroups.java_hash`; ``None`` infers it
    from each key: ``int`` -> ``Long``, ``str`` -> ``String``, tuples -> ``TupleN``, ...). A ``None`` key, or a key
    of an unsupported type, raises when the partition function meets it. Instances pickle as their
    parameters and compare equal when those are equal, so PySpark recognises RDDs partitioned alike and skips a
    second shuffle.

    RDDs only, so classic sessions only: Spark Connect has no RDDs (:func:`key_by` says so when handed a
    DataFrame); :func:`partition_by_key_group` places DataFrames the same way on both.
    """

    __slots__ = ("_max_parallelism", "_parallelism", "_key_type", "_code", "_boundaries", "_owners")

    def __init__(self, max_parallelism: int, parallelism: int, key_type: KeyType = None,
                 key_group_boundaries: Sequence[int] | None = None) -> None:
        p, mp = check_parallelism(parallelism, max_parallelism)
        self._max_parallelism = mp
        self._parallelism = p
        self._key_type = key_type
        self._code = key_type_code(key_type)  # validates the name
        self._boundaries: tuple[int, ...] | None = None
        self._owners: list[int] | None = None
        if key_group_boundaries is not None:
            b = check_boundaries(key_group_boundaries, mp)
            if len(b) != p + 1:
                raise ValueError(f"key_group_boundaries must hold parallelism + 1 = {p + 1} boundaries, got {len(b)}")
            if b != flink_boundaries(mp, p):   # Flink's ranges stay Flink's arithmetic (and compare equal to it)
                self._boundaries = b
                self._owners = np.repeat(np.arange(p), np.diff(np.asarray(b))).tolist()

    @property
    def max_parallelism(self) -> int:
        return self._max_parallelism

    @property
    def parallelism(self) -> int:
        """The number of partitions this partitioner is for: pass it as ``rdd.partitionBy``'s ``numPartitions``."""
        return self._parallelism

    @property
    def key_type(self) -> KeyType:
        return self._key_type

    @property
    def key_group_boundaries(self) -> tuple[int, ...] | None:
        """The explicit ranges partitions follow (None: Flink's)."""
        return self._boundaries

    def __call__(self, key: Any) -> int:
        """The operator index (subtask) of ``key``: ``key_group * parallelism // max_parallelism`` (Flink's), or the
        subtask whose range of ``key_group_boundaries`` holds its key group."""
        group = _h.key_group_for_hash(_h.java_hash_object(key, self._code), self._max_parallelism)
        if self._owners is not None:
            return self._owners[group]
        return group * self._parallelism // self._max_parallelism

    def __reduce__(self) -> tuple[Any, ...]:
        return (KeyGroupPartitioner, (self._max_parallelism, self._parallelism, self._key_type, self._boundaries))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyGroupPartitioner):
            return NotImplemented
        return (self._max_parallelism, self._parallelism, self._key_type, self._boundaries) == (
            other._max_parallelism,
            other._parallelism,
            other._key_type,
            other._boundaries,
        )

    def __hash__(self) -> int:
        return hash((KeyGroupPartitioner, self._max_parallelism, self._parallelism, self._key_type, self._boundaries))

    def __repr__(self) -> str:
        kt = "" if self._key_type is None else f", key_type={self._key_type!r}"
        kb = "" if self._boundaries is None else f", key_group_boundaries={self._boundaries!r}"
        return (f"KeyGroupPartitioner(max_parallelism={self._max_parallelism}, parallelism={self._parallelism}{kt}"
                f"{kb})")


def key_by(
    rdd: RDD,
    key_fn: Callable[[Any], Any],
    max_parallelism: int | None = None,
    parallelism: int | None = None,
    key_type: KeyType = None,
) -> RDD:
    """The pair RDD ``(key_fn(value), value)``, partitioned so that partition *i* holds exactly subtask *i*'s keys.

    ``parallelism`` defaults to the RDD's partition count, ``max_parallelism`` to
    ``default_max_parallelism(parallelism)`` (Flink's default)."""
    if not isinstance(rdd, RDD):
        raise TypeError(_NOT_AN_RDD.format(got=type(rdd).__name__))
    if not callable(key_fn):
        raise TypeError(f"key_fn must be callable (value -> key), got {key_fn!r}")
    p = rdd.getNumPartitions() if parallelism is None else parallelism
    mp = default_max_parallelism(p) if max_parallelism is None else max_parallelism
    partitioner = KeyGroupPartitioner(mp, p, key_type)
    return rdd.map(lambda value: (key_fn(value), value)).partitionBy(partitioner.parallelism, partitioner)


# ---- DataFrames ---------------------------------------------------------------------------------------------------

_C1, _C2 = 0xCC9E2D51, 0x1B873593


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def spark_hash_int(values: npt.ArrayLike, seed: int = 42) -> npt.NDArray[np.int32]:
    """Spark's ``hash()`` of ``IntegerType`` values (``Murmur3_x86_32.hashInt(v, seed)``), vectorized in numpy."""
    k = np.asarray(values, dtype=np.int32).view(np.uint32).copy()
    with np.errstate(over="ignore"):
        k *= np.uint32(_C1)
        k = _rotl(k, 15)
        k *= np.uint32(_C2)
        h = np.uint32(seed) ^ k
        h = _rotl(h, 13)
        h = h * np.uint32(5) + np.uint32(0xE6546B64)
        h ^= np.uint32(4)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h.view(np.int32)


def hash_partitioning_stand_ins(num_partitions: int) -> npt.NDArray[np.int32]:
    """For every partition *i* of ``num_partitions``, the smallest non-negative int ``v`` with
    ``pmod(hash(v), num_partitions) == i``: Spark's hash partitioning sends a row whose partitioning column holds
    ``v`` to partition *i*, exactly."""
    out = np.full(num_partitions, -1, dtype=np.int64)
    missing = num_partitions
    start, chunk = 0, max(4096, 16 * num_partitions)
    while missing:
        candidates = np.arange(start, start + chunk, dtype=np.int64)
        targets = np.mod(spark_hash_int(candidates).astype(np.int64), num_partitions)
        # return_index gives each target's first (smallest) candidate in this chunk
        uniq, first = np.unique(targets, return_index=True)
        fresh = out[uniq] < 0
        out[uniq[fresh]] = candidates[first[fresh]]
        missing = int(np.count_nonzero(out < 0))
        start += chunk
    return out.astype(np.int32)


def _has_repartition_by_id(df: DataFrame) -> bool:
    return callable(getattr(df, "repartitionById", None))


def partition_by_key_group(
    df: DataFrame,
    *key_columns: ColumnOrName,
    max_parallelism: int,
    parallelism: int,
    sort_within: bool = False,
    key_group_col: str | None = None,
    operator_col: str | None = None,
    engine: str = "auto",
    method: str = "auto",
    key_group_boundaries: Sequence[int] | None = None,
) -> DataFrame:
    """``df`` in exactly ``parallelism`` partitions, where Spark partition *i* holds exactly the records of subtask
    *i* (the keys of ``key_group_range(max_parallelism, parallelism, i)``): Flink's placement, with ``df``'s
    columns, as ``df.repartition(parallelism, *key_columns)`` gives Spark's. With ``key_group_boundaries``
    (``parallelism + 1`` of them, as :mod:`keygroups.runtime.assignment` chooses: subtask *i* owns key groups
    ``[b[i], b[i + 1] - 1]``) partition *i* holds the keys of that range instead. ``sort_within=True`` also sorts each
    partition by key group. ``key_group_col`` and ``operator_col``, when given, name extra columns with the key
    group and the operator index (which equals ``spark_partition_id()``), added after the shuffle.

    The whole path runs in the JVM (no per-row Python): see the module docs. ``method`` is ``"auto"``,
    ``"by_id"`` (``repartitionById``, Spark 4.1+) or ``"hash"`` (hash partitioning on a stand-in; any Spark 4);
    ``engine`` is as in :func:`with_key_groups`. The placement holds for this DataFrame's partitions: a later
    shuffle (a join, an aggregation) redistributes rows as Spark sees fit."""
    return _partition_by_key_group(df, *key_columns, max_parallelism=max_parallelism, parallelism=parallelism,
                                   sort_within=sort_within, key_group_col=key_group_col, operator_col=operator_col,
                                   engine=engine, method=method, key_group_boundaries=key_group_boundaries)


def _partition_by_key_group(
    df: DataFrame,
    *key_columns: ColumnOrName,
    max_parallelism: int,
    parallelism: int,
    sort_within: bool = False,
    key_group_col: str | None = None,
    operator_col: str | None = None,
    engine: str = "auto",
    method: str = "auto",
    key_group_boundaries: Sequence[int] | None = None,
    partition_of_subtask: Sequence[int] | None = None,
) -> DataFrame:
    """:func:`partition_by_key_group`, where subtask *i*'s records go to Spark partition ``partition_of_subtask[i]``
    (a permutation of ``range(parallelism)``; None: partition *i*). The Spark executor's own placement
    (:func:`keygroups.spark.executor.subtask_order`); ``operator_col`` stays the operator index."""
    p, mp = check_parallelism(parallelism, max_parallelism)
    owners = _owners(key_group_boundaries, mp, p)
    if method not in _METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, _METHODS))}, got {method!r}")
    if method == "auto":
        method = "by_id" if _has_repartition_by_id(df) else "hash"
    if method == "by_id" and not _has_repartition_by_id(df):
        raise ValueError("method 'by_id' needs DataFrame.repartitionById (Spark 4.1+); use method='hash' or 'auto'")
    for name, label in ((key_group_col, "key_group_col"), (operator_col, "operator_col")):
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"{label} is a non-empty column name or None, got {name!r}")
        if name is not None and name in df.columns:
            raise ValueError(f"{label} {name!r} already exists in the DataFrame; pass another name")
    if operator_col is not None and operator_col == key_group_col:
        raise ValueError(f"key_group_col and operator_col must differ, both are {operator_col!r}")

    hashes = CatalystHashes.for_dataframe(df) if engine in ("auto", "jvm") else None
    resolved, keys, key_temps = resolve_key_columns(df, key_columns)
    if choose_engine(keys, engine, hashes is not None) == "jvm":
        assert hashes is not None
        source, temps = resolved, key_temps
        group: Column = jvm_key_group(hashes, keys, mp)  # evaluated by the shuffle, and again after it if asked
        keep_group = False
    else:
        group_name = key_group_col or temp_column_name()
        source = with_key_groups(df, *key_columns, max_parallelism=mp, key_group_col=group_name, engine=engine)
        temps = [] if key_group_col else [group_name]
        group = F.col(group_name)
        keep_group = key_group_col is not None
    operator = _permuted(owners(group), partition_of_subtask, p)
    if method == "by_id":
        placed = source.repartitionById(p, operator)
    else:
        # one SQL array literal (parsed once, constant-folded), not p py4j calls
        stand_ins = F.expr("array(" + ",".join(map(str, hash_partitioning_stand_ins(p).tolist())) + ")")
        placed = source.repartition(p, F.element_at(stand_ins, operator + F.lit(1)))
    if key_group_col is not None and not keep_group:
        placed = placed.withColumn(key_group_col, group)
        group = F.col(quote_identifier(key_group_col))
    if sort_within:
        placed = placed.sortWithinPartitions(group)
    if operator_col is not None:
        placed = placed.withColumn(operator_col, owners(group))
    return placed.drop(*temps) if temps else placed


def key_group_placement(df: DataFrame, *key_columns: str, max_parallelism: int, parallelism: int,
                        key_group_boundaries: Sequence[int] | None = None) -> Callable[[DataFrame], DataFrame] | None:
    """What :func:`partition_by_key_group` does to ``df`` (default engine and method), as a function that does it to
    any DataFrame of ``df``'s columns: its expressions are built once (through the JVM gateway) and reused, batch
    after batch. None where they cannot be reused (Spark Connect, a key column that is not a plain top-level column,
    a Spark without ``repartitionById``): call :func:`partition_by_key_group` each time instead."""
    return _key_group_placement(df, *key_columns, max_parallelism=max_parallelism, parallelism=parallelism,
                                key_group_boundaries=key_group_boundaries)


def _key_group_placement(df: DataFrame, *key_columns: str, max_parallelism: int, parallelism: int,
                         key_group_boundaries: Sequence[int] | None = None,
                         partition_of_subtask: Sequence[int] | None = None) -> Callable[[DataFrame], DataFrame] | None:
    """:func:`key_group_placement`, subtask *i*'s records going to partition ``partition_of_subtask[i]`` (as in
    :func:`_partition_by_key_group`)."""
    p, mp = check_parallelism(parallelism, max_parallelism)
    owners = _owners(key_group_boundaries, mp, p)
    if not _has_repartition_by_id(df) or not all(isinstance(c, str) and c in df.columns for c in key_columns):
        return None
    hashes = CatalystHashes.for_dataframe(df)
    if hashes is None:
        return None
    _, keys, temps = resolve_key_columns(df, key_columns)
    if temps or choose_engine(keys, "auto", True) != "jvm":
        return None
    operator = _permuted(owners(jvm_key_group(hashes, keys, mp)), partition_of_subtask, p)
    return lambda frame: frame.repartitionById(p, operator)


def _permuted(operator: Column, partition_of_subtask: Sequence[int] | None, parallelism: int) -> Column:
    """The partition of an operator-index Column: ``partition_of_subtask[operator]`` (one array literal, parsed
    once and constant-folded), or the operator index itself (None, or the identity)."""
    if partition_of_subtask is None:
        return operator
    partitions = [int(i) for i in partition_of_subtask]
    if sorted(partitions) != list(range(parallelism)):
        raise ValueError(f"partition_of_subtask must be a permutation of range({parallelism}), got {partitions}")
    if partitions == list(range(parallelism)):
        return operator
    table = F.expr("array(" + ",".join(map(str, partitions)) + ")")
    return F.element_at(table, operator + F.lit(1))


def _owners(boundaries: Sequence[int] | None, max_parallelism: int, parallelism: int) -> Callable[[Column], Column]:
    """Key-group Column -> its subtask's Column: Flink's arithmetic for Flink's ranges (or none given), else a
    lookup in one array literal of every key group's owner (parsed once, constant-folded)."""
    if boundaries is None:
        return lambda group: operator_index_of(group, max_parallelism, parallelism)
    b = check_boundaries(boundaries, max_parallelism)
    if len(b) != parallelism + 1:
        raise ValueError(f"key_group_boundaries must hold parallelism + 1 = {parallelism + 1} boundaries, got {len(b)}")
    if b == flink_boundaries(max_parallelism, parallelism):
        return lambda group: operator_index_of(group, max_parallelism, parallelism)
    owner = np.repeat(np.arange(parallelism), np.diff(np.asarray(b)))
    table = F.expr("array(" + ",".join(map(str, owner.tolist())) + ")")
    return lambda group: F.element_at(table, group.cast("int") + F.lit(1))
