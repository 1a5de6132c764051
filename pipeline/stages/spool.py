"""An export file's decompressed bytes, kept aside while the landing pass measures them
(``Spool``), for DuckDB's typed read to take instead of decompressing the gzip a second time.

The landing pass decompresses every export file whole anyway (CRC, end marker, size limit, the
``LineCheck``); DuckDB's read of the gzip then decompresses it again, with a slower inflater and
on one thread a file. Measured on a whole generated source (65,536 features, 80 files, 415 MiB
expanded; 2 cores, 2026-12-07): DuckDB's read of its activations on one thread 3.74 CPU-s from
the gzip against 2.58 from the plain bytes, of its explanations 2.08 against 0.89; writing the
copy costs the landing pass ~0.2 CPU-s more (into the page cache: the file has no name, so a
copy read and closed within seconds is never written back to the disk).

The copy is an unnamed temporary file (``O_TMPFILE``, else one unlinked at once) read by DuckDB
through ``/proc/self/fd/<n>``: a run killed at any moment leaves nothing behind, and a
``maintain`` or a second ingest cannot see it. A file past ``SPOOL_MAX_BYTES`` expanded, a
disk that refuses the copy, or a system without ``/proc/self/fd`` keeps DuckDB's read of the
gzip, as before: the copy is a saving, never a condition of the load; nor is one made where it
would leave under ``SPOOL_DISK_RESERVE`` free on its disk (the landing and the lake come first).
A file DuckDB's gzip reader refuses whole though gzip reads it (zero padding after its last
member) is copied then, whatever its size, so it loads on either road (``expanded_copy``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("featurehouse")

#: The largest expanded export file kept aside (a real activations batch is ~200-270 MiB
#: expanded). Only one batch's copies exist at once (closed once it is read, before the next
#: batch is landed), and a batch holds ~341 MiB of expanded export bytes (``EXPORT_BYTES_SHARE``
#: of ``batch_bytes``) plus one file: under 1 GiB of temporary disk with DuckDB's own spills.
SPOOL_MAX_BYTES = 320 << 20

#: The free space a copy leaves on its disk, at least: the landing of the batch's other files,
#: DuckDB's spills and the lake's new files need it more (a copy is given up, not the load).
SPOOL_DISK_RESERVE = 1 << 30

#: The most copies open at once in a process (each holds a file descriptor until its batch is
#: read; a batch may hold up to 1,000 small export files): an eighth of the open-files limit, at
#: most 128 — a batch past it reads its other files' gzip, and the run keeps descriptors for
#: DuckDB, the landing and the lake (a common soft limit is 1,024).
MAX_OPEN = 128

_FD_DIR = Path("/proc/self/fd")
_slots_lock = threading.Lock()
_open = 0


def _take_slot() -> bool:
    global _open
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = 1024
    cap = MAX_OPEN if soft == resource.RLIM_INFINITY else min(MAX_OPEN, soft // 8)
    with _slots_lock:
        if _open >= cap:
            return False
        _open += 1
        return True


def _free_slot() -> None:
    global _open
    with _slots_lock:
        _open -= 1


def spool_possible() -> bool:
    """Whether DuckDB can read an unnamed file of this process by a path."""
    return _FD_DIR.is_dir()


class Spool:
    """Feeds a ``LineCheck`` (``check``) the decompressed bytes of an export file and writes
    them to an unnamed temporary file in ``folder`` as they come (``gunzip_measure``'s ``lines``
    hook). ``path`` is then the file for DuckDB to read (``None`` when it was given up: past
    ``limit`` bytes, ``SPOOL_MAX_BYTES`` unless given, or the disk refused); ``close`` frees it."""

    def __init__(self, check: Any, folder: Path, limit: int | None = None, *, counted: bool = True) -> None:
        self.check = check
        self._folder = folder
        self._limit = limit = SPOOL_MAX_BYTES if limit is None else limit
        self._counted = counted  # takes one of the MAX_OPEN slots (not: one copy made and read at once)
        self._slot = False
        self._file: IO[bytes] | None = None
        self._n = 0
        self._given_up = limit <= 0 or not spool_possible()

    def reset(self) -> None:
        """A second pass over the file (ISA-L found it broken): both start afresh."""
        self.check.reset()
        self._n = 0
        if self._file is not None:
            try:
                self._file.seek(0)
                self._file.truncate()
            except OSError:
                self._give_up()

    def feed(self, chunk: bytes) -> None:
        self.check.feed(chunk)
        if self._given_up:
            return
        self._n += len(chunk)
        if self._n > self._limit:
            self._give_up()
            return
        try:
            if self._file is None:
                if self._counted:
                    if not _take_slot():  # as many copies open as descriptors allow: this file's gzip is read
                        self._given_up = True
                        return
                    self._slot = True
                self._folder.mkdir(parents=True, exist_ok=True)
                self._file = tempfile.TemporaryFile(dir=self._folder)  # O_TMPFILE where the disk has it
            st = os.statvfs(self._folder)
            if st.f_bavail * st.f_frsize - len(chunk) < SPOOL_DISK_RESERVE:
                log.info("not keeping an export file's expanded bytes aside: under %d MiB would be left free "
                         "on the disk of %s; DuckDB reads the gzip", SPOOL_DISK_RESERVE >> 20, self._folder)
                self._give_up()
                return
            self._file.write(chunk)
        except OSError as exc:  # a full disk: DuckDB reads the gzip instead
            log.info("not keeping an export file's expanded bytes aside (%s): DuckDB reads the gzip", exc)
            self._give_up()

    @property
    def path(self) -> str | None:
        """The copy for DuckDB, by a path (the file object stays open), or None."""
        if self._given_up or self._file is None:
            return None
        try:
            self._file.flush()
        except OSError as exc:
            log.info("not keeping an export file's expanded bytes aside (%s): DuckDB reads the gzip", exc)
            self._give_up()
            return None
        return str(_FD_DIR / str(self._file.fileno()))

    def _give_up(self) -> None:
        self._given_up = True
        self.close()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        if self._slot:
            self._slot = False
            _free_slot()

    def __del__(self) -> None:  # an abandoned batch's copies: freed with it
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the module's globals may be gone
            pass


class _NoCheck:
    def reset(self) -> None:
        pass

    def feed(self, chunk: bytes) -> None:
        pass


def expanded_copy(raw: IO[bytes], folder: Path) -> Spool | None:
    """A copy of the expanded bytes of the gzip stream ``raw`` (every member, any zero padding
    after the last ignored, as gzip does), or None where it cannot be made (the disk, or no
    ``/proc/self/fd``). Its size is not limited: the landing pass measured it within the limit."""
    from .gunzip import open_gzip

    copy = Spool(_NoCheck(), folder, limit=1 << 62, counted=False)
    try:
        with open_gzip(raw) as stream:  # type: ignore[arg-type]
            while chunk := stream.read(1 << 20):
                copy.feed(chunk)
    except (OSError, EOFError, ValueError) as exc:
        log.info("could not copy an export file's expanded bytes aside: %s", exc)
        copy.close()
        return None
    if copy.path is None:
        copy.close()
        return None
    return copy


@contextlib.contextmanager
def scratch_path(folder: str | Path | None, prefix: str, suffix: str) -> Iterator[Path]:
    """A temporary file by a path (for DuckDB, or ``gzip.open``) for the block: one with no name
    where ``/proc/self/fd`` allows, so a run killed inside the block leaves nothing in
    ``folder`` (a named one, ``prefix…suffix``, was left for good); else a named one, removed."""
    where = Path(folder or tempfile.gettempdir())
    where.mkdir(parents=True, exist_ok=True)
    if spool_possible():
        with tempfile.TemporaryFile(dir=where) as f:
            yield _FD_DIR / str(f.fileno())
        return
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=where)
    os.close(fd)
    try:
        yield Path(name)
    finally:
        Path(name).unlink(missing_ok=True)


def close_all(spools: dict[str, Spool]) -> None:
    """Free every copy in ``spools`` (a batch's, once it is read) and forget them."""
    for spool in spools.values():
        spool.close()
    spools.clear()
