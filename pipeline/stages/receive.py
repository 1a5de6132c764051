"""Receive stage: turn the paths a user names into inputs, recursively, in a stable order."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

__all__ = ["Input", "InputNotFound", "iter_inputs", "origin_of"]


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
    refused: str | None = None
    """Why it cannot be read, found while listing (a folder that cannot be read, a link that
    loops): the input is refused with this reason and never opened."""

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else self.path.stat().st_size  # type: ignore[union-attr]


def origin_of(path: Path) -> str:
    """A file's origin: its absolute path, folders resolved but not the file itself, so a
    symbolic link is named as itself (its target is said in the reason when it matters). Bytes
    of the name that are not UTF-8 are written ``\\xNN``."""
    path = Path(os.path.abspath(path))
    # A name that is not UTF-8 (bytes the file system allows) is kept readable with its odd
    # bytes written as \xNN: the warehouse stores text, and one such name must not fail a run.
    return os.fsencode(path.parent.resolve() / path.name).decode("utf-8", "backslashreplace")


def iter_inputs(paths: Iterable[str | os.PathLike]) -> Iterator[Input]:
    """Yield every file under ``paths`` (files as given, folders recursively, sorted).

    Hidden files and folders (names starting with ".") are skipped inside folders: they are
    editors' and downloaders' partial files, not pages. A symbolic link to a folder is followed;
    nothing is skipped without a word: a folder that cannot be read, and a link to a folder
    already read (a loop, or a second way to the same folder), come out as inputs with
    ``refused`` set to the reason.
    """
    for p in paths:
        path = Path(p)
        if path.is_file():
            yield Input(origin=origin_of(path), path=path)
        elif path.is_dir():
            yield from _walk(path, {})
        else:
            raise InputNotFound(f"no such file or folder: {path}")


def _walk(folder: Path, read: dict[tuple[int, int], Path]) -> Iterator[Input]:
    """The files under ``folder``, its own first, then each subfolder's, sorted; ``read`` holds
    the folders already read (device, inode → the path they were read as)."""
    try:
        st = folder.stat()
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        yield Input(origin=origin_of(folder), path=folder,
                    refused=f"it is a folder that cannot be read ({exc.strerror or exc}); nothing in it was read")
        return
    read[(st.st_dev, st.st_ino)] = folder
    folders = []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            is_dir = entry.is_dir()  # follows a link
        except OSError:
            is_dir = False  # a link that cannot be followed: refused as a file, with its reason
        if is_dir:
            folders.append(Path(entry.path))
        else:
            yield Input(origin=origin_of(Path(entry.path)), path=Path(entry.path))
    for sub in folders:
        try:
            sst = sub.stat()
        except OSError as exc:
            yield Input(origin=origin_of(sub), path=sub, refused=f"it cannot be looked at ({exc.strerror or exc})")
            continue
        seen = read.get((sst.st_dev, sst.st_ino))
        if seen is not None:
            what = f"a symbolic link to {os.readlink(sub)}" if sub.is_symlink() else "a folder"
            how = ("a folder that contains it (a loop)" if seen == folder or seen in sub.parents
                   else f"already read as {seen}")
            yield Input(origin=origin_of(sub), path=sub, refused=f"it is {what}, {how}; not read again")
            continue
        yield from _walk(sub, read)
