"""Maintenance: expire history past the retention period and keep the data files few and large.

Every commit is a snapshot, and every load writes new Parquet files (an inbox run every ten
minutes writes a few small ones each time). ``maintain`` runs DuckLake's own maintenance, in
this order, each step its own commit under the warehouse's commit lock:

1. flush rows kept inline in the catalog (small commits) into Parquet files;
2. expire snapshots older than the retention period (``settings.retention_days``);
3. merge adjacent small files, and rewrite files where many rows were deleted (replaced
   captures leave deletions behind);
4. delete the files no snapshot references any more, and orphaned files, once they are older
   than a grace period (a reader that started before may still be reading them).

An orphan may be a writer's file written before its commit (``stages/load.py`` ``prewrite``:
``featurehouse-w<tag>-<uuid>.parquet``, the tag from its run id). While any run with that tag is
``running`` and not found abandoned, its files are not orphans: the orphan step then deletes
nothing this time, whatever the grace (a writer may wait its whole lock timeout, or be paused),
and says which run it waited for. A run that died on another host stays ``running`` until it
is settled (the nightly DAG's finish, or a run on its host): its files wait until then.

It never deletes a file outside the warehouse's own data folder: the data path the lake is open
with must be the one the warehouse's settings and folder resolve to (a copied folder's catalog
records the original's), and every file DuckLake would delete is listed first (a dry run, under
the commit lock) and must lie under it; otherwise nothing is deleted and
:class:`MaintenanceRefused` says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import timedelta

import duckdb

from ..config import Settings
from . import runstate, warehouse
from .warehouse import CATALOG, utcnow

__all__ = ["MaintenanceResult", "MaintenanceRefused", "maintain", "count_files"]

log = logging.getLogger("featurehouse")


class MaintenanceRefused(RuntimeError):
    "Maintenance would have deleted or written files outside the warehouse's own data folder."


@dataclass(frozen=True)
class MaintenanceResult:
    """What one maintenance pass did."""

    retention_days: float
    snapshots_before: int
    snapshots_after: int
    snapshots_expired: int
    """Snapshots older than the retention period, removed (maintenance commits a few of its own)."""
    files_before: int
    files_after: int
    bytes_before: int
    bytes_after: int
    seconds: float

    def as_dict(self) -> dict:
        return asdict(self)


def count_files(conn: duckdb.DuckDBPyConnection) -> tuple[int, int]:
    """Parquet files (data and deletes) under the data path, and their bytes."""
    path = warehouse.data_path(conn)
    n, size = conn.execute(
        "SELECT count(*), coalesce(sum(size), 0) FROM read_blob($glob)", {"glob": path.rstrip("/") + "/**/*.parquet"}
    ).fetchone()
    return int(n), int(size)


def _inlined_rows(conn) -> int:
    """Rows kept inline in the catalog (small inserts before migration 0003)."""
    meta = f"__ducklake_metadata_{CATALOG}"
    tables = [t for (t,) in conn.execute(f"SELECT table_name FROM {meta}.ducklake_inlined_data_tables").fetchall()]
    return sum(conn.execute(f'SELECT count(*) FROM {meta}."{t}"').fetchone()[0] for t in tables)


def _under(path: str, root: str) -> bool:
    """Whether ``path`` lies in the folder (or S3 prefix) ``root``, symbolic links resolved."""
    if "://" in root or "://" in path:
        return path.startswith(root.rstrip("/") + "/")
    return os.path.realpath(path).startswith(os.path.realpath(root).rstrip("/") + "/")


def _same_place(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _check_data_path(settings: Settings, conn: duckdb.DuckDBPyConnection) -> str:
    """The data path the lake is open with, if it is the warehouse's own; else refuse."""
    root = warehouse.data_path(conn)
    own = warehouse.resolved_data_path(settings)
    if own is not None and not _same_place(root, own):
        raise MaintenanceRefused(
            f"the warehouse at {settings.warehouse} keeps its data files in {own}, but its lake is open on {root}: "
            "maintenance would merge and delete files there, so it did nothing")
    return root


def writer_tag(run_id: str) -> str:
    """The tag a run's files carry before their commit: see the module."""
    return hashlib.sha256(run_id.encode()).hexdigest()[:12]


def pending_name(run_id: str) -> str:
    """A name for a file run ``run_id`` writes before its commit (``stages/load.py`` ``prewrite``)."""
    return f"featurehouse-w{writer_tag(run_id)}-{uuid.uuid4()}.parquet"


_PENDING = re.compile(r"featurehouse-w([0-9a-f]{12})-[0-9a-f-]{36}\.parquet$")


def _live_writers(c: duckdb.DuckDBPyConnection, paths: list[str]) -> dict[str, str]:
    """Of ``paths``, those a live run wrote before its commit: path -> that run's id."""
    tags = {m.group(1): p for p in paths if (m := _PENDING.search(p))}
    if not tags:
        return {}
    abandoned = runstate.find_abandoned(c)
    running = [r for (r,) in warehouse.execute(c, "SELECT run_id FROM runs WHERE status = 'running'").fetchall()
               if r not in abandoned]
    by_tag = {writer_tag(r): r for r in running}
    return {p: by_tag[t] for t, p in tags.items() if t in by_tag}


def _step(function: str, args: str, params: dict, root: str, *, deletes: bool):
    """One maintenance call as a transaction body. A deleting one lists the files DuckLake would
    delete first (a dry run, in the same transaction, under the commit lock) and deletes nothing
    unless every one is under ``root``."""
    call = f"CALL {function}('{CATALOG}'{args})"

    def body(c: duckdb.DuckDBPyConnection) -> None:
        if deletes:
            listed = c.execute(f"SELECT path FROM {function}('{CATALOG}'{args}, dry_run => true)", params).fetchall()
            outside = [p for (p,) in listed if not _under(p, root)]
            if outside:
                raise MaintenanceRefused(
                    f"maintenance would delete {len(outside)} file(s) outside the warehouse's data folder {root} "
                    f"(e.g. {outside[0]}); it deleted nothing")
            if live := _live_writers(c, [p for (p,) in listed]):
                runs = sorted(set(live.values()))
                log.warning("maintenance: %d unreferenced file(s) belong to run(s) still running (%s), which may "
                            "yet commit them: %s deletes nothing this time", len(live), ", ".join(runs[:3]), function)
                return
        c.execute(call, params)

    return body


def maintain(settings: Settings, *, retention_days: float | None = None,
             grace: timedelta = timedelta(hours=1)) -> MaintenanceResult:
    """Expire old snapshots, compact small files and delete unreferenced ones (see the module)."""
    started = time.monotonic()
    days = settings.retention_days if retention_days is None else retention_days
    conn = warehouse.connect(settings)
    try:
        def snapshots() -> set[int]:
            return {i for (i,) in conn.execute(f"SELECT snapshot_id FROM {CATALOG}.snapshots()").fetchall()}

        before, (n_files, n_bytes) = snapshots(), count_files(conn)
        now = utcnow()
        # Flushing inlined rows drops the catalog tables that held them under any reader whose
        # snapshot still reads them; since migration 0003 nothing is inlined, so only a warehouse
        # that inlined rows before it is flushed, once.
        root = _check_data_path(settings, conn)
        older = " older_than => $t::TIMESTAMP AT TIME ZONE 'UTC'"
        steps = [("flush inlined data", "ducklake_flush_inlined_data", "", {}, False)] if _inlined_rows(conn) else []
        steps += [
            ("expire snapshots", "ducklake_expire_snapshots", "," + older, {"t": now - timedelta(days=days)}, False),
            ("merge adjacent files", "ducklake_merge_adjacent_files", "", {}, False),
            ("rewrite files with deletions", "ducklake_rewrite_data_files", "", {}, False),
            ("clean up old files", "ducklake_cleanup_old_files", "," + older, {"t": now - grace}, True),
            ("delete orphaned files", "ducklake_delete_orphaned_files", "," + older, {"t": now - grace}, True),
        ]
        for what, function, args, params, deletes in steps:
            t0 = time.monotonic()
            warehouse.transaction(conn, settings, _step(function, args, params, root, deletes=deletes),
                                  message=f"maintenance: {what}", extra={"maintenance": what})
            log.info("maintenance: %s in %.2fs", what, time.monotonic() - t0)
        after_files, after_bytes = count_files(conn)
        after = snapshots()
        return MaintenanceResult(days, len(before), len(after), len(before - after), n_files, after_files,
                                 n_bytes, after_bytes, round(time.monotonic() - started, 3))
    finally:
        conn.close()
