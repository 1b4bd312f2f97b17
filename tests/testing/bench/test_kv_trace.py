"""The trace side of the KV replay: loading and validating traces, the window, prefix chains, the
exact LRU simulation (against a brute-force reference with explicit clocks) and the accounting."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from shoal.testing.bench.kv_trace import (
    TraceError,
    TraceRequest,
    _Lru,
    account,
    load_trace,
    prefix_chains,
    simulate_lru,
    trace_summary,
    window,
)

SHIPPED = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "mooncake"


def _write(path: Path, rows: list[object]) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _req(ts: int, ids: list[Any], tokens: int | None = None) -> dict[str, object]:
    return {"timestamp": ts, "input_length": tokens or 512 * len(ids), "output_length": 7, "hash_ids": ids}


def test_load_trace_reads_every_field(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [_req(0, [1, 2], 700), "", _req(5, [1, 3, 4])])
    reqs = load_trace(path)
    assert reqs == [TraceRequest(1, 0, 700, 7, (1, 2)), TraceRequest(3, 5, 1536, 7, (1, 3, 4))]


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{not json", ["t.jsonl:2", "not JSON"]),
        ("[1, 2]", ["t.jsonl:2", "JSON object"]),
        (json.dumps({"timestamp": 1, "input_length": 5, "output_length": 1}), ["t.jsonl:2", "hash_ids"]),
        (json.dumps(_req(1, [1, 2], 512)), ["t.jsonl:2", "2 hash_ids", "ceil(512 / 512) = 1"]),
        (json.dumps(_req(1, [1, "x"])), ["t.jsonl:2", "list of integers"]),
        (json.dumps({**_req(1, [1]), "timestamp": -3}), ["t.jsonl:2", "'timestamp'", ">= 0"]),
        (json.dumps({**_req(1, [1]), "output_length": True}), ["t.jsonl:2", "'output_length'"]),
        (json.dumps(_req(0, [])), ["t.jsonl:2", "'input_length' must be >= 1"]),
    ],
)
def test_a_bad_line_is_refused_naming_the_line_and_field(tmp_path: Path, line: str, words: list[str]) -> None:
    path = _write(tmp_path / "t.jsonl", [_req(0, [1]), line])
    with pytest.raises(TraceError) as e:
        load_trace(path)
    for w in words:
        assert w in str(e.value)


def test_timestamps_must_not_decrease_and_a_trace_must_not_be_empty(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"t.jsonl:2: timestamp 3 ms is before line 1's 9 ms"):
        load_trace(_write(tmp_path / "t.jsonl", [_req(9, [1]), _req(3, [2])]))
    with pytest.raises(TraceError, match="no requests"):
        load_trace(_write(tmp_path / "e.jsonl", []))
    with pytest.raises(TraceError, match="cannot be read"):
        load_trace(str(tmp_path / "missing.jsonl"))


def test_window_keeps_the_first_minutes_from_the_first_request() -> None:
    reqs = [TraceRequest(i + 1, ts, 1, 1, (i,)) for i, ts in enumerate([1000, 60_999, 61_000, 200_000])]
    assert [r.timestamp_ms for r in window(reqs, 1)] == [1000, 60_999]
    assert len(window(reqs, 10)) == 4
    with pytest.raises(TraceError):
        window(reqs, 0)


def test_prefix_chains_name_whole_prefixes() -> None:
    reqs = [
        TraceRequest(1, 0, 1, 1, (1, 2, 3)),
        TraceRequest(2, 0, 1, 1, (1, 2, 9)),
        TraceRequest(3, 0, 1, 1, (5, 2)),
    ]
    a, b, c = prefix_chains(reqs)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert c[1] != a[1]  # the same id after a different prefix is another block
    assert trace_summary(reqs)["distinct_blocks"] == 6


def _reference_lru(chains: list[list[int]], capacity: int, backed: bool) -> tuple[list[int], list[int]]:
    """Brute force, with explicit clocks as the store's index keeps them: each block has (atime,
    -depth); a batch touched or put at one instant shares its atime, depth is the block's place in
    that batch; eviction takes the smallest pair among the blocks the current put does not list."""
    clock = 0
    rows: dict[int, tuple[int, int]] = {}
    stored: set[int] = set()
    prefixes, hits = [], []

    def put(batch: list[int]) -> None:
        nonlocal clock
        clock += 1
        for depth, b in enumerate(batch):
            if b in rows:
                continue
            if len(rows) >= capacity:
                others = [x for x in rows if x not in batch]
                if not others:
                    continue  # only this batch's blocks are left: the block does not fit
                del rows[min(others, key=lambda x: rows[x])]
            rows[b] = (clock, -depth)

    for chain in chains:
        have = stored if backed else set(rows)
        k = next((i for i, b in enumerate(chain) if b not in have), len(chain))
        in_dram = [b for b in chain[:k] if b in rows]
        clock += 1
        for depth, b in enumerate(in_dram):
            rows[b] = (clock, -depth)
        for b in chain[:k]:
            if b not in rows:
                put([b])
        put(list(chain[k:]))
        stored.update(chain)
        prefixes.append(k)
        hits.append(len(in_dram))
    return prefixes, hits


def _random_chains(seed: int, conversations: int = 12, requests: int = 80) -> list[list[int]]:
    rng = random.Random(seed)
    convs: list[list[int]] = [[] for _ in range(conversations)]
    reqs: list[TraceRequest] = []
    next_id = 0
    for _ in range(requests):
        conv = convs[rng.randrange(conversations)]
        for _ in range(rng.randint(1, 4)):
            conv.append(next_id)
            next_id += 1
        shared = [-1, -2][: rng.randint(0, 2)]  # a system prompt some requests share
        reqs.append(TraceRequest(len(reqs) + 1, len(reqs), 1, 1, tuple(shared + conv)))
    return prefix_chains(reqs)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("capacity", [0, 1, 3, 10, 40])
@pytest.mark.parametrize("backed", [False, True])
def test_simulate_lru_matches_a_brute_force_reference(seed: int, capacity: int, backed: bool) -> None:
    chains = _random_chains(seed)
    got = simulate_lru(chains, capacity, backed=backed)
    prefixes, hits = _reference_lru(chains, capacity, backed)
    assert got.prefix == prefixes
    assert got.dram_hits == hits
    assert got.blocks == sum(len(c) for c in chains)
    assert all(h <= p for h, p in zip(got.dram_hits, got.prefix, strict=True))


def test_a_batch_is_evicted_tail_first_and_a_put_keeps_the_present_blocks_it_lists() -> None:
    """The store's rules: a batch (a prefix, head first) touched or stored at one instant sits at
    the MRU end tail first; a put never evicts a block it lists, present or new."""
    lru = _Lru(4)
    lru.put([0])
    lru.put([1, 2])
    assert list(lru.order) == [0, 2, 1]
    lru.put([4, 5])  # evicts 0, the LRU block: 1 and 2 are a tail without its head
    assert list(lru.order) == [2, 1, 5, 4]
    lru.put([0, 1, 2, 3])  # 0 and 3 evict 5 and 4, never the present 1 and 2
    assert list(lru.order) == [2, 1, 3, 0]
    lru.touch([0, 1, 2, 3])
    assert list(lru.order) == [3, 2, 1, 0]
    lru.put([7, 8, 9, 6, 5])  # the rest of the batch does not fit once only its own are left
    assert list(lru.order) == [6, 9, 8, 7]


def test_an_unbounded_pool_hits_every_block_seen_before() -> None:
    chains = _random_chains(3)
    everything = simulate_lru(chains, 10**6, backed=False)
    distinct = len({b for c in chains for b in c})
    assert sum(everything.dram_hits) == everything.blocks - distinct


def test_account_splits_every_block_into_fetched_or_recomputed() -> None:
    req = TraceRequest(4, 0, 1300, 1, (1, 2, 3))  # the last block holds 276 tokens
    a = account(req, ["dram", "local"])
    assert (a.fetched, a.recomputed, a.cached_tokens, a.uncached_tokens) == (
        {"dram": 1, "local": 1},
        1,
        1024,
        276,
    )
    whole = account(req, ["dram", "dram", "shared"])
    assert (whole.recomputed, whole.cached_tokens, whole.uncached_tokens) == (0, 1300, 0)
    cut = account(req, ["dram", None, "dram"])  # a gap ends the usable prefix
    assert (cut.fetched, cut.recomputed) == ({"dram": 1}, 2)
    with pytest.raises(ValueError, match="line 4"):
        account(req, ["dram"] * 4)


def test_the_shipped_trace_loads_with_its_notice() -> None:
    reqs = load_trace(os.fspath(SHIPPED / "conversation_trace.jsonl"))
    assert len(reqs) == 12031
    assert len(window(reqs, 30)) == 5719
    assert "Apache License 2.0" in (SHIPPED / "README.md").read_text()
