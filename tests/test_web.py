"""featurehouse serve, driven in a real browser: Playwright drives the system's Chromium (apt's,
as `.ci/run` installs it) against `featurehouse serve` running as its own process on loopback.

Search, open a feature, follow a nearest-feature link, read a token's activation, run a SQL
query and download it, and a hostile page whose text would run script if it were not escaped.
Screenshots of each view go to build/screenshots/ (kept as the run's artefacts)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from pipeline.config import Settings
from tests.conftest import SEED_FLIGHT, good_page, query, run_ingest, write

pytestmark = pytest.mark.xdist_group("web")
ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "build" / "screenshots"
HOSTILE = "<script>window.__pwned = 1</script><img src=x onerror=\"window.__pwned = 2\">"
ODD_MODEL, ODD_SOURCE = "lab/gpt 2%?", "3-res/16k α"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(warehouse: Path, **env: str) -> tuple[subprocess.Popen, int]:
    """`featurehouse serve` of ``warehouse`` on a free port, returned once it answers (with ``env``
    beside the test's environment); one that does not start fails the test with its stderr."""
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--warehouse", str(warehouse),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, **env})
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"serve did not start: {proc.communicate()[1][-2000:]}") from None
            time.sleep(0.1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("web")
    settings = Settings(warehouse=root / "wh")
    pages = [write(root / "in" / f"{i}.json", orjson.dumps(good_page(i))) for i in (1, 2, 3)]
    hostile = good_page(4)
    hostile["explanations"][0]["description"] = f"cpu {HOSTILE}"
    hostile["activations"][0]["tokens"][1] = HOSTILE
    pages.append(write(root / "in" / "4.json", orjson.dumps(hostile)))
    # ids holding a slash, a percent sign, a question mark and a space (review: /f/MODEL/SOURCE/INDEX
    # took the parts from the decoded path, so a%2Fb was two parts and the page a 404)
    pages.append(write(root / "in" / "5.json", orjson.dumps(good_page(5, model=ODD_MODEL, source=ODD_SOURCE))))
    run_ingest(sorted((ROOT / "samples").iterdir()) + pages, settings)
    subprocess.run([sys.executable, "-m", "pipeline.cli", "index", "--warehouse", str(settings.warehouse)],
                   check=True, capture_output=True)
    proc, port = _serve(settings.warehouse)
    yield settings, f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=20)




@pytest.fixture
def page(chromium):
    ctx = chromium.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    pg = ctx.new_page()
    dialogs: list[str] = []
    pg.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    pg.dialogs = dialogs
    yield pg
    ctx.close()


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_search_open_a_feature_and_follow_a_similar_link(served, page):
    settings, base = served
    page.goto(base + "/")
    shot(page, "home")
    page.keyboard.press("/")  # focuses the search box
    assert page.evaluate("document.activeElement.id") == "q"
    page.keyboard.type("cpu")
    page.keyboard.press("Enter")
    page.wait_for_url("**/search?q=cpu")
    results = page.locator("ol.results li[data-nav]")
    assert results.count() >= 4
    shot(page, "search")
    page.keyboard.press("j")
    page.keyboard.press("Enter")
    page.wait_for_url("**/f/**")
    assert page.locator("h1").inner_text().startswith("Feature ")
    tokens = page.locator(".excerpt .tok[data-activation]")
    assert tokens.count() > 0
    # each shaded token carries its value: in its data attribute and its tooltip, and the peak is outlined
    first_peak = page.locator(".excerpt .tok.peak").first
    value = float(first_peak.get_attribute("data-activation"))
    assert value > 0 and first_peak.get_attribute("title") == f"{value:.3g}"
    assert "rgba(255, 120, 0" in first_peak.get_attribute("style")
    # each bar of the histogram says its range of peaks, the first from nothing, the last to the top
    bars = [b.get_attribute("title") for b in page.locator(".bars div").all()]
    assert len(bars) == 10 and " peaking up to " in bars[0] and all(" peaking from " in b for b in bars[1:]), bars
    assert bars[-1].endswith(page.locator(".bars-axis span").last.inner_text()), bars
    shot(page, "feature")
    # a feature with neighbours (the small pages share their top tokens), opened from the results
    page.go_back()
    page.click('ol.results a[href="/f/gpt-oss-20b/11-resid-post-aa/1"]')
    page.wait_for_url("**/f/gpt-oss-20b/11-resid-post-aa/1")
    here = page.url
    link = page.locator("table.neighbours a").first
    target = link.get_attribute("href")
    link.click()
    page.wait_for_url("**" + target)
    assert page.url != here and page.locator("h1").inner_text().startswith("Feature ")
    page.goto(page.url + "/history")
    assert "Versions of" in page.locator("h1").inner_text()


def test_the_samples_feature_shows_leading_spaces_and_its_source(served, page):
    settings, base = served
    page.goto(base + "/f/gpt-oss-20b/11-resid-post-aa/45698")
    text = page.locator(".excerpt").first.inner_text()
    assert "␣" in text  # tokens with a leading space are told apart
    page.locator("a", has_text="gpt-oss-20b/11-resid-post-aa").first.click()
    page.wait_for_url("**/s/gpt-oss-20b/11-resid-post-aa")
    assert page.locator("table.features tr[data-nav]").count() >= 1
    page.goto(page.url + "?sort=max")
    shot(page, "source")
    page.goto(base + "/runs")
    assert page.locator("span.badge").count() >= 1
    shot(page, "runs")


def test_sql_runs_reads_only_and_downloads(served, page):
    settings, base = served
    page.goto(base + "/sql")
    page.fill("textarea[name=q]", "SELECT count(*) AS n FROM features")
    page.click("main form button")
    page.wait_for_url("**/sql?q=*")
    n = query(settings, "SELECT count(*) FROM features")[0][0]
    assert page.locator("table.result td").first.inner_text() == str(n)
    shot(page, "sql")
    with page.expect_download() as dl:
        page.click("text=CSV")
    assert Path(dl.value.path()).read_text().splitlines() == ["n", str(n)]
    page.goto(base + "/sql?q=" + "DROP TABLE features")
    assert "refused" in page.locator("#sql-error").inner_text()
    assert query(settings, "SELECT count(*) FROM features")[0][0] == n


def test_hostile_text_is_shown_never_run(served, page):
    settings, base = served
    page.goto(base + "/search?q=cpu")
    assert HOSTILE in page.locator("ol.results").inner_text()
    page.goto(base + "/f/gpt-oss-20b/11-resid-post-aa/4")
    assert HOSTILE in page.locator("ul.explanations").inner_text()
    assert page.evaluate("window.__pwned") is None and not page.dialogs
    assert page.locator("img[src=x]").count() == 0


def test_serve_refuses_what_is_not_a_warehouse_and_warns_off_loopback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "serve", "--warehouse", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "no warehouse" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "none").exists()


def test_serve_warns_when_it_listens_beyond_loopback(served):
    settings, _ = served
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--warehouse", str(settings.warehouse),
                             "--host", "0.0.0.0", "--port", str(_port())], stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert first.startswith("warning: listening on 0.0.0.0") and "no login" in first


def test_pages_answer_404_for_what_is_not_there(served, page):
    settings, base = served
    for path in ("/f/nope/nope/1", "/s/nope/nope", "/nothing-here"):
        r = page.goto(base + path)
        assert r.status == 404 and "Not found" in page.locator("h1").inner_text(), path


def test_what_an_outside_review_broke_answers_as_a_page(served):
    """Found from outside: a foreign Host header (DNS rebinding) was served; a query starting with
    `-` was read as an option by the sql child; a huge page number, a NUL token, an unknown run
    gave 500s or an empty 200."""
    import urllib.error
    import urllib.parse
    import urllib.request

    settings, base = served

    def get(path: str, host: str | None = None) -> tuple[int, str]:
        req = urllib.request.Request(base + path, headers={"Host": host} if host else {})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    assert get("/", host="evil.example.com:80")[0] == 400
    assert get("/", host="localhost")[0] == 200
    status, body = get("/sql?q=" + urllib.parse.quote("--help"))
    assert status == 200 and "Usage" not in body  # a comment: it runs nothing, and is no option
    status, body = get("/sql?q=" + urllib.parse.quote("-- a note\nSELECT 42 AS answer"))
    assert status == 200 and "<td class=\"small\"><bdi>42</bdi></td>" in body
    status, body = get("/s/gpt-oss-20b/11-resid-post-aa?page=99999999999999999999")
    assert status == 200 and "page 1 of 1" in body
    assert get("/by-token?t=%00")[0] == 200
    assert get("/runs/no-such-run/quarantine")[0] == 404


# --- a PostgreSQL catalog that stops under the server ------------------------------------------


def _get(base: str, path: str) -> tuple[int, str, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(base + path, timeout=60) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


@pytest.mark.postgres
def test_a_postgresql_catalog_that_stops_is_a_503_page_never_its_password(tmp_path):
    """Review 41 B1: with the catalog's PostgreSQL stopped, every page was a 500 whose body held
    DuckDB's IOException, which echoes the libpq string, password and all, and the server's log
    two tracebacks a request with it. Now: a 503 page of one line naming the server and what to
    do, the same line in the log, no traceback; the pages answer again once it is started."""
    import re

    from pipeline.lake import warehouse as wh
    from tests.airflow_helpers import _as_postgres, pg_bin, postgres_cluster
    from tests.test_lakehouse import _stop_postgres

    if pg_bin() is None:
        pytest.fail("PostgreSQL is not installed: .ci/run installs it (apt-get install postgresql)")
    secret = "Sekr3t-pw_XYZ"
    with postgres_cluster(password=secret) as pg:
        settings = Settings(warehouse=tmp_path / "wh", catalog=pg.catalog)
        wh.connect(settings, create=True).close()  # an empty warehouse: the pages need no rows to fail
        proc, port = _serve(settings.warehouse, FEATUREHOUSE_CATALOG=pg.catalog)
        base = f"http://127.0.0.1:{port}"
        try:
            assert _get(base, "/")[0] == 200
            pg_port = re.search(r"port=(\d+)", pg.catalog)[1]
            data = next(p.parent for p in Path("/tmp").glob("featurehouse-pg-*/data/postmaster.pid")
                        if p.read_text().splitlines()[3].strip() == pg_port)
            _stop_postgres(pg.catalog)
            answers = {path: _get(base, path) for path in ("/", "/runs", "/search?q=cpu", "/sql?q=SELECT%201")}
            # started again: the kept connections answer again, nothing to restart
            subprocess.run(_as_postgres([str(pg_bin() / "pg_ctl"), "-D", str(data), "-l", str(data.parent / "log"),
                                         "-o", f"-p {pg_port} -k {data.parent / 'sock'} -c listen_addresses=127.0.0.1",
                                         "-w", "start"]), check=True, capture_output=True, timeout=60)
            again = _get(base, "/")[0]
        finally:
            proc.terminate()
            _, log = proc.communicate(timeout=20)
    for path, (status, body, headers) in answers.items():
        assert status == 503 and headers.get("retry-after") == "30", (path, status, body[-2000:])
        assert secret not in body and "IOException" not in body, (path, body)
        assert "The catalog does not answer" in body and f"PostgreSQL catalog (127.0.0.1:{pg_port}, database " \
               "featurehouse) does not answer" in body and "Start PostgreSQL" in body, (path, body)
    assert again == 200
    assert secret not in log and "Traceback" not in log, log[-3000:]
    assert log.count("does not answer") == len(answers), log


def test_a_failure_is_a_page_of_one_line_and_a_log_without_the_password(tmp_path, monkeypatch, caplog):
    """Review 41 B1: any other error's words, on the page and in the log, pass through the
    password's redaction; Starlette's handler raised the error again for uvicorn to log it
    whole: it goes no further than the page now."""
    import logging

    from starlette.testclient import TestClient

    from pipeline.outputs import find, web

    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([SEED_FLIGHT], settings)

    def broken(*args, **kwargs):
        raise RuntimeError("could not reach postgres:dbname=x host=db password='Sekr 3t' nor "
                           "postgresql://fh:Sekr3t@db:5432/x\nsecond line")

    monkeypatch.setattr(find, "show", broken)
    with caplog.at_level(logging.WARNING, logger="pipeline.outputs.web"), TestClient(web.make_app(settings), base_url="http://127.0.0.1") as client:
        r = client.get("/f/gpt-oss-20b/11-resid-post-aa/45698")
    assert r.status_code == 500 and "Could not answer" in r.text
    assert "RuntimeError: could not reach postgres:dbname=x host=db password=***" in r.text
    assert "Sekr" not in r.text and "second line" not in r.text
    logged = "\n".join(rec.getMessage() + (str(rec.exc_info) if rec.exc_info else "") for rec in caplog.records)
    assert "Traceback" in logged and "fh:***@db:5432" in logged and "Sekr" not in logged, logged


def test_ids_holding_a_slash_or_a_percent_sign_have_their_pages(served, page):
    """A model or source id may hold '/', '%', '?', a space: each link quotes every part whole,
    and the app takes each part whole from the raw path (the decoded one cut 'lab%2Fgpt' in two)."""
    import urllib.error
    import urllib.request
    from urllib.parse import quote

    settings, base = served
    m, s = quote(ODD_MODEL, safe=""), quote(ODD_SOURCE, safe="")
    for path, says in ((f"/f/{m}/{s}/5", "Feature "), (f"/f/{m}/{s}/5/history", ODD_MODEL),
                       (f"/s/{m}/{s}", ODD_SOURCE)):
        with urllib.request.urlopen(base + path, timeout=30) as r:
            assert r.status == 200 and says in r.read().decode(), path
    for path in (f"/f/{m}/{s}/x5", f"/f/{m}/5", f"/s/{m}", f"/f/{m}/{s}/5/extra"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + path, timeout=30)
        assert err.value.code == 404, path
    page.goto(base + f"/s/{m}/{s}")  # the source page's feature links lead to the feature, in a browser
    page.locator(f'a[href="/f/{m}/{s}/5"]').first.click()
    page.wait_for_url(f"**/f/{m}/{s}/5")
    assert page.locator("h1").inner_text().startswith("Feature ")
    page.locator(f'a[href="/f/{m}/{s}/5/history"]').click()
    assert ODD_MODEL in page.content()


@pytest.mark.parametrize("peaks", [
    [], [None], [0.0, 0.0], [-1.0, -0.5], [1.0], [0.05, 0.1, 0.15, 0.5, 0.99, 1.0, None, -0.2],
    [3.14159, 2.0, 0.31415, 0.0, 1e-9], [float(i) for i in range(37)],
])
def test_a_feature_pages_histogram_counts_as_the_sql_it_replaced(peaks):
    """The feature page's histogram of its excerpts' peaks comes from the one read of its
    excerpts (a second scan of activations cost ~20 ms a page at 262k): the counts the SQL gave."""
    import duckdb

    from pipeline.outputs.web import _bins

    with duckdb.connect() as c:
        c.execute("CREATE TABLE a (max_value DOUBLE)")
        for v in peaks:
            c.execute("INSERT INTO a VALUES (?)", [v])
        rows = c.execute("""SELECT least(9, floor(max_value * 10 / m))::INT AS bin, count(*) AS n
                            FROM a, (SELECT max(max_value) AS m FROM a) mx
                            WHERE m > 0 AND max_value IS NOT NULL GROUP BY ALL ORDER BY 1""").fetchall()
    want = [0] * 10
    for b, n in rows:
        want[max(0, b)] += n
    assert _bins(peaks) == want


def test_the_footer_gives_the_snapshots_time_in_utc_whatever_the_servers_zone(served):
    """Found from outside: a server in another zone wrote its local time, labelled UTC."""
    import datetime
    import re
    import urllib.request

    from pipeline.lake import warehouse as wh

    settings, _ = served
    proc, port = _serve(settings.warehouse, TZ="Asia/Tokyo")
    try:
        for path in ("/", "/f/gpt-oss-20b/11-resid-post-aa/1"):
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60).read().decode()
            sid, shown = re.search(r"warehouse snapshot (\d+) \(([^)]*)\)", body).groups()
            with wh.connect(settings, read_only=True) as conn:
                (t,) = conn.execute(f"SELECT snapshot_time FROM {wh.CATALOG}.snapshots() WHERE snapshot_id = ?",
                                    [int(sid)]).fetchone()
            want = (t.astimezone(datetime.timezone.utc) if t.tzinfo else t).strftime("%Y-%m-%d %H:%M:%S UTC")
            assert shown == want, (path, shown, want)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_a_feature_page_answers_from_the_lake_when_the_find_index_goes_away(tmp_path, caplog):
    """The card comes from the find index while it is current; moved away or replaced by a file
    that is no index under a running server, a feature page still answers (the card from the
    lake, a note where the nearest features were), never a 500; built again, the index answers
    again. A failure of the nearest features is logged without the catalog's password."""
    import logging
    import shutil

    from starlette.testclient import TestClient

    from pipeline.outputs import find, web

    settings = Settings(warehouse=tmp_path / "wh")
    run_ingest([write(tmp_path / "in" / f"{i}.json", orjson.dumps(good_page(i))) for i in (1, 2, 3)], settings)
    find.build_index(settings)
    index = settings.find_index_dir / "index.duckdb"
    path = "/f/gpt-oss-20b/11-resid-post-aa/2"
    with TestClient(web.make_app(settings), base_url="http://127.0.0.1") as client:
        first = client.get(path)
        assert first.status_code == 200 and "cpu things" in first.text and "Nearest features" in first.text
        shutil.move(index, tmp_path / "away.duckdb")
        gone = client.get(path)
        index.write_bytes(b"no index at all" * 100)
        garbage = client.get(path)
        index.unlink()
        find.build_index(settings)
        again = client.get(path)
    for r in (gone, garbage):
        assert r.status_code == 200, r.text[-2000:]
        assert "cpu things" in r.text and 'class="note"' in r.text, r.text[-2000:]
    assert again.status_code == 200 and "cpu things" in again.text

    # the nearest features failing after the card was sent: a note, a log line, no password
    def broken(*args, **kwargs):
        raise RuntimeError("the index went: postgresql://fh:Sekr3t@db:5432/x\nsecond line")

    app = web.make_app(settings)
    with caplog.at_level(logging.WARNING, logger="pipeline.outputs.web"), TestClient(app, base_url="http://127.0.0.1") as client:
        real = find.Finder.similar
        find.Finder.similar = broken
        try:
            r = client.get(path)
        finally:
            find.Finder.similar = real
    assert r.status_code == 200 and "cpu things" in r.text and "the nearest features could not be read" in r.text
    assert "Sekr3t" not in r.text
    logged = "\n".join(rec.getMessage() + (str(rec.exc_info) if rec.exc_info else "") for rec in caplog.records)
    assert "fh:***@db:5432" in logged and "Sekr3t" not in logged, logged


@pytest.mark.postgres
def test_a_long_lived_finder_on_a_postgresql_catalog_never_shows_a_card_older_than_the_lake(tmp_path, monkeypatch):
    """A PostgreSQL catalog has no file to watch: a kept Finder (serve's) cannot tell a commit
    happened by a stamp. The card comes from the index only when the index was built at the
    lake's latest snapshot; after a load that did not refresh it, from the lake."""
    from pipeline.lake import warehouse as wh
    from pipeline.outputs import find
    from tests.airflow_helpers import pg_bin, postgres_cluster

    if pg_bin() is None:
        pytest.fail("PostgreSQL is not installed: .ci/run installs it (apt-get install postgresql)")
    with postgres_cluster() as pg:
        settings = Settings(warehouse=tmp_path / "wh", catalog=pg.catalog)
        run_ingest([write(tmp_path / "in" / f"{i}.json", orjson.dumps(good_page(i))) for i in (1, 2)], settings)
        find.build_index(settings)
        key = ("gpt-oss-20b", "11-resid-post-aa", 2)
        with find.Finder(settings) as kept, wh.connect(settings, read_only=True) as lake:
            before = find.show(settings, key, n_neighbours=0, lake=lake, finder=kept)
            assert before.extra["from"] == "index"
            changed = good_page(2)
            changed["explanations"][0]["description"] = "rewritten while the index slept"
            monkeypatch.setenv("FEATUREHOUSE_FIND_DIR", str(tmp_path / "elsewhere"))  # no refresh of this index
            run_ingest([write(tmp_path / "in2" / "2.json", orjson.dumps(changed))],
                       Settings(warehouse=tmp_path / "wh", catalog=pg.catalog, find_dir=tmp_path / "elsewhere"))
            after = find.show(settings, key, n_neighbours=0, lake=lake, finder=kept)
    assert after.extra["from"] == "lake", after.extra
    assert [e["description"] for e in after.explanations] == ["rewritten while the index slept"]
    assert after.extra["snapshot"]["id"] > before.extra["snapshot"]["id"]
