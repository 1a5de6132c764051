"""Move a single-file DuckDB warehouse (featurehouse 0.1) into a lakehouse warehouse.

Every table is copied by column name into the current schema, in one transaction (one
snapshot, "migrated from <file>"): runs, inputs, the data tables, quarantine, validation
results, fetch failures and the statistics. What the old release did not record is derived:
a row's capture time is when its input was received, and ``feature_captures`` names, for each
feature and table, the input its rows came from. Landed inputs are linked (or copied) into the
new landing area when it is elsewhere, and their recorded paths follow. The old file is left as
it was.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import duckdb

from ..config import Settings
from . import warehouse
from .landing import landed_path

__all__ = ["LegacyMigrationError", "LEGACY_TABLES", "migrate_file"]

log = logging.getLogger("featurehouse")


class LegacyMigrationError(ValueError):
    "The file is not a featurehouse 0.1 warehouse, or the target already holds data."


#: The old release's tables, in the order they are copied.
LEGACY_TABLES = (
    "runs", "raw_inputs", "run_inputs", "models", "source_sets", "sources", "features", "activations",
    "explanations", "quarantine", "validation_results", "fetch_failures", "feature_activation_stats",
    "source_activation_stats",
)
_DATA_TABLES = ("features", "activations", "explanations")


def _columns(conn: duckdb.DuckDBPyConnection, catalog: str, table: str) -> list[str]:
    return [c for (c,) in conn.execute(
        "SELECT column_name FROM duckdb_columns() WHERE database_name = ? AND table_name = ? ORDER BY column_index",
        [catalog, table]).fetchall()]


def _link_or_copy(src: Path, dest: Path) -> None:
    if dest.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _damage(old: Path, tables: set[str]) -> str | None:
    """What is wrong with the old file, in DuckDB's words, if reading every table whole fails
    (a block cut off, a checksum that does not match); None when it reads."""
    try:
        with duckdb.connect(str(old), read_only=True) as conn:
            for table in sorted(tables):
                reader = conn.execute(f'SELECT * FROM "{table}"').fetch_record_batch(65_536)
                for _ in reader:  # every block is read, and its checksum checked
                    pass
    except duckdb.Error as exc:
        return _first_line(exc)
    return None


def migrate_file(old: Path, settings: Settings) -> dict[str, int]:
    """Copy the warehouse in ``old`` into the lakehouse ``settings`` names; return rows per table.

    Refuses a target that already holds runs or inputs, and a file that is not a featurehouse
    warehouse.
    """
    old = Path(old).resolve()
    try:
        with old.open("rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise LegacyMigrationError(f"{old} cannot be read: {exc.strerror or exc}") from None
    if head.startswith(b"SQLite format 3"):
        # DuckDB would open it through its SQLite extension, fetched from the network
        raise LegacyMigrationError(f"{old} is an SQLite database, not a featurehouse 0.1 warehouse (a DuckDB file); "
                                   "a lakehouse's catalog.sqlite needs no migration: point --warehouse at its folder")
    try:
        probe = duckdb.connect(str(old), read_only=True, config={"autoinstall_known_extensions": False,
                                                                 "autoload_known_extensions": False})
        with probe:
            tables = {t for (t,) in probe.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    except duckdb.Error as exc:
        raise LegacyMigrationError(f"{old} cannot be opened as a DuckDB database: it is not one, or it is damaged "
                                   f"or cut short ({_first_line(exc)})") from None
    if not {"runs", "raw_inputs", "features", "activations"} <= tables:
        raise LegacyMigrationError(f"{old} is a DuckDB file but not a featurehouse warehouse (no runs/features tables)")
    if settings.warehouse.resolve() == old:
        raise LegacyMigrationError("give the new warehouse's folder with --warehouse (not the old file)")
    damage = _damage(old, tables)  # read whole before anything is written: a damaged file moves nothing
    if damage is not None:
        raise LegacyMigrationError(f"{old} is damaged or cut short: {damage}; nothing was migrated. Restore it "
                                   "from a backup and migrate again")

    conn = warehouse.connect(settings, create=True)
    try:
        held = conn.execute("SELECT (SELECT count(*) FROM runs) + (SELECT count(*) FROM raw_inputs)").fetchone()[0]
        if held:
            raise LegacyMigrationError(
                f"the warehouse at {settings.warehouse} already holds data; migrate into a new (empty) one")
        q = str(old).replace("'", "''")
        conn.execute(f"ATTACH '{q}' AS legacy (READ_ONLY)")
        old_landing = old.parent / "landing"
        new_landing = settings.landing_dir
        moved_landing = old_landing.resolve() != new_landing.resolve()

        def body(c: duckdb.DuckDBPyConnection) -> dict[str, int]:
            counts: dict[str, int] = {}
            for table in LEGACY_TABLES:
                if table not in tables:
                    continue
                new_cols = set(_columns(c, warehouse.CATALOG, table))
                cols = [col for col in _columns(c, "legacy", table) if col in new_cols]
                sel = ", ".join(f'o."{col}"' for col in cols)
                extra = ""
                if table in _DATA_TABLES or table == "raw_inputs":
                    # what the old release knew of a capture's time: when its input was received
                    extra = (", (SELECT r.received_at FROM legacy.raw_inputs r "
                             "WHERE r.input_sha256 = o.input_sha256 LIMIT 1) AS captured_at")
                c.execute(f"INSERT INTO {table} BY NAME SELECT {sel}{extra} FROM legacy.{table} AS o")
                counts[table] = c.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for table in _DATA_TABLES:
                c.execute(f"""
                    INSERT INTO feature_captures BY NAME
                    SELECT model_id, source_id, feature_index, '{table}' AS table_name,
                           arg_max(captured_at, loaded_at) AS captured_at,
                           arg_max(input_sha256, loaded_at) AS input_sha256,
                           arg_max(run_id, loaded_at) AS run_id, max(loaded_at) AS loaded_at
                    FROM {table} WHERE input_sha256 IS NOT NULL AND run_id IS NOT NULL
                    GROUP BY ALL""")
            counts["feature_captures"] = c.execute("SELECT count(*) FROM feature_captures").fetchone()[0]
            # recorded paths follow the bytes into the new landing area
            c.execute(
                "UPDATE raw_inputs SET landed_path = $new || '/sha256/' || input_sha256[1:2] || '/' || input_sha256 "
                "WHERE list_contains($present, input_sha256)",
                {"new": str(new_landing), "present": present},
            )
            return counts

        present = []
        for (sha,) in conn.execute("SELECT input_sha256 FROM legacy.raw_inputs").fetchall():
            src, dest = landed_path(old_landing, sha), landed_path(new_landing, sha)
            if moved_landing and src.exists():
                _link_or_copy(src, dest)
            if dest.exists():
                present.append(sha)
        if moved_landing:
            for manifest in (old_landing / "fetch").glob("*.jsonl"):
                _link_or_copy(manifest, new_landing / "fetch" / manifest.name)
        old_gx, new_gx = old.parent / "gx", settings.gx_dir / "gx"
        if old_gx.is_dir() and old_gx.resolve() != new_gx.resolve() and not new_gx.exists():
            shutil.copytree(old_gx, new_gx)
        counts = warehouse.transaction(conn, settings, body, message=f"migrated from {old}",
                                       extra={"migrated_from": str(old)})
        log.info("migrated %s into %s: %s", old, settings.warehouse, counts)
        return counts
    finally:
        conn.close()
