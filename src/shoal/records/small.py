"""Small records read whole: a pointer, the writer record, the run record.

Each is one small file on a tier, read with :meth:`~shoal.tiers.base.Tier.read_small` (its size
checked before it is read) and decoded by its own codec; an absent record is None, not an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from shoal.errors import MissingFile
from shoal.format import layout
from shoal.tiers.base import Tier

T = TypeVar("T")


def read_record(
    tier: Tier,
    path: str,
    decode: Callable[[bytes, str], T],
    *,
    what: str,
    limit: int = layout.MAX_POINTER_BYTES,
) -> T | None:
    """The record at ``path`` on ``tier``, decoded, or None if there is no such file.

    ``decode(data, where)`` gets the bytes and ``<tier url>/<path>`` for its messages. A file
    larger than ``limit`` is a :class:`~shoal.errors.FormatError` naming it as ``what`` and is
    never read whole; what ``decode`` raises propagates.
    """
    try:
        data = tier.read_small(path, limit, what)
    except MissingFile:
        return None
    return decode(data, f"{tier.url}/{path}")
