"""Restore planning from the metadata alone: what a subtask of a new parallelism reads of the old state files.

Keyed state (:func:`plan_keyed_restore`): key groups are the unit of redistribution (Flink's
``StateAssignmentOperation``). A subtask of any new parallelism owns a contiguous ``KeyGroupRange`` and reads, for
each of its key groups, that key group's chain (incremental checkpoints): the newest full block and the delta blocks
after it, from whichever old files hold them, and nothing else.

The number of key groups (max parallelism) changes only by an integer factor (:func:`check_restore_max_parallelism`):
a key's key group is ``murmur(hash) % max_parallelism``, so with ``new = k * old`` every new key group ``g`` has
exactly one parent, ``g % old`` (its keys are some of that parent's), and with ``old = k * new`` new key group ``g``
is the union of old groups ``g + j * new`` (``j < k``). :func:`parent_key_groups` maps a new subtask's range to the
old key groups it reads: at most k times its share of the state when splitting, exactly its share when merging. The
backend re-keys what it reads (``KeyedStateBackendBase.restore``); any other change would need every key of the
state, and is refused.

Chains stay bounded: :func:`chain_stats` describes them and :func:`choose_full_key_groups` picks the key groups a
backend writes full at its next snapshot; :func:`carry_forward` keeps in the next checkpoint exactly the older
files some chain still needs.

Chains are whole: a chain must start with a full block (or a delta its writer marked fresh,
:func:`baseless_deltas`), and each delta of keyed format 4 names the block it applies on, which must be the block
before it in the chain (:func:`chain_breaks`): a chain that lacks a delta, or holds a delta of another run or
attempt, is refused when a restore is planned, at commit and by ``keygroups verify``, from the metadata alone, in
O(key groups x chain length). :func:`chain_tips` gives what the next deltas of a key group name.

Raw keyed state (:func:`plan_raw_keyed_restore`, ``raw_keyed.py``): one block per key group, written whole every
checkpoint, so a subtask reads its key groups' blocks from the old files that hold them; the bytes are opaque, so a
max-parallelism change is refused while raw keyed state exists.

Operator state (:func:`plan_operator_restore`, Flink's ``RoundRobinOperatorStateRepartitioner``): lists of elements
are the unit. Per state, by its :class:`~keygroups.checkpoint.metadata.DistributionMode`: SPLIT_DISTRIBUTE lists are
concatenated and cut evenly (:func:`split_sizes`), UNION lists go whole to every subtask, and each subtask reads one
old copy of a BROADCAST state. The plan is runs of elements with their byte ranges; ``operator_format`` reads them.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keygroups._ranges import UPPER_BOUND_MAX_PARALLELISM, KeyGroupRange, check_max_parallelism
from keygroups.checkpoint.metadata import (
    CHAINED_FORMAT_VERSION,
    EMPTY_BLOCK_SIZE,
    BlockLink,
    BlockLinks,
    CheckpointMetadata,
    DistributionMode,
    KeyedStateHandle,
    OperatorStateHandle,
    OperatorStateMeta,
    RawKeyedStateHandle,
    key_group_runs,
    keyed_handles_by_range,
)
from keygroups.errors import CorruptSnapshotError, StateMigrationError


def allowed_max_parallelisms(old: int) -> tuple[list[int], list[int]]:
    """The max parallelisms a state written with max parallelism ``old`` restores into, besides ``old`` itself:
    ``(divisors, multiples)``, ascending: ``old / k`` (key groups merge) and ``old * k`` up to
    ``UPPER_BOUND_MAX_PARALLELISM`` (key groups split)."""
    old = check_max_parallelism(old)
    divisors = [d for d in range(1, old) if old % d == 0]
    multiples = list(range(2 * old, UPPER_BOUND_MAX_PARALLELISM + 1, old))
    return divisors, multiples


def _describe_allowed(old: int) -> str:
    divisors, multiples = allowed_max_parallelisms(old)
    parts = [f"{old} (unchanged)"]
    if multiples:
        shown = ", ".join(map(str, multiples)) if len(multiples) <= 6 else (
            f"{multiples[0]}, {multiples[1]}, {multiples[2]}, ..., {multiples[-1]}")
        parts.append(f"a multiple of {old} up to {UPPER_BOUND_MAX_PARALLELISM} ({shown})")
    if divisors:
        parts.append(f"a divisor of {old} ({', '.join(map(str, divisors))})")
    return "; ".join(parts)


def check_restore_max_parallelism(metadata: CheckpointMetadata, max_parallelism: int) -> int:
    """``max_parallelism`` as an int if a job with it can restore ``metadata``: the checkpoint's max parallelism
    multiplied or divided by an integer factor (or unchanged). StateMigrationError naming the allowed values
    otherwise; ValueError (naming them too) outside ``[1, UPPER_BOUND_MAX_PARALLELISM]``."""
    old = metadata.max_parallelism
    try:
        mp = check_max_parallelism(max_parallelism)
    except ValueError as e:
        raise ValueError(f"{e}; checkpoint {metadata.checkpoint_id} (max_parallelism={old}) restores with "
                         f"max_parallelism {_describe_allowed(old)}") from None
    if mp % old and old % mp:
        raise StateMigrationError(
            f"cannot restore checkpoint {metadata.checkpoint_id} (job {metadata.job_id!r}), written with "
            f"max_parallelism={old}, into a job with max_parallelism={mp}: the max parallelism can only change by "
            f"an integer factor (then every key group splits into, or merges with, whole old key groups; any other "
            f"change would move keys between all of them). Allowed: {_describe_allowed(old)}. Restore with one of "
            f"these, or start without this state.")
    if mp != old and metadata.raw_keyed_handles:
        writers = sorted(h.subtask for h in metadata.raw_keyed_handles)
        raise StateMigrationError(
            f"cannot restore checkpoint {metadata.checkpoint_id} (job {metadata.job_id!r}) with max_parallelism={mp}: "
            f"it holds raw keyed state (the bytes its function wrote per key group in snapshot_raw_keyed_state, "
            f"subtasks {writers}), which is opaque and cannot be re-keyed into key groups of another max "
            f"parallelism (Flink cannot either). Restore with max_parallelism={old}, or from a checkpoint without "
            f"raw keyed state.")
    return mp


def parent_key_groups(new_range: KeyGroupRange, old_max_parallelism: int, new_max_parallelism: int
                      ) -> list[KeyGroupRange]:
    """The old key groups (of ``old_max_parallelism``) whose keys can belong to ``new_range`` (key groups of
    ``new_max_parallelism``), as ascending disjoint ranges: ``g % old`` for each new ``g`` when the max parallelism
    was multiplied (a range as long as ``old`` or longer reads them all), ``g + j * new`` for ``j < old / new`` when
    it was divided. ValueError unless one divides the other."""
    old, new = check_max_parallelism(old_max_parallelism), check_max_parallelism(new_max_parallelism)
    if not isinstance(new_range, KeyGroupRange):
        raise TypeError(f"new_range must be a KeyGroupRange, got {type(new_range).__name__}")
    if new_range and new_range.end >= new:
        raise ValueError(f"key groups {new_range} are past the last key group {new - 1} of max_parallelism={new}")
    if not new_range or old == new:
        return [new_range] if new_range else []
    if new % old == 0:
        if len(new_range) >= old:
            return [KeyGroupRange(0, old - 1)]
        first, last = new_range.start % old, new_range.end % old
        if first <= last:
            return [KeyGroupRange(first, last)]
        return [KeyGroupRange(0, last), KeyGroupRange(first, old - 1)]   # the range wraps past a multiple of old
    if old % new == 0:
        return [KeyGroupRange(new_range.start + j * new, new_range.end + j * new) for j in range(old // new)]
    raise ValueError(f"max_parallelism {old} -> {new} is not a change by an integer factor")


@dataclass(frozen=True)
class ChainStats:
    """One key group's chain as a restore reads it: ``length`` blocks (the full one, if any, and the non-empty
    deltas after it), ``full_bytes`` in the full block (0 without one: the chain starts from no state) and
    ``delta_bytes`` in the deltas; ``tip``, its newest block as the next delta names it (None when that block is of
    a keyed format before 4, which carries no checksum: the next block of the key group must then be full)."""

    length: int
    full_bytes: int
    delta_bytes: int
    tip: BlockLink | None = field(default=None, compare=False)

    def after(self, handle: KeyedStateHandle, key_group: int) -> ChainStats:
        """The chain once ``handle``'s block of ``key_group`` is added (a full block starts it anew; an empty
        delta changes nothing)."""
        if handle.is_full(key_group):
            return ChainStats(1, handle.block_size(key_group), 0, handle.link(key_group))
        if not handle.changes(key_group):
            return self
        return ChainStats(self.length + 1, self.full_bytes, self.delta_bytes + handle.block_size(key_group),
                          handle.link(key_group))


NO_CHAIN = ChainStats(0, 0, 0)


def _checked_range(metadata: CheckpointMetadata, new_range: KeyGroupRange, max_parallelism: int | None
                   ) -> list[KeyGroupRange]:
    """The key groups of ``metadata`` (its numbering) that a subtask owning ``new_range`` (numbered for
    ``max_parallelism``, the checkpoint's when None) reads."""
    if not isinstance(new_range, KeyGroupRange):
        raise TypeError(f"new_range must be a KeyGroupRange, got {type(new_range).__name__}")
    old = metadata.max_parallelism
    if max_parallelism is not None and check_restore_max_parallelism(metadata, max_parallelism) != old:
        return parent_key_groups(new_range, old, max_parallelism)
    if new_range and new_range.end >= old:
        raise StateMigrationError(
            f"key groups {new_range} do not exist in checkpoint {metadata.checkpoint_id}, written with "
            f"max_parallelism={old} (key groups 0..{old - 1}); to restore it with another max parallelism, "
            f"give that max_parallelism")
    return [new_range] if new_range else []


def _ordered_handles(checkpoint_id: int, handles: Sequence[KeyedStateHandle]) -> list[KeyedStateHandle]:
    try:
        return keyed_handles_by_range(list(handles))
    except ValueError as e:
        raise CorruptSnapshotError(f"checkpoint {checkpoint_id} is corrupt, overlapping: {e}") from None


#: The last chains worked out, with the handles they were worked out from: one batch asks for the same chains several
#: times (its restore, its resume, its materialization, the driver's figures and the commit's check).
_CHAINS: collections.OrderedDict[tuple[Any, ...], tuple[list[KeyedStateHandle], dict[int, list[KeyedStateHandle]]]] \
    = collections.OrderedDict()
_CHAINS_KEEP = 16
_CHAINS_LOCK = threading.Lock()


def key_group_chains(handles: Sequence[KeyedStateHandle], key_groups: KeyGroupRange
                     ) -> dict[int, list[KeyedStateHandle]]:
    """Each key group of ``key_groups`` that some handle holds -> its chain: the handle of its newest full block
    (if any) and the handles of the non-empty delta blocks after it, oldest first. ``handles`` are ordered by
    checkpoint id (:func:`~keygroups.checkpoint.metadata.keyed_handles_by_range`). Worked out once for the same
    handle objects and key groups (handles are immutable): a new dict each call, its lists shared."""
    handles = list(handles)
    key = (key_groups.start, key_groups.end, len(handles), *map(id, handles))
    with _CHAINS_LOCK:
        found = _CHAINS.get(key)
        if found is not None and all(a is b for a, b in zip(found[0], handles)):
            _CHAINS.move_to_end(key)
            return dict(found[1])
    chains = _key_group_chains(handles, key_groups)
    with _CHAINS_LOCK:
        _CHAINS[key] = (handles, chains)
        while len(_CHAINS) > _CHAINS_KEEP:
            _CHAINS.popitem(last=False)
    return dict(chains)


def _key_group_chains(handles: Sequence[KeyedStateHandle], key_groups: KeyGroupRange
                      ) -> dict[int, list[KeyedStateHandle]]:
    chains: dict[int, list[KeyedStateHandle]] = {}
    for h in handles:
        part = h.key_group_range.intersection(key_groups)
        if not part:
            continue
        if h.is_all_full:
            for kg in part:
                chains[kg] = [h]
            continue
        full, deltas = h.changed_key_groups()   # a key group's block is one or the other: order is free
        for kg in full[bisect.bisect_left(full, part.start):bisect.bisect_right(full, part.end)]:
            chains[kg] = [h]
        for kg in deltas[bisect.bisect_left(deltas, part.start):bisect.bisect_right(deltas, part.end)]:
            chains.setdefault(kg, []).append(h)
    return chains


def _check_chain_meta(chain: Sequence[KeyedStateHandle]) -> None:
    """CorruptSnapshotError unless every state has one meta (kind, serializers, TTL) along the chain: its blocks
    are applied to one another as bytes."""
    seen: dict[str, tuple[dict, KeyedStateHandle]] = {}
    for h in chain:
        for meta in h.states:
            first = seen.setdefault(meta["name"], (meta, h))
            if first[0] != meta:
                raise CorruptSnapshotError(
                    f"state {meta['name']!r} has one meta in {first[1].file!r} (checkpoint {first[1].checkpoint_id}) and "
                    f"another in {h.file!r} (checkpoint {h.checkpoint_id}), files of one key group's chain: a "
                    f"delta must be written with the meta of the block it changes (a changed serializer or TTL "
                    f"makes the next snapshot full)")


def chain_tips(metadata: CheckpointMetadata, key_groups: KeyGroupRange) -> dict[int, BlockLink]:
    """Each key group of ``key_groups`` whose chain in ``metadata`` ends with a block of keyed format 4 -> that block,
    as a delta written on top of the checkpoint names it (``write_keyed_snapshot``'s ``predecessors``). A key group
    missing here has no chain, or one that ends with an older format's block: its next block must be full."""
    tips: dict[int, BlockLink] = {}
    handles = _ordered_handles(metadata.checkpoint_id, metadata.keyed_handles)
    for kg, chain in key_group_chains(handles, key_groups).items():
        link = chain[-1].link(kg)
        if link is not None:
            tips[kg] = link
    return tips


def _hex(checksum: int | None) -> str:
    return "no checksum" if checksum is None else f"checksum {checksum:#010x}"


@dataclass(frozen=True)
class ChainBreak:
    """A delta block that does not continue the block before it in its key group's chain: ``delta`` holds it,
    ``before`` holds the newest block of the chain older than it (None: the checkpoint lists no block of the key
    group), and ``names`` is the block the delta names as its predecessor (None: it names none).
    :meth:`describe` says which kind of break it is."""

    key_group: int
    delta: KeyedStateHandle
    before: KeyedStateHandle | None
    names: BlockLink | None

    def describe(self) -> str:
        kg, h, before, names = self.key_group, self.delta, self.before, self.names
        empty = not h.changes(kg)
        what = (f"the {'empty ' if empty else ''}delta block of key group {kg} in {h.file!r} (subtask {h.subtask}, "
                f"written by checkpoint {h.checkpoint_id})")
        verb = "continues" if empty else "applies on"
        if before is None:
            return (f"{what} {verb} {names}, but the checkpoint lists no block of key group {kg}: the chain lacks "
                    f"its blocks (the file of checkpoint {names.checkpoint_id if names else '?'} that holds the "
                    "newest is not listed)")
        found = (f"the block of checkpoint {before.checkpoint_id} in {before.file!r} (subtask {before.subtask}, "
                 f"{_hex(before.checksum(kg))})")
        if names is None:
            if h.fresh_key_groups is not None and h.is_fresh(kg):
                return (f"{what} applies to no earlier block (its writer held no state of key group {kg}), yet the "
                        f"chain has {found} before it: the delta belongs to another lineage")
            return (f"{what} names no block it applies on, after {found}: a delta of keyed format "
                    f"{h.format_version} must name it")
        if before.checksum(kg) is None:
            return (f"{what} {verb} {names}, but the block before it is {found}, of keyed format "
                    f"{before.format_version}, which no delta of format {CHAINED_FORMAT_VERSION} names: the delta "
                    "belongs to another lineage")
        if names.checkpoint_id > before.checkpoint_id:
            return (f"{what} {verb} {names}, but the newest block before it in the chain is {found}: the chain "
                    f"lacks a delta (the file of checkpoint {names.checkpoint_id} that holds that block is not "
                    "listed)")
        if names.checkpoint_id < before.checkpoint_id:
            return (f"{what} {verb} {names}, but {found} comes between them: a delta that does not belong to this "
                    "chain (of another run, or listed out of order)")
        return (f"{what} {verb} {names}, but the checkpoint lists {found} instead: one of the two files is of "
                f"another run or attempt of checkpoint {names.checkpoint_id} (a foreign delta)")


def chain_breaks(handles: Sequence[KeyedStateHandle], key_groups: Sequence[KeyGroupRange]) -> list[ChainBreak]:
    """The deltas of keyed format 4 among ``handles`` (ordered as :func:`key_group_chains` takes them) that do not
    continue the block before them, for the key groups of ``key_groups``, by key group. A key group's chain is its
    newest full block and the non-empty deltas after it; each delta of the chain must name the block before it (its
    checkpoint and checksum), and each empty delta after the chain's full block (a file that changed nothing there)
    the newest block older than itself, the end it left as it was. A chain that lost a delta (its newest too, while a
    later file lists the key group), or holds one of another run or attempt, breaks here. Deltas of earlier formats
    name nothing and are not checked; a chain's first block is :func:`baseless_deltas`' concern.

    From the metadata alone, in one pass over the handles with numpy over each one's key groups: O(key groups x
    chain length) in C, Python only for the breaks found."""
    out: list[ChainBreak] = []
    for r in key_groups:
        if not r:
            continue
        parts = [(i, h, h.key_group_range.intersection(r)) for i, h in enumerate(handles)]
        parts = [(i, h, part) for i, h, part in parts if part]
        newest_full = np.full(len(r), -1, dtype=np.int64)   # the checkpoint of each key group's newest full block
        for _, h, part in parts:
            for f in h.full_key_groups:
                fp = f.intersection(part)
                if fp:
                    view = newest_full[fp.start - r.start:fp.end - r.start + 1]
                    np.maximum(view, h.checkpoint_id, out=view)
        tip_checkpoint = np.full(len(r), -1, dtype=np.int64)   # the chain's newest block so far: -1, none yet
        tip_checksum = np.full(len(r), -1, dtype=np.int64)     # ... its checksum, -1 when it carries none
        tip_handle = np.full(len(r), -1, dtype=np.int64)
        for i, h, part in parts:
            a, b = part.start - r.start, part.end - r.start + 1
            ha, hb = part.start - h.key_group_range.start, part.end - h.key_group_range.start + 1
            active = newest_full[a:b] <= h.checkpoint_id   # blocks older than the chain's full block do not count
            full = np.zeros(hb - ha, dtype=bool)
            for f in h.full_key_groups:
                fp = f.intersection(part)
                if fp:
                    full[fp.start - part.start:fp.end - part.start + 1] = True
            nonempty = h.block_sizes()[ha:hb] > EMPTY_BLOCK_SIZE
            links = h.predecessors
            if h.format_version >= CHAINED_FORMAT_VERSION:
                if isinstance(links, BlockLinks):
                    names, named_checksum = links.checkpoints[ha:hb], links.checksums[ha:hb]
                else:
                    names = np.full(hb - ha, -1, dtype=np.int64)
                    named_checksum = np.zeros(hb - ha, dtype=np.int64)
                started = tip_checkpoint[a:b] >= 0
                linked = names >= 0
                wrong = linked & ((tip_checkpoint[a:b] != names) | (tip_checksum[a:b] != named_checksum))
                # a linked delta that starts its chain is a baseless one (reported as such): not counted here
                bad = active & ~full & ((wrong & (started | ~nonempty)) | (~linked & nonempty & started))
                for j in np.flatnonzero(bad).tolist():
                    before = int(tip_handle[a + j])
                    out.append(ChainBreak(part.start + j, h, handles[before] if before >= 0 else None,
                                          BlockLink(int(names[j]), int(named_checksum[j])) if names[j] >= 0 else None))
            moves = active & (full | nonempty)   # a full block starts the chain, a non-empty delta continues it
            tip_checkpoint[a:b][moves] = h.checkpoint_id
            tip_handle[a:b][moves] = i
            checksums = (h.checksum_array()[ha:hb] if h.checksums is not None
                         else np.full(hb - ha, -1, dtype=np.int64))
            tip_checksum[a:b][moves] = checksums[moves]
    out.sort(key=lambda br: (br.key_group, br.delta.checkpoint_id))
    return out


def describe_breaks(checkpoint_id: int, found: list[ChainBreak]) -> str:
    """The message for :func:`chain_breaks`' findings in checkpoint ``checkpoint_id``."""
    groups = sorted({b.key_group for b in found})
    shown = ", ".join(map(str, groups[:8])) + (", ..." if len(groups) > 8 else "")
    return (f"checkpoint {checkpoint_id} holds a broken chain: {found[0].describe()} ({len(groups)} key groups: "
            f"{shown}). Restoring it would silently lose or mix state; restore from a checkpoint or savepoint whose "
            "chains are whole")


def baseless_deltas(chains: dict[int, list[KeyedStateHandle]]) -> list[tuple[int, KeyedStateHandle]]:
    """``(key group, its first block)`` for each chain (of :func:`key_group_chains`) that starts with a delta
    written to change an earlier block (not one of its handle's ``fresh_key_groups``): the block it applies to is
    missing, and the delta alone would restore as the whole state."""
    return [(kg, chain[0]) for kg, chain in sorted(chains.items())
            if not chain[0].is_full(kg) and not chain[0].is_fresh(kg)]


def describe_baseless(checkpoint_id: int, found: list[tuple[int, KeyedStateHandle]]) -> str:
    """The message for :func:`baseless_deltas`' findings in checkpoint ``checkpoint_id``."""
    kg, h = found[0]
    groups = [g for g, _ in found]
    shown = ", ".join(map(str, groups[:8])) + (", ..." if len(groups) > 8 else "")
    names = h.predecessor(kg)
    return (f"checkpoint {checkpoint_id} lists a delta block of key group {kg} (file {h.file!r} of subtask "
            f"{h.subtask}, written by checkpoint {h.checkpoint_id}) but not the block it applies to"
            f"{f' ({names})' if names is not None else ''}: the chain of a "
            f"key group with state must start with a full block (or a delta its writer marked as applying to no "
            f"state), else a restore returns the delta alone as the whole state ({len(groups)} key groups: {shown}). "
            f"The keyed handles of a checkpoint must carry forward every file an older block of each chain lives in "
            f"(keygroups.checkpoint.carry_forward)")


def _chains_of(metadata: CheckpointMetadata, old_ranges: Sequence[KeyGroupRange]
              ) -> dict[int, list[KeyedStateHandle]]:
    handles = _ordered_handles(metadata.checkpoint_id, metadata.keyed_handles)
    chains: dict[int, list[KeyedStateHandle]] = {}
    for r in old_ranges:
        chains.update(key_group_chains(handles, r))
    found = baseless_deltas(chains)
    if found:
        raise CorruptSnapshotError(describe_baseless(metadata.checkpoint_id, found))
    breaks = chain_breaks(handles, old_ranges)
    if breaks:
        raise CorruptSnapshotError(describe_breaks(metadata.checkpoint_id, breaks))
    checked: set[tuple[int, ...]] = set()
    for chain in chains.values():
        ids = tuple(id(h) for h in chain)
        if len(chain) > 1 and ids not in checked:
            _check_chain_meta(chain)
            checked.add(ids)
    return chains


def plan_keyed_restore(metadata: CheckpointMetadata, new_range: KeyGroupRange, *,
                       max_parallelism: int | None = None) -> list[tuple[KeyedStateHandle, KeyGroupRange]]:
    """The ``(old handle, key groups to read from it)`` pairs for a subtask that now owns ``new_range``, in chain
    order: by the handles' ``checkpoint_id`` (then key group), so applying the reads in order gives each key
    group's state. For each key group only its chain appears: the handle of its newest full block and those of the
    non-empty deltas after it; a handle's key groups come as contiguous ranges (one ranged read each). Key groups
    no handle covers had no state.

    ``new_range`` is numbered for ``max_parallelism`` (the checkpoint's when None). When that differs from the
    checkpoint's by an integer factor, the plan reads the chains of the old key groups ``new_range``'s keys come
    from (:func:`parent_key_groups`), key groups numbered as in the checkpoint: the reader re-keys them. Another
    change raises StateMigrationError naming the allowed values (:func:`check_restore_max_parallelism`); so does a
    ``new_range`` past the checkpoint's key groups without ``max_parallelism``.
    CorruptSnapshotError if a state's meta differs along a chain, if handles of one checkpoint overlap, if a key
    group's chain starts with a delta that applies to a block the checkpoint does not list (:func:`baseless_deltas`),
    or if a delta does not apply on the block before it (:func:`chain_breaks`: a lost middle delta, a foreign one)."""
    old_ranges = _checked_range(metadata, new_range, max_parallelism)
    wanted: dict[int, tuple[KeyedStateHandle, list[int]]] = {}
    for kg, chain in sorted(_chains_of(metadata, old_ranges).items()):
        for h in chain:
            wanted.setdefault(id(h), (h, []))[1].append(kg)
    plan = [(h, run) for h, kgs in wanted.values() for run in key_group_runs(kgs)]
    plan.sort(key=lambda hr: (hr[0].checkpoint_id, hr[1].start))
    return plan


def plan_raw_keyed_restore(metadata: CheckpointMetadata, new_range: KeyGroupRange, *,
                           max_parallelism: int | None = None) -> list[tuple[RawKeyedStateHandle, KeyGroupRange]]:
    """The ``(old raw keyed handle, key groups to read from it)`` pairs for a subtask that now owns ``new_range``,
    by key group: each key group's one block (raw state is written whole every checkpoint, so there is no chain),
    one contiguous range per old file. Key groups no handle covers had no raw state.

    ``max_parallelism`` (None: the checkpoint's) may differ only when the checkpoint holds no raw keyed state
    (:func:`check_restore_max_parallelism` refuses it otherwise, naming it); CorruptSnapshotError if two handles
    overlap."""
    ranges = _checked_range(metadata, new_range, max_parallelism)
    if not ranges or not metadata.raw_keyed_handles:
        return []
    (old_range,) = ranges   # the max parallelism is unchanged: raw state exists
    plan: list[tuple[RawKeyedStateHandle, KeyGroupRange]] = []
    for h in sorted(metadata.raw_keyed_handles, key=lambda h: h.key_group_range.start):
        part = h.key_group_range.intersection(old_range)
        if part:
            if plan and plan[-1][1].end >= part.start:
                raise CorruptSnapshotError(f"checkpoint {metadata.checkpoint_id} is corrupt: raw keyed handles of "
                                           f"subtasks {plan[-1][0].subtask} and {h.subtask} overlap")
            plan.append((h, part))
    return plan


def chain_stats(metadata: CheckpointMetadata, new_range: KeyGroupRange) -> dict[int, ChainStats]:
    """Each key group of ``new_range`` that has state -> its :class:`ChainStats` (from the metadata alone): what the
    materialization policy (:func:`choose_full_key_groups`) weighs."""
    _checked_range(metadata, new_range, None)
    out: dict[int, ChainStats] = {}
    for kg, chain in key_group_chains(_ordered_handles(metadata.checkpoint_id, metadata.keyed_handles),
                                      new_range).items():
        stats = NO_CHAIN
        for h in chain:
            stats = stats.after(h, kg)
        out[kg] = stats
    return out


#: At most this share of a backend's key groups is materialized at one snapshot, the most overdue first: a burst
#: (every chain reaching its bound at once, as after a job's first full checkpoint) is spread over several batches.
MAX_MATERIALIZED_SHARE = 1 / 8


def choose_full_key_groups(chains: dict[int, ChainStats], n_key_groups: int, *, max_chain: int,
                           delta_fraction: float) -> set[int]:
    """The key groups to materialize (write full) at the next snapshot: those whose chain is longer than
    ``max_chain`` blocks or whose deltas exceed ``delta_fraction`` of their full block, the worst first, at most
    ``ceil(n_key_groups * MAX_MATERIALIZED_SHARE)`` of them, so the rewriting is spread over snapshots.

    In a steady state where each batch changes a share ``t`` of a key group, its chain is rewritten every
    ``delta_fraction / t`` batches: a batch writes about ``t + t / delta_fraction`` of the state, and a restore
    reads at most ``1 + delta_fraction`` times the live state (``1 + delta_fraction / 2`` on average over key
    groups whose chains are at different points)."""
    scored = []
    for kg, c in chains.items():
        by_length = c.length / max_chain
        by_bytes = c.delta_bytes / (delta_fraction * c.full_bytes) if c.full_bytes else (
            math.inf if c.delta_bytes else 0.0)
        if c.length > max_chain or by_bytes > 1:
            scored.append((-max(by_length, by_bytes), kg))
    scored.sort()
    return {kg for _, kg in scored[:math.ceil(n_key_groups * MAX_MATERIALIZED_SHARE)]}


class _ChainIndex:
    """Every key group's chain over one list of keyed handles (a checkpoint's), kept so that the next checkpoint's
    chains follow from it and the new handles alone: ``chains`` (key group -> its handles, as
    :func:`key_group_chains` gives them), each chain's newest block (``tip_checkpoint``, -1: no chain;
    ``tip_checksum``, -1: its handle records none) and how many chains each handle is in. ``verified``: the chains
    are known to be whole (no baseless delta, no break), checked once in full or extended from verified chains by
    new handles that broke none."""

    __slots__ = ("handles", "chains", "tip_checkpoint", "tip_checksum", "uses", "verified")

    def __init__(self, handles: Sequence[KeyedStateHandle], chains: dict[int, list[KeyedStateHandle]],
                 tip_checkpoint: Any, tip_checksum: Any, uses: dict[int, int], verified: bool) -> None:
        self.handles = tuple(handles)
        self.chains = chains
        self.tip_checkpoint = tip_checkpoint
        self.tip_checksum = tip_checksum
        self.uses = uses
        self.verified = verified

    @classmethod
    def build(cls, handles: Sequence[KeyedStateHandle], size: int) -> _ChainIndex:
        """The index of ``handles`` (ordered as :func:`keyed_handles_by_range` orders them) over key groups
        ``[0, size)``, worked out in full: O(key groups x handles), once per checkpoint a driver did not write."""
        chains = _key_group_chains(handles, KeyGroupRange(0, size - 1)) if size else {}
        tip_checkpoint = np.full(size, -1, dtype=np.int64)
        tip_checksum = np.full(size, -1, dtype=np.int64)
        uses: dict[int, int] = {}
        for kg, chain in chains.items():
            tip = chain[-1]
            tip_checkpoint[kg] = tip.checkpoint_id
            checksum = tip.checksum(kg)
            tip_checksum[kg] = -1 if checksum is None else checksum
            for h in chain:
                uses[id(h)] = uses.get(id(h), 0) + 1
        return cls(handles, chains, tip_checkpoint, tip_checksum, uses, False)

    def verify(self) -> tuple[list[tuple[int, KeyedStateHandle]], list[ChainBreak]]:
        """``(baseless deltas, chain breaks)`` of these chains, checked in full (:func:`baseless_deltas`,
        :func:`chain_breaks`); ``verified`` once there are none."""
        found = baseless_deltas(self.chains)
        size = len(self.tip_checkpoint)
        breaks = chain_breaks(list(self.handles), [KeyGroupRange(0, size - 1)]) if size else []
        self.verified = not found and not breaks
        return found, breaks

    def extended(self, new: Sequence[KeyedStateHandle]
                 ) -> tuple[_ChainIndex, list[tuple[int, KeyedStateHandle]], list[ChainBreak]]:
        """The index once ``new`` (handles of newer checkpoints, ordered) follow these handles, and the baseless
        deltas and chain breaks ``new`` brings: what :func:`baseless_deltas` and :func:`chain_breaks` would find in
        the new handles over all of them, in O(key groups of ``new``) (numpy) plus O(changed key groups)."""
        size = len(self.tip_checkpoint)
        chains = dict(self.chains)
        tip_checkpoint, tip_checksum = self.tip_checkpoint.copy(), self.tip_checksum.copy()
        uses = dict(self.uses)
        members = {id(h): h for h in self.handles}
        baseless: list[tuple[int, KeyedStateHandle]] = []
        breaks: list[ChainBreak] = []
        for h in new:
            members[id(h)] = h
            part = h.key_group_range.intersection(KeyGroupRange(0, size - 1)) if size else KeyGroupRange.empty()
            if not part:
                continue
            a, b = part.start, part.end + 1
            ha, hb = a - h.key_group_range.start, b - h.key_group_range.start
            full = np.zeros(b - a, dtype=bool)
            for f in h.full_key_groups:
                fp = f.intersection(part)
                if fp:
                    full[fp.start - a:fp.end - a + 1] = True
            nonempty = h.block_sizes()[ha:hb] > EMPTY_BLOCK_SIZE
            started = tip_checkpoint[a:b] >= 0
            fresh = np.zeros(b - a, dtype=bool)
            if h.fresh_key_groups is None:
                fresh[:] = True
            else:
                for f in h.fresh_key_groups:
                    fp = f.intersection(part)
                    if fp:
                        fresh[fp.start - a:fp.end - a + 1] = True
            for j in np.flatnonzero(nonempty & ~full & ~started & ~fresh).tolist():
                baseless.append((a + j, h))
            if h.format_version >= CHAINED_FORMAT_VERSION:
                links = h.predecessors
                if isinstance(links, BlockLinks):
                    names, named_checksum = links.checkpoints[ha:hb], links.checksums[ha:hb]
                else:
                    names = np.full(b - a, -1, dtype=np.int64)
                    named_checksum = np.zeros(b - a, dtype=np.int64)
                linked = names >= 0
                wrong = linked & ((tip_checkpoint[a:b] != names) | (tip_checksum[a:b] != named_checksum))
                bad = ~full & ((wrong & (started | ~nonempty)) | (~linked & nonempty & started))
                for j in np.flatnonzero(bad).tolist():
                    chain = chains.get(a + j)
                    breaks.append(ChainBreak(a + j, h, chain[-1] if chain else None,
                                             BlockLink(int(names[j]), int(named_checksum[j])) if names[j] >= 0
                                             else None))
            moves = full | nonempty
            checksums = (h.checksum_array()[ha:hb] if h.checksums is not None
                         else np.full(b - a, -1, dtype=np.int64))
            tip_checkpoint[a:b][moves] = h.checkpoint_id
            tip_checksum[a:b][moves] = checksums[moves]
            for j in np.flatnonzero(moves).tolist():
                kg = a + j
                old = chains.get(kg)
                if full[j]:
                    for g in old or ():
                        uses[id(g)] -= 1
                    chain = [h]
                    uses[id(h)] = uses.get(id(h), 0) + 1
                else:
                    chain = [*old, h] if old else [h]
                    uses[id(h)] = uses.get(id(h), 0) + 1
                chains[kg] = chain
        needed = {i: members[i] for i, n in uses.items() if n > 0}
        for h in new:   # a new file stays even if it holds only empty deltas: the subtask reported it
            needed[id(h)] = h
        handles = sorted(needed.values(), key=lambda h: (h.checkpoint_id, h.key_group_range.start))
        uses = {i: n for i, n in uses.items() if n > 0}
        index = _ChainIndex(handles, chains, tip_checkpoint, tip_checksum, uses,
                            self.verified and not baseless and not breaks)
        breaks.sort(key=lambda br: (br.key_group, br.delta.checkpoint_id))
        return index, sorted(baseless, key=lambda f: f[0]), breaks


#: The chain indexes of the last keyed handle lists seen (a driver's restore point and the checkpoint it commits),
#: by the handles' identities: the next commit extends the last one instead of working every chain out again.
_INDEXES: collections.OrderedDict[tuple[int, ...], _ChainIndex] = collections.OrderedDict()
_INDEXES_KEEP = 8


def _chain_index(handles: Sequence[KeyedStateHandle], size: int) -> _ChainIndex:
    """The (cached) index of ``handles`` over key groups ``[0, size)``."""
    key = (size, *map(id, handles))
    with _CHAINS_LOCK:
        found = _INDEXES.get(key)
        if found is not None and len(found.handles) == len(handles) and all(
                a is b for a, b in zip(found.handles, handles)):
            _INDEXES.move_to_end(key)
            return found
    index = _ChainIndex.build(handles, size)
    _remember_index(index, size)
    return index


def _remember_index(index: _ChainIndex, size: int) -> None:
    with _CHAINS_LOCK:
        _INDEXES[(size, *map(id, index.handles))] = index
        while len(_INDEXES) > _INDEXES_KEEP:
            _INDEXES.popitem(last=False)


def check_chains(metadata: CheckpointMetadata) -> tuple[list[tuple[int, KeyedStateHandle]], list[ChainBreak]]:
    """``(baseless deltas, chain breaks)`` of ``metadata``'s keyed handles over all its key groups (see
    :func:`baseless_deltas`, :func:`chain_breaks`): none for whole chains. Handles that :func:`carry_forward` put
    together from a checkpoint whose chains were whole are known whole already (its new handles were checked as
    they were added), so a commit checks what its batch wrote, not every chain again."""
    handles = _ordered_handles(metadata.checkpoint_id, metadata.keyed_handles)
    index = _chain_index(handles, metadata.max_parallelism)
    if index.verified:
        return [], []
    return index.verify()


def carry_forward(previous: CheckpointMetadata | None, new_handles: Sequence[KeyedStateHandle], *,
                  max_parallelism: int | None = None) -> list[KeyedStateHandle]:
    """The keyed handles of the checkpoint after ``previous``: ``new_handles`` (what its subtasks wrote; a subtask
    that changed nothing may have written none) and every handle of ``previous`` that some key group's chain still
    needs, in chain order. A previous handle every key group of which has a newer full block (or only empty
    deltas since one) drops out.

    ``max_parallelism`` is the new checkpoint's (None: ``previous``'s). When it differs, ``previous``'s key groups
    are numbered otherwise and none of its files carries over: the new handles must be full (a backend restored
    across a max-parallelism change writes its first snapshot full), else ValueError.

    The chains of ``previous`` are worked out once (and kept); the new checkpoint's follow from them and the new
    handles in O(their key groups), and are kept in turn for :func:`check_chains` and the next batch."""
    new = list(new_handles)
    new_ids = {h.checkpoint_id for h in new}
    if previous is not None and any(i <= previous.checkpoint_id for i in new_ids):
        raise ValueError(f"new keyed handles of checkpoints {sorted(new_ids)} cannot follow checkpoint "
                         f"{previous.checkpoint_id}: a new file belongs to a newer checkpoint")
    if previous is not None and max_parallelism is not None and max_parallelism != previous.max_parallelism:
        partial = [h.file for h in new if not h.is_all_full]
        if partial:
            raise ValueError(f"keyed files {partial} hold delta blocks, but their checkpoint changes the max "
                             f"parallelism from {previous.max_parallelism} to {max_parallelism}: a delta cannot "
                             "apply to key groups numbered otherwise; the first snapshot after the change must be "
                             "full")
        previous = None
    size = max([max_parallelism or 0, previous.max_parallelism if previous is not None else 0,
                *(h.key_group_range.end + 1 for h in new if h.key_group_range)])   # past it: validate() refuses
    ordered_new = _ordered_handles(max(new_ids | {previous.checkpoint_id if previous else 0}), new)
    if previous is None:
        base = _ChainIndex((), {}, np.full(size, -1, dtype=np.int64), np.full(size, -1, dtype=np.int64), {}, True)
    else:
        base = _chain_index(_ordered_handles(previous.checkpoint_id, previous.keyed_handles), size)
    index, _, _ = base.extended(ordered_new)
    extra = [h for h in new if not h.key_group_range]   # a subtask without key groups: listed, in no chain
    if extra:
        return sorted([*index.handles, *extra], key=lambda h: (h.checkpoint_id, h.key_group_range.start))
    _remember_index(index, size)
    return list(index.handles)


# ---- operator state -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ElementRun:
    """A contiguous run of one old subtask's elements of one state, to be read by one new subtask.

    ``first``/``stop``: element indices ``[first, stop)`` in the old subtask's list. ``byte_range``: the run's exact
    bytes in ``file``. ``read_range``: ``byte_range`` widened to whole checksum blocks (what is actually read).
    """

    file: str
    old_subtask: int
    state: str
    mode: DistributionMode
    first: int
    stop: int
    byte_range: tuple[int, int]
    read_range: tuple[int, int]

    def __len__(self) -> int:
        return self.stop - self.first


def split_sizes(total: int, parallelism: int, start: int = 0) -> tuple[list[tuple[int, int]], int]:
    """How Flink's round-robin repartitioner cuts ``total`` elements for ``parallelism`` subtasks.

    Returns ``([(subtask, count), ...] in the order the concatenated list is handed out, next start)``: subtasks
    are visited from ``start`` on, wrapping; the first ``total % parallelism`` of them get one element more, and
    the first one that gets no extra element is where the next state starts, so extras rotate across states.
    """
    if parallelism < 1:
        raise ValueError(f"parallelism must be >= 1, got {parallelism}")
    base, remainder = divmod(total, parallelism)
    order: list[tuple[int, int]] = []
    next_start = start
    for i in range(parallelism):
        subtask = (i + start) % parallelism
        count = base
        if remainder > 0:
            count += 1
            remainder -= 1
        elif remainder == 0:
            next_start = subtask
            remainder -= 1
        order.append((subtask, count))
    return order, next_start


def _run(handle: OperatorStateHandle, name: str, meta: OperatorStateMeta, first: int, stop: int) -> ElementRun:
    """Elements ``[first, stop)`` of state ``name`` in ``handle``, with their bytes and checksum blocks."""
    if first >= stop:   # nothing to read, but the state (mode, serializers) is still restored
        at = meta.bound(first)
        return ElementRun(handle.file, handle.subtask, name, meta.mode, first, first, (at, at), (at, at))
    starts = meta.block_starts
    b_first = bisect.bisect_right(starts, first) - 1
    b_last = bisect.bisect_right(starts, stop - 1)   # block after the one holding stop-1
    read_lo = meta.bound(starts[b_first])
    read_hi = meta.bound(starts[b_last]) if b_last < len(starts) else meta.end
    return ElementRun(handle.file, handle.subtask, name, meta.mode, first, stop,
                      (meta.bound(first), meta.bound(stop)), (read_lo, read_hi))


def _states_of(handles: Sequence[OperatorStateHandle], operator_id: str | None
               ) -> dict[str, list[tuple[OperatorStateHandle, OperatorStateMeta]]]:
    """State name -> its per-old-subtask pieces, in old subtask order. Each handle is valid on its own (checked when
    built); here the handles must agree: one per subtask, and one mode and serializers per state."""
    for h in handles:
        if not isinstance(h, OperatorStateHandle):
            raise TypeError(f"handles must be OperatorStateHandle objects (OperatorStateHandle.from_json reads one "
                            f"from JSON), got {type(h).__name__}")
    chosen = sorted((h for h in handles if operator_id is None or h.operator_id == operator_id),
                    key=lambda h: h.subtask)
    subtasks = [h.subtask for h in chosen]
    if len(set(subtasks)) != len(subtasks):
        raise CorruptSnapshotError(f"operator {operator_id!r}: two handles for the same subtask ({subtasks})")
    by_name: dict[str, list[tuple[OperatorStateHandle, OperatorStateMeta]]] = {}
    for h in chosen:
        for name, meta in h.states.items():
            pieces = by_name.setdefault(name, [])
            if pieces and (pieces[0][1].mode, pieces[0][1].serializers) != (meta.mode, meta.serializers):
                raise CorruptSnapshotError(f"operator state {name!r}: subtasks {pieces[0][0].subtask} and "
                                           f"{h.subtask} disagree on its mode or serializers")
            pieces.append((h, meta))
    return by_name


def plan_operator_restore(handles: Sequence[OperatorStateHandle], new_parallelism: int, *,
                          operator_id: str | None = None) -> list[list[ElementRun]]:
    """Which element runs each of ``new_parallelism`` subtasks reads, from the old handles alone (no file I/O).

    SPLIT_DISTRIBUTE states (in name order) are cut as :func:`split_sizes` says over the old lists concatenated in
    old subtask order; UNION states go whole to everyone; new subtask ``i`` reads a BROADCAST state from the
    ``i % k``-th of the ``k`` old subtasks that hold it (each holds a full copy), as Flink does. Unlike Flink, an
    unchanged parallelism is rebalanced too (Flink hands the old lists back as they were), so lists are always
    balanced after a restore. ``operator_id`` picks one operator's handles when several share a checkpoint.
    """
    if not isinstance(new_parallelism, int) or new_parallelism < 1:
        raise ValueError(f"new_parallelism must be an int >= 1, got {new_parallelism!r}")
    plan: list[list[ElementRun]] = [[] for _ in range(new_parallelism)]
    start = 0
    for name, pieces in sorted(_states_of(handles, operator_id).items()):
        mode = pieces[0][1].mode
        if mode is DistributionMode.UNION:
            runs = [_run(h, name, meta, 0, len(meta)) for h, meta in pieces if len(meta)]
            for subtask_runs in plan:
                subtask_runs.extend(runs)
        elif mode is DistributionMode.BROADCAST:
            for i, subtask_runs in enumerate(plan):
                h, meta = pieces[i % len(pieces)]
                subtask_runs.append(_run(h, name, meta, 0, len(meta)))   # kept even when empty: the state exists
        else:
            order, start = split_sizes(sum(len(meta) for _, meta in pieces), new_parallelism, start)
            k, pos = 0, 0   # cursor into the concatenation: piece k, element pos
            for subtask, count in order:
                while count > 0:
                    while pos >= len(pieces[k][1]):
                        k, pos = k + 1, 0
                    h, meta = pieces[k]
                    take = min(count, len(meta) - pos)
                    plan[subtask].append(_run(h, name, meta, pos, pos + take))
                    pos += take
                    count -= take
        # a subtask that gets no elements must still know the state was restored, with its mode and serializers
        for subtask_runs in plan:
            if not subtask_runs or subtask_runs[-1].state != name:
                subtask_runs.append(_run(pieces[0][0], name, pieces[0][1], 0, 0))
    return plan
