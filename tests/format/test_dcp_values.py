"""The DCP codec's generic values (:mod:`shoal.format.dcp_values`): tags, exact types, no pickle."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from shoal.errors import FormatError
from shoal.format.dcp_codec import (
    decode_metadata,
    decode_metadata_json,
    encode_metadata,
    encode_metadata_json,
)


def _roundtrip(md: Metadata) -> Metadata:
    return decode_metadata_json(encode_metadata_json(md))


def test_non_ascii_and_lone_surrogate_names_round_trip() -> None:
    names = ["模型.权重", "emoji.\U0001f600", "bad.\udcff"]
    md = Metadata({n: BytesStorageMetadata() for n in names}, planner_data={n: (n,) for n in names})
    assert decode_metadata_json(encode_metadata_json(md)) == md


def test_user_dict_keys_that_look_like_tags_are_not_confused() -> None:
    trap = {"tuple": ("x",), "dict": 1, "pairs": [], "float": "nan", "storage_info": None, "size": [1]}
    planner = {"trap": trap, "single": {"tuple": ["a"]}, "int_keys": {1: "a", (2, "b"): ["c"]}}
    md = Metadata({}, planner_data=planner)
    back = decode_metadata_json(encode_metadata_json(md))
    assert back.planner_data == planner
    assert type(back.planner_data["trap"]["tuple"]) is tuple
    assert type(back.planner_data["single"]["tuple"]) is list


def test_non_finite_floats_are_tagged_not_literal() -> None:
    md = Metadata({}, planner_data=[math.inf, -math.inf, math.nan, 1.5, -0.0])
    text = encode_metadata_json(md)
    assert b"NaN" not in text and b"Infinity" not in text
    back = decode_metadata_json(text).planner_data
    assert back[:2] == [math.inf, -math.inf] and math.isnan(back[2]) and back[3] == 1.5
    assert math.copysign(1.0, back[4]) == -1.0


def test_torch_size_values_keep_their_type() -> None:
    md = Metadata({}, planner_data={"s": torch.Size([2, 3]), "t": (2, 3)})
    back = _roundtrip(md).planner_data
    assert type(back["s"]) is torch.Size and type(back["t"]) is tuple


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
_hashables = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4),
    lambda inner: st.tuples(inner, inner),
    max_leaves=4,
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=6), inner, max_size=4)
        | st.dictionaries(_hashables, inner, max_size=4)
        | st.lists(st.integers(0, 2**40), max_size=3).map(torch.Size)
    ),
    max_leaves=20,
)


def _same(a: Any, b: Any) -> bool:
    """Exact structural equality: same types all the way down, NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@settings(max_examples=150, deadline=None)
@given(_values)
def test_generic_values_round_trip_exactly(value: Any) -> None:
    md = Metadata({}, planner_data=value)
    assert _same(decode_metadata_json(encode_metadata_json(md)).planner_data, value)


class _Opaque:
    pass


@pytest.mark.parametrize(
    ("planner_data", "message"),
    [
        (_Opaque(), r"planner_data: cannot encode .*_Opaque"),
        ({"a": {1, 2}}, r"planner_data\['a'\]: cannot encode a value of type builtins.set"),
        ([b"bytes"], r"planner_data\[0\]: cannot encode"),
        ({"t": torch.ones(1)}, r"planner_data\['t'\]: cannot encode .*Tensor"),
        ({"d": torch.float32}, r"cannot encode .*dtype"),
    ],
)
def test_values_that_need_pickle_are_refused(planner_data: object, message: str) -> None:
    with pytest.raises(FormatError, match=message):
        encode_metadata(Metadata({}, planner_data=planner_data))


def test_dict_tag_with_non_string_keys_is_refused() -> None:
    obj = encode_metadata(Metadata({}))
    obj["planner_data"] = {"dict": {1: "a"}}
    with pytest.raises(FormatError, match="planner_data: unknown type tag"):
        decode_metadata(obj)
