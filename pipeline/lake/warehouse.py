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
import logging
import math
import os
import random
import re
import shutil
import sqlite3
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import orjson

from ..config import SCHEMAS_DIR, Settings

# the DuckDB extensions, loaded offline from their wheels with DuckDB's own checks: extensions.py
from .extensions import extension_loaded, extension_path, load_extension
from .extensions import needed as _extensions
from .extensions import new_connection as _duckdb
from .extensions import s3_extensions as _s3_extensions
from .landing import disk_full


def utcnow() -> datetime:
    """Now, in UTC, without a time zone (the catalog's TIMESTAMP columns)."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


__all__ = [
    "CATALOG", "WarehouseMissing", "LegacyWarehouse", "SchemaTooNew", "SchemaTooOld", "CommitFailed", "BadCatalog",
    "connect", "transaction", "write_lock", "holds_write_lock", "schema_version", "migrations", "latest_version",
    "attach_sql", "extension_path", "settings_for", "sandbox", "apply_migrations", "is_conflict", "CommitStats",
    "RefusedQuery", "READ_ONLY_HELP", "check_read_only", "open_for_queries", "confine_process", "data_path",
    "resolved_data_path", "load_extension", "extension_loaded", "exists",
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


def exists(settings: Settings) -> bool:
    """Whether there is a warehouse where ``settings`` point (for a catalog that is not a file:
    assumed, the connection says otherwise)."""
    return _sqlite_file(settings).exists() if settings.catalog_kind == "sqlite" else True


def _q(s: str) -> str:
    return s.replace("'", "''")


# --- statements with their values written in -------------------------------------------------
# DuckDB's Python client imports pandas the first time it binds a parameter that is not None
# (duckdb-python checks each value against pandas.NaT before its type): 0.3-0.45 s measured,
# a quarter of an unchanged re-run of 1,000 pages, which loads nothing and never needs pandas.
# The statements a run that loads nothing makes (its row in ``runs``, the inputs it saw, the
# commit message, the short report) write their values into the SQL as literals instead:
# ``literal`` writes one value, ``bind`` a statement's ``$name`` or ``?`` placeholders, skipping
# quoted strings, quoted identifiers and comments. Checked against DuckDB's own binding with
# hostile values (quotes, placeholders and comment marks inside strings, newlines, non-ASCII).

_SQL_TOKEN = re.compile(r"""'(?:[^']|'')*'|"(?:[^"]|"")*"|--[^\n]*|/\*.*?\*/|\$\$|\$[A-Za-z_]\w*|\?""", re.S)


def literal(value: Any) -> str:
    """``value`` as a DuckDB SQL literal of the type binding it would give: None, bool, int,
    float, str, datetime (naive: TIMESTAMP, aware: TIMESTAMPTZ), date, or a list of those."""
    if value is None:
        return "NULL"
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        value = value.item()  # a numpy scalar (an id read with fetchnumpy)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):  # a negative one in parentheses: 10-$x is never 10--1, a comment
        return f"({int(value)})" if value < 0 else str(int(value))
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"'{value!r}'::DOUBLE"
        return f"({value!r}::DOUBLE)" if math.copysign(1.0, value) < 0 else f"{value!r}::DOUBLE"
    if isinstance(value, str):
        if "\0" in value:  # DuckDB's parser ends a string there
            raise ValueError("a NUL character cannot be written into an SQL string")
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, datetime):
        return f"{'TIMESTAMPTZ' if value.tzinfo else 'TIMESTAMP'} '{value.isoformat(sep=' ')}'"
    if isinstance(value, date):
        return f"DATE '{value.isoformat()}'"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    raise TypeError(f"no SQL literal for a {type(value).__name__}")


def bind(sql: str, params: dict[str, Any] | list | tuple | None = None) -> str:
    """``sql`` with its placeholders (``$name`` for a dict, ``?`` in order for a list) replaced
    by the values as literals; text in quotes and comments is left as it is."""
    if not params:
        return sql
    positional = iter(params) if isinstance(params, (list, tuple)) else None

    def one(m: re.Match) -> str:
        token = m.group()
        if token == "?" and positional is not None:
            try:
                return literal(next(positional))
            except StopIteration:
                raise ValueError(f"fewer values than placeholders in: {sql}") from None
        if token.startswith("$") and token != "$$" and isinstance(params, dict):
            return literal(params[token[1:]])
        if token == "$$":
            raise ValueError("dollar-quoted strings are not supported by bind()")
        return token

    out = _SQL_TOKEN.sub(one, sql)
    if positional is not None and next(positional, _END) is not _END:
        raise ValueError(f"more values than placeholders in: {sql}")
    return out


_END = object()


def execute(conn: duckdb.DuckDBPyConnection, sql: str,
            params: dict[str, Any] | list | tuple | None = None) -> duckdb.DuckDBPyConnection:
    """``conn.execute(sql, params)`` with the values written in (see ``bind``): no pandas."""
    return conn.execute(bind(sql, params))


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
        raise BadCatalog(f"the warehouse's catalog {path} cannot be read as an SQLite database ({said}); "
                         "restore it from a backup, or move it away to start a new warehouse") from None
    finally:
        if own:
            probe.close()


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


# --- where the data files are -------------------------------------------------------------------
#
# DuckLake records the data path in the catalog as it was given when the lake was made (an
# absolute path: a relative one would be resolved against the working directory of whoever opens
# it). A warehouse folder holding its own catalog and data/ must survive `cp -a` and `mv`, so its
# data path is resolved from the folder being opened, at every open (ATTACH ... DATA_PATH with
# OVERRIDE_DATA_PATH, which DuckLake does not write back): a copy reads and writes its own files,
# never the original's, and nothing needs migrating in warehouses made by earlier releases.


def _folder_catalog(settings: Settings) -> bool:
    """Whether the catalog is an SQLite file in the warehouse folder itself (the default)."""
    return (settings.catalog_kind == "sqlite"
            and _sqlite_file(settings).absolute().parent.resolve() == settings.warehouse.absolute().resolve())


def _is_local(path: str) -> bool:
    return "://" not in path


def _local_dir(path: str) -> str:
    """A local folder as DuckLake takes a data path: absolute, ending in a slash."""
    return str(Path(path).absolute()).rstrip("/") + "/"


def _data_path_override(settings: Settings, recorded: str | None) -> str | None:
    """The data path to open the lake with instead of the one its catalog records (``recorded``,
    None for a new lake or a catalog that was not read); None keeps the recorded one.

    ``FEATUREHOUSE_DATA_PATH`` (``settings.data_path``) always says where the data files are.
    Otherwise a warehouse whose catalog is in its folder has its data in ``<folder>/data/``
    wherever the folder now is, when the catalog records a ``.../data/`` folder (what every
    release made) and this folder has one or the recorded one is gone (a copy or a move). A data
    folder recorded elsewhere (made with ``FEATUREHOUSE_DATA_PATH`` and opened without it) stands.
    """
    if settings.data_path:
        return _local_dir(settings.data_url) if _is_local(settings.data_url) else settings.data_url
    if not _folder_catalog(settings):
        return None
    own = _local_dir(str(settings.warehouse / "data"))
    if recorded is None:
        return own
    if not _is_local(recorded):
        return None
    was = Path(recorded.rstrip("/") or "/")
    if was.name != "data":
        return None
    if _local_dir(recorded) == own or (settings.warehouse / "data").is_dir() or not was.exists():
        return own
    return None


def resolved_data_path(settings: Settings) -> str | None:
    """Where this warehouse's data files are, as featurehouse opens it; None when only the
    catalog knows (a PostgreSQL catalog without ``FEATUREHOUSE_DATA_PATH``)."""
    _, recorded = _catalog_state(settings)
    return _data_path_override(settings, recorded) or recorded


def data_path(conn: duckdb.DuckDBPyConnection) -> str:
    """The data path the open lake reads and writes (after any override; ``options()`` shows the
    recorded one)."""
    (path,) = conn.execute(f"SELECT data_path FROM ducklake_settings('{CATALOG}')").fetchone()
    return path


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
    conn.execute(bind(sql, [str(p) for p in params]))


def _open(settings: Settings, *, read_only: bool, create: bool, threads: int | None = None) -> duckdb.DuckDBPyConnection:
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
    if settings.catalog_kind == "sqlite" and not _sqlite_file(settings).exists() and not create:
        raise WarehouseMissing(f"no warehouse at {wh}: run `featurehouse ingest` (or `fetch`) first")
    config: dict[str, Any] = {"memory_limit": os.environ.get("FEATUREHOUSE_DUCKDB_MEMORY", "1GB")}
    if not read_only:
        # spills go into the warehouse folder, not into the current directory
        config["temp_directory"] = str(wh / ".tmp")
    if threads is not None:
        config["threads"] = threads
    conn = _duckdb(_extensions(settings), config)
    try:
        if settings.uses_s3:
            _s3_secret(conn, settings)
        exists, recorded = _catalog_state(settings, conn)
        if exists is False and not create:
            raise WarehouseMissing(f"no warehouse at {wh}: run `featurehouse ingest` (or `fetch`) first")
        if read_only or exists is True or not create:
            override = _data_path_override(settings, recorded) if exists is not False else None
            opts = ["READ_ONLY"] if read_only else (["CREATE_IF_NOT_EXISTS false"] if exists is None else [])
            if override:
                opts += [f"DATA_PATH '{_q(override)}'", "OVERRIDE_DATA_PATH true"]
            _attach(conn, settings, opts)
        else:
            # A new warehouse: made under the commit lock, so that two writers starting at once
            # on an empty folder (or database) make it once.
            wh.mkdir(parents=True, exist_ok=True)
            if settings.catalog_kind == "sqlite":
                _sqlite_file(settings).parent.mkdir(parents=True, exist_ok=True)
            with write_lock(settings):
                exists, recorded = _catalog_state(settings, conn)
                if exists is False:
                    with contextlib.closing(sqlite3.connect(_sqlite_file(settings))) as db:
                        # WAL: readers never wait for a writer, which holds the catalog while it loads
                        db.execute("PRAGMA journal_mode=WAL")
                override = _data_path_override(settings, recorded if exists else None)
                # Another thread or process may be looking at the catalog file this moment (a
                # probe outside the lock) and SQLite then refuses the lake's first write ("database
                # is locked"; seen once, eight threads starting at once on a loaded machine): the
                # look ends in milliseconds, so try again, for up to 10 s.
                deadline = time.monotonic() + 10
                while True:
                    try:
                        _attach(conn, settings, [f"DATA_PATH '{_q(override or settings.data_url)}'"]
                                + (["OVERRIDE_DATA_PATH true"] if override and exists is not False else []))
                        break
                    except duckdb.Error as exc:
                        if "does not match existing data path" in str(exc):
                            _attach(conn, settings, [])  # it existed after all: its data path stands
                            break
                        if "database is locked" not in str(exc) or time.monotonic() > deadline:
                            raise
                        with contextlib.suppress(duckdb.Error):
                            conn.execute(f"DETACH DATABASE IF EXISTS {CATALOG}")
                        time.sleep(0.02 + random.random() * 0.05)
        conn.execute(f"USE {CATALOG}")
        return conn
    except BaseException:
        conn.close()
        raise


@contextlib.contextmanager
def scratch_first(conn: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """Make the connection's own in-memory database the default while only temp tables are
    read and written (staging, validation), then the lake again, whatever happens.

    With the lake as the default database every statement, even one on a temp table, opens a
    DuckLake transaction and reads its snapshot from the catalog: measured ~1.7-2 ms a statement
    in autocommit, against ~0.3 ms with the in-memory database in use. A batch runs ~100 such
    statements. Temp tables resolve the same either way; a lake table must then be named with
    its catalog (``featurehouse.main.features``).
    """
    try:
        conn.execute("USE memory")
        yield
    except BaseException as exc:
        try:
            conn.execute(f"USE {CATALOG}")
        except duckdb.Error as restore:  # the error that got here is the one to report
            exc.add_note(f"(and the warehouse could not be made the default database again: {restore})")
        raise
    conn.execute(f"USE {CATALOG}")


def _recorded_data_path(conn: duckdb.DuckDBPyConnection) -> str:
    row = conn.execute(f"SELECT value FROM __ducklake_metadata_{CATALOG}.ducklake_metadata "
                       "WHERE key = 'data_path'").fetchone()
    return row[0] if row and row[0] else ""


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
                load_extension(conn, name)
            _s3_secret(conn, settings)
            conn.execute(f"ATTACH 'ducklake:{_q(settings.catalog_url)}' AS {CATALOG}{suffix}")
        else:
            # DuckDB autoloads httpfs (installed offline) for an s3:// data path the catalog
            # records and the settings did not name; the endpoint and credentials are still ours.
            if not settings.uses_s3 and _recorded_data_path(conn).startswith("s3://"):
                _s3_secret(conn, settings)
    except duckdb.Error as exc:
        msg = str(exc)
        if "creating a new DuckLake is explicitly disabled" in msg or "not initialized" in msg.lower():
            raise WarehouseMissing(
                f"no warehouse in catalog {_redact(settings.catalog_url)}: run `featurehouse ingest` first"
            ) from None
        if _redact(msg) != msg:  # DuckDB echoes the libpq string, password and all: not into any log
            raise type(exc)(_redact(msg)) from None
        raise


def _redact(url: str) -> str:
    """A catalog URL for messages: without its password (a quoted one with spaces in it, a URL's
    with no user name too: catalog_down.redact)."""
    from .catalog_down import redact

    return redact(url)


def connect(where: Settings | str | os.PathLike, *, read_only: bool = False, create: bool = False,
            migrate: bool = True, threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """Open the warehouse (``where``: Settings, or a warehouse folder).

    A read-only connection sees the last committed snapshot of each query and never blocks a
    load. A writable one brings the schema up to date first (under the commit lock). Only
    ``create=True`` (ingest, fetch, migrate) makes a new warehouse; otherwise a missing one
    raises :class:`WarehouseMissing`. Raises :class:`SchemaTooNew` for a warehouse written by a
    newer featurehouse, and for ``read_only`` :class:`SchemaTooOld` for an older one. ``threads``
    caps DuckDB's worker threads (its default: one per core).

    The data files are looked for where the warehouse folder is now (see ``_data_path_override``):
    a copied or moved folder reads and writes its own.
    """
    settings = settings_for(where)
    conn = _open(settings, read_only=read_only, create=create, threads=threads)
    try:
        version = schema_version(conn)
        latest = latest_version()
        if version > latest:
            raise SchemaTooNew(
                f"the warehouse at {settings.warehouse} has schema version {version}, newer than this "
                f"featurehouse knows ({latest}): upgrade featurehouse to use it"
            )
        if version == 0 and read_only:
            raise WarehouseMissing(
                f"the warehouse at {settings.warehouse} was begun but never made: its catalog "
                f"{_redact(settings.catalog_url)} holds none of its tables (its making stopped before they were "
                "committed, e.g. the catalog's server stopped): `featurehouse ingest` or `featurehouse upgrade` makes it"
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
    """The warehouse's schema version (0 for a new, empty lake), outside a transaction.

    The version table is read directly (a third of the time of listing the lake's tables, paid
    at every open); only a lake without it is listed, to tell a new lake from a foreign one.
    """
    try:
        return int(conn.execute(f"SELECT coalesce(max(version), 0) FROM {CATALOG}.main.schema_version").fetchone()[0])
    except (duckdb.CatalogException, duckdb.InvalidInputException):
        # no such table (the second: DuckDB then looked for a Python object of that name)
        return _listed_schema_version(conn)


def _listed_schema_version(conn: duckdb.DuckDBPyConnection) -> int:
    """``schema_version`` by listing the lake's tables first: inside a DuckLake transaction,
    whose first error (a missing table) aborts it."""
    tables = {t for (t,) in conn.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = ?", [CATALOG]).fetchall()}
    if "schema_version" in tables:
        return int(conn.execute(f"SELECT coalesce(max(version), 0) FROM {CATALOG}.main.schema_version").fetchone()[0])
    if tables:
        raise ValueError(f"the catalog holds tables ({', '.join(sorted(tables)[:5])}) but no featurehouse "
                         "schema_version: it is not a featurehouse warehouse")
    return 0


def apply_migrations(conn: duckdb.DuckDBPyConnection, settings: Settings, folder: Path | None = None) -> list[int]:
    """Apply, in order and each in its own transaction, the migrations newer than the warehouse."""
    from .. import __version__

    version = schema_version(conn)
    pending = [m for m in migrations(folder) if m.version > version]
    # A new lake gets every migration in one transaction (nobody can see it half made, and it is
    # one commit instead of one per migration); an existing one, each in its own.
    groups = [pending] if version == 0 and pending else [[m] for m in pending]
    applied = []
    for group in groups:
        def step(c: duckdb.DuckDBPyConnection, group: list[Migration] = group) -> list[int]:
            done, current = [], _listed_schema_version(c)
            for m in group:
                if current >= m.version:  # another process got there first
                    continue
                c.execute(m.sql)
                c.execute("INSERT INTO schema_version VALUES (?, ?, now() AT TIME ZONE 'UTC', ?)",
                          [m.version, m.name, __version__])
                done.append(m.version)
                current = m.version
            return done

        names = ", ".join(f"{m.version:04d}_{m.name}" for m in group)
        for v in transaction(conn, settings, step, message=f"schema migration {names}",
                             extra={"migration": group[-1].version}):
            log.info("warehouse %s: applied schema migration %04d", settings.warehouse, v)
            applied.append(v)
    return applied


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


# --- ad-hoc queries: reads only -------------------------------------------------------------------
#
# `featurehouse sql` runs what a user types. Two layers, each enough on its own for what it covers:
#
# 1. ``check_read_only``: the statement must be provably a read. DuckDB's own parser serializes
#    it (``json_serialize_sql`` takes SELECT trees only: COPY, ATTACH, SET, CALL, ... are not
#    one), and the tree is walked: every table it names is one of the warehouse's (or a CTE, or
#    a catalog view), every table function is on a short list. A text match cannot tell
#    ``query('... sqlite' || '_scan ...')`` from a read; the tree can (``query`` is not listed).
# 2. ``open_for_queries``: the process that runs the query cannot write files at all, except in
#    a private scratch folder (Linux Landlock, an unprivileged kernel sandbox), and DuckDB's own
#    file access is limited to the data folder and locked (``sandbox``). So a statement that
#    slipped past the check (``EXPLAIN ANALYZE COPY ... TO '<a data file>'``) fails to write.


class RefusedQuery(PermissionError):
    "The statement is not provably a read of the warehouse: `featurehouse sql` does not run it."


#: DuckLake's read-only functions of the warehouse's catalog: ``featurehouse.snapshots()`` (or
#: ``snapshots()`` once it is in use), and the same as ``ducklake_snapshots('featurehouse')``.
_LAKE_READS = ("snapshots", "current_snapshot", "last_committed_snapshot", "table_info", "table_changes",
               "table_insertions", "table_deletions", "options", "settings")

#: Table functions that only compute, or read the catalogs' descriptions: nothing else is run.
#: (Not ``query``/``query_table``/``read_*``/scanners, which read what they are given, nor
#: DuckLake's maintenance functions, which write.)
_TABLE_FUNCTIONS = frozenset({
    "range", "generate_series", "unnest", "repeat", "repeat_row", "json_each", "json_tree", "glob",
    "duckdb_columns", "duckdb_constraints", "duckdb_databases", "duckdb_dependencies", "duckdb_extensions",
    "duckdb_functions", "duckdb_indexes", "duckdb_keywords", "duckdb_memory", "duckdb_optimizers",
    "duckdb_schemas", "duckdb_sequences", "duckdb_settings", "duckdb_tables", "duckdb_temporary_files",
    "duckdb_types", "duckdb_variables", "duckdb_views", "pragma_collations", "pragma_database_size",
    "pragma_platform", "pragma_show", "pragma_table_info", "pragma_version", "pragma_user_agent",
    "icu_calendar_names", "pg_timezone_names", "ducklake_list_files",
    *(f"ducklake_{name}" for name in _LAKE_READS),
})

def _plain_glob(fn: dict) -> bool:
    """Whether a glob() call takes one constant path with no ``..`` step in it."""
    args = fn.get("children") or []
    if len(args) != 1 or args[0].get("class") != "CONSTANT":
        return False
    value = args[0].get("value")
    text = value.get("value") if isinstance(value, dict) else None
    return isinstance(text, str) and ".." not in re.split(r"[/\\]", text)


#: Scalar functions with an effect beyond their result.
_SCALAR_REFUSED = frozenset({"write_log"})

#: ``SHOW TABLES`` / ``SHOW DATABASES`` / ``SHOW SCHEMAS`` (what DuckDB's binder expands itself).
_SHOW_LISTS = frozenset({'"tables"', "__show_tables_expanded", '"databases"', '"schemas"'})

#: Table references a read may hold; anything else (an unknown kind) is refused.
_TABLE_REFS = frozenset({"BASE_TABLE", "TABLE_FUNCTION", "SUBQUERY", "JOIN", "EXPRESSION_LIST", "EMPTY",
                         "EMPTY_FROM", "PIVOT", "SHOW_REF"})

READ_ONLY_HELP = (
    "featurehouse sql is read-only and runs queries only: SELECT / FROM / WITH / VALUES, PIVOT and UNPIVOT, "
    "DESCRIBE, SHOW, SUMMARIZE, and EXPLAIN [ANALYZE] of those, over the warehouse's tables (and CTEs, "
    "information_schema and the duckdb_* catalog views), with the table functions "
    f"{', '.join(n + '()' for n in _LAKE_READS)} (as {CATALOG}.<name>() or ducklake_<name>('{CATALOG}', ...)), "
    "range, generate_series, unnest, repeat, json_each, json_tree, glob and the duckdb_*/pragma_* listings; "
    "write results out with --format csv or --format json"
)


def _serialized_json(conn: duckdb.DuckDBPyConnection, sql: str) -> str:
    """DuckDB's ``json_serialize_sql`` of ``sql``: given as a literal, because a bound parameter
    makes DuckDB's Python client import pandas (0.5 s a command); a NUL, which no literal can
    hold, is bound (tests/test_sql_sandbox.py checks both parse the same for any text)."""
    if "\0" in sql:
        return conn.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()[0]
    return conn.execute(f"SELECT json_serialize_sql('{_q(sql)}')").fetchone()[0]


def _serialized(conn: duckdb.DuckDBPyConnection, sql: str) -> list[dict] | None:
    """The statements' trees from DuckDB's parser, or None when they are not all SELECTs."""
    tree = orjson.loads(_serialized_json(conn, sql))
    return None if tree.get("error") else tree["statements"]


def _relations(conn: duckdb.DuckDBPyConnection) -> set[tuple[str, str, str]]:
    """(database, schema, name) of every table and view attached: the warehouse's tables, its
    catalog's, and DuckDB's information_schema / pg_catalog / duckdb_* views."""
    rows = conn.execute("SELECT database_name, schema_name, table_name FROM duckdb_tables() UNION ALL "
                        "SELECT database_name, schema_name, view_name FROM duckdb_views()").fetchall()
    return {(d.lower(), s.lower(), n.lower()) for d, s, n in rows}


def _is_relation(known: set[tuple[str, str, str]], catalog: str, schema: str, name: str) -> bool:
    if catalog:
        return (catalog, schema or "main", name) in known
    if schema:  # schema.name, or catalog.name
        return any(s == schema and d in (CATALOG, "system", "temp") for d, s, n in known if n == name) \
            or (schema, "main", name) in known
    return any(d in (CATALOG, "system", "temp") and s in ("main", "pg_catalog") for d, s, n in known if n == name)


class _NoSuchTable(str):
    """A name that is no table of the warehouse: most often a typo, so the refusal names the
    nearest table (difflib) instead of the read-only rules, which are not what went wrong."""

    def __new__(cls, shown: str, known: set[tuple[str, str, str]]) -> _NoSuchTable:
        import difflib

        tables = sorted({n for d, s, n in known if d == CATALOG and s == "main"})
        near = difflib.get_close_matches(shown.split(".")[-1].lower(), tables, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else ""
        return super().__new__(cls, f"{shown!r}, which is not a table of the warehouse{hint} (SHOW TABLES lists "
                                    "them; a file name is read as a table name)")


def _refused_in(tree: Any, known: set[tuple[str, str, str]], ctes: frozenset[str] = frozenset()) -> str | None:
    """What in a serialized statement is not a read (a table function off the list, a name that
    is not a table, ...), or None."""
    if isinstance(tree, list):
        for item in tree:
            if found := _refused_in(item, known, ctes):
                return found
        return None
    if not isinstance(tree, dict):
        return None
    outer = ctes
    entries = tree["cte_map"].get("map", []) if isinstance(tree.get("cte_map"), dict) else []
    names = [entry["key"].lower() for entry in entries]
    ctes = ctes | set(names)
    kind = tree.get("type")
    if "class" in tree:  # an expression
        if tree["class"] == "FUNCTION" and tree.get("function_name", "").lower() in _SCALAR_REFUSED:
            return f"the function {tree['function_name']}()"
    elif "alias" in tree and "sample" in tree:  # a table reference
        if kind not in _TABLE_REFS:
            return f"a {kind} table reference"
        if kind == "TABLE_FUNCTION":
            fn = tree["function"]
            name = fn.get("function_name", "").lower()
            where = tuple(x.lower() for x in (fn.get("catalog", ""), fn.get("schema", "")) if x)
            if name in _LAKE_READS and where in ((), (CATALOG,), (CATALOG, "main")):
                pass
            elif name == "glob" and not _plain_glob(fn):
                # DuckDB's allowed_directories lets 'data/../catalog.sqlite' through in glob()
                return "glob() of anything but one constant path without '..' (it lists files in the data folder only)"
            elif name in _TABLE_FUNCTIONS and set(where) <= {"system", "main"}:
                pass
            else:
                return f"the table function {'.'.join((*where, name))}()"
        elif kind == "BASE_TABLE":
            catalog, schema, name = (tree.get(k, "").lower() for k in ("catalog_name", "schema_name", "table_name"))
            if not (catalog or schema) and name in ctes:
                pass
            elif not _is_relation(known, catalog, schema, name):
                shown = ".".join(x for x in (tree.get("catalog_name"), tree.get("schema_name"), tree.get("table_name")) if x)
                if "/" in name or "\\" in name or "." in name:  # a file's name: files are not read
                    return f"{shown!r}, which is not a table of the warehouse (a file name is read as one)"
                return _NoSuchTable(shown, known)
        elif kind == "SHOW_REF" and not tree.get("query") and tree.get("show_type") != "SHOW_FROM" \
                and tree.get("table_name") not in _SHOW_LISTS:
            return f"SHOW {tree.get('table_name')}"
    for key, value in tree.items():
        if key != "cte_map" and isinstance(value, (dict, list)):
            # a recursive CTE names itself in its recursive part only (its anchor, the left,
            # reads a table or file of that name)
            seen = ctes | {tree["cte_name"].lower()} if kind == "RECURSIVE_CTE_NODE" and key == "right" else ctes
            if found := _refused_in(value, known, seen):
                return found
    # The CTEs' own bodies, each seeing only the CTEs before it (and those of enclosing queries):
    # DuckDB binds a name a body gives to itself or to a later CTE as a table, or a file
    # (``WITH a AS (FROM 'x.csv'), "x.csv" AS (SELECT 1) FROM a`` reads x.csv).
    for i, entry in enumerate(entries):
        if found := _refused_in(entry.get("value"), known, outer | set(names[:i])):
            return found
    return None


def _words(sql: str) -> list[tuple[int, str]]:
    """DuckDB's tokens of ``sql`` (comments and strings skipped by its tokenizer): (offset,
    upper-cased keyword or identifier, or the operator's first character; '' for literals)."""
    out = []
    for offset, kind in duckdb.tokenize(sql):
        if kind in (duckdb.token_type.keyword, duckdb.token_type.identifier):
            m = re.match(r"[A-Za-z_][A-Za-z_0-9]*", sql[offset:])
            out.append((offset, m.group(0).upper() if m and kind == duckdb.token_type.keyword else "\0ident"))
        elif kind == duckdb.token_type.operator:
            out.append((offset, sql[offset]))
        else:
            out.append((offset, ""))
    return out


#: Where a PIVOT's ON list ends.
_PIVOT_ON_ENDS = frozenset({"USING", "GROUP", "ORDER", "LIMIT", "OFFSET", "UNION", "EXCEPT", "INTERSECT",
                            "HAVING", "QUALIFY", "WINDOW", ";"})


def _pivot_values_named(sql: str) -> tuple[str, int]:
    """``sql`` with ``IN (NULL)`` added to each PIVOT column without an IN list, and how many.

    A PIVOT without its values is, to DuckDB, a CREATE of an enum of them and then a SELECT,
    which the serializer refuses; with a list it is one SELECT tree holding the same source,
    columns and aggregates. The tree of this text is checked; the user's text is what runs.
    """
    inserts: list[int] = []
    states: list[dict] = []  # open PIVOTs: their depth, and whether in the ON list / its item has IN
    depth = 0

    def end_item(state: dict, at: int) -> None:
        if not state["has_in"]:
            inserts.append(at)
        state["has_in"] = False

    for offset, word in _words(sql):
        top = states[-1] if states and states[-1]["depth"] == depth else None
        if word == ")":
            if top is not None:
                if top["on"]:
                    end_item(top, offset)
                states.pop()
            depth -= 1
            continue
        if word == "(":
            depth += 1
        elif word == "PIVOT":
            states.append({"depth": depth, "on": False, "has_in": False})
        elif top is None:
            pass
        elif not top["on"]:
            if word == "ON":
                top["on"] = True
            elif word in ("JOIN", "SELECT", ";"):
                states.pop()  # not the ON of a PIVOT ... ON (a join's, or another form)
        elif word == "IN":
            top["has_in"] = True
        elif word == ",":
            end_item(top, offset)
        elif word in _PIVOT_ON_ENDS:
            end_item(top, offset)
            states.pop()
    for state in states:
        if state["on"]:
            end_item(state, len(sql))
    text = sql
    for at in sorted(inserts, reverse=True):
        text = text[:at] + "\n IN (NULL) " + text[at:]
    return text, len(inserts)


def _explained(sql: str) -> str:
    """What an EXPLAIN [ANALYZE] statement explains (and, with ANALYZE, runs)."""
    words = _words(sql)
    i = 1 if words and words[0][1] == "EXPLAIN" else 0
    if i and len(words) > 1 and words[1][1] in ("ANALYZE", "ANALYSE"):
        i = 2
    if i == 1 and i < len(words) and words[i][1] == "(":
        i = _explain_options_end(sql, words, i)
    if not i or i >= len(words) or words[i][1] == "(":
        raise RefusedQuery(f"refused an EXPLAIN with options other than ANALYZE and FORMAT "
                           f"{'|'.join(sorted(_EXPLAIN_FORMATS)).lower()}. {READ_ONLY_HELP}")
    return sql[words[i][0]:]


#: ``EXPLAIN (FORMAT f)``'s formats: each only changes how the plan is printed.
_EXPLAIN_FORMATS = frozenset({"TEXT", "JSON", "HTML", "GRAPHVIZ", "YAML", "MERMAID"})


def _explain_options_end(sql: str, words: list[tuple[int, str]], i: int) -> int:
    """The index of the first word after ``EXPLAIN (options)`` whose options are each ANALYZE or
    FORMAT with one of :data:`_EXPLAIN_FORMATS`; 0 for any other option list."""
    j = sql.find(")", words[i][0])
    if j < 0:
        return 0
    items = [item.split() for item in sql[words[i][0] + 1:j].split(",")]
    for item in items:
        item = [w.strip('"').upper() for w in item]
        if not (item in (["ANALYZE"], ["ANALYSE"]) or (len(item) == 2 and item[0] == "FORMAT"
                                                           and item[1] in _EXPLAIN_FORMATS)):
            return 0
    after = [k for k, (offset, _) in enumerate(words) if offset > j]
    return after[0] if after else 0


def check_read_only(conn: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Raise :class:`RefusedQuery`, saying what is allowed, unless every statement in ``sql`` is
    provably a read of the warehouse (see the section's comment). A statement DuckDB cannot
    parse raises its ``duckdb.Error``."""
    try:
        _check(conn, sql, _relations(conn), explain=True)
    except (RecursionError, orjson.JSONDecodeError):
        raise RefusedQuery(f"refused a statement nested too deeply to check. {READ_ONLY_HELP}") from None


def _check(conn: duckdb.DuckDBPyConnection, sql: str, known: set[tuple[str, str, str]], *, explain: bool) -> None:
    statements = duckdb.extract_statements(sql)
    if not statements:
        return
    trees = _serialized(conn, sql)
    if trees is None:
        made = [st for st in statements if not st.query.strip()]  # DuckDB's own, for a PIVOT
        if not made:
            if len(statements) > 1:
                for st in statements:
                    _check(conn, st.query, known, explain=explain)
                return
            (st,) = statements
            if st.type == duckdb.StatementType.EXPLAIN and explain:
                try:
                    _check(conn, _explained(st.query), known, explain=False)
                except RefusedQuery as exc:
                    raise RefusedQuery(str(exc).replace("refused ", "refused EXPLAIN of ", 1)) from None
                return
            raise RefusedQuery(f"refused a {st.type.name} statement. {READ_ONLY_HELP}")
        others = [st.type.name for st in statements if st.query.strip() and st.type != duckdb.StatementType.SELECT]
        if others or any(st.type not in (duckdb.StatementType.CREATE, duckdb.StatementType.SELECT) for st in made):
            raise RefusedQuery(f"refused a {(others or [made[0].type.name])[0]} statement. {READ_ONLY_HELP}")
        text, n = _pivot_values_named(sql)
        trees = _serialized(conn, text) if n else None
        if trees is None or n != sum(st.type == duckdb.StatementType.CREATE for st in made):
            raise RefusedQuery("refused a CREATE statement (write a PIVOT that DuckDB cannot read as a SELECT "
                               f"with its values: PIVOT ... ON col IN (...)). {READ_ONLY_HELP}")
    for tree in trees:
        if found := _refused_in(tree, known):
            raise RefusedQuery(f"refused {found}" if isinstance(found, _NoSuchTable) else
                               f"refused {found}. {READ_ONLY_HELP}")


# --- the process that runs them cannot write --------------------------------------------------------

_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446  # every Linux ABI
_FS_READ = 1 << 0 | 1 << 2 | 1 << 3  # EXECUTE, READ_FILE, READ_DIR
_FS_FILE = 1 << 0 | 1 << 1 | 1 << 2 | 1 << 14 | 1 << 15  # what applies to a file (not a folder)


def confine_process(writable: list[Path]) -> bool:
    """Make this process — its calling thread and every thread and process it starts after —
    unable to write, create, remove or rename any file outside ``writable`` (reading stays
    allowed everywhere), with Linux's Landlock. Threads that already run are not confined: call
    it before DuckDB starts its workers. Returns False where Landlock is not available (not
    Linux, a kernel before 5.13 or without it); it cannot be undone."""
    if sys.platform != "linux":
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return False
    handled = (1 << 13) - 1  # ABI 1: execute .. make_sym
    handled |= (1 << 13) if abi >= 2 else 0  # refer (link/rename across folders)
    handled |= (1 << 14) if abi >= 3 else 0  # truncate
    handled |= (1 << 15) if abi >= 5 else 0  # ioctl on devices
    attr = ctypes.create_string_buffer(struct.pack("=Q", handled), 8)
    ruleset = libc.syscall(_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(8), ctypes.c_uint32(0))
    if ruleset < 0:
        return False
    try:
        def allow(path: Path, access: int) -> None:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = struct.pack("=Qi", access & handled & (_FS_FILE if not path.is_dir() else ~0), fd)
                if libc.syscall(_LANDLOCK_ADD_RULE, ruleset, ctypes.c_int(1), ctypes.create_string_buffer(rule, 12),
                                ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock: cannot allow {path}")
            finally:
                os.close(fd)

        allow(Path("/"), _FS_READ)
        allow(Path(os.devnull), _FS_READ | 1 << 1)
        for path in writable:
            allow(path, handled)
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, which Landlock requires unprivileged
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
        return True
    except OSError as exc:
        log.warning("cannot confine the process with Landlock: %s", exc)
        return False
    finally:
        os.close(ruleset)


def _scratch() -> tuple[Path, Path]:
    """A private scratch folder for this process's query spills, removed at exit, and the folder
    the confined process may write in (its parent: one per user, so the folder can be removed)."""
    import atexit
    import shutil
    import tempfile

    parent = Path(tempfile.gettempdir()) / f"featurehouse-sql-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        parent.mkdir(mode=0o700)
    st = parent.lstat()
    if not parent.is_dir() or parent.is_symlink() or st.st_uid != os.getuid():
        parent = Path(tempfile.mkdtemp(prefix="featurehouse-sql-"))
    scratch = Path(tempfile.mkdtemp(dir=parent))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return scratch, parent


#: Connections kept open for the life of the process (see ``_hold_catalog``).
_HELD: list[duckdb.DuckDBPyConnection] = []


def _hold_catalog(settings: Settings) -> list[Path]:
    """For an SQLite catalog: the files a reader must still write once the process is confined —
    the shared-memory index of its write-ahead log (``catalog.sqlite-shm``), which every reader
    updates — kept from being deleted and made anew (a file rule holds the file, not its name).

    DuckDB's SQLite opens the catalog for each transaction; SQLite deletes the index when its last
    connection closes, and the next one would have to create it in the warehouse folder. So one
    connection (DuckDB's SQLite, the library DuckLake uses: never Python's, see ``_catalog_state``)
    stays open, in a transaction, until the process ends.
    """
    if settings.catalog_kind != "sqlite":
        return []
    path = _sqlite_file(settings)
    holder = _duckdb(["sqlite_scanner"], {"threads": 1})
    holder.execute(f"ATTACH '{_q(str(path))}' AS held_catalog (TYPE sqlite, READ_ONLY)")
    holder.execute("BEGIN TRANSACTION")
    holder.execute("SELECT count(*) FROM held_catalog.ducklake_metadata").fetchall()
    _HELD.append(holder)
    shm = Path(f"{path}-shm")
    return [shm] if shm.is_file() else []


def sandbox(conn: duckdb.DuckDBPyConnection, *, scratch: Path | None = None) -> None:
    """Lock a read-only connection down for ad-hoc queries: DuckDB's file access limited to the
    warehouse's data files (and ``scratch``, where spills go): no COPY TO elsewhere, no ATTACH,
    no INSTALL/LOAD of new extensions; and the configuration locked so a query cannot undo it.

    Within the data folder DuckDB could still write (it has no read-only directories): the
    process-level confinement of :func:`open_for_queries` is what stops that."""
    dirs = [data_path(conn)] + ([str(scratch).rstrip("/") + "/"] if scratch else [])
    if scratch:
        conn.execute(f"SET temp_directory = '{_q(str(scratch))}'")
    listed = ", ".join(f"'{_q(d)}'" for d in dirs)
    conn.execute(f"SET allowed_directories = [{listed}]")  # no parameter: see _serialized_json
    conn.execute("SET enable_external_access = false")
    conn.execute("SET lock_configuration = true")


def open_for_queries(where: Settings | str | os.PathLike) -> duckdb.DuckDBPyConnection:
    """The warehouse opened read-only for ad-hoc queries (`featurehouse sql`), in a process that
    cannot write the lake any more, whatever statement reaches the connection.

    The catalog is opened first (an SQLite reader writes its shared-memory index beside it),
    with one DuckDB thread; then the process is confined (:func:`confine_process`: it may write
    only in a private scratch folder), then DuckDB's worker threads start — confined too — and
    the connection is sandboxed (:func:`sandbox`). Confinement is for good: use it in a process
    that ends with its queries (a command), not in a long-lived one. Where Landlock is missing it
    logs a warning and the statement check and DuckDB's sandbox are all that stand.
    """
    settings = settings_for(where)
    conn = connect(settings, read_only=True, threads=1)
    try:
        scratch, parent = _scratch()
        if not confine_process([parent, *_hold_catalog(settings)]):
            log.warning("this system cannot confine the process (Linux Landlock is not available): "
                        "only the statement check keeps the query from writing the warehouse's files")
        conn.execute("RESET threads")  # the workers start now, from the confined thread
        sandbox(conn, scratch=scratch)
        return conn
    except BaseException:
        conn.close()
        raise


# --- for people ---------------------------------------------------------------------------------


def attach_sql(settings: Settings, *, read_only: bool = True) -> list[str]:
    """The statements that attach this warehouse in any DuckDB client (CLI, Python, ...), with
    its data path where the folder is now (see ``_data_path_override``)."""
    lines = [f"LOAD '{_q(extension_path(n))}';" for n in _extensions(settings)]
    if settings.uses_s3:
        lines.append("-- S3 data: CREATE SECRET (TYPE s3, ...) with your endpoint and credentials;")
    _, recorded = _catalog_state(settings)
    override = _data_path_override(settings, recorded)
    opts = (["READ_ONLY"] if read_only else []) + (
        [f"DATA_PATH '{_q(override)}'", "OVERRIDE_DATA_PATH true"] if override else [])
    suffix = f" ({', '.join(opts)})" if opts else ""
    lines += [f"ATTACH 'ducklake:{_q(settings.catalog_url)}' AS {CATALOG}{suffix};", f"USE {CATALOG};"]
    return lines
