"""How record-checkpoint-v1 was made: run at commit 41e6c99 (RecordSerializer format 1, whose stored schema holds no
aliases), from the repository root, with ``PYTHONPATH=src python tests/data/record-checkpoint-v1/make_checkpoint.py``.
Running it with a later keygroups writes that version's snapshots instead, so the committed files are the test data,
not this script.

A heap backend at parallelism 2, max parallelism 16, three record states (value, list of records, map of records with
a TTL) over a schema with nested records, lists, maps, decimals, dates and timestamps; chk-1 is full, chk-2 a delta.
``expected.json`` holds each key's values as restored from chk-2 by that same code (JSON-able: ``repr`` of each)."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import pathlib
import shutil

from keygroups import KeyGroupRange, assign_to_key_group, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward
from keygroups.serializers import Int64Serializer, RecordSerializer, StrSerializer
from keygroups.state import (
    HeapKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    StateTtlConfig,
    ValueStateDescriptor,
)

HERE = pathlib.Path(__file__).parent
CLOCK_S = 1_700_000_000.0
MAXP = 16
KEYS = range(40)
SCHEMA = ("id bigint not null, name string, score double, small int not null, "
          "price decimal(10,2), day date, at timestamp, "
          "address struct<street: string, zip int not null>, tags array<string>, counts map<string, bigint>")


def descriptors() -> dict:
    ser = RecordSerializer(SCHEMA)
    out = {"profile": ValueStateDescriptor("profile", ser),
           "history": ListStateDescriptor("history", ser),
           "by_name": MapStateDescriptor("by_name", StrSerializer(), ser)}
    out["by_name"].enable_time_to_live(StateTtlConfig.new_builder(10**6).build())
    return out


def record(k: int, version: int) -> dict:
    return {"id": k, "name": None if k % 7 == 0 else f"n{k}-{version}", "score": k / 4 + version,
            "small": k * 3 - version, "price": decimal.Decimal(k * 101 + version).scaleb(-2),
            "day": dt.date(2024, 1, 1) + dt.timedelta(days=k), "at": dt.datetime(2024, 5, 1, k % 24,
                                                                                  tzinfo=dt.timezone.utc),
            "address": None if k % 5 == 0 else {"street": f"s{k}", "zip": 10000 + k},
            "tags": [f"t{k}", None] if k % 2 else [], "counts": {"a": k, "b": None}}


def main() -> None:
    out = HERE / "chk"
    shutil.rmtree(out, ignore_errors=True)
    storage = CheckpointStorage(out, retain=10)
    backends = [HeapKeyedStateBackend(key_group_range(MAXP, 2, i), MAXP, Int64Serializer(), subtask_index=i,
                                      clock=lambda: CLOCK_S) for i in range(2)]
    states = [{n: b.get_state(d) for n, d in descriptors().items()} for b in backends]

    def owner(k: int) -> int:
        return 0 if assign_to_key_group(k, MAXP) in backends[0].key_group_range else 1

    last = None

    def commit(cid: int) -> None:
        nonlocal last
        handles = [b.snapshot(cid, storage).result(30) for b in backends]
        storage.commit(CheckpointMetadata(checkpoint_id=cid, job_id="records-v1", timestamp_ms=0,
                                          max_parallelism=MAXP, parallelism=2,
                                          keyed_handles=carry_forward(last, handles), operator_handles=[],
                                          properties={}))
        last = storage.load(cid)

    for k in KEYS:
        i = owner(k)
        backends[i].set_current_key(k)
        s = states[i]
        s["profile"].update(record(k, 1))
        s["history"].update([record(k, 0), record(k + 1, 0)])
        s["by_name"].put(f"k{k}", record(k, 2))
    commit(1)
    for k in KEYS[::3]:   # a delta: changed, appended, cleared
        i = owner(k)
        backends[i].set_current_key(k)
        s = states[i]
        if k % 2:
            s["profile"].clear()
        else:
            s["profile"].update(record(k, 3))
        s["history"].add(record(k, 4))
        s["by_name"].put("extra", record(k, 5))
    commit(2)
    for b in backends:
        b.dispose()
    (HERE / "expected.json").write_text(json.dumps(read_back(storage)))


def read_back(storage: CheckpointStorage) -> dict[int, list[str]]:
    with HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer(), clock=lambda: CLOCK_S) as b:
        b.restore(storage, storage.load(2))
        s = {n: b.get_state(d) for n, d in descriptors().items()}
        got = {}
        for k in KEYS:
            b.set_current_key(k)
            got[k] = [repr(s["profile"].value()), repr(s["history"].get()), repr(sorted(s["by_name"].items()))]
        return got


if __name__ == "__main__":
    main()
