"""Isolation between runs and users on one machine (docs/design.md section 11), as a user meets it.

Two experiments with default names never share host state; a fresh run never resumes another
run; what a crashed process staged survives the next process; host tiers are private (0700 /
0600, no symlink followed, nothing of another user read).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

import shoal
from shoal.errors import OwnershipError
from shoal.testing.checkpoints import assert_state_equal, zeros_like_state


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4096, generator=g), "b": torch.arange(seed, seed + 100, dtype=torch.int64)}


def _config(shared: Path, dram: Path, local: Path, **kw: object) -> shoal.Config:
    return shoal.Config(shared=str(shared), dram=str(dram), local=str(local), host_id="host", **kw)  # type: ignore[arg-type]


@pytest.fixture
def roots(tmp_path: Path, dram_root: Path) -> dict[str, Path]:
    return {
        "dram": dram_root / "shoal",
        "local": tmp_path / "local",
        "a": tmp_path / "a",
        "b": tmp_path / "b",
    }


CRASH_AFTER_B1 = textwrap.dedent(
    """
    import sys, time, torch, shoal
    from shoal import failpoints
    shared, dram, local, crash_step = sys.argv[1:5]
    g = torch.Generator().manual_seed(int(crash_step))
    cfg = shoal.Config(shared=shared, dram=dram, local=local, host_id="host")
    ckpt = shoal.Checkpointer(cfg)
    ckpt.save(1, {"w": torch.randn(4096, generator=torch.Generator().manual_seed(1)),
                  "b": torch.arange(1, 101, dtype=torch.int64)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    failpoints.configure("pipeline.before_hash=kill")
    ckpt.save(int(crash_step), {"w": torch.randn(4096, generator=g),
                               "b": torch.arange(int(crash_step), int(crash_step) + 100, dtype=torch.int64)})
    time.sleep(600)  # the pipeline's failpoint kills the process after B1
    """
)


def _crash_after_b1(roots: dict[str, Path], shared: Path, step: int = 4) -> None:
    """A training process saves step 1 (B4), then stages ``step`` and is killed before hashing it."""
    env = {k: v for k, v in os.environ.items() if k != "SHOAL_FAILPOINTS"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CRASH_AFTER_B1,
            str(shared),
            str(roots["dram"]),
            str(roots["local"]),
            str(step),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard: the process is killed at its second save
    )
    # SIGKILL, as a crash: by the pipeline's worker, after save() had staged (B1) and submitted.
    assert proc.returncode == -9, proc.stderr


def test_a_second_process_on_the_same_roots_job_host_and_rank_is_refused_naming_the_lock(roots):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import sys, time, shoal
                shoal.Checkpointer(shoal.Config(shared=sys.argv[1], dram=sys.argv[2], local=sys.argv[3],
                                                host_id="host"))
                print("ready", flush=True)
                time.sleep(600)  # killed by the test when it is done
                """
            ),
            str(roots["a"]),
            str(roots["dram"]),
            str(roots["local"]),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        # Another experiment: its own shared root, everything else default (same job, host, rank).
        with pytest.raises(OwnershipError) as info:
            shoal.Checkpointer(_config(roots["b"], roots["dram"], roots["local"]))
        message = str(info.value)
        assert f"pid {holder.pid}" in message and "r0.lock" in message and "Config.job" in message
        # The way out works: another job name.
        with shoal.Checkpointer(_config(roots["b"], roots["dram"], roots["local"], job="other")) as ckpt:
            ckpt.save(1, _state(2)).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    # The kernel released the dead holder's lock: the default job starts now.
    shoal.Checkpointer(_config(roots["b"], roots["dram"], roots["local"])).close()


def test_two_experiments_in_turn_on_default_names_each_load_only_their_own_bytes(roots):
    for step in range(1, 4):
        for name, seed in (("a", 100), ("b", 200)):
            with shoal.Checkpointer(_config(roots[name], roots["dram"], roots["local"])) as ckpt:
                ckpt.save(step, _state(seed + step)).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    for name, seed in (("a", 100), ("b", 200)):
        with shoal.Checkpointer(_config(roots[name], roots["dram"], roots["local"])) as ckpt:
            for step in range(1, 4):
                target = zeros_like_state(_state(0))
                assert ckpt.load(target, step=step) == step
                assert_state_equal(target, _state(seed + step))


def test_a_fresh_run_never_resumes_another_runs_staged_checkpoint(roots):
    _crash_after_b1(roots, roots["a"])  # run A: step 1 committed, step 4 staged (B1) only
    # Run B: an empty, different shared root, the same job name and host roots.
    with shoal.Checkpointer(_config(roots["b"], roots["dram"], roots["local"])) as ckpt:
        with pytest.raises(shoal.CheckpointNotFound):
            ckpt.load(zeros_like_state(_state(0)))
        assert not (roots["b"] / "default" / "steps").exists()  # nothing healed into B's root
    # Run A resumes as before: step 4 comes back from its DRAM slab, bit for bit.
    with shoal.Checkpointer(_config(roots["a"], roots["dram"], roots["local"])) as ckpt:
        target = zeros_like_state(_state(0))
        assert ckpt.load(target) == 4
        assert_state_equal(target, _state(4))
        assert ckpt.last_load is not None and ckpt.last_load.origin == "staged"


def test_after_a_crash_at_b1_construct_close_and_load_without_heal_keep_the_staged_checkpoint(roots):
    _crash_after_b1(roots, roots["a"])
    cfg = _config(roots["a"], roots["dram"], roots["local"])
    shoal.Checkpointer(cfg).close()  # only construct and close
    with shoal.Checkpointer(cfg) as ckpt:
        target = zeros_like_state(_state(0))
        assert ckpt.load(target, heal=False) == 4
    with shoal.Checkpointer(cfg) as ckpt:
        target = zeros_like_state(_state(0))
        assert ckpt.load(target) == 4  # still there; this load heals it to B4
        assert_state_equal(target, _state(4))
        assert ckpt.last_heal is not None
        ckpt.last_heal.wait(shoal.Boundary.RESTARTABLE, timeout=60)
    # Superseded by its own commit: the crashed process's slabs are given back now.
    assert not [p for p in roots["dram"].rglob("*.slab")]
    with shoal.Checkpointer(cfg) as ckpt:
        target = zeros_like_state(_state(0))
        assert ckpt.load(target) == 4 and ckpt.last_load is not None
        assert ckpt.last_load.bytes_by_tier.keys() == {"shared"}


def test_host_tiers_are_private_directories_and_files(roots):
    with shoal.Checkpointer(_config(roots["a"], roots["dram"], roots["local"])) as ckpt:
        ckpt.save(1, _state(1)).wait(shoal.Boundary.RESTARTABLE, timeout=60)
        for root in (roots["dram"], roots["local"]):
            entries = [root, *root.rglob("*")]
            assert len(entries) > 3
            for p in entries:
                mode = stat.S_IMODE(p.lstat().st_mode)
                assert not p.is_symlink()
                assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))


def test_a_host_root_owned_by_another_user_is_refused_naming_path_owner_and_mode(roots):
    if os.geteuid() != 0:
        pytest.skip("planting a directory as another user needs root (setpriv --reuid)")
    if shutil.which("setpriv") is None or not os.path.isdir("/dev/shm"):
        pytest.skip("needs setpriv and /dev/shm")
    public = Path(tempfile.mkdtemp(prefix="shoal-test-public-", dir="/dev/shm"))
    try:
        public.chmod(0o1777)  # like /dev/shm itself: world-writable, sticky
        victim_root = public / f"shoal-{os.geteuid()}"
        marker = public / "pwned"
        # Another user creates the victim's default-style root first and plants state in it.
        plant = textwrap.dedent(
            """
            import json, os, sys
            root, marker = sys.argv[1:3]
            host = os.path.join(root, "default", "host")
            os.makedirs(os.path.join(host, "runs"), mode=0o777)
            os.chmod(root, 0o777)
            with open(os.path.join(host, "planted.json"), "w") as f:
                json.dump({"marker": marker}, f)
            """
        )
        subprocess.run(
            ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
             sys.executable, "-c", plant, str(victim_root), str(marker)],
            check=True, timeout=60,
        )  # fmt: skip
        assert victim_root.stat().st_uid == 65534
        with pytest.raises(OwnershipError) as info:
            shoal.Checkpointer(_config(roots["a"], victim_root, roots["local"]))
        message = str(info.value)
        assert str(victim_root) in message and "uid 65534" in message and "0777" in message
        assert not marker.exists()
        assert not (roots["a"] / "default" / "RUN").exists()  # refused before touching shared storage
    finally:
        shutil.rmtree(public, ignore_errors=True)


def test_a_group_writable_root_is_refused(roots):
    roots["dram"].mkdir(mode=0o700)
    roots["dram"].chmod(0o770)
    with pytest.raises(OwnershipError, match="writable by other users"):
        shoal.Checkpointer(_config(roots["a"], roots["dram"], roots["local"]))


def test_a_symlinked_host_root_is_refused(roots, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (roots["dram"]).mkdir(mode=0o700)
    (roots["dram"] / "default").symlink_to(elsewhere)
    with pytest.raises(OwnershipError, match="symbolic link"):
        shoal.Checkpointer(_config(roots["a"], roots["dram"], roots["local"]))
    assert list(elsewhere.iterdir()) == []


def test_a_symlink_planted_for_the_event_log_or_a_staged_index_is_never_followed(roots, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    victim.chmod(0o600)
    cfg = _config(roots["a"], roots["dram"], roots["local"])
    with shoal.Checkpointer(cfg) as ckpt:
        ckpt.save(1, _state(1)).wait(shoal.Boundary.RESTARTABLE, timeout=60)
        log_path = ckpt.config.event_log
        assert log_path is not None
    os.unlink(log_path)
    os.symlink(victim, log_path)
    run = Path(ckpt.dram.root)
    (run / "staged").mkdir(exist_ok=True)
    os.symlink(victim, run / "staged" / "r0-deadbeef-slot-0.json")
    with shoal.Checkpointer(cfg) as ckpt:
        target = zeros_like_state(_state(0))
        assert ckpt.load(target) == 1  # the planted index is ignored, step 1 loads from shared
        assert_state_equal(target, _state(1))
        ckpt.save(2, _state(2)).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    assert victim.read_text() == "precious"  # never appended to, never overwritten


def _committed_steps(shared: Path) -> list[int]:
    steps = shared / "default" / "steps"
    return sorted(int(p.name) for p in steps.iterdir() if (p / "COMMIT").exists())


def test_a_restart_that_resumed_keeps_keep_last_and_one_that_did_not_keeps_the_old_steps_apart(roots):
    cfg = _config(roots["a"], roots["dram"], roots["local"], keep_last=2)
    with shoal.Checkpointer(cfg) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _state(step)).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    with shoal.Checkpointer(cfg) as ckpt:  # a restart: loads, then trains on
        assert ckpt.load(zeros_like_state(_state(0))) == 3
        for step in (4, 5):
            ckpt.save(step, _state(step)).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    assert _committed_steps(roots["a"]) == [4, 5]  # the restarted writer continues the old one
    with shoal.Checkpointer(cfg) as ckpt:  # saves into the job without loading it: another writer
        for step in (6, 7, 8):
            ckpt.save(step, _state(step)).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    assert _committed_steps(roots["a"]) == [4, 5, 7, 8]  # its own window; the others' steps left alone
    with shoal.Checkpointer(cfg) as ckpt:
        for step in (4, 8):
            target = zeros_like_state(_state(0))
            assert ckpt.load(target, step=step) == step
            assert_state_equal(target, _state(step))


def test_shoal_gc_lists_and_drops_what_a_crashed_process_left_staged(roots, capsys):
    from shoal.cli.main import main

    _crash_after_b1(roots, roots["a"])
    argv = ["gc", "--staged", "--dram", str(roots["dram"])]
    assert main(argv) == 0
    listed = capsys.readouterr().out
    assert "step 4" in listed and "rank 0" in listed and str(roots["a"]) in listed
    assert main([*argv, "--drop", "--step", "4", "--dry-run"]) == 0
    assert "would drop" in capsys.readouterr().out
    cfg = _config(roots["a"], roots["dram"], roots["local"])
    with shoal.Checkpointer(cfg):  # a live process of rank 0: its lock keeps gc's hands off
        assert main([*argv, "--drop"]) == 0
        assert "in use by pid" in capsys.readouterr().out
    assert main([*argv, "--drop", "--step", "4"]) == 0
    assert "dropped" in capsys.readouterr().out
    with shoal.Checkpointer(cfg) as ckpt:  # step 4 is gone; step 1 (committed) loads
        target = zeros_like_state(_state(0))
        assert ckpt.load(target) == 1
        assert_state_equal(target, _state(1))


def test_a_second_checkpointer_in_the_same_process_says_to_close_the_first(roots):
    cfg = _config(roots["a"], roots["dram"], roots["local"])
    first = shoal.Checkpointer(cfg)
    try:
        with pytest.raises(OwnershipError, match=r"this process already has a Checkpointer open.*close\(\)"):
            shoal.Checkpointer(cfg)
    finally:
        first.close()
    shoal.Checkpointer(cfg).close()  # closed: the lock is free again


def test_a_world_writable_root_like_dev_shm_itself_is_refused_with_the_way_out(tmp_path, roots):
    public = tmp_path / "public"
    public.mkdir()
    public.chmod(0o1777)
    with pytest.raises(OwnershipError, match="writable by other users") as info:
        shoal.Checkpointer(_config(roots["a"], public, roots["local"]))
    assert "a directory of your own" in str(info.value)
