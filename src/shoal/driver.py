"""Driving DCP with shoal's writer and reader: ``dcp.save``/``dcp.load`` calls, their errors, their cost.

What :class:`shoal.Checkpointer` needs around DCP's own entry points, kept apart from the
manager API:

* :func:`save_state`: ``dcp.save`` with :class:`shoal.dcp.SavePlanner` and the given writer,
  with the garbage collector paused, around DCP's per-key logging wrapper while its logger
  reaches no one, DCP's ``CheckpointException`` unwrapped to shoal's own error, and a value
  that cannot be serialised named by its key;
* :func:`load_state`: ``dcp.load`` with the given reader, the same way.
"""

from __future__ import annotations

import functools
import inspect
import io
import logging
import pickle
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.api import CheckpointException

from shoal import dcp as shoal_dcp
from shoal._collector import collector_paused
from shoal.errors import ShoalError, UnsupportedValue

__all__ = ["load_state", "quiet_dcp_logger", "save_state"]


def save_state(
    state: Mapping[str, Any], writer: shoal_dcp.StorageWriter, *, step: int, no_dist: bool
) -> None:
    """``dcp.save(state)`` through ``writer`` (see the module docstring); raises shoal's errors.

    A ``TypeError``, ``AttributeError`` or ``PicklingError`` from a value that cannot be serialised
    becomes :class:`~shoal.errors.UnsupportedValue` naming the key.
    """
    try:
        with collector_paused(), quiet_dcp_logger(), _quiet_no_dist(), _unwrapped_errors():
            _dcp_save(state, writer, no_dist=no_dist)
    except (TypeError, AttributeError, pickle.PicklingError) as e:
        if isinstance(e, ShoalError):
            raise
        bad = _unserialisable(state)
        if bad is not None:
            raise UnsupportedValue(
                f"step {step}: the value at {bad[0]!r} ({bad[1]}) cannot be saved: it cannot be "
                f"serialised ({type(e).__name__}: {e}); save tensors, or values that pickle"
            ) from e
        raise


def load_state(target: dict[str, Any], reader: shoal_dcp.StorageReader, *, no_dist: bool) -> None:
    """``dcp.load(target)`` through ``reader``, in place, with the collector paused; raises shoal's errors."""
    with collector_paused(), _quiet_no_dist(), _unwrapped_errors():
        torch_dcp.load(target, storage_reader=reader, no_dist=no_dist)


@contextmanager
def _unwrapped_errors() -> Iterator[None]:
    """Re-raise shoal's own error when DCP wraps it in its ``CheckpointException`` (a BaseException).

    With one failing rank (every failure on one host today) the caller gets the error
    that rank raised, e.g. :class:`InvalidName` or :class:`InsufficientMemory`.
    """
    try:
        yield
    except CheckpointException as e:
        failures = list(e.failures.values())
        originals = [f[0] if isinstance(f, tuple) else f for f in failures]
        if originals and all(isinstance(o, Exception) for o in originals):
            raise originals[0] from None
        raise


@contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """Silence DCP's 'assuming the intent is to save in a single process' warning: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


_dcp_log_lock = threading.Lock()
_dcp_log_quieted = 0
_dcp_log_level = logging.NOTSET


def _records_go_nowhere(logger: logging.Logger) -> bool:
    """Whether ``logger``'s records reach no one: no filter, only ``NullHandler``s, no propagation."""
    return (
        not logger.propagate
        and not logger.filters
        and all(type(h) is logging.NullHandler for h in logger.handlers)
    )


@contextmanager
def quiet_dcp_logger() -> Iterator[None]:
    """Skip the two debug records DCP's logging wrapper makes per state-dict key, while nobody reads them.

    ``dcp.save`` wraps the ``state_dict()`` resolution of every key in a logging wrapper that
    emits two DEBUG records to DCP's logger (about 20 us per key). That logger ships at DEBUG
    with only a ``NullHandler`` and does not propagate, so the records are made and dropped.
    While that is so, its level is raised to INFO for the block (exceptions are still logged,
    at ERROR); a logger someone configured (another handler, a filter, propagation) is left
    as it is. Nested and concurrent blocks restore the level once, when the last one ends.
    """
    global _dcp_log_quieted, _dcp_log_level
    try:
        from torch.distributed.checkpoint import logger as dcp_logging

        logger = dcp_logging._dcp_logger
    except (ImportError, AttributeError):  # another torch: nothing to do
        yield
        return
    with _dcp_log_lock:
        quiet = _dcp_log_quieted > 0 or (_records_go_nowhere(logger) and logger.level < logging.INFO)
        if quiet:
            if _dcp_log_quieted == 0:
                _dcp_log_level = logger.level
                logger.setLevel(logging.INFO)
            _dcp_log_quieted += 1
    try:
        yield
    finally:
        if quiet:
            with _dcp_log_lock:
                _dcp_log_quieted -= 1
                if _dcp_log_quieted == 0:
                    logger.setLevel(_dcp_log_level)


_SAVE_PARAMETERS = frozenset({"state_dict", "storage_writer", "process_group", "no_dist", "planner"})


@functools.cache
def _dcp_save_state_dict() -> Callable[..., Any] | None:
    """DCP's ``_save_state_dict`` (what ``dcp.save`` runs after resolving ``Stateful`` values), when
    this torch has it with the parameters shoal passes; else None (``dcp.save`` is used)."""
    try:
        from torch.distributed.checkpoint import state_dict_saver

        fn: Callable[..., Any] = state_dict_saver._save_state_dict
        parameters = set(inspect.signature(fn).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    return fn if parameters >= _SAVE_PARAMETERS else None


def _resolved(state: Mapping[str, Any]) -> dict[str, Any]:
    """``dcp.save``'s shallow copy of ``state``, each ``Stateful`` value replaced by its ``state_dict()``."""
    from torch import Tensor
    from torch.distributed.checkpoint.stateful import Stateful

    # type(v) is Tensor: a plain tensor is never Stateful, and the protocol check costs ~5 us a key.
    return {
        k: v if type(v) is Tensor else (v.state_dict() if isinstance(v, Stateful) else v)
        for k, v in state.items()
    }


def _dcp_save(state: Mapping[str, Any], writer: shoal_dcp.StorageWriter, *, no_dist: bool) -> None:
    """``dcp.save(state, storage_writer=writer, planner=shoal_dcp.SavePlanner(), no_dist=no_dist)``.

    While DCP's logger reaches no one, without ``dcp.save``'s logging wrapper around every key
    (a closure, a ``uuid4`` and two records each, about 15 us a key, and more when the pipeline
    thread holds the GIL): the ``Stateful`` values are resolved as ``dcp.save`` does, and DCP's
    ``_save_state_dict`` is called directly. Otherwise, or with another torch, ``dcp.save`` itself.
    """
    from torch.distributed.checkpoint import logger as dcp_logging

    planner = shoal_dcp.SavePlanner(balance=writer.checkpointer.runtime.config.balance_drain)
    direct = _dcp_save_state_dict()
    logger = getattr(dcp_logging, "_dcp_logger", None)
    if direct is None or not isinstance(logger, logging.Logger) or not _records_go_nowhere(logger):
        torch_dcp.save(dict(state), storage_writer=writer, planner=planner, no_dist=no_dist)
        return
    import torch.distributed as dist

    no_dist = no_dist or not dist.is_available() or not dist.is_initialized()
    direct(
        state_dict=_resolved(state),
        storage_writer=writer,
        process_group=None,
        no_dist=no_dist,
        planner=planner,
    )


def _unserialisable(state: Mapping[str, Any], prefix: str = "") -> tuple[str, str] | None:
    """The first non-tensor value in ``state`` (nested mappings and lists) that does not pickle.

    Only called after a save failed, to name the key: the walk costs one trial pickle per value.
    """
    import torch

    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, Mapping):
            found = _unserialisable(value, name + ".")
        elif isinstance(value, list | tuple):
            found = _unserialisable({str(i): v for i, v in enumerate(value)}, name + ".")
        else:
            found = None
            try:
                torch.save(value, io.BytesIO())
            except Exception:
                found = (name, type(value).__name__)
        if found is not None:
            return found
    return None
