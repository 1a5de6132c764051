"""A feature page is a snapshot of its feature: a newer capture replaces its rows, an older one
does not, and rivals in one batch resolve to the newest (issue: re-fetched features kept stale rows).

Capture times are set with the files' modification times, which is what `ingest` reads for
files (fetched bodies carry their fetch time).
"""

from __future__ import annotations

import copy
import gzip
import os
from datetime import datetime, timedelta

import orjson
import pytest

from pipeline.config import Settings
from tests.conftest import good_page, query, run_ingest, write
from tests.formats import to_api_json, to_flight

KEY = ("gpt-oss-20b", "11-resid-post-aa", 7)
T0 = datetime(2026, 1, 1, 12, 0, 0)  # captures are in the past: a future time counts as now


def _at(path, when: datetime):
    ts = (when - datetime(1970, 1, 1)).total_seconds()
    os.utime(path, (ts, ts))
    return path


def page_v(version: int, index: int = 7) -> dict:
    """Capture ``version`` of one feature: new activation ids, a different explanation and size."""
    page = good_page(index)
    for a in page["activations"]:
        a["id"] = f"{a['id']}-v{version}"
    if version > 1:
        page["activations"] = page["activations"][:2]  # the newer capture has fewer excerpts
        page["activations"][0]["values"] = [0.0, 9.5, 3.25, 0.0]
        page["activations"][0]["maxValue"], page["activations"][0]["maxValueTokenIndex"] = 9.5, 1
        page["maxActApprox"] = 9.5
    page["explanations"] = [{"id": f"exp-{index}-v{version}", "description": f"capture {version}",
                             "explanationModelName": "m", "typeName": "t", "scores": []}]
    return page


def _state(settings: Settings, index: int = 7):
    where = f"model_id = '{KEY[0]}' AND source_id = '{KEY[1]}' AND feature_index = {index}"
    return {
        "activations": sorted(r[0] for r in query(settings.warehouse, f"SELECT activation_id FROM activations WHERE {where}")),
        "explanations": sorted(r[0] for r in query(settings.warehouse, f"SELECT description FROM explanations WHERE {where}")),
        "max_act_approx": query(settings.warehouse, f"SELECT max_act_approx FROM features WHERE {where}"),
        "n_examples": query(settings.warehouse,
                            f"SELECT sum(n_examples) FROM feature_activation_stats WHERE {where}")[0][0],
        "max_activation": query(settings.warehouse,
                                f"SELECT max(max_activation) FROM feature_activation_stats WHERE {where}")[0][0],
    }


V1 = {"activations": ["act-gpt-oss-20b-11-resid-post-aa-7-0-v1", "act-gpt-oss-20b-11-resid-post-aa-7-1-v1",
                      "act-gpt-oss-20b-11-resid-post-aa-7-2-v1"],
      "explanations": ["capture 1"], "max_act_approx": [(3.25,)], "n_examples": 3, "max_activation": 3.25}
V2 = {"activations": ["act-gpt-oss-20b-11-resid-post-aa-7-0-v2", "act-gpt-oss-20b-11-resid-post-aa-7-1-v2"],
      "explanations": ["capture 2"], "max_act_approx": [(9.5,)], "n_examples": 2, "max_activation": 9.5}


def test_a_newer_capture_replaces_the_feature_in_any_shape(tmp_path, settings):
    old = _at(write(tmp_path / "in" / "v1.txt", to_flight(page_v(1))), T0)
    run_ingest([old], settings)
    assert _state(settings) == V1
    new = _at(write(tmp_path / "in2" / "v2.json", to_api_json(page_v(2))), T0 + timedelta(days=1))
    s = run_ingest([new], settings)
    assert _state(settings) == V2, "rows missing from the new capture must be gone"
    assert (s.n_features, s.n_activations, s.n_explanations, s.n_superseded) == (1, 2, 1, 0)
    assert query(settings.warehouse, "SELECT count(*) FROM activations")[0][0] == 2
    captures = query(settings.warehouse,
                     "SELECT table_name, captured_at FROM feature_captures ORDER BY table_name")
    assert captures == [(t, T0 + timedelta(days=1)) for t in ("activations", "explanations", "features")]
    assert {r[0] for r in query(settings.warehouse, "SELECT DISTINCT captured_at FROM activations")} == {T0 + timedelta(days=1)}


def test_an_older_capture_does_not_replace_a_newer_one(tmp_path, settings):
    new = _at(write(tmp_path / "a" / "v2.json", to_api_json(page_v(2))), T0 + timedelta(days=1))
    old = _at(write(tmp_path / "b" / "v1.json", to_api_json(page_v(1))), T0)
    run_ingest([new], settings)
    s = run_ingest([old], settings)
    assert _state(settings) == V2
    assert (s.n_features, s.n_activations, s.n_superseded) == (0, 0, 3)
    rows = query(settings.warehouse, "SELECT table_name, captured_at, kept_captured_at, reason FROM superseded ORDER BY 1")
    assert rows == [(t, T0, T0 + timedelta(days=1), "older than the capture already loaded")
                    for t in ("activations", "explanations", "features")]


def test_reprocessing_an_old_capture_after_a_newer_one_keeps_the_newer(tmp_path, settings):
    old = _at(write(tmp_path / "in" / "v1.json", to_api_json(page_v(1))), T0)
    new = _at(write(tmp_path / "in" / "v2.json", to_api_json(page_v(2))), T0 + timedelta(days=1))
    run_ingest([old], settings)
    run_ingest([new], settings)
    run_ingest([old, new], settings, reprocess=True)
    assert _state(settings) == V2
    run_ingest([old], settings, reprocess=True)
    assert _state(settings) == V2


def test_two_captures_in_one_batch_the_newer_wins_and_nothing_of_the_other_loads(tmp_path, settings):
    old = _at(write(tmp_path / "in" / "b-v1.json", to_api_json(page_v(1))), T0)
    new = _at(write(tmp_path / "in" / "a-v2.txt", to_flight(page_v(2))), T0 + timedelta(hours=1))
    s = run_ingest([new, old], settings)
    assert _state(settings) == V2
    assert s.n_quarantined == 0, "rival captures are not refused as duplicates"
    assert (s.n_features, s.n_activations, s.n_explanations, s.n_superseded) == (1, 2, 1, 3)
    assert query(settings.warehouse, "SELECT DISTINCT reason FROM superseded") == [
        ("a newer capture of this feature came in the same batch",)]
    # both inputs loaded (were parsed); the older one's rows are all superseded
    assert query(settings.warehouse, "SELECT count(*) FROM raw_inputs WHERE status = 'loaded'")[0][0] == 2


def test_an_export_batch_replaces_only_its_own_table(tmp_path, settings):
    run_ingest([_at(write(tmp_path / "in" / "v1.json", to_api_json(page_v(1))), T0)], settings)
    rows = []
    for a in page_v(2)["activations"]:
        row = {k: v for k, v in a.items() if k != "createdAt"}
        rows.append(orjson.dumps(row))
    export = _at(write(tmp_path / "ex" / "batch-0.jsonl.gz", gzip.compress(b"\n".join(rows) + b"\n")),
                 T0 + timedelta(days=1))
    s = run_ingest([export], settings)
    state = _state(settings)
    assert state["activations"] == V2["activations"] and state["n_examples"] == 2 and state["max_activation"] == 9.5
    assert state["explanations"] == V1["explanations"] and state["max_act_approx"] == V1["max_act_approx"]
    assert (s.n_features, s.n_activations, s.n_explanations) == (0, 2, 0)
    assert dict(query(settings.warehouse, "SELECT table_name, captured_at FROM feature_captures")) == {
        "features": T0, "explanations": T0, "activations": T0 + timedelta(days=1)}


def test_an_activation_id_that_moves_to_another_feature_leaves_no_stale_stats(tmp_path, settings):
    one, two = good_page(1), good_page(2)
    run_ingest([_at(write(tmp_path / "a" / "1.json", to_api_json(one)), T0),
                _at(write(tmp_path / "a" / "2.json", to_api_json(two)), T0)], settings)
    moved = copy.deepcopy(two)
    taken = one["activations"][0]
    moved["activations"].append({**taken, "modelId": KEY[0], "layer": KEY[1], "index": "2"})
    run_ingest([_at(write(tmp_path / "b" / "2.json", to_api_json(moved)), T0 + timedelta(days=1))], settings)
    owners = query(settings.warehouse, "SELECT feature_index FROM activations WHERE activation_id = ?", [taken["id"]])
    assert owners == [(2,)], "an activation id belongs to one feature"
    stats = dict(query(settings.warehouse, "SELECT feature_index, sum(n_examples) FROM feature_activation_stats GROUP BY 1"))
    assert stats == {1: 2, 2: 4}
    total = query(settings.warehouse, "SELECT sum(n_examples) FROM source_activation_stats")[0][0]
    assert total == query(settings.warehouse, "SELECT count(*) FROM activations")[0][0] == 6


@pytest.mark.parametrize("shape", ["api_json", "flight"])
def test_a_capture_without_explanations_removes_the_old_ones(tmp_path, settings, shape):
    enc = to_api_json if shape == "api_json" else to_flight
    run_ingest([_at(write(tmp_path / "a" / "v1", enc(page_v(1))), T0)], settings)
    bare = page_v(2)
    bare["explanations"] = []
    run_ingest([_at(write(tmp_path / "b" / "v2", enc(bare)), T0 + timedelta(days=1))], settings)
    assert _state(settings)["explanations"] == []
