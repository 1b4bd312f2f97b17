"""The durability path on the emulated cluster: ``direct``, ``partner`` and ``auto`` (the model), in one run.

For each regime (a number of hosts N, one rank each, another tenant's background load on the
shared storage, and optionally the storage link's weather), three jobs save every ``--interval``
seconds (:func:`shoal.testing.bench.model_paths.path_run`), one per policy: ``Config.path`` =
``direct``, ``partner``, ``auto``. Each job has its own name on the store; the weather restarts
from the same seed for each, so the three see the same storage. What is reported, per regime:

* **predictability**: mean, p90 and coefficient of variation (CoV) of the time to B2 (safe against
  a host failure) and to B3 (safe against the cluster) by each policy, over the saves after the
  first ``--warmup`` (``auto``'s cold start, decided by the rule; every policy runs them, so
  every policy counts the same steps);
* **the conditional criterion**: which fixed path reached B2 sooner on average (the regime's
  winner), how often ``auto`` chose it, and ``auto``'s mean time to B2 against the winner's;
* **exposure**: the time-integrated rollback exposure of the host and cluster failure classes
  (:func:`shoal.model.exposure.exposure_timeline` over each job's saves), per policy, over the
  same span of saves.

* **what deciding cost**: from ``auto``'s ``path`` events, the decision's own seconds at plan
  time (mean and max) and the model updates behind them (CPU seconds of a refit and of an
  update without one, and where they ran).

``--sweep rates`` runs the map again at other link rates and shard sizes, one factor at a time
around the base (``--host-storage-mbit``, ``--fabric-mbit``, ``--storage-mbit``, ``--shard-mib``):
the fabric at half and 2.5 times its rate, the storage side (each host's link and the aggregate
together) at half and twice, the shard at half and twice its size; each rate point on a cluster
of its own, its regimes named for it. ``--hosts`` and ``--tenants`` pick the map's cells.

The model never sees the regime: it learns from the job's own checkpoints only (the harness's
knobs label the rows). ``--out`` keeps the raw results; ``--from`` re-reports them; ``--plot``
draws the map and the CoV. Needs root. Usage:
``python benchmarks/model_paths.py --out /tmp/paths.json --plot docs/img/model_paths.png``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Any

from shoal.model.exposure import CheckpointTimes, exposure_timeline
from shoal.testing.cluster.hosts import Cluster, ClusterSpec, cannot_run
from shoal.testing.cluster.load import BackgroundLoad, Weather, set_storage_rate

POLICIES = ("direct", "partner", "auto")
MODELS = ("auto", "auto-thread")
AGAIN = "-again"
"""A fixed policy's name with this suffix (``partner-again``) runs the same path as another job:
the two jobs' difference is the noise any comparison of two jobs in the regime carries."""
"""The model's policies: ``auto`` (its updates in a worker process, the default) and ``auto-thread``
(``ModelPolicy(worker="thread")``: its updates in a thread of the coordinator, as before the
worker process; ``--policies`` adds it, to compare the two)."""
SCENARIO = "shoal.testing.bench.model_paths:path_run"
MIB = 1 << 20


@dataclass(frozen=True)
class Regime:
    """One cell of the map: ``hosts`` job hosts (one rank each) and the storage's other traffic."""

    name: str
    hosts: int
    tenants: int = 0
    """Background writers of the other tenant (on the host after the job's), putting without pause."""
    weather: int | None = None
    """Seed of the storage link's random-walk weather; None: the link keeps its rate."""
    shard_mib: float | None = None
    """Each rank's optimizer shard; None: ``--shard-mib``."""


LOADS = (("quiet", 0), ("1 tenant", 1), ("3 tenants", 3))
MAP = tuple(Regime(f"N={n} {load}", n, tenants) for load, tenants in LOADS for n in (2, 3, 4))
CONTENDED = (Regime("N=3 3 tenants + weather", 3, 3, weather=7),)


@dataclass(frozen=True)
class RatePoint:
    """Link rates (Mbit/s) and a shard size (MiB) the sweep runs the map's cells at."""

    host_storage_mbit: float
    fabric_mbit: float
    storage_mbit: float
    shard_mib: float

    @property
    def label(self) -> str:
        return (
            f"F{self.fabric_mbit:g} S{self.host_storage_mbit:g}/{self.storage_mbit:g} {self.shard_mib:g}MiB"
        )


def rate_points(base: RatePoint) -> list[RatePoint]:
    """The base, then one factor at a time: the fabric x0.5 and x2.5, the storage side (each
    host's link and the aggregate) x0.5 and x2, the shard x0.5 and x2."""
    b = base
    return [
        b,
        RatePoint(b.host_storage_mbit, b.fabric_mbit * 0.5, b.storage_mbit, b.shard_mib),
        RatePoint(b.host_storage_mbit, b.fabric_mbit * 2.5, b.storage_mbit, b.shard_mib),
        RatePoint(b.host_storage_mbit * 0.5, b.fabric_mbit, b.storage_mbit * 0.5, b.shard_mib),
        RatePoint(b.host_storage_mbit * 2, b.fabric_mbit, b.storage_mbit * 2, b.shard_mib),
        RatePoint(b.host_storage_mbit, b.fabric_mbit, b.storage_mbit, b.shard_mib * 0.5),
        RatePoint(b.host_storage_mbit, b.fabric_mbit, b.storage_mbit, b.shard_mib * 2),
    ]


def _run_regime(cluster: Cluster, regime: Regime, args: argparse.Namespace, root: str) -> dict[str, Any]:
    """The three policies' jobs in one regime, one after another, each under the same load."""
    out: dict[str, Any] = {"regime": asdict(regime), "policies": {}}
    for policy in args.policies.split(","):
        saves = args.saves + args.warmup  # every policy: the same steps count (see _counted)
        job = f"{policy}-{secrets.token_hex(3)}"
        run_args = {
            "bucket": "paths",
            "job": job,
            "dram_root": os.path.join(root, "dram", job),
            "local_root": os.path.join(root, "local", job),
            "path": policy.removesuffix(AGAIN),
            "saves": saves,
            "interval": args.interval,
            "model_mib": args.model_mib,
            "shard_mib": args.shard_mib if regime.shard_mib is None else regime.shard_mib,
            "config": {"keep_last": None if args.keep_last == "none" else int(args.keep_last)},
            "events": args.events,
        }
        loads = (
            [BackgroundLoad(cluster, cluster.spec.hosts - 1, writers=regime.tenants)]
            if regime.tenants
            else []
        )
        weather = Weather(
            cluster, seed=regime.weather, low_mbit=args.storage_mbit / 4, high_mbit=args.storage_mbit
        )
        for load in loads:
            load.start()
        if regime.weather is not None:
            weather.start()
        try:
            ranks = cluster.run_ranks(SCENARIO, 1, run_args, timeout=900, hosts=regime.hosts)
        finally:
            if regime.weather is not None:
                weather.stop()
                set_storage_rate(cluster, args.storage_mbit)
            for load in loads:
                load.stop()
        out["policies"][policy] = {**ranks[0], "warmup_steps": args.warmup}
        print(f"  {regime.name}: {policy} done", file=sys.stderr, flush=True)
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": float("nan"), "p90": float("nan"), "cov": float("nan"), "n": 0}
    mean = statistics.fmean(xs)
    sd = statistics.pstdev(xs) if len(xs) > 1 else 0.0
    p90 = sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]
    return {"mean": mean, "p90": p90, "cov": sd / mean if mean else float("nan"), "n": len(xs)}


def _counted(run: dict[str, Any], policy: str, warmup: int) -> list[dict[str, Any]]:
    """The saves that count: those after the first ``warmup`` steps that reached B4.

    Every policy runs the same steps and counts the same ones (results saved before 2026-12-06
    ran the fixed policies without the warm-up: they count all of theirs). The model needs the
    warm-up for its cold start; the fixed paths run it too because the store's periodic work
    (a retention pass that yielded to waiting checkpoints four times runs whole on the fifth,
    and listing the shared tier costs about half a second here) falls on the same steps in
    every job: counting other steps per policy put one such stall in some windows and not in
    others."""
    saves = [s for s in run["saves"] if not s["skipped"] and "4" in s["times"]]
    aligned = run.get("warmup_steps", 0) or (warmup if policy in MODELS else 0)
    return [s for s in saves if s["step"] > aligned]


def _exposure(run: dict[str, Any], saves: list[dict[str, Any]]) -> dict[str, float]:
    """Mean exposure (seconds) of the host and cluster classes over the counted saves' span."""
    if len(saves) < 2:
        return {}
    checkpoints = [
        CheckpointTimes(s["step"], s["saved"], {int(k): s["saved"] + v for k, v in s["times"].items()})
        for s in run["saves"]
        if not s["skipped"]
    ]
    start, end = saves[0]["saved"] + saves[0]["times"]["4"], saves[-1]["saved"]
    timeline = exposure_timeline(checkpoints, start, end)
    return {c: timeline[c].mean_seconds for c in ("host", "cluster")}


def decision_costs(run: dict[str, Any], saves: list[dict[str, Any]]) -> dict[str, Any]:
    """What deciding cost over the counted saves (from rank 0's ``path`` events): the decision's
    own seconds, and the CPU seconds of the updates behind the decisions, with and without a refit."""
    costs = run.get("costs") or {}
    steps = [costs[str(s["step"])] for s in saves if costs.get(str(s["step"]))]
    if not steps:
        return {}
    decide = [c["decide_s"] for c in steps]
    updates = {}
    for c in steps:  # one update can stand behind several decisions: count it once
        u = c.get("update")
        if u:
            updates[u["after_checkpoint"]] = u
    refits = [u["cpu_s"] for u in updates.values() if u["refit"]]
    plain = [u["cpu_s"] for u in updates.values() if not u["refit"]]
    return {
        "decide_mean_s": statistics.fmean(decide),
        "decide_max_s": max(decide),
        "refit_cpu_s": statistics.fmean(refits) if refits else None,
        "update_cpu_s": statistics.fmean(plain) if plain else None,
        "update_wall_s": statistics.fmean(u["wall_s"] for u in updates.values()) if updates else None,
        "where": sorted({str(u.get("where")) for u in updates.values()}),
        "stale": sum("has not landed" in (s.get("reason") or "") for s in saves),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def summarize(results: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """One row per regime: each policy's B2/B3 statistics and exposure, the winner, and per model
    policy (``auto``, ``auto-thread``) how often it chose the winner, its B2 against the winner's
    and what deciding cost."""
    rows = []
    for r in results:
        row: dict[str, Any] = {"regime": r["regime"]["name"], "policies": {}, "models": {}}
        for policy, run in r["policies"].items():
            saves = _counted(run, policy, warmup)
            row["policies"][policy] = {
                "b2": _stats([s["times"]["2"] for s in saves]),
                "b3": _stats([s["times"]["3"] for s in saves]),
                "exposure": _exposure(run, saves),
                "paths": [s["path"] for s in saves],
            }
        p = row["policies"]
        winner = row["winner"] = min(("direct", "partner"), key=lambda k: p[k]["b2"]["mean"])
        best = p[winner]["b2"]
        for model in (m for m in MODELS if m in p):
            b2, paths = p[model]["b2"], p[model]["paths"]
            row["models"][model] = {
                "picks_winner": sum(x == winner for x in paths) / max(1, len(paths)),
                "mean_vs_best": b2["mean"] / best["mean"],
                "p90_vs_best": b2["p90"] / best["p90"],
                "cov_vs_best": b2["cov"] / best["cov"] if best["cov"] else float("inf"),
                "cost": decision_costs(r["policies"][model], _counted(r["policies"][model], model, warmup)),
            }
        row["controls"] = {
            path: {
                "mean": p[path + AGAIN]["b2"]["mean"] / p[path]["b2"]["mean"],
                "p90": p[path + AGAIN]["b2"]["p90"] / p[path]["b2"]["p90"],
                "cov": p[path + AGAIN]["b2"]["cov"] / p[path]["b2"]["cov"]
                if p[path]["b2"]["cov"]
                else float("inf"),
            }
            for path in ("direct", "partner")
            if path + AGAIN in p
        }
        row["auto_picks_winner"] = row["models"]["auto"]["picks_winner"]
        row["auto_vs_best"] = row["models"]["auto"]["mean_vs_best"]
        rows.append(row)
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    print("| regime | policy | B2 mean | B2 p90 | B2 CoV | B3 mean | B3 CoV | exposure: host | cluster |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        for policy, s in row["policies"].items():
            e = s["exposure"]
            print(
                f"| {row['regime']} | {policy} | {s['b2']['mean']:.3f} | {s['b2']['p90']:.3f} | "
                f"{s['b2']['cov']:.3f} | {s['b3']['mean']:.3f} | {s['b3']['cov']:.3f} | "
                f"{e.get('host', float('nan')):.2f} | {e.get('cluster', float('nan')):.2f} |"
            )
    print()
    print(
        "| regime | sooner to B2 | model | picks it | mean B2 / the better path's | p90 / its | CoV / its | "
        "CoV direct / model |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        p = row["policies"]
        for model, m in row["models"].items():
            cov = p[model]["b2"]["cov"]
            ratio = p["direct"]["b2"]["cov"] / cov if cov else float("inf")
            print(
                f"| {row['regime']} | {row['winner']} | {model} | {m['picks_winner']:.0%} | "
                f"{m['mean_vs_best']:.3f} | {m['p90_vs_best']:.3f} | {m['cov_vs_best']:.3f} | {ratio:.1f}x |"
            )
    print()
    if any(row["controls"] for row in rows):
        print("the same fixed path in two jobs (``-again`` / the first): the noise between two jobs")
        print()
        print("| regime | path | mean B2 | p90 | CoV |")
        print("|---|---|---:|---:|---:|")
        for row in rows:
            for path, c in row["controls"].items():
                print(f"| {row['regime']} | {path} | {c['mean']:.3f} | {c['p90']:.3f} | {c['cov']:.3f} |")
        print()
    print(
        "| regime | model | decision mean ms | max ms | update CPU s: refit | without | update wall s | "
        "stale decisions | where |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")

    def ms(v: float | None) -> str:
        return "" if v is None else f"{v * 1e3:.3f}"

    def sec(v: float | None) -> str:
        return "" if v is None else f"{v:.3f}"

    for row in rows:
        for model, m in row["models"].items():
            c = m["cost"]
            print(
                f"| {row['regime']} | {model} | {ms(c.get('decide_mean_s'))} | {ms(c.get('decide_max_s'))} | "
                f"{sec(c.get('refit_cpu_s'))} | {sec(c.get('update_cpu_s'))} | "
                f"{sec(c.get('update_wall_s'))} | {c.get('stale', '')} | {', '.join(c.get('where', []))} |"
            )


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["regime"] for r in rows]
    x = range(len(rows))
    for k, policy in enumerate(POLICIES):  # the three of every run
        means = [r["policies"][policy]["b2"]["mean"] for r in rows]
        covs = [r["policies"][policy]["b2"]["cov"] for r in rows]
        ax1.bar([i + (k - 1) * 0.27 for i in x], means, 0.27, label=policy)
        ax2.bar([i + (k - 1) * 0.27 for i in x], covs, 0.27, label=policy)
    for ax, title in ((ax1, "mean time to B2 (s)"), (ax2, "CoV of time to B2")):
        ax.set_xticks(list(x), names, rotation=45, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot: {path}", file=sys.stderr)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saves", type=int, default=10, help="timed saves per policy and regime")
    ap.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated, of direct, partner, auto, auto-thread, direct-again, partner-again "
        "(a second job of that path: the noise between two jobs); direct, partner and auto always",
    )
    ap.add_argument(
        "--warmup", type=int, default=6, help="first saves of every policy left out (auto's cold start)"
    )
    ap.add_argument("--events", action="store_true", help="keep every rank's events in --out (diagnosis)")
    ap.add_argument(
        "--keep-last", default="2", help="Config.keep_last of the jobs (none: no retention); default 2"
    )
    ap.add_argument("--interval", type=float, default=2.5, help="seconds between save calls")
    ap.add_argument("--model-mib", type=int, default=1)
    ap.add_argument("--shard-mib", type=float, default=6.0)
    ap.add_argument("--host-storage-mbit", type=float, default=200.0)
    ap.add_argument("--fabric-mbit", type=float, default=60.0)
    ap.add_argument("--storage-mbit", type=float, default=300.0)
    ap.add_argument(
        "--storage-cpus",
        default=None,
        help="CPUs (comma-separated) for the S3 server and the other tenant, e.g. 1; default: shared",
    )
    ap.add_argument("--job-cpus", default=None, help="CPUs (comma-separated) for the job's ranks, e.g. 0")
    ap.add_argument("--regimes", default="map,contended", help="map, contended, or both (comma-separated)")
    ap.add_argument(
        "--sweep",
        choices=("none", "rates"),
        default="none",
        help="rates: the map's cells again at other link rates and shard sizes (one factor at a time)",
    )
    ap.add_argument("--hosts", default="2,3,4", help="the map's host counts (comma-separated)")
    ap.add_argument("--tenants", default="0,1,3", help="the map's tenant counts (comma-separated)")
    ap.add_argument("--only", default=None, help="run only regimes whose name contains this")
    ap.add_argument("--out", default=None, help="write the raw results here (JSON)")
    ap.add_argument("--from", dest="source", default=None, help="report results saved with --out")
    ap.add_argument("--plot", default=None, help="draw the B2 means and CoVs to this PNG")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.source:
        opener = gzip.open if args.source.endswith(".gz") else open
        with opener(args.source, "rt", encoding="utf-8") as f:
            saved = json.load(f)
        results, args.warmup = saved["results"], saved["warmup"]
    else:
        why = cannot_run()
        if why:
            print(f"cannot run the emulated cluster: {why}", file=sys.stderr)
            return 2
        hosts = {int(h) for h in args.hosts.split(",")}
        tenants = {int(t) for t in args.tenants.split(",")}
        regimes = [r for k in args.regimes.split(",") for r in {"map": MAP, "contended": CONTENDED}[k]]
        regimes = [r for r in regimes if r.hosts in hosts and (r.tenants in tenants or r.weather is not None)]
        regimes = [r for r in regimes if args.only is None or args.only in r.name]
        results: list[dict[str, Any]] = []  # saved after every regime: a long sweep stopped early keeps them
        if args.sweep == "rates":
            base = RatePoint(args.host_storage_mbit, args.fabric_mbit, args.storage_mbit, args.shard_mib)
            for point in rate_points(base):
                _sweep(args, regimes, results, point)
        else:
            _sweep(args, regimes, results)
    rows = summarize(results, args.warmup)
    _print(rows)
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _cpus(text: str | None) -> tuple[int, ...] | None:
    return None if text is None else tuple(int(c) for c in text.split(","))


def _sweep(
    args: argparse.Namespace,
    regimes: list[Regime],
    results: list[dict[str, Any]],
    point: RatePoint | None = None,
) -> None:
    """``regimes`` on one cluster, at ``point``'s rates and shard size (None: the arguments'), each
    one's results appended to ``results`` and saved to ``--out`` as it ends."""
    out_path, given = args.out, dict(vars(args))
    hosts = max(r.hosts for r in regimes) + 1  # the last host is the other tenant's
    if point is not None:
        regimes = [replace(r, name=f"{point.label} {r.name}", shard_mib=point.shard_mib) for r in regimes]
        args = argparse.Namespace(**{**vars(args), "storage_mbit": point.storage_mbit})  # the weather's top
    spec = ClusterSpec(
        hosts=hosts,
        host_storage_mbit=args.host_storage_mbit if point is None else point.host_storage_mbit,
        fabric_mbit=args.fabric_mbit if point is None else point.fabric_mbit,
        storage_mbit=args.storage_mbit,
        storage_cpus=_cpus(args.storage_cpus),
        job_cpus=_cpus(args.job_cpus),
    )
    root = tempfile.mkdtemp(prefix="shoal-paths-")
    try:
        with Cluster(spec) as cluster:
            for r in regimes:
                results.append(_run_regime(cluster, r, args, root))
                if point is not None:
                    results[-1]["rates"] = asdict(point)
                if out_path:
                    with open(out_path, "w", encoding="utf-8") as f:
                        json.dump({"args": given, "warmup": args.warmup, "results": results}, f)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
