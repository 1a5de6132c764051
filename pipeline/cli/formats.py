"""Output formats: rows and values printed as a table, CSV or JSON (never a Python repr), fitted
to the terminal."""

from __future__ import annotations

import csv
import datetime
import decimal
import json
import math
import sys

import duckdb
import orjson


def _blob_text(b: bytes) -> str:
    """A BLOB as DuckDB writes one: printable ASCII as is, other bytes as ``\\xHH``."""
    return "".join(chr(c) if 32 <= c < 127 and c != 92 else f"\\x{c:02X}" for c in b)


def _interval_text(d: datetime.timedelta) -> str:
    """An INTERVAL as DuckDB writes one (``1 day``, ``2 days 01:30:00``), not Python's text."""
    days, secs, micros = d.days, d.seconds, d.microseconds
    parts = [f"{days} day{'' if abs(days) == 1 else 's'}"] if days else []
    if secs or micros or not parts:
        hms = f"{secs // 3600:02d}:{secs % 3600 // 60:02d}:{secs % 60:02d}"
        parts.append(hms + (f".{micros:06d}" if micros else ""))
    return " ".join(parts)


def _plain(value):
    """A query's value as JSON has it: containers walked, a DECIMAL as a number, a BLOB and an
    INTERVAL as DuckDB writes them, a time as ISO 8601, NaN and infinities as null (JSON has
    none); never a Python repr."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() and value.is_finite() else (
            float(value) if value.is_finite() else None)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _blob_text(bytes(value))
    if isinstance(value, datetime.timedelta):
        return _interval_text(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    return str(value)  # UUID and the like


def _json_dumps(value, *, indent: bool = False) -> str:
    """JSON text of query results: orjson, or Python's json for integers past 64 bits (HUGEINT)."""
    plain = _plain(value)
    try:
        return orjson.dumps(plain, option=orjson.OPT_INDENT_2 if indent else 0).decode()
    except TypeError:
        return json.dumps(plain, ensure_ascii=False, indent=2 if indent else None,
                          separators=None if indent else (",", ":"))


def _csv_cell(value):
    """A CSV cell: a list, struct or map as JSON text (timestamps inside it ISO 8601, as in
    --format json), never a Python repr; a scalar as text DuckDB would write."""
    if isinstance(value, (list, tuple, dict)):
        return _json_dumps(value)
    if isinstance(value, (bytes, bytearray, memoryview, datetime.timedelta)):
        return _plain(value)
    if isinstance(value, bool):  # as DuckDB's CSV writer and every CSV reader have it, not True/False
        return "true" if value else "false"
    return value


def _unique_names(cols: list[str]) -> list[str]:
    """Column names made unique as DuckDB makes a subquery's (``a, a, a_1`` -> ``a, a_1, a_1_1``):
    a JSON object, or a row turned into one, keeps every column (``SELECT 1 AS a, 2 AS a``, a
    join's two ``extra`` columns)."""
    seen: set[str] = set()  # lower case: DuckDB's names are case-insensitive (a, A -> a, A_1)
    tried: dict[str, int] = {}  # the last suffix tried for a name: linear in the columns, not quadratic
    out = []
    for name in cols:
        unique, k = name, tried.get(name.lower(), 0)
        while unique.lower() in seen:
            k += 1
            unique = f"{name}_{k}"
        tried[name.lower()] = k
        seen.add(unique.lower())
        out.append(unique)
    return out


def _terminal_width() -> int | None:
    """The terminal's columns when stdout is one; None into a pipe or a file (then tables are
    printed whole, for grep and ``less -S``)."""
    if not sys.stdout.isatty():
        return None
    import shutil

    return shutil.get_terminal_size((120, 24)).columns


def _print_rows(cols: list[str], rows: list[tuple], fmt: str, max_rows: int = 40, max_width: int | None = None) -> None:
    """Rows as a table (DuckDB's own rendering), CSV or JSON on stdout. The table fits the
    terminal as DuckDB's own CLI fits it (long values cut, middle columns left out, said below
    it) unless ``max_width`` is given; into a pipe, whole."""
    if max_width is None:
        max_width = _terminal_width() or 10_000
    if fmt != "csv":
        cols = _unique_names(cols)
    if fmt == "csv":
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(cols)
        w.writerows([_csv_cell(v) for v in r] for r in rows)
    elif fmt == "json":
        out = [dict(zip(cols, r)) for r in rows]
        sys.stdout.write(_json_dumps(out, indent=True) + "\n")
    else:
        with duckdb.connect() as c:
            import pyarrow as pa

            c.register("result", pa.Table.from_pylist([dict(zip(cols, r)) for r in rows]) if rows
                       else pa.table({col: pa.array([], pa.string()) for col in cols}))
            c.sql("SELECT * FROM result").show(max_rows=max_rows, max_width=max_width)


def _print_json(value) -> None:
    """One JSON document on stdout (timestamps as ISO 8601): all a script reads there."""
    sys.stdout.write(orjson.dumps(value, default=str, option=orjson.OPT_INDENT_2).decode() + "\n")


def _cut_middle(v: str, room: int) -> str:
    """``v`` in at most ``room`` characters, cut in its middle (a path's head and its end stay)."""
    if len(v) <= room:
        return v
    keep = max(room - 1, 2)
    return v[: keep // 2] + "…" + v[len(v) - (keep - keep // 2):]
