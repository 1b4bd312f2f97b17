"""The serving simulator of the KV replay: the layout's bytes, the per-request accounting of every
policy, and shoal's DRAM hits against the exact LRU simulation of the same trace and capacity."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shoal.errors import ShoalError
from shoal.testing.bench.kv_serving import (
    QWEN25_14B,
    PerKeyFallback,
    ServingConfig,
    ShoalPolicy,
    make_policy,
    scaled_link_mbit,
    serve_requests,
    summarize,
)
from shoal.testing.bench.kv_trace import load_trace, prefix_chains, simulate_lru

BLOCK = 4096


def _trace(path: Path, seed: int = 1, requests: int = 60, block_tokens: int = 512) -> str:
    """Conversations that grow turn by turn (each turn's prompt extends the last), some sharing a
    system prompt: the reuse a conversation trace has."""
    rng = random.Random(seed)
    convs: list[list[int]] = [[] for _ in range(6)]
    next_id, lines = 100, []
    for i in range(requests):
        conv = convs[rng.randrange(len(convs))]
        for _ in range(rng.randint(1, 3)):
            conv.append(next_id)
            next_id += 1
        ids = [1, 2, *conv] if i % 3 else list(conv)
        tokens = block_tokens * len(ids) - rng.randrange(block_tokens * 25 // 32)
        lines.append({"timestamp": 10 * i, "input_length": tokens, "output_length": 5, "hash_ids": ids})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def _config(tmp_path: Path, trace: str, policy: str, **kw: Any) -> ServingConfig:
    base = ServingConfig(
        policy=policy,
        trace=trace,
        minutes=30.0,
        speedup=1e6,
        per_token_s=1e-6,
        block_bytes=BLOCK,
        dram_blocks=12,
        namespace=QWEN25_14B.namespace,
        dram_root=str(tmp_path / "dram"),
        overlap_puts=False,
    )
    return replace(base, **kw)


def _replay(cfg: ServingConfig, instances: int = 1) -> dict[str, Any]:
    reqs = load_trace(cfg.trace, block_tokens=cfg.block_tokens)
    policy = make_policy(cfg, instances)
    try:
        return serve_requests(reqs, policy, cfg, t0=0.0, origin_ms=reqs[0].timestamp_ms)
    finally:
        policy.close()


def test_the_default_layout_is_qwen25_14b_in_bf16() -> None:
    assert QWEN25_14B.bytes_per_token == 196_608
    assert QWEN25_14B.block_bytes == 96 << 20
    assert replace(QWEN25_14B, tp=8).block_bytes == 12 << 20
    assert QWEN25_14B.namespace == "qwen2.5-14b/bf16-L48-H8-D128-B512-TP1"


def _dram_replay(tmp_path: Path, extra: int) -> tuple[list[int], list[int], dict[str, Any]]:
    """A pool that holds the longest request plus ``extra`` blocks (in the benchmark it holds
    thousands of requests) and fewer blocks than the trace has: the store's DRAM hits per request
    and the LRU simulation's."""
    trace = _trace(tmp_path / "t.jsonl")
    reqs = load_trace(trace)
    capacity = max(r.blocks for r in reqs) + extra
    assert capacity < len(set().union(*prefix_chains(reqs)))  # something is evicted
    out = _replay(_config(tmp_path, trace, "shoal", dram_blocks=capacity))
    sim = simulate_lru(prefix_chains(reqs), capacity, backed=False)
    got = [r["fetched"].get("dram", 0) for r in out["records"]]
    tiers = out["policy"]["tiers"]
    assert tiers["dram"]["bytes_used"] <= tiers["dram"]["capacity"]
    assert out["policy"]["wrong"] == 0
    return got, sim.dram_hits, out


@pytest.mark.parametrize("extra", [0, 5, 30])
def test_shoal_dram_hits_equal_the_lru_simulation_hit_for_hit(tmp_path: Path, extra: int) -> None:
    """Request by request (222 hits at 29 blocks, 269 at 34, 340 at 59)."""
    got, want, _ = _dram_replay(tmp_path, extra)
    assert sum(want) > 0
    assert got == want


def test_shoal_with_a_local_tier_fetches_every_prefix_ever_stored(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", seed=2)
    cfg = _config(tmp_path, trace, "shoal", dram_blocks=4, local_root=str(tmp_path / "local"))
    out = _replay(cfg)
    sim = simulate_lru(prefix_chains(load_trace(trace)), 4, backed=True)
    records = out["records"]
    assert [sum(r["fetched"].values()) for r in records] == sim.prefix
    assert sum(r["fetched"].get("local", 0) for r in records) > 0


def test_the_per_key_fallback_reads_its_storage_block_by_block(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", seed=3)
    cfg = _config(tmp_path, trace, "perkey", dram_blocks=8, shared_url=str(tmp_path / "storage"))
    out = _replay(cfg, instances=2)  # the fallback's private LRU gets 8 // 2 blocks
    sim = simulate_lru(prefix_chains(load_trace(trace)), 0, backed=True)
    records = out["records"]
    assert [sum(r["fetched"].values()) for r in records] == sim.prefix
    stats = out["policy"]
    assert stats["wrong"] == 0 and stats["writes"] == len(set().union(*prefix_chains(load_trace(trace))))
    assert stats["reads"] == sum(r["fetched"].get("shared", 0) for r in records)


def test_a_wrong_block_on_the_storage_is_never_counted_as_a_hit(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", seed=4, requests=10)
    cfg = _config(tmp_path, trace, "perkey", dram_blocks=0, shared_url=str(tmp_path / "storage"))
    policy = make_policy(cfg, 1)
    assert isinstance(policy, PerKeyFallback)
    from shoal.kv import chain_keys

    keys = chain_keys(cfg.namespace, 0, [7, 8])
    policy.store(keys)
    assert policy.fetch(keys) == ["shared", "shared"]
    policy.tier.write(keys[1].digest, b"\0" * BLOCK)  # another block's bytes under this key
    assert policy.fetch(keys) == ["shared"]
    assert policy.counts["wrong"] == 1
    policy.close()


@pytest.mark.parametrize("policy", ["recompute", "perkey", "shoal"])
def test_every_block_is_fetched_or_recomputed(tmp_path: Path, policy: str) -> None:
    trace = _trace(tmp_path / "t.jsonl", seed=5)
    cfg = _config(tmp_path, trace, policy, shared_url=str(tmp_path / "s") if policy == "perkey" else None)
    out = _replay(cfg)
    reqs = load_trace(trace)
    for req, r in zip(reqs, out["records"], strict=True):
        assert r["blocks"] == req.blocks == sum(r["fetched"].values()) + r["recomputed"]
        cached = min(512 * sum(r["fetched"].values()), req.input_length)
        assert r["uncached_tokens"] == req.input_length - cached
        assert r["ttft"] >= r["fetch"] + r["prefill"] - 1e-9
    if policy == "recompute":
        assert all(not r["fetched"] for r in out["records"])
    rep = summarize([out], cfg, 96 << 20)
    assert rep["requests"] == len(reqs)
    assert rep["recomputed_ratio"] + sum(rep["hit_ratio"].values()) == pytest.approx(1.0)


def test_summarize_refuses_inconsistent_accounting(tmp_path: Path) -> None:
    cfg = _config(tmp_path, _trace(tmp_path / "t.jsonl"), "recompute")
    bad = {"records": [{"ttft": 1, "queue": 0, "fetch": 0, "prefill": 1, "blocks": 3, "fetched": {"dram": 1},
                        "recomputed": 1, "uncached_tokens": 5}], "put_seconds": 0, "writer_waited": 0,
           "policy": {}}  # fmt: skip
    with pytest.raises(ShoalError, match="3 blocks but 1 recomputed"):
        summarize([bad], cfg, 1)


def test_shoal_overlapping_puts_still_stores_every_block(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", seed=6)
    cfg = _config(tmp_path, trace, "shoal", dram_blocks=1000, overlap_puts=True)
    policy = make_policy(cfg, 1)
    assert isinstance(policy, ShoalPolicy)
    reqs = load_trace(trace)
    try:
        serve_requests(reqs, policy, cfg, t0=0.0, origin_ms=0)
        distinct = len(set().union(*prefix_chains(reqs)))
        assert policy.store_.stats().tiers["dram"].blocks == distinct
    finally:
        policy.close()


def test_a_trace_of_other_block_sizes_is_replayed_with_its_own_tokens_per_block(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", seed=5, block_tokens=64)
    with pytest.raises(ShoalError, match="ceil"):
        load_trace(trace)  # read as 512-token blocks, its hash_ids do not add up: refused, naming the line
    cfg = _config(
        tmp_path, trace, "shoal", dram_blocks=4, local_root=str(tmp_path / "local"), block_tokens=64
    )
    out = _replay(cfg)
    reqs = load_trace(trace, block_tokens=64)
    sim = simulate_lru(prefix_chains(reqs), 4, backed=True)
    assert [sum(r["fetched"].values()) for r in out["records"]] == sim.prefix
    for req, r in zip(reqs, out["records"], strict=True):
        assert r["uncached_tokens"] == max(0, req.input_length - 64 * sum(r["fetched"].values()))
    with pytest.raises(ShoalError, match="block_tokens"):
        replace(cfg, block_tokens=0)


def test_a_full_scale_link_is_shaped_to_its_bandwidth_times_speedup_over_the_byte_scale() -> None:
    # 10 GB/s at full scale, 96 MiB blocks stored as 64 KiB (scale 1536), the trace's own clock:
    # 10e9 / 1536 B/s = 52.1 mbit/s; ten times faster, ten times the rate.
    assert scaled_link_mbit(10.0, 1.0, 1536) == pytest.approx(52.083, rel=1e-4)
    assert scaled_link_mbit(10.0, 10.0, 1536) == pytest.approx(520.83, rel=1e-4)
    with pytest.raises(ShoalError, match="byte_scale"):
        scaled_link_mbit(10.0, 1.0, 0)
