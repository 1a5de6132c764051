"""History: a feature's versions over time, what changed since a run or a moment, and the
retention that expires old history while merging the small files frequent runs leave behind."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import duckdb
import orjson
import pytest

from bench.generate import synthetic_page
from pipeline.config import Settings
from pipeline.lake.history import BadFeatureKey, changes_since, feature_history, parse_key
from pipeline.lake.maintain import maintain
from pipeline.lake.warehouse import attach_sql, connect
from tests.conftest import good_page, query, run_ingest, tables_rows, write
from tests.formats import to_api_json
from tests.test_snapshots import T0, _at, page_v

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")
KEY = "gpt-oss-20b/11-resid-post-aa/7"


def fh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=300, env=os.environ)


@pytest.fixture(scope="module")
def three_versions(tmp_path_factory):
    """Feature 7 loaded in three runs (captures v1, v2, v3); feature 8 added by the third."""
    root = tmp_path_factory.mktemp("history")
    settings = Settings(warehouse=root / "wh")
    v3 = page_v(2)
    v3["explanations"].append({"id": "exp-7-extra", "description": "a second idea", "scores": []})
    runs = []
    for n, page in enumerate([page_v(1), page_v(2), v3], start=1):
        files = [_at(write(root / f"in{n}" / "7.json", to_api_json(page)), T0 + timedelta(days=n))]
        if n == 3:
            files.append(_at(write(root / "in3" / "8.json", to_api_json(good_page(8))), T0 + timedelta(days=3)))
        runs.append(run_ingest(files, settings, run_id=f"run-{n}").run_id)
    return settings, runs


def test_history_lists_each_version_with_its_run_capture_and_values(three_versions):
    settings, runs = three_versions
    with connect(settings, read_only=True) as conn:
        versions = feature_history(conn, parse_key(KEY))
    assert [v["run_id"] for v in versions] == runs
    assert [v["captured_at"] for v in versions] == [T0 + timedelta(days=n) for n in (1, 2, 3)]
    assert [v["n_activations"] for v in versions] == [3, 2, 2]
    assert [v["max_activation"] for v in versions] == [3.25, 9.5, 9.5]
    assert [v["max_act_approx"] for v in versions] == [3.25, 9.5, 9.5]
    assert [v["explanations"] for v in versions] == [["capture 1"], ["capture 2"], ["a second idea", "capture 2"]]
    assert all(v["replaced"] == ["activations", "explanations", "features"] for v in versions)
    assert [v["snapshot_id"] for v in versions] == sorted(v["snapshot_id"] for v in versions)


def test_history_command_formats(three_versions):
    settings, runs = three_versions
    as_json = json.loads(fh("history", KEY, "--warehouse", str(settings.warehouse), "--format", "json").stdout)
    assert [v["n_activations"] for v in as_json] == [3, 2, 2] and as_json[0]["run_id"] == runs[0]
    rows = list(csv.DictReader(io.StringIO(fh("history", KEY, "--warehouse", str(settings.warehouse),
                                              "--format", "csv").stdout)))
    assert [r["max_activation"] for r in rows] == ["3.25", "9.5", "9.5"]
    table = fh("history", KEY, "--warehouse", str(settings.warehouse))
    assert table.returncode == 0 and "capture 1" in table.stdout and runs[2] in table.stdout
    missing = fh("history", "gpt-oss-20b/11-resid-post-aa/999", "--warehouse", str(settings.warehouse))
    assert missing.returncode == 1 and "no version" in missing.stderr
    bad = fh("history", "not-a-key", "--warehouse", str(settings.warehouse))
    assert bad.returncode == 2 and "MODEL/SOURCE/INDEX" in bad.stderr
    with pytest.raises(BadFeatureKey):
        parse_key("a/b/c")


def test_changes_since_a_run_and_since_a_moment(three_versions):
    settings, runs = three_versions
    with connect(settings, read_only=True) as conn:
        label, changes = changes_since(conn, runs[2])
        assert label == f"since run {runs[2]} started"
        by_key = {c["feature"]: c for c in changes}
        assert set(by_key) == {KEY, "gpt-oss-20b/11-resid-post-aa/8"}
        assert by_key["gpt-oss-20b/11-resid-post-aa/8"]["change"] == "added"
        assert by_key[KEY]["change"] == "changed" and by_key[KEY]["run_id"] == runs[2]
        assert by_key[KEY]["what"] == [{"field": "explanations", "before": ["capture 2"],
                                        "after": ["a second idea", "capture 2"]}]

        _, since_run2 = changes_since(conn, runs[1])
        what = {w["field"]: (w["before"], w["after"]) for w in {c["feature"]: c for c in since_run2}[KEY]["what"]}
        assert what["n_activations"] == (3, 2) and what["max_activation"] == (3.25, 9.5)

        (between,) = query(settings.warehouse, "SELECT finished_at FROM runs WHERE run_id = ?", [runs[1]])[0]
        label, since_moment = changes_since(conn, (between + timedelta(milliseconds=1)).isoformat())
        assert {c["feature"] for c in since_moment} == {KEY, "gpt-oss-20b/11-resid-post-aa/8"}
        _, everything = changes_since(conn, "2000-01-01T00:00:00Z")
        assert {c["change"] for c in everything} == {"added"}
        _, nothing = changes_since(conn, datetime.utcnow().isoformat() + "Z")
        assert nothing == []
    out = fh("changes", "--since", runs[2], "--warehouse", str(settings.warehouse), "--format", "json")
    assert {c["change"] for c in json.loads(out.stdout)} == {"added", "changed"}
    table = fh("changes", "--since", runs[2], "--warehouse", str(settings.warehouse))
    assert "2 feature(s) changed since run" in table.stdout and "explanations" in table.stdout
    unknown = fh("changes", "--since", "no-such-run", "--warehouse", str(settings.warehouse))
    assert unknown.returncode == 1 and "neither a run id" in unknown.stderr


def _files(settings: Settings) -> dict[str, int]:
    """Parquet data files per table."""
    out: dict[str, int] = {}
    for p in (settings.warehouse / "data").rglob("*.parquet"):
        if not p.name.endswith("-delete.parquet"):
            out[p.parent.name] = out.get(p.parent.name, 0) + 1
    return out


@pytest.mark.heavy(35)
def test_maintenance_expires_old_history_and_merges_small_files(tmp_path):
    settings = Settings(warehouse=tmp_path / "wh")
    for i in range(8):  # an inbox-like trickle: one page per run (small commits stay inline in the catalog)
        page = synthetic_page(100 + i, valid=True)
        run_ingest([write(tmp_path / f"in{i}" / "p.json", orjson.dumps(page))], settings)
    assert _files(settings)["activations"] == 8
    before = tables_rows(settings.warehouse, ("features", "activations", "explanations",
                                              "feature_activation_stats", "runs", "raw_inputs"))
    first_run = query(settings.warehouse, "SELECT run_id FROM runs ORDER BY started_at LIMIT 1")[0][0]

    kept = maintain(settings, retention_days=30, grace=timedelta(0))  # nothing is old enough to expire
    assert kept.snapshots_expired == 0
    result = maintain(settings, retention_days=0, grace=timedelta(0))
    assert result.snapshots_expired >= 8 * 3 and result.snapshots_after == 1
    files = _files(settings)
    assert files["activations"] == files["validation_results"] == 1, files
    assert max(files.values()) == 1, f"every table is one file now: {files}"
    assert result.files_after == len(list((settings.warehouse / "data").rglob("*.parquet")))
    after = tables_rows(settings.warehouse, before)
    for table, rows in before.items():
        assert after[table] == rows, f"{table} changed in maintenance"
    gone = fh("changes", "--since", first_run, "--warehouse", str(settings.warehouse))
    assert gone.returncode == 1 and "expired" in gone.stderr
    # the history that remains starts from the state at the oldest snapshot kept
    with connect(settings, read_only=True) as conn:
        (v,) = feature_history(conn, parse_key("gpt-oss-20b/11-resid-post-aa/100"))
        assert v["replaced"] == [] and v["n_activations"] == 40
    cli = fh("maintain", "--warehouse", str(settings.warehouse), "--retention-days", "0", "--grace-minutes", "0")
    assert cli.returncode == 0 and "expired" in cli.stdout and "data files" in cli.stdout


def test_a_reader_in_a_transaction_keeps_its_snapshot_across_maintain(tmp_path):
    """Small commits were kept inline in the catalog, and maintain's flush deleted them under a
    reader holding a transaction (its activation count went to 0)."""
    settings = Settings(warehouse=tmp_path / "wh")
    for i in range(2):  # two small commits (in-process: the set-up)
        summary = run_ingest([write(tmp_path / f"in{i}" / "p.json", orjson.dumps(synthetic_page(i)))], settings)
        assert summary.status == "succeeded" and summary.n_loaded == 1, summary
    conn = duckdb.connect()
    try:
        for line in attach_sql(settings):
            conn.execute(line)
        conn.execute("BEGIN TRANSACTION")
        counts = "SELECT (SELECT count(*) FROM activations), (SELECT count(*) FROM runs), (SELECT count(*) FROM quarantine)"
        before = conn.execute(counts).fetchone()
        assert before[0] > 0
        proc = fh("maintain", "--warehouse", str(settings.warehouse), "--retention-days", "0", "--grace-minutes", "0")
        assert proc.returncode == 0, proc.stderr
        assert conn.execute(counts).fetchone() == before
        conn.execute("COMMIT")
        assert conn.execute(counts).fetchone() == before  # maintenance changes no row
    finally:
        conn.close()
