"""Driving DCP with shoal's writer and reader: ``dcp.save``/``dcp.load`` calls, their errors, their cost.

What :class:`shoal.Checkpointer` needs around DCP's own entry points, kept apart from the
manager API:

* :func:`check_state`: the state handed to ``save`` or ``load`` is a mapping, or a clear error;
* :func:`save_state`: ``dcp.save`` with :class:`shoal.dcp.SavePlanner` and the given writer,
  with the garbage collector paused, around DCP's per-key logging wrapper while its logger
  reaches no one, DCP's ``CheckpointException`` unwrapped to shoal's own error, a value
  that cannot be serialised named by its key, and (unless ``Config.allow_pickle``) a value
  that the default load would refuse named by its key before anything is staged;
* :func:`load_state`: ``dcp.load`` with the given reader, the same way, and a target tensor of
  another shape than the stored one named before anything is read.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import io
import logging
import pickle
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

from shoal import dcp as shoal_dcp
from shoal._collector import collector_paused
from shoal._torch_private import flatten_state_dict, reset_derived_version
from shoal.errors import InvalidName, ShoalError, StateMismatch, UnsupportedValue

__all__ = ["check_loadable", "check_state", "load_state", "quiet_dcp_logger", "save_state"]


def check_state(state: object, where: str) -> None:
    """Refuse a ``state`` that is not a mapping (a tensor, a list, None, a module) for call ``where``.

    Raises :class:`~shoal.errors.UnsupportedValue` (a ``TypeError``) saying what it got, and
    :class:`~shoal.errors.InvalidName` for a top-level key that is not a string (DCP's load sorts
    them: ``1`` beside ``"model"`` fails there; nested keys may be anything, as in an optimizer's).
    """
    if isinstance(state, Mapping):
        for key in state:
            if not isinstance(key, str):
                raise InvalidName(
                    f'{where}: the state\'s top-level keys must be strings (names such as "model"), got '
                    f"{key!r} ({type(key).__name__}); nested dicts may have other keys (an optimizer's "
                    "state_dict() does)"
                )
        return
    got = "None" if state is None else type(state).__name__
    hint = ""
    if callable(getattr(state, "state_dict", None)):
        hint = f'; a {got} has a state_dict(): pass {{"name": it}} and its state_dict() is what is used'
    raise UnsupportedValue(
        f"{where}: the state must be a mapping of names to tensors/values "
        f'(a dict such as {{"model": model.state_dict()}}), got {got}{hint}'
    )


def save_state(
    state: Mapping[str, Any], writer: shoal_dcp.StorageWriter, *, step: int, no_dist: bool
) -> None:
    """``dcp.save(state)`` through ``writer`` (see the module docstring); raises shoal's errors.

    Before anything is staged (in DCP's planning, so that every rank fails alike), unless
    ``Config.allow_pickle``: a non-tensor value that ``torch.load(weights_only=True)`` would refuse
    at load is :class:`~shoal.errors.UnsupportedValue` naming its key (:func:`check_loadable`);
    two entries that DCP would flatten to one name are :class:`~shoal.errors.InvalidName`.
    A ``TypeError``, ``AttributeError`` or ``PicklingError`` from a value that cannot be serialised
    becomes :class:`~shoal.errors.UnsupportedValue` naming the key.
    """
    allow_pickle = writer.checkpointer.runtime.config.allow_pickle
    try:
        with collector_paused(), quiet_dcp_logger(), _quiet_no_dist(), _unwrapped_errors():
            _dcp_save(state, writer, no_dist=no_dist, step=step, check=not allow_pickle)
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
    """``dcp.load(target)`` through ``reader``, in place, with the collector paused; raises shoal's errors.

    A target tensor of another shape than the stored one (or a non-tensor target of a stored
    tensor) is :class:`~shoal.errors.StateMismatch` naming the key, the stored dtype and shape
    and the target's, raised in DCP's planning: before anything is read, on every rank alike.
    """
    where = "load()" if reader.step is None else f"load(step {reader.step})"
    planner = _LoadPlanner(where)
    with collector_paused(), _quiet_no_dist(), _unwrapped_errors():
        torch_dcp.load(target, storage_reader=reader, planner=planner, no_dist=no_dist)


_DUPLICATE = "duplicated flatten key "


def _duplicate_name(error: ValueError, where: str) -> InvalidName | None:
    """The error for DCP's ``duplicated flatten key`` (two entries of the state, one name), or None."""
    message = str(error)
    if not message.startswith(_DUPLICATE):
        return None
    name = message[len(_DUPLICATE) :]
    return InvalidName(
        f"{where}: two entries of the state are both named {name!r} once flattened (DCP names each "
        "value by its keys joined with '.', each key turned into a string: 1 and '1', or 'a.b' and "
        "{'a': {'b': ...}}, are one name); rename one of them"
    )


class _SavePlanner(shoal_dcp.SavePlanner):
    """shoal's save planner, checking the flattened state first (see :func:`save_state`)."""

    def __init__(self, *, balance: bool, where: str, check: bool) -> None:
        super().__init__(balance=balance)
        self.where = where
        self.check = check

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        try:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
        except ValueError as e:
            named = _duplicate_name(e, self.where)
            if named is None:
                raise
            raise named from e
        if self.check:
            check_loadable(self.state_dict, self.where)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, naming a target of another shape than stored (see :func:`load_state`)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        try:
            # DCP's load flattens sharded tensors first, which merges two entries of one name
            # silently (one is never loaded): flattening the target as it is finds them.
            flatten_state_dict()(state_dict)
        except ValueError as e:
            named = _duplicate_name(e, self.where)
            if named is None:
                raise
            raise named from e
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        if self.metadata is not None:
            _check_shapes(self.state_dict, self.metadata, self.where)
        try:
            return super().create_local_plan()
        except BaseException:
            # DCP's fallback to checkpoints before torch 2.4 sets this module-wide switch around a
            # flattening and leaves it set if that raises: every later flattening would be 2.3's.
            reset_derived_version()
            raise


def _shape(size: Any) -> str:
    return f"[{', '.join(str(n) for n in size)}]"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_shapes(state: Mapping[str, Any], metadata: Metadata, where: str) -> None:
    """Refuse a target tensor whose (global) shape is not its stored tensor's, or a non-tensor
    target of a stored tensor: :class:`~shoal.errors.StateMismatch` naming key, stored and target."""
    stored = metadata.state_dict_metadata
    absent = [fqn for fqn in state if fqn not in stored]
    if absent:
        held = sorted(stored)
        near = difflib.get_close_matches(absent[0], held, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        shown = ", ".join(repr(k) for k in held[:8])
        if len(held) > 8:
            shown += f", ... ({len(held)} in all)"
        raise StateMismatch(
            f"{where}: the target has {len(absent)} item(s) the checkpoint does not hold: "
            f"{', '.join(repr(k) for k in absent[:5])}{'...' if len(absent) > 5 else ''}{hint}; it holds "
            f"{shown or 'nothing'}. Load a state with the saved names (keys joined with '.'), or leave "
            "those entries out of the target"
        )
    for fqn, obj in state.items():
        md = stored.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            continue
        dtype, size = _dtype(md.properties.dtype), _shape(md.size)
        if isinstance(obj, torch.Tensor):
            if obj.size() != md.size:
                raise StateMismatch(
                    f"{where}: item {fqn!r} is stored as {dtype} {size} but the target is "
                    f"{_shape(obj.size())}; load into a tensor of the stored shape (or reshard with a "
                    "DTensor of the same global shape)"
                )
        elif not hasattr(obj, "__create_chunk_list__"):
            name = type(obj).__name__
            got = "None" if obj is None else f"{'an' if name[:1] in 'aeiouAEIOU' else 'a'} {name}"
            raise StateMismatch(
                f"{where}: item {fqn!r} is stored as a tensor, {dtype} {size}, but the target is {got}; "
                f"load it into a tensor of that dtype and shape (e.g. torch.empty({size}, "
                f"dtype=torch.{dtype}))"
            )


_SAFE_LEAVES: frozenset[type] = frozenset(
    {int, float, bool, str, bytes, bytearray, complex, type(None), torch.Size, torch.dtype, torch.device}
)
"""Types that ``torch.load(weights_only=True)`` surely rebuilds: no trial needed."""
_SAFE_TENSORS: frozenset[type] = frozenset({torch.Tensor, torch.nn.Parameter})
_SAFE_CONTAINERS: frozenset[type] = frozenset({dict, list, tuple, set})
_MAX_DEPTH = 32
"""How deep a value is walked; anything deeper is tried whole."""


def check_loadable(state: Mapping[str, Any], where: str) -> None:
    """Refuse a value in ``state`` (flattened by DCP: dotted keys) that the default load would refuse.

    A non-tensor value is saved with ``torch.save`` and loaded back with
    ``torch.load(weights_only=True)`` unless the loading Config has ``allow_pickle``, which
    rebuilds tensors, containers, numbers, strings and the classes allowed with
    ``torch.serialization.add_safe_globals`` only. Plain values and containers of them (the whole
    of an ordinary state: tensors, numbers, strings, lists, tuples) are accepted on sight; any other
    value is tried once, saved and loaded back in memory. Raises
    :class:`~shoal.errors.UnsupportedValue` naming the key (``extra.sampler``), the class and the way out.
    """
    tensor, safe = torch.Tensor, _SAFE_LEAVES  # (locals: this loop runs once per key of every save)
    for key, value in state.items():
        cls = type(value)
        if cls is tensor or cls in safe:
            continue
        if isinstance(value, tensor) or hasattr(value, "__create_write_items__"):
            continue  # tensors (and DTensor, ShardedTensor: their own write items) are not pickled
        _check_value(value, key, where, 0)


def _check_value(value: Any, name: str, where: str, depth: int) -> None:
    cls = type(value)
    if cls in _SAFE_LEAVES or cls in _SAFE_TENSORS:
        return
    if cls in _SAFE_CONTAINERS and depth < _MAX_DEPTH:
        safe = _SAFE_LEAVES
        if cls is dict:
            for k, v in value.items():
                if type(k) not in safe:
                    _check_value(k, f"{name}.{k!r}", where, depth + 1)
                if type(v) not in safe:
                    _check_value(v, f"{name}.{k}", where, depth + 1)
        else:
            for i, v in enumerate(value):
                if type(v) not in safe:
                    _check_value(v, f"{name}.{i}", where, depth + 1)
        return
    _try_value(value, name, where)


def _try_value(value: Any, name: str, where: str) -> None:
    """Save ``value`` and load it back with ``weights_only=True``; refuse it, naming it, if that fails."""
    what = f"the value at {name!r} (a {_class_name(type(value))})"
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
    except Exception as e:
        raise UnsupportedValue(
            f"{where}: {what} cannot be saved: it cannot be serialised ({type(e).__name__}: {e}); "
            "save tensors, or values that pickle"
        ) from e
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:
        refused = shoal_dcp.refusal_reason(str(e))
        found = _REFUSED_CLASS.search(str(e))
        allow = found.group(1).removeprefix("__main__.") if found else _class_name(type(value))
        raise UnsupportedValue(
            f"{where}: {what} would be refused at load: the safe unpickler "
            f"(torch.load(weights_only=True)) refuses it ({refused}). Allow its class with "
            f"torch.serialization.add_safe_globals([{allow}]) before saving and before loading, save "
            "it as tensors and plain values (a dict of numbers and strings), or, if you trust whoever "
            "can write your checkpoints, set shoal.Config(allow_pickle=True) (loading then runs code "
            "the checkpoint's writer chose)"
        ) from e


_REFUSED_CLASS = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _class_name(cls: type) -> str:
    """``Sampler`` (a class of ``__main__``), ``int``, ``numpy.float64``, ``train.Sampler``."""
    module = cls.__module__
    return cls.__qualname__ if module in ("builtins", "__main__") else f"{module}.{cls.__qualname__}"


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


def _dcp_save(
    state: Mapping[str, Any], writer: shoal_dcp.StorageWriter, *, no_dist: bool, step: int, check: bool
) -> None:
    """``dcp.save(state, storage_writer=writer, planner=shoal_dcp.SavePlanner(), no_dist=no_dist)``.

    While DCP's logger reaches no one, without ``dcp.save``'s logging wrapper around every key
    (a closure, a ``uuid4`` and two records each, about 15 us a key, and more when the pipeline
    thread holds the GIL): the ``Stateful`` values are resolved as ``dcp.save`` does, and DCP's
    ``_save_state_dict`` is called directly. Otherwise, or with another torch, ``dcp.save`` itself.
    With ``check``, the planner first checks every value loads by default (:func:`check_loadable`).
    """
    from torch.distributed.checkpoint import logger as dcp_logging

    balance = writer.checkpointer.runtime.config.balance_drain
    planner = _SavePlanner(balance=balance, where=f"save({step})", check=check)
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
