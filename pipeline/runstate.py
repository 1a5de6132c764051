"""Whether a run marked ``running`` is still running: its process (``runs.host``, ``runs.pid``,
``runs.started_at``) may have been killed (SIGKILL, out of memory, a machine restarted) before
it could record how it ended.

Only a process on this host can be looked at. A run is *abandoned* when its host is this one and
its process is gone: no such pid, a zombie, or a pid the system has since given to a process
that started after the run did (pid reuse). Runs on other hosts, and runs recorded before
``runs.host`` existed, are left as they are: nothing here can tell whether they are alive.

Readers (``featurehouse status``, the report) compute this on read and never write; an ingest
records it (``mark_abandoned``) before its own run starts.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from . import warehouse
from .config import Settings

__all__ = ["ABANDONED", "this_host", "process_gone", "find_abandoned", "apply", "mark_abandoned"]

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
    rows = conn.execute(
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
    rows = conn.execute(
        "SELECT run_id, pid FROM runs WHERE list_contains($ids, run_id)", {"ids": list(found)}
    ).fetchall()

    def body(c: duckdb.DuckDBPyConnection) -> list[str]:
        marked = []
        for run_id, pid in rows:
            # only if still the same process's run: a retry of the run id may have taken it over
            hit = c.execute(
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
