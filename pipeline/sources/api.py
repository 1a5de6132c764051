"""Neuronpedia's HTTP API, as a client: retries, the rate budget, the API key.

Transient answers (429, 5xx, timeouts, connection resets, bodies cut short) are retried with
exponential backoff and jitter (tenacity), honouring ``Retry-After`` for every worker at once;
a 404 is final ("feature not found"). The API key travels only in the ``x-api-key`` header and
is replaced by ``***`` in every message that could carry it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote, urlparse

import orjson
import requests
import tenacity
import urllib3
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from ..lake.landing import Where
from .exports import (
    IncompleteTransfer,
    stream_to_landing,
)

__all__ = ["DEFAULT_BASE_URL", "DEFAULT_EXPORTS_URL", "USER_AGENT", "Transient", "NotFound", "Refused", "Cancelled",
           "FetchFailed", "BadApiKey", "Client", "require_json"]

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
                        "check NEURONPEDIA_API_KEY / --api-key (the nightly DAG: the "
                        "neuronpedia_default Connection's password first)")
    return key or None


class _KeySession(requests.Session):
    """A session that never carries the API key across a redirect to another host: requests
    strips Authorization there, but not a custom header such as ``x-api-key``."""

    def rebuild_auth(self, prepared_request, response):  # noqa: D401 - requests' hook
        super().rebuild_auth(prepared_request, response)
        old, new = urlparse(response.request.url), urlparse(prepared_request.url)
        if (old.scheme, old.hostname, old.port) != (new.scheme, new.hostname, new.port):
            prepared_request.headers.pop("x-api-key", None)


class Client:
    """A pooled requests session; every call goes through the rate budget and the retry policy."""

    def __init__(self, *, api_key: str | None, timeout: float, max_attempts: int, concurrency: int,
                 requests_per_hour: float, backoff: float, max_backoff: float, shared: Any = None):
        """``shared``: a ``budget.SharedBudget`` every request also takes from (the fetches running
        at once share it), besides this client's own bucket."""
        self.timeout = timeout
        self.shared = shared
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
            if self.shared is not None:
                self.shared.acquire(self.cancelled)
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
        require_json(body)
        return body

    def post_json_body(self, url: str, payload: dict[str, Any], *, with_key: bool) -> bytes:
        resp = self.session.post(url, json=payload, headers=self.headers(with_key), timeout=self.timeout)
        with resp:
            self.check(resp)
            body = resp.content
        require_json(body)
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
            return stream_to_landing(self._until_cancelled(chunks), landing_dir, expected_size=expected, gzip=gzip)

    def _until_cancelled(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """The chunks, until the fetch is cancelled (a signal): the partial file is then removed."""
        for chunk in chunks:
            if self.cancelled.is_set():
                raise Cancelled("fetch cancelled")
            yield chunk


def require_json(body: bytes) -> None:
    """The API answers JSON; a 200 whose body does not parse arrived damaged: ask again."""
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise IncompleteTransfer(f"body of {len(body):,} bytes is not complete JSON ({exc})") from None


def _feature_url(base_url: str, model: str, source: str, index: int) -> str:
    return f"{base_url.rstrip('/')}/api/feature/{quote(model, safe='')}/{quote(source, safe='')}/{index}"
