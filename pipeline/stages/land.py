"""Land stage: store each input's bytes untouched under a content-addressed path in the
landing area (``pipeline.lake.landing``), before anything reads them."""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..lake import s3
from ..lake.landing import Where, publish_file, read_landed, scratch_dir, store, writing
from .receive import Input

__all__ = ["Landed", "land", "Digests"]

log = logging.getLogger(__name__)

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


class Digests:
    """The SHA-256 of each input file already read, by what ``stat`` says of it, so an unchanged
    re-run of a folder need not read and hash every file again to find it was landed before.

    A row is the file's path with its device, inode, size, modification and change times (ns)
    and digest; a file whose ``stat`` differs in any of them is read again. The change time is
    set by the kernel on a write (no tool can set it back), so a file rewritten in place, even
    with its size and modification time restored, is read again. Like git's index, a file
    changed less than ``RACY_SECONDS`` before it was hashed is not remembered: within a
    timestamp's granularity a second write could leave every field as it was, and a write
    through a memory map moves the times only at the first write to a page until the kernel
    writes the page back (~30 s on Linux's defaults). A digest is trusted for ``max_age``
    seconds after the hashing, then the file is read again (``Settings.input_digest_days``;
    0 turns the cache off) and rows not used since are dropped.

    Kept in a SQLite file (``<warehouse>/.input-digests.sqlite``). It only saves work: when it
    cannot be opened, read or written, the run reads every file, as it would without it; one
    that is not a database is set aside (``.broken``) and started again.
    """

    RACY_SECONDS = 60.0

    def __init__(self, path: Path, max_age: float):
        self.path = path
        self.max_age = max_age
        self.pending: list[tuple] = []
        self.db: sqlite3.Connection | None = None
        if not max_age > 0:  # 0 (or NaN): off
            return
        for attempt in (1, 2):
            try:
                self.db = sqlite3.connect(path, timeout=1.0, isolation_level=None)
                self.db.execute("PRAGMA journal_mode = WAL")
                self.db.execute("""CREATE TABLE IF NOT EXISTS digests (path BLOB PRIMARY KEY, dev INTEGER,
                    ino INTEGER, size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER, sha256 TEXT, hashed_at REAL)""")
                return
            except sqlite3.DatabaseError as exc:
                if attempt == 1 and not isinstance(exc, sqlite3.OperationalError):  # not a database at all
                    if self.db is not None:
                        self.db.close()
                        self.db = None
                    try:
                        os.replace(path, path.with_name(path.name + ".broken"))
                        log.warning("the input digest cache %s was damaged (%s): set aside as %s.broken, "
                                    "started again", path, exc, path.name)
                        continue
                    except OSError:
                        pass
                self._off(exc)
                return
            except (OSError, ValueError) as exc:
                self._off(exc)
                return

    def _off(self, exc: Exception) -> None:
        log.warning("the input digest cache %s is not used (%s): every input is read and hashed", self.path, exc)
        if self.db is not None:
            self.db.close()
        self.db = None

    @staticmethod
    def _key(st: os.stat_result) -> tuple[int, int, int, int, int]:
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def lookup(self, path: Path, st: os.stat_result) -> str | None:
        """The digest of ``path``'s bytes if it was hashed (less than ``max_age`` ago) and ``st``
        says it is unchanged since."""
        if self.db is None:
            return None
        try:
            row = self.db.execute("SELECT dev, ino, size, mtime_ns, ctime_ns, sha256, hashed_at FROM digests "
                                  "WHERE path = ?", [os.fsencode(path)]).fetchone()
        except (sqlite3.Error, ValueError) as exc:
            self._off(exc)
            return None
        if row is None or tuple(row[:5]) != self._key(st) or time.time() - row[6] > self.max_age:
            return None
        return row[5]

    def remember(self, path: Path, before: os.stat_result, sha: str) -> None:
        """Note ``path``'s digest, hashed from bytes read between ``before`` (its stat then) and
        now, unless it changed meanwhile or too recently to tell a later write apart."""
        if self.db is None:
            return
        try:
            after = os.stat(path)
        except OSError:
            return
        now = time.time()
        if self._key(after) != self._key(before) or now - max(after.st_mtime, after.st_ctime) < self.RACY_SECONDS:
            return
        self.pending.append((os.fsencode(path), *self._key(after), sha, now))

    def save(self) -> None:
        """Write what ``remember`` noted (one transaction), and drop rows past ``max_age``."""
        if self.db is None or not self.pending:
            self.pending.clear()
            return
        try:
            with self.db:
                self.db.execute("BEGIN IMMEDIATE")
                self.db.executemany("INSERT OR REPLACE INTO digests VALUES (?, ?, ?, ?, ?, ?, ?, ?)", self.pending)
                self.db.execute("DELETE FROM digests WHERE hashed_at < ?", [time.time() - self.max_age])
        except (sqlite3.Error, ValueError) as exc:
            self._off(exc)
        self.pending.clear()

    def close(self) -> None:
        self.save()
        if self.db is not None:
            self.db.close()
            self.db = None
