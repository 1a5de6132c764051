"""Validate stage: run the Great Expectations suite of each table once per batch.

The suites live in ``schemas/expectations/<table>.json``. Great Expectations checks columns,
so each record's list-valued facts (lengths, maxima, finiteness) are first derived as scalar
check columns in DuckDB, vectorised over the whole batch; the suite then judges them. A record
that fails any expectation is kept out of its table and quarantined with the check's name and a
readable detail taken from the expectation's ``meta.detail`` template.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa

from .config import SCHEMAS_DIR

__all__ = ["SUITES", "SuiteError", "ValidationOutcome", "validate_batch", "load_suite"]

#: table name → record kind; one suite per table.
SUITES = {"features": "feature", "activations": "activation", "explanations": "explanation"}

# Scalar check columns derived from each staged table; the suites refer to these names.
_CHECK_SQL = {
    "features": """
        SELECT _row, model_id || '/' || source_id || '/' || feature_index AS record_key,
               model_id, source_id, feature_index, frac_nonzero, max_act_approx,
               coalesce(len(pos_str), 0) AS n_pos_str, coalesce(len(pos_values), 0) AS n_pos_values,
               coalesce(len(neg_str), 0) AS n_neg_str, coalesce(len(neg_values), 0) AS n_neg_values
        FROM stage_features""",
    "activations": """
        SELECT _row, coalesce(activation_id, '(no id) in ' || page_key) AS record_key,
               activation_id, feature_index,
               model_id || '/' || source_id || '/' || feature_index AS feature_key, page_key,
               coalesce(model_id || '/' || source_id || '/' || feature_index = page_key, false)
                   AS feature_key_matches_page,
               coalesce(len(tokens), 0) AS n_tokens, coalesce(len("values"), 0) AS n_values,
               coalesce(len("values") - list_count("values"), 0) AS n_null_values,
               coalesce(len(list_filter("values", x -> NOT isfinite(x))), 0) AS n_nonfinite_values,
               list_max("values") AS max_of_values, max_value, max_value_token_index,
               CASE WHEN max_value_token_index >= 0
                    THEN "values"[max_value_token_index + 1] END AS value_at_max_index,
               min_value,
               coalesce(max_value_token_index < len("values"), false) AS max_index_in_excerpt,
               coalesce(min_value <= max_value, false) AS min_not_above_max
        FROM stage_activations""",
    "explanations": """
        SELECT _row, coalesce(explanation_id, '(no id) for ' || model_id || '/' || source_id || '/' || feature_index) AS record_key,
               explanation_id, feature_index,
               coalesce(length(trim(description)), 0) AS description_length
        FROM stage_explanations""",
}


class SuiteError(ValueError):
    "An expectation suite file is not valid."


@functools.lru_cache(maxsize=None)
def load_suite(table: str) -> dict[str, Any]:
    """The expectation suite for ``table``, as stored in ``schemas/expectations``."""
    return json.loads((SCHEMAS_DIR / "expectations" / f"{table}.json").read_text())


@functools.lru_cache(maxsize=1)
def _gx():
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    import great_expectations as gx  # heavy: imported on first validation, not at import time
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = context.data_sources.add_pandas("featurehouse")
    batches = {}
    suites = {}
    for table in SUITES:
        asset = source.add_dataframe_asset(table)
        batches[table] = asset.add_batch_definition_whole_dataframe(f"{table}_batch")
        spec = load_suite(table)
        suite = gx.ExpectationSuite(name=spec["name"], expectations=spec["expectations"], meta=spec.get("meta", {}))
        if len(suite.expectations) != len(spec["expectations"]):
            # Great Expectations logs and drops an expectation it cannot build; refuse instead.
            raise SuiteError(
                f"schemas/expectations/{table}.json: {len(spec['expectations']) - len(suite.expectations)} "
                "expectation(s) are not valid Great Expectations configurations"
            )
        suites[table] = suite
    return batches, suites


@dataclass
class ValidationOutcome:
    """What one batch's validation decided."""

    passed: dict[str, pa.Array] = field(default_factory=dict)
    """table → boolean mask over the staged rows: True where every expectation passed."""
    quarantine: list[dict[str, Any]] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def validate_batch(conn: duckdb.DuckDBPyConnection, staged: dict[str, pa.Table]) -> ValidationOutcome:
    """Validate staged Arrow tables (each with a ``_row`` column) with the tables' suites.

    ``staged`` maps table name to the batch's records; they must already be registered in
    ``conn`` as ``stage_<table>``. Returns pass masks, quarantine entries (without run and
    input ids, which the caller adds) and one result per expectation.
    """
    batches, suites = _gx()
    outcome = ValidationOutcome()
    for table, records in staged.items():
        n = records.num_rows
        failed: dict[int, list[tuple[str, str]]] = {}
        if n:
            frame = conn.sql(_CHECK_SQL[table]).df()
            batch = batches[table].get_batch(batch_parameters={"dataframe": frame})
            result = batch.validate(
                suites[table],
                result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["_row"]},
            )
            by_row = frame.set_index("_row", drop=False)
            for r in result.results:
                cfg = r.expectation_config
                meta = cfg.meta or {}
                check = meta.get("check_name", cfg.type)
                info = r.result or {}
                rows = [int(u["_row"]) for u in info.get("unexpected_index_list") or []]
                raised = (r.exception_info or {}).get("raised_exception") if isinstance(r.exception_info, dict) else False
                if raised:
                    # An expectation that could not run must not let records through unchecked.
                    rows = list(range(n))
                    msg = (r.exception_info or {}).get("exception_message", "expectation failed to run")
                    for row in rows:
                        failed.setdefault(row, []).append((check, f"check could not run: {msg}"))
                else:
                    for row in rows:
                        values = {k: _clean(v) for k, v in by_row.loc[row].to_dict().items()}
                        try:
                            detail = meta.get("detail", check).format(**values)
                        except (KeyError, IndexError, ValueError):
                            detail = meta.get("detail", check)
                        failed.setdefault(row, []).append((check, detail))
                keys = sorted({str(by_row.loc[row, "record_key"]) for row in rows[:20]})
                outcome.results.append(
                    {
                        "suite": table,
                        "expectation": check,
                        "expectation_type": cfg.type,
                        "kwargs": json.dumps({k: v for k, v in cfg.kwargs.items() if k != "batch_id"}, default=str),
                        "success": bool(r.success) and not raised,
                        "element_count": int(info.get("element_count") or n),
                        "unexpected_count": len(rows) if raised else int(info.get("unexpected_count") or 0),
                        "unexpected_percent": 100.0 if raised else float(info.get("unexpected_percent") or 0.0),
                        "failing_keys": keys,
                    }
                )
            for row, checks in sorted(failed.items()):
                for check, detail in checks:
                    outcome.quarantine.append(
                        {"table": table, "row": row, "record_kind": SUITES[table],
                         "record_key": str(by_row.loc[row, "record_key"]), "check_name": check, "detail": detail}
                    )
        mask = [True] * n
        for row in failed:
            mask[row] = False
        outcome.passed[table] = pa.array(mask, type=pa.bool_())
    return outcome
