"""Commits are metadata (issue 18, item 1): a batch's rows are written as Parquet files before
the commit lock is taken, and the locked commit adds those files to the catalog. When another
writer's commit changed, in between, what the batch loads, the commit decides again and writes
what loads itself; the file written for the old decision is removed. A writer killed before its
commit leaves no visible rows, only an unreferenced file that `maintain` deletes.

The races are made with the real commit lock: this process holds it (it is an OS lock, and
re-entrant within a process) while a `featurehouse ingest` in another process writes its files
and waits for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from pipeline.config import Settings
from pipeline.lake import warehouse as wh
from tests.conftest import good_page, open_warehouse, query, run_ingest, write
from tests.formats import to_api_json

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")


def _page(description: str, when: datetime, folder: Path, scale: float = 1.0, edit=None) -> Path:
    """A capture of feature 7 taken at ``when``: its values times ``scale`` (other statistics),
    then changed by ``edit(page)`` if given."""
    page = good_page(7, source="race-src")
    page["explanations"][0]["description"] = description
    for a in page["activations"]:
        a["values"] = [v * scale for v in a["values"]]
        a["maxValue"], a["minValue"] = a["maxValue"] * scale, a["minValue"] * scale
    if edit is not None:
        edit(page)
    path = write(folder / "page.json", to_api_json(page))
    os.utime(path, (when.timestamp(), when.timestamp()))
    return path


def _ours(wh_dir: Path) -> set[str]:
    """The data files featurehouse wrote before a commit (DuckLake's own are ducklake-*)."""
    return {p.name for p in (wh_dir / "data").rglob("featurehouse-*.parquet")}


def _registered(settings: Settings) -> set[str]:
    """Every data file the catalog records, current or kept for history."""
    rows = query(settings.warehouse, "SELECT path FROM __ducklake_metadata_featurehouse.ducklake_data_file")
    return {Path(f).name for (f,) in rows}


def _wait_for(predicate, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _start(path: Path, settings: Settings) -> subprocess.Popen:
    return subprocess.Popen([str(FEATUREHOUSE), "ingest", str(path), "--warehouse", str(settings.warehouse),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@contextlib.contextmanager
def _lock_once_running(settings: Settings, proc: subprocess.Popen, runs: int = 1):
    """Take the commit lock as soon as the other processes' ``runs`` runs are recorded (each takes
    the lock to open the warehouse and to record its run; then not until its batch's commit,
    seconds later: it lands, parses and validates first). Taken when only one of two had
    recorded its run, the other waited for the lock the test held (the suite's CI, loaded).
    Looked for through one connection held open (each look ~10 ms; DuckLake reads the newest
    snapshot at each statement): with a connection opened a look (~0.4 CPU-s, ~1 s loaded) the
    writer went from its recorded run to its commit between two looks on the suite's loaded run
    (2026-12-07), and the test killed a writer that had already committed."""
    with open_warehouse(settings) as conn:
        def running() -> bool:
            return conn.execute("SELECT count(*) FROM runs WHERE status = 'running'").fetchone()[0] >= runs

        _wait_for(running, 120, proc)
    with wh.write_lock(settings):
        yield


def test_a_load_adds_the_files_it_wrote_and_leaves_none_behind(tmp_path):
    settings = Settings(warehouse=tmp_path / "wh")
    for i, when in enumerate((datetime(2026, 1, 1), datetime(2026, 2, 1))):
        run_ingest([_page(f"v{i}", when, tmp_path / f"in{i}")], settings)
    ours = _ours(settings.warehouse)
    # each load's three data tables came from the files written before its commit (the first
    # load's files are kept for the history, until maintain expires it)
    assert len(ours) == 6 and ours <= _registered(settings), (ours, _registered(settings))
    assert query(settings.warehouse, "SELECT description FROM explanations") == [("v1",)]
    assert query(settings.warehouse, "SELECT count(*) FROM activations") == [(3,)]


def test_a_commit_between_the_write_and_the_commit_changes_the_decision_and_nothing_is_lost(tmp_path):
    """The other process writes its files for 'load v1' and waits for the lock; meanwhile a
    newer capture v2 is committed here. Its commit must decide again: v1 is older, so it is
    recorded as superseded and its files are not added (and are removed)."""
    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([_page("v0", datetime(2025, 12, 1), tmp_path / "in0")], settings)  # the lake exists
    before = _ours(settings.warehouse)
    proc = _start(_page("v1", datetime(2026, 1, 1), tmp_path / "in1"), settings)
    with _lock_once_running(settings, proc):
        _wait_for(lambda: len(_ours(settings.warehouse) - before) == 3, 120, proc)
        written = _ours(settings.warehouse) - before
        run_ingest([_page("v2", datetime(2026, 2, 1), tmp_path / "in2")], settings)  # the lock is ours
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert query(settings.warehouse, "SELECT description FROM explanations") == [("v2",)]
    assert query(settings.warehouse, "SELECT count(*) FROM activations") == [(3,)]
    superseded = query(settings.warehouse, "SELECT DISTINCT reason FROM superseded")
    assert superseded == [("older than the capture already loaded",)]
    assert not written & _registered(settings), "the files written for v1 were not added"
    assert not written & _ours(settings.warehouse), "and they are gone"
    assert _ours(settings.warehouse) <= _registered(settings)


def test_a_writer_killed_before_its_commit_leaves_no_rows_and_maintain_deletes_its_files(tmp_path):
    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([_page("v0", datetime(2025, 12, 1), tmp_path / "in0")], settings)
    before = _ours(settings.warehouse)
    proc = _start(_page("v1", datetime(2026, 1, 1), tmp_path / "in1"), settings)
    with _lock_once_running(settings, proc):
        _wait_for(lambda: len(_ours(settings.warehouse) - before) == 3, 120, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    orphans = _ours(settings.warehouse) - before
    assert len(orphans) == 3 and not orphans & _registered(settings)
    assert query(settings.warehouse, "SELECT description FROM explanations") == [("v0",)]
    r = subprocess.run([str(FEATUREHOUSE), "maintain", "--warehouse", str(settings.warehouse), "--grace-minutes", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not orphans & _ours(settings.warehouse), "maintain deleted the files no commit added"
    assert query(settings.warehouse, "SELECT description FROM explanations") == [("v0",)]


@contextlib.contextmanager
def _v1_waiting_with_its_files(settings: Settings, tmp_path: Path):
    """v0 loaded; another process's ingest of v1 has written its three files and waits for the
    commit lock, which this process holds inside the block. Yields (that process, its files)."""
    run_ingest([_page("v0", datetime(2025, 12, 1), tmp_path / "in0")], settings)
    before = _ours(settings.warehouse)
    proc = _start(_page("v1", datetime(2026, 1, 1), tmp_path / "in1"), settings)
    with _lock_once_running(settings, proc):
        _wait_for(lambda: len(_ours(settings.warehouse) - before) == 3, 120, proc)
        yield proc, _ours(settings.warehouse) - before


def test_maintain_keeps_the_files_of_a_writer_waiting_for_the_lock(tmp_path):
    """Issue 41 item 2: a writer with its files written, waiting for the commit lock, met
    `maintain --grace-minutes 0`, which deleted them as orphans; its commit then failed ("No
    files found"). Its run is running: its files are not orphans, whatever the grace."""
    from datetime import timedelta

    from pipeline.lake.maintain import maintain

    settings = Settings(warehouse=tmp_path / "wh")
    with _v1_waiting_with_its_files(settings, tmp_path) as (proc, pending):
        maintain(settings, grace=timedelta(0))  # the lock is re-entrant in this process
        assert pending <= _ours(settings.warehouse), "maintain deleted a live writer's files"
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert query(settings.warehouse, "SELECT description FROM explanations") == [("v1",)]
    assert pending <= _registered(settings)
    # once the writer is done, what is unreferenced goes as before
    r = subprocess.run([str(FEATUREHOUSE), "maintain", "--warehouse", str(settings.warehouse), "--grace-minutes", "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "deletes nothing this time" not in r.stderr, r.stderr


def test_a_commit_whose_files_vanished_writes_its_rows_under_the_lock(tmp_path):
    """The other half of item 2: whatever took the files (a hand, an older maintain), the
    commit writes the rows itself instead of failing with a traceback."""
    settings = Settings(warehouse=tmp_path / "wh")
    with _v1_waiting_with_its_files(settings, tmp_path) as (proc, pending):
        for p in (settings.warehouse / "data").rglob("featurehouse-*.parquet"):
            if p.name in pending:
                p.unlink()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert query(settings.warehouse, "SELECT description FROM explanations") == [("v1",)]
    assert query(settings.warehouse, "SELECT count(*) FROM activations") == [(3,)]
    assert not pending & _registered(settings)


def test_a_retime_decided_before_the_lock_is_decided_again_under_it(tmp_path):
    """Issue 41 item 1: bytes X loaded as captured in January come again dated April; the writer
    decides "only move the capture time" before the lock. Meanwhile Y, a capture of the same
    feature dated March, commits. The retime, committed as decided, kept Y@March in every table
    (and raw_inputs said April: re-running X changed nothing). Decided again under the lock, X is
    read again and, the newest capture, loads: as one writer in capture order gives."""
    import threading

    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([_page("x", datetime(2026, 1, 1), tmp_path / "jan")], settings)
    x_apr = _page("x", datetime(2026, 4, 1), tmp_path / "apr")
    # and a page of another feature, new: the batch loads it too (its checks keep the writer
    # busy a few seconds between its decision and its commit)
    write(tmp_path / "apr" / "other.json", to_api_json(good_page(8, source="race-src")))
    proc = subprocess.Popen([str(FEATUREHOUSE), "-v", "ingest", str(tmp_path / "apr"),
                             "--warehouse", str(settings.warehouse), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)
    reader.start()
    # the lock taken as soon as the writer says its decision (a file lock: at once), not once a
    # look at the warehouse (a connection each, ~0.4 CPU-s) saw it running: on the suite's loaded
    # CI the writer decided and committed in 3.7 s before those looks saw it
    _wait_for(lambda: any("only the time moves" in line for line in said), 120, proc)
    with wh.write_lock(settings):
        assert proc.poll() is None, "".join(said)
        x_sha = hashlib.sha256(x_apr.read_bytes()).hexdigest()
        # its retime not committed yet: the race this test is about is on
        assert query(settings.warehouse, "SELECT captured_at FROM raw_inputs WHERE input_sha256 = ?",
                     [x_sha]) == [(datetime(2026, 1, 1),)]
        run_ingest([_page("y", datetime(2026, 3, 1), tmp_path / "mar")], settings)  # the lock is ours
        assert query(settings.warehouse, "SELECT description FROM explanations WHERE feature_index = 7") == [("y",)]
    out = proc.stdout.read()
    proc.wait(timeout=300)
    reader.join(10)
    assert proc.returncode == 0, out + "".join(said)
    # as one writer in capture order: X (April) is the loaded capture, in every table
    assert query(settings.warehouse, "SELECT description FROM explanations WHERE feature_index = 7") == [("x",)]
    x_sha = hashlib.sha256(x_apr.read_bytes()).hexdigest()
    held = query(settings.warehouse, "SELECT DISTINCT input_sha256, captured_at FROM feature_captures "
                 "WHERE feature_index = 7")
    assert held == [(x_sha, datetime(2026, 4, 1))], held
    assert query(settings.warehouse, "SELECT DISTINCT input_sha256 FROM activations WHERE feature_index = 7") == [(x_sha,)]
    assert query(settings.warehouse, "SELECT count(*) FROM features") == [(2,)]
    assert query(settings.warehouse, "SELECT captured_at FROM raw_inputs WHERE input_sha256 = ?",
                 [x_sha]) == [(datetime(2026, 4, 1),)]
    # the run recorded X once, as read, not as a duplicate
    last = query(settings.warehouse, "SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 1")
    outcomes = query(settings.warehouse, "SELECT outcome FROM run_inputs WHERE input_sha256 = ? AND run_id <> "
                     "(SELECT run_id FROM runs ORDER BY started_at LIMIT 1) AND run_id <> ?", [x_sha, last[0][0]])
    assert ("duplicate",) not in outcomes, outcomes


def test_two_writers_of_one_file_at_once_record_what_is_held(tmp_path):
    """Issue 41 item 4: two ingests of the same file at once. The first to commit loads its rows;
    the second, deciding again under the lock, loads none of them (they are there) and recorded
    its raw_inputs row as 'loaded' with 0 features and activations while they were held. Its
    counts are what the tables hold of it."""
    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([_page("v0", datetime(2025, 12, 1), tmp_path / "in0")], settings)  # the lake exists
    before = _ours(settings.warehouse)
    page = _page("v1", datetime(2026, 1, 1), tmp_path / "in1")
    first, second = _start(page, settings), _start(page, settings)
    with _lock_once_running(settings, first, runs=2):
        _wait_for(lambda: len(_ours(settings.warehouse) - before) == 6, 300, first)  # both wrote theirs
    for proc in (first, second):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out + err
    sha = hashlib.sha256(page.read_bytes()).hexdigest()
    held = query(settings.warehouse, "SELECT (SELECT count(*) FROM features WHERE input_sha256 = $s), "
                 "(SELECT count(*) FROM activations WHERE input_sha256 = $s), "
                 "(SELECT count(*) FROM explanations WHERE input_sha256 = $s)", {"s": sha})
    assert held == [(1, 3, 1)]
    assert query(settings.warehouse, "SELECT status, n_features, n_activations, n_explanations FROM raw_inputs "
                 "WHERE input_sha256 = ?", [sha]) == [("loaded", 1, 3, 1)]


def test_the_decision_reads_one_snapshot_and_an_error_inside_leaves_no_transaction(tmp_path):
    """``one_snapshot`` (what prewrite decides in): every read inside sees the snapshot the first
    one saw, even after another writer commits; an error inside rolls it back, leaving the
    connection out of any transaction and the lake as it was."""
    settings = Settings(warehouse=tmp_path / "wh")
    assert run_ingest([write(tmp_path / "a" / "page.json", to_api_json(good_page(1)))], settings).n_loaded == 1
    with wh.connect(settings) as conn, wh.connect(settings) as other:
        with wh.one_snapshot(conn):
            first = conn.execute(f"SELECT id FROM {wh.CATALOG}.current_snapshot()").fetchone()[0]
            assert conn.execute("SELECT count(*) FROM features").fetchone() == (1,)
            other.execute("INSERT INTO models (model_id) VALUES ('committed-beside-it')")  # autocommit
            assert conn.execute("SELECT count(*) FROM models WHERE model_id = 'committed-beside-it'").fetchone() == (0,)
            assert conn.execute(f"SELECT id FROM {wh.CATALOG}.current_snapshot()").fetchone()[0] == first
        assert conn.execute("SELECT count(*) FROM models WHERE model_id = 'committed-beside-it'").fetchone() == (1,)
        n_snapshots = conn.execute(f"SELECT count(*) FROM {wh.CATALOG}.snapshots()").fetchone()[0]
        with contextlib.suppress(ZeroDivisionError), wh.one_snapshot(conn):
            conn.execute("CREATE OR REPLACE TEMP TABLE scratch AS SELECT 1 AS x")
            raise ZeroDivisionError
        conn.execute("BEGIN TRANSACTION")  # none was left open
        conn.execute("ROLLBACK")
        assert conn.execute(f"SELECT count(*) FROM {wh.CATALOG}.snapshots()").fetchone()[0] == n_snapshots


def test_an_interrupt_at_the_decisions_commit_leaves_no_transaction_open(tmp_path):
    """A signal (SIGTERM raises in the main thread) that lands at ``one_snapshot``'s COMMIT rolls
    the transaction back: the run's failure can then be recorded (its BEGIN would fail inside an
    open transaction, leaving the run `running`)."""
    settings = Settings(warehouse=tmp_path / "wh")
    assert run_ingest([write(tmp_path / "a" / "page.json", to_api_json(good_page(1)))], settings).n_loaded == 1

    class InterruptedAtCommit:  # the connection as one_snapshot sees it, a signal arriving at COMMIT
        def __init__(self, conn):
            self.conn = conn

        def execute(self, sql, *args):
            if sql == "COMMIT":
                raise KeyboardInterrupt
            return self.conn.execute(sql, *args)

    with wh.connect(settings) as conn:
        with contextlib.suppress(KeyboardInterrupt), wh.one_snapshot(InterruptedAtCommit(conn)):
            conn.execute("SELECT count(*) FROM features").fetchall()
        conn.execute("BEGIN TRANSACTION")  # none was left open
        conn.execute("ROLLBACK")


def _stats(settings: Settings) -> list[tuple]:
    cols = "model_id, source_id, feature_index, data_source, n_examples, max_activation, top_tokens"
    return query(settings.warehouse, f"SELECT {cols} FROM feature_activation_stats ORDER BY ALL") + \
        query(settings.warehouse, "SELECT * EXCLUDE (refreshed_at) FROM feature_token_stats ORDER BY ALL")


def _recomputed(settings: Settings) -> list[tuple]:
    """The statistics computed again from the activations, in a copy of the warehouse."""
    import shutil

    from pipeline.stages import materialise

    copy = Settings(warehouse=settings.warehouse.parent / "recomputed")
    shutil.copytree(settings.warehouse, copy.warehouse)
    conn = wh.connect(copy)
    try:
        materialise.refresh(conn, copy)
    finally:
        conn.close()
    return _stats(copy)


def _spy_stats(monkeypatch, between=None) -> list:
    """Record what each batch's commit did with its statistics: (computed before the lock,
    used as computed). ``between`` runs once, after the first batch computed them."""
    import importlib

    from pipeline.stages import materialise

    loading_module = importlib.import_module("pipeline.ingest.loading")  # the loader thread's work
    prestats, refresh = loading_module.prestats, materialise.refresh_changed
    seen, loading = [], []  # every batch's record; those not committed yet (``between`` nests one)

    def spy_prestats(conn, prewritten):
        done = prestats(conn, prewritten)
        seen.append(["computed" if done else "not computed"])
        loading.append(seen[-1])
        if between is not None and len(seen) == 1:
            between()
        return done

    def spy_refresh(conn, **kw):
        if loading:  # (not a load's: materialise.refresh)
            loading.pop().append("used" if kw.get("computed") else "computed in the lock")
        return refresh(conn, **kw)

    monkeypatch.setattr(loading_module, "prestats", spy_prestats)
    monkeypatch.setattr(materialise, "refresh_changed", spy_refresh)
    return seen


def test_a_batchs_statistics_are_computed_before_the_commit_lock(tmp_path, monkeypatch):
    """With no commit in between, the commit only replaces the statistics rows, computed before
    the lock: the same as computing them all again."""
    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([_page("v0", datetime(2025, 12, 1), tmp_path / "in0")], settings)
    seen = _spy_stats(monkeypatch)
    run_ingest([_page("v1", datetime(2026, 1, 1), tmp_path / "in1", scale=2.0)], settings)
    assert seen == [["computed", "used"]]
    assert query(settings.warehouse, "SELECT max(max_activation) FROM feature_activation_stats") == [(6.5,)]
    assert _stats(settings) == _recomputed(settings)


def test_statistics_computed_before_a_commit_that_came_in_between_are_not_used(tmp_path, monkeypatch):
    """v1's statistics are computed; then, before its commit, a newer capture v2 (other values)
    is committed: v1's commit decides again (v1 is older: nothing of it loads) and its
    statistics are not the ones computed for it, but v2's, as computed again from scratch."""
    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([_page("v0", datetime(2025, 12, 1), tmp_path / "in0")], settings)
    v2 = _page("v2", datetime(2026, 2, 1), tmp_path / "in2", scale=3.0)
    seen = _spy_stats(monkeypatch, between=lambda: run_ingest([v2], settings))
    run_ingest([_page("v1", datetime(2026, 1, 1), tmp_path / "in1", scale=2.0)], settings)
    assert seen == [["computed", "computed in the lock"], ["computed", "used"]]  # v1's, then v2's
    assert query(settings.warehouse, "SELECT description FROM explanations") == [("v2",)]
    assert query(settings.warehouse, "SELECT max(max_activation) FROM feature_activation_stats") == [(9.75,)]
    assert _stats(settings) == _recomputed(settings)


def test_reference_rows_are_decided_before_the_lock_and_a_changed_one_replaces_the_old(tmp_path, monkeypatch):
    """Models, sources and source sets: what a batch changes is found before the commit lock;
    the commit replaces a changed row (one row per key) and leaves an unchanged one alone."""
    import importlib

    from pipeline.stages import load

    loading_module = importlib.import_module("pipeline.ingest.loading")  # the loader thread's work
    calls, upsert = [], load.upsert_reference

    def spy(conn, table, now, *, decided=None):
        calls.append((table, decided))
        return upsert(conn, table, now, decided=decided)

    monkeypatch.setattr(loading_module, "upsert_reference", spy)
    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([_page("v0", datetime(2025, 12, 1), tmp_path / "in0")], settings)
    page = good_page(8, source="race-src")
    page["model"]["displayName"] = "renamed"
    run_ingest([write(tmp_path / "in1" / "page.json", to_api_json(page))], settings)
    assert calls == [("models", 1), ("source_sets", 1), ("sources", 1),  # the first load: all new
                       ("models", 1), ("source_sets", 0), ("sources", 0)]
    assert query(settings.warehouse, "SELECT model_id, display_name FROM models") == [("gpt-oss-20b", "renamed")]
    assert query(settings.warehouse, "SELECT count(*) FROM sources") == [(1,)]


def test_a_batch_with_a_new_empty_capture_loses_its_statistics(tmp_path):
    """A newer capture of feature 7 with no activations: its statistics rows go, as a full
    recompute gives (the rows computed before the lock must not read the old activations)."""
    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([_page("v0", datetime(2025, 12, 1), tmp_path / "in0")], settings)
    run_ingest([_page("v1", datetime(2026, 1, 1), tmp_path / "in1", edit=lambda p: p.update(activations=[]))], settings)
    assert query(settings.warehouse, "SELECT count(*) FROM activations") == [(0,)]
    for table in ("feature_activation_stats", "feature_token_stats", "source_activation_stats"):
        assert query(settings.warehouse, f"SELECT count(*) FROM {table}") == [(0,)], table
    assert _stats(settings) == _recomputed(settings)


def test_a_commit_retried_on_a_busy_catalog_without_a_new_snapshot_loads_what_was_decided(tmp_path, monkeypatch):
    """The catalog (SQLite) is held by another connection just as the batch commits, so its
    COMMIT fails and is retried against the same snapshot: the retry uses what was decided
    before the lock (a renamed model, new statistics) and loads it."""
    import importlib
    loading_module = importlib.import_module("pipeline.ingest.loading")  # the loader thread's work
    settings = Settings(warehouse=tmp_path / "wh", commit_attempts=30)
    run_ingest([_page("v0", datetime(2025, 12, 1), tmp_path / "in0")], settings)
    path = _page("v1", datetime(2026, 1, 1), tmp_path / "in1", scale=2.0,
                 edit=lambda p: p["model"].update(displayName="renamed"))

    write_counts, held = loading_module.write_counts, []
    # another process (SQLite's locks are a process's: one in this process would not block it)
    hold = ("import sqlite3, sys, time\n"
            "db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=0)\n"
            "db.execute('BEGIN IMMEDIATE'); print('held', flush=True); time.sleep(3); db.execute('ROLLBACK')\n")

    def busy_after(conn, s, counts):  # the load's last statement before its COMMIT
        write_counts(conn, s, counts)
        if not held:
            held.append(subprocess.Popen([sys.executable, "-c", hold, str(settings.warehouse / "catalog.sqlite")],
                                         stdout=subprocess.PIPE, text=True))
            assert held[0].stdout.readline() == "held\n"

    monkeypatch.setattr(loading_module, "write_counts", busy_after)
    summary = run_ingest([path], settings)
    held[0].communicate(timeout=60)
    assert summary.status == "succeeded", summary
    assert summary.stats.retries >= 1, "the COMMIT did not meet a busy catalog"
    assert query(settings.warehouse, "SELECT display_name FROM models") == [("renamed",)]
    assert query(settings.warehouse, "SELECT max(max_activation) FROM feature_activation_stats") == [(6.5,)]
    assert _stats(settings) == _recomputed(settings)


def _bad_value(page: dict) -> None:
    """One activation of the page with its maximum's index past its excerpt: quarantined, the
    rest of the page loads."""
    page["activations"][0]["maxValueTokenIndex"] = 99


def test_deletes_found_empty_before_the_lock_run_when_a_commit_came_in_between(tmp_path):
    """Before the lock, feature 7 is new: the commit's deletes (its rows, captures, statistics)
    have nothing to delete and are skipped if the plan stands. Here it does not: an older
    capture v1 of feature 7 is committed in between, so the commit decides again and deletes
    v1's rows. Skipping those deletes would leave both captures' rows."""
    settings = Settings(warehouse=tmp_path / "wh")
    other = good_page(8, source="race-src")  # the tables hold rows, none of feature 7
    run_ingest([write(tmp_path / "in8" / "page.json", to_api_json(other))], settings)
    before = _ours(settings.warehouse)
    proc = _start(_page("v2", datetime(2026, 2, 1), tmp_path / "in2", scale=3.0), settings)
    with _lock_once_running(settings, proc):
        _wait_for(lambda: len(_ours(settings.warehouse) - before) == 3, 120, proc)
        run_ingest([_page("v1", datetime(2026, 1, 1), tmp_path / "in1")], settings)  # the lock is ours
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    f7 = "feature_index = 7"
    assert query(settings.warehouse, f"SELECT description FROM explanations WHERE {f7}") == [("v2",)]
    assert query(settings.warehouse, f"SELECT count(*), max(max_value) FROM activations WHERE {f7}") == [(3, 9.75)]
    assert query(settings.warehouse, f"SELECT count(*) FROM feature_captures WHERE {f7}") == [(3,)]
    assert query(settings.warehouse, f"SELECT count(*) FROM features WHERE {f7}") == [(1,)]
    assert query(settings.warehouse, f"SELECT count(*), max(max_activation) FROM feature_activation_stats "
                                     f"WHERE {f7}") == [(3, 9.75)]  # one row per data source
    assert _stats(settings) == _recomputed(settings)


def test_an_inputs_records_found_absent_before_the_lock_are_replaced_if_it_came_in_between(tmp_path):
    """Before the lock, the other process's input is not in the warehouse: its earlier records
    (raw_inputs, quarantine, input_captures) need no replacing while the plan stands. Here the
    same bytes are ingested in between (another path to them): the commit must replace what
    that load recorded, not add a second copy of each record."""
    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([write(tmp_path / "in8" / "page.json", to_api_json(good_page(8, source="race-src")))], settings)
    page = _page("v2", datetime(2026, 2, 1), tmp_path / "in2", edit=_bad_value)
    copy = tmp_path / "copy" / "page.json"
    copy.parent.mkdir()
    copy.write_bytes(page.read_bytes())
    os.utime(copy, (page.stat().st_mtime, page.stat().st_mtime))
    before = _ours(settings.warehouse)
    proc = _start(page, settings)
    with _lock_once_running(settings, proc):
        _wait_for(lambda: len(_ours(settings.warehouse) - before) == 3, 120, proc)
        run_ingest([copy], settings)  # the lock is ours
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    where = f"WHERE input_sha256 = '{hashlib.sha256(page.read_bytes()).hexdigest()}'"
    assert query(settings.warehouse, f"SELECT count(*) FROM raw_inputs {where}") == [(1,)]
    assert query(settings.warehouse, f"SELECT count(*), count(DISTINCT (record_key, check_name)), "
                                     f"count(DISTINCT record_key) FROM quarantine {where}") == [(2, 2, 1)]
    assert query(settings.warehouse, f"SELECT count(*) FROM input_captures {where}") == [(3,)]
    assert query(settings.warehouse, "SELECT count(*) FROM activations WHERE feature_index = 7") == [(2,)]


def test_a_runs_next_batch_decides_against_what_another_writer_committed_after_its_last(tmp_path, monkeypatch):
    """Which tables hold rows, and what the reference tables hold, is asked by each batch of
    the snapshot it decides against, never kept from the run's batch before. Here the run's
    first batch (feature 8 with no explanation, the model renamed) finds no explanation held;
    then another writer commits capture v1 of feature 7 (its explanation and activations, the
    model named otherwise); then the run's second batch, a newer capture of feature 7 with
    neither explanations nor activations and the model named as the first batch named it, must
    delete v1's rows and name the model again (the last commit's name is the model's)."""
    import importlib

    loading_module = importlib.import_module("pipeline.ingest.loading")  # the loader thread's work
    settings = Settings(warehouse=tmp_path / "wh", batch_bytes=1)  # one input a batch
    run_ingest([write(tmp_path / "in9" / "page.json", to_api_json(good_page(9, source="race-src")))], settings)

    def named(name: str, empty: bool = False):
        def edit(page: dict) -> None:
            page["model"]["displayName"] = name
            if empty:
                page.update(explanations=[], activations=[])
        return edit

    f8 = good_page(8, source="race-src")
    f8.update(explanations=[])
    f8["model"]["displayName"] = "renamed"
    f8 = write(tmp_path / "in8" / "page.json", to_api_json(f8))
    v1 = _page("v1", datetime(2026, 1, 1), tmp_path / "in1", edit=named("other"))
    v2 = _page("v2", datetime(2026, 2, 1), tmp_path / "in2", edit=named("renamed", empty=True))

    load_batch, between = loading_module._Loader.load_batch, []

    def then_another_writer(self, job):
        out = load_batch(self, job)
        if not between:  # after the run's first commit, before its second batch decides
            between.append(subprocess.run([str(FEATUREHOUSE), "ingest", str(v1), "--warehouse", str(settings.warehouse),
                                           "--no-progress"], capture_output=True, text=True, timeout=300))
        return out

    monkeypatch.setattr(loading_module._Loader, "load_batch", then_another_writer)
    summary = run_ingest([f8, v2], settings)
    assert summary.status == "succeeded" and between and between[0].returncode == 0, (summary, between)
    assert query(settings.warehouse, "SELECT count(*) FROM raw_inputs") == [(4,)]
    assert query(settings.warehouse, "SELECT count(*) FROM explanations WHERE feature_index = 7") == [(0,)]
    assert query(settings.warehouse, "SELECT count(*) FROM activations WHERE feature_index = 7") == [(0,)]
    assert query(settings.warehouse, "SELECT count(*) FROM activations WHERE feature_index = 8") == [(3,)]
    assert query(settings.warehouse, "SELECT display_name FROM models") == [("renamed",)]
    assert _stats(settings) == _recomputed(settings)
