"""The landing area: where every input's bytes are kept, untouched, under their SHA-256.

The landing area is a local folder or an ``s3://bucket/prefix`` (shared by every worker). On
disk a landed file appears by an atomic rename; on S3 by a conditional put (``If-None-Match:
*``) or a multipart upload, which is visible only once complete. Either way an object at
``sha256/<ab>/<sha256>`` is always whole, and is written once. The land stage
(``pipeline.stages.land``) puts inputs here; the sources and the migration read and publish here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from . import s3

__all__ = ["Where", "LandingFailed", "writing", "disk_full", "landed_path", "landed_exists", "read_landed", "open_landed", "publish_file", "scratch_dir",
           "store"]

Where = Path | str
"""A landing area or a landed object: a local path, or an ``s3://`` URL (a string)."""


class LandingFailed(Exception):
    "The landing area could not be written (its disk is full, no permission): no input can land."


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (an OS error, DuckDB's IO error, or one raised from either) is a full disk."""
    while exc is not None:
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(exc) \
                or "database or disk is full" in str(exc) or "SQLITE_FULL" in str(exc):  # SQLite's (the catalog's) words
            return True
        exc = exc.__cause__
    return False


@contextlib.contextmanager
def writing(landing_dir: Where) -> Iterator[None]:
    """Inside: writing the landing area. An OS error here is the landing area's, not the
    input's (which was read): raised as :class:`LandingFailed`, naming the folder."""
    try:
        yield
    except OSError as exc:
        full = " (the disk that holds it is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise LandingFailed(f"the landing area {landing_dir} could not be written: {exc.strerror or exc}{full}; "
                            "nothing more can land, so the run stopped") from exc


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
    with writing(landing_dir):
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


def store(landing_dir: Where, sha: str, write, data: bytes) -> tuple[Where, bool]:
    if s3.is_s3(landing_dir):
        dest = landed_path(landing_dir, sha)
        if s3.exists(str(dest)):  # a HEAD is cheaper than sending the bytes again
            return dest, False
        return dest, s3.put_if_absent(str(dest), data)
    dest = landed_path(landing_dir, sha)
    if dest.exists():
        return dest, False
    with writing(landing_dir):
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".landing-")
    try:
        with writing(landing_dir):
            with os.fdopen(fd, "wb") as out:
                write(out)
            os.chmod(tmp, 0o444)
            os.replace(tmp, dest)  # atomic: a crash never leaves a half-written landed file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # a full disk gets back what the partial copy took
        raise
    return dest, True
