"""Exposure in the engine: SaveHandle's boundary listeners, the runtime's tracker, the exposure
events, and a run read back from its event log (shoal.records.exposure_log)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import shoal
from shoal import failpoints
from shoal.boundary import Boundary
from shoal.engine.handle import SaveHandle
from shoal.errors import ShoalError
from shoal.records.events import monotonic, read_events
from shoal.records.exposure_log import measure_paths, read_run_log
from shoal.testing import scenarios
from shoal.testing.checkpoints import make_config
from shoal.testing.multiproc import run_ranks

# -- SaveHandle's listeners -------------------------------------------------------------------------


def test_a_listener_sees_every_newly_reached_boundary_in_order() -> None:
    seen: list[tuple[int, Boundary, float]] = []
    handle = SaveHandle(3)
    handle.add_listener(lambda h, b, s: seen.append((h.step, b, s)))
    handle.reach(Boundary.STAGED)
    handle.reach(Boundary.PERSISTED)  # B2 implied
    handle.reach_at_least(Boundary.STAGED)  # nothing new
    handle.reach(Boundary.RESTARTABLE)
    assert [b for _, b, _ in seen] == list(Boundary)
    assert all(step == 3 for step, _, _ in seen)
    times = handle.times
    assert [s for _, _, s in seen] == [times[b] for b in Boundary]
    assert seen[1][2] == seen[2][2]  # the implied B2 comes with B3's time


def test_a_failing_listener_breaks_neither_the_handle_nor_the_other_listeners(caplog) -> None:
    seen: list[Boundary] = []

    def broken(h: SaveHandle, b: Boundary, s: float) -> None:
        raise RuntimeError("listener bug")

    handle = SaveHandle(1)
    handle.add_listener(broken)
    handle.add_listener(lambda h, b, s: seen.append(b))
    handle.reach(Boundary.RESTARTABLE)
    assert handle.done(Boundary.RESTARTABLE) and handle.finished
    assert seen == list(Boundary)
    assert "boundary listener failed" in caplog.text


def test_a_listener_may_read_the_handle_it_is_told_about() -> None:
    reached: list[Boundary | None] = []
    handle = SaveHandle(1)
    handle.add_listener(lambda h, b, s: reached.append(h.reached))  # takes the handle's lock
    handle.reach(Boundary.REPLICATED)
    assert reached == [Boundary.REPLICATED, Boundary.REPLICATED]


def test_two_threads_reporting_b1_never_race_into_an_error() -> None:
    for _ in range(200):
        handle = SaveHandle(1)
        errors: list[BaseException] = []

        def report(h: SaveHandle = handle, errors: list[BaseException] = errors) -> None:
            try:
                h.reach_at_least(Boundary.STAGED)
            except BaseException as e:  # noqa: BLE001 - the test wants to see any
                errors.append(e)

        threads = [threading.Thread(target=report) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and handle.reached == Boundary.STAGED


# -- the runtime's tracker and the exposure events ------------------------------------------------------


@pytest.fixture
def config(tmp_path: Path, dram_root: Path) -> shoal.Config:
    return make_config(tmp_path, dram_root)


def test_a_committed_save_protects_every_class(config: shoal.Config) -> None:
    before = monotonic()
    with shoal.Checkpointer(config) as ckpt:
        first = ckpt.exposure()
        assert all(c.protected_step is None for c in first.classes.values())
        assert first["cluster"].seconds <= monotonic() - before
        ckpt.save(5, {"w": torch.randn(1000)}).wait(timeout=60)
        saved_by = monotonic()
        ckpt.save(6, {"w": torch.randn(1000)}).wait(timeout=60)
        exposure = ckpt.exposure()
        elapsed = monotonic() - saved_by
        assert exposure["cluster"].protected_step == 6 and exposure["cluster"].steps == 0
        assert 0 <= exposure["cluster"].seconds <= elapsed  # since step 6's save, not the start
        assert exposure["host"].protected_step == exposure["process"].protected_step == 6
        assert ckpt.exposure(step=9)["cluster"].steps == 3
        path = ckpt.config.event_log
    assert path is not None
    logged = [e for e in read_events(path, kinds=["exposure"]) if e.step == 6]
    assert [e["boundary"] for e in logged] == [b.name for b in Boundary]
    assert logged[0]["classes"]["process"]["protected_step"] == 6
    assert logged[0]["classes"]["cluster"]["protected_step"] == 5  # at B1, B4 is step 5's still
    assert logged[-1]["classes"]["cluster"]["protected_step"] == 6
    assert set(logged[-1]["classes"]["host"]) >= {"failure", "boundary", "seconds", "steps", "protected_step"}


def test_a_failed_save_protects_only_against_what_it_reached(config: shoal.Config) -> None:
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, {"w": torch.randn(100)}).wait(timeout=60)
        failpoints.configure("pipeline.before_drain=raise")
        try:
            handle = ckpt.save(2, {"w": torch.randn(100)})
            ckpt.wait(60)
        finally:
            failpoints.configure(None)
        assert handle.error is not None
        exposure = ckpt.exposure()
    assert exposure["process"].protected_step == 2
    assert exposure["cluster"].protected_step == 1 and exposure["cluster"].steps == 1


def test_a_skipped_save_is_not_a_checkpoint(tmp_path: Path, dram_root: Path, hold_failpoint) -> None:
    config = make_config(tmp_path, dram_root, dram_slots=1, on_busy="skip")
    drain = hold_failpoint("pipeline.before_drain")
    with shoal.Checkpointer(config) as ckpt:
        first = ckpt.save(1, {"w": torch.ones(10)})
        second = ckpt.save(2, {"w": torch.ones(10)})  # the one slot is step 1's until its drain is let go
        drain.release()
        first.wait(timeout=60)
        exposure = ckpt.exposure()
        path = ckpt.config.event_log
    assert second.skipped
    assert exposure["cluster"].protected_step == 1 and exposure["cluster"].steps == 0
    assert path is not None
    assert [c.step for c in read_run_log(path).checkpoints] == [1]


def test_only_the_coordinator_logs_exposure_and_its_log_reads_back(tmp_path: Path) -> None:
    results = run_ranks(  # a generous limit; the suite's timeout is the hang guard
        scenarios.frozen_second_checkpoint, hosts=["h0", "h1"], kwargs={"root": str(tmp_path)}, timeout=300
    )
    assert [h["error"] for r in results for h in r["handles"]] == [None] * 4
    logs = {p.parts[-4]: str(p) for p in (tmp_path / "local").rglob("events.jsonl")}
    assert sorted(logs) == ["h0", "h1"]
    exposures = [e for host in logs.values() for e in read_events(host, kinds=["exposure"])]
    assert exposures and {e.rank for e in exposures} == {0}
    assert [e["boundary"] for e in exposures if e.step == 2] == [b.name for b in Boundary]
    log = read_run_log(logs["h0"])
    assert [(c.step, c.durability_path) for c in log.checkpoints] == [(1, "partner"), (2, "partner")]
    assert log.timeline()["cluster"].at_end.protected_step == 2
    partner = measure_paths(log)["partner"]
    assert partner.lags["host"].lag_s <= partner.lags["cluster"].lag_s
    with pytest.raises(ShoalError, match="no events of rank 0"):
        read_run_log(logs["h1"])
