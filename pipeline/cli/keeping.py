"""The warehouse's settings and upkeep: `config` (every setting in effect and where it came
from), `materialise`, `maintain`, `upgrade` and `migrate`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ..config import Settings
from ..lake import warehouse as warehouse_mod
from .common import (
    _USER_ERRORS,
    _open,
    warehouse_option,
)
from .formats import _cut_middle, _print_json, _print_rows

#: Variables read where they are used, not through Settings or featurehouse.toml (docs/cli.md#settings
#: says what each does): (name, setting, the value in effect when unset, whether it is a secret).
_OTHER_VARIABLES = (
    ("NEURONPEDIA_API_KEY", "api_key", "(not set)", True),
    ("FEATUREHOUSE_CACHE_DIR", "cache_dir", None, False),
    ("FEATUREHOUSE_DUCKDB_MEMORY", "duckdb_memory", "1GB", False),
    ("FEATUREHOUSE_CHART_TIMEOUT", "chart_timeout", "120", False),
    ("FEATUREHOUSE_SCHEMAS", "schemas_dir", None, False),
)


def _other_variables() -> list[dict[str, str]]:
    from ..config import SCHEMAS_DIR
    from ..lake.extensions import _cache_dir

    derived = {"FEATUREHOUSE_CACHE_DIR": str(_cache_dir() or "(none: no HOME)"), "FEATUREHOUSE_SCHEMAS": str(SCHEMAS_DIR)}
    rows = []
    for name, what, default, secret in _OTHER_VARIABLES:
        given = (os.environ.get(name) or "").strip()
        value = ("***" if secret else given) if given else derived.get(name, default)
        rows.append({"setting": what, "value": value, "from": f"${name}" if given else "default",
                     "variables": f"${name}"})
    return rows


def _fit_config(rows: list[tuple], width: int) -> tuple[list[str], list[tuple]]:
    """The config table for a terminal of ``width`` characters: setting, value and from (the
    variables that set each are in --wide), a value cut in its middle when the line is short."""
    rows = [r[:3] for r in rows]
    need = [3 + max([len(h), 7] + [len(str(r[i])) for r in rows]) for i, h in enumerate(("setting", "value", "from"))]
    room = max(20, width - 1 - need[0] - need[2] - 3)  # the value column's characters
    return ["setting", "value", "from"], [(a, _cut_middle(str(b), room), c) for a, b, c in rows]


@click.command("config")
@warehouse_option
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--wide", is_flag=True, help="The variables that set each setting too, and every value whole "
                                           "(by default, in a terminal, what fits it).")
def config_cmd(warehouse, fmt, wide) -> None:
    """Every setting in effect, and where it came from (the command line, an environment
    variable, featurehouse.toml, the default): the warehouse's settings and the paths derived
    from them, what the nightly and inbox DAGs read from featurehouse.toml ($FEATUREHOUSE_CONFIG;
    `featurehouse fetch` takes its own options and NEURONPEDIA_* instead), and the variables
    read nowhere else. As this shell sees them: an Airflow Variable or Connection (the DAGs'
    featurehouse_config, neuronpedia_default) is not read here. Reads no warehouse; exits 1,
    after showing the rest, when featurehouse.toml has a mistake.

    Every environment variable featurehouse reads is in docs/cli.md#settings."""
    from ..sources import plan

    settings = Settings.from_env(warehouse=warehouse)
    rows = settings.described({"warehouse": warehouse})
    problem = None
    try:
        rows += plan.described()
    except plan.ConfigError as exc:
        problem = str(exc)
    rows += _other_variables()
    if fmt == "json":
        _print_json(rows)
    else:
        heads, cells = ["setting", "value", "from", "variables"], [tuple(r.values()) for r in rows]
        if not wide and sys.stdout.isatty():  # into a pipe or a file: every column whole, as status
            import shutil

            heads, cells = _fit_config(cells, shutil.get_terminal_size((120, 24)).columns)
        _print_rows(heads, cells, "table", max_rows=200)
        if len(heads) < 4:
            click.echo("(the variables that set each: featurehouse config --wide, or --format json)")
    if problem:
        raise click.ClickException(problem)



@click.command("materialise")
@warehouse_option
@click.option("--run-id", default=None, help="Refresh only the features this run changed (default: all).")
def materialise_cmd(warehouse, run_id) -> None:
    """Rebuild the activation statistics tables."""
    from ..stages import materialise

    settings = Settings.from_env(warehouse=warehouse)
    with _open(settings) as conn:
        r = materialise.refresh(conn, settings, run_id)
    rows = (f"{r.feature_stats_rows} feature stats rows over {r.n_features} features "
            f"and {r.source_stats_rows} source stats rows over {r.n_sources} sources")
    if r.unchanged:  # (review: "refreshed" when nothing was written)
        click.echo(f"unchanged: the {rows} already hold what they would be computed as; nothing committed")
    else:
        click.echo(f"refreshed {rows}")



@click.command("maintain")
@warehouse_option
@click.option("--retention-days", type=click.FloatRange(min=0), default=None,
              help="Keep history this long (default: $FEATUREHOUSE_RETENTION_DAYS, else 90).")
@click.option("--grace-minutes", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Files no snapshot uses are deleted once they are this old (readers may still hold them).")
def maintain_cmd(warehouse, retention_days, grace_minutes) -> None:
    """Expire old snapshots, merge small files and delete files nothing references."""
    from datetime import timedelta

    from ..lake.maintain import MaintenanceRefused, maintain

    settings = Settings.from_env(warehouse=warehouse)
    try:
        r = maintain(settings, retention_days=retention_days, grace=timedelta(minutes=grace_minutes))
    except (MaintenanceRefused, *_USER_ERRORS) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"snapshots {r.snapshots_before} -> {r.snapshots_after} ({r.snapshots_expired} older than "
               f"{r.retention_days:g} days expired); "
               f"data files {r.files_before} -> {r.files_after} ({r.bytes_before:,} -> {r.bytes_after:,} bytes) "
               f"in {r.seconds:.1f}s")



@click.command("upgrade")
@warehouse_option
def upgrade_cmd(warehouse) -> None:
    """Bring the warehouse's schema up to this release (any write command also does)."""
    settings = Settings.from_env(warehouse=warehouse)
    with _open(settings, migrate=False) as conn:
        before = warehouse_mod.schema_version(conn)
        applied = warehouse_mod.apply_migrations(conn, settings)
        if 5 in applied:  # feature_token_stats is new: filled for the features loaded before
            from ..stages import materialise

            filled = materialise.refresh(conn, settings)
    after = before + len(applied)
    click.echo(f"schema version {before} -> {after}" if applied else f"schema version {before}: up to date")
    if 5 in applied:
        click.echo(f"feature_token_stats filled for {filled.n_features} features (featurehouse by-token); "
                   "explanation embeddings and extra fields of rows loaded before: ingest their inputs "
                   "again with --reprocess")



@click.command("migrate")
@click.argument("old", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@warehouse_option
def migrate_cmd(old, warehouse) -> None:
    """Move a single-file DuckDB warehouse of an earlier release into a lakehouse warehouse.

    Every row, run, quarantine record and validation result is kept; the old file is left as it
    was (delete it once you are satisfied). The target defaults to the old file's folder.
    """
    from ..lake.legacy import LegacyMigrationError, migrate_file

    settings = Settings.from_env(warehouse=warehouse or old.parent)
    try:
        counts = migrate_file(old, settings)
    except (LegacyMigrationError, *_USER_ERRORS) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"migrated {old} -> {settings.warehouse}: " + ", ".join(f"{n} {t}" for t, n in counts.items() if n))
