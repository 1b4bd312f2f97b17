"""Exposure in the engine: SaveHandle's boundary listeners, the runtime's tracker, the exposure
events, and a run read back from its event log (shoal.engine.exposure_log)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import shoal
from shoal import failpoints
from shoal.boundary import Boundary
from shoal.engine.events import monotonic, read_events
from shoal.engine.exposure_log import advise_from_events, measure_paths, read_run_log, run_log
from shoal.engine.handle import SaveHandle
from shoal.errors import MissingFile, ShoalError
from shoal.model.advisor import CheckpointTiming, FailureModel, advise_intervals
from shoal.model.exposure import CheckpointTimes, exposure_timeline
from shoal.testing.checkpoints import make_config

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


def test_a_skipped_save_is_not_a_checkpoint(tmp_path: Path, dram_root: Path) -> None:
    config = make_config(tmp_path, dram_root, dram_slots=1, on_busy="skip")
    failpoints.configure("pipeline.before_drain=delay:0.3")
    try:
        with shoal.Checkpointer(config) as ckpt:
            first = ckpt.save(1, {"w": torch.ones(10)})
            second = ckpt.save(2, {"w": torch.ones(10)})
            first.wait(timeout=60)
            exposure = ckpt.exposure()
            path = ckpt.config.event_log
    finally:
        failpoints.configure(None)
    assert second.skipped
    assert exposure["cluster"].protected_step == 1 and exposure["cluster"].steps == 0
    assert path is not None
    assert [c.step for c in read_run_log(path).checkpoints] == [1]


# -- a run read back from its event log -----------------------------------------------------------------


def _line(event: str, step: int | None, mono: float, rank: int = 0, **fields: Any) -> str:
    record = {
        "v": 1,
        "t": 1.0e9 + mono,
        "mono": mono,
        "event": event,
        "step": step,
        "host": "h0",
        "rank": rank,
    }
    return json.dumps({**record, **fields})


def _record(step: int, mono: float, boundaries: dict[str, float], path: str | None, **fields: Any) -> str:
    reached = max(boundaries, key=lambda b: Boundary[b], default=None)
    defaults = {"failed_at": None, "error": None, "bytes": 100, "end": mono}
    return _line("checkpoint", step, mono, durability_path=path, boundaries=boundaries, reached=reached,
                 **{**defaults, **fields})  # fmt: skip


def synthetic_log(directory: Path) -> Path:
    """A run from 100 to 400 s: step 10 (partner, committed), step 20 (partner, failed before B3),
    step 30 (skipped), step 40 (direct, committed); a line of rank 1 in between."""
    lines = [
        _line("opened", None, 100.0, start=100.0),
        _line("save_called", 10, 110.5, called=110.0),
        _line("staged", 10, 111.0),
        _line("save_called", 10, 110.6, rank=1, called=110.0),
        _record(
            10, 131.0, {"STAGED": 1.5, "REPLICATED": 5.0, "PERSISTED": 20.0, "RESTARTABLE": 21.0}, "partner"
        ),
        _line("save_called", 20, 210.0, called=210.0),
        _line("staged", 20, 212.0),
        _record(
            20, 216.0, {"STAGED": 2.5, "REPLICATED": 6.0}, "partner", failed_at="PERSISTED", error="boom"
        ),
        _line("save_called", 30, 260.0, called=260.0),
        _line("skipped", 30, 260.1, in_flight=[20]),
        _line("save_called", 40, 310.0, called=310.0),
        _line("staged", 40, 310.5),
        _record(
            40, 312.0, {"STAGED": 1.0, "REPLICATED": 2.0, "PERSISTED": 2.0, "RESTARTABLE": 2.0}, "direct"
        ),
        _line("loaded", 40, 400.0),
    ]
    path = directory / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


SYNTHETIC_RUN = [
    CheckpointTimes(10, 110.0, {1: 111.5, 2: 115.0, 3: 130.0, 4: 131.0}),
    CheckpointTimes(20, 210.0, {1: 212.5, 2: 216.0}),
    CheckpointTimes(40, 310.0, {1: 311.0, 2: 312.0, 3: 312.0, 4: 312.0}),
]


def test_a_run_log_gives_each_save_its_call_stall_and_boundaries(tmp_path: Path) -> None:
    log = read_run_log(str(synthetic_log(tmp_path)))
    assert (log.start, log.end) == (100.0, 400.0)
    assert [c.step for c in log.checkpoints] == [10, 20, 40]  # 30 was skipped
    ten, twenty, forty = log.checkpoints
    assert ten.saved == 110.0 and ten.stall_s == 1.0 and ten.durability_path == "partner"
    assert twenty.failed_at == "PERSISTED" and twenty.lag_s(4) is None and twenty.lag_s(2) == 6.0
    assert forty.lag_s(2) == 2.0 and forty.finished
    assert [c.times() for c in log.checkpoints] == SYNTHETIC_RUN
    assert log.timeline() == exposure_timeline(SYNTHETIC_RUN, 100.0, 400.0)


def test_a_run_log_measures_each_path(tmp_path: Path) -> None:
    log = read_run_log(str(synthetic_log(tmp_path)))
    paths = measure_paths(log)
    assert set(paths) == {"partner", "direct"}
    partner = paths["partner"]
    assert partner.checkpoints == 2 and partner.stall_s == pytest.approx(1.5)  # (1 + 2) / 2
    assert partner.lags["host"].lag_s == pytest.approx(5.5) and partner.lags["host"].checkpoints == 2
    assert partner.lags["cluster"].lag_s == 21.0 and partner.lags["cluster"].checkpoints == 1
    assert paths["direct"].lags["cluster"].lag_s == 2.0


def test_advice_from_events_is_the_advisor_on_the_measured_timings(tmp_path: Path) -> None:
    events = read_events(str(synthetic_log(tmp_path)))
    failures = FailureModel(86400.0 * 365, 512, 600.0)
    advice = advise_from_events(events, failures, accelerators_per_node=8)
    assert advice.save_gap_s == 100.0  # the median of 100 (10 -> 20) and 100 (20 -> 40)
    partner = advice.paths["partner"]
    expected = advise_intervals(
        {
            "process": CheckpointTiming(1.5, 2.0, 0.5),
            "host": CheckpointTiming(1.5, 5.5, 0.5),
            "cluster": CheckpointTiming(1.5, 21.0, 0.0),
        },
        failures,
        current_interval_s=100.0 - 1.5,
        step_time_s=(100.0 - 1.5) / 15.0,  # median steps between saves: (10 + 20) / 2
        accelerators_per_node=8,
    )
    assert dict(partner.advice) == expected


def test_a_log_without_the_coordinator_or_without_saves_says_so(tmp_path: Path) -> None:
    other = tmp_path / "other.jsonl"
    other.write_text(_line("save_called", 1, 5.0, rank=3) + "\n")
    with pytest.raises(ShoalError, match=r"other.jsonl: no events of rank 0 .*ranks here: \[3\]"):
        read_run_log(str(other))
    idle = tmp_path / "idle.jsonl"
    idle.write_text(_line("opened", None, 5.0, start=5.0) + "\n")
    with pytest.raises(ShoalError, match="idle.jsonl: rank 0 called no save"):
        read_run_log(str(idle))
    with pytest.raises(MissingFile, match="no event log at .*missing.jsonl"):
        read_run_log(str(tmp_path / "missing.jsonl"))


def test_a_clock_that_went_backwards_keeps_the_last_run_of_it(tmp_path: Path) -> None:
    lines = [
        _line("save_called", 1, 500.0, called=500.0),
        _line("save_called", 2, 10.0, called=10.0),  # the host rebooted
        _line("staged", 2, 11.0),
        _line("loaded", 2, 20.0),
    ]
    log = run_log(_events(tmp_path, lines), source="rebooted")
    assert [c.step for c in log.checkpoints] == [2]
    assert any("went backwards" in n for n in log.notes)
    assert log.start == 10.0  # no opened event: its first event, and a note says so


def _events(directory: Path, lines: list[str]) -> list[Any]:
    path = directory / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return list(read_events(str(path)))
