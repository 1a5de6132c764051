"""A feature page is a snapshot of its feature: a newer capture replaces its rows, an older one
does not, and rivals in one batch resolve to the newest (issue: re-fetched features kept stale rows).

Capture times are set with the files' modification times, which is what `ingest` reads for
files (fetched bodies carry their fetch time).
"""

from __future__ import annotations

import copy
import csv
import gzip
import io
import json
import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import orjson
import pytest

from pipeline.config import Settings
from pipeline.lake.history import changes_since, feature_history, parse_key
from pipeline.lake.warehouse import connect
from tests.conftest import good_page, query, run_ingest, tables_rows, write
from tests.formats import to_api_json, to_flight
from tests.test_land import _adds_up

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
    # the move is said: feature 1 lost one record, to feature 2's newer capture
    gone = query(settings.warehouse, "SELECT feature_index, table_name, reason FROM superseded")
    assert gone == [(1, "activations", f"1 of its activations ids (activation_id) now belong to feature "
                                       f"{KEY[0]}/{KEY[1]}/2 (a newer capture brought them there)")], gone


def test_a_copy_of_a_page_under_another_index_is_recorded_both_ways(tmp_path, settings):
    """An outside review: a copy of a page with only its index changed moved the page's records
    to the other feature with nothing said (superseded 0); one dated before it moved nothing,
    also silently."""
    one = good_page(1)
    first = run_ingest([_at(write(tmp_path / "a" / "1.json", to_api_json(one)), T0)], settings)
    assert first.n_superseded == 0
    copied = copy.deepcopy(one)
    copied["index"] = "5"
    for a in copied["activations"]:
        a["index"] = "5"
    older = run_ingest([_at(write(tmp_path / "b" / "5.json", to_api_json(copied)), T0 - timedelta(days=1))], settings)
    ids = sorted(a["id"] for a in one["activations"])
    owners = query(settings.warehouse, "SELECT DISTINCT feature_index FROM activations WHERE list_contains(?, activation_id)", [ids])
    assert owners == [(1,)], "the newer capture keeps its ids"
    said = {(r[0], r[1]): r[2] for r in query(settings.warehouse, "SELECT feature_index, table_name, reason FROM superseded")}
    assert older.n_superseded == len(said) == 2, said  # activations and explanations
    assert said[(5, "activations")] == (f"{len(ids)} of its activations ids (activation_id) belong to feature "
                                        f"{KEY[0]}/{KEY[1]}/1, whose capture is newer: not loaded")
    assert said[(5, "explanations")].startswith("1 of its explanations ids (explanation_id) belong to feature")

    from pipeline.outputs.find import refresh_index, search

    refresh_index(settings)
    assert [r["feature_index"] for r in search(settings, "cpu things").as_dicts()] == [1]
    newer = run_ingest([_at(write(tmp_path / "c" / "5.json", to_api_json(copied) + b" "), T0 + timedelta(days=1))], settings)
    # the find index, refreshed, has the explanation where the warehouse has it (it kept it at both)
    assert refresh_index(settings).mode == "refreshed"
    assert [r["feature_index"] for r in search(settings, "cpu things").as_dicts()] == [5]
    owners = query(settings.warehouse, "SELECT DISTINCT feature_index FROM activations WHERE list_contains(?, activation_id)", [ids])
    assert owners == [(5,)]
    moved = {(r[0], r[1]): r[2] for r in query(settings.warehouse, "SELECT feature_index, table_name, reason FROM superseded "
                                                                   "WHERE run_id = ?", [newer.run_id])}
    assert newer.n_superseded == 2 and moved[(1, "activations")].endswith(
        f"now belong to feature {KEY[0]}/{KEY[1]}/5 (a newer capture brought them there)"), moved
    stats = dict(query(settings.warehouse, "SELECT feature_index, sum(n_examples) FROM feature_activation_stats GROUP BY 1"))
    assert stats.get(1, 0) == 0 and stats[5] == len(ids), stats


def test_a_copy_of_a_page_under_another_index_in_the_same_run_is_recorded(tmp_path, settings):
    """An outside review of the test above: both pages in one run, the older's records were
    dropped with nothing said (the batch chose among its own ids). Said as across runs; a run
    again changes nothing."""
    one = good_page(1)
    copied = copy.deepcopy(one)
    copied["index"] = "5"
    for a in copied["activations"]:
        a["index"] = "5"
    pages = [_at(write(tmp_path / "a" / "1.json", to_api_json(one)), T0 - timedelta(days=1)),
             _at(write(tmp_path / "b" / "5.json", to_api_json(copied)), T0)]
    run = run_ingest(pages, settings)
    ids = sorted(a["id"] for a in one["activations"])
    assert query(settings.warehouse, "SELECT DISTINCT feature_index FROM activations "
                                     "WHERE list_contains(?, activation_id)", [ids]) == [(5,)]
    said = {(r[0], r[1]): r[2] for r in query(settings.warehouse, "SELECT feature_index, table_name, reason FROM superseded")}
    assert run.n_superseded == len(said) == 2, said
    assert said[(1, "activations")] == (f"{len(ids)} of its activations ids (activation_id) belong to feature "
                                        f"{KEY[0]}/{KEY[1]}/5, whose capture is newer: not loaded")
    assert run_ingest(pages, settings).n_superseded == 0  # landed already: nothing is decided again
    assert query(settings.warehouse, "SELECT count(*) FROM superseded") == [(2,)]


@pytest.mark.parametrize("shape", ["api_json", "flight"])
def test_a_capture_without_explanations_removes_the_old_ones(tmp_path, settings, shape):
    enc = to_api_json if shape == "api_json" else to_flight
    run_ingest([_at(write(tmp_path / "a" / "v1", enc(page_v(1))), T0)], settings)
    bare = page_v(2)
    bare["explanations"] = []
    run_ingest([_at(write(tmp_path / "b" / "v2", enc(bare)), T0 + timedelta(days=1))], settings)
    assert _state(settings)["explanations"] == []


FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")


def fh(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_a_capture_dated_in_the_future_does_not_beat_later_captures(tmp_path):
    """A file whose mtime was in the future (a wrong clock, ``touch -d 2099``) kept its feature
    for ever: every later capture, older by its own time, lost to it."""
    import os

    from pipeline.config import Settings
    from tests.conftest import write
    from tests.formats import to_api_json

    settings = Settings(warehouse=tmp_path / "wh")
    old = good_page(7, source="future-src")
    old["explanations"][0]["description"] = "from a clock that ran ahead"
    first = write(tmp_path / "a" / "page.json", to_api_json(old))
    os.utime(first, (4070908800, 4070908800))  # 2099-01-01
    assert run_ingest([first], settings).n_loaded == 1
    new = good_page(7, source="future-src")
    new["explanations"][0]["description"] = "captured later"
    second = write(tmp_path / "b" / "page.json", to_api_json(new))
    assert run_ingest([second], settings).status == "succeeded"
    assert query(settings.warehouse, "SELECT description FROM explanations") == [("captured later",)]
    (when,) = query(settings.warehouse, "SELECT max(captured_at) FROM raw_inputs")[0]
    assert when.year < 2099


JAN, FEB, MAR = T0, T0 + timedelta(days=31), T0 + timedelta(days=59)


# --- the newest capture wins, whatever its bytes (issue 17, item 3) -------------------------------


def _captures(settings: Settings) -> set:
    return set(query(settings.warehouse, "SELECT table_name, captured_at FROM feature_captures"))


def test_the_newest_capture_wins_when_its_bytes_equal_an_older_one(tmp_path, settings):
    """t1 (v1, Jan), t2 (v2, Feb), t3 (a copy of t1's bytes, Mar): t3 was skipped as already
    landed and the warehouse kept v2. Three runs, and one run, now end with v1 captured in March."""
    t1 = _at(write(tmp_path / "a" / "t1.json", to_api_json(page_v(1))), JAN)
    t2 = _at(write(tmp_path / "b" / "t2.json", to_api_json(page_v(2))), FEB)
    t3 = _at(write(tmp_path / "c" / "t3.json", t1.read_bytes()), MAR)
    for path in (t1, t2):
        run_ingest([path], settings)
    s = run_ingest([t3], settings)
    assert _state(settings) == V1, "the newest capture (t3, the bytes of v1) must win"
    assert _captures(settings) == {(t, MAR) for t in ("features", "activations", "explanations")}
    assert (s.n_received, s.n_reread, s.n_duplicates, s.n_loaded, s.n_features) == (1, 1, 0, 1, 1)
    _adds_up(s)
    assert query(settings.warehouse, "SELECT captured_at FROM raw_inputs WHERE origin = ?", [str(t1)]) == [(MAR,)]

    one_run = Settings(warehouse=tmp_path / "one-run")
    s = run_ingest([t1, t2, t3], one_run)
    assert _state(one_run) == V1 and _captures(one_run) == _captures(settings)
    _adds_up(s)


def test_a_newer_copy_of_what_is_loaded_moves_its_capture_time_without_reading_it(tmp_path, settings):
    """The same bytes captured later change nothing but the capture's time, which later
    decisions compare with: a capture made in between (v2, Feb) then arrives too late."""
    t1 = _at(write(tmp_path / "a" / "t1.json", to_api_json(page_v(1))), JAN)
    run_ingest([t1], settings)
    s = run_ingest([_at(write(tmp_path / "c" / "t3.json", t1.read_bytes()), MAR)], settings)
    assert (s.n_received, s.n_duplicates, s.n_reread, s.n_loaded) == (1, 1, 0, 0), "read again for nothing"
    assert _captures(settings) == {(t, MAR) for t in ("features", "activations", "explanations")}
    with connect(settings, read_only=True) as conn:
        assert changes_since(conn, s.run_id)[1] == [], "the same bytes captured again are no change"
        assert len(feature_history(conn, parse_key("gpt-oss-20b/11-resid-post-aa/7"))) == 1
    late = run_ingest([_at(write(tmp_path / "b" / "t2.json", to_api_json(page_v(2))), FEB)], settings)
    assert late.n_superseded == 3 and _state(settings) == V1


# --- one activation id in two features (issue 17, items 4 and 9) ----------------------------------


def _rival_pages() -> tuple[dict, dict]:
    """Feature 1, and feature 2 whose page also lists two of feature 1's activations."""
    one, two = good_page(1), good_page(2)
    for a in one["activations"][:2]:
        two["activations"].append({**copy.deepcopy(a), "index": "2"})
    return one, two


STATE_TABLES = ("features", "activations", "explanations", "feature_activation_stats", "source_activation_stats")


def _tables(settings: Settings) -> dict[str, list]:
    return tables_rows(settings.warehouse, STATE_TABLES)


@pytest.fixture(scope="module")
def rivals(tmp_path_factory):
    """The two pages (feature 1 captured in January, feature 2 in February) loaded in one run,
    in two runs in capture order, and in two runs the other way round."""
    root = tmp_path_factory.mktemp("rivals")
    one, two = _rival_pages()
    p1 = _at(write(root / "in" / "1.json", to_api_json(one)), JAN)
    p2 = _at(write(root / "in" / "2.json", to_api_json(two)), FEB)
    out = {}
    for name, runs in {"one run": [[p1, p2]], "two runs": [[p1], [p2]], "newer first": [[p2], [p1]]}.items():
        settings = Settings(warehouse=root / name.replace(" ", "-"))
        out[name] = (settings, [run_ingest(paths, settings, run_id=f"r{i}").run_id for i, paths in enumerate(runs)])
    return out


def test_an_id_in_two_features_gives_the_same_tables_however_the_pages_are_batched(rivals):
    """One run quarantined both copies of the ids (72 activations) where two runs moved them to
    the later capture (75). One rule now: the newer capture keeps each id."""
    expected = _tables(rivals["two runs"][0])
    owners = dict(query(rivals["two runs"][0].warehouse,
                        "SELECT feature_index, count(*) FROM activations GROUP BY 1 ORDER BY 1"))
    assert owners == {1: 1, 2: 5}, "feature 2 (the newer capture) keeps the two ids"
    for name in ("one run", "newer first"):
        settings = rivals[name][0]
        assert _tables(settings) == expected, name
        assert query(settings.warehouse, "SELECT count(*) FROM quarantine") == [(0,)], name


def test_on_equal_capture_times_the_larger_digest_keeps_the_id_in_any_batching(tmp_path):
    one, two = _rival_pages()
    p1 = _at(write(tmp_path / "in" / "1.json", to_api_json(one)), JAN)
    p2 = _at(write(tmp_path / "in" / "2.json", to_api_json(two)), JAN)
    together, apart = Settings(warehouse=tmp_path / "together"), Settings(warehouse=tmp_path / "apart")
    run_ingest([p1, p2], together)
    run_ingest([p2], apart)
    run_ingest([p1], apart)
    assert _tables(together) == _tables(apart)
    (winner,) = query(together.warehouse, "SELECT max(input_sha256) FROM raw_inputs")[0]
    shared = [a["id"] for a in one["activations"][:2]]
    assert {r[0] for r in query(together.warehouse, "SELECT DISTINCT input_sha256 FROM activations WHERE "
                                "list_contains(?, activation_id)", [shared])} == {winner}


def test_a_newer_copy_of_a_page_takes_back_the_ids_an_older_capture_took(tmp_path):
    """Captures in order: feature 1 (Jan), feature 2 (Feb) with two of its ids, feature 1 again
    (the same bytes, Mar): the ids are feature 1's again, in three runs as in one."""
    one, two = _rival_pages()
    p1 = _at(write(tmp_path / "a" / "1.json", to_api_json(one)), JAN)
    p2 = _at(write(tmp_path / "b" / "2.json", to_api_json(two)), FEB)
    p1_again = _at(write(tmp_path / "c" / "1.json", p1.read_bytes()), MAR)
    runs, together = Settings(warehouse=tmp_path / "runs"), Settings(warehouse=tmp_path / "together")
    for path in (p1, p2):
        run_ingest([path], runs)
    s = run_ingest([p1_again], runs)
    assert (s.n_reread, s.n_loaded) == (1, 1), "rows of its were taken: the newer capture reads it again"
    run_ingest([p1, p2, p1_again], together)
    owners = dict(query(runs.warehouse, "SELECT feature_index, count(*) FROM activations GROUP BY 1 ORDER BY 1"))
    assert owners == {1: 3, 2: 3}
    assert _tables(runs) == _tables(together)


def test_history_and_changes_show_the_feature_that_lost_activations(rivals):
    """Feature 1 went from 3 activations to 1 when feature 2's capture took two: `changes` listed
    only feature 2 and `history` still showed 3."""
    settings, (first, second) = rivals["two runs"]
    with connect(settings, read_only=True) as conn:
        _, changes = changes_since(conn, second)
        versions = feature_history(conn, parse_key("gpt-oss-20b/11-resid-post-aa/1"))
    by_feature = {c["feature"]: c for c in changes}
    assert set(by_feature) == {"gpt-oss-20b/11-resid-post-aa/1", "gpt-oss-20b/11-resid-post-aa/2"}
    lost = by_feature["gpt-oss-20b/11-resid-post-aa/1"]
    assert lost["change"] == "changed" and {"field": "n_activations", "before": 3, "after": 1} in lost["what"]
    assert [(v["run_id"], v["n_activations"]) for v in versions] == [(first, 3), (second, 1)]
    assert versions[1]["replaced"] == [] and versions[1]["lost"] == ["activations"]

    out = fh("changes", "--since", second, "--warehouse", str(settings.warehouse), "--format", "csv")
    assert out.returncode == 0, out.stderr
    rows = {r["feature"]: r for r in csv.DictReader(io.StringIO(out.stdout))}
    what = json.loads(rows["gpt-oss-20b/11-resid-post-aa/1"]["what"])  # JSON text, not a Python repr
    assert {"field": "n_activations", "before": 3, "after": 1} in what
