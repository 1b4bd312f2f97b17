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


class FaultyReader(shoal_dcp.StorageReader):
    """shoal's reader, failing ``read_metadata`` or ``read_data`` on ``ranks``."""

    def __init__(self, ckpt: shoal.Checkpointer, step: int | None, phase: str, ranks: Sequence[int]) -> None:
        super().__init__(ckpt, step)
        self.phase = phase
        self.fail_here = ckpt.rank in ranks

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail_here and self.phase == "read_metadata":
            raise InjectedDcpFault("injected fault in read_metadata")
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: Any, planner: Any) -> Any:
        if self.fail_here and self.phase == "read_data":
            raise InjectedDcpFault("injected fault in read_data")
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


def load_faults_then_good_load(
    rank: int, world: int, *, root: str, faults: Sequence[tuple[str, Sequence[int]]]
) -> dict[str, Any]:
    """Save once; for each load fault, a failing dcp.load, then a good one, bit for bit."""
    seen: dict[str, str] = {}
    with shoal.Checkpointer(group_config(root, collective_timeout=15.0)) as ckpt:
        state = state_for(rank, 1)
        ckpt.save(1, state).wait(shoal.Boundary.RESTARTABLE, timeout=120)
        for phase, ranks in faults:
            label = f"{phase}@{','.join(map(str, ranks))}"
            try:
                dcp.load(zeros_like_state(state), storage_reader=FaultyReader(ckpt, 1, phase, ranks),
                         no_dist=world == 1)  # fmt: skip
                seen[label] = "no error"
            except (CheckpointException, InjectedDcpFault) as e:
                seen[label] = type(e).__name__
            target = zeros_like_state(state)
            dcp.load(target, storage_reader=shoal_dcp.StorageReader(ckpt, 1), no_dist=world == 1)
            assert_state_equal(target, state)
        ckpt.save(2, state_for(rank, 2)).wait(shoal.Boundary.RESTARTABLE, timeout=120)
    return {"errors": seen}
