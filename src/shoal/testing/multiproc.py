"""Run a function on N ranks, each its own process with a gloo process group, on one machine.

Ranks are grouped into simulated hosts by ``SHOAL_HOST_ID`` (each host with its own
DRAM and local tiers, as on real machines)::

    results = run_ranks(scenario, hosts=["h0", "h0", "h1", "h1"], kwargs={"root": str(tmp_path)})

``scenario(rank, world_size, **kwargs)`` must be importable (a module-level function in
an installed module): ranks are started by a fork server, a clean process that imported
torch once (a rank then starts in a tenth of a second instead of the two or three seconds
of CPU that importing torch and its checkpoint package costs each process). Each rank
sees the caller's environment as it is at the call, plus ``env``, before it imports
anything of its own. Each rank's return value comes back in rank order; an exception in
any rank is re-raised here with that rank's traceback. Every rank is killed after
``timeout`` seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any


class RankFailed(RuntimeError):
    """A rank raised, died or timed out; the message carries its traceback."""


# Imported once by the fork server, never by a rank: third-party packages only, none of which
# reads the environment a test sets (shoal itself, whose failpoints read it, imports in each rank).
_PRELOAD = ["numpy", "torch", "torch.distributed", "torch.distributed.checkpoint"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _rank_main(
    payload: bytes,
    rank: int,
    world_size: int,
    host: str,
    store: str,
    env: Mapping[str, str],
    results: Any,
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ["SHOAL_HOST_ID"] = host
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # the function and its arguments unpickle only now, with the environment in place: any
        # module they import (shoal's failpoints among them) reads the caller's settings
        fn, kwargs = pickle.loads(payload)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, **kwargs)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    *,
    hosts: Sequence[str],
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    allow_death: Sequence[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``len(hosts)`` ranks; rank r on host ``hosts[r]``.

    ``allow_death`` lists ranks expected to die (killed by a failpoint): their result is None.
    """
    ctx = _context()
    results = ctx.Queue()
    world = len(hosts)
    payload = pickle.dumps((fn, dict(kwargs or {})))
    rank_env = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="shoal-pg-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(payload, r, world, hosts[r], store, rank_env, results),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        failures: list[str] = []
        deadline = time.monotonic() + timeout
        grace: float | None = None  # once a rank failed, the others may wait on it: give them a moment
        try:
            while len(out) + len(failures) < world:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    now = time.monotonic()
                    dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]
                    if dead and all(r in allow_death for r in dead) and len(out) + len(dead) == world:
                        break
                    for r in dead:
                        code = procs[r].exitcode
                        if (
                            r not in allow_death
                            and code
                            and not any(f.startswith(f"rank {r} ") for f in failures)
                        ):
                            failures.append(f"rank {r} died with exit code {code}")
                            grace = grace or now + 10
                    if grace is not None and now > grace:
                        break
                    if now > deadline:
                        if failures:
                            break
                        raise RankFailed(
                            f"ranks timed out after {timeout} s; finished: {sorted(out)}"
                        ) from None
                    continue
                if ok:
                    out[rank] = value
                else:
                    failures.append(f"rank {rank} failed:\n{value}")
                    grace = grace or time.monotonic() + 10
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if failures:
            raise RankFailed("\n".join(failures))
        return [out.get(r) for r in range(world)]
