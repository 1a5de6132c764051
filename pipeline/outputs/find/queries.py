"""The find index opened for queries (``Finder``): ``search``, ``similar`` and ``by_token``."""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any

import duckdb

from ...config import Settings
from ...lake import warehouse as warehouse_mod
from .build import refresh_index
from .common import (
    _F32_MARGIN,
    _LEADING,
    EMBEDDING_DIM,
    FindIndexForeign,
    FindIndexMissing,
    FindIndexStale,
    FindIndexUnwritable,
    Found,
    NoSuchFeature,
    NoSuchSource,
    QueryHoldsNoWord,
    _check_limit,
    parse_key,
)
from .store import _open_index, _paths, lake_state


def _snapshot_time(text: str | None):
    """The index's snapshot time (UTC, ISO, as its meta holds it) as a time in UTC."""
    from datetime import datetime, timezone

    if not text:
        return None
    t = datetime.fromisoformat(text)
    return t.astimezone(timezone.utc) if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


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
        self._opened_at = time.monotonic()
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

    def _opened_long_ago(self, seconds: float = 1.0) -> bool:
        """Whether this Finder checked the catalog more than ``seconds`` ago (see ``card``)."""
        return time.monotonic() - self._opened_at > seconds

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

    def card(self, key: str | tuple[str, str, int], *, n_excerpts: int, context: int,
             captures: bool = False, lake_snapshot: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """A feature card's parts (``feature``, ``stats``, ``explanations``, ``excerpts``,
        ``peaks``, ``captures``, ``snapshot``) as the lake holds them, read from the index alone;
        None when the index cannot answer for the lake as it is now (a commit since touched a
        table the index reads; the feature is not in it; more excerpts or context than it
        keeps): the caller reads the lake.

        ``lake_snapshot``: the lake's latest snapshot (id and time), read just before: the card
        is said to be read at it (the index's tables are the lake's there: no change since the
        index's own touched them). Without it, the card says the index's snapshot. A catalog
        that is no SQLite file (PostgreSQL) cannot be watched by a file's stamp: there the index
        answers only when it was built at that very snapshot (or, without it, for a Finder just
        opened, which checked the catalog then)."""
        from .build import CARD_CONTEXT, CARD_EXCERPTS

        if n_excerpts > CARD_EXCERPTS or context > CARD_CONTEXT or context < 0 or n_excerpts < 0:
            return None
        self._follow()
        if self.note is not None:
            return None
        if self.settings.catalog_kind != "sqlite" and (
                int(lake_snapshot["id"]) != self.snapshot_id if lake_snapshot is not None else self._opened_long_ago()):
            return None
        model, source, index = parse_key(key)
        found = self.conn.execute(warehouse_mod.bind("SELECT fid FROM features WHERE model_id = $m AND source_id = $s "
                                                     "AND feature_index = $i", {"m": model, "s": source, "i": index})).fetchone()
        if not found:
            return None
        fid = int(found[0])

        def rows(sql: str) -> list[dict[str, Any]]:
            cur = self.conn.execute(sql.replace("$fid", str(fid)))
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

        head = rows("SELECT * EXCLUDE (fid) FROM card_features WHERE fid = $fid")
        feature = None
        if head and head[0]["in_features"]:
            feature = {k: v for k, v in head[0].items() if k not in ("in_features", "peaks")}
        excerpts = []
        for e in rows(f"""SELECT data_source, max_value, max_value_token_index, start, tokens, "values"
                          FROM card_excerpts WHERE fid = $fid ORDER BY "rank" LIMIT {int(n_excerpts)}"""):
            peak = e["max_value_token_index"]
            if peak is not None and e["tokens"] is not None:  # CARD_CONTEXT each side kept: ``context`` of them
                start = max(peak - context, 0)
                cut = slice(start - e["start"], peak + context + 1 - e["start"])
                e["start"], e["tokens"] = start, e["tokens"][cut]
                e["values"] = e["values"][cut] if e["values"] is not None else None
            excerpts.append(e)
        return {
            "feature": feature,
            "stats": rows("SELECT * EXCLUDE (fid) FROM card_stats WHERE fid = $fid ORDER BY data_source NULLS LAST"),
            "explanations": rows("SELECT description, explanation_model, type_name, has_embedding FROM docs "
                                 "WHERE fid = $fid ORDER BY explanation_id"),
            "excerpts": excerpts,
            "peaks": (head[0]["peaks"] if head else None) or [],
            "captures": rows("SELECT table_name, captured_at, run_id FROM card_captures WHERE fid = $fid "
                             "ORDER BY table_name") if captures else None,
            "snapshot": lake_snapshot or {"id": self.snapshot_id, "time": _snapshot_time(self.meta.get("snapshot_time"))},
            "from": "index",
        }

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


