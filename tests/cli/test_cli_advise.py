"""``shoal advise``: the interval advisor on a run's own measurements, table and --json, bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import shoal
from shoal.cli.main import main
from shoal.model.advisor import CheckpointTiming, FailureModel, advise_intervals
from shoal.records.events import read_events
from shoal.records.exposure_log import advise_from_events
from shoal.testing.checkpoints import make_config

from .exposure_logs import line, record, synthetic_log

FAILURES = ["--node-mtbf", "8760", "--nodes", "512", "--restart", "600"]
"""One failure per node-year, 512 nodes, ten minutes to restart."""


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_advise_json_is_the_advisor_on_the_same_inputs(tmp_path, capsys) -> None:
    code, out, err = run(capsys, "advise", str(synthetic_log(tmp_path)), *FAILURES,
                         "--accelerators-per-node", "8", "--json")  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    failures = FailureModel(8760 * 3600.0, 512, 600.0)
    assert doc["failures"]["job_mtbf_s"] == failures.job_mtbf_s and doc["save_gap_s"] == 100.0
    partner = doc["paths"]["partner"]
    assert partner["checkpoints"] == 2 and partner["stall_s"] == 1.5
    # partner: stalls 1 and 2 s; to B1 1.5 and 2.5 s, to B2 5 and 6 s, to B4 21 s (step 20 failed)
    expected = advise_intervals(
        {"process": CheckpointTiming(1.5, 2.0, 0.5), "host": CheckpointTiming(1.5, 5.5, 0.5),
         "cluster": CheckpointTiming(1.5, 21.0)},
        failures, current_interval_s=98.5, step_time_s=98.5 / 15, accelerators_per_node=8,
    )  # fmt: skip
    for name, advice in expected.items():
        got = {k: v for k, v in partner["classes"][name].items() if k in dataclasses.asdict(advice)}
        assert got == pytest.approx(dataclasses.asdict(advice)), name
    assert partner["classes"]["cluster"]["boundary"] == "RESTARTABLE"
    assert partner["classes"]["cluster"]["lag_checkpoints"] == 1
    direct = doc["paths"]["direct"]["classes"]["cluster"]
    assert direct["stall_s"] == 0.5 and direct["lag_s"] == 2.0 and direct["current_interval_s"] == 99.5


def test_advise_table_shows_each_path_and_class(tmp_path, capsys) -> None:
    code, out, err = run(capsys, "advise", str(synthetic_log(tmp_path)), *FAILURES)
    assert code == 0, err
    assert "path partner: 2 checkpoint(s)" in out and "path direct: 1 checkpoint(s)" in out
    assert "save gap 100.0 s (measured)" in out
    rows = [row.split()[1] for row in out.splitlines() if row.startswith("│")]
    assert rows == ["process", "host", "cluster"] * 2


def test_an_interval_given_replaces_the_measured_gap(tmp_path, capsys) -> None:
    events = read_events(str(synthetic_log(tmp_path)))
    code, out, err = run(capsys, "advise", str(synthetic_log(tmp_path)), *FAILURES,
                         "--interval", "1800", "--json")  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert doc["save_gap_s"] == 1800.0 and doc["save_gap_given"] is True
    advice = advise_from_events(events, FailureModel(8760 * 3600.0, 512, 600.0), interval_s=1800.0)
    host = advice.paths["partner"].advice["host"]
    assert doc["paths"]["partner"]["classes"]["host"]["waste_at_current"] == host.waste_at_current
    assert host.current_interval_s == 1800.0 - 1.5


def test_advise_on_a_real_run(tmp_path, dram_root, capsys) -> None:
    config = make_config(tmp_path, dram_root)
    with shoal.Checkpointer(config) as ckpt:
        for step in (10, 20):
            ckpt.save(step, {"w": torch.randn(1000)}).wait(timeout=60)
        log = ckpt.config.event_log
    assert log is not None
    code, out, err = run(capsys, "advise", log, *FAILURES, "--json")
    assert code == 0, err
    direct = json.loads(out)["paths"]["direct"]
    assert direct["checkpoints"] == 2 and direct["stall_s"] > 0
    cluster = direct["classes"]["cluster"]
    assert cluster["lag_s"] >= cluster["stall_s"] and cluster["optimal_interval_s"] > 0
    assert direct["step_time_s"] == pytest.approx(direct["current_interval_s"] / 10)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--node-mtbf", "-5", "--nodes", "4", "--restart", "60"], "argument --node-mtbf: must be > 0 hours"),
        (["--node-mtbf", "10", "--nodes", "0", "--restart", "60"], "argument --nodes: must be at least 1"),
        (
            ["--node-mtbf", "10", "--nodes", "4", "--restart", "-1"],
            "argument --restart: must be >= 0 seconds",
        ),
        (["--node-mtbf", "x", "--nodes", "4", "--restart", "1"], "not a number of hours: 'x'"),
        (["--nodes", "4", "--restart", "1"], "the following arguments are required: --node-mtbf"),
        ([*FAILURES, "--interval", "0"], "argument --interval: must be > 0 seconds"),
        ([*FAILURES, "--interval", "1"], "is not longer than the partner path's stall"),
    ],
)
def test_bad_numbers_name_the_option(tmp_path, capsys, argv, message) -> None:
    code, out, err = run(capsys, "advise", str(synthetic_log(tmp_path)), *argv)
    assert code == 2 and out == ""
    assert message in err


def test_a_missing_or_useless_log_is_a_clear_error(tmp_path, capsys) -> None:
    code, out, err = run(capsys, "advise", "--events", str(tmp_path / "gone.jsonl"), *FAILURES)
    assert code == 2 and f"no event log at {tmp_path / 'gone.jsonl'}" in err
    failed = tmp_path / "failed.jsonl"  # one save that failed before its path was chosen
    failed.write_text(
        "\n".join([line("save_called", 1, 5.0, called=5.0), line("staged", 1, 6.0),
                   record(1, 7.0, {"STAGED": 1.5}, None, failed_at="REPLICATED", error="boom")]) + "\n"
    )  # fmt: skip
    code, out, err = run(capsys, "advise", str(failed), *FAILURES)
    assert code == 2 and f"{failed}: none of the 1 saves got as far as a durability path" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text(line("opened", None, 1.0, start=1.0) + "\n")
    code, out, err = run(capsys, "advise", str(empty), *FAILURES)
    assert code == 2 and "called no save in it (no save_called event): no checkpoints" in err
