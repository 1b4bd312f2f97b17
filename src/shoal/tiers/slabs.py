"""The slab capability: tiers that hand out staging slabs, as protocols callers check with ``isinstance``.

A *slab* is a named, growable, writable buffer a tier keeps outside its files: the stager
copies a rank's items into one and the pipeline reads them from there (docs/design.md section 4).
:class:`shoal.tiers.dram.DramTier` is the built-in slab store (one pre-faulted shared-memory
file per slab); any tier can be one by offering the methods of :class:`SlabStore`. Callers
ask ``isinstance(tier, SlabStore)``, never for a class or with ``getattr``.

Contract (checked by :class:`shoal.testing.TierTests` for every tier that is a slab store):

* slab names are identifiers (:func:`shoal.format.names.check_identifier`); another name is
  :class:`~shoal.errors.InvalidName`;
* ``open_slab(name, nbytes)`` returns a slab of at least ``nbytes``; an existing slab of that
  name is reused with its content, unless ``exclusive``: then it must not exist yet
  (:class:`~shoal.errors.OwnershipError`);
* a slab's content outlives :meth:`SlabLike.close` and the store (the next ``open_slab`` of the
  name, :meth:`SlabStore.read_slab_into`, another process) until :meth:`SlabStore.delete_slab`;
* slabs are not files of the tier: ``Tier.list`` never shows them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from shoal.errors import ConfigError


@runtime_checkable
class SlabLike(Protocol):
    """One slab, open in this process. Not thread-safe: one owner (a stager slot) uses it."""

    @property
    def capacity(self) -> int:
        """Bytes the slab holds now (what was asked for, possibly rounded up); 0 once closed."""
        ...

    @property
    def buffer(self) -> memoryview:
        """A writable, flat byte view of the whole slab (``capacity`` bytes); ``ValueError`` once closed."""
        ...

    def ensure(self, nbytes: int) -> None:
        """Grow to at least ``nbytes``, keeping the content; no-op if already that big.

        Views from earlier ``buffer`` calls may keep the old, smaller buffer alive; take a
        fresh one after growing. Running out of room is a :class:`~shoal.errors.ShoalError`
        (:class:`~shoal.errors.InsufficientMemory` for memory) and leaves the slab as it was.
        """
        ...

    def close(self) -> None:
        """Release this process's hold on the slab; its content stays in the store. Idempotent."""
        ...


@runtime_checkable
class SlabStore(Protocol):
    """A tier that keeps named slabs beside its files (the DRAM tier; what the staging role needs)."""

    def open_slab(self, name: str, nbytes: int, *, exclusive: bool = False) -> SlabLike:
        """Open slab ``name`` with at least ``nbytes``, creating it if missing (see the module contract)."""
        ...

    def read_slab_into(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from slab ``name`` at ``offset``, without opening it for writing.

        :class:`~shoal.errors.MissingFile` if there is no such slab or it ends before the range.
        """
        ...

    def list_slabs(self) -> dict[str, int]:
        """Every slab in the store, name -> bytes it holds, sorted by name."""
        ...

    def delete_slab(self, name: str) -> None:
        """Remove slab ``name`` (open slabs of it keep their memory until closed); missing is no error."""
        ...


@runtime_checkable
class MappedSlabs(Protocol):
    """A slab store that also lends a slab's bytes without a copy (the DRAM tier): a restore
    from DRAM then reads each byte once, into its destination."""

    def map_slab(self, name: str) -> memoryview:
        """A read-only view of all of slab ``name``, valid while it is held (the mapping goes with
        the last view of it); :class:`~shoal.errors.MissingFile` if there is no such slab."""
        ...


@runtime_checkable
class MappedFiles(Protocol):
    """A host tier that also lends a file's bytes without a copy (the ``local`` and ``dram``
    tiers): a restore then verifies a chunk of a partner copy where it lies and sends it from
    there, with no buffer of its own. Only a tier private to this host and user lends its files
    (a mapped file that another process truncated would fault)."""

    def map_file(self, path: str) -> memoryview:
        """A read-only view of all of file ``path``, valid while it is held;
        :class:`~shoal.errors.MissingFile` if there is no such file."""
        ...


def require_slabs(tier: object, action: str) -> SlabStore:
    """``tier`` as a :class:`SlabStore`, or :class:`~shoal.errors.ConfigError` saying it keeps no slabs."""
    if not isinstance(tier, SlabStore):
        kind, url = getattr(tier, "kind", type(tier).__name__), getattr(tier, "url", repr(tier))
        raise ConfigError(
            f"cannot {action} on the {kind} tier at {url}: it keeps no slabs (it is not a SlabStore; "
            "staging needs a tier that is, such as the dram tier)"
        )
    return tier


__all__ = ["MappedFiles", "MappedSlabs", "SlabLike", "SlabStore", "require_slabs"]
