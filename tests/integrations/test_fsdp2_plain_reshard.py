"""FSDP2 saved on 4 ranks through shoal, resumed on 2: the full model and Adam state bit for bit."""

from __future__ import annotations

import pytest

from shoal.testing.checkpoints import assert_identical
from shoal.testing.multiproc import run_ranks


@pytest.mark.timeout(300)
def test_fsdp2_saved_on_four_ranks_resumes_on_two(tmp_path):
    from shoal.testing import fsdp2

    kwargs = {"root": str(tmp_path), "step": 3}
    saved = run_ranks(fsdp2.save_sharded, hosts=["h0", "h0", "h1", "h1"], kwargs=kwargs, timeout=240)
    resumed = run_ranks(fsdp2.load_resharded, hosts=["h0", "h1"], kwargs=kwargs, timeout=240)
    expected = saved[0]
    assert expected["optim"]["state"], "Adam has state after three steps"
    assert [r["loaded"] for r in resumed] == [3, 3] and all(r["trained_on"] for r in resumed)
    assert_identical(resumed[0]["state"], expected)  # the full state is gathered on rank 0 (cpu_offload)
    assert expected["model"]["0.weight"].shape == (96, 64)
