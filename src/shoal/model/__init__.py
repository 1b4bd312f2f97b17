"""The completion-time model (docs/design.md section 7): pure math over plain numbers, no I/O.

* :mod:`shoal.model.writers`: per-writer time on a tier, ln T = ln(S / b_eff) + g + e, fitted by
  maximum likelihood (lognormal or gamma writers, chosen by BIC); the typical writer and the
  slowest of N writers' quantiles for any N, S and tier state;
* :mod:`shoal.model.evaluate`: forward (time-ordered) splits, MAPE and MdAPE, coverage and
  pinball loss of predicted quantiles;
* :mod:`shoal.model.advisor`: the checkpoint interval (Young, Daly, with the asynchronous lag
  in the restart term), the expected waste, and a Monte Carlo of failures to check them;
* :mod:`shoal.model.exposure`: rollback exposure per failure class (process, host, cluster), live
  (:class:`ExposureTracker`) and over a finished run (:func:`exposure_timeline`).
"""

from __future__ import annotations

from shoal.model.advisor import (
    CheckpointTiming,
    FailureModel,
    IntervalAdvice,
    SimulatedWaste,
    advise_interval,
    advise_intervals,
    daly_interval,
    daly_wall_time,
    daly_waste,
    first_order_waste,
    job_mtbf,
    simulate_waste,
    young_interval,
)
from shoal.model.evaluate import coverage, forward_split, mape, mdape, pinball_loss
from shoal.model.exposure import (
    FAILURE_CLASSES,
    CheckpointTimes,
    ClassExposure,
    ClassTimeline,
    Exposure,
    ExposureTimeline,
    ExposureTracker,
    exposure_timeline,
)
from shoal.model.writers import (
    FAMILIES,
    TierState,
    WriterFit,
    WriterSample,
    choose_family,
    estimate_state,
    fit_writers,
)

__all__ = [
    "FAMILIES",
    "CheckpointTiming",
    "FailureModel",
    "IntervalAdvice",
    "SimulatedWaste",
    "advise_interval",
    "advise_intervals",
    "daly_interval",
    "daly_wall_time",
    "daly_waste",
    "first_order_waste",
    "job_mtbf",
    "simulate_waste",
    "young_interval",
    "FAILURE_CLASSES",
    "CheckpointTimes",
    "ClassExposure",
    "ClassTimeline",
    "Exposure",
    "ExposureTimeline",
    "ExposureTracker",
    "exposure_timeline",
    "TierState",
    "WriterFit",
    "WriterSample",
    "choose_family",
    "estimate_state",
    "coverage",
    "fit_writers",
    "forward_split",
    "mape",
    "mdape",
    "pinball_loss",
]
