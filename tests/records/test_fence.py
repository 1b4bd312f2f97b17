"""Writer fencing on the shared tier: the newest claim wins, every other writer is fenced."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from shoal.errors import FormatError, MissingFile, ShoalError, WriterFenced
from shoal.format import layout
from shoal.records.fence import WRITER_FORMAT, WriterFence, after_failed_commit, decode_writer, read_writer
from shoal.tiers import open_tier
from shoal.tiers.base import Tier


@pytest.fixture(params=["posix", "s3"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    """An empty job directory on the shared tier: a local directory, or a bucket on the moto server."""
    if request.param == "posix":
        return open_tier("shared", str(tmp_path / "shared" / "job"))
    url = request.getfixturevalue("s3_url")
    options = request.getfixturevalue("s3_options")
    return open_tier("shared", f"{url}/job", options)


def _record(tier: Tier) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(tier.read(layout.WRITER))
    return doc


def test_claim_writes_a_record_naming_writer_host_pid_and_time(shared: Tier) -> None:
    before = time.time()
    fence = WriterFence.claim(shared, host="node7", pid=4242)
    doc = _record(shared)
    assert doc["format"] == WRITER_FORMAT == "shoal-writer/1"
    assert doc["writer"] == fence.writer_id and len(fence.writer_id) == 16
    int(fence.writer_id, 16)
    assert doc["host"] == "node7" and doc["pid"] == 4242
    assert before <= doc["claimed"] <= time.time()
    assert read_writer(shared) == fence.record
    fence.check(shared)  # the holder passes


def test_every_claim_is_a_new_writer_even_from_the_same_process(tmp_path: Path) -> None:
    shared = open_tier("shared", str(tmp_path / "job"))
    fences = [WriterFence.claim(shared, host="a", pid=os.getpid()) for _ in range(20)]
    assert len({f.writer_id for f in fences}) == 20
    fences[-1].check(shared)
    for f in fences[:-1]:
        with pytest.raises(WriterFenced):
            f.check(shared)


def test_the_newest_claim_wins_and_the_older_writer_is_fenced(
    shared: Tier, caplog: pytest.LogCaptureFixture
) -> None:
    first = WriterFence.claim(shared, host="a", pid=11)
    with caplog.at_level(logging.WARNING, logger="shoal.records.fence"):
        second = WriterFence.claim(shared, host="b", pid=22)
    # The takeover is logged, naming the writer it displaced.
    assert first.writer_id in caplog.text and "host 'a', pid 11" in caplog.text
    second.check(shared)
    with pytest.raises(WriterFenced) as err:
        first.check(shared, "commit step 3")
    msg = str(err.value)
    assert "commit step 3" in msg and shared.url in msg
    assert second.writer_id in msg and "host 'b', pid 22" in msg and "claimed 20" in msg  # who holds it now
    assert "same Config.job" in msg and "shared root" in msg  # what happened and the way out
    assert first.superseded_by == second.record
    assert isinstance(err.value, ShoalError) and isinstance(err.value, RuntimeError)
    # The record is not changed by the fenced writer's check.
    assert read_writer(shared) == second.record


def test_a_missing_record_fences(shared: Tier) -> None:
    fence = WriterFence.claim(shared, host="a", pid=1)
    shared.delete(layout.WRITER)
    with pytest.raises(WriterFenced, match="is missing"):
        fence.check(shared)
    assert fence.superseded_by is None  # nobody else was seen
    assert fence.holder(shared) is None


MALFORMED = [
    b"",
    b"{",
    b"[]",
    b'"shoal-writer/1"',
    b"\xff\xfe\x00garbage",
    b"[" * 50_000 + b"]" * 50_000,
    b'{"format": "shoal-writer/1"}',
    b'{"format": "shoal-writer/2", "writer": "0123456789abcdef", "host": "a", "pid": 1, "claimed": 1.0}',
    b'{"format": "shoal-writer/1", "writer": "XYZ", "host": "a", "pid": 1, "claimed": 1.0}',
    b'{"format": "shoal-writer/1", "writer": "0123456789abcdef", "host": "", "pid": 1, "claimed": 1.0}',
    b'{"format": "shoal-writer/1", "writer": "0123456789abcdef", "host": 7, "pid": 1, "claimed": 1.0}',
    b'{"format": "shoal-writer/1", "writer": "0123456789abcdef", "host": "a", "pid": true, "claimed": 1.0}',
    b'{"format": "shoal-writer/1", "writer": "0123456789abcdef", "host": "a", "pid": -3, "claimed": 1.0}',
    b'{"format": "shoal-writer/1", "writer": "0123456789abcdef", "host": "a", "pid": 1, "claimed": "now"}',
    b'{"format": "shoal-writer/1", "writer": "0123456789abcdef", "host": "a", "pid": 1, "claimed": NaN}',
    b'{"format": "shoal-writer/1", "writer": "0123456789abcdef", "host": "a", "pid": 1}',
]


@pytest.mark.parametrize("data", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_record_is_a_format_error_and_fences(tmp_path: Path, data: bytes) -> None:
    shared = open_tier("shared", str(tmp_path / "job"))
    fence = WriterFence.claim(shared, host="a", pid=1)
    shared.write(layout.WRITER, data)
    with pytest.raises(FormatError) as decoded:
        decode_writer(data, "somewhere/WRITER")
    assert "somewhere/WRITER" in str(decoded.value)
    with pytest.raises(WriterFenced) as err:
        fence.check(shared)
    assert "unreadable" in str(err.value) and f"delete {shared.url}/{layout.WRITER}" in str(err.value)


def test_an_oversized_record_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    shared = open_tier("shared", str(tmp_path / "job"))
    fence = WriterFence.claim(shared, host="a", pid=1)
    shared.write(layout.WRITER, b" " * (layout.MAX_POINTER_BYTES + 1))
    with pytest.raises(WriterFenced, match="more than the 65536 bytes"):
        fence.check(shared)


def test_a_claim_replaces_a_malformed_record(shared: Tier, caplog: pytest.LogCaptureFixture) -> None:
    shared.write(layout.WRITER, b"{not json")
    with caplog.at_level(logging.WARNING, logger="shoal.records.fence"):
        fence = WriterFence.claim(shared, host="a", pid=1)
    assert "unreadable writer record" in caplog.text
    fence.check(shared)


def test_the_first_claim_on_a_job_warns_about_nobody(shared: Tier, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="shoal.records.fence"):
        WriterFence.claim(shared, host="a", pid=1)
    assert caplog.records == []


def test_after_a_failed_commit_a_takeover_is_the_error_to_report(shared: Tier) -> None:
    mine = WriterFence.claim(shared, host="a", pid=1)
    WriterFence.claim(shared, host="b", pid=2)
    cause = MissingFile("packs/x.pack is missing")  # the other writer's retention took a reused pack
    error, kept = after_failed_commit(mine, shared, cause, "commit step 3")
    assert isinstance(error, WriterFenced) and "host 'b'" in str(error) and error.__cause__ is cause
    assert kept is mine and mine.superseded_by is not None
    # Once superseded, a vanished record gives the job back to nobody: the fence stays.
    shared.delete(layout.WRITER)
    error, kept = after_failed_commit(mine, shared, cause, "commit step 4")
    assert error is cause and kept is mine


def test_after_a_failed_commit_a_vanished_record_lets_the_writer_claim_again(shared: Tier) -> None:
    mine = WriterFence.claim(shared, host="a", pid=1)
    shared.delete(layout.WRITER)
    cause = MissingFile("packs/x.pack is missing")
    error, kept = after_failed_commit(mine, shared, cause, "commit step 3")
    assert error is cause and kept is None
    # With the record still ours (another failure), nothing changes.
    again = WriterFence.claim(shared, host="a", pid=1)
    assert after_failed_commit(again, shared, cause, "commit step 4") == (cause, again)
