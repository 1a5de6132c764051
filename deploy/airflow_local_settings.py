"""Airflow's local settings for featurehouse's deployment, imported by every Airflow process as it
starts (deploy/airflow.env puts this folder on PYTHONPATH).

The scheduler (LocalExecutor: its workers are forked from it, and each forks a task) and a
Celery worker (its pool is forked from it, and each pool process forks a task) import the
pipeline and Great Expectations here, once, so that every task they fork inherits them instead
of paying ~3 s of CPU to import them again. The other processes (api-server, dag-processor,
triggerer, the `airflow` commands) do not: they never run a task, or run it in-process.
"""

from __future__ import annotations

import sys

__all__: list[str] = []  # Airflow copies a local settings module's public names into its own

#: ``airflow <these arguments>``: the processes that fork the task runners.
FORKS_TASKS = (["scheduler"], ["celery", "worker"])


def _forks_tasks(argv: list[str]) -> bool:
    return any(argv[1:1 + len(args)] == args for args in FORKS_TASKS)


if _forks_tasks(sys.argv):
    try:
        import pipeline

        pipeline.warm_up()
    except Exception:  # a task will meet the same error and say it; the scheduler must still start
        import logging

        logging.getLogger(__name__).exception("featurehouse: preloading the pipeline failed; tasks will import it")
