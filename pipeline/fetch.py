"""Fetch stage: feature pages from Neuronpedia's API, or a source's bulk exports, into the
landing area, resumably, within a rate budget.

Fetching never writes the warehouse (several fetches may run at once; DuckDB has one writer).
Each body is landed untouched (``landing/sha256/...``) and one line per URL is appended to the
window's manifest, ``landing/fetch/<window>.jsonl``. A rerun with the same window skips what
that manifest says already landed. :func:`ingest_fetched` then loads what a window landed
through the ordinary ingest path and records what could not be fetched in ``fetch_failures``.

Transient answers (429, 5xx, timeouts, connection resets, bodies cut short) are retried with
exponential backoff and jitter (tenacity), honouring ``Retry-After`` for every worker at once;
a 404 is final ("feature not found"). The API key travels only in the ``x-api-key`` header and
is replaced by ``***`` in every message that could carry it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

import orjson
import requests
import tenacity
import urllib3
from requests.adapters import HTTPAdapter
from tqdm import tqdm
from urllib3.util.retry import Retry

from . import s3, warehouse
from .config import Settings
from .exports import (
    IncompleteTransfer,
    ListObjectsV2,
    OffsetPaging,
    export_prefix,
    select_exports,
    stream_to_landing,
)
from .ingest import RunSummary, ingest, new_run_id
from .land import Where, land, landed_exists
from .load import utcnow
from .receive import Input

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_EXPORTS_URL",
    "FetchResult",
    "fetch_exports",
    "fetch_features",
    "ingest_fetched",
    "ingest_unit",
    "finish_fetched",
    "in_unit",
    "manifest_path",
    "read_manifest",
]

log = logging.getLogger("featurehouse.fetch")

DEFAULT_BASE_URL = "https://www.neuronpedia.org"
DEFAULT_EXPORTS_URL = "https://neuronpedia-datasets.s3.amazonaws.com"
USER_AGENT = "featurehouse/0.1 (+https://github.com/featurehouse)"

LOW_WATER = 50
"""When ``x-limit-remaining`` falls below this, requests are spaced further apart."""
MAX_RETRY_AFTER = 3600.0
"""A longer ``Retry-After`` is capped: the site's rate window is an hour."""

_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


# --- errors -------------------------------------------------------------------------------


class Transient(Exception):
    "An answer worth asking again for: 429, 5xx, a timeout, a reset, a body cut short."

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class NotFound(Exception):
    "Neuronpedia answered 404: there is no such feature (or object)."


class Refused(Exception):
    "An answer that asking again will not change (401, 403, another 4xx)."

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class Cancelled(Exception):
    "The fetch is stopping (Ctrl-C, a kill): workers give up without recording anything."


class FetchFailed(Exception):
    "A URL still failed after the retry budget; carries the last status and error."

    def __init__(self, message: str, status: int | None, attempts: int):
        super().__init__(message)
        self.status = status
        self.attempts = attempts


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

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["failures"] = d["failures"][:100]
        return d


# --- manifest -----------------------------------------------------------------------------


def manifest_path(window: str, settings: Settings | None = None) -> Where:
    """``landing/fetch/<window>.jsonl``: one JSON line per URL a fetch in this window finished.
    In an S3 landing area, a prefix ``.../fetch/<window>/`` of parts, one per flush of a fetch."""
    settings = settings or Settings.from_env()
    if not window or "/" in window or "\\" in window or window.startswith(".") or "\0" in window:
        raise ValueError(f"window {window!r} cannot name a manifest file (no '/', no leading '.')")
    root = settings.landing_root
    if s3.is_s3(root):
        return f"{root}/fetch/{window}/"
    return Path(root) / "fetch" / f"{window}.jsonl"


def _lines(data: bytes, entries: dict[str, dict[str, Any]]) -> None:
    for line in data.splitlines():
        try:
            e = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(e, dict) and isinstance(e.get("key"), str):
            entries.pop(e["key"], None)  # keep first-seen order of the latest state
            entries[e["key"]] = e


def read_manifest(path: Where) -> dict[str, dict[str, Any]]:
    """The last line written for each key (a fetch killed mid-write leaves a partial last line,
    which is skipped). On S3, the parts are read in the order they were written."""
    entries: dict[str, dict[str, Any]] = {}
    if s3.is_s3(path):
        for url in sorted(s3.list_keys(str(path))):  # part names start with the write time
            _lines(s3.get_bytes(url), entries)
        return entries
    path = Path(path)
    if not path.exists():
        return entries
    with path.open("rb") as f:
        for line in f:
            _lines(line, entries)
    return entries


class _Manifest:
    """The window's manifest. On disk, one O_APPEND write per line; on S3 (no appends), lines
    are buffered and written as a new part every ``_S3_FLUSH_LINES`` lines or
    ``_S3_FLUSH_SECONDS``, and on close: a fetch killed between flushes asks again for what it
    had not flushed (its bodies are already landed, so that costs requests, not correctness)."""

    _S3_FLUSH_LINES = 200
    _S3_FLUSH_SECONDS = 5.0

    def __init__(self, path: Where):
        self.path = path
        self.on_s3 = s3.is_s3(path)
        if not self.on_s3:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.entries = read_manifest(path)
        self._lock = threading.Lock()
        self._buffer: list[bytes] = []
        self._flushed = time.monotonic()
        self._part = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._seq = 0

    def landed(self, key: str) -> dict[str, Any] | None:
        e = self.entries.get(key)
        if e and e.get("status") in ("landed", "empty"):
            if e["status"] == "empty" or (e.get("landed_path") and landed_exists(e["landed_path"])):
                return e
        return None

    def append(self, entry: dict[str, Any]) -> None:
        line = orjson.dumps(entry) + b"\n"
        with self._lock:
            self.entries[entry["key"]] = entry
            if self.on_s3:
                self._buffer.append(line)
                if (len(self._buffer) >= self._S3_FLUSH_LINES
                        or time.monotonic() - self._flushed >= self._S3_FLUSH_SECONDS):
                    self._flush()
                return
            # One write on an O_APPEND descriptor: lines from parallel fetches never interleave.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)

    def _flush(self) -> None:
        if self._buffer:
            self._seq += 1
            name = f"{time.time_ns():020d}-{self._part}-{self._seq:06d}.jsonl"
            s3.put_bytes(f"{self.path}{name}", b"".join(self._buffer))
            self._buffer.clear()
        self._flushed = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self.on_s3:
                self._flush()


# --- rate budget --------------------------------------------------------------------------


class _RateLimiter:
    """A token bucket of ``requests_per_hour`` shared by all workers, plus a global pause
    (after a 429's ``Retry-After``) and extra spacing as ``x-limit-remaining`` nears zero."""

    def __init__(self, requests_per_hour: float, burst: int, max_spacing: float, cancelled: threading.Event):
        if requests_per_hour <= 0:
            raise ValueError("requests_per_hour must be positive")
        self.rate = requests_per_hour / 3600.0
        self.capacity = float(max(1, burst))
        self.tokens = self.capacity
        self.max_spacing = max_spacing
        self.spacing = 0.0
        self.paused_until = 0.0
        self.next_at = 0.0
        self._stamp = time.monotonic()
        self._lock = threading.Lock()
        self.cancelled = cancelled

    def acquire(self) -> None:
        while True:
            if self.cancelled.is_set():
                raise Cancelled("fetch cancelled")
            with self._lock:
                now = time.monotonic()
                self.tokens = min(self.capacity, self.tokens + (now - self._stamp) * self.rate)
                self._stamp = now
                delay = max(self.paused_until - now, self.next_at - now, 0.0)
                if delay <= 0 and self.tokens >= 1:
                    self.tokens -= 1
                    self.next_at = now + self.spacing
                    return
                if delay <= 0:
                    delay = (1 - self.tokens) / self.rate
            self.cancelled.wait(min(delay, 0.5))  # wake often: a pause or a new spacing may change it

    def pause(self, seconds: float) -> None:
        with self._lock:
            self.paused_until = max(self.paused_until, time.monotonic() + seconds)

    def observe_remaining(self, remaining: int) -> None:
        with self._lock:
            if remaining >= LOW_WATER:
                self.spacing = 0.0
            else:
                self.spacing = self.max_spacing * (1 - max(remaining, 0) / LOW_WATER)
                self.next_at = max(self.next_at, time.monotonic() + self.spacing)


# --- HTTP client --------------------------------------------------------------------------


def _redactor(secret: str | None) -> Callable[[str], str]:
    if not secret:
        return lambda s: s
    forms = sorted({secret, secret.strip(), repr(secret)[1:-1]} - {""}, key=len, reverse=True)

    def redact(s: str) -> str:
        for form in forms:
            s = s.replace(form, "***")
        return s

    return redact


class BadApiKey(ValueError):
    "The API key cannot be sent as an HTTP header (it holds a line break or another control character)."


def _clean_key(api_key: str | None) -> str | None:
    """The key with surrounding whitespace removed (a copy from a CRLF .env file ends in \\r);
    refused, without being shown, if a control character remains inside it."""
    if api_key is None:
        return None
    key = api_key.strip()
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise BadApiKey("the Neuronpedia API key holds a control character (a line break?): "
                        "check NEURONPEDIA_API_KEY / --api-key")
    return key or None


class _KeySession(requests.Session):
    """A session that never carries the API key across a redirect to another host: requests
    strips Authorization there, but not a custom header such as ``x-api-key``."""

    def rebuild_auth(self, prepared_request, response):  # noqa: D401 - requests' hook
        super().rebuild_auth(prepared_request, response)
        old, new = urlparse(response.request.url), urlparse(prepared_request.url)
        if (old.scheme, old.hostname, old.port) != (new.scheme, new.hostname, new.port):
            prepared_request.headers.pop("x-api-key", None)


class _Client:
    """A pooled requests session; every call goes through the rate budget and the retry policy."""

    def __init__(self, *, api_key: str | None, timeout: float, max_attempts: int, concurrency: int,
                 requests_per_hour: float, backoff: float, max_backoff: float):
        self.timeout = timeout
        self.max_attempts = max(1, max_attempts)
        self.backoff = backoff
        self.max_backoff = max_backoff
        api_key = _clean_key(api_key)
        self.redact = _redactor(api_key)
        self.api_key = api_key
        self.cancelled = threading.Event()
        self.limiter = _RateLimiter(requests_per_hour, burst=concurrency, max_spacing=max_backoff,
                                    cancelled=self.cancelled)
        self.session = _KeySession()
        self.session.headers["User-Agent"] = USER_AGENT
        # Retries happen one level up (they must also cover bodies cut short), so the adapter
        # itself never retries; it only pools connections, one per worker.
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=max(4, concurrency),
                              max_retries=Retry(total=0, redirect=5, raise_on_status=False))
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self._exp = tenacity.wait_exponential_jitter(initial=backoff, max=max_backoff, jitter=backoff)

    def close(self) -> None:
        self.session.close()

    def _sleep(self, seconds: float) -> None:
        if self.cancelled.wait(seconds):
            raise Cancelled("fetch cancelled")

    def headers(self, with_key: bool) -> dict[str, str]:
        return {"x-api-key": self.api_key} if with_key and self.api_key else {}

    def _wait(self, state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        retry_after = getattr(exc, "retry_after", None)
        if retry_after is not None:
            return min(retry_after, MAX_RETRY_AFTER)
        return self._exp(state)

    def _before_sleep(self, what: str) -> Callable[[tenacity.RetryCallState], None]:
        def log_retry(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.info("retrying %s in %.2fs (attempt %d failed: %s)", what,
                     state.next_action.sleep if state.next_action else 0.0,
                     state.attempt_number, self.redact(str(exc)))
        return log_retry

    def call(self, what: str, attempt: Callable[[], Any]) -> tuple[Any, int]:
        """Run ``attempt`` (one request and the reading of its body) until it succeeds, raises
        a final error, or the budget is spent. Returns (its result, attempts made)."""
        n = 0

        def once() -> Any:
            nonlocal n
            n += 1
            self.limiter.acquire()
            try:
                return attempt()
            except (requests.Timeout, requests.ConnectionError, requests.exceptions.ChunkedEncodingError,
                    requests.exceptions.ContentDecodingError, urllib3.exceptions.HTTPError,
                    IncompleteTransfer, ConnectionResetError) as exc:
                raise Transient(f"{type(exc).__name__}: {self.redact(str(exc))}") from None

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.max_attempts),
            wait=self._wait,
            retry=tenacity.retry_if_exception_type(Transient),
            before_sleep=self._before_sleep(what),
            sleep=self._sleep,
            reraise=True,
        )
        try:
            return retrying(once), n
        except Transient as exc:
            raise FetchFailed(str(exc), exc.status, n) from None
        except Refused as exc:
            raise FetchFailed(str(exc), exc.status, n) from None
        except NotFound as exc:
            exc.attempts = n  # type: ignore[attr-defined]
            raise

    def check(self, resp: requests.Response) -> None:
        """Classify an answer's status; note the rate headers."""
        remaining = resp.headers.get("x-limit-remaining")
        if remaining is not None and remaining.strip().lstrip("-").isdigit():
            self.limiter.observe_remaining(int(remaining))
        status = resp.status_code
        if status < 300:
            return
        snippet = self.redact(resp.text[:200].strip())
        if status == 404:
            raise NotFound(f"HTTP 404: not found ({snippet})" if snippet else "HTTP 404: not found")
        if status in _TRANSIENT_STATUS or status >= 500:
            retry_after = None
            if "Retry-After" in resp.headers:
                try:
                    retry_after = Retry().parse_retry_after(resp.headers["Retry-After"])
                except Exception:  # an unreadable Retry-After falls back to our own backoff
                    retry_after = None
            if status == 429:
                self.limiter.pause(retry_after if retry_after is not None else self.backoff)
            raise Transient(f"HTTP {status}: {snippet}".rstrip(": "), status, retry_after)
        raise Refused(f"HTTP {status}: {snippet}".rstrip(": "), status)

    # One attempt of each kind of request ------------------------------------------------

    def get_json_body(self, url: str, *, with_key: bool) -> bytes:
        resp = self.session.get(url, headers=self.headers(with_key), timeout=self.timeout)
        with resp:
            self.check(resp)
            body = resp.content  # a body shorter than Content-Length raises here
        _require_json(body)
        return body

    def post_json_body(self, url: str, payload: dict[str, Any], *, with_key: bool) -> bytes:
        resp = self.session.post(url, json=payload, headers=self.headers(with_key), timeout=self.timeout)
        with resp:
            self.check(resp)
            body = resp.content
        _require_json(body)
        return body

    def get_bytes(self, url: str, params: dict[str, str]) -> bytes:
        resp = self.session.get(url, params=params, timeout=self.timeout)
        with resp:
            self.check(resp)
            return resp.content

    def download(self, url: str, landing_dir: Where, *, size: int | None, gzip: bool) -> tuple[str, Where, int]:
        resp = self.session.get(url, stream=True, timeout=self.timeout)
        with resp:
            self.check(resp)
            announced = resp.headers.get("Content-Length")
            expected = int(announced) if announced and announced.isdigit() else size
            if size is not None and expected is not None and size != expected:
                raise IncompleteTransfer(f"bucket lists {size:,} bytes but the answer announces {expected:,}")
            # Raw bytes, never decoded: the landed file is exactly the object in the bucket.
            chunks = resp.raw.stream(1 << 20, decode_content=False)
            return stream_to_landing(chunks, landing_dir, expected_size=expected, gzip=gzip)


def _require_json(body: bytes) -> None:
    """The API answers JSON; a 200 whose body does not parse arrived damaged: ask again."""
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise IncompleteTransfer(f"body of {len(body):,} bytes is not complete JSON ({exc})") from None


# --- the fetch loop -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    key: str
    url: str
    kind: str  # feature | offset | export
    run: Callable[[], dict[str, Any]]
    """Performs the fetch and returns the manifest fields it learnt (status, sha256, ...)."""


class _Progress:
    def __init__(self, result: FetchResult, total: int | None, show: bool, desc: str):
        self.result = result
        self.bar = tqdm(total=total, unit="page", desc=desc, disable=not show, dynamic_ncols=True)
        self.started = time.monotonic()

    def update(self) -> None:
        r = self.result
        elapsed = max(time.monotonic() - self.started, 1e-6)
        done = r.n_landed + r.n_not_found + r.n_failed
        self.bar.set_postfix(landed=r.n_landed, failed=r.n_failed, not_found=r.n_not_found,
                             skipped=r.n_skipped_already_landed,
                             per_hour=int(done / elapsed * 3600), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class _Fetcher:
    def __init__(self, client: _Client, manifest: _Manifest, result: FetchResult, model: str,
                 source: str, progress: _Progress):
        self.client = client
        self.manifest = manifest
        self.result = result
        self.model = model
        self.source = source
        self.progress = progress

    def run_job(self, job: _Job) -> dict[str, Any] | None:
        base = {"key": job.key, "url": job.url, "kind": job.kind, "model": self.model, "source": self.source}
        try:
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
        self.progress.update()

    def run_all(self, jobs: Iterable[_Job], concurrency: int) -> None:
        """Run jobs with at most ``concurrency`` in flight (and as many again queued)."""
        pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="fetch")
        try:
            pending: set[Future] = set()
            for job in jobs:
                if self.manifest.landed(job.key):
                    self.result.n_skipped_already_landed += 1
                    self.progress.bar.update(1)
                    continue
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


def _feature_job(client: _Client, landing: Where, base_url: str, model: str, source: str, index: int,
                 max_bytes: int) -> _Job:
    url = f"{base_url.rstrip('/')}/api/feature/{quote(model, safe='')}/{quote(source, safe='')}/{index}"

    def run() -> dict[str, Any]:
        body = client.get_json_body(url, with_key=True)
        landed = land(Input(origin=url, data=body), landing, max_bytes)
        return {"status": "landed", "http_status": 200, "sha256": landed.sha256,
                "landed_path": str(landed.path), "n_bytes": landed.n_bytes}

    return _Job(f"{model}/{source}/{index}", url, "feature", run)


def _offset_job(client: _Client, landing: Where, base_url: str, model: str, source: str, offset: int,
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
    """
    if (indices is None) == (not all_features):
        raise ValueError("give either feature indices or all_features=True (not both, not neither)")
    settings = settings or Settings.from_env()
    window = window or new_run_id("fetch")
    manifest = _Manifest(manifest_path(window, settings))
    result = FetchResult(window=window, manifest=str(manifest.path))
    started = time.monotonic()
    client = _Client(api_key=api_key, timeout=timeout, max_attempts=max_attempts, concurrency=concurrency,
                     requests_per_hour=requests_per_hour, backoff=backoff, max_backoff=max_backoff)
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


def _fetch_all(client: _Client, manifest: _Manifest, result: FetchResult, bar: _Progress, landing: Where,
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
    settings = settings or Settings.from_env()
    window = window or new_run_id("fetch")
    manifest = _Manifest(manifest_path(window, settings))
    result = FetchResult(window=window, manifest=str(manifest.path))
    started = time.monotonic()
    client = _Client(api_key=None, timeout=timeout, max_attempts=max_attempts, concurrency=concurrency,
                     requests_per_hour=requests_per_hour, backoff=backoff, max_backoff=max_backoff)
    bucket = exports_url.rstrip("/")
    prefix = export_prefix(model, source)
    try:
        listing = ListObjectsV2(bucket, prefix)
        objects = []
        for page in listing.pages(lambda url, params: client.call(f"{url}?prefix={prefix}",
                                                                  lambda: client.get_bytes(url, params))[0]):
            objects.extend(page)
        chosen = select_exports(objects, prefix, batches)
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
            if s3.is_s3(e.get("landed_path")):
                remote.append(e)
                continue
            path = Path(e["landed_path"])
            if path.exists():
                local.append(Input(origin=e["url"], path=path, captured_at=_fetched_at(e)))
                continue
            e = e | {"status": "failed", "last_error": f"landed file {path} is missing; fetch again"}
        if e.get("status") in ("failed", "not_found"):
            failures.append(e)
    if not remote:
        return local

    def read(e: dict[str, Any]) -> Input | None:
        small = (e.get("n_bytes") or 0) <= settings.max_input_bytes and not e["landed_path"].endswith(".gz") \
            and e.get("kind") != "export"
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
    with warehouse.connect(settings) as conn:
        _record_failures(conn, settings, window, run_id, failures)
        if report_after:  # as in ingest: a report that cannot be written does not fail the run
            from .ingest import _write_report

            _write_report(conn, summary, settings)
    return summary


def _record_failures(conn, settings: Settings, window: str, run_id: str, failures: list[dict[str, Any]]) -> None:
    now = utcnow()

    def record(conn) -> None:
        conn.execute("DELETE FROM fetch_failures WHERE run_id = ?", [run_id])
        if failures:
            conn.executemany(
                'INSERT INTO fetch_failures (run_id, "window", url, feature_key, status, attempts, '
                "last_error, recorded_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [[run_id, window, e["url"], e["key"], e["status"], e.get("attempts"), e.get("last_error"),
                  now] for e in failures],
            )

    warehouse.transaction(conn, settings, record, message=f"run {run_id} fetch failures", extra={"run_id": run_id})


def in_unit(entry: dict[str, Any], unit: dict[str, Any]) -> bool:
    """Whether a manifest entry belongs to an ingest unit (see :func:`pipeline.plan.ingest_units`):
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
    inputs = _window_inputs((e for e in entries.values() if in_unit(e, unit)), settings, [])
    return ingest(inputs, settings, run_id=run_id, trigger=trigger, progress=progress, report_after=False,
                  source_stats=False, part=int(unit["part"]))


def finish_fetched(window: str, settings: Settings | None = None, *, run_id: str,
                   failed_parts: int = 0) -> dict[str, Any]:
    """After a window's units are ingested: record what could not be fetched in
    ``fetch_failures`` and close the run (``failed`` when a unit failed, or ``failed_parts``
    says some did — a killed worker's part cannot say so itself: then this raises, so that what
    follows, materialise and the report, does not run on a partial load)."""
    from .ingest import finish_parts

    settings = settings or Settings.from_env()
    failures: list[dict[str, Any]] = []
    entries = read_manifest(manifest_path(window, settings))
    for e in entries.values():
        if e.get("status") in ("failed", "not_found"):
            failures.append(e)
    with warehouse.connect(settings, create=True) as conn:
        _record_failures(conn, settings, window, run_id, failures)
        status = finish_parts(conn, settings, run_id, failed_parts)
        if status == "failed":
            (error,) = conn.execute("SELECT error FROM runs WHERE run_id = ?", [run_id]).fetchone()
            raise RuntimeError(f"run {run_id}: an ingest part failed: {error}")
    return {"run_id": run_id, "status": status, "n_fetch_failures": len(failures)}


def _fetched_at(entry: dict[str, Any]):
    """When a manifest entry's body was fetched (naive UTC), the capture time of what it landed."""
    from datetime import datetime

    try:
        return datetime.fromisoformat(entry["fetched_at"]) if entry.get("fetched_at") else None
    except ValueError:
        return None
