"""The run report and its index, as a reader sees them: nothing wider than the window, each count
of failures out of what, and failures listed in the order of their numbers.

Over runs with real-looking content: the samples; a run of long tokens (a URL, 150 letters with
no break), long explanations, inputs rejected and records quarantined; a fetched night that lost
some URLs; a run that failed with a long error; and an unchanged re-run (the short form, with
its trend as a table). At 760 and 1280 px wide, in Chromium, the page does not scroll sideways
and each card and table lies inside the window (a long token wraps in its cell; the SQL under a
section scrolls in its own box). The index's table of runs scrolls inside its card at 760 px
(``test_readable_outputs`` measures it at 1024 and 1280). ``show --html``'s feature card is
measured the same way: the samples' feature (excerpts of tokens joined by ␣, with no space to
wrap at) and one of the long tokens; its excerpts wrap inside their boxes."""

from __future__ import annotations

import html
import re
from pathlib import Path

import orjson
import pytest

from pipeline import Settings, ingest
from pipeline.outputs import find
from pipeline.outputs.report import write_report
from pipeline.sources.fetch import ingest_fetched
from pipeline.sources.night import fetch_chunk
from tests.conftest import good_page, query, write
from tests.fake_neuronpedia import MODEL, SOURCE, FakeNeuronpedia, feature_path, small_pages

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "build" / "screenshots"

LONG_MODEL, LONG_SOURCE = "gemma-2-2b", "20-gemmascope-res-16k-canonical-l0-ultra-long-name"
LONG_TOKENS = [" https://example.org/" + "path/" * 30 + "index.html", "x" * 150, "\n\n", "Ж" * 80]
SAMPLES_FEATURE = "gpt-oss-20b/11-resid-post-aa/45698"
LONG_WORD = "supercalifragilistic" * 9
QUARANTINED = (2, 9, 10)  # pages with a broken excerpt: their keys differ by a number
LOST = (2, 9, 10, 11)  # URLs of the night lost for good (503), of 0..12
BROKEN_ID = "manual__2026-01-01T00:00:00.123456+00:00-retry-of-the-nightly-window-2026-01-01"
LONG_ERROR = ("injected failure while validating /srv/featurehouse/landing/sha256/ab/"
              + "abcdef0123456789" * 8 + ".json.gz: " + "the batch could not be validated " * 6)


def _long_page(index: int) -> dict:
    page = good_page(index, model=LONG_MODEL, source=LONG_SOURCE)
    for a in page["activations"]:
        a["tokens"] = (LONG_TOKENS * 2)[: len(a["values"])]
    page["explanations"][0]["description"] = (
        "text about very long identifiers and the places they appear in, such as " + LONG_WORD
        + " and long web addresses; " * 8)
    if index in QUARANTINED:
        page["activations"][0]["values"].append(0.0)  # tokens and values of unequal length
    return page


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, Path]:
    """Five runs' reports and the index; each run's own report as it wrote it."""
    root = tmp_path_factory.mktemp("layout")
    settings = Settings.from_env(warehouse=root / "wh")
    out = {"samples": Path(ingest([ROOT / "samples"], settings, progress=False, run_id="run-samples").report_path)}

    inbox = root / "long"
    for i in (2, 9, 10, 11, 12):
        write(inbox / f"page-{i}.json", orjson.dumps(_long_page(i)))
    for i in (2, 9, 10):  # rejected: not a page, named by a number
        write(inbox / f"export-{i}.txt", f"<html><body>{'not a page ' * 40}{i}</body></html>".encode())
    out["long"] = Path(ingest([inbox], settings, progress=False, run_id="run-long").report_path)

    served = small_pages(range(13))
    with FakeNeuronpedia(pages=served, always={feature_path(i): "503" for i in LOST}) as np:
        chunk = {"model": MODEL, "source": SOURCE, "via": "api", "start": 0, "stop": 13, "window": "w-night",
                 "base_url": np.base_url, "exports_url": f"{np.base_url}/neuronpedia-datasets", "concurrency": 2,
                 "requests_per_hour": 10_000_000, "max_attempts": 2, "backoff": 0.01, "max_failed_fraction": 0.5}
        assert fetch_chunk(chunk, settings)["n_failed"] == len(LOST)
    night = ingest_fetched("w-night", settings, run_id="scheduled__2026-01-01T00:00:00+00:00", progress=False)
    out["night"] = Path(night.report_path)

    from pipeline.stages import validate

    def broken(*a, **kw):
        raise RuntimeError(LONG_ERROR)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(validate, "validate_batch", broken)
        page = write(root / "broken" / "p.json", orjson.dumps(_long_page(40)))
        with pytest.raises(RuntimeError, match="injected failure"):
            ingest([page], settings, progress=False, report_after=False, run_id=BROKEN_ID)
    out["broken"] = write_report(settings, BROKEN_ID)

    quiet = ingest([ROOT / "samples"], settings, progress=False, run_id="run-quiet")
    assert quiet.n_loaded == 0
    out["quiet"] = Path(quiet.report_path)
    out["index"] = settings.report_dir / "index.html"

    # `show --html`'s feature card: the samples' feature whose excerpts hold long runs of ␣-joined
    # tokens, and one of the long tokens above (a URL, 150 letters with no break)
    find.build_index(settings)
    for name, key in (("card", SAMPLES_FEATURE), ("card-long", f"{LONG_MODEL}/{LONG_SOURCE}/11")):
        out[name] = write(root / f"{name}.html", find.render_html(find.show(settings, key)).encode())

    # serve's /runs over the same runs, kept as a file (its CSS is inline: it lays out the same)
    from starlette.testclient import TestClient

    from pipeline.outputs import web

    with TestClient(web.make_app(settings), base_url="http://127.0.0.1") as client:
        answer = client.get("/runs")
        assert answer.status_code == 200, answer.text[:2000]
        out["serve-runs"] = write(root / "serve-runs.html", answer.content)
    out["settings"] = settings
    return out


def _text(fragment: str) -> str:
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", fragment)).split())


def _run(settings: Settings, run_id: str) -> dict:
    cols = ("n_received", "n_duplicates", "n_rejected", "n_features", "n_activations", "n_explanations",
            "n_quarantined", "n_expectations", "n_expectations_failed")
    row = query(settings, f"SELECT {', '.join(cols)} FROM runs WHERE run_id = ?", [run_id])[0]
    return dict(zip(cols, row))


# --- each count of failures, out of what -------------------------------------------------------

def test_each_count_of_failures_on_a_report_says_out_of_what(reports):
    run = _run(reports["settings"], "run-long")
    new = run["n_received"] - run["n_duplicates"]
    records = run["n_features"] + run["n_activations"] + run["n_explanations"] + run["n_quarantined"]
    assert run["n_rejected"] == 3 and run["n_quarantined"] == len(QUARANTINED) and run["n_expectations_failed"]
    page = reports["long"].read_text()

    def tile(key: str) -> str:
        return _text(re.search(rf'data-count="{key}"><div class="v">(.*?)</div>', page, re.S).group(1))

    assert tile("n_rejected") == f"3 of {new}"
    assert tile("n_quarantined") == f"{len(QUARANTINED)} of {records}"
    assert tile("n_expectations_failed") == f"{run['n_expectations_failed']} of {run['n_expectations']}"
    assert tile("n_fetch_failed") == "0"  # no URL was fetched: out of nothing
    hints = [_text(h) for h in re.findall(r'<span class="hint">(.*?)</span>\s*</div>', page, re.S)]
    assert any(h.startswith(f"3 of {new} input(s)") for h in hints), hints
    assert any(h.startswith(f"{len(QUARANTINED)} of {records} record(s)") for h in hints), hints
    counts = [_text(c) for c in re.findall(r'<span class="count">(.*?)</span></span>', page)]
    assert counts == [f"3 of {new}", f"{len(QUARANTINED)} of {records}"], counts
    failed_suite = _text(re.search(r'<span class="bad">(\d[^<]*<span class="of">[^<]*</span> failed)</span>', page).group(1))
    assert re.fullmatch(r"\d+ of \d+ failed", failed_suite), failed_suite
    assert f"{len(QUARANTINED)} of {records} record(s) quarantined" in page  # the verdict's reason

    night = reports["night"].read_text()
    fetched = 13  # every URL asked for: landed or lost
    assert _text(re.search(r'data-count="n_fetch_failed"><div class="v">(.*?)</div>', night).group(1)) \
        == f"{len(LOST)} of {fetched}"
    assert f"{len(LOST)} of {fetched} URL(s) failed after their retries" in _text(night)


def test_each_count_of_failures_on_the_index_and_the_trend_says_out_of_what(reports):
    run = _run(reports["settings"], "run-long")
    new = run["n_received"] - run["n_duplicates"]
    records = run["n_features"] + run["n_activations"] + run["n_explanations"] + run["n_quarantined"]
    index = reports["index"].read_text()
    row = re.search(r'<tr class="run" data-run="run-long">(.*?)</tr>', index, re.S).group(1)
    cells = [_text(c) for c in re.findall(r'<td class="n">(.*?)</td>', row, re.S)]
    # lost URLs, received, loaded, rejected, activations, quarantined, failed checks
    assert cells[0] == "0" and cells[3] == f"3 of {new}" and cells[5] == f"{len(QUARANTINED)} of {records}", cells
    assert cells[6] == f"{run['n_expectations_failed']} of {run['n_expectations']}", cells
    heads = [_text(h) for h in re.findall(r"<th[^>]*>(.*?)</th>", index.split("<tbody>")[0], re.S)]
    assert heads == ["verdict", "run", "why", "lost URLs", "received", "loaded", "rejected", "activations",
                     "quarantined", "failed checks"], heads
    # a night that lost URLs says how many of how many in a column of its own, not only in its why
    row = re.search(r'<tr class="run" data-run="scheduled__[^"]*">(.*?)</tr>', index, re.S).group(1)
    cells = [_text(c) for c in re.findall(r'<td class="n">(.*?)</td>', row, re.S)]
    assert cells[0] == f"{len(LOST)} of 13", cells

    quiet = reports["quiet"].read_text()
    trend = re.search(r'<tr class="trend-run"[^>]*><td[^>]*>run-long</td>(.*?)</tr>', quiet, re.S).group(1)
    cells = [_text(c) for c in re.findall(r'<td class="n">(.*?)</td>', trend, re.S)]
    assert cells[1:3] == [f"3 of {new}", f"{len(QUARANTINED)} of {records}"], cells


@pytest.mark.browser
def test_the_index_shows_each_runs_verdict_and_why_in_a_narrow_window(chromium, reports):
    """At 760 px the runs' table scrolls inside its card; what a reader needs first (the verdict,
    the run, why) lies in the window before any scrolling, the counts after it."""
    ctx = chromium.new_context(viewport={"width": 760, "height": 900})
    try:
        page = ctx.new_page()
        page.goto(reports["index"].as_uri())
        cells = page.evaluate("""() => [...document.querySelectorAll('tr.run td:nth-child(-n+3)')].map(e => {
            const r = e.getBoundingClientRect(), s = e.closest('.scroll').getBoundingClientRect();
            return {cls: e.className, text: e.innerText, left: r.left, right: r.right, box: s.right,
                    window: document.documentElement.clientWidth}; })""")
    finally:
        ctx.close()
    assert len(cells) == 3 * 5 and sum("why" in c["cls"] for c in cells) == 5, cells
    off = [c for c in cells if c["left"] < 0 or c["right"] > min(c["box"], c["window"]) + 0.5]
    assert not off, off


# --- failures in the order of their numbers ------------------------------------------------------

def test_failures_are_listed_in_the_order_of_their_numbers(reports):
    night = reports["night"].read_text()
    urls = [html.unescape(u) for u in re.findall(r'<tr class="fetch-failure"[^>]*><td[^>]*>([^<]+)</td>', night)]
    assert [int(u.rsplit("/", 1)[1]) for u in urls] == list(LOST), urls  # 9 before 10, not after

    page = reports["long"].read_text()
    keys = re.findall(r'<tr class="quarantined" data-check="[^"]*" data-key="([^"]*)">', page)
    assert [int(k.split("-")[-2]) for k in keys] == list(QUARANTINED), keys
    origins = [html.unescape(o) for o in re.findall(r'<tr class="rejected-input"><td[^>]*>([^<]+)</td>', page)]
    assert [Path(o).name for o in origins] == [f"export-{i}.txt" for i in (2, 9, 10)], origins
    row = re.search(r'<tr class="failed" data-expectation="activations.tokens_values_same_length">.*?</tr>', page, re.S)
    pills = [html.unescape(p) for p in re.findall(r'<span class="pill" title="([^"]*)">', row.group(0))]
    assert [int(p.split("-")[-2]) for p in pills] == list(QUARANTINED), pills


def test_the_failures_chosen_to_list_are_those_with_the_lowest_numbers():
    """Past the 50 listed, the rest are left to a query: the 50 are the lowest feature indices
    (or batch numbers), not the first in text order (0, 1, 10, 100, ...)."""
    import duckdb

    from pipeline.outputs.report_data import _by_number

    base = "http://127.0.0.1:8765/api/feature/gpt-oss-20b/11-resid-post-aa/"
    urls = [f"{base}{i}" for i in range(120)] + [f"http://x/v1/m/s/batch-{i}.jsonl.gz" for i in range(12)]
    conn = duckdb.connect()
    conn.execute("CREATE TABLE f AS SELECT unnest(?) AS url", [urls])
    chosen = [u for (u,) in conn.execute(f"""
        SELECT url FROM (SELECT *, regexp_extract(url, '[0-9]+[^0-9]*$') AS _tail FROM f)
        ORDER BY {_by_number("url")} LIMIT 50""").fetchall()]
    assert chosen == [f"{base}{i}" for i in range(50)]
    batches = [u for (u,) in conn.execute(f"""
        SELECT url FROM (SELECT *, regexp_extract(url, '[0-9]+[^0-9]*$') AS _tail FROM f WHERE url LIKE '%batch%')
        ORDER BY {_by_number("url")}""").fetchall()]
    assert batches == [f"http://x/v1/m/s/batch-{i}.jsonl.gz" for i in range(12)]


# --- in a browser --------------------------------------------------------------------------------



#: Each box a reader sees, with how far it reaches and how wide its content is; for a table, the
#: card it is in and the box that scrolls it (if any).
_MEASURE = """() => {
  const box = e => { const r = e.getBoundingClientRect(); return {left: r.left, right: r.right}; };
  const scroller = e => { for (let p = e.parentElement; p; p = p.parentElement) {
      if (['auto', 'scroll'].includes(getComputedStyle(p).overflowX)) return p; } return null; };
  const what = e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') + (e.className ? '.' + e.className : '');
  const boxes = [...document.querySelectorAll('main > *, section.card, table, pre, figure, .verdict, .group, .stat, .excerpt')]
    .map(e => { const s = e.tagName === 'TABLE' ? scroller(e) : null;
      return {what: what(e), ...box(e), scrollWidth: e.scrollWidth, clientWidth: e.clientWidth,
              scroller: s && what(s), scrollerBox: s && box(s)}; });
  return {page: document.documentElement.scrollWidth, window: document.documentElement.clientWidth, boxes};
}"""

PAGES = ("samples", "long", "night", "broken", "quiet", "index", "card", "card-long", "serve-runs")


@pytest.mark.browser
@pytest.mark.parametrize("width", [760, 1280])
@pytest.mark.parametrize("name", PAGES)
def test_nothing_is_wider_than_the_window(chromium, reports, name, width):
    ctx = chromium.new_context(viewport={"width": width, "height": 900})
    try:
        page = ctx.new_page()
        page.goto(reports[name].as_uri())
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"layout-{name}-{width}.png"), full_page=True)
        m = page.evaluate(_MEASURE)
    finally:
        ctx.close()
    window = m["window"]
    assert m["page"] <= window, f"the page scrolls sideways: {m['page']} px wide in {window}"
    wide = []
    for b in m["boxes"]:
        if b["what"].startswith("table") and b["scroller"] and b["scroller"].startswith("div.scroll") and width < 1024:
            # the index's runs at 760 px: a table that scrolls in a box of its own, inside the window
            reach = b["scrollerBox"]
        else:
            reach = b
        if reach["left"] < -0.5 or reach["right"] > window + 0.5:
            wide.append(b)
        elif b["what"].startswith(("section.card", "div.excerpt")) and b["scrollWidth"] > b["clientWidth"] + 1:
            wide.append(b)  # the card (the excerpt) holds something wider than itself: it would scroll (run past)
    assert not wide, f"at {width} px: {wide}"


#: Each cell of serve's runs, its text and where its lines break (the index in the text of each
#: line's first character), read character by character.
_LINES = """() => [...document.querySelectorAll('table tr[data-nav] > td')].map(td => {
  const text = [], tops = [];
  const walk = document.createTreeWalker(td, NodeFilter.SHOW_TEXT);
  for (let n = walk.nextNode(); n; n = walk.nextNode()) {
    for (let i = 0; i < n.length; i++) {
      const r = document.createRange(); r.setStart(n, i); r.setEnd(n, i + 1);
      const rect = [...r.getClientRects()].find(q => q.width > 0);
      text.push(n.data[i]); tops.push(rect ? rect.top : null);
    }
  }
  const breaks = []; let top = null;
  tops.forEach((t, i) => { if (t === null) return; if (top !== null && t > top + 2) breaks.push(i); top = t; });
  return {cls: td.className, text: text.join(''), breaks};
})"""


@pytest.mark.browser
@pytest.mark.parametrize("width", [760, 1280])
def test_serves_runs_break_no_word(chromium, reports, width):
    """serve's /runs: a status, a verdict's badge and a count each on one line ("N of M" whole); a
    run id wraps only after a '-' or a 'T' (its date from its time); the start time between its
    date and its time; why between words (inside one only if the word alone is wider than the
    column: a path in an error)."""
    ctx = chromium.new_context(viewport={"width": width, "height": 900})
    try:
        page = ctx.new_page()
        page.goto(reports["serve-runs"].as_uri())
        cells = page.evaluate(_LINES)
        heads = page.evaluate("[...document.querySelectorAll('table th')].map(e => e.innerText)")
    finally:
        ctx.close()
    assert len(cells) == 5 * len(heads), heads
    bad = []
    for k, c in enumerate(cells):
        t, column = c["text"], heads[k % len(heads)]
        for i in c["breaks"]:
            if column == "run":
                ok = t[i - 1] in "-T"
            elif column == "started":  # between its date and its time
                ok = t[i - 1].isspace() or t[i].isspace()
            elif column == "why":
                word = t[:i].split()[-1:] + t[i:].split()[:1]
                ok = t[i - 1].isspace() or t[i].isspace() or t[i - 1] in "-/" or len("".join(word)) > 40
            else:
                ok = False
            if not ok:
                bad.append((column, t[max(0, i - 12):i] + "|" + t[i:i + 12]))
    assert not bad, f"at {width} px, broken inside a word: {bad}"


def test_serves_runs_say_each_count_of_failures_out_of_what(reports):
    """serve's /runs writes each failure count as the report and `status` do (report.out_of's
    formulas), with a column for the URLs a night lost."""
    page = reports["serve-runs"].read_text()
    heads = [_text(h) for h in re.findall(r"<th[^>]*>(.*?)</th>", page, re.S)]

    def cells(run_id: str) -> dict[str, str]:
        row = re.search(rf'<tr id="{re.escape(run_id)}" data-nav>(.*?)</tr>', page, re.S).group(1)
        return dict(zip(heads, [_text(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]))

    run = _run(reports["settings"], "run-long")
    new = run["n_received"] - run["n_duplicates"]
    records = run["n_features"] + run["n_activations"] + run["n_explanations"] + run["n_quarantined"]
    long = cells("run-long")
    assert (long["rejected"], long["quarantined"], long["failed checks"], long["lost URLs"]) == (
        f"3 of {new}", f"{len(QUARANTINED)} of {records}",
        f"{run['n_expectations_failed']} of {run['n_expectations']}", "0"), long
    night = cells("scheduled__2026-01-01T00:00:00+00:00")
    assert night["lost URLs"] == f"{len(LOST)} of 13" and night["verdict"] in ("WARN", "FAIL"), night
