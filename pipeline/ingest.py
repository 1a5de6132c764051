"""One ingest run: receive → land → parse → validate → load → materialise, in bounded batches.

Chaining only; each stage lives in its own module. Every input lands before it is parsed; an
input that cannot be parsed is recorded as rejected with its reason and the run goes on; records
that fail an expectation are quarantined. Memory stays bounded because inputs are staged,
validated and loaded in batches (``settings.batch_bytes`` of input or
``settings.batch_activations`` activations, whichever comes first).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import stat
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import orjson
import pyarrow as pa
from tqdm import tqdm

from .config import Settings
from .lake import catalog_down, runstate, s3, warehouse
from .lake.landing import disk_full, landed_path, open_landed, read_landed
from .lake.runstate import COUNTERS, RunSummary, write_counts
from .lake.s3 import is_s3
from .lake.sqltext import insert_values
from .lake.warehouse import utcnow
from .names import check_run_id
from .signals import RAISED, importing
from .stages import materialise, stage, validate
from .stages.captures import AGAIN_READ, DATA_TABLES, claim_captures, retime_checked, settle_again
from .stages.land import Digests, Landed, land
from .stages.load import (
    REFERENCE_KEYS,
    STAGED_ACTIVATIONS,
    delete,
    forget_decided,
    insert_rows,
    prestats,
    prewrite,
    record_captures,
    replace_staged,
    upsert_reference,
)
from .stages.parse import (
    PAGE_KEY_BYTES,
    NotAnObject,
    Rejected,
    first_lines,
    gunzip_measure,
    parse_bytes,
    parse_export_line,
)
from .stages.receive import Input, iter_inputs
from .stages.records import InputFormat, ParsedInput

__all__ = ["RunSummary", "ingest", "new_run_id", "PART_BATCHES"]

log = logging.getLogger("featurehouse")

_MAX_INPUTS_PER_BATCH = 1000
PART_BATCHES = 100_000
"""Batch numbers of one part of a run: part i numbers its batches from i * PART_BATCHES + 1."""

#: The check a quarantined export line failed: it is not a JSON object (cut short, not JSON).
BAD_LINE_CHECK = "export_line_is_json_object"
#: An export line that is a JSON object but no record (a key twice, an index that is no integer).
LINE_RECORD_CHECK = "export_line_is_a_record"


class _Unreadable(Exception):
    "An input that cannot be read as a file."


@contextlib.contextmanager
def _signals_watched() -> Iterator[list[tuple[int, Any, bool]]]:
    """Watch SIGINT and SIGTERM for the run (main thread only; the handlers are wrapped, then
    put back), for :func:`_stop_if_signalled`, against two ways a signal failed to stop it:

    - A handler raises in the main thread, but raised inside a DuckDB statement its exception
      becomes an Exception ("Query interrupted") that a step forgiving errors (the housekeeping of
      abandoned runs) caught, and the run went on to the end and exited 0. A signal whose
      handler raised is noted, and raised again at the next point the run may stop.
    - Raised inside an import (DuckDB imports ``pyarrow.dataset`` on first use, beside the
      thread importing Great Expectations), right after the interpreter's import lock was taken,
      the exception left that lock held for ever, and DuckDB swallowed the exception: every
      later import waited, the run hung. While an import is under way (``signals.importing``:
      the import lock held, or the main thread inside an import, whose module lock an exception
      could leave held) the handler does not run; the signal is noted, and handled at the next
      point the run may stop.

    (Both found by the SIGTERM test, which failed about one run in three.)"""
    came: list[tuple[int, Any, bool]] = []  # (signal, its handler, whether the handler raised)
    if threading.current_thread() is not threading.main_thread():
        yield came
        return
    before = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if callable(handler):
            def noted(signum, frame, handler=handler):
                if importing(frame):
                    came.append((signum, handler, False))
                    return
                try:
                    handler(signum, frame)
                except BaseException:
                    came.append((signum, handler, True))
                    raise
            before[sig] = signal.signal(sig, noted)
    try:
        yield came
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _stop_if_signalled(came: list[tuple[int, Any, bool]]) -> None:
    """At a point where the run may stop: run the handler of a signal that came inside an
    import, and raise again a signal whose handler raised while the run went on (it was caught
    on the way); see :func:`_signals_watched`."""
    while came:
        signum, handler, raised = came.pop(0)
        handler(signum, None)
        if raised:  # (a handler that raised once and not now)
            raise KeyboardInterrupt(f"signal {signum}")
    if RAISED:  # its handler raised, and the exception was swallowed on its way (see signals.RAISED)
        raise KeyboardInterrupt(f"signal {RAISED[0]}")


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends (in the main thread, the one where Python
    runs signal handlers; elsewhere the block runs as it is): a few statements that must not be
    cut in two by a KeyboardInterrupt raised between them. The handlers are swapped for one that
    notes the signal, then put back, and a signal that came is raised again for them. (Masking
    the signal in the main thread is not enough: the kernel hands a process's signal to another
    thread, and Python still runs its handler in the main thread.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    before = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler is not None:  # (None: not set from Python, so it cannot be put back)
            before[sig] = signal.signal(sig, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for sig in came:
            signal.raise_signal(sig)  # handled now, by the handler it was meant for


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM are let go while the block runs (main thread only): a run already
    stopping records its failure whole. A second Ctrl-C during that recording raised inside it:
    the run stayed `running`, with a traceback (found from outside)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler is not None:
            before[sig] = signal.signal(sig, lambda signum, frame: None)
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def new_run_id(prefix: str = "run") -> str:
    """A sortable, unique run id: ``run-20261129T211500Z-1a2b3c``."""
    return f"{prefix}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:6]}"


class _Batch:
    """Inputs gathered until the next validate + load, bounded by bytes, activations and count."""

    def __init__(self) -> None:
        self.inputs: list[tuple[Landed, str, str | None]] = []  # landed, format, reject reason
        self.run_inputs: list[dict[str, str]] = []
        self.parsed: list[tuple[str, ParsedInput]] = []
        self.fast: list[Landed] = []  # single-line API JSON, left for DuckDB to read
        self.exports: dict[str, list[Landed]] = {}  # gzip export rows by table, left for DuckDB
        self.export_lines: dict[str, int] = {}  # newlines in each export file, by digest
        self.export_inexact: dict[str, list[int]] = {}  # ... its lines for the Python road (stage.LineCheck)
        self.export_fields: dict[str, frozenset[str]] = {}  # ... the fields of its lines the typed read lacks
        self.bad_lines: list[dict[str, Any]] = []  # export lines that are not JSON objects, to quarantine
        self.taken: set[str] = set()  # digests this batch reads
        self.reread: list[str] = []  # of those, landed before (--reprocess, a limit raised, a newer capture)
        self.again: list[tuple[Landed, datetime]] = []  # bytes taken before, come again: decided at the flush
        self.retimes: dict[str, datetime] = {}  # bytes still loaded whose newer capture time is recorded
        self.retimed: dict[str, Landed] = {}  # ... and their inputs, read after all if the commit decides so
        self.n_activations = 0
        self.n_bytes = 0
        self.scratch: Path | None = None  # local copies of its S3 pages, for DuckDB to read

    def __len__(self) -> int:
        return (len(self.inputs) + len(self.run_inputs) + len(self.fast) + sum(map(len, self.exports.values()))
                + len(self.again))

    def add(self, landed: Landed, parsed: ParsedInput) -> None:
        self.inputs.append((landed, str(getattr(parsed.format, "value", parsed.format)), None))
        self.parsed.append((landed.sha256, parsed))
        self.n_activations += len(parsed.activations)

    def reject(self, landed: Landed, fmt: str, reason: str) -> None:
        self.inputs.append((landed, fmt, reason))


_WS = b" \t\r\n"


_MAX_DEPTH = 1024  # as orjson: deeper JSON is refused, whichever road it takes


def _duckdb_readable(data: bytes) -> bool:
    """True for one JSON object on one line that cannot nest past ``_MAX_DEPTH``: DuckDB's
    read_json takes these directly. read_json has no depth limit, so a page holding at most
    1,024 opening brackets in all (real pages hold a few hundred) is provably shallow enough;
    anything else takes the Python road, whose parser refuses deeper JSON with a reason. (The
    brackets are counted by numpy: 35 us for a 280 KB page, where two ``bytes.count`` take 160.)"""
    body = data.strip(_WS)
    if not (body[:1] == b"{" and body[-1:] == b"}" and b"\n" not in body):
        return False
    octets = np.frombuffer(body, np.uint8)
    return int(np.count_nonzero(octets == ord("["))) + int(np.count_nonzero(octets == ord("{"))) <= _MAX_DEPTH


_LIMIT_MARK = "FEATUREHOUSE_MAX_"  # every size-limit refusal names its setting


def _export_table(data: bytes) -> str | None:
    """For a gzip bulk-export batch of feature, activation or explanation rows, the table it
    loads: DuckDB reads these as a stream, so a batch far larger than memory still loads."""
    if not data.startswith(b"\x1f\x8b"):
        return None
    # Judged by its first line that is JSON: lines before it that are not (a first line cut
    # short, an object written over several lines, braces around a NaN) are bad lines of the
    # batch, quarantined on DuckDB's road like any other, not a reason to refuse the file whole
    # (a cut first line lost its 49 good lines where a cut middle line cost one). A file with no
    # JSON line among its first ones is no export batch: the Python road says what it is.
    for line in first_lines(data)[:_EXPORT_SNIFF_LINES]:
        line = line.strip()
        if not line.startswith(b"{"):  # (a line inside an object over several lines may be JSON: "0.5")
            continue
        try:
            orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        return stage.export_table(line)
    return None


_EXPORT_SNIFF_LINES = 100


_DATA_TABLES = tuple(validate.SUITES)
assert set(_DATA_TABLES) == set(DATA_TABLES)


def _mtime(path: Path | None) -> datetime:
    """A file's modification time as naive UTC (now for bytes in hand). A time in the future
    (a wrong clock, ``touch -d 2099-01-01``) counts as now: else that capture would beat every
    later one for ever."""
    now = utcnow()
    if path is None:
        return now
    return min(datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).replace(tzinfo=None), now)


class _Run:
    """One run's inputs through the stages. ``take`` receives an input: land → new? → route
    (which road reads it). ``flush`` takes a batch through read → stage → validate, then hands
    it to the loader thread (write → statistics → commit) and goes on with the next batch;
    ``_record_seen`` commits a batch of inputs seen before.

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
        self.materialise = materialise
        self.source_stats = source_stats
        self.settings = settings
        self.summary = summary
        self.reprocess = reprocess
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
        self.captured: dict[str, datetime] = {}  # input digest → when this capture was made
        self.requeued: list[tuple[Landed, datetime]] = []  # inputs a commit sent back to be read (_requeue)
        self.retimed_any = False  # a batch decided a retime since flush_requeued last looked
        # Inputs already landed. Those refused only for a size limit are looked at again: raising
        # FEATUREHOUSE_MAX_* is how a person acts on that reason, so the outcome may change.
        with warehouse.one_snapshot(conn):
            rows = conn.execute(
                f"SELECT input_sha256, reason LIKE '%{_LIMIT_MARK}%' FROM raw_inputs"
            ).fetchall()
            # A retried run (same run id, e.g. an Airflow retry) skips what its earlier attempt saw.
            self.seen_this_run: set[str] = {
                sha for (sha,) in warehouse.execute(
                    conn, "SELECT DISTINCT input_sha256 FROM run_inputs WHERE run_id = ?", [summary.run_id]
                ).fetchall()
            }
        self.landed_before = {sha for sha, _ in rows}
        self.known = {sha for sha, over_limit in rows if not over_limit}
        self.seen_before_this_attempt = set(self.seen_this_run)
        self.digests = Digests(settings.warehouse / ".input-digests.sqlite", settings.input_digest_days * 86400)
        self._store_pool = ThreadPoolExecutor(1, thread_name_prefix="gx-store")
        self._warming: threading.Thread | None = None  # the import of Great Expectations, in a thread
        self._warm_up_started = False  # at the first batch with records to judge
        self._stored: Future | None = None
        self._writing = threading.Event()  # the batch loading has begun writing its files

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
        self._settle_again(batch)
        if not (batch.inputs or batch.fast or any(batch.exports.values())):
            # Only inputs landed before (an unchanged re-run): nothing to parse, validate or load,
            # so no Great Expectations and no staging; record that this run saw them.
            self.wait_loaded()
            self._record_seen(batch)
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
        except BaseException:
            self._warmed_up()
            self._forget(conn, batch)
            raise
        finally:
            self.digests.save()
        # one load at a time, in batch order; this batch's connection is the loader's until it is
        # committed, and the next batch is staged on the other one
        self.wait_loaded()
        base = {c: getattr(self.summary, c) for c in COUNTERS}  # the counts as of this batch
        args = (conn, batch, outcome, superseded, now, self.batch_no, base)
        self._writing.clear()
        if warehouse.holds_write_lock(self.settings):
            # the caller holds the commit lock, which is re-entrant in its own thread only
            self._loading = Future()
            self._loading.set_result(self._load_batch(*args))
        else:
            self._loading = self._load_pool.submit(self._load_batch, *args)
        self.conn = self._other(conn)

    def _other(self, conn: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
        """The connection the loader is not using: the next batch is staged on it."""
        if conn is not self.primary:
            return self.primary
        if self.spare is None:
            self.spare = self.primary.cursor()  # the same database (the lake attached), its own temp tables
            self.spare.execute(f"USE {warehouse.CATALOG}")
        return self.spare

    def _load_batch(self, conn: duckdb.DuckDBPyConnection, batch: _Batch, outcome: validate.ValidationOutcome,
                    superseded: list[dict], now: datetime, batch_no: int, base: dict[str, int]):
        """The loader thread's work for one batch: load it, then drop its staging tables."""
        try:
            return self._load(conn, batch, outcome, superseded, now, batch_no, base)
        finally:
            self._forget(conn, batch)

    def _forget(self, conn: duckdb.DuckDBPyConnection, batch: _Batch) -> None:
        """A batch's staging tables and scratch copies, once it is loaded (or failed): quarantined
        records are cut out of these copies at the load."""
        stage.drop(conn)
        if batch.scratch is not None:
            shutil.rmtree(batch.scratch, ignore_errors=True)

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

    def _settle_again(self, batch: _Batch) -> None:
        """Bytes taken before that came again: content dedup skips reading them, never the
        capture-time decision (``captures.settle_again``). Those whose capture changes what is
        loaded are read again now, in this batch; the others are skipped, a newer capture time
        recorded (``batch.retimes``). Inputs read again take the newest capture time of their
        bytes (a copy's file may be older than a capture already recorded)."""
        newest: dict[str, tuple[Landed, datetime]] = {}
        for landed, when in batch.again:
            kept = newest.get(landed.sha256)
            if kept is None or when > kept[1]:
                if kept is not None:
                    self._skip(batch, kept[0])
                newest[landed.sha256] = (landed, when)
            else:
                self._skip(batch, landed)
        batch.again.clear()
        decided = settle_again(self.conn, {sha: when for sha, (_, when) in newest.items()})
        if batch.reread:
            recorded = dict(self.conn.execute(
                "SELECT input_sha256, captured_at FROM raw_inputs WHERE list_contains($shas, input_sha256) "
                "AND captured_at IS NOT NULL", {"shas": batch.reread}).fetchall())
            for sha, at in recorded.items():
                self.captured[sha] = max(self.captured[sha], at)
        if n_retimes := sum(d == "retime" for d in decided.values()):
            log.info("%d input(s) landed before came again with a newer capture time: only the time moves "
                     "(decided again at the commit)", n_retimes)
        for sha, (landed, when) in newest.items():
            if decided.get(sha) != AGAIN_READ:
                self._skip(batch, landed)
                if decided.get(sha) == "retime":
                    batch.retimes[sha] = when
                    batch.retimed[sha] = landed
                    self.retimed_any = True
                continue
            self.summary.n_reread += 1
            self.seen_this_run.add(sha)
            self.captured[sha] = when
            batch.taken.add(sha)
            batch.reread.append(sha)
            small = landed.n_bytes <= self.settings.max_input_bytes
            self._route(replace(landed, data=read_landed(landed.path) if small else None), batch)

    @staticmethod
    def _without_moved(run_inputs: list[dict], moved: list[str]) -> tuple[list[dict], int]:
        """The run_inputs rows less the 'duplicate' ones of inputs the commit decided to read
        after all (they are read after it, and recorded then); and how many were left out."""
        if not moved:
            return run_inputs, 0
        rows = [r for r in run_inputs if not (r["outcome"] == "duplicate" and r["input_sha256"] in moved)]
        return rows, len(run_inputs) - len(rows)

    def _requeue(self, batch: _Batch, moved: list[str]) -> int:
        """Inputs whose retime the commit found moved (see ``captures.retime_checked``): read again in
        a batch after this one (``requeued``); returns how many 'duplicate' rows that undid."""
        undone = 0
        for sha in moved:
            self.requeued.append((batch.retimed[sha], batch.retimes[sha]))
            undone += sum(r["outcome"] == "duplicate" and r["input_sha256"] == sha for r in batch.run_inputs)
        if moved:
            log.info("%d input(s) decided 'only move the capture time' lost their features to another writer's "
                     "commit in between: read again", len(moved))
        return undone

    def flush_requeued(self) -> None:
        """Read the inputs commits sent back (see :meth:`_requeue`), until none is. Waits for
        the batch loading only when a batch retimed something (else the report's work overlaps
        the last load, see :meth:`close`)."""
        while self.retimed_any:
            self.retimed_any = False
            self.wait_loaded()
            if not self.requeued:
                return
            batch = _Batch()
            batch.again, self.requeued = self.requeued, []
            self.flush(batch)

    def _skip(self, batch: _Batch, landed: Landed) -> None:
        """Count an input as already landed and skipped, and record that this run saw it."""
        self.summary.n_duplicates += 1
        batch.run_inputs.append({"run_id": self.summary.run_id, "input_sha256": landed.sha256,
                                 "origin": landed.input.origin, "outcome": "duplicate"})

    def _read_pages(self, batch: _Batch) -> None:
        """DuckDB reads one-line API-JSON pages; one it cannot read cleanly takes the Python road,
        which parses it or refuses it with a precise reason."""
        fast_ok = stage.read_api_json(self.conn, [(landed.sha256, self._local(landed, batch)) for landed in batch.fast],
                                      checked=True)  # (stage.exact_activations, as each was routed)
        for landed in batch.fast:
            if landed.sha256 in fast_ok:
                self.summary.n_loaded += 1
                batch.inputs.append((landed, "api_json", None))
            else:
                self._parse(batch, replace(landed, data=landed.data or read_landed(landed.path)))

    def _read_exports(self, batch: _Batch) -> None:
        """Export files never take the Python road, which would hold a whole (many-GB) file in
        memory: a line that is not a JSON object is quarantined and the rest of its file loads."""
        exports = stage.read_exports(
            self.conn, {t: [(landed.sha256, landed.path, batch.export_lines[landed.sha256]) for landed in group]
                        for t, group in batch.exports.items()}, batch.export_inexact, batch.export_fields
        )
        for table, group in batch.exports.items():
            for landed in group:
                if landed.sha256 in exports.refused:
                    self._reject(batch, landed, "gzip+export_jsonl", exports.refused[landed.sha256])
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
                    self._reject(batch, landed, "gzip+export_jsonl",
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
            "captured_at": pa.array([self.captured.get(landed.sha256) for landed, _ in loaded_inputs],
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
        import its modules (or the report's altair, pandas) beside it, as Python's import locks
        can deadlock two threads importing the same packages."""
        if self._warming is not None:
            self._warming.join()
            self._warming = None

    def _warm_report(self) -> None:
        """Do the report's work that needs no committed state in the main thread, which has
        nothing else to do while the loader thread writes and commits the last batch: start
        the chart renderer (a child process: its JavaScript engine takes ~0.4 s of one core to
        start, see ``outputs/draw.py``) and build the run's Great Expectations Data Docs pages
        (its results are all stored by then). Only then: a run with no batch to load (an
        unchanged re-run) starts no renderer. What fails here the report does itself, or says
        why it cannot (a renderer that cannot start leaves the report without charts).

        This waits until the loader is inside the write of the batch's files, a statement that
        does not need the GIL: building the Data Docs holds it, and when the renderer was drawn
        in this process (it held the GIL for its 0.36 s start) the loader's many small
        statements before the write waited it out."""
        from .outputs import report

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
        self.digests.close()
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

    def _record_seen(self, batch: _Batch) -> None:
        """Commit the run_inputs rows of a batch of inputs all landed before, and the run's counts."""
        s, run_id = self.summary, self.summary.run_id

        def body(conn: duckdb.DuckDBPyConnection) -> tuple[dict[str, float], list[str]]:
            moved = retime_checked(conn, batch.retimes)
            rows, undone = self._without_moved(batch.run_inputs, moved)
            insert_values(conn, "run_inputs", rows)
            counts = {c: getattr(s, c) for c in COUNTERS} | s.sync_commit_stats()
            counts["n_duplicates"] -= undone  # read after all, after this commit
            write_counts(conn, s, counts)  # a part adds its own; never overwrites the other parts'
            return counts, moved

        counts, moved = warehouse.transaction(self.conn, self.settings, body,
                                              message=f"run {run_id} inputs seen before",
                                              extra={"run_id": run_id}, stats=s.stats)
        s.n_duplicates -= self._requeue(batch, moved)
        if s.part is not None:
            s.written = counts

    @staticmethod
    def _failed_rows(conn: duckdb.DuckDBPyConnection, outcome: validate.ValidationOutcome) -> list[tuple[str, int]]:
        """The staged rows Great Expectations refused, ``(table, _row)``, also as the temp table
        ``failed_rows`` (the batch's write leaves them out)."""
        failed = sorted({(q["table"], q["row"]) for q in outcome.quarantine})
        conn.register("_failed", pa.table({"tbl": pa.array([t for t, _ in failed], pa.string()),
                                           "_row": pa.array([r for _, r in failed], pa.int64())}))
        conn.execute("CREATE OR REPLACE TEMP TABLE failed_rows AS SELECT * FROM _failed")
        conn.unregister("_failed")
        return failed

    @staticmethod
    def _export_files(batch: _Batch) -> dict[str, Path]:
        """The batch's local export files whose rows are their lines (none of them set aside)."""
        set_aside = {q["input_sha256"] for q in batch.bad_lines}
        return {landed.sha256: Path(landed.path) for group in batch.exports.values() for landed in group
                if not is_s3(landed.path) and landed.sha256 not in set_aside}

    def _bookkeeping(self, conn: duckdb.DuckDBPyConnection, batch: _Batch, outcome: validate.ValidationOutcome,
                     now, batch_no: int, failed: list[tuple[str, int]],
                     lines: dict[str, dict[int, tuple[str, str]]]) -> tuple[list, list, list]:
        """What the commit records beside the rows, prepared before it (none of it needs the
        committed state): the quarantined records as received (``lines``: the refused export
        rows' lines, cut out of their files per table), the expectation results and the run's
        inputs."""
        run_id = self.summary.run_id
        raw_by_row = {}
        export_files = self._export_files(batch)
        for table in _DATA_TABLES:
            raws = stage.raw_records(conn, table, [r for t, r in failed if t == table], export_files,
                                     lines=lines.get(table, {}))
            raw_by_row.update({(table, r): v for r, v in raws.items()})
        quarantine = [dict(q, run_id=run_id, quarantined_at=now) for q in batch.bad_lines]
        for q in outcome.quarantine:
            sha, raw = raw_by_row[(q["table"], q["row"])]
            quarantine.append({
                "run_id": run_id, "input_sha256": sha, "record_kind": q["record_kind"],
                "record_key": q["record_key"], "check_name": q["check_name"], "detail": q["detail"],
                "record_json": raw, "quarantined_at": now,
            })
        results = [dict(r, run_id=run_id, batch_no=batch_no, validated_at=now) for r in outcome.results]
        run_inputs = list(batch.run_inputs) + [
            {"run_id": run_id, "input_sha256": landed.sha256, "origin": landed.input.origin,
             "outcome": "rejected" if reason else "loaded"}
            for landed, _, reason in batch.inputs
        ]
        return quarantine, results, run_inputs

    def _load(self, conn: duckdb.DuckDBPyConnection, batch: _Batch, outcome: validate.ValidationOutcome,
              superseded: list[dict], now, batch_no: int, base: dict[str, int]) -> tuple[dict, dict]:
        """Commit the batch (in the loader thread, on the connection it was staged on): one
        transaction, one snapshot, under the commit lock, retried whole if it loses a commit
        race. Everything that need not see the committed state (the quarantined records as
        received, the bookkeeping rows) is prepared before it. ``base``: the run's counts as of
        this batch (the main thread counts the next one meanwhile). Returns what it loaded and
        the counts it stored."""
        s, run_id = self.summary, self.summary.run_id
        failed = self._failed_rows(conn, outcome)
        shas = [landed.sha256 for landed, _, _ in batch.inputs]
        # The refused export rows' lines are cut out of their gzip files (a second or two of one
        # core for a 1 GiB batch) in a thread, beside the batch's Parquet write, whose end runs
        # on one core; the plan reads the staged table, so it is made here, before the write.
        export_files = self._export_files(batch)
        plans = {t: stage.plan_export_lines(conn, t, [r for tt, r in failed if tt == t], export_files)
                 for t in _DATA_TABLES}
        with contextlib.ExitStack() as stack:
            cutting = {}
            if any(p.wanted for p in plans.values()):
                pool = stack.enter_context(futures.ThreadPoolExecutor(1, thread_name_prefix="cut-lines"))
                cutting = {t: pool.submit(stage.cut_export_lines, p) for t, p in plans.items() if p.wanted}

            # The batch's rows are written before the commit lock is taken; the commit adds the
            # files to the catalog (and writes the rows itself only where another writer's
            # commit since changed what loads): the lock is held for metadata, not for writing.
            with s.timed("write"):
                prewritten = prewrite(conn, now, run_id, reprocess=self.reprocess, inputs=shas,
                                      on_write=self._writing.set)
            if batch.retimes:
                prewritten.snapshot = -1  # the commit moves capture times first: it decides again after
            elif self.materialise:  # the changed features' statistics too, before the lock
                with s.timed("stats"):
                    prestats(conn, prewritten)
            lines = {t: f.result() for t, f in cutting.items()}
        quarantine, results, run_inputs = self._bookkeeping(conn, batch, outcome, now, batch_no, failed, lines)

        def body(conn: duckdb.DuckDBPyConnection) -> dict[str, int]:
            moved = retime_checked(conn, batch.retimes)
            loaded, older = replace_staged(conn, now, run_id, reprocess=self.reprocess, prewritten=prewritten)
            record_captures(conn, now, run_id, prewritten)
            for table in REFERENCE_KEYS:  # (decided before the lock, unless a commit came in between)
                upsert_reference(conn, table, now, decided=prewritten.reference.get(table) if prewritten.stood else None)
            if self.materialise:  # stats of the features this batch changed, in the same snapshot
                with s.timed("stats"):  # (computed before the lock, if no commit came in between)
                    materialise.refresh_changed(conn, sources=self.source_stats, staged=STAGED_ACTIVATIONS,
                                                computed=prewritten.stats and prewritten.stood,
                                                nothing_to_delete=prewritten.skipped())
            gone = [dict(r, run_id=run_id, recorded_at=now) for r in superseded + older]
            insert_rows(conn, "superseded", gone)
            # An input parsed again (--reprocess) re-derives its quarantine: replace, never duplicate.
            delete(conn, "quarantine", prewritten, {"shas": shas})
            insert_rows(conn, "quarantine", quarantine)
            insert_rows(conn, "validation_results", results)
            self._record_inputs(conn, batch, loaded, now, known="raw_inputs" not in prewritten.skipped())
            rows, undone = self._without_moved(run_inputs, moved)
            insert_values(conn, "run_inputs", rows)
            delta = {f"n_{t}": sum(loaded[t].values()) for t in _DATA_TABLES}
            delta |= {"n_quarantined": len(failed) + len(batch.bad_lines), "n_superseded": len(gone),
                      "n_expectations": len(results), "n_expectations_failed": sum(not r["success"] for r in results),
                      "n_duplicates": -undone}
            counts = {c: base[c] + delta.get(c, 0) for c in COUNTERS} | s.sync_commit_stats()
            write_counts(conn, s, counts)
            return delta, counts, moved

        with s.timed("commit"):
            delta, counts, moved = warehouse.transaction(conn, self.settings, body,
                                                         message=f"run {run_id} batch {batch_no}",
                                                         extra={"run_id": run_id, "batch": batch_no}, stats=s.stats)
        self._requeue(batch, moved)  # (the count of 'duplicate' rows it undid is in delta)
        materialise.forget_computed(conn)
        forget_decided(conn)
        # committed: a file the commit did not add is no table's (after a failure, all of them
        # stay for `maintain` to delete: whether a failed commit added them is not known here)
        for path in prewritten.unused():
            try:
                s3.delete(path, self.settings) if is_s3(path) else os.unlink(path)
            except Exception as exc:  # an orphan: maintain deletes it later
                log.warning("could not remove the unused data file %s: %s", path, exc)
        return delta, counts

    def _record_inputs(self, conn: duckdb.DuckDBPyConnection, batch: _Batch, loaded: dict, now,
                       known: bool = True) -> None:
        """The batch's inputs in ``raw_inputs``, in the commit: what each loaded (``loaded``: rows
        per table and input digest) or why it was rejected. ``known=False``: none of them is
        there yet (found before the lock, against the snapshot the commit still reads).

        An input whose rows this commit did not load may hold rows all the same: another writer
        loaded the same bytes between this batch's decision and its commit (two ingests of one
        file at once). Its counts are what the tables hold of it, read under the lock, not the
        commit's zero (the row said 'loaded' with 0 activations while 40 were held)."""
        run_id, raw_rows = self.summary.run_id, []
        none_loaded = sorted({landed.sha256 for landed, _, reason in batch.inputs if reason is None
                              and any(not loaded[t].get(landed.sha256) for t in _DATA_TABLES)})
        held: dict[str, dict[str, int]] = {t: {} for t in _DATA_TABLES}
        if none_loaded and known:
            for t in _DATA_TABLES:
                held[t] = dict(warehouse.execute(
                    conn, f"SELECT input_sha256, count(*) FROM {t} WHERE list_contains(?, input_sha256) GROUP BY 1",
                    [none_loaded]).fetchall())
        for landed, fmt, reason in batch.inputs:
            raw_rows.append({
                "input_sha256": landed.sha256, "origin": landed.input.origin, "format": fmt,
                "n_bytes": landed.n_bytes, "received_at": now, "run_id": run_id,
                "captured_at": self.captured.get(landed.sha256),
                "status": "rejected" if reason else "loaded", "reason": reason,
                "landed_path": str(landed.path),
                **{f"n_{t}": loaded[t].get(landed.sha256) or held[t].get(landed.sha256, 0) for t in _DATA_TABLES},
            })
        if raw_rows:
            # An input read again keeps its first origin, run and receipt time; what parsing
            # decided (format, status, reason, counts) is updated, and its capture time is the
            # newest of its bytes'.
            conn.register("_raw_rows", pa.Table.from_pylist(raw_rows))
            if known:
                conn.execute(
                    """UPDATE raw_inputs AS t SET format = s.format, status = s.status, reason = s.reason,
                              n_features = s.n_features, n_activations = s.n_activations,
                              n_explanations = s.n_explanations, captured_at = greatest(t.captured_at, s.captured_at)
                       FROM _raw_rows AS s WHERE t.input_sha256 = s.input_sha256"""
                )
            conn.execute("INSERT INTO raw_inputs BY NAME SELECT * FROM _raw_rows"
                         + (" WHERE input_sha256 NOT IN (SELECT input_sha256 FROM raw_inputs)" if known else ""))
            conn.unregister("_raw_rows")

    def take(self, item: Input, batch: _Batch) -> None:
        """Receive one input: land it, then route it to the road that reads it (or skip it as
        seen before)."""
        landed = self._land(item)  # (beside the loader thread's commit of the batch before)
        if landed is None or not self._is_new(item, landed, batch):
            return
        self._route(landed, batch)

    def _land(self, item: Input) -> Landed | None:
        """The input's bytes in the landing area, or None when nothing could be read (refused)."""
        s = self.summary
        try:
            if item.refused is not None:  # found while listing: never opened
                raise _Unreadable(item.refused)
            if item.data is not None or item.path is None or item.landed is not None:
                return land(item, self.settings.landing_root, self.settings.max_input_bytes)
            st = os.stat(item.path)
            if not stat.S_ISREG(st.st_mode):
                # a named pipe would block the run for ever; a socket or device is no page
                raise _Unreadable("it is not a regular file (a named pipe, socket or device); nothing was read")
            if (seen := self._seen_unchanged(item, st)) is not None:
                return seen
            landed = land(item, self.settings.landing_root, self.settings.max_input_bytes)
            self.digests.remember(item.path, st, landed.sha256)
            return landed
        except (OSError, _Unreadable) as exc:
            # Nothing could be read, so nothing lands: the input is refused here, and the run goes
            # on. (A landing area that cannot be written is no input's fault: LandingFailed stops
            # the run.)
            reason = str(exc) if isinstance(exc, _Unreadable) else f"it could not be read: {exc.strerror or exc}"
            if isinstance(exc, FileNotFoundError) and os.path.islink(item.path):
                reason = f"it is a symbolic link to {os.readlink(item.path)}, which does not exist"
            log.warning("input %s refused: %s", item.origin, reason)
            s.n_received += 1
            s.n_unread += 1
            s.n_rejected += 1
            s.rejected.append({"origin": item.origin, "reason": reason})
            return None

    def _seen_unchanged(self, item: Input, st: os.stat_result) -> Landed | None:
        """A file unchanged since an earlier run hashed it, whose bytes that run loaded (or
        refused) and whose landed copy is still there: known without reading it again (an
        unchanged re-run of a large folder reads nothing). None when it must be read."""
        if self.reprocess or (sha := self.digests.lookup(item.path, st)) is None or sha not in self.known:
            return None
        where = landed_path(self.settings.landing_root, sha)
        if not is_s3(where) and not Path(where).exists():  # on S3 raw_inputs vouches for the copy
            return None
        return Landed(item, sha, where, st.st_size, None, False)

    def _is_new(self, item: Input, landed: Landed, batch: _Batch) -> bool:
        """Count the input as received; False for one this run (or an earlier one) already took:
        a copy in this batch lends the batch its capture time if newer; other bytes taken before
        wait for the flush, which decides whether their capture time changes anything."""
        s, sha = self.summary, landed.sha256
        if sha in self.seen_before_this_attempt:
            return False  # an earlier attempt of this run already counted and recorded it
        s.n_received += 1
        when = item.captured_at or _mtime(item.path)
        if sha in batch.taken:  # not decided yet: the batch decides with the newest of its copies
            self.captured[sha] = max(self.captured[sha], when)
            self._skip(batch, landed)
            return False
        if (sha in self.known and not self.reprocess) or sha in self.seen_this_run:
            batch.again.append((replace(landed, data=None), when))
            return False
        self.seen_this_run.add(sha)
        batch.taken.add(sha)
        self.captured[sha] = when
        if sha in self.landed_before:
            s.n_reread += 1
            batch.reread.append(sha)
        else:
            s.n_landed += 1
        return True

    def _route(self, landed: Landed, batch: _Batch) -> None:
        """Decide once which road reads the input: DuckDB's read of a one-line page, DuckDB's
        stream of an export batch, a refusal for size, or the Python parser."""
        if landed.data is not None and _duckdb_readable(landed.data) and (
                (n_activations := stage.exact_activations(landed.data)) is not None):
            # DuckDB reads it from the landing area (from S3, a local copy of the bytes in hand);
            # it is checked here, on the bytes in hand, not read from the landing area again
            batch.fast.append(landed if is_s3(landed.path) else replace(landed, data=None))
            batch.n_bytes += landed.n_bytes
            batch.n_activations += n_activations
        elif (table := _export_table(landed.data or read_landed(landed.path, 1 << 22))) is not None:
            # An export batch: DuckDB streams it from the landing area, however large. It is
            # checked whole first (CRC, end marker, size limit), never held in memory.
            check = stage.LineCheck(table)  # (lines DuckDB's typed read would take otherwise)
            try:  # on S3 this reads the object once more: the price of never trusting a size
                with open_landed(landed.path) as stream:
                    size, lines = gunzip_measure(stream, self.settings.max_decompressed_bytes, PAGE_KEY_BYTES,
                                                 lines=check)
            except Rejected as exc:
                self._reject(batch, landed, "gzip+export_jsonl", str(exc))
                return
            inexact = check.finish()
            if check.page_line is not None:  # as the plain road refuses a file of JSON lines holding one
                self._reject(batch, landed, "gzip+export_jsonl", (
                    f"line {check.page_line} of the JSON lines is a whole feature page but line 1 is an export "
                    "row: send feature pages and bulk-export rows in separate files"))
                return
            batch.exports.setdefault(table, []).append(replace(landed, data=None))
            batch.export_lines[landed.sha256] = lines
            if inexact:
                batch.export_inexact[landed.sha256] = inexact
            batch.export_fields[landed.sha256] = check.fields
            batch.n_bytes += size
            if table == "activations":  # one row a line; a file is never split across batches
                batch.n_activations += lines
        elif landed.data is None:
            reason = (
                f"input is {landed.n_bytes:,} bytes, over the {self.settings.max_input_bytes:,}-byte "
                f"limit ({_LIMIT_MARK}INPUT_BYTES); it is landed but was not parsed"
            )
            self._reject(batch, landed, "unknown", reason)
        else:
            self._parse(batch, landed)

    def _local(self, landed: Landed, batch: _Batch) -> Path:
        """A page's landed file for DuckDB: itself on disk; from S3, its bytes (in hand) written
        to a local scratch file of the batch, cheaper than one S3 request per page from DuckDB."""
        if not is_s3(landed.path):
            return Path(landed.path)
        batch.scratch.mkdir(parents=True, exist_ok=True)
        path = batch.scratch / landed.sha256
        path.write_bytes(landed.data or read_landed(landed.path))
        return path

    def _parse(self, batch: _Batch, landed: Landed) -> None:
        try:
            parsed = parse_bytes(landed.data, self.settings)
        except Rejected as exc:
            self._reject(batch, landed, "unknown", str(exc))
        except RecursionError:
            self._reject(batch, landed, "unknown", "input is nested too deeply to parse; refused")
        except Exception as exc:  # a parser bug must not stop the run; the input stays landed
            log.exception("unexpected error parsing %s", landed.input.origin)
            self._reject(batch, landed, "unknown", f"could not be parsed ({type(exc).__name__}: {exc})")
        else:
            self.summary.n_loaded += 1
            batch.add(replace(landed, data=None), parsed)
            batch.n_bytes += landed.n_bytes
            kind = next((k for t, k in validate.SUITES.items() if getattr(parsed, t)), "activation")
            for line_no, text, problem, is_object in parsed.bad_lines:  # as the export road quarantines them
                key, kept = (_line_as_record(line_no, text.encode()) if is_object
                             else (f"line {line_no}", orjson.dumps(text).decode()))
                batch.bad_lines.append(
                    {"input_sha256": landed.sha256, "record_kind": kind, "record_key": key,
                     "check_name": LINE_RECORD_CHECK if is_object else BAD_LINE_CHECK,
                     "detail": f"line {line_no} of {landed.input.origin} {problem}" if not is_object
                     else f"line {line_no} of {landed.input.origin}: {problem}",
                     "record_json": kept})

    def _reject(self, batch: _Batch, landed: Landed, fmt: str, reason: str) -> None:
        self.summary.n_rejected += 1
        self.summary.rejected.append({"origin": landed.input.origin, "reason": reason})
        batch.reject(landed, fmt, reason)


def _line_as_record(line_no: int, line: bytes) -> tuple[str, str]:
    """A JSON-object line quarantined whole: keyed by its ``id`` where it has one (as a record
    the checks quarantine is), kept as received (byte for byte) when it is JSON of a size to
    keep, else as a JSON string of its first bytes."""
    if len(line) <= stage.KEPT_BYTES:
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            key = obj.get("id")
            return (key if isinstance(key, str) and key else f"line {line_no}"), line.decode()
    return f"line {line_no}", orjson.dumps(line[:stage.KEPT_BYTES].decode("utf-8", "replace")).decode()


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
    started = time.monotonic()
    conn = warehouse.connect(settings, create=True)
    run_started: _Run | None = None
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
                        run.take(item, batch)
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
                summary.status = "failed"
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
                        runstate.finish_run(conn, settings, summary,
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
        summary.seconds = round(time.monotonic() - started, 3)
        runstate.finish_run(conn, settings, summary)
        try:
            if report_after:  # the run's seconds (and runs.finished_at) include its report
                write_run_report(conn, summary, settings)
                summary.seconds = round(time.monotonic() - started, 3)
            _stop_if_signalled(came)  # one that came during the report stops the process too
        except BaseException as exc:  # a signal: the run is done and recorded
            exc.add_note(f"run {run_id} is recorded as succeeded (its data is loaded); its report may not be "
                         f"written: `featurehouse report --run {run_id}` writes it")
            conn.close()
            raise
        conn.close()
        return summary


def write_run_report(conn: duckdb.DuckDBPyConnection, summary: RunSummary, settings: Settings) -> None:
    """Write the run's HTML report (it records its path in ``runs.report_path``); a failure
    here is logged, not raised."""
    try:
        from .outputs import (
            report,  # charts pull in Altair and vl-convert: only when a report is wanted
        )

        with summary.timed("report"):
            # the Data Docs index is left to `featurehouse report` and the nightly report: it is
            # rebuilt from every result stored, a cost that grows with every run
            path = report.write_report(conn, summary.run_id, settings=settings, data_docs_index=False)
        summary.report_path = str(path)
        runstate.record_report(conn, settings, summary.run_id, path, ended_at=utcnow())
    except Exception as exc:
        if RAISED:  # a signal stopped it (inside DuckDB: "Query interrupted"): the run says so, no traceback
            log.warning("the report of run %s was not written: the run was stopped", summary.run_id)
            return
        if settings.catalog_url.startswith("postgres:") and (line := catalog_down.said(exc, settings.catalog_url)) is not None:
            log.error("could not write the report for run %s: %s; then `featurehouse report --run %s`",
                      summary.run_id, line, summary.run_id)
            return
        if not disk_full(exc):
            log.exception("could not write the report for run %s", summary.run_id)
            return
        # the run's data is loaded and recorded: a full disk is said, not a traceback
        log.error("could not write the report for run %s: the disk is full (%s); the run's data is "
                  "loaded: free some space, then `featurehouse report --run %s`", summary.run_id,
                  str(exc).splitlines()[0][:200], summary.run_id)
