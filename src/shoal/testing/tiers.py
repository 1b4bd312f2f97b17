"""The tier conformance suite: every tier, built in or third party, proves itself against it.

Subclass :class:`TierTests` in a test module (its name must start with ``Test`` for
pytest to collect it), provide a ``tier`` fixture, and implement the two helpers that
reach *around* the tier to its backing storage, so that the suite checks the tier
against ground truth rather than against itself::

    class TestMyTier(TierTests):
        @pytest.fixture
        def tier(self, tmp_path):
            return MyTier(tmp_path)

        def write_around(self, tier, path, data): ...
        def read_around(self, tier, path): ...
        def files_around(self, tier): ...

A tier that is a :class:`~shoal.tiers.slabs.SlabStore` also runs the slab tests (they skip
for others), and every tier's :class:`~shoal.tiers.base.TierCapabilities` are checked for
consistency with its class and the registry.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from shoal.errors import InvalidName, MissingFile, OwnershipError, TierError
from shoal.tiers.base import Data, FileInfo, Tier, TierCapabilities
from shoal.tiers.registry import BUILT_IN_TIERS, TIER_CLASSES, read_preference, tier_class
from shoal.tiers.roles import Role, kind_for
from shoal.tiers.slabs import MappedFiles, MappedSlabs, SlabLike, SlabStore

MiB = 1 << 20


class Boom(RuntimeError):
    """What a failing data iterable raises in the atomicity tests."""


def _failing(parts: list[bytes]) -> Iterator[bytes]:
    yield from parts
    raise Boom("data source failed mid-write")


def _slabs(tier: Tier) -> SlabStore:
    """``tier`` as a slab store; the test is skipped for a tier that is not one."""
    if not isinstance(tier, SlabStore):
        pytest.skip(f"{type(tier).__name__} is not a SlabStore")
    return tier


def _read_slab(store: SlabStore, name: str, offset: int, nbytes: int) -> bytes:
    out = bytearray(nbytes)
    store.read_slab_into(name, offset, memoryview(out))
    return bytes(out)


class TierTests:
    """Conformance tests for one :class:`~shoal.tiers.base.Tier` implementation."""

    kind: str | None = None
    """If set, the ``kind`` the tier must report."""

    @pytest.fixture
    def tier(self) -> Tier:
        """An empty tier of the implementation under test; subclasses override."""
        raise NotImplementedError("subclasses of TierTests provide a 'tier' fixture")

    def write_around(self, tier: Tier, path: str, data: bytes) -> None:
        """Create file ``path`` of ``tier`` with ``data`` directly in the backing storage."""
        raise NotImplementedError

    def read_around(self, tier: Tier, path: str) -> bytes | None:
        """Read file ``path`` of ``tier`` directly from the backing storage; ``None`` if absent."""
        raise NotImplementedError

    def files_around(self, tier: Tier) -> list[str]:
        """Every file physically under the tier's root (temporary files included), relative, sorted."""
        raise NotImplementedError

    # -- writing and reading --------------------------------------------------------------

    @pytest.mark.parametrize(
        "data",
        [
            b"hello",
            bytearray(b"hello"),
            memoryview(b"xhellox")[1:-1],
            [b"he", bytearray(b"l"), memoryview(b"lo")],
        ],
        ids=["bytes", "bytearray", "memoryview", "parts"],
    )
    def test_write_accepts_any_bytes_like_and_parts(self, tier: Tier, data: Data) -> None:
        assert tier.write("a/file.bin", data) == 5
        assert self.read_around(tier, "a/file.bin") == b"hello"
        assert tier.read("a/file.bin") == b"hello"

    def test_read_sees_what_was_written_around(self, tier: Tier) -> None:
        self.write_around(tier, "x/y/z.bin", b"ground truth")
        assert tier.read("x/y/z.bin") == b"ground truth"
        assert tier.exists("x/y/z.bin")

    def test_empty_file_round_trips(self, tier: Tier) -> None:
        assert tier.write("empty", b"") == 0
        assert tier.write("empty-parts", []) == 0
        assert tier.read("empty") == b""
        assert tier.read("empty-parts") == b""
        assert tier.info("empty").size == 0
        assert tier.read_range("empty", 0, 0) == b""

    def test_large_multipart_write_round_trips(self, tier: Tier) -> None:
        parts = [os.urandom(MiB) for _ in range(10)]
        assert tier.write("big", parts) == 10 * MiB
        expected = b"".join(parts)
        assert self.read_around(tier, "big") == expected
        assert tier.read("big") == expected
        assert tier.read_range("big", 3 * MiB - 7, MiB + 11) == expected[3 * MiB - 7 : 4 * MiB + 4]

    def test_write_replaces_existing_file(self, tier: Tier) -> None:
        tier.write("f", b"old content, longer")
        tier.write("f", b"new")
        assert tier.read("f") == b"new"
        assert self.read_around(tier, "f") == b"new"
        assert tier.list() == ["f"]

    def test_nested_directories_are_created(self, tier: Tier) -> None:
        tier.write("a/b/c/d/e.bin", b"deep")
        assert tier.read("a/b/c/d/e.bin") == b"deep"
        assert tier.list() == ["a/b/c/d/e.bin"]

    # -- ranges -----------------------------------------------------------------------------

    def test_read_range_returns_exact_bytes(self, tier: Tier) -> None:
        tier.write("r", bytes(range(256)))
        assert tier.read_range("r", 10, 5) == bytes(range(10, 15))
        assert tier.read_range("r", 0, 256) == bytes(range(256))
        assert tier.read_range("r", 256, 0) == b""

    def test_read_range_into_fills_the_callers_buffer(self, tier: Tier) -> None:
        tier.write("r", bytes(range(256)))
        out = bytearray(b"\xff" * 20)
        tier.read_range_into("r", 100, memoryview(out)[5:15])
        assert out == b"\xff" * 5 + bytes(range(100, 110)) + b"\xff" * 5

    @pytest.mark.parametrize(("offset", "length"), [(250, 10), (256, 1), (1000, 4)])
    def test_short_range_raises_tier_error(self, tier: Tier, offset: int, length: int) -> None:
        tier.write("r", bytes(range(256)))
        with pytest.raises(TierError) as err:
            tier.read_range("r", offset, length)
        assert "'r'" in str(err.value)
        with pytest.raises(TierError):
            tier.read_range_into("r", offset, memoryview(bytearray(length)))

    # -- missing files ----------------------------------------------------------------------

    def test_missing_file_raises_missing_file(self, tier: Tier) -> None:
        tier.write("present", b"x")
        with pytest.raises(MissingFile, match="nope"):
            tier.read("nope")
        with pytest.raises(MissingFile):
            tier.read_range("dir/nope", 0, 1)
        with pytest.raises(MissingFile):
            tier.read_range_into("nope", 0, memoryview(bytearray(1)))
        with pytest.raises(MissingFile):
            tier.info("nope")
        with pytest.raises(FileNotFoundError):  # MissingFile is a FileNotFoundError
            tier.read("present/under-a-file")
        assert not tier.exists("nope")

    def test_a_directory_is_not_a_file(self, tier: Tier) -> None:
        tier.write("d/f", b"x")
        assert not tier.exists("d")
        with pytest.raises(MissingFile):
            tier.info("d")
        with pytest.raises(MissingFile):
            tier.read("d")
        with pytest.raises(MissingFile):
            tier.read_range("d", 0, 1)

    # -- metadata and listing ---------------------------------------------------------------

    def test_info_reports_size(self, tier: Tier) -> None:
        tier.write("s/f", b"12345")
        info = tier.info("s/f")
        assert isinstance(info, FileInfo)
        assert (info.path, info.size) == ("s/f", 5)
        assert info.mtime >= 0.0

    def test_list_is_recursive_sorted_and_filtered_by_prefix(self, tier: Tier) -> None:
        for path in ["b", "a/2", "a/1", "a/sub/3", "ab", "c/d/e"]:
            tier.write(path, path.encode())
        assert tier.list() == ["a/1", "a/2", "a/sub/3", "ab", "b", "c/d/e"]
        assert tier.list("a/") == ["a/1", "a/2", "a/sub/3"]
        assert tier.list("a") == ["a/1", "a/2", "a/sub/3", "ab"]
        assert tier.list("a/sub/") == ["a/sub/3"]
        assert tier.list("nothing/") == []
        assert tier.list("c/d/") == ["c/d/e"]

    def test_list_sizes_is_the_listing_with_each_files_size(self, tier: Tier) -> None:
        for path, n in [("p/a.pack", 7), ("p/a.idx", 0), ("p/sub/b", 3), ("q", 5)]:
            tier.write(path, b"x" * n)
        assert tier.list_sizes("p/") == {"p/a.idx": 0, "p/a.pack": 7, "p/sub/b": 3}
        assert tier.list_sizes() == {p: tier.info(p).size for p in tier.list()}
        assert list(tier.list_sizes()) == tier.list()
        assert tier.list_sizes("nothing/") == {}
        with pytest.raises(InvalidName):
            tier.list_sizes("../")

    def test_list_of_an_empty_tier_is_empty(self, tier: Tier) -> None:
        assert tier.list() == []
        assert tier.list("steps/") == []

    def test_list_sees_files_written_around(self, tier: Tier) -> None:
        self.write_around(tier, "p/q", b"1")
        assert tier.list() == ["p/q"]

    # -- deleting ---------------------------------------------------------------------------

    def test_delete_removes_and_tolerates_missing(self, tier: Tier) -> None:
        tier.write("d/f", b"x")
        tier.write("d/g", b"y")
        tier.delete("d/f")
        assert not tier.exists("d/f")
        assert self.read_around(tier, "d/f") is None
        assert tier.list() == ["d/g"]
        tier.delete("d/f")
        tier.delete("never/there")

    def test_delete_many_removes_every_one_and_tolerates_missing(self, tier: Tier) -> None:
        for name in ("d/a", "d/b", "d/c", "e/a"):
            tier.write(name, b"x")
        tier.delete_many(["d/a", "e/a", "never/there", "d/c"])
        assert tier.list() == ["d/b"]
        assert self.read_around(tier, "d/a") is None
        tier.delete_many([])
        tier.delete_many(["d/b"])
        assert tier.list() == []

    # -- names ------------------------------------------------------------------------------

    @pytest.mark.parametrize("path", ["../x", "/abs", "a\x00b", "a/../b", "a//b", "", ".", "a/./b"])
    def test_unsafe_paths_are_refused(self, tier: Tier, path: str) -> None:
        with pytest.raises(InvalidName):
            tier.write(path, b"x")
        with pytest.raises(InvalidName):
            tier.read(path)
        with pytest.raises(InvalidName):
            tier.delete(path)
        with pytest.raises(InvalidName):
            tier.exists(path)
        assert self.files_around(tier) == []

    def test_list_prefix_is_validated(self, tier: Tier) -> None:
        with pytest.raises(InvalidName):
            tier.list("../")
        with pytest.raises(InvalidName):
            tier.list("/abs/")

    # -- atomicity --------------------------------------------------------------------------

    def test_failed_write_keeps_old_content_and_leaves_nothing(self, tier: Tier) -> None:
        tier.write("f", b"old")
        with pytest.raises(Boom):
            tier.write("f", _failing([b"new ", b"partial"]))
        assert tier.read("f") == b"old"
        assert tier.list() == ["f"]
        assert self.files_around(tier) == ["f"]

    def test_failed_first_write_creates_nothing(self, tier: Tier) -> None:
        with pytest.raises(Boom):
            tier.write("new/f", _failing([b"x" * MiB]))
        assert not tier.exists("new/f")
        assert tier.list() == []
        assert self.files_around(tier) == []

    # -- the object itself ------------------------------------------------------------------

    def test_capabilities_and_identity(self, tier: Tier) -> None:
        assert isinstance(tier.capabilities, TierCapabilities)
        assert isinstance(tier.url, str) and tier.url
        if self.kind is not None:
            assert tier.kind == self.kind
        assert tier.url in repr(tier)
        tier.close()
        tier.close()

    def test_capabilities_agree_with_the_class_and_the_registry(self, tier: Tier) -> None:
        caps = tier.capabilities
        declared = type(tier).capabilities  # what the registry reads for the kind
        assert isinstance(declared, TierCapabilities)
        assert (caps.persistent, caps.host_local, caps.read_preference) == (
            declared.persistent,
            declared.host_local,
            declared.read_preference,
        ), "an instance may refine only atomic_rename"
        assert isinstance(caps.read_preference, int) and caps.read_preference >= 0
        if tier.kind in TIER_CLASSES and tier_class(tier.kind) is type(tier):
            assert read_preference(tier.kind) == caps.read_preference

    def test_host_tiers_are_read_before_shared_storage(self, tier: Tier) -> None:
        caps = tier.capabilities
        shared = read_preference(kind_for(Role.SHARED))
        host_kinds = [k for k in BUILT_IN_TIERS if tier_class(k).capabilities.host_local]
        if caps.host_local:
            assert caps.read_preference < shared, "a host's own copy is read before shared storage"
        else:
            assert all(caps.read_preference >= read_preference(k) for k in host_kinds), (
                "a job-wide tier is never read before a host's own tiers"
            )

    # -- slabs (tiers that are a SlabStore) -------------------------------------------------

    def test_slab_is_writable_and_outlives_close(self, tier: Tier) -> None:
        store = _slabs(tier)
        slab = store.open_slab("slot-0", 10_000)
        assert isinstance(slab, SlabLike)
        assert slab.capacity >= 10_000
        buf = slab.buffer
        assert not buf.readonly and buf.nbytes == slab.capacity
        buf[:5] = b"hello"
        buf[9_995:10_000] = b"world"
        del buf
        assert _read_slab(store, "slot-0", 0, 5) == b"hello"
        slab.close()
        slab.close()
        assert slab.capacity == 0
        with pytest.raises(ValueError):
            _ = slab.buffer
        again = store.open_slab("slot-0", 100)
        assert again.capacity >= 10_000, "an existing slab is reused, not shrunk"
        assert bytes(again.buffer[:5]) == b"hello"
        assert _read_slab(store, "slot-0", 9_995, 5) == b"world"
        again.close()

    def test_slab_grows_keeping_its_content(self, tier: Tier) -> None:
        store = _slabs(tier)
        slab = store.open_slab("grow", 100)
        small = slab.capacity
        slab.buffer[:4] = b"keep"
        slab.ensure(small)  # no-op
        assert slab.capacity == small
        slab.ensure(small * 3 + 1)
        assert slab.capacity >= small * 3 + 1
        buf = slab.buffer
        assert buf.nbytes == slab.capacity and bytes(buf[:4]) == b"keep"
        buf[slab.capacity - 1 : slab.capacity] = b"z"
        del buf
        assert _read_slab(store, "grow", slab.capacity - 1, 1) == b"z"
        with pytest.raises(ValueError):
            slab.ensure(-1)
        slab.close()

    def test_exclusive_slab_is_never_an_existing_one(self, tier: Tier) -> None:
        store = _slabs(tier)
        fresh = store.open_slab("mine", 64, exclusive=True)
        fresh.close()
        with pytest.raises(OwnershipError, match="mine"):
            store.open_slab("mine", 64, exclusive=True)
        store.delete_slab("mine")
        store.open_slab("mine", 64, exclusive=True).close()

    def test_slabs_are_listed_apart_from_files_and_deleted(self, tier: Tier) -> None:
        store = _slabs(tier)
        assert store.list_slabs() == {}
        tier.write("f", b"file")
        for name in ("b", "a"):
            store.open_slab(name, 1000).close()
        slabs = store.list_slabs()
        assert list(slabs) == ["a", "b"]
        assert all(size >= 1000 for size in slabs.values())
        assert tier.list() == ["f"], "slabs are not files of the tier"
        store.delete_slab("a")
        store.delete_slab("a")  # missing is no error
        store.delete_slab("never-there")
        assert list(store.list_slabs()) == ["b"]
        with pytest.raises(MissingFile):
            store.read_slab_into("a", 0, memoryview(bytearray(1)))
        assert tier.read("f") == b"file"

    def test_slab_reads_past_the_end_are_missing(self, tier: Tier) -> None:
        store = _slabs(tier)
        slab = store.open_slab("s", 100)
        end = slab.capacity
        slab.close()
        assert _read_slab(store, "s", end - 3, 3) == bytes(3)
        with pytest.raises(MissingFile):
            store.read_slab_into("s", end - 3, memoryview(bytearray(4)))
        with pytest.raises(MissingFile):
            store.read_slab_into("nope", 0, memoryview(bytearray(1)))

    def test_a_lent_slab_is_its_bytes_read_only(self, tier: Tier) -> None:
        """A slab store that lends its slabs (:class:`~shoal.tiers.slabs.MappedSlabs`): the view is
        the slab's bytes, whether this process has it open or not, and cannot write them."""
        store = _slabs(tier)
        if not isinstance(store, MappedSlabs):
            pytest.skip(f"{type(tier).__name__} does not lend its slabs (not a MappedSlabs)")
        slab = store.open_slab("lent", 5000)
        slab.buffer[:5] = b"hello"
        slab.buffer[4995:5000] = b"world"
        for still_open in (True, False):
            view = store.map_slab("lent")
            assert view.readonly and view.nbytes >= 5000
            assert bytes(view[:5]) == b"hello" and bytes(view[4995:5000]) == b"world"
            assert bytes(view[:5000]) == _read_slab(store, "lent", 0, 5000)
            del view
            if still_open:
                slab.close()
        with pytest.raises(MissingFile):
            store.map_slab("nope")
        with pytest.raises(InvalidName):
            store.map_slab("../x")

    def test_a_lent_file_is_its_bytes_read_only(self, tier: Tier) -> None:
        """A tier that lends its files (:class:`~shoal.tiers.slabs.MappedFiles`): the view is the
        file's bytes, read-only; an absent file is :class:`~shoal.errors.MissingFile`."""
        if not isinstance(tier, MappedFiles):
            pytest.skip(f"{type(tier).__name__} does not lend its files (not a MappedFiles)")
        data = os.urandom(10_000)
        tier.write("packs/a.pack", data)
        tier.write("empty", b"")
        view = tier.map_file("packs/a.pack")
        assert view.readonly and bytes(view) == data
        assert bytes(tier.map_file("empty")) == b""
        del view
        with pytest.raises(MissingFile):
            tier.map_file("packs/nope.pack")
        with pytest.raises(InvalidName):
            tier.map_file("../outside")

    @pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden", "a\x00b"])
    def test_slab_names_are_identifiers(self, tier: Tier, name: str) -> None:
        store = _slabs(tier)
        with pytest.raises(InvalidName):
            store.open_slab(name, 10)
        with pytest.raises(InvalidName):
            store.delete_slab(name)
        with pytest.raises(InvalidName):
            store.read_slab_into(name, 0, memoryview(bytearray(1)))
        assert store.list_slabs() == {}

    def test_closing_the_tier_closes_its_slabs(self, tier: Tier) -> None:
        store = _slabs(tier)
        slab = store.open_slab("c", 10)
        slab.buffer[:1] = b"x"
        tier.close()
        assert slab.capacity == 0
        assert _read_slab(store, "c", 0, 1) == b"x"
