"""`featurehouse sql` is a sandbox: queries read the warehouse and nothing else, and write nothing.

Layers, each tested on its own: the statement check accepts only reads (a SELECT tree, by
DuckDB's parser, over the warehouse's tables and listed table functions); the connection it
opens (``warehouse.sandbox``) cannot read files outside the warehouse's data, attach databases
or load extensions, whatever the statement, and its configuration is locked; and the process
cannot write the lake at all (tests/test_sql_readonly.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from pipeline.config import Settings
from pipeline.lake import warehouse
from pipeline.lake.warehouse import RefusedQuery, check_read_only
from tests.conftest import (
    FIXTURES,
    _empty_warehouse,
    run_ingest,
)

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")


def fh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ))


@pytest.fixture(scope="module")
def wh(tmp_path_factory) -> Path:
    wh = tmp_path_factory.mktemp("sandbox") / "wh"
    summary = run_ingest([FIXTURES], Settings(warehouse=wh))  # the set-up: the CLI's ingest is tested elsewhere
    assert summary.n_loaded == 1 and summary.status == "succeeded", summary
    return wh


@pytest.fixture
def target(tmp_path) -> Path:
    return tmp_path / "escaped.csv"


# Statements that are not queries: the CLI refuses them before opening anything.
NOT_QUERIES = [
    "COPY (SELECT * FROM features) TO '{target}'",
    "COPY features TO '{target}' (FORMAT csv)",
    "EXPORT DATABASE '{dir}'",
    "ATTACH '{dir}/other.duckdb' AS other",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "RESET lock_configuration",
    "CREATE TABLE x AS SELECT 1",
    "DELETE FROM features",
    "CALL featurehouse.set_option('parquet_row_group_size', 10)",
    "SELECT 1; COPY (SELECT 1) TO '{target}'",
]


@pytest.mark.parametrize("sql", NOT_QUERIES)
def test_the_cli_refuses_every_statement_that_is_not_a_query(wh, target, sql):
    proc = fh("sql", sql.format(target=target, dir=target.parent), "--warehouse", str(wh))
    assert proc.returncode != 0
    assert "read-only and runs queries only" in proc.stderr and "Traceback" not in proc.stderr
    assert not target.exists() and not (target.parent / "other.duckdb").exists()


# Queries that try to reach outside the warehouse: the statement check refuses the file readers
# and DuckLake's maintenance; the sandboxed connection refuses the rest (glob outside the data).
ESCAPING_QUERIES = [
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT * FROM read_text('/etc/hostname')",
    "SELECT * FROM glob('/etc/*')",
    "SELECT * FROM read_json('{dir}/../../../../etc/passwd')",
    # the warehouse is attached read-only: DuckLake's maintenance functions cannot write through it
    "SELECT * FROM ducklake_expire_snapshots('featurehouse', older_than => now())",
]


@pytest.mark.parametrize("sql", ESCAPING_QUERIES)
def test_a_query_cannot_read_or_write_outside_the_warehouse(wh, tmp_path, sql):
    proc = fh("sql", sql.format(dir=tmp_path, catalog=wh / "catalog.sqlite"), "--warehouse", str(wh))
    assert proc.returncode != 0, proc.stdout
    assert ("query failed" in proc.stderr or "featurehouse sql is read-only" in proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr
    assert "root:" not in proc.stdout


@pytest.mark.parametrize("sql", [
    "SELECT * FROM sqlite_scan('{other}', 'secret')",
    "SELECT * FROM SQLITE_SCAN ('{other}', 'secret')",
    "SELECT (SELECT x FROM sqlite_scan('{other}', 'secret')) AS y",
    "SELECT * FROM sqlite_scan('{catalog}', 'ducklake_snapshot')",
    "SELECT * FROM postgres_scan('host=127.0.0.1 dbname=postgres', 'public', 't')",
    "SELECT * FROM postgres_query('featurehouse', 'SELECT 1')",
])
def test_scanner_functions_are_refused(wh, tmp_path, sql):
    """sqlite_scan opens any SQLite file itself (not through DuckDB's file system, so the
    sandbox's allowed_directories does not stop it): found reading a file outside the warehouse.
    No scanner is on the list of table functions, however its name is written."""
    import sqlite3

    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as c:
        c.execute("CREATE TABLE secret (x)")
        c.execute("INSERT INTO secret VALUES ('hidden')")
    proc = fh("sql", sql.format(other=other, catalog=wh / "catalog.sqlite"), "--warehouse", str(wh))
    assert proc.returncode != 0
    assert "refused the table function" in proc.stderr and "Traceback" not in proc.stderr
    assert "hidden" not in proc.stdout


def test_queries_over_the_warehouse_still_work(wh):
    proc = fh("sql", "SELECT count(*) AS n FROM activations", "--warehouse", str(wh), "--format", "csv")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["n", "39"]
    # the data files themselves are inside the sandbox (it is where the tables live)
    data = wh / "data"
    proc = fh("sql", f"SELECT count(*) > 0 AS ok FROM glob('{data}/**/*.parquet')", "--warehouse", str(wh),
              "--format", "csv")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "true"]


@pytest.mark.parametrize("sql", [
    "COPY (SELECT 1) TO '{target}'",
    "ATTACH '{dir}/other.duckdb' AS other",
    "INSTALL httpfs",
    "LOAD '{ext}'",
    "SET enable_external_access = true",
    "SET allowed_directories = ['/']",
    "SELECT * FROM read_csv('/etc/passwd')",
])
def test_the_sandboxed_connection_alone_refuses_escapes(wh, target, sql):
    """Without the CLI's statement filter: the connection itself refuses."""
    conn = warehouse.connect(Settings.from_env(warehouse=wh), read_only=True)
    try:
        warehouse.sandbox(conn)
        with pytest.raises(duckdb.Error):
            conn.execute(sql.format(target=target, dir=target.parent, ext=warehouse.extension_path("httpfs")))
        assert conn.execute("SELECT count(*) FROM features").fetchone() == (1,)
    finally:
        conn.close()
    assert not target.exists() and not (target.parent / "other.duckdb").exists()


_SQLISH = ["'", "''", "\\", "\\'", "E'", "$$", "$a$", "--", "/*", "*/", ";", "?", "$1", "\n", "\r", "\t",
           "SELECT 1", "COPY t TO 'x'", "é", "\u202e", "\U0001f600", "\x1b", "\ufeff", "\x7f"]


@given(st.lists(st.one_of(st.sampled_from(_SQLISH), st.text(max_size=8)), max_size=12).map("".join))
@hyp_settings(max_examples=300, deadline=None)
def test_the_statement_check_parses_exactly_the_text_it_was_given(text):
    """The check serialises the statement as an SQL literal (a bound parameter would import
    pandas); for any text DuckDB's parser must see the same statement as when it is bound."""
    conn = duckdb.connect()
    bound = conn.execute("SELECT json_serialize_sql(?)", [text]).fetchone()[0]
    assert warehouse._serialized_json(conn, text) == bound


# --- `featurehouse sql`: a CTE's name is not a CTE everywhere in the WITH -------------------------
#
# The statement check took every CTE name of a WITH as a CTE in all of its bodies. DuckDB binds a
# name that a body gives to itself (outside the recursive part of a recursive CTE) or to a later
# CTE as a table — or, for a name like 'x.csv', as the file: these read a file that the check
# took for a CTE. (The process's confinement still kept the read inside the data folder.)

CTE_FILE_READS = [
    'WITH a AS (FROM "{f}"), "{f}" AS (SELECT 1) FROM a',
    'WITH RECURSIVE a AS (FROM "{f}"), "{f}" AS (SELECT 1) FROM a',
    'WITH RECURSIVE "{f}" AS (FROM "{f}") FROM "{f}"',
    'WITH "{f}" AS (SELECT 1 AS a, 2 AS b UNION ALL FROM "{f}" WHERE a < 0) FROM "{f}"',
    'WITH RECURSIVE "{f}" AS (FROM "{f}" UNION ALL SELECT 5 AS a, 6 AS b WHERE false) FROM "{f}"',
    'WITH a AS (WITH b AS (FROM "{f}") FROM b), "{f}" AS (SELECT 1) FROM a',
    'SELECT * FROM (WITH a AS (FROM "{f}"), "{f}" AS (SELECT 1) FROM a)',
]


@pytest.mark.parametrize("sql", CTE_FILE_READS)
def test_a_name_a_cte_body_gives_to_itself_or_a_later_cte_is_not_taken_for_a_cte(tmp_path, sql):
    f = tmp_path / "x.csv"
    f.write_text("a,b\n1,2\n")
    text = sql.format(f=f)
    # what DuckDB does with it: reads the file
    assert duckdb.connect().execute(text).fetchall() == [(1, 2)]
    with pytest.raises(RefusedQuery, match="not a table of the warehouse"):
        check_read_only(duckdb.connect(), text)


CTE_READS = [
    "WITH a AS (SELECT 1 AS x), b AS (SELECT x FROM a) SELECT * FROM b",
    "WITH RECURSIVE r AS (SELECT 1 AS x UNION ALL SELECT x + 1 FROM r WHERE x < 3) SELECT * FROM r",
    "WITH RECURSIVE r AS (SELECT 1 AS x UNION ALL SELECT x + 1 FROM (FROM r) t WHERE x < 3) FROM r",
    "WITH a AS (SELECT 1 AS x) SELECT * FROM (WITH b AS (SELECT * FROM a) SELECT * FROM b)",
    "WITH a AS (SELECT 1 AS x), b AS (WITH c AS (FROM a) FROM c) FROM b",
    "WITH a AS MATERIALIZED (SELECT 1 AS x) FROM a, a AS a2",
]


@pytest.mark.parametrize("sql", CTE_READS)
def test_ctes_naming_earlier_ones_and_recursive_ctes_are_still_accepted(sql):
    conn = duckdb.connect()
    check_read_only(conn, sql)
    assert conn.execute(sql).fetchall()


def _sql(warehouse, statement: str, fmt: str):
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.run([str(Path(sys.executable).with_name("featurehouse")), "sql", statement, "--warehouse",
                           str(warehouse), "--format", fmt], capture_output=True, text=True, timeout=120)


def test_glob_cannot_step_out_of_the_data_folder_with_dot_dot(tmp_path):
    """glob('<data>/../catalog.sqlite') listed the catalog: DuckDB's allowed_directories let the
    '..' through."""
    warehouse = _empty_warehouse(tmp_path)
    r = _sql(warehouse, f"SELECT * FROM glob('{warehouse}/data/../catalog.sqlite')", "csv")
    assert r.returncode != 0 and "catalog.sqlite" not in r.stdout, r.stdout
    assert "glob()" in r.stderr and "Traceback" not in r.stderr, r.stderr
    ok = _sql(warehouse, f"SELECT count(*) AS n FROM glob('{warehouse}/data/**/*.parquet')", "csv")
    assert ok.returncode == 0, ok.stderr
