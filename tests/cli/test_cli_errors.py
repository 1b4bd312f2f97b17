"""The ``shoal`` command line on damaged checkpoints: the right exit status, one line naming the file.

Exit status: 0 fine (``ls`` lists a damaged step, with its problem); 1 ``verify`` found
problems; 2 could not run (``export`` of a damaged step). Never a traceback.
Each damage is made on a copy of one real checkpoint; where a manifest is edited, its
commit record and ``LATEST`` are re-signed, as a careful forger (or a buggy writer) would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import shoal
import shoal.cli.ls
from shoal.cli.common import local_time
from shoal.cli.main import DEBUG_ENV, main
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.testing.checkpoints import make_config

MANIFEST = layout.manifest_path(1)
COMMIT = layout.commit_path(1)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One real job directory: step 1, then step 2 with the same state (all its bytes reused)."""
    root = tmp_path_factory.mktemp("pristine")
    dram = Path(tempfile.mkdtemp(prefix="shoal-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        config = make_config(root, dram)
        state = {"w": torch.arange(10.0), "b": torch.ones(3, dtype=torch.int64), "epoch": 3}
        with shoal.Checkpointer(config) as ckpt:
            for step in (1, 2):
                ckpt.save(step, state).wait(shoal.Boundary.RESTARTABLE, timeout=60)
        yield Path(config.shared_url())
    finally:
        shutil.rmtree(dram, ignore_errors=True)


@pytest.fixture
def job(pristine: Path, tmp_path: Path) -> Path:
    """A copy of the pristine job directory, this test's to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "job"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- damage, one kind at a time ----------------------------------------------------------------------


def sign(job: Path, step: int, data: bytes) -> None:
    """Write ``data`` as the manifest of ``step`` and make its commit record (and LATEST) agree."""
    Path(job, layout.manifest_path(step)).write_bytes(data)
    record = json.dumps({"step": step, "manifest_blake3": digest(data)})
    Path(job, layout.commit_path(step)).write_text(record)
    if json.loads(Path(job, layout.LATEST).read_bytes())["step"] == step:
        Path(job, layout.LATEST).write_text(record)


def edit_manifest(edit: Callable[[dict[str, Any]], object]) -> Callable[[Path], str]:
    def damage(job: Path) -> str:
        doc = json.loads(Path(job, MANIFEST).read_bytes())
        edit(doc)
        sign(job, 1, json.dumps(doc).encode())
        return MANIFEST

    return damage


def set_created(literal: str) -> Callable[[Path], str]:
    """``created`` as a JSON literal of any size (``1e400`` parses as inf, ``10**30`` as an int)."""

    def damage(job: Path) -> str:
        doc = json.loads(Path(job, MANIFEST).read_bytes())
        doc["created"] = "@CREATED@"
        sign(job, 1, json.dumps(doc).replace('"@CREATED@"', literal).encode())
        return MANIFEST

    return damage


def make_partial(doc: dict[str, Any]) -> None:
    """As a host tier holds it: ``"partial": true``, and no location for item ``w``'s chunk."""
    doc["partial"] = True
    del doc["locations"][doc["items"]["w"]["chunks"][0]]


def huge_pack(size: int, offset: int) -> Callable[[dict[str, Any]], None]:
    """The pack's size is ``size`` and item ``w``'s chunk lies at ``offset`` in it (the two agree)."""

    def edit(doc: dict[str, Any]) -> None:
        (pid,) = doc["packs"]
        doc["packs"][pid]["size"] = size
        doc["locations"][doc["items"]["w"]["chunks"][0]] = [pid, offset, 40]

    return edit


LARGEST_PACK = huge_pack(2**63 - 1, 2**62)
"""A pack as large as any file offset can say, a chunk far into it: the decoder accepts both."""


def largest_pack_in_manifest(job: Path) -> str:
    edit_manifest(LARGEST_PACK)(job)
    (pack,) = (job / layout.PACKS_DIR).glob("*.pack")
    return str(pack.relative_to(job))  # what verify and export name: the file is not that large


def put_directory(rel: str) -> Callable[[Path], str]:
    def damage(job: Path) -> str:
        path = job / rel
        path.unlink()
        path.mkdir()
        (path / "stray").write_text("x")
        return rel

    return damage


def truncate(rel: str, keep: int) -> Callable[[Path], str]:
    def damage(job: Path) -> str:
        path = job / rel
        path.write_bytes(path.read_bytes()[:keep])
        return rel

    return damage


def write(rel: str, text: str) -> Callable[[Path], str]:
    def damage(job: Path) -> str:
        (job / rel).write_text(text)
        return rel

    return damage


def pack_file(suffix: str, change: Callable[[Path], object]) -> Callable[[Path], str]:
    def damage(job: Path) -> str:
        (path,) = (job / layout.PACKS_DIR).glob(f"*{suffix}")
        change(path)
        return str(path.relative_to(job))

    return damage


def set_field(*path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        for key in path[:-1]:
            doc = doc[key]
        doc[path[-1]] = value

    return edit


def drop_dcp_codec(doc: dict[str, Any]) -> None:
    del doc["dcp"]["codec"]


def truncated_manifest(job: Path) -> str:
    sign(job, 1, Path(job, MANIFEST).read_bytes()[:99])
    return MANIFEST


@dataclass(frozen=True)
class Damage:
    """A way to damage the job, and what each command must then do."""

    make: Callable[[Path], str]
    """Damages the job directory; returns the file (relative to it) the messages must name."""
    verify: int = 1
    export: int = 2
    ls_names_it: bool = True
    """``ls`` (exit 0 always: it lists) names the file, in a warning or the step's problem."""
    from_latest: bool = False
    """The damage is to ``LATEST``: export what it names rather than ``--step 1``."""


DAMAGES = {
    "created past time_t (10**30)": Damage(set_created(str(10**30))),
    "created before time_t (-1e300)": Damage(set_created("-1e300")),
    "created not finite (1e400)": Damage(set_created("1e400")),
    "created of the wrong type": Damage(edit_manifest(set_field("created", value="yesterday"))),
    "created missing": Damage(edit_manifest(lambda d: d.pop("created"))),
    "partial manifest": Damage(edit_manifest(make_partial)),
    "stats past any float": Damage(edit_manifest(set_field("stats", "logical_bytes", value=10**400))),
    "pack size past any offset": Damage(edit_manifest(huge_pack(10**30, 10**29))),
    "pack size the largest offset": Damage(largest_pack_in_manifest, ls_names_it=False),
    "item dtype disagrees with DCP": Damage(
        edit_manifest(set_field("items", "w", "dtype", value="int32")), ls_names_it=False
    ),
    "item shape disagrees with DCP": Damage(
        edit_manifest(set_field("items", "w", "shape", value=[2, 5])), ls_names_it=False
    ),
    "item kind disagrees with DCP": Damage(
        edit_manifest(set_field("items", "w", "kind", value="bytes")), ls_names_it=False
    ),
    "DCP metadata malformed": Damage(edit_manifest(drop_dcp_codec), ls_names_it=False),
    "items of the wrong type": Damage(edit_manifest(set_field("items", value=[]))),
    "manifest truncated": Damage(truncated_manifest),
    "manifest a directory": Damage(put_directory(MANIFEST)),
    "COMMIT truncated": Damage(truncate(COMMIT, 7)),
    "COMMIT a directory": Damage(put_directory(COMMIT)),
    "LATEST not JSON": Damage(write(layout.LATEST, "\x00garbage"), from_latest=True),
    "LATEST step out of range": Damage(write(layout.LATEST, json.dumps({"step": 10**30})), from_latest=True),
    "LATEST a directory": Damage(put_directory(layout.LATEST), from_latest=True),
    "pack index truncated": Damage(
        pack_file(".idx", lambda p: p.write_bytes(p.read_bytes()[:20])), export=0, ls_names_it=False
    ),
    "pack truncated": Damage(
        pack_file(".pack", lambda p: p.write_bytes(p.read_bytes()[:50])), ls_names_it=False
    ),
}


@pytest.mark.parametrize("command", ["ls", "verify", "export"])
@pytest.mark.parametrize("name", list(DAMAGES))
def test_a_damaged_checkpoint_gives_the_exit_status_and_names_the_file(job, tmp_path, capsys, name, command):
    damage = DAMAGES[name]
    place = f"{job}/{damage.make(job)}"
    if command == "ls":
        code, out, err = run(capsys, "ls", str(job), "--json")
        assert code == 0, err
        problems = [c["problem"] or "" for c in json.loads(out)["checkpoints"]]
        if damage.ls_names_it:
            assert place in err or any(place in p for p in problems), out + err
    elif command == "verify":
        code, out, err = run(capsys, "verify", str(job))
        assert code == damage.verify, out + err
        if damage.verify == 1:
            assert any(line.startswith("PROBLEM: ") and place in line for line in out.splitlines()), out
            assert out.splitlines()[-1].startswith("FAILED: ")
    else:
        out_dir = tmp_path / "out"
        step = [] if damage.from_latest else ["--step", "1"]
        code, out, err = run(capsys, "export", str(job), "--format", "dcp", *step, str(out_dir))
        assert code == damage.export, out + err
        if damage.export == 2:
            assert err.startswith("shoal export: error: ") and len(err.splitlines()) == 1, err
            assert place in err, err
            assert not out_dir.exists()  # nothing that looks like a result
    assert "Traceback" not in err


def table_cells(out: str) -> dict[int, list[str]]:
    """The cells of each row of ``ls``'s table by step, a cell's wrapped lines joined by a space."""
    rows: dict[int, list[str]] = {}
    for line in out.splitlines():
        if not line.startswith("│"):
            continue
        parts = [part.strip() for part in line.split("│")[1:-1]]
        if parts[0]:
            rows[int(parts[0])] = cells = parts
        else:  # a continuation of the row above
            cells[:] = [f"{a} {b}" if a and b else a or b for a, b in zip(cells, parts, strict=True)]
    return rows


# -- what each crash became --------------------------------------------------------------------------


def test_ls_of_a_created_time_out_of_range_lists_the_step_with_the_problem(job, capsys):
    set_created(str(10**30))(job)  # was: OverflowError, exit 1, a traceback; then listed without it
    code, out, err = run(capsys, "ls", str(job))
    assert code == 0 and err == "", err
    cells = table_cells(out)[1]
    assert cells[1] == "?" and cells[2] == ""  # a manifest that cannot be read proves nothing
    problem = "".join(cells[-1].split())  # however the column wrapped it
    assert problem.startswith("manifest") and "created:" in problem  # the table may cut the path short
    assert problem.endswith("isnotatimebetween1970and2242(secondsin[0,2**33))")
    code, out, err = run(capsys, "ls", str(job), "--json")
    first, second = json.loads(out)["checkpoints"]
    assert code == 0 and err == "", err
    assert first["step"] == 1 and first["created"] is None and first["boundary"] is None
    assert first["problem"].startswith(f"manifest {job}/{MANIFEST}: created: ")
    assert second["boundary"] == "RESTARTABLE" and second["problem"] is None


def test_ls_of_a_time_this_platform_cannot_show_lists_the_step_without_it(job, capsys, monkeypatch):
    set_created(str(2**33 - 1))(job)  # the last second a manifest may hold, in 2242

    def narrow_local_time(ts: float) -> Any:  # as on a platform whose time_t ends in 2106
        return None if ts >= 2**32 else local_time(ts)

    monkeypatch.setattr(shoal.cli.ls, "local_time", narrow_local_time)
    code, out, err = run(capsys, "ls", str(job))
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("│") and line.split()[1] == "1")
    assert " ? " in row and "B4 RESTARTABLE" in row
    assert f"manifest {job}/{MANIFEST}: created is 8.58993e+09, not a time this platform can show" in err
    code, out, _ = run(capsys, "ls", str(job), "--json")
    first = json.loads(out)["checkpoints"][0]
    assert code == 0 and first["created"] == 2**33 - 1 and first["created_iso"] is None
    assert first["boundary"] == "RESTARTABLE" and first["problem"] is None


def test_ls_shows_all_reused_for_a_step_that_wrote_nothing_and_any_size_a_manifest_holds(job, capsys):
    edit_manifest(set_field("stats", "logical_bytes", value=2**63 - 1))(job)  # the most it may hold
    code, out, err = run(capsys, "ls", str(job))
    assert code == 0, err
    rows = {int(line.split()[1]): line for line in out.splitlines() if line.startswith("│")}
    assert "8.0 EiB" in rows[1] and "6.96e+15x" in rows[1]
    assert "all reused" in rows[2] and "inf" not in out  # step 2 wrote 0 bytes: was "inf"
    code, out, _ = run(capsys, "ls", str(job), "--json")
    first, second = json.loads(out)["checkpoints"]
    assert first["logical_bytes"] == 2**63 - 1 and first["problem"] is None  # exact, not a float
    assert first["dedup_ratio"] == (2**63 - 1) / first["written_bytes"]
    assert second["dedup_ratio"] is None  # step 2 wrote nothing: no ratio, not inf


def test_verify_of_a_partial_manifest_reports_what_it_does_not_place_and_checks_the_rest(job, capsys):
    edit_manifest(make_partial)(job)  # was: KeyError, exit 1, a traceback
    code, out, err = run(capsys, "verify", str(job), "--step", "1", "--json")
    assert code == 1, err
    report = json.loads(out)
    (problem,) = report["problems"]
    assert problem["step"] == 1 and problem["item"] == "w" and problem["chunks"] == [0]
    assert f"manifest {job}/{MANIFEST} is partial" in problem["message"]
    assert report["chunks"] == 2  # b and epoch were re-hashed; w has no place to read it from
    code, out, _ = run(capsys, "verify", str(job), "--step", "2")
    assert code == 0, out  # step 2's own manifest is whole


def test_export_of_a_partial_manifest_fails_before_writing(job, tmp_path, capsys):
    edit_manifest(make_partial)(job)
    code, _, err = run(
        capsys, "export", str(job), "--format", "safetensors", "--step", "1", str(tmp_path / "o")
    )
    assert code == 2 and "is partial (a host tier's copy): item 'w' chunk 0 has no location" in err
    assert "export from the shared tier" in err and not (tmp_path / "o").exists()


def test_export_of_a_pack_offset_past_any_file_is_an_error_naming_the_pack(job, tmp_path, capsys):
    edit_manifest(LARGEST_PACK)(job)  # was: ValueError "cannot fit 'int' into an offset-sized integer"
    code, _, err = run(
        capsys, "export", str(job), "--format", "safetensors", "--step", "1", str(tmp_path / "o")
    )
    (pack,) = (job / layout.PACKS_DIR).glob("*.pack")
    assert code == 2 and f"pack {pack} is " in err and f"says {2**63 - 1} " in err and "shoal verify" in err
    assert not (tmp_path / "o").exists()
    code, out, _ = run(capsys, "verify", str(job))
    size = pack.stat().st_size
    assert code == 1 and f"PROBLEM: pack {pack} is {size} bytes; the manifests say {2**63 - 1}" in out


def test_a_mismatch_with_the_dcp_metadata_is_a_problem_for_verify_and_stops_export(job, tmp_path, capsys):
    edit_manifest(set_field("items", "w", "kind", value="bytes"))(job)
    code, out, _ = run(capsys, "verify", str(job))
    assert code == 1  # was: 0, OK
    assert f"PROBLEM: step 1: manifest {job}/{MANIFEST} disagrees with its DCP metadata" in out
    assert "item 'w'" in out and "'bytes'" in out and "'tensor'" in out
    for fmt in ("dcp", "safetensors"):  # safetensors was: exit 0, the bytes exported as a tensor
        code, _, err = run(capsys, "export", str(job), "--format", fmt, "--step", "1", str(tmp_path / fmt))
        assert code == 2 and f"manifest {job}/{MANIFEST}: " in err and "item 'w'" in err, err
        assert not (tmp_path / fmt).exists()


def test_export_names_the_manifest_whose_dcp_metadata_is_malformed(job, tmp_path, capsys):
    edit_manifest(drop_dcp_codec)(job)  # was: "dcp metadata: codec: ...", no file named
    code, _, err = run(capsys, "export", str(job), "--format", "dcp", "--step", "1", str(tmp_path / "o"))
    assert code == 2 and f"manifest {job}/{MANIFEST}: dcp metadata: codec" in err


def test_export_of_a_step_whose_manifest_is_missing_does_not_say_the_step_is_absent(job, tmp_path, capsys):
    (job / MANIFEST).unlink()  # was: "no checkpoint for step 1 ...; steps present: 1, 2"
    code, _, err = run(capsys, "export", str(job), "--format", "dcp", "--step", "1", str(tmp_path / "o"))
    assert code == 2 and "has a commit record but no manifest" in err and f"{job}/{MANIFEST}" in err
    assert "steps present" not in err


def test_records_that_are_directories_are_not_taken_for_absent_ones(job, capsys):
    put_directory(COMMIT)(job)  # was: step 1 silently B3, verify OK
    put_directory(layout.LATEST)(job)  # was: silently no LATEST, verify OK
    code, out, err = run(capsys, "verify", str(job))
    assert code == 1
    assert f"{job}/{COMMIT} is a directory, not a file" in out
    assert f"{job}/{layout.LATEST} is a directory, not a file" in out
    code, out, err = run(capsys, "ls", str(job), "--json")
    assert code == 0 and f"warning: {job}/{layout.LATEST} is a directory" in err
    assert f"{job}/{COMMIT} is a directory" in json.loads(out)["checkpoints"][0]["problem"]


@pytest.mark.parametrize("step", ["-1", "1000000000000", "x"])
def test_a_step_out_of_range_is_a_usage_error(job, tmp_path, capsys, step):
    for argv in (
        ["export", str(job), "--format", "dcp", "--step", step, str(tmp_path / "o")],
        ["verify", str(job), "--step", step],
    ):
        code, _, err = run(capsys, *argv)  # export --step -1 was: ValueError, a traceback
        assert code == 2 and "--step" in err and "Traceback" not in err, err


# -- the last resort ---------------------------------------------------------------------------------


def _raise(error: BaseException) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    return fail


def test_an_os_error_is_one_line_naming_the_file(job, capsys, monkeypatch):
    error = PermissionError(13, "Permission denied", f"{job}/{MANIFEST}")
    monkeypatch.setattr(shoal.cli.ls, "list_checkpoints", _raise(error))
    code, out, err = run(capsys, "ls", str(job))
    assert code == 2 and out == ""
    assert err == f"shoal ls: error: [Errno 13] Permission denied: '{job}/{MANIFEST}'\n"


def test_an_unexpected_exception_is_an_internal_error_with_a_hint(job, capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.setattr(shoal.cli.ls, "list_checkpoints", _raise(ZeroDivisionError("boom")))
    code, _, err = run(capsys, "ls", str(job))
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("shoal ls: internal error: ZeroDivisionError: boom")
    assert "--debug" in err and f"{DEBUG_ENV}=1" in err
    code, _, err = run(capsys, "ls", str(job), "--debug")
    assert code == 2 and "Traceback" in err and "ZeroDivisionError: boom" in err
    monkeypatch.setenv(DEBUG_ENV, "1")
    code, _, err = run(capsys, "ls", str(job))
    assert code == 2 and "Traceback" in err


def test_interrupted_is_130_and_a_closed_pipe_is_quiet(job, capsys, monkeypatch):
    monkeypatch.setattr(shoal.cli.ls, "list_checkpoints", _raise(KeyboardInterrupt()))
    code, _, err = run(capsys, "ls", str(job))
    assert code == 130 and err == "shoal ls: interrupted\n"
    monkeypatch.setattr(shoal.cli.ls, "list_checkpoints", _raise(BrokenPipeError()))
    code, out, err = run(capsys, "ls", str(job))
    assert code == 2 and out == err == ""


def test_demo_errors_are_one_line_too(capsys, monkeypatch):
    import shoal.demo

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.setattr(shoal.demo, "main", _raise(OSError(28, "No space left on device", "/dev/shm/x")))
    code, _, err = run(capsys, "demo")
    assert code == 2 and err == "shoal demo: error: [Errno 28] No space left on device: '/dev/shm/x'\n"
    monkeypatch.setattr(shoal.demo, "main", _raise(KeyError("k")))
    code, _, err = run(capsys, "demo")
    assert (
        code == 2 and err.startswith("shoal demo: internal error: KeyError: 'k'") and "Traceback" not in err
    )


# -- as a user runs it -------------------------------------------------------------------------------


def test_the_installed_command_prints_no_traceback_on_damaged_checkpoints(job, tmp_path):
    edit_manifest(make_partial)(job)
    script = (
        "import sys\n"
        "from shoal.cli.main import main\n"
        "codes = [main(a.split('\\t')) for a in sys.argv[1:]]\n"
        "print(codes, file=sys.stderr)\n"
    )
    commands = [
        f"ls\t{job}",
        f"verify\t{job}",
        f"export\t{job}\t--format\tdcp\t--step\t1\t{tmp_path / 'o'}",
        f"export\t{job}\t--format\tdcp\t--step\t-1\t{tmp_path / 'o'}",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", script, *commands], capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == "[0, 1, 2, 2]", proc.stderr
    assert f"manifest {job}/{MANIFEST} is partial" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "verify", str(job), "--step", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("FAILED: 1 problem(s)")


def test_export_to_a_directory_that_cannot_be_made_says_so(job, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, out, err = run(capsys, "export", str(job), "--format", "dcp", str(blocker / "out"))
    assert code == 2 and out == ""
    target = blocker / "out"
    assert err.startswith(f"shoal export: error: cannot create the output directory {target}: ")
    assert err.endswith(": Not a directory; choose another\n")
