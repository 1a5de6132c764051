"""Building the find index from the warehouse (``build_index``) and refreshing it from the
lake's change feed (``refresh_index``): the index file, its full-text index and the
embedding matrices beside it."""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from ...config import Settings
from ...lake import warehouse as warehouse_mod
from .common import (
    _FIND_TABLES,
    _LEADING,
    _REFRESH_WHOLE_SHARE,
    EMBEDDING_DIM,
    INDEX_VERSION,
    FindIndexDamaged,
    FindIndexMissing,
    FindIndexUnwritable,
    IndexInfo,
)
from .store import (
    _build_lock,
    _connect_index,
    _counts,
    _meta,
    _open_index,
    _paths,
    _unwritable,
    _utc,
    lake_state,
)

log = logging.getLogger("featurehouse")

_SCHEMA = """
CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR);
-- one row per feature with an explanation or activation statistics
CREATE TABLE features (fid INTEGER, model_id VARCHAR, source_id VARCHAR, feature_index BIGINT,
                       max_activation DOUBLE, pos_str VARCHAR[]);
-- one row per explanation; fts_main_docs indexes description
CREATE TABLE docs (doc_id INTEGER, fid INTEGER, explanation_id VARCHAR, description VARCHAR,
                   explanation_model VARCHAR, type_name VARCHAR, has_embedding BOOLEAN);
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
-- the feature card (`show`, the web app's feature page) as of the index's snapshot, so that a
-- card reads a local file (~1 ms a part) where each of its five lake reads paid DuckLake's own
-- ~25 ms: the lake's features row and every excerpt's peak (card_features), the statistics per
-- data source, the CARD_EXCERPTS strongest excerpts (CARD_CONTEXT tokens each side of the peak;
-- ``start``: the first one's place in the whole excerpt), the runs that loaded it
CREATE TABLE card_features (fid INTEGER PRIMARY KEY, in_features BOOLEAN, max_act_approx DOUBLE, frac_nonzero DOUBLE,
                            pos_str VARCHAR[], pos_values DOUBLE[], neg_str VARCHAR[], neg_values DOUBLE[],
                            hook_name VARCHAR, captured_at TIMESTAMP, peaks DOUBLE[]);
CREATE TABLE card_stats (fid INTEGER, data_source VARCHAR, n_examples BIGINT, n_active_tokens BIGINT,
                         active_token_fraction DOUBLE, max_activation DOUBLE, mean_max_activation DOUBLE,
                         top_tokens VARCHAR[]);
CREATE TABLE card_excerpts (fid INTEGER, "rank" INTEGER, data_source VARCHAR, max_value DOUBLE,
                            max_value_token_index INTEGER, start INTEGER, tokens VARCHAR[], "values" DOUBLE[]);
CREATE TABLE card_captures (fid INTEGER, table_name VARCHAR, captured_at TIMESTAMP, run_id VARCHAR);
"""

#: The excerpts and the tokens each side of their peak the index keeps for a feature's card
#: (the web app's feature page shows 10 of 12; ``show`` 5 of 12 by default): a card asking for
#: more reads the lake.
CARD_EXCERPTS = 10
CARD_CONTEXT = 12

#: The card's tables, read from the lake as the ``card_*`` queries of :func:`_lake_rows_sql` give them.
_CARD_TABLES = ("card_features", "card_stats", "card_excerpts", "card_captures")

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
        "docs": f"""SELECT model_id, source_id, feature_index, explanation_id, description, explanation_model,
                           type_name, embedding IS NOT NULL AS has_embedding
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
        # the card's parts, as card.show reads them from the lake (the same columns, order and rounding)
        "card_features": f"""
            WITH peaks AS (SELECT model_id, source_id, feature_index, list(max_value) AS peaks
                           FROM activations {semi} GROUP BY ALL)
            SELECT model_id, source_id, feature_index, f.model_id IS NOT NULL AS in_features,
                   f.max_act_approx, f.frac_nonzero, f.pos_str, f.pos_values, f.neg_str, f.neg_values,
                   f.hook_name, f.captured_at, p.peaks
            FROM (SELECT model_id, source_id, feature_index, max_act_approx, frac_nonzero, pos_str, pos_values,
                         neg_str, neg_values, hook_name, captured_at FROM features {semi}) AS f
            FULL JOIN peaks AS p USING (model_id, source_id, feature_index)""",
        "card_stats": f"""
            SELECT model_id, source_id, feature_index, data_source, n_examples, n_active_tokens,
                   round(active_token_fraction, 5) AS active_token_fraction, max_activation,
                   round(mean_max_activation, 4) AS mean_max_activation,
                   list_transform(top_tokens[1:5], t -> t.token) AS top_tokens
            FROM feature_activation_stats {semi}""",
        # the strongest CARD_EXCERPTS of each feature: their ids first (no token read), then the
        # token lists of those rows only
        "card_excerpts": f"""
            WITH best AS (SELECT model_id, source_id, feature_index, activation_id FROM activations {semi}
                          QUALIFY row_number() OVER (PARTITION BY model_id, source_id, feature_index
                                                     ORDER BY max_value DESC NULLS LAST, activation_id) <= {CARD_EXCERPTS})
            SELECT model_id, source_id, feature_index,
                   row_number() OVER (PARTITION BY model_id, source_id, feature_index
                                      ORDER BY max_value DESC NULLS LAST, activation_id)::INTEGER AS "rank",
                   data_source, max_value, max_value_token_index,
                   greatest(max_value_token_index - {CARD_CONTEXT}, 0) AS start,
                   tokens[greatest(max_value_token_index - {CARD_CONTEXT}, 0) + 1 :
                          max_value_token_index + {CARD_CONTEXT} + 1] AS tokens,
                   "values"[greatest(max_value_token_index - {CARD_CONTEXT}, 0) + 1 :
                            max_value_token_index + {CARD_CONTEXT} + 1] AS "values"
            FROM activations SEMI JOIN best USING (model_id, source_id, feature_index, activation_id)
            QUALIFY "rank" <= {CARD_EXCERPTS}""",
        "card_captures": f"""SELECT model_id, source_id, feature_index, table_name, captured_at, run_id
                             FROM feature_captures {semi}""",
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
    for name in ("features", "docs", "tokens", "top", "excerpts", *_CARD_TABLES):
        # streamed a batch at a time (a whole Arrow table beside the temp table held the card's
        # excerpts twice: +300 MB at 262,144 features)
        rel = lake.execute(queries[name]).to_arrow_reader(_EMB_CHUNK)
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
               f.fid, d.explanation_id, d.description, d.explanation_model, d.type_name, d.has_embedding
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
    for name in _CARD_TABLES:  # a card's parts by fid (its features row: only for the features the index holds)
        cols = ", ".join(f'c."{c}"' for (c,) in idx.execute(f"SELECT column_name FROM (DESCRIBE {name}) OFFSET 1").fetchall())
        idx.execute(f"INSERT INTO {name} SELECT f.fid, {cols} FROM lake_{name} AS c {key} ORDER BY f.fid")
    if emb_rows.num_rows:
        idx.register("lake_emb", emb_rows)
        idx.execute(f"INSERT INTO emb_rows SELECT e.\"row\", f.fid, e.explanation_id, true FROM lake_emb AS e {key}")
        idx.unregister("lake_emb")
    for name in ("features", "docs", "tokens", "top", "excerpts", *_CARD_TABLES):
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
                    for t in ("docs", "tokens", "basis_tokens", "excerpts", *_CARD_TABLES):
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


