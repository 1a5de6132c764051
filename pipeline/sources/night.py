"""The nightly run's work, from its plan (``plan.py``): the plan cut into fetch chunks, a chunk
fetched into the landing area, then the ingest units the landed files make.

The nightly DAG calls :func:`chunks` to get the list its fetch task is mapped over, then
:func:`fetch_chunk` inside each mapped task, then :func:`ingest_units` for its mapped ingest.
Everything a chunk or a unit needs travels in a small dict (its window, source, range and the
warehouse it writes), so no task after the plan reads ``featurehouse.toml`` again. The window
and run id of a scheduled run (:func:`window_for`, :func:`run_id_for`) are stable across
retries, so a retried fetch resumes and an ingest never loads twice.
"""

from __future__ import annotations

import logging
import math
import os
from datetime import datetime, timezone
from typing import Any

from ..config import Settings
from .plan import DEFAULT_MAX_MAP_LENGTH, ConfigError, Plan, SourceNotFound

__all__ = ["settings_of", "chunks", "window_for", "run_id_for", "fetch_chunk", "ingest_units", "FetchChunkFailed",
           "too_many_failed"]

log = logging.getLogger("featurehouse.fetch")


class FetchChunkFailed(RuntimeError):
    "All, or [fetch] max_failed_fraction or more, of a fetch chunk's URLs failed: the task fails (and is retried)."


def settings_of(item: dict[str, Any]) -> Settings:
    """The settings a fetch chunk or an ingest unit runs with: its plan's warehouse (the
    ``warehouse`` it carries), the rest from the environment."""
    return Settings.from_env(warehouse=item.get("warehouse"))


def window_for(key: datetime, dag_id: str = "featurehouse_nightly") -> str:
    """The fetch window of a scheduled run, named after its data interval start (never "now").

    The same run (or a retry of it) always gets the same window, so that fetch resumes instead
    of refetching and ingest never loads twice.
    """
    if key.tzinfo is None:
        key = key.replace(tzinfo=timezone.utc)
    return f"{dag_id}-{key.astimezone(timezone.utc):%Y%m%dT%H%M%SZ}"


def run_id_for(key: datetime, dag_id: str = "featurehouse_nightly") -> str:
    """The warehouse ``runs.run_id`` of a scheduled run: stable across retries, like the window."""
    return f"airflow-{window_for(key, dag_id)}"


def chunks(plan: Plan, window: str, max_map_length: int = DEFAULT_MAX_MAP_LENGTH) -> list[dict[str, Any]]:
    """Split the plan into fetch chunks, each a small dict, no more than ``max_map_length`` of them.

    API ranges are cut into chunks of ``plan.chunk_size`` indices, and the chunk size grows
    when that would make more chunks than Airflow may map (every source keeps at least one chunk
    of its own). A source fetched whole (``all = true`` or exports) is one chunk. Chunks carry
    ranges, never lists of indices, so a chunk of 100,000 features is still a few bytes of XCom.
    Every chunk carries the plan's ``warehouse``, so the tasks that follow need not read the
    file again. Raises :class:`ConfigError` when the plan lists no source (a night that would
    fetch nothing is a mistake, not a green night) or even one chunk per source exceeds the limit.
    """
    if not plan.sources:
        raise ConfigError(f"{plan.config_path}: no [[sources]]: the nightly run would fetch nothing; "
                          "list at least one source to fetch (see docs/nightly.md)")
    if max_map_length < 1:
        raise ConfigError(f"max_map_length must be at least 1, got {max_map_length}")
    whole = [s for s in plan.sources if s.via == "exports" or s.all_features]
    ranged = [s for s in plan.sources if s.via == "api" and not s.all_features]
    room = max_map_length - len(whole)
    total = sum(s.n_indices for s in ranged)
    n_ranges = sum(len(s.ranges) for s in ranged)
    if n_ranges > room:  # every range needs at least one chunk of its own
        raise ConfigError(
            f"{len(plan.sources)} sources with {n_ranges} ranges cannot be "
            f"fetched in at most {max_map_length} mapped tasks; raise [core] max_map_length"
        )
    size = plan.chunk_size
    if ranged:
        while sum(math.ceil((b - a) / size) for s in ranged for a, b in s.ranges) > room:
            size = max(size + 1, math.ceil(size * 1.25), math.ceil(total / room))
    # Chunks run side by side. With the shared budget (sources.budget, the default) each takes
    # its requests from one bucket and may use all of it when it runs alone; without it
    # (FEATUREHOUSE_FETCH_BUDGET=off) the budget is split between them so that together they
    # stay under it.
    per_task = (plan.requests_per_hour if plan.shared_budget
                else max(1, plan.requests_per_hour // max(1, plan.parallel_fetches)))
    common = {"window": window, "warehouse": str(plan.warehouse), "base_url": plan.base_url,
              "exports_url": plan.exports_url,
              "concurrency": plan.concurrency, "requests_per_hour": per_task,
              "max_attempts": plan.max_attempts, "backoff": plan.backoff,
              "max_failed_fraction": plan.max_failed_fraction}
    out: list[dict[str, Any]] = []
    for s in plan.sources:
        base = {"model": s.model, "source": s.source, "via": s.via}
        if s.via == "exports":
            out.append(base | {"batches": list(s.batches) if s.batches else None} | common)
        elif s.all_features:
            out.append(base | {"all": True} | common)
        else:
            for a, b in s.ranges:
                for start in range(a, b, size):
                    out.append(base | {"start": start, "stop": min(start + size, b)} | common)
    return out


def too_many_failed(n_failed: int, n_requested: int, max_fraction: float) -> bool:
    """True when every URL asked for failed, or ``max_fraction`` of them or more did (half a
    night's URLs lost is not a pass, at the default 0.5).

    A listing that could not be read counts as a failed request of its own (nothing else was
    asked for); a feature Neuronpedia does not have (404) is not a failure.
    """
    asked = max(n_requested, n_failed)
    return n_failed > 0 and (n_failed >= asked or n_failed / asked >= max_fraction)


def fetch_chunk(chunk: dict[str, Any], settings=None, api_key: str | None = None,
                retry_left: bool | None = None) -> dict[str, Any]:
    """Fetch one chunk (a dict from :func:`chunks`) into the landing area; return what happened.

    Lands bodies and writes the window's manifest only: it never writes the warehouse, so that
    many chunks can run at once. ``api_key`` defaults to ``$NEURONPEDIA_API_KEY``. A chunk that
    lost any URL (and does not raise) ends with one WARNING saying how many, out of what it
    asked for.

    Raises :class:`FetchChunkFailed` when every URL it asked for failed, or the chunk's
    ``max_failed_fraction`` (``[fetch] max_failed_fraction``, default 0.5) of them or more: the
    Airflow task then fails and is retried (a retry asks only for what did not land). What did
    land stays in the window's manifest for the ingest task, which records the failures in
    ``fetch_failures``. ``retry_left`` says whether the caller will retry the chunk (the nightly
    DAG knows from its task's try number; None: unknown), so the message does not promise a
    retry that will not come.

    Raises :class:`SourceNotFound` (a :class:`ConfigError`: asking again changes nothing) when
    the chunk shows its source does not exist: every feature it asked for is a 404 and so is the
    source's feature 0, features-offset has no feature of it, or its export listing is empty (or
    holds no batch in ``batches``). The reason is kept in ``fetch_failures`` too.
    """
    from urllib.parse import quote

    from . import fetch
    from .exports import export_prefix

    settings = settings or settings_of(chunk)
    common = {"settings": settings, "window": chunk["window"], "progress": False,
              "max_attempts": chunk.get("max_attempts", Plan.max_attempts),
              "backoff": chunk.get("backoff", Plan.backoff)}
    if chunk["via"] == "exports":
        batches = range(*chunk["batches"]) if chunk.get("batches") else None
        result = fetch.fetch_exports(chunk["model"], chunk["source"], batches=batches,
                                     exports_url=chunk["exports_url"], **common)
    else:
        kwargs = {"all_features": True} if chunk.get("all") else {"indices": range(chunk["start"], chunk["stop"])}
        result = fetch.fetch_features(chunk["model"], chunk["source"], base_url=chunk["base_url"],
                                      api_key=api_key or os.environ.get("NEURONPEDIA_API_KEY"),
                                      concurrency=chunk["concurrency"],
                                      requests_per_hour=chunk["requests_per_hour"], **kwargs, **common)
    what = (f"exports batches {chunk.get('batches') or 'all'}" if chunk["via"] == "exports"
            else "all features" if chunk.get("all") else f"features {chunk['start']}:{chunk['stop']}")
    if chunk["via"] == "exports":
        missing = fetch.missing_source(result, chunk["model"], chunk["source"], batches=batches)
        where = f"{chunk['exports_url']}/?list-type=2&prefix={export_prefix(chunk['model'], chunk['source'])}"
    else:
        missing = fetch.missing_source(
            result, chunk["model"], chunk["source"], all_features=bool(chunk.get("all")),
            asked=None if chunk.get("all") else range(chunk["start"], chunk["stop"]), base_url=chunk["base_url"],
            api_key=api_key or os.environ.get("NEURONPEDIA_API_KEY"), max_attempts=common["max_attempts"],
            backoff=common["backoff"], settings=settings)
        where = f"{chunk['base_url']}/api/feature/{quote(chunk['model'], safe='')}/{quote(chunk['source'], safe='')}"
    fetch.settle_source(result, chunk["model"], chunk["source"], where, missing, settings)
    if result.missing_source:
        raise SourceNotFound(
            f"{chunk['model']}/{chunk['source']} {what} (window {result.window}): {result.missing_source}. "
            f"Check this [[sources]] entry's model and source in featurehouse.toml; asking again will not help"
        )
    max_fraction = chunk.get("max_failed_fraction", Plan.max_failed_fraction)
    # counted out of what this try asked for (a retry asks only for what had not landed), as
    # each lost URL's line in the log counts them
    lost, earlier = f"{result.n_failed} of {max(result.n_requested, result.n_failed)} URL(s)", result.earlier()
    if too_many_failed(result.n_failed, result.n_requested, max_fraction):
        first = result.failures[0] if result.failures else {}
        status = f"HTTP {first['http_status']}, " if first.get("http_status") else ""
        then = {True: "a retry asks only for the rest",
                False: "no retry is left ([fetch] task_retries): the rest stays lost tonight, in fetch_failures",
                None: "a retry (the same window) asks only for the rest"}[retry_left]
        share = ("all it asked for" if result.n_failed >= max(result.n_requested, 1)
                 else f"reaching max_failed_fraction = {max_fraction:g} (this share or more fails the task)")
        raise FetchChunkFailed(
            f"{chunk['model']}/{chunk['source']} {what} (window {result.window}): {lost} failed"
            f"{f' ({earlier})' if earlier else ''}, {share}; first {first.get('url')} ({status}{fetch.attempts(first.get('attempts'))}): "
            f"{first.get('last_error')}. What landed is kept for the ingest; {then}"
        )
    if result.n_failed:
        log.warning("%s/%s %s (window %s): %s lost in this chunk (%ssee fetch_failures)", chunk["model"],
                    chunk["source"], what, result.window, lost, f"{earlier}; " if earlier else "")
    return result.as_dict()


def ingest_units(chunks_: list[dict[str, Any]], settings=None,
                 max_map_length: int = DEFAULT_MAX_MAP_LENGTH) -> list[dict[str, Any]]:
    """What the nightly DAG's mapped ingest runs over, after the fetch: one unit per API chunk
    (its source and index range), and one per landed export batch file (the small model,
    source and source-set files of a source together), each numbered ``part`` 0, 1, ... Units
    are disjoint, so their ingests can load at once on any workers. Export files are packed
    several to a unit when there would be more than ``max_map_length`` units. Each unit carries
    the chunks' ``warehouse`` (see :func:`settings_of`).
    """
    from .manifest import manifest_path, read_manifest

    if settings is None and chunks_:
        settings = settings_of(chunks_[0])
    carried = {"warehouse": chunks_[0]["warehouse"]} if chunks_ and "warehouse" in chunks_[0] else {}
    units: list[dict[str, Any]] = []
    exports: list[list[str]] = []
    manifests: dict[str, dict[str, dict[str, Any]]] = {}
    for c in chunks_:
        if c["via"] != "exports":
            units.append({k: c[k] for k in ("window", "model", "source", "via", "start", "stop", "all") if k in c})
            continue
        if c["window"] not in manifests:
            manifests[c["window"]] = read_manifest(manifest_path(c["window"], settings))
        landed = [e["key"] for e in manifests[c["window"]].values()
                  if e.get("kind") == "export" and e.get("status") == "landed"
                  and e.get("model") == c["model"] and e.get("source") == c["source"]]
        batches = sorted(k for k in landed if "/batch-" in k)
        small = sorted(k for k in landed if "/batch-" not in k)
        exports += [[c["window"], *small]] if small else []
        exports += [[c["window"], k] for k in batches]
    room = max(1, max_map_length - len(units))
    if len(exports) > room:  # pack several files (of one window) to a unit
        packed: dict[tuple[str, int], list[str]] = {}
        for i, (window, *keys) in enumerate(exports):
            packed.setdefault((window, i % room), []).extend(keys)
        exports = [[w, *keys] for (w, _), keys in packed.items()]
    units += [{"window": window, "via": "exports", "keys": keys} for window, *keys in exports]
    return [u | {"part": i} | carried for i, u in enumerate(units)]
