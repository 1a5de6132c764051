"""One structural check, every road: a JSON page with a bad element has one outcome whichever
road reads it (DuckDB's read_json for a one-line page, the Python parser for pretty-printed
JSON, gzip, JSON lines of pages and flight text), and the other pages in the folder load.

Issue 17, items 5 and 10: a one-line page whose ``activations[1]`` was ``null`` crashed every
run that included it (its pretty-printed copy was refused with the schema's reason), an
``explanations`` of ``42`` was dropped silently, a duplicated ``"index"`` key loaded as one
feature on one road and another on the other, and a page with ``index: "-5"`` had its
explanation loaded while its feature and activations were quarantined.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import jsonschema
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.generate import synthetic_page
from pipeline.config import SCHEMAS_DIR, Settings
from pipeline.stages.parse import Rejected, check_page, json_view
from tests.conftest import (
    good_page,
    open_warehouse,
    query,
    run_ingest,
    write,
)
from tests.formats import to_api_json, to_flight, to_html

_SCHEMA_REASON = "does not match the feature page schema at"
_SCHEMA = json.loads((SCHEMAS_DIR / "feature_page.schema.json").read_text())
_DELETE = object()


def _elem(field: str, i: int, value):
    def mutate(page):
        page[field][i] = value
    return mutate


def _in_act(field: str, j: int, value):
    def mutate(page):
        page["activations"][0][field][j] = value
    return mutate


def _set(field: str, value):
    def mutate(page):
        page[field] = value
    return mutate


#: defect → (mutation of a good page, what every road must make of it): ("rejected", words the
#: reason holds) or ("loaded", {activation position: the checks that quarantine it}).
DEFECTS = {
    "activation_null": (_elem("activations", 1, None), ("rejected", [_SCHEMA_REASON, "activations.1", "None"])),
    "activation_number": (_elem("activations", 1, 7), ("rejected", [_SCHEMA_REASON, "activations.1", "7"])),
    "activation_string": (_elem("activations", 1, "x"), ("rejected", [_SCHEMA_REASON, "activations.1", "'x'"])),
    "activation_list": (_elem("activations", 1, [1, 2]), ("rejected", [_SCHEMA_REASON, "activations.1", "[1, 2]"])),
    "explanations_42": (_set("explanations", 42), ("rejected", [_SCHEMA_REASON, "explanations", "42"])),
    "explanation_42": (_elem("explanations", 0, 42), ("rejected", [_SCHEMA_REASON, "explanations.0", "42"])),
    "tokens_with_null": (_in_act("tokens", 1, None), ("loaded", {0: ["tokens_not_null"]})),
    # Not text where text belongs: stored as one text on every road (the odd values below).
    "tokens_with_boolean": (_in_act("tokens", 1, True), ("loaded", {})),
    "tokens_with_number": (_in_act("tokens", 1, 1e-7), ("loaded", {})),
    "tokens_with_object": (_in_act("tokens", 1, {"a": [1, 2.5, None], "b": "é"}), ("loaded", {})),
    "tokens_with_list": (_in_act("tokens", 1, [False, 100000.0]), ("loaded", {})),
    "tokens_with_date": (_in_act("tokens", 1, datetime(2025, 2, 1, 3, 4, 5, 678000)), ("loaded", {})),
    # numbers past what simdjson reads (issue 17 review: DuckDB kept the digits, Python a float)
    "tokens_with_30_digits": (_in_act("tokens", 1, 10**30), ("loaded", {})),
    "tokens_with_2_to_the_64": (_in_act("tokens", 1, 2**64), ("loaded", {})),
    "tokens_with_2_to_the_63": (_in_act("tokens", 1, 2**63), ("loaded", {})),
    "type_name_a_number": (lambda page: page["explanations"][0].update(typeName=42), ("loaded", {})),
    "description_a_date": (lambda page: page["explanations"][0].update(description=datetime(2025, 2, 1)), ("loaded", {})),
    "data_index_an_object": (lambda page: page["activations"][0].update(dataIndex={"x": True}), ("loaded", {})),
    "values_with_string": (_in_act("values", 1, "x"), ("loaded", {0: ["values_not_null"]})),
    "values_with_number_string": (_in_act("values", 1, "1.5"), ("loaded", {0: ["values_not_null"]})),
    "values_with_boolean": (_in_act("values", 1, True), ("loaded", {0: ["values_not_null"]})),
    # digits that are not ASCII (issue 41 item 5: "²" rejected the page on the Python road, which
    # read "٤٥" as 45, and both were quarantined on DuckDB's road)
    "activation_index_superscript": (lambda page: page["activations"][0].update(index="²"),
                                     ("loaded", {0: ["activation_feature_key_matches_page", "activation_feature_key_present"]})),
    "activation_index_arabic_indic": (lambda page: page["activations"][0].update(index="٤٥"),
                                      ("loaded", {0: ["activation_feature_key_matches_page", "activation_feature_key_present"]})),
    "max_token_index_superscript": (lambda page: page["activations"][0].update(maxValueTokenIndex="²"),
                                    ("loaded", {0: ["max_value_token_index_in_excerpt",
                                                    "max_value_token_index_points_at_max"]})),
}

#: How a page is sent. one_line takes DuckDB's road; the others the Python parser's.
ENCODINGS = ("one_line", "pretty", "gzip", "jsonl", "flight")
_WHERE = re.compile(r"^(JSON input|line \d+ of the JSON lines|initialNeuron) ")


def _index(defect: str, encoding: str) -> int:
    """A feature number of its own for each input (captures of one feature would compete)."""
    return 1000 + 10 * list(DEFECTS).index(defect) + ENCODINGS.index(encoding)


def _encode(page: dict, encoding: str) -> bytes:
    one_line = to_api_json(page)
    if encoding == "one_line":
        return one_line
    if encoding == "pretty":
        return json.dumps(json.loads(one_line), indent=2).encode()
    if encoding == "gzip":
        return gzip.compress(one_line, mtime=0)
    if encoding == "jsonl":  # JSON lines of whole pages: this page, then a good one
        return one_line + b"\n" + to_api_json(good_page(int(page["index"]) + 5000)) + b"\n"
    return to_flight(page)


def _bad_page(defect: str, encoding: str) -> dict:
    page = good_page(_index(defect, encoding), source="structure-src")
    DEFECTS[defect][0](page)
    return page


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """One run over a folder: every defect in every encoding, between good pages. Returns the
    run's summary, each input's outcome and the rows each feature has in each table."""
    root = tmp_path_factory.mktemp("structure")
    inbox = root / "in"
    write(inbox / "000_good.json", to_api_json(good_page(1, source="structure-src")))
    paths = {}
    for defect in DEFECTS:
        for encoding in ENCODINGS:
            paths[defect, encoding] = write(inbox / f"{defect}__{encoding}.bin", _encode(_bad_page(defect, encoding), encoding))
    write(inbox / "zzz_good.json", to_api_json(good_page(2, source="structure-src")))
    settings = Settings(warehouse=root / "wh")
    summary = run_ingest([inbox], settings)
    with open_warehouse(settings.warehouse) as conn:
        inputs = {sha: (status, reason) for sha, status, reason in conn.execute(
            "SELECT input_sha256, status, reason FROM raw_inputs").fetchall()}
        quarantined = conn.execute("SELECT input_sha256, record_key, check_name FROM quarantine "
                                   "WHERE record_kind = 'activation' ORDER BY ALL").fetchall()
        rows = {(table, index): n for table in ("features", "activations", "explanations")
                for index, n in conn.execute(f"SELECT feature_index, count(*) FROM {table} GROUP BY 1").fetchall()}
    outcomes = {}
    for key, path in paths.items():
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        status, reason = inputs[sha]
        checks: dict[int, list[str]] = {}
        for _, record_key, check in (q for q in quarantined if q[0] == sha):
            checks.setdefault(int(record_key.rsplit("-", 1)[1]), []).append(check)
        # the reason without its "where", which names the shape
        outcomes[key] = (status, _WHERE.sub("", reason or ""), checks)

    def stored(*sqls: str) -> list[list[tuple]]:
        """Each query's rows, through one connection (opening one is ~0.3 CPU-s)."""
        with open_warehouse(settings.warehouse) as conn:
            return [conn.execute(sql).fetchall() for sql in sqls]

    return summary, outcomes, rows, stored


def test_the_run_succeeds_and_the_good_pages_load(folder_run):
    summary, _, rows, _ = folder_run
    assert summary.status == "succeeded"
    assert rows["features", 1] == rows["features", 2] == 1 and rows["activations", 1] == rows["activations", 2] == 3


@pytest.mark.parametrize("defect", DEFECTS)
def test_every_road_has_the_same_outcome(folder_run, defect):
    _, outcomes, rows, _ = folder_run
    by_encoding = {enc: outcomes[defect, enc] for enc in ENCODINGS}
    assert len(set(map(repr, by_encoding.values()))) == 1, by_encoding
    status, reason, checks = by_encoding["one_line"]
    kind, expected = DEFECTS[defect][1]
    if kind == "rejected":
        assert status == "rejected"
        for word in expected:
            assert word in reason, (word, reason)
    else:
        assert (status, reason) == ("loaded", "") and checks == expected
        for enc in ENCODINGS:  # the page's other records load
            index = _index(defect, enc)
            assert rows.get(("features", index)) == 1 and rows.get(("explanations", index)) == 1
            assert rows.get(("activations", index)) == 3 - len(expected)


#: defect → the stored text every road must give it (issue 17 review: ``True`` on the Python
#: road beside ``true`` on DuckDB's, a Python repr beside JSON, a flight date as Python's text).
_ODD_TEXT = {
    "tokens_with_boolean": ("activations", "tokens[2]", "true"),
    "tokens_with_number": ("activations", "tokens[2]", "1e-07"),
    "tokens_with_object": ("activations", "tokens[2]", '{"a":[1,2.5,null],"b":"é"}'),
    "tokens_with_list": ("activations", "tokens[2]", "[false,100000.0]"),
    "tokens_with_date": ("activations", "tokens[2]", "2025-02-01T03:04:05.678Z"),
    "tokens_with_30_digits": ("activations", "tokens[2]", "1e+30"),
    "tokens_with_2_to_the_64": ("activations", "tokens[2]", "1.8446744073709552e+19"),
    "tokens_with_2_to_the_63": ("activations", "tokens[2]", "9223372036854775808"),
    "type_name_a_number": ("explanations", "type_name", "42"),
    "description_a_date": ("explanations", "description", "2025-02-01T00:00:00.000Z"),
    "data_index_an_object": ("activations", "data_index", '{"x":true}'),
}


@pytest.mark.parametrize("defect", _ODD_TEXT)
def test_a_value_that_is_not_text_where_text_belongs_is_stored_alike_on_every_road(folder_run, defect):
    *_, stored = folder_run
    table, column, expected = _ODD_TEXT[defect]
    position = " AND activation_id LIKE '%-0'" if table == "activations" else ""
    sqls = {enc: f"SELECT {column} FROM {table} WHERE feature_index = {_index(defect, enc)}{position}"
            for enc in ENCODINGS}
    for enc, got in zip(sqls, stored(*sqls.values())):
        assert got == [(expected,)], (enc, got)


def _with_second_index(text: bytes, value: bytes, pretty: bool) -> bytes:
    """The page's text with a second ``"index"`` key added last."""
    body = text.rstrip()
    assert body.endswith(b"}")
    sep = b',\n  "index": ' if pretty else b',"index":'
    return body[:-1].rstrip() + sep + value + b"}" + (b"\n" if pretty else b"")


def test_a_duplicated_key_is_refused_on_every_road(tmp_path):
    """{"index":"3", ..., "index":"4"} loaded as feature 3 on DuckDB's road (read_json keeps the
    first) and as 4 on the Python road (orjson keeps the last); now refused on both."""
    page = good_page(3, source="dup-src")
    one_line = _with_second_index(to_api_json(page), b'"4"', pretty=False)
    pretty = _with_second_index(json.dumps(page, default=str, indent=2).encode(), b'"4"', pretty=True)
    inputs = {"one_line": one_line, "pretty": pretty, "gzip": gzip.compress(one_line, mtime=0),
              "jsonl": one_line + b"\n" + to_api_json(good_page(5, source="dup-src")) + b"\n",
              "array": b"[" + one_line + b"]"}
    # flight text and a saved HTML page with the key twice in the page's row (issue 17 review:
    # they loaded, as feature 4)
    flight = to_flight(page, outline=0.0)
    assert flight.count(b'"index":"3"') >= 1
    flight = flight.replace(b'"index":"3"', b'"index":"3","index":"4"', 1)
    inputs |= {"flight": flight, "html": to_html(flight)}
    paths = [write(tmp_path / "in" / f"{name}.json", data) for name, data in inputs.items()]
    paths.append(write(tmp_path / "in" / "zz_good.json", to_api_json(good_page(6, source="dup-src"))))
    settings = Settings(warehouse=tmp_path / "wh")
    summary = run_ingest(paths, settings)
    assert summary.status == "succeeded" and summary.n_rejected == len(inputs), summary.rejected
    for rejected in summary.rejected:
        assert "'index'" in rejected["reason"] and "twice" in rejected["reason"], rejected
    assert query(settings.warehouse, "SELECT feature_index FROM features") == [(6,)]


def test_a_negative_index_keeps_every_record_of_the_page_out(tmp_path):
    """index "-5": the feature and its activations were quarantined but the explanation loaded
    (with feature_index -5); it takes its page's key only when that is a feature's."""
    settings = Settings(warehouse=tmp_path / "wh")
    one_line, pretty, flight = (good_page(-5, source=f"neg-{name}") for name in ("one-line", "pretty", "flight"))
    paths = [write(tmp_path / "in" / "one_line.json", to_api_json(one_line)),
             write(tmp_path / "in" / "pretty.json", json.dumps(json.loads(to_api_json(pretty)), indent=2).encode()),
             write(tmp_path / "in" / "flight.txt", to_flight(flight))]
    summary = run_ingest(paths, settings)
    assert summary.status == "succeeded" and summary.n_rejected == 0, summary.rejected
    for table in ("features", "activations", "explanations"):
        assert query(settings.warehouse, f"SELECT count(*) FROM {table}") == [(0,)], table
    kinds = query(settings.warehouse, "SELECT record_kind, count(DISTINCT input_sha256) FROM quarantine GROUP BY 1 ORDER BY 1")
    assert kinds == [("activation", 3), ("explanation", 3), ("feature", 3)]
    assert query(settings.warehouse, "SELECT DISTINCT check_name FROM quarantine WHERE record_kind = 'explanation'") == [
        ("explanation_feature_key_present",)]


# --- the check itself -------------------------------------------------------------------


def test_the_check_reads_a_json_view_and_a_parsed_page_alike():
    """The DuckDB road checks simdjson's view of the bytes; the Python road the same view, and
    flight text its decoded page: the same verdict and reason."""
    for defect, (mutate, _) in DEFECTS.items():
        page = good_page(4)
        mutate(page)
        data = to_api_json(page)
        reasons = []
        for view in (json_view(data), orjson.loads(data)):
            try:
                check_page(view, "JSON input")
                reasons.append(None)
            except Rejected as exc:
                reasons.append(str(exc))
        assert reasons[0] == reasons[1], defect


@pytest.mark.parametrize("text", [
    b'{"modelId":"m","layer":"s","index":"1","v":NaN,"activations":[{"id":"a","values":[Infinity]}]}',
    b'{"modelId":"m","layer":"s","index":"1","big":123456789012345678901234567890}',
], ids=["nan", "bigint"])
def test_json_that_simdjson_refuses_is_still_checked(text):
    """DuckDB reads NaN, Infinity and integers past 64 bits; simdjson does not, Python's json does."""
    check_page(json_view(text), "JSON input")
    with pytest.raises(Rejected, match="'index' twice"):
        check_page(json_view(text[:-1] + b',"index":"2"}'), "JSON input")


# Where a generated value goes: the fields the schema describes, at every depth.
_TARGETS = [
    ("modelId",), ("layer",), ("index",), ("sourceSetName",), ("maxActApprox",), ("frac_nonzero",),
    ("pos_str",), ("pos_values",), ("neg_str",), ("neg_values",), ("model",), ("model", "id"), ("source",),
    ("source", "id"), ("source", "modelId"), ("sourceSet",), ("sourceSet", "name"), ("activations",),
    ("activations", 1), ("activations", 0, "id"), ("activations", 0, "tokens"), ("activations", 0, "values"),
    ("activations", 2, "dataSource"), ("explanations",), ("explanations", 0), ("explanations", 0, "id"),
    ("explanations", 0, "description"), ("hookName",),
]
_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5),
              st.from_regex(r"-?[0-9]{1,20}", fullmatch=True)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["id", "x", "name"]), inner,
                                                                         max_size=3)),
    max_leaves=6,
)


def _put(page: dict, path: tuple, value) -> None:
    """Set (or delete) the value at ``path``, when the page still has the place for it."""
    *parents, last = path
    node = page
    for step in parents:
        if isinstance(node, dict) and step in node or isinstance(node, list) and isinstance(step, int) and len(node) > step:
            node = node[step]
        else:
            return
    if isinstance(node, dict) and isinstance(last, str):
        if value is _DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    elif isinstance(node, list) and isinstance(last, int) and len(node) > last:
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value


@settings(max_examples=300, deadline=None)
@given(changes=st.lists(st.tuples(st.sampled_from(_TARGETS), _json_values | st.just(_DELETE)), min_size=1,
                        max_size=3))
def test_the_check_agrees_with_jsonschema(changes):
    """The page check compiles the schema for speed (jsonschema took 3 ms a page on the DuckDB
    road): on any page, its verdict is jsonschema's, on the parsed page and on the JSON view
    (simdjson's) alike."""
    page = json.loads(to_api_json(good_page(4)))
    for path, value in changes:
        _put(page, path, value)
    # the page check is the schema, and a feature number that fits in 64 bits
    expected = jsonschema.Draft202012Validator(_SCHEMA).is_valid(page) and -(2**63) <= int(page["index"]) < 2**63
    for view in (page, json_view(orjson.dumps(page))):
        try:
            check_page(view, "JSON input")
            verdict = True
        except Rejected:
            verdict = False
        assert verdict == expected, (changes, type(view))


def test_a_value_that_is_not_a_number_in_an_export_batch_fails_one_check_on_both_roads(tmp_path):
    """Export rows: DuckDB's stream (gzip batch) made ``"x"`` null (values_not_null), the Python
    parser (plain JSON lines) NaN (values_finite and max_value_is_max_of_values)."""
    paths = []
    for name, index in (("gzip", 21), ("plain", 22)):
        rows = json.loads(to_api_json(good_page(index, source="export-src")))["activations"]
        rows[0]["values"][1] = "x"
        text = b"".join(orjson.dumps(r) + b"\n" for r in rows)
        paths.append(write(tmp_path / "in" / f"{name}.jsonl{'.gz' if name == 'gzip' else ''}",
                           gzip.compress(text, mtime=0) if name == "gzip" else text))
    settings = Settings(warehouse=tmp_path / "wh")
    summary = run_ingest(paths, settings)
    assert summary.status == "succeeded" and summary.n_rejected == 0, summary.rejected
    assert query(settings.warehouse, "SELECT format FROM raw_inputs ORDER BY 1") == [("export_jsonl",),
                                                                                  ("gzip+export_jsonl",)]
    assert query(settings.warehouse, "SELECT record_key, check_name FROM quarantine ORDER BY 1") == [
        ("act-gpt-oss-20b-export-src-21-0", "values_not_null"), ("act-gpt-oss-20b-export-src-22-0", "values_not_null")]
    assert query(settings.warehouse, "SELECT feature_index, count(*) FROM activations GROUP BY 1 ORDER BY 1") == [
        (21, 2), (22, 2)]


FEATUREHOUSE = Path(sys.executable).with_name("featurehouse")


def fh(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(FEATUREHOUSE), *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))


def test_a_page_with_nan_and_a_bad_record_is_refused_and_the_run_goes_on(tmp_path):
    """DuckDB reads NaN, Infinity and 1e400; cutting the refused record out of such a page with
    simdjson failed and stopped the whole run. Such a page is not JSON: the Python road refused
    it while DuckDB's loaded it (issue 17 review: one outcome on every road), so both refuse it
    now, with the reason, and the other pages load."""
    page = synthetic_page(3, valid=False)  # keeps the seed's one bad activation
    text = orjson.dumps(page).replace(b'"maxActApprox":', b'"maxActApprox":NaN,"_was":', 1)
    first_value = page["activations"][0]["maxValue"]
    text = text.replace(f'"maxValue":{orjson.dumps(first_value).decode()}'.encode(), b'"maxValue":1e400', 1)
    settings = Settings(warehouse=tmp_path / "wh")
    write(tmp_path / "in" / "good.json", orjson.dumps(synthetic_page(4, valid=False)))
    for name, data in (("nan.json", text), ("nan-pretty.json", text.replace(b',"', b',\n"'))):
        write(tmp_path / "in" / name, data)
    proc = fh("ingest", str(tmp_path / "in"), "--warehouse", str(settings.warehouse), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert query(settings.warehouse, "SELECT status FROM runs") == [("succeeded",)]
    refused = query(settings.warehouse, "SELECT origin, reason FROM raw_inputs WHERE status = 'rejected' ORDER BY 1")
    assert [o.rsplit("/", 1)[1] for o, _ in refused] == ["nan-pretty.json", "nan.json"]
    assert all("not valid JSON" in reason for _, reason in refused), refused
    assert query(settings.warehouse, "SELECT feature_index FROM features") == [(4,)]
    (n,) = query(settings.warehouse, "SELECT count(*) FROM quarantine WHERE record_kind = 'activation'")[0]
    assert n >= 1  # the good page's own bad record
