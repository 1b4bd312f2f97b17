"""Reading a checkpoint for export: its manifest, DCP metadata and items as tensors; output directories."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from shoal.cli.common import CliError, directory_at, missing_step, read_pointer_strictly
from shoal.errors import CheckpointNotFound, FormatError, MissingFile, ShoalError
from shoal.format import layout
from shoal.format.crosscheck import check_against_dcp
from shoal.format.dcp_codec import decode_metadata
from shoal.format.manifest import ItemRecord, Manifest
from shoal.records.store import ItemReader, list_steps, resolve_manifest
from shoal.tiers.base import Tier


def load_source(tier: Tier, step: int | None) -> tuple[Manifest, Metadata]:
    """The manifest of ``step`` (None: the one ``LATEST`` names) and its DCP metadata.

    Before anything is exported, the manifest's items are cross-checked against its DCP
    metadata (kind, dtype, shape, byte size; :func:`~shoal.format.crosscheck.check_against_dcp`),
    so a damaged or forged manifest fails here, naming the file, the item and both values.
    """
    try:
        if step is not None:  # a directory in the way of its commit record is not "uncommitted"
            read_pointer_strictly(tier, layout.commit_path(step))
        manifest = resolve_manifest(tier, step)
    except CheckpointNotFound as e:
        clearer = _not_found(tier, step, e)
        if clearer is e:
            raise
        raise clearer from e
    where = f"{tier.url}/{layout.manifest_path(manifest.step)}"
    if manifest.dcp is None:
        raise FormatError(f"manifest {where} has no DCP metadata; cannot export step {manifest.step}")
    try:
        md = decode_metadata(manifest.dcp)
        check_against_dcp(manifest)
    except FormatError as e:
        raise type(e)(f"manifest {where}: {e}") from e
    return manifest, md


def _not_found(tier: Tier, step: int | None, error: CheckpointNotFound) -> ShoalError:
    """The clearest error for a checkpoint that could not be found (``error`` itself if none clearer)."""
    path = layout.LATEST if step is None else layout.manifest_path(step)
    if directory_at(tier, path):
        return FormatError(f"{tier.url}/{path} is a directory, not a file; move it away")
    if step is None:
        return error
    if step not in list_steps(tier):
        return missing_step(tier, step)
    return CheckpointNotFound(
        f"step {step} under {tier.url} has a commit record but no manifest ({tier.url}/{path} does not exist)"
    )


def storage_keys(manifest: Manifest, md: Metadata) -> dict[MetadataIndex, str]:
    """DCP's ``storage_data``: every write item's index -> the shoal item holding its bytes (checked)."""
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise FormatError(f"step {manifest.step}: DCP metadata has no storage_data")
    out: dict[MetadataIndex, str] = {}
    for index, key in storage.items():
        if not isinstance(key, str) or key not in manifest.items:
            raise FormatError(
                f"step {manifest.step}: DCP item {index.fqn!r} (offset {index.offset}) has no stored item "
                f"in the manifest (storage key {key!r})"
            )
        out[index] = key
    return out


def check_stored(tier: Tier, manifest: Manifest, keys: Iterable[str]) -> None:
    """Every chunk of items ``keys`` is placed by ``manifest``, in a pack of the size it records on ``tier``.

    Checked before an export writes anything: a partial manifest (a host tier's copy), a
    missing pack and a truncated or replaced one each fail here, naming the file.
    """
    where = f"{tier.url}/{layout.manifest_path(manifest.step)}"
    first_user: dict[str, str] = {}  # pack id -> the first item that needs it
    for key in dict.fromkeys(keys):
        for i, dig in enumerate(manifest.items[key].chunks):
            loc = manifest.locations.get(dig)
            if loc is None:
                raise FormatError(
                    f"manifest {where} is partial (a host tier's copy): item {key!r} chunk {i} has no "
                    f"location under {tier.url}; export from the shared tier, which holds whole checkpoints"
                )
            first_user.setdefault(loc.pack, key)
    for pack_id, key in sorted(first_user.items()):
        path = f"{tier.url}/{layout.pack_path(pack_id)}"
        try:
            size = tier.info(layout.pack_path(pack_id)).size
        except MissingFile as e:
            raise MissingFile(
                f"pack {path} is missing (item {key!r} of step {manifest.step} needs it); "
                f"shoal verify {tier.url} lists everything it held"
            ) from e
        expected = manifest.packs[pack_id].size
        if size != expected:
            raise FormatError(
                f"pack {path} is {size} bytes, manifest {where} says {expected} (truncated or replaced?); "
                f"shoal verify {tier.url} lists what it affects"
            )


READ_BATCH = 64 << 20
"""Bytes of items an export reads with one fetch (per contiguous run of each pack) at most."""


def batches(sizes: Iterable[tuple[str, int]], limit: int = READ_BATCH) -> Iterator[list[str]]:
    """The names of ``(name, bytes)`` in order, in lists of at most ``limit`` bytes (a bigger one alone)."""
    batch: list[str] = []
    used = 0
    for name, n in sizes:
        if batch and used + n > limit:
            yield batch
            batch, used = [], 0
        batch.append(name)
        used += n
    if batch:
        yield batch


def read_in_batches(reader: ItemReader, keys: Iterable[str]) -> Iterator[tuple[str, bytearray]]:
    """Each item of ``keys`` (in order) with its verified bytes, read :data:`READ_BATCH` bytes at a time."""
    items = reader.manifest.items
    for batch in batches((key, items[key].nbytes) for key in keys):
        yield from reader.read_items(batch).items()


def item_dtype(rec: ItemRecord) -> torch.dtype:
    dtype = vars(torch).get(rec.dtype or "")
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"item {rec.key!r}: dtype {rec.dtype!r} is not a torch dtype known to this torch")
    return dtype


def item_tensor(data: bytearray, rec: ItemRecord) -> torch.Tensor:
    """The tensor whose raw C-order bytes are ``data`` (shares ``data``'s memory; no copy)."""
    dtype = item_dtype(rec)
    shape = tuple(rec.shape or ())
    numel = 1
    for n in shape:
        numel *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize != len(data):
        raise FormatError(
            f"item {rec.key!r}: {len(data)} bytes cannot be a {rec.dtype} tensor of shape {list(shape)}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


@contextmanager
def output_dir(out_dir: Path, stale: Iterable[str], *, overwrite: bool) -> Iterator[list[Path]]:
    """Check and create ``out_dir``, removing the ``stale`` names in it; yield a list of files to write.

    A directory that holds anything is refused unless ``overwrite``. If the body raises, every
    file added to the list (and its ``.tmp``) is removed, and the directory too if created here,
    so a failed export leaves nothing that looks like a result.
    """
    if "://" in str(out_dir):
        raise CliError(f"export writes to a local directory; got {str(out_dir)!r}")
    if out_dir.exists() and not out_dir.is_dir():
        raise CliError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise CliError(f"{out_dir} is not empty; choose an empty directory or pass --overwrite")
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason = e.strerror or str(e)
        raise CliError(f"cannot create the output directory {out_dir}: {reason}; choose another") from e
    for name in stale:
        (out_dir / name).unlink(missing_ok=True)
    written: list[Path] = []
    try:
        yield written
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
            path.with_name(path.name + ".tmp").unlink(missing_ok=True)
        if created:
            with suppress(OSError):
                out_dir.rmdir()
        raise


def write_durably(path: Path, write: Callable[[Any], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
