"""Benchmark: `featurehouse ingest` against DuckDB's own read_json of the same inputs.

Four cases, in one run, each the real pipeline (land, parse, validate with Great Expectations,
quarantine, load, stats, report) as a child process timed from outside (wall, and peak RSS from
wait4):

  full     N realistic API-JSON pages (bench/generate.py: mostly-zero short-decimal values, one
           bad record per page) into a fresh warehouse, against the floor: DuckDB read_json of the
           same files' activations into a table of a fresh DuckDB file, no validation. Per N.
  rerun    the same N pages again into that warehouse (all landed already): against the full run.
  one      one new page into the warehouse holding the N pages (what the inbox DAG does every
           10 minutes); also the import time of great_expectations, which it pays every time.
  export   a realistic gzip activations export batch expanding to >= --export-gib GiB, against
           DuckDB read_json of the same .jsonl.gz into a table.

Inputs are generated once into --workdir and kept. Prints each figure and ratio and writes
bench/out/results.json. Not a test: nothing here asserts a time.

    python bench/run_bench.py                          # every case, N = 250 and 1000
    python bench/run_bench.py --case full --n 1000
    python bench/run_bench.py --tree /work/before      # ours from another checkout (before/after)
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

from bench.generate import write_activation_export, write_pages  # noqa: E402

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

EXPORT_FLOOR_SQL = """
CREATE TABLE activations AS
SELECT id AS activation_id, modelId AS model_id, layer AS source_id,
       CAST("index" AS BIGINT) AS feature_index, dataSource AS data_source,
       tokens, "values", maxValue AS max_value, maxValueTokenIndex AS max_value_token_index,
       minValue AS min_value
FROM read_json('{path}', format = 'newline_delimited', maximum_object_size = 1000000000,
               columns = {{id: 'VARCHAR', modelId: 'VARCHAR', layer: 'VARCHAR', "index": 'VARCHAR',
                   dataSource: 'VARCHAR', tokens: 'VARCHAR[]', "values": 'DOUBLE[]', maxValue: 'DOUBLE',
                   maxValueTokenIndex: 'INTEGER', minValue: 'DOUBLE'}})
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


class Runner:
    def __init__(self, workdir: Path, tree: Path | None):
        self.workdir = workdir
        self.env = dict(os.environ)
        if tree is not None:  # ours from another checkout: its package first on the path
            self.env["PYTHONPATH"] = str(tree.resolve())
        self.exe = str(Path(sys.executable).with_name("featurehouse"))

    def ingest(self, inputs: Path, wh: Path, env: dict | None = None) -> dict:
        return _run_child([self.exe, "ingest", str(inputs), "--warehouse", str(wh), "--no-progress"],
                          env=self.env | (env or {}))

    def floor(self, sql: str) -> dict:
        db = self.workdir / "floor.duckdb"
        db.unlink(missing_ok=True)
        script = ("import duckdb,sys; c=duckdb.connect(sys.argv[1]); c.execute(sys.argv[2]); "
                  "print(c.sql('select count(*) from activations').fetchone()[0], 'activations')")
        r = _run_child([sys.executable, "-c", script, str(db), sql])
        r["activations"] = int(r["tail"].split()[-2])
        db.unlink(missing_ok=True)
        return r

    def pages(self, n: int) -> Path:
        pages = self.workdir / f"pages-{n}"
        if not pages.exists() or len(list(pages.glob("*.json"))) != n:
            shutil.rmtree(pages, ignore_errors=True)
            write_pages(n, pages)
        return pages


def _counts(wh: Path) -> dict:
    """What the warehouse holds (read with this checkout's code; None if it cannot read it)."""
    try:
        from pipeline.lake.warehouse import connect

        with connect(wh, read_only=True) as c:
            return {"activations": c.sql("select count(*) from activations").fetchone()[0],
                    "quarantined": c.sql("select count(*) from quarantine").fetchone()[0]}
    except Exception as exc:  # a warehouse from another release
        return {"activations": None, "quarantined": None, "error": str(exc)[:200]}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def case_full(r: Runner, n: int) -> dict:
    pages = r.pages(n)
    wh = r.workdir / f"wh-{n}"
    shutil.rmtree(wh, ignore_errors=True)
    ours = r.ingest(pages, wh)
    floor = r.floor(FLOOR_SQL.format(glob=str(pages / "*.json")))
    return {"case": "full", "n_pages": n, "input_mib": round(_size(pages) / 2**20, 1),
            "ours_seconds": ours["seconds"], "ours_peak_rss_mib": ours["peak_rss_mib"], **_counts(wh),
            "floor_seconds": floor["seconds"], "floor_peak_rss_mib": floor["peak_rss_mib"],
            "floor_activations": floor["activations"], "ratio": round(ours["seconds"] / floor["seconds"], 2)}


def case_rerun(r: Runner, n: int, full: dict) -> dict:
    wh = r.workdir / f"wh-{n}"
    again = r.ingest(r.pages(n), wh)
    return {"case": "rerun", "n_pages": n, "seconds": again["seconds"], "peak_rss_mib": again["peak_rss_mib"],
            "full_seconds": full["ours_seconds"], "fraction_of_full": round(again["seconds"] / full["ours_seconds"], 3)}


def case_one(r: Runner, n: int) -> dict:
    wh = r.workdir / f"wh-{n}"
    one = r.workdir / "one-new-page"
    shutil.rmtree(one, ignore_errors=True)
    write_pages(1, one, start=n + 10_000 + int(time.time()) % 10_000)  # a feature the warehouse lacks
    new = r.ingest(one, wh)
    gx = _run_child([sys.executable, "-c", "import great_expectations"], env=r.env)
    cli = _run_child([r.exe, "--help"], env=r.env)
    return {"case": "one", "n_landed": n, "seconds": new["seconds"], "peak_rss_mib": new["peak_rss_mib"],
            "import_great_expectations_seconds": gx["seconds"], "cli_start_seconds": cli["seconds"]}


def case_export(r: Runner, gib: float) -> dict:
    src = r.workdir / f"export-{gib:g}gib" / "activations__batch-0.jsonl.gz"
    meta = src.with_suffix(".meta.json")
    if not meta.exists():
        src.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps(write_activation_export(src, int(gib * 2**30))))
    info = json.loads(meta.read_text())
    wh = r.workdir / "wh-export"
    shutil.rmtree(wh, ignore_errors=True)
    # A batch expanding past 1 GiB is over the default gzip-bomb guard: raise it, as for real
    # activation batches (0.6-1.2 GB gzip each).
    ours = r.ingest(src, wh, env={"FEATUREHOUSE_MAX_DECOMPRESSED_BYTES": str(8 * 2**30)})
    floor = r.floor(EXPORT_FLOOR_SQL.format(path=str(src)))
    return {"case": "export", "gzip_mib": round(info["gzip_bytes"] / 2**20, 1),
            "expanded_mib": round(info["expanded_bytes"] / 2**20, 1), "rows": info["rows"],
            "features": info["features"], "ours_seconds": ours["seconds"], "ours_peak_rss_mib": ours["peak_rss_mib"],
            **_counts(wh), "floor_seconds": floor["seconds"], "floor_peak_rss_mib": floor["peak_rss_mib"],
            "floor_activations": floor["activations"], "ratio": round(ours["seconds"] / floor["seconds"], 2)}


def _line(res: dict) -> str:
    c = res["case"]
    if c == "full":
        return (f"full    N={res['n_pages']:>5} ({res['input_mib']} MiB)  ingest {res['ours_seconds']:.2f}s "
                f"(peak RSS {res['ours_peak_rss_mib']:.0f} MiB, {res['activations']} activations, "
                f"{res['quarantined']} quarantined)  |  read_json {res['floor_seconds']:.2f}s "
                f"({res['floor_activations']} activations)  |  ratio {res['ratio']:.2f}  (goal <= 1.5)")
    if c == "rerun":
        return (f"rerun   N={res['n_pages']:>5}  {res['seconds']:.2f}s = {100 * res['fraction_of_full']:.1f}% "
                f"of the full run  (goal <= 5%)")
    if c == "one":
        return (f"one     1 new page into {res['n_landed']} landed  {res['seconds']:.2f}s  (goal <= 3 s; "
                f"import great_expectations alone {res['import_great_expectations_seconds']:.2f}s, "
                f"featurehouse --help {res['cli_start_seconds']:.2f}s)")
    return (f"export  {res['gzip_mib']} MiB gzip, {res['expanded_mib']} MiB expanded, {res['rows']} rows  "
            f"ingest {res['ours_seconds']:.2f}s (peak RSS {res['ours_peak_rss_mib']:.0f} MiB, "
            f"{res['activations']} loaded, {res['quarantined']} quarantined)  |  read_json "
            f"{res['floor_seconds']:.2f}s  |  ratio {res['ratio']:.2f}  (goal <= 1.5, RSS <= 2048 MiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description="featurehouse ingest vs DuckDB read_json, four cases")
    ap.add_argument("--n", type=int, action="append", help="pages of the full case (repeatable); default 250 and 1000")
    ap.add_argument("--case", action="append", choices=["full", "rerun", "one", "export"],
                    help="cases to run (repeatable); default all. rerun and one use the largest N's warehouse")
    ap.add_argument("--export-gib", type=float, default=1.0, help="expanded size of the export batch")
    ap.add_argument("--workdir", type=Path, default=OUT)
    ap.add_argument("--tree", type=Path, default=None, help="run ours from this checkout (PYTHONPATH)")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    cases = a.case or ["full", "rerun", "one", "export"]
    ns = sorted(a.n or [250, 1000])
    r = Runner(a.workdir, a.tree)
    results = []

    def done(res: dict) -> dict:
        results.append(res)
        print(_line(res), flush=True)
        (a.workdir / "results.json").write_text(json.dumps(results, indent=2))
        return res

    full = None
    for n in ns:
        if "full" in cases or (n == ns[-1] and {"rerun", "one"} & set(cases)):
            full = done(case_full(r, n))
    if "rerun" in cases:
        done(case_rerun(r, ns[-1], full))
    if "one" in cases:
        done(case_one(r, ns[-1]))
    if "export" in cases:
        done(case_export(r, a.export_gib))


if __name__ == "__main__":
    main()
