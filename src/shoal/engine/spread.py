"""A load's chunks over the fabric while they are read: one :class:`Spread` per exchange.

The plan (:func:`~shoal.group.exchange.plan_exchange`) says which rank sends which chunk to
whom, in the order each reader reads its chunks. A :class:`Spread` posts every receive of this
rank at once, straight into the chunks' destinations, before the reads start; the restore
tells it of each chunk it has read (:meth:`Spread.ready`; a chunk only other ranks need is not
checked by its reader: its receivers check it), and it posts that
chunk's sends as soon as every chunk before it in the plan's order has gone: the fabric carries
one chunk while the next is read. :meth:`Spread.finish` sends what is left (in place of a chunk
this rank failed to read, a placeholder of its length, so no receiver waits forever; its
receivers find it does not verify, and the restore sends the repaired chunk again), then takes
its receives: verifies each chunk before it is used or placed elsewhere, and forwards each one
it relays within its host as soon as it has it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from shoal.errors import ChecksumMismatch
from shoal.format.chunking import verify
from shoal.group.exchange import ExchangePlan
from shoal.group.fabric import Fabric

__all__ = ["Spread", "SpreadTotals"]


class SpreadTotals:
    """Bytes a rank received over the fabric and verified: all, and those a relay forwarded."""

    def __init__(self) -> None:
        self.fabric = 0
        self.relayed = 0


class Spread:
    """One exchange of a load's chunks over ``fabric`` (see the module).

    ``places[d]``: the buffers chunk ``d`` goes to on this rank (a receive lands in the first);
    ``lengths[d]``: its length; ``describe(d, how)``: the chunk, for an error message.
    """

    def __init__(
        self,
        fabric: Fabric,
        plan: ExchangePlan,
        places: Mapping[str, list[memoryview]],
        lengths: Mapping[str, int],
        describe: Callable[[str, str], str],
        totals: SpreadTotals,
    ) -> None:
        me = fabric.rank
        self._fabric = fabric
        self._places = places
        self._lengths = lengths
        self._describe = describe
        self._totals = totals
        self._sends = plan.sends_at(me)
        self._mine = {x.digest for x in self._sends}
        self._next = 0
        self._ready: dict[str, memoryview] = {}
        self._works: list[Any] = []
        self._incoming = plan.incoming_at(me)
        self._forwards = plan.forwards_at(me)
        self._receives = fabric.post_receives([(x.src, places[x.digest][0]) for x in self._incoming])

    def ready(self, digest: str, chunk: memoryview) -> None:
        """This rank has read ``digest`` (``chunk``: bytes that stay as they are until :meth:`finish`
        returns); post its sends once those before it have gone."""
        if digest not in self._mine:
            return
        self._ready[digest] = chunk
        sends = self._sends
        batch = []
        while self._next < len(sends) and sends[self._next].digest in self._ready:
            x = sends[self._next]
            batch.append((x.dst, [self._ready[x.digest]]))
            self._next += 1
        if batch:
            self._works += self._fabric.post_sends(batch)

    def finish(self) -> dict[str, str]:
        """Send the rest, take every receive; returns, per chunk that arrived spoiled, what was wrong.

        A chunk this rank was to send but does not have goes as a placeholder of its length."""
        rest = self._sends[self._next :]
        self._next = len(self._sends)
        for x in rest:
            if x.digest not in self._ready:  # one placeholder per chunk, however many it goes to
                self._ready[x.digest] = memoryview(bytearray(self._lengths[x.digest]))
        self._works += self._fabric.post_sends([(x.dst, [self._ready[x.digest]]) for x in rest])
        errors: dict[str, str] = {}
        for x, work in zip(self._incoming, self._receives, strict=True):
            work.wait()
            view = self._places[x.digest][0]
            if x.digest in self._forwards:
                self._works += self._fabric.post_sends([(dst, [view]) for dst in self._forwards[x.digest]])
            how = f"from rank {x.src}" + (" (relayed within the host)" if x.relayed else "")
            try:
                verify(view, x.digest, partial(self._describe, x.digest, how))
            except ChecksumMismatch as e:
                errors[x.digest] = str(e)
                continue
            for p in self._places[x.digest]:
                if p is not view:
                    p[:] = view
            self._totals.fabric += view.nbytes
            self._totals.relayed += view.nbytes if x.relayed else 0
        self._fabric.wait_all(self._works)
        self._works = []
        return errors
