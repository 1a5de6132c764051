"""Two batches in hand (issue 18, item 2): a loader thread writes and commits batch k while the
main thread lands, reads and validates batch k + 1 on a second DuckDB connection. The loads
commit one at a time in batch order; the run's counts stored at each commit are those of the
batches committed; a load that fails stops the run before any later batch commits.

The overlap is forced, not hoped for: the first batch's load waits (in the loader thread) until
the second batch has been read and staged; run one batch after the other, that wait would time
out and the test fails.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
from datetime import datetime, timedelta

import pytest

from pipeline.config import Settings
from pipeline.lake import warehouse as wh
from tests.conftest import good_page, open_warehouse, query, run_ingest, write
from tests.formats import to_api_json

# where the run looks them up: claim_captures in the chain (run), prewrite in the loader thread (loading)
run_module = importlib.import_module("pipeline.ingest.run")
loading_module = importlib.import_module("pipeline.ingest.loading")


def _pages(folder, n: int) -> list:
    return [write(folder / f"p{i}.json", to_api_json(good_page(i, source="overlap-src"))) for i in range(n)]


def _one_page_batches(tmp_path) -> Settings:
    return Settings(warehouse=tmp_path / "wh", batch_bytes=1)  # every page is a batch of its own


def _hold_first_load(monkeypatch) -> dict:
    """Batch 1's load waits until batch 2 is staged (``claim_captures`` ran for it); says whether
    it came, and in which threads the loads and the staging ran."""
    seen = {"staged": threading.Event(), "came": None, "claims": 0, "load_threads": [], "stage_threads": []}
    real_claim, real_prewrite = run_module.claim_captures, loading_module.prewrite

    def claim(conn):
        out = real_claim(conn)
        seen["claims"] += 1
        seen["stage_threads"].append(threading.current_thread().name)
        if seen["claims"] == 2:
            seen["staged"].set()
        return out

    def prewrite(conn, *args, **kw):
        seen["load_threads"].append(threading.current_thread().name)
        if seen["came"] is None:
            seen["came"] = seen["staged"].wait(30)
        return real_prewrite(conn, *args, **kw)

    monkeypatch.setattr(run_module, "claim_captures", claim)
    monkeypatch.setattr(loading_module, "prewrite", prewrite)
    return seen


def test_the_next_batch_is_read_and_staged_while_the_batch_before_it_loads(tmp_path, monkeypatch):
    settings = _one_page_batches(tmp_path)
    seen = _hold_first_load(monkeypatch)
    summary = run_ingest(_pages(tmp_path / "in", 3), settings)
    assert seen["came"] is True, "batch 2 was not staged while batch 1 loaded"
    assert all(name.startswith("load") for name in seen["load_threads"]) and len(seen["load_threads"]) == 3
    assert set(seen["stage_threads"]) == {"MainThread"}
    assert summary.status == "succeeded" and (summary.n_loaded, summary.n_features) == (3, 3)
    assert query(settings, "SELECT count(*) FROM features")[0][0] == 3
    # one commit a batch, in batch order
    messages = [m for (m,) in query(settings, "SELECT commit_message FROM featurehouse.snapshots() "
                                              "WHERE commit_message LIKE '%batch%' ORDER BY snapshot_id")]
    assert messages == [f"run {summary.run_id} batch {k}" for k in (1, 2, 3)]


def test_the_counts_stored_at_each_commit_are_those_of_the_batches_committed(tmp_path, monkeypatch):
    """Batch 2 is read (its page counted as loaded) before batch 1 commits: batch 1's commit must
    still store the counts of batch 1 alone, as a reader of the runs table sees them then."""
    settings = _one_page_batches(tmp_path)
    seen = _hold_first_load(monkeypatch)
    summary = run_ingest(_pages(tmp_path / "in", 3), settings)
    assert seen["came"] is True
    with open_warehouse(settings) as conn:
        snaps = conn.execute("SELECT snapshot_id FROM featurehouse.snapshots() WHERE commit_message LIKE '%batch%' "
                             "ORDER BY snapshot_id").fetchall()
        assert len(snaps) == 3
        for k, (snap,) in enumerate(snaps, start=1):
            at = f"AT (VERSION => {int(snap)})"
            stored = conn.execute(f"SELECT n_loaded, n_features, n_activations FROM runs {at} WHERE run_id = ?",
                                  [summary.run_id]).fetchone()
            actual = (
                conn.execute(f"SELECT count(*) FROM run_inputs {at} WHERE outcome = 'loaded'").fetchone()[0],
                conn.execute(f"SELECT count(*) FROM features {at}").fetchone()[0],
                conn.execute(f"SELECT count(*) FROM activations {at}").fetchone()[0],
            )
            assert stored == actual and actual[0] == k, (k, stored, actual)


def test_a_load_that_fails_stops_the_run_before_any_later_batch_commits(tmp_path, monkeypatch):
    settings = _one_page_batches(tmp_path)
    real_prewrite, calls = loading_module.prewrite, []

    def prewrite(conn, *args, **kw):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            raise OSError("the data folder went away (test)")
        return real_prewrite(conn, *args, **kw)

    monkeypatch.setattr(loading_module, "prewrite", prewrite)
    with pytest.raises(OSError, match="went away") as err:
        run_ingest(_pages(tmp_path / "in", 5), settings)
    assert any("recorded as failed" in note for note in getattr(err.value, "__notes__", []))
    assert len(calls) == 2  # batch 3 was never handed to the loader
    assert query(settings, "SELECT count(*) FROM features")[0][0] == 1  # batch 1 only
    status, error, n_features = query(settings, "SELECT status, error, n_features FROM runs")[0]
    assert status == "failed" and "went away" in error and n_features == 1
    # nothing half-done: a later run loads the rest
    again = run_ingest(_pages(tmp_path / "in", 5), Settings(warehouse=settings.warehouse))
    assert again.status == "succeeded"
    assert query(settings, "SELECT count(*) FROM features")[0][0] == 5


def test_a_copy_with_a_newer_capture_decides_against_the_batch_loading_before_it(tmp_path, monkeypatch):
    """A page's bytes come again in the next batch with a newer capture time: that decision reads
    what is committed, so it waits for the batch loading (which holds the first copy)."""
    settings = _one_page_batches(tmp_path)
    data = to_api_json(good_page(1, source="overlap-src"))
    older, newer = datetime(2026, 1, 1), datetime(2026, 6, 1)
    first = write(tmp_path / "in" / "a.json", data)
    second = write(tmp_path / "in" / "b.json", data)
    os.utime(first, (older.timestamp(), older.timestamp()))
    os.utime(second, (newer.timestamp(), newer.timestamp()))
    summary = run_ingest([first, second], settings)
    assert summary.status == "succeeded"
    ((captured,),) = query(settings, "SELECT captured_at FROM raw_inputs")
    assert abs(captured - newer) < timedelta(seconds=1)
    ((captured,),) = query(settings, "SELECT captured_at FROM feature_captures WHERE table_name = 'features'")
    assert abs(captured - newer) < timedelta(seconds=1)


def test_an_ingest_inside_the_callers_commit_lock_loads_in_the_callers_thread(tmp_path):
    """The commit lock is re-entrant in the thread holding it only: an ingest called with it held
    loads in that thread (a loader thread would wait for it for ever)."""
    settings = _one_page_batches(tmp_path)
    run_ingest([write(tmp_path / "a" / "p.json", to_api_json(good_page(9, source="overlap-src")))], settings)
    with wh.write_lock(settings):
        summary = run_ingest(_pages(tmp_path / "b", 3), settings)
    assert summary.status == "succeeded" and summary.n_features == 3


def test_a_lock_another_thread_holds_is_waited_for_as_long_as_the_lock_timeout_says(tmp_path):
    settings = Settings(warehouse=tmp_path / "wh", lock_timeout=1.0)
    run_ingest(_pages(tmp_path / "a", 1), settings)
    held, release = threading.Event(), threading.Event()

    def hold():
        with wh.write_lock(settings):
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(30)
        with pytest.raises(TimeoutError, match="another thread of this process holds it"), wh.write_lock(settings):
            pass
    finally:
        release.set()
        holder.join(30)
    with wh.write_lock(settings):  # free again
        assert wh.holds_write_lock(settings)
    assert not wh.holds_write_lock(settings)


def test_an_interrupt_while_a_batch_loads_waits_for_its_commit_then_records_the_run_failed(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) in the main thread while the loader commits batch 1: the run is
    recorded as failed only after that commit (both share a connection), and counts what it
    committed."""
    settings = _one_page_batches(tmp_path)
    real_claim, real_prewrite, claims = run_module.claim_captures, loading_module.prewrite, []
    loading = threading.Event()

    def prewrite(conn, *args, **kw):
        loading.set()
        threading.Event().wait(1.0)  # a load that takes a while
        return real_prewrite(conn, *args, **kw)

    def claim(conn):
        claims.append(1)
        if len(claims) == 2:
            assert loading.wait(30)
            raise KeyboardInterrupt
        return real_claim(conn)

    monkeypatch.setattr(run_module, "claim_captures", claim)
    monkeypatch.setattr(loading_module, "prewrite", prewrite)
    with pytest.raises(KeyboardInterrupt):
        run_ingest(_pages(tmp_path / "in", 4), settings)
    status, n_features = query(settings, "SELECT status, n_features FROM runs")[0]
    assert status == "failed" and n_features == 1
    assert query(settings, "SELECT count(*) FROM features")[0][0] == 1


def test_a_signal_while_a_committed_batch_is_counted_counts_it_once(tmp_path, monkeypatch):
    """SIGINT arrives in the main thread while it adds a committed batch's counts to the run's
    (between two of them): the signal waits until all are added, so the part of a night recorded
    as failed stores that batch's counts whole, once (a part stores its counts as it ends).
    Without it, the counts after the signal were lost, or, had the batch been counted again,
    doubled."""
    import signal

    from pipeline.lake.runstate import RunSummary

    settings = _one_page_batches(tmp_path)
    real_setattr, sent = RunSummary.__setattr__, []

    def setattr_(self, name, value):
        real_setattr(self, name, value)
        if name == "n_activations" and value and not sent:  # the first batch's first count
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(RunSummary, "__setattr__", setattr_)
    # Python raises KeyboardInterrupt on SIGINT only if the process did not inherit SIGINT
    # ignored, which a shell gives the jobs it starts in the background (as CI may): the
    # handler Python installs by default, for this test
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_ingest(_pages(tmp_path / "in", 3), settings, run_id="run-signal", part=0)
    finally:
        signal.signal(signal.SIGINT, before)
    assert sent
    row = query(settings, "SELECT status, n_features, n_activations, n_quarantined, n_expectations FROM runs")[0]
    committed = (query(settings, "SELECT count(*) FROM features")[0][0],
                 query(settings, "SELECT count(*) FROM activations")[0][0],
                 query(settings, "SELECT count(*) FROM quarantine")[0][0],
                 query(settings, "SELECT count(*) FROM validation_results")[0][0])
    assert row == ("failed", *committed) and committed[0] >= 1, (row, committed)


def test_duckdbs_allocator_gets_one_arena_unless_the_user_configured_it():
    """Set by the package before duckdb's first import (jemalloc reads it once): the loader
    thread then reuses what the main thread's read freed. A value the user set is kept."""
    code = "import os, pipeline, duckdb; print(os.environ.get('DUCKDB_JE_MALLOC_CONF'))"
    env = {k: v for k, v in os.environ.items() if k != "DUCKDB_JE_MALLOC_CONF"}
    ours = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert ours.stdout.strip() == "narenas:1"
    theirs = subprocess.run([sys.executable, "-c", code], env=env | {"DUCKDB_JE_MALLOC_CONF": "narenas:4"},
                            capture_output=True, text=True, check=True)
    assert theirs.stdout.strip() == "narenas:4"
