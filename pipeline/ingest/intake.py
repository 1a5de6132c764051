"""Landing and routing, apart from batching: each input received is landed, counted as new or
seen before, and routed to the road that reads it (DuckDB's read of a one-line page, DuckDB's
stream of an export batch, a refusal for size, or the Python parser), into the batch it is
given. The run (``run.py``) decides when a batch is flushed."""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import numpy as np
import orjson

from ..config import Settings
from ..lake import warehouse
from ..lake.landing import landed_path, open_landed, read_landed
from ..lake.runstate import RunSummary
from ..lake.s3 import is_s3
from ..lake.warehouse import utcnow
from ..stages import stage, validate
from ..stages.captures import AGAIN_READ, settle_again
from ..stages.land import Digests, Landed, land
from ..stages.parse import PAGE_KEY_BYTES, Rejected, first_lines, gunzip_measure, parse_bytes
from ..stages.receive import Input
from ..stages.spool import Spool
from .batch import _Batch

log = logging.getLogger("featurehouse")

#: The share of an export file's expanded bytes that counts toward its batch's size
#: (``settings.batch_bytes``) and DuckDB's threads (``settings.bytes_per_thread``): DuckDB streams
#: the file into its own columns, where a page's bytes become Python objects first, several
#: times their size. Measured on a whole generated source (65,536 features, 80 files, 2 cores;
#: ``farm-bench``, 4 alternating pairs, 2026-12-07): batches of 128 MiB of export bytes on one
#: thread took 0.92 (0.81-0.99) of the CPU of 48 MiB batches, at 737 against 646 MiB peak RSS
#: (the lake's statements a batch pays, ~0.3 CPU-s, paid fewer times); as 128 MiB on two threads,
#: no less CPU (their threads spin). 3/8 makes the default 48 MiB 128 MiB of export bytes. A
#: single activations file of real export size (45 MiB gzip, 201 MiB expanded) now reads on one
#: thread: 0.65 (0.64-0.68) of the CPU and 0.64 (0.62-0.99) of the wall it took on two (3 pairs).
EXPORT_BYTES_SHARE = 3 / 8

#: The check a quarantined export line failed: it is not a JSON object (cut short, not JSON).
BAD_LINE_CHECK = "export_line_is_json_object"
#: An export line that is a JSON object but no record (a key twice, an index that is no integer).
LINE_RECORD_CHECK = "export_line_is_a_record"


class _Unreadable(Exception):
    "An input that cannot be read as a file."


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


def _mtime(path: Path | None) -> datetime:
    """A file's modification time as naive UTC (now for bytes in hand). A time in the future
    (a wrong clock, ``touch -d 2099-01-01``) counts as now: else that capture would beat every
    later one for ever."""
    now = utcnow()
    if path is None:
        return now
    return min(datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).replace(tzinfo=None), now)


class _Intake:
    """Landing and routing, the run's first stages: ``take`` receives an input (land → new? →
    route, into the batch it is given); ``decide_again`` settles, at the flush, the inputs
    taken before that came again. What it knows of the inputs is here: which were landed
    before, which this run saw, and when each was captured (``captured``, which the staging of
    a batch and its loader read too). ``parse``, ``reject`` and ``local`` are the roads the
    batch's read takes for a page DuckDB could not read, a refused export file, an S3 page."""

    def __init__(self, conn: duckdb.DuckDBPyConnection, settings: Settings, summary: RunSummary, reprocess: bool):
        self.settings = settings
        self.summary = summary
        self.reprocess = reprocess
        self.captured: dict[str, datetime] = {}  # input digest → when this capture was made
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
            # the expanded bytes kept aside for DuckDB's read as they are measured (spool.py)
            spool = Spool(check, self.settings.warehouse / ".tmp")
            try:  # on S3 this reads the object once more: the price of never trusting a size
                with open_landed(landed.path) as stream:
                    size, lines = gunzip_measure(stream, self.settings.max_decompressed_bytes, PAGE_KEY_BYTES,
                                                 lines=spool)
            except Rejected as exc:
                spool.close()
                self.reject(batch, landed, "gzip+export_jsonl", str(exc))
                return
            except BaseException:
                spool.close()
                raise
            inexact = check.finish()
            if check.page_line is not None:  # as the plain road refuses a file of JSON lines holding one
                spool.close()
                self.reject(batch, landed, "gzip+export_jsonl", (
                    f"line {check.page_line} of the JSON lines is a whole feature page but line 1 is an export "
                    "row: send feature pages and bulk-export rows in separate files"))
                return
            if spool.path is not None:
                batch.export_spools[landed.sha256] = spool
            batch.exports.setdefault(table, []).append(replace(landed, data=None))
            batch.export_lines[landed.sha256] = lines
            if inexact:
                batch.export_inexact[landed.sha256] = inexact
            batch.export_fields[landed.sha256] = check.fields
            batch.n_bytes += int(size * EXPORT_BYTES_SHARE)
            if table == "activations":  # one row a line; a file is never split across batches
                batch.n_activations += lines
        elif landed.data is None:
            reason = (
                f"input is {landed.n_bytes:,} bytes, over the {self.settings.max_input_bytes:,}-byte "
                f"limit ({_LIMIT_MARK}INPUT_BYTES); it is landed but was not parsed"
            )
            self.reject(batch, landed, "unknown", reason)
        else:
            self.parse(batch, landed)

    def local(self, landed: Landed, batch: _Batch) -> Path:
        """A page's landed file for DuckDB: itself on disk; from S3, its bytes (in hand) written
        to a local scratch file of the batch, cheaper than one S3 request per page from DuckDB."""
        if not is_s3(landed.path):
            return Path(landed.path)
        batch.scratch.mkdir(parents=True, exist_ok=True)
        path = batch.scratch / landed.sha256
        path.write_bytes(landed.data or read_landed(landed.path))
        return path

    def parse(self, batch: _Batch, landed: Landed) -> None:
        try:
            parsed = parse_bytes(landed.data, self.settings)
        except Rejected as exc:
            self.reject(batch, landed, "unknown", str(exc))
        except RecursionError:
            self.reject(batch, landed, "unknown", "input is nested too deeply to parse; refused")
        except Exception as exc:  # a parser bug must not stop the run; the input stays landed
            log.exception("unexpected error parsing %s", landed.input.origin)
            self.reject(batch, landed, "unknown", f"could not be parsed ({type(exc).__name__}: {exc})")
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

    def reject(self, batch: _Batch, landed: Landed, fmt: str, reason: str) -> None:
        self.summary.n_rejected += 1
        self.summary.rejected.append({"origin": landed.input.origin, "reason": reason})
        batch.reject(landed, fmt, reason)

    def _skip(self, batch: _Batch, landed: Landed) -> None:
        """Count an input as already landed and skipped, and record that this run saw it."""
        self.summary.n_duplicates += 1
        batch.run_inputs.append({"run_id": self.summary.run_id, "input_sha256": landed.sha256,
                                 "origin": landed.input.origin, "outcome": "duplicate"})

    def decide_again(self, conn: duckdb.DuckDBPyConnection, batch: _Batch) -> bool:
        """Bytes taken before that came again: content dedup skips reading them, never the
        capture-time decision (``captures.settle_again``). Those whose capture changes what is
        loaded are read again now, in this batch; the others are skipped, a newer capture time
        recorded (``batch.retimes``). Inputs read again take the newest capture time of their
        bytes (a copy's file may be older than a capture already recorded). Returns whether it
        decided a retime (the commit may send those inputs back to be read: ``_Run.flush_requeued``)."""
        retimed = False
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
        decided = settle_again(conn, {sha: when for sha, (_, when) in newest.items()})
        if batch.reread:
            recorded = dict(conn.execute(
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
                    retimed = True
                continue
            self.summary.n_reread += 1
            self.seen_this_run.add(sha)
            self.captured[sha] = when
            batch.taken.add(sha)
            batch.reread.append(sha)
            small = landed.n_bytes <= self.settings.max_input_bytes
            self._route(replace(landed, data=read_landed(landed.path) if small else None), batch)
        return retimed


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
