"""HTTP paging and bulk-export transfer for the fetch stage.

Two paging rules, each in one small class: Neuronpedia's ``features-offset`` (25 features a
page, stop at a short page) and S3 ListObjectsV2 (continuation tokens). And one transfer:
an export file streamed to the landing area while its length and gzip CRC are checked, so a
file that arrived cut short is never landed.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

from ..lake.landing import Where, publish_file, scratch_dir

__all__ = [
    "ExportObject",
    "IncompleteTransfer",
    "ListObjectsV2",
    "OffsetPaging",
    "export_prefix",
    "select_exports",
    "stream_to_landing",
    "remove_spooled",
    "remove_stale_spool",
]

_S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_CHUNK = 1 << 20
_BATCH = re.compile(r"^(features|activations|explanations)/batch-(\d+)\.jsonl\.gz$")
_SIDECARS = ("model.jsonl", "source.jsonl", "sourceset.jsonl")


class IncompleteTransfer(Exception):
    "A body arrived shorter than announced, or its gzip stream is cut or corrupt: fetch it again."


@dataclass(frozen=True)
class OffsetPaging:
    """``POST /api/features-offset`` pages: ``page_size`` features each, in index order.

    The offset counts features that have activations, so the listing ends at the first page
    that comes back shorter than a full page.
    """

    page_size: int = 25

    def offsets(self, start: int = 0) -> Iterator[int]:
        offset = start
        while True:
            yield offset
            offset += self.page_size

    def is_last(self, n_items: int) -> bool:
        return n_items < self.page_size


@dataclass(frozen=True)
class ExportObject:
    """One object in the bulk-export bucket."""

    key: str
    size: int | None


@dataclass(frozen=True)
class ListObjectsV2:
    """S3 ListObjectsV2 paging: ``?list-type=2&prefix=...&continuation-token=...``.

    ``get(url, params)`` performs one (retried) GET and returns the body; pages are parsed
    here and followed until ``IsTruncated`` is false.
    """

    bucket_url: str
    prefix: str
    max_keys: int = 1000

    def pages(self, get: Callable[[str, dict[str, str]], bytes]) -> Iterator[list[ExportObject]]:
        token: str | None = None
        while True:
            params = {"list-type": "2", "prefix": self.prefix, "max-keys": str(self.max_keys)}
            if token:
                params["continuation-token"] = token
            objects, token = self.parse(get(self.bucket_url.rstrip("/") + "/", params))
            yield objects
            if not token:
                return

    @staticmethod
    def parse(body: bytes) -> tuple[list[ExportObject], str | None]:
        """Objects on one ListBucketResult page, and the token for the next page (or None)."""
        try:
            root = ElementTree.fromstring(body)
        except ElementTree.ParseError as exc:
            raise IncompleteTransfer(f"bucket listing is not valid XML ({exc})") from exc
        ns = _S3_NS if root.tag.startswith(_S3_NS) else ""
        if root.tag != f"{ns}ListBucketResult":
            raise IncompleteTransfer(f"bucket listing is a <{root.tag}>, not a ListBucketResult")
        objects = []
        for c in root.iter(f"{ns}Contents"):
            key = c.findtext(f"{ns}Key")
            size = c.findtext(f"{ns}Size")
            if key:
                objects.append(ExportObject(key, int(size) if size and size.isdigit() else None))
        truncated = (root.findtext(f"{ns}IsTruncated") or "").strip().lower() == "true"
        token = root.findtext(f"{ns}NextContinuationToken") if truncated else None
        if truncated and not token:
            raise IncompleteTransfer("bucket listing is truncated but carries no NextContinuationToken")
        return objects, token


def export_prefix(model: str, source: str) -> str:
    return f"v1/{model}/{source}/"


def select_exports(objects: list[ExportObject], prefix: str, batches: range | None) -> list[ExportObject]:
    """The model/source/source-set rows, then the features, explanations and activations
    batches (those numbered in ``batches``, or all), table by table. Other keys are ignored.

    ``batches`` selects batch files by their number in each table. The tables number them
    differently (features and explanations batches are paged by ``index`` as text, so features
    batch 0 holds "0", "1", "10", "100", ...; activations batch N holds features N*1024 to
    N*1024+1023), so features batch N and activations batch N generally cover different
    features: nothing here assumes a feature's rows share a batch number.
    """
    sidecars, batch_objs = [], []
    for o in objects:
        rel = o.key[len(prefix):] if o.key.startswith(prefix) else None
        if rel in _SIDECARS:
            sidecars.append(o)
        elif rel and (m := _BATCH.match(rel)) and (batches is None or int(m[2]) in batches):
            batch_objs.append((("features", "explanations", "activations").index(m[1]), int(m[2]), o))
    sidecars.sort(key=lambda o: _SIDECARS.index(o.key[len(prefix):]))
    return sidecars + [o for _, _, o in sorted(batch_objs, key=lambda t: (t[0], t[1]))]


class _GzipCheck:
    """Streams through gzip members (discarding the output) so that zlib checks each CRC."""

    def __init__(self) -> None:
        self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._in_member = False
        self.members = 0

    def feed(self, data: bytes) -> None:
        while data:
            self._in_member = True
            try:
                self._d.decompress(data, _CHUNK)
                while self._d.unconsumed_tail and not self._d.eof:
                    self._d.decompress(self._d.unconsumed_tail, _CHUNK)
            except zlib.error as exc:
                raise IncompleteTransfer(f"gzip data is corrupt ({exc})") from exc
            if not self._d.eof:
                return
            self.members += 1
            self._in_member = False
            data = self._d.unused_data.lstrip(b"\x00")
            self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)

    def finish(self) -> None:
        if self._in_member or not self.members:
            raise IncompleteTransfer("gzip stream is truncated: it ends before its end marker and CRC")


#: The partial downloads being written now, by this process: a fetch stopped by a signal
#: removes them (:func:`remove_spooled`) before it exits.
_SPOOLED: set[str] = set()
_SPOOLED_LOCK = threading.Lock()
#: A spool file left this long without a write is no live download's (a download writes every
#: chunk; its read times out long before): the next fetch removes it.
SPOOL_STALE_SECONDS = 3600


def remove_spooled() -> int:
    """Remove this process's partial downloads (a fetch that is stopping); returns how many."""
    with _SPOOLED_LOCK:
        paths = list(_SPOOLED)
        _SPOOLED.clear()
    for p in paths:
        Path(p).unlink(missing_ok=True)
    return len(paths)


def remove_stale_spool(landing_dir: Where, older_than: float = SPOOL_STALE_SECONDS) -> int:
    """Remove the partial downloads a killed fetch left in the spool folder (``.landing-*`` not
    written for ``older_than`` seconds); returns how many."""
    spool = scratch_dir(landing_dir)
    n = 0
    try:
        candidates = list(spool.glob(".landing-*"))
    except OSError:
        return 0
    now = time.time()
    for p in candidates:
        try:
            if now - p.stat().st_mtime > older_than:
                p.unlink()
                n += 1
        except OSError:  # gone already, or not ours to remove
            continue
    return n


def stream_to_landing(
    chunks: Iterator[bytes],
    landing_dir: Where,
    *,
    expected_size: int | None,
    gzip: bool,
) -> tuple[str, Where, int]:
    """Write ``chunks`` to a temporary file in the landing area while hashing them and, for
    gzip, checking the stream; move it to ``landing/sha256/<ab>/<sha256>`` only when whole.

    Returns (sha256, landed path, size). Raises :class:`IncompleteTransfer` when the bytes
    fall short of ``expected_size`` or the gzip stream is cut or corrupt.
    """
    spool = scratch_dir(landing_dir)
    spool.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    check = _GzipCheck() if gzip else None
    n = 0
    fd, tmp = tempfile.mkstemp(dir=spool, prefix=".landing-")
    with _SPOOLED_LOCK:
        _SPOOLED.add(tmp)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                if not chunk:
                    continue
                h.update(chunk)
                out.write(chunk)
                n += len(chunk)
                if check:
                    check.feed(chunk)
        if expected_size is not None and n != expected_size:
            raise IncompleteTransfer(f"body is {n:,} bytes but {expected_size:,} were announced")
        if check:
            check.finish()
        sha = h.hexdigest()
        # atomic (a rename, or a multipart upload completed): a landed export file is always whole
        dest, _ = publish_file(Path(tmp), landing_dir, sha, n)
        return sha, dest, n
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        with _SPOOLED_LOCK:
            _SPOOLED.discard(tmp)
