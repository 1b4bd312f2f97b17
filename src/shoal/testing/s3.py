"""A throw-away S3 for tests: moto's server on 127.0.0.1, an ephemeral port, fresh buckets.

Nothing here touches the process environment or real AWS: credentials and the
endpoint are passed explicitly through the storage options that
:func:`s3_storage_options` returns.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

TEST_REGION = "us-east-1"
TEST_KEY = "testing"
TEST_SECRET = "testing"


@contextmanager
def moto_s3_server(host: str = "127.0.0.1", *, quiet: bool = True) -> Iterator[str]:
    """Run moto's S3 server in a thread for the duration of the ``with`` block; yield its endpoint URL.

    The port is chosen by the kernel (port 0), so parallel test runs never collide.
    The server is stopped when the block exits, also on error. With ``quiet``, the
    per-request log lines of werkzeug are silenced while the server runs (the
    ``werkzeug`` logger's level is restored afterwards).
    """
    from moto.server import ThreadedMotoServer

    werkzeug_log = logging.getLogger("werkzeug")
    old_level = werkzeug_log.level
    if quiet:
        werkzeug_log.setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address=host, port=0, verbose=False)
    server.start()
    try:
        bound_host, port = server.get_host_and_port()
        yield f"http://{bound_host}:{port}"
    finally:
        server.stop()
        werkzeug_log.setLevel(old_level)


def s3_storage_options(endpoint_url: str) -> dict[str, Any]:
    """fsspec/s3fs storage options that talk to ``endpoint_url`` with the test credentials."""
    return {
        "key": TEST_KEY,
        "secret": TEST_SECRET,
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": TEST_REGION},
    }


class S3Admin:
    """Direct boto3 access to the test server: buckets, and ground truth *around* a tier.

    One client per instance (created on first use); pass the instance around explicitly.
    """

    def __init__(self, endpoint_url: str) -> None:
        self.endpoint_url = endpoint_url
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The boto3 S3 client for the test server."""
        if self._client is None:
            import boto3

            self._client = boto3.client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=TEST_REGION,
                aws_access_key_id=TEST_KEY,
                aws_secret_access_key=TEST_SECRET,
            )
        return self._client

    def storage_options(self) -> dict[str, Any]:
        """Storage options for an fsspec tier on this server (see :func:`s3_storage_options`)."""
        return s3_storage_options(self.endpoint_url)

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name unless ``name`` is given); return its name."""
        bucket = name or f"shoal-test-{secrets.token_hex(6)}"
        self.client.create_bucket(Bucket=bucket)
        return bucket

    def list_objects(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key in ``bucket`` under ``prefix``, sorted."""
        keys: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
        return sorted(keys)

    def list_multipart_uploads(self, bucket: str) -> list[str]:
        """Keys of multipart uploads still open in ``bucket`` (an aborted upload is not listed)."""
        response = self.client.list_multipart_uploads(Bucket=bucket)
        return sorted(upload["Key"] for upload in response.get("Uploads", []))

    def get_object(self, bucket: str, key: str) -> bytes | None:
        """The bytes of one object; ``None`` if there is no such object."""
        try:
            body = self.client.get_object(Bucket=bucket, Key=key)["Body"]
        except self.client.exceptions.NoSuchKey:
            return None
        try:
            return bytes(body.read())
        finally:
            body.close()

    def put_object(self, bucket: str, key: str, data: bytes) -> None:
        """Store one object."""
        self.client.put_object(Bucket=bucket, Key=key, Body=data)

    def close(self) -> None:
        """Close the client's connections."""
        if self._client is not None:
            self._client.close()
            self._client = None
