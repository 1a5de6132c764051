"""The run report's charts: what they draw, binned or gridded by DuckDB (so that a chart's size
does not grow with the warehouse: a whole source has 262,144 features), built with Altair and
drawn to inline SVG by the renderer's child process (``draw.py``), with drawn charts cached
under ``<reports>/.charts/``. ``warm_charts`` starts the renderer ahead of the report.

``report_data.py`` reads the rest of what the page shows; ``report.py`` writes it.
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
from pathlib import Path
from typing import Any

import duckdb

from ..stages import validate
from . import draw

__all__ = ["warm_charts"]

log = logging.getLogger("featurehouse")

_TREND_RUNS = 30  # runs the trend shows (read in report_data.py)
_MAX_SOURCES_CHARTED = 8

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
