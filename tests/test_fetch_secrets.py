"""The Neuronpedia API key travels only in the x-api-key header: never in logs, output,
error messages, the manifest, the landing area, or the warehouse."""

from __future__ import annotations

import logging

from click.testing import CliRunner

from pipeline.cli import cli
from tests.conftest import open_warehouse
from tests.fake_neuronpedia import FakeNeuronpedia, feature_path
from tests.fetch_support import MODEL, SOURCE, pages, settings_in

KEY = "np-secret-7f3a9c1e5b2d4a60"


def test_api_key_never_leaks(tmp_path, caplog, capfd):
    caplog.set_level(logging.DEBUG)  # urllib3 and requests log connections and URLs at DEBUG
    s = settings_in(tmp_path)
    faults = {feature_path(1): ["429", "drop"], feature_path(2): ["truncate"]}
    echo = feature_path(4)  # a server that repeats the key in its error body, every time
    with FakeNeuronpedia(pages=pages(5), api_key=KEY, faults=faults, always={echo: "echo_key_500"},
                         retry_after="0", batch_features=4) as np:
        common = ["--warehouse", str(s.warehouse), "--backoff", "0.01", "--max-attempts", "3",
                  "--requests-per-hour", "10000000"]
        out = CliRunner().invoke(cli, ["-v", "fetch", "features", "--model", MODEL, "--source", SOURCE,
                                       "--range", "0:5", "--base-url", np.base_url, *common],
                                 env={"NEURONPEDIA_API_KEY": KEY})
        out2 = CliRunner().invoke(cli, ["-v", "fetch", "exports", "--model", MODEL, "--source", SOURCE,
                                        "--exports-url", np.exports_url, *common],
                                  env={"NEURONPEDIA_API_KEY": KEY})
        api = np.seen(prefix="/api/")
        bucket = np.seen(prefix="/neuronpedia-datasets")

    assert out.exit_code == 3, out.output  # feature 4 failed on every attempt
    assert out2.exit_code == 0, out2.output
    # The key was sent, as the header, on every API request, and nowhere else.
    assert api and all(r.headers.get("x-api-key") == KEY for r in api)
    assert bucket and all("x-api-key" not in r.headers for r in bucket)
    assert all(KEY not in r.path and KEY not in str(r.query) for r in api + bucket)
    assert [r.answer for r in np.seen(echo)] == ["echo_key_500"] * 3

    # The echoed key was redacted from the error that is reported.
    assert "internal error for key ***" in out.output
    captured = capfd.readouterr()
    for text in (out.output, out2.output, caplog.text, captured.out, captured.err):
        assert KEY not in text
    assert any(r.name.startswith("urllib3") for r in caplog.records)  # DEBUG logging was on

    # every file of this test's warehouse (landing area, manifests, budget): its own folder only
    # (its parent holds the worker's earlier tests' folders, whose files may still be going away)
    files = [p for p in s.warehouse.rglob("*") if p.is_file()]
    assert any(p.suffix == ".jsonl" for p in files)  # the manifests are among them
    for p in files:
        if p.suffix not in (".duckdb", ".wal"):
            assert KEY.encode() not in p.read_bytes(), p

    with open_warehouse(s.warehouse) as conn:
        tables = [t for (t,) in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'").fetchall()]
        assert "fetch_failures" in tables
        for t in tables:
            cols = [c for (c,) in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = ?", [t]).fetchall()]
            hits = conn.execute(
                f'SELECT count(*) FROM "{t}" WHERE ' + " OR ".join(
                    f'contains(CAST("{c}" AS VARCHAR), ?)' for c in cols), [KEY] * len(cols)).fetchone()[0]
            assert hits == 0, t
        failed = conn.execute("SELECT feature_key, last_error FROM fetch_failures WHERE status = 'failed'").fetchall()
        assert failed == [(f"{MODEL}/{SOURCE}/4", 'HTTP 500: {"error":"internal error for key ***"}')]


def test_a_redirect_to_another_host_never_carries_the_key(tmp_path):
    """requests drops Authorization on a cross-host redirect but keeps custom headers: a 302 from
    the API to another host must not hand it the key (same-host redirects still carry it)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen: list[tuple[str, str | None]] = []

    class Other(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("x-api-key")))
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error":"Not found"}')

        def log_message(self, *a):
            pass

    other = ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    target = f"http://127.0.0.1:{other.server_address[1]}"

    class Redirect(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(("redirector" + self.path, self.headers.get("x-api-key")))
            self.send_response(302)
            self.send_header("Location", target + self.path)
            self.end_headers()

        def log_message(self, *a):
            pass

    redirector = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=redirector.serve_forever, daemon=True).start()
    try:
        s = settings_in(tmp_path)
        out = CliRunner().invoke(cli, ["fetch", "features", "--model", MODEL, "--source", SOURCE,
                                       "--index", "1", "--base-url",
                                       f"http://127.0.0.1:{redirector.server_address[1]}",
                                       "--warehouse", str(s.warehouse), "--no-progress"],
                                 env={"NEURONPEDIA_API_KEY": KEY})
    finally:
        other.shutdown()
        redirector.shutdown()
    assert out.exit_code == 0, out.output  # the other host's 404 is "feature not found"
    assert [k for p, k in seen if p.startswith("redirector")] == [KEY]
    assert [k for p, k in seen if not p.startswith("redirector")] == [None]


def test_a_key_with_line_breaks_is_cleaned_or_refused_never_shown(tmp_path):
    s = settings_in(tmp_path)
    with FakeNeuronpedia(pages=pages(2), api_key=KEY) as np:
        args = ["fetch", "features", "--model", MODEL, "--source", SOURCE, "--index", "1",
                "--base-url", np.base_url, "--warehouse", str(s.warehouse), "--no-progress"]
        crlf = CliRunner().invoke(cli, args, env={"NEURONPEDIA_API_KEY": KEY + "\r\n"})
        inner = CliRunner().invoke(cli, args, env={"NEURONPEDIA_API_KEY": KEY[:6] + "\r" + KEY[6:]})
        sent = [r.headers.get("x-api-key") for r in np.seen(prefix="/api/")]
    assert crlf.exit_code == 0, crlf.output  # a CRLF .env file's trailing \r\n is stripped
    assert sent == [KEY]  # the refused key never reached the server
    assert inner.exit_code != 0 and "control character" in inner.output
    assert KEY[6:] not in inner.output and KEY[:6] + "\\r" not in inner.output
