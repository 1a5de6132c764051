"""Which capture of each feature loads: the decision the load stage (``load.py``) writes.

Every capture carries the time it was made (fetched, else the file's modification time). For
each (feature, table) the newest capture wins; ties go to the larger input digest, so the
outcome never depends on arrival order:

* ``claim_captures`` (before validation) picks the winner among captures of one feature in the
  same batch and drops the others' records, which are recorded as superseded;
* ``_plan`` (inside the load transaction, under the commit lock, through ``load.prewrite`` and
  ``load.replace_staged``) compares each winner with the capture already loaded
  (``feature_captures``): an older capture is recorded as superseded and loads nothing; a newer
  one replaces the feature's rows.

An activation (or explanation) id is unique in its table and belongs to one feature: among the
captures that bring it (the batch's, and the one whose row holds it now) the newest keeps it,
ties again to the larger digest, as if captures were applied in the order they were made, so
the outcome is the same whether the pages came in one run or several. A capture that takes an
id from another feature takes its row; that feature's statistics are refreshed too, and the
move is recorded in ``superseded`` (``moved_ids``: either way, the records that lost their ids,
or the batch's records that did not load because a newer capture holds them elsewhere). (What
the warehouse decides from is what it holds: an id whose holder was since replaced by a capture
without it goes to the next capture that brings it.)

Bytes seen again with a newer capture time are decided without parsing them (``settle_again``,
from what ``load.record_captures`` kept of each input's claims in ``input_captures``), and only
their time moved when they still win (``retime``; ``retime_checked`` takes that decision again
under the commit lock).
"""

from __future__ import annotations

from datetime import datetime, timezone

import duckdb

from ..lake.sqltext import bind, insert_values

__all__ = ["DATA_TABLES", "passed", "claim_captures", "moved_ids", "settle_again", "retime", "retime_checked",
           "AGAIN_READ"]

#: The tables a capture replaces per feature.
DATA_TABLES = ("features", "activations", "explanations")

_FEATURE_KEY = ("model_id", "source_id", "feature_index")
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
    table holds rows already; False, without looking, for a table none of the captures that
    load is of (nothing of it is replaced, deleted or taken: its rows do not matter)."""
    _decide(conn, reprocess)
    # An export batch brings one table's captures: the other two are not read. Each look at a
    # lake table is DuckLake's lookup of its files (an empty one costs most: ~12 ms against ~3,
    # 2026-12-07); a whole generated source's 6 batches looked at 18 tables, 11 of them for
    # nothing, and probed and checked ids in some: 0.27 CPU-s of its statements. The decision
    # is the batch's own, against the snapshot it reads, never one kept from another batch.
    # (``incoming_<table>`` is rows of ``applied``'s captures of it: none, for such a table.)
    loading = {t for (t,) in conn.execute("SELECT DISTINCT table_name FROM applied").fetchall()}
    has_rows = {}
    for table in DATA_TABLES:
        _incoming(conn, table)
        has_rows[table] = table in loading and conn.execute(f"SELECT EXISTS (FROM {table})").fetchone()[0]
        row_id = _ROW_IDS.get(table)
        if row_id:
            has_rows[f"{table}:moves"] = _newest_keeps_each_id(conn, table, row_id, has_rows[table])
    return has_rows
