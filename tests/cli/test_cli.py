"""The ``shoal`` command line on real checkpoints: ls, verify, gc, addressing and errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import shoal
from shoal.cli.main import main
from shoal.format import layout
from shoal.testing.checkpoints import assert_state_equal, make_config, rich_state, zeros_like_state


@pytest.fixture
def config(tmp_path: Path, dram_root: Path) -> shoal.Config:
    return make_config(tmp_path, dram_root)


@pytest.fixture
def job(config: shoal.Config) -> dict[str, Any]:
    """Three committed checkpoints: step 1, step 2 identical to it (all deduplicated), step 3 changed."""
    state = rich_state()
    with shoal.Checkpointer(config) as ckpt:
        for step in (1, 2, 3):
            if step == 3:
                state["model"]["f32"][0, 0] += 1.0
            ckpt.save(step, state).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    return {"url": config.shared_url(), "config": config, "state": state}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def manifest_doc(url: str, step: int) -> dict[str, Any]:
    return json.loads(Path(url, layout.manifest_path(step)).read_bytes())


def files_under(root: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


# -- ls --------------------------------------------------------------------------------------------


def test_ls_shows_each_step_with_its_boundary_and_marks_latest(job, capsys):
    code, out, err = run(capsys, "ls", job["url"])
    assert code == 0, err
    rows = {int(line.split()[1]): line for line in out.splitlines() if line.startswith("│")}
    assert sorted(rows) == [1, 2, 3]
    assert all("B4 RESTARTABLE" in row for row in rows.values())
    assert "LATEST" in rows[3] and "LATEST" not in rows[1] + rows[2]
    assert "all reused" in rows[2] and "inf" not in rows[2]  # step 2 wrote nothing new


def test_ls_json_reports_sizes_and_dedup(job, capsys):
    code, out, _ = run(capsys, "ls", job["url"], "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["latest"] == 3
    first, second, third = doc["checkpoints"]
    assert [c["step"] for c in doc["checkpoints"]] == [1, 2, 3]
    assert [c["latest"] for c in doc["checkpoints"]] == [False, False, True]
    assert all(c["boundary"] == "RESTARTABLE" and c["boundary_level"] == 4 for c in doc["checkpoints"])
    m1 = manifest_doc(job["url"], 1)
    assert first["items"] == len(m1["items"])
    assert first["logical_bytes"] == m1["stats"]["logical_bytes"] == second["logical_bytes"] > 0
    assert first["written_bytes"] == first["unique_bytes"] and first["dedup_ratio"] == 1.0
    assert second["written_bytes"] == 0 and second["dedup_ratio"] is None
    assert 0 < third["written_bytes"] <= job["config"].chunk_size  # one changed element: one chunk
    assert third["dedup_ratio"] > 1


def test_ls_shows_an_uncommitted_step_as_persisted_and_an_unreadable_manifest_as_a_problem(job, capsys):
    root = Path(job["url"])
    (root / layout.commit_path(2)).unlink()
    (root / layout.manifest_path(1)).write_bytes(b'{"format": "shoal/1.0", "job":')
    code, out, _ = run(capsys, "ls", job["url"], "--json")
    assert code == 0
    by_step = {c["step"]: c for c in json.loads(out)["checkpoints"]}
    assert by_step[2]["boundary"] == "PERSISTED" and by_step[2]["problem"] is None
    assert "but its commit record says" in by_step[1]["problem"] and by_step[1]["items"] is None
    code, out, _ = run(capsys, "ls", job["url"])
    assert "B3 PERSISTED" in out and "BLAKE3 digest is" in out


def test_shared_and_job_address_the_same_checkpoints_as_the_url(job, capsys):
    cfg = job["config"]
    _, by_url, _ = run(capsys, "ls", job["url"], "--json")
    code, by_config, err = run(capsys, "ls", "--shared", cfg.shared, "--job", cfg.job, "--json")
    assert code == 0, err
    assert json.loads(by_url)["checkpoints"] == json.loads(by_config)["checkpoints"]


def test_ls_runs_as_python_dash_m_shoal_cli(job):
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "ls", job["url"], "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert [c["step"] for c in json.loads(proc.stdout)["checkpoints"]] == [1, 2, 3]


# -- verify ----------------------------------------------------------------------------------------


def test_verify_passes_on_intact_checkpoints(job, capsys):
    code, out, err = run(capsys, "verify", job["url"])
    assert code == 0, out + err
    assert out.startswith("OK: steps 1, 2, 3")
    assert run(capsys, "verify", job["url"], "--step", "2")[0] == 0


def test_verify_hashes_each_stored_chunk_once_however_many_items_use_it(job, capsys):
    code, out, _ = run(capsys, "verify", job["url"], "--json")
    assert code == 0
    report = json.loads(out)
    locations = set()
    packs: dict[str, int] = {}
    for step in (1, 2, 3):
        m = manifest_doc(job["url"], step)
        locations |= {tuple(loc) for loc in m["locations"].values()}
        packs |= {pid: rec["size"] for pid, rec in m["packs"].items()}
    assert report["ok"] and report["problems"] == []
    assert report["chunks"] == len(locations)
    assert report["packs"] == len(packs)
    assert report["bytes_read"] == sum(packs.values())  # every pack byte read once, chunks and whole file


def test_verify_reports_a_flipped_byte_with_item_chunk_pack_and_offset_for_every_step(job, capsys):
    m = manifest_doc(job["url"], 1)
    digest = m["items"]["model.f64"]["chunks"][0]
    pack, offset, _ = m["locations"][digest]
    pack_file = Path(job["url"], layout.pack_path(pack))
    data = bytearray(pack_file.read_bytes())
    data[offset + 7] ^= 0x01
    pack_file.write_bytes(bytes(data))

    code, out, _ = run(capsys, "verify", job["url"])
    assert code == 1
    bad = [line for line in out.splitlines() if "'model.f64' chunk 0" in line]
    assert len(bad) == 3, out  # steps 1, 2 and 3 all use that chunk; it was hashed once, reported thrice
    for step, line in zip((1, 2, 3), bad, strict=True):
        assert line.startswith(f"PROBLEM: step {step} item 'model.f64' chunk 0")
        assert f"pack {pack_file}" in line and f"offset {offset} " in line
    assert f"pack {pack_file}: whole-file BLAKE3" in out
    assert out.splitlines()[-1].startswith("FAILED: 4 problem(s)")

    code, out, _ = run(capsys, "verify", job["url"], "--step", "3", "--json")
    assert code == 1
    report = json.loads(out)
    chunk_problems = [p for p in report["problems"] if p["item"] is not None]
    assert chunk_problems == [
        {
            "step": 3,
            "item": "model.f64",
            "chunks": [0],
            "pack": str(pack_file),
            "offsets": [offset],
            "message": chunk_problems[0]["message"],
        }
    ]


def test_verify_reports_a_missing_pack_and_every_item_it_held(job, capsys):
    m = manifest_doc(job["url"], 1)
    (pack,) = m["packs"]
    pack_file = Path(job["url"], layout.pack_path(pack))
    pack_file.unlink()
    code, out, _ = run(capsys, "verify", job["url"], "--step", "1")
    assert code == 1
    assert f"PROBLEM: pack {pack_file} is missing" in out
    items_with_bytes = {k for k, rec in m["items"].items() if rec["chunks"]}
    for key in items_with_bytes:
        assert f"step 1 item {key!r} chunk(s) 0 (pack offset" in out, key


def test_verify_unknown_step_is_a_clear_error_without_traceback(job, capsys):
    code, out, err = run(capsys, "verify", job["url"], "--step", "99")
    assert code == 2 and out == ""
    assert "no checkpoint for step 99" in err and "steps present: 1, 2, 3" in err
    assert "Traceback" not in err
    code, _, err = run(capsys, "verify", job["url"], "--step", "99", "--debug")
    assert code == 2 and "Traceback" in err and "CheckpointNotFound" in err


# -- gc --------------------------------------------------------------------------------------------


def test_gc_dry_run_deletes_nothing(job, capsys):
    before = files_under(job["url"])
    code, out, _ = run(capsys, "gc", job["url"], "--keep-last", "1", "--dry-run")
    assert code == 0
    assert "would delete step 1 (B4 RESTARTABLE)" in out and "would delete step 2" in out
    assert "dry run: would free" in out
    assert files_under(job["url"]) == before


def test_gc_keep_last_keeps_only_the_newest_and_it_still_loads(job, capsys):
    stray = Path(job["url"], layout.pack_path("000000000002-h0-r0-deadbeef"))
    stray.write_bytes(b"x" * 1000)  # a pack no manifest references (an aborted save)
    code, out, _ = run(capsys, "gc", job["url"], "--keep-last", "1")
    assert code == 0
    assert "deleted step 1" in out and "deleted step 2" in out and f"deleted pack {stray}" in out
    assert "freed 1000 B in 1 pack(s) and 2 step(s); kept steps 3 (LATEST 3)" in out
    assert not stray.exists()
    code, out, _ = run(capsys, "ls", job["url"], "--json")
    assert [c["step"] for c in json.loads(out)["checkpoints"]] == [3]
    assert run(capsys, "verify", job["url"])[0] == 0
    target = zeros_like_state(job["state"])
    with shoal.Checkpointer(job["config"]) as ckpt:
        assert ckpt.load(target) == 3
    assert_state_equal(target, job["state"])


# -- command line --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ls"], "give the job directory"),
        (["ls", "/x/job", "--shared", "/x"], "not both"),
        (["ls", "/x/job", "--job", "j"], "--job goes with --shared"),
        (["ls", "--shared", "/x", "--storage-options", "[1]"], "must be a JSON object"),
        (["gc", "/x/job", "--keep-last", "0"], "must be at least 1"),
    ],
)
def test_bad_command_lines_exit_2_with_a_message(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_an_empty_directory_is_no_job(tmp_path, capsys):
    # tests/cli/test_cli_no_job.py has the rest: what is expected there, the jobs found next to it
    for command in ("ls", "verify", "gc"):
        code, out, err = run(capsys, command, str(tmp_path))
        assert code == 2 and out == "" and err.startswith(f"shoal {command}: error: no job at {tmp_path} (")


def test_ls_of_a_job_without_checkpoints_says_so(config, capsys):
    with shoal.Checkpointer(config):  # writes the job's RUN record, saves nothing
        pass
    code, out, err = run(capsys, "ls", config.shared_url())
    assert code == 0 and out == "" and err == f"no checkpoints under {config.shared_url()}\n"
    assert run(capsys, "verify", config.shared_url())[0] == 2


def test_demo_gets_the_rest_of_the_command_line(monkeypatch, capsys):
    import shoal.demo

    seen: list[list[str]] = []
    monkeypatch.setattr(shoal.demo, "main", lambda argv: seen.append(argv))
    assert main(["demo", "--steps", "3", "--help"]) == 0
    assert seen == [["--steps", "3", "--help"]]


def test_help_and_version(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and all(cmd in out for cmd in ("ls", "verify", "gc", "export", "demo"))
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"shoal {shoal.__version__}"


# -- progress -------------------------------------------------------------------------------------


def _stderr_on_a_terminal(*argv: str) -> tuple[int, bytes]:
    """Run ``python -m shoal.cli ARGV`` with stderr on a pseudo-terminal: its exit code and what it drew."""
    import os
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        env={**os.environ, "COLUMNS": "120", "TERM": "xterm"},
    )
    os.close(slave)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    return proc.wait(timeout=120), drawn


@pytest.mark.timeout(180)
def test_gc_verify_and_export_draw_progress_on_a_terminal_and_stay_quiet_otherwise(job, tmp_path):
    stray = Path(job["url"], layout.pack_path("000000000002-h0-r0-deadbeef"))
    stray.write_bytes(b"x" * 1000)
    for argv, label in (
        (["verify", job["url"]], b"verifying"),
        (["export", job["url"], "--format", "dcp", str(tmp_path / "dcp")], b"exporting step 3"),
        (["gc", job["url"], "--keep-last", "1"], b"deleting"),
    ):
        code, drawn = _stderr_on_a_terminal(*argv)
        assert code == 0, drawn
        assert label in drawn, (argv, drawn)
    assert not stray.exists()
    # Not a terminal (a pipe, as in CI or a log file): no bar, no control codes.
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "verify", job["url"]], capture_output=True, timeout=120
    )
    assert proc.returncode == 0 and b"verifying" not in proc.stderr and b"\x1b[" not in proc.stderr
