"""Reading the warehouse for a run's report: the run's rows (``runs`` with its duration and
failed fetches; ``NoRuns`` / ``RunNotFound`` when there is none), its own sections (rejected
inputs, fetch failures, expectations, quarantine), the activation statistics over what it loaded
and the runs' trend, gathered into the context the page's template is rendered with.

``report.py`` writes the page from it; ``charts.py`` draws its charts (and bins what they draw).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import duckdb

from ..lake import runstate
from ..lake import warehouse as warehouse_mod
from ..lake.sqltext import rows  # (values written in: the short form needs no pandas)
from ..names import BadRunId, check_run_id
from .charts import _TREND_RUNS, _chat_pairs, _histogram
from .verdict import VERDICT_RULES, verdict

__all__ = ["NoRuns", "RunNotFound", "recent_runs", "changed_nothing"]

_MAX_ROWS_PER_GROUP = 50  # rejected inputs or quarantined records listed per reason / check
_TOP_FEATURES = 15
_NEURONPEDIA = "https://www.neuronpedia.org"


class NoRuns(LookupError):
    "The warehouse has no runs yet: run `featurehouse ingest` first."


class RunNotFound(LookupError):
    "No run with that id in the warehouse."


def _by_number(col: str) -> str:
    """ORDER BY terms for the text column ``col`` that put its last number in numeric order:
    ``.../9`` before ``.../10`` (a feature key, a URL, ``batch-10.jsonl.gz``), as a person reads
    them. Needs ``_tail`` beside ``col``: ``regexp_extract(col, '[0-9]+[^0-9]*$')``, its last
    number and what follows it (one regex a row: a whole source's 262,144 lost URLs sort in
    ~0.2 s on two cores, where a key of every number in the text took 2.5 s)."""
    return (f"left({col}, length({col}) - length(_tail)), length(regexp_extract(_tail, '^[0-9]*')), "
            f"_tail, {col}")


def _natural_key(text: str | None) -> list[tuple[int, int | str]]:
    """A sort key for text with each run of digits compared as a number: the rows of a table
    chosen by ``_by_number`` are shown in this order."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.findall(r"[0-9]+|[^0-9]+", text or "")]


def _reason_kind(reason: str) -> str:
    """A rejection reason with its specifics (quoted text, numbers) blanked, for grouping."""
    kind = re.sub(r"\([^()]*\)", "(…)", reason or "")
    kind = re.sub(r"'[^']*'|\"[^\"]*\"", "…", kind)
    return re.sub(r"\d[\d,.]*", "N", kind)


_KEY_FIELDS = ("id", "modelId", "layer", "index", "dataSource", "dataIndex", "maxValue",
               "maxValueTokenIndex", "minValue", "description", "explanationModelName", "frac_nonzero",
               "maxActApprox")


def _key_fields(record_json: str | None) -> list[tuple[str, str]]:
    """The identifying scalars of a quarantined record, and the length of each of its lists."""
    try:
        rec = json.loads(record_json) if record_json else {}
    except ValueError:
        return []
    if not isinstance(rec, dict):
        return []
    out = []
    for k in _KEY_FIELDS:
        v = rec.get(k)
        if v is not None and not isinstance(v, (list, dict)):
            s = str(v)
            out.append((k, s if len(s) <= 60 else s[:57] + "…"))
    for k, v in rec.items():
        if isinstance(v, list) and v:
            out.append((k, f"{len(v):,} items"))
    return out


#: What the statistics section reads, copied once from the lake for the features in scope: its
#: six queries read these temp tables, not the lake's tables again and again (each read of a
#: lake table lists its files in the catalog and opens them: ~10-20 ms, and more files after
#: many small runs). Named apart for each report (a caller's own temp tables are never touched)
#: and dropped once the section is gathered.
_SCOPED = {
    "stats": "SELECT * FROM feature_activation_stats SEMI JOIN {scope} USING (model_id, source_id, feature_index)",
    "features": """SELECT model_id, source_id, feature_index, frac_nonzero
                   FROM features SEMI JOIN {scope} USING (model_id, source_id, feature_index)""",
    "explanations": """SELECT model_id, source_id, feature_index, string_agg(DISTINCT description, ' · ') AS explanation
                       FROM explanations SEMI JOIN {scope} USING (model_id, source_id, feature_index)
                       GROUP BY ALL""",
}


def _run_scope(conn: duckdb.DuckDBPyConnection, run_id: str, t: dict[str, str]) -> str:
    """Fill the temp table ``t["scope"]`` with the features a report's statistics cover (and
    ``t[...]`` of ``_SCOPED`` with what the section reads of them); returns a label for it.

    The features the run loaded; when it loaded none (it refused its inputs, or failed), the
    whole warehouse. (A run that changed nothing gets the short form, which reads neither.)
    """
    rid = warehouse_mod.literal(run_id)
    run_sql = f"""SELECT model_id, source_id, feature_index FROM features WHERE run_id = {rid}
                  UNION SELECT model_id, source_id, feature_index FROM activations WHERE run_id = {rid}"""
    conn.execute(f"CREATE TEMP TABLE {t['scope']} AS {run_sql}")
    (n,) = conn.execute(f"SELECT count(*) FROM {t['scope']}").fetchone()
    label = f"the {n:,} feature(s) this run loaded"
    if not n:
        all_sql = """SELECT model_id, source_id, feature_index FROM features
                     UNION SELECT model_id, source_id, feature_index FROM feature_activation_stats"""
        conn.execute(f"CREATE OR REPLACE TEMP TABLE {t['scope']} AS {all_sql}")
        (n,) = conn.execute(f"SELECT count(*) FROM {t['scope']}").fetchone()
        label = f"this run loaded no features; showing the whole warehouse ({n:,} feature(s))"
    for name, sql in _SCOPED.items():
        conn.execute(f"CREATE TEMP TABLE {t[name]} AS {sql.format(scope=t['scope'])}")
    return label


def _feature_url(f: dict[str, Any]) -> str:
    """The feature's page on Neuronpedia; each part of its key is one path segment, whatever it holds."""
    parts = (f["model_id"], f["source_id"], f["feature_index"])
    return _NEURONPEDIA + "".join("/" + quote(str(p), safe="") for p in parts)


def changed_nothing(run: dict[str, Any]) -> bool:
    """Whether a run (a ``runs`` row) succeeded without loading, rejecting or refusing anything:
    an unchanged re-run, an inbox with nothing new, no inputs at all. Its report is the short
    form: the activation statistics are as the runs before it left them."""
    return run.get("status") == "succeeded" and not any(run.get(k) for k in (
        "n_loaded", "n_reread", "n_rejected", "n_quarantined", "n_features", "n_activations", "n_explanations",
        "n_superseded", "n_expectations", "n_fetch_failed", "n_fetch_not_found"))


def _gather(conn: duckdb.DuckDBPyConnection, run: dict[str, Any]) -> dict[str, Any]:
    """What a run's report shows: its own sections, then the warehouse's statistics over what it
    loaded (or, when it loaded nothing, over the whole warehouse) and the runs' trend."""
    ctx = _gather_run(conn, run)
    _gather_warehouse(conn, run, ctx)
    ctx["trend"] = rows(conn, _TREND_SQL, [run["started_at"], _TREND_RUNS])[::-1]
    return ctx


_TREND_SQL = """
    SELECT run_id, started_at, n_features + n_activations + n_explanations AS rows_loaded,
           n_rejected, n_quarantined, n_received - n_duplicates AS n_new,
           n_features + n_activations + n_explanations + n_quarantined AS n_records,
           100.0 * n_expectations_failed / nullif(n_expectations, 0) AS failure_rate
    FROM runs WHERE started_at <= ? ORDER BY started_at DESC LIMIT ?"""


def _gather_quiet(conn: duckdb.DuckDBPyConnection, run: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The short form's context (see :func:`changed_nothing`): the run's own sections, the
    latest earlier run that loaded something (its report linked when found), and the trend as
    a table.
    Nothing here reads the warehouse's data tables, nothing is drawn: an unchanged re-run's
    report costs the same whatever the warehouse holds."""
    ctx = _gather_run(conn, run)
    last = rows(conn, """
        SELECT run_id, started_at, report_path FROM runs
        WHERE started_at <= ? AND run_id <> ? AND n_loaded > 0
        ORDER BY started_at DESC LIMIT 1""", [run["started_at"], run["run_id"]])
    if last:
        page = _report_page(last[0], out_dir)
        last[0]["href"] = _rel(page, out_dir) if page is not None else None
    ctx["quiet"] = {"last_loaded": last[0] if last else None}
    trend = rows(conn, _TREND_SQL, [run["started_at"], _TREND_RUNS])
    ctx["trend"] = trend[::-1]
    ctx["charts"], ctx["data_docs"] = {}, None
    return ctx


def _report_page(run: dict[str, Any], out_dir: Path) -> Path | None:
    """A run's report: beside the one being written (the warehouse's reports, wherever the
    warehouse has been moved or copied to), else where the run recorded it (an absolute path:
    a relative one was relative to a folder no longer known); None when neither is there."""
    with contextlib.suppress(BadRunId):
        if (page := out_dir / f"{check_run_id(run['run_id'])}.html").exists():
            return page
    stored = Path(run["report_path"]) if run.get("report_path") else None
    return stored if stored is not None and stored.is_absolute() and stored.exists() else None


def _gather_run(conn: duckdb.DuckDBPyConnection, run: dict[str, Any]) -> dict[str, Any]:
    """The run's own sections: rejected inputs, fetch failures, expectations, quarantine."""
    run_id = run["run_id"]
    ctx: dict[str, Any] = {"run": run, "verdict": verdict(run), "rules": VERDICT_RULES}

    rejected = rows(conn, """
        SELECT ri.origin, r.reason, r.landed_path, r.format, r.n_bytes, r.input_sha256
        FROM run_inputs ri JOIN raw_inputs r USING (input_sha256)
        WHERE ri.run_id = ? AND ri.outcome = 'rejected'""", [run_id])
    rejected.sort(key=lambda r: (_natural_key(r["origin"]), r["origin"] or ""))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rejected:
        groups.setdefault(_reason_kind(r["reason"]), []).append(r)
    ctx["rejected_groups"] = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    ctx["n_rejected_listed"] = len(rejected)

    ctx["fetch_failures"] = sorted(rows(conn, f"""
        SELECT url, feature_key, status, attempts, last_error, "window"
        FROM (SELECT *, regexp_extract(url, '[0-9]+[^0-9]*$') AS _tail FROM fetch_failures WHERE run_id = ?)
        ORDER BY status, {_by_number("url")} LIMIT ?""", [run_id, _MAX_ROWS_PER_GROUP]),
        key=lambda f: (f["status"], _natural_key(f["url"]), f["url"]))

    exp = rows(conn, """
        SELECT suite, expectation, any_value(expectation_type) AS expectation_type,
               any_value(kwargs) AS kwargs, bool_and(success) AS success, count(*) AS n_batches,
               sum(element_count) AS element_count, sum(unexpected_count) AS unexpected_count,
               list_distinct(flatten(list(failing_keys))) AS failing_keys, min(rowid) AS pos
        FROM validation_results WHERE run_id = ?
        GROUP BY suite, expectation ORDER BY min(rowid)""", [run_id])
    suites: dict[str, list[dict[str, Any]]] = {}
    for e in exp:
        e["unexpected_percent"] = 100.0 * (e["unexpected_count"] or 0) / e["element_count"] if e["element_count"] else 0.0
        e["failing_keys"] = sorted(e["failing_keys"] or [], key=_natural_key)[:5]
        e["kwargs"] = ", ".join(f"{k}={v}" for k, v in json.loads(e["kwargs"] or "{}").items())
        suites.setdefault(e["suite"], []).append(e)
    ctx["suites"] = [
        {"name": name, "expectations": items, "n_failed": sum(not e["success"] for e in items),
         "records": max((e["element_count"] or 0) for e in items)}
        for name, items in suites.items()
    ]

    quarantine = rows(conn, f"""
        SELECT q.check_name, q.record_kind, q.record_key, q.detail, q.record_json, r.origin,
               count(*) OVER (PARTITION BY q.check_name) AS n_in_check
        FROM (SELECT *, regexp_extract(record_key, '[0-9]+[^0-9]*$') AS _tail FROM quarantine WHERE run_id = ?) q
        LEFT JOIN raw_inputs r USING (input_sha256)
        QUALIFY row_number() OVER (PARTITION BY q.check_name ORDER BY {_by_number("q.record_key")}) <= ?""",
                       [run_id, _MAX_ROWS_PER_GROUP])
    quarantine.sort(key=lambda q: (q["check_name"], _natural_key(q["record_key"]), q["record_key"] or ""))
    qgroups: dict[str, dict[str, Any]] = {}
    for q in quarantine:
        g = qgroups.setdefault(q["check_name"], {"check": q["check_name"], "n": q["n_in_check"], "records": []})
        q["fields"] = _key_fields(q.pop("record_json"))
        g["records"].append(q)
    ctx["quarantine_groups"] = sorted(qgroups.values(), key=lambda g: (-g["n"], g["check"]))
    ctx["n_quarantine_rows"] = warehouse_mod.execute(
        conn, "SELECT count(*) FROM quarantine WHERE run_id = ?", [run_id]).fetchone()[0]
    return ctx


def _gather_warehouse(conn: duckdb.DuckDBPyConnection, run: dict[str, Any], ctx: dict[str, Any]) -> None:
    """The activation statistics section: over the features the run loaded, else the warehouse."""
    tag = uuid.uuid4().hex[:12]
    t = {name: f"_report_{name}_{tag}" for name in ("scope", *_SCOPED)}
    try:
        ctx["scope_label"] = _run_scope(conn, run["run_id"], t)
        _statistics(conn, ctx, t)
    finally:
        for name in t.values():
            conn.execute(f"DROP TABLE IF EXISTS temp.{name}")


def _statistics(conn: duckdb.DuckDBPyConnection, ctx: dict[str, Any], t: dict[str, str]) -> None:
    ctx["sources"] = rows(conn, f"""
        SELECT model_id, source_id, coalesce(data_source, '(none)') AS data_source,
               count(*) AS n_features, sum(n_examples) AS n_examples,
               sum(n_active_tokens) / nullif(sum(n_tokens), 0) AS active_token_fraction,
               max(max_activation) AS max_activation, median(max_activation) AS median_max_activation
        FROM {t['stats']}
        GROUP BY ALL ORDER BY model_id, source_id, data_source""")
    ctx["hist_max_activation"], ctx["hidden_sources"] = _histogram(conn, f"""
        SELECT model_id || ' / ' || source_id AS source, coalesce(data_source, '(none)') AS data_source,
               max_activation AS x
        FROM {t['stats']}""")
    ctx["hist_frac_nonzero"], _ = _histogram(conn, f"""
        SELECT model_id || ' / ' || source_id AS source, '' AS data_source, frac_nonzero AS x
        FROM {t['features']} WHERE frac_nonzero > 0""", log=True)
    ctx["n_frac_zero"] = conn.execute(f"SELECT count(*) FROM {t['features']} WHERE frac_nonzero <= 0").fetchone()[0]
    ctx["top_features"] = rows(conn, f"""
        WITH best AS (
            SELECT model_id, source_id, feature_index,
                   arg_max(coalesce(data_source, '(none)'), max_activation) AS data_source,
                   arg_max(top_tokens, max_activation) AS top_tokens,
                   max(max_activation) AS max_activation, sum(n_examples) AS n_examples
            FROM {t['stats']}
            WHERE max_activation IS NOT NULL
            GROUP BY ALL ORDER BY max_activation DESC, model_id, source_id, feature_index LIMIT {_TOP_FEATURES})
        SELECT b.*, e.explanation, f.frac_nonzero
        FROM best b LEFT JOIN {t['explanations']} e USING (model_id, source_id, feature_index)
        LEFT JOIN {t['features']} f USING (model_id, source_id, feature_index)
        ORDER BY b.max_activation DESC, model_id, source_id, feature_index""")
    for f in ctx["top_features"]:
        f["url"] = _feature_url(f)
        f["tokens"] = [tok["token"] for tok in (f["top_tokens"] or [])[:6]]
    ctx["chat_pairs"] = _chat_pairs(conn, t["stats"])
    ctx["chat_extremes"] = rows(conn, f"""
        WITH pairs AS (
            SELECT c.model_id, c.source_id, c.feature_index, c.max_activation AS chat_max,
                   n.max_activation AS non_chat_max,
                   ln(greatest(c.max_activation, 1e-6) / greatest(n.max_activation, 1e-6)) AS log_ratio
            FROM {t['stats']} c JOIN {t['stats']} n USING (model_id, source_id, feature_index)
            WHERE c.data_source = 'Chat' AND n.data_source = 'Non-Chat'),
        ranked AS (
            SELECT *, 'more active on Chat' AS side, row_number() OVER (ORDER BY log_ratio DESC, model_id, source_id, feature_index) AS rk FROM pairs WHERE log_ratio > 0
            UNION ALL
            SELECT *, 'more active on Non-Chat', row_number() OVER (ORDER BY log_ratio, model_id, source_id, feature_index) FROM pairs WHERE log_ratio < 0)
        SELECT r.*, exp(abs(log_ratio)) AS ratio, e.explanation
        FROM ranked r LEFT JOIN {t['explanations']} e USING (model_id, source_id, feature_index)
        WHERE rk <= 5 ORDER BY side, rk""")
    for f in ctx["chat_extremes"]:
        f["url"] = _feature_url(f)


# --- the runs ----------------------------------------------------------------------------------

#: Columns added to a ``runs`` row for the report: its duration and its failed fetches.
_RUN_EXTRA = """epoch(finished_at - started_at) AS seconds,
    (SELECT count(*) FROM fetch_failures f WHERE f.run_id = runs.run_id AND f.status = 'failed') AS n_fetch_failed,
    (SELECT count(*) FROM fetch_failures f WHERE f.run_id = runs.run_id AND f.status = 'not_found') AS n_fetch_not_found"""


def _runs(conn: duckdb.DuckDBPyConnection, tail: str, params: Any = None) -> list[dict[str, Any]]:
    """``runs`` rows with ``_RUN_EXTRA``, a run whose process is gone shown as abandoned (on
    read: nothing is written)."""
    runs = rows(conn, f"SELECT *, {_RUN_EXTRA} FROM runs {tail}", params)
    return runstate.apply(runs, runstate.find_abandoned(conn))


def recent_runs(conn: duckdb.DuckDBPyConnection, limit: int = 10) -> list[dict[str, Any]]:
    """The latest ``limit`` runs, newest first: every ``runs`` column, with ``status``
    'abandoned' for a run whose process is gone (see ``runstate``), and ``seconds``,
    ``n_fetch_failed``, ``n_fetch_not_found`` and ``verdict`` (a :class:`Verdict`)."""
    return [{**r, "verdict": verdict(r)} for r in _runs(conn, "ORDER BY started_at DESC LIMIT ?", [int(limit)])]


def _run_row(conn: duckdb.DuckDBPyConnection, run_id: str | None) -> dict[str, Any]:
    found = _runs(conn, "WHERE run_id = ?" if run_id else "ORDER BY started_at DESC LIMIT 1",
                  [run_id] if run_id else None)
    if found:
        return found[0]
    if run_id:
        raise RunNotFound(f"no run {run_id!r} in the warehouse (see `featurehouse status`)")
    raise NoRuns("the warehouse has no runs yet: run `featurehouse ingest` first")


def _rel(target: Path, start: Path) -> str:
    try:
        return Path(os.path.relpath(target.resolve(), start.resolve())).as_posix()
    except ValueError:  # another drive: fall back to an absolute link
        return target.resolve().as_uri()
