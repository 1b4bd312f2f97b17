"""Paths inside a tier root (docs/design.md section 6)."""

from __future__ import annotations

import pytest

from shoal.errors import InvalidName
from shoal.format import layout
from shoal.format.names import check_identifier, check_relpath


def test_paths_follow_the_documented_layout() -> None:
    assert layout.step_dir(42) == "steps/000000000042"
    assert layout.manifest_path(42) == "steps/000000000042/manifest.json"
    assert layout.commit_path(42) == "steps/000000000042/COMMIT"
    assert layout.pack_path("p-1") == "packs/p-1.pack"
    assert layout.index_path("p-1") == "packs/p-1.idx"
    assert layout.LATEST == "LATEST"
    for path in (layout.manifest_path(0), layout.commit_path(layout.MAX_STEP), layout.pack_path("x")):
        assert check_relpath(path) == path


def test_step_paths_sort_in_step_order() -> None:
    steps = [0, 9, 10, 99, 100, 12345, layout.MAX_STEP]
    assert sorted(layout.step_dir(s) for s in steps) == [layout.step_dir(s) for s in steps]


@pytest.mark.parametrize("step", [0, 1, 10**6, layout.MAX_STEP])
def test_check_step_accepts_the_range(step: int) -> None:
    assert layout.check_step(step) == step


@pytest.mark.parametrize("step", [-1, layout.MAX_STEP + 1, 10**12, True, False, 1.0, "1", None])
def test_check_step_rejects_out_of_range_and_non_ints(step: object) -> None:
    with pytest.raises(InvalidName, match="step"):
        layout.check_step(step)
    with pytest.raises(ValueError):  # InvalidName is a ValueError too: old callers keep working
        layout.step_dir(step)  # type: ignore[arg-type]


def test_check_step_message_stays_short_for_a_huge_step() -> None:
    with pytest.raises(InvalidName, match="an int of 3322 bits") as info:
        layout.check_step(10**1000)
    assert len(str(info.value)) < 200


@pytest.mark.parametrize("pack_id", ["../x", "a/b", "", ".hidden"])
def test_pack_paths_refuse_unsafe_ids(pack_id: str) -> None:
    with pytest.raises(InvalidName):
        layout.pack_path(pack_id)
    with pytest.raises(InvalidName):
        layout.index_path(pack_id)


def test_new_pack_id_is_a_fresh_identifier_that_names_its_step() -> None:
    ids = {layout.new_pack_id(7, "node-1", 3) for _ in range(50)}
    assert len(ids) == 50
    for pid in ids:
        assert check_identifier(pid, "pack id") == pid
        assert pid.startswith("000000000007-node-1-r3-")
        assert layout.pack_step(pid) == 7
    assert layout.pack_step(layout.new_pack_id(layout.MAX_STEP, "h", 0)) == layout.MAX_STEP


def test_new_pack_id_refuses_bad_inputs() -> None:
    with pytest.raises(ValueError):
        layout.new_pack_id(-1, "h", 0)
    with pytest.raises(InvalidName):
        layout.new_pack_id(1, "bad/host", 0)


@pytest.mark.parametrize(
    ("pack_id", "step"),
    [
        ("000000000042-h-r0-abcd", 42),
        ("000000000000-x", 0),
        ("42-h-r0", None),
        ("foreign-pack", None),
        ("0000000000042-h", None),
        ("00000000004a-h", None),
    ],
)
def test_pack_step(pack_id: str, step: int | None) -> None:
    assert layout.pack_step(pack_id) == step


@pytest.mark.parametrize(
    ("path", "step"),
    [
        ("steps/000000000042/manifest.json", 42),
        ("steps/000000000042/COMMIT", 42),
        ("steps/000000000042", None),
        ("steps/42/manifest.json", None),
        ("packs/000000000042-h.pack", None),
        ("LATEST", None),
        ("x/steps/000000000042/manifest.json", None),
    ],
)
def test_step_of_path(path: str, step: int | None) -> None:
    assert layout.step_of_path(path) == step


def test_step_of_path_inverts_step_paths() -> None:
    for s in (0, 5, layout.MAX_STEP):
        assert layout.step_of_path(layout.manifest_path(s)) == s
        assert layout.step_of_path(layout.commit_path(s)) == s
