"""Great Expectations in this process: imported once (the collector paused, modules it would
load for expectations featurehouse's suites do not use made lazy), the suites as its objects in
an ephemeral context, and the lock every user of it in the process takes (``_GX_USE``).

``validate`` judges with it when DuckDB cannot (``JUDGE``); ``gx_project`` records results in
the warehouse's file data context with it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from ..config import SCHEMAS_DIR
from . import parse

__all__ = ["SUITES", "SuiteError", "load_suite", "heavy_imports", "BATCH_DEFINITION"]

#: table name → record kind; one suite per table.
SUITES = {"features": "feature", "activations": "activation", "explanations": "explanation"}

#: Each asset's batch definition (the whole dataframe a run is given).
BATCH_DEFINITION = "whole"


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
