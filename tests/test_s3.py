"""S3 storage (moto's server on loopback): the data path and the landing area as ``s3://``.

* landing on S3 is content-addressed and happens once: a conditional put, a multipart upload
  for a large input (never visible half-written), racing landers make one object;
* a fetch into an S3 landing area and its ingest into S3 data files give the same tables as
  the same fetch on disk (feature pages through the API, and export batches that DuckDB streams
  from S3);
* the units of a window ingested at once, as the nightly DAG's mapped ingests do, give the same
  tables and statistics as one ingest, and the run's counters add up.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.config import Settings
from pipeline.ingest import PART_BATCHES
from pipeline.lake import s3
from pipeline.lake.landing import read_landed
from pipeline.sources.fetch import (
    fetch_exports,
    fetch_features,
    finish_fetched,
    ingest_fetched,
    ingest_unit,
)
from pipeline.sources.night import ingest_units
from pipeline.stages.land import land
from pipeline.stages.materialise import refresh_run
from pipeline.stages.receive import Input
from tests.airflow_helpers import postgres_cluster
from tests.conftest import query, tables_rows
from tests.fake_neuronpedia import FakeNeuronpedia
from tests.fetch_support import FAST, MODEL, SOURCE, pages, scalar
from tests.s3_support import moto_s3

TABLES = ("features", "activations", "explanations", "models", "sources", "source_sets",
          "feature_activation_stats", "source_activation_stats")


@pytest.fixture(scope="module")
def server():
    with moto_s3() as srv:
        yield srv


@pytest.fixture
def env(server, monkeypatch):
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return server


def on_s3(tmp_path: Path, server, bucket: str | None = None) -> Settings:
    bucket = bucket or server.bucket()
    return Settings.from_env(warehouse=tmp_path / "wh-s3", data_path=f"s3://{bucket}/lake/data/",
                             landing=f"s3://{bucket}/lake/landing")


def test_landing_on_s3_is_content_addressed_and_once(env, tmp_path, monkeypatch):
    bucket = env.bucket()
    landing = f"s3://{bucket}/landing"
    first = land(Input(origin="a", data=b'{"x": 1}'), landing, max_bytes=10**6)
    assert first.new and first.path == f"{landing}/sha256/{first.sha256[:2]}/{first.sha256}"
    again = land(Input(origin="b", data=b'{"x": 1}'), landing, max_bytes=10**6)
    assert not again.new and again.path == first.path
    assert read_landed(first.path) == b'{"x": 1}'

    # racing landers of the same bytes: one object, made once
    with ThreadPoolExecutor(8) as pool:
        news = list(pool.map(lambda i: land(Input(origin=str(i), data=b"same"), landing, 10**6).new, range(8)))
    assert sum(news) == 1

    # over the parse limit: streamed through a local spool file and a multipart upload
    monkeypatch.setattr(s3, "PART_SIZE", 5 * 1024 * 1024)
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(range(256)) * (12 * 1024 * 1024 // 256))
    landed = land(Input(origin=str(big), path=big), landing, max_bytes=1000)
    assert landed.new and landed.data is None and landed.n_bytes == big.stat().st_size
    assert read_landed(landed.path) == big.read_bytes()
    assert not land(Input(origin="again", path=big), landing, max_bytes=1000).new
    assert not env.client().list_multipart_uploads(Bucket=bucket).get("Uploads")  # none left open


def test_files_ingested_from_disk_land_on_s3(env, tmp_path):
    """`featurehouse ingest FILES` (and the inbox) with an S3 landing area: bytes land there,
    nothing in a local landing folder."""
    from tests.conftest import run_ingest

    s = on_s3(tmp_path, env)
    files = sorted(p for p in (Path(__file__).resolve().parent.parent / "samples").iterdir() if p.is_file())[:2]
    summary = run_ingest(files, s)
    assert summary.n_received == 2
    landed = dict(query(s, "SELECT origin, landed_path FROM raw_inputs"))
    assert {Path(o).name for o in landed} == {f.name for f in files}
    for origin, path in landed.items():
        assert path.startswith("s3://") and read_landed(path) == Path(origin).read_bytes()
    assert not (s.warehouse / "landing").exists() and not Path("s3:").exists()


@pytest.mark.heavy(60)
@pytest.mark.postgres
def test_on_s3_one_ingest_and_units_at_once_match_one_ingest_on_disk(env, tmp_path):
    """The same window fetched on disk and into S3: one ingest on disk; one ingest on S3; and
    the units of the window ingested by four writers at once (threads) on a PostgreSQL catalog,
    as the nightly DAG's mapped ingests do, each its own part of one run, then one materialise.
    API pages and export batch files (which DuckDB streams from S3) alike."""
    with postgres_cluster() as pg:
        _units_at_once(env, tmp_path, pg.catalog)


def _units_at_once(env, tmp_path, catalog: str) -> None:
    chunks = [{"window": "w", "model": MODEL, "source": SOURCE, "via": "api", "start": a, "stop": a + 10}
              for a in (0, 10, 20)] + [{"window": "w", "model": MODEL, "source": SOURCE, "via": "exports"}]
    local = Settings.from_env(warehouse=tmp_path / "wh-local")
    bucket = env.bucket()
    remote = on_s3(tmp_path, env, bucket)
    parallel = replace(remote, warehouse=tmp_path / "wh-parallel", data_path=f"s3://{bucket}/parallel/data/",
                       catalog=catalog)
    with FakeNeuronpedia(pages=pages(30), batch_features=15) as np:  # two batch files a table
        for s in (local, remote):  # `parallel` shares `remote`'s landing area
            fetch_features(MODEL, SOURCE, range(0, 30), settings=s, base_url=np.base_url, window="w", **FAST)
            fetch_exports(MODEL, SOURCE, settings=s, exports_url=np.exports_url, window="w", **FAST)
    for s in (local, remote):
        summary = ingest_fetched("w", s, run_id="r", progress=False, report_after=False)
        assert summary.n_rejected == 0 and summary.n_quarantined == 0

    units = ingest_units(chunks, parallel)
    assert [u["part"] for u in units] == list(range(len(units)))
    assert len(units) == 3 + 1 + 3 * 2  # API chunks, the small export files, 3 tables x 2 batches
    start = threading.Barrier(4)

    def one(unit):
        if unit["part"] < 4:
            start.wait(timeout=60)  # the first four start together
        return ingest_unit(unit, parallel, run_id="night").as_dict()

    with ThreadPoolExecutor(4) as pool:
        parts = list(pool.map(one, units))
    assert finish_fetched("w", parallel, run_id="night")["status"] == "succeeded"
    refresh_run(parallel, "night")

    want, on_s3_, at_once = (tables_rows(s, TABLES) for s in (local, remote, parallel))
    for table in TABLES:
        assert on_s3_[table] == want[table], table
        assert at_once[table] == want[table], table
    assert scalar(remote, "SELECT count(*) FROM features") == 30

    keys = env.keys(bucket)
    for prefix in ("lake/data/main/", "parallel/data/main/"):  # Parquet on S3
        assert any(k.startswith(prefix) and k.endswith(".parquet") for k in keys)
    assert any(k.startswith("lake/landing/sha256/") for k in keys)
    assert any(k.startswith("lake/landing/fetch/w/") for k in keys)  # the manifest's parts
    for s in (remote, parallel):
        assert not (s.warehouse / "data").exists() and not (s.warehouse / "landing").exists()
    assert parallel.catalog_kind == "postgres" and not (parallel.warehouse / "catalog.sqlite").exists()
    paths = [p for (p,) in query(parallel, "SELECT landed_path FROM raw_inputs")]
    assert paths and all(p.startswith(f"s3://{bucket}/lake/landing/sha256/") for p in paths)

    (status, n_received, n_loaded, commits) = query(
        parallel, "SELECT status, n_received, n_loaded, commits FROM runs WHERE run_id = 'night'")[0]
    assert status == "succeeded"
    assert n_received == sum(p["n_received"] for p in parts) == 30 + 3 + 3 * 2  # pages, small files, batches
    assert n_loaded == sum(p["n_loaded"] for p in parts)
    assert commits >= len(units)
    # every part numbers its batches apart: one run, no two parts' batches share a number
    (n_batches, n_parts) = query(parallel, f"SELECT count(DISTINCT batch_no), count(DISTINCT batch_no // {PART_BATCHES}) "
                                 "FROM validation_results WHERE run_id = 'night'")[0]
    assert n_batches == n_parts >= len(units) - 1  # (16 units, >= 15, with 4 batches a table)


def test_a_refused_record_of_a_page_landed_on_s3_is_quarantined(env, tmp_path):
    """The record is cut out of the page's local copy after validation: the copies must live
    until the load (they were removed before it, and the run failed on the missing file)."""
    import orjson

    from bench.generate import synthetic_page
    from tests.conftest import run_ingest, write

    s = on_s3(tmp_path, env)
    summary = run_ingest([write(tmp_path / "in" / "p.json", orjson.dumps(synthetic_page(5, valid=False)))], s)
    assert summary.status == "succeeded" and summary.n_activations == 39 and summary.n_quarantined == 1
    [(record,)] = query(s, "SELECT record_json FROM quarantine")
    assert orjson.loads(record)["id"] and not list((s.warehouse).rglob("scratch*"))


def test_a_reader_given_only_the_warehouse_reads_its_s3_data(env, tmp_path):
    """A reader that names no data path (the catalog records s3://...) reads the data files from
    the configured endpoint: DuckDB autoloads httpfs for the path, and the endpoint and
    credentials are featurehouse's secret (without it DuckDB went to AWS: 'Could not resolve
    hostname ... s3.us-east-1.amazonaws.com', seen in the Celery test)."""
    from tests.conftest import open_warehouse, run_ingest

    s = on_s3(tmp_path, env)
    files = sorted(p for p in (Path(__file__).resolve().parent.parent / "samples").iterdir() if p.is_file())
    run_ingest(files, s)
    parquet = [o["Key"] for o in env.client().list_objects_v2(Bucket=s.data_url.split("/")[2]).get("Contents", [])
               if o["Key"].endswith(".parquet") and "/activations/" in o["Key"]]
    assert parquet, "the activations are in data files on S3 (not inlined in the catalog)"
    reader = Settings.from_env(warehouse=s.warehouse)
    assert not reader.uses_s3
    with open_warehouse(reader) as conn:
        assert conn.execute("SELECT count(*) FROM activations WHERE len(values) > 0").fetchone()[0] > 0
