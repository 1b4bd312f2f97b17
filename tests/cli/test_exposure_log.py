"""A run read back from its event log (shoal.records.exposure_log): saves, stalls, lags, advice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shoal.errors import MissingFile, ShoalError
from shoal.model.advisor import CheckpointTiming, FailureModel, advise_intervals
from shoal.model.exposure import exposure_timeline
from shoal.records.events import read_events
from shoal.records.exposure_log import advise_from_events, measure_paths, read_run_log, run_log

from .exposure_logs import SYNTHETIC_RUN, line, synthetic_log


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
    other.write_text(line("save_called", 1, 5.0, rank=3) + "\n")
    with pytest.raises(ShoalError, match=r"other.jsonl: no events of rank 0 .*ranks here: \[3\]"):
        read_run_log(str(other))
    idle = tmp_path / "idle.jsonl"
    idle.write_text(line("opened", None, 5.0, start=5.0) + "\n")
    with pytest.raises(ShoalError, match="idle.jsonl: rank 0 called no save"):
        read_run_log(str(idle))
    with pytest.raises(MissingFile, match="no event log at .*missing.jsonl"):
        read_run_log(str(tmp_path / "missing.jsonl"))


def test_a_clock_that_went_backwards_keeps_the_last_run_of_it(tmp_path: Path) -> None:
    lines = [
        line("save_called", 1, 500.0, called=500.0),
        line("save_called", 2, 10.0, called=10.0),  # the host rebooted
        line("staged", 2, 11.0),
        line("loaded", 2, 20.0),
    ]
    log = run_log(_events(tmp_path, lines), source="rebooted")
    assert [c.step for c in log.checkpoints] == [2]
    assert any("went backwards" in n for n in log.notes)
    assert log.start == 10.0  # no opened event: its first event, and a note says so


def _events(directory: Path, lines: list[str]) -> list[Any]:
    path = directory / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return list(read_events(str(path)))


def test_lines_a_little_out_of_clock_order_are_one_run(tmp_path: Path) -> None:
    lines = [
        line("opened", None, 1.0, start=1.0),
        line("save_called", 1, 2.0, called=2.0),
        line("staged", 1, 2.1),
        line("save_called", 2, 3.0, called=3.0),
        line(
            "checkpoint",
            1,
            3.002,
            durability_path="direct",
            boundaries={"RESTARTABLE": 1.0},
            reached="RESTARTABLE",
            failed_at=None,
            error=None,
            bytes=1,
            end=3.002,
        ),  # fmt: skip
        line("staged", 2, 3.001),  # written after the pipeline's line, stamped before it
    ]
    log = run_log(_events(tmp_path, lines))
    assert [c.step for c in log.checkpoints] == [1, 2] and not log.notes
    assert log.checkpoints[1].stall_s == pytest.approx(0.001)
