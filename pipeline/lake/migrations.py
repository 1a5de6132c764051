"""Schema versions: the ordered migrations in ``schemas/migrations``, the version a warehouse is
at, and bringing it up to date. Opening an older warehouse for writing applies them
(``connect``); a newer one is refused."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import duckdb

from ..config import SCHEMAS_DIR, Settings
from .catalog import CATALOG
from .commit import transaction

log = logging.getLogger("featurehouse")


class SchemaTooNew(RuntimeError):
    "The warehouse was written by a newer featurehouse: upgrade featurehouse to open it."


class SchemaTooOld(RuntimeError):
    "The warehouse's schema is older than this featurehouse: any write command upgrades it."


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
