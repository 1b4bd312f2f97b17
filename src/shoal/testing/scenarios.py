"""Multi-rank scenarios for tests and benchmarks, run with :func:`shoal.testing.multiproc.run_ranks`.

Each function runs on every rank of a gloo job whose ranks are grouped into simulated
hosts by ``SHOAL_HOST_ID``; each host has its own DRAM and local tiers under ``root``.
They return plain data (picklable) for the test process to assert on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shoal import failpoints
from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.config import Config
from shoal.engine.inventory import read_staged
from shoal.format import layout
from shoal.format.chunking import digest
from shoal.format.pack import decode_index
from shoal.records.events import read_events
from shoal.records.store import list_checkpoints
from shoal.testing.checkpoints import assert_state_equal, zeros_like_state
from shoal.tiers.dram import DramTier


def group_config(root: str, **overrides: Any) -> Config:
    """The config of every rank: shared, local and DRAM roots under ``root`` (host from ``SHOAL_HOST_ID``)."""
    kwargs: dict[str, Any] = {
        "shared": os.path.join(root, "shared"),
        "local": os.path.join(root, "local"),
        "dram": os.path.join(root, "dram"),
        "job": "test",
        "chunk_size": 64 << 10,
        "keep_last": None,
        "collective_timeout": 60.0,
    }
    kwargs.update(overrides)
    return Config(**kwargs)


def dp_state(
    rank: int, *, tensors: int = 8, numel: int = 32 << 10, shard_numel: int = 48 << 10
) -> dict[str, Any]:
    """A data-parallel model (identical on every rank) plus this rank's own optimizer shard."""
    g = torch.Generator().manual_seed(1234)
    model = {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(tensors)}
    g_rank = torch.Generator().manual_seed(10_000 + rank)
    optim = {f"shard{rank}.exp_avg": torch.randn(shard_numel, generator=g_rank)}
    return {"model": model, "optim": optim, "step": 0}


def _handle_summary(handle: Any) -> dict[str, Any]:
    return {
        "reached": int(handle.reached) if handle.reached else None,
        "times": {int(b): t for b, t in handle.times.items()},
        "error": None if handle.error is None else f"{type(handle.error).__name__}: {handle.error}",
        "failed_at": int(handle.failed_at) if handle.failed_at else None,
    }


def _run_dirs(base: str) -> list[tuple[str, str]]:
    """``(host, run directory)`` for every run directory under ``<tier root>/<job>``."""
    out = []
    for host in sorted(os.listdir(base)):
        runs = os.path.join(base, host, "runs")
        for run in sorted(os.listdir(runs)) if os.path.isdir(runs) else []:
            out.append((host, os.path.join(runs, run)))
    return out


def host_chunks(root: str, job: str = "test") -> dict[str, set[str]]:
    """Every chunk each simulated host holds, found by reading its tiers directly and re-hashing.

    DRAM: each slot's staged index (``staged/*.json``) and the bytes of its slab.
    Local: every pack through its index. Only chunks whose bytes hash to their digest count.
    """
    out: dict[str, set[str]] = {}
    for tier_name in ("dram", "local"):
        base = os.path.join(root, tier_name, job)
        if not os.path.isdir(base):
            continue
        for host, hdir in _run_dirs(base):
            held = out.setdefault(host, set())
            staged = os.path.join(hdir, "staged")
            records = (
                read_staged(DramTier(hdir, base=os.path.join(root, tier_name)))
                if os.path.isdir(staged)
                else []
            )
            for rec in records:
                with open(os.path.join(hdir, "slabs", rec.slab + ".slab"), "rb") as f:
                    slab = f.read()
                for item in rec.items:
                    for i, d in enumerate(item.chunks or ()):
                        start = item.offset + i * rec.chunk_size
                        end = item.offset + min(item.nbytes, (i + 1) * rec.chunk_size)
                        if digest(slab[start:end]) == d:
                            held.add(d)
            packs = os.path.join(hdir, layout.PACKS_DIR)
            for name in sorted(os.listdir(packs)) if os.path.isdir(packs) else []:
                if not name.endswith(".idx"):
                    continue
                with open(os.path.join(packs, name), "rb") as f:
                    index = decode_index(f.read(), name)
                with open(os.path.join(packs, index.pack_id + ".pack"), "rb") as f:
                    data = f.read()
                for e in index.entries:
                    if digest(data[e.offset : e.offset + e.length]) == e.digest:
                        held.add(e.digest)
    return out


def host_manifests(root: str, step: int, job: str = "test") -> dict[str, bool]:
    """Which hosts hold a manifest of ``step`` on their local or DRAM tier."""
    out: dict[str, bool] = {}
    for tier_name in ("dram", "local"):
        base = os.path.join(root, tier_name, job)
        for host, hdir in _run_dirs(base) if os.path.isdir(base) else []:
            path = os.path.join(hdir, layout.manifest_path(step))
            out[host] = out.get(host, False) or os.path.exists(path)
    return out


def save_dp_and_inspect(rank: int, world: int, *, root: str, delay_drain: float = 1.5) -> dict[str, Any]:
    """Save a DP model + optimizer shards; at B2 (drain held back) inspect the tiers; then B4 and reload."""
    cfg = group_config(root)
    state = dp_state(rank)
    failpoints.configure(f"pipeline.before_drain=delay:{delay_drain}")
    out: dict[str, Any] = {"rank": rank}
    with Checkpointer(cfg) as ckpt:
        handle = ckpt.save(1, state)
        handle.wait(Boundary.REPLICATED, timeout=60)
        torch.distributed.barrier()
        if rank == 0:  # every rank is at B2 and the drain is held back: look at the tiers as they are
            out["at_b2"] = {
                "chunks": {h: sorted(c) for h, c in host_chunks(root).items()},
                "manifests": host_manifests(root, 1),
                "shared_files": sorted(os.listdir(os.path.join(root, "shared", "test")))
                if os.path.isdir(os.path.join(root, "shared", "test"))
                else [],
            }
        torch.distributed.barrier()
        handle.wait(Boundary.RESTARTABLE, timeout=60)
        failpoints.configure(None)
        out["handle"] = _handle_summary(handle)
        ckpt.wait()
        out["replicating"] = ckpt.replicating
    torch.distributed.barrier()
    if rank == 0:
        with open(os.path.join(root, "shared", "test", layout.manifest_path(1)), "rb") as f:
            manifest = json.loads(f.read())
        out["manifest_chunks"] = sorted({d for item in manifest["items"].values() for d in item["chunks"]})
        out["stats"] = manifest["stats"]
        packs = os.path.join(root, "shared", "test", layout.PACKS_DIR)
        out["packs"] = {
            p: os.path.getsize(os.path.join(packs, p)) for p in os.listdir(packs) if p.endswith(".pack")
        }
        # the data loads from shared storage alone: drop every host's DRAM and local tiers
        for tier_name in ("dram", "local"):
            shutil.rmtree(os.path.join(root, tier_name), ignore_errors=True)
    torch.distributed.barrier()
    with Checkpointer(cfg) as fresh:
        target = zeros_like_state(state)
        out["loaded"] = fresh.load(target)
        assert_state_equal(target, state)
    return out


def frozen_second_checkpoint(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """Two checkpoints of a model whose parameters are 90% frozen between them; bytes written each time.

    The model (10 x 256 KiB) is the same on every rank; its optimizer state is sharded
    ZeRO-style (rank r keeps ``exp_avg`` of parameters r, r + world, ...). Between the
    checkpoints one parameter in ten trains, and with it its optimizer state.
    """
    cfg = group_config(root)
    g = torch.Generator().manual_seed(7)
    model = {f"p{i}": torch.randn(64 << 10, generator=g) for i in range(10)}
    shard = {
        f"exp_avg.p{i}": torch.randn(64 << 10, generator=torch.Generator().manual_seed(100 + i))
        for i in range(rank, 10, world)
    }
    out: dict[str, Any] = {}
    with Checkpointer(cfg) as ckpt:
        h1 = ckpt.save(1, {"model": model, "optim": shard})
        h1.wait(timeout=60)
        ckpt.wait()
        model["p3"].add_(1.0)  # one tenth of the parameters train; the rest are frozen
        if "exp_avg.p3" in shard:
            shard["exp_avg.p3"].mul_(0.5)
        h2 = ckpt.save(2, {"model": model, "optim": shard})
        h2.wait(timeout=60)
        ckpt.wait()
        out["handles"] = [_handle_summary(h1), _handle_summary(h2)]
        events = ckpt.config.event_log
    assert events is not None  # resolved: the local tier's events.jsonl by default
    out["events"] = [dict(e.fields) for e in read_events(events) if e.rank == rank]
    return out


def failing_drain(
    rank: int, world: int, *, root: str, bad_rank: int, fault: str = "pipeline.before_drain=raise"
) -> dict[str, Any]:
    """Step 1 commits; step 2's drain fails on ``bad_rank`` (failpoint spec ``fault``, armed in that
    rank's process only); training goes on and step 3 commits."""
    cfg = group_config(root)
    state = dp_state(rank)
    out: dict[str, Any] = {}
    with Checkpointer(cfg) as ckpt:
        ckpt.save(1, state).wait(timeout=60)
        if rank == bad_rank:
            failpoints.configure(fault)
        # Each rank's optimizer shard moved on: every rank has new bytes to drain.
        state2 = {**state, "optim": {k: v + 1 for k, v in state["optim"].items()}, "step": 2}
        second = ckpt.save(2, state2)
        try:
            second.wait(timeout=60)
        except Exception as e:
            out["second_error"] = f"{type(e).__name__}: {e}"
        failpoints.configure(None)
        out["second"] = _handle_summary(second)
        torch.distributed.barrier()
        shared = os.path.join(root, "shared")
        out["temp_files"] = [n for _, _, names in os.walk(shared) for n in names if ".tmp-" in n]
        out["latest_after_failure"] = ckpt.latest()
        target = zeros_like_state(state)
        out["loaded"] = ckpt.load(target, step=ckpt.latest())
        assert_state_equal(target, state)
        # Step 2 reached B2 (every chunk on two hosts) before its drain failed: it is restorable.
        out["newest"] = ckpt.load(target)
        assert_state_equal(target, state2)
        third = ckpt.save(3, {**state, "step": 3})
        third.wait(timeout=60)
        out["third"] = _handle_summary(third)
    return out


def state_bytes(state: Mapping[str, Any]) -> int:
    total = 0
    for v in state.values():
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, Mapping):
            total += state_bytes(v)
    return total


def bench_group_save(rank: int, world: int, *, root: str, mib_per_rank: int, repeats: int) -> dict[str, Any]:
    """Benchmark: each rank saves ``mib_per_rank`` MiB of its own data ``repeats`` + 1 times."""
    cfg = group_config(root, chunk_size=4 << 20, keep_last=2)
    n = mib_per_rank << 18  # float32 elements
    g = torch.Generator().manual_seed(rank)
    state = {f"r{rank}.t{i}": torch.randn(n // 8, generator=g) for i in range(8)}
    times, coordination = [], []
    with Checkpointer(cfg) as ckpt:
        for step in range(repeats + 1):
            for t in state.values():
                t[0] += 1.0
            h = ckpt.save(step, state)
            h.wait(timeout=600)
            ckpt.wait()
            if step:
                times.append({int(b): s for b, s in h.times.items()})
        events = ckpt.config.event_log
    assert events is not None  # resolved: the local tier's events.jsonl by default
    for e in read_events(events, kinds=["coordination"]):
        if e.rank == rank and (e.step or 0) > 0:
            coordination.append(e["seconds"])
    return {"times": times, "coordination": coordination}


def direct_dcp_save(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """``dcp.save``/``dcp.load`` with shoal's writer and reader, multi-rank, partner copies in DRAM."""
    import torch.distributed.checkpoint as dcp

    from shoal import dcp as shoal_dcp

    cfg = group_config(root, replicate_to="dram")
    state = dp_state(rank)
    with Checkpointer(cfg) as ckpt:
        writer = shoal_dcp.StorageWriter(ckpt, 5)
        dcp.save(state, storage_writer=writer, planner=shoal_dcp.SavePlanner())
        handle = writer.handle
        handle.wait(Boundary.RESTARTABLE, timeout=60)
        ckpt.wait()
        target = zeros_like_state(state)
        reader = shoal_dcp.StorageReader(ckpt, 5)
        dcp.load(target, storage_reader=reader)
        assert_state_equal(target, state)
        replica = os.path.join(ckpt.dram.url, layout.manifest_path(5))
        replica_manifest = os.path.exists(replica)
        return {"handle": _handle_summary(handle), "replica_manifest_in_dram": replica_manifest}


def held_replicas_are_reused(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """Step 1 reaches B2 but its drain fails everywhere; step 2 (same state) reuses the partner copies.

    Returns what step 2 sent to partners and, from this host's manifest of step 2 on its local
    tier, how many of the checkpoint's chunks it references there.
    """
    cfg = group_config(root)
    state = dp_state(rank)
    out: dict[str, Any] = {}
    with Checkpointer(cfg) as ckpt:
        failpoints.configure("pipeline.before_drain=raise")
        first = ckpt.save(1, state)
        with contextlib.suppress(Exception):  # it fails at B3, as armed
            first.wait(timeout=60)
        failpoints.configure(None)
        out["first"] = _handle_summary(first)
        second = ckpt.save(2, state)
        second.wait(timeout=60)
        ckpt.wait()
        out["second"] = _handle_summary(second)
        events = ckpt.config.event_log
        host = ckpt.host
        local_run = ckpt.local.url
    assert events is not None  # resolved: the local tier's events.jsonl by default
    rows = read_events(events, kinds=["replicate"])
    out["sent"] = {step: sum(r["sent_bytes"] for r in rows if r.step == step) for step in (1, 2)}
    with open(os.path.join(local_run, layout.manifest_path(2)), "rb") as f:
        manifest = json.loads(f.read())
    out["host"] = host
    out["located"] = len(manifest["locations"])
    return out


def _state_at(rank: int, step: int) -> dict[str, Any]:
    """``dp_state`` trained to ``step``: every tensor moved by ``step``."""
    state = dp_state(rank)
    for group in (state["model"], state["optim"]):
        for t in group.values():
            t.add_(step)
    state["step"] = step
    return state


class AlternatingPolicy:
    """A path policy for tests: odd steps through the partner, even steps straight to shared storage."""

    def decide(self, context: Any) -> Any:
        from shoal.engine.path import DIRECT, PARTNER, PathDecision

        if context.step % 2:
            return PathDecision(PARTNER, f"step {context.step} is odd")
        return PathDecision(DIRECT, f"step {context.step} is even")


def alternating_paths(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """Six checkpoints on alternating paths (keep_last=3): boundaries, copies, restore of each."""
    cfg = group_config(root, keep_last=3)
    out: dict[str, Any] = {"steps": {}}
    with Checkpointer(cfg, path_policy=AlternatingPolicy()) as ckpt:
        for step in range(1, 7):
            state = _state_at(rank, step)
            handle = ckpt.save(step, state)
            handle.wait(Boundary.RESTARTABLE, timeout=120)
            times = handle.times
            manifest = json.loads((Path(ckpt.shared.url) / layout.manifest_path(step)).read_bytes())
            out["steps"][step] = {
                "path": handle.path,
                "reason": handle.path_reason,
                "manifest_path": manifest.get("path"),
                "b2_before_b3": times[Boundary.REPLICATED] < times[Boundary.PERSISTED],
                "b2_with_b3": times[Boundary.REPLICATED] == times[Boundary.PERSISTED],
                "host_copy": ckpt.local.exists(layout.manifest_path(step))
                or ckpt.dram.exists(layout.manifest_path(step)),
            }
        ckpt.wait()
        if world > 1:
            torch.distributed.barrier()  # the coordinator's retention ran: every rank lists the same
        out["committed"] = sorted(
            i.step for i in list_checkpoints(ckpt.shared) if i.boundary == Boundary.RESTARTABLE
        )
        for step in out["committed"]:
            expected = _state_at(rank, step)
            target = zeros_like_state(expected)
            loaded = ckpt.load(target, step=step)
            assert loaded == step, (loaded, step)
            assert_state_equal(target, expected)
    return out


def mismatched_load_steps(rank: int, world: int, *, root: str) -> str:
    """Two checkpoints; then each rank asks for another step: every rank gets the same error."""
    with Checkpointer(group_config(root)) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _state_at(rank, step)).wait(Boundary.RESTARTABLE, timeout=120)
        try:
            ckpt.load(zeros_like_state(_state_at(rank, 0)), step=1 + rank % 2)
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
        else:
            message = "loaded"
        target = zeros_like_state(_state_at(rank, 0))  # and the next, agreed load works
        assert ckpt.load(target, step=2) == 2
        assert_state_equal(target, _state_at(rank, 2))
        return message
