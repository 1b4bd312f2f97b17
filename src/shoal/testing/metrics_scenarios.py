"""Multi-rank scenarios of the metrics endpoint, run with :func:`shoal.testing.multiproc.run_ranks`.

Each host's first rank serves its host's metrics (``Config.metrics_port``); the scenario scrapes
that endpoint over HTTP while the job runs and returns what it read with the host's event log,
for the test process to hold one against the other.
"""

from __future__ import annotations

import urllib.request
from typing import Any

import torch.distributed as dist

from shoal.boundary import Boundary
from shoal.checkpointer import Checkpointer
from shoal.records.events import monotonic
from shoal.testing.checkpoints import zeros_like_state
from shoal.testing.scenarios import AlternatingPolicy, dp_state, group_config


def scraped_saves(rank: int, world: int, *, root: str, steps: int = 2) -> dict[str, Any]:
    """``steps`` saves on alternating paths (partner, direct, ...) and a load, then a scrape.

    Every rank passes a barrier once its checkpoints finished (their records are written) and
    its load returned; each host's serving rank then scrapes its endpoint and reads the monotonic
    clock before and after (the exposure gauge grows with it). A second barrier keeps every
    Checkpointer open until the scrapes are done.
    """
    cfg = group_config(root, metrics_port=0, metrics_addr="127.0.0.1")
    out: dict[str, Any] = {"rank": rank}
    with Checkpointer(cfg, path_policy=AlternatingPolicy()) as ckpt:
        for step in range(1, steps + 1):
            state = dp_state(rank)
            for t in state["optim"].values():
                t.add_(step)  # the optimizer shard changes; the model stays (deduplicated)
            ckpt.save(step, state).wait(Boundary.RESTARTABLE, timeout=120)
        ckpt.wait()
        ckpt.load(zeros_like_state(dp_state(rank)), step=steps)
        dist.barrier()
        server = ckpt.runtime.metrics_server
        out.update(host=ckpt.host, log=ckpt.config.event_log, serves=server is not None)
        if server is not None:
            before = monotonic()
            with urllib.request.urlopen(server.url, timeout=60) as reply:
                out["text"] = reply.read().decode()
                out["content_type"] = reply.headers.get("Content-Type")
            out.update(before=before, after=monotonic(), url=server.url)
        dist.barrier()
    return out
