"""A run's signals: SIGINT and SIGTERM watched for the points where the run may stop, held over
statements that must not be cut in two, let go while a stopping run records its failure.
(``pipeline/signals.py`` notes the signals that come before the run and those whose exception
was swallowed on its way; these helpers act on them within a run.)"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from ..signals import RAISED, importing


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
