"""What resuming kept (warm) state for a key-group range did, key group by key group (issue 26: a range that moved
keeps the key groups it still owns)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from keygroups.checkpoint.metadata import key_group_runs
from keygroups.state._base import RestoreStats


@dataclass(frozen=True)
class WarmResume(RestoreStats):
    """What resuming a kept backend for a key-group range read (``bytes_read``, ``key_groups`` read), and which key
    groups (absolute numbers) it kept: ``warm`` (kept, nothing read), ``caught_up`` (kept, the blocks committed
    since the backend's last snapshot read), ``restored`` (arrived from another range: their chains read from the
    checkpoint), ``dropped`` (left for another subtask; their entries discarded); bytes read per kind."""

    warm: tuple[int, ...] = ()
    caught_up: tuple[int, ...] = ()
    restored: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    bytes_caught_up: int = 0
    bytes_restored: int = 0

    def report(self) -> dict[str, Any]:
        """The key groups as ``[start, end]`` runs and the bytes, for a task report (JSON-able)."""
        def runs(kgs: tuple[int, ...]) -> list[list[int]]:
            return [[r.start, r.end] for r in key_group_runs(kgs)]

        return {"warm_key_groups": runs(self.warm), "caught_up_key_groups": runs(self.caught_up),
                "restored_key_groups": runs(self.restored), "dropped_key_groups": runs(self.dropped),
                "bytes_caught_up": int(self.bytes_caught_up), "bytes_restored": int(self.bytes_restored)}
