"""`featurehouse sql` reads and never writes (issue 17, item 1).

Two layers, each tested on its own. The statement check accepts only what DuckDB's own parser
shows to be a read (a SELECT tree whose tables are the warehouse's and whose table functions are
on a short list), so `EXPLAIN ANALYZE COPY`, DuckLake's maintenance functions and `query('...')`
built by string concatenation are refused, while PIVOT, DESCRIBE, SUMMARIZE and EXPLAIN of a
read keep working. And the process that runs the query cannot write the lake at all: a statement
handed straight to the connection, past every check, still fails to write under the data folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.config import Settings
from tests.conftest import FIXTURES, query, run_ingest

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")


def fh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ))


def lake_files(wh: Path) -> dict[str, str]:
    """Every file under the data folder and the catalog, with its content's hash."""
    found = {}
    for path in sorted([*(wh / "data").rglob("*"), wh / "catalog.sqlite"]):
        if path.is_file():
            found[str(path.relative_to(wh))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture(scope="module")
def wh(tmp_path_factory) -> Path:
    wh = tmp_path_factory.mktemp("readonly") / "wh"
    summary = run_ingest([FIXTURES], Settings(warehouse=wh))  # the set-up: the CLI's ingest is tested elsewhere
    assert summary.n_loaded == 1 and summary.status == "succeeded", summary
    return wh


@pytest.fixture
def untouched(wh):
    """Asserts, after the test, that no file of the lake was written, added or removed."""
    before = lake_files(wh)
    yield
    assert lake_files(wh) == before
    # and it still reads whole, through the read-only connection `featurehouse sql` opens (in this
    # process: a CLI process a test cost ~1 CPU-s, 55 tests; the CLI's own reads are the tests')
    assert query(wh, "SELECT count(*) AS n, sum(len(tokens)) AS t FROM activations") == [(39, 26151)]


def a_data_file(wh: Path) -> Path:
    return sorted((wh / "data" / "main" / "features").glob("*.parquet"))[0]


# --- what the statement check refuses -----------------------------------------------------------

WRITES = [
    # runs the COPY: it overwrote a data file, and every later read failed ("Invalid footer length")
    "EXPLAIN ANALYZE COPY (SELECT 1 AS x) TO '{data_file}' (FORMAT parquet)",
    "EXPLAIN ANALYZE COPY (SELECT 1 AS x) TO '{data_dir}/main/features/new.parquet' (FORMAT parquet)",
    "/* c */ EXPLAIN /* c */ ANALYZE COPY (SELECT 1 AS x) TO '{data_dir}/x.csv'",
    "EXPLAIN (ANALYZE, FORMAT json) COPY (SELECT 1 AS x) TO '{data_dir}/x.csv'",
    "EXPLAIN (FORMAT /* ) */ json, ANALYZE) COPY (SELECT 1 AS x) TO '{data_dir}/x.csv'",
    # DuckLake's maintenance: writes Parquet files before the read-only commit fails
    "SELECT * FROM ducklake_merge_adjacent_files('featurehouse')",
    "FROM featurehouse.merge_adjacent_files()",
    "SELECT * FROM ducklake_rewrite_data_files('featurehouse')",
    "SELECT * FROM ducklake_flush_inlined_data('featurehouse')",
    "SELECT * FROM ducklake_expire_snapshots('featurehouse', older_than => now())",
    "SELECT * FROM ducklake_cleanup_old_files('featurehouse', cleanup_all => true)",
    "SELECT * FROM ducklake_delete_orphaned_files('featurehouse', cleanup_all => true)",
    "SELECT * FROM ducklake_add_data_files('featurehouse', 'features', '{data_file}')",
    "FROM featurehouse.set_option('parquet_row_group_size', 10)",
    "SELECT * FROM (SELECT 1) t, LATERAL (SELECT * FROM ducklake_merge_adjacent_files('featurehouse'))",
]


@pytest.mark.parametrize("sql", WRITES)
def test_statements_that_write_are_refused_and_write_nothing(wh, untouched, sql):
    data_file = a_data_file(wh)
    proc = fh("sql", sql.format(data_file=data_file, data_dir=wh / "data"), "--warehouse", str(wh))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "read-only" in proc.stderr, proc.stderr


def _secret_db(tmp_path: Path) -> Path:
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as c:
        c.execute("CREATE TABLE t (x)")
        c.execute("INSERT INTO t VALUES ('hidden')")
    return other


READS_ELSEWHERE = [
    # the scanner ban was a text match: a name built by concatenation went through
    "SELECT * FROM query('SELECT * FROM sqlite' || '_scan(''{other}'', ''t'')')",
    "SELECT * FROM query_table('{other}')",
    "SELECT * FROM sqlite_scan('{other}', 't')",
    "SELECT * FROM sqlite_query('{other}', 'SELECT * FROM t')",
    "SELECT * FROM read_csv('{other}')",
    "SELECT * FROM read_text('{other}')",
    "SELECT * FROM read_blob('{other}')",
    "SELECT * FROM read_parquet('{data_file}')",
    "SELECT * FROM '{other}'",
    "SELECT * FROM \"{other}\"",
    "SELECT (SELECT max(content) FROM read_text('{other}')) AS y",
    "WITH x AS (SELECT 1) SELECT * FROM x, read_text('{other}')",
    "SELECT * FROM json_execute_serialized_sql(json_serialize_sql('SELECT 1'))",
    "SELECT * FROM no_such_function()",
    "DESCRIBE '{other}'",
    "SUMMARIZE SELECT * FROM read_text('{other}')",
    "EXPLAIN ANALYZE SELECT * FROM read_text('{other}')",
]


@pytest.mark.parametrize("sql", READS_ELSEWHERE)
def test_table_functions_off_the_list_are_refused(wh, tmp_path, untouched, sql):
    other = _secret_db(tmp_path)
    proc = fh("sql", sql.format(other=other, data_file=a_data_file(wh)), "--warehouse", str(wh))
    assert proc.returncode == 1, proc.stdout
    assert "hidden" not in proc.stdout and "Traceback" not in proc.stderr
    # the message says what is allowed
    assert "read-only" in proc.stderr and "snapshots" in proc.stderr, proc.stderr


def test_the_message_says_what_is_allowed(wh):
    proc = fh("sql", "SELECT * FROM query('SELECT 1')", "--warehouse", str(wh))
    assert proc.returncode == 1
    msg = proc.stderr
    assert "query" in msg
    for allowed in ("SELECT", "PIVOT", "DESCRIBE", "SUMMARIZE", "EXPLAIN", "the warehouse's tables", "snapshots",
                    "table_changes", "range", "unnest", "--format csv"):
        assert allowed in msg, (allowed, msg)


# --- reads keep working --------------------------------------------------------------------------

READS = [
    # a bare PIVOT is two statements to DuckDB (an enum of the values, then the SELECT): a read
    ("PIVOT activations ON data_source USING count(*) GROUP BY feature_index", "feature_index,Chat,Non-Chat"),
    ("PIVOT activations ON data_source USING count(*) GROUP BY feature_index ORDER BY 1", "45698,19,20"),
    ("SELECT * FROM (PIVOT activations ON data_source USING count(*) GROUP BY feature_index)", "45698,19,20"),
    ("PIVOT (SELECT data_source, max_value FROM activations) ON data_source USING max(max_value)", "366.75"),
    ("WITH p AS (PIVOT activations ON data_source USING max(max_value) GROUP BY feature_index) "
     "SELECT count(*) AS n FROM p", "n\n1"),
    ("SELECT 1 AS one; PIVOT activations ON data_source, model_id USING count(*) GROUP BY feature_index",
     "Chat_gpt-oss-20b"),
    ("PIVOT activations ON data_source IN ('Chat', 'Non-Chat') USING count(*) GROUP BY feature_index", "45698,19,20"),
    ("UNPIVOT (SELECT 1 AS a, 2 AS b) ON a, b INTO NAME k VALUE v", "a,1"),
    ("DESCRIBE features", "feature_index"),
    ("SHOW TABLES", "activations"),
    ("SHOW ALL TABLES", "activations"),
    ("SUMMARIZE activations", "max_value"),
    ("EXPLAIN SELECT count(*) FROM activations", "physical_plan"),
    ("EXPLAIN ANALYZE SELECT count(*) FROM activations", "analyzed_plan"),
    ("EXPLAIN (FORMAT json) SELECT count(*) FROM activations", "physical_plan"),
    ("EXPLAIN (ANALYZE, FORMAT \"json\") SELECT count(*) FROM activations", "analyzed_plan"),
    ("SELECT count(*) AS n FROM activations AT (VERSION => 3)", "n"),
    ("SELECT count(*) > 0 AS ok FROM featurehouse.snapshots()", "true"),
    ("SELECT count(*) > 0 AS ok FROM snapshots()", "true"),
    ("SELECT count(*) >= 0 AS ok FROM featurehouse.table_changes('features', 1, 3)", "true"),
    ("SELECT count(*) > 0 AS ok FROM featurehouse.table_info()", "true"),
    ("SELECT count(*) > 0 AS ok FROM ducklake_snapshots('featurehouse')", "true"),
    ("SELECT count(*) > 0 AS ok FROM ducklake_table_info('featurehouse')", "true"),
    ("SELECT sum(range) AS s FROM range(4)", "6"),
    ("SELECT sum(generate_series) AS s FROM generate_series(1, 3)", "6"),
    ("SELECT unnest([1, 2]) AS u", "2"),
    ("SELECT count(*) > 0 AS ok FROM information_schema.tables", "true"),
    ("SELECT count(*) > 0 AS ok FROM duckdb_tables()", "true"),
    ("VALUES (1, 'a')", "a"),
    ("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 3) SELECT max(n) AS m FROM r", "3"),
    ("SELECT 1 AS a; SELECT 2 AS b", "b"),
    ("SELECT (SELECT count(*) FROM features) AS n, upper('x') AS u", "X"),
]


@pytest.mark.parametrize(("sql", "expected"), READS)
def test_reads_keep_working(wh, untouched, sql, expected):
    proc = fh("sql", sql, "--warehouse", str(wh), "--format", "csv", "--max-rows", "1000")
    assert proc.returncode == 0, proc.stderr
    assert expected.lower() in proc.stdout.lower(), proc.stdout[:2000]


# --- the process cannot write the lake, whatever reaches the connection --------------------------

INJECT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from pipeline.lake import warehouse

    wh, data_file = Path(sys.argv[1]), Path(sys.argv[2])
    if hasattr(warehouse, "open_for_queries"):
        conn = warehouse.open_for_queries(wh)
    else:  # what `featurehouse sql` opened before issue 17
        conn = warehouse.connect(wh, read_only=True)
        warehouse.sandbox(conn)
    for sql in sys.argv[3:]:
        try:
            conn.execute(sql)
            print("RAN", sql)
        except Exception as exc:
            print("REFUSED", sql, "|", str(exc).splitlines()[0])
    try:
        with open(data_file, "r+b") as f:
            f.write(b"x")
        print("RAN python write")
    except OSError as exc:
        print("REFUSED python write |", exc)
    print(conn.execute("SELECT count(*) FROM activations").fetchone()[0])
""")


def test_a_statement_that_slips_past_the_checks_still_cannot_write_the_lake(wh, untouched):
    """Straight to the connection `featurehouse sql` runs queries on, no statement check: the
    process itself cannot write under the data folder (nor the catalog)."""
    data_file = a_data_file(wh)
    statements = [
        f"COPY (SELECT 1 AS x) TO '{data_file}' (FORMAT parquet)",
        f"COPY (SELECT range AS x FROM range(1000000)) TO '{wh / 'data' / 'main' / 'features' / 'new.parquet'}'",
        f"EXPLAIN ANALYZE COPY (SELECT 1 AS x) TO '{wh / 'data' / 'x.csv'}'",
        "SELECT * FROM ducklake_merge_adjacent_files('featurehouse')",  # small files to merge: it writes
    ]
    proc = subprocess.run([sys.executable, "-c", INJECT, str(wh), str(data_file), *statements],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(" | ")[0] for line in lines[:-1]] == [f"REFUSED {sql}" for sql in statements] + [
        "REFUSED python write"], proc.stdout
    assert all("Permission denied" in line for line in lines[:-1]), proc.stdout  # the kernel's answer
    assert lines[-1] == "39"


HOLD = textwrap.dedent("""
    import sys
    from pipeline.lake import warehouse

    conn = warehouse.open_for_queries(sys.argv[1])
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            print(*conn.execute(line).fetchone(), flush=True)
        except Exception as exc:
            print("failed:", str(exc).splitlines()[0], flush=True)
""")


def test_queries_go_on_while_writers_commit(tmp_path):
    """A confined reader still updates the catalog's write-ahead-log index (catalog.sqlite-shm),
    as every SQLite reader must; a writer that closes the catalog last deletes that file and the
    next reader would have to create it, which the confined process cannot: it keeps the catalog
    open, so the file stays. Found by a `featurehouse sql` during a long ingest ("attempt to write
    a readonly database")."""
    from pipeline.config import Settings
    from pipeline.lake import warehouse
    from tests.conftest import good_page, run_ingest

    page = tmp_path / "page.json"
    page.write_text(json.dumps(good_page(7), default=str))
    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([page], settings)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(settings.warehouse)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        for n in range(3):
            writer = warehouse.connect(settings)
            writer.execute(f"CREATE OR REPLACE TABLE scratch AS SELECT range AS x FROM range({n + 1})")
            writer.close()  # the last connection of its own: SQLite would delete the index now
            proc.stdin.write("SELECT (SELECT count(*) FROM activations), (SELECT count(*) FROM scratch)\n")
            proc.stdin.flush()
            assert proc.stdout.readline().split() == ["3", str(n + 1)]
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
