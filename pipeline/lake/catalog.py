"""The warehouse's catalog, as every room of the lake names it: ``CATALOG``, the name it is
attached under; where an SQLite catalog file is; a catalog URL fit for messages; and the look at
an SQLite catalog file that tells a DuckLake from a new folder or a damaged file."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import duckdb

from ..config import Settings
from .extensions import new_connection as _duckdb
from .landing import disk_full
from .sqltext import _q


def utcnow() -> datetime:
    """Now, in UTC, without a time zone (the catalog's TIMESTAMP columns)."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


#: The name the warehouse is attached under in every featurehouse connection.
CATALOG = "featurehouse"


class BadCatalog(RuntimeError):
    "The warehouse's catalog exists but is not a DuckLake catalog (damaged, or another file)."


def _sqlite_file(settings: Settings) -> Path:
    return Path(settings.catalog_url.split(":", 1)[1])


def _catalog_state(settings: Settings, conn: duckdb.DuckDBPyConnection | None = None) -> tuple[bool | None, str | None]:
    """For an SQLite catalog, whether its file holds a DuckLake, and the data path it records;
    ``(None, None)`` for other catalogs. ``conn``, when given, is a connection with DuckDB's
    SQLite loaded that the catalog is attached to for the look and detached from after (saving
    the ~0.2 s of a connection of its own and a second LOAD at every open).

    Read through DuckDB's SQLite (its sqlite extension, the one DuckLake uses), never Python's
    sqlite3: two SQLite libraries in one process do not see each other's locks (POSIX locks are
    per process), and Python's, opened while a DuckDB connection of this process had the catalog,
    took its WAL index for unused and truncated it under DuckDB's mapping (SIGBUS), or read it
    half-written ("database disk image is malformed") — threads ingesting at once in one process.
    """
    if settings.catalog_kind != "sqlite":
        return None, None
    path = _sqlite_file(settings)
    if not path.exists():
        return False, None
    if path.stat().st_size == 0:
        return False, None  # an empty file is an SQLite database without tables
    own = conn is None
    probe = _duckdb(["sqlite_scanner"]) if own else conn
    # A catalog another process or thread is making right now (its file written, its write-ahead
    # log index not yet) refuses a read-only look with "attempt to write a readonly database";
    # where this user may write the catalog and its folder that passes: look again, for 10 s.
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                return _probe_catalog(probe, path)
            except duckdb.Error as exc:
                beside = [Path(f"{path}-wal"), Path(f"{path}-shm")]  # another user's leave it read-only
                if not ("readonly database" in str(exc) and time.monotonic() < deadline
                        and all(os.access(p, os.W_OK) for p in [path.parent, path, *beside] if p.exists())):
                    raise
            finally:  # SQLite's ATTACH is lazy: its error may come after the name is taken
                with contextlib.suppress(duckdb.Error):
                    probe.execute("DETACH DATABASE IF EXISTS catalog_probe")
            time.sleep(0.05)
    except duckdb.Error as exc:
        said = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(path.parent).free
            if free < 1 << 20 or disk_full(exc):
                # SQLite cannot make the index of its write-ahead log ("disk I/O error"): the
                # catalog is not damaged, and moving it away would lose the warehouse
                raise BadCatalog(f"the warehouse's catalog {path} cannot be opened ({said}): the disk that holds "
                                 f"it is full ({free:,} bytes free); free some space and run again") from None
        if "readonly database" in str(exc) or not os.access(path.parent, os.W_OK) or not os.access(path, os.W_OK):
            # SQLite writes beside the catalog (its write-ahead log) even to read it: the
            # catalog is sound, this user may not write its folder
            raise BadCatalog(f"the warehouse's catalog {path} cannot be opened ({said}): this user may not write "
                             f"it or its folder {path.parent} (a read-only copy or mount?); give write access, or "
                             "open a writable copy") from None
        if "database is locked" in str(exc) or "locking protocol" in str(exc):
            # SQLite's own locks, held by a process that does not go on (stopped, hung): the
            # catalog is sound, and moving it away would lose the warehouse
            who = ", ".join(f"process {pid}" for pid in _lock_holders(path)) or "another process"
            raise BadCatalog(f"the warehouse's catalog {path} is locked by {who} ({said}): a process that holds "
                             "it and does not go on (stopped with Ctrl-Z or SIGSTOP, in a debugger, hung) keeps "
                             "every other reader out; let it go on (`fg`, `kill -CONT PID`) or end it, then run "
                             "again. The catalog is not damaged: do not move it away") from None
        raise BadCatalog(f"the warehouse's catalog {path} cannot be read as an SQLite database ({said}); "
                         "restore it from a backup, or move it away to start a new warehouse") from None
    finally:
        if own:
            probe.close()


def _lock_holders(path: Path) -> list[int]:
    """The processes holding a lock on the SQLite catalog ``path`` or its WAL index, from the
    kernel's table of locks (Linux; elsewhere none are named), this one left out."""
    inodes = set()
    for f in (path, Path(f"{path}-shm"), Path(f"{path}-wal")):
        with contextlib.suppress(OSError):
            inodes.add(os.stat(f).st_ino)
    pids: list[int] = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/locks").read_text().splitlines():
            f = line.split()  # 1: POSIX  ADVISORY  WRITE 1234 08:01:5678 120 122 (or "->" first: a waiter)
            if f[1] == "->":
                continue
            pid, inode = int(f[4]), int(f[5].rsplit(":", 1)[1])
            if inode in inodes and pid != os.getpid() and pid not in pids:
                pids.append(pid)
    return pids


def _probe_catalog(probe: duckdb.DuckDBPyConnection, path: Path) -> tuple[bool, str | None]:
    """``_catalog_state``'s look at an SQLite catalog file, through ``probe`` (attached as
    ``catalog_probe``; the caller detaches it)."""
    probe.execute(f"ATTACH '{_q(str(path))}' AS catalog_probe (TYPE sqlite, READ_ONLY)")
    tables = {t for (t,) in probe.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = 'catalog_probe' "
        "AND table_name IN ('ducklake_snapshot', 'ducklake_metadata')").fetchall()}
    if "ducklake_snapshot" not in tables:
        return False, None
    row = probe.execute("SELECT value FROM catalog_probe.ducklake_metadata WHERE key = 'data_path' "
                        "AND scope IS NULL").fetchone() if "ducklake_metadata" in tables else None
    return True, (row[0] if row else None)


def _redact(url: str) -> str:
    """A catalog URL for messages: without its password (a quoted one with spaces in it, a URL's
    with no user name too: catalog_down.redact)."""
    from .catalog_down import redact

    return redact(url)
