"""The checkpoint-interval advisor: Young/Daly with an asynchronous lag, and a failure simulator.

Pure math over plain numbers (no I/O, no torch). A training job measures, per checkpoint:

* ``C`` -- the **stall** ``C_b``: seconds training is blocked by one save (the blocking stage).
  If the background write measurably slows the steps that overlap it, add that slowdown here
  (``C_eff`` in docs/design.md section 7); it is time lost on every checkpoint, failure or not.
* ``L`` -- the **lag** to a boundary: seconds from the save call until the checkpoint is safe
  against one failure class (B2 for a host failure, B3 for the cluster), ``L >= C_b``.
* ``R`` -- the **restart**: seconds from a failure until training runs again (reschedule, reload).
* ``M`` -- the job's mean time between failures, ``M = M_node / nodes`` for independent nodes.

Where the lag goes. A save returns after ``C_b``; the checkpoint becomes safe ``L - C_b`` seconds
later, while training already runs the next interval. A failure inside that window cannot use the
new checkpoint: it rolls back to the one before, losing a whole extra interval. Per failure that
happens with probability ``(L - C_b) / (P + C)`` and costs ``P + C``, so it adds ``L - C_b`` to the
expected loss *per failure*, whatever the interval ``P``. It does not add to the cost paid on every
checkpoint. To first order the waste fraction is therefore::

    W(P) = C / P + (P / 2 + (L - C_b) + R) / M

whose minimum is Young's ``P = sqrt(2 C M)``, independent of the lag. Daly's exact expected wall
time for exponential failures takes the lag as part of the restart, ``R' = R + (L - C_b)``
(docs/design.md section 7)::

    T_w = M exp(R' / M) (exp((P + C) / M) - 1) T_s / P,    waste = 1 - T_s / T_w

This is exact for ``L = C_b`` (Daly 2006) and exact to first order in the lag; its argmin over
``P`` does not depend on ``R'``, so Daly's higher-order interval (which uses ``C`` only) holds with
the lag too. :func:`simulate_waste` simulates the actual lagged process (a failure in the window
rolls back to the save before); the tests hold the two against each other. Measured: they agree
within the simulation's noise (~0.3%) for lags up to a few intervals, and stay within 1% even
where ``L - C_b`` exceeds the MTBF.

A sanity example (AITURBO's remark, "waste reduced by up to 6%, not 58x"): a job failing once an
hour (``M = 3600``) whose stall shrinks 58x, from 10 s to 0.17 s, each at its Daly interval, with
no restart cost and no lag:

>>> before = daly_waste(daly_interval(10.0, 3600.0), 10.0, 10.0, 0.0, 3600.0)
>>> after = daly_waste(daly_interval(10 / 58, 3600.0), 10 / 58, 10 / 58, 0.0, 3600.0)
>>> round(before, 4), round(after, 4), round(before - after, 4), round(before / after, 2)
(0.0727, 0.0098, 0.0629, 7.45)

The waste falls by 6.3 points of the job's time: a factor 7.45, close to ``sqrt(58) = 7.6``
(waste grows as ``sqrt(C)``), never 58x. First order, the drop is
``sqrt(2 C / M) (1 - 58**-0.5) = 0.065``; it reaches 6 points at a stall of 8.6 s. With a
restart of 300 s the same stall cut takes the waste from 14.7% to 8.9%, a factor 1.65.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from shoal.errors import ConfigError

HOURS_PER_DAY = 24.0


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number of seconds, got {value!r}")
    return float(value)


def _positive(name: str, value: float) -> float:
    number = _finite(name, value)
    if number <= 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    return number


def _non_negative(name: str, value: float) -> float:
    number = _finite(name, value)
    if number < 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")
    return number


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
    return value


def _check_lag(stall_s: float, lag_s: float) -> tuple[float, float]:
    stall = _non_negative("stall_s", stall_s)
    lag = _non_negative("lag_s", lag_s)
    if lag < stall:
        raise ConfigError(
            f"lag_s ({lag_s!r}) must be >= stall_s ({stall_s!r}): a checkpoint cannot be safe "
            "before its save returns; measure the lag from the save call"
        )
    return stall, lag


def job_mtbf(node_mtbf_s: float, nodes: int) -> float:
    """The job's mean time between failures ``M = M_node / nodes``, for independent nodes.

    >>> job_mtbf(86400.0 * 365, 512)  # one failure per node-year, 512 nodes
    61593.75
    """
    return _positive("node_mtbf_s", node_mtbf_s) / _count("nodes", nodes)


def young_interval(stall_s: float, mtbf_s: float) -> float:
    """Young's first-order optimal interval ``sqrt(2 C M)`` (seconds of work between saves).

    ``C`` is the stall ``C_b`` (time blocked per checkpoint), ``M`` the job's MTBF. The lag and the
    restart do not appear: they add to the loss per failure, which does not depend on the interval.

    >>> young_interval(8.0, 3600.0)
    240.0
    """
    stall = _positive("stall_s", stall_s)
    return math.sqrt(2.0 * stall * _positive("mtbf_s", mtbf_s))


def daly_interval(stall_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimal interval, seconds of work between saves.

    For ``C < 2M``: ``sqrt(2CM) [1 + sqrt(C/2M)/3 + (C/2M)/9] - C``; otherwise ``M``. ``C`` is the
    stall ``C_b``. The restart ``R'`` (restart plus lag) is a factor of Daly's expected wall time,
    so it does not move the optimum.

    >>> round(daly_interval(8.0, 3600.0), 2)
    234.7
    """
    stall = _positive("stall_s", stall_s)
    mtbf = _positive("mtbf_s", mtbf_s)
    if stall >= 2.0 * mtbf:
        return mtbf
    ratio = stall / (2.0 * mtbf)
    return math.sqrt(2.0 * stall * mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - stall


def first_order_waste(
    interval_s: float, stall_s: float, lag_s: float, restart_s: float, mtbf_s: float
) -> float:
    """First-order waste fraction ``C/P + (P/2 + (L - C_b) + R) / M`` (docs/design.md section 7).

    ``C`` and ``C_b`` are both the stall; ``L - C_b`` is the window after a save returns in which
    a failure still rolls back one more interval. Good while ``P``, ``L`` and ``R`` are small
    against ``M``; :func:`daly_waste` is the exact form.

    >>> round(first_order_waste(240.0, 8.0, 8.0, 0.0, 3600.0), 4)
    0.0667
    """
    interval = _positive("interval_s", interval_s)
    stall, lag = _check_lag(stall_s, lag_s)
    restart = _non_negative("restart_s", restart_s)
    mtbf = _positive("mtbf_s", mtbf_s)
    return stall / interval + (interval / 2.0 + (lag - stall) + restart) / mtbf


def daly_wall_time(
    work_s: float, interval_s: float, stall_s: float, lag_s: float, restart_s: float, mtbf_s: float
) -> float:
    """Daly's expected wall time ``M e^{R'/M} (e^{(P+C)/M} - 1) T_s / P`` for exponential failures.

    ``T_s`` is the work (failure- and checkpoint-free run time), ``P`` the work between saves,
    ``C`` the stall ``C_b``, and ``R' = R + (L - C_b)``: the lag enters as extra restart, because a
    failure in the ``L - C_b`` window after a save loses that much more work on average (see the
    module docstring). Failures may also strike during the restart, as in Daly's model.

    >>> round(daly_wall_time(3600.0, 240.0, 8.0, 8.0, 0.0, 3600.0), 1)
    3851.1
    """
    work = _positive("work_s", work_s)
    interval = _positive("interval_s", interval_s)
    stall, lag = _check_lag(stall_s, lag_s)
    restart = _non_negative("restart_s", restart_s)
    mtbf = _positive("mtbf_s", mtbf_s)
    effective_restart = restart + (lag - stall)
    per_work = mtbf * math.exp(effective_restart / mtbf) * math.expm1((interval + stall) / mtbf) / interval
    return per_work * work


def daly_waste(interval_s: float, stall_s: float, lag_s: float, restart_s: float, mtbf_s: float) -> float:
    """Expected waste fraction ``1 - T_s / T_w`` of wall time, from :func:`daly_wall_time`.

    >>> round(daly_waste(240.0, 8.0, 8.0, 0.0, 3600.0), 4)
    0.0652
    """
    return 1.0 - 1.0 / daly_wall_time(1.0, interval_s, stall_s, lag_s, restart_s, mtbf_s)


@dataclass(frozen=True)
class CheckpointTiming:
    """What a job measured about its saves, for one path or failure class.

    ``stall_s`` is ``C_b`` (training blocked per save), ``lag_s`` the mean time from the save call
    until the checkpoint is safe against the failure class (``>= stall_s``), ``lag_spread_s`` its
    standard deviation. The advice uses the mean lag: the loss per failure is linear in the lag, so
    the spread does not enter at first order (the simulator can draw the lag to check that).
    """

    stall_s: float
    lag_s: float
    lag_spread_s: float = 0.0

    def __post_init__(self) -> None:
        _check_lag(self.stall_s, self.lag_s)
        spread = _non_negative("lag_spread_s", self.lag_spread_s)
        if spread > 0 and self.lag_s == self.stall_s:
            raise ConfigError(
                f"lag_spread_s ({self.lag_spread_s!r}) must be 0 when lag_s equals stall_s "
                f"({self.stall_s!r}): the lag beyond the stall is never negative"
            )


@dataclass(frozen=True)
class FailureModel:
    """How often the job fails and what a failure costs besides the lost work.

    ``node_mtbf_s`` is one node's MTBF, ``nodes`` the job's node count (failures independent, so
    the job's MTBF is ``node_mtbf_s / nodes``), ``restart_s`` the time ``R`` to restart and reload.
    """

    node_mtbf_s: float
    nodes: int
    restart_s: float

    def __post_init__(self) -> None:
        job_mtbf(self.node_mtbf_s, self.nodes)
        _non_negative("restart_s", self.restart_s)

    @property
    def job_mtbf_s(self) -> float:
        """The job's MTBF ``M = node_mtbf_s / nodes``."""
        return job_mtbf(self.node_mtbf_s, self.nodes)


@dataclass(frozen=True)
class IntervalAdvice:
    """One advice: the optimal interval and the expected waste, for one path or failure class.

    Intervals are seconds of work between saves (``*_steps`` when a step time was given). Waste is
    Daly's expected fraction of wall time lost to stalls, rework and restarts; accelerator-hours
    per day are that fraction times the accelerators times 24 (``None`` when no count was given).
    ``effective_restart_s`` is ``R' = R + (L - C_b)``.
    """

    name: str
    stall_s: float
    lag_s: float
    lag_spread_s: float
    restart_s: float
    effective_restart_s: float
    job_mtbf_s: float
    young_interval_s: float
    optimal_interval_s: float
    optimal_interval_steps: int | None
    waste_at_optimum: float
    accelerators: int | None
    waste_accelerator_hours_per_day_at_optimum: float | None
    current_interval_s: float | None
    waste_at_current: float | None
    waste_accelerator_hours_per_day_at_current: float | None


def _accelerator_hours(waste: float | None, accelerators: int | None) -> float | None:
    if waste is None or accelerators is None:
        return None
    return waste * accelerators * HOURS_PER_DAY


def advise_interval(
    timing: CheckpointTiming,
    failures: FailureModel,
    *,
    name: str = "",
    current_interval_s: float | None = None,
    step_time_s: float | None = None,
    accelerators_per_node: int | None = None,
) -> IntervalAdvice:
    """Advise the checkpoint interval for one path or failure class.

    >>> advice = advise_interval(
    ...     CheckpointTiming(stall_s=2.0, lag_s=30.0),
    ...     FailureModel(node_mtbf_s=86400.0 * 365, nodes=512, restart_s=600.0),
    ...     current_interval_s=1800.0, step_time_s=4.0, accelerators_per_node=8)
    >>> round(advice.optimal_interval_s), advice.optimal_interval_steps
    (495, 124)
    >>> round(advice.waste_at_optimum, 4), round(advice.waste_at_current, 4)
    (0.0181, 0.0256)
    """
    mtbf = failures.job_mtbf_s
    if current_interval_s is not None:
        _positive("current_interval_s", current_interval_s)
    accelerators = None
    if accelerators_per_node is not None:
        accelerators = _count("accelerators_per_node", accelerators_per_node) * failures.nodes
    optimum = daly_interval(timing.stall_s, mtbf)
    steps = None
    if step_time_s is not None:
        steps = max(1, round(optimum / _positive("step_time_s", step_time_s)))
    waste = daly_waste(optimum, timing.stall_s, timing.lag_s, failures.restart_s, mtbf)
    current_waste = None
    if current_interval_s is not None:
        current_waste = daly_waste(current_interval_s, timing.stall_s, timing.lag_s, failures.restart_s, mtbf)
    return IntervalAdvice(
        name=name,
        stall_s=timing.stall_s,
        lag_s=timing.lag_s,
        lag_spread_s=timing.lag_spread_s,
        restart_s=failures.restart_s,
        effective_restart_s=failures.restart_s + (timing.lag_s - timing.stall_s),
        job_mtbf_s=mtbf,
        young_interval_s=young_interval(timing.stall_s, mtbf),
        optimal_interval_s=optimum,
        optimal_interval_steps=steps,
        waste_at_optimum=waste,
        accelerators=accelerators,
        waste_accelerator_hours_per_day_at_optimum=_accelerator_hours(waste, accelerators),
        current_interval_s=current_interval_s,
        waste_at_current=current_waste,
        waste_accelerator_hours_per_day_at_current=_accelerator_hours(current_waste, accelerators),
    )


def advise_intervals(
    timings: Mapping[str, CheckpointTiming],
    failures: FailureModel,
    *,
    current_interval_s: float | None = None,
    step_time_s: float | None = None,
    accelerators_per_node: int | None = None,
) -> dict[str, IntervalAdvice]:
    """One :func:`advise_interval` per named path or failure class (``{"partner": ..., "direct": ...}``).

    Each advice assumes every failure is of its class (the one ``failures`` rate), so the entries
    compare paths or boundaries under the same failures; they are not summed.

    >>> advice = advise_intervals(
    ...     {"B2": CheckpointTiming(2.0, 30.0), "B3": CheckpointTiming(2.0, 300.0)},
    ...     FailureModel(86400.0 * 365, 512, 600.0))
    >>> {name: round(a.waste_at_optimum, 4) for name, a in advice.items()}
    {'B2': 0.0181, 'B3': 0.0224}
    """
    if not timings:
        raise ConfigError("timings must name at least one path or failure class, got an empty mapping")
    return {
        name: advise_interval(
            timing,
            failures,
            name=name,
            current_interval_s=current_interval_s,
            step_time_s=step_time_s,
            accelerators_per_node=accelerators_per_node,
        )
        for name, timing in timings.items()
    }


@dataclass(frozen=True)
class SimulatedWaste:
    """The outcome of :func:`simulate_waste`: the waste fraction ``1 - T_s / mean(T_w)``.

    ``standard_error`` is the waste fraction's standard error over the simulated jobs (delta
    method on the mean wall time); ``mean_failures`` the failures per job, restarts included.
    """

    waste_fraction: float
    standard_error: float
    mean_wall_time_s: float
    mean_failures: float
    jobs: int


@dataclass(frozen=True)
class _Schedule:
    """One simulated job's deterministic timeline between failures."""

    interval: float
    stall: float
    lag: float
    lag_spread: float
    last_segment: float

    @property
    def cycle(self) -> float:
        return self.interval + self.stall

    def extra_lags(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """Per-checkpoint lag beyond the stall: gamma with the mean and spread measured."""
        mean = self.lag - self.stall
        if self.lag_spread == 0:
            return np.full(size, mean)
        shape = (mean / self.lag_spread) ** 2
        return rng.gamma(shape, self.lag_spread**2 / mean, size)


def _restart_times(rng: np.random.Generator, count: int, restart: float, mtbf: float) -> np.ndarray:
    """Seconds each of ``count`` restarts takes when a failure during one starts it over (Daly)."""
    total = np.zeros(count)
    pending = np.arange(count)
    while pending.size:
        attempt = rng.exponential(mtbf, pending.size)
        ok = attempt >= restart
        total[pending[ok]] += restart
        total[pending[~ok]] += attempt[~ok]
        pending = pending[~ok]
    return total


def _last_safe(
    rng: np.random.Generator, schedule: _Schedule, elapsed: np.ndarray, newest: np.ndarray
) -> np.ndarray:
    """Index of the last checkpoint safe ``elapsed`` seconds after a (re)start (0: the one restored).

    Checkpoint ``j`` starts at ``j P + (j - 1) C`` and is safe its lag later; ``newest`` caps ``j``
    (the final save ends the job, so it never serves a restart). With a spread the lags differ, so
    scan down from the newest started save to the first that is safe.
    """
    cycle = schedule.cycle
    started = np.minimum(np.floor((elapsed + schedule.stall) / cycle).astype(np.int64), newest)
    if schedule.lag_spread == 0:
        safe = np.floor((elapsed + schedule.stall - schedule.lag) / cycle).astype(np.int64)
        return np.clip(safe, 0, started)
    safe = np.zeros(elapsed.size, dtype=np.int64)
    pending = np.flatnonzero(started >= 1)
    candidate = started[pending]
    while pending.size:
        # start j*cycle - C, plus the lag C + extra
        safe_at = candidate * cycle + schedule.extra_lags(rng, pending.size)
        ok = safe_at <= elapsed[pending]
        safe[pending[ok]] = candidate[ok]
        keep = ~ok & (candidate > 1)
        pending, candidate = pending[keep], candidate[keep] - 1
    return safe


def simulate_waste(
    work_s: float,
    interval_s: float,
    timing: CheckpointTiming,
    restart_s: float,
    mtbf_s: float,
    *,
    rng: np.random.Generator,
    jobs: int = 1000,
    max_failures: int = 100_000,
) -> SimulatedWaste:
    """Monte Carlo of ``jobs`` independent jobs of ``work_s`` seconds of work under failures.

    Failures arrive with exponential gaps of mean ``mtbf_s``, during work, saves and restarts
    alike. A job saves after every ``interval_s`` of work (and after its last, shorter piece), each
    save blocking ``timing.stall_s``; a save becomes safe ``L`` seconds after it started, ``L`` the
    mean ``timing.lag_s`` (drawn per save as ``stall + gamma`` with ``timing.lag_spread_s`` when
    that is set). A failure rolls back to the last *safe* save and costs ``restart_s``; a failure
    during the restart starts it over. The job ends when its last save returns.

    >>> sim = simulate_waste(36_000.0, 240.0, CheckpointTiming(8.0, 8.0), 0.0, 3600.0,
    ...                      rng=np.random.default_rng(1), jobs=200)
    >>> abs(sim.waste_fraction - daly_waste(240.0, 8.0, 8.0, 0.0, 3600.0)) < 4 * sim.standard_error
    True
    """
    work = _positive("work_s", work_s)
    interval = _positive("interval_s", interval_s)
    restart = _non_negative("restart_s", restart_s)
    mtbf = _positive("mtbf_s", mtbf_s)
    _count("jobs", jobs)
    _count("max_failures", max_failures)
    segments = max(1, math.ceil(work / interval - 1e-9))
    last_segment = work - (segments - 1) * interval
    schedule = _Schedule(interval, timing.stall_s, timing.lag_s, timing.lag_spread_s, last_segment)
    done = np.zeros(jobs, dtype=np.int64)  # segments behind the last safe save each job restarts from
    wall = np.zeros(jobs)
    failures = np.zeros(jobs, dtype=np.int64)
    active = np.arange(jobs)
    for _ in range(max_failures + 1):
        if not active.size:
            break
        remaining = segments - done[active]
        to_finish = (remaining - 1) * schedule.cycle + schedule.last_segment + schedule.stall
        until_failure = rng.exponential(mtbf, active.size)
        finished = until_failure >= to_finish
        wall[active[finished]] += to_finish[finished]
        hit, elapsed = active[~finished], until_failure[~finished]
        done[hit] += _last_safe(rng, schedule, elapsed, remaining[~finished] - 1)
        wall[hit] += elapsed + _restart_times(rng, hit.size, restart, mtbf)
        failures[hit] += 1
        active = hit
    if active.size:
        raise ConfigError(
            f"simulate_waste: {active.size} of {jobs} jobs did not finish within max_failures="
            f"{max_failures}; interval_s={interval_s!r} plus stall is too long against mtbf_s={mtbf_s!r}"
        )
    mean_wall = float(wall.mean())
    spread = float(wall.std(ddof=1)) if jobs > 1 else 0.0
    return SimulatedWaste(
        waste_fraction=1.0 - work / mean_wall,
        standard_error=work / mean_wall**2 * spread / math.sqrt(jobs),
        mean_wall_time_s=mean_wall,
        mean_failures=float(failures.mean()),
        jobs=jobs,
    )
