"""Errors a new user meets first: each is a ShoalError that says what was wrong and where."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import threading
from typing import Any

import pytest
import torch

import shoal
from shoal.testing.checkpoints import assert_state_equal, make_config, zeros_like_state


@dataclasses.dataclass
class Sampler:
    """A user's own class in the state: the safe unpickler refuses it unless allowed."""

    seed: int = 3
    position: int = 0


class _WithState:
    """A ``Stateful`` value: saved as what ``state_dict()`` returns."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.inner = sd["inner"]


@pytest.fixture
def config(tmp_path, dram_root) -> shoal.Config:
    return make_config(tmp_path, dram_root)


def test_config_accepts_paths_as_well_as_strings(tmp_path, dram_root):
    cfg = shoal.Config(shared=tmp_path / "shared", local=tmp_path / "local", dram=pathlib.Path(dram_root))  # type: ignore[arg-type]
    assert cfg.shared == str(tmp_path / "shared") and cfg.dram == str(dram_root)
    with shoal.Checkpointer(cfg) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)


@pytest.mark.parametrize("step", [-1, 10**12, 1.5, "3", True])
def test_a_bad_step_is_a_shoal_error_naming_it(config, step):
    with shoal.Checkpointer(config) as ckpt:
        with pytest.raises(shoal.ShoalError, match="step"):
            ckpt.save(step, {"w": torch.ones(3)})  # type: ignore[arg-type]
        with pytest.raises(shoal.ShoalError, match="step"):
            ckpt.load({"w": torch.ones(3)}, step=step)  # type: ignore[arg-type]


def test_save_and_load_after_close_say_the_checkpointer_is_closed(config):
    ckpt = shoal.Checkpointer(config)
    ckpt.close()
    with pytest.raises(shoal.ShoalError, match="closed"):
        ckpt.save(1, {"w": torch.ones(3)})
    with pytest.raises(shoal.ShoalError, match="closed"):
        ckpt.load({"w": torch.ones(3)})


def test_a_value_that_cannot_be_serialised_names_its_key(config):
    with shoal.Checkpointer(config) as ckpt:
        with pytest.raises(shoal.ShoalError) as info:
            ckpt.save(1, {"w": torch.ones(3), "extra": {"lock": threading.Lock()}})
        assert "extra.lock" in str(info.value)
        ckpt.save(1, {"w": torch.ones(3)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)  # the slot was freed


def test_saving_a_committed_step_again_says_it_is_committed(config):
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)
        with pytest.raises(shoal.CheckpointExists, match="already (committed|exists)"):
            ckpt.save(1, {"w": torch.ones(3)})
        ckpt.wait()
        with pytest.raises(shoal.CheckpointExists, match="already"):
            ckpt.save(1, {"w": torch.ones(3)})
        target = zeros_like_state({"w": torch.ones(3)})
        assert ckpt.load(target) == 1
        assert_state_equal(target, {"w": torch.ones(3)})


# -- the state is not a mapping ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "got"), [(torch.ones(3), "Tensor"), ([torch.ones(3)], "list"), (None, "None")]
)
def test_a_state_that_is_not_a_mapping_is_refused_at_save_and_load(config, state, got):
    with shoal.Checkpointer(config) as ckpt:
        expected = r"save\(1\): the state must be a mapping of names to tensors/values \(a dict such as "
        with pytest.raises(shoal.UnsupportedValue, match=expected + r".*\), got " + got + "$") as info:
            ckpt.save(1, state)
        assert isinstance(info.value, TypeError)
        ckpt.save(1, {"w": torch.ones(3)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)  # nothing was left
        with pytest.raises(
            shoal.UnsupportedValue, match=r"load\(\): the state must be a mapping.*got " + got
        ):
            ckpt.load(state)
        with pytest.raises(shoal.UnsupportedValue, match=r"load\(step 1\): the state must be a mapping"):
            ckpt.load(state, step=1)


def test_a_module_passed_as_the_state_says_to_put_it_under_a_name(config):
    with (
        shoal.Checkpointer(config) as ckpt,
        pytest.raises(
            shoal.UnsupportedValue, match=r'got Linear; a Linear has a state_dict\(\): pass \{"name"'
        ),
    ):
        ckpt.save(1, torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def test_a_top_level_key_that_is_not_a_string_is_refused(config):
    with shoal.Checkpointer(config) as ckpt:
        with pytest.raises(
            shoal.InvalidName, match=r"save\(1\): the state's top-level keys must be strings.* got 1 \(int\)"
        ):
            ckpt.save(1, {"model": {"w": torch.ones(2)}, 1: torch.ones(2)})  # type: ignore[dict-item]
        with pytest.raises(shoal.InvalidName, match=r"load\(\): the state's top-level keys must be strings"):
            ckpt.load({"model": {"w": torch.ones(2)}, 1: torch.ones(2)})  # type: ignore[dict-item]


def test_nested_int_keys_as_in_an_optimizer_state_round_trip(config):
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, {"model": model.state_dict(), "optim": optim.state_dict()}).wait(timeout=60)
        fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
        fresh.load_state_dict(optim.state_dict())  # the same structure, int keys, to load into
        for buffers in fresh.state.values():
            for t in buffers.values():
                t.zero_()
        target = {"model": torch.nn.Linear(3, 2).state_dict(), "optim": fresh.state_dict()}
        assert ckpt.load(target) == 1
    assert torch.equal(target["optim"]["state"][0]["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize(
    ("state", "name"),
    [
        ({"extra": {1: torch.ones(2), "1": torch.zeros(2)}}, "extra.1"),
        ({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, "a.b"),
    ],
)
def test_two_entries_that_flatten_to_one_name_are_refused(config, state, name):
    with shoal.Checkpointer(config) as ckpt:
        expected = rf"save\(1\): two entries of the state are both named '{name}' once flattened.*rename one"
        with pytest.raises(shoal.InvalidName, match=expected):
            ckpt.save(1, state)
        assert ckpt.runtime.in_flight_steps() == []
        ckpt.save(1, {"w": torch.ones(3)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)
        with pytest.raises(shoal.InvalidName, match=rf"load\(step 1\): two entries .* named '{name}'"):
            ckpt.load(state)


# -- a value the default load would refuse ---------------------------------------------------------


def test_a_value_the_default_load_would_refuse_is_refused_at_save_naming_key_class_and_way_out(config):
    state = {"w": torch.ones(3), "extra": {"sampler": Sampler(), "epoch": 2}}
    with shoal.Checkpointer(config) as ckpt:
        with pytest.raises(shoal.UnsupportedValue) as info:
            ckpt.save(1, state)
        message = str(info.value)
        assert message.startswith("save(1): the value at 'extra.sampler' (a ")
        assert "Sampler) would be refused at load" in message
        assert "torch.serialization.add_safe_globals([" in message and "Sampler])" in message
        assert "shoal.Config(allow_pickle=True)" in message
        assert isinstance(info.value, TypeError)
        # nothing was staged: the step is free and nothing is in flight
        assert ckpt.runtime.in_flight_steps() == []
        assert ckpt.latest(shoal.Boundary.STAGED) is None
        ckpt.save(1, {"w": torch.ones(3)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)


def test_a_refused_value_inside_a_list_tuple_or_stateful_value_is_named_by_its_path(config):
    with shoal.Checkpointer(config) as ckpt:
        with pytest.raises(shoal.UnsupportedValue, match=r"the value at 'history\.1' \(a .*Sampler\)"):
            ckpt.save(1, {"w": torch.ones(3), "history": [1, Sampler(), "x"]})
        with pytest.raises(shoal.UnsupportedValue, match=r"the value at 'pair\.0\.s' \(a .*Sampler\)"):
            ckpt.save(1, {"pair": ({"s": Sampler()}, 2)})
        with pytest.raises(shoal.UnsupportedValue, match=r"the value at 'loader\.inner' \(a .*Sampler\)"):
            ckpt.save(1, {"loader": _WithState(Sampler())})
        # a Stateful object is checked as its state_dict(), not as itself
        ckpt.save(1, {"loader": _WithState(5)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)


def test_a_numpy_scalar_is_refused_at_save(config):
    np = pytest.importorskip("numpy")
    expected = r"the value at 'loss' \(a numpy\.float64\)"
    with shoal.Checkpointer(config) as ckpt, pytest.raises(shoal.UnsupportedValue, match=expected):
        ckpt.save(1, {"loss": np.float64(0.5)})


def test_a_class_allowed_with_safe_globals_saves_and_loads(config):
    with shoal.Checkpointer(config) as ckpt, torch.serialization.safe_globals([Sampler]):
        ckpt.save(1, {"w": torch.ones(3), "sampler": Sampler(7, 9)}).wait(timeout=60)
        out: dict[str, Any] = {"w": torch.zeros(3), "sampler": None}
        ckpt.load(out)
    assert out["sampler"] == Sampler(7, 9)


def test_with_allow_pickle_such_a_value_saves_and_loads(tmp_path, dram_root):
    with shoal.Checkpointer(make_config(tmp_path, dram_root, allow_pickle=True)) as ckpt:
        ckpt.save(1, {"w": torch.ones(3), "extra": {"sampler": Sampler(1, 2)}}).wait(timeout=60)
        out: dict[str, Any] = {"w": torch.zeros(3), "extra": {"sampler": None}}
        ckpt.load(out)
    assert out["extra"]["sampler"] == Sampler(1, 2)


def test_plain_values_save_without_a_trial(config, monkeypatch):
    from shoal import driver

    tried: list[str] = []
    monkeypatch.setattr(driver, "_try_value", lambda value, name, where: tried.append(name))
    state = {
        "w": torch.ones(3),
        "extra": {"epoch": 3, "lr": 1e-3, "name": "run", "flags": [True, None, 2.5, b"x", 1j]},
        "meta": (torch.float16, torch.device("cpu"), torch.Size([2, 3]), {"k": [1, 2]}),
    }
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, state).wait(shoal.Boundary.RESTARTABLE, timeout=60)
    assert tried == []


# -- a target that does not fit ---------------------------------------------------------------------


def test_a_shape_mismatch_at_load_names_key_stored_and_target(config):
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(3, {"model": {"w": torch.ones(4, 4)}}).wait(shoal.Boundary.RESTARTABLE, timeout=60)
        expected = (
            r"^load\(step 3\): item 'model\.w' is stored as float32 \[4, 4\] but the target is \[8, 4\]; "
            r"load into a tensor of the stored shape \(or reshard with a DTensor of the same global shape\)$"
        )
        target = {"model": {"w": torch.zeros(8, 4)}}
        with pytest.raises(shoal.StateMismatch, match=expected) as info:
            ckpt.load(target)
        assert isinstance(info.value, ValueError)
        assert torch.equal(target["model"]["w"], torch.zeros(8, 4))
        with pytest.raises(
            shoal.StateMismatch,
            match=r"item 'model\.w' is stored as a tensor, float32 \[4, 4\], but the target is None",
        ):
            ckpt.load({"model": {"w": None}})
        target = {"model": {"w": torch.zeros(4, 4)}}
        assert ckpt.load(target) == 3  # the next load works
    assert torch.equal(target["model"]["w"], torch.ones(4, 4))


def test_a_dtype_mismatch_at_load_needs_cast(config):
    stored = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, {"w": stored}).wait(shoal.Boundary.RESTARTABLE, timeout=60)
        with pytest.raises(shoal.StateMismatch, match=r"'w' is stored as float32 \[2, 3\].*float16"):
            ckpt.load({"w": torch.zeros(2, 3, dtype=torch.float16)})
        target = {"w": torch.zeros(2, 3, dtype=torch.float16)}
        assert ckpt.load(target, cast=True) == 1
    assert target["w"].dtype == torch.float16 and torch.equal(target["w"], stored.half())


# -- Config ----------------------------------------------------------------------------------------


def test_an_unknown_config_field_names_the_closest_one(tmp_path):
    expected = (
        r"^Config has no field 'keep_lst'; did you mean 'keep_last'\? \(fields: shared, local, dram, job, "
    )
    with pytest.raises(shoal.UnknownConfigField, match=expected) as info:
        shoal.Config(shared=str(tmp_path), keep_lst=3)  # type: ignore[call-arg]
    assert isinstance(info.value, shoal.ConfigError) and isinstance(info.value, TypeError)
    with pytest.raises(
        TypeError, match=r"Config has no fields 'jb' \(did you mean 'job'\?\), 'zzz' \(fields"
    ):
        shoal.Config(shared=str(tmp_path), jb="x", zzz=1)  # type: ignore[call-arg]
    cfg = shoal.Config(str(tmp_path), None, None, "run-1")  # positional use still works
    assert cfg.job == "run-1" and dataclasses.replace(cfg, keep_last=5).keep_last == 5
    with pytest.raises(shoal.UnknownConfigField, match="did you mean 'keep_last'"):
        dataclasses.replace(cfg, keep_lst=5)  # type: ignore[call-arg]


# -- roots ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["shared", "local", "dram"])
def test_a_root_that_is_a_file_is_refused_in_one_line(tmp_path, dram_root, field):
    afile = tmp_path / "afile"
    afile.write_text("")
    config = make_config(tmp_path, dram_root, **{field: str(afile)})
    with pytest.raises(shoal.ConfigError) as info:
        shoal.Checkpointer(config)
    assert str(info.value) == (
        f"Config.{field}: {afile} is a file, not a directory; "
        "point it at a directory (it is created if missing)"
    )
    below = afile / "sub"
    with pytest.raises(shoal.ConfigError) as info:
        shoal.Checkpointer(make_config(tmp_path, dram_root, **{field: str(below)}))
    assert str(info.value) == (
        f"Config.{field}: {below} is below {afile}, which is a file, not a directory; "
        "point it at a directory (it is created if missing)"
    )
    config = make_config(tmp_path, dram_root)
    with shoal.Checkpointer(config) as ckpt:  # nothing was left behind (locks, run records)
        ckpt.save(1, {"w": torch.ones(3)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)


def test_a_job_directory_that_is_a_file_is_refused_in_one_line(tmp_path, dram_root):
    config = make_config(tmp_path, dram_root)
    os.makedirs(config.shared)
    job_dir = pathlib.Path(config.shared) / config.job
    job_dir.write_text("")
    with pytest.raises(shoal.ConfigError) as info:
        shoal.Checkpointer(config)
    assert str(info.value) == (
        f"Config.shared: {job_dir} (the job's directory under {config.shared}) is a file, not a directory; "
        "remove it, or choose another Config.job"
    )


def test_a_shared_root_given_as_a_file_url_is_checked_too(tmp_path, dram_root):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(shoal.ConfigError, match=r"^Config\.shared: .*afile is a file, not a directory"):
        shoal.Checkpointer(make_config(tmp_path, dram_root, shared=f"file://{afile}"))


@pytest.mark.parametrize("field", ["local", "dram"])
def test_a_host_root_that_cannot_be_written_is_refused_in_one_line(tmp_path, dram_root, field, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root may write anywhere: deny it here, as the kernel denies another user
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real(p, mode))
    expected = (
        rf"^Config\.{field}: {locked}/root cannot be used: {locked} is not writable by uid \d+; "
        "point it at a directory you can write \\(it is created if missing\\)$"
    )
    try:
        with pytest.raises(shoal.ConfigError, match=expected):
            shoal.Checkpointer(make_config(tmp_path, dram_root, **{field: str(locked / "root")}))
    finally:
        locked.chmod(0o700)


# -- collectives --------------------------------------------------------------------------------------


def test_save_and_load_enter_the_collective_after_their_argument_checks(config, monkeypatch):
    with shoal.Checkpointer(config) as ckpt:
        calls: list[str] = []
        monkeypatch.setattr(ckpt.runtime, "enter_collective", calls.append)
        with pytest.raises(shoal.UnsupportedValue):
            ckpt.save(1, None)  # type: ignore[arg-type]
        with pytest.raises(shoal.ShoalError):
            ckpt.load({"w": torch.ones(3)}, step=-1)
        assert calls == []
        ckpt.save(1, {"w": torch.ones(3)}).wait(shoal.Boundary.RESTARTABLE, timeout=60)
        ckpt.load({"w": torch.zeros(3)})
        ckpt.load({"w": torch.zeros(3)}, step=1)
    assert calls == ["save(1)", "load(None)", "load(1)"]


def test_a_target_key_the_checkpoint_does_not_hold_is_named_with_the_closest_stored_one(config):
    with shoal.Checkpointer(config) as ckpt:
        ckpt.save(1, {"model": {"weight": torch.ones(3), "bias": torch.zeros(3)}}).wait(
            shoal.Boundary.RESTARTABLE, timeout=60
        )
        target = {"model": {"weight": torch.empty(3), "bais": torch.empty(3)}}
        with pytest.raises(shoal.StateMismatch) as info:
            ckpt.load(target)
        message = str(info.value)
        assert "'model.bais'" in message and "did you mean 'model.bias'?" in message, message
        assert "'model.weight'" in message and "leave those entries out" in message, message
        fitting = {"model": {"weight": torch.empty(3)}}  # a partial target loads what it names
        assert ckpt.load(fitting, heal=False) == 1
        assert torch.equal(fitting["model"]["weight"], torch.ones(3))
