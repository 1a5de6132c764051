"""One request budget for every fetch that runs at once, not a static split between them.

Neuronpedia's rate limit is per IP. A night's fetch tasks used to get ``requests_per_hour //
parallel_fetches`` each, so a task running alone used a fraction of the budget (the docs' night:
0.72 s a request against localhost). Now every fetch takes its requests from one shared bucket
(pyrate-limiter's, a well-kept library: a leaky bucket of ``requests_per_hour`` an hour that
lets ``burst`` requests through at once), and each task may use all of it when it runs alone:

* on one machine (the default), an SQLite file beside the warehouse
  (``<warehouse>/.fetch-budget.sqlite``), locked across processes with a file lock;
* across machines (Celery workers), Redis: ``FEATUREHOUSE_FETCH_BUDGET=redis://host:6379/N``
  (the scale-out deployment's broker is one);
* ``FEATUREHOUSE_FETCH_BUDGET=off``: each fetch alone within its own share (the static split).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["SharedBudget", "shared_budget", "budget_setting", "FILE_NAME"]

FILE_NAME = ".fetch-budget.sqlite"
_KEY = "neuronpedia"


def budget_setting() -> str:
    """``FEATUREHOUSE_FETCH_BUDGET``: '' (an SQLite file beside the warehouse), 'off', or a
    ``redis://`` URL."""
    return os.environ.get("FEATUREHOUSE_FETCH_BUDGET", "").strip()


class BadBudget(ValueError):
    "FEATUREHOUSE_FETCH_BUDGET is none of '', 'off' or a redis:// URL."


class SharedBudget:
    """``acquire()`` one request from the shared bucket, waiting as long as it takes (a
    ``cancelled`` event ends the wait)."""

    def __init__(self, limiter: Any, where: str):
        self.limiter = limiter
        self.where = where

    def acquire(self, cancelled: threading.Event | None = None) -> None:
        from .api import Cancelled

        while not self.limiter.try_acquire(_KEY, blocking=True, timeout=0.5):
            if cancelled is not None and cancelled.is_set():
                raise Cancelled("fetch cancelled")


def _rates(requests_per_hour: int, burst: int) -> list:
    """At most ``burst`` requests in the time they take at the hourly rate, and the hour's total
    (pyrate-limiter wants intervals and limits increasing, the rate per ms not increasing)."""
    from pyrate_limiter import Duration, Rate

    rph, burst = max(1, int(requests_per_hour)), max(1, int(burst))
    hour = Rate(rph, Duration.HOUR)
    interval = max(1, math.floor(burst * 3_600_000 / rph))
    limit = max(burst, math.ceil(rph * interval / 3_600_000))
    if interval >= 3_600_000 or limit >= rph:
        return [hour]
    return [Rate(limit, interval), hour]


def shared_budget(warehouse: str | os.PathLike, requests_per_hour: int, burst: int) -> SharedBudget | None:
    """The shared bucket for fetches into ``warehouse`` (None when FEATUREHOUSE_FETCH_BUDGET is
    'off'). An unusable one (a folder that cannot be written, Redis down) is said in the log and
    None is returned: the fetch then keeps to its own budget."""
    from pyrate_limiter import Limiter, SQLiteBucket

    setting = budget_setting()
    if setting.lower() == "off":
        return None
    rates = _rates(requests_per_hour, burst)
    try:
        if setting.startswith(("redis://", "rediss://")):
            import redis
            from pyrate_limiter import RedisBucket

            client = redis.Redis.from_url(setting)
            bucket = RedisBucket.init(rates, client, f"featurehouse:{_KEY}:{requests_per_hour}")
            return SharedBudget(Limiter(bucket), setting.split("@")[-1])
        if setting:
            raise BadBudget(f"FEATUREHOUSE_FETCH_BUDGET={setting!r}: '' (a file beside the warehouse), 'off' "
                             "or a redis:// URL")
        path = Path(warehouse) / FILE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        # one table a budget: fetches with another requests_per_hour do not share rows
        bucket = SQLiteBucket.init_from_file(rates, table=f"budget_{int(requests_per_hour)}", db_path=str(path),
                                             use_file_lock=True)
        return SharedBudget(Limiter(bucket), str(path))
    except BadBudget:
        raise
    except Exception as exc:
        log.warning("no shared request budget (%s): this fetch keeps to its own", exc)
        return None
