"""The planner's input, one :class:`ChunkTable` per rank, and :class:`Digests`: tables read as their
items, tables as the exchange delivers them plan alike, digest prefixes and colliding keys."""

from __future__ import annotations

import pickle
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.group._tables import index_tables
from shoal.group.digests import Digests
from shoal.group.plan import ChunkRuns, ChunkTable, GroupPlan, ItemChunks, RankChunks
from shoal.group.planner import PlanCache, plan_group_save
from shoal.group.topology import build_topology

from .planner_helpers import _d, _item, pickled, plan_drains, rank, table
from .test_group_plan import GroupScenario, _check_group, group_scenarios
from .test_planner import Scenario, _check_accounting, _check_ownership, scenarios


def chunks_of(plan: GroupPlan) -> tuple[object, ...]:
    """Everything a plan says, chunk by chunk, as plain tuples."""
    return (
        plan.step,
        plan.logical_bytes,
        plan.unique_bytes,
        plan.reused_bytes,
        [(d.rank, d.host, list(d.chunks), d.nbytes, len(d.runs)) for d in plan.drains],
        [(t.src_rank, t.dst_rank, list(t.chunks), t.nbytes, len(t.runs)) for t in plan.transfers],
    )


# -- Digests -------------------------------------------------------------------------------------


def test_digests_read_like_a_tuple_of_hex_strings() -> None:
    hexes = tuple(_d(i) for i in range(6))
    d = Digests.from_hex(hexes)
    assert len(d) == 6 and list(d) == list(hexes) and d[2] == hexes[2] and d[-1] == hexes[-1]
    assert d == hexes and hexes == d and d == list(hexes) and d != hexes[:5] and d != hexes[::-1]
    assert d[1:4] == hexes[1:4] and d[::2] == hexes[::2] and d[4:1] == ()
    assert hash(d) == hash(hexes) and {hexes: 1}[d] == 1
    assert hexes[3] in d and _d(99) not in d and "zz" not in d and 7 not in d
    assert d[1:4] == Digests(d.raw[32:128]) and d.raw == b"".join(bytes.fromhex(h) for h in hexes)
    assert d.words().shape == (6, 4) and d.tuple() == hexes
    with pytest.raises(IndexError):
        d[6]
    with pytest.raises(ValueError):
        Digests(b"x" * 31)
    with pytest.raises(ValueError):
        Digests.from_hex(["ab" * 31 + "a", "ab"])
    assert pickle.loads(pickle.dumps(d[2:5])) == hexes[2:5]


def test_views_of_one_buffer_pickle_it_once() -> None:
    d = Digests(bytes(range(32)) * 1000)
    views = [d[i : i + 10] for i in range(0, 1000, 10)]
    data = pickle.dumps(views)
    assert 32_000 < len(data) < 40_000
    assert pickle.loads(data) == views


def test_a_table_reads_as_its_items() -> None:
    lengths = {_d(i): 10 + i for i in range(8)}
    items = (_item("a", [0, 1, 2], lengths), ItemChunks("empty", 0, (), ()), _item("b", [3, 3], lengths))
    t = table(items)
    assert len(t) == 3 and tuple(t) == items and list(t) == list(items) and t[-1] == items[-1]
    assert t[0:2] == items[0:2] and pickle.loads(pickle.dumps(t)).same(t)
    assert t == table(items) and t == pickle.loads(pickle.dumps(t)) and t != table(items[:2])
    assert t != items, "a table equals tables, not tuples of its items"
    u = ChunkTable.uniform(["w", "x"], [10, 4], 4, Digests.from_hex([_d(0), _d(1), _d(2), _d(3)]))
    assert [i.lengths for i in u] == [(4, 4, 2), (4,)] and list(u.lengths) == [4, 4, 2, 4]
    assert table(u).same(u) and pickle.loads(pickle.dumps(u)).same(u)
    assert table(u) == u and hash(table(u)) == hash(u), "lengths given or implied by the chunk size"
    with pytest.raises(ValueError, match="digests"):
        ChunkTable.uniform(["w"], [10], 4, Digests.from_hex([_d(0)]))


# -- the same plans ------------------------------------------------------------------------------


def _as_uniform(t: ChunkTable) -> ChunkTable | None:
    """``t`` as :meth:`ChunkTable.uniform` builds it, if one chunk size fits every item, else None."""
    size = max((int(n) for n in t.lengths), default=1)
    for it in t:
        if any(n != size for n in it.lengths[:-1]):
            return None
    return ChunkTable.uniform(t.keys, t.nbytes, size, t.digests)


@settings(max_examples=150, deadline=None)
@given(group_scenarios())
def test_tables_through_a_pickle_plan_like_the_originals(sc: GroupScenario) -> None:
    """Tables as the exchange delivers them (new objects, prefixes computed again) plan alike."""
    expected = plan_group_save(5, sc.ranks, sc.durable, sc.topology, held=sc.held)
    got = plan_group_save(5, pickled(sc.ranks), sc.durable, sc.topology, held=sc.held)
    assert chunks_of(got) == chunks_of(expected)
    assert got == expected, "equal field by field too (lazy run columns equal their values)"
    _check_group(sc, got)
    assert pickle.loads(pickle.dumps(got)) == got


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_pickled_tables_plan_alike_without_replication(sc: Scenario) -> None:
    got = plan_drains(3, pickled(sc.ranks), sc.durable)
    assert got == plan_drains(3, sc.ranks, sc.durable)
    _check_ownership(sc, got)
    _check_accounting(sc, got)


@settings(max_examples=60, deadline=None)
@given(group_scenarios(), st.randoms(use_true_random=False))
def test_tables_of_every_construction_plan_alike(sc: GroupScenario, rnd: random.Random) -> None:
    """Per rank, its table as built (lengths given), pickled, with the prefixes the rank made, or
    by chunk size (:meth:`ChunkTable.uniform`, where one size fits): the same plan."""
    mixed = []
    for rc in sc.ranks:
        t = rc.items
        form = rnd.choice(["built", "pickled", "prefixes", "uniform"])
        if form == "pickled":
            t = pickle.loads(pickle.dumps(t))
        elif form == "prefixes":
            t = ChunkTable(t.keys, t.nbytes, t.counts, t.lengths, t.digests, prefix=t.digests.prefixes())
        elif form == "uniform":
            t = _as_uniform(t) or t
        assert t == rc.items
        mixed.append(RankChunks(rc.rank, rc.host, t))
    expected = plan_group_save(2, sc.ranks, sc.durable, sc.topology, held=sc.held)
    assert chunks_of(plan_group_save(2, mixed, sc.durable, sc.topology, held=sc.held)) == chunks_of(expected)


def _colliding(n: int) -> list[str]:
    """``n`` different digests sharing their first 8 bytes (and so every shortened key)."""
    head = bytes.fromhex(_d(0))[:8]
    return [(head + bytes.fromhex(_d(1000 + i))[8:]).hex() for i in range(n)]


def test_digests_sharing_their_first_bytes_are_not_merged() -> None:
    a, b, c = _colliding(3)
    assert a[:16] == b[:16] == c[:16] and len({a, b, c}) == 3
    ranks = [
        rank(0, "h0", ItemChunks("x", 30, (a, b), (10, 20))),
        rank(1, "h1", ItemChunks("x", 30, (a, c), (10, 20)), ItemChunks("y", 10, (b,), (10,))),
    ]
    topo = build_topology(["h0", "h1"])
    for form in (ranks, pickled(ranks)):
        plan = plan_group_save(0, form, set(), topo)
        drained = sorted(c.digest for d in plan.drains for c in d.chunks)
        assert drained == sorted([a, b, c]), "each distinct digest once; a shared key merges nothing"
        assert plan.unique_bytes == 50 and plan.logical_bytes == 70
        sc = GroupScenario(tuple(ranks), topo, frozenset(), {}, {a: 10, b: 20, c: 20})
        _check_group(sc, plan)


def test_many_colliding_keys_in_a_big_report() -> None:
    """Over a million chunks (the bitmap path), with equal and merely colliding digests planted."""
    rng = random.Random(7)
    n_ranks, per_rank = 64, 20_000
    raw = bytearray(rng.randbytes(32 * n_ranks * per_rank))
    twins = _colliding(40)
    for k, h in enumerate(twins):  # 40 digests with one key, 20 of them twice (in two ranks)
        for _ in range(2 if k < 20 else 1):
            at = rng.randrange(n_ranks * per_rank)
            raw[32 * at : 32 * at + 32] = bytes.fromhex(h)
    buf = bytes(raw)
    ranks = []
    for r in range(n_ranks):
        d = Digests.view(buf, r * per_rank, per_rank)
        keys = [f"r{r}.{j}" for j in range(per_rank // 4)]
        ranks.append(RankChunks(r, f"h{r // 8}", ChunkTable.uniform(keys, [4 * 4] * len(keys), 4, d)))
    all_hex = Digests(buf)
    distinct = len(set(all_hex))
    plan = plan_group_save(0, ranks, set(), build_topology([rc.host for rc in ranks]))
    drained = [c.digest for d in plan.drains for c in d.chunks]
    assert len(drained) == len(set(drained)) == distinct
    assert plan.unique_bytes == 4 * distinct


def test_a_chunk_shared_between_items_and_ranks_is_drained_once() -> None:
    lengths = {_d(i): 10 for i in range(6)}
    ranks = [
        rank(0, "h0", chunks={"a": [0, 1], "zeros": [5, 5, 5]}, lengths=lengths),
        rank(1, "h1", chunks={"b": [2, 1], "zeros": [5, 5, 5]}, lengths=lengths),
        rank(2, "h2", chunks={"c": [3, 4, 5]}, lengths=lengths),
    ]
    topo = build_topology(["h0", "h1", "h2"])
    plans = [plan_group_save(0, form, set(), topo) for form in (ranks, pickled(ranks))]
    assert chunks_of(plans[0]) == chunks_of(plans[1])
    drained = sorted(c.digest for d in plans[1].drains for c in d.chunks)
    assert drained == sorted(_d(i) for i in range(6))
    assert plans[1].unique_bytes == 60 and plans[1].logical_bytes == 130
    _check_group(GroupScenario(tuple(ranks), topo, frozenset(), {}, lengths), plans[1])
    h = index_tables([rc.items for rc in pickled(ranks)])
    assert h.dups is not None and len(h.items) == 4, "rank 1's zeros are rank 0's: a, zeros, b, c"


def _materialized(plan: GroupPlan) -> GroupPlan:
    """``plan`` with every run column a plain tuple (digests tuples of hex strings), runs that
    were one object still one object: what a plan holding an object per item looks like."""
    done: dict[int, ChunkRuns] = {}

    def plain(runs: ChunkRuns) -> ChunkRuns:
        if id(runs) not in done:
            done[id(runs)] = ChunkRuns(
                tuple(runs.keys),
                tuple(runs.starts),
                tuple(tuple(d) for d in runs.digests),
                tuple(tuple(n) for n in runs.lengths),
            )
        return done[id(runs)]

    return replace(
        plan,
        drains=tuple(replace(d, runs=plain(d.runs)) for d in plan.drains),
        transfers=tuple(replace(t, runs=plain(t.runs)) for t in plan.transfers),
    )


def test_sharded_plan_holds_lazy_runs() -> None:
    """Every rank drains and sends its whole table: runs read the table, and pickle small."""
    lengths = {_d(i): 100 for i in range(400)}
    ranks = pickled(
        [
            rank(
                r,
                f"h{r // 2}",
                *(_item(f"s.{j}", [50 * r + 5 * j + k for k in range(5)], lengths) for j in range(10)),
            )
            for r in range(8)
        ]
    )
    topo = build_topology([rc.host for rc in ranks])
    plan = plan_group_save(0, ranks, set(), topo)
    plain = _materialized(plan)
    assert plan == plain and chunks_of(plan) == chunks_of(plain)
    for d in plan.drains:
        assert len(d.runs) == 50 and d.nbytes == 5000 and plan.sends_from(d.rank)[0].runs is d.runs
        assert list(d.runs.keys) == sorted(d.runs.keys)
    assert len(pickle.dumps(plan)) < 0.75 * len(pickle.dumps(plain))


def test_plan_cache_on_tables_through_a_pickle() -> None:
    lengths = {_d(i): 100 + i for i in range(40)}
    ranks = [
        rank(r, f"h{r // 2}", chunks={"w": list(range(10)), "o": [20 + 2 * r, 21 + 2 * r]}, lengths=lengths)
        for r in range(4)
    ]
    topo = build_topology([rc.host for rc in ranks])
    cache = PlanCache()
    first = cache.lookup_or_plan(1, pickled(ranks), set(), topo)
    assert first == plan_group_save(1, ranks, set(), topo)
    assert cache.lookup_or_plan(2, pickled(ranks), set(), topo) == replace(first, step=2)
    assert (cache.hits, cache.misses) == (1, 1)
    changed = [*ranks[:3], rank(3, "h1", ranks[3].items[0], _item("o", [22, 23], lengths))]
    got = cache.lookup_or_plan(3, pickled(changed), set(), topo)
    assert cache.misses == 2 and got == plan_group_save(3, changed, set(), topo)
    assert cache.lookup_or_plan(4, ranks, set(), topo) == replace(plan_group_save(4, ranks, set(), topo))
    assert cache.misses == 3, "the first reports again, after other ones: planned again"


# -- Digest prefixes (the planner's sort keys) ----------------------------------------------------


def test_a_table_takes_the_prefixes_its_rank_made() -> None:
    d = Digests.from_hex([_d(i) for i in range(5)])
    prefix = d.prefixes()
    assert len(prefix) == 8 * 5 and prefix[8:16] == bytes.fromhex(_d(1))[:8]
    t = ChunkTable.uniform(["a", "b"], [30, 20], 10, d, prefix)
    assert t.prefix.tolist() == ChunkTable.uniform(["a", "b"], [30, 20], 10, d).prefix.tolist()
    assert t.prefix.dtype.name == "uint64" and not t.prefix.flags.writeable
    with pytest.raises(ValueError, match="a prefix of 32 bytes for 5 digests"):
        ChunkTable.uniform(["a", "b"], [30, 20], 10, d, prefix[:32])
    with pytest.raises(ValueError, match="prefix 4 is not"):
        ChunkTable.uniform(["a", "b"], [30, 20], 10, d, prefix[:32] + bytes(8))
    again = pickle.loads(pickle.dumps(t))
    assert again == t and again._prefix is None, "plans refer to tables: the prefixes stay home"


def test_prefixes_that_lie_merge_nothing() -> None:
    """Ranks whose prefixes all claim one key (checked only at both ends) still get each distinct
    digest drained once: a shared key is a candidate, equal means all 32 bytes equal."""
    hexes = [_d(i) for i in range(12)]
    lengths = dict.fromkeys(hexes, 10)
    ranks = [
        rank(r, f"h{r}", chunks={f"x{r}": [4 * r, 4 * r + 1], "z": [4 * r + 2, 4 * r + 3]}, lengths=lengths)
        for r in range(3)
    ]
    forged = []
    for rc in ranks:
        t = rc.items
        real = t.digests.prefixes()
        lie = real[:8] + real[:8] * 2 + real[-8:]  # the middle two claim the first one's key
        forged.append(RankChunks(rc.rank, rc.host, ChunkTable.uniform(t.keys, t.nbytes, 10, t.digests, lie)))
    topo = build_topology([rc.host for rc in ranks])
    plan = plan_group_save(0, forged, set(), topo)
    assert chunks_of(plan) == chunks_of(plan_group_save(0, ranks, set(), topo))
    assert sorted(c.digest for d in plan.drains for c in d.chunks) == sorted(hexes)


def test_tables_of_several_chunk_sizes_plan_like_tables_of_their_lengths() -> None:
    """Chunk counts follow each table's own chunk size (none shared by all)."""
    hexes = [_d(i) for i in range(40)]
    ranks, total = [], 0
    for r, size in enumerate((10, 10, 25, 7)):
        n = 3 + r
        d = Digests.from_hex(hexes[10 * r : 10 * r + n])
        nbytes = size * (n - 1) + 1
        total += nbytes
        ranks.append(RankChunks(r, f"h{r}", ChunkTable.uniform([f"w{r}"], [nbytes], size, d)))
    explicit = [rank(rc.rank, rc.host, *rc.items) for rc in ranks]  # every chunk's length given
    assert all(rc.items.chunk_size is None for rc in explicit)
    topo = build_topology([rc.host for rc in ranks])
    plan = plan_group_save(0, ranks, set(), topo)
    assert chunks_of(plan) == chunks_of(plan_group_save(0, explicit, set(), topo))
    assert plan.unique_bytes == total
