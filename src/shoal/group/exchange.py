"""Who sends which chunk of a load to whom (docs/design.md section 5): pure, every rank alike.

Each chunk was read by one rank (its *reader*). It reaches every other rank that needs it in
at most two hops, and crosses to each other host once:

* round 1: the reader sends it to each rank of its own host that needs it, and to one rank of
  every other host that needs it (that host's *relay* for the chunk; the relays of a host take
  turns, chunk by chunk, so that no one rank forwards everything);
* round 2: each relay forwards it to the other ranks of its host that need it.

Ranks of one host share its fabric link, so sending a chunk once per host instead of once per
rank divides what crosses the link by the ranks per host; and unlike a broadcast tree, which
sends one chunk at a time down its levels, every transfer of both rounds is posted at once, so
every link sends and receives at the same time.

:func:`plan_exchange` returns an :class:`ExchangePlan` that every rank computes alike. No header
travels: between two ranks, messages match in the order they were posted, and the plan fixes
that order. Each rank posts every receive of both rounds at once (straight into its
destination buffers) and its round-1 sends (the restore posts them before it reads, and each
send as soon as its chunk is read, in ``order``), then takes its receives in
:meth:`ExchangePlan.incoming_at` order (round 1, then round 2; each round one chunk from each
sender in turn, so that it takes them about as they arrive) and forwards each chunk it relays
as soon as it has it. A relay's round-2 sends follow the order it takes its round-1 chunks in.
Round-2 receives come last, and no round-1 send waits for a receive, so no rank can wait on
another that waits on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Delivery", "ExchangePlan", "plan_exchange"]


@dataclass(frozen=True)
class Delivery:
    """Rank ``src`` sends chunk ``digest`` to rank ``dst``; ``relayed``: in round 2, as the relay
    of ``dst``'s host (``src`` received it in round 1)."""

    digest: str
    src: int
    dst: int
    relayed: bool = False


def _in_turns(deliveries: Sequence[Delivery], rank: int, world: int) -> list[Delivery]:
    """``deliveries`` to ``rank``, one from each sender in turn (each sender's in their order)."""
    queues: dict[int, list[Delivery]] = {}
    for x in deliveries:
        queues.setdefault(x.src, []).append(x)
    senders = sorted(queues, key=lambda s: (s - rank) % world)
    out: list[Delivery] = []
    for i in range(max((len(q) for q in queues.values()), default=0)):
        out.extend(queues[s][i] for s in senders if i < len(queues[s]))
    return out


@dataclass(frozen=True)
class ExchangePlan:
    """Both rounds of one exchange; every rank reads its part."""

    first: tuple[Delivery, ...]
    """Round 1, from each chunk's reader, in chunk order."""
    second: tuple[Delivery, ...]
    """Round 2, from the relays; each relay's in the order it takes its round-1 chunks."""
    world: int

    def sends_at(self, rank: int) -> list[Delivery]:
        """``rank``'s round-1 sends, in the order to post them."""
        return [x for x in self.first if x.src == rank]

    def incoming_at(self, rank: int) -> list[Delivery]:
        """Every chunk ``rank`` receives, in the order it takes them: round 1, then round 2."""
        first = _in_turns([x for x in self.first if x.dst == rank], rank, self.world)
        return first + _in_turns([x for x in self.second if x.dst == rank], rank, self.world)

    def forwards_at(self, rank: int) -> dict[str, list[int]]:
        """Digest -> the ranks ``rank`` forwards it to (as their host's relay), in order."""
        out: dict[str, list[int]] = {}
        for x in self.second:
            if x.src == rank:
                out.setdefault(x.digest, []).append(x.dst)
        return out


def plan_exchange(
    reader_of: Mapping[str, int],
    needs: Sequence[Sequence[str]],
    rank_hosts: Sequence[str],
    order: Mapping[str, tuple[int, int]] | None = None,
) -> ExchangePlan:
    """Both rounds of the exchange of a load's chunks.

    ``reader_of``: digest -> the rank that reads it; ``needs[r]``: the digests rank ``r`` needs
    (each once); ``rank_hosts[r]``: rank ``r``'s host. A rank never receives a chunk it read,
    nor one chunk twice. Chunks go in the order of (reader, ``order[digest]``, digest): with
    ``order`` the order each reader reads its chunks in, a reader can send each chunk as soon as
    it has read it. Time and size are linear in the deliveries.
    """
    rank_of = order or {}
    world = len(rank_hosts)
    consumers: dict[str, list[int]] = {}
    for rank, digests in enumerate(needs):
        for d in digests:
            consumers.setdefault(d, []).append(rank)
    first: list[Delivery] = []
    targets: dict[tuple[int, str], list[int]] = {}
    """(relay, digest) -> the ranks of the relay's host it forwards the chunk to."""
    turn: dict[str, int] = {}
    for d in sorted(consumers, key=lambda d: (reader_of[d], rank_of.get(d, (0, 0)), d)):
        src = reader_of[d]
        by_host: dict[str, list[int]] = {}
        for r in consumers[d]:
            if r != src:
                by_host.setdefault(rank_hosts[r], []).append(r)
        for host, ranks in by_host.items():
            if host == rank_hosts[src]:
                first.extend(Delivery(d, src, r) for r in ranks)
                continue
            k = turn.get(host, 0)
            turn[host] = k + 1
            relay = ranks[k % len(ranks)]
            first.append(Delivery(d, src, relay))
            if len(ranks) > 1:
                targets[(relay, d)] = [r for r in ranks if r != relay]
    # A relay forwards in the order it takes all its round-1 chunks (those it keeps too).
    relays = {relay for relay, _ in targets}
    to_relay: dict[int, list[Delivery]] = {}
    for x in first:
        if x.dst in relays:
            to_relay.setdefault(x.dst, []).append(x)
    second = tuple(
        Delivery(x.digest, relay, dst, relayed=True)
        for relay in sorted(to_relay)
        for x in _in_turns(to_relay[relay], relay, world)
        for dst in targets.get((relay, x.digest), ())
    )
    return ExchangePlan(tuple(first), second, world)
