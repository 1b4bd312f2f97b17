"""Reading a checkpoint for export: its manifest, DCP metadata and items as tensors; output directories."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from shoal.cli.common import CliError, missing_step
from shoal.engine.store import resolve_manifest
from shoal.errors import CheckpointNotFound, FormatError
from shoal.format.dcp_codec import decode_metadata
from shoal.format.manifest import ItemRecord, Manifest
from shoal.tiers.base import Tier


def load_source(tier: Tier, step: int | None) -> tuple[Manifest, Metadata]:
    """The manifest of ``step`` (None: the one ``LATEST`` names) and its DCP metadata."""
    try:
        manifest = resolve_manifest(tier, step)
    except CheckpointNotFound as e:
        if step is None:
            raise
        raise missing_step(tier, step) from e
    if manifest.dcp is None:
        raise FormatError(
            f"step {manifest.step} under {tier.url} has no DCP metadata in its manifest; cannot export it"
        )
    return manifest, decode_metadata(manifest.dcp)


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
    out_dir.mkdir(parents=True, exist_ok=True)
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
