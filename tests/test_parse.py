"""Parse stage: shapes detected from content, records typed as the page says."""

from __future__ import annotations

import json
import re
import time
import tracemalloc
from datetime import datetime

import orjson
import pytest

from pipeline.config import Settings
from pipeline.stages.parse import Rejected, parse_bytes
from pipeline.stages.records import InputFormat
from tests.conftest import SEED_FLIGHT, good_page
from tests.formats import gz, to_api_json, to_flight, to_html
from tests.test_flight import reference_bomb


def test_seed_capture_parses_to_the_records_it_holds(seed_page):
    parsed = parse_bytes(SEED_FLIGHT.read_bytes())
    assert parsed.format == InputFormat.FLIGHT
    (feature,) = parsed.features
    assert (feature.model_id, feature.source_id, feature.feature_index) == ("gpt-oss-20b", "11-resid-post-aa", 45698)
    assert feature.max_act_approx == seed_page["maxActApprox"]
    assert feature.pos_str == seed_page["pos_str"] and feature.neg_values == seed_page["neg_values"]
    # dates become naive UTC timestamps
    assert feature.created_at == datetime(2025, 9, 24, 4, 30, 34, 656000)
    assert [a.activation_id for a in parsed.activations] == [a["id"] for a in seed_page["activations"]]
    by_id = {a.activation_id: a for a in parsed.activations}
    for a in seed_page["activations"]:
        rec = by_id[a["id"]]
        assert rec.tokens == a["tokens"] and rec.values == a["values"]
        assert rec.data_source == a["dataSource"] and rec.max_value == a["maxValue"]
        assert rec.feature_index == 45698 and rec.page_key == "gpt-oss-20b/11-resid-post-aa/45698"
    assert [e.description for e in parsed.explanations] == ["cpu"]
    assert [m.model_id for m in parsed.models] == ["gpt-oss-20b"] and parsed.models[0].n_layers == 24
    assert [(s.model_id, s.source_id) for s in parsed.sources] == [("gpt-oss-20b", "11-resid-post-aa")]
    assert [s.source_set_name for s in parsed.source_sets] == ["resid-post-aa"]


def test_seed_counts_match_a_plain_reading_of_the_file():
    text = SEED_FLIGHT.read_text()
    ids = re.findall(r'"id":"([a-z0-9]{24})","tokens"', text)
    parsed = parse_bytes(SEED_FLIGHT.read_bytes())
    assert len(parsed.activations) == len(ids) == 40
    assert sorted(a.activation_id for a in parsed.activations) == sorted(ids)


def test_shape_is_detected_from_content_not_name(tmp_path):
    page = good_page()
    for data, fmt in [(to_api_json(page), "api_json"), (to_flight(page), "flight"),
                      (gz(to_flight(page)), "gzip+flight"), (b"\xef\xbb\xbf  \n" + to_api_json(page), "api_json")]:
        parsed = parse_bytes(data)
        assert str(getattr(parsed.format, "value", parsed.format)) == fmt
        assert len(parsed.activations) == 3


def test_json_array_and_features_wrapper():
    pages = [good_page(1), good_page(2)]
    for body in (json.dumps(json.loads(b"[" + b",".join(to_api_json(p) for p in pages) + b"]")),
                 json.dumps({"features": [json.loads(to_api_json(p)) for p in pages]})):
        parsed = parse_bytes(body.encode())
        assert sorted(f.feature_index for f in parsed.features) == [1, 2]
        assert len(parsed.activations) == 6


def test_export_jsonl_rows_by_name():
    page = json.loads(to_api_json(good_page(3)))
    acts = page["activations"]
    acts[0]["zValues"] = [1]  # a second producer's extra column is tolerated
    del acts[1]["lossValues"]
    body = b"\n".join(orjson.dumps(a) for a in acts) + b"\n"
    parsed = parse_bytes(gz(body))
    assert parsed.format == "gzip+export_jsonl"
    assert [a.activation_id for a in parsed.activations] == [a["id"] for a in acts]
    assert {a.feature_index for a in parsed.activations} == {3}


def test_index_becomes_an_integer_and_a_non_number_is_refused():
    page = good_page(12)
    assert parse_bytes(to_api_json(page)).features[0].feature_index == 12
    page["index"] = "twelve"
    with pytest.raises(Rejected, match="index 'twelve' is not a number"):
        parse_bytes(to_api_json(page))


@pytest.mark.parametrize("field", ["maxValueTokenIndex", "dfaTargetIndex", "qualifyingTokenIndex"])
def test_integer_too_large_for_its_column_does_not_break_parsing(field):
    """An int32 column given 3,000,000,000 must not crash the load; the value cannot be kept."""
    from pipeline.stages.records import to_arrow

    page = good_page()
    page["activations"][0][field] = 3_000_000_000
    parsed = parse_bytes(to_api_json(page))
    to_arrow("activations", parsed.activations)  # raised ArrowInvalid before the fix


def test_values_beyond_int64_become_floats():
    from pipeline.stages.records import to_arrow

    page = good_page()
    page["activations"][0]["values"][0] = 2**64 - 1
    parsed = parse_bytes(to_api_json(page))
    assert to_arrow("activations", parsed.activations).column("values")[0].as_py()[0] == float(2**64 - 1)


def test_feature_index_beyond_int64_is_refused():
    page = good_page()
    page["index"] = 2**63
    with pytest.raises(Rejected, match="out of range"):
        parse_bytes(to_api_json(page))


@pytest.mark.parametrize("data", [
    b"[" * 5000 + b"]" * 5000,
    b"0:" + b"[" * 5000 + b"]" * 5000 + b"\n",
    b"<html><script>self.__next_f.push(" + b"[" * 5000 + b"]" * 5000 + b")</script>",
], ids=["json", "flight", "html"])
def test_deep_nesting_is_refused_in_every_shape(data):
    with pytest.raises(Rejected, match="nested|depth"):
        parse_bytes(data)


def test_html_with_the_real_next_js_bootstrap():
    page = good_page()
    html = to_html(to_flight(page)).replace(b"<script>self.__next_f.push([0])</script>",
                                            b"<script>(self.__next_f=self.__next_f||[]).push([0])</script>")
    assert parse_bytes(html).format == InputFormat.HTML and len(parse_bytes(html).activations) == 3


@pytest.mark.parametrize("html", [False, True], ids=["flight", "html"])
@pytest.mark.parametrize("n_rows", [22, 35])
def test_a_reference_bomb_is_refused_quickly_in_small_memory(n_rows, html):
    """Issue 17, item 6: 35 rows each referring twice to the row before expanded to 2 ** 34
    values (4.3 GB, then SIGSEGV); 22 rows put a 33-million-character logitContributions into
    the warehouse. The expansion is bounded: refused, naming the limit, in milliseconds."""
    data = reference_bomb(n_rows, html=html)
    assert len(data) < 20_000
    tracemalloc.start()
    started = time.process_time()  # CPU, not wall: another process on the machine cannot fail it
    try:
        with pytest.raises(Rejected) as refused:
            parse_bytes(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    seconds = time.process_time() - started
    reason = str(refused.value)
    assert "references expand" in reason and "limit" in reason and "1,048,576" in reason, reason
    assert seconds < 1.0 and peak < 16 << 20, (seconds, peak)


def test_the_expansion_limit_follows_the_decompressed_size_setting():
    """A page within the relative bound is still refused past FEATUREHOUSE_MAX_DECOMPRESSED_BYTES."""
    data = to_flight(good_page())
    assert parse_bytes(data).features
    with pytest.raises(Rejected, match="FEATUREHOUSE_MAX_DECOMPRESSED_BYTES"):
        parse_bytes(data, Settings(max_decompressed_bytes=100))
