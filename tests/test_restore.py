"""Restore across simulated hosts: read once, spread over the fabric, survive a lost host."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import shoal
from shoal.testing import restore_scenarios as rs
from shoal.testing.multiproc import run_ranks

HOSTS = ["h0", "h0", "h1", "h1"]
# Several processes on 2 cores: generous limits (run_ranks kills its ranks after them), so a busy
# machine is not a failure; the suite's own timeout is the hang guard.
LIMIT = 300


def test_n_ranks_loading_one_model_read_each_unique_byte_from_shared_storage_once(tmp_path):
    results = run_ranks(rs.load_one_model, hosts=HOSTS, kwargs={"root": str(tmp_path)}, timeout=LIMIT)
    first = results[0]
    assert [r["step"] for r in results] == [1, 1, 1, 1]  # and every rank compared its tensors bit for bit
    assert first["by_tier"] == {"shared": first["unique_bytes"]}  # each unique byte read once, job-wide
    # Every rank needs every chunk; each was read by one rank and reaches the three others: its
    # host's other rank from the reader, the other host once, then from that host's relay.
    assert first["fabric"] == 3 * first["unique_bytes"]
    assert first["relayed"] == first["unique_bytes"]  # one of the three copies of each chunk is relayed
    assert all(r["by_tier"] == first["by_tier"] for r in results)


def _lose_host(root: str, host: str) -> None:
    """Delete everything ``host`` held (its DRAM slabs, staged indexes and local tier)."""
    for tier in ("dram", "local"):
        shutil.rmtree(os.path.join(root, tier, "test", host), ignore_errors=True)


def _disable_shared(root: str) -> None:
    """Make the shared tier unreachable: its root is now a plain file."""
    shared = os.path.join(root, "shared")
    os.rename(shared, shared + ".offline")
    with open(shared, "w") as f:
        f.write("offline")


def test_losing_the_coordinators_host_and_shared_storage_restores_from_partner_copies(tmp_path):
    root = str(tmp_path)
    run_ranks(rs.save_then_crash, hosts=HOSTS, kwargs={"root": root}, allow_death=[0, 1, 2, 3], timeout=LIMIT)
    _lose_host(root, "h0")
    _disable_shared(root)
    results = run_ranks(rs.restore_and_resume, hosts=HOSTS, kwargs={"root": root}, timeout=LIMIT)
    for r in results:
        # Step 2 reached B2 but never B3: only host h1's DRAM and its partner copies of h0's shards survive.
        assert r["step"] == 2
        assert r["origin"].endswith(":h1")
        assert "shared" not in r["by_tier"]
        assert r["by_tier"]["dram"] > 0 and r["by_tier"]["local"] > 0
        assert r["fabric"] > 0
        # Healing it (saving it again) cannot reach shared storage; the job goes on regardless.
        assert r["healed"]["error"] is not None and r["latest"] is None


def test_after_losing_a_host_the_newest_checkpoint_on_two_hosts_wins_over_older_committed_ones(tmp_path):
    root = str(tmp_path)
    run_ranks(rs.save_then_crash, hosts=HOSTS, kwargs={"root": root}, allow_death=[0, 1, 2, 3], timeout=LIMIT)
    _lose_host(root, "h1")  # the other host this time; the shared tier stays
    results = run_ranks(rs.restore_and_resume, hosts=HOSTS, kwargs={"root": root}, timeout=LIMIT)
    for r in results:
        assert r["step"] == 2  # newer than LATEST (step 1): restored from h0's DRAM and partner copies
        assert r["origin"].endswith(":h0")
        # Healed: saved again, it reached B4 (only what shared storage lacked was drained).
        assert r["healed"] == {"reached": int(shoal.Boundary.RESTARTABLE), "error": None}
        assert r["latest"] == 2


# (failpoint, the rank it kills, the step that must load after restart). Rank 0 is the coordinator;
# rank 2 leads host h1 (a replica target: it receives h0's partner copies); every rank drains its
# own shards. A killed process leaves its host's DRAM: B1 survives it, so a checkpoint that
# reached B1 (save returned on every rank) must load; one that did not must not.
KILLS = [
    ("stage.after_copy", 2, 1),
    ("pipeline.before_hash", 2, 2),
    ("pipeline.before_replica_manifest", 2, 2),
    ("pipeline.before_drain", 3, 2),
    ("pipeline.before_latest", 0, 2),
]
MORE_KILLS = [
    ("pipeline.after_replica_pack", 2, 2),
    ("pipeline.after_replicate", 1, 2),
    ("pipeline.after_pack", 1, 2),
    ("pipeline.before_manifest", 0, 2),
    ("pipeline.before_commit", 0, 2),
]
if os.environ.get("SHOAL_FULL_KILL_MATRIX"):
    KILLS += MORE_KILLS


@pytest.mark.parametrize(("point", "victim", "expected"), KILLS, ids=[f"{p}@rank{v}" for p, v, _ in KILLS])
def test_a_kill_at_each_failpoint_restores_the_newest_checkpoint_that_survives_it(
    tmp_path, point, victim, expected
):
    root = str(tmp_path)
    kwargs = {"root": root, "fault": f"{point}=kill", "victim": victim}
    run_ranks(rs.crash_at, hosts=HOSTS, kwargs=kwargs, allow_death=[0, 1, 2, 3], timeout=LIMIT)
    results = run_ranks(rs.restore_after_crash, hosts=HOSTS, kwargs={"root": root}, timeout=LIMIT)
    assert [r["step"] for r in results] == [expected] * 4  # bit-exact, and step 1 still loads (in ranks)
    # The restarted job closed cleanly: its own slabs are given back, and so is every slab of the
    # crashed job that a committed checkpoint superseded. What stays is only a staged step newer
    # than LATEST (kept until a newer checkpoint reaches B4, or `shoal gc --staged` drops it).
    left = _leftover_steps(os.path.join(root, "dram"))
    with open(os.path.join(root, "shared", "test", "LATEST")) as f:
        latest = json.load(f)["step"]
    assert all(step is not None and step > latest for step in left.values()), (latest, left)
    if expected == 2 and point != "pipeline.before_latest":
        # Restored from B1..B3 and healed to B4: nothing of the crashed job is needed any more.
        # (Killed before LATEST, step 2 has its COMMIT: it loads as committed, is not healed, and
        # its staged copies stay until a newer checkpoint reaches B4.)
        assert left == {}


def _leftover_steps(dram: str) -> dict[str, int | None]:
    """Every slab file under ``dram`` -> the step its staged index names (None: no index)."""
    out: dict[str, int | None] = {}
    for directory, _, names in os.walk(dram):
        for n in names:
            if n.endswith(".slab"):
                index = os.path.join(os.path.dirname(directory), "staged", n[: -len(".slab")] + ".json")
                step = None
                if os.path.exists(index):
                    with open(index) as f:
                        step = json.load(f)["step"]
                out[n] = step
    return out


def test_a_checkpoint_of_four_ranks_loads_resharded_on_two(tmp_path):
    root = str(tmp_path)
    run_ranks(rs.save_row_sharded, hosts=HOSTS, kwargs={"root": root}, timeout=LIMIT)
    results = run_ranks(rs.load_resharded, hosts=["h0", "h1"], kwargs={"root": root}, timeout=LIMIT)
    assert [r["step"] for r in results] == [1, 1]  # each rank checked its 32 rows and the model


def test_a_chunk_bad_on_its_own_host_and_on_shared_storage_is_repaired_from_the_partner_host(tmp_path):
    results = run_ranks(rs.repair_across_hosts, hosts=HOSTS, kwargs={"root": str(tmp_path)}, timeout=LIMIT)
    for r in results:
        assert r["repaired"] == 1  # and every rank compared its tensors bit for bit
        assert r["by_tier"].get("local", 0) > 0  # the good copy: h1's partner copy, sent over the fabric


def test_ranks_asking_for_different_steps_all_get_the_same_error_naming_them(tmp_path):
    from shoal.testing import scenarios

    results = run_ranks(
        scenarios.mismatched_load_steps, hosts=["h0", "h1"], kwargs={"root": str(tmp_path)}, timeout=LIMIT
    )
    # found before any collective of the load: each rank names both calls, with the same note
    notes = [r.split("failed before it began: ", 1)[1] for r in results]
    assert all(r.startswith("CollectiveMismatch") for r in results), results
    assert notes[0] == notes[1] and "load(1)" in notes[0] and "load(2)" in notes[0], notes


def test_chunks_that_fail_at_their_reader_after_the_exchange_began_are_sent_again_repaired(tmp_path):
    results = run_ranks(
        rs.repair_replicated_across_hosts, hosts=HOSTS, kwargs={"root": str(tmp_path)}, timeout=LIMIT
    )
    first = results[0]
    assert first["repaired"] > 0  # chunks h0's ranks were to read and send (every rank compared bit for bit)
    assert set(first["by_tier"]) <= {"dram", "local"} and first["by_tier"]
    # Each unique byte reaches the three ranks that did not read it, once verified: the
    # placeholders that did not verify are not counted.
    assert first["fabric"] == 3 * first["unique_bytes"]


def test_a_chunk_sent_on_unchecked_that_arrives_spoiled_is_read_again_from_another_copy(tmp_path):
    """Host h0 is lost: h1 reads h0's shards from its partner copies and sends them on without
    checking them (the receivers do). One of those copies is damaged: its receiver finds it,
    and the load reads that chunk again from shared storage."""
    root = str(tmp_path)
    run_ranks(rs.save_then_crash, hosts=HOSTS, kwargs={"root": root}, allow_death=[0, 1, 2, 3], timeout=LIMIT)
    _lose_host(root, "h0")
    chunk = rs.first_chunk_of_rank_zero(1, 64 << 10)
    assert rs.spoil_copies([os.path.join(root, "local", "test", "h1")], [chunk]) == 1
    results = run_ranks(rs.load_step_one, hosts=HOSTS, kwargs={"root": root}, timeout=LIMIT)
    first = results[0]  # every rank compared its tensors bit for bit
    assert first["repaired"] == 1
    assert first["by_tier"]["local"] > 0 and first["by_tier"]["shared"] == 64 << 10  # the one chunk again
    assert all(r == first for r in results)
