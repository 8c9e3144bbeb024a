"""The canonical lines of tests/flink/README.md, made in Python: what keygroups reads from a Flink savepoint (or
writes into one) as the same text SavepointJob.java prints for what Flink holds."""

from __future__ import annotations

import json
import struct
from typing import Any

from keygroups.flink import FlinkSavepoint, TtlValue
from keygroups.flink.types import (
    BytesType,
    DoubleType,
    FlinkType,
    FloatType,
    ListType,
    MapType,
    NullableType,
    RowType,
    TtlType,
    TupleType,
)


def plain(t: FlinkType, v: Any) -> Any:
    """A decoded value as the JSON-ready value SavepointJob.Json writes for it."""
    if v is None:
        return None
    if isinstance(t, TtlType):
        return plain(t.value, v.value if isinstance(v, TtlValue) else v)
    if isinstance(t, DoubleType):
        return "d:" + struct.pack(">d", v).hex()
    if isinstance(t, FloatType):
        return "f:" + struct.pack(">f", v).hex()
    if isinstance(t, BytesType):
        return "b:" + bytes(v).hex()
    if isinstance(t, (TupleType, RowType)):
        return [plain(f, x) for f, x in zip(t.fields, v)]
    if isinstance(t, ListType):
        return [plain(t.element, x) for x in v]
    if isinstance(t, MapType):
        pairs = sorted((dumps(plain(t.key, k)), dumps(plain(t.value, x))) for k, x in v.items())
        return [json.loads(f"[{k},{x}]") for k, x in pairs]
    if isinstance(t, NullableType):
        return plain(t.inner, v)
    return v


def dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=True, separators=(",", ":"))


def savepoint_lines(sp: FlinkSavepoint, uid: str = "keyed") -> list[str]:
    """Every entry, timer and operator-state element of operator ``uid``, as sorted canonical lines."""
    infos = {s.name: s for s in sp.states(uid)}
    lines = []
    maps: dict[tuple[str, str], dict] = {}
    for kg in sp.key_groups(uid):
        for name, entries in kg.entries.items():
            info = infos[name]
            for e in entries:
                key = dumps(plain(info.key_type, e[0]))
                if info.kind == "TIMER":
                    domain = "event" if "event" in name else "processing"
                    lines.append(f"timer\t{domain}\t{key}\t{e[2]}")
                elif info.kind == "MAP":
                    maps.setdefault((name, key), {})[e[2]] = e[3]
                else:
                    lines.append(f"keyed\t{name}\t{key}\t{dumps(plain(info.value_type, e[2]))}")
    for (name, key), entries in maps.items():
        lines.append(f"keyed\t{name}\t{key}\t{dumps(plain(infos[name].value_type, entries))}")
    for name, mode in sp.operator_state_modes(uid).items():
        per_subtask = sp.read_operator_state(uid, name)
        t = infos[name].value_type
        if mode == "BROADCAST":
            copies = {dumps(sorted((dumps(plain(infos[name].key_type, k)), dumps(plain(t, v)))
                                   for k, v in m.items())) for m in per_subtask.values()}
            assert len(copies) == 1, f"broadcast state {name} differs between subtasks"
            m = next(iter(per_subtask.values()))
            lines += [f"broadcast\t{name}\t{dumps(plain(infos[name].key_type, k))}\t{dumps(plain(t, v))}"
                      for k, v in m.items()]
        else:
            tag = "split" if mode == "SPLIT_DISTRIBUTE" else "union"
            lines += [f"{tag}\t{name}\t{dumps(plain(t, e))}" for elems in per_subtask.values() for e in elems]
    return sorted(lines)
