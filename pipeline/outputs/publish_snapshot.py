"""What of the warehouse is published: the snapshot (``--snapshot``, ``--at`` or the latest),
the tables (the schema's bookkeeping and unknown names refused) and their columns (the private
ones left out), and whether DuckLake's change feed reaches back to the snapshot a publication
holds (``_change_feed_covers``), which both layouts ask before writing only a table's changes.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import duckdb

from ..lake.warehouse import CATALOG
from .publish_names import _KEY, DEFAULT_TABLES, NEVER, PRIVATE_COLUMNS, PublishRefused


def _snapshot(conn: duckdb.DuckDBPyConnection, snapshot: int | None, at: datetime | None) -> tuple[int, datetime]:
    snaps = f"{CATALOG}.snapshots()"
    if snapshot is not None and at is not None:
        raise PublishRefused("give --snapshot or --at, not both")
    if snapshot is not None:
        row = conn.execute(f"SELECT snapshot_id, snapshot_time FROM {snaps} WHERE snapshot_id = $s",
                           {"s": int(snapshot)}).fetchone()
        if row is None:
            first, last = conn.execute(f"SELECT min(snapshot_id), max(snapshot_id) FROM {snaps}").fetchone()
            raise PublishRefused(f"the warehouse has no snapshot {snapshot} (it keeps {first}..{last}; older ones "
                                 "were expired by `featurehouse maintain`)")
    elif at is not None:
        if at.tzinfo is None:
            at = at.replace(tzinfo=timezone.utc)
        row = conn.execute(f"SELECT snapshot_id, snapshot_time FROM {snaps} WHERE snapshot_time <= $t "
                           "ORDER BY snapshot_id DESC LIMIT 1", {"t": at}).fetchone()
        if row is None:
            raise PublishRefused(f"the warehouse kept no snapshot as old as {at.isoformat()}")
    else:
        row = conn.execute(f"SELECT snapshot_id, snapshot_time FROM {snaps} ORDER BY snapshot_id DESC LIMIT 1").fetchone()
    sid, stime = row
    if stime.tzinfo is None:
        stime = stime.replace(tzinfo=timezone.utc)
    return int(sid), stime.astimezone(timezone.utc)


def _columns(conn: duckdb.DuckDBPyConnection, table: str, snap: int, include_private: bool) -> list[tuple[str, str]]:
    rel = conn.sql(f"SELECT * FROM {CATALOG}.main.{table} AT (VERSION => {snap}) LIMIT 0")
    drop = () if include_private else PRIVATE_COLUMNS.get(table, ())
    return [(c, str(t)) for c, t in zip(rel.columns, rel.types) if c not in drop]


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _order(cols: list[str]) -> str:
    keys = [c for c in _KEY if c in cols] or cols[:1]
    return ", ".join(_ident(c) for c in keys)


def _warehouse_id(conn: duckdb.DuckDBPyConnection) -> str:
    """What tells this warehouse from another: when its schema was first made."""
    (made,) = conn.execute(f"SELECT min(applied_at) FROM {CATALOG}.main.schema_version").fetchone()
    return f"{made.isoformat() if made else ''}"


def _tables(conn: duckdb.DuckDBPyConnection, snap: int, tables: list[str] | None) -> list[str]:
    have = {r[0] for r in conn.execute(
        f"SELECT table_name FROM duckdb_tables() WHERE database_name = '{CATALOG}' AND schema_name = 'main'").fetchall()}
    want = list(tables) if tables else list(DEFAULT_TABLES)
    never = [t for t in want if t in NEVER]
    if never:
        raise PublishRefused(f"{', '.join(never)}: the schema's own bookkeeping, never published")
    unknown = [t for t in want if t not in have]
    if unknown:
        import difflib

        hints = [f"{t} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(t, sorted(have), 1)) else t
                 for t in unknown]
        raise PublishRefused(f"no such table to publish: {', '.join(hints)}")
    return [t for t in dict.fromkeys(want) if t in have]



def _change_feed_covers(conn: duckdb.DuckDBPyConnection, prev: dict[str, Any] | None, snap: int, wid: str) -> str:
    """Why the change feed cannot be used since ``prev`` ('' when it can)."""
    if prev is None:
        return "first publication"
    if prev["warehouse_id"] != wid:
        return "published from another warehouse before"
    if int(prev["snapshot_id"]) > snap:
        return f"snapshot {snap} is older than the one published ({prev['snapshot_id']})"
    (first,) = conn.execute(f"SELECT min(snapshot_id) FROM {CATALOG}.snapshots()").fetchone()
    if int(first) > int(prev["snapshot_id"]):
        return f"the warehouse no longer keeps snapshot {prev['snapshot_id']} (expired by maintain)"
    # a warehouse restored from a copy numbers its snapshots again: the same id, another time
    row = conn.execute(f"SELECT snapshot_time FROM {CATALOG}.snapshots() WHERE snapshot_id = $s",
                       {"s": int(prev["snapshot_id"])}).fetchone()
    if row is None or _utc_naive(row[0]) != _utc_naive(prev["snapshot_time"]):
        return f"the warehouse's snapshot {prev['snapshot_id']} is not the one published (restored from a copy?)"
    return ""


def _stamp(wid: str, snap: int, snap_time: datetime) -> str:
    """Which warehouse snapshot a table's files hold, as ``hf/.published.json`` records it."""
    return f"{wid}|{snap}|{_utc_naive(snap_time).isoformat()}"


def _utc_naive(t: datetime) -> datetime:
    return t.astimezone(timezone.utc).replace(tzinfo=None) if t.tzinfo else t


def _count(conn: duckdb.DuckDBPyConnection, sql: str) -> int:
    return int(conn.execute(f"SELECT count(*) FROM {sql}").fetchone()[0])
