# Typed codecs (included by codec.pyx, whose names it uses): the Codec class, built by keygroups.serializers as a
# tree that mirrors a typed serializer, and its encoder and decoder.

@cython.auto_pickle(False)   # serializers pickle by their constructor arguments and rebuild the codec
cdef class Codec:
    """The compiled form of one serializer (a tree for nested ones). Built by keygroups.serializers."""
    # attributes: declared in codec.pxd

    def __init__(self, int kind, str name, tuple children=(), object external=None):
        cdef Codec ch
        cdef Py_ssize_t total = 0
        cdef bint fixed = True
        self.kind = kind
        self.name = name
        self.children = children
        self.external = external
        self.fixed_size = -1
        for ch in children:
            if ch is None:
                raise TypeError("codec children must be Codec objects")
        nchildren = {K_NULLABLE: 1, K_LIST: 1, K_MAP: 2}.get(kind, 0)
        if kind == K_TUPLE:
            if len(children) == 0:
                raise ValueError("a tuple codec needs at least one field")
        elif len(children) != nchildren:
            raise ValueError(f"codec kind {kind} takes {nchildren} children, got {len(children)}")
        if kind == K_EXTERNAL and external is None:
            raise ValueError("an external codec needs the serializer it calls")
        if nchildren >= 1:
            self.a = children[0]
        if nchildren == 2:
            self.b = children[1]
        if kind == K_INT64 or kind == K_FLOAT64:
            self.min_size = self.fixed_size = 8
        elif kind == K_INT32:
            self.min_size = self.fixed_size = 4
        elif kind == K_BOOL:
            self.min_size = self.fixed_size = 1
        elif kind == K_STR or kind == K_BYTES or kind == K_LIST or kind == K_MAP or kind == K_EXTERNAL:
            self.min_size = 4
        elif kind == K_NULLABLE or kind == K_VALUE:
            self.min_size = 1
        elif kind == K_TUPLE:
            for ch in children:
                total += ch.min_size
                fixed = fixed and ch.fixed_size >= 0
            self.min_size = total
            if fixed:
                self.fixed_size = total
        else:
            raise ValueError(f"unknown codec kind {kind}")

    def __repr__(self):
        return f"<Codec {self.name}>"

    def encode(self, value) -> bytes:
        """One value → its bytes."""
        cdef Writer w
        w_init(&w)
        try:
            enc_top(self, &w, value)
            return w_result(&w)
        finally:
            w_free(&w)

    def decode(self, data):
        """Bytes holding exactly one value → the value; CorruptSnapshotError if they are not that."""
        cdef Py_buffer view
        cdef Cursor cur
        if PyBytes_CheckExact(data):
            cur_init(&cur, <const uint8_t *>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
            return dec_top(self, &cur)
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            cur_init(&cur, <const uint8_t *>view.buf, view.len)
            return dec_top(self, &cur)
        finally:
            PyBuffer_Release(&view)

    def encode_many(self, values):
        """Values → (one buffer, int64 offsets of length n + 1); value i is buffer[offsets[i]:offsets[i + 1]]."""
        cdef Writer w
        cdef Py_ssize_t n, i
        cdef int64_t[::1] o
        fast = self._encode_array(values)
        if fast is not None:
            return fast
        if not isinstance(values, (list, tuple)):
            values = list(values)
        n = len(values)
        offsets = np.empty(n + 1, dtype=np.int64)
        o = offsets
        w_init(&w)
        try:
            for i in range(n):
                o[i] = w.pos
                enc_top(self, &w, values[i])
            o[n] = w.pos
            return w_result(&w), offsets
        finally:
            w_free(&w)

    cdef object _encode_array(self, object values):
        """numpy arrays of a matching dtype are copied in bulk (fixed-width kinds only)."""
        cdef object arr
        if not isinstance(values, np.ndarray) or values.ndim != 1:
            return None
        dt = values.dtype
        if self.kind == K_INT64 and dt.kind in "iu" and (dt.kind == "i" or dt.itemsize < 8):
            arr = values.astype("<i8")
        elif self.kind == K_INT32 and dt.kind in "iu" and (dt.itemsize < 4 or (dt.kind == "i" and dt.itemsize == 4)):
            arr = values.astype("<i4")
        elif self.kind == K_FLOAT64 and dt.kind == "f" and dt.itemsize <= 8:
            arr = values.astype("<f8")
            nan = np.isnan(arr)
            if nan.any():
                arr[nan] = np.nan   # np.nan is the canonical quiet NaN
        elif self.kind == K_BOOL and dt.kind == "b":
            arr = values.astype(np.uint8)
        else:
            return None
        offsets = np.arange(len(arr) + 1, dtype=np.int64) * self.fixed_size
        return np.ascontiguousarray(arr).tobytes(), offsets

    def decode_many(self, data, offsets) -> list:
        """The inverse of encode_many; offsets are untrusted (they come from files) and checked first."""
        cdef Py_buffer view
        cdef Cursor cur
        cdef const int64_t[::1] o = np.ascontiguousarray(offsets, dtype=np.int64)
        cdef Py_ssize_t n = o.shape[0] - 1, i, bad
        cdef list out
        cdef object item
        if n < 0:
            raise ValueError("offsets must hold n + 1 entries (the first 0 or more, then one end per value)")
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            with nogil:
                bad = check_offsets(&o[0], n, view.len)
            if bad >= 0:
                raise CorruptSnapshotError(
                    f"value offsets are not ascending inside the {view.len}-byte buffer (offset {bad}: "
                    f"{o[bad]}): the data is truncated or corrupt")
            if self.fixed_size > 0 and self.kind != K_TUPLE and n > 0:
                fast = self._decode_array(data, &o[0], n)
                if fast is not None:
                    return fast
            out = PyList_New(n)
            for i in range(n):
                cur_init(&cur, <const uint8_t *>view.buf + o[i], o[i + 1] - o[i])
                item = dec_top(self, &cur)
                Py_INCREF(item)
                PyList_SET_ITEM(out, i, item)
            return out
        finally:
            PyBuffer_Release(&view)

    cdef object _decode_array(self, object data, const int64_t *o, Py_ssize_t n):
        cdef Py_ssize_t i
        cdef int64_t w = self.fixed_size
        for i in range(n + 1):
            if o[i] != o[0] + i * w:
                return None   # not one contiguous run: decode one by one (that also reports bad lengths)
        dtype = {K_INT64: "<i8", K_INT32: "<i4", K_FLOAT64: "<f8", K_BOOL: "u1"}[self.kind]
        arr = np.frombuffer(data, dtype=dtype, count=n, offset=o[0])
        if self.kind == K_BOOL:
            if n and arr.max() > 1:
                raise CorruptSnapshotError(f"a bool byte of {int(arr.max())} (only 0 and 1 are valid): "
                                           "the data is truncated or corrupt")
            return arr.astype(bool).tolist()
        return arr.tolist()


cdef Py_ssize_t check_offsets(const int64_t *o, Py_ssize_t n, Py_ssize_t length) noexcept nogil:
    """-1 when 0 <= o[0] <= o[1] <= ... <= o[n] <= length, else the index of the first bad offset."""
    cdef Py_ssize_t i
    if o[0] < 0 or o[0] > length:
        return 0
    for i in range(1, n + 1):
        if o[i] < o[i - 1] or o[i] > length:
            return i
    return -1


cdef int enc_top(Codec c, Writer *w, object v) except -1:
    """A whole value: like enc, except that a top-level str/bytes needs no length (the frame has it)."""
    cdef Py_ssize_t n
    cdef const char *p
    cdef bytes b
    if c.kind == K_STR:
        p = _utf8(c, v, &n)
        return w_bytes(w, p, n)
    if c.kind == K_BYTES:
        return enc_bytes(c, w, v, False)
    if c.kind == K_EXTERNAL:
        b = _external_bytes(c, v)
        return w_bytes(w, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))
    return enc(c, w, v, 0)


cdef object dec_top(Codec c, Cursor *cur):
    cdef object v
    cdef Py_ssize_t n = cur_remaining(cur)
    if c.kind == K_STR:
        return r_str(cur, n)
    if c.kind == K_BYTES:
        return r_bytes(cur, n)
    if c.kind == K_EXTERNAL:
        return c.external.deserialize(r_bytes(cur, n))
    v = dec(c, cur, 0)
    if cur.pos != cur.length:
        cur_corrupt(cur, f"{cur.length - cur.pos} trailing bytes after a {c.name} value")
    return v


cdef inline const char *_utf8(Codec c, object v, Py_ssize_t *n) except NULL:
    if not isinstance(v, str):
        raise TypeError(f"{c.name} expects a str, got {_short(v)} of type {type(v).__name__}")
    return PyUnicode_AsUTF8AndSize(v, n)


cdef int enc_bytes(Codec c, Writer *w, object v, bint prefixed) except -1:
    cdef Py_buffer view
    if PyBytes_CheckExact(v):
        if prefixed:
            w_len(w, PyBytes_GET_SIZE(v), "a bytes length")
        return w_bytes(w, PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v))
    if not isinstance(v, (bytes, bytearray, memoryview)):
        raise TypeError(f"{c.name} expects bytes, bytearray or memoryview, got {_short(v)} of type "
                        f"{type(v).__name__}")
    PyObject_GetBuffer(v, &view, PyBUF_SIMPLE)
    try:
        if prefixed:
            w_len(w, view.len, "a bytes length")
        return w_bytes(w, <const char *>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef bytes _external_bytes(Codec c, object v):
    b = c.external.serialize(v)
    if not PyBytes_CheckExact(b):
        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise TypeError(f"{c.name}.serialize returned {type(b).__name__}, not bytes")
        b = bytes(b)
    return b


cdef inline int64_t _as_int(Codec c, object v, int64_t lo, int64_t hi) except? -1:
    cdef int overflow = 0
    cdef long long x
    if not PyLong_Check(v):
        if isinstance(v, float) or isinstance(v, _np_floating) or isinstance(v, str):
            raise TypeError(f"{c.name} expects an int, got {_short(v)} of type {type(v).__name__}")
        try:
            v = _index(v)
        except TypeError:
            raise TypeError(f"{c.name} expects an int, got {_short(v)} of type {type(v).__name__}") from None
    x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow or x < lo or x > hi:
        raise ValueError(f"{v!r} is out of range for {c.name}: allowed are integers in [{lo}, {hi}]")
    return x


cdef int enc(Codec c, Writer *w, object v, int depth) except -1:
    """One nested value of codec c."""
    cdef int k = c.kind
    cdef Py_ssize_t n, i
    cdef const char *p
    cdef bytes b
    cdef Codec f
    if k == K_INT64:
        return w_i64(w, _as_int(c, v, -9223372036854775807LL - 1, 9223372036854775807LL))
    if k == K_INT32:
        i = <Py_ssize_t>_as_int(c, v, INT32_MIN, INT32_MAX)
        return w_u32(w, <uint32_t><int32_t>i)
    if k == K_STR:
        p = _utf8(c, v, &n)
        w_len(w, n, "a str length")
        return w_bytes(w, p, n)
    if k == K_FLOAT64:
        if type(v) is float:
            return w_f64(w, PyFloat_AsDouble(v))
        if isinstance(v, str) or isinstance(v, (bytes, bytearray)) or v is None:
            raise TypeError(f"{c.name} expects a float, got {_short(v)} of type {type(v).__name__}")
        try:
            return w_f64(w, PyFloat_AsDouble(v))
        except TypeError:
            raise TypeError(f"{c.name} expects a float, got {_short(v)} of type {type(v).__name__}") from None
        except OverflowError:
            raise ValueError(f"{_short(v)} is out of range for {c.name}: allowed are floats and ints of magnitude "
                             "up to about 1.8e308") from None
    if k == K_BOOL:
        if v is True:
            return w_u8(w, 1)
        if v is False:
            return w_u8(w, 0)
        if isinstance(v, _np_bool):
            return w_u8(w, 1 if v else 0)
        raise TypeError(f"{c.name} expects a bool, got {_short(v)} of type {type(v).__name__}")
    if k == K_BYTES:
        return enc_bytes(c, w, v, True)
    if k == K_NULLABLE:
        if v is None:
            return w_u8(w, 0)
        w_u8(w, 1)
        return enc(c.a, w, v, depth + 1)
    if k == K_TUPLE:
        n = len(c.children)
        if type(v) is tuple:
            if PyTuple_GET_SIZE(v) != n:
                raise ValueError(f"{c.name} expects a tuple of {n} fields, got {PyTuple_GET_SIZE(v)}: {_short(v)}")
            for i in range(n):
                enc(<Codec>PyTuple_GET_ITEM(c.children, i), w, <object>PyTuple_GET_ITEM(v, i), depth + 1)
            return 0
        if not isinstance(v, (tuple, list)):
            raise TypeError(f"{c.name} expects a tuple (or list) of {n} fields, got {_short(v)} of type "
                            f"{type(v).__name__}")
        return enc(c, w, tuple(v), depth)
    if k == K_LIST:
        if not isinstance(v, (list, tuple)):
            raise TypeError(f"{c.name} expects a list (or tuple), got {_short(v)} of type {type(v).__name__}")
        if type(v) is not tuple:
            v = tuple(v)   # a snapshot of the elements: encoding them may run Python code
        n = PyTuple_GET_SIZE(v)
        w_len(w, n, "a list length")
        f = c.a
        for i in range(n):
            enc(f, w, <object>PyTuple_GET_ITEM(v, i), depth + 1)
        return 0
    if k == K_MAP:
        if not isinstance(v, dict):
            raise TypeError(f"{c.name} expects a dict, got {_short(v)} of type {type(v).__name__}")
        return enc_dict(w, v if type(v) is dict else PyDict_Copy(v), c.a, c.b, depth)
    if k == K_VALUE:
        return enc_value(w, v, depth)
    if k == K_EXTERNAL:
        b = _external_bytes(c, v)
        w_len(w, PyBytes_GET_SIZE(b), "an external value length")
        return w_bytes(w, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))
    raise AssertionError(f"unknown codec kind {k}")


cdef object dec(Codec c, Cursor *cur, int depth):
    """One nested value of codec c."""
    cdef int k = c.kind
    cdef Py_ssize_t n, i
    cdef uint8_t flag
    cdef object item, key, out
    cdef Codec f
    if k == K_INT64:
        return PyLong_FromLongLong(r_i64(cur))
    if k == K_STR:
        n = cur_count(cur, 1, "a str length")
        return r_str(cur, n)
    if k == K_INT32:
        return PyLong_FromLongLong(r_i32(cur))
    if k == K_FLOAT64:
        return PyFloat_FromDouble(r_f64(cur))
    if k == K_BOOL:
        flag = cur_u8(cur)
        if flag > 1:
            cur.pos -= 1
            cur_corrupt(cur, f"a bool byte of {flag} (only 0 and 1 are valid)")
        return flag == 1
    if k == K_BYTES:
        n = cur_count(cur, 1, "a bytes length")
        return r_bytes(cur, n)
    if k == K_NULLABLE:
        flag = cur_u8(cur)
        if flag == 0:
            return None
        if flag != 1:
            cur.pos -= 1
            cur_corrupt(cur, f"a null flag of {flag} (only 0 and 1 are valid)")
        return dec(c.a, cur, depth + 1)
    if k == K_TUPLE:
        n = PyTuple_GET_SIZE(c.children)
        out = PyTuple_New(n)
        for i in range(n):
            item = dec(<Codec>PyTuple_GET_ITEM(c.children, i), cur, depth + 1)
            Py_INCREF(item)
            PyTuple_SET_ITEM(out, i, item)
        return out
    if k == K_LIST:
        f = c.a
        n = cur_count(cur, f.min_size, "a list length")
        out = PyList_New(n)
        for i in range(n):
            item = dec(f, cur, depth + 1)
            Py_INCREF(item)
            PyList_SET_ITEM(out, i, item)
        return out
    if k == K_MAP:
        n = cur_count(cur, c.a.min_size + c.b.min_size, "a map size")
        out = {}
        for i in range(n):
            if c.a.kind == K_STR:
                key = r_key_str(cur, cur_count(cur, 1, "a str length"))
            else:
                key = dec(c.a, cur, depth + 1)
                if c.a.kind != K_INT64 and c.a.kind != K_INT32:
                    key = _map_key(key)
            item = dec(c.b, cur, depth + 1)
            _dict_put(cur, out, key, item)
        if len(out) != n:
            cur_corrupt(cur, f"a map of {n} entries with duplicate keys")
        return out
    if k == K_VALUE:
        return dec_value(cur, depth)
    if k == K_EXTERNAL:
        n = cur_count(cur, 1, "an external value length")
        return c.external.deserialize(r_bytes(cur, n))
    raise AssertionError(f"unknown codec kind {k}")


def copy_json_value(value):
    """A deep copy of a ValueSerializer value (lists, dicts and bytearrays are new; immutables are shared)."""
    return copy_value(value, 0)
