"""What every part of finding shares: the errors it raises, an answer (``Found``), what a
build or refresh did (``IndexInfo``), a feature's key, and the index's version."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EMBEDDING_DIM = 256  # records.EMBEDDING_DIM; not imported: the stages pull in the whole ingest
INDEX_VERSION = 6  # 2: the warehouse's identity and its find tables' fingerprint in meta; 3: its snapshot's time;
# 4: every word of a description indexed (no stop words); 5: each feature's strongest excerpt; 6: the feature card
_F32_MARGIN = 1e-4  # far above float32's error on a cosine of 256 values (~1e-6)
_FIND_TABLES = ("explanations", "features", "feature_activation_stats", "feature_token_stats", "activations",
                "feature_captures")  # (the card's runs)
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


