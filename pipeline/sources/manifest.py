"""Fetch manifests: one JSON line per URL a fetch in a window finished, so that a rerun of
the window skips what already landed (``landing/fetch/<window>.jsonl``, or parts under
``.../fetch/<window>/`` in an S3 landing area)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from ..config import Settings
from ..lake import s3
from ..lake.landing import Where, landed_exists, landed_path

__all__ = ["manifest_path", "read_manifest", "landed_where", "Manifest"]

# --- manifest -----------------------------------------------------------------------------


def manifest_path(window: str, settings: Settings | None = None) -> Where:
    """``landing/fetch/<window>.jsonl``: one JSON line per URL a fetch in this window finished.
    In an S3 landing area, a prefix ``.../fetch/<window>/`` of parts, one per flush of a fetch."""
    settings = settings or Settings.from_env()
    if not window or "/" in window or "\\" in window or window.startswith(".") or "\0" in window:
        raise ValueError(f"window {window!r} cannot name a manifest file (no '/', no leading '.')")
    root = settings.landing_root
    if s3.is_s3(root):
        return f"{root}/fetch/{window}/"
    return Path(root) / "fetch" / f"{window}.jsonl"


def landed_where(entry: dict[str, Any], landing_root: Where) -> Where | None:
    """Where an entry's body is in *this* landing area, found by its digest (the landing area is
    content-addressed). A line's ``landed_path`` says where it was written, which for a copied
    or moved warehouse is the other folder's: read there, a copy would load the original's
    files and a moved warehouse fetch everything again."""
    sha = entry.get("sha256")
    if isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha):
        return landed_path(landing_root, sha)
    return None


def _lines(data: bytes, entries: dict[str, dict[str, Any]]) -> None:
    for line in data.splitlines():
        try:
            e = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(e, dict) and isinstance(e.get("key"), str):
            entries.pop(e["key"], None)  # keep first-seen order of the latest state
            entries[e["key"]] = e


def read_manifest(path: Where) -> dict[str, dict[str, Any]]:
    """The last line written for each key (a fetch killed mid-write leaves a partial last line,
    which is skipped). On S3, the parts are read in the order they were written."""
    entries: dict[str, dict[str, Any]] = {}
    if s3.is_s3(path):
        for url in sorted(s3.list_keys(str(path))):  # part names start with the write time
            _lines(s3.get_bytes(url), entries)
        return entries
    path = Path(path)
    if not path.exists():
        return entries
    with path.open("rb") as f:
        for line in f:
            _lines(line, entries)
    return entries


class Manifest:
    """The window's manifest. On disk, one O_APPEND write per line; on S3 (no appends), lines
    are buffered and written as a new part every ``_S3_FLUSH_LINES`` lines or
    ``_S3_FLUSH_SECONDS``, and on close: a fetch killed between flushes asks again for what it
    had not flushed (its bodies are already landed, so that costs requests, not correctness)."""

    _S3_FLUSH_LINES = 200
    _S3_FLUSH_SECONDS = 5.0

    def __init__(self, path: Where, landing_root: Where):
        self.path = path
        self.landing_root = landing_root
        self.on_s3 = s3.is_s3(path)
        if not self.on_s3:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.entries = read_manifest(path)
        self._lock = threading.Lock()
        self._buffer: list[bytes] = []
        self._flushed = time.monotonic()
        self._part = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._seq = 0

    def landed(self, key: str) -> dict[str, Any] | None:
        e = self.entries.get(key)
        if e and e.get("status") in ("landed", "empty"):
            where = landed_where(e, self.landing_root)
            if e["status"] == "empty" or (where is not None and landed_exists(where)):
                return e
        return None

    def append(self, entry: dict[str, Any]) -> None:
        line = orjson.dumps(entry) + b"\n"
        with self._lock:
            self.entries[entry["key"]] = entry
            if self.on_s3:
                self._buffer.append(line)
                if (len(self._buffer) >= self._S3_FLUSH_LINES
                        or time.monotonic() - self._flushed >= self._S3_FLUSH_SECONDS):
                    self._flush()
                return
            # One write on an O_APPEND descriptor: lines from parallel fetches never interleave.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)

    def _flush(self) -> None:
        if self._buffer:
            self._seq += 1
            name = f"{time.time_ns():020d}-{self._part}-{self._seq:06d}.jsonl"
            s3.put_bytes(f"{self.path}{name}", b"".join(self._buffer))
            self._buffer.clear()
        self._flushed = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self.on_s3:
                self._flush()


