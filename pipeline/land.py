"""Land stage: store each input's bytes untouched under a content-addressed path."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from .receive import Input

__all__ = ["Landed", "land", "landed_path"]

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Landed:
    """An input after landing: its digest, where its bytes are, and the bytes when small enough."""

    input: Input
    sha256: str
    path: Path
    n_bytes: int
    data: bytes | None
    """The bytes, or None when the input exceeded the parse limit (it is landed but not read)."""
    new: bool
    """False when these exact bytes were already in the landing area."""


def landed_path(landing_dir: Path, sha256: str) -> Path:
    return landing_dir / "sha256" / sha256[:2] / sha256


def _store(landing_dir: Path, sha: str, write) -> tuple[Path, bool]:
    dest = landed_path(landing_dir, sha)
    if dest.exists():
        return dest, False
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".landing-")
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
        os.chmod(tmp, 0o444)
        os.replace(tmp, dest)  # atomic: a crash never leaves a half-written landed file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest, True


def land(item: Input, landing_dir: Path, max_bytes: int) -> Landed:
    """Copy ``item``'s bytes into ``landing_dir/sha256/<ab>/<sha256>`` (once per distinct content).

    Inputs over ``max_bytes`` are streamed to the landing area without being held in memory,
    and come back with ``data=None`` so that the caller rejects them without parsing.
    """
    if item.data is not None:
        data = item.data
        sha = hashlib.sha256(data).hexdigest()
        path, new = _store(landing_dir, sha, lambda out: out.write(data))
        return Landed(item, sha, path, len(data), data if len(data) <= max_bytes else None, new)
    assert item.path is not None
    size = item.path.stat().st_size
    if size <= max_bytes:
        data = item.path.read_bytes()
        return land(replace(item, data=data), landing_dir, max_bytes)
    # Too large to parse: hash while streaming into a temp file, then move it into place. Any
    # error on the way (a full disk, an unreadable source, Ctrl-C) removes the partial copy.
    landing_dir.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=landing_dir, prefix=".landing-")
    try:
        with os.fdopen(fd, "wb") as out, item.path.open("rb") as src:
            while chunk := src.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
        sha = h.hexdigest()
        dest = landed_path(landing_dir, sha)
        new = not dest.exists()
        if new:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(tmp, 0o444)
            os.replace(tmp, dest)
        else:
            Path(tmp).unlink()
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Landed(item, sha, dest, size, None, new)
