"""Start one host's gloo ranks inside an emulated cluster host (:mod:`shoal.testing.cluster.hosts`).

Run once per host namespace (:meth:`shoal.testing.cluster.hosts.Cluster.run_ranks` does)::

    python -m shoal.testing.cluster.ranks --scenario shoal.testing.cluster.scenarios:save_state \\
        --host 1 --hosts 2 --ranks-per-host 2 --master 10.202.0.10 --port 29500 \\
        --args '{"bucket": "b"}' --out /tmp/results

The launcher starts ``--ranks-per-host`` rank processes (itself, with ``--rank``). Rank ``r`` of
host ``h`` is global rank ``h * ranks_per_host + r``; it joins the job with
``init_process_group("gloo", init_method="tcp://<master>:<port>")`` (the master is host 0's fabric
address, where global rank 0 serves the store), with ``GLOO_SOCKET_IFNAME`` set to the fabric
interface so that gloo's traffic goes over the fabric, never the storage NIC. ``SHOAL_HOST_ID``
comes from the host's environment. Each rank then calls ``scenario(rank, world_size, **args)`` and
writes ``{"rank", "host", "ok", "value" | "error"}`` as JSON to ``<out>/r<rank>.json``. The value
must be JSON-serialisable.

The launcher waits for its ranks; once one fails the others get ``--grace`` seconds (``GRACE_S``
by default; they may be waiting on it in a collective), and past ``--timeout`` every rank still
running is killed. SIGTERM stops the launcher the same way (its ranks are killed and reaped); a rank
whose launcher dies is killed by the kernel. It exits 0 when every rank succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["GRACE_S", "load_scenario", "result_path"]

GRACE_S = 10.0
"""How long the other ranks may run on after one failed (they may be waiting on it)."""


def result_path(out: str, rank: int) -> str:
    """Where global rank ``rank`` writes its result."""
    return os.path.join(out, f"r{rank}.json")


def load_scenario(spec: str) -> Callable[..., Any]:
    """The function ``"package.module:function"`` names; a clear error if it does not resolve."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"a scenario is named 'package.module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"scenario {spec!r} cannot be loaded: {e}") from e
    if not callable(fn):
        raise ValueError(f"scenario {spec!r} is not callable")
    return fn


def _write_result(out: str, rank: int, record: dict[str, Any]) -> bool:
    """Write the rank's result; whether it records a success."""
    path = result_path(out, rank)
    try:
        data = json.dumps(record)
    except (TypeError, ValueError) as e:
        error = f"the scenario's result is not JSON-serialisable: {e}"
        record = {"rank": rank, "host": record.get("host", ""), "ok": False, "error": error}
        data = json.dumps(record)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(data)
    os.replace(tmp, path)
    return bool(record["ok"])


def _die_with_parent() -> None:
    """Have the kernel kill this rank when its launcher dies (Linux ``PR_SET_PDEATHSIG``)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _rank_main(args: argparse.Namespace) -> int:
    """One rank: join the job over the fabric, run the scenario, write the result."""
    _die_with_parent()
    if args.launcher is not None and os.getppid() != args.launcher:  # it died before the line above
        return 1
    rank = args.host * args.ranks_per_host + args.rank
    world = args.hosts * args.ranks_per_host
    host = os.environ.get("SHOAL_HOST_ID", "")
    record: dict[str, Any] = {"rank": rank, "host": host}
    try:
        if not host:
            raise RuntimeError("SHOAL_HOST_ID is not set: run the ranks with the cluster host's environment")
        fn = load_scenario(args.scenario)
        kwargs = json.loads(args.args)
        if not isinstance(kwargs, dict):
            raise ValueError(f"--args must be a JSON object, got {args.args!r}")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{args.master}:{args.port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=args.timeout),
        )
        try:
            value = fn(rank, world, **kwargs)
        finally:
            dist.destroy_process_group()
        record.update(ok=True, value=value)
    except BaseException:
        record.update(ok=False, error=traceback.format_exc())
    return 0 if _write_result(args.out, rank, record) else 1


def _host_main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """The host's launcher: start its ranks, wait for them, kill what outlives the timeout."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": args.ifname, "OMP_NUM_THREADS": "1"}
    me = ["--launcher", str(os.getpid())]
    # SIGTERM (Cluster.run_ranks stopping the run) ends the wait below: the ranks are killed and reaped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "shoal.testing.cluster.ranks", *argv, *me, "--rank", str(r)], env=env
        )
        for r in range(args.ranks_per_host)
    ]
    deadline = time.monotonic() + args.timeout
    until: float | None = None  # once a rank failed: when the others are killed
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if until is None and any(p.returncode for p in procs):
                until = now + args.grace
            if now > deadline or (until is not None and now > until):
                break
            time.sleep(0.1)
    finally:
        for r, p in enumerate(procs):
            if p.poll() is None:
                print(f"cluster_ranks: host {args.host}: killing rank {r} (still running)", file=sys.stderr)
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
    codes = [p.returncode for p in procs]
    for r, code in enumerate(codes):
        if code:
            print(f"cluster_ranks: host {args.host}: local rank {r} exited with {code}", file=sys.stderr)
    return 0 if all(code == 0 for code in codes) else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shoal.testing.cluster.ranks",
        description="Start one emulated host's gloo ranks and run a scenario on each.",
    )
    p.add_argument("--scenario", required=True, help="package.module:function, called (rank, world, **args)")
    p.add_argument("--host", type=int, required=True, help="this host's index (0-based)")
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--ranks-per-host", type=int, required=True)
    p.add_argument("--master", required=True, help="host 0's fabric address (rank 0 serves the store)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--args", default="{}", help="the scenario's keyword arguments, a JSON object")
    p.add_argument("--out", required=True, help="directory for the ranks' r<rank>.json results")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before every rank is killed")
    p.add_argument(
        "--grace", type=float, default=GRACE_S, help="seconds the others run on after a rank failed"
    )
    p.add_argument("--ifname", default="fb0", help="the fabric interface gloo binds (GLOO_SOCKET_IFNAME)")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # a rank process, not the host
    p.add_argument("--launcher", type=int, default=None, help=argparse.SUPPRESS)  # the rank's launcher pid
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if not 0 <= args.host < args.hosts or args.ranks_per_host < 1:
        raise SystemExit(
            f"bad layout: host {args.host} of {args.hosts}, {args.ranks_per_host} ranks per host"
        )
    if args.rank is not None:
        return _rank_main(args)
    os.makedirs(args.out, exist_ok=True)
    return _host_main(args, argv)


if __name__ == "__main__":
    sys.exit(main())
