"""shoal inside the frameworks people train with: one module per framework, each an optional extra.

- :mod:`shoal.integrations.lightning` (``pip install 'shoal[lightning]'``)
- :mod:`shoal.integrations.accelerate` (``pip install 'shoal[accelerate]'``)
- :mod:`shoal.integrations.torchtitan` (``pip install 'shoal[torchtitan]'``)
- :mod:`shoal.integrations.megatron` (``pip install 'shoal[megatron]'``): Megatron's local checkpoints

Each module imports its framework when it is itself imported, never before: ``import shoal`` and
``import shoal.integrations`` import none of them. Each is a thin translation of the framework's
save, load and remove calls and its retention and resume conventions onto a
:class:`shoal.Checkpointer` or :mod:`shoal.dcp`'s writer and reader; no storage logic lives here.
See docs/integrations.md.
"""
