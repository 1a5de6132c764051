"""The Hugging Face layout, ``DEST/hf/``: which of a table's files the warehouse's changes touch
(``hf/.published.json`` says which snapshot, columns and cut each table's files hold), the files
the DuckLake layout wrote ahead from its own sort (``_HfAhead``), and ``hf/`` built in a staged
copy (unchanged files hard-linked) with its dataset card, then swapped in whole.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb

from ..lake.warehouse import CATALOG, _q
from .publish_card import _card
from .publish_folder import _files, _link_or_copy, _swap_in
from .publish_hf_files import HF_LAYOUT, _chunk_sql, _chunked, _write_hf_table
from .publish_names import HF_MARK, SCRATCH, Published, PublishRefused
from .publish_snapshot import _change_feed_covers, _columns, _ident, _stamp, _warehouse_id


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
