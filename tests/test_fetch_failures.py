"""A fetch that failed wholly or mostly is not a green night: the fetch chunk raises (its
Airflow task fails and is retried), the ingest still loads what landed and records the failures,
and the run's report is not PASS and lists them, escaped. Against real loopback servers: a port
nobody listens on, the fake Neuronpedia with failing URLs, and a proxy answering HTML 502s."""

from __future__ import annotations

import html
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline.sources.fetch import ingest_fetched
from pipeline.sources.night import FetchChunkFailed, fetch_chunk, too_many_failed
from tests.fake_neuronpedia import FakeNeuronpedia, feature_path
from tests.fetch_support import MODEL, SOURCE, pages, query, settings_in


def closed_port() -> int:
    """A loopback port nothing listens on: connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chunk(base_url: str, window: str, start: int = 0, stop: int = 3, **kw) -> dict:
    return {"model": MODEL, "source": SOURCE, "via": "api", "start": start, "stop": stop, "window": window,
            "base_url": base_url, "exports_url": f"{base_url}/neuronpedia-datasets", "concurrency": 2,
            "requests_per_hour": 10_000_000, "max_attempts": 2, "backoff": 0.01, "max_failed_fraction": 0.5} | kw


def test_a_chunk_against_a_closed_port_fails_and_the_run_says_so(tmp_path):
    settings = settings_in(tmp_path)
    base = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(FetchChunkFailed) as exc:
        fetch_chunk(chunk(base, "w-closed"), settings)
    msg = str(exc.value)
    assert f"{MODEL}/{SOURCE} features 0:3 (window w-closed): 3 of 3 URL(s) failed" in msg
    assert "(2 attempts): ConnectionError" in msg and base in msg

    # the ingest task still runs (trigger_rule all_done): nothing to load, the failures recorded
    summary = ingest_fetched("w-closed", settings, run_id="r-closed", progress=False)
    assert summary.status == "succeeded" and summary.n_received == 0
    rows = query(settings, "SELECT url, status, attempts FROM fetch_failures WHERE run_id = 'r-closed' ORDER BY url")
    assert rows == [(f"{base}/api/feature/{MODEL}/{SOURCE}/{i}", "failed", 2) for i in range(3)]

    page = Path(summary.report_path).read_text()
    assert '<div class="verdict FAIL" id="verdict">' in page and "Decided by rule 4" in page
    assert "3 of 3 URL(s) failed to fetch (all)" in page
    listed = re.findall(r'<tr class="fetch-failure" data-status="failed"><td[^>]*>([^<]+)</td>.*?<td class="n">(\d+)</td>'
                        r'<td[^>]*>([^<]*)</td>', page)
    assert [(u, int(n)) for u, n, _ in listed] == [(u, n) for u, _, n in rows]
    assert all(e.startswith("ConnectionError") for _, _, e in listed)
    index = (settings.report_dir / "index.html").read_text()
    assert re.search(r'data-run="r-closed">\s*<td><span class="badge FAIL">', index)


def test_an_exports_chunk_whose_listing_fails_fails(tmp_path):
    base = f"http://127.0.0.1:{closed_port()}"
    c = chunk(base, "w-exp", via="exports", batches=None)
    with pytest.raises(FetchChunkFailed, match=r"exports batches all \(window w-exp\): 1 of 1 URL\(s\) failed"):
        fetch_chunk(c, settings_in(tmp_path))


@pytest.mark.parametrize(
    "n_failing, fraction, fails",
    [(0, 0.5, False), (1, 0.5, False), (2, 0.5, True), (3, 0.5, True), (4, 0.5, True),
     (3, 1.0, False), (4, 1.0, True), (1, 0.0, True), (1, 0.3, False)],
)
def test_the_share_of_failed_urls_decides(tmp_path, n_failing, fraction, fails):
    with FakeNeuronpedia(pages=pages(4), always={feature_path(i): "503" for i in range(n_failing)}) as np:
        c = chunk(np.base_url, "w", 0, 4, max_failed_fraction=fraction)
        if fails:
            with pytest.raises(FetchChunkFailed, match=rf"{n_failing} of 4 URL\(s\) failed.*HTTP 503"):
                fetch_chunk(c, settings_in(tmp_path))
        else:
            assert fetch_chunk(c, settings_in(tmp_path))["n_failed"] == n_failing


def test_features_neuronpedia_does_not_have_are_not_failures(tmp_path):
    with FakeNeuronpedia(pages=pages(2)) as np:
        result = fetch_chunk(chunk(np.base_url, "w", 10, 14), settings_in(tmp_path))
    assert (result["n_not_found"], result["n_failed"]) == (4, 0)


def test_a_retried_chunk_asks_only_for_what_failed_and_passes_once_it_lands(tmp_path):
    settings = settings_in(tmp_path)
    with FakeNeuronpedia(pages=pages(4), always={feature_path(i): "503" for i in range(4)}) as np:
        with pytest.raises(FetchChunkFailed):
            fetch_chunk(chunk(np.base_url, "w-retry", 0, 4), settings)
        np.set_faults()  # the site is back
        result = fetch_chunk(chunk(np.base_url, "w-retry", 0, 4), settings)
    assert (result["n_requested"], result["n_landed"], result["n_failed"]) == (4, 4, 0)


@pytest.mark.parametrize("n, fails", [(0, False), (1, True), (10, True)])
def test_too_many_failed_counts_a_failed_listing_as_a_request(n, fails):
    assert too_many_failed(n, 0, 0.5) is fails


class _BadGateway(BaseHTTPRequestHandler):
    """A proxy in front of the site that answers every request with its own HTML error page."""

    BODY = b"<html><head><title>502 Bad Gateway</title></head><body><!-- x --><script>alert(1)</script></body></html>"

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(502)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(self.BODY)))
        self.end_headers()
        self.wfile.write(self.BODY)

    def log_message(self, *args):
        pass


def test_the_report_lists_fetch_failures_escaped(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BadGateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings = settings_in(tmp_path)
    try:
        with pytest.raises(FetchChunkFailed, match="HTTP 502"):
            fetch_chunk(chunk(f"http://127.0.0.1:{server.server_address[1]}", "w-502", 0, 2), settings)
    finally:
        server.shutdown()
        server.server_close()
    summary = ingest_fetched("w-502", settings, run_id="r-502", progress=False)
    raw = Path(summary.report_path).read_text()
    assert "<title>502" not in raw and "<script>alert" not in raw and "<!-- x" not in raw
    rows = re.findall(r'<tr class="fetch-failure".*?</tr>', raw, re.S)
    assert len(rows) == 2
    assert all("HTTP 502: <html><head><title>502 Bad Gateway</title>" in html.unescape(r) for r in rows)
    assert '<footer>' in raw


# --- a source Neuronpedia does not have (issue 20) ------------------------------------------------


@pytest.mark.parametrize("start, stop", [(0, 3), (5, 8)])
def test_a_source_that_does_not_exist_fails_its_fetch_and_the_night(tmp_path, start, stop):
    """Every URL a 404, and so is the source's feature 0: no such source. The chunk fails (not
    retried: a ConfigError), the reason is kept in fetch_failures and the verdict is FAIL."""
    from pipeline.outputs.report import recent_runs
    from pipeline.sources.plan import ConfigError, SourceNotFound
    from tests.conftest import open_warehouse

    settings = settings_in(tmp_path)
    with FakeNeuronpedia(pages=pages(10)) as np:
        c = chunk(np.base_url, "w-typo", start, stop, source="11-resid-post-ab")
        with pytest.raises(SourceNotFound) as exc:
            fetch_chunk(c, settings)
    assert isinstance(exc.value, ConfigError)
    msg = str(exc.value)
    assert f"{MODEL}/11-resid-post-ab" in msg and f"all {stop - start} feature(s) asked for" in msg
    assert "feature 0" in msg and "no such source" in msg

    summary = ingest_fetched("w-typo", settings, run_id="r-typo", progress=False, report_after=False)
    assert summary.n_received == 0
    rows = query(settings, "SELECT status, last_error FROM fetch_failures WHERE run_id = 'r-typo' AND status = 'failed'")
    assert len(rows) == 1 and "no such source" in rows[0][1]
    with open_warehouse(settings.warehouse) as conn:
        (run,) = recent_runs(conn)
    assert run["verdict"].level == "FAIL"


def test_a_range_past_the_end_of_a_source_that_exists_is_not_a_failure(tmp_path):
    with FakeNeuronpedia(pages=pages(4)) as np:
        result = fetch_chunk(chunk(np.base_url, "w-past", 10, 12), settings_in(tmp_path))
        assert np.count(feature_path(0)) == 1  # asked once whether the source exists
    assert (result["n_not_found"], result["n_failed"]) == (2, 0)


@pytest.mark.parametrize("batches, reason", [(None, "is empty"), ([7, 9], "is a batch numbered 7:9")])
def test_an_exports_source_with_nothing_to_fetch_fails(tmp_path, batches, reason):
    from pipeline.sources.plan import SourceNotFound

    with FakeNeuronpedia(pages=pages(4), batch_features=8) as np:
        source = "no-such-sae" if batches is None else SOURCE
        c = chunk(np.base_url, "w-exp-none", via="exports", batches=batches, source=source,
                  exports_url=np.exports_url)
        with pytest.raises(SourceNotFound, match=reason) as exc:
            fetch_chunk(c, settings_in(tmp_path))
    assert f"v1/{MODEL}/{source}/" in str(exc.value)


def test_all_features_of_a_source_that_has_none_fails(tmp_path):
    from pipeline.sources.plan import SourceNotFound

    with FakeNeuronpedia(pages=pages(4)) as np:
        c = chunk(np.base_url, "w-all-none", via="api", all=True, source="no-such-sae")
        with pytest.raises(SourceNotFound, match="features-offset has no feature"):
            fetch_chunk(c, settings_in(tmp_path))


def test_the_task_log_names_each_lost_url_with_the_count_so_far_and_the_progress(tmp_path, caplog, monkeypatch):
    """Issue 45: a night that lost half its URLs said nothing at WARNING in its task log, and a
    long fetch was silent for minutes (the progress bar is off where there is no terminal)."""
    import logging

    from pipeline.sources import fetch as fetch_mod
    from pipeline.sources.fetch import fetch_features
    from tests.fake_neuronpedia import FakeNeuronpedia, feature_path
    from tests.fetch_support import FAST, MODEL, SOURCE, pages, settings_in

    monkeypatch.setattr(fetch_mod, "LOG_EVERY", 0.0)
    lost = {feature_path(i): "503" for i in (1, 3, 5)}
    with FakeNeuronpedia(pages=pages(8), always=lost) as np, caplog.at_level(logging.INFO, "featurehouse.fetch"):
        result = fetch_features(MODEL, SOURCE, range(8), settings=settings_in(tmp_path), base_url=np.base_url,
                                concurrency=1, max_attempts=2, **FAST)
    assert result.n_failed == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "lost " in r.getMessage()]
    assert len(warnings) == 3 and "3 of 8 URL(s) lost so far" in warnings[-1], warnings
    progress = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and " done in " in r.getMessage()]
    assert progress and "8 of 8 done" in progress[-1], progress


def _fetch_log(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "featurehouse.fetch"]


def test_a_chunk_that_lost_urls_under_the_share_ends_its_log_with_one_warning_saying_how_many(tmp_path, caplog):
    """12 of 25 lost (48%, under 0.5): the task succeeds, and its log's last line from the fetch
    is one WARNING counting what the chunk lost; a chunk that lost nothing says none."""
    import logging

    lost = {feature_path(i): "503" for i in range(0, 24, 2)}
    with FakeNeuronpedia(pages=pages(25), always=lost) as np, caplog.at_level(logging.INFO, "featurehouse.fetch"):
        result = fetch_chunk(chunk(np.base_url, "w-some", 0, 25, max_attempts=1), settings_in(tmp_path))
        assert result["n_failed"] == 12
        logged = _fetch_log(caplog)
        caplog.clear()
        fetch_chunk(chunk(np.base_url, "w-none", 25, 30, max_attempts=1), settings_in(tmp_path))
        quiet = _fetch_log(caplog)
    summaries = [m for _, m in logged if "in this chunk" in m]
    assert summaries == [f"{MODEL}/{SOURCE} features 0:25 (window w-some): 12 of 25 URL(s) lost in this chunk "
                         "(see fetch_failures)"]
    assert logged[-1] == (logging.WARNING, summaries[0])
    assert not [m for level, m in quiet if level >= logging.WARNING]


def test_a_retry_counts_what_it_asked_for_alike_in_each_lost_url_and_in_its_failure(tmp_path, caplog):
    """A retry asks only for the 13 that did not land: each lost URL's line and the task's
    exception count out of those 13, and both say the other 12 landed before. The rule is
    "this share or more" (13 of 25 fails at 0.5); one attempt is "1 attempt"."""
    import logging

    settings = settings_in(tmp_path)
    lost = {feature_path(i): "503" for i in range(13)}
    c = chunk("http://unused", "w-again", 0, 25, max_attempts=1)
    with FakeNeuronpedia(pages=pages(25), always=lost) as np, caplog.at_level(logging.INFO, "featurehouse.fetch"):
        c["base_url"] = np.base_url
        with pytest.raises(FetchChunkFailed) as first:
            fetch_chunk(c, settings)
        caplog.clear()
        with pytest.raises(FetchChunkFailed) as again:
            fetch_chunk(c, settings)
    msg = str(first.value)
    assert "13 of 25 URL(s) failed, reaching max_failed_fraction = 0.5 (this share or more fails the task)" in msg
    assert "more than" not in msg and "(HTTP 503, 1 attempt):" in msg, msg
    msg = str(again.value)
    assert "13 of 13 URL(s) failed (12 more landed in an earlier try), all it asked for" in msg, msg
    lines = [m for level, m in _fetch_log(caplog) if level == logging.WARNING and m.startswith("lost ")]
    assert len(lines) == 13 and "after 1 attempt:" in lines[0]
    assert lines[-1].endswith("(13 of 13 URL(s) lost so far; 12 more landed in an earlier try)"), lines[-1]


@pytest.mark.parametrize("retry_left, says, never", [
    (True, "a retry asks only for the rest", "no retry is left"),
    (False, "no retry is left ([fetch] task_retries)", "a retry asks"),
])
def test_a_failed_chunk_promises_a_retry_only_when_one_is_left(tmp_path, retry_left, says, never):
    base = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(FetchChunkFailed) as exc:
        fetch_chunk(chunk(base, "w-last", max_attempts=1), settings_in(tmp_path), retry_left=retry_left)
    assert says in str(exc.value) and never not in str(exc.value), str(exc.value)
