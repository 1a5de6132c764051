"""featurehouse: Neuronpedia feature pages into a DuckDB warehouse.

Stages, one module each: receive → land → parse → validate → load → materialise → report.
Find features offline (``search``, ``similar``, ``by_token``, ``show``): ``pipeline.outputs.find``.

The names below are imported on first use, so that a command that only reads (``featurehouse
search``) does not pay for the ingest stages (Great Expectations, pandas) at start-up.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from typing import TYPE_CHECKING, Any

# DuckDB's allocator (jemalloc, on Linux) with one arena, unless the user configured it: set
# before duckdb is first imported, which reads it once. An ingest reads a batch on its main
# thread and writes it from its loader thread; with jemalloc's arenas per thread, the memory the
# read freed stayed cached in the main thread's arena while the write grew another. Measured
# here (2 cores): a 1 GiB export batch peaked at 2.26-2.43 GB, 1.98 GB with one arena, in the
# same time; 1,000 pages in the same wall time (1.00, 3 alternating pairs), 1.12 against 1.13 GB.
# A process that imported duckdb before pipeline keeps DuckDB's default (the CLI, the DAG files
# and deploy/airflow_local_settings.py import pipeline first). Not measured on more than 2 cores,
# where DuckDB's worker threads share the one arena: set the variable to tune it there.
os.environ.setdefault("DUCKDB_JE_MALLOC_CONF", "narenas:1")

# `featurehouse ingest|fetch`: SIGTERM and SIGINT are noted from here on (see signals.note_early)
from .signals import note_early  # noqa: E402

note_early(sys.argv)

if TYPE_CHECKING:  # pragma: no cover
    from .config import Settings
    from .ingest import RunSummary, ingest
    from .outputs.find import Finder, FindIndexStale, by_token, refresh_index, search, show, similar
    from .stages.materialise import refresh as refresh_stats
    from .stages.parse import Rejected, parse_bytes
    from .warm import warm_up

_LAZY = {
    "Settings": (".config", "Settings"),
    "RunSummary": (".ingest", "RunSummary"),
    "ingest": (".ingest", "ingest"),
    "refresh_stats": (".stages.materialise", "refresh"),
    "Rejected": (".stages.parse", "Rejected"),
    "parse_bytes": (".stages.parse", "parse_bytes"),
    "Finder": (".outputs.find", "Finder"),
    "FindIndexStale": (".outputs.find", "FindIndexStale"),
    "search": (".outputs.find", "search"),
    "similar": (".outputs.find", "similar"),
    "by_token": (".outputs.find", "by_token"),
    "show": (".outputs.find", "show"),
    "refresh_index": (".outputs.find", "refresh_index"),
    "warm_up": (".warm", "warm_up"),
}

__all__ = ["Settings", "RunSummary", "ingest", "refresh_stats", "Rejected", "parse_bytes",
           "Finder", "FindIndexStale", "search", "similar", "by_token", "show", "refresh_index", "warm_up"]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # one version, pyproject.toml's, as installed (what --version says)
        from importlib.metadata import PackageNotFoundError, version

        try:
            globals()[name] = version("featurehouse")
        except PackageNotFoundError:  # run from a source tree that was never installed
            globals()[name] = "unknown"
        return globals()[name]
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package keeps its public names whatever is imported after it: importing the
    submodule ``pipeline.ingest`` makes the import system set the package's attribute
    ``ingest`` to that module, which would shadow the function ``pipeline.ingest`` (as the
    eager ``from .ingest import ingest`` of old never let it). A submodule bound over a public
    name binds the name to the module's own attribute instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (name in _LAZY and isinstance(value, types.ModuleType)
                and value.__name__ == f"{__name__}{_LAZY[name][0]}" and hasattr(value, _LAZY[name][1])):
            value = getattr(value, _LAZY[name][1])
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
