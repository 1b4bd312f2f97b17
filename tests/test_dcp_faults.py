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
    faults = [(phase, [0], 0) for phase in dcp_faults.LOAD_FAULTS]
    out = dcp_faults.load_faults_then_good_load(0, 1, root=str(tmp_path), faults=faults)
    for label, seen in out["errors"].items():
        assert seen["raised"] in {"InjectedDcpFault", "CheckpointException"}, (label, seen)


# PyTorch's own load fault injection (test_checkpoint.py's test_load_error_handling): each phase
# failing on one rank, with the coordinator on rank 0 and on others. prepare_global_plan runs on
# the coordinator alone, so it fails only where the failing rank is the coordinator.
LOAD_MATRIX = [
    ("set_up_storage_reader", [0], 0),
    ("prepare_global_plan", [0], 0),
    ("read_metadata", [0], 0),
    ("prepare_local_plan", [1], 0),
    ("read_data", [3], 0),
    ("read_data_async", [1], 0),
    ("set_up_storage_reader", [0], 3),
    ("read_metadata", [3], 1),
    ("read_metadata", [2], 2),
    ("read_data", [0], 2),
    ("read_data_async", [2], 3),
    ("prepare_global_plan", [1], 1),
    ("prepare_global_plan", [2], 0),  # not the coordinator: nothing fails
    ("read_data", [1, 2], 0),
    ("read_metadata", [0, 1, 2, 3], 0),
]


def test_four_ranks_a_load_failing_on_one_rank_fails_on_every_rank_at_once_naming_it(tmp_path):
    # Every healthy rank would wait 120 s at a collective of shoal's if the failing rank's error did
    # not reach it: the test's timeout (well under 15 x 120 s) and the ranks named below show it did.
    results = run_ranks(
        dcp_faults.load_faults_then_good_load,
        hosts=HOSTS,
        kwargs={"root": str(tmp_path), "faults": LOAD_MATRIX, "collective_timeout": 120.0},
        timeout=280,
    )
    for phase, ranks, coordinator in LOAD_MATRIX:
        label = f"{phase}@{','.join(map(str, ranks))}/c{coordinator}"
        seen = [r["errors"][label] for r in results]
        if phase == "prepare_global_plan" and coordinator not in ranks:
            assert seen == [{"raised": None}] * 4, (label, seen)
            continue
        # the same error on every rank, naming the failing ranks and no other
        assert all(s == seen[0] for s in seen), (label, seen)
        assert seen[0]["raised"] == "CheckpointException", (label, seen[0])
        failures = seen[0]["failures"]
        assert sorted(failures) == sorted(ranks), (label, failures)
        for kind, message in failures.values():
            # DCP reports a read_metadata failure as its own AssertionError, quoting ours
            assert kind in {"InjectedDcpFault", "AssertionError"}, (label, kind, message)
            assert f"injected fault in {phase.removesuffix('_async')}" in message, (label, message)


def test_four_ranks_a_dtype_mismatch_on_one_rank_fails_every_rank_naming_that_rank(tmp_path):
    results = run_ranks(
        dcp_faults.mismatched_dtype_on_one_rank,
        hosts=HOSTS,
        kwargs={"root": str(tmp_path), "bad_rank": 2},
        timeout=280,
    )
    for r in results:
        kind, message = r["raised"]
        assert kind == "StateMismatch", message
        assert "rank 2" in message and "'shared.weight'" in message, message
        assert "float32 [4096]" in message and "float16" in message and "cast=True" in message, message
        assert r["cast_ok"]
