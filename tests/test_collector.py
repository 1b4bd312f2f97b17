"""collector_paused: overlapping blocks in two threads and nested blocks leave the collector as it was."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from shoal._collector import collector_paused


@pytest.fixture
def enabled() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_nested_blocks_resume_the_collector_once_the_outermost_ends(enabled: None) -> None:
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_user_disabled_stays_disabled(enabled: None) -> None:
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


@pytest.mark.parametrize("first_out", ["other", "this"])
def test_overlapping_blocks_in_two_threads_pause_until_the_last_ends(enabled: None, first_out: str) -> None:
    inside, leave, left = threading.Event(), threading.Event(), threading.Event()

    def other() -> None:
        with collector_paused():
            inside.set()
            leave.wait(60)
        left.set()

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(60)
    with collector_paused():
        if first_out == "other":
            leave.set()
            assert left.wait(60)
            assert not gc.isenabled()  # this thread's block is still open
    if first_out == "this":
        assert not gc.isenabled()  # the other thread's block is still open
        leave.set()
    t.join(60)
    assert gc.isenabled()
