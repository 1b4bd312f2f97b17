"""Where ranks run: hosts, failure domains and replication partners (docs/design.md sections 1 and 4).

A :class:`Topology` is plain, immutable data that every rank can build for itself from
the host id of every rank (one all-gather at start-up). It says:

* which host each rank runs on (``rank_hosts``), and the hosts in order of their lowest rank;
* the failure domain of each host (a rack, a power feed; by default the host itself):
  two hosts in one domain may fail together, so they are **never** partners;
* the partner of each host: where that host's new chunks are replicated before the drain
  to shared storage (boundary B2). Partners are chosen by a *scheme*:

  ``ring``
      the partner of host ``i`` (in ``hosts`` order) is the first of hosts ``i+1, i+2, ...``
      (modulo the host count) whose failure domain differs from host ``i``'s.
  ``jump``
      the same search, started half-way round the ring at ``(i + n // 2) % n``, so that
      neighbouring hosts (often one rack, one switch) do not hold each other's copies even
      when no failure domains are configured.

  Partnership is not symmetric in general (with ``ring``, ``h0 -> h1 -> h2 -> h0``); every
  host has exactly one partner and receives from one or more hosts.

The ranks of one host need not be contiguous. :meth:`Topology.partner_rank` spreads one
host's ranks over its partner's ranks by local index, so that replication traffic uses
every rank (and NIC) of both hosts when their sizes match.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from shoal.errors import ConfigError

SCHEMES = ("ring", "jump")
"""Partner schemes :func:`build_topology` knows."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """Hosts, failure domains and partners of one job; index of ``rank_hosts`` = rank.

    Build it with :func:`build_topology`; constructing it directly checks that the fields
    agree with each other (every host has a domain, partners are hosts of other domains).
    """

    rank_hosts: tuple[str, ...]
    """Host id of each rank."""
    hosts: tuple[str, ...]
    """Distinct hosts, in order of their lowest rank."""
    partners: Mapping[str, str]
    """Host -> partner host; empty when there is one host or replication is off."""
    domains: Mapping[str, str]
    """Host -> failure domain, for every host."""
    _ranks_on: Mapping[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _local_index: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _partner_rank: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.rank_hosts:
            raise ConfigError("a topology needs at least one rank; rank_hosts is empty")
        ranks_on: dict[str, list[int]] = {}
        for rank, host in enumerate(self.rank_hosts):
            ranks_on.setdefault(host, []).append(rank)
        if tuple(ranks_on) != tuple(self.hosts):
            raise ConfigError(
                f"hosts must list the distinct hosts of rank_hosts in order of their lowest rank: "
                f"expected {tuple(ranks_on)}, got {tuple(self.hosts)}"
            )
        missing = [h for h in self.hosts if h not in self.domains]
        if missing:
            raise ConfigError(f"domains has no failure domain for hosts {missing}")
        for host, partner in self.partners.items():
            if host not in ranks_on or partner not in ranks_on:
                raise ConfigError(f"partner {host!r} -> {partner!r} names a host that runs no rank")
            if self.domains[host] == self.domains[partner]:
                raise ConfigError(
                    f"hosts {host!r} and {partner!r} cannot be partners: both are in failure domain "
                    f"{self.domains[host]!r}"
                )
        if self.partners and set(self.partners) != set(self.hosts):
            raise ConfigError(
                f"partners must give every host a partner or none: missing for "
                f"{[h for h in self.hosts if h not in self.partners]}"
            )
        local = [0] * len(self.rank_hosts)
        for ranks in ranks_on.values():
            for i, rank in enumerate(ranks):
                local[rank] = i
        # Frozen: the derived lookups are set once, here. Copies of the mappings keep it immutable.
        object.__setattr__(self, "rank_hosts", tuple(self.rank_hosts))
        object.__setattr__(self, "hosts", tuple(self.hosts))
        object.__setattr__(self, "partners", MappingProxyType(dict(self.partners)))
        object.__setattr__(self, "domains", MappingProxyType({h: self.domains[h] for h in self.hosts}))
        object.__setattr__(self, "_ranks_on", MappingProxyType({h: tuple(r) for h, r in ranks_on.items()}))
        object.__setattr__(self, "_local_index", tuple(local))
        partner_rank = []
        if self.partners:
            for rank, host in enumerate(self.rank_hosts):
                theirs = ranks_on[self.partners[host]]
                partner_rank.append(theirs[local[rank] % len(theirs)])
        object.__setattr__(self, "_partner_rank", tuple(partner_rank))

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # Mapping proxies do not pickle; rebuild from plain dicts (the derived fields are recomputed).
        return (Topology, (self.rank_hosts, self.hosts, dict(self.partners), dict(self.domains)))

    @property
    def world_size(self) -> int:
        return len(self.rank_hosts)

    def host_of(self, rank: int) -> str:
        """The host ``rank`` runs on."""
        self._check_rank(rank)
        return self.rank_hosts[rank]

    def ranks_on(self, host: str) -> tuple[int, ...]:
        """The ranks running on ``host``, ascending."""
        try:
            return self._ranks_on[host]
        except KeyError:
            raise ConfigError(f"no rank runs on host {host!r}; hosts are {list(self.hosts)}") from None

    def leader(self, host: str) -> int:
        """The lowest rank on ``host``: the one that speaks for the host (its tier, its inventory)."""
        return self.ranks_on(host)[0]

    def local_index(self, rank: int) -> int:
        """Position of ``rank`` among :meth:`ranks_on` its host."""
        self._check_rank(rank)
        return self._local_index[rank]

    def partner(self, host: str) -> str:
        """The host that receives ``host``'s replicas; ConfigError when replication is off."""
        try:
            return self.partners[host]
        except KeyError:
            self.ranks_on(host)
            raise ConfigError(
                f"host {host!r} has no partner: this topology was built without replication"
            ) from None

    def partner_rank(self, rank: int) -> int:
        """The rank on the partner host that receives ``rank``'s replicas.

        It is the partner host's rank whose local index equals ``local_index(rank)`` modulo the
        partner host's rank count: equal-sized hosts pair their ranks one to one.
        """
        self.partner(self.host_of(rank))
        return self._partner_rank[rank]

    @property
    def partner_ranks(self) -> tuple[int, ...]:
        """:meth:`partner_rank` of every rank, by rank (one lookup each); empty without partners."""
        return self._partner_rank

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < len(self.rank_hosts):
            raise ConfigError(f"rank {rank} is outside this job of {len(self.rank_hosts)} ranks")


def build_topology(
    rank_hosts: Sequence[str],
    *,
    scheme: str = "ring",
    domains: Mapping[str, str] | None = None,
    replicate: bool = True,
) -> Topology:
    """The topology of a job whose rank ``r`` runs on host ``rank_hosts[r]``.

    ``domains`` maps each host to its failure domain (default: each host is its own).
    With ``replicate`` every host gets a partner in another failure domain by ``scheme``
    (see the module docstring); without it ``partners`` is empty.
    Raises :class:`~shoal.errors.ConfigError` for an empty job, an unknown scheme, a host
    missing from ``domains``, replication with one host, or a host with no other domain.
    """
    rank_hosts = tuple(rank_hosts)
    if not rank_hosts:
        raise ConfigError("cannot build a topology for a job of no ranks (rank_hosts is empty)")
    bad = sorted({repr(h) for h in rank_hosts if not isinstance(h, str) or not h})
    if bad:
        raise ConfigError(f"host ids must be non-empty strings, got {', '.join(bad)}")
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown partner scheme {scheme!r}: use one of {', '.join(map(repr, SCHEMES))}")
    hosts = tuple(dict.fromkeys(rank_hosts))
    if domains is None:
        dom = {h: h for h in hosts}
    else:
        missing = [h for h in hosts if h not in domains]
        if missing:
            raise ConfigError(
                f"domains gives no failure domain for hosts {missing} (it covers {sorted(domains)})"
            )
        dom = {h: domains[h] for h in hosts}
    partners: dict[str, str] = {}
    if replicate:
        n = len(hosts)
        if n < 2:
            raise ConfigError(
                f"replication needs at least two hosts, and this job has one: {hosts[0]!r}; "
                f"use path='direct' (or simulate hosts with SHOAL_HOST_ID)"
            )
        for i, host in enumerate(hosts):
            start = (i + 1) % n if scheme == "ring" else (i + n // 2) % n
            order = (hosts[(start + k) % n] for k in range(n))
            partner = next((h for h in order if h != host and dom[h] != dom[host]), None)
            if partner is None:
                raise ConfigError(
                    f"host {host!r} has no possible partner: every host of this job is in its "
                    f"failure domain {dom[host]!r}, and partners must be in different domains"
                )
            partners[host] = partner
    return Topology(rank_hosts, hosts, partners, dom)


__all__ = ["SCHEMES", "Topology", "build_topology", "topology_for_path"]


def topology_for_path(
    rank_hosts: Sequence[str], *, path: str, scheme: str = "ring", domains: Mapping[str, str] | None = None
) -> Topology:
    """The job's topology, with partners wherever the job can have them (``Config.path`` given).

    ``path="partner"`` requires them (a one-host job, or hosts all in one failure domain, is a
    :class:`~shoal.errors.ConfigError` naming why); otherwise a job without possible partners
    simply has none, and its checkpoints take the direct path.
    """
    if path == "partner":
        return build_topology(rank_hosts, scheme=scheme, domains=domains, replicate=True)
    if len(set(rank_hosts)) > 1:
        try:
            return build_topology(rank_hosts, scheme=scheme, domains=domains, replicate=True)
        except ConfigError as e:
            log.info("no partner copies possible in this job (%s): checkpoints take the direct path", e)
    return build_topology(rank_hosts, scheme=scheme, domains=domains, replicate=False)
