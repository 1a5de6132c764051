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


# --- the record: only this user's, only a regular file, only the file that was checked ------------

def _record_now(path, cache) -> None:
    identity = wh._identity(str(path))
    wh._record_checked(str(path), identity)
    assert wh._checked_before(str(path)), "the record was not written"


def test_a_file_swapped_during_its_check_is_not_recorded(tmp_path):
    """The identity is taken before the check: if the file at the path is another one after it
    (a rename over it, same size and modification time), nothing is recorded."""
    good, unsigned = tmp_path / "sqlite_scanner.duckdb_extension", tmp_path / "other"
    shutil.copyfile(wh.extension_path("sqlite_scanner"), good)
    before = wh._identity(str(good))
    shutil.copyfile(good, unsigned)
    os.utime(unsigned, ns=(before[3], before[3]))
    os.replace(unsigned, good)  # ... while DuckDB was hashing the first
    wh._record_checked(str(good), before)
    assert not (tmp_path / "cache" / wh._CHECKED_FILE).exists()
    assert not wh._checked_before(str(good))


@pytest.mark.parametrize("loosen", ["folder_writable_by_others", "file_writable_by_group", "file_of_another_user"])
def test_a_record_others_could_have_written_is_not_believed(tmp_path, loosen):
    copy = tmp_path / "sqlite_scanner.duckdb_extension"
    shutil.copyfile(wh.extension_path("sqlite_scanner"), copy)
    cache = tmp_path / "cache"
    _record_now(copy, cache)
    record = cache / wh._CHECKED_FILE
    if loosen == "folder_writable_by_others":
        cache.chmod(0o777)
    elif loosen == "file_writable_by_group":
        record.chmod(0o660)
    else:
        if os.geteuid() != 0:
            pytest.skip("only root can give a file to another user")
        os.chown(record, 65534, 65534)
    assert not wh._checked_before(str(copy))


@pytest.mark.parametrize("kind", ["fifo", "link_to_dev_zero", "folder", "too_large"])
def test_a_record_that_is_not_a_small_regular_file_is_ignored_and_nothing_is_left_behind(tmp_path, kind):
    copy = tmp_path / "sqlite_scanner.duckdb_extension"
    shutil.copyfile(wh.extension_path("sqlite_scanner"), copy)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    record = cache / wh._CHECKED_FILE
    if kind == "fifo":
        os.mkfifo(record)  # reading it would wait for a writer for ever
    elif kind == "link_to_dev_zero":
        record.symlink_to("/dev/zero")  # reading it would never end
    elif kind == "folder":
        record.mkdir()
    else:
        record.write_bytes(b'{"x": "' + b"y" * wh._CHECKED_MAX_BYTES + b'"}')
        record.chmod(0o600)
    assert not wh._checked_before(str(copy))
    wh._record_checked(str(copy), wh._identity(str(copy)))  # replaces it where it can, else gives up
    assert sorted(p.name for p in cache.iterdir()) == [wh._CHECKED_FILE]
    assert wh._checked_before(str(copy)) == (kind in ("fifo", "link_to_dev_zero", "too_large"))


def test_records_of_files_that_are_gone_are_dropped(tmp_path):
    a, b = tmp_path / "a.duckdb_extension", tmp_path / "b.duckdb_extension"
    for p in (a, b):
        shutil.copyfile(wh.extension_path("sqlite_scanner"), p)
    _record_now(a, tmp_path / "cache")
    a.unlink()  # an old virtualenv, removed
    _record_now(b, tmp_path / "cache")
    assert list(wh._read_checked(tmp_path / "cache")) == [f"{duckdb.__version__}:{b}"]
