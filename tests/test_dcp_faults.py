"""DCP's fault injection with shoal's writer and reader (modelled on PyTorch's test_checkpoint.py).

A fault in any phase, on one rank or on all: the error reaches every rank, the DRAM slots come
back (more failing saves than slots, and the next save still stages), nothing hangs, and the
next save and load, through DCP and through Checkpointer, are bit-exact.
"""

from __future__ import annotations

import pytest

from shoal.testing import dcp_faults
from shoal.testing.multiproc import run_ranks

HOSTS = ["h0", "h0", "h1", "h1"]
pytestmark = [
    pytest.mark.timeout(300),
    # one process: DCP warns that it assumes a single-process save; that is the intent here
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


@pytest.mark.parametrize("phase", dcp_faults.SAVE_FAULTS)
def test_one_process_a_failed_dcp_save_gives_its_slot_back_and_the_next_save_works(
    tmp_path, monkeypatch, phase
):
    monkeypatch.setenv("SHOAL_HOST_ID", "h0")
    out = dcp_faults.save_faults_then_good_rounds(
        0,
        1,
        root=str(tmp_path),
        faults=[(phase, [0])],
        repeats=3,  # more failures than DRAM slots
    )
    errors = out["errors"][f"{phase}@0"]
    assert errors == ["InjectedDcpFault"] * 3 or errors == ["CheckpointException"] * 3, errors


def test_four_ranks_every_save_fault_on_one_rank_or_all_then_good_saves_and_loads(tmp_path):
    faults = [
        ("write_data", [2]),
        ("write_data_async", [1]),
        ("finish", [0]),
        ("finish_after", [0]),
        ("write_data", [0, 1, 2, 3]),
        ("write_data_async", [0, 1, 2, 3]),
    ]
    results = run_ranks(
        dcp_faults.save_faults_then_good_rounds,
        hosts=HOSTS,
        kwargs={"root": str(tmp_path), "faults": faults, "repeats": 2},
        timeout=280,
    )
    for r in results:  # every rank saw every failing save fail, and every good round passed
        for phase, ranks in faults:
            assert r["errors"][f"{phase}@{','.join(map(str, ranks))}"] == ["CheckpointException"] * 2


def test_four_ranks_dcp_save_with_coordinator_rank_one(tmp_path):
    results = run_ranks(dcp_faults.coordinator_rank_one, hosts=HOSTS, kwargs={"root": str(tmp_path)})
    assert [r["latest"] for r in results] == [6] * 4


def test_one_process_a_failed_dcp_load_then_a_good_one(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_HOST_ID", "h0")
    out = dcp_faults.load_faults_then_good_load(
        0, 1, root=str(tmp_path), faults=[("read_metadata", [0]), ("read_data", [0])]
    )
    assert set(out["errors"].values()) <= {"InjectedDcpFault", "CheckpointException"}, out


def test_four_ranks_a_load_failing_on_one_rank_fails_on_every_rank_and_the_next_load_works(tmp_path):
    faults = [("read_metadata", [2]), ("read_data", [1]), ("read_metadata", [0, 1, 2, 3])]
    results = run_ranks(
        dcp_faults.load_faults_then_good_load,
        hosts=HOSTS,
        kwargs={"root": str(tmp_path), "faults": faults},
        timeout=280,
    )
    for r in results:  # the others left at the arrival bound (15 s here), not at a gloo timeout
        assert r["errors"] == {f"{p}@{','.join(map(str, rs))}": "CheckpointException" for p, rs in faults}
