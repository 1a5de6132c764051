"""History: every committed batch is a DuckLake snapshot named after its run, so the warehouse
can say how a feature changed over time and what changed since a run or a moment.

Both read ``feature_captures`` (which capture each feature's rows come from) through DuckLake's
change feed and time travel (``AT (VERSION => n)``); history older than the retention period
(``featurehouse maintain`` expires it) is gone. A feature can also change without a capture of
its own: another feature's capture may take activation (or explanation) ids it held, deleting
its rows; the change feed of those tables shows that too. A newer capture of the same bytes
(only ``captured_at`` moves) is not a change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import duckdb

from .warehouse import CATALOG

__all__ = ["FeatureKey", "BadFeatureKey", "HistoryUnavailable", "parse_key", "feature_history", "changes_since"]


class BadFeatureKey(ValueError):
    "A feature is named MODEL/SOURCE/INDEX, e.g. gpt-oss-20b/11-resid-post-aa/45698."


class HistoryUnavailable(LookupError):
    "The warehouse no longer keeps (or never had) the snapshot asked for."


@dataclass(frozen=True)
class FeatureKey:
    model_id: str
    source_id: str
    feature_index: int

    def __str__(self) -> str:
        return f"{self.model_id}/{self.source_id}/{self.feature_index}"


def parse_key(text: str) -> FeatureKey:
    """``MODEL/SOURCE/INDEX`` → FeatureKey."""
    parts = text.strip().strip("/").split("/")
    if len(parts) != 3 or not all(parts) or not re.fullmatch(r"\d{1,18}", parts[2]):
        raise BadFeatureKey(f"{text!r} is not MODEL/SOURCE/INDEX (e.g. gpt-oss-20b/11-resid-post-aa/45698)")
    return FeatureKey(parts[0], parts[1], int(parts[2]))


def _rows(conn: duckdb.DuckDBPyConnection, sql: str, params: Any = None) -> list[dict[str, Any]]:
    cur = conn.execute(sql, params or {})
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def _snapshot_span(conn: duckdb.DuckDBPyConnection) -> tuple[int, int]:
    first, last = conn.execute(f"SELECT min(snapshot_id), max(snapshot_id) FROM {CATALOG}.snapshots()").fetchone()
    return int(first), int(last)


def _at(conn: duckdb.DuckDBPyConnection, table: str, version: int | None) -> str:
    """``table`` as of snapshot ``version`` (None: now); empty if it did not exist yet."""
    if version is None:
        return table
    at = f"{table} AT (VERSION => {int(version)})"
    try:
        conn.execute(f"SELECT 1 FROM {at} LIMIT 0")
    except duckdb.CatalogException:  # the snapshot predates the table (the schema's creation)
        return f"(SELECT * FROM {table} LIMIT 0)"
    return at


#: The tables whose rows another feature's capture can take (by id).
_TAKEN_FROM = ("activations", "explanations")


def _replaced(conn: duckdb.DuckDBPyConnection, first: int, last: int, where: str) -> str:
    """SQL: per snapshot and feature (``where`` over the feature's key), the tables whose capture
    changed to another input (``replaced``), the capture's time and run."""
    feed = f"ducklake_table_changes('{CATALOG}', 'main', 'feature_captures', {first}, {last})"
    # a capture loaded is an insert; an update that keeps the input only moved its time (retime)
    return f"""
        WITH ch AS (SELECT * FROM {feed} WHERE {where})
        SELECT p.snapshot_id, p.model_id, p.source_id, p.feature_index, p.table_name, p.captured_at, p.run_id
        FROM ch p
        WHERE p.change_type = 'insert' OR (p.change_type = 'update_postimage' AND NOT EXISTS (
            SELECT 1 FROM ch q WHERE q.change_type = 'update_preimage' AND q.snapshot_id = p.snapshot_id
            AND q.table_name = p.table_name AND q.model_id = p.model_id AND q.source_id = p.source_id
            AND q.feature_index = p.feature_index AND q.input_sha256 = p.input_sha256))"""


def _lost(conn: duckdb.DuckDBPyConnection, first: int, last: int, where: str) -> str:
    """SQL: per snapshot and feature (``where``), the tables that lost rows without a capture
    of the feature's own replacing them: ids another feature's capture took."""
    own = f"ducklake_table_changes('{CATALOG}', 'main', 'feature_captures', {first}, {last})"
    parts = " UNION ".join(
        f"""SELECT snapshot_id, model_id, source_id, feature_index, '{t}' AS table_name
            FROM ducklake_table_changes('{CATALOG}', 'main', '{t}', {first}, {last})
            WHERE change_type = 'delete' AND {where}""" for t in _TAKEN_FROM)
    return f"""
        SELECT d.* FROM ({parts}) d
        WHERE NOT EXISTS (SELECT 1 FROM {own} c WHERE c.snapshot_id = d.snapshot_id AND c.table_name = d.table_name
                          AND c.model_id = d.model_id AND c.source_id = d.source_id
                          AND c.feature_index = d.feature_index AND c.change_type IN ('insert', 'delete'))"""


def _state(conn: duckdb.DuckDBPyConnection, key: FeatureKey, version: int | None) -> dict[str, Any]:
    """The feature as the warehouse held it at snapshot ``version`` (None: now)."""
    where = "model_id = $m AND source_id = $s AND feature_index = $i"
    p = {"m": key.model_id, "s": key.source_id, "i": key.feature_index}
    f = conn.execute(f"SELECT max_act_approx, frac_nonzero FROM {_at(conn, 'features', version)} WHERE {where}",
                     p).fetchone()
    n, mx = conn.execute(
        f"SELECT count(*), max(max_value) FROM {_at(conn, 'activations', version)} WHERE {where}", p).fetchone()
    (expl,) = conn.execute(
        f"SELECT coalesce(list(description ORDER BY description), []) "
        f"FROM {_at(conn, 'explanations', version)} WHERE {where}", p
    ).fetchone()
    return {"max_act_approx": f[0] if f else None, "frac_nonzero": f[1] if f else None,
            "n_activations": int(n), "max_activation": mx, "explanations": list(expl)}


def feature_history(conn: duckdb.DuckDBPyConnection, key: FeatureKey) -> list[dict[str, Any]]:
    """Every version of a feature the warehouse still keeps, oldest first.

    A version is a snapshot in which one of the feature's tables took a capture from another
    input (``replaced``), or lost rows to another feature's capture, which took their ids
    (``lost``). Each comes with when it was committed, the run that committed it, the time of
    the feature's capture, and the feature as of that snapshot: max_act_approx, number of
    activations, the largest activation and the explanations' texts. When older snapshots have
    been expired, the first version is the state at the oldest snapshot kept (``replaced`` and
    ``lost`` are then empty).
    """
    first, last = _snapshot_span(conn)
    p = {"m": key.model_id, "s": key.source_id, "i": key.feature_index}
    where = "model_id = $m AND source_id = $s AND feature_index = $i"
    changed = _rows(conn, f"""
        WITH r AS ({_replaced(conn, first, last, where)}), l AS ({_lost(conn, first, last, where)})
        SELECT snapshot_id,
               coalesce(list(DISTINCT r.table_name ORDER BY r.table_name) FILTER (WHERE r.table_name IS NOT NULL), [])
                   AS replaced,
               coalesce(list(DISTINCT l.table_name ORDER BY l.table_name) FILTER (WHERE l.table_name IS NOT NULL), [])
                   AS lost,
               max(r.captured_at) AS captured_at, any_value(r.run_id) AS run_id
        FROM r FULL JOIN l USING (snapshot_id)
        GROUP BY snapshot_id ORDER BY snapshot_id""", p)
    at_first = conn.execute(
        f"SELECT max(captured_at), any_value(run_id) FROM {_at(conn, 'feature_captures', first)} WHERE {where}", p
    ).fetchone()
    if at_first[1] is not None and not any(v["snapshot_id"] == first for v in changed):
        changed.insert(0, {"snapshot_id": first, "replaced": [], "lost": [], "captured_at": at_first[0],
                           "run_id": at_first[1]})
    if not changed:
        return []
    snaps = {s: (t, r) for s, t, r in conn.execute(
        f"SELECT snapshot_id, snapshot_time, TRY_CAST(commit_extra_info AS JSON)->>'run_id' FROM {CATALOG}.snapshots() "
        "WHERE snapshot_id IN (SELECT unnest($ids))", {"ids": [v["snapshot_id"] for v in changed]}).fetchall()}
    out = []
    for v in changed:
        committed, run_id = snaps.get(v["snapshot_id"], (None, None))
        captured_at = v["captured_at"]
        if captured_at is None:  # rows lost, the feature's own capture unchanged: its time then
            (captured_at,) = conn.execute(
                f"SELECT max(captured_at) FROM {_at(conn, 'feature_captures', v['snapshot_id'])} WHERE {where}", p
            ).fetchone()
        out.append({
            "feature": str(key), "snapshot_id": v["snapshot_id"],
            "committed_at": committed.astimezone(timezone.utc).replace(tzinfo=None) if committed else None,
            "run_id": v["run_id"] or run_id, "captured_at": captured_at, "replaced": v["replaced"],
            "lost": v["lost"], **_state(conn, key, v["snapshot_id"]),
        })
    return out


def resolve_since(conn: duckdb.DuckDBPyConnection, since: str) -> tuple[int, str]:
    """The snapshot ``since`` names, and words for it: a run id (the state just before the
    run's first commit) or a timestamp (the last snapshot at or before it; naive means UTC)."""
    first, _ = _snapshot_span(conn)
    snap = conn.execute(
        f"""SELECT min(snapshot_id) FROM {CATALOG}.snapshots()
            WHERE TRY_CAST(commit_extra_info AS JSON)->>'run_id' = $r""", {"r": since}).fetchone()[0]
    if snap is not None:
        if snap <= first:
            raise HistoryUnavailable(
                f"run {since} started at the oldest snapshot the warehouse keeps ({first}); "
                "the state before it has expired")
        return int(snap) - 1, f"since run {since} started"
    if conn.execute("SELECT count(*) FROM runs WHERE run_id = $r", {"r": since}).fetchone()[0]:
        raise HistoryUnavailable(f"run {since}'s snapshots have expired (older than the retention period)")
    try:
        when = datetime.fromisoformat(since.replace("Z", "+00:00"))
    except ValueError:
        raise HistoryUnavailable(f"{since!r} is neither a run id in this warehouse nor a timestamp "
                                 "(e.g. 2026-11-29T03:00:00Z)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    snap = conn.execute(f"SELECT max(snapshot_id) FROM {CATALOG}.snapshots() WHERE snapshot_time <= $t",
                        {"t": when}).fetchone()[0]
    if snap is None and first == 0:  # before the warehouse was made: it held nothing then
        snap = 0
    if snap is None:
        raise HistoryUnavailable(f"the warehouse keeps no snapshot from {when.isoformat()} or before "
                                 "(history older than the retention period is expired)")
    return int(snap), f"since {when.astimezone(timezone.utc).strftime('%Y-%m-%d %H:%M:%S')} UTC"


def _fmt(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list):
        return "[" + "; ".join(repr(x) for x in v) + "]"
    return str(v)


def changes_since(conn: duckdb.DuckDBPyConnection, since: str) -> tuple[str, list[dict[str, Any]]]:
    """Features added, removed and changed between the snapshot ``since`` names and now.

    Returns a description of the starting point and one dict per feature:
    ``feature, change (added|removed|changed), what (a list of {field, before, after}),
    run_id, captured_at`` — ``run_id``/``captured_at`` of the capture loaded now. A feature is
    listed when a capture from another input replaced one of its tables, or when its rows changed
    otherwise (another feature's capture took ids it held, or its own input was read again) and
    its values differ; a newer capture of the same bytes alone is not a change.
    """
    snap, label = resolve_since(conn, since)
    _, last = _snapshot_span(conn)
    touched = " UNION ".join(
        f"""SELECT DISTINCT model_id, source_id, feature_index
            FROM ducklake_table_changes('{CATALOG}', 'main', '{t}', {snap + 1}, {last})
            WHERE change_type IN ('insert', 'delete')""" for t in ("features", *_TAKEN_FROM)
    ) if snap < last else "SELECT NULL::VARCHAR AS model_id, NULL::VARCHAR AS source_id, NULL::BIGINT AS feature_index LIMIT 0"
    keys = _rows(conn, f"""
        WITH old AS (SELECT * FROM {_at(conn, 'feature_captures', snap)}), new AS (SELECT * FROM feature_captures),
        pairs AS (
            SELECT coalesce(n.model_id, o.model_id) AS model_id, coalesce(n.source_id, o.source_id) AS source_id,
                   coalesce(n.feature_index, o.feature_index) AS feature_index,
                   coalesce(n.table_name, o.table_name) AS table_name,
                   o.input_sha256 AS old_sha, n.input_sha256 AS new_sha, n.captured_at AS new_at, n.run_id
            FROM old o FULL JOIN new n USING (model_id, source_id, feature_index, table_name)),
        touched AS (SELECT DISTINCT *, true AS is_touched FROM ({touched}))
        SELECT model_id, source_id, feature_index,
               CASE WHEN bool_and(old_sha IS NULL) THEN 'added' WHEN bool_and(new_sha IS NULL) THEN 'removed'
                    ELSE 'changed' END AS change,
               bool_or(old_sha IS DISTINCT FROM new_sha) AS recaptured,
               max(run_id) AS run_id, max(new_at) AS captured_at
        FROM pairs LEFT JOIN touched USING (model_id, source_id, feature_index)
        GROUP BY model_id, source_id, feature_index
        HAVING bool_or(old_sha IS DISTINCT FROM new_sha) OR bool_or(is_touched)
        ORDER BY model_id, source_id, feature_index""")
    if not keys:
        return label, []
    conn.execute("CREATE OR REPLACE TEMP TABLE changed_keys (model_id VARCHAR, source_id VARCHAR, feature_index BIGINT)")
    conn.executemany("INSERT INTO changed_keys VALUES (?, ?, ?)",
                     [[k["model_id"], k["source_id"], k["feature_index"]] for k in keys])

    def summary(version: int | None) -> dict[tuple, dict[str, Any]]:
        out: dict[tuple, dict[str, Any]] = {}
        f_, a_, e_ = (_at(conn, t, version) for t in ("features", "activations", "explanations"))
        for r in _rows(conn, f"""
            WITH f AS (SELECT model_id, source_id, feature_index, max_act_approx, frac_nonzero
                       FROM {f_} SEMI JOIN changed_keys USING (model_id, source_id, feature_index)),
            a AS (SELECT model_id, source_id, feature_index, count(*) AS n_activations, max(max_value) AS max_activation
                  FROM {a_} SEMI JOIN changed_keys USING (model_id, source_id, feature_index) GROUP BY ALL),
            e AS (SELECT model_id, source_id, feature_index, list(description ORDER BY description) AS explanations
                  FROM {e_} SEMI JOIN changed_keys USING (model_id, source_id, feature_index) GROUP BY ALL)
            SELECT * FROM changed_keys k LEFT JOIN f USING (model_id, source_id, feature_index)
            LEFT JOIN a USING (model_id, source_id, feature_index) LEFT JOIN e USING (model_id, source_id, feature_index)"""):
            out[(r.pop("model_id"), r.pop("source_id"), r.pop("feature_index"))] = r
        return out

    before, after = summary(snap), summary(None)
    fields = ("max_act_approx", "frac_nonzero", "n_activations", "max_activation", "explanations")
    result = []
    for k in keys:
        key = (k["model_id"], k["source_id"], k["feature_index"])
        b, a = before.get(key, {}), after.get(key, {})
        what = []
        for f in fields:
            old, new = b.get(f), a.get(f)
            if f == "n_activations":
                old, new = old or 0, new or 0
            if f == "explanations":
                old, new = list(old or []), list(new or [])
            if old != new:
                what.append({"field": f, "before": old, "after": new})
        if not what and k["change"] == "changed":
            if not k["recaptured"]:
                continue  # rows rewritten, the same values (its own input read again)
            what.append({"field": "capture", "before": "an earlier capture", "after": "a newer capture, same values"})
        result.append({"feature": "/".join(map(str, key)), "change": k["change"], "what": what,
                       "run_id": k["run_id"], "captured_at": k["captured_at"]})
    return label, result


def describe(what: list[dict[str, Any]]) -> str:
    """``what`` from :func:`changes_since` in words: ``field before → after; ...``."""
    return "; ".join(f"{w['field']} {_fmt(w['before'])} → {_fmt(w['after'])}" for w in what)
