"""Retention on a real shared tier: damaged steps, other writers and failing listings, through
``run_retention`` and ``shoal gc``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from shoal.cli.main import main as cli_main
from shoal.engine.retention import run_retention
from shoal.errors import TierError
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.format.manifest import Pointer
from shoal.records.fence import WriterClaim
from shoal.records.retention import pack_ids_on
from shoal.tiers import open_tier
from shoal.tiers.base import Tier
from shoal.tiers.shared import FsspecTier

from .retention_helpers import bare_manifest, pack_id


def _shared(tmp_path: Path) -> Tier:
    return open_tier("shared", str(tmp_path / "shared" / "job"))


def _commit_step(tier: Tier, step: int, *, writer: str | None = None, reuse: tuple[str, ...] = ()) -> str:
    """A committed step on ``tier`` with one pack of its own (10 bytes) and the reused ones; its pack id."""
    pid = pack_id(step)
    tier.write(layout.pack_path(pid), b"x" * 10)
    tier.write(layout.index_path(pid), b"[]")
    data = bare_manifest(step, [pid, *reuse], writer).encode()
    tier.write(layout.manifest_path(step), data)
    pointer = Pointer(step, digest(data)).encode()
    tier.write(layout.commit_path(step), pointer)
    tier.write(layout.LATEST, pointer)
    return pid


def _step_dirs(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "shared" / "job" / layout.STEPS_DIR).iterdir())


def _damage(tier: Tier, how: str, step: int) -> None:
    if how == "commit without manifest":
        tier.delete(layout.manifest_path(step))
    elif how == "garbage manifest":
        tier.write(layout.manifest_path(step), b'{"format": "shoal/1.0", "job": ')
    elif how == "digest mismatch":  # a second writer rewrote the manifest of the same step
        tier.write(layout.manifest_path(step), bare_manifest(step, [pack_id(step)], "other").encode())
    else:  # pragma: no cover
        raise AssertionError(how)


DAMAGE = ["commit without manifest", "garbage manifest", "digest mismatch"]


@pytest.mark.parametrize("how", DAMAGE)
def test_run_retention_removes_an_old_damaged_step_and_its_packs_and_directory(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = _shared(tmp_path)
    for step in range(1, 6):
        _commit_step(tier, step)
    _damage(tier, how, 2)
    with caplog.at_level(logging.WARNING, logger="shoal.records.retention"):
        freed, dropped = run_retention(tier, 2, 5)
    assert dropped == (pack_id(1), pack_id(2), pack_id(3)) and freed == 30
    assert _step_dirs(tmp_path) == [f"{4:012d}", f"{5:012d}"]  # emptied step directories are gone too
    assert pack_ids_on(tier) == [pack_id(4), pack_id(5)]
    assert "step 2 is damaged" in caplog.text and "removed" in caplog.text


@pytest.mark.parametrize("how", DAMAGE)
def test_run_retention_keeps_a_damaged_step_in_the_window_and_the_packs_up_to_it(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = _shared(tmp_path)
    for step in range(1, 7):
        _commit_step(tier, step)
    tier.write(layout.pack_path(pack_id(6, 1)), b"y" * 7)  # an aborted save's pack, newer than the damage
    _damage(tier, how, 5)
    with caplog.at_level(logging.WARNING, logger="shoal.records.retention"):
        freed, dropped = run_retention(tier, 2, 6)
    # Kept: 4 and 6 (the damaged 5 does not count); 1..3 go, but their packs may be 5's.
    assert dropped == (pack_id(6, 1),) and freed == 7
    assert _step_dirs(tmp_path) == [f"{s:012d}" for s in (4, 5, 6)]
    assert pack_ids_on(tier) == [pack_id(s) for s in range(1, 7)]
    assert "step 5 is damaged" in caplog.text and "protecting packs of steps <= 5" in caplog.text


def test_run_retention_for_a_writer_leaves_the_other_writers_steps(tmp_path: Path) -> None:
    tier = _shared(tmp_path)
    for step in (1, 2):
        _commit_step(tier, step, writer="a" * 16)
    for step in (3, 4, 5):
        _commit_step(tier, step, writer="b" * 16, reuse=(pack_id(1),))
    _, dropped = run_retention(tier, 1, 5, writer="b" * 16)
    assert dropped == (pack_id(3), pack_id(4))
    assert _step_dirs(tmp_path) == [f"{s:012d}" for s in (1, 2, 5)]


def _gc(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli_main(["gc", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_gc_reports_each_damaged_step_and_what_it_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = _shared(tmp_path)
    for step in range(1, 7):
        _commit_step(tier, step)
    _damage(tier, "commit without manifest", 2)
    _damage(tier, "garbage manifest", 5)
    code, out, err = _gc(capsys, tier.url, "--keep-last", "2", "--dry-run")
    assert code == 0, err
    assert "would delete damaged step 2 (no checkpoint for step 2" in out
    assert "kept damaged step 5 (" in out and "would protect packs of steps <= 5" in out
    assert "2 damaged step(s), 1 removed" in out
    assert _step_dirs(tmp_path) == [f"{s:012d}" for s in range(1, 7)]  # a dry run
    code, out, err = _gc(capsys, tier.url, "--keep-last", "2")
    assert code == 0 and "Traceback" not in err
    assert "deleted damaged step 2" in out and "deleted step 1 (B4 RESTARTABLE)" in out
    assert "step 2 is damaged" in err  # the log line, on stderr
    assert _step_dirs(tmp_path) == [f"{s:012d}" for s in (4, 5, 6)]
    assert pack_ids_on(tier) == [pack_id(s) for s in range(1, 7)]  # all written no later than step 5


def test_gc_judges_the_steps_of_the_writer_holding_the_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = _shared(tmp_path)
    a, b = "a" * 16, "b" * 16
    for step in (1, 2, 3):
        _commit_step(tier, step, writer=b)
    for step in (7, 8):  # another job with the same name, further along
        _commit_step(tier, step, writer=a)
    tier.write(layout.LATEST, tier.read(layout.commit_path(3)))
    tier.write(layout.WRITER, WriterClaim(b, "hb", 42, 1.0).encode())
    code, out, err = _gc(capsys, tier.url, "--keep-last", "1")
    assert code == 0, err
    assert f"left step 7 alone: committed by writer {a}" in out and f"writer {b} (host 'hb'" in out
    assert "kept steps 3 (LATEST 3); left 2 step(s) of other writers alone" in out
    assert _step_dirs(tmp_path) == [f"{s:012d}" for s in (3, 7, 8)]
    code, out, err = _gc(capsys, tier.url, "--keep-last", "1", "--all-writers")
    assert code == 0, err
    assert _step_dirs(tmp_path) == [f"{3:012d}", f"{8:012d}"]  # the newest, and the one LATEST names


def test_gc_that_cannot_run_exits_2_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = _shared(tmp_path)
    _commit_step(tier, 1)

    def failing_list(self: Tier, prefix: str = "") -> list[str]:
        raise TierError(f"could not list {prefix!r} in shared tier {self.url}: EIO")

    monkeypatch.setattr(FsspecTier, "list", failing_list)
    code, out, err = _gc(capsys, tier.url, "--keep-last", "1")
    assert code == 2 and "shoal gc: error: could not list" in err and "Traceback" not in err
    assert out == ""


def test_retention_on_a_host_tier_removes_emptied_step_directories(tmp_path: Path) -> None:
    tier = open_tier("local", str(tmp_path / "local" / "job" / "h0"))
    for step in range(1, 5):
        pid = pack_id(step)
        tier.write(layout.pack_path(pid), b"x" * 10)
        tier.write(layout.index_path(pid), b"[]")
        tier.write(layout.manifest_path(step), bare_manifest(step, [pid]).encode())  # no commit records here
    _, dropped = run_retention(tier, 2, 4, manifests_are_commits=True)
    assert dropped == (pack_id(1), pack_id(2))
    steps = tmp_path / "local" / "job" / "h0" / layout.STEPS_DIR
    assert sorted(p.name for p in steps.iterdir()) == [f"{3:012d}", f"{4:012d}"]
