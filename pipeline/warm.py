"""Pay a process's fixed costs before it forks: import what a task needs, once.

An orchestrator that forks a process per task (Airflow's scheduler with the LocalExecutor, a
Celery worker before it forks its pool) calls ``warm_up()`` once, and every process it forks
starts with the modules instead of importing them again (about 3 s of CPU a task, most of it
Great Expectations pulling in pandas, scipy and altair).
"""

from __future__ import annotations

import importlib
import logging

import duckdb

#: The modules the DAGs' tasks call into (dags/*.py imports them in each task body).
TASK_MODULES = (
    "pipeline.sources.plan",
    "pipeline.sources.fetch",
    "pipeline.sources.inbox",
    "pipeline.stages.materialise",
    "pipeline.outputs.report",
    "pipeline.lake.maintain",
    "pipeline.lake.warehouse",
    "pipeline.outputs.find",
)


def warm_up() -> None:
    """Import the pipeline's task modules and Great Expectations, and build the expectation
    suites, so that processes forked after this call start with them.

    Safe to call before forking: it leaves no DuckDB database open and starts no thread of its
    own. ``import duckdb`` opens DuckDB's module-level default connection, with a worker
    thread, which is closed here (``duckdb.sql()`` opens a new one if anything asks). Great
    Expectations' context is in memory; each forked process uses its own copy. The threads
    that numpy's OpenBLAS and Arrow's jemalloc start on import are made for fork (they are
    restarted in the child). DuckDB's extensions are not loaded: that needs a database open.
    """
    # Great Expectations logs hundreds of lines of its own API bookkeeping at INFO on import.
    logging.getLogger("great_expectations._docs_decorators").setLevel(logging.WARNING)
    for name in TASK_MODULES:
        importlib.import_module(name)
    from .stages import validate

    validate.warm_up()
    duckdb.default_connection().close()
