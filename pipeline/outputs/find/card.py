"""One feature as a person reads it (``show``): gathered from the warehouse and the find index,
written as text (``render_text``) or a self-contained HTML page (``render_html``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import html
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import duckdb

from ...config import Settings
from ...lake import warehouse as warehouse_mod
from ..text import density, rounded, visible_token
from .common import FindIndexMissing, Found, NoSuchFeature, parse_key
from .queries import Finder


@dataclass
class FeatureView:
    """One feature as :func:`show` gathers it from the warehouse."""

    key: str
    feature: dict[str, Any] | None
    stats: list[dict[str, Any]]
    explanations: list[dict[str, Any]]
    excerpts: list[dict[str, Any]]
    neighbours: Found | None = None
    note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


#: Threads that read a feature card's parts from the lake at once (``show``): each read pays
#: DuckLake's own cost (~13 ms on an SQLite catalog) before it reads a byte, so five of them one
#: after the other were most of a card's time; on their own cursors they overlap (the GIL is
#: let go inside DuckDB), beside the nearest-neighbour search of the find index.
_READERS: concurrent.futures.ThreadPoolExecutor | None = None
_READERS_LOCK = threading.Lock()


def _readers() -> concurrent.futures.ThreadPoolExecutor:
    global _READERS
    with _READERS_LOCK:
        if _READERS is None:
            _READERS = concurrent.futures.ThreadPoolExecutor(max_workers=5, thread_name_prefix="card")
        return _READERS


def _read(lake: duckdb.DuckDBPyConnection, sql: str, params: list) -> list[dict[str, Any]]:
    cur = lake.cursor()  # a connection of its own to the same database (one statement at a time each)
    try:
        got = cur.execute(sql, params)
        cols = [d[0] for d in got.description]
        return [dict(zip(cols, r)) for r in got.fetchall()]
    finally:
        cur.close()


def show(where: Settings | str | os.PathLike, key: str | tuple[str, str, int], *, n_excerpts: int = 5, n_neighbours: int = 5,
         context: int = 12, lake: duckdb.DuckDBPyConnection | None = None, finder: Finder | None = None,
         captures: bool = False) -> FeatureView:
    """A feature as a person reads it: its statistics per data source, its explanations, its
    top excerpts (``context`` tokens each side of the peak) and its nearest neighbours (from
    the find index, when there is one). ``lake`` and ``finder``: a read-only connection and a
    Finder to use instead of opening them (a long-lived caller: the web app). ``captures``:
    also the runs that loaded its rows (``extra["captures"]``).

    Every part is read from one snapshot (``extra["snapshot"]``: its id and time; ``extra["from"]``:
    "index" or "lake"): from the find index's card tables when the index is current (no commit
    since its snapshot touched a table it reads) and holds the feature and as many excerpts and
    as much context as asked; else from the lake, each part on a cursor of its own, at once
    (``_READERS``)."""
    settings = warehouse_mod.settings_for(where)
    model, source, index = parse_key(key)
    note: str | None = None
    own_finder = finder is None
    if own_finder:
        try:
            finder = Finder(settings)
        except FindIndexMissing as exc:
            note = str(exc)
    try:
        parts = latest = None
        if finder is not None:
            # the lake's latest snapshot first, then whether the index is current up to it
            latest = latest_snapshot(lake) if lake is not None else None
            try:
                parts = finder.card((model, source, index), n_excerpts=n_excerpts, context=context,
                                    captures=captures, lake_snapshot=latest)
            except (FindIndexMissing, OSError, duckdb.Error) as exc:  # moved, damaged, rebuilt under it
                note = str(exc)
        if parts is None:
            parts = _from_lake(settings, (model, source, index), n_excerpts=n_excerpts, context=context, lake=lake,
                               captures=captures, finder=finder, latest=latest)
        neighbours: Found | None = None
        if finder is not None:
            try:
                neighbours = (finder.similar((model, source, index), limit=n_neighbours) if n_neighbours else
                              Found(["model_id", "source_id", "feature_index", "similarity", "basis", "description"],
                                    [], finder.note))
                note = note or finder.note  # (the card's own failure first)
            except (FindIndexMissing, NoSuchFeature, OSError, duckdb.Error) as exc:
                note = str(exc)
    finally:
        if own_finder and finder is not None:
            finder.close()
    for e in parts["excerpts"]:
        e["peak"] = (e["max_value_token_index"] - e["start"]) if e["max_value_token_index"] is not None else None
    view = FeatureView(f"{model}/{source}/{index}", parts["feature"], parts["stats"], parts["explanations"],
                       parts["excerpts"], extra={"peaks": parts["peaks"], "snapshot": parts["snapshot"],
                                                 "from": parts["from"]})
    if captures:
        view.extra["captures"] = parts["captures"]
    view.neighbours = neighbours
    view.note = note
    return view


def latest_snapshot(lake: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """The lake's latest snapshot: its id and time (the one a read-only statement reads now).
    Read from the catalog's table of snapshots, not DuckLake's ``snapshots()``, which builds
    every snapshot's list of changes before a filter or a LIMIT applies: 10.6 against 3.4 ms of
    CPU at 302 snapshots, growing with the history, for each feature page ``serve`` answers.
    (The SQLite catalog keeps the time as text: cast, it is the same instant and type.)"""
    sid, t = lake.execute(f"SELECT snapshot_id, snapshot_time::TIMESTAMPTZ FROM __ducklake_metadata_"
                          f"{warehouse_mod.CATALOG}.ducklake_snapshot ORDER BY snapshot_id DESC LIMIT 1").fetchone()
    return {"id": sid, "time": t}


def _from_lake(settings: Settings, key: tuple[str, str, int], *, n_excerpts: int, context: int,
               lake: duckdb.DuckDBPyConnection | None, captures: bool, finder: Finder | None,
               latest: dict[str, Any] | None = None) -> dict[str, Any]:
    """The card's parts read from the lake at its current snapshot (``latest``, when the caller
    read it already), at once (NoSuchFeature when it holds nothing of the feature)."""
    model, source, index = key
    k = [model, source, index]
    cond = "model_id = ? AND source_id = ? AND feature_index = ?"
    own = lake is None
    with (warehouse_mod.connect(settings, read_only=True) if own else contextlib.nullcontext(lake)) as lake:
        if latest is None:
            latest = latest_snapshot(lake)
        snap = latest["id"]

        def at(table: str) -> str:  # the table as of that snapshot, from any cursor
            return f"{warehouse_mod.CATALOG}.{table} AT (VERSION => {int(snap)})"

        queries = {
            "feature": (f"""SELECT max_act_approx, frac_nonzero, pos_str, pos_values, neg_str, neg_values,
                                   hook_name, captured_at FROM {at('features')} WHERE {cond}""", k),
            "stats": (f"""SELECT data_source, n_examples, n_active_tokens, round(active_token_fraction, 5) AS active_token_fraction,
                                 max_activation, round(mean_max_activation, 4) AS mean_max_activation,
                                 list_transform(top_tokens[1:5], t -> t.token) AS top_tokens
                          FROM {at('feature_activation_stats')} WHERE {cond} ORDER BY data_source NULLS LAST""", k),
            "explanations": (f"""SELECT description, explanation_model, type_name, embedding IS NOT NULL AS has_embedding
                                 FROM {at('explanations')} WHERE {cond} ORDER BY explanation_id""", k),
            "excerpts": (f"""SELECT data_source, max_value, max_value_token_index,
                                    greatest(max_value_token_index - {int(context)}, 0) AS start,
                                    tokens[greatest(max_value_token_index - {int(context)}, 0) + 1 :
                                           max_value_token_index + {int(context)} + 1] AS tokens,
                                    "values"[greatest(max_value_token_index - {int(context)}, 0) + 1 :
                                             max_value_token_index + {int(context)} + 1] AS "values",
                                    list(max_value) OVER () AS every_peak
                             FROM {at('activations')} WHERE {cond}
                             ORDER BY max_value DESC NULLS LAST, activation_id LIMIT {max(int(n_excerpts), 1)}""", k),
        }
        if captures:
            queries["captures"] = (f"SELECT table_name, captured_at, run_id FROM {at('feature_captures')} "
                                   f"WHERE {cond} ORDER BY table_name", k)
        pending = {name: _readers().submit(_read, lake, sql, params) for name, (sql, params) in queries.items()}
        try:
            if finder is not None:  # the nearest-neighbour search's matrices mapped meanwhile
                with contextlib.suppress(Exception):
                    finder._matrices()
        finally:
            concurrent.futures.wait(pending.values())  # every cursor done before the lake may close
        got = {name: f.result() for name, f in pending.items()}
    feature, stats, explanations, excerpts = got["feature"], got["stats"], got["explanations"], got["excerpts"]
    if not (feature or stats or explanations or excerpts):
        raise NoSuchFeature(f"{model}/{source}/{index} is not in the warehouse at {settings.warehouse}")
    peaks = excerpts[0]["every_peak"] if excerpts else []  # every excerpt's, for a histogram (one scan)
    excerpts = excerpts[:n_excerpts]  # (one row read at least: the peaks come with it)
    for e in excerpts:
        del e["every_peak"]
    return {"feature": feature[0] if feature else None, "stats": stats, "explanations": explanations,
            "excerpts": excerpts, "peaks": peaks, "captures": got.get("captures"), "from": "lake",
            "snapshot": latest}


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, chars: re.Pattern[str] = _CONTROL) -> str:
    """``text`` safe to print on a terminal: control characters (an escape sequence in a
    description or a token would move the cursor, recolour, retitle the window) and the
    bidirectional overrides written as ``\\xHH``/``\\uHHHH``; tabs and newlines are left to the caller.
    ``chars``: another set of characters to write so (the report's chart text: those XML refuses)."""
    return chars.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)


def render_text(view: FeatureView) -> str:
    """``show``'s answer as plain text: the peak token of each excerpt in [[ ]]; every text
    from the warehouse made :func:`printable`."""
    return printable(_render_text(view))


def _render_text(view: FeatureView) -> str:
    out = [f"feature {view.key}"]
    f = view.feature or {}
    if f:
        out.append(f"  max activation (approx.) {rounded(f.get('max_act_approx'))}, "
                   f"firing density {density(f.get('frac_nonzero'))}")
        if f.get("pos_str"):
            out.append("  top positive logits: " + ", ".join(repr(t) for t in f["pos_str"][:10]))
    out.append("statistics per data source:")
    for s in view.stats:
        out.append(f"  {s['data_source'] or '(no data source)'}: {s['n_examples']} excerpts, "
                   f"max {rounded(s['max_activation'])}, mean peak {rounded(s['mean_max_activation'])}, "
                   f"active tokens {rounded(s['n_active_tokens'])} ({density(s['active_token_fraction'])} of its excerpts' tokens), "
                   f"top tokens {s['top_tokens']}")
    if not view.stats:
        out.append("  (no activations loaded)")
    out.append("explanations:")
    for e in view.explanations:
        emb = ", embedding" if e["has_embedding"] else ""
        out.append(f"  - {e['description'].strip() if e['description'] else ''}  ({e['explanation_model']}{emb})")
    if not view.explanations:
        out.append("  (none)")
    out.append("top excerpts (the peak token in [[ ]]):")
    for e in view.excerpts:
        toks = [("[[" + t + "]]" if i == e["peak"] else t) for i, t in enumerate(e["tokens"] or [])]
        out.append(f"  {rounded(e['max_value']):>8}  {e['data_source'] or '-':<9} " + "".join(toks).replace("\n", "⏎"))
    if not view.excerpts:  # (a heading over nothing read as if the answer were cut)
        out.append("  (none)")
    out.append("nearest features:")
    if view.neighbours is not None and view.neighbours.rows:
        for m, s, i, sim, basis, d in view.neighbours.rows:
            out.append(f"  {sim:.4f} ({basis})  {m}/{s}/{i}  {(d or '').strip()[:80]}")
    else:
        out.append("  (none)")
    if view.note:
        out.append(f"note: {view.note}")
    return "\n".join(out)


def render_html(view: FeatureView) -> str:
    """``show``'s answer as one self-contained HTML page (no script, no external file): each
    excerpt headed by its data source and its largest activation, its tokens shaded by their
    activation relative to the feature's largest, the peak token outlined, the value in each
    token's title. Tokens are written as the report and the web app write them (a leading or
    trailing space as ␣, a newline as ↵: " CPU" and "CPU" differ), numbers rounded for people
    (``text.rounded``). Text from the warehouse is escaped for HTML, its control characters and
    bidirectional overrides written as visible escapes (as :func:`printable` prints them), and
    isolated (``<bdi>``, ``unicode-bidi: isolate``) so a right-to-left run cannot reorder what
    stands around it."""

    def esc(text: Any) -> str:  # in an attribute or the title
        return html.escape(printable(str(text)))

    def bdi(text: Any) -> str:  # in the page's text
        return f"<bdi>{esc(text)}</bdi>"

    def tok(token: str | None) -> str:  # a token, its spaces and newlines visible
        return esc(visible_token(token))

    num = rounded
    top = max([e["max_value"] or 0 for e in view.excerpts] + [0]) or 1.0
    parts = [f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(view.key)} — featurehouse</title>
<style>
body {{ font: 15px/1.5 system-ui, sans-serif; margin: 2rem; color: #1d1d1f; max-width: 70rem; }}
h1 {{ font-size: 1.3rem; }} h2 {{ font-size: 1.05rem; margin-top: 1.6rem; }}
table {{ border-collapse: collapse; }} td, th {{ padding: .2rem .6rem; border-bottom: 1px solid #ddd; text-align: left; }}
td.num, th.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
.excerpt {{ font: 13px/1.9 ui-monospace, monospace; white-space: pre-wrap; word-break: break-word; margin: .1rem 0 .8rem; padding: .3rem; border: 1px solid #eee; }}
/* as serve's pages: tokens written with ␣ hold no space to wrap at, so an excerpt, a cell or a
   line of text breaks anywhere rather than reach past the window */
td, li, p, .excerpt {{ overflow-wrap: anywhere; }}
td.nowrap {{ white-space: nowrap; overflow-wrap: normal; }}
.excerpt-head {{ font-size: 13px; color: #555; }} .hint {{ font-size: 13px; color: #555; }}
.tok {{ border-radius: 2px; unicode-bidi: isolate; }} bdi, code {{ unicode-bidi: isolate; }} .peak {{ outline: 2px solid #b3261e; }}
.note {{ color: #8a5a00; }}
</style></head><body>
<h1>Feature {bdi(view.key)}</h1>"""]
    f = view.feature or {}
    if f:
        parts.append(f'<p>Max activation (approx.) <b class="max-act">{esc(num(f.get("max_act_approx")))}</b>; '
                     f'firing density <b class="density">{esc(density(f.get("frac_nonzero")))}</b> '
                     "(the share of all tokens on which it fires).</p>")
        if f.get("pos_str"):
            parts.append("<p>Top positive logits: "
                         + ", ".join(f"<code><bdi>{tok(t)}</bdi></code>" for t in f["pos_str"][:10]) + "</p>")
    parts.append('<h2>Statistics per data source</h2><table class="stats"><tr><th>data source</th>'
                 '<th class="num">excerpts</th><th class="num">max activation</th><th class="num">mean peak</th>'
                 '<th class="num">active tokens</th><th>top tokens</th></tr>')
    for s in view.stats:
        parts.append(f"<tr><td>{bdi(s['data_source'] or '(none)')}</td><td class=\"num\">{esc(num(s['n_examples']))}</td>"
                     f"<td class=\"num\">{esc(num(s['max_activation']))}</td>"
                     f"<td class=\"num\">{esc(num(s['mean_max_activation']))}</td>"
                     f"<td class=\"num\">{esc(num(s['n_active_tokens']))}</td>"
                     f"<td>{', '.join(f'<code><bdi>{tok(t)}</bdi></code>' for t in s['top_tokens'] or [])}</td></tr>")
    parts.append("</table><h2>Explanations</h2><ul class=\"explanations\">")
    for e in view.explanations:
        parts.append(f"<li>{bdi((e['description'] or '').strip())} <small>({bdi(e['explanation_model'] or '?')})</small></li>")
    parts.append("</ul><h2>Top excerpts</h2>"
                 '<p class="hint">each headed by its data source and its largest activation; each token shaded by '
                 "its activation against the feature's largest (hover a token for its value), the peak outlined; "
                 "␣ is a space, ↵ a newline, ⇥ a tab</p>")
    for e in view.excerpts:
        spans = []
        for i, (t, v) in enumerate(zip(e["tokens"] or [], e["values"] or [])):
            alpha = max(0.0, min(1.0, (v or 0) / top))
            cls = "tok peak" if i == e["peak"] else "tok"
            spans.append(f'<span class="{cls}" data-activation="{v}" title="{esc(num(v))}" '
                         f'style="background: rgba(255, 120, 0, {alpha:.3f})">{tok(t)}</span>')
        parts.append(f'<div class="excerpt-head"><span class="data-source">{bdi(e["data_source"] or "(no data source)")}'
                     f'</span> · max activation <b class="excerpt-max">{esc(num(e["max_value"]))}</b></div>')
        parts.append(f'<div class="excerpt" data-max="{e["max_value"]}">' + "".join(spans) + "</div>")
    parts.append("<h2>Nearest features</h2><table class=\"neighbours\"><tr><th>feature</th><th class=\"num\">similarity</th>"
                 "<th>basis</th><th>description</th></tr>")
    for m, s, i, sim, basis, d in (view.neighbours.rows if view.neighbours is not None else []):
        parts.append(f"<tr><td>{bdi(f'{m}/{s}/{i}')}</td><td class=\"num\">{esc(num(sim))}</td><td class=\"nowrap\">{esc(basis)}</td>"
                     f"<td>{bdi((d or '').strip())}</td></tr>")
    if view.neighbours is None or not view.neighbours.rows:
        parts.append('<tr><td colspan="4">(no other feature to compare it with)</td></tr>')
    parts.append("</table>")
    if view.note:
        parts.append(f'<p class="note">{bdi(view.note)}</p>')
    parts.append("</body></html>\n")
    return "\n".join(parts)
