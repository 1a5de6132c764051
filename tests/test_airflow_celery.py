"""Scale-out: the nightly DAG on the CeleryExecutor with two workers sharing one lakehouse — the
catalog in PostgreSQL, data files and the landing area on S3 (moto's server here, MinIO in
compose), Redis as the broker — started with deploy/airflow.env and deploy/airflow-scale.env as
`make up-scale` does (tests/test_compose.py holds the compose file to these settings).

1. A night of 20 features in 2 fetch chunks of 10 (the run the scheduler makes when the DAG is
   unpaused): each worker runs an ingest part, every feature is loaded once, and the tables and
   statistics equal one plain local ingest of the same pages.
2. Another night (40 more, in chunks of 20, triggered through the REST API), a worker is killed (its whole session, as a machine dying would)
   while it runs an ingest part: Airflow notices the missing heartbeat, the part is retried on
   the other worker, and the tables still equal the local ingest of all 60 features.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline.config import Settings
from pipeline.sources.fetch import fetch_features, ingest_fetched
from tests.airflow_helpers import (
    AIRFLOW,
    SCALE_SERVICES,
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
from tests.conftest import open_warehouse, tables_rows
from tests.s3_support import S3_ENV

pytestmark = [pytest.mark.airflow, pytest.mark.scheduler, pytest.mark.celery]

REPO = Path(__file__).resolve().parent.parent
MODEL, SOURCE = "gpt-oss-20b", "11-resid-post-aa"
CONFIG = """
[schedule]
retry_delay = 2
[fetch]
chunk_size = {chunk}
requests_per_hour = 3600000  # the fake site has no limit: no waiting on the rate limiter
[[sources]]
model = "{model}"
source = "{source}"
indices = ["{a}:{b}"]
"""
TABLES = ("features", "activations", "explanations", "models", "sources", "source_sets",
          "feature_activation_stats", "source_activation_stats")
WORKERS = ("worker-a", "worker-b")
BUCKET = "featurehouse"
#: found dead within seconds (the defaults take minutes); with ``[schedule] retry_delay`` above
#: (the killed part is retried 2 s later, not a minute), the test's only timing settings
FAST_ZOMBIES = {"AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "10",
                "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "1",
                "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "1"}


def _logs(tmp: Path, tail: int = 3000) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in sorted(tmp.glob("*.log")))


def _session(sid: int) -> list[int]:
    """Live processes of session ``sid``: a Celery worker, its pool, and the task runners that
    Airflow's supervisor moves into process groups of their own."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z" and os.getsid(int(d.name)) == sid:
                    out.append(int(d.name))
            except (OSError, IndexError):
                pass
    return out


def _kill_session(proc: subprocess.Popen) -> None:
    for pid in _session(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


class Stack:
    def __init__(self, env: dict[str, str], tmp: Path, api: Api):
        self.env, self.tmp, self.api = env, tmp, api

    def trigger(self, logical_date: str) -> str:
        return self.api.call("POST", "/api/v2/dags/featurehouse_nightly/dagRuns",
                             {"logical_date": logical_date})["dag_run_id"]

    def tis(self, run_id: str) -> list[dict]:
        return self.api.call("GET", f"/api/v2/dags/featurehouse_nightly/dagRuns/{run_id}/taskInstances"
                             "?limit=100")["task_instances"]

    def tries(self, run_id: str, task_id: str, map_index: int) -> list[dict]:
        return self.api.call("GET", f"/api/v2/dags/featurehouse_nightly/dagRuns/{run_id}/taskInstances/"
                             f"{task_id}/{map_index}/tries")["task_instances"]

    def wait(self, run_id: str, timeout: float) -> None:
        def done():
            state = self.api.call("GET", f"/api/v2/dags/featurehouse_nightly/dagRuns/{run_id}")["state"]
            assert state != "failed", f"run {run_id} failed: {[(t['task_id'], t['map_index'], t['state']) for t in self.tis(run_id)]}\n{_logs(self.tmp)}"
            return state == "success"

        try:
            wait_until(done, timeout, interval=2, what=f"run {run_id} to succeed")
        except AssertionError as exc:
            if "timed out" in str(exc):
                raise AssertionError(f"{exc}\n{_logs(self.tmp)}") from None
            raise


def _local_night(local: Settings, fake: str, a: int, b: int) -> None:
    """The same pages through one plain local ingest: what the cluster must match."""
    fetch_features(MODEL, SOURCE, range(a, b), settings=local, base_url=fake, window=f"local-{a}", progress=False)
    summary = ingest_fetched(f"local-{a}", local, run_id=f"local-{a}", progress=False, report_after=False)
    assert summary.n_loaded == b - a and summary.n_rejected == 0


def _assert_same_tables(cluster: Settings, local: Settings, n: int) -> None:
    with open_warehouse(cluster) as conn:
        assert conn.execute("SELECT count(*), count(DISTINCT feature_index) FROM features").fetchone() == (n, n)
    got, want = tables_rows(cluster, TABLES), tables_rows(local, TABLES)
    for table in TABLES:
        assert got[table] == want[table], table


@pytest.mark.heavy(200)
def test_two_celery_workers_share_one_lakehouse_and_survive_a_killed_worker(tmp_path):
    if pg_bin() is None:
        pytest.fail("PostgreSQL is not installed: .ci/run installs it (apt-get install postgresql)")
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: .ci/run installs it (apt-get install redis-server)")
    config = tmp_path / "featurehouse.toml"
    config.write_text(CONFIG.format(model=MODEL, source=SOURCE, a=0, b=20, chunk=10))
    password = secrets.token_urlsafe(12)
    api_port, redis_port, s3_port = free_port(), free_port(), free_port()
    procs: dict[str, subprocess.Popen] = {}
    with fake_neuronpedia_server(tmp_path / "fake.log") as fake, postgres_cluster() as pg:
        try:
            procs["redis"] = start(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no"], dict(os.environ), tmp_path / "redis.log", cwd=tmp_path)
            procs["s3"] = start([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p",
                                 str(s3_port)], dict(os.environ), tmp_path / "s3.log")
            wait_for_port(redis_port, 30, procs["redis"], "redis-server")
            wait_for_port(s3_port, 60, procs["s3"], "moto_server")
            endpoint = f"http://127.0.0.1:{s3_port}"
            import boto3

            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                         aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket=BUCKET)

            env = airflow_env(
                tmp_path / "home", scale=True,
                AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=pg.url,
                AIRFLOW__CELERY__BROKER_URL=f"redis://127.0.0.1:{redis_port}/0",
                FEATUREHOUSE_FETCH_BUDGET=f"redis://127.0.0.1:{redis_port}/2",
                AIRFLOW__CELERY__RESULT_BACKEND=f"db+{pg.url}",
                FEATUREHOUSE_CATALOG=pg.catalog,
                FEATUREHOUSE_S3_ENDPOINT=endpoint,
                FEATUREHOUSE_DATA_PATH=f"s3://{BUCKET}/warehouse/data/",
                FEATUREHOUSE_LANDING=f"s3://{BUCKET}/landing",
                AWS_ACCESS_KEY_ID=S3_ENV["AWS_ACCESS_KEY_ID"],
                AWS_SECRET_ACCESS_KEY=S3_ENV["AWS_SECRET_ACCESS_KEY"],
                AIRFLOW__API__PORT=str(api_port),
                AIRFLOW__API__HOST="127.0.0.1",
                AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{api_port}/execution/",
                AIRFLOW_ADMIN_PASSWORD=password,
                FEATUREHOUSE_CONFIG=str(config),
                NEURONPEDIA_BASE_URL=fake,
                NEURONPEDIA_EXPORTS_URL=f"{fake}/neuronpedia-datasets",
                AIRFLOW__CORE__HOSTNAME_CALLABLE="tests.worker_hostname.get",
                FEATUREHOUSE_WRITER_SLOTS="2",  # two workers x one slot
                # this tree's dags/ and pipeline/, tests.worker_hostname, and deploy/ (airflow_local_settings)
                PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "deploy")]),
                **FAST_ZOMBIES,
            )
            assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
            init(env)
            for name in ("api-server", "scheduler", "dag-processor"):
                procs[name] = start([str(AIRFLOW), *SERVICES[name]], env, tmp_path / f"{name}.log")
            for w in WORKERS:
                # one task at a time each, so that the night's two ingest parts go one to each
                procs[w] = start([str(AIRFLOW), *SCALE_SERVICES["airflow-worker"], "--celery-hostname", w,
                                  "--concurrency", "1", "--pid", str(tmp_path / f"{w}.pid"), "--skip-serve-logs"],
                                 env | {"FEATUREHOUSE_TEST_WORKER": w}, tmp_path / f"{w}.log")
            wait_for_port(api_port, 180, procs["api-server"], "airflow api-server")
            # the execution API is mounted on first use, slower than a worker's first call waits
            with urllib.request.urlopen(f"http://127.0.0.1:{api_port}/execution/health", timeout=120) as r:
                assert r.status == 200
            wait_until(lambda: all(f"celery@{w} ready" in (tmp_path / f"{w}.log").read_text(errors="replace")
                                   for w in WORKERS), 180, 0.5, "both Celery workers ready")
            api = Api(f"http://127.0.0.1:{api_port}", "admin", password)
            stack = Stack(env, tmp_path, api)
            wait_until(lambda: api._send("GET", "/api/v2/dags/featurehouse_nightly", token=api.token)[0] == 200,
                       180, what="the nightly DAG to be parsed")
            api.call("PATCH", "/api/v2/dags/featurehouse_nightly", {"is_paused": False})

            cluster = Settings(warehouse=tmp_path / "reader", catalog=pg.catalog, s3_endpoint=endpoint)
            local = Settings(warehouse=tmp_path / "local")
            os.environ.update(S3_ENV)  # this process reads the cluster's warehouse from S3 too

            # --- night 1: both workers load parts of one run at once ---------------------------
            # unpausing makes the scheduler run the latest interval: that run is the first night
            first = wait_until(lambda: [r["dag_run_id"] for r in api.call(
                "GET", "/api/v2/dags/featurehouse_nightly/dagRuns")["dag_runs"]], 120, what="the scheduled run")[0]
            _local_night(local, fake, 0, 20)
            stack.wait(first, 420)
            ingests = [t for t in stack.tis(first) if t["task_id"] == "ingest"]
            assert len(ingests) == 2 and {t["state"] for t in ingests} == {"success"}
            assert {t["hostname"] for t in ingests} == set(WORKERS), "each worker ran an ingest part"
            _assert_same_tables(cluster, local, 20)

            # --- night 2: a worker dies in the middle of an ingest part -------------------------
            config.write_text(CONFIG.format(model=MODEL, source=SOURCE, a=20, b=60, chunk=20))
            second = stack.trigger("2026-11-20T03:00:00Z")  # not the scheduled run's night

            def an_ingest_running():
                running = [t for t in stack.tis(second) if t["task_id"] == "ingest" and t["state"] == "running"
                           and t["hostname"] in WORKERS]
                return running[0] if running else None

            victim = wait_until(an_ingest_running, 300, interval=0.3, what="an ingest part running")
            _kill_session(procs[victim["hostname"]])
            survivor = next(w for w in WORKERS if w != victim["hostname"])
            killed_at = time.monotonic()
            _local_night(local, fake, 20, 60)
            stack.wait(second, 420)
            tries = sorted(stack.tries(second, "ingest", victim["map_index"]), key=lambda t: t["try_number"])
            assert [(t["hostname"], t["state"]) for t in tries][-1] == (survivor, "success"), tries
            assert tries[0]["hostname"] == victim["hostname"] and tries[0]["state"] == "failed", tries
            print(f"killed {victim['hostname']} in ingest part {victim['map_index']}; the night ended "
                  f"{time.monotonic() - killed_at:.0f}s later")
            _assert_same_tables(cluster, local, 60)
            with open_warehouse(cluster) as conn:
                runs = conn.execute("SELECT status, n_loaded FROM runs WHERE run_id LIKE 'airflow-%' "
                                    "ORDER BY run_id").fetchall()
            assert runs == [("succeeded", 40), ("succeeded", 20)]  # by run id: night 2 (2026-11-20) comes first
        finally:
            for name in reversed(list(procs)):
                stop(procs[name], grace=15)
                if name in WORKERS:
                    _kill_session(procs[name])
            for k in S3_ENV:
                os.environ.pop(k, None)
