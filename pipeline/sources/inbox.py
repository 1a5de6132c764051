"""Drain an inbox folder: ingest every file dropped into it, and let a file go only once it has landed.

A file leaves the inbox (moved to ``<inbox>/.done/<run id>/``, or deleted) only after its bytes
are recorded in ``raw_inputs`` — a committed row, whether the page loaded or was rejected. A
run that dies half-way leaves the rest in the inbox for the next run, and re-ingesting a file
that had already landed changes nothing (its bytes are counted as a duplicate).

What is not a file is never read (reading a named pipe would wait for a writer for ever): a
named pipe, socket or device, a symbolic link to nothing or to a folder, a folder that cannot be
read, is refused with its reason, counted as a rejected input of the run, and set aside unread in
``<inbox>/.refused/<run id>/`` (a folder the drain may not move stays, refused again each time),
so that it neither blocks a drain nor goes unnoticed. Subfolders
a drain empties are removed, and ``.done`` and ``.refused`` keep a run's files ``keep_days``
(their bytes are in the landing area), then let them go.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from ..config import Settings
from ..ingest import ingest, new_run_id
from ..lake import warehouse
from ..stages.receive import Input, origin_of

log = logging.getLogger("featurehouse")

__all__ = ["DONE_DIR", "REFUSED_DIR", "DrainResult", "Pending", "drain_inbox", "pending_files", "scan_inbox",
           "prune"]

DONE_DIR = ".done"
"""Folder inside the inbox where drained files are kept (hidden, so never ingested again)."""
REFUSED_DIR = ".refused"
"""Folder inside the inbox where what is not a file is set aside, unread (hidden too)."""
KEEP_DAYS = 7.0
"""Days a run's folder under ``.done`` and ``.refused`` is kept (``[inbox] keep_days``)."""

_CHUNK = 1 << 20


class Pending(NamedTuple):
    """What an inbox holds, from :func:`scan_inbox`."""

    ready: list[Path]
    """Regular files (or links to one) that have settled: to ingest."""
    waiting: int
    """Entries changed less than ``settle_seconds`` ago (probably still being copied in)."""
    refused: list[tuple[Path, str]]
    """Settled entries that are not files (named pipes, sockets, devices, links to nothing or to
    a folder, folders that cannot be read), each with the reason, in words; never opened."""


@dataclass
class DrainResult:
    """What one drain did; ``as_dict()`` is what the inbox DAG's task returns."""

    inbox: str
    run_id: str | None
    n_found: int = 0
    """Entries in the inbox that had settled (not modified for ``settle_seconds``): files and refused entries."""
    n_waiting: int = 0
    """Files left alone because they were still changing."""
    n_drained: int = 0
    """Files that landed and left the inbox."""
    n_kept: int = 0
    """Files ingested but not found in raw_inputs afterwards (changed while read): kept for next time."""
    n_refused: int = 0
    """Entries that are not files: refused with their reason and set aside under ``.refused``."""
    n_pruned: int = 0
    """Run folders under ``.done`` and ``.refused`` older than ``keep_days``, deleted."""
    run: dict[str, Any] | None = None
    """The ingest run's summary, when there was anything to ingest."""
    verdict: str | None = None
    """The run's verdict (PASS, WARN, FAIL; see docs/report.md), when there was a run."""
    verdict_reason: str | None = None
    kept: list[str] = field(default_factory=list)
    refused: list[dict[str, str]] = field(default_factory=list)
    """``{"path", "reason"}`` of each refused entry."""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kept"] = d["kept"][:50]
        d["refused"] = d["refused"][:50]
        return d


def _not_a_file(path: Path) -> tuple[os.stat_result | None, str | None]:
    """``path``'s status (following a link) and, when it is not a regular file, why, in words."""
    try:
        st = path.stat()
    except FileNotFoundError:
        try:
            lst = path.lstat()
        except FileNotFoundError:
            return None, None  # removed while we looked
        if stat.S_ISLNK(lst.st_mode):
            return lst, f"it is a symbolic link to {os.readlink(path)}, which does not exist; it was not read"
        return None, None
    except OSError as exc:  # a loop of links, no permission
        return path.lstat(), f"it cannot be looked at ({exc.strerror or exc}); it was not read"
    if stat.S_ISREG(st.st_mode):
        return st, None
    if stat.S_ISDIR(st.st_mode) and path.is_symlink():
        # judged by the link's own age: the folder is never read, and a busy one (/tmp) would
        # keep the link "still being copied" at every drain, for ever
        return path.lstat(), (f"it is a symbolic link to a folder ({os.readlink(path)}); an inbox does not follow links to "
                    "folders (what it drains is moved out of the inbox); it was not read")
    kind = ("a named pipe (FIFO): reading it would wait for a writer" if stat.S_ISFIFO(st.st_mode)
            else "a socket" if stat.S_ISSOCK(st.st_mode)
            else "a device" if stat.S_ISBLK(st.st_mode) or stat.S_ISCHR(st.st_mode)
            else "a folder" if stat.S_ISDIR(st.st_mode) else "not a file")
    return st, f"it is not a regular file but {kind}; it was not read"


def pending_files(inbox: Path, settle_seconds: float = 0.0, now: float | None = None) -> tuple[list[Path], int]:
    """Files waiting in ``inbox``: the settled regular files and how many entries are still too
    fresh (see :func:`scan_inbox`, which also says what is refused)."""
    pending = scan_inbox(inbox, settle_seconds, now)
    return pending.ready, pending.waiting


def scan_inbox(inbox: Path, settle_seconds: float = 0.0, now: float | None = None) -> Pending:
    """What waits in ``inbox`` (recursively, sorted; hidden names, ``.done`` and ``.refused`` skipped).

    Returns the settled regular files, how many entries are still too fresh (modified less
    than ``settle_seconds`` ago, probably still being copied in), and the settled entries that
    are not files, with the reason (never opened: a named pipe would block the drain).
    """
    now = time.time() if now is None else now
    ready: list[Path] = []
    refused: list[tuple[Path, str]] = []
    waiting = 0

    def unreadable(exc: OSError) -> None:  # os.walk would skip a folder it cannot list, silently
        folder = Path(exc.filename)
        if folder == inbox:
            raise exc
        try:
            settled = now - folder.lstat().st_mtime >= settle_seconds
        except OSError:
            return  # gone since it was listed
        if settled:
            refused.append((folder, f"it is a folder that cannot be read ({exc.strerror or exc}); "
                                    "nothing in it was read"))
        else:
            nonlocal waiting
            waiting += 1

    for root, dirs, files in os.walk(inbox, onerror=unreadable):
        entries = sorted(files + [d for d in dirs if os.path.islink(os.path.join(root, d))])
        # a link to a folder is listed among the folders and not followed: refused below
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not os.path.islink(os.path.join(root, d)))
        for name in entries:
            if name.startswith("."):
                continue
            path = Path(root) / name
            st, why = _not_a_file(path)
            if st is None:
                continue
            if now - st.st_mtime < settle_seconds:
                waiting += 1
            elif why is None:
                ready.append(path)
            else:
                refused.append((path, why))
    refused.sort()
    return Pending(ready, waiting, refused)


def _sha256(path: Path) -> str | None:
    """The file's digest; None when it is (no longer) a regular file: opened without waiting,
    so a file swapped for a named pipe since the scan is never waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        h = hashlib.sha256()
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def prune(inbox: Path, keep_days: float = KEEP_DAYS, now: float | None = None) -> int:
    """Delete the run folders under ``<inbox>/.done`` and ``<inbox>/.refused`` last changed
    ``keep_days`` or more ago (their bytes are in the landing area); returns how many."""
    now = time.time() if now is None else now
    n = 0
    for kept in (inbox / DONE_DIR, inbox / REFUSED_DIR):
        if not kept.is_dir():
            continue
        for run in sorted(kept.iterdir()):
            try:
                old = run.is_dir() and not run.is_symlink() and now - run.lstat().st_mtime >= keep_days * 86400
            except FileNotFoundError:
                continue
            if old:
                shutil.rmtree(run, ignore_errors=True)
                n += 1
    return n


def _remove_emptied(inbox: Path, moved: list[Path]) -> None:
    """Remove the subfolders that moving ``moved`` out left empty (never the inbox itself)."""
    folders = {p for m in moved for p in m.parents if p != inbox and inbox in p.parents}
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        try:
            folder.rmdir()  # only when empty: a folder still filling keeps its files
        except OSError:
            pass


def _set_aside(inbox: Path, path: Path, folder: Path, keep: bool) -> None:
    if not keep:
        path.unlink()
        return
    dest = folder / path.relative_to(inbox)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(path), dest)  # a rename within the inbox: a named pipe is never opened


def drain_inbox(
    inbox: str | os.PathLike,
    settings: Settings | None = None,
    run_id: str | None = None,
    *,
    trigger: str = "inbox",
    settle_seconds: float = 0.0,
    keep: bool = True,
    keep_days: float = KEEP_DAYS,
) -> DrainResult:
    """Ingest the files waiting in ``inbox``, then move each one that landed out of it.

    ``keep`` moves drained files to ``<inbox>/.done/<run_id>/`` (same relative path), where
    they stay ``keep_days``; otherwise they are deleted. A file is drained only when its sha256,
    computed after the run, is in ``raw_inputs``: so a crash, or a file rewritten while it was
    read, leaves it in the inbox. What is not a file (see :func:`pending_files`) is refused with
    its reason in the run and set aside unread in ``<inbox>/.refused/<run_id>/``. Subfolders
    emptied are removed. The result carries the run's verdict. Running again with the same
    ``run_id`` (an Airflow retry) is safe.
    """
    from ..outputs.report import verdict

    settings = settings or Settings.from_env()
    inbox = Path(inbox)
    inbox.mkdir(parents=True, exist_ok=True)
    pending = scan_inbox(inbox, settle_seconds)
    result = DrainResult(inbox=str(inbox), run_id=None, n_found=len(pending.ready) + len(pending.refused),
                         n_waiting=pending.waiting, n_pruned=prune(inbox, keep_days))
    if not result.n_found:
        return result
    run_id = run_id or new_run_id("inbox")
    result.run_id = run_id
    inputs = [Input(origin=origin_of(p), path=p) for p in pending.ready]
    inputs += [Input(origin=origin_of(p), path=p, refused=why) for p, why in pending.refused]
    summary = ingest(inputs, settings, run_id=run_id, trigger=trigger, progress=False)
    result.run = summary.as_dict()
    judged = verdict(result.run)
    result.verdict, result.verdict_reason = judged.level, judged.reason

    digests = {path: _sha256(path) for path in pending.ready}
    conn = warehouse.connect(settings, read_only=True)
    try:
        landed = {
            sha for (sha,) in conn.execute(
                "SELECT input_sha256 FROM raw_inputs WHERE list_contains($shas, input_sha256)",
                {"shas": sorted({d for d in digests.values() if d})},
            ).fetchall()
        }
    finally:
        conn.close()

    moved: list[Path] = []
    for path, sha in digests.items():
        if sha not in landed:
            result.n_kept += 1
            result.kept.append(str(path))
            continue
        _set_aside(inbox, path, inbox / DONE_DIR / run_id, keep)
        moved.append(path)
        result.n_drained += 1
    for path, why in pending.refused:
        result.refused.append({"path": str(path), "reason": why})
        result.n_refused += 1
        try:
            _set_aside(inbox, path, inbox / REFUSED_DIR / run_id, keep)
            moved.append(path)
        except FileNotFoundError:  # gone already
            pass
        except OSError as exc:  # a folder we may not move (not ours): refused again next time
            log.warning("refused %s stays in the inbox: it cannot be set aside (%s)", path, exc.strerror or exc)
    _remove_emptied(inbox, moved)
    return result
