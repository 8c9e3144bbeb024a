"""Keyed states that a backend snapshots and restores but does not hold itself: *external states*.

A function whose state is better kept in its own layout (``keygroups.aggregates`` keeps accumulators as numpy
columns per key, updated for a whole batch at once) binds its states to an :class:`ExternalStates` object with
``backend.bind_external_states(descriptors, make)``. They stay ordinary keyed state everywhere outside memory: the
backend writes them into its own snapshot files, one section per state and key group as for any state (full blocks
and deltas, in the canonical per-key value framing of ``keygroups.state._codec``), so a restore at any parallelism, by
either backend, the state reader, ``keygroups verify`` and the Flink export never see a difference. A backend that
does not support it (``bind_external_states`` returns None) keeps the states itself and the function reads and
writes them through the ordinary state objects.

What the backend hands the external object, and when (a backend that supports external states: the heap backend):

- at binding: the states' entries it restored (or kept from earlier batches), as bytes per key group
  (:meth:`ExternalStates.load`), after which it forgets them;
- at each snapshot: ``capture`` (in the snapshot's synchronous part) gives the sections to write, per key group,
  full for the key groups the backend writes full and the changes since the last capture for the others; the
  backend writes them beside its own and ``confirm`` says the file is complete (called on the snapshot thread: it
  must only note the fact);
- when a kept backend catches up on blocks other workers wrote, or takes over key groups: ``load``, ``clear`` and
  ``move``;
- when the states are registered the ordinary way again (another function on a kept backend), or bound with another
  meta: ``release`` gives every entry back as bytes, and the backend keeps them as restored state.

The per-key state objects (``get_state`` after binding) work on :meth:`ExternalStates.store`, a store of the
``keygroups.state.states`` interface (``get``/``put``/``delete`` of the backend's current key).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from keygroups.checkpoint import KeyGroupBlock
from keygroups.errors import StateMigrationError

#: n serialized items of one buffer: ``(buffer, offsets)``, item i is ``buffer[offsets[i]:offsets[i + 1]]`` (int64
#: offsets, n + 1 of them).
Items = tuple[Any, Any]
#: A put section of external states: (the state's position in ``ExternalStates.names``, keys, values), keys and
#: values as lists of bytes or ``Packed`` (``keygroups.checkpoint.format.Packed``).
ExternalPut = tuple[int, Any, Any]
#: A delete section: (position, keys).
ExternalDelete = tuple[int, Any]


class ExternalStates(Protocol):
    """The states of one function kept outside the backend (see the module docstring). Positions index ``names``
    and :meth:`metas`, which are fixed when the object is made."""

    #: The states' names.
    names: tuple[str, ...]

    def metas(self) -> list[dict[str, Any]]:
        """Each state's meta, as ``keygroups.state._base.state_meta`` makes it for its descriptor."""
        ...

    def store(self, name: str) -> Any:
        """State ``name``'s store for the per-key state objects (``get``, ``put``, ``delete`` of the backend's
        current key; a TTL state's values as ``(value, timestamp)``)."""
        ...

    def load(self, key_group: int, full: bool, puts: list[tuple[int, Items, Items]],
             deletes: list[tuple[int, Items]]) -> None:
        """Apply one block of key group ``key_group`` (absolute): ``full`` replaces every entry the key group held
        (of every state) by the block's; otherwise its puts replace the values of their keys, then its deletes remove
        theirs. ``puts``: ``(position, keys, values)``, ``deletes``: ``(position, keys)``, each part as ``(buffer,
        offsets)`` (:data:`Items`); keys as the backend's key serializer writes them, values in the states'
        framing."""
        ...

    def capture(self, checkpoint_id: int, full: Collection[int]
                ) -> dict[int, tuple[list[ExternalPut], list[ExternalDelete]]]:
        """What snapshot ``checkpoint_id`` writes, per key group with something to write: every live entry of the key
        groups in ``full`` (absolute); for the others, the entries changed since the last capture whose snapshot was
        confirmed (puts) and the keys removed since (deletes). Encoded now: later changes never reach it."""
        ...

    def confirm(self, checkpoint_id: int) -> None:
        """The snapshot of ``checkpoint_id``'s capture is complete (called from the snapshot thread: note it only)."""
        ...

    def changed(self) -> bool:
        """Whether anything changed since the last confirmed snapshot's capture (or a capture is unconfirmed)."""
        ...

    def clear(self, key_groups: Iterable[int]) -> None:
        """Forget every entry of ``key_groups`` (absolute)."""
        ...

    def move(self, key_group_range: Any) -> None:
        """The backend's key-group range is now ``key_group_range``: entries of key groups outside it go."""
        ...

    def keys(self, name: str) -> Iterator[Any]:
        """Every key with a value in state ``name``, key group by key group."""
        ...

    def entries(self) -> int:
        """Entries over all the states."""
        ...

    def has_data(self) -> bool:
        ...

    def release(self) -> Iterator[tuple[int, list[ExternalPut]]]:
        """Every live entry, per key group (ascending), as put sections: the backend keeps them from now on."""
        ...


@dataclass(frozen=True)
class ExternalTarget:
    """What a restore's state index maps to for a state bound to external states: the object and the position."""

    states: ExternalStates
    position: int


def canonical_meta(meta: dict[str, Any]) -> str:
    return json.dumps(meta, sort_keys=True, separators=(",", ":"))


def route_block(block: KeyGroupBlock, targets: list[Any]) -> KeyGroupBlock:
    """Apply ``block``'s sections of external targets to their external states and return the block with the
    others only (``block`` itself when it has none). ``block`` must carry int64 offsets
    (``read_key_group_offsets``)."""
    externals = {id(t.states): t.states for t in targets if isinstance(t, ExternalTarget)}
    if not externals:
        return block
    puts: dict[int, list[tuple[int, Items, Items]]] = {k: [] for k in externals}
    deletes: dict[int, list[tuple[int, Items]]] = {k: [] for k in externals}
    kept_puts: list[tuple[int, Any, Any]] = []
    kept_deletes: list[tuple[int, Any]] = []
    for put in block.puts:
        target = targets[put[0]]
        if isinstance(target, ExternalTarget):
            puts[id(target.states)].append((target.position, (block.block, put[1]), (block.block, put[2])))
        else:
            kept_puts.append(put)
    for delete in block.deletes:
        target = targets[delete[0]]
        if isinstance(target, ExternalTarget):
            deletes[id(target.states)].append((target.position, (block.block, delete[1])))
        else:
            kept_deletes.append(delete)
    for k, states in externals.items():
        if block.full or puts[k] or deletes[k]:
            states.load(block.key_group, block.full, puts[k], deletes[k])
    return KeyGroupBlock(block.key_group, block.full, block.sorted, block.block, kept_puts, kept_deletes,
                         block.predecessor)


def items(part: Any) -> Items:
    """A section part (a ``Packed`` or a list of bytes) as :data:`Items`."""
    data, offsets = getattr(part, "data", None), getattr(part, "offsets", None)
    if data is not None and offsets is not None:
        return data, offsets
    parts = list(part)
    bounds = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, parts), np.int64, len(parts)), out=bounds[1:])
    return b"".join(parts), bounds


def external_block(key_group: int, puts: list[ExternalPut]) -> KeyGroupBlock:
    """A delta block of ``key_group`` holding ``puts`` (keys unsorted), as a restore hands blocks to a backend: how
    released external entries go back into it."""
    parts: list[Any] = []
    sections = []
    pos = 0
    for position, keys, values in puts:
        offsets = []
        for part in (keys, values):
            data, o = items(part)
            o = np.asarray(o, dtype=np.int64)
            parts.append(memoryview(data)[int(o[0]):int(o[-1])])
            offsets.append(o - o[0] + pos)
            pos += int(o[-1] - o[0])
        sections.append((position, offsets[0], offsets[1]))
    return KeyGroupBlock(key_group, False, False, memoryview(b"".join(parts)), sections, [])


def check_target_meta(states: ExternalStates, position: int, meta: dict[str, Any]) -> ExternalTarget:
    """The restore target of a block's state ``meta`` that ``states`` holds at ``position``; StateMigrationError
    when the block was written with another meta (its bytes would not be the external states' values)."""
    if canonical_meta(states.metas()[position]) != canonical_meta(meta):
        raise StateMigrationError(
            f"state {meta['name']!r} is bound to external states with meta {states.metas()[position]}, but a block to "
            f"restore into it was written with {meta}: restore a fresh backend instead")
    return ExternalTarget(states, position)


class ExternalCapture:
    """What one snapshot writes of a backend's external states: their metas (after the backend's own, from state
    index ``offset``) and their sections per key group, merged into the backend's stream of key groups."""

    def __init__(self, bound: list[ExternalStates], checkpoint_id: int, full: Collection[int], offset: int) -> None:
        self.metas: list[dict[str, Any]] = []
        self._sections: dict[int, tuple[list[Any], list[Any]]] = {}
        base = offset
        for states in bound:
            for kg, (puts, deletes) in states.capture(checkpoint_id, full).items():
                into = self._sections.setdefault(kg, ([], []))
                into[0].extend((base + p, keys, values) for p, keys, values in puts)
                into[1].extend((base + p, keys) for p, keys in deletes)
            metas = states.metas()
            self.metas.extend(metas)
            base += len(metas)

    def merge(self, groups: Iterable[tuple[int, list[Any], list[Any]]]) -> Iterator[tuple[int, list[Any], list[Any]]]:
        """``groups`` (the backend's ``(key group, puts, deletes)``, ascending) with the external sections added,
        key groups only the external states write included."""
        pending = sorted(self._sections.items())
        i = 0
        for kg, puts, deletes in groups:
            while i < len(pending) and pending[i][0] < kg:
                yield pending[i][0], list(pending[i][1][0]), list(pending[i][1][1])
                i += 1
            if i < len(pending) and pending[i][0] == kg:
                extra_puts, extra_deletes = pending[i][1]
                i += 1
                yield kg, [*puts, *extra_puts], [*deletes, *extra_deletes]
            else:
                yield kg, puts, deletes
        for kg, (puts, deletes) in pending[i:]:
            yield kg, list(puts), list(deletes)


__all__ = ["ExternalStates", "ExternalTarget", "ExternalCapture", "Items", "items", "route_block", "external_block",
           "check_target_meta", "canonical_meta"]
