"""The emulated cluster (shoal.testing.cluster.hosts): namespaces, shaped links, a real S3, nothing left
behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shoal.testing.cluster.hosts import PREFIX, Cluster, ClusterSpec, cannot_run, remove_leftovers

WHY = cannot_run()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")

MIB = 1 << 20


def _ours(run_id: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    mine = f"{PREFIX}{run_id}-"
    return [line.split()[0] for line in out.splitlines() if line.startswith(mine)]


MAKE_BUCKET = """
import os, sys
from shoal.testing.s3 import S3Admin
S3Admin(os.environ["SHOAL_S3_ENDPOINT"]).create_bucket(sys.argv[1])
"""

PUT_GET = """
import os, sys, s3fs
from shoal.testing.s3 import s3_storage_options
fs = s3fs.S3FileSystem(**s3_storage_options(os.environ["SHOAL_S3_ENDPOINT"]))
host = os.environ["SHOAL_HOST_ID"]
bucket = sys.argv[1]
data = os.urandom(int(sys.argv[2]))
fs.pipe(f"{bucket}/{host}", data)
assert fs.cat(f"{bucket}/{host}") == data
print(host, len(data))
"""


def test_hosts_reach_s3_over_their_own_storage_nic_and_nothing_is_left() -> None:
    spec = ClusterSpec(hosts=2, host_storage_mbit=400, fabric_mbit=400, storage_mbit=800)
    with Cluster(spec) as cluster:
        run_id = cluster.run_id
        assert len(_ours(run_id)) == 2 + 2  # switch, storage, two hosts
        for i in range(2):  # each host's links carry a token bucket of the spec's rate
            for dev, rate in (("st0", "400Mbit"), ("fb0", "400Mbit")):
                shown = subprocess.run(
                    ["tc", "-n", cluster.host_ns(i), "qdisc", "show", "dev", dev],
                    capture_output=True, text=True, check=True,
                ).stdout  # fmt: skip
                assert "tbf" in shown and f"rate {rate}" in shown, shown
        made = cluster.run_on(0, [sys.executable, "-c", MAKE_BUCKET, "cluster-test"])
        assert made.returncode == 0, made.stderr
        pid = cluster.s3_pid()  # the S3 server, the one process of the storage namespace
        assert pid is not None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert b"moto" in f.read()
        before = [cluster.counters(i) for i in range(2)]
        sizes = [3 * MIB, 1 * MIB]
        for i, n in enumerate(sizes):
            done = cluster.run_on(i, [sys.executable, "-c", PUT_GET, "cluster-test", str(n)])
            assert done.returncode == 0, done.stderr
            assert done.stdout.split() == [f"h{i}", str(n)]
        after = [cluster.counters(i) for i in range(2)]
        for i, n in enumerate(sizes):
            sent = after[i].storage_tx - before[i].storage_tx
            got = after[i].storage_rx - before[i].storage_rx
            # Each host's object went out and came back through its own storage NIC (plus HTTP and
            # TCP overhead), and nothing of it crossed the fabric.
            assert n <= sent < n * 1.2 + 256 * 1024, (i, sent)
            assert n <= got < n * 1.2 + 256 * 1024, (i, got)
            assert after[i].fabric_tx - before[i].fabric_tx < 64 * 1024
    assert _ours(run_id) == []


def test_hosts_talk_over_the_fabric() -> None:
    with Cluster(ClusterSpec(hosts=2)) as cluster:
        server = cluster.popen_in(
            cluster.host_ns(1),
            [sys.executable, "-c", "import socket; s = socket.create_server(('" + cluster.fabric_addr(1)
             + "', 29500)); c, _ = s.accept(); c.sendall(c.recv(5)[::-1]); c.close()"],
        )  # fmt: skip
        client = (
            "import socket, sys, time\n"
            "for _ in range(100):\n"
            "    try:\n"
            f"        c = socket.create_connection(({cluster.fabric_addr(1)!r}, 29500), timeout=2); break\n"
            "    except OSError: time.sleep(0.05)\n"
            "c.sendall(b'hello'); print(c.recv(5).decode())\n"
        )
        done = cluster.run_on(0, [sys.executable, "-c", client], timeout=30)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "olleh"
        assert server.wait(timeout=10) == 0


def test_a_dead_runs_namespaces_are_removed_at_the_next_start() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{PREFIX}{dead.pid}-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in remove_leftovers(keep_pid=os.getpid())
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, check=False)
    assert _ours(str(dead.pid)) == []


def test_the_command_line_runs_a_command_on_every_host() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "shoal.testing.cluster.hosts", "--hosts", "2", "--", sys.executable, "-c",
         "import os; os.write(1, f\"on {os.environ['SHOAL_HOST_ID']}\\n\".encode())"],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "on h0" in done.stdout and "on h1" in done.stdout
    assert "h1: LinkCounters(" in done.stdout


def test_run_ranks_on_the_first_hosts_only() -> None:
    with Cluster(ClusterSpec(hosts=3)) as cluster:
        placed = cluster.run_ranks("shoal.testing.cluster.scenarios:all_reduce_placement", 2, hosts=2)
        assert [(p["rank"], p["world"], p["host"]) for p in placed] == [
            (0, 4, "h0"), (1, 4, "h0"), (2, 4, "h1"), (3, 4, "h1"),
        ]  # fmt: skip
        assert {p["sum"] for p in placed} == {0 + 1 + 2 + 3}
        for bad in (0, 4):
            with pytest.raises(ValueError, match=r"hosts must be in 1\.\.3"):
                cluster.run_ranks("shoal.testing.cluster.scenarios:all_reduce_placement", 1, hosts=bad)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning apart needs at least two CPUs")
def test_the_storage_side_and_the_job_run_on_the_cpus_the_spec_gives_them() -> None:
    from shoal.testing.cluster.load import BackgroundLoad

    storage, job = sorted(os.sched_getaffinity(0))[-1], sorted(os.sched_getaffinity(0))[0]
    spec = ClusterSpec(hosts=2, storage_cpus=(storage,), job_cpus=(job,))
    with Cluster(spec) as cluster:
        s3 = cluster.s3_pid()
        assert s3 is not None and os.sched_getaffinity(s3) == {storage}
        with BackgroundLoad(cluster, host=1, writers=1, object_mib=0.25, pause=0.5) as load:
            # The tenant is in host 1's namespace once `ip netns exec` has joined it, a moment after
            # it started (on a busy machine, a long one): wait for it there, not for a set time.
            pids: list[str] = []
            for _ in range(1200):  # at most 120 s: it only runs out when the tenant never got there
                pids = subprocess.run(
                    ["ip", "netns", "pids", cluster.host_ns(1)], capture_output=True, text=True, check=True
                ).stdout.split()
                if pids or not load.running():
                    break
                time.sleep(0.1)
            assert len(pids) == 1
            assert os.sched_getaffinity(int(pids[0])) == {storage}
        placed = cluster.run_ranks("shoal.testing.cluster.scenarios:all_reduce_placement", 1, hosts=1)
        assert placed[0]["cpus"] == [job]


def test_a_spec_with_cpus_this_process_cannot_use_is_refused() -> None:
    with pytest.raises(ValueError, match="ClusterSpec.job_cpus must be a non-empty set"):
        ClusterSpec(job_cpus=(max(os.sched_getaffinity(0)) + 1000,))
    with pytest.raises(ValueError, match="ClusterSpec.storage_cpus"):
        ClusterSpec(storage_cpus=())
