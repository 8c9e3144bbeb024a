# Kernels of the declarative keyed aggregates (keygroups.aggregates): a hash index from int64 keys to the rows of a
# columnar table, and the running folds of one batch's values, key by key.
#
# A batch arrives sorted by key: ``runs`` (n + 1 int64 offsets) cut its rows into the n keys' runs. ``fold_runs``
# folds each run's values into that key's accumulator, strictly in row order (the order a per-record function would
# see them: a float sum is the same left fold as ``acc + v`` record by record, never a pairwise sum), starting from
# the accumulator the key carried in; it can also write the accumulator after every row (per-record results). Every
# array length is checked against the others at the def boundary; the loops run without the GIL over pointers.
#
# group_key_order: the stable order of a subtask's records by (key group, integer key), by LSD radix sort (11-bit
# digits of the key, digits every key shares skipped, then one counting pass over the key groups): what Arrow's
# two-column sort_indices gives, in a few linear passes.
#
# Int64Index: open addressing with linear probing over a power-of-two table (at most 3/4 full), each bucket a key and
# its row (-1: empty); a removal shifts the following buckets of its cluster back (no tombstones), so lookups stay
# short however many keys come and go.
from libc.math cimport signbit
from libc.stdint cimport INT64_MAX, INT64_MIN, int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

cimport cython

import numpy as np

cdef enum:
    OP_SUM = 0
    OP_MIN = 1
    OP_MAX = 2
    OP_FIRST = 3
    OP_LAST = 4

#: Fold operations (``fold_runs``'s ``op``).
SUM = OP_SUM
MIN = OP_MIN
MAX = OP_MAX
FIRST = OP_FIRST
LAST = OP_LAST

ctypedef fused num_t:
    int64_t
    double
    uint8_t


cdef inline bint _less(num_t a, num_t b) noexcept nogil:
    """a < b in the order Java's compare gives (Spark's and Flink's MIN/MAX): for doubles, -0.0 < 0.0 and NaN is
    above every other value and equal to itself."""
    if num_t is double:
        if a < b:
            return True
        if a > b:
            return False
        if a != a:
            return False
        if b != b:
            return True
        return signbit(a) and not signbit(b)
    else:
        return a < b


cdef inline int _add_i64(int64_t a, int64_t b, int64_t *out) noexcept nogil:
    """out = a + b; 1 when the sum does not fit an int64 (out is then unchanged)."""
    if (b > 0 and a > INT64_MAX - b) or (b < 0 and a < INT64_MIN - b):
        return 1
    out[0] = a + b
    return 0


cdef Py_ssize_t _fold(int op, const num_t *values, const uint8_t *valid, const int64_t *runs, Py_ssize_t n_runs,
                      num_t *acc, uint8_t *has, num_t *row_acc, uint8_t *row_has) noexcept nogil:
    """The fold loop; returns the row whose int64 sum overflowed, or -1."""
    cdef Py_ssize_t r, i
    cdef num_t a, v
    cdef int64_t s
    cdef bint h
    for r in range(n_runs):
        a = acc[r]
        h = has[r] != 0
        for i in range(runs[r], runs[r + 1]):
            if valid == NULL or valid[i]:
                v = values[i]
                if not h:
                    a = v
                    h = True
                elif op == OP_SUM:
                    if num_t is int64_t:
                        if _add_i64(a, v, &s):
                            return i
                        a = s
                    else:
                        a = a + v
                elif op == OP_MIN:
                    if _less(v, a):
                        a = v
                elif op == OP_MAX:
                    if _less(a, v):
                        a = v
                elif op == OP_LAST:
                    a = v
                # FIRST keeps what it has
            if row_acc != NULL:
                row_acc[i] = a
                row_has[i] = h
        acc[r] = a
        has[r] = h
    return -1


cdef Py_ssize_t _count(const uint8_t *valid, const int64_t *runs, Py_ssize_t n_runs, int64_t *acc, uint8_t *has,
                       int64_t *row_acc, uint8_t *row_has) noexcept nogil:
    cdef Py_ssize_t r, i
    cdef int64_t a
    cdef bint h
    for r in range(n_runs):
        a = acc[r] if has[r] else 0
        h = has[r] != 0
        for i in range(runs[r], runs[r + 1]):
            if valid == NULL or valid[i]:
                if a == INT64_MAX:
                    return i
                a += 1
                h = True
            if row_acc != NULL:
                row_acc[i] = a
                row_has[i] = h
        acc[r] = a
        has[r] = h
    return -1


cdef int _check_runs(const int64_t[::1] runs, Py_ssize_t n_rows) except -1:
    cdef Py_ssize_t r, n = runs.shape[0]
    if n < 1 or runs[0] != 0 or runs[n - 1] != n_rows:
        raise ValueError(f"runs must start at 0 and end at the row count {n_rows}")
    for r in range(n - 1):
        if runs[r + 1] < runs[r]:
            raise ValueError(f"runs must not descend; run {r} goes from {runs[r]} to {runs[r + 1]}")
    return 0


def fold_runs(int op, const num_t[::1] values, const uint8_t[::1] valid, const int64_t[::1] runs,
              num_t[::1] acc, uint8_t[::1] has, num_t[::1] row_acc, uint8_t[::1] row_has) -> int:
    """Fold each run of ``values`` (rows ``runs[r]:runs[r + 1]``) into ``acc[r]`` in row order, with ``op`` (SUM,
    MIN, MAX, FIRST, LAST); ``has[r]`` says whether ``acc[r]`` holds a value (one that has none takes the first
    value). Rows whose ``valid`` byte is 0 (nulls) are skipped; an empty ``valid`` means every row is valid. With
    a non-empty ``row_acc`` (one per row), the accumulator after each row goes there and whether it has a value into
    ``row_has``. MIN and MAX order doubles as Java's compare does (NaN greatest, -0.0 below 0.0).

    Returns -1, or the first row at which an int64 SUM overflowed (the run's accumulator is then left as it was
    before the batch): the caller raises, naming the key."""
    cdef Py_ssize_t n = values.shape[0], k = runs.shape[0] - 1
    if op < OP_SUM or op > OP_LAST:
        raise ValueError(f"op must be SUM, MIN, MAX, FIRST or LAST, got {op}")
    if num_t is uint8_t:
        if op == OP_SUM:
            raise ValueError("SUM does not fold booleans")
    _check_runs(runs, n)
    if valid.shape[0] not in (0, n):
        raise ValueError(f"valid must be empty or hold one byte per row ({n}), got {valid.shape[0]}")
    if acc.shape[0] != k or has.shape[0] != k:
        raise ValueError(f"acc and has must hold one entry per run ({k}), got {acc.shape[0]} and {has.shape[0]}")
    if row_acc.shape[0] not in (0, n) or row_has.shape[0] != row_acc.shape[0]:
        raise ValueError(f"row_acc and row_has must both be empty or hold one entry per row ({n})")
    if k == 0:
        return -1
    cdef const uint8_t *pv = &valid[0] if valid.shape[0] else NULL
    cdef num_t *pr = &row_acc[0] if row_acc.shape[0] else NULL
    cdef uint8_t *ph = &row_has[0] if row_acc.shape[0] else NULL
    cdef const num_t *px = &values[0] if n else NULL
    cdef Py_ssize_t bad
    with nogil:
        bad = _fold(op, px, pv, &runs[0], k, &acc[0], &has[0], pr, ph)
    return bad


def count_runs(const uint8_t[::1] valid, const int64_t[::1] runs, int64_t[::1] acc, uint8_t[::1] has,
               int64_t[::1] row_acc, uint8_t[::1] row_has, Py_ssize_t n_rows) -> int:
    """Count each run's rows (those whose ``valid`` byte is 1; every row when ``valid`` is empty) onto ``acc[r]``
    (0 when ``has[r]`` is 0); ``has[r]`` becomes 1 once a row was counted. ``row_acc``/``row_has`` as in
    :func:`fold_runs`. Returns -1, or the row at which a count would pass the int64 range."""
    cdef Py_ssize_t k = runs.shape[0] - 1
    _check_runs(runs, n_rows)
    if valid.shape[0] not in (0, n_rows):
        raise ValueError(f"valid must be empty or hold one byte per row ({n_rows}), got {valid.shape[0]}")
    if acc.shape[0] != k or has.shape[0] != k:
        raise ValueError(f"acc and has must hold one entry per run ({k}), got {acc.shape[0]} and {has.shape[0]}")
    if row_acc.shape[0] not in (0, n_rows) or row_has.shape[0] != row_acc.shape[0]:
        raise ValueError(f"row_acc and row_has must both be empty or hold one entry per row ({n_rows})")
    if k == 0:
        return -1
    cdef const uint8_t *pv = &valid[0] if valid.shape[0] else NULL
    cdef int64_t *pr = &row_acc[0] if row_acc.shape[0] else NULL
    cdef uint8_t *ph = &row_has[0] if row_acc.shape[0] else NULL
    cdef Py_ssize_t bad
    with nogil:
        bad = _count(pv, &runs[0], k, &acc[0], &has[0], pr, ph)
    return bad


# ---- the order of a subtask's records ------------------------------------------------------------------------------
cdef enum:
    _DIGIT_BITS = 11
    _DIGITS = 6                  # 6 * 11 >= 64
    _BUCKETS = 1 << _DIGIT_BITS
    _MAX_GROUP = 32768           # key groups are below Flink's largest max parallelism


def group_key_order(const int32_t[::1] groups, const int64_t[::1] keys) -> np.ndarray:
    """The stable order (int64 indices) that sorts rows by ``groups`` (key groups, 0 <= g < 32768), then by
    ``keys`` (signed int64), equal pairs keeping their order: what a stable sort on the two columns gives."""
    cdef Py_ssize_t n = keys.shape[0], i, d, b, p
    if groups.shape[0] != n:
        raise ValueError(f"group_key_order: {groups.shape[0]} key groups but {n} keys")
    out = np.empty(n, dtype=np.int64)
    if n == 0:
        return out
    cdef int64_t[::1] o = out
    cdef int32_t gmin = groups[0], gmax = groups[0], g
    for i in range(n):
        g = groups[i]
        if g < 0 or g >= _MAX_GROUP:
            raise ValueError(f"group_key_order: key group {g} at row {i} is outside [0, {_MAX_GROUP})")
        if g < gmin:
            gmin = g
        elif g > gmax:
            gmax = g
    cdef uint64_t *k0 = <uint64_t *>malloc(n * sizeof(uint64_t))
    cdef uint64_t *k1 = <uint64_t *>malloc(n * sizeof(uint64_t))
    cdef int64_t *spare = <int64_t *>malloc(n * sizeof(int64_t))
    cdef int64_t *i0 = &o[0]   # the indices move between the output and one spare buffer
    cdef int64_t *i1 = spare
    cdef Py_ssize_t *hist = <Py_ssize_t *>malloc((_DIGITS * _BUCKETS + (gmax - gmin + 1)) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *h
    cdef Py_ssize_t *gh
    cdef int shift
    if k0 == NULL or k1 == NULL or spare == NULL or hist == NULL:
        free(k0); free(k1); free(spare); free(hist)
        raise MemoryError(f"group_key_order: cannot allocate the buffers of {n} rows")
    cdef uint64_t any_bits = 0, all_bits = ~(<uint64_t>0), varying, mask
    cdef int lo = 0, span = 0, group_bits = 0
    cdef bint merged
    cdef bint moves[_DIGITS]
    with nogil:
        for i in range(_DIGITS * _BUCKETS + (gmax - gmin + 1)):
            hist[i] = 0
        for i in range(n):
            k0[i] = <uint64_t>keys[i] ^ (<uint64_t>1 << 63)   # signed order as unsigned
            i0[i] = i
            any_bits |= k0[i]
            all_bits &= k0[i]
        varying = any_bits ^ all_bits   # the bits some keys differ in: only they order the keys
        if varying:
            while not (varying >> lo) & 1:
                lo += 1
            span = 64 - lo
            while not (varying >> (lo + span - 1)) & 1:
                span -= 1
        while (gmax - gmin) >> group_bits:
            group_bits += 1
        # when the key group and the key's varying bits fit one word, sort that word: no pass of its own for the
        # key group
        merged = span + group_bits <= 64
        if merged:
            mask = (<uint64_t>1 << span) - 1 if span < 64 else ~(<uint64_t>0)
            for i in range(n):
                k0[i] = (k0[i] >> lo) & mask
                if group_bits:
                    k0[i] |= (<uint64_t>(groups[i] - gmin)) << span
            varying = (<uint64_t>1 << (span + group_bits)) - 1 if span + group_bits < 64 else ~(<uint64_t>0)
        for d in range(_DIGITS):
            moves[d] = ((varying >> (d * _DIGIT_BITS)) & (_BUCKETS - 1)) != 0
        for i in range(n):
            for d in range(_DIGITS):
                if moves[d]:
                    hist[d * _BUCKETS + <Py_ssize_t>((k0[i] >> (d * _DIGIT_BITS)) & (_BUCKETS - 1))] += 1
        for d in range(_DIGITS):
            if not moves[d]:
                continue
            h = hist + d * _BUCKETS
            shift = d * _DIGIT_BITS
            p = 0
            for b in range(_BUCKETS):
                p, h[b] = p + h[b], p
            for i in range(n):
                b = <Py_ssize_t>((k0[i] >> shift) & (_BUCKETS - 1))
                k1[h[b]] = k0[i]
                i1[h[b]] = i0[i]
                h[b] += 1
            k0, k1 = k1, k0
            i0, i1 = i1, i0
        if merged or gmin == gmax:
            if i0 != &o[0]:
                memcpy(&o[0], i0, n * sizeof(int64_t))
        else:
            if i0 == &o[0]:   # the key group pass scatters into the output: read the indices from the spare
                memcpy(spare, i0, n * sizeof(int64_t))
                i0 = spare
            gh = hist + _DIGITS * _BUCKETS
            for i in range(n):
                gh[groups[i] - gmin] += 1
            p = 0
            for b in range(gmax - gmin + 1):
                p, gh[b] = p + gh[b], p
            for i in range(n):
                b = groups[i0[i]] - gmin
                o[gh[b]] = i0[i]
                gh[b] += 1
    free(k0); free(k1); free(spare); free(hist)
    return out


# ---- the index ------------------------------------------------------------------------------------------------------
cdef inline uint64_t _mix(int64_t key) noexcept nogil:
    """splitmix64's finalizer: consecutive keys land far apart."""
    cdef uint64_t z = <uint64_t>key
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EBULL
    return z ^ (z >> 31)


@cython.final
cdef class Int64Index:
    """A hash index from int64 keys to rows (int64 >= 0): the key -> row map of a columnar table whose keys are
    longs. ``lookup`` and ``insert`` work on whole arrays; ``get`` on one key."""

    cdef int64_t *_keys
    cdef int64_t *_rows
    cdef Py_ssize_t _mask
    cdef Py_ssize_t _size

    def __cinit__(self, Py_ssize_t capacity=0):
        cdef Py_ssize_t cap = 16
        while cap * 3 < capacity * 4:
            cap *= 2
        self._alloc(cap)

    def __init__(self, Py_ssize_t capacity=0):
        """An empty index with room for ``capacity`` keys before it first grows."""

    def __dealloc__(self):
        free(self._keys)
        free(self._rows)

    cdef int _alloc(self, Py_ssize_t cap) except -1:
        cdef Py_ssize_t i
        cdef int64_t *keys = <int64_t *>malloc(cap * sizeof(int64_t))
        cdef int64_t *rows = <int64_t *>malloc(cap * sizeof(int64_t))
        if keys == NULL or rows == NULL:
            free(keys)
            free(rows)
            raise MemoryError(f"Int64Index: cannot allocate {cap} buckets")
        for i in range(cap):
            rows[i] = -1
        self._keys, self._rows, self._mask = keys, rows, cap - 1
        return 0

    cdef int _grow(self, Py_ssize_t wanted) except -1:
        """Make room for ``wanted`` keys at most 3/4 full, rehashing what is there."""
        cdef Py_ssize_t cap = self._mask + 1, old_cap = cap, i, j
        if wanted * 4 <= cap * 3:
            return 0
        while wanted * 4 > cap * 3:
            cap *= 2
        cdef int64_t *old_keys = self._keys
        cdef int64_t *old_rows = self._rows
        self._keys = NULL
        self._rows = NULL
        try:
            self._alloc(cap)
        except MemoryError:
            self._keys, self._rows = old_keys, old_rows
            raise
        with nogil:
            for i in range(old_cap):
                if old_rows[i] >= 0:
                    j = <Py_ssize_t>(_mix(old_keys[i]) & <uint64_t>self._mask)
                    while self._rows[j] >= 0:
                        j = (j + 1) & self._mask
                    self._keys[j] = old_keys[i]
                    self._rows[j] = old_rows[i]
        free(old_keys)
        free(old_rows)
        return 0

    cdef inline Py_ssize_t _find(self, int64_t key) noexcept nogil:
        """The bucket of ``key``, or of the empty bucket where it would go."""
        cdef Py_ssize_t j = <Py_ssize_t>(_mix(key) & <uint64_t>self._mask)
        while self._rows[j] >= 0 and self._keys[j] != key:
            j = (j + 1) & self._mask
        return j

    def __len__(self) -> int:
        return self._size

    def get(self, int64_t key) -> int:
        """The row of ``key``, or -1."""
        return self._rows[self._find(key)]

    def lookup(self, const int64_t[::1] keys) -> np.ndarray:
        """The row of every key (-1: absent), as an int64 array."""
        cdef Py_ssize_t i, n = keys.shape[0]
        out = np.empty(n, dtype=np.int64)
        cdef int64_t[::1] o = out
        with nogil:
            for i in range(n):
                o[i] = self._rows[self._find(keys[i])]
        return out

    def insert(self, const int64_t[::1] keys, const int64_t[::1] rows) -> None:
        """Map ``keys[i]`` to ``rows[i]`` (replacing a key's row if it has one); rows must be >= 0."""
        cdef Py_ssize_t i, j, n = keys.shape[0]
        if rows.shape[0] != n:
            raise ValueError(f"insert: {n} keys but {rows.shape[0]} rows")
        for i in range(n):
            if rows[i] < 0:
                raise ValueError(f"insert: rows must be >= 0, got {rows[i]} at position {i}")
        self._grow(self._size + n)
        with nogil:
            for i in range(n):
                j = self._find(keys[i])
                if self._rows[j] < 0:
                    self._size += 1
                    self._keys[j] = keys[i]
                self._rows[j] = rows[i]

    def remove(self, const int64_t[::1] keys) -> None:
        """Forget ``keys`` (absent ones are skipped), shifting each cluster's later buckets back into the gap."""
        cdef Py_ssize_t i, n = keys.shape[0]
        with nogil:
            for i in range(n):
                self._remove(keys[i])

    cdef void _remove(self, int64_t key) noexcept nogil:
        cdef Py_ssize_t gap = self._find(key), j, home
        if self._rows[gap] < 0:
            return
        self._size -= 1
        j = gap
        while True:
            j = (j + 1) & self._mask
            if self._rows[j] < 0:
                break
            home = <Py_ssize_t>(_mix(self._keys[j]) & <uint64_t>self._mask)
            # the bucket at j may move into the gap unless its home lies cyclically in (gap, j]
            if (j > gap and (home <= gap or home > j)) or (j < gap and (home <= gap and home > j)):
                self._keys[gap] = self._keys[j]
                self._rows[gap] = self._rows[j]
                gap = j
        self._rows[gap] = -1

    def clear(self) -> None:
        """Forget every key."""
        cdef Py_ssize_t i
        for i in range(self._mask + 1):
            self._rows[i] = -1
        self._size = 0

    def __reduce__(self):
        raise TypeError("an Int64Index is in-memory state of a backend and is never pickled")
