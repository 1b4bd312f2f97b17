"""A collective call made on some ranks only, or differently on one rank, is an error on every rank
that made it (a CollectiveMismatch naming the others), raised within Config.collective_timeout: not
a hang inside DCP ending in a gloo error when a peer goes away."""

from __future__ import annotations

import pytest

from shoal.testing import misuse
from shoal.testing.multiproc import run_ranks

HOSTS = ["h0", "h0", "h1", "h1"]
pytestmark = pytest.mark.timeout(300)  # a hang is what is tested: the ranks must end by themselves


@pytest.mark.parametrize(
    ("call", "callers"), [("save", [0]), ("save", [0, 1]), ("load", [0]), ("load", [1, 2, 3])]
)
def test_a_call_on_some_ranks_only_fails_on_each_of_them_naming_the_others(tmp_path, call, callers):
    timeout = 5.0
    results = run_ranks(
        misuse.partial_call,
        hosts=HOSTS,
        kwargs={"root": str(tmp_path), "call": call, "callers": callers, "timeout": timeout},
        timeout=240,
    )
    missing = [r for r in range(len(HOSTS)) if r not in callers]
    for rank, seen in enumerate(results):
        if rank not in callers:
            assert seen["raised"] is None
            continue
        kind, message = seen["raised"]
        assert kind == "CollectiveMismatch", message
        assert f"ranks {missing} of 4 did not call {call}(" in message, message
        assert "every rank must call it" in message and "if rank == 0:" in message, message
        assert f"within {timeout:.0f} s (Config.collective_timeout)" in message, message


def test_a_save_of_another_step_on_one_rank_fails_on_every_rank_naming_both_steps(tmp_path):
    results = run_ranks(misuse.mismatched_steps, hosts=HOSTS, kwargs={"root": str(tmp_path), "odd_rank": 2})
    for seen in results:
        kind, message = seen["raised"]
        assert kind == "CollectiveMismatch", message
        assert "save(3)" in message and "save(2)" in message, message
