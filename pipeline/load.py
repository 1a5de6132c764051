"""Load stage: upsert a validated batch into DuckDB through Arrow, in one transaction."""

from __future__ import annotations

from datetime import datetime, timezone

import duckdb
import pyarrow as pa

__all__ = ["UPSERT_KEYS", "upsert", "insert_rows", "utcnow"]

#: The natural key each loaded table is upserted by.
UPSERT_KEYS: dict[str, tuple[str, ...]] = {
    "models": ("model_id",),
    "source_sets": ("model_id", "source_set_name"),
    "sources": ("model_id", "source_id"),
    "features": ("model_id", "source_id", "feature_index"),
    "activations": ("activation_id",),
    "explanations": ("explanation_id",),
    "raw_inputs": ("input_sha256",),
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def upsert(conn: duckdb.DuckDBPyConnection, table: str, rows: pa.Table) -> int:
    """Replace rows of ``table`` whose key is in ``rows``, then insert ``rows``, by column name.

    The caller holds the transaction. A delete + insert keeps the large tables free of
    indexes, which DuckDB would otherwise maintain on every load.
    """
    if rows.num_rows == 0:
        return 0
    keys = UPSERT_KEYS[table]
    conn.register("_upsert_rows", rows)
    try:
        cond = " AND ".join(f"t.{k} = s.{k}" for k in keys)
        conn.execute(f"DELETE FROM {table} AS t USING _upsert_rows AS s WHERE {cond}")
        conn.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _upsert_rows")
    finally:
        conn.unregister("_upsert_rows")
    return rows.num_rows


def insert_rows(conn: duckdb.DuckDBPyConnection, table: str, rows: list[dict]) -> int:
    """Append small bookkeeping rows (quarantine, results) through Arrow, by column name."""
    if not rows:
        return 0
    conn.register("_append_rows", pa.Table.from_pylist(rows))
    try:
        conn.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _append_rows")
    finally:
        conn.unregister("_append_rows")
    return len(rows)
