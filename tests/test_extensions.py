"""The DuckDB extensions featurehouse loads, offline, with DuckDB's own trust: each wheel's file
is signed with DuckDB's core key; it is installed from the wheel into this user's extension
folder (DuckDB checks the signature before it writes a byte) and loaded from there by name
(checked again at each load); no connection the library opens allows unsigned extensions or
downloads one, and a file that is not the signed one is refused, never loaded."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from pipeline.config import Settings
from pipeline.lake import extensions as ext
from pipeline.lake import warehouse as wh

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> Path:
    """An extension folder of this test's own, empty, and nothing installed by this process yet."""
    monkeypatch.setenv("FEATUREHOUSE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ext, "_INSTALLED", {})
    return tmp_path / "cache" / "duckdb-extensions"


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory) -> Path:
    """An empty warehouse (its schema, no rows)."""
    path = tmp_path_factory.mktemp("ext") / "wh"
    wh.connect(path, create=True).close()
    return path


def tampered_copy(name: str, folder: Path) -> Path:
    """A copy of the wheel's file of ``name`` with one byte of its code changed (not of the
    signature at its end)."""
    folder.mkdir(parents=True, exist_ok=True)
    bad = folder / f"{name}.duckdb_extension"
    data = bytearray(Path(ext.extension_path(name)).read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    return bad


def settings_of(conn: duckdb.DuckDBPyConnection) -> dict[str, str]:
    return dict(conn.execute("SELECT name, value FROM duckdb_settings() WHERE name IN ('allow_unsigned_extensions', "
                             "'allow_community_extensions', 'autoinstall_known_extensions')").fetchall())


SAFE = {"allow_unsigned_extensions": "false", "allow_community_extensions": "false",
        "autoinstall_known_extensions": "false"}


def test_every_wheel_carries_a_file_signed_with_duckdbs_core_key():
    """What the rest stands on: DuckDB's default checks (and core keys only) accept each file."""
    for name in ext.WHEELS:
        with duckdb.connect(config={"autoinstall_known_extensions": False, "allow_community_extensions": False}) as c:
            assert settings_of(c)["allow_unsigned_extensions"] == "false"
            c.execute(f"LOAD '{ext.extension_path(name)}'")
            assert c.execute("SELECT loaded FROM duckdb_extensions() WHERE extension_name = ?", [name]).fetchone() == (
                True,)


def test_no_connection_the_library_opens_allows_unsigned_extensions_or_downloads(warehouse, monkeypatch):
    seen = []
    real_connect = duckdb.connect

    def connect(*args, **kw):
        conn = real_connect(*args, **kw)
        seen.append(settings_of(conn))
        return conn

    monkeypatch.setattr(duckdb, "connect", connect)
    settings = Settings.from_env(warehouse=warehouse)
    wh.connect(settings, read_only=True).close()
    wh.connect(settings).close()
    wh._catalog_state(settings)  # a probe of its own
    ext.new_connection(["fts"]).close()
    assert len(seen) >= 4
    assert all(s == SAFE for s in seen), seen


def test_featurehouse_sql_runs_with_signature_checks_on(warehouse, own_cache):
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "sql", "--warehouse", str(warehouse), "--format", "csv",
         "SELECT current_setting('allow_unsigned_extensions') AS u, current_setting('autoinstall_known_extensions') AS a, "
         "current_setting('extension_directory') AS d"],
        capture_output=True, text=True, timeout=180, cwd=REPO, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["u,a,d", f"false,false,{own_cache}"]


def test_the_wheels_files_are_installed_into_a_private_folder_and_loaded_by_name(own_cache):
    conn = ext.new_connection(["sqlite_scanner"])
    try:
        path, mode, origin = conn.execute(
            "SELECT install_path, install_mode, installed_from FROM duckdb_extensions() "
            "WHERE extension_name = 'sqlite_scanner' AND loaded").fetchone()
    finally:
        conn.close()
    assert Path(path).parent.parent.parent == own_cache
    assert (mode, origin) == ("CUSTOM_PATH", ext.extension_path("sqlite_scanner"))
    assert Path(path).read_bytes() == Path(ext.extension_path("sqlite_scanner")).read_bytes()
    assert own_cache.stat().st_mode & 0o777 == 0o700
    assert ext.extension_loaded("sqlite_scanner")


def test_a_tampered_wheel_file_is_refused_and_never_installed(tmp_path, own_cache, monkeypatch):
    bad = tampered_copy("fts", tmp_path / "bad")
    monkeypatch.setattr(ext, "extension_path", lambda name: str(bad))
    with pytest.raises(duckdb.Error, match="signature"):
        ext.new_connection(["fts"])
    assert not list(own_cache.rglob("fts.duckdb_extension"))


def test_a_tampered_wheel_file_is_refused_without_a_folder_too(tmp_path, monkeypatch):
    bad = tampered_copy("fts", tmp_path / "bad")
    monkeypatch.setattr(ext, "extension_path", lambda name: str(bad))
    monkeypatch.delenv("FEATUREHOUSE_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME", raising=False)
    assert ext.extension_directory() is None
    with pytest.raises(duckdb.Error, match="signature"):
        ext.new_connection(["fts"])
    # and into a connection someone opened allowing unsigned extensions: checked all the same
    with duckdb.connect(config={"allow_unsigned_extensions": True}) as conn, \
            pytest.raises(duckdb.Error, match="signature"):
        ext.load_extension(conn, "fts")


def test_a_tampered_installed_copy_is_refused_and_installed_again_from_the_wheel(own_cache, caplog):
    ext.new_connection(["fts"]).close()
    installed = next(own_cache.rglob("fts.duckdb_extension"))
    bad = tampered_copy("fts", installed.parent / "tmp")
    os.replace(bad, installed)  # a new file at the path (this process has the old one mapped)
    with duckdb.connect(config={"extension_directory": str(own_cache)}) as plain, \
            pytest.raises(duckdb.Error, match="signature"):
        plain.execute("LOAD fts")  # DuckDB itself refuses it

    with caplog.at_level(logging.WARNING, logger="featurehouse"):
        ext.new_connection(["fts"]).close()  # the library: refused, then installed again and loaded
    assert "refused the installed copy of the fts extension" in caplog.text
    assert installed.read_bytes() == Path(ext.extension_path("fts")).read_bytes()


def test_a_folder_others_may_write_is_not_used(own_cache):
    own_cache.mkdir(parents=True)
    own_cache.chmod(0o777)
    assert ext.extension_directory() is None
    with ext.new_connection(["fts"]) as conn:  # from the wheel's file, checked
        assert conn.execute("SELECT install_path FROM duckdb_extensions() WHERE extension_name = 'fts'"
                            ).fetchone()[0] != str(own_cache)
        assert settings_of(conn) == SAFE
    assert not list(own_cache.iterdir())


#: In a process of its own, without any network (a network namespace of its own): opens the
#: warehouse argv[1] with an empty extension folder, then shows that a query needing an extension
#: that is not installed fails without a download, and that autoloading finds the installed ones.
_OFFLINE = """
import sys, duckdb
from pipeline.lake import extensions as ext, warehouse as wh
conn = wh.connect(sys.argv[1], read_only=True)
print("features:", conn.execute("SELECT count(*) FROM features").fetchone()[0])
try:
    conn.execute("SELECT * FROM read_parquet('s3://featurehouse-nowhere/x.parquet')")
except duckdb.Error as exc:
    print("s3:", " ".join(str(exc).split()))
conn.close()
bare = ext.new_connection([])
bare.execute(f"ATTACH 'ducklake:sqlite:{sys.argv[1]}/catalog.sqlite' AS l (READ_ONLY)")
print("autoloaded:", sorted(n for (n,) in bare.execute(
    "SELECT extension_name FROM duckdb_extensions() WHERE loaded AND install_mode = 'CUSTOM_PATH'").fetchall()))
"""


def test_loading_works_offline_from_an_empty_folder_and_never_downloads(warehouse, own_cache):
    if subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode != 0:
        pytest.skip("this system cannot give a process a network namespace of its own (unshare -rn)")
    catalog = Settings.from_env(warehouse=warehouse).catalog_url
    assert catalog == f"sqlite:{warehouse}/catalog.sqlite", catalog
    proc = subprocess.run(["unshare", "-rn", sys.executable, "-c", _OFFLINE, str(warehouse)], capture_output=True,
                          text=True, timeout=180, cwd=REPO, env={**os.environ, "FEATUREHOUSE_CACHE_DIR": str(own_cache.parent)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert lines["features"] == "0"
    assert "Install it first" in lines["s3"] and "download" not in lines["s3"].lower(), lines["s3"]
    assert lines["autoloaded"] == "['ducklake', 'sqlite_scanner']"
    assert sorted(p.name for p in own_cache.rglob("*.duckdb_extension")) == [
        "ducklake.duckdb_extension", "sqlite_scanner.duckdb_extension"]


_INSTALL_AND_QUERY = """
from pipeline.lake import extensions as ext
with ext.new_connection(["fts"]) as conn:
    print(conn.execute("SELECT stem('running', 'porter')").fetchone()[0])
"""


def test_two_processes_installing_into_an_empty_folder_at_once(own_cache):
    env = {**os.environ, "FEATUREHOUSE_CACHE_DIR": str(own_cache.parent)}
    procs = [subprocess.Popen([sys.executable, "-c", _INSTALL_AND_QUERY], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO, env=env) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        assert out.split() == ["run"]
    assert sorted(p.name for p in own_cache.rglob("*.duckdb_extension*")) == [
        "fts.duckdb_extension", "fts.duckdb_extension.info"]
    assert not [p for p in own_cache.rglob("*") if "tmp" in p.name]


def test_the_attach_statements_for_other_clients_load_the_wheels_files(warehouse):
    lines = wh.attach_sql(Settings.from_env(warehouse=warehouse))
    assert lines[:2] == [f"LOAD '{ext.extension_path('ducklake')}';", f"LOAD '{ext.extension_path('sqlite_scanner')}';"]
    with duckdb.connect() as plain:  # DuckDB's defaults: signature checks on
        for line in lines:
            plain.execute(line)
        assert plain.execute("SELECT count(*) FROM features").fetchone() == (0,)
