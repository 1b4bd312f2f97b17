"""``ls``, ``verify``, ``gc`` and ``export`` on a path that holds no job: exit 2, one line, what was
expected there (``<shared>/<job>`` with shoal's records) and which jobs the shared root does hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shoal
from shoal.cli.common import EXIT_ERROR, parent_url
from shoal.cli.main import main
from shoal.testing.checkpoints import make_config

COMMANDS = ["ls", "verify", "gc", "export"]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shared root with job ``run-a`` (one committed step), job ``run-b`` (its Checkpointer ran,
    no save: only its RUN record) and ``notes``, a directory that is not a job."""
    base = tmp_path_factory.mktemp("no-job")
    dram = base / "dram"
    with shoal.Checkpointer(make_config(base, dram, job="run-a")) as ckpt:
        ckpt.save(1, {"model": {"w": torch.arange(4.0)}}).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    with shoal.Checkpointer(make_config(base, dram, job="run-b")):
        pass
    root = base / "shared"
    (root / "notes").mkdir()
    (root / "notes" / "todo.txt").write_text("not a job")
    return root


def run(capsys: pytest.CaptureFixture[str], command: str, *where: str, out: Path) -> tuple[int, str, str]:
    argv = [command, *where]
    if command == "export":
        argv += ["--format", "dcp", str(out)]
    elif command == "gc":
        argv += ["--dry-run"]
    code = main(argv)
    stdout, stderr = capsys.readouterr()
    return code, stdout, stderr


def one_line_error(command: str, code: int, out: str, err: str) -> str:
    assert code == EXIT_ERROR, (out, err)
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"shoal {command}: error: "), err
    return err.strip()


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", COMMANDS)
def test_shared_without_job_names_the_default_job_and_the_jobs_found(shared, tmp_path, capsys, command):
    before = files(shared)
    code, out, err = run(capsys, command, "--shared", str(shared), out=tmp_path / "o")
    line = one_line_error(command, code, out, err)
    assert f"no job 'default' under {shared}: {shared}/default does not exist" in line
    assert f"jobs found under {shared}: run-a, run-b (choose one with --job NAME)" in line
    assert files(shared) == before and not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_directory_that_is_not_a_job_says_what_a_job_holds(shared, tmp_path, capsys, command):
    before = files(shared)
    code, out, err = run(capsys, command, str(shared / "notes"), out=tmp_path / "o")
    line = one_line_error(command, code, out, err)
    assert line.startswith(f"shoal {command}: error: no job at {shared}/notes (a job directory holds a RUN")
    assert "RUN, WRITER or LATEST record, or steps/ and packs/, which shoal writes at <shared>/<job>" in line
    assert line.endswith(f"; jobs found under {shared}: run-a, run-b")
    assert files(shared) == before and not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_the_shared_root_given_as_the_job_lists_its_jobs_and_how_to_address_one(
    shared, tmp_path, capsys, command
):
    code, out, err = run(capsys, command, str(shared), out=tmp_path / "o")
    line = one_line_error(command, code, out, err)
    assert f"no job at {shared} (" in line
    assert (
        f"it looks like a shared root: jobs found in it: run-a, run-b "
        f"(shoal {command} {shared}/run-a, or --shared {shared} --job run-a)"
    ) in line


@pytest.mark.parametrize("command", COMMANDS)
def test_a_path_that_does_not_exist_is_one_line_naming_it(shared, tmp_path, capsys, command):
    nowhere = tmp_path / "no" / "such" / "place"
    code, out, err = run(capsys, command, str(nowhere), out=tmp_path / "o")
    line = one_line_error(command, code, out, err)
    assert f"no job at {nowhere}: no such file or directory" in line
    assert f"{nowhere.parent} does not exist either" in line
    assert not nowhere.exists() and not (tmp_path / "o").exists()


def test_a_misspelt_job_lists_the_jobs_there(shared, tmp_path, capsys):
    code, out, err = run(capsys, "ls", "--shared", str(shared), "--job", "run-c", out=tmp_path)
    line = one_line_error("ls", code, out, err)
    assert line == (
        f"shoal ls: error: no job 'run-c' under {shared}: {shared}/run-c does not exist; "
        f"jobs found under {shared}: run-a, run-b (choose one with --job NAME)"
    )
    code, out, err = run(capsys, "verify", str(shared / "run-c"), out=tmp_path)
    line = one_line_error("verify", code, out, err)
    assert line == (
        f"shoal verify: error: no job at {shared}/run-c: no such file or directory; "
        f"jobs found under {shared}: run-a, run-b"
    )


def test_a_directory_given_as_the_job_with_shared_says_what_was_expected(shared, tmp_path, capsys):
    code, out, err = run(capsys, "ls", "--shared", str(shared), "--job", "notes", out=tmp_path)
    line = one_line_error("ls", code, out, err)
    assert line.startswith(f"shoal ls: error: no job 'notes' under {shared} (expected {shared}/notes: ")
    assert "a RUN, WRITER or LATEST record" in line and "jobs found under" in line


def test_a_job_given_as_the_shared_root_points_at_itself(shared, tmp_path, capsys):
    job = shared / "run-a"
    code, out, err = run(capsys, "ls", "--shared", str(job), out=tmp_path)
    line = one_line_error("ls", code, out, err)
    assert f"no job 'default' under {job}: {job}/default does not exist" in line
    assert line.endswith(f"; {job} itself is a job directory (shoal ls {job})")


def test_a_file_given_as_the_job_says_so(shared, tmp_path, capsys):
    record = shared / "run-a" / "RUN"
    code, out, err = run(capsys, "verify", str(record), out=tmp_path)
    line = one_line_error("verify", code, out, err)
    assert line == (
        f"shoal verify: error: no job at {record}: it is a file, not a job directory; "
        f"{shared}/run-a itself is a job directory (shoal verify {shared}/run-a)"
    )


def test_a_job_with_no_checkpoint_yet_is_a_job(shared, tmp_path, capsys):
    job = shared / "run-b"
    assert sorted(p.name for p in job.iterdir()) == ["RUN"]  # what its Checkpointer wrote
    code, out, err = run(capsys, "ls", str(job), out=tmp_path)
    assert code == 0 and out == "" and err == f"no checkpoints under {job}\n"
    code, out, err = run(capsys, "gc", str(job), out=tmp_path)
    assert code == 0 and "would free 0 B in 0 pack(s) and 0 step(s)" in out, err
    code, out, err = run(capsys, "verify", str(job), out=tmp_path)
    assert one_line_error("verify", code, out, err) == f"shoal verify: error: no checkpoints under {job}"


@pytest.mark.parametrize("command", COMMANDS)
def test_a_real_job_still_runs(shared, tmp_path, capsys, command):
    code, out, err = run(capsys, command, "--shared", str(shared), "--job", "run-a", out=tmp_path / "o")
    assert code == 0, err
    if command == "export":
        assert (tmp_path / "o" / ".metadata").is_file()


def test_over_s3_the_jobs_under_the_root_are_listed(s3_url, s3_options, dram_root, tmp_path, capsys):
    config = make_config(tmp_path, dram_root, shared=s3_url, storage_options=s3_options, job="run-a")
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, {"model": {"w": torch.arange(3.0)}}).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    options = json.dumps(s3_options)
    code, out, err = run(capsys, "ls", "--shared", s3_url, "--storage-options", options, out=tmp_path)
    line = one_line_error("ls", code, out, err)
    assert line == (
        f"shoal ls: error: no job 'default' under {s3_url}: {s3_url}/default does not exist; "
        f"jobs found under {s3_url}: run-a (choose one with --job NAME)"
    )
    code, out, err = run(capsys, "verify", s3_url, "--storage-options", options, out=tmp_path)
    line = one_line_error("verify", code, out, err)
    assert f"it looks like a shared root: jobs found in it: run-a (shoal verify {s3_url}/run-a" in line
    code, out, err = run(
        capsys, "ls", f"{s3_url}/run-a", "--storage-options", options, "--json", out=tmp_path
    )
    assert code == 0 and [c["step"] for c in json.loads(out)["checkpoints"]] == [1], err


@pytest.mark.parametrize(
    ("url", "parent"),
    [
        ("/x/shared/job", "/x/shared"),
        ("/job", "/"),
        ("/", None),
        ("job42", "."),
        ("runs/job42/", "runs"),
        ("s3://bucket/runs/job42", "s3://bucket/runs"),
        ("s3://bucket/job42", "s3://bucket"),
        ("s3://bucket", None),
        ("file:///x/job", "file:///x"),
    ],
)
def test_the_shared_root_above_a_job_url(url, parent):
    assert parent_url(url) == parent
