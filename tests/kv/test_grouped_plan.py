"""The grouped read's pure plans: every need met once, reads balanced, DRAM blocks never on the fabric."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.errors import ConfigError
from shoal.kv._grouped_plan import (
    GroupedReadPlan,
    RankWants,
    Want,
    plan_grouped_deliveries,
    plan_grouped_read,
)


def _size(digest: str) -> int:
    return 4096 * (1 + int(digest[1:]) % 3)


def _wants(
    hosts: list[str], needs: list[list[str]], dram: set[tuple[str, str]] | None = None
) -> list[RankWants]:
    """RankWants per rank: ``needs[r]`` with sizes from the digest, DRAM as ``(host, digest)``."""
    dram = dram or set()
    return [
        RankWants(h, tuple(Want(d, _size(d), (h, d) in dram) for d in ds))
        for h, ds in zip(hosts, needs, strict=True)
    ]


def _check_plan(wants: list[RankWants], plan: GroupedReadPlan) -> None:
    """The invariants every plan keeps (what the protocol relies on)."""
    world = len(wants)
    wanted = {(r, w.digest) for r, rw in enumerate(wants) for w in rw.wants}
    in_dram = {(r, w.digest) for r, rw in enumerate(wants) for w in rw.wants if w.in_dram}
    met: Counter[tuple[int, str]] = Counter()
    reads: Counter[tuple[int, str]] = Counter()
    for b in plan.blocks:
        assert (b.reader, b.digest) in wanted, (
            "a reader always wants the block (it reads into its own buffer)"
        )
        assert b.from_dram == bool(b.local)
        if b.from_dram:
            assert b.reader in b.local
        for r in b.local:
            assert (r, b.digest) in in_dram
        for r in b.receivers:
            assert (r, b.digest) not in in_dram, (
                "a block in a rank's host DRAM never crosses the fabric to it"
            )
            assert r != b.reader
        for r in {b.reader, *b.local}:
            reads[(r, b.digest)] += 1
        for r in {b.reader, *b.local, *b.receivers}:
            met[(r, b.digest)] += 1
    assert set(met) == wanted and all(n == 1 for n in met.values()), "every need met exactly once"
    assert all(n == 1 for n in reads.values()), "no rank reads a block twice"
    for r in range(world):
        got = sorted(b.digest for b in plan.reads_at(r))
        assert got == sorted(d for (rr, d) in reads if rr == r)
    _check_balance(wants, plan)


def _check_balance(wants: list[RankWants], plan: GroupedReadPlan) -> None:
    """Each rank's slow-tier bytes, less its last block, are at most those of any rank that wanted that
    block and did not hold it: the greedy's "within one block" bound."""
    load = plan.slow_bytes()
    holders = {(r, w.digest) for r, rw in enumerate(wants) for w in rw.wants if w.in_dram}
    candidates: dict[str, list[int]] = {}
    for r, rw in enumerate(wants):
        for w in rw.wants:
            candidates.setdefault(w.digest, []).append(r)
    order = sorted((b for b in plan.blocks if not b.from_dram), key=lambda b: (-b.nbytes, b.digest))
    last = {b.reader: b for b in order}
    for r, b in last.items():
        for c in candidates[b.digest]:
            if (c, b.digest) not in holders:
                assert load[r] - b.nbytes <= load[c], (r, c, b.digest, load)


def test_every_rank_wanting_every_block_reads_an_even_share() -> None:
    blocks = [f"b{i:03d}" for i in range(64)]
    wants = [RankWants("h0", tuple(Want(d, 1 << 20) for d in blocks)) for _ in range(4)]
    plan = plan_grouped_read(wants)
    _check_plan(wants, plan)
    assert plan.slow_bytes() == [16 << 20] * 4
    assert plan.fabric_receives() == 64 * 3


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ranks_wanting_the_same_blocks_of_mixed_sizes_read_within_one_block_of_an_even_share(
    world: int,
) -> None:
    rng = random.Random(world)
    blocks = [Want(f"b{i:03d}", rng.choice([1, 2, 3, 5, 8]) << 16) for i in range(64)]
    plan = plan_grouped_read([RankWants(f"h{r % 2}", tuple(blocks)) for r in range(world)])
    ideal = sum(w.nbytes for w in blocks) / world
    assert max(plan.slow_bytes()) <= ideal + max(w.nbytes for w in blocks)
    assert min(plan.slow_bytes()) >= ideal - max(w.nbytes for w in blocks)
    assert sum(plan.slow_bytes()) == sum(w.nbytes for w in blocks), "each block read once"


def test_a_block_one_rank_wants_is_read_by_it_and_never_sent() -> None:
    plan = plan_grouped_read(_wants(["h0", "h0"], [["b1"], ["b2"]]))
    assert [(b.digest, b.reader, b.receivers) for b in plan.blocks] == [("b1", 0, ()), ("b2", 1, ())]


def test_a_block_in_a_hosts_dram_is_read_there_and_served_to_the_other_host() -> None:
    hosts = ["h0", "h0", "h1", "h1"]
    plan = plan_grouped_read(_wants(hosts, [["b1"]] * 4, dram={("h0", "b1")}))
    (b,) = plan.blocks
    assert b.local == (0, 1) and b.from_dram and b.reader in (0, 1)
    assert b.receivers == (2, 3)
    assert plan.slow_bytes() == [0, 0, 0, 0], "no read below DRAM when a wanting host holds it"


def test_ranks_that_disagree_on_a_size_get_a_conflict_and_nothing_is_read() -> None:
    wants = [RankWants("h0", (Want("b1", 10),)), RankWants("h0", (Want("b1", 20), Want("b2", 5)))]
    plan = plan_grouped_read(wants)
    assert [b.digest for b in plan.blocks] == ["b2"]
    (c,) = plan.conflicts
    assert c.sizes == ((0, 10), (1, 20)) and "rank 0: 10 bytes" in c.message()


def test_a_rank_listing_a_block_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="twice"):
        plan_grouped_read([RankWants("h0", (Want("b1", 1), Want("b1", 1)))])


def test_plans_for_thousands_of_ranks_and_blocks_keep_every_invariant() -> None:
    rng = random.Random(12)
    world, per_host = 4096, 8
    hosts = [f"h{r // per_host}" for r in range(world)]
    blocks = [f"b{i}" for i in range(3000)]
    needs = []
    for r in range(world):
        # an instance of 8 (one host) shares most of its blocks; some cross hosts
        base = (r // per_host) * 5
        needs.append(sorted({blocks[(base + rng.randrange(40)) % len(blocks)] for _ in range(6)}))
    dram = {(hosts[r], d) for r in range(0, world, 7) for d in needs[r][:1]}
    wants = _wants(hosts, needs, dram)
    plan = plan_grouped_read(wants)
    _check_plan(wants, plan)
    assert plan_grouped_read(wants) == plan, "deterministic"
    delivered = {b.digest: True for b in plan.blocks}
    ex = plan_grouped_deliveries(plan, delivered)
    got = Counter((x.dst, x.digest) for x in (*ex.first, *ex.second))
    assert got == Counter((r, b.digest) for b in plan.blocks for r in b.receivers)


def test_deliveries_skip_blocks_not_read_and_late_ranks() -> None:
    hosts = ["h0", "h0", "h1", "h1"]
    plan = plan_grouped_read(_wants(hosts, [["b1", "b2"]] * 4))
    ok = {b.digest: b.digest == "b1" for b in plan.blocks}
    ex = plan_grouped_deliveries(plan, ok, late=[3])
    moved = {(x.dst, x.digest) for x in (*ex.first, *ex.second)}
    reader = next(b.reader for b in plan.blocks if b.digest == "b1")
    assert moved == {(r, "b1") for r in (0, 1, 2) if r != reader}


def test_each_block_crosses_to_another_host_once() -> None:
    hosts = ["h0", "h0", "h0", "h0", "h1", "h1", "h1", "h1"]
    plan = plan_grouped_read(_wants(hosts, [["b1", "b2", "b3", "b4"]] * 8))
    ex = plan_grouped_deliveries(plan, {b.digest: True for b in plan.blocks})
    crossing = Counter(x.digest for x in (*ex.first, *ex.second) if hosts[x.src] != hosts[x.dst])
    assert crossing == {"b1": 1, "b2": 1, "b3": 1, "b4": 1}


@st.composite
def _cases(draw: st.DrawFn) -> list[RankWants]:
    n_hosts = draw(st.integers(1, 4))
    per_host = draw(st.integers(1, 4))
    hosts = [f"h{r // per_host}" for r in range(n_hosts * per_host)]
    blocks = [f"b{i}" for i in range(draw(st.integers(1, 16)))]
    dram = draw(st.sets(st.tuples(st.sampled_from(sorted(set(hosts))), st.sampled_from(blocks))))
    needs = [sorted(draw(st.sets(st.sampled_from(blocks)))) for _ in hosts]
    return _wants(hosts, needs, dram)


@settings(max_examples=300, deadline=None)
@given(_cases(), st.data())
def test_any_wants_give_a_plan_that_keeps_every_invariant(
    wants: list[RankWants], data: st.DataObject
) -> None:
    plan = plan_grouped_read(wants)
    _check_plan(wants, plan)
    delivered = {b.digest: data.draw(st.booleans()) for b in plan.blocks}
    late = data.draw(st.sets(st.integers(0, len(wants) - 1)))
    ex = plan_grouped_deliveries(plan, delivered, late)
    got = Counter((x.dst, x.digest) for x in (*ex.first, *ex.second))
    want = Counter(
        (r, b.digest) for b in plan.blocks if delivered[b.digest] for r in b.receivers if r not in late
    )
    assert got == want, "each delivered block reaches every receiver that is in time, once"
    for x in (*ex.first, *ex.second):
        assert (x.dst, x.digest) not in {(r, b.digest) for b in plan.blocks for r in b.local}
