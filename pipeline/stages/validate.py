"""Validate stage: run the Great Expectations suite of each table once per batch.

The suites live in ``schemas/expectations/<table>.json``. Great Expectations checks columns,
so each record's list-valued facts (lengths, maxima, finiteness) are first derived as scalar
check columns in DuckDB, vectorised over the whole batch; the suite then judges them. A record
that fails any expectation is kept out of its table and quarantined with the check's name and a
readable detail taken from the expectation's ``meta.detail`` template.

DuckDB judges the suites in SQL with Great Expectations' semantics (``sql_judge``); Great
Expectations itself judges only a suite with an expectation type DuckDB does not evaluate (in an
ephemeral context: ``batch.validate``; Great Expectations in the process: ``gx_setup``). Either
way the results are recorded in the warehouse's file data context (``gx/``), where each table has
a validation definition and a checkpoint (``featurehouse-<table>``), as that checkpoint records a
run's, and its Data Docs are built from them (``gx_project``). ``frame_for`` gives a batch's check columns as a pandas frame, for a Great Expectations
user to run the checkpoint again (docs/report.md).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import duckdb

from . import parse
from .gx_project import (  # noqa: F401  (what was recorded here: other code reaches it as validate.X)
    _file_context,
    _pages_missing,
    _pending_runs,
    _set_up_project,
    _shape,
    build_data_docs,
    checkpoint_name,
    has_pending,
    store_pending,
    store_results,
)
from .gx_setup import (  # noqa: F401
    _GX_LOCK,
    _GX_USE,
    BATCH_DEFINITION,
    SUITES,
    SuiteError,
    _gx,
    heavy_imports,
    load_suite,
)
from .materialise import EXCERPT, excerpt_columns

log = logging.getLogger(__name__)

__all__ = [
    "SUITES", "SuiteError", "ValidationOutcome", "validate_batch", "load_suite",
    "store_results", "build_data_docs", "frame_for", "checkpoint_name",
]

# Scalar check columns derived from each staged table; the suites refer to these names.
# ``input_key`` names a record's input (a hash of its digest, small in the frame): an id is
# unique within its input; two inputs that bring one id are captures, settled by the load.
_CHECK_SQL = {
    "features": """
        SELECT _row, concat_ws('/', coalesce(model_id, '?'), coalesce(source_id, '?'), coalesce(feature_index::VARCHAR, '?')) AS record_key,  -- '?' marks a missing part
               model_id, source_id, feature_index, frac_nonzero, max_act_approx,
               coalesce(len(pos_str), 0) AS n_pos_str, coalesce(len(pos_values), 0) AS n_pos_values,
               coalesce(len(neg_str), 0) AS n_neg_str, coalesce(len(neg_values), 0) AS n_neg_values
        FROM stage_features""",
    "activations": """
        SELECT _row, coalesce(activation_id, '(no id) in ' || page_key) AS record_key,
               activation_id, hash(input_sha256) AS input_key, feature_index,
               concat_ws('/', coalesce(model_id, '?'), coalesce(source_id, '?'), coalesce(feature_index::VARCHAR, '?')) AS feature_key, page_key,
               coalesce(model_id || '/' || source_id || '/' || feature_index = page_key, false)
                   AS feature_key_matches_page,
               coalesce(len(tokens), 0) AS n_tokens, coalesce(len("values"), 0) AS n_values,
               coalesce(len(tokens) - list_count(tokens), 0) AS n_null_tokens,
               coalesce(len("values") - list_count("values"), 0) AS n_null_values,
               -- NaN and infinities make the sum non-finite: count them only then
               CASE WHEN isfinite(coalesce(list_sum("values"), 0)) THEN 0
                    ELSE len(list_filter("values", x -> NOT isfinite(x))) END AS n_nonfinite_values,
               list_max("values") AS max_of_values, max_value, max_value_token_index,
               CASE WHEN max_value_token_index >= 0
                    THEN "values"[max_value_token_index + 1] END AS value_at_max_index,
               min_value,
               coalesce(max_value_token_index < len("values"), false) AS max_index_in_excerpt,
               coalesce(min_value <= max_value, false) AS min_not_above_max
        FROM stage_activations""",
    "explanations": """
        SELECT _row, coalesce(explanation_id, '(no id) for ' || concat_ws('/', coalesce(model_id, '?'), coalesce(source_id, '?'), coalesce(feature_index::VARCHAR, '?'))) AS record_key,
               explanation_id, hash(input_sha256) AS input_key, feature_index,
               coalesce(length(trim(description)), 0) AS description_length,
               embedding_dim, embedding_numeric,
               -- an embedding needs a length (norm) to have a direction: all zeros have none, and
               -- values so small or large that their squares' sum is not a normal double cannot be
               -- normalised (a cosine with them is undefined: NaN, or 0 for every other feature)
               -- (not list_inner_product, though 3x cheaper: it refuses a null value anywhere in
               -- the lists under its vector, even in a row no branch gives it, e.g. a page's
               -- embedding [1, null] set to NULL in the staging view: the whole batch failed)
               CASE WHEN embedding IS NOT NULL AND len(embedding) > 0
                    THEN coalesce(list_sum(list_transform(embedding, x -> x * x))
                                  BETWEEN 2.2250738585072014e-308 AND 1.7976931348623157e308, false)
               END AS embedding_not_zero
        FROM stage_explanations""",
}

#: The activation checks, and beside them the excerpt columns the statistics need (``x_``…).
_ACTIVATION_CHECKS_AND_EXCERPTS = _CHECK_SQL["activations"].replace(
    "\n        FROM stage_activations", f",\n               {excerpt_columns('x_')}\n        FROM stage_activations")
assert _ACTIVATION_CHECKS_AND_EXCERPTS != _CHECK_SQL["activations"]


def warm_up() -> None:
    """Import Great Expectations and build the suites now (about 3 s), e.g. in a thread while
    the first batch is landed and read: DuckDB releases the GIL, so the two overlap."""
    _suites()


@dataclass
class ValidationOutcome:
    """What one batch's validation decided."""

    quarantine: list[dict[str, Any]] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)
    gx_results: dict[str, Any] = field(default_factory=dict)
    """table → Great Expectations' own validation result, for Data Docs (see ``store_results``)."""


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def validate_batch(conn: duckdb.DuckDBPyConnection, staged: dict[str, Any]) -> ValidationOutcome:
    """Validate the batch's staged records with the tables' suites.

    ``staged`` names the tables to validate (its values are not used); each must be readable in
    ``conn`` as ``stage_<table>`` (a view or table with a unique ``_row`` id per record). Returns quarantine entries (without run and
    input ids, which the caller adds) and one result per expectation.
    """
    outcome = ValidationOutcome()
    _validate_tables(conn, staged, outcome)
    return outcome


def _suites() -> tuple[dict, dict]:
    """Great Expectations' batch definitions and suites, set up once per process (under the
    lock: a warm-up thread may be setting them up)."""
    with _GX_LOCK:
        return _gx()


def _check_relation(conn: duckdb.DuckDBPyConnection, table: str) -> str:
    """Compute the staged ``table``'s check columns into a temporary table; returns a query of
    them (one row per record, ``_row`` its id)."""
    if table == "activations":
        # One pass over the batch's token and value lists: the checks, and beside them what
        # the statistics need (the load reads it back for the rows that load).
        conn.execute(f"CREATE OR REPLACE TEMP TABLE stage_activation_checks AS {_ACTIVATION_CHECKS_AND_EXCERPTS}")
        return (f"SELECT * EXCLUDE ({', '.join('x_' + n for n, _ in EXCERPT)}) "
                "FROM stage_activation_checks")
    conn.execute(f"CREATE OR REPLACE TEMP TABLE stage_{table}_checks AS {_CHECK_SQL[table]}")
    return f"SELECT * FROM stage_{table}_checks"


def _check_frame(conn: duckdb.DuckDBPyConnection, table: str):
    """The staged ``table``'s check columns, a pandas frame for Great Expectations."""
    return conn.sql(_check_relation(conn, table)).df()


def frame_for(table: str, warehouse: Any, *, run_id: str | None = None, inputs: list[str] | None = None):
    """The frame ``table``'s suite judges, as a pandas DataFrame: its check columns, one row per
    record (``record_key`` names it), for the records of inputs the warehouse landed: those of
    the run ``run_id`` loaded, or the inputs of the sha256 digests ``inputs``. The records the
    ingest quarantined are in it, beside those that loaded.

    It is built as the ingest builds a batch's: the inputs' bytes read again from the landing
    area (each on the Python road, which the golden tests hold to the DuckDB road's rows),
    staged, rival captures of a feature among them settled (the newest stays), and the check
    columns computed by the same SQL. Run through the table's checkpoint
    (``featurehouse-<table>``, see docs/report.md) it fails the records the ingest quarantined,
    with the same checks, when the inputs were judged in one batch (a run's inputs up to the
    batch size, 48 MiB or 20,000 activations by default, are one). The records are held in
    memory: meant for pages and modest export files, not a many-GB export batch.
    """
    from ..lake import landing
    from ..lake import warehouse as lake
    from . import captures, stage

    if table not in SUITES:
        raise ValueError(f"no suite judges {table!r}: one of {', '.join(SUITES)}")
    if (run_id is None) == (inputs is None):
        raise ValueError("name a run (run_id) or inputs (their sha256 digests), not both")
    settings = lake.settings_for(warehouse)
    conn = lake.connect(settings, read_only=True)
    try:
        if inputs is None:
            inputs = [sha for (sha,) in conn.execute(
                "SELECT DISTINCT input_sha256 FROM run_inputs WHERE run_id = ? AND outcome = 'loaded' ORDER BY 1",
                [run_id]).fetchall()]
        found = conn.execute("SELECT input_sha256, any_value(format), any_value(captured_at) FROM raw_inputs "
                             "WHERE input_sha256 IN (SELECT unnest(?::VARCHAR[])) GROUP BY ALL ORDER BY 1",
                             [list(inputs)]).fetchall()
    finally:
        conn.close()
    missing = sorted(set(inputs) - {sha for sha, _, _ in found})
    if missing:
        raise ValueError(f"the warehouse landed no input {missing[0]}")
    scratch = duckdb.connect()
    try:
        stage.read_api_json(scratch, [])  # (no input on the DuckDB roads: empty tables)
        stage.read_exports(scratch, {})
        records: dict[str, list[tuple[str, Any]]] = {t: [] for t in stage.STAGED_TABLES}
        for sha, fmt, _ in found:
            for parsed in _parse_landed(landing.landed_path(settings.landing_root, sha), fmt or "", settings):
                for t, kept in records.items():
                    kept.extend((sha, r) for r in getattr(parsed, t))
        stage.stage_parsed(scratch, records)
        del records
        stage.create_views(scratch)
        scratch.execute("CREATE TEMP TABLE batch_inputs (input_sha256 VARCHAR, captured_at TIMESTAMP, is_page BOOLEAN)")
        scratch.executemany("INSERT INTO batch_inputs VALUES (?, ?, ?)",
                            [(sha, at, not (fmt or "").endswith("export_jsonl")) for sha, fmt, at in found])
        captures.claim_captures(scratch)
        return _check_frame(scratch, table)
    finally:
        scratch.close()


def _parse_landed(where: Any, fmt: str, settings: Any) -> Iterator[Any]:
    """A landed input's records, as the Python road parses them (a gzip export batch, one
    ``ParsedInput`` per line; a line that is no record, or an input refused, gives none: no
    suite judged it)."""
    import gzip

    from ..lake import landing

    if fmt == "gzip+export_jsonl":  # a gzip export batch: its lines, streamed (the ingest's road)
        with landing.open_landed(where) as raw, gzip.open(raw) as lines:
            for n, line in enumerate(lines, 1):
                if line.strip():
                    try:
                        yield parse.parse_export_line(line, n)
                    except parse.Rejected:
                        continue
        return
    try:
        yield parse.parse_bytes(landing.read_landed(where), settings)
    except parse.Rejected:
        return


#: Who judges a batch's check columns. ``"duckdb"``: each expectation of a type in ``sql_judge``
#: is evaluated as SQL in DuckDB, with Great Expectations' semantics (a test holds the two
#: roads to the same outcome), and Great Expectations records the results for its Data Docs
#: in the store's thread; a suite with any other type goes to Great Expectations whole.
#: ``"gx"``: Great Expectations judges every table (on a pandas frame of the check columns).
JUDGE = "duckdb"


def _validate_tables(conn: duckdb.DuckDBPyConnection, staged: dict[str, Any], outcome: ValidationOutcome) -> None:
    from . import sql_judge

    frames = {}
    for table in staged:
        query = _check_relation(conn, table)
        if JUDGE == "duckdb" and sql_judge.can_judge(load_suite(table)):
            sql_judge.judge(conn, table, query, load_suite(table), outcome, SUITES[table])
        else:
            frames[table] = conn.sql(query).df()
    # Great Expectations (~3 s of CPU to import) only once a table has records to judge: a batch
    # whose every input was refused before staging has none, and pays nothing for it.
    # Every table's check columns first (DuckDB), then Great Expectations judges them: the
    # first batch's checks run while Great Expectations is still being imported in a thread.
    if frames:
        with _GX_USE:
            _gx_judge(frames, outcome)


def _gx_judge(frames: dict[str, Any], outcome: ValidationOutcome) -> None:
    for table, frame in frames.items():
        n = len(frame)
        failed: dict[int, list[tuple[str, str]]] = {}
        if n:
            batches, suites = _suites()
            batch = batches[table].get_batch(batch_parameters={"dataframe": frame})
            result = batch.validate(
                suites[table],
                result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["_row"]},
            )
            outcome.gx_results[table] = result
            by_row = frame.set_index("_row", drop=False)
            for r in result.results:
                cfg = r.expectation_config
                meta = cfg.meta or {}
                check = meta.get("check_name", cfg.type)
                info = r.result or {}
                rows = [int(u["_row"]) for u in info.get("unexpected_index_list") or []]
                raised = (r.exception_info or {}).get("raised_exception") if isinstance(r.exception_info, dict) else False
                if raised:
                    # An expectation that could not run must not let records through unchecked.
                    rows = [int(x) for x in frame["_row"]]
                    msg = (r.exception_info or {}).get("exception_message", "expectation failed to run")
                    for row in rows:
                        failed.setdefault(row, []).append((check, f"check could not run: {msg}"))
                else:
                    for row in rows:
                        values = {k: _clean(v) for k, v in by_row.loc[row].to_dict().items()}
                        try:
                            detail = meta.get("detail", check).format(**values)
                        except (KeyError, IndexError, ValueError):
                            detail = meta.get("detail", check)
                        failed.setdefault(row, []).append((check, detail))
                keys = sorted({str(by_row.loc[row, "record_key"]) for row in rows[:20]})
                outcome.results.append(
                    {
                        "suite": table,
                        "expectation": check,
                        "expectation_type": cfg.type,
                        "kwargs": json.dumps({k: v for k, v in cfg.kwargs.items() if k != "batch_id"}, default=str),
                        "success": bool(r.success) and not raised,
                        "element_count": int(info.get("element_count") or n),
                        "unexpected_count": len(rows) if raised else int(info.get("unexpected_count") or 0),
                        "unexpected_percent": 100.0 if raised else float(info.get("unexpected_percent") or 0.0),
                        "failing_keys": keys,
                    }
                )
            for row, checks in sorted(failed.items()):
                for check, detail in checks:
                    outcome.quarantine.append(
                        {"table": table, "row": row, "record_kind": SUITES[table],
                         "record_key": str(by_row.loc[row, "record_key"]), "check_name": check, "detail": detail}
                    )


def needs_great_expectations(data_docs: str) -> bool:
    """Whether an ingest imports Great Expectations: to judge (a suite DuckDB cannot judge, or
    ``JUDGE = "gx"``), or to record results and build Data Docs with the run (``data_docs="run"``)."""
    from . import sql_judge

    return data_docs != "report" or JUDGE != "duckdb" or not all(
        sql_judge.can_judge(load_suite(t)) for t in SUITES)
