"""The DuckDB extensions featurehouse uses, loaded offline from their PyPI wheels with DuckDB's
own signature checks.

Each extension comes in a wheel of its own (``duckdb-extension-<name>``, one
``.duckdb_extension`` file signed with DuckDB's core key). The first process of a user that
needs one installs it from the wheel's file into this user's extension folder
(``INSTALL '<file>'``: DuckDB refuses a file whose signature is not valid), and every
connection then loads it by name (``LOAD ducklake``), which DuckDB checks again at each load.
No connection allows unsigned extensions, and none downloads any: autoinstalling is off, so a
query that needs a known extension autoloads it from the folder or fails, offline.

Where the folder cannot be used (no home or cache folder, one this user does not own alone, a
read-only or full disk), extensions are loaded straight from the wheel's file
(``LOAD '<file>'``), checked by DuckDB the same way.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import stat as stat_module
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb

from ..config import Settings

__all__ = [
    "WHEELS", "extension_path", "extension_directory", "new_connection", "load_extension", "extension_loaded",
    "needed", "s3_extensions", "CONNECTION_CONFIG", "install_all",
]

log = logging.getLogger("featurehouse")

#: The extensions featurehouse loads, and the package of the wheel that carries each.
WHEELS = {
    "ducklake": "duckdb_extension_ducklake",
    "sqlite_scanner": "duckdb_extension_sqlite_scanner",
    "postgres_scanner": "duckdb_extension_postgres_scanner",
    "httpfs": "duckdb_extension_httpfs",
    "aws": "duckdb_extension_aws",
    # the find index (pipeline/outputs/find/): full-text search; vss for the array functions
    "fts": "duckdb_extension_fts",
    "vss": "duckdb_extension_vss",
}

#: What every connection featurehouse opens is configured with: extensions signed with DuckDB's
#: core key only (DuckDB's default also takes community-signed ones; every wheel here is core),
#: unsigned ones never (DuckDB's default, and it cannot be changed once the database runs), and
#: never an extension downloaded to autoload it.
CONNECTION_CONFIG: dict[str, Any] = {
    "autoinstall_known_extensions": False,
    "allow_community_extensions": False,
}

#: The name of this user's extension folder inside featurehouse's cache folder.
_FOLDER = "duckdb-extensions"
_LOCK_FILE = ".install.lock"


def extension_path(name: str) -> str:
    """The extension's file inside its PyPI wheel (``duckdb-extension-<name>``), loadable offline
    with ``LOAD '<path>'``; raises ImportError naming the package when it is not installed."""
    spec = importlib.util.find_spec(WHEELS[name])
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the DuckDB extension {name!r} is not installed: pip install "
            f"'{WHEELS[name].replace('_', '-')}=={duckdb.__version__}'"
        )
    base = Path(next(iter(spec.submodule_search_locations)))
    path = base / "extensions" / f"v{duckdb.__version__}" / f"{name}.duckdb_extension"
    if not path.exists():
        found = sorted(base.glob("extensions/*/*.duckdb_extension"))
        raise ImportError(
            f"{WHEELS[name]} carries no extension for DuckDB {duckdb.__version__} "
            f"(found: {', '.join(p.parent.name for p in found) or 'none'}); install the matching version"
        )
    return str(path)


def _cache_dir() -> Path | None:
    if os.environ.get("FEATUREHOUSE_CACHE_DIR"):
        return Path(os.environ["FEATUREHOUSE_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "featurehouse"
    home = os.environ.get("HOME")
    return Path(home) / ".cache" / "featurehouse" if home else None


def extension_directory() -> Path | None:
    """This user's extension folder (DuckDB's ``extension_directory``): ``duckdb-extensions`` in
    featurehouse's cache folder (``FEATUREHOUSE_CACHE_DIR``, else ``$XDG_CACHE_HOME/featurehouse``
    or ``~/.cache/featurehouse``), made private if missing. None where there is no such folder,
    it cannot be made, or it is not this user's alone (a folder others may write could be
    emptied or filled under us; DuckDB would still refuse any file not signed)."""
    cache = _cache_dir()
    if cache is None:
        return None
    folder = cache / _FOLDER
    with contextlib.suppress(OSError):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        st = os.lstat(folder)
    except OSError:
        return None
    if not stat_module.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return None
    return folder


# --- installing from the wheels ------------------------------------------------------------------

#: (folder, name) → the installed file of each extension this process found current (or
#: installed) in that folder: looked at once a process, not trusted — DuckDB checks the file at
#: every LOAD; a LOAD that fails installs it again once (see ``_load_installed``).
_INSTALLED: dict[tuple[str, str], str] = {}
_INSTALL_LOCK = threading.Lock()

#: The extensions this process has loaded into one of its DuckDB connections.
_LOADED: set[str] = set()
_LOADED_LOCK = threading.Lock()


def _q(s: str) -> str:
    return s.replace("'", "''")


def _installed_paths(db: duckdb.DuckDBPyConnection) -> dict[str, str]:
    return dict(db.execute("SELECT extension_name, install_path FROM duckdb_extensions() "
                           "WHERE installed AND install_mode <> 'STATICALLY_LINKED'").fetchall())


def _current(installed: str | None, wheel: str) -> bool:
    """Whether the installed file is the wheel's (as large, and written since the wheel's was)."""
    try:
        have, want = os.stat(installed) if installed else None, os.stat(wheel)
    except OSError:
        return False
    return have is not None and have.st_size == want.st_size and have.st_mtime_ns >= want.st_mtime_ns


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """One installer at a time in ``folder`` across processes (DuckDB writes each file aside and
    renames it into place, so a process loading meanwhile sees the old file or the new one)."""
    fd = os.open(folder / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _install(names: list[str], *, force: bool = False) -> dict[str, str]:
    """The installed file of each of ``names`` in this user's extension folder, installed from
    its wheel first where it is missing or not the wheel's (``force``: in any case). A name that
    cannot be installed (no folder, a disk that refuses) is left out: it is loaded from its wheel.
    Raises duckdb.Error when DuckDB refuses a wheel's file (its signature is not valid)."""
    folder = extension_directory()
    if folder is None:
        return {}
    key = str(folder)
    with _INSTALL_LOCK:
        todo = [n for n in names if force or (key, n) not in _INSTALLED]
        if todo:
            try:
                with duckdb.connect(config={**CONNECTION_CONFIG, "extension_directory": key,
                                            "autoload_known_extensions": False}) as db:
                    have = _installed_paths(db)
                    stale = [n for n in todo if force or not _current(have.get(n), extension_path(n))]
                    if stale:
                        with _folder_lock(folder):
                            have = _installed_paths(db)  # another process may have installed them meanwhile
                            for n in stale:
                                if force or not _current(have.get(n), extension_path(n)):
                                    # DuckDB checks the file's signature before it writes a byte
                                    db.execute(f"FORCE INSTALL '{_q(extension_path(n))}'")
                            have = _installed_paths(db)
                    for n in todo:
                        if have.get(n):
                            _INSTALLED[key, n] = have[n]
            except duckdb.Error as exc:
                if "signature" in str(exc):
                    raise
                log.warning("cannot install DuckDB extensions into %s (%s): loading them from their wheels",
                            folder, str(exc).splitlines()[0])
            except OSError as exc:
                log.warning("cannot install DuckDB extensions into %s (%s): loading them from their wheels",
                            folder, exc)
        return {n: _INSTALLED[key, n] for n in names if (key, n) in _INSTALLED}


def install_all() -> dict[str, str]:
    """Install every extension whose wheel is here into this user's extension folder (those
    already current are left): what any DuckDB client needs to open the warehouse or a
    publication offline with ``SET extension_directory`` (ducklake, sqlite, postgres, httpfs, aws,
    fts, vss). Returns the installed file of each; {} where there is no folder."""
    have = [n for n in WHEELS if importlib.util.find_spec(WHEELS[n]) is not None]
    return _install(have)


# --- connections ---------------------------------------------------------------------------------


def new_connection(extensions: list[str], config: dict[str, Any] | None = None) -> duckdb.DuckDBPyConnection:
    """A new in-memory DuckDB with ``extensions`` loaded (installed from their wheels into this
    user's extension folder first if needed), signature checks on, never the network."""
    installed = _install(list(extensions))
    folder = extension_directory()
    settings = {**(config or {}), **CONNECTION_CONFIG}
    if folder is not None:
        settings["extension_directory"] = str(folder)  # autoloading finds what is installed there
    conn = duckdb.connect(config=settings)
    try:
        for name in extensions:
            _load(conn, name, installed.get(name), by_name=folder is not None)
    except BaseException:
        conn.close()
        raise
    return conn


def _load(conn: duckdb.DuckDBPyConnection, name: str, installed: str | None, *, by_name: bool) -> None:
    """LOAD ``name``: its installed copy (by name where ``conn`` uses this user's extension folder)
    or, where it has none, its wheel's file. A copy DuckDB refuses (gone, damaged, replaced) is
    installed again from the wheel once; the wheel's file DuckDB refuses, it refuses for good."""
    if installed is None:
        conn.execute(f"LOAD '{_q(extension_path(name))}'")
    else:
        try:
            conn.execute(f"LOAD {name}" if by_name else f"LOAD '{_q(installed)}'")
        except duckdb.Error as exc:
            log.warning("DuckDB refused the installed copy of the %s extension (%s): installing it again "
                        "from its wheel", name, str(exc).splitlines()[0])
            again = _install([name], force=True).get(name)
            if again is None:
                conn.execute(f"LOAD '{_q(extension_path(name))}'")
            else:
                conn.execute(f"LOAD {name}" if by_name else f"LOAD '{_q(again)}'")
    with _LOADED_LOCK:
        _LOADED.add(name)


def load_extension(conn: duckdb.DuckDBPyConnection, name: str) -> None:
    """LOAD extension ``name`` into any connection: its copy in this user's extension folder
    (installed from the wheel if needed), else the wheel's file.

    A connection opened with ``allow_unsigned_extensions`` would load it unchecked: there the
    file is loaded first in a connection of its own that checks it (its cost paid twice); open
    connections without that setting (as :func:`new_connection` does)."""
    installed = _install([name]).get(name)
    folder = extension_directory()
    settings = dict(conn.execute("SELECT name, value FROM duckdb_settings() WHERE name IN "
                                 "('allow_unsigned_extensions', 'extension_directory')").fetchall())
    if settings.get("allow_unsigned_extensions") == "true":
        with duckdb.connect(config=CONNECTION_CONFIG) as checker:
            _load(checker, name, installed, by_name=False)  # refused unless DuckDB's check passes
        installed = _install([name]).get(name)  # (installed again if the check found it damaged)
        conn.execute(f"LOAD '{_q(installed or extension_path(name))}'")
        return
    by_name = folder is not None and settings.get("extension_directory") == str(folder)
    _load(conn, name, installed, by_name=by_name)


def extension_loaded(name: str) -> bool:
    """Whether this process has loaded extension ``name`` into a DuckDB connection (with
    ``sqlite_scanner``: DuckDB's SQLite library is in the process)."""
    with _LOADED_LOCK:
        return name in _LOADED


# --- which extensions a warehouse needs ----------------------------------------------------------


def needed(settings: Settings) -> list[str]:
    """The extensions a connection to the warehouse ``settings`` name loads."""
    names = ["ducklake", "sqlite_scanner" if settings.catalog_kind == "sqlite" else "postgres_scanner"]
    if settings.uses_s3:
        names += s3_extensions()
    return names


def s3_extensions() -> list[str]:
    """The extensions that read and write S3 data files."""
    # `aws` only for DuckDB's credential chain: with keys in the variables httpfs is enough, and
    # each LOAD costs a connection ~0.2-0.4 s (DuckDB hashes the whole file to check it)
    keys = os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")
    return ["httpfs"] if keys else ["httpfs", "aws"]
