"""What the nightly run fetches: ``featurehouse.toml`` read into a typed plan, split into chunks.

The plan is library code so that it can be tested without Airflow: the nightly DAG calls
:func:`load_plan`, then :func:`chunks` to get the list its fetch task is mapped over, then
:func:`fetch_chunk` inside each mapped task. Everything a chunk needs travels in a small dict.

Every setting in the file can be overridden by an environment variable, so that tests and
deployments point the same file at another server or folder:

=================================  ====================================
``FEATUREHOUSE_CONFIG``            path of the toml file itself
``FEATUREHOUSE_SCHEDULE``          ``[schedule] cron``
``FEATUREHOUSE_WAREHOUSE``         ``[paths] warehouse``
``FEATUREHOUSE_INBOX``             ``[paths] inbox``
``FEATUREHOUSE_INBOX_SETTLE_SECONDS``  ``[inbox] settle_seconds``
``NEURONPEDIA_BASE_URL``           ``[neuronpedia] base_url``
``NEURONPEDIA_EXPORTS_URL``        ``[neuronpedia] exports_url``
``FEATUREHOUSE_MAX_FAILED_FRACTION``  ``[fetch] max_failed_fraction``
=================================  ====================================
"""

from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "cron_problem",
    "SourcePlan",
    "Plan",
    "DEFAULT_CONFIG",
    "load_plan",
    "chunks",
    "window_for",
    "run_id_for",
    "fetch_chunk",
    "ingest_units",
    "FetchChunkFailed",
    "too_many_failed",
]

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "featurehouse.toml"
DEFAULT_SCHEDULE = "0 3 * * *"
DEFAULT_MAX_MAP_LENGTH = 1024
"""Airflow's ``[core] max_map_length`` default: a mapped task may expand to at most this many."""


class ConfigError(ValueError):
    "featurehouse.toml is missing, unreadable, or names something it cannot mean."


class FetchChunkFailed(RuntimeError):
    "All, or more than [fetch] max_failed_fraction, of a fetch chunk's URLs failed: the task fails (and is retried)."


#: Schedules Airflow takes by name (``airflow.utils.dates.cron_presets``, ``@once``, ``@continuous``).
AIRFLOW_PRESETS = ("@once", "@continuous", "@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly")


def cron_problem(cron: Any) -> str | None:
    """Why ``cron`` is not a schedule Airflow can run (in words), or None when it is.

    A five-field cron expression that croniter (what Airflow's cron timetables use) reads and
    that fires at least once, or one of Airflow's presets. dags/featurehouse_nightly.py applies
    the same rule with the stdlib and croniter only, to fall back to the default schedule.
    """
    if not isinstance(cron, str):
        return "must be a string"
    if cron in AIRFLOW_PRESETS:
        return None
    if len(cron.split()) != 5:
        return ("is not a cron expression: it needs five fields (minute hour day-of-month month "
                f"day-of-week), or one of {', '.join(AIRFLOW_PRESETS)}")
    from croniter import croniter  # Airflow's own cron reader; a small pure-Python package

    try:
        croniter(cron).get_next(datetime)
    except ValueError as exc:  # CroniterBadCronError, CroniterBadDateError (it never fires), ...
        return f"is not a valid cron expression ({exc})"
    return None


@dataclass(frozen=True)
class SourcePlan:
    """One source (SAE) to fetch, either by feature index through the API or whole via exports."""

    model: str
    """Neuronpedia model id, e.g. ``gpt-oss-20b``."""
    source: str
    """Source id within the model, e.g. ``11-resid-post-aa``."""
    via: str = "api"
    """``api`` (feature pages by index) or ``exports`` (the bulk bucket, the whole source)."""
    ranges: tuple[tuple[int, int], ...] = ()
    """Half-open index ranges ``(start, stop)`` to fetch through the API."""
    all_features: bool = False
    """Page through every feature of the source with ``features-offset`` instead of ranges."""
    batches: tuple[int, int] | None = None
    """Exports only: the half-open range of batch file numbers, taken in each table (features and
    explanations batches are in text order of the index, activations batches numeric ranges of
    1,024 features, so the same numbers cover different features); None means every batch."""

    @property
    def n_indices(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


@dataclass(frozen=True)
class Plan:
    """Everything the nightly and inbox DAGs read from ``featurehouse.toml`` (after env overrides)."""

    config_path: Path
    """The file this plan was read from."""
    schedule: str = DEFAULT_SCHEDULE
    """Cron expression for the nightly run, in UTC."""
    warehouse: Path = Path("warehouse")
    """The warehouse folder; relative paths are taken from the config file's folder."""
    inbox: Path = Path("inbox")
    """Folder the inbox DAG drains; relative paths are taken from the config file's folder."""
    inbox_settle_seconds: float = 30.0
    """A file in the inbox is left alone until it has not changed for this long (still being copied)."""
    base_url: str = "https://www.neuronpedia.org"
    """Neuronpedia's site, for the feature API."""
    exports_url: str = "https://neuronpedia-datasets.s3.amazonaws.com"
    """The bulk-exports bucket's HTTPS endpoint."""
    chunk_size: int = 500
    """Feature indices per mapped fetch task (raised when needed to stay under the map limit)."""
    concurrency: int = 4
    """Concurrent requests within one fetch task."""
    requests_per_hour: int = 20_000
    """Request budget of the whole nightly fetch, shared by the fetch tasks that run at once
    (each gets ``requests_per_hour // parallel_fetches``): Neuronpedia's limit is per IP."""
    parallel_fetches: int = 4
    """Fetch tasks that may run at once: the DAG's ``max_active_tis_per_dagrun`` and at most the
    ``neuronpedia_api`` pool's slots (``$FEATUREHOUSE_API_SLOTS``)."""
    max_failed_fraction: float = 0.5
    """A fetch chunk whose failed URLs are more than this share of those it asked for (or all of
    them, whatever this is) fails its task, which Airflow retries; what landed is still ingested."""
    max_attempts: int = 6
    """Attempts per URL within one fetch task before the URL counts as failed."""
    backoff: float = 1.0
    """First wait between a URL's attempts, in seconds (doubling, with jitter, up to a minute)."""
    task_retries: int = 4
    """Airflow retries of a failed fetch task (read by the nightly DAG file when it is parsed)."""
    task_retry_delay: float = 60.0
    """Seconds before the first retry of a failed fetch task, doubling after each."""
    sources: tuple[SourcePlan, ...] = field(default_factory=tuple)


_RANGE = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")


def _parse_range(spec: Any, where: str) -> tuple[int, int]:
    """``"0:5000"`` (half-open), ``"45698"``, ``45698`` or ``[0, 5000]`` → ``(start, stop)``."""
    if isinstance(spec, bool):
        raise ConfigError(f"{where}: {spec!r} is not an index range")
    if isinstance(spec, int):
        start, stop = spec, spec + 1
    elif isinstance(spec, list) and len(spec) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in spec):
        start, stop = spec
    elif isinstance(spec, str) and (m := _RANGE.match(spec)):
        start = int(m.group(1))
        stop = int(m.group(2)) if m.group(2) is not None else start + 1
    else:
        raise ConfigError(f"{where}: {spec!r} is not an index range (write \"start:stop\" or an index)")
    if start < 0 or stop <= start:
        raise ConfigError(f"{where}: range {start}:{stop} is empty or negative")
    return start, stop


def _merge(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sort and merge overlapping or touching ranges so no index is fetched twice."""
    out: list[list[int]] = []
    for start, stop in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return tuple((a, b) for a, b in out)


def _source(entry: Any, n: int) -> SourcePlan:
    where = f"[[sources]] #{n + 1}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = set(entry) - {"model", "source", "via", "indices", "all", "batches"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    model, source = entry.get("model"), entry.get("source")
    if not isinstance(model, str) or not model or not isinstance(source, str) or not source:
        raise ConfigError(f"{where} needs a model and a source (non-empty strings)")
    where = f"{where} ({model}/{source})"
    via = entry.get("via", "api")
    if via not in ("api", "exports"):
        raise ConfigError(f"{where}: via must be \"api\" or \"exports\", not {via!r}")
    if via == "exports":
        if "indices" in entry or entry.get("all"):
            raise ConfigError(f"{where}: exports fetch the whole source; drop indices/all")
        batches = _parse_range(entry["batches"], where) if "batches" in entry else None
        return SourcePlan(model, source, "exports", batches=batches)
    if "batches" in entry:
        raise ConfigError(f"{where}: batches only apply to via = \"exports\"")
    all_features = entry.get("all", False)
    if not isinstance(all_features, bool):
        raise ConfigError(f"{where}: all must be true or false")
    specs = entry.get("indices", [])
    if not isinstance(specs, list):
        specs = [specs]
    if all_features and specs:
        raise ConfigError(f"{where}: give indices or all = true, not both")
    if not all_features and not specs:
        raise ConfigError(f"{where}: give indices = [\"start:stop\", ...] or all = true")
    ranges = _merge([_parse_range(s, where) for s in specs])
    return SourcePlan(model, source, "api", ranges=ranges, all_features=all_features)


def _positive(value: Any, name: str, kind: type = int) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (kind is int and (value == 0 or value != int(value))):
        raise ConfigError(f"{name} must be a positive {'integer' if kind is int else 'number'}, got {value!r}")
    return kind(value)


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a whole number ≥ 0, got {value!r}")
    return value


def _fraction(from_env: str | None, from_file: Any) -> float:
    name = "FEATUREHOUSE_MAX_FAILED_FRACTION" if from_env else "[fetch] max_failed_fraction"
    value: Any = from_file
    if from_env:
        try:
            value = float(from_env)
        except ValueError:
            value = from_env
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"{name} must be a number from 0 to 1 (a share of a chunk's URLs), got {value!r}")
    return float(value)


def load_plan(path: str | os.PathLike | None = None, env: dict[str, str] | None = None) -> Plan:
    """Read ``featurehouse.toml`` (``path``, else ``$FEATUREHOUSE_CONFIG``, else the repo's) into a Plan.

    Environment variables override the file (see the module docstring); relative paths in the
    file are resolved against the file's folder. Raises :class:`ConfigError` naming the file and
    the entry when something is wrong.
    """
    env = os.environ if env is None else env
    config_path = Path(path or env.get("FEATUREHOUSE_CONFIG") or DEFAULT_CONFIG).resolve()
    try:
        raw = tomllib.loads(config_path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"no config file at {config_path} (set FEATUREHOUSE_CONFIG)") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{config_path} is not valid TOML: {exc}") from exc
    try:
        return _plan(raw, config_path, env)
    except ConfigError as exc:
        raise ConfigError(f"{config_path}: {exc}") from None


def _plan(raw: dict[str, Any], config_path: Path, env: dict[str, str] | os._Environ) -> Plan:
    unknown = set(raw) - {"schedule", "paths", "inbox", "neuronpedia", "fetch", "sources"}
    if unknown:
        raise ConfigError(f"unknown section(s) {', '.join(sorted(unknown))}")
    schedule = raw.get("schedule", {})
    paths = raw.get("paths", {})
    inbox = raw.get("inbox", {})
    api = raw.get("neuronpedia", {})
    fetch = raw.get("fetch", {})
    here = config_path.parent

    def path_of(value: str) -> Path:
        p = Path(value).expanduser()
        return p if p.is_absolute() else here / p

    cron = env.get("FEATUREHOUSE_SCHEDULE") or schedule.get("cron", DEFAULT_SCHEDULE)
    if (problem := cron_problem(cron)) is not None:
        where = "FEATUREHOUSE_SCHEDULE" if env.get("FEATUREHOUSE_SCHEDULE") else "[schedule] cron"
        raise ConfigError(f"{where} {cron!r} {problem}")
    settle = env.get("FEATUREHOUSE_INBOX_SETTLE_SECONDS")
    sources = raw.get("sources", [])
    if not isinstance(sources, list):
        raise ConfigError("sources must be an array of tables ([[sources]])")
    plan = Plan(
        config_path=config_path,
        schedule=cron,
        warehouse=Path(env["FEATUREHOUSE_WAREHOUSE"]) if env.get("FEATUREHOUSE_WAREHOUSE")
        else path_of(paths.get("warehouse", "warehouse")),
        inbox=Path(env["FEATUREHOUSE_INBOX"]) if env.get("FEATUREHOUSE_INBOX")
        else path_of(paths.get("inbox", "inbox")),
        inbox_settle_seconds=_positive(
            float(settle) if settle else inbox.get("settle_seconds", 30.0), "[inbox] settle_seconds", float
        ),
        base_url=(env.get("NEURONPEDIA_BASE_URL") or api.get("base_url", Plan.base_url)).rstrip("/"),
        exports_url=(env.get("NEURONPEDIA_EXPORTS_URL") or api.get("exports_url", Plan.exports_url)).rstrip("/"),
        chunk_size=_positive(fetch.get("chunk_size", Plan.chunk_size), "[fetch] chunk_size"),
        concurrency=_positive(fetch.get("concurrency", Plan.concurrency), "[fetch] concurrency"),
        requests_per_hour=_positive(fetch.get("requests_per_hour", Plan.requests_per_hour), "[fetch] requests_per_hour"),
        parallel_fetches=_positive(int(env.get("FEATUREHOUSE_API_SLOTS") or Plan.parallel_fetches),
                                   "FEATUREHOUSE_API_SLOTS"),
        max_failed_fraction=_fraction(env.get("FEATUREHOUSE_MAX_FAILED_FRACTION"),
                                      fetch.get("max_failed_fraction", Plan.max_failed_fraction)),
        max_attempts=_positive(fetch.get("max_attempts", Plan.max_attempts), "[fetch] max_attempts"),
        backoff=_positive(fetch.get("backoff", Plan.backoff), "[fetch] backoff", float),
        task_retries=_count(fetch.get("task_retries", Plan.task_retries), "[fetch] task_retries"),
        task_retry_delay=_positive(fetch.get("task_retry_delay", Plan.task_retry_delay),
                                   "[fetch] task_retry_delay", float),
        sources=tuple(_source(e, i) for i, e in enumerate(sources)),
    )
    seen: set[tuple[str, str]] = set()
    for s in plan.sources:
        if (s.model, s.source) in seen:
            raise ConfigError(f"{s.model}/{s.source} is listed twice; merge its indices into one entry")
        seen.add((s.model, s.source))
    return plan


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
    Raises :class:`ConfigError` when even one chunk per source exceeds the limit.
    """
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
    # Chunks run side by side, each with its own rate limiter: split the budget between them so
    # that together they stay under it.
    per_task = max(1, plan.requests_per_hour // max(1, plan.parallel_fetches))
    common = {"window": window, "base_url": plan.base_url, "exports_url": plan.exports_url,
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
    """True when every URL asked for failed, or more than ``max_fraction`` of them did.

    A listing that could not be read counts as a failed request of its own (nothing else was
    asked for); a feature Neuronpedia does not have (404) is not a failure.
    """
    asked = max(n_requested, n_failed)
    return n_failed > 0 and (n_failed >= asked or n_failed / asked > max_fraction)


def fetch_chunk(chunk: dict[str, Any], settings=None, api_key: str | None = None) -> dict[str, Any]:
    """Fetch one chunk (a dict from :func:`chunks`) into the landing area; return what happened.

    Lands bodies and writes the window's manifest only: it never writes the warehouse, so that
    many chunks can run at once. ``api_key`` defaults to ``$NEURONPEDIA_API_KEY`` inside fetch.

    Raises :class:`FetchChunkFailed` when every URL it asked for failed, or more than the chunk's
    ``max_failed_fraction`` (``[fetch] max_failed_fraction``, default 0.5) of them: the Airflow
    task then fails and is retried (a retry asks only for what did not land). What did land stays
    in the window's manifest for the ingest task, which records the failures in ``fetch_failures``.
    """
    from . import fetch

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
    max_fraction = chunk.get("max_failed_fraction", Plan.max_failed_fraction)
    if too_many_failed(result.n_failed, result.n_requested, max_fraction):
        what = (f"exports batches {chunk.get('batches') or 'all'}" if chunk["via"] == "exports"
                else "all features" if chunk.get("all") else f"features {chunk['start']}:{chunk['stop']}")
        first = result.failures[0] if result.failures else {}
        status = f"HTTP {first['http_status']}, " if first.get("http_status") else ""
        raise FetchChunkFailed(
            f"{chunk['model']}/{chunk['source']} {what} (window {result.window}): "
            f"{result.n_failed} of {max(result.n_requested, result.n_failed)} URL(s) failed, more than "
            f"max_failed_fraction = {max_fraction:g} allows; first {first.get('url')} "
            f"({status}{first.get('attempts')} attempts): {first.get('last_error')}. What landed is kept "
            "for the ingest; a retry asks only for the rest"
        )
    return result.as_dict()


def ingest_units(chunks_: list[dict[str, Any]], settings=None,
                 max_map_length: int = DEFAULT_MAX_MAP_LENGTH) -> list[dict[str, Any]]:
    """What the nightly DAG's mapped ingest runs over, after the fetch: one unit per API chunk
    (its source and index range), and one per landed export batch file (the small model,
    source and source-set files of a source together), each numbered ``part`` 0, 1, ... Units
    are disjoint, so their ingests can load at once on any workers. Export files are packed
    several to a unit when there would be more than ``max_map_length`` units.
    """
    from .manifest import manifest_path, read_manifest

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
    return [u | {"part": i} for i, u in enumerate(units)]
