"""Flink's window state (keyed state in ``TimeWindow`` namespaces) and window timers, in and out of keygroups.

Flink's ``WindowOperator`` keeps a window's contents in the keyed state ``window-contents`` under the namespace of
the window (a ``ReducingState`` for ``reduce``, an ``AggregatingState`` of the accumulator for ``aggregate``, a
``ListState`` of the records for ``process``/``apply``), and its timers in the queues ``window-timers`` (key,
window, timestamp): the trigger's timer at ``window.maxTimestamp()`` and the cleanup timer at ``maxTimestamp +
allowedLateness`` (one timer when there is no lateness).

keygroups stores a namespaced state as a map state of the same name per key, namespace -> value (``keygroups.state.
namespaced``; ``(namespace, user key) -> value`` for a map state), and its timers per key and timestamp without a
namespace: ``keygroups.windows``' operator registers a timer of the key at ``end - 1`` (and ``end - 1 + lateness``)
and, when it fires, looks up the key's windows in ``window-contents``. So a Flink window timer becomes the key's
timer of the same domain and timestamp, and on the way back a keygroups timer becomes a Flink window timer for each
window of the key it belongs to (``end - 1`` or ``end - 1 + allowed_lateness``).

Two layouts of the imported contents (:class:`FlinkWindows`):

* ``"operator"`` (the default): ``window-contents`` as ``keygroups.windows``' operator keeps it, so a keygroups
  ``window(...)`` job with the same windowing continues Flink's windows and fires them with the Flink-era contents.
  Its accumulator is a tuple of the aggregations' accumulators: Flink's reduced value or accumulator ``v`` becomes
  ``(v,)``, the accumulator of one ``reduce(...)``, ``PythonReduce`` or ``PythonAggregate`` (or ``Sum``/``Min``/
  ``Max`` of a Long or Double, whose nullable accumulator reads it after migration). Flink's list contents (records
  of a process window function) become the operator's Arrow record batches when ``record_schema`` names the
  records' columns (a Tuple or Row element fills them in order, any other element the one column).
* ``"state"``: every namespaced state as it is in Flink (``v`` stays ``v``), for a ``KeyedProcessFunction`` reading
  it with ``context.get_namespaced_state(descriptor, window, TimeWindow.serializer())``.

Other states in ``TimeWindow`` namespaces (a process window function's per-window state) are imported as in the
``"state"`` layout either way.

Merging (session) windows: Flink keeps a session's contents under a "state window" (the first window merged into
it), recorded per key in the list state ``merging-window-set`` of (window, state window) pairs; keygroups keeps them
under the session itself. The operator layout moves the contents to their session and leaves ``merging-window-set``
out; the export writes each session as its own state window (as Flink does for a session not merged yet).

This module is the Python path and the reference: the importer and exporter move window state and window timers
through their compiled transcoders (``keygroups.flink.transcode`` with ``_native/flinkin.pyx``, and
``_native/flinkout.pyx``), which write the same bytes (tests/test_flink_fast_windows.py); what they do not take
comes here: on import the contents of sessions (moved by ``merging-window-set``) and a process window's records as
Arrow batches; on export those records and a window value that may be null.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import pyarrow as pa

from keygroups.flink._cursor import shown
from keygroups.flink.keyed import StateMetaInfoSnapshot, encode_key, encode_list_value
from keygroups.flink.types import (
    BooleanType,
    BytesType,
    DoubleType,
    FlinkType,
    IntType,
    LongType,
    StringType,
    ListType,
    MapType,
    RowType,
    TimerType,
    TimeWindowType,
    TtlType,
    TtlValue,
    TupleType,
    UnsupportedFlinkTypeError,
    VoidNamespaceType,
    flink_type_for,
    flink_value,
)
from keygroups.serializers import BytesSerializer, ListSerializer, SerializerSnapshot, TupleSerializer
from keygroups.state import MapStateDescriptor, StateDescriptor
from keygroups.state.namespaced import backing_descriptor
from keygroups.state.timers import TIMER_STATE_NAMES, TimeDomain
from keygroups.windows.assigners import TimeWindow
from keygroups.windows.operator import CONTENTS_STATE, _from_ipc, _ipc

#: Flink's window timer queues (``WindowOperator``'s timer service "window-timers") and their keygroups domains.
WINDOW_TIMERS = {"_timer_state/event_window-timers": TimeDomain.EVENT_TIME,
                 "_timer_state/processing_window-timers": TimeDomain.PROCESSING_TIME}
#: keygroups' timer states -> Flink's window timer queues (export of a window operator).
FLINK_WINDOW_TIMERS = {TIMER_STATE_NAMES[d]: name for name, d in WINDOW_TIMERS.items()}
#: Flink's record of merged (session) windows: (window, state window) pairs per key (see the module docstring).
MERGING_WINDOW_SET = "merging-window-set"
LAYOUTS = ("operator", "state")
KINDS = ("value", "list", "map", "reducing", "aggregating")


@dataclasses.dataclass(frozen=True)
class FlinkWindows:
    """How window state moves between Flink's ``WindowOperator`` and keygroups (see the module docstring).

    ``layout``: ``"operator"`` (``window-contents`` as ``keygroups.windows`` keeps it) or ``"state"`` (namespaced
    state as in Flink). ``record_schema``: the columns of the records of a process window function (operator layout
    of list contents). Export only: ``states``, the keygroups states that are window state and their Flink kinds
    (``{"window-contents": "reducing"}``; by default the ``like`` savepoint's states in ``TimeWindow`` namespaces,
    else ``window-contents`` as reducing), and ``allowed_lateness`` (ms) of the keygroups windows, which places their
    cleanup timers; ``merging``: the windows are sessions (Flink's ``merging-window-set`` is written; by default when
    the ``like`` savepoint has one). When window state is exported, keygroups' timers become the
    ``WindowOperator``'s window timers (unless the ``like`` savepoint has a ``KeyedProcessFunction``'s user timers
    instead)."""

    layout: str = "operator"
    record_schema: pa.Schema | None = None
    states: Mapping[str, str] | None = None
    allowed_lateness: int = 0
    merging: bool = False

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"FlinkWindows layout {self.layout!r} is unknown; allowed: {list(LAYOUTS)}")
        if self.record_schema is not None and not isinstance(self.record_schema, pa.Schema):
            raise TypeError(f"record_schema must be a pyarrow Schema, got {self.record_schema!r}")
        if self.states is not None:
            bad = {n: k for n, k in self.states.items() if k not in KINDS}
            if bad:
                raise ValueError(f"FlinkWindows states {bad} name unknown Flink state kinds; allowed: {list(KINDS)}")
        lateness = self.allowed_lateness
        if isinstance(lateness, bool) or not isinstance(lateness, int) or lateness < 0:
            raise ValueError(f"allowed_lateness must be an int of ms >= 0, got {lateness!r}")


def check_namespace(namespace_type: FlinkType | None, what: str) -> None:
    """Refuse (by name) a namespace other than Flink's ``TimeWindow``."""
    if not isinstance(namespace_type, TimeWindowType):
        raise UnsupportedFlinkTypeError(f"{what} is in namespace {namespace_type!r}; keygroups maps VoidNamespace and "
                                        "TimeWindow namespaces only (a GlobalWindow or custom window is not); skip "
                                        "it")


# ---------------------------------------------------------------------------------------------- import

@dataclasses.dataclass
class WindowImport:
    """One Flink state in ``TimeWindow`` namespaces as a keygroups namespaced state (its backing map state)."""

    kind: str                                  # the Flink state's kind, lower case
    ttl: bool
    wrap: bool = False                         # the operator layout's one-part accumulator tuple
    record_schema: pa.Schema | None = None     # the operator layout's record batches
    sessions: bool = False                     # contents of merging windows: moved from state window to session
    #: (key, state window) -> session, of the key group being imported (``session_windows``)
    state_windows: dict[tuple[Any, tuple[int, int]], tuple[int, int]] = dataclasses.field(default_factory=dict)

    def entries(self, entries: list[tuple], plain: Callable[[Any], Any], plain_key: Callable[[Any], Any]
                ) -> Iterator[tuple[Any, Any, Any]]:
        """(job key, map key, map value) of the backing map state per Flink entry; ``plain`` converts a value (or
        list element, or map value), ``plain_key`` a map's user key."""
        moved = self.state_windows if self.sessions else {}
        for e in entries:
            window = tuple(e[1])
            if moved:
                window = moved.get((e[0], window), window)
            if self.kind == "map":
                v = e[3]
                if v is None:
                    raise UnsupportedFlinkTypeError(f"a window map state holds a null value for key {e[0]!r}; "
                                                    "keygroups map states hold no nulls")
                yield e[0], (window, plain_key(e[2])), (plain(v.value), v.timestamp) if self.ttl else plain(v)
            elif self.kind == "list":
                elements = e[2]
                if self.ttl:   # keygroups keeps one timestamp per namespace: the list's latest access
                    stamp = max(x.timestamp for x in elements)
                    values = [plain(x.value) for x in elements]
                else:
                    values = [plain(x) for x in elements]
                if self.record_schema is not None:
                    values = [_ipc(_records(values, self.record_schema))]
                yield e[0], window, (values, stamp) if self.ttl else values
            else:
                v = e[2]
                ts = v.timestamp if isinstance(v, TtlValue) else None
                v = plain(v.value if isinstance(v, TtlValue) else v)
                if self.wrap:
                    v = (v,)
                yield e[0], window, (v, ts) if self.ttl else v


def _records(values: list[Any], schema: pa.Schema) -> pa.Table:
    """Flink's window records as the keygroups window operator's record batch of ``schema``."""
    names = schema.names
    if len(names) == 1:
        rows = [{names[0]: v[0] if isinstance(v, tuple) and len(v) == 1 else v} for v in values]
    else:
        rows = []
        for v in values:
            if not isinstance(v, (tuple, list)) or len(v) != len(names):
                raise UnsupportedFlinkTypeError(f"a window record {shown(v)} does not fill record_schema's "
                                                f"{len(names)} columns {names}")
            rows.append(dict(zip(names, v)))
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
        raise UnsupportedFlinkTypeError(f"window records such as {rows[0]!r} do not fit record_schema "
                                        f"{schema.to_string(show_schema_metadata=False)!r}: {e}") from None


def plan_import(name: str, kind: str, inner: StateDescriptor, windows: FlinkWindows, ttl: bool
                ) -> tuple[MapStateDescriptor, WindowImport]:
    """The backing map state of Flink state ``name`` (``kind``, lower case) in ``TimeWindow`` namespaces, whose
    un-namespaced keygroups descriptor is ``inner``, and how its entries convert."""
    operator = windows.layout == "operator" and name == CONTENTS_STATE
    if operator and kind in ("reducing", "aggregating"):
        inner = MapStateDescriptor(name, TimeWindow.serializer(), TupleSerializer(inner.serializers["value"]))
        return inner, WindowImport(kind, ttl, wrap=True, sessions=True)
    if operator and kind == "list":
        if windows.record_schema is None:
            raise UnsupportedFlinkTypeError(
                f"state {name!r} holds the records of a process window function; keygroups' window operator keeps "
                "them as Arrow record batches: give FlinkWindows(record_schema=...) (the records' columns), or "
                "FlinkWindows(layout='state') to import them as a namespaced list state")
        inner = MapStateDescriptor(name, TimeWindow.serializer(), ListSerializer(BytesSerializer()))
        return inner, WindowImport(kind, ttl, record_schema=windows.record_schema, sessions=True)
    return backing_descriptor(inner, TimeWindow.serializer()), WindowImport(kind, ttl)


def merging_window_set(info_name: str, value_type: FlinkType, windows: FlinkWindows, uid: str) -> bool:
    """Whether state ``info_name`` is Flink's record of merged windows, read (not imported) by the operator layout;
    refused by name when it is not the (window, state window) pairs Flink writes."""
    if info_name != MERGING_WINDOW_SET or windows.layout != "operator":
        return False
    pair = value_type.element if isinstance(value_type, ListType) else None
    if not (isinstance(pair, TupleType) and len(pair.fields) == 2
            and all(isinstance(f, TimeWindowType) for f in pair.fields)):
        raise UnsupportedFlinkTypeError(f"operator {uid!r}: state {MERGING_WINDOW_SET!r} is {value_type!r}, not "
                                        "Flink's List(Tuple2(TimeWindow, TimeWindow)) of merged windows; skip it or "
                                        "import with FlinkWindows(layout='state')")
    return True


def session_windows(entries: list[tuple]) -> dict[tuple[Any, tuple[int, int]], tuple[int, int]]:
    """(key, state window) -> session, from one key group's ``merging-window-set`` entries."""
    return {(e[0], tuple(state_window)): tuple(session) for e in entries for session, state_window in e[2]}


# ---------------------------------------------------------------------------------------------- export

@dataclasses.dataclass
class WindowExport:
    """One keygroups namespaced state (its backing map state) as a Flink state in ``TimeWindow`` namespaces."""

    kind: str                              # the Flink kind, lower case
    unwrap: bool = False                   # the operator layout's one-part accumulator tuple
    records: bool = False                  # the operator layout's record batches, as list elements


def export_kinds(windows: FlinkWindows | None, template: Mapping[str, StateMetaInfoSnapshot],
                 present: Iterable[str]) -> dict[str, str]:
    """The keygroups states exported as window state, with their Flink kinds: ``windows.states``, else the template
    savepoint's states in ``TimeWindow`` namespaces, else ``window-contents`` as reducing."""
    present = set(present)
    if windows is not None and windows.states is not None:
        missing = set(windows.states) - present
        if missing:
            raise ValueError(f"FlinkWindows states {sorted(missing)} are not in the restore point (its keyed states: "
                             f"{sorted(present)})")
        return dict(windows.states)
    from_template = {n: m.kind.lower() for n, m in template.items() if isinstance(m.namespace_type, TimeWindowType)
                     and m.kind != "TIMER"}
    if from_template:
        return {n: k for n, k in from_template.items() if n in present}
    if windows is None:
        return {}
    if CONTENTS_STATE not in present:
        raise ValueError(f"windows= is given but the restore point has no {CONTENTS_STATE!r} state (its keyed states: "
                         f"{sorted(present)}); name its window states and their Flink kinds with "
                         "FlinkWindows(states={...})")
    return {CONTENTS_STATE: "reducing"}


def plan_export(name: str, flink_kind: str, sers: dict[str, SerializerSnapshot], windows: FlinkWindows, ttl: bool,
                template: StateMetaInfoSnapshot | None, checked: Callable[[FlinkType | None, FlinkType, str], FlinkType]
                ) -> tuple[StateMetaInfoSnapshot, FlinkType, FlinkType | None, WindowExport]:
    """Flink meta info, value type (TTL-wrapped when ``ttl``; of list elements, map values), map user key type and
    entry conversion of keygroups state ``name``, stored as the backing map of a namespaced ``flink_kind`` state."""
    what = f"window state {name!r}"
    layout, record_schema = windows.layout, windows.record_schema
    if sers["map key"].identifier != "tuple" or not sers["map key"].nested:
        raise UnsupportedFlinkTypeError(f"{what} is not a namespaced state (its map keys are not windows)")
    value_snapshot = sers["map value"]
    tt = template.value_type if template is not None else None
    if isinstance(tt, TtlType):
        tt = tt.value
    out = WindowExport(flink_kind)
    map_key_type: FlinkType | None = None
    if flink_kind == "map":
        ns, user_key = sers["map key"].nested
        _expect_window(ns, what)
        map_key_type = checked(tt.key if isinstance(tt, MapType) else None, flink_type_for(user_key, what), what)
        mv = checked(_ttl_inner(tt.value) if isinstance(tt, MapType) else None, flink_type_for(value_snapshot, what),
                     what)
        value_type: FlinkType = TtlType(mv) if ttl else mv
        full: FlinkType = MapType(map_key_type, value_type)
    else:
        _expect_window(sers["map key"], what)
        if flink_kind == "list":
            element_snapshot = value_snapshot.nested[0] if value_snapshot.identifier == "list" else None
            if element_snapshot is None:
                raise UnsupportedFlinkTypeError(f"{what}: Flink kind 'list' needs list values, the state holds "
                                                f"{value_snapshot.describe()}")
            t_element = _ttl_inner(tt.element) if isinstance(tt, ListType) else None
            if layout == "operator" and name == CONTENTS_STATE and element_snapshot.identifier == "bytes":
                # Arrow record batches: the element type is the original savepoint's, or the record schema's
                element = t_element if t_element is not None else _record_element(record_schema, what)
                out.records = True
            else:
                element = checked(t_element, flink_type_for(element_snapshot, what), what)
            value_type = TtlType(element) if ttl else element
            full = ListType(value_type)
        else:
            if (layout == "operator" and name == CONTENTS_STATE and value_snapshot.identifier == "tuple"
                    and len(value_snapshot.nested) == 1):
                value_snapshot, out.unwrap = value_snapshot.nested[0], True
                if value_snapshot.identifier == "nullable":   # Sum/Min/Max: None is no value, which Flink skips
                    value_snapshot = value_snapshot.nested[0]
            elif flink_kind == "reducing" and layout == "operator" and name == CONTENTS_STATE:
                raise UnsupportedFlinkTypeError(
                    f"{what} holds the accumulators of several aggregations {value_snapshot.describe()}; a Flink "
                    "ReducingState holds one value: export it as 'aggregating' (a Tuple accumulator)")
            v = checked(tt, flink_type_for(value_snapshot, what), what)
            value_type = full = TtlType(v) if ttl else v
    meta = StateMetaInfoSnapshot(name, "KEY_VALUE", {"KEYED_STATE_TYPE": flink_kind.upper()},
                                 {"VALUE_SERIALIZER": full, "NAMESPACE_SERIALIZER": TimeWindowType()})
    return meta, value_type, map_key_type, out


_ARROW_TO_FLINK: dict[pa.DataType, type[FlinkType]] = {
    pa.int64(): LongType, pa.int32(): IntType, pa.float64(): DoubleType, pa.bool_(): BooleanType,
    pa.string(): StringType, pa.binary(): BytesType}


def _record_element(schema: pa.Schema | None, what: str) -> FlinkType:
    """The Flink list element of keygroups' window records: one column's type, or a Tuple of the columns' types."""
    if schema is None:
        raise UnsupportedFlinkTypeError(
            f"{what} holds keygroups' window records (Arrow record batches); their Flink element type comes from the "
            "original savepoint (like=) or from FlinkWindows(record_schema=...): one column becomes its type, "
            "several a Tuple")
    fields = []
    for f in schema:
        t = _ARROW_TO_FLINK.get(f.type)
        if t is None:
            raise UnsupportedFlinkTypeError(f"{what}: record column {f.name!r} is {f.type}, which has no Flink "
                                            f"element type here (allowed: {[str(a) for a in _ARROW_TO_FLINK]})")
        fields.append(t())
    return fields[0] if len(fields) == 1 else TupleType(tuple(fields))


def _ttl_inner(t: FlinkType | None) -> FlinkType | None:
    return t.value if isinstance(t, TtlType) else t


def _expect_window(snapshot: SerializerSnapshot, what: str) -> None:
    if snapshot != TimeWindow.serializer().snapshot():
        raise UnsupportedFlinkTypeError(f"{what}: its namespaces are {snapshot.describe()}, not windows "
                                        "(TimeWindow.serializer(): a tuple of two Int64)")


def window_entries(out: WindowExport, key: Any, value: dict, key_type: FlinkType, value_type: FlinkType,
                   map_key_type: FlinkType | None, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """The Flink (key, value) pairs of one key's backing map ``value`` (namespace -> what the state holds)."""
    ns_type = TimeWindowType()
    ttl = isinstance(value_type, TtlType)
    for map_key in sorted(value, key=_window_order):
        v = value[map_key]
        window = map_key[0] if out.kind == "map" else map_key
        k = bytearray(prefix)
        encode_key(k, key, tuple(window), key_type, ns_type)
        if out.kind == "map":
            assert map_key_type is not None
            map_key_type.write(k, flink_value(map_key_type, map_key[1]))
            b = bytearray(b"\x00")
            value_type.write(b, flink_value(value_type, v))
            yield bytes(k), bytes(b)
            continue
        b = bytearray()
        if out.kind == "list":
            elements, stamp = v if ttl else (v, None)
            if out.records:
                elements = _elements(elements, _ttl_inner(value_type))
            if not elements:
                continue      # Flink holds no empty list
            encode_list_value(b, [flink_value(value_type, (e, stamp) if ttl else e) for e in elements], value_type)
        else:
            if out.unwrap:
                v = (v[0][0], v[1]) if ttl else v[0]
            if v is None or (ttl and v[0] is None):
                continue      # an empty accumulator: Flink holds no null value
            value_type.write(b, flink_value(value_type, v))
        yield bytes(k), bytes(b)


def _window_order(map_key: Any) -> Any:
    return map_key if isinstance(map_key[0], int) else (tuple(map_key[0]), map_key[1])


def _elements(parts: list[bytes], element: FlinkType | None) -> list[Any]:
    """keygroups' window record batches as Flink list elements (a Tuple or Row element from the columns)."""
    if not parts:
        return []
    table = _from_ipc(parts)
    if isinstance(element, (TupleType, RowType)):
        return [tuple(r.values()) for r in table.to_pylist()]
    if table.num_columns != 1:
        raise UnsupportedFlinkTypeError(f"window records of {table.num_columns} columns do not fit Flink's {element!r}"
                                        " list elements")
    return table.column(0).to_pylist()


def window_timer_meta(domain_state: str, key_type: FlinkType) -> tuple[StateMetaInfoSnapshot, TimerType]:
    """Flink's window timer queue for keygroups timer state ``domain_state``."""
    timer = TimerType(key_type, TimeWindowType())
    return StateMetaInfoSnapshot(FLINK_WINDOW_TIMERS[domain_state], "PRIORITY_QUEUE", {},
                                 {"VALUE_SERIALIZER": timer}), timer


def window_timers(timer: TimerType, key: Any, timestamps: Iterable[int], windows: Iterable[tuple[int, int]],
                  allowed_lateness: int, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Flink window timers of one key: each keygroups timer at a window's ``end - 1`` (its trigger) or ``end - 1 +
    allowed_lateness`` (its cleanup) becomes that window's timer; a timer of no window of the key fires nothing in
    keygroups and is left out."""
    stamps = set(timestamps)
    out = []
    for w in set(map(tuple, windows)):
        for ts in {w[1] - 1, w[1] - 1 + allowed_lateness}:
            if ts in stamps:
                out.append((ts, w))
    for ts, w in sorted(out):
        k = bytearray(prefix)
        timer.write(k, (ts, key, w))
        yield bytes(k), b""


def namespaces_of(value: dict, kind: str) -> set[tuple[int, int]]:
    """The windows of one key's backing map value."""
    if kind == "map":
        return {tuple(k[0]) for k in value}
    return {tuple(k) for k in value}


def merging_meta() -> StateMetaInfoSnapshot:
    """Flink's ``merging-window-set`` state: a list of (window, state window) pairs per key."""
    return StateMetaInfoSnapshot(MERGING_WINDOW_SET, "KEY_VALUE", {"KEYED_STATE_TYPE": "LIST"},
                                 {"VALUE_SERIALIZER": ListType(_WINDOW_PAIR),
                                  "NAMESPACE_SERIALIZER": VoidNamespaceType()})


_WINDOW_PAIR = TupleType((TimeWindowType(), TimeWindowType()))


def merging_entries(key: Any, windows: Iterable[tuple[int, int]], key_type: FlinkType, prefix: bytes
                    ) -> Iterator[tuple[bytes, bytes]]:
    """A key's ``merging-window-set`` entry: each of its sessions is its own state window."""
    pairs = [(w, w) for w in sorted(set(map(tuple, windows)))]
    if not pairs:
        return
    k = bytearray(prefix)
    encode_key(k, key, None, key_type, VoidNamespaceType())
    v = bytearray()
    encode_list_value(v, pairs, _WINDOW_PAIR)
    yield bytes(k), bytes(v)


__all__ = ["FlinkWindows", "WINDOW_TIMERS", "FLINK_WINDOW_TIMERS", "MERGING_WINDOW_SET", "WindowImport",
           "WindowExport", "plan_import", "plan_export", "export_kinds", "window_entries", "window_timer_meta",
           "window_timers", "namespaces_of", "check_namespace", "merging_window_set", "session_windows",
           "merging_meta", "merging_entries"]
