"""Nothing a stranger wrote is unpickled: non-tensor items load with ``weights_only=True`` by default."""

from __future__ import annotations

import pathlib
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import shoal
from shoal.errors import FormatError
from shoal.testing.checkpoints import assert_state_equal, make_config


def _plant(path: str) -> str:
    """What the malicious pickle runs when unpickled: it creates ``path``."""
    pathlib.Path(path).touch()
    return "planted"


class Planted:
    """An object whose pickle calls :func:`_plant` (a stand-in for ``os.system``)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_plant, (self.marker,))


class Point:
    """A user class the user allows with ``torch.serialization.add_safe_globals``."""

    def __init__(self, x: int, label: str) -> None:
        self.x = x
        self.label = label


@pytest.fixture
def roots(tmp_path: pathlib.Path, dram_root: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """The test's root (shared tier and local roots) and its DRAM scratch root."""
    return tmp_path, dram_root


def _config(roots: tuple[pathlib.Path, pathlib.Path], name: str, **overrides: Any) -> shoal.Config:
    """A Config on the test's shared root, with host tiers of its own (empty): loads use shared only."""
    root, dram = roots
    return make_config(root, dram / name, local=str(root / f"local-{name}"), **overrides)


def _save(roots: tuple[pathlib.Path, pathlib.Path], state: dict[str, Any]) -> None:
    # allow_pickle: the writer saves what the default load refuses (shoal refuses it at save otherwise)
    with shoal.Checkpointer(_config(roots, "writer", allow_pickle=True)) as ckpt:
        ckpt.save(1, state).wait(shoal.Boundary.RESTARTABLE, timeout=60)


def test_a_planted_pickle_is_refused_by_default_and_never_runs(roots, tmp_path):
    marker = tmp_path / "pwned"
    _save(roots, {"w": torch.arange(6.0), "evil": Planted(str(marker))})
    assert not marker.exists()
    with shoal.Checkpointer(_config(roots, "reader")) as ckpt, pytest.raises(FormatError) as info:
        ckpt.load({"w": torch.zeros(6), "evil": None})
    message = str(info.value)
    assert "'evil'" in message and "step 1" in message
    assert "allow_pickle=True" in message
    assert f"{__name__}._plant" in message  # names what was refused
    assert not marker.exists()


def test_a_planted_pickle_is_refused_through_dcp_load_too(roots, tmp_path):
    marker = tmp_path / "pwned"
    _save(roots, {"evil": Planted(str(marker))})
    with shoal.Checkpointer(_config(roots, "reader")) as ckpt, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's "assuming a single process" notice
        with pytest.raises(CheckpointException) as info:  # DCP wraps what read_data raises
            dcp.load({"evil": None}, storage_reader=shoal.dcp.StorageReader(ckpt, step=1), no_dist=True)
    (failure,) = info.value.failures.values()
    error = failure[0] if isinstance(failure, tuple) else failure
    assert isinstance(error, shoal.errors.FormatError) and "allow_pickle" in str(error)
    assert not marker.exists()


def test_with_allow_pickle_the_object_is_unpickled_as_saved(roots, tmp_path):
    marker = tmp_path / "pwned"
    _save(roots, {"w": torch.arange(6.0), "evil": Planted(str(marker))})
    out: dict[str, Any] = {"w": torch.zeros(6), "evil": None}
    with shoal.Checkpointer(_config(roots, "trusting", allow_pickle=True)) as ckpt:
        ckpt.load(out)
    assert out["evil"] == "planted"
    assert marker.exists()  # the payload really was live: the default-config tests above mean something
    assert torch.equal(out["w"], torch.arange(6.0))


def test_plain_python_objects_and_tensors_inside_them_load_by_default(roots):
    state = {
        "w": torch.randn(5, 3),
        "epoch": 4,
        "lr": 3e-4,
        "name": "run-42",
        "flags": [True, None, "x", 2.5],
        # a tuple is one non-tensor item, even with a dict, a list and a tensor inside
        "packed": ({"a": 1, "b": "two"}, [1, 2, 3], torch.arange(4, dtype=torch.int16), (1.5, b"raw")),
    }
    out: dict[str, Any] = {"w": torch.zeros(5, 3), **{k: None for k in state if k != "w"}}
    _save(roots, state)
    with shoal.Checkpointer(_config(roots, "reader")) as ckpt:
        ckpt.load(out)
    packed = out.pop("packed")
    expected = state.pop("packed")
    assert_state_equal(out, state)
    assert packed[0] == expected[0] and packed[1] == expected[1] and packed[3] == expected[3]
    assert packed[2].dtype == torch.int16 and torch.equal(packed[2], expected[2])


def test_a_dict_saved_as_one_item_loads_by_default(roots):
    """Without flattening, DCP saves a whole dict of ints and strings as one non-tensor item."""
    meta = {"epoch": 3, "tag": "best", "sizes": [1, 2], "nested": {"k": "v"}}
    with shoal.Checkpointer(_config(roots, "writer")) as ckpt, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        writer = shoal.dcp.StorageWriter(ckpt, step=1)
        planner = shoal.dcp.SavePlanner(flatten_state_dict=False)
        dcp.save({"meta": meta, "t": torch.ones(3)}, storage_writer=writer, planner=planner, no_dist=True)
        writer.handle.wait(shoal.Boundary.RESTARTABLE, timeout=60)
        assert ckpt.runtime.resolve_manifest(1).items["meta"].kind == "bytes"
    with shoal.Checkpointer(_config(roots, "reader")) as ckpt, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out: dict[str, Any] = {"meta": None, "t": torch.zeros(3)}
        dcp.load(
            out,
            storage_reader=shoal.dcp.StorageReader(ckpt, step=1),
            # (flattening sharded tensors would copy the dict, and the value would land in the copy)
            planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            no_dist=True,
        )
    assert out["meta"] == meta
    assert torch.equal(out["t"], torch.ones(3))


def test_a_class_the_user_allowed_loads_by_default(roots):
    _save(roots, {"p": Point(7, "seven")})
    out: dict[str, Any] = {"p": None}
    with shoal.Checkpointer(_config(roots, "reader")) as ckpt:
        with pytest.raises(shoal.errors.FormatError, match="Point"):
            ckpt.load(out)
        with torch.serialization.safe_globals([Point]):
            ckpt.load(out)
    assert isinstance(out["p"], Point) and (out["p"].x, out["p"].label) == (7, "seven")
