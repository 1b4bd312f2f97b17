"""``shoal export --format safetensors``: a checkpoint's model (or other tensors) as safetensors files.

A tensor DCP saved in shards (several write items for one FQN, each at its offsets in
the full tensor) is assembled into the whole tensor; the chunks must cover it exactly.
One ``model.safetensors``, or, when the tensors exceed ``max_shard_size``,
``model-00001-of-0000N.safetensors`` files and a ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``) as Hugging Face
lays them out.

What is exported: by default the model only, the tensors under the state dict's top-level
``model`` key (DCP flattens ``{"model": {...}, "optim": {...}}`` to ``model.layers.0.weight``,
``optim.state.0.exp_avg``, ...), named without the ``model.`` prefix, so that the names are the
keys of ``model.state_dict()``; a checkpoint without a ``model`` key is refused, naming its
top-level keys. ``strip_prefix`` chooses another prefix (the tensors whose flattened name starts
with it, named without it); ``strip_prefix=""`` exports every tensor (the optimizer's too)
under its flattened DCP name.

What safetensors cannot hold is skipped and named through ``warn`` (or, with
``strict``, refused with :class:`~shoal.cli.common.CliError`): objects that are not
tensors (``epoch``, an optimizer's ``lr``), and tensors of dtypes the installed
safetensors has no code for (``complex128``, ``float8_e8m0fnu``, ... depending on its
version). Shards are held in memory one at a time.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from shoal.cli.common import CliError
from shoal.cli.source import batches, item_tensor, output_dir, storage_keys, write_durably
from shoal.errors import FormatError
from shoal.format.manifest import Manifest
from shoal.records.store import ItemReader
from shoal.tiers.base import Tier

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MODEL_KEY = "model"
"""The top-level key of the state dict exported by default (``{"model": model.state_dict(), ...}``)."""
CHOOSE = (
    "--strip-prefix KEY. (the tensors under KEY, named without it) or --all (every tensor, names as stored)"
)
"""How to choose what to export instead, for messages."""


def _safetensors() -> ModuleType:
    try:
        import safetensors.torch
    except ImportError as e:
        raise CliError(
            "exporting safetensors needs the safetensors package: pip install safetensors "
            "(or pip install 'shoal[dev]')"
        ) from e
    return safetensors.torch


@functools.cache
def supported_dtype(dtype: torch.dtype) -> bool:
    """Whether the installed safetensors can store ``dtype`` (asked by saving an empty tensor)."""
    try:
        _safetensors().save({"probe": torch.empty(0, dtype=dtype)})
    except Exception:  # noqa: BLE001 - safetensors raises various errors for an unknown dtype
        return False
    return True


def _nbytes(meta: TensorStorageMetadata) -> int:
    numel = 1
    for n in meta.size:
        numel *= n
    return numel * torch.empty((), dtype=meta.properties.dtype).element_size()


def plan_shards(sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
    """Tensor names in shards of at most ``max_shard_size`` bytes (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


Keys = dict[tuple[str, tuple[int, ...] | None], str]
"""``(fqn, offsets)`` of each DCP write item -> the stored item holding it."""


def _parts(
    manifest: Manifest, keys: Keys, fqn: str, meta: TensorStorageMetadata
) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    """``(offsets, sizes, stored item)`` of each DCP chunk of tensor ``fqn``."""
    parts = []
    for c in meta.chunks:
        offsets = tuple(c.offsets)
        key = keys.get((fqn, offsets))
        if key is None:
            raise FormatError(
                f"step {manifest.step}: tensor {fqn!r} has no stored item for its chunk at {list(offsets)}"
            )
        parts.append((offsets, tuple(c.sizes), key))
    return parts


def _assemble(
    manifest: Manifest,
    fqn: str,
    meta: TensorStorageMetadata,
    parts: list[tuple[tuple[int, ...], tuple[int, ...], str]],
    data: dict[str, bytearray],
) -> torch.Tensor:
    """The whole tensor ``fqn``: its one stored item, or its DCP chunks (in ``data``) copied into place."""

    def chunk_tensor(offsets: tuple[int, ...], sizes: tuple[int, ...], key: str) -> torch.Tensor:
        part = item_tensor(data[key], manifest.items[key])
        if tuple(part.shape) != sizes or part.dtype != meta.properties.dtype:
            raise FormatError(
                f"step {manifest.step}: tensor {fqn!r}: chunk at {list(offsets)} is stored as "
                f"{part.dtype} {list(part.shape)}, the DCP metadata says "
                f"{meta.properties.dtype} {list(sizes)}"
            )
        return part

    size = tuple(meta.size)
    if len(parts) == 1 and parts[0][:2] == ((0,) * len(size), size):
        return chunk_tensor(*parts[0])
    full = torch.empty(size, dtype=meta.properties.dtype)
    covered = 0
    for offsets, sizes, key in parts:
        part = chunk_tensor(offsets, sizes, key)
        target = full
        for dim, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
            target = target.narrow(dim, o, n)
        target.copy_(part)
        covered += part.numel()
    if covered != full.numel():
        raise FormatError(
            f"step {manifest.step}: tensor {fqn!r} {list(size)}: its {len(parts)} chunks hold {covered} "
            f"elements, the tensor has {full.numel()}; cannot assemble it"
        )
    return full


def _read_shard(
    reader: ItemReader,
    keys: Keys,
    tensors: dict[str, tuple[str, TensorStorageMetadata]],
    shard: list[str],
    advance: Callable[[int], None],
) -> dict[str, torch.Tensor]:
    """The tensors of ``shard`` by name, read :data:`READ_BATCH` bytes of stored items at a time."""
    manifest = reader.manifest
    parts = {name: _parts(manifest, keys, *tensors[name]) for name in shard}
    stored = ((name, sum(manifest.items[k].nbytes for *_, k in parts[name])) for name in shard)
    out: dict[str, torch.Tensor] = {}
    for names in batches(stored):
        data = reader.read_items([k for name in names for *_, k in parts[name]])
        for name in names:
            out[name] = _assemble(manifest, *tensors[name], parts[name], data)
            advance(sum(manifest.items[k].nbytes for *_, k in parts[name]))
    return out


def top_level_keys(md: Metadata) -> list[str]:
    """The state dict's top-level keys, in the order DCP lists them (``model`` of ``model.layers.0.w``)."""
    return list(dict.fromkeys(fqn.split(".", 1)[0] for fqn in md.state_dict_metadata))


def _under(fqn: str, prefix: str) -> bool:
    return not prefix or (fqn.startswith(prefix) and len(fqn) > len(prefix))


def _model_prefix(manifest: Manifest, md: Metadata) -> str:
    """``"model."``, the default prefix, if the state dict has a ``model`` state dict; else a CliError."""
    prefix = f"{MODEL_KEY}."
    if not any(_under(fqn, prefix) for fqn in md.state_dict_metadata):
        single = MODEL_KEY in md.state_dict_metadata
        raise CliError(
            f"step {manifest.step} has no {MODEL_KEY!r} state dict to export as the model"
            + (f" ({MODEL_KEY!r} is a single item, not a state dict)" if single else "")
            + f"; its top-level keys: {', '.join(top_level_keys(md)) or 'none'}; "
            f"choose what to export with {CHOOSE}"
        )
    return prefix


def _select(
    md: Metadata, strip_prefix: str, strict: bool, warn: Callable[[str], object]
) -> dict[str, tuple[str, TensorStorageMetadata]]:
    """Exported name -> (FQN, metadata) of each tensor to write; what safetensors cannot hold is named."""
    tensors: dict[str, tuple[str, TensorStorageMetadata]] = {}
    objects: list[str] = []
    unsupported: list[str] = []
    for fqn, meta in md.state_dict_metadata.items():
        if not _under(fqn, strip_prefix):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            objects.append(fqn)
        elif not supported_dtype(meta.properties.dtype):
            unsupported.append(f"{fqn} ({str(meta.properties.dtype).removeprefix('torch.')})")
        else:
            tensors[fqn[len(strip_prefix) :]] = (fqn, meta)
    for what, names in (
        ("objects that are not tensors", objects),
        ("tensors of dtypes safetensors lacks", unsupported),
    ):
        if not names:
            continue
        if strict:
            raise CliError(
                f"safetensors cannot hold the checkpoint's {what}: {', '.join(names)} "
                "(drop --strict to skip them)"
            )
        warn(f"skipped {len(names)} {what}: {', '.join(names)}")
    return tensors


def _save_file(st: ModuleType, path: Path, data: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write one safetensors file durably, through a temporary name, with the usual file mode."""
    umask = os.umask(0)
    os.umask(umask)
    tmp = path.with_name(path.name + ".tmp")
    st.save_file(data, str(tmp), metadata=metadata)
    os.chmod(tmp, 0o666 & ~umask)  # safetensors creates 0600 files; give the usual mode
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)


def export_safetensors(
    tier: Tier,
    manifest: Manifest,
    md: Metadata,
    out_dir: Path,
    *,
    max_shard_size: int = 5 * 10**9,
    strip_prefix: str | None = None,
    strict: bool = False,
    overwrite: bool = False,
    advance: Callable[[int], None] = lambda n: None,
    warn: Callable[[str], object] = print,
) -> list[Path]:
    """Write the tensors of ``manifest``'s checkpoint as safetensors in ``out_dir``; return the files.

    ``strip_prefix``: None (the default) exports the model, the tensors under the top-level
    ``model`` key without ``model.``; a prefix exports the tensors under it, without it; ``""``
    exports every tensor, names as stored.
    """
    st = _safetensors()
    by_index = storage_keys(manifest, md)
    keys = {(i.fqn, tuple(i.offset) if i.offset is not None else None): k for i, k in by_index.items()}
    prefix = _model_prefix(manifest, md) if strip_prefix is None else strip_prefix
    tensors = _select(md, prefix, strict, warn)
    if not tensors:
        raise CliError(
            f"step {manifest.step} has no tensors to export"
            + (
                f" under {prefix!r}; its top-level keys: {', '.join(top_level_keys(md)) or 'none'}; "
                f"choose what to export with {CHOOSE}"
                if prefix
                else ""
            )
        )
    sizes = {name: _nbytes(meta) for name, (_, meta) in tensors.items()}
    shards = plan_shards(sizes, max_shard_size)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    stale = (
        [SINGLE_FILE, INDEX_FILE] + [p.name for p in out_dir.glob("model-*-of-*.safetensors")]
        if out_dir.is_dir()
        else []
    )
    metadata = {"format": "pt", "shoal_job": manifest.job, "shoal_step": str(manifest.step)}
    with output_dir(out_dir, stale, overwrite=overwrite) as written:
        reader = ItemReader(tier, manifest)
        for file_name, shard in zip(names, shards, strict=True):
            data = _read_shard(reader, keys, tensors, shard, advance)
            written.append(out_dir / file_name)
            _save_file(st, written[-1], data, metadata)
            del data
        if n > 1:
            index = {
                "metadata": {"total_size": sum(sizes.values())},
                "weight_map": {
                    name: file_name for file_name, shard in zip(names, shards, strict=True) for name in shard
                },
            }
            written.append(out_dir / INDEX_FILE)
            write_durably(written[-1], lambda f: f.write(json.dumps(index, indent=2).encode()))
    left_out = [k for k in top_level_keys(md) if k != MODEL_KEY]
    if strip_prefix is None and left_out:
        warn(
            f"note: exported the model only (the tensors under {MODEL_KEY!r}, named without {prefix!r}); "
            f"left out {', '.join(left_out)} (--all exports every tensor, names as stored)"
        )
    return written
