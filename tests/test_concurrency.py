"""Readers and writers at once, as separate processes on one warehouse (issue: readers and loads
locked each other out of the single DuckDB file).

* queries, `status` and `report` in another process while a long ingest runs: every one
  succeeds and sees the last committed batch (counts only grow);
* a reader that keeps its connection (and a snapshot) open, and the DuckDB CLI with the
  warehouse attached, never make a load fail;
* two ingests at once: of disjoint corpora they give the union, of the same corpus the same
  tables as one ingest;
* a writer outside featurehouse committing conflicting changes: the load retries its
  transaction with backoff and loses nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import pytest

from bench.generate import synthetic_page
from pipeline.config import Settings
from pipeline.lake import warehouse as wh
from tests.conftest import (
    META_COLUMNS,
    catalog_held_rebuilding_wal_index,
    query,
    run_ingest,
    tables_rows,
)

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")
TABLES = ("features", "activations", "explanations", "models", "sources", "source_sets",
          "feature_activation_stats", "source_activation_stats", "feature_captures")
#: one page per batch, so an ingest commits many snapshots one after another
ONE_PAGE_A_BATCH = {"FEATUREHOUSE_BATCH_ACTIVATIONS": "40"}


def pages(folder: Path, indices, *, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in indices:
        (folder / f"{i}.json").write_bytes(orjson.dumps(synthetic_page(i, seed=seed, valid=True)))
    return folder


def start_ingest(warehouse: Path, *paths: Path, env: dict | None = None) -> subprocess.Popen:
    """``featurehouse ingest`` in a process of its own, one page a batch."""
    return subprocess.Popen([str(FEATUREHOUSE), "ingest", *map(str, paths), "--warehouse", str(warehouse),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **ONE_PAGE_A_BATCH, **(env or {})})


def ingest_here(warehouse: Path, *paths: Path) -> None:
    """An ingest in this process, batched as usual: what is there before the test's processes
    start, or the single run they are compared with (the CLI's ingest is what runs at once)."""
    summary = run_ingest(list(paths), Settings(warehouse=warehouse))
    assert summary.status == "succeeded" and summary.n_loaded == len([p for d in paths for p in d.iterdir()]), summary


def activation_files(warehouse: Path) -> int:
    """The activations' data files: a batch writes its own just before it commits."""
    return len(list((warehouse / "data" / "main" / "activations").glob("*.parquet")))


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"ingest failed ({proc.returncode}):\n{out}\n{err}"
    return out


def fh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.heavy(60)
def test_queries_status_and_report_in_another_process_during_a_long_ingest(tmp_path):
    warehouse = tmp_path / "wh"
    corpus = pages(tmp_path / "in", range(8))  # one page a batch: 8 commits, each seen by the queries
    ingest_here(warehouse, pages(tmp_path / "first", [1000]))
    proc = start_ingest(warehouse, corpus)
    counts, others, seen = [], [], None  # a query at once (the ingest starting), then
    while proc.poll() is None:
        if activation_files(warehouse) == seen:  # ... one each time a batch is about to commit
            time.sleep(0.02)
            continue
        seen = activation_files(warehouse)
        q = fh("sql", "SELECT count(*) FROM activations", "--warehouse", str(warehouse), "--format", "csv")
        assert q.returncode == 0, q.stderr
        counts.append(int(q.stdout.split()[-1]))
        if len(counts) in (2, 4):  # the other read commands, side by side with the load and the queries
            others += [subprocess.Popen([str(FEATUREHOUSE), *cmd, "--warehouse", str(warehouse)], text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                       for cmd in (["status", "-n", "2"], ["report", "--out", str(tmp_path / "reports")])]
    finish(proc)
    final = query(warehouse, "SELECT count(*) FROM activations")[0][0]
    assert final == 9 * 40
    assert counts == sorted(counts), f"a reader saw rows disappear: {counts}"
    assert any(40 < c < final for c in counts), f"no query landed in the middle of the load: {counts}"
    assert len(others) == 4
    for p in others:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err


DUCKDB_CLI = Path(sys.executable).with_name("duckdb")


@pytest.mark.heavy(45)
def test_a_reader_holding_a_connection_and_the_duckdb_cli_never_make_a_load_fail(tmp_path):
    settings = Settings(warehouse=tmp_path / "wh")
    ingest_here(settings.warehouse, pages(tmp_path / "a", range(3)))
    reader = wh.connect(settings, read_only=True)
    reader.execute("BEGIN TRANSACTION")
    assert reader.execute("SELECT count(*) FROM activations").fetchone()[0] == 120
    cli = subprocess.Popen([str(DUCKDB_CLI), "-csv", "-noheader", "-cmd", " ".join(wh.attach_sql(settings))],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cli.stdin.write("SELECT count(*) FROM activations;\n")
    cli.stdin.flush()
    assert cli.stdout.readline().strip() == "120"
    try:
        time.sleep(1)  # both readers now hold the warehouse open for the whole load
        finish(start_ingest(settings.warehouse, pages(tmp_path / "b", range(10, 16))))
        # the open transaction keeps its snapshot; a new one sees the load
        assert reader.execute("SELECT count(*) FROM activations").fetchone()[0] == 120
        reader.execute("COMMIT")
        assert reader.execute("SELECT count(*) FROM activations").fetchone()[0] == 360
        cli.stdin.write("SELECT count(*) FROM activations;\n")
        cli.stdin.flush()
        assert cli.stdout.readline().strip() == "360"
    finally:
        reader.close()
        cli.stdin.close()
        cli.wait(timeout=30)


def _rounded(rows: list[tuple]) -> list[tuple]:
    """Floats to 12 significant digits: an average may differ in its last bit with the order
    DuckDB summed in."""
    return [tuple(float(f"{v:.12g}") if isinstance(v, float) else v for v in r) for r in rows]


def _same_tables(a: Path, b: Path) -> None:
    rows_a, rows_b = tables_rows(a, TABLES), tables_rows(b, TABLES)
    for table in TABLES:
        assert _rounded(rows_a[table]) == _rounded(rows_b[table]), f"{table} differs"


def _ran_at_once(warehouse: Path) -> None:
    """The two runs overlapped in time (one began before the other ended): otherwise the test
    showed only two ingests one after the other."""
    (started, finished), = query(warehouse, "SELECT max(started_at), min(finished_at) FROM runs")
    assert started < finished, f"the two ingests did not run at once: one began at {started}, after the other ended at {finished}"


@pytest.mark.heavy(45)
def test_a_catalog_held_by_a_process_that_does_not_go_on_is_said_locked_not_damaged(tmp_path):
    """Found while a publication was stopped mid-way (SIGSTOP, ^Z): a process that holds the
    SQLite catalog's locks and does not go on keeps every reader out ("database is locked"), and
    the message called the catalog damaged: "restore it from a backup, or move it away" (which
    loses a sound warehouse). It says who holds it and what to do; once it is let go, all reads."""
    warehouse = tmp_path / "wh"
    ingest_here(warehouse, pages(tmp_path / "in", [1]))
    # a reader with the WAL index mapped (as the stopped publication had): SQLite then says
    # "database is locked" after its busy wait (~5 s), not "locking protocol" after ~95 s
    mapped = subprocess.Popen([sys.executable, "-c", "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
                               "c.execute('SELECT count(*) FROM sqlite_master').fetchall(); print('open', flush=True); "
                               "sys.stdin.read()", str(warehouse / "catalog.sqlite")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert mapped.stdout.readline().strip() == "open"
        with catalog_held_rebuilding_wal_index(Settings(warehouse=warehouse)) as holder:
            held = fh("status", "--warehouse", str(warehouse))
    finally:
        mapped.communicate()
    assert held.returncode == 1 and "Traceback" not in held.stderr, held.stderr
    assert "is locked by process " in held.stderr and f"process {holder.pid}" in held.stderr, held.stderr
    assert "not damaged" in held.stderr
    assert "restore it from a backup" not in held.stderr and "move it away to" not in held.stderr
    assert fh("status", "--warehouse", str(warehouse)).returncode == 0


def test_two_concurrent_ingests_of_disjoint_corpora_give_the_union(tmp_path):
    one, two = pages(tmp_path / "one", range(0, 4)), pages(tmp_path / "two", range(100, 104))
    both = [start_ingest(tmp_path / "wh", one), start_ingest(tmp_path / "wh", two)]
    for p in both:
        finish(p)
    ingest_here(tmp_path / "alone", one, two)
    assert query(tmp_path / "wh", "SELECT count(*), count(DISTINCT activation_id) FROM activations") == [(320, 320)]
    assert query(tmp_path / "wh", "SELECT count(*) FROM features") == [(8,)]
    _same_tables(tmp_path / "wh", tmp_path / "alone")
    assert query(tmp_path / "wh", "SELECT count(*), sum(n_loaded) FROM runs WHERE status = 'succeeded'") == [(2, 8)]
    _ran_at_once(tmp_path / "wh")


@pytest.mark.heavy(45)
def test_two_concurrent_ingests_of_the_same_corpus_equal_one_ingest(tmp_path):
    corpus = pages(tmp_path / "in", range(4))
    both = [start_ingest(tmp_path / "wh", corpus), start_ingest(tmp_path / "wh", corpus)]
    for p in both:
        finish(p)
    ingest_here(tmp_path / "alone", corpus)
    _same_tables(tmp_path / "wh", tmp_path / "alone")
    assert query(tmp_path / "wh", "SELECT count(*), count(DISTINCT input_sha256) FROM raw_inputs") == [(4, 4)]
    _ran_at_once(tmp_path / "wh")


OUTSIDE_WRITER = textwrap.dedent("""
    import sys, threading, time, duckdb
    from pathlib import Path
    from pipeline.lake import warehouse as wh
    from pipeline.config import Settings
    settings = Settings(warehouse=Path(sys.argv[1]))
    conn = duckdb.connect()
    for name in ("ducklake", "sqlite_scanner"):
        conn.execute(f"LOAD '{wh.extension_path(name)}'")
    conn.execute(f"ATTACH 'ducklake:{settings.catalog_url}' AS lake")
    commits = conflicts = 0
    stop = time.monotonic() + float(sys.argv[2])
    done = threading.Event()  # the test closes stdin when the load has finished
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    while time.monotonic() < stop and not done.is_set():
        try:  # rewrite every feature row, as another tool might: it never takes featurehouse's lock
            conn.execute("UPDATE lake.features SET hook_name = hook_name")
            commits += 1
        except duckdb.Error:
            conflicts += 1
        if commits == 1:
            print("writing", flush=True)
        time.sleep(0.02)
    print(commits, conflicts)
""")


@pytest.mark.heavy(80)
def test_a_load_retries_when_a_writer_outside_featurehouse_wins_the_commit(tmp_path):
    warehouse = tmp_path / "wh"
    ingest_here(warehouse, pages(tmp_path / "v1", range(6), seed=1))  # what is there before
    v2 = pages(tmp_path / "v2", range(6), seed=2)  # newer captures of the same features
    outside = subprocess.Popen([sys.executable, "-c", OUTSIDE_WRITER, str(warehouse), "25"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).resolve().parent.parent)
    assert outside.stdout.readline() == "writing\n", "the outside writer did not start writing"
    load = start_ingest(warehouse, v2, env={"FEATUREHOUSE_COMMIT_ATTEMPTS": "50"})
    err = []
    for line in load.stderr:  # the writer stops once the load has lost a commit to it (the load's
        err.append(line)      # retries back off exponentially: kept writing, it wins for its 25 s)
        if "commit conflict" in line and not outside.stdin.closed:
            outside.stdin.close()
    load.wait(timeout=600)
    assert load.returncode == 0, f"ingest failed ({load.returncode}):\n{''.join(err)}"
    if not outside.stdin.closed:
        outside.stdin.close()
    out = outside.stdout.read()  # at most 25 s of writes, fewer once the load lost one
    outside.wait(timeout=120)
    assert outside.returncode == 0 and int(out.split()[0]) > 0, f"the outside writer did not write: {out}"
    (retries,) = query(warehouse, "SELECT commit_retries FROM runs ORDER BY started_at DESC LIMIT 1")[0]
    assert retries > 0, "the outside writer never conflicted with the load: the test proved nothing"
    ingest_here(tmp_path / "alone", v2)
    tables = ("features", "activations", "explanations", "feature_activation_stats")
    got = tables_rows(warehouse, tables, exclude=META_COLUMNS)
    want = tables_rows(tmp_path / "alone", tables, exclude=META_COLUMNS)
    for table in tables:
        assert got[table] == want[table], f"{table} differs after the retried load"


@pytest.fixture(scope="module")
def one_run(tmp_path_factory) -> Path:
    """A warehouse of one run, shared by the read-only commands (each checks it wrote nothing)."""
    tmp = tmp_path_factory.mktemp("readers")
    warehouse = tmp / "wh"
    ingest_here(warehouse, pages(tmp / "in", [5]))
    return warehouse


@pytest.mark.parametrize("command", ["status", "report", "history", "changes"])
def test_commands_that_only_read_never_write(one_run, command):
    warehouse = one_run
    (before,) = query(warehouse, "SELECT max(snapshot_id) FROM featurehouse.snapshots()")[0]
    (run_id,) = query(warehouse, "SELECT run_id FROM runs")[0]
    args = {"status": ["status"], "report": ["report"], "history": ["history", "gpt-oss-20b/11-resid-post-aa/5"],
            "changes": ["changes", "--since", run_id]}[command]
    r = fh(*args, "--warehouse", str(warehouse))
    assert r.returncode == 0, r.stderr
    assert query(warehouse, "SELECT max(snapshot_id) FROM featurehouse.snapshots()")[0] == (before,)
