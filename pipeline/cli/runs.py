"""What the runs did: `status` (the recent runs, fitted to the terminal) and `report` (a run's
HTML report)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..config import Settings
from ..lake.landing import disk_full
from .common import (
    _open,
    _run_id,
    warehouse_option,
)
from .formats import _cut_middle, _print_json, _print_rows

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
    from ..outputs.report import out_of  # (status imports report already: its verdict)

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


@click.command("status")
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
    from ..outputs.report import recent_runs

    settings = Settings.from_env(warehouse=warehouse)
    with _open(settings, read_only=True) as conn:
        runs = recent_runs(conn, limit)
        if fmt == "json":
            from ..outputs.report import out_of

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



@click.command("report")
@warehouse_option
@click.option("--run", "run_id", default=None, callback=lambda ctx, param, value: _run_id(value, "--run"),
              help="The run to report (default: the latest).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for the report and index.html (default: reports/ in the warehouse folder).")
def report_cmd(warehouse, run_id, out_dir) -> None:
    """Write a run's HTML data-quality and activation report, and the index of runs."""
    from ..outputs import report

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
