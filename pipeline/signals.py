"""Where a signal handler found the main thread; the signals a loading command got before its
own handlers were in place."""

from __future__ import annotations

import _imp
import os
import signal
import threading
from typing import Any

#: SIGTERM and SIGINT that came to a loading command (``featurehouse ingest|fetch``) before its
#: handlers were installed (``note_early``): the command says so and exits, nothing loaded.
EARLY: list[int] = []
LOADING_COMMANDS = ("ingest", "fetch")

#: SIGTERM and SIGINT whose handler (the CLI's) raised in the main thread. The exception can be
#: swallowed on its way out: raised inside a Python callback DuckDB made during a query (its
#: lookup of a Python object named like a missing table, which walks frames with ``inspect``), it
#: became an error the code expected, and the run went on to load and exit 0, the Ctrl-C lost
#: (found by the signal test, about one run in ten on a loaded machine). The run stops at its next
#: point that may (``ingest.stopping._stop_if_signalled``) when this holds one.
RAISED: list[int] = []


def note_early(argv: list[str]) -> None:
    """From the package's first import in a ``featurehouse ingest|fetch`` process: note SIGTERM
    and SIGINT instead of dying in silence (rc -15) or raising KeyboardInterrupt inside the
    imports that follow (which left the import lock held: the run then hung for good). The CLI
    replaces these handlers with its own, then says what came."""
    if (os.path.basename(argv[0] if argv else "") == "featurehouse" and set(argv[1:3]) & set(LOADING_COMMANDS)
            and threading.current_thread() is threading.main_thread()):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: EARLY.append(signum))


def importing(frame: Any) -> bool:
    """Whether the main thread is inside an import (``frame``: where a signal handler found it).

    An exception raised there can leave the interpreter's import lock, or the module's, held for
    ever (the import machinery takes a lock, then enters its ``try``): every later import waits,
    in every thread. Found from outside: a SIGTERM half a second into ``featurehouse ingest``
    left it held, the thread importing Great Expectations waited on it, the main thread on that
    thread, and the run hung. A handler that finds the main thread importing must not raise.
    The interpreter's import lock held (by any thread) counts too: it is taken and released by
    the import machinery, and by ``_imp.acquire_lock`` callers.
    """
    if _imp.lock_held():
        return True
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False
