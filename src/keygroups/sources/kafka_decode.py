"""Decoding a batch of Kafka values against the record schema: JSON objects (checked one by one, parsed by Arrow in
one call) or raw bytes through a user's decoder. A value that does not decode goes to the caller's ``bad(index,
why)``, which raises or skips by the source's policy; the rest come back as one table with their indexes."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pyarrow as pa

__all__ = ["decode_json", "decode_with", "preview"]

#: How many bytes of a bad value an error message shows.
PREVIEW_BYTES = 80

Bad = Callable[[int, str], None]


def decode_json(values: Sequence[bytes | None], record_schema: pa.Schema, bad: Bad) -> tuple[list[int], pa.Table]:
    """Each value must be one JSON object (``json`` checks, so that Arrow's reader, which takes whatever is on a
    line, gets exactly one object per line: a line of two objects, or a bare ``null``, would shift or crash it);
    Arrow parses them against the schema in one call. A batch Arrow refuses is split in halves until the values it
    refuses are found. Returns the indexes of the values decoded and their table."""
    lines: list[bytes] = []
    keep: list[int] = []
    for i, value in enumerate(values):
        line = _json_line(value)
        if isinstance(line, str):
            bad(i, line)
        else:
            lines.append(line)
            keep.append(i)
    options = _json_options(record_schema)
    good: list[int] = []
    tables: list[pa.Table] = []

    def parse(lo: int, hi: int) -> None:
        try:
            table = _read_json_lines(lines[lo:hi], options)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            if hi - lo == 1:
                bad(keep[lo], str(e))
                return
            mid = (lo + hi) // 2
            parse(lo, mid)
            parse(mid, hi)
            return
        good.extend(keep[lo:hi])
        tables.append(table)

    if lines:
        parse(0, len(lines))
    if not tables:
        return [], record_schema.empty_table()
    return good, pa.concat_tables(tables)


def decode_with(values: Sequence[bytes | None], decoder: Callable[[bytes], Mapping[str, Any] | None],
                record_schema: pa.Schema, bad: Bad) -> tuple[list[int], pa.Table]:
    """Each value through ``decoder`` (a dict, or None to drop the value), the dicts converted to the schema (a
    batch Arrow refuses is split in halves until the rows it refuses are found). Returns the indexes of the values
    decoded and their table."""
    rows: list[Mapping[str, Any]] = []
    keep: list[int] = []
    for i, value in enumerate(values):
        if value is None:
            bad(i, "its value is null (a tombstone); a decoder sees bytes only")
            continue
        try:
            row = decoder(value)
        except Exception as e:
            bad(i, f"the decoder raised {type(e).__name__}: {e}")
            continue
        if row is None:
            continue   # the decoder drops it
        if not isinstance(row, Mapping):
            bad(i, f"the decoder returned {type(row).__name__}, not a dict (or None to drop it)")
            continue
        rows.append(row)
        keep.append(i)
    good: list[int] = []
    tables: list[pa.Table] = []

    def convert(lo: int, hi: int) -> None:
        try:
            table = pa.Table.from_pylist(rows[lo:hi], schema=record_schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
            if hi - lo == 1:
                bad(keep[lo], f"the decoded record does not fit the record schema: {e}")
                return
            mid = (lo + hi) // 2
            convert(lo, mid)
            convert(mid, hi)
            return
        good.extend(keep[lo:hi])
        tables.append(table)

    if rows:
        convert(0, len(rows))
    if not tables:
        return [], record_schema.empty_table()
    return good, pa.concat_tables(tables)


def preview(value: bytes | None) -> str:
    if value is None:
        return "null"
    head = value[:PREVIEW_BYTES]
    return repr(head) + (f"... ({len(value)} bytes)" if len(value) > PREVIEW_BYTES else "")


def _json_line(value: bytes | None) -> bytes | str:
    """``value`` as one line holding one JSON object, or why it is not one."""
    if value is None:
        return "its value is null (a tombstone), not a JSON object"
    try:
        parsed = json.loads(value.decode("utf-8"))   # UTF-8 only (json.loads would take UTF-16/32 bytes too)
    except UnicodeDecodeError as e:
        return f"it is not UTF-8: {e}"
    except ValueError as e:
        return f"it is not JSON: {e}"
    if not isinstance(parsed, dict):
        return f"it is JSON {type(parsed).__name__}, not an object"
    if b"\n" in value or b"\r" in value:   # line breaks between tokens: write it on one line for Arrow
        return json.dumps(parsed, ensure_ascii=False, separators=(",", ":")).encode()
    return value


def _json_options(record_schema: pa.Schema) -> Any:
    import pyarrow.json as pajson

    return pajson.ParseOptions(explicit_schema=record_schema, unexpected_field_behavior="ignore")


def _read_json_lines(lines: Sequence[bytes], options: Any) -> pa.Table:
    import pyarrow.json as pajson

    buffer = b"\n".join(lines) + b"\n"
    read = pajson.ReadOptions(block_size=max(1 << 20, min(len(buffer) + 1, 1 << 30)))
    table = pajson.read_json(pa.BufferReader(buffer), read_options=read, parse_options=options)
    if table.num_rows != len(lines):   # never for checked lines; refuse rather than misalign records
        raise pa.ArrowInvalid(f"{len(lines)} JSON lines parsed into {table.num_rows} rows")
    return table.select(options.explicit_schema.names).cast(options.explicit_schema)
