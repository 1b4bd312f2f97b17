"""DCP's ``async_save`` baselines, shared by ``stall.py`` and ``small_tensors.py``."""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse


def make_stager(kind: str) -> DefaultStager | None:
    """The stager an ``async_save`` variant passes (None: the default, FileSystemWriter stages itself).

    ``DefaultStager`` caches one CPU storage per source storage (``StateDictStager``) and copies into
    it on later saves; pinned and shared memory off (CPU only), non-blocking copies need an accelerator.
    """
    if kind == "default":
        return None
    accel = torch.accelerator.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=accel,
            use_shared_memory=False,
            use_async_staging=kind == "stager-thread",
            use_non_blocking_copy=accel,
        )
    )


def timed_async_save(state: dict[str, Any], path: str, stager: DefaultStager | None) -> tuple[float, float]:
    """One ``dcp.async_save`` to ``path``: (stall, seconds until its upload completed).

    The stall runs until ``async_save`` returns, and for a stager staging in its thread until its
    ``staging_completion``.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        resp = dcp.async_save(
            state, storage_writer=dcp.FileSystemWriter(path), no_dist=True, async_stager=stager
        )
        if isinstance(resp, AsyncSaveResponse):
            resp.staging_completion.result()
            fut = resp.upload_completion
        else:
            fut = resp
        stall = time.perf_counter() - t0
        fut.result()
        return stall, time.perf_counter() - t0
