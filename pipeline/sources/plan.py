"""What the nightly run fetches: ``featurehouse.toml`` read into a typed plan.

The plan is library code so that it can be tested without Airflow: the nightly DAG calls
:func:`load_plan`, then ``night.chunks`` to get the list its fetch task is mapped over, then
``night.fetch_chunk`` inside each mapped task (``night.py``: the night's work from the plan).

The whole file is checked against ``schemas/featurehouse.toml.schema.json`` first: an unknown
section or key, or a value of the wrong type, is a :class:`ConfigError` naming the file, the
section and the key. Settings can be overridden by environment variables (the schema's
``x-env``), so that tests and deployments point the same file at another server or folder; a
variable's value is held to the same rule, and a bad one is refused naming the variable:

======================================  ====================================
``FEATUREHOUSE_CONFIG``                 path of the toml file itself
``FEATUREHOUSE_SCHEDULE``               ``[schedule] cron``
``FEATUREHOUSE_WAREHOUSE``              ``[paths] warehouse``
``FEATUREHOUSE_INBOX``                  ``[paths] inbox``
``FEATUREHOUSE_INBOX_SETTLE_SECONDS``   ``[inbox] settle_seconds``
``FEATUREHOUSE_INBOX_KEEP_DAYS``        ``[inbox] keep_days``
``NEURONPEDIA_BASE_URL``                ``[neuronpedia] base_url``
``NEURONPEDIA_EXPORTS_URL``             ``[neuronpedia] exports_url``
``FEATUREHOUSE_MAX_FAILED_FRACTION``    ``[fetch] max_failed_fraction``
``FEATUREHOUSE_API_SLOTS``              (no key) fetch tasks at once, the ``neuronpedia_api`` pool's slots
======================================  ====================================

The nightly DAG reads the file once, in its ``plan`` task; every chunk and ingest unit carries
the warehouse it writes, so the tasks after it never read the file again. The inbox DAG reads
only ``[paths]`` and ``[inbox]`` (:func:`load_inbox_plan`): a mistake in a nightly source does
not stop it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ..config import SCHEMAS_DIR, BadSetting

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "SourceNotFound",
    "cron_problem",
    "SourcePlan",
    "Plan",
    "InboxPlan",
    "DEFAULT_CONFIG",
    "CONFIG_SCHEMA",
    "load_plan",
    "load_inbox_plan",
]

log = logging.getLogger("featurehouse.fetch")

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "featurehouse.toml"
CONFIG_SCHEMA = "featurehouse.toml.schema.json"
"""The file's JSON Schema, in ``schemas/``: every section and key, its type and range, in words."""
DEFAULT_SCHEDULE = "0 3 * * *"
DEFAULT_MAX_MAP_LENGTH = 1024
"""Airflow's ``[core] max_map_length`` default: a mapped task may expand to at most this many."""


class ConfigError(BadSetting):
    "featurehouse.toml (or a variable overriding it) is missing, unreadable, or says something it cannot mean: not transient."


class SourceNotFound(ConfigError):
    "featurehouse.toml names a source Neuronpedia does not have: every URL of it was not found, or its export listing is empty."


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
    retry_delay: float = 60.0
    """Seconds before a failed task other than fetch is retried (doubling, up to 30 minutes)."""
    warehouse: Path = Path("warehouse")
    """The warehouse folder; relative paths are taken from the config file's folder."""
    inbox: Path = Path("inbox")
    """Folder the inbox DAG drains; relative paths are taken from the config file's folder."""
    inbox_settle_seconds: float = 30.0
    """A file in the inbox is left alone until it has not changed for this long (still being copied)."""
    inbox_keep_days: float = 7.0
    """Drained files stay under ``<inbox>/.done/<run id>/`` (refused ones under ``.refused/``)
    this many days, then are deleted: their bytes are in the landing area."""
    base_url: str = "https://www.neuronpedia.org"
    """Neuronpedia's site, for the feature API."""
    exports_url: str = "https://neuronpedia-datasets.s3.amazonaws.com"
    """The bulk-exports bucket's HTTPS endpoint."""
    chunk_size: int = 500
    """Feature indices per mapped fetch task (raised when needed to stay under the map limit)."""
    concurrency: int = 4
    """Concurrent requests within one fetch task."""
    requests_per_hour: int = 20_000
    """Request budget of the whole nightly fetch, shared by the fetch tasks that run at once:
    Neuronpedia's limit is per IP. With ``shared_budget`` each takes its requests from one
    bucket (``sources.budget``) and may use all of it; without, each gets
    ``requests_per_hour // parallel_fetches``."""
    shared_budget: bool = True
    """False when ``$FEATUREHOUSE_FETCH_BUDGET`` is 'off'."""
    parallel_fetches: int = 4
    """Fetch tasks that may run at once: the DAG's ``max_active_tis_per_dagrun`` and at most the
    ``neuronpedia_api`` pool's slots (``$FEATUREHOUSE_API_SLOTS``)."""
    max_failed_fraction: float = 0.5
    """A fetch chunk whose failed URLs are this share of those it asked for or more (or all of
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


@dataclass(frozen=True)
class InboxPlan:
    """What the inbox DAG reads from ``featurehouse.toml``: ``[paths]`` and ``[inbox]`` only."""

    config_path: Path
    warehouse: Path
    """The warehouse folder (as :attr:`Plan.warehouse`)."""
    inbox: Path
    """The folder to drain (as :attr:`Plan.inbox`)."""
    settle_seconds: float = 30.0
    """As :attr:`Plan.inbox_settle_seconds`."""
    keep_days: float = 7.0
    """As :attr:`Plan.inbox_keep_days`."""


#: The largest feature index a page may carry (parse.check_page holds pages to it too).
MAX_INDEX = 2**63 - 1
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
    if stop > MAX_INDEX + 1:
        raise ConfigError(f"{where}: range {start}:{stop} runs past the largest feature index, {MAX_INDEX:,} "
                          "(a 64-bit integer, as a page's index is)")
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


def _source(entry: dict[str, Any], n: int) -> SourcePlan:
    """One ``[[sources]]`` table, its keys and types already checked by the schema."""
    model, source = entry["model"], entry["source"]
    where = f"[[sources]] #{n + 1} ({model}/{source})"
    if entry.get("via", "api") == "exports":
        if "indices" in entry or entry.get("all"):
            raise ConfigError(f"{where}: exports fetch the whole source; drop indices/all")
        batches = _parse_range(entry["batches"], where) if "batches" in entry else None
        return SourcePlan(model, source, "exports", batches=batches)
    if "batches" in entry:
        raise ConfigError(f"{where}: batches only apply to via = \"exports\"")
    all_features = entry.get("all", False)
    specs = entry.get("indices", [])
    if not isinstance(specs, list):
        specs = [specs]
    if all_features and specs:
        raise ConfigError(f"{where}: give indices or all = true, not both")
    if not all_features and not specs:
        raise ConfigError(f"{where}: give indices = [\"start:stop\", ...] or all = true")
    ranges = _merge([_parse_range(s, where) for s in specs])
    return SourcePlan(model, source, "api", ranges=ranges, all_features=all_features)


# --- the file, checked against its schema ---------------------------------------------------------

#: Settings only the environment gives (no key in the file), held to a rule like the schema's.
_ENV_ONLY = {"FEATUREHOUSE_API_SLOTS": {"type": "integer", "minimum": 1, "x-must-be": "a positive integer"}}


@functools.lru_cache(maxsize=1)
def _schema() -> dict[str, Any]:
    return json.loads((SCHEMAS_DIR / CONFIG_SCHEMA).read_text())


def _resolve(sub: dict[str, Any]) -> dict[str, Any]:
    ref = sub.get("$ref", "")
    return _schema()["$defs"][ref.rsplit("/", 1)[-1]] | {k: v for k, v in sub.items() if k != "$ref"} \
        if ref.startswith("#/$defs/") else sub


def _rule(path: tuple) -> str | None:
    """The rule in words (``x-must-be``) of the nearest entry holding ``path``."""
    subs = [_schema()]
    for k in path:
        sub = _resolve(subs[-1])
        subs.append(sub.get("items", {}) if isinstance(k, int) else sub.get("properties", {}).get(k, {}))
    return next((_resolve(s)["x-must-be"] for s in reversed(subs) if "x-must-be" in _resolve(s)), None)


def _where(path: tuple, raw: dict[str, Any]) -> str:
    """An entry as a person finds it in the file: ``[fetch] chunk_size``, ``[[sources]] #2 (m/s) via``."""
    if not path:
        return "the file"
    section, rest = path[0], path[1:]
    label = f"[{section}]"
    if section == "sources":
        if not rest:
            return "sources"
        entry, label = raw["sources"][rest[0]], f"[[sources]] #{rest[0] + 1}"
        if isinstance(entry, dict) and isinstance(entry.get("model"), str) and isinstance(entry.get("source"), str):
            label += f" ({entry['model']}/{entry['source']})"
        rest = rest[1:]
    return label + "".join(f" {k}" if isinstance(k, str) else f"[{k}]" for k in rest)


def _problem(error, raw: dict[str, Any]) -> str:
    """A schema error in words, naming the section and the key."""
    path, where = tuple(error.absolute_path), _where(tuple(error.absolute_path), raw)
    if error.validator == "additionalProperties":
        known = sorted(error.schema.get("properties", {}))

        def named(k: str) -> str:
            close = difflib.get_close_matches(k, known, 1)
            shown = f"[{k}]" if not path else k
            return f"{shown} (did you mean {f'[{close[0]}]' if not path else close[0]}?)" if close else shown

        unknown = ", ".join(named(k) for k in sorted(set(error.instance) - set(known)))
        if not path:
            return f"unknown section(s) {unknown}; the sections are {', '.join(f'[{k}]' for k in known)}"
        return f"{where}: unknown key(s) {unknown}; its keys are {', '.join(known)}"
    if error.validator == "required":
        return f"{where} needs " + " and ".join(f"a {k}" for k in error.validator_value if k not in error.instance)
    rule = _rule(path)
    return f"{where} must be {rule}, got {error.instance!r}" if rule else f"{where}: {error.message}"


def _check(raw: dict[str, Any]) -> None:
    """Hold the file to the schema; every mistake at once, in the file's order."""
    import jsonschema  # a dependency of the pipeline; imported when a file is read

    errors = sorted(jsonschema.Draft202012Validator(_schema()).iter_errors(raw),
                    key=lambda e: [str(p) for p in e.absolute_path])
    # TOML has nan and inf, and a schema's minimum and maximum never refuse NaN (every
    # comparison with it is false): no setting means either, so each is refused here.
    problems = list(dict.fromkeys([*(_problem(e, raw) for e in errors),
                                   *(f"{_where(path, raw)} must be {_rule(path) or 'a finite number'}, got {value!r}"
                                     for path, value in _not_finite(raw))]))
    if problems:
        raise ConfigError("; ".join(problems))


def _not_finite(value: Any, path: tuple = ()) -> list[tuple[tuple, float]]:
    """Every nan, inf and -inf in the file, with where it is."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [(path, value)]
    if isinstance(value, dict):
        return [found for k, v in value.items() for found in _not_finite(v, (*path, k))]
    if isinstance(value, list):
        return [found for i, v in enumerate(value) for found in _not_finite(v, (*path, i))]
    return []


def _env_value(name: str, raw: str, rule: dict[str, Any]) -> Any:
    """An environment variable's value, converted to its key's type and held to its rule."""
    import jsonschema

    bad = ConfigError(f"{name} must be {rule['x-must-be']}, got {raw!r}")
    try:
        value: Any = {"integer": int, "number": float}.get(rule.get("type"), str)(raw.strip())
    except ValueError:
        raise bad from None
    if isinstance(value, float) and not math.isfinite(value):
        raise bad
    if next(jsonschema.Draft202012Validator(rule).iter_errors(value), None) is not None:
        raise bad
    return value


def _only(raw: dict[str, Any], sections: tuple[str, ...]) -> dict[str, Any]:
    """The file as a reader of ``sections`` alone sees it: those sections, and unknown ones whose
    name is close to theirs (a misspelt ``[pahts]`` is its mistake; a misspelt nightly section is not)."""
    known = set(_schema()["properties"])
    return {k: v for k, v in raw.items()
            if k in sections or (k not in known and difflib.get_close_matches(k, sections, 1, 0.7))}


def _load(path: str | os.PathLike | None, env: dict[str, str] | os._Environ | None,
          sections: tuple[str, ...] | None = None) -> tuple[Path, dict[str, Any], dict[tuple[str, str], str]]:
    """Read the file, check it (``sections``: only those), and apply the environment's overrides.
    Returns the file, its values, and which of them a variable gave (key → variable)."""
    env = os.environ if env is None else env
    config_path = Path(path or env.get("FEATUREHOUSE_CONFIG") or DEFAULT_CONFIG).resolve()
    try:
        raw = tomllib.loads(config_path.read_text())
    except FileNotFoundError as exc:
        named = ("FEATUREHOUSE_CONFIG names it" if not path and env.get("FEATUREHOUSE_CONFIG")
                 else "set FEATUREHOUSE_CONFIG to the file to read")  # (review: said "set it" when it was)
        raise ConfigError(f"no config file at {config_path} ({named})") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_path} cannot be read: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{config_path} is not valid TOML: {exc}") from exc
    try:
        raw = raw if sections is None else _only(raw, sections)
        _check(raw)
        values = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
        given: dict[tuple[str, str], str] = {}
        for section, sub in _schema()["properties"].items():
            if sections is not None and section not in sections:
                continue
            for key, rule in sub.get("properties", {}).items():
                name = rule.get("x-env")
                if name and (env.get(name) or "").strip():
                    values.setdefault(section, {})[key] = _env_value(name, env[name], rule)
                    given[(section, key)] = name
    except ConfigError as exc:
        raise ConfigError(f"{config_path}: {exc}") from None
    return config_path, values, given


def _path(values: dict[str, Any], given: dict[tuple[str, str], str], config_path: Path, key: str) -> Path:
    """``[paths] key``: from the environment as given; from the file, relative to its folder."""
    value = values.get("paths", {}).get(key, key)
    if ("paths", key) in given:
        return Path(value)
    p = Path(value).expanduser()
    return p if p.is_absolute() else config_path.parent / p


def load_plan(path: str | os.PathLike | None = None, env: dict[str, str] | None = None) -> Plan:
    """Read ``featurehouse.toml`` (``path``, else ``$FEATUREHOUSE_CONFIG``, else the repo's) into a Plan.

    The whole file is held to ``schemas/featurehouse.toml.schema.json``; environment variables
    override it (see the module docstring) and are held to the same rules; relative paths in the
    file are resolved against the file's folder. Raises :class:`ConfigError` naming the file and
    the entry (or the variable) when something is wrong.
    """
    env = os.environ if env is None else env
    config_path, values, given = _load(path, env)
    try:
        return _plan(config_path, values, given, env)
    except ConfigError as exc:
        raise ConfigError(f"{config_path}: {exc}") from None


#: A ``featurehouse.toml`` key's field of :class:`Plan`, where the name differs.
_PLAN_FIELD = {("schedule", "cron"): "schedule", ("inbox", "settle_seconds"): "inbox_settle_seconds",
               ("inbox", "keep_days"): "inbox_keep_days"}


def described(path: str | os.PathLike | None = None, env: dict[str, str] | None = None) -> list[dict[str, str]]:
    """What ``featurehouse config`` shows of ``featurehouse.toml``: the file and where its path came
    from, then every key of every section in effect (``[fetch] max_failed_fraction``...), from its
    variable, the file or the default, the sources it names, and the variables only the
    environment sets. Raises :class:`ConfigError` as :func:`load_plan` does."""
    env = os.environ if env is None else env
    rows = [{"setting": "config file", "value": str(Path(path or env.get("FEATUREHOUSE_CONFIG") or DEFAULT_CONFIG)),
             "from": "command line" if path else "$FEATUREHOUSE_CONFIG" if env.get("FEATUREHOUSE_CONFIG") else "default",
             "variables": "$FEATUREHOUSE_CONFIG"}]
    config_path, values, given = _load(path, env)
    plan = load_plan(path, env)
    rows[0]["value"] = str(config_path)
    for section, sub in _schema()["properties"].items():
        for key, rule in sub.get("properties", {}).items():
            name = rule.get("x-env")
            in_file = key in values.get(section, {}) and (section, key) not in given
            if section == "paths" or hasattr(plan, _PLAN_FIELD.get((section, key), key)):
                value = getattr(plan, _PLAN_FIELD.get((section, key), key))  # as the DAGs use it
            else:  # [notify]: no default, shown as written
                value = values.get(section, {}).get(key, "")
            rows.append({"setting": f"[{section}] {key}", "value": "" if value is None else str(value),
                         "from": f"${given[(section, key)]}" if (section, key) in given
                         else config_path.name if in_file else "default",
                         "variables": f"${name}" if name else ""})
    rows.append({"setting": "[[sources]]", "value": "; ".join(
        f"{s.model}/{s.source} " + ("(exports)" if s.via == "exports" else f"({s.n_indices:,} indices)")
        for s in plan.sources), "from": config_path.name if plan.sources else "default", "variables": ""})
    rows.append({"setting": "api_slots", "value": str(plan.parallel_fetches),
                 "from": "$FEATUREHOUSE_API_SLOTS" if (env.get("FEATUREHOUSE_API_SLOTS") or "").strip() else "default",
                 "variables": "$FEATUREHOUSE_API_SLOTS"})
    rows.append({"setting": "shared_budget", "value": "yes" if plan.shared_budget else "no",
                 "from": "$FEATUREHOUSE_FETCH_BUDGET" if (env.get("FEATUREHOUSE_FETCH_BUDGET") or "").strip()
                 else "default", "variables": "$FEATUREHOUSE_FETCH_BUDGET"})
    return rows


def load_inbox_plan(path: str | os.PathLike | None = None, env: dict[str, str] | None = None) -> InboxPlan:
    """What the inbox DAG needs: ``[paths]`` and ``[inbox]`` (checked, with their overrides).
    The nightly's sections are not read, so a mistake there does not stop the inbox."""
    config_path, values, given = _load(path, env, ("paths", "inbox"))
    inbox = values.get("inbox", {})
    return InboxPlan(config_path=config_path, warehouse=_path(values, given, config_path, "warehouse"),
                     inbox=_path(values, given, config_path, "inbox"),
                     settle_seconds=float(inbox.get("settle_seconds", InboxPlan.settle_seconds)),
                     keep_days=float(inbox.get("keep_days", InboxPlan.keep_days)))


def _plan(config_path: Path, values: dict[str, Any], given: dict[tuple[str, str], str],
          env: dict[str, str] | os._Environ) -> Plan:
    schedule, inbox, api, fetch = (values.get(k, {}) for k in ("schedule", "inbox", "neuronpedia", "fetch"))
    cron = schedule.get("cron", DEFAULT_SCHEDULE)
    if (problem := cron_problem(cron)) is not None:
        raise ConfigError(f"{given.get(('schedule', 'cron'), '[schedule] cron')} {cron!r} {problem}")
    slots = {name: _env_value(name, env[name], rule) for name, rule in _ENV_ONLY.items()
             if (env.get(name) or "").strip()}
    plan = Plan(
        config_path=config_path,
        schedule=cron,
        retry_delay=float(schedule.get("retry_delay", Plan.retry_delay)),
        warehouse=_path(values, given, config_path, "warehouse"),
        inbox=_path(values, given, config_path, "inbox"),
        inbox_settle_seconds=float(inbox.get("settle_seconds", Plan.inbox_settle_seconds)),
        inbox_keep_days=float(inbox.get("keep_days", Plan.inbox_keep_days)),
        base_url=api.get("base_url", Plan.base_url).rstrip("/"),
        exports_url=api.get("exports_url", Plan.exports_url).rstrip("/"),
        chunk_size=int(fetch.get("chunk_size", Plan.chunk_size)),
        concurrency=int(fetch.get("concurrency", Plan.concurrency)),
        requests_per_hour=int(fetch.get("requests_per_hour", Plan.requests_per_hour)),
        parallel_fetches=slots.get("FEATUREHOUSE_API_SLOTS", Plan.parallel_fetches),
        shared_budget=(env.get("FEATUREHOUSE_FETCH_BUDGET") or "").strip().lower() != "off",
        max_failed_fraction=float(fetch.get("max_failed_fraction", Plan.max_failed_fraction)),
        max_attempts=int(fetch.get("max_attempts", Plan.max_attempts)),
        backoff=float(fetch.get("backoff", Plan.backoff)),
        task_retries=int(fetch.get("task_retries", Plan.task_retries)),
        task_retry_delay=float(fetch.get("task_retry_delay", Plan.task_retry_delay)),
        sources=tuple(_source(e, i) for i, e in enumerate(values.get("sources", []))),
    )
    seen: set[tuple[str, str]] = set()
    for s in plan.sources:
        if (s.model, s.source) in seen:
            raise ConfigError(f"{s.model}/{s.source} is listed twice; merge its indices into one entry")
        seen.add((s.model, s.source))
    return plan


def with_params(plan: Plan, params: dict[str, Any] | None) -> Plan:
    """``plan`` with its sources replaced by the one a manual run names in its params (Airflow's
    "trigger with config"): ``model`` and ``source``, and ``indices`` ("start:stop" or indices
    separated by commas; "all" for every feature) or ``via = "exports"``. Params naming no
    source leave the plan as it is. A mistake raises :class:`ConfigError` naming the param."""
    params = {k: v for k, v in (params or {}).items() if v not in (None, "")}
    if not ({"model", "source"} & set(params)):
        return plan
    missing = [k for k in ("model", "source") if not isinstance(params.get(k), str) or not params[k].strip()]
    if missing:
        raise ConfigError(f"the run's params name a source but no {' or '.join(missing)} (give model and source)")
    entry: dict[str, Any] = {"model": params["model"].strip(), "source": params["source"].strip(),
                             "via": params.get("via") or "api"}
    if entry["via"] not in ("api", "exports"):
        raise ConfigError(f"the run's param via is {entry['via']!r}: api or exports")
    indices = params.get("indices")
    if entry["via"] == "api":
        if indices is None or str(indices).strip().lower() == "all":
            entry["all"] = True
        else:
            specs = indices if isinstance(indices, list) else [s.strip() for s in str(indices).split(",") if s.strip()]
            entry["indices"] = [str(x) for x in specs]
    elif indices is not None:
        raise ConfigError("the run's params: exports fetch the whole source; drop indices")
    try:
        source = _source(entry, 0)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("[[sources]] #1", "the run's params")) from None
    return dataclasses.replace(plan, sources=(source,))
