"""The save planner without replication: dedup, one owner per new chunk, drain bytes balanced by host."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.group.plan import ChunkRef, GroupPlan, RankChunks

from .planner_helpers import _d, _item, hosts_by_digest, plan_drains, rank


@dataclass(frozen=True)
class Scenario:
    ranks: tuple[RankChunks, ...]
    durable: frozenset[str]
    lengths: dict[str, int]

    def holders(self) -> dict[str, set[str]]:
        """Digest -> hosts holding it."""
        return hosts_by_digest(self.ranks)


@st.composite
def scenarios(draw: st.DrawFn, replicated: bool = False) -> Scenario:
    hosts = draw(st.integers(1, 5))
    per_host = draw(st.integers(1, 3))
    pool = draw(st.integers(1, 30))
    lengths = {_d(i): draw(st.integers(1, 1000)) for i in range(pool)}
    ranks = []
    for r in range(hosts * per_host):
        # Replicated: every rank holds the whole state (data parallel), split into two items.
        ids = list(range(pool)) if replicated else draw(st.lists(st.integers(0, pool - 1), max_size=12))
        cut = draw(st.integers(0, len(ids)))
        parts = (("a", ids[:cut]), ("b", ids[cut:]))
        items = [_item(f"r{r}.{name}", part, lengths) for name, part in parts if part]
        ranks.append(rank(r, f"host-{r // per_host}", *items))
    durable = frozenset(_d(i) for i in draw(st.sets(st.integers(0, pool - 1))) if not replicated)
    return Scenario(tuple(ranks), durable, lengths)


def _check_ownership(sc: Scenario, plan: GroupPlan) -> None:
    by_rank = {rc.rank: rc for rc in sc.ranks}
    owned: dict[str, int] = {}
    for drain in plan.drains:
        rc = by_rank[drain.rank]
        assert drain.host == rc.host
        assert drain.chunks, "a drain assignment is never empty"
        for ref in drain.chunks:
            assert ref.digest not in owned, "each unique chunk has exactly one owner"
            owned[ref.digest] = drain.rank
            # The owner really holds the chunk, where the reference says.
            items = [it for it in rc.items if it.key == ref.key]
            assert len(items) == 1
            assert items[0].digests[ref.index] == ref.digest
            assert items[0].lengths[ref.index] == ref.length == sc.lengths[ref.digest]
    held = set(sc.lengths) & {d for rc in sc.ranks for it in rc.items for d in it.digests}
    assert set(owned) == held - sc.durable, "every new chunk is drained, no durable chunk is"


def _check_accounting(sc: Scenario, plan: GroupPlan) -> None:
    held = {d for rc in sc.ranks for it in rc.items for d in it.digests}
    assert plan.logical_bytes == sum(it.nbytes for rc in sc.ranks for it in rc.items)
    assert plan.unique_bytes == sum(sc.lengths[d] for d in held)
    assert plan.reused_bytes == sum(sc.lengths[d] for d in held & sc.durable)
    assert plan.new_bytes == plan.unique_bytes - plan.reused_bytes == sum(d.nbytes for d in plan.drains)
    assert plan.transfers == () and plan.replicated_bytes == 0
    assert sum(plan.bytes_per_host().values()) == plan.new_bytes
    assert [d.rank for d in plan.drains] == sorted({d.rank for d in plan.drains})


def _check_locally_balanced(sc: Scenario, plan: GroupPlan) -> None:
    """Each loaded host owns a chunk whose removal would leave it no fuller than any other holder of it.

    This is what greedy placement guarantees whatever the holders are; with every chunk available on
    every host it implies the one-chunk bound checked below.
    """
    load = {rc.host: 0 for rc in sc.ranks} | plan.bytes_per_host()
    holders = sc.holders()
    for drain_host, host_load in load.items():
        if host_load == 0:
            continue
        refs = [r for d in plan.drains if d.host == drain_host for r in d.chunks]
        assert any(all(host_load - r.length <= load[g] for g in holders[r.digest]) for r in refs), drain_host


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_plan_invariants(sc: Scenario) -> None:
    plan = plan_drains(9, sc.ranks, sc.durable)
    assert plan.step == 9
    _check_ownership(sc, plan)
    _check_accounting(sc, plan)
    _check_locally_balanced(sc, plan)


@settings(max_examples=150, deadline=None)
@given(scenarios(replicated=True))
def test_drain_bytes_per_host_within_one_chunk_of_the_lower_bound(sc: Scenario) -> None:
    plan = plan_drains(1, sc.ranks, sc.durable)
    _check_ownership(sc, plan)
    hosts = {rc.host for rc in sc.ranks}
    total, biggest = sum(sc.lengths.values()), max(sc.lengths.values())
    lower_bound = max(total / len(hosts), biggest)
    per_host = plan.bytes_per_host()
    assert max(per_host.values()) <= lower_bound + biggest
    # Within a host, the ranks share the host's bytes the same way.
    for host in hosts:
        ranks = [rc.rank for rc in sc.ranks if rc.host == host]
        drains = [plan.drain_for(r) for r in ranks]
        rank_bytes = [0 if d is None else d.nbytes for d in drains]
        assert max(rank_bytes) <= per_host.get(host, 0) / len(ranks) + biggest


@st.composite
def sharded_plus_replicated(draw: st.DrawFn) -> Scenario:
    """Each chunk is either one rank's own shard or held by every rank (FSDP/TP shards + DDP weights)."""
    hosts = draw(st.integers(1, 6))
    per_host = draw(st.integers(1, 3))
    n_ranks = hosts * per_host
    pool = draw(st.integers(1, 40))
    lengths = {_d(i): draw(st.integers(1, 1000)) for i in range(pool)}
    owner = [draw(st.none() | st.integers(0, n_ranks - 1)) for _ in range(pool)]
    ranks = tuple(
        rank(
            r,
            f"host-{r // per_host}",
            *(
                item
                for item in (
                    _item(f"shard.{r}", [i for i in range(pool) if owner[i] == r], lengths),
                    _item("replicated", [i for i in range(pool) if owner[i] is None], lengths),
                )
                if item.digests
            ),
        )
        for r in range(n_ranks)
    )
    durable = frozenset(_d(i) for i in draw(st.sets(st.integers(0, pool - 1))))
    return Scenario(ranks, durable, lengths)


@settings(max_examples=200, deadline=None)
@given(sharded_plus_replicated())
def test_sharded_plus_replicated_within_one_chunk_of_the_lower_bound(sc: Scenario) -> None:
    plan = plan_drains(4, sc.ranks, sc.durable)
    _check_ownership(sc, plan)
    _check_locally_balanced(sc, plan)
    holders = sc.holders()
    hosts = {rc.host for rc in sc.ranks}
    new = {d: n for d, n in sc.lengths.items() if d in holders and d not in sc.durable}
    if not new:
        assert plan.drains == ()
        return
    forced = {h: sum(n for d, n in new.items() if holders[d] == {h}) for h in hosts}
    biggest = max(new.values())
    lower_bound = max(max(forced.values()), sum(new.values()) / len(hosts), biggest)
    assert max(plan.bytes_per_host().values()) <= lower_bound + biggest


def test_replicated_chunks_go_where_the_own_shards_are_light() -> None:
    """Longest-first alone handed both replicated chunks to host-0 before its own four shards.

    That drained 610 bytes from host-0, more than one chunk above the lower bound 415; placing
    each host's own shards first gives 400 / 430.
    """
    lengths = {_d(i): n for i, n in enumerate([100, 100, 100, 100, 110, 110, 105, 105])}
    replicated = _item("replicated", [6, 7], lengths)
    ranks = [
        rank(0, "host-0", _item("shard.0", [0, 1, 2, 3], lengths), replicated),
        rank(1, "host-1", _item("shard.1", [4, 5], lengths), replicated),
    ]
    assert plan_drains(1, ranks, set()).bytes_per_host() == {"host-0": 400, "host-1": 430}


@settings(max_examples=100, deadline=None)
@given(scenarios(), st.randoms(use_true_random=False))
def test_plan_does_not_depend_on_rank_order(sc: Scenario, rnd: random.Random) -> None:
    shuffled = list(sc.ranks)
    rnd.shuffle(shuffled)
    assert plan_drains(3, shuffled, sc.durable) == plan_drains(3, sc.ranks, sc.durable)


def test_dedup_across_ranks_gives_one_owner() -> None:
    lengths = {_d(i): 10 for i in range(4)}
    ranks = [rank(r, f"h{r}", _item("model.w", [0, 1, 2, 3], lengths)) for r in range(4)]
    plan = plan_drains(0, ranks, set())
    assert plan.logical_bytes == 160 and plan.unique_bytes == 40 and plan.new_bytes == 40
    assert sorted(r.digest for d in plan.drains for r in d.chunks) == sorted(lengths)
    assert plan.bytes_per_host() == {f"h{r}": 10 for r in range(4)}


def test_durable_chunks_are_not_assigned() -> None:
    lengths = {_d(i): 10 for i in range(3)}
    ranks = [rank(0, "h0", chunks={"w": [0, 1, 2]}, lengths=lengths)]
    plan = plan_drains(2, ranks, {_d(0), _d(2), _d(99)})
    assert plan.drains == (plan.drains[0],)
    assert plan.drains[0].chunks == (ChunkRef(_d(1), "w", 1, 10),)
    assert plan.reused_bytes == 20 and plan.new_bytes == 10


def test_everything_durable_means_nothing_to_drain() -> None:
    lengths = {_d(i): 10 for i in range(3)}
    ranks = [rank(0, "h0", _item("w", [0, 1, 2], lengths))]
    plan = plan_drains(2, ranks, set(lengths))
    assert plan.drains == () and plan.new_bytes == 0 and plan.drain_for(0) is None
    assert plan_drains(0, [], set()).drains == ()


def test_a_chunk_repeated_inside_one_rank_is_drained_once() -> None:
    lengths = {_d(0): 10}
    ranks = [rank(0, "h0", chunks={"zeros": [0, 0, 0], "more": [0]}, lengths=lengths)]
    plan = plan_drains(1, ranks, set())
    assert plan.new_bytes == 10 and plan.logical_bytes == 40
    assert plan.drains[0].chunks == (ChunkRef(_d(0), "zeros", 0, 10),)


@pytest.mark.timeout(300)  # the scale check: a plan not near-linear in ranks takes hours here, a linear one
# seconds (an elapsed-time assertion broke on busy machines; benchmarks/planner.py measures the speed)
def test_sixteen_thousand_ranks_plan_quickly() -> None:
    """A 16,384-rank job (8 ranks per host): sharded weights plus a replicated block, no processes."""
    n_ranks, per_host = 16_384, 8
    lengths = {_d(i): 4 << 20 for i in range(n_ranks * 2 + 16)}
    shared_ids = list(range(n_ranks * 2, n_ranks * 2 + 16))
    replicated = _item("replicated", shared_ids, lengths)
    ranks = [
        rank(r, f"host-{r // per_host}", _item(f"shard.{r}", [2 * r, 2 * r + 1], lengths), replicated)
        for r in range(n_ranks)
    ]
    plan = plan_drains(1000, ranks, set())
    assert plan.unique_bytes == len(lengths) * (4 << 20) == plan.new_bytes
    drained = plan.bytes_per_host()
    assert max(drained.values()) - min(drained.values()) <= 4 << 20  # 16 hosts drain one extra chunk


def test_without_balance_every_shared_chunk_is_drained_by_the_lowest_rank_holding_it() -> None:
    lengths = {_d(i): 10 for i in range(8)}
    ranks = [
        rank(r, f"h{r // 2}", _item("model.w", [0, 1, 2, 3], lengths), _item(f"own.{r}", [4 + r], lengths))
        for r in range(4)
    ]
    balanced = plan_drains(0, ranks, set())
    lowest = plan_drains(0, ranks, set(), balance=False)
    assert balanced.bytes_per_host() == {"h0": 40, "h1": 40}
    assert lowest.bytes_per_host() == {"h0": 60, "h1": 20}  # the whole model from h0, each its own
    model = {ref.digest: d.rank for d in lowest.drains for ref in d.chunks if ref.key == "model.w"}
    assert sorted(model) == sorted(_d(i) for i in range(4)) and set(model.values()) == {0}
    assert lowest.new_bytes == balanced.new_bytes == 80  # the same chunks, once each
