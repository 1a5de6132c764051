"""Land stage: store each input's bytes untouched under a content-addressed path in the
landing area (``pipeline.lake.landing``), before anything reads them."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from ..lake import s3
from ..lake.landing import Where, publish_file, read_landed, scratch_dir, store, writing
from .receive import Input

__all__ = ["Landed", "land"]

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
        path, new = store(landing_dir, sha, lambda out: out.write(data), data)
        return Landed(item, sha, path, len(data), data if len(data) <= max_bytes else None, new)
    assert item.path is not None
    size = item.path.stat().st_size
    if size <= max_bytes:
        data = item.path.read_bytes()
        return land(replace(item, data=data), landing_dir, max_bytes)
    # Too large to parse: hash while streaming into a temp file, then move it into place. Any
    # error on the way (a full disk, an unreadable source, Ctrl-C) removes the partial copy.
    spool = scratch_dir(landing_dir)
    h = hashlib.sha256()
    with writing(landing_dir):
        spool.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=spool, prefix=".landing-")
    try:
        with os.fdopen(fd, "wb") as out, item.path.open("rb") as src:
            while chunk := src.read(_CHUNK):  # a read error is the input's: it could not be read
                h.update(chunk)
                with writing(landing_dir):
                    out.write(chunk)
            with writing(landing_dir):
                out.flush()
        sha = h.hexdigest()
        dest, new = publish_file(Path(tmp), landing_dir, sha, size)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Landed(item, sha, dest, size, None, new)
