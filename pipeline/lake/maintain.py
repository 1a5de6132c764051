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
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import duckdb

from ..config import Settings
from . import warehouse
from .warehouse import CATALOG, utcnow

__all__ = ["MaintenanceResult", "maintain", "count_files"]

log = logging.getLogger("featurehouse")


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
    (path,) = conn.execute(f"SELECT value FROM {CATALOG}.options() WHERE option_name = 'data_path'").fetchone()
    n, size = conn.execute(
        "SELECT count(*), coalesce(sum(size), 0) FROM read_blob($glob)", {"glob": path.rstrip("/") + "/**/*.parquet"}
    ).fetchone()
    return int(n), int(size)


def _inlined_rows(conn) -> int:
    """Rows kept inline in the catalog (small inserts before migration 0003)."""
    meta = f"__ducklake_metadata_{CATALOG}"
    tables = [t for (t,) in conn.execute(f"SELECT table_name FROM {meta}.ducklake_inlined_data_tables").fetchall()]
    return sum(conn.execute(f'SELECT count(*) FROM {meta}."{t}"').fetchone()[0] for t in tables)


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
        steps = [("flush inlined data", f"CALL ducklake_flush_inlined_data('{CATALOG}')", {})] if _inlined_rows(conn) else []
        steps += [
            ("expire snapshots",
             f"CALL ducklake_expire_snapshots('{CATALOG}', older_than => $t::TIMESTAMP AT TIME ZONE 'UTC')",
             {"t": now - timedelta(days=days)}),
            ("merge adjacent files", f"CALL ducklake_merge_adjacent_files('{CATALOG}')", {}),
            ("rewrite files with deletions", f"CALL ducklake_rewrite_data_files('{CATALOG}')", {}),
            ("clean up old files",
             f"CALL ducklake_cleanup_old_files('{CATALOG}', older_than => $t::TIMESTAMP AT TIME ZONE 'UTC')",
             {"t": now - grace}),
            ("delete orphaned files",
             f"CALL ducklake_delete_orphaned_files('{CATALOG}', older_than => $t::TIMESTAMP AT TIME ZONE 'UTC')",
             {"t": now - grace}),
        ]
        for what, sql, params in steps:
            t0 = time.monotonic()
            warehouse.transaction(conn, settings, lambda c, sql=sql, params=params: c.execute(sql, params),
                                  message=f"maintenance: {what}", extra={"maintenance": what})
            log.info("maintenance: %s in %.2fs", what, time.monotonic() - t0)
        after_files, after_bytes = count_files(conn)
        after = snapshots()
        return MaintenanceResult(days, len(before), len(after), len(before - after), n_files, after_files,
                                 n_bytes, after_bytes, round(time.monotonic() - started, 3))
    finally:
        conn.close()
