"""Find features offline: by words (``search``), by likeness (``similar``), by token
(``by_token``), and one feature as a person reads it (``show``).

The package's rooms: ``common`` (errors, an answer, a key), ``store`` (where the index lives,
the lake's version, the builder's lock), ``build`` (building and refreshing the index),
``queries`` (``Finder`` and its three queries), ``card`` (``show`` and its text and HTML).

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

from .build import EXCERPT_CONTEXT, build_index, index_info, refresh_index
from .card import FeatureView, printable, render_html, render_text, show
from .common import (
    EMBEDDING_DIM,
    INDEX_VERSION,
    FindIndexDamaged,
    FindIndexForeign,
    FindIndexMissing,
    FindIndexStale,
    FindIndexUnwritable,
    Found,
    IndexInfo,
    NoSuchFeature,
    NoSuchSource,
    QueryHoldsNoWord,
    parse_key,
)
from .queries import Finder, by_token, search, similar
from .store import LOCK_TIMEOUT, LakeState, lake_changes_since, lake_state

__all__ = [
    "Finder", "Found", "FindIndexMissing", "FindIndexDamaged", "FindIndexForeign", "FindIndexUnwritable",
    "FindIndexStale", "NoSuchFeature", "NoSuchSource", "QueryHoldsNoWord", "IndexInfo", "FeatureView", "LakeState",
    "build_index", "refresh_index", "index_info", "search", "similar", "by_token", "show", "lake_state",
    "lake_changes_since", "render_html", "render_text", "printable", "parse_key", "EMBEDDING_DIM", "EXCERPT_CONTEXT",
    "INDEX_VERSION", "LOCK_TIMEOUT",
]
