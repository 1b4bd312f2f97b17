"""shoal under PyTorch Distributed Checkpoint: ``StorageWriter``, ``StorageReader``, ``SavePlanner``.

DCP's planner decides *what* is written; these classes decide *where* the bytes go.
``StorageWriter`` stages every write item into the rank's DRAM slab (B1) and hands
the checkpoint to the background pipeline; ``StorageReader`` serves reads from the
checkpoint's manifest, verifying every chunk's BLAKE3 digest before the bytes reach
the state dict. Resharding (loading at another layout) works because reads are
expressed as DCP's offsets and lengths into saved items::

    import torch.distributed.checkpoint as dcp
    writer = shoal.dcp.StorageWriter(ckpt, step=100)
    dcp.save(state_dict, storage_writer=writer, planner=shoal.dcp.SavePlanner())
    writer.handle.wait(shoal.Boundary.RESTARTABLE)
    dcp.load(state_dict, storage_reader=shoal.dcp.StorageReader(ckpt, step=100))

Collective contract (DCP's own): every rank constructs one writer (reader) for
the same step and calls ``dcp.save`` (``dcp.load``); the coordinator alone calls
``finish``. Each writer is used for exactly one save.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import io
import logging
import os
import pickle
import re
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from shoal._torch_private import plan_caching
from shoal.boundary import Boundary
from shoal.engine.handle import SaveHandle
from shoal.engine.restore import LoadReport, Restore
from shoal.engine.runtime import Runtime
from shoal.engine.session import SaveSession
from shoal.errors import (
    BoundaryTimeout,
    CheckpointFailed,
    CollectiveMismatch,
    ConfigError,
    FormatError,
    RestoreFailed,
    StateError,
    StateMismatch,
    UnsupportedValue,
)
from shoal.format.crosscheck import check_metadata, item_dtype, item_key
from shoal.format.dcp_codec import decode_metadata
from shoal.format.manifest import ItemRecord, Manifest
from shoal.records.events import read_events
from shoal.records.stager import StageEntry

log = logging.getLogger(__name__)


class HasRuntime(Protocol):
    """What the writer and reader are given: a ``shoal.Checkpointer`` (anything with its runtime)."""

    @property
    def runtime(self) -> Runtime: ...


@runtime_checkable
class StagesState(Protocol):
    """A manager that drives ``dcp.save`` through a writer its own way (``shoal.Checkpointer``):
    :meth:`StorageWriter.stage` stages through it, with the manager's checks and its cost, when the
    writer's ``checkpointer`` is one. Otherwise ``stage`` calls ``dcp.save`` with :class:`SavePlanner`."""

    def stage_state(self, writer: StorageWriter, state_dict: Mapping[str, Any]) -> None: ...


__all__ = ["SavePlanner", "StorageReader", "StorageWriter", "item_key"]


def _is_shard(item: WriteItem) -> bool:
    td = item.tensor_data
    if td is None:
        return False
    return any(o != 0 for o in td.chunk.offsets) or tuple(td.chunk.sizes) != tuple(td.size)


@functools.cache
def _pinning_possible() -> bool:
    """Whether a CPU tensor can be pinned here (an accelerator exists); if not, none is."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return True
    return bool(torch.cuda.is_available())


def _layout_signature(state_dict: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What DCP's local save plan of the flattened ``state_dict`` depends on, or None if not only that.

    Per key: for a plain tensor its dtype, layout, device, shape, ``requires_grad`` and whether it
    is pinned (what DCP's ``TensorProperties`` records); for a non-tensor value only that it is one
    (a ``BYTE_IO`` item, serialised when written). A tensor subclass (DTensor, ShardedTensor) or
    anything with its own write items: None (never cached).
    """
    pinnable = _pinning_possible()
    out: list[tuple[Any, ...]] = []
    for key, v in state_dict.items():
        if type(v) is torch.Tensor:
            pinned = v.is_pinned() if pinnable else False
            out.append((key, v.dtype, v.layout, v.device, v.shape, v.requires_grad, pinned))
        elif isinstance(v, torch.Tensor) or hasattr(v, "__create_write_items__"):
            return None
        else:
            out.append((key,))
    return tuple(out)


@dataclasses.dataclass
class PlanCache:
    """The last local plan and global plan a :class:`SavePlanner` made in this process, by layout,
    and the stored keys of the last plan's items (:attr:`SavePlanner.plan_cache`)."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    local: tuple[tuple[Any, ...], bool, dict[str, Any], SavePlan] | None = None
    """(layout signature, is_coordinator, flattening mappings, the plan)."""
    global_: tuple[list[SavePlan], list[SavePlan], Metadata, bool] | None = None
    """(the local plans it was made from, the global plans, the metadata, ``balance``)."""
    keys: tuple[list[WriteItem], list[str]] | None = None
    """(a plan's item list, each item's stored key): the writer's keys, again for the same list."""
    hits: int = 0

    def item_keys(self, items: list[WriteItem]) -> list[str]:
        """Each write item's stored key; those of the last list again when ``items`` is that very
        list (a plan reused from this cache: its items are frozen)."""
        with self.lock:
            last = self.keys
        if last is not None and last[0] is items:
            return last[1]
        keys = [item_key(item.index, sharded=_is_shard(item)) for item in items]
        with self.lock:
            self.keys = (items, keys)
        return keys


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with name-replicated items balanced across hosts.

    DCP writes an item that several ranks hold under one name (a data-parallel
    replica) once. DCP's own choice balances bytes per *rank*; this planner
    balances them per *host* first (each host drains through one storage NIC),
    then per rank within the host, longest item first. The host of each rank's
    plan comes from shoal's :class:`StorageWriter` (``prepare_local_plan``); with
    another writer every rank counts as its own host. ``balance=False`` gives each such item to
    the lowest rank holding it instead (``Config.balance_drain``: for measuring the balance).
    """

    plan_cache: ClassVar[PlanCache] = PlanCache()
    """The process's plans by layout (DCP makes a new planner per save; the cache outlives it)."""

    def __init__(self, *args: Any, balance: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.balance = balance

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, the one made last time when the layout is the same (keys, dtypes,
        shapes, flags): an unchanged state is not planned again, item by item."""
        if plan_caching(self) or not self.flatten_state_dict:
            return super().create_local_plan()
        signature = _layout_signature(self.state_dict)
        cache = SavePlanner.plan_cache
        with cache.lock:
            hit = cache.local
        if (
            signature is not None
            and hit is not None
            and hit[0] == signature
            and hit[1] == self.is_coordinator
            and hit[2] == self.mappings
        ):
            self.plan = hit[3]
            cache.hits += 1
            return self.plan
        plan = super().create_local_plan()
        if signature is not None:
            with cache.lock:
                cache.local = (signature, self.is_coordinator, self.mappings, plan)
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plan and metadata, the ones made last time when every rank's local plan is
        the cached one (the same item lists and mappings; only one rank's plans are ever the same
        objects). The metadata object is then the same too: ``finish`` fills its storage data anew."""
        if plan_caching(self):
            return super().create_global_plan(all_plans)
        cache = SavePlanner.plan_cache
        with cache.lock:
            hit = cache.global_
        if hit is not None and hit[3] == self.balance and _same_plans(hit[0], all_plans):
            self.global_plan, self.metadata = hit[1], hit[2]
            cache.hits += 1
            return self.global_plan, self.metadata
        global_plan, metadata = super().create_global_plan(all_plans)
        with cache.lock:
            cache.global_ = (all_plans, global_plan, metadata, self.balance)
        return global_plan, metadata

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        if len(all_plans) == 1:
            return all_plans  # one rank holds every item: nothing to choose
        hosts = [
            p.storage_data if isinstance(p.storage_data, str) else f"rank-{i}"
            for i, p in enumerate(all_plans)
        ]
        holders: dict[MetadataIndex, list[int]] = defaultdict(list)
        size: dict[MetadataIndex, int] = {}
        for i, plan in enumerate(all_plans):
            for item in plan.items:
                holders[item.index].append(i)
                size[item.index] = item.tensor_storage_size() or 1
        host_load: dict[str, int] = defaultdict(int)
        rank_load = [0] * len(all_plans)
        keep: dict[MetadataIndex, int] = {}
        for index, plans in holders.items():
            if len(plans) == 1:
                keep[index] = plans[0]
                host_load[hosts[plans[0]]] += size[index]
                rank_load[plans[0]] += size[index]
        shared = sorted((ix for ix, ps in holders.items() if len(ps) > 1), key=lambda ix: (-size[ix], ix.fqn))
        for index in shared:
            if not self.balance:
                keep[index] = min(holders[index])
                continue
            chosen = min(holders[index], key=lambda i: (host_load[hosts[i]], rank_load[i], i))
            keep[index] = chosen
            host_load[hosts[chosen]] += size[index]
            rank_load[chosen] += size[index]
        return [
            dataclasses.replace(plan, items=[it for it in plan.items if keep[it.index] == i])
            for i, plan in enumerate(all_plans)
        ]


def _same_plans(cached: list[SavePlan], plans: list[SavePlan]) -> bool:
    """Whether ``plans`` hold the very item lists and mappings of ``cached``, and the same hosts."""
    return len(cached) == len(plans) and all(
        c.items is p.items and c.planner_data is p.planner_data and c.storage_data == p.storage_data
        for c, p in zip(cached, plans, strict=True)
    )


class StorageWriter(_DcpStorageWriter, AsyncStager):
    """Writes one checkpoint (``step``) of ``checkpointer`` through DCP.

    ``write_data`` (every rank) stages its items into the rank's DRAM slab and
    returns; ``finish`` (coordinator) records DCP's metadata and hands the
    checkpoint to the background pipeline, which reaches B3 and B4 later.
    After ``dcp.save`` returns, :attr:`handle` tracks the checkpoint.

    ``session``: the :class:`~shoal.engine.session.SaveSession` of a save whose owner drives
    ``dcp.save`` and submits the checkpoint once it returned (:meth:`shoal.Checkpointer.save`
    does). Without one, the writer opens a direct session of its own: the save is checked to be
    every rank's, and its checkpoint goes to the pipeline as soon as DCP's ``finish`` ran.

    **With** ``dcp.async_save``: the writer is also DCP's ``AsyncStager``. Given as
    ``storage_writer=`` (and no ``async_stager=``), it is what ``dcp.async_save`` stages with:
    :meth:`stage` plans and copies the state into the DRAM slab in the calling thread, exactly
    as :meth:`shoal.Checkpointer.save` does, so ``dcp.async_save`` returns at B1 after one copy
    (DCP makes none of its own). DCP's background save of the staged state then only waits: its
    future completes once the checkpoint reached ``durable_at`` (B2 ``REPLICATED``, B3
    ``PERSISTED`` or, the default, B4 ``RESTARTABLE``), and fails with DCP's
    ``CheckpointException`` around shoal's :class:`~shoal.errors.CheckpointFailed` when the
    checkpoint failed first (or :class:`~shoal.errors.BoundaryTimeout` after ``timeout``
    seconds). Both of DCP's checkpointer types work: with ``AsyncCheckpointerType.PROCESS`` the
    writer DCP sends to its checkpoint process follows the checkpoint in this rank's event log
    (``Config.event_log``). As with any writer, give ``dcp.async_save`` a process group of its own
    (``process_group=dist.new_group(backend="gloo")``): DCP's background save makes collectives.
    """

    _synchronize_after_execute = False  # stage() returns once the state is staged: nothing to wait for

    def __init__(
        self,
        checkpointer: HasRuntime,
        step: int,
        *,
        session: SaveSession | None = None,
        durable_at: Boundary = Boundary.RESTARTABLE,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        self.checkpointer = checkpointer
        self.step = step
        if not isinstance(durable_at, Boundary) or durable_at < Boundary.REPLICATED:
            raise ConfigError(
                f"StorageWriter(step {step}): durable_at must be Boundary.REPLICATED, PERSISTED or "
                f"RESTARTABLE (when dcp.async_save's future completes), got {durable_at!r}"
            )
        if timeout is not None and not timeout > 0:
            raise ConfigError(
                f"StorageWriter(step {step}): timeout must be None or > 0 seconds, got {timeout!r}"
            )
        self.durable_at = durable_at
        """The boundary at which ``dcp.async_save``'s future completes (see the class docstring)."""
        self.timeout = timeout
        """Seconds DCP's background save waits for :attr:`durable_at` (None: as long as it takes)."""
        if session is None:
            session = checkpointer.runtime.begin_save(step, direct=True)
        elif session.step != step:
            raise ConfigError(
                f"StorageWriter for step {step} was given the save session of step {session.step}"
            )
        self.session = session
        """The save this writer stages (see the class docstring)."""
        self.is_coordinator = True
        self._async: str | None = None
        """None; ``"staging"`` inside :meth:`stage`; ``"staged"`` after it (DCP's save only waits)."""
        self._staged_at = 0.0

    @property
    def handle(self) -> SaveHandle:
        """The checkpoint's :class:`SaveHandle` (available once ``write_data`` ran)."""
        return self.session.handle

    # -- DCP's AsyncStager ----------------------------------------------------------------------
    def stage(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Stage ``state_dict`` for ``dcp.async_save`` (every rank, collective): return at B1.

        Plans and copies the state into this rank's DRAM slab in the calling thread, as
        :meth:`shoal.Checkpointer.save` does (with its checks: a value the default load would
        refuse, two entries of one name), and hands the checkpoint to the pipeline. Returns an
        empty state: DCP's background save of it only waits for :attr:`durable_at`.
        """
        if self._async is not None:
            raise StateError(
                f"step {self.step}: this StorageWriter has staged its save already; make one per "
                "dcp.async_save"
            )
        self._async = "staging"
        try:
            manager = self.checkpointer
            if isinstance(manager, StagesState):
                manager.stage_state(self, state_dict)
            else:
                import torch.distributed.checkpoint as torch_dcp

                torch_dcp.save(dict(state_dict), storage_writer=self, planner=SavePlanner())
            self.session.submit()
        except BaseException as e:
            self._async = "failed"
            self.session.abort(e)
            raise
        self._async = "staged"
        self._staged_at = time.monotonic()
        return {}

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the state is staged."""

    def close(self) -> None:
        """Nothing to release: the DRAM slab belongs to the checkpointer."""

    def __reduce__(self) -> tuple[Any, ...]:
        """What DCP's checkpoint process (``AsyncCheckpointerType.PROCESS``) gets: a watcher."""
        if self._async != "staged":
            raise UnsupportedValue(
                f"step {self.step}: shoal's StorageWriter stages in the training process and cannot be "
                "sent to DCP's checkpoint process before it did: call dcp.async_save with "
                "storage_writer=<this writer> and without async_stager= (shoal stages the state itself)"
            )
        events = self.checkpointer.runtime.config.event_log
        if events is None:  # pragma: no cover - the runtime always sets one
            raise ConfigError("AsyncCheckpointerType.PROCESS needs Config.event_log")
        rank = self.checkpointer.runtime.rank
        return (
            _DurabilityWatch,
            (events, rank, self.step, int(self.durable_at), self._staged_at, self.timeout),
        )

    def _wait_durable(self) -> None:
        """DCP's background save (after :meth:`stage`): wait for :attr:`durable_at`, or raise."""
        self.handle.wait(self.durable_at, timeout=self.timeout)

    # -- DCP's StorageWriter -------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            raise ConfigError(
                "shoal.dcp.StorageWriter is addressed by (Checkpointer, step); call dcp.save without "
                f"checkpoint_id (got {checkpoint_id!r})"
            )

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """DCP's first call into the writer, on every rank: with ``dcp.save`` called directly,
        every rank must have called it (see :meth:`~shoal.engine.runtime.Runtime.enter_collective`).

        DCP catches what this raises and takes it into its own gather of the ranks' plans, which
        the ranks that never called ``dcp.save`` never join: so the error is logged here too,
        naming them, before DCP waits out the process group's timeout.
        """
        if self._async == "staged":
            return
        self.is_coordinator = is_coordinator
        try:
            self.session.enter()  # a no-op when Checkpointer.save entered it before dcp.save
        except CollectiveMismatch as e:
            log.error("%s", e)
            raise

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Tell shoal's SavePlanner which host this rank's plan comes from.
        return dataclasses.replace(plan, storage_data=self.checkpointer.runtime.host)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: Any) -> Future[list[WriteResult]]:
        if self._async == "staged":
            if plan.items:
                raise StateError(
                    f"step {self.step}: DCP's background save was given {len(plan.items)} items to write, "
                    "but this writer staged the state already (in dcp.async_save's stage)"
                )
            self._wait_durable()
            done: Future[list[WriteResult]] = Future()
            done.set_result([])
            return done
        entries: list[StageEntry] = []
        results: list[WriteResult] = []
        for item, key in zip(plan.items, SavePlanner.plan_cache.item_keys(plan.items), strict=True):
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                payload: Any = data.getbuffer() if isinstance(data, io.BytesIO) else bytes(data)
            else:
                payload = data  # no detach(): the stager copies under no_grad (a GIL round trip saved)
                if not isinstance(payload, torch.Tensor):
                    raise UnsupportedValue(
                        f"item {key!r}: the planner resolved a {type(data).__name__}, not a tensor"
                    )
            entries.append(StageEntry(key, payload))
        staged = self.session.stage(entries)
        sizes = {s.key: s.nbytes for s in staged} if staged is not None else {}
        for item, entry in zip(plan.items, entries, strict=True):
            results.append(
                WriteResult(index=item.index, size_in_bytes=sizes.get(entry.key, 0), storage_data=entry.key)
            )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._async == "staged":
            return  # the metadata of DCP's background save of the empty staged state: not the checkpoint's
        metadata.storage_data = {wr.index: wr.storage_data for rank in results for wr in rank}
        self.session.finish(metadata)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


class _DurabilityWatch(_DcpStorageWriter):
    """The writer DCP's checkpoint process runs after :meth:`StorageWriter.stage` (``PROCESS`` type).

    It writes nothing: ``write_data`` follows the staging rank's event log (same host, same user:
    opened without following a symlink, and only if this user owns it; records after the stage,
    by the host's monotonic clock) until the step's ``boundary`` record
    reaches ``durable_at``, and raises :class:`~shoal.errors.CheckpointFailed` at its ``failed`` or
    ``skipped`` record.
    """

    _POLL = 0.05

    def __init__(
        self, events: str, rank: int, step: int, durable_at: int, since: float, timeout: float | None
    ) -> None:
        super().__init__()
        self.events, self.rank, self.step = events, rank, step
        self.durable_at = Boundary(durable_at)
        self.since, self.timeout = since, timeout

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: Any) -> Future[list[WriteResult]]:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            verdict = self._verdict()
            if verdict is None:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise BoundaryTimeout(
                    f"step {self.step}: {self.durable_at.label} not reached within {self.timeout} s "
                    f"(followed in {self.events})"
                )
            time.sleep(self._POLL)
        done: Future[list[WriteResult]] = Future()
        done.set_result([])
        return done

    def _verdict(self) -> str | None:
        """None once ``durable_at`` is reached; raises on failure; else what is awaited."""
        try:
            records = read_events(self.events, kinds=("boundary", "failed", "skipped"), private=True)
        except FileNotFoundError:
            return "the event log"
        for e in records:
            if e.step != self.step or e.rank != self.rank or e.mono is None or e.mono < self.since - 1.0:
                continue
            if e.event == "boundary" and Boundary[e.get("boundary")] >= self.durable_at:
                return None
            if e.event in ("failed", "skipped"):
                raise CheckpointFailed(
                    f"step {self.step} failed before {self.durable_at.label}: "
                    f"{e.get('error') or e.event} ({e.where})"
                )
        return self.durable_at.label

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def _writable_view(tensor: torch.Tensor) -> memoryview | None:
    """A byte view of a contiguous CPU tensor's memory, or None if it has no such view."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class StorageReader(_DcpStorageReader):
    """Reads checkpoint ``step`` (None: the newest restorable) of ``checkpointer`` through DCP.

    Collective like ``dcp.load`` itself: ``read_metadata`` takes the job's inventory and
    agrees on the checkpoint (its metadata may come from the shared tier or from a host's
    copy); ``read_data`` reads each chunk the ranks need once in the job, from the nearest
    surviving copy, and spreads it over the fabric (docs/design.md section 5). Every chunk is
    verified against its BLAKE3 digest before any of its bytes reach the state dict; a bad
    copy is replaced by another. Resharding works: reads are DCP's offsets and lengths into
    saved items. After ``dcp.load`` returns, :attr:`step` is the step loaded and
    :attr:`report` says which sources served it.

    Trust (docs/design.md section 11): before a byte is read, the manifest is checked against its
    own DCP metadata (:mod:`shoal.format.crosscheck`: kind, dtype, shape and size of every
    item), on every rank alike. Non-tensor items are unpickled with
    ``torch.load(weights_only=True)`` unless ``Config.allow_pickle`` (see :func:`_safe_payload`).

    A stored tensor is loaded into a target of its own dtype only: another dtype is a
    :class:`~shoal.errors.StateMismatch` naming the item, unless ``cast=True``.

    Errors: DCP's ``dcp.load`` turns any exception from ``read_metadata`` into its own
    ``AssertionError("metadata is None ...")``. So ``read_metadata`` never raises: it keeps the
    error (a missing checkpoint, a malformed manifest) and returns an empty ``Metadata``, and
    ``set_up_storage_reader`` (DCP's next call into the reader, on every rank) raises the
    error itself, as a :class:`~shoal.errors.ShoalError`.

    A load that fails on one rank fails on every rank at once, with that rank's error, as DCP's
    own reader does: ``read_metadata`` and ``read_data`` start collectives of shoal's, and a
    rank that fails before reaching them (in shoal's code, or in a subclass's override of
    either method: overrides are wrapped when the subclass is defined) tells the others on the
    job's store. They then skip the collective and return normally, so DCP's own gather of the
    ranks' results raises its ``CheckpointException`` on every rank naming the failing ranks
    only, and nothing waits for a timeout. The next load works as usual.
    """

    _phases = ("read_metadata", "read_data")
    """The methods that start shoal's collectives (each behind an arrival of every rank)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for phase in cls._phases:
            if phase in cls.__dict__:
                setattr(cls, phase, _reported(phase, cls.__dict__[phase]))

    def __init__(
        self,
        checkpointer: HasRuntime,
        step: int | None = None,
        *,
        cast: bool = False,
        session: Restore | None = None,
    ) -> None:
        super().__init__()
        self.cast = cast
        """Whether a stored tensor may be cast to its target's dtype (else a dtype mismatch is an error)."""
        self.checkpointer = checkpointer
        self.session = session
        manifest = session.manifest if session is not None else None
        self.step = step if manifest is None else manifest.step
        self._requested = step
        self.report: LoadReport | None = None
        self._checked: Metadata | None = None
        self._error: Exception | None = None
        self._peer_failed: str | None = None
        """Another rank's note when it failed this load before a collective of shoal's."""
        self._failed: dict[str, BaseException] = {}
        """Phases that failed on this rank (an override raised): DCP's second ask gets the same error."""
        # Every rank makes one reader per load, so the count names the load alike on every rank.
        self._sequence = checkpointer.runtime.next_load_sequence()
        if manifest is not None:  # chosen already (Checkpointer.load): refuse it before DCP starts
            self._checked = _checked_metadata(manifest)

    @property
    def bytes_read(self) -> int:
        return sum(self.report.bytes_by_tier.values()) if self.report else 0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            raise ConfigError(
                "shoal.dcp.StorageReader is addressed by (Checkpointer, step); call dcp.load without "
                f"checkpoint_id (got {checkpoint_id!r})"
            )

    def _manifest(self) -> Manifest:
        if self.session is None:
            # The choice is collective: enter it only once every rank is here (a rank whose
            # read_metadata failed before ours never comes; the others then fail alike).
            limit = self.checkpointer.runtime.config.collective_timeout
            closed = self.checkpointer.runtime.arrive(self._sequence, "read_metadata", limit)
            if closed is not None:
                raise _PeerFailed(closed)
            self.session = self.checkpointer.runtime.begin_restore(self._requested)
        assert self.session.manifest is not None
        return self.session.manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Collective: choose the checkpoint; its DCP metadata, checked against the manifest.

        Never raises (DCP would hide the error): see the class docstring.
        """
        if self._peer_failed is not None:
            return _placeholder_metadata()
        if self._checked is not None or self._error is not None:  # DCP may ask twice
            return self._checked or Metadata(state_dict_metadata={})
        try:
            manifest = self._manifest()
            self.step = manifest.step
            self._checked = _checked_metadata(manifest)
        except _PeerFailed as e:
            # Another rank failed before the choice: plan nothing real; DCP's gather reports it.
            self._peer_failed = str(e)
            return _placeholder_metadata()
        except Exception as e:
            self._error = e
            return Metadata(state_dict_metadata={})
        return self._checked

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._error is not None:
            raise self._error
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._peer_failed is not None:  # DCP went on after another rank's failure (it gathers next)
            return _failed_future(RestoreFailed(f"nothing was read: {self._peer_failed}"))
        if self.session is None or self.session.manifest is None:
            raise StateError("shoal.dcp.StorageReader: read_data was called before read_metadata")
        rt = self.checkpointer.runtime
        try:
            problem, dests, finishers = self._prepare_reads(plan, planner)
        except Exception as e:
            rt.abandon(self._sequence, "read_data", e)  # the others must not wait for this rank
            raise
        # Collective: every rank takes part, even with nothing to read or a bad plan; entered only
        # once every rank is here (DCP's plan scatter just synchronised them: a short wait).
        limit = min(60.0, rt.config.collective_timeout)
        closed = rt.arrive(self._sequence, "read_data", limit)
        fut: Future[None] = Future()
        if closed is not None:
            # A rank failed before reading (its own error reaches DCP's gather): read nothing.
            fut.set_result(None)
            return fut
        self.report = self.session.fetch(dests, problem=problem)
        for finish in finishers:
            finish()
        fut.set_result(None)
        return fut

    def _prepare_reads(
        self, plan: LoadPlan, planner: LoadPlanner
    ) -> tuple[str | None, dict[str, memoryview], list[Any]]:
        """Where each read item's bytes land: (a problem every rank reports, destinations, finishers)."""
        assert self.session is not None and self.session.manifest is not None
        manifest = self.session.manifest
        storage = self._metadata.storage_data or {}
        groups: dict[str, list[ReadItem]] = defaultdict(list)
        problem: str | None = None
        for ri in plan.items:
            key = storage.get(ri.storage_index)
            if not isinstance(key, str) or key not in manifest.items:
                problem = (
                    f"step {manifest.step}: DCP item {ri.storage_index.fqn!r} "
                    f"(offset {ri.storage_index.offset}) "
                    f"has no stored item in the manifest (storage key {key!r})"
                )
                break
            groups[key].append(ri)
        dests: dict[str, memoryview] = {}
        finishers: list[Any] = []
        if problem is None:
            how = _Reading(
                step=manifest.step,
                rank=self.checkpointer.runtime.rank,
                allow_pickle=self.checkpointer.runtime.config.allow_pickle,
                cast=self.cast,
            )
            for key, items in groups.items():
                finishers.append(_prepare_item(manifest.items[key], items, planner, dests, how))
        return problem, dests, finishers

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


class _PeerFailed(Exception):
    """Another rank failed this load before a collective of shoal's (its note, from the store)."""


class _AnyItem(dict[str, Any]):
    """State-dict metadata that holds every key, as a small opaque item: see :func:`_placeholder_metadata`."""

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: str) -> Any:
        return BytesStorageMetadata()


def _placeholder_metadata() -> Metadata:
    """What ``read_metadata`` returns after another rank failed before the checkpoint was chosen.

    DCP plans the load next and gathers every rank's plan; the gather raises the failing rank's
    error on every rank. So this rank's plan is never used, but it must be made without an
    error of this rank's own (DCP would name this rank too): every key is 'there', as an opaque
    item of no bytes, which DCP's default planner plans without a question.
    """
    return Metadata(state_dict_metadata=_AnyItem())


def _failed_future(error: BaseException) -> Future[None]:
    fut: Future[None] = Future()
    fut.set_exception(error)  # type: ignore[arg-type]  # torch's stub types it as the result
    return fut


def _reported(phase: str, method: Any) -> Any:
    """``method`` (a subclass's override of ``phase``), telling the other ranks when it fails.

    An exception escaping it, or a future it returns that fails, closes this load's arrival at
    ``phase`` on the job's store, so the ranks waiting there stop at once (see
    :meth:`StorageReader.read_data`). A failed phase asked again (DCP asks ``read_metadata``
    twice when the first call raised) raises the same error, without calling the override.
    """

    @functools.wraps(method)
    def wrapper(self: StorageReader, *args: Any, **kwargs: Any) -> Any:
        failed = self.__dict__.get("_failed", {}).get(phase)
        if failed is not None:
            raise failed
        try:
            out = method(self, *args, **kwargs)
        except BaseException as e:
            _report(self, phase, e)
            raise
        if isinstance(out, Future):
            out.add_done_callback(lambda f: _report_future(self, phase, f))
        return out

    return wrapper


def _report(reader: StorageReader, phase: str, error: BaseException) -> None:
    if "_sequence" not in reader.__dict__:  # the override ran before StorageReader.__init__
        return
    reader._failed[phase] = error
    reader.checkpointer.runtime.abandon(reader._sequence, phase, error)


def _report_future(reader: StorageReader, phase: str, fut: Future[Any]) -> None:
    try:
        fut.wait()
    except BaseException as e:
        _report(reader, phase, e)


def _checked_metadata(manifest: Manifest) -> Metadata:
    """``manifest``'s DCP metadata, decoded and checked against its items (FormatError if not)."""
    if manifest.dcp is None:
        raise FormatError(f"step {manifest.step} was not saved through DCP: its manifest has no DCP metadata")
    metadata = decode_metadata(manifest.dcp)
    check_metadata(manifest, metadata)
    return metadata


_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
_UNPICKLER_ERROR = re.compile(r"WeightsUnpickler error:\s*([^\n]+)")


def refusal_reason(message: str) -> str:
    """What torch's (long, multi-line) weights-only refusal says was wrong, in a few words."""
    found = _REFUSED_GLOBAL.search(message)
    if found:
        return f"{found.group(1)} is not an allowed global"
    reason = _UNPICKLER_ERROR.search(message)
    lines = [reason.group(1)] if reason else message.strip().splitlines()
    return lines[0].strip()[:200] if lines and lines[0].strip() else "no reason given"


def _safe_payload(data: bytes | bytearray | memoryview, key: str, step: int) -> bytes:
    """The ``torch.save`` payload of a non-tensor item, rebuilt from what the safe unpickler accepts.

    DCP hands a non-tensor item's bytes to ``planner.load_bytes``, and DCP's planners (and most
    others) unpickle them with ``torch.load(weights_only=False)``: a checkpoint anyone could
    write would run their code. So shoal unpickles the bytes first with
    ``torch.load(weights_only=True)`` (tensors, containers, numbers, strings and the classes
    the user allowed with ``torch.serialization.add_safe_globals``), pickles the object it got
    again with ``torch.save``, and hands *that* to the planner. The planner's unpickler then
    sees only objects the safe unpickler built, so this works with any planner, unchanged.
    The price is one more serialisation of these (usually small) items.

    Raises :class:`~shoal.errors.FormatError` naming item ``key`` and ``step`` when the safe
    unpickler refuses the bytes (saying how to opt in) or they are not a ``torch.save`` payload.
    """
    try:
        obj = torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        raise FormatError(
            f"item {key!r} of step {step}: the safe unpickler (torch.load(weights_only=True)) refuses it: "
            f"{refusal_reason(str(e))}. If you trust whoever could write this checkpoint, load it with "
            "shoal.Config(allow_pickle=True) (unsafe: unpickling runs code the writer chose), "
            "or allow its class with torch.serialization.add_safe_globals"
        ) from e
    except Exception as e:
        raise FormatError(
            f"item {key!r} of step {step}: {len(data)} bytes that are not a torch.save payload: "
            f"{type(e).__name__}: {str(e)[:200]}"
        ) from e
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


@dataclasses.dataclass(frozen=True)
class _Reading:
    """How one rank's load reads items: the step, the rank, and what the caller allowed."""

    step: int
    rank: int
    allow_pickle: bool
    cast: bool


def _prepare_item(
    rec: ItemRecord,
    items: list[ReadItem],
    planner: LoadPlanner,
    dests: dict[str, memoryview],
    how: _Reading,
) -> Any:
    """Choose where item ``rec``'s bytes land (``dests[key]``); return what completes the reads after.

    Raises :class:`~shoal.errors.StateMismatch` when a target tensor's dtype is not the stored
    one and ``how.cast`` is off.
    """
    step = how.step
    if rec.kind == "bytes":
        buf = bytearray(rec.nbytes)
        if rec.nbytes:
            dests[rec.key] = memoryview(buf)

        def finish_bytes() -> None:
            payload = buf if how.allow_pickle else _safe_payload(buf, rec.key, step)
            for ri in items:
                planner.load_bytes(ri, io.BytesIO(payload))

        return finish_bytes
    dtype = item_dtype(rec.dtype, rec.key)
    shape = tuple(rec.shape or ())
    targets = [planner.resolve_tensor(ri).detach() for ri in items]
    if not how.cast:
        for ri, target in zip(items, targets, strict=True):
            if target.dtype != dtype:
                raise StateMismatch(
                    f"load of step {step}, rank {how.rank}: item {ri.dest_index.fqn!r} is stored as "
                    f"{_describe(dtype, shape)} but its target is {_describe(target.dtype, None)}; "
                    f"load into a {str(dtype).removeprefix('torch.')} tensor, or allow the cast "
                    "(Checkpointer.load(..., cast=True), shoal.dcp.StorageReader(..., cast=True))"
                )
    direct: int | None = None
    for i, (ri, target) in enumerate(zip(items, targets, strict=True)):
        full = all(o == 0 for o in ri.storage_offsets) and tuple(ri.lengths) == shape
        view = _writable_view(target) if full else None
        if view is not None and target.dtype == dtype and view.nbytes == rec.nbytes:
            direct = i
            dests[rec.key] = view
            break
    whole = targets[direct] if direct is not None else torch.empty(shape, dtype=dtype)
    if direct is None and rec.nbytes:
        view = _writable_view(whole)
        if view is None:
            raise FormatError(f"item {rec.key!r}: {rec.nbytes} bytes but shape {shape} holds none")
        dests[rec.key] = view

    def finish_tensors() -> None:
        for i, (ri, target) in enumerate(zip(items, targets, strict=True)):
            if i != direct:
                src = whole
                for dim, (off, n) in enumerate(zip(ri.storage_offsets, ri.lengths, strict=True)):
                    src = src.narrow(dim, off, n)
                if tuple(target.shape) != tuple(src.shape):
                    src = src.reshape(target.shape)
                target.copy_(src)
            planner.commit_tensor(ri, target)

    return finish_tensors


def _describe(dtype: torch.dtype, shape: tuple[int, ...] | None) -> str:
    name = str(dtype).removeprefix("torch.")
    return name if shape is None else f"{name} {list(shape)}"
