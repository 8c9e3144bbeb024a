"""``keygroups flink``: move a job's state between Flink and keygroups.

``keygroups flink import SAVEPOINT LOCATION --name NAME --uid UID [--operator-state-uid UID2] [--skip-state S]``
writes Flink operator UID's keyed state, timers and operator state (UID2's operator state when given) as the keygroups
savepoint LOCATION/savepoints/NAME, which ``KeyedJob(..., restore_from_savepoint=NAME)`` continues from.
``keygroups flink list SAVEPOINT`` lists a Flink savepoint's operators and states.
"""

from __future__ import annotations

import argparse
from typing import Any

from keygroups.cli.arguments import add_storage_options


def _import(args: argparse.Namespace) -> int:
    from keygroups.flink.importer import import_savepoint

    ttl = args.ttl_ms if args.ttl_ms is not None else None
    kwargs: dict[str, Any] = {} if ttl is None else {"ttl_ms": ttl}
    r = import_savepoint(args.savepoint, args.location, args.name, uid=args.uid,
                         operator_state_uid=args.operator_state_uid, skip_states=args.skip_state or (),
                         storage_options=args.storage_options, **kwargs)
    print(f"imported Flink operator {args.uid!r} into {r.savepoint}: parallelism {r.parallelism}, max parallelism "
          f"{r.max_parallelism}, {r.key_groups} key groups, {r.entries} entries, {r.timers} timers, keyed states "
          f"{', '.join(r.keyed_states) or 'none'}; operator states {', '.join(r.operator_states) or 'none'}"
          + (f"; skipped {', '.join(r.skipped_states)}" if r.skipped_states else ""))
    return 0


def _list(args: argparse.Namespace) -> int:
    from keygroups.flink import read_savepoint

    sp = read_savepoint(args.savepoint)
    print(f"Flink savepoint {sp.path}: checkpoint {sp.metadata.checkpoint_id}, metadata version "
          f"{sp.metadata.version}")
    for op in sp.operators:
        print(f"operator uid={op.uid or '?'} name={op.name or '?'} id={op.operator_id_hex} "
              f"parallelism={op.parallelism} max_parallelism={op.max_parallelism}")
        if not any(st.managed_keyed_state or st.managed_operator_state for st in op.subtasks):
            continue
        for s in sp.states(op.uid or op.operator_id_hex):
            print(f"  {s.kind:<16} {s.name}: {s.value_type!r}{' (TTL)' if s.ttl else ''}")
    return 0


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
    i.add_argument("--ttl-ms", type=int, help="the TTL recorded for TTL states (Flink keeps each entry's timestamp, "
                                              "not the duration; default 7 days)")
    add_storage_options(i)
    i.set_defaults(run=_import)
    li = fsub.add_parser("list", help="list a Flink savepoint's operators and states")
    li.add_argument("savepoint", help="the Flink savepoint directory")
    li.set_defaults(run=_list, storage_options=None)
