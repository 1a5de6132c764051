"""Reading the warehouse directly: `sql` (read-only queries), `shell` (the DuckDB CLI attached
read-only), `history` (a feature's versions) and `changes` (what changed since a run or time)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
import duckdb

from ..config import Settings
from ..lake import warehouse as warehouse_mod
from .common import (
    _USER_ERRORS,
    _open,
    format_option,
    warehouse_option,
)
from .formats import _print_rows, _terminal_width


@click.command("sql")
@click.argument("query")
@warehouse_option
@format_option
@click.option("--max-rows", default=40, show_default=True, help="Rows shown in table format.")
def sql_cmd(query, warehouse, fmt, max_rows) -> None:
    """Run a read-only SQL query against the warehouse (the last committed snapshot).

    Reads only: SELECT / FROM / WITH / VALUES, PIVOT, UNPIVOT, DESCRIBE, SHOW, SUMMARIZE and
    EXPLAIN [ANALYZE] of those, over the warehouse's tables, with a short list of table
    functions (snapshots(), table_changes(), range(), unnest(), ...); anything DuckDB's parser
    does not show to be such a read is refused, saying what is allowed. The process cannot write
    the warehouse's files whatever runs. --format csv/json is how results leave.
    """
    try:
        duckdb.extract_statements(query)
    except duckdb.Error as exc:
        raise click.ClickException(f"query failed: {exc}") from None
    settings = Settings.from_env(warehouse=warehouse)
    try:
        conn = warehouse_mod.open_for_queries(settings)
    except _USER_ERRORS as exc:
        raise click.ClickException(str(exc)) from None
    try:
        warehouse_mod.check_read_only(conn, query)
        rel = conn.sql(query)
        if rel is None:
            return
        if fmt == "table":  # in a terminal, as wide as it is (review: a row of 700 columns wrapped)
            rel.show(max_rows=max_rows, max_width=_terminal_width() or 10_000)
            return
        _print_rows(rel.columns, rel.fetchall(), fmt)
    except warehouse_mod.RefusedQuery as exc:
        raise click.ClickException(str(exc)) from None
    except duckdb.Error as exc:
        raise click.ClickException(f"query failed: {exc}") from None
    finally:
        conn.close()



@click.command("shell")
@warehouse_option
@click.option("--print", "print_only", is_flag=True, help="Print the statements that attach the warehouse, "
              "for any DuckDB client, instead of opening the shell.")
def shell_cmd(warehouse, print_only) -> None:
    """Open the DuckDB CLI with the warehouse attached read-only.

    Both install every DuckDB extension of featurehouse's wheels into its extension folder
    (~/.cache/featurehouse/duckdb-extensions), where any DuckDB client finds them offline.

    The shell is your own DuckDB client, not a sandbox: the warehouse is attached READ_ONLY, but
    COPY ... TO, ATTACH and the file readers work as anywhere, and can write any file your user
    can, the warehouse's data files included. For queries you did not write yourself, or in
    scripts, use `featurehouse sql`, whose process cannot write them.
    """
    import shutil

    from ..lake.extensions import install_all

    settings = Settings.from_env(warehouse=warehouse)
    _open(settings, read_only=True).close()  # a clear error now, rather than one inside the shell
    # every extension of the wheels in the folder a client names offline (docs/querying.md):
    # httpfs too, for a publication over HTTPS or S3, though this warehouse never needed it
    install_all()
    lines = warehouse_mod.attach_sql(settings, read_only=True)
    if print_only:
        click.echo("\n".join(lines))
        return
    exe = shutil.which("duckdb", path=str(Path(sys.executable).parent)) or shutil.which("duckdb")
    if exe is None:
        raise click.ClickException("the DuckDB CLI is not installed: pip install duckdb-cli")
    os.execv(exe, [exe, "-cmd", " ".join(lines)])



@click.command("history")
@click.argument("feature", metavar="MODEL/SOURCE/INDEX")
@warehouse_option
@format_option
def history_cmd(feature, warehouse, fmt) -> None:
    """Show a feature's versions over time: when each capture was loaded (or another feature's
    capture took some of its activations), by which run, and its max activation, number of
    activations and explanations as of then."""
    from ..lake.history import BadFeatureKey, feature_history, parse_key

    try:
        key = parse_key(feature)
    except BadFeatureKey as exc:
        raise click.BadParameter(str(exc), param_hint="FEATURE") from None
    settings = Settings.from_env(warehouse=warehouse)
    with _open(settings, read_only=True) as conn:
        versions = feature_history(conn, key)
    if not versions:
        raise click.ClickException(f"the warehouse has no version of {key} (within its retained history)")
    cols = ["snapshot_id", "committed_at", "run_id", "captured_at", "replaced", "lost", "max_act_approx",
            "n_activations", "max_activation", "explanations"]
    rows = [tuple(v[c] for c in cols) for v in versions]
    if fmt == "table":
        def what(replaced: list[str], lost: list[str]) -> str:
            taken = f"{', '.join(lost)} taken by another feature's capture" if lost else ""
            return "; ".join(x for x in (", ".join(replaced), taken) if x) or "(state kept from before)"

        cols = cols[:5] + cols[6:]
        rows = [r[:4] + (what(r[4], r[5]),) + r[6:9] + (" · ".join(r[9]),) for r in rows]
    _print_rows(cols, rows, fmt)



@click.command("changes")
@click.option("--since", required=True, metavar="RUN_ID|TIMESTAMP",
              help="A run id (changes from just before that run) or a timestamp such as 2026-11-29T03:00:00Z "
                   "(a time without a zone is UTC).")
@warehouse_option
@format_option
@click.option("--max-rows", default=100, show_default=True, help="Rows shown in table format.")
def changes_cmd(since, warehouse, fmt, max_rows) -> None:
    """List the features added, removed and changed since a run or a moment, with what changed."""
    from ..lake.history import HistoryUnavailable, changes_since, describe

    settings = Settings.from_env(warehouse=warehouse)
    with _open(settings, read_only=True) as conn:
        try:
            label, changes = changes_since(conn, since)
        except HistoryUnavailable as exc:
            raise click.ClickException(str(exc)) from None
    cols = ["feature", "change", "what", "run_id", "captured_at"]
    if fmt == "table":
        click.echo(f"{len(changes)} feature(s) changed {label}")
        rows = [(c["feature"], c["change"], describe(c["what"]), c["run_id"], c["captured_at"]) for c in changes]
        if rows:
            _print_rows(cols, rows, fmt, max_rows=max_rows)
    else:
        _print_rows(cols, [tuple(c[k] for k in cols) for c in changes], fmt)
