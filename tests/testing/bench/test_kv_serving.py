"""The serving simulator of the KV replay: the layout's bytes, the per-request accounting of every
policy, the first level every compared policy shares (the same hits request by request, and the
exact LRU simulation's), and what each fallback below it keeps and reads."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shoal.errors import ConfigError, MissingFile, ShoalError
from shoal.kv import chain_keys
from shoal.testing.bench.kv_serving import (
    FIRST_LEVEL_POLICIES,
    POLICIES,
    QWEN25_14B,
    PerKeyFallback,
    PerObjectStorage,
    ServingConfig,
    ShoalFallback,
    TwoLevelPolicy,
    block_bytes_for,
    make_policy,
    peer_link,
    scaled_link_mbit,
    serve_request,
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


def _below(tmp_path: Path, policy: str) -> dict[str, Any]:
    """What the policy needs below its first level (a storage directory, a local tier)."""
    if policy in ("storage", "private-lru+perkey"):
        return {"shared_url": str(tmp_path / f"{policy}-storage")}
    if policy == "shoal":
        return {"local_root": str(tmp_path / "shoal-local"), "staging_blocks": 8}
    return {}


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


def _first_level_replay(tmp_path: Path, policy: str, trace: str, capacity: int) -> dict[str, Any]:
    cfg = _config(
        tmp_path, trace, policy, dram_blocks=capacity, dram_root=str(tmp_path / policy / "dram"),
        **_below(tmp_path, policy),
    )  # fmt: skip
    out = _replay(cfg)
    first = out["policy"]["first_level"]
    assert first["wrong"] == 0 and first["errors"] == 0
    assert first["dram"]["bytes_used"] <= first["dram"]["capacity"]
    return out


@pytest.mark.parametrize("extra", [0, 5, 30])
def test_the_policies_see_the_same_first_level_hits_request_by_request(tmp_path: Path, extra: int) -> None:
    """One trace, one pool capacity (the longest request plus ``extra`` blocks; fewer than the
    trace's distinct blocks, so the pool evicts): recompute, storage and shoal hit the first level
    in the same requests for the same blocks, as the exact LRU simulation of that pool does, while
    their fallbacks below it differ (storage and shoal serve blocks from below, recompute none)."""
    trace = _trace(tmp_path / "t.jsonl")
    reqs = load_trace(trace)
    chains = prefix_chains(reqs)
    capacity = max(r.blocks for r in reqs) + extra
    assert capacity < len(set().union(*chains))  # something is evicted
    hits: dict[str, list[int]] = {}
    below: dict[str, int] = {}
    for policy in FIRST_LEVEL_POLICIES:
        out = _first_level_replay(tmp_path, policy, trace, capacity)
        records = out["records"]
        hits[policy] = [r["first_level_hits"] for r in records]
        assert hits[policy] == [r["fetched"].get("dram", 0) for r in records]
        below[policy] = sum(sum(r["fetched"].values()) - r["first_level_hits"] for r in records)
    assert hits["recompute"] == hits["storage"] == hits["shoal"]
    assert hits["recompute"] == simulate_lru(chains, capacity, backed=False).dram_hits
    assert sum(hits["recompute"]) > 0
    assert below["recompute"] == 0 and below["storage"] > 0 and below["shoal"] > 0


def test_the_first_level_is_one_pool_for_the_hosts_instances(tmp_path: Path) -> None:
    """Two instances, requests alternating between them (round-robin), one pool: the first-level
    hits of each policy are those of one LRU pool over the whole trace (a block one instance put is
    a hit for the other), the same under every fallback."""
    trace = _trace(tmp_path / "t.jsonl", seed=7)
    reqs = load_trace(trace)
    chains = prefix_chains(reqs)
    capacity = max(r.blocks for r in reqs) + 5
    hits: dict[str, list[int]] = {}
    for policy in FIRST_LEVEL_POLICIES:
        cfg = _config(
            tmp_path, trace, policy, dram_blocks=capacity, dram_root=str(tmp_path / policy / "dram"),
            **_below(tmp_path, policy),
        )  # fmt: skip
        every = {k.digest: k for r in reqs for k in chain_keys(cfg.namespace, 0, r.hash_ids)}
        instances = [make_policy(cfg, 2, every) for _ in range(2)]
        try:
            got = []
            for i, req in enumerate(reqs):
                inst = instances[i % 2]
                assert isinstance(inst, TwoLevelPolicy)
                keys = chain_keys(cfg.namespace, 0, req.hash_ids)
                record = serve_request(req, keys, inst, cfg, time.monotonic())
                inst.first.store_.flush()  # its LRU update lands before the other instance's put
                inst.store(inst.to_store(keys, record["tiers"]))
                got.append(record["first_level_hits"])
        finally:
            for inst in instances:
                inst.close()
        hits[policy] = got
    assert hits["recompute"] == hits["storage"] == hits["shoal"]
    assert hits["recompute"] == simulate_lru(chains, capacity, backed=False).dram_hits
    assert sum(hits["recompute"][1::2]) > 0


@pytest.mark.parametrize("policy", ["storage", "shoal"])
def test_a_fallback_keeps_what_the_first_level_evicts(tmp_path: Path, policy: str) -> None:
    """A first level of 4 blocks (smaller than most requests): every block it evicts or cannot hold
    goes below, so every prefix ever stored is fetched (from the first level or from below)."""
    trace = _trace(tmp_path / "t.jsonl", seed=2)
    out = _first_level_replay(tmp_path, policy, trace, 4)
    records = out["records"]
    sim = simulate_lru(prefix_chains(load_trace(trace)), 4, backed=True)
    assert [sum(r["fetched"].values()) for r in records] == sim.prefix
    lower = "shared" if policy == "storage" else "local"
    assert sum(r["fetched"].get(lower, 0) for r in records) > 0
    stats = out["policy"]
    assert stats["first_level"]["evicted"] > 0 and stats["unknown_evicted"] == 0
    if policy == "storage":
        assert stats["below"]["reads"] == sum(r["fetched"].get("shared", 0) for r in records)
        assert stats["below"]["wrong"] == 0


def test_the_private_lru_fallback_reads_its_storage_block_by_block(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", seed=3)
    cfg = _config(tmp_path, trace, "private-lru+perkey", dram_blocks=8, shared_url=str(tmp_path / "storage"))
    out = _replay(cfg, instances=2)  # the fallback's private LRU gets 8 // 2 blocks
    sim = simulate_lru(prefix_chains(load_trace(trace)), 0, backed=True)
    records = out["records"]
    assert [sum(r["fetched"].values()) for r in records] == sim.prefix
    stats = out["policy"]
    assert stats["wrong"] == 0 and stats["writes"] == len(set().union(*prefix_chains(load_trace(trace))))
    assert stats["reads"] == sum(r["fetched"].get("shared", 0) for r in records)


def test_the_former_perkey_name_is_refused_naming_the_new_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'perkey' is now 'private-lru\\+perkey'.*'storage'"):
        _config(tmp_path, "t.jsonl", "perkey")


def test_a_wrong_block_on_the_storage_is_never_counted_as_a_hit(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.jsonl", seed=4, requests=10)
    cfg = _config(tmp_path, trace, "private-lru+perkey", dram_blocks=0, shared_url=str(tmp_path / "storage"))
    policy = make_policy(cfg, 1)
    assert isinstance(policy, PerKeyFallback)
    keys = chain_keys(cfg.namespace, 0, [7, 8])
    policy.store(keys)
    assert policy.fetch(keys) == ["shared", "shared"]
    policy.tier.write(keys[1].digest, b"\0" * BLOCK)  # another block's bytes under this key
    assert policy.fetch(keys) == ["shared"]
    assert policy.counts["wrong"] == 1
    policy.close()


def test_a_wrong_block_below_the_first_level_is_never_counted_as_a_hit(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "t.jsonl", "storage", dram_blocks=1, shared_url=str(tmp_path / "storage"))
    policy = make_policy(cfg, 1)
    assert isinstance(policy, TwoLevelPolicy) and isinstance(policy.below, PerObjectStorage)
    keys = chain_keys(cfg.namespace, 0, [7, 8, 9])
    assert policy.fetch(keys) == []
    policy.store(keys)  # the pool holds one block; the other two go to the storage, one object each
    policy.below.drain()
    assert policy.below.counts["writes"] == 2
    assert policy.fetch(keys) == ["dram", "shared", "shared"]
    policy.below.tier.write(keys[2].digest, b"\0" * BLOCK)  # another block's bytes under this key
    policy.below._there.discard(keys[2].digest)
    assert policy.fetch(keys) == ["dram", "shared"]
    assert policy.below.counts["wrong"] == 1
    policy.close()


class _GatedStorage:
    """A storage whose writes wait for ``gate`` and fail once for one chosen key; it counts the
    writes in flight."""

    def __init__(self, fail: str) -> None:
        self.objects: dict[str, bytes] = {}
        self.fail = fail
        self.gate = threading.Event()
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def write(self, name: str, data: bytes) -> None:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        assert self.gate.wait(30)
        with self.lock:
            self.in_flight -= 1
            if name == self.fail:
                self.fail = ""
                raise OSError(f"{name}: the storage refused the write")
        self.objects[name] = bytes(data)

    def read(self, name: str) -> bytes:
        if name not in self.objects:
            raise MissingFile(f"{name}: not on the storage")
        return self.objects[name]

    def close(self) -> None:
        return None


def test_the_storage_fallback_writes_its_objects_from_a_pool_off_the_writer_thread() -> None:
    keys = chain_keys("ns", 0, list(range(10, 22)))
    storage = _GatedStorage(fail=keys[3].digest)
    below = PerObjectStorage(storage, BLOCK, write_threads=4)  # type: ignore[arg-type]
    blocks = [block_bytes_for(k, b"\1" * BLOCK) for k in keys]
    below.write_back(keys, blocks)  # returns with every write still waiting: off the writer thread
    deadline = time.monotonic() + 30
    while storage.in_flight < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert storage.in_flight == 4 and not storage.objects
    got: list[list[str]] = []
    reader = threading.Thread(target=lambda: got.append(below.fetch(keys)))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and not got  # a read of a block being written waits for the write
    storage.gate.set()
    reader.join(30)
    assert got == [["shared"] * 3]  # up to the block whose write failed
    below.drain()
    assert storage.most_in_flight == 4
    assert below.counts["writes"] == 11 and below.counts["write_errors"] == 1
    assert below.fetch(keys) == ["shared"] * 3  # up to the block whose write failed
    below.write_back(keys, blocks)  # the failed one is written again; the others are known there
    below.close()
    assert below.counts["writes"] == 12
    assert below.fetch(keys) == ["shared"] * 12
    with pytest.raises(ConfigError, match="write_threads must be an int >= 1"):
        PerObjectStorage(storage, BLOCK, write_threads=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_block_is_fetched_or_recomputed(tmp_path: Path, policy: str) -> None:
    trace = _trace(tmp_path / "t.jsonl", seed=5)
    cfg = _config(tmp_path, trace, policy, **_below(tmp_path, policy))
    out = _replay(cfg)
    reqs = load_trace(trace)
    for req, r in zip(reqs, out["records"], strict=True):
        assert r["blocks"] == req.blocks == sum(r["fetched"].values()) + r["recomputed"]
        cached = min(512 * sum(r["fetched"].values()), req.input_length)
        assert r["uncached_tokens"] == req.input_length - cached
        assert r["ttft"] >= r["fetch"] + r["prefill"] - 1e-9
    if policy == "nocache":
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
    cfg = _config(tmp_path, trace, "shoal", dram_blocks=1000, overlap_puts=True, **_below(tmp_path, "shoal"))
    policy = make_policy(cfg, 1)
    assert isinstance(policy, TwoLevelPolicy) and isinstance(policy.below, ShoalFallback)
    reqs = load_trace(trace)
    try:
        serve_requests(reqs, policy, cfg, t0=0.0, origin_ms=0)
        distinct = len(set().union(*prefix_chains(reqs)))
        assert policy.first.store_.stats().tiers["dram"].blocks == distinct
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


def test_the_fabric_links_use_counts_fetches_that_share_a_link_together(tmp_path: Path) -> None:
    """Two fetches from one holder at once, each at half the rate: the holder's link out was full
    the whole time (use 100%), though each fetch alone saw half of it; a short fetch's round
    trip does not count; a file from before the spans were recorded still reports."""
    cfg = _config(tmp_path, "t.jsonl", "shoal", fabric_mbit=8.0)  # 1 MB/s
    rate = 1e6
    half = int(rate * 0.5)  # each moves 0.5 MB in 1 s

    def rank(host: str, fetches: list[list[Any]]) -> dict[str, Any]:
        peers = {"requests": len(fetches), "blocks": 1, "bytes": 1, "fetches": fetches}
        return {"host": host, "policy": {"below": {"peers": peers}}}

    ranks = [
        rank("a", [["c", half, 1.0, 100.0], ["c", 1000, 0.01, 300.0]]),
        rank("b", [["c", half, 1.0, 100.0]]),
    ]
    out = peer_link(ranks, cfg)
    assert out["fetches"] == 3 and out["large_fetches"] == 2
    assert out["per_fetch_use"] == pytest.approx(0.5)
    # c's link out: busy 1 s with 1 MB (100%); a's and b's links in: 0.5 MB in 1 s each (50%)
    assert out["busy_periods"] == 3
    assert out["link_use_out"] == pytest.approx(1.0) and out["link_use_in"] == pytest.approx(0.5)
    assert out["link_use"] == pytest.approx(1.0)
    old = [rank("a", [["c", half, 1.0]])]  # no start times: each fetch on its own
    assert peer_link(old, cfg)["link_use"] == pytest.approx(0.5)
