"""Benchmark: `featurehouse ingest` against DuckDB's own read_json on the same pages.

For each N it generates N synthetic API-JSON pages (bench/generate.py), then, in one run:
  * ours  — `featurehouse ingest` (every stage: land, parse, validate, load, materialise) into a
            fresh warehouse, as a child process;
  * floor — DuckDB `read_json` loading the same files' activations into a table in a fresh
            database, no validation, as a child process.
Each child's wall time and peak RSS (from wait4) are measured. Prints both, their ratio, and
writes bench/out/results.json. Not a test: nothing here asserts a time.

    python bench/run_bench.py --n 1000            # the issue's goal: ratio <= 1.5, RSS <= 1.5 GB
    python bench/run_bench.py --n 250 --n 1000    # RSS should not grow with N
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.generate import write_pages  # noqa: E402

OUT = ROOT / "bench" / "out"

FLOOR_SQL = """
CREATE TABLE activations AS
SELECT a.id AS activation_id, a.modelId AS model_id, a.layer AS source_id,
       CAST(a."index" AS BIGINT) AS feature_index, a.dataSource AS data_source,
       a.tokens, a."values", a.maxValue AS max_value,
       a.maxValueTokenIndex AS max_value_token_index, a.minValue AS min_value
FROM (
    SELECT unnest(activations) AS a
    FROM read_json('{glob}', format = 'auto', maximum_object_size = 1000000000,
                   columns = {{activations: 'STRUCT(id VARCHAR, modelId VARCHAR, layer VARCHAR,
                       "index" VARCHAR, dataSource VARCHAR, tokens VARCHAR[], "values" DOUBLE[],
                       maxValue DOUBLE, maxValueTokenIndex INTEGER, minValue DOUBLE)[]'}})
)
"""


def _run_child(argv: list[str], env: dict | None = None) -> dict:
    """Run a child process; return wall seconds, peak RSS (MiB) and its output tail."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    out = proc.stdout.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    text = out.decode("utf-8", "replace")
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({proc.returncode}):\n{text[-3000:]}")
    return {"seconds": round(seconds, 3), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "tail": text[-600:]}


def bench_once(n: int, workdir: Path) -> dict:
    pages = workdir / f"pages-{n}"
    if not pages.exists() or len(list(pages.glob("*.json"))) != n:
        shutil.rmtree(pages, ignore_errors=True)
        write_pages(n, pages)
    size = sum(p.stat().st_size for p in pages.glob("*.json"))

    wh = workdir / f"wh-{n}"
    shutil.rmtree(wh, ignore_errors=True)
    exe = str(Path(sys.executable).with_name("featurehouse"))
    ours = _run_child([exe, "ingest", str(pages), "--warehouse", str(wh), "--no-progress"],
                      env=dict(os.environ, FEATUREHOUSE_REPORTS=str(wh / "reports")))

    floor_db = workdir / f"floor-{n}.duckdb"
    floor_db.unlink(missing_ok=True)
    script = (
        "import duckdb,sys; c=duckdb.connect(sys.argv[1]); "
        "c.execute(sys.argv[2]); print(c.sql('select count(*) from activations').fetchone()[0], 'activations')"
    )
    floor = _run_child([sys.executable, "-c", script, str(floor_db),
                        FLOOR_SQL.format(glob=str(pages / "*.json"))])

    import duckdb

    from pipeline.warehouse import connect

    with connect(wh, read_only=True) as c:
        ours_rows = c.sql("select count(*) from activations").fetchone()[0]
    with duckdb.connect(str(floor_db), read_only=True) as c:
        floor_rows = c.sql("select count(*) from activations").fetchone()[0]
    return {
        "n_pages": n,
        "input_mib": round(size / 2**20, 1),
        "ours_seconds": ours["seconds"],
        "ours_peak_rss_mib": ours["peak_rss_mib"],
        "ours_activations": ours_rows,
        "floor_seconds": floor["seconds"],
        "floor_peak_rss_mib": floor["peak_rss_mib"],
        "floor_activations": floor_rows,
        "ratio": round(ours["seconds"] / floor["seconds"], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="featurehouse ingest vs DuckDB read_json")
    ap.add_argument("--n", type=int, action="append", help="pages per run (repeatable); default 1000")
    ap.add_argument("--workdir", type=Path, default=OUT)
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for n in a.n or [1000]:
        r = bench_once(n, a.workdir)
        results.append(r)
        print(
            f"N={r['n_pages']:>5} ({r['input_mib']} MiB)  featurehouse ingest {r['ours_seconds']:.2f}s "
            f"(peak RSS {r['ours_peak_rss_mib']:.0f} MiB, {r['ours_activations']} activations)  |  "
            f"duckdb read_json {r['floor_seconds']:.2f}s (peak RSS {r['floor_peak_rss_mib']:.0f} MiB, "
            f"{r['floor_activations']} activations)  |  ratio {r['ratio']:.2f}",
            flush=True,
        )
    (a.workdir / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
