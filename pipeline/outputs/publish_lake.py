"""The DuckLake layout: ``DEST/featurehouse.ducklake`` and its Parquet files in ``DEST/data/``.
Each table gets the warehouse's changes since the snapshot published before (DuckLake's change
feed: the rows removed deleted, the rows added appended in a new file) or is written whole,
sorted by key (its ``hf`` files written from the same sort when the ``hf`` layout writes it
whole too); the ``publication`` table records each publication; the catalog is copied with
small blocks and replaces the old one last.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from ..lake.warehouse import CATALOG, _q
from .publish_folder import _drop_unknown, _files, _known_files, _move_into
from .publish_hf import _HfAhead
from .publish_hf_files import _chunked, _stream_chunks
from .publish_names import CATALOG_FILE, PUB, ROW_GROUP_ROWS, SCRATCH, Published, TableDone
from .publish_snapshot import (
    _change_feed_covers,
    _columns,
    _count,
    _ident,
    _order,
    _stamp,
    _utc_naive,
    _warehouse_id,
)


def _previous(conn: duckdb.DuckDBPyConnection) -> dict[str, Any] | None:
    with contextlib.suppress(duckdb.CatalogException):
        # the last row written (rows are only appended, one file each: the largest row id)
        row = conn.execute(f"SELECT * FROM {PUB}.main.publication ORDER BY rowid DESC LIMIT 1").fetchone()
        if row is None:
            return None
        cols = [d[0] for d in conn.description]
        return dict(zip(cols, row))
    return None



def _same_columns(conn: duckdb.DuckDBPyConnection, table: str, cols: list[tuple[str, str]]) -> bool:
    try:
        rel = conn.sql(f"SELECT * FROM {PUB}.main.{_ident(table)} LIMIT 0")
    except (duckdb.CatalogException, duckdb.BinderException):  # no such table, or no publication yet
        return False
    return [(c, str(t)) for c, t in zip(rel.columns, rel.types)] == cols



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
