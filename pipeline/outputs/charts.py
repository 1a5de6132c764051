"""The run report's charts: what they draw, binned or gridded by DuckDB (so that a chart's size
does not grow with the warehouse: a whole source has 262,144 features), written as Vega-Lite specs
and drawn to inline SVG by the renderer's child process (``draw.py``), with drawn charts cached
under ``<reports>/.charts/``. ``warm_charts`` starts the renderer ahead of the report.

``report_data.py`` reads the rest of what the page shows; ``report.py`` writes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import duckdb

from ..lake.sqltext import rows
from . import draw

__all__ = ["warm_charts"]

log = logging.getLogger("featurehouse")

_TREND_RUNS = 30  # runs the trend shows (read in report_data.py)
_MAX_SOURCES_CHARTED = 8

_FONT = "Inter, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"
_DS_COLORS = {"Chat": "#4c78a8", "Non-Chat": "#f58518", "(none)": "#9d9d9d"}


#: The page's look, as every chart's Vega-Lite ``config`` (what Altair's ``configure_*`` wrote,
#: its default view size included, so that a chart is drawn as it was).
_CONFIG = {
    "view": {"continuousWidth": 300, "continuousHeight": 300, "stroke": "#e5e7eb"},
    "axis": {"domainColor": "#9ca3af", "gridColor": "#eef0f3", "labelColor": "#374151", "labelFontSize": 11,
             "labelOverlap": "greedy", "titleColor": "#374151", "titleFontSize": 11, "titleFontWeight": 500},
    "background": "white", "font": _FONT,
    "header": {"labelColor": "#111827", "labelFontSize": 11, "titleFontSize": 11},
    "legend": {"labelFontSize": 11, "orient": "top", "titleFontSize": 11},
}
_SCHEMA = "https://vega.github.io/schema/vega-lite/v6.json"


def _spec(**chart: Any) -> dict[str, Any]:
    """A whole Vega-Lite spec: ``chart``'s keys with the page's look.

    The specs are written as the JSON Vega-Lite reads, not built with Altair: Altair's import
    (with jsonschema and narwhals) cost ~0.15-0.46 CPU-s in every process that drew a report,
    and its data handling pandas' (~0.33 CPU-s), to write five small dicts; the specs are the
    same as it wrote (checked by drawing both: tests/test_report.py draws every chart)."""
    return {"config": _CONFIG, **chart, "$schema": _SCHEMA}


def _data(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Inline data of a chart: its rows, a number that is no number (NaN, infinite) as null,
    as Vega-Lite's JSON has them."""
    return {"values": [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                       for r in rows]}


_counter = itertools.count()

def warm_charts() -> None:
    """Start the chart renderer (a child process, see ``draw.py``: ~0.4 s of one core there for
    its JavaScript engine) so that the first real chart does not wait for it. ``ingest`` calls
    it while its last batch loads. Raises ``draw.DrawerUnavailable`` when the renderer cannot
    start (the report then says its charts are not drawn)."""
    draw.start()


def _svg_cached(spec: dict[str, Any], cache: Path | None = None) -> str:
    """Draw a chart's Vega-Lite ``spec`` as SVG, with its element ids made unique within the page.

    With ``cache`` (a folder), a chart whose Vega-Lite spec (its data included) was drawn before
    is read back instead of drawn again: an unchanged warehouse redraws nothing but its trend.
    """
    spec = _xml_safe(spec)
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
    Returns (the bins as rows: source, data_source, start, end, count; how many sources were
    left out)."""
    x = "log10(x)" if log else "x"
    pad = "0.25" if log else "greatest(abs(lo) * 0.05, 0.5)"
    edge = (lambda e: f"pow(10, {e})") if log else (lambda e: e)
    bins = rows(conn, f"""
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
        FROM b GROUP BY source, data_source, lo, width, bin ORDER BY source, data_source, bin""")
    hidden = conn.execute(f"SELECT greatest(count(DISTINCT source) - {_MAX_SOURCES_CHARTED}, 0) FROM ({values_sql}) "
                          "WHERE x IS NOT NULL").fetchone()[0]
    return bins, int(hidden)



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
        return {"n": n, "hi": hi, "points": rows(conn, pairs), "cells": None}
    k, step = _SCATTER_CELLS, hi / _SCATTER_CELLS
    cells = [{**c, "x0": c["cx"] * step, "x1": (c["cx"] + 1) * step, "y0": c["cy"] * step, "y1": (c["cy"] + 1) * step}
             for c in rows(conn, f"""
        SELECT least(floor(non_chat_max / {step}), {k - 1})::INTEGER AS cx,
               least(floor(chat_max / {step}), {k - 1})::INTEGER AS cy, count(*) AS count
        FROM ({pairs}) GROUP BY ALL ORDER BY ALL""")]  # in order: the same spec, the chart cache's hit
    return {"n": n, "hi": hi, "points": None, "cells": cells}


def _ds_scale(values) -> dict[str, list]:
    domain = sorted(values, key=lambda v: (v not in _DS_COLORS, list(_DS_COLORS).index(v) if v in _DS_COLORS else 0, v))
    palette = ["#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b"]
    rng = [_DS_COLORS.get(v) or palette[i % len(palette)] for i, v in enumerate(domain)]
    return {"domain": domain, "range": rng}


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
    def chart(name: str, build) -> None:
        try:
            charts[name] = build()
        except draw.DrawerUnavailable:
            raise
        except Exception as exc:  # one chart's failure: said on the page, the others drawn
            log.warning("the report's %s chart is not drawn: %s", name, str(exc).splitlines()[0][:300])
            charts["not_drawn"].append({"chart": name, "why": str(exc).splitlines()[0][:300]})

    def _svg(spec: dict[str, Any]) -> str:
        return _svg_cached(spec, cache)

    def q(field: str, **more: Any) -> dict[str, Any]:  # an encoding channel: a quantitative field
        return {"field": field, "type": "quantitative", **more}

    h = ctx["hist_max_activation"]
    if h:
        data_sources = list(dict.fromkeys(r["data_source"] for r in h))
        n_ds, one = len(data_sources), len({r["source"] for r in h}) == 1
        # one source: its name heads the chart, each panel is named by its data source alone
        h = [{**r, "panel": r["data_source"] if one else f"{r['source']}  ·  {r['data_source']}"} for r in h]
        chart("max_activation", lambda: _svg(_spec(
            data=_data(h),
            facet={"field": "panel", "type": "nominal", "title": h[0]["source"] if one else None,
                   "header": {"labelAnchor": "start", "labelFontSize": 11.5, "labelFontWeight": "bold",
                              "labelLimit": 250 if n_ds > 2 else 320, "titleAnchor": "start",
                              "titleFontSize": 11.5, "titleFontWeight": "normal"}},
            spec={"mark": {"type": "bar", "stroke": "white", "strokeWidth": 0.5},
                  "encoding": {
                      # vl-convert ignores labelOverlap: few enough ticks not to touch
                      "x": q("start", title="feature max activation", scale={"zero": False}, axis={"tickCount": 5}),
                      "x2": {"field": "end"},
                      "y": q("count", title="features",
                             axis={"format": "d", "values": _int_ticks(max(r["count"] for r in h))}),
                      "y2": {"datum": 0},
                      "color": {"field": "data_source", "type": "nominal", "title": "data source",
                                "scale": _ds_scale(data_sources), "legend": None}},
                  "width": 250 if n_ds > 2 else 320, "height": 110},
            columns=min(n_ds, 3), spacing={"row": 14, "column": 22},
            # each source's own range: a small one is not flattened
            resolve={"scale": {"x": "independent", "y": "independent"}},
        )))
        charts["hidden_sources"] = ctx["hidden_sources"]
    h = ctx["hist_frac_nonzero"]
    if h:
        chart("frac_nonzero", lambda: _svg(_spec(
            data=_data(h),
            facet={"field": "source", "type": "nominal", "title": None,
                   "header": {"labelAnchor": "start", "labelFontSize": 11.5, "labelFontWeight": "bold"}},
            spec={"mark": {"type": "bar", "color": "#54a24b", "stroke": "white", "strokeWidth": 0.5},
                  "encoding": {
                      # a percentage of tokens, as the tables write it (review: "frac_nonzero", 3e-5)
                      "x": q("start", title="firing density, % of tokens (log scale)", scale={"type": "log"},
                             axis={"values": _log_ticks(h),
                                   "labelExpr": "format(datum.value * 100, '.2~r') + '%'"}),
                      "x2": {"field": "end"},
                      "y": q("count", title="features",
                             axis={"format": "d", "values": _int_ticks(max(r["count"] for r in h))}),
                      "y2": {"datum": 0}},
                  "width": 320, "height": 110},
            columns=1, spacing=14,
            resolve={"scale": {"x": "independent", "y": "independent"}},
        )))
        charts["n_frac_zero"] = ctx["n_frac_zero"]
    cp = ctx["chat_pairs"]
    if cp["n"]:
        hi = cp["hi"]
        diag = {"data": {"values": [{"v": 0}, {"v": hi}]},
                "mark": {"type": "line", "color": "#9ca3af", "strokeDash": [4, 4]},
                "encoding": {"x": q("v"), "y": q("v")}}
        x_title, y_title = "max activation on Non-Chat", "max activation on Chat"
        scale = {"domain": [0, hi], "nice": False}
        if cp["points"] is not None:
            pts = {"data": _data(cp["points"]),
                   "mark": {"type": "circle", "color": "#4c78a8", "opacity": 0.75, "size": 46, "stroke": "#1f3b5c",
                            "strokeWidth": 0.6},
                   "encoding": {"x": q("non_chat_max", title=x_title, scale=scale),
                                "y": q("chat_max", title=y_title, scale=scale)}}
        else:  # a whole source: how many features in each cell, the scale said on the chart
            pts = {"data": _data(cp["cells"]), "mark": {"type": "rect"},
                   "encoding": {"x": q("x0", title=x_title, scale=scale), "x2": {"field": "x1"},
                                "y": q("y0", title=y_title, scale=scale), "y2": {"field": "y1"},
                                "color": q("count", title="features", scale={"type": "log", "scheme": "blues"})}}
            charts["chat_cells"] = {"n": cp["n"], "k": _SCATTER_CELLS}
        chart("chat_vs_non_chat", lambda: _svg(_spec(layer=[pts, diag], width=300, height=300)))
    tf = ctx["top_features"]
    if tf:
        rows = [{"label": f"#{f['feature_index']}  {_short(f['explanation'] or '(no explanation)', 38)}",
                 "source": f"{f['source_id']}", "max_activation": f["max_activation"],
                 "data_source": f["data_source"], "rank": i} for i, f in enumerate(tf)]
        chart("top_features", lambda: _svg(_spec(
            data=_data(rows),
            mark={"type": "bar", "height": {"band": 0.75}},
            encoding={
                "y": {"field": "label", "type": "nominal", "sort": {"field": "rank"}, "title": None,
                      "axis": {"labelLimit": 330, "labelFontSize": 11}},
                "x": q("max_activation", title="max activation", axis={"tickCount": 4, "format": "~s"}),
                "color": {"field": "data_source", "type": "nominal", "title": "strongest on",
                          "scale": _ds_scale(list(dict.fromkeys(r["data_source"] for r in rows)))}},
            width=380, height={"step": 18},
            # the browser's font sets the labels wider than vl-convert measured them
            padding={"left": 48, "top": 5, "right": 5, "bottom": 5},
        )))
    tr = ctx["trend"]
    if tr:
        this = ctx["run"]["run_id"]
        runs = [{"order": _TREND_RUNS - len(tr) + i, "label": f"{t['started_at']:%m-%d %H:%M}",
                 "is_this": t["run_id"] == this, "run_id": t["run_id"]} for i, t in enumerate(tr)]
        metrics = [("rows_loaded", "rows loaded", "~s"), ("n_rejected", "inputs rejected", "d"),
                   ("n_quarantined", "records quarantined", "d"), ("failure_rate", "expectation failure rate %", ".1f")]
        panels = []
        for col, title, fmt in metrics:
            d = [{**r, "value": _number(t[col])} for r, t in zip(runs, tr)]
            top = float(max(r["value"] for r in d))
            if fmt == "d":
                ticks = _int_ticks(top, 3)
                axis, scale = {"format": fmt, "values": ticks}, {"domain": [0, ticks[-1]]}
            else:
                axis, scale = {"format": fmt, "tickCount": 3}, {"domainMin": 0, "domainMax": max(top, 1.0), "nice": True}
            panel = _spec(
                data=_data(d), mark={"type": "bar", "width": {"band": 0.8}},
                encoding={
                    "x": {"field": "order", "type": "ordinal", "scale": {"domain": list(range(_TREND_RUNS))},
                          "axis": {"labels": False, "ticks": False, "title": f"last {_TREND_RUNS} runs, oldest → newest"}},
                    "y": q("value", title=None, scale=scale, axis=axis),
                    "color": {"condition": {"test": "datum.is_this", "value": "#1f2937"}, "value": "#a5b4c8"}},
                width=190, height=80)
            panels.append({"title": title, "chart": panel})
        chart("trend", lambda: [{"title": p["title"], "svg": _svg(p["chart"])} for p in panels])


def _number(v: Any) -> float | int:
    """A trend's value as a number to draw: a missing one (no expectations: no failure rate) as 0."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return 0
    return v if isinstance(v, (int, float)) else float(v)


def _log_ticks(h: list[dict[str, Any]]) -> list[float]:
    """Ticks for a log axis over the bins ``h`` (start, end): the powers of ten inside, and 2x
    and 5x them when there are few (vl-convert draws every tick label Vega gives, overlapping)."""
    lo, hi = float(min(r["start"] for r in h)), float(max(r["end"] for r in h))
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


def _atomic_write(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a cached chart here; the page and the index in
    ``report.py``)."""
    # a name of its own per writer: two processes writing one page (the index, a cached chart)
    # at once must not write into each other's temporary file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
