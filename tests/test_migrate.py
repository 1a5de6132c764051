"""`featurehouse migrate` says what is wrong with a file it cannot migrate, without a traceback,
a download or a half-written warehouse: an SQLite file (a lakehouse catalog under the old name),
a single-file 0.1 warehouse that is damaged or cut short (issue 17, item 10)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pipeline.config import Settings
from pipeline.lake.legacy import LegacyMigrationError, migrate_file
from tests.conftest import _empty_warehouse

ROOT = Path(__file__).resolve().parent.parent
FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")


def fh(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_migrate_of_an_sqlite_file_says_what_it_is_and_fetches_nothing(tmp_path):
    """A lakehouse catalog renamed featurehouse.duckdb made `migrate` try to download DuckDB's
    SQLite extension, and quote that failed download."""
    import shutil

    from pipeline.config import Settings
    from pipeline.lake.legacy import LegacyMigrationError, migrate_file

    old = tmp_path / "featurehouse.duckdb"
    shutil.copy(_empty_warehouse(tmp_path) / "catalog.sqlite", old)
    with pytest.raises(LegacyMigrationError, match="is an SQLite database, not a featurehouse 0.1 warehouse"):
        migrate_file(old, Settings(warehouse=tmp_path / "new"))
    assert not (tmp_path / "new").exists()


# --- a damaged single-file 0.1 warehouse (issue 17, item 10) --------------------------------------


def _legacy_copy(tmp_path: Path, damage) -> Path:
    root = tmp_path / "old"
    root.mkdir()
    with tarfile.open(ROOT / "tests" / "legacy" / "warehouse-0.1.tar.gz") as tar:
        tar.extractall(root, filter="data")
    old = root / "featurehouse.duckdb"
    data = bytearray(old.read_bytes())
    old.write_bytes(damage(data))
    return old


@pytest.mark.parametrize("damage", [
    pytest.param(lambda data: bytes(data[:len(data) * 9 // 10]), id="cut-short"),
    pytest.param(lambda data: bytes(data[:300_000] + bytes(20_000) + data[320_000:]), id="overwritten-block"),
])
def test_a_damaged_single_file_warehouse_is_refused_naming_the_damage(tmp_path, damage):
    """A truncated or corrupt 0.1 warehouse made `featurehouse migrate` print a traceback."""
    old = _legacy_copy(tmp_path, damage)
    target = tmp_path / "new"
    with pytest.raises(LegacyMigrationError, match="damaged or cut short") as err:
        migrate_file(old, Settings(warehouse=target))
    assert str(old) in str(err.value) and "nothing was migrated" in str(err.value)
    assert not target.exists(), "nothing is written for a file that cannot be read whole"


def test_migrate_says_what_is_wrong_without_a_traceback(tmp_path):
    old = _legacy_copy(tmp_path, lambda data: bytes(data[:len(data) * 9 // 10]))
    proc = fh("migrate", str(old), "--warehouse", str(tmp_path / "new"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "is damaged or cut short" in proc.stderr
