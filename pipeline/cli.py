"""The ``featurehouse`` command: each command opens the warehouse, calls one library function,
and turns the library's named errors into a clear message and exit code."""

from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path

import click
import duckdb
import orjson

from . import materialise
from . import warehouse as warehouse_mod
from .config import Settings
from .ingest import RunSummary, ingest
from .receive import InputNotFound

warehouse_option = click.option(
    "--warehouse",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="DuckDB file (default: $FEATUREHOUSE_WAREHOUSE, else ./warehouse/featurehouse.duckdb).",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log what each stage does.")
def cli(verbose: bool) -> None:
    """featurehouse: Neuronpedia feature pages into a DuckDB warehouse you can query."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def print_summary(s: RunSummary) -> None:
    """Print a run's summary for a person."""
    click.echo(f"run {s.run_id}: {s.status} in {s.seconds:.1f}s -> {s.warehouse}")
    click.echo(
        f"  inputs   received {s.n_received}, new {s.n_landed}, already landed {s.n_duplicates}, "
        f"loaded {s.n_loaded}, rejected {s.n_rejected}"
    )
    click.echo(
        f"  records  features {s.n_features}, activations {s.n_activations}, "
        f"explanations {s.n_explanations}, quarantined {s.n_quarantined}"
    )
    click.echo(f"  checks   {s.n_expectations} expectation results, {s.n_expectations_failed} failed")
    for r in s.rejected[:20]:
        click.echo(f"  rejected {r['origin']}\n           {r['reason']}")
    if len(s.rejected) > 20:
        click.echo(f"  ... and {len(s.rejected) - 20} more rejected (see raw_inputs)")
    if s.n_quarantined:
        click.echo("  quarantined records: featurehouse sql \"SELECT record_key, check_name, detail FROM quarantine\"")
    if s.report_path:
        click.echo(f"  report   {s.report_path}")


@cli.command("ingest")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@warehouse_option
@click.option("--run-id", default=None, help="Name the run (an Airflow task passes its data interval).")
@click.option("--reprocess", is_flag=True, help="Parse and load inputs again even if already landed.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
def ingest_cmd(paths, warehouse, run_id, reprocess, no_progress) -> None:
    """Ingest feature pages from files and folders (any mix, recursively).

    Accepts API JSON, captured flight text, saved HTML and gzip of any of them, and bulk-export
    JSON lines. Exits 0 when the run completed, even if some inputs were rejected.
    """
    settings = Settings.from_env(warehouse=warehouse)
    try:
        summary = ingest(paths, settings, run_id=run_id, reprocess=reprocess,
                         progress=False if no_progress else None)
    except InputNotFound as exc:
        raise click.UsageError(str(exc)) from exc
    print_summary(summary)


@cli.command("sql")
@click.argument("query")
@warehouse_option
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--max-rows", default=40, show_default=True, help="Rows shown in table format.")
def sql_cmd(query, warehouse, fmt, max_rows) -> None:
    """Run a read-only SQL query against the warehouse."""
    settings = Settings.from_env(warehouse=warehouse)
    try:
        conn = warehouse_mod.connect(settings.warehouse, read_only=True)
    except warehouse_mod.WarehouseMissing as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        rel = conn.sql(query)
        if rel is None:
            return
        if fmt == "table":
            rel.show(max_rows=max_rows, max_width=10_000)
            return
        cols = rel.columns
        rows = rel.fetchall()
        if fmt == "csv":
            w = csv.writer(sys.stdout)
            w.writerow(cols)
            w.writerows(rows)
        else:
            out = [dict(zip(cols, r)) for r in rows]
            sys.stdout.write(orjson.dumps(out, default=str, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n")
    except duckdb.Error as exc:
        raise click.ClickException(f"query failed: {exc}") from exc
    finally:
        conn.close()



@cli.command("status")
@warehouse_option
@click.option("-n", "--limit", default=10, show_default=True, help="How many recent runs.")
def status_cmd(warehouse, limit) -> None:
    """Show recent runs and their counts."""
    settings = Settings.from_env(warehouse=warehouse)
    try:
        conn = warehouse_mod.connect(settings.warehouse, read_only=True)
    except warehouse_mod.WarehouseMissing as exc:
        raise click.ClickException(str(exc)) from exc
    with conn:
        conn.sql(
            f"""SELECT run_id, status, started_at, round(epoch(finished_at - started_at), 1) AS seconds,
                       n_received AS received, n_loaded AS loaded, n_rejected AS rejected,
                       n_duplicates AS dups, n_features AS features, n_activations AS activations,
                       n_quarantined AS quarantined, n_expectations_failed AS failed_checks
                FROM runs ORDER BY started_at DESC LIMIT {int(limit)}"""
        ).show(max_width=10_000)
        totals = conn.sql(
            "SELECT (SELECT count(*) FROM features), (SELECT count(*) FROM activations), "
            "(SELECT count(*) FROM explanations), (SELECT count(*) FROM quarantine), "
            "(SELECT count(*) FROM raw_inputs WHERE status = 'rejected')"
        ).fetchone()
        click.echo("warehouse holds {} features, {} activations, {} explanations; {} quarantined records, "
                   "{} rejected inputs".format(*totals))


@cli.command("materialise")
@warehouse_option
@click.option("--run-id", default=None, help="Refresh only the features this run loaded (default: all).")
def materialise_cmd(warehouse, run_id) -> None:
    """Rebuild the activation statistics tables."""
    settings = Settings.from_env(warehouse=warehouse)
    with warehouse_mod.connect(settings.warehouse) as conn:
        r = materialise.refresh(conn, run_id)
    click.echo(f"refreshed {r.feature_stats_rows} feature stats rows over {r.n_features} features "
               f"and {r.source_stats_rows} source stats rows over {r.n_sources} sources")


def main() -> None:
    cli(prog_name="featurehouse")


if __name__ == "__main__":
    main()
