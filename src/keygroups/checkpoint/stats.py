"""Figures of a checkpoint for people deciding on a parallelism: bytes (and, on request, keys) per key group, the
load each subtask would get at a parallelism and how uneven it is, and the state's size over the retained
checkpoints. ``keygroups inspect --plot`` draws them (:mod:`keygroups.cli.plot`); everything here is plain numbers.

What each figure costs:

* **Bytes per key group** come from the metadata alone (no state file is opened): a key group's bytes are those of
  its chain, the newest full block and the non-empty deltas after it, which is exactly what a restore of that key
  group reads (:func:`~keygroups.checkpoint.chain_stats`).
* **Keys per key group** need the blocks themselves (:func:`count_keys`): every chain is read once, with the same
  ranged reads a restore does, and each key's serialized bytes are collected to apply the deltas' puts and deletes;
  no value is decoded. One subtask's key groups (at the checkpoint's parallelism) are held at a time. Entries whose
  TTL has expired but that no write has cleaned up yet still count: they are still in the files.
* **Loads and skew** at a parallelism follow from either per-key-group figure: subtask *i* of parallelism *p* owns
  ``key_group_range(max_parallelism, p, i)``, so its load is the sum over that range; the skew is the largest
  subtask's load over the mean (1.0 is perfectly even; ``p`` means one subtask holds everything).
* **Size over the retained checkpoints** reads each retained checkpoint's ``_metadata`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

from keygroups._ranges import check_parallelism, key_group_range
from keygroups.checkpoint.format import read_key_group_offsets
from keygroups.checkpoint.metadata import CheckpointMetadata
from keygroups.checkpoint.planning import chain_stats, plan_keyed_restore
from keygroups.checkpoint.storage import CheckpointStorage
from keygroups.errors import CheckpointNotFoundError

#: What a subtask's load is measured in: bytes of keyed state, or keys (when they were counted).
LoadMeasure = Literal["bytes", "keys"]


def subtask_loads(per_key_group: Sequence[int], parallelism: int) -> list[int]:
    """The load of each of ``parallelism`` subtasks: the sum of ``per_key_group`` (one figure per key group, so
    ``len(per_key_group)`` is the max parallelism) over the key groups each subtask owns, as Flink assigns them."""
    parallelism, max_parallelism = check_parallelism(parallelism, len(per_key_group))
    prefix = [0, *accumulate(per_key_group)]
    loads = []
    for i in range(parallelism):
        own = key_group_range(max_parallelism, parallelism, i)
        loads.append(prefix[own.end + 1] - prefix[own.start])
    return loads


def skew(loads: Sequence[int]) -> float:
    """The largest load over the mean load: 1.0 when every subtask carries the same, ``len(loads)`` when one carries
    everything; 1.0 when there is no load at all (nothing is uneven)."""
    if not loads:
        raise ValueError("skew() needs the loads of at least one subtask, got none")
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


@dataclass(frozen=True)
class CheckpointFigures:
    """One checkpoint's figures. Lists are indexed by key group (``0 .. max_parallelism - 1``): ``full_bytes`` and
    ``delta_bytes`` of each key group's chain (0 and 0 for a key group without state), ``chain_blocks`` (its
    length), ``keys`` (distinct keys, None unless counted). ``operator_bytes`` is the operator state's size;
    ``written_bytes`` what this checkpoint wrote itself (its keyed, operator and raw keyed files; an incremental
    checkpoint references older keyed files too)."""

    checkpoint_id: int
    job_id: str
    max_parallelism: int
    parallelism: int
    full_bytes: list[int]
    delta_bytes: list[int]
    chain_blocks: list[int]
    keys: list[int] | None
    operator_bytes: int
    written_bytes: int

    @property
    def bytes_per_key_group(self) -> list[int]:
        """Bytes each key group's restore reads: its chain's full block and deltas."""
        return [f + d for f, d in zip(self.full_bytes, self.delta_bytes)]

    @property
    def keyed_bytes(self) -> int:
        """Bytes of keyed state a restore of every key group reads."""
        return sum(self.full_bytes) + sum(self.delta_bytes)

    def per_key_group(self, measure: LoadMeasure) -> list[int]:
        """``"bytes"`` or ``"keys"`` per key group (``"keys"`` only when they were counted)."""
        if measure == "bytes":
            return self.bytes_per_key_group
        if measure == "keys":
            if self.keys is None:
                raise ValueError("keys per key group were not counted: build the figures with count_keys=True "
                                 "(it reads every block of the state)")
            return self.keys
        raise ValueError(f"measure must be 'bytes' or 'keys', got {measure!r}")

    def loads(self, parallelism: int, measure: LoadMeasure = "bytes") -> list[int]:
        """Each subtask's load at ``parallelism`` (1 to the max parallelism), in bytes or keys."""
        return subtask_loads(self.per_key_group(measure), parallelism)

    def skew(self, parallelism: int, measure: LoadMeasure = "bytes") -> float:
        """Max over mean of :meth:`loads` at ``parallelism``."""
        return skew(self.loads(parallelism, measure))


def count_keys(storage: CheckpointStorage, metadata: CheckpointMetadata) -> list[int]:
    """Distinct keys per key group (a key with entries in several states counts once), from the blocks of every
    key group's chain: puts add a state's keys, deletes remove them, a full block starts the key group anew. Reads
    what a restore of the whole state reads, one subtask's key groups (at the checkpoint's parallelism) at a time;
    keys are compared as serialized bytes and no value is decoded."""
    mp = metadata.max_parallelism
    counts = [0] * mp
    for i in range(metadata.parallelism):
        live: dict[int, dict[str, set[bytes]]] = {}
        for handle, part in plan_keyed_restore(metadata, key_group_range(mp, metadata.parallelism, i)):
            names = [s["name"] for s in handle.states]
            blocks, _ = read_key_group_offsets(storage, handle, part)
            for block in blocks:
                states = live.setdefault(block.key_group, {})
                if block.full:
                    states.clear()
                data = block.block
                for state_index, key_offsets, _ in block.puts:
                    o = key_offsets.tolist()
                    states.setdefault(names[state_index], set()).update(
                        bytes(data[o[j]:o[j + 1]]) for j in range(len(o) - 1))
                for state_index, key_offsets in block.deletes:
                    o = key_offsets.tolist()
                    states.setdefault(names[state_index], set()).difference_update(
                        bytes(data[o[j]:o[j + 1]]) for j in range(len(o) - 1))
        for kg, states in live.items():
            counts[kg] = len(set().union(*states.values()))
    return counts


def checkpoint_figures(storage: CheckpointStorage, metadata: CheckpointMetadata, *,
                       with_keys: bool = False) -> CheckpointFigures:
    """The figures of the checkpoint (or savepoint) ``metadata`` of ``storage``: from the metadata alone, and keys
    per key group too when ``with_keys`` (which reads every block: see :func:`count_keys`)."""
    mp = metadata.max_parallelism
    full, delta, blocks = [0] * mp, [0] * mp, [0] * mp
    for kg, chain in chain_stats(metadata, key_group_range(mp, 1, 0)).items():
        full[kg], delta[kg], blocks[kg] = chain.full_bytes, chain.delta_bytes, chain.length
    own = f"{metadata.base}/"
    written = {h.file: h.size for h in metadata.keyed_handles if h.checkpoint_id == metadata.checkpoint_id}
    written.update((h.file, h.size) for h in metadata.operator_handles if h.file.startswith(own))
    written.update((h.file, h.size) for h in metadata.raw_keyed_handles)   # written whole by every checkpoint
    return CheckpointFigures(
        checkpoint_id=metadata.checkpoint_id, job_id=metadata.job_id, max_parallelism=mp,
        parallelism=metadata.parallelism, full_bytes=full, delta_bytes=delta, chain_blocks=blocks,
        keys=count_keys(storage, metadata) if with_keys else None,
        operator_bytes=sum(h.size for h in metadata.operator_handles), written_bytes=sum(written.values()))


def size_history(storage: CheckpointStorage) -> list[CheckpointFigures]:
    """The figures (without keys) of every retained complete checkpoint of ``storage``, oldest first: how the
    state's size, and what each checkpoint wrote, changed over them."""
    history = []
    for cid in storage.checkpoint_ids():
        try:
            history.append(checkpoint_figures(storage, storage.load(cid)))
        except CheckpointNotFoundError:   # a running job's retention removed it since the listing
            continue
    return history


__all__ = ["CheckpointFigures", "checkpoint_figures", "count_keys", "size_history", "skew", "subtask_loads"]
