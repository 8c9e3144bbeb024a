# The ValueSerializer format (included by codec.pyx, whose names it uses): a tag byte (the T_* of codec.pyx), then
# the payload.

cdef inline int enc_v_str(Writer *w, object v) except -1:
    cdef Py_ssize_t n
    cdef const char *p = PyUnicode_AsUTF8AndSize(v, &n)   # a str subclass: its stored text, not its __str__
    w_u8(w, T_STR)
    w_len(w, n, "a str length")
    return w_bytes(w, p, n)


cdef inline int enc_v_int(Writer *w, object v) except -1:
    cdef int overflow = 0
    cdef long long x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow:
        return enc_bigint(w, v)
    w_u8(w, T_INT64)
    return w_i64(w, x)


cdef int enc_v_list(Writer *w, object v, int depth) except -1:
    cdef Py_ssize_t n = PyList_GET_SIZE(v), i = 0
    cdef object item
    w_u8(w, T_LIST)
    w_len(w, n, "a list length")
    # Index, not iterate: encoding an element may run Python code that changes the list.
    while i < PyList_GET_SIZE(v):
        if i >= n:
            break
        item = <object>PyList_GET_ITEM(v, i)   # owned, in case that code drops it from the list
        enc_value(w, item, depth + 1)
        i += 1
    if i != n or PyList_GET_SIZE(v) != n:
        raise RuntimeError("list changed size during serialization")
    return 0


cdef int enc_v_tuple(Writer *w, object v, int depth) except -1:
    cdef Py_ssize_t n = PyTuple_GET_SIZE(v), i
    w_u8(w, T_TUPLE)
    w_len(w, n, "a tuple length")
    for i in range(n):
        enc_value(w, <object>PyTuple_GET_ITEM(v, i), depth + 1)
    return 0


cdef inline int enc_v_bytes(Writer *w, object v) except -1:
    cdef Py_ssize_t n = PyBytes_GET_SIZE(v)
    w_u8(w, T_BYTES)
    w_len(w, n, "a bytes length")
    return w_bytes(w, PyBytes_AS_STRING(v), n)


cdef int enc_value(Writer *w, object v, int depth) except -1:
    cdef type t = type(v)
    if depth > C_MAX_DEPTH:
        raise ValueError(f"the value nests deeper than {C_MAX_DEPTH} levels (or contains itself); "
                         "ValueSerializer refuses it")
    if v is None:
        return w_u8(w, T_NONE)
    if t is str:
        return enc_v_str(w, v)
    if t is int:
        return enc_v_int(w, v)
    if t is float:
        w_u8(w, T_FLOAT64)
        return w_f64(w, PyFloat_AsDouble(v))
    if t is bool:
        return w_u8(w, T_TRUE if v is True else T_FALSE)
    if t is dict:
        w_u8(w, T_DICT)
        return enc_dict(w, v, None, None, depth)
    if t is list:
        return enc_v_list(w, v, depth)
    if t is tuple:
        return enc_v_tuple(w, v, depth)
    if t is bytes:
        return enc_v_bytes(w, v)
    return enc_value_slow(w, v, depth)


cdef int enc_bigint(Writer *w, object v) except -1:
    cdef bytes b = int.to_bytes(v, (int.bit_length(v) + 8) // 8, "little", signed=True)
    w_u8(w, T_BIGINT)
    w_len(w, PyBytes_GET_SIZE(b), "an int's byte length")
    return w_bytes(w, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))


cdef int enc_value_slow(Writer *w, object v, int depth) except -1:
    """Subclasses of the JSON-like types, stored as their base type from the value they hold (never from methods
    they may override: a str subclass's __str__, a list subclass's __iter__), and numpy scalars."""
    if PyUnicode_Check(v):
        return enc_v_str(w, v)
    if PyLong_Check(v):   # IntEnum & co.; bool is handled before (it cannot be subclassed)
        return enc_v_int(w, v)
    if PyFloat_Check(v):
        w_u8(w, T_FLOAT64)
        return w_f64(w, PyFloat_AsDouble(v))
    if PyDict_Check(v):   # OrderedDict, defaultdict, ...: a plain copy of what they store (not their items())
        w_u8(w, T_DICT)
        return enc_dict(w, PyDict_Copy(v), None, None, depth)
    if PyList_Check(v):
        return enc_v_list(w, v, depth)
    if PyTuple_Check(v):   # namedtuples become plain tuples
        return enc_v_tuple(w, v, depth)
    if PyBytes_Check(v):
        return enc_v_bytes(w, v)
    if isinstance(v, (bytearray, memoryview)):
        return enc_v_bytes(w, bytes(v))
    if isinstance(v, _np_bool):
        return w_u8(w, T_TRUE if v else T_FALSE)
    if isinstance(v, _np_integer):
        return enc_v_int(w, int(v))
    if isinstance(v, _np_floating):
        w_u8(w, T_FLOAT64)
        return w_f64(w, float(v))
    raise TypeError(f"ValueSerializer cannot serialize {_short(v)} of type {type(v).__name__}; allowed: "
                    f"{ALLOWED_VALUE_TYPES} (nested freely). Use a typed serializer or an explicit PickleSerializer "
                    "for other types")


cdef object dec_value(Cursor *c, int depth):
    cdef uint8_t tag
    cdef Py_ssize_t n, i
    cdef object item, key, out
    if depth > C_MAX_DEPTH:
        cur_corrupt(c, f"a value nested deeper than {C_MAX_DEPTH} levels")
    tag = cur_u8(c)
    if tag == T_STR:
        n = cur_count(c, 1, "a str length")
        return r_str(c, n)
    if tag == T_INT64:
        return PyLong_FromLongLong(r_i64(c))
    if tag == T_NONE:
        return None
    if tag == T_TRUE:
        return True
    if tag == T_FALSE:
        return False
    if tag == T_FLOAT64:
        return PyFloat_FromDouble(r_f64(c))
    if tag == T_DICT:
        n = cur_count(c, 2, "a dict size")
        out = {}
        for i in range(n):
            if cur_u8(c) == T_STR:
                key = r_key_str(c, cur_count(c, 1, "a str length"))
            else:
                c.pos -= 1
                key = dec_value(c, depth + 1)
            item = dec_value(c, depth + 1)
            _dict_put(c, out, key, item)
        if len(out) != n:
            cur_corrupt(c, f"a dict of {n} entries with duplicate keys")
        return out
    if tag == T_LIST:
        n = cur_count(c, 1, "a list length")
        out = PyList_New(n)
        for i in range(n):
            item = dec_value(c, depth + 1)
            Py_INCREF(item)
            PyList_SET_ITEM(out, i, item)
        return out
    if tag == T_TUPLE:
        n = cur_count(c, 1, "a tuple length")
        out = PyTuple_New(n)
        for i in range(n):
            item = dec_value(c, depth + 1)
            Py_INCREF(item)
            PyTuple_SET_ITEM(out, i, item)
        return out
    if tag == T_BYTES:
        n = cur_count(c, 1, "a bytes length")
        return r_bytes(c, n)
    if tag == T_BIGINT:
        n = cur_count(c, 1, "an int's byte length")
        return int.from_bytes(r_bytes(c, n), "little", signed=True)
    c.pos -= 1
    cur_corrupt(c, f"unknown value tag {tag}")


cdef int _dict_put(Cursor *c, dict d, object key, object value) except -1:
    try:
        d[key] = value
    except TypeError:
        cur_corrupt(c, f"an unhashable dict key of type {type(key).__name__}")
    return 0


cdef object copy_value(object v, int depth):
    cdef type t = type(v)
    if depth > C_MAX_DEPTH:
        raise ValueError(f"the value nests deeper than {C_MAX_DEPTH} levels (or contains itself)")
    if t is list:
        return [copy_value(x, depth + 1) for x in <list>v]
    if t is dict:
        return {copy_value(k, depth + 1): copy_value(x, depth + 1) for k, x in (<dict>v).items()}
    if t is tuple:
        return tuple([copy_value(x, depth + 1) for x in <tuple>v])
    if t is bytearray:
        return bytearray(v)
    if isinstance(v, (list, dict, tuple)):   # subclasses: let the copy module keep their type
        import copy
        return copy.deepcopy(v)
    return v
