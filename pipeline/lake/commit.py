"""The commit lock and the transactions that write the lake.

Writers take the warehouse's *commit lock* for the length of each load transaction (a file lock
beside an SQLite catalog, an advisory lock on PostgreSQL), so each transaction starts from the
latest snapshot and decides what a capture replaces against what is committed; everything
before it (landing, reading, validating) runs in parallel. A transaction that still loses a
commit race (to maintenance, or to a writer outside featurehouse) is retried with backoff.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import orjson

from ..config import Settings
from .catalog import CATALOG, _redact, _sqlite_file
from .landing import disk_full
from .sqltext import execute

log = logging.getLogger("featurehouse")

T = TypeVar("T")


class CommitFailed(RuntimeError):
    "A load transaction kept losing commit races and ran out of attempts."


# --- the commit lock ----------------------------------------------------------------------------


class _Lock:
    """One warehouse's commit lock in this process: re-entrant, shared by threads."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.mutex = threading.RLock()
        self.depth = 0
        self.owner: int | None = None  # the thread holding it
        self.handle: Any = None

    def _acquire_os(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        warned = False
        if self.settings.catalog_kind == "sqlite":
            path = Path(str(_sqlite_file(self.settings)) + ".lock")
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        warned = self._wait(deadline, warned)
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.uname().nodename} {os.getpid()}\n".encode())
            except BaseException:
                os.close(fd)
                raise
            self.handle = fd
            return
        import psycopg  # PostgreSQL catalogs only

        dsn = self.settings.catalog_url.split(":", 1)[1]
        key = int.from_bytes(hashlib.sha256(f"featurehouse:{dsn}".encode()).digest()[:8], "big", signed=True)
        pg = psycopg.connect(dsn, autocommit=True)
        try:
            while not pg.execute("SELECT pg_try_advisory_lock(%s)", [key]).fetchone()[0]:
                warned = self._wait(deadline, warned)
        except BaseException:
            pg.close()
            raise
        self.handle = pg

    def _wait(self, deadline: float, warned: bool) -> bool:
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {self.settings.lock_timeout:.0f}s for the warehouse's commit lock "
                               f"({_redact(self.settings.catalog_url)}); another writer holds it")
        if not warned:
            log.info("waiting for the warehouse's commit lock (another writer is committing)")
        time.sleep(0.02 + random.random() * 0.08)
        return True

    def _release_os(self) -> None:
        handle, self.handle = self.handle, None
        if isinstance(handle, int):
            fcntl.flock(handle, fcntl.LOCK_UN)
            os.close(handle)
        elif handle is not None:
            handle.close()  # ends the session, which releases the advisory lock

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        started = time.monotonic()
        # another thread of this process holding it is waited for as long as another process
        if not self.mutex.acquire(timeout=self.settings.lock_timeout):
            raise TimeoutError(f"waited {self.settings.lock_timeout:.0f}s for the warehouse's commit lock "
                               f"({_redact(self.settings.catalog_url)}); another thread of this process holds it")
        try:
            if self.depth == 0:
                self._acquire_os(max(0.0, self.settings.lock_timeout - (time.monotonic() - started)))
                self.owner = threading.get_ident()
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.owner = None
                    self._release_os()
        finally:
            self.mutex.release()


_LOCKS: dict[str, _Lock] = {}
_LOCKS_GUARD = threading.Lock()


def holds_write_lock(settings: Settings) -> bool:
    """True when the calling thread holds the warehouse's commit lock (``write_lock``): work it
    runs must take the lock in this thread, not wait for it in another."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(settings.catalog_url)
    return lock is not None and lock.owner == threading.get_ident()


def write_lock(settings: Settings) -> contextlib.AbstractContextManager[None]:
    """The warehouse's commit lock (re-entrant in a process; released if the process dies)."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(settings.catalog_url)
        if lock is None:
            lock = _LOCKS[settings.catalog_url] = _Lock(settings)
        lock.settings = settings
    return lock.held()


# --- transactions -------------------------------------------------------------------------------

_RETRYABLE = re.compile(
    r"conflict|database is locked|could not serialize|deadlock|Failed to commit DuckLake transaction"
    r"|Failed to read inlined data"  # maintain flushed them under a load begun before (warehouses before 0003)
    r"|another transaction|SQLITE_BUSY",
    re.I,
)




def is_conflict(exc: BaseException) -> bool:
    """True for an error that another writer's commit caused (retrying the transaction helps)."""
    # a full disk under the catalog or the data files reads "Failed to commit DuckLake
    # transaction" too, but no retry helps (they spent seconds, logged as commit conflicts)
    return isinstance(exc, duckdb.Error) and bool(_RETRYABLE.search(str(exc))) and not disk_full(exc)


@contextlib.contextmanager
def one_snapshot(conn: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """Run the statements inside in one transaction that writes nothing to the lake: they read
    one snapshot of it (the latest as the first of them reads), and DuckLake looks the snapshot
    up once instead of once a statement (a lake read in autocommit costs ~10 ms here, ~5 ms in a
    transaction). Temp tables and files written inside stay; nothing is committed to the lake.
    Not for statements that change the lake: use ``transaction`` (the commit lock, retries).
    Inside a transaction the caller opened, the statements run in it: it reads one snapshot
    already, and it is the caller's to commit or roll back, never this block's."""
    if _in_transaction(conn):
        yield
        return
    try:  # BEGIN and COMMIT inside: an interrupt (SIGTERM) at either rolls back too
        conn.execute("BEGIN TRANSACTION")
        yield
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(duckdb.Error):
            conn.execute("ROLLBACK")
        raise


def _in_transaction(conn: duckdb.DuckDBPyConnection) -> bool:
    """Whether a transaction is open on ``conn``: in autocommit each statement is a transaction
    of its own, with its own id. (Trying BEGIN would tell too, but its error aborts the open
    transaction.)"""
    first = conn.execute("SELECT current_transaction_id()").fetchone()[0]  # (txid_current() fails on a lake)
    return conn.execute("SELECT current_transaction_id()").fetchone()[0] == first


@dataclass
class CommitStats:
    """Where a writer's commits spent their time: how a run tells that commits are its bottleneck."""

    commits: int = 0
    retries: int = 0
    """Transactions rolled back after losing a commit race, and run again."""
    lock_wait_seconds: float = 0.0
    """Time spent waiting for the commit lock (other writers committing)."""
    commit_seconds: float = 0.0
    """Time spent inside transactions holding the lock (writing data files and the catalog)."""


def transaction(conn: duckdb.DuckDBPyConnection, settings: Settings, body: Callable[[duckdb.DuckDBPyConnection], T],
                *, message: str, extra: dict[str, Any] | None = None, stats: CommitStats | None = None) -> T:
    """Run ``body(conn)`` in one transaction under the commit lock, committed as one snapshot
    whose commit message is ``message`` and extra info ``extra`` (JSON, e.g. the run id).

    A commit that loses a race (a conflict, or a busy catalog) is rolled back and the whole
    transaction retried, up to ``settings.commit_attempts`` times with exponential backoff and
    jitter; ``body`` must therefore be safe to run again. Any other error is raised as it is.
    ``stats``, when given, accumulates the time waited and spent, and the retries.
    """
    stats = stats if stats is not None else CommitStats()
    attempts = max(1, settings.commit_attempts)
    for attempt in range(1, attempts + 1):
        try:
            waited = time.monotonic()
            with write_lock(settings):
                began = time.monotonic()
                stats.lock_wait_seconds += began - waited
                conn.execute("BEGIN TRANSACTION")
                try:
                    execute(conn, f"CALL {CATALOG}.set_commit_message('featurehouse', ?, extra_info => ?)",
                            [message, orjson.dumps(extra or {}).decode()])
                    result = body(conn)
                    conn.execute("COMMIT")
                    stats.commits += 1
                    return result
                except BaseException:
                    with contextlib.suppress(duckdb.Error):
                        conn.execute("ROLLBACK")
                    raise
                finally:
                    stats.commit_seconds += time.monotonic() - began
        except duckdb.Error as exc:
            if not is_conflict(exc):
                raise
            if attempt == attempts:
                raise CommitFailed(f"{message}: still conflicting after {attempts} attempts: {exc}") from exc
            stats.retries += 1
            delay = min(30.0, 0.1 * 2 ** (attempt - 1)) * (0.5 + random.random())
            log.warning("%s: commit conflict (%s); retrying in %.2fs (attempt %d of %d)",
                        message, str(exc).splitlines()[0][:200], delay, attempt + 1, attempts)
            time.sleep(delay)
    raise AssertionError("unreachable")
