"""Land stage: store each input's bytes untouched under a content-addressed path.

The landing area is a local folder or an ``s3://bucket/prefix`` (shared by every worker). On
disk a landed file appears by an atomic rename; on S3 by a conditional put (``If-None-Match:
*``) or a multipart upload, which is visible only once complete. Either way an object at
``sha256/<ab>/<sha256>`` is always whole, and is written once.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from . import s3
from .receive import Input

__all__ = ["Landed", "land", "landed_path", "read_landed", "landed_exists", "open_landed", "Where"]

Where = Path | str
"""A landing area or a landed object: a local path, or an ``s3://`` URL (a string)."""

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Landed:
    """An input after landing: its digest, where its bytes are, and the bytes when small enough."""

    input: Input
    sha256: str
    path: Where
    """The landed file, or its ``s3://`` URL."""
    n_bytes: int
    data: bytes | None
    """The bytes, or None when the input exceeded the parse limit (it is landed but not read)."""
    new: bool
    """False when these exact bytes were already in the landing area."""


def landed_path(landing_dir: Where, sha256: str) -> Where:
    if s3.is_s3(landing_dir):
        return str(s3.S3Url.parse(str(landing_dir)).join("sha256", sha256[:2], sha256))
    return Path(landing_dir) / "sha256" / sha256[:2] / sha256


def landed_exists(where: Where) -> bool:
    return s3.exists(str(where)) if s3.is_s3(where) else Path(where).exists()


def read_landed(where: Where, limit: int | None = None) -> bytes:
    """A landed object's bytes (the first ``limit`` when given)."""
    if s3.is_s3(where):
        return s3.get_bytes(str(where), limit=limit)
    with Path(where).open("rb") as f:
        return f.read(limit if limit is not None else -1)


def open_landed(where: Where):
    """A landed object as a binary stream."""
    return s3.open_stream(str(where)) if s3.is_s3(where) else Path(where).open("rb")


def publish_file(tmp: Path, landing_dir: Where, sha: str, size: int) -> tuple[Where, bool]:
    """Move a finished local temp file into the landing area under its digest (atomically);
    the temp file is gone afterwards. Returns (landed path or URL, whether it is new)."""
    dest = landed_path(landing_dir, sha)
    if s3.is_s3(dest):
        try:
            with tmp.open("rb") as f:
                new = s3.upload_file_if_absent(str(dest), f, size)
        finally:
            tmp.unlink(missing_ok=True)
        return dest, new
    dest = Path(dest)
    if dest.exists():
        tmp.unlink()
        return dest, False
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(tmp, 0o444)
    os.replace(tmp, dest)  # atomic: a crash never leaves a half-written landed file
    return dest, True


def scratch_dir(landing_dir: Where) -> Path:
    """Where a large input is spooled while it is hashed: the landing folder itself (so the
    final rename is atomic), or for S3 the local temp folder."""
    if s3.is_s3(landing_dir):
        return Path(tempfile.gettempdir())
    return Path(landing_dir)


def _store(landing_dir: Where, sha: str, write, data: bytes) -> tuple[Where, bool]:
    if s3.is_s3(landing_dir):
        dest = landed_path(landing_dir, sha)
        if s3.exists(str(dest)):  # a HEAD is cheaper than sending the bytes again
            return dest, False
        return dest, s3.put_if_absent(str(dest), data)
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


def land(item: Input, landing_dir: Where, max_bytes: int) -> Landed:
    """Copy ``item``'s bytes into ``landing_dir/sha256/<ab>/<sha256>`` (once per distinct content).

    Inputs over ``max_bytes`` are streamed to the landing area without being held in memory,
    and come back with ``data=None`` so that the caller rejects them without parsing. An input
    already in an S3 landing area (``item.landed``) is only looked at, not landed again.
    """
    if item.landed is not None:
        sha, where = item.landed
        n = len(item.data) if item.data is not None else s3.size(where)
        data = item.data if item.data is not None or n > max_bytes else read_landed(where)
        return Landed(item, sha, where, n, data if n <= max_bytes else None, False)
    if item.data is not None:
        data = item.data
        sha = hashlib.sha256(data).hexdigest()
        path, new = _store(landing_dir, sha, lambda out: out.write(data), data)
        return Landed(item, sha, path, len(data), data if len(data) <= max_bytes else None, new)
    assert item.path is not None
    size = item.path.stat().st_size
    if size <= max_bytes:
        data = item.path.read_bytes()
        return land(replace(item, data=data), landing_dir, max_bytes)
    # Too large to parse: hash while streaming into a temp file, then move it into place. Any
    # error on the way (a full disk, an unreadable source, Ctrl-C) removes the partial copy.
    spool = scratch_dir(landing_dir)
    spool.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=spool, prefix=".landing-")
    try:
        with os.fdopen(fd, "wb") as out, item.path.open("rb") as src:
            while chunk := src.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
        sha = h.hexdigest()
        dest, new = publish_file(Path(tmp), landing_dir, sha, size)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Landed(item, sha, dest, size, None, new)
