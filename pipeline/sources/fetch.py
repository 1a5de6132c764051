"""Fetch stage: feature pages from Neuronpedia's API, or a source's bulk exports, into the
landing area, resumably, within a rate budget.

Fetching never writes the warehouse (several fetches may run at once; DuckDB has one writer).
Each body is landed untouched (``landing/sha256/...``) and one line per URL is appended to the
window's manifest, ``landing/fetch/<window>.jsonl``. A rerun with the same window skips what
that manifest says already landed. :func:`ingest_fetched` then loads what a window landed
through the ordinary ingest path and records what could not be fetched in ``fetch_failures``.
Each fetch also records when it started (``landing/fetch/.starts/<window>.jsonl``): the
window's first start is when a night's run began (:func:`finish_fetched`).

The HTTP client (retries, rate budget, the API key) is ``pipeline.sources.api``; the manifest
``pipeline.sources.manifest``; listing and streaming exports ``pipeline.sources.exports``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson
from tqdm import tqdm

from ..config import Settings
from ..ingest import ingest, new_run_id
from ..lake import runstate, s3, warehouse
from ..lake.landing import Where, scratch_dir
from ..lake.runstate import RunSummary
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
)
from .exports import (
    ListObjectsV2,
    OffsetPaging,
    export_prefix,
    remove_stale_spool,
    select_exports,
)
from .manifest import Manifest, landed_where, manifest_path, read_manifest

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_EXPORTS_URL",
    "FetchResult",
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


# --- result -------------------------------------------------------------------------------


@dataclass
class FetchResult:
    """What one fetch did; ``as_dict()`` is small enough to pass between Airflow tasks."""

    window: str
    n_requested: int = 0
    n_landed: int = 0
    n_skipped_already_landed: int = 0
    n_not_found: int = 0
    n_failed: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    manifest: str = ""
    n_listed: int | None = None
    """Exports: the files the bucket lists under the source (None for the API)."""
    n_batches: int | None = None
    """Exports: the batch files chosen among them (None for the API)."""
    missing_source: str | None = None
    """Why the source does not exist, when :func:`settle_source` found so (else None)."""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["failures"] = d["failures"][:100]
        return d

    def earlier(self) -> str:
        """What a count out of what this try asked for leaves out when a retry skipped what had
        landed ("12 more landed in an earlier try"), so that it is not read as out of the whole
        chunk; "" when nothing was skipped."""
        n = self.n_skipped_already_landed
        return f"{n} more landed in an earlier try" if n else ""


# --- when a window's fetching began -------------------------------------------------------


def _starts_path(window: str, settings: Settings) -> Where:
    """``landing/fetch/.starts/<window>.jsonl`` (on S3, parts under ``.../fetch/.starts/<window>/``):
    beside the manifests, never taken for one (a window's name never starts with '.')."""
    manifest_path(window, settings)  # the same check of the window's name
    root = settings.landing_root
    if s3.is_s3(root):
        return f"{root}/fetch/.starts/{window}/"
    return Path(root) / "fetch" / ".starts" / f"{window}.jsonl"


def record_fetch_start(window: str, at: datetime, settings: Settings | None = None) -> None:
    """Record that a fetch of ``window`` started ``at`` (naive UTC): one line per fetch (a
    retried chunk adds its own), ``{"fetch_started": ..., "host": ..., "pid": ...}``."""
    settings = settings or Settings.from_env()
    path = _starts_path(window, settings)
    line = orjson.dumps({"fetch_started": at.isoformat(), "host": os.uname().nodename, "pid": os.getpid()}) + b"\n"
    if s3.is_s3(path):  # no appends: a part of its own, named by the time
        s3.put_bytes(f"{path}{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.jsonl", line)
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # one write: lines never interleave
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def first_fetch_start(window: str, settings: Settings | None = None) -> datetime | None:
    """When the window's first fetch started (naive UTC): the nightly run's ``started_at``. None
    when no fetch recorded its start (a window fetched before they did, or none fetched)."""
    settings = settings or Settings.from_env()
    path = _starts_path(window, settings)
    if s3.is_s3(path):
        data = b"".join(s3.get_bytes(url) for url in s3.list_keys(str(path)))
    elif Path(path).exists():
        data = Path(path).read_bytes()
    else:
        return None
    starts = []
    for line in data.splitlines():
        try:
            starts.append(datetime.fromisoformat(orjson.loads(line)["fetch_started"]).replace(tzinfo=None))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a partial last line of a killed fetch
    return min(starts, default=None)


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


def _feature_url(base_url: str, model: str, source: str, index: int) -> str:
    return f"{base_url.rstrip('/')}/api/feature/{quote(model, safe='')}/{quote(source, safe='')}/{index}"


# --- whether a source exists ---------------------------------------------------------------


def missing_source(result: FetchResult, model: str, source: str, *, asked: range | None = None,
                   all_features: bool = False, batches: range | None = None, base_url: str = DEFAULT_BASE_URL,
                   api_key: str | None = None, timeout: float = 30.0, max_attempts: int = 6,
                   backoff: float = 1.0, settings: Settings | None = None) -> str | None:
    """Why ``model``/``source`` does not exist, judging by what a fetch found, or None.

    - feature indices (``asked``): every one asked for was a 404, and so is the source's
      feature 0 (Neuronpedia numbers a source's features from 0; asked once, only then). When
      feature 0 is there the range is past the source's end: merely not found. When the site
      cannot say (failing itself), nothing is decided here.
    - ``all_features``: features-offset had no feature at all (an empty first page).
    - exports (``result.n_listed`` set): the listing is empty, or holds no batch file (in
      ``batches``).
    """
    if result.n_listed is not None:
        prefix = export_prefix(model, source)
        if result.n_listed == 0:
            return f"the export listing of {prefix} is empty: no such source in the bucket"
        if not result.n_batches:
            return (f"none of the {result.n_listed} export file(s) under {prefix} is a batch numbered "
                    f"{batches.start}:{batches.stop}" if batches is not None
                    else f"the export listing of {prefix} holds no batch file")
        return None
    if all_features:
        settings = settings or Settings.from_env()
        first = read_manifest(manifest_path(result.window, settings)).get(f"{model}/{source}/offset/0", {})
        return (f"features-offset has no feature of it (an empty first page): no such source on {base_url}"
                if first.get("status") == "empty" else None)
    if not (result.n_requested and result.n_not_found == result.n_requested and not result.n_skipped_already_landed):
        return None
    if asked is None or 0 not in asked:
        url = _feature_url(base_url, model, source, 0)
        client = Client(api_key=api_key, timeout=timeout, max_attempts=max_attempts, concurrency=1,
                        requests_per_hour=3600, backoff=backoff, max_backoff=60.0)
        try:
            client.call(url, lambda: client.get_json_body(url, with_key=True))
            return None  # feature 0 is there: the source exists
        except NotFound:
            pass
        except (FetchFailed, Cancelled):
            return None  # the site cannot say now
        finally:
            client.close()
    return (f"all {result.n_requested} feature(s) asked for were not found (HTTP 404), and neither is "
            f"feature 0: no such source on {base_url}")


def settle_source(result: FetchResult, model: str, source: str, url: str, missing: str | None,
                  settings: Settings | None = None) -> None:
    """Record in the window's manifest what is known of the source itself (key ``model/source``,
    ``kind`` "source"): a failed URL when ``missing`` says it does not exist, which
    ``fetch_failures`` then keeps with the reason; "found" when it does and an earlier attempt
    of the window said otherwise, so that only the latest word is recorded. ``result`` counts
    the failure."""
    settings = settings or Settings.from_env()
    key = f"{model}/{source}"
    manifest = Manifest(manifest_path(result.window, settings), settings.landing_root)
    try:
        if missing is None and manifest.entries.get(key, {}).get("status") != "failed":
            return
        entry = {"key": key, "url": url, "kind": "source", "model": model, "source": source,
                 "status": "failed" if missing else "found", "attempts": 1 if missing else 0,
                 "http_status": 404 if missing else None, "sha256": None, "landed_path": None,
                 "last_error": missing, "fetched_at": utcnow().isoformat()}
        manifest.append(entry)
    finally:
        manifest.close()
    if missing:
        result.missing_source = missing
        result.n_failed += 1
        result.failures.append({k: entry.get(k) for k in ("url", "key", "http_status", "attempts", "last_error")})


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


# --- ingest what a window landed ----------------------------------------------------------


def _window_inputs(entries: Iterable[dict[str, Any]], settings: Settings,
                   failures: list[dict[str, Any]]) -> list[Input] | Iterator[Input]:
    """The landed bodies of manifest ``entries`` as inputs; what did not land (or is gone)
    goes to ``failures``. Bodies in an S3 landing area are read ahead by a few threads (small
    ones whole; export batches stay there, for DuckDB to stream)."""
    local: list[Input] = []
    remote: list[dict[str, Any]] = []
    for e in entries:
        if e.get("status") == "landed":
            where = landed_where(e, settings.landing_root)
            if where is None:
                e = e | {"status": "failed", "last_error": "the manifest line names no digest; fetch again"}
            elif s3.is_s3(where):
                remote.append(e | {"landed_path": str(where)})
                continue
            elif Path(where).exists():
                local.append(Input(origin=e["url"], path=Path(where), captured_at=_fetched_at(e)))
                continue
            else:
                e = e | {"status": "failed", "last_error": f"landed file {where} is missing; fetch again"}
        if e.get("status") in ("failed", "not_found"):
            failures.append(e)
    if not remote:
        return local

    def read(e: dict[str, Any]) -> Input | None:
        small = (e.get("n_bytes") or 0) <= settings.max_input_bytes and e.get("kind") != "export"
        try:
            data = s3.get_bytes(e["landed_path"], settings) if small else None
        except Exception as exc:  # gone from the bucket: fetch it again next time
            failures.append(e | {"status": "failed", "last_error": f"landed object {e['landed_path']} "
                                                                   f"cannot be read ({type(exc).__name__}); fetch again"})
            return None
        return Input(origin=e["url"], data=data, captured_at=_fetched_at(e),
                     landed=(e["sha256"], e["landed_path"]))

    def ahead() -> Iterator[Input]:
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="s3-read") as pool:
            yield from local
            for i in range(0, len(remote), 64):  # bounded: at most 64 bodies in hand ahead
                yield from (x for x in pool.map(read, remote[i:i + 64]) if x is not None)

    return ahead()


def ingest_fetched(
    window: str,
    settings: Settings | None = None,
    *,
    run_id: str | None = None,
    trigger: str = "fetch",
    progress: bool | None = None,
    report_after: bool = True,
) -> RunSummary:
    """Ingest everything the window's manifest says landed, and record what did not.

    Landed bodies go through :func:`pipeline.ingest.ingest` (bytes already loaded count as
    duplicates, so running this twice loads nothing twice). Every URL whose latest outcome in
    this window is a failure or a 404 becomes a row of ``fetch_failures`` for this run; the
    run's report (``report_after``) is written after that, so it lists them.
    """
    settings = settings or Settings.from_env()
    entries = read_manifest(manifest_path(window, settings))
    run_id = run_id or new_run_id()
    failures: list[dict[str, Any]] = []
    inputs = _window_inputs(entries.values(), settings, failures)
    # The report is written after fetch_failures holds this run's rows: it lists them and judges by them.
    summary = ingest(inputs, settings, run_id=run_id, trigger=trigger, progress=progress, report_after=False)
    loaded = time.monotonic()
    with warehouse.connect(settings) as conn:
        _record_failures(conn, settings, window, run_id, failures)
        if report_after:  # as in ingest: a report that cannot be written does not fail the run
            from ..ingest import write_run_report

            write_run_report(conn, summary, settings)
            # the run's seconds cover every stage it lists, its report included, and the
            # runs table says the same duration
            summary.seconds = round(summary.seconds + time.monotonic() - loaded, 3)
            runstate.end_run(conn, settings, run_id, utcnow())
    return summary


def _record_failures(conn, settings: Settings, window: str, run_id: str, failures: list[dict[str, Any]]) -> None:
    now = utcnow()

    def record(conn) -> None:
        conn.execute("DELETE FROM fetch_failures WHERE run_id = ?", [run_id])
        if failures:  # one statement from an Arrow table: executemany took 2.5 s for 970 rows
            import pyarrow as pa

            rows = pa.table({"url": [e["url"] for e in failures], "feature_key": [e["key"] for e in failures],
                             "status": [e["status"] for e in failures],
                             "attempts": pa.array([e.get("attempts") for e in failures], pa.int32()),
                             "last_error": pa.array([e.get("last_error") for e in failures], pa.string())})
            conn.register("_fetch_failures", rows)
            try:
                conn.execute('INSERT INTO fetch_failures (run_id, "window", url, feature_key, status, attempts, '
                             "last_error, recorded_at) SELECT ?, ?, url, feature_key, status, attempts, last_error, ? "
                             "FROM _fetch_failures", [run_id, window, now])
            finally:
                conn.unregister("_fetch_failures")

    warehouse.transaction(conn, settings, record, message=f"run {run_id} fetch failures", extra={"run_id": run_id})


def in_unit(entry: dict[str, Any], unit: dict[str, Any]) -> bool:
    """Whether a manifest entry belongs to an ingest unit (see :func:`pipeline.sources.night.ingest_units`):
    the unit's export files by key, or its source's pages in its index range (or all of them)."""
    if "keys" in unit:
        return entry.get("key") in unit["keys"]
    if entry.get("model") != unit["model"] or entry.get("source") != unit["source"]:
        return False
    if unit.get("all"):
        return entry.get("kind") == "offset"
    if entry.get("kind") != "feature":
        return False
    index = str(entry.get("key", "")).rsplit("/", 1)[-1]
    return index.isdigit() and unit["start"] <= int(index) < unit["stop"]


def ingest_unit(unit: dict[str, Any], settings: Settings | None = None, *, run_id: str,
                trigger: str = "airflow", progress: bool | None = False) -> RunSummary:
    """Ingest one unit of a window (one fetch chunk's pages, or one export batch file) as part
    ``unit["part"]`` of ``run_id``, alongside the other units' ingests (any machine, at once).

    Per-feature statistics are refreshed in each batch's commit; the per-source aggregates are
    left to one ``materialise`` after every unit is in, and the run's status and fetch failures
    to :func:`finish_fetched`.
    """
    settings = settings or Settings.from_env()
    entries = read_manifest(manifest_path(unit["window"], settings))
    fetch_started = first_fetch_start(unit["window"], settings)
    inputs = _window_inputs((e for e in entries.values() if in_unit(e, unit)), settings, [])
    with runstate.began_at(fetch_started):  # the first part makes the run's row: it began with the fetch
        return ingest(inputs, settings, run_id=run_id, trigger=trigger, progress=progress, report_after=False,
                      source_stats=False, part=int(unit["part"]))


def finish_fetched(window: str, settings: Settings | None = None, *, run_id: str,
                   failed_parts: int = 0) -> dict[str, Any]:
    """After a window's units are ingested: record what could not be fetched in
    ``fetch_failures`` and close the run (``failed`` when a unit failed, or ``failed_parts``
    says some did — a killed worker's part cannot say so itself: then this raises, so that what
    follows, materialise and the report, does not run on a partial load).

    The run began when the window's first fetch did (:func:`record_fetch_start`): its
    ``started_at`` is then, so its ``seconds`` are the whole night's, from the
    first fetch to this.

    Returns the run's id, status and count of fetch failures, and its verdict, which it logs
    (see :func:`judge_run`)."""

    settings = settings or Settings.from_env()
    failures: list[dict[str, Any]] = []
    entries = read_manifest(manifest_path(window, settings))
    fetch_started = first_fetch_start(window, settings)
    for e in entries.values():
        if e.get("status") in ("failed", "not_found"):
            failures.append(e)
    with warehouse.connect(settings, create=True) as conn:
        _record_failures(conn, settings, window, run_id, failures)
        status = runstate.finish_parts(conn, settings, run_id, failed_parts, started_at=fetch_started)
        if status == "failed":
            (error,) = conn.execute("SELECT error FROM runs WHERE run_id = ?", [run_id]).fetchone()
            raise RuntimeError(f"run {run_id}: an ingest part failed: {error}")
        judged = _judge(conn, run_id)
    return {"run_id": run_id, "status": status, "n_fetch_failures": len(failures)} | judged


def judge_run(where: Settings | str | os.PathLike, run_id: str) -> dict[str, str]:
    """The run's verdict (:func:`pipeline.outputs.report.verdict`), said in the log and returned
    as ``{"verdict": "FAIL", "verdict_reason": "..."}``: WARNING when it is not PASS, so that a
    task that succeeded still tells the operator reading its log that the night is not green;
    INFO when it is. The nightly's ``finish`` (through :func:`finish_fetched`) and ``report``
    tasks end with it."""
    with warehouse.connect(warehouse.settings_for(where), read_only=True) as conn:
        return _judge(conn, run_id)


def _judge(conn, run_id: str) -> dict[str, str]:
    from ..outputs.report import _run_row, verdict

    v = verdict(_run_row(conn, run_id))
    log.log(logging.INFO if v.level == "PASS" else logging.WARNING, "run %s: verdict %s: %s", run_id, v.level, v.reason)
    return {"verdict": v.level, "verdict_reason": v.reason}


def _fetched_at(entry: dict[str, Any]):
    """When a manifest entry's body was fetched (naive UTC), the capture time of what it landed."""
    try:
        return datetime.fromisoformat(entry["fetched_at"]) if entry.get("fetched_at") else None
    except ValueError:
        return None
