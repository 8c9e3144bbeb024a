"""``export_savepoint``: a keygroups savepoint or checkpoint as a Flink canonical savepoint directory that Flink 2.3
restores into a job whose operator has the given uid and the same state descriptors.

Per Flink subtask (the restore point's parallelism and key groups) one keyed state file is written, one key group's
block at a time (``FullSnapshotAsyncWriter``'s format, optionally Snappy-framed per key group), plus one operator
state file per subtask; ``_metadata`` (version 3) is written last. Flink types come from the keygroups serializers
(Int64 → Long, Int32 → Integer, Float64 → Double, Str → String, ...), or, given ``like`` (the Flink savepoint the state
came from), from that savepoint's own state meta info, so that Short, Byte, Float and Character states go back as
they came (values are range-checked). Record state (``RecordSerializer``) goes back as ``Row`` with RowKind (as Flink
2's ``RowTypeInfo`` makes it), fields in the record's order, nested records as nested Rows, smallint/tinyint/float as
Short/Byte/Float; with ``like``, a Row's Character, Tuple and Nullable fields come back as they were. A state Flink
cannot hold (a ``ValueSerializer`` or pickled value, a record with a date, timestamp or decimal field) and raw keyed
state are refused by name.

Per state, the compiled path (``_native/flinkout.pyx``) transcodes the stored keygroups bytes straight into Flink's
(no Python object per entry) and writes each key group's block in C; ``_fast_state`` compiles it from the state's
serializers and Flink types (window state and window timers included: ``flinkout.BlockWriter.note_windows``
records each key's windows first; sessions' ``merging-window-set`` is written from them). A state it does not take
(a process window's records, a window value that may be null, a Nullable of a Nullable) goes the Python way, ``_entries`` per decoded key; both write the same bytes (tests/test_flink_fast_export.py). A value Flink cannot
hold is refused naming the state and the key either way; corrupt stored bytes raise ``CorruptSnapshotError`` naming
the state and the key group.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import cramjam
import fsspec

from keygroups._ranges import KeyGroupRange, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.flink.keyed import (
    END_OF_KEY_GROUP,
    FIRST_BIT,
    KeyedBackendHeader,
    StateMetaInfoSnapshot,
    encode_key,
    encode_list_value,
    key_group_prefix_bytes,
    write_keyed_header,
)
from keygroups.flink.metadata import (
    KeyGroupsStateHandle,
    OperatorState,
    OperatorStateMeta,
    OperatorStreamStateHandle,
    OperatorSubtaskState,
    RelativeFileStateHandle,
    write_metadata,
)
from keygroups.flink.operator import OperatorBackendHeader, write_operator_header
from keygroups.flink.savepoint import FlinkSavepoint, operator_id_for_uid, read_savepoint
from keygroups.windows.assigners import TimeWindow
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
    TimerType,
    TtlType,
    TupleType,
    UnsupportedFlinkTypeError,
    VoidNamespaceType,
    flink_type_for,
    flink_value,
    narrow_to,
    with_record_names,
)
from keygroups.flink.windows import (
    MERGING_WINDOW_SET,
    WINDOW_TIMERS,
    FlinkWindows,
    WindowExport,
    export_kinds,
    merging_entries,
    merging_meta,
    namespaces_of,
    plan_export,
    window_entries,
    window_timer_meta,
    window_timers,
)
from keygroups._native import flinkout
from keygroups.errors import CorruptSnapshotError
from keygroups.runtime.state_reader import (
    LiveEntries,
    key_group_entries,
    load_restore_point,
    operator_state_table,
    value_framing,
)
from keygroups.runtime.state_types import reading_serializer
from keygroups.serializers import RecordSerializer, SerializerSnapshot
from keygroups.serializers import schema as rs
from keygroups.state.timers import TIMER_STATE_NAMES, TimeDomain

log = logging.getLogger("keygroups.flink")

#: keygroups' timer states → Flink's user timer queues (KeyedProcessOperator's "user-timers").
FLINK_TIMER_STATES = {TIMER_STATE_NAMES[TimeDomain.EVENT_TIME]: "_timer_state/event_user-timers",
                      TIMER_STATE_NAMES[TimeDomain.PROCESSING_TIME]: "_timer_state/processing_user-timers"}
_KINDS = {"value": "VALUE", "list": "LIST", "map": "MAP", "reducing": "REDUCING", "aggregating": "AGGREGATING"}
_I32 = struct.Struct(">i")
_U16 = struct.Struct(">H")


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """What ``export_savepoint`` wrote."""

    savepoint: str
    parallelism: int
    max_parallelism: int
    keyed_states: tuple[str, ...]
    skipped_states: tuple[str, ...]
    key_groups: int
    entries: int
    timers: int
    operator_states: tuple[str, ...]
    bytes_written: int
    seconds: float


@dataclasses.dataclass
class _Out:
    """One exported keyed state: its Flink meta info and how a keygroups value becomes Flink entries."""

    source: str                  # the keygroups state name
    meta: StateMetaInfoSnapshot
    kind: str                    # keygroups kind, or "timer"
    value_type: FlinkType        # value / list element / map value, TTL-wrapped when the state has TTL
    map_key_type: FlinkType | None = None
    timer: TimerType | None = None
    window: WindowExport | None = None   # a state in TimeWindow namespaces (keygroups.flink.windows)
    window_timers: bool = False          # timers as a WindowOperator's, one per window of the key


def _checked(template: FlinkType | None, derived: FlinkType, what: str) -> FlinkType:
    """``template`` (the original Flink type) when keygroups' values fit it, else ``derived``."""
    if template is None:
        return derived
    if narrow_to(template, derived) or template == derived:
        return with_record_names(template, derived)
    raise UnsupportedFlinkTypeError(f"{what}: the state holds {derived!r} values, which the original Flink "
                                    f"savepoint's {template!r} cannot hold; export without like=, or skip it")


def _plan(meta: dict[str, Any], key_type: FlinkType, template: StateMetaInfoSnapshot | None,
          window_kind: str | None = None, windows: FlinkWindows | None = None, window_timers: bool = False) -> _Out:
    name, kind = meta["name"], meta["kind"]
    what = f"state {name!r}"
    sers = {role: SerializerSnapshot.from_json(j) for role, j in meta["serializers"].items()}
    ttl = meta.get("ttl") is not None
    void = VoidNamespaceType()
    if name in FLINK_TIMER_STATES and window_timers:
        m, timer = window_timer_meta(name, key_type)
        return _Out(name, m, "timer", timer, timer=timer, window_timers=True)
    if window_kind is not None:     # keygroups' backing map of a namespaced state
        if kind != "map":
            raise UnsupportedFlinkTypeError(f"{what} is a {kind} state, not the map state keygroups keeps a "
                                            "namespaced (window) state in; it is not window state")
        planned = plan_export(name, window_kind, sers, windows or FlinkWindows(), ttl, template, _checked)
        return _Out(name, planned[0], "window", planned[1], planned[2], window=planned[3])
    if name in FLINK_TIMER_STATES:
        timer = TimerType(key_type, void)
        m = StateMetaInfoSnapshot(FLINK_TIMER_STATES[name], "PRIORITY_QUEUE", {}, {"VALUE_SERIALIZER": timer})
        return _Out(name, m, "timer", timer, timer=timer)
    if meta.get("namespace_serializer") is not None:
        raise UnsupportedFlinkTypeError(f"{what} is namespaced (window state); keygroups exports non-windowed keyed "
                                        "state only: skip it")
    tt = template.value_type if template is not None else None
    if kind == "list":
        element = _checked(tt.element.value if isinstance(tt, ListType) and isinstance(tt.element, TtlType)
                           else tt.element if isinstance(tt, ListType) else None,
                           flink_type_for(sers["element"], f"{what} (element)"), what)
        value_type: FlinkType = TtlType(element) if ttl else element
        full: FlinkType = ListType(value_type)
        map_key = None
    elif kind == "map":
        tv = tt.value if isinstance(tt, MapType) else None
        map_key = _checked(tt.key if isinstance(tt, MapType) else None,
                           flink_type_for(sers["map key"], f"{what} (map key)"), what)
        mv = _checked(tv.value if isinstance(tv, TtlType) else tv, flink_type_for(sers["map value"],
                                                                                  f"{what} (map value)"), what)
        value_type = TtlType(mv) if ttl else mv
        full = MapType(map_key, value_type)
    else:
        v = _checked(tt.value if isinstance(tt, TtlType) else tt, flink_type_for(sers["value"], what), what)
        value_type = full = TtlType(v) if ttl else v
        map_key = None
    m = StateMetaInfoSnapshot(name, "KEY_VALUE", {"KEYED_STATE_TYPE": _KINDS[kind]},
                              {"VALUE_SERIALIZER": full, "NAMESPACE_SERIALIZER": void})
    return _Out(name, m, kind, value_type, map_key)


def _entries(out: _Out, key: Any, value: Any, key_type: FlinkType, prefix: bytes,
             key_windows: Iterable[tuple[int, int]] = (), allowed_lateness: int = 0) -> Iterator[tuple[bytes, bytes]]:
    """The Flink (key, value) pairs of one keygroups key of one state; ``prefix`` is the key group's;
    ``key_windows``: the key's windows (window timers)."""
    void = VoidNamespaceType()
    if out.window is not None:
        yield from window_entries(out.window, key, value, key_type, out.value_type, out.map_key_type, prefix)
        return
    if out.window_timers:
        assert out.timer is not None
        yield from window_timers(out.timer, key, value, key_windows, allowed_lateness, prefix)
        return
    if out.kind == "timer":
        assert out.timer is not None
        for ts in sorted(value):
            k = bytearray(prefix)
            out.timer.write(k, (ts, key, None))
            yield bytes(k), b""
        return
    base = bytearray(prefix)
    encode_key(base, key, None, key_type, void)
    if out.kind == "map":
        assert out.map_key_type is not None
        for uk, uv in value.items():
            k = bytearray(base)
            out.map_key_type.write(k, flink_value(out.map_key_type, uk))
            v = bytearray(b"\x00")
            out.value_type.write(v, flink_value(out.value_type, uv))
            yield bytes(k), bytes(v)
        return
    if out.kind == "list" and not value:
        return          # Flink holds no empty list: ListState.update([]) clears the state
    v = bytearray()
    if out.kind == "list":
        encode_list_value(v, [flink_value(out.value_type, e) for e in value], out.value_type)
    else:
        out.value_type.write(v, flink_value(out.value_type, value))
    yield bytes(base), bytes(v)


def _block(sections: list[tuple[int, list[tuple[bytes, bytes]]]]) -> bytes:
    """One key group's block (``FullSnapshotAsyncWriter``): per state run its id, its pairs, the last pair's first
    key byte flagged, then the next id or the end mark. (The export writes blocks with ``flinkout.BlockWriter``;
    this is the reference the tests hold it to.)"""
    out = bytearray()
    for i, (state_id, pairs) in enumerate(sections):
        if i == 0:
            out += struct.pack(">h", state_id)
        for j, (k, v) in enumerate(pairs):
            if j == len(pairs) - 1:
                k = bytes([k[0] | FIRST_BIT]) + k[1:]
            out += _I32.pack(len(k)) + k + _I32.pack(len(v)) + v
        nxt = sections[i + 1][0] if i + 1 < len(sections) else END_OF_KEY_GROUP
        out += _U16.pack(nxt)
    return bytes(out)


def _python_pairs(state: str, out: _Out, meta: dict[str, Any], entries: LiveEntries, key_ser: Any,
                  key_type: FlinkType, prefix: bytes, counts: dict[str, int],
                  key_windows: dict[bytes, tuple[Any, set[tuple[int, int]]]] | None = None,
                  allowed_lateness: int = 0) -> list[tuple[bytes, bytes]]:
    """One state's Flink pairs in one key group, the Python way (``_entries`` per decoded key): for the states the
    compiled path does not take (see ``_fast_state``: window state and window timers among them), and to name the
    key of a value Flink cannot hold. ``key_windows`` (key bytes -> the key and its windows) is filled by window
    states and read by window timers."""
    keys = key_ser.deserialize_many(entries.keys, entries.key_offsets)
    framing = value_framing(meta)
    vo = entries.value_offsets.tolist()
    mv = memoryview(entries.values)
    windowed = out.window is not None or out.window_timers
    if key_windows is None:
        key_windows = {}
    ko = entries.key_offsets.tolist()
    mk = memoryview(entries.keys)
    pairs: list[tuple[bytes, bytes]] = []
    for i, key in enumerate(keys):
        value = framing.decode(mv[vo[i]:vo[i + 1]])
        try:
            if windowed:
                kb = bytes(mk[ko[i]:ko[i + 1]])
                if out.window is not None:
                    key_windows.setdefault(kb, (key, set()))[1].update(namespaces_of(value, out.window.kind))
                produced = list(_entries(out, key, value, key_type, prefix, key_windows.get(kb, (key, ()))[1],
                                         allowed_lateness))
                pairs.extend(produced)
                counts["timers" if out.window_timers else "entries"] += len(produced)
                continue
            pairs.extend(_entries(out, key, value, key_type, prefix))
        except UnsupportedFlinkTypeError:
            raise
        except (TypeError, ValueError, OverflowError) as e:   # e.g. a null list element, a double past a Float
            raise UnsupportedFlinkTypeError(
                f"state {state!r}, key {key!r}: Flink's {out.meta.serializers['VALUE_SERIALIZER']!r} "
                f"cannot hold the value {value!r}: {e}") from None
        counts["timers" if out.kind == "timer" else "entries"] += len(value) if out.kind == "timer" else 1
    return pairs


def _refusal(state: str, out: _Out, meta: dict[str, Any], entries: LiveEntries, key_ser: Any, key_type: FlinkType,
             prefix: bytes, kg: int, error: flinkout.UnrepresentableValue) -> Exception:
    """The error for a value the compiled path found Flink cannot hold: the Python path's, which names the key and
    the value (it refuses the same values), else one naming the state, key group and the key's position."""
    try:
        _python_pairs(state, out, meta, entries, key_ser, key_type, prefix, {"entries": 0, "timers": 0})
    except (UnsupportedFlinkTypeError, CorruptSnapshotError) as e:
        return e
    return UnsupportedFlinkTypeError(f"state {state!r}, key group {kg}, key #{error.index}: "
                                     f"{out.meta.serializers['VALUE_SERIALIZER']!r} cannot hold a value: {error}")


# ---- the compiled path: a flinkout.Op tree per state, from its keygroups serializers and its Flink types ----------

#: Off: every state takes the Python path (``_entries``); the tests compare the two paths' files byte for byte.
_COMPILED = True

_F = flinkout
_FLINK_SCALARS: dict[type[FlinkType], int] = {
    LongType: _F.LONG, IntType: _F.INT, ShortType: _F.SHORT, ByteType: _F.BYTE, DoubleType: _F.DOUBLE,
    FloatType: _F.FLOAT, BooleanType: _F.BOOLEAN, CharType: _F.CHAR, StringType: _F.STRING, BytesType: _F.BYTE_ARRAY}
_CODEC_SCALARS = {"int64": _F.I64, "int32": _F.I32, "float64": _F.F64, "bool": _F.BOOL, "str": _F.STR,
                  "bytes": _F.BYTES}
_RECORD_SCALARS = {rs.INT8: _F.I8, rs.INT16: _F.I16, rs.INT32: _F.I32, rs.INT64: _F.I64, rs.FLOAT32: _F.F32,
                   rs.FLOAT64: _F.F64, rs.BOOL: _F.BOOL, rs.STRING: _F.STR, rs.BINARY: _F.BYTES}
_INTS = frozenset({_F.I8, _F.I16, _F.I32, _F.I64})


class _NotCompiled(Exception):
    """A serializer pairing the compiled path does not take: the state goes the Python way."""


@dataclasses.dataclass(frozen=True)
class _Source:
    """How keygroups stored one position: a flinkout source kind, behind a null flag or not, and its parts."""

    kind: int
    nullable: bool = False
    parts: tuple[_Source, ...] = ()


def _codec_source(snapshot: SerializerSnapshot) -> _Source:
    ident = snapshot.identifier
    if ident in _CODEC_SCALARS:
        return _Source(_CODEC_SCALARS[ident])
    nested = snapshot.nested
    if ident == "nullable":
        inner = _codec_source(nested[0])
        if inner.nullable:
            raise _NotCompiled("a Nullable of a Nullable")
        return dataclasses.replace(inner, nullable=True)
    if ident in ("tuple", "list", "map"):
        kind = {"tuple": _F.TUPLE, "list": _F.LIST, "map": _F.MAP}[ident]
        return _Source(kind, parts=tuple(_codec_source(n) for n in nested))
    if ident == RecordSerializer.identifier and snapshot.version == RecordSerializer.version:
        return _Source(_F.EXTERNAL, parts=(_record_source(_record_schema(snapshot), False),))   # u32 length first
    raise _NotCompiled(snapshot.describe())


def _record_schema(snapshot: SerializerSnapshot) -> rs.RecordType:
    return rs.RecordType.from_json(snapshot.config.get("schema"))


def _record_source(t: rs.DataType, nullable: bool) -> _Source:
    if t in _RECORD_SCALARS:
        return _Source(_RECORD_SCALARS[t], nullable)
    if isinstance(t, rs.ListType):
        return _Source(_F.LIST, nullable, (_record_source(t.element, t.element_nullable),))
    if isinstance(t, rs.MapType):
        return _Source(_F.MAP, nullable, (_record_source(t.key, False), _record_source(t.value, t.value_nullable)))
    if isinstance(t, rs.RecordType):
        return _Source(_F.RECORD, nullable, tuple(_record_source(f.type, f.nullable) for f in t.fields))
    raise _NotCompiled(t.ddl())


def _top_source(snapshot: SerializerSnapshot) -> _Source:
    """A whole stored value (a key, a value, an element, a map key or value): a record is its fields, unframed."""
    if snapshot.identifier == RecordSerializer.identifier and snapshot.version == RecordSerializer.version:
        return _record_source(_record_schema(snapshot), False)
    return _codec_source(snapshot)


def _null_mode(t: FlinkType, position: str) -> int:
    """What a null becomes where ``t`` is written: a Row's mask bit and a Map value's flag are the parent's; a
    Tuple field refuses it; elsewhere Flink's serializer writes it (Nullable, String) or refuses it."""
    if position == "parent":
        return _F.NULL_TO_PARENT
    if position == "tuple":
        return _F.NULL_REFUSED
    if isinstance(t, NullableType):
        return _F.NULL_AS_NULLABLE
    return _F.NULL_AS_STRING if isinstance(t, StringType) else _F.NULL_REFUSED


def _compile(src: _Source, t: FlinkType, position: str = "", whole: bool = False) -> flinkout.Op:
    """The Op writing ``src``'s values as ``t`` writes them (``t.write(flink_value(t, value))``)."""
    common: dict[str, Any] = {"src_nullable": src.nullable, "null_mode": _null_mode(t, position), "what": repr(t)}
    target = t
    if isinstance(t, NullableType):
        target = t.inner
        common.update(dst_nullable=True, padding=t.padding)
        if isinstance(target, NullableType):
            raise _NotCompiled("a Nullable of a Nullable")
    if src.kind == _F.EXTERNAL:
        return _F.Op(_F.EXTERNAL, _F.DELEGATE, (_compile(src.parts[0], target),), **common)
    kind = _FLINK_SCALARS.get(type(target))
    if kind is not None:
        ok = {_F.LONG: _INTS, _F.INT: _INTS, _F.SHORT: _INTS, _F.BYTE: _INTS, _F.DOUBLE: {_F.F32, _F.F64},
              _F.FLOAT: {_F.F32, _F.F64}, _F.BOOLEAN: {_F.BOOL}, _F.CHAR: {_F.STR}, _F.STRING: {_F.STR},
              _F.BYTE_ARRAY: {_F.BYTES}}[kind]
        if src.kind not in ok:
            raise _NotCompiled(f"{src} as {t!r}")
        return _F.Op(src.kind, kind, whole=whole and src.kind in (_F.STR, _F.BYTES) and not src.nullable,
                     **common)
    if isinstance(target, (TupleType, RowType)) and src.kind in (_F.TUPLE, _F.RECORD) \
            and len(src.parts) == len(target.fields):
        row = isinstance(target, RowType)
        fields = tuple(_compile(s, f, "parent" if row else "tuple") for s, f in zip(src.parts, target.fields))
        return _F.Op(src.kind, _F.ROW if row else _F.FLINK_TUPLE, fields,
                     row_kind=target.supports_row_kind if isinstance(target, RowType) else True, **common)
    if isinstance(target, ListType) and src.kind == _F.LIST:
        return _F.Op(_F.LIST, _F.FLINK_LIST, (_compile(src.parts[0], target.element),), **common)
    if isinstance(target, MapType) and src.kind == _F.MAP:
        return _F.Op(_F.MAP, _F.FLINK_MAP, (_compile(src.parts[0], target.key),
                                            _compile(src.parts[1], target.value, "parent")), **common)
    raise _NotCompiled(f"{src} as {t!r}")


def _fast_state(out: _Out, meta: dict[str, Any], key_type: FlinkType, allowed_lateness: int = 0
                ) -> flinkout.StateTranscoder | None:
    """The compiled transcoder of one state's entries stored with ``meta``'s serializers, or None when the state
    takes the Python path (a pairing the compiled path does not take, see ``_fast_window``). Window state and
    window timers are compiled (``allowed_lateness`` places the cleanup timers)."""
    if not _COMPILED or meta.get("namespace_serializer") is not None or out.kind == "merging":
        return None
    try:
        sers = {role: SerializerSnapshot.from_json(j) for role, j in meta["serializers"].items()}
        key = _compile(_top_source(sers["key"]), key_type, whole=True)
        if out.window_timers:
            if sers["map key"].identifier != "int64" or sers["map value"].identifier != "bool":
                return None
            return _F.StateTranscoder(_F.WINDOW_TIMER_STATE, key, allowed_lateness=allowed_lateness)
        if out.window is not None:
            return _fast_window(out, sers, key, meta.get("ttl") is not None)
        if out.kind == "timer":
            if sers["map key"].identifier != "int64" or sers["map value"].identifier != "bool":
                return None
            return _F.StateTranscoder(_F.TIMER_STATE, key)
        ttl = meta.get("ttl") is not None
        value_type = out.value_type
        if ttl != isinstance(value_type, TtlType):
            return None
        if isinstance(value_type, TtlType):
            value_type = value_type.value
        if out.kind == "map":
            assert out.map_key_type is not None
            return _F.StateTranscoder(
                _F.MAP_STATE, key, _compile(_top_source(sers["map value"]), value_type, whole=True),
                _compile(_top_source(sers["map key"]), out.map_key_type, whole=True), ttl=ttl)
        role, kind = ("element", _F.LIST_STATE) if out.kind == "list" else ("value", _F.VALUE_STATE)
        return _F.StateTranscoder(kind, key, _compile(_top_source(sers[role]), value_type, whole=True), ttl=ttl)
    except (_NotCompiled, KeyError, ValueError) as e:
        log.debug("state %r takes the Python export path: %s", out.source, e)
        return None


def _fast_window(out: _Out, sers: dict[str, SerializerSnapshot], key: flinkout.Op, ttl: bool
                 ) -> flinkout.StateTranscoder | None:
    """A namespaced state's transcoder: window -> value (the operator layout's one-part accumulator unwrapped: a
    Flink Tuple1 is its field's bytes) or list, (window, user key) -> value. None for what the Python path keeps:
    records, a value that may be null (Flink holds none: the Python path leaves it out), user keys other than
    str, bytes, int64 and int32 (their order is Python's)."""
    assert out.window is not None
    value_type = out.value_type
    if out.window.records or ttl != isinstance(value_type, TtlType):
        return None
    if isinstance(value_type, TtlType):
        value_type = value_type.value
    value = sers["map value"]
    window = TimeWindow.serializer().snapshot()
    if out.window.kind == "map":
        namespace, user_key = sers["map key"].nested
        order = _USER_KEY_ORDER.get(user_key.identifier)
        if namespace != window or order is None or out.map_key_type is None:
            return None
        return _F.StateTranscoder(_F.WINDOW_MAP_STATE, key, _compile(_top_source(value), value_type, whole=True),
                                  _compile(_codec_source(user_key), out.map_key_type), ttl=ttl,
                                  user_key_order=order)
    if sers["map key"] != window:
        return None
    if out.window.kind == "list":
        if value.identifier != "list" or value.nested[0].identifier == "nullable":
            return None
        return _F.StateTranscoder(_F.WINDOW_LIST_STATE, key, _compile(_codec_source(value.nested[0]), value_type),
                                  ttl=ttl)
    inner = value.nested[0] if out.window.unwrap else value
    if inner.identifier == "nullable":
        return None
    target = TupleType((value_type,)) if out.window.unwrap else value_type
    return _F.StateTranscoder(_F.WINDOW_STATE, key, _compile(_top_source(value), target, whole=True), ttl=ttl)


#: How a window map state's user keys sort, as Python sorts them (by their keygroups codec bytes).
_USER_KEY_ORDER = {"str": _F.USER_KEY_UTF8, "bytes": _F.USER_KEY_UTF8, "int64": _F.USER_KEY_I64,
                   "int32": _F.USER_KEY_I32}


def _key_type(meta: dict[str, Any], template: FlinkType | None) -> FlinkType:
    derived = flink_type_for(SerializerSnapshot.from_json(meta["serializers"]["key"]), "the job's key")
    return _checked(template, derived, "the job's key")


def _check_uid(uid: Any, what: str) -> None:
    if not isinstance(uid, str):
        raise TypeError(f"{what} must be the Flink operator's uid (a str), got {uid!r}")
    if not uid.strip():
        raise ValueError(f"{what} {uid!r} is empty: give the uid the Flink job sets on the operator "
                         "(.uid(\"...\")), which Flink matches the state by")


def _check_empty_destination(fs: Any, root: str, dest: str) -> None:
    """Refuse a ``dest`` that is a file or a directory with anything in it: a Flink savepoint directory holds only
    its own files, and an export never overwrites or mixes with others."""
    if not fs.exists(root):
        return
    if not fs.isdir(root):
        raise ValueError(f"{dest} exists and is not a directory; give a new or empty directory for the Flink "
                         "savepoint")
    present = fs.ls(root, detail=False)
    if present:
        what = "a savepoint (_metadata exists)" if any(p.rstrip("/").endswith("/_metadata") for p in present) \
            else f"{len(present)} entries"
        raise ValueError(f"{dest} already holds {what}; give a new or empty directory for the Flink savepoint "
                         "(nothing was written)")


def _remove_partial(fs: Any, root: str, created: bool) -> None:
    try:
        if created:
            fs.rm(root, recursive=True)
        else:
            for path in fs.ls(root, detail=False):
                fs.rm(path, recursive=True)
    except OSError as e:
        log.warning("could not remove the files of the failed export in %s: %s", root, e)


def export_savepoint(location: str, dest: str | os.PathLike, *, uid: str, savepoint: str | None = None,
                     checkpoint_id: int | None = None, operator_state_uid: str | None = None,
                     like: str | os.PathLike | FlinkSavepoint | None = None, skip_states: Iterable[str] = (),
                     compression: bool = False, windows: FlinkWindows | None = None,
                     allow_paths_outside: bool = False,
                     storage_options: dict[str, Any] | None = None) -> ExportReport:
    """Write keygroups savepoint ``savepoint`` (or checkpoint ``checkpoint_id``, or the latest checkpoint) of
    ``location`` as a Flink canonical savepoint in directory ``dest`` for operator ``uid`` (operator state under
    ``operator_state_uid`` when given). ``like``: the Flink savepoint the state came from, whose types are kept;
    ``compression``: Snappy key-group blocks (Flink's snapshot compression). ``windows``
    (``keygroups.flink.windows.FlinkWindows``): which states are window state (keygroups keeps a namespaced state as
    a map state, so only this or ``like``'s states in ``TimeWindow`` namespaces tell), and the timers then become a
    Flink ``WindowOperator``'s window timers. ``dest`` must be new or an empty directory; nothing is written when
    anything is refused. ``allow_paths_outside``: read ``like``'s state files outside its directory (see
    ``read_savepoint``)."""
    started = time.perf_counter()
    _check_uid(uid, "uid")
    if operator_state_uid is not None:
        _check_uid(operator_state_uid, "operator_state_uid")
    dest = os.fspath(dest)
    fs, root = fsspec.core.url_to_fs(dest)
    _check_empty_destination(fs, root, dest)
    storage = CheckpointStorage(location, storage_options=storage_options)
    md = load_restore_point(storage, checkpoint_id=checkpoint_id, savepoint=savepoint)
    if md.raw_keyed_handles:
        raise UnsupportedFlinkTypeError("the restore point holds raw keyed state (written by the job's function in "
                                        "keygroups' own format), which a Flink operator cannot restore")
    template = like if isinstance(like, FlinkSavepoint) or like is None else read_savepoint(
        like, allow_paths_outside=allow_paths_outside)
    t_header = template.keyed_header(uid) if template is not None else None
    t_states = {m.name: m for m in t_header.states} if t_header is not None else {}
    skip = set(skip_states)
    metas: dict[str, dict[str, Any]] = {}
    for h in md.keyed_handles:
        for m in h.states:
            metas.setdefault(m["name"], m)
    plans: list[_Out] = []
    skipped = []
    key_type: FlinkType | None = None
    window_kinds = export_kinds(windows, t_states, set(metas) - skip)
    t_timers = {n for n, m in t_states.items() if m.kind == "TIMER"}
    as_window_timers = bool(t_timers & set(WINDOW_TIMERS)) if t_timers else bool(window_kinds)
    if metas:
        key_type = _key_type(next(iter(metas.values())), t_header.key_type if t_header is not None else None)
        for name, meta in metas.items():
            if name in skip:
                skipped.append(name)
                continue
            flink_name = FLINK_TIMER_STATES.get(name, name)
            plans.append(_plan(meta, key_type, t_states.get(flink_name), window_kinds.get(name), windows,
                               as_window_timers))
    merging = (windows is not None and windows.merging) or MERGING_WINDOW_SET in t_states
    if window_kinds and merging and MERGING_WINDOW_SET not in metas:   # sessions: Flink's record of them
        m = merging_meta()
        plans.append(_Out(MERGING_WINDOW_SET, m, "merging", m.value_type))
    unknown = skip - set(metas) - {n for h in md.operator_handles for n in h.states}
    if unknown:
        raise ValueError(f"skip_states names {sorted(unknown)}, which the restore point does not have")
    plans.sort(key=lambda o: (o.kind == "timer", o.source))
    by_source = {o.source: (i, o) for i, o in enumerate(plans)}
    mp, p = md.max_parallelism, md.parallelism
    prefix_bytes = key_group_prefix_bytes(mp)
    counts = {"key_groups": 0, "entries": 0, "timers": 0, "bytes": 0}
    keyed: dict[int, KeyGroupsStateHandle] = {}
    created = not fs.exists(root)
    fs.makedirs(root, exist_ok=True)
    try:
        if plans:
            assert key_type is not None
            header = KeyedBackendHeader(compression, key_type, tuple(o.meta for o in plans))
            key_ser = reading_serializer(
                SerializerSnapshot.from_json(next(iter(metas.values()))["serializers"]["key"]))
            for subtask in range(p):
                groups = key_group_range(mp, p, subtask)
                keyed[subtask] = _write_keyed_file(fs, root, storage, md, groups, header, by_source, key_ser,
                                                   key_type, prefix_bytes, counts,
                                                   windows.allowed_lateness if windows is not None else 0)

        op_states: dict[int, OperatorStreamStateHandle] = {}
        op_names: list[str] = []
        t_op = template if template is not None else None
        if md.operator_handles:
            op_states, op_names = _write_operator_files(fs, root, storage, md, skip, t_op,
                                                        operator_state_uid or uid, counts)

        operators = []
        separate = operator_state_uid is not None and operator_state_uid != uid
        subtasks = []
        for i in range(p):
            subtasks.append(OperatorSubtaskState(i, None if separate else op_states.get(i), None, keyed.get(i),
                                                 None))
        operators.append(OperatorState(operator_id_for_uid(uid), None, uid, p, mp, tuple(subtasks)))
        if separate and op_states:
            n = max(op_states) + 1
            operators.append(OperatorState(operator_id_for_uid(operator_state_uid), None, operator_state_uid,
                                           max(n, 1), mp, tuple(OperatorSubtaskState(i, h, None, None, None)
                                                                for i, h in sorted(op_states.items()))))
        elif op_states and max(op_states) >= p:
            raise ValueError(f"operator state of subtask {max(op_states)} in a restore point of parallelism {p}")
        data = write_metadata(md.checkpoint_id, operators)
        with fs.open(f"{root}/_metadata.inprogress", "wb") as f:
            f.write(data)
        fs.mv(f"{root}/_metadata.inprogress", f"{root}/_metadata")
    except BaseException:
        _remove_partial(fs, root, created)   # the directory was new or empty: nothing of a failed export stays
        raise
    report = ExportReport(dest, p, mp, tuple(o.source for o in plans if o.kind != "timer"), tuple(skipped),
                          counts["key_groups"], counts["entries"], counts["timers"], tuple(op_names),
                          counts["bytes"] + len(data), time.perf_counter() - started)
    log.info("exported %s of %s as Flink savepoint %s: %d key groups, %d entries, %d timers", savepoint or
             f"checkpoint {md.checkpoint_id}", location, dest, report.key_groups, report.entries, report.timers)
    return report


def _write_keyed_file(fs: Any, root: str, storage: CheckpointStorage, md: CheckpointMetadata, groups: KeyGroupRange,
                      header: KeyedBackendHeader, by_source: dict[str, tuple[int, _Out]], key_ser: Any,
                      key_type: FlinkType, prefix_bytes: int, counts: dict[str, int],
                      allowed_lateness: int = 0) -> KeyGroupsStateHandle:
    name = str(uuid.uuid4())
    offsets = [0] * (groups.end - groups.start + 1)
    head = bytearray()
    write_keyed_header(head, header)
    pos = len(head)
    builder = flinkout.BlockWriter(prefix_bytes)
    fast: dict[int, tuple[dict[str, Any], flinkout.StateTranscoder | None]] = {}   # id(meta) -> its fast path
    merging = by_source.get(MERGING_WINDOW_SET)
    with fs.open(f"{root}/{name}", "wb") as f:
        f.write(head)
        for kg, live in key_group_entries(storage, md, groups):   # one key group in memory at a time
            prefix = kg.to_bytes(prefix_bytes, "big")
            builder.start(kg)
            present = {by_source[s][0]: (s, e) for s, e in live.items() if s in by_source}
            transcoders = {}
            for state_id, (state, (meta, entries)) in present.items():
                cached = fast.get(id(meta))
                if cached is None:
                    cached = fast[id(meta)] = (meta, _fast_state(by_source[state][1], meta, key_type,
                                                                 allowed_lateness))
                transcoders[state_id] = cached[1]
            # Window state first: its keys' windows decide their window timers and session list, whose state ids
            # may come before or after it (a block's states go in id order). Compiled, the BlockWriter notes them;
            # else the Python way, and then window timers go that way too (they read key_windows).
            windowed = {i: by_source[s][1] for i, (s, _) in present.items()
                        if by_source[s][1].window is not None or by_source[s][1].window_timers}
            compiled_windows = all(transcoders[i] is not None for i in windowed)
            key_windows: dict[bytes, tuple[Any, set[tuple[int, int]]]] = {}   # key bytes -> key, its windows
            ready: dict[int, list[tuple[bytes, bytes]]] = {}
            for state_id, (state, (meta, entries)) in sorted(present.items()):
                out = by_source[state][1]
                if out.window is None:
                    continue
                noted = transcoders[state_id] if compiled_windows else None
                if noted is not None:
                    try:
                        builder.note_windows(noted, entries.keys, entries.key_offsets, entries.values,
                                             entries.value_offsets)
                    except CorruptSnapshotError as e:
                        raise CorruptSnapshotError(f"state {state!r}, key group {kg}: {e}") from None
                else:
                    ready[state_id] = _python_pairs(state, out, meta, entries, key_ser, key_type, prefix, counts,
                                                    key_windows, allowed_lateness)
            sessions = merging is not None and merging[1].kind == "merging"
            window_key = next((transcoders[i].key for i, o in windowed.items()       # type: ignore[union-attr]
                               if o.window is not None), None) if compiled_windows else None
            if sessions and window_key is None:
                ready[merging[0]] = [pair for kb, (key, ws) in sorted(key_windows.items())
                                     for pair in merging_entries(key, ws, key_type, prefix)]
            for state_id in sorted(present.keys() | ready.keys() | ({merging[0]} if sessions else set())):
                if state_id in ready:
                    builder.add_pairs(state_id, ready[state_id])
                    continue
                if sessions and state_id == merging[0]:   # the windows noted above, compiled
                    if window_key is not None:
                        builder.add_merging(state_id, window_key)
                    continue
                state, (meta, entries) = present[state_id]
                out = by_source[state][1]
                transcoder = transcoders[state_id] if compiled_windows or state_id not in windowed else None
                try:
                    if transcoder is None:
                        builder.add_pairs(state_id, _python_pairs(state, out, meta, entries, key_ser, key_type,
                                                                  prefix, counts, key_windows, allowed_lateness))
                        continue
                    keys, timers = builder.add_state(state_id, transcoder, entries.keys, entries.key_offsets,
                                                     entries.values, entries.value_offsets)
                except CorruptSnapshotError as e:
                    raise CorruptSnapshotError(f"state {state!r}, key group {kg}: {e}") from None
                except flinkout.UnrepresentableValue as e:
                    raise _refusal(state, out, meta, entries, key_ser, key_type, prefix, kg, e) from None
                counts["entries"] += keys
                counts["timers"] += timers
            block = builder.finish()
            if block is None:
                continue
            if header.compression:
                block = bytes(cramjam.snappy.compress(block))
            offsets[kg - groups.start] = pos
            f.write(block)
            pos += len(block)
            counts["key_groups"] += 1
    counts["bytes"] += pos
    return KeyGroupsStateHandle(groups.start, tuple(offsets), RelativeFileStateHandle(name, pos), savepoint=True)


def _write_operator_files(fs: Any, root: str, storage: CheckpointStorage, md: CheckpointMetadata, skip: set[str],
                          template: FlinkSavepoint | None, op_uid: str, counts: dict[str, int]
                          ) -> tuple[dict[int, OperatorStreamStateHandle], list[str]]:
    names = sorted({n for h in md.operator_handles for n in h.states} - skip)
    t_types: dict[str, Any] = {}
    if template is not None:
        try:
            t_types = {s.name: s for s in template.states(op_uid) if not s.keyed}
        except KeyError:
            t_types = {}
    per_subtask: dict[int, dict[str, tuple[str, list[Any]]]] = {}
    metas: dict[str, StateMetaInfoSnapshot] = {}
    for name in names:
        table = operator_state_table(storage, md, name)
        meta = next(h.states[name] for h in md.operator_handles if name in h.states)
        mode = meta.mode.value
        what = f"operator state {name!r}"
        tt = t_types.get(name)
        if mode == "BROADCAST":
            kt = _checked(tt.key_type if tt else None,
                          flink_type_for(SerializerSnapshot.from_json(meta.serializers["key_serializer"]), what), what)
            vt = _checked(tt.value_type if tt else None,
                          flink_type_for(SerializerSnapshot.from_json(meta.serializers["value_serializer"]), what),
                          what)
            metas[name] = StateMetaInfoSnapshot(name, "BROADCAST", {"OPERATOR_STATE_DISTRIBUTION_MODE": mode},
                                                {"KEY_SERIALIZER": kt, "VALUE_SERIALIZER": vt})
        else:
            vt = _checked(tt.value_type if tt else None,
                          flink_type_for(SerializerSnapshot.from_json(meta.serializers["serializer"]), what), what)
            metas[name] = StateMetaInfoSnapshot(name, "OPERATOR", {"OPERATOR_STATE_DISTRIBUTION_MODE": mode},
                                                {"VALUE_SERIALIZER": vt})
        for row in table.to_pylist():
            slot = per_subtask.setdefault(row["subtask"], {}).setdefault(name, (mode, []))
            slot[1].append((row["key"], row["value"]) if mode == "BROADCAST" else row["value"])
    handles = {}
    for subtask, states in sorted(per_subtask.items()):
        header = OperatorBackendHeader(False, {n: m for n, m in metas.items() if m.backend_type == "OPERATOR"},
                                       {n: m for n, m in metas.items() if m.backend_type == "BROADCAST"})
        data = bytearray()
        write_operator_header(data, header)
        offsets: dict[str, OperatorStateMeta] = {}
        for name in [*header.states, *header.broadcast_states]:
            mode, values = states.get(name, (metas[name].kind, []))
            m = metas[name]
            if mode == "BROADCAST":
                at = len(data)
                data += _I32.pack(len(values))
                kt, vt = m.serializers["KEY_SERIALIZER"], m.value_type
                for k, v in values:
                    kt.write(data, flink_value(kt, k))
                    vt.write(data, flink_value(vt, v))
                offsets[name] = OperatorStateMeta(mode, (at,))
            else:
                element_offsets = []
                for v in values:
                    element_offsets.append(len(data))
                    m.value_type.write(data, flink_value(m.value_type, v))
                offsets[name] = OperatorStateMeta(mode, tuple(element_offsets))
        file = str(uuid.uuid4())
        with fs.open(f"{root}/{file}", "wb") as f:
            f.write(data)
        counts["bytes"] += len(data)
        handles[subtask] = OperatorStreamStateHandle(offsets, RelativeFileStateHandle(file, len(data)))
    return handles, names
