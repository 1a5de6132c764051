"""The pages people read write tokens and numbers for people: the run report, its index of runs
and the feature card (``show --html``). A token's leading or trailing space is ␣ and a newline
↵ (" CPU" and "CPU" differ on the page), escaped; a firing density is a percentage as
Neuronpedia writes it, 0.00335%, not 3.347874052815106e-05, the same on every page; each excerpt of the card says its data source
and its largest activation; the runs' table fits its card in a browser."""

from __future__ import annotations

import html
import math
import re
from decimal import Decimal
from pathlib import Path

import numpy as np
import orjson
import pytest

from pipeline import Settings, ingest
from pipeline.outputs import find
from pipeline.outputs.text import density, rounded, visible_token
from tests.conftest import SEED_NOT_A_PAGE, good_page, write

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
SHOTS = ROOT / "build" / "screenshots"

KEY = "gpt-oss-20b/11-resid-post-aa/7"
DENSITY = 3.347874052815106e-05
TOKENS = ["CPU", " CPU", "\n", " <b>x</b>", "x "]
SHOWN = ["CPU", "␣CPU", "↵", "␣<b>x</b>", "x␣"]  # as text, before HTML escaping
PEAK = 3.14159265
#: An Airflow run id (37 characters) and a seed run's WARN reason: the widest a runs row gets.
LONG_RUN_ID = "scheduled__2026-01-01T00:00:00+00:00"


def _page() -> dict:
    page = good_page(7)
    page["frac_nonzero"] = DENSITY
    page["maxActApprox"] = PEAK
    page["pos_str"], page["pos_values"] = [" the", "the", "\n"], [0.3, 0.2, 0.1]
    chat = page["activations"][0]
    chat["tokens"], chat["values"] = TOKENS, [1.0, PEAK, 2.5, 1.5, 0.75]
    chat["maxValue"], chat["maxValueTokenIndex"], chat["minValue"] = PEAK, 1, 0.75
    return page


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory):
    """One page with look-alike tokens and a long density, then the seed (a WARN with a long
    reason) and a rejected input under an Airflow-like run id: each with its report."""
    root = tmp_path_factory.mktemp("readable")
    settings = Settings.from_env(warehouse=root / "wh")
    page = write(root / "in" / "p.json", orjson.dumps(_page()))
    first = ingest([page], settings, progress=False, run_id="run-readable")
    assert first.n_loaded == 1 and first.n_quarantined == 0
    ingest([FIXTURES], settings, progress=False, run_id="run-seed")
    ingest([SEED_NOT_A_PAGE], settings, progress=False, run_id=LONG_RUN_ID)
    return settings, Path(first.report_path)


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


# --- one way of writing a token and a number ----------------------------------------------------

@pytest.mark.parametrize("token, shown", [
    (" CPU", "␣CPU"), ("CPU", "CPU"), ("x ", "x␣"), ("\n", "↵"), ("  ", "␣␣"), ("a b", "a b"),
    ("\tif", "⇥if"), (" \n", "␣↵"), ("", ""), (None, ""),
])
def test_a_tokens_edges_are_visible(token, shown):
    assert visible_token(token) == shown


@pytest.mark.parametrize("value, shown", [
    (DENSITY, "3.35e-05"), (0.001, "0.001"), (0.000335, "0.000335"), (3.14159265, "3.14"), (12.3456, "12.3"),
    (1234.5, "1,234"), (262144, "262,144"), (3.0, "3"), (0, "0"), (0.0, "0"), (None, "–"),
    (np.int64(5000), "5,000"), (np.float64(DENSITY), "3.35e-05"), (Decimal("2.50"), "2.5"),
    (float("nan"), "nan"), (True, "True"), ("n/a", "n/a"),
    # a time to the second (review: the feature page said "captured 2026-12-06 03:08:42.766184")
    (__import__("datetime").datetime(2026, 12, 6, 3, 8, 42, 766184), "2026-12-06 03:08:42"),
])
def test_numbers_are_rounded_for_people(value, shown):
    assert rounded(value) == shown


@pytest.mark.parametrize("value", [
    " CPU", "CPU", "\n", " \n ", "\t", "   ", "a  b ", None,
])
def test_the_web_app_writes_a_token_the_same_way(value):
    from pipeline.outputs import web  # its own copy until it imports text.py's

    assert web.visible_token(value) == visible_token(value)


@pytest.mark.parametrize(("value", "shown"), [
    (DENSITY, "0.00335%"), (0.001, "0.1%"), (1.23e-9, "0.000000123%"), (1e-4, "0.01%"),
    (9.9996e-6, "0.001%"), (0.123456, "12.3%"), (0.25, "25%"), (1, "100%"), (0, "0%"), (0.0, "0%"), (None, "–"),
    (np.float64(DENSITY), "0.00335%"), (Decimal("0.5"), "50%"), (math.nan, "nan"), ("x", "x"),
])
def test_a_firing_density_is_a_percentage_for_people(value, shown):
    assert density(value) == shown


@pytest.mark.parametrize("value", [DENSITY, 0.001, 3.14159265, 1234.5, 262144, 3.0, 0, None, -0.5, 1e9, math.inf])
def test_the_web_app_rounds_a_number_the_same_way(value):
    from pipeline.outputs import web

    assert web._round(value) == rounded(value)


# --- the run report -----------------------------------------------------------------------------

def test_the_reports_top_tokens_show_their_spaces_and_newlines(warehouse):
    _, path = warehouse
    raw = path.read_text()
    row = re.search(r'<tr class="top-feature">.*?</tr>', raw, re.S)
    assert row, "no top feature in the report"
    pills = [html.unescape(p) for p in re.findall(r'<span class="pill">(.*?)</span>', row.group(0))]
    assert sorted(pills) == sorted(SHOWN), pills
    assert "<b>x</b>" not in raw and "␣&lt;b&gt;x&lt;/b&gt;" in raw  # escaped, as text


def test_the_report_rounds_the_firing_density_and_activations(warehouse):
    _, path = warehouse
    raw = path.read_text()
    row = _text(re.search(r'<tr class="top-feature">.*?</tr>', raw, re.S).group(0))
    assert "0.00335%" in row and rounded(PEAK) in row, row
    outside_charts = html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<svg.*?</svg>", "", raw, flags=re.S)))  # cells apart
    long_numbers = re.findall(r"\d\.0*[1-9]\d{3,}", outside_charts)  # over 3 significant digits
    assert not long_numbers, f"numbers not rounded: {long_numbers}"


# --- the feature card ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def card(warehouse):
    settings, _ = warehouse
    view = find.show(settings, KEY, n_neighbours=0)
    return view, find.render_html(view)


def test_the_cards_excerpts_say_their_data_source_and_activation(card):
    view, page = card
    chunks = re.split(r'<div class="excerpt" data-max="[^"]*">', page.split("<h2>Top excerpts</h2>", 1)[1])
    assert len(chunks) == len(view.excerpts) + 1 == 4
    assert [e["data_source"] for e in view.excerpts] == ["Chat", "Non-Chat", None]
    for k, (e, before) in enumerate(zip(view.excerpts, chunks)):
        # what stands between the excerpt before (its tokens, closed by </div>) and this one
        head = _text(before.split("</div>", 1)[1] if k else before)
        assert (e["data_source"] or "(no data source)") in head, head
        assert re.search(rf"(?<![\d.]){re.escape(rounded(e['max_value']))}(?![\d.])", head), head


def test_the_cards_tokens_show_their_spaces_and_newlines(card):
    view, page = card
    first = re.search(r'<div class="excerpt" data-max="[^"]*">(.*?)</div>', page, re.S).group(1)
    toks = [html.unescape(t) for t in re.findall(r'<span class="tok[^"]*"[^>]*>(.*?)</span>', first)]
    assert toks == SHOWN
    assert "<b>x</b>" not in page and "␣&lt;b&gt;x&lt;/b&gt;" in page
    stats = re.search(r'<table class="stats">.*?</table>', page, re.S).group(0)
    assert "␣CPU" in _text(stats) and "↵" in _text(stats)
    logits = _text(re.search(r"<p>Top positive logits:.*?</p>", page, re.S).group(0))
    assert logits == "Top positive logits: ␣the, the, ↵"


def test_the_card_rounds_its_numbers_as_the_report_does(card, warehouse):
    _, page = card
    _, path = warehouse
    assert str(DENSITY) not in page and str(PEAK) not in _text(page)
    head = _text(re.search(r"<p>Max activation.*?</p>", page, re.S).group(0))
    assert f"firing density {density(DENSITY)}" in head and f"(approx.) {rounded(PEAK)}" in head
    assert density(DENSITY) == "0.00335%" and density(DENSITY) in _text(path.read_text())  # the report alike
    titles = re.findall(r'<span class="tok[^"]*" data-activation="[^"]*" title="([^"]*)"', page)
    assert rounded(PEAK) in titles and str(PEAK) not in titles


# --- the runs' index in a browser ---------------------------------------------------------------



_MEASURE = """() => {
  const table = document.querySelector('tr.run').closest('table');
  const box = table.parentElement, card = table.closest('section');
  const cells = [...table.querySelectorAll('tr.run > td')].map(td => ({
    cls: td.className, width: td.getBoundingClientRect().width,
    em: parseFloat(getComputedStyle(td).fontSize)}));
  return {table: table.scrollWidth, box: box.clientWidth, boxScrolls: getComputedStyle(box).overflowX,
          card: card.clientWidth, cardScroll: card.scrollWidth,
          page: document.documentElement.scrollWidth, window: innerWidth, cells};
}"""


@pytest.mark.browser
@pytest.mark.parametrize("width", [1280, 1024])
def test_the_runs_table_fits_its_card(chromium, warehouse, width):
    settings, _ = warehouse
    ctx = chromium.new_context(viewport={"width": width, "height": 900})
    try:
        page = ctx.new_page()
        page.goto((settings.report_dir / "index.html").as_uri())
        assert page.locator("tr.run").count() == 3
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"report-index-{width}.png"), full_page=True)
        m = page.evaluate(_MEASURE)
        assert m["table"] <= m["box"] + 1, m
        assert m["cardScroll"] <= m["card"] + 1 and m["page"] <= m["window"] + 1, m
        for c in m["cells"]:  # no column squeezed to a word a line: four characters at the least
            assert c["width"] >= 4 * 0.6 * c["em"], c
        why = [c for c in m["cells"] if "why" in c["cls"]]
        assert why and all(c["width"] >= 14 * c["em"] for c in why), why
    finally:
        ctx.close()


@pytest.mark.browser
def test_a_narrow_window_scrolls_the_runs_table_inside_its_card(chromium, warehouse):
    settings, _ = warehouse
    ctx = chromium.new_context(viewport={"width": 760, "height": 900})
    try:
        page = ctx.new_page()
        page.goto((settings.report_dir / "index.html").as_uri())
        page.screenshot(path=str(SHOTS / "report-index-760.png"), full_page=True)
        m = page.evaluate(_MEASURE)
        assert m["boxScrolls"] in ("auto", "scroll") and m["page"] <= m["window"] + 1, m
        assert m["cardScroll"] <= m["card"] + 1, m
    finally:
        ctx.close()


def test_the_reports_duration_says_what_status_counts(warehouse, tmp_path):
    """The report a run writes cannot time its own writing: it says its duration is the load's
    and that status counts the report too; written again later, it gives status's seconds."""
    from pipeline.lake import warehouse as warehouse_mod
    from pipeline.outputs import report

    settings, path = warehouse
    dd = re.search(r"<dt>duration</dt><dd>(.*?)</dd>", path.read_text(), re.S).group(1)
    assert 'id="duration-note"' in dd and "featurehouse status" in _text(dd), dd
    with warehouse_mod.connect(settings, read_only=True) as conn:
        seconds = conn.execute("SELECT epoch(finished_at - started_at) FROM runs "
                               "WHERE run_id = 'run-readable'").fetchone()[0]
    loaded = float(re.match(r"\s*([\d.]+) s", _text(dd)).group(1))
    assert loaded <= round(seconds, 1)
    again = report.write_report(settings, "run-readable", out_dir=tmp_path)
    dd = re.search(r"<dt>duration</dt><dd>(.*?)</dd>", again.read_text(), re.S).group(1)
    assert "duration-note" not in dd and _text(dd).strip() == f"{seconds:.1f} s", dd
