"""Where a replay rank sits: its serving instance, its tensor-parallel rank, its host, and the
fabric path to the other hosts (docs/kv_replay.md, "Hosts, instances and the fabric path").

The job's ranks are ``instances x tp``; instance ``i`` is ranks ``i*tp .. i*tp+tp-1``, all on one
host (the launchers place ranks host-major, ``tp`` divides the ranks per host). :func:`form` is
collective over the whole job, once, before the replay: the instances' gloo subgroups, the job's
peer token, and every rank's peer server endpoint. Nothing here is on a request's path except
:meth:`Instance.agree` (one all-gather inside the instance, TP > 1 only).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import ConfigError
from shoal.group.fabric import Fabric
from shoal.kv.peers import PeerClient, PeerDirectory, PeerEndpoint, PeerServer

__all__ = ["Instance", "form", "host_id", "start_peers"]


def host_id() -> str:
    """This process's host (``$SHOAL_HOST_ID``, set by both launchers), ``h0`` by default."""
    return os.environ.get("SHOAL_HOST_ID") or "h0"


def _fabric_addr() -> str:
    """The address this host's peers reach it at: its fabric link on the emulated cluster."""
    i = os.environ.get("SHOAL_CLUSTER_HOST")
    if i is None:
        return "127.0.0.1"
    from shoal.testing.cluster.hosts import Cluster

    return Cluster.fabric_addr(int(i))


@dataclass
class Instance:
    """One rank's place in the job."""

    rank: int
    world: int
    tp: int
    host: str
    hosts: tuple[str, ...]
    """Every rank's host, in rank order."""
    fabric: Fabric | None = None
    """The instance's ranks (TP > 1), for grouped reads and :meth:`agree`."""
    token: str = ""
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def index(self) -> int:
        return self.rank // self.tp

    @property
    def instances(self) -> int:
        return self.world // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def leader(self) -> bool:
        """The instance's rank that keeps blocks and reports the instance's requests."""
        return self.tp_rank == 0

    @property
    def multi_host(self) -> bool:
        return len(set(self.hosts)) > 1

    def agree(self, n: int) -> int:
        """The smallest ``n`` over the instance's ranks (each rank must call it alike)."""
        if self.fabric is None:
            return n
        return min(int(x) for x in self.fabric.all_gather(n))


def form(rank: int, world: int, tp: int, timeout: float = 300.0) -> Instance:
    """Collective over the job: this rank's :class:`Instance` (module docstring)."""
    import torch.distributed as dist

    if tp < 1 or world % tp:
        raise ConfigError(f"the replay's world of {world} ranks is not a whole number of TP {tp} instances")
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, host_id())
    for i in range(0, world, tp):
        if len(set(hosts[i : i + tp])) != 1:
            raise ConfigError(f"instance {i // tp}'s ranks are on hosts {hosts[i : i + tp]}: one host each")
    box = [secrets.token_hex(16) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    fabric = Fabric.subgroups([range(i, i + tp) for i in range(0, world, tp)], timeout) if tp > 1 else None
    return Instance(rank, world, tp, host_id(), tuple(hosts), fabric, str(box[0]))


def start_peers(inst: Instance, sources: list[Any], timeout_s: float) -> tuple[PeerServer, PeerClient]:
    """Collective over the job: every rank serves its host's ``sources`` to the other hosts and
    gets a client that knows every rank's endpoint (one all-gather, before the replay)."""
    import torch.distributed as dist

    directory = PeerDirectory()
    server = PeerServer(sources, host=inst.host, token=inst.token, directory=directory, addr=_fabric_addr())
    eps: list[Any] = [None] * inst.world
    dist.all_gather_object(eps, (server.endpoint.host, server.endpoint.addr, server.endpoint.port))
    client = PeerClient(
        inst.host, [PeerEndpoint(*e) for e in eps], directory, token=inst.token, timeout_s=timeout_s,
        pick=inst.rank,
    )  # fmt: skip
    return server, client
