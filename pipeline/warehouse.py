"""The DuckDB warehouse file: open it, create its tables, one writer at a time."""

from __future__ import annotations

from pathlib import Path

import duckdb

from .config import SCHEMAS_DIR

__all__ = ["connect", "WarehouseMissing"]


class WarehouseMissing(FileNotFoundError):
    "The warehouse file does not exist yet: run `featurehouse ingest` first."


def _ddl() -> str:
    return "\n".join(
        (SCHEMAS_DIR / "sql" / name).read_text()
        for name in ("warehouse.sql", "stats_tables.sql", "fetch.sql")
    )


def connect(path: Path | str, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open the warehouse; a writable connection creates the file and any missing tables."""
    path = Path(path)
    if read_only:
        if not path.exists():
            raise WarehouseMissing(f"no warehouse at {path}: run `featurehouse ingest` first")
        return duckdb.connect(str(path), read_only=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = duckdb.connect(str(path))
    conn.execute(_ddl())
    return conn
