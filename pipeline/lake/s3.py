"""S3 (or any S3-compatible store: MinIO, a test server) for the landing area, through boto3.

Only the landing area uses this module; DuckDB reads and writes ``s3://`` data files itself
(httpfs, with the secret ``warehouse`` makes from the same settings). Credentials come from the
standard AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a profile, an instance
role); the endpoint and region from :class:`~pipeline.config.Settings`. None of them is logged.

Writes are conditional (``If-None-Match: *``): an object is created once and never
overwritten, so "landed once" holds between machines, and a large body goes up as a multipart
upload, which becomes visible only when it completes: no partial object is ever landed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from ..config import Settings

__all__ = ["S3Url", "is_s3", "client", "put_if_absent", "upload_file_if_absent", "exists", "get_bytes",
           "open_stream", "list_keys", "size", "put_bytes", "PART_SIZE"]

PART_SIZE = 64 * 1024 * 1024
"""Multipart part size: at 10,000 parts, objects up to 640 GB."""


def is_s3(where: object) -> bool:
    return str(where).startswith("s3://")


@dataclass(frozen=True)
class S3Url:
    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str) -> S3Url:
        if not is_s3(url):
            raise ValueError(f"not an s3:// URL: {url!r}")
        bucket, _, key = url[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"no bucket in {url!r}")
        return cls(bucket, key)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def join(self, *parts: str) -> S3Url:
        key = "/".join([self.key.rstrip("/"), *parts]) if self.key.strip("/") else "/".join(parts)
        return S3Url(self.bucket, key)


_CLIENTS: dict[tuple, Any] = {}
_GUARD = threading.Lock()


def client(settings: Settings | None = None) -> Any:
    """A boto3 S3 client for the settings' endpoint and region (one per process: boto3 clients
    are thread-safe)."""
    settings = settings or Settings.from_env()
    key = (settings.s3_endpoint, settings.s3_region)
    with _GUARD:
        c = _CLIENTS.get(key)
        if c is None:
            import boto3  # only deployments with S3 storage need it
            from botocore.config import Config

            cfg = Config(retries={"max_attempts": 8, "mode": "adaptive"}, max_pool_connections=32,
                         s3={"addressing_style": "path"} if settings.s3_endpoint else None)
            c = _CLIENTS[key] = boto3.session.Session().client(
                "s3", endpoint_url=settings.s3_endpoint, region_name=settings.s3_region, config=cfg)
        return c


def _code(exc: BaseException) -> str:
    resp = getattr(exc, "response", None) or {}
    return str(resp.get("Error", {}).get("Code", "")) + " " + str(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def _already_there(exc: BaseException) -> bool:
    # 412: the object exists; 409 ConditionalRequestConflict: another writer is creating it now
    code = _code(exc)
    return "PreconditionFailed" in code or "412" in code or "ConditionalRequestConflict" in code or " 409" in code


def exists(url: str, settings: Settings | None = None) -> bool:
    from botocore.exceptions import ClientError

    u = S3Url.parse(url)
    try:
        client(settings).head_object(Bucket=u.bucket, Key=u.key)
        return True
    except ClientError as exc:
        if "404" in _code(exc) or "NoSuchKey" in _code(exc) or "NotFound" in _code(exc):
            return False
        raise


def size(url: str, settings: Settings | None = None) -> int:
    u = S3Url.parse(url)
    return int(client(settings).head_object(Bucket=u.bucket, Key=u.key)["ContentLength"])


def put_bytes(url: str, data: bytes, settings: Settings | None = None) -> None:
    """Write (or overwrite) an object: for bookkeeping such as manifest parts, never landed bytes."""
    u = S3Url.parse(url)
    client(settings).put_object(Bucket=u.bucket, Key=u.key, Body=data)


def delete(url: str, settings: Settings | None = None) -> None:
    """Remove an object (absent is fine): a data file written for a commit that did not add it."""
    u = S3Url.parse(url)
    client(settings).delete_object(Bucket=u.bucket, Key=u.key)


def put_if_absent(url: str, data: bytes, settings: Settings | None = None) -> bool:
    """Create the object with ``data`` unless it exists; True when this call created it."""
    from botocore.exceptions import ClientError

    u = S3Url.parse(url)
    try:
        client(settings).put_object(Bucket=u.bucket, Key=u.key, Body=data, IfNoneMatch="*")
        return True
    except ClientError as exc:
        if _already_there(exc):
            return False
        raise


def upload_file_if_absent(url: str, f: IO[bytes], size: int, settings: Settings | None = None) -> bool:
    """Upload a local file's bytes to ``url`` unless it exists: one put when small, else a
    multipart upload completed with ``If-None-Match: *`` (visible only once whole; aborted on
    any error). True when this call created the object."""
    from botocore.exceptions import ClientError

    if size <= PART_SIZE:
        return put_if_absent(url, f.read(), settings)
    if exists(url, settings):
        return False
    u, c = S3Url.parse(url), client(settings)
    upload_id = c.create_multipart_upload(Bucket=u.bucket, Key=u.key)["UploadId"]
    try:
        parts = []
        number = 1
        while chunk := f.read(PART_SIZE):
            etag = c.upload_part(Bucket=u.bucket, Key=u.key, UploadId=upload_id, PartNumber=number,
                                 Body=chunk)["ETag"]
            parts.append({"ETag": etag, "PartNumber": number})
            number += 1
        c.complete_multipart_upload(Bucket=u.bucket, Key=u.key, UploadId=upload_id, IfNoneMatch="*",
                                    MultipartUpload={"Parts": parts})
        return True
    except ClientError as exc:
        _abort(c, u, upload_id)
        if _already_there(exc):
            return False
        raise
    except BaseException:
        _abort(c, u, upload_id)
        raise


def _abort(c: Any, u: S3Url, upload_id: str) -> None:
    try:
        c.abort_multipart_upload(Bucket=u.bucket, Key=u.key, UploadId=upload_id)
    except Exception:  # the store expires abandoned uploads itself (lifecycle rule)
        pass


def get_bytes(url: str, settings: Settings | None = None, *, limit: int | None = None) -> bytes:
    """The object's bytes (the first ``limit`` of them when given)."""
    u = S3Url.parse(url)
    kw = {"Range": f"bytes=0-{limit - 1}"} if limit else {}
    return client(settings).get_object(Bucket=u.bucket, Key=u.key, **kw)["Body"].read()


def open_stream(url: str, settings: Settings | None = None) -> IO[bytes]:
    """The object as a readable binary stream (read it in chunks: it may be many GB)."""
    u = S3Url.parse(url)
    return client(settings).get_object(Bucket=u.bucket, Key=u.key)["Body"]


def list_keys(url: str, settings: Settings | None = None) -> Iterator[str]:
    """Every object under the prefix ``url``, as ``s3://`` URLs, in key order."""
    u = S3Url.parse(url)
    pages = client(settings).get_paginator("list_objects_v2").paginate(Bucket=u.bucket, Prefix=u.key)
    for page in pages:
        for obj in page.get("Contents", []):
            yield f"s3://{u.bucket}/{obj['Key']}"
