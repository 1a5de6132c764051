"""Statements with their values written in: ``literal`` writes one value as a DuckDB SQL literal,
``bind`` a statement's placeholders, ``execute`` runs it, ``rows`` reads its rows (see the comment below
for why)."""

from __future__ import annotations

import math
import re
from datetime import date, datetime
from typing import Any

import duckdb


def _q(s: str) -> str:
    return s.replace("'", "''")


# DuckDB's Python client imports pandas the first time it binds a parameter that is not None
# (duckdb-python checks each value against pandas.NaT before its type): 0.3-0.45 s measured,
# a quarter of an unchanged re-run of 1,000 pages, which loads nothing and never needs pandas.
# The statements a run that loads nothing makes (its row in ``runs``, the inputs it saw, the
# commit message, the short report) write their values into the SQL as literals instead:
# ``literal`` writes one value, ``bind`` a statement's ``$name`` or ``?`` placeholders, skipping
# quoted strings, quoted identifiers and comments. Checked against DuckDB's own binding with
# hostile values (quotes, placeholders and comment marks inside strings, newlines, non-ASCII).

_SQL_TOKEN = re.compile(r"""'(?:[^']|'')*'|"(?:[^"]|"")*"|--[^\n]*|/\*.*?\*/|\$\$|\$[A-Za-z_]\w*|\?""", re.S)


def literal(value: Any) -> str:
    """``value`` as a DuckDB SQL literal of the type binding it would give: None, bool, int,
    float, str, datetime (naive: TIMESTAMP, aware: TIMESTAMPTZ), date, or a list of those."""
    if value is None:
        return "NULL"
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        value = value.item()  # a numpy scalar (an id read with fetchnumpy)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):  # a negative one in parentheses: 10-$x is never 10--1, a comment
        return f"({int(value)})" if value < 0 else str(int(value))
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"'{value!r}'::DOUBLE"
        return f"({value!r}::DOUBLE)" if math.copysign(1.0, value) < 0 else f"{value!r}::DOUBLE"
    if isinstance(value, str):
        if "\0" in value:  # DuckDB's parser ends a string there
            raise ValueError("a NUL character cannot be written into an SQL string")
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, datetime):
        return f"{'TIMESTAMPTZ' if value.tzinfo else 'TIMESTAMP'} '{value.isoformat(sep=' ')}'"
    if isinstance(value, date):
        return f"DATE '{value.isoformat()}'"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    raise TypeError(f"no SQL literal for a {type(value).__name__}")


def bind(sql: str, params: dict[str, Any] | list | tuple | None = None) -> str:
    """``sql`` with its placeholders (``$name`` for a dict, ``?`` in order for a list) replaced
    by the values as literals; text in quotes and comments is left as it is."""
    if not params:
        return sql
    positional = iter(params) if isinstance(params, (list, tuple)) else None

    def one(m: re.Match) -> str:
        token = m.group()
        if token == "?" and positional is not None:
            try:
                return literal(next(positional))
            except StopIteration:
                raise ValueError(f"fewer values than placeholders in: {sql}") from None
        if token.startswith("$") and token != "$$" and isinstance(params, dict):
            return literal(params[token[1:]])
        if token == "$$":
            raise ValueError("dollar-quoted strings are not supported by bind()")
        return token

    out = _SQL_TOKEN.sub(one, sql)
    if positional is not None and next(positional, _END) is not _END:
        raise ValueError(f"more values than placeholders in: {sql}")
    return out


_END = object()


def execute(conn: duckdb.DuckDBPyConnection, sql: str,
            params: dict[str, Any] | list | tuple | None = None) -> duckdb.DuckDBPyConnection:
    """``conn.execute(sql, params)`` with the values written in (see ``bind``): no pandas."""
    return conn.execute(bind(sql, params))


def rows(conn: duckdb.DuckDBPyConnection, sql: str,
         params: dict[str, Any] | list | tuple | None = None) -> list[dict[str, Any]]:
    """A statement's rows as dicts by column name, its values written in (``execute``): no pandas."""
    cur = execute(conn, sql, params)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def insert_values(conn: duckdb.DuckDBPyConnection, table: str, rows: list[dict], chunk: int = 2000) -> int:
    """Append small rows of a few short scalar columns (``run_inputs``) as literal ``VALUES``,
    by the first row's column names: without Arrow, whose ``pa.array`` imports pandas, which a
    run that loads nothing never needs otherwise (see ``bind``)."""
    if not rows:
        return 0
    cols = list(rows[0])
    head = f"INSERT INTO {table} ({', '.join(cols)}) VALUES "
    for i in range(0, len(rows), chunk):
        conn.execute(head + ", ".join(
            "(" + ", ".join(literal(r[c]) for c in cols) + ")" for r in rows[i:i + chunk]))
    return len(rows)
