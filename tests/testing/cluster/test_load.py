"""Storage weather and background load on the emulated cluster."""

from __future__ import annotations

import subprocess
import time

import pytest

from shoal.testing.cluster.hosts import Cluster, ClusterSpec, cannot_run
from shoal.testing.cluster.load import BackgroundLoad, Weather, set_storage_rate

WHY = cannot_run()
MIB = 1 << 20


def _rate_shown(cluster: Cluster) -> str:
    return subprocess.run(
        ["tc", "-n", cluster.ns("st"), "qdisc", "show", "dev", "eth0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_a_random_walk_is_the_same_for_a_seed_and_stays_within_its_bounds() -> None:
    walk = Weather(cluster=None, seed=3, low_mbit=50, high_mbit=400).rates()  # type: ignore[arg-type]
    again = Weather(cluster=None, seed=3, low_mbit=50, high_mbit=400).rates()  # type: ignore[arg-type]
    other = Weather(cluster=None, seed=4, low_mbit=50, high_mbit=400).rates()  # type: ignore[arg-type]
    assert walk == again and walk != other
    assert all(50 <= r <= 400 for r, _ in walk)
    assert len({r for r, _ in walk[:50]}) > 10  # it moves


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_weather_reshapes_the_storage_link_in_its_regimes() -> None:
    with Cluster(ClusterSpec(hosts=1, storage_mbit=400)) as cluster:
        assert "rate 400Mbit" in _rate_shown(cluster)
        set_storage_rate(cluster, 123)
        assert "rate 123Mbit" in _rate_shown(cluster)
        with Weather(cluster, regimes=[(100, 0.05), (300, 0.05)]) as weather:
            deadline = time.monotonic() + 120  # generous: it only runs out when the weather is stuck
            while len(weather.timeline) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert [r for _, r in weather.timeline[:4]] == [100, 300, 100, 300]
        assert f"rate {int(weather.timeline[-1][1])}Mbit" in _rate_shown(cluster)
        with pytest.raises(ValueError, match="must be > 0"):
            set_storage_rate(cluster, 0)


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_background_load_moves_bytes_through_its_own_host_and_stops() -> None:
    with Cluster(ClusterSpec(hosts=2, host_storage_mbit=400, storage_mbit=800)) as cluster:
        before = cluster.counters(1)
        with BackgroundLoad(cluster, host=1, writers=1, readers=1, object_mib=1) as load:
            deadline = time.monotonic() + 120  # generous: it only runs out when no bytes move
            while time.monotonic() < deadline:
                now = cluster.counters(1)
                if (
                    now.storage_tx - before.storage_tx > 3 * MIB
                    and now.storage_rx - before.storage_rx > 3 * MIB
                ):
                    break
                time.sleep(0.1)
            assert load.running() == 2
        after = cluster.counters(1)
        assert after.storage_tx - before.storage_tx > 3 * MIB
        assert after.storage_rx - before.storage_rx > 3 * MIB
        assert cluster.counters(0).storage_tx < 256 * 1024  # the tenant's host, not the others
        assert load.running() == 0
