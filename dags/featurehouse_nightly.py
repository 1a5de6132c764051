"""
### featurehouse_nightly

Fetches the features listed in `featurehouse.toml` from Neuronpedia and loads them into the
warehouse (a DuckLake), once a night (cron from `[schedule] cron`, default 03:00 UTC).

1. **plan** reads `featurehouse.toml` (`$FEATUREHOUSE_CONFIG`, else the Airflow Variable
   `featurehouse_config`, else the project's own; checked whole against its schema) and splits it into
   fetch chunks (fewer than `[core] max_map_length`); each chunk is a small dict naming a
   source, an index range and the warehouse. It is the only task that reads the file. A
   mistake in it is not transient: the task fails at once, without retries, naming the file
   and the entry, and nothing after it runs.
2. **fetch** is mapped over the chunks in pool `neuronpedia_api`: each lands page bodies in the
   landing area and never touches the warehouse, so chunks run side by side. A chunk whose URLs
   all failed, or `[fetch] max_failed_fraction` (default 0.5) of them or more, fails its task,
   which is retried (`[fetch] task_retries`, `task_retry_delay`) and then left failed; one that
   lost fewer succeeds, its log ending with a WARNING saying how many. A chunk
   whose source does not exist (every feature a 404 and so is its feature 0, or an empty export
   listing) fails at once, naming it.
3. **units** splits what the run's window landed into ingest units: one per fetch chunk, one
   per export batch file. It runs even when some fetch chunks failed, so what did land is
   loaded tonight (but not when the plan failed: there is nothing to load).
4. **ingest** is mapped over the units: each parses, validates and loads its share as a part
   of the night's warehouse run, on any worker, committing side by side with the others; each
   part that succeeds publishes the tables it loads (`features`, `activations`, ...) as Assets.
5. **finish** records the fetch failures in `fetch_failures` and the run's status (failed, and
   so is this task, when an ingest part failed); skipped when the plan failed. It logs the
   night's verdict (PASS, WARN or FAIL and why; at WARNING unless PASS) and returns it.
6. **materialise** refreshes the activation statistics of what the run changed (the
   per-source aggregates once, after every part) and publishes them as Assets. Every Asset's
   URI names the warehouse: `x-ducklake://<catalog>/<table>`.
7. **report** writes the run's data-quality report (its verdict is FAIL when the fetch failed
   wholly or mostly) and logs the verdict as finish does.
8. **maintain** expires snapshots past the retention period, merges small files and deletes
   unreferenced ones.
9. **all_fetched** does nothing itself; it is skipped as `upstream_failed` when a fetch chunk
   failed, which marks the run failed once the tasks above have run.

A failed run mails the addresses of `[notify] email` (through the Airflow SMTP connection
`[notify] smtp_conn_id`, default `smtp_default`), naming the task that failed it.

A manual run can name one source in its params (model, source, indices or via = exports): it
fetches that instead of the file's sources. Neuronpedia's address and API key come from the Airflow Connection `neuronpedia_default`
(host with its schema, the key as its password) when there is one; else from
`NEURONPEDIA_BASE_URL` / `NEURONPEDIA_API_KEY` and featurehouse.toml.

Writers need no exclusive slot: each commit takes the warehouse's commit lock and conflicts are
retried, and readers are never blocked. Pool `warehouse_writer` only bounds how many loads run
at once (memory). Every task is keyed by the run's data interval (window
`featurehouse_nightly-<start>`, warehouse run id `airflow-featurehouse_nightly-<start>`), so a
retry or a re-run resumes instead of fetching or loading twice. The code is in `pipeline/`;
each task is a call into it.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import pendulum
from airflow.sdk import Param, dag, task
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

DAG_ID = "featurehouse_nightly"
CONFIG_PATH = config_path()
"""featurehouse.toml: ``$FEATUREHOUSE_CONFIG``, else the Airflow Variable ``featurehouse_config``,
else the project's own (featurehouse_common.config_path). The plan task loads this same file."""
CONFIG = read_config(CONFIG_PATH)
"""The file as a dict, read with the stdlib (empty when it cannot be read: the plan task then
fails with the real error, naming the file)."""
RAW = table_assets(CONFIG, CONFIG_PATH, RAW_TABLES)
"""The tables each ingest part loads, as Assets naming the warehouse."""
STATS = table_assets(CONFIG, CONFIG_PATH, STATS_TABLES)
"""The statistics materialise refreshes, as Assets naming the warehouse."""


DEFAULT_SCHEDULE = "0 3 * * *"
PRESETS = ("@once", "@continuous", "@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly")


MAX_RETRY_DELAY = 86400
"""The schema's ``maximum`` of ``[schedule] retry_delay`` and ``[fetch] task_retry_delay`` (a day)."""


def _setting(section: str, key: str, default: float, kind: type, maximum: float = math.inf) -> float:
    """``[fetch] task_retries`` / ``task_retry_delay`` for the fetch task, ``[schedule]
    retry_delay`` for the others (plan.py checks them too; a value that is not a finite number
    from 0 to ``maximum`` falls back to the default here and fails the plan task: TOML's nan, inf
    or 1e300 in a ``timedelta`` would fail this file's import, and the DAG would vanish)."""
    table = CONFIG.get(section)
    value = table.get(key, default) if isinstance(table, dict) else default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0 <= value <= maximum or (kind is int and value != int(value))):
        return default
    return kind(value)


def _schedule() -> str:
    """The cron, read with the stdlib and croniter only: this file is parsed every few seconds, so
    it must not import the pipeline (DuckDB, Arrow). ``pipeline.sources.plan.load_plan`` reads it the
    same way and ``pipeline.sources.plan.cron_problem`` judges it by the same rule.

    A cron that cannot be read falls back to the default: the DAG still imports (and stays in
    the UI), and its ``plan`` task fails every night with the real error, naming the file and
    the entry, until the file is fixed."""
    cron = os.environ.get("FEATUREHOUSE_SCHEDULE")
    if not cron:
        schedule = CONFIG.get("schedule")
        cron = schedule.get("cron", DEFAULT_SCHEDULE) if isinstance(schedule, dict) else DEFAULT_SCHEDULE
    return cron if _runs(cron) else DEFAULT_SCHEDULE


def _runs(cron: object) -> bool:
    """A schedule Airflow can run: one of its presets, or five cron fields that fire."""
    if not isinstance(cron, str):
        return False
    if cron in PRESETS:
        return True
    if len(cron.split()) != 5:
        return False
    from datetime import datetime

    from croniter import croniter

    try:
        croniter(cron).get_next(datetime)
    except ValueError:
        return False
    return True


CONNECTION_ID = "neuronpedia_default"


def _neuronpedia() -> tuple[str | None, str | None]:
    """Neuronpedia's address and API key from the Airflow Connection ``neuronpedia_default``
    (host ``https://www.neuronpedia.org``, or a host with its schema and port; the key its
    password), as Airflow users keep credentials; (None, None) when there is none, and then
    ``NEURONPEDIA_BASE_URL``/``NEURONPEDIA_API_KEY`` and featurehouse.toml say, as before."""
    from airflow.sdk import Connection

    try:
        conn = Connection.get(CONNECTION_ID)
    except Exception as exc:  # AirflowNotFoundException: no such connection
        if "isn't defined" not in str(exc) and "not found" not in str(exc).lower():
            raise
        return None, None
    host = (conn.host or "").rstrip("/")
    if host and "://" not in host:
        host = f"{conn.schema or 'https'}://{host}" + (f":{conn.port}" if conn.port else "")
    return host or None, conn.password or None


def _warehouse(context: dict) -> str | None:
    """The warehouse the plan task chose for this run (None when it failed): the tasks after it
    never read featurehouse.toml again."""
    return context["ti"].xcom_pull(task_ids="plan", key="warehouse")


def _retry_left(context: dict) -> bool:
    """Whether Airflow retries this task instance if this try fails (as its
    ``TaskInstance.is_eligible_to_retry`` judges): its message must not promise a retry otherwise."""
    ti = context["ti"]
    return bool(ti.task.retries) and ti.try_number <= ti.max_tries


def _failed(context: dict, task_id: str) -> int:
    """How many of this run's ``task_id`` instances failed (a killed worker's task leaves no
    trace in the warehouse); 0 when the scheduler cannot be asked (``airflow dags test``)."""
    try:
        return context["ti"].get_ti_count(dag_id=DAG_ID, task_ids=[task_id], run_ids=[context["run_id"]],
                                          states=["failed", "upstream_failed"])
    except Exception:
        return 0


default_args = {
    "owner": "featurehouse",
    # a task that fails for good keeps its error for the run's failure mail
    "on_failure_callback": remember_error,
    "retries": 3,
    "retry_delay": timedelta(seconds=_setting("schedule", "retry_delay", 60.0, float, MAX_RETRY_DELAY)),
    "retry_exponential_backoff": True,
    "max_retry_delay": timedelta(minutes=30),
    # a task stuck (a hung connection, a lock never released) is ended and retried, never left
    # running into the next night; the whole night has dagrun_timeout below
    "execution_timeout": timedelta(hours=6),
}


@dag(
    dag_id=DAG_ID,
    schedule=_schedule(),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    # the next night starts fresh: a night still running after 23 hours is failed (its tasks
    # stopped), what it landed is loaded by a re-run of its window
    dagrun_timeout=timedelta(hours=23),
    # a manual run ("Trigger DAG" with these filled in) fetches one source instead of the file's
    params={
        "model": Param(None, type=["null", "string"], title="model",
                       description="Neuronpedia model id, e.g. gpt-oss-20b (empty: the sources of featurehouse.toml)"),
        "source": Param(None, type=["null", "string"], title="source",
                        description="Source (SAE) id, e.g. 11-resid-post-aa"),
        "indices": Param(None, type=["null", "string"], title="indices",
                         description='"start:stop" or indices separated by commas; "all" or empty: every feature'),
        "via": Param("api", type="string", enum=["api", "exports"], title="via",
                     description="api (the feature API) or exports (the bulk files)"),
    },
    default_args=default_args,
    # one mail a failed night, naming the task that failed it, when [notify] asks for it
    on_failure_callback=failure_notifier(CONFIG),
    tags=["featurehouse", "neuronpedia", "nightly"],
    doc_md=__doc__,
)
def featurehouse_nightly():
    @task
    def plan(**context) -> list[dict]:
        from airflow.sdk import conf

        from pipeline.sources.night import chunks, window_for
        from pipeline.sources.plan import load_plan, with_params

        base_url, _ = _neuronpedia()
        with not_transient():
            planned = load_plan(CONFIG_PATH, env={**os.environ, "NEURONPEDIA_BASE_URL": base_url} if base_url else None)
            planned = with_params(planned, dict(context.get("params") or {}))
            out = chunks(planned, window_for(run_key(context), DAG_ID), conf.getint("core", "max_map_length"))
        context["ti"].xcom_push(key="warehouse", value=str(planned.warehouse))
        return out

    # A chunk whose URLs all (or mostly) failed raises FetchChunkFailed: the task fails, is
    # retried ([fetch] task_retries, task_retry_delay), and a retry asks only for what is missing.
    # A source that does not exist raises SourceNotFound, a ConfigError: it fails at once.
    @task(pool="neuronpedia_api", retries=_setting("fetch", "task_retries", 4, int),
          retry_delay=timedelta(seconds=_setting("fetch", "task_retry_delay", 60.0, float, MAX_RETRY_DELAY)),
          max_active_tis_per_dagrun=4)
    def fetch(chunk: dict, **context) -> dict:
        from pipeline.sources.night import fetch_chunk

        _, api_key = _neuronpedia()  # read here, never passed through XCom
        with not_transient():
            return fetch_chunk(chunk, api_key=api_key, retry_left=_retry_left(context))

    # all_done_min_one_success: what the chunks that succeeded landed is still loaded (and
    # failures recorded) tonight, rather than left landed in a window no later run reads; the
    # plan's success is the one success needed, so when the plan failed this does not run.
    @task(trigger_rule="all_done_min_one_success")
    def units(chunks: list[dict]) -> list[dict]:
        from airflow.sdk import conf

        from pipeline.sources.night import ingest_units

        with not_transient():
            return ingest_units(chunks, max_map_length=conf.getint("core", "max_map_length"))

    # One ingest per unit (a fetch chunk's pages, an export batch file), on any worker, at once:
    # each is a part of the night's run and commits under the commit lock; per-source stats wait
    # for materialise.
    @task(pool="warehouse_writer", outlets=RAW)
    def ingest(unit: dict, **context) -> dict:
        from pipeline.sources.fetch import ingest_unit
        from pipeline.sources.night import run_id_for, settings_of

        with not_transient():
            return ingest_unit(unit, settings_of(unit), run_id=run_id_for(run_key(context), DAG_ID)).as_dict()

    # all_done: the run's status and fetch failures are recorded whatever the parts did; it
    # fails (and so stops materialise and the report) when a part failed. Skipped when the plan
    # failed: nothing was fetched, there is no run to finish. It logs and returns the verdict.
    @task(pool="warehouse_writer", trigger_rule="all_done")
    def finish(**context) -> dict:
        from airflow.sdk.exceptions import AirflowSkipException

        from pipeline.sources.fetch import finish_fetched
        from pipeline.sources.night import run_id_for, settings_of, window_for

        warehouse = _warehouse(context)
        if warehouse is None:
            raise AirflowSkipException("the plan task failed (see its log): nothing was fetched or loaded")
        key = run_key(context)
        with not_transient():
            return finish_fetched(window_for(key, DAG_ID), settings_of({"warehouse": warehouse}),
                                  run_id=run_id_for(key, DAG_ID), failed_parts=_failed(context, "ingest"))

    @task(pool="warehouse_writer", outlets=STATS)
    def materialise(**context) -> dict:
        from pipeline.sources.night import run_id_for
        from pipeline.stages.materialise import refresh_run

        with not_transient():
            return refresh_run(_warehouse(context), run_id_for(run_key(context), DAG_ID)).as_dict()

    @task
    def find_index(**context) -> dict:
        from pipeline.outputs.find import refresh_index
        from pipeline.sources.night import settings_of

        with not_transient():  # after the load's snapshots, before maintain may expire them
            return refresh_index(settings_of({"warehouse": _warehouse(context)})).as_dict()

    # ends its log with the night's verdict: WARNING when it is not PASS
    @task
    def report(**context) -> dict:
        from pipeline.outputs.report import report_run
        from pipeline.sources.fetch import judge_run
        from pipeline.sources.night import run_id_for

        warehouse, run_id = _warehouse(context), run_id_for(run_key(context), DAG_ID)
        with not_transient():
            return report_run(warehouse, run_id) | judge_run(warehouse, run_id)

    @task(pool="warehouse_writer")
    def maintain(**context) -> dict:
        from pipeline.lake.maintain import maintain
        from pipeline.lake.warehouse import settings_for

        with not_transient():
            return maintain(settings_for(_warehouse(context))).as_dict()

    # Airflow judges a run by its last tasks: this one (all_success) is upstream_failed when a
    # fetch chunk failed, so such a night is a failed run, after what landed was loaded and reported.
    @task
    def all_fetched() -> None:
        return None

    chunks = plan()
    fetched = fetch.expand(chunk=chunks)
    todo = units(chunks)
    fetched >> todo
    reported = ingest.expand(unit=todo) >> finish() >> materialise() >> find_index() >> report() >> maintain()
    [fetched, reported] >> all_fetched()


featurehouse_nightly()
