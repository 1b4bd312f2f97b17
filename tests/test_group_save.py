"""Group save across simulated hosts: 4 gloo ranks on 2 hosts, each host with its own DRAM and local tiers."""

from __future__ import annotations

import pytest

import shoal
from shoal.testing import scenarios
from shoal.testing.checkpoints import make_config
from shoal.testing.multiproc import run_ranks

HOSTS = ["h0", "h0", "h1", "h1"]
# Several processes on 2 cores: generous limits (run_ranks kills its ranks after them), so a busy
# machine is not a failure; the suite's own timeout is the hang guard.
LIMIT = 300
CHUNK = 64 << 10


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    return run_ranks(scenarios.save_dp_and_inspect, hosts=HOSTS, kwargs={"root": str(root)}, timeout=LIMIT)


def test_boundaries_are_reached_in_order_on_every_rank(dp_run):
    for r in dp_run:
        h = r["handle"]
        assert h["error"] is None and h["reached"] == int(shoal.Boundary.RESTARTABLE)
        t = {shoal.Boundary(b): s for b, s in h["times"].items()}
        assert t[shoal.Boundary.STAGED] < t[shoal.Boundary.REPLICATED]
        assert t[shoal.Boundary.REPLICATED] <= t[shoal.Boundary.PERSISTED] <= t[shoal.Boundary.RESTARTABLE]
        assert r["replicating"]


def test_at_replicated_every_chunk_and_the_manifest_are_on_two_hosts(dp_run):
    at_b2 = dp_run[0]["at_b2"]
    chunks = dp_run[0]["manifest_chunks"]
    holders = {d: [h for h, held in at_b2["chunks"].items() if d in held] for d in chunks}
    single = {d[:12]: hs for d, hs in holders.items() if len(set(hs)) < 2}
    assert not single, f"chunks on fewer than two hosts at B2: {single}"
    assert at_b2["manifests"] == {"h0": True, "h1": True}
    for r in dp_run:  # the drain was held back 1.5 s: B2 was reached well before B3
        t = r["handle"]["times"]
        assert t[int(shoal.Boundary.PERSISTED)] - t[int(shoal.Boundary.REPLICATED)] >= 1.0


def test_shared_tier_holds_each_unique_byte_once_and_hosts_drain_half_each(dp_run):
    state_unique = scenarios.state_bytes(scenarios.dp_state(0)["model"]) + sum(
        scenarios.state_bytes(scenarios.dp_state(r)["optim"]) for r in range(len(HOSTS))
    )
    packs = dp_run[0]["packs"]
    objects = dp_run[0]["stats"]["unique_bytes"] - state_unique  # the pickled non-tensor "step"
    assert 0 < objects < 2048
    assert sum(packs.values()) == state_unique + objects
    by_host = {h: sum(n for p, n in packs.items() if f"-{h}-" in p) for h in ("h0", "h1")}
    half = sum(packs.values()) / 2
    assert all(abs(n - half) <= CHUNK for n in by_host.values()), by_host


def test_data_loads_bit_exact_from_shared_storage_alone(dp_run):
    assert [r["loaded"] for r in dp_run] == [1, 1, 1, 1]  # the scenario compared every tensor bit for bit


def test_a_second_checkpoint_with_90_percent_frozen_writes_at_most_10_percent(tmp_path):
    kwargs = {"root": str(tmp_path)}
    results = run_ranks(scenarios.frozen_second_checkpoint, hosts=HOSTS, kwargs=kwargs, timeout=LIMIT)
    for r in results:
        assert [h["error"] for h in r["handles"]] == [None, None]

    def written(step, kind, field):
        return sum(
            e.get(field, 0) for r in results for e in r["events"] if e["step"] == step and e["event"] == kind
        )

    def shared_pack_bytes(step):
        return sum(
            e["bytes"] for r in results for e in r["events"]
            if e["step"] == step and e["event"] == "write" and e.get("what") == "pack"
        )  # fmt: skip

    first, second = shared_pack_bytes(1), shared_pack_bytes(2)
    assert first > 0 and second <= 0.10 * first, (first, second)
    sent1, sent2 = written(1, "replicate", "sent_bytes"), written(2, "replicate", "sent_bytes")
    assert sent1 > 0 and sent2 <= 0.10 * sent1, (sent1, sent2)


def test_a_failing_drain_leaves_training_running_and_the_next_save_succeeds(tmp_path):
    kwargs = {"root": str(tmp_path), "bad_rank": 2}
    results = run_ranks(scenarios.failing_drain, hosts=HOSTS, kwargs=kwargs, timeout=LIMIT)
    for r in results:
        assert r["second"]["error"] is not None and "rank 2" in r["second"]["error"]
        assert r["second"]["failed_at"] == int(shoal.Boundary.PERSISTED)
        assert r["latest_after_failure"] == 1
        assert r["loaded"] == 1
        assert r["newest"] == 2  # reached B2 before its drain failed: restorable from DRAM and partners
        assert r["third"]["error"] is None and r["third"]["reached"] == int(shoal.Boundary.RESTARTABLE)


def test_a_full_shared_tier_fails_that_checkpoint_at_b3_and_the_job_goes_on(tmp_path):
    # ENOSPC after rank 2 wrote the first chunk of its drain pack: a disk filling up mid-file.
    kwargs = {"root": str(tmp_path), "bad_rank": 2, "fault": "shared.write=raise:ENOSPC"}
    results = run_ranks(scenarios.failing_drain, hosts=HOSTS, kwargs=kwargs, timeout=LIMIT)
    for r in results:
        error = r["second"]["error"]
        assert "rank 2" in error and "No space left on device" in error and "shared" in error
        assert r["second"]["failed_at"] == int(shoal.Boundary.PERSISTED)
        assert r["temp_files"] == []  # the half-written pack was removed, not left behind
        assert r["loaded"] == 1  # the earlier checkpoint loads bit-exact (checked in the ranks)
        assert r["third"]["error"] is None and r["third"]["reached"] == int(shoal.Boundary.RESTARTABLE)


def test_replication_with_one_host_is_refused(tmp_path, dram_root):
    config = make_config(tmp_path, dram_root, path="partner")
    with pytest.raises(shoal.ConfigError, match="two hosts"):
        shoal.Checkpointer(config)


def test_dcp_save_with_shoals_writer_runs_the_same_pipeline(tmp_path):
    results = run_ranks(scenarios.direct_dcp_save, hosts=HOSTS, kwargs={"root": str(tmp_path)}, timeout=LIMIT)
    for r in results:
        assert r["handle"]["error"] is None and r["handle"]["reached"] == int(shoal.Boundary.RESTARTABLE)
        times = r["handle"]["times"]
        assert times[int(shoal.Boundary.STAGED)] < times[int(shoal.Boundary.REPLICATED)]
        assert r["replica_manifest_in_dram"]  # Config.replicate_to="dram"


def test_partner_copies_of_a_failed_drain_are_reused_and_referenced(tmp_path):
    results = run_ranks(
        scenarios.held_replicas_are_reused, hosts=HOSTS, kwargs={"root": str(tmp_path)}, timeout=LIMIT
    )
    for r in results:
        assert r["first"]["reached"] == int(shoal.Boundary.REPLICATED)
        assert r["first"]["failed_at"] == int(shoal.Boundary.PERSISTED)
        assert r["second"]["reached"] == int(shoal.Boundary.RESTARTABLE)
        assert r["sent"][1] > 0 and r["sent"][2] == 0  # the partners already held every chunk
    located = {r["host"]: r["located"] for r in results}
    assert all(n > 0 for n in located.values())  # each host's manifest of step 2 points at its copies
