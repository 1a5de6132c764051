"""The whole run on the seeds and on crafted pages: counts, bookkeeping, batches, upserts."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from datetime import datetime

import pytest

from pipeline.config import SCHEMAS_DIR
from tests.conftest import (
    BAD_ACTIVATION,
    SEED_FLIGHT,
    SEED_NOT_A_PAGE,
    good_page,
    query,
    run_ingest,
    seed_page_copy,
    table_rows,
    write,
)
from tests.formats import to_api_json, to_flight

N_EXPECTATIONS = sum(len(json.loads(f.read_text())["expectations"])
                     for f in (SCHEMAS_DIR / "expectations").glob("*.json"))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    from pipeline.config import Settings

    settings = Settings(warehouse=tmp_path_factory.mktemp("seeds") / "wh.duckdb")
    summary = run_ingest([SEED_FLIGHT.parent], settings)
    return settings.warehouse, summary


def test_seed_run_summary(seeds):
    wh, s = seeds
    page = seed_page_copy()
    n_good = sum(len(a["tokens"]) == len(a["values"]) for a in page["activations"])
    assert (s.status, s.n_received, s.n_landed, s.n_loaded, s.n_rejected) == ("succeeded", 2, 2, 1, 1)
    assert (s.n_features, s.n_activations, s.n_explanations, s.n_quarantined) == (1, n_good, 1, 1)
    assert s.n_expectations == N_EXPECTATIONS and s.n_expectations_failed == 1
    row = query(wh, "SELECT status, n_received, n_loaded, n_rejected, n_features, n_activations, n_quarantined, "
                    "finished_at >= started_at FROM runs")
    assert row == [("succeeded", 2, 1, 1, 1, n_good, 1, True)]


def test_seed_raw_inputs(seeds):
    wh, s = seeds
    rows = {o.rsplit("/", 1)[-1]: r for o, *r in query(
        wh, "SELECT origin, format, status, n_bytes, n_features, n_activations, n_explanations FROM raw_inputs")}
    assert rows[SEED_FLIGHT.name] == ["flight", "loaded", SEED_FLIGHT.stat().st_size, 1, 39, 1]
    fmt, status, n_bytes, *_ = rows[SEED_NOT_A_PAGE.name]
    assert (status, n_bytes) == ("rejected", SEED_NOT_A_PAGE.stat().st_size)


def test_seed_quarantine_keeps_the_record(seeds):
    wh, _ = seeds
    (kind, key, check, detail, record) = query(
        wh, "SELECT record_kind, record_key, check_name, detail, record_json FROM quarantine")[0]
    record = json.loads(record)
    assert (kind, key, check) == ("activation", BAD_ACTIVATION, "tokens_values_same_length")
    assert (len(record["tokens"]), len(record["values"])) == (986, 992) and record["id"] == BAD_ACTIVATION
    assert detail == "len(tokens) = 986 but len(values) = 992"
    assert query(wh, "SELECT count(*) FROM activations WHERE activation_id = ?", [BAD_ACTIVATION]) == [(0,)]


def test_seed_rows_are_typed(seeds):
    wh, _ = seeds
    page = seed_page_copy()
    (fi, src, created, vals) = query(wh, "SELECT feature_index, source_id, created_at, pos_values FROM features")[0]
    assert (fi, src, vals) == (45698, "11-resid-post-aa", page["pos_values"])
    assert created == datetime(2025, 9, 24, 4, 30, 34, 656000)
    a = next(a for a in page["activations"] if a["id"] != BAD_ACTIVATION)
    assert query(wh, 'SELECT tokens, "values", max_value, max_value_token_index, data_source FROM activations '
                     "WHERE activation_id = ?", [a["id"]]) == [
        (a["tokens"], [float(v) for v in a["values"]], a["maxValue"], a["maxValueTokenIndex"], a["dataSource"])]
    assert query(wh, "SELECT count(*), count(DISTINCT suite) FROM validation_results") == [(N_EXPECTATIONS, 3)]


def test_small_batches_give_the_same_tables(tmp_path, settings):
    pages = [good_page(i) for i in range(6)]
    paths = [write(tmp_path / "in" / f"{i}.txt", to_flight(p)) for i, p in enumerate(pages)]  # counted by activations
    paths.append(write(tmp_path / "in" / "seed.txt", SEED_FLIGHT.read_bytes()))
    one = run_ingest(paths, settings)
    many_settings = replace(settings, warehouse=tmp_path / "many" / "wh.duckdb", batch_activations=5)
    many = run_ingest(paths, many_settings)
    assert query(many_settings.warehouse, "SELECT count(DISTINCT batch_no) FROM validation_results")[0][0] > 2
    for t in ("features", "activations", "explanations", "quarantine", "feature_activation_stats", "raw_inputs"):
        exclude = ("input_sha256", "run_id", "loaded_at", "refreshed_at", "quarantined_at", "received_at",
                   "landed_path")  # the two warehouses land in different folders
        assert table_rows(many_settings.warehouse, t, exclude) == table_rows(settings.warehouse, t, exclude), t
    assert (one.n_activations, one.n_quarantined) == (many.n_activations, many.n_quarantined) == (18 + 39, 1)


@pytest.mark.parametrize("shape", ["api_json", "gzip_export"])
def test_the_activation_limit_closes_batches_on_every_road(tmp_path, settings, shape):
    """FEATUREHOUSE_BATCH_ACTIVATIONS was ignored for pages DuckDB reads (10 pages x 3 activations
    with a limit of 3 made one batch). An export file is never split: it closes its batch."""
    folder = tmp_path / "in"
    for i in range(10):
        page = good_page(i)
        if shape == "api_json":
            write(folder / f"{i}.json", to_api_json(page))
        else:
            rows = b"".join(json.dumps({k: v for k, v in a.items() if k != "createdAt"}).encode() + b"\n"
                            for a in page["activations"])
            write(folder / f"activations-{i}.jsonl.gz", gzip.compress(rows))
    s = run_ingest([folder], replace(settings, batch_activations=3))
    assert s.n_activations == 30 and s.n_rejected == 0
    assert query(settings.warehouse, "SELECT count(DISTINCT batch_no) FROM validation_results") == [(10,)]
    formats = query(settings.warehouse, "SELECT DISTINCT format FROM raw_inputs")
    assert formats == [("api_json" if shape == "api_json" else "gzip+export_jsonl",)], "not the DuckDB road"


def test_a_later_version_of_a_feature_replaces_the_earlier(tmp_path, settings):
    page = good_page(5)
    run_ingest([write(tmp_path / "v1.json", to_api_json(page))], settings)
    page["maxActApprox"] = 4.5
    page["activations"][0]["values"][0] = 0.25
    run_ingest([write(tmp_path / "v2.txt", to_flight(page))], settings)
    wh = settings.warehouse
    assert query(wh, "SELECT max_act_approx FROM features") == [(4.5,)]
    assert query(wh, "SELECT count(*) FROM activations") == [(3,)]
    assert query(wh, 'SELECT "values"[1] FROM activations WHERE activation_id = ?',
                 [page["activations"][0]["id"]]) == [(0.25,)]
    assert query(wh, "SELECT n_active_tokens FROM feature_activation_stats WHERE data_source = 'Chat'") == [(3,)]


@pytest.mark.parametrize("shape", ["api_json", "flight"])
def test_an_integer_too_large_is_a_bad_record_not_a_failed_run(tmp_path, settings, shape):
    page = good_page(8)
    page["activations"][0]["maxValueTokenIndex"] = 3_000_000_000
    bad_index = good_page(9)
    bad_index["index"] = str(2**63)
    encode = to_api_json if shape == "api_json" else to_flight
    s = run_ingest([write(tmp_path / "a", encode(page)), write(tmp_path / "b", encode(bad_index)),
                    write(tmp_path / "c", to_api_json(good_page(10)))], settings)
    assert s.status == "succeeded" and s.n_loaded == 2 and s.n_rejected == 1
    assert "index" in s.rejected[0]["reason"]
    wh = settings.warehouse
    assert query(wh, "SELECT record_key FROM quarantine WHERE check_name = 'max_value_token_index_in_excerpt'") == [
        (page["activations"][0]["id"],)]
    assert query(wh, "SELECT feature_index, count(*) FROM activations GROUP BY 1 ORDER BY 1") == [(8, 2), (10, 3)]


def test_reprocess_keeps_when_and_by_which_run_an_input_first_landed(tmp_path):
    from pipeline.config import Settings

    settings = Settings(warehouse=tmp_path / "wh.duckdb")
    first = run_ingest([SEED_FLIGHT, SEED_NOT_A_PAGE], settings)
    before = query(settings.warehouse, "SELECT input_sha256, run_id, received_at, status FROM raw_inputs ORDER BY 1")
    second = run_ingest([SEED_FLIGHT, SEED_NOT_A_PAGE], settings, reprocess=True)
    after = query(settings.warehouse, "SELECT input_sha256, run_id, received_at, status FROM raw_inputs ORDER BY 1")
    assert second.run_id != first.run_id and second.n_loaded == 1 and second.n_rejected == 1
    assert after == before and {r[1] for r in after} == {first.run_id}
    outcomes = query(settings.warehouse, "SELECT run_id, outcome FROM run_inputs ORDER BY 1, 2")
    assert outcomes == sorted([(first.run_id, "loaded"), (first.run_id, "rejected"),
                               (second.run_id, "loaded"), (second.run_id, "rejected")])


def test_a_retried_run_keeps_what_its_first_attempt_counted(tmp_path):
    """An Airflow retry re-runs ingest under the same run id: the run's counts and its
    run_inputs must stay those of the work done, not be reset to "all duplicates"."""
    from pipeline.config import Settings

    settings = Settings(warehouse=tmp_path / "wh.duckdb")
    first = run_ingest([SEED_FLIGHT, SEED_NOT_A_PAGE], settings, run_id="R")
    again = run_ingest([SEED_FLIGHT, SEED_NOT_A_PAGE], settings, run_id="R")
    counts = "n_received, n_loaded, n_rejected, n_duplicates, n_features, n_activations"
    assert query(settings.warehouse, f"SELECT {counts} FROM runs WHERE run_id = 'R'") == [
        (first.n_received, first.n_loaded, first.n_rejected, 0, first.n_features, first.n_activations)]
    assert (again.n_loaded, again.n_rejected, again.n_duplicates) == (first.n_loaded, first.n_rejected, 0)
    assert query(settings.warehouse, "SELECT outcome FROM run_inputs ORDER BY 1") == [("loaded",), ("rejected",)]


def test_an_input_refused_for_a_size_limit_loads_once_the_limit_is_raised(tmp_path):
    from pipeline.config import Settings

    small = Settings(warehouse=tmp_path / "wh.duckdb", max_input_bytes=1000)
    first = run_ingest([SEED_FLIGHT, SEED_NOT_A_PAGE], small)
    assert first.n_rejected == 2 and "FEATUREHOUSE_MAX_INPUT_BYTES" in first.rejected[0]["reason"]
    again = run_ingest([SEED_FLIGHT, SEED_NOT_A_PAGE], replace(small, max_input_bytes=2**28))
    # the seed page loads now; the page that is not a feature page is refused for what it is
    assert (again.n_loaded, again.n_rejected, again.n_landed) == (1, 1, 0)
    assert query(small.warehouse, "SELECT count(*) FROM activations") == [(39,)]
    reasons = [r for (r,) in query(small.warehouse, "SELECT reason FROM raw_inputs WHERE status = 'rejected'")]
    assert len(reasons) == 1 and "not a Neuronpedia feature page" in reasons[0]
    # and a third run changes nothing: both are now settled
    third = run_ingest([SEED_FLIGHT, SEED_NOT_A_PAGE], replace(small, max_input_bytes=2**28))
    assert (third.n_duplicates, third.n_loaded, third.n_rejected) == (2, 0, 0)


def test_an_export_batch_over_the_input_limit_is_streamed_not_refused(tmp_path):
    """The input limit bounds what is read into memory; a gzip export batch is never read into
    memory (DuckDB streams it), so only the decompressed limit applies to it."""
    import gzip

    from pipeline.config import Settings
    from tests.fake_neuronpedia import build_bucket, small_pages

    objects = build_bucket(small_pages(range(0, 20), n_activations=3), producer="a")
    key = next(k for k in objects if "/activations/" in k)
    path = tmp_path / "activations-batch-0.jsonl.gz"
    path.write_bytes(objects[key])
    n_rows = len(gzip.decompress(objects[key]).splitlines())
    settings = Settings(warehouse=tmp_path / "wh.duckdb", max_input_bytes=len(objects[key]) // 2)
    summary = run_ingest([path], settings)
    assert (summary.n_loaded, summary.n_rejected, summary.n_activations) == (1, 0, n_rows)
    bomb = Settings(warehouse=tmp_path / "wh2.duckdb", max_input_bytes=100, max_decompressed_bytes=1000)
    refused = run_ingest([path], bomb)
    assert refused.n_rejected == 1 and "FEATUREHOUSE_MAX_DECOMPRESSED_BYTES" in refused.rejected[0]["reason"]


@pytest.mark.parametrize("bytes_per_thread, threads", [(None, "one"), (1, "every core"), (0, "every core")])
def test_duckdb_gets_one_thread_per_bytes_per_thread_of_the_batch(tmp_path, monkeypatch, bytes_per_thread, threads):
    """A one-page batch runs on one DuckDB thread by default (worker threads only spin on its
    small statements); FEATUREHOUSE_BYTES_PER_THREAD small enough, or 0, gives it every core."""
    import duckdb

    from pipeline.config import Settings
    from pipeline.stages import materialise

    seen = []
    refresh = materialise.refresh_changed

    def spy(conn, **kw):  # runs inside the batch's load, on the ingest's connection
        seen.append(conn.execute("SELECT current_setting('threads')").fetchone()[0])
        return refresh(conn, **kw)

    monkeypatch.setattr(materialise, "refresh_changed", spy)
    if bytes_per_thread is not None:
        monkeypatch.setenv("FEATUREHOUSE_BYTES_PER_THREAD", str(bytes_per_thread))
    summary = run_ingest([SEED_FLIGHT], Settings.from_env(warehouse=tmp_path / "wh"))
    assert summary.n_loaded == 1
    cores = duckdb.connect().execute("SELECT current_setting('threads')").fetchone()[0]
    assert seen == [1 if threads == "one" else cores]


@pytest.mark.parametrize("where", ["stage", "validate"])
def test_a_run_failing_while_staging_is_recorded_as_failed_on_the_lake(tmp_path, monkeypatch, where):
    """Staging and validation run with the in-memory database as the default (their temp-table
    statements then skip DuckLake's transaction); a failure there gives the lake back, so the
    run's row (an unqualified ``runs``) is still marked failed with the error that stopped it."""
    import importlib

    from pipeline.config import Settings
    from pipeline.stages import stage, validate

    ingest_module = importlib.import_module("pipeline.ingest")
    target, name = (stage, "create_views") if where == "stage" else (validate, "validate_batch")

    def broken(*a, **kw):
        raise RuntimeError(f"injected failure in {where}")

    monkeypatch.setattr(target, name, broken)
    settings = Settings(warehouse=tmp_path / "wh")
    with pytest.raises(RuntimeError, match="injected") as info:
        ingest_module.ingest([SEED_FLIGHT], settings, progress=False, report_after=False, run_id="broken-run")
    assert any("is recorded as failed" in n for n in getattr(info.value, "__notes__", [])), info.value.__notes__
    [(status, error)] = query(settings.warehouse, "SELECT status, error FROM runs WHERE run_id = 'broken-run'")
    assert status == "failed" and f"injected failure in {where}" in error


def test_scratch_first_gives_the_lake_back_and_keeps_the_first_error(tmp_path):
    import duckdb

    from pipeline.config import Settings
    from pipeline.lake import warehouse

    settings = Settings(warehouse=tmp_path / "wh")
    with warehouse.connect(settings, create=True) as conn:
        with warehouse.scratch_first(conn):
            assert conn.execute("SELECT current_database()").fetchone() == ("memory",)
        assert conn.execute("SELECT current_database()").fetchone() == ("featurehouse",)
        with pytest.raises(ZeroDivisionError), warehouse.scratch_first(conn):
            raise ZeroDivisionError
        assert conn.execute("SELECT current_database()").fetchone() == ("featurehouse",)
        with pytest.raises(ValueError, match="first") as info, warehouse.scratch_first(conn):
            conn.execute("DETACH featurehouse")  # the lake is gone: the restore itself fails
            raise ValueError("first")
        assert any("could not be made the default database again" in n for n in info.value.__notes__)
        assert not isinstance(info.value, duckdb.Error)
