"""DuckDB judges a batch's check columns by the expectation suites, as Great Expectations would.

Great Expectations judges a pandas frame in Python, and importing it costs ~3 s of CPU in every
process that validates (pandas, its expectation registry, SQLAlchemy). Featurehouse's suites use
five expectation types, each a predicate over one batch's check columns, which DuckDB evaluates
in one vectorised query. This module evaluates them with Great Expectations' semantics for a
pandas batch (what counts as missing, which rows each type ignores, how the percentages are
taken), and hands back the same per-expectation results and failing rows as
``validate._validate_tables`` reads from Great Expectations. A test runs both roads over crafted
bad records and holds them to the same outcome. Great Expectations still records every result
(``validate.store_results`` builds its validation results from ``record``) and renders the Data
Docs; a suite with an expectation type not here goes to Great Expectations whole.

Semantics kept (Great Expectations 1.x, pandas execution engine):
- *missing* is null or NaN (pandas ``isnull``; a DuckDB integer or text NULL, a double NaN);
  infinities are values;
- column-map types (``between``, ``in_set``) skip missing values; ``unexpected_percent`` is
  of the values not missing; ``not_be_null``'s is of every row;
- ``column_pair_values_to_be_equal`` skips a row by ``ignore_row_if`` (default: both missing);
  a missing value on one side is unexpected (NaN equals nothing);
- ``compound_columns_to_be_unique`` skips a row by ``ignore_row_if`` (default: all missing);
  every row of a combination seen more than once among the rest is unexpected (missing values
  of a key are equal to each other, as pandas' ``duplicated`` has them);
- ``mostly`` (default 1): success when the unexpected share of the considered rows is at most
  ``1 - mostly``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import duckdb

#: The expectation types evaluated here, and the keyword arguments each may carry.
TYPES: dict[str, set[str]] = {
    "expect_column_values_to_not_be_null": {"column", "mostly"},
    "expect_column_values_to_be_between": {"column", "min_value", "max_value", "strict_min",
                                           "strict_max", "mostly"},
    "expect_column_values_to_be_in_set": {"column", "value_set", "mostly"},
    "expect_column_pair_values_to_be_equal": {"column_A", "column_B", "ignore_row_if", "mostly"},
    "expect_compound_columns_to_be_unique": {"column_list", "ignore_row_if", "mostly"},
}

#: Rows kept per expectation for Great Expectations' stored record (its partial lists).
PARTIAL = 20

_FLOATS = {"FLOAT", "DOUBLE", "REAL"}


def can_judge(suite: dict[str, Any]) -> bool:
    """Whether every expectation of ``suite`` is of a type, with arguments, evaluated here."""
    return all(e.get("type") in TYPES and set(e.get("kwargs") or {}) <= TYPES[e["type"]] | {"batch_id"}
               for e in suite.get("expectations", []))


def _ident(name: Any) -> str:
    if not isinstance(name, str):
        raise ValueError(f"a column name must be a string, not {name!r}")
    return '"' + name.replace('"', '""') + '"'


def _literal(v: Any) -> str:
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "'NaN'::DOUBLE"
        return f"'{v!r}'::DOUBLE" if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    raise ValueError(f"{v!r} is not a value DuckDB compares here (a number, a string or a boolean)")


class _Columns:
    """The check columns' types, to say what missing means for each."""

    def __init__(self, types: dict[str, str]):
        self.types = types

    def col(self, name: Any) -> str:
        if name not in self.types:
            raise KeyError(f'The column "{name}" in BatchData does not exist.')
        return _ident(name)

    def missing(self, name: Any) -> str:
        c = self.col(name)
        if self.types[name].upper() in _FLOATS:
            return f"({c} IS NULL OR isnan({c}))"
        return f"({c} IS NULL)"

    def key(self, name: Any) -> str:
        """The column as a grouping key: NaN grouped with NULL, as pandas' missing values are."""
        c = self.col(name)
        return f"(CASE WHEN isnan({c}) THEN NULL ELSE {c} END)" if self.types[name].upper() in _FLOATS else c


def _predicates(e: dict[str, Any], cols: _Columns) -> tuple[str, str, list[str]]:
    """For one expectation: (SQL of 'this row is considered', SQL of 'this row is unexpected',
    the columns its unexpected values are read from)."""
    t, kw = e["type"], e.get("kwargs") or {}
    if t == "expect_column_values_to_not_be_null":
        return "TRUE", cols.missing(kw["column"]), [kw["column"]]
    if t == "expect_column_values_to_be_between":
        c, lo, hi = cols.col(kw["column"]), kw.get("min_value"), kw.get("max_value")
        if lo is None and hi is None:
            raise ValueError("min_value and max_value cannot both be None")
        ok = []
        if lo is not None:
            ok.append(f"{c} {'>' if kw.get('strict_min') else '>='} {_literal(lo)}")
        if hi is not None:
            ok.append(f"{c} {'<' if kw.get('strict_max') else '<='} {_literal(hi)}")
        considered = f"NOT {cols.missing(kw['column'])}"
        return considered, f"({considered} AND NOT coalesce({' AND '.join(ok)}, FALSE))", [kw["column"]]
    if t == "expect_column_values_to_be_in_set":
        values = kw.get("value_set")
        if not isinstance(values, list):
            raise ValueError(f"value_set must be a list, not {values!r}")
        c = cols.col(kw["column"])
        considered = f"NOT {cols.missing(kw['column'])}"
        present = " OR ".join(f"{c} = {_literal(v)}" for v in values if v is not None) or "FALSE"
        return considered, f"({considered} AND NOT coalesce({present}, FALSE))", [kw["column"]]
    if t == "expect_column_pair_values_to_be_equal":
        a, b = kw["column_A"], kw["column_B"]
        ma, mb = cols.missing(a), cols.missing(b)
        ignore = kw.get("ignore_row_if", "both_values_are_missing")
        considered = {"both_values_are_missing": f"NOT ({ma} AND {mb})",
                      "either_value_is_missing": f"NOT ({ma} OR {mb})",
                      "neither": "TRUE"}.get(ignore)
        if considered is None:
            raise ValueError(f"unknown ignore_row_if {ignore!r}")
        equal = f"(NOT {ma} AND NOT {mb} AND {cols.col(a)} = {cols.col(b)})"
        return considered, f"({considered} AND NOT coalesce({equal}, FALSE))", [a, b]
    if t == "expect_compound_columns_to_be_unique":
        names = kw.get("column_list")
        if not isinstance(names, list) or not names:
            raise ValueError(f"column_list must be a non-empty list, not {names!r}")
        missing = [cols.missing(n) for n in names]
        ignore = kw.get("ignore_row_if", "all_values_are_missing")
        considered = {"all_values_are_missing": f"NOT ({' AND '.join(missing)})",
                      "any_value_is_missing": f"NOT ({' OR '.join(missing)})",
                      "never": "TRUE"}.get(ignore)
        if considered is None:
            raise ValueError(f"unknown ignore_row_if {ignore!r}")
        keys = ", ".join(cols.key(n) for n in names)
        return considered, (f"({considered} AND count(*) OVER (PARTITION BY ({considered}), {keys}) > 1)"), names
    raise ValueError(f"{t} is not evaluated in DuckDB")


def _value(v: Any) -> Any:
    """A value as a pandas frame's row hands it to a detail template (NaN as None)."""
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def judge(conn: duckdb.DuckDBPyConnection, table: str, query: str, suite: dict[str, Any],
          outcome: Any, record_kind: str) -> None:
    """Judge the rows of ``query`` (check columns, ``_row`` and ``record_key`` among them) by
    ``suite``; appends to ``outcome`` what ``validate._validate_tables`` appends from Great
    Expectations' result, and ``outcome.gx_results[table]``: what Great Expectations records.
    ``record_kind`` names a quarantined row's kind of record (``validate.SUITES[table]``)."""

    rel = conn.sql(query)
    cols = _Columns(dict(zip(rel.columns, map(str, rel.types))))
    expectations = suite.get("expectations", [])
    preds: list[tuple[str, str, list[str]] | Exception] = []
    for e in expectations:
        try:
            preds.append(_predicates(e, cols))
        except (KeyError, ValueError, TypeError) as exc:
            preds.append(exc)
    # each expression's errors are DuckDB's: try them at once, and one by one only if that fails
    live = [i for i, p in enumerate(preds) if not isinstance(p, Exception)]
    try:
        flags = _flags(conn, query, {i: preds[i] for i in live})
    except duckdb.Error:
        for i in live:
            try:
                _flags(conn, query + " LIMIT 0", {i: preds[i]})
            except duckdb.Error as exc:
                preds[i] = exc
        live = [i for i in live if not isinstance(preds[i], Exception)]
        flags = _flags(conn, query, {i: preds[i] for i in live})
    n = conn.execute(f"SELECT count(*) FROM ({query})").fetchone()[0]
    if not n:
        return
    counts = conn.execute(
        "SELECT " + ", ".join([f"count(*) FILTER (WHERE c{i}), count(*) FILTER (WHERE u{i})" for i in live] or ["1"])
        + f" FROM {flags}").fetchone()
    any_unexpected = " OR ".join(f"u{i}" for i in live) or "FALSE"
    failing = conn.execute(
        f"SELECT q.*, {', '.join(f'f.u{i}' for i in live) or 'NULL'} FROM ({query}) q "
        f"JOIN {flags} f USING (_row) WHERE {any_unexpected} ORDER BY q._row").fetchall()
    width = len(rel.columns)
    rows = [(dict(zip(rel.columns, map(_value, r[:width]))), r[width:]) for r in failing]
    all_rows = None  # read only if an expectation could not run
    failed: dict[int, list[tuple[str, str]]] = {}
    record: list[dict[str, Any]] = []
    for i, e in enumerate(expectations):
        meta = e.get("meta") or {}
        check = meta.get("check_name", e["type"])
        kwargs = {k: v for k, v in (e.get("kwargs") or {}).items() if k != "batch_id"}
        entry = {"type": e["type"], "kwargs": kwargs, "meta": meta, "element_count": n}
        if isinstance(preds[i], Exception):
            # An expectation that could not run must not let records through unchecked.
            if all_rows is None:
                all_rows = conn.execute(f"SELECT _row, record_key FROM ({query}) ORDER BY _row").fetchall()
            msg = str(preds[i].args[0] if isinstance(preds[i], KeyError) and preds[i].args else preds[i])
            for row, _ in all_rows:
                failed.setdefault(int(row), []).append((check, f"check could not run: {msg}"))
            keys = sorted({str(k) for _, k in all_rows[:20]})
            entry.update(success=False, exception=msg, unexpected_count=n, considered=n)
            outcome.results.append(_result(table, check, e["type"], kwargs, False, n, n, 100.0, keys))
            record.append(entry)
            continue
        considered, unexpected = counts[2 * live.index(i)], counts[2 * live.index(i) + 1]
        mine = [(values, flags_i) for values, flags_i in rows if flags_i[live.index(i)]]
        for values, _ in mine:
            try:
                detail = meta.get("detail", check).format(**values)
            except (KeyError, IndexError, ValueError, AttributeError):
                detail = meta.get("detail", check)
            failed.setdefault(int(values["_row"]), []).append((check, detail))
        base = n if e["type"] == "expect_column_values_to_not_be_null" else considered
        percent = unexpected / base * 100 if base else 0.0  # in Great Expectations' order: the same last digit
        mostly = float((e.get("kwargs") or {}).get("mostly", 1.0))
        success = (unexpected / base if base else 0.0) <= 1.0 - mostly + 1e-12
        keys = sorted({str(values["record_key"]) for values, _ in mine[:20]})
        outcome.results.append(_result(table, check, e["type"], kwargs, success, n, unexpected, percent, keys))
        names = preds[i][2]
        entry.update(success=success, unexpected_count=unexpected, considered=considered,
                     unexpected_percent=percent,
                     unexpected=[{**{c: values[c] for c in names}, "_row": str(values["_row"])}
                                 for values, _ in mine[:PARTIAL]])
        record.append(entry)
    outcome.gx_results[table] = {"featurehouse_record": record, "suite_name": suite.get("name", table)}
    by_key = {int(v["_row"]): str(v["record_key"]) for v, _ in rows}
    if all_rows is not None:
        by_key.update((int(r), str(k)) for r, k in all_rows)
    for row, checks in sorted(failed.items()):
        for check, detail in checks:
            outcome.quarantine.append({"table": table, "row": row, "record_kind": record_kind,
                                       "record_key": by_key[row], "check_name": check, "detail": detail})


def _flags(conn: duckdb.DuckDBPyConnection, query: str, preds: dict[int, tuple[str, str, list[str]]]) -> str:
    """A temporary table of each row's ``_row`` and, per expectation, whether it is considered
    (``c<i>``) and unexpected (``u<i>``)."""
    cols = [f"coalesce({c}, FALSE) AS c{i}, coalesce({u}, FALSE) AS u{i}" for i, (c, u, _) in preds.items()]
    conn.execute("CREATE OR REPLACE TEMP TABLE stage_judged AS SELECT _row"
                 + "".join(", " + c for c in cols) + f" FROM ({query})")
    return "stage_judged"


def _result(table, check, type_, kwargs, success, n, unexpected, percent, keys) -> dict[str, Any]:
    return {"suite": table, "expectation": check, "expectation_type": type_,
            "kwargs": json.dumps(kwargs, default=str), "success": bool(success), "element_count": int(n),
            "unexpected_count": int(unexpected), "unexpected_percent": float(percent), "failing_keys": keys}


def to_great_expectations(record: dict[str, Any], validated_at: Any = None):
    """Great Expectations' validation result of one table's batch, from what ``judge`` recorded
    (imports Great Expectations: called where results are stored, not where they are judged)."""
    from great_expectations.core import (
        ExpectationSuiteValidationResult,
        ExpectationValidationResult,
    )
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    results = []
    for entry in record["featurehouse_record"]:
        config = ExpectationConfiguration(type=entry["type"], kwargs=entry["kwargs"], meta=entry["meta"])
        if "exception" in entry:
            results.append(ExpectationValidationResult(
                success=False, expectation_config=config, result={},
                exception_info={"raised_exception": True, "exception_message": entry["exception"],
                                "exception_traceback": None}))
            continue
        n, considered, unexpected = entry["element_count"], entry["considered"], entry["unexpected_count"]
        values = [v for v in entry["unexpected"]]
        names = [k for k in (values[0] if values else {}) if k != "_row"]
        listed = [v[names[0]] if len(names) == 1 else
                  ([v[c] for c in names] if entry["type"] == "expect_column_pair_values_to_be_equal"
                   else {c: v[c] for c in names}) for v in values]
        result = {"element_count": n, "unexpected_count": unexpected,
                  "unexpected_percent": entry["unexpected_percent"],
                  "partial_unexpected_list": listed, "unexpected_list": listed,
                  "unexpected_index_column_names": ["_row"],
                  "unexpected_index_list": values, "partial_unexpected_index_list": values}
        if entry["type"] != "expect_column_values_to_not_be_null":
            result.update(missing_count=n - considered,
                          missing_percent=(n - considered) / n * 100 if n else None,
                          unexpected_percent_total=unexpected / n * 100 if n else None,
                          unexpected_percent_nonmissing=entry["unexpected_percent"])
        results.append(ExpectationValidationResult(success=entry["success"], expectation_config=config,
                                                   result=result, exception_info={
                                                       "raised_exception": False, "exception_message": None,
                                                       "exception_traceback": None}))
    ok = sum(1 for r in results if r.success)
    return ExpectationSuiteValidationResult(
        success=ok == len(results), results=results, suite_name=record["suite_name"],
        statistics={"evaluated_expectations": len(results), "successful_expectations": ok,
                    "unsuccessful_expectations": len(results) - ok,
                    "success_percent": 100.0 * ok / len(results) if results else None},
        meta={"judged_by": "duckdb (featurehouse.stages.sql_judge)"})
