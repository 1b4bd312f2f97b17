"""A save through s3:// on a 2-host emulated cluster: the storage NICs carry the plan's balance.

Two hosts of two gloo ranks each (network namespaces, shaped links, moto's S3 behind its own
link: :mod:`shoal.testing.cluster.hosts`). The ranks save a data-parallel model plus per-rank optimizer
shards; each host's storage NIC must have sent what that host's ranks drained (read from the
kernel's interface counters, against the drain's ``write`` events and the objects on S3), the two
hosts' shares must be the plan's even split, and after host 1's tiers are deleted a fresh job
restores bit for bit. Byte counts only: nothing here is timed.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from shoal.testing.cluster import scenarios as cluster_scenarios
from shoal.testing.cluster.hosts import PREFIX, Cluster, ClusterSpec, cannot_run
from shoal.testing.cluster.scenarios import CHUNK, host_tier_roots
from shoal.testing.multiproc import RankFailed

WHY = cannot_run()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the emulated cluster cannot run here: {WHY}")

HOSTS, RANKS_PER_HOST = 2, 2
KIB, MIB = 1 << 10, 1 << 20
SPEC = ClusterSpec(hosts=HOSTS, host_storage_mbit=200, fabric_mbit=400, storage_mbit=400)
# What a host's storage NIC sends on top of the objects it writes: Ethernet, IP and TCP headers
# (about 66 bytes per 1448-byte segment: 4.6 %), the HTTP requests themselves (headers, signatures,
# the listings and reads of the catalog and fence) and the ACKs of what it receives.
FRAME_OVERHEAD = 0.05
REQUEST_SLACK = 256 * KIB


def _namespaces(run_id: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{PREFIX}{run_id}-")]


@pytest.fixture
def roots() -> Iterator[dict[str, str]]:
    """Fresh DRAM (``/dev/shm``) and local roots for the hosts' tiers, removed after the test."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    dram = tempfile.mkdtemp(prefix="shoal-cluster-dram-", dir=shm)
    local = tempfile.mkdtemp(prefix="shoal-cluster-local-")
    try:
        yield {"dram_root": dram, "local_root": local}
    finally:
        shutil.rmtree(dram, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)


def _object_host(key: str) -> str:
    """Which host wrote an object: a pack (or its index) names its host; the rest is the coordinator's."""
    name = key.rsplit("/", 1)[-1]
    if "/packs/" in f"/{key}":
        for h in range(HOSTS):
            if f"-h{h}-" in name:
                return f"h{h}"
        raise AssertionError(f"pack {key!r} names no host of the cluster")
    return "h0"  # RUN, WRITER, the manifest, COMMIT, LATEST: rank 0, on host 0


def test_a_save_through_s3_drains_the_plans_balance_over_each_hosts_storage_nic(
    roots: dict[str, str],
) -> None:
    bucket = f"shoal-cluster-{secrets.token_hex(4)}"
    args: dict[str, Any] = {"bucket": bucket, **roots}
    with Cluster(SPEC) as cluster:
        run_id = cluster.run_id
        before = [cluster.counters(i) for i in range(HOSTS)]
        saved = cluster.run_ranks(cluster_scenarios.save_state, RANKS_PER_HOST, args, timeout=60)
        after = [cluster.counters(i) for i in range(HOSTS)]

        assert [r["reached"] for r in saved] == [4] * HOSTS * RANKS_PER_HOST, saved
        assert [r["host"] for r in saved] == [f"h{r // RANKS_PER_HOST}" for r in range(len(saved))]
        objects: dict[str, int] = saved[0]["objects"]
        packs = {k: n for k, n in objects.items() if k.endswith(".pack")}

        # What the plan had each host drain, from its ranks' write events, is what S3 holds.
        drained = {f"h{h}": 0 for h in range(HOSTS)}
        for r in saved:
            for w in r["writes"]:
                if w["what"] == "pack":
                    drained[r["host"]] += w["bytes"]
                    key = f"root/{cluster_scenarios.JOB}/{w['path']}"
                    assert packs.get(key) == w["bytes"], (key, w, packs)
        assert sum(drained.values()) == sum(packs.values()), (drained, packs)
        unique = 6 * MIB + HOSTS * RANKS_PER_HOST * int(1.5 * MIB)  # the model once, every shard
        assert sum(drained.values()) == unique, drained
        assert saved[0]["planned_new_bytes"] == [unique], saved[0]  # the coordinator's plan
        assert all(r["planned_new_bytes"] == [] for r in saved[1:])

        # The plan's balance: the state is even across hosts, so is the drain.
        half = unique / HOSTS
        for host, n in drained.items():
            assert abs(n - half) <= 0.25 * half, (host, drained)
            assert abs(n - half) <= CHUNK, (host, drained)  # finer: within one chunk of the even split

        # Each host's storage NIC sent what its ranks wrote to S3, and not much more.
        written = {f"h{h}": 0 for h in range(HOSTS)}
        for key, n in objects.items():
            written[_object_host(key)] += n
        report = []
        for h in range(HOSTS):
            host = f"h{h}"
            sent = after[h].storage_tx - before[h].storage_tx
            got = after[h].storage_rx - before[h].storage_rx
            fabric = after[h].fabric_tx - before[h].fabric_tx
            report.append(f"{host}: st0 tx {sent} rx {got}, fb0 tx {fabric}; drained {drained[host]}, "
                          f"wrote {written[host]}")  # fmt: skip
            assert drained[host] <= written[host] <= sent, report
            assert sent <= written[host] * (1 + FRAME_OVERHEAD) + REQUEST_SLACK, report
            # The partner copies crossed the fabric, not the storage NIC. DCP writes a replicated
            # item once (shoal's planner spreads them over the hosts), so every staged chunk was
            # on one host only and went to the partner: what a host drained, it also sent there.
            replicated = sum(r["replicated"] for r in saved if r["host"] == host)
            assert replicated == drained[host], (host, replicated, drained)
            assert fabric >= replicated, report
        print("\n" + "\n".join(report))

        # Host 1 is lost: its DRAM slabs and local disk are gone. A fresh job restores bit for bit
        # (each rank compared every tensor) from host 0's memory, its partner copies and S3.
        for path in host_tier_roots(roots["dram_root"], roots["local_root"], 1):
            shutil.rmtree(path)
        before = [cluster.counters(i) for i in range(HOSTS)]
        restored = cluster.run_ranks(cluster_scenarios.restore_state, RANKS_PER_HOST, args, timeout=60)
        after = [cluster.counters(i) for i in range(HOSTS)]
        assert [r["loaded"] for r in restored] == [1] * HOSTS * RANKS_PER_HOST, restored
        assert all(r["committed"] for r in restored), restored
        read = restored[0]["bytes_by_tier"]
        assert sum(read.values()) == unique, read  # each chunk read once in the job
        got = sum(after[h].storage_rx - before[h].storage_rx for h in range(HOSTS))
        assert got >= read.get("shared", 0), (got, read)  # what came from S3 came over the storage NICs
        print(f"restored from {read} ({got} bytes in through the storage NICs), "
              f"{restored[0]['fabric_bytes']} bytes over the fabric")  # fmt: skip
    assert _namespaces(run_id) == []


def _processes_in(cluster: Cluster) -> list[str]:
    return [
        pid
        for i in range(HOSTS)
        for pid in subprocess.run(
            ["ip", "netns", "pids", cluster.host_ns(i)], capture_output=True, text=True, check=True
        ).stdout.split()
    ]


def test_run_ranks_forms_one_gloo_job_over_the_fabric_and_kills_what_fails_or_hangs() -> None:
    with Cluster(SPEC) as cluster:
        placed = cluster.run_ranks(cluster_scenarios.all_reduce_placement, RANKS_PER_HOST, timeout=60)
        world = HOSTS * RANKS_PER_HOST
        assert [p["rank"] for p in placed] == list(range(world))
        assert {p["world"] for p in placed} == {world}
        assert [p["host"] for p in placed] == [f"h{r // RANKS_PER_HOST}" for r in range(world)]
        assert [p["cluster_host"] for p in placed] == [r // RANKS_PER_HOST for r in range(world)]
        assert {p["ifname"] for p in placed} == {"fb0"}
        assert {p["sum"] for p in placed} == {sum(range(world))}

        # One rank fails while the others go on: its traceback comes back, the rest are killed.
        with pytest.raises(RankFailed) as failed:
            cluster.run_ranks(
                "shoal.testing.cluster.scenarios:sleep_or_fail",
                RANKS_PER_HOST,
                {"bad_rank": 3},
                timeout=60,
                grace=2,
            )
        message = str(failed.value)
        assert "rank 3 (host h1) failed" in message and "ValueError: rank 3 fails on purpose" in message
        assert "rank 0 (host h0) wrote no result" in message
        assert _processes_in(cluster) == []

        # Every rank hangs: all are killed at the timeout.
        with pytest.raises(RankFailed, match=r"ranks timed out after 3(\.0)? s"):
            cluster.run_ranks(cluster_scenarios.sleep_or_fail, RANKS_PER_HOST, {"sleep": 600}, timeout=3)
        assert _processes_in(cluster) == []
