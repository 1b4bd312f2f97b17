"""The exact tree encoding (:mod:`shoal.format.tree`): bit-exact round trips, load targets, refusals."""

from __future__ import annotations

import doctest
import json
import math
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shoal
from shoal.errors import ConfigError, FormatError, UnsupportedValue
from shoal.format import tree
from shoal.testing.checkpoints import assert_identical, make_config


def _load_by_hand(skeleton: Any, stored: dict[str, Any]) -> dict[str, Any]:
    """What ``Checkpointer.load`` does to the targets: each stored tensor copied into its target."""
    target = tree.targets(skeleton)
    assert sorted(tree.paths(target)) == sorted(tree.paths(stored))
    for path in tree.paths(stored):
        got, want = target, stored
        for name in path:
            got, want = got[name], want[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        with torch.no_grad():
            got.copy_(want)
    return target


def _round_trip(value: Any, **kwargs: Any) -> Any:
    stored, skeleton = tree.encode(value, where="test", **kwargs)
    skeleton = json.loads(json.dumps(skeleton, allow_nan=False))  # through JSON text, strictly
    return tree.decode(skeleton, _load_by_hand(skeleton, stored))


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


PLAIN = {
    1: "an int key",
    "1.5": 1.5,
    (2, "b", None): [True, 1, False, 0, None, 2**70, -(2**70)],
    2.5: (math.inf, -math.inf, math.nan, -0.0, 0.0, 5e-324, 1e300),
    None: "",
    "nested": OrderedDict(b=[{}, [], ()], a=(OrderedDict(), {"x": {"y": [1, (2,)]}})),
    "dtypes": [torch.float16, torch.bfloat16, torch.int8, torch.bool, torch.complex64, torch.float8_e4m3fn],
    "devices": (torch.device("cpu"), torch.device("cuda:1"), torch.device("meta")),
    torch.float32: torch.device("cpu"),
    "text": "模型 \U0001f600 \udcff",
}


def test_nested_containers_key_types_and_plain_values_round_trip_exactly() -> None:
    stored, _ = tree.encode(PLAIN, where="test")
    assert stored == {}  # no tensor: nothing for shoal, all of it in the skeleton
    assert_identical(_round_trip(PLAIN), PLAIN)


def _tensors() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    # a nan with a payload, a negative nan, -0.0 (0x7FC00001, 0xFFC00000, 0x80000000)
    nan_bits = torch.tensor([0x7FC00001, -0x400000, -0x80000000], dtype=torch.int32).view(torch.float32)
    return {
        "empty": torch.empty(0, 3),
        "empty_1d": torch.zeros(0, dtype=torch.int64),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "transposed": base.t(),  # non-contiguous
        "strided": base[:, ::2],  # non-contiguous
        "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "bf16_scalar": torch.tensor(-0.0, dtype=torch.bfloat16),
        "nan_payloads": nan_bits,
        "bool": torch.tensor([True, False, True]),
        "int16": torch.tensor([1, -2, 32767], dtype=torch.int16),
        "uint8": torch.arange(256, dtype=torch.uint8),
        "complex": torch.randn(3, generator=g, dtype=torch.complex64),
        "f8": torch.tensor([0.5, -1.0]).to(torch.float8_e4m3fn),
        "param": torch.nn.Parameter(torch.ones(2)),
    }


@pytest.mark.parametrize("inline", [False, True], ids=["stored", "inline"])
def test_tensors_round_trip_bit_exact_stored_or_inline(inline: bool) -> None:
    value = {"state": {0: _tensors(), "list": [torch.ones(1), (torch.zeros(2, 2),)]}}
    stored, skeleton = tree.encode(value, where="test", inline=lambda path: inline)
    assert len(tree.paths(stored)) == (0 if inline else len(_tensors()) + 2)
    back = _round_trip(value, inline=lambda path: inline)
    expected = {"state": {0: {**_tensors(), "param": torch.ones(2)}, "list": value["state"]["list"]}}
    assert_identical(back, expected)  # a Parameter comes back as a plain tensor of its bits
    assert back["state"][0]["transposed"].shape == (6, 4)


def test_stored_tensors_are_the_values_own_at_their_paths_and_inline_decides_per_path() -> None:
    w, b, ema = torch.ones(2), torch.zeros(3), torch.full((2,), 0.5)
    value = {"model": OrderedDict(w=w), "optim": [{"state": {3: b}}], "callbacks": {"ema": ema}}
    stored, skeleton = tree.encode(value, where="test", inline=lambda path: path[0] == "callbacks")
    assert tree.paths(stored) == [("model", "w"), ("optim", "0", "state", "3")]
    assert stored["model"]["w"] is w and stored["optim"]["0"]["state"]["3"] is b  # not copied
    assert skeleton["dict"][2][1]["dict"][0][1]["inline"][:2] == ["float32", [2]]
    assert skeleton["dict"][0][1] == {"odict": [["w", {"tensor": ["float32", [2]]}]]}
    assert_identical(_round_trip(value, inline=lambda path: path[0] == "callbacks"), value)


def test_targets_have_each_stored_tensors_dtype_and_shape_or_the_live_tensor_at_its_path() -> None:
    value = {"a": [torch.ones(2, 3, dtype=torch.bfloat16), {"b": torch.zeros((), dtype=torch.int64)}]}
    _, skeleton = tree.encode(value, where="test")
    target = tree.targets(skeleton)
    assert list(target) == ["a"] and list(target["a"]) == ["0", "1"]
    assert (target["a"]["0"].dtype, target["a"]["0"].shape) == (torch.bfloat16, (2, 3))
    assert (target["a"]["1"]["b"].dtype, target["a"]["1"]["b"].shape) == (torch.int64, ())
    live = torch.empty(2, 3, dtype=torch.bfloat16)
    into = tree.targets(skeleton, {"a": {"0": live}, "other": {"x": torch.ones(1)}})
    assert into["a"]["0"] is live and "other" not in into
    assert into["a"]["1"]["b"].shape == ()
    assert tree.targets(tree.encode({"x": [1, 2.0]}, where="test")[1]) == {}


def test_a_value_that_cannot_be_encoded_exactly_is_refused_naming_its_path() -> None:
    with pytest.raises(UnsupportedValue, match=r"^ckpt: the value at mine/1 is a builtins\.object: .*pickle"):
        tree.encode({"mine": [1, object()]}, where="ckpt")

    class MyInt(int):
        pass

    for bad, where in [
        ({"a": {"b": defaultdict(list)}}, "a/b is a collections.defaultdict"),
        ({"n": [MyInt(3)]}, "n/0 is a .*MyInt"),
        ({"s": {1, 2}}, "s is a builtins.set"),
        ({"k": {frozenset(): 1}}, "the key at k is a builtins.frozenset"),
        ({"k": {(1, object()): 1}}, "the key at k is a builtins.object"),
        ({"k": {torch.ones(1): 1}}, "the key at k is a torch.Tensor"),
        ({"sp": torch.eye(2).to_sparse()}, "the tensor at sp is torch.sparse_coo, not strided"),
        (torch.ones(1), "the value is a tensor itself"),
    ]:
        with pytest.raises(UnsupportedValue, match=where):
            tree.encode(bad, where="ckpt")


def test_two_keys_that_are_one_path_name_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"ckpt: keys 1 and '1' at a/0 are one name, '1'"):
        tree.encode({"a": [{1: torch.ones(1), "1": 2}]}, where="ckpt")
    with pytest.raises(ConfigError, match=r"keys True and 'True' at the top"):
        tree.encode({True: 1, "True": 2}, where="ckpt")


def test_a_malformed_skeleton_or_loaded_state_is_a_format_error_naming_the_path() -> None:
    for skeleton, match in [
        ({"dict": [["a", {"pickle": "x"}]]}, "unknown skeleton tag 'pickle' at a"),
        ({"dict": [["a", {"tensor": ["load", [1]]}]]}, "unknown dtype 'load' at a"),
        ({"dict": [["a", {"dtype": "Tensor"}]]}, "unknown dtype 'Tensor' at a"),
        ([{"float": "1.5"}], "unknown skeleton tag 'float' at 0"),
        ([{"a": 1, "b": 2}], "node at 0 is neither plain nor tagged"),
    ]:
        with pytest.raises(FormatError, match=match):
            tree.decode(skeleton, {})
    _, skeleton = tree.encode({"a": {"b": torch.ones(1)}}, where="test")
    with pytest.raises(FormatError, match="no tensor at a/b"):
        tree.decode(skeleton, {"a": {}})


def test_the_module_docstrings_example_runs() -> None:
    assert doctest.testmod(tree, raise_on_error=True).attempted > 0


# plain values, as deep as hypothesis likes: every one must come back exactly through JSON text
_KEYS = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5), st.floats(allow_nan=False))
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(
        [torch.float32, torch.bfloat16, torch.uint8, torch.device("cpu"), torch.device("cuda:3")]
    ),
)


def _distinct_names(d: dict[Any, Any]) -> bool:
    return len({str(k) for k in d}) == len(d)


_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(_KEYS, inner, max_size=4).filter(_distinct_names),
        st.dictionaries(st.tuples(st.integers(), st.text(max_size=2)), inner, max_size=3)
        .filter(_distinct_names)
        .map(OrderedDict),
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(_VALUES)
def test_any_nested_plain_value_round_trips_exactly_through_json(value: Any) -> None:
    assert_identical(_round_trip(value), value)


def test_stored_state_and_skeleton_round_trip_through_a_checkpointer(tmp_path: Path, dram_root: Path) -> None:
    """What the integrations do: the stored state and the skeleton (a string item) as one step."""
    value = {"opt": {"state": {0: {"step": torch.tensor(3.0), "m": torch.randn(4, 3).t()}}, "lr": [0.1]}}
    value["opt"]["extra"] = (torch.empty(0, 2, dtype=torch.bfloat16), -0.0, {7: math.inf})
    stored, skeleton = tree.encode(value, where="test")
    with shoal.Checkpointer(make_config(tmp_path, dram_root)) as ckpt:
        ckpt.save(1, {"tree": stored, "skeleton": json.dumps(skeleton, allow_nan=False)}).wait()
        head = {"skeleton": ""}  # a reader that knows nothing but the step: the skeleton first
        ckpt.load(head, 1, heal=False)
        skeleton = json.loads(head["skeleton"])
        state = {"tree": tree.targets(skeleton), "skeleton": ""}
        ckpt.load(state, 1)
    assert_identical(tree.decode(skeleton, state["tree"]), value)
