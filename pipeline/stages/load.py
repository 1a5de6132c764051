"""Load stage: a validated, staged batch into the warehouse, each feature capture as a snapshot.

A feature page is a snapshot of its feature: loading one replaces that feature's row, its
activations and its explanations, so rows missing from the new capture are gone from the
current tables. A bulk-export batch of features, activations or explanations replaces, for
each feature it holds, that feature's rows of its own table only (a source's three kinds of
export batches number features differently and arrive separately).

Every capture carries the time it was made (fetched, else the file's modification time). For
each (feature, table) the newest capture wins; ties go to the larger input digest, so the
outcome never depends on arrival order:

* ``claim_captures`` (before validation) picks the winner among captures of one feature in the
  same batch and drops the others' records, which are recorded as superseded;
* ``replace_staged`` (inside the load transaction, under the commit lock) compares each winner
  with the capture already loaded (``feature_captures``): an older capture is recorded as
  superseded and loads nothing; a newer one replaces the feature's rows.

An activation (or explanation) id is unique in its table and belongs to one feature: among the
captures that bring it (the batch's, and the one whose row holds it now) the newest keeps it,
ties again to the larger digest, as if captures were applied in the order they were made, so
the outcome is the same whether the pages came in one run or several. A capture that takes an
id from another feature takes its row; that feature's statistics are refreshed too, and the
move is recorded in ``superseded`` (either way: the records that lost their ids, or the
batch's records that did not load because a newer capture holds them elsewhere). (What the
warehouse decides from is what it holds: an id whose holder was since replaced by a capture
without it goes to the next capture that brings it.)

Each input's claims are kept in ``input_captures`` (``record_captures``), so that bytes seen
again with a newer capture time are decided without parsing them (``settle_again``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

import duckdb
import pyarrow as pa

from ..lake.maintain import pending_name
from ..lake.warehouse import CATALOG, bind, data_path, literal, one_snapshot, utcnow
from .materialise import compute_changed, excerpt_from, stats_without_rows
from .records import ARROW_SCHEMAS

log = logging.getLogger(__name__)

__all__ = [
    "DATA_TABLES", "REFERENCE_KEYS", "STAGED_ACTIVATIONS", "passed", "claim_captures", "replace_staged", "upsert_reference",
    "insert_rows", "utcnow", "record_captures", "settle_again", "retime", "retime_checked", "AGAIN_READ", "Prewritten", "prewrite",
    "prestats", "mark_changed_features", "changed_reference", "forget_decided",
]

#: The tables a capture replaces per feature.
DATA_TABLES = ("features", "activations", "explanations")

#: The natural key of each reference table (models, source sets, sources): replaced by key when
#: their content changes, left alone (no new snapshot data) when it does not.
REFERENCE_KEYS: dict[str, tuple[str, ...]] = {
    "models": ("model_id",),
    "source_sets": ("model_id", "source_set_name"),
    "sources": ("model_id", "source_id"),
}

_FEATURE_KEY = ("model_id", "source_id", "feature_index")

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
_ROW_IDS = {"activations": "activation_id", "explanations": "explanation_id"}


def passed(table: str) -> str:
    """FROM clause of the batch's staged ``table`` records that passed every expectation
    (``failed_rows(tbl, _row)`` lists those quarantined)."""
    return f"FROM stage_{table} WHERE _row NOT IN (SELECT _row FROM failed_rows WHERE tbl = '{table}')"


def _on(a: str, b: str, cols: tuple[str, ...] = _FEATURE_KEY) -> str:
    return " AND ".join(f"{a}.{c} = {b}.{c}" for c in cols)


def claim_captures(conn: duckdb.DuckDBPyConnection) -> list[dict]:
    """Decide, inside the batch, which capture of each (feature, table) loads.

    Needs the temp table ``batch_inputs(input_sha256, captured_at, is_page)`` and the staged
    tables. Leaves the winners in ``batch_claims`` (one row per feature and table), removes the
    losers' records from the staged tables, and returns the losers as ``superseded`` rows
    (without run id and time).
    """
    key_ok = " AND ".join(f"s.{c} IS NOT NULL" for c in _FEATURE_KEY)
    parts = [f"""
        SELECT s.model_id, s.source_id, s.feature_index, t.table_name, s.input_sha256
        FROM stage_features s JOIN batch_inputs b USING (input_sha256)
        CROSS JOIN (VALUES ('features'), ('activations'), ('explanations')) t(table_name)
        WHERE b.is_page AND {key_ok}"""]
    for table in DATA_TABLES:
        parts.append(f"""
            SELECT s.model_id, s.source_id, s.feature_index, '{table}', s.input_sha256
            FROM stage_{table} s JOIN batch_inputs b USING (input_sha256)
            WHERE NOT b.is_page AND {key_ok}""")
    conn.execute(f"""
        CREATE OR REPLACE TEMP TABLE all_claims AS
        SELECT c.*, b.captured_at,
               row_number() OVER (PARTITION BY c.model_id, c.source_id, c.feature_index, c.table_name
                                  ORDER BY b.captured_at DESC NULLS LAST, c.input_sha256 DESC) AS rank
        FROM ({' UNION '.join(parts)}) AS c JOIN batch_inputs b USING (input_sha256)""")
    conn.execute("CREATE OR REPLACE TEMP TABLE batch_captures AS SELECT DISTINCT input_sha256, model_id, source_id, "
                 "feature_index, table_name FROM all_claims")
    conn.execute("CREATE OR REPLACE TEMP TABLE batch_claims AS SELECT * EXCLUDE (rank) FROM all_claims WHERE rank = 1")
    cur = conn.execute("""
        SELECT l.input_sha256, l.model_id, l.source_id, l.feature_index, l.table_name, l.captured_at,
               w.input_sha256 AS kept_input_sha256, w.captured_at AS kept_captured_at,
               'a newer capture of this feature came in the same batch' AS reason
        FROM all_claims l JOIN batch_claims w USING (model_id, source_id, feature_index, table_name)
        WHERE l.rank > 1 ORDER BY ALL""")
    cols = [d[0] for d in cur.description]
    losers = [dict(zip(cols, r)) for r in cur.fetchall()]
    if losers:
        from .stage import keep_staged

        for table in DATA_TABLES:
            keep_staged(conn, table, f"""NOT EXISTS (
                SELECT 1 FROM all_claims l WHERE l.rank > 1 AND l.table_name = '{table}'
                AND l.input_sha256 = s.input_sha256 AND {_on('l', 's')})""")
    conn.execute("DROP TABLE all_claims")
    return losers


def _decide(conn: duckdb.DuckDBPyConnection, reprocess: bool) -> None:
    """``capture_decisions``: each winner against the committed capture; ``applied``: those that load."""
    conn.execute("""
        CREATE OR REPLACE TEMP TABLE capture_decisions AS
        SELECT w.*, c.captured_at AS loaded_captured_at, c.input_sha256 AS loaded_input_sha256,
               CASE WHEN c.input_sha256 IS NULL THEN 'new'
                    WHEN w.input_sha256 = c.input_sha256
                         AND w.captured_at IS NOT DISTINCT FROM c.captured_at THEN 'same'
                    WHEN (coalesce(w.captured_at, TIMESTAMP '0001-01-01'), w.input_sha256)
                         > (coalesce(c.captured_at, TIMESTAMP '0001-01-01'), c.input_sha256) THEN 'newer'
                    ELSE 'older' END AS decision
        FROM batch_claims w
        LEFT JOIN feature_captures c USING (model_id, source_id, feature_index, table_name)""")
    applied = "('new', 'newer', 'same')" if reprocess else "('new', 'newer')"
    conn.execute(f"CREATE OR REPLACE TEMP TABLE applied AS SELECT * FROM capture_decisions WHERE decision IN {applied}")


def _incoming(conn: duckdb.DuckDBPyConnection, table: str) -> None:
    """``incoming_<table>``: the staged rows of ``table`` that load (passed validation, and
    their capture applies), by ``_row``, with their keys and capture time, not their contents."""
    row_id = f", s.{_ROW_IDS[table]}" if table in _ROW_IDS else ""
    conn.execute(f"""
        CREATE OR REPLACE TEMP TABLE incoming_{table} AS
        SELECT s._row, s.input_sha256, s.model_id, s.source_id, s.feature_index{row_id},
               a.captured_at AS captured_at_
        FROM stage_{table} s
        JOIN applied a ON {_on('a', 's')} AND a.table_name = '{table}' AND a.input_sha256 = s.input_sha256
        WHERE s._row NOT IN (SELECT _row FROM failed_rows WHERE tbl = '{table}')""")


_OLDEST = "TIMESTAMP '0001-01-01'"


def _newest_keeps_each_id(conn: duckdb.DuckDBPyConnection, table: str, row_id: str, has_rows: bool) -> bool:
    """Keep in ``incoming_<table>`` only the rows whose id no newer capture brings: of the
    batch's rows with one id (from different inputs; copies within one input are refused by
    validation) the newest capture's, and that only if the capture holding the id now (its
    feature's in ``feature_captures``) is not newer still.

    Returns whether any of the batch's ids is held already (by its own feature or another) or
    comes twice; if so, the ids that change feature are in ``moved_<table>`` and ``kept_<table>``
    (:func:`moved_ids`)."""
    held = ""
    if has_rows and conn.execute(  # (the usual batch holds no id loaded before: ~0.01 s, not ~0.1)
            f"SELECT EXISTS (SELECT 1 FROM {table} WHERE {row_id} IN (SELECT {row_id} FROM incoming_{table}))"
    ).fetchone()[0]:
        newer = f"""(coalesce(c.captured_at, {_OLDEST}), c.input_sha256)
                  > (coalesce(i.captured_at_, {_OLDEST}), i.input_sha256)"""
        held = f"""WHERE NOT EXISTS (
            SELECT 1 FROM {table} t JOIN feature_captures c ON {_on('c', 't')} AND c.table_name = '{table}'
            WHERE t.{row_id} = i.{row_id} AND {newer})"""
        # what is held elsewhere, by a newer capture, does not load: said, not silent (review)
        conn.execute(f"""
            CREATE OR REPLACE TEMP TABLE kept_{table} AS
            SELECT i.input_sha256, i.model_id, i.source_id, i.feature_index, i.captured_at_ AS captured_at,
                   c.input_sha256 AS kept_input_sha256, c.captured_at AS kept_captured_at,
                   t.model_id AS other_model, t.source_id AS other_source, t.feature_index AS other_index
            FROM incoming_{table} i JOIN {table} t ON t.{row_id} = i.{row_id}
            JOIN feature_captures c ON {_on('c', 't')} AND c.table_name = '{table}'
            WHERE {newer} AND NOT ({_on('t', 'i')})""")
    order = f"PARTITION BY i.{row_id} ORDER BY coalesce(i.captured_at_, {_OLDEST}) DESC, i.input_sha256 DESC"
    # one id from two features of the batch (a copy of a page under another index, in one run):
    # the older's records do not load, said as when the newer was loaded before (outside review)
    twice = conn.execute(f"SELECT count({row_id}) > count(DISTINCT {row_id}) FROM incoming_{table}").fetchone()[0]
    if twice:
        conn.execute(f"""
            CREATE OR REPLACE TEMP TABLE batch_lost_{table} AS
            WITH ranked AS (SELECT i.*, row_number() OVER ({order}) AS rn_ FROM incoming_{table} i
                            {held or 'WHERE true'} AND i.{row_id} IS NOT NULL)
            SELECT l.input_sha256, l.model_id, l.source_id, l.feature_index, l.captured_at_ AS captured_at,
                   w.input_sha256 AS kept_input_sha256, w.captured_at_ AS kept_captured_at,
                   w.model_id AS other_model, w.source_id AS other_source, w.feature_index AS other_index
            FROM ranked l JOIN ranked w ON w.{row_id} = l.{row_id} AND w.rn_ = 1
            WHERE l.rn_ > 1 AND NOT ({_on('l', 'w')})""")
        if held:
            conn.execute(f"INSERT INTO kept_{table} SELECT * FROM batch_lost_{table}")
        else:
            conn.execute(f"CREATE OR REPLACE TEMP TABLE kept_{table} AS FROM batch_lost_{table}")
            conn.execute(f"CREATE OR REPLACE TEMP TABLE moved_{table} AS FROM batch_lost_{table} LIMIT 0")
    conn.execute(f"""
        CREATE OR REPLACE TEMP TABLE incoming_{table} AS
        SELECT i.* FROM incoming_{table} i {held}
        QUALIFY i.{row_id} IS NULL OR row_number() OVER ({order}) = 1""")
    if not held:
        return bool(twice)
    # the ids the batch takes from another feature (which loses them: its statistics are redone,
    # see mark_changed_features) — a newer capture wins an id, as it wins its own feature
    conn.execute(f"""
        CREATE OR REPLACE TEMP TABLE moved_{table} AS
        SELECT t.input_sha256, t.model_id, t.source_id, t.feature_index, t.captured_at,
               i.input_sha256 AS kept_input_sha256, i.captured_at_ AS kept_captured_at,
               i.model_id AS other_model, i.source_id AS other_source, i.feature_index AS other_index
        FROM {table} t JOIN incoming_{table} i ON t.{row_id} = i.{row_id}
        WHERE NOT ({_on('t', 'i')})
          AND NOT EXISTS (SELECT 1 FROM applied a WHERE a.table_name = '{table}' AND {_on('a', 't')})""")
    return True


def moved_ids(conn: duckdb.DuckDBPyConnection, has_rows: dict[str, bool]) -> list[dict]:
    """The ``superseded`` rows for ids that changed feature in this batch's plan: a feature's
    records whose ids a newer capture of another feature brings (they move to it), and the
    batch's records whose ids another feature's newer capture holds (they do not load). An id
    names one record of one feature; a copy of a page under another index is the usual cause."""
    out = []
    for table, row_id in _ROW_IDS.items():
        if not has_rows.get(f"{table}:moves"):
            continue
        for name, says in ((f"moved_{table}", "now belong to feature {} (a newer capture brought them there)"),
                           (f"kept_{table}", "belong to feature {}, whose capture is newer: not loaded")):
            cur = conn.execute(f"""
                SELECT input_sha256, model_id, source_id, feature_index, '{table}' AS table_name,
                       max(captured_at) AS captured_at, max(kept_input_sha256) AS kept_input_sha256,
                       max(kept_captured_at) AS kept_captured_at,
                       other_model || '/' || other_source || '/' || other_index AS other, count(*) AS n
                FROM {name} GROUP BY ALL ORDER BY ALL""")
            cols = [d[0] for d in cur.description]
            for row in cur.fetchall():
                r = dict(zip(cols, row))
                n, other = r.pop("n"), r.pop("other")
                r["reason"] = f"{n} of its {table} ids ({row_id}) " + says.format(other)
                out.append(r)
    return out


def record_captures(conn: duckdb.DuckDBPyConnection, now: datetime, run_id: str,
                    prewritten: Prewritten | None = None) -> None:
    """Record what each input the batch parsed holds (``batch_captures``, from ``claim_captures``)
    in ``input_captures``, replacing what an earlier parse of it recorded."""
    delete(conn, "input_captures", prewritten)
    conn.execute("""INSERT INTO input_captures BY NAME
                    SELECT c.*, $run_id AS run_id, $now AS recorded_at FROM batch_captures c
                    WHERE input_sha256 IN (SELECT input_sha256 FROM batch_inputs)""",
                 {"now": now, "run_id": run_id})


#: ``settle_again``'s answer for bytes that must be read again: this capture changes what loads.
AGAIN_READ = "read"


def settle_again(conn: duckdb.DuckDBPyConnection, again: dict[str, datetime]) -> dict[str, str]:
    """Decide, without parsing them, what inputs already landed bring when they come again with
    a capture time (``again``: digest → time) newer than any capture of their bytes taken so far.

    Reads the committed state. For each digest: ``"read"`` (:data:`AGAIN_READ`) when this capture
    is newer than another capture now loaded for one of the (feature, table)s the bytes hold (or
    nothing says what they hold, or rows of theirs were taken by another feature since): they
    are read again and load as any capture. ``"retime"`` when they are still what is loaded
    everywhere this capture would win: only the capture's time moves forward (:func:`retime`).
    ``"skip"`` otherwise (not newer than what is recorded, older than what is loaded, or bytes
    that were refused).
    """
    if not again:
        return {}
    # As literal VALUES, not Arrow: an unchanged re-run needs no pandas (see ``insert_values``).
    _times_table(conn, "again", again)
    # Most bytes seen again (an unchanged re-run) are not newer than what is recorded: settled
    # from raw_inputs alone, so the claims and the tables' rows are looked at only for the rest.
    first = dict(conn.execute(f"""
        SELECT a.input_sha256, CASE
            WHEN r.input_sha256 IS NULL THEN 'read'
            WHEN a.captured_at <= coalesce(r.captured_at, {_OLDEST}) OR r.status <> 'loaded' THEN 'skip'
            END
        FROM again a LEFT JOIN raw_inputs r USING (input_sha256)""").fetchall())
    newer = [sha for sha, decision in first.items() if decision is None]
    if not newer:
        return first
    conn.execute(bind("DELETE FROM again WHERE NOT list_contains($newer, input_sha256)", {"newer": newer}))
    rows = conn.execute(f"""
        WITH claims AS (
            SELECT c.input_sha256,
                   bool_or(f.input_sha256 IS NULL OR (f.input_sha256 <> c.input_sha256
                           AND (a.captured_at, c.input_sha256) > (coalesce(f.captured_at, {_OLDEST}), f.input_sha256)))
                       AS beats_another,
                   bool_or(f.input_sha256 = c.input_sha256 AND a.captured_at > coalesce(f.captured_at, {_OLDEST}))
                       AS newer_than_itself
            FROM input_captures c JOIN again a USING (input_sha256)
            LEFT JOIN feature_captures f USING (model_id, source_id, feature_index, table_name)
            GROUP BY c.input_sha256),
        held AS (
            SELECT input_sha256, count(*) FILTER (WHERE t = 'a') AS n_activations,
                   count(*) FILTER (WHERE t = 'e') AS n_explanations
            FROM (SELECT input_sha256, 'a' AS t FROM activations WHERE input_sha256 IN (SELECT input_sha256 FROM again)
                  UNION ALL
                  SELECT input_sha256, 'e' FROM explanations WHERE input_sha256 IN (SELECT input_sha256 FROM again))
            GROUP BY input_sha256)
        SELECT a.input_sha256, CASE
            WHEN c.input_sha256 IS NULL OR c.beats_another THEN 'read'
            WHEN c.newer_than_itself AND (coalesce(h.n_activations, 0) < coalesce(r.n_activations, 0)
                                          OR coalesce(h.n_explanations, 0) < coalesce(r.n_explanations, 0))
                THEN 'read'  -- rows of its taken by another feature's capture: this newer one takes them back
            WHEN c.newer_than_itself THEN 'retime'
            ELSE 'skip' END
        FROM again a LEFT JOIN raw_inputs r USING (input_sha256)
        LEFT JOIN claims c USING (input_sha256) LEFT JOIN held h USING (input_sha256)""").fetchall()
    return first | dict(rows)


def retime(conn: duckdb.DuckDBPyConnection, again: dict[str, datetime]) -> None:
    """Record newer capture times of bytes already loaded (``again``: digest → time): the
    captures they are still the loaded one of, and their ``raw_inputs`` row, take the newer
    time (the rows, the same, are not rewritten). Inside the load's transaction."""
    if not again:
        return
    _times_table(conn, "_retime", again)
    try:
        for table in ("feature_captures", "raw_inputs"):
            conn.execute(f"""UPDATE {table} AS t SET captured_at = r.captured_at FROM _retime AS r
                             WHERE t.input_sha256 = r.input_sha256
                               AND coalesce(t.captured_at, {_OLDEST}) < r.captured_at""")
    finally:
        conn.execute("DROP TABLE IF EXISTS temp._retime")


def retime_checked(conn: duckdb.DuckDBPyConnection, again: dict[str, datetime]) -> list[str]:
    """:func:`retime`, its decision taken again first: inside the load's transaction, under the
    commit lock, :func:`settle_again` is asked again against the snapshot the commit writes on.
    A capture decided "only move its time" before the lock may since have lost its features to
    another writer's capture (older than this one, newer than the bytes' first): only those still
    to be retimed are; the digests returned are now to be read again (:data:`AGAIN_READ`), which
    the caller does after the commit. (Those now ``skip``: another writer moved the time already.)"""
    if not again:
        return []
    decided = settle_again(conn, again)
    retime(conn, {sha: at for sha, at in again.items() if decided.get(sha) == "retime"})
    return sorted(sha for sha in again if decided.get(sha) == AGAIN_READ)


def _times_table(conn: duckdb.DuckDBPyConnection, name: str, times: dict[str, datetime]) -> None:
    """The temp table ``name`` (input_sha256, captured_at) of digests and capture times (naive
    UTC; an aware time is taken to UTC, as Arrow took it), as literal VALUES: a re-run whose
    files were only touched needs no pandas either (see ``insert_values``)."""
    conn.execute(f"CREATE OR REPLACE TEMP TABLE {name} (input_sha256 VARCHAR, captured_at TIMESTAMP)")
    insert_values(conn, name, [
        {"input_sha256": sha, "captured_at": at.astimezone(timezone.utc).replace(tzinfo=None) if at.tzinfo else at}
        for sha, at in times.items()])


def _plan(conn: duckdb.DuckDBPyConnection, reprocess: bool) -> dict[str, bool]:
    """Decide against the snapshot the connection reads: ``applied`` (the captures that load)
    and ``incoming_<table>`` (the rows that load) for every data table. Returns whether each
    table holds rows already."""
    _decide(conn, reprocess)
    has_rows = {}
    for table in DATA_TABLES:
        _incoming(conn, table)
        has_rows[table] = conn.execute(f"SELECT EXISTS (FROM {table})").fetchone()[0]
        row_id = _ROW_IDS.get(table)
        if row_id:
            has_rows[f"{table}:moves"] = _newest_keeps_each_id(conn, table, row_id, has_rows[table])
    return has_rows


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
    same key, in the temp table ``new_<table>``; returns how many."""
    cols = [f.name for f in ARROW_SCHEMAS[table]]
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


def insert_values(conn: duckdb.DuckDBPyConnection, table: str, rows: list[dict], chunk: int = 2000) -> int:
    """Append small rows of a few short scalar columns (``run_inputs``) as literal ``VALUES``,
    by the first row's column names: without Arrow, whose ``pa.array`` imports pandas, which a
    run that loads nothing never needs otherwise (see ``bind``)."""
    if not rows:
        return 0
    cols = list(rows[0])
    head = f"INSERT INTO {table} ({', '.join(cols)}) VALUES "
    for i in range(0, len(rows), chunk):
        conn.execute(head + ", ".join(
            "(" + ", ".join(literal(r[c]) for c in cols) + ")" for r in rows[i:i + chunk]))
    return len(rows)


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
