"""The event log: private, never follows a symlink, rotates at its size cap; versioned records, one reader."""

from __future__ import annotations

import glob
import json
import os
import pathlib
import re

import pytest
import torch

import shoal
from shoal import failpoints
from shoal.errors import OwnershipError, ShoalError
from shoal.records.events import (
    FORMAT_VERSION,
    CheckpointRecord,
    Event,
    EventLog,
    WriterRecord,
    read_events,
    writer_samples,
)
from shoal.testing import scenarios
from shoal.testing.checkpoints import make_config, pack_bytes_on
from shoal.testing.multiproc import run_ranks


def test_the_event_log_rotates_at_its_cap_and_keeps_the_newest_events(tmp_path):
    path = str(tmp_path / "events.jsonl")
    log = EventLog(path, max_bytes=4096)
    for i in range(200):
        log.emit("tick", i, pad="x" * 50)
    assert os.path.getsize(path) <= 4096 and os.path.getsize(path + ".1") <= 4096
    newest = [e.step for e in read_events(path, rotated=False)]
    older = [e.step for e in read_events(path + ".1", rotated=False)]
    assert newest[-1] == 199 and older[-1] + 1 == newest[0]  # nothing lost at the seam
    assert [e.step for e in read_events(path)] == older + newest  # the rotated file first
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_a_symlink_in_place_of_the_event_log_is_never_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "events.jsonl"
    path.symlink_to(victim)
    EventLog(str(path)).emit("tick", 1)  # logs a warning, never raises into training
    assert victim.read_text() == "precious"


def test_a_private_read_follows_no_symlink_and_refuses_a_log_another_user_owns(tmp_path):
    path = str(tmp_path / "events.jsonl")
    EventLog(path).emit("tick", 1)
    assert [e.step for e in read_events(path, private=True)] == [1]
    link = str(tmp_path / "link.jsonl")
    os.symlink(path, link)
    assert [e.step for e in read_events(link)] == [1]  # a person reading a log may follow a link
    with pytest.raises(OwnershipError, match="link.jsonl is a symbolic link"):
        read_events(link, private=True)
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root; the symlink case ran")
    os.chown(path, 65534, 65534)
    with pytest.raises(OwnershipError, match="events.jsonl"):
        read_events(path, private=True)


def test_every_line_carries_the_version_wall_and_monotonic_time(tmp_path):
    path = str(tmp_path / "events.jsonl")
    log = EventLog(path, host="h3", rank=5)
    log.emit("tick", 1, n=1)
    log.emit("tick", 2, n=2)
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    assert [line["v"] for line in lines] == [FORMAT_VERSION, FORMAT_VERSION]
    assert lines[0]["mono"] <= lines[1]["mono"] and lines[0]["t"] > 1e9
    first, second = read_events(path)
    assert type(first) is Event and (first.host, first.rank, first.step, first["n"]) == ("h3", 5, 1, 1)
    assert first.version == FORMAT_VERSION and first.mono == lines[0]["mono"] and first.wall == lines[0]["t"]
    assert first.where == f"{path}:1" and second.get("missing", "default") == "default"


def _write_lines(path, *records):
    with open(path, "w") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r) + "\n")


def _line(event="tick", step=1, **fields):
    return {
        "v": FORMAT_VERSION,
        "t": 1.0,
        "mono": 2.0,
        "event": event,
        "step": step,
        "host": "h0",
        "rank": 0,
        **fields,
    }


def test_the_reader_refuses_a_newer_major_version_naming_file_and_line(tmp_path):
    path = str(tmp_path / "events.jsonl")
    _write_lines(path, _line(), _line(v=FORMAT_VERSION + 1))
    with pytest.raises(ShoalError, match=rf"events\.jsonl:2: event record version {FORMAT_VERSION + 1}"):
        read_events(path)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([1, 2], "must be a JSON object"),
        (_line(rank="0"), "'rank' of a 'tick' event record is '0'"),
        (_line("write", tier="shared", what="pack"), "a 'write' event record has no 'path'"),
        (_line(v=True), "version True"),
    ],
)
def test_the_reader_refuses_a_record_it_cannot_read(tmp_path, bad, message):
    path = str(tmp_path / "events.jsonl")
    _write_lines(path, _line(), bad)
    with pytest.raises(ShoalError, match=rf"events\.jsonl:2: .*{message}"):
        read_events(path)


def test_a_torn_last_line_is_skipped_and_a_torn_line_inside_the_log_is_refused(tmp_path):
    path = str(tmp_path / "events.jsonl")
    _write_lines(path, _line(step=1), _line(step=2), '{"v": 1, "t": 3.0, "mono": 4.0, "ev')
    assert [e.step for e in read_events(path)] == [1, 2]
    _write_lines(path, _line(step=1), '{"v": 1, "t": 3.0, "ev\n', _line(step=3))
    with pytest.raises(ShoalError, match=r"events\.jsonl:2: not a JSON event record"):
        read_events(path)


def test_the_next_writer_closes_a_torn_line_and_the_reader_skips_it(tmp_path):
    path = str(tmp_path / "events.jsonl")
    log = EventLog(path)
    log.emit("tick", 1)
    with open(path, "a") as f:
        f.write('{"v": 1, "t": 3.0, "mono": 4.0, "ev')  # the host went down mid-line
    restarted = EventLog(path)
    restarted.emit("tick", 2)
    restarted.emit("tick", 3)
    with open(path) as f:
        lines = f.read().splitlines()
    assert json.loads(lines[2])["event"] == "torn" and len(lines) == 5  # one marker, once
    assert [(e.event, e.step) for e in read_events(path)] == [("tick", 1), ("tick", 2), ("tick", 3)]


def test_kinds_selects_event_names_and_legacy_lines_read_as_generic_events(tmp_path):
    path = str(tmp_path / "events.jsonl")
    legacy = {"t": 1.0, "event": "write", "step": 1, "host": "h0", "rank": 0, "bytes": 3}
    _write_lines(path, legacy, _line("tick"), _line("other"))
    events = read_events(path, kinds=["write", "tick"])
    assert [(e.event, e.version, e.mono) for e in events] == [
        ("write", 0, None),
        ("tick", FORMAT_VERSION, 2.0),
    ]
    assert type(events[0]) is Event  # an unversioned write has no start or end: not a writer record


def test_a_save_writes_writer_records_for_every_byte_drained_and_one_checkpoint_record(tmp_path, dram_root):
    config = make_config(tmp_path, dram_root)
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, {"w": torch.randn(100_000), "b": torch.arange(1000)}).wait(timeout=60)
        ckpt.save(2, {"w": torch.randn(50_000)}).wait(timeout=60)
        path = ckpt.config.event_log
        packs_on_shared = pack_bytes_on(ckpt.shared)
    assert path is not None
    writes = [e for e in read_events(path, kinds=["write"]) if e.what == "pack"]
    assert all(isinstance(w, WriterRecord) for w in writes) and len(writes) == 2  # one per pack
    assert sum(w.bytes for w in writes) == packs_on_shared
    for w in writes:
        assert w.tier == "shared" and w.host == "h0" and w.path.endswith(".pack")
        assert w.start <= w.end and w.seconds == pytest.approx(w.end - w.start)
        assert (w.concurrency, w.host_concurrency, w.durability_path) == (1, 1, "direct")
    done = read_events(path, kinds=["checkpoint"])
    assert [c.step for c in done] == [1, 2] and all(isinstance(c, CheckpointRecord) for c in done)
    first = done[0]
    b = first.boundaries
    assert list(b) == ["STAGED", "REPLICATED", "PERSISTED", "RESTARTABLE"]  # direct: B2 with B3
    assert b["STAGED"] <= b["REPLICATED"] == b["PERSISTED"] <= b["RESTARTABLE"]
    assert (first.reached, first.failed_at, first.error, first.durability_path) == (
        "RESTARTABLE",
        None,
        None,
        "direct",
    )
    assert first.bytes == 100_000 * 4 + 1000 * 8 and writes[0].end <= first.end


def test_a_failed_checkpoint_still_writes_its_checkpoint_record(tmp_path, dram_root):
    config = make_config(tmp_path, dram_root)
    failpoints.configure("pipeline.before_drain=raise")
    try:
        with shoal.Checkpointer(config) as ckpt:
            handle = ckpt.save(1, {"w": torch.randn(1000)})
            with pytest.raises(shoal.CheckpointFailed):
                handle.wait(timeout=60)
            path = ckpt.config.event_log
    finally:
        failpoints.configure(None)
    assert path is not None
    [record] = read_events(path, kinds=["checkpoint"])
    assert isinstance(record, CheckpointRecord) and record.reached == "STAGED"
    assert record.failed_at == "PERSISTED" and record.error and record.durability_path == "direct"
    assert list(record.boundaries) == ["STAGED"]
    assert not [e for e in read_events(path, kinds=["write"]) if e.what == "pack"]  # nothing drained


def test_four_ranks_on_two_hosts_write_replica_records_on_the_receivers(tmp_path):
    hosts = ["h0", "h0", "h1", "h1"]
    # a generous limit (four processes on a busy machine); the suite's timeout is the hang guard
    results = run_ranks(
        scenarios.frozen_second_checkpoint, hosts=hosts, kwargs={"root": str(tmp_path)}, timeout=300
    )
    assert [h["error"] for r in results for h in r["handles"]] == [None] * 8
    logs = sorted(glob.glob(str(tmp_path / "local" / "**" / "events.jsonl"), recursive=True))
    assert len(logs) == 2  # one per host, every rank of the host in it
    events = [e for p in logs for e in read_events(p)]
    replicas = [e for e in events if isinstance(e, WriterRecord) and e.what == "replica" and e.step == 1]
    received = {e.rank: e["received_bytes"] for e in events if e.event == "replicate" and e.step == 1}
    receivers = sorted(r for r, n in received.items() if n)
    assert receivers and sorted(e.rank for e in replicas) == receivers  # one record per receiving rank
    for e in replicas:
        assert e.bytes >= received[e.rank] and e.tier == "local" and e.durability_path == "partner"
        assert e.start <= e.end and e.concurrency == len(receivers) and e.host == hosts[e.rank]
        assert e.host_concurrency == sum(1 for r in receivers if hosts[r] == e.host)
        assert e["sources"] and all(hosts[s] != e.host for s in e["sources"])  # from the other host
    drains = [e for e in events if isinstance(e, WriterRecord) and e.what == "pack" and e.step == 1]
    assert drains and all(d.concurrency == len(drains) for d in drains)
    checkpoints = [e for e in events if isinstance(e, CheckpointRecord)]
    assert sorted((c.step, c.rank) for c in checkpoints) == [(s, r) for s in (1, 2) for r in range(4)]
    for c in checkpoints:
        assert c.durability_path == "partner" and c.reached == "RESTARTABLE"
        assert list(c.boundaries) == ["STAGED", "REPLICATED", "PERSISTED", "RESTARTABLE"]


def test_the_documented_example_reads_back_as_typed_records(tmp_path):
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "events.md").read_text()
    example = re.search(r"```json\n(.*?)```", doc, flags=re.S)
    assert example is not None
    path = tmp_path / "events.jsonl"
    path.write_text(example.group(1))
    kinds = [type(e) for e in read_events(str(path))]
    assert kinds == [WriterRecord, WriterRecord, CheckpointRecord, WriterRecord]


def test_the_drain_records_become_the_models_writer_samples(tmp_path, dram_root):
    config = make_config(tmp_path, dram_root, drain_pack_bytes=128 << 10, drain_streams=2)
    with shoal.Checkpointer(config) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.randn(128 << 10)}).wait(timeout=60)  # 512 KiB: 4 packs
        path = ckpt.config.event_log
    assert path is not None
    events = read_events(path)
    samples = writer_samples(events)
    assert [s.checkpoint for s in samples] == [1] * 4 + [2] * 4
    assert all(s.nbytes == 128 << 10 and s.seconds > 0 and s.writers == 2 for s in samples)
    assert writer_samples(events, what="replica", tier="local") == []  # one host: no partner copies
