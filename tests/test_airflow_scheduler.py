"""A scheduler run: the deployment's own processes (api-server, scheduler, dag-processor,
triggerer; LocalExecutor) on a throwaway PostgreSQL, initialised by deploy/airflow-init.sh with
deploy/airflow.env, both DAGs triggered through the REST API and awaited, then everything stopped.

This proves the deployment's configuration, not just the Python: docker-compose.yml is held to
these same commands and settings by tests/test_compose.py.
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import pytest

from pipeline.config import Settings
from pipeline.sources.inbox import pending_files
from tests.airflow_helpers import (
    AIRFLOW,
    SERVICES,
    Api,
    airflow_env,
    fake_neuronpedia_server,
    free_port,
    init,
    pg_bin,
    postgres_cluster,
    start,
    stop,
    wait_for_port,
    wait_until,
)
from tests.conftest import open_warehouse

pytestmark = [pytest.mark.airflow, pytest.mark.scheduler]

REPO = Path(__file__).resolve().parent.parent
CONFIG = """
[fetch]
chunk_size = 10
requests_per_hour = 3600000  # the fake site has no limit: no waiting on the rate limiter
[[sources]]
model = "gpt-oss-20b"
source = "11-resid-post-aa"
indices = ["0:40"]
"""
RUN_TIMEOUT = 300


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(tmp.glob("*.log")))


# about 100-150 s, but weighted lower: it goes out after the longest groups, not beside the Celery
# test (each starts a whole Airflow stack; the two at once on 3 workers pushed that one past 3 min)
@pytest.mark.heavy(50)
def test_scheduler_runs_both_dags_triggered_through_the_rest_api(tmp_path):
    if pg_bin() is None:
        pytest.fail("PostgreSQL is not installed: .ci/run installs it (apt-get install postgresql)")
    password = secrets.token_urlsafe(12)
    port = free_port()
    (tmp_path / "featurehouse.toml").write_text(CONFIG)
    with fake_neuronpedia_server(tmp_path / "fake.log") as fake, postgres_cluster() as pg:
        env = airflow_env(
            tmp_path / "home",
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=pg.url,
            FEATUREHOUSE_CATALOG=pg.catalog,  # as docker-compose.yml: the catalog in its own database
            AIRFLOW__API__PORT=str(port),
            AIRFLOW__API__HOST="127.0.0.1",
            AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
            AIRFLOW_ADMIN_PASSWORD=password,
            FEATUREHOUSE_CONFIG=str(tmp_path / "featurehouse.toml"),
            FEATUREHOUSE_INBOX_SETTLE_SECONDS="0",
            NEURONPEDIA_BASE_URL=fake,
            NEURONPEDIA_EXPORTS_URL=f"{fake}/neuronpedia-datasets",
        )
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
        init(env)

        inbox = Path(env["FEATUREHOUSE_INBOX"])
        inbox.mkdir(parents=True)
        for f in sorted((REPO / "samples").iterdir()):
            shutil.copyfile(f, inbox / f.name)

        procs = {}
        try:
            for name, args in SERVICES.items():
                procs[name] = start([str(AIRFLOW), *args], env, tmp_path / f"{name}.log")
            wait_for_port(port, 120, procs["api-server"], "airflow api-server")
            api = Api(f"http://127.0.0.1:{port}", "admin", password)

            runs = {}
            for dag_id in ("featurehouse_inbox", "featurehouse_nightly"):
                def parsed(d=dag_id):
                    status, dag = api._send("GET", f"/api/v2/dags/{d}", token=api.token)
                    return dag if status == 200 else None

                # the dag-processor has parsed the file and the DAG is known to the API
                dag = wait_until(parsed, 120, what=f"{dag_id} to be parsed")
                # Unpausing makes the scheduler run the latest interval, unless a run of that logical
                # date exists: triggered for it, the API's run is the only one (not a second night
                # beside it, competing for the same two cores).
                run = api.call("POST", f"/api/v2/dags/{dag_id}/dagRuns",
                               {"logical_date": dag["next_dagrun_logical_date"] or "2026-11-28T03:00:00Z"})
                api.call("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})
                runs[dag_id] = run["dag_run_id"]

            def finished():
                states = {d: api.call("GET", f"/api/v2/dags/{d}/dagRuns/{r}")["state"] for d, r in runs.items()}
                for d, state in states.items():
                    assert state != "failed", f"{d} run failed\n{_logs(tmp_path)}"
                return states if all(s == "success" for s in states.values()) else None

            try:
                wait_until(finished, RUN_TIMEOUT, interval=2, what="both DAG runs to succeed")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{_logs(tmp_path)}") from None

            # the API's run was the night's only one (the scheduler did not make its own beside it)
            nightly = api.call("GET", "/api/v2/dags/featurehouse_nightly/dagRuns")["dag_runs"]
            assert [r["dag_run_id"] for r in nightly] == [runs["featurehouse_nightly"]]
            # the mapped fetch ran in the pool, one task per chunk
            tis = api.call("GET", f"/api/v2/dags/featurehouse_nightly/dagRuns/{runs['featurehouse_nightly']}/taskInstances")
            fetches = [t for t in tis["task_instances"] if t["task_id"] == "fetch"]
            assert len(fetches) == 4 and {t["pool"] for t in fetches} == {"neuronpedia_api"}
            assert all(t["state"] == "success" for t in tis["task_instances"])
            writers = {t["task_id"]: t["pool"] for t in tis["task_instances"] if t["task_id"] != "fetch"}
            assert writers == {"plan": "default_pool", "units": "default_pool", "ingest": "warehouse_writer",
                               "finish": "warehouse_writer", "materialise": "warehouse_writer",
                               "report": "default_pool", "maintain": "warehouse_writer",
                               "all_fetched": "default_pool", "find_index": "default_pool"}
            # and the mapped ingest, one part per fetch chunk
            assert len([t for t in tis["task_instances"] if t["task_id"] == "ingest"]) == 4
        finally:
            for proc in reversed(list(procs.values())):
                stop(proc)

        for name, proc in procs.items():
            assert proc.returncode is not None, f"{name} still running"

        assert pending_files(inbox) == ([], 0)
        # the warehouse's catalog is in PostgreSQL; its folder holds data files, landing, reports
        assert not (Path(env["FEATUREHOUSE_WAREHOUSE"]) / "catalog.sqlite").exists()
        assert list((Path(env["FEATUREHOUSE_WAREHOUSE"]) / "data").rglob("*.parquet"))
        with open_warehouse(Settings(warehouse=Path(env["FEATUREHOUSE_WAREHOUSE"]), catalog=pg.catalog)) as conn:
            assert conn.execute("SELECT count(*) FROM features WHERE feature_index < 40").fetchone()[0] == 40
            assert conn.execute("SELECT count(*) FROM features WHERE feature_index = 45698").fetchone()[0] == 1
            assert conn.execute("SELECT count(*) FROM raw_inputs WHERE status = 'rejected'").fetchone()[0] == 1
            # the two DAGs' runs, each batch a snapshot named after its run
            runs = {r for (r,) in conn.execute(
                "SELECT DISTINCT commit_extra_info::JSON->>'run_id' FROM featurehouse.snapshots() "
                "WHERE commit_extra_info::JSON->>'run_id' IS NOT NULL").fetchall()}
            assert {r for (r,) in conn.execute("SELECT run_id FROM runs").fetchall()} <= runs
            statuses = conn.execute("SELECT DISTINCT status FROM runs WHERE trigger = 'airflow'").fetchall()
            assert statuses == [("succeeded",)]
