"""``featurehouse serve``: a read-only web app over the warehouse, for people who would rather
look than read tables.

Every view is a URL: ``/`` and ``/search?q=`` (explanations, BM25 from the find index),
``/by-token?t=``, ``/f/MODEL/SOURCE/INDEX`` (a feature: statistics per data source,
explanations, top excerpts shaded by activation with each token's value, the nearest features as
links, its history), ``/s/MODEL/SOURCE`` (a source: counts, its features as a sortable, paged
table), ``/runs`` (``status`` as a page, each run's report, its quarantine) and ``/sql`` (the
``featurehouse sql`` allow-list; CSV and JSON downloads).

Nothing is written: the lake is read through read-only connections, each answer from one
snapshot (shown at the foot of each page); the find index is opened once and followed as ingests
refresh it. A query typed into ``/sql`` runs in a ``featurehouse sql`` child process, which is
confined and sandboxed as the command is (a long-lived server cannot confine itself and go on
reading the find index). Every text from the warehouse is escaped by Jinja2's autoescape, and
no asset comes from outside: the CSS and the few lines of script are in the pages.

A request that fails is answered with a page of one line, never a traceback, and nothing it
shows or logs carries the catalog's password (DuckDB's errors echo the libpq string): a
PostgreSQL catalog that does not answer is a 503 naming its server (reload once it is started);
any other failure a 500 with the error's first line.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any
from urllib.parse import quote

import duckdb

from ..config import Settings
from ..lake import catalog_down
from ..lake import warehouse as warehouse_mod
from . import find
from .find.card import latest_snapshot
from .text import density, rounded, visible_token

log = logging.getLogger(__name__)

__all__ = ["make_app", "visible_token", "SORTS"]

_TEMPLATES = Path(__file__).resolve().parent / "templates" / "web"
PAGE = 50
#: Results a search or a by-token page lists (it says when there may be more).
LIMIT = 100
#: A query of /sql runs at most this long; the page shows at most this much of its answer.
SQL_SECONDS = 120
SQL_PAGE_BYTES = 8 << 20
#: The columns a source's feature table sorts by (?sort=), each with its SQL.
SORTS = {"index": "feature_index", "max": "max_act_approx DESC NULLS LAST, feature_index",
         "density": "frac_nonzero DESC NULLS LAST, feature_index",
         "quarantined": "n_quarantined DESC, feature_index"}


#: Where the feature page's nearest features go, sent after the rest of the card.
_NEIGHBOURS = "<!-- featurehouse: the nearest features -->"

_round = rounded  # one way to write a number for people: the report's, the card's (text.py)


class _State:
    """What the app keeps between requests: the settings and one find index (DuckDB
    connections are not for two threads at once: a lock)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.lock = threading.Lock()
        self.finder: find.Finder | None = None
        self.finder_error: str | None = None

    def with_finder(self, fn):
        with self.lock:
            for _attempt in (1, 2):
                if self.finder is None:
                    try:
                        self.finder = find.Finder(self.settings)
                        self.finder_error = None
                    except (find.FindIndexMissing, find.FindIndexStale, PermissionError) as exc:
                        self.finder_error = catalog_down.redact(str(exc))
                        return None
                try:
                    return fn(self.finder)
                except (find.FindIndexMissing, find.FindIndexStale, OSError, duckdb.IOException) as exc:
                    # the index was moved, damaged or rebuilt under it: opened again once
                    self.finder_error = catalog_down.redact(str(exc))
                    with contextlib.suppress(Exception):
                        self.finder.close()
                    self.finder = None
            return None

    def close(self) -> None:
        with self.lock:
            if self.finder is not None:
                self.finder.close()
                self.finder = None


_LOCAL = threading.local()


class _Kept:
    """A read-only connection kept by the thread that opened it (opening one costs ~0.1 s; each
    statement still reads the latest committed snapshot). ``close`` is a no-op: it stays open."""

    def __init__(self, conn: duckdb.DuckDBPyConnection):
        self.conn = conn

    def __getattr__(self, name: str):
        return getattr(self.conn, name)

    def close(self) -> None:
        pass


def _lake(settings: Settings) -> _Kept:
    kept = getattr(_LOCAL, "lakes", None)
    if kept is None:
        kept = _LOCAL.lakes = {}
    key = str(settings.warehouse)
    if key not in kept:
        kept[key] = _Kept(warehouse_mod.connect(settings, read_only=True, threads=1))
    return kept[key]


def _rows(conn: duckdb.DuckDBPyConnection, sql: str, params: Any = None) -> list[dict[str, Any]]:
    cur = conn.execute(sql, params or [])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def _bins(peaks: list[float | None]) -> list[int]:
    """A feature's excerpts by their peak, in tenths of the largest (the first tenth takes what is
    at or under 0; none when the largest is not over 0)."""
    bins = [0] * 10
    top = max((v for v in peaks if v is not None), default=None)
    if top is None or not top > 0:
        return bins
    for v in peaks:
        if v is not None and not math.isnan(v):
            bins[max(0, min(9, math.floor(v * 10 / top)))] += 1
    return bins


def utc_text(t: Any) -> str:
    """A snapshot's time as the footer writes it, in UTC whatever the server's zone (DuckDB gives
    a TIMESTAMPTZ in the process's zone); a naive one is UTC already (the lake's own times)."""
    if not isinstance(t, datetime.datetime):
        return "" if t is None else str(t)
    if t.tzinfo is not None:
        t = t.astimezone(datetime.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _parts(request, names: tuple[str, ...]) -> dict[str, Any] | None:
    """The parts of ``/f/MODEL/SOURCE/INDEX[/history]`` or ``/s/MODEL/SOURCE``, each unquoted
    from the raw path on its own (the decoded path would cut ``a%2Fb`` in two); None when the
    address has not those parts (or an index that is not a number)."""
    from urllib.parse import unquote_to_bytes

    raw = request.scope.get("raw_path") or request.url.path.encode()
    segments = [unquote_to_bytes(s).decode("utf-8", "replace") for s in raw.split(b"/")[2:]]
    history = len(segments) == len(names) + 1 and segments[-1] == "history"
    if history:
        segments.pop()
    if len(segments) != len(names) or not all(segments):
        return None
    got: dict[str, Any] = dict(zip(names, segments))
    if "index" in got:
        if not re.fullmatch(r"-?[0-9]{1,18}", got["index"]):
            return None
        got["index"] = int(got["index"])
    return got | ({"history": True} if history else {})


def make_app(where: Settings | str | os.PathLike, host: str | None = None):
    """The Starlette application over the warehouse at ``where``; ``host``: the address it listens
    on, besides loopback's names (requests naming another host are refused)."""
    import jinja2
    import markupsafe
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    settings = warehouse_mod.settings_for(where)
    if not warehouse_mod.exists(settings):
        raise warehouse_mod.WarehouseMissing(f"no warehouse at {settings.warehouse}: run `featurehouse ingest` first")
    state = _State(settings)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATES)), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["tok"] = visible_token
    env.filters["num"] = _round
    env.filters["density"] = density
    env.filters["q"] = lambda s: quote(str(s), safe="")

    def rendered(name: str, **ctx: Any) -> tuple[str, dict[str, str]]:
        t0 = ctx.pop("_t0", None)
        for said in ("message", "note", "error"):  # an error's words: never the catalog's password
            if isinstance(ctx.get(said), str):
                ctx[said] = catalog_down.redact(ctx[said])
        snap = ctx.pop("_snapshot", None) or latest_snapshot(_lake(settings).conn)  # the one the page was read at
        snap = {"id": snap["id"], "time": utc_text(snap["time"])}
        body = env.get_template(name).render(snapshot=snap, **ctx)
        headers = {"Server-Timing": f"app;dur={1000 * (time.perf_counter() - t0):.1f}"} if t0 else {}
        return body, headers

    def page(name: str, status: int = 200, **ctx: Any) -> HTMLResponse:
        body, headers = rendered(name, **ctx)
        return HTMLResponse(body, status_code=status, headers=headers)

    def found(fn) -> tuple[list[dict[str, Any]], str | None]:
        out = state.with_finder(fn)
        if out is None:
            return [], state.finder_error
        return out.as_dicts(), out.note

    def home(request: Request):
        t0 = time.perf_counter()
        q = (request.query_params.get("q") or "").strip()
        model = request.query_params.get("model") or None
        source = request.query_params.get("source") or None
        results, note = [], None
        if q:
            try:
                results, note = found(lambda f: f.search(q, model=model, source=source, limit=LIMIT))
            except (ValueError, duckdb.Error) as exc:
                note = f"the query could not be read: {exc}"
        sources = [] if q else _rows(
            _lake(settings).conn, "SELECT model_id, source_id, count(*) AS n FROM features GROUP BY ALL ORDER BY 1, 2")
        _with_excerpts(results)
        return page("search.html.j2", limit=LIMIT, q=q, model=model, source=source, results=results, note=note,
                    sources=sources, _t0=t0)

    def _with_excerpts(results: list[dict[str, Any]], first: int = 20) -> None:
        """The first ``first`` results' strongest excerpts, a few tokens each side of the peak,
        from the find index that found them (no lake read: ~1 ms, where reading the lake's
        activations for 20 features of a 131,072-excerpt source took ~75-100 ms)."""
        shown = results[:first]
        if not shown:
            return
        keys = [(r["model_id"], r["source_id"], int(r["feature_index"])) for r in shown]
        best = state.with_finder(lambda f: f.excerpts(keys)) or {}
        for r, k in zip(shown, keys):
            r["excerpt"] = best.get(k)

    def by_token(request: Request):
        t0 = time.perf_counter()
        t = request.query_params.get("t") or ""
        results, note = [], None
        if t:
            try:
                results, note = found(lambda f: f.by_token(t, ignore_case="i" in request.query_params, limit=LIMIT))
            except ValueError as exc:
                results, note = [], f"the token could not be looked up: {exc}"
            _with_excerpts(results)
        return page("by_token.html.j2", limit=LIMIT, t=t, results=results, note=note, _t0=t0)

    def feature(request: Request):
        t0 = time.perf_counter()
        p = _parts(request, ("model", "source", "index"))
        if p is None:
            return page("error.html.j2", status=404, message="a feature's address is /f/MODEL/SOURCE/INDEX", _t0=t0)
        if p.pop("history", False):
            return feature_history(p, t0)
        key = f"{p['model']}/{p['source']}/{p['index']}"
        args = (p["model"], p["source"], int(p["index"]))
        lake = _lake(settings).conn
        try:
            with state.lock:  # every part of the card from one snapshot (show pins it)
                if state.finder is None:
                    with contextlib.suppress(find.FindIndexMissing, PermissionError):
                        state.finder = find.Finder(settings)
                view = find.show(settings, args, n_excerpts=10, n_neighbours=0, lake=lake, finder=state.finder,
                                 captures=True)
        except (find.NoSuchFeature, ValueError) as exc:
            return page("error.html.j2", status=404, message=str(exc), _t0=t0)
        top = max([e["max_value"] or 0 for e in view.excerpts] + [0]) or 1.0
        bins = _bins(view.extra.get("peaks") or [])
        body, headers = rendered("feature.html.j2", view=view, key=key, model=p["model"], source=p["source"],
                                 index=p["index"], top=top, captures=view.extra["captures"], bins=bins,
                                 neighbours_section=markupsafe.Markup(_NEIGHBOURS), _t0=t0, _snapshot=view.extra["snapshot"])
        head, tail = body.split(_NEIGHBOURS, 1)

        def parts():
            # the card first (the browser lays it out meanwhile), then the nearest features: a
            # product over every embedding (~45 ms at 262,144), the page's longest part
            yield head
            yield neighbours_section(view, args)
            yield tail

        return StreamingResponse(parts(), media_type="text/html; charset=utf-8", headers=headers)

    def neighbours_section(view: find.FeatureView, args: tuple[str, str, int]) -> str:
        """The feature page's nearest features, from the find index (a note where it cannot say)."""
        def near(finder: find.Finder):
            try:
                return finder.similar(args, limit=10), finder.note
            except find.NoSuchFeature as exc:
                return None, str(exc)

        try:
            got = state.with_finder(near)
            view.neighbours, note = got if got is not None else (None, state.finder_error)
        except Exception as exc:  # the card is sent already: said in the page, never a traceback
            # the traceback as text, the password out (a logging handler formats exc_info itself)
            log.warning("the nearest features of %s/%s/%s failed: %s", *args,
                        catalog_down.redact("".join(traceback.format_exception(exc)).rstrip()))
            text = str(exc).strip()
            view.neighbours, note = None, f"the nearest features could not be read: {text.splitlines()[0] if text else type(exc).__name__}"
        view.note = catalog_down.redact(note) if note else view.note
        return env.get_template("_neighbours.html.j2").render(view=view)

    def feature_history(p: dict[str, Any], t0: float):
        from ..lake.history import FeatureKey
        from ..lake.history import feature_history as versions_of

        key = f"{p['model']}/{p['source']}/{p['index']}"
        with state.lock:
            versions = versions_of(_lake(settings).conn, FeatureKey(p["model"], p["source"], int(p["index"])))
        if not versions:
            return page("error.html.j2", status=404, message=f"no version of {key} in the snapshots the warehouse keeps",
                        _t0=t0)
        return page("history.html.j2", key=key, model=p["model"], source=p["source"], index=p["index"],
                    versions=versions, _t0=t0)

    def source_page(request: Request):
        t0 = time.perf_counter()
        p = _parts(request, ("model", "source"))
        if p is None or p.get("history"):
            return page("error.html.j2", status=404, message="a source's address is /s/MODEL/SOURCE", _t0=t0)
        sort = request.query_params.get("sort", "index")
        order = SORTS.get(sort, SORTS["index"])
        try:
            pageno = max(1, min(int(request.query_params.get("page", "1")), 10**9))
        except ValueError:
            pageno = 1
        with contextlib.closing(_lake(settings)) as conn:
            args = [p["model"], p["source"]]
            n = conn.execute("SELECT count(*) FROM features WHERE model_id = ? AND source_id = ?", args).fetchone()[0]
            if not n:
                return page("error.html.j2", status=404, message=f"no source {p['model']}/{p['source']} in the warehouse",
                            _t0=t0)
            pageno = min(pageno, max(1, math.ceil(n / PAGE)))
            stats = _rows(conn, "SELECT * EXCLUDE (model_id, source_id, refreshed_at) FROM source_activation_stats "
                                "WHERE model_id = ? AND source_id = ? ORDER BY data_source NULLS LAST", args)
            counts = _rows(conn, """SELECT (SELECT count(*) FROM activations WHERE model_id = $1 AND source_id = $2) AS activations,
                                           (SELECT count(*) FROM explanations WHERE model_id = $1 AND source_id = $2) AS explanations""",
                           args)[0]
            dist = _rows(conn, """SELECT width_bucket AS bin, count(*) AS n FROM (
                                      SELECT least(9, floor(max_act_approx * 10 / nullif(m, 0)))::INT AS width_bucket
                                      FROM features, (SELECT max(max_act_approx) AS m FROM features
                                                      WHERE model_id = $1 AND source_id = $2) mx
                                      WHERE model_id = $1 AND source_id = $2 AND max_act_approx IS NOT NULL)
                                  GROUP BY 1 ORDER BY 1""", args)
            top_max = conn.execute("SELECT max(max_act_approx) FROM features WHERE model_id = ? AND source_id = ?",
                                   args).fetchone()[0]
            rows = _rows(conn, f"""
                WITH q AS (SELECT json_extract_string(q.record_json, '$.index') AS idx, count(DISTINCT q.record_key) AS n
                           FROM quarantine q
                           WHERE json_extract_string(q.record_json, '$.modelId') = $1
                             AND json_extract_string(q.record_json, '$.layer') = $2
                             AND q.input_sha256 IN (SELECT input_sha256 FROM feature_captures
                                                    WHERE model_id = $1 AND source_id = $2) GROUP BY 1)
                SELECT f.feature_index, f.max_act_approx, f.frac_nonzero, coalesce(q.n, 0) AS n_quarantined,
                       (SELECT first(e.description ORDER BY e.explanation_id) FROM explanations e WHERE e.model_id = $1
                        AND e.source_id = $2 AND e.feature_index = f.feature_index) AS description
                FROM features f LEFT JOIN q ON q.idx = f.feature_index::VARCHAR
                WHERE f.model_id = $1 AND f.source_id = $2 ORDER BY {order} LIMIT {PAGE} OFFSET {(pageno - 1) * PAGE}""",
                         args)
        bins = [0] * 10
        for d in dist:
            if d["bin"] is not None:
                bins[max(0, min(9, int(d["bin"])))] += d["n"]
        return page("source.html.j2", model=p["model"], source=p["source"], n=n, stats=stats, counts=counts,
                    rows=rows, sort=sort, sorts=list(SORTS), pageno=pageno, pages=max(1, math.ceil(n / PAGE)),
                    bins=bins, top_max=top_max, _t0=t0)

    def runs(request: Request):
        t0 = time.perf_counter()
        from .report import out_of, recent_runs

        with contextlib.closing(_lake(settings)) as conn:
            rs = recent_runs(conn, 200)
        for r in rs:
            # what each failure count is out of: the report's formulas, so the page, the report
            # and `status` say one "N of M"; a run that fetched nothing lost no URL of any number
            r["of"] = out_of(r) | ({} if r.get("n_fetch_failed") else {"n_fetch_failed": 0})
            # the id may wrap after a '-' or a 'T' (its date and time), never inside a word
            r["run_id_parts"] = re.findall(r"[^-T]*[-T]|[^-T]+$", r["run_id"])
            rp = r.get("report_path")
            r["report_url"] = None
            if rp:
                with contextlib.suppress(ValueError):
                    r["report_url"] = "/reports/" + Path(rp).resolve().relative_to(Path(settings.report_dir).resolve()).as_posix()
        return page("runs.html.j2", runs=rs, _t0=t0)

    def quarantine(request: Request):
        t0 = time.perf_counter()
        run_id = request.path_params["run_id"]
        with contextlib.closing(_lake(settings)) as conn:
            rows = _rows(conn, "SELECT record_kind, record_key, check_name, detail, left(record_json::VARCHAR, 2000) AS record "
                               "FROM quarantine WHERE run_id = ? ORDER BY record_key, check_name LIMIT 1000", [run_id])
        if not rows:
            with contextlib.closing(_lake(settings)) as conn:
                if conn.execute("SELECT count(*) FROM runs WHERE run_id = ?", [run_id]).fetchone()[0] == 0:
                    return page("error.html.j2", status=404, message=f"no run {run_id}", _t0=t0)
        return page("quarantine.html.j2", run_id=run_id, rows=rows, _t0=t0)

    def _sql_child(q: str, fmt: str) -> subprocess.Popen:
        # `--` first: a query is never read as an option (`--help`, a leading `-- comment`)
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "sql", "--warehouse", str(settings.warehouse),
                                 "--format", fmt, "--", q], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        # no query runs longer than SQL_SECONDS, whoever is still waiting for it
        timer = threading.Timer(SQL_SECONDS, proc.kill)
        timer.daemon = True
        timer.start()
        proc.timer = timer
        return proc

    def sql(request: Request):
        t0 = time.perf_counter()
        q = (request.query_params.get("q") or "").strip()
        cols, rows, error, more = [], [], None, False
        if q:
            proc = _sql_child(q, "json")
            # at most SQL_PAGE_BYTES of the answer are read for the page: the rest is for a download
            out = proc.stdout.read(SQL_PAGE_BYTES + 1)
            big = len(out) > SQL_PAGE_BYTES
            if big:
                proc.kill()
            err = proc.stderr.read()
            proc.wait()
            proc.timer.cancel()
            if big:
                error = (f"the answer is larger than {SQL_PAGE_BYTES >> 20} MB: add a LIMIT, or download it as CSV "
                         "or JSON")
            elif proc.returncode == -signal.SIGKILL:
                error = f"the query took more than {SQL_SECONDS} s: stopped"
            elif proc.returncode != 0:
                error = err.decode("utf-8", "replace").strip().removeprefix("Error: ") or f"exit {proc.returncode}"
            else:
                data = json.loads(out or b"[]")
                if data:
                    cols = list(data[0])
                    more = len(data) > 500
                    rows = [[r[c] for c in cols] for r in data[:500]]
        return page("sql.html.j2", status=400 if error else 200, q=q, cols=cols, rows=rows, error=error, more=more,
                    _t0=t0)

    def sql_download(request: Request):
        q = (request.query_params.get("q") or "").strip()
        fmt = request.path_params["fmt"]
        if not q or fmt not in ("csv", "json"):
            return PlainTextResponse("a query (?q=) and a format (csv or json)", status_code=400)
        proc = _sql_child(q, fmt)
        first = proc.stdout.read(1 << 16)
        if not first:
            err = proc.stderr.read().decode("utf-8", "replace").strip()
            proc.wait()
            proc.timer.cancel()
            if proc.returncode != 0:
                return PlainTextResponse(catalog_down.redact(err.removeprefix("Error: ")) + "\n", status_code=400)

        def stream():
            try:
                yield first
                while chunk := proc.stdout.read(1 << 16):
                    yield chunk
            finally:
                proc.kill()
                proc.wait()
                proc.timer.cancel()

        return StreamingResponse(stream(), media_type="text/csv" if fmt == "csv" else "application/json",
                                 headers={"Content-Disposition": f'attachment; filename="featurehouse.{fmt}"'})

    def not_found(request: Request, exc: Exception) -> Response:
        return page("error.html.j2", status=404, message=f"nothing at {request.url.path}")

    def failed(request: Request, exc: Exception) -> Response:
        """Any other error: one line on a page (the warehouse moved away, a damaged index...); a
        PostgreSQL catalog that does not answer: 503, its server named, never its password."""
        line = catalog_down.said(exc, settings.catalog_url, again="reload this page")
        if line is not None:
            log.warning("%s: %s", request.url.path, line)  # one line: the state of a server, no bug
            title, status, headers = "The catalog does not answer", 503, {"Retry-After": "30"}
        else:
            text = str(exc).strip()
            line = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
            # the traceback, as text: a logging handler formats exc_info itself, password and all
            log.warning("%s failed: %s", request.url.path,
                        catalog_down.redact("".join(traceback.format_exception(exc)).rstrip()))
            title, status, headers = "Could not answer", 500, {}
        body = env.get_template("error.html.j2").render(
            snapshot={"id": "?", "time": "unknown"}, title=title, message=catalog_down.redact(line))
        return HTMLResponse(body, status_code=status, headers=headers)

    class Guard:
        """The outermost layer: a request that raised is answered by ``failed`` and goes no
        further. (Starlette's own handler of ``Exception`` raises it again after answering, for
        the server to log: uvicorn's traceback, with DuckDB's words, password and all.)"""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                await self.app(scope, receive, send)
                return
            started = False

            async def sending(message):
                nonlocal started
                if message["type"] == "http.response.start":
                    started = True
                await send(message)

            try:
                await self.app(scope, receive, sending)
            except Exception as exc:  # noqa: BLE001 - every failure is answered, none escapes
                from starlette.concurrency import run_in_threadpool

                try:
                    response = await run_in_threadpool(failed, Request(scope), exc)  # said() may ask the server: 3 s
                except Exception as worse:  # noqa: BLE001 - the error page itself failed: a line, no more
                    log.warning("%s failed, and its error page too: %s", scope.get("path"),
                                catalog_down.redact(f"{type(worse).__name__}: {worse}"))
                    response = PlainTextResponse("featurehouse could not answer this request\n", status_code=500)
                if not started:
                    await response(scope, receive, send)

    routes = [
        Route("/", home), Route("/search", home), Route("/by-token", by_token),
        # every part of a feature's or source's address whole, as its link quoted it (%2F and all):
        # a model or source id may hold a slash
        Route("/f/{rest:path}", feature), Route("/s/{rest:path}", source_page),
        Route("/runs", runs), Route("/runs/{run_id}/quarantine", quarantine),
        Route("/sql", sql), Route("/sql.{fmt}", sql_download),
    ]
    report_dir = Path(settings.report_dir)
    if report_dir.is_dir():
        routes.append(Mount("/reports", app=StaticFiles(directory=str(report_dir)), name="reports"))
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.close()

    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware

    # The Host header names this machine: a page elsewhere that rebinds its own name to 127.0.0.1
    # (DNS rebinding) is refused, so "loopback only" holds against web pages the user visits.
    hosts = ["localhost", "127.0.0.1", "[::1]", "::1"] + ([] if not host else ["*"] if host in ("0.0.0.0", "::")
                                                         else [host])
    app = Starlette(routes=routes, exception_handlers={404: not_found}, lifespan=lifespan,
                    middleware=[Middleware(Guard), Middleware(TrustedHostMiddleware, allowed_hosts=hosts)])
    app.state.featurehouse = state
    return app
