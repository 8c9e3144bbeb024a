"""Spark DDL schema strings (``"user string, ts long, tags array<string>"``) as Arrow schemas, without Spark.

``KeyedJob`` takes its output schema as a DDL string, a Spark ``StructType`` or an Arrow schema; the harness takes
the same strings so that a test reuses the job's own. Types map as PySpark's ``to_arrow_schema`` maps them
(timestamps as UTC instants in microseconds, as a job writes its output)."""

from __future__ import annotations

import re

import pyarrow as pa

_SIMPLE = {
    "string": pa.string(), "varchar": pa.string(), "char": pa.string(),
    "long": pa.int64(), "bigint": pa.int64(),
    "int": pa.int32(), "integer": pa.int32(),
    "short": pa.int16(), "smallint": pa.int16(),
    "byte": pa.int8(), "tinyint": pa.int8(),
    "double": pa.float64(), "float": pa.float32(), "real": pa.float32(),
    "boolean": pa.bool_(), "binary": pa.binary(), "date": pa.date32(),
    "timestamp": pa.timestamp("us", tz="UTC"), "timestamp_ltz": pa.timestamp("us", tz="UTC"),
    "timestamp_ntz": pa.timestamp("us"),
}
_TOKEN = re.compile(r"\s*(`(?:[^`]|``)*`|[A-Za-z_][A-Za-z0-9_]*|\d+|[<>(),:])")


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[str] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                if text[pos:].strip():
                    raise self.error(f"unexpected {text[pos:].strip()[:20]!r}")
                break
            self.tokens.append(m.group(1))
            pos = m.end()
        self.i = 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"schema {self.text!r}: {what}; a schema is 'name type, ...' with Spark's types (string, "
                          f"long, int, short, byte, double, float, boolean, binary, date, timestamp, timestamp_ntz, "
                          f"decimal(p,s), array<t>, map<k,v>, struct<name:t,...>)")

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise self.error(f"expected {expected or 'more'}, found {token or 'the end'}")
        self.i += 1
        return token

    def name(self) -> str:
        token = self.take()
        if token.startswith("`"):
            return token[1:-1].replace("``", "`")
        if not (token[0].isalpha() or token[0] == "_"):
            raise self.error(f"expected a column name, found {token!r}")
        return token

    def type(self) -> pa.DataType:
        word = self.take().lower()
        if word in _SIMPLE:
            return _SIMPLE[word]
        if word in ("decimal", "dec", "numeric"):
            precision, scale = 10, 0
            if self.peek() == "(":
                self.take("(")
                precision = int(self.take())
                if self.peek() == ",":
                    self.take(",")
                    scale = int(self.take())
                self.take(")")
            return pa.decimal128(precision, scale)
        if word == "array":
            self.take("<")
            element = self.type()
            self.take(">")
            return pa.list_(element)
        if word == "map":
            self.take("<")
            key = self.type()
            self.take(",")
            value = self.type()
            self.take(">")
            return pa.map_(key, value)
        if word == "struct":
            self.take("<")
            fields = []
            while self.peek() != ">":
                name = self.name()
                if self.peek() == ":":
                    self.take(":")
                fields.append(pa.field(name, self.type()))
                if self.peek() == ",":
                    self.take(",")
            self.take(">")
            return pa.struct(fields)
        raise self.error(f"unknown type {word!r}")

    def schema(self) -> pa.Schema:
        fields = []
        while self.peek() is not None:
            name = self.name()
            if self.peek() == ":":
                self.take(":")
            fields.append(pa.field(name, self.type()))
            if self.peek() is not None:
                self.take(",")
        if not fields:
            raise self.error("no columns")
        return pa.schema(fields)


def arrow_schema(schema: object) -> pa.Schema:
    """An Arrow schema from an Arrow schema, a Spark DDL string, or what ``pyarrow.schema`` takes (a list of
    ``(name, type)`` pairs); TypeError naming what is allowed otherwise."""
    if isinstance(schema, pa.Schema):
        return schema
    if isinstance(schema, str):
        return _Parser(schema).schema()
    if hasattr(schema, "fields") and hasattr(schema, "simpleString"):   # a Spark StructType, without importing Spark
        return _Parser(", ".join(f"`{f.name.replace('`', '``')}` {f.dataType.simpleString()}"
                                 for f in schema.fields)).schema()
    try:
        return pa.schema(schema)
    except (TypeError, ValueError):
        raise TypeError(f"a schema is a pyarrow Schema, a Spark DDL string ('user string, ts long') or a Spark "
                        f"StructType; got {schema!r}") from None
