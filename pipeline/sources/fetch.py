"""Fetch stage: feature pages from Neuronpedia's API, or a source's bulk exports, into the
landing area, resumably, within a rate budget: the fetch loop and its progress.

Fetching never writes the warehouse (several fetches may run at once; DuckDB has one writer).
Each body is landed untouched (``landing/sha256/...``) and one line per URL is appended to the
window's manifest, ``landing/fetch/<window>.jsonl``. A rerun with the same window skips what
that manifest says already landed. Each fetch also records when it started
(``pipeline.sources.starts``).

The HTTP client (retries, rate budget, the API key) is ``pipeline.sources.api``; the manifest
``pipeline.sources.manifest``; listing and streaming exports ``pipeline.sources.exports``; what a
fetch did (:class:`FetchResult`) ``pipeline.sources.result``;
whether a source exists ``pipeline.sources.existence``; ingesting what a window landed
(:func:`ingest_fetched`, :func:`finish_fetched`, ...) ``pipeline.sources.fetched``. This
module re-exports those names, so ``pipeline.sources.fetch.X`` keeps working.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import orjson
from tqdm import tqdm

from ..config import Settings
from ..ingest import new_run_id
from ..lake import s3
from ..lake.landing import Where, scratch_dir
from ..lake.warehouse import utcnow
from ..stages.land import land
from ..stages.receive import Input
from . import budget
from .api import (
    DEFAULT_BASE_URL,
    DEFAULT_EXPORTS_URL,
    BadApiKey,
    Cancelled,
    Client,
    FetchFailed,
    NotFound,
    _feature_url,
)
from .existence import missing_source, settle_source
from .exports import (
    ListObjectsV2,
    OffsetPaging,
    export_prefix,
    remove_stale_spool,
    select_exports,
)
from .fetched import finish_fetched, in_unit, ingest_fetched, ingest_unit, judge_run
from .manifest import Manifest, manifest_path, read_manifest
from .result import FetchResult
from .starts import first_fetch_start, record_fetch_start

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_EXPORTS_URL",
    "FetchResult",
    "LOG_EVERY",
    "attempts",
    "fetch_exports",
    "fetch_features",
    "ingest_fetched",
    "ingest_unit",
    "finish_fetched",
    "judge_run",
    "first_fetch_start",
    "record_fetch_start",
    "in_unit",
    "missing_source",
    "settle_source",
    "manifest_path",
    "read_manifest",
    "BadApiKey",
]

log = logging.getLogger("featurehouse.fetch")


# --- the fetch loop -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    key: str
    url: str
    kind: str  # feature | offset | export
    run: Callable[[], dict[str, Any]]
    """Performs the fetch and returns the manifest fields it learnt (status, sha256, ...)."""


#: Seconds between the progress lines a fetch logs (the bar is for terminals; an Airflow task's
#: log gets these): at most this long apart while the fetch runs, whether or not a URL finished
#: meanwhile (a slow answer, a ``Retry-After`` wait), each saying what is done and what is in flight.
LOG_EVERY = 30.0


class _Progress:
    """A fetch's progress: the terminal's bar, and a line in the log at least every
    :data:`LOG_EVERY` seconds (from a thread of its own, stopped by :meth:`close`)."""

    def __init__(self, result: FetchResult, total: int | None, show: bool, desc: str):
        self.result = result
        self.bar = tqdm(total=total, unit="page", desc=desc, disable=not show, dynamic_ncols=True)
        self.started = time.monotonic()
        self.logged = self.started
        self.total = total
        self.desc = desc
        self._lock = threading.Lock()
        self._flying: dict[int, tuple[str, float]] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="fetch-progress", daemon=True)
        self._ticker.start()

    @contextlib.contextmanager
    def flying(self, url: str):
        """The block asks for ``url`` (retries and waits included): it is in flight meanwhile."""
        n = next(self._ids)
        with self._lock:
            self._flying[n] = (url, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._flying.pop(n, None)

    def update(self) -> None:
        r = self.result
        elapsed = max(time.monotonic() - self.started, 1e-6)
        done = r.n_landed + r.n_not_found + r.n_failed
        self.bar.set_postfix(landed=r.n_landed, failed=r.n_failed, not_found=r.n_not_found,
                             skipped=r.n_skipped_already_landed,
                             per_hour=int(done / elapsed * 3600), refresh=False)
        self.bar.update(1)
        self._log_if_due()

    def _tick(self) -> None:
        while True:
            with self._lock:
                due = self.logged + LOG_EVERY
            if self._stop.wait(max(0.01, due - time.monotonic())):
                return
            self._log_if_due()

    def _log_if_due(self) -> None:
        # Composed and logged under the lock: lines come out in the order they were counted (the
        # last one has the final counts), whichever thread logs them.
        with self._lock:
            now = time.monotonic()
            if now - self.logged < LOG_EVERY:
                return
            self.logged = now
            flying = min(self._flying.values(), key=lambda f: f[1], default=None)
            r = self.result
            elapsed = max(now - self.started, 1e-6)
            done = r.n_landed + r.n_not_found + r.n_failed
            of = f" of {self.total:,}" if self.total else ""
            air = (f"; {len(self._flying)} in flight, the longest for {now - flying[1]:.0f} s: {flying[0]}"
                   if flying else "; none in flight")
            log.info("%s: %d%s done in %.0f s (landed %d, failed %d, not found %d, already landed %d; %d an hour)%s",
                     self.desc, done + r.n_skipped_already_landed, of, elapsed, r.n_landed, r.n_failed,
                     r.n_not_found, r.n_skipped_already_landed, int(done / elapsed * 3600), air)

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not threading.current_thread():
            self._ticker.join(timeout=5)
        self.bar.close()


class _Fetcher:
    def __init__(self, client: Client, manifest: Manifest, result: FetchResult, model: str,
                 source: str, progress: _Progress):
        self.client = client
        self.manifest = manifest
        self.result = result
        self.model = model
        self.source = source
        self.progress = progress
        self.asking = 0
        """URLs this fetch asks for (not already landed), counted before any is asked."""

    def run_job(self, job: _Job) -> dict[str, Any] | None:
        base = {"key": job.key, "url": job.url, "kind": job.kind, "model": self.model, "source": self.source}
        try:
            with self.progress.flying(job.url):
                (fields, attempts) = self.client.call(job.url, job.run)
            entry = base | {"attempts": attempts, "last_error": None} | fields
        except Cancelled:
            return None  # stopping: leave no line, so a rerun asks for this URL again
        except NotFound as exc:
            entry = base | {"status": "not_found", "attempts": getattr(exc, "attempts", 1),
                            "http_status": 404, "sha256": None, "landed_path": None,
                            "last_error": "feature not found (HTTP 404)"}
        except FetchFailed as exc:
            entry = base | {"status": "failed", "attempts": exc.attempts, "http_status": exc.status,
                            "sha256": None, "landed_path": None,
                            "last_error": self.client.redact(str(exc))}
        except Exception as exc:  # a bug or a local disk problem: record it, keep going
            # No traceback: its frames' text could carry the key; the redacted message is enough.
            log.error("unexpected error fetching %s: %s", job.url,
                      self.client.redact(f"{type(exc).__name__}: {exc}"))
            entry = base | {"status": "failed", "attempts": 0, "http_status": None, "sha256": None,
                            "landed_path": None,
                            "last_error": self.client.redact(f"{type(exc).__name__}: {exc}")}
        entry["fetched_at"] = utcnow().isoformat()
        self.manifest.append(entry)
        return entry

    def record(self, entry: dict[str, Any] | None) -> None:
        if entry is None:
            return
        r = self.result
        status = entry["status"]
        if status in ("landed", "empty"):
            r.n_landed += status == "landed"
        elif status == "not_found":
            r.n_not_found += 1
        else:
            r.n_failed += 1
            r.failures.append({k: entry.get(k) for k in
                               ("url", "key", "http_status", "attempts", "last_error")})
            # an operator reading the task's log sees each lost URL, with the count so far out of
            # what this try asks for (as FetchChunkFailed counts), not out of the whole chunk
            log.warning("lost %s after %s: %s (%d of %d URL(s) lost so far%s)", entry.get("url"),
                        attempts(entry.get("attempts")), entry.get("last_error"), r.n_failed,
                        max(self.asking, r.n_failed), f"; {r.earlier()}" if r.earlier() else "")
        self.progress.update()

    def run_all(self, jobs: Iterable[_Job], concurrency: int) -> None:
        """Run jobs with at most ``concurrency`` in flight (and as many again queued)."""
        todo = []
        for job in jobs:  # first, so that a lost URL's count says out of how many
            if self.manifest.landed(job.key):
                self.result.n_skipped_already_landed += 1
                self.progress.bar.update(1)
            else:
                todo.append(job)
        self.asking += len(todo)
        pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="fetch")
        try:
            pending: set[Future] = set()
            for job in todo:
                self.result.n_requested += 1
                pending.add(pool.submit(self.run_job, job))
                if len(pending) >= 2 * concurrency:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for f in done:
                        self.record(f.result())
            for f in pending:
                self.record(f.result())
        except BaseException:
            self.client.cancelled.set()  # in-flight workers give up at their next wait
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


def attempts(n: Any) -> str:
    """A count of attempts in words: 1 attempt, 6 attempts."""
    return f"{n} attempt" + ("" if n == 1 else "s")


def _feature_job(client: Client, landing: Where, base_url: str, model: str, source: str, index: int,
                 max_bytes: int) -> _Job:
    url = _feature_url(base_url, model, source, index)

    def run() -> dict[str, Any]:
        body = client.get_json_body(url, with_key=True)
        landed = land(Input(origin=url, data=body), landing, max_bytes)
        return {"status": "landed", "http_status": 200, "sha256": landed.sha256,
                "landed_path": str(landed.path), "n_bytes": landed.n_bytes}

    return _Job(f"{model}/{source}/{index}", url, "feature", run)


def _offset_job(client: Client, landing: Where, base_url: str, model: str, source: str, offset: int,
                max_bytes: int) -> _Job:
    url = f"{base_url.rstrip('/')}/api/features-offset"
    origin = f"{url}#modelId={quote(model)}&layer={quote(source)}&offset={offset}"

    def run() -> dict[str, Any]:
        body = client.post_json_body(url, {"modelId": model, "layer": source, "offset": offset}, with_key=True)
        items = orjson.loads(body)
        n = len(items) if isinstance(items, list) else len(items.get("features") or []) if isinstance(items, dict) else 0
        if n == 0:  # past the last feature: nothing to land
            return {"status": "empty", "http_status": 200, "sha256": None, "landed_path": None, "n_items": 0}
        landed = land(Input(origin=origin, data=body), landing, max_bytes)
        return {"status": "landed", "http_status": 200, "sha256": landed.sha256,
                "landed_path": str(landed.path), "n_bytes": landed.n_bytes, "n_items": n}

    return _Job(f"{model}/{source}/offset/{offset}", origin, "offset", run)


def _show(progress: bool | None, total: int | None) -> bool:
    return progress if progress is not None else (total is None or total > 20)


def fetch_features(
    model: str,
    source: str,
    indices: Iterable[int] | None = None,
    *,
    all_features: bool = False,
    settings: Settings | None = None,
    base_url: str = DEFAULT_BASE_URL,
    api_key: str | None = None,
    concurrency: int = 4,
    requests_per_hour: int = 20_000,
    window: str | None = None,
    timeout: float = 30.0,
    max_attempts: int = 6,
    progress: bool | None = None,
    backoff: float = 1.0,
    max_backoff: float = 60.0,
) -> FetchResult:
    """Fetch feature pages of ``model``/``source`` from the Neuronpedia API into the landing area.

    Either the given ``indices`` (``GET /api/feature/{model}/{source}/{index}``) or, with
    ``all_features``, every feature that has activations, 25 at a time through
    ``POST /api/features-offset``. Up to ``concurrency`` requests run at once, within
    ``requests_per_hour``. Transient failures are retried up to ``max_attempts`` times with
    exponential backoff from ``backoff`` seconds (capped at ``max_backoff``) and jitter,
    honouring ``Retry-After``; a 404 is recorded as "feature not found". Each URL's outcome
    is appended to the window's manifest; URLs the manifest says already landed in this
    ``window`` are skipped. The warehouse is not touched: call :func:`ingest_fetched` next.
    Whether the source exists at all is :func:`missing_source`'s question.
    """
    if (indices is None) == (not all_features):
        raise ValueError("give either feature indices or all_features=True (not both, not neither)")
    began = utcnow()
    settings = settings or Settings.from_env()
    window = window or new_run_id("fetch")
    manifest = Manifest(manifest_path(window, settings), settings.landing_root)
    record_fetch_start(window, began, settings)  # the window's first is when its night began
    result = FetchResult(window=window, manifest=str(manifest.path))
    started = time.monotonic()
    client = Client(api_key=api_key, timeout=timeout, max_attempts=max_attempts, concurrency=concurrency,
                     requests_per_hour=requests_per_hour, backoff=backoff, max_backoff=max_backoff,
                     shared=budget.shared_budget(settings.warehouse, requests_per_hour, concurrency))
    landing, limit = settings.landing_root, settings.max_input_bytes
    try:
        if not all_features:
            todo = sorted(set(int(i) for i in indices))  # type: ignore[union-attr]
            if any(i < 0 for i in todo):
                raise ValueError("feature indices are numbers ≥ 0")
            bar = _Progress(result, len(todo), _show(progress, len(todo)), f"fetch {model}/{source}")
            try:
                fetcher = _Fetcher(client, manifest, result, model, source, bar)
                fetcher.run_all((_feature_job(client, landing, base_url, model, source, i, limit) for i in todo),
                                concurrency)
            finally:
                bar.close()
        else:
            bar = _Progress(result, None, _show(progress, None), f"fetch {model}/{source} (all)")
            try:
                _fetch_all(client, manifest, result, bar, landing, base_url, model, source, limit, concurrency)
            finally:
                bar.close()
    finally:
        client.close()
        manifest.close()
    result.seconds = round(time.monotonic() - started, 3)
    return result


def _fetch_all(client: Client, manifest: Manifest, result: FetchResult, bar: _Progress, landing: Where,
               base_url: str, model: str, source: str, limit: int, concurrency: int) -> None:
    """Page through features-offset in waves of ``concurrency`` pages, until a short page."""
    paging = OffsetPaging()
    fetcher = _Fetcher(client, manifest, result, model, source, bar)
    offsets = paging.offsets()
    while True:
        wave = [next(offsets) for _ in range(max(1, concurrency))]
        jobs = [_offset_job(client, landing, base_url, model, source, o, limit) for o in wave]
        fetcher.run_all(jobs, concurrency)
        entries = [manifest.entries.get(j.key) or {} for j in jobs]
        counts = [e.get("n_items") for e in entries if e.get("status") in ("landed", "empty")]
        if not counts or any(paging.is_last(n) for n in counts if n is not None):
            return


def fetch_exports(
    model: str,
    source: str,
    *,
    batches: range | None = None,
    settings: Settings | None = None,
    exports_url: str = DEFAULT_EXPORTS_URL,
    window: str | None = None,
    progress: bool | None = None,
    timeout: float = 60.0,
    max_attempts: int = 6,
    concurrency: int = 2,
    requests_per_hour: int = 20_000,
    backoff: float = 1.0,
    max_backoff: float = 60.0,
) -> FetchResult:
    """Download a source's bulk exports from the ``neuronpedia-datasets`` bucket.

    Lists ``v1/{model}/{source}/`` through S3 ListObjectsV2 (following continuation tokens),
    then streams ``model.jsonl``, ``source.jsonl``, ``sourceset.jsonl`` and the
    ``features|explanations|activations/batch-N.jsonl.gz`` files (only batches numbered in
    ``batches`` when given) straight into the landing area, never whole in memory. A file is
    landed only when it arrived whole: its length matches ``Content-Length`` and the listing,
    and its gzip stream decompresses to the end with a good CRC; otherwise it is fetched
    again, as for any transient failure. No API key is sent to the bucket.
    """
    began = utcnow()
    settings = settings or Settings.from_env()
    window = window or new_run_id("fetch")
    manifest = Manifest(manifest_path(window, settings), settings.landing_root)
    record_fetch_start(window, began, settings)  # the window's first is when its night began
    result = FetchResult(window=window, manifest=str(manifest.path))
    started = time.monotonic()
    client = Client(api_key=None, timeout=timeout, max_attempts=max_attempts, concurrency=concurrency,
                     requests_per_hour=requests_per_hour, backoff=backoff, max_backoff=max_backoff,
                     shared=budget.shared_budget(settings.warehouse, requests_per_hour, concurrency))
    bucket = exports_url.rstrip("/")
    prefix = export_prefix(model, source)
    # (a local landing area only: on S3 the spool is the system's temp folder, others' too)
    if not s3.is_s3(settings.landing_root) and (removed := remove_stale_spool(settings.landing_root)):
        log.warning("removed %d partial download(s) a stopped fetch left in %s", removed,
                    scratch_dir(settings.landing_root))
    try:
        listing = ListObjectsV2(bucket, prefix)
        objects = []

        def list_page(url: str, params: Any) -> bytes:
            with lister.flying(f"{url}?prefix={prefix}"):
                return client.call(f"{url}?prefix={prefix}", lambda: client.get_bytes(url, params))[0]

        lister = _Progress(result, None, False, f"exports {model}/{source} (listing)")
        try:
            for page in listing.pages(list_page):
                objects.extend(page)
        finally:
            lister.close()
        chosen = select_exports(objects, prefix, batches)
        result.n_listed, result.n_batches = len(objects), sum("/batch-" in o.key for o in chosen)
        if not chosen:
            log.warning("no export files under %s/%s", bucket, prefix)
        landing = settings.landing_root

        def job(obj) -> _Job:
            url = f"{bucket}/{quote(obj.key)}"

            def run() -> dict[str, Any]:
                sha, path, n = client.download(url, landing, size=obj.size, gzip=obj.key.endswith(".gz"))
                return {"status": "landed", "http_status": 200, "sha256": sha, "landed_path": str(path),
                        "n_bytes": n}

            return _Job(obj.key, url, "export", run)

        bar = _Progress(result, len(chosen), _show(progress, len(chosen)), f"exports {model}/{source}")
        try:
            _Fetcher(client, manifest, result, model, source, bar).run_all(map(job, chosen), concurrency)
        finally:
            bar.close()
    except FetchFailed as exc:  # the listing itself could not be read: nothing else can be done
        result.n_failed += 1
        result.failures.append({"url": f"{bucket}/?list-type=2&prefix={prefix}", "key": prefix,
                                "http_status": exc.status, "attempts": exc.attempts, "last_error": str(exc)})
        manifest.append({"key": prefix, "url": f"{bucket}/?list-type=2&prefix={prefix}", "kind": "listing",
                         "model": model, "source": source, "status": "failed", "attempts": exc.attempts,
                         "http_status": exc.status, "sha256": None, "landed_path": None,
                         "last_error": str(exc), "fetched_at": utcnow().isoformat()})
    finally:
        client.close()
        manifest.close()
    result.seconds = round(time.monotonic() - started, 3)
    return result

