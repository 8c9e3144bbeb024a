"""Flink's key group as one Catalyst expression that calls the JDK's own ``hashCode`` methods in generated code.

Spark SQL has no function that returns Java's ``String.hashCode``, ``Long.hashCode`` or ``Arrays.hashCode``, but
Catalyst can call any Java method from generated code: ``StaticInvoke`` calls a static method on the column's Java
value (``java.lang.Long.hashCode(long)``, ``java.util.Arrays.hashCode(byte[])``), ``Invoke`` calls a method of the
value itself (``UTF8String.toString().hashCode()``). Every Java hash below is therefore the JDK's own, exact by
construction, and Flink's ``MathUtils.murmurHash`` is Catalyst's ``Murmur3Hash`` of that ``int`` with seed 0 (one
MurmurHash3_x86_32 block: the same function). Strings that are all ASCII, the common case, skip the decoding to a
Java ``String``: their UTF-8 bytes are their UTF-16 units, and ``HiveHash`` folds ``h = 31 * h + b`` over them.

The result is a single expression with no repeated subtree, so it can be evaluated where it is needed: in a
projection, or inside a shuffle's partitioning expression, which spares the shuffle a key-group column.

These expression classes are internal to Spark (they are not SQL functions), so they are built through the classic
session's py4j gateway. :meth:`CatalystHashes.for_dataframe` returns ``None`` where that is impossible (Spark
Connect has no gateway; a Spark whose constructors differ), and callers use the portable SQL engine instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

_M32 = 0xFFFFFFFF

#: The one table of Spark key column types: each type's Flink key type name (as ``keygroups._hashing`` names them
#: for the Arrow type Spark converts it to) and the JDK class whose static ``hashCode(value)`` is the Java hash of the
#: column's value (None for strings, hashed through the decoded ``String``: see :meth:`CatalystHashes.java_hash`).
SPARK_KEY_TYPES: dict[type, tuple[str, str | None]] = {
    T.LongType: ("long", "java.lang.Long"),
    T.IntegerType: ("int", "java.lang.Integer"),
    T.ShortType: ("short", "java.lang.Short"),
    T.ByteType: ("byte", "java.lang.Byte"),
    T.BooleanType: ("boolean", "java.lang.Boolean"),
    T.DoubleType: ("double", "java.lang.Double"),
    T.FloatType: ("float", "java.lang.Float"),
    T.StringType: ("string", None),
    T.BinaryType: ("bytes", "java.util.Arrays"),
}

#: The builder of each JVM gateway seen (with the gateway itself: an id is only unique while its object lives).
_BUILT: dict[int, tuple[Any, CatalystHashes | None]] = {}

#: key type name -> the JDK class of its static ``hashCode``, read off SPARK_KEY_TYPES.
_STATIC_HASHES = {key_type: cls for key_type, cls in SPARK_KEY_TYPES.values() if cls is not None}


class CatalystHashes:
    """Builds the Catalyst expressions of one classic Spark session's JVM."""

    def __init__(self, jvm: Any) -> None:
        self._jvm = jvm
        self._expressions = jvm.org.apache.spark.sql.catalyst.expressions
        self._utils = jvm.org.apache.spark.sql.classic.ExpressionUtils
        types = jvm.org.apache.spark.sql.types
        self._int_type = types.DataTypes.IntegerType
        self._bool_type = types.DataTypes.BooleanType
        self._string_object = types.ObjectType(jvm.java.lang.Class.forName("java.lang.String"))
        self._classes = {name: jvm.java.lang.Class.forName(name) for name in set(_STATIC_HASHES.values())}
        self._no_option = jvm.scala.Option.empty()

    @classmethod
    def for_dataframe(cls, df: DataFrame) -> CatalystHashes | None:
        """The builder for ``df``'s session, or ``None`` without a usable JVM gateway (built once per gateway)."""
        jvm = getattr(df.sparkSession, "_jvm", None)  # classic sessions only
        if jvm is None:
            return None
        known = _BUILT.get(id(jvm))
        if known is not None and known[0] is jvm:
            return known[1]
        hashes = cls._build(jvm, df)
        _BUILT[id(jvm)] = (jvm, hashes)
        return hashes

    @classmethod
    def _build(cls, jvm: Any, df: DataFrame) -> CatalystHashes | None:
        from py4j.protocol import Py4JError  # type: ignore[import-untyped]

        try:
            hashes = cls(jvm)
            hashes.murmur(hashes.java_hash(F.lit("probe"), "string"))  # every constructor used below, once
        except (Py4JError, TypeError, AttributeError) as e:  # TypeError: py4j's stand-in for a missing class
            # A classic session whose Catalyst classes differ from Spark 4.x's: still exact, but slower; say so.
            detail = " ".join(str(e).splitlines()[:2])  # py4j appends the whole Java stack trace
            warnings.warn(f"keygroups: cannot build Catalyst hash expressions on Spark {df.sparkSession.version} "
                          f"({type(e).__name__}: {detail}); key groups use the portable SQL engine instead",
                          RuntimeWarning, stacklevel=3)
            return None
        return hashes

    # ---- py4j plumbing ---------------------------------------------------------------------------------------

    def _seq(self, expressions: Sequence[Any]) -> Any:
        items = self._jvm.java.util.ArrayList()
        for e in expressions:
            items.add(e)
        return self._jvm.scala.jdk.javaapi.CollectionConverters.asScala(items).toSeq()

    def _expr(self, column: Column) -> Any:
        return self._utils.expression(column._jc)

    def _column(self, expression: Any) -> Column:
        return Column(self._utils.column(expression))

    def _static_int(self, class_name: str, method: str, column: Column) -> Column:
        # StaticInvoke(class, type, name, arguments, inputTypes, propagateNull, returnNullable, deterministic, fn)
        invoke = self._expressions.objects.StaticInvoke(
            self._classes[class_name], self._int_type, method, self._seq([self._expr(column)]), self._seq([]),
            True, True, True, self._no_option,
        )
        return self._column(invoke)

    def _invoke(self, target: Any, method: str, data_type: Any) -> Any:
        # Invoke(target, name, type, arguments, methodInputTypes, propagateNull, returnNullable, deterministic)
        return self._expressions.objects.Invoke(target, method, data_type, self._seq([]), self._seq([]),
                                                True, True, True)

    # ---- the hashes ------------------------------------------------------------------------------------------

    def java_hash(self, column: Column, key_type: str) -> Column:
        """The Java ``hashCode()`` of the column's values (``IntegerType``) as Flink sees them; null stays null."""
        if key_type == "string":
            value = self._expr(column)
            ascii_only = self._column(self._invoke(value, "isFullAscii", self._bool_type))
            ascii_hash = self._column(self._expressions.HiveHash(self._seq([value])))
            decoded = self._invoke(value, "toString", self._string_object)  # UTF-8 -> UTF-16, as the JVM decodes
            return F.when(ascii_only, ascii_hash).otherwise(
                self._column(self._invoke(decoded, "hashCode", self._int_type))
            )
        return self._static_int(_STATIC_HASHES[key_type], "hashCode", column)

    def tuple_hash(self, field_hashes: Sequence[Column]) -> Column:
        """Flink ``TupleN.hashCode()`` over the fields' Java hashes: ``h = 31 * h + field``, in 32-bit ints."""
        h = field_hashes[0]
        for field in field_hashes[1:]:
            # On longs, masked to 32 bits; Long.hashCode(x) of an x < 2^32 is x's int bits.
            low_bits = (h.cast("long") * 31 + field.cast("long")).bitwiseAND(F.lit(_M32))
            h = self._static_int("java.lang.Long", "hashCode", low_bits)
        return h

    def murmur(self, h: Column) -> Column:
        """Flink's ``MathUtils.murmurHash`` before its sign rule: MurmurHash3_x86_32 of one int, seed 0."""
        return self._column(self._expressions.Murmur3Hash(self._seq([self._expr(h)]), 0))

    def key_group(self, field_hashes: Sequence[Column], max_parallelism: int) -> Column:
        """Flink's key group (``IntegerType``) of a key whose fields hash to ``field_hashes``."""
        murmur = self.murmur(self.tuple_hash(field_hashes))
        # Flink's sign rule: -m for negative m, 0 for Integer.MIN_VALUE (|MIN_VALUE| = 2^31, which the mask clears).
        non_negative = F.abs(murmur.cast("long")).bitwiseAND(F.lit(0x7FFFFFFF))
        return (non_negative % max_parallelism).cast("int")


def operator_index_of(key_group: Column, max_parallelism: int, parallelism: int) -> Column:
    """Flink's ``computeOperatorIndexForKeyGroup`` (``key_group * parallelism / max_parallelism``, integer division)
    over a key-group Column. ``key_group * parallelism`` stays below 2^30, and its double quotient by
    ``max_parallelism`` <= 2^15 is off by less than 2^-23 while a non-integral quotient is at least 2^-15 from the
    next integer, so truncating it is the integer quotient."""
    return (key_group * parallelism / max_parallelism).cast("int")
