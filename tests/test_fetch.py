"""Fetching feature pages from a real HTTP server (tests/fake_neuronpedia.py) on 127.0.0.1:
faults retried, failures reported, rate limits obeyed, interrupted fetches resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.sources.fetch import fetch_features, ingest_fetched, manifest_path, read_manifest
from tests.fake_neuronpedia import FakeNeuronpedia, feature_path, random_faults
from tests.fetch_support import FAST, MODEL, SOURCE, pages, query, scalar, settings_in

ROOT = Path(__file__).resolve().parent.parent


def test_200_features_with_random_faults_all_land_exactly_once(tmp_path):
    n = 200
    paths = [feature_path(i) for i in range(n)]
    faults = random_faults(paths, 0.10, seed=7)
    assert len(faults) == 20
    assert {k for kinds in faults.values() for k in kinds} >= {"429", "drop", "truncate"}
    settings = settings_in(tmp_path)
    # the client's timeout well above a plain answer's time on a loaded machine (at FAST's 0.5 s, an
    # answer without a fault once took longer under the suite's load: asked twice), the slow fault
    # well above it
    with FakeNeuronpedia(pages=pages(n), faults=faults, retry_after="0", slow_seconds=3.0) as np:
        result = fetch_features(MODEL, SOURCE, range(n), settings=settings, base_url=np.base_url,
                                window="w-faults", concurrency=8, **{**FAST, "timeout": 1.5})
        for p in paths:  # each faulted URL: one request per fault, then the one that landed
            assert np.count(p) == len(faults.get(p, [])) + 1, p

    assert (result.n_requested, result.n_landed, result.n_failed, result.n_not_found) == (n, n, 0, 0)
    assert json.loads(json.dumps(result.as_dict()))["n_landed"] == n  # passes through XCom as is

    entries = read_manifest(manifest_path("w-faults", settings))
    assert len(entries) == n and {e["status"] for e in entries.values()} == {"landed"}
    assert max(e["attempts"] for e in entries.values()) == 3  # two faults in a row, then success

    summary = ingest_fetched("w-faults", settings, run_id="r1")
    assert summary.status == "succeeded" and summary.n_loaded == n and summary.n_rejected == 0
    assert scalar(settings, "SELECT count(*) FROM features") == n
    assert scalar(settings, "SELECT count(DISTINCT feature_index) FROM features") == n
    n_acts = sum(len(p["activations"]) for p in pages(n))
    assert query(settings, "SELECT count(*), count(DISTINCT activation_id) FROM activations") == [(n_acts, n_acts)]
    assert scalar(settings, "SELECT count(*) FROM explanations") == n
    assert scalar(settings, "SELECT count(*) FROM raw_inputs") == n
    assert scalar(settings, "SELECT count(*) FROM fetch_failures") == 0

    again = ingest_fetched("w-faults", settings, run_id="r2")  # loads nothing twice
    assert (again.n_loaded, again.n_duplicates) == (0, n)
    assert query(settings, "SELECT count(*), count(DISTINCT activation_id) FROM activations") == [(n_acts, n_acts)]


def test_feature_failing_every_attempt_is_reported_and_the_run_finishes(tmp_path):
    settings = settings_in(tmp_path)
    broken, missing = feature_path(3), feature_path(99)
    with FakeNeuronpedia(pages=pages(6), always={broken: "503"}) as np:
        out = CliRunner().invoke(cli, [
            "fetch", "features", "--model", MODEL, "--source", SOURCE, "--range", "0:6", "--index", "99",
            "--base-url", np.base_url, "--warehouse", str(settings.warehouse), "--window", "w-fail",
            "--max-attempts", "3", "--backoff", "0.01", "--requests-per-hour", "10000000", "--timeout", "2", "--no-progress",
        ])
        assert np.count(broken) == 3  # the whole budget was spent on it
        assert np.count(missing) == 1  # a 404 is not retried

    assert out.exit_code == 3, out.output
    assert f"{np.base_url}{broken}" in out.output
    assert "failed 1" in out.output and "not found 1" in out.output and "landed 5" in out.output
    assert "succeeded" in out.output
    rows = query(settings, "SELECT url, feature_key, status, attempts, last_error, \"window\" "
                           "FROM fetch_failures ORDER BY status")
    assert [(r[1], r[2], r[3], r[5]) for r in rows] == [
        (f"{MODEL}/{SOURCE}/3", "failed", 3, "w-fail"),
        (f"{MODEL}/{SOURCE}/99", "not_found", 1, "w-fail"),
    ]
    assert "503" in rows[0][4] and "not found" in rows[1][4]
    assert scalar(settings, "SELECT count(*) FROM features") == 5
    assert scalar(settings, "SELECT status FROM runs") == "succeeded"

    # Once the server recovers, the same window fetches only what did not land, and exits 0.
    with FakeNeuronpedia(pages=pages(6)) as np:
        out = CliRunner().invoke(cli, [
            "fetch", "features", "--model", MODEL, "--source", SOURCE, "--range", "0:6",
            "--base-url", np.base_url, "--warehouse", str(settings.warehouse), "--window", "w-fail",
            "--backoff", "0.01", "--requests-per-hour", "10000000", "--no-progress",
        ])
        assert [r.path for r in np.requests] == [broken]
    assert out.exit_code == 0, out.output
    assert scalar(settings, "SELECT count(*) FROM features") == 6


def test_404_is_feature_not_found_and_exit_code_zero(tmp_path):
    settings = settings_in(tmp_path)
    with FakeNeuronpedia(pages=pages(2)) as np:
        out = CliRunner().invoke(cli, [
            "fetch", "features", "--model", MODEL, "--source", SOURCE, "--index", "1", "--index", "5",
            "--base-url", np.base_url, "--warehouse", str(settings.warehouse), "--no-progress",
        ])
    assert out.exit_code == 0, out.output
    assert "not found 1" in out.output
    assert query(settings, "SELECT feature_key, status FROM fetch_failures") == [(f"{MODEL}/{SOURCE}/5", "not_found")]


def test_retry_after_is_honoured(tmp_path):
    settings = settings_in(tmp_path)
    p = feature_path(0)
    with FakeNeuronpedia(pages=pages(1), faults={p: ["429"]}, retry_after="1") as np:
        result = fetch_features(MODEL, SOURCE, [0], settings=settings, base_url=np.base_url, **FAST)
        first, second = np.seen(p)
    assert result.n_landed == 1
    assert first.answer == "429"
    assert second.at - first.at >= 0.95  # the 0.01 s backoff was overridden by Retry-After: 1


def test_slows_down_as_x_limit_remaining_nears_zero(tmp_path):
    def gaps(limit_remaining):
        with FakeNeuronpedia(pages=pages(6), limit_remaining=limit_remaining) as np:
            fetch_features(MODEL, SOURCE, range(6), settings=settings_in(tmp_path / str(limit_remaining)),
                           base_url=np.base_url, concurrency=1, **(FAST | {"max_backoff": 1.0}))
            times = [r.at for r in np.requests]
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    # x-limit-remaining 9, 8, ... of LOW_WATER 50: each next request waits about 1.0 * (1 - r/50),
    # 0.82-0.92 s; unthrottled, a gap is the landing of a page (one took 0.36 s in a loaded suite,
    # when the bound here was 0.3 with a 0.4 s backoff)
    assert min(gaps(10)) >= 0.75
    assert max(gaps(None)) < 0.75


def test_requests_per_hour_budget_is_kept(tmp_path):
    with FakeNeuronpedia(pages=pages(11)) as np:
        fetch_features(MODEL, SOURCE, range(11), settings=settings_in(tmp_path), base_url=np.base_url,
                       concurrency=1, **(FAST | {"requests_per_hour": 36_000}))  # 10 a second
        times = [r.at for r in np.requests]
    assert times[-1] - times[0] >= 0.9  # one token to start with, then one every 0.1 s


def test_all_features_pages_through_features_offset(tmp_path):
    settings = settings_in(tmp_path)
    ps = pages(60)
    for p in ps[::12]:
        p["maxActApprox"] = 0  # features-offset lists only features with activations
    active = sorted(int(p["index"]) for p in ps if p["maxActApprox"] > 0)
    with FakeNeuronpedia(pages=ps, faults={"/api/features-offset@25": ["503", "drop"]}) as np:
        result = fetch_features(MODEL, SOURCE, all_features=True, settings=settings, base_url=np.base_url,
                                window="w-all", concurrency=2, **FAST)
        offsets = [json.loads(r.body)["offset"] for r in np.seen("/api/features-offset")]
        assert sorted(set(offsets)) == [0, 25, 50, 75]  # 55 features: pages of 25, 25, 5 -> stop
        assert offsets.count(25) == 3
        assert result.n_landed == 3 and result.n_failed == 0
        before = np.count()
        again = fetch_features(MODEL, SOURCE, all_features=True, settings=settings, base_url=np.base_url,
                               window="w-all", concurrency=2, **FAST)
        assert np.count() == before  # everything already landed in this window
        assert again.n_skipped_already_landed == 4
    ingest_fetched("w-all", settings)
    assert [r[0] for r in query(settings, "SELECT feature_index FROM features ORDER BY 1")] == active


def _manifest_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def test_killed_fetch_resumes_without_refetching_or_duplicates(tmp_path):
    n = 80
    settings = settings_in(tmp_path)
    manifest = manifest_path("w-kill", settings)
    with FakeNeuronpedia(pages=pages(n), latency=0.05) as np:
        args = [sys.executable, "-m", "pipeline.cli", "fetch", "features", "--model", MODEL, "--source", SOURCE,
                "--range", f"0:{n}", "--base-url", np.base_url, "--warehouse", str(settings.warehouse),
                "--window", "w-kill", "--concurrency", "2", "--backoff", "0.01", "--requests-per-hour", "10000000", "--no-progress"]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while len(_manifest_lines(manifest)) < 20 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        landed_before = {e["url"] for e in _manifest_lines(manifest) if e["status"] == "landed"}
        assert 20 <= len(landed_before) < n, "the fetch was not interrupted part-way"
        assert not (settings.warehouse / "catalog.sqlite").exists() or scalar(settings, "SELECT count(*) FROM features") == 0

        np.latency = 0.0
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"already landed {len(landed_before)}" in done.stdout
        for url in landed_before:  # what landed before the kill was not asked for again
            assert np.count(url.removeprefix(np.base_url)) == 1, url
        assert np.count(prefix="/api/feature/") <= n + 2  # at most the two in flight when killed

    assert scalar(settings, "SELECT count(*) FROM features") == n
    n_acts = sum(len(p["activations"]) for p in pages(n))
    assert query(settings, "SELECT count(*), count(DISTINCT activation_id) FROM activations") == [(n_acts, n_acts)]
    assert scalar(settings, "SELECT count(*) FROM raw_inputs") == n


def test_fetch_needs_indices_or_all():
    with pytest.raises(ValueError):
        fetch_features(MODEL, SOURCE)
    with pytest.raises(ValueError):
        fetch_features(MODEL, SOURCE, [1], all_features=True)
    out = CliRunner().invoke(cli, ["fetch", "features", "--model", MODEL, "--source", SOURCE])
    assert out.exit_code == 2 and "--index" in out.output
    out = CliRunner().invoke(cli, ["fetch", "features", "--model", MODEL, "--source", SOURCE, "--range", "5:2"])
    assert out.exit_code == 2 and "A:B" in out.output


def test_window_cannot_escape_the_manifest_folder(tmp_path):
    with pytest.raises(ValueError):
        manifest_path("../elsewhere", settings_in(tmp_path))


def test_ctrl_c_during_a_long_retry_after_stops_promptly_and_says_how_to_resume(tmp_path):
    settings = settings_in(tmp_path)
    paths = [feature_path(i) for i in range(4)]
    with FakeNeuronpedia(pages=pages(4), always={p: "429" for p in paths}, retry_after="30") as np:
        args = [sys.executable, "-m", "pipeline.cli", "fetch", "features", "--model", MODEL, "--source", SOURCE,
                "--range", "0:4", "--base-url", np.base_url, "--warehouse", str(settings.warehouse),
                "--window", "w-int", "--no-progress"]
        # A shell that starts a job in the background (as CI may) ignores SIGINT in it, and Python
        # keeps an inherited "ignore": give the child the default a terminal's Ctrl-C finds.
        proc = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 60
        while np.count() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # now every worker waits out the 30 s Retry-After
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=20)
    assert time.monotonic() - interrupted < 5  # did not sit out the 30 s
    assert proc.returncode == 130, stdout + stderr
    assert "--window w-int" in stderr
    assert read_manifest(manifest_path("w-int", settings)) == {}  # nothing recorded as failed


def test_fetch_reads_the_base_url_from_the_environment_and_gives_a_verdict_and_json(tmp_path):
    """Issue 45: `fetch features` printed no verdict line, had no --format json or --strict, and
    ignored NEURONPEDIA_BASE_URL (the DAGs read it)."""
    settings = settings_in(tmp_path)
    lost = feature_path(3)
    with FakeNeuronpedia(pages=pages(4), always={lost: "503"}) as np:
        env = dict(os.environ, PYTHONPATH=str(ROOT), NEURONPEDIA_BASE_URL=np.base_url)
        args = [sys.executable, "-m", "pipeline.cli", "fetch", "features", "--model", MODEL, "--source", SOURCE,
                "--range", "0:4", "--warehouse", str(settings.warehouse), "--no-progress", "--max-attempts", "2",
                "--backoff", "0.01", "--requests-per-hour", "10000000"]
        table = subprocess.run(args + ["--window", "w-env"], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=120)
        assert table.returncode == 3, table.stdout + table.stderr
        assert "  verdict  WARN: 1 of 4 URL(s) failed to fetch" in table.stdout
        as_json = subprocess.run(args + ["--window", "w-env2", "--format", "json"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=120)
    assert as_json.returncode == 3, as_json.stderr
    out = json.loads(as_json.stdout)
    assert out["verdict"] == "WARN" and out["fetch"]["n_failed"] == 1 and out["fetch"]["failures"][0]["url"].endswith("/3")


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_fetch_strict_exits_4_when_the_verdict_is_fail_even_with_urls_lost(tmp_path, fmt):
    """docs/fetching.md: with --strict, 4 when the verdict is FAIL; 3 (URLs lost) came first."""
    settings = settings_in(tmp_path)
    with FakeNeuronpedia(pages=pages(4), always={feature_path(1): "503", feature_path(3): "503"}) as np:
        env = dict(os.environ, PYTHONPATH=str(ROOT), NEURONPEDIA_BASE_URL=np.base_url)
        args = [sys.executable, "-m", "pipeline.cli", "fetch", "features", "--model", MODEL, "--source", SOURCE,
                "--index", "1", "--index", "3", "--warehouse", str(settings.warehouse), "--no-progress",
                "--max-attempts", "1", "--requests-per-hour", "10000000", "--format", fmt]
        strict = subprocess.run(args + ["--strict"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        lax = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert strict.returncode == 4, strict.stdout + strict.stderr
    assert "FAIL" in strict.stdout
    assert lax.returncode == 3, lax.stdout + lax.stderr


@pytest.mark.parametrize("wait", ["trickle", "retry_after"])
def test_a_slow_answer_or_a_retry_after_wait_still_logs_progress(tmp_path, caplog, monkeypatch, wait):
    """Issue 45: progress was logged only when a URL finished, so a page trickling in for 70 s
    (or a Retry-After wait) left the task's log silent; now a line comes at least every
    LOG_EVERY seconds, saying what is done and what is in flight, and stops with the fetch."""
    import logging
    import threading

    from pipeline.sources import fetch as fetch_mod

    monkeypatch.setattr(fetch_mod, "LOG_EVERY", 0.3)
    slow = feature_path(1)
    kw = ({"always": {slow: "trickle"}, "trickle_seconds": 1.5} if wait == "trickle"
          else {"faults": {slow: ["429"]}, "retry_after": "2"})
    with FakeNeuronpedia(pages=pages(3), **kw) as np, caplog.at_level(logging.INFO, "featurehouse.fetch"):
        result = fetch_features(MODEL, SOURCE, range(3), settings=settings_in(tmp_path), base_url=np.base_url,
                                window="w-slow", concurrency=1, max_attempts=2,
                                **FAST | {"timeout": 5})
        url = np.base_url + slow
    assert result.n_landed == 3
    lines = [r.getMessage() for r in caplog.records if " done in " in r.getMessage()]
    waiting = [m for m in lines if "1 in flight, the longest for" in m and m.endswith(url)]
    assert len(waiting) >= 3, lines  # ~1.5 s of waiting, a line every 0.3 s
    assert "1 of 3 done" in waiting[0], waiting
    assert not [t for t in threading.enumerate() if t.name == "fetch-progress"]  # stopped with the fetch
