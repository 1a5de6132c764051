"""Where the find index lives and how it is opened: its folder and file, the lake's version it
is compared with (``lake_state``), the lock one builder holds."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from ...config import Settings
from ...lake import warehouse as warehouse_mod
from ...lake.extensions import new_connection
from .common import (
    _FIND_TABLES,
    EMBEDDING_DIM,
    INDEX_VERSION,
    FindIndexDamaged,
    FindIndexMissing,
    FindIndexUnwritable,
)


def _paths(settings: Settings) -> tuple[Path, Path]:
    d = settings.find_index_dir
    return d, d / "index.duckdb"


def _connect_index(path: Path, *, read_only: bool) -> duckdb.DuckDBPyConnection:
    """The index file attached (as ``idx``, in use) to a new in-memory DuckDB. Not
    ``duckdb.connect(path)``: DuckDB shares one instance per path within a process, so a
    process that still holds the old index open would be handed the old file after a refresh
    replaced it."""
    conn = new_connection(["fts"])  # DuckDB's own signature check, never the network
    try:
        conn.execute(f"ATTACH {warehouse_mod.literal(str(path))} AS idx{' (READ_ONLY)' if read_only else ''}")
        conn.execute("USE idx")
    except BaseException:
        conn.close()
        raise
    return conn


def _relevant(changes: str | None, table_ids: set[int]) -> bool:
    """Whether a snapshot's ``changes_made`` touched one of the tables the index reads."""
    for _kind, tid in re.findall(r"(inserted_into_table|deleted_from_table|altered_table|dropped_table):(\d+)",
                                changes or ""):
        if int(tid) in table_ids:
            return True
    return "created_table" in (changes or "") and any(t in (changes or "") for t in _FIND_TABLES)


@dataclass(frozen=True)
class LakeState:
    """What the catalog says about the warehouse, as the find index compares it with its own
    record: ``identity`` names the warehouse (its find tables' uuids: a copy has the same, any
    other warehouse others), ``fingerprint`` the find tables' contents (row counts and next row
    ids: any insert or delete moves them, merging files does not), ``n_changes`` how many
    snapshots after the index's changed a find table, or -1 when that cannot be told (the
    snapshots in between were expired by `maintain`) and the fingerprint moved."""

    latest: int
    n_changes: int
    identity: str
    fingerprint: str
    #: when the asked-for snapshot was committed (UTC, ISO), None when the catalog has no such
    #: snapshot (expired, or not reached): two diverged copies of a warehouse reach the same
    #: snapshot id with the same table uuids, never at the same microsecond
    snapshot_time: str | None = None

    def same_as(self, meta: dict[str, str], snapshot_id: int) -> bool:
        """Whether an index whose metadata is ``meta`` (built at ``snapshot_id``) was built from
        this warehouse, in this state of its history: the same tables, and the index's snapshot
        here is the one it read (not a diverged copy's, nor one this warehouse never reached)."""
        if self.identity != meta.get("warehouse_id") or snapshot_id > self.latest:
            return False
        return self.snapshot_time is None or self.snapshot_time == meta.get("snapshot_time")


def _utc(value: Any) -> str | None:
    """A catalog's snapshot time (text from SQLite, a timestamp from DuckDB or PostgreSQL) as
    one canonical string."""
    if value is None:
        return None
    t = value if isinstance(value, datetime) else datetime.fromisoformat(str(value).strip())
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).isoformat()


def lake_state(settings: Settings, snapshot_id: int, fingerprint: str | None = None) -> LakeState:
    """The warehouse's latest snapshot, identity and fingerprint, and how many snapshots after
    ``snapshot_id`` changed a table the index reads; read from the catalog's own tables, never
    through DuckLake (whose extension costs a query a second to load)."""
    names = ", ".join(warehouse_mod.literal(t) for t in _FIND_TABLES)
    sql = {
        "ids": f"SELECT table_id FROM {{c}}ducklake_table WHERE table_name IN ({names})",
        "latest": "SELECT max(snapshot_id) FROM {c}ducklake_snapshot",
        "kept": f"SELECT count(*) FROM {{c}}ducklake_snapshot WHERE snapshot_id >= {int(snapshot_id)}",
        "changes": f"SELECT changes_made FROM {{c}}ducklake_snapshot_changes WHERE snapshot_id > {int(snapshot_id)}",
        "at": f"SELECT snapshot_time FROM {{c}}ducklake_snapshot WHERE snapshot_id = {int(snapshot_id)}",
        # live rows: the live data files' rows less their live deletes (the table's stats
        # count no delete); next row id: moved by every insert; neither by merging files
        "tables": f"""SELECT t.table_name, CAST(t.table_uuid AS VARCHAR),
                             coalesce((SELECT sum(d.record_count) FROM {{c}}ducklake_data_file AS d
                                       WHERE d.table_id = t.table_id AND d.end_snapshot IS NULL), 0)
                             - coalesce((SELECT sum(x.delete_count) FROM {{c}}ducklake_delete_file AS x
                                         WHERE x.table_id = t.table_id AND x.end_snapshot IS NULL), 0),
                             s.next_row_id
                      FROM {{c}}ducklake_table AS t LEFT JOIN {{c}}ducklake_table_stats AS s USING (table_id)
                      WHERE t.end_snapshot IS NULL AND t.table_name IN ({names}) ORDER BY t.table_name""",
    }
    if settings.catalog_kind == "sqlite":
        path = Path(settings.catalog_url.removeprefix("sqlite:"))
        if not path.exists():
            raise warehouse_mod.WarehouseMissing(f"no warehouse at {settings.warehouse}: run `featurehouse ingest` first")
    if settings.catalog_kind == "sqlite" and not warehouse_mod.extension_loaded("sqlite_scanner"):
        # Python's sqlite3, read-only, for a few milliseconds. Not in a process whose DuckDB
        # has the catalog open (it has loaded the SQLite scanner): two SQLite libraries in one
        # process do not see each other's locks (see warehouse._catalog_state).
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
            got = {k: db.execute(q.format(c="")).fetchall() for k, q in sql.items()}
    elif settings.catalog_kind == "sqlite":
        with new_connection(["sqlite_scanner"]) as db:
            db.execute(f"ATTACH {warehouse_mod.literal(str(path))} AS cat (TYPE sqlite, READ_ONLY)")
            got = {k: db.execute(q.format(c="cat.")).fetchall() for k, q in sql.items()}
    else:
        with warehouse_mod.connect(settings, read_only=True) as lake:
            c = f"__ducklake_metadata_{warehouse_mod.CATALOG}."
            got = {k: lake.execute(q.format(c=c)).fetchall() for k, q in sql.items()}
    ids = {int(tid) for (tid,) in got["ids"]}
    latest = int(got["latest"][0][0] or 0)
    tables = [(n, u, None if rc is None else int(rc), None if nr is None else int(nr)) for n, u, rc, nr in got["tables"]]
    identity = hashlib.sha256(json.dumps([(n, u) for n, u, _, _ in tables]).encode()).hexdigest()[:24]
    now = json.dumps(tables)
    n_changes = sum(1 for (c,) in got["changes"] if _relevant(c, ids))
    complete = latest >= snapshot_id and int(got["kept"][0][0]) == latest - snapshot_id + 1
    if not complete and not n_changes:
        # some of the change feed since the index's snapshot was expired: the fingerprint decides
        n_changes = 0 if fingerprint == now else -1
    return LakeState(latest, n_changes, identity, now, _utc(got["at"][0][0]) if got["at"] else None)


def lake_changes_since(settings: Settings, snapshot_id: int, fingerprint: str | None = None) -> tuple[int, int]:
    """(the warehouse's latest snapshot, how many snapshots after ``snapshot_id`` changed a
    table the index reads; -1: some did, how many cannot be told); see :func:`lake_state`."""
    state = lake_state(settings, snapshot_id, fingerprint)
    return state.latest, state.n_changes


def _unwritable(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return True
    return isinstance(exc, duckdb.Error) and ("Permission denied" in str(exc) or "Read-only file system" in str(exc))


LOCK_TIMEOUT = 900.0  # seconds a builder waits for another's build before it gives up


@contextlib.contextmanager
def _build_lock(directory: Path, timeout: float | None = None) -> Iterator[None]:
    """One builder or refresher of an index at a time (readers never wait). An advisory lock
    on ``.lock``, which the system releases with its holder: a file left behind by a killed
    builder holds nothing. A folder this user may not write is :class:`FindIndexUnwritable`."""
    timeout = LOCK_TIMEOUT if timeout is None else timeout
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # opened without truncating (a leftover file's bytes do not matter)
        try:
            fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:
            # a lock file another user left: flock needs only a descriptor, not write access;
            # whether the folder may be written the build itself finds out
            fd = os.open(directory / ".lock", os.O_RDONLY)
    except OSError as exc:
        if _unwritable(exc):
            raise FindIndexUnwritable(f"the find index in {directory} cannot be built or refreshed: permission "
                                      f"denied ({exc.strerror}); `featurehouse index` as a user who may write there, "
                                      "or set FEATUREHOUSE_FIND_DIR to a folder you may write") from None
        if isinstance(exc, (FileExistsError, NotADirectoryError)):
            raise FindIndexUnwritable(f"the find index cannot be built in {directory}: it is not a folder "
                                      f"({exc.strerror}); move the file away or set FEATUREHOUSE_FIND_DIR to a "
                                      "folder") from None
        raise
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building the find index in {directory} for "
                                       f"over {timeout:.0f}s; try again later") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _open_index(directory: Path, path: Path) -> tuple[duckdb.DuckDBPyConnection, dict[str, str]]:
    """The index opened read-only and its metadata, checked whole enough to answer from: any
    file that is not (damaged, cut short, another release's) is :class:`FindIndexDamaged`."""
    if not path.exists():
        raise FindIndexMissing(f"no find index in {directory}: run `featurehouse index`")
    try:
        conn = _connect_index(path, read_only=True)
    except duckdb.Error as exc:
        raise FindIndexDamaged(f"the find index {path} cannot be read ({str(exc).splitlines()[0]})") from None
    try:
        try:
            meta = _read_meta(conn)
            if int(meta.get("version") or 0) != INDEX_VERSION:
                raise FindIndexDamaged(f"the find index {path} was built by another release (version "
                                       f"{meta.get('version')}, this one reads {INDEX_VERSION})")
            n = int(meta["n_rows"])
            int(meta["snapshot_id"])
            for ext, width in (("f32", 4), ("f64", 8)):
                m = directory / f"emb-{meta['generation']}.{ext}"
                size = m.stat().st_size if m.exists() else -1
                if size < n * EMBEDDING_DIM * width:
                    raise FindIndexDamaged(f"the find index's embedding matrix {m} is "
                                           f"{'missing' if size < 0 else 'cut short'}")
            _counts(conn)
            conn.execute("SELECT count(*) FROM fts_main_docs.stats").fetchone()
        except (duckdb.Error, KeyError, ValueError) as exc:
            raise FindIndexDamaged(f"the find index {path} is damaged ({str(exc).splitlines()[0]})") from None
    except BaseException:
        conn.close()
        raise
    return conn, meta


def _meta(idx: duckdb.DuckDBPyConnection, **values: Any) -> None:
    for k, v in values.items():
        idx.execute(f"INSERT OR REPLACE INTO meta VALUES ({warehouse_mod.literal(k)}, {warehouse_mod.literal(None if v is None else str(v))})")


def _read_meta(idx: duckdb.DuckDBPyConnection) -> dict[str, str]:
    return dict(idx.execute("SELECT key, value FROM meta").fetchall())


def _counts(idx: duckdb.DuckDBPyConnection) -> tuple[int, int, int]:
    return idx.execute("SELECT (SELECT count(*) FROM features), (SELECT count(*) FROM docs), "
                       "(SELECT count(*) FROM emb_rows WHERE live)").fetchone()
