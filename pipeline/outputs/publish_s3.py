"""Publish into ``s3://bucket/prefix``: the folder layout, built locally, then uploaded.

``publish`` builds the publication in a local folder exactly as for a folder DEST (the same
code, the same crash safety), then sends what S3 does not hold yet, so S3 holds the same layout:
``featurehouse.ducklake``, ``data/...``, ``hf/<table>/*.parquet``, ``hf/README.md``.

**The local folder** (``dest/`` in ``stage``, a folder of featurehouse's own: by default
``publish/<digest of the endpoint and URL>/`` in featurehouse's cache folder; beside it
``etags.json``, the ETag S3 gave each of its files) is made to hold what S3 holds before each
publication: the catalog S3 holds, the data files that catalog names and ``hf/`` as it is
there, each downloaded only when S3's ETag or size is not the local file's. So the change feed
is applied to the publication S3 holds, whoever made it; a machine that did not make it
downloads it once. One publication through a folder at a time: the folder's ``flock``.

**What is sent, in order**: the data files S3 does not hold (``If-None-Match: *``: a data file
is never overwritten, a reader of the old catalog may be reading it), then ``hf/``'s changed
files (its mark first saying the tables being replaced are unknown, the stale files removed, the
card and the mark last), then the catalog, last, with ``If-Match`` on the catalog S3 held when
this publication began (``If-None-Match: *`` when none): a publication that another one overtook
fails instead of dropping it. An upload that fails or is killed part-way leaves the old catalog,
so the DuckLake there is the previous publication, whole; ``hf/`` may hold some tables of each
(S3 has no rename), which the next publication repairs. Data files no catalog names (a failed
upload's, or older publications') are left: a reader attached to an old catalog may need them.

``--dry-run`` builds the publication in a copy of the local folder
(``stage/.featurehouse-dry-<pid>``, hard links: published files are never rewritten) and says
which objects it would send; it sends nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from ..config import Settings
from ..lake.s3 import PART_SIZE, S3Url
from ..lake.warehouse import _q
from . import publish as pub
from .publish_folder import _check_dest, _known_files, _link_or_copy, _lock

__all__ = ["UploadFailed", "Upload", "publish", "publish_s3", "stage_for"]

#: Objects sent (or fetched) at once.
WORKERS = 8
#: What a publication puts at the top of its prefix: nothing else may be there.
TOP = (pub.CATALOG_FILE, "data", "hf")
ETAGS = "etags.json"


class UploadFailed(pub.PublishRefused):
    """An S3 transfer that failed part-way: the DuckLake there is still the previous publication."""


@dataclass
class Upload:
    """What a publication sent to S3 (a dry run: would send)."""

    sent: list[tuple[str, int]] = field(default_factory=list)  # keys under the prefix, bytes
    kept: int = 0  # objects already there, the same
    kept_bytes: int = 0
    removed: list[str] = field(default_factory=list)  # stale hf/ objects
    fetched: int = 0  # objects downloaded to make the local folder what S3 holds
    fetched_bytes: int = 0

    @property
    def bytes_sent(self) -> int:
        return sum(n for _, n in self.sent)

    def as_dict(self) -> dict[str, Any]:
        return {"sent": [k for k, _ in self.sent], "objects_sent": len(self.sent), "bytes_sent": self.bytes_sent,
                "objects_kept": self.kept, "bytes_kept": self.kept_bytes, "removed": self.removed,
                "objects_fetched": self.fetched, "bytes_fetched": self.fetched_bytes}


def stage_for(settings: Settings, url: str) -> Path | None:
    """The folder of featurehouse's own a publication into ``url`` is built in, by default (None:
    no cache folder)."""
    from ..lake.extensions import _cache_dir

    cache = _cache_dir()
    if cache is None:
        return None
    digest = hashlib.sha256(f"{settings.s3_endpoint or 'aws'}|{url.rstrip('/')}".encode()).hexdigest()[:20]
    return cache / "publish" / digest


# --- S3 -------------------------------------------------------------------------------------------

def _client(settings: Settings) -> Any:
    try:
        import boto3  # noqa: F401
    except ImportError:
        raise pub.PublishRefused("publishing to s3:// uploads with boto3, which this install lacks: "
                                 "pip install 'featurehouse[scale]' (or boto3)") from None
    from ..lake import s3

    return s3.client(settings)


def _why(exc: BaseException, settings: Settings) -> str:
    """One line for an S3 or network error, naming no credential."""
    resp = getattr(exc, "response", None) or {}
    err = resp.get("Error", {})
    if err:
        return f"{err.get('Code', '')}: {err.get('Message', '')}".strip(": ")
    name = type(exc).__name__
    if name == "NoCredentialsError":
        return "no AWS credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile or a role)"
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"):
        return f"could not reach {settings.s3_endpoint or 'S3'} ({exc})"
    return f"{name}: {exc}"


def _s3_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError, OSError)


def _code(exc: BaseException) -> str:
    resp = getattr(exc, "response", None) or {}
    return f"{resp.get('Error', {}).get('Code', '')} {resp.get('ResponseMetadata', {}).get('HTTPStatusCode', '')}"


def _listing(c: Any, u: S3Url) -> dict[str, tuple[int, str]]:
    """Every object under the prefix: key relative to it → (size, ETag without quotes)."""
    out = {}
    prefix = u.key.strip("/") + "/" if u.key.strip("/") else ""
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=u.bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix):]] = (int(o["Size"]), o["ETag"].strip('"'))
    return out


def _key(u: S3Url, rel: str) -> str:
    return u.join(rel).key


def _put(c: Any, u: S3Url, rel: str, path: Path, **cond: str) -> str:
    """Send one file (one PUT, or a multipart upload visible only once complete); its ETag.
    ``cond``: ``IfNoneMatch='*'`` or ``IfMatch=etag``, checked by S3 as it makes the object."""
    size = path.stat().st_size
    key = _key(u, rel)
    if size <= PART_SIZE:
        with open(path, "rb") as f:
            return c.put_object(Bucket=u.bucket, Key=key, Body=f, **cond)["ETag"].strip('"')
    upload_id = c.create_multipart_upload(Bucket=u.bucket, Key=key)["UploadId"]
    try:
        parts = []
        with open(path, "rb") as f:
            while chunk := f.read(PART_SIZE):
                n = len(parts) + 1
                etag = c.upload_part(Bucket=u.bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=chunk)["ETag"]
                parts.append({"ETag": etag, "PartNumber": n})
        return c.complete_multipart_upload(Bucket=u.bucket, Key=key, UploadId=upload_id,
                                           MultipartUpload={"Parts": parts}, **cond)["ETag"].strip('"')
    except BaseException:
        with contextlib.suppress(Exception):  # else the bucket's lifecycle rule expires it
            c.abort_multipart_upload(Bucket=u.bucket, Key=key, UploadId=upload_id)
        raise


def _get(c: Any, u: S3Url, rel: str, path: Path) -> None:
    """Download one object into ``path`` (whole, then renamed: a reader of the folder sees old or new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{pub.SCRATCH}{os.getpid()}-{threading.get_ident()}-{path.name}")
    try:
        body = c.get_object(Bucket=u.bucket, Key=_key(u, rel))["Body"]
        with open(tmp, "wb") as f:
            while chunk := body.read(8 * 1024 * 1024):
                f.write(chunk)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _all(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    """``fn`` of each item, ``WORKERS`` at once; the first failure cancels what has not begun."""
    items = list(items)
    if not items:
        return []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(WORKERS, len(items)))
    try:
        futures = [pool.submit(fn, i) for i in items]
        return [f.result() for f in futures]
    finally:  # a failure, or Ctrl-C / SIGTERM in the main thread: nothing queued starts
        pool.shutdown(wait=True, cancel_futures=True)


# --- the local folder's ETags ---------------------------------------------------------------------

class ETags:
    """The S3 ETag of each file of the local folder, as S3 gave it (kept by size and mtime), else
    computed as S3 computes it for this module's uploads (MD5; of the parts' MD5s for a multipart)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.file = folder.parent / ETAGS  # beside the folder: nothing in it is not a publication's
        try:
            self.known: dict[str, list] = dict(json.loads(self.file.read_text(encoding="utf-8")).get("files", {}))
        except (OSError, ValueError, AttributeError):
            self.known = {}
        self._guard = threading.Lock()

    def _stat(self, rel: str) -> tuple[int, int] | None:
        try:
            st = (self.folder / rel).stat()
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    def record(self, rel: str, etag: str) -> None:
        st = self._stat(rel)
        if st is not None:
            with self._guard:
                self.known[rel] = [st[0], st[1], etag]

    def same(self, rel: str, remote: tuple[int, str] | None) -> bool:
        """The local file is the object S3 holds (``remote``: its size and ETag)."""
        st = self._stat(rel)
        if remote is None or st is None or st[0] != remote[0]:
            return False
        with self._guard:
            had = self.known.get(rel)
        if had and had[0] == st[0] and had[1] == st[1]:
            return had[2] == remote[1]
        etag = _etag(self.folder / rel, st[0])
        self.record(rel, etag)
        return etag == remote[1]

    def save(self) -> None:
        with self._guard:
            keep = {k: v for k, v in self.known.items() if (self.folder / k).is_file()}
        tmp = self.file.with_name(f".{ETAGS}.{os.getpid()}")
        tmp.write_text(json.dumps({"files": keep}), encoding="utf-8")
        os.replace(tmp, self.file)


def _etag(path: Path, size: int) -> str:
    with open(path, "rb") as f:
        if size <= PART_SIZE:
            h = hashlib.md5(usedforsecurity=False)
            while chunk := f.read(8 * 1024 * 1024):
                h.update(chunk)
            return h.hexdigest()
        digests = []
        while chunk := f.read(PART_SIZE):
            digests.append(hashlib.md5(chunk, usedforsecurity=False).digest())
    return hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest() + f"-{len(digests)}"


# --- where it goes --------------------------------------------------------------------------------

def _check_s3_dest(settings: Settings, url: str) -> S3Url:
    try:
        u = S3Url.parse(url)
    except ValueError as exc:
        raise pub.PublishRefused(f"{url}: {exc}") from None
    mine = f"{u.bucket}/{u.key.strip('/')}".rstrip("/") + "/"
    places = [("the warehouse's data path", settings.data_url), ("the landing area", settings.landing_url)]
    for name, where in places:
        if not str(where).startswith("s3://"):
            continue
        theirs = str(where)[len("s3://"):].rstrip("/") + "/"
        if mine.startswith(theirs) or theirs.startswith(mine):
            raise pub.PublishRefused(f"{url} is inside {name} ({where}) or holds it: publish to a prefix of its own")
    return u


def _local_files(folder: Path, layouts: tuple[str, ...]) -> dict[str, int]:
    """The files of the layouts the folder holds, relative to it: never its lock or scratch."""
    out = {}
    for top in layouts:
        p = folder / top
        if p.is_file():
            out[top] = p.stat().st_size
        elif p.is_dir():
            for f in p.rglob("*"):
                if f.is_file() and not f.name.startswith(pub.SCRATCH):
                    out[f.relative_to(folder).as_posix()] = f.stat().st_size
    return out


def _layouts(formats: tuple[str, ...]) -> tuple[str, ...]:
    return ((pub.CATALOG_FILE, "data") if "ducklake" in formats else ()) + (("hf",) if "hf" in formats else ())


# --- S3 → the local folder ------------------------------------------------------------------------

def _take_what_s3_holds(c: Any, u: S3Url, folder: Path, remote: dict[str, tuple[int, str]],
                        tags: ETags, formats: tuple[str, ...], up: Upload) -> None:
    """Make the local folder hold the publication S3 holds, downloading only what differs."""
    fetch: list[str] = []
    if "ducklake" in formats:
        cat = folder / pub.CATALOG_FILE
        if pub.CATALOG_FILE not in remote:
            with contextlib.suppress(FileNotFoundError):
                cat.unlink()  # nothing published there: the local data files are swept as named by none
        elif not tags.same(pub.CATALOG_FILE, remote[pub.CATALOG_FILE]):
            _fetch(c, u, folder, [pub.CATALOG_FILE], tags, remote, up)
        if cat.exists():
            try:
                with duckdb.connect() as raw:
                    raw.execute(f"ATTACH '{_q(str(cat))}' AS w (READ_ONLY)")
                    named = _known_files(raw, "w")
            except duckdb.Error as exc:
                raise pub.PublishRefused(f"{u.join(pub.CATALOG_FILE)} is not a catalog a publication made "
                                         f"({str(exc).splitlines()[0]}): publish into another prefix") from None
            for rel in sorted(named):
                if rel.startswith(("/", "s3://", "http://", "https://")):
                    continue  # not relative to the data path: not this layout's
                key = f"data/{rel}"
                if key not in remote:
                    raise pub.PublishRefused(f"{u.join(key)} is named by the catalog there but missing: that "
                                             "publication is broken; publish into another prefix")
                if not tags.same(key, remote[key]):
                    fetch.append(key)
    if "hf" in formats:
        theirs = {k for k in remote if k.startswith("hf/")}
        fetch += sorted(k for k in theirs if not tags.same(k, remote[k]))
        hf = folder / "hf"
        if hf.is_dir():
            for f in list(hf.rglob("*")):
                rel = f.relative_to(folder).as_posix()
                if f.is_file() and rel not in theirs:
                    f.unlink()
            for d in sorted((d for d in hf.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
                with contextlib.suppress(OSError):
                    d.rmdir()
            if not theirs:
                shutil.rmtree(hf, ignore_errors=True)
    _fetch(c, u, folder, fetch, tags, remote, up)


def _fetch(c: Any, u: S3Url, folder: Path, rels: list[str], tags: ETags, remote: dict[str, tuple[int, str]],
           up: Upload) -> None:
    def one(rel: str) -> None:
        _get(c, u, rel, folder / rel)
        tags.record(rel, remote[rel][1])

    _all(one, rels)
    up.fetched += len(rels)
    up.fetched_bytes += sum(remote[r][0] for r in rels)


# --- the local folder → S3 ------------------------------------------------------------------------

@dataclass
class _Plan:
    data: list[str]
    hf: list[str]  # table files, then the card
    mark: bool  # hf/.published.json changed
    stale: list[str]
    catalog: bool


def _plan(folder: Path, remote: dict[str, tuple[int, str]], tags: ETags, formats: tuple[str, ...],
          up: Upload) -> _Plan:
    local = _local_files(folder, _layouts(formats))
    send = []
    for rel, size in sorted(local.items()):
        if tags.same(rel, remote.get(rel)):
            up.kept += 1
            up.kept_bytes += size
        else:
            send.append(rel)
    mark = f"hf/{pub.HF_MARK}"
    card = "hf/README.md"
    plan = _Plan(data=[r for r in send if r.startswith("data/")],
                 hf=[r for r in send if r.startswith("hf/") and r not in (mark, card)] + ([card] if card in send else []),
                 mark=mark in send,
                 stale=sorted(k for k in remote if k.startswith("hf/") and k not in local) if "hf" in formats else [],
                 catalog=pub.CATALOG_FILE in send)
    order = plan.data + plan.hf + ([mark] if plan.mark else []) + ([pub.CATALOG_FILE] if plan.catalog else [])
    up.sent = [(r, local[r]) for r in order]
    up.removed = plan.stale
    return plan


def _send(c: Any, u: S3Url, folder: Path, plan: _Plan, remote: dict[str, tuple[int, str]], tags: ETags,
          held: dict[str, str]) -> None:
    from botocore.exceptions import ClientError

    # the catalog S3 holds now must be the one this publication was built on (checked again by the
    # conditional PUT at the end; this spares sending anything for a publication already overtaken)
    was = remote.get(pub.CATALOG_FILE)
    try:
        now = c.head_object(Bucket=u.bucket, Key=_key(u, pub.CATALOG_FILE))["ETag"].strip('"')
    except ClientError as exc:
        if "404" not in _code(exc) and "NotFound" not in _code(exc) and "NoSuchKey" not in _code(exc):
            raise
        now = None
    if now != (was[1] if was else None):
        raise _overtaken(u)

    def data(rel: str) -> None:
        try:
            tags.record(rel, _put(c, u, rel, folder / rel, IfNoneMatch="*"))
        except ClientError as exc:  # there already: the same file sent by an upload that failed later?
            code = _code(exc)
            if not ("PreconditionFailed" in code or "412" in code):
                raise
            head = c.head_object(Bucket=u.bucket, Key=_key(u, rel))
            if not tags.same(rel, (int(head["ContentLength"]), head["ETag"].strip('"'))):
                raise UploadFailed(f"{u.join(rel)} is on S3 already with other bytes than the data file the new "
                                   "catalog names: another publisher? Nothing was replaced") from None

    def hf(rel: str) -> None:
        tags.record(rel, _put(c, u, rel, folder / rel))

    _all(data, plan.data)
    mark = f"hf/{pub.HF_MARK}"
    touched = {r.split("/")[1] for r in plan.hf + plan.stale if r.count("/") >= 2}
    if touched:
        # first, S3's hf/ says the tables about to change hold nothing known: a publication that
        # fetches a hf/ left half-replaced writes those tables again
        interim = json.dumps({"tables": {t: s for t, s in held.items() if t not in touched}}, indent=1).encode()
        c.put_object(Bucket=u.bucket, Key=_key(u, mark), Body=interim)
    _all(hf, [r for r in plan.hf if r != "hf/README.md"])
    _all(lambda k: c.delete_object(Bucket=u.bucket, Key=_key(u, k)), plan.stale)
    if "hf/README.md" in plan.hf:
        hf("hf/README.md")
    if plan.mark or touched:
        hf(mark)
    if plan.catalog:
        cond = {"IfMatch": was[1]} if was else {"IfNoneMatch": "*"}
        try:
            tags.record(pub.CATALOG_FILE, _put(c, u, pub.CATALOG_FILE, folder / pub.CATALOG_FILE, **cond))
        except ClientError as exc:
            code = _code(exc)
            if "PreconditionFailed" in code or "412" in code or "ConditionalRequestConflict" in code or " 409" in code:
                raise _overtaken(u) from None
            raise


def _overtaken(u: S3Url) -> UploadFailed:
    return UploadFailed(f"another publication replaced {u.join(pub.CATALOG_FILE)} while this one ran: its catalog "
                        "was left as it is; publish again to build on it")


# --- the whole of it --------------------------------------------------------------------------------

def publish(settings: Settings, dest: str | os.PathLike, *, snapshot: int | None = None, at=None,
            tables: list[str] | None = None, formats: tuple[str, ...] = ("ducklake", "hf"), url: str | None = None,
            license: str | None = None, include_private: bool = False, dry_run: bool = False,
            stage: str | os.PathLike | None = None) -> pub.Published:
    """:func:`pipeline.outputs.publish.publish` into ``s3://bucket/prefix``: the publication is
    built in ``stage`` (default: in featurehouse's cache folder) by that function's folder code,
    then uploaded (:func:`publish_s3`). Raises ``PublishRefused`` as it does (:class:`UploadFailed`
    for an upload that failed part-way)."""
    started = time.monotonic()
    bad = [f for f in formats if f not in ("ducklake", "hf")]
    if bad or not formats:
        raise pub.PublishRefused(f"unknown format {', '.join(bad) or '(none)'}: ducklake, hf or both")
    where = os.fspath(dest)
    if not where.startswith("s3:/"):
        raise pub.PublishRefused(f"{where} is not an s3:// address: pipeline.outputs.publish.publish publishes a folder")
    remote = "s3://" + where[len("s3:/"):].lstrip("/")  # a Path made of s3://b/x reads s3:/b/x
    url = (url.rstrip("/") if url else None) or remote.rstrip("/")  # the catalog names its data files there
    if not re.match(r"(https?|s3|gs|r2|az)://\S+$", url):
        raise pub.PublishRefused(f"--url {url!r} is not an http(s):// or s3:// address")
    kw = dict(snapshot=snapshot, at=at, tables=tables, formats=tuple(formats), url=url, license=license,
              include_private=include_private)
    out = publish_s3(settings, remote, formats=tuple(formats), stage=Path(stage) if stage else None,
                     dry_run=dry_run, build=lambda folder: pub._publish_folder(settings, folder, **kw))
    out.seconds = time.monotonic() - started
    return out


def publish_s3(settings: Settings, url: str, *, formats: tuple[str, ...], stage: Path | None, dry_run: bool,
               build: Callable[[Path], pub.Published]) -> pub.Published:
    """Publish into ``url`` (``s3://bucket/prefix``): ``build(folder)`` publishes ``formats`` into
    a local folder made to hold what S3 holds (``stage/dest``; ``stage`` by default
    :func:`stage_for`), then what differs is sent, the catalog last. A dry run builds in a copy and
    sends nothing."""
    u = _check_s3_dest(settings, url)
    url = str(u).rstrip("/")
    c = _client(settings)
    stage = stage if stage is not None else stage_for(settings, url)
    temporary = stage is None
    if temporary:  # no cache folder: built in a temporary one (S3's publication fetched every time)
        stage = Path(tempfile.mkdtemp(prefix="featurehouse-publish-s3-"))
    stage = Path(os.path.abspath(stage))
    errors = _s3_errors()
    up = Upload()
    stack = contextlib.ExitStack()
    try:
        stage.mkdir(parents=True, exist_ok=True, mode=0o700)
        (stage / "where.txt").write_text(f"{url}\n{settings.s3_endpoint or 'AWS'}\n", encoding="utf-8")
        folder = _check_dest(settings, stage / "dest")
        folder.mkdir(exist_ok=True)
        _lock(folder, stack)  # one publication through this folder at a time
        for old in stage.glob(f"{pub.SCRATCH}dry-*"):  # a dry run killed part-way
            shutil.rmtree(old, ignore_errors=True)
        tags = ETags(folder)
        stack.callback(tags.save)
        try:
            c.head_bucket(Bucket=u.bucket)
            remote = _listing(c, u)
        except errors as exc:
            raise UploadFailed(f"cannot list {url}: {_why(exc, settings)}") from None
        other = sorted({k.split("/", 1)[0] for k in remote} - set(TOP))
        if other:
            raise pub.PublishRefused(f"{url} holds objects no publication made ({', '.join(other[:3])}): publish "
                                     "into an empty prefix or one a publication made")
        try:
            _take_what_s3_holds(c, u, folder, remote, tags, formats, up)
        except errors as exc:
            raise UploadFailed(f"cannot fetch the publication in {url} ({_why(exc, settings)}): nothing was sent; "
                               "the publication there is whole") from None
        target = folder
        if dry_run:  # built in a copy: the folder keeps holding what S3 holds
            target = stage / f"{pub.SCRATCH}dry-{os.getpid()}"
            _link_tree(folder, target)
            stack.callback(shutil.rmtree, target, ignore_errors=True)
            tags = ETags(folder)  # its records are the folder's; not saved
            tags.folder = target
        out = build(target)
        plan = _plan(target, remote, tags, formats, up)
        if dry_run:
            out.dest, out.dry_run = folder, True
            out.bytes_written = out.files_written = 0
            out.bytes_by_format = {}
        else:
            was = _remote_mark(c, u, remote, errors)
            try:
                _send(c, u, target, plan, remote, tags, was)
            except errors as exc:
                hf = " (hf/ may hold some tables of this publication: the next one repairs it)" if plan.hf else ""
                raise UploadFailed(f"uploading to {url} failed ({_why(exc, settings)}): its catalog was not replaced, "
                                   f"the DuckLake there is the publication before, whole{hf}; publish again to "
                                   "finish") from None
        out.remote, out.upload, out.endpoint = url, up, settings.s3_endpoint
        return out
    finally:
        stack.close()
        if temporary:
            shutil.rmtree(stage, ignore_errors=True)


def _remote_mark(c: Any, u: S3Url, remote: dict[str, tuple[int, str]], errors: tuple) -> dict[str, str]:
    """Which snapshot each table's files in S3's ``hf/`` hold, as its mark says."""
    key = f"hf/{pub.HF_MARK}"
    if key not in remote:
        return {}
    try:
        return dict(json.loads(c.get_object(Bucket=u.bucket, Key=_key(u, key))["Body"].read()).get("tables", {}))
    except (*errors, ValueError, AttributeError, TypeError):
        return {}


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` holds ``src``'s layouts as hard links (copies where links cannot be made)."""
    dst.mkdir(parents=True)
    for top in TOP:
        p = src / top
        if p.is_dir():
            _link_or_copy(p, dst / top)
        elif p.is_file():
            try:
                os.link(p, dst / top)
            except OSError:
                shutil.copy2(p, dst / top)
