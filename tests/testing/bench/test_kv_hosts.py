"""The KV replay across hosts, in real processes: two simulated hosts of one TP 2 instance each.

A conversation's turns alternate between the hosts (round-robin over the instances), so a turn
finds its prefix in the other host's pool: shoal fetches it over the fabric path, verified, and
the instance's two ranks read each block once between them and end up with the same bytes."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from shoal.testing.bench.kv_serving import QWEN25_14B, ServingConfig, replay_instance, summarize
from shoal.testing.multiproc import run_ranks

from .test_kv_serving import _trace

BLOCK = 4096


def _run(tmp_path: Path, policy: str, **kw: Any) -> tuple[ServingConfig, list[dict[str, Any]]]:
    trace = _trace(tmp_path / "t.jsonl", requests=24)
    cfg = ServingConfig(
        policy=policy,
        trace=trace,
        minutes=30.0,
        speedup=50.0,
        per_token_s=1e-5,
        block_bytes=BLOCK,
        dram_blocks=256,
        namespace=QWEN25_14B.namespace,
        dram_root=str(tmp_path / policy / "dram"),
        local_root=str(tmp_path / policy / "local"),
        shared_url=str(tmp_path / policy / "shared") if policy != "shoal" else None,
        staging_blocks=16,
        tp=2,
        record_digests=True,
        start_delay_s=1.0,
        **kw,
    )
    ranks = run_ranks(
        replay_instance, hosts=["h0", "h0", "h1", "h1"], kwargs={"config": asdict(cfg)}, timeout=120
    )
    return cfg, ranks


def test_shoal_fetches_the_other_hosts_blocks_over_the_fabric_and_tp_ranks_get_the_same_bytes(
    tmp_path: Path,
) -> None:
    cfg, ranks = _run(tmp_path, "shoal")
    assert [(r["host"], r["instance"], r["tp_rank"]) for r in ranks] == [
        ("h0", 0, 0), ("h0", 0, 1), ("h1", 1, 0), ("h1", 1, 1),
    ]  # fmt: skip
    row = summarize(ranks, cfg, QWEN25_14B.block_bytes)
    assert row["requests"] == 24  # the leaders' records: one per request
    assert row["hit_ratio"].get("peer", 0) > 0, row["hit_ratio"]
    link = row["peer_link"]
    assert link["blocks"] > 0 and link["corrupt"] == 0 and link["failed"] == 0
    # the instance's ranks served every request with the same bytes
    for leader, other in ((ranks[0], ranks[1]), (ranks[2], ranks[3])):
        assert [r["line"] for r in leader["records"]] == [r["line"] for r in other["records"]]
        assert [r["digest"] for r in leader["records"]] == [r["digest"] for r in other["records"]]
        assert [r["fetched"] for r in leader["records"]] == [r["fetched"] for r in other["records"]]
    # grouped reads: a block from below the first level was read by one rank and sent to the other
    grouped = [r["policy"]["below"]["grouped"] for r in ranks]
    assert sum(g["blocks_received"] for g in grouped) > 0
    assert sum(g["corrupt_received"] for g in grouped) == 0


def test_without_the_fabric_path_the_other_hosts_blocks_are_not_reached(tmp_path: Path) -> None:
    cfg, ranks = _run(tmp_path, "shoal-no-fabric")
    row = summarize(ranks, cfg, QWEN25_14B.block_bytes)
    assert row["hit_ratio"].get("peer", 0) == 0
    assert row["peer_link"]["blocks"] == 0
