"""One ingest run: receive → land → parse → validate → load → materialise, in bounded batches.

Chaining only; each stage lives in its own module. Every input lands before it is parsed; an
input that cannot be parsed is recorded as rejected with its reason and the run goes on; records
that fail an expectation are quarantined. Memory stays bounded because inputs are staged,
validated and loaded in batches (``settings.batch_bytes`` of input or
``settings.batch_activations`` activations, whichever comes first).

This module holds ``ingest()`` (the batching loop, and the run's start and end as recorded) and
the run's report; the run lives beside it in rooms of one concern each: ``run.py`` (the chain:
a batch's read → stage → validate, handed to the loader thread, two connections in turn),
``intake.py`` (landing and routing each input into a batch), ``batch.py`` (what a batch
gathers), ``loading.py`` (the loader thread's write and commit of a batch, handed it as one
``LoadJob``) and ``stopping.py`` (where the run may stop for a signal). Every name other code
imports from ``pipeline.ingest`` is here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import duckdb
from tqdm import tqdm

from ..config import Settings
from ..lake import catalog_down, runstate, warehouse
from ..lake.landing import disk_full
from ..lake.runstate import RunSummary
from ..lake.warehouse import utcnow
from ..names import check_run_id
from ..signals import RAISED
from ..stages.receive import Input, iter_inputs
from .batch import _Batch
from .intake import BAD_LINE_CHECK, LINE_RECORD_CHECK
from .run import PART_BATCHES, _Run
from .stopping import _signals_held, _signals_ignored, _signals_watched, _stop_if_signalled

__all__ = ["RunSummary", "ingest", "new_run_id", "PART_BATCHES", "write_run_report", "BAD_LINE_CHECK",
           "LINE_RECORD_CHECK", "_Run", "_Batch", "_signals_held", "_signals_ignored", "_signals_watched",
           "_stop_if_signalled"]

log = logging.getLogger("featurehouse")

_MAX_INPUTS_PER_BATCH = 1000


def new_run_id(prefix: str = "run") -> str:
    """A sortable, unique run id: ``run-20261129T211500Z-1a2b3c``."""
    return f"{prefix}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:6]}"


def _expand(inputs: Iterable[str | os.PathLike | Input]) -> tuple[Iterable[Input], int | None]:
    """Paths become their files (listed up front, for a progress total); Inputs pass through lazily."""
    if isinstance(inputs, (list, tuple)):
        if all(isinstance(i, Input) for i in inputs):
            return inputs, len(inputs)
        files: list[Input] = []
        for i in inputs:
            files.extend([i] if isinstance(i, Input) else iter_inputs([i]))
        return files, len(files)
    return (i if isinstance(i, Input) else Input(origin=str(i), path=Path(i)) for i in inputs), None


def ingest(
    inputs: Iterable[str | os.PathLike | Input],
    settings: Settings | None = None,
    *,
    run_id: str | None = None,
    trigger: str = "cli",
    reprocess: bool = False,
    progress: bool | None = None,
    materialise_after: bool = True,
    source_stats: bool = True,
    report_after: bool = True,
    part: int | None = None,
) -> RunSummary:
    """Ingest files, folders or in-memory inputs into the warehouse, and return what happened.

    Re-sending bytes already landed changes nothing (they are counted as duplicates) unless
    ``reprocess`` is set. Raises only when the run itself fails (the warehouse cannot be
    written); bad inputs are recorded, never raised. Each batch is committed as one snapshot
    named after the run. With ``materialise_after`` (the default) the activation statistics of
    each batch's features are refreshed in that batch's transaction, so memory stays bounded and
    the stats always match what is committed; ``source_stats=False`` leaves the per-source
    aggregates to a later ``materialise`` (parallel loads of one source). With ``report_after``
    (the default) the run's HTML report is written last (``summary.report_path``); a report
    that cannot be written is logged and does not fail the run.

    ``part`` (0, 1, ...) makes this ingest one of several loading the same ``run_id`` at once
    (the nightly DAG's mapped ingests, each a disjoint share of the inputs): each part adds its
    counts to the run's row instead of storing its own, numbers its batches apart, and leaves
    the run's status to :func:`pipeline.lake.runstate.finish_parts`, called once all parts are done.
    """
    settings = settings or Settings.from_env()
    todo, total = _expand(inputs)
    run_id = check_run_id(run_id or new_run_id())  # it names the report: refuse "../x" before writing
    summary = RunSummary(run_id=run_id, warehouse=str(settings.warehouse), part=part,
                         started_at=utcnow() if part is None else None)  # a part's run began with its first part
    conn = warehouse.connect(settings, create=True)
    run_started: _Run | None = None
    batch: _Batch | None = None
    with _signals_watched() as came:  # a signal a step caught on the way still stops the run
        try:
            try:  # housekeeping the next run redoes: it never stops this one
                runstate.mark_abandoned(conn, settings, by=run_id)
            except Exception:
                if not came:  # (a signal, inside DuckDB "Query interrupted", stops the run just below)
                    log.exception("could not mark the abandoned runs of this host")
            _stop_if_signalled(came)
            runstate.start_run(conn, settings, summary, trigger)
            run = _Run(conn, settings, summary, reprocess, materialise_after, source_stats, report_after)
            run.signals = came
            run_started = run
            batch = _Batch()
            show = progress if progress is not None else (total is None or total > 20)
            with tqdm(total=total, unit="input", disable=not show, desc="ingest") as bar:
                for item in todo:
                    with summary.timed("land"):
                        run.intake.take(item, batch)
                    _stop_if_signalled(came)
                    bar.update(1)
                    if (batch.n_activations >= settings.batch_activations or batch.n_bytes >= settings.batch_bytes
                            or len(batch) >= _MAX_INPUTS_PER_BATCH):
                        run.flush(batch)
                        batch = _Batch()
                    bar.set_postfix(loaded=summary.n_loaded, rejected=summary.n_rejected, refresh=False)
                run.flush(batch)
                run.flush_requeued()
            run.close()
            run.use_threads(run.n_bytes)  # the statistics and the report: as large as the run
            _stop_if_signalled(came)
            summary.status = "succeeded"
        except BaseException as exc:
            # stopped by a signal: a second one waits, the failure is recorded whole (a failure of
            # another kind keeps Ctrl-C, should its recording hang on a catalog that stopped)
            stopping = bool(RAISED or came) or not isinstance(exc, Exception)
            with _signals_ignored() if stopping else contextlib.nullcontext():
                warehouse.end_statement(conn)  # a statement the signal stopped: the next ones would wait for it
                summary.status = "failed"
                if batch is not None:  # the batch being gathered: its copies are freed now, not by the collector
                    batch.free_copies()
                if run_started is not None:
                    run_started.close(failed=True)
                with contextlib.suppress(duckdb.Error):  # interrupted inside a read transaction: none open
                    conn.execute("ROLLBACK")
                with contextlib.suppress(duckdb.Error):  # interrupted while staging: the lake again
                    conn.execute(f"USE {warehouse.CATALOG}")
                catalog_gone = settings.catalog_url.startswith("postgres:") and catalog_down.said(exc, settings.catalog_url) is not None
                try:
                    if run_started is None and not conn.execute(  # stopped before its row was written
                            "SELECT count(*) FROM runs WHERE run_id = ?", [run_id]).fetchone()[0]:
                        exc.add_note("no run was recorded: nothing was loaded")
                    else:
                        summary.seconds, ended = summary.elapsed()
                        runstate.finish_run(conn, settings, summary, at=ended,
                                            error=catalog_down.redact(f"{type(exc).__name__}: {exc}"))
                        exc.add_note(f"run {run_id} is recorded as failed")
                except Exception as record_exc:
                    log.error("could not record that run %s failed", run_id,
                              exc_info=not (disk_full(record_exc) or catalog_gone))
                    exc.add_note(f"run {run_id} could not be recorded as failed "
                                 f"({catalog_down.redact(str(record_exc).splitlines()[0])}); "
                                 "the next ingest on this host records it as abandoned")
                # none can be written on a full disk or without the catalog; nor is one wanted by a
                # signal that stopped the run (inside a DuckDB statement it arrives as an Exception,
                # "Query interrupted")
                if report_after and isinstance(exc, Exception) and not disk_full(exc) and not came and not catalog_gone:
                    write_run_report(conn, summary, settings)
                conn.close()
            raise
        summary.seconds, ended = summary.elapsed()
        runstate.finish_run(conn, settings, summary, at=ended)
        try:
            if report_after:  # the run's seconds (and runs.finished_at) include its report
                write_run_report(conn, summary, settings)
            _stop_if_signalled(came)  # one that came during the report stops the process too
        except BaseException as exc:  # a signal: the run is done and recorded
            exc.add_note(f"run {run_id} is recorded as succeeded (its data is loaded); its report may not be "
                         f"written: `featurehouse report --run {run_id}` writes it")
            warehouse.end_statement(conn)  # (the report's statement the signal stopped)
            conn.close()
            raise
        conn.close()
        return summary


def write_run_report(conn: duckdb.DuckDBPyConnection, summary: RunSummary, settings: Settings) -> bool:
    """Write the run's HTML report (it records its path in ``runs.report_path``, and moves the
    run's ``finished_at`` on to when it was written, as ``summary.seconds``: one duration,
    ``RunSummary.elapsed``); a failure here is logged, not raised (False)."""
    try:
        from ..outputs import (
            report,  # charts start vl-convert's renderer: only when a report is wanted
        )

        with summary.timed("report"):
            # the Data Docs index is left to `featurehouse report` and the nightly report: it is
            # rebuilt from every result stored, a cost that grows with every run
            path = report.write_report(conn, summary.run_id, settings=settings, data_docs_index=False)
        summary.report_path = str(path)
        seconds, ended = summary.elapsed()
        runstate.record_report(conn, settings, summary.run_id, path, ended_at=ended)
        summary.seconds = seconds
        return True
    except Exception as exc:
        if RAISED:  # a signal stopped it (inside DuckDB: "Query interrupted"): the run says so, no traceback
            log.warning("the report of run %s was not written: the run was stopped", summary.run_id)
            return False
        if settings.catalog_url.startswith("postgres:") and (line := catalog_down.said(exc, settings.catalog_url)) is not None:
            log.error("could not write the report for run %s: %s; then `featurehouse report --run %s`",
                      summary.run_id, line, summary.run_id)
            return False
        if not disk_full(exc):
            log.exception("could not write the report for run %s", summary.run_id)
            return False
        # the run's data is loaded and recorded: a full disk is said, not a traceback
        log.error("could not write the report for run %s: the disk is full (%s); the run's data is "
                  "loaded: free some space, then `featurehouse report --run %s`", summary.run_id,
                  str(exc).splitlines()[0][:200], summary.run_id)
        return False
