"""Validate stage: run the Great Expectations suite of each table once per batch.

The suites live in ``schemas/expectations/<table>.json``. Great Expectations checks columns,
so each record's list-valued facts (lengths, maxima, finiteness) are first derived as scalar
check columns in DuckDB, vectorised over the whole batch; the suite then judges them. A record
that fails any expectation is kept out of its table and quarantined with the check's name and a
readable detail taken from the expectation's ``meta.detail`` template.

DuckDB judges the suites in SQL with Great Expectations' semantics (``sql_judge``); Great
Expectations itself judges only a suite with an expectation type DuckDB does not evaluate (in an
ephemeral context: ``batch.validate``). Either way the results are recorded in the warehouse's
file data context (``gx/``), where each table has a validation definition and a checkpoint
(``featurehouse-<table>``), as that checkpoint records a run's, and its Data Docs are built from
them. ``frame_for`` gives a batch's check columns as a pandas frame, for a Great Expectations
user to run the checkpoint again (docs/report.md).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import json
import logging
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from glob import escape as glob_escape
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import duckdb

from ..config import SCHEMAS_DIR
from . import parse
from .materialise import EXCERPT, excerpt_columns

log = logging.getLogger(__name__)

__all__ = [
    "SUITES", "SuiteError", "ValidationOutcome", "validate_batch", "load_suite",
    "store_results", "build_data_docs", "frame_for", "checkpoint_name",
]

#: table name → record kind; one suite per table.
SUITES = {"features": "feature", "activations": "activation", "explanations": "explanation"}

# Scalar check columns derived from each staged table; the suites refer to these names.
# ``input_key`` names a record's input (a hash of its digest, small in the frame): an id is
# unique within its input; two inputs that bring one id are captures, settled by the load.
_CHECK_SQL = {
    "features": """
        SELECT _row, concat_ws('/', coalesce(model_id, '?'), coalesce(source_id, '?'), coalesce(feature_index::VARCHAR, '?')) AS record_key,  -- '?' marks a missing part
               model_id, source_id, feature_index, frac_nonzero, max_act_approx,
               coalesce(len(pos_str), 0) AS n_pos_str, coalesce(len(pos_values), 0) AS n_pos_values,
               coalesce(len(neg_str), 0) AS n_neg_str, coalesce(len(neg_values), 0) AS n_neg_values
        FROM stage_features""",
    "activations": """
        SELECT _row, coalesce(activation_id, '(no id) in ' || page_key) AS record_key,
               activation_id, hash(input_sha256) AS input_key, feature_index,
               concat_ws('/', coalesce(model_id, '?'), coalesce(source_id, '?'), coalesce(feature_index::VARCHAR, '?')) AS feature_key, page_key,
               coalesce(model_id || '/' || source_id || '/' || feature_index = page_key, false)
                   AS feature_key_matches_page,
               coalesce(len(tokens), 0) AS n_tokens, coalesce(len("values"), 0) AS n_values,
               coalesce(len(tokens) - list_count(tokens), 0) AS n_null_tokens,
               coalesce(len("values") - list_count("values"), 0) AS n_null_values,
               -- NaN and infinities make the sum non-finite: count them only then
               CASE WHEN isfinite(coalesce(list_sum("values"), 0)) THEN 0
                    ELSE len(list_filter("values", x -> NOT isfinite(x))) END AS n_nonfinite_values,
               list_max("values") AS max_of_values, max_value, max_value_token_index,
               CASE WHEN max_value_token_index >= 0
                    THEN "values"[max_value_token_index + 1] END AS value_at_max_index,
               min_value,
               coalesce(max_value_token_index < len("values"), false) AS max_index_in_excerpt,
               coalesce(min_value <= max_value, false) AS min_not_above_max
        FROM stage_activations""",
    "explanations": """
        SELECT _row, coalesce(explanation_id, '(no id) for ' || concat_ws('/', coalesce(model_id, '?'), coalesce(source_id, '?'), coalesce(feature_index::VARCHAR, '?'))) AS record_key,
               explanation_id, hash(input_sha256) AS input_key, feature_index,
               coalesce(length(trim(description)), 0) AS description_length,
               embedding_dim, embedding_numeric,
               -- an embedding needs a length (norm) to have a direction: all zeros have none, and
               -- values so small or large that their squares' sum is not a normal double cannot be
               -- normalised (a cosine with them is undefined: NaN, or 0 for every other feature)
               CASE WHEN embedding IS NOT NULL AND len(embedding) > 0
                    THEN coalesce(list_sum(list_transform(embedding, x -> x * x))
                                  BETWEEN 2.2250738585072014e-308 AND 1.7976931348623157e308, false)
               END AS embedding_not_zero
        FROM stage_explanations""",
}

#: The activation checks, and beside them the excerpt columns the statistics need (``x_``…).
_ACTIVATION_CHECKS_AND_EXCERPTS = _CHECK_SQL["activations"].replace(
    "\n        FROM stage_activations", f",\n               {excerpt_columns('x_')}\n        FROM stage_activations")
assert _ACTIVATION_CHECKS_AND_EXCERPTS != _CHECK_SQL["activations"]


class SuiteError(ValueError):
    "An expectation suite file is not valid."


@functools.cache
def load_suite(table: str) -> dict[str, Any]:
    """The expectation suite for ``table``, as stored in ``schemas/expectations``."""
    return json.loads((SCHEMAS_DIR / "expectations" / f"{table}.json").read_text())


#: Modules Great Expectations imports at start-up for expectations featurehouse's suites do not
#: use (``scipy.stats`` for the KL-divergence and KS-test ones): made lazy, they load on first
#: use. Measured here: ``import great_expectations`` 4.6 s -> 3.4 s of CPU, in every process
#: that validates (a CLI ingest, an Airflow task).
_DEFERRED_IMPORTS = ("scipy.stats",)


def _defer_unused_imports() -> None:
    """Put a lazy module (``importlib.util.LazyLoader``) in ``sys.modules`` for each of
    ``_DEFERRED_IMPORTS`` not imported yet: ``from scipy import stats`` then binds a module that
    runs its code on first attribute access. Only a ``from package import module`` works this way
    (a plain ``import package`` touches the module's spec, which loads it), hence scipy.stats
    and not altair."""
    import importlib.util
    import sys

    for name in _DEFERRED_IMPORTS:
        if name in sys.modules:
            continue
        parent, _, child = name.rpartition(".")
        try:
            package = importlib.import_module(parent)
            spec = importlib.util.find_spec(name)
        except ImportError:
            continue
        if spec is None or spec.loader is None:
            continue
        spec.loader = importlib.util.LazyLoader(spec.loader)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        setattr(package, child, module)


@contextlib.contextmanager
def heavy_imports() -> Iterator[None]:
    """Run a block of heavy imports (Great Expectations, Altair) with Python's cyclic garbage
    collector paused, then freeze what it made (``gc.freeze``).

    An import makes hundreds of thousands of objects that live as long as the process and are
    never garbage: the collector's full passes, triggered again and again as they pile up, walk
    them all for nothing, and every later full pass (and the interpreter's teardown) walks them
    again. Measured on one new page: 0.67 s of the run's 5.7 s in collections, 0.49 s of it
    in full passes. Frozen objects are left out of every later pass; the collector runs as
    before for what the run itself makes. Blocks in several threads at once keep it paused
    until the last ends; a collector the caller had switched off stays off.
    """
    global _gc_pausers, _gc_was_on
    with _GC_PAUSE:
        if _gc_pausers == 0:
            _gc_was_on = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _GC_PAUSE:
            _gc_pausers -= 1
            gc.freeze()
            if _gc_pausers == 0 and _gc_was_on:
                gc.enable()


#: Blocks inside ``heavy_imports`` now, in any thread, and whether the collector was on before
#: the first of them: the last one out switches it back on.
_GC_PAUSE = threading.Lock()
_gc_pausers = 0
_gc_was_on = False


@functools.lru_cache(maxsize=1)
def _gx():
    with heavy_imports():  # ~390,000 objects that live as long as the process
        return _set_up_gx()


def _set_up_gx():
    # first, under the lock parse's page check takes: Great Expectations imports it through
    # Altair, maybe while the main thread checks the first pages (see page_check._JSONSCHEMA_IMPORT)
    parse.import_jsonschema()
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    _defer_unused_imports()
    import great_expectations as gx  # heavy: imported on first validation, not at import time
    from great_expectations.data_context.types.base import ProgressBarsConfig

    # Great Expectations logs routine set-up (its temporary docs folder) at INFO: not news.
    logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.WARNING)
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = context.data_sources.add_pandas("featurehouse")
    batches = {}
    suites = {}
    for table in SUITES:
        asset = source.add_dataframe_asset(table)
        batches[table] = asset.add_batch_definition_whole_dataframe(BATCH_DEFINITION)
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


_GX_LOCK = threading.Lock()
_GX_USE = threading.RLock()
"""Held while Great Expectations validates or stores results: ingest stores a batch's results
in a thread (beside DuckDB's load of it), and the two never run Great Expectations at once."""


def warm_up() -> None:
    """Import Great Expectations and build the suites now (about 3 s), e.g. in a thread while
    the first batch is landed and read: DuckDB releases the GIL, so the two overlap."""
    _suites()


@dataclass
class ValidationOutcome:
    """What one batch's validation decided."""

    quarantine: list[dict[str, Any]] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)
    gx_results: dict[str, Any] = field(default_factory=dict)
    """table → Great Expectations' own validation result, for Data Docs (see ``store_results``)."""


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def validate_batch(conn: duckdb.DuckDBPyConnection, staged: dict[str, Any]) -> ValidationOutcome:
    """Validate the batch's staged records with the tables' suites.

    ``staged`` names the tables to validate (its values are not used); each must be readable in
    ``conn`` as ``stage_<table>`` (a view or table with a unique ``_row`` id per record). Returns quarantine entries (without run and
    input ids, which the caller adds) and one result per expectation.
    """
    outcome = ValidationOutcome()
    _validate_tables(conn, staged, outcome)
    return outcome


def _suites() -> tuple[dict, dict]:
    """Great Expectations' batch definitions and suites, set up once per process (under the
    lock: a warm-up thread may be setting them up)."""
    with _GX_LOCK:
        return _gx()


def _check_relation(conn: duckdb.DuckDBPyConnection, table: str) -> str:
    """Compute the staged ``table``'s check columns into a temporary table; returns a query of
    them (one row per record, ``_row`` its id)."""
    if table == "activations":
        # One pass over the batch's token and value lists: the checks, and beside them what
        # the statistics need (the load reads it back for the rows that load).
        conn.execute(f"CREATE OR REPLACE TEMP TABLE stage_activation_checks AS {_ACTIVATION_CHECKS_AND_EXCERPTS}")
        return (f"SELECT * EXCLUDE ({', '.join('x_' + n for n, _ in EXCERPT)}) "
                "FROM stage_activation_checks")
    conn.execute(f"CREATE OR REPLACE TEMP TABLE stage_{table}_checks AS {_CHECK_SQL[table]}")
    return f"SELECT * FROM stage_{table}_checks"


def _check_frame(conn: duckdb.DuckDBPyConnection, table: str):
    """The staged ``table``'s check columns, a pandas frame for Great Expectations."""
    return conn.sql(_check_relation(conn, table)).df()


def frame_for(table: str, warehouse: Any, *, run_id: str | None = None, inputs: list[str] | None = None):
    """The frame ``table``'s suite judges, as a pandas DataFrame: its check columns, one row per
    record (``record_key`` names it), for the records of inputs the warehouse landed: those of
    the run ``run_id`` loaded, or the inputs of the sha256 digests ``inputs``. The records the
    ingest quarantined are in it, beside those that loaded.

    It is built as the ingest builds a batch's: the inputs' bytes read again from the landing
    area (each on the Python road, which the golden tests hold to the DuckDB road's rows),
    staged, rival captures of a feature among them settled (the newest stays), and the check
    columns computed by the same SQL. Run through the table's checkpoint
    (``featurehouse-<table>``, see docs/report.md) it fails the records the ingest quarantined,
    with the same checks, when the inputs were judged in one batch (a run's inputs up to the
    batch size, 48 MiB or 20,000 activations by default, are one). The records are held in
    memory: meant for pages and modest export files, not a many-GB export batch.
    """
    from ..lake import landing
    from ..lake import warehouse as lake
    from . import captures, stage

    if table not in SUITES:
        raise ValueError(f"no suite judges {table!r}: one of {', '.join(SUITES)}")
    if (run_id is None) == (inputs is None):
        raise ValueError("name a run (run_id) or inputs (their sha256 digests), not both")
    settings = lake.settings_for(warehouse)
    conn = lake.connect(settings, read_only=True)
    try:
        if inputs is None:
            inputs = [sha for (sha,) in conn.execute(
                "SELECT DISTINCT input_sha256 FROM run_inputs WHERE run_id = ? AND outcome = 'loaded' ORDER BY 1",
                [run_id]).fetchall()]
        found = conn.execute("SELECT input_sha256, any_value(format), any_value(captured_at) FROM raw_inputs "
                             "WHERE input_sha256 IN (SELECT unnest(?::VARCHAR[])) GROUP BY ALL ORDER BY 1",
                             [list(inputs)]).fetchall()
    finally:
        conn.close()
    missing = sorted(set(inputs) - {sha for sha, _, _ in found})
    if missing:
        raise ValueError(f"the warehouse landed no input {missing[0]}")
    scratch = duckdb.connect()
    try:
        stage.read_api_json(scratch, [])  # (no input on the DuckDB roads: empty tables)
        stage.read_exports(scratch, {})
        records: dict[str, list[tuple[str, Any]]] = {t: [] for t in stage.STAGED_TABLES}
        for sha, fmt, _ in found:
            for parsed in _parse_landed(landing.landed_path(settings.landing_root, sha), fmt or "", settings):
                for t, kept in records.items():
                    kept.extend((sha, r) for r in getattr(parsed, t))
        stage.stage_parsed(scratch, records)
        del records
        stage.create_views(scratch)
        scratch.execute("CREATE TEMP TABLE batch_inputs (input_sha256 VARCHAR, captured_at TIMESTAMP, is_page BOOLEAN)")
        scratch.executemany("INSERT INTO batch_inputs VALUES (?, ?, ?)",
                            [(sha, at, not (fmt or "").endswith("export_jsonl")) for sha, fmt, at in found])
        captures.claim_captures(scratch)
        return _check_frame(scratch, table)
    finally:
        scratch.close()


def _parse_landed(where: Any, fmt: str, settings: Any) -> Iterator[Any]:
    """A landed input's records, as the Python road parses them (a gzip export batch, one
    ``ParsedInput`` per line; a line that is no record, or an input refused, gives none: no
    suite judged it)."""
    import gzip

    from ..lake import landing

    if fmt == "gzip+export_jsonl":  # a gzip export batch: its lines, streamed (the ingest's road)
        with landing.open_landed(where) as raw, gzip.open(raw) as lines:
            for n, line in enumerate(lines, 1):
                if line.strip():
                    try:
                        yield parse.parse_export_line(line, n)
                    except parse.Rejected:
                        continue
        return
    try:
        yield parse.parse_bytes(landing.read_landed(where), settings)
    except parse.Rejected:
        return


#: Who judges a batch's check columns. ``"duckdb"``: each expectation of a type in ``sql_judge``
#: is evaluated as SQL in DuckDB, with Great Expectations' semantics (a test holds the two
#: roads to the same outcome), and Great Expectations records the results for its Data Docs
#: in the store's thread; a suite with any other type goes to Great Expectations whole.
#: ``"gx"``: Great Expectations judges every table (on a pandas frame of the check columns).
JUDGE = "duckdb"


def _validate_tables(conn: duckdb.DuckDBPyConnection, staged: dict[str, Any], outcome: ValidationOutcome) -> None:
    from . import sql_judge

    frames = {}
    for table in staged:
        query = _check_relation(conn, table)
        if JUDGE == "duckdb" and sql_judge.can_judge(load_suite(table)):
            sql_judge.judge(conn, table, query, load_suite(table), outcome, SUITES[table])
        else:
            frames[table] = conn.sql(query).df()
    # Great Expectations (~3 s of CPU to import) only once a table has records to judge: a batch
    # whose every input was refused before staging has none, and pays nothing for it.
    # Every table's check columns first (DuckDB), then Great Expectations judges them: the
    # first batch's checks run while Great Expectations is still being imported in a thread.
    if frames:
        with _GX_USE:
            _gx_judge(frames, outcome)


def _gx_judge(frames: dict[str, Any], outcome: ValidationOutcome) -> None:
    for table, frame in frames.items():
        n = len(frame)
        failed: dict[int, list[tuple[str, str]]] = {}
        if n:
            batches, suites = _suites()
            batch = batches[table].get_batch(batch_parameters={"dataframe": frame})
            result = batch.validate(
                suites[table],
                result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["_row"]},
            )
            outcome.gx_results[table] = result
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
                    rows = [int(x) for x in frame["_row"]]
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


# ---------------------------------------------------------------------------------------------
# Great Expectations' file data context under ``<warehouse dir>/gx/``: what a Great Expectations
# user finds there, and where each batch's results are recorded for the Data Docs. Per table:
# the suite; a pandas data source ``featurehouse`` with a dataframe asset named after the table
# and its whole-dataframe batch definition; a validation definition (the suite on that batch
# definition) and a checkpoint ``featurehouse-<table>`` over it, whose action updates the Data
# Docs. One checkpoint per table: a checkpoint's batch parameters go to every validation
# definition it holds, and each table's suite judges its own frame. Featurehouse's own judging
# runs in DuckDB (``sql_judge``) or in the ephemeral context above; its results are recorded
# here as the checkpoint's run would record them (the same keys' shape, its validation
# definition's and checkpoint's ids in their meta), and their Data Docs pages built with them.

_PARTIAL = 20  # unexpected values and row indices kept per expectation in the stored results

#: The pandas data source of the file data context; each table's dataframe asset is in it.
DATA_SOURCE = "featurehouse"
#: Each asset's batch definition (the whole dataframe a run is given).
BATCH_DEFINITION = "whole"
#: The result format of the checkpoints: every failing record, named by its ``record_key``.
CHECKPOINT_RESULT_FORMAT = {"result_format": "COMPLETE", "unexpected_index_column_names": ["record_key"]}
#: The name of the checkpoints' action that updates the Data Docs.
DATA_DOCS_ACTION = "update_data_docs"


def checkpoint_name(table: str) -> str:
    """The checkpoint that validates ``table``'s frame (see ``frame_for``): ``featurehouse-<table>``."""
    return f"featurehouse-{table}"


@dataclass(frozen=True)
class _Project:
    """A file data context and, per table, the ids of its validation definition and checkpoint."""

    context: Any
    ids: dict[str, tuple[str, str]]


@functools.lru_cache(maxsize=4)
def _file_context(project_dir: str) -> _Project:
    """The file data context in ``project_dir`` (its ``gx/`` folder), with every table's suite,
    data asset, batch definition, validation definition and checkpoint in it: made the first
    time, brought up to date with ``schemas/expectations`` when a suite changed there, found as
    they are afterwards. Under a lock file (``gx/uncommitted/featurehouse-setup.lock``): two
    processes setting up one warehouse at once do not both add an object (Great Expectations
    refuses the second: "Store already has the following key"), and none reads the context's
    configuration half written."""
    import fcntl

    _gx()  # sets up Great Expectations (analytics off) once per process
    lock_dir = Path(project_dir) / "gx" / "uncommitted"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / "featurehouse-setup.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            return _set_up_project(project_dir)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _set_up_project(project_dir: str) -> _Project:
    import great_expectations as gx
    from great_expectations.checkpoint import UpdateDataDocsAction
    from great_expectations.exceptions import DataContextError

    context = gx.get_context(mode="file", project_root_dir=project_dir)
    try:
        source = context.data_sources.get(DATA_SOURCE)
    except KeyError:
        source = context.data_sources.add_pandas(DATA_SOURCE)
    ids = {}
    for table in SUITES:
        spec = load_suite(table)
        wanted = gx.ExpectationSuite(name=spec["name"], expectations=spec["expectations"], meta=spec.get("meta", {}))
        try:
            suite = context.suites.get(spec["name"])
        except DataContextError:
            suite = context.suites.add(wanted)
        else:
            if _shape(suite) != _shape(wanted) or any(suite.meta.get(k) != v for k, v in wanted.meta.items()):
                suite = context.suites.add_or_update(wanted)  # the suite changed in schemas/
        try:
            asset = source.get_asset(table)
        except LookupError:
            asset = source.add_dataframe_asset(table)
        try:
            batch = asset.get_batch_definition(BATCH_DEFINITION)
        except KeyError:
            batch = asset.add_batch_definition_whole_dataframe(BATCH_DEFINITION)
        try:
            definition = context.validation_definitions.get(table)
            if definition.suite.name != suite.name or definition.data.name != batch.name \
                    or definition.asset.name != table:
                raise DataContextError("another validation definition")
        except DataContextError:
            definition = context.validation_definitions.add_or_update(
                gx.ValidationDefinition(name=table, data=batch, suite=suite))
        name = checkpoint_name(table)
        try:
            checkpoint = context.checkpoints.get(name)
            if [d.name for d in checkpoint.validation_definitions] != [definition.name] \
                    or not any(isinstance(a, UpdateDataDocsAction) for a in checkpoint.actions) \
                    or checkpoint.result_format != CHECKPOINT_RESULT_FORMAT:
                raise DataContextError("another checkpoint")
        except DataContextError:
            checkpoint = context.checkpoints.add_or_update(gx.Checkpoint(
                name=name, validation_definitions=[definition],
                actions=[UpdateDataDocsAction(name=DATA_DOCS_ACTION)], result_format=CHECKPOINT_RESULT_FORMAT))
        ids[table] = (definition.id, checkpoint.id)
    return _Project(context, ids)


def _shape(suite: Any) -> list[tuple[str, dict, dict]]:
    """A suite's expectations as type, arguments and meta (not their ids, which a store gives)."""
    return [(c.type, c.kwargs, c.meta) for c in (e.configuration for e in suite.expectations)]


def _trim(result: Any) -> Any:
    """Cap the per-row lists a COMPLETE result carries, so stored results stay small."""
    for r in result.results:
        info = r.result or {}
        for key in ("unexpected_list", "unexpected_index_list"):
            if isinstance(info.get(key), list) and len(info[key]) > _PARTIAL:
                info[key] = info[key][:_PARTIAL]
    return result


def store_results(project_dir: Path | str, run_id: str, batch_no: int, validated_at: Any,
                  outcome: ValidationOutcome, pages: bool = False) -> int:
    """Record one batch's results in the file data context in ``project_dir``, as its table's
    checkpoint (``featurehouse-<table>``) records a run's.

    Results are keyed by suite, run name ``run_id``, the batch's time and ``batch-<n>-<table>``,
    which is how ``build_data_docs`` finds a run's pages; their meta names the validation
    definition and checkpoint (their ids), the data source and asset, as a run of the checkpoint
    has it. Trims the stored per-row lists to 20 entries. With ``pages``, also builds the
    batch's Data Docs pages (not the site's index), so that the run's report has only the index
    left to build. Returns how many results were written.
    """
    with _GX_USE:
        return _store(project_dir, run_id, batch_no, validated_at, outcome, pages)


def _as_checkpoint_ran(result: Any, project: _Project, table: str, run: Any, validated_at: Any) -> Any:
    """``result`` with the meta a run of the table's checkpoint gives its result
    (``ValidationDefinition.run``, ``Checkpoint.run``)."""
    validation_id, checkpoint_id = project.ids[table]
    result.meta.update({
        "active_batch_definition": {"datasource_name": DATA_SOURCE, "data_connector_name": "fluent",
                                    "data_asset_name": table, "batch_identifiers": {"dataframe": "<DATAFRAME>"}},
        "validation_id": validation_id,
        "checkpoint_id": checkpoint_id,
        "run_id": run,  # shown as the run's name and time on the Data Docs page
        "validation_time": validated_at,
        "batch_parameters": {"dataframe": "<DATAFRAME>"},
    })
    return result


def _store(project_dir: Path | str, run_id: str, batch_no: int, validated_at: Any,
           outcome: ValidationOutcome, pages: bool = False) -> int:
    if not outcome.gx_results:  # nothing was judged: no Great Expectations to import for it
        return 0
    from great_expectations.core.run_identifier import RunIdentifier
    from great_expectations.data_context.types.resource_identifiers import (
        ExpectationSuiteIdentifier,
        ValidationResultIdentifier,
    )

    project = _file_context(str(project_dir))
    context = project.context
    if getattr(validated_at, "tzinfo", True) is None:  # our timestamps are naive UTC
        validated_at = validated_at.replace(tzinfo=datetime.timezone.utc)
    run = RunIdentifier(run_name=run_id, run_time=validated_at)
    keys = []
    for table, result in outcome.gx_results.items():
        if isinstance(result, dict):  # judged by DuckDB (sql_judge): Great Expectations records it
            from .sql_judge import to_great_expectations

            result = to_great_expectations(result)
        suite = ExpectationSuiteIdentifier(name=result.suite_name)
        key = ValidationResultIdentifier(expectation_suite_identifier=suite, run_id=run,
                                         batch_identifier=f"batch-{batch_no:04d}-{table}")
        context.validation_results_store.store_validation_results(
            _trim(_as_checkpoint_ran(result, project, table, run, validated_at)), key, suite)
        keys.append(key)
    if pages:
        # the pages the checkpoint's action (UpdateDataDocsAction) builds, without the site's
        # index, which it rebuilds from every result stored, of every run (see build_data_docs)
        context.build_data_docs(resource_identifiers=keys, build_index=False)
    return len(outcome.gx_results)


#: Where results judged by DuckDB wait, as JSON, for Great Expectations to record them when the
#: run's Data Docs are built (``Settings.data_docs = "report"``): under the results store's folder.
_PENDING = Path("gx") / "uncommitted" / "featurehouse-pending"


def needs_great_expectations(data_docs: str) -> bool:
    """Whether an ingest imports Great Expectations: to judge (a suite DuckDB cannot judge, or
    ``JUDGE = "gx"``), or to record results and build Data Docs with the run (``data_docs="run"``)."""
    from . import sql_judge

    return data_docs != "report" or JUDGE != "duckdb" or not all(
        sql_judge.can_judge(load_suite(t)) for t in SUITES)


def store_pending(project_dir: Path | str, run_id: str, batch_no: int, validated_at: Any,
                  outcome: ValidationOutcome) -> int | None:
    """Keep one batch's results, judged by DuckDB, as JSON until the run's Data Docs are built
    (``build_data_docs`` has Great Expectations record them then); no Great Expectations here.
    Returns how many tables' results were kept, or None when a table was judged by Great
    Expectations (its result is an object of Great Expectations: ``store_results`` stores it)."""
    if not all(isinstance(r, dict) for r in outcome.gx_results.values()):
        return None
    folder = Path(project_dir) / _PENDING / run_id
    for table, record in outcome.gx_results.items():
        path = folder / f"batch-{batch_no:04d}-{table}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        text = json.dumps({"batch_no": batch_no, "validated_at": validated_at.isoformat(),
                           "table": table, "record": record}, default=str)
        for attempt in (1, 2, 3):
            # a report recording this run's waiting results meanwhile removes the folder when
            # it has emptied it (_record_pending): made again, the file written again
            folder.mkdir(parents=True, exist_ok=True)
            try:
                tmp.write_text(text)
                os.replace(tmp, path)
                break
            except FileNotFoundError:
                if attempt == 3:
                    raise
    return len(outcome.gx_results)


def _record_pending(project_dir: Path | str, run_id: str) -> int:
    """Have Great Expectations record the run's results kept by ``store_pending``; returns how
    many batches' were recorded. Each file is removed once its results are stored."""
    folder = Path(project_dir) / _PENDING / run_id
    files = sorted(folder.glob("batch-*.json")) if folder.is_dir() else []
    done = 0
    for path in files:
        try:
            kept = json.loads(path.read_text())
            outcome = ValidationOutcome(gx_results={kept["table"]: kept["record"]})
            batch_no, at = int(kept["batch_no"]), datetime.datetime.fromisoformat(kept["validated_at"])
        except FileNotFoundError:
            continue  # another report recorded it meanwhile (recording it twice stores one result)
        except (ValueError, KeyError, TypeError) as exc:
            # damaged (a full disk, a hand): set aside, so it stops no other result's recording
            aside = path.with_name(path.name + ".broken")
            with contextlib.suppress(OSError):
                os.replace(path, aside)
            log.warning("a waiting Great Expectations result could not be read (%s: %s); set aside as %s",
                        type(exc).__name__, exc, aside)
            continue
        _store(project_dir, run_id, batch_no, at, outcome)
        path.unlink(missing_ok=True)
        done += 1
    if files:
        with contextlib.suppress(OSError):
            folder.rmdir()
    return done


def _pending_runs(project_dir: Path | str) -> list[str]:
    """The runs whose results wait for Great Expectations to record them (``store_pending``)."""
    folder = Path(project_dir) / _PENDING
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def has_pending(project_dir: Path | str, run_id: str) -> bool:
    """Whether the run has results waiting for its Data Docs (see ``store_pending``)."""
    folder = Path(project_dir) / _PENDING / run_id
    return folder.is_dir() and any(folder.glob("batch-*.json"))


def _pages_missing(base: Path, site: Path) -> bool:
    """Whether a result stored has no Data Docs page (a report killed between the two): read
    off the folders, without Great Expectations."""
    return any(not (site / p.relative_to(base).with_suffix(".html")).exists()
               for p in base.glob("validations/*/*/*/*.json"))


def _no_page(like):
    """A validation result key no stored result has (``like``'s, in a batch no run names)."""
    from great_expectations.data_context.types.resource_identifiers import (
        ValidationResultIdentifier,
    )

    return ValidationResultIdentifier(expectation_suite_identifier=like.expectation_suite_identifier,
                                      run_id=like.run_id, batch_identifier="featurehouse-index-only")


def build_data_docs(project_dir: Path | str, run_id: str, *, index: bool = True) -> list[Path]:
    """Build the Great Expectations Data Docs pages for one run's stored results.

    Returns the run's validation pages (one per suite and batch, sorted); the site's index is
    ``<project_dir>/gx/uncommitted/data_docs/local_site/index.html``. Returns an empty list
    when the run stored no results.

    Pages built as their batches were stored (``store_results(pages=True)``) are not built
    again. ``index``: rebuild the site's index, which Great Expectations does from every result
    stored, of every run (~5 ms each, measured: 0.55 s of a one-page run with 99 stored, and
    an inbox run every few minutes stores ~3 more). Without it (a run's own report, written by
    ``ingest``) the index is built only when the site has none; ``featurehouse report`` and the
    nightly DAG's report task refresh it. Results waiting as JSON (``store_pending``) are
    recorded first: the run's, and with ``index`` every run's, with their pages, so that the
    index lists every run (an inbox run's too, which no report command names).
    """
    # The results store is a folder per suite and run: when the run stored none (an unchanged
    # re-run), there is nothing to build, and no reason to import Great Expectations (seconds).
    base = Path(project_dir) / "gx" / "uncommitted"
    # The index lists every result stored: refreshing it records every run's waiting results
    # first (an inbox run's, which no report command named), and builds their pages below.
    waiting = [r for r in _pending_runs(project_dir) if r == run_id or index and has_pending(project_dir, r)]
    if waiting:
        with _GX_USE:
            for run in waiting:
                _record_pending(project_dir, run)
    stored = sorted(base.glob(f"validations/*/{glob_escape(run_id)}/*/*.json"))
    site = base / "data_docs" / "local_site"  # where _file_context's site writes
    if not stored and not (index and (waiting or _pages_missing(base, site))):
        return []
    pages = [site / p.relative_to(base).with_suffix(".html") for p in stored]
    if not index and (site / "index.html").exists() and all(p.exists() for p in pages):
        return pages  # nothing to build: no Great Expectations, nothing read of other runs
    with _GX_USE:
        context = _file_context(str(project_dir)).context
        every = context.validation_results_store.list_keys()
        keys = [k for k in every if k.run_id.run_name == run_id]
        # every other run's result whose page is missing (recorded above, or by a report killed
        # before its pages were built): the index links them
        others = [k for k in every if index and k.run_id.run_name != run_id]
        if not keys and not others:
            return []
        root = Path(unquote(urlparse(context.build_data_docs(dry_run=True)["local_site"]).path)).parent

        def page(k) -> Path:
            suite, run_name, run_time, batch = k.to_tuple()
            return root / "validations" / suite / run_name / run_time / f"{batch}.html"

        missing = [k for k in keys + others if not page(k).exists()]
        with_index = index or not (root / "index.html").exists()
        if missing:
            context.build_data_docs(resource_identifiers=missing, build_index=with_index)
        elif with_index:
            # Great Expectations takes no list as every page in the store: given a key no
            # result has, it builds no page, then the index.
            context.build_data_docs(resource_identifiers=[_no_page((keys or others)[0])])
    return sorted(p for p in map(page, keys) if p.exists())
