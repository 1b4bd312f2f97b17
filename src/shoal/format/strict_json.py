"""Reading shoal's JSON metadata strictly: one parser for every record, errors that name the file."""

from __future__ import annotations

import json
from typing import Any

from shoal.errors import FormatError


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a key given twice would let one reader see what another does not."""
    out = dict(pairs)
    if len(out) != len(pairs):  # rare: find the key to name it
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


def load_json(data: bytes, what: str) -> Any:
    """Parse ``data`` (the bytes of ``what``, e.g. ``"manifest s3://b/j/steps/.../manifest.json"``).

    Anything that is not one valid JSON document with each object key given once (bad UTF-8,
    a truncated file, nesting too deep, an integer too long to parse) is a
    :class:`~shoal.errors.FormatError` naming ``what``.
    """
    try:
        return json.loads(data, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise FormatError(f"{what}: duplicate JSON object key {str(e.args[0])[:80]!r}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, huge ints
        raise FormatError(f"{what} is not valid JSON (truncated or corrupted?): {e}") from e
