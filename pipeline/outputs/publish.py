"""Publish a snapshot of the warehouse that anyone opens with one line.

Two layouts in one folder ``DEST`` (``publish``):

* ``ducklake``: ``DEST/featurehouse.ducklake``, a DuckLake catalog in a **DuckDB file**, with its
  Parquet files under ``DEST/data/`` addressed relatively. Served over HTTP(S) by anything that
  answers Range requests (or from S3, or read in place), a plain DuckDB with ``httpfs`` and
  ``ducklake`` attaches it read-only and reads only the row groups a query needs. It holds the
  published tables as of one warehouse snapshot, the ``publication`` table (one row per
  publication into this folder: the warehouse snapshot, its time, the tables' counts) and, as
  DuckLake snapshots of its own, every earlier publication into the same folder.
* ``hf``: ``DEST/hf/<table>/*.parquet`` (sorted by model, source and feature) and
  ``DEST/hf/README.md``, a Hugging Face dataset card whose YAML ``configs`` name each table's
  files, with what each column means, the counts, the snapshot and the runs' data-quality
  verdicts.

**Incremental.** A later publication into the same folder applies what changed in the
warehouse since the snapshot the folder holds, read from DuckLake's change feed
(``ducklake_table_changes``): the rows the warehouse removed are deleted from the published
table (DuckLake writes a delete file) and the rows it added are appended in a new Parquet file.
Files are never rewritten or deleted, so a reader attached to the previous catalog keeps
reading, and what is sent is the new files and the new catalog, which replaces the old one last
(``os.replace``). A table is written whole instead when the change feed cannot say (the
snapshot published before was expired by ``maintain``, another warehouse, another snapshot
older than the published one, its columns changed) or when the result would not hold exactly the
warehouse's row count. The ``hf`` layout rewrites the files of the tables that changed.

**Killed at any point.** Each layout is committed by one rename, after everything it names is
written: the catalog (``os.replace``), ``hf/`` (swapped whole with a staged copy, whose unchanged
tables are hard links: Linux's ``renameat2(RENAME_EXCHANGE)``). A first publication stages its
data files in a scratch folder, moved to ``data/`` just before its catalog. So a publication
killed anywhere (SIGKILL included) leaves each layout as it was, or nothing a reader opens for a
first one; what it left is named ``.featurehouse-*`` or is a data file no catalog names. One
publication into a folder at a time (``flock`` on ``.publish.lock``, which the kernel frees when
its holder dies, whose text names the holder): the next one, holding it, removes all of that,
so no leftover outlives it, and refuses while a live process holds it, naming that process.

**To S3.** DEST may be ``s3://bucket/prefix``: the same layout is built in a local folder by
the code below, then uploaded, the catalog last (:mod:`pipeline.outputs.publish_s3`).

**Private.** What leaves is the data tables and their statistics (``DEFAULT_TABLES``); other
tables only when named (``tables``), and even then without the columns that say where the
inputs came from or who ran what (``PRIVATE_COLUMNS``: paths, hosts, errors) unless
``include_private``. Nothing of the landing area is published, and DEST may not be inside the
warehouse.

Why not the ``frozen-ducklake`` project: it is not on this project's package index (``pip
download frozen-ducklake`` finds no version here), and it copies a lake whole; the change feed
is what makes a nightly publication send ~a page's worth of bytes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from ..config import SCHEMAS_DIR, Settings
from ..lake import warehouse as warehouse_mod
from ..lake.warehouse import CATALOG, _q

__all__ = ["DEFAULT_TABLES", "PRIVATE_COLUMNS", "PublishRefused", "Published", "publish", "CATALOG_FILE"]

#: The tables a publication holds unless told otherwise: the data and its statistics.
DEFAULT_TABLES = ("models", "source_sets", "sources", "features", "activations", "explanations",
                  "feature_activation_stats", "feature_token_stats", "source_activation_stats")

#: Columns left out unless ``include_private``: where inputs came from (paths, URLs with hosts),
#: who ran a run (host, pid), errors that quote paths, and where reports were written.
PRIVATE_COLUMNS = {
    "runs": ("host", "pid", "error", "report_path"),
    "raw_inputs": ("origin", "reason", "landed_path"),
    "run_inputs": ("origin",),
    "fetch_failures": ("url", "last_error"),
}

#: Tables never published: the schema's own bookkeeping.
NEVER = ("schema_version",)

CATALOG_FILE = "featurehouse.ducklake"
LOCK_FILE = ".publish.lock"
#: In ``hf/``: which warehouse snapshot each table's files hold (written after them).
HF_MARK = ".published.json"
#: What a publication's scratch is named (``.featurehouse-<pid>-...``): only ever removed under the lock.
SCRATCH = ".featurehouse-"
#: What a publication makes in DEST, besides its scratch.
MADE = (CATALOG_FILE, LOCK_FILE, "data", "hf")
PUB = "fh_publish"
_KEY = ("model_id", "source_id", "feature_index")
#: Rows per Parquet row group of the published files (DuckDB's writer flushes at multiples of its
#: 2,048-row vectors): a one-feature lookup over HTTP reads the row group that holds it.
ROW_GROUP_ROWS = 2048


class PublishRefused(ValueError):
    """A publication that would leak, overwrite the warehouse or cannot be made: said in one line."""


@dataclass
class TableDone:
    table: str
    rows: int
    how: str  # "new" | "whole" | "changes" | "unchanged"
    added: int = 0
    removed: int = 0
    why: str = ""


@dataclass
class Published:
    dest: Path
    snapshot_id: int
    snapshot_time: datetime
    formats: tuple[str, ...]
    tables: list[TableDone] = field(default_factory=list)
    bytes_written: int = 0
    files_written: int = 0
    bytes_by_format: dict[str, int] = field(default_factory=dict)
    dry_run: bool = False
    url: str | None = None
    seconds: float = 0.0
    #: The snapshot the DuckLake held before, when its change feed was applied ("" otherwise)
    base: str = ""
    #: ``s3://bucket/prefix`` when published there (``dest`` is then the local folder it was built in)
    remote: str = ""
    #: What was sent to (or, a dry run, would be sent to) ``remote``: a ``publish_s3.Upload``
    upload: Any = None
    #: The S3 endpoint of ``remote`` when not AWS's (``http://host:port``), for the secret a reader makes
    endpoint: str | None = None

    @property
    def catalog(self) -> Path:
        return self.dest / CATALOG_FILE

    @property
    def where(self) -> str:
        """Where it was published: ``s3://bucket/prefix`` or the folder."""
        return self.remote or str(self.dest)

    def lines(self) -> list[str]:
        """The lines that open the publication, as a reader pastes them (quotes doubled for SQL,
        escaped for Python)."""
        out: list[str] = []
        sql = lambda v: str(v).replace("'", "''")  # noqa: E731
        py = lambda v: str(v).replace("\\", "\\\\").replace("'", "\\'")  # noqa: E731
        if "ducklake" in self.formats:
            if self.url and self.url.startswith("s3://"):
                out.append("-- DuckDB (INSTALL ducklake; INSTALL httpfs; once), with an S3 secret for the bucket, e.g.")
                out.append("-- CREATE SECRET (TYPE s3, PROVIDER credential_chain" + self._endpoint_opts() + ");")
            elif self.url:
                out.append("-- DuckDB (INSTALL ducklake; INSTALL httpfs; once):")
            if self.url:
                out.append(f"ATTACH 'ducklake:{sql(self.url)}/{CATALOG_FILE}' AS fh (READ_ONLY);")
            else:
                out.append("-- DuckDB, this folder in place (served over HTTP: publish with --url):")
                out.append(f"ATTACH 'ducklake:{sql(self.catalog)}' AS fh (READ_ONLY, DATA_PATH '{sql(self.dest)}/data/', "
                           "OVERRIDE_DATA_PATH true);")
        if "hf" in self.formats:
            base = py(f"{self.url}/hf" if self.url else self.dest / "hf")
            out.append("# pandas:")
            out.append(f"pd.read_parquet('{base}/features')" if not self.url else
                       f"pd.read_parquet('{base}/features/data_0.parquet')")
            out.append("# Hugging Face datasets (or load_dataset('ORG/NAME', 'features') once pushed to the Hub):")
            out.append(f"datasets.load_dataset('{base}', 'features')" if not self.url else
                       f"datasets.load_dataset('parquet', data_files='{base}/features/*.parquet')")
        return out

    def _endpoint_opts(self) -> str:
        """A DuckDB S3 secret's options for ``endpoint`` ('' for AWS itself)."""
        if not self.endpoint:
            return ""
        scheme, _, host = self.endpoint.rpartition("://")
        host = host.rstrip("/").replace("'", "''")
        return f", ENDPOINT '{host}', URL_STYLE 'path', USE_SSL {'false' if scheme == 'http' else 'true'}"


# --- where it goes -------------------------------------------------------------------------------

def _inside(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def _check_dest(settings: Settings, dest: Path) -> Path:
    dest = Path(os.path.realpath(dest))  # a link into the warehouse is inside it
    places = [("the warehouse", settings.warehouse), ("its data path", settings.data_url),
              ("the landing area", settings.landing_url)]
    for name, where in places:
        if str(where).startswith("s3://"):
            continue
        place = Path(os.path.realpath(where))
        if _inside(dest, place) or _inside(place, dest):
            raise PublishRefused(f"{dest} is inside {name} ({place}) or holds it: publish to a folder of its own")
    if dest.exists() and not dest.is_dir():
        raise PublishRefused(f"{dest} is a file, not a folder")
    if dest.is_dir():
        names = [p.name for p in dest.iterdir()]
        made = (dest / CATALOG_FILE).is_file() or (dest / "hf" / HF_MARK).is_file() or (
            # a first publication killed before its catalog: its lock (made only in a folder that was
            # empty or a publication's), its scratch and its data files, nothing else
            LOCK_FILE in names and all(n in MADE or n.startswith(SCRATCH) for n in names))
        if names and not made:
            raise PublishRefused(f"{dest} holds other files ({', '.join(sorted(names)[:3])}): publish into an "
                                 "empty folder or one a publication made")
    return dest


# --- one at a time, and what a killed one left ------------------------------------------------------

def _holder(dest: Path) -> str:
    """Who holds the folder's lock, as its holder wrote it into the lock file."""
    for _ in range(10):  # a holder writes its name just after taking the lock: give it a moment
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            h = json.loads((dest / LOCK_FILE).read_text(encoding="utf-8"))
            since = datetime.fromisoformat(h["since"])
            age = int((datetime.now(timezone.utc) - since).total_seconds())
            if h["host"] != socket.gethostname() or _alive(int(h["pid"])):
                return (f"process {int(h['pid'])} on {h['host']}, publishing since {since:%Y-%m-%d %H:%M:%S} UTC, "
                        f"{age // 60} min {age % 60} s ago")
            # the name of a holder that is gone (killed): the lock's holder now has not written its own
        time.sleep(0.1)
    return f"by a process that wrote no name into {dest / LOCK_FILE}: an older featurehouse, or one starting"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _lock(dest: Path, stack: contextlib.ExitStack) -> None:
    """Hold ``DEST/.publish.lock`` until ``stack`` closes, or refuse naming its holder.

    One publication into a folder at a time: two would each build on the same catalog, and the one
    replacing it last would drop the other's publication. ``flock``: the kernel frees it when its
    holder dies however it dies, so a killed publication leaves no lock (the file stays, naming it)."""
    lock = stack.enter_context(open(dest / LOCK_FILE, "a+b"))
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise PublishRefused(f"another publication into {dest} is under way ({_holder(dest)}): wait for it to "
                             "finish, or stop that process (the next publication removes what it leaves)") from None
    lock.truncate(0)
    lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}).encode())
    lock.flush()

    def release() -> None:  # still held: no one reads a half-emptied name
        with contextlib.suppress(OSError):
            lock.truncate(0)

    stack.callback(release)


def _known_files(conn: duckdb.DuckDBPyConnection, db: str) -> set[str]:
    """Every file any publication in the catalog attached (as a DuckDB file) as ``db`` wrote: its data
    and delete files, relative to the data path (as written), of every snapshot it keeps."""
    return {r[0] for r in conn.execute(f"""
        WITH t AS (SELECT DISTINCT t.table_id, CASE WHEN t.path_is_relative THEN
                          (CASE WHEN s.path_is_relative THEN s.path ELSE '' END) || t.path ELSE t.path END AS tp
                   FROM {db}.ducklake_table t JOIN {db}.ducklake_schema s USING (schema_id))
        SELECT DISTINCT CASE WHEN f.path_is_relative THEN t.tp || f.path ELSE f.path END
        FROM (SELECT table_id, path, path_is_relative FROM {db}.ducklake_data_file
              UNION ALL SELECT table_id, path, path_is_relative FROM {db}.ducklake_delete_file) f
        JOIN t USING (table_id)""").fetchall()}


def _drop_unknown(data: Path, known: set[str]) -> None:
    """Remove the Parquet files under ``data`` no catalog names (written by a publication killed before
    its catalog replaced the old one: no reader can be reading them), then the folders left empty."""
    if not data.is_dir():
        return
    for p in list(data.rglob("*.parquet")):
        if p.relative_to(data).as_posix() not in known and str(p) not in known:
            with contextlib.suppress(OSError):
                p.unlink()
    for d in sorted((d for d in data.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
        with contextlib.suppress(OSError):
            d.rmdir()  # only when empty


def _sweep(dest: Path) -> None:
    """Remove what publications killed part-way left: every ``.featurehouse-*`` (catalog copies, spill
    and staging folders), and the data files no catalog names. Called holding the folder's lock, so
    none of it belongs to a publication under way (a dry run writes nothing here), whatever process
    id its name holds (a dead publisher's id may be a live process's by now)."""
    hf = dest / "hf"
    if not hf.exists():  # killed between the two renames of a swap without RENAME_EXCHANGE: put it back
        for old in sorted(dest.glob(f"{SCRATCH}*-hf.old")):
            with contextlib.suppress(OSError):
                os.rename(old, hf)
                break
    for folder in (dest, hf):
        if not folder.is_dir():
            continue
        for p in folder.glob(f"{SCRATCH}*"):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
    catalog = dest / CATALOG_FILE
    if not catalog.exists():
        _drop_unknown(dest / "data", set())  # no catalog: nothing names them
        return
    try:
        with duckdb.connect() as raw:
            raw.execute(f"ATTACH '{_q(str(catalog))}' AS w (READ_ONLY)")
            known = _known_files(raw, "w")
    except duckdb.Error:
        return  # not a catalog this can read: remove nothing
    _drop_unknown(dest / "data", known)


# --- what is published ---------------------------------------------------------------------------

def _snapshot(conn: duckdb.DuckDBPyConnection, snapshot: int | None, at: datetime | None) -> tuple[int, datetime]:
    snaps = f"{CATALOG}.snapshots()"
    if snapshot is not None and at is not None:
        raise PublishRefused("give --snapshot or --at, not both")
    if snapshot is not None:
        row = conn.execute(f"SELECT snapshot_id, snapshot_time FROM {snaps} WHERE snapshot_id = $s",
                           {"s": int(snapshot)}).fetchone()
        if row is None:
            first, last = conn.execute(f"SELECT min(snapshot_id), max(snapshot_id) FROM {snaps}").fetchone()
            raise PublishRefused(f"the warehouse has no snapshot {snapshot} (it keeps {first}..{last}; older ones "
                                 "were expired by `featurehouse maintain`)")
    elif at is not None:
        if at.tzinfo is None:
            at = at.replace(tzinfo=timezone.utc)
        row = conn.execute(f"SELECT snapshot_id, snapshot_time FROM {snaps} WHERE snapshot_time <= $t "
                           "ORDER BY snapshot_id DESC LIMIT 1", {"t": at}).fetchone()
        if row is None:
            raise PublishRefused(f"the warehouse kept no snapshot as old as {at.isoformat()}")
    else:
        row = conn.execute(f"SELECT snapshot_id, snapshot_time FROM {snaps} ORDER BY snapshot_id DESC LIMIT 1").fetchone()
    sid, stime = row
    if stime.tzinfo is None:
        stime = stime.replace(tzinfo=timezone.utc)
    return int(sid), stime.astimezone(timezone.utc)


def _columns(conn: duckdb.DuckDBPyConnection, table: str, snap: int, include_private: bool) -> list[tuple[str, str]]:
    rel = conn.sql(f"SELECT * FROM {CATALOG}.main.{table} AT (VERSION => {snap}) LIMIT 0")
    drop = () if include_private else PRIVATE_COLUMNS.get(table, ())
    return [(c, str(t)) for c, t in zip(rel.columns, rel.types) if c not in drop]


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _order(cols: list[str]) -> str:
    keys = [c for c in _KEY if c in cols] or cols[:1]
    return ", ".join(_ident(c) for c in keys)


def _warehouse_id(conn: duckdb.DuckDBPyConnection) -> str:
    """What tells this warehouse from another: when its schema was first made."""
    (made,) = conn.execute(f"SELECT min(applied_at) FROM {CATALOG}.main.schema_version").fetchone()
    return f"{made.isoformat() if made else ''}"


def _tables(conn: duckdb.DuckDBPyConnection, snap: int, tables: list[str] | None) -> list[str]:
    have = {r[0] for r in conn.execute(
        f"SELECT table_name FROM duckdb_tables() WHERE database_name = '{CATALOG}' AND schema_name = 'main'").fetchall()}
    want = list(tables) if tables else list(DEFAULT_TABLES)
    never = [t for t in want if t in NEVER]
    if never:
        raise PublishRefused(f"{', '.join(never)}: the schema's own bookkeeping, never published")
    unknown = [t for t in want if t not in have]
    if unknown:
        import difflib

        hints = [f"{t} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(t, sorted(have), 1)) else t
                 for t in unknown]
        raise PublishRefused(f"no such table to publish: {', '.join(hints)}")
    return [t for t in dict.fromkeys(want) if t in have]


# --- the DuckLake ---------------------------------------------------------------------------------

def _previous(conn: duckdb.DuckDBPyConnection) -> dict[str, Any] | None:
    with contextlib.suppress(duckdb.CatalogException):
        # the last row written (rows are only appended, one file each: the largest row id)
        row = conn.execute(f"SELECT * FROM {PUB}.main.publication ORDER BY rowid DESC LIMIT 1").fetchone()
        if row is None:
            return None
        cols = [d[0] for d in conn.description]
        return dict(zip(cols, row))
    return None


def _change_feed_covers(conn: duckdb.DuckDBPyConnection, prev: dict[str, Any] | None, snap: int, wid: str) -> str:
    """Why the change feed cannot be used since ``prev`` ('' when it can)."""
    if prev is None:
        return "first publication"
    if prev["warehouse_id"] != wid:
        return "published from another warehouse before"
    if int(prev["snapshot_id"]) > snap:
        return f"snapshot {snap} is older than the one published ({prev['snapshot_id']})"
    (first,) = conn.execute(f"SELECT min(snapshot_id) FROM {CATALOG}.snapshots()").fetchone()
    if int(first) > int(prev["snapshot_id"]):
        return f"the warehouse no longer keeps snapshot {prev['snapshot_id']} (expired by maintain)"
    # a warehouse restored from a copy numbers its snapshots again: the same id, another time
    row = conn.execute(f"SELECT snapshot_time FROM {CATALOG}.snapshots() WHERE snapshot_id = $s",
                       {"s": int(prev["snapshot_id"])}).fetchone()
    if row is None or _utc_naive(row[0]) != _utc_naive(prev["snapshot_time"]):
        return f"the warehouse's snapshot {prev['snapshot_id']} is not the one published (restored from a copy?)"
    return ""


def _stamp(wid: str, snap: int, snap_time: datetime) -> str:
    """Which warehouse snapshot a table's files hold, as ``hf/.published.json`` records it."""
    return f"{wid}|{snap}|{_utc_naive(snap_time).isoformat()}"


def _utc_naive(t: datetime) -> datetime:
    return t.astimezone(timezone.utc).replace(tzinfo=None) if t.tzinfo else t


def _same_columns(conn: duckdb.DuckDBPyConnection, table: str, cols: list[tuple[str, str]]) -> bool:
    try:
        rel = conn.sql(f"SELECT * FROM {PUB}.main.{_ident(table)} LIMIT 0")
    except (duckdb.CatalogException, duckdb.BinderException):  # no such table, or no publication yet
        return False
    return [(c, str(t)) for c, t in zip(rel.columns, rel.types)] == cols


def _count(conn: duckdb.DuckDBPyConnection, sql: str) -> int:
    return int(conn.execute(f"SELECT count(*) FROM {sql}").fetchone()[0])


def _apply_changes(conn: duckdb.DuckDBPyConnection, table: str, cols: list[str], since: int, snap: int,
                   dry_run: bool) -> TableDone | None:
    """Apply the warehouse's changes to ``table`` between ``since`` and ``snap`` to the published
    table; None when the result would not hold exactly the warehouse's rows (then written whole)."""
    sel = ", ".join(_ident(c) for c in cols)
    want = _count(conn, f"{CATALOG}.main.{table} AT (VERSION => {snap})")
    if since == snap:
        return TableDone(table, want, "unchanged") if _count(conn, f"{PUB}.main.{_ident(table)}") == want else None
    feed = f"ducklake_table_changes('{CATALOG}', 'main', '{table}', {since + 1}, {snap})"
    conn.execute(f"CREATE OR REPLACE TEMP TABLE _pub_in AS SELECT {sel} FROM {feed} "
                 "WHERE change_type IN ('insert', 'update_postimage')")
    conn.execute(f"CREATE OR REPLACE TEMP TABLE _pub_out AS SELECT {sel} FROM {feed} "
                 "WHERE change_type IN ('delete', 'update_preimage')")
    # the net change: a row added and removed again in between is neither (multisets: EXCEPT ALL)
    conn.execute("CREATE OR REPLACE TEMP TABLE _pub_add AS SELECT * FROM _pub_in EXCEPT ALL SELECT * FROM _pub_out")
    conn.execute("CREATE OR REPLACE TEMP TABLE _pub_rm AS SELECT * FROM _pub_out EXCEPT ALL SELECT * FROM _pub_in")
    n_add, n_rm = _count(conn, "_pub_add"), _count(conn, "_pub_rm")
    have = _count(conn, f"{PUB}.main.{_ident(table)}")
    if have + n_add - n_rm != want:
        return None
    if not n_add and not n_rm:
        return TableDone(table, want, "unchanged")
    if dry_run:
        return TableDone(table, want, "changes", n_add, n_rm)
    if n_rm:
        # a removed row is found by the hash of all its columns (NULLs included), then compared whole
        (gone,) = conn.execute(
            f"DELETE FROM {PUB}.main.{_ident(table)} t WHERE hash({sel}) IN (SELECT hash({sel}) FROM _pub_rm)"
        ).fetchone()
        if int(gone) != n_rm:
            return None
    if n_add:
        conn.execute(f"INSERT INTO {PUB}.main.{_ident(table)} SELECT * FROM _pub_add ORDER BY {_order(cols)}")
    if _count(conn, f"{PUB}.main.{_ident(table)}") != want:
        return None
    return TableDone(table, want, "changes", n_add, n_rm)


def _write_whole(conn: duckdb.DuckDBPyConnection, table: str, cols: list[tuple[str, str]], snap: int,
                 why: str, dry_run: bool, hf_ahead: Path | None = None) -> TableDone:
    """Write ``table`` whole into the published lake, sorted by key. ``hf_ahead``: a folder where
    its ``hf`` files are written too, from the same sorted rows (a sort of the rows costs more
    than reading and writing them: one sort for both layouts)."""
    names = [c for c, _ in cols]
    sel = ", ".join(_ident(c) for c in names)
    src = f"{CATALOG}.main.{table} AT (VERSION => {snap})"
    want = _count(conn, src)
    existed = _same_columns(conn, table, cols)
    if dry_run:
        return TableDone(table, want, "whole" if existed else "new", want, 0, why)
    t = f"{PUB}.main.{_ident(table)}"
    if existed:
        conn.execute(f"DELETE FROM {t}")
    else:
        conn.execute(f"DROP TABLE IF EXISTS {t}")
        conn.execute(f"CREATE TABLE {t} AS SELECT {sel} FROM {src} LIMIT 0")
    if hf_ahead is not None and _chunked(table, names):
        # sorted once, into the hf files; the lake's rows read back from them, in their order
        # (DuckDB keeps the files' order and theirs): for one source, key order; for several,
        # each source's rows together in key order
        files = _stream_chunks(conn, sel, src, names, hf_ahead)
        if files:
            listed = ", ".join(f"'{_q(str(f))}'" for f in files)
            (threads,) = conn.execute("SELECT current_setting('threads')").fetchone()
            try:
                # one thread: DuckDB's workers would each take some of the files, and the lake's
                # files would hold the rows in no order (a lookup by feature would read them all)
                conn.execute("SET threads = 1")
                conn.execute(f"INSERT INTO {t} SELECT {sel} FROM read_parquet([{listed}])")
            finally:
                conn.execute(f"SET threads = {int(threads)}")
    else:
        conn.execute(f"INSERT INTO {t} SELECT {sel} FROM {src} ORDER BY {_order(names)}")
    return TableDone(table, want, "whole" if existed else "new", want, 0, why)


def _files(folder: Path) -> dict[str, int]:
    if not folder.is_dir():
        return {}
    return {str(p): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def _publish_ducklake(conn: duckdb.DuckDBPyConnection, dest: Path, tables: list[str], snap: int, snap_time: datetime,
                      include_private: bool, url: str | None, dry_run: bool, out: Published,
                      hf_ahead: _HfAhead | None = None) -> dict[str, str]:
    """Write ``DEST/featurehouse.ducklake`` and ``DEST/data/``; the tables' how-written, by name.
    ``hf_ahead``: the ``hf`` layout comes next; a table both write whole has its ``hf`` files
    written here, from the one sort (see :class:`_HfAhead`)."""
    final = dest / CATALOG_FILE
    first = not final.exists()
    # a dry run writes nothing into DEST (it holds no lock there): its copy of the catalog goes elsewhere
    scratch = Path(tempfile.mkdtemp(prefix="featurehouse-publish-")) if dry_run else dest
    work = scratch / f"{SCRATCH}{os.getpid()}-{time.time_ns()}.ducklake"
    data = dest / "data"
    # a first publication writes its data files into a scratch folder, moved to data/ just before its
    # catalog: killed before that, it leaves nothing a reader opens (and the next one removes it)
    written = dest / f"{SCRATCH}{os.getpid()}-data" if first else data
    before = _files(data)
    if first and dry_run:
        work = None
    try:
        if not first:
            shutil.copyfile(final, work)
        wid = _warehouse_id(conn)
        if work is not None:
            if not dry_run:
                written.mkdir(parents=True, exist_ok=True)
            opts = f"DATA_PATH '{_q(str(written))}/'" + ("" if first else ", OVERRIDE_DATA_PATH true")
            conn.execute(f"ATTACH 'ducklake:{_q(str(work))}' AS {PUB} ({opts})")
            if first:
                conn.execute(f"CALL {PUB}.set_option('parquet_row_group_size', {ROW_GROUP_ROWS})")
                conn.execute(f"CALL {PUB}.set_option('parquet_compression', 'zstd')")
                # rows in Parquet files, never in the catalog: the catalog stays small for a remote
                # reader's attach, however many publications add a few rows
                conn.execute(f"CALL {PUB}.set_option('data_inlining_row_limit', 0)")
            prev = _previous(conn)
        else:
            prev = None
        why_not = _change_feed_covers(conn, prev, snap, wid)
        if not why_not:
            out.base = _stamp(wid, int(prev["snapshot_id"]), prev["snapshot_time"])
        hows: dict[str, str] = {}
        if work is not None and not dry_run:
            conn.execute("BEGIN")
        for table in tables:
            cols = _columns(conn, table, snap, include_private)
            done = None
            if not why_not and work is not None and _same_columns(conn, table, cols):
                done = _apply_changes(conn, table, [c for c, _ in cols], int(prev["snapshot_id"]), snap, dry_run)
                why = "the change feed did not add up to the warehouse's rows"
            else:
                why = why_not or "its columns changed"
            if done is None:
                ahead = hf_ahead.folder(conn, table, cols) if hf_ahead is not None and not dry_run else None
                done = _write_whole(conn, table, cols, snap, why, dry_run, ahead)
                if ahead is not None:
                    hf_ahead.written[table] = ahead
            out.tables.append(done)
            hows[table] = done.how
        if work is not None and not dry_run:
            # a table an earlier publication held and this one does not name leaves the catalog
            # (its files stay, for readers of the old catalog): the publication is what it lists
            held = [r[0] for r in conn.execute(
                f"SELECT table_name FROM duckdb_tables() WHERE database_name = '{PUB}' AND schema_name = 'main' "
                "AND table_name <> 'publication'").fetchall()]
            for gone in sorted(set(held) - set(tables)):
                conn.execute(f"DROP TABLE {PUB}.main.{_ident(gone)}")
            counts = {d.table: d.rows for d in out.tables}
            conn.execute(f"""CREATE TABLE IF NOT EXISTS {PUB}.main.publication (
                published_at TIMESTAMP, snapshot_id BIGINT, snapshot_time TIMESTAMP, warehouse_id VARCHAR,
                tables VARCHAR[], row_counts JSON, featurehouse_version VARCHAR)""")
            from .. import __version__

            conn.execute(f"INSERT INTO {PUB}.main.publication VALUES ($now, $s, $t, $w, $tb, $c, $v)",
                         {"now": datetime.now(timezone.utc).replace(tzinfo=None), "s": snap,
                          "t": _utc_naive(snap_time), "w": wid, "tb": tables,
                          "c": json.dumps(counts), "v": __version__})
            conn.execute("COMMIT")
        if work is not None:
            conn.execute(f"DETACH {PUB}")
        if dry_run:
            return hows
        # A copy with small blocks: DuckDB's 256 KiB block a table made the catalog ~8 MB, which a
        # remote reader reads on attaching; with 16 KiB blocks ~1.5 MB. Its data path: the URL it is
        # served from, else relative to the catalog file.
        compact = Path(str(work) + ".compact")
        with duckdb.connect() as raw:
            raw.execute(f"ATTACH '{_q(str(work))}' AS w (READ_ONLY)")
            raw.execute(f"ATTACH '{_q(str(compact))}' AS c (BLOCK_SIZE 16384)")
            raw.execute("COPY FROM DATABASE w TO c")
            # every file any publication in this catalog wrote: what else is in data/ a publication
            # killed part-way left
            known = _known_files(raw, "w")
            raw.execute("UPDATE c.ducklake_metadata SET value = $v WHERE key = 'data_path' AND scope IS NULL",
                        {"v": f"{url}/data/" if url else "data/"})
            raw.execute("DETACH c")
        with open(compact, "rb") as f:
            os.fsync(f.fileno())
        work.unlink()
        work = compact
        if written != data:  # a first publication: its files where its catalog says, then the catalog
            _move_into(written, data)
        os.replace(work, final)  # last: a reader of the old catalog reads its files, which stay
        work = None
        # under the folder's lock: a file no publication's catalog names was written by one that
        # was killed before its catalog replaced the old one; no reader can be reading it
        _drop_unknown(data, known)
        after = _files(data)
        new = {p: s for p, s in after.items() if p not in before}
        out.files_written += len(new) + 1
        out.bytes_written += sum(new.values()) + final.stat().st_size
        out.bytes_by_format["ducklake"] = sum(new.values()) + final.stat().st_size
        return hows
    finally:
        with contextlib.suppress(duckdb.Error):
            conn.execute("ROLLBACK")
        with contextlib.suppress(duckdb.Error):
            conn.execute(f"DETACH DATABASE IF EXISTS {PUB}")
        if work is not None:  # not published: what this publication wrote beside the catalog goes
            base = str(work).removesuffix(".compact")
            for leftover in (base, base + ".wal", base + ".compact", base + ".compact.wal"):
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
            if written != data:
                shutil.rmtree(written, ignore_errors=True)
        if scratch != dest:
            shutil.rmtree(scratch, ignore_errors=True)


def _move_into(src: Path, dst: Path) -> None:
    """Move the files under ``src`` to the same places under ``dst`` (in one rename when ``dst`` is
    not there or empty)."""
    try:
        os.rename(src, dst)
        return
    except OSError:
        pass
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        target = dst / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(f, target)
    shutil.rmtree(src, ignore_errors=True)


# --- the Hugging Face layout -----------------------------------------------------------------------

def _column_notes() -> dict[str, dict[str, str]]:
    """What each column means, from the comments of the migrations' DDL."""
    notes: dict[str, dict[str, str]] = {}
    table = None
    for path in sorted((SCHEMAS_DIR / "migrations").glob("*.sql")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if m := re.match(r"\s*CREATE TABLE (\w+)", line, re.I):
                table = m.group(1)
            elif re.match(r"\s*\)\s*;", line):
                table = None
            elif m := re.match(r"\s*ALTER TABLE (\w+) ADD COLUMN (?:IF NOT EXISTS )?\"?(\w+)\"?[^-]*--\s*(.+)", line, re.I):
                notes.setdefault(m.group(1), {})[m.group(2)] = m.group(3).strip()
            elif table and (m := re.match(r'\s*"?(\w+)"?\s+[A-Z][^-]*--\s*(.+)', line)):
                notes.setdefault(table, {})[m.group(1)] = m.group(2).strip()
    return notes


def _grains() -> dict[str, str]:
    """Each table's grain, from docs/tables.md where the checkout has it."""
    doc = SCHEMAS_DIR.parent / "docs" / "tables.md"
    out: dict[str, str] = {}
    if doc.is_file():
        for line in doc.read_text(encoding="utf-8").splitlines():
            if m := re.match(r"\|\s*((?:`\w+`(?:,\s*)?)+)\s*\|\s*(.+?)\s*\|\s*$", line):
                for t in re.findall(r"`(\w+)`", m.group(1)):
                    out[t] = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", m.group(2))
    return out


def _runs_verdicts(conn: duckdb.DuckDBPyConnection, snap: int) -> list[dict[str, Any]]:
    from .report import verdict

    rows = conn.execute(
        f"SELECT run_id, status, started_at, finished_at, n_received, n_duplicates, n_loaded, n_rejected, "
        f"n_quarantined, n_expectations, n_expectations_failed, n_features, n_activations, n_explanations "
        f"FROM {CATALOG}.main.runs AT (VERSION => {snap}) WHERE n_loaded > 0 ORDER BY started_at").fetchall()
    cols = [d[0] for d in conn.description]
    out = []
    for r in rows:
        run = dict(zip(cols, r))
        v = verdict(run)
        out.append({"run_id": run["run_id"], "started_at": str(run["started_at"]), "verdict": v.level,
                    "why": v.reason, "features": run["n_features"], "quarantined": run["n_quarantined"]})
    return out


def _card(conn: duckdb.DuckDBPyConnection, tables: list[str], snap: int, snap_time: datetime,
          license: str | None, include_private: bool, files: dict[str, list[str]]) -> str:
    import yaml

    notes, grains = _column_notes(), _grains()
    counts = {t: _count(conn, f"{CATALOG}.main.{t} AT (VERSION => {snap})") for t in tables}
    meta = {
        "license": license or "other",
        "pretty_name": "featurehouse: Neuronpedia SAE features",
        "tags": ["interpretability", "sparse-autoencoder", "neuronpedia", "featurehouse"],
        # an empty table has no config: `datasets` refuses a split with no rows ("corresponds to no
        # data"); its file (its columns) is there for pyarrow and DuckDB
        "configs": [{"config_name": t, "data_files": [{"split": "train", "path": f"{t}/*.parquet"}],
                     **({"default": True} if t == "features" else {})} for t in tables if counts[t]],
    }
    models = [r[0] for r in conn.execute(
        f"SELECT DISTINCT model_id FROM {CATALOG}.main.features AT (VERSION => {snap}) ORDER BY 1").fetchall()]
    sources = conn.execute(
        f"SELECT model_id, source_id, count(*) FROM {CATALOG}.main.features AT (VERSION => {snap}) "
        "GROUP BY ALL ORDER BY 1, 2").fetchall()
    runs = _runs_verdicts(conn, snap)
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "",
             "# Neuronpedia SAE features, validated and typed (featurehouse)", "",
             "Feature pages of [Neuronpedia](https://www.neuronpedia.org) loaded by "
             "[featurehouse](https://github.com/) into typed tables: every record checked by Great Expectations "
             "suites, bad records quarantined, not loaded.", "",
             f"- **Snapshot**: warehouse snapshot {snap}, {snap_time.isoformat()}",
             f"- **Licence**: {license or 'not given by the publisher (Neuronpedia data: see its terms)'}",
             f"- **Models**: {', '.join(models) or '(none)'}",
             "- **Sources**: " + (", ".join(f"{m}/{s} ({n:,} features)" for m, s, n in sources) or "(none)"),
             "", "## Tables", "", "| config | rows | what one row is |", "|---|---:|---|"]
    lines += [f"| `{t}` | {counts[t]:,}{'' if counts[t] else ' (empty: no config)'} | "
              f"{grains.get(t, '').replace('|', '/')} |" for t in tables]
    for t in tables:
        cols = _columns(conn, t, snap, include_private)
        lines += ["", f"### `{t}`", "", f"Files: {', '.join(f'`{f}`' for f in files.get(t, [])) or '(none)'}", "",
                  "| column | type | meaning |", "|---|---|---|"]
        lines += [f"| `{c}` | `{ty}` | {notes.get(t, {}).get(c, '').replace('|', '/')} |" for c, ty in cols]
    lines += ["", "## Data quality", "", "The runs that loaded this data, with their verdicts (PASS, WARN, FAIL):", "",
              "| run | started | verdict | why |", "|---|---|---|---|"]
    lines += [f"| `{r['run_id']}` | {r['started_at']} | {r['verdict']} | {r['why'].replace('|', '/')} |" for r in runs]
    lines += ["", "## Load", "", "```python", "import datasets", "ds = datasets.load_dataset('ORG/NAME', 'features')",
              "import pandas as pd", "df = pd.read_parquet('hf/features')", "```", ""]
    return "\n".join(lines)


def _check_hf(dest: Path, tables: list[str]) -> None:
    """``hf/`` is replaced whole: refuse when it holds anything a publication did not make."""
    hf = dest / "hf"
    if not hf.is_dir():
        return
    ours = set(_hf_held(dest).get("tables") or {}) | set(tables)
    other = sorted(p.name for p in hf.iterdir() if p.name not in (HF_MARK, "README.md") and not
                   p.name.startswith(SCRATCH) and not (p.name in ours and p.is_dir() and not p.is_symlink()))
    if other:
        raise PublishRefused(f"{hf} holds files no publication made ({', '.join(other[:3])}): move them out of it")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux's ``renameat2(RENAME_EXCHANGE)``); False where there is none."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):  # not on this system or file system
        return False
    raise OSError(e, os.strerror(e), str(b))


def _swap_in(stage: Path, folder: Path) -> None:
    """Put ``stage`` where ``folder`` is, in one step: a reader (or a kill) sees the old or the new."""
    if not folder.exists():
        os.rename(stage, folder)
        return
    if _exchange(stage, folder):
        shutil.rmtree(stage, ignore_errors=True)  # the old one, now
        return
    # two renames: killed between them, the next publication's sweep renames the old one back
    old = stage.with_name(stage.name + ".old")
    os.rename(folder, old)
    os.rename(stage, folder)
    shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` holds ``src``'s files: hard links (no bytes written; the old ones stay whole), else copies."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_dir():
            _link_or_copy(f, dst / f.name)
        else:
            _link_or_copy_file(f, dst / f.name)


def _link_or_copy_file(src: Path, dst: Path) -> None:
    """``dst`` is ``src``: a hard link, else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


#: Features per file of a table in the ``hf`` layout: a table keyed by feature is written as one
#: file per source and run of 1,024 feature indices (Neuronpedia's own export batches: a source's
#: features in files of 1,024), so a publication after a load rewrites only the files of the
#: features it changed; the others are hard links to the files before (kept, not sent again).
HF_CHUNK = 1024
#: What ``hf/.published.json`` says of how the files are cut (a folder cut otherwise is written whole).
HF_LAYOUT = f"chunks-{HF_CHUNK}"


def _chunked(table: str, names: list[str]) -> bool:
    """Whether a table is cut into files by source and feature: one keyed by feature (the three
    key columns), but ``features``, which stays one file (``data_0.parquet``): the table a reader
    opens first (pandas reads one file over HTTP, where it cannot list a folder), one small row
    a feature (~0.2 % of a publication's bytes)."""
    return table != "features" and all(k in names for k in _KEY)


def _chunk_sql(a: str = "") -> str:
    """SQL for the file a row goes to (``_chunked``): its source's digest and its run of indices,
    as the file's name without ``.parquet``. ``a``: the rows' alias and a dot."""
    return (f"left(md5(coalesce({a}model_id, '') || chr(0) || coalesce({a}source_id, '')), 12) || '-' || "
            f"lpad(CAST(coalesce({a}feature_index // {HF_CHUNK}, -1) AS VARCHAR), 7, '0')")


def _hf_held(dest: Path) -> dict[str, Any]:
    """What ``hf/.published.json`` says: each table's snapshot stamp, columns and how its files are cut."""
    try:
        got = json.loads((dest / "hf" / HF_MARK).read_text(encoding="utf-8"))
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}


def _hf_changed_chunks(conn: duckdb.DuckDBPyConnection, table: str, held: dict[str, Any], snap: int,
                       cols: list[tuple[str, str]], wid: str) -> set[str] | None:
    """The files of ``table`` the warehouse's changes since the snapshot its ``hf/`` files hold
    touch (from DuckLake's change feed), or None when they cannot be told (written whole): cut
    otherwise, other columns, another warehouse, an expired or restored snapshot."""
    stamp = (held.get("tables") or {}).get(table)
    if held.get("layout") != HF_LAYOUT or not isinstance(stamp, str) or stamp.count("|") != 2:
        return None
    if (held.get("columns") or {}).get(table) != [list(c) for c in cols]:
        return None
    hwid, hsnap, htime = stamp.split("|")
    try:
        prev = {"warehouse_id": hwid, "snapshot_id": int(hsnap), "snapshot_time": datetime.fromisoformat(htime)}
    except ValueError:
        return None
    if _change_feed_covers(conn, prev, snap, wid):
        return None
    since = prev["snapshot_id"]
    if since == snap:
        return set()
    feed = f"ducklake_table_changes('{CATALOG}', 'main', '{table}', {since + 1}, {snap})"
    try:
        if not _chunked(table, [c for c, _ in cols]):  # one file: touched by any change
            return {"data_0"} if conn.execute(f"SELECT EXISTS (FROM {feed})").fetchone()[0] else set()
        return {r[0] for r in conn.execute(f"SELECT DISTINCT {_chunk_sql()} FROM {feed}").fetchall()}
    except duckdb.Error:  # the feed cannot say (a table made again in between): written whole
        return None


def _write_hf_table(conn: duckdb.DuckDBPyConnection, table: str, names: list[str], snap: int, target: Path,
                    old: Path | None, changed: set[str] | None) -> None:
    """Write ``table``'s files into ``target``: cut by source and feature (``_chunked``), each file
    sorted; with ``old`` (the files before) and ``changed`` (the files the changes touch), the
    others are linked from ``old`` and only those are written (an emptied one is left out)."""
    sel = ", ".join(_ident(c) for c in names)
    src = f"{CATALOG}.main.{table} AT (VERSION => {snap})"
    opts = f"FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {ROW_GROUP_ROWS}"
    target.mkdir(parents=True, exist_ok=True)
    if not _chunked(table, names):  # features, and the small tables (models, sources, ...): one file
        conn.execute(f"COPY (SELECT {sel} FROM {src} ORDER BY {_order(names)}) TO '{_q(str(target / 'data_0.parquet'))}' ({opts})")
        return
    where = ""
    if old is not None and changed is not None:
        for f in sorted(old.glob("*.parquet")):
            if f.stem not in changed and f.name != "data_0.parquet":  # (that: an empty table's columns)
                _link_or_copy_file(f, target / f.name)
        if not changed:
            return
        conn.execute("CREATE OR REPLACE TEMP TABLE _hf_changed (chunk VARCHAR)")
        conn.executemany("INSERT INTO _hf_changed VALUES (?)", [[c] for c in sorted(changed)])
        where = "WHERE _chunk IN (SELECT chunk FROM _hf_changed)"
    _stream_chunks(conn, sel, src, names, target, where)


def _stream_chunks(conn: duckdb.DuckDBPyConnection, sel: str, src: str, names: list[str], target: Path,
                   where: str = "") -> list[Path]:
    """``src``'s rows (those ``where`` keeps) sorted by file (``_chunk``) and key, one Parquet file
    a chunk into ``target``, each in that order (a lookup by feature reads one row group, not
    all); the files written, in order. One sorted read, streamed to pyarrow's Parquet writer a
    batch at a time: a temp table of the sorted rows, then a COPY a file, each scanning it for its
    rows, cost twice the CPU (activations of 65,536 features: 6.4 against 3.2 CPU-s, 2026-12-07);
    DuckDB's PARTITION_BY does not keep the rows' order inside a file."""
    import pyarrow as pa
    import pyarrow.compute as pc

    target.mkdir(parents=True, exist_ok=True)
    sql = (f"SELECT * FROM (SELECT {sel}, {_chunk_sql()} AS _chunk FROM {src}) {where} "
           f"ORDER BY _chunk, {_order(names)}")
    # a JSON column as DuckDB's own writer keeps it (Parquet's JSON type): DuckDB hands it over as text
    json_cols = {n for n, t in zip(names, conn.sql(f"SELECT {sel} FROM {src} LIMIT 0").types) if str(t) == "JSON"}
    schema: pa.Schema | None = None
    out = _ChunkFiles(target)
    # the files written on a thread of their own (pyarrow lets the GIL go as it encodes), while
    # DuckDB hands over the next batches: a few batches ahead at most
    pending: collections.deque[concurrent.futures.Future] = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-write") as pool:
        try:
            for batch in conn.execute(sql).to_arrow_reader(ROW_GROUP_ROWS):
                if batch.num_rows == 0:
                    continue
                chunk = batch.column(batch.num_columns - 1)
                if schema is None:
                    schema = pa.schema([pa.field(f.name, pa.json_()) if f.name in json_cols else f
                                        for f in list(batch.schema)[:-1]])
                rows = pa.RecordBatch.from_arrays([c.cast(f.type) if f.name in json_cols else c
                                                   for c, f in zip(batch.columns[:-1], schema)], schema=schema)
                # the rows are in file order: cut the batch where the file changes
                cuts = [0]
                if batch.num_rows > 1:
                    changed = pc.not_equal(chunk.slice(1), chunk.slice(0, batch.num_rows - 1))
                    cuts += [int(i) + 1 for i in pc.indices_nonzero(changed).to_pylist()]
                cuts.append(batch.num_rows)
                for a, b in zip(cuts, cuts[1:]):
                    pending.append(pool.submit(out.add, f"{chunk[a].as_py()}.parquet", rows.slice(a, b - a)))
                while len(pending) > 8:
                    pending.popleft().result()
            while pending:
                pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()
            concurrent.futures.wait(pending)
            pool.submit(out.close).result()
    return out.files


class _ChunkFiles:
    """The files ``_stream_chunks`` writes, one a chunk, in the order their rows come: whole row
    groups of ROW_GROUP_ROWS, the last of a file shorter."""

    def __init__(self, target: Path):
        self.target = target
        self.files: list[Path] = []
        self.writer = None
        self.held: list = []

    def add(self, name: str, rows) -> None:
        import pyarrow.parquet as pq

        if not self.files or self.files[-1].name != name:
            self.close()
            self.files.append(self.target / name)
            self.writer = pq.ParquetWriter(self.files[-1], rows.schema, compression="zstd", use_dictionary=True,
                                           dictionary_pagesize_limit=_DICTIONARY_PAGE)
        self.held.append(rows)
        self._flush()

    def _flush(self, final: bool = False) -> None:
        import pyarrow as pa

        n = sum(b.num_rows for b in self.held)
        if self.writer is None or not n or (n < ROW_GROUP_ROWS and not final):
            return
        t = pa.Table.from_batches(self.held)
        cut = n if final else n - n % ROW_GROUP_ROWS
        self.writer.write_table(t.slice(0, cut), row_group_size=ROW_GROUP_ROWS)
        self.held = t.slice(cut).to_batches() if cut < n else []

    def close(self) -> None:
        if self.writer is not None:
            try:
                self._flush(final=True)
            finally:
                self.writer.close()
                self.writer = None
                self.held = []


#: A column's dictionary page at most this large, then plain: an activation's values (few distinct
#: short decimals) take a dictionary, a 256-value embedding does not (pyarrow's default of 1 MB
#: made the explanations' files 7 % larger than DuckDB's own writer; at 16 KiB, the same size).
_DICTIONARY_PAGE = 16 << 10


class _HfAhead:
    """The ``hf`` files of the tables the DuckLake layout writes whole, written by it from the
    rows it sorted (``_write_whole``), for :func:`_publish_hf` to take instead of sorting them
    again: only where the ``hf`` layout would write that table whole too (no files of it yet, or
    files it cannot bring up to date). In a scratch folder of DEST: a publication killed before
    ``hf/`` is swapped in leaves them to the next one's sweep."""

    def __init__(self, dest: Path, snap: int, wid: str):
        self.dest, self.snap, self.wid = dest, snap, wid
        self.held = _hf_held(dest) if (dest / "hf").is_dir() else {}
        self.root = dest / f"{SCRATCH}{os.getpid()}-hf-ahead"
        self.written: dict[str, Path] = {}

    def folder(self, conn: duckdb.DuckDBPyConnection, table: str, cols: list[tuple[str, str]]) -> Path | None:
        if not _chunked(table, [c for c, _ in cols]) or not _hf_whole(conn, self.dest, table, self.held, self.snap,
                                                                      cols, self.wid):
            return None
        shutil.rmtree(self.root / table, ignore_errors=True)
        return self.root / table

    def take(self, table: str, target: Path) -> bool:
        """Move the table's files written ahead to ``target``; whether there were any."""
        ahead = self.written.pop(table, None)
        if ahead is None or not ahead.is_dir():
            return False
        os.rename(ahead, target)
        return True

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _hf_whole(conn: duckdb.DuckDBPyConnection, dest: Path, table: str, held: dict[str, Any], snap: int,
              cols: list[tuple[str, str]], wid: str) -> bool:
    """Whether the ``hf`` layout writes ``table`` whole (no files of it, or none it can bring up to date)."""
    return not (dest / "hf" / table).is_dir() or _hf_changed_chunks(conn, table, held, snap, cols, wid) is None


def _publish_hf(conn: duckdb.DuckDBPyConnection, dest: Path, tables: list[str], snap: int, snap_time: datetime,
                include_private: bool, license: str | None, out: Published, ahead: _HfAhead | None = None) -> None:
    """Write ``DEST/hf/`` into a scratch folder, then swap it in: ``hf/`` is the publication
    before or this one, never some of each (killed part-way, the next sweeps the scratch). Files
    the warehouse's changes since the files before did not touch are hard links to them."""
    hf = dest / "hf"
    held = _hf_held(dest) if hf.is_dir() else {}
    wid = _warehouse_id(conn)
    here = _stamp(wid, snap, snap_time)
    stage = dest / f"{SCRATCH}{os.getpid()}-hf"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        now: dict[str, str] = {}
        columns: dict[str, list[list[str]]] = {}
        for table in tables:
            folder = hf / table
            target = stage / table
            now[table] = here
            cols = _columns(conn, table, snap, include_private)
            columns[table] = [list(c) for c in cols]
            names = [c for c, _ in cols]
            touched = _hf_changed_chunks(conn, table, held, snap, cols, wid) if folder.is_dir() else None
            if touched is not None and not touched:  # its files hold what this snapshot has
                _link_or_copy(folder, target)
                continue
            before = _files(folder) if touched is not None else {}
            if touched is not None or ahead is None or not ahead.take(table, target):
                _write_hf_table(conn, table, names, snap, target, folder if touched is not None else None, touched)
            if not any(target.glob("*.parquet")):  # an empty table: one file with its columns
                conn.execute(f"COPY (SELECT {', '.join(_ident(c) for c in names)} FROM {CATALOG}.main.{table} "
                             f"AT (VERSION => {snap}) LIMIT 0) TO '{_q(str(target / 'data_0.parquet'))}' (FORMAT parquet)")
            linked = {Path(k).name for k in before}
            new = {k: v for k, v in _files(target).items()
                   if Path(k).name not in linked or not os.path.samefile(k, folder / Path(k).name)}
            out.files_written += len(new)
            out.bytes_written += sum(new.values())
            out.bytes_by_format["hf"] = out.bytes_by_format.get("hf", 0) + sum(new.values())
        (stage / HF_MARK).write_text(json.dumps({"layout": HF_LAYOUT, "tables": now, "columns": columns}, indent=1),
                                     encoding="utf-8")
        files = {t: sorted(p.name for p in (stage / t).glob("*.parquet")) for t in tables}
        card = _card(conn, tables, snap, snap_time, license, include_private, files)
        (stage / "README.md").write_text(card, encoding="utf-8")
        out.files_written += 1
        out.bytes_written += len(card.encode())
        out.bytes_by_format["hf"] = out.bytes_by_format.get("hf", 0) + len(card.encode())
        _swap_in(stage, hf)  # the tables an earlier publication wrote and this one does not name go with it
    finally:
        shutil.rmtree(stage, ignore_errors=True)


# --- the whole of it --------------------------------------------------------------------------------

def publish(settings: Settings, dest: str | os.PathLike, *, snapshot: int | None = None, at: datetime | None = None,
            tables: list[str] | None = None, formats: tuple[str, ...] = ("ducklake", "hf"), url: str | None = None,
            license: str | None = None, include_private: bool = False, dry_run: bool = False,
            stage: str | os.PathLike | None = None) -> Published:
    """Publish the warehouse's tables as of one snapshot (the latest by default) into ``dest``, a
    folder (``s3://bucket/prefix``: :func:`pipeline.outputs.publish_s3.publish`, which builds on this).

    ``url``: where ``dest`` will be served from (``https://host/path``): the catalog then names
    its data files there, and the printed line attaches it with nothing else (for an ``s3://``
    DEST, the DEST itself unless given). ``stage``: for an ``s3://`` DEST, a folder of
    featurehouse's own where its publication is built before it is uploaded (default: in
    featurehouse's cache folder, see :mod:`pipeline.outputs.publish_s3`). Raises
    :class:`PublishRefused` for a publication that cannot or may not be made
    (:class:`~pipeline.outputs.publish_s3.UploadFailed`, one of them, for an upload that failed
    part-way)."""
    started = time.monotonic()
    bad = [f for f in formats if f not in ("ducklake", "hf")]
    if bad or not formats:
        raise PublishRefused(f"unknown format {', '.join(bad) or '(none)'}: ducklake, hf or both")
    if url is not None:
        url = url.rstrip("/")
        if not re.match(r"(https?|s3|gs|r2|az)://\S+$", url):
            raise PublishRefused(f"--url {url!r} is not an http(s):// or s3:// address")
    where = os.fspath(dest)
    if where.startswith("s3:/"):  # (publish_s3 builds on this module: it cannot be called from here)
        raise PublishRefused(f"{where}: an s3:// DEST is published by pipeline.outputs.publish_s3.publish "
                             "(featurehouse publish calls it)")
    out = _publish_folder(settings, _check_dest(settings, Path(dest)), snapshot=snapshot, at=at, tables=tables,
                          formats=tuple(formats), url=url, license=license, include_private=include_private,
                          dry_run=dry_run, lock=True)
    out.seconds = time.monotonic() - started
    return out


def _publish_folder(settings: Settings, dest: Path, *, snapshot: int | None, at: datetime | None,
                    tables: list[str] | None, formats: tuple[str, ...], url: str | None, license: str | None,
                    include_private: bool, dry_run: bool = False, lock: bool = False) -> Published:
    """Publish into the folder ``dest`` (checked): ``lock``, taking its lock; without, its caller holds it."""
    conn = warehouse_mod.connect(settings, read_only=True)
    stack = contextlib.ExitStack()
    try:
        snap, snap_time = _snapshot(conn, snapshot, at)
        names = _tables(conn, snap, tables)
        if "hf" in formats:
            _check_hf(dest, names)
        spill = dest / f"{SCRATCH}{os.getpid()}-tmp"
        if not dry_run:
            dest.mkdir(parents=True, exist_ok=True)
            if lock:
                _lock(dest, stack)  # one publication into a folder at a time
            stack.callback(shutil.rmtree, spill, ignore_errors=True)  # before the lock is let go
            _sweep(dest)
            conn.execute(f"SET temp_directory = '{_q(str(spill))}'")
        out = Published(dest, snap, snap_time, tuple(formats), dry_run=dry_run, url=url)
        ahead = None
        if "ducklake" in formats and "hf" in formats and not dry_run:
            ahead = _HfAhead(dest, snap, _warehouse_id(conn))
            stack.callback(ahead.close)  # (before the lock is let go)
        if "ducklake" in formats:
            _publish_ducklake(conn, dest, names, snap, snap_time, include_private, url, dry_run, out, ahead)
        if "hf" in formats and not dry_run:
            _publish_hf(conn, dest, names, snap, snap_time, include_private, license, out, ahead)
        elif "hf" in formats and not out.tables:
            out.tables = [TableDone(t, _count(conn, f"{CATALOG}.main.{t} AT (VERSION => {snap})"), "whole") for t in names]
    finally:
        conn.close()
        stack.close()
    return out
