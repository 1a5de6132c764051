"""DAG integrity: every file in dags/ imports cleanly in Airflow's own DagBag, and the DAGs keep
the house rules (tags, retries with backoff, one writer, idempotent keys, nothing heavy at top level).

Airflow reads its configuration at import time, so the DagBag is built in a subprocess with its
own AIRFLOW_HOME and the result comes back as JSON. dags/ is loaded as Airflow loads a DAG
bundle (the dag-processor, a task's worker, `airflow dags test`): ``BundleDagBag``, the
bundle's root on ``sys.path``, so the DAG files import ``featurehouse_common`` beside them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.sources.plan import DEFAULT_CONFIG, load_plan
from tests.airflow_helpers import DEPLOY, REPO, airflow_env

DAGS = REPO / "dags"
#: Tasks that load or rewrite the warehouse: in the pool that bounds how many run at once (memory).
WRITERS = {"featurehouse_nightly": {"ingest", "finish", "materialise", "maintain"}, "featurehouse_inbox": {"drain"}}

#: How Airflow loads a DAG bundle (the folder's root on sys.path); known_pools: a task naming a
#: pool the deployment does not create is an import error.
_BAG = r"""
from airflow.dag_processing.dagbag import BundleDagBag
bag = BundleDagBag(dag_folder=sys.argv[1], bundle_path=sys.argv[1],
                   known_pools={"default_pool", "neuronpedia_api", "warehouse_writer"})
"""

_PROBE = r"""
import json, sys
from airflow.providers.smtp.notifications.smtp import SmtpNotifier
""" + _BAG + r"""
out = {"import_errors": {k: str(v) for k, v in bag.import_errors.items()}, "dags": {}}
for dag_id, dag in bag.dags.items():
    dag.check_cycle()  # raises on a cycle
    tasks = {}
    for t in dag.tasks:
        tasks[t.task_id] = {
            "pool": t.pool, "retries": t.retries, "backoff": bool(t.retry_exponential_backoff),
            "trigger_rule": getattr(t.trigger_rule, "value", str(t.trigger_rule)),
            "upstream": sorted(t.upstream_task_ids), "mapped": type(t).__name__.startswith("Mapped") or hasattr(t, "expand_input"),
            "outlets": [getattr(o, "uri", str(o)) for o in (t.outlets or [])],
            "timeout_s": t.execution_timeout.total_seconds() if t.execution_timeout else None,
        }
    out["dags"][dag_id] = {
        "fileloc": dag.fileloc, "tags": sorted(dag.tags), "catchup": dag.catchup,
        "max_active_runs": dag.max_active_runs, "doc_md": dag.doc_md or "",
        "dagrun_timeout_s": dag.dagrun_timeout.total_seconds() if dag.dagrun_timeout else None,
        "timetable": type(dag.timetable).__name__, "summary": getattr(dag.timetable, "expression", None),
        "tasks": tasks, "sorted": [t.task_id for t in dag.topological_sort()],
        "notify": None if dag.on_failure_callback is None else {
            "smtp": isinstance(dag.on_failure_callback, SmtpNotifier), "to": dag.on_failure_callback.to,
            "conn": dag.on_failure_callback.smtp_conn_id, "from": dag.on_failure_callback.from_email,
            "subject": dag.on_failure_callback.subject},
    }
import featurehouse_common  # what the DAG files resolved, from beside them
path = featurehouse_common.config_path()
out["config_path"] = str(path)
out["warehouse"] = str(featurehouse_common._warehouse_dir(featurehouse_common.read_config(path), path))
print("JSON:" + json.dumps(out))
"""

_HEAVY = r"""
import importlib.util, json, sys
import airflow.sdk
before = set(sys.modules)
for path in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location("dagfile", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
heavy = ("duckdb", "pyarrow", "pandas", "great_expectations", "altair", "pipeline", "requests")
print("JSON:" + json.dumps(sorted(m for m in heavy if m in sys.modules and m not in before)))
"""


def _run(code: str, args: list[str], tmp_path: Path, bundle: Path = DAGS, **env: str):
    """Run a probe; ``bundle`` (the DAG folder) is on its path, as Airflow's bundle loader puts it."""
    env = airflow_env(tmp_path / "home", **env)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(bundle)])
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")][-1]
    return json.loads(line[5:])


@pytest.fixture(scope="module")
def bag(tmp_path_factory):
    return _run(_PROBE, [str(DAGS)], tmp_path_factory.mktemp("dagbag"))


#: What the DAG files share: no DAG in it, and listed in dags/.airflowignore so Airflow does not parse it.
SHARED = "featurehouse_common.py"


def test_every_dag_file_imports_without_errors(bag):
    assert bag["import_errors"] == {}
    files = {Path(d["fileloc"]).name for d in bag["dags"].values()}
    assert files == {p.name for p in DAGS.glob("*.py")} - {SHARED}
    assert SHARED in (DAGS / ".airflowignore").read_text().split()
    assert set(bag["dags"]) == {"featurehouse_nightly", "featurehouse_inbox"}


@pytest.mark.parametrize("dag_id", ["featurehouse_nightly", "featurehouse_inbox"])
def test_house_rules(bag, dag_id):
    dag = bag["dags"][dag_id]
    assert "featurehouse" in dag["tags"]
    assert dag["catchup"] is False and dag["max_active_runs"] == 1
    assert dag["doc_md"].strip().startswith(f"### {dag_id}")
    for task_id, t in dag["tasks"].items():
        assert t["retries"] >= 2, task_id
        assert t["backoff"], task_id
        # a stuck task is ended and retried, within its run's own timeout
        assert t["timeout_s"] and t["timeout_s"] <= dag["dagrun_timeout_s"], task_id
    assert dag["dagrun_timeout_s"] and dag["dagrun_timeout_s"] < 24 * 3600
    # no cycles (check_cycle passed in the probe) and a topological order covers every task
    assert sorted(dag["sorted"]) == sorted(dag["tasks"])


@pytest.mark.parametrize("dag_id", ["featurehouse_nightly", "featurehouse_inbox"])
def test_writing_tasks_use_the_writer_pool_and_nothing_else_does(bag, dag_id):
    tasks = bag["dags"][dag_id]["tasks"]
    assert {t for t, v in tasks.items() if v["pool"] == "warehouse_writer"} == WRITERS[dag_id]


def test_nightly_shape(bag):
    dag = bag["dags"]["featurehouse_nightly"]
    t = dag["tasks"]
    assert dag["sorted"] == ["plan", "fetch", "units", "ingest", "finish", "materialise", "find_index", "report",
                             "maintain", "all_fetched"]
    assert t["fetch"]["pool"] == "neuronpedia_api" and t["fetch"]["mapped"] and not t["plan"]["mapped"]
    # the ingest is mapped over the units of what landed: parts of one run, loading at once
    assert t["fetch"]["upstream"] == ["plan"] and t["units"]["upstream"] == ["fetch", "plan"]
    assert t["ingest"]["upstream"] == ["units"] and t["ingest"]["mapped"]
    assert t["finish"]["upstream"] == ["ingest"] and t["materialise"]["upstream"] == ["finish"]
    # the find index is refreshed from the load's change feed before maintain may expire it
    assert t["find_index"]["upstream"] == ["materialise"] and t["report"]["upstream"] == ["find_index"]
    assert t["maintain"]["upstream"] == ["report"]
    # the last task waits for every fetch chunk: a failed chunk fails the run, after the report
    assert t["all_fetched"]["upstream"] == ["fetch", "maintain"] and t["all_fetched"]["pool"] == "default_pool"
    # each ingest part publishes the tables it loads, materialise the statistics, named after the
    # warehouse's catalog (airflow_env's FEATUREHOUSE_WAREHOUSE)
    catalog = f"x-ducklake://{bag['warehouse']}/catalog.sqlite"
    assert t["ingest"]["outlets"] == [f"{catalog}/{table}" for table in RAW_TABLES]
    assert t["materialise"]["outlets"] == [f"{catalog}/{table}" for table in STATS_TABLES]
    assert {k for k, v in t.items() if v["outlets"]} == {"ingest", "materialise"}
    assert dag["timetable"] == "CronTriggerTimetable"


def test_nightly_schedule_comes_from_featurehouse_toml(bag, tmp_path):
    assert load_plan(env={}).schedule in bag["dags"]["featurehouse_nightly"]["summary"]
    # FEATUREHOUSE_CONFIG and FEATUREHOUSE_SCHEDULE move it, as pipeline.sources.plan reads them
    cfg = tmp_path / "fh.toml"
    cfg.write_text('[schedule]\ncron = "15 4 * * *"\n')
    other = _run(_PROBE, [str(DAGS)], tmp_path, FEATUREHOUSE_CONFIG=str(cfg))
    assert other["dags"]["featurehouse_nightly"]["summary"] == "15 4 * * *"
    assert load_plan(env={"FEATUREHOUSE_CONFIG": str(cfg)}).schedule == "15 4 * * *"


def test_dag_files_import_nothing_heavy(tmp_path):
    assert _run(_HEAVY, [str(p) for p in sorted(DAGS.glob("*.py"))], tmp_path) == []


def test_inbox_shape(bag):
    dag = bag["dags"]["featurehouse_inbox"]
    assert list(dag["tasks"]) == ["drain", "find_index"]
    assert dag["tasks"]["find_index"]["upstream"] == ["drain"]
    assert dag["summary"] == "*/10 * * * *"
    # the drain loads and refreshes: the same Assets as the nightly's ingest and materialise
    nightly = bag["dags"]["featurehouse_nightly"]["tasks"]
    assert dag["tasks"]["drain"]["outlets"] == nightly["ingest"]["outlets"] + nightly["materialise"]["outlets"]
    assert dag["tasks"]["find_index"]["outlets"] == []


# --- Assets name the warehouse (issue 45) --------------------------------------------------------

RAW_TABLES = ("models", "source_sets", "sources", "features", "activations", "explanations")
STATS_TABLES = ("feature_activation_stats", "feature_token_stats", "source_activation_stats")


def test_the_assets_are_the_tables_ingest_and_materialise_write():
    from pipeline.stages.stage import STAGED_TABLES

    assert RAW_TABLES == STAGED_TABLES
    assert set(STATS_TABLES) == {p.stem for p in (REPO / "schemas" / "sql").glob("*.sql")}


def test_two_warehouses_are_two_sets_of_assets(tmp_path):
    """The URI names the warehouse's catalog: another folder, or a PostgreSQL catalog (host,
    port and database, never the user or the password), is another Asset; Airflow keeps the
    URI as written (an ``x-`` scheme has no normaliser)."""
    one = _run(_PROBE, [str(DAGS)], tmp_path, FEATUREHOUSE_WAREHOUSE=str(tmp_path / "one"))
    other = _run(_PROBE, [str(DAGS)], tmp_path, FEATUREHOUSE_WAREHOUSE=str(tmp_path / "a b"))
    pg = _run(_PROBE, [str(DAGS)], tmp_path,
              FEATUREHOUSE_CATALOG="postgres:dbname=featurehouse host=db.internal port=5433 user=airflow password=s3cret")
    outlets = {name: got["dags"]["featurehouse_nightly"]["tasks"]["ingest"]["outlets"]
               for name, got in (("one", one), ("other", other), ("pg", pg))}
    assert outlets["one"][3] == f"x-ducklake://{tmp_path}/one/catalog.sqlite/features"
    assert outlets["other"][3] == f"x-ducklake://{tmp_path}/a%20b/catalog.sqlite/features"
    assert outlets["pg"] == [f"x-ducklake://db.internal:5433/featurehouse/{t}" for t in RAW_TABLES]
    assert "s3cret" not in json.dumps(pg["dags"]) and "airflow" not in json.dumps(outlets["pg"])


# --- a failed run mails [notify] email (issue 45) -------------------------------------------------

NOTIFY = '[notify]\nemail = ["ops@example.org", "oncall@example.org"]\nsmtp_conn_id = "featurehouse_smtp"\n'


def test_without_notify_no_dag_has_a_failure_callback(bag):
    assert [d["notify"] for d in bag["dags"].values()] == [None, None]


def test_notify_gives_both_dags_an_smtp_notifier(tmp_path):
    cfg = tmp_path / "fh.toml"
    cfg.write_text(NOTIFY + 'from_email = "featurehouse@example.org"\n')
    got = _run(_PROBE, [str(DAGS)], tmp_path, FEATUREHOUSE_CONFIG=str(cfg))
    for dag in got["dags"].values():
        assert dag["notify"]["smtp"]
        assert dag["notify"]["to"] == ["ops@example.org", "oncall@example.org"]
        assert (dag["notify"]["conn"], dag["notify"]["from"]) == ("featurehouse_smtp", "featurehouse@example.org")
        assert "{{ dag.dag_id }}" in dag["notify"]["subject"] and "ti.task_id" in dag["notify"]["subject"]
    # one address, the default connection, a subject of one's own
    cfg.write_text('[notify]\nemail = "ops@example.org"\nsubject = "{{ dag.dag_id }} is red"\n')
    got = _run(_PROBE, [str(DAGS)], tmp_path, FEATUREHOUSE_CONFIG=str(cfg))
    assert {(d["notify"]["conn"], d["notify"]["subject"]) for d in got["dags"].values()} == {
        ("smtp_default", "{{ dag.dag_id }} is red")}


def test_a_mistake_in_notify_keeps_the_dags_and_fails_the_plan_naming_it(tmp_path):
    cfg = tmp_path / "fh.toml"
    cfg.write_text('[notify]\nemial = "ops@example.org"\n[[sources]]\nmodel = "m"\nsource = "s"\nindices = [1]\n')
    got = _run(_PLAN_TASK, [str(DAGS)], tmp_path, FEATUREHOUSE_CONFIG=str(cfg))
    assert got["import_errors"] == {}
    assert "[notify]: unknown key(s) emial (did you mean email?)" in got["plan_error"]


def test_dag_files_import_nothing_heavy_with_notify(tmp_path):
    cfg = tmp_path / "fh.toml"
    cfg.write_text(NOTIFY)
    assert _run(_HEAVY, [str(p) for p in sorted(DAGS.glob("*.py"))], tmp_path, FEATUREHOUSE_CONFIG=str(cfg)) == []


# --- the DAG files work from a DAG bundle (issue 45) ---------------------------------------------

def _bundle(tmp_path: Path) -> Path:
    """Only dags/, copied elsewhere, as a DAG bundle is: nothing of the repository beside it."""
    copy = tmp_path / "bundles" / "featurehouse" / "versions" / "abc123"
    shutil.copytree(DAGS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_a_copied_bundle_finds_featurehouse_toml_from_the_airflow_variable(tmp_path):
    bundle = _bundle(tmp_path)
    cfg = tmp_path / "elsewhere" / "fh.toml"
    cfg.parent.mkdir()
    cfg.write_text('[schedule]\ncron = "15 4 * * *"\n[paths]\nwarehouse = "wh"\n[fetch]\nchunk_sise = 5\n' + NOTIFY)
    # AIRFLOW_VAR_<KEY>: the Variable as Airflow reads it from the environment (its first backend)
    env = {"FEATUREHOUSE_CONFIG": "", "FEATUREHOUSE_WAREHOUSE": "", "AIRFLOW_VAR_FEATUREHOUSE_CONFIG": str(cfg),
           "AIRFLOW__CORE__DAGS_FOLDER": str(bundle)}
    got = _run(_PROBE, [str(bundle)], tmp_path, bundle=bundle, **env)
    assert got["import_errors"] == {} and set(got["dags"]) == {"featurehouse_nightly", "featurehouse_inbox"}
    nightly = got["dags"]["featurehouse_nightly"]
    assert Path(nightly["fileloc"]).parent == bundle
    assert got["config_path"] == str(cfg)
    assert nightly["summary"] == "15 4 * * *"  # the Variable's file, at parse time
    assert nightly["notify"]["to"] == ["ops@example.org", "oncall@example.org"]
    assert nightly["tasks"]["ingest"]["outlets"][3] == f"x-ducklake://{cfg.parent}/wh/catalog.sqlite/features"
    # ... and at run time: the plan task loads that same file
    plan = _run(_PLAN_TASK, [str(bundle)], tmp_path, bundle=bundle, **env)
    assert str(cfg) in plan["plan_error"] and "unknown key(s) chunk_sise" in plan["plan_error"]


def test_featurehouse_config_wins_over_the_variable_and_the_projects_file_is_the_last_resort(tmp_path):
    bundle = _bundle(tmp_path)
    cfg, other = tmp_path / "fh.toml", tmp_path / "other.toml"
    cfg.write_text('[schedule]\ncron = "15 4 * * *"\n')
    other.write_text('[schedule]\ncron = "45 5 * * *"\n')
    got = _run(_PROBE, [str(bundle)], tmp_path, bundle=bundle, FEATUREHOUSE_CONFIG=str(other),
               AIRFLOW_VAR_FEATUREHOUSE_CONFIG=str(cfg), AIRFLOW__CORE__DAGS_FOLDER=str(bundle))
    assert got["dags"]["featurehouse_nightly"]["summary"] == "45 5 * * *"
    # neither: the project's own featurehouse.toml, the one `featurehouse` commands read
    got = _run(_PROBE, [str(bundle)], tmp_path, bundle=bundle, FEATUREHOUSE_CONFIG="",
               AIRFLOW__CORE__DAGS_FOLDER=str(bundle))
    assert got["config_path"] == str(DEFAULT_CONFIG)
    assert got["dags"]["featurehouse_nightly"]["summary"] == load_plan(DEFAULT_CONFIG, env={}).schedule


_PLAN_TASK = r"""
import json, sys
import pendulum
""" + _BAG + r"""
dag = bag.dags.get("featurehouse_nightly")
out = {"import_errors": {k: str(v) for k, v in bag.import_errors.items()},
       "summary": getattr(dag.timetable, "expression", None) if dag else None, "plan_error": None}
if dag:
    try:  # the plan task's own code, as a worker runs it for a scheduled night
        dag.get_task("plan").python_callable(data_interval_start=pendulum.datetime(2026, 11, 28, 3, tz="UTC"))
    except Exception as exc:
        out["plan_error"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
print("JSON:" + json.dumps(out))
"""


@pytest.mark.parametrize("cron", ["61 3 * * *", "nightly", "0 3 30 2 *"])
def test_a_bad_cron_keeps_the_dag_and_fails_its_plan_task_naming_the_entry(tmp_path, cron):
    cfg = tmp_path / "fh.toml"
    cfg.write_text(f'[schedule]\ncron = "{cron}"\n')
    got = _run(_PLAN_TASK, [str(DAGS)], tmp_path, FEATUREHOUSE_CONFIG=str(cfg))
    assert got["import_errors"] == {}, "a bad cron must not make the DAG file fail to import"
    assert got["summary"] == "0 3 * * *"  # the default, so the mistake surfaces every night
    # a configuration error is not transient: the task fails at once, without retries
    assert got["plan_error"] and got["plan_error"].startswith(
        "airflow.sdk.exceptions.AirflowFailException: pipeline.sources.plan.ConfigError: ")
    assert str(cfg) in got["plan_error"] and f"[schedule] cron '{cron}'" in got["plan_error"]


# --- a bad night is not retried for nothing, nor green (issue 20) --------------------------------

_TASK = r"""
import json, sys
import pendulum
""" + _BAG + r"""
dag = bag.dags[sys.argv[2]]
out = {"result": None, "error": None}
try:  # the task's own code, as a worker runs it for a scheduled run
    out["result"] = dag.get_task(sys.argv[3]).python_callable(data_interval_start=pendulum.datetime(2026, 11, 28, 3, tz="UTC"))
except Exception as exc:
    out["error"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
print("JSON:" + json.dumps(out, default=str))
"""

FAIL_AT_ONCE = "airflow.sdk.exceptions.AirflowFailException: "


def test_after_the_plan_only_what_must_run_runs(bag):
    """units loads what landed when fetch chunks failed, but not when the plan failed (its one
    success); finish records the run whatever the parts did (and skips when the plan failed)."""
    t = bag["dags"]["featurehouse_nightly"]["tasks"]
    assert t["units"]["trigger_rule"] == "all_done_min_one_success"
    assert t["finish"]["trigger_rule"] == "all_done"
    assert {k for k, v in t.items() if v["trigger_rule"] != "all_success"} == {"units", "finish"}


def test_a_config_mistake_fails_the_plan_at_once_and_leaves_the_inbox_running(tmp_path):
    cfg = tmp_path / "fh.toml"
    cfg.write_text('[paths]\ninbox = "drop"\n[[sources]]\nmodel = "m"\nsourse = "s"\nindices = [1]\n')
    env = {"FEATUREHOUSE_CONFIG": str(cfg), "FEATUREHOUSE_WAREHOUSE": str(tmp_path / "wh"),
           "FEATUREHOUSE_INBOX": str(tmp_path / "drop")}
    plan = _run(_TASK, [str(DAGS), "featurehouse_nightly", "plan"], tmp_path, **env)
    assert plan["error"] and plan["error"].startswith(FAIL_AT_ONCE + "pipeline.sources.plan.ConfigError: ")
    assert str(cfg) in plan["error"] and "[[sources]] #1: unknown key(s)" in plan["error"]
    assert "unknown key(s) sourse (did you mean source?)" in plan["error"]
    drain = _run(_TASK, [str(DAGS), "featurehouse_inbox", "drain"], tmp_path, **env)
    assert drain["error"] is None and drain["result"]["n_found"] == 0


def test_a_bad_environment_value_fails_the_inbox_at_once_naming_it(tmp_path):
    got = _run(_TASK, [str(DAGS), "featurehouse_inbox", "drain"], tmp_path,
               FEATUREHOUSE_INBOX=str(tmp_path / "drop"), FEATUREHOUSE_INBOX_SETTLE_SECONDS="abc")
    assert got["error"] and got["error"].startswith(FAIL_AT_ONCE)
    assert "FEATUREHOUSE_INBOX_SETTLE_SECONDS must be a number of seconds (0 or more), got 'abc'" in got["error"]


def test_an_inbox_run_whose_verdict_is_fail_fails_its_task_after_recording_it(tmp_path):
    inbox, wh = tmp_path / "drop", tmp_path / "wh"
    inbox.mkdir()
    (inbox / "not-a-page.txt").write_bytes((REPO / "samples" / "002_cdcf7f83dd4b10f8.txt").read_bytes())
    got = _run(_TASK, [str(DAGS), "featurehouse_inbox", "drain"], tmp_path, FEATUREHOUSE_INBOX=str(inbox),
               FEATUREHOUSE_WAREHOUSE=str(wh), FEATUREHOUSE_INBOX_SETTLE_SECONDS="0")
    assert got["error"] and got["error"].startswith(FAIL_AT_ONCE)
    assert "verdict FAIL: 1 input(s) not already landed received, none loaded" in got["error"]
    # everything was recorded first: the run, and the file out of the inbox
    assert [p.name for p in inbox.iterdir()] == [".done"]
    from tests.conftest import query

    assert query(wh, "SELECT n_received, n_rejected FROM runs") == [(1, 1)]


_PRELOAD = r"""
import json, os, sys
os.environ["OPENBLAS_NUM_THREADS"] = "1"  # numpy's and scipy's BLAS threads (made for fork) out of the count
sys.argv = ["airflow", *sys.argv[1:]]
import airflow  # as every Airflow process does: imports airflow_local_settings from PYTHONPATH
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
modules = ("great_expectations", "pipeline.sources.fetch", "pipeline.outputs.report")
print("JSON:" + json.dumps({"preloaded": [m for m in modules if m in sys.modules],
                            "threads": sorted(t for t in threads if t != "jemalloc_bg_thd")}))
"""


def test_the_scheduler_preloads_the_pipeline_and_leaves_nothing_running_to_fork(tmp_path):
    """deploy/airflow_local_settings.py, on the PYTHONPATH deploy/airflow.env gives every Airflow
    process: the scheduler imports what its tasks import, once, and after it only the main thread
    runs (DuckDB's default connection closed; Arrow's jemalloc thread is made for fork)."""
    out = _run(_PRELOAD, ["scheduler"], tmp_path)
    assert out == {"preloaded": ["great_expectations", "pipeline.sources.fetch", "pipeline.outputs.report"],
                   "threads": ["python"]}


@pytest.mark.parametrize("argv, preloads", [
    (["scheduler"], True), (["scheduler", "--pid", "x"], True), (["celery", "worker", "-q", "default"], True),
    (["api-server"], False), (["dag-processor"], False), (["triggerer"], False), (["celery", "flower"], False),
    (["dags", "test", "featurehouse_nightly"], False), (["tasks", "test"], False), ([], False)])
def test_only_the_processes_that_fork_tasks_preload(argv, preloads):
    spec = importlib.util.spec_from_file_location("local_settings_probe", DEPLOY / "airflow_local_settings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # pytest's own argv: no preload
    assert module._forks_tasks(["/usr/bin/airflow", *argv]) is preloads
