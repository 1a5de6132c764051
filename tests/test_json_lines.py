"""JSON lines of whole feature pages: a file of pages, one per line (plain or gzip), loads every
record of every page, not the features alone as if they were export rows; a file that mixes pages
and export rows is refused with the reason, compressed or not; and gzip's quirks (a page key
across two read chunks, zero padding after the last member) neither hide a page nor fail the run.

Found by a reviewer using the product from outside; each test failed before its fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from bench.generate import synthetic_page
from pipeline.config import Settings
from tests.conftest import query, run_ingest, write

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")


def fh(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))


def _table_counts(wh: Path) -> dict[str, int]:
    return {t: query(wh, f"SELECT count(*) FROM {t}")[0][0]
            for t in ("features", "activations", "explanations", "quarantine")}


@pytest.mark.heavy(65)
def test_json_lines_of_whole_pages_load_every_record_of_every_page(tmp_path):
    """A file of whole feature pages, one per line, was read as export rows: its features loaded
    and its activations and explanations were dropped without a word."""
    import gzip

    from bench.generate import write_pages

    pages = write_pages(3, tmp_path / "pages", start=40)
    lines = b"\n".join(p.read_bytes() for p in pages) + b"\n"
    write(tmp_path / "jl" / "three.jsonl", lines)
    write(tmp_path / "gz" / "three.jsonl.gz", gzip.compress(lines))
    assert run_ingest([tmp_path / "pages"], Settings(warehouse=tmp_path / "wh-pages")).status == "succeeded"
    for name in ("jl", "gz"):  # the reference above in-process, the two files as they were found: the CLI
        proc = fh("ingest", str(tmp_path / name), "--warehouse", str(tmp_path / f"wh-{name}"), "--no-progress")
        assert proc.returncode == 0, proc.stderr
    expected = _table_counts(tmp_path / "wh-pages")
    assert expected["activations"] > 0 and expected["explanations"] > 0 and expected["quarantine"] == 3
    assert _table_counts(tmp_path / "wh-jl") == expected
    assert _table_counts(tmp_path / "wh-gz") == expected
    cols = "model_id, source_id, feature_index, activation_id, tokens, \"values\""
    assert (query(tmp_path / "wh-jl", f"SELECT {cols} FROM activations ORDER BY activation_id")
            == query(tmp_path / "wh-pages", f"SELECT {cols} FROM activations ORDER BY activation_id"))


def test_json_lines_mixing_pages_and_export_rows_are_refused_with_the_reason(tmp_path):
    page = orjson.dumps(synthetic_page(7))
    row = orjson.dumps({"modelId": "m", "layer": "l", "index": "1", "tokens": ["a"], "values": [1.0]})
    write(tmp_path / "in" / "mixed.jsonl", page + b"\n" + row + b"\n")
    proc = fh("ingest", str(tmp_path / "in"), "--warehouse", str(tmp_path / "wh"), "--no-progress",
              "--format", "json")
    summary = orjson.loads(proc.stdout)
    assert summary["n_loaded"] == 0 and summary["n_rejected"] == 1
    reason = summary["rejected"][0]["reason"]
    assert "line 2 of the JSON lines is an export row but line 1 is a whole feature page" in reason
    assert query(tmp_path / "wh", "SELECT count(*) FROM raw_inputs WHERE status = 'rejected'") == [(1,)]


# --- gzip JSON lines (found in review 2) ----------------------------------------------------------

def test_gzip_json_lines_mixing_an_export_row_and_a_page_are_refused_like_uncompressed(tmp_path, settings):
    """Uncompressed, such a file is refused; gzip-compressed it took the export road, the page
    loaded as a bare feature row and its activations and explanations were dropped."""
    import gzip

    page = synthetic_page(71, valid=True)
    row = {"modelId": page["modelId"], "layer": page["layer"], "index": "70", "maxActApprox": 3.0}
    body = orjson.dumps(row) + b"\n" + orjson.dumps(page) + b"\n"
    write(tmp_path / "in" / "mixed.jsonl.gz", gzip.compress(body))
    summary = run_ingest([tmp_path / "in"], settings)
    assert summary.n_rejected == 1, "a gzip file mixing export rows and pages must be refused"
    assert "line 2 holds a whole feature page" in summary.rejected[0]["reason"]
    assert query(settings, "SELECT count(*) FROM features") == [(0,)]


def test_a_page_key_straddling_two_read_chunks_is_found_on_its_line(tmp_path):
    import gzip

    from pipeline.stages.parse import PAGE_KEY_BYTES, Rejected, gunzip_measure

    row = b'{"modelId":"m","layer":"l","index":"1","maxActApprox":1.0}\n'
    first = row * ((1 << 20) // len(row) - 1)
    head, tail = b'{"modelId":"m","layer":"l","index":"2","x":"', b'"}\n'
    pad = head + b"y" * ((1 << 20) - 5 - len(first) - len(head) - len(tail)) + tail
    body = first + pad + b'{"activations":[]}\n'
    assert body.index(b'"activations":') == (1 << 20) - 4  # the key straddles the first 1 MiB read
    (tmp_path / "f.jsonl.gz").write_bytes(gzip.compress(body))
    n_first = first.count(b"\n")
    try:
        gunzip_measure(tmp_path / "f.jsonl.gz", 1 << 30, PAGE_KEY_BYTES)
    except Rejected as exc:
        assert f"line {n_first + 2} holds a whole feature page" in str(exc)
    else:
        raise AssertionError("the page line was not found")
    (tmp_path / "ok.jsonl.gz").write_bytes(gzip.compress(first + pad))
    assert gunzip_measure(tmp_path / "ok.jsonl.gz", 1 << 30, PAGE_KEY_BYTES) == (len(first + pad), n_first + 1)


@pytest.mark.parametrize("copy", ["while-landing", "past-the-copy-limit", "no-room-for-a-copy"])
def test_gzip_export_batch_with_trailing_zero_padding_does_not_fail_the_run(tmp_path, settings, monkeypatch, copy):
    """gzip accepts zero padding after the last member; DuckDB's reader raised IOException
    "Input is not a GZIP stream", uncaught: the run failed, and every re-run failed the same way.
    It loads, as gzip reads it, from its expanded bytes (``spool.py``): those kept aside while it
    landed, or (a file past the copy's limit, which DuckDB's gzip reader refused) copied then;
    only where no copy can be made at all is it refused, saying why (an outside review found it
    loaded or refused by its size)."""
    import gzip

    from pipeline.stages import spool
    from tests.conftest import good_page

    if copy != "while-landing":
        monkeypatch.setattr(spool, "SPOOL_MAX_BYTES", 0)
    if copy == "no-room-for-a-copy":
        monkeypatch.setattr(spool, "SPOOL_DISK_RESERVE", 1 << 62)
    kept_aside = copy != "no-room-for-a-copy"
    rows = b"".join(orjson.dumps(a) + b"\n" for a in good_page(5)["activations"])
    write(tmp_path / "in" / "padded.jsonl.gz", gzip.compress(rows) + b"\x00" * 16)
    write(tmp_path / "in" / "page.json", orjson.dumps(good_page(6)))
    summary = run_ingest([tmp_path / "in"], settings)
    assert query(settings, "SELECT count(*) FROM features WHERE feature_index = 6") == [(1,)]
    if kept_aside:
        assert summary.status == "succeeded" and summary.n_loaded == 2 and summary.n_rejected == 0
        assert query(settings, "SELECT count(*) FROM activations WHERE feature_index = 5") == [(3,)]
    else:
        assert summary.status == "succeeded" and summary.n_loaded == 1 and summary.n_rejected == 1
        assert "zero padding" in summary.rejected[0]["reason"]
