"""The ``featurehouse`` command: each command opens the warehouse, calls one library function,
and turns the library's named errors into a clear message and exit code.

This module holds the click group ``cli`` (with -v/--verbose and the signal handlers of the
loading commands) and ``main`` (the entry point); the commands live beside it, by group:
``loading`` (ingest), ``fetching`` (fetch features / exports), ``finding`` (search, similar,
by-token, show, index), ``querying`` (sql, shell, history, changes), ``runs`` (status, report),
``keeping`` (config, materialise, maintain, upgrade, migrate), ``sharing`` (publish, serve); what
they share in ``common`` (options, errors), ``formats`` (table, CSV, JSON) and ``stopping``
(signals)."""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading

import click

from ..signals import EARLY as _EARLY_SIGNALS
from ..signals import LOADING_COMMANDS as _LOADING_COMMANDS
from . import fetching, finding, keeping, loading, querying, runs, sharing
from .common import EXIT_VERDICT_FAIL, format_option, warehouse_option
from .formats import _print_json, _print_rows
from .loading import print_summary
from .stopping import (
    _DONE,
    _TERMINATED,
    Terminated,
    _recorded,
    _stop_if_terminated,
    _stopped_by,
    _teardown_signals,
    _terminated,
)

__all__ = ["EXIT_VERDICT_FAIL", "Terminated", "cli", "format_option", "main", "print_summary", "warehouse_option",
           "_DONE", "_TERMINATED", "_print_json", "_print_rows", "_recorded", "_stop_if_terminated", "_stopped_by",
           "_teardown_signals", "_terminated"]

# The ingest stages (Great Expectations, pandas) are imported by the commands that use them,
# so that the commands that only read (`search`, `similar`, `by-token`, `show`) start quickly.


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="featurehouse", prog_name="featurehouse")
@click.option("-v", "--verbose", is_flag=True, help="Log what each stage does.")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """featurehouse: Neuronpedia feature pages into a warehouse (DuckLake) you can query with DuckDB."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if ctx.invoked_subcommand in _LOADING_COMMANDS and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):  # from here on, the command's own handler
            signal.signal(sig, _terminated)
        if _EARLY_SIGNALS:  # (looked at once the handlers are in place: none falls in between)
            click.echo(f"featurehouse: {ctx.invoked_subcommand} {_stopped_by(_EARLY_SIGNALS[0])} before it started: "
                       "nothing was loaded", err=True)
            sys.exit(128 + _EARLY_SIGNALS[0])


for _command in (loading.ingest_cmd, fetching.fetch_group,
                 finding.search_cmd, finding.similar_cmd, finding.by_token_cmd, finding.show_cmd, finding.index_cmd,
                 querying.sql_cmd, querying.shell_cmd, querying.history_cmd, querying.changes_cmd,
                 runs.status_cmd, runs.report_cmd,
                 keeping.config_cmd, keeping.materialise_cmd, keeping.maintain_cmd, keeping.upgrade_cmd,
                 keeping.migrate_cmd,
                 sharing.publish_cmd, sharing.serve_cmd):
    cli.add_command(_command)


def _set_verbose(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        logging.getLogger().setLevel(logging.INFO)


def _verbose_everywhere(group: click.Group) -> None:
    """``-v/--verbose`` after the command too (``featurehouse ingest x -v``), as before it."""
    for command in group.commands.values():
        if isinstance(command, click.Group):
            _verbose_everywhere(command)  # its commands, and the group itself (featurehouse fetch -v features)
        if not any(p.name == "verbose" for p in command.params):
            command.params.append(click.Option(["-v", "--verbose"], is_flag=True, expose_value=False,
                                               callback=_set_verbose, help="Log what each stage does."))


_verbose_everywhere(cli)


def main() -> None:
    try:
        cli(prog_name="featurehouse")
    except Terminated as exc:  # a signal no command's own handling saw (between its steps): one line
        click.echo(f"featurehouse: {_stopped_by(exc.code - 128)}" + (f"; {_DONE[-1]}" if _DONE else ""), err=True)
        raise
    except Exception as exc:  # a PostgreSQL catalog that stopped: one line, no traceback, no password
        from ..lake import catalog_down

        line = catalog_down.said(exc)
        if line is None:
            raise
        click.echo(f"Error: {line}", err=True)
        for note in getattr(exc, "__notes__", ()):  # how the run was recorded, if it was
            click.echo(catalog_down.redact(note), err=True)
        sys.exit(1)
    finally:
        _teardown_signals()
        # The command is done and has closed what it opened; what is left is the interpreter's
        # teardown, whose garbage collections walk every object of the libraries loaded (pandas,
        # pyarrow, Great Expectations): 0.20 s of a 1.4 s unchanged re-run, measured (0.05 s
        # frozen). Frozen objects are never walked again; memory goes back with the process.
        gc.freeze()

