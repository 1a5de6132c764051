"""`featurehouse fetch features` and `fetch exports`: pages fetched from Neuronpedia (feature API
or bulk exports), then ingested, with the fetch's counts and failures."""

from __future__ import annotations

import os
import signal
import sys

import click

from ..config import Settings
from .common import (
    EXIT_VERDICT_FAIL,
    warehouse_option,
)
from .finding import _refresh_find
from .formats import _print_json
from .loading import print_summary
from .stopping import _TERMINATED, Terminated, _recorded, _stopped_by


def _span(value: str | None, option: str) -> range | None:
    """``A:B`` → range(A, B): A up to but not including B."""
    if value is None:
        return None
    a, sep, b = value.partition(":")
    if not (sep and a.strip().isdigit() and b.strip().isdigit() and int(a) < int(b)):
        raise click.BadParameter(f"{value!r} is not A:B with whole numbers A < B (B is excluded)",
                                 param_hint=option)
    return range(int(a), int(b))


def _fetch_options(f):
    """Options every fetch command takes."""
    options = [
        click.option("--model", required=True, help="Neuronpedia model id, e.g. gpt-oss-20b."),
        click.option("--source", required=True,
                     help="Source (SAE) id, Neuronpedia's 'layer', e.g. 11-resid-post-aa."),
        warehouse_option,
        click.option("--window", default=None,
                     help="Name of this fetch (default: a fresh id). Re-running with the same window "
                          "skips what already landed in it; Airflow passes the run's data interval."),
        click.option("--concurrency", default=None, type=click.IntRange(1, 64),
                     help="Requests in flight at once [features: 4, exports: 2]."),
        click.option("--requests-per-hour", default=20_000, show_default=True, type=click.IntRange(1),
                     help="Request budget (Neuronpedia allows 25,000 an hour per IP on /api)."),
        click.option("--timeout", default=None, type=click.FloatRange(min=0.01),
                     help="Seconds to wait for each answer [features: 30, exports: 60]."),
        click.option("--max-attempts", default=6, show_default=True, type=click.IntRange(1),
                     help="Attempts per URL before it is recorded as failed."),
        click.option("--backoff", default=1.0, show_default=True, type=click.FloatRange(min=0),
                     help="First wait between attempts, in seconds; it doubles (with jitter) up to "
                          "a minute, and a Retry-After answer overrides it."),
        click.option("--no-progress", is_flag=True, help="Hide the progress bar."),
        click.option("--strict", is_flag=True, help="Exit 4 when the run's verdict is FAIL (for cron and scripts)."),
        click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True,
                     help="The run's summary for a person, or as one JSON object on stdout (the summary's "
                          "fields, the fetch's counts and failures, verdict, verdict_reason)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _fetch_then_ingest(settings: Settings, window: str, fetch, no_progress: bool, strict: bool = False,
                       fmt: str = "table") -> None:
    from ..outputs.report import verdict
    from ..sources.fetch import ingest_fetched

    click.echo(f"fetch window {window}", err=True)
    # A SIGTERM (a timeout, `kill`, Airflow stopping the task) stops the fetch as Ctrl-C does:
    # the downloads under way are given up and their partial files removed, the rest kept (the
    # handlers are the group's, see `cli`).
    from ..ingest import new_run_id
    from ..sources.api import BadApiKey
    from ..sources.exports import remove_spooled

    try:
        result = fetch()
    except BadApiKey as exc:
        raise click.ClickException(str(exc)) from None
    except (KeyboardInterrupt, Terminated):
        removed = remove_spooled()
        signum = _TERMINATED[0] if _TERMINATED else signal.SIGINT
        click.echo(f"\nfetch {_stopped_by(signum)}: what landed is kept"
                   + (f", {removed} partial download(s) removed" if removed else "")
                   + f"; run the same command with --window {window} to fetch only the rest", err=True)
        # now, not at the interpreter's exit, which would join the download threads: one blocked
        # reading a slow body would hold a stopped process for as long as the body takes
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)
    run_id = new_run_id()
    try:
        summary = ingest_fetched(window, settings, run_id=run_id, trigger="fetch",
                                 progress=False if no_progress else None)
    except BaseException as exc:
        signum = _TERMINATED[0] if _TERMINATED else signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None
        if signum is None:
            raise
        notes = "; ".join(getattr(exc, "__notes__", ())) or _recorded(settings, run_id)
        click.echo(f"featurehouse: the ingest of what was fetched was {_stopped_by(signum)}; "
                   f"{notes}; run the same command with --window {window} to ingest what is not loaded (nothing "
                   "landed is fetched again)", err=True)
        sys.exit(128 + signum)
    r = result
    judged = verdict(summary.as_dict() | {"n_fetch_failed": r.n_failed})
    if fmt == "json":
        _print_json(summary.as_dict() | {
            "fetch": {"window": r.window, "n_requested": r.n_requested, "n_landed": r.n_landed,
                      "n_already_landed": r.n_skipped_already_landed, "n_not_found": r.n_not_found,
                      "n_failed": r.n_failed, "seconds": round(r.seconds, 3), "failures": r.failures},
            "verdict": judged.level, "verdict_reason": judged.reason})
        _refresh_find(settings)
        if strict and judged.level == "FAIL":  # docs/fetching.md: 4 with --strict, before 3
            sys.exit(EXIT_VERDICT_FAIL)
        if r.n_failed:
            sys.exit(3)
        return
    print_summary(summary)
    _refresh_find(settings)
    click.echo(
        f"  fetch    window {r.window}: requested {r.n_requested}, landed {r.n_landed}, "
        f"already landed {r.n_skipped_already_landed}, not found {r.n_not_found}, "
        f"failed {r.n_failed} in {r.seconds:.1f}s"
    )
    for f in r.failures[:20]:
        status = f"HTTP {f['http_status']}, " if f.get("http_status") else ""
        click.echo(f"  failed   {f['url']}\n           ({status}{f['attempts']} attempts) {f['last_error']}")
    if len(r.failures) > 20:
        click.echo(f"  ... and {len(r.failures) - 20} more failed")
    if r.n_failed or r.n_not_found:
        click.echo("  fetch failures: featurehouse sql \"SELECT url, status, attempts, last_error "
                   f"FROM fetch_failures WHERE run_id = '{summary.run_id}'\"")
    click.echo(f"  verdict  {judged.level}: {judged.reason}")
    if r.n_failed:
        click.echo(f"  re-run with --window {r.window} to retry only what did not land")
    if strict and judged.level == "FAIL":
        sys.exit(EXIT_VERDICT_FAIL)
    if r.n_failed:
        sys.exit(3)


@click.group("fetch")
def fetch_group() -> None:
    """Fetch feature pages from Neuronpedia (feature API or bulk exports), then ingest them.

    Each command lands what it fetches, ingests it, and prints the run summary and the URLs
    that still failed after the retry budget. Exits 3 when some failed, 0 otherwise (a feature
    Neuronpedia does not have is reported as not found, not as a failure).
    """


@fetch_group.command("features")
@click.option("--index", "indices", multiple=True, type=click.IntRange(0), help="A feature index (repeatable).")
@click.option("--range", "span", default=None, metavar="A:B", help="Features A up to B (B excluded).")
@click.option("--all", "all_features", is_flag=True,
              help="Every feature of the source that has activations (pages through features-offset).")
@click.option("--base-url", default="https://www.neuronpedia.org", show_default=True, envvar="NEURONPEDIA_BASE_URL",
              show_envvar=True, help="Neuronpedia site (or a mirror, or a local fake).")
@click.option("--api-key", envvar="NEURONPEDIA_API_KEY", show_envvar=True, default=None,
              help="Sent only as the x-api-key header, never logged. Prefer the environment variable: "
                   "a command-line argument is visible to other users.")
@_fetch_options
def fetch_features_cmd(indices, span, all_features, base_url, api_key, model, source, warehouse, window,
                       concurrency, requests_per_hour, timeout, max_attempts, backoff, no_progress, strict, fmt) -> None:
    """Fetch features through GET /api/feature/{model}/{source}/{index} and ingest them."""
    from ..ingest import new_run_id
    from ..sources.fetch import fetch_features

    wanted = _span(span, "--range")
    if bool(indices or wanted is not None) == all_features:
        raise click.UsageError("say which features: --index (repeatable) and/or --range A:B, or --all")
    chosen = None if all_features else sorted(set(indices) | set(wanted or ()))
    settings = Settings.from_env(warehouse=warehouse)
    window = window or new_run_id("fetch")
    _fetch_then_ingest(settings, window, lambda: fetch_features(
        model, source, chosen, all_features=all_features, settings=settings, base_url=base_url,
        api_key=api_key or None, concurrency=concurrency or 4, requests_per_hour=requests_per_hour,
        window=window, timeout=timeout or 30.0, max_attempts=max_attempts, backoff=backoff,
        progress=False if no_progress else None,
    ), no_progress, strict, fmt)


@fetch_group.command("exports")
@click.option("--batches", "span", default=None, metavar="A:B",
              help="Only batch files A up to B (B excluded) of each table. Tables number batches "
                   "differently: features and explanations batches are in text order of the index "
                   "(batch 0: 0, 1, 10, 100, ...), activations batch N holds features N*1024 to "
                   "N*1024+1023, so the same numbers cover different features. Default: every batch.")
@click.option("--exports-url", default="https://neuronpedia-datasets.s3.amazonaws.com", show_default=True,
              envvar="NEURONPEDIA_EXPORTS_URL", show_envvar=True, help="The public bulk-export bucket (anonymous HTTPS; no API key is sent to it).")
@_fetch_options
def fetch_exports_cmd(span, exports_url, model, source, warehouse, window, concurrency, requests_per_hour,
                      timeout, max_attempts, backoff, no_progress, strict, fmt) -> None:
    """Fetch a source's bulk exports (S3 bucket, v1/{model}/{source}/) and ingest them."""
    from ..ingest import new_run_id
    from ..sources.fetch import fetch_exports

    batches = _span(span, "--batches")
    settings = Settings.from_env(warehouse=warehouse)
    window = window or new_run_id("fetch")
    _fetch_then_ingest(settings, window, lambda: fetch_exports(
        model, source, batches=batches, settings=settings, exports_url=exports_url, window=window,
        timeout=timeout or 60.0, max_attempts=max_attempts, concurrency=concurrency or 2,
        requests_per_hour=requests_per_hour, backoff=backoff, progress=False if no_progress else None,
    ), no_progress, strict, fmt)
