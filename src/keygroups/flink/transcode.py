"""The compiled import of keyed state (``keygroups._native.flinkin``): a Flink serializer tree (``FlinkType``) as the
tree of compiled nodes that turns its bytes straight into the bytes of its keygroups serializer
(``FlinkType.keygroups_serializer()``), and a keyed state's plan (job key, namespace, value framing, TTL).

Every type the importer maps is compiled, in ``VoidNamespace`` and ``TimeWindow`` namespaces (window state and
window timers). What is not (session contents moved by ``merging-window-set``, a process window's records as
Arrow batches) falls back to the Python path of ``keygroups.flink.importer``
(decode to Python values, encode with the keygroups serializer), state by state.
"""

from __future__ import annotations

from keygroups._native import flinkin
from keygroups.flink.types import (
    BooleanType,
    ByteType,
    BytesType,
    CharType,
    DoubleType,
    FlinkType,
    FloatType,
    IntType,
    ListType,
    LongType,
    MapType,
    NullableType,
    RowType,
    ShortType,
    StringType,
    TimeWindowType,
    TupleType,
    VoidNamespaceType,
    holds_tuple,
)

_SCALARS: dict[type[FlinkType], int] = {
    LongType: flinkin.LONG, IntType: flinkin.INT, ShortType: flinkin.SHORT, ByteType: flinkin.BYTE,
    DoubleType: flinkin.DOUBLE, FloatType: flinkin.FLOAT, BooleanType: flinkin.BOOL, CharType: flinkin.CHAR,
    StringType: flinkin.STRING, BytesType: flinkin.BYTES}


class NotCompiled(Exception):
    """The type or state has no compiled import; the Python path imports it."""


def compile_type(t: FlinkType, record: bool = False) -> flinkin.Node:
    """The compiled node of ``t``: as its keygroups serializer writes it (a codec), or inside a Row (``record``)
    as a ``RecordSerializer`` field."""
    scalar = _SCALARS.get(type(t))
    if scalar is not None:
        return flinkin.Node(scalar, record)
    if isinstance(t, RowType):      # a Row is a record, whatever holds it
        return flinkin.Node(flinkin.ROW, record, tuple(compile_type(f, True) for f in t.fields),
                            row_kind=t.supports_row_kind)
    if isinstance(t, TupleType):
        return flinkin.Node(flinkin.TUPLE, record, tuple(compile_type(f, record) for f in t.fields))
    if isinstance(t, ListType):
        return flinkin.Node(flinkin.LIST, record, (compile_type(t.element, record),))
    if isinstance(t, MapType):
        return flinkin.Node(flinkin.MAP, record, (compile_type(t.key, record), compile_type(t.value, record)))
    if isinstance(t, NullableType):
        return flinkin.Node(flinkin.NULLABLE, record, (compile_type(t.inner, record),), padding=t.padding)
    raise NotCompiled(f"{t!r} has no compiled import")


#: A ``TimeWindow`` namespace (start, end) as ``TimeWindow.serializer()`` writes it: a tuple of two Int64.
_WINDOW = TupleType((LongType(), LongType()))


def compile_value(t: FlinkType, tuples_as_records: bool) -> flinkin.Node:
    """The compiled node of a whole state value (a value, list element or map value). ``tuples_as_records``: a
    Tuple is imported as a record (``keygroups.flink.types.state_serializer``); one at the top of the value is its
    record's bytes (its fields in order, in the record format), one inside a List, Map or Nullable value has no
    compiled import (NotCompiled: the Python path writes it)."""
    if not tuples_as_records:
        return compile_type(t)
    if isinstance(t, TupleType):
        return compile_type(t, True)
    if holds_tuple(t):
        raise NotCompiled(f"a Tuple inside {t!r} becomes a nested record: no compiled import")
    return compile_type(t)


def state_plan(name: str, kind: str, key_type: FlinkType, namespace_type: FlinkType | None, value_type: FlinkType,
               map_key_type: FlinkType | None, ttl: bool, timers: bool, wrap: bool = False, *,
               tuples_as_records: bool = False) -> flinkin.StatePlan:
    """The compiled import of one keyed state: ``kind`` is keygroups' (value, reducing, aggregating, list, map),
    ``value_type`` the value's, list element's or map value's FlinkType with its TTL unwrapped (``ttl`` says
    whether it had one); ``timers`` for a timer queue (its value_type is ignored); ``tuples_as_records``: its Tuples
    become records (``compile_value``). NotCompiled if it has none.

    In ``TimeWindow`` namespaces (keygroups.flink.windows): a state becomes the namespaced state's map, window ->
    value (``wrap``: the window operator's one-part accumulator ``(v,)``) or list, (window, user key) -> value for
    a map state; window timers become the key's timers."""
    windowed = isinstance(namespace_type, TimeWindowType)
    if not windowed and not isinstance(namespace_type, VoidNamespaceType):
        raise NotCompiled(f"state {name!r} is in namespace {namespace_type!r}")
    key = compile_type(key_type)
    namespace = compile_type(_WINDOW) if windowed else None
    if timers:
        return flinkin.StatePlan(flinkin.TIMER_STATE, key, name=name, namespace=namespace)
    value = compile_type(TupleType((value_type,))) if wrap else compile_value(value_type, tuples_as_records)
    if windowed:
        kinds = {"list": flinkin.LIST_STATE, "map": flinkin.MAP_STATE}
        user_key = compile_type(map_key_type) if kind == "map" and map_key_type is not None else None
        return flinkin.StatePlan(kinds.get(kind, flinkin.VALUE_STATE), key, value, user_key, ttl, name, namespace)
    if kind == "map":
        assert map_key_type is not None
        return flinkin.StatePlan(flinkin.MAP_STATE, key, value, compile_type(map_key_type), ttl, name)
    if kind == "list":
        return flinkin.StatePlan(flinkin.LIST_STATE, key, value, None, ttl, name)
    return flinkin.StatePlan(flinkin.VALUE_STATE, key, value, None, ttl, name)
