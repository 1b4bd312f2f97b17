"""Block keys: chained prefix hashes name whole prefixes; validation names the field."""

from __future__ import annotations

import pytest

from shoal.errors import ConfigError, InvalidName
from shoal.kv.keys import BlockKey, chain_keys, encode_block_id, namespace_for

NS = namespace_for("qwen2.5-14b", "bf16-L48-H8-D128-B512")


def test_equal_prefixes_give_equal_keys_and_a_change_differs_from_there_on() -> None:
    a = chain_keys(NS, 0, [1, 2, 3, 4, 5])
    b = chain_keys(NS, 0, [1, 2, 3, 9, 5])
    assert a[:3] == b[:3]
    assert [x.digest for x in a[:3]] == [x.digest for x in b[:3]]
    assert all(x != y and x.digest != y.digest for x, y in zip(a[3:], b[3:], strict=True))  # 5 too


def test_a_longer_sequence_extends_the_keys_of_its_prefix() -> None:
    assert chain_keys(NS, 0, [7, 8]) == chain_keys(NS, 0, [7, 8, 9])[:2]


def test_namespace_rank_and_id_type_each_change_the_key() -> None:
    base = chain_keys(NS, 0, [1])[0]
    assert chain_keys(namespace_for("other", "bf16"), 0, [1])[0].digest != base.digest
    assert chain_keys(NS, 1, [1])[0].digest != base.digest
    assert chain_keys(NS, 0, ["1"])[0].digest != base.digest
    assert chain_keys(NS, 0, [b"1"])[0].digest != base.digest
    assert encode_block_id(12) != encode_block_id("12")


def test_digest_is_64_hex_and_stable() -> None:
    key = BlockKey("m/l", 3, bytes(32))
    assert len(key.digest) == 64 and int(key.digest, 16) >= 0
    assert key.digest == BlockKey("m/l", 3, bytes(32)).digest
    assert key == BlockKey("m/l", 3, bytes(32)) and hash(key) == hash(BlockKey("m/l", 3, bytes(32)))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"namespace": "", "tp_rank": 0, "prefix_hash": bytes(32)}, "namespace"),
        ({"namespace": "a\nb", "tp_rank": 0, "prefix_hash": bytes(32)}, "namespace"),
        ({"namespace": "x" * 257, "tp_rank": 0, "prefix_hash": bytes(32)}, "namespace"),
        ({"namespace": "m", "tp_rank": -1, "prefix_hash": bytes(32)}, "tp_rank"),
        ({"namespace": "m", "tp_rank": True, "prefix_hash": bytes(32)}, "tp_rank"),
        ({"namespace": "m", "tp_rank": 0, "prefix_hash": bytes(31)}, "prefix_hash"),
        ({"namespace": "m", "tp_rank": 0, "prefix_hash": "00" * 32}, "prefix_hash"),
    ],
)
def test_invalid_fields_are_refused_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises((ConfigError, InvalidName), match=field):
        BlockKey(**kwargs)  # type: ignore[arg-type]


def test_block_ids_of_other_types_and_bad_namespace_parts_are_refused() -> None:
    with pytest.raises(ConfigError, match="bool"):
        chain_keys(NS, 0, [True])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="float"):
        chain_keys(NS, 0, [1.5])  # type: ignore[list-item]
    with pytest.raises(InvalidName, match="model"):
        namespace_for("a/b", "bf16")
