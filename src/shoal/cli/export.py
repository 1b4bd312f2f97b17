"""``shoal export``: a checkpoint as a stock PyTorch DCP directory, or as safetensors, for interop.

The writers are :mod:`shoal.cli.export_dcp` and :mod:`shoal.cli.export_safetensors`; they
(and torch) are imported only when the command runs, so the rest of ``shoal`` starts fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shoal.cli.common import CliError, byte_progress, open_job, parse_size, step_number


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

                files = export_safetensors(
                    tier,
                    manifest,
                    md,
                    out_dir,
                    max_shard_size=args.max_shard_size,
                    strip_prefix=args.strip_prefix,
                    strict=args.strict,
                    overwrite=args.overwrite,
                    advance=advance,
                    warn=bar.console.print,
                )
                what = f"safetensors ({', '.join(p.name for p in files)})"
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
        "loads (and dcp_to_torch_save converts). --format safetensors: every tensor, with DCP shards "
        "assembled into whole tensors, in model.safetensors (or shards of --max-shard-size with a "
        "model.safetensors.index.json, as Hugging Face lays them out); objects that are not tensors, "
        "and tensors of dtypes safetensors cannot hold, are listed on stderr as skipped (--strict: "
        "fail instead).",
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
    st.add_argument(
        "--strip-prefix",
        default="",
        metavar="PREFIX",
        help="export only tensors whose name starts with PREFIX, without it (e.g. 'model.')",
    )
    st.add_argument(
        "--strict", action="store_true", help="fail instead of skipping what safetensors cannot hold"
    )
    p.set_defaults(run=run, intermixed="paths")
