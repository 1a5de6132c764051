"""A local S3 (moto's server) for the tests of S3 data and landing: a bucket per test."""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["S3Server", "moto_s3", "S3_ENV"]

S3_ENV = {"AWS_ACCESS_KEY_ID": "featurehouse-test", "AWS_SECRET_ACCESS_KEY": "featurehouse-test-secret",
          "AWS_REGION": "us-east-1"}
"""Credentials of the test server (moto accepts any), as the standard AWS variables."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    endpoint: str

    def env(self) -> dict[str, str]:
        """The settings a process needs to use this server (data path and landing aside)."""
        return S3_ENV | {"FEATUREHOUSE_S3_ENDPOINT": self.endpoint}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"])

    def bucket(self) -> str:
        name = f"fh-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o["Key"] for p in pages for o in p.get("Contents", [])]


@contextlib.contextmanager
def moto_s3() -> Iterator[S3Server]:
    """moto's S3 server on a free loopback port, for as long as the block runs."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield S3Server(f"http://127.0.0.1:{port}")
    finally:
        server.stop()


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
