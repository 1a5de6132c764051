"""
### featurehouse_inbox

Every ten minutes, ingests whatever has been dropped into the inbox folder (`[paths] inbox` in
`featurehouse.toml`, or `$FEATUREHOUSE_INBOX`): saved pages, captured flight text, API JSON,
bulk-export lines, gzip of any of them.

A file leaves the inbox (to `<inbox>/.done/<run id>/`) only once its bytes are recorded in
`raw_inputs`, loaded or rejected; a run that dies half-way leaves the rest for the next run.
Files changed in the last `[inbox] settle_seconds` are left for the next run (still being
copied). One task, in pool `warehouse_writer` (which bounds concurrent loads; commits take the
warehouse's commit lock, so it may run beside the nightly); it refreshes the activation
statistics and publishes them as Assets. The code is `pipeline.sources.inbox.drain_inbox`.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Asset, dag, task

DAG_ID = "featurehouse_inbox"
FEATURE_STATS = Asset(name="featurehouse.feature_activation_stats",
                      uri="duckdb://featurehouse/feature_activation_stats")
SOURCE_STATS = Asset(name="featurehouse.source_activation_stats",
                     uri="duckdb://featurehouse/source_activation_stats")


def _key(context: dict):
    """The run's key: its data interval start (a manual run without one: its logical date / run_after)."""
    return context.get("data_interval_start") or context.get("logical_date") or context["dag_run"].run_after


@dag(
    dag_id=DAG_ID,
    schedule="*/10 * * * *",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(hours=2),
    default_args={
        "owner": "featurehouse",
        "retries": 2,
        "retry_delay": timedelta(minutes=1),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(minutes=10),
    },
    tags=["featurehouse", "inbox"],
    doc_md=__doc__,
)
def featurehouse_inbox():
    @task(pool="warehouse_writer", outlets=[FEATURE_STATS, SOURCE_STATS])
    def drain(**context) -> dict:
        from pipeline.config import Settings
        from pipeline.sources.inbox import drain_inbox
        from pipeline.sources.plan import load_plan, run_id_for

        plan = load_plan()
        return drain_inbox(plan.inbox, Settings.from_env(warehouse=plan.warehouse), run_id_for(_key(context), DAG_ID),
                           trigger="airflow", settle_seconds=plan.inbox_settle_seconds).as_dict()

    drain()


featurehouse_inbox()
