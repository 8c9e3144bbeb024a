"""Java ``hashCode()``, Flink's murmur hash and key-group assignment, for single keys and for whole arrays.

How Python keys map to the Java types Flink would see (``key_type`` overrides the default):

=================================  ==========================  =========================================
Python / numpy / Arrow             Java type                   ``key_type`` name
=================================  ==========================  =========================================
``int``, ``np.int64``, Arrow int64  ``java.lang.Long``          ``"long"``
``np.int32``, Arrow int32           ``java.lang.Integer``       ``"int"``
int16 / int8 (numpy, Arrow)         ``Short`` / ``Byte``        ``"short"`` / ``"byte"``
unsigned integers                   ``Long`` of their value     ``"long"`` (Java has no unsigned types)
``bool``, ``np.bool_``              ``java.lang.Boolean``       ``"boolean"``
``float``, ``np.float64``           ``java.lang.Double``        ``"double"``
``np.float32``, ``np.float16``      ``java.lang.Float``         ``"float"``
``str``, Arrow (large_)utf8/view    ``java.lang.String``        ``"string"`` (hashed over UTF-16 code units)
``bytes``, Arrow (large_)binary     ``byte[]``                  ``"bytes"`` (``Arrays.hashCode``; our choice:
                                                                Flink itself refuses arrays as keys)
``tuple``                           Flink ``TupleN``            a tuple of the fields' key types
=================================  ==========================  =========================================

Arrays follow one table (``_KEY_TYPE_BY_ELEMENT``): numpy dtypes directly, Arrow types through
:func:`key_type_for_arrow`, which ``KeyedJob`` also uses for its key columns, so a column hashes the same whether
it goes through :func:`assign_key_groups` or through a job's keyed state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from keygroups._native import hashing as _h
from keygroups._ranges import check_max_parallelism, check_parallelism

KeyType = Union[str, tuple["KeyType", ...], None]

_KEY_TYPE_CODES = {
    "long": _h.KEY_TYPE_LONG,
    "int": _h.KEY_TYPE_INT,
    "short": _h.KEY_TYPE_SHORT,
    "byte": _h.KEY_TYPE_BYTE,
    "boolean": _h.KEY_TYPE_BOOLEAN,
    "double": _h.KEY_TYPE_DOUBLE,
    "float": _h.KEY_TYPE_FLOAT,
    "string": _h.KEY_TYPE_STRING,
    "bytes": _h.KEY_TYPE_BYTES,
}
_INT_RANGES = {"int": (-(2**31), 2**31 - 1), "short": (-(2**15), 2**15 - 1), "byte": (-128, 127)}
_INT64_MAX = 2**63 - 1

#: The Java key type of an array element, by numpy dtype kind and item size: the one table for numpy arrays and
#: (through ``to_pandas_dtype``) for Arrow's numeric and bool types. Unsigned integers hash as the Long of their value.
_KEY_TYPE_BY_ELEMENT: dict[tuple[str, int], str] = {
    ("i", 8): "long",
    ("i", 4): "int",
    ("i", 2): "short",
    ("i", 1): "byte",
    ("u", 8): "long",
    ("u", 4): "long",
    ("u", 2): "long",
    ("u", 1): "long",
    ("b", 1): "boolean",
    ("f", 8): "double",
    ("f", 4): "float",
    ("f", 2): "float",
}
_SUPPORTED_NUMPY = (
    "signed and unsigned integers, float16/float32/float64, bool, unicode ('U'), bytes ('S') and object arrays"
)
_SUPPORTED_ARROW = (
    "integers, floating point, bool, utf8 / large_utf8 / string_view, binary / large_binary / binary_view, and "
    "dictionaries of these"
)


def key_type_code(key_type: KeyType) -> Any:
    """The compiled core's code for a key type name (or tuple of names); None stays None (infer from the value)."""
    if key_type is None:
        return None
    if isinstance(key_type, tuple):
        return tuple(key_type_code(k) for k in key_type)
    try:
        return _KEY_TYPE_CODES[key_type]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown key_type {key_type!r}; allowed: None (infer), {', '.join(map(repr, _KEY_TYPE_CODES))}, "
            "or a tuple of these for tuple keys"
        ) from None


def key_type_for_arrow(arrow_type: pa.DataType) -> str:
    """The Flink key type name (``"long"``, ``"string"``, ...) under which values of an Arrow type hash: the one
    answer for :func:`assign_key_groups` and for a ``KeyedJob``'s key columns. A dictionary type answers for its
    value type. ``TypeError`` for a type with no Java key type."""
    t = pa.types
    if t.is_dictionary(arrow_type):
        return key_type_for_arrow(arrow_type.value_type)
    if t.is_integer(arrow_type) or t.is_floating(arrow_type) or t.is_boolean(arrow_type):
        dtype = np.dtype(arrow_type.to_pandas_dtype())
        return _KEY_TYPE_BY_ELEMENT[(dtype.kind, dtype.itemsize)]
    if t.is_string(arrow_type) or t.is_large_string(arrow_type) or t.is_string_view(arrow_type):
        return "string"
    if t.is_binary(arrow_type) or t.is_large_binary(arrow_type) or t.is_binary_view(arrow_type):
        return "bytes"
    raise TypeError(
        f"unsupported Arrow key type {arrow_type}: it has no Java key type; supported: {_SUPPORTED_ARROW}. Cast the "
        "column first (e.g. a timestamp or decimal to int64, a date to string)"
    )


def java_hash(key: Any, key_type: KeyType = None) -> int:
    """The signed 32-bit Java ``hashCode()`` Flink would compute for ``key`` (see the module docs for the types)."""
    return _h.java_hash_object(key, key_type_code(key_type))


def murmur_hash(h: int) -> int:
    """Flink's ``MathUtils.murmurHash(int)``: MurmurHash3 of the 4 bytes of ``h`` with seed 0, made non-negative."""
    if isinstance(h, bool) or not isinstance(h, (int, np.integer)):
        raise TypeError(f"murmur_hash takes a Java int (a Python int), got {type(h).__name__}")
    if not -(2**31) <= int(h) < 2**31:
        raise ValueError(f"murmur_hash takes a signed 32-bit int in [-2**31, 2**31 - 1], got {h}")
    return _h.murmur_hash(int(h))


def assign_to_key_group(key: Any, max_parallelism: int, key_type: KeyType = None) -> int:
    """The key group of ``key`` (Flink's ``KeyGroupRangeAssignment.assignToKeyGroup``)."""
    mp = check_max_parallelism(max_parallelism)
    return _h.key_group_for_hash(_h.java_hash_object(key, key_type_code(key_type)), mp)


def assign_to_operator(key: Any, max_parallelism: int, parallelism: int, key_type: KeyType = None) -> int:
    """The subtask that owns ``key`` (Flink's ``assignKeyToParallelOperator``)."""
    p, mp = check_parallelism(parallelism, max_parallelism)
    return assign_to_key_group(key, mp, key_type) * p // mp


def _first_null(arr: Any) -> int:
    return int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])


def _check_int_range(values: np.ndarray, key_type: str) -> None:
    lo, hi = _INT_RANGES[key_type]
    dtype_range = np.iinfo(values.dtype)
    if lo <= dtype_range.min and dtype_range.max <= hi:
        return  # every value of the dtype fits (int16 keys as "short"): no pass over the array
    if values.size and (values.min() < lo or values.max() > hi):
        pos = int(np.argmax((values < lo) | (values > hi)))
        raise ValueError(
            f"key {values[pos]!r} at position {pos} does not fit key_type {key_type!r}: allowed range is [{lo}, {hi}]"
        )


def _as_int64(values: np.ndarray) -> np.ndarray:
    if values.dtype == np.uint64 and values.size and values.max() > _INT64_MAX:
        pos = int(np.argmax(values > _INT64_MAX))
        raise ValueError(
            f"key {values[pos]} at position {pos} is outside the 64-bit range of java.lang.Long [-2**63, 2**63 - 1]"
        )
    return np.ascontiguousarray(values, dtype=np.int64)


def _numeric_hashes(values: np.ndarray, key_type: KeyType) -> np.ndarray:
    """Java hashes of a 1-D numeric or bool numpy array; int64 values are returned untouched (hash them as Long)."""
    kind = values.dtype.kind
    if key_type is None:
        key_type = _KEY_TYPE_BY_ELEMENT.get((kind, values.dtype.itemsize))
        if key_type is None:
            raise TypeError(f"unsupported key array dtype {values.dtype}; supported: {_SUPPORTED_NUMPY}")
    if key_type == "boolean":
        if kind != "b":
            raise TypeError(f"key_type 'boolean' needs bool keys, got an array of {values.dtype}")
        return _h.java_hashes_bool(np.ascontiguousarray(values).view(np.uint8))
    if key_type in ("long", "int", "short", "byte"):
        if kind not in "iu":
            raise TypeError(f"key_type {key_type!r} needs integer keys, got an array of {values.dtype}")
        if key_type == "long":
            return _h.java_hashes_int64(_as_int64(values))
        _check_int_range(values, key_type)
        return np.ascontiguousarray(values, dtype=np.int32)
    if key_type in ("double", "float"):
        if kind not in "iuf":
            raise TypeError(f"key_type {key_type!r} needs real-number keys, got an array of {values.dtype}")
        if key_type == "double":
            return _h.java_hashes_float64(np.ascontiguousarray(values, dtype=np.float64))
        return _h.java_hashes_float32(np.ascontiguousarray(values, dtype=np.float32))
    raise TypeError(f"key_type {key_type!r} does not fit an array of {values.dtype}")


def _numpy_hashes(keys: np.ndarray, key_type: KeyType) -> np.ndarray:
    if keys.ndim != 1:
        raise ValueError(f"keys must be a 1-D array, got an array of shape {keys.shape}")
    kind = keys.dtype.kind
    if kind in "biuf":
        return _numeric_hashes(keys, key_type)
    if kind == "U":
        if key_type not in (None, "string"):
            raise TypeError(f"key_type {key_type!r} does not fit an array of strings ({keys.dtype})")
        width = keys.dtype.itemsize // 4
        chars = np.ascontiguousarray(keys).view(np.uint32).reshape(len(keys), width)
        return _h.java_hashes_ucs4(chars)
    if kind == "S":
        if key_type not in (None, "bytes"):
            raise TypeError(f"key_type {key_type!r} does not fit an array of bytes ({keys.dtype})")
        width = keys.dtype.itemsize
        data = np.ascontiguousarray(keys).view(np.uint8).reshape(len(keys), width)
        return _h.java_hashes_fixed_bytes(data)
    if kind == "O":
        return _h.java_hashes_objects(keys, key_type_code(key_type))
    raise TypeError(f"unsupported key array dtype {keys.dtype}; supported: {_SUPPORTED_NUMPY}")


def _arrow_hashes(
    arr: pa.Array, key_type: KeyType, max_parallelism: int = 0, out: np.ndarray | None = None
) -> np.ndarray:
    """Java hashes of an Arrow array; for offset-based string/binary arrays with max_parallelism > 0, their key
    groups instead (one fused pass, into ``out`` when given). Callers check the dtype of what comes back."""
    t = pa.types
    if arr.null_count:
        raise ValueError(f"key at position {_first_null(arr)} is null: Flink refuses null keys")
    typ = arr.type
    if t.is_dictionary(typ):
        return _arrow_hashes(arr.dictionary, key_type)[arr.indices.to_numpy(zero_copy_only=False)]
    natural = key_type_for_arrow(typ)  # raises the TypeError for types with no Java key type
    if t.is_integer(typ) or t.is_floating(typ) or t.is_boolean(typ):
        return _numeric_hashes(arr.to_numpy(zero_copy_only=not t.is_boolean(typ)), key_type)
    # strings and binaries: hashed straight from the Arrow buffers
    if key_type not in (None, natural):
        raise TypeError(f"key_type {key_type!r} does not fit an Arrow {typ} array")
    utf8 = natural == "string"
    buffers = arr.buffers()
    n, off = len(arr), arr.offset
    if t.is_string_view(typ) or t.is_binary_view(typ):
        views = memoryview(buffers[1]).cast("B")[off * 16 : (off + n) * 16]
        return _h.java_hashes_binary_view(views, [b if b is not None else b"" for b in buffers[2:]], utf8)
    width = np.int64 if (t.is_large_string(typ) or t.is_large_binary(typ)) else np.int32
    if buffers[1] is None:
        offsets = np.zeros(n + 1, dtype=width)
    else:
        offsets = np.frombuffer(buffers[1], dtype=width)
        if len(offsets) < off + n + 1:
            raise ValueError(f"Arrow array of {n} values has only {len(offsets)} offsets: the array is corrupt")
        offsets = offsets[off : off + n + 1]
    data = buffers[2] if buffers[2] is not None else b""
    return _h.java_hashes_var_binary(offsets, memoryview(data).cast("B"), utf8, max_parallelism,
                                     out if max_parallelism > 0 else None)


def _int64_keys(keys: Any, key_type: KeyType) -> np.ndarray | None:
    """``keys`` as a contiguous int64 numpy array when they are int64 keys hashed as Long (numpy, or Arrow without
    nulls: zero-copy), for the direct int64 kernel; None otherwise."""
    if key_type not in (None, "long"):
        return None
    if isinstance(keys, np.ndarray) and keys.ndim == 1 and keys.dtype.kind == "i" and keys.dtype.itemsize == 8:
        return np.ascontiguousarray(keys, dtype=np.int64)
    if isinstance(keys, pa.Array) and pa.types.is_int64(keys.type) and not keys.null_count:
        return keys.to_numpy(zero_copy_only=True)
    return None


def java_hashes(keys: Any, key_type: KeyType = None) -> npt.NDArray[np.int32]:
    """Vectorized :func:`java_hash`: an int32 array of the Java hashes of ``keys`` (numpy array, pyarrow Array or
    ChunkedArray, or a sequence of Python keys). Errors name the position of the first bad key."""
    if key_type is not None:
        key_type_code(key_type)  # validates the name
    if isinstance(keys, pa.ChunkedArray):
        if keys.null_count:
            raise ValueError(f"key at position {_first_null(keys)} is null: Flink refuses null keys")
        parts = [_arrow_hashes(chunk, key_type) for chunk in keys.chunks]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
    if isinstance(keys, pa.Array):
        return _arrow_hashes(keys, key_type)
    if isinstance(keys, np.ndarray):
        return _numpy_hashes(keys, key_type)
    if isinstance(keys, (str, bytes, bytearray)):
        raise TypeError(
            f"keys must be an array or a sequence of keys, got a single {type(keys).__name__}; "
            "use assign_to_key_group for one key"
        )
    if not isinstance(keys, Sequence):
        keys = list(keys)
    return _h.java_hashes_objects(keys, key_type_code(key_type))


def assign_key_groups(
    keys: Any, max_parallelism: int, key_type: KeyType = None, *, out: npt.NDArray[np.int16] | None = None
) -> npt.NDArray[np.int16]:
    """Vectorized :func:`assign_to_key_group`: an int16 array with the key group of every key.

    ``keys`` is a numpy array (integers, floats, bools, unicode, bytes or objects), a pyarrow ``Array`` /
    ``ChunkedArray`` (integers, floats, bools, strings, binaries, dictionaries), or a sequence of Python keys.
    Arrow strings are hashed straight from their offset and data buffers.

    ``out``, when given, is an int16 numpy array of ``len(keys)`` elements, writable and C-contiguous: the key groups
    are written into it and it is returned, so that a loop over equally long batches reuses one buffer instead of
    allocating (and page-faulting) a new one per batch. Any other ``out`` raises ``TypeError`` (not an int16 array)
    or ``ValueError`` (wrong length, read-only, not contiguous)."""
    mp = check_max_parallelism(max_parallelism)
    int64_keys = _int64_keys(keys, key_type)
    if int64_keys is not None:
        return _h.groups_from_int64(int64_keys, mp, out)
    if isinstance(keys, pa.Array) and not keys.null_count:
        hashes_or_groups = _arrow_hashes(keys, key_type, mp, out)
        if hashes_or_groups.dtype == np.int16:  # the fused string path wrote the key groups
            return hashes_or_groups
        return _h.groups_from_hashes(hashes_or_groups, mp, out)
    return _h.groups_from_hashes(java_hashes(keys, key_type), mp, out)


def assign_operators(
    keys: Any, max_parallelism: int, parallelism: int, key_type: KeyType = None
) -> npt.NDArray[np.int32]:
    """Vectorized :func:`assign_to_operator`: an int32 array with the owning subtask of every key."""
    p, mp = check_parallelism(parallelism, max_parallelism)
    return _h.operators_from_groups(assign_key_groups(keys, mp, key_type), mp, p)


def tuple_java_hashes(columns: Sequence[Any], key_type: KeyType = None) -> npt.NDArray[np.int32]:
    """Java hashes of the Flink tuples formed row by row from ``columns`` (each an array :func:`java_hashes`
    accepts): ``h = hash(c0); h = 31 * h + hash(ci)``, without building a tuple per row. ``key_type`` is None or a
    tuple with one key type per column."""
    if not columns:
        raise ValueError("a tuple key needs at least one column")
    if key_type is not None and (not isinstance(key_type, tuple) or len(key_type) != len(columns)):
        raise TypeError(f"key_type must be None or a tuple of {len(columns)} key types, got {key_type!r}")
    types = key_type if key_type is not None else (None,) * len(columns)
    acc = np.array(java_hashes(columns[0], types[0]), dtype=np.int32, copy=True)
    for column, field_type in zip(columns[1:], types[1:]):
        field = java_hashes(column, field_type)
        if len(field) != len(acc):
            raise ValueError(f"tuple key columns differ in length: {len(acc)} and {len(field)}")
        _h.combine_tuple_hashes(acc, field)
    return acc


def assign_key_groups_for_tuples(
    columns: Sequence[Any], max_parallelism: int, key_type: KeyType = None
) -> npt.NDArray[np.int16]:
    """Key groups of the Flink tuples formed row by row from ``columns``: the vectorized form of
    ``assign_to_key_group((c0[i], c1[i], ...), max_parallelism, key_type)``."""
    mp = check_max_parallelism(max_parallelism)
    return _h.groups_from_hashes(tuple_java_hashes(columns, key_type), mp)
