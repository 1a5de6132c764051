"""Ingesting the same inputs again changes nothing: as duplicates, and with --reprocess."""

from __future__ import annotations

import pytest

from pipeline.config import Settings
from tests.conftest import (
    SEED_FLIGHT,
    SEED_NOT_A_PAGE,
    good_page,
    query,
    run_ingest,
    tables_rows,
    write,
)
from tests.formats import gz, to_api_json, to_flight, to_html

TABLES = ("models", "source_sets", "sources", "features", "activations", "explanations", "quarantine",
          "feature_activation_stats", "source_activation_stats", "raw_inputs")


def _snapshot(wh) -> dict[str, list[tuple]]:
    return tables_rows(wh, TABLES)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("idem")
    inbox = root / "inbox"
    write(inbox / "seed.txt", SEED_FLIGHT.read_bytes())
    write(inbox / "not_a_page.txt", SEED_NOT_A_PAGE.read_bytes())
    write(inbox / "p1.json", to_api_json(good_page(1)))
    write(inbox / "p2.html", to_html(to_flight(good_page(2))))
    write(inbox / "p3.txt.gz", gz(to_flight(good_page(3))))
    write(inbox / "p1_again_as_flight.txt", to_flight(good_page(1)))  # same records, other shape
    settings = Settings(warehouse=root / "wh.duckdb")
    snaps, summaries = [], []
    for reprocess in (False, False, True):
        summaries.append(run_ingest([inbox], settings, reprocess=reprocess))
        snaps.append(_snapshot(settings.warehouse))
    return settings.warehouse, snaps, summaries


def test_first_run_loads(runs):
    wh, snaps, (first, _, _) = runs
    assert (first.n_received, first.n_loaded, first.n_rejected, first.n_duplicates) == (6, 5, 1, 0)
    assert len(snaps[0]["features"]) == 4 and len(snaps[0]["quarantine"]) == 1


@pytest.mark.parametrize("table", TABLES)
def test_second_run_changes_nothing(runs, table):
    _, snaps, (_, second, _) = runs
    assert (second.n_duplicates, second.n_loaded, second.n_rejected) == (6, 0, 0)
    assert snaps[1][table] == snaps[0][table]


@pytest.mark.parametrize("table", TABLES)
def test_reprocess_changes_nothing(runs, table):
    _, snaps, (_, _, third) = runs
    assert (third.n_loaded, third.n_rejected) == (5, 1)
    assert snaps[2][table] == snaps[0][table]


def test_runs_are_all_recorded(runs):
    wh, _, summaries = runs
    assert query(wh, "SELECT count(*), count(DISTINCT run_id) FROM runs WHERE status = 'succeeded'") == [(3, 3)]
    assert query(wh, "SELECT count(*) FROM run_inputs") == [(18,)]
