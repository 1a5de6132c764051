"""Bulk exports from an S3-style bucket on 127.0.0.1: paginated listing, verified streaming
downloads, both producers' column sets, and the same rows as the feature API."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest
import requests
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cli import cli
from pipeline.sources.exports import IncompleteTransfer, ListObjectsV2, stream_to_landing
from pipeline.sources.fetch import (
    fetch_exports,
    fetch_features,
    ingest_fetched,
    manifest_path,
    read_manifest,
)
from tests.conftest import open_warehouse
from tests.fake_neuronpedia import FakeNeuronpedia
from tests.fetch_support import FAST, MODEL, SOURCE, pages, query, scalar, settings_in

PREFIX = f"v1/{MODEL}/{SOURCE}/"


def test_listing_is_paginated_and_every_file_is_verified_and_landed(tmp_path):
    s = settings_in(tmp_path)
    faults = {  # one of each fault a download can meet, each once
        f"/neuronpedia-datasets/{PREFIX}activations/batch-1.jsonl.gz": ["truncate"],
        f"/neuronpedia-datasets/{PREFIX}features/batch-0.jsonl.gz": ["drop"],
        f"/neuronpedia-datasets/{PREFIX}explanations/batch-2.jsonl.gz": ["503"],
        f"/neuronpedia-datasets/{PREFIX}model.jsonl": ["reset"],
        f"/neuronpedia-datasets/{PREFIX}source.jsonl": ["slow"],
        "/neuronpedia-datasets/": ["500"],  # the listing itself
    }
    with FakeNeuronpedia(pages=pages(12), batch_features=4, max_keys=5, faults=faults, slow_seconds=1.0) as np:
        assert len(np.objects) == 12  # 3 batches x 3 kinds + model/source/sourceset
        result = fetch_exports(MODEL, SOURCE, settings=s, exports_url=np.exports_url, window="e", **FAST)
        listing = np.seen("/neuronpedia-datasets/")
        assert len(listing) == 1 + 3  # a 500, then 12 keys at 5 a page
        assert listing[2].query["continuation-token"] and listing[1].query["list-type"] == ["2"]
        for path, kinds in faults.items():
            if path != "/neuronpedia-datasets/":
                assert np.count(path) == len(kinds) + 1, path
        assert all(r.headers.get("x-api-key") is None for r in np.requests)
        objects = dict(np.objects)

    assert (result.n_requested, result.n_landed, result.n_failed) == (12, 12, 0)
    for e in read_manifest(manifest_path("e", s)).values():  # landed byte for byte
        key = e["url"].split("/neuronpedia-datasets/", 1)[1]
        assert open(e["landed_path"], "rb").read() == objects[key]

    summary = ingest_fetched("e", s)
    assert summary.n_loaded == 12 and summary.n_rejected == 0
    assert scalar(s, "SELECT count(*) FROM features") == 12
    assert scalar(s, "SELECT count(*) FROM activations") == sum(len(p["activations"]) for p in pages(12))
    assert [scalar(s, f"SELECT count(*) FROM {t}") for t in ("models", "sources", "source_sets")] == [1, 1, 1]


def _text_order(n: int) -> list[int]:
    """Feature indices 0..n-1 as Neuronpedia's export pages them: ORDER BY index, a text column."""
    return [int(i) for i in sorted(str(i) for i in range(n))]


def _indices(s, table: str) -> list[int]:
    return [r[0] for r in query(s, f"SELECT DISTINCT feature_index FROM {table} ORDER BY 1")]


def test_batches_select_batch_files_by_number_in_each_table(tmp_path):
    """--batches 1:2 takes batch 1 of each table: features and explanations batches hold indices
    in text order ("16", ..., "19", "2", "20", ...), activations batch 1 holds 8..15."""
    s = settings_in(tmp_path)
    with FakeNeuronpedia(pages=pages(24), batch_features=8) as np:
        out = CliRunner().invoke(cli, [
            "fetch", "exports", "--model", MODEL, "--source", SOURCE, "--batches", "1:2",
            "--exports-url", np.exports_url, "--warehouse", str(s.warehouse), "--no-progress",
        ])
        fetched = sorted(r.path.rsplit("/", 2)[-2] + "/" + r.path.rsplit("/", 1)[-1]
                         for r in np.requests if r.path.endswith(".gz"))
    assert out.exit_code == 0, out.output
    assert fetched == ["activations/batch-1.jsonl.gz", "explanations/batch-1.jsonl.gz", "features/batch-1.jsonl.gz"]
    in_text_batch_1 = sorted(_text_order(24)[8:16])
    assert in_text_batch_1 == [2, 16, 17, 18, 19, 20, 21, 22]
    assert _indices(s, "features") == in_text_batch_1
    assert _indices(s, "explanations") == in_text_batch_1
    assert _indices(s, "activations") == list(range(8, 16))


def test_the_whole_source_gives_every_row(tmp_path):
    s = settings_in(tmp_path)
    with FakeNeuronpedia(pages=pages(24), batch_features=8) as np:
        keys = sorted(k.rsplit("/", 2)[-2] + "/" + k.rsplit("/", 1)[-1] for k in np.objects if k.endswith(".gz"))
        result = fetch_exports(MODEL, SOURCE, settings=s, exports_url=np.exports_url, window="all", **FAST)
    assert keys == [f"{t}/batch-{n}.jsonl.gz" for t in ("activations", "explanations", "features") for n in range(3)]
    assert (result.n_landed, result.n_failed) == (12, 0)
    summary = ingest_fetched("all", s, run_id="r-all", progress=False)
    assert summary.n_rejected == 0 and summary.n_quarantined == 0
    for table in ("features", "explanations", "activations"):
        assert _indices(s, table) == list(range(24)), table
    assert scalar(s, "SELECT count(*) FROM activations") == sum(len(p["activations"]) for p in pages(24))
    assert scalar(s, "SELECT count(DISTINCT feature_index) FROM feature_activation_stats") == 24


def test_export_that_never_arrives_whole_is_reported_not_landed(tmp_path):
    s = settings_in(tmp_path)
    bad = f"/neuronpedia-datasets/{PREFIX}activations/batch-0.jsonl.gz"
    with FakeNeuronpedia(pages=pages(8), batch_features=4, always={bad: "corrupt"}) as np:
        result = fetch_exports(MODEL, SOURCE, settings=s, exports_url=np.exports_url, window="e",
                               max_attempts=3, **FAST)
        assert np.count(bad) == 3
    assert result.n_failed == 1 and result.n_landed == 8
    assert "gzip data is corrupt" in result.failures[0]["last_error"]  # length was right, CRC not
    assert not [p for p in s.landing_dir.rglob("*") if p.name.startswith(".landing-")]  # no partial file left
    ingest_fetched("e", s, run_id="r")
    assert query(s, "SELECT feature_key, status, attempts FROM fetch_failures") == [
        (f"{PREFIX}activations/batch-0.jsonl.gz", "failed", 3)]
    assert scalar(s, "SELECT count(*) FROM activations WHERE feature_index < 4") == 0
    assert scalar(s, "SELECT count(*) FROM activations WHERE feature_index >= 4") > 0


# Exports carry no explanation scores; producer "a" also lacks the activations' createdAt,
# lossValues, dataIndex, logitContributions and qualifyingTokenIndex.
_NOT_EXPORTED = {
    "a": {"activations": ["created_at", "loss_values", "data_index", "logit_contributions",
                          "qualifying_token_index"], "explanations": ["scores"], "features": []},
    "b": {"activations": [], "explanations": ["scores"], "features": []},
}
_KEYS = {"features": "feature_index", "activations": "activation_id", "explanations": "explanation_id"}
# The keys of `extra` only one road's records carry: a page's relations without a table of
# their own (lists, creator, comments) are not in the features export, whose rows are pages
# without their relations; producer "b"'s activation rows carry fields of its own, which no
# API page has. The other road keeps them null (or leaves them out); every other key of
# extra is the same on both roads.
_ONE_ROAD_EXTRA = {
    "a": {"features": ("api", ("lists", "creator", "comments"))},
    "b": {"features": ("api", ("lists", "creator", "comments")),
          "activations": ("exports", ("zValues", "producer_note"))},
}


def _drop_extra_keys(rows: list[tuple], at: int, keys: tuple[str, ...]) -> list[tuple]:
    out = []
    for r in rows:
        extra = json.loads(r[at]) if r[at] is not None else None
        if extra is not None:
            extra = {k: v for k, v in extra.items() if k not in keys}
        out.append((*r[:at], extra, *r[at + 1:]))
    return out


@pytest.mark.parametrize("producer", ["a", "b"])
def test_api_and_exports_give_identical_rows(tmp_path, producer):
    via_api, via_exports = settings_in(tmp_path / "api"), settings_in(tmp_path / "exports")
    with FakeNeuronpedia(pages=pages(10), batch_features=4, producer=producer) as np:
        fetch_features(MODEL, SOURCE, range(10), settings=via_api, base_url=np.base_url, window="w", **FAST)
        fetch_exports(MODEL, SOURCE, settings=via_exports, exports_url=np.exports_url, window="w", **FAST)
    ingest_fetched("w", via_api)
    ingest_fetched("w", via_exports)
    # one connection a warehouse for every read below (~0.3 CPU-s an opening; one a read was ~15 a test)
    with open_warehouse(via_api.warehouse) as api_conn, open_warehouse(via_exports.warehouse) as exports_conn:
        def read(settings, sql):  # tests.fetch_support.query, through the open connections
            return (api_conn if settings is via_api else exports_conn).execute(sql).fetchall()

        for table, key in _KEYS.items():
            skip = ["input_sha256", "run_id", "loaded_at", "captured_at", *_NOT_EXPORTED[producer][table]]
            sql = f"SELECT * EXCLUDE ({', '.join(skip)}) FROM {table} ORDER BY {key}"
            api_rows, export_rows = read(via_api, sql), read(via_exports, sql)
            assert len(api_rows) == len(export_rows) > 0
            if table in _ONE_ROAD_EXTRA[producer]:
                road, keys = _ONE_ROAD_EXTRA[producer][table]
                carried, other = (api_rows, export_rows) if road == "api" else (export_rows, api_rows)
                at = [c for c, *_ in read(via_api, f"DESCRIBE {sql}")].index("extra")
                assert all(json.loads(r[at]).get(k) is None for r in other for k in keys)
                assert all(k in json.loads(r[at]) for r in carried for k in keys)
                api_rows, export_rows = _drop_extra_keys(api_rows, at, keys), _drop_extra_keys(export_rows, at, keys)
            assert api_rows == export_rows, table
            for col in _NOT_EXPORTED[producer][table]:
                assert read(via_exports, f"SELECT count({col}) FROM {table}")[0][0] == 0


def _chunks(data: bytes, size: int = 100):
    for i in range(0, len(data), size):
        yield data[i:i + size]


@pytest.mark.parametrize("damage", ["cut", "cut_mid_second_member", "bad_crc", "short_of_length"])
def test_stream_to_landing_refuses_damaged_gzip(tmp_path, damage):
    whole = gzip.compress(b'{"a": 1}\n' * 500) + gzip.compress(b'{"b": 2}\n' * 500)
    data, expected = {
        "cut": (whole[: len(whole) // 3], None),
        "cut_mid_second_member": (whole[:-5], None),
        "bad_crc": (whole[:-8] + (zlib.crc32(b"x")).to_bytes(4, "little") + whole[-4:], None),
        "short_of_length": (whole[:-1], len(whole)),
    }[damage]
    with pytest.raises(IncompleteTransfer):
        stream_to_landing(_chunks(data), tmp_path, expected_size=expected, gzip=True)
    assert not list(tmp_path.rglob("*.*")) and not list((tmp_path).glob("sha256/*/*"))
    sha, path, n = stream_to_landing(_chunks(whole), tmp_path, expected_size=len(whole), gzip=True)
    assert path.read_bytes() == whole and n == len(whole)


@pytest.fixture(scope="module")
def bucket():
    with FakeNeuronpedia() as np:
        yield np


@settings(max_examples=25, deadline=None)
@given(keys=st.sets(st.text("ab/-.0", min_size=1, max_size=6), max_size=30), max_keys=st.integers(1, 7))
def test_list_objects_v2_pages_through_every_key_once(bucket, keys, max_keys):
    bucket.max_keys = max_keys
    bucket.objects = {f"v1/{k}": b"x" * len(k) for k in keys}
    bucket.requests.clear()
    listing = ListObjectsV2(bucket.exports_url, "v1/")
    got = [o for page in listing.pages(lambda url, params: requests.get(url, params=params, timeout=5).content)
           for o in page]
    assert [o.key for o in got] == sorted(f"v1/{k}" for k in keys)
    assert all(o.size == len(o.key) - 3 for o in got)
    assert bucket.count("/neuronpedia-datasets/") == max(1, -(-len(keys) // max_keys))


def _spool_files(settings) -> list:
    return sorted(settings.landing_root.rglob(".landing-*")) if settings.landing_root.exists() else []


def test_sigterm_during_a_download_removes_its_partial_file_and_says_how_to_resume(tmp_path):
    """Issue 40 item 5: a SIGTERM left `.landing-*` spool files for good and said nothing."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    s = settings_in(tmp_path)
    slow = f"/neuronpedia-datasets/{PREFIX}activations/batch-0.jsonl.gz"
    with FakeNeuronpedia(pages=pages(12), batch_features=4, always={slow: "trickle"}, trickle_seconds=60) as np:
        args = [sys.executable, "-m", "pipeline.cli", "fetch", "exports", "--model", MODEL, "--source", SOURCE,
                "--exports-url", np.exports_url, "--warehouse", str(s.warehouse), "--window", "w-term",
                "--no-progress", "--requests-per-hour", "10000000"]
        proc = subprocess.Popen(args, cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (np.count(slow) and _spool_files(s)) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert _spool_files(s), "the download never started"
        time.sleep(0.5)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    assert time.monotonic() - stopped < 10, "the stopped fetch waited for the slow download"
    assert proc.returncode == 143, stdout + stderr
    assert "terminated by SIGTERM" in stderr and "partial download(s) removed" in stderr and "--window w-term" in stderr
    assert _spool_files(s) == []


def test_the_next_fetch_removes_what_a_killed_one_left(tmp_path):
    import os
    import time

    s = settings_in(tmp_path)
    s.landing_root.mkdir(parents=True, exist_ok=True)
    left = s.landing_root / ".landing-killed"
    left.write_bytes(b"half a gzip")
    old = time.time() - 2 * 3600
    os.utime(left, (old, old))
    fresh = s.landing_root / ".landing-live"  # a live download's: written a moment ago
    fresh.write_bytes(b"being written")
    with FakeNeuronpedia(pages=pages(4), batch_features=4) as np:
        result = fetch_exports(MODEL, SOURCE, settings=s, exports_url=np.exports_url, window="after", **FAST)
    assert result.n_failed == 0
    assert not left.exists() and fresh.exists()
