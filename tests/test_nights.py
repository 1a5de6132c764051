"""Bad nights the operator must see (issue 20): each kind of bad night is told apart from a good
one in the runs table, in `featurehouse status` and in the verdict, never left green.

Library level, without Airflow (the DAG-level cases are in tests/test_airflow_dags_test.py):
the nightly's ingest parts run one after another as the mapped ingest task runs them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import Settings
from pipeline.outputs.report import recent_runs
from pipeline.sources.fetch import finish_fetched, ingest_unit
from pipeline.sources.night import FetchChunkFailed, fetch_chunk, ingest_units
from tests.conftest import open_warehouse
from tests.fake_neuronpedia import FakeNeuronpedia
from tests.fetch_support import MODEL, SOURCE, pages, query

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")
COUNTS = "status, n_received, n_duplicates, n_loaded, n_rejected, n_features, n_quarantined"


def chunk(base_url: str, window: str, start: int, stop: int) -> dict:
    return {"model": MODEL, "source": SOURCE, "via": "api", "start": start, "stop": stop, "window": window,
            "base_url": base_url, "exports_url": f"{base_url}/neuronpedia-datasets", "concurrency": 4,
            "requests_per_hour": 10_000_000, "max_attempts": 1, "backoff": 0.01, "max_failed_fraction": 0.5}


def night(settings: Settings, base_url: str, window: str, run_id: str, ranges: list[tuple[int, int]]) -> list[dict]:
    """One night as the nightly DAG runs it: fetch each chunk, ingest each unit as a part of the
    run (in order), then finish; returns the parts' summaries."""
    chunks = [chunk(base_url, window, a, b) for a, b in ranges]
    for c in chunks:
        fetch_chunk(c, settings)
    parts = [ingest_unit(u, settings, run_id=run_id).as_dict() for u in ingest_units(chunks, settings)]
    finish_fetched(window, settings, run_id=run_id)
    return parts


def run_row(settings: Settings, run_id: str) -> dict:
    with open_warehouse(settings.warehouse) as conn:
        (run,) = [r for r in recent_runs(conn, 100) if r["run_id"] == run_id]
    return run


def test_a_part_that_saw_only_duplicates_adds_its_counts_and_keeps_the_nights_verdict(tmp_path):
    """Night 1 loads features 10-19. Night 2 asks for 0-29 in three parts; the middle one
    (10-19, all landed the night before) runs after the first. Its counts are added to the
    night's, never written over them: the 20 new features and the broken record of feature 5
    stay in the run's row, so its verdict stays WARN."""
    settings = Settings.from_env(warehouse=tmp_path / "wh")
    served = pages(30)
    served[5]["activations"][0]["values"].pop()  # tokens and values of unequal length: quarantined
    with FakeNeuronpedia(pages=served) as np:
        night(settings, np.base_url, "w1", "night-1", [(10, 20)])
        parts = night(settings, np.base_url, "w2", "night-2", [(0, 10), (10, 20), (20, 30)])

    assert [p["n_duplicates"] for p in parts] == [0, 10, 0]
    run = run_row(settings, "night-2")
    assert {k: run[k] for k in COUNTS.split(", ")} == {
        "status": "succeeded", "n_received": 30, "n_duplicates": 10, "n_loaded": 20, "n_rejected": 0,
        "n_features": 20, "n_quarantined": 1}
    assert run["verdict"].level == "WARN" and "1 of 100 record(s) quarantined" in run["verdict"].reason, run["verdict"]
    assert query(settings, "SELECT count(*) FROM run_inputs WHERE run_id = 'night-2'") == [(30,)]


def closed_port() -> str:
    with socket.socket() as s:  # a loopback port nobody listens on: connecting is refused at once
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_status_shows_a_night_whose_fetch_failed_wholly_as_fail_with_its_fetch_failures(tmp_path):
    """The run itself succeeded (it loaded what landed: nothing), so its status is `succeeded`;
    the table must still say FAIL and how many URLs failed, as --format json does."""
    settings = Settings.from_env(warehouse=tmp_path / "wh")
    c = chunk(closed_port(), "w-down", 0, 3)
    with pytest.raises(FetchChunkFailed):
        fetch_chunk(c, settings)
    for u in ingest_units([c], settings):
        ingest_unit(u, settings, run_id="night-down")
    finish_fetched("w-down", settings, run_id="night-down")

    table = subprocess.run([str(FEATUREHOUSE), "status", "--warehouse", str(settings.warehouse)],
                           capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert table.returncode == 0, table.stderr
    header = next(ln for ln in table.stdout.splitlines() if "run_id" in ln)
    (row,) = [ln for ln in table.stdout.splitlines() if "night-down" in ln and "│" in ln]
    cells = dict(zip([h.strip() for h in header.split("│")], [c.strip() for c in row.split("│")]))
    assert (cells["status"], cells["verdict"], cells["fetch_failed"]) == ("succeeded", "FAIL", "3 of 3")
    assert cells["why"].startswith("3 of 3 URL(s) failed to fetch (all)")

    as_json = subprocess.run([str(FEATUREHOUSE), "status", "--warehouse", str(settings.warehouse), "--format", "json"],
                             capture_output=True, text=True, timeout=120, env=dict(os.environ))
    (run,) = json.loads(as_json.stdout)
    assert (run["status"], run["verdict"], run["n_fetch_failed"]) == ("succeeded", "FAIL", 3)


def test_finish_and_the_report_tell_the_nights_verdict_in_the_log_and_finish_returns_it(tmp_path, caplog):
    """A night that lost 2 of 10 URLs is WARN: finish returns the verdict beside its count of
    fetch failures and says it at WARNING, and so does judge_run (the report task's last
    line); a clean night is PASS, said at INFO."""
    import logging

    from pipeline.sources.fetch import judge_run
    from tests.fake_neuronpedia import feature_path

    settings = Settings.from_env(warehouse=tmp_path / "wh")
    with FakeNeuronpedia(pages=pages(20), always={feature_path(3): "503", feature_path(7): "503"}) as np:
        c, clean = chunk(np.base_url, "w-lossy", 0, 10), chunk(np.base_url, "w-clean", 10, 20)
        fetch_chunk(c, settings)
        fetch_chunk(clean, settings)
    for ch, run_id in ((c, "night-lossy"), (clean, "night-clean")):
        for u in ingest_units([ch], settings):
            ingest_unit(u, settings, run_id=run_id)
    with caplog.at_level(logging.INFO, "featurehouse"):
        finished = finish_fetched("w-lossy", settings, run_id="night-lossy")
        judged = judge_run(settings.warehouse, "night-lossy")
        clean_judged = finish_fetched("w-clean", settings, run_id="night-clean")
    assert finished["n_fetch_failures"] == 2 and finished["verdict"] == "WARN", finished
    assert "2 of 10 URL(s) failed to fetch" in finished["verdict_reason"]
    assert judged == {k: finished[k] for k in ("verdict", "verdict_reason")}
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "verdict" in r.getMessage()]
    assert said[:2] == [(logging.WARNING, f"run night-lossy: verdict WARN: {finished['verdict_reason']}")] * 2
    assert clean_judged["verdict"] == "PASS" and said[2][0] == logging.INFO and "night-clean: verdict PASS" in said[2][1]
