"""Found in the outside review of issue 17's fixes (Hardening 2), on a fresh clone.

Each test failed on the code before its fix.
"""

from __future__ import annotations

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
