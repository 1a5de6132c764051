"""Report stage: one self-contained HTML page per run, and an index of runs.

``write_report`` reads what a run did from the warehouse (``runs``, ``run_inputs``,
``raw_inputs``, ``validation_results``, ``quarantine`` and the activation statistics tables) and
writes ``<reports dir>/<run_id>.html`` plus ``<reports dir>/index.html``. The page needs no
network: its CSS is inline and its charts are Vega-Lite (built with Altair) rendered to inline
SVG by vl-convert. It also builds Great Expectations' Data Docs for the run (file data context
under ``<warehouse dir>/gx/``) and links to them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import duckdb

from ..config import Settings
from ..lake import runstate
from ..lake import warehouse as warehouse_mod
from ..lake.landing import disk_full
from ..names import BadRunId, check_run_id
from ..stages import validate
from . import draw
from .text import density, rounded, visible_token

__all__ = ["VERDICT_RULES", "Verdict", "verdict", "out_of", "recent_runs", "write_report", "report_run", "NoRuns",
           "RunNotFound", "warm_charts"]

log = logging.getLogger("featurehouse")

_TEMPLATES = Path(__file__).resolve().parent / "templates"
_TREND_RUNS = 30
_MAX_ROWS_PER_GROUP = 50  # rejected inputs or quarantined records listed per reason / check
_TOP_FEATURES = 15
_MAX_SOURCES_CHARTED = 8
_NEURONPEDIA = "https://www.neuronpedia.org"


class NoRuns(LookupError):
    "The warehouse has no runs yet: run `featurehouse ingest` first."


class RunNotFound(LookupError):
    "No run with that id in the warehouse."


# --- the verdict --------------------------------------------------------------------------------

#: (verdict, condition), checked in order; the first that holds decides. "New inputs" are the
#: inputs the run received minus those already landed by an earlier run.
VERDICT_RULES: tuple[tuple[str, str], ...] = (
    ("FAIL", "the run did not finish successfully (status is not 'succeeded')"),
    ("FAIL", "the run received new inputs but loaded none of them"),
    ("FAIL", "more than half of the new inputs were rejected"),
    ("FAIL", "its fetch failed wholly or mostly: every URL it fetched, or half of them or more, "
             "failed after its retries (fetch_failures)"),
    ("WARN", "an input was rejected, a record was quarantined, an expectation failed, "
             "or a URL could not be fetched"),
    ("PASS", "none of the above: everything new loaded and every expectation held"),
)


@dataclass(frozen=True)
class Verdict:
    """PASS, WARN or FAIL for one run, and why."""

    level: str
    rule: int
    """Index into ``VERDICT_RULES`` of the rule that decided."""
    reason: str
    """The deciding rule applied to this run's numbers, in words."""


def out_of(run: dict[str, Any]) -> dict[str, int]:
    """What each failure count of a run (a ``runs`` row, with ``n_fetch_failed``) is out of, by
    the count's key: rejected inputs of the inputs not already landed, URLs that failed to fetch
    of the URLs fetched (each that landed is an input received; a 404 is neither), failed
    expectation results of all, quarantined records of every record read (loaded or refused)."""
    n = {k: int(run.get(k) or 0) for k in (
        "n_received", "n_duplicates", "n_fetch_failed", "n_expectations", "n_features", "n_activations",
        "n_explanations", "n_quarantined")}
    return {"n_rejected": n["n_received"] - n["n_duplicates"], "n_fetch_failed": n["n_fetch_failed"] + n["n_received"],
            "n_expectations_failed": n["n_expectations"],
            "n_quarantined": n["n_features"] + n["n_activations"] + n["n_explanations"] + n["n_quarantined"]}


def verdict(run: dict[str, Any]) -> Verdict:
    """Judge a run (a ``runs`` row as a dict) by ``VERDICT_RULES``."""
    n = {k: int(run.get(k) or 0) for k in
         ("n_received", "n_duplicates", "n_loaded", "n_rejected", "n_quarantined", "n_expectations_failed",
          "n_fetch_failed")}
    of = out_of(run)
    new = of["n_rejected"]
    if run.get("status") != "succeeded":
        err = f": {run['error']}" if run.get("error") else ""
        return Verdict("FAIL", 0, f"the run's status is '{run.get('status')}'{err}")
    if new > 0 and n["n_loaded"] == 0:
        return Verdict("FAIL", 1, f"{new:,} input(s) not already landed received, none loaded")
    if new > 0 and n["n_rejected"] / new > 0.5:
        return Verdict("FAIL", 2, f"{n['n_rejected']:,} of {new:,} inputs not already landed rejected "
                                  f"({100 * n['n_rejected'] / new:.0f}% > 50%)")
    fetched = of["n_fetch_failed"]
    if n["n_fetch_failed"] and n["n_fetch_failed"] / fetched >= 0.5:  # half a night lost is no pass
        share = ("all" if n["n_fetch_failed"] == fetched else f"{100 * n['n_fetch_failed'] / fetched:.0f}%")
        return Verdict("FAIL", 3, f"{n['n_fetch_failed']:,} of {fetched:,} URL(s) failed to fetch ({share}), "
                                  "see Fetch failures")
    # each count with what it is out of ("50 of 100 URL(s)"): one quarantined record and half a
    # night's URLs lost must not read alike
    problems = [f"{n[k]:,}{f' of {of[k]:,}' if of[k] else ''} {what}" for k, what in (
        ("n_rejected", "input(s) rejected"), ("n_quarantined", "record(s) quarantined"),
        ("n_expectations_failed", "expectation result(s) failed"),
        ("n_fetch_failed", "URL(s) failed to fetch")) if n[k]]
    if problems:
        return Verdict("WARN", 4, ", ".join(problems))
    if new == 0:
        return Verdict("PASS", 5, "nothing new to load: every input was already landed" if n["n_received"]
                       else "the run received no inputs")
    return Verdict("PASS", 5, f"{n['n_loaded']:,} of {new:,} inputs not already landed loaded, no record refused")


# --- reading the warehouse ----------------------------------------------------------------------

def _rows(conn: duckdb.DuckDBPyConnection, sql: str, params: Any = None) -> list[dict[str, Any]]:
    cur = warehouse_mod.execute(conn, sql, params)  # values written in: the short form needs no pandas
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


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
    ctx["trend"] = conn.execute(_TREND_SQL, [run["started_at"], _TREND_RUNS]).df().iloc[::-1].reset_index(drop=True)
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
    last = _rows(conn, """
        SELECT run_id, started_at, report_path FROM runs
        WHERE started_at <= ? AND run_id <> ? AND n_loaded > 0
        ORDER BY started_at DESC LIMIT 1""", [run["started_at"], run["run_id"]])
    if last:
        page = _report_page(last[0], out_dir)
        last[0]["href"] = _rel(page, out_dir) if page is not None else None
    ctx["quiet"] = {"last_loaded": last[0] if last else None}
    trend = _rows(conn, _TREND_SQL, [run["started_at"], _TREND_RUNS])
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

    rejected = _rows(conn, """
        SELECT ri.origin, r.reason, r.landed_path, r.format, r.n_bytes, r.input_sha256
        FROM run_inputs ri JOIN raw_inputs r USING (input_sha256)
        WHERE ri.run_id = ? AND ri.outcome = 'rejected'""", [run_id])
    rejected.sort(key=lambda r: (_natural_key(r["origin"]), r["origin"] or ""))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rejected:
        groups.setdefault(_reason_kind(r["reason"]), []).append(r)
    ctx["rejected_groups"] = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    ctx["n_rejected_listed"] = len(rejected)

    ctx["fetch_failures"] = sorted(_rows(conn, f"""
        SELECT url, feature_key, status, attempts, last_error, "window"
        FROM (SELECT *, regexp_extract(url, '[0-9]+[^0-9]*$') AS _tail FROM fetch_failures WHERE run_id = ?)
        ORDER BY status, {_by_number("url")} LIMIT ?""", [run_id, _MAX_ROWS_PER_GROUP]),
        key=lambda f: (f["status"], _natural_key(f["url"]), f["url"]))

    exp = _rows(conn, """
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

    quarantine = _rows(conn, f"""
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
    ctx["sources"] = _rows(conn, f"""
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
    ctx["top_features"] = _rows(conn, f"""
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
    ctx["chat_extremes"] = _rows(conn, f"""
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


# --- charts ---------------------------------------------------------------------------------------

_FONT = "Inter, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"
_DS_COLORS = {"Chat": "#4c78a8", "Non-Chat": "#f58518", "(none)": "#9d9d9d"}


@functools.lru_cache(maxsize=1)
def _alt():
    with validate.heavy_imports():  # only when a report is drawn
        import altair as alt

    # Altair validates every object against the Vega-Lite schema as it is built (its "debug
    # mode"): ~1 s of jsonschema a report, for charts this module builds the same way every time
    # (tests/test_report.py draws each; vl-convert refuses a spec that is wrong)
    alt.utils.schemapi.disable_debug_mode()
    return alt


def _theme(chart):
    return chart.configure(font=_FONT, background="white").configure_view(stroke="#e5e7eb").configure_axis(
        labelColor="#374151", titleColor="#374151", gridColor="#eef0f3", domainColor="#9ca3af",
        titleFontWeight=500, labelFontSize=11, titleFontSize=11, labelOverlap="greedy",
    ).configure_header(labelFontSize=11, titleFontSize=11, labelColor="#111827").configure_legend(
        labelFontSize=11, titleFontSize=11, orient="top")


_counter = itertools.count()

def warm_charts() -> None:
    """Start the chart renderer (a child process, see ``draw.py``: ~0.4 s of one core there for
    its JavaScript engine) so that the first real chart does not wait for it, and import Altair.
    ``ingest`` calls it while its last batch loads. Raises ``draw.DrawerUnavailable`` when the
    renderer cannot start (the report then says its charts are not drawn)."""
    draw.start()
    _alt()


def _svg_cached(chart, cache: Path | None = None) -> str:
    """Render an Altair chart to SVG, with its element ids made unique within the page.

    With ``cache`` (a folder), a chart whose Vega-Lite spec (its data included) was drawn before
    is read back instead of drawn again: an unchanged warehouse redraws nothing but its trend.
    """
    spec = _xml_safe(_theme(chart).to_dict(validate=False))  # (the module's own charts: see _alt)
    svg = None
    if cache is not None:
        key = hashlib.sha256(json.dumps([draw.renderer_version(), spec], sort_keys=True, default=str).encode()).hexdigest()
        hit = cache / f"{key}.svg"
        try:
            svg = hit.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            pass
        else:
            if _whole_svg(svg):
                with contextlib.suppress(OSError):
                    os.utime(hit)  # the cache keeps the newest used: a chart read back stays
            else:  # cut short (a crash, a full disk) or emptied: drawn again, and replaced
                log.warning("chart cache entry %s is damaged; drawing the chart again", hit)
                svg = None
    if svg is None:
        svg = draw.draw_svg(spec)
        if cache is not None:
            _cache_put(cache, hit, svg)
    prefix = f"c{next(_counter)}-"
    svg = re.sub(r'id="([^"]+)"', lambda m: f'id="{prefix}{m.group(1)}"', svg)
    svg = re.sub(r'url\(#([^)]+)\)', lambda m: f"url(#{prefix}{m.group(1)})", svg)
    svg = re.sub(r'href="#([^"]+)"', lambda m: f'href="#{prefix}{m.group(1)}"', svg)
    svg = svg.replace("<svg ", '<svg role="img" ', 1)
    return svg


#: Characters XML 1.0 does not allow (C0 controls but tab, newline and return; U+FFFE, U+FFFF;
#: lone surrogates): vl-convert draws the SVG as XML and panics, aborting the process, on one of
#: them in a label (a description holding ESC, say).
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff\ud800-\udfff]")


def _xml_safe(value: Any) -> Any:
    """``value`` (a chart's spec) with each character XML does not allow written as its escape
    (``\\x1b``), as the terminal output shows it."""
    if isinstance(value, str):
        from .find import printable  # one way of writing a character as its escape

        return printable(value, _NOT_XML)
    if isinstance(value, dict):
        return {_xml_safe(k): _xml_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_xml_safe(v) for v in value]
    return value


def _whole_svg(text: str) -> bool:
    """A drawn chart as vl-convert writes it: one <svg> element, closed (an unclosed one would
    swallow the rest of the page)."""
    text = text.strip()
    return text.startswith("<svg") and text.endswith("</svg>") and text.count("<svg") == text.count("</svg>")


_CHART_CACHE_KEEP = 64  # drawn charts kept in <reports>/.charts/, newest first


def _cache_put(cache: Path, path: Path, svg: str) -> None:
    """Keep a drawn chart (best effort: a report never fails for its cache)."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, svg)
        old = sorted(cache.glob("*.svg"), key=lambda p: p.stat().st_mtime, reverse=True)[_CHART_CACHE_KEEP:]
        # and what a writer killed between writing and renaming left behind
        old += [p for p in cache.glob(".*.tmp") if time.time() - p.stat().st_mtime > 3600]
        for p in old:
            p.unlink(missing_ok=True)
    except OSError as exc:
        log.debug("chart cache %s not written: %s", cache, exc)


def _histogram(conn: duckdb.DuckDBPyConnection, values_sql: str, bins: int = 24, log: bool = False):
    """Counts per equal-width bin, computed by DuckDB so that a chart's size and cost do not grow
    with the number of features (a whole source has 262,144). ``values_sql`` gives ``source``,
    ``data_source`` and ``x``; the bins are shared across the data sources of one source, over
    the ``_MAX_SOURCES_CHARTED`` sources with the most rows. ``log``: bins of log10(x), x > 0.
    Returns (the bins as a DataFrame: source, data_source, start, end, count; how many sources
    were left out)."""
    x = "log10(x)" if log else "x"
    pad = "0.25" if log else "greatest(abs(lo) * 0.05, 0.5)"
    edge = (lambda e: f"pow(10, {e})") if log else (lambda e: e)
    df = conn.execute(f"""
        WITH v AS (SELECT source, data_source, {x}::DOUBLE AS x FROM ({values_sql})
                   WHERE x IS NOT NULL AND isfinite(x::DOUBLE){' AND x > 0' if log else ''}),
        top AS (SELECT source FROM v GROUP BY source ORDER BY count(*) DESC, source LIMIT {_MAX_SOURCES_CHARTED}),
        r AS (SELECT source, min(x) AS lo, max(x) AS hi FROM v SEMI JOIN top USING (source) GROUP BY source),
        w AS (SELECT source, CASE WHEN hi - lo < 1e-9 THEN lo - {pad} ELSE lo END AS lo,
                     CASE WHEN hi - lo < 1e-9 THEN hi + {pad} ELSE hi END AS hi FROM r),
        b AS (SELECT source, data_source, lo, (hi - lo) / {bins} AS width,
                     least(greatest(floor((x - lo) / ((hi - lo) / {bins})), 0), {bins - 1})::INTEGER AS bin
              FROM v JOIN w USING (source))
        SELECT source, data_source, {edge('lo + bin * width')} AS start, {edge('lo + (bin + 1) * width')} AS "end",
               count(*) AS count
        FROM b GROUP BY source, data_source, lo, width, bin ORDER BY source, data_source, bin""").df()
    hidden = conn.execute(f"SELECT greatest(count(DISTINCT source) - {_MAX_SOURCES_CHARTED}, 0) FROM ({values_sql}) "
                          "WHERE x IS NOT NULL").fetchone()[0]
    return df, int(hidden)


#: Up to this many features the Chat vs Non-Chat chart draws a point each; past it, counts per
#: cell of a grid (a whole source: 262,144 points would make a page of tens of MB).
_SCATTER_POINTS = 2000
_SCATTER_CELLS = 40


def _chat_pairs(conn: duckdb.DuckDBPyConnection, stats: str) -> dict[str, Any]:
    """The features with both a Chat and a Non-Chat maximum: their points, or (past
    ``_SCATTER_POINTS``) how many fall in each cell of a ``_SCATTER_CELLS``-square grid."""
    pairs = f"""
        SELECT c.max_activation::DOUBLE AS chat_max, n.max_activation::DOUBLE AS non_chat_max
        FROM {stats} c JOIN {stats} n USING (model_id, source_id, feature_index)
        WHERE c.data_source = 'Chat' AND n.data_source = 'Non-Chat'
          AND isfinite(c.max_activation::DOUBLE) AND isfinite(n.max_activation::DOUBLE)"""
    n, hi = conn.execute(f"SELECT count(*), greatest(max(chat_max), max(non_chat_max), 0) FROM ({pairs})").fetchone()
    hi = float(hi or 0)
    hi = (hi * 1.05 if math.isfinite(hi * 1.05) else hi) or 1.0  # (1.75e308 * 1.05 is no number)
    if n <= _SCATTER_POINTS:
        return {"n": n, "hi": hi, "points": conn.execute(pairs).df(), "cells": None}
    k, step = _SCATTER_CELLS, hi / _SCATTER_CELLS
    cells = conn.execute(f"""
        SELECT least(floor(non_chat_max / {step}), {k - 1})::INTEGER AS cx,
               least(floor(chat_max / {step}), {k - 1})::INTEGER AS cy, count(*) AS count
        FROM ({pairs}) GROUP BY ALL ORDER BY ALL""").df()  # in order: the same spec, the chart cache's hit
    cells = cells.assign(x0=cells["cx"] * step, x1=(cells["cx"] + 1) * step,
                         y0=cells["cy"] * step, y1=(cells["cy"] + 1) * step)
    return {"n": n, "hi": hi, "points": None, "cells": cells}


def _ds_scale(alt, values):
    domain = sorted(values, key=lambda v: (v not in _DS_COLORS, list(_DS_COLORS).index(v) if v in _DS_COLORS else 0, v))
    palette = ["#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b"]
    rng = [_DS_COLORS.get(v) or palette[i % len(palette)] for i, v in enumerate(domain)]
    return alt.Scale(domain=domain, range=rng)


def _charts(ctx: dict[str, Any], cache: Path | None = None) -> dict[str, Any]:
    """The report's charts as SVG. A chart that cannot be built or drawn is left out, and said
    (``charts["not_drawn"]``): the report is written all the same. When the renderer cannot draw
    at all (see ``draw.py``), no chart is tried after it."""
    charts: dict[str, Any] = {"not_drawn": []}
    try:
        _draw_charts(ctx, charts, cache)
    except draw.DrawerUnavailable as exc:
        log.warning("the report's charts are not drawn: %s", exc)
        charts["unavailable"] = str(exc)
    return charts


def _draw_charts(ctx: dict[str, Any], charts: dict[str, Any], cache: Path | None) -> None:
    alt = _alt()

    def chart(name: str, build) -> None:
        try:
            charts[name] = build()
        except draw.DrawerUnavailable:
            raise
        except Exception as exc:  # one chart's failure: said on the page, the others drawn
            log.warning("the report's %s chart is not drawn: %s", name, str(exc).splitlines()[0][:300])
            charts["not_drawn"].append({"chart": name, "why": str(exc).splitlines()[0][:300]})

    def _svg(c) -> str:
        return _svg_cached(c, cache)

    h = ctx["hist_max_activation"]
    if len(h):
        n_ds, one = h["data_source"].nunique(), h["source"].nunique() == 1
        # one source: its name heads the chart, each panel is named by its data source alone
        h = h.assign(panel=h["data_source"] if one else h["source"] + "  ·  " + h["data_source"])
        chart("max_activation", lambda: _svg(
            alt.Chart(h).mark_bar(stroke="white", strokeWidth=0.5).encode(
                x=alt.X("start:Q", title="feature max activation", scale=alt.Scale(zero=False),
                        axis=alt.Axis(tickCount=5)),  # vl-convert ignores labelOverlap: few enough not to touch
                x2="end:Q",
                y=alt.Y("count:Q", title="features", axis=alt.Axis(values=_int_ticks(h["count"].max()), format="d")),
                y2=alt.datum(0),
                color=alt.Color("data_source:N", title="data source", scale=_ds_scale(alt, h["data_source"].unique()),
                                legend=None),
            ).properties(width=250 if n_ds > 2 else 320, height=110).facet(
                facet=alt.Facet("panel:N", title=h["source"].iloc[0] if one else None,
                                header=alt.Header(labelFontWeight="bold", labelAnchor="start", labelFontSize=11.5,
                                                  labelLimit=250 if n_ds > 2 else 320, titleFontSize=11.5,
                                                  titleAnchor="start", titleFontWeight="normal")),
                columns=min(n_ds, 3), spacing={"row": 14, "column": 22},
            ).resolve_scale(x="independent", y="independent")  # each source's own range: a small one is not flattened
        ))
        charts["hidden_sources"] = ctx["hidden_sources"]
    h = ctx["hist_frac_nonzero"]
    if len(h):
        chart("frac_nonzero", lambda: _svg(
            alt.Chart(h).mark_bar(color="#54a24b", stroke="white", strokeWidth=0.5).encode(
                # a percentage of tokens, as the tables write it (review: "frac_nonzero", 3e-5)
                x=alt.X("start:Q", title="firing density, % of tokens (log scale)", scale=alt.Scale(type="log"),
                        axis=alt.Axis(values=_log_ticks(h), labelExpr="format(datum.value * 100, '.2~r') + '%'")),
                x2="end:Q",
                y=alt.Y("count:Q", title="features", axis=alt.Axis(values=_int_ticks(h["count"].max()), format="d")),
                y2=alt.datum(0),
            ).properties(width=320, height=110).facet(
                facet=alt.Facet("source:N", title=None, header=alt.Header(labelFontWeight="bold", labelAnchor="start",
                                                                           labelFontSize=11.5)),
                columns=1, spacing=14,
            ).resolve_scale(x="independent", y="independent")
        ))
        charts["n_frac_zero"] = ctx["n_frac_zero"]
    cp = ctx["chat_pairs"]
    if cp["n"]:
        hi = cp["hi"]
        diag = alt.Chart(alt.Data(values=[{"v": 0}, {"v": hi}])).mark_line(
            color="#9ca3af", strokeDash=[4, 4]).encode(x="v:Q", y="v:Q")
        x_title, y_title = "max activation on Non-Chat", "max activation on Chat"
        axes = {"scale": alt.Scale(domain=[0, hi], nice=False)}
        if cp["points"] is not None:
            pts = alt.Chart(cp["points"]).mark_circle(size=46, opacity=0.75, color="#4c78a8", stroke="#1f3b5c",
                                                      strokeWidth=0.6).encode(
                x=alt.X("non_chat_max:Q", title=x_title, **axes), y=alt.Y("chat_max:Q", title=y_title, **axes))
        else:  # a whole source: how many features in each cell, the scale said on the chart
            pts = alt.Chart(cp["cells"]).mark_rect().encode(
                x=alt.X("x0:Q", title=x_title, **axes), x2="x1:Q",
                y=alt.Y("y0:Q", title=y_title, **axes), y2="y1:Q",
                color=alt.Color("count:Q", title="features", scale=alt.Scale(type="log", scheme="blues")),
            )
            charts["chat_cells"] = {"n": cp["n"], "k": _SCATTER_CELLS}
        chart("chat_vs_non_chat", lambda: _svg((pts + diag).properties(width=300, height=300)))
    tf = ctx["top_features"]
    if tf:
        import pandas as pd

        rows = [{"label": f"#{f['feature_index']}  {_short(f['explanation'] or '(no explanation)', 38)}",
                 "source": f"{f['source_id']}", "max_activation": f["max_activation"],
                 "data_source": f["data_source"], "rank": i} for i, f in enumerate(tf)]
        df = pd.DataFrame(rows)
        chart("top_features", lambda: _svg(
            alt.Chart(df).mark_bar(height={"band": 0.75}).encode(
                y=alt.Y("label:N", sort=alt.EncodingSortField("rank"), title=None,
                        axis=alt.Axis(labelLimit=330, labelFontSize=11)),
                x=alt.X("max_activation:Q", title="max activation", axis=alt.Axis(tickCount=4, format="~s")),
                color=alt.Color("data_source:N", title="strongest on", scale=_ds_scale(alt, df["data_source"].unique())),
            ).properties(width=380, height=alt.Step(18),
                         # the browser's font sets the labels wider than vl-convert measured them
                         padding={"left": 48, "top": 5, "right": 5, "bottom": 5})
        ))
    tr = ctx["trend"]
    if len(tr):
        import pandas as pd

        tr = tr.assign(order=range(_TREND_RUNS - len(tr), _TREND_RUNS), is_this=tr["run_id"] == ctx["run"]["run_id"],
                       label=[f"{t:%m-%d %H:%M}" for t in tr["started_at"]])
        metrics = [("rows_loaded", "rows loaded", "~s"), ("n_rejected", "inputs rejected", "d"),
                   ("n_quarantined", "records quarantined", "d"), ("failure_rate", "expectation failure rate %", ".1f")]
        panels = []
        for col, title, fmt in metrics:
            d = tr[["order", "label", "is_this", "run_id"]].assign(value=pd.to_numeric(tr[col], errors="coerce").fillna(0))
            top = float(d["value"].max())
            if fmt == "d":
                ticks = _int_ticks(top, 3)
                axis, scale = alt.Axis(format=fmt, values=ticks), alt.Scale(domain=[0, ticks[-1]])
            else:
                axis, scale = alt.Axis(format=fmt, tickCount=3), alt.Scale(domainMin=0, domainMax=max(top, 1.0), nice=True)
            panel = alt.Chart(d).mark_bar(width={"band": 0.8}).encode(
                x=alt.X("order:O", scale=alt.Scale(domain=list(range(_TREND_RUNS))),
                        axis=alt.Axis(labels=False, ticks=False, title=f"last {_TREND_RUNS} runs, oldest → newest")),
                y=alt.Y("value:Q", title=None, scale=scale, axis=axis),
                color=alt.condition("datum.is_this", alt.value("#1f2937"), alt.value("#a5b4c8")),
            ).properties(width=190, height=80)
            panels.append({"title": title, "chart": panel})
        chart("trend", lambda: [{"title": p["title"], "svg": _svg(p["chart"])} for p in panels])


def _log_ticks(h) -> list[float]:
    """Ticks for a log axis over the bins ``h`` (start, end): the powers of ten inside, and 2x
    and 5x them when there are few (vl-convert draws every tick label Vega gives, overlapping)."""
    lo, hi = float(h["start"].min()), float(h["end"].max())
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    mults = (1,) if last - first > 3 else (1, 2, 5)
    ticks = [m * 10.0**e for e in range(first, last + 1) for m in mults if lo <= m * 10.0**e <= hi]
    if ticks:
        return ticks
    # none inside: the ends, when far enough apart not to print one over the other (review:
    # "3e-5" over "4e-5" read "34e55"), else the lower
    return [lo, hi] if hi >= 3 * lo else [lo]


def _int_ticks(top: float, most: int = 4) -> list[int]:
    """Whole-number axis ticks from 0 past ``top`` in steps of 1, 2, 5, 10, 20, 50 ...: at most
    about ``most`` steps. (vl-convert's renderer ignores Vega's ``tickMinStep``.)"""
    top = max(int(math.ceil(top or 0)), 1)
    steps = (m * 10**e for e in range(0, 16) for m in (1, 2, 5))
    step = next(st for st in steps if top / st <= most)
    return list(range(0, step * math.ceil(top / step) + 1, step))


def _short(s: str, n: int) -> str:
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[: n - 1] + "…"


# --- writing -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _bytecode_cache():
    """Jinja's cache of compiled templates (its per-user folder in the temp directory), so a
    process does not compile the report's templates again (~0.09 s of each run); None where it
    cannot be had. A cache that cannot be written is passed over, never a report's failure."""
    import jinja2

    class Cache(jinja2.FileSystemBytecodeCache):
        def dump_bytecode(self, bucket) -> None:
            try:
                super().dump_bytecode(bucket)
            except OSError as exc:
                log.debug("compiled template not cached: %s", exc)

    try:
        return Cache()
    except (OSError, RuntimeError) as exc:  # RuntimeError: the folder is not safely this user's
        log.debug("no cache of compiled templates: %s", exc)
        return None


@functools.lru_cache(maxsize=1)
def _env():
    import jinja2

    # Every template is HTML (named *.html.j2, which select_autoescape(["html"]) does not match):
    # escape every value. Page text is text: tokens such as "<!--", "</" and "&" are ordinary.
    # The one thing marked |safe is the charts' SVG, which Vega writes with its text escaped.
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATES)), bytecode_cache=_bytecode_cache(),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True)
    # numbers and tokens written as the feature card and the web app write them (text.py)
    env.filters["num"] = rounded
    env.filters["density"] = density
    env.filters["tok"] = visible_token
    env.filters["pct"] = lambda v, d=1: "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{d}f}%"
    env.filters["when"] = lambda t: "–" if t is None else f"{t:%Y-%m-%d %H:%M:%S} UTC"
    env.filters["bytes"] = _human_bytes
    env.filters["short"] = _short
    env.filters["of"] = _of
    env.filters["soft"] = _soft
    env.globals["out_of"] = out_of
    return env


def _soft(text: Any) -> Any:
    """``text`` (a name such as ``max_value_token_index_not_negative``) that may wrap after each
    ``_``, and only there: a narrow window breaks it between words, not inside one."""
    from markupsafe import Markup, escape

    return Markup("_<wbr>").join(escape(part) for part in str(text).split("_"))


def _of(n: Any, m: Any) -> Any:
    """A count of failures with what it is out of, ``3 of 100`` (``of 100`` in a span the page
    styles); the count alone when there is nothing it is out of (``m`` 0 or None)."""
    from markupsafe import Markup, escape

    if not m:
        return rounded(n)
    return Markup('{} <span class="of">of {}</span>').format(escape(rounded(n)), escape(rounded(m)))


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "–"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{v:,.0f} {unit}" if unit == "B" else f"{v:,.1f} {unit}"
        v /= 1024
    return f"{n} B"


#: Columns added to a ``runs`` row for the report: its duration and its failed fetches.
_RUN_EXTRA = """epoch(finished_at - started_at) AS seconds,
    (SELECT count(*) FROM fetch_failures f WHERE f.run_id = runs.run_id AND f.status = 'failed') AS n_fetch_failed,
    (SELECT count(*) FROM fetch_failures f WHERE f.run_id = runs.run_id AND f.status = 'not_found') AS n_fetch_not_found"""


def _runs(conn: duckdb.DuckDBPyConnection, tail: str, params: Any = None) -> list[dict[str, Any]]:
    """``runs`` rows with ``_RUN_EXTRA``, a run whose process is gone shown as abandoned (on
    read: nothing is written)."""
    rows = _rows(conn, f"SELECT *, {_RUN_EXTRA} FROM runs {tail}", params)
    return runstate.apply(rows, runstate.find_abandoned(conn))


def recent_runs(conn: duckdb.DuckDBPyConnection, limit: int = 10) -> list[dict[str, Any]]:
    """The latest ``limit`` runs, newest first: every ``runs`` column, with ``status``
    'abandoned' for a run whose process is gone (see ``runstate``), and ``seconds``,
    ``n_fetch_failed``, ``n_fetch_not_found`` and ``verdict`` (a :class:`Verdict`)."""
    rows = _runs(conn, "ORDER BY started_at DESC LIMIT ?", [int(limit)])
    return [{**r, "verdict": verdict(r)} for r in rows]


def _run_row(conn: duckdb.DuckDBPyConnection, run_id: str | None) -> dict[str, Any]:
    rows = _runs(conn, "WHERE run_id = ?" if run_id else "ORDER BY started_at DESC LIMIT 1",
                 [run_id] if run_id else None)
    if rows:
        return rows[0]
    if run_id:
        raise RunNotFound(f"no run {run_id!r} in the warehouse (see `featurehouse status`)")
    raise NoRuns("the warehouse has no runs yet: run `featurehouse ingest` first")


def _rel(target: Path, start: Path) -> str:
    try:
        return Path(os.path.relpath(target.resolve(), start.resolve())).as_posix()
    except ValueError:  # another drive: fall back to an absolute link
        return target.resolve().as_uri()


def write_report(
    conn_or_warehouse: duckdb.DuckDBPyConnection | str | os.PathLike | Settings,
    run_id: str | None = None,
    out_dir: Path | None = None,
    settings: Settings | None = None,
    *,
    data_docs_index: bool = True,
) -> Path:
    """Write the HTML report of one run (default: the latest) and refresh the runs index.

    ``conn_or_warehouse`` is an open warehouse connection, or the warehouse (its folder or its
    Settings), which is then opened read-only. Writes ``<out_dir>/<run_id>.html`` and
    ``<out_dir>/index.html``; ``out_dir`` defaults to ``settings.report_dir`` (``reports/`` in
    the warehouse folder). Builds the run's Great Expectations Data Docs under
    ``<warehouse>/gx/`` and links them. Returns the report's path (``ingest`` records it in
    ``runs.report_path``). ``data_docs_index=False`` (``ingest``'s own report) leaves the Data
    Docs site's index as it is when it has one: Great Expectations rebuilds it from every
    result ever stored (see ``validate.build_data_docs``).

    Raises ``NoRuns`` or ``RunNotFound`` when there is no run to report, and
    ``warehouse.WarehouseMissing`` when the warehouse does not exist, and
    ``names.BadRunId`` when the run id cannot name a file (it names the report).
    """
    if run_id is not None:
        check_run_id(run_id)
    if isinstance(conn_or_warehouse, duckdb.DuckDBPyConnection):
        conn, own = conn_or_warehouse, False
        settings = settings or Settings.from_env()
    else:
        settings = settings or warehouse_mod.settings_for(conn_or_warehouse)
        conn, own = warehouse_mod.connect(settings, read_only=True), True
    try:
        out_dir = Path(out_dir) if out_dir is not None else settings.report_dir
        return _write(conn, run_id, out_dir, settings, data_docs_index)
    finally:
        if own:
            conn.close()


def _write(conn, run_id, out_dir: Path, settings: Settings, data_docs_index: bool = True) -> Path:
    # One snapshot for every read: the report's sections agree with each other while loads
    # commit beside it, and DuckLake looks the snapshot up once (measured: 0.52 -> 0.44 s of
    # queries for a one-page run's report).
    with warehouse_mod.one_snapshot(conn):
        return _write_read(conn, run_id, out_dir, settings, data_docs_index)


def _write_read(conn, run_id, out_dir: Path, settings: Settings, data_docs_index: bool) -> Path:
    started = time.monotonic()
    # the index lists the latest runs: read once, they give the run's own row too (it is the
    # newest, when the report is a run's own), one query of the runs less
    runs = recent_runs(conn, _INDEX_RUNS)
    run = next((r for r in runs if run_id is None or r["run_id"] == run_id), None) or _run_row(conn, run_id)
    run_id = check_run_id(run["run_id"])  # the latest run, too, may predate the check
    out_dir.mkdir(parents=True, exist_ok=True)
    if changed_nothing(run):
        ctx = _gather_quiet(conn, run, out_dir)
    else:
        ctx = _gather(conn, run)
        ctx["charts"] = _charts(ctx, out_dir / ".charts")
        if settings.data_docs == "report" and not data_docs_index and validate.has_pending(settings.gx_dir, run_id):
            # a run's own report, with its Data Docs left to `featurehouse report` (no Great
            # Expectations in the ingest): say how to build them
            ctx["data_docs"] = {"pending": f"featurehouse report --run {run_id}"}
        else:
            ctx["data_docs"] = _data_docs(settings.gx_dir, run_id, out_dir, data_docs_index)
    ctx["warehouse"] = str(settings.warehouse)
    ctx["generated_at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    from .. import __version__

    ctx["version"] = __version__
    path = out_dir / f"{run_id}.html"
    _atomic_write(path, _env().get_template("run.html.j2").render(**ctx))
    _write_index(conn, out_dir, runs)
    log.info("report for %s written to %s in %.2fs", run_id, path, time.monotonic() - started)
    return path


def _data_docs(gx_project: Path, run_id: str, out_dir: Path, index: bool = True) -> dict[str, Any] | None:
    """Build Great Expectations' Data Docs for the run; links relative to the report."""
    if not (gx_project / "gx").exists():
        return None
    try:
        pages = validate.build_data_docs(gx_project, run_id, index=index)
    except Exception as exc:
        if disk_full(exc):
            log.error("could not build Great Expectations Data Docs for run %s: the disk is full", run_id)
        else:
            log.exception("could not build Great Expectations Data Docs for run %s", run_id)
        return None
    if not pages:
        return None
    site = pages[0].parents[4]  # validations/<suite>/<run>/<time>/<page> under the site root
    return {
        "index": _rel(site / "index.html", out_dir),
        "index_refreshed": index,  # else it may not list this run yet (see build_data_docs)
        "pages": [{"suite": p.parents[2].name, "batch": p.stem, "href": _rel(p, out_dir)} for p in pages],
    }


#: Runs the report's index lists.
_INDEX_RUNS = 1000


def _write_index(conn, out_dir: Path, runs: list[dict[str, Any]] | None = None) -> Path:
    runs = recent_runs(conn, _INDEX_RUNS) if runs is None else runs
    for r in runs:
        try:
            page = out_dir / f"{check_run_id(r['run_id'])}.html"
        except BadRunId:  # a run named before run ids were checked has no page of its own here
            r["href"] = None
            continue
        r["href"] = page.name if page.exists() else None
    path = out_dir / "index.html"
    _atomic_write(path, _env().get_template("index.html.j2").render(
        runs=runs, rules=VERDICT_RULES, generated_at=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())))
    return path


def _atomic_write(path: Path, text: str) -> None:
    # a name of its own per writer: two processes writing one page (the index, a cached chart)
    # at once must not write into each other's temporary file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def report_run(where: Settings | str | os.PathLike, run_id: str) -> dict[str, str]:
    """Write a run's report (reading the warehouse read-only), then record its path in
    ``runs.report_path``; what the nightly DAG's report task returns."""

    settings = warehouse_mod.settings_for(where)
    path = write_report(settings, run_id, settings=settings)
    with warehouse_mod.connect(settings) as conn:
        runstate.record_report(conn, settings, run_id, path)
    return {"run_id": run_id, "report_path": str(path)}
