"""Name checks: item keys, tier paths, identifiers and digests."""

from __future__ import annotations

import pytest

from shoal.errors import InvalidName, ShoalError
from shoal.format.chunking import digest
from shoal.format.names import (
    MAX_KEY_LENGTH,
    MAX_PATH_LENGTH,
    check_digest,
    check_identifier,
    check_item_key,
    check_relpath,
)


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.0.weight",
        "optim.state.0.exp_avg",
        "optim.param_groups.0.lr",
        "model.embed_tokens.weight@shard.0_128",
        "a/b",
        "a..b",
        "...",
        "x" * MAX_KEY_LENGTH,
        "模型.权重",
        "step",
    ],
)
def test_item_key_accepts_dcp_fqns(key: str) -> None:
    assert check_item_key(key) == key


@pytest.mark.parametrize(
    "key",
    [
        "",
        "..",
        "../etc/passwd",
        "a/../b",
        "a/..",
        "a\\..\\b",
        "/abs",
        "\\abs",
        "a\x00b",
        "x" * (MAX_KEY_LENGTH + 1),
        None,
        3,
        b"bytes",
    ],
)
def test_item_key_rejects_unsafe_keys(key: object) -> None:
    with pytest.raises(InvalidName):
        check_item_key(key)


def test_invalid_name_is_a_shoal_value_error() -> None:
    with pytest.raises(ShoalError):
        check_item_key("..")
    with pytest.raises(ValueError, match="absolute"):
        check_item_key("/x")
    with pytest.raises(ValueError, match="NUL"):
        check_item_key("a\x00")


@pytest.mark.parametrize(
    "path",
    [
        "LATEST",
        "packs/000000000001-h-r0-abcd.pack",
        "steps/000000000001/manifest.json",
        "__0_0.distcp",
        "a/b/c",
        "a..b/c",
        "x" * MAX_PATH_LENGTH,
    ],
)
def test_relpath_accepts_tier_paths(path: str) -> None:
    assert check_relpath(path) == path


@pytest.mark.parametrize(
    "path",
    [
        "",
        "/abs",
        "..",
        "../x",
        "a/../b",
        "a/.",
        "./a",
        "a//b",
        "a/",
        "a\\b",
        "..\\x",
        "a\x00",
        "x" * (MAX_PATH_LENGTH + 1),
        None,
        ["a"],
    ],
)
def test_relpath_rejects_unsafe_paths(path: object) -> None:
    with pytest.raises(InvalidName):
        check_relpath(path)


@pytest.mark.parametrize("value", ["run-42", "job_1.v2", "0", "node-1.example.com", "a" * 128])
def test_identifier_accepts_simple_names(value: str) -> None:
    assert check_identifier(value, "job") == value


@pytest.mark.parametrize(
    "value", ["", "-lead", ".hidden", "a/b", "a b", "..", "a\x00", "ü", "a" * 129, None, 1]
)
def test_identifier_rejects_other_names(value: object) -> None:
    with pytest.raises(InvalidName, match="host id"):
        check_identifier(value, "host id")


def test_digest_check() -> None:
    d = digest(b"x")
    assert check_digest(d) == d
    for bad in (d.upper(), d[:-1], d + "0", "g" * 64, None, 0):
        with pytest.raises(InvalidName, match="chunk"):
            check_digest(bad, "chunk")
