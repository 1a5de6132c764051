"""Signal handling: a SIGTERM or Ctrl-C ends a loading command with its exit code (128 + the
signal) and one line saying what stands, recorded or not, at any point, the interpreter's
teardown included."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from ..config import Settings
from ..lake import warehouse as warehouse_mod
from ..signals import RAISED as _TERMINATED
from ..signals import importing


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
