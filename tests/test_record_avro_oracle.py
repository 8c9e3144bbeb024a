"""Record evolution against Avro: random writer schemas, reader schemas derived from them by random steps (add, drop,
reorder, widen, string <-> binary, rename through an alias, swap two names, rename a field away and reuse its name,
the same inside nested records, and a few changes Avro refuses), random records. keygroups' resolution must give what
Avro gives, or both must refuse.

The oracle is Avro's specification, run as two steps: the reader's aliases rewrite the writer's schema ("Aliases
function by re-writing the writer's schema using aliases from the reader's schema"; a rewrite that leaves two fields
of one name is refused, as Java's ``Schema.applyAliases`` refuses it), then fastavro resolves the rewritten writer
against the reader without aliases (by name: defaults, promotions, nested records, unions). fastavro alone is not the
oracle for aliases: it matches a writer's field by the reader's field name first and by alias second, so a swap keeps
the values in place and a reused name is fed by both fields (the very bug this module guards against in keygroups),
and Java's ``GenericDatumReader`` applies the aliases twice (a swap is undone). ``test_java_resolving_decoder_agrees``
checks the alias cases against Java Avro's own ``ResolvingDecoder`` (the Avro jar ships with pyspark).

keygroups is stricter than Avro in a few documented places, which the generator does not draw: a nullable field never
becomes not null (Avro fails only when it meets a null), and a nullable field added without a default reads as null
(the Avro schemas given to fastavro say ``"default": null`` for it). The second property runs the same cases through
both state backends, restored at another parallelism.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import decimal
import io
import json
import os
import pathlib
import random
import shutil
import subprocess
from typing import Any

import fastavro
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from keygroups import assign_to_operator, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.errors import StateMigrationError
from keygroups.serializers import Int64Serializer, RecordSerializer, resolve_compatibility
from keygroups.serializers.schema import (
    NO_DEFAULT,
    DataType,
    DecimalType,
    Field,
    ListType,
    MapType,
    PrimitiveType,
    RecordType,
    TimestampType,
)
from keygroups.state import HeapKeyedStateBackend, RocksDBKeyedStateBackend, ValueStateDescriptor

UTC = dt.timezone.utc


# ---- the test's own schema model: Avro record names stay fixed through a derivation -----------------------------

@dataclasses.dataclass
class F:
    name: str
    type: Any                      # a scalar name, ("list", t, nullable), ("map", t, nullable), ("decimal", p, s),
    nullable: bool                 # ("timestamp", unit, tz), or an M
    default: Any = NO_DEFAULT
    aliases: tuple[str, ...] = ()


@dataclasses.dataclass
class M:
    avro_name: str
    fields: list[F]


SCALARS = ["int8", "int16", "int32", "int64", "float32", "float64", "bool", "string", "binary", "date"]
WIDER = {"int8": ["int16", "int32", "int64", "float32", "float64"], "int16": ["int32", "int64", "float32", "float64"],
         "int32": ["int64", "float32", "float64"], "int64": ["float32", "float64"], "float32": ["float64"],
         "string": ["binary"], "binary": ["string"]}
NOT_A_PROMOTION = {"int32": "string", "int64": "int32", "float64": "float32", "string": "int64", "bool": "int32",
                   "binary": "float64", "date": "string", "float32": "int64"}
AVRO_SCALAR = {"int8": "int", "int16": "int", "int32": "int", "int64": "long", "float32": "float",
               "float64": "double", "bool": "boolean", "string": "string", "binary": "bytes",
               "date": {"type": "int", "logicalType": "date"}}
names = st.text(alphabet="abcdefgh", min_size=1, max_size=3)


def kg_type(t: Any) -> DataType:
    if isinstance(t, M):
        return kg_record(t)
    if isinstance(t, str):
        return PrimitiveType(t)
    kind = t[0]
    if kind == "list":
        return ListType(kg_type(t[1]), t[2])
    if kind == "map":
        return MapType(PrimitiveType("string"), kg_type(t[1]), t[2])
    if kind == "decimal":
        return DecimalType(t[1], t[2])
    return TimestampType(t[1], t[2])


def kg_record(m: M) -> RecordType:
    return RecordType(tuple(Field(f.name, kg_type(f.type), f.nullable, f.default, f.aliases) for f in m.fields))


def avro_type(t: Any) -> Any:
    if isinstance(t, M):
        return avro_record(t)
    if isinstance(t, str):
        return AVRO_SCALAR[t]
    kind = t[0]
    if kind == "list":
        return {"type": "array", "items": _nullable(avro_type(t[1]), t[2])}
    if kind == "map":
        return {"type": "map", "values": _nullable(avro_type(t[1]), t[2])}
    if kind == "decimal":
        return {"type": "bytes", "logicalType": "decimal", "precision": t[1], "scale": t[2]}
    unit = {"ms": "millis", "us": "micros"}[t[1]]
    return {"type": "long", "logicalType": f"{'timestamp' if t[2] else 'local-timestamp'}-{unit}"}


def _nullable(t: Any, nullable: bool, default: Any = None) -> Any:
    if not nullable:
        return t
    return [t, "null"] if default is not None else ["null", t]


def avro_record(m: M) -> dict[str, Any]:
    """Without aliases: the oracle applies them itself (``rewrite``), then fastavro matches by name only."""
    fields = []
    for f in m.fields:
        d: dict[str, Any] = {"name": f.name}
        default = None if f.default is NO_DEFAULT else f.default
        d["type"] = _nullable(avro_type(f.type), f.nullable, default)
        if f.default is not NO_DEFAULT:
            d["default"] = f.default
        elif f.nullable:
            d["default"] = None          # keygroups: a nullable field added without a default reads as null
        fields.append(d)
    return {"type": "record", "name": m.avro_name, "fields": fields}


class Ambiguous(Exception):
    """Avro refuses the rewritten writer's schema: two of its fields share a name."""


def rewrite(writer: M, reader: M) -> M:
    """Avro's alias rewrite of the writer's schema by the reader's: per record name, a writer field named like an
    alias of a reader field takes that field's name (written from the specification, as Java's applyAliases)."""
    field_aliases: dict[str, dict[str, str]] = {}

    def collect(t: Any) -> None:
        if isinstance(t, M):
            for f in t.fields:
                for a in f.aliases:
                    field_aliases.setdefault(t.avro_name, {})[a] = f.name
                collect(f.type)
        elif isinstance(t, tuple) and t[0] in ("list", "map"):
            collect(t[1])

    def apply(t: Any) -> Any:
        if isinstance(t, M):
            renames = field_aliases.get(t.avro_name, {})
            fields = [F(renames.get(f.name, f.name), apply(f.type), f.nullable) for f in t.fields]
            if len({f.name for f in fields}) != len(fields):
                raise Ambiguous(t.avro_name)
            return M(t.avro_name, fields)
        if isinstance(t, tuple) and t[0] in ("list", "map"):
            return (t[0], apply(t[1]), t[2])
        return t

    collect(reader)
    return apply(writer)


# ---- writer schemas and their values -----------------------------------------------------------------------------

@st.composite
def writer_types(draw: Any, depth: int, counter: list[int]) -> Any:
    choice = draw(st.integers(0, 9 if depth < 2 else 6))
    if choice <= 4:
        return draw(st.sampled_from(SCALARS))
    if choice == 5:
        p = draw(st.integers(1, 38))
        return ("decimal", p, draw(st.integers(0, min(p, 10))))
    if choice == 6:
        return ("timestamp", draw(st.sampled_from(["ms", "us"])), draw(st.sampled_from(["UTC", None])))
    if choice == 7:
        return ("list", draw(writer_types(depth + 1, counter)), draw(st.booleans()))
    if choice == 8:
        return ("map", draw(writer_types(depth + 1, counter)), draw(st.booleans()))
    return draw(writer_records(depth + 1, counter))


@st.composite
def writer_records(draw: Any, depth: int = 0, counter: list[int] | None = None) -> M:
    counter = [0] if counter is None else counter
    counter[0] += 1
    name = f"R{counter[0]}"
    field_names = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    return M(name, [F(n, draw(writer_types(depth, counter)), draw(st.booleans())) for n in field_names])


def values(t: Any, nullable: bool = False, *, probe: str = "") -> st.SearchStrategy[Any]:
    """Values of ``t``. Avro resolves a union or a promotion when it meets a value, so two probes make Avro judge a
    schema pair as a whole, as keygroups does: ``probe="full"`` has every position filled (no null, no empty list or
    map, binary that is UTF-8), ``probe="nulls"`` has a null wherever one may be (and no empty list or map)."""
    if nullable and probe == "nulls":
        return st.none()
    base = _values(t, probe)
    return st.one_of(st.none(), base) if nullable and not probe else base


def _values(t: Any, probe: str) -> st.SearchStrategy[Any]:
    if isinstance(t, M):
        return st.fixed_dictionaries({f.name: values(f.type, f.nullable, probe=probe) for f in t.fields})
    if isinstance(t, str):
        bits = {"int8": 7, "int16": 15, "int32": 31, "int64": 53}   # int64 within a double's exact range (see below)
        if t in bits:
            return st.integers(-(2 ** bits[t]), 2 ** bits[t] - 1)
        # binary: mostly UTF-8 (so string readers get text), sometimes not (both must refuse)
        binary = st.text(max_size=6).map(str.encode)
        return {"float32": st.floats(width=32, allow_nan=False), "float64": st.floats(allow_nan=False),
                "bool": st.booleans(), "string": st.text(max_size=6),
                "binary": binary if probe else st.one_of(binary, st.binary(max_size=6)),
                "date": st.dates()}[t]
    kind = t[0]
    size = 1 if probe else 0
    if kind == "list":
        return st.lists(values(t[1], t[2], probe=probe), min_size=size, max_size=3)
    if kind == "map":
        return st.dictionaries(st.text(max_size=3), values(t[1], t[2], probe=probe), min_size=size, max_size=3)
    if kind == "decimal":
        bound = 10 ** t[1] - 1
        return st.integers(-bound, bound).map(lambda u: decimal.Decimal(u).scaleb(-t[2], decimal.Context(prec=60)))
    naive = st.datetimes(dt.datetime(1, 1, 2), dt.datetime(9999, 12, 30))
    if t[1] == "ms":
        naive = naive.map(lambda d: d.replace(microsecond=d.microsecond // 1000 * 1000))
    return naive if t[2] is None else naive.map(lambda d: d.replace(tzinfo=UTC))


# ---- reader schemas: random steps from the writer's ---------------------------------------------------------------

ADDED = {"int32": st.integers(-5, 5), "int64": st.integers(-5, 5), "float64": st.floats(-4, 4, width=32),
         "string": st.text(max_size=3), "bool": st.booleans()}


def _fresh(draw: Any, taken: set[str]) -> str:
    return draw(names.filter(lambda n: n not in taken))


def _added(draw: Any, name: str) -> F:
    t = draw(st.sampled_from(sorted(ADDED)))
    how = draw(st.sampled_from(["default", "nullable", "nullable default", "no default"]))
    if how == "no default":     # Avro and keygroups both refuse it
        return F(name, t, False)
    if how == "nullable":
        return F(name, t, True)
    return F(name, t, how == "nullable default", draw(ADDED[t]))


@st.composite
def derive(draw: Any, writer: M, depth: int = 0) -> M:
    m = copy.deepcopy(writer)
    # one change of type per field, and none of an added field (its default is of its type): two could chain into
    # one keygroups does not take
    retyped: set[int] = set()
    for _ in range(draw(st.integers(1, 3))):
        fs = m.fields
        taken = {f.name for f in fs} | {a for f in fs for a in f.aliases}
        kind = draw(st.sampled_from(["add", "drop", "reorder", "widen", "rename", "swap", "reuse", "nested",
                                     "nullable", "claim", "bad"]))
        event(f"step: {kind}")
        if kind == "add":
            fs.insert(draw(st.integers(0, len(fs))), _added(draw, _fresh(draw, taken)))
        elif kind == "drop" and len(fs) > 1:
            fs.pop(draw(st.integers(0, len(fs) - 1)))
        elif kind == "reorder":
            m.fields = draw(st.permutations(fs))
        elif kind == "widen":
            widenable = [f for f in fs if isinstance(f.type, str) and f.type in WIDER and id(f) not in retyped
                         and f.default is NO_DEFAULT]
            if widenable:
                f = draw(st.sampled_from(widenable))
                f.type = draw(st.sampled_from(WIDER[f.type]))
                retyped.add(id(f))
        elif kind == "nullable":
            f = draw(st.sampled_from(fs))
            f.nullable = True
        elif kind == "rename":
            f = draw(st.sampled_from(fs))
            f.aliases, f.name = (*f.aliases, f.name), _fresh(draw, taken)
        elif kind == "swap" and len(fs) > 1:   # each takes the other's name and lists it as an alias
            a, b = draw(st.permutations(fs))[:2]
            a.name, b.name = b.name, a.name
            a.aliases, b.aliases = (*a.aliases, b.name), (*b.aliases, a.name)
        elif kind == "reuse":                  # rename a field away and give its old name to a new field
            f = draw(st.sampled_from(fs))
            old = f.name
            f.aliases, f.name = (*f.aliases, old), _fresh(draw, taken)
            fs.append(_added(draw, old))
        elif kind == "claim" and len(fs) > 1:  # an alias naming a field the record still has: Avro refuses
            a, b = draw(st.permutations(fs))[:2]
            if b.name not in a.aliases and not any(b.name in f.aliases for f in fs):
                a.aliases = (*a.aliases, b.name)
        elif kind == "bad":                    # a change of type that is no promotion: both refuse
            changeable = [f for f in fs if isinstance(f.type, str) and f.type in NOT_A_PROMOTION
                          and id(f) not in retyped and f.default is NO_DEFAULT]
            if changeable:
                f = draw(st.sampled_from(changeable))
                f.type = NOT_A_PROMOTION[f.type]
                retyped.add(id(f))
        elif kind == "nested":
            nested = [f for f in fs if isinstance(f.type, M)]
            if nested and depth < 2:
                f = draw(st.sampled_from(nested))
                f.type = draw(derive(f.type, depth + 1))
    return m


def _drop_shared_aliases(m: M) -> M:
    """A derivation can leave two fields listing one alias; keygroups refuses that when the schema is declared (the
    test checks so elsewhere), so the oracle cases keep the alias on the first field only."""
    seen: set[str] = set()
    for f in m.fields:
        f.aliases = tuple(a for a in f.aliases if a not in seen and a != f.name)
        seen.update(f.aliases)
        if isinstance(f.type, M):
            _drop_shared_aliases(f.type)
    return m


# ---- both sides ------------------------------------------------------------------------------------------------

REFUSED = "refused"


def avro_reads(writer: M, reader: M, records: list[dict[str, Any]], probes: list[dict[str, Any]]) -> Any:
    """What Avro reads each record as, or REFUSED (also when it cannot read one of the ``probes``: see ``values``)."""
    try:
        rewritten = rewrite(writer, reader)
    except Ambiguous:
        return REFUSED
    if _narrowed(rewritten, reader):
        return REFUSED
    w = fastavro.parse_schema(avro_record(writer))
    w_renamed = fastavro.parse_schema(avro_record(rewritten))
    r = fastavro.parse_schema(avro_record(reader))
    out = []
    for rec in [*probes, *records]:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, w, rec)
        buf.seek(0)
        try:
            # the bytes are positional: written with the writer's names, read as the rewritten writer's
            out.append(fastavro.schemaless_reader(buf, w_renamed, r))
        except (fastavro.read.SchemaResolutionError, UnicodeDecodeError):
            return REFUSED
    if _logical_read_as_plain_type(reader, out):
        return REFUSED
    return [float32_view(reader, v) for v in out[len(probes):]]


def _narrowed(w: Any, r: Any) -> bool:
    """Whether a reader field reads a writer field of another scalar type that is not a promotion. Avro's ``int``
    holds int8, int16 and int32 alike, so an alias rewrite that pairs an int16 with an int8 reads in Avro, while
    keygroups refuses the narrowing (a StateMigrationError naming the state and field)."""
    if isinstance(w, M) and isinstance(r, M):
        written = {f.name: f.type for f in w.fields}
        return any(f.name in written and _narrowed(written[f.name], f.type) for f in r.fields)
    if isinstance(w, tuple) and isinstance(r, tuple) and w[0] == r[0] and w[0] in ("list", "map"):
        return _narrowed(w[1], r[1])
    return isinstance(w, str) and isinstance(r, str) and w != r and r not in WIDER.get(w, [])


def _logical_read_as_plain_type(t: Any, v: Any) -> bool:
    """Whether a logical type's value (a date, a timestamp, a decimal) reached a reader field of a plain type. Avro's
    Java reader promotes the underlying int or long (days, milliseconds) to a long, float or double there, and
    fastavro hands over the date or datetime itself; keygroups refuses to turn a date or an instant into a number
    (Spark's ``date`` and ``timestamp`` are no numbers), with a StateMigrationError naming the state and field."""
    if isinstance(v, list) and not isinstance(t, tuple):   # the records read
        return any(_logical_read_as_plain_type(t, x) for x in v)
    if v is None:
        return False
    if isinstance(t, M):
        return any(_logical_read_as_plain_type(f.type, v.get(f.name)) for f in t.fields)
    if isinstance(t, tuple) and t[0] == "list":
        return any(_logical_read_as_plain_type(t[1], x) for x in v)
    if isinstance(t, tuple) and t[0] == "map":
        return any(_logical_read_as_plain_type(t[1], x) for x in v.values())
    logical = isinstance(t, tuple) and t[0] in ("timestamp", "decimal")
    return t != "date" and not logical and isinstance(v, (dt.date, decimal.Decimal))


def float32_view(t: Any, v: Any) -> Any:
    """fastavro hands a float32 reader promoted ints as doubles: Avro's value is the nearest float32."""
    if v is None:
        return None
    if isinstance(t, M):
        return {f.name: float32_view(f.type, v[f.name]) for f in t.fields}
    if t == "float32":
        return float(np.float32(v))
    if isinstance(t, tuple) and t[0] == "list":
        return [float32_view(t[1], x) for x in v]
    if isinstance(t, tuple) and t[0] == "map":
        return {k: float32_view(t[1], x) for k, x in v.items()}
    return v


def keygroups_reads(writer: M, reader: M, records: list[dict[str, Any]]) -> Any:
    old, new = RecordSerializer(kg_record(writer)), RecordSerializer(kg_record(reader))
    try:
        _, read = resolve_compatibility("s", old.snapshot(), new)
        return read.deserialize_many(*old.serialize_many(records))
    except StateMigrationError as e:
        assert "'s'" in str(e)      # every refusal names the state (and, in its message, the field)
        return REFUSED


@st.composite
def cases(draw: Any) -> tuple[M, M, list[dict[str, Any]], list[dict[str, Any]]]:
    writer = draw(writer_records())
    reader = _drop_shared_aliases(draw(derive(writer)))
    records = draw(st.lists(values(writer), min_size=1, max_size=4))
    return writer, reader, records, [draw(values(writer, probe="full")), draw(values(writer, probe="nulls"))]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example(case=(M("R1", [F("aa", "date", False, NO_DEFAULT, ())]), M("R1", [F("aa", "float64", True, NO_DEFAULT, ())]),
               [{"aa": dt.date(2000, 1, 1)}], [{"aa": dt.date(2000, 1, 1)}, {"aa": dt.date(2000, 1, 1)}]))
def test_keygroups_resolves_as_avro_does(case):
    writer, reader, records, probes = case
    expected = avro_reads(writer, reader, records, probes)
    event("both refuse" if expected == REFUSED else "both read")
    assert keygroups_reads(writer, reader, records) == expected


# ---- the same through both backends, restored at another parallelism --------------------------------------------

MAXP = 16


def _write_and_restore(backend: str, p: int, p2: int, writer: M, reader: M, records: list[dict[str, Any]],
                       root: pathlib.Path) -> Any:
    cls = {"heap": HeapKeyedStateBackend, "rocksdb": RocksDBKeyedStateBackend}[backend]
    storage = CheckpointStorage(root)
    old = RecordSerializer(kg_record(writer))
    backends = [cls(key_group_range(MAXP, p, i), MAXP, Int64Serializer(), subtask_index=i) for i in range(p)]
    states = [b.get_state(ValueStateDescriptor("s", old)) for b in backends]
    for k, rec in enumerate(records):
        i = assign_to_operator(k, MAXP, p)
        backends[i].set_current_key(k)
        states[i].update(rec)
    handles = [b.snapshot(1, storage).result(60) for b in backends]
    for b in backends:
        b.dispose()
    storage.commit(CheckpointMetadata(checkpoint_id=1, job_id="oracle", timestamp_ms=0, max_parallelism=MAXP,
                                      parallelism=p, keyed_handles=carry_forward(None, handles),
                                      operator_handles=[], properties={}))
    metadata = storage.load(1)
    new = RecordSerializer(kg_record(reader))
    backends = [cls(key_group_range(MAXP, p2, i), MAXP, Int64Serializer(), subtask_index=i) for i in range(p2)]
    try:
        for b in backends:
            b.restore(storage, metadata)
        states = [b.get_state(ValueStateDescriptor("s", new)) for b in backends]
        out = []
        for k in range(len(records)):
            i = assign_to_operator(k, MAXP, p2)
            backends[i].set_current_key(k)
            out.append(states[i].value())
        return out
    except StateMigrationError as e:
        assert "'s'" in str(e)
        return REFUSED
    finally:
        for b in backends:
            b.dispose()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(case=cases(), backend=st.sampled_from(["heap", "rocksdb"]),
       parallelisms=st.tuples(st.integers(1, 3), st.integers(1, 3)))
def test_both_backends_restore_as_avro_reads_at_another_parallelism(case, backend, parallelisms, tmp_path_factory):
    writer, reader, records, probes = case
    root = tmp_path_factory.mktemp("oracle")
    try:
        got = _write_and_restore(backend, *parallelisms, writer, reader, records, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert got == avro_reads(writer, reader, records, probes)


# ---- the alias cases by hand, and against Java Avro's resolver ---------------------------------------------------

def _m(*fields: F) -> M:
    return M("R", list(fields))


ALIAS_CASES = {
    "swap": (_m(F("a", "int64", False), F("b", "int64", False)),
             _m(F("a", "int64", False, aliases=("b",)), F("b", "int64", False, aliases=("a",)))),
    "swap and drop": (_m(F("a", "int64", False), F("b", "int64", False), F("c", "int64", False)),
                      _m(F("a", "int64", False, aliases=("b",)), F("b", "int64", False, aliases=("a",)))),
    "renamed away, name reused": (_m(F("a", "int64", False)),
                                  _m(F("b", "int64", False, aliases=("a",)), F("a", "int64", False, 7))),
    "renamed and widened": (_m(F("a", "int32", False), F("z", "string", True)),
                            _m(F("z", "binary", True), F("b", "float64", False, aliases=("a",)))),
    "alias claims a kept field": (_m(F("a", "int64", False), F("b", "int64", False)),
                                  _m(F("b", "int64", False, aliases=("a",)))),
}


@pytest.mark.parametrize("case", sorted(ALIAS_CASES))
def test_alias_cases_follow_the_specification(case):
    writer, reader = ALIAS_CASES[case]
    records = [{f.name: (i * 10 + j if f.type != "string" else f"s{i}") for j, f in enumerate(writer.fields)}
               for i in range(3)]
    expected = avro_reads(writer, reader, records, records[:1])
    assert keygroups_reads(writer, reader, records) == expected
    if case.startswith("swap"):
        assert expected == [{"a": r["b"], "b": r["a"]} for r in records]
    elif case == "renamed away, name reused":
        assert expected == [{"b": r["a"], "a": 7} for r in records]
    elif case == "alias claims a kept field":
        assert expected == REFUSED


JAVA_RESOLVER = r"""
import org.apache.avro.Schema;
import org.apache.avro.io.*;
import java.io.*;
import java.nio.file.*;
import java.util.*;

// One case per line: writer schema, reader schema, then the writer's long fields' values; prints what the
// ResolvingDecoder reads (reader field = value, in reader order) or ERROR.
public class ResolveCases {
  public static void main(String[] args) throws Exception {
    for (String line : Files.readAllLines(Paths.get(args[0]))) {
      String[] part = line.split("\t");
      try {
        Schema w = new Schema.Parser().parse(part[0]);
        Schema r = new Schema.Parser().parse(part[1]);
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        BinaryEncoder enc = EncoderFactory.get().binaryEncoder(out, null);
        for (String v : part[2].split(",")) enc.writeLong(Long.parseLong(v));
        enc.flush();
        ResolvingDecoder d = DecoderFactory.get().resolvingDecoder(w, r,
            DecoderFactory.get().binaryDecoder(out.toByteArray(), null));
        StringBuilder sb = new StringBuilder();
        for (Schema.Field f : d.readFieldOrder()) sb.append(f.name()).append('=').append(d.readLong()).append(' ');
        d.drain();
        System.out.println(sb.toString().trim());
      } catch (Exception e) {
        System.out.println("ERROR");
      }
    }
  }
}
"""


def _avro_jars() -> list[str]:
    pyspark = pytest.importorskip("pyspark")
    jars = pathlib.Path(pyspark.__file__).parent / "jars"
    wanted = ("avro-1", "jackson-core-", "jackson-databind-", "jackson-annotations-", "slf4j-api-",
              "commons-compress-")
    found = [str(p) for p in sorted(jars.glob("*.jar")) if p.name.startswith(wanted) and "avro-ipc" not in p.name]
    if not any("avro-1" in p for p in found) or shutil.which("java") is None:
        pytest.skip("no Java or no Avro jar in pyspark's jars")
    return found


def _java_schema(m: M) -> dict[str, Any]:
    """Long fields only (aliases kept: Java applies them itself); defaults as given."""
    fields = []
    for f in m.fields:
        d: dict[str, Any] = {"name": f.name, "type": "long"}
        if f.aliases:
            d["aliases"] = list(f.aliases)
        if f.default is not NO_DEFAULT:
            d["default"] = f.default
        fields.append(d)
    return {"type": "record", "name": m.avro_name, "fields": fields}


def long_alias_cases(rng: random.Random) -> tuple[M, M, dict[str, int]]:
    """A writer of long fields and a reader made from it by random renames, swaps, reused names, drops, reorders and
    aliases that claim a kept field."""
    pool = list("abcdefg")
    writer = M("R", [F(n, "int64", False) for n in rng.sample(pool, rng.randint(1, 4))])
    reader = copy.deepcopy(writer)
    for _ in range(rng.randint(1, 3)):
        fs = reader.fields
        taken = {f.name for f in fs} | {a for f in fs for a in f.aliases}
        fresh = [n for n in pool if n not in taken]
        kind = rng.choice(["rename", "swap", "reuse", "drop", "reorder", "claim"])
        if kind in ("rename", "reuse") and fresh:
            f = rng.choice(fs)
            old = f.name
            f.aliases, f.name = (*f.aliases, old), rng.choice(fresh)
            if kind == "reuse":
                fs.append(F(old, "int64", False, rng.randint(-9, 9)))
        elif kind == "swap" and len(fs) > 1:
            a, b = rng.sample(fs, 2)
            a.name, b.name = b.name, a.name
            a.aliases, b.aliases = (*a.aliases, b.name), (*b.aliases, a.name)
        elif kind == "drop" and len(fs) > 1:
            fs.pop(rng.randrange(len(fs)))
        elif kind == "reorder":
            rng.shuffle(fs)
        elif kind == "claim" and len(fs) > 1:
            a, b = rng.sample(fs, 2)
            a.aliases = (*a.aliases, b.name)
    _drop_shared_aliases(reader)
    return writer, reader, {f.name: i + 1 for i, f in enumerate(writer.fields)}


def _java_skips_rewrite(writer: M, reader: M) -> bool:
    """Java's applyAliases returns the writer unchanged when it equals the reader (Schema.equals ignores aliases):
    then even a swap is not applied. The specification has no such exception; those cases are left out."""
    return [(f.name, f.default) for f in writer.fields] == [(f.name, f.default) for f in reader.fields]


@pytest.mark.slow
def test_java_resolving_decoder_agrees(tmp_path):
    """Alias cases (renames, swaps, reused names, drops, reorders, claims) drawn at random, resolved by Java Avro's
    ResolvingDecoder (the Avro jar pyspark ships) in one JVM, and by keygroups."""
    jars = _avro_jars()
    rng = random.Random(31)
    found = [c for c in (long_alias_cases(rng) for _ in range(300)) if not _java_skips_rewrite(c[0], c[1])]
    lines = []
    for writer, reader, values in found:
        lines.append("\t".join([json.dumps(_java_schema(writer)), json.dumps(_java_schema(reader)),
                                ",".join(str(values[f.name]) for f in writer.fields)]))
    (tmp_path / "cases.tsv").write_text("\n".join(lines) + "\n")
    (tmp_path / "ResolveCases.java").write_text(JAVA_RESOLVER)
    run = subprocess.run(["java", "-cp", os.pathsep.join(jars), str(tmp_path / "ResolveCases.java"),
                          str(tmp_path / "cases.tsv")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    answers = run.stdout.strip().splitlines()
    assert len(answers) == len(found)
    for (writer, reader, values), java in zip(found, answers):
        got = keygroups_reads(writer, reader, [values])
        if java == "ERROR":
            assert got == REFUSED, (writer, reader)
        else:
            want = dict((k, int(v)) for k, v in (kv.split("=") for kv in java.split()))
            assert got != REFUSED and got[0] == want, (writer, reader, java)
