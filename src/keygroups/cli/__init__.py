"""The ``keygroups`` command: ``demo`` (the main job), ``inspect`` (a checkpoint), ``plan`` (a rescale), ``verify``
(read every file of a checkpoint), ``dashboard`` (a job's metrics as one HTML page)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from keygroups import __version__
from keygroups.cli import plot
from keygroups.cli.arguments import add_storage_options, whole_number
from keygroups.errors import CorruptDataError, KeyGroupsError

# Packages of object-store clients under fsspec whose own exceptions (not OSError) mean "could not reach the store".
_STORAGE_CLIENTS = frozenset({"botocore", "aiobotocore", "s3fs", "gcsfs", "google", "adlfs", "azure"})


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The storage at ``args.location`` and the asked-for checkpoint (default: the latest complete one)."""
    from keygroups.checkpoint import CheckpointStorage

    storage = CheckpointStorage(args.location, storage_options=args.storage_options)
    if getattr(args, "savepoint", None) is not None:
        return storage, storage.load_savepoint(args.savepoint)
    metadata = storage.load(args.checkpoint) if args.checkpoint is not None else storage.latest()
    if metadata is None:
        print(f"no complete checkpoint under {args.location}", file=sys.stderr)
    return storage, metadata


def _timers(storage: Any, metadata: Any) -> dict[str, Any]:
    """Per time domain: the timers registered at ``metadata`` in total, the earliest, and how many per key group
    (read from the hidden timer states: every key group's chain is read when the checkpoint holds timers)."""
    from keygroups.runtime.state_reader import timer_counts
    from keygroups.state.timers import TimeDomain

    counts = timer_counts(storage, metadata).to_pylist()
    out: dict[str, Any] = {}
    for domain in TimeDomain:
        rows = [r for r in counts if r["domain"] == domain.value]
        out[domain.value] = {"total": sum(r["timers"] for r in rows),
                             "earliest": min((r["earliest"] for r in rows), default=None),
                             "per_key_group": {r["key_group"]: r["timers"] for r in rows}}
    return out


#: How many of the latest retained checkpoints ``inspect`` shows the batch figures of.
RECENT_BATCHES = 5


def _recent_reports(storage: Any, metadata: Any) -> list[Any]:
    """The batch reports of the retained checkpoints up to ``metadata`` (the newest :data:`RECENT_BATCHES`), oldest
    first: each reads one ``_metadata`` file, no state."""
    from keygroups.runtime.report import BatchReport

    ids = [i for i in storage.checkpoint_ids() if i <= metadata.checkpoint_id][-RECENT_BATCHES:]
    return [BatchReport.from_checkpoint(metadata if i == metadata.checkpoint_id else storage.load(i)) for i in ids]


def _is_internal(state_name: str) -> bool:
    """States keygroups keeps for itself (the timer queues, ``_timers/...``), not the function's."""
    return state_name.startswith("_")


def _inspect(args: argparse.Namespace) -> int:
    from keygroups.runtime.report import format_time

    storage, metadata = _load(args)
    if metadata is None:
        return 1
    timers = _timers(storage, metadata) if args.timers else {}
    reports = _recent_reports(storage, metadata)
    latest = reports[-1] if reports else None
    states = {s["name"]: s.get("kind", "?") for h in metadata.keyed_handles for s in h.states
              if args.internal or not _is_internal(s["name"])}
    if args.json:
        print(json.dumps({"checkpoint_id": metadata.checkpoint_id, "job_id": metadata.job_id,
                          "max_parallelism": metadata.max_parallelism, "parallelism": metadata.parallelism,
                          "watermark": latest.watermark_after if latest else None,
                          "records_late": latest.records_late if latest else 0,
                          "states": states,
                          "keyed_handles": [h.to_json() for h in metadata.keyed_handles],
                          "operator_handles": [h.to_json() for h in metadata.operator_handles],
                          "raw_keyed_handles": [h.to_json() for h in metadata.raw_keyed_handles],
                          "timers": timers, "ranges": _range_figures(metadata),
                          "source_positions": [dataclasses.asdict(p) for p in _positions(storage, metadata)],
                          "recent_batches": [r.to_dict() for r in reports]}, indent=2))
        return plot.run(args, storage, metadata)
    print(f"checkpoint {metadata.checkpoint_id} of job {metadata.job_id!r}: parallelism {metadata.parallelism}, "
          f"max parallelism {metadata.max_parallelism}; complete checkpoints: {storage.checkpoint_ids()}")
    if latest is not None:
        late = sum(r.records_late for r in reports)
        print(f"watermark {format_time(latest.watermark_after)}; late records: {latest.records_late:,} in this "
              f"checkpoint, {late:,} in the last {len(reports)}")
    hidden = "" if args.internal else " (internal states hidden: --internal shows them)"
    print(f"keyed state: {', '.join(f'{n} ({k})' for n, k in sorted(states.items())) or 'none'}{hidden}")
    for line in _record_schemas(metadata):
        print(line)
    for h in metadata.keyed_handles:
        print(f"  subtask {h.subtask}: key groups {h.key_group_range.start}-{h.key_group_range.end}, {h.size:,} bytes"
              f" in {h.file}")
    _print_ranges(metadata)
    for oh in metadata.operator_handles:
        names = ", ".join(f"{name} ({meta.mode}, {len(meta)} elements)" for name, meta in sorted(oh.states.items()))
        print(f"  operator state of subtask {oh.subtask}: {oh.size:,} bytes: {names}")
    _print_positions(_positions(storage, metadata))
    for rh in metadata.raw_keyed_handles:
        print(f"  raw keyed state of subtask {rh.subtask}: key groups {rh.key_group_range.start}-"
              f"{rh.key_group_range.end}, {rh.size:,} bytes in {rh.file}")
    for domain, t in timers.items():
        if not t["total"]:
            print(f"timers ({domain}): none")
            continue
        groups = " ".join(f"{kg}:{n}" for kg, n in sorted(t["per_key_group"].items()))
        print(f"timers ({domain}): {t['total']:,} in {len(t['per_key_group'])} key groups, earliest {t['earliest']} "
              f"({format_time(t['earliest'])}); per key group: {groups}")
    if reports:
        print(f"last {len(reports)} batches:")
        for r in reports:
            print(f"  {r.summary()}")
    return plot.run(args, storage, metadata)


def _positions(storage: Any, metadata: Any) -> list[Any]:
    """The source splits the checkpoint's operator state holds (Kafka's and the file log's)."""
    from keygroups.sources import source_positions

    return source_positions(storage, metadata)


def _print_positions(positions: list[Any]) -> None:
    """One line per topic (or log): each partition's next offset and the subtask that holds it."""
    by_topic: dict[Any, list[Any]] = {}
    for p in positions:
        by_topic.setdefault(p.topic, []).append(p)
    for topic, splits in by_topic.items():
        what = f"Kafka topic {topic!r}" if topic is not None else "log"
        parts = " ".join(f"{p.partition}:{p.offset}@{p.subtask}" for p in splits)
        print(f"source positions, {what} (partition:next offset@subtask): {parts}")


def _range_figures(metadata: Any) -> dict[str, Any]:
    """The checkpoint's key-group ranges with each one's load (records and timers decayed over the last batches,
    state bytes), and why the ranges are what they are (the assignment's decision, when recorded)."""
    from keygroups.runtime.assignment import DECISION_PROPERTY, checkpoint_boundaries, checkpoint_loads, range_loads

    b = checkpoint_boundaries(metadata)
    loads = checkpoint_loads(metadata)
    records, timers, state = (range_loads(a, b) for a in (loads.records, loads.timers, loads.state_bytes))
    return {"boundaries": list(b), "decision": metadata.properties.get(DECISION_PROPERTY),
            "per_range": [{"subtask": i, "key_groups": [b[i], b[i + 1] - 1], "records": round(float(records[i]), 1),
                           "timers": round(float(timers[i]), 1), "state_bytes": int(state[i])}
                          for i in range(len(b) - 1)]}


def _print_ranges(metadata: Any) -> None:
    figures = _range_figures(metadata)
    decision = figures["decision"] or {}
    print(f"key-group ranges ({decision.get('assignment', 'flink')}): {decision.get('reason', 'not recorded')}")
    for r in figures["per_range"]:
        print(f"  subtask {r['subtask']}: key groups {r['key_groups'][0]}-{r['key_groups'][1]}, records "
              f"{r['records']:,.0f}, timers fired {r['timers']:,.0f} (decayed over the last batches), state "
              f"{r['state_bytes']:,} B")
    if decision:
        print(f"  load max/mean {decision['max_over_mean']} (before: {decision['max_over_mean_before']}, Flink's "
              f"ranges: {decision['flink_max_over_mean']}); moved {decision['moved_key_groups']} key groups holding "
              f"{decision['moved_bytes']:,} B; ranges that changed hold {decision['restore_bytes']:,} B")
        for hot in decision.get("hot_key_groups", []):
            print(f"  {_hot_note(hot)}")


def _hot_note(hot: dict[str, Any]) -> str:
    suggested = hot.get("suggested_max_parallelism")
    remedy = (f"a max parallelism of {suggested} would split it (if its load is spread over several keys)"
              if suggested else "no allowed max parallelism splits it enough")
    return (f"key group {hot['key_group']} alone carries {hot['times_mean']:.2f}x a subtask's mean load: no ranges "
            f"can split it; {remedy}")
def _record_schemas(metadata: Any) -> list[str]:
    """One line per keyed state stored as records: its role (value, element, map value) and schema, as Spark DDL."""
    from keygroups.serializers.schema import RecordType

    lines = {}
    for h in sorted(metadata.keyed_handles, key=lambda h: h.checkpoint_id):   # the newest meta of each state wins
        for meta in h.states:
            for role, stored in sorted(meta.get("serializers", {}).items()):
                if role != "key" and stored.get("identifier") == "record":
                    try:
                        ddl = RecordType.from_json(stored.get("config", {}).get("schema")).fields_ddl()
                    except KeyGroupsError as e:
                        ddl = f"unreadable ({e})"
                    lines[(meta["name"], role)] = f"  {meta['name']} {role}: record<{ddl}>"
    return [lines[k] for k in sorted(lines)]




def _plan(args: argparse.Namespace) -> int:
    from keygroups._ranges import key_group_range
    from keygroups.checkpoint import chain_stats, check_restore_max_parallelism, parent_key_groups, plan_keyed_restore

    storage, metadata = _load(args)
    if metadata is None:
        return 1
    old = metadata.max_parallelism
    mp = old if args.max_parallelism is None else check_restore_max_parallelism(metadata, args.max_parallelism)
    if args.parallelism > mp:
        whose = f"checkpoint {metadata.checkpoint_id}'s max parallelism" if mp == old else "the new max parallelism"
        print(f"keygroups plan: parallelism {args.parallelism} is above {whose} {mp}; give a parallelism from 1 "
              f"to {mp}", file=sys.stderr)
        return 2
    from keygroups.runtime.assignment import resolve_assignment

    decision = resolve_assignment(args.assignment).choose(metadata, mp, args.parallelism)
    everything = key_group_range(old, 1, 0)
    chains = chain_stats(metadata, everything)
    total = sum(c.full_bytes + c.delta_bytes for c in chains.values())   # what restoring every key group reads
    files = {h.file for h in metadata.keyed_handles}
    change = "" if mp == old else (f" -> {mp}: each key group split in {mp // old}, a new one reads its parent"
                                   if mp > old else f" -> {mp}: key groups merged {old // mp} into 1, a new one "
                                                    "reads those it merges")
    print(f"checkpoint {metadata.checkpoint_id}: p={metadata.parallelism} -> p'={args.parallelism} "
          f"(max parallelism {old}{change}), {total:,} bytes of keyed state in the chains of {len(chains)} key "
          f"groups, {len(files)} keyed files")
    print(f"ranges ({decision.assignment}): {decision.reason}; load max/mean {decision.max_over_mean:.3f} (Flink's "
          f"ranges: {decision.flink_max_over_mean:.3f}); {decision.moved_key_groups} key groups change owner, "
          f"holding {decision.moved_bytes:,} B")
    for hot in decision.hot_key_groups:
        print(f"  {_hot_note(hot.to_json())}")
    for i, own in enumerate(decision.ranges):
        reads = []
        nbytes = 0
        for handle, part in plan_keyed_restore(metadata, own, max_parallelism=mp):
            start, end = handle.byte_range(part)
            size = end - start
            nbytes += size
            full = sum(handle.is_full(kg) for kg in part)
            kind = "full" if full == len(part) else "delta" if not full else f"{full} full"
            reads.append(f"{handle.file} (checkpoint {handle.checkpoint_id}, old subtask {handle.subtask}, {kind}) "
                         f"groups {part.start}-{part.end} ({size:,} B)")
        parents = parent_key_groups(own, old, mp)
        lengths = [chains[kg].length for r in parents for kg in r if kg in chains]
        chain_note = (f"chains of {min(lengths)}-{max(lengths)} blocks (mean {sum(lengths) / len(lengths):.1f})"
                      if lengths else "no state")
        if mp != old:
            chain_note += f"; old key groups {', '.join(f'{r.start}-{r.end}' for r in parents)}"
        print(f"  new subtask {i} (key groups {own.start}-{own.end}): reads {nbytes:,} bytes in {len(reads)} ranged "
              f"reads, {nbytes / max(total, 1) * args.parallelism:.2f}x its even share; {chain_note}")
        for read in reads:
            print(f"    {read}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Read every file the checkpoint references, whole, through the same checked readers a restore uses, and check
    each handle against its file: the size, the offsets of every key group (or element block), the key groups and,
    for keyed files, which blocks are full, the file's id and each block's checksum and predecessor (keyed format
    4); then that every key group's chain starts with the block its deltas apply to, and that each delta applies on
    the block before it (no delta lost, none of another run). Each problem names the file, its handle and what is
    wrong; exit 1 if there is any."""
    from keygroups import KeyGroupRange
    from keygroups.checkpoint import open_raw_keyed, open_snapshot, plan_operator_restore, read_operator_runs
    from keygroups.checkpoint.metadata import NOT_RECORDED, keyed_handles_by_range
    from keygroups.checkpoint.planning import (
        baseless_deltas,
        chain_breaks,
        describe_baseless,
        describe_breaks,
        key_group_chains,
    )
    from keygroups.checkpoint.raw_keyed import BLOCK_OVERHEAD, HEADER_SIZE

    storage, metadata = _load(args)
    if metadata is None:
        return 1
    problems = []
    checked = 0

    def check(what: str, read: Any) -> None:
        nonlocal checked
        checked += 1
        try:
            read()
        except FileNotFoundError:
            problems.append(f"{what}: missing from {storage.location}")
        except (CorruptDataError, OSError, ValueError) as e:
            problems.append(f"{what}: {e}")

    def sized(handle: Any) -> None:
        size = storage.file_size(handle.file)
        if size != handle.size:
            raise CorruptDataError(f"the file is {size} bytes, its handle says {handle.size}")

    def keyed(handle: Any) -> None:
        sized(handle)
        snapshot = open_snapshot(storage.read_bytes(handle.file))
        if snapshot.key_group_range != handle.key_group_range:
            raise CorruptDataError(f"holds key groups {snapshot.key_group_range}, its handle says "
                                   f"{handle.key_group_range}")
        if snapshot.version != handle.format_version:
            raise CorruptDataError(f"is of keyed format {snapshot.version}, its handle says {handle.format_version}")
        if list(snapshot.offsets) != list(handle.offsets):
            wrong = next(i for i, (a, b) in enumerate(zip(snapshot.offsets, handle.offsets)) if a != b)
            where = (f"key group {handle.key_group_range.start + wrong}" if wrong < len(handle.key_group_range)
                     else "the end of the last block")
            raise CorruptDataError(f"its index puts {where} at byte {snapshot.offsets[wrong]}, its handle says "
                                   f"{handle.offsets[wrong]}")
        if snapshot.states != handle.states:
            raise CorruptDataError("its header's state meta differs from its handle's")
        if snapshot.file_id != handle.file_id:
            raise CorruptDataError(f"its header names file id {snapshot.file_id}, its handle {handle.file_id}: the "
                                   "file was replaced by another (of another run or attempt?)")
        got = snapshot.checksums()
        if handle.checksums is not None and any(a != b and b != NOT_RECORDED for a, b in zip(got, handle.checksums)):
            i = next(i for i, (a, b) in enumerate(zip(got, handle.checksums)) if a != b and b != NOT_RECORDED)
            raise CorruptDataError(f"key group {handle.key_group_range.start + i}'s block stores checksum "
                                   f"{got[i]:#010x}, its handle names {handle.checksums[i]:#010x}")
        for block in snapshot.key_groups():   # each block's checksum (with the header's file id) and structure
            kg = block.key_group
            if block.full != handle.is_full(kg):
                raise CorruptDataError(f"key group {kg}'s block is {'full' if block.full else 'a delta'}, "
                                       f"its handle says {'full' if handle.is_full(kg) else 'a delta'}")
            if (block.predecessor is not None and block.predecessor != handle.predecessor(kg)
                    and handle.checksum(kg) is not None):   # a quiet block read from version 7 names none
                raise CorruptDataError(f"key group {kg}'s delta block applies on {block.predecessor}, its handle says "
                                       f"{handle.predecessor(kg) or 'on no earlier block'}")

    def raw_keyed(handle: Any) -> None:
        sized(handle)
        key_groups, payloads = open_raw_keyed(storage.read_bytes(handle.file))   # every block's checksum
        if key_groups != handle.key_group_range:
            raise CorruptDataError(f"holds key groups {key_groups}, its handle says {handle.key_group_range}")
        offset = HEADER_SIZE
        for kg, payload, said in zip(key_groups, payloads, handle.offsets):
            if said != offset:
                raise CorruptDataError(f"key group {kg}'s block starts at byte {offset}, its handle says {said}")
            offset += BLOCK_OVERHEAD + len(payload)

    def operator(handle: Any) -> None:
        sized(handle)
        runs = plan_operator_restore([handle], 1, operator_id=handle.operator_id)[0]
        read_operator_runs(storage, [handle], runs)

    for h in metadata.keyed_handles:
        check(f"keyed state file {h.file} (handle of subtask {h.subtask}, written by checkpoint {h.checkpoint_id})",
              lambda h=h: keyed(h))
    for oh in metadata.operator_handles:
        check(f"operator state file {oh.file} (handle of subtask {oh.subtask})", lambda oh=oh: operator(oh))
    _print_positions(_positions(storage, metadata))
    for rh in metadata.raw_keyed_handles:
        check(f"raw keyed state file {rh.file} (handle of subtask {rh.subtask})", lambda rh=rh: raw_keyed(rh))
    for f in metadata.runner_files():
        check(f"output, input or late output file {f}", lambda f=f: storage.file_size(f))
    everything = KeyGroupRange(0, metadata.max_parallelism - 1)
    ordered = keyed_handles_by_range(metadata.keyed_handles)
    chains = key_group_chains(ordered, everything)
    baseless = baseless_deltas(chains)
    if baseless:
        problems.append(f"keyed state chains: {describe_baseless(metadata.checkpoint_id, baseless)}")
    breaks = chain_breaks(ordered, [everything])
    if breaks:
        problems.append(f"keyed state chains: {describe_breaks(metadata.checkpoint_id, breaks)}")
    for problem in problems:
        print(f"CORRUPT {problem}", file=sys.stderr)
    print(f"checkpoint {metadata.checkpoint_id}: {checked} files read, {len(problems)} corrupt or missing")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keygroups", description=__doc__)
    parser.add_argument("--version", action="version", version=f"keygroups {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from keygroups.cli import demo

    demo.add_parser(sub)
    from keygroups.cli import flink

    flink.add_parser(sub)
    from keygroups.cli import dashboard

    dashboard.add_parser(sub)
    p = sub.add_parser("inspect", help="describe a checkpoint (the latest complete one by default)")
    p.add_argument("location", help="checkpoint directory (local path or fsspec URL)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--checkpoint", type=whole_number(0), help="checkpoint id (default: latest complete)")
    which.add_argument("--savepoint", help="inspect this savepoint of the location instead (savepoints/NAME)")
    p.add_argument("--json", action="store_true", help="print the handles as JSON")
    p.add_argument("--no-timers", dest="timers", action="store_false",
                   help="do not count the timers (which reads every key group's chain when the checkpoint holds "
                        "timers); print what the metadata says only")
    p.add_argument("--internal", action="store_true",
                   help="also list the states keygroups keeps for itself (the timer queues, _timers/...)")
    add_storage_options(p)
    plot.add_arguments(p)
    p.set_defaults(run=_inspect)
    p = sub.add_parser("plan", help="show what each subtask would read when restoring at another parallelism (or "
                                    "max parallelism)")
    p.add_argument("location", help="checkpoint directory (local path or fsspec URL)")
    p.add_argument("parallelism", type=whole_number(1), help="the new parallelism")
    p.add_argument("--checkpoint", type=whole_number(0), help="checkpoint id (default: latest complete)")
    p.add_argument("--max-parallelism", type=whole_number(1), default=None,
                   help="the new max parallelism: the checkpoint's multiplied or divided by an integer factor "
                        "(default: unchanged)")
    p.add_argument("--assignment", choices=["flink", "balanced"], default="flink",
                   help="the key-group ranges to plan: Flink's equal ranges (default) or balanced by the "
                        "checkpoint's measured load")
    add_storage_options(p)
    p.set_defaults(run=_plan)
    p = sub.add_parser("verify", help="read every file of a checkpoint through its checksums; exit 1 if any is "
                                      "corrupt or missing")
    p.add_argument("location", help="checkpoint directory (local path or fsspec URL)")
    p.add_argument("--checkpoint", type=whole_number(0), help="checkpoint id (default: latest complete)")
    add_storage_options(p)
    p.set_defaults(run=_verify)
    args = parser.parse_args(argv)
    run: Any = args.run
    try:
        return int(run(args) or 0)
    except (KeyGroupsError, OSError, ValueError) as e:
        # a missing or damaged checkpoint, an unreadable path, an unknown URL scheme: say what is wrong, not where
        # in our code
        print(f"keygroups {args.command}: {e}", file=sys.stderr)
        return 2
    except TypeError as e:
        # fsspec hands storage options on to the filesystem's client, which refuses an unknown one at its first
        # request; without options a TypeError is a bug of ours, to be seen whole
        if not args.storage_options:
            raise
        print(f"keygroups {args.command}: the storage options {sorted(args.storage_options)} were "
              f"not accepted ({e}); give only options of the location's fsspec filesystem", file=sys.stderr)
        return 2
    except Exception as e:
        # the object store's client library refusing the request (botocore's NoCredentialsError is no OSError)
        if type(e).__module__.split(".")[0] not in _STORAGE_CLIENTS:
            raise
        location = getattr(args, "location", None) or args.dir
        print(f"keygroups {args.command}: the storage client could not reach {location}: {type(e).__name__}: {e}; "
              "give its endpoint and credentials with --storage-option or in the environment (AWS_ENDPOINT_URL, "
              "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY for s3://)", file=sys.stderr)
        return 2
