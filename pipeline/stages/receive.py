"""Receive stage: turn the paths a user names into inputs, recursively, in a stable order."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

__all__ = ["Input", "InputNotFound", "iter_inputs"]


class InputNotFound(FileNotFoundError):
    "A path given to ingest does not exist."


@dataclass(frozen=True)
class Input:
    """One thing to ingest: a file on disk, or bytes already in hand (a fetched body)."""

    origin: str
    """Where it came from: a file path or a URL."""
    path: Path | None = None
    data: bytes | None = None
    captured_at: datetime | None = None
    """When this capture of the page was made (naive UTC): the fetch time for fetched bodies;
    None means the file's modification time (or, for bytes in hand, the time it is landed)."""
    landed: tuple[str, str] | None = None
    """(sha256, ``s3://`` URL) of bytes already in an S3 landing area (a fetched body): they
    are read from there, never landed again; ``data``, when given, holds them."""

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else self.path.stat().st_size  # type: ignore[union-attr]


def iter_inputs(paths: Iterable[str | os.PathLike]) -> Iterator[Input]:
    """Yield every file under ``paths`` (files as given, folders recursively, sorted).

    Hidden files and folders (names starting with ".") are skipped inside folders: they are
    editors' and downloaders' partial files, not pages.
    """
    for p in paths:
        path = Path(p)
        if path.is_file():
            yield Input(origin=str(path.resolve()), path=path)
        elif path.is_dir():
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(files):
                    if not name.startswith("."):
                        f = Path(root) / name
                        yield Input(origin=str(f.resolve()), path=f)
        else:
            raise InputNotFound(f"no such file or folder: {path}")
