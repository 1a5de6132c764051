"""The flight decoder: rows, encodings, references, HTML chunks; Hypothesis round trips."""

from __future__ import annotations

import math
import random
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.stages import flight
from tests.conftest import (
    SEED_FLIGHT,
    good_page,
    query,
    run_ingest,
)
from tests.formats import UNDEFINED, FlightWriter, to_flight, to_html


def test_t_row_length_is_utf8_bytes_and_no_newline_follows():
    text = "é\n北" * 400  # newlines inside the text, 3 and 2 byte characters
    raw = text.encode()
    data = b"0:" + b'{"a":"$1"}\n' + b"1:T" + format(len(raw), "x").encode() + b"," + raw + b'2:["next"]\n'
    rows = flight.parse_rows(data)
    assert rows["1"] == text
    assert rows["2"] == ["next"]
    assert flight.decode(rows, rows["0"]) == {"a": text}


def test_truncated_t_row_is_an_error_that_says_so():
    data = b"1:T400,short"
    with pytest.raises(flight.FlightError, match="truncated"):
        flight.parse_rows(data)


def test_tagged_rows_and_visible_text_are_not_data():
    data = b'1:I["x",[],"Y"]\n2:HL["/a.css","style"]\nSome visible text\n\n3:{"k":1}\nmore text'
    rows = flight.parse_rows(data)
    assert rows["3"] == {"k": 1}
    assert rows["1"][0] == "tag" and rows["2"][0] == "tag"
    assert flight.find_key(rows, "k") == (True, 1)


@pytest.mark.parametrize(
    ("encoded", "expected"),
    [
        ("$$", "$"),
        ("$$L1", "$L1"),
        ("$D2025-09-24T04:30:34.656Z", datetime(2025, 9, 24, 4, 30, 34, 656000, tzinfo=timezone.utc)),
        ("$n18446744073709551615", 18446744073709551615),
        ("$n-9223372036854775808", -9223372036854775808),
        # past 64 bits, a float, as the Python road (orjson) reads the same JSON number
        ("$n123456789012345678901234567890", 1.2345678901234568e29),
        ("$n" + "9" * 5000, math.inf),
        ("$n-5", -5),
        ("$L14", "$L14"),  # a lazy component reference stays as written
        ("plain", "plain"),
    ],
)
def test_string_encodings(encoded, expected):
    assert flight.decode({}, encoded) == expected


def test_special_numbers():
    out = flight.decode({}, ["$Infinity", "$-Infinity", "$NaN", "$-0"])
    assert out[0] == math.inf and out[1] == -math.inf and math.isnan(out[2])
    assert out[3] == 0 and math.copysign(1, out[3]) < 0


def test_undefined_drops_a_key_and_is_null_in_a_list():
    assert flight.decode({}, {"a": "$undefined", "b": 1}) == {"b": 1}
    assert flight.decode({}, ["$undefined", 1]) == [None, 1]


def test_references_with_a_path_and_errors():
    rows = flight.parse_rows(b'1:{"a":[10,{"b":"deep"}]}\n2:"$1:a:1:b"\n3:"$4"\n')
    assert flight.decode(rows, "$2") == "deep"
    with pytest.raises(flight.FlightError, match="row 4"):
        flight.decode(rows, "$3")
    with pytest.raises(flight.FlightError, match="does not resolve"):
        flight.decode(rows, "$1:nope")
    cyclic = flight.parse_rows(b'5:["$6"]\n6:["$5"]\n')
    with pytest.raises(flight.FlightError, match="cycle"):
        flight.decode(cyclic, "$5")


def test_find_key_in_the_seed_capture():
    rows = flight.parse_rows(SEED_FLIGHT.read_bytes())
    found, page = flight.find_key(rows, "initialNeuron")
    assert found and page["index"] == "45698" and len(page["activations"]) == 40
    assert page["createdAt"] == datetime(2025, 9, 24, 4, 30, 34, 656000, tzinfo=timezone.utc)
    assert flight.find_key(rows, "noSuchKey") == (False, None)


def test_html_chunks_join_to_the_flight_text():
    text = ('1:{"s":"a & b < c > d \u2028 \u2029 é"}\n2:T5,hello' + '3:["x"]\n').encode()
    html = to_html(text, n_chunks=6, seed=3).decode()
    assert "\u2028" not in html and "& b" not in html and "\\u0026" in html and '[3,"' in html
    assert flight.html_to_flight(html) == text


# --- Hypothesis: arbitrary values round-trip through our encoder and the pipeline's decoder ---

_key = st.text(max_size=8).filter(lambda k: k != "initialNeuron")
_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
    st.text(max_size=4).map(lambda s: "$" + s),
    st.text(min_size=1, max_size=3).map(lambda s: s * 400),  # 400 to 1,200 characters: T rows
    st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(2200, 1, 1)).map(
        lambda d: d.replace(microsecond=d.microsecond // 1000 * 1000, tzinfo=timezone.utc)
    ),
    st.just(UNDEFINED),
)
_values = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(_key, inner, max_size=5)),
    max_leaves=30,
)


def _expected(v):
    """What the decoder should give back: undefined keys dropped, undefined list items null."""
    if isinstance(v, dict):
        return {k: _expected(x) for k, x in v.items() if x is not UNDEFINED}
    if isinstance(v, list):
        return [None if x is UNDEFINED else _expected(x) for x in v]
    if type(v) is int and not -(2**63) <= v < 2**64:
        return float(v)  # a BigInt past 64 bits: a float, as orjson reads the JSON number
    return v


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=_values, outline=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 1000), html=st.booleans())
def test_round_trip(value, outline, seed, html):
    w = FlightWriter(first_id=0x10, outline=outline, rng=random.Random(seed))
    enc = w.encode([value])
    w.json_row(["$", "div", None, {"children": ["$", "$L1", None, {"initialNeuron": enc}]}], rid="0")
    w.rows.append(b"visible text after the rows\n")
    data = w.text()
    if html:
        data = flight.html_to_flight(to_html(data, seed=seed).decode())
    rows = flight.parse_rows(data)
    found, decoded = flight.find_key(rows, "initialNeuron")
    assert found
    assert _same(decoded, _expected([value]))


def test_visible_text_that_looks_like_a_row_is_not_data():
    """A captured page's visible text can hold lines like "10:00 am" or "8:30" after the rows."""
    data = SEED_FLIGHT.read_bytes() + b"\n10:00 am, posted\n8:30\nnull:1\n"
    found, page = flight.find_key(flight.parse_rows(data), "initialNeuron")
    assert found and page["index"] == "45698"


def test_a_bad_row_before_any_visible_text_is_still_an_error():
    with pytest.raises(flight.FlightError, match="row 1 is not valid JSON"):
        flight.parse_rows(b'1:{"a": oops}\n2:["ok"]\n')


# --- reference bombs (issue 17, item 6) ---------------------------------------------------


def reference_bomb(n_rows: int, *, html: bool = False) -> bytes:
    """A good page's flight text (or saved HTML) whose first activation's ``logitContributions``
    refers to the last of ``n_rows`` rows, each holding two references to the row before it:
    a few KB of text that expands to 2 ** n_rows values."""
    page = good_page(8)
    page["activations"][0]["logitContributions"] = "BOMB-REFERENCE"
    chain = [b'f00:["tok","tok"]\n'] + [
        f'{0xF00 + i:x}:["${0xF00 + i - 1:x}","${0xF00 + i - 1:x}"]\n'.encode() for i in range(1, n_rows)
    ]
    text = b"".join(chain) + to_flight(page, outline=0.0)
    text = text.replace(b'"BOMB-REFERENCE"', f'"${0xF00 + n_rows - 1:x}"'.encode(), 1)
    return to_html(text) if html else text


def test_a_reference_bomb_is_refused_before_it_is_expanded():
    """35 rows referring each to the one before twice: 2 ** 35 values from a few KB of text."""
    rows = flight.parse_rows(reference_bomb(35))
    with pytest.raises(flight.FlightError, match="references expand"):
        flight.find_key(rows, "initialNeuron")


def test_references_that_share_a_row_within_the_bound_still_resolve():
    """A row referred to a few times (React outlines shared objects) is not a bomb."""
    data = b'1:{"name":"shared","n":[1,2,3]}\n0:{"initialNeuron":{"a":"$1","b":"$1","c":["$1","$1:n"]}}\n'
    found, page = flight.find_key(flight.parse_rows(data), "initialNeuron")
    assert found and page["a"] == page["b"] == page["c"][0] == {"name": "shared", "n": [1, 2, 3]}
    assert page["c"][1] == [1, 2, 3]


# --- flight text: a BigInt past 64 bits in a record stopped every run ------------------------------
#
# ``"$n<digits>"`` was decoded to an exact Python int; a record holding one past 64 bits (a value,
# dataIndex, an extra field) made the run end in a traceback (``TypeError: Integer exceeds 64-bit
# range`` writing the record out as JSON), so no page of the folder loaded, at every re-run; in a
# score it was refused as "could not be parsed (TypeError ...)", and over 4,300 digits as
# "could not be parsed (ValueError ...)".


def _flight_with(index: int, placeholder_at, big: str) -> bytes:
    page = good_page(index)
    placeholder_at(page)
    text = to_flight(page, outline=0.0)
    assert text.count(b'"XX"') == 1
    return text.replace(b'"XX"', b'"$n' + big.encode() + b'"')


def test_a_bigint_past_64_bits_in_flight_text_does_not_stop_the_run(tmp_path, settings):
    big = "9" * 30
    pages = {
        "data_index": _flight_with(101, lambda p: p["activations"][0].__setitem__("dataIndex", "XX"), big),
        "extra": _flight_with(102, lambda p: p.__setitem__("extraField", "XX"), big),
        "score": _flight_with(103, lambda p: p["explanations"][0].__setitem__("scores", ["XX"]), big),
        "token": _flight_with(104, lambda p: p["activations"][0]["tokens"].__setitem__(1, "XX"), "9" * 5000),
        "value": _flight_with(105, lambda p: p["activations"][1]["values"].__setitem__(1, "XX"), big),
    }
    folder = tmp_path / "in"
    folder.mkdir()
    for name, data in pages.items():
        (folder / f"{name}.txt").write_bytes(data)
    (folder / "good.txt").write_bytes(to_flight(good_page(106)))
    summary = run_ingest([folder], settings)
    assert summary.status == "succeeded"
    assert summary.n_rejected == 0 and summary.n_loaded == 6
    assert query(settings, "SELECT count(*) FROM features")[0][0] == 6
    assert query(settings, "SELECT data_index FROM activations WHERE feature_index = 101 AND data_index IS NOT NULL") \
        == [("1e+30",)]
