"""Field coercion and typed records: each field of a page or an export row made what its column
holds (numbers, integers that fit, ids and numbers written as text, timestamps, JSON text of the
fields without a column), as DuckDB's typed read makes it, and the :mod:`records` built from them.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from typing import Any

import orjson

from .records import (
    ACTIVATION_COLUMN_FIELDS,
    ACTIVATION_EXTRA_FIELDS,
    EXPLANATION_COLUMN_FIELDS,
    EXPLANATION_EXTRA_FIELDS,
    FEATURE_COLUMN_FIELDS,
    FEATURE_EXTRA_FIELDS,
    PAGE_RELATIONS,
    Activation,
    Explanation,
    Feature,
    Model,
    Source,
    SourceSet,
    unlisted_fields,
)

__all__ = ["json_text"]


def _ts(v: Any) -> datetime | None:
    if isinstance(v, datetime):
        dt = v
    elif isinstance(v, str) and v:
        s = v[2:] if v.startswith("$D") else v
        try:
            dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
        except ValueError:
            return None
    else:
        return None
    if dt.tzinfo is not None:
        dt = dt.astimezone(timezone.utc).replace(tzinfo=None)
    return dt


def _num(v: Any) -> float | None:
    t = type(v)
    if t is float:
        return v
    if t is int:
        try:
            return float(v)
        except OverflowError:  # a "$n" bigint past the float range
            return math.nan
    if isinstance(v, str) and v in ("$I", "$Infinity", "$-Infinity", "$N", "$NaN"):
        return {"$I": math.inf, "$Infinity": math.inf, "$-Infinity": -math.inf}.get(v, math.nan)
    return None


_INT64 = 2**63
_INT32 = 2**31


#: An integer written as text: ASCII digits only (``str.isdigit`` also takes "²", which ``int()``
#: then refuses, and Arabic-Indic digits, which it reads; DuckDB's cast refuses both). DuckDB's
#: cast is laxer still ("+12", " 12", "1_2", "0x1", "12.5" read as numbers): an activation's
#: ``index`` written so is quarantined on both roads, with one check more on this one.
_DIGITS = re.compile(r"-?[0-9]+")


def _int(v: Any, bound: int = _INT64) -> int | None:
    """An integer, or None when it is not one or does not fit its column (BIGINT by default)."""
    if type(v) is int:
        n = v
    elif isinstance(v, float) and v.is_integer():
        n = int(v)
    elif isinstance(v, str) and _DIGITS.fullmatch(v):
        n = int(v)
    else:
        return None
    # A value its column cannot hold would make the Arrow conversion, and so the run, fail.
    return n if -bound <= n < bound else None


def _int32(v: Any) -> int | None:
    return _int(v, _INT32)


_NUMBER_TYPES = {float, int}


def _floats(v: Any) -> list[float] | None:
    """A list of numbers; elements that are not numbers become null, as DuckDB's typed read makes
    them (validation refuses them: values_not_null)."""
    if not isinstance(v, list):
        return None
    types = set(map(type, v))
    if types <= _NUMBER_TYPES and (int not in types or -_INT64 <= min(v) and max(v) < _INT64):
        return v  # the common case: leave the list as parsed (Arrow converts ints that fit int64)
    return [_num(x) for x in v]


def _strs(v: Any) -> list[str] | None:
    if not isinstance(v, list):
        return None
    return [x if type(x) is str else _str(x) for x in v]


def _str(v: Any) -> str | None:
    """Text as DuckDB's typed read of the same JSON makes it, so both roads store one thing: a
    string as is, ``true``/``false``, a number as DuckDB (and Python's ``repr``) writes it, an
    object or a list as its compact JSON, a flight ``$D`` date as the API writes dates; null
    stays null (an excerpt token that is null is refused by ``tokens_not_null``)."""
    if v is None or isinstance(v, str):
        return v
    if v is True or v is False:
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, datetime):
        return _json_default(v)
    return _json(v)


def _json_default(v: Any) -> Any:
    if isinstance(v, datetime):
        # Written as the API writes dates (JavaScript's toISOString), so that a flight "$D" date
        # in an extra field stores the same text as the API JSON's string.
        if v.tzinfo is not None:
            v = v.astimezone(timezone.utc).replace(tzinfo=None)
        frac = f"{v.microsecond // 1000:03d}" if v.microsecond % 1000 == 0 else f"{v.microsecond:06d}"
        return v.strftime("%Y-%m-%dT%H:%M:%S.") + frac + "Z"
    return str(v)


def _json(v: Any) -> str | None:
    """JSON text of a parsed value; a flight ``$D`` date as the API writes it."""
    if v is None:
        return None
    return orjson.dumps(
        v, default=_json_default, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATETIME
    ).decode()


_FEATURE_RELATIONS = {"model", "source", "sourceSet", "activations", "explanations", "lists", "creator", "comments"}


def _extra(obj: dict, columns: frozenset[str], listed: tuple[str, ...]) -> str:
    """``obj``'s fields that have no column: the listed ones (null when absent), then any
    other that is not null, by name (as columns.py's ``_extra_sql`` builds it)."""
    extra = {k: obj.get(k) for k in listed}
    for k in unlisted_fields(obj.keys(), columns, listed):
        if obj[k] is not None:
            extra[k] = obj[k]
    return _json(extra)


def _embedding(v: Any) -> tuple[list[float] | None, int | None, bool | None]:
    """An explanation's embedding (a JSON list, or a string holding one): the numbers, how many
    values it holds, and whether they are all finite numbers (see ``columns._EMBEDDING_NUMERIC``)."""
    if v is None:
        return None, None, None
    if isinstance(v, str):
        try:
            v = orjson.loads(v)
        except orjson.JSONDecodeError:
            return None, None, False
    if not isinstance(v, list):
        return None, None, False
    numeric = all((type(x) is int or type(x) is float) and math.isfinite(x) for x in v)
    return ([float(x) for x in v] if numeric else None), len(v), numeric


def _feature(p: dict, model_id: Any, source_id: Any, index: int | None) -> Feature:
    return Feature(
        model_id=_str(model_id),
        source_id=_str(source_id),
        feature_index=index,
        source_set_name=_str(p.get("sourceSetName")),
        max_act_approx=_num(p.get("maxActApprox")),
        frac_nonzero=_num(p.get("frac_nonzero")),
        pos_str=_strs(p.get("pos_str")),
        pos_values=_floats(p.get("pos_values")),
        neg_str=_strs(p.get("neg_str")),
        neg_values=_floats(p.get("neg_values")),
        hook_name=_str(p.get("hookName")),
        has_vector=p.get("hasVector") if isinstance(p.get("hasVector"), bool) else None,
        creator_id=_str(p.get("creatorId")),
        created_at=_ts(p.get("createdAt")),
        extra=_extra({k: v for k, v in p.items() if k not in PAGE_RELATIONS},
                     FEATURE_COLUMN_FIELDS, FEATURE_EXTRA_FIELDS),
        raw={k: v for k, v in p.items() if k not in _FEATURE_RELATIONS},
    )


def _activation(a: Any, page_key: str | None) -> Activation:
    if not isinstance(a, dict):
        a = {"value": a}
    model_id, source_id, idx = a.get("modelId"), a.get("layer"), _int(a.get("index"))
    key = f"{model_id}/{source_id}/{idx}"
    return Activation(
        activation_id=_str(a.get("id")) or None,
        model_id=_str(model_id),
        source_id=_str(source_id),
        feature_index=idx,
        data_source=_str(a.get("dataSource")),
        data_index=_str(a.get("dataIndex")),
        tokens=_strs(a.get("tokens")),
        values=_floats(a.get("values")),
        max_value=_num(a.get("maxValue")),
        max_value_token_index=_int32(a.get("maxValueTokenIndex")),
        min_value=_num(a.get("minValue")),
        dfa_values=_floats(a.get("dfaValues")),
        dfa_target_index=_int32(a.get("dfaTargetIndex")),
        dfa_max_value=_num(a.get("dfaMaxValue")),
        loss_values=_floats(a.get("lossValues")),
        logit_contributions=(
            a["logitContributions"] if isinstance(a.get("logitContributions"), str)
            else _json(a.get("logitContributions"))
        ),
        bin_min=_num(a.get("binMin")),
        bin_max=_num(a.get("binMax")),
        bin_contains=_num(a.get("binContains")),
        qualifying_token_index=_int32(a.get("qualifyingTokenIndex")),
        creator_id=_str(a.get("creatorId")),
        created_at=_ts(a.get("createdAt")),
        extra=_extra(a, ACTIVATION_COLUMN_FIELDS, ACTIVATION_EXTRA_FIELDS),
        page_key=page_key if page_key is not None else key,
        raw=a,
    )


def _explanation(e: Any, model_id: Any, source_id: Any, index: int | None) -> Explanation:
    if not isinstance(e, dict):
        e = {"value": e}
    embedding, dim, numeric = _embedding(e.get("embedding"))
    return Explanation(
        explanation_id=_str(e.get("id")) or None,
        model_id=_str(e.get("modelId", model_id)),
        source_id=_str(e.get("layer", source_id)),
        feature_index=_int(e["index"]) if "index" in e else index,
        description=_str(e.get("description")),
        explanation_model=_str(e.get("explanationModelName")),
        type_name=_str(e.get("typeName")),
        author_id=_str(e.get("authorId")),
        scores=_json(e.get("scores")),
        created_at=_ts(e.get("createdAt")),
        embedding=embedding,
        extra=_extra(e, EXPLANATION_COLUMN_FIELDS, EXPLANATION_EXTRA_FIELDS),
        embedding_dim=dim,
        embedding_numeric=numeric,
        raw=e,
    )


def _model(m: dict) -> Model:
    core = {"id", "displayName", "owner", "tlensId", "layers", "dimension", "createdAt", "updatedAt"}
    return Model(
        model_id=_str(m.get("id")) or "",
        display_name=_str(m.get("displayName")),
        owner=_str(m.get("owner")),
        tlens_id=_str(m.get("tlensId")),
        n_layers=_int32(m.get("layers")),
        dimension=_int32(m.get("dimension")),
        created_at=_ts(m.get("createdAt")),
        updated_at=_ts(m.get("updatedAt")),
        extra=_json({k: v for k, v in m.items() if k not in core}),
    )


def _source(s: dict, model_id: Any) -> Source:
    core = {"id", "modelId", "setName", "hfRepoId", "hfFolderId", "dataset", "num_tokens_in_prompt", "createdAt"}
    return Source(
        model_id=_str(s.get("modelId", model_id)) or "",
        source_id=_str(s.get("id")) or "",
        source_set_name=_str(s.get("setName")),
        hf_repo_id=_str(s.get("hfRepoId")),
        hf_folder_id=_str(s.get("hfFolderId")),
        dataset=_str(s.get("dataset")),
        num_tokens_in_prompt=_int32(s.get("num_tokens_in_prompt")),
        created_at=_ts(s.get("createdAt")),
        extra=_json({k: v for k, v in s.items() if k not in core}),
    )


def _source_set(s: dict, model_id: Any) -> SourceSet:
    core = {"modelId", "name", "description", "type", "creatorName", "releaseName", "urls", "createdAt"}
    return SourceSet(
        model_id=_str(s.get("modelId", model_id)) or "",
        source_set_name=_str(s.get("name")) or "",
        description=_str(s.get("description")),
        type_name=_str(s.get("type")),
        creator_name=_str(s.get("creatorName")),
        release_name=_str(s.get("releaseName")),
        urls=_strs(s.get("urls")),
        created_at=_ts(s.get("createdAt")),
        extra=_json({k: v for k, v in s.items() if k not in core}),
    )


json_text = _json
