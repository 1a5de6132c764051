"""Where a signal handler found the main thread."""

from __future__ import annotations

import _imp
from typing import Any


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
