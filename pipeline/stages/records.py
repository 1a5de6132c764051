"""Typed records parsed from a feature page, and their Arrow schemas for loading."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any

import pyarrow as pa


class InputFormat(str, Enum):
    API_JSON = "api_json"
    FLIGHT = "flight"
    HTML = "html"
    EXPORT_JSONL = "export_jsonl"
    UNKNOWN = "unknown"


class RecordKind(str, Enum):
    FEATURE = "feature"
    ACTIVATION = "activation"
    EXPLANATION = "explanation"


@dataclass(frozen=True, slots=True)
class Model:
    model_id: str
    display_name: str | None = None
    owner: str | None = None
    tlens_id: str | None = None
    n_layers: int | None = None
    dimension: int | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    extra: str | None = None


@dataclass(frozen=True, slots=True)
class SourceSet:
    model_id: str
    source_set_name: str
    description: str | None = None
    type_name: str | None = None
    creator_name: str | None = None
    release_name: str | None = None
    urls: list[str] | None = None
    created_at: datetime | None = None
    extra: str | None = None


@dataclass(frozen=True, slots=True)
class Source:
    model_id: str
    source_id: str
    source_set_name: str | None = None
    hf_repo_id: str | None = None
    hf_folder_id: str | None = None
    dataset: str | None = None
    num_tokens_in_prompt: int | None = None
    created_at: datetime | None = None
    extra: str | None = None


@dataclass(frozen=True, slots=True)
class Feature:
    model_id: str | None
    source_id: str | None
    feature_index: int | None
    source_set_name: str | None = None
    max_act_approx: float | None = None
    frac_nonzero: float | None = None
    pos_str: list[str] | None = None
    pos_values: list[float] | None = None
    neg_str: list[str] | None = None
    neg_values: list[float] | None = None
    hook_name: str | None = None
    has_vector: bool | None = None
    creator_id: str | None = None
    created_at: datetime | None = None
    extra: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def key(self) -> str:
        return f"{self.model_id}/{self.source_id}/{self.feature_index}"


@dataclass(frozen=True, slots=True)
class Activation:
    activation_id: str | None
    model_id: str | None
    source_id: str | None
    feature_index: int | None
    data_source: str | None = None
    data_index: str | None = None
    tokens: list[str] | None = None
    values: list[float] | None = None
    max_value: float | None = None
    max_value_token_index: int | None = None
    min_value: float | None = None
    dfa_values: list[float] | None = None
    dfa_target_index: int | None = None
    dfa_max_value: float | None = None
    loss_values: list[float] | None = None
    logit_contributions: str | None = None
    bin_min: float | None = None
    bin_max: float | None = None
    bin_contains: float | None = None
    qualifying_token_index: int | None = None
    creator_id: str | None = None
    created_at: datetime | None = None
    extra: str | None = None
    page_key: str | None = field(default=None, compare=False)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def feature_key(self) -> str:
        return f"{self.model_id}/{self.source_id}/{self.feature_index}"


@dataclass(frozen=True, slots=True)
class Explanation:
    explanation_id: str | None
    model_id: str | None
    source_id: str | None
    feature_index: int | None
    description: str | None = None
    explanation_model: str | None = None
    type_name: str | None = None
    author_id: str | None = None
    scores: str | None = None
    created_at: datetime | None = None
    embedding: list[float] | None = None
    extra: str | None = None
    embedding_dim: int | None = field(default=None, compare=False)
    """How many values the embedding as received holds (None: absent, or not a list)."""
    embedding_numeric: bool | None = field(default=None, compare=False)
    """Whether it is a list of finite numbers (None: absent)."""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass
class ParsedInput:
    """Everything one input carried, before validation."""

    format: InputFormat
    models: list[Model] = field(default_factory=list)
    source_sets: list[SourceSet] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    features: list[Feature] = field(default_factory=list)
    activations: list[Activation] = field(default_factory=list)
    explanations: list[Explanation] = field(default_factory=list)
    bad_lines: list[tuple[int, str, str, bool]] = field(default_factory=list)
    """Lines of an export file that are no record, quarantined as the export road does: (line
    number, text, what is wrong with it, whether it is a JSON object)."""


#: Feature fields kept together in ``features.extra`` (JSON; null when a page lacks one).
FEATURE_EXTRA_FIELDS: tuple[str, ...] = (
    "vector", "vectorLabel", "vectorDefaultSteerStrength", "topkCosSimIndices", "topkCosSimValues",
    "neuron_alignment_indices", "neuron_alignment_values", "neuron_alignment_l1",
    "correlated_neurons_indices", "correlated_neurons_pearson", "correlated_neurons_l1",
    "correlated_features_indices", "correlated_features_pearson", "correlated_features_l1",
    "freq_hist_data_bar_heights", "freq_hist_data_bar_values", "logits_hist_data_bar_heights",
    "logits_hist_data_bar_values", "decoder_weights_dist", "umap_cluster",
    "umap_log_feature_sparsity", "umap_x", "umap_y",
    # the page's relations that have no table of their own
    "lists", "creator", "comments",
)

#: Activation fields kept in ``activations.extra`` (the second export producer's), beside any
#: field no column or list here names.
ACTIVATION_EXTRA_FIELDS: tuple[str, ...] = ("zValues",)

#: Explanation fields kept in ``explanations.extra``, beside any field no column or list here
#: names (pages carry ``triggeredByUser``, exports ``notes``, ``triggeredById`` and the umap_*).
EXPLANATION_EXTRA_FIELDS: tuple[str, ...] = (
    "notes", "triggeredById", "triggeredByUser", "umap_x", "umap_y", "umap_cluster",
    "umap_log_feature_sparsity",
)

#: The fields of a feature row, an activation and an explanation that have columns of their own
#: (with the feature key, ``modelId``, ``layer``, ``index``); every other field is kept in the
#: table's ``extra``: the listed extra fields always (null when absent), any other one when
#: it is not null, after them in name order.
FEATURE_COLUMN_FIELDS = frozenset({
    "modelId", "layer", "index", "sourceSetName", "maxActApprox", "frac_nonzero", "pos_str",
    "pos_values", "neg_str", "neg_values", "hookName", "hasVector", "creatorId", "createdAt"})
#: ... and the page's relations, which load into tables of their own
PAGE_RELATIONS = frozenset({"model", "source", "sourceSet", "activations", "explanations"})
ACTIVATION_COLUMN_FIELDS = frozenset({
    "id", "modelId", "layer", "index", "dataSource", "dataIndex", "tokens", "values", "maxValue",
    "maxValueTokenIndex", "minValue", "dfaValues", "dfaTargetIndex", "dfaMaxValue", "lossValues",
    "logitContributions", "binMin", "binMax", "binContains", "qualifyingTokenIndex", "creatorId",
    "createdAt"})
EXPLANATION_COLUMN_FIELDS = frozenset({
    "id", "modelId", "layer", "index", "description", "explanationModelName", "typeName",
    "authorId", "scores", "createdAt", "embedding"})


def unlisted_fields(keys: Any, columns: frozenset[str], listed: tuple[str, ...]) -> list[str]:
    """The keys of a record that neither a column nor the table's extra list names, in order."""
    return sorted(k for k in keys if k not in columns and k not in listed)


#: Values in an explanation embedding: Neuronpedia's search vectors are OpenAI
#: text-embedding-3-large cut to 256 dimensions. Any other length is quarantined
#: (``embedding_dimension`` in schemas/expectations/explanations.json).
EMBEDDING_DIM = 256

_TS = pa.timestamp("us")
_F64_LIST = pa.list_(pa.float64())
_STR_LIST = pa.list_(pa.string())

#: Arrow schema of each loaded table's record columns (run metadata is added at load time).
ARROW_SCHEMAS: dict[str, pa.Schema] = {
    "models": pa.schema(
        [("model_id", pa.string()), ("display_name", pa.string()), ("owner", pa.string()),
         ("tlens_id", pa.string()), ("n_layers", pa.int32()), ("dimension", pa.int32()),
         ("created_at", _TS), ("updated_at", _TS), ("extra", pa.string())]
    ),
    "source_sets": pa.schema(
        [("model_id", pa.string()), ("source_set_name", pa.string()), ("description", pa.string()),
         ("type_name", pa.string()), ("creator_name", pa.string()), ("release_name", pa.string()),
         ("urls", _STR_LIST), ("created_at", _TS), ("extra", pa.string())]
    ),
    "sources": pa.schema(
        [("model_id", pa.string()), ("source_id", pa.string()), ("source_set_name", pa.string()),
         ("hf_repo_id", pa.string()), ("hf_folder_id", pa.string()), ("dataset", pa.string()),
         ("num_tokens_in_prompt", pa.int32()), ("created_at", _TS), ("extra", pa.string())]
    ),
    "features": pa.schema(
        [("model_id", pa.string()), ("source_id", pa.string()), ("feature_index", pa.int64()),
         ("source_set_name", pa.string()), ("max_act_approx", pa.float64()),
         ("frac_nonzero", pa.float64()), ("pos_str", _STR_LIST), ("pos_values", _F64_LIST),
         ("neg_str", _STR_LIST), ("neg_values", _F64_LIST), ("hook_name", pa.string()),
         ("has_vector", pa.bool_()), ("creator_id", pa.string()), ("created_at", _TS),
         ("extra", pa.string())]
    ),
    "activations": pa.schema(
        [("activation_id", pa.string()), ("model_id", pa.string()), ("source_id", pa.string()),
         ("feature_index", pa.int64()), ("data_source", pa.string()), ("data_index", pa.string()),
         ("tokens", _STR_LIST), ("values", _F64_LIST), ("max_value", pa.float64()),
         ("max_value_token_index", pa.int32()), ("min_value", pa.float64()),
         ("dfa_values", _F64_LIST), ("dfa_target_index", pa.int32()),
         ("dfa_max_value", pa.float64()), ("loss_values", _F64_LIST),
         ("logit_contributions", pa.string()), ("bin_min", pa.float64()),
         ("bin_max", pa.float64()), ("bin_contains", pa.float64()),
         ("qualifying_token_index", pa.int32()), ("creator_id", pa.string()),
         ("created_at", _TS), ("extra", pa.string())]
    ),
    "explanations": pa.schema(
        [("explanation_id", pa.string()), ("model_id", pa.string()), ("source_id", pa.string()),
         ("feature_index", pa.int64()), ("description", pa.string()),
         ("explanation_model", pa.string()), ("type_name", pa.string()),
         ("author_id", pa.string()), ("scores", pa.string()), ("created_at", _TS),
         ("embedding", _F64_LIST), ("extra", pa.string())]
    ),
}


def to_arrow(table: str, records: list[Any]) -> pa.Table:
    """Build an Arrow table of ``records`` (dataclasses) with the table's schema, column by column."""
    schema = ARROW_SCHEMAS[table]
    return pa.Table.from_arrays(
        [pa.array([getattr(r, f.name) for r in records], type=f.type) for f in schema],
        schema=schema,
    )
