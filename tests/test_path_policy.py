"""The durability path per checkpoint: a policy on the coordinator decides, checkpoint by checkpoint."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

import shoal
from shoal.engine.path import DIRECT, PARTNER, ModelPolicy, PathContext, PathDecision, RulePolicy, decide_path
from shoal.records.events import read_events
from shoal.testing import scenarios
from shoal.testing.checkpoints import make_config
from shoal.testing.multiproc import run_ranks

HOSTS = ["h0", "h0", "h1", "h1"]


def _context(*, hosts: tuple[str, ...] = ("a", "b"), can: bool = True) -> PathContext:
    return PathContext(step=1, world_size=4, hosts=hosts, logical_bytes=1 << 20, can_replicate=can)


def test_the_default_rule_is_config_path():
    assert RulePolicy("auto").decide(_context()).path == PARTNER
    assert RulePolicy("auto").decide(_context(hosts=("a",), can=False)).path == DIRECT
    assert RulePolicy("direct").decide(_context()).path == DIRECT
    assert RulePolicy("partner").decide(_context()).reason == "Config.path='partner'"


def test_a_partner_choice_where_none_is_possible_becomes_direct_saying_why():
    class Always:
        def decide(self, context: PathContext) -> PathDecision:
            return PathDecision(PARTNER, "always")

    decision = decide_path(Always(), _context(can=False))
    assert decision.path == DIRECT and "no partner host is possible" in decision.reason


def test_a_policy_answering_nonsense_is_refused_naming_it():
    with pytest.raises(shoal.ConfigError, match="paths are"):
        PathDecision("sideways", "?")

    class Bad:
        def decide(self, context: PathContext) -> str:
            return "partner"

    with pytest.raises(shoal.ConfigError, match="not a PathDecision"):
        decide_path(Bad(), _context())  # type: ignore[arg-type]


def test_one_host_takes_the_direct_path_and_says_so(tmp_path, dram_root):
    with shoal.Checkpointer(make_config(tmp_path, dram_root)) as ckpt:
        handle = ckpt.save(1, {"w": __import__("torch").ones(8)})
        handle.wait(shoal.Boundary.RESTARTABLE, timeout=60)
        assert handle.path == DIRECT and "one host" in (handle.path_reason or "")
        assert ckpt.runtime.resolve_manifest(1).path == DIRECT


def test_four_ranks_alternating_partner_and_direct_checkpoint_by_checkpoint(tmp_path):
    results = run_ranks(scenarios.alternating_paths, hosts=HOSTS, kwargs={"root": str(tmp_path)}, timeout=280)
    for r in results:
        for step, s in r["steps"].items():
            expected = PARTNER if int(step) % 2 else DIRECT
            assert s["path"] == expected and s["manifest_path"] == expected, (step, s)
            if expected == PARTNER:  # B2 on the partner host first, then the drain
                assert s["b2_before_b3"] and s["host_copy"], (step, s)
            else:  # straight to shared storage: B2 with B3, no partner copy
                assert s["b2_with_b3"] and not s["host_copy"], (step, s)
        # retention across the mix kept the newest three, and each of them loaded bit for bit
        assert r["committed"] == [4, 5, 6]


def auto_paths_in_lockstep_with_the_model(rank: int, world: int, *, root: str, saves: int) -> dict[str, Any]:
    """``saves`` checkpoints with ``path="auto"``: each one's path and reason, and on the
    coordinator the ``path`` and ``path_observed`` events of its event log. The coordinator waits,
    after each checkpoint, for it to finish and for the model update it started in the background:
    each decision then sees every fit the checkpoints before it asked for, so how long the cold
    start lasts is the policy's rule, not how fast a busy machine fits."""
    out: dict[str, Any] = {"steps": {}}
    with shoal.Checkpointer(scenarios.group_config(root, path="auto")) as ckpt:
        policy = ckpt.runtime.path_policy
        assert isinstance(policy, ModelPolicy) and policy.background  # the default, fitting off-thread
        for step in range(1, saves + 1):
            handle = ckpt.save(step, scenarios._state_at(rank, step))
            handle.wait(shoal.Boundary.RESTARTABLE, timeout=120)
            out["steps"][step] = {"path": handle.path, "reason": handle.path_reason}
            if rank == 0:
                assert ckpt.wait(120)  # the checkpoint's record reached the policy (observe)...
                # ...and the update it started is done: at nice 19 on a machine whose cores are
                # both busy that takes minutes, and a decision made before it would see one fit less
                assert policy.wait(400), "the model's update did not finish in 400 s"
            # The other ranks wait for it too, or the next save's collective timeout (60 s) would
            # fail them first: that is not what this test is about.
            dist.barrier()
        ckpt.wait()
        if rank == 0:
            assert ckpt.config.event_log is not None
            events = read_events(ckpt.config.event_log, kinds=("path", "path_observed"))
            out["path_events"] = [dict(e.fields) for e in events if e.event == "path" and e.rank == 0]
            out["observed"] = [dict(e.fields) for e in events if e.event == "path_observed"]
    return out


def test_auto_is_the_model_after_its_cold_start_and_every_decision_can_be_audited(tmp_path):
    """Four ranks on two hosts, ``path="auto"``: the rule while the model warms up, then the model's
    predictions for both paths; every decision's predictions and observed times in the event log."""
    saves = 8
    results = run_ranks(
        auto_paths_in_lockstep_with_the_model,
        hosts=HOSTS,
        kwargs={"root": str(tmp_path), "saves": saves},
        timeout=560,  # 8 model updates at nice 19, in lockstep: minutes on a busy machine
    )
    steps = results[0]["steps"]
    assert all(r["steps"] == steps for r in results)  # every rank took the coordinator's decision
    warm = [s for s in range(1, saves + 1) if "warming up" in steps[s]["reason"]]
    # min_checkpoints=4, the process's first not counted: the fits exist once the fifth is observed,
    # and (the coordinator having waited for them) the sixth decision is the model's
    assert warm == [1, 2, 3, 4, 5], steps
    for s in range(len(warm) + 1, saves + 1):
        assert "time to B2" in steps[s]["reason"], steps[s]
    events = {e["step"]: e for e in results[0]["path_events"]}
    assert set(events) == set(range(1, saves + 1))
    for s in range(len(warm) + 1, saves + 1):
        predicted = events[s]["predictions"]
        assert set(predicted) == {PARTNER, DIRECT} and events[s]["path"] == steps[s]["path"]
        assert all(p["seconds"] >= p["typical"] > 0 for p in predicted.values())
        # what the decision cost on the pipeline's thread, and the update behind it in its own process
        cost = events[s]["cost"]
        assert cost["when"] == "before the plan" and cost["decide_s"] >= 0, cost
        assert cost["update"]["where"] == "process" and cost["update"]["after_checkpoint"] == s - 1, cost
    for s in warm:
        assert "update" not in events[s]["cost"] and events[s]["cost"]["decide_s"] >= 0
    observed = {e["step"]: e for e in results[0]["observed"]}
    assert set(observed) == set(range(1, saves + 1))
    for s, e in observed.items():
        assert e["path"] == steps[s]["path"] and e["b2"] > e["pre"] > 0
        assert (e["predicted"] is None) == (s in warm)
