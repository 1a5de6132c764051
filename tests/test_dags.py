"""DAG integrity: every file in dags/ imports cleanly in Airflow's own DagBag, and the DAGs keep
the house rules (tags, retries with backoff, one writer, idempotent keys, nothing heavy at top level).

Airflow reads its configuration at import time, so the DagBag is built in a subprocess with its
own AIRFLOW_HOME and the result comes back as JSON.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.sources.plan import load_plan
from tests.airflow_helpers import DEPLOY, REPO, airflow_env

DAGS = REPO / "dags"
#: Tasks that load or rewrite the warehouse: in the pool that bounds how many run at once (memory).
WRITERS = {"featurehouse_nightly": {"ingest", "finish", "materialise", "maintain"}, "featurehouse_inbox": {"drain"}}

_PROBE = r"""
import json, sys
from airflow.dag_processing.dagbag import DagBag
# known_pools: a task naming a pool the deployment does not create is an import error
bag = DagBag(dag_folder=sys.argv[1], known_pools={"default_pool", "neuronpedia_api", "warehouse_writer"})
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
    }
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


def _run(code: str, args: list[str], tmp_path: Path, **env: str):
    proc = subprocess.run([sys.executable, "-c", code, *args], env=airflow_env(tmp_path / "home", **env),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")][-1]
    return json.loads(line[5:])


@pytest.fixture(scope="module")
def bag(tmp_path_factory):
    return _run(_PROBE, [str(DAGS)], tmp_path_factory.mktemp("dagbag"))


def test_every_dag_file_imports_without_errors(bag):
    assert bag["import_errors"] == {}
    files = {Path(d["fileloc"]).name for d in bag["dags"].values()}
    assert files == {p.name for p in DAGS.glob("*.py")}
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
    assert any("feature_activation_stats" in o for o in t["materialise"]["outlets"])
    assert any("source_activation_stats" in o for o in t["materialise"]["outlets"])
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


_PLAN_TASK = r"""
import json, sys
import pendulum
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1], known_pools={"default_pool", "neuronpedia_api", "warehouse_writer"})
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
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1], known_pools={"default_pool", "neuronpedia_api", "warehouse_writer"})
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
