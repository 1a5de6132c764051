"""Draining the inbox (pipeline/inbox.py): a file leaves only after it has landed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import Settings
from pipeline.lake.warehouse import BadCatalog
from pipeline.sources.inbox import DONE_DIR, drain_inbox, pending_files
from tests.conftest import open_warehouse

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = sorted((ROOT / "samples").iterdir())
GOOD = ROOT / "samples" / "000_e9e35889d0228029.txt"
BAD = ROOT / "samples" / "002_cdcf7f83dd4b10f8.txt"


def rows(warehouse: Path, sql: str):
    with open_warehouse(warehouse) as conn:
        return conn.execute(sql).fetchall()


def fill(inbox: Path, files, old: bool = True) -> None:
    inbox.mkdir(parents=True, exist_ok=True)
    for f in files:
        dest = inbox / f.name
        shutil.copyfile(f, dest)
        if old:
            os.utime(dest, (time.time() - 3600, time.time() - 3600))


def test_seeds_land_and_leave_the_inbox(tmp_path):
    inbox, wh = tmp_path / "inbox", tmp_path / "wh" / "f.duckdb"
    fill(inbox, SAMPLES)
    (inbox / "sub").mkdir()
    shutil.copyfile(GOOD, inbox / "sub" / "again.txt")  # same bytes, another name
    (inbox / ".partial.txt").write_text("downloading")  # hidden: somebody's partial file

    result = drain_inbox(inbox, Settings(warehouse=wh), "inbox-run-1")

    assert (result.n_found, result.n_drained, result.n_kept) == (3, 3, 0)
    assert result.run["n_loaded"] == 1 and result.run["n_rejected"] == 1 and result.run["n_duplicates"] == 1
    assert pending_files(inbox) == ([], 0)
    assert (inbox / ".partial.txt").exists()
    done = inbox / DONE_DIR / "inbox-run-1"
    assert sorted(p.relative_to(done).as_posix() for p in done.rglob("*") if p.is_file()) == [
        "000_e9e35889d0228029.txt", "002_cdcf7f83dd4b10f8.txt", "sub/again.txt"]
    statuses = dict(rows(wh, "SELECT origin, status FROM raw_inputs"))
    assert sorted(statuses.values()) == ["loaded", "rejected"]
    assert rows(wh, "SELECT count(*) FROM features")[0][0] == 1
    assert rows(wh, "SELECT count(*) FROM feature_activation_stats")[0][0] >= 1

    # nothing left: a second drain is a no-op that does not even start a run
    again = drain_inbox(inbox, Settings(warehouse=wh), "inbox-run-2")
    assert (again.n_found, again.run_id, again.run) == (0, None, None)
    assert rows(wh, "SELECT count(*) FROM runs")[0][0] == 1


def test_delete_instead_of_keep(tmp_path):
    inbox, wh = tmp_path / "inbox", tmp_path / "wh"
    fill(inbox, SAMPLES)
    result = drain_inbox(inbox, Settings(warehouse=wh), keep=False)
    assert result.n_drained == 2
    assert not any(inbox.rglob("*"))


def test_fresh_files_wait_until_they_settle(tmp_path):
    inbox, wh = tmp_path / "inbox", tmp_path / "wh"
    fill(inbox, [BAD], old=True)
    fill(inbox, [GOOD], old=False)
    result = drain_inbox(inbox, Settings(warehouse=wh), settle_seconds=60)
    assert (result.n_found, result.n_waiting, result.n_drained) == (1, 1, 1)
    assert [p.name for p in pending_files(inbox)[0]] == [GOOD.name]


def test_a_failed_run_leaves_every_file_in_the_inbox(tmp_path):
    inbox = tmp_path / "inbox"
    fill(inbox, SAMPLES)
    wh = tmp_path / "wh"
    wh.mkdir()
    (wh / "catalog.sqlite").write_text("this is not a catalog")
    with pytest.raises(BadCatalog):
        drain_inbox(inbox, Settings(warehouse=wh))
    assert sorted(p.name for p in pending_files(inbox)[0]) == [f.name for f in SAMPLES]

    (wh / "catalog.sqlite").unlink()
    result = drain_inbox(inbox, Settings(warehouse=wh))
    assert result.n_drained == 2 and pending_files(inbox) == ([], 0)


def test_a_run_killed_half_way_loses_nothing_and_the_next_run_finishes(tmp_path):
    """SIGKILL a drain mid-run: whatever left the inbox has its raw_inputs row; a rerun takes the rest."""
    inbox, wh = tmp_path / "inbox", tmp_path / "wh"
    inbox.mkdir()
    base = GOOD.read_bytes()
    n = 40
    for i in range(n):  # distinct bytes, so each is its own input; a trailing newline still parses
        (inbox / f"page_{i:03d}.txt").write_bytes(base + b"\n" * (i + 1))
        os.utime(inbox / f"page_{i:03d}.txt", (0, 0))
    code = (
        "import sys; from pathlib import Path; from pipeline.config import Settings; from pipeline.sources.inbox import drain_inbox;"
        "drain_inbox(sys.argv[1], Settings(warehouse=Path(sys.argv[2]), batch_activations=1), 'killed-run')"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(inbox), str(wh)], cwd=ROOT)
    # kill it once it has committed something, but well before it is done
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list((wh / "data").glob("main/activations/*.parquet"))) >= 3:  # three batches committed
            break
        time.sleep(0.2)
    was_running = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = {p.name for p in pending_files(inbox)[0]}
    assert was_running, "the drain finished before it could be killed; make it slower"
    assert left, "the kill came too late to test anything"

    gone = {f"page_{i:03d}.txt" for i in range(n)} - left
    if gone:  # anything that left the inbox is recorded
        landed = {o.rsplit("/", 1)[-1] for (o,) in rows(wh, "SELECT origin FROM raw_inputs")}
        assert gone <= landed

    result = drain_inbox(inbox, Settings(warehouse=wh))
    assert pending_files(inbox) == ([], 0)
    assert result.n_drained == len(left)
    assert rows(wh, "SELECT count(*) FROM raw_inputs WHERE status = 'loaded'")[0][0] == n
    assert rows(wh, "SELECT count(DISTINCT input_sha256) FROM raw_inputs")[0][0] == n
