"""Load stage: upsert a validated, staged batch into the warehouse tables, in one transaction."""

from __future__ import annotations

from datetime import datetime, timezone

import duckdb
import pyarrow as pa

from .records import ARROW_SCHEMAS

__all__ = ["UPSERT_KEYS", "passed", "upsert_staged", "insert_rows", "utcnow"]

#: The natural key each loaded table is upserted by.
UPSERT_KEYS: dict[str, tuple[str, ...]] = {
    "models": ("model_id",),
    "source_sets": ("model_id", "source_set_name"),
    "sources": ("model_id", "source_id"),
    "features": ("model_id", "source_id", "feature_index"),
    "activations": ("activation_id",),
    "explanations": ("explanation_id",),
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def passed(table: str) -> str:
    """FROM clause of the batch's staged ``table`` records that passed every expectation
    (``failed_rows(tbl, _row)`` lists those quarantined)."""
    return f"FROM stage_{table} WHERE _row NOT IN (SELECT _row FROM failed_rows WHERE tbl = '{table}')"


def upsert_staged(conn: duckdb.DuckDBPyConnection, table: str, now: datetime,
                  run_id: str | None = None) -> dict[str, int]:
    """Upsert the staged records of ``table`` that passed validation; return loaded counts per input.

    Rows whose key is staged are replaced, then the staged rows inserted by column name, with
    ``loaded_at`` (and ``run_id`` for data tables). The caller holds the transaction. A delete +
    insert keeps the large tables free of indexes, which DuckDB would otherwise maintain on
    every load; on an empty table the delete is skipped.
    """
    cols = ", ".join(f'"{f.name}"' for f in ARROW_SCHEMAS[table])
    good = passed(table)
    params: dict = {"now": now}
    meta = "input_sha256, $now AS loaded_at"
    if run_id is not None:
        params["run_id"] = run_id
        meta += ", $run_id AS run_id"
    if conn.execute(f"SELECT EXISTS (FROM {table})").fetchone()[0]:
        cond = " AND ".join(f"t.{k} = s.{k}" for k in UPSERT_KEYS[table])
        conn.execute(f"DELETE FROM {table} AS t USING (SELECT * {good}) AS s WHERE {cond}")
    conn.execute(f"INSERT INTO {table} BY NAME SELECT {cols}, {meta} {good}", params)
    return dict(conn.execute(f"SELECT input_sha256, count(*) {good} GROUP BY 1").fetchall())


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
