"""The event log: private, never follows a symlink, rotates at its size cap."""

from __future__ import annotations

import os

from shoal.engine.events import EventLog, read_events


def test_the_event_log_rotates_at_its_cap_and_keeps_the_newest_events(tmp_path):
    path = str(tmp_path / "events.jsonl")
    log = EventLog(path, max_bytes=4096)
    for i in range(200):
        log.emit("tick", i, pad="x" * 50)
    assert os.path.getsize(path) <= 4096 and os.path.getsize(path + ".1") <= 4096
    newest = [e["step"] for e in read_events(path)]
    older = [e["step"] for e in read_events(path + ".1")]
    assert newest[-1] == 199 and older[-1] + 1 == newest[0]  # nothing lost at the seam
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_a_symlink_in_place_of_the_event_log_is_never_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "events.jsonl"
    path.symlink_to(victim)
    EventLog(str(path)).emit("tick", 1)  # logs a warning, never raises into training
    assert victim.read_text() == "precious"
