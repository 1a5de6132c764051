"""Bulk-export batches (`*.jsonl.gz`) are read by DuckDB as a stream: same rows as the Python
parser gives, a bad row quarantined rather than the whole batch refused, and memory that does
not grow with the size of the batch."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.conftest import query, run_ingest
from tests.fake_neuronpedia import build_bucket, small_pages

TABLES = {
    "features": "model_id, source_id, feature_index",
    "activations": "activation_id",
    "explanations": "explanation_id",
    "feature_activation_stats": "model_id, source_id, feature_index, data_source",
}
SKIP = {"input_sha256", "run_id", "loaded_at", "refreshed_at", "captured_at"}


def _write_bucket(objects: dict[str, bytes], folder: Path, *, plain: bool) -> None:
    """The bucket's files as landed by `fetch exports` (gzip), or decompressed to plain JSON lines
    (several lines, not gzip: the Python parser's road)."""
    folder.mkdir(parents=True)
    for key, body in objects.items():
        name = key.replace("/", "__")
        if plain and key.endswith(".gz"):
            (folder / name.removesuffix(".gz")).write_bytes(gzip.decompress(body))
        else:
            (folder / name).write_bytes(body)


def _rows(wh: Path, table: str) -> list[tuple]:
    cols = [c for (c,) in query(wh, f"SELECT column_name FROM (DESCRIBE {table})") if c not in SKIP]
    rows = query(wh, f"SELECT {', '.join(chr(34) + c + chr(34) for c in cols)} FROM {table} ORDER BY {TABLES[table]}")
    # Averages may differ in the last bit with the order DuckDB sums in.
    return [tuple(round(v, 9) if isinstance(v, float) else v for v in r) for r in rows]


@pytest.mark.parametrize("producer", ["a", "b"])
def test_gzip_exports_and_plain_lines_give_identical_rows(tmp_path, producer):
    from pipeline.config import Settings

    objects = build_bucket(small_pages(range(0, 40), n_activations=4), producer=producer, batch_features=16)
    _write_bucket(objects, tmp_path / "gz", plain=False)
    _write_bucket(objects, tmp_path / "plain", plain=True)
    gz = Settings(warehouse=tmp_path / "gz.duckdb")
    plain = Settings(warehouse=tmp_path / "plain.duckdb")
    s_gz = run_ingest([tmp_path / "gz"], gz)
    s_plain = run_ingest([tmp_path / "plain"], plain)
    assert s_gz.n_rejected == s_plain.n_rejected == 0
    assert s_gz.n_activations == s_plain.n_activations == 160
    assert s_gz.n_features == 40 and s_gz.n_explanations == 40
    formats = dict(query(gz.warehouse, "SELECT format, count(*) FROM raw_inputs GROUP BY 1"))
    assert formats["gzip+export_jsonl"] == len([k for k in objects if k.endswith(".gz")])
    for table in TABLES:
        assert _rows(gz.warehouse, table) == _rows(plain.warehouse, table), table


def test_a_bad_row_in_an_export_is_quarantined_not_the_whole_batch(tmp_path):
    from pipeline.config import Settings

    objects = build_bucket(small_pages(range(0, 10), n_activations=3), producer="a")
    key = next(k for k in objects if "/activations/" in k)
    rows = [orjson.loads(line) for line in gzip.decompress(objects[key]).splitlines()]
    bad_id = rows[4]["id"]
    rows[4]["index"] = "five"
    objects[key] = gzip.compress(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    _write_bucket(objects, tmp_path / "in", plain=False)
    settings = Settings(warehouse=tmp_path / "wh.duckdb")
    summary = run_ingest([tmp_path / "in"], settings)
    assert summary.n_rejected == 0
    assert summary.n_activations == len(rows) - 1
    checks = query(settings.warehouse, "SELECT record_key, check_name, record_json->>'index' FROM quarantine ORDER BY 2")
    assert {c[0] for c in checks} == {bad_id} and {c[2] for c in checks} == {"five"}
    assert "activation_feature_key_present" in {c[1] for c in checks}


def _big_export(path: Path, n_rows: int) -> int:
    """An activations batch of ``n_rows`` excerpts of 1,024 tokens, streamed to gzip."""
    template = small_pages([7], n_activations=1, n_tokens=24)[0]["activations"][0]
    tokens = [f" tok{i % 97}" for i in range(1024)]
    values = [0.0] * 1024
    written = 0
    with gzip.open(path, "wb", compresslevel=1) as out:
        for i in range(n_rows):
            values[i % 1024] = 5.0 + i % 13
            row = dict(template, id=f"big{i:08d}", index=str(i // 100), tokens=tokens, values=values,
                       maxValue=max(values), maxValueTokenIndex=values.index(max(values)), minValue=0.0)
            line = orjson.dumps(row) + b"\n"
            out.write(line)
            written += len(line)
            values[i % 1024] = 0.0
    return written


@pytest.mark.slow
def test_an_export_batch_larger_than_memory_headroom_streams(tmp_path):
    """A ~600 MB activations batch loads with a bounded footprint. The Python parser holds the
    text and its objects (measured: 9.7 GB for this batch); DuckDB streams it, spilling past its
    1 GB cap (measured: ~1.9 GB for this batch and ~2.0 GB for one twice as large)."""
    src = tmp_path / "in" / "activations__batch-0.jsonl.gz"
    src.parent.mkdir()
    decompressed = _big_export(src, 45_000)
    assert decompressed > 500 * 2**20
    wh = tmp_path / "wh.duckdb"
    script = (
        "import os, resource, sys\n"
        "from pipeline import ingest, Settings\n"
        "s = ingest([sys.argv[1]], Settings.from_env(warehouse=sys.argv[2]), progress=False, report_after=False)\n"
        "print(s.n_activations, s.n_rejected, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)\n"
    )
    env = dict(os.environ, FEATUREHOUSE_MAX_DECOMPRESSED_BYTES=str(4 * 2**30))
    out = subprocess.run([sys.executable, "-c", script, str(src.parent), str(wh)], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    n_activations, n_rejected, peak_mib = map(int, out[-3:])
    assert (n_activations, n_rejected) == (45_000, 0)
    assert peak_mib < 2600, f"peak RSS {peak_mib} MiB for a {decompressed / 2**20:.0f} MiB batch"
    assert query(wh, "SELECT count(*), sum(len(tokens)) FROM activations") == [(45_000, 45_000 * 1024)]


def test_an_export_duckdb_cannot_read_is_refused_with_the_python_parsers_reason(tmp_path):
    from pipeline.config import Settings

    objects = build_bucket(small_pages(range(0, 6), n_activations=2), producer="a")
    key = next(k for k in objects if "/activations/" in k)
    lines = gzip.decompress(objects[key]).splitlines()
    lines[3] = lines[3][: len(lines[3]) // 2]  # a line cut in half
    objects[key] = gzip.compress(b"\n".join(lines) + b"\n")
    _write_bucket(objects, tmp_path / "in", plain=False)
    settings = Settings(warehouse=tmp_path / "wh.duckdb")
    summary = run_ingest([tmp_path / "in"], settings)
    assert summary.n_rejected == 1 and summary.n_features == 6
    [(reason,)] = query(settings.warehouse, "SELECT reason FROM raw_inputs WHERE status = 'rejected'")
    assert "line 4" in reason and ("truncated" in reason or "not valid JSON" in reason)
