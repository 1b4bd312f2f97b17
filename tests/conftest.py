"""Shared fixtures: a moto S3 server for the whole session, fresh buckets, DRAM scratch roots."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal import failpoints
from shoal.testing.s3 import S3Admin, moto_s3_server

# The CLI sizes its tables to COLUMNS when it is set (else 200 columns off a terminal); pytest-xdist's
# workers set it to 80, which would cut the tables the CLI tests read. The tests read full tables.
os.environ.pop("COLUMNS", None)

_FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """Endpoint URL of a moto S3 server on 127.0.0.1 (ephemeral port), for the whole session.

    While it runs, the AWS credential variables are set to fake values and instance
    metadata lookups are disabled, so nothing can reach real AWS even by accident.
    """
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _FAKE_AWS_ENV.items():
            mp.setenv(name, value)
        mp.delenv("AWS_PROFILE", raising=False)
        with moto_s3_server() as endpoint:
            yield endpoint


@pytest.fixture(scope="session")
def s3_admin(s3_endpoint: str) -> Iterator[S3Admin]:
    """Direct boto3 access to the test server (buckets, ground truth)."""
    admin = S3Admin(s3_endpoint)
    yield admin
    admin.close()


@pytest.fixture(scope="session")
def s3_options(s3_admin: S3Admin) -> dict[str, Any]:
    """fsspec storage options for the test server."""
    return s3_admin.storage_options()


@pytest.fixture
def s3_url(s3_admin: S3Admin) -> str:
    """``s3://<fresh bucket>/root``: an empty shared-tier root on the test server."""
    return f"s3://{s3_admin.create_bucket()}/root"


@pytest.fixture
def shm_path(tmp_path: Path) -> Iterator[Path]:
    """A fresh, empty directory on tmpfs (``/dev/shm``; ``tmp_path`` where there is none), removed after."""
    if not os.path.isdir("/dev/shm"):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="shoal-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def dram_root(shm_path: Path) -> Path:
    """The DRAM tier root of a test's Checkpointer: a private directory on tmpfs."""
    return shm_path


class Hold:
    """A failpoint of this process that blocks whoever hits it until the test releases it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.reached = threading.Event()
        """Set once some thread is held here."""
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    def wait_released(self) -> None:
        # generous: it only runs out when a test forgot to release, and then fails that test
        if not self._released.wait(120):
            raise RuntimeError(f"failpoint {self.name} was held for 120 s: the test never released it")


@pytest.fixture
def hold_failpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], Hold]]:
    """``hold(name)``: the failpoint ``name`` blocks until ``.release()``: an event ordered after
    another by the test, not by a delay a busy machine can outlast. Released at teardown."""
    holds: dict[str, Hold] = {}
    real = failpoints.hit

    def hit(name: str, *, rank: int = 0) -> None:
        held = holds.get(name)
        if held is not None:
            held.reached.set()
            held.wait_released()
        real(name, rank=rank)

    def hold(name: str) -> Hold:
        holds[name] = Hold(name)
        return holds[name]

    monkeypatch.setattr(failpoints, "hit", hit)
    try:
        yield hold
    finally:
        for held in holds.values():
            held.release()  # never leave a pipeline thread blocked behind the test
