"""A run id names files (reports/<run_id>.html, the run's Data Docs): one that could point
anywhere else is refused by the library, whichever entry point passes it, and by the CLI as a
usage error, before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline import Settings, ingest
from pipeline.cli import cli
from pipeline.names import BadRunId, check_run_id
from pipeline.outputs.report import write_report
from pipeline.sources.fetch import ingest_fetched
from tests.conftest import FIXTURES

BAD = ["../../escaped", "../escaped", "/tmp/escaped", "a/b", ".hidden", "..", "", "two words",
       "tab\there", "nul\0", "back\\slash", "index", "INDEX", "x" * 201, "caf\u00e9\u2028"]
GOOD = ["run-20261129T211500Z-1a2b3c", "airflow-featurehouse_nightly-20261128T030000Z", "run-a", "r1",
        "manual__2026-11-28T03:00:00+00:00", "x" * 200, "v1.2"]


@pytest.mark.parametrize("run_id", BAD)
def test_bad_run_ids_are_refused(run_id):
    with pytest.raises(BadRunId, match="run id"):
        check_run_id(run_id)


@pytest.mark.parametrize("run_id", GOOD)
def test_good_run_ids_pass(run_id):
    assert check_run_id(run_id) == run_id


def _nothing_escaped(root: Path) -> None:
    assert not list(root.rglob("escaped*")), "something was written under the bad run id"


def test_ingest_refuses_a_run_id_that_leaves_reports(tmp_path):
    settings = Settings.from_env(warehouse=tmp_path / "a" / "b" / "featurehouse.duckdb")
    with pytest.raises(BadRunId):
        ingest([FIXTURES], settings, progress=False, run_id="../../escaped")
    _nothing_escaped(tmp_path)
    assert not settings.warehouse.exists(), "the run was refused before the warehouse was opened"


def test_ingest_fetched_refuses_it_too(tmp_path):
    settings = Settings.from_env(warehouse=tmp_path / "a" / "featurehouse.duckdb")
    with pytest.raises(BadRunId):
        ingest_fetched("w", settings, run_id="../escaped", progress=False)
    _nothing_escaped(tmp_path)


def test_report_refuses_it(tmp_path):
    settings = Settings.from_env(warehouse=tmp_path / "a" / "featurehouse.duckdb")
    ingest([], settings, progress=False, run_id="fine")
    with pytest.raises(BadRunId):
        write_report(settings.warehouse, "../../escaped", settings=settings)
    _nothing_escaped(tmp_path)


@pytest.mark.parametrize("command, option", [("ingest", "--run-id"), ("report", "--run")])
def test_cli_turns_it_into_a_usage_error(tmp_path, command, option):
    wh = tmp_path / "a" / "b" / "featurehouse.duckdb"
    args = [command, *([str(FIXTURES)] if command == "ingest" else []), option, "../../escaped",
            "--warehouse", str(wh)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output  # click's usage error
    assert f"Invalid value for {option}" in res.output and "run id '../../escaped'" in res.output
    _nothing_escaped(tmp_path)
