"""Benchmark: ingest throughput with 1 and 2 workers on one lakehouse (PostgreSQL catalog, data
files and landing area on S3 — moto's server on loopback), as the nightly DAG's mapped ingests
run: the window's units (50 pages each, or one export batch file each) taken from a queue by W
worker processes, each unit an ``ingest_unit`` part of one run, then ``finish_fetched`` and one
``materialise``.

    python bench/scale_bench.py --n 400 --workers 1 --workers 2      # pages/s
    python bench/scale_bench.py --n 400 --exports                     # and export MB/s

Prints a table and writes bench/out/scale.json, with each run's commit figures (commits,
retries, lock wait, time inside commits) from its ``runs`` row. Not a test: nothing is asserted.
The machine's load average is recorded: on a shared machine the figures move with it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = ROOT / "bench" / "out"
MODEL, SOURCE = "gpt-oss-20b", "11-resid-post-aa"
CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_REGION": "us-east-1"}


def _worker(queue, settings_kw: dict, run_id: str, env: dict) -> None:
    os.environ.update(env)
    from pipeline.config import Settings
    from pipeline.sources.fetch import ingest_unit

    settings = Settings.from_env(**settings_kw)
    while True:
        unit = queue.get()
        if unit is None:
            return
        ingest_unit(unit, settings, run_id=run_id, progress=False)


def _land(settings, window: str, inputs: list[tuple[str, bytes, str]]) -> float:
    """Land (origin, bytes, kind) into the S3 landing area and write the window's manifest, as a
    fetch would; returns seconds."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.sources.manifest import Manifest, manifest_path
    from pipeline.stages.land import land
    from pipeline.stages.receive import Input

    manifest = Manifest(manifest_path(window, settings), settings.landing_root)
    started = time.monotonic()

    def one(item):
        key, data, kind = item
        landed = land(Input(origin=key, data=data), settings.landing_root, settings.max_input_bytes)
        manifest.append({"key": key, "url": f"https://bench/{key}", "kind": kind, "model": MODEL, "source": SOURCE,
                         "status": "landed", "sha256": landed.sha256, "landed_path": str(landed.path),
                         "n_bytes": landed.n_bytes, "attempts": 1, "fetched_at": "2026-11-30T00:00:00"})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, inputs))
    manifest.close()
    return time.monotonic() - started


def _run(settings, units: list[dict], workers: int, run_id: str, env: dict) -> dict:
    from pipeline.sources.fetch import finish_fetched
    from pipeline.stages.materialise import refresh_run
    from tests.conftest import query

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    for u in units:
        queue.put(u)
    for _ in range(workers):
        queue.put(None)
    kw = {"warehouse": str(settings.warehouse), "catalog": settings.catalog, "data_path": settings.data_path,
          "landing": settings.landing}
    started = time.monotonic()
    procs = [ctx.Process(target=_worker, args=(queue, kw, run_id, env)) for _ in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0, f"a worker exited {p.exitcode}"
    loads = time.monotonic() - started
    finish_fetched(units[0]["window"], settings, run_id=run_id)
    refresh_run(settings, run_id)
    total = time.monotonic() - started
    row = query(settings, "SELECT n_loaded, n_activations, commits, commit_retries, lock_wait_seconds, commit_seconds "
                          "FROM runs WHERE run_id = ?", [run_id])[0]
    return {"workers": workers, "units": len(units), "load_seconds": round(loads, 2),
            "with_finish_and_materialise_seconds": round(total, 2),
            **dict(zip(("n_loaded", "n_activations", "commits", "commit_retries", "lock_wait_seconds",
                        "commit_seconds"), row))}


def _on_s3(tmp: Path, pg, db: str, landing: str):
    """Settings of a new warehouse with its catalog in a new PostgreSQL database ``db`` and its
    data files on S3, sharing ``landing``."""
    import psycopg

    from pipeline.config import Settings

    with psycopg.connect(pg.catalog.split(":", 1)[1], autocommit=True) as c:
        c.execute(f"CREATE DATABASE {db}")
    return Settings.from_env(warehouse=tmp / db, catalog=pg.catalog.replace("dbname=featurehouse", f"dbname={db}"),
                             data_path=f"s3://bench/{db}/", landing=landing)


def _vs_local(pairs: int, tmp: Path, pg, landing: str, exports: list, export_mb: float, env: dict) -> dict:
    """The export batches loaded by one worker on PostgreSQL + S3 and on local disk (SQLite
    catalog, data and landing in the warehouse folder), in turn, ``pairs`` times: S3's
    throughput as a share of local disk's, pair by pair (the same rows, the same code)."""
    import statistics

    from pipeline.config import Settings
    from pipeline.sources.night import ingest_units

    unit = [{"window": "exports", "model": MODEL, "source": SOURCE, "via": "exports"}]
    shares, runs = [], []
    for i in range(pairs):
        s3 = _on_s3(tmp, pg, f"bench_vs_{i}", landing)
        on_s3 = _run(s3, ingest_units(unit, s3), 1, f"bench-vs-s3-{i}", env)
        local = Settings.from_env(warehouse=tmp / f"local_{i}")
        _land(local, "exports", exports)  # its own landing area, on disk (not timed)
        on_disk = _run(local, ingest_units(unit, local), 1, f"bench-vs-local-{i}", env)
        share = on_disk["load_seconds"] / on_s3["load_seconds"]  # throughput S3 / throughput local
        shares.append(round(share, 3))
        runs.append({"s3_seconds": on_s3["load_seconds"], "local_seconds": on_disk["load_seconds"],
                     "s3_mb_per_second": round(export_mb / on_s3["load_seconds"], 2),
                     "local_mb_per_second": round(export_mb / on_disk["load_seconds"], 2), "share": round(share, 3)})
    return {"pairs": runs, "s3_share_of_local_median": round(statistics.median(shares), 3), "shares": sorted(shares),
            "goal": "S3 export throughput >= 50% of local disk's"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400, help="synthetic pages (~270 KB each)")
    ap.add_argument("--unit", type=int, default=50, help="pages per ingest unit (a fetch chunk)")
    ap.add_argument("--workers", type=int, action="append", help="worker counts to try (default 1 and 2)")
    ap.add_argument("--exports", action="store_true", help="also export batches (gzip JSONL), MB/s")
    ap.add_argument("--batch-features", type=int, help="features per export batch file (default n/8)")
    ap.add_argument("--no-pages", action="store_true", help="export batches only")
    ap.add_argument("--vs-local", type=int, default=0, metavar="PAIRS",
                    help="with --exports: also load the export batches with one worker into a local warehouse "
                         "(SQLite catalog, data and landing on disk), alternating with S3, PAIRS times; "
                         "prints S3's throughput as a share of local disk's")
    args = ap.parse_args()
    counts = args.workers or [1, 2]

    import boto3
    import orjson

    from bench.generate import synthetic_pages
    from pipeline.config import Settings
    from pipeline.sources.night import ingest_units
    from tests.airflow_helpers import free_port, postgres_cluster, start, stop, wait_for_port
    from tests.fake_neuronpedia import build_bucket

    tmp = Path(tempfile.mkdtemp(prefix="scale-bench-"))
    port = free_port()
    moto = start([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                 dict(os.environ), tmp / "moto.log")
    endpoint = f"http://127.0.0.1:{port}"
    env = CREDS | {"FEATUREHOUSE_S3_ENDPOINT": endpoint}
    os.environ.update(env)
    results: dict = {"n_pages": args.n, "unit": args.unit, "load_average": os.getloadavg(), "runs": []}
    try:
        wait_for_port(port, 60, moto, "moto_server")
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=CREDS["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=CREDS["AWS_SECRET_ACCESS_KEY"]).create_bucket(Bucket="bench")
        pages = list(synthetic_pages(args.n, valid=True))
        bodies = [(f"{MODEL}/{SOURCE}/{p['index']}", orjson.dumps(p), "feature") for p in pages]
        mb = sum(len(b) for _, b, _ in bodies) / 1e6
        with postgres_cluster() as pg:
            landing = "s3://bench/landing"
            base = Settings.from_env(warehouse=tmp / "wh", landing=landing)
            results["land_pages_seconds"] = round(_land(base, "pages", bodies), 2)
            chunks = [{"window": "pages", "model": MODEL, "source": SOURCE, "via": "api", "start": a,
                       "stop": min(a + args.unit, args.n)} for a in range(0, args.n, args.unit)]
            exports = []
            if args.exports:
                objects = build_bucket(pages, batch_features=args.batch_features or max(1, args.n // 8))
                exports = [(k, v, "export") for k, v in objects.items()]
                results["export_mb"] = round(sum(len(v) for k, v in objects.items() if k.endswith(".gz")) / 1e6, 1)
                results["land_exports_seconds"] = round(_land(base, "exports", exports), 2)
            for w in counts:
                for what in (*(() if args.no_pages else ("pages",)), *(("exports",) if exports else ())):
                    s = _on_s3(tmp, pg, f"bench_{what}_{w}", landing)
                    units = ingest_units(chunks if what == "pages" else
                                         [{"window": "exports", "model": MODEL, "source": SOURCE, "via": "exports"}], s)
                    r = _run(s, units, w, f"bench-{what}-{w}", env)
                    r["what"] = what
                    if what == "pages":
                        r["pages_per_second"] = round(args.n / r["load_seconds"], 1)
                        r["input_mb_per_second"] = round(mb / r["load_seconds"], 1)
                    else:
                        r["export_mb_per_second"] = round(results["export_mb"] / r["load_seconds"], 2)
                    results["runs"].append(r)
                    print(json.dumps(r), flush=True)
            if args.vs_local and exports:
                results["vs_local"] = _vs_local(args.vs_local, tmp, pg, landing, exports, results["export_mb"], env)
                print(json.dumps(results["vs_local"]), flush=True)
    finally:
        stop(moto, grace=5)
    results["load_average_after"] = os.getloadavg()
    OUT.mkdir(parents=True, exist_ok=True)
    name = "scale-exports.json" if args.no_pages else "scale.json"
    (OUT / name).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}))
    for line in _goals(results):
        print(line)


def _goals(results: dict) -> list[str]:
    """Issue 18's scale-out goals, each with the figure measured here and whether it is met."""
    out = []
    for what in ("pages", "exports"):
        runs = {r["workers"]: r for r in results["runs"] if r["what"] == what}
        if 1 in runs:
            one = runs[1]
            share = one["commit_seconds"] / one["load_seconds"]
            out.append(f"{what}: commit lock held {100 * share:.1f}% of one writer's wall time "
                       f"(goal <= 10%: {'met' if share <= 0.10 else 'NOT met'})")
        if 1 in runs and 2 in runs:
            speedup = runs[1]["load_seconds"] / runs[2]["load_seconds"]
            out.append(f"{what}: two writers {speedup:.2f}x as fast as one "
                       f"(goal: no slower, >= 1.0: {'met' if speedup >= 1.0 else 'NOT met'})")
    if "vs_local" in results:
        share = results["vs_local"]["s3_share_of_local_median"]
        out.append(f"exports: S3 throughput {100 * share:.0f}% of local disk's (median of pairs "
                   f"{results['vs_local']['shares']}; goal >= 50%: {'met' if share >= 0.5 else 'NOT met'})")
    return out


if __name__ == "__main__":
    main()
