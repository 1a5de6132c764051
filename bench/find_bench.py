"""Benchmark finding features: search, similar and by-token on one 262,144-feature source.

    python bench/find_bench.py [--features 262144] [--active 16384] [--workdir bench/out]

Generates the source (bench/find_source.py: explanations with 256-float embeddings, half of
them string-encoded; activations for 16,384 of its features), ingests it into a new warehouse,
builds the find index from scratch, then measures:

* each command from the CLI, process start included (wall, median of 5; peak RSS of the process),
* each query from Python on a warm ``Finder`` (median of 20, after one warm-up),
* a refresh of the index after a one-page load (``featurehouse index``, process included).

Goals (issue 19): CLI ≤ 1 s, Python ≤ 50 ms, ≤ 1 GB RSS, build ≤ 60 s, refresh ≤ 2 s.
Prints one line per figure and writes bench/out/find-bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.find_source import MODEL, SOURCE, write_source  # noqa: E402

FH = Path(sys.executable).parent / "featurehouse"
GOALS = {"cli_s": 1.0, "python_ms": 50.0, "rss_mb": 1024.0, "build_s": 60.0, "refresh_s": 2.0}


def run(argv: list[str], env: dict | None = None) -> tuple[float, subprocess.CompletedProcess]:
    """Wall seconds of one child process, and what it printed."""
    t = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr[-2000:]}")
    return time.perf_counter() - t, proc


def run_rss(argv: list[str]) -> tuple[float, float, str]:
    """Wall seconds and the child's peak RSS in MB, measured with os.wait4."""
    t = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}")
    return wall, usage.ru_maxrss / 1024, out.decode()


_PY_WARM = r"""
import json, statistics, sys, time, resource
from pipeline.outputs.find import Finder
wh, key = sys.argv[1], sys.argv[2]
out = {}
with Finder(wh) as f:
    cases = {
        "search": lambda: f.search("jokes humour", limit=10),
        "search_phrase": lambda: f.search('"the city of Paris" Seine', limit=10),
        "similar": lambda: f.similar(key, limit=10),
        "by_token": lambda: f.by_token("paris", ignore_case=True, strip=True, limit=10),
    }
    for name, q in cases.items():
        q()
        times = []
        for _ in range(20):
            t = time.perf_counter(); q(); times.append((time.perf_counter() - t) * 1000)
        out[name] = {"median_ms": statistics.median(times), "max_ms": max(times)}
out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def _direct_explanations(wh: Path, src: Path) -> None:
    """Every explanations file into the lake in one statement, parsed as the export road parses
    it (no validation, no captures): what the find index reads, without the pipeline's load."""
    from pipeline.lake import warehouse
    from pipeline.stages.columns import _with_embedding

    sel = f"""SELECT id AS explanation_id, modelId AS model_id, layer AS source_id,
                     CAST("index" AS BIGINT) AS feature_index, description,
                     explanationModelName AS explanation_model, typeName AS type_name,
                     authorId AS author_id, embedding AS embedding_json
              FROM read_json('{src}/explanations/*.jsonl.gz', format = 'newline_delimited', compression = 'gzip',
                             columns = {{'id': 'VARCHAR', 'modelId': 'VARCHAR', 'layer': 'VARCHAR',
                                        'index': 'VARCHAR', 'description': 'VARCHAR',
                                        'explanationModelName': 'VARCHAR', 'typeName': 'VARCHAR',
                                        'authorId': 'VARCHAR', 'embedding': 'JSON'}})"""
    os.environ.setdefault("FEATUREHOUSE_DUCKDB_MEMORY", "4GB")
    with warehouse.connect(wh) as conn:
        conn.execute("BEGIN")
        conn.execute(f"""INSERT INTO explanations BY NAME
                         SELECT * EXCLUDE (embedding_numeric, embedding_dim), now()::TIMESTAMP AS loaded_at,
                                'bench-direct' AS input_sha256, 'bench-direct' AS run_id
                         FROM ({_with_embedding(sel, 'embedding_json')})""")
        conn.execute("COMMIT")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--features", type=int, default=262_144)
    ap.add_argument("--active", type=int, default=16_384)
    ap.add_argument("--workdir", type=Path, default=ROOT / "bench" / "out")
    ap.add_argument("--keep", action="store_true", help="reuse the warehouse of an earlier run (skip the ingest)")
    ap.add_argument("--direct", action="store_true",
                    help="load the explanations straight into the lake with DuckDB instead of through the pipeline")
    a = ap.parse_args()
    src = a.workdir / f"find-source-{a.features}"
    wh = a.workdir / f"find-wh-{a.features}"
    res: dict = {"features": a.features, "active": a.active}
    if not (src / "explanations").exists():
        t = time.perf_counter()
        res["generated"] = write_source(src, a.features, a.active)
        print(f"generated {res['generated']} in {time.perf_counter() - t:.1f}s", flush=True)
    if not (a.keep and wh.exists()):
        shutil.rmtree(wh, ignore_errors=True)
        # The ingest is not what is measured here. These activations files in more than one
        # batch make the load's id check (captures._newest_keeps_each_id) run out of DuckDB's memory,
        # and of the disk when given more (so does release 59aeb32, before issue 19: see
        # docs/benchmarks.md); in one batch they load. So: activations in one batch, then the rest.
        # Explanations files one run each: in one run of all 16, the load's temporary storage
        # grew until the disk was full (not found yet; see docs/benchmarks.md).
        wall = 0.0
        one_batch = {"FEATUREHOUSE_BATCH_BYTES": str(4 << 30), "FEATUREHOUSE_BATCH_ACTIVATIONS": "1000000"}
        parts = [(src / "activations", one_batch), (src / "features", {})]
        if not a.direct:
            parts += [(p, {}) for p in sorted((src / "explanations").glob("*.jsonl.gz"))]
        for part, env in parts:
            w, proc = run([str(FH), "ingest", str(part), "--warehouse", str(wh), "--no-progress",
                           "--format", "json"], env=env)
            wall += w
            print(f"ingest {part.name}: {w:.1f}s", flush=True)
        if a.direct:
            t = time.perf_counter()
            _direct_explanations(wh, src)
            wall += time.perf_counter() - t
            print(f"explanations straight into the lake: {time.perf_counter() - t:.1f}s", flush=True)
        res["ingest_s"] = wall
        print(f"ingest: {wall:.1f}s", flush=True)
    wall, rss, out = run_rss([str(FH), "index", "--full", "--format", "json", "--warehouse", str(wh)])
    info = json.loads(out)
    res["build"] = {"wall_s": wall, "rss_mb": rss, **info}
    print(f"index build from scratch: {wall:.1f}s wall ({info['seconds']:.1f}s inside), peak RSS {rss:.0f} MB, "
          f"{info['n_embeddings']} embeddings", flush=True)
    key = f"{MODEL}/{SOURCE}/{a.features // 3}"
    cli = {
        "search": ["search", "jokes humour"],
        "search_phrase": ["search", '"the city of Paris" Seine'],
        "similar": ["similar", key],
        "by_token": ["by-token", "paris", "--ignore-case", "--strip"],
    }
    res["cli"] = {}
    for name, args in cli.items():
        walls, rsss = [], []
        for _ in range(5):
            w, r, _ = run_rss([str(FH), *args, "--warehouse", str(wh)])
            walls.append(w)
            rsss.append(r)
        res["cli"][name] = {"median_s": statistics.median(walls), "max_s": max(walls), "rss_mb": max(rsss)}
        print(f"cli {name}: median {statistics.median(walls):.3f}s (max {max(walls):.3f}s), peak RSS {max(rsss):.0f} MB",
              flush=True)
    _, py_rss, out = run_rss([sys.executable, "-c", _PY_WARM, str(wh), key])
    res["python"] = json.loads(out)
    for name, v in res["python"].items():
        if isinstance(v, dict):
            print(f"python warm {name}: median {v['median_ms']:.1f} ms (max {v['max_ms']:.1f} ms)", flush=True)
    print(f"python process peak RSS {py_rss:.0f} MB", flush=True)
    # a one-page load, then the refresh (the CLI ingest would refresh by itself: use the library)
    page = a.workdir / "find-one-page" / "page.json"
    page.parent.mkdir(parents=True, exist_ok=True)
    from tests.conftest import good_page
    from tests.formats import to_api_json

    p = good_page(a.features + 1, model=MODEL, source=SOURCE)
    p["explanations"][0].update(description=f"penguins on the ice ({time.time():.0f})", embedding=[0.0625] * 256)
    page.write_bytes(to_api_json(p))
    subprocess.run([sys.executable, "-c", "import sys; from pipeline.ingest import ingest; from pipeline.config import Settings;"
                    "ingest([sys.argv[1]], Settings.from_env(warehouse=sys.argv[2]), progress=False)", str(page), str(wh)],
                   check=True, capture_output=True)
    wall, rss, out = run_rss([str(FH), "index", "--format", "json", "--warehouse", str(wh)])
    info = json.loads(out)
    res["refresh"] = {"wall_s": wall, "rss_mb": rss, **info}
    print(f"refresh after a one-page load: {wall:.2f}s wall ({info['seconds']:.2f}s inside, {info['mode']}, "
          f"{info['n_changed_features']} features read), peak RSS {rss:.0f} MB", flush=True)
    (a.workdir / "find-bench.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
