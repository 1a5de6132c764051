"""Materialise stage: refresh the activation statistics tables for features that changed."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import duckdb

from .config import SCHEMAS_DIR

__all__ = ["MaterialiseResult", "refresh", "refresh_changed"]


@dataclass(frozen=True)
class MaterialiseResult:
    """How much of each aggregate table was rebuilt."""

    n_features: int
    n_sources: int
    feature_stats_rows: int
    source_stats_rows: int

    def as_dict(self) -> dict:
        return asdict(self)


def _sql(name: str) -> str:
    return (SCHEMAS_DIR / "sql" / f"{name}.sql").read_text()


def refresh(conn: duckdb.DuckDBPyConnection, run_id: str | None = None) -> MaterialiseResult:
    """Recompute stats for the features a run loaded (``run_id``), or for all features (None).

    The features changed by a run are derived from the rows it wrote, so a crash between load
    and materialise is mended by running this again. One transaction.
    """
    where = "WHERE run_id = $run_id" if run_id is not None else ""
    params = {"run_id": run_id} if run_id is not None else {}
    conn.execute("BEGIN TRANSACTION")
    try:
        conn.execute(
            f"""CREATE OR REPLACE TEMP TABLE changed_features AS
                SELECT DISTINCT model_id, source_id, feature_index FROM activations {where}
                UNION
                SELECT DISTINCT model_id, source_id, feature_index FROM features {where}""",
            params,
        )
        result = refresh_changed(conn)
        conn.execute("COMMIT")
    except Exception:
        conn.execute("ROLLBACK")
        raise
    return result


def refresh_changed(conn: duckdb.DuckDBPyConnection) -> MaterialiseResult:
    """Recompute stats for the features in the temp table ``changed_features(model_id,
    source_id, feature_index)`` and for their sources. The caller holds the transaction (ingest
    calls this inside each batch's load, so stats always match what is committed)."""
    conn.execute(
        "CREATE OR REPLACE TEMP TABLE changed_sources AS "
        "SELECT DISTINCT model_id, source_id FROM changed_features"
    )
    conn.execute(
        "DELETE FROM feature_activation_stats f USING changed_features c "
        "WHERE f.model_id = c.model_id AND f.source_id = c.source_id "
        "AND f.feature_index = c.feature_index"
    )
    conn.execute(f"INSERT INTO feature_activation_stats BY NAME ({_sql('feature_activation_stats')})")
    conn.execute(
        "DELETE FROM source_activation_stats s USING changed_sources c "
        "WHERE s.model_id = c.model_id AND s.source_id = c.source_id"
    )
    conn.execute(f"INSERT INTO source_activation_stats BY NAME ({_sql('source_activation_stats')})")
    (n_f,) = conn.execute("SELECT count(*) FROM changed_features").fetchone()
    (n_s,) = conn.execute("SELECT count(*) FROM changed_sources").fetchone()
    (r_f,) = conn.execute(
        "SELECT count(*) FROM feature_activation_stats SEMI JOIN changed_features "
        "USING (model_id, source_id, feature_index)"
    ).fetchone()
    (r_s,) = conn.execute(
        "SELECT count(*) FROM source_activation_stats SEMI JOIN changed_sources USING (model_id, source_id)"
    ).fetchone()
    return MaterialiseResult(n_f, n_s, r_f, r_s)
