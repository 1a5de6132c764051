"""Drain an inbox folder: ingest every file dropped into it, and let a file go only once it has landed.

A file leaves the inbox (moved to ``<inbox>/.done/<run id>/``, or deleted) only after its bytes
are recorded in ``raw_inputs`` — a committed row, whether the page loaded or was rejected. A
run that dies half-way leaves the rest in the inbox for the next run, and re-ingesting a file
that had already landed changes nothing (its bytes are counted as a duplicate).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import Settings
from ..ingest import ingest, new_run_id
from ..lake import warehouse

__all__ = ["DONE_DIR", "DrainResult", "drain_inbox", "pending_files"]

DONE_DIR = ".done"
"""Folder inside the inbox where drained files are kept (hidden, so never ingested again)."""

_CHUNK = 1 << 20


@dataclass
class DrainResult:
    """What one drain did; ``as_dict()`` is what the inbox DAG's task returns."""

    inbox: str
    run_id: str | None
    n_found: int = 0
    """Files in the inbox that had settled (not modified for ``settle_seconds``)."""
    n_waiting: int = 0
    """Files left alone because they were still changing."""
    n_drained: int = 0
    """Files that landed and left the inbox."""
    n_kept: int = 0
    """Files ingested but not found in raw_inputs afterwards (changed while read): kept for next time."""
    run: dict[str, Any] | None = None
    """The ingest run's summary, when there was anything to ingest."""
    kept: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kept"] = d["kept"][:50]
        return d


def pending_files(inbox: Path, settle_seconds: float = 0.0, now: float | None = None) -> tuple[list[Path], int]:
    """Files waiting in ``inbox`` (recursively, sorted; hidden names and ``.done`` skipped).

    Returns the settled files and how many are still too fresh (modified less than
    ``settle_seconds`` ago, probably still being copied in).
    """
    now = time.time() if now is None else now
    ready: list[Path] = []
    waiting = 0
    for root, dirs, files in os.walk(inbox):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = Path(root) / name
            try:
                mtime = path.stat().st_mtime
            except FileNotFoundError:  # removed while we looked
                continue
            if now - mtime < settle_seconds:
                waiting += 1
            else:
                ready.append(path)
    return ready, waiting


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def drain_inbox(
    inbox: str | os.PathLike,
    settings: Settings | None = None,
    run_id: str | None = None,
    *,
    trigger: str = "inbox",
    settle_seconds: float = 0.0,
    keep: bool = True,
) -> DrainResult:
    """Ingest the files waiting in ``inbox``, then move each one that landed out of it.

    ``keep`` moves drained files to ``<inbox>/.done/<run_id>/`` (same relative path); otherwise
    they are deleted. A file is drained only when its sha256, computed after the run, is in
    ``raw_inputs``: so a crash, or a file rewritten while it was read, leaves it in the inbox.
    Running again with the same ``run_id`` (an Airflow retry) is safe.
    """
    settings = settings or Settings.from_env()
    inbox = Path(inbox)
    inbox.mkdir(parents=True, exist_ok=True)
    files, waiting = pending_files(inbox, settle_seconds)
    result = DrainResult(inbox=str(inbox), run_id=None, n_found=len(files), n_waiting=waiting)
    if not files:
        return result
    run_id = run_id or new_run_id("inbox")
    result.run_id = run_id
    summary = ingest(files, settings, run_id=run_id, trigger=trigger, progress=False)
    result.run = summary.as_dict()

    digests = {path: _sha256(path) for path in files}
    conn = warehouse.connect(settings, read_only=True)
    try:
        landed = {
            sha for (sha,) in conn.execute(
                "SELECT input_sha256 FROM raw_inputs WHERE list_contains($shas, input_sha256)",
                {"shas": sorted(set(digests.values()))},
            ).fetchall()
        }
    finally:
        conn.close()

    done = inbox / DONE_DIR / run_id
    for path, sha in digests.items():
        if sha not in landed:
            result.n_kept += 1
            result.kept.append(str(path))
            continue
        if keep:
            dest = done / path.relative_to(inbox)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(path), dest)
        else:
            path.unlink()
        result.n_drained += 1
    return result
