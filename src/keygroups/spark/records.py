"""Record state with Spark's own types: a ``StructType`` schema in, Spark ``Row``\\ s out.

``RecordSerializer`` (``keygroups.serializers``) takes a ``StructType`` as it is (through its JSON) and Rows as
values (by field name); :func:`row_records` makes one that also returns ``Row``\\ s, nested records too, so a keyed
function sees its state as it sees its input rows.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import Row
from pyspark.sql.types import StructType

from keygroups.serializers import RecordSerializer


def as_row(fields: dict[str, Any]) -> Row:
    """A record's dict as a ``Row`` with the fields in the schema's order."""
    return Row(**fields)


def row_records(schema: StructType | str) -> RecordSerializer:
    """A ``RecordSerializer`` of ``schema`` (a ``StructType`` or a DDL string) whose values come back as ``Row``\\ s.
    Rows, dicts and tuples go in."""
    return RecordSerializer(schema, form=as_row)


__all__ = ["row_records", "as_row"]
