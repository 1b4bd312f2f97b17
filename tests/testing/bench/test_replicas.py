"""The pure parts of the "load N replicas" benchmark (shoal.testing.bench.replicas): no cluster needed."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.testing.bench.replicas import (
    LINKS,
    link_fraction,
    load_metrics,
    placement,
    replica_model,
    summarise,
)

MIB = 1 << 20


@pytest.mark.parametrize(
    ("replicas", "expected"),
    [(1, (1, 1)), (2, (2, 1)), (4, (4, 1)), (8, (4, 2)), (12, (4, 3))],
)
def test_replicas_take_one_host_each_then_share_every_host_alike(
    replicas: int, expected: tuple[int, int]
) -> None:
    assert placement(replicas, 4) == expected


def test_a_placement_that_cannot_be_even_is_refused() -> None:
    with pytest.raises(ValueError, match="6 replicas do not spread evenly over 4 hosts"):
        placement(6, 4)
    with pytest.raises(ValueError, match=">= 1"):
        placement(0, 4)


def test_link_fraction_is_payload_over_time_over_the_rate() -> None:
    assert link_fraction(25e6, 1.0, 400) == pytest.approx(0.5)  # 400 Mbit/s = 50 MB/s
    with pytest.raises(ValueError, match="seconds > 0"):
        link_fraction(1, 0.0, 400)


def test_the_model_is_the_same_bytes_every_time_in_the_tensors_asked_for() -> None:
    a, b = replica_model(1, 4), replica_model(1, 4)
    assert sorted(a["model"]) == [f"layer{i:02d}.weight" for i in range(4)]
    assert sum(t.numel() * 4 for t in a["model"].values()) == MIB
    assert all(a["model"][k].equal(b["model"][k]) for k in a["model"])


def _rank(loads: list[tuple[float, int]], *, rank0: bool) -> list[dict[str, Any]]:
    """A rank's records: (seconds, storage bytes received) per load, the first a warm-up."""
    out = []
    for k, (seconds, storage) in enumerate(loads):
        rec: dict[str, Any] = {
            "warmup": k == 0,
            "seconds": seconds,
            "cpu_s": 0.5,
            "links": {**dict.fromkeys(LINKS, 0), "storage_rx": storage, "fabric_tx": storage // 2},
        }
        if rank0:
            rec.update(window_s=seconds, cpu_busy_s=1.0, moto_cpu_s=0.1)
        out.append(rec)
    return out


def test_summarise_keeps_the_slowest_rank_and_one_counter_reading_per_host() -> None:
    ranks = [  # two hosts of two ranks: ranks 0 and 2 report their host's counters
        _rank([(9.0, 0), (1.0, 4 * MIB), (2.0, 4 * MIB)], rank0=True),
        _rank([(9.0, 0), (1.5, 99), (1.0, 99)], rank0=False),
        _rank([(9.0, 0), (1.2, 2 * MIB), (1.0, 2 * MIB)], rank0=False),
        _rank([(9.0, 0), (1.0, 99), (3.0, 99)], rank0=False),
    ]
    loads = summarise(ranks, 2)
    assert [x["seconds"] for x in loads] == [1.5, 3.0]  # the warm-up is left out
    assert [h["storage_rx"] for h in loads[0]["hosts"]] == [4 * MIB, 2 * MIB]
    assert loads[0]["ranks_cpu_s"] == 2.0 and loads[0]["cpu_busy_s"] == 1.0
    m = load_metrics(loads, storage_mbit=300, fabric_mbit=400)
    assert m["seconds"] == 2.25 and m["storage"] == [4 * MIB, 2 * MIB] and m["fabric"] == [2 * MIB, MIB]
    assert m["storage_fraction"] == pytest.approx(6 * MIB / 2.25 / 37.5e6)
    assert m["fabric_fraction"] == pytest.approx(2 * MIB / 2.25 / 50e6)


def test_summarise_refuses_ranks_that_disagree_on_the_loads() -> None:
    with pytest.raises(ValueError, match="same loads"):
        summarise([_rank([(1.0, 0)], rank0=True), []], 1)


def test_the_exchange_fraction_is_the_busiest_fabric_link_over_the_exchange_alone() -> None:
    ranks = [_rank([(9.0, 0), (1.0, 4 * MIB), (2.0, 4 * MIB)], rank0=True)]
    for k, exchange in enumerate((5.0, 0.5, 1.5)):
        ranks[0][k]["report"] = {"exchange_seconds": exchange}
    m = load_metrics(summarise(ranks, 1), storage_mbit=300, fabric_mbit=400)
    assert m["exchange_seconds"] == 1.0  # the median of the timed loads' (the warm-up left out)
    assert m["exchange_fraction"] == pytest.approx(2 * MIB / 1.0 / 50e6)
    assert "exchange_seconds" not in load_metrics(
        summarise([_rank([(9.0, 0), (1.0, 0)], rank0=True)], 1), storage_mbit=300, fabric_mbit=400
    )
