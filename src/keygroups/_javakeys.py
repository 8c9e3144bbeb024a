"""Keys that compare as Java compares them: ``Double.equals`` makes every NaN one key and tells ``-0.0`` from ``0.0``,
while Python's ``==`` does the opposite (NaN equals nothing, ``-0.0 == 0.0``). Keys hash by Java's rule, so they
must also be *compared* by it wherever they meet: the state backends' per-key dicts and the runner's grouping.

A float key (alone or inside a tuple key) is brought to its canonical object when it becomes a backend's current
key: every NaN to :data:`NAN_KEY` (one object, so dict lookups find it by identity), ``-0.0`` to
:data:`NEGATIVE_ZERO_KEY`, a float whose equality and hash tell it from ``0.0``. Both are still floats: functions
compute with them, and serializers write their IEEE bits (Java's ``doubleToLongBits``: one canonical NaN)."""

from __future__ import annotations

from typing import Any


class NegativeZeroKey(float):
    """``-0.0`` as a key: equal only to itself, hashed apart from ``0.0`` (Java's ``Double.equals``)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is NegativeZeroKey

    def __ne__(self, other: object) -> bool:
        return type(other) is not NegativeZeroKey

    def __hash__(self) -> int:
        return -2   # hash(0.0) is 0; any other fixed value keeps the two apart

    def __repr__(self) -> str:
        return "-0.0"

    def __reduce__(self) -> Any:
        return (_negative_zero_key, ())


def _negative_zero_key() -> NegativeZeroKey:
    return NEGATIVE_ZERO_KEY


#: The one NaN every NaN key becomes.
NAN_KEY: float = float("nan")
#: The one ``-0.0`` every negative-zero key becomes.
NEGATIVE_ZERO_KEY = NegativeZeroKey(-0.0)

__all__ = ["NAN_KEY", "NEGATIVE_ZERO_KEY", "NegativeZeroKey"]
