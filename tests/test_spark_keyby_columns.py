"""with_key_groups: Flink-exact key-group and operator-index columns on a real local Spark session.

Every supported Spark type, composite keys, both engines, against the golden vectors from Flink and against the
compiled core (``keygroups.assign_key_groups``); nulls, empty DataFrames and unsupported column types. The tests
that take ``any_spark`` run over Spark Connect too, with the engines it has (``ENGINES_BY_SESSION``): Column
arguments, output types, nulls, empty input and the refusals (test_spark_connect.py runs the golden vectors there)."""

from __future__ import annotations

import datetime
import decimal
import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keygroups as kg
from conftest import load_jsonl

pyspark = pytest.importorskip("pyspark")
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql import types as T  # noqa: E402

from keygroups.spark import with_key_groups  # noqa: E402
from keygroups.spark.catalyst import CatalystHashes  # noqa: E402
from keygroups.spark.columns import choose_engine, resolve_key_columns  # noqa: E402

pytestmark = pytest.mark.spark

SPARK_TYPES = {
    "long": T.LongType(),
    "int": T.IntegerType(),
    "short": T.ShortType(),
    "byte": T.ByteType(),
    "boolean": T.BooleanType(),
    "double": T.DoubleType(),
    "float": T.FloatType(),
    "string": T.StringType(),
    "bytes": T.BinaryType(),
}
ENGINES = ["jvm", "sql", "arrow"]
#: (session, engine) cases: every engine on the classic session, the portable ones over Spark Connect ("jvm" needs
#: the py4j gateway; test_spark_connect.py checks its refusal there).
ENGINES_BY_SESSION = [("classic", e) for e in ENGINES] + [("connect", "sql"), ("connect", "arrow")]
GOLDEN_MAX_PARALLELISMS = [1, 7, 129, 1000, 32768]  # 1, small prime, 2^7+1, 10^3, 2^15


def test_spark_key_types_are_the_key_types_of_their_arrow_types():
    """The Spark table (one row per Spark type) agrees with the Arrow one: a key column hashes under the same Java
    type whether Spark's engines read it or the Arrow engine and KeyedJob see its Arrow form."""
    from pyspark.sql.pandas.types import to_arrow_type

    from keygroups._hashing import key_type_for_arrow
    from keygroups.spark.catalyst import SPARK_KEY_TYPES

    assert {spark_type() for spark_type in SPARK_KEY_TYPES} == set(SPARK_TYPES.values())
    for spark_type, (key_type, _) in SPARK_KEY_TYPES.items():
        assert SPARK_TYPES[key_type] == spark_type()
        assert key_type_for_arrow(to_arrow_type(spark_type())) == key_type


def _field_types(type_name: str) -> list[str]:
    if type_name.startswith("tuple<"):
        return type_name[len("tuple<") : -1].split(",")
    return [type_name]


def _decode(key_type: str, value):
    if key_type == "bytes":
        return bytes.fromhex(value)
    if key_type == "double" and isinstance(value, str):
        return float(value)  # "NaN", "Infinity", "-Infinity"
    return value


def _utf8_ok(value) -> bool:
    try:
        value.encode("utf-8")
        return True
    except UnicodeEncodeError:  # a lone surrogate: a Java String may hold one, a Spark (UTF-8) string cannot
        return False


def _golden_groups() -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for row in load_jsonl("key_groups.jsonl"):
        fields = _field_types(row["type"])
        values = row["key"] if len(fields) > 1 else [row["key"]]
        decoded = [_decode(t, v) for t, v in zip(fields, values)]
        if any(isinstance(v, str) and not _utf8_ok(v) for v in decoded):
            continue
        groups.setdefault(row["type"], []).append({"key": decoded, "key_groups": row["key_groups"]})
    return groups


GOLDEN = _golden_groups()


def _frame(spark, field_types: list[str], keys: list[list], nullable: bool = False):
    schema = T.StructType(
        [T.StructField("idx", T.IntegerType(), False)]
        + [T.StructField(f"k{i}", SPARK_TYPES[t], nullable) for i, t in enumerate(field_types)]
    )
    return spark.createDataFrame([(i, *key) for i, key in enumerate(keys)], schema)


def _collect_sorted(df, *cols):
    return sorted(df.select("idx", *cols).collect(), key=lambda r: r["idx"])


def test_golden_vectors_cover_every_golden_type():
    assert {"long", "int", "string", "bytes", "double", "boolean"} <= set(GOLDEN)
    assert any(t.startswith("tuple<") for t in GOLDEN)


@pytest.mark.parametrize("type_name", sorted(GOLDEN))
def test_golden_key_groups(spark, type_name):
    """Flink's own key groups, for every golden type, several max parallelisms and both engines, in one Spark job
    per type."""
    fields = _field_types(type_name)
    check_golden_key_groups(spark, type_name,
                            [e for e in ENGINES if e != "sql"] if "bytes" in fields else ENGINES)  # see test_binary_keys_*


def check_golden_key_groups(session, type_name: str, engines: list[str]) -> None:
    """Every golden key of ``type_name`` gets Flink's key group at every golden max parallelism from each engine,
    on ``session`` (classic or Connect)."""
    rows = GOLDEN[type_name]
    fields = _field_types(type_name)
    df = _frame(session, fields, [r["key"] for r in rows])
    key_cols = [f"k{i}" for i in range(len(fields))]
    outputs = []
    for engine in engines:
        for mp in GOLDEN_MAX_PARALLELISMS:
            df = with_key_groups(df, *key_cols, max_parallelism=mp, key_group_col=f"{engine}{mp}", engine=engine)
            outputs.append((engine, mp))
    got = _collect_sorted(df, *[f"{e}{mp}" for e, mp in outputs])
    assert len(got) == len(rows)
    for out, row in zip(got, rows):
        for engine, mp in outputs:
            assert out[f"{engine}{mp}"] == row["key_groups"][str(mp)], (row["key"], engine, mp)


def _random_keys(key_type: str, n: int, rng: np.random.Generator) -> list:
    """Random keys plus each type's edge values."""
    if key_type in ("long", "int", "short", "byte"):
        bits = {"long": 64, "int": 32, "short": 16, "byte": 8}[key_type]
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        edges = [lo, lo + 1, -1, 0, 1, hi - 1, hi]
        return edges + [int(v) for v in rng.integers(lo, hi, size=n, endpoint=True, dtype=np.int64)]
    if key_type == "boolean":
        return [True, False] * (n // 2 + 1)
    if key_type in ("double", "float"):
        edges = [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308]
        if key_type == "float":
            edges = [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 1.4e-45, 3.4028234663852886e38]
            values = rng.standard_normal(n).astype(np.float32) * np.float32(1e6)
            return edges + [float(v) for v in values]
        return edges + [float(v) for v in rng.standard_normal(n) * 1e9]
    if key_type == "string":
        # Half the keys are ASCII (the SQL engine's byte-hash route), half mix in multi-byte and astral characters
        # (its java_method route); the edges put one non-ASCII character at either end of ASCII text.
        mixed = ["a", "Z", "0", "é", "ß", "€", "中", "\u0000", "😀", "𝄞", "\uffff", " "]
        ascii_only = ["a", "Z", "0", "~", "\u0000", "\u007f", " ", "-"]
        lengths = rng.integers(0, 24, size=n)
        edges = ["", "😀", "a" * 100, "\u007f", "é" + "a" * 9, "a" * 9 + "é", "user-1234567"]
        return edges + ["".join(rng.choice(ascii_only if i % 2 else mixed, size=length))
                        for i, length in enumerate(lengths)]
    if key_type == "bytes":
        lengths = rng.integers(0, 40, size=n)
        return [b"", b"\x80", b"\xff" * 17] + [rng.integers(0, 256, size=length, dtype=np.uint8).tobytes()
                                                 for length in lengths]
    raise AssertionError(key_type)


def _core_key_groups(key_type: str, values: list, max_parallelism: int) -> np.ndarray:
    """The compiled core's key groups of the values Spark handed back (FloatType values went through float32)."""
    if key_type == "float":
        return kg.assign_key_groups(np.array(values, dtype=np.float32), max_parallelism, "float")
    if key_type == "bytes":
        return kg.assign_key_groups(pa.array([bytes(b) for b in values], pa.binary()), max_parallelism, "bytes")
    if key_type == "string":
        return kg.assign_key_groups(pa.array(values, pa.string()), max_parallelism, "string")
    return kg.assign_key_groups(values, max_parallelism, key_type)


def test_every_column_type_agrees_with_the_core(spark):
    """One DataFrame with a column of every supported type (random values plus each type's edge values), every
    column keyed on its own by both engines, in one Spark job."""
    rng = np.random.default_rng(2024)
    n = 400
    types = list(SPARK_TYPES)
    columns = [_random_keys(t, n, rng)[:n] for t in types]
    df = _frame(spark, types, [list(row) for row in zip(*columns)])
    outputs = []
    for i, key_type in enumerate(types):
        for engine in ENGINES:
            if engine == "sql" and key_type == "bytes":
                continue
            name = f"{engine}_{key_type}"
            df = with_key_groups(
                df, f"k{i}", max_parallelism=1000, parallelism=7, engine=engine, key_group_col=f"g_{name}",
                operator_col=f"op_{name}",
            )
            outputs.append((i, key_type, name))
    out = _collect_sorted(df, *[f"k{i}" for i in range(len(types))], *[c for _, _, name in outputs
                                                                        for c in (f"g_{name}", f"op_{name}")])
    for i, key_type, name in outputs:
        expected = _core_key_groups(key_type, [r[f"k{i}"] for r in out], 1000)
        assert [r[f"g_{name}"] for r in out] == expected.tolist(), name
        assert [r[f"op_{name}"] for r in out] == kg.operator_index_for_key_group(1000, 7, expected).tolist(), name


def test_composite_keys_hash_as_a_flink_tuple(spark):
    rng = np.random.default_rng(7)
    n = 300
    types = ["string", "long", "int", "boolean", "double", "short", "byte"]
    columns = [_random_keys(t, n, rng)[:n] for t in types]
    keys = [list(row) for row in zip(*columns)]
    df = _frame(spark, types, keys)
    cols = [f"k{i}" for i in range(len(types))]
    widths = (2, 3, len(types))
    for engine in ENGINES:
        for width in widths:
            df = with_key_groups(df, *cols[:width], max_parallelism=4096, key_group_col=f"{engine}{width}",
                                 engine=engine)
    out = _collect_sorted(df, *[f"{e}{w}" for e in ENGINES for w in widths])
    for width in widths:
        expected = kg.assign_key_groups([tuple(k[:width]) for k in keys], 4096, tuple(types[:width])).tolist()
        for engine in ENGINES:
            assert [r[f"{engine}{width}"] for r in out] == expected, (engine, width)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.text(max_size=6), st.integers(-(2**63), 2**63 - 1), st.booleans()), min_size=1, max_size=30
    ),
    st.integers(1, 32768),
    st.sampled_from(ENGINES),
)
def test_composite_key_property(spark, keys, max_parallelism, engine):
    keys = [k for k in keys if _utf8_ok(k[0])]
    if not keys:
        return
    df = _frame(spark, ["string", "long", "boolean"], [list(k) for k in keys])
    p = max(1, max_parallelism // 3)
    out = _collect_sorted(
        with_key_groups(df, "k0", "k1", "k2", max_parallelism=max_parallelism, parallelism=p, engine=engine),
        "key_group",
        "operator_index",
    )
    for row, key in zip(out, keys):
        assert row["key_group"] == kg.assign_to_key_group(key, max_parallelism, ("string", "long", "boolean"))
        assert row["operator_index"] == kg.assign_to_operator(key, max_parallelism, p, ("string", "long", "boolean"))


def test_key_columns_as_column_expressions(any_spark):
    df = any_spark.range(50).withColumn("s", F.concat(F.lit("k"), F.col("id").cast("string")))
    out = with_key_groups(df, F.col("s"), F.col("id") * 2, max_parallelism=128).orderBy("id").collect()
    expected = kg.assign_key_groups([(r["s"], r["id"] * 2) for r in out], 128, ("string", "long"))
    assert [r["key_group"] for r in out] == expected.tolist()


def test_output_columns_and_types(any_spark):
    df = any_spark.range(10)
    out = with_key_groups(df, "id", max_parallelism=128, parallelism=4, key_group_col="g", operator_col="op")
    assert out.columns == ["id", "g", "op"]
    assert out.schema["g"].dataType == T.IntegerType()
    assert out.schema["op"].dataType == T.IntegerType()
    assert with_key_groups(df, "id", max_parallelism=128).columns == ["id", "key_group"]


@pytest.mark.parametrize(("any_spark", "engine"), ENGINES_BY_SESSION, indirect=["any_spark"])
def test_null_key_fails_naming_the_column(any_spark, engine):
    df = _frame(any_spark, ["long", "string"], [[1, "a"], [2, None], [3, "c"]], nullable=True)
    with pytest.raises(Exception, match="key column 'k1' holds a null key"):
        with_key_groups(df, "k0", "k1", max_parallelism=128, engine=engine).collect()


@pytest.mark.parametrize("engine", ENGINES)
def test_nullable_column_without_nulls_works(spark, engine):
    df = _frame(spark, ["long"], [[1], [2], [3]], nullable=True)
    out = _collect_sorted(with_key_groups(df, "k0", max_parallelism=128, engine=engine), "key_group")
    assert [r["key_group"] for r in out] == kg.assign_key_groups(np.array([1, 2, 3]), 128).tolist()


@pytest.mark.parametrize(("any_spark", "engine"), ENGINES_BY_SESSION, indirect=["any_spark"])
def test_empty_dataframe(any_spark, engine):
    df = _frame(any_spark, ["string", "long"], [])
    out = with_key_groups(df, "k0", "k1", max_parallelism=128, parallelism=3, engine=engine)
    assert out.collect() == []
    assert out.columns == ["idx", "k0", "k1", "key_group", "operator_index"]


@pytest.mark.parametrize(
    ("spark_type", "value"),
    [
        (T.DecimalType(10, 2), decimal.Decimal("1.50")),
        (T.DateType(), datetime.date(2024, 1, 1)),
        (T.TimestampType(), datetime.datetime(2024, 1, 1)),
        (T.ArrayType(T.LongType()), [1, 2]),
    ],
)
def test_unsupported_column_type_is_refused_naming_the_column(any_spark, spark_type, value):
    df = any_spark.createDataFrame(
        [(1, value)], T.StructType([T.StructField("id", T.LongType()), T.StructField("when", spark_type)])
    )
    with pytest.raises(TypeError, match=r"key column 'when' has Spark type .*allowed: LongType"):
        with_key_groups(df, "id", "when", max_parallelism=128)


def test_argument_errors(any_spark):
    df = any_spark.range(3).withColumn("b", F.lit(b"x"))
    with pytest.raises(ValueError, match="at least one key column"):
        with_key_groups(df, max_parallelism=128)
    with pytest.raises(ValueError, match="max_parallelism must be in"):
        with_key_groups(df, "id", max_parallelism=0)
    with pytest.raises(ValueError, match="parallelism must be in"):
        with_key_groups(df, "id", max_parallelism=8, parallelism=9)
    with pytest.raises(ValueError, match="output column 'id' already exists"):
        with_key_groups(df, "id", max_parallelism=8, key_group_col="id")
    with pytest.raises(ValueError, match="must differ"):
        with_key_groups(df, "id", max_parallelism=8, parallelism=2, key_group_col="x", operator_col="x")
    with pytest.raises(ValueError, match="engine must be one of"):
        with_key_groups(df, "id", max_parallelism=8, engine="fast")
    with pytest.raises(TypeError, match="column name or a Column"):
        with_key_groups(df, 3, max_parallelism=8)


def test_engine_choice_and_binary_keys(spark):
    """On a classic session "auto" is the JVM engine; without a JVM gateway (Spark Connect) it is the SQL engine,
    or the Arrow engine for binary keys, which java_method cannot take; an engine that cannot run is refused."""
    df = spark.range(3).withColumn("b", F.col("id").cast("string").cast("binary"))
    _, keys, _ = resolve_key_columns(df, ["id", "b"])
    assert [k.key_type for k in keys] == ["long", "bytes"]
    assert CatalystHashes.for_dataframe(df) is not None
    assert choose_engine(keys, "auto", jvm_available=True) == "jvm"
    assert choose_engine(keys, "auto", jvm_available=False) == "arrow"
    assert choose_engine(keys[:1], "auto", jvm_available=False) == "sql"
    with pytest.raises(ValueError, match="engine 'jvm' builds Catalyst expressions through the JVM gateway"):
        choose_engine(keys[:1], "jvm", jvm_available=False)
    with pytest.raises(ValueError, match="engine 'sql' cannot hash BinaryType key column 'b'"):
        with_key_groups(df, "id", "b", max_parallelism=8, engine="sql")
    out = with_key_groups(df, "id", "b", max_parallelism=8).orderBy("id").collect()
    expected = kg.assign_key_groups([(r["id"], bytes(r["b"])) for r in out], 8, ("long", "bytes"))
    assert [r["key_group"] for r in out] == expected.tolist()


@pytest.mark.parametrize("engine", ["jvm", "sql"])
def test_strings_that_are_not_valid_utf8_hash_as_the_jvm_decodes_them(spark, engine):
    """A Spark string can hold bytes that are not UTF-8 (cast from binary). The JVM engines hash the String the JVM
    decodes (each malformed sequence becomes U+FFFD), as a Flink job reading those bytes would; the JVM engine must
    not take its ASCII shortcut for them."""
    raw = [b"\x80", b"abc\xff", b"ab\xc3", b"\xbf\xbf", b"plain", b"\xc3\xa9t\xc3\xa9"]
    df = spark.createDataFrame([(i, r) for i, r in enumerate(raw)], "i int, b binary").selectExpr(
        "i", "cast(b as string) AS s"
    )
    out = with_key_groups(df, "s", max_parallelism=32768, engine=engine).orderBy("i").collect()
    expected = kg.assign_key_groups([r.decode("utf-8", errors="replace") for r in raw], 32768, "string")
    assert [r["key_group"] for r in out] == expected.tolist()


def test_jvm_engine_without_whole_stage_codegen(spark):
    """The JVM engine's expressions evaluated outside whole-stage code generation (as Spark does when a plan's
    generated code grows too large) give the same key groups."""
    rows = [("k\u00e9y", -(2**63), True, 1.5, b"\x00\xff"), ("", 2**63 - 1, False, -0.0, b"")]
    df = spark.createDataFrame(rows, "s string, l long, z boolean, d double, b binary")
    spark.conf.set("spark.sql.codegen.wholeStage", "false")
    try:
        out = with_key_groups(df, "s", "l", "z", "d", "b", max_parallelism=32768, engine="jvm").collect()
    finally:
        spark.conf.unset("spark.sql.codegen.wholeStage")
    expected = kg.assign_key_groups([tuple(r)[:4] + (bytes(r[4]),) for r in rows], 32768,
                                    ("string", "long", "boolean", "double", "bytes"))
    assert sorted(r["key_group"] for r in out) == sorted(expected.tolist())


def test_nested_calls_do_not_collide(any_spark):
    df = any_spark.range(20)
    once = with_key_groups(df, "id", max_parallelism=64, key_group_col="g1")
    twice = with_key_groups(once, "id", "g1", max_parallelism=32, key_group_col="g2").orderBy("id").collect()
    assert [r["g1"] for r in twice] == kg.assign_key_groups(np.arange(20), 64).tolist()
    expected = kg.assign_key_groups([(r["id"], r["g1"]) for r in twice], 32, ("long", "int"))
    assert [r["g2"] for r in twice] == expected.tolist()


def test_auto_falls_back_to_sql_with_a_warning_when_catalyst_classes_differ(spark, monkeypatch):
    """A JVM without one of the classes the JVM engine calls (as a future Spark or JDK might be): the real
    ClassNotFoundException from the gateway makes "auto" warn and use the SQL engine, with the same key groups."""
    import keygroups.spark.catalyst as catalyst

    monkeypatch.setitem(catalyst._STATIC_HASHES, "long", "java.lang.NoSuchLong")
    df = spark.createDataFrame([("a", 1), ("b\u00e9", -(2**40))], "s string, n long")
    with pytest.warns(RuntimeWarning, match="cannot build Catalyst hash expressions.*portable SQL engine"):
        out = with_key_groups(df, "s", "n", max_parallelism=4096).orderBy("s").collect()
    expected = kg.assign_key_groups([(r["s"], r["n"]) for r in out], 4096, ("string", "long"))
    assert [r["key_group"] for r in out] == expected.tolist()
