"""A full disk is said to be a full disk, wherever it is: under the catalog (not a commit
conflict, not a damaged warehouse to restore from a backup), under the landing area (the run
fails with that reason instead of blaming each input, and is not left `running`), and under the
reports after a good load (one line, no traceback).

Found in the outside reviews of issue 17 ("Hardening 2"); each test failed on the code before
its fix.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from tests.conftest import good_page, query, run_ingest, write
from tests.formats import to_api_json

ROOT = Path(__file__).resolve().parent.parent
FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")


def fh(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# --- a full disk under the catalog -----------------------------------------------------------------
#
# SQLite says "database or disk is full" when a commit cannot be written: that matched the commit
# conflicts' pattern ("Failed to commit DuckLake transaction"), so it was retried 8 times over
# ~11 s, logged as "commit conflict", then reported as "still conflicting after 8 attempts", with
# four tracebacks when the run's end could not be recorded. And a catalog whose write-ahead-log
# index could not be made on the full disk ("disk I/O error") was called unreadable: "restore it
# from a backup, or move it away to start a new warehouse" — which loses a sound warehouse.


def test_a_full_disk_is_not_a_commit_conflict():
    from pipeline.lake.landing import disk_full
    from pipeline.lake.warehouse import is_conflict

    full = duckdb.TransactionException('TransactionContext Error: Failed to commit: Failed to commit DuckLake '
                                       'transaction.\nFailed to commit: Failed to execute query "COMMIT": '
                                       'database or disk is full')
    assert not is_conflict(full) and disk_full(full)
    busy = duckdb.TransactionException("TransactionContext Error: Failed to commit: Failed to commit DuckLake "
                                       "transaction.\nFailed to commit: database is locked")
    assert is_conflict(busy) and not disk_full(busy)


def test_a_catalog_on_a_full_disk_is_said_to_be_on_a_full_disk_not_damaged(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from pipeline.config import Settings
    from tests.formats import to_api_json

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("no tmpfs can be mounted here")
    fh = str(Path(sys.executable).with_name("featurehouse"))
    try:
        (tmp_path / "in").mkdir()
        (tmp_path / "in" / "a.json").write_bytes(to_api_json(good_page(1)))
        wh = disk / "wh"
        assert run_ingest([tmp_path / "in"], Settings(warehouse=wh)).status == "succeeded"  # the set-up
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)  # the disk fills up
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * (64 << 10)):
                pass
        os.close(fd)
        (wh / "catalog.sqlite-shm").unlink(missing_ok=True)
        (tmp_path / "in" / "b.json").write_bytes(to_api_json(good_page(2)))
        for args in (["status"], ["ingest", str(tmp_path / "in"), "--no-progress"]):
            proc = subprocess.run([fh, *args, "--warehouse", str(wh)], capture_output=True, text=True, timeout=300)
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert "Traceback" not in proc.stderr and "conflict" not in proc.stderr, proc.stderr
            assert "the disk that holds it is full" in proc.stderr, proc.stderr
            assert "restore it from a backup" not in proc.stderr, proc.stderr
        os.unlink(disk / "filler")  # once there is room, the warehouse is as it was
        proc = subprocess.run([fh, "ingest", str(tmp_path / "in"), "--warehouse", str(wh), "--no-progress"],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert sorted(r[0] for r in query(wh, "SELECT feature_index FROM features")) == [1, 2]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# --- a full disk under the landing area (issue 17, item 7) ----------------------------------------


def _small_disk(folder: Path) -> str:
    """A 2 MiB file system at ``folder`` (a tmpfs); how it was made, or "" when it cannot be."""
    folder.mkdir(parents=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(folder)], capture_output=True)
    return "tmpfs" if proc.returncode == 0 else ""


def test_a_full_disk_under_the_landing_area_fails_the_run_with_that_reason(tmp_path):
    """Each input was reported as "it could not be read: No space left on device", then a
    traceback, and the run stayed `running`."""
    disk = tmp_path / "disk"
    how = _small_disk(disk)
    inputs = tmp_path / "in"
    write(inputs / "a.json", to_api_json(good_page(1)))
    write(inputs / "b_big.txt", os.urandom(3 << 20))  # larger than the whole disk
    write(inputs / "c.json", to_api_json(good_page(3)))
    wh = disk / "wh"
    try:
        if how:
            proc = fh("ingest", str(inputs), "--warehouse", str(wh), "--no-progress")
        else:  # no mount here: the same failure from a file size limit (EFBIG instead of ENOSPC)
            limit = "import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); " \
                    "resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))"
            proc = subprocess.run(
                [sys.executable, "-c", f"{limit}\nfrom pipeline.cli import main; main()", "ingest", str(inputs),
                 "--warehouse", str(wh), "--no-progress"], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert f"the landing area {wh / 'landing'} could not be written" in proc.stderr, proc.stderr
        if how:
            assert "No space left on device (the disk that holds it is full)" in proc.stderr
        assert "could not be read" not in proc.stdout + proc.stderr
        assert "is recorded as failed" in proc.stderr
        status, error = query(wh, "SELECT status, error FROM runs")[0]
        assert status == "failed" and "LandingFailed: the landing area" in error
        assert not list((wh / "landing").rglob(".landing-*")), "the partial copy is removed"
    finally:
        if how:
            subprocess.run(["umount", "-l", str(disk)], check=False)


# --- a full disk under the reports ----------------------------------------------------------------


def test_a_full_disk_under_the_reports_after_a_good_load_is_said_without_a_traceback(tmp_path):
    """The data loaded, then writing the report (and Great Expectations' Data Docs) on a full
    disk logged tracebacks; now one line says the disk is full and how to write it later."""
    disk = tmp_path / "reports"
    if not _small_disk(disk):
        pytest.skip("no tmpfs can be mounted here (needs root)")
    try:
        with (disk / "filler").open("wb") as f:  # fill it
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        inputs = tmp_path / "in"
        write(inputs / "a.json", to_api_json(good_page(1)))
        wh = tmp_path / "wh"
        proc = fh("ingest", str(inputs), "--warehouse", str(wh), "--no-progress",
                  env={"FEATUREHOUSE_REPORTS": str(disk)})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "could not write the report for run" in proc.stderr and "the disk is full" in proc.stderr
        assert "featurehouse report --run run-" in proc.stderr
        assert query(wh, "SELECT count(*) FROM features") == [(1,)]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
