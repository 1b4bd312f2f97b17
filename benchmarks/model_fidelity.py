"""Fidelity of the completion-time model (``shoal.model.writers``) on the emulated cluster.

The sweep: jobs of ``hosts x ranks-per-host`` gloo ranks, each rank draining its own state as
``streams`` packs in flight at once (:mod:`shoal.testing.bench.model_fidelity`), so a checkpoint has
``N = hosts x ranks x streams`` writers of ``S`` bytes each, over a sequence of cluster
configurations (:data:`SWEEP`): writers N, bytes per writer S, another tenant's load
(:class:`~shoal.testing.cluster.load.BackgroundLoad`: none, light, heavy) and the storage link's
weather (:class:`~shoal.testing.cluster.load.Weather`: steady, a random walk, regimes). The sweep
runs ``--rounds`` times over every configuration (each round after the previous one), so a
forward split in time has every regime on both sides. Raw drain-pack records go to ``--out``.

The evaluation (also alone, ``--from JSON``): checkpoints in time order, the first ``--fraction``
fitted (:func:`~shoal.model.writers.choose_family`, with and without a fixed cost per write;
then the spreads calibrated for predictions from estimated states, ``--calibrate``), the rest
predicted one by one. Each test checkpoint's tier state comes from
:func:`~shoal.model.writers.estimate_state` over the same job's ``--window`` previous checkpoints
(records that ended before it started; by default the window is chosen on the training part),
and carries the spread of ``g`` its job's last ``--spread-window`` prediction errors showed:
only what a production run sees. The harness's knobs (true load, true rates) only label the regimes.
Scores: MAPE and MdAPE of the typical (median) writer, coverage and pinball loss of the predicted
p90 of the slowest writer, overall and per regime; and for N beyond the sweep the model's slowest
quantiles against a Monte Carlo of the fitted model (its own consistency). ``--plot PNG`` draws
predicted against observed. Needs root for the sweep, not for ``--from``.

Usage: ``python benchmarks/model_fidelity.py --out /tmp/fidelity.json --plot docs/img/model_fidelity.png``
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20
SCENARIO = "shoal.testing.bench.model_fidelity:drain_sweep"
JOB_HOSTS = 2
"""Hosts the jobs run on (the first ones); the tenants' hosts come after them."""
TENANT_HOSTS = 2
HOST_MBIT = 400.0
"""Each host's storage NIC: above the storage link, so the shared tier is what binds."""
STORAGE_MBIT = 240.0
"""The storage link's steady rate (30 MB/s): well under what moto sustains on two cores."""


@dataclass(frozen=True)
class JobSpec:
    """One configuration of the sweep: a job's shape and the tier's conditions while it runs."""

    regime: str
    hosts: int
    ranks_per_host: int
    streams: int
    shard_mib: float
    load: str = "none"
    """``none``, ``light`` (one tenant writer, pausing) or ``heavy`` (two tenant hosts: writers, readers)."""
    weather: str = "steady"
    """``steady``, ``walk`` (a random walk of the storage rate) or ``regimes`` (steps between rates)."""

    @property
    def writers(self) -> int:
        """N: the checkpoint's writers on the tier at once."""
        return self.hosts * self.ranks_per_host * self.streams

    @property
    def writer_mib(self) -> float:
        """S: each writer's MiB."""
        return self.shard_mib / self.streams


SWEEP: tuple[JobSpec, ...] = (
    JobSpec("quiet", 1, 1, 1, 2),
    JobSpec("quiet", 2, 1, 2, 4),
    JobSpec("quiet", 2, 2, 2, 2),
    JobSpec("quiet", 2, 2, 4, 8),
    JobSpec("light load", 1, 2, 2, 4, load="light"),
    JobSpec("light load", 2, 2, 4, 4, load="light"),
    JobSpec("heavy load", 2, 1, 1, 8, load="heavy"),
    JobSpec("heavy load", 2, 2, 2, 4, load="heavy"),
    JobSpec("weather walk", 2, 1, 4, 2, weather="walk"),
    JobSpec("weather walk", 1, 1, 2, 8, weather="walk"),
    JobSpec("weather regimes", 2, 2, 1, 4, weather="regimes"),
    JobSpec("weather regimes + load", 2, 2, 4, 8, load="light", weather="regimes"),
)


@contextmanager
def _conditions(cluster: Any, job: JobSpec, seed: int) -> Iterator[list[tuple[float, float]]]:
    """The tenants' load and the storage weather of ``job`` while the block runs; yields the timeline."""
    from shoal.testing.cluster.load import BackgroundLoad, Weather, set_storage_rate

    timeline: list[tuple[float, float]] = []
    with ExitStack() as stack:
        if job.load == "light":
            stack.enter_context(BackgroundLoad(cluster, host=JOB_HOSTS, writers=1, object_mib=4, pause=0.3))
        elif job.load == "heavy":
            for h in range(TENANT_HOSTS):
                stack.enter_context(
                    BackgroundLoad(cluster, host=JOB_HOSTS + h, writers=1, readers=1, object_mib=8)
                )
        if job.weather == "walk":
            w = Weather(cluster, seed=seed, low_mbit=120, high_mbit=320, step_seconds=3, step_factor=1.3)
        elif job.weather == "regimes":
            w = Weather(cluster, regimes=((240, 8), (120, 8), (320, 8)))
        else:
            set_storage_rate(cluster, STORAGE_MBIT)
            w = None
        if w is not None:
            stack.enter_context(w)
            timeline = w.timeline
        else:
            timeline.append((time.monotonic(), STORAGE_MBIT))
        if job.load != "none":
            time.sleep(2.0)  # the tenants' first requests under way
        yield timeline


def _run_job(
    cluster: Any, job: JobSpec, index: int, saves: int, roots: Mapping[str, str], probe_bytes: int = 0
) -> dict[str, Any]:
    """One job of the sweep under its conditions: its records and probes, its spec, the storage timeline."""
    args = {
        **roots,
        "bucket": f"fidelity-{secrets.token_hex(4)}",
        "job": f"fid{index}",
        "saves": saves,
        "shard_bytes": int(job.shard_mib * MIB),
        "streams": job.streams,
        "pause_s": 0.3,
        "probe_bytes": probe_bytes,
    }
    with _conditions(cluster, job, seed=index) as timeline:
        ranks = cluster.run_ranks(SCENARIO, job.ranks_per_host, args, timeout=900, hosts=job.hosts)
        timeline = list(timeline)
    records = [r for out in ranks for r in out["records"]]
    probes = [p for out in ranks for p in out.get("probes", ())]
    spec = job.__dict__
    return {"index": index, "spec": spec, "records": records, "probes": probes, "storage_timeline": timeline}


def sweep(saves: int, rounds: int, only: int | None, out: str, probe_bytes: int = 0) -> dict[str, Any]:
    """Run every configuration ``rounds`` times, each job on a fresh cluster; the raw records.

    What is done so far is written to ``out`` after every job (a sweep cut short keeps it)."""
    from shoal.testing.cluster.hosts import Cluster, ClusterSpec

    spec = ClusterSpec(JOB_HOSTS + TENANT_HOSTS, HOST_MBIT, HOST_MBIT, STORAGE_MBIT)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    jobs: list[dict[str, Any]] = []
    data = {
        "cluster": {"host_mbit": HOST_MBIT, "storage_mbit": STORAGE_MBIT, "hosts": spec.hosts},
        "saves": saves,
        "rounds": rounds,
        "probe_bytes": probe_bytes,
        "jobs": jobs,
    }
    configs = SWEEP if only is None else SWEEP[:only]
    t0 = time.monotonic()
    for r in range(rounds):
        for k, job in enumerate(configs):
            index = r * len(configs) + k
            roots = {
                "dram_root": tempfile.mkdtemp(prefix="shoal-fidelity-dram-", dir=shm),
                "local_root": tempfile.mkdtemp(prefix="shoal-fidelity-local-"),
            }
            try:
                with Cluster(spec) as cluster:
                    jobs.append(_run_job(cluster, job, index, saves, roots, probe_bytes))
            finally:
                for root in roots.values():
                    shutil.rmtree(root, ignore_errors=True)
            print(
                f"round {r} job {k} ({job.regime}, N={job.writers}, S={job.writer_mib:g} MiB): "
                f"{len(jobs[-1]['records'])} records, {time.monotonic() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            with open(out, "w", encoding="utf-8") as f:
                json.dump(data, f)
    return data


# -- the evaluation (pure over the saved records, no cluster) ---------------------------------


def checkpoints_of(data: Mapping[str, Any]) -> list[Any]:
    """The sweep's checkpoints (:class:`~shoal.model.evaluate.Checkpoint`), one per job and step."""
    from shoal.model.evaluate import Checkpoint
    from shoal.model.writers import WriterSample

    out = []
    for job in data["jobs"]:
        timed = [p for p in job.get("probes", ()) if p["end"] > p["start"]]
        probes = {p["step"]: p["bytes"] / (p["end"] - p["start"]) for p in timed}  # bytes per second
        by_step: dict[int, list[dict[str, Any]]] = {}
        for r in job["records"]:
            by_step.setdefault(r["step"], []).append(r)
        for step, rs in sorted(by_step.items()):
            cid = job["index"] * 1000 + step
            samples = tuple(
                WriterSample(cid, r["bytes"], r["end"] - r["start"], max(1, r["concurrency"]), r["end"])
                for r in rs
                if r["end"] > r["start"]
            )
            start, end = min(r["start"] for r in rs), max(r["end"] for r in rs)
            out.append(
                Checkpoint(f"job{job['index']}", samples, start, end, job["spec"]["regime"], probes.get(step))
            )
    return out


def _persistence(preds: list[Any], ckpts: list[Any]) -> float:
    """MAPE of the naive forecast "the job's previous checkpoint's median writer", for context."""
    from shoal.model.evaluate import history, mape

    pairs = [(history(ckpts, p.checkpoint, 1), p.checkpoint) for p in preds]
    return mape([h[0].typical_seconds for h, _ in pairs if h], [c.typical_seconds for h, c in pairs if h])


def _hindsight(preds: list[Any]) -> dict[str, float]:
    """MAPE of an oracle no forecast can beat from a steady state: each job's median over its test part.

    It knows, in hindsight, the median of the very checkpoints it is scored on (per job, so per
    N and S). What it misses is the checkpoint-to-checkpoint variation around that level, which
    only a forecast that sees each change coming could capture. Per regime, and ``"all"``."""
    from shoal.model.evaluate import mape

    by_job: dict[str, list[Any]] = {}
    for p in preds:
        by_job.setdefault(p.checkpoint.job, []).append(p.checkpoint)
    level = {job: statistics.median(c.typical_seconds for c in cs) for job, cs in by_job.items()}
    out: dict[str, float] = {}
    groups = {"all": [p.checkpoint for p in preds]}
    for p in preds:
        groups.setdefault(p.checkpoint.regime, []).append(p.checkpoint)
    for name, cs in groups.items():
        out[name] = mape([level[c.job] for c in cs], [c.typical_seconds for c in cs])
    return out


STATE_RULES = (
    "pooled:1", "pooled:2", "pooled:4", "pooled:8", "median:4", "median:8", "median:all", "matched:4",
    "matched:8", "matched:all", "adaptive",
)  # fmt: skip
"""The state rules ``--state choose`` picks among on the training part."""


def evaluate(
    data: Mapping[str, Any],
    fraction: float,
    window: int | str,
    latency: bool = True,
    target: str = "slowest",
    spread_window: int = 8,
) -> dict[str, Any]:
    """Fit on the first ``fraction`` of the checkpoints in time, predict the rest one by one.

    ``window``: the state rule (:class:`~shoal.model.states.StateRule`'s text, or an int ``w``
    for ``pooled:w``); ``"choose"`` (or 0): the one of :data:`STATE_RULES` that predicts the
    training part best."""
    from shoal.model.evaluate import (
        calibrated_fit,
        choose_window,
        forward_predictions,
        forward_split,
        prediction_scores,
    )
    from shoal.model.states import StateRule
    from shoal.model.writers import choose_family

    ckpts = checkpoints_of(data)
    train, test = forward_split(ckpts, fraction, key=lambda c: c.start)
    raw, fits = choose_family([s for c in train for s in c.samples], latency=latency)
    window_mape: dict[Any, float] = {}
    rule: int | StateRule
    if window in ("choose", 0, "0"):  # chosen on the training checkpoints alone
        rule, window_mape = choose_window(raw, train, [StateRule.parse(r) for r in STATE_RULES])
    elif isinstance(window, int) or window.isdigit():
        rule = int(window)
    else:
        rule = StateRule.parse(window)
    window = rule
    fit = (
        raw
        if target == "none"
        else calibrated_fit(raw, train, window=window, target=target, spread_window=spread_window)
    )
    preds = forward_predictions(fit, test, train, window=window, spread_window=spread_window)
    regimes = sorted({p.checkpoint.regime for p in preds})
    per = {r: prediction_scores([p for p in preds if p.checkpoint.regime == r]) for r in regimes}
    return {
        "window": window,
        "target": target if target == "none" else f"calibrated by {target}, spread window {spread_window}",
        "window_mape": window_mape,
        "persistence_mape": _persistence(preds, ckpts),
        "hindsight_mape": _hindsight(preds),
        "fit": fit,
        "raw_fit": raw,
        "fits": fits,
        "train": len(train),
        "test": len(test),
        "predictions": preds,
        "overall": prediction_scores(preds),
        "per_regime": per,
    }


def _rate(b: float) -> str:
    """A rate in MB/s, or that it never binds (a ceiling the fit put far above every record)."""
    return "never binds" if b > 1e12 else f"{b / 1e6:.1f} MB/s"


def _print_scores(result: Mapping[str, Any]) -> None:
    """The fit, the window, and the scores per regime as a markdown table."""
    fit, raw = result["fit"], result["raw_fit"]
    print(
        f"fit ({fit.family}, on {result['train']} checkpoints, {fit.n} writers): b_client "
        f"{_rate(fit.b_client)}, b_shared {fit.b_shared / 1e6:.1f} MB/s, latency "
        f"{fit.latency * 1e3:.1f} ms, sigma {raw.sigma:.3f}, tau {raw.tau:.3f}; BIC "
        + ", ".join(f"{f} {x.bic:.0f}" for f, x in result["fits"].items())
    )
    print(
        f"spreads for predictions from states estimated from recent records ({result['target']}): "
        f"sigma {fit.sigma:.3f}, tau {fit.tau:.3f} (where a state has no spread of its own)"
    )
    rule = result["window"]
    rule = f"pooled:{rule}" if isinstance(rule, int) else str(rule)
    if result["window_mape"]:
        tried = ", ".join(f"{w}: {m:.1f}%" for w, m in result["window_mape"].items())
        print(f"state rule {rule} (chosen on the training part: {tried})")
    else:
        print(f"state rule {rule}")
    print()
    print(
        "| regime | test checkpoints | MAPE typical | MdAPE typical | p90 slowest coverage | pinball (s) "
        "| hindsight floor | MAPE / floor |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    floor = result["hindsight_mape"]
    rows = [
        *((k, v, floor[k]) for k, v in result["per_regime"].items()),
        ("**all**", result["overall"], floor["all"]),
    ]
    for name, sc, low in rows:
        ratio = sc["mape"] / low if low else math.inf
        print(
            f"| {name} | {sc['n']:.0f} | {sc['mape']:.1f}% | {sc['mdape']:.1f}% | "
            f"{sc['coverage']:.1%} | {sc['pinball']:.4f} | {low:.1f}% | {ratio:.2f}x |"
        )
    print()
    print(
        f"for context, the naive forecast 'the job's previous checkpoint's median writer' has MAPE "
        f"{result['persistence_mape']:.1f}% on the same test checkpoints (it cannot predict another N or S)"
    )
    print(
        "hindsight floor: the MAPE of each job's own median over its test checkpoints (an oracle "
        "constant); a forecast from a steady state of the tier cannot do better"
    )
    print()


def extrapolate(fit: Any, nbytes: float, counts: tuple[int, ...], seed: int = 0) -> list[dict[str, float]]:
    """The model's slowest-writer quantiles for ``counts`` writers, against a Monte Carlo of itself.

    Beyond the sweep's N nothing was observed: this checks only that the quantiles the model
    computes (``slowest_quantile``, integrated over g on a grid) are those of the process it
    describes (``simulate``), at the fitted tier state.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for n in counts:
        draws = max(2000, 200_000 // n)
        sizes = [nbytes] * n
        sim = fit.simulate(rng, sizes, draws)
        slowest = np.array([s.seconds for s in sim]).reshape(draws, n).max(axis=1)
        for q in (0.5, 0.9, 0.99):
            model, mc = fit.slowest_quantile(q, sizes), float(np.quantile(slowest, q))
            rows.append({"writers": n, "draws": draws, "q": q, "model": model, "monte_carlo": mc})
    return rows


def _print_extrapolation(rows: list[dict[str, float]], nbytes: float) -> None:
    """:func:`extrapolate`'s rows as a markdown table."""
    print(f"Beyond the sweep ({nbytes / MIB:g} MiB per writer, the fitted tier state): the model's own")
    print("consistency, its slowest-writer quantiles against a Monte Carlo of the fitted model")
    print()
    print("| writers | Monte Carlo draws | quantile | model (s) | Monte Carlo (s) | difference |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        diff = r["model"] / r["monte_carlo"] - 1
        print(
            f"| {r['writers']} | {r['draws']} | p{r['q'] * 100:g} | {r['model']:.2f} | "
            f"{r['monte_carlo']:.2f} | {diff:+.1%} |"
        )
    print()


def _plot(result: Mapping[str, Any], path: str) -> None:
    """Predicted against observed typical writer, and observed slowest over its predicted p90."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    preds = result["predictions"]
    regimes = sorted({p.checkpoint.regime for p in preds})
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for k, regime in enumerate(regimes):
        mine = [(i, p) for i, p in enumerate(preds) if p.checkpoint.regime == regime]
        color = plt.get_cmap("tab10")(k)
        cov = result["per_regime"][regime]["coverage"]
        left.scatter([p.checkpoint.typical_seconds for _, p in mine], [p.typical for _, p in mine],
                     s=8, color=color, label=regime)  # fmt: skip
        right.scatter([i for i, _ in mine], [p.checkpoint.slowest_seconds / p.slowest for _, p in mine],
                      s=8, color=color, label=f"{regime}: {cov:.0%}")  # fmt: skip
    lo = min(min(p.typical, p.checkpoint.typical_seconds) for p in preds)
    hi = max(max(p.typical, p.checkpoint.typical_seconds) for p in preds)
    left.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    left.set(xscale="log", yscale="log", xlabel="observed median writer (s)", ylabel="predicted typical (s)")
    for axis in (left.xaxis, left.yaxis):
        axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_title(f"typical writer: MAPE {result['overall']['mape']:.1f}%", fontsize=9)
    left.legend(fontsize=7)
    right.axhline(1.0, color="black", lw=0.8)
    right.set(xlabel="test checkpoint (time order)", ylabel="observed slowest / predicted p90")
    right.set_title(f"p90 of the slowest writer: coverage {result['overall']['coverage']:.1%}", fontsize=9)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"plot: {path}")


def main() -> int:
    """Run the sweep (or read one, ``--from``), evaluate it, print the tables, draw the plot."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "shoal-model-fidelity.json"))
    parser.add_argument(
        "--from", dest="source", default=None, help="evaluate a saved sweep, .json or .json.gz (no cluster)"
    )
    parser.add_argument("--saves", type=int, default=14, help="timed checkpoints per job")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", type=int, default=None, help="the first ONLY configurations (development)")
    parser.add_argument("--fraction", type=float, default=0.5, help="the forward split's training share")
    parser.add_argument(
        "--state", "--window", dest="window", default="choose",
        help="how the tier's state comes from a job's recent checkpoints: pooled:W, median:W, median:all, "
        "matched:W, matched:all, adaptive, or W (pooled:W); default: choose (the best of "
        + ", ".join(STATE_RULES) + " on the training part)",
    )  # fmt: skip
    parser.add_argument("--plot", default=None, help="write a PNG of predicted against observed here")
    parser.add_argument(
        "--probe-kib", type=int, default=0,
        help="the sweep: probe the tier before each save with one object of this many KiB (0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--calibrate", choices=("order", "slowest", "writers", "none"), default="order",
        help="refit the spread for predictions from recent states by each checkpoint's slowest writer "
        "(sigma and tau), by the gap between its median and slowest writer (sigma, then tau: the default), "
        "by every writer (tau), or not at all",
    )  # fmt: skip
    parser.add_argument(
        "--spread-window", type=int, default=8,
        help="previous predictions whose errors set the state's spread of g (0: the fit's one spread)",
    )  # fmt: skip
    parser.add_argument(
        "--latency", action=argparse.BooleanOptionalAction, default=True,
        help="let BIC choose a fixed cost per write too (default: on)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.source:
        opener = gzip.open if args.source.endswith(".gz") else open
        with opener(args.source, "rt", encoding="utf-8") as f:
            data = json.load(f)
    else:
        from shoal.testing.cluster.hosts import cannot_run

        why = cannot_run()
        if why is not None:
            print(f"model_fidelity: {why}", file=sys.stderr)
            return 2
        data = sweep(args.saves, args.rounds, args.only, args.out, args.probe_kib << 10)
        print(f"raw samples: {args.out}", file=sys.stderr)
    result = evaluate(data, args.fraction, args.window, args.latency, args.calibrate, args.spread_window)
    _print_scores(result)
    _print_extrapolation(extrapolate(result["fit"], MIB, (64, 256, 1024)), MIB)
    if args.plot:
        _plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
