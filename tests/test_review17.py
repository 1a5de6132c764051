"""Found in the outside review of issue 17's fixes (Hardening 2), on a fresh clone.

Each test failed on the code before its fix.
"""

from __future__ import annotations

import duckdb
import pytest

from pipeline.lake.warehouse import RefusedQuery, check_read_only

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
