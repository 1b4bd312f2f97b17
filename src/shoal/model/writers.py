"""Per-writer time on a tier, and the slowest of a checkpoint's writers (docs/design.md section 7).

The model, for writer ``i`` of checkpoint ``j`` writing ``S_ij`` bytes with ``N_j`` writers::

    m_ij  = ln(latency + S_ij / b_eff(N_j)),   b_eff(N) = min(b_client, b_shared / N)
    ln T_ij = m_ij + g_j + e_ij      (lognormal writers: e_ij ~ N(0, sigma^2))
    T_ij | g_j ~ Gamma(k, exp(m_ij + g_j) / k),  k = 1 / sigma^2      (gamma writers)
    g_j ~ N(0, tau^2), shared by the writers of one checkpoint

``b_client`` is one writer's own ceiling (its NIC, its client); ``b_shared`` is what the tier
gives all writers together, ``B (1 - rho)`` for a tier of bandwidth ``B`` under background load
``rho``: from a job's own records the two are one number, which is all a production run can
see. ``g`` is the state one checkpoint's writers share (the tier's weather at that moment);
``e`` is each writer's own luck. For lognormal writers ``sigma`` is the spread of ``ln T`` given
``g``; for gamma writers it is the coefficient of variation of ``T`` given ``g``.

:func:`fit_writers` fits ``(b_client, b_shared, sigma, tau)`` by maximum likelihood, with ``g``
integrated out checkpoint by checkpoint (in closed form for lognormal writers, numerically for
gamma ones); :func:`choose_family` fits both and keeps the one with the lower BIC. A
:class:`WriterFit` predicts, for any ``N``, ``S`` and :class:`TierState`, the typical (median)
writer and the quantiles of the slowest of ``N`` writers:
``P(max_i T_i <= t) = E_g[prod_i F_i(t | g)]``, integrated over ``g`` on a fine grid.

``latency`` (a fixed cost per write) is 0 unless fitted (``fit_writers(latency=True)``; BIC
decides in ``choose_family(latency=True)``). :func:`estimate_state` gives the tier's present
``b_shared`` from a job's own recent records; :func:`calibrate_spread` refits the spreads a
prediction from such an estimated state should carry (a :class:`TierState` may also carry its
own ``tau``, the spread of ``g`` the job saw lately).

Pure: numpy and scipy over plain numbers; no I/O.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shoal.errors import ConfigError
from shoal.model.plain import from_plain, to_plain

__all__ = [
    "FAMILIES",
    "TierState",
    "WriterFit",
    "WriterSample",
    "calibrate_spread",
    "choose_family",
    "estimate_state",
    "fit_writers",
]

FAMILIES = ("lognormal", "gamma")
"""The per-writer families :func:`fit_writers` knows."""

_SQRT_2PI = np.sqrt(2 * np.pi)
_LOG_SQRT_2PI = np.log(_SQRT_2PI)


class _OnFirstUse:
    """A scipy module imported when a fit first needs it, not when shoal is imported.

    ``import shoal`` sits in every training process and every CLI call; scipy's optimize and
    special cost about a second of CPU to import, which only a model fit needs.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)


optimize: Any = _OnFirstUse("scipy.optimize")
special: Any = _OnFirstUse("scipy.special")


def _norm_logpdf(x: np.ndarray) -> np.ndarray:
    """The standard normal's log density (what ``scipy.stats.norm.logpdf`` computes, without scipy.stats)."""
    return np.asarray(-(x**2) / 2.0 - _LOG_SQRT_2PI)


_G_POINTS = 1201
"""Grid points over g for the slowest writer's distribution (+- 8 tau): smooth to well under 1%."""
_GAMMA_POINTS = 81
"""Grid points per checkpoint for the gamma family's likelihood (around each checkpoint's mode)."""


@dataclass(frozen=True)
class WriterSample:
    """One writer's write of one checkpoint to a tier, as the event records give it."""

    checkpoint: int
    """Which checkpoint: its writers share ``g``."""
    nbytes: int
    seconds: float
    writers: int
    """How many writers that checkpoint had on the tier at once (``concurrency``)."""
    t: float = 0.0
    """When it ended (any clock): the order of a forward split."""


@dataclass(frozen=True)
class TierState:
    """What a prediction assumes of the tier now."""

    b_shared: float
    """Bytes per second the tier gives all writers together now, ``B (1 - rho)``."""
    tau: float | None = None
    """The spread of the shared term ``g`` now, when the records tell it (a bursty tier is bursty
    for a while); None: the fit's ``tau``."""


@dataclass(frozen=True)
class _Data:
    """Samples as arrays, grouped by checkpoint (rows sorted by group)."""

    nbytes: np.ndarray
    seconds: np.ndarray
    writers: np.ndarray
    group: np.ndarray
    """Row -> group index 0..G-1."""
    starts: np.ndarray
    """Group g's rows: starts[g]:starts[g+1]."""

    @classmethod
    def of(cls, samples: Sequence[WriterSample]) -> _Data:
        if not samples:
            raise ConfigError("fit_writers needs at least one writer sample, got none")
        for s in samples:
            if not (s.nbytes > 0 and s.seconds > 0 and s.writers >= 1):
                raise ConfigError(f"writer sample {s}: nbytes and seconds must be > 0 and writers >= 1")
        order = sorted(range(len(samples)), key=lambda i: (samples[i].checkpoint, i))
        ids = [samples[i].checkpoint for i in order]
        starts = [0] + [k for k in range(1, len(ids)) if ids[k] != ids[k - 1]] + [len(ids)]
        group = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
        return cls(
            np.array([samples[i].nbytes for i in order], dtype=float),
            np.array([samples[i].seconds for i in order], dtype=float),
            np.array([samples[i].writers for i in order], dtype=float),
            group,
            np.array(starts),
        )


def _m(
    nbytes: np.ndarray, writers: np.ndarray, b_client: float, b_shared: Any, latency: float = 0.0
) -> np.ndarray:
    """ln(latency + S / b_eff(N)) for every row (``b_shared``: one rate, or one per row)."""
    b_eff = np.minimum(b_client, b_shared / writers)
    return np.log(latency + nbytes / b_eff)


def _loglik_lognormal(d: _Data, m: np.ndarray, sigma: float, tau: float) -> float:
    """Closed form: within a checkpoint, ln T - m is normal with covariance sigma^2 I + tau^2 11'."""
    r = np.log(d.seconds) - m
    n = np.diff(d.starts).astype(float)
    sums = np.add.reduceat(r, d.starts[:-1])
    mean = sums / n
    ssw = np.add.reduceat(r * r, d.starts[:-1]) - n * mean * mean
    s2, t2 = sigma * sigma, tau * tau
    ll = (
        -0.5 * n * math.log(2 * math.pi)
        - (n - 1) * math.log(sigma)
        - 0.5 * np.log(s2 + n * t2)
        - ssw / (2 * s2)
        - n * mean * mean / (2 * (s2 + n * t2))
    )
    return float(ll.sum() - np.log(d.seconds).sum())


def _loglik_gamma(d: _Data, m: np.ndarray, sigma: float, tau: float) -> float:
    """g integrated out per checkpoint on a grid around the mode of its integrand (all at once)."""
    k = 1.0 / (sigma * sigma)
    base = k * math.log(k) - special.gammaln(k) + (k - 1) * np.log(d.seconds) - k * m
    consts = np.add.reduceat(base, d.starts[:-1])
    w = np.add.reduceat(d.seconds * np.exp(-m), d.starts[:-1])  # per checkpoint: sum of T e^{-m}
    n = np.diff(d.starts).astype(float)
    t2 = tau * tau
    # The log integrand A(g) = -n k g - k W e^{-g} - g^2 / (2 tau^2) is concave: its mode solves
    # A'(g) = 0, a convex decreasing function, so Newton's steps close in on it from either side.
    g = np.log(w / n)
    for _ in range(60):
        kwe = k * w * np.exp(-g)
        slope = -n * k + kwe - g / t2
        g = g + slope / (kwe + 1.0 / t2)
        if np.all(np.abs(slope) < 1e-10 * (n * k + 1.0)):
            break
    sd = 1.0 / np.sqrt(k * w * np.exp(-g) + 1.0 / t2)
    offsets = _GAMMA_OFFSETS
    grid = g[:, None] + sd[:, None] * offsets[None, :]
    a = -n[:, None] * k * grid - k * w[:, None] * np.exp(-grid) - grid * grid / (2 * t2)
    step = sd * (offsets[1] - offsets[0])
    per = consts + _logsumexp_rows(a) + np.log(step) - math.log(tau * math.sqrt(2 * math.pi))
    return float(per.sum())


_GAMMA_OFFSETS = np.linspace(-8.0, 8.0, _GAMMA_POINTS)
"""The gamma likelihood's grid around each checkpoint's mode, in its standard deviations."""


def _logsumexp_rows(a: np.ndarray) -> np.ndarray:
    """``ln sum_j exp(a[i, j])`` for each row: ``scipy.special.logsumexp(a, axis=1)``, computed the
    same way, without its checks and array-API dispatch (which cost more than the sum itself at
    these sizes, and a fit calls this thousands of times)."""
    top = a.max(axis=1)
    top[~np.isfinite(top)] = 0.0  # as scipy: a row without a finite entry sums to its own inf
    with np.errstate(divide="ignore"):  # a row of -inf: ln 0, as scipy (quietly)
        return np.log(np.exp(a - top[:, None]).sum(axis=1)) + top


_LOGLIK = {"lognormal": _loglik_lognormal, "gamma": _loglik_gamma}


def _starts(d: _Data) -> list[np.ndarray]:
    """Starting points: b_client from the fewest-writer checkpoints, b_shared from the most-writer ones.

    ``min(b_client, b_shared / N)`` is flat in whichever rate never binds, so one start can
    settle with ``b_client`` bounding nothing; a few starts with the kink at different writer
    counts, and the best of them, avoid that.
    """
    rate = d.nbytes / d.seconds
    fewest, most = d.writers.min(), d.writers.max()
    b_client = float(np.median(rate[d.writers == fewest]))
    b_shared = float(np.median(rate[d.writers == most] * most))
    counts = sorted(set(d.writers.tolist()))
    starts = [np.log([b_client, b_shared, 0.2, 0.2])]
    for n in counts[:-1]:  # the kink just above each writer count seen
        starts.append(np.log([b_client, b_client * (n + 0.5), 0.2, 0.2]))
    starts.append(np.log([b_client * 1e3, b_shared, 0.2, 0.2]))  # b_client never binds
    return starts


def fit_writers(
    samples: Sequence[WriterSample],
    family: str = "lognormal",
    *,
    latency: bool = False,
    pace: Callable[[], None] | None = None,
) -> WriterFit:
    """Fit ``b_client``, ``b_shared``, ``sigma`` and ``tau`` to ``samples`` by maximum likelihood.

    ``samples`` should span several checkpoints (``tau`` is the spread between them) and, for
    ``b_client`` and ``b_shared`` to be told apart, several writer counts: where every sample's
    writers share the tier evenly the fit cannot see ``b_client`` and puts it high (it then
    bounds nothing). With ``latency`` a fixed cost per write is fitted too (``T = (latency +
    S / b_eff) e^(g + e)``: the request's round trips and the store's own handling of an
    object, which bytes alone do not explain); it needs several sizes or writer counts to be
    told from the rates. ``pace``, when given, is called before every evaluation of the
    likelihood (a caller that bounds the fit's CPU share sleeps there). Raises
    :class:`~shoal.errors.ConfigError` for an unknown family or bad samples.
    """
    if family not in _LOGLIK:
        raise ConfigError(f"family must be one of {FAMILIES}, got {family!r}")
    d = _Data.of(samples)
    loglik = _LOGLIK[family]

    def neg(theta: np.ndarray) -> float:
        if pace is not None:
            pace()
        values = np.exp(np.clip(theta, -60.0, 60.0))
        b_client, b_shared, sigma, tau = values[:4]
        lat = float(values[4]) if len(values) > 4 else 0.0
        if not (1e-4 < sigma < 20 and 1e-4 < tau < 20):
            return 1e300
        value = loglik(d, _m(d.nbytes, d.writers, b_client, b_shared, lat), sigma, tau)
        return -value if math.isfinite(value) else 1e300

    starts = _starts(d)
    if latency:  # each start with next to no latency, and with a third of the quickest write
        quickest = float(d.seconds.min())
        starts = [np.append(x, math.log(v)) for x in starts for v in (1e-6 * quickest, quickest / 3)]
    options = {"maxiter": 6000, "xatol": 1e-8, "fatol": 1e-10}
    tries = [optimize.minimize(neg, x0, method="Nelder-Mead", options=options) for x0 in starts]
    best = min(tries, key=lambda r: float(r.fun))
    best = optimize.minimize(neg, best.x, method="Nelder-Mead", options=options)  # restart: NM can stall
    values = [float(v) for v in np.exp(np.clip(best.x, -60.0, 60.0))]  # what neg() evaluated
    b_client, b_shared, sigma, tau = values[:4]
    lat, params = (values[4], 5) if latency else (0.0, 4)
    return WriterFit(family, b_client, b_shared, sigma, tau, -float(best.fun), len(d.seconds), lat, params)


def estimate_state(
    fit: WriterFit, recent: Sequence[WriterSample], *, pace: Callable[[], None] | None = None
) -> TierState:
    """The tier's state now, from a job's own ``recent`` records: ``b_shared`` refitted alone.

    ``b_client``, ``sigma`` and ``tau`` stay as ``fit`` has them (they describe the writers and the
    tier's variability, which change slowly); ``b_shared`` is what other tenants' load moves, and
    is refitted by maximum likelihood over the recent checkpoints. Where no recent writer was
    bound by the tier's share (``b_client < b_shared / N`` for every one of them) the records say
    nothing about it, and ``fit``'s own ``b_shared`` stands. ``pace``: as :func:`fit_writers`'s.
    """
    d = _Data.of(recent)  # ConfigError for no records or bad ones
    loglik = _LOGLIK[fit.family]
    shares = fit.b_client * d.writers  # the tier binds a writer only while b_shared < b_client * N

    def neg(log_b: float) -> float:
        if pace is not None:
            pace()
        m = _m(d.nbytes, d.writers, fit.b_client, math.exp(log_b), fit.latency)
        value = loglik(d, m, fit.sigma, fit.tau)
        return -value if math.isfinite(value) else 1e300

    # A grid first: the likelihood is flat where the share never binds, which misleads a bracket.
    grid = np.linspace(math.log(fit.b_shared) - 6.0, math.log(fit.b_shared) + 6.0, 121)
    best = int(np.argmin([neg(float(x)) for x in grid]))
    lo, hi = float(grid[max(best - 1, 0)]), float(grid[min(best + 1, len(grid) - 1)])
    found = optimize.minimize_scalar(neg, bounds=(lo, hi), method="bounded")
    b_shared = math.exp(float(found.x))
    if b_shared >= float(shares.max()):  # the share never bound: the records cannot see b_shared
        return fit.state()
    return TierState(b_shared)


def calibrate_spread(
    fit: WriterFit,
    checkpoints: Sequence[tuple[TierState, Sequence[WriterSample]]],
    *,
    target: str = "writers",
) -> WriterFit:
    """``fit`` with ``tau`` refitted as the spread of ``g`` around states estimated beforehand.

    :func:`fit_writers` fits one ``b_shared`` over all its records, so its ``tau`` is the spread
    of the shared term around that one rate: every change of load or weather over the records
    is in it. A running job predicts instead from a state estimated from its own recent records
    (:func:`estimate_state`), which follows such changes, but late and with noise. The spread a
    prediction should carry is that of ``g`` around the state it was given: ``checkpoints`` pairs
    each checkpoint's writers with the state estimated before it ran.

    ``target="writers"`` refits ``tau`` by maximum likelihood of every writer (``b_client`` and
    ``sigma`` kept). ``target="slowest"`` refits ``sigma`` and ``tau`` by maximum likelihood of
    each checkpoint's slowest writer under the model's own distribution of the slowest
    (:meth:`WriterFit.slowest_cdf`'s density; ``sigma`` alone where every state carries its own
    ``tau``): for when the writers' spread within a checkpoint
    is not the family's (writers that started late and so finished early make a long tail
    below the median, which a fit of every writer reads as one above it too, and so over-predicts
    the slowest). Raises :class:`~shoal.errors.ConfigError` for no checkpoints, bad samples or an
    unknown target.
    """
    if not checkpoints:
        raise ConfigError("calibrate_spread needs at least one (state, writers) checkpoint, got none")
    if target not in ("writers", "slowest", "order"):
        raise ConfigError(f"target must be 'writers', 'slowest' or 'order', got {target!r}")
    samples: list[WriterSample] = []
    shares: list[float] = []
    for j, (state, writers) in enumerate(checkpoints):
        samples.extend(WriterSample(j, s.nbytes, s.seconds, s.writers, s.t) for s in writers)
        shares.extend([state.b_shared] * len(writers))
    d = _Data.of(samples)  # rows sorted by checkpoint, and so by the order of ``shares``
    b_shared = np.array(shares, dtype=float)[np.argsort([s.checkpoint for s in samples], kind="stable")]
    m = _m(d.nbytes, d.writers, fit.b_client, b_shared, fit.latency)
    if target in ("slowest", "order"):
        own = [state.tau for state, _ in checkpoints]
        taus = None if any(t is None for t in own) else np.array(own, dtype=float)
        return (_calibrate_slowest if target == "slowest" else _calibrate_order)(fit, d, m, taus)
    loglik = _LOGLIK[fit.family]

    def neg(log_tau: float) -> float:
        value = loglik(d, m, fit.sigma, math.exp(log_tau))
        return -value if math.isfinite(value) else 1e300

    found = optimize.minimize_scalar(neg, bounds=(math.log(1e-4), math.log(5.0)), method="bounded")
    return replace(fit, tau=math.exp(float(found.x)))


_SLOWEST_POINTS = 161
"""Grid points over g (+- 6 tau) for the slowest writer's likelihood."""


def _slowest_loglik(family: str, d: _Data, m: np.ndarray, sigma: float, tau: Any) -> float:
    """Sum over checkpoints of ln(density of their slowest writer's time), g integrated on a grid.

    The slowest of writers with cdfs F_i and densities f_i has density
    ``sum_i f_i(t) prod_{k != i} F_k(t)`` given g, at its time t; all rows of a checkpoint are
    evaluated at that checkpoint's slowest time. ``tau``: one spread, or one per checkpoint.
    """
    t = np.maximum.reduceat(d.seconds, d.starts[:-1])[d.group]  # each row: its checkpoint's slowest
    z = np.linspace(-6.0, 6.0, _SLOWEST_POINTS)  # g = tau z
    log_w = _norm_logpdf(z)
    log_w -= special.logsumexp(log_w)
    taus = np.broadcast_to(np.asarray(tau, dtype=float), (len(d.starts) - 1,))
    mu = m[:, None] + taus[d.group][:, None] * z[None, :]  # rows x grid
    if family == "lognormal":
        x = (np.log(t)[:, None] - mu) / sigma
        log_cdf = special.log_ndtr(x)
        log_pdf = _norm_logpdf(x) - math.log(sigma) - np.log(t)[:, None]
    else:
        k = 1.0 / (sigma * sigma)
        y = k * t[:, None] * np.exp(-mu)
        log_cdf = np.log(np.clip(special.gammainc(k, y), 1e-300, 1.0))
        log_pdf = k * math.log(k) - special.gammaln(k) + (k - 1) * np.log(t)[:, None] - k * mu - y
    all_below = np.add.reduceat(log_cdf, d.starts[:-1], axis=0)  # checkpoints x grid
    hazard_sum = np.add.reduceat(np.exp(np.minimum(log_pdf - log_cdf, 700.0)), d.starts[:-1], axis=0)
    per = _logsumexp_rows(all_below + np.log(np.maximum(hazard_sum, 1e-300)) + log_w[None, :])
    return float(per.sum())


def _calibrate_order(fit: WriterFit, d: _Data, m: np.ndarray, taus: np.ndarray | None) -> WriterFit:
    """``sigma`` from the gap between each checkpoint's median and slowest writer, then ``tau`` by
    the likelihood of each checkpoint's slowest writer (unless the states carry their own)."""
    sigma = _sigma_from_order(fit.family, d, m) or fit.sigma
    if taus is not None:
        return replace(fit, sigma=sigma)

    def neg(log_tau: float) -> float:
        value = _slowest_loglik(fit.family, d, m, sigma, math.exp(log_tau))
        return -value if math.isfinite(value) else 1e300

    found = optimize.minimize_scalar(neg, bounds=(math.log(1e-4), math.log(5.0)), method="bounded")
    return replace(fit, sigma=sigma, tau=math.exp(float(found.x)))


def _calibrate_slowest(fit: WriterFit, d: _Data, m: np.ndarray, taus: np.ndarray | None) -> WriterFit:
    """``fit`` with ``sigma`` and ``tau`` of the best likelihood of each checkpoint's slowest writer.

    With ``taus`` (each checkpoint's state's own spread of g) only ``sigma`` is refitted."""

    def neg(theta: np.ndarray) -> float:
        sigma, tau = np.exp(np.clip(theta, -12.0, 3.0)).tolist() + [0.0] * (2 - len(theta))
        value = _slowest_loglik(fit.family, d, m, sigma, tau if taus is None else taus)
        return -value if math.isfinite(value) else 1e300

    if taus is not None:
        found = optimize.minimize_scalar(lambda x: neg(np.array([x])), bounds=(-9.0, 1.5), method="bounded")
        return replace(fit, sigma=math.exp(float(found.x)))
    x0 = np.log([fit.sigma, max(fit.tau, 1e-3)])
    found = optimize.minimize(neg, x0, method="Nelder-Mead", options={"xatol": 1e-5, "fatol": 1e-7})
    sigma, tau = (float(v) for v in np.exp(found.x))
    return replace(fit, sigma=sigma, tau=tau)


_ORDER_DRAWS = 2000
"""Draws per writer count for the model's spread between a checkpoint's median and slowest writer."""


def _order_gap(family: str, sigma: float, offsets: np.ndarray, u: np.ndarray) -> float:
    """E[ln(slowest / median)] of writers whose ``ln(S / b_eff)`` differ by ``offsets`` (g cancels).

    ``u``: uniform draws, one row per draw and a column per writer (common to every ``sigma``)."""
    if family == "lognormal":
        x = sigma * special.ndtri(u)
    else:
        k = 1.0 / (sigma * sigma)
        x = np.log(np.maximum(special.gammaincinv(k, u) / k, 1e-300))
    x = x + offsets[None, :]
    return float(np.mean(x.max(axis=1) - np.median(x, axis=1)))


def _sigma_from_order(family: str, d: _Data, m: np.ndarray) -> float | None:
    """The ``sigma`` whose gap between a checkpoint's median and slowest writer matches the records'.

    ``ln(slowest / median)`` within one checkpoint does not depend on ``g`` nor on the tier's
    state: it is the writers' own spread, in the part of it that decides when a checkpoint is
    done. Checkpoints of one writer say nothing of it; None when every checkpoint has one.
    """
    groups: dict[tuple[float, ...], list[float]] = {}
    for lo, hi in zip(d.starts[:-1], d.starts[1:], strict=True):
        if hi - lo < 2:
            continue
        t = np.log(d.seconds[lo:hi])
        offsets = tuple(np.round(m[lo:hi] - m[lo:hi].mean(), 6))
        groups.setdefault(offsets, []).append(float(t.max() - np.median(t)))
    if not groups:
        return None
    rng = np.random.default_rng(0)
    u = rng.uniform(1e-12, 1 - 1e-12, (_ORDER_DRAWS, max(len(k) for k in groups)))
    keys = [(np.array(k), len(v), float(np.mean(v))) for k, v in groups.items()]

    def loss(log_sigma: float) -> float:
        sigma = math.exp(log_sigma)
        return sum(n * (seen - _order_gap(family, sigma, o, u[:, : len(o)])) ** 2 for o, n, seen in keys)

    found = optimize.minimize_scalar(loss, bounds=(math.log(1e-3), math.log(3.0)), method="bounded")
    return math.exp(float(found.x))


def choose_family(
    samples: Sequence[WriterSample], *, latency: bool = False
) -> tuple[WriterFit, Mapping[str, WriterFit]]:
    """Fit every family of :data:`FAMILIES`; return the one with the lowest BIC, and all of them.

    With ``latency`` each family is also fitted with a fixed cost per write (under
    ``"<family>+latency"``), and BIC chooses among all four.
    """
    fits = {f: fit_writers(samples, f) for f in FAMILIES}
    if latency:
        fits.update({f"{f}+latency": fit_writers(samples, f, latency=True) for f in FAMILIES})
    return min(fits.values(), key=lambda f: f.bic), fits


@dataclass(frozen=True)
class WriterFit:
    """A fitted writer model of one tier; predicts for any writer count, size and tier state."""

    family: str
    b_client: float
    """One writer's own ceiling, bytes per second."""
    b_shared: float
    """What the tier gave all writers together over the fitted records, ``B (1 - rho)``."""
    sigma: float
    tau: float
    loglik: float
    n: int
    """Writer samples fitted."""
    latency: float = 0.0
    """A fixed cost per write, seconds (0: none fitted): ``T = (latency + S / b_eff) e^(g + e)``."""
    n_params: int = 4
    """Parameters fitted (5 with a latency), for the BIC."""

    def to_json(self) -> dict[str, Any]:
        """The fit as plain JSON values (:meth:`from_json` reads it back, bit for bit)."""
        return to_plain(self)

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> WriterFit:
        """A fit from :meth:`to_json`'s object; :class:`~shoal.errors.ConfigError` says what is wrong."""
        fit = from_plain(cls, value, "a writer fit's JSON")
        if fit.family not in FAMILIES:
            raise ConfigError(f"a writer fit's family must be one of {FAMILIES}, got {fit.family!r}")
        return fit

    @property
    def bic(self) -> float:
        return self.n_params * math.log(self.n) - 2.0 * self.loglik

    def state(self) -> TierState:
        """The tier state of the fitted records."""
        return TierState(self.b_shared)

    def b_eff(self, writers: int, state: TierState | None = None) -> float:
        """Each writer's rate with ``writers`` of them: ``min(b_client, b_shared / writers)``."""
        b_shared = (state or self.state()).b_shared
        return min(self.b_client, b_shared / writers)

    def _m(self, nbytes: float, writers: int, state: TierState | None) -> float:
        """ln(latency + S / b_eff): the log of a writer's time at g = e = 0."""
        return math.log(self.latency + nbytes / self.b_eff(writers, state))

    def _cdf_given_g(self, t: float, m: float, g: np.ndarray) -> np.ndarray:
        """F(t | g) of one writer whose ``ln(S / b_eff)`` is ``m``, for every g."""
        if self.family == "lognormal":
            # the normal cdf: stats.norm.cdf's own value, without its argument checks (a fit calls it often)
            return np.asarray(special.ndtr((math.log(t) - m - g) / self.sigma))
        k = 1.0 / (self.sigma * self.sigma)
        return np.asarray(special.gammainc(k, k * t * np.exp(-(m + g))))

    def _tau(self, state: TierState | None) -> float:
        """The spread of g a prediction in ``state`` carries: the state's own, else the fit's."""
        return self.tau if state is None or state.tau is None else state.tau

    def _grid(self, state: TierState | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Points over g and their normal weights (+- 8 of the spread ``state`` predicts with)."""
        tau = self._tau(state)
        g = np.linspace(-8 * tau, 8 * tau, _G_POINTS)
        w = np.exp(-((g / tau) ** 2) / 2.0) / _SQRT_2PI / tau  # stats.norm.pdf(g, scale=tau), bit for bit
        return g, w / w.sum()

    def slowest_cdf(self, t: float, sizes: Sequence[float], state: TierState | None = None) -> float:
        """P(the slowest of ``len(sizes)`` writers, of these sizes, ends within ``t`` seconds)."""
        if t <= 0:
            return 0.0
        n = len(sizes)
        g, w = self._grid(state)
        log_all = np.zeros_like(g)
        for size in sizes:
            log_all += np.log(np.clip(self._cdf_given_g(t, self._m(size, n, state), g), 1e-300, 1.0))
        return float(np.dot(w, np.exp(log_all)))

    def slowest_quantile(self, q: float, sizes: Sequence[float], state: TierState | None = None) -> float:
        """The ``q`` quantile of the slowest writer's time (seconds), for writers of ``sizes``."""
        if not 0 < q < 1:
            raise ConfigError(f"quantile q must be in (0, 1), got {q!r}")
        if not sizes or min(sizes) <= 0:
            raise ConfigError(f"sizes must be positive byte counts, one per writer, got {list(sizes)!r}")
        scale = math.exp(self._m(max(sizes), len(sizes), state))
        return self._invert(lambda t: self.slowest_cdf(t, sizes, state), q, scale, self._tau(state))

    def writer_quantile(self, q: float, nbytes: float, writers: int, state: TierState | None = None) -> float:
        """The ``q`` quantile of one writer's time (g and its own luck both unknown)."""
        if not 0 < q < 1:
            raise ConfigError(f"quantile q must be in (0, 1), got {q!r}")
        m = self._m(nbytes, writers, state)
        g, w = self._grid(state)
        cdf = lambda t: float(np.dot(w, self._cdf_given_g(t, m, g)))  # noqa: E731
        return self._invert(cdf, q, math.exp(m), self._tau(state))

    def typical(self, nbytes: float, writers: int, state: TierState | None = None) -> float:
        """The typical (median) writer's time, seconds."""
        return self.writer_quantile(0.5, nbytes, writers, state)

    def _invert(self, f: Callable[[float], float], q: float, scale: float, tau: float) -> float:
        """The t where the increasing ``f(t) = P(T <= t)`` reaches ``q`` (``scale``: a typical t)."""
        spread = 8.0 * (self.sigma + tau) + 1.0
        lo, hi = math.log(scale) - spread, math.log(scale) + spread
        while f(math.exp(hi)) < q:
            hi += spread
        while f(math.exp(lo)) > q:
            lo -= spread
        return math.exp(optimize.brentq(lambda x: f(math.exp(x)) - q, lo, hi, xtol=1e-10))

    def simulate(
        self,
        rng: np.random.Generator,
        sizes: Sequence[float],
        checkpoints: int,
        state: TierState | None = None,
    ) -> list[WriterSample]:
        """Draw ``checkpoints`` checkpoints of writers of ``sizes`` from the model (tests, consistency)."""
        n = len(sizes)
        m = np.log(self.latency + np.asarray(sizes, dtype=float) / self.b_eff(n, state))
        out: list[WriterSample] = []
        for j in range(checkpoints):
            g = rng.normal(0.0, self._tau(state))
            if self.family == "lognormal":
                times = np.exp(m + g + rng.normal(0.0, self.sigma, n))
            else:
                k = 1.0 / (self.sigma * self.sigma)
                times = rng.gamma(k, np.exp(m + g) / k)
            out.extend(
                WriterSample(j, int(s), float(x), n, float(j)) for s, x in zip(sizes, times, strict=True)
            )
        return out
