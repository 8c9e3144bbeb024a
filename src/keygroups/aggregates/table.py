"""Accumulators kept as columns: the external states (``keygroups.state.external``) of a declarative aggregate.

One :class:`ColumnarStates` holds the aggregate's value states for one backend's key-group range. Every key that has
state has a *row*: its key (an int64 column for long and int keys, found through a compiled hash index; a Python list
and dict for other keys), its key group, and per state a presence flag, the value's fields as numpy columns (a
scalar: one column; ``mean``'s record: sum and count) and, with TTL, the last-access timestamp. A batch reads and
writes the rows of its keys with numpy (:meth:`rows`, :meth:`read`, :meth:`write`); nothing is kept per key as a
Python object.

Snapshots (``capture``): the rows a state changed since the last capture (kept as one array of row numbers per
write, so finding them costs what the batches wrote, not the table's size) become delta sections, and every live row
of the key groups the backend writes full becomes a full section; keys and values are encoded for all of them with
numpy (every value here has a fixed width: the state's framing is ``[i64 timestamp |] fields``, little-endian, as
the state's serializer writes it). Restores and take-overs (``load``) decode sections the same way, refusing any
value of another width. The checkpoint thus holds ordinary value states, which any backend restores.

A row whose states are all gone (TTL expiry, a cleared key) keeps its key until a confirmed snapshot wrote the
deletes; then the key leaves the index and the row is reused.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from keygroups._hashing import assign_key_groups
from keygroups._native.aggregates import Int64Index, group_key_order
from keygroups._native.statecore import MISSING, java_keys
from keygroups.checkpoint.format import Packed
from keygroups.errors import CorruptSnapshotError, no_current_key_error
from keygroups.serializers import Int32Serializer, Int64Serializer
from keygroups.state.descriptors import StateDescriptor
from keygroups.state.external import ExternalDelete, ExternalPut, Items

_I64_MIN, _I64_MAX = -2**63, 2**63 - 1


def _byte_order(keys: np.ndarray, key_mode: str) -> np.ndarray:
    """int64 values that order ``keys`` (int64) as their little-endian bytes (8 for long keys, 4 for int keys) compare
    byte by byte: the bytes read as one big-endian unsigned number, shifted into the signed range."""
    if key_mode == "i8":
        return (keys.byteswap().view(np.uint64) ^ np.uint64(1 << 63)).view(np.int64)  # type: ignore[no-any-return]
    return keys.astype(np.uint32).byteswap().astype(np.int64)  # type: ignore[no-any-return]


class ValueLayout:
    """The fixed-width value of one state: its fields' numpy dtypes (a scalar has one, ``mean`` two), how a Python
    value maps to them, and the little-endian bytes its serializer writes (``[i64 timestamp |] fields``)."""

    def __init__(self, fields: Sequence[np.dtype[Any]], *, record: tuple[str, ...] | None = None) -> None:
        self.fields = tuple(np.dtype(f) for f in fields)
        self.record = record   # field names of a record value (tuples), None for a scalar
        self.wire = [np.dtype("<u1") if f == np.bool_ else f.newbyteorder("<") for f in self.fields]

    def wire_dtype(self, ttl: bool) -> np.dtype[Any]:
        parts: list[tuple[str, Any]] = [("ts", "<i8")] if ttl else []
        parts += [(f"f{i}", w) for i, w in enumerate(self.wire)]
        return np.dtype(parts)

    def width(self, ttl: bool) -> int:
        return self.wire_dtype(ttl).itemsize

    def to_python(self, values: Sequence[Any]) -> Any:
        """The Python value of one row's fields (as a restore would decode its bytes)."""
        items = [v.item() if hasattr(v, "item") else v for v in values]
        return tuple(items) if self.record is not None else items[0]

    def from_python(self, value: Any, state: str) -> list[Any]:
        """The fields of a Python value, checked as the state's serializer would check it on write."""
        parts: Sequence[Any]
        if self.record is not None:
            if isinstance(value, dict):
                missing = [n for n in self.record if n not in value]
                if missing:
                    raise TypeError(f"state {state!r}: a record value needs the fields {list(self.record)}, missing "
                                    f"{missing}")
                parts = [value[n] for n in self.record]
            elif isinstance(value, (tuple, list)) and len(value) == len(self.record):
                parts = value
            else:
                raise TypeError(f"state {state!r} keeps records ({', '.join(self.record)}): give a tuple or dict, got "
                                f"{value!r}")
        else:
            parts = (value,)
        out: list[Any] = []
        for v, dtype in zip(parts, self.fields):
            if dtype == np.bool_:
                if not isinstance(v, (bool, np.bool_)):
                    raise TypeError(f"state {state!r} keeps booleans, got {v!r}")
                out.append(bool(v))
            elif dtype == np.int64:
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                    raise TypeError(f"state {state!r} keeps longs (int), got {v!r}")
                if not _I64_MIN <= int(v) <= _I64_MAX:
                    raise OverflowError(f"state {state!r}: {v} does not fit a long (int64)")
                out.append(int(v))
            else:
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
                    raise TypeError(f"state {state!r} keeps doubles (float), got {v!r}")
                out.append(float(v))
        return out


class _Store:
    """One state's store for the per-key state objects: the backend's current key's row."""

    __slots__ = ("_table", "_position")

    def __init__(self, table: ColumnarStates, position: int) -> None:
        self._table = table
        self._position = position

    def get(self) -> Any:
        t = self._table
        row = t.current_row(insert=False)
        j = self._position
        if row < 0 or not t.present[j][row]:
            return MISSING
        value = t.layouts[j].to_python([f[row] for f in t.fields[j]])
        return (value, int(t.stamps[j][row])) if t.ttl else value

    def put(self, obj: Any) -> None:
        t = self._table
        j = self._position
        if t.ttl:
            if not (isinstance(obj, tuple) and len(obj) == 2):
                raise TypeError(f"state {t.names[j]!r} has TTL: its stored values are (value, timestamp) tuples")
            value, stamp = obj
        else:
            value, stamp = obj, 0
        parts = t.layouts[j].from_python(value, t.names[j])
        row = t.current_row(insert=True)
        for column, v in zip(t.fields[j], parts):
            column[row] = v
        t.present[j][row] = True
        if t.ttl:
            t.stamps[j][row] = stamp
        t.mark(j, np.array([row], dtype=np.int64))

    def delete(self) -> None:
        t = self._table
        row = t.current_row(insert=False)
        j = self._position
        if row >= 0 and t.present[j][row]:
            t.present[j][row] = False
            t.mark(j, np.array([row], dtype=np.int64))

    def append(self, items: list[Any]) -> None:
        raise TypeError(f"state {self._table.names[self._position]!r} is a value state: it has no list to append to")


class ColumnarStates:
    """The value states of one declarative aggregate as columns, for one backend (see the module docstring); made
    by ``backend.bind_external_states`` with the backend, the states' descriptors and their value layouts."""

    def __init__(self, backend: Any, descriptors: Sequence[StateDescriptor], layouts: Sequence[ValueLayout]) -> None:
        self.backend = backend
        self.descriptors = list(descriptors)
        self.names = tuple(d.name for d in descriptors)
        self.layouts = list(layouts)
        self._metas = [backend._state_meta(d) for d in descriptors]
        ttls = {d.ttl_config is not None for d in descriptors}
        if len(ttls) != 1:
            raise ValueError("the states of one aggregate either all have TTL or none has")
        self.ttl = ttls.pop()
        self._wire = [layout.wire_dtype(self.ttl) for layout in self.layouts]
        ser = backend.key_serializer
        self.key_mode = ("i8" if type(ser) is Int64Serializer else "i4" if type(ser) is Int32Serializer else "object")
        self._index: Int64Index | dict[Any, int] = Int64Index() if self.key_mode != "object" else {}
        self._keys_obj: list[Any] = []
        k = len(self.names)
        self.cap = 0
        self.size = 0   # rows used so far (a high-water mark; freed rows are reused first)
        self.key_values = np.zeros(0, dtype=np.int64)
        self.group = np.zeros(0, dtype=np.int32)   # absolute key group
        self.present: list[np.ndarray] = [np.zeros(0, dtype=bool) for _ in range(k)]
        self.fields: list[list[np.ndarray]] = [[np.zeros(0, dtype=f) for f in lay.fields] for lay in self.layouts]
        self.stamps: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in range(k)]
        self._dirty_flag: list[np.ndarray] = [np.zeros(0, dtype=bool) for _ in range(k)]
        self._dirty: list[list[np.ndarray]] = [[] for _ in range(k)]
        self._inflight: list[tuple[int, list[np.ndarray]]] = []   # (checkpoint id, per state rows) not confirmed
        self._confirmed = -1
        self._free: list[np.ndarray] = []
        self._to_free: list[tuple[int, np.ndarray]] = []   # rows whose deletes a snapshot writes: freed once confirmed
        self._lock = threading.Lock()

    # ---- ExternalStates: identity -------------------------------------------------------------------------------
    def metas(self) -> list[dict[str, Any]]:
        return self._metas

    def store(self, name: str) -> _Store:
        return _Store(self, self.names.index(name))

    # ---- rows -----------------------------------------------------------------------------------------------------
    def _grow(self, wanted: int) -> None:
        if wanted <= self.cap:
            return
        cap = max(1024, self.cap)
        while cap < wanted:
            cap *= 2

        def grown(a: np.ndarray) -> np.ndarray:
            out = np.zeros(cap, dtype=a.dtype)
            out[:len(a)] = a
            return out

        self.key_values = grown(self.key_values)
        self.group = grown(self.group)
        for j in range(len(self.names)):
            self.present[j] = grown(self.present[j])
            self.fields[j] = [grown(f) for f in self.fields[j]]
            self.stamps[j] = grown(self.stamps[j])
            self._dirty_flag[j] = grown(self._dirty_flag[j])
        self.cap = cap

    def _allocate(self, n: int) -> np.ndarray:
        """``n`` free rows (reused ones first), cleared."""
        taken: list[np.ndarray] = []
        need = n
        while need and self._free:
            block = self._free.pop()
            if len(block) > need:
                self._free.append(block[need:])
                block = block[:need]
            taken.append(block)
            need -= len(block)
        if need:
            self._grow(self.size + need)
            taken.append(np.arange(self.size, self.size + need, dtype=np.int64))
            self.size += need
        rows = np.concatenate(taken) if len(taken) != 1 else taken[0]
        for j in range(len(self.names)):
            self.present[j][rows] = False
            self.stamps[j][rows] = 0
            for f in self.fields[j]:
                f[rows] = 0
        return rows

    def _lookup(self, keys: Any) -> np.ndarray:
        if self.key_mode != "object":
            return self._index.lookup(keys)  # type: ignore[union-attr]
        index = self._index
        assert isinstance(index, dict)
        return np.fromiter((index.get(k, -1) for k in keys), np.int64, len(keys))

    def _insert(self, keys: Any, rows: np.ndarray, groups: np.ndarray) -> None:
        if self.key_mode != "object":
            self._index.insert(keys, rows)  # type: ignore[union-attr]
            self.key_values[rows] = keys
        else:
            index = self._index
            assert isinstance(index, dict)
            objs = self._keys_obj
            if len(objs) < self.size:
                objs.extend([None] * (self.size - len(objs)))
            for k, r in zip(keys, rows.tolist()):
                index[k] = r
                objs[r] = k
        self.group[rows] = groups

    def rows(self, keys: Any, key_groups: np.ndarray | None = None) -> np.ndarray:
        """The rows of ``keys`` (distinct: an int64 array for long and int keys, else a list of keys), new rows for
        those without one; ``key_groups`` (absolute) if known, else computed for the new keys."""
        if self.key_mode == "object":
            keys = java_keys(list(keys))
        else:
            keys = np.ascontiguousarray(keys, dtype=np.int64)
        rows = self._lookup(keys)
        new = np.flatnonzero(rows < 0)
        if len(new):
            if self.key_mode == "object":
                new_keys: Any = [keys[i] for i in new.tolist()]
            else:
                new_keys = np.ascontiguousarray(keys[new])
            if key_groups is not None:
                groups = np.asarray(key_groups)[new]
            else:
                b = self.backend
                groups = assign_key_groups(new_keys, b.max_parallelism, b.key_type)
            fresh = self._allocate(len(new))
            self._insert(new_keys, fresh, groups)
            rows[new] = fresh
        return rows

    def current_row(self, *, insert: bool) -> int:
        """The row of the backend's current key (-1 if it has none and ``insert`` is False)."""
        ctx = self.backend._ctx
        if ctx.kgi >= ctx.n:
            raise no_current_key_error()
        key = ctx.key
        index = self._index
        row = index.get(key, -1) if isinstance(index, dict) else index.get(int(key))
        if row < 0 and insert:
            keys: Any = [key] if self.key_mode == "object" else np.array([key], dtype=np.int64)
            return int(self.rows(keys, np.array([ctx.start + ctx.kgi], dtype=np.int32))[0])
        return int(row)

    def mark(self, j: int, rows: np.ndarray) -> None:
        """State ``j`` of ``rows`` changed: the next capture writes it."""
        flag = self._dirty_flag[j]
        new = rows[~flag[rows]]
        if len(new):
            flag[new] = True
            self._dirty[j].append(new)

    def python_keys(self, rows: np.ndarray) -> list[Any]:
        if self.key_mode == "object":
            objs = self._keys_obj
            return [objs[r] for r in rows.tolist()]
        return self.key_values[rows].tolist()  # type: ignore[no-any-return]

    # ---- snapshots ------------------------------------------------------------------------------------------------
    def _maintain(self) -> None:
        """Apply confirmations (noted by the snapshot thread): forget confirmed captures, free rows whose deletes a
        confirmed snapshot wrote and that nothing brought back since."""
        with self._lock:
            confirmed = self._confirmed
        self._inflight = [c for c in self._inflight if c[0] > confirmed]
        keep: list[tuple[int, np.ndarray]] = []
        free: list[np.ndarray] = []
        for checkpoint_id, rows in self._to_free:
            if checkpoint_id <= confirmed:
                free.append(rows)
            else:
                keep.append((checkpoint_id, rows))
        self._to_free = keep
        if free:
            rows = np.unique(np.concatenate(free))
            gone = np.ones(len(rows), dtype=bool)
            for j in range(len(self.names)):
                gone &= ~self.present[j][rows] & ~self._dirty_flag[j][rows]
            for _, pending in self._inflight:   # a later capture still writes them
                for p in pending:
                    gone &= ~np.isin(rows, p)
            self._forget(rows[gone])

    def _forget(self, rows: np.ndarray) -> None:
        if not len(rows):
            return
        if self.key_mode != "object":
            self._index.remove(np.ascontiguousarray(self.key_values[rows]))  # type: ignore[union-attr]
        else:
            index = self._index
            assert isinstance(index, dict)
            for r in rows.tolist():
                index.pop(self._keys_obj[r], None)
                self._keys_obj[r] = None
        for j in range(len(self.names)):
            self.present[j][rows] = False
        self._free.append(rows)

    def _snapshot_deadline(self, j: int) -> int | None:
        return self.backend._snapshot_ttl_deadline(self.descriptors[j])  # type: ignore[no-any-return]

    def _encode_keys(self, rows: np.ndarray) -> tuple[Any, np.ndarray]:
        if self.key_mode == "i8":
            return self.key_values[rows].astype("<i8").tobytes(), np.arange(len(rows) + 1, dtype=np.int64) * 8
        if self.key_mode == "i4":
            return self.key_values[rows].astype("<i4").tobytes(), np.arange(len(rows) + 1, dtype=np.int64) * 4
        data, offsets = self.backend.key_serializer.serialize_many(self.python_keys(rows))
        return data, np.asarray(offsets, dtype=np.int64)

    def _encode_values(self, j: int, rows: np.ndarray) -> tuple[bytes, np.ndarray]:
        wire = self._wire[j]
        width = wire.itemsize
        fields = self.fields[j]
        if not self.ttl and len(fields) == 1:   # one scalar: its column's values are the bytes
            values = fields[0][rows]
            if values.dtype == np.float64:
                values[np.isnan(values)] = np.nan   # the one canonical NaN Float64Serializer writes
            return (values.astype(wire["f0"], copy=False).tobytes(),
                    np.arange(len(rows) + 1, dtype=np.int64) * width)
        out = np.empty(len(rows), dtype=wire)
        if self.ttl:
            out["ts"] = self.stamps[j][rows]
        for i, column in enumerate(self.fields[j]):
            values = column[rows]
            if values.dtype == np.float64:
                values = np.where(np.isnan(values), np.nan, values)   # the one canonical NaN Float64Serializer writes
            out[f"f{i}"] = values
        return out.tobytes(), np.arange(len(rows) + 1, dtype=np.int64) * width

    def _by_group(self, rows: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """``rows`` in key-group order (long and int keys: then in the order of their bytes, as the snapshot's blocks
        keep them, which spares the block encoder its sort), and each key group's ``(key group, first, end)`` among
        them."""
        groups = self.group[rows]
        if self.key_mode != "object" and len(rows) > 1:
            order = group_key_order(groups, _byte_order(self.key_values[rows], self.key_mode))
            rows, groups = rows[order], groups[order]
        elif len(rows) and (np.diff(groups) < 0).any():
            order = np.argsort(groups, kind="stable")
            rows, groups = rows[order], groups[order]
        cuts = np.flatnonzero(np.diff(groups)) + 1
        starts = [0, *cuts.tolist()]
        ends = [*cuts.tolist(), len(rows)]
        return rows, [(int(groups[a]), a, b) for a, b in zip(starts, ends) if b > a]

    def _sections(self, j: int, rows: np.ndarray, values: bool, last: list[Any]
                  ) -> list[tuple[int, Packed, Packed | None]]:
        """State ``j``'s ``rows`` encoded (keys, and values when ``values``) and cut per key group. ``last`` holds
        the previous call's rows, ordered rows and key sections: states that changed for the same keys (all of an
        aggregate's, as a rule) share them, ordered and encoded once."""
        if not len(rows):
            return []
        if last and len(last[0]) == len(rows) and np.array_equal(last[0], rows):
            _, rows, keyed = last
        else:
            given = rows
            rows, groups = self._by_group(rows)
            key_data, key_offsets = self._encode_keys(rows)
            keyed = [(kg, a, b, Packed(key_data, key_offsets[a:b + 1])) for kg, a, b in groups]
            last[:] = [given, rows, keyed]
        if values:
            value_data, value_offsets = self._encode_values(j, rows)
            return [(kg, keys, Packed(value_data, value_offsets[a:b + 1])) for kg, a, b, keys in keyed]
        return [(kg, keys, None) for kg, _, _, keys in keyed]

    def capture(self, checkpoint_id: int, full: Collection[int]
                ) -> dict[int, tuple[list[ExternalPut], list[ExternalDelete]]]:
        self._maintain()
        full_groups = np.zeros(self.backend.max_parallelism, dtype=bool)
        full_list = [g for g in full]
        if full_list:
            full_groups[full_list] = True
        out: dict[int, tuple[list[ExternalPut], list[ExternalDelete]]] = {}
        taken: list[np.ndarray] = []
        freed: list[np.ndarray] = []
        last: list[Any] = []
        for j in range(len(self.names)):
            # each write's rows are new to the dirty flag, so only an unconfirmed capture can repeat a row
            inflight = [p[j] for _, p in self._inflight]
            parts = self._dirty[j] + inflight
            if not parts:
                dirty = np.zeros(0, dtype=np.int64)
            elif inflight:
                dirty = np.unique(np.concatenate(parts))
            else:
                dirty = np.concatenate(parts) if len(parts) > 1 else parts[0]
            self._dirty_flag[j][dirty] = False
            self._dirty[j] = []
            taken.append(dirty)
            present = self.present[j]
            deadline = self._snapshot_deadline(j)
            delta = dirty[~full_groups[self.group[dirty]]]
            live = present[delta]
            if deadline is not None:
                live &= self.stamps[j][delta] > deadline
            puts = delta[live]
            deletes = delta[~live]
            if full_list:
                used = np.arange(self.size, dtype=np.int64)
                whole = used[present[:self.size] & full_groups[self.group[:self.size]]]
                if deadline is not None:
                    whole = whole[self.stamps[j][whole] > deadline]
                puts = np.concatenate([puts, whole])
            freed.append(deletes[~present[deletes]])
            for kg, keys, values in self._sections(j, puts, True, last):
                out.setdefault(kg, ([], []))[0].append((j, keys, values))
            for kg, keys, _ in self._sections(j, deletes, False, last):
                out.setdefault(kg, ([], []))[1].append((j, keys))
        self._inflight.append((checkpoint_id, taken))
        rows = np.concatenate(freed) if freed else np.zeros(0, dtype=np.int64)
        if len(rows):
            self._to_free.append((checkpoint_id, rows))
        return out

    def confirm(self, checkpoint_id: int) -> None:
        with self._lock:
            self._confirmed = max(self._confirmed, checkpoint_id)

    def changed(self) -> bool:
        self._maintain()
        return bool(self._inflight) or any(self._dirty)

    # ---- restore --------------------------------------------------------------------------------------------------
    def _decode_keys(self, part: Items, what: str) -> Any:
        buffer, offsets = part
        offsets = np.asarray(offsets, dtype=np.int64)
        n = len(offsets) - 1
        if self.key_mode == "object":
            return java_keys(self.backend.key_serializer.deserialize_many(buffer, offsets))
        width = 8 if self.key_mode == "i8" else 4
        if n and not (np.all(np.diff(offsets) == width)):
            raise CorruptSnapshotError(f"{what}: a key of {self.key_mode} keys is not {width} bytes long")
        start = int(offsets[0]) if n else 0
        raw = np.frombuffer(memoryview(buffer)[start:start + n * width], dtype=f"<i{width}")
        return np.ascontiguousarray(raw, dtype=np.int64)

    def _decode_values(self, j: int, part: Items, what: str) -> np.ndarray:
        buffer, offsets = part
        offsets = np.asarray(offsets, dtype=np.int64)
        n = len(offsets) - 1
        wire = self._wire[j]
        if n and not np.all(np.diff(offsets) == wire.itemsize):
            raise CorruptSnapshotError(f"{what}: a value of state {self.names[j]!r} is not {wire.itemsize} bytes "
                                       f"long ({[str(f) for f in self.layouts[j].fields]}"
                                       f"{' with a TTL timestamp' if self.ttl else ''})")
        start = int(offsets[0]) if n else 0
        values = np.frombuffer(memoryview(buffer)[start:start + n * wire.itemsize], dtype=wire)
        for i, f in enumerate(self.layouts[j].fields):
            if f == np.bool_ and n and (values[f"f{i}"] > 1).any():
                raise CorruptSnapshotError(f"{what}: a bool value of state {self.names[j]!r} is neither 0 nor 1")
        return values

    def load(self, key_group: int, full: bool, puts: list[tuple[int, Items, Items]],
             deletes: list[tuple[int, Items]]) -> None:
        what = f"key group {key_group}"
        if full:
            self.clear([key_group])
        groups = None
        for j, keys_part, values_part in puts:
            keys = self._decode_keys(keys_part, what)
            values = self._decode_values(j, values_part, what)
            if len(values) != len(keys):
                raise CorruptSnapshotError(f"{what}: state {self.names[j]!r} has {len(keys)} keys but "
                                           f"{len(values)} values")
            if not len(keys):
                continue
            deadline = self._snapshot_deadline(j)
            if deadline is not None:   # expired entries are dropped on restore, as every backend drops them
                keep = values["ts"] > deadline
                if not keep.all():   # an expired put still replaces the key's older value (it may outlive it)
                    gone = self._lookup(keys[~keep] if self.key_mode != "object"
                                        else [k for k, x in zip(keys, keep) if not x])
                    self.present[j][gone[gone >= 0]] = False
                keys = keys[keep] if self.key_mode != "object" else [k for k, x in zip(keys, keep) if x]
                values = values[keep]
            groups = np.full(len(keys), key_group, dtype=np.int32)
            rows = self.rows(keys, groups)
            self.present[j][rows] = True
            if self.ttl:
                self.stamps[j][rows] = values["ts"]
            for i, column in enumerate(self.fields[j]):
                column[rows] = values[f"f{i}"]
        for j, keys_part in deletes:
            keys = self._decode_keys(keys_part, what)
            if self.key_mode == "object":
                keys = list(keys)
            rows = self._lookup(keys)
            self.present[j][rows[rows >= 0]] = False

    def _rows_of_groups(self, key_groups: Iterable[int]) -> np.ndarray:
        wanted = np.zeros(self.backend.max_parallelism, dtype=bool)
        wanted[list(key_groups)] = True
        used = self._used_rows()
        rows: np.ndarray = used[wanted[self.group[used]]]
        return rows

    def _used_rows(self) -> np.ndarray:
        used = np.zeros(self.size, dtype=bool)
        for j in range(len(self.names)):
            used |= self.present[j][:self.size] | self._dirty_flag[j][:self.size]
        return np.flatnonzero(used).astype(np.int64)

    def clear(self, key_groups: Iterable[int]) -> None:
        groups = list(key_groups)
        if not groups:
            return
        rows = self._rows_of_groups(groups)
        for j in range(len(self.names)):
            self._dirty_flag[j][rows] = False
            self._dirty[j] = [d[~np.isin(d, rows)] for d in self._dirty[j]]
        self._forget(rows)

    def move(self, key_group_range: Any) -> None:
        inside = np.zeros(self.backend.max_parallelism, dtype=bool)
        inside[key_group_range.start:key_group_range.end + 1] = True
        used = self._used_rows()
        self.clear(np.unique(self.group[used[~inside[self.group[used]]]]).tolist())

    # ---- reading the whole table ------------------------------------------------------------------------------------
    def keys_of(self, j: int) -> np.ndarray:
        rows = np.flatnonzero(self.present[j][:self.size])
        return rows[np.argsort(self.group[rows], kind="stable")]

    def keys(self, name: str) -> Iterator[Any]:
        yield from self.python_keys(self.keys_of(self.names.index(name)))

    def entries(self) -> int:
        return int(sum(int(p[:self.size].sum()) for p in self.present))

    def has_data(self) -> bool:
        return any(bool(p[:self.size].any()) for p in self.present)

    def release(self) -> Iterator[tuple[int, list[ExternalPut]]]:
        out: dict[int, list[ExternalPut]] = {}
        last: list[Any] = []
        for j in range(len(self.names)):
            for kg, keys, values in self._sections(j, self.keys_of(j), True, last):
                out.setdefault(kg, []).append((j, keys, values))
        yield from sorted(out.items())


__all__ = ["ColumnarStates", "ValueLayout"]
