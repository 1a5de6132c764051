"""Whether a run marked ``running`` is still running: its process (``runs.host``, ``runs.pid``,
``runs.started_at``) may have been killed (SIGKILL, out of memory, a machine restarted) before
it could record how it ended.

Only a process on this host can be looked at. A run is *abandoned* when its host is this one and
its process is gone: no such pid, a zombie, or a pid the system has since given to a process
that started after the run did (pid reuse). Runs on other hosts, and runs recorded before
``runs.host`` existed, are left as they are: nothing here can tell whether they are alive.

Readers (``featurehouse status``, the report) compute this on read and never write; an ingest
records it (``mark_abandoned``) before its own run starts.

This module also owns the rest of a run's state in the ``runs`` table: its summary
(``RunSummary``), its start, its counts (a whole run stores totals; a part of a shared run adds
its own), its end, the closing of a run loaded in parts, and where its report was written.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import duckdb

from ..config import Settings
from . import warehouse
from .warehouse import utcnow

__all__ = ["ABANDONED", "this_host", "process_gone", "find_abandoned", "apply", "mark_abandoned", "RunSummary",
           "COUNTERS", "began_at", "start_run", "write_counts", "finish_run", "finish_parts", "end_run",
           "record_report"]

ABANDONED = "abandoned"

#: How much later than a run's start its pid's process may have started and still be the run's
#: own: the boot time the kernel reports is whole seconds and moves a little as the clock is
#: adjusted. The run's real process started before the run did (it records the run after
#: starting), so this only matters for a pid reused within seconds of the run starting.
_START_SLACK_SECONDS = 5.0


def this_host() -> str:
    """The name runs started here record in ``runs.host``."""
    return socket.gethostname()


def _proc_start(pid: int) -> tuple[str, float] | None:
    """(state, start time as a Unix time) of a process from /proc (Linux); None where there is
    no /proc or the process vanished while being read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    # after "pid (comm)" (comm may hold spaces and parentheses): field 3, state, onwards
    fields = stat.rpartition(")")[2].split()
    try:
        return fields[0], btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (IndexError, ValueError):
        return None


def process_gone(pid: int, started_at: datetime) -> bool:
    """True when process ``pid`` of this host cannot be the one that started a run at
    ``started_at`` (naive UTC): it does not exist, is a zombie (killed, not yet reaped), or
    started after the run did, so its pid was reused."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's process: it exists
    proc = _proc_start(pid)
    if proc is None:  # no /proc (not Linux): existing is all we can tell
        return False
    state, proc_started = proc
    if state in ("Z", "X"):
        return True
    run_started = started_at.replace(tzinfo=timezone.utc).timestamp()
    return proc_started > run_started + _START_SLACK_SECONDS


def find_abandoned(conn: duckdb.DuckDBPyConnection) -> dict[str, str]:
    """The ``running`` runs of this host whose process is gone: run id → why, in words. Reads only."""
    rows = warehouse.execute(conn, 
        "SELECT run_id, pid, started_at FROM runs WHERE status = 'running' AND host = ? AND pid IS NOT NULL",
        [this_host()],
    ).fetchall()
    return {
        run_id: f"abandoned: its process (pid {pid} on {this_host()}) is gone; the run never finished"
        for run_id, pid, started_at in rows if process_gone(pid, started_at)
    }


def apply(runs: Iterable[dict[str, Any]], abandoned: dict[str, str]) -> list[dict[str, Any]]:
    """``runs`` rows (dicts) as they are: a run in ``abandoned`` gets status 'abandoned' and,
    unless it has one, the reason as its error."""
    out = []
    for r in runs:
        why = abandoned.get(r["run_id"])
        if why is not None and r.get("status") == "running":
            r = {**r, "status": ABANDONED, "error": r.get("error") or why}
        out.append(r)
    return out


def mark_abandoned(conn: duckdb.DuckDBPyConnection, settings: Settings, *, by: str) -> list[str]:
    """Record as 'abandoned' every ``running`` run of this host whose process is gone, in one
    commit (none when there is nothing to mark); ``by`` names the run that found them. Returns
    their run ids."""
    found = find_abandoned(conn)
    if not found:
        return []
    rows = warehouse.execute(conn, 
        "SELECT run_id, pid FROM runs WHERE list_contains($ids, run_id)", {"ids": list(found)}
    ).fetchall()

    def body(c: duckdb.DuckDBPyConnection) -> list[str]:
        marked = []
        for run_id, pid in rows:
            # only if still the same process's run: a retry of the run id may have taken it over
            hit = warehouse.execute(c, 
                "UPDATE runs SET status = $abandoned, error = coalesce(error, $why) "
                "WHERE run_id = $run_id AND status = 'running' AND host = $host AND pid = $pid",
                {"abandoned": ABANDONED, "why": f"{found[run_id]} (found by run {by})", "run_id": run_id,
                 "host": this_host(), "pid": pid},
            ).fetchone()[0]
            if hit:
                marked.append(run_id)
        return marked

    marked = warehouse.transaction(conn, settings, body, message=f"run {by}: marked abandoned runs",
                                   extra={"run_id": by, "abandoned": sorted(found)})
    return marked


@dataclass
class RunSummary:
    """What one ingest run did; ``as_dict()`` is small enough to pass between Airflow tasks."""

    run_id: str
    warehouse: str
    status: str = "running"
    n_received: int = 0
    """Inputs this run saw: ``n_landed + n_reread + n_duplicates + n_unread``, and also
    ``n_loaded + n_rejected + n_duplicates``."""
    n_landed: int = 0
    """New: bytes never landed before."""
    n_reread: int = 0
    """Landed before and read again: ``--reprocess``, a size limit since raised, or a newer
    capture of bytes already loaded that changes what is loaded."""
    n_duplicates: int = 0
    """Landed before and skipped: nothing to read again (a newer capture time is still recorded)."""
    n_unread: int = 0
    """Refused before anything was read (a named pipe, a broken link, a folder that cannot be
    read); counted in ``n_rejected`` too."""
    n_loaded: int = 0
    n_rejected: int = 0
    n_features: int = 0
    n_activations: int = 0
    n_explanations: int = 0
    n_quarantined: int = 0
    n_superseded: int = 0
    n_expectations: int = 0
    n_expectations_failed: int = 0
    seconds: float = 0.0
    """From the command's start to the run's end (before its report; ``fetch features``: after
    it, so every stage in ``stage_seconds`` is inside): ``runs``' started_at and finished_at span
    the same, so ``status`` and the ingest's summary give one duration. A part's is its own; its
    run's (``runs``) is the night's, from its first fetch to ``finish``."""
    started_at: datetime | None = field(default=None, repr=False)
    """When the ingest began (naive UTC), before it opened the warehouse: ``runs.started_at``."""
    clock_started: float = field(default_factory=time.monotonic, repr=False)
    """The monotonic clock as the summary was made (with ``started_at``): see :meth:`elapsed`."""
    commits: int = 0
    commit_retries: int = 0
    lock_wait_seconds: float = 0.0
    commit_seconds: float = 0.0
    rejected: list[dict[str, str]] = field(default_factory=list)
    report_path: str | None = None
    stats: warehouse.CommitStats = field(default_factory=warehouse.CommitStats, repr=False)
    """Accumulates over the run's transactions; copied into the fields above."""
    part: int | None = None
    """Set when this ingest is one of several loading one run at once (``ingest(part=...)``)."""
    written: dict[str, float] = field(default_factory=dict, repr=False)
    """A part's counters as already added to the shared ``runs`` row."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds spent in each stage, in the order they ran: ``land`` (receive, land, route;
    a page DuckDB cannot read is parsed here), ``read`` (DuckDB reads pages and exports), ``stage``
    (staging tables, captures settled), ``validate`` (check columns and Great Expectations),
    ``write`` (a batch's data files, before the commit lock), ``commit`` (the locked transaction:
    lock wait, deletes, catalog, bookkeeping; ``stats`` included), ``stats`` (the statistics of
    the features a batch changed), ``report``."""
    stage_cpu_seconds: dict[str, float] = field(default_factory=dict)
    """CPU seconds (user + system) of the thread that ran each stage, as ``stage_seconds``: all of
    a stage's CPU when DuckDB runs it on that thread (a batch under ``bytes_per_thread`` of input,
    the default for every export file), without its worker threads' when it has several."""

    @contextlib.contextmanager
    def timed(self, stage: str):
        """Add the time the ``with`` block takes to ``stage_seconds[stage]``."""
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + time.perf_counter() - started
            self.stage_cpu_seconds[stage] = self.stage_cpu_seconds.get(stage, 0.0) + time.thread_time() - cpu

    def elapsed(self) -> tuple[float, datetime]:
        """The run's seconds so far by the monotonic clock (a wall clock stepped back or on during
        the run moves neither), and the moment they end on the run's own clock: ``started_at`` +
        those seconds (now, for a part, whose run began with its first part). Recorded as
        ``runs.finished_at``, the summary and ``status`` give one duration, however long the
        commit recording it takes."""
        seconds = round(time.monotonic() - self.clock_started, 3)
        if self.started_at is None:
            return seconds, warehouse.utcnow()
        return seconds, self.started_at + timedelta(seconds=seconds)

    def sync_commit_stats(self) -> dict[str, float]:
        self.commits, self.commit_retries = self.stats.commits, self.stats.retries
        self.lock_wait_seconds = round(self.stats.lock_wait_seconds, 3)
        self.commit_seconds = round(self.stats.commit_seconds, 3)
        return {k: getattr(self, k) for k in _COMMIT_FIELDS}

    def as_dict(self) -> dict[str, Any]:
        self.sync_commit_stats()
        d = asdict(self)
        d.pop("stats")
        d.pop("written")
        d.pop("started_at")
        d.pop("clock_started")
        d["rejected"] = d["rejected"][:50]
        d["stage_seconds"] = {k: round(v, 3) for k, v in self.stage_seconds.items()}
        d["stage_cpu_seconds"] = {k: round(v, 3) for k, v in self.stage_cpu_seconds.items()}
        return d


COUNTERS = (
    "n_received", "n_landed", "n_reread", "n_duplicates", "n_unread", "n_loaded", "n_rejected", "n_features",
    "n_activations", "n_explanations", "n_quarantined", "n_superseded", "n_expectations",
    "n_expectations_failed",
)
_COMMIT_FIELDS = ("commits", "commit_retries", "lock_wait_seconds", "commit_seconds")


def write_counts(conn: duckdb.DuckDBPyConnection, summary: RunSummary, counts: dict[str, float]) -> None:
    """Store the run's counters. A part of a shared run adds what it counted since its last
    write (parts commit one at a time under the commit lock, so the sums are exact); a whole
    run stores its totals."""
    if summary.part is None:
        warehouse.execute(conn, "UPDATE runs SET " + ", ".join(f"{c} = ${c}" for c in counts) + " WHERE run_id = $run_id",
                     counts | {"run_id": summary.run_id})
        return
    add = {c: v - summary.written.get(c, 0) for c, v in counts.items()}
    warehouse.execute(conn, "UPDATE runs SET " + ", ".join(f"{c} = coalesce({c}, 0) + ${c}" for c in add)
                 + " WHERE run_id = $run_id", add | {"run_id": summary.run_id})


_BEGAN: contextvars.ContextVar[datetime | None] = contextvars.ContextVar("featurehouse_run_began", default=None)


@contextlib.contextmanager
def began_at(when: datetime | None):
    """Within the block, a part of a shared run that makes the run's row (the first part)
    records ``when`` (naive UTC) as the run's ``started_at``, not its own start: a night's run
    began when its first fetch did (``pipeline.sources.fetched.ingest_unit``). None changes nothing."""
    token = _BEGAN.set(when)
    try:
        yield
    finally:
        _BEGAN.reset(token)


def start_run(conn: duckdb.DuckDBPyConnection, settings: Settings, summary: RunSummary, trigger: str) -> None:
    """Record the run as running, and which process runs it (``runs.host``, ``runs.pid``: how a
    later run tells it was killed); a retry of the same run id carries on from its counts. A
    part of a shared run makes the row if it is the first (started when :func:`began_at` says,
    else now), and clears its own earlier failure; a shared run records no owner (its parts run
    in many processes, and the DAG's ``finish`` task settles its status), so it is never taken
    for abandoned.
    """
    began = summary.started_at or (_BEGAN.get() if summary.part is not None else None) or utcnow()
    owner = {"host": this_host(), "pid": os.getpid()} if summary.part is None else {"host": None, "pid": None}

    def body(conn: duckdb.DuckDBPyConnection) -> None:
        stored = warehouse.execute(conn, f"SELECT {', '.join(COUNTERS + _COMMIT_FIELDS)} FROM runs WHERE run_id = ?",
                              [summary.run_id]).fetchone()
        if stored and summary.part is not None:
            warehouse.execute(conn, "UPDATE runs SET status = 'running', error = NULL WHERE run_id = ? AND status = 'failed' "
                         "AND starts_with(error, ?)", [summary.run_id, _part_tag(summary.part)])
        elif stored:  # a retry of the same run: carry on from what its earlier attempts counted
            for name, value in zip(COUNTERS, stored):
                setattr(summary, name, value or 0)
            st = summary.stats
            st.commits, st.retries, st.lock_wait_seconds, st.commit_seconds = (v or 0 for v in stored[len(COUNTERS):])
            warehouse.execute(conn, "UPDATE runs SET status = 'running', started_at = $at, finished_at = NULL, error = NULL, "
                         "host = $host, pid = $pid WHERE run_id = $run_id",
                         {"at": summary.started_at or utcnow(), "run_id": summary.run_id} | owner)
        else:
            warehouse.execute(conn, "INSERT INTO runs (run_id, started_at, status, trigger, host, pid) "
                         "VALUES ($run_id, $at, 'running', $trigger, $host, $pid)",
                         {"run_id": summary.run_id, "at": began, "trigger": trigger} | owner)

    if summary.part is not None:
        # A part of a run whose row is there, not failed by this part: nothing to write, so no
        # commit (and no turn of the commit lock: one for every unit of a night). Decided again
        # inside the commit when there is something to write.
        row = warehouse.execute(conn, "SELECT status, error FROM runs WHERE run_id = ?", [summary.run_id]).fetchone()
        if row is not None and not (row[0] == "failed" and (row[1] or "").startswith(_part_tag(summary.part))):
            return
    warehouse.transaction(conn, settings, body, message=f"run {summary.run_id} started",
                          extra={"run_id": summary.run_id}, stats=summary.stats)


def _part_tag(part: int) -> str:
    return f"part c{part}: "


def finish_run(conn: duckdb.DuckDBPyConnection, settings: Settings, summary: RunSummary,
               error: str | None = None, at: datetime | None = None) -> None:
    def part_body(c: duckdb.DuckDBPyConnection) -> dict[str, float]:
        counts = {k: getattr(summary, k) for k in COUNTERS} | summary.sync_commit_stats()
        write_counts(c, summary, counts)
        if error is not None:  # the run fails with its part; the part's retry clears it (_start_run)
            warehouse.execute(c, "UPDATE runs SET status = 'failed', error = ? WHERE run_id = ?",
                      [_part_tag(summary.part) + error, summary.run_id])
        return counts

    def body(c: duckdb.DuckDBPyConnection) -> None:
        stats = summary.sync_commit_stats()
        warehouse.execute(c, "UPDATE runs SET status = $status, finished_at = $at, error = $error, "
                  + ", ".join(f"{k} = ${k}" for k in stats) + " WHERE run_id = $run_id",
                  {"status": summary.status, "at": at or utcnow(), "error": error, "run_id": summary.run_id} | stats)

    if summary.part is None:
        warehouse.transaction(conn, settings, body, message=f"run {summary.run_id} {summary.status}",
                              extra={"run_id": summary.run_id}, stats=summary.stats)
        return
    # A part only adds its counts: the run's status is decided once all parts are done
    # (pipeline.sources.fetched.finish_fetched).
    summary.written = warehouse.transaction(
        conn, settings, part_body, message=f"run {summary.run_id} part c{summary.part} {summary.status}",
        extra={"run_id": summary.run_id, "part": summary.part}, stats=summary.stats)


def finish_parts(conn: duckdb.DuckDBPyConnection, settings: Settings, run_id: str, failed_parts: int = 0,
                 started_at: datetime | None = None) -> str:
    """Close a run loaded in parts: ``succeeded`` unless a part failed (its error stays) or
    ``failed_parts`` (known to the scheduler) is above 0. Returns the status. ``started_at``
    (naive UTC), when the run began before its first part did (a night's first fetch), becomes
    its ``started_at``: its ``seconds`` are then the whole night's, fetching included."""
    def body(c: duckdb.DuckDBPyConnection) -> str:
        row = warehouse.execute(c, "SELECT status FROM runs WHERE run_id = ?", [run_id]).fetchone()
        if row is None:  # no part had anything to load
            warehouse.execute(c, "INSERT INTO runs (run_id, started_at, status, trigger) VALUES (?, ?, 'running', 'airflow')",
                      [run_id, started_at or utcnow()])
        status = "failed" if (row and row[0] == "failed") or failed_parts else "succeeded"
        warehouse.execute(c, "UPDATE runs SET status = ?, finished_at = ?, error = coalesce(error, ?), "
                          "started_at = least(started_at, coalesce(?, started_at)) WHERE run_id = ?",
                  [status, utcnow(), f"{failed_parts} ingest part(s) failed" if failed_parts else None,
                   started_at, run_id])
        return status

    return warehouse.transaction(conn, settings, body, message=f"run {run_id} parts finished",
                                 extra={"run_id": run_id})


def end_run(conn: duckdb.DuckDBPyConnection, settings: Settings, run_id: str, at: datetime) -> None:
    """Move a finished run's ``finished_at`` on to ``at`` (naive UTC): the end of the work that
    came after its load and belongs to it (``fetch features`` writes the run's fetch failures and
    its report then), so that ``runs`` and the command's summary give one duration."""
    warehouse.transaction(
        conn, settings, lambda c: warehouse.execute(
            c, "UPDATE runs SET finished_at = greatest(finished_at, ?) WHERE run_id = ? AND finished_at IS NOT NULL",
            [at, run_id]),
        message=f"run {run_id} ended", extra={"run_id": run_id},
    )


def record_report(conn: duckdb.DuckDBPyConnection, settings: Settings, run_id: str, path: Path,
                  ended_at: datetime | None = None) -> None:
    """Record where a run's HTML report was written (``runs.report_path``); with ``ended_at``
    (naive UTC), the run's ``finished_at`` moves on to it in the same commit (the run wrote its
    report: its duration includes it, as the command's summary does)."""
    warehouse.transaction(
        conn, settings, lambda c: warehouse.execute(
            c, "UPDATE runs SET report_path = ?, finished_at = CASE WHEN finished_at IS NULL OR ? IS NULL "
               "THEN finished_at ELSE greatest(finished_at, ?) END WHERE run_id = ?",
            [str(path), ended_at, ended_at, run_id]),
        message=f"run {run_id} report", extra={"run_id": run_id},
    )
