"""Checks on write: a state whose serializer checks values (``TypeSerializer.check``; ``RecordSerializer`` does, with
its compiled encoder) refuses a value it could not snapshot where the value is written, not at the next snapshot.

A backend wraps its state classes with :func:`checked_state_class`: for a descriptor whose serializers check, the
state is an instance of a subclass whose writes (``update``; ``add``, ``add_all``, ``update``; ``put``, ``put_all``)
check each value first, then call the class's own write; for any other descriptor, of the class itself, so states of
other serializers pay nothing. Reducing and aggregating states store what their function made: their table checks it
in its ``put`` (:func:`stored_value_check`, :func:`check_stored`). A refusal is the ``StateSerializationError`` a
snapshot (or RocksDB's write to its database) raises for the value, naming the state, its serializers and the key;
the state keeps what it had.

A table here is a backend's per-state store: it has ``write_framing`` (``_codec.ValueFraming``) and ``ctx`` (the
backend's key context, whose ``key`` is the current key)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from keygroups.serializers.base import checks_on_write
from keygroups.state._codec import UNWRITABLE, ValueFraming
from keygroups.state.descriptors import StateDescriptor


def _refusal(table: Any, error: Exception, what: str) -> Exception:
    return table.write_framing.unwritable(table.ctx.key, error, what=what)


def _accept(value: Any) -> None:
    """The check of a serializer that checks nothing on write (a map's key or value beside one that does)."""


def _with_checks(kind: str, base: type) -> type:
    """``base`` (a value, list or map state class) with the write checks in front: its writes check each value
    (``self._check``; a map's keys with ``self._check_key`` too), then call ``base``'s own. The base methods are bound
    here, not looked up through ``super()`` on every call."""
    base_init: Any = base.__init__  # type: ignore[misc]  # the class's own, called on the subclass's instances

    def __init__(self: Any, store: Any, descriptor: StateDescriptor, backend: Any) -> None:
        base_init(self, store, descriptor, backend)
        self._table = store
        if kind == "map":
            self._check = checks_on_write(descriptor.serializers["map value"]) or _accept
            self._check_key = checks_on_write(descriptor.serializers["map key"]) or _accept
        else:
            self._check = descriptor.serializers["element" if kind == "list" else "value"].check

    methods: dict[str, Any] = {"__init__": __init__}
    if kind == "value":
        base_update = base.update  # type: ignore[attr-defined]

        def update(self: Any, value: Any) -> None:
            if value is not None:
                try:
                    self._check(value)
                except UNWRITABLE as e:
                    raise _refusal(self._table, e, "update") from e
            base_update(self, value)

        methods["update"] = update
    elif kind == "list":
        base_add, base_add_all = base.add, base.add_all  # type: ignore[attr-defined]
        base_replace = base.update  # type: ignore[attr-defined]

        def check_all(self: Any, values: Any, what: str) -> list[Any]:
            values = list(values)
            check = self._check
            try:
                for v in values:
                    if v is not None:   # the state refuses None itself, naming it
                        check(v)
            except UNWRITABLE as e:
                raise _refusal(self._table, e, what) from e
            return values

        def add(self: Any, value: Any) -> None:
            if value is not None:
                try:
                    self._check(value)
                except UNWRITABLE as e:
                    raise _refusal(self._table, e, "add") from e
            base_add(self, value)

        def add_all(self: Any, values: Any) -> None:
            base_add_all(self, check_all(self, values, "add_all"))

        def replace(self: Any, values: Any) -> None:
            base_replace(self, check_all(self, values, "update"))

        methods.update(add=add, add_all=add_all, update=replace)
    elif kind == "map":
        base_put, base_put_all = base.put, base.put_all  # type: ignore[attr-defined]

        def put(self: Any, key: Any, value: Any) -> None:
            try:
                self._check_key(key)
                self._check(value)
            except UNWRITABLE as e:
                raise _refusal(self._table, e, "put") from e
            base_put(self, key, value)

        def put_all(self: Any, mapping: Any) -> None:
            check, check_key = self._check, self._check_key
            try:
                for k, v in mapping.items():
                    check_key(k)
                    check(v)
            except UNWRITABLE as e:
                raise _refusal(self._table, e, "put_all") from e
            base_put_all(self, mapping)

        methods.update(put=put, put_all=put_all)
    else:
        raise ValueError(f"no write checks for {kind} states")
    slots = ("_table", "_check", "_check_key") if kind == "map" else ("_table", "_check")
    return type(f"_Checked{base.__name__.lstrip('_')}", (base,), {"__slots__": slots, "__module__": __name__,
                                                                   "__qualname__": f"_Checked{base.__name__}",
                                                                   **methods})


_ROLES = {"value": ("value",), "list": ("element",), "map": ("map key", "map value")}


class _StateChooser:
    """Stands for a state class (it is called as one: ``(store, descriptor, backend)``): an instance of ``checked``
    for a descriptor whose serializers check on write, of ``plain`` otherwise."""

    def __init__(self, kind: str, plain: type) -> None:
        self.kind, self.plain, self.checked = kind, plain, _with_checks(kind, plain)
        self.roles = _ROLES[kind]

    def __call__(self, store: Any, descriptor: StateDescriptor, backend: Any) -> Any:
        serializers = descriptor.serializers
        checks = any(checks_on_write(serializers[role]) is not None for role in self.roles)
        return (self.checked if checks else self.plain)(store, descriptor, backend)


_CHOOSERS: dict[type, _StateChooser] = {}


def checked_state_class(kind: str, plain: type) -> type:
    """What a backend's ``_state_class`` returns for state class ``plain`` of ``kind``: for value, list and map states
    a chooser (made once per class) that builds ``plain`` or its checked subclass by the descriptor's serializers;
    ``plain`` itself for reducing and aggregating states (their table checks, see :func:`stored_value_check`)."""
    if kind not in _ROLES:
        return plain
    chooser = _CHOOSERS.get(plain)
    if chooser is None:
        chooser = _CHOOSERS[plain] = _StateChooser(kind, plain)
    return chooser  # type: ignore[return-value]  # called as the class would be


def _check_first(check: Callable[[Any], None], stored: tuple[Any, int]) -> None:
    check(stored[0])   # a TTL value: (value, timestamp)


def stored_value_check(write: ValueFraming) -> Callable[[Any], None] | None:
    """For a table with framing ``write``: the check of what a reducing or aggregating state stores (its value, or a
    TTL ``(value, timestamp)``) when its serializer checks on write; None otherwise (value, list and map states check
    in their classes)."""
    if write.kind not in ("reducing", "aggregating"):
        return None
    check = checks_on_write(write.ser)
    if check is None or not write.ttl:
        return check
    return functools.partial(_check_first, check)


def check_stored(check: Callable[[Any], None], value: Any, table: Any) -> None:
    """``check(value)`` for ``table``'s ``put`` (see :func:`stored_value_check`); a refusal names the state."""
    try:
        check(value)
    except UNWRITABLE as e:
        raise _refusal(table, e, "add") from e


__all__ = ["checked_state_class", "stored_value_check", "check_stored"]
