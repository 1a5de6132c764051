"""A warehouse this user may not write (a read-only folder, a read-only copy, a data folder made
immutable) is said so in one line: not a traceback, and not called damaged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import Settings
from tests.conftest import _empty_warehouse, good_page, query, run_ingest, write
from tests.formats import to_api_json

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")


def fh(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_a_warehouse_this_user_may_not_write_is_said_so_not_a_traceback(tmp_path):
    """A read-only folder ended `ingest` in a PermissionError traceback; a read-only copy of a
    warehouse was called damaged ("restore it from a backup, or move it away")."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import FIXTURES

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop the override of file permissions")
    fh = [str(Path(sys.executable).with_name("featurehouse"))]
    as_user = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    r = subprocess.run(as_user + fh + ["ingest", str(FIXTURES), "--warehouse", str(ro / "wh"), "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "permission denied" in r.stderr and str(ro / "wh") in r.stderr

    warehouse = _empty_warehouse(tmp_path)
    for p in [warehouse, *warehouse.rglob("*")]:
        p.chmod(p.stat().st_mode & ~0o222)
    r = subprocess.run(as_user + fh + ["ingest", str(FIXTURES), "--warehouse", str(warehouse), "--no-progress",
                                       "--reprocess"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "may not write" in r.stderr and "restore it from a backup" not in r.stderr, r.stderr
    for p in [warehouse, *warehouse.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)


def test_a_data_folder_made_immutable_is_said_in_one_line(tmp_path):
    """EPERM ("Operation not permitted": `chattr +i`, some mounts) stops the run with its reason,
    not a traceback, as EACCES does (found from outside)."""
    wh = tmp_path / "wh"
    run_ingest([write(tmp_path / "a" / "p.json", to_api_json(good_page(1)))], Settings(warehouse=wh))
    folder = next(p for p in (wh / "data").rglob("activations") if p.is_dir())
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        write(tmp_path / "b" / "p.json", to_api_json(good_page(2)))
        proc = fh("ingest", str(tmp_path / "b"), "--warehouse", str(wh), "--no-progress")
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Operation not permitted" in proc.stderr and "may not write there" in proc.stderr, proc.stderr
    assert query(Settings(warehouse=wh), "SELECT status FROM runs ORDER BY started_at DESC LIMIT 1") == [("failed",)]
