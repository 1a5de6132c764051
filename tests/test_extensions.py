"""The DuckDB extensions featurehouse loads from their wheels: each file's signature is checked
once per process (DuckDB hashes the whole file at a LOAD: 0.3-1 s for ducklake's 36 MB, paid at
every open before), and a file that is not the signed one is refused, never loaded."""

from __future__ import annotations

import shutil

import duckdb
import pytest

from pipeline.lake import warehouse as wh


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
    checked = []
    real_connect = duckdb.connect

    def connect(*args, **kw):
        if not kw.get("config", {}).get("allow_unsigned_extensions"):
            checked.append(kw)
        return real_connect(*args, **kw)

    monkeypatch.setattr(wh, "_VERIFIED", set())
    monkeypatch.setattr(duckdb, "connect", connect)
    for _ in range(3):
        wh._duckdb(["sqlite_scanner", "ducklake"]).close()
    assert len(checked) == 2  # one checking connection per file, the first time only
    assert wh._VERIFIED == {wh.extension_path("sqlite_scanner"), wh.extension_path("ducklake")}
