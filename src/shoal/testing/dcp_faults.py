"""DCP's own fault injection, with shoal's writer and reader (modelled on PyTorch's ``test_checkpoint.py``).

:class:`FaultyWriter` and :class:`FaultyReader` fail one named phase on chosen ranks: before
shoal's code runs (``write_data``, ``finish``, ``read_metadata``: the rank never reaches shoal)
or after it (``write_data_async``: shoal staged, then the write's future fails;
``finish_after``: shoal's finish ran, then the call fails). After each fault, the scenarios
check what a user relies on: the error reached every rank, nothing hangs, the DRAM slots are
given back, and the next save and load through DCP and through ``Checkpointer`` work bit for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.futures import Future

import shoal
from shoal import dcp as shoal_dcp
from shoal.testing.checkpoints import assert_state_equal, zeros_like_state
from shoal.testing.scenarios import group_config


class InjectedDcpFault(ValueError):
    """The error a faulty phase raises."""


class FaultyWriter(shoal_dcp.StorageWriter):
    """shoal's writer, failing ``phase`` on ``ranks``."""

    def __init__(self, ckpt: shoal.Checkpointer, step: int, phase: str, ranks: Sequence[int]) -> None:
        super().__init__(ckpt, step)
        self.phase = phase
        self.fail_here = ckpt.rank in ranks

    def _fail(self, phase: str) -> None:
        if self.fail_here and self.phase == phase:
            raise InjectedDcpFault(f"injected fault in {phase}")

    def write_data(self, plan: Any, planner: Any) -> Any:
        self._fail("write_data")
        fut = super().write_data(plan, planner)
        if self.fail_here and self.phase == "write_data_async":
            failed: Future[Any] = Future()
            failed.set_exception(InjectedDcpFault("injected fault in write_data (async)"))
            return failed
        return fut

    def finish(self, metadata: Any, results: Any) -> None:
        self._fail("finish")
        super().finish(metadata, results)
        self._fail("finish_after")


LOAD_FAULTS = (
    "set_up_storage_reader",
    "prepare_local_plan",
    "prepare_global_plan",
    "read_metadata",
    "read_data",
    "read_data_async",
)
"""The phases of PyTorch's own load fault injection (``FaultyStorageReader`` in its tests)."""


class FaultyReader(shoal_dcp.StorageReader):
    """shoal's reader, failing one phase of :data:`LOAD_FAULTS` on ``ranks``.

    As in PyTorch's fault injection, a faulty phase raises before shoal's code runs, so the
    failing rank never reaches shoal's collectives; ``read_data_async`` returns a failed future
    instead of reading (it raises nothing).
    """

    def __init__(self, ckpt: shoal.Checkpointer, step: int | None, phase: str, ranks: Sequence[int]) -> None:
        super().__init__(ckpt, step)
        self.phase = phase
        self.fail_here = ckpt.rank in ranks

    def _fail(self, phase: str) -> None:
        if self.fail_here and self.phase == phase:
            raise InjectedDcpFault(f"injected fault in {phase}")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        self._fail("read_metadata")
        return super().read_metadata(*args, **kwargs)

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._fail("set_up_storage_reader")
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        self._fail("prepare_local_plan")
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: Any) -> Any:
        self._fail("prepare_global_plan")
        return super().prepare_global_plan(plans)

    def read_data(self, plan: Any, planner: Any) -> Any:
        self._fail("read_data")
        if self.fail_here and self.phase == "read_data_async":
            failed: Future[Any] = Future()
            failed.set_exception(InjectedDcpFault("injected fault in read_data (async)"))
            return failed
        return super().read_data(plan, planner)


def state_for(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {
        "shared.weight": torch.arange(4096, dtype=torch.float32) + step,  # the same on every rank
        f"rank{rank}.shard": torch.randn(20 << 10, generator=g),
    }


SAVE_FAULTS = ("write_data", "write_data_async", "finish", "finish_after")


def _good_round(ckpt: shoal.Checkpointer, rank: int, step: int, *, coordinator_rank: int = 0) -> None:
    """A good dcp.save and dcp.load through shoal's writer and reader, then Checkpointer.save/load."""
    no_dist = ckpt.world_size == 1
    state = state_for(rank, step)
    writer = shoal_dcp.StorageWriter(ckpt, step)
    if coordinator_rank == 0:
        dcp.save(state, storage_writer=writer, planner=shoal_dcp.SavePlanner(), no_dist=no_dist)
    else:  # only the older entry point takes coordinator_rank (deprecated, still in torch 2.13)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dcp.save_state_dict(
                state, writer, coordinator_rank=coordinator_rank, planner=shoal_dcp.SavePlanner()
            )
    handle = writer.handle
    handle.wait(shoal.Boundary.RESTARTABLE, timeout=120)
    target = zeros_like_state(state)
    dcp.load(target, storage_reader=shoal_dcp.StorageReader(ckpt, step), no_dist=no_dist)
    assert_state_equal(target, state)
    managed = state_for(rank, step + 1)
    ckpt.save(step + 1, managed).wait(shoal.Boundary.RESTARTABLE, timeout=120)
    target = zeros_like_state(managed)
    assert ckpt.load(target) == step + 1
    assert_state_equal(target, managed)


def save_faults_then_good_rounds(
    rank: int, world: int, *, root: str, faults: Sequence[tuple[str, Sequence[int]]], repeats: int = 1
) -> dict[str, Any]:
    """For each ``(phase, failing ranks)``: ``repeats`` failing dcp.saves, then a good round.

    Returns, per fault, the error each failing save raised on this rank (class names).
    """
    cfg = group_config(root, dram_slots=2, collective_timeout=60.0)
    seen: dict[str, list[str]] = {}
    with shoal.Checkpointer(cfg) as ckpt:
        step = 10
        for phase, ranks in faults:
            label = f"{phase}@{','.join(map(str, ranks))}"
            for _ in range(repeats):
                writer = FaultyWriter(ckpt, step, phase, ranks)
                try:
                    dcp.save(
                        state_for(rank, step),
                        storage_writer=writer,
                        planner=shoal_dcp.SavePlanner(),
                        no_dist=world == 1,
                    )
                    seen.setdefault(label, []).append("no error")
                except CheckpointException as e:
                    seen.setdefault(label, []).append(type(e).__name__)
                except InjectedDcpFault as e:  # one process: DCP lets the error through as it is
                    seen.setdefault(label, []).append(type(e).__name__)
                step += 1
            _good_round(ckpt, rank, step + 100)
            step += 200
        assert ckpt.wait(timeout=120)
    return {"errors": seen}


def coordinator_rank_one(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """``dcp.save(..., coordinator_rank=1)`` with shoal's writer reaches B4 and loads back."""
    with shoal.Checkpointer(group_config(root)) as ckpt:
        _good_round(ckpt, rank, 5, coordinator_rank=1)
        return {"latest": ckpt.latest()}


def _dcp_load(
    target: dict[str, Any], reader: shoal_dcp.StorageReader, *, world: int, coordinator: int
) -> None:
    if coordinator == 0:
        dcp.load(target, storage_reader=reader, no_dist=world == 1)
        return
    with warnings.catch_warnings():  # only the older entry point takes coordinator_rank
        warnings.simplefilter("ignore", FutureWarning)
        dcp.load_state_dict(target, reader, coordinator_rank=coordinator)


def load_faults_then_good_load(
    rank: int,
    world: int,
    *,
    root: str,
    faults: Sequence[tuple[str, Sequence[int], int]],
    collective_timeout: float = 120.0,
) -> dict[str, Any]:
    """Save once; for each ``(phase, failing ranks, coordinator)``, a failing dcp.load, then a good one.

    Returns, per fault, what the failing load raised on this rank: the exception's class, and for
    DCP's ``CheckpointException`` the ranks it names with each one's original error (class and
    message). The good load after each fault is checked bit for bit here.
    """
    seen: dict[str, Any] = {}
    with shoal.Checkpointer(group_config(root, collective_timeout=collective_timeout)) as ckpt:
        state = state_for(rank, 1)
        ckpt.save(1, state).wait(shoal.Boundary.RESTARTABLE, timeout=120)
        for phase, ranks, coordinator in faults:
            label = f"{phase}@{','.join(map(str, ranks))}/c{coordinator}"
            try:
                _dcp_load(zeros_like_state(state), FaultyReader(ckpt, 1, phase, ranks),
                          world=world, coordinator=coordinator)  # fmt: skip
                seen[label] = {"raised": None}
            except CheckpointException as e:
                seen[label] = {"raised": type(e).__name__, "failures": _failures(e)}
            except InjectedDcpFault as e:  # one process: DCP lets the error through as it is
                seen[label] = {"raised": type(e).__name__}
            target = zeros_like_state(state)
            _dcp_load(target, shoal_dcp.StorageReader(ckpt, 1), world=world, coordinator=coordinator)
            assert_state_equal(target, state)
        ckpt.save(2, state_for(rank, 2)).wait(shoal.Boundary.RESTARTABLE, timeout=120)
    return {"errors": seen}


def _failures(e: CheckpointException) -> dict[int, tuple[str, str]]:
    """The ranks a ``CheckpointException`` names, each with its original error's class and message."""
    out: dict[int, tuple[str, str]] = {}
    for r, failure in e.failures.items():
        original = failure[0] if isinstance(failure, tuple) else failure
        out[int(r)] = (type(original).__name__, str(original))
    return out


def mismatched_dtype_on_one_rank(rank: int, world: int, *, root: str, bad_rank: int) -> dict[str, Any]:
    """Checkpointer.load where ``bad_rank``'s target holds one tensor in float16 (stored float32).

    Every rank's load raises what ``bad_rank``'s raised; then a load with ``cast=True`` casts, and
    a load into the right dtypes is bit-exact.
    """
    with shoal.Checkpointer(group_config(root, collective_timeout=120.0)) as ckpt:
        state = state_for(rank, 1)
        ckpt.save(1, state).wait(shoal.Boundary.RESTARTABLE, timeout=120)
        target = zeros_like_state(state)
        if rank == bad_rank:
            target["shared.weight"] = target["shared.weight"].half()
        raised: tuple[str, str] | None = None
        try:
            ckpt.load(target)
        except shoal.ShoalError as e:
            raised = (type(e).__name__, str(e))
        cast = zeros_like_state(state)
        if rank == bad_rank:
            cast["shared.weight"] = cast["shared.weight"].half()
        ckpt.load(cast, cast=True)
        expected = state["shared.weight"].to(cast["shared.weight"].dtype)
        cast_ok = bool(torch.equal(cast["shared.weight"], expected))
        good = zeros_like_state(state)
        ckpt.load(good)
        assert_state_equal(good, state)
    return {"raised": raised, "cast_ok": cast_ok}
