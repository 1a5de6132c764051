"""The warehouse: a DuckLake (a SQL catalog + Parquet data files), opened with DuckDB.

The catalog is an SQLite file in the warehouse folder by default (several local processes) or
a PostgreSQL database (many machines); the data files live in a folder or an S3 prefix. Every
commit is a snapshot: readers see the last committed one and are never blocked by a load.

Writers take the warehouse's *commit lock* for the length of each load transaction (a file lock
beside an SQLite catalog, an advisory lock on PostgreSQL), so each transaction starts from the
latest snapshot and decides what a capture replaces against what is committed; everything
before it (landing, reading, validating) runs in parallel. A transaction that still loses a
commit race (to maintenance, or to a writer outside featurehouse) is retried with backoff.

The schema carries a version: opening an older warehouse for writing applies the ordered
migrations in ``schemas/migrations``; a newer one is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import random
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import orjson

from ..config import SCHEMAS_DIR, Settings


def utcnow() -> datetime:
    """Now, in UTC, without a time zone (the catalog's TIMESTAMP columns)."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


__all__ = [
    "CATALOG", "WarehouseMissing", "LegacyWarehouse", "SchemaTooNew", "SchemaTooOld", "CommitFailed", "BadCatalog",
    "connect", "transaction", "write_lock", "schema_version", "migrations", "latest_version",
    "attach_sql", "extension_path", "settings_for", "sandbox", "apply_migrations", "is_conflict", "CommitStats",
]

log = logging.getLogger("featurehouse")

#: The name the warehouse is attached under in every featurehouse connection.
CATALOG = "featurehouse"

T = TypeVar("T")


class WarehouseMissing(FileNotFoundError):
    "The warehouse does not exist yet: run `featurehouse ingest` first."


class LegacyWarehouse(ValueError):
    "The path names a single-file DuckDB warehouse of an earlier release: move it with `featurehouse migrate`."


class SchemaTooNew(RuntimeError):
    "The warehouse was written by a newer featurehouse: upgrade featurehouse to open it."


class SchemaTooOld(RuntimeError):
    "The warehouse's schema is older than this featurehouse: any write command upgrades it."


class BadCatalog(RuntimeError):
    "The warehouse's catalog exists but is not a DuckLake catalog (damaged, or another file)."


class CommitFailed(RuntimeError):
    "A load transaction kept losing commit races and ran out of attempts."


def settings_for(where: Settings | str | os.PathLike) -> Settings:
    """``where`` as Settings: a warehouse folder resolves the rest from the environment."""
    return where if isinstance(where, Settings) else Settings.from_env(warehouse=Path(where))


# --- extensions ---------------------------------------------------------------------------------

_WHEELS = {
    "ducklake": "duckdb_extension_ducklake",
    "sqlite_scanner": "duckdb_extension_sqlite_scanner",
    "postgres_scanner": "duckdb_extension_postgres_scanner",
    "httpfs": "duckdb_extension_httpfs",
    "aws": "duckdb_extension_aws",
}


def extension_path(name: str) -> str:
    """The extension's file inside its PyPI wheel (``duckdb-extension-<name>``), loadable offline
    with ``LOAD '<path>'``; raises ImportError naming the package when it is not installed."""
    spec = importlib.util.find_spec(_WHEELS[name])
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the DuckDB extension {name!r} is not installed: pip install "
            f"'{_WHEELS[name].replace('_', '-')}=={duckdb.__version__}'"
        )
    base = Path(next(iter(spec.submodule_search_locations)))
    path = base / "extensions" / f"v{duckdb.__version__}" / f"{name}.duckdb_extension"
    if not path.exists():
        found = sorted(base.glob("extensions/*/*.duckdb_extension"))
        raise ImportError(
            f"{_WHEELS[name]} carries no extension for DuckDB {duckdb.__version__} "
            f"(found: {', '.join(p.parent.name for p in found) or 'none'}); install the matching version"
        )
    return str(path)


def _extensions(settings: Settings) -> list[str]:
    names = ["ducklake", "sqlite_scanner" if settings.catalog_kind == "sqlite" else "postgres_scanner"]
    if settings.uses_s3:
        names += _s3_extensions()
    return names


def _s3_extensions() -> list[str]:
    # `aws` only for DuckDB's credential chain: with keys in the variables httpfs is enough, and
    # each LOAD costs a connection ~0.4 s
    keys = os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")
    return ["httpfs"] if keys else ["httpfs", "aws"]


def _q(s: str) -> str:
    return s.replace("'", "''")


def _sqlite_file(settings: Settings) -> Path:
    return Path(settings.catalog_url.split(":", 1)[1])


def _metadata_exists(settings: Settings) -> bool | None:
    """For an SQLite catalog, whether its file holds a DuckLake; None for other catalogs.

    Read through DuckDB's SQLite (its sqlite extension, the one DuckLake uses), never Python's
    sqlite3: two SQLite libraries in one process do not see each other's locks (POSIX locks are
    per process), and Python's, opened while a DuckDB connection of this process had the catalog,
    took its WAL index for unused and truncated it under DuckDB's mapping (SIGBUS), or read it
    half-written ("database disk image is malformed") — threads ingesting at once in one process.
    """
    if settings.catalog_kind != "sqlite":
        return None
    path = _sqlite_file(settings)
    if not path.exists():
        return False
    if path.stat().st_size == 0:
        return False  # an empty file is an SQLite database without tables
    probe = duckdb.connect(config={"autoinstall_known_extensions": False})
    try:
        probe.execute(f"LOAD '{_q(extension_path('sqlite_scanner'))}'")
        probe.execute(f"ATTACH '{_q(str(path))}' AS catalog_probe (TYPE sqlite, READ_ONLY)")
        (n,) = probe.execute("SELECT count(*) FROM duckdb_tables() WHERE database_name = 'catalog_probe' "
                             "AND table_name = 'ducklake_snapshot'").fetchone()
        return bool(n)
    except duckdb.Error as exc:
        raise BadCatalog(f"the warehouse's catalog {path} cannot be read as an SQLite database ({(str(exc).strip() or type(exc).__name__).splitlines()[0]}); "
                         "restore it from a backup, or move it away to start a new warehouse") from None
    finally:
        probe.close()


def _is_duckdb_file(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(16)[8:12] == b"DUCK"
    except OSError:
        return False


def _s3_secret(conn: duckdb.DuckDBPyConnection, settings: Settings) -> None:
    """An S3 secret from the settings' endpoint and region and the standard AWS credentials
    (variables, else DuckDB's credential chain). Values are inlined quoted, never logged."""
    opts = ["TYPE s3"]
    params: list[Any] = []
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        opts += ["KEY_ID ?", "SECRET ?"]
        params += [key, secret]
        if os.environ.get("AWS_SESSION_TOKEN"):
            opts.append("SESSION_TOKEN ?")
            params.append(os.environ["AWS_SESSION_TOKEN"])
    else:
        opts.append("PROVIDER credential_chain")
    opts.append("REGION ?")
    params.append(settings.s3_region)
    if settings.s3_endpoint:
        scheme, _, host = settings.s3_endpoint.rpartition("://")
        opts += ["ENDPOINT ?", "URL_STYLE 'path'", f"USE_SSL {'false' if scheme == 'http' else 'true'}"]
        params.append(host.rstrip("/"))
    # CREATE SECRET takes no prepared parameters: inline them quoted, and never log the statement.
    sql = "CREATE OR REPLACE SECRET featurehouse_s3 (" + ", ".join(opts) + ")"
    for p in params:
        sql = sql.replace("?", f"'{_q(str(p))}'", 1)
    conn.execute(sql)


def _open(settings: Settings, *, read_only: bool, create: bool) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with the warehouse attached as ``featurehouse`` and in use."""
    wh = settings.warehouse
    if wh.is_file():
        if _is_duckdb_file(wh):
            raise LegacyWarehouse(
                f"{wh} is a single-file warehouse of an earlier featurehouse release; move it into "
                f"a lakehouse with `featurehouse migrate {wh} --warehouse {wh.parent}` (its rows, runs "
                "and quarantine are kept)"
            )
        raise WarehouseMissing(f"{wh} is a file, not a warehouse folder")
    exists = _metadata_exists(settings)
    if exists is False and not create:
        raise WarehouseMissing(f"no warehouse at {wh}: run `featurehouse ingest` (or `fetch`) first")
    config: dict[str, Any] = {"memory_limit": os.environ.get("FEATUREHOUSE_DUCKDB_MEMORY", "1GB")}
    if not read_only:
        # spills go into the warehouse folder, not into the current directory
        config["temp_directory"] = str(wh / ".tmp")
    config["autoinstall_known_extensions"] = False  # never reach for the network: load from the wheels
    conn = duckdb.connect(config=config)
    try:
        for name in _extensions(settings):
            conn.execute(f"LOAD '{_q(extension_path(name))}'")
        if settings.uses_s3:
            _s3_secret(conn, settings)
        if read_only or exists is True or not create:
            _attach(conn, settings, ["READ_ONLY"] if read_only else
                    (["CREATE_IF_NOT_EXISTS false"] if exists is None else []))
        else:
            # A new warehouse: made under the commit lock, so that two writers starting at once
            # on an empty folder (or database) make it once.
            wh.mkdir(parents=True, exist_ok=True)
            if settings.catalog_kind == "sqlite":
                _sqlite_file(settings).parent.mkdir(parents=True, exist_ok=True)
            with write_lock(settings):
                if _metadata_exists(settings) is False:
                    with contextlib.closing(sqlite3.connect(_sqlite_file(settings))) as db:
                        # WAL: readers never wait for a writer, which holds the catalog while it loads
                        db.execute("PRAGMA journal_mode=WAL")
                try:
                    _attach(conn, settings, [f"DATA_PATH '{_q(settings.data_url)}'"])
                except duckdb.Error as exc:
                    if "does not match existing data path" not in str(exc):
                        raise
                    _attach(conn, settings, [])  # it existed after all: its data path stands
        conn.execute(f"USE {CATALOG}")
        return conn
    except BaseException:
        conn.close()
        raise


def _attach(conn: duckdb.DuckDBPyConnection, settings: Settings, opts: list[str]) -> None:
    suffix = f" ({', '.join(opts)})" if opts else ""
    try:
        try:
            conn.execute(f"ATTACH 'ducklake:{_q(settings.catalog_url)}' AS {CATALOG}{suffix}")
        except duckdb.Error as exc:
            # The catalog keeps the data path: an s3:// one the settings did not name (a reader
            # given only the catalog) needs httpfs and the secret, loaded offline, not downloaded.
            if "httpfs" not in str(exc) or settings.uses_s3:
                raise
            for name in _s3_extensions():
                conn.execute(f"LOAD '{_q(extension_path(name))}'")
            _s3_secret(conn, settings)
            conn.execute(f"ATTACH 'ducklake:{_q(settings.catalog_url)}' AS {CATALOG}{suffix}")
    except duckdb.Error as exc:
        msg = str(exc)
        if "creating a new DuckLake is explicitly disabled" in msg or "not initialized" in msg.lower():
            raise WarehouseMissing(
                f"no warehouse in catalog {_redact(settings.catalog_url)}: run `featurehouse ingest` first"
            ) from None
        raise


def _redact(url: str) -> str:
    """A catalog URL for messages: without its password."""
    url = re.sub(r"(password\s*=\s*)\S+", r"\1***", url, flags=re.I)
    return re.sub(r"(://[^:/@]+:)[^@]+@", r"\1***@", url)


def connect(where: Settings | str | os.PathLike, *, read_only: bool = False, create: bool = False,
            migrate: bool = True) -> duckdb.DuckDBPyConnection:
    """Open the warehouse (``where``: Settings, or a warehouse folder).

    A read-only connection sees the last committed snapshot of each query and never blocks a
    load. A writable one brings the schema up to date first (under the commit lock). Only
    ``create=True`` (ingest, fetch, migrate) makes a new warehouse; otherwise a missing one
    raises :class:`WarehouseMissing`. Raises :class:`SchemaTooNew` for a warehouse written by a
    newer featurehouse, and for ``read_only`` :class:`SchemaTooOld` for an older one.
    """
    settings = settings_for(where)
    conn = _open(settings, read_only=read_only, create=create)
    try:
        version = schema_version(conn)
        latest = latest_version()
        if version > latest:
            raise SchemaTooNew(
                f"the warehouse at {settings.warehouse} has schema version {version}, newer than this "
                f"featurehouse knows ({latest}): upgrade featurehouse to use it"
            )
        if version < latest:
            if read_only:
                raise SchemaTooOld(
                    f"the warehouse at {settings.warehouse} has schema version {version} and this "
                    f"featurehouse expects {latest}: run `featurehouse upgrade` (or any ingest) to migrate it"
                )
            if migrate:
                apply_migrations(conn, settings)
        return conn
    except BaseException:
        conn.close()
        raise


# --- schema versions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations(folder: Path | None = None) -> list[Migration]:
    """The ordered migrations: ``schemas/migrations/NNNN_name.sql``, numbered from 1 without gaps."""
    folder = folder or SCHEMAS_DIR / "migrations"
    found = []
    for path in sorted(folder.glob("*.sql")):
        m = re.fullmatch(r"(\d{4})_([a-z0-9_]+)\.sql", path.name)
        if not m:
            raise ValueError(f"{path}: a migration is named NNNN_name.sql")
        found.append(Migration(int(m.group(1)), m.group(2), path.read_text()))
    for i, m in enumerate(found, start=1):
        if m.version != i:
            raise ValueError(f"migrations must be numbered 1, 2, 3, ... without gaps; found {m.version} at {i}")
    return found


def latest_version(folder: Path | None = None) -> int:
    return len(migrations(folder))


def schema_version(conn: duckdb.DuckDBPyConnection) -> int:
    """The warehouse's schema version (0 for a new, empty lake)."""
    tables = {t for (t,) in conn.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = ?", [CATALOG]).fetchall()}
    if "schema_version" in tables:
        return int(conn.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()[0])
    if tables:
        raise ValueError(f"the catalog holds tables ({', '.join(sorted(tables)[:5])}) but no featurehouse "
                         "schema_version: it is not a featurehouse warehouse")
    return 0


def apply_migrations(conn: duckdb.DuckDBPyConnection, settings: Settings, folder: Path | None = None) -> list[int]:
    """Apply, in order and each in its own transaction, the migrations newer than the warehouse."""
    from .. import __version__

    applied = []
    for m in migrations(folder):
        def step(c: duckdb.DuckDBPyConnection, m: Migration = m) -> bool:
            if schema_version(c) >= m.version:  # another process got there first
                return False
            c.execute(m.sql)
            c.execute("INSERT INTO schema_version VALUES (?, ?, now() AT TIME ZONE 'UTC', ?)",
                      [m.version, m.name, __version__])
            return True

        if schema_version(conn) >= m.version:
            continue
        if transaction(conn, settings, step, message=f"schema migration {m.version:04d}_{m.name}",
                       extra={"migration": m.version}):
            log.info("warehouse %s: applied schema migration %04d_%s", settings.warehouse, m.version, m.name)
            applied.append(m.version)
    return applied


# --- the commit lock ----------------------------------------------------------------------------


class _Lock:
    """One warehouse's commit lock in this process: re-entrant, shared by threads."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.mutex = threading.RLock()
        self.depth = 0
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
        with self.mutex:
            if self.depth == 0:
                self._acquire_os(self.settings.lock_timeout)
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self._release_os()


_LOCKS: dict[str, _Lock] = {}
_LOCKS_GUARD = threading.Lock()


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
    return isinstance(exc, duckdb.Error) and bool(_RETRYABLE.search(str(exc)))


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
                    conn.execute(f"CALL {CATALOG}.set_commit_message('featurehouse', ?, extra_info => ?)",
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


def sandbox(conn: duckdb.DuckDBPyConnection) -> None:
    """Lock a read-only connection down for ad-hoc queries: no file access beyond the
    warehouse's data files (no COPY TO, no ATTACH, no INSTALL/LOAD of new extensions), and the
    configuration locked so a query cannot undo it."""
    (path,) = conn.execute(f"SELECT value FROM {CATALOG}.options() WHERE option_name = 'data_path'").fetchone()
    conn.execute("SET allowed_directories = $dirs", {"dirs": [path]})
    conn.execute("SET enable_external_access = false")
    conn.execute("SET lock_configuration = true")


#: Table functions of the loaded scanner extensions that open any database by name or file,
#: outside DuckDB's file system (so ``allowed_directories`` does not stop them).
_SCANNERS = re.compile(r"\b(sqlite|postgres)_(scan|query|execute|attach|scan_pushdown)\b", re.IGNORECASE)


def check_sandboxed_query(sql: str) -> None:
    """Refuse a query calling a scanner function (``sqlite_scan('/any/file.db', ...)`` reads any
    SQLite file; ``postgres_scan`` any reachable server): the sandbox cannot stop them."""
    if m := _SCANNERS.search(sql):
        raise PermissionError(f"{m.group(0)} reads databases outside the warehouse; query the warehouse's tables")


# --- for people ---------------------------------------------------------------------------------


def attach_sql(settings: Settings, *, read_only: bool = True) -> list[str]:
    """The statements that attach this warehouse in any DuckDB client (CLI, Python, ...)."""
    lines = [f"LOAD '{_q(extension_path(n))}';" for n in _extensions(settings)]
    if settings.uses_s3:
        lines.append("-- S3 data: CREATE SECRET (TYPE s3, ...) with your endpoint and credentials;")
    ro = " (READ_ONLY)" if read_only else ""
    lines += [f"ATTACH 'ducklake:{_q(settings.catalog_url)}' AS {CATALOG}{ro};", f"USE {CATALOG};"]
    return lines
