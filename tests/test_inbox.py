"""Draining the inbox (pipeline/sources/inbox.py): a file leaves only after it has landed."""

from __future__ import annotations

import json
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
from pipeline.sources.inbox import DONE_DIR, REFUSED_DIR, drain_inbox, pending_files, scan_inbox
from tests.conftest import (
    open_warehouse,
)

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


# --- what must never block the inbox, nor stay in it for ever (issue 20) ----------------------------


def _drain_in_a_subprocess(inbox: Path, wh: Path, run_id: str, **kw) -> dict:
    """drain_inbox in another process, so that a drain that blocks (on a named pipe) fails the
    test instead of hanging it."""
    code = ("import json, sys; from pathlib import Path; from pipeline.config import Settings;"
            "from pipeline.sources.inbox import drain_inbox;"
            "r = drain_inbox(sys.argv[1], Settings(warehouse=Path(sys.argv[2])), sys.argv[3], **json.loads(sys.argv[4]));"
            "print('JSON:' + json.dumps(r.as_dict(), default=str))")
    proc = subprocess.run([sys.executable, "-c", code, str(inbox), str(wh), run_id, json.dumps(kw)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:"))[5:])


def test_a_named_pipe_and_a_dangling_link_are_refused_with_a_reason_and_the_page_beside_them_loads(tmp_path):
    inbox, wh = tmp_path / "inbox", tmp_path / "wh"
    fill(inbox, [GOOD])
    (inbox / "again.txt").write_bytes(GOOD.read_bytes() + b"\n")  # other bytes, the same page
    os.utime(inbox / "again.txt", (0, 0))
    os.mkfifo(inbox / "pipe")
    (inbox / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    for name in ("pipe", "gone.txt"):
        os.utime(inbox / name, (0, 0), follow_symlinks=False)

    result = _drain_in_a_subprocess(inbox, wh, "inbox-odd")

    assert (result["n_found"], result["n_drained"], result["n_refused"]) == (4, 2, 2)
    reasons = {Path(r["path"]).name: r["reason"] for r in result["refused"]}
    assert "not a regular file" in reasons["pipe"] and "named pipe" in reasons["pipe"]
    assert "symbolic link" in reasons["gone.txt"] and "does not exist" in reasons["gone.txt"]
    assert result["run"]["n_loaded"] == 2 and result["run"]["n_rejected"] == 2
    assert result["verdict"] == "WARN"  # two of four new inputs rejected: not more than half
    assert rows(wh, "SELECT count(*) FROM features")[0][0] == 1
    # they left the inbox (set aside with the run, never read), so the next drain is clean
    assert sorted(p.name for p in inbox.iterdir()) == [".done", ".refused"]
    aside = inbox / ".refused" / "inbox-odd"
    assert (aside / "pipe").is_fifo() and (aside / "gone.txt").is_symlink()
    again = _drain_in_a_subprocess(inbox, wh, "inbox-next")
    assert (again["n_found"], again["run_id"]) == (0, None)


def test_emptied_subfolders_go_and_folders_still_filling_stay(tmp_path):
    inbox, wh = tmp_path / "inbox", tmp_path / "wh"
    for sub in ("a/b", "c"):
        (inbox / sub).mkdir(parents=True)
    shutil.copyfile(GOOD, inbox / "a" / "b" / "page.txt")
    os.utime(inbox / "a" / "b" / "page.txt", (0, 0))
    shutil.copyfile(BAD, inbox / "c" / "fresh.txt")  # still being copied: waits, and so does c/
    result = drain_inbox(inbox, Settings(warehouse=wh), "inbox-subs", settle_seconds=60)
    assert (result.n_drained, result.n_waiting) == (1, 1)
    assert sorted(p.relative_to(inbox).as_posix() for p in inbox.iterdir()) == [".done", "c"]


def test_drained_files_are_kept_keep_days_then_pruned(tmp_path):
    inbox, wh = tmp_path / "inbox", tmp_path / "wh"
    old, recent = inbox / DONE_DIR / "inbox-old", inbox / DONE_DIR / "inbox-recent"
    for folder, age_days in ((old, 8), (recent, 6)):
        folder.mkdir(parents=True)
        (folder / "page.txt").write_text("landed long ago")
        when = time.time() - age_days * 86400
        os.utime(folder / "page.txt", (when, when))
        os.utime(folder, (when, when))
    fill(inbox, [GOOD])
    result = drain_inbox(inbox, Settings(warehouse=wh), "inbox-now", keep_days=7)
    assert result.n_pruned == 1 and result.n_drained == 1
    assert sorted(p.name for p in (inbox / DONE_DIR).iterdir()) == ["inbox-now", "inbox-recent"]
    # an empty drain prunes too (the inbox is drained every ten minutes, mostly empty)
    assert drain_inbox(inbox, Settings(warehouse=wh), keep_days=0).n_pruned == 2


def test_a_drain_whose_every_input_was_rejected_says_fail(tmp_path):
    inbox, wh = tmp_path / "inbox", tmp_path / "wh"
    fill(inbox, [BAD])
    result = drain_inbox(inbox, Settings(warehouse=wh), "inbox-bad")
    assert result.n_drained == 1  # it landed (as rejected): it leaves the inbox
    assert result.verdict == "FAIL" and "none loaded" in result.verdict_reason
    assert result.as_dict()["verdict"] == "FAIL"


# An inbox holding a link to a folder that keeps changing (``/tmp``) counted it as "still being
# copied" at every drain, for ever: its settle time was read from the folder it points to, which
# a drain never reads, instead of from the link. (Found reviewing issue 20's fixes from outside.)
def test_a_link_to_a_busy_folder_is_refused_not_left_waiting_for_ever(tmp_path):
    """A link is judged by its own age: the folder it points to is never read, and its
    modification time says nothing about the link (a busy /tmp changes every second)."""
    inbox, busy = tmp_path / "inbox", tmp_path / "busy"
    inbox.mkdir()
    busy.mkdir()
    (inbox / "to-busy").symlink_to(busy)
    os.utime(inbox / "to-busy", (time.time() - 3600, time.time() - 3600), follow_symlinks=False)
    (busy / "just-written").write_text("x")  # the target changed a moment ago

    pending = scan_inbox(inbox, settle_seconds=60)
    assert pending.waiting == 0
    assert [(p.name, "link to a folder" in why) for p, why in pending.refused] == [("to-busy", True)]

    result = drain_inbox(inbox, Settings(warehouse=tmp_path / "wh"), "inbox-link", settle_seconds=60)
    assert (result.n_refused, result.n_waiting) == (1, 0)
    assert (inbox / REFUSED_DIR / "inbox-link" / "to-busy").is_symlink()
    assert (busy / "just-written").exists()  # what it points to is left alone
