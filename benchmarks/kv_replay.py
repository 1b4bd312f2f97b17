"""KV-cache trace replay: one shared first-level cache per host, and below it nothing, a per-object
storage, or shoal (and shoal with each of its mechanisms switched off), on 1, 2 or 4 hosts.

The Mooncake conversation trace (``benchmarks/data/mooncake/``; any trace of that format with
``--trace``), its first ``--minutes``, replayed ``--speedup`` times faster than its clock by
``--instances`` serving instances of ``--tp`` ranks each (one process per rank), spread evenly over
each of ``--hosts`` host counts, requests round-robin over the instances, with each policy in turn
(:mod:`shoal.testing.bench.kv_serving`). ``recompute``, ``storage``, ``shoal`` and shoal's ablations
(``shoal-no-local``, ``shoal-no-batch``, ``shoal-no-fabric``, ``shoal-no-grouped``) share one first
level per host (the host's DRAM pool, ``--dram-blocks``, the same for all) and differ only below it;
``private-lru+perkey`` (a private LRU per instance, then per-key reads: the replay's former
``perkey``) and ``nocache`` are rows of their own. Reported per policy, storage and host count:
mean / p50 / p90 / p99 time to first token (TTFT, on the trace's clock), its parts (queue, fetch,
prefill), the write-back's back-pressure per request, the hit ratio per tier ("peer": another
host), the blocks recomputed, the bytes read per tier and through every host's links, the fabric
link's use during peer fetches, each mechanism's share of shoal's gain over ``storage``, and for the
first level its hit ratio next to the exact LRU simulation of the same trace and capacity
(:func:`shoal.testing.bench.kv_trace.simulate_lru`).

Every assumption and its source is in docs/kv_replay.md. Storage ``local``: the storage is a
directory on this machine's disk (``storage`` and ``private-lru+perkey``: one file per block;
shoal: a local-disk tier), hosts are simulated (one pool and local tier each, the fabric path over
loopback). Storage ``cluster`` (needs root): the instances run in host namespaces of the emulated
cluster (:mod:`shoal.testing.cluster.hosts`), the storage is its S3, loaded by another tenant
(:class:`~shoal.testing.cluster.load.BackgroundLoad`) on a host of its own; shoal has a bounded local
tier (``--local-blocks``), the fabric path and the S3. The results are saved after every run
(``--out``). Usage::

    python benchmarks/kv_replay.py --minutes 2 --storage local            # a smoke run, no root
    python benchmarks/kv_replay.py --minutes 2 --storage local --hosts 1,2
    sudo .venv/bin/python benchmarks/kv_replay.py --storage cluster --hosts 1,2,4 --minutes 10 \
        --speedup 2 --storage-cpus 1 --job-cpus 0 --out /tmp/kv.json
    python benchmarks/kv_replay.py --from /tmp/kv.json                    # report saved results
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from typing import Any

from shoal.testing.bench.kv_serving import (
    ABLATIONS,
    FIRST_LEVEL_POLICIES,
    POLICIES,
    QWEN25_14B,
    RENAMED,
    ModelLayout,
    ServingConfig,
    replay_instance,
    scaled_link_mbit,
    summarize,
)
from shoal.testing.bench.kv_trace import (
    BLOCK_TOKENS,
    TraceError,
    load_trace,
    prefix_chains,
    simulate_lru,
    trace_summary,
    window,
)

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "data", "mooncake", "conversation_trace.jsonl")
MIB = 1 << 20

QWEN25_14B_PARAMS = 14.7e9
"""Qwen2.5-14B's parameters (its model card: 14.7 B)."""
ACCEL_FLOPS = 989e12
"""Dense bf16 tensor throughput of one H100/H800 SXM (NVIDIA's datasheet: 989 TFLOPS without sparsity)."""
MFU = 0.40
"""Model FLOPs utilisation of a prefill (a long-prompt prefill is compute bound; 40% is typical)."""
PER_TOKEN_S = 2 * QWEN25_14B_PARAMS / (ACCEL_FLOPS * MFU)
"""Prefill seconds per token on one accelerator: 2 x params FLOPs / (throughput x MFU) = 74.3 us."""


def _policies(args: argparse.Namespace, hosts: int) -> list[str]:
    """The policies run on ``hosts`` hosts: an ablation that switches off what is not there is
    the same run as shoal (no fabric path on one host, no grouped reads at TP 1), so it is left out."""
    out = []
    for p in args.policies.split(","):
        if (p == "shoal-no-fabric" and hosts == 1) or (p == "shoal-no-grouped" and args.tp == 1):
            continue
        out.append(p)
    return out


def _done(results: list[dict[str, Any]]) -> set[str]:
    """The policies that ``results`` (one storage and host count, maybe from --resume) already ran."""
    return {run["config"]["policy"] for run in results}


def _configs(
    args: argparse.Namespace,
    storage: str,
    root: str,
    hosts: int = 1,
    fabric_mbit: float | None = None,
    done: set[str] = frozenset(),  # type: ignore[assignment]
) -> list[ServingConfig]:
    """One ServingConfig per policy not ``done`` for ``storage`` on ``hosts`` hosts, fresh roots each."""
    layout = _layout(args)
    block = args.block_bytes or max(64, layout.block_bytes // args.scale)
    out = []
    for policy in _policies(args, hosts):
        if policy in done:
            continue
        run = f"{policy}-{secrets.token_hex(3)}"
        cfg = ServingConfig(
            policy=policy,
            trace=os.path.abspath(args.trace),
            minutes=args.minutes,
            speedup=args.speedup,
            per_token_s=args.per_token_ms / 1000.0 / args.tp,
            block_bytes=block,
            dram_blocks=args.dram_blocks,
            namespace=layout.namespace,
            dram_root=os.path.join(args.dram_dir, f"shoal-kvreplay-{os.getpid()}", run),
            block_tokens=args.block_tokens,
            high_water=args.high_water,
            shared_lookup=args.shared_lookup,
            staging_blocks=args.staging_blocks,
            tp=args.tp,
            fabric_mbit=fabric_mbit,
        )
        shoal = cfg.is_shoal
        if storage == "local":
            if shoal and cfg.off == "local":
                cfg = replace(cfg, shared_url=os.path.join(root, run, "storage"))
            elif shoal:
                cfg = replace(cfg, local_root=os.path.join(root, run, "local"))
            elif policy in ("storage", "private-lru+perkey"):
                cfg = replace(cfg, shared_url=os.path.join(root, run, "storage"))
        else:
            url = f"s3://kvreplay/{run}"
            if shoal:
                cfg = replace(
                    cfg, local_root=os.path.join(root, run, "local"), local_blocks=args.local_blocks,
                    shared_url=url, s3=True,
                )  # fmt: skip
            elif policy in ("storage", "private-lru+perkey"):
                cfg = replace(cfg, shared_url=url, s3=True)
        out.append(cfg)
    return out


def _timeout(args: argparse.Namespace) -> float:
    return args.minutes * 60.0 / args.speedup * 3 + 300.0


def _hosts(args: argparse.Namespace) -> list[int]:
    return [int(h) for h in str(args.hosts).split(",")]


def _ranks_per_host(args: argparse.Namespace, hosts: int) -> int:
    if args.instances % hosts:
        raise SystemExit(f"--instances {args.instances} do not spread evenly over {hosts} hosts")
    return args.instances // hosts * args.tp


def _run_local(args: argparse.Namespace, root: str, out: dict[str, list[dict[str, Any]]], save: Any) -> None:
    """Every host count, on this machine: the hosts are simulated (``$SHOAL_HOST_ID``, one pool
    and local tier each), the fabric path is loopback."""
    from shoal.testing.multiproc import run_ranks

    for n in _hosts(args):
        rph = _ranks_per_host(args, n)
        results = out.setdefault(f"local-{n}h" if len(_hosts(args)) > 1 or n > 1 else "local", [])
        for cfg in _configs(args, "local", root, n, done=_done(results)):
            t = time.monotonic()
            ranks = run_ranks(
                replay_instance,
                hosts=[f"h{r // rph}" for r in range(n * rph)],
                kwargs={"config": asdict(cfg)},
                timeout=_timeout(args),
            )
            results.append(
                {"config": asdict(cfg), "ranks": ranks, "wall_s": time.monotonic() - t, "commit": COMMIT}
            )
            save()
            print(
                f"  local, {n} host(s): {cfg.policy} done in {time.monotonic() - t:.0f} s",
                file=sys.stderr, flush=True,
            )  # fmt: skip
            _clean(cfg)


def _layout(args: argparse.Namespace) -> ModelLayout:
    """The KV layout of one block as each rank holds it: the whole block on every TP rank (the
    replay's TP instances keep the KV replicated on their ranks, docs/kv_replay.md)."""
    return replace(QWEN25_14B, block_tokens=args.block_tokens)


def link_mbit(args: argparse.Namespace) -> tuple[float, float]:
    """The cluster's ``tc`` rates (the host's storage link, the S3's link), mbit/s here."""
    full = _layout(args).block_bytes
    scale = full / (args.block_bytes or max(64, full // args.scale))
    host = scaled_link_mbit(args.shared_gbps, args.speedup, scale)
    return host, scaled_link_mbit(args.storage_gbps, args.speedup, scale)


def fabric_link_mbit(args: argparse.Namespace) -> float:
    """The cluster's fabric link (``tc``), mbit/s here, for ``--fabric-gbps`` at full scale."""
    full = _layout(args).block_bytes
    scale = full / (args.block_bytes or max(64, full // args.scale))
    return scaled_link_mbit(args.fabric_gbps, args.speedup, scale)


def _cpus(text: str | None) -> tuple[int, ...] | None:
    return None if text is None else tuple(int(c) for c in text.split(","))


def _run_cluster(
    args: argparse.Namespace, root: str, out: dict[str, list[dict[str, Any]]], save: Any
) -> None:
    """Every host count on one emulated cluster of max(hosts) + 1 hosts: the serving hosts, and
    the last one for the other tenant. Each run records the bytes through every serving host's
    storage NIC and fabric link (the kernel's counters, before and after)."""
    from shoal.testing.cluster.hosts import Cluster, ClusterSpec, cannot_run
    from shoal.testing.cluster.load import BackgroundLoad

    why = cannot_run()
    if why:
        raise SystemExit(f"cannot run the emulated cluster: {why}")
    host_mbit, storage_mbit = link_mbit(args)
    fabric_mbit = fabric_link_mbit(args)
    print(
        f"  cluster: the host's storage link {host_mbit:.1f} mbit here = {args.shared_gbps:g} GB/s at full "
        f"scale; the S3's {storage_mbit:.1f} mbit = {args.storage_gbps:g} GB/s; the fabric link "
        f"{fabric_mbit:.1f} mbit = {args.fabric_gbps:g} GB/s",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    counts = _hosts(args)
    tenant = max(counts)
    spec = ClusterSpec(
        hosts=tenant + 1,
        host_storage_mbit=host_mbit,
        fabric_mbit=fabric_mbit,
        storage_mbit=storage_mbit,
        storage_cpus=_cpus(args.storage_cpus),
        job_cpus=_cpus(args.job_cpus),
    )
    with Cluster(spec) as cluster:
        for n in counts:
            rph = _ranks_per_host(args, n)
            results = out.setdefault(f"cluster-{n}h", [])
            for cfg in _configs(args, "cluster", root, n, fabric_mbit, done=_done(results)):
                t = time.monotonic()
                load = BackgroundLoad(
                    cluster, tenant, writers=args.tenant_writers, readers=args.tenant_readers,
                    object_mib=8.0, pause=args.tenant_pause,
                )  # fmt: skip
                before = [asdict(cluster.counters(i)) for i in range(n)]
                with load:
                    ranks = cluster.run_ranks(
                        "shoal.testing.bench.kv_serving:replay_instance", rph, {"config": asdict(cfg)},
                        timeout=_timeout(args), hosts=n,
                    )  # fmt: skip
                after = [asdict(cluster.counters(i)) for i in range(n)]
                links = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
                results.append(
                    {
                        "config": asdict(cfg), "ranks": ranks, "wall_s": time.monotonic() - t,
                        "links": links, "commit": COMMIT,
                    }
                )  # fmt: skip
                save()
                print(
                    f"  cluster, {n} host(s): {cfg.policy} done in {time.monotonic() - t:.0f} s",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
                _clean(cfg)


def _clean(cfg: ServingConfig) -> None:
    shutil.rmtree(cfg.dram_root, ignore_errors=True)
    shutil.rmtree(cfg.staging_root, ignore_errors=True)
    if cfg.local_root:
        shutil.rmtree(os.path.dirname(cfg.local_root), ignore_errors=True)
    if cfg.shared_url and not cfg.s3:
        shutil.rmtree(os.path.dirname(cfg.shared_url), ignore_errors=True)


def _legacy(config: dict[str, Any]) -> dict[str, Any]:
    """A saved run's config, its policy named as now: files written before the shared first level
    have ``perkey`` (now ``private-lru+perkey``) and a ``recompute`` that had no cache (``nocache``)."""
    if "staging_blocks" in config:
        return config
    return {**config, "policy": {"perkey": "private-lru+perkey", "recompute": "nocache"}.get(
        config["policy"], config["policy"])}  # fmt: skip


SAME_FOR_RESUME = (
    "trace", "minutes", "speedup", "per_token_ms", "block_tokens", "tp", "fabric_gbps", "scale",
    "block_bytes", "dram_blocks", "local_blocks", "instances", "high_water", "shared_lookup",
    "staging_blocks", "shared_gbps", "storage_gbps", "storage_cpus", "job_cpus", "tenant_writers",
    "tenant_readers", "tenant_pause",
)  # fmt: skip
"""The settings a resumed file must share with this invocation (its runs are then comparable)."""


def _commit() -> str:
    """The code a run measured: the git commit, with ``+dirty`` for uncommitted changes."""
    import subprocess

    try:
        head = subprocess.run(
            ["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", HERE, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


COMMIT = _commit()


def _open(path: str, name: str, mode: str) -> Any:
    """``path`` opened as text, through gzip when ``name`` ends in ``.gz``."""
    if name.endswith(".gz"):
        return gzip.open(path, mode, encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def _load(path: str) -> dict[str, Any]:
    """A file saved with ``--out`` (gzip'd when its name ends in ``.gz``)."""
    with _open(path, path, "rt") as f:
        saved: dict[str, Any] = json.load(f)
    return saved


def _resumed(args: argparse.Namespace) -> dict[str, Any]:
    """The saved file of ``--out``, to be continued; refused (naming the setting) if it was made
    with other settings than these."""
    saved = _load(args.out)
    old = saved.get("args", {})
    for name in SAME_FOR_RESUME:
        if name in old and old[name] != getattr(args, name):
            raise SystemExit(
                f"kv_replay --resume: {args.out} was run with --{name.replace('_', '-')} {old[name]!r}, "
                f"this run has {getattr(args, name)!r}; resume with the same settings or use another --out"
            )
    hosts = sorted({*map(int, str(old.get("hosts", "1")).split(",")), *_hosts(args)})
    policies = list(dict.fromkeys([*str(old.get("policies", "")).split(","), *args.policies.split(",")]))
    merged = {**old, "hosts": ",".join(map(str, hosts)), "policies": ",".join(p for p in policies if p)}
    return {"args": merged, "results": saved.get("results", {})}


def report(saved: dict[str, Any]) -> dict[str, Any]:
    """Summaries per storage and policy, shoal's gains and the LRU check, from saved raw results."""
    args = saved["args"]
    tokens = args.get("block_tokens", BLOCK_TOKENS)
    full_block = replace(QWEN25_14B, tp=args["tp"], block_tokens=tokens).block_bytes
    out: dict[str, Any] = {"storages": {}}
    for storage, runs in saved["results"].items():
        if not runs:
            continue
        first = ServingConfig(**_legacy(runs[0]["config"]))
        reqs = window(load_trace(first.trace, block_tokens=first.block_tokens), first.minutes)
        chains = prefix_chains(reqs)
        rows = {}
        for run in runs:
            legacy = "staging_blocks" not in run["config"]
            cfg = ServingConfig(**_legacy(run["config"]))
            row = summarize(run["ranks"], cfg, full_block)
            if cfg.policy in FIRST_LEVEL_POLICIES:
                # the shared first level's exact model (a run from before it: shoal's whole store)
                sim = simulate_lru(chains, cfg.dram_blocks, backed=legacy)
                row["lru_dram_hit_ratio"] = sim.dram_hit_ratio
                row["lru_prefix_hit_ratio"] = sim.prefix_hit_ratio
            row["wall_s"] = run["wall_s"]
            row["commit"] = run.get("commit", "")
            if "links" in run:  # bytes through the serving hosts' links, at full scale
                scale = full_block / cfg.block_bytes
                row["links_full_scale"] = {
                    k: sum(h[k] for h in run["links"]) * scale for k in run["links"][0]
                }
            rows[cfg.policy] = row
        gains = {}
        if "shoal" in rows:
            for other in rows:
                if other != "shoal":
                    gains[other] = 1.0 - rows["shoal"]["ttft"]["mean"] / rows[other]["ttft"]["mean"]
        shares = {}
        if "shoal" in rows and "storage" in rows:
            gain = rows["storage"]["ttft"]["mean"] - rows["shoal"]["ttft"]["mean"]
            for ablation, mechanism in ABLATIONS.items():
                if ablation in rows and gain:
                    shares[mechanism] = (
                        rows[ablation]["ttft"]["mean"] - rows["shoal"]["ttft"]["mean"]
                    ) / gain
        out["storages"][storage] = {
            "ablation_shares": shares,
            "trace": trace_summary(reqs),
            "window": {"minutes": first.minutes, "speedup": first.speedup},
            "rows": rows,
            "shoal_lower_mean_ttft_than": gains,
        }
    return out


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.0f}"


def _print(rep: dict[str, Any]) -> None:
    for storage, s in rep["storages"].items():
        t, w = s["trace"], s["window"]
        print(
            f"\n### storage: {storage}: the first {w['minutes']:g} minutes, {w['speedup']:g} times faster\n"
        )
        print(
            f"trace window: {t['requests']} requests, {t['blocks']} blocks ({t['distinct_blocks']} distinct, "
            f"at most {t['reusable_ratio']:.1%} reusable), {t['input_tokens']} input tokens "
            f"over {t['span_s']:.0f} s\n"
        )
        cols = ["policy", "TTFT mean", "p50", "p90", "p99", "queue", "fetch", "of it: lookup", "prefill"]
        cols += ["writer wait mean", "p99", "hit: dram", "staging", "local", "peer", "storage", "recomputed"]
        cols += ["LRU sim dram"]
        print("| " + " | ".join(cols) + " |")
        print("|---|" + "---:|" * (len(cols) - 1))
        for policy, r in s["rows"].items():
            h, p = r["hit_ratio"], r["parts"]
            lru = f"{r['lru_dram_hit_ratio']:.1%}" if "lru_dram_hit_ratio" in r else ""
            ww = r.get("writer_wait") or {"mean": r["writer_waited"] / max(1, r["requests"]), "p99": 0.0}
            print(
                f"| {policy} | {r['ttft']['mean']:.3f} | {r['ttft']['p50']:.3f} | {r['ttft']['p90']:.3f} | "
                f"{r['ttft']['p99']:.3f} | {p['queue']:.3f} | {p['fetch']:.3f} | "
                f"{p.get('lookup', 0.0):.3f} | "
                f"{p['prefill']:.3f} | {ww['mean']:.3f} | {ww['p99']:.3f} | {h.get('dram', 0):.1%} | "
                f"{h.get('staging', 0):.1%} | {h.get('local', 0):.1%} | {h.get('peer', 0):.1%} | "
                f"{h.get('shared', 0):.1%} | {r['recomputed_ratio']:.1%} | {lru} |"
            )
        print("\nBytes, GiB at full scale: read per tier; through the serving hosts' links (all hosts)\n")
        cols = ["policy", "read: dram", "staging", "local", "peer", "storage"]
        cols += ["storage NIC in", "out", "fabric in", "out", "peer fetches", "of them filling the link"]
        cols += ["link use", "per fetch"]
        print("| " + " | ".join(cols) + " |")
        print("|---|" + "---:|" * (len(cols) - 1))
        for policy, r in s["rows"].items():
            b = r["bytes_read_full_scale"]
            links = r.get("links_full_scale") or {}
            pl = r.get("peer_link") or {}
            use = f"{pl['link_use']:.0%}" if "link_use" in pl else ""
            one = f"{pl['per_fetch_use']:.0%}" if "per_fetch_use" in pl else ""
            print(
                f"| {policy} | {_gib(b.get('dram', 0))} | {_gib(b.get('staging', 0))} | "
                f"{_gib(b.get('local', 0))} | {_gib(b.get('peer', 0))} | {_gib(b.get('shared', 0))} | "
                + " | ".join(
                    _gib(links[k]) if k in links else ""
                    for k in ("storage_rx", "storage_tx", "fabric_rx", "fabric_tx")
                )
                + f" | {pl.get('fetches', 0)} | {pl.get('large_fetches', '')} | {use} | {one} |"
            )
        for other, g in s["shoal_lower_mean_ttft_than"].items():
            word = "lower" if g >= 0 else "higher"
            print(f"\nshoal's mean TTFT is {abs(g):.1%} {word} than {other}'s")
        shares = s.get("ablation_shares") or {}
        if shares:
            print(
                "\nEach mechanism's share of shoal's gain over storage (its ablation's mean TTFT minus "
                "shoal's,"
            )
            print("over storage's minus shoal's):\n")
            for name, share in shares.items():
                print(f"- {name}: {share:+.0%}")
        commits = {r.get("commit", "") for r in s["rows"].values()}
        if len(commits) > 1:  # a file continued with --resume at other code
            which = [f"{policy} at {r.get('commit') or 'unrecorded'}" for policy, r in s["rows"].items()]
            print("\nThe runs measured different code: " + ", ".join(which))


def _plot(rep: dict[str, Any], path: str, saved: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    storages = list(saved["results"])
    fig, axes = plt.subplots(1, len(storages), figsize=(5.5 * len(storages), 4), squeeze=False)
    for ax, storage in zip(axes[0], storages, strict=True):
        for run in saved["results"][storage]:
            cfg = ServingConfig(**_legacy(run["config"]))
            xs = sorted(r["ttft"] * cfg.speedup for rank in run["ranks"] for r in rank["records"])
            mean = rep["storages"][storage]["rows"][cfg.policy]["ttft"]["mean"]
            ax.plot(
                xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{cfg.policy} (mean {mean:.2f} s)"
            )
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (s, trace clock)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"storage: {storage}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot: {path}", file=sys.stderr)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=TRACE, help="a trace in the Mooncake JSON-lines format")
    ap.add_argument("--minutes", type=float, default=30.0, help="replay the trace's first minutes")
    ap.add_argument("--speedup", type=float, default=10.0, help="the trace's clock runs this much faster")
    ap.add_argument(
        "--per-token-ms", type=float, default=PER_TOKEN_S * 1000, help="prefill ms per uncached token"
    )
    ap.add_argument(
        "--block-tokens", type=int, default=BLOCK_TOKENS, help="tokens per block of the trace (per hash_id)"
    )
    ap.add_argument(
        "--tp", type=int, default=2,
        help="tensor-parallel ranks per instance (each needs every block: the KV is replicated on them)",
    )  # fmt: skip
    ap.add_argument(
        "--hosts",
        default="1",
        help="comma-separated host counts to run, e.g. 1,2,4 (instances spread over them)",
    )
    ap.add_argument(
        "--fabric-gbps", type=float, default=50.0,
        help="cluster: each host's fabric link (peer fetches), GB/s at full scale",
    )  # fmt: skip
    ap.add_argument("--scale", type=int, default=1536, help="block bytes here = the layout's / this")
    ap.add_argument("--block-bytes", type=int, default=0, help="override the scaled block size (bytes)")
    ap.add_argument("--dram-blocks", type=int, default=8192, help="the host's DRAM pool, in blocks")
    ap.add_argument(
        "--local-blocks", type=int, default=131072, help="shoal's local tier on the cluster, in blocks"
    )
    ap.add_argument(
        "--instances", type=int, default=4,
        help="serving instances in all, spread evenly over the hosts (x --tp ranks, one process each)",
    )  # fmt: skip
    ap.add_argument("--high-water", type=float, default=1.0, help="shoal's KVConfig.high_water")
    ap.add_argument(
        "--shared-lookup", choices=("ask", "host"), default="host",
        help="shoal's KVConfig.shared_lookup (one serving host: its index knows what it wrote)",
    )  # fmt: skip
    ap.add_argument(
        "--staging-blocks", type=int, default=64,
        help="shoal's fallback: its DRAM staging area (evicted blocks on their way down), in blocks",
    )  # fmt: skip
    ap.add_argument(
        "--policies", default=",".join(("recompute", "storage", "shoal", *ABLATIONS, "private-lru+perkey")),
        help=f"comma-separated, of {','.join(POLICIES)}",
    )  # fmt: skip
    ap.add_argument("--storage", default="local", help="local, cluster, or local,cluster")
    ap.add_argument("--dram-dir", default="/dev/shm")
    ap.add_argument(
        "--shared-gbps", type=float, default=10.0,
        help="cluster: the serving host's link to the shared storage, GB/s at full scale",
    )  # fmt: skip
    ap.add_argument(
        "--storage-gbps", type=float, default=16.0,
        help="cluster: what the shared storage serves in all (host and tenant), GB/s at full scale",
    )  # fmt: skip
    ap.add_argument(
        "--storage-cpus", default=None, help="CPUs (comma-separated) for the S3 server and the tenant"
    )
    ap.add_argument("--job-cpus", default=None, help="CPUs (comma-separated) for the serving instances")
    ap.add_argument("--tenant-writers", type=int, default=1)
    ap.add_argument("--tenant-readers", type=int, default=1)
    ap.add_argument("--tenant-pause", type=float, default=0.5)
    ap.add_argument("--out", default=None, help="write the raw results here (JSON; gzip'd if it ends in .gz)")
    ap.add_argument(
        "--resume", action="store_true",
        help="--out exists: keep its runs and run only the (host count, policy) pairs it lacks "
        "(its settings must be these)",
    )  # fmt: skip
    ap.add_argument("--from", dest="source", default=None, help="report results saved with --out")
    ap.add_argument("--plot", default=None, help="draw the TTFT distributions to this PNG")
    args = ap.parse_args(argv)
    for p in args.policies.split(","):
        if p in RENAMED:
            ap.error(
                f"--policies: {p!r} is now {RENAMED[p]!r} (a private LRU per instance); the per-key "
                f"fallback under the shared first level is 'storage'"
            )
        if p not in POLICIES:
            ap.error(f"--policies: unknown policy {p!r}; choose from {','.join(POLICIES)}")
    if args.staging_blocks < 1:
        ap.error(f"--staging-blocks must be >= 1, got {args.staging_blocks}")
    if args.block_tokens < 1:
        ap.error(f"--block-tokens must be >= 1, got {args.block_tokens}")
    if args.resume and not args.out:
        ap.error("--resume continues the file named by --out; pass --out")
    for s in args.storage.split(","):
        if s not in ("local", "cluster"):
            ap.error(f"--storage: unknown storage {s!r}; choose local, cluster or local,cluster")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.source:
        saved = _load(args.source)
    else:
        try:
            # a bad trace fails here, naming the line
            window(load_trace(args.trace, block_tokens=args.block_tokens), args.minutes)
        except TraceError as e:
            print(f"kv_replay: {e}", file=sys.stderr)
            return 2
        root = tempfile.mkdtemp(prefix="shoal-kvreplay-")
        saved = {"args": vars(args), "results": {}}
        if args.resume and os.path.exists(args.out):
            saved = _resumed(args)

        def save() -> None:
            """Write what has run so far (after every run: a long run stopped early keeps its results)."""
            if not args.out:
                return
            tmp = f"{args.out}.tmp"
            with _open(tmp, args.out, "wt") as f:
                json.dump({**saved, "results": {k: v for k, v in saved["results"].items() if v}}, f)
            os.replace(tmp, args.out)

        try:
            for storage in args.storage.split(","):
                run = _run_local if storage == "local" else _run_cluster
                run(args, root, saved["results"], save)
        finally:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(os.path.join(args.dram_dir, f"shoal-kvreplay-{os.getpid()}"), ignore_errors=True)
        save()
    rep = report(saved)
    _print(rep)
    if args.plot:
        _plot(rep, args.plot, saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
