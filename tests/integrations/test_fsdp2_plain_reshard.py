"""FSDP2 saved on 4 ranks through shoal, resumed on 2: the full model and Adam state bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shoal.testing.multiproc import run_ranks


def _assert_same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape, where
        assert np.array_equal(got, want), where
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}/{i}")
    else:
        assert got == want, where


@pytest.mark.timeout(300)
def test_fsdp2_saved_on_four_ranks_resumes_on_two(tmp_path):
    from shoal.testing import fsdp2

    kwargs = {"root": str(tmp_path), "step": 3}
    saved = run_ranks(fsdp2.save_sharded, hosts=["h0", "h0", "h1", "h1"], kwargs=kwargs, timeout=240)
    resumed = run_ranks(fsdp2.load_resharded, hosts=["h0", "h1"], kwargs=kwargs, timeout=240)
    expected = saved[0]
    assert expected["optim"]["state"], "Adam has state after three steps"
    assert [r["loaded"] for r in resumed] == [3, 3] and all(r["trained_on"] for r in resumed)
    _assert_same(resumed[0]["state"], expected)  # the full state is gathered on rank 0 (cpu_offload)
    assert expected["model"]["0.weight"].shape == (96, 64)
