"""What one fetch did (:class:`FetchResult`): its counts, the URLs it lost and, once judged,
why its source does not exist. ``pipeline.sources.fetch`` fills it in,
``pipeline.sources.existence`` reads and settles it, the nightly passes it between tasks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["FetchResult"]


@dataclass
class FetchResult:
    """What one fetch did; ``as_dict()`` is small enough to pass between Airflow tasks."""

    window: str
    n_requested: int = 0
    n_landed: int = 0
    n_skipped_already_landed: int = 0
    n_not_found: int = 0
    n_failed: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    manifest: str = ""
    n_listed: int | None = None
    """Exports: the files the bucket lists under the source (None for the API)."""
    n_batches: int | None = None
    """Exports: the batch files chosen among them (None for the API)."""
    missing_source: str | None = None
    """Why the source does not exist, when :func:`settle_source` found so (else None)."""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["failures"] = d["failures"][:100]
        return d

    def earlier(self) -> str:
        """What a count out of what this try asked for leaves out when a retry skipped what had
        landed ("12 more landed in an earlier try"), so that it is not read as out of the whole
        chunk; "" when nothing was skipped."""
        n = self.n_skipped_already_landed
        return f"{n} more landed in an earlier try" if n else ""
