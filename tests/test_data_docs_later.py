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


def _runs_waiting(tmp_path: Path, n: int) -> tuple[Settings, list[str]]:
    """``n`` runs of one bad page each, their results waiting (the default, in-process)."""
    from tests.conftest import run_ingest

    settings = Settings(warehouse=tmp_path / "wh", data_docs="report")
    runs = []
    for i in range(n):
        summary = run_ingest([write(tmp_path / f"in{i}" / "p.json", _bad_page(40 + i))], settings)
        assert summary.status == "succeeded", summary
        runs.append(summary.run_id)
    return settings, runs


def test_a_damaged_waiting_result_is_set_aside_and_stops_no_other(tmp_path, caplog):
    """Found by the outside review: one waiting file cut short (or not a result at all) made
    every later report fail to record any run's results."""
    from pipeline.stages import validate

    settings, runs = _runs_waiting(tmp_path, 3)
    pending = settings.warehouse / "gx" / "uncommitted" / "featurehouse-pending"
    cut = pending / runs[0] / "batch-0001-features.json"
    cut.write_bytes(cut.read_bytes()[:100])
    (pending / runs[1] / "batch-0009-features.json").write_text('{"a": 1}')
    with caplog.at_level("WARNING"):
        pages = validate.build_data_docs(settings.warehouse, runs[2])
    assert len(pages) == 3  # the run named: its three suites
    validations = settings.warehouse / "gx" / "uncommitted" / "validations"
    recorded = sorted((p.parents[2].name, p.parent.parent.name) for p in validations.rglob("*.json"))
    assert recorded == sorted([(t, r) for r in runs for t in validate.SUITES if (t, r) != ("features", runs[0])])
    assert sorted(p.name for p in pending.rglob("*.broken")) == ["batch-0001-features.json.broken",
                                                                 "batch-0009-features.json.broken"]
    assert not list(pending.rglob("*.json"))
    assert caplog.text.count("set aside as") == 2


def test_the_report_builds_the_pages_a_killed_report_left_unbuilt(tmp_path):
    """Found by the outside review: a report killed after recording other runs' results, before
    their pages, left them out of the Data Docs for good (only runs still waiting were built)."""
    from pipeline.stages import validate

    settings, runs = _runs_waiting(tmp_path, 3)
    validate.build_data_docs(settings.warehouse, runs[0])
    site = settings.warehouse / "gx" / "uncommitted" / "data_docs" / "local_site"
    gone = sorted((site / "validations").rglob(f"*/{runs[1]}/*/*.html"))
    assert len(gone) == 3
    for p in gone:
        p.unlink()
    index = site / "index.html"
    index.write_text("stale")
    validate.build_data_docs(settings.warehouse, runs[2])  # another run's report: its results recorded
    assert all(p.exists() for p in gone) and runs[1] in index.read_text()
    for p in gone:
        p.unlink()
    # nothing waiting and nothing of its own stored (an unchanged run): the index is mended all the same
    assert validate.build_data_docs(settings.warehouse, "run-that-stored-nothing") == []
    assert all(p.exists() for p in gone)
    # with every page there and nothing waiting, no Great Expectations is needed to know it
    assert not validate._pages_missing(settings.warehouse / "gx" / "uncommitted", site)


def test_the_report_of_a_run_that_changed_nothing_records_the_runs_waiting(tmp_path):
    """Found by the outside review: `featurehouse report` names the latest run by default, and
    after a re-run that is one that changed nothing, whose short report recorded nothing."""
    from tests.conftest import run_ingest

    settings, runs = _runs_waiting(tmp_path, 2)
    again = run_ingest([tmp_path / "in1" / "p.json"], settings)
    assert again.status == "succeeded" and again.n_loaded == 0
    done = subprocess.run([str(EXE), "report", "--warehouse", str(settings.warehouse)], capture_output=True,
                          text=True, env=_env(), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert again.run_id in done.stdout  # the latest: the re-run
    pending = settings.warehouse / "gx" / "uncommitted" / "featurehouse-pending"
    assert not list(pending.rglob("*.json"))
    index = (settings.warehouse / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html").read_text()
    assert all(r in index for r in runs)


def test_a_report_of_a_run_whose_data_docs_are_built_imports_no_great_expectations(tmp_path):
    """`featurehouse report` again, every page built and linked from the index: nothing to build,
    so no Great Expectations (2.5-6 CPU-s of import); an index that does not link a stored result
    (another process stored it while the index was built) is built again."""
    from pipeline.stages import validate

    settings, runs = _runs_waiting(tmp_path, 2)
    validate.build_data_docs(settings.warehouse, runs[1])  # the report command's: every run recorded
    site = settings.warehouse / "gx" / "uncommitted" / "data_docs" / "local_site"
    index = site / "index.html"
    code = ("import sys\nfrom pipeline.stages import validate\n"
            "pages = validate.build_data_docs(sys.argv[1], sys.argv[2])\n"
            "print(len(pages), 'GX' if 'great_expectations' in sys.modules else 'NO-GX')")

    def again(run_id: str) -> str:
        done = subprocess.run([sys.executable, "-c", code, str(settings.warehouse), run_id], capture_output=True,
                              text=True, env=_env(), cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip()

    assert again(runs[0]) == "3 NO-GX"  # its three suites' pages, read off the folders
    page = next((site / "validations").rglob(f"*/{runs[0]}/*/*.html")).relative_to(site).as_posix()
    assert page in index.read_text()
    index.write_text(index.read_text().replace(page, "elsewhere.html"))
    assert again(runs[1]) == "3 GX"  # an index missing a result: built again, with it
    assert page in index.read_text()
    assert again(runs[1]) == "3 NO-GX"
    # found by the outside review: an index cut short after its last link, and one still
    # linking a result deleted since, are built again too
    whole = index.read_text()
    index.write_text(whole[:whole.rindex(page) + len(page) + 10])
    assert again(runs[1]) == "3 GX" and index.read_text().rstrip().endswith("</html>")
    gone = next((settings.warehouse / "gx" / "uncommitted" / "validations").rglob(f"*/{runs[0]}/*/*.json"))
    gone.unlink()
    assert again(runs[1]) == "3 GX"
    assert gone.relative_to(gone.parents[3]).with_suffix(".html").as_posix() not in index.read_text()
    assert again(runs[1]) == "3 NO-GX"


def test_an_index_linking_a_run_id_written_as_a_url_is_current(tmp_path):
    """Found by the outside review: a run id holding ``:`` or ``+`` is linked quoted in the index
    (``%3A``); read as it is, every report built the index again."""
    from pipeline.stages import gx_project, validate
    from tests.conftest import run_ingest

    settings = Settings(warehouse=tmp_path / "wh", data_docs="report")
    summary = run_ingest([write(tmp_path / "in" / "p.json", _bad_page(50))], settings, run_id="nightly:2026-12-08T00+00")
    assert summary.status == "succeeded", summary
    validate.build_data_docs(settings.warehouse, summary.run_id)
    base = settings.warehouse / "gx" / "uncommitted"
    assert "nightly%3A2026-12-08T00%2B00" in (base / "data_docs" / "local_site" / "index.html").read_text()
    assert gx_project._index_current(base, base / "data_docs" / "local_site")
