"""Flink-exact key-group and operator-index columns for Spark DataFrames.

Three engines compute the same bits:

``"jvm"``
    One Catalyst expression that calls the JDK's own ``hashCode`` methods from generated code
    (:mod:`keygroups.spark.catalyst`): ``Long.hashCode``, ``Double.hashCode``, ``Arrays.hashCode`` and so on, and
    ``String.hashCode`` of the string the JVM decodes (all-ASCII strings skip the decoding), then Catalyst's
    ``Murmur3Hash`` with seed 0, which is Flink's ``MathUtils.murmurHash``. The fastest engine, and the only one
    whose expression can go straight into a shuffle's partitioning. It needs the JVM gateway of a classic session.
``"sql"``
    Spark SQL text only, so it also runs over Spark Connect. Java's 32-bit ``int`` arithmetic is reproduced on
    ``LongType`` values kept in ``[0, 2^32)``: every product is split so that it stays below ``2^63`` (ANSI mode,
    Spark 4's default, raises on ``long`` overflow and on narrowing casts, so nothing here may overflow or narrow
    out of range), then masked with ``0xFFFFFFFF``. The Java ``hashCode()`` of integral and boolean keys is plain
    arithmetic; ``String``, ``Double`` and ``Float`` keys call the JVM's own ``Objects.hashCode`` /
    ``Double.hashCode`` / ``Float.hashCode`` through ``java_method``, which runs by reflection, outside code
    generation. ``java_method`` cannot take ``BinaryType``, so binary keys need another engine.
``"arrow"``
    A scalar ``arrow_udf`` that hands the key columns, as Arrow arrays, to the compiled kernels
    (:func:`keygroups.java_hashes`, ``groups_from_hashes``); strings and binaries are hashed straight from the Arrow
    buffers. The operator index is then derived from the key group in SQL.

``engine="auto"`` (the default) picks ``"jvm"`` on a classic session; without a JVM gateway, ``"sql"``, or
``"arrow"`` when a key column is ``BinaryType``. The benchmark ``benchmarks/bench_spark_keyby.py`` measures them
against Spark's own ``pmod(hash(col), n)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import pyarrow as pa  # type: ignore[import-untyped]  # (no stubs; only pa.Array for arrow_udf's hints)
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from keygroups._ranges import check_max_parallelism, check_parallelism
from keygroups.spark.catalyst import SPARK_KEY_TYPES, CatalystHashes, operator_index_of

ColumnOrName = Union[str, Column]

_M32 = 0xFFFFFFFF
_BIT31 = 1 << 31

_ALLOWED = ", ".join(spark_type.__name__ for spark_type in SPARK_KEY_TYPES)

_ENGINES = ("auto", "jvm", "sql", "arrow")

# Temporary columns are named with a prefix no user column is likely to carry, and a counter so that nested calls
# (with_key_groups on a DataFrame that already went through it) never collide.
_tmp_counter = itertools.count()


@dataclass(frozen=True)
class KeyColumn:
    """One resolved key column: its top-level column name, how to name it in errors, and its Java key type."""

    column: str
    name: str
    key_type: str
    nullable: bool

    @property
    def sql(self) -> str:
        return quote_identifier(self.column)


def quote_identifier(name: str) -> str:
    """``name`` as a Spark SQL identifier (backticks, inner backticks doubled)."""
    return "`" + name.replace("`", "``") + "`"


def _sql_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _temp_prefix() -> str:
    return f"__kg{next(_tmp_counter)}_"


def temp_column_name() -> str:
    """A fresh name for a temporary column (dropped before a result is returned)."""
    return f"{_temp_prefix()}t"


def _display_name(c: ColumnOrName) -> str:
    return c if isinstance(c, str) else str(c)


def resolve_key_columns(
    df: DataFrame, key_columns: Sequence[ColumnOrName]
) -> tuple[DataFrame, list[KeyColumn], list[str]]:
    """Look up every key column's Spark type and map it to the Java type Flink would hash.

    Returns the DataFrame (with a temporary top-level column for every key given as an expression or a nested
    field, so that both engines refer to plain columns), the resolved keys and the temporary column names to drop.
    Raises ``ValueError`` when no key column is given and ``TypeError`` naming the column for a type Flink has no
    ``hashCode()`` mapping for here."""
    if not key_columns:
        raise ValueError("with_key_groups needs at least one key column (several hash as a Flink tuple, in order)")
    top_level = set(df.schema.fieldNames())  # df.schema is cached by PySpark: no round trip per column
    prefix = _temp_prefix()
    temps: list[str] = []
    named: list[tuple[str, str]] = []
    for c in key_columns:
        if not isinstance(c, (str, Column)):
            raise TypeError(f"a key column is a column name or a Column, got {c!r} of type {type(c).__name__}")
        if isinstance(c, str) and c in top_level:
            named.append((c, c))
        else:
            temp = f"{prefix}{len(temps)}"
            temps.append(temp)
            df = df.withColumn(temp, F.col(c) if isinstance(c, str) else c)
            named.append((temp, _display_name(c)))
    schema = df.schema
    resolved = []
    for column, name in named:
        field = schema[column]
        known = SPARK_KEY_TYPES.get(type(field.dataType))
        if known is None:
            raise TypeError(
                f"key column {name!r} has Spark type {field.dataType.simpleString()}, which has no Flink key "
                f"hashCode() mapping; allowed: {_ALLOWED} (cast the column, e.g. a date to a long or a string)"
            )
        key_type, _ = known
        resolved.append(KeyColumn(column, name, key_type, field.nullable))
    return df, resolved, temps


def choose_engine(keys: Sequence[KeyColumn], engine: str, jvm_available: bool) -> str:
    """The engine that will run: ``engine`` itself, checked against the key types and the session, or for
    ``"auto"`` the fastest one that can run (see the module docs)."""
    if engine not in _ENGINES:
        raise ValueError(f"engine must be one of {', '.join(map(repr, _ENGINES))}, got {engine!r}")
    binary = [k.name for k in keys if k.key_type == "bytes"]
    if engine == "auto":
        return "jvm" if jvm_available else ("arrow" if binary else "sql")
    if engine == "jvm" and not jvm_available:
        raise ValueError(
            "engine 'jvm' builds Catalyst expressions through the JVM gateway of a classic Spark session, and this "
            "session has none (Spark Connect); use engine='sql', 'arrow' or 'auto'"
        )
    if engine == "sql" and binary:
        raise ValueError(
            f"engine 'sql' cannot hash BinaryType key column {binary[0]!r} (Spark's java_method does not take "
            "binary arguments); use engine='jvm', 'arrow' or 'auto'"
        )
    return engine


def _null_message(key: KeyColumn) -> str:
    return f"key column {key.name!r} holds a null key: Flink refuses null keys (filter or fill them first)"


# ---- the JVM engine: one Catalyst expression ---------------------------------------------------------------------


def jvm_key_group(hashes: CatalystHashes, keys: Sequence[KeyColumn], max_parallelism: int) -> Column:
    """The key-group Column of the JVM engine: one expression over the key columns, evaluated wherever it is used."""
    fields = []
    for key in keys:
        column = F.col(key.sql)
        h = hashes.java_hash(column, key.key_type)
        if key.nullable:
            h = F.when(column.isNull(), F.raise_error(F.lit(_null_message(key)))).otherwise(h)
        fields.append(h)
    return hashes.key_group(fields, max_parallelism)


# ---- the SQL engine: Java int arithmetic on longs in [0, 2^32) ----------------------------------------------------
# Expressions are built as SQL text and parsed by the JVM in one call: building them as Column objects costs a
# py4j round trip per operator (about a thousand per call).


def _u32(x: str) -> str:
    return f"(({x}) & {_M32})"


def _mul32(x: str, constant: int) -> str:
    """``x * constant mod 2^32`` for ``0 <= x < 2^32``: split the constant in 16-bit halves so that no product reaches
    2^63 (ANSI overflow checks stay silent) and the high half only contributes its low 16 bits."""
    lo, hi = constant & 0xFFFF, constant >> 16
    return _u32(f"{x} * {lo} + shiftleft(({x} * {hi}) & 65535, 16)")


def _rotl32(x: str, r: int) -> str:
    return _u32(f"shiftleft({x}, {r}) | shiftright({x}, {32 - r})")


def _xorshift(x: str, r: int) -> str:
    return f"({x} ^ shiftright({x}, {r}))"


def _java_hash_u32(key: KeyColumn) -> str:
    """The key's Java ``hashCode()`` as a long in ``[0, 2^32)`` (its 32 bits, unsigned); a null key raises."""
    c = key.sql
    kt = key.key_type
    if kt == "long":
        h = _u32(f"{c} ^ shiftrightunsigned({c}, 32)")
    elif kt in ("int", "short", "byte"):  # Integer/Short/Byte.hashCode() is the value itself
        h = _u32(f"cast({c} as bigint)")
    elif kt == "boolean":
        h = f"if({c}, 1231L, 1237L)"
    else:
        # The JVM's own hashCode, exact by construction; java_method returns its result as a string.
        cls = {"string": "java.util.Objects", "double": "java.lang.Double", "float": "java.lang.Float"}[kt]
        h = _u32(f"cast(java_method('{cls}', 'hashCode', {c}) as bigint)")
    if key.nullable:
        h = f"if({c} IS NULL, raise_error({_sql_string(_null_message(key))}), {h})"
    return h


class _Steps:
    """Names every intermediate value. An expression that uses a value twice (``x ^ (x >>> 16)``) would otherwise
    copy the whole tree below it, doubling the plan at every step. All steps go into ONE ``selectExpr`` as lateral
    column aliases (each refers to the ones before it): the analyzer turns them into a chain of projections in one
    pass, Spark's optimizer keeps those apart (it does not inline a non-trivial expression referenced twice), and
    whole-stage code generation fuses them into one loop over local variables."""

    def __init__(self) -> None:
        self.prefix = _temp_prefix()
        self.steps: list[str] = []
        self.temps: list[str] = []

    def let(self, value: str) -> str:
        name = f"{self.prefix}{len(self.temps)}"
        self.temps.append(name)
        self.steps.append(f"{value} AS {name}")
        return name


def _sql_key_group(steps: _Steps, keys: Sequence[KeyColumn], max_parallelism: int) -> str:
    h = steps.let(_java_hash_u32(keys[0]))
    for key in keys[1:]:  # Flink TupleN.hashCode(): h = 31 * h + field.hashCode()
        h = steps.let(_u32(f"{h} * 31 + {_java_hash_u32(key)}"))
    # Flink's MathUtils.murmurHash(int): one MurmurHash3_x86_32 block, seed 0, length 4.
    h = steps.let(_mul32(h, 0xCC9E2D51))
    h = steps.let(_rotl32(h, 15))
    h = steps.let(_mul32(h, 0x1B873593))
    h = steps.let(_rotl32(h, 13))
    h = steps.let(f"({_u32(f'{h} * 5 + {0xE6546B64}')} ^ 4)")
    h = steps.let(_xorshift(h, 16))
    h = steps.let(_mul32(h, 0x85EBCA6B))
    h = steps.let(_xorshift(h, 13))
    h = steps.let(_mul32(h, 0xC2B2AE35))
    h = steps.let(_xorshift(h, 16))
    # Made non-negative as Flink does: -h for negative ints, and 0 for Integer.MIN_VALUE (the mask maps 2^31 to 0).
    return steps.let(f"cast(if({h} >= {_BIT31}, ({1 << 32} - {h}) & 2147483647, {h}) % {max_parallelism} as int)")


# ---- the Arrow engine: compiled kernels over Arrow batches --------------------------------------------------------


def _arrow_key_group(keys: Sequence[KeyColumn], max_parallelism: int) -> Column:
    from pyspark.sql.functions import arrow_udf

    key_types = tuple(k.key_type for k in keys)
    names = tuple(k.name for k in keys)
    mp = max_parallelism

    def key_groups(*arrays: pa.Array) -> pa.Array:
        # Runs in the Python worker: imports stay inside so that only this small closure is pickled.
        import numpy as np

        from keygroups import java_hashes
        from keygroups._native import hashing as h

        for arr, name in zip(arrays, names):
            if arr.null_count:
                raise ValueError(f"key column {name!r} holds a null key: Flink refuses null keys "
                                 "(filter or fill them first)")
        if len(arrays) == 1 and key_types[0] == "long":
            groups = h.groups_from_int64(np.ascontiguousarray(arrays[0].to_numpy(zero_copy_only=False)), mp)
        else:
            acc = java_hashes(arrays[0], key_types[0])
            if len(arrays) > 1:
                acc = np.array(acc, dtype=np.int32, copy=True)  # combine_tuple_hashes writes in place
                for arr, kt in zip(arrays[1:], key_types[1:]):
                    h.combine_tuple_hashes(acc, java_hashes(arr, kt))
            groups = h.groups_from_hashes(acc, mp)
        return pa.array(groups.astype(np.int32), type=pa.int32())

    # The pa.Array type hints make this a scalar Arrow UDF; PySpark's stubs do not cover a *args signature.
    udf = arrow_udf(key_groups, T.IntegerType())  # type: ignore[call-overload]
    return udf(*[F.col(k.sql) for k in keys])


# ---- the public function ------------------------------------------------------------------------------------------


def with_key_groups(
    df: DataFrame,
    *key_columns: ColumnOrName,
    max_parallelism: int,
    parallelism: int | None = None,
    key_group_col: str = "key_group",
    operator_col: str = "operator_index",
    engine: str = "auto",
) -> DataFrame:
    """``df`` plus a Flink-exact key-group column (``IntegerType``), and the operator-index column (the subtask that
    owns the key group) when ``parallelism`` is given.

    Several key columns hash as a Flink tuple of their values, in order. Key columns are column names or Column
    expressions. Spark types map to the Java types Flink would hash: ``LongType`` -> ``Long``, ``IntegerType`` ->
    ``Integer``, ``ShortType`` / ``ByteType`` -> ``Short`` / ``Byte``, ``BooleanType`` -> ``Boolean``,
    ``DoubleType`` / ``FloatType`` -> ``Double`` / ``Float``, ``StringType`` -> ``String`` (over UTF-16 units),
    ``BinaryType`` -> ``byte[]`` (``Arrays.hashCode``).

    An unsupported column type raises ``TypeError`` here, naming the column. A null key makes the query fail when
    it runs, with an error naming the column (Flink refuses null keys). ``engine`` is ``"auto"``,
    ``"jvm"``, ``"sql"`` or ``"arrow"`` (see the module docs); all give the same bits.
    """
    mp = check_max_parallelism(max_parallelism)
    p = None
    if parallelism is not None:
        p, mp = check_parallelism(parallelism, mp)
    outputs = [key_group_col] + ([operator_col] if p is not None else [])
    existing = set(df.columns)
    for out in outputs:
        if not isinstance(out, str) or not out:
            raise TypeError(f"output column names are non-empty strings, got {out!r}")
        if out in existing:
            raise ValueError(f"output column {out!r} already exists in the DataFrame; pass another name")
    if p is not None and key_group_col == operator_col:
        raise ValueError(f"key_group_col and operator_col must differ, both are {key_group_col!r}")
    df, keys, key_temps = resolve_key_columns(df, key_columns)
    hashes = CatalystHashes.for_dataframe(df) if engine in ("auto", "jvm") else None
    chosen = choose_engine(keys, engine, hashes is not None)
    if chosen == "jvm":
        assert hashes is not None
        out_df = df.withColumn(key_group_col, jvm_key_group(hashes, keys, mp))
    elif chosen == "sql":
        steps = _Steps()
        group = _sql_key_group(steps, keys, mp)
        exprs = ["*", *steps.steps, f"{group} AS {quote_identifier(key_group_col)}"]
        out_df = df.selectExpr(*exprs).drop(*steps.temps)
    else:
        out_df = df.withColumn(key_group_col, _arrow_key_group(keys, mp))
    if p is not None:
        out_df = out_df.withColumn(operator_col, operator_index_of(F.col(quote_identifier(key_group_col)), mp, p))
    return out_df.drop(*key_temps) if key_temps else out_df
