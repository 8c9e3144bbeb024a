"""``import_savepoint``: one Flink operator's state (keyed state, TTL, timers, operator state) as a keygroups
savepoint ``LOCATION/savepoints/NAME/`` that ``KeyedJob(..., restore_from_savepoint=NAME)`` continues from.

Same max parallelism and key groups (keygroups' key groups are Flink's, bit for bit); one keyed file per Flink
subtask, written one key group at a time with the checkpoint layer's full snapshot writer; states keep their Flink
names. Flink's user timers become keygroups' timers of the same domain; Flink values map to keygroups serializers
(``state_serializer``): Short/Byte as Int32, Float as Float64, Character as a one-character str; a Row as a record
(``RecordSerializer``: Flink stores no field names, so f0, f1, ... unless ``field_names`` names them; every field
nullable; Short/Byte/Float keep their width as smallint/tinyint/float); a TupleN as a record too, its fields f0, f1,
... as Flink's Tuple classes name them (or ``field_names``), never null unless Flink's field serializer is a Nullable
one. Tuples stay tuples (``TupleSerializer``) in a map's keys and in window state, whose values are
``keygroups.windows``' accumulators.

Keyed state is imported compiled (``keygroups.flink.transcode``, ``_native/flinkin.pyx``): each block is scanned once
and every state's entries go from Flink's bytes straight to the bytes those serializers write, framed, grouped per
key and sorted, with no Python object per entry (window state and window timers included). A state it cannot
compile (sessions' contents, a process window's records as Arrow batches) goes through ``_plan``/
``_encode`` (decode to Python values, encode them), which also serve as its reference in tests.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from keygroups._native import flinkin
from keygroups._ranges import KeyGroupRange, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.checkpoint.format import Packed, write_full_snapshot
from keygroups.checkpoint.metadata import DEFAULT_OPERATOR_ID, DistributionMode
from keygroups.checkpoint.operator_format import SerializedState, write_operator_snapshot
from keygroups.errors import CorruptSnapshotError, StateSerializationError
from keygroups.flink._cursor import plain, shown
from keygroups.flink.savepoint import FlinkSavepoint, FlinkStateInfo, decode_entries, read_savepoint
from keygroups.flink.transcode import NotCompiled, state_plan
from keygroups.flink.types import (
    BooleanType,
    ByteType,
    BytesType,
    DoubleType,
    FlinkType,
    FloatType,
    IntType,
    LongType,
    RowType,
    ShortType,
    StringType,
    TtlValue,
    TupleType,
    UnsupportedFlinkTypeError,
    VoidNamespaceType,
    state_serializer,
)
from keygroups.flink.windows import (
    MERGING_WINDOW_SET,
    WINDOW_TIMERS,
    FlinkWindows,
    WindowImport,
    check_namespace,
    merging_window_set,
    plan_import,
    session_windows,
)
from keygroups._native.statecore import java_key
from keygroups.runtime.backends import key_serializer_for
from keygroups.serializers import TypeSerializer
from keygroups.runtime.state_writer import _descriptor as state_descriptor
from keygroups.state import StateDescriptor, StateTtlConfig, state_meta
from keygroups.state._codec import ValueFraming
from keygroups.state.timers import NO_WATERMARK, TimeDomain, check_timestamp, timer_descriptor

log = logging.getLogger("keygroups.flink")

#: Flink's user timer queues (KeyedProcessOperator's timer service "user-timers") → keygroups' timer domains.
USER_TIMERS = {"_timer_state/event_user-timers": TimeDomain.EVENT_TIME,
               "_timer_state/processing_user-timers": TimeDomain.PROCESSING_TIME}
#: Flink does not store a TTL's duration in a savepoint; imported TTL states get this one unless told otherwise.
DEFAULT_TTL_MS = 7 * 24 * 3600 * 1000

_KEY_TYPES: dict[type[FlinkType], str] = {
    LongType: "long", IntType: "int", ShortType: "short", ByteType: "byte", BooleanType: "boolean",
    DoubleType: "double", FloatType: "float", StringType: "string", BytesType: "bytes"}


@dataclasses.dataclass(frozen=True)
class ImportReport:
    """What ``import_savepoint`` wrote."""

    savepoint: str                     # the keygroups savepoint written: LOCATION/savepoints/NAME
    max_parallelism: int               # Flink's, kept: the key groups are Flink's
    parallelism: int                   # Flink's: one keyed file per Flink subtask (a job restores at any)
    keyed_states: tuple[str, ...]      # the keyed states imported, by their Flink names (timer queues not listed)
    skipped_states: tuple[str, ...]    # the states left out (skip_states)
    timers: int                        # event- and processing-time timers imported (window timers included)
    entries: int                       # Flink entries imported: one per key of a value or list state, one per
                                       # user key of a map state (per window for window state)
    key_groups: int                    # non-empty key groups written
    operator_states: tuple[str, ...]   # the operator states imported
    bytes_read: int                    # bytes of Flink state read (state files and inline handles)
    seconds: float                     # wall time of the import
    watermark: int | None = None       # the watermark the first batch starts from (None: no event time yet)


def parse_watermark(value: int | datetime.datetime | str, what: str = "watermark") -> int:
    """A watermark as epoch milliseconds: an int (or a string of one), a ``datetime``, or an ISO 8601 time
    (``2026-11-26T10:00:00Z``, ``2026-11-26 10:00:00.250+01:00``); a time without a zone is UTC, as Spark's
    timestamps are. Flink's savepoint holds no watermark, so a job continuing it is told where event time stands."""
    if isinstance(value, str):
        text = value.strip()
        if text.lstrip("-").isdigit():
            value = int(text)
        else:
            try:
                value = datetime.datetime.fromisoformat(text)
            except ValueError:
                raise ValueError(f"{what} {value!r} is neither epoch milliseconds (e.g. 1795681600000) nor an ISO "
                                 "8601 time (e.g. 2026-11-26T10:00:00Z)") from None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        delta = value - _EPOCH
        value = delta.days * 86_400_000 + delta.seconds * 1000 + delta.microseconds // 1000
    if isinstance(value, datetime.date):
        raise TypeError(f"{what} must be epoch milliseconds, a datetime or an ISO time, got the date {value!r} "
                        "(a date has no time of day: give a datetime)")
    timestamp = check_timestamp(value, what)
    if timestamp == NO_WATERMARK:
        raise ValueError(f"{what} {timestamp} is Long.MIN_VALUE, which means no watermark: leave it out instead")
    return timestamp


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def key_type_of(t: FlinkType) -> Any:
    """The keygroups key type (``KeyedJob``'s hashing) of a Flink key serializer; Tuple keys become tuples."""
    if isinstance(t, TupleType):
        return tuple(key_type_of(f) for f in t.fields)
    name = _KEY_TYPES.get(type(t))
    if name is None:
        raise UnsupportedFlinkTypeError(f"the job is keyed by {t!r}, which keygroups does not hash as Flink does; "
                                        "key it by a basic type, String or a Tuple of them")
    return name


def _plain(t: FlinkType, v: Any) -> Any:
    """A Flink value as its keygroups serializer takes it (TTL unwrapped by the caller)."""
    if isinstance(t, TupleType):
        return tuple(_plain(f, x) for f, x in zip(t.fields, v))
    return v


@dataclasses.dataclass
class _State:
    info: FlinkStateInfo
    index: int
    kind: str                          # keygroups kind
    descriptor: StateDescriptor
    framing: ValueFraming
    value_type: FlinkType              # of the value, list element or map value (TTL unwrapped)
    map_key_type: FlinkType | None = None
    domain: TimeDomain | None = None
    window: WindowImport | None = None   # a state in TimeWindow namespaces (keygroups.flink.windows)


def _named(t: FlinkType, names: Sequence[str] | None, what: str) -> FlinkType:
    """``t`` with the user's field names when given (only a Row or a Tuple takes them)."""
    if names is None:
        return t
    if not isinstance(t, (RowType, TupleType)):
        raise ValueError(f"field_names gives names for {what}, whose values are {t!r}, not a Row or Tuple: only "
                         "their fields are named")
    if isinstance(names, str):
        raise TypeError(f"field_names for {what} must be a list of names, got the string {names!r}")
    try:
        return t.with_names(tuple(names))
    except ValueError as e:
        raise ValueError(f"field_names for {what}: {e}") from None


def _value_of(info: FlinkStateInfo) -> FlinkType:
    """The type of a state's value, list element or map value, its TTL unwrapped."""
    vt = info.value_type
    if info.kind == "LIST":
        vt = vt.element                       # type: ignore[attr-defined]
    elif info.kind == "MAP":
        vt = vt.value                         # type: ignore[attr-defined]
    return vt.value if info.ttl else vt       # type: ignore[attr-defined]


def _plan(info: FlinkStateInfo, index: int, ttl_ms: int, names: Sequence[str] | None = None,
          windows: FlinkWindows | None = None) -> _State:
    what = f"state {shown(info.name)}"
    if info.kind == "TIMER":
        domain = USER_TIMERS.get(info.name)
        if domain is not None and not isinstance(info.namespace_type, VoidNamespaceType):
            raise UnsupportedFlinkTypeError(f"{what}: timers in namespace {info.namespace_type!r} are not imported")
        if domain is None:   # a window's timers fire the key's windows in keygroups: the namespace is dropped
            domain = WINDOW_TIMERS.get(info.name)
            check_namespace(info.namespace_type, what)
        if domain is None:
            raise UnsupportedFlinkTypeError(f"{what}: timer queue {shown(info.name)} is neither a "
                                            "KeyedProcessFunction's user timers nor a WindowOperator's window "
                                            "timers; skip it")
        d = timer_descriptor(domain)
        return _State(info, index, "map", d, ValueFraming.for_state(d.name, "map", d.serializers, ttl=False),
                      LongType(), domain=domain)
    namespaced = not isinstance(info.namespace_type, VoidNamespaceType)
    if namespaced:
        check_namespace(info.namespace_type, what)
    vt = info.value_type
    map_key = None
    # A Tuple becomes a record with Flink's field names (f0, f1, ...), except in window state, whose values
    # keygroups.windows' operator keeps as its own accumulators (tuples).
    serializer = (lambda t: t.keygroups_serializer()) if namespaced else state_serializer
    if namespaced and names is not None and not isinstance(_value_of(info), RowType):
        raise ValueError(f"field_names gives names for {what}, a window state, whose values are "
                         f"{_value_of(info)!r}: only a Row's fields are named in window state (its Tuples stay "
                         "tuples, as keygroups.windows keeps its accumulators)")
    try:
        if info.kind == "LIST":
            element = vt.element                                   # type: ignore[attr-defined]
            value_type = element.value if info.ttl else element   # type: ignore[attr-defined]
            value_type = _named(value_type, names, what)
            kind = "list"
            d: StateDescriptor = state_descriptor(info.name, kind, {"element": serializer(value_type)})
        elif info.kind == "MAP":
            map_key = vt.key                                       # type: ignore[attr-defined]
            value_type = vt.value.value if info.ttl else vt.value  # type: ignore[attr-defined]
            value_type = _named(value_type, names, what)
            kind = "map"
            d = state_descriptor(info.name, kind, {"map key": map_key.keygroups_serializer(),
                                                   "map value": serializer(value_type)})
        else:
            value_type = vt.value if info.ttl else vt              # type: ignore[attr-defined]
            value_type = _named(value_type, names, what)
            kind = info.kind.lower()
            d = state_descriptor(info.name, kind, {"value": serializer(value_type)})
    except UnsupportedFlinkTypeError as e:
        raise UnsupportedFlinkTypeError(str(e) if str(e).startswith(what) else f"{what}: {e}") from None
    window = None
    if namespaced:   # stored as keygroups stores namespaced state: a map state, window -> value
        d, window = plan_import(info.name, kind, d, windows or FlinkWindows(), info.ttl)
        kind = "map"
    if info.ttl:
        d.enable_time_to_live(StateTtlConfig(ttl_ms=ttl_ms))
    framing = ValueFraming.for_state(info.name, kind, d.serializers, ttl=info.ttl)
    return _State(info, index, kind, d, framing, value_type, map_key, window=window)


def _encode(st: _State, entries: list[tuple], key_ser: TypeSerializer, key_type: FlinkType,
            key_bytes: dict[Any, bytes]) -> tuple[list[bytes], list[bytes]]:
    """Flink entries of one state in one key group → (key bytes, keygroups value bytes), one per key.
    ``key_bytes`` caches the key group's serialized keys (its states share them)."""
    keys: list[bytes] = []
    values: list[bytes] = []
    vt = st.value_type
    plain_key = not isinstance(key_type, TupleType)

    def serialized(k: Any) -> bytes:
        kb = key_bytes.get(k)
        if kb is None:
            kb = key_bytes[k] = key_ser.serialize(k if plain_key else _plain(key_type, k))
        return kb

    if st.window is not None:                          # a namespaced state: window (and user key) -> value
        by_window: dict[bytes, dict] = {}
        mk = st.map_key_type
        for key, map_key, v in st.window.entries(entries, lambda x: _plain(vt, x),
                                                 lambda x: x if mk is None else _plain(mk, x)):
            by_window.setdefault(serialized(key), {})[map_key] = v
        return list(by_window), [st.framing.encode(m) for m in by_window.values()]
    if st.domain is not None or st.kind == "map":        # one keygroups value per key: a dict
        by_key: dict[bytes, dict] = {}
        for e in entries:
            kb = serialized(e[0])
            if st.domain is not None:
                by_key.setdefault(kb, {})[e[2]] = True
            else:
                v = e[3]
                if v is None:
                    raise UnsupportedFlinkTypeError(f"map state {shown(st.info.name)} holds a null value for key "
                                                    f"{shown(e[0])}"
                                                    "; keygroups map states hold no nulls")
                if st.info.ttl:
                    v = (_plain(vt, v.value), v.timestamp)
                else:
                    v = _plain(vt, v)
                # Java's equality (0.0 and -0.0 two keys, every NaN one), as the compiled path and the states keep
                by_key.setdefault(kb, {})[java_key(_plain(st.map_key_type, e[2]))] = v   # type: ignore[arg-type]
        for kb, m in by_key.items():
            keys.append(kb)
            values.append(st.framing.encode(m))
        return keys, values
    for e in entries:
        v = e[2]
        if st.kind == "list":
            v = [(_plain(vt, x.value), x.timestamp) if isinstance(x, TtlValue) else _plain(vt, x) for x in v]
        elif isinstance(v, TtlValue):
            v = (_plain(vt, v.value), v.timestamp)
        else:
            v = _plain(vt, v)
        keys.append(serialized(e[0]))
        values.append(st.framing.encode(v))
    return keys, values


def import_savepoint(savepoint: str | os.PathLike | FlinkSavepoint, location: str, name: str, *, uid: str,
                     operator_state_uid: str | None = None, skip_states: Iterable[str] = (),
                     ttl_ms: int | Mapping[str, int] = DEFAULT_TTL_MS,
                     field_names: Mapping[str, Sequence[str]] | None = None,
                     windows: FlinkWindows | None = None,
                     watermark: int | datetime.datetime | str | None = None, allow_paths_outside: bool = False,
                     storage_options: dict[str, Any] | None = None) -> ImportReport:
    """Write Flink operator ``uid``'s keyed state, timers and operator state (of ``operator_state_uid`` when given:
    a Flink source usually holds the offsets) as keygroups savepoint ``name`` in ``location``.

    ``skip_states`` leaves states out by name (a state keygroups cannot hold otherwise refuses the import, naming it
    and its serializer). ``ttl_ms``: the time to live recorded for TTL states (Flink's savepoint keeps the entries'
    timestamps, not the duration), one for all or per state name. ``field_names``: per state name, the names of
    its Row's or Tuple's fields (Flink's savepoint does not store a Row's; unnamed Rows and Tuples get f0, f1, ...).
    Row and Tuple state becomes record state (``RecordSerializer``: a Row's fields nullable, a Tuple's not;
    Short/Byte/Float kept as smallint/tinyint/float), queryable as struct columns. ``windows``: how a window operator's state (keyed state in ``TimeWindow`` namespaces) and window
    timers are imported (``keygroups.flink.windows.FlinkWindows``; by default ``window-contents`` as
    ``keygroups.windows``' operator keeps it, so a keygroups ``window(...)`` job continues the Flink windows).
    ``watermark``: where event time stands (epoch ms, a datetime or an ISO time, see ``parse_watermark``): Flink's
    savepoint holds none, so without it the job's first batch starts with no watermark (nothing is late, no
    event-time timer fires until its own records move the watermark); with it, the first batch starts from it, as
    from a checkpoint that committed it. ``allow_paths_outside``: read state files the savepoint's ``_metadata``
    names outside its directory (Flink's non-relocatable savepoints; see ``read_savepoint``), refused otherwise.
    Nothing is visible until the savepoint's ``_metadata`` is written, last."""
    started = time.perf_counter()
    start_watermark = None if watermark is None else parse_watermark(watermark)
    if isinstance(savepoint, FlinkSavepoint):
        if allow_paths_outside and not savepoint.allow_paths_outside:
            raise ValueError("allow_paths_outside=True applies to a savepoint read here: the FlinkSavepoint given was "
                             "opened without it (read_savepoint(path, allow_paths_outside=True))")
        sp = savepoint
    else:
        sp = read_savepoint(savepoint, allow_paths_outside=allow_paths_outside)
    op = sp.operator(uid)
    read_before = sp.bytes_read
    sp.check_files(uid)                 # refused before anything is written: outside, not a file, too short
    if operator_state_uid is not None:
        sp.check_files(operator_state_uid)
    skip = set(skip_states)
    header = sp.keyed_header(uid)
    storage = CheckpointStorage(location, storage_options=storage_options)
    mp, p = op.max_parallelism, op.parallelism

    names = dict(field_names or {})
    plans: list[_State] = []
    skipped = []
    refused: list[tuple[str, UnsupportedFlinkTypeError]] = []
    sessions = False
    key_type = header.key_type if header is not None else None
    if header is not None:
        assert key_type is not None
        key_ser = key_serializer_for(key_type_of(key_type))
        windows = windows if windows is not None else FlinkWindows()
        for info in sp.states(uid):
            if not info.keyed:
                continue
            if info.name in skip:
                skipped.append(info.name)
                continue
            if merging_window_set(info.name, info.value_type, windows, uid):
                sessions = True      # read to move session contents to their sessions; not a keygroups state
                continue
            ttl = ttl_ms.get(info.name, DEFAULT_TTL_MS) if isinstance(ttl_ms, Mapping) else ttl_ms
            try:
                plans.append(_plan(info, len(plans), ttl, names.get(info.name), windows))
            except UnsupportedFlinkTypeError as e:
                refused.append((info.name, e))
    if len(refused) == 1:
        raise refused[0][1]
    if refused:   # every one at once: a user skipping them should not learn of them one import at a time
        skips = " ".join(f"--skip-state {plain(n)}" for n, _ in refused)
        raise UnsupportedFlinkTypeError(
            f"{len(refused)} states of operator {uid!r} cannot be imported: "
            + "; ".join(str(e) for _, e in refused)
            + f". To import the others, leave these out: {skips} (Python: skip_states="
            + f"[{', '.join(shown(n) for n, _ in refused)}])")
    unknown = skip - {s.name for s in sp.states(uid)} - {s.name for s in sp.states(operator_state_uid or uid)}
    if unknown and operator_state_uid in (None, uid):
        raise ValueError(f"skip_states names {sorted(unknown)}, which operator {uid!r} does not have")
    if unknown:
        raise ValueError(f"skip_states names {sorted(unknown)}, which neither operator {uid!r} nor operator "
                         f"{operator_state_uid!r} has")
    unnamed = set(names) - {st.info.name for st in plans}
    if unnamed:
        raise ValueError(f"field_names names {sorted(unnamed)}, which are not keyed states imported from operator "
                         f"{uid!r} (its keyed states: {', '.join(shown(s.name) for s in sp.states(uid) if s.keyed)})")

    storage.begin_savepoint(name)
    directory = f"savepoints/{name}"
    by_name = {st.info.name: st for st in plans}
    metas = [state_meta(st.descriptor, key_ser) for st in plans] if plans else []
    keyed_handles = []
    counts = {"timers": 0, "entries": 0, "key_groups": 0}
    if plans:
        assert key_type is not None
        fast = _fast_plans(plans, key_type, sessions)
        for subtask in range(p):
            groups = key_group_range(mp, p, subtask)
            kg_iter = _key_groups(sp, uid, groups, by_name, key_ser, key_type, counts, fast, sessions)
            relpath = f"{directory}/keyed-{subtask}-{uuid.uuid4().hex}"
            handle = write_full_snapshot(storage, relpath, 0, subtask, groups, metas, kg_iter)
            keyed_handles.append(handle)

    operator_handles = []
    operator_names: list[str] = []
    op_uid = operator_state_uid or uid
    op_infos = {s.name: s for s in sp.states(op_uid) if not s.keyed and s.name not in skip}
    skipped += [s.name for s in sp.states(op_uid) if not s.keyed and s.name in skip]
    if op_infos:
        modes = sp.operator_state_modes(op_uid)
        per_subtask: dict[int, list[SerializedState]] = {}
        for name_, info in op_infos.items():
            operator_names.append(name_)
            mode = DistributionMode(modes[name_])
            try:
                value_ser = state_serializer(info.value_type)
                key_ser_op = info.key_type.keygroups_serializer() if info.key_type is not None else None
            except UnsupportedFlinkTypeError as e:
                raise UnsupportedFlinkTypeError(f"operator state {shown(name_)}: {e}") from None
            for index, elements in sp.read_operator_state(op_uid, name_).items():
                per_subtask.setdefault(index, []).append(
                    _serialized_operator_state(name_, mode, value_ser, key_ser_op, info, elements))
        for index in sorted(per_subtask):
            relpath = f"{directory}/operator-{index}-{uuid.uuid4().hex}"
            operator_handles.append(write_operator_snapshot(storage, relpath, per_subtask[index], subtask=index,
                                                            operator_id=DEFAULT_OPERATOR_ID))

    metadata = CheckpointMetadata(
        checkpoint_id=0, job_id=f"flink-import:{uid}", timestamp_ms=int(time.time() * 1000), max_parallelism=mp,
        parallelism=p, keyed_handles=keyed_handles, operator_handles=operator_handles,
        properties={"flink": {"savepoint": sp.path, "uid": uid, "operator_id": op.operator_id_hex,
                              "checkpoint_id": sp.metadata.checkpoint_id},
                    **({} if start_watermark is None else {"watermark": start_watermark})})
    path = storage.commit_savepoint(metadata, name)
    report = ImportReport(path, mp, p, tuple(st.info.name for st in plans if st.domain is None), tuple(skipped),
                          counts["timers"], counts["entries"], counts["key_groups"], tuple(operator_names),
                          sp.bytes_read - read_before, time.perf_counter() - started, start_watermark)
    log.info("imported Flink operator %s into %s: %d key groups, %d entries, %d timers", uid, path,
             report.key_groups, report.entries, report.timers)
    return report


def _fast_plan(st: _State, key_type: FlinkType) -> flinkin.StatePlan:
    """The compiled import of ``st`` (NotCompiled when it has none: the Python path imports it)."""
    kind, wrap = st.kind, False
    if st.window is not None:      # keygroups keeps it as a map; the compiled plan follows the Flink kind
        if st.window.record_schema is not None:
            raise NotCompiled(f"state {shown(st.info.name)} holds a process window's records")
        kind, wrap = st.window.kind, st.window.wrap
    return state_plan(st.info.name, kind, key_type, st.info.namespace_type, st.value_type, st.map_key_type,
                      st.info.ttl, st.domain is not None, wrap, tuples_as_records=st.window is None)


def _fast_plans(plans: list[_State], key_type: FlinkType, sessions: bool = False) -> dict[str, flinkin.StatePlan]:
    """The compiled import of each state that has one. ``sessions``: the savepoint records merged windows, whose
    contents move to their sessions the Python way (keygroups.flink.windows)."""
    fast = {}
    for st in plans:
        if sessions and st.window is not None and st.window.sessions:
            continue
        try:
            fast[st.info.name] = _fast_plan(st, key_type)
        except NotCompiled as e:
            log.info("state %r is imported by the Python path: %s", st.info.name, e)
    return fast


def _key_groups(sp: FlinkSavepoint, uid: str, groups: KeyGroupRange, by_name: dict[str, _State],
                key_ser: TypeSerializer, key_type: FlinkType, counts: dict[str, int],
                fast: dict[str, flinkin.StatePlan], sessions: bool = False
                ) -> Iterator[tuple[int, list[tuple[int, Any, Any]]]]:
    """Each key group's sections for ``write_full_snapshot``. A block is scanned once; a compiled state's entries go
    from Flink's bytes to keygroups' in C (``flinkin.StatePlan``, packed: no Python object per entry), the others
    (window state and window timers) through ``_encode``. ``sessions``: the block's ``merging-window-set`` is read
    to move each session's contents to the session itself."""
    for raw in sp.key_group_blocks(uid, groups):
        names = [m.name for m in raw.header.states]
        scan = raw.scan()
        present = scan.counts(len(names))
        sections: list[tuple[int, Any, Any]] = []
        slow = []
        key_order = flinkin.KeyOrder()   # the states of a key group mostly share their keys: sorted once
        for state_id, name in enumerate(names):
            st = by_name.get(name)
            if not present[state_id] or (st is None and not (sessions and name == MERGING_WINDOW_SET)):
                continue
            plan = fast.get(name)
            if plan is None:
                slow.append(state_id)
                continue
            assert st is not None
            try:
                n, kd, ko, vd, vo = plan.transcode(scan, state_id, key_order)
            except CorruptSnapshotError as e:
                raise CorruptSnapshotError(f"{raw.where}, state {shown(name)} {e}") from None
            except StateSerializationError as e:
                raise UnsupportedFlinkTypeError(f"{raw.where}, state {shown(name)} {e}") from None
            sections.append((st.index, Packed(kd, ko), Packed(vd, vo)))
            counts["timers" if st.domain is not None else "entries"] += n
        if slow:
            decoded = decode_entries(raw, scan, slow)
            state_windows = session_windows(decoded.get(MERGING_WINDOW_SET, [])) if sessions else {}
            key_bytes: dict[Any, bytes] = {}
            for state_name, entries in decoded.items():
                st = by_name.get(state_name)
                if st is None:      # merging-window-set: read for state_windows only
                    continue
                if st.window is not None:
                    st.window.state_windows = state_windows
                keys, values = _encode(st, entries, key_ser, key_type, key_bytes)
                order = sorted(range(len(keys)), key=keys.__getitem__)
                sections.append((st.index, [keys[i] for i in order], [values[i] for i in order]))
                counts["timers" if st.domain is not None else "entries"] += len(entries)
        sections.sort(key=lambda s: s[0])
        counts["key_groups"] += 1
        yield raw.key_group, sections


def _serialized_operator_state(name: str, mode: DistributionMode, value_ser: TypeSerializer,
                               key_ser: TypeSerializer | None, info: FlinkStateInfo, elements: Any
                               ) -> SerializedState:
    from keygroups._native import splitter

    if mode is DistributionMode.BROADCAST:
        assert key_ser is not None and info.key_type is not None
        keys = [_plain(info.key_type, k) for k in elements]
        values = [_plain(info.value_type, v) for v in elements.values()]
        kd, ko = key_ser.serialize_many(keys)
        vd, vo = value_ser.serialize_many(values)
        data, offsets = splitter.encode_entries(kd, np.ascontiguousarray(ko, dtype=np.int64),
                                                vd, np.ascontiguousarray(vo, dtype=np.int64))
        serializers = {"key_serializer": key_ser.snapshot().to_json(),
                       "value_serializer": value_ser.snapshot().to_json()}
    else:
        data, offsets = value_ser.serialize_many([_plain(info.value_type, e) for e in elements])
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        serializers = {"serializer": value_ser.snapshot().to_json()}
    return SerializedState(name, mode, serializers, data, offsets)
