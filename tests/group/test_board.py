"""The job's board: arrivals every rank waits at without a collective, whose gate the last rank
opens and a failing, late or different rank closes, for everyone, at once."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from shoal.group.fabric import Arrival, Board


@pytest.fixture
def board() -> Board:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    return Board(dist.PrefixStore("test/", store))


def _in_thread(fn) -> tuple[threading.Thread, list[Arrival]]:
    out: list[Arrival] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    return t, out


def test_every_rank_arriving_opens_the_gate(board):
    t, out = _in_thread(lambda: board.arrive("k", 0, 2, 60.0, call="save(1)"))
    mine = board.arrive("k", 1, 2, 60.0, call="save(1)")
    t.join()
    assert mine.complete and out[0].complete and mine.note == ""


def test_a_rank_that_fails_first_stops_the_waiting_ones_and_those_who_come_later(board):
    t, out = _in_thread(lambda: board.arrive("k", 0, 3, 60.0))
    assert board.close("k", "rank 2 failed in read_data: boom") == "closed: rank 2 failed in read_data: boom"
    t.join(timeout=30)
    assert not t.is_alive()
    assert out[0].closed == "closed: rank 2 failed in read_data: boom" and not out[0].late
    later = board.arrive("k", 1, 3, 60.0)
    assert later.note == "rank 2 failed in read_data: boom" and not later.complete


def test_a_rank_that_waits_out_its_timeout_names_the_missing_and_closes_for_the_late_ones(board):
    early = board.arrive("k", 0, 3, 0.2, late=lambda missing: f"ranks {missing} are late")
    assert early.missing == [1, 2] and early.late and early.note == "ranks [1, 2] are late"
    late = board.arrive("k", 1, 3, 60.0)
    assert late.late and not late.missing and late.note == "ranks [1, 2] are late"


def test_another_call_closes_the_gate_naming_both(board):
    t, out = _in_thread(lambda: board.arrive("k", 0, 2, 60.0, call="save(5)"))
    mine = board.arrive("k", 1, 2, 60.0, call="save(6)")
    t.join(timeout=30)
    # the second to arrive names both calls, whichever thread that is
    notes = {
        "rank 1 called save(6) where another rank called save(5)",
        "rank 0 called save(5) where another rank called save(6)",
    }
    assert mine.note in notes and out[0].note == mine.note and not out[0].late


def test_a_close_after_the_gate_opened_changes_nothing(board):
    t, out = _in_thread(lambda: board.arrive("k", 0, 2, 60.0))
    board.arrive("k", 1, 2, 60.0)
    t.join()
    assert board.close("k", "too late to fail") == "open"
    assert board.arrive("k", 0, 2, 60.0).complete
