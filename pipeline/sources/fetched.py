"""Ingesting what a window landed: the landed bodies of a window's manifest (or of one ingest
unit of it) through the ordinary ingest path, what could not be fetched recorded in
``fetch_failures``, the run closed and its verdict said (:func:`ingest_fetched`,
:func:`ingest_unit`, :func:`finish_fetched`, :func:`judge_run`).

Fetching them into the landing area is ``pipeline.sources.fetch``; when the window's fetching
began ``pipeline.sources.starts``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

from ..config import Settings
from ..ingest import ingest, new_run_id
from ..lake import runstate, s3, warehouse
from ..lake.runstate import RunSummary
from ..lake.warehouse import utcnow
from ..stages.receive import Input
from .manifest import landed_where, manifest_path, read_manifest
from .starts import first_fetch_start

__all__ = ["ingest_fetched", "ingest_unit", "in_unit", "finish_fetched", "judge_run"]

log = logging.getLogger("featurehouse.fetch")


def _window_inputs(entries: Iterable[dict[str, Any]], settings: Settings,
                   failures: list[dict[str, Any]]) -> list[Input] | Iterator[Input]:
    """The landed bodies of manifest ``entries`` as inputs; what did not land (or is gone)
    goes to ``failures``. Bodies in an S3 landing area are read ahead by a few threads (small
    ones whole; export batches stay there, for DuckDB to stream)."""
    local: list[Input] = []
    remote: list[dict[str, Any]] = []
    for e in entries:
        if e.get("status") == "landed":
            where = landed_where(e, settings.landing_root)
            if where is None:
                e = e | {"status": "failed", "last_error": "the manifest line names no digest; fetch again"}
            elif s3.is_s3(where):
                remote.append(e | {"landed_path": str(where)})
                continue
            elif Path(where).exists():
                local.append(Input(origin=e["url"], path=Path(where), captured_at=_fetched_at(e)))
                continue
            else:
                e = e | {"status": "failed", "last_error": f"landed file {where} is missing; fetch again"}
        if e.get("status") in ("failed", "not_found"):
            failures.append(e)
    if not remote:
        return local

    def read(e: dict[str, Any]) -> Input | None:
        small = (e.get("n_bytes") or 0) <= settings.max_input_bytes and e.get("kind") != "export"
        try:
            data = s3.get_bytes(e["landed_path"], settings) if small else None
        except Exception as exc:  # gone from the bucket: fetch it again next time
            failures.append(e | {"status": "failed", "last_error": f"landed object {e['landed_path']} "
                                                                   f"cannot be read ({type(exc).__name__}); fetch again"})
            return None
        return Input(origin=e["url"], data=data, captured_at=_fetched_at(e),
                     landed=(e["sha256"], e["landed_path"]))

    def ahead() -> Iterator[Input]:
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="s3-read") as pool:
            yield from local
            for i in range(0, len(remote), 64):  # bounded: at most 64 bodies in hand ahead
                yield from (x for x in pool.map(read, remote[i:i + 64]) if x is not None)

    return ahead()


def ingest_fetched(
    window: str,
    settings: Settings | None = None,
    *,
    run_id: str | None = None,
    trigger: str = "fetch",
    progress: bool | None = None,
    report_after: bool = True,
) -> RunSummary:
    """Ingest everything the window's manifest says landed, and record what did not.

    Landed bodies go through :func:`pipeline.ingest.ingest` (bytes already loaded count as
    duplicates, so running this twice loads nothing twice). Every URL whose latest outcome in
    this window is a failure or a 404 becomes a row of ``fetch_failures`` for this run; the
    run's report (``report_after``) is written after that, so it lists them.
    """
    settings = settings or Settings.from_env()
    entries = read_manifest(manifest_path(window, settings))
    run_id = run_id or new_run_id()
    failures: list[dict[str, Any]] = []
    inputs = _window_inputs(entries.values(), settings, failures)
    # The report is written after fetch_failures holds this run's rows: it lists them and judges by them.
    summary = ingest(inputs, settings, run_id=run_id, trigger=trigger, progress=progress, report_after=False)
    with warehouse.connect(settings) as conn:
        _record_failures(conn, settings, window, run_id, failures)
        if report_after:  # as in ingest: a report that cannot be written does not fail the run
            from ..ingest import write_run_report

            # the run's seconds cover every stage it lists, its report included, and the runs
            # table says the same duration (RunSummary.elapsed): the report's record moves
            # finished_at on; without a report, the end of this work does
            if not write_run_report(conn, summary, settings):
                summary.seconds, ended = summary.elapsed()
                runstate.end_run(conn, settings, run_id, ended)
    return summary


def _record_failures(conn, settings: Settings, window: str, run_id: str, failures: list[dict[str, Any]]) -> None:
    now = utcnow()

    def record(conn) -> None:
        conn.execute("DELETE FROM fetch_failures WHERE run_id = ?", [run_id])
        if failures:  # one statement from an Arrow table: executemany took 2.5 s for 970 rows
            import pyarrow as pa

            rows = pa.table({"url": [e["url"] for e in failures], "feature_key": [e["key"] for e in failures],
                             "status": [e["status"] for e in failures],
                             "attempts": pa.array([e.get("attempts") for e in failures], pa.int32()),
                             "last_error": pa.array([e.get("last_error") for e in failures], pa.string())})
            conn.register("_fetch_failures", rows)
            try:
                conn.execute('INSERT INTO fetch_failures (run_id, "window", url, feature_key, status, attempts, '
                             "last_error, recorded_at) SELECT ?, ?, url, feature_key, status, attempts, last_error, ? "
                             "FROM _fetch_failures", [run_id, window, now])
            finally:
                conn.unregister("_fetch_failures")

    warehouse.transaction(conn, settings, record, message=f"run {run_id} fetch failures", extra={"run_id": run_id})


def in_unit(entry: dict[str, Any], unit: dict[str, Any]) -> bool:
    """Whether a manifest entry belongs to an ingest unit (see :func:`pipeline.sources.night.ingest_units`):
    the unit's export files by key, or its source's pages in its index range (or all of them)."""
    if "keys" in unit:
        return entry.get("key") in unit["keys"]
    if entry.get("model") != unit["model"] or entry.get("source") != unit["source"]:
        return False
    if unit.get("all"):
        return entry.get("kind") == "offset"
    if entry.get("kind") != "feature":
        return False
    index = str(entry.get("key", "")).rsplit("/", 1)[-1]
    return index.isdigit() and unit["start"] <= int(index) < unit["stop"]


def ingest_unit(unit: dict[str, Any], settings: Settings | None = None, *, run_id: str,
                trigger: str = "airflow", progress: bool | None = False) -> RunSummary:
    """Ingest one unit of a window (one fetch chunk's pages, or one export batch file) as part
    ``unit["part"]`` of ``run_id``, alongside the other units' ingests (any machine, at once).

    Per-feature statistics are refreshed in each batch's commit; the per-source aggregates are
    left to one ``materialise`` after every unit is in, and the run's status and fetch failures
    to :func:`finish_fetched`.
    """
    settings = settings or Settings.from_env()
    entries = read_manifest(manifest_path(unit["window"], settings))
    fetch_started = first_fetch_start(unit["window"], settings)
    inputs = _window_inputs((e for e in entries.values() if in_unit(e, unit)), settings, [])
    with runstate.began_at(fetch_started):  # the first part makes the run's row: it began with the fetch
        return ingest(inputs, settings, run_id=run_id, trigger=trigger, progress=progress, report_after=False,
                      source_stats=False, part=int(unit["part"]))


def finish_fetched(window: str, settings: Settings | None = None, *, run_id: str,
                   failed_parts: int = 0) -> dict[str, Any]:
    """After a window's units are ingested: record what could not be fetched in
    ``fetch_failures`` and close the run (``failed`` when a unit failed, or ``failed_parts``
    says some did — a killed worker's part cannot say so itself: then this raises, so that what
    follows, materialise and the report, does not run on a partial load).

    The run began when the window's first fetch did (:func:`record_fetch_start`): its
    ``started_at`` is then, so its ``seconds`` are the whole night's, from the
    first fetch to this.

    Returns the run's id, status and count of fetch failures, and its verdict, which it logs
    (see :func:`judge_run`)."""

    settings = settings or Settings.from_env()
    failures: list[dict[str, Any]] = []
    entries = read_manifest(manifest_path(window, settings))
    fetch_started = first_fetch_start(window, settings)
    for e in entries.values():
        if e.get("status") in ("failed", "not_found"):
            failures.append(e)
    with warehouse.connect(settings, create=True) as conn:
        _record_failures(conn, settings, window, run_id, failures)
        status = runstate.finish_parts(conn, settings, run_id, failed_parts, started_at=fetch_started)
        if status == "failed":
            (error,) = conn.execute("SELECT error FROM runs WHERE run_id = ?", [run_id]).fetchone()
            raise RuntimeError(f"run {run_id}: an ingest part failed: {error}")
        judged = _judge(conn, run_id)
    return {"run_id": run_id, "status": status, "n_fetch_failures": len(failures)} | judged


def judge_run(where: Settings | str | os.PathLike, run_id: str) -> dict[str, str]:
    """The run's verdict (:func:`pipeline.outputs.report.verdict`), said in the log and returned
    as ``{"verdict": "FAIL", "verdict_reason": "..."}``: WARNING when it is not PASS, so that a
    task that succeeded still tells the operator reading its log that the night is not green;
    INFO when it is. The nightly's ``finish`` (through :func:`finish_fetched`) and ``report``
    tasks end with it."""
    with warehouse.connect(warehouse.settings_for(where), read_only=True) as conn:
        return _judge(conn, run_id)


def _judge(conn, run_id: str) -> dict[str, str]:
    from ..outputs.report import _run_row, verdict

    v = verdict(_run_row(conn, run_id))
    log.log(logging.INFO if v.level == "PASS" else logging.WARNING, "run %s: verdict %s: %s", run_id, v.level, v.reason)
    return {"verdict": v.level, "verdict_reason": v.reason}


def _fetched_at(entry: dict[str, Any]):
    """When a manifest entry's body was fetched (naive UTC), the capture time of what it landed."""
    try:
        return datetime.fromisoformat(entry["fetched_at"]) if entry.get("fetched_at") else None
    except ValueError:
        return None
