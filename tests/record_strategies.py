"""Hypothesis strategies for record schemas, their values, and schema evolution steps with a plain-dict model of
what each step does to a stored value (written from the rules, not from ``schema.resolve``)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
from typing import Any

from hypothesis import strategies as st

from keygroups.serializers.schema import (
    BINARY,
    BOOL,
    DATE,
    FLOAT32,
    FLOAT64,
    INT8,
    INT16,
    INT32,
    INT64,
    STRING,
    DataType,
    DecimalType,
    Field,
    ListType,
    MapType,
    PrimitiveType,
    RecordType,
    TimestampType,
)

INT_RANGES = {"int8": 7, "int16": 15, "int32": 31, "int64": 63}
SCALARS = [INT8, INT16, INT32, INT64, FLOAT32, FLOAT64, BOOL, STRING, BINARY, DATE]
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)

scalar_types = st.one_of(
    st.sampled_from(SCALARS),
    st.builds(TimestampType, st.sampled_from(["s", "ms", "us", "ns"]), st.sampled_from(["UTC", None,
                                                                                       "Europe/Berlin"])),
    st.builds(lambda p, s: DecimalType(p, min(s, p)), st.integers(1, 38), st.integers(0, 12)),
)
key_types = st.sampled_from([INT32, INT64, STRING, BINARY, BOOL, DATE])


def record_types(max_fields: int = 5) -> st.SearchStrategy[RecordType]:
    def extend(children: st.SearchStrategy[DataType]) -> st.SearchStrategy[DataType]:
        return st.one_of(
            st.builds(ListType, children, st.booleans()),
            st.builds(MapType, key_types, children, st.booleans()),
            _records(children, max_fields),
        )

    return _records(st.recursive(scalar_types, extend, max_leaves=6), max_fields)


def _records(types: st.SearchStrategy[DataType], max_fields: int) -> st.SearchStrategy[RecordType]:
    field = st.tuples(names, types, st.booleans())
    return st.lists(field, min_size=1, max_size=max_fields, unique_by=lambda f: f[0]).map(
        lambda fs: RecordType(tuple(Field(n, t, nl) for n, t, nl in fs)))


def values_of(t: DataType, nullable: bool = False) -> st.SearchStrategy[Any]:
    """Values of ``t`` as a dict-form RecordSerializer returns them (so they compare equal after a round trip)."""
    base = _values(t)
    return st.one_of(st.none(), base) if nullable else base


def _values(t: DataType) -> st.SearchStrategy[Any]:
    if isinstance(t, PrimitiveType):
        if t.name in INT_RANGES:
            bits = INT_RANGES[t.name]
            return st.integers(-(2 ** bits), 2 ** bits - 1)
        return {
            "float32": st.floats(width=32, allow_nan=False),
            "float64": st.floats(allow_nan=False),
            "bool": st.booleans(), "string": st.text(max_size=8), "binary": st.binary(max_size=8),
            "date": st.dates(),
        }[t.name]
    if isinstance(t, TimestampType):
        lo, hi = (dt.datetime(1678, 1, 1), dt.datetime(2261, 12, 31)) if t.unit == "ns" else (
            dt.datetime(1, 1, 2), dt.datetime(9999, 12, 30))
        naive = st.datetimes(lo, hi)
        if t.unit in ("s", "ms"):
            step = 1_000_000 if t.unit == "s" else 1000
            naive = naive.map(lambda d: d.replace(microsecond=d.microsecond // step * step))
        if t.tz is None:
            return naive
        return naive.map(lambda d: d.replace(tzinfo=dt.timezone.utc))
    if isinstance(t, DecimalType):
        bound = 10 ** t.precision - 1
        return st.integers(-bound, bound).map(lambda u: decimal.Decimal(u).scaleb(-t.scale,
                                                                                   decimal.Context(prec=60)))
    if isinstance(t, ListType):
        return st.lists(values_of(t.element, t.element_nullable), max_size=4)
    if isinstance(t, MapType):
        return st.dictionaries(_values(t.key), values_of(t.value, t.value_nullable), max_size=3)
    assert isinstance(t, RecordType)
    return st.fixed_dictionaries({f.name: values_of(f.type, f.nullable) for f in t.fields})


# ---- evolution steps ------------------------------------------------------------------------------------------------

WIDER_INT = {"int8": ["int16", "int32", "int64", "float32", "float64"], "int16": ["int32", "int64", "float64"],
             "int32": ["int64", "float64"], "int64": ["float64"], "float32": ["float64"]}


@dataclasses.dataclass(frozen=True)
class Step:
    """One evolution step: the new schema and what it does to a stored (dict-form) value."""

    kind: str
    schema: RecordType
    field: str = ""
    other: str = ""
    default: Any = None

    def apply(self, value: dict[str, Any]) -> dict[str, Any]:
        v = dict(value)
        if self.kind == "add":
            v[self.field] = self.default
        elif self.kind == "drop":
            del v[self.field]
        elif self.kind == "rename":
            v[self.other] = v.pop(self.field)
        elif self.kind == "widen" and v[self.field] is not None and self.other.startswith("float"):
            v[self.field] = float(v[self.field])
        return {f.name: v[f.name] for f in self.schema.fields}


@st.composite
def evolution_steps(draw: Any, schema: RecordType) -> Step:
    fields = list(schema.fields)
    kinds = ["add", "reorder", "rename", "nullable"] + (["drop"] if len(fields) > 1 else [])
    if any(isinstance(f.type, PrimitiveType) and f.type.name in WIDER_INT for f in fields):
        kinds.append("widen")
    kind = draw(st.sampled_from(kinds))
    if kind == "add":
        name = draw(names.filter(lambda n: n not in schema.names))
        nullable = draw(st.booleans())
        default = None if nullable and draw(st.booleans()) else draw(st.integers(-5, 5))
        new = Field(name, INT64, nullable, default=default)
        at = draw(st.integers(0, len(fields)))
        return Step("add", RecordType(tuple(fields[:at] + [new] + fields[at:])), name, default=default)
    if kind == "drop":
        gone = draw(st.sampled_from(fields))
        return Step("drop", RecordType(tuple(f for f in fields if f is not gone)), gone.name)
    if kind == "reorder":
        return Step("reorder", RecordType(tuple(draw(st.permutations(fields)))))
    if kind == "rename":
        f = draw(st.sampled_from(fields))
        name = draw(names.filter(lambda n: n not in schema.names))
        renamed = dataclasses.replace(f, name=name, aliases=(f.name,))
        return Step("rename", RecordType(tuple(renamed if x is f else x for x in fields)), f.name, name)
    if kind == "nullable":
        f = draw(st.sampled_from(fields))
        return Step("nullable", RecordType(tuple(dataclasses.replace(x, nullable=True) if x is f else x
                                                 for x in fields)), f.name)
    f = draw(st.sampled_from([f for f in fields if isinstance(f.type, PrimitiveType) and f.type.name in WIDER_INT]))
    wider = draw(st.sampled_from(WIDER_INT[f.type.name]))
    return Step("widen", RecordType(tuple(dataclasses.replace(x, type=PrimitiveType(wider)) if x is f else x
                                          for x in fields)), f.name, wider)
