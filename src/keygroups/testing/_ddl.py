"""Spark DDL schema strings (``"user string, ts long, tags array<string>"``) and Spark ``StructType``s as Arrow
schemas, without Spark: ``KeyedJob`` takes its output schema in any of these forms, and the harness takes the same
so that a test reuses the job's own. The parsing and the type mapping are the record serializer's
(:mod:`keygroups.serializers.schema_formats`), which maps types as PySpark's ``to_arrow_schema`` does (timestamps as
UTC instants in microseconds, as a job writes its output)."""

from __future__ import annotations

import pyarrow as pa

from keygroups.errors import KeyGroupsError
from keygroups.serializers.schema_formats import from_spark_json, parse_ddl, to_arrow


def arrow_schema(schema: object) -> pa.Schema:
    """An Arrow schema from an Arrow schema, a Spark DDL string, a Spark StructType (duck-typed: its
    ``jsonValue()``), or what ``pyarrow.schema`` takes (a list of ``(name, type)`` pairs); TypeError naming what is
    allowed otherwise."""
    if isinstance(schema, pa.Schema):
        return schema
    if isinstance(schema, str):
        return pa.schema(list(to_arrow(parse_ddl(schema))))
    if hasattr(schema, "fields") and hasattr(schema, "jsonValue"):   # a Spark StructType, without importing Spark
        return pa.schema(list(to_arrow(from_spark_json(schema.jsonValue()))))
    try:
        return pa.schema(schema)
    except (TypeError, ValueError, KeyGroupsError):
        raise TypeError(f"a schema is a pyarrow Schema, a Spark DDL string ('user string, ts long') or a Spark "
                        f"StructType; got {schema!r}") from None
