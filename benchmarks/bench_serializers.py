"""Serializer throughput: keygroups' compiled serializers beside pickle and json doing the same work.

"The same work" is N separately addressable encodings (what keyed state stores: one value per key), so the
baselines are ``[pickle.dumps(v) for v in values]`` and ``[json.dumps(v).encode() for v in values]`` (and their
loads). Ours is shown both in bulk (``serialize_many``: one buffer + offsets, how snapshots write) and per value
(``serialize`` in a Python loop, how a state update writes). Medians of several interleaved runs (GC paused while timing, as timeit does); ratio = baseline / ours, so
> 1 means we are faster.

Record state (``RecordSerializer``): a 6-field record (long, double, string, bool, timestamp, list<long>), encode +
decode round trips per second, beside pickle, ``ValueSerializer`` (the timestamp as epoch microseconds: it has no
datetime) and Avro binary through fastavro (the other candidate encoding; skipped if fastavro is not installed),
with the bytes each stores per record.

    python benchmarks/bench_serializers.py [--n 1000000] [--repeat 5] [--only records]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from keygroups.serializers import Int64Serializer, RecordSerializer, ValueSerializer
from _util import measure

RECORD_DDL = "id bigint, score double, name string, ok boolean, at timestamp, history array<bigint>"


def report(title: str, fns: dict[str, Callable[[], Any]], n: int, repeat: int) -> None:
    """Times fns (the first is the baseline) and prints time, rate and baseline/ours per line."""
    print(f" {title}")
    m = {label: t.seconds for label, t in measure(fns, repeat, keep_results=False).items()}
    base = next(iter(m.values()))
    for i, (label, sec) in enumerate(m.items()):
        ratio = "   (base)" if i == 0 else f"{base / sec:7.2f}x"
        print(f"  {label:<44} {sec * 1e3:9.1f} ms  {n / sec / 1e6:7.2f} M/s  {ratio}")


def bench_case(title: str, values: list, ser, repeat: int) -> None:
    n = len(values)
    print(f"\n{title}  (n = {n:,}, median of {repeat})")
    pk = [pickle.dumps(v, protocol=5) for v in values]
    js = [json.dumps(v).encode() for v in values]
    buf, offsets = ser.serialize_many(values)
    ours_each = [ser.serialize(v) for v in values]
    s, d = ser.serialize, ser.deserialize

    report("serialize", {
        "pickle.dumps per value (baseline)": lambda: [pickle.dumps(v, protocol=5) for v in values],
        "json.dumps per value": lambda: [json.dumps(v).encode() for v in values],
        "keygroups serialize_many (bulk)": lambda: ser.serialize_many(values),
        "keygroups serialize per value": lambda: [s(v) for v in values],
    }, n, repeat)
    report("deserialize", {
        "pickle.loads per value (baseline)": lambda: [pickle.loads(b) for b in pk],
        "json.loads per value": lambda: [json.loads(b) for b in js],
        "keygroups deserialize_many (bulk)": lambda: ser.deserialize_many(buf, offsets),
        "keygroups deserialize per value": lambda: [d(b) for b in ours_each],
    }, n, repeat)
    sizes = {"pickle": sum(map(len, pk)), "json": sum(map(len, js)), "keygroups": len(buf)}
    print("  bytes: " + ", ".join(f"{k} {v / n:.1f}/value" for k, v in sizes.items()))


def _avro_codec() -> tuple[Callable[[Any], bytes], Callable[[bytes], Any]] | None:
    """fastavro's schemaless writer and reader of the record (per value, as keyed state stores values)."""
    try:
        import io

        import fastavro
    except ImportError:
        return None
    schema = fastavro.parse_schema({"type": "record", "name": "R", "fields": [
        {"name": "id", "type": ["null", "long"]}, {"name": "score", "type": ["null", "double"]},
        {"name": "name", "type": ["null", "string"]}, {"name": "ok", "type": ["null", "boolean"]},
        {"name": "at", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
        {"name": "history", "type": ["null", {"type": "array", "items": ["null", "long"]}]}]})
    writer, reader = fastavro.schemaless_writer, fastavro.schemaless_reader

    def encode(v: Any) -> bytes:
        out = io.BytesIO()
        writer(out, schema, v)
        return out.getvalue()

    def decode(b: bytes) -> Any:
        return reader(io.BytesIO(b), schema, None)

    return encode, decode


def measure_cpu(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, tuple[float, float]]:
    """Median (wall seconds, CPU seconds of this process) per fn: interleaved runs, GC collected before and paused
    during each call (as ``_util.measure`` times)."""
    import gc
    import statistics
    import time

    walls: dict[str, list[float]] = {k: [] for k in fns}
    cpus: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for label, fn in fns.items():
            gc.collect()
            gc.disable()
            try:
                w0, c0 = time.perf_counter(), time.process_time()
                result = fn()
                walls[label].append(time.perf_counter() - w0)
                cpus[label].append(time.process_time() - c0)
            finally:
                gc.enable()
            del result
    return {k: (statistics.median(walls[k]), statistics.median(cpus[k])) for k in fns}


def bench_records(n: int, repeat: int, rng: np.random.Generator) -> None:
    """Encode + decode of the 6-field record, each candidate doing the same work; round trips per second."""
    import datetime as dt

    print(f"\nrecords: {RECORD_DDL}  (n = {n:,}, median of {repeat}, GC paused while timing)")
    epoch = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
    ids = rng.integers(0, 2**40, size=n).tolist()
    records = [{"id": i, "score": i / 7.0, "name": f"user-{i % 10_000}", "ok": bool(i & 1),
                "at": epoch + dt.timedelta(microseconds=i), "history": [i, i + 1, i + 2]} for i in ids]
    as_value = [dict(r, at=i) for r, i in zip(records, ids)]   # ValueSerializer has no datetime: epoch µs
    rec = RecordSerializer(RECORD_DDL)
    rec_tuple = RecordSerializer(RECORD_DDL, form="tuple")
    tuples = [tuple(r.values()) for r in records]
    value = ValueSerializer()

    def round_trip_each(ser: Any, values: list) -> Callable[[], Any]:
        s, d = ser.serialize, ser.deserialize
        return lambda: [d(s(v)) for v in values]

    def round_trip_bulk(ser: Any, values: list) -> Callable[[], Any]:
        return lambda: ser.deserialize_many(*ser.serialize_many(values))

    fns: dict[str, Callable[[], Any]] = {
        "pickle dumps+loads per record (baseline)": lambda: [pickle.loads(pickle.dumps(r, protocol=5))
                                                              for r in records],
        "ValueSerializer per record": round_trip_each(value, as_value),
        "ValueSerializer bulk": round_trip_bulk(value, as_value),
    }
    avro = _avro_codec()
    if avro is not None:
        enc, dec = avro
        fns["fastavro schemaless per record"] = lambda: [dec(enc(r)) for r in records]
    else:
        print("  (fastavro is not installed: pip install fastavro to compare Avro binary)")
    fns.update({
        "RecordSerializer dicts per record": round_trip_each(rec, records),
        "RecordSerializer dicts bulk": round_trip_bulk(rec, records),
        "RecordSerializer tuples per record": round_trip_each(rec_tuple, tuples),
        "RecordSerializer tuples bulk": round_trip_bulk(rec_tuple, tuples),
    })
    print(" encode + decode (round trips); per core = records / CPU seconds of this process (the machine is shared:"
          " wall time includes waiting for a core, CPU time does not)")
    cpu = measure_cpu(fns, repeat)
    base_wall, base_cpu = next(iter(cpu.values()))
    for i, (label, (wall, cpu_s)) in enumerate(cpu.items()):
        ratio = "   (base)" if i == 0 else f"{base_cpu / cpu_s:7.2f}x"
        print(f"  {label:<44} wall {wall * 1e3:8.1f} ms  cpu {cpu_s * 1e3:8.1f} ms  {n / cpu_s / 1e6:6.2f} M/s per core"
              f"  {ratio}")
    assert rec.deserialize_many(*rec.serialize_many(records[:1000])) == records[:1000]
    sizes = {"pickle": sum(len(pickle.dumps(r, protocol=5)) for r in records[:10_000]),
             "ValueSerializer": len(value.serialize_many(as_value[:10_000])[0]),
             "RecordSerializer": len(rec.serialize_many(records[:10_000])[0])}
    if avro is not None:
        sizes["fastavro"] = sum(len(avro[0](r)) for r in records[:10_000])
    print("  bytes per record: " + ", ".join(f"{k} {v / 10_000:.1f}" for k, v in sizes.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--only", choices=["records"], help="run only this case")
    args = p.parse_args()
    n = args.n
    rng = np.random.default_rng(42)
    print(f"load average {os.getloadavg()} on {os.cpu_count()} cores (a shared machine: compare ratios, not times)")
    if args.only == "records":
        bench_records(n, args.repeat, rng)
        return

    ints = rng.integers(-(2**62), 2**62, size=n).tolist()
    bench_case("int64 (Python ints)", ints, Int64Serializer(), args.repeat)

    dicts = [{"user": f"u{i % 1000}", "count": int(c), "score": float(c) / 7.0, "tags": ["a", "b"], "ok": bool(c & 1)}
             for i, c in enumerate(rng.integers(0, 10**6, size=n))]
    bench_case("small dicts (ValueSerializer)", dicts, ValueSerializer(), args.repeat)

    bench_records(n, args.repeat, rng)

    print("\nratio = baseline time / our time (higher is better for keygroups)")


if __name__ == "__main__":
    main()
