"""End to end through Airflow itself: a fresh AIRFLOW_HOME, `airflow db migrate` and the pools
(deploy/airflow-init.sh, as the deployment runs it), then `airflow dags test` of both DAGs: the
nightly one fetching from a fake Neuronpedia server, the inbox one draining the seed pages."""

from __future__ import annotations

import contextlib
import shutil
import socket
import sqlite3
import time
from datetime import datetime
from pathlib import Path

import duckdb
import pytest

from pipeline.sources.inbox import DONE_DIR, pending_files
from pipeline.sources.night import run_id_for, window_for
from tests.airflow_helpers import (
    REPO,
    airflow,
    airflow_env,
    fake_neuronpedia_server,
    init,
    smtp_server,
)
from tests.conftest import open_warehouse
from tests.test_dags import RAW_TABLES, STATS_TABLES, _bundle

pytestmark = [pytest.mark.airflow, pytest.mark.heavy(150)]  # its tests share one Airflow home

LOGICAL_DATE = "2026-11-28T03:00:00+00:00"
WANTED = list(range(0, 60)) + [150]  # what the config below asks for and the fake serves
MISSING = 500  # asked for, not on the server: recorded as not found, the run goes on

CONFIG = """
[fetch]
chunk_size = 25
requests_per_hour = 3600000  # the fake site has no limit: no waiting on the rate limiter
concurrency = 4
[[sources]]
model = "gpt-oss-20b"
source = "11-resid-post-aa"
indices = ["0:60", "150", "500"]
"""


def q(warehouse, sql, params=None):
    """``sql``'s rows: from ``warehouse`` (a connection of its own), or through an open connection
    (several reads in a row: opening one is ~0.3 CPU-s)."""
    if isinstance(warehouse, duckdb.DuckDBPyConnection):
        return warehouse.execute(sql, params or []).fetchall()
    with open_warehouse(warehouse) as conn:
        return conn.execute(sql, params or []).fetchall()


#: Features the fake serves, 0 to 150: the highest index any test here asks for and expects
#: found (WANTED's 150; the others ask for 0:3 and 70:73), MISSING beyond them. It builds every
#: page before it listens (~13 ms of CPU a page), so not the 200 it would make by default.
FAKE_FEATURES = max(WANTED) + 1


@pytest.fixture(scope="module")
def fake_neuronpedia(tmp_path_factory):
    assert MISSING >= FAKE_FEATURES  # still not on the server
    with fake_neuronpedia_server(tmp_path_factory.mktemp("fake") / "fake.log", n_features=FAKE_FEATURES) as url:
        yield url


@pytest.fixture(scope="module")
def home(tmp_path_factory, fake_neuronpedia):
    """A fresh AIRFLOW_HOME (SQLite metadata), initialised by the deployment's own init script."""
    root = tmp_path_factory.mktemp("airflow")
    (root / "featurehouse.toml").write_text(CONFIG)
    env = airflow_env(
        root / "home",
        FEATUREHOUSE_CONFIG=str(root / "featurehouse.toml"),
        NEURONPEDIA_BASE_URL=fake_neuronpedia,
        NEURONPEDIA_EXPORTS_URL=f"{fake_neuronpedia}/neuronpedia-datasets",
        FEATUREHOUSE_INBOX_SETTLE_SECONDS="0",
    )
    init(env)
    with _airflow_db(env) as conn:  # as `airflow pools list` prints them
        pools = set(conn.execute("SELECT pool, slots FROM slot_pool").fetchall())
    assert {("neuronpedia_api", 4), ("warehouse_writer", 2)} <= pools  # the script's defaults
    return env


def test_nightly_fetches_from_the_fake_server_into_the_warehouse(home):
    out = airflow(["dags", "test", "featurehouse_nightly", LOGICAL_DATE], home)
    assert "state=success" in out.stdout + out.stderr

    wh = home["FEATUREHOUSE_WAREHOUSE"]
    key = datetime.fromisoformat(LOGICAL_DATE)
    run_id = run_id_for(key)
    with open_warehouse(wh) as conn:  # the night's reads through one connection
        got = [i for (i,) in q(conn, "SELECT feature_index FROM features ORDER BY 1")]
        assert got == WANTED
        assert q(conn, "SELECT count(*) FROM activations")[0][0] > 0
        assert q(conn, "SELECT count(DISTINCT feature_index) FROM feature_activation_stats")[0][0] == len(WANTED)
        assert q(conn, "SELECT status, trigger, n_loaded, n_rejected FROM runs WHERE run_id = ?", [run_id]) == [
            ("succeeded", "airflow", len(WANTED), 0)]
        failures = q(conn, 'SELECT "window", feature_key, status FROM fetch_failures WHERE run_id = ?', [run_id])
        assert len(failures) == 1 and failures[0][0] == window_for(key) and str(MISSING) in failures[0][1]
        assert failures[0][2] == "not_found" and failures[0][1].endswith(f"/{MISSING}")
        (report_path,) = q(conn, "SELECT report_path FROM runs WHERE run_id = ?", [run_id])[0]
        assert report_path and Path(report_path).exists()
        n_raw = q(conn, "SELECT count(*) FROM raw_inputs")[0][0]

    # Airflow recorded the Assets' events, their URIs naming this warehouse: each ingest part's
    # tables, and materialise's statistics once
    catalog = f"x-ducklake://{wh}/catalog.sqlite"
    airflow_run_id = _states(home, LOGICAL_DATE)[0]["run_id"]
    events = _asset_events(home, "featurehouse_nightly", airflow_run_id)
    assert {uri for uri, task in events if task == "ingest"} == {f"{catalog}/{t}" for t in RAW_TABLES}
    assert sorted(uri for uri, task in events if task == "materialise") == [f"{catalog}/{t}" for t in STATS_TABLES]
    with _airflow_db(home) as conn:  # one event of each table a part
        ((parts,),) = conn.execute("SELECT count(*) FROM task_instance WHERE dag_id = 'featurehouse_nightly' "
                                   "AND task_id = 'ingest' AND run_id = ?", [airflow_run_id]).fetchall()
    assert parts > 1 and [uri for uri, _ in events].count(f"{catalog}/features") == parts

    # the same logical date again: the same window and run id, nothing fetched or loaded twice
    airflow(["dags", "test", "featurehouse_nightly", LOGICAL_DATE], home)
    with open_warehouse(wh) as conn:
        assert q(conn, "SELECT count(*) FROM runs WHERE run_id LIKE 'airflow-featurehouse_nightly-%'")[0][0] == 1
        assert q(conn, "SELECT count(*) FROM raw_inputs")[0][0] == n_raw
        assert q(conn, "SELECT count(*) FROM features")[0][0] == len(WANTED)
        # ... and the run keeps saying what it did (a re-run of the same interval is that run again,
        # not a new run that found only duplicates)
        assert q(conn, "SELECT n_loaded, n_duplicates FROM runs WHERE run_id = ?", [run_id]) == [(len(WANTED), 0)]
        assert q(conn, "SELECT count(*) FROM run_inputs WHERE run_id = ?", [run_id]) == [(n_raw,)]


def test_inbox_drains_the_seeds(home):
    inbox = Path(home["FEATUREHOUSE_INBOX"])
    inbox.mkdir(parents=True, exist_ok=True)
    seeds = sorted((REPO / "samples").iterdir())
    for f in seeds:
        shutil.copyfile(f, inbox / f.name)

    out = airflow(["dags", "test", "featurehouse_inbox", LOGICAL_DATE], home)
    assert "state=success" in out.stdout + out.stderr

    assert pending_files(inbox) == ([], 0)  # the inbox is empty ...
    done = sorted(p.name for p in (inbox / DONE_DIR).rglob("*") if p.is_file())
    assert done == [f.name for f in seeds]  # ... and nothing was lost
    with open_warehouse(home["FEATUREHOUSE_WAREHOUSE"]) as wh:  # both reads through one connection
        statuses = dict(q(wh, "SELECT regexp_extract(origin, '[^/]+$'), status FROM raw_inputs "
                              "WHERE run_id LIKE 'airflow-featurehouse_inbox-%'"))
        assert statuses == {"000_e9e35889d0228029.txt": "loaded", "002_cdcf7f83dd4b10f8.txt": "rejected"}
        assert q(wh, "SELECT count(*) FROM features WHERE feature_index = 45698")[0][0] == 1
    run, _ = _states(home, LOGICAL_DATE, "featurehouse_inbox")
    assert sorted(uri.rsplit("/", 1)[1] for uri, task in _asset_events(home, "featurehouse_inbox", run["run_id"])
                  if task == "drain") == sorted(RAW_TABLES + STATS_TABLES)


def test_a_failed_run_mails_the_operator_from_a_bundle_that_finds_its_config_from_a_variable(home, tmp_path):
    """Issue 45, as an operator of Airflow expects it: only dags/, copied elsewhere as a DAG bundle
    is; featurehouse.toml named by the Airflow Variable featurehouse_config (not
    $FEATUREHOUSE_CONFIG), its [notify] naming who is mailed; the SMTP server the connection
    smtp_default (AIRFLOW_CONN_SMTP_DEFAULT) names, on loopback. The inbox's drain fails (all it
    found was rejected): one mail arrives, naming the DAG, the task and the run, Airflow's and the
    warehouse's (review: only Airflow's was named)."""
    import json

    bundle = _bundle(tmp_path)
    site = tmp_path / "site"
    (site / "drop").mkdir(parents=True)
    (site / "drop" / "not-a-page.txt").write_bytes((REPO / "samples" / "002_cdcf7f83dd4b10f8.txt").read_bytes())
    (site / "featurehouse.toml").write_text(
        '[paths]\nwarehouse = "wh"\ninbox = "drop"\n[inbox]\nsettle_seconds = 0\n'
        '[notify]\nemail = ["ops@example.org", "oncall@example.org"]\nfrom_email = "featurehouse@example.org"\n')
    logical_date = "2026-12-02T03:00:00+00:00"
    with smtp_server() as mailbox:
        smtp = {"conn_type": "smtp", "host": "127.0.0.1", "port": mailbox.port,
                "extra": {"disable_ssl": True, "disable_tls": True, "timeout": 10, "retry_limit": 0}}
        env = {k: v for k, v in home.items() if not k.startswith("FEATUREHOUSE_")} | {
            "FEATUREHOUSE_SCHEMAS": home["FEATUREHOUSE_SCHEMAS"], "FEATUREHOUSE_CATALOG": "",
            "AIRFLOW__CORE__DAGS_FOLDER": str(bundle), "AIRFLOW_VAR_FEATUREHOUSE_CONFIG": str(site / "featurehouse.toml"),
            "AIRFLOW_CONN_SMTP_DEFAULT": json.dumps(smtp)}
        out = airflow(["dags", "test", "featurehouse_inbox", logical_date], env, check=False)
    log = out.stdout + out.stderr
    run, by_task = _states(env, logical_date, "featurehouse_inbox")
    assert run["state"] == "failed" and by_task["drain"] == "failed", log[-3000:]
    # the drain read the Variable's file: its inbox and warehouse, relative to it
    assert [p.name for p in (site / "drop").iterdir()] == [".done"]
    with open_warehouse(site / "wh") as conn:  # the warehouse's two reads through one connection
        assert q(conn, "SELECT n_received, n_rejected FROM runs") == [(1, 1)]
        (warehouse_run,) = q(conn, "SELECT run_id FROM runs")[0]  # the id status and reports name it by

    assert len(mailbox.messages) == 1, log[-3000:]
    (mail,) = mailbox.messages
    assert mail["X-Envelope-To"] == "ops@example.org, oncall@example.org"
    assert mail["From"] == "featurehouse@example.org"
    assert mail["Subject"] == f"featurehouse: featurehouse_inbox failed in task drain (run {run['run_id']})"
    body = mail.get_body(("html",)).get_content()
    assert "featurehouse_inbox" in body and "<b>drain</b>" in body and "featurehouse status" in body
    # with the warehouse the tasks loaded, the Variable's file's (review: the commands named none)
    assert f"featurehouse report --run {warehouse_run} --warehouse {site / 'wh'}" in body, body
    assert f"featurehouse status --warehouse {site / 'wh'}" in body, body
    # the failed task's own error, not only a link to its log
    assert "AirflowFailException: inbox run" in body and "verdict FAIL" in body, body


CLOSED_CONFIG = """
[fetch]
chunk_size = 10
max_attempts = 1
backoff = 0.01
task_retries = 1
task_retry_delay = 1
[[sources]]
model = "gpt-oss-20b"
source = "11-resid-post-aa"
indices = ["0:3"]
"""


def test_nightly_takes_neuronpedia_from_its_airflow_connection(home, tmp_path, fake_neuronpedia):
    """Issue 45: Neuronpedia's address (and key) from the Connection `neuronpedia_default`, as
    Airflow users keep them: the environment's URL is a closed port here, only the Connection
    (given as Airflow's AIRFLOW_CONN_ variable) names the fake site, and the night lands its pages."""
    import json

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    (tmp_path / "featurehouse.toml").write_text(CLOSED_CONFIG)
    wh = tmp_path / "warehouse"
    conn = json.dumps({"conn_type": "http", "host": fake_neuronpedia, "password": "key-from-the-connection"})
    env = home | {"FEATUREHOUSE_CONFIG": str(tmp_path / "featurehouse.toml"), "NEURONPEDIA_BASE_URL": closed,
                  "FEATUREHOUSE_WAREHOUSE": str(wh), "AIRFLOW_CONN_NEURONPEDIA_DEFAULT": conn}
    logical_date = "2026-11-30T03:00:00+00:00"
    out = airflow(["dags", "test", "featurehouse_nightly", logical_date], env, check=False)
    log = out.stdout + out.stderr
    run, by_task = _states(env, logical_date)
    assert by_task["fetch"] == "success" and run["state"] == "success", log[-3000:]
    assert "key-from-the-connection" not in log  # the key is sent, never logged
    run_id = run_id_for(datetime.fromisoformat(logical_date))
    assert q(wh, "SELECT status, n_loaded FROM runs WHERE run_id = ?", [run_id]) == [("succeeded", 3)]


def test_a_manual_run_fetches_the_source_its_params_name(home, tmp_path):
    """Issue 45: "Trigger DAG" with params fetches that source and range, not the file's."""
    import json

    (tmp_path / "featurehouse.toml").write_text(CONFIG)
    wh = tmp_path / "warehouse"
    env = home | {"FEATUREHOUSE_CONFIG": str(tmp_path / "featurehouse.toml"), "FEATUREHOUSE_WAREHOUSE": str(wh)}
    logical_date = "2026-12-01T03:00:00+00:00"
    conf = json.dumps({"model": "gpt-oss-20b", "source": "11-resid-post-aa", "indices": "70:73"})
    out = airflow(["dags", "test", "featurehouse_nightly", logical_date, "--conf", conf], env, check=False)
    run, by_task = _states(env, logical_date)
    assert run["state"] == "success", (out.stdout + out.stderr)[-3000:]
    assert [i for (i,) in q(wh, "SELECT feature_index FROM features ORDER BY 1")] == [70, 71, 72]


def test_nightly_against_a_closed_port_fails_its_fetch_but_ingests_and_reports(home, tmp_path):
    """Every fetch failed: the fetch task fails (after its retry), ingest and report still run,
    and the run's report says FAIL; a night like this is never all green."""
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    (tmp_path / "featurehouse.toml").write_text(CLOSED_CONFIG)
    wh = tmp_path / "warehouse" / "featurehouse.duckdb"
    env = home | {"FEATUREHOUSE_CONFIG": str(tmp_path / "featurehouse.toml"), "NEURONPEDIA_BASE_URL": closed,
                  "FEATUREHOUSE_WAREHOUSE": str(wh)}
    logical_date = "2026-11-29T03:00:00+00:00"
    out = airflow(["dags", "test", "featurehouse_nightly", logical_date], env, check=False)
    log = out.stdout + out.stderr
    assert "FetchChunkFailed" in log and "3 of 3 URL(s) failed" in log, log[-3000:]

    run, by_task = _states(env, logical_date)
    # the chunk's ingest part finds nothing landed; finish records the failures
    assert by_task == {"plan": "success", "fetch": "failed", "units": "success", "ingest": "success",
                       "finish": "success", "materialise": "success", "find_index": "success",
                       "report": "success", "maintain": "success", "all_fetched": "upstream_failed"}
    assert log.count("3 of 3 URL(s) failed") >= 2, "the fetch task was not retried"
    # the first try promises a retry, the last (task_retries = 1) says none is left
    assert log.count("a retry asks only for the rest") == 1 and log.count("no retry is left") == 1, log[-3000:]
    assert log.index("a retry asks only for the rest") < log.index("no retry is left")
    assert run["state"] == "failed"
    # finish and report say the night's verdict in their logs (at WARNING: it is not PASS)
    assert log.count("verdict FAIL: 3 of 3 URL(s) failed to fetch") >= 2, log[-3000:]

    run_id = run_id_for(datetime.fromisoformat(logical_date))
    with open_warehouse(wh) as conn:  # the three reads through one connection
        assert q(conn, "SELECT status, n_received FROM runs WHERE run_id = ?", [run_id]) == [("succeeded", 0)]
        assert q(conn, "SELECT count(*), min(status) FROM fetch_failures WHERE run_id = ?", [run_id]) == [(3, "failed")]
        (report_path,) = q(conn, "SELECT report_path FROM runs WHERE run_id = ?", [run_id])[0]
    assert '<div class="verdict FAIL" id="verdict">' in Path(report_path).read_text()


def _asset_events(env: dict, dag_id: str, run_id: str) -> list[tuple[str, str]]:
    """(asset URI, task) of each asset event a DAG run's tasks emitted, from Airflow's metadata
    database (what the UI's Assets view shows)."""
    with _airflow_db(env) as conn:
        return conn.execute("SELECT a.uri, e.source_task_id FROM asset_event e JOIN asset a ON a.id = e.asset_id "
                            "WHERE e.source_dag_id = ? AND e.source_run_id = ?", [dag_id, run_id]).fetchall()


def _airflow_db(env: dict) -> contextlib.closing:
    """Airflow's metadata database (SQLite here), read-only: what the `airflow` commands that
    list pools, runs and task states read, without starting an Airflow process (~3 s of CPU)."""
    db = env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].removeprefix("sqlite:///")
    return contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True))


def _states(env: dict, logical_date: str, dag_id: str = "featurehouse_nightly") -> tuple[dict, dict[str, str]]:
    """The DAG run of ``logical_date`` and its tasks' states (a mapped task's worst), as Airflow
    recorded them in its metadata database: what `airflow dags list-runs` and `airflow tasks
    states-for-dag-run` print, read without starting two more Airflow processes (~3 s each)."""
    with _airflow_db(env) as conn:
        ((run_id, state),) = conn.execute(
            "SELECT run_id, state FROM dag_run WHERE dag_id = ? AND logical_date LIKE ?",
            [dag_id, logical_date[:10] + "%"]).fetchall()
        states = conn.execute("SELECT task_id, state FROM task_instance WHERE dag_id = ? "
                              "AND run_id = ? ORDER BY task_id, map_index", [dag_id, run_id]).fetchall()
    by_task: dict[str, str] = {}
    for task_id, task_state in states:  # a mapped task: failed if any of its instances failed
        if by_task.get(task_id) != "failed":
            by_task[task_id] = task_state
    return {"run_id": run_id, "state": state}, by_task


TYPO_CONFIG = """
[fetch]
chunk_size = 10
max_attempts = 1
backoff = 0.01
task_retries = 2
task_retry_delay = 1
[[sources]]
model = "gpt-oss-20b"
source = "11-resid-post-ab"
indices = ["0:2"]
"""


def test_nightly_naming_a_source_that_does_not_exist_fails_at_once_and_says_why(home, tmp_path):
    """Every URL of the source is a 404 (and so is its feature 0): its fetch fails at once,
    though retries are allowed; what follows records it; the night is failed, not green."""
    (tmp_path / "featurehouse.toml").write_text(TYPO_CONFIG)
    wh = tmp_path / "warehouse"
    env = home | {"FEATUREHOUSE_CONFIG": str(tmp_path / "featurehouse.toml"), "FEATUREHOUSE_WAREHOUSE": str(wh)}
    logical_date = "2026-11-30T03:00:00+00:00"
    out = airflow(["dags", "test", "featurehouse_nightly", logical_date], env, check=False)
    log = out.stdout + out.stderr
    assert "SourceNotFound" in log and "gpt-oss-20b/11-resid-post-ab" in log and "no such source" in log, log[-3000:]

    run, by_task = _states(env, logical_date)
    assert run["state"] == "failed"
    assert by_task["fetch"] == "failed" and by_task["all_fetched"] == "upstream_failed"
    assert {by_task[t] for t in ("units", "ingest", "finish", "materialise", "report", "maintain")} == {"success"}
    assert log.count("starting task_id=fetch map_index=0") == 1, "a missing source was retried"

    run_id = run_id_for(datetime.fromisoformat(logical_date))
    with open_warehouse(wh) as conn:  # the three reads through one connection
        assert q(conn, "SELECT status, n_loaded FROM runs WHERE run_id = ?", [run_id]) == [("succeeded", 0)]
        (reason,) = q(conn, "SELECT last_error FROM fetch_failures WHERE run_id = ? AND status = 'failed'",
                      [run_id])[0]
        assert "no such source" in reason
        (report_path,) = q(conn, "SELECT report_path FROM runs WHERE run_id = ?", [run_id])[0]
    assert '<div class="verdict FAIL" id="verdict">' in Path(report_path).read_text()


def test_nightly_with_a_config_mistake_fails_once_at_once_and_nothing_after_it_runs(home, tmp_path):
    """... and its mail carries the plan's error and claims no warehouse run (none was made)."""
    import json

    (tmp_path / "featurehouse.toml").write_text(
        TYPO_CONFIG.replace("chunk_size", "chunk_sise") + '[notify]\nemail = "ops@example.org"\nfrom_email = "featurehouse@example.org"\n')
    env = home | {"FEATUREHOUSE_CONFIG": str(tmp_path / "featurehouse.toml"),
                  "FEATUREHOUSE_WAREHOUSE": str(tmp_path / "warehouse")}
    logical_date = "2026-12-01T03:00:00+00:00"
    started = time.monotonic()
    with smtp_server() as mailbox:
        smtp = {"conn_type": "smtp", "host": "127.0.0.1", "port": mailbox.port,
                "extra": {"disable_ssl": True, "disable_tls": True, "timeout": 10, "retry_limit": 0}}
        out = airflow(["dags", "test", "featurehouse_nightly", logical_date],
                      env | {"AIRFLOW_CONN_SMTP_DEFAULT": json.dumps(smtp)}, check=False)
    log = out.stdout + out.stderr
    assert len(mailbox.messages) == 1, log[-3000:]
    body = mailbox.messages[0].get_body(("html",)).get_content()
    assert "<b>plan</b>" in body and "unknown key(s) chunk_sise (did you mean chunk_size?)" in body, body
    assert f"If the night got as far as loading, its run in the warehouse {tmp_path / 'warehouse'} is" in body, body
    assert f"featurehouse status --warehouse {tmp_path / 'warehouse'}" in body, body
    assert "Its run in the warehouse:" not in body
    assert "[fetch]: unknown key(s) chunk_sise (did you mean chunk_size?)" in log, log[-3000:]
    assert time.monotonic() - started < 120, "the plan task was retried"
    assert log.count("starting task_id=plan") == 1

    run, by_task = _states(env, logical_date)
    assert run["state"] == "failed"
    assert by_task["plan"] == "failed"
    # nothing after it loads the plan again, nor retries: they never run
    assert {by_task[t] for t in ("fetch", "units", "ingest", "all_fetched")} == {"upstream_failed"}
    assert {by_task[t] for t in ("finish", "materialise", "report", "maintain")} == {"skipped"}
    assert not (tmp_path / "warehouse").exists()
