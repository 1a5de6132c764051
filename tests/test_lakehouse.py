"""The warehouse as a DuckLake: its layout and settings, schema versions and upgrades, moving a
single-file warehouse of the previous release over, and the DuckDB shell."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import tarfile
from pathlib import Path

import duckdb
import pytest

from pipeline.config import SCHEMAS_DIR, Settings
from pipeline.lake import warehouse as wh
from tests.conftest import FIXTURES, SEED_FLIGHT, query, run_ingest

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")
LEGACY = Path(__file__).resolve().parent / "legacy" / "warehouse-0.1.tar.gz"
"""A warehouse written by featurehouse 0.1 (commit 6f88c53): two runs over the seeds, three small
pages (one with a bad record) and an explanations export batch; its landing area beside it."""


def fh(*args: str, env: dict | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, input=input)


def test_the_embedded_default_needs_nothing_started(tmp_path):
    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([FIXTURES], settings)
    root = settings.warehouse
    assert (root / "catalog.sqlite").is_file() and (root / "landing" / "sha256").is_dir()
    parquet = list((root / "data").rglob("*.parquet"))
    assert parquet, "data files are Parquet under data/"
    with sqlite3.connect(root / "catalog.sqlite") as db:  # readers never wait for a writer
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert query(settings.warehouse, "SELECT count(*) FROM activations") == [(39,)]
    # and any DuckDB client reads it the same way
    with duckdb.connect() as conn:
        for line in wh.attach_sql(settings):
            conn.execute(line)
        assert conn.execute("SELECT count(*) FROM activations").fetchone() == (39,)


def test_the_catalog_and_the_data_can_live_elsewhere(tmp_path):
    env = {"FEATUREHOUSE_CATALOG": f"sqlite:{tmp_path / 'meta' / 'lake.sqlite'}",
           "FEATUREHOUSE_DATA_PATH": str(tmp_path / "parquet")}
    r = fh("ingest", str(SEED_FLIGHT), "--warehouse", str(tmp_path / "wh"), "--no-progress", env=env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "meta" / "lake.sqlite").is_file() and not (tmp_path / "wh" / "catalog.sqlite").exists()
    assert list((tmp_path / "parquet").rglob("*.parquet")) and not (tmp_path / "wh" / "data").exists()
    r = fh("sql", "SELECT count(*) AS n FROM activations", "--warehouse", str(tmp_path / "wh"), "--format", "csv", env=env)
    assert r.stdout.split() == ["n", "39"]


@pytest.mark.parametrize("args", [
    ["status"], ["sql", "SELECT 1"], ["report"], ["materialise"], ["maintain"], ["upgrade"],
    ["history", "m/s/1"], ["changes", "--since", "2026-01-01"], ["shell", "--print"],
])
def test_only_ingest_and_fetch_create_a_warehouse(tmp_path, args):
    r = fh(*args, "--warehouse", str(tmp_path / "typo"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no warehouse at" in r.stderr and "featurehouse ingest" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "typo").exists()


# --- schema versions ----------------------------------------------------------------------------


def _schemas(tmp_path: Path, extra: dict[str, str]) -> Path:
    """A copy of schemas/ with extra migrations: what a later release would ship."""
    folder = tmp_path / f"schemas-{len(list(tmp_path.glob('schemas-*')))}"
    shutil.copytree(SCHEMAS_DIR, folder)
    for name, sql in extra.items():
        (folder / "migrations" / name).write_text(sql)
    return folder


def test_an_older_warehouse_is_migrated_in_order_and_a_newer_one_refused(tmp_path):
    latest = wh.latest_version()
    now = _schemas(tmp_path, {})
    nxt = _schemas(tmp_path, {
        f"{latest + 1:04d}_runs_note.sql": "ALTER TABLE runs ADD COLUMN note VARCHAR;\n",
        f"{latest + 2:04d}_fill_note.sql": "UPDATE runs SET note = 'written by ' || trigger;\n",
    })
    warehouse = str(tmp_path / "wh")
    r = fh("ingest", str(FIXTURES), "--warehouse", warehouse, "--no-progress", env={"FEATUREHOUSE_SCHEMAS": str(now)})
    assert r.returncode == 0, r.stderr

    # a newer featurehouse reading it first: it asks for the upgrade instead of guessing
    r = fh("status", "--warehouse", warehouse, env={"FEATUREHOUSE_SCHEMAS": str(nxt)})
    assert r.returncode == 1 and "featurehouse upgrade" in r.stderr and f"version {latest}" in r.stderr

    # any write applies the missing migrations, in order, each recorded
    r = fh("upgrade", "--warehouse", warehouse, env={"FEATUREHOUSE_SCHEMAS": str(nxt)})
    assert r.returncode == 0 and f"{latest} -> {latest + 2}" in r.stdout, r.stderr
    r = fh("sql", "SELECT version, name FROM schema_version ORDER BY version", "--warehouse", warehouse,
           "--format", "csv", env={"FEATUREHOUSE_SCHEMAS": str(nxt)})
    rows = [line.split(",") for line in r.stdout.splitlines()[1:]]
    assert [int(v) for v, _ in rows] == list(range(1, latest + 3)), r.stderr
    assert rows[-2:] == [[str(latest + 1), "runs_note"], [str(latest + 2), "fill_note"]]
    # every row kept; the new column filled by the later migration (so they ran in order)
    r = fh("sql", "SELECT note, (SELECT count(*) FROM activations) AS n FROM runs", "--warehouse", warehouse,
           "--format", "csv", env={"FEATUREHOUSE_SCHEMAS": str(nxt)})
    assert r.stdout.splitlines() == ["note,n", "written by cli,39"], r.stderr

    # this release opening the upgraded warehouse: refused, with what to do
    for args in (["status"], ["ingest", str(SEED_FLIGHT), "--no-progress"]):
        r = fh(*args, "--warehouse", warehouse, env={"FEATUREHOUSE_SCHEMAS": str(now)})
        assert r.returncode == 1 and "newer than this featurehouse" in r.stderr and "Traceback" not in r.stderr


# --- from the single-file warehouse of the previous release ------------------------------------

_LEGACY_COUNTS = {"runs": 2, "raw_inputs": 6, "run_inputs": 8, "features": 4, "activations": 47,
                  "explanations": 5, "quarantine": 2, "validation_results": 27, "feature_activation_stats": 5,
                  "source_activation_stats": 2, "models": 1, "sources": 1, "source_sets": 1}


def _legacy(tmp_path: Path) -> Path:
    root = tmp_path / "warehouse"
    root.mkdir()
    with tarfile.open(LEGACY) as tar:
        tar.extractall(root, filter="data")
    return root / "featurehouse.duckdb"


def _legacy_rows(old: Path, table: str) -> list[tuple]:
    with duckdb.connect(str(old), read_only=True) as conn:
        cols = [c for (c,) in conn.execute(
            "SELECT column_name FROM duckdb_columns() WHERE table_name = ? ORDER BY column_index", [table]).fetchall()
                if c not in ("landed_path", "refreshed_at")]
        sel = ", ".join(f'"{c}"' for c in cols)
        return cols, conn.execute(f"SELECT {sel} FROM {table} ORDER BY ALL").fetchall()


def test_a_single_file_warehouse_moves_over_with_every_row_run_and_quarantine_record(tmp_path):
    old = _legacy(tmp_path)
    r = fh("status", "--warehouse", str(old))
    assert r.returncode == 1 and f"featurehouse migrate {old}" in r.stderr

    r = fh("migrate", str(old))
    assert r.returncode == 0, r.stderr
    new = old.parent  # in place: the catalog and data files join the landing area and reports
    with wh.connect(new, read_only=True) as conn:  # one connection for the tables' reads (~0.3 CPU-s each)
        for table, n in _LEGACY_COUNTS.items():
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchall() == [(n,)], table
            cols, rows = _legacy_rows(old, table)
            sel = ", ".join(f'"{c}"' for c in cols)
            assert conn.execute(f"SELECT {sel} FROM {table} ORDER BY ALL").fetchall() == rows, table
        # 4 features from pages (3 tables each) and one whose explanation came from an export batch
        assert conn.execute("SELECT table_name, count(*) FROM feature_captures GROUP BY 1 ORDER BY 1").fetchall() == [
            ("activations", 4), ("explanations", 5), ("features", 4)]
        landed = conn.execute("SELECT landed_path FROM raw_inputs").fetchall()
    for (path,) in landed:
        assert Path(path).is_file() and Path(path).parent.parent.parent == new / "landing"

    # the moved warehouse carries on: its landed inputs are known, history and stats work
    s = run_ingest([FIXTURES], Settings(warehouse=new))
    # Nothing is new. The seed page's file is newer than its capture as 0.1 recorded it (its
    # receipt), and 0.1 kept no record of what an input holds: that newer capture is read again.
    assert (s.n_received, s.n_landed, s.n_reread, s.n_duplicates, s.n_loaded) == (2, 0, 1, 1, 1)
    r = fh("history", "gpt-oss-20b/11-resid-post-aa/45698", "--warehouse", str(new), "--format", "json")
    assert r.returncode == 0 and '"n_activations": 39' in r.stdout, r.stderr
    assert fh("materialise", "--warehouse", str(new)).returncode == 0
    assert query(new, "SELECT sum(n_examples) FROM feature_activation_stats") == [(47,)]
    # migrating twice would double everything: refused
    r = fh("migrate", str(old))
    assert r.returncode == 1 and "already holds data" in r.stderr


def test_a_single_file_warehouse_moves_into_another_folder(tmp_path):
    old = _legacy(tmp_path)
    target = tmp_path / "lake"
    r = fh("migrate", str(old), "--warehouse", str(target))
    assert r.returncode == 0, r.stderr
    paths = [Path(p) for (p,) in query(target, "SELECT landed_path FROM raw_inputs")]
    assert len(paths) == 6 and all(p.is_file() and str(p).startswith(str(target / "landing")) for p in paths)
    assert query(target, "SELECT count(*) FROM activations") == [(47,)]


def test_migrate_refuses_what_is_not_a_featurehouse_warehouse(tmp_path):
    other = tmp_path / "other.duckdb"
    with duckdb.connect(str(other)) as conn:
        conn.execute("CREATE TABLE t AS SELECT 1")
    r = fh("migrate", str(other), "--warehouse", str(tmp_path / "x"))
    assert r.returncode == 1 and "not a featurehouse warehouse" in r.stderr


# --- the shell ----------------------------------------------------------------------------------


def test_shell_opens_the_duckdb_cli_read_only(tmp_path):
    warehouse = tmp_path / "wh"
    run_ingest([SEED_FLIGHT], Settings(warehouse=warehouse))
    r = fh("shell", "--warehouse", str(warehouse), input="SELECT count(*) AS n FROM activations;\n"
           "DELETE FROM activations;\n")
    assert "39" in r.stdout, r.stdout + r.stderr
    assert "read-only" in r.stderr.lower()
    assert query(warehouse, "SELECT count(*) FROM activations") == [(39,)]
    printed = fh("shell", "--print", "--warehouse", str(warehouse)).stdout
    assert (f"ATTACH 'ducklake:sqlite:{warehouse.absolute()}/catalog.sqlite' AS featurehouse (READ_ONLY, "
            f"DATA_PATH '{warehouse.absolute()}/data/', OVERRIDE_DATA_PATH true);") in printed


# --- a PostgreSQL catalog -----------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.heavy(40)
def test_a_postgresql_catalog_with_two_writers_and_a_reader(tmp_path):
    from tests.airflow_helpers import pg_bin, postgres_cluster
    from tests.test_concurrency import finish, pages, start_ingest

    if pg_bin() is None:
        pytest.fail("PostgreSQL is not installed: .ci/run installs it (apt-get install postgresql)")
    with postgres_cluster() as pg:
        env = {"FEATUREHOUSE_CATALOG": pg.catalog}
        missing = fh("status", "--warehouse", str(tmp_path / "wh"), env=env)
        assert missing.returncode == 1 and "no warehouse" in missing.stderr and "password=airflow" not in missing.stderr
        one, two = pages(tmp_path / "one", range(0, 4)), pages(tmp_path / "two", range(50, 54))
        both = [start_ingest(tmp_path / "wh", one, env=env), start_ingest(tmp_path / "wh", two, env=env)]
        for p in both:
            finish(p)
        r = fh("sql", "SELECT count(*) AS n, count(DISTINCT activation_id) AS d FROM activations",
               "--warehouse", str(tmp_path / "wh"), "--format", "csv", env=env)
        assert r.stdout.split() == ["n,d", "320,320"], r.stderr
        assert not (tmp_path / "wh" / "catalog.sqlite").exists()
        assert list((tmp_path / "wh" / "data").rglob("*.parquet"))
        r = fh("history", "gpt-oss-20b/11-resid-post-aa/50", "--warehouse", str(tmp_path / "wh"),
               "--format", "json", env=env)
        assert r.returncode == 0 and '"n_activations": 40' in r.stdout, r.stderr



def test_writers_starting_at_once_on_a_new_warehouse_all_open_it(tmp_path):
    """Eight threads open one new warehouse at once, as the nightly DAG's mapped ingests do on a
    first night: one makes it, the others wait for it. A look at the catalog while it was being
    made used to fail ("attempt to write a readonly database", said as a read-only copy) in about
    one round in eight; each round here is a new warehouse."""
    import threading

    for round_no in range(6):
        settings = Settings(warehouse=tmp_path / f"wh{round_no}")
        start, errors = threading.Barrier(8), []

        def open_it(settings=settings, start=start, errors=errors):
            start.wait(timeout=60)
            try:
                wh.connect(settings, create=True).close()
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=open_it) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert errors == [], errors[0]
        assert query(settings, "SELECT count(*) FROM runs") == [(0,)]


@pytest.mark.parametrize("own_connection", [True, False])
def test_a_catalog_said_read_only_while_being_made_is_looked_at_again(tmp_path, monkeypatch, own_connection):
    """SQLite's ATTACH is lazy: "attempt to write a readonly database" comes after the probe's
    name is taken. Looked at again, the probe attaches anew, on its own connection or on the one
    being opened (the second once failed with "catalog_probe already exists", said as a damaged
    catalog to move away)."""
    from pipeline.lake import catalog

    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([SEED_FLIGHT], settings)
    probe, calls = wh._probe_catalog, []

    def once_read_only(conn, path):
        calls.append(path)
        if len(calls) == 1:
            conn.execute(f"ATTACH '{path}' AS catalog_probe (TYPE sqlite, READ_ONLY)")
            raise duckdb.IOException("attempt to write a readonly database")
        return probe(conn, path)

    monkeypatch.setattr(catalog, "_probe_catalog", once_read_only)  # its room: what _catalog_state calls
    conn = None if own_connection else wh._duckdb(["sqlite_scanner"])
    assert wh._catalog_state(settings, conn) == (True, f"{settings.warehouse / 'data'}/")
    assert len(calls) == 2
    if conn is not None:
        assert conn.execute("SELECT count(*) FROM duckdb_databases() WHERE database_name = 'catalog_probe'"
                            ).fetchone() == (0,)


def _stop_postgres(catalog: str) -> None:
    """Stop (immediately, as a crash) the throwaway cluster that serves ``catalog``: the data
    folder whose postmaster.pid names its port."""
    import glob
    import re

    from tests.airflow_helpers import _as_postgres, pg_bin

    port = re.search(r"port=(\d+)", catalog)[1]
    for pid_file in glob.glob("/tmp/featurehouse-pg-*/data/postmaster.pid"):
        lines = Path(pid_file).read_text().splitlines()
        if len(lines) > 3 and lines[3].strip() == port:
            subprocess.run(_as_postgres([str(pg_bin() / "pg_ctl"), "-D", str(Path(pid_file).parent), "-m",
                                         "immediate", "-w", "stop"]), capture_output=True, timeout=60, check=True)
            return
    raise AssertionError(f"no cluster on port {port}")


@pytest.mark.postgres
def test_a_postgresql_catalog_that_stops_is_said_in_one_line_without_its_password(tmp_path):
    """Issue 41 item 7: with PostgreSQL stopped, every command ended in a traceback whose last
    line echoed the libpq string, password included; an ingest it stopped under logged two
    tracebacks more. Now: one line naming the server, what to do, and that nothing half-done
    was committed."""
    import time

    from tests.airflow_helpers import pg_bin, postgres_cluster
    from tests.test_concurrency import pages

    if pg_bin() is None:
        pytest.fail("PostgreSQL is not installed: .ci/run installs it (apt-get install postgresql)")
    many = pages(tmp_path / "many", range(0, 400))
    with postgres_cluster() as pg:
        env = {"FEATUREHOUSE_CATALOG": pg.catalog}
        wh_dir = str(tmp_path / "wh")
        assert fh("ingest", str(SEED_FLIGHT), "--warehouse", wh_dir, "--no-progress", env=env).returncode == 0
        proc = subprocess.Popen([str(FEATUREHOUSE), "ingest", str(many), "--warehouse", wh_dir, "--no-progress"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
        deadline = time.monotonic() + 120
        while not list((tmp_path / "wh" / "landing").rglob("*")) or len(list((tmp_path / "wh" / "landing").rglob("*"))) < 50:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        _stop_postgres(pg.catalog)
        _, err = proc.communicate(timeout=300)
        runs = [("during an ingest", proc.returncode, err)]
        for args in (("status",), ("sql", "SELECT count(*) FROM features"), ("ingest", str(SEED_FLIGHT)),
                     ("search", "cpu"), ("history", "gpt-oss-20b/11-resid-post-aa/0")):
            r = fh(*args, "--warehouse", wh_dir, env=env)
            runs.append((args[0], r.returncode, r.stderr))
    for what, rc, err in runs:
        assert rc == 1, (what, err)
        assert "Traceback" not in err and "password=airflow" not in err and "airflow@" not in err, (what, err)
        assert "the warehouse's PostgreSQL catalog (127.0.0.1:" in err and "database featurehouse" in err, (what, err)
        assert "Start PostgreSQL" in err, (what, err)


def test_a_warehouse_whose_making_was_cut_short_says_so_and_an_ingest_makes_it(tmp_path):
    """Issue 41 item 7: a catalog whose making stopped before featurehouse's tables were
    committed (PostgreSQL stopped while a warehouse was made) told every reader it had "schema
    version 0" and to run upgrade, as if it were an old warehouse. Now it says what happened,
    and an ingest makes it."""
    from pipeline.lake.extensions import new_connection

    wh_dir = tmp_path / "wh"
    (wh_dir / "data").mkdir(parents=True)
    with new_connection(["ducklake", "sqlite_scanner"]) as db:  # the lake begun, nothing of ours in it
        db.execute(f"ATTACH 'ducklake:sqlite:{wh_dir / 'catalog.sqlite'}' AS lake (DATA_PATH '{wh_dir / 'data'}/')")
    for args in (("status",), ("sql", "SELECT 1")):
        r = fh(*args, "--warehouse", str(wh_dir))
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "was begun but never made" in r.stderr and "featurehouse ingest" in r.stderr, r.stderr
        assert "schema version 0" not in r.stderr
    r = fh("ingest", str(SEED_FLIGHT), "--warehouse", str(wh_dir), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert fh("sql", "SELECT count(*) AS n FROM features", "--warehouse", str(wh_dir), "--format", "csv").stdout.split() == ["n", "1"]
