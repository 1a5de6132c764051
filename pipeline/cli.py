"""The ``featurehouse`` command: each command opens the warehouse, calls one library function,
and turns the library's named errors into a clear message and exit code."""

from __future__ import annotations

import contextlib
import csv
import datetime
import decimal
import gc
import json
import logging
import math
import os
import signal
import sys
import threading
from pathlib import Path

import click
import duckdb
import orjson

from .config import Settings
from .lake import warehouse as warehouse_mod
from .lake.landing import LandingFailed, disk_full
from .names import BadRunId, check_run_id
from .signals import EARLY as _EARLY_SIGNALS
from .signals import LOADING_COMMANDS as _LOADING_COMMANDS
from .signals import RAISED as _TERMINATED
from .signals import importing

# The ingest stages (Great Expectations, pandas) are imported by the commands that use them,
# so that the commands that only read (`search`, `similar`, `by-token`, `show`) start quickly.

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


def _blob_text(b: bytes) -> str:
    """A BLOB as DuckDB writes one: printable ASCII as is, other bytes as ``\\xHH``."""
    return "".join(chr(c) if 32 <= c < 127 and c != 92 else f"\\x{c:02X}" for c in b)


def _interval_text(d: datetime.timedelta) -> str:
    """An INTERVAL as DuckDB writes one (``1 day``, ``2 days 01:30:00``), not Python's text."""
    days, secs, micros = d.days, d.seconds, d.microseconds
    parts = [f"{days} day{'' if abs(days) == 1 else 's'}"] if days else []
    if secs or micros or not parts:
        hms = f"{secs // 3600:02d}:{secs % 3600 // 60:02d}:{secs % 60:02d}"
        parts.append(hms + (f".{micros:06d}" if micros else ""))
    return " ".join(parts)


def _plain(value):
    """A query's value as JSON has it: containers walked, a DECIMAL as a number, a BLOB and an
    INTERVAL as DuckDB writes them, a time as ISO 8601, NaN and infinities as null (JSON has
    none); never a Python repr."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, decimal.Decimal):
        return int(value) if value == value.to_integral_value() and value.is_finite() else (
            float(value) if value.is_finite() else None)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _blob_text(bytes(value))
    if isinstance(value, datetime.timedelta):
        return _interval_text(value)
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    return str(value)  # UUID and the like


def _json_dumps(value, *, indent: bool = False) -> str:
    """JSON text of query results: orjson, or Python's json for integers past 64 bits (HUGEINT)."""
    plain = _plain(value)
    try:
        return orjson.dumps(plain, option=orjson.OPT_INDENT_2 if indent else 0).decode()
    except TypeError:
        return json.dumps(plain, ensure_ascii=False, indent=2 if indent else None,
                          separators=None if indent else (",", ":"))


def _csv_cell(value):
    """A CSV cell: a list, struct or map as JSON text (timestamps inside it ISO 8601, as in
    --format json), never a Python repr; a scalar as text DuckDB would write."""
    if isinstance(value, (list, tuple, dict)):
        return _json_dumps(value)
    if isinstance(value, (bytes, bytearray, memoryview, datetime.timedelta)):
        return _plain(value)
    if isinstance(value, bool):  # as DuckDB's CSV writer and every CSV reader have it, not True/False
        return "true" if value else "false"
    return value


def _unique_names(cols: list[str]) -> list[str]:
    """Column names made unique as DuckDB makes a subquery's (``a, a, a_1`` -> ``a, a_1, a_1_1``):
    a JSON object, or a row turned into one, keeps every column (``SELECT 1 AS a, 2 AS a``, a
    join's two ``extra`` columns)."""
    seen: set[str] = set()  # lower case: DuckDB's names are case-insensitive (a, A -> a, A_1)
    tried: dict[str, int] = {}  # the last suffix tried for a name: linear in the columns, not quadratic
    out = []
    for name in cols:
        unique, k = name, tried.get(name.lower(), 0)
        while unique.lower() in seen:
            k += 1
            unique = f"{name}_{k}"
        tried[name.lower()] = k
        seen.add(unique.lower())
        out.append(unique)
    return out


def _terminal_width() -> int | None:
    """The terminal's columns when stdout is one; None into a pipe or a file (then tables are
    printed whole, for grep and ``less -S``)."""
    if not sys.stdout.isatty():
        return None
    import shutil

    return shutil.get_terminal_size((120, 24)).columns


def _print_rows(cols: list[str], rows: list[tuple], fmt: str, max_rows: int = 40, max_width: int | None = None) -> None:
    """Rows as a table (DuckDB's own rendering), CSV or JSON on stdout. The table fits the
    terminal as DuckDB's own CLI fits it (long values cut, middle columns left out, said below
    it) unless ``max_width`` is given; into a pipe, whole."""
    if max_width is None:
        max_width = _terminal_width() or 10_000
    if fmt != "csv":
        cols = _unique_names(cols)
    if fmt == "csv":
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(cols)
        w.writerows([_csv_cell(v) for v in r] for r in rows)
    elif fmt == "json":
        out = [dict(zip(cols, r)) for r in rows]
        sys.stdout.write(_json_dumps(out, indent=True) + "\n")
    else:
        with duckdb.connect() as c:
            import pyarrow as pa

            c.register("result", pa.Table.from_pylist([dict(zip(cols, r)) for r in rows]) if rows
                       else pa.table({col: pa.array([], pa.string()) for col in cols}))
            c.sql("SELECT * FROM result").show(max_rows=max_rows, max_width=max_width)


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


def _print_json(value) -> None:
    """One JSON document on stdout (timestamps as ISO 8601): all a script reads there."""
    sys.stdout.write(orjson.dumps(value, default=str, option=orjson.OPT_INDENT_2).decode() + "\n")


class Terminated(SystemExit):
    "The process was sent SIGTERM or SIGINT (its code: 128 + the signal)."

    def __str__(self) -> str:
        return _stopped_by(self.code - 128) if isinstance(self.code, int) and self.code > 128 else "terminated"


def _stopped_by(signum: int) -> str:
    return "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"terminated by {signal.Signals(signum).name}"


def _recorded(settings: Settings, run_id: str | None) -> str:
    """How the run stopped by a signal is recorded, read from the warehouse: said only what is
    known (the signal may have come before the run was recorded, or after it succeeded)."""
    if run_id is None:
        return "`featurehouse status` says how its run is recorded"
    try:
        with warehouse_mod.connect(settings, read_only=True) as conn:
            row = conn.execute("SELECT status FROM runs WHERE run_id = ?", [run_id]).fetchone()
    except Exception as exc:  # no warehouse yet, or it cannot be read now
        row = None
        if isinstance(exc, warehouse_mod.WarehouseMissing) or (
                not (settings.warehouse / "catalog.sqlite").exists() and settings.catalog_kind == "sqlite"):
            return "no run was recorded: nothing was loaded"  # (missing, or begun and never made)
        return f"`featurehouse status` says how run {run_id} is recorded"
    if row is None:
        return "no run was recorded: nothing was loaded"
    if row[0] == "succeeded":
        return f"run {run_id} is recorded as succeeded (its data is loaded)"
    return f"run {run_id} is recorded as {row[0]}"


#: What stands once a command's work is done (a succeeded run): said by a signal after it.
_DONE: list[str] = []


def _teardown_signals() -> None:
    """After the command: a signal during the interpreter's teardown ends the process at once,
    with its exit code and its one line, instead of raising inside an exit handler (exit 0, a
    traceback) or ending in silence (found from outside: a Ctrl-C just after the summary)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum, frame) -> None:
        line = f"featurehouse: {_stopped_by(signum)} as it exited" + (f"; {_DONE[-1]}" if _DONE else "") + "\n"
        with contextlib.suppress(Exception):  # (a flush already under way: the line still goes)
            sys.stdout.flush()
        with contextlib.suppress(OSError):
            os.write(2, line.encode())
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(sig) is _terminated:
            signal.signal(sig, stop)


def _stop_if_terminated() -> None:
    """Raise again a signal whose handler raised but whose exception was swallowed on its way
    (see ``signals.RAISED``): the command stops as it would have."""
    if _TERMINATED:
        raise Terminated(128 + _TERMINATED[0])


def _terminated(signum, frame) -> None:
    # (frame None: called by the run at a point where it may stop, outside any import of its
    # own; another thread holding the import lock then, Great Expectations' import, is no reason
    # to wait: deferred again and again, the signal was lost when the run ended first, exit 0)
    if frame is not None and importing(frame):
        # Raised inside an import it could leave the interpreter's import lock (or the module's)
        # held for ever: every later import, and the run, hung (found from outside, SIGTERM half
        # a second in, while the warehouse was being opened). Sent again once the import is done.
        threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
        return
    _TERMINATED.append(signum)
    raise Terminated(128 + signum)  # inside a DuckDB query it surfaces as "Query interrupted"


@cli.command("ingest")
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
        from .ingest import ingest, new_run_id
        from .outputs.report import verdict
        from .stages.receive import InputNotFound

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


@cli.command("sql")
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


#: The columns ``status`` shows in a table: (heading, key of a ``report.recent_runs`` row). A run
#: can succeed (it loaded what it got) and still be a bad night: the verdict and the fetch
#: failures say so, as in --format json.
_STATUS_COLUMNS = (
    ("run_id", "run_id"), ("status", "status"), ("verdict", "verdict"), ("started_at", "started_at"),
    ("seconds", "seconds"), ("received", "n_received"), ("loaded", "n_loaded"), ("rejected", "n_rejected"),
    ("dups", "n_duplicates"), ("features", "n_features"), ("activations", "n_activations"),
    ("quarantined", "n_quarantined"), ("superseded", "n_superseded"), ("failed_checks", "n_expectations_failed"),
    ("fetch_failed", "n_fetch_failed"), ("not_found", "n_fetch_not_found"), ("why", "verdict_reason"),
)
#: What ``status`` shows without ``--wide``: the verdict, the run (its id cut in the middle when the
#: line is short: an Airflow run's is 45 characters) and why, then the failure counts a run holds,
#: then the rest, as many as the terminal holds, the why given the rest of the line (at least
#: _WHY_MIN characters). run_id names the start time too.
_STATUS_NARROW = ("verdict", "run_id", "why", "fetch_failed", "rejected", "quarantined", "status", "loaded",
                  "seconds", "started_at")
_STATUS_FAILURES = ("fetch_failed", "rejected", "quarantined")
_WHY_MIN = 24
_RUN_ID_MIN = 16


def _status_cell(run: dict, key: str):
    if key == "verdict":
        return run["verdict"].level
    if key == "verdict_reason":  # why a run is not PASS, in words
        return run["verdict"].reason if run["verdict"].level != "PASS" else ""
    if key == "seconds" and run[key] is not None:
        return round(run[key], 1)
    if key == "started_at" and run[key] is not None:
        return run[key].replace(microsecond=0)
    from .outputs.report import out_of  # (status imports report already: its verdict)

    of = out_of(run).get(key)
    if of is not None:  # a failure count says what it is out of: 50 of 100 URLs is not 1 of 40 records
        return f"{run[key] or 0:,} of {of:,}" if run[key] else "0"
    return run[key]


def _fit_status(columns: list[tuple[str, str]], rows: list[tuple], width: int) -> tuple[list, list]:
    """The narrow table's columns that fit ``width`` characters of DuckDB's box rendering, in
    _STATUS_NARROW's order of wanting (a failure count no run shown holds after the rest), the
    run id cut in the middle and the why cut to the rest of the line when they must be."""
    def need(i: int, h: str) -> int:  # a column's share of the line: its widest of name, type, values, +3
        values = [r[i] for r in rows if r[i] is not None]
        kind = {str: 7, int: 5, float: 6}.get(type(values[0]), 9) if values else 7  # varchar, int64, double
        return 3 + max([len(h), kind] + [len(str(v)) for v in values])

    index = {h: i for i, (h, _) in enumerate(columns)}
    held = [h for h in _STATUS_FAILURES if any(r[index[h]] not in (None, 0, "0") for r in rows)]
    wanted = [h for h in _STATUS_NARROW if h not in _STATUS_FAILURES or h in held]
    wanted += [h for h in _STATUS_FAILURES if h not in held]
    # the verdict, the run and the why always: the run id gives way first, down to _RUN_ID_MIN
    run_id = min(need(index["run_id"], "run_id"), max(3 + _RUN_ID_MIN, width - 1 - need(index["verdict"], "verdict")
                                                       - 3 - _WHY_MIN))
    kept, used = ["verdict", "run_id", "why"], 1 + need(index["verdict"], "verdict") + run_id + 3 + _WHY_MIN
    for h in wanted:
        if h not in kept and used + need(index[h], h) <= width:
            kept.append(h)
            used += need(index[h], h)
    room = max(_WHY_MIN, width - used + _WHY_MIN)  # what the why's column holds once the others are in
    order = [h for h, _ in columns if h in kept]
    out = []
    for r in rows:
        cells = []
        for h in order:
            v = r[index[h]]
            if h == "why" and v and len(v) > room:
                v = v[: room - 1] + "…"
            elif h == "run_id" and v:  # its head (the kind of run) and its tail (the time and the suffix)
                v = _cut_middle(v, run_id - 3)
            cells.append(v)
        out.append(tuple(cells))
    return order, out


@cli.command("status")
@warehouse_option
@click.option("-n", "--limit", default=10, show_default=True, type=click.IntRange(min=1), help="How many recent runs.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True,
              help="A table and the warehouse's totals, or the runs as one JSON list on stdout (every "
                   "runs column, seconds, verdict, verdict_reason, and what the failure counts are out of: "
                   "n_fetch_counted, the URLs that landed or failed (a 404 is neither), and n_records_read).")
@click.option("--wide", is_flag=True, help="Every count in the table (by default the columns that fit the terminal).")
def status_cmd(warehouse, limit, fmt, wide) -> None:
    """Show recent runs, their verdicts (PASS, WARN, FAIL, and why when not PASS) and counts.

    A run still marked running whose process is gone (killed) shows as abandoned; nothing is
    written (the next ingest records it).
    """
    from .outputs.report import recent_runs

    settings = Settings.from_env(warehouse=warehouse)
    with _open(settings, read_only=True) as conn:
        runs = recent_runs(conn, limit)
        if fmt == "json":
            from .outputs.report import out_of

            # with what each failure count is out of, as the table's "N of M" (review: a script
            # could not rebuild "50 of 100 URLs" from n_fetch_failed alone); not "requested": a URL
            # answered 404 is counted in neither (review: 200 "requested" beside 802 not found)
            _print_json([{k: v for k, v in r.items() if k != "verdict"}
                         | {"n_fetch_counted": out_of(r)["n_fetch_failed"], "n_records_read": out_of(r)["n_quarantined"],
                            "verdict": r["verdict"].level, "verdict_reason": r["verdict"].reason} for r in runs])
            return
        columns = [(h, c) for h, c in _STATUS_COLUMNS if wide or h in _STATUS_NARROW]
        rows = [tuple(_status_cell(r, c) for _, c in columns) for r in runs]
        heads = [h for h, _ in columns]
        if not wide and sys.stdout.isatty():  # the columns most wanted that fit the terminal, the why cut to fit
            import shutil  # (into a pipe or file: the narrow columns whole, for grep and less -S)

            heads, rows = _fit_status(columns, rows, shutil.get_terminal_size((120, 24)).columns)
        _print_rows(heads, rows, "table", max_width=10_000)
        if not wide and len(heads) < len(_STATUS_COLUMNS):
            click.echo(f"({len(_STATUS_COLUMNS) - len(heads)} more columns: featurehouse status --wide, or --format json)")
        totals = conn.sql(
            "SELECT (SELECT count(*) FROM features), (SELECT count(*) FROM activations), "
            "(SELECT count(*) FROM explanations), (SELECT count(*) FROM quarantine), "
            "(SELECT count(*) FROM raw_inputs WHERE status = 'rejected')"
        ).fetchone()
        # two lines: one held 100 characters, past an 80-column terminal (review of 45)
        click.echo("warehouse holds {:,} features, {:,} activations, {:,} explanations;\n"
                   "                {:,} quarantined records, {:,} rejected inputs".format(*totals))


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
    from .config import SCHEMAS_DIR
    from .lake.extensions import _cache_dir

    derived = {"FEATUREHOUSE_CACHE_DIR": str(_cache_dir() or "(none: no HOME)"), "FEATUREHOUSE_SCHEMAS": str(SCHEMAS_DIR)}
    rows = []
    for name, what, default, secret in _OTHER_VARIABLES:
        given = (os.environ.get(name) or "").strip()
        value = ("***" if secret else given) if given else derived.get(name, default)
        rows.append({"setting": what, "value": value, "from": f"${name}" if given else "default",
                     "variables": f"${name}"})
    return rows


def _cut_middle(v: str, room: int) -> str:
    """``v`` in at most ``room`` characters, cut in its middle (a path's head and its end stay)."""
    if len(v) <= room:
        return v
    keep = max(room - 1, 2)
    return v[: keep // 2] + "…" + v[len(v) - (keep - keep // 2):]


def _fit_config(rows: list[tuple], width: int) -> tuple[list[str], list[tuple]]:
    """The config table for a terminal of ``width`` characters: setting, value and from (the
    variables that set each are in --wide), a value cut in its middle when the line is short."""
    rows = [r[:3] for r in rows]
    need = [3 + max([len(h), 7] + [len(str(r[i])) for r in rows]) for i, h in enumerate(("setting", "value", "from"))]
    room = max(20, width - 1 - need[0] - need[2] - 3)  # the value column's characters
    return ["setting", "value", "from"], [(a, _cut_middle(str(b), room), c) for a, b, c in rows]


@cli.command("config")
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
    from .sources import plan

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


@cli.command("report")
@warehouse_option
@click.option("--run", "run_id", default=None, callback=lambda ctx, param, value: _run_id(value, "--run"),
              help="The run to report (default: the latest).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for the report and index.html (default: reports/ in the warehouse folder).")
def report_cmd(warehouse, run_id, out_dir) -> None:
    """Write a run's HTML data-quality and activation report, and the index of runs."""
    from .outputs import report

    settings = Settings.from_env(warehouse=warehouse)
    conn = _open(settings, read_only=True)
    try:
        path = report.write_report(conn, run_id, out_dir=out_dir, settings=settings)
    except (report.NoRuns, report.RunNotFound) as exc:
        raise click.ClickException(str(exc)) from exc
    except OSError as exc:  # the reports folder cannot be written: said, not a traceback
        where = exc.filename or out_dir or settings.report_dir
        why = "the disk is full" if disk_full(exc) else (exc.strerror or str(exc))
        raise click.ClickException(f"the report could not be written to {where}: {why}") from None
    finally:
        conn.close()
    click.echo(f"report {path}")
    click.echo(f"index  {path.parent / 'index.html'}")


def _at_time(ctx, param, value):
    if value is None:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a time such as 2026-11-29T03:00:00Z") from None


@cli.command("publish")
@click.argument("dest")  # text: click's Path would make s3://b/x a local s3:/b/x
@warehouse_option
@click.option("--snapshot", type=click.IntRange(min=0), default=None, help="The warehouse snapshot to publish (default: the latest).")
@click.option("--at", "at", default=None, callback=_at_time, metavar="TIME",
              help="Publish the snapshot the warehouse had at this time (UTC unless it says otherwise).")
@click.option("--tables", default=None, metavar="T1,T2",
              help="Tables to publish (default: models, sources, features, activations, explanations and the statistics).")
@click.option("--format", "fmt", type=click.Choice(["ducklake", "hf", "both"]), default="both", show_default=True,
              help="A DuckLake (DEST/featurehouse.ducklake + DEST/data/), a Hugging Face dataset (DEST/hf/), or both.")
@click.option("--url", default=None, metavar="URL",
              help="Where DEST will be served from (https://host/path or s3://bucket/prefix): the catalog names its "
                   "files there, so `ATTACH 'ducklake:URL/featurehouse.ducklake'` is all a reader needs.")
@click.option("--license", "license_", default=None, help="The licence the dataset card states (e.g. cc-by-4.0).")
@click.option("--include-private", is_flag=True,
              help="Keep the columns left out by default (input paths, hosts, errors) of the tables named.")
@click.option("--dry-run", is_flag=True, help="Say what would be written (to s3://: sent), write (send) nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout instead.")
def publish_cmd(dest, warehouse, snapshot, at, tables, fmt, url, license_, include_private, dry_run, as_json) -> None:
    """Publish a snapshot of the warehouse into DEST: a DuckLake anyone attaches read-only with one
    line (over HTTP, S3 or in place) and a Hugging Face dataset of Parquet files with its card.
    DEST is a folder or s3://bucket/prefix (the lake's S3 endpoint, region and AWS credentials).

    Publishing again into the same DEST sends only what changed: new data files, then the new
    catalog, which replaces the old one last (a reader of the old one keeps reading)."""
    from .outputs import publish

    settings = Settings.from_env(warehouse=warehouse)
    formats = ("ducklake", "hf") if fmt == "both" else (fmt,)
    names = [t.strip() for t in tables.split(",") if t.strip()] if tables else None
    stopped: list[int] = []

    def stop(signum, frame) -> None:  # said in one line below; what it wrote beside the catalog is removed
        stopped.append(signum)
        raise KeyboardInterrupt

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        to = publish.publish
        if dest.startswith("s3:/"):  # built as a folder by publish.publish's code, then uploaded
            from .outputs import publish_s3

            to = publish_s3.publish
        r = to(settings, dest, snapshot=snapshot, at=at, tables=names, formats=formats, url=url,
               license=license_, include_private=include_private, dry_run=dry_run)
    except (publish.PublishRefused, *_USER_ERRORS) as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        why = "the disk is full" if disk_full(exc) else (exc.strerror or str(exc))
        raise click.ClickException(f"could not publish into {dest}: {why} ({exc.filename or dest}); "
                                   "a publication there before is still whole") from None
    except (KeyboardInterrupt, duckdb.Error, RuntimeError) as exc:  # DuckDB: 'Query interrupted'
        if not stopped and not isinstance(exc, KeyboardInterrupt):
            raise
        signum = stopped[0] if stopped else signal.SIGINT
        click.echo(f"featurehouse: publish {_stopped_by(signum)}: {dest} holds the publication it held before "
                   "(the next publish removes what this one left); run it again to publish", err=True)
        sys.exit(128 + signum)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    if as_json:
        _print_json({"dest": r.where, "snapshot_id": r.snapshot_id, "snapshot_time": r.snapshot_time.isoformat(),
                     "dry_run": r.dry_run, "formats": list(r.formats), "bytes_written": r.bytes_written,
                     "bytes_by_format": r.bytes_by_format,
                     "files_written": r.files_written, "seconds": round(r.seconds, 2),
                     "tables": [vars(t) for t in r.tables], "open_with": r.lines(),
                     **({"s3": r.upload.as_dict()} if r.upload else {})})
        return
    verb = "would publish" if dry_run else "published"
    up = r.upload
    done = (f"{len(up.sent)} object(s), {up.bytes_sent:,} bytes sent ({up.kept} already there)" if up
            else f"{r.files_written} file(s), {r.bytes_written:,} bytes")
    click.echo(f"{verb} snapshot {r.snapshot_id} ({r.snapshot_time:%Y-%m-%d %H:%M:%S} UTC) into {r.where}"
               + ("" if dry_run else f": {done} in {r.seconds:.1f}s"))
    if up and dry_run:
        click.echo(f"would send {len(up.sent)} object(s), {up.bytes_sent:,} bytes ({up.kept} already there)"
                   + (f", remove {len(up.removed)} stale hf/ object(s)" if up.removed else "") + ":")
        for key, size in up.sent[:20]:
            click.echo(f"  {key} ({size:,} bytes)")
        if len(up.sent) > 20:
            click.echo(f"  ... and {len(up.sent) - 20} more (--json lists them all)")
    for t in r.tables:
        what = {"new": f"{t.rows:,} rows", "whole": f"{t.rows:,} rows, written whole ({t.why})",
                "changes": f"{t.rows:,} rows: +{t.added:,} -{t.removed:,}", "unchanged": f"{t.rows:,} rows, unchanged"}[t.how]
        click.echo(f"  {t.table:<26} {what}")
    if not dry_run:
        click.echo("open it with:")
        for line in r.lines():
            click.echo(f"  {line}")


@cli.command("serve")
@warehouse_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (loopback by default: the app has no login).")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
def serve_cmd(warehouse, host, port) -> None:
    """Browse the warehouse in a web browser: search, features, sources, runs, SQL (read-only).

    Every view is a URL; nothing is written. Builds the find index first when there is none."""
    import uvicorn

    from .outputs import find, web

    settings = Settings.from_env(warehouse=warehouse)
    try:
        warehouse_mod.connect(settings, read_only=True).close()
        try:
            find.Finder(settings).close()
        except find.FindIndexMissing:
            click.echo("building the find index (search, similar, by-token) ...", err=True)
            find.build_index(settings)
        app = web.make_app(settings, host=host)
    except (*_USER_ERRORS, find.FindIndexUnwritable) as exc:
        raise click.ClickException(str(exc)) from None
    if host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"warning: listening on {host}: anyone who can reach this machine on port {port} can read the "
                   "whole warehouse (there is no login)", err=True)
    click.echo(f"featurehouse: http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/ (Ctrl-C stops it)",
               err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


@cli.command("materialise")
@warehouse_option
@click.option("--run-id", default=None, help="Refresh only the features this run changed (default: all).")
def materialise_cmd(warehouse, run_id) -> None:
    """Rebuild the activation statistics tables."""
    from .stages import materialise

    settings = Settings.from_env(warehouse=warehouse)
    with _open(settings) as conn:
        r = materialise.refresh(conn, settings, run_id)
    rows = (f"{r.feature_stats_rows} feature stats rows over {r.n_features} features "
            f"and {r.source_stats_rows} source stats rows over {r.n_sources} sources")
    if r.unchanged:  # (review: "refreshed" when nothing was written)
        click.echo(f"unchanged: the {rows} already hold what they would be computed as; nothing committed")
    else:
        click.echo(f"refreshed {rows}")


@cli.command("history")
@click.argument("feature", metavar="MODEL/SOURCE/INDEX")
@warehouse_option
@format_option
def history_cmd(feature, warehouse, fmt) -> None:
    """Show a feature's versions over time: when each capture was loaded (or another feature's
    capture took some of its activations), by which run, and its max activation, number of
    activations and explanations as of then."""
    from .lake.history import BadFeatureKey, feature_history, parse_key

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


@cli.command("changes")
@click.option("--since", required=True, metavar="RUN_ID|TIMESTAMP",
              help="A run id (changes from just before that run) or a timestamp such as 2026-11-29T03:00:00Z "
                   "(a time without a zone is UTC).")
@warehouse_option
@format_option
@click.option("--max-rows", default=100, show_default=True, help="Rows shown in table format.")
def changes_cmd(since, warehouse, fmt, max_rows) -> None:
    """List the features added, removed and changed since a run or a moment, with what changed."""
    from .lake.history import HistoryUnavailable, changes_since, describe

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


@cli.command("maintain")
@warehouse_option
@click.option("--retention-days", type=click.FloatRange(min=0), default=None,
              help="Keep history this long (default: $FEATUREHOUSE_RETENTION_DAYS, else 90).")
@click.option("--grace-minutes", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Files no snapshot uses are deleted once they are this old (readers may still hold them).")
def maintain_cmd(warehouse, retention_days, grace_minutes) -> None:
    """Expire old snapshots, merge small files and delete files nothing references."""
    from datetime import timedelta

    from .lake.maintain import MaintenanceRefused, maintain

    settings = Settings.from_env(warehouse=warehouse)
    try:
        r = maintain(settings, retention_days=retention_days, grace=timedelta(minutes=grace_minutes))
    except (MaintenanceRefused, *_USER_ERRORS) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"snapshots {r.snapshots_before} -> {r.snapshots_after} ({r.snapshots_expired} older than "
               f"{r.retention_days:g} days expired); "
               f"data files {r.files_before} -> {r.files_after} ({r.bytes_before:,} -> {r.bytes_after:,} bytes) "
               f"in {r.seconds:.1f}s")


@cli.command("upgrade")
@warehouse_option
def upgrade_cmd(warehouse) -> None:
    """Bring the warehouse's schema up to this release (any write command also does)."""
    settings = Settings.from_env(warehouse=warehouse)
    with _open(settings, migrate=False) as conn:
        before = warehouse_mod.schema_version(conn)
        applied = warehouse_mod.apply_migrations(conn, settings)
        if 5 in applied:  # feature_token_stats is new: filled for the features loaded before
            from .stages import materialise

            filled = materialise.refresh(conn, settings)
    after = before + len(applied)
    click.echo(f"schema version {before} -> {after}" if applied else f"schema version {before}: up to date")
    if 5 in applied:
        click.echo(f"feature_token_stats filled for {filled.n_features} features (featurehouse by-token); "
                   "explanation embeddings and extra fields of rows loaded before: ingest their inputs "
                   "again with --reprocess")


@cli.command("migrate")
@click.argument("old", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@warehouse_option
def migrate_cmd(old, warehouse) -> None:
    """Move a single-file DuckDB warehouse of an earlier release into a lakehouse warehouse.

    Every row, run, quarantine record and validation result is kept; the old file is left as it
    was (delete it once you are satisfied). The target defaults to the old file's folder.
    """
    from .lake.legacy import LegacyMigrationError, migrate_file

    settings = Settings.from_env(warehouse=warehouse or old.parent)
    try:
        counts = migrate_file(old, settings)
    except (LegacyMigrationError, *_USER_ERRORS) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"migrated {old} -> {settings.warehouse}: " + ", ".join(f"{n} {t}" for t, n in counts.items() if n))


# --- find features (pipeline.outputs.find): kept free of the ingest stages' imports -------------


def _refresh_find(settings: Settings) -> None:
    """After a load: refresh the find index, if this warehouse has one (on stderr; a failure
    is reported, the load stands)."""
    from .outputs import find

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
        from .outputs.find import printable

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
    from .outputs import find

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
    from .outputs.find import parse_key

    try:
        parse_key(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="MODEL/SOURCE/INDEX") from None
    return value


@cli.command("search")
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
    from .outputs.find import NoSuchSource, QueryHoldsNoWord

    with _finder(warehouse, refresh) as finder:
        try:
            found = finder.search(query, model=model, source=source, limit=limit)
        except (QueryHoldsNoWord, NoSuchSource) as exc:
            raise click.UsageError(str(exc)) from None
        _print_found(found, fmt)


@cli.command("similar")
@click.argument("feature", metavar="MODEL/SOURCE/INDEX", callback=lambda ctx, param, value: _feature_key(value))
@_find_options
def similar_cmd(feature, warehouse, model, source, limit, fmt, refresh) -> None:
    """The features nearest to FEATURE, across sources and models unless --model/--source
    narrow them: by cosine similarity of their explanations' embeddings (exact), or, for a
    feature without one, by the overlap of its top activating tokens and top positive logits.
    The basis column says which."""
    from .outputs.find import NoSuchFeature, NoSuchSource

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


@cli.command("by-token")
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
    from .outputs.find import NoSuchSource

    with _finder(warehouse, refresh) as finder:
        try:
            found = finder.by_token(token, ignore_case=ignore_case, strip=strip, model=model, source=source,
                                    data_source=data_source, limit=limit)
        except NoSuchSource as exc:
            raise click.UsageError(str(exc)) from None
        _print_found(found, fmt, {"description": 50})


@cli.command("show")
@click.argument("feature", metavar="MODEL/SOURCE/INDEX", callback=lambda ctx, param, value: _feature_key(value))
@warehouse_option
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the feature as a self-contained HTML page, tokens shaded by activation.")
@click.option("--excerpts", default=5, show_default=True, type=click.IntRange(0, 200), help="Top excerpts shown.")
@click.option("--neighbours", default=5, show_default=True, type=click.IntRange(0, 100), help="Nearest features shown.")
def show_cmd(feature, warehouse, html_path, excerpts, neighbours) -> None:
    """One feature as a person reads it: statistics per data source, explanations, top excerpts
    (the peak token in [[ ]]) and nearest features."""
    from .outputs import find

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


@cli.command("index")
@warehouse_option
@click.option("--full", is_flag=True, help="Build from scratch instead of refreshing what changed.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def index_cmd(warehouse, full, fmt) -> None:
    """Build or refresh the find index (the derived file search, similar, by-token and show
    read) from the warehouse's last snapshot. Ingest refreshes it once it exists."""
    from .outputs import find

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


@cli.command("shell")
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

    from .lake.extensions import install_all

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


# --- fetch ---------------------------------------------------------------------------------


def _span(value: str | None, option: str) -> range | None:
    """``A:B`` → range(A, B): A up to but not including B."""
    if value is None:
        return None
    a, sep, b = value.partition(":")
    if not (sep and a.strip().isdigit() and b.strip().isdigit() and int(a) < int(b)):
        raise click.BadParameter(f"{value!r} is not A:B with whole numbers A < B (B is excluded)",
                                 param_hint=option)
    return range(int(a), int(b))


def _fetch_options(f):
    """Options every fetch command takes."""
    options = [
        click.option("--model", required=True, help="Neuronpedia model id, e.g. gpt-oss-20b."),
        click.option("--source", required=True,
                     help="Source (SAE) id, Neuronpedia's 'layer', e.g. 11-resid-post-aa."),
        warehouse_option,
        click.option("--window", default=None,
                     help="Name of this fetch (default: a fresh id). Re-running with the same window "
                          "skips what already landed in it; Airflow passes the run's data interval."),
        click.option("--concurrency", default=None, type=click.IntRange(1, 64),
                     help="Requests in flight at once [features: 4, exports: 2]."),
        click.option("--requests-per-hour", default=20_000, show_default=True, type=click.IntRange(1),
                     help="Request budget (Neuronpedia allows 25,000 an hour per IP on /api)."),
        click.option("--timeout", default=None, type=click.FloatRange(min=0.01),
                     help="Seconds to wait for each answer [features: 30, exports: 60]."),
        click.option("--max-attempts", default=6, show_default=True, type=click.IntRange(1),
                     help="Attempts per URL before it is recorded as failed."),
        click.option("--backoff", default=1.0, show_default=True, type=click.FloatRange(min=0),
                     help="First wait between attempts, in seconds; it doubles (with jitter) up to "
                          "a minute, and a Retry-After answer overrides it."),
        click.option("--no-progress", is_flag=True, help="Hide the progress bar."),
        click.option("--strict", is_flag=True, help="Exit 4 when the run's verdict is FAIL (for cron and scripts)."),
        click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True,
                     help="The run's summary for a person, or as one JSON object on stdout (the summary's "
                          "fields, the fetch's counts and failures, verdict, verdict_reason)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _fetch_then_ingest(settings: Settings, window: str, fetch, no_progress: bool, strict: bool = False,
                       fmt: str = "table") -> None:
    from .outputs.report import verdict
    from .sources.fetch import ingest_fetched

    click.echo(f"fetch window {window}", err=True)
    # A SIGTERM (a timeout, `kill`, Airflow stopping the task) stops the fetch as Ctrl-C does:
    # the downloads under way are given up and their partial files removed, the rest kept (the
    # handlers are the group's, see `cli`).
    from .ingest import new_run_id
    from .sources.api import BadApiKey
    from .sources.exports import remove_spooled

    try:
        result = fetch()
    except BadApiKey as exc:
        raise click.ClickException(str(exc)) from None
    except (KeyboardInterrupt, Terminated):
        removed = remove_spooled()
        signum = _TERMINATED[0] if _TERMINATED else signal.SIGINT
        click.echo(f"\nfetch {_stopped_by(signum)}: what landed is kept"
                   + (f", {removed} partial download(s) removed" if removed else "")
                   + f"; run the same command with --window {window} to fetch only the rest", err=True)
        # now, not at the interpreter's exit, which would join the download threads: one blocked
        # reading a slow body would hold a stopped process for as long as the body takes
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)
    run_id = new_run_id()
    try:
        summary = ingest_fetched(window, settings, run_id=run_id, trigger="fetch",
                                 progress=False if no_progress else None)
    except BaseException as exc:
        signum = _TERMINATED[0] if _TERMINATED else signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None
        if signum is None:
            raise
        notes = "; ".join(getattr(exc, "__notes__", ())) or _recorded(settings, run_id)
        click.echo(f"featurehouse: the ingest of what was fetched was {_stopped_by(signum)}; "
                   f"{notes}; run the same command with --window {window} to ingest what is not loaded (nothing "
                   "landed is fetched again)", err=True)
        sys.exit(128 + signum)
    r = result
    judged = verdict(summary.as_dict() | {"n_fetch_failed": r.n_failed})
    if fmt == "json":
        _print_json(summary.as_dict() | {
            "fetch": {"window": r.window, "n_requested": r.n_requested, "n_landed": r.n_landed,
                      "n_already_landed": r.n_skipped_already_landed, "n_not_found": r.n_not_found,
                      "n_failed": r.n_failed, "seconds": round(r.seconds, 3), "failures": r.failures},
            "verdict": judged.level, "verdict_reason": judged.reason})
        _refresh_find(settings)
        if strict and judged.level == "FAIL":  # docs/fetching.md: 4 with --strict, before 3
            sys.exit(EXIT_VERDICT_FAIL)
        if r.n_failed:
            sys.exit(3)
        return
    print_summary(summary)
    _refresh_find(settings)
    click.echo(
        f"  fetch    window {r.window}: requested {r.n_requested}, landed {r.n_landed}, "
        f"already landed {r.n_skipped_already_landed}, not found {r.n_not_found}, "
        f"failed {r.n_failed} in {r.seconds:.1f}s"
    )
    for f in r.failures[:20]:
        status = f"HTTP {f['http_status']}, " if f.get("http_status") else ""
        click.echo(f"  failed   {f['url']}\n           ({status}{f['attempts']} attempts) {f['last_error']}")
    if len(r.failures) > 20:
        click.echo(f"  ... and {len(r.failures) - 20} more failed")
    if r.n_failed or r.n_not_found:
        click.echo("  fetch failures: featurehouse sql \"SELECT url, status, attempts, last_error "
                   f"FROM fetch_failures WHERE run_id = '{summary.run_id}'\"")
    click.echo(f"  verdict  {judged.level}: {judged.reason}")
    if r.n_failed:
        click.echo(f"  re-run with --window {r.window} to retry only what did not land")
    if strict and judged.level == "FAIL":
        sys.exit(EXIT_VERDICT_FAIL)
    if r.n_failed:
        sys.exit(3)


@cli.group("fetch")
def fetch_group() -> None:
    """Fetch feature pages from Neuronpedia (feature API or bulk exports), then ingest them.

    Each command lands what it fetches, ingests it, and prints the run summary and the URLs
    that still failed after the retry budget. Exits 3 when some failed, 0 otherwise (a feature
    Neuronpedia does not have is reported as not found, not as a failure).
    """


@fetch_group.command("features")
@click.option("--index", "indices", multiple=True, type=click.IntRange(0), help="A feature index (repeatable).")
@click.option("--range", "span", default=None, metavar="A:B", help="Features A up to B (B excluded).")
@click.option("--all", "all_features", is_flag=True,
              help="Every feature of the source that has activations (pages through features-offset).")
@click.option("--base-url", default="https://www.neuronpedia.org", show_default=True, envvar="NEURONPEDIA_BASE_URL",
              show_envvar=True, help="Neuronpedia site (or a mirror, or a local fake).")
@click.option("--api-key", envvar="NEURONPEDIA_API_KEY", show_envvar=True, default=None,
              help="Sent only as the x-api-key header, never logged. Prefer the environment variable: "
                   "a command-line argument is visible to other users.")
@_fetch_options
def fetch_features_cmd(indices, span, all_features, base_url, api_key, model, source, warehouse, window,
                       concurrency, requests_per_hour, timeout, max_attempts, backoff, no_progress, strict, fmt) -> None:
    """Fetch features through GET /api/feature/{model}/{source}/{index} and ingest them."""
    from .ingest import new_run_id
    from .sources.fetch import fetch_features

    wanted = _span(span, "--range")
    if bool(indices or wanted is not None) == all_features:
        raise click.UsageError("say which features: --index (repeatable) and/or --range A:B, or --all")
    chosen = None if all_features else sorted(set(indices) | set(wanted or ()))
    settings = Settings.from_env(warehouse=warehouse)
    window = window or new_run_id("fetch")
    _fetch_then_ingest(settings, window, lambda: fetch_features(
        model, source, chosen, all_features=all_features, settings=settings, base_url=base_url,
        api_key=api_key or None, concurrency=concurrency or 4, requests_per_hour=requests_per_hour,
        window=window, timeout=timeout or 30.0, max_attempts=max_attempts, backoff=backoff,
        progress=False if no_progress else None,
    ), no_progress, strict, fmt)


@fetch_group.command("exports")
@click.option("--batches", "span", default=None, metavar="A:B",
              help="Only batch files A up to B (B excluded) of each table. Tables number batches "
                   "differently: features and explanations batches are in text order of the index "
                   "(batch 0: 0, 1, 10, 100, ...), activations batch N holds features N*1024 to "
                   "N*1024+1023, so the same numbers cover different features. Default: every batch.")
@click.option("--exports-url", default="https://neuronpedia-datasets.s3.amazonaws.com", show_default=True,
              envvar="NEURONPEDIA_EXPORTS_URL", show_envvar=True, help="The public bulk-export bucket (anonymous HTTPS; no API key is sent to it).")
@_fetch_options
def fetch_exports_cmd(span, exports_url, model, source, warehouse, window, concurrency, requests_per_hour,
                      timeout, max_attempts, backoff, no_progress, strict, fmt) -> None:
    """Fetch a source's bulk exports (S3 bucket, v1/{model}/{source}/) and ingest them."""
    from .ingest import new_run_id
    from .sources.fetch import fetch_exports

    batches = _span(span, "--batches")
    settings = Settings.from_env(warehouse=warehouse)
    window = window or new_run_id("fetch")
    _fetch_then_ingest(settings, window, lambda: fetch_exports(
        model, source, batches=batches, settings=settings, exports_url=exports_url, window=window,
        timeout=timeout or 60.0, max_attempts=max_attempts, concurrency=concurrency or 2,
        requests_per_hour=requests_per_hour, backoff=backoff, progress=False if no_progress else None,
    ), no_progress, strict, fmt)


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
        from .lake import catalog_down

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


if __name__ == "__main__":
    main()
