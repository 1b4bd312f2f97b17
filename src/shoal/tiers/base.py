"""The narrow interface every tier implements.

A tier is a place bytes live: ``dram`` (host memory under ``/dev/shm``), ``local``
(node-local disk) or ``shared`` (a parallel file system or an object store through
fsspec). A tier instance is rooted at one directory or prefix, normally
``<root>/<job>`` (shared) or ``<root>/<job>/<host_id>`` (dram, local); every path
passed to it is relative to that root, POSIX-style, and checked by
:func:`shoal.format.names.check_relpath`.

Contract shared by every implementation (checked by
``shoal.testing.TierTests``):

* ``write`` is atomic and durable: a reader sees either the old file or the
  complete new one, never a prefix, and when ``write`` returns the bytes are
  fsync'd (POSIX, with the directory) or upload-complete (object stores) where the
  tier is persistent. ``write`` replaces an existing file.
* ``read``/``read_range`` return exactly the bytes asked for or raise: a missing
  file is :class:`shoal.errors.MissingFile`, a short range is
  :class:`shoal.errors.TierError`. Tiers never verify digests; callers do.
* ``delete`` of a missing file is not an error.
* ``list(prefix)`` returns every file below ``prefix`` (recursively), as relative
  paths, sorted; temporary files of writes in progress are never listed.
"""

from __future__ import annotations

import abc
import errno
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, cast

from shoal.errors import ConfigError, FormatError, MissingFile, ShoalError, TierError

BytesLike = bytes | bytearray | memoryview
Data = BytesLike | Iterable[BytesLike]
"""What ``Tier.write`` accepts: one bytes-like object, or an iterable of them written back to back."""


def iter_byte_views(data: Data) -> Iterator[memoryview]:
    """Yield ``data`` as flat, C-contiguous byte views (format ``B``), without copying.

    ``data`` is one object supporting the buffer protocol (bytes, bytearray, memoryview,
    a numpy array, ...) or an iterable of them. Typed views (``memoryview`` of floats) are
    cast to bytes; a non-contiguous view is the only case that is copied. The iterable is
    consumed lazily, so an exception it raises reaches the caller mid-write.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        try:
            single = memoryview(cast(Any, data))
        except TypeError:
            for part in data:
                yield as_byte_view(part)
            return
        yield as_byte_view(single)
        return
    yield as_byte_view(data)


def as_byte_view(obj: Any) -> memoryview:
    """Return ``obj`` (any buffer) as a flat, format-``B`` memoryview; copy only if not contiguous."""
    view = obj if isinstance(obj, memoryview) else memoryview(obj)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    if view.c_contiguous:
        return view.cast("B")
    return memoryview(view.tobytes())


class CommitStrategy(Protocol):
    """How a tier makes one file appear whole or not at all (chosen once per tier).

    Implementations: :class:`shoal.tiers.files.AtomicRenameCommit` (temporary sibling,
    fsync, rename, directory fsync) and :class:`shoal.tiers.shared.ObjectPutCommit`
    (one streamed PUT or multipart upload completed at close, aborted on error).
    """

    @property
    def atomic_rename(self) -> bool:
        """Whether the commit is a rename of a temporary file (``TierCapabilities.atomic_rename``)."""
        ...

    def write(self, target: str, data: Data) -> int:
        """Write ``data`` to ``target`` (a path in the strategy's namespace), atomically; return bytes.

        On any exception nothing new is visible at ``target`` (an earlier file stays intact)
        and the exception propagates unchanged (``OSError`` s are wrapped by the tier).
        """
        ...


_MISSING_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR)
_MISSING_TYPES = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


def describe_os_error(err: BaseException) -> str:
    """``[ENOSPC] No space left on device (/the/file)``: an ``OSError``'s errno name, message and file."""
    if not isinstance(err, OSError):
        return f"{type(err).__name__}: {err}"
    return f"[{errno.errorcode.get(err.errno or 0, err.errno)}] {err.strerror or err}" + (
        f" ({err.filename})" if err.filename else ""
    )


@contextmanager
def translate_errors(
    action: str,
    where: str,
    *,
    missing: bool = False,
    catch: tuple[type[BaseException], ...] = (OSError,),
    describe: Callable[[BaseException], str] = describe_os_error,
    classify: Callable[[BaseException], ShoalError | None] | None = None,
) -> Iterator[None]:
    """Turn a backend error raised while doing ``action`` on ``where`` into shoal's.

    ``where`` names the file for messages (``"'a/b' in local tier /root"``). Shoal's own errors
    pass unchanged; an exception of ``catch`` (``OSError`` by default) becomes:

    * with ``missing``, for a missing file, a missing directory on the way or a directory in the
      file's place (``ENOENT``/``ENOTDIR``/``EISDIR`` or their ``OSError`` subclasses),
      :class:`~shoal.errors.MissingFile`: ``cannot <action> <where>: no such file`` (``it is a
      directory``);
    * what ``classify`` returns for it, when that is not None (the dram tier's full tmpfs);
    * else :class:`~shoal.errors.TierError`: ``could not <action> <where>: <describe(err)>``.

    The original exception is chained (``from``) to the one raised.
    """
    try:
        yield
    except ShoalError:
        raise
    except catch as e:
        if (
            missing
            and isinstance(e, OSError)
            and (isinstance(e, _MISSING_TYPES) or e.errno in _MISSING_ERRNOS)
        ):
            directory = isinstance(e, IsADirectoryError) or e.errno == errno.EISDIR
            what = "it is a directory" if directory else "no such file"
            raise MissingFile(f"cannot {action} {where}: {what}") from e
        special = classify(e) if classify is not None else None
        if special is not None:
            raise special from e
        raise TierError(f"could not {action} {where}: {describe(e)}") from e


AUTO = -1
"""``TierCapabilities.read_preference`` default: derive the preference from the other flags."""


def derived_read_preference(*, persistent: bool, host_local: bool) -> int:
    """The read preference a tier gets when it does not state one.

    0 for a volatile host tier (memory), 1 for a persistent host tier (node-local disk), 2
    for a job-wide tier (shared storage, reached over the network).
    """
    if not host_local:
        return 2
    return 1 if persistent else 0


@dataclass(frozen=True)
class TierCapabilities:
    """What a tier can promise; callers branch on these flags, never on the class.

    Every tier class states its capabilities as a class attribute (what the registry reads
    for a kind, e.g. :func:`shoal.tiers.read_preference`); an instance may refine only
    ``atomic_rename`` (the shared tier's depends on its URL).
    """

    persistent: bool
    """Bytes survive a reboot of the host (false for ``dram``)."""
    host_local: bool
    """The tier belongs to one host (``dram``, ``local``) rather than the whole job."""
    atomic_rename: bool
    """Commits by write-to-temporary then rename (POSIX); false for single-PUT object stores."""
    read_preference: int = AUTO
    """Where the tier comes when a chunk can be read from several (lower is read first):
    ``dram`` 0, ``local`` 1, ``shared`` 2. :data:`AUTO` (the default) derives it from
    ``persistent`` and ``host_local`` (:func:`derived_read_preference`)."""

    def __post_init__(self) -> None:
        for name in ("persistent", "host_local", "atomic_rename"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"TierCapabilities.{name} must be True or False, got {getattr(self, name)!r}"
                )
        pref = self.read_preference
        if isinstance(pref, bool) or not isinstance(pref, int) or (pref < 0 and pref != AUTO):
            raise ConfigError(
                f"TierCapabilities.read_preference must be an int >= 0 (lower is read first) or AUTO, "
                f"got {pref!r}"
            )
        if pref == AUTO:
            derived = derived_read_preference(persistent=self.persistent, host_local=self.host_local)
            object.__setattr__(self, "read_preference", derived)


@dataclass(frozen=True)
class FileInfo:
    """Size and modification time of one file in a tier."""

    path: str
    size: int
    mtime: float


class Tier(abc.ABC):
    """Abstract tier. Implementations are small modules registered in ``shoal.tiers``."""

    kind: str = "abstract"
    capabilities: TierCapabilities

    @classmethod
    def from_url(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> Tier:
        """Open a tier of this class at ``url``; what :func:`shoal.tiers.open_tier` calls.

        The default passes ``url`` to the constructor and refuses storage options, which
        only tiers backed by fsspec understand (they override this).
        """
        if storage_options:
            raise ConfigError(
                f"the {cls.kind!r} tier at {url!r} takes no storage options; got {sorted(storage_options)}"
            )
        return cls(url)  # type: ignore[call-arg]

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where the tier's root is, for messages (a path or ``s3://bucket/prefix``)."""

    @abc.abstractmethod
    def write(self, path: str, data: Data) -> int:
        """Atomically and durably write ``data`` to ``path``; return the bytes written."""

    @abc.abstractmethod
    def read(self, path: str) -> bytes:
        """Return the whole file."""

    def read_small(self, path: str, limit: int, what: str = "metadata file") -> bytes:
        """Read a whole metadata file that must hold at most ``limit`` bytes.

        Checks the size before reading (so a huge file is never loaded whole) and the
        length of what came back; a larger file is a :class:`~shoal.errors.FormatError`
        naming the file, its size and the limit. A missing file is
        :class:`~shoal.errors.MissingFile`, as for :meth:`read`.
        """
        size = self.info(path).size
        if size > limit:
            raise FormatError(
                f"{what} {self.url}/{path} is {size} bytes, more than the {limit} bytes such a file may hold"
            )
        data = self.read(path)
        if len(data) > limit:
            raise FormatError(
                f"{what} {self.url}/{path} grew to {len(data)} bytes while read (limit {limit} bytes)"
            )
        return data

    @abc.abstractmethod
    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """Return ``length`` bytes starting at ``offset``; raise if fewer are there."""

    def read_range_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` (a writable byte view) from ``offset``; raise if fewer bytes are there.

        Implementations override this to read straight into the caller's buffer
        (``os.preadv`` on POSIX) and skip a copy; the default reads then copies.
        """
        out[:] = self.read_range(path, offset, out.nbytes)

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether ``path`` names a file in this tier."""

    @abc.abstractmethod
    def info(self, path: str) -> FileInfo:
        """Size and mtime of ``path``; :class:`shoal.errors.MissingFile` if absent."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Every file below ``prefix`` (``""`` for the whole tier), relative, sorted."""

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """Every file below ``prefix`` (as :meth:`list` names them) with its size in bytes.

        This default asks :meth:`info` of each file (one that vanished in between is left out);
        a tier whose listing carries sizes (a directory scan, an object store's listing)
        overrides it with that one listing.
        """
        out: dict[str, int] = {}
        for path in self.list(prefix):
            try:
                out[path] = self.info(path).size
            except MissingFile:
                continue
        return out

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Remove ``path``; a missing file is not an error."""

    def delete_many(self, paths: Sequence[str]) -> None:
        """Remove every one of ``paths`` (missing ones are not errors), in no promised order.

        This default deletes them one by one; an object store overrides it with its batch delete
        (one request per thousand keys), so that retention costs a few round trips, not one per
        file, when the link to storage is slow. Callers that need an order make one call per stage.
        """
        for path in paths:
            self.delete(path)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (open mappings, connections). Idempotent."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
