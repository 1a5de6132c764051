"""Finding features (pipeline.outputs.find): `search`, `similar`, `by-token`, `show` and `index`,
and the find index refreshed after a load. Kept free of the ingest stages' imports, so that
these commands start quickly."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import click

from ..config import Settings
from .common import (
    _USER_ERRORS,
    format_option,
    warehouse_option,
)
from .formats import _csv_cell, _print_json, _terminal_width
from .stopping import _TERMINATED, Terminated


def _refresh_find(settings: Settings) -> None:
    """After a load: refresh the find index, if this warehouse has one (on stderr; a failure
    is reported, the load stands)."""
    from ..outputs import find

    if not (settings.find_index_dir / "index.duckdb").exists():
        return
    try:
        info = find.refresh_index(settings)
    except Exception as exc:  # the index is derived: the next query says it is stale
        if _TERMINATED:  # a SIGTERM inside a DuckDB statement surfaces as "Query interrupted"
            raise Terminated(128 + _TERMINATED[0]) from None
        click.echo(f"  find     the find index could not be refreshed ({exc}); run `featurehouse index`", err=True)
        return
    click.echo(f"  find     index {info.mode} at snapshot {info.snapshot_id} in {info.seconds:.2f}s "
               f"({info.n_changed_features} features read)", err=True)


def _print_found(found, fmt: str, widths: dict[str, int] | None = None, empty: str = "(no match)") -> None:
    """A find answer on stdout: a plain table (no Arrow to import), CSV or JSON; its note
    (the index is older than the warehouse) on stderr."""
    if fmt in ("csv", "json"):
        if fmt == "json":
            _print_json(found.as_dicts())
        else:
            w = csv.writer(sys.stdout, lineterminator="\n")
            w.writerow(found.columns)
            w.writerows([_csv_cell(v) for v in r] for r in found.rows)
    else:
        from ..outputs.find import printable

        widths = widths or {}

        def cell(col: str, v) -> str:
            text = (", ".join(repr(x) if isinstance(x, str) else str(x) for x in v) if isinstance(v, (list, tuple)) else
                    f"{v:.4f}" if isinstance(v, float) else "" if v is None else str(v))
            text = printable(" ".join(text.split()))  # newlines and runs of spaces in descriptions; escapes
            limit = widths.get(col, 60)
            return text if len(text) <= limit else text[: limit - 1] + "…"

        cols = list(found.columns)
        cells = [[cell(c, v) for c, v in zip(cols, r)] for r in found.rows]
        sizes = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
        width, dropped = _terminal_width(), 0
        # in a terminal (review: rows wrapped at 80 columns): the description gives way, to 20
        # characters; then the columns right of it go, from the right (the feature's key stays)
        while width and sum(sizes) + 2 * (len(sizes) - 1) > width:
            others = sum(sizes) - (sizes[cols.index("description")] if "description" in cols else 0) + 2 * (len(sizes) - 1)
            if "description" in cols and widths.get("description", 60) > 20 and width - others < sizes[cols.index("description")]:
                widths = {**widths, "description": max(20, width - others)}
            else:
                keep = ("model_id", "source_id", "feature_index", "description")
                gone = next((i for i in range(len(cols) - 1, -1, -1) if cols[i] not in keep), None)
                if gone is None:
                    break
                cols.pop(gone)
                dropped += 1
            cells = [[cell(c, r[found.columns.index(c)]) for c in cols] for r in found.rows]
            sizes = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
        click.echo("  ".join(c.ljust(n) for c, n in zip(cols, sizes)).rstrip())
        for r in cells:
            click.echo("  ".join(v.ljust(n) for v, n in zip(r, sizes)).rstrip())
        if not found.rows:
            click.echo(empty)
        elif dropped:
            click.echo(f"({dropped} more column(s): a wider terminal, or --format csv or json)")
    if found.note:
        click.echo(f"note: {found.note}", err=True)


def _finder(warehouse, refresh: bool):
    """The find index opened for a query; built first when there is none yet."""
    from ..outputs import find

    settings = Settings.from_env(warehouse=warehouse)
    try:
        try:
            return find.Finder(settings, fresh="refresh" if refresh else "warn")
        except find.FindIndexMissing as exc:
            why = "first use" if type(exc) is find.FindIndexMissing else str(exc)
            click.echo(f"building the find index in {settings.find_index_dir} ({why}) ...", err=True)
            # a refresh, not a build: another process may have built it meanwhile
            find.refresh_index(settings)
            return find.Finder(settings)
    except (find.FindIndexUnwritable, find.FindIndexMissing, *_USER_ERRORS) as exc:
        raise click.ClickException(str(exc)) from None


def _find_options(f):
    options = [
        warehouse_option,
        click.option("--model", default=None, help="Only features of this model."),
        click.option("--source", default=None, help="Only features of this source (SAE), e.g. 11-resid-post-aa."),
        click.option("-n", "--limit", default=10, show_default=True, type=click.IntRange(1, 10_000),
                     help="How many rows."),
        format_option,
        click.option("--refresh", is_flag=True,
                     help="Bring the find index up to the warehouse's last snapshot first."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _feature_key(value: str) -> str:
    from ..outputs.find import parse_key

    try:
        parse_key(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="MODEL/SOURCE/INDEX") from None
    return value


@click.command("search")
@click.argument("query")
@_find_options
def search_cmd(query, warehouse, model, source, limit, fmt, refresh) -> None:
    """Features whose explanations match QUERY: BM25 full-text search over the descriptions
    (words are stemmed: "jokes" finds "joke"); a "quoted phrase" must appear as written.

    \b
    Example: featurehouse search '"programming language" syntax' --source 11-resid-post-aa
    """
    if not query.replace('"', " ").strip():
        raise click.UsageError("the search query is empty: give one or more words, or a \"quoted phrase\"")
    from ..outputs.find import NoSuchSource, QueryHoldsNoWord

    with _finder(warehouse, refresh) as finder:
        try:
            found = finder.search(query, model=model, source=source, limit=limit)
        except (QueryHoldsNoWord, NoSuchSource) as exc:
            raise click.UsageError(str(exc)) from None
        _print_found(found, fmt)


@click.command("similar")
@click.argument("feature", metavar="MODEL/SOURCE/INDEX", callback=lambda ctx, param, value: _feature_key(value))
@_find_options
def similar_cmd(feature, warehouse, model, source, limit, fmt, refresh) -> None:
    """The features nearest to FEATURE, across sources and models unless --model/--source
    narrow them: by cosine similarity of their explanations' embeddings (exact), or, for a
    feature without one, by the overlap of its top activating tokens and top positive logits.
    The basis column says which."""
    from ..outputs.find import NoSuchFeature, NoSuchSource

    with _finder(warehouse, refresh) as finder:
        try:
            found = finder.similar(feature, model=model, source=source, limit=limit)
        except NoSuchFeature as exc:
            raise click.ClickException(str(exc)) from None
        except NoSuchSource as exc:
            raise click.UsageError(str(exc)) from None
        (n,) = finder.conn.execute(
            "SELECT count(*) FROM features WHERE ($m IS NULL OR model_id = $m) AND ($s IS NULL OR source_id = $s)",
            {"m": model, "s": source}).fetchone()
        within = " ".join(f"{k} {v}" for k, v in (("model", model), ("source", source)) if v)
        _print_found(found, fmt, empty=f"(no other feature to compare it with: the find index holds {n} feature(s)"
                                       f"{' of ' + within if within else ''}; none other of them has an embedding "
                                       "or shares a top token or logit with it)")


@click.command("by-token")
@click.argument("token")
@_find_options
@click.option("--ignore-case", is_flag=True, help="Match the token whatever its case.")
@click.option("--strip", is_flag=True, help="Ignore a leading space, ▁ or Ġ (tokenizers' word-start marks).")
@click.option("--data-source", default=None, help="Only excerpts of this data source (NULL: those without one).")
def by_token_cmd(token, warehouse, model, source, limit, fmt, refresh, ignore_case, strip, data_source) -> None:
    """The features whose stored excerpts activate most on TOKEN, by their highest activation on
    it, with how many excerpts peak on it (from every active token of every excerpt, not only
    the top ten).

    \b
    Example: featurehouse by-token CPU --strip --ignore-case
    """
    from ..outputs.find import NoSuchSource

    with _finder(warehouse, refresh) as finder:
        try:
            found = finder.by_token(token, ignore_case=ignore_case, strip=strip, model=model, source=source,
                                    data_source=data_source, limit=limit)
        except NoSuchSource as exc:
            raise click.UsageError(str(exc)) from None
        _print_found(found, fmt, {"description": 50})


@click.command("show")
@click.argument("feature", metavar="MODEL/SOURCE/INDEX", callback=lambda ctx, param, value: _feature_key(value))
@warehouse_option
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the feature as a self-contained HTML page, tokens shaded by activation.")
@click.option("--excerpts", default=5, show_default=True, type=click.IntRange(0, 200), help="Top excerpts shown.")
@click.option("--neighbours", default=5, show_default=True, type=click.IntRange(0, 100), help="Nearest features shown.")
def show_cmd(feature, warehouse, html_path, excerpts, neighbours) -> None:
    """One feature as a person reads it: statistics per data source, explanations, top excerpts
    (the peak token in [[ ]]) and nearest features."""
    from ..outputs import find

    if html_path is not None and (not str(html_path).strip() or str(html_path) in (".", "..") or html_path.is_dir()):
        raise click.BadParameter(f"{str(html_path)!r} is not a file name", param_hint="--html")
    settings = Settings.from_env(warehouse=warehouse)
    try:
        view = find.show(settings, feature, n_excerpts=excerpts, n_neighbours=neighbours)
    except (find.NoSuchFeature, *_USER_ERRORS) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(find.render_text(view))
    if html_path is not None:
        try:
            html_path.parent.mkdir(parents=True, exist_ok=True)
            html_path.write_text(find.render_html(view), encoding="utf-8")
        except OSError as exc:
            raise click.ClickException(f"cannot write {html_path}: {exc.strerror or exc}") from None
        click.echo(f"html {html_path}")


@click.command("index")
@warehouse_option
@click.option("--full", is_flag=True, help="Build from scratch instead of refreshing what changed.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def index_cmd(warehouse, full, fmt) -> None:
    """Build or refresh the find index (the derived file search, similar, by-token and show
    read) from the warehouse's last snapshot. Ingest refreshes it once it exists."""
    from ..outputs import find

    settings = Settings.from_env(warehouse=warehouse)
    try:
        info = find.refresh_index(settings, full=full)
    except (find.FindIndexUnwritable, *_USER_ERRORS) as exc:
        raise click.ClickException(str(exc)) from None
    if fmt == "json":
        _print_json(info.as_dict())
    else:
        click.echo(f"find index {info.mode} at snapshot {info.snapshot_id} in {info.seconds:.2f}s: "
                   f"{info.n_features} features, {info.n_explanations} explanations, "
                   f"{info.n_embeddings} embeddings ({info.n_changed_features} features read) "
                   f"-> {settings.find_index_dir}")
