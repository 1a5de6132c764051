"""Whether a source exists, judged by what a fetch of it found (:func:`missing_source`), and
that word settled in the window's manifest (:func:`settle_source`), whence ``fetch_failures``
keeps a missing source with the reason.
"""

from __future__ import annotations

from ..config import Settings
from ..lake.warehouse import utcnow
from .api import DEFAULT_BASE_URL, Cancelled, Client, FetchFailed, NotFound, _feature_url
from .exports import export_prefix
from .manifest import Manifest, manifest_path, read_manifest
from .result import FetchResult

__all__ = ["missing_source", "settle_source"]


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
