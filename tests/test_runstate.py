"""A killed run: recorded with its host and pid, shown as abandoned on read, marked so by the next ingest."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest

from bench.generate import write_pages
from pipeline import Settings, ingest
from pipeline.lake import runstate, warehouse
from pipeline.stages.load import utcnow
from tests.conftest import SEED_FLIGHT, SEED_NOT_A_PAGE, open_warehouse, query
from tests.test_cli import FEATUREHOUSE, fh


def _index_row(index: Path, run_id: str) -> str:
    m = re.search(rf'<tr class="run" data-run="{re.escape(run_id)}">(.*?)</tr>', index.read_text(), re.S)
    assert m, f"{run_id} is not in {index}"
    return m.group(1)


@pytest.mark.heavy(40)
def test_a_killed_ingest_shows_as_abandoned_and_the_next_ingest_records_it(tmp_path):
    wh = tmp_path / "wh"
    first = ingest([SEED_FLIGHT], Settings.from_env(warehouse=wh), progress=False)  # the set-up, in-process
    assert first.status == "succeeded" and first.report_path, first
    write_pages(150, tmp_path / "pages")  # ~40 MB: seconds of work after the run is recorded

    log = (tmp_path / "killed.log").open("w")
    child = subprocess.Popen([str(FEATUREHOUSE), "ingest", str(tmp_path / "pages"), "--warehouse", str(wh),
                              "--no-progress", "--run-id", "killed-run"], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 120
        # looked for through one connection held open (DuckLake reads the newest snapshot at each
        # statement): ~10 ms a look, where opening one a look cost ~0.4 CPU-s every 50 ms
        with open_warehouse(wh) as conn:
            while not conn.execute("SELECT 1 FROM runs WHERE run_id = 'killed-run'").fetchall():
                assert child.poll() is None, (tmp_path / "killed.log").read_text()
                assert time.monotonic() < deadline, "the ingest never recorded its run"
                time.sleep(0.05)
        assert child.poll() is None, "the ingest finished before it could be killed: give it more pages"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        log.close()
    assert child.returncode == -signal.SIGKILL

    # who ran it is recorded; the row can say no more than 'running'
    assert query(wh, "SELECT status, host, pid FROM runs WHERE run_id = 'killed-run'") == [
        ("running", socket.gethostname(), child.pid)]
    snapshot = query(wh, "SELECT max(snapshot_id) FROM featurehouse.snapshots()")

    # status shows it abandoned, computed on read: nothing written
    table = fh("status", "--warehouse", str(wh))
    assert table.returncode == 0, table.stderr
    (line,) = [line for line in table.stdout.splitlines() if "killed-run" in line]
    assert "abandoned" in line and "running" not in line
    as_json = fh("status", "--warehouse", str(wh), "--format", "json")
    assert as_json.returncode == 0, as_json.stderr
    runs = {r["run_id"]: r for r in json.loads(as_json.stdout)}
    assert runs["killed-run"]["status"] == "abandoned" and runs["killed-run"]["verdict"] == "FAIL"
    assert f"pid {child.pid}" in runs["killed-run"]["verdict_reason"]
    assert [r["status"] for r in runs.values()].count("succeeded") == 1

    # so does the report (read-only too), on the run's page and in the index
    report = fh("report", "--warehouse", str(wh), "--run", "killed-run")
    assert report.returncode == 0, report.stderr
    page = (wh / "reports" / "killed-run.html").read_text()
    assert "status <b>abandoned</b>" in page and '<div class="verdict FAIL"' in page
    row = _index_row(wh / "reports" / "index.html", "killed-run")
    assert '<span class="bad">abandoned</span>' in row and "badge FAIL" in row

    assert query(wh, "SELECT status FROM runs WHERE run_id = 'killed-run'") == [("running",)]
    assert query(wh, "SELECT max(snapshot_id) FROM featurehouse.snapshots()") == snapshot

    # the next ingest records it, and its index says so
    later = fh("ingest", str(SEED_NOT_A_PAGE), "--warehouse", str(wh), "--no-progress")
    assert later.returncode == 0, later.stderr
    ((status, error),) = query(wh, "SELECT status, error FROM runs WHERE run_id = 'killed-run'")
    assert status == "abandoned"
    assert f"pid {child.pid} on {socket.gethostname()}" in error and "found by run run-" in error
    assert '<span class="bad">abandoned</span>' in _index_row(wh / "reports" / "index.html", "killed-run")


def test_only_runs_of_this_host_whose_process_is_gone_are_abandoned(tmp_path):
    settings = Settings.from_env(warehouse=tmp_path / "wh")
    ingest([SEED_FLIGHT], settings, progress=False, report_after=False)
    host, now = socket.gethostname(), utcnow()
    exited = subprocess.Popen(["true"])
    exited.wait()
    zombie = subprocess.Popen(["sleep", "60"])
    zombie.send_signal(signal.SIGKILL)  # killed, not yet reaped: its pid still answers
    time.sleep(0.2)
    reused = subprocess.Popen(["sleep", "60"])  # alive, but started long after its run: the pid was reused
    try:
        runs = [
            ("exited-here", host, exited.pid, now),
            ("zombie-here", host, zombie.pid, now),
            ("pid-reused-here", host, reused.pid, now - timedelta(hours=1)),
            ("alive-here", host, os.getpid(), now),  # this process started before the run: its own
            ("exited-elsewhere", "another-host", exited.pid, now),  # cannot be looked at from here
            ("before-host-was-recorded", None, None, now - timedelta(days=1)),
        ]

        def body(c):
            for run_id, h, pid, at in runs:
                c.execute("INSERT INTO runs (run_id, started_at, status, trigger, host, pid) "
                          "VALUES (?, ?, 'running', 'test', ?, ?)", [run_id, at, h, pid])

        with warehouse.connect(settings) as conn:
            warehouse.transaction(conn, settings, body, message="runs")
        gone = {"exited-here", "zombie-here", "pid-reused-here"}
        with open_warehouse(settings) as conn:
            assert set(runstate.find_abandoned(conn)) == gone

        ingest([SEED_NOT_A_PAGE], settings, progress=False, report_after=False)
        assert dict(query(settings, "SELECT run_id, status FROM runs WHERE trigger = 'test'")) == {
            run_id: "abandoned" if run_id in gone else "running" for run_id, *_ in runs}
    finally:
        for p in (zombie, reused):
            p.kill()
            p.wait()


def test_a_part_starts_without_a_commit_unless_it_clears_its_own_failure(tmp_path):
    """Parts of a shared run (a night's units) record nothing when they start, once the run's
    row is there: no turn of the commit lock per unit. A part whose earlier attempt failed the
    run clears that failure when it starts again; another part's start leaves it."""
    settings = Settings.from_env(warehouse=tmp_path / "wh")
    conn = warehouse.connect(settings, create=True)
    try:
        def start(part):
            s = runstate.RunSummary(run_id="night-1", warehouse=str(settings.warehouse), part=part)
            runstate.start_run(conn, settings, s, "nightly")
            return s

        def snapshots():
            return conn.execute(f"SELECT count(*) FROM {warehouse.CATALOG}.snapshots()").fetchone()[0]

        first = start(0)
        assert first.stats.commits == 1  # the run's row is made
        before = snapshots()
        assert start(1).stats.commits == 0 and snapshots() == before
        failed = start(2)
        runstate.finish_run(conn, settings, failed, error="its worker died")
        row = lambda: conn.execute("SELECT status, error FROM runs WHERE run_id = 'night-1'").fetchone()  # noqa: E731
        assert row() == ("failed", "part c2: its worker died")
        assert start(1).stats.commits == 0 and row()[0] == "failed"  # not its failure
        assert start(2).stats.commits == 1 and row() == ("running", None)  # its retry clears it
    finally:
        conn.close()
