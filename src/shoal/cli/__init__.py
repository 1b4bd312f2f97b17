"""The ``shoal`` command line: ``ls``, ``verify``, ``gc``, ``export``, ``exposure``, ``advise``, ``demo``.

Run ``shoal --help`` (or ``python -m shoal.cli --help``); the entry point is
:func:`shoal.cli.main.main`. Checkpoints are addressed by the job directory on shared
storage, ``shoal ls /lustre/run/job42`` or ``shoal ls s3://bucket/run/job42``, or as
``shoal.Config`` names them, ``shoal ls --shared /lustre/run --job job42``.

Modules: :mod:`~shoal.cli.main` (parser, dispatch, exit codes), :mod:`~shoal.cli.common`
(addressing, consoles, sizes), one module per command (:mod:`~shoal.cli.ls`,
:mod:`~shoal.cli.verify`, :mod:`~shoal.cli.gc`, :mod:`~shoal.cli.export`), and the export
writers (:mod:`~shoal.cli.source`, :mod:`~shoal.cli.export_dcp`,
:mod:`~shoal.cli.export_safetensors`).

Building the parser imports neither torch nor scipy (``shoal --help`` starts in a fraction of
a second): each command module imports at its top only what its parser and its light work
need, and the heavy modules (torch, for the export writers and ``verify``'s cross-check;
numpy and scipy, for ``exposure`` and ``advise``; the DRAM tier, for ``gc --staged``) in the
functions that run the command. tests/cli/test_cli_help_imports.py holds them to it.
"""
