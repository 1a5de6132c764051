"""Opening the warehouse: ``connect`` attaches the lake to an in-memory DuckDB as ``featurehouse``,
with its data files where the folder is now and an S3 secret when they are in S3, and brings
its schema up to date for a writer; ``attach_sql`` gives the same in any DuckDB client.

The catalog is an SQLite file in the warehouse folder by default (several local processes) or
a PostgreSQL database (many machines); the data files live in a folder or an S3 prefix.
"""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb

from ..config import Settings
from .catalog import CATALOG, _catalog_state, _redact, _sqlite_file
from .commit import write_lock
from .extensions import extension_path, load_extension
from .extensions import needed as _extensions
from .extensions import new_connection as _duckdb
from .extensions import s3_extensions as _s3_extensions
from .migrations import SchemaTooNew, SchemaTooOld, apply_migrations, latest_version, schema_version
from .sqltext import _q, bind


class WarehouseMissing(FileNotFoundError):
    "The warehouse does not exist yet: run `featurehouse ingest` first."


class LegacyWarehouse(ValueError):
    "The path names a single-file DuckDB warehouse of an earlier release: move it with `featurehouse migrate`."


def settings_for(where: Settings | str | os.PathLike) -> Settings:
    """``where`` as Settings: a warehouse folder resolves the rest from the environment."""
    return where if isinstance(where, Settings) else Settings.from_env(warehouse=Path(where))


def exists(settings: Settings) -> bool:
    """Whether there is a warehouse where ``settings`` point (for a catalog that is not a file:
    assumed, the connection says otherwise)."""
    return _sqlite_file(settings).exists() if settings.catalog_kind == "sqlite" else True


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


def end_statement(conn: duckdb.DuckDBPyConnection) -> None:
    """End what may still run of a statement a signal stopped on ``conn``: DuckDB raised "Query
    interrupted" to Python while its worker threads went on with the statement, and the
    connection's next statement (making the lake the default again, dropping a batch's tables,
    a ROLLBACK) waited for all of it (measured: 25-140 s). Harmless on an idle connection."""
    with contextlib.suppress(Exception):
        conn.interrupt()


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
        end_statement(conn)  # (a statement a signal stopped: its next one would wait for it)
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
