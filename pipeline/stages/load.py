"""Load stage: a validated, staged batch into the warehouse, each feature capture as a snapshot.

A feature page is a snapshot of its feature: loading one replaces that feature's row, its
activations and its explanations, so rows missing from the new capture are gone from the
current tables. A bulk-export batch of features, activations or explanations replaces, for
each feature it holds, that feature's rows of its own table only (a source's three kinds of
export batches number features differently and arrive separately).

Which capture of each feature loads (the newest; ties to the larger input digest), and which
feature keeps an activation or explanation id, is decided in ``captures.py``; this module writes
what it decided: the rows as Parquet files before the commit lock (``prewrite``), the catalog
under it (``replace_staged``), each input's claims (``record_captures``, for ``settle_again``)
and the reference tables.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

import duckdb
import pyarrow as pa

from ..lake.maintain import pending_name
from ..lake.warehouse import CATALOG, data_path, literal, one_snapshot, utcnow
from .captures import (
    _FEATURE_KEY,
    _ROW_IDS,
    DATA_TABLES,
    _on,
    _plan,
    moved_ids,
)
from .materialise import compute_changed, excerpt_from, stats_without_rows
from .records import ARROW_SCHEMAS

log = logging.getLogger(__name__)

__all__ = [
    "REFERENCE_KEYS", "STAGED_ACTIVATIONS", "replace_staged", "upsert_reference", "insert_rows", "utcnow",
    "record_captures", "Prewritten", "prewrite", "prestats", "mark_changed_features", "changed_reference",
    "forget_decided",
]

#: The natural key of each reference table (models, source sets, sources): replaced by key when
#: their content changes, left alone (no new snapshot data) when it does not.
REFERENCE_KEYS: dict[str, tuple[str, ...]] = {
    "models": ("model_id",),
    "source_sets": ("model_id", "source_set_name"),
    "sources": ("model_id", "source_id"),
}

#: Once a batch has decided what it loads: its activations that make up their features, those
#: features' keys, and the ids it takes (what ``materialise.refresh_changed(staged=...)`` takes).
STAGED_ACTIVATIONS = (
    # the excerpts the validation pass computed beside its checks (validate.ACTIVATION_CHECKS)
    f"SELECT {excerpt_from('x_')} FROM stage_activation_checks JOIN incoming_activations USING (_row)",
    # every feature whose capture of activations applies: its rows are all in the query above
    # (none, for a capture that brings none), never in the table
    "SELECT DISTINCT model_id, source_id, feature_index FROM applied WHERE table_name = 'activations'",
    "SELECT activation_id FROM incoming_activations",
)


def record_captures(conn: duckdb.DuckDBPyConnection, now: datetime, run_id: str,
                    prewritten: Prewritten | None = None) -> None:
    """Record what each input the batch parsed holds (``batch_captures``, from ``claim_captures``)
    in ``input_captures``, replacing what an earlier parse of it recorded."""
    delete(conn, "input_captures", prewritten)
    conn.execute("""INSERT INTO input_captures BY NAME
                    SELECT c.*, $run_id AS run_id, $now AS recorded_at FROM batch_captures c
                    WHERE input_sha256 IN (SELECT input_sha256 FROM batch_inputs)""",
                 {"now": now, "run_id": run_id})


@dataclass
class Prewritten:
    """A batch's rows written as Parquet files before the commit lock is taken (``prewrite``):
    the locked commit adds them to the catalog (``ducklake_add_data_files``) instead of writing
    them, when what it decides against the latest snapshot is what they were written for."""

    snapshot: int
    """The snapshot the rows were decided against."""
    has_rows: dict[str, bool] = field(default_factory=dict)
    """Whether each table held rows at that snapshot."""
    files: dict[str, str] = field(default_factory=dict)
    """table → the Parquet file of its incoming rows (a table with none has no file)."""
    used: set[str] = field(default_factory=set)
    """Tables whose file the last commit attempt added."""
    reference: dict[str, int] = field(default_factory=dict)
    """Reference table → how many of its staged rows change it (:func:`changed_reference`)."""
    stats: bool = False
    """Whether the statistics of the features it changes were computed against ``snapshot``
    (:func:`prestats`)."""
    stood: bool = False
    """Whether the last commit attempt found ``snapshot`` still the latest: its plan stood."""
    empty: set[str] = field(default_factory=set)
    """The commit's deletes (by name, see :func:`delete`; the statistics tables', see
    :func:`prestats`) that found nothing to delete at ``snapshot``: skipped while the plan
    stands. Each is a scan of a table (its files read back, from S3 when deployed) that would
    otherwise run under the commit lock."""

    def skipped(self) -> frozenset[str]:
        """The deletes this commit attempt skips: those found empty, if the plan stood."""
        return frozenset(self.empty) if self.stood else frozenset()

    def unused(self) -> list[str]:
        return [path for table, path in self.files.items() if table not in self.used]


def _table_folders(conn: duckdb.DuckDBPyConnection, tables: list[str]) -> dict[str, str]:
    """The folder DuckLake writes each of ``tables``' data files in (under the lake's data path
    as it is open), so a file added from there is recorded relative to it, as DuckLake's own are."""
    if not tables:
        return {}
    meta = f"__ducklake_metadata_{CATALOG}"
    rows = conn.execute(f"""
        SELECT t.table_name, s.path, s.path_is_relative, t.path, t.path_is_relative
        FROM {meta}.ducklake_table t JOIN {meta}.ducklake_schema s USING (schema_id)
        WHERE list_contains(?, t.table_name) AND s.schema_name = 'main' AND t.end_snapshot IS NULL
          AND s.end_snapshot IS NULL""", [tables]).fetchall()
    base = data_path(conn)
    folders = {}
    for table, schema_path, schema_rel, table_path, table_rel in rows:
        schema = base.rstrip("/") + "/" + schema_path.lstrip("/") if schema_rel else schema_path
        folder = schema.rstrip("/") + "/" + table_path.lstrip("/") if table_rel else table_path
        folders[table] = folder.rstrip("/") + "/"
    return folders


def _rows_sql(conn: duckdb.DuckDBPyConnection, table: str, now: datetime, run_id: str) -> str:
    """The batch's incoming rows of ``table`` with exactly the table's columns and types, in its
    order (a file DuckLake adds must have them)."""
    staged = {f.name for f in ARROW_SCHEMAS[table]} | {"input_sha256"}
    meta = {"captured_at": "i.captured_at_", "loaded_at": literal(now),
            "run_id": literal(run_id)}
    cols = []
    for name, sql_type, *_ in conn.execute(f"DESCRIBE {table}").fetchall():
        expr = f's."{name}"' if name in staged else meta.get(name, "NULL")
        cols.append(f'CAST({expr} AS {sql_type}) AS "{name}"')
    return f"SELECT {', '.join(cols)} FROM stage_{table} s JOIN incoming_{table} i USING (_row)"


def _deletion(name: str) -> tuple[str, str, str]:
    """The commit's delete called ``name``: (its table, what it joins — a ``USING`` list, or
    nothing —, its condition on the table's rows ``t``). A data table's: the rows the batch's
    loading captures replace; the others: what a feature's new capture, or an input parsed
    again, replaces."""
    if name in DATA_TABLES:
        claims = f"(SELECT * FROM applied WHERE table_name = '{name}')"
        row_id = _ROW_IDS.get(name)
        if row_id:
            return name, "", (f"t.{row_id} IN (SELECT {row_id} FROM incoming_{name}) "
                              f"OR EXISTS (SELECT 1 FROM {claims} a WHERE {_on('a', 't')})")
        return name, f"{claims} AS a", _on("t", "a")
    if name == "feature_captures":
        return name, "applied AS a", _on("t", "a", (*_FEATURE_KEY, "table_name"))
    if name == "input_captures":
        return name, "", "t.input_sha256 IN (SELECT input_sha256 FROM batch_inputs)"
    if name in ("quarantine", "raw_inputs"):  # the batch's inputs, as the $shas parameter
        return name, "", "list_contains($shas, t.input_sha256)"
    raise KeyError(name)


def delete(conn: duckdb.DuckDBPyConnection, name: str, plan: Prewritten | None = None,
           params: dict | None = None) -> None:
    """Run the commit's delete ``name`` (see :func:`_deletion`), unless ``plan`` found before the
    lock that it deletes nothing (:func:`probe`) and still stands."""
    if plan is not None and name in plan.skipped():
        return
    table, using, where = _deletion(name)
    conn.execute(f"DELETE FROM {table} AS t {'USING ' + using if using else ''} WHERE {where}", params)


def probe(conn: duckdb.DuckDBPyConnection, plan: Prewritten, names, params: dict | None = None) -> None:
    """Before the lock, against ``plan``'s snapshot: note in ``plan.empty`` which of the commit's
    deletes ``names`` would delete nothing (they are skipped if the plan stands)."""
    for name in names:
        table, using, where = _deletion(name)
        if not conn.execute(f"SELECT EXISTS (SELECT 1 FROM {table} AS t{', ' + using if using else ''} "
                            f"WHERE {where})", params).fetchone()[0]:
            plan.empty.add(name)


def _snapshot(conn: duckdb.DuckDBPyConnection) -> int:
    return conn.execute(f"SELECT id FROM {CATALOG}.current_snapshot()").fetchone()[0]


def prewrite(conn: duckdb.DuckDBPyConnection, now: datetime, run_id: str, *, reprocess: bool = False,
             inputs: list[str] | None = None, on_write: Callable[[], None] | None = None) -> Prewritten:
    """Before the commit lock: decide against the latest snapshot what the batch loads, and
    write those rows of each data table to a Parquet file in the table's folder. The rows are
    not visible to anyone until a commit adds the file; a file no commit adds (the decision
    changed, or the writer died) is an orphan, which ``maintain`` deletes after its grace.
    Also finds which of the commit's deletes have nothing to delete (:func:`probe`); with
    ``inputs`` (the batch's input digests), the inputs' earlier records too. ``on_write`` is
    called as the files' write (one statement per table, without the GIL) begins."""
    with one_snapshot(conn):  # what it decides, it decides against one snapshot: the one it records
        plan = Prewritten(snapshot=_snapshot(conn))
        plan.has_rows = _plan(conn, reprocess)
        plan.reference = {table: changed_reference(conn, table) for table in REFERENCE_KEYS}
        probe(conn, plan, [t for t in DATA_TABLES if plan.has_rows[t]] + ["feature_captures", "input_captures"])
        if inputs is not None:
            probe(conn, plan, ["quarantine", "raw_inputs"], {"shas": inputs})
        writing = []
        for table in DATA_TABLES:
            conn.execute(f"CREATE OR REPLACE TEMP TABLE planned_{table} AS SELECT _row, captured_at_ FROM incoming_{table}")
            if conn.execute(f"SELECT EXISTS (FROM incoming_{table})").fetchone()[0]:
                writing.append(table)
        folders = _table_folders(conn, writing)
        if on_write is not None:
            on_write()
        for table in writing:
            folder = folders[table]
            if "://" not in folder:
                os.makedirs(folder, exist_ok=True)  # DuckLake makes a table's folder at its first write
            path = f"{folder}{pending_name(run_id)}"
            conn.execute(f"COPY ({_rows_sql(conn, table, now, run_id)}) TO {literal(path)} "
                         f"(FORMAT parquet, ROW_GROUP_SIZE {_ROW_GROUP_SIZE}, COMPRESSION zstd)")
            plan.files[table] = path
    return plan


#: As the lake's ``parquet_row_group_size`` option (migration 0001): small groups, so that a
#: query for a few features reads a few groups. Compressed with zstd, not DuckLake's default
#: snappy: a batch's activations file wrote faster (0.53-0.64 s against 0.70-0.88 s for 200
#: pages, 2026-12-02) and smaller; readers take either, file by file. (Written without keeping
#: the rows' order, ``PRESERVE_ORDER false``, a gigabyte export batch took as long: 0.99 of the
#: wall, three alternating pairs, 2026-12-03.)
_ROW_GROUP_SIZE = 2048


def mark_changed_features(conn: duckdb.DuckDBPyConnection, has_rows: bool) -> None:
    """The features whose activation statistics the batch changes, in the temp table
    ``changed_features``: those it loads activations of, and (``has_rows``: the table holds
    some) those that hold an activation id it brings, which they lose to it."""
    conn.execute("CREATE OR REPLACE TEMP TABLE changed_features AS SELECT DISTINCT model_id, source_id, "
                 "feature_index FROM applied WHERE table_name = 'activations'")
    if has_rows:
        conn.execute(f"""
            INSERT INTO changed_features
            SELECT DISTINCT t.model_id, t.source_id, t.feature_index FROM activations t
            WHERE t.activation_id IN (SELECT activation_id FROM incoming_activations)
              AND NOT EXISTS (SELECT 1 FROM applied a WHERE a.table_name = 'activations' AND {_on('a', 't')})""")


def prestats(conn: duckdb.DuckDBPyConnection, prewritten: Prewritten) -> bool:
    """Before the commit lock: the statistics of the features the batch changes, computed
    against the snapshot ``prewritten`` was decided against (``materialise.compute_changed``),
    so that the commit only replaces their rows when that snapshot is still the latest
    (``prewritten.stood``). False, computing nothing, when a commit came in between."""
    with one_snapshot(conn):
        if _snapshot(conn) != prewritten.snapshot:
            return False
        mark_changed_features(conn, prewritten.has_rows["activations"])
        compute_changed(conn, staged=STAGED_ACTIVATIONS)
        prewritten.empty |= stats_without_rows(conn)
    prewritten.stats = True
    return True


def _as_planned(conn: duckdb.DuckDBPyConnection, table: str) -> bool:
    """Whether ``incoming_<table>`` (decided now) holds exactly the rows planned before."""
    return conn.execute(f"""
        SELECT NOT EXISTS (SELECT _row, captured_at_ FROM incoming_{table} EXCEPT SELECT * FROM planned_{table})
           AND NOT EXISTS (SELECT * FROM planned_{table} EXCEPT SELECT _row, captured_at_ FROM incoming_{table})""").fetchone()[0]


def _still_there(conn: duckdb.DuckDBPyConnection, path: str) -> bool:
    """Whether the prewritten file is there (a folder or an S3 prefix: DuckDB lists it)."""
    return conn.execute("SELECT count(*) FROM glob(?)", [path]).fetchone()[0] > 0


def replace_staged(conn: duckdb.DuckDBPyConnection, now: datetime, run_id: str, *,
                   reprocess: bool = False, prewritten: Prewritten | None = None) -> tuple[dict[str, dict[str, int]], list[dict]]:
    """Replace, for every capture that applies, its feature's rows; the caller holds the
    transaction (and the commit lock).

    With ``prewritten`` (see :func:`prewrite`), a table's rows are added from their file when
    what is decided now is what the file was written for, and written here otherwise.

    Returns the rows loaded per table and input, and the captures superseded by an already
    loaded newer one. Leaves the features whose activations changed in the temp table
    ``changed_features``, and the rows that loaded in ``incoming_<table>`` (see
    :data:`STAGED_ACTIVATIONS`).
    """
    stood = prewritten is not None and prewritten.snapshot == _snapshot(conn)
    if stood:
        has = prewritten.has_rows  # nothing was committed since: the plan made then stands
    else:
        has = _plan(conn, reprocess)
    if prewritten is not None:
        prewritten.used, prewritten.stood = set(), stood
    mark_changed_features(conn, has["activations"])
    moved = moved_ids(conn, has)  # (before the deletes: who held the ids)
    loaded: dict[str, dict[str, int]] = {}
    for table in DATA_TABLES:
        incoming = f"incoming_{table}"
        if has[table]:
            delete(conn, table, prewritten)
        path = prewritten.files.get(table) if prewritten is not None else None
        # a file that is gone (deleted as an orphan by a maintenance that did not know its run
        # was live, or by hand) is not added: its rows are written here, under the lock
        if path is not None and _as_planned(conn, table) and _still_there(conn, path):
            conn.execute(f"CALL ducklake_add_data_files('{CATALOG}', '{table}', ?)", [path])
            prewritten.used.add(table)
        else:
            cols = ", ".join(f's."{f.name}"' for f in ARROW_SCHEMAS[table])
            conn.execute(
                f"""INSERT INTO {table} BY NAME
                    SELECT {cols}, s.input_sha256, i.captured_at_ AS captured_at, $now AS loaded_at,
                           $run_id AS run_id
                    FROM stage_{table} s JOIN {incoming} i USING (_row)""",
                {"now": now, "run_id": run_id},
            )
        loaded[table] = dict(conn.execute(f"SELECT input_sha256, count(*) FROM {incoming} GROUP BY 1").fetchall())
    delete(conn, "feature_captures", prewritten)
    conn.execute("""INSERT INTO feature_captures BY NAME
                    SELECT model_id, source_id, feature_index, table_name, captured_at, input_sha256,
                           $run_id AS run_id, $now AS loaded_at FROM applied""",
                 {"now": now, "run_id": run_id})
    cur = conn.execute("""
        SELECT input_sha256, model_id, source_id, feature_index, table_name, captured_at,
               loaded_input_sha256 AS kept_input_sha256, loaded_captured_at AS kept_captured_at,
               'older than the capture already loaded' AS reason
        FROM capture_decisions WHERE decision = 'older' ORDER BY ALL""")
    cols = [d[0] for d in cur.description]
    older = [dict(zip(cols, r)) for r in cur.fetchall()]
    for r in moved:
        log.warning("%s/%s/%s: %s", r["model_id"], r["source_id"], r["feature_index"], r["reason"])
    return loaded, older + moved


def changed_reference(conn: duckdb.DuckDBPyConnection, table: str) -> int:
    """The staged rows of a reference table whose content differs from the stored row with the
    same key, in the temp table ``new_<table>`` (not made when none is staged); returns how many."""
    cols = [f.name for f in ARROW_SCHEMAS[table]]
    if not conn.execute(f"SELECT EXISTS (FROM stage_{table})").fetchone()[0]:
        # Nothing staged (every batch of export files): nothing changes, whatever the table
        # holds, so it is not read. Reading it costs DuckLake's lookup of its files each time
        # (an empty lake table costs most: ~12 ms against ~3 for one with rows, 2026-12-07), 3
        # tables a batch, again under the lock when a commit came in between: 0.40 CPU-s of a
        # whole generated source's 6 batches (65,536 features), 0.03 for these looks instead.
        return 0  # (and no new_<table>: nothing reads it, see upsert_reference)
    same = " AND ".join(f't."{c}" IS NOT DISTINCT FROM s."{c}"' for c in cols)
    conn.execute(f"""CREATE OR REPLACE TEMP TABLE new_{table} AS
                     SELECT * FROM stage_{table} AS s WHERE NOT EXISTS (SELECT 1 FROM {table} AS t WHERE {same})""")
    return conn.execute(f"SELECT count(*) FROM new_{table}").fetchone()[0]


def upsert_reference(conn: duckdb.DuckDBPyConnection, table: str, now: datetime, *, decided: int | None = None) -> int:
    """Replace the staged rows of a reference table whose content differs from the stored
    row with the same key; identical rows are left alone. Returns rows written. ``decided``:
    what :func:`changed_reference` found against the snapshot this transaction still reads
    (before the commit lock, by :func:`prewrite`): not looked for again."""
    sel = ", ".join(f'"{f.name}"' for f in ARROW_SCHEMAS[table])
    n = changed_reference(conn, table) if decided is None else decided
    if n:
        on = " AND ".join(f"t.{k} = c.{k}" for k in REFERENCE_KEYS[table])
        conn.execute(f"DELETE FROM {table} AS t USING new_{table} AS c WHERE {on}")
        conn.execute(f"INSERT INTO {table} BY NAME SELECT {sel}, input_sha256, $now AS loaded_at FROM new_{table}",
                     {"now": now})
    return n  # new_<table> stays until forget_decided: a retried commit may need it again


def forget_decided(conn: duckdb.DuckDBPyConnection) -> None:
    """After the commit: drop the reference rows :func:`changed_reference` found. (Not inside the
    commit: a COMMIT that fails does not bring back a temp table dropped in its transaction, and
    a retry against the same snapshot uses them.)"""
    for table in REFERENCE_KEYS:
        conn.execute(f"DROP TABLE IF EXISTS temp.main.new_{table}")


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
