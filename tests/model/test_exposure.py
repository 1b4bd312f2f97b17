"""Rollback exposure (shoal.model.exposure): hand-computed sawtooths, the live tracker, bad input."""

from __future__ import annotations

import random
import threading

import pytest

from shoal.errors import ConfigError, ShoalError
from shoal.model.exposure import (
    FAILURE_CLASSES,
    CheckpointTimes,
    ExposureTracker,
    exposure_timeline,
    protection_changes,
)

# Two checkpoints over a run from 0 to 100 s:
#   step 10, saved at 10: B1 at 12, B2 at 20, B4 at 30
#   step 20, saved at 50: B1 at 52, B4 at 70 (B2 and B3 implied by B4)
RUN = [
    CheckpointTimes(10, 10.0, {1: 12.0, 2: 20.0, 4: 30.0}),
    CheckpointTimes(20, 50.0, {1: 52.0, 4: 70.0}),
]


def test_failure_classes_are_protected_by_b1_b2_and_b4() -> None:
    assert dict(FAILURE_CLASSES) == {"process": 1, "host": 2, "cluster": 4}


def test_cluster_sawtooth_matches_the_hand_computed_one() -> None:
    cluster = exposure_timeline(RUN, 0.0, 100.0)["cluster"]
    # 0..30 rises to 30, drops to 30-10=20; 30..70 rises to 60, drops to 70-50=20; 70..100 rises to 50
    assert cluster.points == ((0, 0), (30, 30), (30, 20), (70, 60), (70, 20), (100, 50))
    assert cluster.peak_seconds == 60.0
    assert cluster.integral == 30 * 30 / 2 + 40 * (20 + 60) / 2 + 30 * (20 + 50) / 2  # 3100, exact
    assert cluster.mean_seconds == 31.0
    assert cluster.at_end.seconds == 50.0 and cluster.at_end.protected_step == 20
    assert cluster.at_end.steps == 0 and cluster.checkpoints == 2 and cluster.protections == 2


def test_lower_levels_are_implied_by_higher_ones() -> None:
    timeline = exposure_timeline(RUN, 0.0, 100.0)
    host = timeline["host"]
    # step 20 never reported B2 itself: its B4 at 70 protects against a host failure from then on
    assert host.points == ((0, 0), (20, 20), (20, 10), (70, 60), (70, 20), (100, 50))
    assert host.integral == 20 * 20 / 2 + 50 * (10 + 60) / 2 + 30 * (20 + 50) / 2
    process = timeline["process"]
    assert process.points == ((0, 0), (12, 12), (12, 2), (52, 42), (52, 2), (100, 50))
    assert process.peak_seconds == 50.0
    only_b4 = CheckpointTimes(1, 5.0, {4: 9.0})
    assert only_b4.reached_at(1) == only_b4.reached_at(2) == only_b4.reached_at(4) == 9.0


def test_a_checkpoint_completing_out_of_order_changes_nothing() -> None:
    late_old = CheckpointTimes(10, 10.0, {4: 80.0})  # saved first, committed last
    early_new = CheckpointTimes(20, 50.0, {4: 60.0})
    cluster = exposure_timeline([late_old, early_new], 0.0, 100.0)["cluster"]
    assert [(c.at, c.step) for c in protection_changes([late_old, early_new], 4)] == [(60.0, 20)]
    assert cluster.points == ((0, 0), (60, 60), (60, 10), (100, 50))
    assert cluster.integral == 60 * 60 / 2 + 40 * (10 + 50) / 2
    assert cluster.at_end.protected_step == 20 and cluster.checkpoints == 2 and cluster.protections == 1


def test_a_failed_checkpoint_protects_only_what_it_reached() -> None:
    ok = CheckpointTimes(10, 10.0, {4: 20.0})
    failed = CheckpointTimes(20, 50.0, {1: 51.0, 2: 55.0})  # failed before B3
    timeline = exposure_timeline([ok, failed], 0.0, 100.0, end_step=25)
    assert timeline["cluster"].at_end.protected_step == 10
    assert timeline["cluster"].at_end.seconds == 90.0 and timeline["cluster"].at_end.steps == 15
    assert timeline["host"].at_end.protected_step == 20 and timeline["host"].at_end.seconds == 50.0
    never = CheckpointTimes(30, 60.0)  # failed before B1
    assert exposure_timeline([never], 0.0, 100.0)["process"].at_end.protected_step is None


def test_with_no_checkpoint_the_exposure_is_the_time_since_the_start() -> None:
    timeline = exposure_timeline([], 5.0, 25.0)
    for c in timeline.classes.values():
        assert c.points == ((5, 0), (25, 20))
        assert c.peak_seconds == 20.0 and c.integral == 200.0 and c.mean_seconds == 10.0
        assert c.at_end.steps is None and c.at_end.protected_step is None and c.checkpoints == 0
    known = exposure_timeline([], 5.0, 25.0, start_step=100, end_step=140)
    assert known["cluster"].at_end.steps == 40
    zero = exposure_timeline([], 7.0, 7.0)["host"]
    assert zero.mean_seconds == 0.0 and zero.integral == 0.0


def test_boundaries_after_the_end_do_not_count() -> None:
    timeline = exposure_timeline(RUN, 0.0, 60.0)
    assert timeline["cluster"].at_end.protected_step == 10  # step 20's B4 comes at 70
    assert timeline["cluster"].points[-1] == (60, 50)
    assert timeline.checkpoints == 2  # both saves were called by 60
    assert exposure_timeline(RUN, 0.0, 40.0).checkpoints == 1


def test_to_json_names_every_class_and_its_boundary() -> None:
    doc = exposure_timeline(RUN, 0.0, 100.0).to_json()
    assert set(doc["classes"]) == {"process", "host", "cluster"}
    assert doc["classes"]["cluster"]["boundary"] == "RESTARTABLE"
    assert doc["classes"]["cluster"]["integral_seconds2"] == 3100.0
    assert doc["classes"]["cluster"]["points"][0] == [0.0, 0.0]
    assert doc["duration_seconds"] == 100.0


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: CheckpointTimes(1, 10.0, {4: 9.0}), "before its save was called"),
        (lambda: CheckpointTimes(1, 10.0, {5: 11.0}), "boundary level 1..4"),
        (lambda: CheckpointTimes(1, float("nan")), "saved must be a finite number"),
        (lambda: CheckpointTimes(True, 1.0), "step must be a whole number"),  # type: ignore[arg-type]
        (lambda: exposure_timeline([], 10.0, 5.0), "end .* is before start"),
        (lambda: exposure_timeline([(1, 2.0)], 0.0, 5.0), "must be CheckpointTimes"),  # type: ignore[list-item]
        (lambda: ExposureTracker(0.0).reached(1, 0, 1.0), "boundary level"),
        (lambda: ExposureTracker(5.0).exposure(4.0), "before the tracker's start"),
        (lambda: ExposureTracker(0.0, history=0), "history"),
    ],
)
def test_bad_input_is_a_config_error_naming_the_value(build, match) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        build()
    assert isinstance(info.value, ShoalError) and isinstance(info.value, ValueError)


# -- the live tracker ------------------------------------------------------------------------------


def test_tracker_follows_saves_and_boundaries() -> None:
    tracker = ExposureTracker(0.0, start_step=0)
    assert tracker.exposure(3.0)["cluster"].seconds == 3.0
    assert tracker.exposure(3.0)["cluster"].steps == 0  # current step: the start step
    tracker.saved(10, 10.0)
    tracker.reached(10, 1, 12.0)
    now = tracker.exposure(15.0)
    assert now["process"].seconds == 5.0 and now["process"].protected_step == 10
    assert now["cluster"].seconds == 15.0 and now["cluster"].steps == 10
    tracker.reached(10, 4, 30.0)  # implies B2 and B3
    assert tracker.exposure(40.0)["host"].protected_step == 10
    assert tracker.exposure(40.0, step=17)["cluster"].steps == 7
    assert tracker.exposure(25.0)["cluster"].protected_step is None  # still answers for the past


def test_tracker_ignores_late_old_checkpoints_and_unknown_steps() -> None:
    tracker = ExposureTracker(0.0)
    tracker.saved(10, 10.0)
    tracker.saved(20, 50.0)
    tracker.reached(20, 4, 60.0)
    tracker.reached(10, 4, 80.0)  # out of order: older, changes nothing
    tracker.reached(99, 4, 81.0)  # never saved: ignored
    e = tracker.exposure(100.0)
    assert e["cluster"].protected_step == 20 and e["cluster"].seconds == 50.0
    assert tracker.exposure(100.0).to_json()["classes"]["cluster"]["protected_step"] == 20


def test_tracker_with_nothing_protected_and_no_start_step_has_no_steps() -> None:
    tracker = ExposureTracker(0.0)
    assert tracker.exposure(1.0)["host"].steps is None
    tracker.saved(3, 2.0)
    assert tracker.exposure(4.0)["host"].steps is None  # nothing protected, start step unknown
    tracker.reached(3, 2, 3.0)
    assert tracker.exposure(4.0)["host"].steps == 0


def test_a_step_saved_again_counts_from_its_new_save() -> None:
    tracker = ExposureTracker(0.0)
    tracker.saved(5, 10.0)
    tracker.reached(5, 1, 11.0)  # then failed before B2
    tracker.saved(5, 40.0)  # saved again under the same step
    tracker.reached(5, 4, 45.0)
    e = tracker.exposure(50.0)
    assert e["cluster"].seconds == 10.0 and e["process"].seconds == 10.0


def _random_run(rng: random.Random, n: int) -> list[CheckpointTimes]:
    """``n`` saves 10 s apart whose boundaries come after random lags (some fail, some out of order)."""
    out = []
    for i in range(n):
        saved = 10.0 * (i + 1)
        top = rng.choice([0, 1, 2, 3, 4, 4, 4])
        at, reached = saved, {}
        for level in range(1, top + 1):
            at += rng.uniform(0.0, 25.0)
            if rng.random() < 0.8:  # sometimes only a higher level is reported
                reached[level] = at
        if top and top not in reached:
            reached[top] = at
        out.append(CheckpointTimes(i, saved, reached))
    return out


def test_tracker_agrees_with_the_timeline_at_every_time() -> None:
    rng = random.Random(7)
    run = _random_run(rng, 40)
    tracker = ExposureTracker(0.0)
    reports = sorted((at, c.step, level) for c in run for level, at in c.reached.items())
    for c in run:
        tracker.saved(c.step, c.saved)
    for at, step, level in reports:
        tracker.reached(step, level, at)
    for t in [rng.uniform(0.0, 500.0) for _ in range(200)]:
        live = tracker.exposure(t)
        timeline = exposure_timeline(run, 0.0, t)
        for name in FAILURE_CLASSES:
            assert live[name].protected_step == timeline[name].at_end.protected_step, (name, t)
            assert live[name].seconds == pytest.approx(timeline[name].at_end.seconds)


def test_tracker_is_safe_across_threads() -> None:
    tracker = ExposureTracker(0.0)
    steps = 2000

    def train() -> None:
        for s in range(steps):
            tracker.saved(s, float(s))

    def pipeline() -> None:
        for s in range(steps):
            tracker.reached(s, 4, float(s) + 0.5)  # a step not saved yet is ignored

    def read() -> None:
        for _ in range(steps):
            tracker.exposure(float(steps))

    threads = [threading.Thread(target=f) for f in (train, pipeline, read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tracker.reached(steps - 1, 4, steps + 0.5)
    assert tracker.exposure(steps + 1.0)["cluster"].protected_step == steps - 1


def test_tracker_memory_stays_bounded() -> None:
    tracker = ExposureTracker(0.0, history=8)
    for s in range(1000):
        tracker.saved(s, float(s))
        tracker.reached(s, 4, s + 0.5)
    assert len(tracker._pending) == 0
    assert all(len(changes) <= 16 for changes in tracker._changes.values())
    assert tracker.exposure(1000.0)["cluster"].protected_step == 999
