"""The run: one ingest's batches through the stages it chains. The intake (``intake.py``) lands
and routes each input into a batch; ``flush`` takes the batch through read → stage → validate on
one DuckDB connection and hands it, as one ``LoadJob``, to the loader thread (``loading.py``:
write → statistics → commit), then stages the next batch on the other connection."""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime
from typing import Any

import duckdb
import orjson
import pyarrow as pa

from ..config import Settings
from ..lake import warehouse
from ..lake.landing import disk_full, read_landed
from ..lake.runstate import COUNTERS, RunSummary
from ..lake.warehouse import utcnow
from ..stages import stage, validate
from ..stages.captures import claim_captures
from ..stages.land import Landed
from ..stages.parse import NotAnObject, Rejected, parse_export_line
from ..stages.records import InputFormat, ParsedInput
from .batch import _Batch
from .intake import BAD_LINE_CHECK, LINE_RECORD_CHECK, _Intake, _line_as_record
from .loading import _DATA_TABLES, LoadJob, _forget, _Loader
from .stopping import _signals_held, _stop_if_signalled

log = logging.getLogger("featurehouse")

PART_BATCHES = 100_000
"""Batch numbers of one part of a run: part i numbers its batches from i * PART_BATCHES + 1."""


class _Run:
    """One run's inputs through the stages. ``intake.take`` receives an input: land → new? →
    route (which road reads it), into the batch the caller gathers. ``flush`` takes a batch
    through read → stage → validate, then hands it to the loader thread as one ``LoadJob``
    (``loader``: write → statistics → commit) and goes on with the next batch;
    ``loader.record_seen`` commits a batch of inputs seen before.

    Two batches are in hand at most: one loading, one being landed, read and validated, each on
    a DuckDB connection of its own (the staging tables are a connection's temp tables). DuckDB
    releases the GIL while it writes the loading batch's files, so the next batch's landing,
    read and Great Expectations' judging use the other core. The loads commit one at a time, in
    batch order; a batch's load starts only after the one before it committed, so it decides
    what it replaces against the latest snapshot, as a lone batch does.
    """

    def __init__(self, conn: duckdb.DuckDBPyConnection, settings: Settings, summary: RunSummary,
                 reprocess: bool, materialise: bool = True, source_stats: bool = True, report_after: bool = False):
        self.conn = conn
        self.report_after = report_after
        self.settings = settings
        self.summary = summary
        self.primary = conn
        self.spare: duckdb.DuckDBPyConnection | None = None  # the second connection, made when needed
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="load")
        self._loading: Future | None = None  # the batch loading in the loader thread
        self.signals: list[tuple[int, Any, bool]] = []  # see _signals_watched
        # the thread starts now: started by the first batch's submit, a signal inside
        # Thread.start could leave a thread loading that the pool does not know to wait for
        self._load_pool.submit(int).result()
        self.cores = int(conn.execute("SELECT current_setting('threads')").fetchone()[0])
        self.threads = self.cores
        self.n_bytes = 0  # input bytes of the batches flushed so far
        self.use_threads(0)  # the run's bookkeeping is small statements: one thread
        self.scratch = settings.warehouse / ".tmp" / f"pages-{uuid.uuid4().hex}"
        # parts of one run number their batches apart: part i's are i * PART_BATCHES + 1, + 2, ...
        self.batch_no = (summary.part or 0) * PART_BATCHES
        self.retimed_any = False  # a batch decided a retime since flush_requeued last looked
        self.intake = _Intake(conn, settings, summary, reprocess)  # landing and routing
        self._store_pool = ThreadPoolExecutor(1, thread_name_prefix="gx-store")
        self._warming: threading.Thread | None = None  # the import of Great Expectations, in a thread
        self._warm_up_started = False  # at the first batch with records to judge
        self._stored: Future | None = None
        self._writing = threading.Event()  # the batch loading has begun writing its files
        self.loader = _Loader(settings, summary, reprocess, materialise, source_stats,  # the loader thread's work
                              self.intake.captured, self._writing.set)

    def use_threads(self, n_bytes: int) -> None:
        """Give DuckDB one worker thread per ``settings.bytes_per_thread`` of the ``n_bytes`` of
        input in hand, at least one, at most one per core: worker threads spin on the many small
        statements of a small batch (measured: one page 3.1 s of CPU on two threads, 2.0 s on
        one, in less time) and only pay off on large reads and writes."""
        per = self.settings.bytes_per_thread
        want = self.cores if per <= 0 else max(1, min(self.cores, n_bytes // per))
        if want != self.threads:
            self.wait_loaded()  # a global setting: not while the loader's statement runs
            self.conn.execute(f"SET threads = {int(want)}")
            self.threads = want

    def flush(self, batch: _Batch) -> None:
        """The batch through the stages: read (DuckDB, or Python for what DuckDB cannot read) →
        stage → validate → load, one commit."""
        if not len(batch):
            return
        self.n_bytes += batch.n_bytes
        self.use_threads(batch.n_bytes)
        if batch.again:  # decided against what is committed: the batch loading first
            self.wait_loaded()
        if self.intake.decide_again(self.conn, batch):
            self.retimed_any = True
        if not (batch.inputs or batch.fast or any(batch.exports.values())):
            # Only inputs landed before (an unchanged re-run): nothing to parse, validate or load,
            # so no Great Expectations and no staging; record that this run saw them.
            self.wait_loaded()
            self.loader.record_seen(self.conn, batch)
            return
        self.batch_no += 1
        batch.scratch = self.scratch / f"batch-{self.batch_no}"
        now = utcnow()
        if not self._warm_up_started and (batch.parsed or batch.fast or any(batch.exports.values())) \
                and validate.needs_great_expectations(self.settings.data_docs):
            # Import Great Expectations (~3 s of Python) while DuckDB reads, which releases the
            # GIL; started earlier it would slow down landing, which needs the GIL too. Not for a
            # batch of refused inputs only: it has no record to validate.
            self._warm_up_started = True
            self._warming = threading.Thread(target=validate.warm_up, name="gx-warm-up", daemon=True)
            self._warming.start()
        timed, conn = self.summary.timed, self.conn
        try:
            with warehouse.scratch_first(conn):  # temp tables only until the load
                with timed("read"):
                    self._read_pages(batch)
                    self._read_exports(batch)
                with timed("stage"):
                    self._stage(batch)
                    superseded = claim_captures(conn)
                with timed("validate"):
                    outcome = self._validate(now)
            _stop_if_signalled(self.signals)  # not a batch read or judged across a signal
        except BaseException:  # (a statement a signal stopped was ended by scratch_first)
            self._warmed_up()
            _forget(conn, batch)
            raise
        finally:
            self.intake.digests.save()
        # one load at a time, in batch order; this batch's connection is the loader's until it is
        # committed, and the next batch is staged on the other one
        self.wait_loaded()
        base = {c: getattr(self.summary, c) for c in COUNTERS}  # the counts as of this batch
        job = LoadJob(conn, batch, outcome, superseded, now, self.batch_no, base)
        self._writing.clear()
        if warehouse.holds_write_lock(self.settings):
            # the caller holds the commit lock, which is re-entrant in its own thread only
            self._loading = Future()
            self._loading.set_result(self.loader.load_batch(job))
        else:
            self._loading = self._load_pool.submit(self.loader.load_batch, job)
        self.conn = self._other(conn)

    def _other(self, conn: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
        """The connection the loader is not using: the next batch is staged on it."""
        if conn is not self.primary:
            return self.primary
        if self.spare is None:
            self.spare = self.primary.cursor()  # the same database (the lake attached), its own temp tables
            self.spare.execute(f"USE {warehouse.CATALOG}")
        return self.spare

    def wait_loaded(self) -> None:
        """Wait until the batch loading (if any) is committed, and count what it loaded; its
        error, if it failed, is raised here."""
        loading = self._loading
        if loading is None:
            return
        try:
            delta, counts = loading.result()
        except BaseException:
            # the load failed: its error is raised here, once. (A signal that interrupted the
            # wait leaves the batch for close() to wait for and count.)
            if loading.done() and loading.exception() is not None:
                self._loading = None
            raise
        with _signals_held():  # counted and forgotten together: a signal waits for both
            s = self.summary
            if s.part is not None:
                s.written = counts
            for c, n in delta.items():
                setattr(s, c, getattr(s, c) + n)
            self._loading = None

    def flush_requeued(self) -> None:
        """Read the inputs commits sent back (see ``_Loader._requeue``), until none is. Waits for
        the batch loading only when a batch retimed something (else the report's work overlaps
        the last load, see :meth:`close`)."""
        while self.retimed_any:
            self.retimed_any = False
            self.wait_loaded()
            if not self.loader.requeued:
                return
            batch = _Batch()
            batch.again, self.loader.requeued = self.loader.requeued, []
            self.flush(batch)

    def _read_pages(self, batch: _Batch) -> None:
        """DuckDB reads one-line API-JSON pages; one it cannot read cleanly takes the Python road,
        which parses it or refuses it with a precise reason."""
        fast_ok = stage.read_api_json(self.conn, [(landed.sha256, self.intake.local(landed, batch)) for landed in batch.fast],
                                      checked=True)  # (stage.exact_activations, as each was routed)
        for landed in batch.fast:
            if landed.sha256 in fast_ok:
                self.summary.n_loaded += 1
                batch.inputs.append((landed, "api_json", None))
            else:
                self.intake.parse(batch, replace(landed, data=landed.data or read_landed(landed.path)))

    def _read_exports(self, batch: _Batch) -> None:
        """Export files never take the Python road, which would hold a whole (many-GB) file in
        memory: a line that is not a JSON object is quarantined and the rest of its file loads."""
        try:
            exports = stage.read_exports(
                self.conn, {t: [(landed.sha256, landed.path, batch.export_lines[landed.sha256]) for landed in group]
                            for t, group in batch.exports.items()}, batch.export_inexact, batch.export_fields,
                {sha: path for sha, spool in batch.export_spools.items() if (path := spool.path) is not None},
            )
        finally:
            batch.free_copies()  # read (or failed): the copies are freed before the next batch lands
        for table, group in batch.exports.items():
            for landed in group:
                if landed.sha256 in exports.refused:
                    self.intake.reject(batch, landed, "gzip+export_jsonl", exports.refused[landed.sha256])
                    continue
                bad_lines = [
                    {"input_sha256": landed.sha256, "record_kind": validate.SUITES[table],
                     "record_key": f"line {bad.line_no}", "check_name": BAD_LINE_CHECK,
                     "detail": f"line {bad.line_no} of {landed.input.origin} {bad.problem}",
                     "record_json": orjson.dumps(bad.text).decode()}
                    for bad in exports.bad_lines.get(landed.sha256, ())
                ]
                records = self._read_lines_in_python(landed, table, exports.python_lines.get(landed.sha256, ()),
                                                     bad_lines)
                if len(bad_lines) > stage.MAX_BAD_LINES:  # counted as the plain-lines road counts them
                    self.conn.execute(f"DELETE FROM fast_export_{table} WHERE input_sha256 = ?", [landed.sha256])
                    first = min((b["detail"] for b in bad_lines), key=lambda d: int(d.split(" ", 2)[1]))
                    self.intake.reject(batch, landed, "gzip+export_jsonl",
                                 f"more than {stage.MAX_BAD_LINES:,} of its lines are no records (the first: "
                                 f"{first.replace(f' of {landed.input.origin}', '', 1)}); "
                                 "refused whole: it is not a readable export batch")
                    continue
                self.summary.n_loaded += 1
                batch.inputs.append((landed, "gzip+export_jsonl", None))
                batch.bad_lines.extend(bad_lines)
                if records is not None:
                    batch.parsed.append((landed.sha256, records))

    def _read_lines_in_python(self, landed: Landed, table: str, lines: Any, bad_lines: list[dict]) -> ParsedInput | None:
        """An export file's lines that DuckDB's typed read would take otherwise than the Python
        road (a key twice, a number written as text, ``true`` among the values, a line simdjson
        cannot parse): each is read as the Python road reads a line, so it has the outcome it
        has on every road (its record quarantined by the check it fails; a line that is no
        record, quarantined as such, into ``bad_lines``). Returns the records, if any."""
        records = ParsedInput(InputFormat.EXPORT_JSONL)
        for line_no, line in lines:
            try:
                parsed = parse_export_line(line, line_no)
            except NotAnObject as exc:
                bad_lines.append(
                    {"input_sha256": landed.sha256, "record_kind": validate.SUITES[table],
                     "record_key": f"line {line_no}", "check_name": BAD_LINE_CHECK,
                     "detail": f"line {line_no} of {landed.input.origin} {exc.problem}",
                     "record_json": orjson.dumps(line[:stage.KEPT_BYTES].decode("utf-8", "replace")).decode()})
                continue
            except Rejected as exc:
                reason = str(exc).removeprefix(f"line {line_no}: ").removeprefix(f"line {line_no} ")
                key, kept = _line_as_record(line_no, line)
                bad_lines.append(
                    {"input_sha256": landed.sha256, "record_kind": validate.SUITES[table],
                     "record_key": key, "check_name": LINE_RECORD_CHECK,
                     "detail": f"line {line_no} of {landed.input.origin}: {reason}",
                     "record_json": kept})
                continue
            for name in stage.STAGED_TABLES:
                getattr(records, name).extend(getattr(parsed, name))
        return records if any(getattr(records, name) for name in stage.STAGED_TABLES) else None

    def _stage(self, batch: _Batch) -> None:
        """Records parsed in Python join what DuckDB read in the staging tables; the batch's
        inputs (with their capture times) become ``batch_inputs``."""
        records: dict[str, list[tuple[str, Any]]] = {t: [] for t in stage.STAGED_TABLES}
        for sha, p in batch.parsed:
            for table in records:
                records[table].extend((sha, r) for r in getattr(p, table))
        batch.parsed.clear()
        stage.stage_parsed(self.conn, records)
        del records
        stage.create_views(self.conn)
        loaded_inputs = [(landed, fmt) for landed, fmt, reason in batch.inputs if reason is None]
        self.conn.register("_batch_inputs", pa.table({
            "input_sha256": pa.array([landed.sha256 for landed, _ in loaded_inputs], pa.string()),
            "captured_at": pa.array([self.intake.captured.get(landed.sha256) for landed, _ in loaded_inputs],
                                    pa.timestamp("us")),
            "is_page": pa.array([not fmt.endswith("export_jsonl") for _, fmt in loaded_inputs], pa.bool_()),
        }))
        self.conn.execute("CREATE OR REPLACE TEMP TABLE batch_inputs AS SELECT * FROM _batch_inputs")
        self.conn.unregister("_batch_inputs")

    def _validate(self, now: datetime) -> validate.ValidationOutcome:
        """Great Expectations judges the staged batch (rival captures of a feature were already
        settled by ``claim_captures``: the newest loads, the others are superseded, not refused
        as duplicates); its results are stored for the Data Docs beside the load."""
        outcome = validate.validate_batch(self.conn, {t: None for t in _DATA_TABLES})
        self._warmed_up()
        self._store_results(self.batch_no, now, outcome)
        return outcome

    def _store_results(self, batch_no: int, now: datetime, outcome: validate.ValidationOutcome) -> None:
        """Store the batch's Great Expectations results for its Data Docs, in a thread: seconds
        of Python that overlap DuckDB's load of the batch (which releases the GIL)."""
        self.wait_stored()
        self._stored = self._store_pool.submit(self._store_one, batch_no, now, outcome)

    def _store_one(self, batch_no: int, now: datetime, outcome: validate.ValidationOutcome) -> None:
        try:  # Great Expectations' own record of the batch, for its Data Docs; never fails a run
            if self.settings.data_docs == "report" and validate.store_pending(
                    self.settings.gx_dir, self.summary.run_id, batch_no, now, outcome) is not None:
                return  # recorded when the run's Data Docs are built (featurehouse report)
            validate.store_results(self.settings.gx_dir, self.summary.run_id, batch_no, now, outcome,
                                   pages=self.report_after)  # the report then builds only the index
        except Exception as exc:
            log.error("could not store Great Expectations results for batch %d: %s", batch_no, exc,
                      exc_info=not disk_full(exc))

    def wait_stored(self) -> None:
        """Wait until the last batch's results are stored (before the next, and the report)."""
        if self._stored is not None:
            self._stored.result()
            self._stored = None

    def _warmed_up(self) -> None:
        """Wait for the import of Great Expectations started in a thread, if any. A batch with
        no record left to judge, or one that failed, did not wait for it: no other thread may
        import its modules (or pandas) beside it, as Python's import locks
        can deadlock two threads importing the same packages."""
        if self._warming is not None:
            self._warming.join()
            self._warming = None

    def _warm_report(self) -> None:
        """Do the report's work that needs no committed state in the main thread, which has
        nothing else to do while the loader thread writes and commits the last batch: start
        the chart renderer (a child process: its JavaScript engine takes ~0.4 s of one core to
        start, see ``outputs/draw.py``; not waited for: the first chart waits for what is left)
        and build the run's Great Expectations Data Docs pages
        (its results are all stored by then). Only then: a run with no batch to load (an
        unchanged re-run) starts no renderer. What fails here the report does itself, or says
        why it cannot (a renderer that cannot start leaves the report without charts).

        This waits until the loader is inside the write of the batch's files, a statement that
        does not need the GIL: building the Data Docs holds it, and when the renderer was drawn
        in this process (it held the GIL for its 0.36 s start) the loader's many small
        statements before the write waited it out."""
        from ..outputs import report

        loading = self._loading
        while loading is not None and not (self._writing.wait(0.05) or loading.done()):
            pass
        steps = (("start the chart drawer", report.warm_charts),
                 ("build the run's Data Docs", self._data_docs_ahead))
        for what, step in steps:
            try:
                step()
            except Exception:
                log.debug("could not %s ahead of the report", what, exc_info=True)

    def _data_docs_ahead(self) -> None:
        self.wait_stored()
        if self.settings.data_docs == "report":
            return
        validate.build_data_docs(self.settings.gx_dir, self.summary.run_id, index=False)

    def close(self, failed: bool = False) -> None:
        """Wait for the threads; ``failed``: the run is failing already, so an error of the batch
        loading is logged, not raised (the first error is the run's)."""
        if failed:
            warehouse.end_statement(self.conn)  # (this thread's connection, never the loader's: see flush)
        self.intake.digests.close()
        self._warmed_up()
        if not failed and self.report_after and self._loading is not None and not self._loading.done():
            self._warm_report()  # while the last batch loads: the report then draws at once
        while failed and self._loading is not None and not self._loading.done():
            # the run is failing (a signal, often): the batch loading shares this connection,
            # so the run is recorded only once it is done; a second signal does not cut that short
            try:
                futures.wait([self._loading])
            except BaseException:
                log.warning("the run is ending: waiting for the batch being committed first")
        try:
            self.wait_loaded()
        except Exception:
            if not failed:
                raise
            if getattr(self, "signals", None):  # stopped by a signal: said once, by the caller
                log.info("the batch loading when the run was stopped did not load", exc_info=True)
            else:
                log.exception("the batch loading when the run failed did not load")
        finally:
            self._load_pool.shutdown(wait=True)
            self.wait_stored()
            self._store_pool.shutdown(wait=True)
            if self.spare is not None:
                self.conn = self.primary
                self.spare.close()
                self.spare = None
