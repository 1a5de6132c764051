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
the code of this module and its siblings, then uploaded, the catalog last
(:mod:`pipeline.outputs.publish_s3`).

**Private.** What leaves is the data tables and their statistics (``DEFAULT_TABLES``); other
tables only when named (``tables``), and even then without the columns that say where the
inputs came from or who ran what (``PRIVATE_COLUMNS``: paths, hosts, errors) unless
``include_private``. Nothing of the landing area is published, and DEST may not be inside the
warehouse.

Why not the ``frozen-ducklake`` project: it is not on this project's package index (``pip
download frozen-ducklake`` finds no version here), and it copies a lake whole; the change feed
is what makes a nightly publication send ~a page's worth of bytes.

**Where it is.** This module holds the command's entry point (:func:`publish`) and the order of
things (``_publish_folder``); beside it, one concern each: ``publish_names`` (what a publication
is called and reports), ``publish_snapshot`` (what of the warehouse: snapshot, tables, columns,
whether the change feed reaches back), ``publish_folder`` (DEST checked, the lock, the sweep of a
killed one's leftovers, the swaps), ``publish_lake`` (the DuckLake layout), ``publish_hf`` and
``publish_hf_files`` (the ``hf`` layout, and its files cut and streamed), ``publish_card`` (the
dataset card) and ``publish_s3`` (the upload).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from datetime import datetime
from pathlib import Path

from ..config import Settings
from ..lake import warehouse as warehouse_mod
from ..lake.warehouse import CATALOG, _q
from .publish_folder import _check_dest, _lock, _sweep
from .publish_hf import _check_hf, _HfAhead, _publish_hf
from .publish_hf_files import HF_CHUNK
from .publish_lake import _publish_ducklake
from .publish_names import (
    CATALOG_FILE,
    DEFAULT_TABLES,
    HF_MARK,
    LOCK_FILE,
    PRIVATE_COLUMNS,
    SCRATCH,
    Published,
    PublishRefused,
    TableDone,
)
from .publish_snapshot import _count, _snapshot, _tables, _warehouse_id

#: What other code takes from here (``CATALOG_FILE`` ... ``TableDone`` are defined in ``publish_names``,
#: ``HF_CHUNK`` in ``publish_hf_files``).
__all__ = ["DEFAULT_TABLES", "PRIVATE_COLUMNS", "PublishRefused", "Published", "publish", "CATALOG_FILE",
           "LOCK_FILE", "HF_MARK", "HF_CHUNK", "SCRATCH", "TableDone"]


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
    """Publish into the folder ``dest`` (checked): ``lock``, taking its lock; without, its caller holds it.

    The lock of a folder that exists is taken before the warehouse is opened: a publication under
    way there may be stopped (SIGSTOP, a debugger) while it holds the warehouse's SQLite catalog,
    rebuilding its WAL index (each of its reads opens the catalog anew, and rebuilds it when alone),
    and SQLite then fails every other reader ("database is locked", or "locking protocol" after
    ~95 s of retries), where the next publication into that folder is to be refused at once,
    naming it. (Any other reader of the warehouse fails the same: that is SQLite's own.) A folder
    that does not exist holds no publication: it is made (and locked) only once the snapshot and
    tables are known good, so a refused publication leaves no folder behind."""
    stack = contextlib.ExitStack()
    conn = None
    try:
        locked = lock and not dry_run and dest.is_dir()
        if locked:
            _lock(dest, stack)  # one publication into a folder at a time
        conn = warehouse_mod.connect(settings, read_only=True)
        snap, snap_time = _snapshot(conn, snapshot, at)
        names = _tables(conn, snap, tables)
        if "hf" in formats:
            _check_hf(dest, names)
        spill = dest / f"{SCRATCH}{os.getpid()}-tmp"
        if not dry_run:
            dest.mkdir(parents=True, exist_ok=True)
            if lock and not locked:
                _lock(dest, stack)
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
        if conn is not None:
            conn.close()
        stack.close()
    return out
