"""Found in the outside review of issue 17's fixes (Hardening 2), on a fresh clone.

Each test failed on the code before its fix.
"""

from __future__ import annotations

import contextlib

import duckdb
import pytest

from pipeline.lake.warehouse import RefusedQuery, check_read_only
from tests.conftest import good_page, query, run_ingest
from tests.formats import to_flight

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


# --- flight text: a BigInt past 64 bits in a record stopped every run ------------------------------
#
# ``"$n<digits>"`` was decoded to an exact Python int; a record holding one past 64 bits (a value,
# dataIndex, an extra field) made the run end in a traceback (``TypeError: Integer exceeds 64-bit
# range`` writing the record out as JSON), so no page of the folder loaded, at every re-run; in a
# score it was refused as "could not be parsed (TypeError ...)", and over 4,300 digits as
# "could not be parsed (ValueError ...)".


def _flight_with(index: int, placeholder_at, big: str) -> bytes:
    page = good_page(index)
    placeholder_at(page)
    text = to_flight(page, outline=0.0)
    assert text.count(b'"XX"') == 1
    return text.replace(b'"XX"', b'"$n' + big.encode() + b'"')


def test_a_bigint_past_64_bits_in_flight_text_does_not_stop_the_run(tmp_path, settings):
    big = "9" * 30
    pages = {
        "data_index": _flight_with(101, lambda p: p["activations"][0].__setitem__("dataIndex", "XX"), big),
        "extra": _flight_with(102, lambda p: p.__setitem__("extraField", "XX"), big),
        "score": _flight_with(103, lambda p: p["explanations"][0].__setitem__("scores", ["XX"]), big),
        "token": _flight_with(104, lambda p: p["activations"][0]["tokens"].__setitem__(1, "XX"), "9" * 5000),
        "value": _flight_with(105, lambda p: p["activations"][1]["values"].__setitem__(1, "XX"), big),
    }
    folder = tmp_path / "in"
    folder.mkdir()
    for name, data in pages.items():
        (folder / f"{name}.txt").write_bytes(data)
    (folder / "good.txt").write_bytes(to_flight(good_page(106)))
    summary = run_ingest([folder], settings)
    assert summary.status == "succeeded"
    assert summary.n_rejected == 0 and summary.n_loaded == 6
    assert query(settings, "SELECT count(*) FROM features")[0][0] == 6
    assert query(settings, "SELECT data_index FROM activations WHERE feature_index = 101 AND data_index IS NOT NULL") \
        == [("1e+30",)]


# --- a full disk under the catalog -----------------------------------------------------------------
#
# SQLite says "database or disk is full" when a commit cannot be written: that matched the commit
# conflicts' pattern ("Failed to commit DuckLake transaction"), so it was retried 8 times over
# ~11 s, logged as "commit conflict", then reported as "still conflicting after 8 attempts", with
# four tracebacks when the run's end could not be recorded. And a catalog whose write-ahead-log
# index could not be made on the full disk ("disk I/O error") was called unreadable: "restore it
# from a backup, or move it away to start a new warehouse" — which loses a sound warehouse.


def test_a_full_disk_is_not_a_commit_conflict():
    from pipeline.lake.landing import disk_full
    from pipeline.lake.warehouse import is_conflict

    full = duckdb.TransactionException('TransactionContext Error: Failed to commit: Failed to commit DuckLake '
                                       'transaction.\nFailed to commit: Failed to execute query "COMMIT": '
                                       'database or disk is full')
    assert not is_conflict(full) and disk_full(full)
    busy = duckdb.TransactionException("TransactionContext Error: Failed to commit: Failed to commit DuckLake "
                                       "transaction.\nFailed to commit: database is locked")
    assert is_conflict(busy) and not disk_full(busy)


def test_a_catalog_on_a_full_disk_is_said_to_be_on_a_full_disk_not_damaged(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from pipeline.config import Settings
    from tests.formats import to_api_json

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("no tmpfs can be mounted here")
    fh = str(Path(sys.executable).with_name("featurehouse"))
    try:
        (tmp_path / "in").mkdir()
        (tmp_path / "in" / "a.json").write_bytes(to_api_json(good_page(1)))
        wh = disk / "wh"
        assert run_ingest([tmp_path / "in"], Settings(warehouse=wh)).status == "succeeded"  # the set-up
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)  # the disk fills up
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * (64 << 10)):
                pass
        os.close(fd)
        (wh / "catalog.sqlite-shm").unlink(missing_ok=True)
        (tmp_path / "in" / "b.json").write_bytes(to_api_json(good_page(2)))
        for args in (["status"], ["ingest", str(tmp_path / "in"), "--no-progress"]):
            proc = subprocess.run([fh, *args, "--warehouse", str(wh)], capture_output=True, text=True, timeout=300)
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert "Traceback" not in proc.stderr and "conflict" not in proc.stderr, proc.stderr
            assert "the disk that holds it is full" in proc.stderr, proc.stderr
            assert "restore it from a backup" not in proc.stderr, proc.stderr
        os.unlink(disk / "filler")  # once there is room, the warehouse is as it was
        proc = subprocess.run([fh, "ingest", str(tmp_path / "in"), "--warehouse", str(wh), "--no-progress"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert sorted(r[0] for r in query(wh, "SELECT feature_index FROM features")) == [1, 2]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_capture_dated_in_the_future_does_not_beat_later_captures(tmp_path):
    """A file whose mtime was in the future (a wrong clock, ``touch -d 2099``) kept its feature
    for ever: every later capture, older by its own time, lost to it."""
    import os

    from pipeline.config import Settings
    from tests.conftest import write
    from tests.formats import to_api_json

    settings = Settings(warehouse=tmp_path / "wh")
    old = good_page(7, source="future-src")
    old["explanations"][0]["description"] = "from a clock that ran ahead"
    first = write(tmp_path / "a" / "page.json", to_api_json(old))
    os.utime(first, (4070908800, 4070908800))  # 2099-01-01
    assert run_ingest([first], settings).n_loaded == 1
    new = good_page(7, source="future-src")
    new["explanations"][0]["description"] = "captured later"
    second = write(tmp_path / "b" / "page.json", to_api_json(new))
    assert run_ingest([second], settings).status == "succeeded"
    assert query(settings.warehouse, "SELECT description FROM explanations") == [("captured later",)]
    (when,) = query(settings.warehouse, "SELECT max(captured_at) FROM raw_inputs")[0]
    assert when.year < 2099


def _empty_warehouse(tmp_path):
    from pipeline.config import Settings
    from pipeline.lake import warehouse as wh

    settings = Settings(warehouse=tmp_path / "wh")
    wh.connect(settings, create=True).close()
    return settings.warehouse


def _sql(warehouse, statement: str, fmt: str):
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.run([str(Path(sys.executable).with_name("featurehouse")), "sql", statement, "--warehouse",
                           str(warehouse), "--format", fmt], capture_output=True, text=True, timeout=120)


def test_sql_csv_and_json_write_every_value_as_json_text_and_a_hugeint_does_not_crash(tmp_path):
    """A HUGEINT ended `sql --format csv|json` in a traceback (orjson: "Integer exceeds 64-bit
    range"); a BLOB came out as b'x', an INTERVAL as "1 day, 0:00:00", a DECIMAL as a string."""
    import json

    warehouse = _empty_warehouse(tmp_path)
    statement = ("SELECT 18446744073709551616::HUGEINT AS h, [18446744073709551616::HUGEINT] AS hl, "
                 "'x'::BLOB AS b, ['x'::BLOB] AS bl, [INTERVAL 1 DAY, INTERVAL 90 MINUTE] AS i, "
                 "{'b': [1.5::DECIMAL(4, 1)]} AS s")
    csv_out = _sql(warehouse, statement, "csv")
    assert csv_out.returncode == 0 and "Traceback" not in csv_out.stderr, csv_out.stderr
    assert csv_out.stdout.splitlines()[1] == ('18446744073709551616,[18446744073709551616],x,"[""x""]",'
                                              '"[""1 day"",""01:30:00""]","{""b"":[1.5]}"')
    json_out = _sql(warehouse, statement, "json")
    assert json_out.returncode == 0 and "Traceback" not in json_out.stderr, json_out.stderr
    assert json.loads(json_out.stdout) == [{"h": 18446744073709551616, "hl": [18446744073709551616], "b": "x",
                                            "bl": ["x"], "i": ["1 day", "01:30:00"], "s": {"b": [1.5]}}]


def test_glob_cannot_step_out_of_the_data_folder_with_dot_dot(tmp_path):
    """glob('<data>/../catalog.sqlite') listed the catalog: DuckDB's allowed_directories let the
    '..' through."""
    warehouse = _empty_warehouse(tmp_path)
    r = _sql(warehouse, f"SELECT * FROM glob('{warehouse}/data/../catalog.sqlite')", "csv")
    assert r.returncode != 0 and "catalog.sqlite" not in r.stdout, r.stdout
    assert "glob()" in r.stderr and "Traceback" not in r.stderr, r.stderr
    ok = _sql(warehouse, f"SELECT count(*) AS n FROM glob('{warehouse}/data/**/*.parquet')", "csv")
    assert ok.returncode == 0, ok.stderr


def test_a_warehouse_this_user_may_not_write_is_said_so_not_a_traceback(tmp_path):
    """A read-only folder ended `ingest` in a PermissionError traceback; a read-only copy of a
    warehouse was called damaged ("restore it from a backup, or move it away")."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import FIXTURES

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop the override of file permissions")
    fh = [str(Path(sys.executable).with_name("featurehouse"))]
    as_user = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    r = subprocess.run(as_user + fh + ["ingest", str(FIXTURES), "--warehouse", str(ro / "wh"), "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "permission denied" in r.stderr and str(ro / "wh") in r.stderr

    warehouse = _empty_warehouse(tmp_path)
    for p in [warehouse, *warehouse.rglob("*")]:
        p.chmod(p.stat().st_mode & ~0o222)
    r = subprocess.run(as_user + fh + ["ingest", str(FIXTURES), "--warehouse", str(warehouse), "--no-progress",
                                       "--reprocess"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "may not write" in r.stderr and "restore it from a backup" not in r.stderr, r.stderr
    for p in [warehouse, *warehouse.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)


def test_migrate_of_an_sqlite_file_says_what_it_is_and_fetches_nothing(tmp_path):
    """A lakehouse catalog renamed featurehouse.duckdb made `migrate` try to download DuckDB's
    SQLite extension, and quote that failed download."""
    import shutil

    from pipeline.config import Settings
    from pipeline.lake.legacy import LegacyMigrationError, migrate_file

    old = tmp_path / "featurehouse.duckdb"
    shutil.copy(_empty_warehouse(tmp_path) / "catalog.sqlite", old)
    with pytest.raises(LegacyMigrationError, match="is an SQLite database, not a featurehouse 0.1 warehouse"):
        migrate_file(old, Settings(warehouse=tmp_path / "new"))
    assert not (tmp_path / "new").exists()
