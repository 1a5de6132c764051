"""A warehouse folder is self-contained (issue 17, item 2): it survives `cp -a` and `mv`, and
`maintain` on a copy never touches the original's files.

DuckLake records the data path in the catalog as it was given (absolute); featurehouse resolves
a folder warehouse's data path from the folder it opens, so a copy reads and writes its own
files, and `maintain` refuses to delete anything outside the data folder it was pointed at.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from pipeline.config import Settings
from tests.conftest import FIXTURES, run_ingest

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")


def fh(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def parquet(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*.parquet")}


def reads_everything(wh: Path, env: dict | None = None) -> list[str]:
    """A query that opens every activations data file (not only the catalog's statistics)."""
    r = fh("sql", "SELECT count(*) AS n, sum(len(tokens)) AS t, count(DISTINCT run_id) AS runs FROM activations",
           "--warehouse", str(wh), "--format", "csv", env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r.stdout.split()


@pytest.fixture
def wh(tmp_path) -> Path:
    """A warehouse of the test's own, loaded twice (the replaced capture leaves files for maintain
    to merge and delete)."""
    wh = tmp_path / "wh"
    for i in range(2):
        run_ingest([FIXTURES], Settings(warehouse=wh), reprocess=i > 0)
    assert len(parquet(wh / "data")) > 10
    return wh


def test_maintain_on_a_copy_never_touches_the_original(wh, tmp_path):
    before = parquet(wh / "data")
    expected = reads_everything(wh)
    backup = tmp_path / "wh-backup"
    shutil.copytree(wh, backup, symlinks=True)  # cp -a

    r = fh("maintain", "--warehouse", str(backup), "--grace-minutes", "0")
    assert r.returncode == 0, r.stderr
    assert parquet(wh / "data") == before, "maintain on the copy deleted or wrote the original's files"
    assert parquet(backup / "data") != before, "maintain on the copy did its work on the copy"
    assert reads_everything(wh) == expected
    assert reads_everything(backup) == expected

    # and the original, maintained in turn, still has what it needs; the copy is not affected
    copy_files = parquet(backup / "data")
    r = fh("maintain", "--warehouse", str(wh), "--grace-minutes", "0")
    assert r.returncode == 0, r.stderr
    assert parquet(backup / "data") == copy_files
    assert reads_everything(wh) == expected and reads_everything(backup) == expected


def test_a_copy_writes_its_own_data_folder(wh, tmp_path):
    before = parquet(wh / "data")
    copy = tmp_path / "copy"
    shutil.copytree(wh, copy, symlinks=True)
    r = fh("ingest", str(FIXTURES), "--reprocess", "--warehouse", str(copy), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert parquet(wh / "data") == before, "an ingest into the copy wrote into the original's data folder"
    assert len(parquet(copy / "data")) > len(before)
    assert reads_everything(copy)[1].startswith("39,")


def test_a_moved_warehouse_keeps_working_and_nothing_appears_where_it_was(wh, tmp_path):
    expected = reads_everything(wh)
    moved = tmp_path / "elsewhere" / "wh-moved"
    moved.parent.mkdir()
    shutil.move(wh, moved)  # mv
    assert not wh.exists()

    r = fh("status", "--warehouse", str(moved))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert reads_everything(moved) == expected
    r = fh("ingest", str(FIXTURES), "--reprocess", "--warehouse", str(moved), "--no-progress")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    r = fh("maintain", "--warehouse", str(moved), "--grace-minutes", "0")
    assert r.returncode == 0, r.stderr
    assert reads_everything(moved)[1].startswith("39,")
    assert not wh.exists(), f"something was created at the old location: {sorted(wh.rglob('*'))[:5]}"

    # a plain DuckDB client, with the statements `featurehouse shell --print` gives
    r = fh("shell", "--print", "--warehouse", str(moved))
    assert r.returncode == 0, r.stderr
    with duckdb.connect() as conn:
        conn.execute(r.stdout)
        assert conn.execute("SELECT count(*), sum(len(tokens)) FROM activations").fetchone() == (39, 26151)


def test_a_warehouse_opened_through_a_relative_path_from_anywhere(wh, tmp_path):
    """The folder is found from where the command runs; the data with it."""
    expected = reads_everything(wh)
    sub = tmp_path / "sub"
    sub.mkdir()
    r = fh("sql", "SELECT count(*) AS n, sum(len(tokens)) AS t, count(DISTINCT run_id) AS runs FROM activations",
           "--warehouse", os.path.relpath(wh, sub), "--format", "csv", cwd=sub)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == expected


def test_the_data_path_setting_points_a_moved_external_data_folder(tmp_path, monkeypatch):
    """Data kept outside the warehouse folder: after moving it, FEATUREHOUSE_DATA_PATH says where."""
    env = {"FEATUREHOUSE_DATA_PATH": str(tmp_path / "parquet")}
    with monkeypatch.context() as m:  # the first ingest (in-process), its data path from the environment
        m.setenv("FEATUREHOUSE_DATA_PATH", env["FEATUREHOUSE_DATA_PATH"])
        summary = run_ingest([FIXTURES], Settings.from_env(warehouse=tmp_path / "wh"))
    assert summary.status == "succeeded" and summary.n_loaded == 1, summary
    expected = reads_everything(tmp_path / "wh", env=env)
    assert reads_everything(tmp_path / "wh") == expected  # the catalog remembers where it put them
    shutil.move(tmp_path / "parquet", tmp_path / "parquet-moved")
    moved = {"FEATUREHOUSE_DATA_PATH": str(tmp_path / "parquet-moved")}
    assert reads_everything(tmp_path / "wh", env=moved) == expected
    r = fh("ingest", str(FIXTURES), "--reprocess", "--warehouse", str(tmp_path / "wh"), "--no-progress", env=moved)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "parquet").exists() and not (tmp_path / "wh" / "data").exists()


def test_maintain_refuses_to_delete_outside_the_warehouses_data_folder(wh, tmp_path, monkeypatch):
    """The second line of defence: were the lake opened on the data path its catalog records (as
    every release before issue 17 did: a copy's catalog names the original's folder), maintain
    refuses and deletes nothing, rather than delete the original's files."""
    from datetime import timedelta

    from pipeline.lake import connect as connect_mod
    from pipeline.lake import maintain as maintain_mod

    before = parquet(wh / "data")
    copy = tmp_path / "copy"
    shutil.copytree(wh, copy, symlinks=True)
    attach = connect_mod._attach
    # _open calls _attach in its own room (connect.py): the name on the warehouse facade is not what it calls
    monkeypatch.setattr(connect_mod, "_attach", lambda conn, settings, opts: attach(
        conn, settings, [o for o in opts if not o.startswith(("DATA_PATH", "OVERRIDE_DATA_PATH"))]))

    with pytest.raises(Exception, match="data files in .*copy/data/, but its lake is open on .*/wh/data/"):
        maintain_mod.maintain(Settings(warehouse=copy), grace=timedelta(0))
    assert parquet(wh / "data") == before
    assert parquet(copy / "data") == before


def test_maintain_refuses_to_delete_a_file_outside_the_data_folder(wh, tmp_path):
    """A file the catalog names outside the data folder (DuckLake keeps absolute paths for files
    added from elsewhere): listed by the dry run, refused, nothing deleted."""
    from pipeline.lake.maintain import MaintenanceRefused, _step

    outside = tmp_path / "elsewhere" / "x.parquet"
    outside.parent.mkdir()
    with duckdb.connect() as conn:
        conn.execute(f"COPY (SELECT 1 AS x) TO '{outside}' (FORMAT parquet)")
        conn.execute(f"CREATE MACRO listing(catalog, dry_run := false) AS TABLE SELECT '{outside}' AS path")
        body = _step("listing", "", {}, str(wh / "data") + "/", deletes=True)
        with pytest.raises(MaintenanceRefused, match="outside the warehouse's data folder"):
            body(conn)
    assert outside.exists()


def test_a_copied_or_moved_warehouse_ingests_its_own_fetched_pages_and_fetches_nothing_again(tmp_path):
    """A fetch window's manifest recorded each body's absolute landed path: a copy ingested the
    original's landing files (gone when the original was removed: "missing; fetch again"), and a
    moved warehouse fetched every page again. Bodies are now found by digest in the warehouse's
    own landing area."""
    from pipeline.sources.fetch import fetch_features, ingest_fetched
    from tests.fake_neuronpedia import FakeNeuronpedia, feature_path
    from tests.fetch_support import FAST, MODEL, SOURCE, pages

    original, copy, moved = tmp_path / "wh", tmp_path / "wh-copy", tmp_path / "wh-moved"
    with FakeNeuronpedia(pages=pages(5)) as np:
        first = fetch_features(MODEL, SOURCE, range(5), settings=Settings(warehouse=original),
                               base_url=np.base_url, window="w", **FAST)
        assert first.n_landed == 5
        shutil.copytree(original, copy, symlinks=True)  # cp -a, before anything is ingested
        shutil.move(original, moved)                     # then mv: nothing is left where it was
        again = fetch_features(MODEL, SOURCE, range(5), settings=Settings(warehouse=moved),
                               base_url=np.base_url, window="w", **FAST)
        assert (again.n_landed, again.n_skipped_already_landed) == (0, 5)
        assert np.count(feature_path(0)) == 1  # asked once, by the first fetch only
    for wh in (copy, moved):
        summary = ingest_fetched("w", Settings(warehouse=wh), report_after=False)
        assert (summary.status, summary.n_loaded, summary.n_rejected) == ("succeeded", 5, 0), summary
        assert reads_everything(wh)[1] != "0"
    assert not original.exists()
