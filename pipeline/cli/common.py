"""What every command shares: the --warehouse and --format options, the library's named errors
a command turns into a one-line message (exit 1), the warehouse opened with them, a run id
checked as an option, and the exit code of a FAIL verdict under --strict."""

from __future__ import annotations

from pathlib import Path

import click
import duckdb

from ..config import Settings
from ..lake import warehouse as warehouse_mod
from ..names import BadRunId, check_run_id

warehouse_option = click.option(
    "--warehouse",
    type=click.Path(path_type=Path),
    default=None,
    help="Warehouse folder (default: $FEATUREHOUSE_WAREHOUSE, else ./warehouse). "
         "$FEATUREHOUSE_CATALOG and $FEATUREHOUSE_DATA_PATH put the catalog and data elsewhere.",
)
format_option = click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table",
                             show_default=True, help="How to print the result.")

#: The library's named errors a command turns into a one-line message (exit 1).
_USER_ERRORS: tuple[type[BaseException], ...] = (
    warehouse_mod.WarehouseMissing, warehouse_mod.LegacyWarehouse, warehouse_mod.SchemaTooNew,
    warehouse_mod.SchemaTooOld, warehouse_mod.CommitFailed, warehouse_mod.BadCatalog, TimeoutError,
)

def _with_notes(exc: BaseException, first: bool = True) -> str:
    """The error's message and the notes the library added (e.g. how the run was recorded)."""
    return "\n".join(([str(exc)] if first else []) + list(getattr(exc, "__notes__", ())))


def _open(settings: Settings, **kw) -> duckdb.DuckDBPyConnection:
    try:
        return warehouse_mod.connect(settings, **kw)
    except _USER_ERRORS as exc:
        raise click.ClickException(str(exc)) from None

def _run_id(value: str | None, option: str) -> str | None:
    """A run id names files (the report): refuse one that cannot, as a usage error."""
    if value is None:
        return None
    try:
        return check_run_id(value)
    except BadRunId as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None

#: ``ingest --strict``'s exit code for a run whose verdict is FAIL (1 is an error, 2 a usage
#: error, 3 a fetch with failed URLs).
EXIT_VERDICT_FAIL = 4
