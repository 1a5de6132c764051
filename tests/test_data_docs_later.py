"""Data Docs later (``FEATUREHOUSE_DATA_DOCS=report``, the default): an ingest judges in DuckDB and
imports no Great Expectations; `featurehouse report` has Great Expectations record the run's
results and build its Data Docs, and every other run's waiting results with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import BadSetting, Settings
from tests.conftest import good_page, query, write
from tests.formats import to_api_json

ROOT = Path(__file__).resolve().parent.parent
EXE = Path(sys.executable).with_name("featurehouse")


def _bad_page(index: int) -> bytes:
    page = good_page(index, source="later-src")
    page["activations"][0]["tokens"] = ["a", "b", "c"]  # len(tokens) != len(values)
    return to_api_json(page)


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEATUREHOUSE_")}
    return {**env, **extra}


def test_an_ingest_with_data_docs_later_imports_no_great_expectations(tmp_path):
    inbox = tmp_path / "in"
    write(inbox / "p.json", _bad_page(11))
    wh = tmp_path / "wh"
    code = ("import sys; from pipeline.cli import main; sys.argv = ['featurehouse', 'ingest', sys.argv[1], "
            "'--warehouse', sys.argv[2]]\ntry:\n    main()\nexcept SystemExit as e:\n    rc = e.code\n"
            "print('GX' if 'great_expectations' in sys.modules else 'NO-GX', rc, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, str(inbox), str(wh)], capture_output=True, text=True,
                          env=_env(), cwd=tmp_path, timeout=300)  # the default
    assert done.stderr.strip().splitlines()[-1] == "NO-GX 0", done.stderr[-3000:]
    # judged all the same: the bad record is quarantined with its check
    assert query(wh, "SELECT check_name FROM quarantine") == [("tokens_values_same_length",)]
    (run_id, report_path), = query(wh, "SELECT run_id, report_path FROM runs")
    html = Path(report_path).read_text()
    assert f"featurehouse report --run {run_id}" in html and "data_docs/local_site" not in html
    assert not (wh / "gx" / "uncommitted" / "validations").exists()

    # the report command has Great Expectations record the results and build the pages
    done = subprocess.run([str(EXE), "report", "--run", run_id, "--warehouse", str(wh)], capture_output=True,
                          text=True, env=_env(FEATUREHOUSE_DATA_DOCS="report"), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    html = Path(report_path).read_text()
    assert "data_docs/local_site/validations/" in html and "builds them" not in html
    stored = sorted((wh / "gx" / "uncommitted" / "validations").rglob("*.json"))
    assert len(stored) == 3  # features, activations, explanations of the one batch
    for p in stored:  # recorded as the table's checkpoint records a run's (tests/test_gx_checkpoint.py)
        table = p.parents[2].name
        checkpoint = json.loads((wh / "gx" / "checkpoints" / f"featurehouse-{table}.json").read_text())
        assert json.loads(p.read_text())["meta"]["checkpoint_id"] == checkpoint["id"]
    checks = {r["expectation_config"]["meta"]["check_name"]: r for p in stored
              for r in json.loads(p.read_text())["results"]}
    assert checks["tokens_values_same_length"]["success"] is False
    assert checks["tokens_values_same_length"]["result"]["unexpected_count"] == 1
    pages = sorted((wh / "gx" / "uncommitted" / "data_docs" / "local_site" / "validations").rglob("*.html"))
    assert any("tokens_values_same_length" in p.read_text() or "n_tokens" in p.read_text() for p in pages)
    assert not list((wh / "gx" / "uncommitted" / "featurehouse-pending").glob("*/*.json"))

    # again: nothing left to record, the same pages
    done = subprocess.run([str(EXE), "report", "--run", run_id, "--warehouse", str(wh)], capture_output=True,
                          text=True, env=_env(), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted((wh / "gx" / "uncommitted" / "validations").rglob("*.json")) == stored


def test_a_bad_data_docs_setting_is_refused(monkeypatch):
    monkeypatch.setenv("FEATUREHOUSE_DATA_DOCS", "sometimes")
    with pytest.raises(BadSetting, match="FEATUREHOUSE_DATA_DOCS must be one of run, report"):
        Settings.from_env()
    monkeypatch.setenv("FEATUREHOUSE_DATA_DOCS", "Report")
    assert Settings.from_env().data_docs == "report"


def _ingest(inbox: Path, wh: Path, **env) -> str:
    done = subprocess.run([str(EXE), "ingest", str(inbox), "--warehouse", str(wh), "--no-progress"],
                          capture_output=True, text=True, env=_env(**env), cwd=inbox.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return query(wh, "SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 1")[0][0]


def test_the_report_command_records_every_runs_waiting_results_in_the_index(tmp_path):
    """An inbox run is never named by a report command: the next report's index refresh (the
    nightly report task's, anyone's `featurehouse report`) records its waiting results and
    builds its pages, so the Data Docs index lists every run. A run in `run` mode meanwhile
    records its own as before."""
    wh = tmp_path / "wh"
    runs = []
    for i, mode in enumerate(["report", "run", "report"]):
        write(tmp_path / f"in{i}" / "p.json", _bad_page(20 + i))
        runs.append(_ingest(tmp_path / f"in{i}", wh, FEATUREHOUSE_DATA_DOCS=mode))
    pending = wh / "gx" / "uncommitted" / "featurehouse-pending"
    assert sorted(p.name for p in pending.iterdir()) == sorted([runs[0], runs[2]])
    validations = wh / "gx" / "uncommitted" / "validations"
    assert {p.parent.parent.name for p in validations.rglob("*.json")} == {runs[1]}

    done = subprocess.run([str(EXE), "report", "--run", runs[2], "--warehouse", str(wh)], capture_output=True,
                          text=True, env=_env(), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list(pending.glob("*/*.json")) and not [p for p in pending.iterdir() if p.is_dir()]
    assert {p.parent.parent.name for p in validations.rglob("*.json")} == set(runs)
    site = wh / "gx" / "uncommitted" / "data_docs" / "local_site"
    index = (site / "index.html").read_text()
    for run_id in runs:
        assert run_id in index
        assert len(list((site / "validations").rglob(f"*/{run_id}/*/batch-*.html"))) == 3, run_id
    # the first run's own report, written again, links its pages and says nothing waits
    done = subprocess.run([str(EXE), "report", "--run", runs[0], "--warehouse", str(wh)], capture_output=True,
                          text=True, env=_env(), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,), = query(wh, "SELECT report_path FROM runs WHERE run_id = ?", [runs[0]])
    html = Path(path).read_text()
    assert "local_site/validations/" in html and "builds them" not in html
