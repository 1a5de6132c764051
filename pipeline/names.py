"""Names that become file names: a run id names its report (``reports/<run_id>.html``) and its
Great Expectations results, so it is checked before anything is written under it."""

from __future__ import annotations

import re

__all__ = ["BadRunId", "check_run_id"]

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,199}")
_RESERVED = {"index"}  # reports/index.html is the list of runs


class BadRunId(ValueError):
    "A run id must be a plain file name: letters, digits and . _ : + - (no '/', no leading '.')."


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it can name a run's files; raise :class:`BadRunId` saying why not."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise BadRunId(
            f"run id {run_id!r} cannot name the run's report and Data Docs: use 1 to 200 letters, "
            "digits and . _ : + - starting with a letter or digit (no '/', spaces or '..' paths)"
        )
    if run_id.lower() in _RESERVED:
        raise BadRunId(f"run id {run_id!r} is reserved: reports/{run_id}.html is the index of runs")
    return run_id
