"""The load's exchange plan: every need met once, each chunk once per host, messages that match."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.group.exchange import Delivery, ExchangePlan, plan_exchange


@dataclass(frozen=True)
class Job:
    rank_hosts: list[str]
    needs: list[list[str]]
    reader_of: dict[str, int]
    order: dict[str, tuple[int, int]] | None = None
    """Where each reader reads each chunk in its fetch (None: by digest)."""


@st.composite
def jobs(draw: st.DrawFn) -> Job:
    hosts = draw(st.integers(1, 4))
    per_host = draw(st.integers(1, 3))
    rank_hosts = [f"h{r // per_host}" for r in range(hosts * per_host)]
    chunks = [f"c{i:02d}" for i in range(draw(st.integers(1, 12)))]
    needs = [sorted(draw(st.sets(st.sampled_from(chunks)))) for _ in rank_hosts]
    wanted = sorted({d for n in needs for d in n})
    world = len(rank_hosts)
    reader_of = {d: draw(st.integers(0, world - 1)) for d in wanted}
    places = st.tuples(st.integers(0, 2), st.integers(0, 9))  # (file's turn, offset)
    order = draw(st.none() | st.fixed_dictionaries(dict.fromkeys(wanted, places)))
    return Job(rank_hosts, needs, reader_of, order)


def _simulate(plan: ExchangePlan, world: int) -> dict[int, list[str]]:
    """Run the protocol as the engine does; return what each rank received, in order.

    Every receive and every round-1 send is posted at the start; a rank takes its receives in
    ``incoming_at`` order, and a receive completes once the message matching it (the next one
    from that sender to that rank) is posted; forwards are posted when the relay takes the chunk.
    Fails on a deadlock or on a message matched to the wrong receive.
    """
    posted: dict[tuple[int, int], list[str]] = {}
    for x in plan.first:
        posted.setdefault((x.src, x.dst), []).append(x.digest)
    taken: dict[tuple[int, int], int] = {}
    todo = {r: list(plan.incoming_at(r)) for r in range(world)}
    forwards = {r: plan.forwards_at(r) for r in range(world)}
    got: dict[int, list[str]] = {r: [] for r in range(world)}
    while any(todo.values()):
        progressed = False
        for r in range(world):
            while todo[r]:
                x = todo[r][0]
                pair = (x.src, r)
                i = taken.get(pair, 0)
                if i >= len(posted.get(pair, [])):
                    break  # not sent yet
                assert posted[pair][i] == x.digest, (
                    f"rank {r} expected {x} but the message is {posted[pair][i]}"
                )
                taken[pair] = i + 1
                todo[r].pop(0)
                got[r].append(x.digest)
                for dst in forwards[r].get(x.digest, ()):
                    posted.setdefault((r, dst), []).append(x.digest)
                progressed = True
        assert progressed, f"deadlock: {todo}"
    return got


@settings(max_examples=300, deadline=None)
@given(jobs())
def test_every_need_is_met_once_and_each_chunk_crosses_to_a_host_once(job: Job) -> None:
    plan = plan_exchange(job.reader_of, job.needs, job.rank_hosts, job.order)
    world = len(job.rank_hosts)
    got = _simulate(plan, world)
    for r in range(world):  # each reader sends in the order it reads
        sent = [(job.order or {}).get(x.digest, (0, 0)) for x in plan.sends_at(r)]
        assert sent == sorted(sent)
    for r in range(world):
        expected = sorted(d for d in job.needs[r] if job.reader_of[d] != r)
        assert sorted(got[r]) == expected  # each needed chunk once, never one this rank read
    for d, reader in job.reader_of.items():
        crossings = [
            x for x in plan.first if x.digest == d and job.rank_hosts[x.dst] != job.rank_hosts[reader]
        ]
        hosts = [job.rank_hosts[x.dst] for x in crossings]
        assert len(hosts) == len(set(hosts))  # into each other host once
    for x in plan.second:
        assert x.relayed and job.rank_hosts[x.src] == job.rank_hosts[x.dst]
        assert any(y.digest == x.digest and y.dst == x.src for y in plan.first)


def test_four_replicas_on_two_hosts_relay_one_copy_per_chunk() -> None:
    hosts = ["h0", "h0", "h1", "h1"]
    needs = [["a", "b"]] * 4
    plan = plan_exchange({"a": 0, "b": 2}, needs, hosts)
    assert plan.first == (
        Delivery("a", 0, 1),
        Delivery("a", 0, 2),
        Delivery("b", 2, 0),
        Delivery("b", 2, 3),
    )
    assert plan.second == (Delivery("b", 0, 1, relayed=True), Delivery("a", 2, 3, relayed=True))
    assert plan.forwards_at(2) == {"a": [3]} and plan.incoming_at(3) == [
        Delivery("b", 2, 3),
        Delivery("a", 2, 3, relayed=True),
    ]


def test_a_reader_sends_its_chunks_in_the_order_it_reads_them() -> None:
    hosts = ["h0", "h0", "h1", "h1"]
    order = {"c": (0, 0), "a": (0, 4096), "b": (1, 0), "d": (0, 0)}  # c, a from one pack, then b's
    plan = plan_exchange({"a": 0, "b": 0, "c": 0, "d": 2}, [["a", "b", "c", "d"]] * 4, hosts, order)
    assert [(x.digest, x.dst) for x in plan.sends_at(0)] == [
        ("c", 1), ("c", 2), ("a", 1), ("a", 3), ("b", 1), ("b", 2)
    ]  # fmt: skip (h1's relays take turns)
    # rank 2 relays c and b to rank 3 in the order it gets them
    assert [(x.digest, x.src) for x in plan.incoming_at(3)] == [("a", 0), ("d", 2), ("c", 2), ("b", 2)]


def test_relays_of_a_host_take_turns() -> None:
    hosts = ["h0", "h1", "h1"]
    needs = [[], ["a", "b", "c", "d"], ["a", "b", "c", "d"]]
    plan = plan_exchange(dict.fromkeys("abcd", 0), needs, hosts)
    assert [x.dst for x in plan.first] == [1, 2, 1, 2]


def test_one_rank_exchanges_nothing() -> None:
    plan = plan_exchange({"a": 0}, [["a"]], ["h0"])
    assert plan.first == plan.second == () and plan.incoming_at(0) == []
