"""Validate stage: every expectation in every suite fires on a crafted bad record and passes on good ones.

The cases are parametrized over the suite files themselves, so an expectation added to
schemas/expectations without a case here fails ``test_expectation_fires``.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import orjson
import pytest

from pipeline.config import SCHEMAS_DIR, Settings
from tests.conftest import good_page, query, run_ingest, write
from tests.formats import to_api_json, to_flight

SUITE_FILES = sorted((SCHEMAS_DIR / "expectations").glob("*.json"))
KIND = {"features": "feature", "activations": "activation", "explanations": "explanation"}


def _suite_checks() -> list[tuple[str, str]]:
    out = []
    for f in SUITE_FILES:
        for e in json.loads(f.read_text())["expectations"]:
            out.append((f.stem, e["meta"]["check_name"]))
    return out


def _page(index: int, mutate=None, *, no_activations: bool = False) -> bytes:
    page = good_page(index, source="validate-src")
    if no_activations:
        page["activations"] = []
    if mutate:
        mutate(page)
    return to_api_json(page)


def _flight_page(index: int, mutate) -> bytes:
    """Flight text can carry Infinity and NaN ("$Infinity", "$NaN"); JSON cannot."""
    page = good_page(index, source="validate-src")
    mutate(page)
    return to_flight(page)


def _jsonl(*rows: dict) -> bytes:
    return b"\n".join(orjson.dumps(r) for r in rows) + b"\n"


def _act(i: int = 0, **changes):
    def mutate(page):
        page["activations"][i].update(changes)
    return mutate


def _set(**changes):
    return lambda page: page.update(changes)


def _dup_activation(page):
    page["activations"][1]["id"] = page["activations"][0]["id"]


def _dup_explanation(page):
    page["explanations"].append(dict(page["explanations"][0], description="something else"))


def _two_copies_of_a_feature(index):
    a, b = good_page(index, source="validate-src"), good_page(index, source="validate-src")
    a["activations"] = b["activations"] = []
    b["maxActApprox"] = 9.5
    return b"[" + to_api_json(a) + b"," + to_api_json(b) + b"]"


_MODEL_ROW = {"id": "m-export", "displayName": "M"}

# check name → (input bytes, other checks the same defect may also trip)
CASES: dict[str, tuple[bytes, set[str]]] = {
    # features
    "feature_model_id_present": (_jsonl({"layer": "validate-src", "index": 101}, _MODEL_ROW), set()),
    "feature_source_id_present": (_jsonl({"modelId": "m", "layer": None, "index": 102}, _MODEL_ROW), set()),
    "feature_index_present": (_jsonl({"modelId": "m", "layer": "validate-src", "index": None}, _MODEL_ROW), set()),
    "feature_index_not_negative": (_page(-5, no_activations=True), set()),
    "feature_key_unique_in_batch": (_two_copies_of_a_feature(104), set()),
    "frac_nonzero_is_fraction": (_page(105, _set(frac_nonzero=1.5)), set()),
    "max_act_approx_not_negative": (_page(106, _set(maxActApprox=-0.5)), set()),
    "pos_str_values_same_length": (_page(107, _set(pos_values=[0.1, 0.05, 0.01])), set()),
    "neg_str_values_same_length": (_page(108, _set(neg_str=[])), set()),
    # activations (activation 0 of good_page: values [0, 1.5, 3.25, 0], max at 2)
    "activation_id_present": (_page(201, _act(id=None)), set()),
    "activation_id_unique_in_input": (_page(202, _dup_activation), set()),
    "activation_feature_index_valid": (_page(203, _act(index="-3")), {"activation_feature_key_matches_page"}),
    "activation_feature_key_present": (_page(204, _act(index=None)), {"activation_feature_key_matches_page"}),
    "activation_feature_key_matches_page": (_page(205, _act(layer="another-source")), set()),
    "tokens_values_same_length": (_page(206, _act(tokens=["a", "b", "c"])), set()),
    "excerpt_not_empty": (_page(207, _act(tokens=[], values=[], maxValue=None, maxValueTokenIndex=None, minValue=None)),
                          {"max_value_token_index_in_excerpt", "min_value_not_above_max_value"}),
    "values_not_null": (_page(208, _act(values=[None, 1.5, 3.25, 0.0])), set()),
    "tokens_not_null": (_page(215, _act(tokens=["a", None, "c", "d"])), set()),
    "values_finite": (_flight_page(209, _act(values=[math.inf, 1.5, 3.25, 0.0])), {"max_value_is_max_of_values"}),
    "max_value_is_max_of_values": (_page(210, _act(maxValue=3.0)), {"max_value_token_index_points_at_max"}),
    "max_value_token_index_not_negative": (_page(211, _act(maxValueTokenIndex=-1)),
                                           {"max_value_token_index_points_at_max"}),
    "max_value_token_index_in_excerpt": (_page(212, _act(maxValueTokenIndex=4)),
                                         {"max_value_token_index_points_at_max"}),
    "max_value_token_index_points_at_max": (_page(213, _act(maxValueTokenIndex=1)), set()),
    "min_value_not_above_max_value": (_page(214, _act(minValue=5.0)), set()),
    # explanations
    "explanation_id_present": (_page(301, lambda p: p["explanations"][0].update(id=None)), set()),
    "explanation_id_unique_in_input": (_page(302, _dup_explanation), set()),
    "explanation_feature_key_present": (
        _jsonl({"id": "exp-no-index", "modelId": "m", "layer": "validate-src", "index": None, "description": "x"},
               _MODEL_ROW), set()),
    "description_not_empty": (_page(304, lambda p: p["explanations"][0].update(description="  ")), set()),
    # an embedding: 256 finite numbers, as a JSON list or a string holding one
    "embedding_is_numbers": (_page(305, lambda p: p["explanations"][0].update(
        embedding=[0.25] * 255 + [None])), set()),
    "embedding_dimension": (_page(306, lambda p: p["explanations"][0].update(
        embedding=json.dumps([0.5] * 10))), set()),
    "embedding_not_zero": (_page(307, lambda p: p["explanations"][0].update(embedding=[0.0] * 256)), set()),
}

_EMBEDDING = [round(0.001 * i - 0.1, 9) for i in range(256)]
GOOD = [_page(900, lambda p: p["explanations"][0].update(embedding=_EMBEDDING)),
        _page(901, lambda p: p["explanations"][0].update(embedding=json.dumps(_EMBEDDING))), _jsonl(*[json.loads(to_api_json(good_page(902, source="validate-src")))["activations"][i]
                                         for i in range(3)])]


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate_bad")
    settings = Settings(warehouse=root / "wh.duckdb")
    paths = [write(root / "in" / f"{name}.json", data) for name, (data, _) in CASES.items()]
    paths += [write(root / "in" / f"zz_good_{i}.json", data) for i, data in enumerate(GOOD)]
    summary = run_ingest(paths, settings)
    assert summary.status == "succeeded" and summary.n_rejected == 0, summary.rejected
    return settings.warehouse


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate_good")
    settings = Settings(warehouse=root / "wh.duckdb")
    run_ingest([write(root / "in" / f"good_{i}.json", d) for i, d in enumerate(GOOD)], settings)
    return settings.warehouse


def test_every_expectation_has_a_case():
    names = [c for _, c in _suite_checks()]
    assert len(names) == len(set(names)), "check names must be unique across suites"
    assert sorted(names) == sorted(CASES)


@pytest.mark.parametrize(("suite", "check"), _suite_checks())
def test_expectation_fires(bad_run, suite, check):
    assert check in CASES, f"expectation {suite}.{check} has no crafted bad record in tests/test_validate.py"
    data, also = CASES[check]
    sha = hashlib.sha256(data).hexdigest()
    rows = query(bad_run, "SELECT check_name, detail, record_json FROM quarantine WHERE input_sha256 = ? "
                          "AND record_kind = ?", [sha, KIND[suite]])
    fired = {c for c, _, _ in rows}
    assert check in fired, f"{check} did not fire on its crafted record (fired: {fired})"
    assert fired <= {check} | also, f"unexpected extra checks fired: {fired - {check} - also}"
    for _, detail, record_json in rows:
        assert detail and "{" not in detail  # the template was filled in
        assert isinstance(json.loads(record_json), dict)
    (success, unexpected) = query(bad_run, "SELECT success, unexpected_count FROM validation_results "
                                           "WHERE suite = ? AND expectation = ?", [suite, check])[0]
    assert success is False and unexpected >= 1


@pytest.mark.parametrize(("suite", "check"), _suite_checks())
def test_expectation_passes_on_good_records(good_run, suite, check):
    assert query(good_run, "SELECT success, unexpected_count FROM validation_results WHERE suite = ? AND expectation = ?",
                 [suite, check]) == [(True, 0)]


def test_good_records_load_and_nothing_is_quarantined(good_run):
    assert query(good_run, "SELECT count(*) FROM quarantine") == [(0,)]
    assert query(good_run, "SELECT count(*) FROM activations") == [(9,)]
    assert query(good_run, "SELECT count(*) FROM features") == [(2,)]


def test_bad_records_stay_out_and_the_rest_of_their_page_loads(bad_run):
    # the crafted activation 0 of page 206 is out; its two good siblings are in
    ids = {i for (i,) in query(bad_run, "SELECT activation_id FROM activations WHERE feature_index = 206")}
    assert ids == {"act-gpt-oss-20b-validate-src-206-1", "act-gpt-oss-20b-validate-src-206-2"}
    assert query(bad_run, "SELECT count(*) FROM features WHERE feature_index = 206") == [(1,)]
    assert query(bad_run, "SELECT count(*) FROM features WHERE feature_index = 105") == [(0,)]
    assert query(bad_run, "SELECT count(*) FROM activations WHERE feature_index IN (900, 901, 902)") == [(9,)]


def test_quarantine_detail_names_the_values(bad_run):
    (detail,) = query(bad_run, "SELECT detail FROM quarantine WHERE check_name = 'tokens_values_same_length'")[0]
    assert detail == "len(tokens) = 3 but len(values) = 4"
    (detail,) = query(bad_run, "SELECT detail FROM quarantine WHERE check_name = 'frac_nonzero_is_fraction'")[0]
    assert "1.5" in detail


def test_a_record_with_a_missing_key_part_is_still_named(bad_run):
    keys = dict(query(bad_run, "SELECT check_name, record_key FROM quarantine WHERE check_name IN "
                               "('feature_model_id_present', 'feature_source_id_present', 'feature_index_present')"))
    assert keys == {"feature_model_id_present": "?/validate-src/101", "feature_source_id_present": "m/?/102",
                    "feature_index_present": "m/validate-src/?"}
    (detail,) = query(bad_run, "SELECT detail FROM quarantine WHERE check_name = 'activation_feature_key_matches_page' "
                               "AND record_key LIKE '%-204-0'")[0]
    assert detail == "the activation belongs to feature gpt-oss-20b/validate-src/?, but its page is gpt-oss-20b/validate-src/204"


def test_duckdb_judges_as_great_expectations_does(tmp_path, monkeypatch):
    """The suites judged in DuckDB (``sql_judge``, the default) and by Great Expectations on a
    pandas frame (``JUDGE = "gx"``) decide the same for every batch: the seed, a crafted case
    of every check, and good records; the same quarantine (records, checks, details) and the
    same per-expectation results (counts, percentages, success, failing keys)."""
    from pipeline.stages import validate

    pairs = []
    real = validate.validate_batch

    def both(conn, staged):
        monkeypatch.setattr(validate, "JUDGE", "gx")
        by_gx = real(conn, staged)
        monkeypatch.setattr(validate, "JUDGE", "duckdb")
        by_duckdb = real(conn, staged)
        pairs.append((by_gx, by_duckdb))
        return by_duckdb

    monkeypatch.setattr(validate, "validate_batch", both)
    seed = sorted((Path(__file__).parent / "fixtures").iterdir())
    crafted = [write(tmp_path / "in" / f"{name}.json", data) for name, (data, _) in CASES.items()]
    crafted += [write(tmp_path / "in" / f"zz_good_{i}.json", data) for i, data in enumerate(GOOD)]
    # what only DuckDB and pandas could disagree on: NaN beside null, infinities, a NaN maximum
    crafted.append(write(tmp_path / "in" / "zz_nan.flight", _flight_page(
        990, lambda p: (p["activations"][0].update(maxValue=math.nan, values=[math.nan, 1.0, 2.0, 0.0]),
                        p["activations"][1].update(minValue=-math.inf, maxValue=math.inf),
                        p.update(frac_nonzero=math.nan, maxActApprox=math.inf)))))
    for n, paths in enumerate([seed, crafted]):
        summary = run_ingest(paths, Settings(warehouse=tmp_path / f"wh{n}"))
        assert summary.status == "succeeded", summary
    assert len(pairs) >= 2
    assert {q["check_name"] for _, d in pairs for q in d.quarantine} >= set(CASES)
    for by_gx, by_duckdb in pairs:
        # a record's checks, and the results, in suite order here, in Great Expectations' own there
        order = {(t, e["meta"]["check_name"]): i for i, (t, e) in enumerate(
            (f.stem, e) for f in SUITE_FILES for e in json.loads(f.read_text())["expectations"])}
        assert sorted(by_duckdb.quarantine, key=lambda q: (q["table"], q["row"], order[q["table"], q["check_name"]])) \
            == sorted(by_gx.quarantine, key=lambda q: (q["table"], q["row"], order[q["table"], q["check_name"]]))
        # kwargs as JSON: Great Expectations writes a bound 0 as 0.0
        by_check = lambda r: (r["suite"], r["expectation"])  # noqa: E731
        assert sorted(({**r, "kwargs": json.loads(r["kwargs"])} for r in by_duckdb.results), key=by_check) == \
               sorted(({**r, "kwargs": json.loads(r["kwargs"])} for r in by_gx.results), key=by_check)
        assert by_duckdb.gx_results.keys() == by_gx.gx_results.keys()
        for table, record in by_duckdb.gx_results.items():
            ge = by_gx.gx_results[table]
            assert sorted((r["meta"]["check_name"], r["success"]) for r in record["featurehouse_record"]) == \
                sorted((r.expectation_config.meta["check_name"], r.success) for r in ge.results)


@pytest.mark.parametrize("data_docs", ["report", "run"])
def test_duckdb_judges_what_great_expectations_records(tmp_path, data_docs):
    """What DuckDB judged is stored as Great Expectations' own validation result and its Data
    Docs page is built from it: the failing expectation, its counts and a failing row's id. By
    default (``report``) the result waits until the Data Docs are built; with ``run``, the
    ingest records it."""
    from pipeline.stages import validate

    summary = run_ingest([write(tmp_path / "in" / "bad.json", CASES["frac_nonzero_is_fraction"][0])],
                         Settings(warehouse=tmp_path / "wh", data_docs=data_docs))
    assert summary.status == "succeeded", summary
    validations = tmp_path / "wh" / "gx" / "uncommitted" / "validations"
    if data_docs == "report":
        assert not validations.exists() and validate.has_pending(tmp_path / "wh", summary.run_id)
        validate.build_data_docs(tmp_path / "wh", summary.run_id)
    stored = sorted(validations.rglob("*.json"))
    assert stored, "no Great Expectations result was stored"
    results = {}
    for path in stored:
        doc = json.loads(path.read_text())
        for r in doc["results"]:
            results[r["expectation_config"]["meta"]["check_name"]] = r
    bad = results["frac_nonzero_is_fraction"]
    assert bad["success"] is False and bad["result"]["unexpected_count"] == 1
    assert bad["result"]["partial_unexpected_list"] == [1.5]
    assert results["feature_index_not_negative"]["success"] is True
    pages = validate.build_data_docs(tmp_path / "wh", summary.run_id)
    assert pages and any("1.5" in p.read_text() for p in pages)


@pytest.mark.parametrize("bad", [[1.0, None], [None], "[null, 2]", ["abc"], [[1.0]]])
def test_an_embedding_with_a_value_that_is_no_number_is_quarantined_beside_a_good_one(tmp_path, settings, bad):
    """An explanation whose embedding holds a null (or a value that is no number) is that
    record's fault, on a page whose other explanation has a good embedding: it is quarantined,
    the rest loads. (An inner product over the staged embeddings refused the null under the
    staging view's NULL, and the whole run failed: found from outside.)"""
    page = good_page(7)
    good = [0.5, 0.25] * 128  # 256 values, as Neuronpedia's
    page["explanations"] = [dict(page["explanations"][0], id="exp-good", embedding=good),
                            dict(page["explanations"][0], id="exp-bad", embedding=bad)]
    summary = run_ingest([write(tmp_path / "in" / "p.json", to_api_json(page))], settings)
    assert summary.status == "succeeded" and summary.n_loaded == 1
    assert query(settings, "SELECT explanation_id, embedding FROM explanations") == [("exp-good", good)]
    assert {c for (c,) in query(settings, "SELECT DISTINCT check_name FROM quarantine WHERE record_key = 'exp-bad'")} \
        >= {"embedding_is_numbers"}
