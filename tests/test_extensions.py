"""The DuckDB extensions featurehouse loads from their wheels: each file's signature is checked
once per process (DuckDB hashes the whole file at a LOAD: 0.3-1 s for ducklake's 36 MB, paid at
every open before) and not again in a later process while the file is the same one (recorded in
the user's cache folder), and a file that is not the signed one is refused, never loaded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from pipeline.lake import warehouse as wh


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Checks recorded in this test's own cache folder, and none made by this process yet."""
    monkeypatch.setenv("FEATUREHOUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(wh, "_VERIFIED", set())


def counting_checks(monkeypatch) -> list:
    """The connections that check a signature (opened without ``allow_unsigned_extensions``)."""
    checked = []
    real_connect = duckdb.connect

    def connect(*args, **kw):
        if not kw.get("config", {}).get("allow_unsigned_extensions"):
            checked.append(kw)
        return real_connect(*args, **kw)

    monkeypatch.setattr(duckdb, "connect", connect)
    return checked


def test_a_tampered_extension_file_is_refused(tmp_path, monkeypatch):
    good = wh.extension_path("sqlite_scanner")
    bad = tmp_path / "sqlite_scanner.duckdb_extension"
    shutil.copyfile(good, bad)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of the code, not of the signature at the end
    bad.write_bytes(bytes(data))
    monkeypatch.setattr(wh, "extension_path", lambda name: str(bad))
    with pytest.raises(duckdb.Error, match="signature"):
        wh._duckdb(["sqlite_scanner"])
    assert str(bad) not in wh._VERIFIED


def test_each_extension_file_is_checked_once_per_process(monkeypatch):
    checked = counting_checks(monkeypatch)
    for _ in range(3):
        wh._duckdb(["sqlite_scanner", "ducklake"]).close()
    assert len(checked) == 2  # one checking connection per file, the first time only
    assert wh._VERIFIED == {wh.extension_path("sqlite_scanner"), wh.extension_path("ducklake")}


#: Loads the extension file argv[1] as ``warehouse`` does, in a process of its own (a file this
#: process has mapped must not be rewritten under it), and prints how many times it was checked.
_LOAD_IN_A_NEW_PROCESS = """
import sys, duckdb
from pipeline.lake import warehouse as wh
wh.extension_path = lambda name: sys.argv[1]
checks = []
real_connect = duckdb.connect
def connect(*args, **kw):
    if not kw.get("config", {}).get("allow_unsigned_extensions"):
        checks.append(kw)
    return real_connect(*args, **kw)
duckdb.connect = connect
try:
    wh._duckdb(["sqlite_scanner"]).close()
except duckdb.Error as exc:
    print("refused:", exc)
print("checks:", len(checks))
"""


def load_in_a_new_process(path, cache) -> str:
    proc = subprocess.run([sys.executable, "-c", _LOAD_IN_A_NEW_PROCESS, str(path)], capture_output=True, text=True,
                          env={**os.environ, "FEATUREHOUSE_CACHE_DIR": str(cache)}, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_later_process_does_not_check_the_same_file_again_but_checks_a_changed_one(tmp_path):
    copy = tmp_path / "sqlite_scanner.duckdb_extension"
    shutil.copyfile(wh.extension_path("sqlite_scanner"), copy)
    assert load_in_a_new_process(copy, tmp_path / "cache").split() == ["checks:", "1"]
    assert (tmp_path / "cache" / wh._CHECKED_FILE).is_file()
    assert load_in_a_new_process(copy, tmp_path / "cache").split() == ["checks:", "0"]  # recorded

    # written again with the same bytes and its old modification time: its change time says so
    stat = copy.stat()
    copy.write_bytes(copy.read_bytes())
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert load_in_a_new_process(copy, tmp_path / "cache").split() == ["checks:", "1"]


def test_a_file_tampered_after_its_check_was_recorded_is_refused(tmp_path):
    """Changed in place (same inode and size, its modification time put back): refused."""
    copy = tmp_path / "sqlite_scanner.duckdb_extension"
    shutil.copyfile(wh.extension_path("sqlite_scanner"), copy)
    assert load_in_a_new_process(copy, tmp_path / "cache").split() == ["checks:", "1"]
    stat = copy.stat()
    with copy.open("r+b") as f:
        f.seek(stat.st_size // 2)
        byte = f.read(1)
        f.seek(stat.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (copy.stat().st_ino, copy.stat().st_size, copy.stat().st_mtime_ns) == (
        stat.st_ino, stat.st_size, stat.st_mtime_ns)
    out = load_in_a_new_process(copy, tmp_path / "cache")
    assert "refused:" in out and "signature" in out, out


def test_an_unreadable_or_broken_record_means_checking_again(tmp_path, monkeypatch):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / wh._CHECKED_FILE).write_bytes(b"[not a record")
    checked = counting_checks(monkeypatch)
    wh._duckdb(["sqlite_scanner"]).close()
    assert len(checked) == 1
    monkeypatch.setenv("FEATUREHOUSE_CACHE_DIR", "/proc/no-such-folder")  # cannot be written
    monkeypatch.setattr(wh, "_VERIFIED", set())
    wh._duckdb(["sqlite_scanner"]).close()
    assert len(checked) == 2
