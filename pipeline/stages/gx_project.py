"""Great Expectations' file data context in the warehouse (``<warehouse>/gx/``): the objects a
Great Expectations user finds there (each table's suite, data asset, validation definition and
checkpoint), each batch's results recorded there as the table's checkpoint records a run's,
the results that wait as JSON until then (``FEATUREHOUSE_DATA_DOCS=report``), and the Data Docs
built from them. ``validate`` judges; this module records.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import os
import re
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from .gx_setup import _GX_USE, BATCH_DEFINITION, SUITES, _gx, load_suite

log = logging.getLogger("pipeline.stages.validate")

__all__ = ["store_results", "store_pending", "has_pending", "build_data_docs", "checkpoint_name"]


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
                  outcome: Any, pages: bool = False) -> int:
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
        return _store(project_dir, run_id, batch_no, validated_at, outcome.gx_results, pages)


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
           gx_results: dict[str, Any], pages: bool = False) -> int:
    """``store_results`` of a batch's ``ValidationOutcome.gx_results`` (table → result)."""
    if not gx_results:  # nothing was judged: no Great Expectations to import for it
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
    for table, result in gx_results.items():
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
    return len(gx_results)


#: Where results judged by DuckDB wait, as JSON, for Great Expectations to record them when the
#: run's Data Docs are built (``Settings.data_docs = "report"``): under the results store's folder.
_PENDING = Path("gx") / "uncommitted" / "featurehouse-pending"


def store_pending(project_dir: Path | str, run_id: str, batch_no: int, validated_at: Any,
                  outcome: Any) -> int | None:
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
            gx_results = {kept["table"]: kept["record"]}
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
        _store(project_dir, run_id, batch_no, at, gx_results)
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


#: A validation page's link in the site's index (its path, quoted as a URL's: a run id may hold ``:``).
_RESULT_LINK = re.compile(r"""validations/[^"'\s<>]+?\.html""")


def _index_current(base: Path, site: Path) -> bool:
    """Whether the site's index is whole and links exactly the results stored, each of which has
    its page, and each of featurehouse's suites: read off the folders and the index's text,
    without Great Expectations, so that ``featurehouse report`` of a run whose Data Docs are
    built costs no import of it (2.5-6 CPU-s). A result another process stored while the index
    was being built is not in its text, nor is one deleted since gone from it: the index is
    built again."""
    try:
        text = (site / "index.html").read_text(encoding="utf-8", errors="replace")
        if not text.rstrip().endswith("</html>"):  # cut short (a disk full while it was written)
            return False
        stored = {p.relative_to(base).with_suffix(".html").as_posix() for p in base.glob("validations/*/*/*/*.json")}
        linked = {unquote(m) for m in _RESULT_LINK.findall(text)}
        return (linked == stored and not _pages_missing(base, site)
                and all(f"expectations/{suite}.html" in text for suite in SUITES))
    except OSError:  # no index yet, or a file gone while looked at: build it
        return False


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
    nightly DAG's report task refresh it (unless it is whole and links exactly the results stored,
    each with its page: ``_index_current``). Results waiting as JSON (``store_pending``) are
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
    if all(p.exists() for p in pages) and (
            not index and (site / "index.html").exists() or index and not waiting and _index_current(base, site)):
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
