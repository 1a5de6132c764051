"""Bad inputs: each is landed untouched, recorded as rejected with a reason a person can act on,
and the run goes on (the good inputs around it load) and exits 0.

All cases go through one real ``featurehouse ingest`` run (a subprocess, as a user runs it);
a good page sorts before them and another after them. The gzip bomb is also ingested in this
process to measure that memory stays bounded.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import sys
import threading
import zlib
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from tests.conftest import SEED_FLIGHT, SEED_NOT_A_PAGE, good_page, query, run_ingest, write
from tests.formats import to_api_json, to_flight
from tests.test_flight import reference_bomb

FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")
BOMB_LIMIT = 16 * 1024 * 1024


def _write_gzip_bomb(path: Path, n_bytes: int) -> Path:
    """``n_bytes`` of zeros, gzip-compressed, written in 1 MiB steps (never held in memory)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    with path.open("wb") as out:
        for _ in range(n_bytes >> 20):
            out.write(comp.compress(zeros))
        out.write(comp.flush())
    return path


@pytest.fixture(scope="session")
def gzip_bomb(tmp_path_factory) -> Path:
    return _write_gzip_bomb(tmp_path_factory.mktemp("bomb") / "bomb.json.gz", 2 << 30)  # 2 GiB of zeros


def _nested(depth: int) -> bytes:
    return b'{"modelId":"m","layer":"s","index":"1","vector":' + b"[" * depth + b"]" * depth + b"}"


_PAGE = to_api_json(good_page(11))
_SEED = SEED_FLIGHT.read_bytes()

# name → (input bytes or a callable of the bomb path, key words the reason must contain)
CASES = {
    "seed_002_not_a_page": (SEED_NOT_A_PAGE.read_bytes(), ["not a Neuronpedia feature page"]),
    "empty": (b"", ["empty"]),
    "whitespace_only": (b" \n\t\n", ["empty"]),
    "truncated_json": (_PAGE[: len(_PAGE) // 2], ["truncated"]),
    "invalid_json": (b'{"modelId": "gpt-oss-20b", "layer": oops}', ["not valid JSON"]),
    "nested_5000_deep_arrays": (b"[" * 5000 + b"]" * 5000, ["nested", "deep"]),
    "nested_5000_deep_objects": (b'{"a":' * 5000 + b"1" + b"}" * 5000, ["nested", "deep"]),
    "page_with_a_field_nested_5000_deep": (_nested(5000), ["nested", "deep"]),
    "not_utf8_latin1": (_PAGE.replace(b"cpu things", "caf\u00e9".encode("latin-1")), ["UTF-8"]),
    "not_utf8_utf16": (_PAGE.decode().encode("utf-16"), ["UTF-8"]),
    "error_not_found": (b'{"error":"Not found"}', ["error", "Not found"]),
    "gzip_bomb": (None, ["gzip", "limit", "FEATUREHOUSE_MAX_DECOMPRESSED_BYTES"]),
    "truncated_gzip": (gzip.compress(_PAGE)[:-200], ["gzip", "truncated"]),
    "index_not_a_number": (_PAGE.replace(b'"index": "11"', b'"index": "eleven"', 1), ["index", "not a number"]),
    "index_a_list": (_PAGE.replace(b'"index": "11"', b'"index": [11]', 1), ["index", "not a number"]),
    "truncated_flight_capture": (_SEED[: len(_SEED) // 2], ["truncated"]),
    "flight_without_initial_neuron": (b'0:["$","div",null,{"children":"hello"}]\n', ["initialNeuron", "not a feature page"]),
    "html_without_flight": (b"<!DOCTYPE html><html><body>Neuronpedia</body></html>", ["HTML", "not a saved feature page"]),
    # 35 rows, each referring twice to the one before: 2 ** 35 values (4.3 GB, then SIGSEGV)
    "flight_reference_bomb": (reference_bomb(35), ["references expand", "limit", "reference bomb"]),
    "html_reference_bomb": (reference_bomb(35, html=True), ["references expand", "limit", "reference bomb"]),
}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, gzip_bomb):
    root = tmp_path_factory.mktemp("bad_inputs")
    inbox = root / "inbox"
    write(inbox / "00_good_first.json", to_api_json(good_page(1)))
    write(inbox / "zz_good_last.txt", to_flight(good_page(2)))
    inputs = {}
    for i, (name, (data, _)) in enumerate(CASES.items(), start=1):
        path = inbox / f"{i:02d}_{name}.bin"
        if data is None:
            os.link(gzip_bomb, path)
        else:
            write(path, data)
        inputs[name] = path
    assert len({hashlib.sha256(p.read_bytes()).digest() for p in inputs.values()}) == len(inputs)
    env = dict(os.environ, FEATUREHOUSE_MAX_DECOMPRESSED_BYTES=str(BOMB_LIMIT))
    wh = root / "wh"
    proc = subprocess.run([str(FEATUREHOUSE), "ingest", str(inbox), "--warehouse", str(wh), "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=300)
    return proc, wh, inputs


def test_run_completes_and_exits_0(cli_run):
    proc, wh, inputs = cli_run
    assert proc.returncode == 0, proc.stderr
    (status, n_rejected, n_received) = query(wh, "SELECT status, n_rejected, n_received FROM runs")[0]
    assert status == "succeeded" and n_received == len(CASES) + 2
    assert n_rejected == len(CASES) and f"rejected {n_rejected}" in proc.stdout


def test_good_inputs_before_and_after_still_load(cli_run):
    _, wh, _ = cli_run
    assert query(wh, "SELECT feature_index FROM features WHERE model_id = 'gpt-oss-20b' ORDER BY 1") == [(1,), (2,)]
    assert query(wh, "SELECT count(*) FROM activations WHERE model_id = 'gpt-oss-20b'") == [(6,)]


@pytest.mark.parametrize("name", CASES)
def test_each_bad_input_is_landed_and_rejected_with_a_reason(cli_run, name):
    _, wh, inputs = cli_run
    data = inputs[name].read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    rows = query(wh, "SELECT status, reason, landed_path, n_bytes FROM raw_inputs WHERE input_sha256 = ?", [sha])
    assert len(rows) == 1, f"{name} has no raw_inputs row"
    status, reason, landed_path, n_bytes = rows[0]
    assert status == "rejected"
    assert Path(landed_path).read_bytes() == data and n_bytes == len(data)
    for word in CASES[name][1]:
        assert word.lower() in reason.lower(), f"{name}: {word!r} not in reason {reason!r}"
    assert query(wh, "SELECT outcome FROM run_inputs WHERE input_sha256 = ?", [sha]) == [("rejected",)]


def test_gzip_bomb_does_not_exhaust_memory(tmp_path, settings, gzip_bomb):
    """2 GiB of zeros behind a 16 MiB limit: the process grows by tens of MiB, not gigabytes."""
    settings = replace(settings, max_decompressed_bytes=BOMB_LIMIT)
    # Warm up first (Great Expectations, DuckDB): the measurement is of the bomb, not of imports.
    run_ingest([write(tmp_path / "warm.json", to_api_json(good_page(1)))], settings)
    proc = psutil.Process()
    baseline = proc.memory_info().rss
    peak = baseline
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            done.wait(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        summary = run_ingest([gzip_bomb], settings)
    finally:
        done.set()
        sampler.join()
    print(f"RSS grew by {(peak - baseline) >> 20} MiB expanding the bomb")
    assert summary.n_rejected == 1 and summary.status == "succeeded"
    assert "FEATUREHOUSE_MAX_DECOMPRESSED_BYTES" in summary.rejected[0]["reason"]
    assert peak - baseline < 128 * 1024 * 1024, f"RSS grew by {(peak - baseline) >> 20} MiB"
