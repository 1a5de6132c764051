"""Find features offline: by words (``search``), by likeness (``similar``), by token
(``by_token``), and one feature as a person reads it (``show``).

The answers come from the *find index*, a derived DuckDB file beside the warehouse
(``Settings.find_index_dir``, ``find/`` in the warehouse folder): DuckDB's ``fts`` index needs
a native DuckDB table, which a DuckLake cannot hold. It is never the source of truth: any
time it can be rebuilt from the warehouse (``build_index``), and it records the snapshot it was
built from, so a query can say when the warehouse has changed since (``Found.note``).

What it holds:

* ``index.duckdb``: the features (key, largest activation, top positive logits), their
  explanations with a BM25 index over the descriptions (Porter stemmer), a copy of
  ``feature_token_stats`` with the token folded three ways (for ``by-token``), and which row
  of the embedding matrices belongs to which explanation.
* ``emb-<generation>.f32`` and ``.f64``: every explanation embedding, one row of 256 values
  each: as float32, normalised (the scan), and as received (float64, the exact re-ranking).

A refresh (``refresh_index``, after each load) copies ``index.duckdb``, replaces in the copy
the rows of the features that changed since its snapshot (DuckLake's change feed names them)
and moves the copy over the old one (``os.replace``): a query that opened the old file reads it
to the end. The matrices are append-only: new rows go after the old ones, which the old
``index.duckdb`` never reads past, and replaced rows are only marked dead. A build from scratch
writes a new generation.

``similar`` is exact: a float32 scan of all rows gives, per feature, its best cosine with the
query's embeddings; every feature within ``_F32_MARGIN`` of the k-th best is scored again in
float64 from the embeddings as received, which is what a brute-force cosine over the warehouse
computes. (An HNSW index, DuckDB's ``vss``, is approximate; the scan is ~30 ms for 262,144
rows, so none is needed.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import html
import json
import logging
import math
import os
import re
import shutil
import sqlite3
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from ..config import Settings
from ..lake import warehouse as warehouse_mod
from ..lake.extensions import new_connection
from .text import density, rounded, visible_token

__all__ = [
    "Finder", "Found", "FindIndexMissing", "FindIndexDamaged", "FindIndexForeign", "FindIndexUnwritable",
    "FindIndexStale", "NoSuchFeature", "IndexInfo",
    "build_index", "refresh_index", "index_info", "search", "similar", "by_token", "show",
    "render_html", "parse_key", "EMBEDDING_DIM",
]

log = logging.getLogger("featurehouse")

EMBEDDING_DIM = 256  # records.EMBEDDING_DIM; not imported: the stages pull in the whole ingest
INDEX_VERSION = 5  # 2: the warehouse's identity and its find tables' fingerprint in meta; 3: its snapshot's time;
# 4: every word of a description indexed (no stop words); 5: each feature's strongest excerpt
_F32_MARGIN = 1e-4  # far above float32's error on a cosine of 256 values (~1e-6)
_FIND_TABLES = ("explanations", "features", "feature_activation_stats", "feature_token_stats", "activations")
_REFRESH_WHOLE_SHARE = 0.25  # past this share of changed features, a refresh builds anew
#: Leading marks of a word-initial token: a space, SentencePiece's ▁, GPT-2's Ġ.
_LEADING = " \u2581\u0120"


class FindIndexMissing(FileNotFoundError):
    "There is no find index yet: `featurehouse index` (or any ingest that refreshes it) builds it."


class FindIndexDamaged(FindIndexMissing):
    "The find index cannot be read (a damaged or partial file, another release's): it is rebuilt."


class FindIndexForeign(FindIndexMissing):
    "The find index was built from another warehouse (a shared FEATUREHOUSE_FIND_DIR): it is rebuilt."


class FindIndexUnwritable(PermissionError):
    "The find index cannot be built or refreshed: its folder may not be written (or is a file)."


class FindIndexStale(RuntimeError):
    "The find index is older than the warehouse and the caller asked for a fresh answer."


class QueryHoldsNoWord(ValueError):
    """A search query of punctuation alone: the index holds words (letters and digits) only."""


class NoSuchSource(ValueError):
    """``model``/``source`` naming none the find index holds (the message names the nearest)."""


class NoSuchFeature(LookupError):
    "The feature is not in the warehouse (or not in the find index yet)."


@dataclass
class Found:
    """An answer: named columns and rows (tuples), and a note when the index is older than the
    warehouse. ``as_dicts()`` for rows as dicts, ``to_arrow()`` for an Arrow table."""

    columns: list[str]
    rows: list[tuple]
    note: str | None = None

    def as_dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, r)) for r in self.rows]

    def to_arrow(self):
        """The answer as an Arrow table, typed by its columns whether or not it has rows."""
        import pyarrow as pa

        types = {c: _ARROW_TYPES[c](pa) for c in self.columns if c in _ARROW_TYPES}
        if len(types) == len(self.columns):
            return pa.Table.from_pylist(self.as_dicts(), schema=pa.schema(list(types.items())))
        return pa.Table.from_pylist(self.as_dicts()) if self.rows else pa.table(
            {c: pa.array([], types.get(c, pa.string())) for c in self.columns})

    def __len__(self) -> int:
        return len(self.rows)


#: The Arrow type of each column an answer can hold (pyarrow is imported only by to_arrow).
_ARROW_TYPES: dict[str, Any] = {
    "model_id": lambda pa: pa.string(), "source_id": lambda pa: pa.string(),
    "feature_index": lambda pa: pa.int64(), "description": lambda pa: pa.string(),
    "explanation_model": lambda pa: pa.string(), "score": lambda pa: pa.float64(),
    "max_activation": lambda pa: pa.float64(), "similarity": lambda pa: pa.float64(),
    "basis": lambda pa: pa.string(), "max_activation_on_token": lambda pa: pa.float64(),
    "n_peak_excerpts": lambda pa: pa.int64(), "n_active": lambda pa: pa.int64(),
    "tokens": lambda pa: pa.list_(pa.string()),
}


def _check_limit(limit: Any) -> int:
    """``limit`` as the queries take it: a whole number of rows, at least 1."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise ValueError(f"limit must be a whole number of rows (at least 1), not {limit!r}")
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    return int(limit)


@dataclass(frozen=True)
class IndexInfo:
    """What a build or refresh did."""

    snapshot_id: int
    mode: str  # built | refreshed | current
    n_features: int
    n_explanations: int
    n_embeddings: int
    n_changed_features: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def parse_key(key: str | tuple[str, str, int]) -> tuple[str, str, int]:
    """``MODEL/SOURCE/INDEX`` → its parts (a model id may itself hold a slash: the last two
    parts are the source and the index). A ``(model, source, index)`` tuple is taken as it is
    (a source id holding a slash can only be named so: the web app's URLs keep each part whole)."""
    if isinstance(key, tuple):
        model, source, index = key
        if not model or not source or isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"{key!r} is not a feature key: (model, source, index)")
        return str(model), str(source), index
    parts = key.strip().split("/")
    if len(parts) < 3 or not parts[-1].lstrip("-").isdigit() or not parts[-2] or not parts[0]:
        raise ValueError(f"{key!r} is not a feature key: write MODEL/SOURCE/INDEX, e.g. gpt-oss-20b/11-resid-post-aa/45698")
    return "/".join(parts[:-2]), parts[-2], int(parts[-1])


# --- where the index lives, and the lake's version ----------------------------------------------


def _paths(settings: Settings) -> tuple[Path, Path]:
    d = settings.find_index_dir
    return d, d / "index.duckdb"


def _connect_index(path: Path, *, read_only: bool) -> duckdb.DuckDBPyConnection:
    """The index file attached (as ``idx``, in use) to a new in-memory DuckDB. Not
    ``duckdb.connect(path)``: DuckDB shares one instance per path within a process, so a
    process that still holds the old index open would be handed the old file after a refresh
    replaced it."""
    conn = new_connection(["fts"])  # DuckDB's own signature check, never the network
    try:
        conn.execute(f"ATTACH {warehouse_mod.literal(str(path))} AS idx{' (READ_ONLY)' if read_only else ''}")
        conn.execute("USE idx")
    except BaseException:
        conn.close()
        raise
    return conn


def _relevant(changes: str | None, table_ids: set[int]) -> bool:
    """Whether a snapshot's ``changes_made`` touched one of the tables the index reads."""
    for _kind, tid in re.findall(r"(inserted_into_table|deleted_from_table|altered_table|dropped_table):(\d+)",
                                changes or ""):
        if int(tid) in table_ids:
            return True
    return "created_table" in (changes or "") and any(t in (changes or "") for t in _FIND_TABLES)


@dataclass(frozen=True)
class LakeState:
    """What the catalog says about the warehouse, as the find index compares it with its own
    record: ``identity`` names the warehouse (its find tables' uuids: a copy has the same, any
    other warehouse others), ``fingerprint`` the find tables' contents (row counts and next row
    ids: any insert or delete moves them, merging files does not), ``n_changes`` how many
    snapshots after the index's changed a find table, or -1 when that cannot be told (the
    snapshots in between were expired by `maintain`) and the fingerprint moved."""

    latest: int
    n_changes: int
    identity: str
    fingerprint: str
    #: when the asked-for snapshot was committed (UTC, ISO), None when the catalog has no such
    #: snapshot (expired, or not reached): two diverged copies of a warehouse reach the same
    #: snapshot id with the same table uuids, never at the same microsecond
    snapshot_time: str | None = None

    def same_as(self, meta: dict[str, str], snapshot_id: int) -> bool:
        """Whether an index whose metadata is ``meta`` (built at ``snapshot_id``) was built from
        this warehouse, in this state of its history: the same tables, and the index's snapshot
        here is the one it read (not a diverged copy's, nor one this warehouse never reached)."""
        if self.identity != meta.get("warehouse_id") or snapshot_id > self.latest:
            return False
        return self.snapshot_time is None or self.snapshot_time == meta.get("snapshot_time")


def _utc(value: Any) -> str | None:
    """A catalog's snapshot time (text from SQLite, a timestamp from DuckDB or PostgreSQL) as
    one canonical string."""
    if value is None:
        return None
    t = value if isinstance(value, datetime) else datetime.fromisoformat(str(value).strip())
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).isoformat()


def lake_state(settings: Settings, snapshot_id: int, fingerprint: str | None = None) -> LakeState:
    """The warehouse's latest snapshot, identity and fingerprint, and how many snapshots after
    ``snapshot_id`` changed a table the index reads; read from the catalog's own tables, never
    through DuckLake (whose extension costs a query a second to load)."""
    names = ", ".join(warehouse_mod.literal(t) for t in _FIND_TABLES)
    sql = {
        "ids": f"SELECT table_id FROM {{c}}ducklake_table WHERE table_name IN ({names})",
        "latest": "SELECT max(snapshot_id) FROM {c}ducklake_snapshot",
        "kept": f"SELECT count(*) FROM {{c}}ducklake_snapshot WHERE snapshot_id >= {int(snapshot_id)}",
        "changes": f"SELECT changes_made FROM {{c}}ducklake_snapshot_changes WHERE snapshot_id > {int(snapshot_id)}",
        "at": f"SELECT snapshot_time FROM {{c}}ducklake_snapshot WHERE snapshot_id = {int(snapshot_id)}",
        # live rows: the live data files' rows less their live deletes (the table's stats
        # count no delete); next row id: moved by every insert; neither by merging files
        "tables": f"""SELECT t.table_name, CAST(t.table_uuid AS VARCHAR),
                             coalesce((SELECT sum(d.record_count) FROM {{c}}ducklake_data_file AS d
                                       WHERE d.table_id = t.table_id AND d.end_snapshot IS NULL), 0)
                             - coalesce((SELECT sum(x.delete_count) FROM {{c}}ducklake_delete_file AS x
                                         WHERE x.table_id = t.table_id AND x.end_snapshot IS NULL), 0),
                             s.next_row_id
                      FROM {{c}}ducklake_table AS t LEFT JOIN {{c}}ducklake_table_stats AS s USING (table_id)
                      WHERE t.end_snapshot IS NULL AND t.table_name IN ({names}) ORDER BY t.table_name""",
    }
    if settings.catalog_kind == "sqlite":
        path = Path(settings.catalog_url.removeprefix("sqlite:"))
        if not path.exists():
            raise warehouse_mod.WarehouseMissing(f"no warehouse at {settings.warehouse}: run `featurehouse ingest` first")
    if settings.catalog_kind == "sqlite" and not warehouse_mod.extension_loaded("sqlite_scanner"):
        # Python's sqlite3, read-only, for a few milliseconds. Not in a process whose DuckDB
        # has the catalog open (it has loaded the SQLite scanner): two SQLite libraries in one
        # process do not see each other's locks (see warehouse._catalog_state).
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
            got = {k: db.execute(q.format(c="")).fetchall() for k, q in sql.items()}
    elif settings.catalog_kind == "sqlite":
        with new_connection(["sqlite_scanner"]) as db:
            db.execute(f"ATTACH {warehouse_mod.literal(str(path))} AS cat (TYPE sqlite, READ_ONLY)")
            got = {k: db.execute(q.format(c="cat.")).fetchall() for k, q in sql.items()}
    else:
        with warehouse_mod.connect(settings, read_only=True) as lake:
            c = f"__ducklake_metadata_{warehouse_mod.CATALOG}."
            got = {k: lake.execute(q.format(c=c)).fetchall() for k, q in sql.items()}
    ids = {int(tid) for (tid,) in got["ids"]}
    latest = int(got["latest"][0][0] or 0)
    tables = [(n, u, None if rc is None else int(rc), None if nr is None else int(nr)) for n, u, rc, nr in got["tables"]]
    identity = hashlib.sha256(json.dumps([(n, u) for n, u, _, _ in tables]).encode()).hexdigest()[:24]
    now = json.dumps(tables)
    n_changes = sum(1 for (c,) in got["changes"] if _relevant(c, ids))
    complete = latest >= snapshot_id and int(got["kept"][0][0]) == latest - snapshot_id + 1
    if not complete and not n_changes:
        # some of the change feed since the index's snapshot was expired: the fingerprint decides
        n_changes = 0 if fingerprint == now else -1
    return LakeState(latest, n_changes, identity, now, _utc(got["at"][0][0]) if got["at"] else None)


def lake_changes_since(settings: Settings, snapshot_id: int, fingerprint: str | None = None) -> tuple[int, int]:
    """(the warehouse's latest snapshot, how many snapshots after ``snapshot_id`` changed a
    table the index reads; -1: some did, how many cannot be told); see :func:`lake_state`."""
    state = lake_state(settings, snapshot_id, fingerprint)
    return state.latest, state.n_changes


def _unwritable(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return True
    return isinstance(exc, duckdb.Error) and ("Permission denied" in str(exc) or "Read-only file system" in str(exc))


LOCK_TIMEOUT = 900.0  # seconds a builder waits for another's build before it gives up


@contextlib.contextmanager
def _build_lock(directory: Path, timeout: float | None = None) -> Iterator[None]:
    """One builder or refresher of an index at a time (readers never wait). An advisory lock
    on ``.lock``, which the system releases with its holder: a file left behind by a killed
    builder holds nothing. A folder this user may not write is :class:`FindIndexUnwritable`."""
    timeout = LOCK_TIMEOUT if timeout is None else timeout
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # opened without truncating (a leftover file's bytes do not matter)
        try:
            fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:
            # a lock file another user left: flock needs only a descriptor, not write access;
            # whether the folder may be written the build itself finds out
            fd = os.open(directory / ".lock", os.O_RDONLY)
    except OSError as exc:
        if _unwritable(exc):
            raise FindIndexUnwritable(f"the find index in {directory} cannot be built or refreshed: permission "
                                      f"denied ({exc.strerror}); `featurehouse index` as a user who may write there, "
                                      "or set FEATUREHOUSE_FIND_DIR to a folder you may write") from None
        if isinstance(exc, (FileExistsError, NotADirectoryError)):
            raise FindIndexUnwritable(f"the find index cannot be built in {directory}: it is not a folder "
                                      f"({exc.strerror}); move the file away or set FEATUREHOUSE_FIND_DIR to a "
                                      "folder") from None
        raise
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building the find index in {directory} for "
                                       f"over {timeout:.0f}s; try again later") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _open_index(directory: Path, path: Path) -> tuple[duckdb.DuckDBPyConnection, dict[str, str]]:
    """The index opened read-only and its metadata, checked whole enough to answer from: any
    file that is not (damaged, cut short, another release's) is :class:`FindIndexDamaged`."""
    if not path.exists():
        raise FindIndexMissing(f"no find index in {directory}: run `featurehouse index`")
    try:
        conn = _connect_index(path, read_only=True)
    except duckdb.Error as exc:
        raise FindIndexDamaged(f"the find index {path} cannot be read ({str(exc).splitlines()[0]})") from None
    try:
        try:
            meta = _read_meta(conn)
            if int(meta.get("version") or 0) != INDEX_VERSION:
                raise FindIndexDamaged(f"the find index {path} was built by another release (version "
                                       f"{meta.get('version')}, this one reads {INDEX_VERSION})")
            n = int(meta["n_rows"])
            int(meta["snapshot_id"])
            for ext, width in (("f32", 4), ("f64", 8)):
                m = directory / f"emb-{meta['generation']}.{ext}"
                size = m.stat().st_size if m.exists() else -1
                if size < n * EMBEDDING_DIM * width:
                    raise FindIndexDamaged(f"the find index's embedding matrix {m} is "
                                           f"{'missing' if size < 0 else 'cut short'}")
            _counts(conn)
            conn.execute("SELECT count(*) FROM fts_main_docs.stats").fetchone()
        except (duckdb.Error, KeyError, ValueError) as exc:
            raise FindIndexDamaged(f"the find index {path} is damaged ({str(exc).splitlines()[0]})") from None
    except BaseException:
        conn.close()
        raise
    return conn, meta


# --- building -----------------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR);
-- one row per feature with an explanation or activation statistics
CREATE TABLE features (fid INTEGER, model_id VARCHAR, source_id VARCHAR, feature_index BIGINT,
                       max_activation DOUBLE, pos_str VARCHAR[]);
-- one row per explanation; fts_main_docs indexes description
CREATE TABLE docs (doc_id INTEGER, fid INTEGER, explanation_id VARCHAR, description VARCHAR,
                   explanation_model VARCHAR);
-- row of the embedding matrices → its explanation's feature; live = false once replaced
CREATE TABLE emb_rows ("row" INTEGER, fid INTEGER, explanation_id VARCHAR, live BOOLEAN);
-- feature_token_stats, the token folded for --ignore-case / --strip
CREATE TABLE tokens (fid INTEGER, data_source VARCHAR, token VARCHAR, token_lower VARCHAR,
                     token_strip VARCHAR, token_lower_strip VARCHAR, max_activation DOUBLE,
                     n_active BIGINT, n_peak_excerpts BIGINT);
-- the fallback basis of `similar`: a feature's top activating tokens and top positive logits
CREATE TABLE basis_tokens (fid INTEGER, token VARCHAR);
-- a feature's strongest excerpt, EXCERPT_CONTEXT tokens each side of its peak (``peak``: the
-- peak's place in ``tokens``), as search and by-token show it beside each result; the key's ART
-- index finds 20 of 262,144 in ~1.5 ms (a scan decompressed every list of their row groups: ~35 ms)
CREATE TABLE excerpts (fid INTEGER PRIMARY KEY, data_source VARCHAR, max_value DOUBLE, peak INTEGER, tokens VARCHAR[],
                       "values" DOUBLE[]);
"""

#: Tokens each side of the peak in the excerpt the index keeps for each feature.
EXCERPT_CONTEXT = 6

_STRIP_SQL = "ltrim({t}, '" + _LEADING + "')"


def _lake_rows_sql(keys: str | None) -> dict[str, str]:
    """The queries (on the lake) that feed the index; ``keys``: a table of the features to read
    (model_id, source_id, feature_index), or None for all."""
    semi = f"SEMI JOIN {keys} USING (model_id, source_id, feature_index)" if keys else ""
    return {
        "features": f"""
            WITH f AS (
                SELECT model_id, source_id, feature_index, max(max_activation) AS max_activation
                FROM feature_activation_stats {semi} GROUP BY ALL
            ), keys AS (
                SELECT model_id, source_id, feature_index FROM explanations {semi}
                UNION SELECT model_id, source_id, feature_index FROM f
            )
            SELECT k.model_id, k.source_id, k.feature_index,
                   coalesce(f.max_activation, ft.max_act_approx) AS max_activation, ft.pos_str
            FROM keys AS k
            LEFT JOIN f USING (model_id, source_id, feature_index)
            LEFT JOIN features AS ft USING (model_id, source_id, feature_index)""",
        "docs": f"""SELECT model_id, source_id, feature_index, explanation_id, description, explanation_model
                    FROM explanations {semi}""",
        "emb": f"""SELECT model_id, source_id, feature_index, explanation_id, embedding
                   FROM explanations {semi}
                   WHERE embedding IS NOT NULL AND len(embedding) = {EMBEDDING_DIM}
                         -- one loaded before embedding_not_zero quarantined it: no direction
                         AND list_bool_or(list_transform(embedding, x -> x <> 0))""",
        "tokens": f"""SELECT model_id, source_id, feature_index, data_source, token, max_activation,
                             n_active, n_peak_excerpts
                      FROM feature_token_stats {semi}""",
        "top": f"""SELECT DISTINCT model_id, source_id, feature_index, t.token AS token
                   FROM (SELECT model_id, source_id, feature_index, unnest(top_tokens) AS t
                         FROM feature_activation_stats {semi})""",
        # the strongest excerpt of each feature, in two passes: its id (no token read), then the
        # token lists of those rows only
        "excerpts": f"""
            WITH best AS (SELECT activation_id FROM activations {semi}
                          QUALIFY row_number() OVER (PARTITION BY model_id, source_id, feature_index
                                                     ORDER BY max_value DESC NULLS LAST, activation_id) = 1)
            SELECT model_id, source_id, feature_index, data_source, max_value,
                   (max_value_token_index - greatest(max_value_token_index - {EXCERPT_CONTEXT}, 0))::INTEGER AS peak,
                   tokens[greatest(max_value_token_index - {EXCERPT_CONTEXT}, 0) + 1 :
                          max_value_token_index + {EXCERPT_CONTEXT} + 1] AS tokens,
                   "values"[greatest(max_value_token_index - {EXCERPT_CONTEXT}, 0) + 1 :
                            max_value_token_index + {EXCERPT_CONTEXT} + 1] AS "values"
            FROM activations SEMI JOIN best USING (activation_id)
            -- one a feature, whatever the ids (the index's key)
            QUALIFY row_number() OVER (PARTITION BY model_id, source_id, feature_index
                                       ORDER BY max_value DESC NULLS LAST, activation_id) = 1""",
    }


def _snapshot(lake: duckdb.DuckDBPyConnection) -> int:
    (sid,) = lake.execute(f"SELECT id FROM {warehouse_mod.CATALOG}.current_snapshot()").fetchone()
    return int(sid)


def _snapshot_time(lake: duckdb.DuckDBPyConnection, snapshot_id: int) -> str | None:
    """When the snapshot was committed, as :func:`lake_state` reports it (see :func:`_utc`)."""
    got = lake.execute(f"SELECT CAST(snapshot_time AS VARCHAR) FROM ducklake_snapshots({warehouse_mod.literal(warehouse_mod.CATALOG)}) "
                       f"WHERE snapshot_id = {int(snapshot_id)}").fetchone()
    return _utc(got[0]) if got else None


#: Embeddings turned into matrix rows at a time: 8,192 × 256 floats are 16 MB a copy.
_EMB_CHUNK = 8192


def _write_matrices(directory: Path, generation: str, lake: duckdb.DuckDBPyConnection, sql: str,
                    start_row: int, mode: str):
    """Append the embeddings ``sql`` selects to the generation's matrices from ``start_row`` on,
    a chunk at a time (bounded memory); returns an Arrow table of (row, model_id, source_id,
    feature_index, explanation_id), one per row written."""
    import numpy as np
    import pyarrow as pa

    keys: list[pa.Table] = []
    row = start_row
    with open(directory / f"emb-{generation}.f32", mode) as f32, open(directory / f"emb-{generation}.f64", mode) as f64:
        for f, width in ((f32, 4), (f64, 8)):
            f.truncate(start_row * EMBEDDING_DIM * width)  # a tail an interrupted refresh left
            f.seek(0, os.SEEK_END)
        # DuckDB hands the lists over as one flat array per chunk (no Python object per value),
        # in the order it reads them: an ORDER BY held every embedding in memory at once to sort
        # it (+550 MB at 262,144); a row's place means nothing (emb_rows says whose it is, and
        # similar breaks ties by fid)
        for batch in lake.execute(sql).to_arrow_reader(_EMB_CHUNK):
            n = batch.num_rows
            m = batch.column("embedding").flatten().to_numpy(zero_copy_only=False).astype(np.float64).reshape(n, EMBEDDING_DIM)
            norms = np.linalg.norm(m, axis=1, keepdims=True)
            unit = np.divide(m, norms, out=np.zeros_like(m), where=norms > 0)
            f64.write(m.tobytes())
            f32.write(unit.astype(np.float32).tobytes())
            # the keys copied out: an array imported from DuckDB keeps its whole batch alive,
            # embeddings included (pyarrow frees a batch's buffers together), and keeping the
            # batch's own key columns held every embedding read to the end (+640 MB at 262,144)
            every = pa.array(np.arange(n))
            keys.append(pa.table({"row": pa.array(range(row, row + n), pa.int32()),
                                  **{c: batch.column(c).take(every)
                                     for c in ("model_id", "source_id", "feature_index", "explanation_id")}}))
            row += n
        for f in (f32, f64):
            f.flush()
            os.fsync(f.fileno())
    schema = pa.schema([("row", pa.int32()), ("model_id", pa.string()), ("source_id", pa.string()),
                        ("feature_index", pa.int64()), ("explanation_id", pa.string())])
    return pa.concat_tables([k.cast(schema) for k in keys]) if keys else schema.empty_table()


def _load_rows(idx: duckdb.DuckDBPyConnection, lake: duckdb.DuckDBPyConnection, queries: dict[str, str],
               emb_rows: list[tuple]) -> None:
    """Insert what ``queries`` read from the lake into the index (new features get new fids)."""
    idx.execute("CREATE OR REPLACE TEMP TABLE lake_features AS SELECT * FROM (SELECT NULL::VARCHAR AS model_id, "
                "NULL::VARCHAR AS source_id, NULL::BIGINT AS feature_index, NULL::DOUBLE AS max_activation, "
                "NULL::VARCHAR[] AS pos_str) WHERE false")
    for name in ("features", "docs", "tokens", "top", "excerpts"):
        rel = lake.execute(queries[name]).fetch_arrow_table()
        idx.register("_rows", rel)
        idx.execute(f"CREATE OR REPLACE TEMP TABLE lake_{name} AS SELECT * FROM _rows")
        idx.unregister("_rows")
    idx.execute("""
        INSERT INTO features
        SELECT coalesce((SELECT max(fid) FROM features), -1) + row_number() OVER (ORDER BY model_id, source_id, feature_index),
               model_id, source_id, feature_index, max_activation, pos_str
        FROM lake_features""")
    key = "JOIN features AS f USING (model_id, source_id, feature_index)"
    idx.execute(f"""
        INSERT INTO docs
        SELECT coalesce((SELECT max(doc_id) FROM docs), -1) + row_number() OVER (ORDER BY d.model_id, d.source_id, d.feature_index, d.explanation_id),
               f.fid, d.explanation_id, d.description, d.explanation_model
        FROM lake_docs AS d {key}""")
    idx.execute(f"""
        INSERT INTO tokens
        SELECT f.fid, t.data_source, t.token, lower(t.token), {_STRIP_SQL.format(t='t.token')},
               lower({_STRIP_SQL.format(t='t.token')}), t.max_activation, t.n_active, t.n_peak_excerpts
        FROM lake_tokens AS t {key}""")
    idx.execute(f"""
        INSERT INTO basis_tokens
        SELECT DISTINCT fid, token FROM (
            SELECT f.fid, lower({_STRIP_SQL.format(t='t.token')}) AS token FROM lake_top AS t {key}
            UNION ALL
            SELECT f.fid, lower({_STRIP_SQL.format(t='p')}) FROM (SELECT fid, unnest(pos_str) AS p FROM features f
                                     SEMI JOIN lake_features USING (model_id, source_id, feature_index)) AS f
        ) WHERE token <> ''""")
    idx.execute(f"""INSERT INTO excerpts SELECT f.fid, e.data_source, e.max_value, e.peak, e.tokens, e."values"
                    FROM lake_excerpts AS e {key} ORDER BY f.fid""")  # by fid: a lookup skips by zone maps
    if emb_rows.num_rows:
        idx.register("lake_emb", emb_rows)
        idx.execute(f"INSERT INTO emb_rows SELECT e.\"row\", f.fid, e.explanation_id, true FROM lake_emb AS e {key}")
        idx.unregister("lake_emb")
    for name in ("features", "docs", "tokens", "top", "excerpts"):
        idx.execute(f"DROP TABLE IF EXISTS temp.main.lake_{name}")


def _fts(idx: duckdb.DuckDBPyConnection) -> None:
    # no stop words: a feature's description is a few words, and "first", "new", "somewhere" or
    # "about" carry its meaning (the fts extension's English list drops 571 such words, and a
    # search for one of them found nothing, saying nothing); BM25 weighs common words down itself
    idx.execute("PRAGMA create_fts_index('docs', 'doc_id', 'description', stemmer = 'porter', "
                "stopwords = 'none', overwrite = 1)")


#: Bring the fts extension's index tables (fts_main_docs: docs, terms, dict, stats) in line
#: with ``docs`` after a refresh replaced some of its rows, as create_fts_index would build them
#: (its indexing script: a term is a stemmed token that is not a stop word; df counts documents;
#: stats holds the number of documents and their mean length), without reading the other
#: 262,144 descriptions again (a rebuild takes ~3 s). tests/test_find.py checks the scores
#: equal a rebuild's.
_FTS_UPDATE = """
CREATE OR REPLACE TEMP TABLE fts_gone AS
    SELECT docid FROM fts_main_docs.docs WHERE name NOT IN (SELECT doc_id FROM docs);
UPDATE fts_main_docs.dict AS d SET df = d.df - g.n
    FROM (SELECT termid, count(DISTINCT docid) AS n FROM fts_main_docs.terms
          WHERE docid IN (SELECT docid FROM fts_gone) GROUP BY termid) AS g
    WHERE d.termid = g.termid;
DELETE FROM fts_main_docs.terms WHERE docid IN (SELECT docid FROM fts_gone);
DELETE FROM fts_main_docs.docs WHERE docid IN (SELECT docid FROM fts_gone);
CREATE OR REPLACE TEMP TABLE fts_new_docs AS
    SELECT (SELECT coalesce(max(docid), -1) FROM fts_main_docs.docs)
               + row_number() OVER (ORDER BY doc_id) AS docid, doc_id AS name, description
    FROM docs WHERE doc_id NOT IN (SELECT name FROM fts_main_docs.docs);
CREATE OR REPLACE TEMP TABLE fts_new_terms AS
    SELECT stem(w, 'porter') AS term, docid, 0::BIGINT AS fieldid
    FROM (SELECT unnest(fts_main_docs.tokenize(description)) AS w, docid FROM fts_new_docs)
    WHERE w IS NOT NULL AND len(w) > 0 AND w NOT IN (SELECT sw FROM fts_main_docs.stopwords);
INSERT INTO fts_main_docs.dict (termid, term, df)
    SELECT (SELECT coalesce(max(termid), -1) FROM fts_main_docs.dict) + row_number() OVER (ORDER BY term), term, 0
    FROM (SELECT DISTINCT term FROM fts_new_terms WHERE term NOT IN (SELECT term FROM fts_main_docs.dict));
INSERT INTO fts_main_docs.terms (docid, fieldid, termid)
    SELECT t.docid, t.fieldid, d.termid FROM fts_new_terms AS t JOIN fts_main_docs.dict AS d USING (term);
UPDATE fts_main_docs.dict AS d SET df = d.df + g.n
    FROM (SELECT termid, count(DISTINCT t.docid) AS n FROM fts_main_docs.terms AS t
          WHERE t.docid IN (SELECT docid FROM fts_new_docs) GROUP BY termid) AS g
    WHERE d.termid = g.termid;
INSERT INTO fts_main_docs.docs (docid, name, len)
    SELECT n.docid, n.name, count(t.term) FROM fts_new_docs AS n LEFT JOIN fts_new_terms AS t USING (docid)
    GROUP BY n.docid, n.name;
DELETE FROM fts_main_docs.stats;
INSERT INTO fts_main_docs.stats SELECT count(docid), sum(len) / count(len) FROM fts_main_docs.docs;
DROP TABLE fts_gone; DROP TABLE fts_new_docs; DROP TABLE fts_new_terms;
"""


def _meta(idx: duckdb.DuckDBPyConnection, **values: Any) -> None:
    for k, v in values.items():
        idx.execute(f"INSERT OR REPLACE INTO meta VALUES ({warehouse_mod.literal(k)}, {warehouse_mod.literal(None if v is None else str(v))})")


def _read_meta(idx: duckdb.DuckDBPyConnection) -> dict[str, str]:
    return dict(idx.execute("SELECT key, value FROM meta").fetchall())


def build_index(where: Settings | str | os.PathLike) -> IndexInfo:
    """Build the find index from scratch from the warehouse's last snapshot, as a new
    generation, and put it in place atomically."""
    return refresh_index(where, full=True)


def _build(settings: Settings, directory: Path, path: Path) -> IndexInfo:
    t0 = time.monotonic()
    generation = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    tmp = directory / f".index-{generation}.duckdb"
    # before the snapshot: a commit in between makes it look older, never newer
    state = lake_state(settings, 0)
    with warehouse_mod.connect(settings, read_only=True) as lake:
        with warehouse_mod.one_snapshot(lake):  # one snapshot for every read
            snapshot = _snapshot(lake)
            at = _snapshot_time(lake, snapshot)
            queries = _lake_rows_sql(None)
            emb_rows = _write_matrices(directory, generation, lake, queries["emb"], 0, "wb")
            with _connect_index(tmp, read_only=False) as idx:
                idx.execute(_SCHEMA)
                _load_rows(idx, lake, queries, emb_rows)
                _fts(idx)
                _meta(idx, version=INDEX_VERSION, snapshot_id=snapshot, generation=generation,
                      n_rows=emb_rows.num_rows, built_at=datetime.now(timezone.utc).isoformat(),
                      warehouse_id=state.identity, fingerprint=state.fingerprint, snapshot_time=at)
                counts = _counts(idx)
    os.replace(tmp, path)
    _drop_old_generations(directory, keep={generation})
    return IndexInfo(snapshot, "built", *counts, n_changed_features=counts[0], seconds=time.monotonic() - t0)


def _counts(idx: duckdb.DuckDBPyConnection) -> tuple[int, int, int]:
    return idx.execute("SELECT (SELECT count(*) FROM features), (SELECT count(*) FROM docs), "
                       "(SELECT count(*) FROM emb_rows WHERE live)").fetchone()


def _drop_old_generations(directory: Path, keep: set[str], grace_seconds: float = 600) -> None:
    """Remove matrices of generations no index names any more, once a reader that opened the
    index before it was replaced has had time to open them."""
    now = time.time()
    for p in directory.glob("emb-*.f*"):
        gen = p.name[4:].rsplit(".", 1)[0]
        if gen not in keep and now - p.stat().st_mtime > grace_seconds:
            p.unlink(missing_ok=True)
    for p in directory.glob(".index-*.duckdb*"):
        if now - p.stat().st_mtime > grace_seconds:
            p.unlink(missing_ok=True)


def refresh_index(where: Settings | str | os.PathLike, *, full: bool = False) -> IndexInfo:
    """Bring the find index up to the warehouse's last snapshot: only the features that
    changed since the index's snapshot (DuckLake's change feed) when it can, else from scratch
    (no index yet, ``full``, the snapshots it needs have expired, or most features changed).
    The nightly and inbox DAGs call this after each load."""
    settings = warehouse_mod.settings_for(where)
    directory, path = _paths(settings)
    if not warehouse_mod.exists(settings):  # before the lock: nothing made where no warehouse is
        raise warehouse_mod.WarehouseMissing(f"no warehouse at {settings.warehouse}: run `featurehouse ingest` first")
    try:
        with _build_lock(directory):
            return _refresh_locked(settings, directory, path, full)
    except FindIndexUnwritable:
        # a folder this user may not write: an index that is current needs no writing
        if not full and (info := _current(settings, directory, path)) is not None:
            return info
        raise
    except (OSError, duckdb.Error) as exc:
        if not _unwritable(exc):
            raise
        raise FindIndexUnwritable(f"the find index in {directory} cannot be built or refreshed: permission denied "
                                  f"({str(exc).splitlines()[0]})") from None


def _current(settings: Settings, directory: Path, path: Path) -> IndexInfo | None:
    """The index as it is, when it is whole, this warehouse's and current; else None."""
    t0 = time.monotonic()
    try:
        idx, meta = _open_index(directory, path)
    except FindIndexMissing:
        return None
    with idx:
        counts = _counts(idx)
    since = int(meta["snapshot_id"])
    state = lake_state(settings, since, meta.get("fingerprint"))
    if not state.same_as(meta, since) or state.n_changes:
        return None
    return IndexInfo(since, "current", *counts, n_changed_features=0, seconds=time.monotonic() - t0)


def _refresh_locked(settings: Settings, directory: Path, path: Path, full: bool) -> IndexInfo:
    if full or not path.exists():
        return _build(settings, directory, path)
    t0 = time.monotonic()
    try:
        idx, meta = _open_index(directory, path)
    except FindIndexDamaged as why:
        log.warning("find index: building anew (%s)", why)
        return _build(settings, directory, path)
    with idx:
        counts = _counts(idx)
    since = int(meta["snapshot_id"])
    state = lake_state(settings, since, meta.get("fingerprint"))
    if not state.same_as(meta, since):
        log.warning("find index: building anew (%s was built from another warehouse, or another copy of it)", path)
        return _build(settings, directory, path)
    if state.n_changes == 0:
        return IndexInfo(since, "current", *counts, n_changed_features=0, seconds=time.monotonic() - t0)
    if state.n_changes < 0:
        log.info("find index: building anew (the history since snapshot %s was expired)", since)
        return _build(settings, directory, path)
    try:
        return _refresh(settings, directory, path, meta, t0)
    except _RebuildInstead as why:
        log.info("find index: building anew (%s)", why)
        return _build(settings, directory, path)


class _RebuildInstead(Exception):
    "An incremental refresh cannot be made."


def _refresh(settings: Settings, directory: Path, path: Path, meta: dict[str, str], t0: float) -> IndexInfo:
    since, generation, n_rows = int(meta["snapshot_id"]), meta["generation"], int(meta["n_rows"])
    state = lake_state(settings, since)
    with warehouse_mod.connect(settings, read_only=True) as lake:
        with warehouse_mod.one_snapshot(lake):  # one snapshot for every read
            snapshot = _snapshot(lake)
            at = _snapshot_time(lake, snapshot)
            parts = []
            for t in _FIND_TABLES:
                parts.append(f"""SELECT model_id, source_id, feature_index
                                 FROM ducklake_table_changes('{warehouse_mod.CATALOG}', 'main', '{t}', {since + 1}, {snapshot})""")
            try:
                lake.execute("CREATE TEMP TABLE changed_keys AS " + " UNION ".join(parts))
            except duckdb.Error as exc:  # snapshots expired by maintenance, a table made since
                raise _RebuildInstead(f"the change feed since snapshot {since} cannot be read: {exc}") from None
            (n_changed,) = lake.execute("SELECT count(*) FROM changed_keys").fetchone()
            tmp = directory / f".index-{generation}-{uuid.uuid4().hex[:6]}.duckdb"
            shutil.copyfile(path, tmp)
            try:
                with _connect_index(tmp, read_only=False) as idx:
                    (n_features,) = idx.execute("SELECT count(*) FROM features").fetchone()
                    if n_changed > max(1000, _REFRESH_WHOLE_SHARE * n_features):
                        raise _RebuildInstead(f"{n_changed:,} of {n_features:,} features changed")
                    idx.register("_changed", lake.execute("SELECT * FROM changed_keys").fetch_arrow_table())
                    idx.execute("CREATE TEMP TABLE changed_keys AS SELECT * FROM _changed")
                    idx.unregister("_changed")
                    idx.execute("""CREATE TEMP TABLE changed_fids AS SELECT fid FROM features
                                   SEMI JOIN changed_keys USING (model_id, source_id, feature_index)""")
                    for t in ("docs", "tokens", "basis_tokens", "excerpts"):
                        idx.execute(f"DELETE FROM {t} WHERE fid IN (SELECT fid FROM changed_fids)")
                    idx.execute("UPDATE emb_rows SET live = false WHERE fid IN (SELECT fid FROM changed_fids)")
                    idx.execute("DELETE FROM features WHERE fid IN (SELECT fid FROM changed_fids)")
                    # the changed features' rows, read again (a feature now gone reads as none)
                    lake.execute("CREATE TEMP TABLE changed AS SELECT DISTINCT * FROM changed_keys")
                    queries = _lake_rows_sql("changed")
                    emb_rows = _write_matrices(directory, generation, lake, queries["emb"], n_rows, "r+b")
                    # a changed feature takes a new fid: its old one is left only on dead rows
                    _load_rows(idx, lake, queries, emb_rows)
                    idx.execute(_FTS_UPDATE)
                    _meta(idx, snapshot_id=snapshot, n_rows=n_rows + emb_rows.num_rows,
                          refreshed_at=datetime.now(timezone.utc).isoformat(), fingerprint=state.fingerprint,
                          snapshot_time=at)
                    counts = _counts(idx)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
    return IndexInfo(snapshot, "refreshed", *counts, n_changed_features=n_changed, seconds=time.monotonic() - t0)


def index_info(where: Settings | str | os.PathLike) -> dict[str, Any]:
    """The find index's metadata and counts, and whether the warehouse changed since."""
    settings = warehouse_mod.settings_for(where)
    directory, path = _paths(settings)
    idx, meta = _open_index(directory, path)
    with idx:
        counts = _counts(idx)
    state = lake_state(settings, int(meta["snapshot_id"]), meta.get("fingerprint"))
    return {**meta, "n_features": counts[0], "n_explanations": counts[1], "n_embeddings": counts[2],
            "lake_snapshot_id": state.latest, "changes_since": state.n_changes, "path": str(path),
            "same_warehouse": state.same_as(meta, int(meta["snapshot_id"]))}


# --- reading ------------------------------------------------------------------------------------


class Finder:
    """The find index opened for queries. Keep one for many queries (a notebook, a service):
    the embedding matrices stay mapped and the feature keys loaded.

    ``fresh``: "warn" (default) answers from the index and puts a note in each answer when the
    warehouse changed since it was built; "refresh" refreshes it first; "error" raises
    :class:`FindIndexStale`.
    """

    def __init__(self, where: Settings | str | os.PathLike, *, fresh: str = "warn"):
        if fresh not in ("warn", "refresh", "error"):
            raise ValueError("fresh is one of: warn, refresh, error")
        self.settings = warehouse_mod.settings_for(where)
        self.directory, self.path = _paths(self.settings)
        self.fresh = fresh
        # a path that is no warehouse: said before anything is made there (no find/.lock)
        if not warehouse_mod.exists(self.settings):
            raise warehouse_mod.WarehouseMissing(
                f"no warehouse at {self.settings.warehouse}: run `featurehouse ingest` first")
        unwritable: FindIndexUnwritable | None = None
        if fresh == "refresh":
            try:
                refresh_index(self.settings)
            except FindIndexUnwritable as exc:  # answered from the index as it is, if current
                unwritable = exc
        if not self.path.exists():
            if unwritable is not None:
                raise unwritable
            raise FindIndexMissing(
                f"no find index for the warehouse at {self.settings.warehouse}: build it with "
                "`featurehouse index` (ingest refreshes it from then on)")
        self.conn, self.meta, self.snapshot_id, self.note, self._stamp = self._open(unwritable)
        self._matrix: tuple | None = None

    def _stamp_now(self) -> tuple:
        """What tells a replaced index file (a refresh's os.replace) and a changed catalog apart
        from the ones this Finder opened: their inode, size and modification time."""
        def stat(p: Path) -> tuple | None:
            try:
                st = os.stat(p)
            except OSError:
                return None
            return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

        catalog = (Path(self.settings.catalog_url.removeprefix("sqlite:"))
                   if self.settings.catalog_kind == "sqlite" else None)
        return (stat(self.path),
                *((stat(catalog), stat(Path(f"{catalog}-wal"))) if catalog is not None else ()))

    def _open(self, unwritable: FindIndexUnwritable | None = None):
        """The index file opened and checked against the warehouse: (conn, meta, snapshot id,
        note, stamp). Raises as the constructor documents."""
        stamp = self._stamp_now()
        conn, meta = _open_index(self.directory, self.path)
        try:
            snapshot_id = int(meta["snapshot_id"])
            note, check = self._check(meta, snapshot_id)
            if note is not None:
                if unwritable is not None:
                    raise FindIndexUnwritable(f"{unwritable}; {note}")
                check()
        except BaseException:
            conn.close()
            raise
        return conn, meta, snapshot_id, note, stamp

    def _check(self, meta: dict[str, str], snapshot_id: int):
        """(the note for an index older than the warehouse or None, a function raising
        FindIndexStale when fresh="error"); FindIndexForeign for another warehouse's index."""
        state = lake_state(self.settings, snapshot_id, meta.get("fingerprint"))
        if not state.same_as(meta, snapshot_id):
            raise FindIndexForeign(
                f"the find index in {self.directory} was built from another warehouse than the one at "
                f"{self.settings.warehouse} (a shared FEATUREHOUSE_FIND_DIR? a copy of the warehouse that has "
                "loaded other pages since?): `featurehouse index` builds it for this one")
        note = None
        if state.n_changes:
            what = (f"{state.n_changes} commit(s) up to snapshot {state.latest}" if state.n_changes > 0 else
                    f"up to snapshot {state.latest}; the history in between was expired")
            note = (f"the find index was built from snapshot {snapshot_id} and the warehouse has "
                    f"changed since ({what}): the answer may be out of date; run `featurehouse index` "
                    "(or pass --refresh)")

        def check() -> None:
            if self.fresh == "error":
                raise FindIndexStale(note)
        return note, check

    def _follow(self) -> None:
        """Before each query: when another process replaced the index file (a refresh after its
        load) or committed to the catalog since, reopen it or say anew whether it is current.
        One stat per file when nothing changed."""
        stamp = self._stamp_now()
        if stamp == self._stamp:
            return
        if stamp[0] != self._stamp[0]:
            conn, meta, snapshot_id, note, stamp = self._open()
            old, self.conn = self.conn, conn
            self.meta, self.snapshot_id, self.note, self._stamp, self._matrix = meta, snapshot_id, note, stamp, None
            old.close()
        else:
            note, check = self._check(self.meta, self.snapshot_id)
            self.note, self._stamp = note, stamp
            if note is not None:
                check()

    def close(self) -> None:
        self.conn.close()
        self._matrix = None

    def __enter__(self) -> Finder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- search --

    def search(self, query: str, *, model: str | None = None, source: str | None = None,
               limit: int = 10) -> Found:
        """Explanations whose description matches ``query`` (BM25 over Porter-stemmed words;
        a "quoted phrase" must also appear as written, case aside), best first."""
        limit = _check_limit(limit)
        self._follow()
        if not isinstance(query, str) or not query.replace('"', " ").strip():
            raise ValueError("the search query is empty: give one or more words, or a \"quoted phrase\"")
        phrases = [p.strip() for p in re.findall(r'"([^"]*)"', query) if p.strip()]
        words = query.replace('"', " ")
        if not self.conn.execute(warehouse_mod.bind(  # bound as a literal: a parameter imports pandas
                "SELECT len(list_filter(fts_main_docs.tokenize($q), w -> w <> ''))", {"q": words})).fetchone()[0]:
            raise QueryHoldsNoWord(f"the search query {query!r} holds no word (the index keeps words of letters; "
                             "digits and punctuation are not searched): give a word of a description, or a \"quoted phrase\"")
        where, params = self._narrow(model, source)
        phrase = ""
        for i, p in enumerate(phrases):
            # its longest word first (cheap), the phrase with runs of spaces folded only then
            phrase += (f" AND contains(lower(description), $w{i})"
                       f" AND strpos(lower(regexp_replace(description, '\\s+', ' ', 'g')), $p{i}) > 0")
            params[f"p{i}"] = re.sub(r"\s+", " ", p.lower())
            params[f"w{i}"] = max(p.lower().split(), key=len)
        # BM25 as the fts extension's match_bm25 computes it (k = 1.2, b = 0.75), over the
        # query's terms only, instead of the macro's one subquery per document
        sql = f"""
            WITH q AS (SELECT DISTINCT stem(unnest(fts_main_docs.tokenize($q)), 'porter') AS t),
            qt AS (SELECT d.termid, d.df FROM fts_main_docs.dict AS d JOIN q ON d.term = q.t),
            tf AS (SELECT t.docid, t.termid, count(*) AS tf FROM fts_main_docs.terms AS t
                   JOIN qt USING (termid) GROUP BY ALL),
            st AS (SELECT num_docs, avgdl FROM fts_main_docs.stats),
            scores AS (
                SELECT dd.name AS doc_id,
                       sum(log((st.num_docs - qt.df + 0.5) / (qt.df + 0.5) + 1)
                           * (tf.tf * 2.2 / (tf.tf + 1.2 * (0.25 + 0.75 * dd.len / st.avgdl)))) AS score
                FROM tf JOIN qt USING (termid) JOIN fts_main_docs.docs AS dd ON dd.docid = tf.docid, st
                GROUP BY dd.name),
            -- materialised: a phrase is checked on the matches only, not pushed down to every description
            matched AS MATERIALIZED (
                SELECT f.model_id, f.source_id, f.feature_index, d.description, d.explanation_model,
                       s.score, f.max_activation, d.explanation_id
                FROM scores AS s JOIN docs AS d ON d.doc_id = s.doc_id JOIN features AS f ON f.fid = d.fid
                WHERE true {where})
            SELECT model_id, source_id, feature_index, description, explanation_model,
                   round(score, 4) AS score, max_activation
            FROM matched WHERE true {phrase}
            ORDER BY matched.score DESC, model_id, source_id, feature_index, explanation_id
            LIMIT $limit"""
        params.update(q=words, limit=int(limit))
        return self._found(self.conn.execute(warehouse_mod.bind(sql, params)))

    def _narrow(self, model: str | None, source: str | None, alias: str = "f") -> tuple[str, dict]:
        """The filter of ``model``/``source``; :class:`NoSuchSource` when the index holds none of
        either (an answer of "no match" would say nothing of the typo)."""
        import difflib

        for kind, column, value in (("model", "model_id", model), ("source", "source_id", source)):
            if value and not self.conn.execute(warehouse_mod.bind(
                    f"SELECT 1 FROM features WHERE {column} = $v LIMIT 1", {"v": value})).fetchone():
                names = [n for (n,) in self.conn.execute(f"SELECT DISTINCT {column} FROM features").fetchall()]
                near = difflib.get_close_matches(value, names, 3, 0.6)
                raise NoSuchSource(f"the find index holds no {kind} {value!r}" + (
                    f" (did you mean {' or '.join(near)}?)" if near else f"; it holds {len(names):,} {kind}(s): "
                    f"featurehouse sql \"SELECT DISTINCT {column} FROM features\""))
        where, params = "", {}
        if model:
            where += f" AND {alias}.model_id = $model"
            params["model"] = model
        if source:
            where += f" AND {alias}.source_id = $source"
            params["source"] = source
        return where, params

    def excerpts(self, keys: list[tuple[str, str, int]]) -> dict[tuple[str, str, int], dict[str, Any]]:
        """The strongest excerpt of each feature of ``keys`` the index holds (its data source,
        max_value, tokens and values, EXCERPT_CONTEXT each side of the peak, and the peak's
        place in them), as of the index's snapshot: what search and by-token show beside each
        result, without reading the lake."""
        if not keys:
            return {}
        self._follow()
        want = {(m, s, int(i)) for m, s, i in keys}
        # by feature index (literals: the scan skips by zone maps), the model and source matched here
        fids = [f for f, m, s, i in self.conn.execute(
            "SELECT fid, model_id, source_id, feature_index FROM features WHERE feature_index IN "
            f"({', '.join(str(i) for _, _, i in want)})").fetchall() if (m, s, int(i)) in want]
        if not fids:
            return {}
        rows = self.conn.execute(f"""
            SELECT f.model_id, f.source_id, f.feature_index, e.data_source, e.max_value, e.peak, e.tokens, e."values"
            FROM excerpts AS e JOIN features AS f USING (fid)
            WHERE e.fid IN ({", ".join(map(str, fids))}) AND f.fid IN ({", ".join(map(str, fids))})""").fetchall()
        return {(m, s, int(i)): {"data_source": ds, "max_value": mx, "peak": pk, "tokens": t, "values": v}
                for m, s, i, ds, mx, pk, t, v in rows}

    def _found(self, cur: duckdb.DuckDBPyConnection) -> Found:
        return Found([d[0] for d in cur.description], cur.fetchall(), self.note)

    # -- similar --

    def _matrices(self):
        if self._matrix is None:
            import numpy as np

            n = int(self.meta["n_rows"])
            gen = self.meta["generation"]
            if n:
                m32 = np.memmap(self.directory / f"emb-{gen}.f32", dtype=np.float32, mode="r", shape=(n, EMBEDDING_DIM))
                m64 = np.memmap(self.directory / f"emb-{gen}.f64", dtype=np.float64, mode="r", shape=(n, EMBEDDING_DIM))
            else:
                m32 = np.zeros((0, EMBEDDING_DIM), np.float32)
                m64 = np.zeros((0, EMBEDDING_DIM), np.float64)
            rows = self.conn.execute('SELECT "row", fid FROM emb_rows WHERE live ORDER BY "row"').fetchnumpy()
            (n_fids,) = self.conn.execute("SELECT coalesce(max(fid), -1) + 1 FROM features").fetchone()
            self._matrix = (m32, m64, rows["row"].astype(np.int64), rows["fid"].astype(np.int64), int(n_fids))
        return self._matrix

    def _fid(self, key: str | tuple[str, str, int]) -> int:
        model, source, index = parse_key(key)
        found = self.conn.execute(warehouse_mod.bind("SELECT fid FROM features WHERE model_id = $m AND source_id = $s "
                                        "AND feature_index = $i", {"m": model, "s": source, "i": index})).fetchone()
        if not found:
            raise NoSuchFeature(f"{model}/{source}/{index} is not in the find index (no explanation and no "
                                "activations loaded for it; or the index is older than its load)")
        return int(found[0])

    def similar(self, key: str, *, model: str | None = None, source: str | None = None,
                limit: int = 10) -> Found:
        """The features nearest to ``key``: by cosine similarity of explanation embeddings
        (a feature's best pair), exactly as a brute-force cosine ranks them; for a feature
        without an embedding, by the overlap (Jaccard) of top activating tokens and top
        positive logits. Each row says which ``basis`` it used."""
        import numpy as np

        limit = _check_limit(limit)
        self._follow()
        fid = self._fid(key)
        m32, m64, rows, fids, n_fids = self._matrices()
        mine = rows[fids == fid]
        if len(mine) == 0:
            return self._similar_by_tokens(fid, model, source, limit)
        q32 = np.asarray(m32[mine], dtype=np.float32)
        # one pass over the whole matrix (dead rows too: cheaper than gathering the live ones)
        all_scores = np.asarray(m32 @ q32.T)
        row_scores = all_scores.max(axis=1)[rows]
        best = np.full(n_fids, -np.inf, dtype=np.float64)
        np.maximum.at(best, fids, row_scores.astype(np.float64))
        best[fid] = -np.inf
        allowed = self._allowed_fids(model, source, n_fids)
        if allowed is not None:
            best[~allowed] = -np.inf
        best[np.isnan(best)] = -np.inf
        k = int(limit)
        finite = np.flatnonzero(np.isfinite(best))
        if len(finite) == 0 or k <= 0:
            return Found(["model_id", "source_id", "feature_index", "similarity", "basis", "description"], [], self.note)
        kth = np.partition(best[finite], max(len(finite) - k, 0))[max(len(finite) - k, 0)]
        cand = finite[best[finite] >= kth - _F32_MARGIN]
        # exact: float64 cosines of the candidates' rows with the query's, from the values as received
        q64 = np.asarray(m64[mine], dtype=np.float64)
        qn = q64 / np.linalg.norm(q64, axis=1, keepdims=True)
        cand_rows_mask = np.isin(fids, cand)
        cr, cf = rows[cand_rows_mask], fids[cand_rows_mask]
        v = np.asarray(m64[cr], dtype=np.float64)
        vn = np.linalg.norm(v, axis=1)
        exact_rows = (qn @ v.T).max(axis=0) / np.where(vn > 0, vn, np.nan)
        exact = {}
        for f, sc in zip(cf.tolist(), exact_rows.tolist()):
            if not math.isnan(sc) and (f not in exact or sc > exact[f]):
                exact[f] = sc
        ranked = sorted(exact.items(), key=lambda t: (-t[1], t[0]))[:k]  # ties: by fid, not row order
        return self._rows_for(ranked, "embedding")

    def _allowed_fids(self, model: str | None, source: str | None, n_fids: int):
        if not model and not source:
            return None
        import numpy as np

        where, params = self._narrow(model, source)
        got = self.conn.execute(warehouse_mod.bind(f"SELECT fid FROM features AS f WHERE true {where}", params)).fetchnumpy()["fid"]
        allowed = np.zeros(n_fids, dtype=bool)
        allowed[got.astype(np.int64)] = True
        return allowed

    def _rows_for(self, ranked: list[tuple[int, float]], basis: str) -> Found:
        if not ranked:
            return Found(["model_id", "source_id", "feature_index", "similarity", "basis", "description"], [], self.note)
        order = {f: i for i, (f, _) in enumerate(ranked)}
        # a join from the few features (a correlated subquery aggregated every description: ~1 s)
        fids = ", ".join(str(int(f)) for f, _ in ranked)  # literals: the scans skip by zone maps
        got = self.conn.execute(f"""
            SELECT f.fid, f.model_id, f.source_id, f.feature_index, d.description
            FROM features AS f
            LEFT JOIN (SELECT fid, string_agg(description, ' | ' ORDER BY doc_id) AS description
                       FROM docs WHERE fid IN ({fids}) GROUP BY fid) AS d USING (fid)
            WHERE f.fid IN ({fids})""").fetchall()
        score = dict(ranked)
        rows = sorted(((m, s, i, round(score[f], 6), basis, d) for f, m, s, i, d in got),
                      key=lambda r: (-r[3], r[0], r[1], r[2]))
        del order
        return Found(["model_id", "source_id", "feature_index", "similarity", "basis", "description"], rows, self.note)

    def _similar_by_tokens(self, fid: int, model: str | None, source: str | None, limit: int) -> Found:
        where, params = self._narrow(model, source)
        params.update(fid=fid, limit=int(limit))
        got = self.conn.execute(warehouse_mod.bind(f"""
            WITH mine AS (SELECT token FROM basis_tokens WHERE fid = $fid),
            n_mine AS (SELECT count(*) AS n FROM mine),
            shared AS (SELECT b.fid, count(*) AS n_shared FROM basis_tokens AS b SEMI JOIN mine USING (token)
                       WHERE b.fid <> $fid GROUP BY b.fid),
            sizes AS (SELECT fid, count(*) AS n FROM basis_tokens WHERE fid IN (SELECT fid FROM shared) GROUP BY fid)
            SELECT s.fid, s.n_shared / (sz.n + (SELECT n FROM n_mine) - s.n_shared) AS jaccard
            FROM shared AS s JOIN sizes AS sz USING (fid) JOIN features AS f USING (fid)
            WHERE true {where}
            ORDER BY jaccard DESC, f.model_id, f.source_id, f.feature_index LIMIT $limit""", params)).fetchall()
        return self._rows_for([(int(f), float(j)) for f, j in got], "tokens")

    # -- by token --

    def by_token(self, token: str, *, ignore_case: bool = False, strip: bool = False,
                 model: str | None = None, source: str | None = None, data_source: str | None = None,
                 limit: int = 10) -> Found:
        """The features whose stored excerpts activate most on ``token``: ranked by their highest
        activation on it, with how many excerpts peak on it. ``ignore_case`` folds case;
        ``strip`` ignores a leading space, ``▁`` or ``Ġ`` (on both sides)."""
        limit = _check_limit(limit)
        self._follow()
        column = "token" + ("_lower" if ignore_case else "") + ("_strip" if strip else "")
        wanted = token.lstrip(_LEADING) if strip else token
        wanted = wanted.lower() if ignore_case else wanted
        where, params = self._narrow(model, source)
        if data_source is not None:
            where += " AND t.data_source IS NOT DISTINCT FROM $ds"
            params["ds"] = None if data_source.lower() in ("null", "(null)") else data_source
        params.update(tok=wanted, limit=int(limit))
        return self._found(self.conn.execute(warehouse_mod.bind(f"""
            SELECT f.model_id, f.source_id, f.feature_index,
                   max(t.max_activation) AS max_activation_on_token,
                   sum(t.n_peak_excerpts) AS n_peak_excerpts,
                   sum(t.n_active) AS n_active,
                   list(DISTINCT t.token ORDER BY t.token) AS tokens,
                   f.max_activation,
                   (SELECT string_agg(d.description, ' | ' ORDER BY d.doc_id) FROM docs d WHERE d.fid = f.fid) AS description
            FROM tokens AS t JOIN features AS f USING (fid)
            WHERE t.{column} = $tok {where}
            GROUP BY f.fid, f.model_id, f.source_id, f.feature_index, f.max_activation
            ORDER BY max_activation_on_token DESC, n_peak_excerpts DESC, f.model_id, f.source_id, f.feature_index
            LIMIT $limit""", params)))


def _with_finder(where, fresh: str, fn):
    with Finder(where, fresh=fresh) as f:
        return fn(f)


def search(where: Settings | str | os.PathLike, query: str, *, model: str | None = None,
           source: str | None = None, limit: int = 10, fresh: str = "warn") -> Found:
    """Full-text search over explanation descriptions (see :meth:`Finder.search`)."""
    return _with_finder(where, fresh, lambda f: f.search(query, model=model, source=source, limit=limit))


def similar(where: Settings | str | os.PathLike, key: str, *, model: str | None = None,
            source: str | None = None, limit: int = 10, fresh: str = "warn") -> Found:
    """Nearest features by explanation embedding (see :meth:`Finder.similar`)."""
    return _with_finder(where, fresh, lambda f: f.similar(key, model=model, source=source, limit=limit))


def by_token(where: Settings | str | os.PathLike, token: str, *, fresh: str = "warn", **kw: Any) -> Found:
    """Features that activate most on a token (see :meth:`Finder.by_token`)."""
    return _with_finder(where, fresh, lambda f: f.by_token(token, **kw))


# --- show ---------------------------------------------------------------------------------------


@dataclass
class FeatureView:
    """One feature as :func:`show` gathers it from the warehouse."""

    key: str
    feature: dict[str, Any] | None
    stats: list[dict[str, Any]]
    explanations: list[dict[str, Any]]
    excerpts: list[dict[str, Any]]
    neighbours: Found | None = None
    note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def show(where: Settings | str | os.PathLike, key: str | tuple[str, str, int], *, n_excerpts: int = 5, n_neighbours: int = 5,
         context: int = 12, lake: duckdb.DuckDBPyConnection | None = None, finder: Finder | None = None) -> FeatureView:
    """A feature as a person reads it: its statistics per data source, its explanations, its
    top excerpts (``context`` tokens each side of the peak) and its nearest neighbours (from
    the find index, when there is one). ``lake`` and ``finder``: a read-only connection and a
    Finder to use instead of opening them (a long-lived caller: the web app)."""
    settings = warehouse_mod.settings_for(where)
    model, source, index = parse_key(key)
    k = [model, source, index]
    cond = "model_id = ? AND source_id = ? AND feature_index = ?"
    own = lake is None
    with (warehouse_mod.connect(settings, read_only=True) if own else contextlib.nullcontext(lake)) as lake:
        def dicts(sql: str, params: list) -> list[dict[str, Any]]:
            cur = lake.execute(sql, params)
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

        feature = dicts(f"""SELECT max_act_approx, frac_nonzero, pos_str, pos_values, neg_str, neg_values,
                                   hook_name, captured_at FROM features WHERE {cond}""", k)
        stats = dicts(f"""SELECT data_source, n_examples, n_active_tokens, round(active_token_fraction, 5) AS active_token_fraction,
                                 max_activation, round(mean_max_activation, 4) AS mean_max_activation,
                                 list_transform(top_tokens[1:5], t -> t.token) AS top_tokens
                          FROM feature_activation_stats WHERE {cond} ORDER BY data_source NULLS LAST""", k)
        explanations = dicts(f"""SELECT description, explanation_model, type_name, embedding IS NOT NULL AS has_embedding
                                 FROM explanations WHERE {cond} ORDER BY explanation_id""", k)
        excerpts = dicts(f"""SELECT data_source, max_value, max_value_token_index,
                                    greatest(max_value_token_index - {int(context)}, 0) AS start,
                                    tokens[greatest(max_value_token_index - {int(context)}, 0) + 1 :
                                           max_value_token_index + {int(context)} + 1] AS tokens,
                                    "values"[greatest(max_value_token_index - {int(context)}, 0) + 1 :
                                             max_value_token_index + {int(context)} + 1] AS "values",
                                    list(max_value) OVER () AS every_peak
                             FROM activations WHERE {cond}
                             ORDER BY max_value DESC NULLS LAST, activation_id LIMIT {int(n_excerpts)}""", k)
    if not (feature or stats or explanations or excerpts):
        raise NoSuchFeature(f"{model}/{source}/{index} is not in the warehouse at {settings.warehouse}")
    peaks = excerpts[0]["every_peak"] if excerpts else []  # every excerpt's, for a histogram (one scan)
    for e in excerpts:
        e["peak"] = (e["max_value_token_index"] - e["start"]) if e["max_value_token_index"] is not None else None
        del e["every_peak"]
    view = FeatureView(f"{model}/{source}/{index}", feature[0] if feature else None, stats, explanations, excerpts,
                       extra={"peaks": peaks})
    try:
        with (Finder(settings) if finder is None else contextlib.nullcontext(finder)) as finder:
            view.neighbours = (finder.similar((model, source, index), limit=n_neighbours) if n_neighbours else
                               Found(["model_id", "source_id", "feature_index", "similarity", "basis", "description"],
                                     [], finder.note))
            view.note = finder.note
    except (FindIndexMissing, NoSuchFeature) as exc:
        view.note = str(exc)
    return view


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, chars: re.Pattern[str] = _CONTROL) -> str:
    """``text`` safe to print on a terminal: control characters (an escape sequence in a
    description or a token would move the cursor, recolour, retitle the window) and the
    bidirectional overrides written as ``\\xHH``/``\\uHHHH``; tabs and newlines are left to the caller.
    ``chars``: another set of characters to write so (the report's chart text: those XML refuses)."""
    return chars.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)


def render_text(view: FeatureView) -> str:
    """``show``'s answer as plain text: the peak token of each excerpt in [[ ]]; every text
    from the warehouse made :func:`printable`."""
    return printable(_render_text(view))


def _render_text(view: FeatureView) -> str:
    out = [f"feature {view.key}"]
    f = view.feature or {}
    if f:
        out.append(f"  max activation (approx.) {rounded(f.get('max_act_approx'))}, "
                   f"firing density {density(f.get('frac_nonzero'))}")
        if f.get("pos_str"):
            out.append("  top positive logits: " + ", ".join(repr(t) for t in f["pos_str"][:10]))
    out.append("statistics per data source:")
    for s in view.stats:
        out.append(f"  {s['data_source'] or '(no data source)'}: {s['n_examples']} excerpts, "
                   f"max {rounded(s['max_activation'])}, mean peak {rounded(s['mean_max_activation'])}, "
                   f"active tokens {rounded(s['n_active_tokens'])} ({density(s['active_token_fraction'])} of its excerpts' tokens), "
                   f"top tokens {s['top_tokens']}")
    if not view.stats:
        out.append("  (no activations loaded)")
    out.append("explanations:")
    for e in view.explanations:
        emb = ", embedding" if e["has_embedding"] else ""
        out.append(f"  - {e['description'].strip() if e['description'] else ''}  ({e['explanation_model']}{emb})")
    if not view.explanations:
        out.append("  (none)")
    out.append("top excerpts (the peak token in [[ ]]):")
    for e in view.excerpts:
        toks = [("[[" + t + "]]" if i == e["peak"] else t) for i, t in enumerate(e["tokens"] or [])]
        out.append(f"  {rounded(e['max_value']):>8}  {e['data_source'] or '-':<9} " + "".join(toks).replace("\n", "⏎"))
    if not view.excerpts:  # (a heading over nothing read as if the answer were cut)
        out.append("  (none)")
    out.append("nearest features:")
    if view.neighbours is not None and view.neighbours.rows:
        for m, s, i, sim, basis, d in view.neighbours.rows:
            out.append(f"  {sim:.4f} ({basis})  {m}/{s}/{i}  {(d or '').strip()[:80]}")
    else:
        out.append("  (none)")
    if view.note:
        out.append(f"note: {view.note}")
    return "\n".join(out)


def render_html(view: FeatureView) -> str:
    """``show``'s answer as one self-contained HTML page (no script, no external file): each
    excerpt headed by its data source and its largest activation, its tokens shaded by their
    activation relative to the feature's largest, the peak token outlined, the value in each
    token's title. Tokens are written as the report and the web app write them (a leading or
    trailing space as ␣, a newline as ↵: " CPU" and "CPU" differ), numbers rounded for people
    (``text.rounded``). Text from the warehouse is escaped for HTML, its control characters and
    bidirectional overrides written as visible escapes (as :func:`printable` prints them), and
    isolated (``<bdi>``, ``unicode-bidi: isolate``) so a right-to-left run cannot reorder what
    stands around it."""

    def esc(text: Any) -> str:  # in an attribute or the title
        return html.escape(printable(str(text)))

    def bdi(text: Any) -> str:  # in the page's text
        return f"<bdi>{esc(text)}</bdi>"

    def tok(token: str | None) -> str:  # a token, its spaces and newlines visible
        return esc(visible_token(token))

    num = rounded
    top = max([e["max_value"] or 0 for e in view.excerpts] + [0]) or 1.0
    parts = [f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(view.key)} — featurehouse</title>
<style>
body {{ font: 15px/1.5 system-ui, sans-serif; margin: 2rem; color: #1d1d1f; max-width: 70rem; }}
h1 {{ font-size: 1.3rem; }} h2 {{ font-size: 1.05rem; margin-top: 1.6rem; }}
table {{ border-collapse: collapse; }} td, th {{ padding: .2rem .6rem; border-bottom: 1px solid #ddd; text-align: left; }}
td.num, th.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
.excerpt {{ font: 13px/1.9 ui-monospace, monospace; white-space: pre-wrap; word-break: break-word; margin: .1rem 0 .8rem; padding: .3rem; border: 1px solid #eee; }}
/* as serve's pages: tokens written with ␣ hold no space to wrap at, so an excerpt, a cell or a
   line of text breaks anywhere rather than reach past the window */
td, li, p, .excerpt {{ overflow-wrap: anywhere; }}
td.nowrap {{ white-space: nowrap; overflow-wrap: normal; }}
.excerpt-head {{ font-size: 13px; color: #555; }} .hint {{ font-size: 13px; color: #555; }}
.tok {{ border-radius: 2px; unicode-bidi: isolate; }} bdi, code {{ unicode-bidi: isolate; }} .peak {{ outline: 2px solid #b3261e; }}
.note {{ color: #8a5a00; }}
</style></head><body>
<h1>Feature {bdi(view.key)}</h1>"""]
    f = view.feature or {}
    if f:
        parts.append(f'<p>Max activation (approx.) <b class="max-act">{esc(num(f.get("max_act_approx")))}</b>; '
                     f'firing density <b class="density">{esc(density(f.get("frac_nonzero")))}</b> '
                     "(the share of all tokens on which it fires).</p>")
        if f.get("pos_str"):
            parts.append("<p>Top positive logits: "
                         + ", ".join(f"<code><bdi>{tok(t)}</bdi></code>" for t in f["pos_str"][:10]) + "</p>")
    parts.append('<h2>Statistics per data source</h2><table class="stats"><tr><th>data source</th>'
                 '<th class="num">excerpts</th><th class="num">max activation</th><th class="num">mean peak</th>'
                 '<th class="num">active tokens</th><th>top tokens</th></tr>')
    for s in view.stats:
        parts.append(f"<tr><td>{bdi(s['data_source'] or '(none)')}</td><td class=\"num\">{esc(num(s['n_examples']))}</td>"
                     f"<td class=\"num\">{esc(num(s['max_activation']))}</td>"
                     f"<td class=\"num\">{esc(num(s['mean_max_activation']))}</td>"
                     f"<td class=\"num\">{esc(num(s['n_active_tokens']))}</td>"
                     f"<td>{', '.join(f'<code><bdi>{tok(t)}</bdi></code>' for t in s['top_tokens'] or [])}</td></tr>")
    parts.append("</table><h2>Explanations</h2><ul class=\"explanations\">")
    for e in view.explanations:
        parts.append(f"<li>{bdi((e['description'] or '').strip())} <small>({bdi(e['explanation_model'] or '?')})</small></li>")
    parts.append("</ul><h2>Top excerpts</h2>"
                 '<p class="hint">each headed by its data source and its largest activation; each token shaded by '
                 "its activation against the feature's largest (hover a token for its value), the peak outlined; "
                 "␣ is a space, ↵ a newline, ⇥ a tab</p>")
    for e in view.excerpts:
        spans = []
        for i, (t, v) in enumerate(zip(e["tokens"] or [], e["values"] or [])):
            alpha = max(0.0, min(1.0, (v or 0) / top))
            cls = "tok peak" if i == e["peak"] else "tok"
            spans.append(f'<span class="{cls}" data-activation="{v}" title="{esc(num(v))}" '
                         f'style="background: rgba(255, 120, 0, {alpha:.3f})">{tok(t)}</span>')
        parts.append(f'<div class="excerpt-head"><span class="data-source">{bdi(e["data_source"] or "(no data source)")}'
                     f'</span> · max activation <b class="excerpt-max">{esc(num(e["max_value"]))}</b></div>')
        parts.append(f'<div class="excerpt" data-max="{e["max_value"]}">' + "".join(spans) + "</div>")
    parts.append("<h2>Nearest features</h2><table class=\"neighbours\"><tr><th>feature</th><th class=\"num\">similarity</th>"
                 "<th>basis</th><th>description</th></tr>")
    for m, s, i, sim, basis, d in (view.neighbours.rows if view.neighbours is not None else []):
        parts.append(f"<tr><td>{bdi(f'{m}/{s}/{i}')}</td><td class=\"num\">{esc(num(sim))}</td><td class=\"nowrap\">{esc(basis)}</td>"
                     f"<td>{bdi((d or '').strip())}</td></tr>")
    if view.neighbours is None or not view.neighbours.rows:
        parts.append('<tr><td colspan="4">(no other feature to compare it with)</td></tr>')
    parts.append("</table>")
    if view.note:
        parts.append(f'<p class="note">{bdi(view.note)}</p>')
    parts.append("</body></html>\n")
    return "\n".join(parts)
