"""Hypothesis strategies shared by the serializer tests: (serializer, values) pairs, nested freely."""

from __future__ import annotations

import math
import struct
from typing import Any

from hypothesis import strategies as st

from keygroups.serializers import (
    BoolSerializer,
    BytesSerializer,
    Float64Serializer,
    Int32Serializer,
    Int64Serializer,
    ListSerializer,
    MapSerializer,
    NullableSerializer,
    StrSerializer,
    TupleSerializer,
    ValueSerializer,
)

floats = st.floats(allow_nan=False)

json_leaf = st.none() | st.booleans() | st.integers() | floats | st.text(max_size=20) | st.binary(max_size=20)
hashable_json = st.recursive(json_leaf, lambda ch: st.lists(ch, max_size=3).map(tuple), max_leaves=6)
json_values = st.recursive(
    json_leaf,
    lambda ch: (st.lists(ch, max_size=4) | st.lists(ch, max_size=4).map(tuple)
                | st.dictionaries(hashable_json, ch, max_size=4)),
    max_leaves=20,
)

HASHABLE_LEAVES = [
    (Int64Serializer(), st.integers(-(2**63), 2**63 - 1)),
    (Int32Serializer(), st.integers(-(2**31), 2**31 - 1)),
    (Float64Serializer(), floats),
    (BoolSerializer(), st.booleans()),
    (StrSerializer(), st.text(max_size=30)),
    (BytesSerializer(), st.binary(max_size=30)),
]
hashable_leaf = st.sampled_from(HASHABLE_LEAVES)
leaf = st.sampled_from([*HASHABLE_LEAVES, (ValueSerializer(), json_values)])


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        children.map(lambda p: (NullableSerializer(p[0]), st.none() | p[1])),
        st.lists(children, min_size=1, max_size=3).map(
            lambda ps: (TupleSerializer(*[p[0] for p in ps]), st.tuples(*[p[1] for p in ps]))),
        children.map(lambda p: (ListSerializer(p[0]), st.lists(p[1], max_size=5))),
        st.tuples(hashable_leaf, children).map(
            lambda kv: (MapSerializer(kv[0][0], kv[1][0]), st.dictionaries(kv[0][1], kv[1][1], max_size=5))),
    )


#: (serializer, strategy of its values), nested up to a few levels.
serializers_and_values = st.recursive(leaf, _extend, max_leaves=5)


def canon(v: Any) -> Any:
    """A form of v where equal means equal value AND equal types (True is not 1, a tuple is not a list, -0.0 is not
    0.0), with dicts compared as sets of entries."""
    t = type(v)
    if isinstance(v, float):   # a map key's -0.0 or NaN comes back as its Java-equality float subclass
        return ("float", "nan" if math.isnan(v) else struct.pack("<d", v))
    if t in (list, tuple):
        return (t.__name__, tuple(canon(x) for x in v))
    if t is dict:
        return ("dict", frozenset((canon(k), canon(x)) for k, x in v.items()))
    return (t.__name__, v)
