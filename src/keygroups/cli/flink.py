"""``keygroups flink``: move a job's state between Flink and keygroups.

``keygroups flink import SAVEPOINT LOCATION --name NAME --uid UID [--operator-state-uid UID2] [--skip-state S]
[--field-names STATE=A,B] [--watermark MS|ISO] [--windows operator|state] [--window-records DDL]``
writes Flink operator UID's keyed state, timers and operator state (UID2's operator state when given) as the keygroups
savepoint LOCATION/savepoints/NAME, which ``KeyedJob(..., restore_from_savepoint=NAME)`` continues from (its first
batch from the watermark given: Flink's savepoint holds none). State files outside the savepoint directory are read
only with ``--allow-paths-outside`` (import, export's ``--like``, list).
``keygroups flink export LOCATION (--savepoint NAME | --checkpoint ID) DEST --uid UID [--operator-state-uid UID2]
[--like FLINK_SAVEPOINT] [--compression] [--windows operator|state] [--window-state STATE=KIND] [--window-records DDL]
[--allowed-lateness MS]`` writes keygroups state as a Flink canonical savepoint DEST that Flink restores into a job
whose operator has uid UID (window state and timers as a ``WindowOperator``'s). ``keygroups flink list SAVEPOINT``
lists a Flink savepoint.
"""

from __future__ import annotations

import argparse
from typing import Any

from keygroups.cli.arguments import add_storage_options


def _windows(args: argparse.Namespace) -> Any:
    """The ``FlinkWindows`` of the window options, None when none is given."""
    from keygroups.flink.windows import FlinkWindows

    states = dict(getattr(args, "window_state", None) or ()) or None
    lateness = getattr(args, "allowed_lateness", None)
    if args.windows is None and args.window_records is None and states is None and lateness is None:
        return None
    return FlinkWindows(layout=args.windows or "operator", record_schema=args.window_records, states=states,
                        allowed_lateness=lateness or 0)


def _ddl_schema(text: str) -> Any:
    import pyarrow as pa

    from keygroups.errors import KeyGroupsError
    from keygroups.serializers.schema_formats import parse_ddl, to_arrow

    try:
        return pa.schema(list(to_arrow(parse_ddl(text))))
    except (ValueError, TypeError, KeyGroupsError) as e:
        raise argparse.ArgumentTypeError(f"--window-records takes the records' columns as Spark DDL "
                                         f"('k long, t long, n long'): {e}") from None


def _window_state(text: str) -> tuple[str, str]:
    state, sep, kind = text.partition("=")
    if not sep or not state or not kind:
        raise argparse.ArgumentTypeError(f"--window-state takes STATE=KIND (e.g. window-contents=reducing), got "
                                         f"{text!r}")
    return state, kind


def _add_window_options(p: Any, export: bool) -> None:
    p.add_argument("--windows", choices=["operator", "state"], help="window state (TimeWindow namespaces) as "
                   "keygroups.windows' operator keeps it (default), or as Flink has it, for a function of your own")
    p.add_argument("--window-records", type=_ddl_schema, metavar="DDL",
                   help="the columns of a process window function's records (Spark DDL)")
    if export:
        p.add_argument("--window-state", action="append", type=_window_state, metavar="STATE=KIND",
                       help="a window state and its Flink kind (value, list, map, reducing, aggregating; repeatable;"
                            " default: --like's states in TimeWindow namespaces)")
        p.add_argument("--allowed-lateness", type=int, metavar="MS",
                       help="the windows' allowed lateness: places their cleanup timers")


def _watermark(text: str) -> int:
    from keygroups.flink.importer import parse_watermark

    try:
        return parse_watermark(text, "--watermark")
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _import(args: argparse.Namespace) -> int:
    from keygroups.flink.importer import import_savepoint

    ttl = args.ttl_ms if args.ttl_ms is not None else None
    kwargs: dict[str, Any] = {} if ttl is None else {"ttl_ms": ttl}
    if args.field_names:
        kwargs["field_names"] = dict(args.field_names)
    r = import_savepoint(args.savepoint, args.location, args.name, uid=args.uid,
                         operator_state_uid=args.operator_state_uid, skip_states=args.skip_state or (),
                         windows=_windows(args), watermark=args.watermark,
                         allow_paths_outside=args.allow_paths_outside, storage_options=args.storage_options,
                         **kwargs)
    print(f"imported Flink operator {args.uid!r} into {r.savepoint}: parallelism {r.parallelism}, max parallelism "
          f"{r.max_parallelism}, {r.key_groups} key groups, {r.entries} entries, {r.timers} timers, keyed states "
          f"{', '.join(r.keyed_states) or 'none'}; operator states {', '.join(r.operator_states) or 'none'}"
          + (f"; skipped {', '.join(r.skipped_states)}" if r.skipped_states else "")
          + (f"; watermark {r.watermark}" if r.watermark is not None else "; no watermark (give --watermark for "
             "event time)"))
    return 0


def _export(args: argparse.Namespace) -> int:
    from keygroups.flink.exporter import export_savepoint

    r = export_savepoint(args.location, args.dest, uid=args.uid, savepoint=args.savepoint,
                         checkpoint_id=args.checkpoint, operator_state_uid=args.operator_state_uid, like=args.like,
                         skip_states=args.skip_state or (), compression=args.compression,
                         windows=_windows(args), allow_paths_outside=args.allow_paths_outside,
                         storage_options=args.storage_options)
    print(f"exported to Flink savepoint {r.savepoint} for operator uid {args.uid!r}: parallelism {r.parallelism}, "
          f"max parallelism {r.max_parallelism}, {r.key_groups} key groups, {r.entries} entries, {r.timers} timers, "
          f"keyed states {', '.join(r.keyed_states) or 'none'}; operator states "
          f"{', '.join(r.operator_states) or 'none'}" + (f"; skipped {', '.join(r.skipped_states)}"
                                                          if r.skipped_states else ""))
    return 0


def _list(args: argparse.Namespace) -> int:
    from keygroups.flink import UnsupportedFlinkTypeError, read_savepoint

    sp = read_savepoint(args.savepoint, allow_paths_outside=args.allow_paths_outside)
    print(f"Flink savepoint {sp.path}: checkpoint {sp.metadata.checkpoint_id}, metadata version "
          f"{sp.metadata.version}")
    for op in sp.operators:
        print(f"operator uid={op.uid or '?'} name={op.name or '?'} id={op.operator_id_hex} "
              f"parallelism={op.parallelism} max_parallelism={op.max_parallelism}")
        if not any(st.managed_keyed_state or st.managed_operator_state for st in op.subtasks):
            continue
        try:
            states = sp.states(op.uid or op.operator_id_hex)
        except UnsupportedFlinkTypeError as e:   # a user's serializer hides this operator's states, not the others'
            print(f"  (its states cannot be listed: {e})")
            continue
        for s in states:
            print(f"  {s.kind:<16} {s.name}: {s.value_type!r}{' (TTL)' if s.ttl else ''}")
    return 0


def _field_names(text: str) -> tuple[str, list[str]]:
    state, sep, names = text.partition("=")
    if not sep or not state or not names:
        raise argparse.ArgumentTypeError(f"--field-names takes STATE=NAME,NAME,... (e.g. row=id,label), got {text!r}")
    return state, names.split(",")


def _add_paths_outside(p: Any, what: str) -> None:
    p.add_argument("--allow-paths-outside", action="store_true",
                   help=f"read state files that {what}'s _metadata names outside its directory (Flink's "
                        "non-relocatable savepoints name them by absolute path); refused otherwise")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("flink", description=__doc__, help="move state between Flink savepoints and keygroups")
    fsub = p.add_subparsers(dest="flink_command", required=True)
    i = fsub.add_parser("import", help="a Flink savepoint's operator state as a keygroups savepoint")
    i.add_argument("savepoint", help="the Flink savepoint directory (canonical format)")
    i.add_argument("location", help="the keygroups checkpoint location (local path or fsspec URL)")
    i.add_argument("--name", required=True, help="the keygroups savepoint to write (LOCATION/savepoints/NAME)")
    i.add_argument("--uid", required=True, help="the uid of the Flink operator whose keyed state to import")
    i.add_argument("--operator-state-uid", help="take the operator state from this operator instead (e.g. the "
                                                "source holding the offsets)")
    i.add_argument("--skip-state", action="append", metavar="STATE",
                   help="leave this state out (repeatable): for a state keygroups cannot hold")
    i.add_argument("--field-names", action="append", type=_field_names, metavar="STATE=NAME,NAME,...",
                   help="name a Row or Tuple state's fields (repeatable; f0, f1, ... otherwise)")
    i.add_argument("--ttl-ms", type=int, help="the TTL recorded for TTL states (Flink keeps each entry's timestamp, "
                                              "not the duration; default 7 days)")
    i.add_argument("--watermark", type=_watermark, metavar="MS|ISO",
                   help="the watermark the job's first batch starts from: epoch milliseconds or an ISO 8601 time "
                        "(2026-11-26T10:00:00Z; no zone: UTC). Flink's savepoint holds none; default: no watermark")
    _add_paths_outside(i, "the savepoint")
    _add_window_options(i, export=False)
    add_storage_options(i)
    i.set_defaults(run=_import)
    e = fsub.add_parser("export", help="keygroups state as a Flink canonical savepoint")
    e.add_argument("location", help="the keygroups checkpoint location (local path or fsspec URL)")
    e.add_argument("dest", help="the Flink savepoint directory to write (empty or new)")
    which = e.add_mutually_exclusive_group()
    which.add_argument("--savepoint", help="export this keygroups savepoint")
    which.add_argument("--checkpoint", type=int, help="export this checkpoint (default: the latest complete one)")
    e.add_argument("--uid", required=True, help="the uid of the Flink operator that will restore the keyed state")
    e.add_argument("--operator-state-uid", help="give the operator state to this Flink operator instead")
    e.add_argument("--like", help="the Flink savepoint the state came from: its state types are kept (Short, Byte, "
                                  "Float, Character)")
    e.add_argument("--skip-state", action="append", metavar="STATE", help="leave this state out (repeatable)")
    e.add_argument("--compression", action="store_true", help="Snappy-compress the key-group blocks (Flink's "
                                                              "snapshot compression)")
    _add_paths_outside(e, "--like")
    _add_window_options(e, export=True)
    add_storage_options(e)
    e.set_defaults(run=_export)
    li = fsub.add_parser("list", help="list a Flink savepoint's operators and states")
    li.add_argument("savepoint", help="the Flink savepoint directory")
    _add_paths_outside(li, "the savepoint")
    li.set_defaults(run=_list, storage_options=None)
