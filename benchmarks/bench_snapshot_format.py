"""Keyed snapshot format: write and read throughput, and what a rescaled restore reads.

    python benchmarks/bench_snapshot_format.py [--entries 1000000] [--runs 5]
    python benchmarks/bench_snapshot_format.py --incremental [--entries 1000000] [--checkpoints 20] [--touch 0.01]
    python benchmarks/bench_snapshot_format.py --framing [--entries 1000000] [--runs 5]

Figures (medians of ``--runs`` runs) are printed beside a named baseline in the same run:

* write MB/s: ``KeyedSnapshotWriter`` (one block per key group, CRC32C each, offset index) to a local file, from
  lists of bytes and from ``Packed`` (``serialize_many``-style) input, against ``pickle.dumps`` (protocol 5) of the
  same per-key-group lists of bytes written to a file. All include the fsync'd close of ``open_write``.
* read MB/s: ``read_key_groups`` over all key groups (one ranged read, every block checksummed and parsed into
  memoryview slices; with ``copy=True``, into bytes; with ``read_key_group_offsets``, into int64 offset arrays),
  against reading the pickled file and ``pickle.loads`` (which builds bytes objects and checks nothing).
* rescaled restore: a checkpoint written by p subtasks restored by p' subtasks; per new subtask, the bytes read
  relative to its ideal share (total snapshot bytes x its key groups / max parallelism; target <= 1.1x), against
  reading every intersecting old file whole (what a format without a per-key-group index would need).

``--incremental``: a full checkpoint, then ``--checkpoints`` incremental ones, each updating ``--touch`` of the keys
(a few deleted), written with the format layer alone (``write_keyed_snapshot`` with the materialization policy's
``choose_full_key_groups`` at its defaults, ``carry_forward``, commits with retention). Printed: what each
checkpoint adds as a share of the live state, chain lengths, and for restores at new parallelisms, the bytes each new
subtask reads (its key groups' chains) over its share of the live state (the bytes of its key groups in a merged
full snapshot, the savepoint); target <= 1.2x after 20 checkpoints.

``--framing``: the per-key value framing of keyed state (``state/_codec.py``) alone: encode and decode of
``--entries`` / 4 list values (4 str elements each) and as many map values (4 str -> int64 entries each), with and
without TTL, and TTL cleanup on bytes (``drop_expired_bytes``, half the elements expired); elements or entries per
second, medians of ``--runs`` runs.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time

import numpy as np

from keygroups import KeyGroupRange, assign_key_groups, key_group_range
from keygroups.checkpoint import (
    CheckpointMetadata,
    CheckpointStorage,
    Packed,
    carry_forward,
    chain_stats,
    choose_full_key_groups,
    plan_keyed_restore,
    read_key_group_offsets,
    read_key_groups,
    write_keyed_snapshot,
)
from keygroups.serializers import Int64Serializer, StrSerializer
from keygroups.state._base import DEFAULT_DELTA_FRACTION, DEFAULT_MAX_CHAIN
from keygroups.state._codec import ValueFraming

from _util import measure

MAXP = 128
STATES = [{"name": "value", "kind": "value"}]


def make_groups(n: int, value_size: int) -> tuple[dict[int, tuple[list[bytes], list[bytes]]], int]:
    rng = np.random.default_rng(7)
    keys = rng.choice(np.iinfo(np.int64).max, size=n, replace=False).astype(np.int64)
    groups = assign_key_groups(keys, MAXP, "long")
    blob = rng.bytes(n * value_size)
    order = np.argsort(groups, kind="stable")
    out: dict[int, tuple[list[bytes], list[bytes]]] = {}
    key_bytes = keys.astype("<i8").tobytes()
    for i in order.tolist():
        ks, vs = out.setdefault(int(groups[i]), ([], []))
        ks.append(key_bytes[8 * i:8 * i + 8])
        vs.append(blob[value_size * i:value_size * (i + 1)])
    payload = n * (8 + value_size)
    return out, payload


def bench_write(storage, groups, r: KeyGroupRange, cid: int):
    t = time.perf_counter()
    h = write_keyed_snapshot(storage, cid, 0, r, STATES,
                             ((kg, [(0, *groups[kg])]) for kg in r if kg in groups))
    return time.perf_counter() - t, h


def pack(groups):
    out = {}
    for kg, (ks, vs) in groups.items():
        out[kg] = tuple(Packed(b"".join(x), np.cumsum([0] + [len(i) for i in x], dtype=np.int64)) for x in (ks, vs))
    return out


def bench_pickle_write(storage, groups, cid: int):
    t = time.perf_counter()
    rel = storage.new_file(cid, "pickle")
    with storage.open_write(rel) as f:
        f.write(pickle.dumps(groups, protocol=5))
    return time.perf_counter() - t, rel


def bench_read(storage, h, copy=False):
    t = time.perf_counter()
    blocks, nread = read_key_groups(storage, h, h.key_group_range, copy=copy)
    n = 0
    for block in blocks:
        for _, ks, vs in block.puts:
            n += len(vs)
    return time.perf_counter() - t, n, nread


def bench_read_offsets(storage, h):
    t = time.perf_counter()
    blocks, nread = read_key_group_offsets(storage, h, h.key_group_range)
    n = 0
    for block in blocks:
        for _, ko, vo in block.puts:
            n += len(vo) - 1
    return time.perf_counter() - t, n


def bench_pickle_read(storage, rel):
    t = time.perf_counter()
    groups = pickle.loads(storage.read_bytes(rel))
    n = sum(len(vs) for _, vs in groups.values())
    return time.perf_counter() - t, n


def rescale_figures(storage, groups, p_old: int, p_new: int, cid: int):
    handles = []
    for i in range(p_old):
        r = key_group_range(MAXP, p_old, i)
        handles.append(write_keyed_snapshot(storage, cid, i, r, STATES,
                                            ((kg, [(0, *groups[kg])]) for kg in r if kg in groups)))
    md = CheckpointMetadata(cid, "bench", 0, MAXP, p_old, handles)
    storage.commit(md)
    total = sum(h.size for h in handles)
    ratios, whole_ratios = [], []
    for j in range(p_new):
        r = key_group_range(MAXP, p_new, j)
        ideal = total * len(r) / MAXP
        read = 0
        whole = 0
        for h, part in plan_keyed_restore(md, r, max_parallelism=MAXP):
            blocks, nread = read_key_groups(storage, h, part)
            for _ in blocks:
                pass
            read += nread
            whole += h.size
        ratios.append(read / ideal)
        whole_ratios.append(whole / ideal)
    return ratios, whole_ratios


def incremental_figures(groups: dict[int, tuple[list[bytes], list[bytes]]], checkpoints: int, touch: float,
                        p: int, value_size: int, max_chain: int = 8, delta_fraction: float = 0.5) -> None:
    """Write a full checkpoint and ``checkpoints`` incremental ones at parallelism ``p``, then plan restores."""
    rng = np.random.default_rng(11)
    live = {kg: dict(zip(ks, vs)) for kg, (ks, vs) in groups.items()}
    n_entries = sum(len(e) for e in live.values())
    ranges = [key_group_range(MAXP, p, i) for i in range(p)]
    with tempfile.TemporaryDirectory(prefix="kg-bench-incr-") as d:
        storage = CheckpointStorage(d, retain=2)
        md = None
        added = []
        t = time.perf_counter()
        for cid in range(1, checkpoints + 2):
            handles = []
            written = 0
            dirty: dict[int, tuple[dict[bytes, bytes], list[bytes]]] = {}
            if cid > 1:
                kgs = sorted(live)
                for _ in range(int(n_entries * touch)):
                    kg = kgs[int(rng.integers(len(kgs)))]
                    entries = live[kg]
                    puts, deletes = dirty.setdefault(kg, ({}, []))
                    key = list(entries)[int(rng.integers(len(entries)))] if rng.random() < 0.9 else (
                        rng.integers(1 << 62).astype("<i8").tobytes())
                    if rng.random() < 0.05 and key in entries:
                        del entries[key]
                        puts.pop(key, None)
                        deletes.append(key)
                    else:
                        entries[key] = value = rng.bytes(value_size)
                        puts[key] = value
            for i, r in enumerate(ranges):
                if md is None:
                    full = set(r)
                else:   # the backend's policy: chains from the metadata, the worst materialized
                    full = choose_full_key_groups(chain_stats(md, r), len(r), max_chain=max_chain,
                                                  delta_fraction=delta_fraction)

                def items(r=r, full=full):
                    for kg in r:
                        if kg in full:
                            e = live.get(kg, {})
                            yield kg, [(0, list(e), list(e.values()))]
                        elif kg in dirty:
                            puts, deletes = dirty[kg]
                            yield kg, [(0, list(puts), list(puts.values()))], [(0, deletes)] if deletes else []
                h = write_keyed_snapshot(storage, cid, i, r, STATES, items(), full_key_groups=full)
                handles.append(h)
                written += h.size
            md = CheckpointMetadata(cid, "bench", 0, MAXP, p, carry_forward(md, handles))
            storage.commit(md)
            added.append(written)
        write_time = time.perf_counter() - t
        storage.savepoint(md, "live")
        merged = storage.load_savepoint("live")
        live_bytes = {kg: h.block_size(kg) for h in merged.keyed_handles for kg in h.key_group_range}
        total_live = sum(live_bytes.values())
        all_groups = KeyGroupRange(0, MAXP - 1)
        lengths = [c.length for c in chain_stats(md, all_groups).values()]
        print(f"incremental checkpoints: {n_entries:,} entries over {MAXP} key groups at p={p}; a full checkpoint, "
              f"then {checkpoints} each updating {touch:.1%} of the keys (5% of those deleted); policy max_chain={max_chain}, "
              f"delta_fraction={delta_fraction}; {write_time:.1f} s to write all")
        print(f"  live state {total_live / 1e6:.2f} MB (merged full snapshot); checkpoint 1 wrote "
              f"{added[0] / total_live:.2f}x of it; each incremental one wrote {statistics.median(added[1:]) / total_live:.1%} "
              f"(median), {max(added[1:]) / total_live:.1%} (max), {statistics.mean(added[-10:]) / total_live:.1%} "
              f"(mean of the last 10)")
        print(f"  chains after checkpoint {md.checkpoint_id}: {min(lengths)}-{max(lengths)} blocks "
              f"(mean {statistics.mean(lengths):.1f}); {len(md.keyed_handles)} keyed files referenced, "
              f"{len(storage.shared_files())} in shared/")
        print("  restore at a new parallelism: bytes read per new subtask / its share of the live state "
              "(target <= 1.2x)")
        print(f"  {'p -> p_new':14}{'max':>8}{'median':>9}{'reads max':>11}")
        for p_new in (1, 3, 5, 8):
            ratios, reads = [], []
            for j in range(p_new):
                r = key_group_range(MAXP, p_new, j)
                plan = plan_keyed_restore(md, r, max_parallelism=MAXP)
                read = sum(h.byte_range(part)[1] - h.byte_range(part)[0] for h, part in plan)
                ratios.append(read / sum(live_bytes[kg] for kg in r))
                reads.append(len(plan))
            print(f"  {f'{p} -> {p_new}':14}{max(ratios):8.3f}{statistics.median(ratios):9.3f}{max(reads):11}")


def framing_figures(entries: int, runs: int) -> None:
    """Encode, decode and TTL cleanup of list and map values, per element or entry (see ``--framing``)."""
    keys = entries // 4
    sers = {"element": StrSerializer(), "map key": StrSerializer(), "map value": Int64Serializer()}
    lists = [[f"event-{k}-{j}" for j in range(4)] for k in range(keys)]
    maps = [{f"field-{j}": k * 4 + j for j in range(4)} for k in range(keys)]
    print(f"value framing, {keys:,} list values (4 str elements) and {keys:,} map values (4 str -> int64 entries); "
          f"elements or entries per second, medians of {runs} runs")
    print(f"{'':14}{'encode':>14}{'decode':>14}{'ttl cleanup':>14}")
    for kind, plain in (("list", lists), ("map", maps)):
        for ttl in (False, True):
            framing = ValueFraming.for_state("s", kind, sers, ttl=ttl)
            if not ttl:
                values = plain
            elif kind == "list":
                values = [[(e, 1000 + j) for j, e in enumerate(v)] for v in plain]
            else:
                values = [{f: (x, 1000 + j) for j, (f, x) in enumerate(v.items())} for v in plain]
            encoded = [framing.encode(v) for v in values]
            assert [framing.decode(b) for b in encoded[:100]] == values[:100]
            fns = {"encode": lambda f=framing, vs=values: [f.encode(v) for v in vs],
                   "decode": lambda f=framing, bs=encoded: [f.decode(b) for b in bs]}
            if ttl:
                fns["ttl cleanup"] = lambda f=framing, bs=encoded: [f.drop_expired_bytes(b, 1001) for b in bs]
            t = measure(fns, runs, warmup=1, keep_results=False)
            cells = "".join(f"{4 * keys / t[n].seconds:14,.0f}" if n in t else f"{'':14}"
                            for n in ("encode", "decode", "ttl cleanup"))
            print(f"{kind + (' + ttl' if ttl else ''):14}{cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--value-size", type=int, default=24)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--incremental", action="store_true", help="chains of incremental checkpoints (see above)")
    ap.add_argument("--framing", action="store_true", help="the per-key value framing alone (see above)")
    ap.add_argument("--checkpoints", type=int, default=20)
    ap.add_argument("--touch", type=float, default=0.01)
    ap.add_argument("--parallelism", type=int, default=4)
    ap.add_argument("--max-chain", type=int, default=DEFAULT_MAX_CHAIN,
                    help=f"the policy's (the backends' default: {DEFAULT_MAX_CHAIN})")
    ap.add_argument("--delta-fraction", type=float, default=DEFAULT_DELTA_FRACTION,
                    help=f"the policy's (the backends' default: {DEFAULT_DELTA_FRACTION})")
    args = ap.parse_args()
    if args.framing:
        framing_figures(args.entries, args.runs)
        return
    if args.incremental:
        groups, _ = make_groups(args.entries, args.value_size)
        incremental_figures(groups, args.checkpoints, args.touch, args.parallelism, args.value_size,
                            args.max_chain, args.delta_fraction)
        return

    groups, payload = make_groups(args.entries, args.value_size)
    r = KeyGroupRange(0, MAXP - 1)
    with tempfile.TemporaryDirectory(prefix="kg-bench-") as d:
        storage = CheckpointStorage(d, retain=100)
        packed = pack(groups)
        w, wp, pw, rd, rdc, rdo, prd = [], [], [], [], [], [], []
        for run in range(args.runs):
            t, h = bench_write(storage, groups, r, 2 * run + 1)
            w.append(t)
            t, hp = bench_write(storage, packed, r, 2 * run + 2)
            assert hp.size == h.size
            wp.append(t)
            t, rel = bench_pickle_write(storage, groups, 2 * run + 1)
            pw.append(t)
            t, n, nread = bench_read(storage, h)
            assert n == args.entries
            rd.append(t)
            t, n, _ = bench_read(storage, h, copy=True)
            assert n == args.entries
            rdc.append(t)
            t, n = bench_read_offsets(storage, h)
            assert n == args.entries
            rdo.append(t)
            t, n2 = bench_pickle_read(storage, rel)
            assert n2 == args.entries
            prd.append(t)
        size = h.size
        pickle_size = storage.file_size(rel)
        mb = size / 1e6
        print(f"keyed snapshot format, {args.entries:,} entries ({args.value_size}-byte values, 8-byte keys) over "
              f"{MAXP} key groups; file {size / 1e6:.1f} MB (pickle {pickle_size / 1e6:.1f} MB), payload "
              f"{payload / 1e6:.1f} MB; medians of {args.runs} runs; python {sys.version.split()[0]}, "
              f"{os.cpu_count()} cpus")
        print(f"{'':34}{'keygroups':>14}{'baseline':>14}{'ratio':>9}   baseline")
        wm, pwm = statistics.median(w), statistics.median(pw)
        rm, prm = statistics.median(rd), statistics.median(prd)
        print(f"{'write MB/s':34}{mb / wm:14.0f}{pickle_size / 1e6 / pwm:14.0f}{(mb / wm) / (pickle_size / 1e6 / pwm):9.2f}"
              f"   pickle.dumps protocol 5 + write")
        wpm = statistics.median(wp)
        print(f"{'write MB/s (Packed input)':34}{mb / wpm:14.0f}{pickle_size / 1e6 / pwm:14.0f}"
              f"{(mb / wpm) / (pickle_size / 1e6 / pwm):9.2f}   pickle.dumps protocol 5 + write")
        print(f"{'read MB/s (all groups, verified)':34}{mb / rm:14.0f}{pickle_size / 1e6 / prm:14.0f}"
              f"{(mb / rm) / (pickle_size / 1e6 / prm):9.2f}   read + pickle.loads")
        rcm = statistics.median(rdc)
        print(f"{'read MB/s (copy=True: bytes)':34}{mb / rcm:14.0f}{pickle_size / 1e6 / prm:14.0f}"
              f"{(mb / rcm) / (pickle_size / 1e6 / prm):9.2f}   read + pickle.loads")
        rom = statistics.median(rdo)
        print(f"{'read MB/s (offset arrays)':34}{mb / rom:14.0f}{pickle_size / 1e6 / prm:14.0f}"
              f"{(mb / rom) / (pickle_size / 1e6 / prm):9.2f}   read + pickle.loads")
        print(f"{'write entries/s':34}{args.entries / wm:14,.0f}{args.entries / pwm:14,.0f}{pwm / wm:9.2f}")
        print(f"{'read entries/s (memoryview)':34}{args.entries / rm:14,.0f}{args.entries / prm:14,.0f}{prm / rm:9.2f}")
        print(f"{'read entries/s (copy=True)':34}{args.entries / rcm:14,.0f}{args.entries / prm:14,.0f}"
              f"{prm / rcm:9.2f}")
        print()
        print("rescaled restore: bytes read per new subtask / its ideal share (total x key groups / max parallelism)")
        print(f"{'p -> p_new':14}{'keygroups max':>15}{'median':>9}{'whole files max':>17}{'median':>9}   target <= 1.1x")
        cid = 1000
        for p_old, p_new in [(4, 3), (2, 4), (3, 1), (1, 7), (15, 77), (77, 15)]:
            ratios, whole = rescale_figures(storage, groups, p_old, p_new, cid)
            cid += 1
            print(f"{f'{p_old} -> {p_new}':14}{max(ratios):15.3f}{statistics.median(ratios):9.3f}"
                  f"{max(whole):17.2f}{statistics.median(whole):9.2f}")


if __name__ == "__main__":
    main()
