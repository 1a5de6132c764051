"""When a window's fetching began: each fetch of a window records its start beside the
window's manifest (``landing/fetch/.starts/<window>.jsonl``); the window's first start is when a
night's run began (:func:`pipeline.sources.fetched.finish_fetched` dates the run by it).
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import datetime
from pathlib import Path

import orjson

from ..config import Settings
from ..lake import s3
from ..lake.landing import Where
from .manifest import manifest_path

__all__ = ["record_fetch_start", "first_fetch_start"]


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
