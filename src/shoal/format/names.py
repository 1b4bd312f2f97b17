"""Validation of the names shoal writes or reads: item keys, tier paths, identifiers.

Everything read from disk or object storage passes through these checks before it
is used to build a path, so a hostile or corrupted manifest cannot make shoal read
or write outside its root.
"""

from __future__ import annotations

import re

from shoal.errors import InvalidName

MAX_KEY_LENGTH = 4096
MAX_PATH_LENGTH = 1024
_IDENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"[0-9a-f]{64}")


def _check_common(value: object, what: str, limit: int) -> str:
    if not isinstance(value, str):
        raise InvalidName(f"{what} must be a string, got {type(value).__name__}: {value!r}")
    if not value:
        raise InvalidName(f"{what} is empty")
    if len(value) > limit:
        raise InvalidName(f"{what} is {len(value)} characters long; the limit is {limit}: {value[:80]!r}...")
    if "\x00" in value:
        raise InvalidName(f"{what} contains a NUL character: {value!r}")
    return value


def check_item_key(key: object) -> str:
    """Return ``key`` if it is a safe item key, else raise :class:`InvalidName`.

    Keys are the flattened state-dict names (``model.layers.0.weight``) plus an
    optional shard suffix. They may contain ``/`` but never name an absolute path,
    a ``..`` segment, or a NUL byte, because exports turn keys into file names.
    """
    key = _check_common(key, "item key", MAX_KEY_LENGTH)
    if key.startswith("/") or key.startswith("\\"):
        raise InvalidName(f"item key {key!r} is an absolute path")
    if ".." in re.split(r"[/\\]", key):
        raise InvalidName(f"item key {key!r} contains a '..' path segment")
    return key


def check_relpath(path: object) -> str:
    """Return ``path`` if it is a safe relative POSIX path inside a tier, else raise."""
    path = _check_common(path, "tier path", MAX_PATH_LENGTH)
    if path.startswith("/"):
        raise InvalidName(f"tier path {path!r} is absolute; tier paths are relative to the tier root")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise InvalidName(f"tier path {path!r} has an empty, '.' or '..' segment")
        if "\\" in part:
            raise InvalidName(f"tier path {path!r} contains a backslash")
    return path


def check_identifier(value: object, what: str) -> str:
    """Return ``value`` if it is a safe identifier (job, host, pack id), else raise."""
    value = _check_common(value, what, 128)
    if not _IDENT.fullmatch(value):
        raise InvalidName(
            f"{what} {value!r} may only use letters, digits, '.', '_' and '-', "
            "and must start with a letter or digit"
        )
    return value


def check_digest(value: object, where: str = "digest") -> str:
    """Return ``value`` if it is a lowercase 64-hex BLAKE3-256 digest, else raise."""
    if not isinstance(value, str) or not _DIGEST.fullmatch(value):
        raise InvalidName(f"{where} {value!r} is not a 64-character lowercase hex BLAKE3-256 digest")
    return value
