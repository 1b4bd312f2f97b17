"""The restore planner: which checkpoint to load, and who reads each chunk from where (docs/design.md §5).

Pure functions over plain data, like the save planner:

* :func:`choose_checkpoint`: given every surviving copy of every checkpoint's metadata
  (:class:`Candidate`) and every place each chunk can be read from (:class:`Source`),
  the newest checkpoint whose every chunk is available somewhere (or the one asked for,
  with a clear error naming what is missing);
* :func:`plan_reads`: each needed chunk is read **once** per job: by a consumer whose own
  host holds it, else by a rank on a host that holds it, else from shared storage by a
  consumer, with bytes read balanced across hosts (one NIC each), then across the ranks of
  a host. The reader then sends it over the fabric to every other rank that needs it
  (:attr:`ChunkRead.consumers`).

A rank reads only its own host's DRAM and local tiers, and the shared tier: a host's
copies reach other hosts through the fabric, never through another host's file system.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shoal.errors import CheckpointNotFound
from shoal.tiers import read_preference
from shoal.tiers.roles import Role, kind_for

SHARED = kind_for(Role.SHARED)
"""``Source.tier`` of the shared tier (whose ``host`` is None): the kind that plays the shared role."""


@dataclass(frozen=True)
class Source:
    """One place a chunk can be read from.

    ``tier`` is a tier kind (``"dram"``, ``"local"``, ``"shared"`` or a registered one); ``host``
    the host whose tier it is (None for shared). ``path`` names a pack (``slab=False``) or a staging slab
    (``slab=True``, DRAM only); the chunk is ``length`` bytes at ``offset`` in it.
    """

    tier: str
    host: str | None
    path: str
    offset: int
    length: int
    slab: bool = False

    def describe(self) -> str:
        where = "shared tier" if self.host is None else f"{self.tier} tier of host {self.host!r}"
        what = f"slab {self.path}" if self.slab else f"pack packs/{self.path}.pack"
        return f"{what} at offset {self.offset} on the {where}"


@dataclass(frozen=True)
class Candidate:
    """One checkpoint as a surviving copy of its metadata describes it.

    ``items`` maps each item key to its chunk digests; ``origin`` says where the metadata
    was found (``"shared"``, or ``"<tier>:<host>"``) and ``committed`` whether the shared
    tier holds its commit record.
    """

    step: int
    items: Mapping[str, Sequence[str]]
    origin: str
    committed: bool = False


@dataclass(frozen=True)
class Choice:
    """The checkpoint to restore and the metadata copy it is read from."""

    step: int
    origin: str
    skipped: tuple[tuple[int, str], ...] = ()
    """Newer checkpoints passed over, each with why."""
    committed: bool = False
    """Whether the shared tier holds its commit record (B4)."""


def _missing(c: Candidate, sources: Mapping[str, Sequence[Source]]) -> list[str]:
    """Keys of the items with a chunk no source holds."""
    return [key for key, digests in c.items.items() if any(not sources.get(d) for d in digests)]


def _describe_missing(c: Candidate, missing: list[str], gone: Mapping[str, Sequence[str]]) -> str:
    shown = ", ".join(repr(k) for k in missing[:5])
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    text = f"no surviving copy of some chunks of {len(missing)} item(s): {shown}{more}"
    lost = sorted({w for key in missing[:5] for d in c.items[key] for w in gone.get(d, ())})
    if lost:
        text += f" (known copies gone: {'; '.join(lost[:5])}{' ...' if len(lost) > 5 else ''})"
    return text


def choose_checkpoint(
    candidates: Iterable[Candidate],
    sources: Mapping[str, Sequence[Source]],
    step: int | None = None,
    *,
    gone: Mapping[str, Sequence[str]] | None = None,
) -> Choice:
    """The newest checkpoint (or ``step``) whose every chunk has a source.

    Several copies of one step's metadata are equivalent (the same items and digests); the
    shared tier's is preferred, then the first given. ``gone``: digest -> descriptions of
    copies the metadata names but that are no longer there (a deleted pack), for the error.
    Raises :class:`~shoal.errors.CheckpointNotFound` naming the missing items, or the steps seen.
    """
    gone = gone or {}
    by_step: dict[int, list[Candidate]] = {}
    for c in candidates:
        by_step.setdefault(c.step, []).append(c)
    for copies in by_step.values():
        copies.sort(key=lambda c: (not c.committed, c.origin != SHARED))
    if step is not None:
        if step not in by_step:
            seen = sorted(by_step)
            raise CheckpointNotFound(
                f"no copy of checkpoint {step} survives on any tier (steps found: {seen or 'none'})"
            )
        c = by_step[step][0]
        missing = _missing(c, sources)
        if missing:
            raise CheckpointNotFound(
                f"checkpoint {step} cannot be restored: {_describe_missing(c, missing, gone)}"
            )
        return Choice(step, c.origin, committed=any(x.committed for x in by_step[step]))
    skipped: list[tuple[int, str]] = []
    for s in sorted(by_step, reverse=True):
        c = by_step[s][0]
        missing = _missing(c, sources)
        if not missing:
            return Choice(s, c.origin, tuple(skipped), any(x.committed for x in by_step[s]))
        skipped.append((s, _describe_missing(c, missing, gone)))
    if not skipped:
        raise CheckpointNotFound("no checkpoint found on any tier (shared, local or DRAM)")
    why = "; ".join(f"step {s}: {w}" for s, w in skipped)
    raise CheckpointNotFound(f"no checkpoint can be restored from what survives: {why}")


@dataclass(frozen=True)
class ChunkRead:
    """One chunk, read by one rank from ``sources`` (in order of preference), for ``consumers``."""

    digest: str
    length: int
    sources: tuple[Source, ...]
    consumers: tuple[int, ...]


@dataclass(frozen=True)
class ReadPlan:
    """Who reads which chunk, and so who sends which chunk to whom."""

    reads: Mapping[int, tuple[ChunkRead, ...]]
    """Per reading rank, its reads in order."""
    complete: bool = False
    """Set by the caller: whether the ranks' needs cover every item of the checkpoint."""

    def reads_at(self, rank: int) -> tuple[ChunkRead, ...]:
        return self.reads.get(rank, ())


def plan_reads(
    needs: Mapping[int, Iterable[str]],
    lengths: Mapping[str, int],
    sources: Mapping[str, Sequence[Source]],
    rank_hosts: Sequence[str],
) -> ReadPlan:
    """Assign each chunk some rank needs to one reader and an ordered list of sources.

    ``needs``: rank -> digests it needs; ``lengths``: digest -> bytes; ``sources``: digest ->
    where it lies; ``rank_hosts[r]``: the host of rank r. Chunks are placed longest first on
    the least-loaded eligible host (bytes read), then the least-loaded rank there. A reader's
    sources are those of its own host, in the order of their tier kinds' read preference
    (:func:`shoal.tiers.read_preference`: DRAM before local disk; a slab before a pack of the
    same kind), then the shared tier.
    Raises :class:`~shoal.errors.CheckpointNotFound` for a needed chunk with no source a
    rank of this job can reach.
    """
    consumers: dict[str, list[int]] = {}
    for rank in sorted(needs):
        for d in needs[rank]:
            ranks = consumers.setdefault(d, [])
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
    ranks_on: dict[str, list[int]] = {}
    for r, h in enumerate(rank_hosts):
        ranks_on.setdefault(h, []).append(r)
    host_load = dict.fromkeys(ranks_on, 0)
    rank_load = dict.fromkeys(range(len(rank_hosts)), 0)
    reads: dict[int, list[ChunkRead]] = {}
    preference: dict[str, int] = {}

    def rank_of(s: Source) -> tuple[int, bool]:
        if s.tier not in preference:
            preference[s.tier] = read_preference(s.tier)  # ConfigError for a kind no tier implements
        return preference[s.tier], s.slab is False

    for d in sorted(consumers, key=lambda d: (-lengths[d], d)):
        n = lengths[d]
        srcs = sources.get(d, ())
        on_host: dict[str, list[Source]] = {}
        shared = [s for s in srcs if s.host is None]
        for s in srcs:
            if s.host is not None and s.host in ranks_on:
                on_host.setdefault(s.host, []).append(s)
        wanting = consumers[d]
        if not on_host and not shared:
            raise CheckpointNotFound(
                f"chunk {d} (needed by ranks {wanting}) has no source this job can reach: "
                + ("; ".join(s.describe() for s in srcs) if srcs else "none survives")
            )
        # Eligible hosts: consumers' hosts holding it, else any host holding it, else consumers' hosts.
        consumer_hosts = sorted({rank_hosts[r] for r in wanting}, key=list(ranks_on).index)
        hosts = [h for h in consumer_hosts if h in on_host] or sorted(on_host) or consumer_hosts
        host = min(hosts, key=lambda h: (host_load[h], hosts.index(h)))
        candidates = [r for r in wanting if rank_hosts[r] == host] or ranks_on[host]
        reader = min(candidates, key=lambda r: (rank_load[r], r))
        mine = sorted(on_host.get(host, ()), key=rank_of)
        order = tuple(mine + shared)
        host_load[host] += n
        rank_load[reader] += n
        reads.setdefault(reader, []).append(ChunkRead(d, n, order, tuple(wanting)))
    return ReadPlan({r: tuple(v) for r, v in sorted(reads.items())})


__all__ = [
    "SHARED",
    "Candidate",
    "Choice",
    "ChunkRead",
    "ReadPlan",
    "Source",
    "choose_checkpoint",
    "plan_reads",
]
