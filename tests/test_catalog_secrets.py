"""A PostgreSQL catalog's password is never printed: not by ``featurehouse config`` (review 41
B3), nor in the one line that says the catalog does not answer, whichever form names it: libpq's
``key=value`` string or a URL, ``postgres:postgresql://user:pw@host:port/db`` or the bare
``postgresql://...`` (review 41 B4: the URL form was said as ``localhost:5432``, and a bare URL
failed with a traceback holding the password)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import Settings
from pipeline.lake import catalog_down

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")
SECRET = "Sekr3t-pw_XYZ"


def fh(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=180,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize(("catalog", "server"), [
    (f"postgres:dbname=featurehouse host=10.0.0.7 port=5433 user=fh password={SECRET}",
     "10.0.0.7:5433, database featurehouse"),
    (f"postgres:dbname=featurehouse host=db user=fh password='{SECRET} with spaces'", "db:5432, database featurehouse"),
    (f"postgres:postgresql://fh:{SECRET}@10.0.0.7:5433/featurehouse", "10.0.0.7:5433, database featurehouse"),
    (f"postgresql://fh:{SECRET}@db.example.org/featurehouse?sslmode=require", "db.example.org:5432, database featurehouse"),
    (f"postgres://fh:{SECRET}@[::1]:6432/wh", "[::1]:6432, database wh"),
    (f"postgres:postgresql://:{SECRET}@db:5433/wh", "db:5433, database wh"),
    (f"postgres:postgresql:///wh?host=/run/pg&port=5444&user=fh&password={SECRET}", "/run/pg:5444, database wh"),
])
def test_the_server_is_named_and_the_password_is_never_said(catalog, server):
    assert catalog_down.where(catalog) == server
    assert SECRET not in catalog_down.redact(catalog) and "***" in catalog_down.redact(catalog)
    # DuckDB's words for a server that is down echo the catalog as it was given
    exc = ConnectionError(f'Unable to connect to Postgres at "{catalog}": connection to server at "db", port 5433 '
                          "failed: Connection refused")
    line = catalog_down.said(exc, catalog)
    assert line.startswith(f"the warehouse's PostgreSQL catalog ({server}) does not answer: Connection refused")
    assert SECRET not in line


@pytest.mark.parametrize("catalog", [
    f"postgres:dbname=featurehouse host=127.0.0.1 port=5433 user=fh password={SECRET}",
    f"postgres:postgresql://fh:{SECRET}@127.0.0.1:5433/featurehouse",
    f"postgresql://fh:{SECRET}@127.0.0.1:5433/featurehouse",
])
def test_config_prints_the_catalog_without_its_password_in_every_format(tmp_path, catalog):
    """Review 41 B3: ``featurehouse config`` printed FEATUREHOUSE_CATALOG, password and all."""
    env = {"FEATUREHOUSE_CATALOG": catalog}
    table = fh("config", "--warehouse", str(tmp_path / "wh"), env=env)
    data = fh("config", "--warehouse", str(tmp_path / "wh"), "--format", "json", env=env)
    assert table.returncode == 0 and data.returncode == 0, table.stderr + data.stderr
    assert SECRET not in table.stdout + table.stderr and SECRET not in data.stdout + data.stderr
    rows = {r["setting"]: r for r in json.loads(data.stdout)}
    assert rows["catalog"]["from"] == "$FEATUREHOUSE_CATALOG"
    for name in ("catalog", "catalog_url"):
        assert "***" in rows[name]["value"] and "127.0.0.1" in rows[name]["value"], rows[name]
        assert rows[name]["value"] in table.stdout
    assert rows["catalog_url"]["value"].startswith("postgres:")  # as DuckLake takes it


@pytest.mark.postgres
def test_a_catalog_named_by_a_url_is_opened_and_said_down_naming_its_server(tmp_path):
    """The URL forms on a real server: a warehouse made through the bare ``postgresql://`` URL
    is read through ``postgres:postgresql://`` and the libpq string alike; stopped, each form's
    one line names the server (not ``localhost:5432``) and never the password."""
    from pipeline.lake import warehouse as wh
    from tests.airflow_helpers import pg_bin, postgres_cluster
    from tests.test_lakehouse import _stop_postgres

    if pg_bin() is None:
        pytest.fail("PostgreSQL is not installed: .ci/run installs it (apt-get install postgresql)")
    with postgres_cluster(password=SECRET) as pg:
        port = re.search(r"port=(\d+)", pg.catalog)[1]
        bare = f"postgresql://airflow:{SECRET}@127.0.0.1:{port}/featurehouse"
        forms = [bare, f"postgres:{bare}", pg.catalog]
        wh.connect(Settings(warehouse=tmp_path / "wh", catalog=bare), create=True).close()
        for catalog in forms:
            r = fh("sql", "SELECT count(*) AS n FROM runs", "--warehouse", str(tmp_path / "wh"), "--format", "csv",
                   env={"FEATUREHOUSE_CATALOG": catalog})
            assert r.returncode == 0 and r.stdout.split() == ["n", "0"], (catalog, r.stderr)
        _stop_postgres(pg.catalog)
        down = [(catalog, fh("status", "--warehouse", str(tmp_path / "wh"), env={"FEATUREHOUSE_CATALOG": catalog}))
                for catalog in forms]
    for catalog, r in down:
        assert r.returncode == 1 and "Traceback" not in r.stderr and SECRET not in r.stderr, (catalog, r.stderr)
        assert r.stderr.startswith(f"Error: the warehouse's PostgreSQL catalog (127.0.0.1:{port}, database "
                                   "featurehouse) does not answer"), (catalog, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
