"""Benchmark `featurehouse serve` on a whole generated source (issue 43's goals).

    python bench/serve_bench.py [--warehouse W] [--n 10]

W defaults to find_bench's 262,144-feature warehouse (bench/out/find-wh-262144), made by
`python bench/find_bench.py` (`make bench` runs that first). Starts `featurehouse serve` on it
(the find index built first if there is none), then for each kind of page: one request to warm
it, then ``--n`` more; prints the median of the server's own time (its Server-Timing header), of
the whole request and of the time to the first byte on loopback, the server's resident memory
after them, and the browser's load event for a feature page (Playwright driving the system's
Chromium, when there is one). Goals: search, feature, by-token ≤ 100 ms warm; a source page
≤ 300 ms; a feature page's first byte ≤ 50 ms; the load event ≤ 500 ms; ≤ 1 GB resident. A page's
time is judged on the whole request on loopback, not the Server-Timing header: a feature page is
sent in two parts (the card, then the nearest features), and its header can time only the first.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FH = Path(sys.executable).parent / "featurehouse"
GOALS_MS = {"search": 100, "feature": 100, "by-token": 100, "source": 300}


def _get(port: int, path: str) -> tuple[float, float, float, int]:
    """(server ms, total ms, first-byte ms, status) of one GET."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    c.request("GET", path)
    r = c.getresponse()
    first = time.perf_counter()
    r.read()
    total = time.perf_counter()
    c.close()
    timing = r.getheader("Server-Timing") or "app;dur=nan"
    return float(timing.split("dur=")[1]), 1000 * (total - t0), 1000 * (first - t0), r.status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warehouse", type=Path, default=ROOT / "bench" / "out" / "find-wh-262144")
    ap.add_argument("--n", type=int, default=10)
    a = ap.parse_args()
    import psutil

    from pipeline.lake import warehouse as wh

    with wh.connect(a.warehouse, read_only=True) as conn:
        n_features = conn.execute("SELECT count(*) FROM features").fetchone()[0]
        model, source, index = conn.execute(
            "SELECT model_id, source_id, feature_index FROM activations GROUP BY ALL ORDER BY count(*) DESC, 3 LIMIT 1"
        ).fetchone()
        token = conn.execute("SELECT token FROM feature_token_stats ORDER BY max_activation DESC LIMIT 1").fetchone()[0]
        # a word of a feature that has excerpts: its results show theirs (a page of results with
        # none measured no excerpt lookup at all)
        word = conn.execute("SELECT split_part(trim(description), ' ', 1) FROM explanations "
                            "SEMI JOIN activations USING (model_id, source_id, feature_index) "
                            "WHERE description IS NOT NULL ORDER BY feature_index LIMIT 1").fetchone()[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.perf_counter()
    proc = subprocess.Popen([str(FH), "serve", "--warehouse", str(a.warehouse), "--port", str(port)],
                            stderr=subprocess.PIPE)
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(proc.stderr.read().decode()) from None
            time.sleep(0.2)
    start_s = time.perf_counter() - t
    m, s_, = quote(model, safe=""), quote(source, safe="")
    pages = {"home": "/", "search": f"/search?q={quote(word)}", "by-token": f"/by-token?t={quote(token)}",
             "feature": f"/f/{m}/{s_}/{index}", "source": f"/s/{m}/{s_}?sort=max", "runs": "/runs"}
    res: dict = {"features": n_features, "start_s": round(start_s, 1), "pages": {}}
    try:
        for name, path in pages.items():
            _get(port, path)
            runs = [_get(port, path) for _ in range(a.n)]
            assert all(r[3] == 200 for r in runs), (name, runs[0])
            res["pages"][name] = {k: round(statistics.median(r[i] for r in runs), 1)
                                  for i, k in enumerate(("server_ms", "total_ms", "first_byte_ms"))}
        res["rss_mb"] = round(psutil.Process(proc.pid).memory_info().rss / 2**20)
        chromium = shutil.which("chromium")
        if chromium:
            from playwright.sync_api import sync_playwright

            with sync_playwright() as p:
                b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu",
                                      "--disable-background-networking", "--disable-component-update"])
                pg = b.new_page()
                loads = []
                for _ in range(5):
                    pg.goto(f"http://127.0.0.1:{port}{pages['feature']}")
                    loads.append(pg.evaluate("performance.getEntriesByType('navigation')[0].loadEventEnd"))
                b.close()
            res["feature_load_event_ms"] = round(statistics.median(loads[1:]), 1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"serve  {n_features:,} features, started in {res['start_s']} s, {res['rss_mb']} MiB resident "
          f"(goal <= 1024: {'met' if res['rss_mb'] <= 1024 else 'NOT met'})")
    for name, f in res["pages"].items():
        goal = GOALS_MS.get(name)
        verdict = f"  goal <= {goal} ms (request): {'met' if f['total_ms'] <= goal else 'NOT met'}" if goal else ""
        print(f"       {name:<9} server {f['server_ms']:>7.1f} ms, request {f['total_ms']:>7.1f} ms, "
              f"first byte {f['first_byte_ms']:>7.1f} ms{verdict}")
    fb = res["pages"]["feature"]["first_byte_ms"]
    print(f"       feature page first byte {fb:.1f} ms  goal <= 50 ms: {'met' if fb <= 50 else 'NOT met'}")
    if "feature_load_event_ms" in res:
        le = res["feature_load_event_ms"]
        print(f"       feature page load event in Chromium {le:.1f} ms  goal <= 500 ms: {'met' if le <= 500 else 'NOT met'}")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve-bench.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
