"""`--format csv` and `--format json` (`sql`, `changes`) write every value as text a reader can
parse back: nested values, blobs, intervals and decimals as JSON text, not Python reprs, and a
HUGEINT without a traceback."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime

from tests.conftest import _empty_warehouse
from tests.test_sql_sandbox import _sql


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


def test_csv_writes_nested_values_as_json_text(capsys):
    """`sql --format csv` and `changes --format csv` wrote [datetime.datetime(2026, 2, 1, 0, 0)]
    and {'a': None}."""
    from pipeline.cli import _print_rows

    _print_rows(["l", "s", "n", "t"], [([datetime(2026, 2, 1)], {"a": None, "b": [1.5]}, 3, datetime(2026, 2, 1))],
                "csv")
    (row,) = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert json.loads(row["l"]) == ["2026-02-01T00:00:00"]
    assert json.loads(row["s"]) == {"a": None, "b": [1.5]}
    assert (row["n"], row["t"]) == ("3", "2026-02-01 00:00:00")
