"""Checkpointer.save raises DCP's logger to INFO only while its records reach no one, and restores it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest
from torch.distributed.checkpoint import logger as dcp_logging

from shoal.checkpointer import _quiet_dcp_logger


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
    with _quiet_dcp_logger():
        assert not dcp_logger.isEnabledFor(logging.DEBUG)
        assert dcp_logger.isEnabledFor(logging.ERROR)  # the wrapper's exception records still pass
        with _quiet_dcp_logger():
            assert dcp_logger.level == logging.INFO
        assert dcp_logger.level == logging.INFO  # the inner block does not restore it early
    assert dcp_logger.level == logging.DEBUG


def test_a_logger_someone_reads_is_left_alone(dcp_logger: logging.Logger) -> None:
    dcp_logger.setLevel(logging.DEBUG)
    dcp_logger.propagate = False
    dcp_logger.handlers[:] = [logging.NullHandler(), logging.StreamHandler()]
    with _quiet_dcp_logger():
        assert dcp_logger.level == logging.DEBUG
    dcp_logger.handlers[:] = [logging.NullHandler()]
    dcp_logger.propagate = True
    with _quiet_dcp_logger():
        assert dcp_logger.level == logging.DEBUG


def test_the_level_is_restored_after_an_error_and_across_threads(dcp_logger: logging.Logger) -> None:
    dcp_logger.handlers[:] = [logging.NullHandler()]
    dcp_logger.propagate = False
    dcp_logger.setLevel(logging.DEBUG)
    with pytest.raises(ZeroDivisionError), _quiet_dcp_logger():
        _ = 1 / 0
    assert dcp_logger.level == logging.DEBUG
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with _quiet_dcp_logger():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(10)
    with _quiet_dcp_logger():
        pass
    assert dcp_logger.level == logging.INFO  # the other thread's block is still open
    leave.set()
    t.join()
    assert dcp_logger.level == logging.DEBUG
