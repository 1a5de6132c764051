"""Materialise stage: refresh the activation statistics tables (and the by-token table) for
features that changed."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import duckdb

from ..config import SCHEMAS_DIR, Settings
from ..lake.warehouse import CATALOG, one_snapshot, transaction

__all__ = ["EXCERPT", "MaterialiseResult", "compute_changed", "excerpt_columns", "excerpt_from", "forget_computed",
           "refresh", "refresh_changed", "refresh_run"]


@dataclass(frozen=True)
class MaterialiseResult:
    """How much of each aggregate table was rebuilt."""

    n_features: int
    n_sources: int
    feature_stats_rows: int
    source_stats_rows: int
    unchanged: bool = False
    """The tables already held what it computed: nothing was committed (no new snapshot)."""

    def as_dict(self) -> dict:
        return asdict(self)


def _sql(name: str) -> str:
    return (SCHEMAS_DIR / "sql" / f"{name}.sql").read_text()


def refresh(conn: duckdb.DuckDBPyConnection, settings: Settings, run_id: str | None = None) -> MaterialiseResult:
    """Recompute the statistics of the features a run changed (``run_id``), or of every
    feature (None), and of their sources: one transaction, one snapshot.

    A run's features come from the snapshots it committed, so a crash between load and
    materialise is mended by running this again, and a later run that reloaded some of them
    does not hide them.
    """
    def changed(conn: duckdb.DuckDBPyConnection) -> None:
        if run_id is None:
            conn.execute(
                """CREATE OR REPLACE TEMP TABLE changed_features AS
                   SELECT DISTINCT model_id, source_id, feature_index FROM activations
                   UNION SELECT model_id, source_id, feature_index FROM features
                   UNION SELECT model_id, source_id, feature_index FROM feature_activation_stats"""
            )
        else:
            conn.execute(f"CREATE OR REPLACE TEMP TABLE changed_features AS {_run_features(conn, run_id)}",
                         {"run_id": run_id})

    def body(conn: duckdb.DuckDBPyConnection) -> MaterialiseResult:
        changed(conn)
        return refresh_changed(conn)

    # First, reading only: are the statistics as they would be computed? Then nothing is
    # committed (a new snapshot of identical rows made every find index say it was stale).
    with one_snapshot(conn):
        changed(conn)
        same = _as_computed(conn)
    if same is not None:
        return same
    return transaction(conn, settings, body, message=f"materialise {run_id or 'all'}",
                       extra={"run_id": run_id} if run_id else {})


def _as_computed(conn: duckdb.DuckDBPyConnection) -> MaterialiseResult | None:
    """What a refresh of ``changed_features`` would report, when the statistics tables hold
    exactly what it would write (``refreshed_at`` aside); None when anything differs."""
    try:
        r_f = compute_changed(conn)  # into temp new_* tables
        conn.execute("CREATE OR REPLACE TEMP TABLE changed_sources AS "
                     "SELECT DISTINCT model_id, source_id FROM changed_features")
        # (from the feature statistics held: when they differ from the new ones, this is not looked at)
        conn.execute(f"CREATE OR REPLACE TEMP TABLE new_source_activation_stats AS {_sql('source_activation_stats')}")
        scopes = {"feature_activation_stats": ("changed_features", _KEY),
                  "feature_token_stats": ("changed_features", _KEY),
                  "source_activation_stats": ("changed_sources", "model_id, source_id")}
        for table, (scope, key) in scopes.items():
            held = f"SELECT * EXCLUDE (refreshed_at) FROM {table} SEMI JOIN {scope} USING ({key})"
            new = f"SELECT * EXCLUDE (refreshed_at) FROM new_{table}"
            (n,) = conn.execute(f"SELECT count(*) FROM (({new} EXCEPT ALL {held}) UNION ALL "
                                f"({held} EXCEPT ALL {new}))").fetchone()
            if n:
                return None
        (n_f,) = conn.execute(f"SELECT count(*) FROM (SELECT DISTINCT {_KEY} FROM changed_features)").fetchone()
        (n_s, r_s) = conn.execute("SELECT count(DISTINCT (model_id, source_id)), count(*) "
                                  "FROM new_source_activation_stats").fetchone()
        return MaterialiseResult(n_f, n_s, r_f, r_s, unchanged=True)
    finally:
        forget_computed(conn)
        conn.execute("DROP TABLE IF EXISTS temp.main.new_source_activation_stats")


def _run_features(conn: duckdb.DuckDBPyConnection, run_id: str) -> str:
    """The features ``run_id`` changed: from the change feed of its snapshots while they are
    kept, and from the captures it loaded (which outlive expired snapshots)."""
    (first, last) = conn.execute(
        f"""SELECT min(snapshot_id), max(snapshot_id) FROM {CATALOG}.snapshots()
            WHERE TRY_CAST(commit_extra_info AS JSON)->>'run_id' = $run_id""", {"run_id": run_id}
    ).fetchone()
    parts = ["SELECT model_id, source_id, feature_index FROM feature_captures WHERE run_id = $run_id"]
    if first is not None:
        for t in ("features", "activations", "explanations"):
            parts.append(
                f"""SELECT model_id, source_id, feature_index
                    FROM ducklake_table_changes('{CATALOG}', 'main', '{t}', {int(first)}, {int(last)})
                    WHERE snapshot_id IN (SELECT snapshot_id FROM {CATALOG}.snapshots()
                                          WHERE TRY_CAST(commit_extra_info AS JSON)->>'run_id' = $run_id)"""
            )
    return " UNION ".join(parts)


STATS_CHUNK_FEATURES = 500
"""Features whose statistics are computed in one statement (bounds DuckDB's memory)."""

_KEY = "model_id, source_id, feature_index"

#: What the statistics need of one activation (an excerpt): its token count, and only its active
#: (token, value) pairs, a few percent of its tokens. Computed in one pass over the rows: inside a
#: load, in the same pass as the validation checks (``validate``: ``stage_activation_checks``).
#: The active tokens' count and sum are the pairs' (``feature_activation_stats.sql``), not two
#: more passes over the values: 0.79 → 0.53 CPU-s over a source's 131,072 excerpts of 128
#: tokens (one thread, 2026-12-07).
EXCERPT: tuple[tuple[str, str], ...] = (
    ("model_id", "model_id"),
    ("source_id", "source_id"),
    ("feature_index", "feature_index"),
    ("data_source", "data_source"),
    ("max_value", "max_value"),
    ("n_tokens", "len(tokens)"),
    ("active_pairs", """list_transform(list_filter(list_zip(tokens, "values"), p -> p[2] > 0),
                                  p -> {'token': p[1], 'value': p[2]})"""),
    ("peak_token", """CASE WHEN "values"[max_value_token_index + 1] > 0
                           THEN tokens[max_value_token_index + 1] END"""),
)


def excerpt_columns(prefix: str = "") -> str:
    """The SELECT list of :data:`EXCERPT` over activation rows, each named ``prefix`` + name."""
    return ", ".join(f"{expr} AS {prefix}{name}" for name, expr in EXCERPT)


def excerpt_from(prefix: str) -> str:
    """The SELECT list that reads back excerpt columns stored under ``prefix``."""
    return ", ".join(f"{prefix}{name} AS {name}" for name, _ in EXCERPT)


_EXCERPT_COLUMNS = excerpt_columns()


#: The per-feature statistics tables, and which of their rows a refresh replaces.
_FEATURE_STATS = ("feature_activation_stats", "feature_token_stats")
_CHANGED = "f.model_id = c.model_id AND f.source_id = c.source_id AND f.feature_index = c.feature_index"


def stats_without_rows(conn: duckdb.DuckDBPyConnection) -> frozenset[str]:
    """The per-feature statistics tables that hold no row of a feature in ``changed_features``
    (new features): a refresh has nothing to delete there (see ``refresh_changed``)."""
    return frozenset(table for table in _FEATURE_STATS if not conn.execute(
        f"SELECT EXISTS (SELECT 1 FROM {table} f, changed_features c WHERE {_CHANGED})").fetchone()[0])


def refresh_changed(conn: duckdb.DuckDBPyConnection, sources: bool = True, *,
                    staged: tuple[str, str, str] | None = None, computed: bool = False,
                    nothing_to_delete: frozenset[str] = frozenset()) -> MaterialiseResult:
    """Recompute stats for the features in the temp table ``changed_features(model_id,
    source_id, feature_index)`` and, with ``sources``, for their sources. The caller holds the
    transaction (ingest calls this inside each batch's load, so stats always match what is
    committed).

    ``staged``, inside a load, is three queries: the excerpts (:data:`EXCERPT` columns) of the
    batch's activations that now make up their features, those features' keys, and the ids of
    the activations the batch takes (from whichever feature holds them). Their stats are
    computed from the staged rows in memory instead of reading back what the load just wrote;
    the other changed features are read from the table.

    ``computed``: the features' statistics are already in hand (:func:`compute_changed`, run
    before the commit lock against the snapshot this transaction still reads): only replace
    their rows. ``nothing_to_delete``: tables found then to hold none of their rows
    (:func:`stats_without_rows`), whose delete is not run again.

    Without ``sources``, the returned source rows are 0: none were written.
    """
    conn.execute(
        "CREATE OR REPLACE TEMP TABLE changed_sources AS "
        "SELECT DISTINCT model_id, source_id FROM changed_features"
    )
    # The changed features' (and sources') rows are all deleted, so the rows inserted are the
    # rows they now have: counted as inserted, not read back from the lake (a scan of the table
    # each, ~10 ms a statement in a load's transaction).
    for table in _FEATURE_STATS:
        if table not in nothing_to_delete:
            conn.execute(f"DELETE FROM {table} f USING changed_features c WHERE {_CHANGED}")
    if computed:
        (r_f,) = conn.execute("INSERT INTO feature_activation_stats BY NAME "
                              "SELECT * FROM new_feature_activation_stats").fetchone()
        conn.execute("INSERT INTO feature_token_stats BY NAME SELECT * FROM new_feature_token_stats")
    else:  # chunk by chunk into the tables (a whole warehouse's never all in memory)
        r_f = compute_changed(conn, staged=staged, into="")
    if sources:
        conn.execute(
            "DELETE FROM source_activation_stats s USING changed_sources c "
            "WHERE s.model_id = c.model_id AND s.source_id = c.source_id"
        )
        (r_s,) = conn.execute(f"INSERT INTO source_activation_stats BY NAME ({_sql('source_activation_stats')})").fetchone()
    else:
        r_s = 0  # none written (the caller refreshes the sources later)
    (n_f,) = conn.execute(
        "SELECT count(*) FROM (SELECT DISTINCT model_id, source_id, feature_index FROM changed_features)"
    ).fetchone()
    (n_s,) = conn.execute("SELECT count(*) FROM changed_sources").fetchone()
    return MaterialiseResult(n_f, n_s, r_f, r_s)


def compute_changed(conn: duckdb.DuckDBPyConnection, *, staged: tuple[str, str, str] | None = None,
                    into: str = "new_") -> int:
    """The statistics rows of the features in ``changed_features``, inserted into the tables
    named ``into`` + ``feature_activation_stats`` / ``feature_token_stats``: by default the
    temp tables ``new_...`` it makes (a load computes them before it takes the commit lock,
    reading only, and its commit then just replaces the rows: ``refresh_changed(computed=True)``);
    with ``into=""`` the warehouse's own, where the caller deleted the features' rows. See
    :func:`refresh_changed` for ``staged``. Returns the feature rows inserted."""
    # The features are computed in chunks of STATS_CHUNK_FEATURES: ranking every active token
    # of a whole export batch (thousands of features) at once ran out of DuckDB's memory.
    conn.execute(f"""CREATE OR REPLACE TEMP TABLE stats_chunks AS
                     SELECT *, (row_number() OVER (ORDER BY {_KEY}) - 1) // $size AS chunk
                     FROM (SELECT DISTINCT {_KEY} FROM changed_features)""",
                 {"size": STATS_CHUNK_FEATURES})
    conn.execute("CREATE OR REPLACE TEMP TABLE stats_chunk AS SELECT * EXCLUDE (chunk) FROM stats_chunks LIMIT 0")
    if staged is None:
        # a chunk's activations read from the table (it may hold millions: never all at once)
        conn.execute(f"""CREATE OR REPLACE TEMP VIEW stats_activations AS
                         SELECT {_EXCERPT_COLUMNS} FROM activations SEMI JOIN stats_chunk USING ({_KEY})""")
    else:
        # A batch (bounded by the batch limits) comes reduced to its excerpts; each chunk then
        # reads that small table, not the batch's token and value lists once per chunk (which
        # took 45 of 124 s of a 1 GiB export batch). A feature the batch takes activations from
        # is read from the table without them (before the commit they are still there).
        rows, keys, taken = staged
        conn.execute(f"""CREATE OR REPLACE TEMP TABLE stats_excerpts AS
                         SELECT * FROM ({rows}) AS r
                         SEMI JOIN stats_chunks USING ({_KEY})
                         UNION ALL
                         SELECT {_EXCERPT_COLUMNS} FROM activations
                         SEMI JOIN (SELECT {_KEY} FROM stats_chunks EXCEPT {keys}) USING ({_KEY})
                         WHERE activation_id NOT IN ({taken})""")
        conn.execute(f"""CREATE OR REPLACE TEMP VIEW stats_activations AS
                         SELECT * FROM stats_excerpts SEMI JOIN stats_chunk USING ({_KEY})""")
    if into:  # made from the queries with no chunk selected: no rows, the columns and types they give
        for table in ("feature_activation_stats", "feature_token_stats"):
            conn.execute(f"CREATE OR REPLACE TEMP TABLE {into}{table} AS ({_sql(table)})")
    (n_chunks,) = conn.execute("SELECT coalesce(max(chunk) + 1, 0) FROM stats_chunks").fetchone()
    r_f = 0
    for chunk in range(n_chunks):
        conn.execute("DELETE FROM stats_chunk")
        conn.execute("INSERT INTO stats_chunk SELECT * EXCLUDE (chunk) FROM stats_chunks WHERE chunk = ?", [chunk])
        r_f += conn.execute(f"INSERT INTO {into}feature_activation_stats BY NAME "
                            f"({_sql('feature_activation_stats')})").fetchone()[0]
        conn.execute(f"INSERT INTO {into}feature_token_stats BY NAME ({_sql('feature_token_stats')})")
    conn.execute("DROP TABLE IF EXISTS temp.main.stats_excerpts")
    return r_f


def forget_computed(conn: duckdb.DuckDBPyConnection) -> None:
    """Drop what :func:`compute_changed` made (a large export batch's token rows are many)."""
    for table in ("new_feature_activation_stats", "new_feature_token_stats"):
        conn.execute(f"DROP TABLE IF EXISTS temp.main.{table}")


def refresh_run(where: Settings | str, run_id: str | None = None) -> MaterialiseResult:
    """Open the warehouse (Settings or folder) and :func:`refresh` a run's features (or all)."""
    from ..lake import warehouse

    settings = warehouse.settings_for(where)
    with warehouse.connect(settings) as conn:
        return refresh(conn, settings, run_id)
