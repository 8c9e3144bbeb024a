"""The shape of a keyed state's meta as a snapshot stores it (``keygroups.state._base.state_meta`` writes it; Flink's
``StateMetaInfoSnapshot`` is the counterpart): checked once, where a ``_metadata`` or a handle is read, so that a
damaged or crafted meta is refused with an error naming the state and what is wrong, and nothing above this layer
meets a missing role, a serializer snapshot of the wrong type or a TTL that is not an object.

A meta is a JSON object: ``name`` (a non-empty string), ``kind`` (``value``, ``list``, ``map``, ``reducing`` or
``aggregating``), ``serializers`` (role -> serializer snapshot: ``key`` and the kind's roles, see :data:`ROLES`),
``ttl`` (None or an object with ``ttl_ms``, an int > 0), and optionally ``namespace_serializer`` (None) and
``format`` (an int). Each serializer snapshot must parse, and one of a serializer class known here must rebuild
(its config and nested snapshots fit the class); a snapshot of a class not imported yet, or one that unpickles, is
left to the restore (which names it then, or refuses it without ``allow_pickle``)."""

from __future__ import annotations

import functools
import json
from typing import Any

from keygroups.errors import CorruptSnapshotError, KeyGroupsError
from keygroups.serializers import SerializerSnapshot
from keygroups.serializers.snapshot import serializer_class

#: The serializer roles of each state kind, besides ``"key"``.
ROLES: dict[str, tuple[str, ...]] = {
    "value": ("value",),
    "reducing": ("value",),
    "aggregating": ("value",),
    "list": ("element",),
    "map": ("map key", "map value"),
}


def check_state_meta(meta: Any) -> None:
    """``ValueError`` (naming the state, or its position when it has no name, and what is wrong) unless ``meta`` is
    a well-formed keyed state meta (see the module docs)."""
    if not isinstance(meta, dict):
        raise ValueError(f"a state meta must be a JSON object, got {type(meta).__name__}")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"a state meta has no valid name (a non-empty string), got {name!r:.100}")
    what = f"state {name!r}"
    kind = meta.get("kind")
    if not isinstance(kind, str) or kind not in ROLES:
        raise ValueError(f"{what} has kind {kind!r:.100}; allowed: {sorted(ROLES)}")
    sers = meta.get("serializers")
    if not isinstance(sers, dict):
        raise ValueError(f"{what} has no serializers object (role -> serializer snapshot), got {sers!r:.100}")
    for role in ("key", *ROLES[kind]):
        if role not in sers:
            raise ValueError(f"{what} ({kind} state) has no {role!r} serializer; it needs "
                             f"{['key', *ROLES[kind]]}, has {sorted(map(str, sers))}")
    for role, snapshot in sers.items():
        problem = _snapshot_problem(json.dumps(snapshot, sort_keys=True, default=repr))
        if problem is not None:
            raise ValueError(f"{what}: its {role!r} serializer snapshot {problem}")
    ttl = meta.get("ttl")
    if ttl is not None:
        if not isinstance(ttl, dict):
            raise ValueError(f"{what} has a TTL that is not a JSON object: {ttl!r:.100}")
        ttl_ms = ttl.get("ttl_ms")
        if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms <= 0:
            raise ValueError(f"{what} has a TTL whose ttl_ms is not an int > 0: {ttl_ms!r:.100}")
        clock = ttl.get("time_characteristic")
        if clock is not None and clock not in ("ProcessingTime", "EventTime"):
            raise ValueError(f"{what} has a TTL of time characteristic {clock!r:.100}; allowed: 'ProcessingTime', "
                             "'EventTime'")
    if meta.get("namespace_serializer") is not None:
        raise ValueError(f"{what} names a namespace serializer, which keyed snapshots never store")
    version = meta.get("format")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise ValueError(f"{what} has a meta format that is not an int: {version!r:.100}")


@functools.lru_cache(maxsize=1024)
def _snapshot_problem(snapshot_json: str) -> str | None:
    """What is wrong with a serializer snapshot (as canonical JSON), None if nothing: it must parse, and a class
    known here that needs no unpickling must rebuild from it. Cached: every handle of a checkpoint repeats them."""
    try:
        snapshot = SerializerSnapshot.from_json(json.loads(snapshot_json))
    except CorruptSnapshotError as e:
        return f"is malformed: {e}"
    if snapshot.uses_pickle or not _all_known(snapshot):
        return None   # judged by the restore, which knows allow_pickle and the classes registered by then
    try:
        snapshot.restore_serializer()
    except KeyGroupsError as e:
        return f"({snapshot.describe()}) does not rebuild: {e}"
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError) as e:
        return f"({snapshot.describe()}) does not rebuild: {type(e).__name__}: {e}"
    return None


def _all_known(snapshot: SerializerSnapshot) -> bool:
    return serializer_class(snapshot.identifier) is not None and all(_all_known(n) for n in snapshot.nested)



def check_state_metas(metadata: Any) -> None:
    """``CorruptSnapshotError`` naming the file and the state unless every state meta of ``metadata``'s keyed
    handles is well formed (:func:`check_state_meta`): what a restore and a reader check before using any."""
    for handle in metadata.keyed_handles:
        # a handle decoded once per process is checked once: every later restore point carries the same object
        if handle.__dict__.get("_states_checked"):
            continue
        for meta in handle.states:
            try:
                check_state_meta(meta)
            except ValueError as e:
                raise CorruptSnapshotError(f"the state meta in the handle of {handle.file!r}: {e}") from None
        handle.__dict__["_states_checked"] = True


__all__ = ["ROLES", "check_state_meta", "check_state_metas"]
