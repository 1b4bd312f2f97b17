"""The fabric: shoal's background process group, for the pipeline's control messages and chunk transfers.

Created once, at start-up, by every rank (``Fabric.create`` is collective): a gloo
group with its own timeout, separate from the training's default group, so that
the pipeline's collectives never interleave with the training's. Every method
below is collective over that group unless it says otherwise, and every rank
calls them in the same order: the pipeline handles checkpoints one at a time,
in step order, on every rank. With one rank, everything is local.
"""

from __future__ import annotations

import datetime
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# A chunk sent from a tier's own (read-only, mapped) bytes is wrapped as a tensor only to be sent:
# nothing writes through it, so torch's warning that it could would only worry the user.
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning, __name__)

_OPEN = "open"
_CLOSED = "closed: "
_LATE = "late: "


@dataclass(frozen=True)
class Arrival:
    """How a :meth:`Board.arrive` ended: every rank came (both fields empty), or not."""

    missing: list[int]
    """Ranks that had not arrived when the wait ran out (the arriving rank closed the gate)."""
    closed: str | None
    """The gate's note when it was closed: ``"closed: ..."`` (a rank failed, or made another call)
    or ``"late: ..."`` (a rank waited ``timeout`` for the others)."""

    @property
    def complete(self) -> bool:
        return not self.missing and self.closed is None

    @property
    def late(self) -> bool:
        """Whether the arrival ended because some rank did not come in time (here or on another rank)."""
        return bool(self.missing) or (self.closed or "").startswith(_LATE)

    @property
    def note(self) -> str:
        """The closing note without its kind (empty when complete)."""
        return (self.closed or "").removeprefix(_LATE).removeprefix(_CLOSED)


class Board:
    """Decisions every rank can read without a collective: a key-value board on the job's store.

    A decision is posted once (the first post wins; later posts read it back), and read
    without blocking, so a rank waiting for one never sits inside a collective that a
    rank which never comes would leave half done. Backed by torch.distributed's default
    store (the rendezvous store every job already has), under a prefix of shoal's own.
    """

    def __init__(self, store: Any) -> None:
        self._store = store

    @classmethod
    def for_job(cls, prefix: str) -> Board | None:
        """The board of this job (None without torch.distributed or with one rank)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        # torch.distributed has no public accessor for the default group's store; this is the
        # one place shoal uses it.
        default = dist.distributed_c10d._get_default_store()
        return cls(dist.PrefixStore(prefix, default))

    def scoped(self, rank: int) -> Board:
        """This board under a prefix of its own for the next user on this rank (every rank alike).

        Each rank counts the users it opened on the board (one ``Runtime`` each, built
        collectively, so the count is the same on every rank): the keys of a closed
        Checkpointer's arrivals and gates, which stay on the store, are never met again by the
        next one of the same run.
        """
        opened = int(self._store.add(f"opened/r{rank}", 1))
        return Board(dist.PrefixStore(f"o{opened}/", self._store))

    def post(self, key: str, value: str) -> str:
        """Post ``value`` under ``key`` unless a decision is there already; return the decision."""
        got = self._store.compare_set(key, "", value)
        return bytes(got).decode() if not isinstance(got, str) else got

    def arrive(
        self,
        key: str,
        rank: int,
        world_size: int,
        timeout: float,
        *,
        call: str | None = None,
        late: Callable[[list[int]], str] | None = None,
    ) -> Arrival:
        """Wait (without a collective) until every rank arrived at ``key``, or the arrival was closed.

        The last rank to arrive opens the arrival's gate for everyone. A rank that will never
        come can close it first (:meth:`close`, with a note saying why): everyone waiting, and
        everyone who arrives later, then gets the note at once instead of waiting ``timeout``.
        With ``call`` (what this rank is doing, e.g. ``"save(5)"``), the first rank's call is
        kept and a rank that arrives with another closes the gate, naming both. A rank missing
        at ``timeout`` closes the gate too, so the ranks that come later fail alike; ``late``
        words its note from the missing ranks.

        Never starts a collective, so a rank that never comes leaves none half done. Every
        arrival costs a few store round trips, then one a poll: from 1 ms apart, backing off to
        20 ms (the store's own blocking wait would hold this process's store connection, which
        the pipeline thread's gates share, for as long as it waits).
        """
        gate = f"{key}/gate"
        if call is not None:
            first = self.post(f"{key}/call", call)
            if first != call:
                note = f"rank {rank} called {call} where another rank called {first}"
                return Arrival(missing=[], closed=self.close(key, note))
        self._store.set(f"{key}/r{rank}", "1")
        if int(self._store.add(f"{key}/count", 1)) >= world_size:
            self.post(gate, _OPEN)
        deadline = time.monotonic() + timeout
        pause = 0.001
        while not self._store.check([gate]):
            if time.monotonic() >= deadline:
                missing = [r for r in range(world_size) if not self._store.check([f"{key}/r{r}"])]
                note = late(missing) if late else f"ranks {missing} did not arrive within {timeout:.0f} s"
                decided = self.post(gate, _LATE + note)
                if decided == _OPEN:  # the last one came just now
                    return Arrival(missing=[], closed=None)
                return Arrival(missing=missing, closed=decided)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        final = self.peek(gate)
        return Arrival(missing=[], closed=None if final == _OPEN else final)

    def close(self, key: str, note: str) -> str:
        """Close the arrival at ``key`` with ``note`` unless its gate was decided; return the decision."""
        return self.post(f"{key}/gate", _CLOSED + note)

    def peek(self, key: str) -> str | None:
        """The decision under ``key``, or None if none was posted yet (never blocks)."""
        if not self._store.check([key]):
            return None
        got = self._store.get(key)
        return bytes(got).decode() if not isinstance(got, str) else got


class Fabric:
    """Collectives and point-to-point chunk streams of one rank."""

    def __init__(
        self, group: Any, rank: int, world_size: int, global_ranks: Sequence[int] | None = None
    ) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._global = tuple(global_ranks) if global_ranks is not None else None
        """The job's rank of each of this fabric's ranks, for a fabric over some of the job's ranks."""

    def _peer(self, r: int) -> int:
        """The job's rank of this fabric's rank ``r`` (point-to-point calls name the job's ranks)."""
        return r if self._global is None else self._global[r]

    @classmethod
    def subgroups(cls, groups: Sequence[Sequence[int]], timeout: float) -> Fabric | None:
        """Collective (every rank of the job, the same ``groups`` in the same order): a gloo group
        for each list of the job's ranks; this rank's fabric over the one it is in (None if none)."""
        mine: Fabric | None = None
        me = dist.get_rank()
        for ranks in groups:
            group = dist.new_group(
                ranks=list(ranks), backend="gloo", timeout=datetime.timedelta(seconds=timeout)
            )
            if me in ranks:
                mine = cls(group, list(ranks).index(me), len(ranks), ranks)
        return mine

    @classmethod
    def create(cls, timeout: float) -> Fabric:
        """Collective (every rank, once): the background gloo group, or a local fabric for one process."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(None, 0, 1)
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        return cls(group, dist.get_rank(), dist.get_world_size())

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj``, in rank order, at the coordinator; None elsewhere."""
        if self.group is None:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(obj, out, dst=self._peer(0), group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank."""
        if self.group is None:
            return obj
        box = [obj if self.is_coordinator else None]
        dist.broadcast_object_list(box, src=self._peer(0), group=self.group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def post_sends(self, sends: Sequence[tuple[int, Iterable[memoryview]]]) -> list[Any]:
        """Post every chunk of ``sends`` (``(dst rank, chunk views)``) without waiting; return the works.

        The views (slices of the DRAM slab) are sent as they are, without copies, and must
        stay untouched until :meth:`wait_all` returns. Sends are posted before any receive,
        so two hosts that send to each other cannot deadlock.
        """
        if self.group is None:
            if sends:
                raise RuntimeError("a one-rank fabric has no peers to send chunks to")
            return []
        return [
            dist.isend(torch.frombuffer(view, dtype=torch.uint8), dst=self._peer(dst), group=self.group)
            for dst, views in sends
            for view in views
        ]

    def post_receives(self, receives: Sequence[tuple[int, memoryview]]) -> list[Any]:
        """Post a receive for each ``(src rank, buffer)`` without waiting; return the works, in order.

        Each chunk lands straight in its buffer (it must be writable and stay untouched until
        its work's ``wait()`` returns). Messages from one rank match these in the order posted,
        after any receive posted before; both sides know the lengths, so no headers travel.
        """
        if receives and self.group is None:
            raise RuntimeError("a one-rank fabric has no peers to receive chunks from")
        return [
            dist.irecv(torch.frombuffer(buf, dtype=torch.uint8), src=self._peer(src), group=self.group)
            for src, buf in receives
        ]

    def receive(
        self, receives: Sequence[tuple[int, Sequence[int]]], scratch: bytearray
    ) -> Iterator[memoryview]:
        """Receive chunks: ``(src rank, chunk lengths)`` in order; yield each chunk's bytes.

        Both sides know the lengths from the plan, so no headers travel. Each yielded view
        lives in ``scratch`` (at least one chunk long) and is valid until the next one: data
        moves in bounded buffers, never the whole state at once.
        """
        if receives and self.group is None:
            raise RuntimeError("a one-rank fabric has no peers to receive chunks from")
        for src, lengths in receives:
            for n in lengths:
                buf = torch.frombuffer(scratch, dtype=torch.uint8, count=n)
                dist.recv(buf, src=self._peer(src), group=self.group)
                yield memoryview(scratch)[:n]

    @staticmethod
    def wait_all(works: Sequence[Any]) -> None:
        """Wait for posted sends (not collective)."""
        for work in works:
            work.wait()
