"""``shoal export``: a checkpoint as a stock PyTorch DCP directory, or as safetensors, for interop.

The writers are :mod:`shoal.cli.export_dcp` and :mod:`shoal.cli.export_safetensors`; they
(and torch) are imported only when the command runs, so the rest of ``shoal`` starts fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shoal.cli.common import CliError, byte_progress, open_job, parse_size, step_number


def _selected(prefix: str | None) -> str:
    """What a safetensors export holds, for the closing line."""
    if prefix is None:
        return "the model, the tensors under 'model', named without 'model.'"
    if not prefix:
        return "every tensor, names as stored"
    return f"the tensors under {prefix!r}, named without it"


def run(args: argparse.Namespace) -> int:
    from shoal.cli.source import check_stored, load_source, storage_keys

    if len(args.paths) not in (1, 2):
        raise CliError(f"export takes [URL] OUT_DIR, got {len(args.paths)} paths: {args.paths}")
    args.url = args.paths[0] if len(args.paths) == 2 else None
    out_dir = Path(args.paths[-1])
    tier = open_job(args)
    try:
        manifest, md = load_source(tier, args.step)
        keys = set(storage_keys(manifest, md).values())
        check_stored(tier, manifest, sorted(keys))
        total = sum(manifest.items[k].nbytes for k in keys)
        with byte_progress(f"exporting step {manifest.step}", total) as bar:
            task = bar.task_ids[0]

            def advance(n: int) -> None:
                bar.advance(task, n)

            if args.format == "dcp":
                from shoal.cli.export_dcp import export_dcp

                export_dcp(tier, manifest, md, out_dir, overwrite=args.overwrite, advance=advance)
                what = "a DCP checkpoint (torch.distributed.checkpoint.FileSystemReader)"
            else:
                from shoal.cli.export_safetensors import export_safetensors

                prefix = "" if args.all else args.strip_prefix
                files = export_safetensors(
                    tier,
                    manifest,
                    md,
                    out_dir,
                    max_shard_size=args.max_shard_size,
                    strip_prefix=prefix,
                    strict=args.strict,
                    overwrite=args.overwrite,
                    advance=advance,
                    warn=bar.console.print,
                )
                what = f"safetensors ({', '.join(p.name for p in files)}: {_selected(prefix)})"
    finally:
        tier.close()
    print(f"exported step {manifest.step} of {tier.url} to {out_dir} as {what}")
    return 0


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        parents=parents,
        help="write a checkpoint as a stock DCP directory or safetensors",
        description="Write one checkpoint (default: the one LATEST names) to a local directory, reading "
        "every chunk verified. --format dcp: a directory torch.distributed.checkpoint.FileSystemReader "
        "loads (and dcp_to_torch_save converts). --format safetensors: the model, the tensors under the "
        "state dict's top-level 'model' key named without 'model.' (the keys of model.state_dict()), "
        "with DCP shards assembled into whole tensors, in model.safetensors (or shards of "
        "--max-shard-size with a model.safetensors.index.json, as Hugging Face lays them out); "
        "--strip-prefix chooses other tensors, --all every tensor (the optimizer's too); objects that are "
        "not tensors, and tensors of dtypes safetensors cannot hold, are listed on stderr as skipped "
        "(--strict: fail instead).",
    )
    p.add_argument(
        "paths",
        nargs="*",
        metavar="[URL] OUT_DIR",
        help="the job directory (<shared>/<job>, a path or fsspec URL; or use --shared/--job), then the "
        "local directory to write (created; must be empty)",
    )
    p.add_argument("--format", required=True, choices=("dcp", "safetensors"), help="what to write")
    p.add_argument("--step", type=step_number, help="the step to export (default: LATEST)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT_DIR, replacing files")
    st = p.add_argument_group("safetensors")
    st.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=parse_size("5GB"),
        metavar="SIZE",
        help="largest shard file (default 5GB; units B, KB/MB/GB = 1000^n, KiB/MiB/GiB = 1024^n)",
    )
    which = st.add_mutually_exclusive_group()
    which.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        help="export the tensors whose flattened name starts with PREFIX, named without it "
        "(default: 'model.', the model, which the checkpoint must have)",
    )
    which.add_argument(
        "--all",
        action="store_true",
        help="export every tensor (the optimizer's too), named as stored (model.layers.0.weight, "
        "optim.state.0.exp_avg, ...)",
    )
    st.add_argument(
        "--strict", action="store_true", help="fail instead of skipping what safetensors cannot hold"
    )
    p.set_defaults(run=run, intermixed="paths")
