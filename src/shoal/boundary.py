"""The four durability boundaries (docs/design.md section 3)."""

from __future__ import annotations

import enum


class Boundary(enum.IntEnum):
    """A durability level a checkpoint has reached; each implies the ones before it.

    ``STAGED`` (B1): every rank's items are copied into its host's DRAM tier; survives
    a crash of the training processes. ``REPLICATED`` (B2): every chunk and the
    manifest are on two hosts; survives the loss of one host. ``PERSISTED`` (B3):
    every chunk and the manifest are on shared storage; survives the loss of every
    compute host. ``RESTARTABLE`` (B4): the commit record and ``LATEST`` are written;
    a fresh job at any world size can load it from shared storage alone.
    """

    STAGED = 1
    REPLICATED = 2
    PERSISTED = 3
    RESTARTABLE = 4

    @property
    def label(self) -> str:
        return f"B{int(self)} {self.name}"
