"""How keyed-checkpoint-v3 was made: run at commit 41e6c99 (keyed format 3, ``_metadata`` version 3: keyed handles
without per-block checksums, delta blocks that name no predecessor), from the repository root, with
``PYTHONPATH=src python tests/data/keyed-checkpoint-v3/make_checkpoint.py``. Running it with a later keygroups writes
that version's format instead, so the committed files are the test data, not this script.

A heap backend at parallelism 2, max parallelism 16, six states (value, list, map; each with and without TTL) and a
clock fixed at CLOCK_S; chk-1 is full, chk-2 and chk-3 deltas (changed keys, appended list elements, cleared keys as
deletes), so every key group's chain has a middle delta. ``expected.json`` holds each key's state as restored from
chk-3 (at parallelism 1) by that same code, at two clock readings: ``"live"`` (CLOCK_S + 300: nothing expired) and
``"expiring"`` (CLOCK_S + TTL_S + 30: what chk-1 wrote for keys below 30 has expired, what chk-2 and chk-3 wrote
has not): per key ``[count, events, attrs, seen, log, tags]``."""

from __future__ import annotations

import json
import pathlib
import shutil

from keygroups import KeyGroupRange, assign_to_key_group, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.serializers import Int64Serializer, StrSerializer, ValueSerializer
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    StateTtlConfig,
    ValueStateDescriptor,
)

HERE = pathlib.Path(__file__).parent
CLOCK_S = 1_700_000_000.0
TTL_S = 3600
MAXP = 16
KEYS = range(60)


def descriptors() -> dict:
    ttl = StateTtlConfig.new_builder(TTL_S).build()
    out = {"count": ValueStateDescriptor("count", Int64Serializer()),
           "events": ListStateDescriptor("events", StrSerializer()),
           "attrs": MapStateDescriptor("attrs", StrSerializer(), ValueSerializer()),
           "seen": ValueStateDescriptor("seen", Int64Serializer()),
           "log": ListStateDescriptor("log", StrSerializer()),
           "tags": MapStateDescriptor("tags", StrSerializer(), Int64Serializer())}
    for name in ("seen", "log", "tags"):
        out[name].enable_time_to_live(ttl)
    return out


def main() -> None:
    out = HERE / "chk"
    shutil.rmtree(out, ignore_errors=True)
    storage = CheckpointStorage(out, retain=10)
    now = [CLOCK_S]
    backends = [HeapKeyedStateBackend(key_group_range(MAXP, 2, i), MAXP, Int64Serializer(), subtask_index=i,
                                      clock=lambda: now[0]) for i in range(2)]
    states = [{n: b.get_state(d) for n, d in descriptors().items()} for b in backends]

    def owner(k: int) -> int:
        return 0 if assign_to_key_group(k, MAXP) in backends[0].key_group_range else 1

    last = None

    def commit(cid: int) -> None:
        nonlocal last
        handles = [b.snapshot(cid, storage).result(30) for b in backends]
        storage.commit(CheckpointMetadata(checkpoint_id=cid, job_id="format-3", timestamp_ms=0,
                                          max_parallelism=MAXP, parallelism=2,
                                          keyed_handles=carry_forward(last, handles), operator_handles=[],
                                          properties={}))
        last = storage.load(cid)

    for k in KEYS:
        i = owner(k)
        backends[i].set_current_key(k)
        s = states[i]
        s["count"].update(k * 7)
        if k % 3 == 0:
            s["events"].update([f"e{k}", f"f{k}"])
        if k % 4 == 0:
            s["attrs"].put_all({"a": [k, "x"], "b": {"n": k}})
        now[0] = CLOCK_S + k
        s["seen"].update(k + 1000)
        s["log"].add_all([f"l{k}", ""])
        s["tags"].put_all({"t": k, "u": -k})
    commit(1)
    now[0] = CLOCK_S + 100
    for k in KEYS:
        if k % 5:
            continue
        i = owner(k)
        backends[i].set_current_key(k)
        s = states[i]
        if k % 10 == 0:   # deletes in the delta blocks
            for st in s.values():
                st.clear()
        else:
            s["count"].update(-k)
            s["events"].add("g")
            s["attrs"].put("c", None)
            s["seen"].update(k + 2000)
            s["log"].add("m")
            s["tags"].put("v", k)
    commit(2)
    now[0] = CLOCK_S + 200
    for k in KEYS:
        if k % 2:
            continue
        i = owner(k)
        backends[i].set_current_key(k)
        s = states[i]
        s["count"].update(k * 11)
        s["events"].add("h")
        s["attrs"].put("d", k)
        s["log"].add("o")
        s["tags"].remove("u")
    commit(3)

    for b in backends:
        b.dispose()
    expected = {"live": read_back(storage, CLOCK_S + 300), "expiring": read_back(storage, CLOCK_S + TTL_S + 30)}
    (HERE / "expected.json").write_text(json.dumps(expected))


def read_back(storage: CheckpointStorage, clock_s: float) -> dict[int, list]:
    with HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer(), clock=lambda: clock_s) as b:
        b.restore(storage, storage.load(3))
        s = {n: b.get_state(d) for n, d in descriptors().items()}
        got = {}
        for k in KEYS:
            b.set_current_key(k)
            got[k] = [s["count"].value(), list(s["events"].get()), dict(s["attrs"].items()), s["seen"].value(),
                      list(s["log"].get()), dict(s["tags"].items())]
        return got


if __name__ == "__main__":
    main()
