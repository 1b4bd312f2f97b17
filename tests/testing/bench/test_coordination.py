"""The pure helpers of the coordination benchmark (no cluster, no root)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shoal.testing.bench.coordination import PHASES, dcp_phases, median_of_max, step_phases, tiny_state


def _rec(event: str, mono: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "mono": mono, "step": 1, "rank": 0, **fields}


def _coordinator_step(partner: bool) -> list[dict[str, Any]]:
    """The coordinator's records of one checkpoint, in the order the engine writes them."""
    records = [
        _rec("save_called", 10.010),
        _rec("staged", 10.012),
        _rec("hashed", 10.030),
        _rec("boundary", 10.040, boundary="STAGED"),
        _rec("planned", 10.043, seconds=0.002),
        _rec("path", 10.045, path="partner" if partner else "direct"),
    ]
    t = 10.045
    if partner:
        records += [
            _rec("replicate", 10.060, seconds=0.010),
            _rec("boundary", 10.065, boundary="REPLICATED"),
        ]
        t = 10.065
    records += [
        _rec("write", t + 0.020, tier="shared", what="pack", seconds=0.015),
        _rec("write", t + 0.050, tier="shared", what="manifest", seconds=0.005),
        _rec("write", t + 0.060, tier="shared", what="commit", seconds=0.004),
        _rec("write", t + 0.070, tier="shared", what="latest", seconds=0.003),
        _rec("write", t + 0.071, tier="local", what="replica", seconds=0.5),  # not the shared tier
        _rec("boundary", t + 0.080, boundary="PERSISTED"),
        _rec("boundary", t + 0.080, boundary="RESTARTABLE"),
        _rec("coordination", t + 0.081, seconds=0.040 if partner else 0.030, collectives=7),
        _rec("checkpoint", t + 0.082),
    ]
    return records


def test_step_phases_cut_the_direct_path_at_its_records() -> None:
    p = step_phases(_coordinator_step(partner=False), called=10.0, returned=10.020)
    assert list(p) == [k for k in PHASES if k in p]
    expected = {
        "DCP plan": 0.010,
        "stage": 0.002,
        "DCP finish": 0.008,
        "queue+hash": 0.010,
        "C1": 0.010,
        "plan": 0.002,
        "C2": 0.003,
        "drain I/O": 0.015,
        "commit I/O": 0.012,
        "C6-C7": 0.030 - 0.010 - 0.003,  # the engine's collectives less C1 and C2
        "commit checks": 0.080 - 0.015 - 0.012 - 0.017,
        "coordination": 0.030,
        "collectives": 7.0,
    }
    assert p == pytest.approx(expected)
    assert "C3-C5" not in p and "replica I/O" not in p


def test_step_phases_on_the_partner_path_split_replication_from_its_collectives() -> None:
    p = step_phases(_coordinator_step(partner=True))
    assert p["replica I/O"] == pytest.approx(0.010)
    assert p["C3-C5"] == pytest.approx(0.020 - 0.010)
    assert p["queue+hash"] == pytest.approx(0.018)  # no call times: staged to hashed, no DCP phases
    assert "DCP plan" not in p and "DCP finish" not in p
    assert p["C6-C7"] == pytest.approx(0.040 - 0.010 - 0.003 - 0.010)


def test_step_phases_give_the_last_stretch_to_collectives_at_most() -> None:
    records = _coordinator_step(partner=False)
    records[-2] = _rec("coordination", 10.2, seconds=5.0, collectives=7)
    p = step_phases(records)
    assert p["C6-C7"] == pytest.approx(0.080 - 0.015 - 0.012)
    assert p["commit checks"] == pytest.approx(0.0)


def test_step_phases_leave_out_what_the_records_do_not_tell() -> None:
    assert step_phases([_rec("save_called", 1.0), _rec("staged", 1.5)]) == {"stage": 0.5}
    assert step_phases([]) == {}


def test_step_phases_clamp_a_return_after_hashing_began() -> None:
    p = step_phases(_coordinator_step(partner=False), called=10.0, returned=10.5)
    assert p["DCP finish"] == pytest.approx(0.018)
    assert p["queue+hash"] == pytest.approx(0.0)


def test_dcp_phases_split_the_two_writes_from_the_rest() -> None:
    stamps = {"write_start": 1.3, "write_end": 1.4, "finish_start": 1.6, "finish_end": 1.9}
    p = dcp_phases(stamps, 1.0, 2.0)
    assert p == pytest.approx(
        {"before write": 0.3, "write I/O": 0.1, "after write": 0.6, "finish I/O": 0.3, "coordination": 0.6}
    )
    no_finish = dcp_phases({"write_start": 1.3, "write_end": 1.4}, 1.0, 2.0)
    assert no_finish["finish I/O"] == 0.0 and no_finish["coordination"] == pytest.approx(0.9)


def test_median_of_max_takes_the_slowest_rank_of_each_save() -> None:
    assert median_of_max([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == 3.0
    assert math.isnan(median_of_max([]))
    assert math.isnan(median_of_max([[], []]))


def test_tiny_state_is_each_ranks_own() -> None:
    a, b = tiny_state(0), tiny_state(1, tensors=2, kib=1)
    assert sorted(a) == [f"r0.t{i}" for i in range(4)]
    assert all(t.dtype == torch.float32 and t.numel() * 4 == 4096 for t in a.values())
    assert sorted(b) == ["r1.t0", "r1.t1"] and b["r1.t0"].numel() == 256
    assert torch.equal(tiny_state(0)["r0.t0"], a["r0.t0"])
    assert not torch.equal(tiny_state(1)["r1.t0"], a["r0.t0"])
