"""The tier's state from a job's own checkpoints: each rule, and the adaptive choice among them."""

from __future__ import annotations

import math

import numpy as np
import pytest

import shoal.model.states as states_mod
from shoal.errors import ConfigError
from shoal.model.states import ADAPTIVE_CANDIDATES, StateEstimator, StateRule
from shoal.model.writers import WriterFit, WriterSample

MB = 1e6
MODEL = WriterFit("lognormal", 50 * MB, 200 * MB, 0.05, 0.05, 0.0, 0)


def _checkpoint(cid: int, b_shared: float, writers: int = 8, seed: int = 0) -> tuple[WriterSample, ...]:
    """One checkpoint of ``writers`` writers of 8 MB drawn from MODEL with the tier at ``b_shared``."""
    rng = np.random.default_rng(seed * 7919 + cid)
    true = WriterFit("lognormal", MODEL.b_client, b_shared, MODEL.sigma, MODEL.tau, 0.0, 0)
    return tuple(
        WriterSample(cid, s.nbytes, s.seconds, writers, s.seconds)
        for s in true.simulate(rng, [8 * MB] * writers, 1)
    )


@pytest.mark.parametrize(
    "text",
    ["pooled:2", "median:4", "median:all", "matched:8", "matched:all", "adaptive", "matched:all+probe"],
)
def test_a_rule_reads_back_from_its_text(text: str) -> None:
    assert str(StateRule.parse(text)) == text


@pytest.mark.parametrize(
    ("text", "match"),
    [("pooled:all", "window >= 1"), ("mean:3", "is .pooled:W."), ("median:x", "is 'pooled:W'"),
     ("adaptive:3", "takes no window"), ("pooled:-1", "window >= 1"), ("median:4+probe", "only a matched"),
     ("matched:4+pro", "only suffix")],
)  # fmt: skip
def test_a_bad_rule_says_what_was_wrong(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        StateRule.parse(text)


def test_no_history_gives_no_state() -> None:
    assert StateEstimator(MODEL, StateRule.parse("median:4")).state([]) is None


def test_the_median_rule_is_not_moved_by_one_unlucky_checkpoint() -> None:
    history = [_checkpoint(k, 200 * MB) for k in range(4)] + [_checkpoint(4, 60 * MB)]
    median = StateEstimator(MODEL, StateRule.parse("median:4")).state(history)
    newest = StateEstimator(MODEL, StateRule.parse("pooled:1")).state(history)
    assert median is not None and newest is not None
    assert median.b_shared == pytest.approx(200 * MB, rel=0.1)
    assert newest.b_shared == pytest.approx(60 * MB, rel=0.1)


def test_each_checkpoints_own_estimate_is_made_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = states_mod.estimate_state
    monkeypatch.setattr(states_mod, "estimate_state", lambda *a, **k: calls.append(1) or real(*a, **k))
    estimator = StateEstimator(MODEL, StateRule.parse("median:all"))
    history = [_checkpoint(k, 200 * MB) for k in range(6)]
    for n in range(1, 7):
        estimator.state(history[:n])
    assert len(calls) == 6


def test_adaptive_follows_a_step_that_a_long_median_lags() -> None:
    # 10 checkpoints at 200 MB/s, then the other tenants take 60% of the tier for good
    history = [_checkpoint(k, 200 * MB) for k in range(10)] + [_checkpoint(k, 80 * MB) for k in range(10, 15)]
    adaptive = StateEstimator(MODEL, StateRule.parse("adaptive"))
    state = adaptive.state(history)
    lagging = StateEstimator(MODEL, StateRule.parse("median:all")).state(history)
    assert state is not None and lagging is not None
    assert state.b_shared == pytest.approx(80 * MB, rel=0.15)
    assert lagging.b_shared > 150 * MB
    assert adaptive.last_choice is not None and adaptive.last_choice.window in (1, 2, 4)


def test_adaptive_keeps_its_default_until_it_has_seen_enough() -> None:
    adaptive = StateEstimator(MODEL, StateRule.parse("adaptive"))
    adaptive.state([_checkpoint(0, 200 * MB), _checkpoint(1, 200 * MB)])
    assert adaptive.last_choice == ADAPTIVE_CANDIDATES[0] == StateRule.parse("median:all")


def test_in_a_steady_tier_adaptive_predicts_as_well_as_the_best_candidate() -> None:
    history = [_checkpoint(k, 150 * MB, seed=3) for k in range(30)]
    errors: dict[str, list[float]] = {}
    for text in ("adaptive", "pooled:1", "median:all"):
        estimator = StateEstimator(MODEL, StateRule.parse(text))
        for k in range(8, 30):
            state = estimator.state(history[:k])
            assert state is not None
            typical = float(np.median([s.seconds for s in history[k]]))
            errors.setdefault(text, []).append(abs(math.log(typical / MODEL.typical(8 * MB, 8, state))))
    mean = {k: float(np.mean(v)) for k, v in errors.items()}
    assert mean["adaptive"] <= 1.15 * min(mean["pooled:1"], mean["median:all"])


def _staggered(cid: int, seconds: float, writers: int = 8, early: int = 3) -> tuple[WriterSample, ...]:
    """A checkpoint whose ``early`` writers finished at 0.6x the others (they overlapped less)."""
    rng = np.random.default_rng(cid)
    times = [seconds * (0.6 if w < early else 1.0) * math.exp(rng.normal(0.0, 0.02)) for w in range(writers)]
    return tuple(WriterSample(cid, 8 * MB, t, writers, t) for t in times)


def test_matched_predicts_the_median_writer_where_the_fits_shape_is_off() -> None:
    # The writers of each checkpoint are not the fit's family: three finish early, every time.
    # The likelihood's state puts the typical writer below the observed median; matching does not.
    history = [_staggered(k, 0.40) for k in range(10)]
    nxt = float(np.median([s.seconds for s in _staggered(10, 0.40)]))
    predicted = {}
    for text in ("median:all", "matched:all", "matched:4"):
        state = StateEstimator(MODEL, StateRule.parse(text)).state(history)
        assert state is not None
        predicted[text] = MODEL.typical(8 * MB, 8, state)
    assert predicted["median:all"] < 0.9 * nxt  # the bias the matched rule removes
    assert predicted["matched:all"] == pytest.approx(nxt, rel=0.03)
    assert predicted["matched:4"] == pytest.approx(nxt, rel=0.03)


def test_matched_falls_back_to_the_checkpoints_own_estimate_where_the_tier_never_binds() -> None:
    # One writer of 8 MB at 50 MB/s (b_client) on a 200 MB/s tier: no b_shared near it changes its time
    fast = tuple(WriterSample(k, 8 * MB, 0.2, 1, 0.2) for k in range(1))
    estimator = StateEstimator(MODEL, StateRule.parse("matched:all"))
    assert estimator.matched(fast) == estimator.own(fast)


def _probe(b_shared: float, rng: np.random.Generator, luck: float) -> float:
    """A probe's rate: a fixed share of the tier, with ``luck`` (its spread in ln) of its own."""
    return 0.2 * b_shared * math.exp(rng.normal(0.0, luck))


def test_a_probed_rule_sees_a_step_at_the_first_checkpoint_after_it() -> None:
    rng = np.random.default_rng(5)
    rates = [200 * MB] * 8 + [80 * MB] * 2 + [200 * MB] * 3
    history = [_checkpoint(k, b) for k, b in enumerate(rates)]
    probes: list[float | None] = [_probe(b, rng, 0.03) for b in rates]
    probed = StateEstimator(MODEL, StateRule.parse("matched:all+probe"))
    plain = StateEstimator(MODEL, StateRule.parse("matched:all"))
    # the tier steps down just before the next checkpoint: only its probe knows
    now = _probe(80 * MB, rng, 0.03)
    state, lagging = probed.state(history, probes, now), plain.state(history)
    assert state is not None and lagging is not None
    assert state.b_shared == pytest.approx(80 * MB, rel=0.15)
    assert lagging.b_shared == pytest.approx(200 * MB, rel=0.15)
    # without a probe now (or any before), it is its rule alone
    assert probed.state(history, probes, None) == lagging
    assert probed.state(history, [None] * len(history), now) == lagging


def test_on_a_steady_tier_a_probe_with_luck_of_its_own_is_not_followed() -> None:
    rng = np.random.default_rng(9)
    history = [_checkpoint(k, 150 * MB, seed=2) for k in range(12)]
    probes: list[float | None] = [_probe(150 * MB, rng, 0.3) for _ in history]
    probed = StateEstimator(MODEL, StateRule.parse("matched:all+probe"))
    state = probed.state(history, probes, _probe(150 * MB, rng, 0.3) * 2)  # an unlucky probe now
    assert state == StateEstimator(MODEL, StateRule.parse("matched:all")).state(history)


def test_probes_must_be_one_per_checkpoint() -> None:
    history = [_checkpoint(k, 150 * MB) for k in range(3)]
    with pytest.raises(ConfigError, match="2 probes for 3 checkpoints"):
        StateEstimator(MODEL, StateRule.parse("matched:all+probe")).state(history, [1.0, 2.0], 1.0)
