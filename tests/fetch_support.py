"""Helpers shared by the fetch tests: fast retry settings, cached fixture pages, warehouse reads."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

from pipeline.config import Settings
from tests.conftest import open_warehouse
from tests.fake_neuronpedia import MODEL, SOURCE, small_pages

__all__ = ["FAST", "MODEL", "SOURCE", "pages", "query", "scalar", "settings_in"]

FAST: dict[str, Any] = {"timeout": 0.5, "backoff": 0.01, "max_backoff": 0.05, "progress": False,
                        "requests_per_hour": 10_000_000}
"""Retry quickly (a `slow` fault, 1 s in these tests, is past the 0.5 s timeout), and lift the
request budget, which the budget test sets on its own."""


@functools.lru_cache(maxsize=4)
def _pages(n: int) -> tuple[dict, ...]:
    return tuple(small_pages(range(n)))


def pages(n: int) -> list[dict]:
    """``n`` small synthetic pages, indices 0..n-1 (copies: tests may change them)."""
    return copy.deepcopy(list(_pages(n)))


def settings_in(path: Path) -> Settings:
    return Settings.from_env(warehouse=path)


def query(settings: Settings, sql: str, params: list | None = None) -> list[tuple]:
    with open_warehouse(settings.warehouse) as conn:
        return conn.execute(sql, params or []).fetchall()


def scalar(settings: Settings, sql: str, params: list | None = None) -> Any:
    return query(settings, sql, params)[0][0]
