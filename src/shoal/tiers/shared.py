"""The ``shared`` tier: a parallel file system or an object store, through fsspec.

One class, two commit strategies chosen once from the URL's file system:

* a local path or ``file://`` URL (a mounted parallel file system) commits with
  :class:`~shoal.tiers.files.AtomicRenameCommit` (temporary sibling, fsync, rename,
  directory fsync); ``capabilities.atomic_rename`` is true;
* anything else (``s3://``, ``gs://``, ...) commits with :class:`ObjectPutCommit`: one
  streamed upload that the object store makes visible only when it completes, and
  that is aborted on error, so a failed write never leaves a partial object.

File systems are created with ``skip_instance_cache=True`` and, for remote stores,
``use_listings_cache=False``: no state is shared with other fsspec users through
fsspec's global caches, and listings always reflect what other hosts wrote.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, suppress
from typing import Any

import fsspec
import fsspec.utils
from fsspec.implementations.local import LocalFileSystem

from shoal.errors import InvalidName, MissingFile, TierError
from shoal.tiers.base import (
    CommitStrategy,
    Data,
    FileInfo,
    Tier,
    TierCapabilities,
    iter_byte_views,
    translate_errors,
)
from shoal.tiers.files import (
    AtomicRenameCommit,
    check_prefix,
    check_tier_path,
    is_temp_name,
    remove_empty_dirs_below,
)

try:  # botocore errors are not OSErrors; only s3fs users have botocore
    from botocore.exceptions import BotoCoreError, ClientError

    _REMOTE_ERRORS: tuple[type[BaseException], ...] = (OSError, BotoCoreError, ClientError)
except ImportError:  # pragma: no cover - depends on the environment
    _REMOTE_ERRORS = (OSError,)


_MAX_OFFSET = 2**63 - 1
"""The largest byte offset any file system or object store can serve."""


class ObjectPutCommit:
    """Commit by one streamed upload to an object store (single PUT, or multipart completed at close).

    Nothing is visible at the target until the file object's ``close`` completes the
    upload. On any exception before or during ``close`` the upload is discarded
    (``discard()`` aborts a multipart upload in s3fs) and the exception propagates.
    """

    atomic_rename = False

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        self.fs = fs

    def write(self, target: str, data: Data) -> int:
        """Upload ``data`` to ``target`` (a path in ``fs``); return the bytes written."""
        f = self.fs.open(target, "wb")
        total = 0
        try:
            for view in iter_byte_views(data):
                f.write(view)
                total += view.nbytes
            f.close()
        except BaseException:
            _discard(f)
            raise
        return total


def _discard(f: Any) -> None:
    """Abandon an unfinished upload so that nothing partial is ever committed (not even by ``__del__``)."""
    try:
        discard = getattr(f, "discard", None)
        if discard is not None:
            discard()
    except Exception:  # noqa: BLE001 - best effort: the original error is what matters
        pass
    finally:
        # fsspec files flush (i.e. commit) on close() and in __del__; mark it closed instead
        with suppress(AttributeError):
            f.closed = True


class FsspecTier(Tier):
    """A tier at an fsspec URL (``/mnt/lustre/ckpt``, ``s3://bucket/prefix``, ...); the job-wide tier."""

    kind = "shared"
    capabilities = TierCapabilities(persistent=True, host_local=False, atomic_rename=False, read_preference=2)
    """The kind's capabilities; an instance on a mounted file system commits by rename
    (``atomic_rename`` true), one on an object store does not."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        if not isinstance(url, str) or not url or "\x00" in url:
            raise InvalidName(f"shared tier URL {url!r} is empty or contains a NUL character")
        options: dict[str, Any] = dict(storage_options or {})
        options["skip_instance_cache"] = True
        if fsspec.utils.get_protocol(url) not in ("file", "local"):
            options.setdefault("use_listings_cache", False)
        try:
            fs, root = fsspec.url_to_fs(url, **options)
        except (ImportError, ValueError) as e:
            raise TierError(f"cannot open shared tier {url!r}: {e}") from e
        self._url = url.rstrip("/")
        self.fs: fsspec.AbstractFileSystem = fs
        self._root = root.rstrip("/")
        self._commit: CommitStrategy
        if isinstance(fs, LocalFileSystem):
            self._commit = AtomicRenameCommit(durable=True, failpoint="shared.write")
        else:
            self._commit = ObjectPutCommit(fs)
        self.capabilities = dataclasses.replace(
            FsspecTier.capabilities, atomic_rename=self._commit.atomic_rename
        )

    @classmethod
    def from_url(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> FsspecTier:
        return cls(url, storage_options)

    @property
    def url(self) -> str:
        return self._url

    def _abs(self, path: str) -> str:
        return f"{self._root}/{check_tier_path(path)}"

    def _translating(self, action: str, path: str, *, missing: bool = False) -> AbstractContextManager[None]:
        """:func:`~shoal.tiers.base.translate_errors` for the shared tier: botocore's errors too, each
        named by its type (a file system's missing file by its message alone)."""
        where = f"{path!r} in shared tier {self._url}"
        return translate_errors(action, where, missing=missing, catch=_REMOTE_ERRORS, describe=_describe)

    def write(self, path: str, data: Data) -> int:
        """Atomically write ``data`` (rename + fsync on a file system, one completed upload on objects)."""
        target = self._abs(path)
        with self._translating("write", path):
            return self._commit.write(target, data)

    def read(self, path: str) -> bytes:
        target = self._abs(path)
        with self._translating("read", path, missing=True):
            data = self.fs.cat_file(target)
        return bytes(data)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise ValueError(
                f"a tier range needs offset >= 0 and length >= 0, got offset={offset} length={length}"
            )
        if offset + length > _MAX_OFFSET:
            raise TierError(
                f"cannot read {path!r} in shared tier {self._url}: offset {offset} + length {length} is "
                f"past the largest file offset ({_MAX_OFFSET}); the metadata that asked for it is corrupt"
            )
        target = self._abs(path)
        with self._translating("read", path, missing=True):
            if length == 0:  # an empty HTTP range is invalid; only check the range is inside the file
                size = self._size(target, path)
                data = b""
                if offset > size:
                    raise self._short(path, offset, length, 0)
            else:
                data = self.fs.cat_file(target, start=offset, end=offset + length)
        if len(data) != length:
            raise self._short(path, offset, length, len(data))
        return bytes(data)

    def _short(self, path: str, offset: int, length: int, got: int) -> TierError:
        return TierError(
            f"short read of {path!r} in shared tier {self._url}: asked for {length} bytes at offset "
            f"{offset}, got {got}"
        )

    def _size(self, target: str, path: str) -> int:
        info = self.fs.info(target)
        if info.get("type") != "file":
            raise MissingFile(f"{path!r} in shared tier {self._url} is a directory, not a file")
        return int(info["size"])

    def exists(self, path: str) -> bool:
        target = self._abs(path)
        try:
            with self._translating("stat", path, missing=True):
                return bool(self.fs.info(target).get("type") == "file")
        except MissingFile:
            return False

    def info(self, path: str) -> FileInfo:
        target = self._abs(path)
        with self._translating("stat", path, missing=True):
            info = self.fs.info(target)
        if info.get("type") != "file":
            raise MissingFile(f"{path!r} in shared tier {self._url} is a directory, not a file")
        return FileInfo(path=path, size=int(info["size"]), mtime=_mtime(info))

    def list(self, prefix: str = "") -> list[str]:
        """Every file whose relative path starts with ``prefix`` (pass ``"dir/"`` for a directory)."""
        return sorted(self._find(prefix))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """:meth:`list` with each file's size, from the same listing (no request per file)."""
        found = self._find(prefix)
        return {rel: found[rel] for rel in sorted(found)}

    def _find(self, prefix: str) -> dict[str, int]:
        check_prefix(prefix)
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = f"{self._root}/{base}" if base else self._root
        with self._translating("list", prefix or "."):
            try:
                found = self.fs.find(start, detail=True)
            except FileNotFoundError:
                return {}
        cut = len(self._root) + 1
        out: dict[str, int] = {}
        for full, info in found.items():
            full = full.rstrip("/")
            if not full.startswith(self._root + "/") or info.get("type", "file") != "file":
                continue
            rel = full[cut:]
            if rel.startswith(prefix) and not is_temp_name(rel.rsplit("/", 1)[-1]):
                out[rel] = int(info.get("size") or 0)
        return out

    def delete(self, path: str) -> None:
        target = self._abs(path)
        with self._translating("delete", path), suppress(FileNotFoundError):
            self.fs.rm_file(target)

    def delete_many(self, paths: Sequence[str]) -> None:
        """One batch delete where the file system has one (an object store's: a request per
        thousand keys); a mounted file system deletes file by file."""
        if isinstance(self.fs, LocalFileSystem) or len(paths) < 2:
            super().delete_many(paths)
            return
        targets = [self._abs(p) for p in paths]
        with self._translating("delete", f"{len(paths)} files ({paths[0]} ...)"):
            try:
                self.fs.rm(targets)
            except FileNotFoundError:  # a file system whose batch stops at a missing file
                missing = True
            else:
                missing = False
        if missing:  # one by one, each missing file skipped: none of the others left behind
            super().delete_many(paths)

    def remove_empty_dirs(self, prefix: str) -> None:
        """Remove the empty directories at and below ``prefix`` (a relative directory path).

        Retention calls it after deleting a step's files, so that ``steps/`` does not fill
        with empty directories. Only a mounted file system has directories to remove; on an
        object store this does nothing. Symbolic links are never followed or removed.
        """
        if not isinstance(self.fs, LocalFileSystem):
            return
        with self._translating("remove empty directories under", prefix):
            remove_empty_dirs_below(self._abs(prefix.rstrip("/")))


def _describe(err: BaseException) -> str:
    """A backend error for a message: ``str(err)`` for a missing file or directory, else with its type."""
    if isinstance(err, FileNotFoundError | NotADirectoryError | IsADirectoryError):
        return str(err)
    return f"{type(err).__name__}: {err}"


def _mtime(info: Mapping[str, Any]) -> float:
    """Modification time from an fsspec info dict (keys differ per backend); 0.0 when unknown."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        value = info.get(key)
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, dt.datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0
