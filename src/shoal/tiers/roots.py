"""Whether a configured root can be a directory: one-line reasons, naming the ``Config`` field.

A root that is a file, that lies below a file, or (for the host tiers) that cannot be written is
found with ``stat`` and ``access`` before any tier is opened, so the user reads what is wrong
with the path they gave rather than the tier's nested error.
"""

from __future__ import annotations

import os
import stat

from shoal.config import Config, default_dram_root, default_local_root
from shoal.errors import ConfigError

__all__ = ["check_host_roots", "check_shared_root"]


def _local_path(url: str) -> str | None:
    """The directory of a root on a local or mounted file system (a path, ``file://``), or None (``s3://``)."""
    if url.startswith("file://"):
        return url[len("file://") :]
    return None if "://" in url else url


def check_host_roots(config: Config) -> None:
    """Refuse a host root of ``config`` that cannot be a directory, in one line naming the field.

    ``local`` and ``dram`` (or their defaults): a root that is a file or lies below a file, or
    that cannot be created or written, is a :class:`~shoal.errors.ConfigError` naming the field,
    the path and the way out. Not collective; no I/O but ``stat`` and ``access``.
    """
    roots = (
        ("local", config.local or default_local_root()),
        ("dram", config.dram or default_dram_root()),
    )
    for name, url in roots:
        root = _local_path(url)
        if root is not None:
            _check_root(f"Config.{name}", os.path.abspath(root), os.path.join(root, config.job), True)


def check_shared_root(config: Config) -> None:
    """Refuse a shared root on a file system that is a file or lies below one (see :func:`check_host_roots`).

    Called only once the shared tier could not be used and no host copies can stand in for it
    (a shared root that is down while host copies survive is a restore from those copies), so
    that the error says what is wrong with the path in one line. An unwritable shared root is
    left to the tier's own error.
    """
    root = _local_path(config.shared)
    if root is not None:
        _check_root("Config.shared", os.path.abspath(root), os.path.join(root, config.job), False)


def _check_root(field: str, root: str, job_dir: str, written: bool) -> None:
    """See :func:`check_roots`: the nearest existing level of ``job_dir`` (under ``root``) is checked."""
    path = os.path.abspath(job_dir)
    while True:
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            parent = os.path.dirname(path)
            if parent == path:
                return
            path = parent
            continue
        except OSError:  # unreachable (a dead mount): the tiers say what is wrong
            return
        break
    way_out = "point it at a directory (it is created if missing)"
    if not stat.S_ISDIR(st.st_mode):
        what = "a file" if stat.S_ISREG(st.st_mode) else "no directory"
        if path == root:
            raise ConfigError(f"{field}: {root} is {what}, not a directory; {way_out}")
        if len(path) < len(root):
            raise ConfigError(f"{field}: {root} is below {path}, which is {what}, not a directory; {way_out}")
        raise ConfigError(
            f"{field}: {path} (the job's directory under {root}) is {what}, not a directory; "
            "remove it, or choose another Config.job"
        )
    if written and not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{field}: {root} cannot be used: {path} is not writable by uid {os.geteuid()}; "
            "point it at a directory you can write (it is created if missing)"
        )
