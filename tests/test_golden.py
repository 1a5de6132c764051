"""Golden test: one page in every shape loads to identical rows.

The seed page is written as API JSON, flight text, saved HTML and gzip of each (tests/formats.py,
an encoder independent of the pipeline), and compared with the real seed capture. A second,
"enriched" page adds what the seed does not exercise: strings long enough for T rows, strings
that start with "$", characters the HTML must escape, a key whose value is undefined, an
activation with a NULL data source and a date among the extra fields.
"""

from __future__ import annotations

import functools
from datetime import datetime
from pathlib import Path

import pytest

from pipeline.config import Settings
from tests.conftest import (
    BAD_ACTIVATION,
    SEED_FLIGHT,
    open_warehouse,
    query,
    run_ingest,
    seed_page_copy,
    tables_rows,
    write,
)
from tests.formats import UNDEFINED, all_formats

TABLES = ("features", "activations", "explanations", "models", "sources", "source_sets")
FORMATS = ("api_json", "flight", "html", "gzip+api_json", "gzip+flight", "gzip+html")


def enriched_page() -> dict:
    page = seed_page_copy()
    long_text = "Ünïcödé “quoted” 北京 & <b> \u2028 line\nbreak " * 40  # > 1024 chars, multibyte
    page["explanations"][0]["description"] = long_text
    page["explanations"].append({"id": "exp-dollar", "description": "$5 or $$ money", "typeName": "oai",
                                 "explanationModelName": UNDEFINED, "scores": [0.5]})
    page["umap_cluster"] = UNDEFINED
    page["vectorLabel"] = "$L14 is not a lazy reference here"
    a = page["activations"][0]
    a["tokens"] = [("$" + t if i % 7 == 0 else t) for i, t in enumerate(a["tokens"])]
    a["tokens"][1] = "x" * 1500  # its own T row, inside a list
    a["dataSource"] = None
    a["logitContributions"] = "{\"a\": \"" + "é" * 1100 + "\"}"
    page["source"]["updatedAt"] = datetime(2025, 9, 11, 8, 50, 59, 351000)  # a date in `extra`
    page["model"]["note"] = "< & > \u2029"
    return page


def _ingest_one(tmp_path_factory, name: str, data: bytes):
    root = tmp_path_factory.mktemp(name.replace("+", "_"))
    settings = Settings(warehouse=root / "wh.duckdb")
    summary = run_ingest([write(root / "in" / "page.bin", data)], settings)
    return settings.warehouse, summary


@pytest.fixture(scope="module")
def seed_loads(tmp_path_factory):
    shapes = all_formats(seed_page_copy(), seed=1)
    shapes["seed_capture"] = SEED_FLIGHT.read_bytes()
    return {name: _ingest_one(tmp_path_factory, f"seed_{name}", data) for name, data in shapes.items()}


@pytest.fixture(scope="module")
def enriched_loads(tmp_path_factory):
    shapes = all_formats(enriched_page(), seed=2)
    return {name: _ingest_one(tmp_path_factory, f"rich_{name}", data) for name, data in shapes.items()}


def test_each_format_is_detected_and_loaded(seed_loads):
    for name, (wh, summary) in seed_loads.items():
        assert summary.status == "succeeded" and summary.n_loaded == 1 and summary.n_rejected == 0, name
        (fmt,) = query(wh, "SELECT format FROM raw_inputs")[0]
        expected = "flight" if name == "seed_capture" else name
        assert fmt == expected, name


def test_seed_capture_loads_what_the_page_holds(seed_loads):
    page = seed_page_copy()
    wh, _ = seed_loads["seed_capture"]
    good_ids = sorted(a["id"] for a in page["activations"] if len(a["tokens"]) == len(a["values"]))
    assert len(good_ids) == 39
    assert [i for (i,) in query(wh, "SELECT activation_id FROM activations ORDER BY 1")] == good_ids
    assert query(wh, "SELECT record_key, check_name FROM quarantine") == [(BAD_ACTIVATION, "tokens_values_same_length")]


@functools.cache
def _rows(warehouse: Path) -> dict[str, list[tuple]]:
    """A load's rows of every table in ``TABLES`` (as ``table_rows`` reads them), through one connection
    once for all the tests that compare them (the module's loads are not written after their
    fixture made them; a connection a table and a test was 66 warehouse openings, ~0.3 CPU-s each)."""
    return tables_rows(warehouse, TABLES)


@pytest.mark.parametrize("name", [*FORMATS])
@pytest.mark.parametrize("table", TABLES)
def test_seed_page_rows_identical_in_every_format(seed_loads, name, table):
    reference = _rows(seed_loads["seed_capture"][0])[table]
    assert reference, f"{table} is empty for the seed capture"
    assert _rows(seed_loads[name][0])[table] == reference


@pytest.mark.parametrize("name", [f for f in FORMATS if f != "api_json"])
@pytest.mark.parametrize("table", TABLES)
def test_enriched_page_rows_identical_in_every_format(enriched_loads, name, table):
    reference = _rows(enriched_loads["api_json"][0])[table]
    assert reference
    assert _rows(enriched_loads[name][0])[table] == reference


def test_enriched_page_values_survive(enriched_loads):
    """The encodings decode to the values written, not merely to the same thing in each format."""
    page = enriched_page()
    for name, (wh, _) in enriched_loads.items():
        with open_warehouse(wh) as conn:  # one connection a load, not one a query (~0.3 CPU-s each)
            def read(sql, params=None, conn=conn):
                return conn.execute(sql, params or []).fetchall()

            (desc,) = read("SELECT description FROM explanations WHERE explanation_id = ?",
                           [page["explanations"][0]["id"]])[0]
            assert desc == page["explanations"][0]["description"], name
            assert read("SELECT description, explanation_model FROM explanations WHERE explanation_id = 'exp-dollar'") \
                == [("$5 or $$ money", None)], name
            a = page["activations"][0]
            (tokens, ds, logits) = read("SELECT tokens, data_source, logit_contributions FROM activations "
                                        "WHERE activation_id = ?", [a["id"]])[0]
            assert tokens == a["tokens"] and ds is None and logits == a["logitContributions"], name
            (label, cluster) = read("SELECT extra->>'vectorLabel', extra->>'umap_cluster' FROM features")[0]
            assert label == "$L14 is not a lazy reference here" and cluster is None, name
            assert read("SELECT extra->>'note' FROM models") == [("< & > \u2029",)], name
