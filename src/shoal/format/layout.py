"""Where things live inside a tier root (docs/design.md section 6).

```
<tier root>/<job>[/<host_id>]/
  packs/<pack-id>.pack           chunk payloads back to back
  packs/<pack-id>.idx            JSON index of the pack
  steps/<step:012d>/manifest.json
  steps/<step:012d>/COMMIT       commit record (shared tier): the manifest's digest
  LATEST                         {"step": N, "manifest_blake3": "..."} (shared tier only)
```
"""

from __future__ import annotations

import re
import secrets

from shoal.errors import InvalidName
from shoal.format.names import check_identifier

LATEST = "LATEST"
STEPS_DIR = "steps"
PACKS_DIR = "packs"
RUN = "RUN"
"""Shared tier: the run's id, written once, at the job's first ``Checkpointer`` (docs/design.md §11)."""
WRITER = "WRITER"
"""Shared tier: the id of the writer allowed to commit into the job (the newest one to claim it)."""

MAX_POINTER_BYTES = 64 << 10
"""Size limits on metadata reads: ``LATEST``, ``COMMIT``, ``RUN`` and ``WRITER`` records."""
MAX_MANIFEST_BYTES = 1 << 30
"""A manifest (every chunk digest of a checkpoint: ~100 bytes per 4 MiB chunk, so ~40 PiB of state)."""
MAX_INDEX_BYTES = 256 << 20
"""A pack's ``.idx``."""
MAX_STAGED_BYTES = 256 << 20
"""A DRAM slot's staged index."""
MAX_STEP = 10**12 - 1
_STEP_DIR = re.compile(r"steps/(\d{12})/")
_PACK_STEP = re.compile(r"(\d{12})-")


def check_step(step: object) -> int:
    """Return ``step`` if it is a valid step number (an int in [0, 10**12)).

    Raises :class:`~shoal.errors.InvalidName` (a ``ShoalError`` and a ``ValueError``) otherwise:
    a step names a directory (``steps/<step:012d>``), so an out-of-range one is an unsafe name.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        shown = repr(step) if len(repr(step)) <= 80 else repr(step)[:77] + "..."
        raise InvalidName(f"step must be an int, got {type(step).__name__}: {shown}")
    if not 0 <= step <= MAX_STEP:
        shown = str(step) if step.bit_length() <= 128 else f"an int of {step.bit_length()} bits"
        raise InvalidName(f"step must be between 0 and {MAX_STEP}, got {shown}")
    return step


def step_dir(step: int) -> str:
    return f"{STEPS_DIR}/{check_step(step):012d}"


def manifest_path(step: int) -> str:
    return f"{step_dir(step)}/manifest.json"


def commit_path(step: int) -> str:
    return f"{step_dir(step)}/COMMIT"


def pack_path(pack_id: str) -> str:
    return f"{PACKS_DIR}/{check_identifier(pack_id, 'pack id')}.pack"


def index_path(pack_id: str) -> str:
    return f"{PACKS_DIR}/{check_identifier(pack_id, 'pack id')}.idx"


def new_pack_id(step: int, host: str, rank: int) -> str:
    """A fresh pack id; it starts with the step so retention can tell in-flight packs apart."""
    return check_identifier(f"{check_step(step):012d}-{host}-r{rank}-{secrets.token_hex(4)}", "pack id")


def pack_step(pack_id: str) -> int | None:
    """The step a pack was written for, or None if the id does not say."""
    m = _PACK_STEP.match(pack_id)
    return int(m.group(1)) if m else None


def step_of_path(path: str) -> int | None:
    """The step of a ``steps/<step>/...`` path, or None."""
    m = _STEP_DIR.match(path)
    return int(m.group(1)) if m else None
