"""The ``shoal`` command line: ``ls``, ``verify``, ``gc``, ``export``, ``demo``.

Run ``shoal --help`` (or ``python -m shoal.cli --help``); the entry point is
:func:`shoal.cli.main.main`. Checkpoints are addressed by the job directory on shared
storage, ``shoal ls /lustre/run/job42`` or ``shoal ls s3://bucket/run/job42``, or as
``shoal.Config`` names them, ``shoal ls --shared /lustre/run --job job42``.

Modules: :mod:`~shoal.cli.main` (parser, dispatch, exit codes), :mod:`~shoal.cli.common`
(addressing, consoles, sizes), one module per command (:mod:`~shoal.cli.ls`,
:mod:`~shoal.cli.verify`, :mod:`~shoal.cli.gc`, :mod:`~shoal.cli.export`), and the export
writers (:mod:`~shoal.cli.source`, :mod:`~shoal.cli.export_dcp`,
:mod:`~shoal.cli.export_safetensors`), which alone import torch.
"""
