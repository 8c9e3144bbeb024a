"""``PickleSerializer``: arbitrary Python objects through pickle. Explicit opt-in only.

Unpickling runs arbitrary code, so a snapshot that holds pickled data refuses to restore unless the caller passes
``allow_pickle=True`` (``SerializerSnapshot.restore_serializer``, ``resolve_compatibility``). Constructing a
``PickleSerializer`` yourself is the opt-in for the data you write. The bytes are not deterministic (pickle may
memoize differently), so never use it for keys.
"""

from __future__ import annotations

import copy as _copy
import pickle
from typing import Any

from keygroups.errors import CorruptSnapshotError
from keygroups.serializers.base import TypeSerializer
from keygroups.serializers.snapshot import PICKLE_IDENTIFIER


class PickleSerializer(TypeSerializer[Any]):
    """Any picklable value; ``protocol`` is used for writing (reading understands every protocol)."""

    identifier = PICKLE_IDENTIFIER
    is_immutable = False

    def __init__(self, protocol: int = pickle.HIGHEST_PROTOCOL) -> None:
        if not isinstance(protocol, int) or not 2 <= protocol <= pickle.HIGHEST_PROTOCOL:
            raise ValueError(f"pickle protocol must be an int in [2, {pickle.HIGHEST_PROTOCOL}], got {protocol!r}")
        self.protocol = protocol

    def serialize(self, value: Any) -> bytes:
        return pickle.dumps(value, protocol=self.protocol)

    def deserialize(self, data: bytes | memoryview) -> Any:
        try:
            return pickle.loads(data)
        except (ImportError, AttributeError):
            raise   # a class that is missing here, not corrupt bytes
        except Exception as e:
            raise CorruptSnapshotError(f"pickled data could not be loaded ({type(e).__name__}: {e}): the data is "
                                       "truncated or corrupt") from None

    def copy(self, value: Any) -> Any:
        return _copy.deepcopy(value)

    @classmethod
    def restore(cls, snapshot, nested):
        return cls()

    def __reduce__(self) -> tuple:
        return (PickleSerializer, (self.protocol,))

    def __repr__(self) -> str:
        return "PickleSerializer()"


__all__ = ["PickleSerializer"]
