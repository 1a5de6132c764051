"""
### featurehouse_inbox

Every ten minutes, ingests whatever has been dropped into the inbox folder (`[paths] inbox` in
`featurehouse.toml`, or `$FEATUREHOUSE_INBOX`): saved pages, captured flight text, API JSON,
bulk-export lines, gzip of any of them.

A file leaves the inbox (to `<inbox>/.done/<run id>/`, kept `[inbox] keep_days`, default 7)
only once its bytes are recorded in `raw_inputs`, loaded or rejected; a run that dies half-way
leaves the rest for the next run. Files changed in the last `[inbox] settle_seconds` are left
for the next run (still being copied). What is not a file (a named pipe, a link to nothing) is
refused with its reason and set aside, unread, in `<inbox>/.refused/<run id>/`. One task, in
pool `warehouse_writer` (which bounds concurrent loads; commits take the warehouse's commit
lock, so it may run beside the nightly); it refreshes the activation statistics and publishes
the tables it loads and the statistics as Assets whose URIs name the warehouse
(`x-ducklake://<catalog>/<table>`). The code is `pipeline.sources.inbox.drain_inbox`.

`featurehouse.toml` is `$FEATUREHOUSE_CONFIG`, else the Airflow Variable `featurehouse_config`,
else the project's own. The drain reads only its `[paths]` and `[inbox]`: a mistake in a
nightly source does not stop it. A mistake in those sections fails the task at once (no
retries), naming it. When the run's verdict is FAIL (everything dropped was rejected, say) the
task fails after everything is recorded, with the verdict's reason, so the operator sees it,
and, when `[notify] email` names anyone, is mailed it.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import dag, task
from featurehouse_common import (
    RAW_TABLES,
    STATS_TABLES,
    config_path,
    failure_notifier,
    not_transient,
    read_config,
    remember_error,
    run_key,
    table_assets,
)

DAG_ID = "featurehouse_inbox"
CONFIG_PATH = config_path()
"""featurehouse.toml: ``$FEATUREHOUSE_CONFIG``, else the Airflow Variable ``featurehouse_config``,
else the project's own (featurehouse_common.config_path). The tasks load this same file."""
CONFIG = read_config(CONFIG_PATH)
"""The file as a dict, read with the stdlib, for ``[notify]`` and the Assets' warehouse."""


@dag(
    dag_id=DAG_ID,
    schedule="*/10 * * * *",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    dagrun_timeout=timedelta(hours=2),
    default_args={
        "owner": "featurehouse",
        # a task that fails for good keeps its error for the run's failure mail
        "on_failure_callback": remember_error,
        "retries": 2,
        "retry_delay": timedelta(minutes=1),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(minutes=10),
        # a drain stuck (a lock never released, a hung read) is ended and retried, not left for good
        "execution_timeout": timedelta(hours=1),
    },
    # one mail a failed drain, naming the task, when [notify] asks for it
    on_failure_callback=failure_notifier(CONFIG),
    tags=["featurehouse", "inbox"],
    doc_md=__doc__,
)
def featurehouse_inbox():
    @task(pool="warehouse_writer", outlets=table_assets(CONFIG, CONFIG_PATH, RAW_TABLES + STATS_TABLES))
    def drain(**context) -> dict:
        from airflow.sdk.exceptions import AirflowFailException

        from pipeline.config import Settings
        from pipeline.sources.inbox import drain_inbox
        from pipeline.sources.night import run_id_for
        from pipeline.sources.plan import load_inbox_plan

        with not_transient():
            plan = load_inbox_plan(CONFIG_PATH)
            result = drain_inbox(plan.inbox, Settings.from_env(warehouse=plan.warehouse),
                                 run_id_for(run_key(context), DAG_ID), trigger="airflow",
                                 settle_seconds=plan.settle_seconds, keep_days=plan.keep_days).as_dict()
        if result["verdict"] == "FAIL":  # recorded already; a retry would find nothing and pass
            raise AirflowFailException(f"inbox run {result['run_id']}: verdict FAIL: {result['verdict_reason']} "
                                       "(see `featurehouse status` and the run's report)")
        return result

    @task
    def find_index() -> dict:
        from pipeline.config import Settings
        from pipeline.outputs.find import refresh_index
        from pipeline.sources.plan import load_inbox_plan

        with not_transient():
            return refresh_index(Settings.from_env(warehouse=load_inbox_plan(CONFIG_PATH).warehouse)).as_dict()

    drain() >> find_index()


featurehouse_inbox()
