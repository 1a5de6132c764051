"""Benchmark: `featurehouse ingest` against DuckDB's own read_json of the same inputs.

Cases, in one run, each the real pipeline (land, parse, validate Great Expectations' suites in
DuckDB, quarantine, load, stats, report) as a child process timed from outside (wall, and peak RSS from
wait4):

  full     N realistic API-JSON pages (bench/generate.py: mostly-zero short-decimal values, one
           bad record per page) into a fresh warehouse, against the floor: DuckDB read_json of the
           same files' activations into a table of a fresh DuckDB file, no validation. Per N.
  rerun    the same N pages again into that warehouse (all landed already): against the full run.
  one      one new page into the warehouse holding the N pages (what the inbox DAG does every
           10 minutes), against its imports; also with FEATUREHOUSE_DATA_DOCS=run (Great
           Expectations records the run in the ingest).
  export   a realistic gzip activations export batch expanding to >= --export-gib GiB, against
           DuckDB read_json of the same .jsonl.gz into a table.

Ours and its floor run as alternating pairs (--pairs, default 3: ours, floor, ours, floor, ...)
and each case reports the median of the pairs' ratios with their range, so a slow moment of the
machine lands on both sides of a pair instead of flattering one. Beside each figure: ours's
time per stage (land, read, stage, validate, write, commit, stats, report), from
`featurehouse ingest --format json` of the median pair, and the goal (issue 18).

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
import statistics
import subprocess
import sys
import tempfile
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
    """Run a child process; return wall seconds, CPU seconds (user + system, its children's
    included, from wait4), peak RSS (MiB), its output's tail and, when its standard output is
    one JSON object, that object."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace")
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{argv[0]} failed ({code}):\n{(stdout + stderr)[-3000:]}")
    try:
        parsed = json.loads(stdout)
    except ValueError:
        parsed = None
    return {"seconds": round(seconds, 3), "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 3),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "tail": (stdout + stderr)[-600:], "json": parsed if isinstance(parsed, dict) else None}


def _stages(run: dict) -> dict | None:
    """Ours's seconds per stage, as `featurehouse ingest --format json` reports them, each with
    the CPU seconds of the thread that ran it after a slash when reported (None from a release
    that reports no stages)."""
    out = run.get("json") or {}
    wall, cpu = out.get("stage_seconds"), out.get("stage_cpu_seconds") or {}
    if not wall:
        return None
    return {k: f"{v:.2f}s" + (f"/{cpu[k]:.2f} CPU-s" if k in cpu else "") for k, v in wall.items()}


def _pairs(k: int, ours, floor) -> dict:
    """``k`` alternating pairs of ours() and floor(); the median pair's figures and the range of
    the ratios. Each callable returns a _run_child result."""
    runs = []
    for _ in range(k):
        a = ours()
        b = floor()
        runs.append((a["seconds"] / b["seconds"], a, b))
    cpu = sorted(a["cpu_seconds"] / b["cpu_seconds"] for _, a, b in runs)
    runs.sort(key=lambda r: r[0])
    ratio, a, b = runs[len(runs) // 2]
    return {"ratio": round(statistics.median(r for r, _, _ in runs), 2),
            "ratios": [round(r, 2) for r, _, _ in runs], "ours": a, "floor": b,
            "cpu_ratio": round(statistics.median(cpu), 2), "cpu_ratios": [round(r, 2) for r in cpu],
            "ours_peak_rss_mib": max(r[1]["peak_rss_mib"] for r in runs)}


class Runner:
    def __init__(self, workdir: Path, tree: Path | None):
        self.workdir = workdir
        self.env = dict(os.environ)
        if tree is not None:  # ours from another checkout: its package first on the path
            self.env["PYTHONPATH"] = str(tree.resolve())
        self.exe = str(Path(sys.executable).with_name("featurehouse"))

    def ingest(self, inputs: Path, wh: Path, env: dict | None = None) -> dict:
        return _run_child([self.exe, "ingest", str(inputs), "--warehouse", str(wh), "--no-progress",
                           "--format", "json"], env=self.env | (env or {}))

    def floor(self, sql: str) -> dict:
        db = self.workdir / "floor.duckdb"
        db.unlink(missing_ok=True)
        script = ("import duckdb,sys; c=duckdb.connect(sys.argv[1]); c.execute(sys.argv[2]); "
                  "print(c.sql('select count(*) from activations').fetchone()[0], 'activations')")
        r = _run_child([sys.executable, "-c", script, str(db), sql])
        r["activations"] = int(r["tail"].split()[-2])
        db.unlink(missing_ok=True)
        return r

    def pages(self, n: int, generator: str = "a") -> Path:
        pages = self.workdir / (f"pages-{n}" if generator == "a" else f"pages-{generator}-{n}")
        if not pages.exists() or len(list(pages.glob("*.json"))) != n:
            shutil.rmtree(pages, ignore_errors=True)
            write_pages(n, pages, generator=generator)
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


def case_full(r: Runner, n: int, pairs: int, generator: str = "a") -> dict:
    pages = r.pages(n, generator)
    wh = r.workdir / (f"wh-{n}" if generator == "a" else f"wh-{generator}-{n}")

    def ours() -> dict:
        shutil.rmtree(wh, ignore_errors=True)  # each pair's ingest into a fresh warehouse
        return r.ingest(pages, wh)

    p = _pairs(pairs, ours, lambda: r.floor(FLOOR_SQL.format(glob=str(pages / "*.json"))))
    return {"case": "full", "generator": generator, "n_pages": n, "input_mib": round(_size(pages) / 2**20, 1),
            "cpu_ratio": p["cpu_ratio"], "cpu_ratios": p["cpu_ratios"],
            "ours_cpu_seconds": p["ours"]["cpu_seconds"], "floor_cpu_seconds": p["floor"]["cpu_seconds"],
            "ours_seconds": p["ours"]["seconds"], "ours_peak_rss_mib": p["ours_peak_rss_mib"], **_counts(wh),
            "floor_seconds": p["floor"]["seconds"], "floor_peak_rss_mib": p["floor"]["peak_rss_mib"],
            "floor_activations": p["floor"]["activations"], "ratio": p["ratio"], "ratios": p["ratios"],
            "stages": _stages(p["ours"])}


def case_rerun(r: Runner, n: int, full: dict, pairs: int) -> dict:
    wh = r.workdir / f"wh-{n}"
    runs = sorted((r.ingest(r.pages(n), wh) for _ in range(pairs)), key=lambda x: x["seconds"])
    again = runs[len(runs) // 2]
    return {"case": "rerun", "n_pages": n, "seconds": again["seconds"], "peak_rss_mib": again["peak_rss_mib"],
            "full_seconds": full["ours_seconds"], "fraction_of_full": round(again["seconds"] / full["ours_seconds"], 3),
            "stages": _stages(again)}


#: What every one-page run imports before it can validate: the floor of the "one" case.
IMPORT_FLOOR = "import pipeline.ingest, pipeline.cli"
#: The same imports as the pipeline makes them (its collector frozen before the teardown:
#: ``cli.main``). Printed beside it, so the "one" figure does not flatter itself with a floor
#: that pays collections the pipeline no longer pays.
PAUSED_FLOOR = "import gc; gc.disable(); " + IMPORT_FLOOR + "; gc.freeze()"


def case_one(r: Runner, n: int, pairs: int) -> dict:
    wh = r.workdir / f"wh-{n}"
    start = n + 10_000 + int(time.time()) % 10_000
    made = iter(range(2 * pairs))  # one new feature for each run of ours() and of later()

    def ours() -> dict:
        one = r.workdir / "one-new-page"
        shutil.rmtree(one, ignore_errors=True)
        write_pages(1, one, start=start + next(made))  # a feature the warehouse lacks
        return r.ingest(one, wh)

    p = _pairs(pairs, ours, lambda: _run_child([sys.executable, "-c", IMPORT_FLOOR], env=r.env))

    def with_gx() -> dict:  # FEATUREHOUSE_DATA_DOCS=run: Great Expectations records in the ingest
        one = r.workdir / "one-new-page"
        shutil.rmtree(one, ignore_errors=True)
        write_pages(1, one, start=start + next(made))
        return r.ingest(one, wh, env={"FEATUREHOUSE_DATA_DOCS": "run"})

    gx_run = sorted((with_gx() for _ in range(pairs)), key=lambda x: x["seconds"])[pairs // 2]
    cli = _run_child([r.exe, "--help"], env=r.env)
    paused = sorted(_run_child([sys.executable, "-c", PAUSED_FLOOR], env=r.env)["seconds"] for _ in range(pairs))
    paused_floor = paused[len(paused) // 2]
    return {"case": "one", "n_landed": n, "seconds": p["ours"]["seconds"], "peak_rss_mib": p["ours_peak_rss_mib"],
            "import_floor_seconds": p["floor"]["seconds"], "over_import_floor_seconds":
            round(p["ours"]["seconds"] - p["floor"]["seconds"], 2), "ratios": p["ratios"],
            "paused_import_floor_seconds": paused_floor,
            "over_paused_floor_seconds": round(p["ours"]["seconds"] - paused_floor, 2),
            "cli_start_seconds": cli["seconds"], "stages": _stages(p["ours"]),
            "cpu_seconds": p["ours"]["cpu_seconds"],
            "data_docs_run_seconds": gx_run["seconds"], "data_docs_run_cpu_seconds": gx_run["cpu_seconds"]}


def case_export(r: Runner, gib: float, pairs: int) -> dict:
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
    def ours() -> dict:
        shutil.rmtree(wh, ignore_errors=True)
        return r.ingest(src, wh, env={"FEATUREHOUSE_MAX_DECOMPRESSED_BYTES": str(8 * 2**30)})

    p = _pairs(pairs, ours, lambda: r.floor(EXPORT_FLOOR_SQL.format(path=str(src))))
    return {"case": "export", "gzip_mib": round(info["gzip_bytes"] / 2**20, 1),
            "expanded_mib": round(info["expanded_bytes"] / 2**20, 1), "rows": info["rows"],
            "features": info["features"], "ours_seconds": p["ours"]["seconds"],
            "ours_peak_rss_mib": p["ours_peak_rss_mib"], **_counts(wh), "floor_seconds": p["floor"]["seconds"],
            "floor_peak_rss_mib": p["floor"]["peak_rss_mib"], "floor_activations": p["floor"]["activations"],
            "ratio": p["ratio"], "ratios": p["ratios"], "cpu_ratio": p["cpu_ratio"], "cpu_ratios": p["cpu_ratios"],
            "stages": _stages(p["ours"])}


#: The source case's floor: DuckDB's read_json of the same files into three tables. An
#: embedding written as a string is cast to DOUBLE[] through JSON, the fastest way DuckDB has
#: (its VARCHAR-to-list cast costs ~6x the CPU: the floor used it until 2026-12-06, when the
#: pipeline stopped using it, so that the floor stays DuckDB's best).
SOURCE_FLOOR_SQL = """
CREATE TABLE activations AS
SELECT id AS activation_id, modelId AS model_id, layer AS source_id, CAST("index" AS BIGINT) AS feature_index,
       dataSource AS data_source, tokens, "values", maxValue AS max_value,
       maxValueTokenIndex AS max_value_token_index, minValue AS min_value, dfaValues AS dfa_values,
       dfaMaxValue AS dfa_max_value, dfaTargetIndex AS dfa_target_index, binMin AS bin_min, binMax AS bin_max,
       binContains AS bin_contains, creatorId AS creator_id
FROM read_json('{src}/activations/*.jsonl.gz', format = 'newline_delimited', maximum_object_size = 1000000000,
               columns = {{id: 'VARCHAR', modelId: 'VARCHAR', layer: 'VARCHAR', "index": 'VARCHAR',
                   creatorId: 'VARCHAR', dataSource: 'VARCHAR', tokens: 'VARCHAR[]', "values": 'DOUBLE[]',
                   maxValue: 'DOUBLE', minValue: 'DOUBLE', maxValueTokenIndex: 'INTEGER', dfaValues: 'DOUBLE[]',
                   dfaMaxValue: 'DOUBLE', dfaTargetIndex: 'INTEGER', binContains: 'DOUBLE', binMin: 'DOUBLE',
                   binMax: 'DOUBLE'}});
CREATE TABLE explanations AS
SELECT id AS explanation_id, modelId AS model_id, layer AS source_id, CAST("index" AS BIGINT) AS feature_index,
       description, authorId AS author_id, typeName AS type_name, explanationModelName AS explanation_model,
       CASE WHEN json_type(embedding) = 'VARCHAR' THEN CAST(CAST(embedding ->> '$' AS JSON) AS DOUBLE[])
            ELSE CAST(embedding AS DOUBLE[]) END AS embedding
FROM read_json('{src}/explanations/*.jsonl.gz', format = 'newline_delimited', maximum_object_size = 1000000000,
               columns = {{id: 'VARCHAR', modelId: 'VARCHAR', layer: 'VARCHAR', "index": 'VARCHAR',
                   description: 'VARCHAR', authorId: 'VARCHAR', embedding: 'JSON', triggeredById: 'VARCHAR',
                   typeName: 'VARCHAR', explanationModelName: 'VARCHAR', notes: 'VARCHAR', createdAt: 'VARCHAR'}});
CREATE TABLE features AS
SELECT modelId AS model_id, layer AS source_id, CAST("index" AS BIGINT) AS feature_index,
       sourceSetName AS source_set_name, maxActApprox AS max_act_approx, frac_nonzero, pos_str, pos_values,
       neg_str, neg_values, hookName AS hook_name, hasVector AS has_vector
FROM read_json('{src}/features/*.jsonl.gz', format = 'newline_delimited', maximum_object_size = 1000000000,
               columns = {{modelId: 'VARCHAR', layer: 'VARCHAR', "index": 'VARCHAR', sourceSetName: 'VARCHAR',
                   maxActApprox: 'DOUBLE', frac_nonzero: 'DOUBLE', pos_str: 'VARCHAR[]', pos_values: 'DOUBLE[]',
                   neg_str: 'VARCHAR[]', neg_values: 'DOUBLE[]', hookName: 'VARCHAR', hasVector: 'BOOLEAN'}});
"""


def _source(r: Runner, features: int, active: int, excerpts: int, tokens: int) -> tuple[Path, dict]:
    """A generated whole source in the export layout (bench/find_source.py): explanation files of
    1,024 rows with 256-d embeddings (half written as strings), activations and features batches
    of 1,024 features, each feature ``excerpts`` excerpts of ``tokens`` tokens, Chat and Non-Chat."""
    from bench.find_source import write_source

    src = r.workdir / f"source-{features}-{active}-{excerpts}x{tokens}"
    meta = src / "meta.json"
    if not meta.exists():
        shutil.rmtree(src, ignore_errors=True)
        info = write_source(src / "v1", features, active, batch=1024, excerpts=excerpts, tokens=tokens,
                            data_sources=("Chat", "Non-Chat"), activation_batch=1024)
        meta.write_text(json.dumps(info))
    return src / "v1", json.loads(meta.read_text())


def case_source(r: Runner, features: int, active: int, excerpts: int, tokens: int, pairs: int) -> dict:
    """A whole source through `featurehouse ingest`, then again unchanged, and through `fetch
    exports` from the fake bucket on loopback; each against DuckDB's read_json of the same files
    into tables."""
    from bench.find_source import MODEL, SOURCE

    src, info = _source(r, features, active, excerpts, tokens)
    wh = r.workdir / "wh-source"
    floor = lambda: r.floor(SOURCE_FLOOR_SQL.format(src=str(src)))  # noqa: E731

    def ours() -> dict:
        shutil.rmtree(wh, ignore_errors=True)
        return r.ingest(src, wh)

    p = _pairs(pairs, ours, floor)
    full = p["ours"]
    again = r.ingest(src, wh)
    counts = _counts(wh)
    sizes = {sub: sorted(f.stat().st_size for f in (src / sub).glob("*.jsonl.gz"))
             for sub in ("activations", "explanations", "features")}
    res = {"case": "source", "features": info["features"], "active_features": info["active_features"],
           "excerpts": info["excerpts"], "files": {k: len(v) for k, v in sizes.items()},
           "activation_batch_gzip_mib": round(statistics.median(sizes["activations"]) / 2**20, 1),
           "input_gzip_mib": round(_size(src) / 2**20, 1),
           "ours_seconds": full["seconds"], "ours_cpu_seconds": full["cpu_seconds"],
           "ours_peak_rss_mib": p["ours_peak_rss_mib"], **counts,
           "floor_seconds": p["floor"]["seconds"], "floor_cpu_seconds": p["floor"]["cpu_seconds"],
           "floor_peak_rss_mib": p["floor"]["peak_rss_mib"],
           "ratio": p["ratio"], "ratios": p["ratios"], "cpu_ratio": p["cpu_ratio"], "cpu_ratios": p["cpu_ratios"],
           "rerun_seconds": again["seconds"], "rerun_fraction": round(again["seconds"] / full["seconds"], 3),
           "stages": _stages(full)}
    # the same files fetched from a bucket on loopback (the fake Neuronpedia of the tests), then ingested
    from tests.fake_neuronpedia import FakeNeuronpedia

    fake = FakeNeuronpedia()
    fake.objects = {f"v1/{MODEL}/{SOURCE}/{f.relative_to(src).as_posix()}": f.read_bytes()
                    for f in sorted(src.rglob("*.jsonl.gz"))}
    whf = r.workdir / "wh-source-fetch"
    with fake:
        def fetched() -> dict:
            shutil.rmtree(whf, ignore_errors=True)
            return _run_child([r.exe, "fetch", "exports", "--model", MODEL, "--source", SOURCE, "--exports-url",
                               fake.exports_url, "--warehouse", str(whf), "--no-progress",
                               "--requests-per-hour", "100000000"], env=r.env)
        pf = _pairs(pairs, fetched, floor)
    res.update(fetch_seconds=pf["ours"]["seconds"], fetch_cpu_seconds=pf["ours"]["cpu_seconds"],
               fetch_ratio=pf["ratio"], fetch_ratios=pf["ratios"], fetch_cpu_ratio=pf["cpu_ratio"],
               fetch_cpu_ratios=pf["cpu_ratios"], fetch_peak_rss_mib=pf["ours_peak_rss_mib"],
               fetch_counts=_counts(whf))
    return res


#: The publish case's yardstick: DuckDB's COPY of the same tables, as of the same snapshot, to
#: Parquet files (zstd), from the warehouse opened as any reader opens it.
PUBLISH_FLOOR = """
import os, sys
from pipeline.lake import warehouse as w
from pipeline.outputs.publish import DEFAULT_TABLES
c = w.connect(sys.argv[1], read_only=True)
os.makedirs(sys.argv[2], exist_ok=True)
for t in DEFAULT_TABLES:
    c.execute(f"COPY (SELECT * FROM {t}) TO '{sys.argv[2]}/{t}.parquet' (FORMAT parquet, COMPRESSION zstd)")
"""


def case_publish(r: Runner, wh: Path, pairs: int) -> dict:
    """`featurehouse publish` of a whole source's warehouse (both layouts, into a new folder)
    against DuckDB's COPY of its tables to Parquet; then one new page loaded and published into
    the same folder: the bytes sent against the publication's data."""
    dest, floor_dir = r.workdir / "published", r.workdir / "copied"

    def ours() -> dict:
        shutil.rmtree(dest, ignore_errors=True)
        return _run_child([r.exe, "publish", str(dest), "--warehouse", str(wh), "--json"], env=r.env)

    def floor() -> dict:
        shutil.rmtree(floor_dir, ignore_errors=True)
        return _run_child([sys.executable, "-c", PUBLISH_FLOOR, str(wh), str(floor_dir)], env=r.env)

    p = _pairs(pairs, ours, floor)
    total = _size(dest)
    lake_total = _size(dest / "data") + (dest / "featurehouse.ducklake").stat().st_size
    one = r.workdir / "publish-one-page"
    shutil.rmtree(one, ignore_errors=True)
    write_pages(1, one, start=900_000 + int(time.time()) % 10_000)
    r.ingest(one, wh)
    again = _run_child([r.exe, "publish", str(dest), "--warehouse", str(wh), "--json"], env=r.env)
    sent = again["json"]["bytes_written"]
    lake_sent = again["json"]["bytes_by_format"].get("ducklake", 0)
    return {"case": "publish", "seconds": p["ours"]["seconds"], "cpu_seconds": p["ours"]["cpu_seconds"],
            "floor_seconds": p["floor"]["seconds"], "floor_cpu_seconds": p["floor"]["cpu_seconds"],
            "ratio": p["ratio"], "ratios": p["ratios"], "cpu_ratio": p["cpu_ratio"], "cpu_ratios": p["cpu_ratios"],
            "published_mib": round(total / 2**20, 1), "copied_mib": round(_size(floor_dir) / 2**20, 1),
            "peak_rss_mib": p["ours_peak_rss_mib"], "again_seconds": again["seconds"], "again_bytes": sent,
            "again_fraction": round(sent / total, 4), "again_lake_bytes": lake_sent,
            "again_lake_fraction": round(lake_sent / lake_total, 4)}


def _publish_line(res: dict) -> str:
    return (f"publish a whole source's warehouse, both layouts ({res['published_mib']} MiB)  {res['seconds']:.1f}s, "
            f"{res['cpu_seconds']:.1f} CPU-s (peak RSS {res['peak_rss_mib']:.0f} MiB)  |  COPY of its tables to "
            f"Parquet ({res['copied_mib']} MiB) {res['floor_seconds']:.1f}s, {res['floor_cpu_seconds']:.1f} CPU-s  |  "
            f"wall ratio {res['ratio']:.2f} (pairs {res['ratios']}), CPU ratio {res['cpu_ratio']:.2f} "
            f"(pairs {res['cpu_ratios']})  goal <= 2: {_met(max(res['ratio'], res['cpu_ratio']) <= 2)}\n"
            f"        after one new page, published again in {res['again_seconds']:.1f}s: the DuckLake "
            f"{res['again_lake_bytes']:,} bytes ({100 * res['again_lake_fraction']:.2f} % of it)  goal <= 1 %: "
            f"{_met(res['again_lake_fraction'] <= 0.01)}; both layouts {res['again_bytes']:,} bytes "
            f"({100 * res['again_fraction']:.2f} % of them)  goal <= 1 %: {_met(res['again_fraction'] <= 0.01)}")


def _source_line(res: dict) -> str:
    worst = max(res["ratio"], res["cpu_ratio"])
    return (f"source  {res['features']} features ({res['active_features']} with {res['excerpts']} excerpts), files "
            f"{res['files']}, activations batch {res['activation_batch_gzip_mib']} MiB gzip, "
            f"{res['input_gzip_mib']} MiB gzip in all\n"
            f"        ingest {res['ours_seconds']:.1f}s, {res['ours_cpu_seconds']:.1f} CPU-s (peak RSS "
            f"{res['ours_peak_rss_mib']:.0f} MiB, {res['activations']} activations, {res['quarantined']} quarantined)  |  "
            f"read_json {res['floor_seconds']:.1f}s, {res['floor_cpu_seconds']:.1f} CPU-s  |  wall ratio "
            f"{res['ratio']:.2f} (pairs {res['ratios']}), CPU ratio {res['cpu_ratio']:.2f} (pairs {res['cpu_ratios']})  "
            f"goal <= 1.5: {_met(worst <= 1.5)}; RSS <= 2048 MiB: {_met(res['ours_peak_rss_mib'] <= 2048)}\n"
            f"        fetch exports (loopback) + ingest {res['fetch_seconds']:.1f}s, {res['fetch_cpu_seconds']:.1f} CPU-s  |  "
            f"wall ratio {res['fetch_ratio']:.2f} (pairs {res['fetch_ratios']}), CPU ratio {res['fetch_cpu_ratio']:.2f} "
            f"(pairs {res['fetch_cpu_ratios']})  goal <= 1.5: {_met(max(res['fetch_ratio'], res['fetch_cpu_ratio']) <= 1.5)}\n"
            f"        unchanged re-run {res['rerun_seconds']:.2f}s = {100 * res['rerun_fraction']:.1f}% of the full "
            f"ingest  goal <= 2%: {_met(res['rerun_fraction'] <= 0.02)}" + _stage_text(res))


def _stage_text(res: dict) -> str:
    stages = res.get("stages")
    if not stages:
        return ""
    return "\n        stages: " + ", ".join(f"{k} {v}" if isinstance(v, str) else f"{k} {v:.2f}s"
                                          for k, v in stages.items())


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _line(res: dict) -> str:
    c = res["case"]
    if c == "full":
        return (f"full    generator {res['generator']} N={res['n_pages']:>5} ({res['input_mib']} MiB)  ingest "
                f"{res['ours_seconds']:.2f}s, {res['ours_cpu_seconds']:.1f} CPU-s "
                f"(peak RSS {res['ours_peak_rss_mib']:.0f} MiB, {res['activations']} activations, "
                f"{res['quarantined']} quarantined)  |  read_json {res['floor_seconds']:.2f}s, "
                f"{res['floor_cpu_seconds']:.1f} CPU-s ({res['floor_activations']} activations)  |  wall ratio "
                f"{res['ratio']:.2f} (pairs {res['ratios']}), CPU ratio {res['cpu_ratio']:.2f} (pairs "
                f"{res['cpu_ratios']})  goal wall and CPU <= 1.5: {_met(max(res['ratio'], res['cpu_ratio']) <= 1.5)}, "
                f"then <= 1.25: {_met(max(res['ratio'], res['cpu_ratio']) <= 1.25)}; RSS <= 1536 MiB: "
                f"{_met(res['ours_peak_rss_mib'] <= 1536)}" + _stage_text(res))
    if c == "source":
        return _source_line(res)
    if c == "rerun":
        return (f"rerun   N={res['n_pages']:>5}  {res['seconds']:.2f}s = {100 * res['fraction_of_full']:.1f}% "
                f"of the full run  goal <= 5%: {_met(res['fraction_of_full'] <= 0.05)}" + _stage_text(res))
    if c == "one":
        return (f"one     1 new page into {res['n_landed']} landed  {res['seconds']:.2f}s, "
                f"{res['cpu_seconds']:.2f} CPU-s  goal <= 2 s: {_met(res['seconds'] <= 2)}; the import floor "
                f"({IMPORT_FLOOR}) {res['import_floor_seconds']:.2f}s: +{res['over_import_floor_seconds']:.2f}s "
                f"(median pair)  goal <= floor + 1 s: {_met(res['over_import_floor_seconds'] <= 1)}; the same "
                f"imports with the collector paused, as the pipeline makes them, {res['paused_import_floor_seconds']:.2f}s: "
                f"+{res['over_paused_floor_seconds']:.2f}s, {_met(res['over_paused_floor_seconds'] <= 1)}; "
                f"featurehouse --help {res['cli_start_seconds']:.2f}s; with FEATUREHOUSE_DATA_DOCS=run (Great "
                f"Expectations in the ingest, as the Airflow deployment has it) {res['data_docs_run_seconds']:.2f}s, "
                f"{res['data_docs_run_cpu_seconds']:.2f} CPU-s"
                + _stage_text(res))
    if res["case"] == "publish":
        return _publish_line(res)
    return (f"export  {res['gzip_mib']} MiB gzip, {res['expanded_mib']} MiB expanded, {res['rows']} rows  "
            f"ingest {res['ours_seconds']:.2f}s (peak RSS {res['ours_peak_rss_mib']:.0f} MiB, "
            f"{res['activations']} loaded, {res['quarantined']} quarantined)  |  read_json "
            f"{res['floor_seconds']:.2f}s  |  wall ratio {res['ratio']:.2f} (pairs {res['ratios']}), CPU ratio "
            f"{res['cpu_ratio']:.2f} (pairs {res['cpu_ratios']})  "
            f"goal <= 1.5: {_met(max(res['ratio'], res['cpu_ratio']) <= 1.5)}; RSS <= 2048 MiB: "
            f"{_met(res['ours_peak_rss_mib'] <= 2048)}"
            + _stage_text(res))


def main() -> None:
    ap = argparse.ArgumentParser(description="featurehouse ingest vs DuckDB read_json, five cases; publish vs COPY")
    ap.add_argument("--n", type=int, action="append", help="pages of the full case (repeatable); default 250 and 1000")
    ap.add_argument("--case", action="append", choices=["full", "rerun", "one", "export", "source", "publish"],
                    help="cases to run (repeatable); default all. rerun and one use the largest N's warehouse; "
                         "publish, the source case's (made by it when missing)")
    ap.add_argument("--export-gib", type=float, default=1.0, help="expanded size of the export batch")
    ap.add_argument("--workdir", type=Path, default=OUT)
    ap.add_argument("--tree", type=Path, default=None, help="run ours from this checkout (PYTHONPATH)")
    ap.add_argument("--pairs", type=int, default=3, help="alternating pairs of ours and its floor per case")
    ap.add_argument("--generator", action="append", choices=["a", "b"],
                    help="page generators of the full case (repeatable; default both, see bench/generate.py)")
    ap.add_argument("--source-features", type=int, default=65_536,
                    help="features of the source case (explanation files of 1,024 rows: 64 by default)")
    ap.add_argument("--source-active", type=int, default=8192,
                    help="features with excerpts (activations batches of 1,024: 8 by default)")
    ap.add_argument("--source-excerpts", type=int, default=16)
    ap.add_argument("--source-tokens", type=int, default=128)
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    cases = a.case or ["full", "rerun", "one", "export", "source", "publish"]
    generators = a.generator or ["a", "b"]
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
            full = done(case_full(r, n, a.pairs))
            if "full" in cases:
                for g in generators:
                    if g != "a":
                        done(case_full(r, n, a.pairs, g))
    if "rerun" in cases:
        done(case_rerun(r, ns[-1], full, a.pairs))
    if "one" in cases:
        done(case_one(r, ns[-1], a.pairs))
    if "export" in cases:
        done(case_export(r, a.export_gib, a.pairs))
    if "source" in cases:
        done(case_source(r, a.source_features, a.source_active, a.source_excerpts, a.source_tokens, a.pairs))
    if "publish" in cases:
        wh = r.workdir / "wh-source"
        if not (wh / "catalog.sqlite").exists():
            src, _ = _source(r, a.source_features, a.source_active, a.source_excerpts, a.source_tokens)
            r.ingest(src, wh)
        done(case_publish(r, wh, a.pairs))


if __name__ == "__main__":
    main()
