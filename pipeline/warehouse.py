"""The DuckDB warehouse file: open it, create its tables, one writer at a time."""

from __future__ import annotations

import os
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


#: Rows per row group in the warehouse file (a multiple of DuckDB's vector size, 2048).
ROW_GROUP_SIZE = 2048


def connect(path: Path | str, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open the warehouse; a writable connection creates the file and any missing tables."""
    path = Path(path)
    if read_only:
        if not path.exists():
            raise WarehouseMissing(f"no warehouse at {path}: run `featurehouse ingest` first")
        return duckdb.connect(str(path), read_only=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Attached with small row groups: a batch (~10,000 activations, each a long list) then fills
    # whole row groups, which DuckDB writes straight to the file at commit instead of through
    # the WAL and a second time at checkpoint. Halves the write cost of a load (see bench/).
    # The memory cap bounds DuckDB's buffer pool, which otherwise grows with the warehouse.
    conn = duckdb.connect(config={
        "memory_limit": os.environ.get("FEATUREHOUSE_DUCKDB_MEMORY", "1GB"),
        "temp_directory": f"{path}.tmp",  # spills go beside the warehouse, not into the cwd
    })
    quoted = str(path).replace("'", "''")
    conn.execute(f"ATTACH '{quoted}' AS warehouse (ROW_GROUP_SIZE {ROW_GROUP_SIZE})")
    conn.execute("USE warehouse")
    conn.execute(_ddl())
    return conn
