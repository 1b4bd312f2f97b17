"""Checkpointer.save and DCP's logger: quieted, or gone around, only while its records reach no one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import logger as dcp_logging

import shoal
import shoal.driver
from shoal.driver import quiet_dcp_logger
from shoal.testing.checkpoints import make_config


@pytest.fixture
def dcp_logger() -> Iterator[logging.Logger]:
    logger = dcp_logging._dcp_logger
    level, handlers, propagate = logger.level, list(logger.handlers), logger.propagate
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers
    logger.propagate = propagate


def test_a_logger_nobody_reads_is_raised_for_the_block_and_restored(dcp_logger: logging.Logger) -> None:
    dcp_logger.handlers[:] = [logging.NullHandler()]
    dcp_logger.propagate = False
    dcp_logger.setLevel(logging.DEBUG)
    with quiet_dcp_logger():
        assert not dcp_logger.isEnabledFor(logging.DEBUG)
        assert dcp_logger.isEnabledFor(logging.ERROR)  # the wrapper's exception records still pass
        with quiet_dcp_logger():
            assert dcp_logger.level == logging.INFO
        assert dcp_logger.level == logging.INFO  # the inner block does not restore it early
    assert dcp_logger.level == logging.DEBUG


def test_a_logger_someone_reads_is_left_alone(dcp_logger: logging.Logger) -> None:
    dcp_logger.setLevel(logging.DEBUG)
    dcp_logger.propagate = False
    dcp_logger.handlers[:] = [logging.NullHandler(), logging.StreamHandler()]
    with quiet_dcp_logger():
        assert dcp_logger.level == logging.DEBUG
    dcp_logger.handlers[:] = [logging.NullHandler()]
    dcp_logger.propagate = True
    with quiet_dcp_logger():
        assert dcp_logger.level == logging.DEBUG


def test_the_level_is_restored_after_an_error_and_across_threads(dcp_logger: logging.Logger) -> None:
    dcp_logger.handlers[:] = [logging.NullHandler()]
    dcp_logger.propagate = False
    dcp_logger.setLevel(logging.DEBUG)
    with pytest.raises(ZeroDivisionError), quiet_dcp_logger():
        _ = 1 / 0
    assert dcp_logger.level == logging.DEBUG
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with quiet_dcp_logger():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(10)
    with quiet_dcp_logger():
        pass
    assert dcp_logger.level == logging.INFO  # the other thread's block is still open
    leave.set()
    t.join()
    assert dcp_logger.level == logging.DEBUG


class _Counter:
    """A ``Stateful`` value (not a tensor, not a module)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        return {"n": torch.tensor(self.n)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = int(sd["n"])


@pytest.mark.parametrize("configured", [False, True])
def test_save_goes_around_dcp_save_only_while_its_logger_reaches_no_one(
    tmp_path: Path,
    dram_root: Path,
    dcp_logger: logging.Logger,
    monkeypatch: pytest.MonkeyPatch,
    configured: bool,
) -> None:
    dcp_logger.handlers[:] = [logging.NullHandler(), *([logging.StreamHandler()] if configured else [])]
    dcp_logger.propagate = False
    calls: list[int] = []
    real_save = shoal.driver.torch_dcp.save

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real_save(*a, **k)

    monkeypatch.setattr(shoal.driver.torch_dcp, "save", counted)
    model = torch.nn.Linear(3, 2)
    state = {"w": torch.randn(5, 4), "model": model, "counter": _Counter(7), "extra": {"lr": 0.1}}
    with shoal.Checkpointer(make_config(tmp_path, dram_root)) as ckpt:
        ckpt.save(1, state).wait(shoal.Boundary.RESTARTABLE, timeout=60)
        assert calls == ([1] if configured else [])
        out_model = torch.nn.Linear(3, 2)
        torch.nn.init.zeros_(out_model.weight)
        out = {"w": torch.zeros(5, 4), "model": out_model, "counter": _Counter(0), "extra": {"lr": 0.0}}
        assert ckpt.load(out) == 1
    assert torch.equal(out["w"], state["w"]) and out["counter"].n == 7 and out["extra"] == {"lr": 0.1}
    assert torch.equal(out_model.weight, model.weight) and torch.equal(out_model.bias, model.bias)


def _model_and_optimizer_state() -> dict[str, Any]:
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "extra": {"epoch": 3, "tag": "run"}}


class _Opaque:
    """A class of the user's: the safe unpickler refuses it."""


def test_an_ordinary_state_is_checked_without_a_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    tried: list[str] = []
    monkeypatch.setattr(shoal.driver, "_try_value", lambda value, name, where: tried.append(name))
    flat, _ = flatten_state_dict(_model_and_optimizer_state())
    shoal.driver.check_loadable(flat, "save(1)")
    assert tried == []
    assert isinstance(flat["optim.param_groups.0.params"], list)  # a list of ints: walked, not tried


def test_check_loadable_tries_an_unknown_value_once_and_names_it() -> None:
    saves: list[object] = []
    real = torch.save

    def counted(obj: object, f: Any, *a: Any, **k: Any) -> None:
        saves.append(obj)
        real(obj, f, *a, **k)

    flat = {"w": torch.ones(2), "extra.items": [1, "a", (2.5, None)], "extra.thing": _Opaque()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shoal.driver.torch, "save", counted)
        with pytest.raises(shoal.UnsupportedValue, match=r"^save\(4\): the value at 'extra\.thing' \(a "):
            shoal.driver.check_loadable(flat, "save(4)")
    assert len(saves) == 1 and isinstance(saves[0], _Opaque)
    with torch.serialization.safe_globals([_Opaque]):
        shoal.driver.check_loadable(flat, "save(4)")  # allowed: accepted after its trial
