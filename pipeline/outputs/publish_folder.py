"""The publication folder's safety: DEST checked (not in or around the warehouse, holding
nothing but a publication's files), one publication into it at a time (``flock`` on
``.publish.lock``, whose text names its holder), what a killed publication left swept away under
that lock, and the one-step moves that make a layout visible whole: a first publication's data
files moved in, ``hf/`` swapped with its staged copy (``renameat2(RENAME_EXCHANGE)``), hard
links for the files that stay.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

import duckdb

from ..config import Settings
from ..lake.warehouse import _q
from .publish_names import CATALOG_FILE, HF_MARK, LOCK_FILE, MADE, SCRATCH, PublishRefused

# --- where it goes -------------------------------------------------------------------------------

def _inside(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def _check_dest(settings: Settings, dest: Path) -> Path:
    dest = Path(os.path.realpath(dest))  # a link into the warehouse is inside it
    places = [("the warehouse", settings.warehouse), ("its data path", settings.data_url),
              ("the landing area", settings.landing_url)]
    for name, where in places:
        if str(where).startswith("s3://"):
            continue
        place = Path(os.path.realpath(where))
        if _inside(dest, place) or _inside(place, dest):
            raise PublishRefused(f"{dest} is inside {name} ({place}) or holds it: publish to a folder of its own")
    if dest.exists() and not dest.is_dir():
        raise PublishRefused(f"{dest} is a file, not a folder")
    if dest.is_dir():
        names = [p.name for p in dest.iterdir()]
        made = (dest / CATALOG_FILE).is_file() or (dest / "hf" / HF_MARK).is_file() or (
            # a first publication killed before its catalog: its lock (made only in a folder that was
            # empty or a publication's), its scratch and its data files, nothing else
            LOCK_FILE in names and all(n in MADE or n.startswith(SCRATCH) for n in names))
        if names and not made:
            raise PublishRefused(f"{dest} holds other files ({', '.join(sorted(names)[:3])}): publish into an "
                                 "empty folder or one a publication made")
    return dest


# --- one at a time, and what a killed one left ------------------------------------------------------

def _holder(dest: Path) -> str:
    """Who holds the folder's lock, as its holder wrote it into the lock file."""
    for _ in range(10):  # a holder writes its name just after taking the lock: give it a moment
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            h = json.loads((dest / LOCK_FILE).read_text(encoding="utf-8"))
            since = datetime.fromisoformat(h["since"])
            age = int((datetime.now(timezone.utc) - since).total_seconds())
            if h["host"] != socket.gethostname() or _alive(int(h["pid"])):
                return (f"process {int(h['pid'])} on {h['host']}, publishing since {since:%Y-%m-%d %H:%M:%S} UTC, "
                        f"{age // 60} min {age % 60} s ago")
            # the name of a holder that is gone (killed): the lock's holder now has not written its own
        time.sleep(0.1)
    return f"by a process that wrote no name into {dest / LOCK_FILE}: an older featurehouse, or one starting"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _lock(dest: Path, stack: contextlib.ExitStack) -> None:
    """Hold ``DEST/.publish.lock`` until ``stack`` closes, or refuse naming its holder.

    One publication into a folder at a time: two would each build on the same catalog, and the one
    replacing it last would drop the other's publication. ``flock``: the kernel frees it when its
    holder dies however it dies, so a killed publication leaves no lock (the file stays, naming it)."""
    lock = stack.enter_context(open(dest / LOCK_FILE, "a+b"))
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise PublishRefused(f"another publication into {dest} is under way ({_holder(dest)}): wait for it to "
                             "finish, or stop that process (the next publication removes what it leaves)") from None
    lock.truncate(0)
    lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}).encode())
    lock.flush()

    def release() -> None:  # still held: no one reads a half-emptied name
        with contextlib.suppress(OSError):
            lock.truncate(0)

    stack.callback(release)


def _known_files(conn: duckdb.DuckDBPyConnection, db: str) -> set[str]:
    """Every file any publication in the catalog attached (as a DuckDB file) as ``db`` wrote: its data
    and delete files, relative to the data path (as written), of every snapshot it keeps."""
    return {r[0] for r in conn.execute(f"""
        WITH t AS (SELECT DISTINCT t.table_id, CASE WHEN t.path_is_relative THEN
                          (CASE WHEN s.path_is_relative THEN s.path ELSE '' END) || t.path ELSE t.path END AS tp
                   FROM {db}.ducklake_table t JOIN {db}.ducklake_schema s USING (schema_id))
        SELECT DISTINCT CASE WHEN f.path_is_relative THEN t.tp || f.path ELSE f.path END
        FROM (SELECT table_id, path, path_is_relative FROM {db}.ducklake_data_file
              UNION ALL SELECT table_id, path, path_is_relative FROM {db}.ducklake_delete_file) f
        JOIN t USING (table_id)""").fetchall()}


def _drop_unknown(data: Path, known: set[str]) -> None:
    """Remove the Parquet files under ``data`` no catalog names (written by a publication killed before
    its catalog replaced the old one: no reader can be reading them), then the folders left empty."""
    if not data.is_dir():
        return
    for p in list(data.rglob("*.parquet")):
        if p.relative_to(data).as_posix() not in known and str(p) not in known:
            with contextlib.suppress(OSError):
                p.unlink()
    for d in sorted((d for d in data.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
        with contextlib.suppress(OSError):
            d.rmdir()  # only when empty


def _sweep(dest: Path) -> None:
    """Remove what publications killed part-way left: every ``.featurehouse-*`` (catalog copies, spill
    and staging folders), and the data files no catalog names. Called holding the folder's lock, so
    none of it belongs to a publication under way (a dry run writes nothing here), whatever process
    id its name holds (a dead publisher's id may be a live process's by now)."""
    hf = dest / "hf"
    if not hf.exists():  # killed between the two renames of a swap without RENAME_EXCHANGE: put it back
        for old in sorted(dest.glob(f"{SCRATCH}*-hf.old")):
            with contextlib.suppress(OSError):
                os.rename(old, hf)
                break
    for folder in (dest, hf):
        if not folder.is_dir():
            continue
        for p in folder.glob(f"{SCRATCH}*"):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
    catalog = dest / CATALOG_FILE
    if not catalog.exists():
        _drop_unknown(dest / "data", set())  # no catalog: nothing names them
        return
    try:
        with duckdb.connect() as raw:
            raw.execute(f"ATTACH '{_q(str(catalog))}' AS w (READ_ONLY)")
            known = _known_files(raw, "w")
    except duckdb.Error:
        return  # not a catalog this can read: remove nothing
    _drop_unknown(dest / "data", known)



def _files(folder: Path) -> dict[str, int]:
    if not folder.is_dir():
        return {}
    return {str(p): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


# --- a layout made visible whole --------------------------------------------------------------------

def _move_into(src: Path, dst: Path) -> None:
    """Move the files under ``src`` to the same places under ``dst`` (in one rename when ``dst`` is
    not there or empty)."""
    try:
        os.rename(src, dst)
        return
    except OSError:
        pass
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        target = dst / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(f, target)
    shutil.rmtree(src, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux's ``renameat2(RENAME_EXCHANGE)``); False where there is none."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):  # not on this system or file system
        return False
    raise OSError(e, os.strerror(e), str(b))


def _swap_in(stage: Path, folder: Path) -> None:
    """Put ``stage`` where ``folder`` is, in one step: a reader (or a kill) sees the old or the new."""
    if not folder.exists():
        os.rename(stage, folder)
        return
    if _exchange(stage, folder):
        shutil.rmtree(stage, ignore_errors=True)  # the old one, now
        return
    # two renames: killed between them, the next publication's sweep renames the old one back
    old = stage.with_name(stage.name + ".old")
    os.rename(folder, old)
    os.rename(stage, folder)
    shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` holds ``src``'s files: hard links (no bytes written; the old ones stay whole), else copies."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_dir():
            _link_or_copy(f, dst / f.name)
        else:
            _link_or_copy_file(f, dst / f.name)


def _link_or_copy_file(src: Path, dst: Path) -> None:
    """``dst`` is ``src``: a hard link, else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
