"""`featurehouse ingest`: files and folders loaded into the warehouse, the run's summary and
verdict printed, stopped cleanly by a signal."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click
import duckdb

from ..config import Settings
from ..lake.landing import LandingFailed, disk_full
from .common import (
    _USER_ERRORS,
    EXIT_VERDICT_FAIL,
    _run_id,
    _with_notes,
    warehouse_option,
)
from .finding import _refresh_find
from .formats import _print_json
from .stopping import _DONE, _TERMINATED, Terminated, _recorded, _stop_if_terminated, _stopped_by


def print_summary(s) -> None:
    """Print a run's summary for a person."""
    click.echo(f"run {s.run_id}: {s.status} in {s.seconds:.1f}s -> {s.warehouse}")
    # two ways every received input is counted once: by where its bytes were, by what became of it
    click.echo(
        f"  inputs   received {s.n_received} = new {s.n_landed} + read again {s.n_reread} + "
        f"already landed {s.n_duplicates} + not readable {s.n_unread}"
    )
    unread = f" ({s.n_unread} not readable)" if s.n_unread else ""
    click.echo(f"           loaded {s.n_loaded}, rejected {s.n_rejected}{unread}, skipped {s.n_duplicates}")
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


@click.command("ingest")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@warehouse_option
@click.option("--run-id", default=None, callback=lambda ctx, param, value: _run_id(value, "--run-id"),
              help="Name the run (an Airflow task passes its data interval); letters, digits and . _ : + -.")
@click.option("--reprocess", is_flag=True, help="Parse and load inputs again even if already landed.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@click.option("--strict", is_flag=True,
              help=f"Exit {EXIT_VERDICT_FAIL} when the run's verdict is FAIL (for cron and scripts).")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True,
              help="The run's summary for a person, or as one JSON object on stdout (the summary's "
                   "fields, verdict, verdict_reason, report_path); progress and logs go to stderr.")
def ingest_cmd(paths, warehouse, run_id, reprocess, no_progress, strict, fmt) -> None:
    """Ingest feature pages from files and folders (any mix, recursively).

    Accepts API JSON, captured flight text, saved HTML and gzip of any of them, and bulk-export
    JSON lines. The run's verdict (PASS, WARN or FAIL; see its report) is printed with its summary.

    \b
    Exit codes:
      0  the run completed, whatever its verdict (some inputs may have been rejected)
      1  the run could not complete (the message says why)
      2  a usage error (a path that does not exist, a bad --run-id)
      4  --strict and the run's verdict is FAIL
    """
    # A SIGTERM (a timeout, Airflow stopping a task, `kill`) or Ctrl-C ends the run as failed,
    # recorded, instead of leaving it `running` until a later run finds its process gone (the
    # handlers are the group's, see `cli`).
    try:  # (a signal before the run: it was not recorded, nothing was loaded)
        from ..ingest import ingest, new_run_id
        from ..outputs.report import verdict
        from ..stages.receive import InputNotFound

        settings = Settings.from_env(warehouse=warehouse)
        run_id = run_id or new_run_id()  # known here: what the warehouse recorded of it can be said
    except Terminated as exc:
        click.echo(f"featurehouse: ingest {_stopped_by(exc.code - 128)} before it started: nothing was loaded", err=True)
        sys.exit(exc.code)
    try:
        summary = ingest(paths, settings, run_id=run_id, reprocess=reprocess,
                         progress=False if no_progress else None)
    except InputNotFound as exc:
        raise click.UsageError(str(exc)) from exc
    except (LandingFailed, *_USER_ERRORS) as exc:
        raise click.ClickException(_with_notes(exc)) from None
    except (OSError, duckdb.IOException) as exc:
        if disk_full(exc):
            raise click.ClickException(f"the warehouse could not be written: {str(exc).splitlines()[0]} (the disk "
                                       f"that holds it is full); the run stopped\n{_with_notes(exc, first=False)}") from None
        if isinstance(exc, PermissionError) or "Permission denied" in str(exc) or "Operation not permitted" in str(exc):
            # a folder this user may not write (a read-only copy, a mount, an immutable file): say so, not a traceback
            where = getattr(exc, "filename", None) or settings.warehouse
            raise click.ClickException(f"the warehouse could not be written: permission denied on {where} "
                                       f"({str(exc).splitlines()[0]}; this user may not write there); the run "
                                       f"stopped\n{_with_notes(exc, first=False)}") from None
        raise
    except BaseException as exc:
        signum = _TERMINATED[0] if _TERMINATED else signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None
        if signum is not None:  # ingest has recorded the run (as failed, unless only its report was left)
            notes = "; ".join(getattr(exc, "__notes__", ())) or _recorded(settings, run_id)
            click.echo(f"featurehouse: ingest {_stopped_by(signum)}; {notes}", err=True)
            sys.exit(128 + signum)
        raise
    # from here a signal stops a run that is done: said so, to the process's last instant
    _DONE.append(f"run {summary.run_id} is recorded as succeeded (its data is loaded)")
    indexed, refreshing = (settings.find_index_dir / "index.duckdb").exists(), False
    try:
        # a CLI ingest fetches nothing, so the summary holds every figure the verdict weighs
        judged = verdict(summary.as_dict())
        if fmt == "json":
            _print_json(summary.as_dict() | {"verdict": judged.level, "verdict_reason": judged.reason})
        else:
            print_summary(summary)
            click.echo(f"  verdict  {judged.level}: {judged.reason}")
        _stop_if_terminated()  # one whose exception was swallowed after the run's last point to stop
        refreshing = indexed
        _refresh_find(settings)
        _stop_if_terminated()
    except (Terminated, KeyboardInterrupt):
        signum = _TERMINATED[0] if _TERMINATED else signal.SIGINT
        click.echo(f"featurehouse: {_stopped_by(signum)} {'while refreshing the find index' if refreshing else 'after its run'}; "
                   + _DONE[-1] + (": `featurehouse index` brings the index up to date" if refreshing else ""), err=True)
        sys.exit(128 + signum)
    if strict and judged.level == "FAIL":
        sys.exit(EXIT_VERDICT_FAIL)
