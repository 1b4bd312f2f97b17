"""``shoal exposure``: a run's rollback exposure from its event log, on a real run and a synthetic log."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import shoal
from shoal.cli.main import main
from shoal.records.exposure_log import read_run_log
from shoal.testing.checkpoints import make_config

from .exposure_logs import SYNTHETIC_RUN, line, synthetic_log


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def real_run(tmp_path: Path, dram_root: Path) -> dict[str, Any]:
    """Three committed saves of a one-process job; its event log and local root."""
    config = make_config(tmp_path, dram_root)
    with shoal.Checkpointer(config) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.randn(1000)}).wait(timeout=60)
        log = ckpt.config.event_log
    assert log is not None
    return {"log": log, "local": config.local, "job": config.job}


def test_exposure_of_a_real_run_shows_every_class(real_run, capsys) -> None:
    code, out, err = run(capsys, "exposure", real_run["log"])
    assert code == 0, err
    assert "note:" not in err  # one run of the clock, started at its opened event
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
    assert set(rows) == {"process", "host", "cluster"}
    assert "B4 RESTARTABLE" in rows["cluster"] and "step 3" in rows["cluster"]
    assert "3 save(s)" in out


def test_exposure_json_of_a_real_run_is_its_timeline(real_run, capsys) -> None:
    code, out, err = run(capsys, "exposure", "--events", real_run["log"], "--json")
    assert code == 0, err
    doc = json.loads(out)
    expected = read_run_log(real_run["log"]).timeline().to_json()
    assert doc["classes"] == json.loads(json.dumps(expected["classes"]))
    assert doc["classes"]["cluster"]["at_end"]["protected_step"] == 3
    assert doc["checkpoints"] == 3 and doc["failed_or_unfinished"] == 0
    peak = doc["classes"]["cluster"]["peak_seconds"]
    assert 0 < doc["classes"]["cluster"]["mean_seconds"] <= peak <= doc["duration_seconds"]


def test_a_job_name_is_looked_up_under_the_local_root(real_run, capsys) -> None:
    code, out, err = run(capsys, "exposure", real_run["job"], "--local", real_run["local"], "--json")
    assert code == 0, err
    assert json.loads(out)["events"] == real_run["log"]
    code, out, err = run(capsys, "exposure", "--job", real_run["job"], "--local", real_run["local"], "--json")
    assert code == 0, err
    directory = os.path.join(real_run["local"], real_run["job"])  # a job's local directory
    code, out, err = run(capsys, "exposure", directory, "--json")
    assert code == 0 and json.loads(out)["events"] == real_run["log"], err


def test_exposure_of_a_synthetic_log_has_the_hand_computed_numbers(tmp_path, capsys) -> None:
    code, out, err = run(capsys, "exposure", str(synthetic_log(tmp_path)), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["start"], doc["end"], doc["checkpoints"], doc["failed_or_unfinished"]) == (100.0, 400.0, 3, 1)
    cluster = doc["classes"]["cluster"]
    # protected by step 10 from 131 (saved 110), by step 40 from 312 (saved 310)
    assert cluster["points"] == [[100, 0], [131, 31], [131, 21], [312, 202], [312, 2], [400, 90]]
    assert cluster["peak_seconds"] == 202.0
    assert cluster["integral_seconds2"] == 31 * 31 / 2 + 181 * (21 + 202) / 2 + 88 * (2 + 90) / 2
    assert cluster["at_end"] == {"failure": "cluster", "boundary": "RESTARTABLE", "boundary_level": 4,
                                 "seconds": 90.0, "steps": 0, "protected_step": 40}  # fmt: skip
    host = doc["classes"]["host"]
    assert host["checkpoints"] == 3  # step 20 reached B2 before it failed
    assert [p for p in host["points"] if p[0] == 216] == [[216, 106], [216, 6]]  # step 10 protected from 115
    assert len(SYNTHETIC_RUN) == doc["checkpoints"]


def test_exposure_table_of_a_synthetic_log(tmp_path, capsys) -> None:
    code, out, err = run(capsys, "exposure", str(synthetic_log(tmp_path)))
    assert code == 0, err
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
    assert "3.4 min" in rows["cluster"]  # the peak, 202 s
    assert "step 40" in rows["cluster"] and "90.0 s" in rows["cluster"]  # at the end


def test_exposure_plots_the_sawtooth(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "exposure.png"
    code, out, err = run(capsys, "exposure", str(synthetic_log(tmp_path)), "--plot", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot written to {png}" in err


def test_plot_without_matplotlib_says_what_is_missing(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    code, out, err = run(capsys, "exposure", str(synthetic_log(tmp_path)), "--plot", str(tmp_path / "x.png"))
    assert code == 2
    assert "--plot needs matplotlib" in err and "pip install matplotlib" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--events", "{tmp}/nope.jsonl"], "no event log at {tmp}/nope.jsonl"),
        (["nosuchjob", "--local", "{tmp}"], "no local directory for job 'nosuchjob' at {tmp}/nosuchjob"),
        (["{tmp}"], "no event log (events.jsonl) under {tmp}"),
        ([], "which run?"),
        (["{tmp}/a", "--events", "{tmp}/b"], "give one of JOB, --events and --job"),
        (["--shared", "{tmp}", "--job", "j"], "the event log is host-local"),
    ],
)
def test_a_log_that_cannot_be_found_is_a_one_line_error(tmp_path, capsys, argv, message) -> None:
    code, out, err = run(capsys, "exposure", *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and out == ""
    assert message.format(tmp=tmp_path) in err and len(err.strip().splitlines()) == 1


def test_a_log_without_saves_or_of_another_host_names_the_file(tmp_path, capsys) -> None:
    idle = tmp_path / "idle.jsonl"
    idle.write_text(line("opened", None, 5.0, start=5.0) + "\n")
    code, out, err = run(capsys, "exposure", str(idle))
    assert code == 2 and f"{idle}: rank 0 called no save in it" in err
    other = tmp_path / "other.jsonl"
    other.write_text(line("save_called", 1, 5.0, rank=2) + "\n")
    code, out, err = run(capsys, "exposure", str(other))
    assert code == 2 and f"{other}: no events of rank 0" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    code, out, err = run(capsys, "exposure", str(bad))
    assert code == 2 and f"{bad}:1" in err


def test_several_logs_read_the_newest_and_say_so(tmp_path, capsys) -> None:
    job = tmp_path / "job"
    for i, run_id in enumerate(("aaaa", "bbbb")):
        directory = job / "h0" / "runs" / run_id
        directory.mkdir(parents=True)
        path = synthetic_log(directory)
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    code, out, err = run(capsys, "exposure", str(job), "--json")
    assert code == 0, err
    assert "bbbb" in json.loads(out)["events"] and "2 event logs under" in err and "--run RUN" in err
    code, out, err = run(capsys, "exposure", str(job), "--run", "aaaa", "--json")
    assert code == 0 and "aaaa" in json.loads(out)["events"] and "event logs under" not in err
    code, out, err = run(capsys, "exposure", str(job), "--host", "h9")
    assert code == 2 and "of host 'h9'" in err
