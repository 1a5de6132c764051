"""Report stage: one self-contained HTML page per run, and an index of runs.

``write_report`` reads what a run did from the warehouse (``runs``, ``run_inputs``,
``raw_inputs``, ``validation_results``, ``quarantine`` and the activation statistics tables) and
writes ``<reports dir>/<run_id>.html`` plus ``<reports dir>/index.html``. The page needs no
network: its CSS is inline and its charts are Vega-Lite specs (``charts.py``) rendered to inline
SVG by vl-convert. It also builds Great Expectations' Data Docs for the run (file data context
under ``<warehouse dir>/gx/``) and links to them.

This module writes the page (its templates, their filters, the index, the Data Docs links). What
it shows is read by ``report_data.py``, judged by ``verdict.py`` and drawn by ``charts.py``; the
names other code imports from here (``verdict``, ``recent_runs``, ``warm_charts`` ...) are
re-exported.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import duckdb

from ..config import Settings
from ..lake import runstate
from ..lake import warehouse as warehouse_mod
from ..lake.landing import disk_full
from ..names import BadRunId, check_run_id
from ..stages import validate
from .charts import _atomic_write, _charts, _short, warm_charts
from .report_data import (
    NoRuns,
    RunNotFound,
    _gather,
    _gather_quiet,
    _rel,
    _run_row,
    changed_nothing,
    recent_runs,
)
from .text import density, rounded, visible_token
from .verdict import VERDICT_RULES, Verdict, out_of, verdict

__all__ = ["VERDICT_RULES", "Verdict", "verdict", "out_of", "recent_runs", "write_report", "report_run", "NoRuns",
           "RunNotFound", "warm_charts"]

log = logging.getLogger("featurehouse")

_TEMPLATES = Path(__file__).resolve().parent / "templates"


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
        if data_docs_index:
            # `featurehouse report` (or the nightly report task) of a run that changed nothing,
            # which `report` names by default after a re-run: other runs' results still wait
            _data_docs(settings.gx_dir, run_id, out_dir, True)
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


def report_run(where: Settings | str | os.PathLike, run_id: str) -> dict[str, str]:
    """Write a run's report (reading the warehouse read-only), then record its path in
    ``runs.report_path``; what the nightly DAG's report task returns."""

    settings = warehouse_mod.settings_for(where)
    path = write_report(settings, run_id, settings=settings)
    with warehouse_mod.connect(settings) as conn:
        runstate.record_report(conn, settings, run_id, path)
    return {"run_id": run_id, "report_path": str(path)}
