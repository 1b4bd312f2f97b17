"""``shoal.Config``: one frozen dataclass; environment overrides are read here and only here."""

from __future__ import annotations

import difflib
import functools
import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from shoal.errors import ConfigError, InvalidName, UnknownConfigField
from shoal.format.chunking import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from shoal.format.names import check_identifier

PATHS = ("auto", "partner", "direct")
ON_BUSY = ("wait", "skip")
REPLICATE_TO = ("local", "dram")
PARTNER_SCHEMES = ("ring", "jump")
ENV_HOST_ID = "SHOAL_HOST_ID"
ENV_METRICS_PORT = "SHOAL_METRICS_PORT"


def default_local_root() -> str:
    """``<tmp>/shoal-local-<uid>``: private to this user (docs/design.md section 11)."""
    return os.path.join(tempfile.gettempdir(), f"shoal-local-{os.geteuid()}")


def default_dram_root() -> str:
    """``/dev/shm/shoal-<uid>``: private to this user (docs/design.md section 11)."""
    return f"/dev/shm/shoal-{os.geteuid()}"


def _sanitize_host(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in name).strip("-.") or "host"
    return cleaned[:128]


@dataclass(frozen=True)
class Config:
    """Where a job's checkpoints go and how they move.

    Args:
        shared: root on shared storage: a path (``/lustre/run``) or an fsspec URL
            (``s3://bucket/run``). Checkpoints live under ``<shared>/<job>/``.
        local: node-local disk root (partner copies, the event log). Defaults to
            ``<tmp>/shoal-local``.
        dram: host-memory root for staging slabs, normally under ``/dev/shm``. Defaults to
            ``/dev/shm/shoal-<uid>``. Host roots are private: shoal creates them 0700 and refuses
            one that another user owns or can write.
        job: job name; one directory level under every root.
        chunk_size: dedup and hashing granularity in bytes (default 4 MiB).
        path: ``"auto"``, ``"partner"`` or ``"direct"``; how checkpoints reach shared storage.
        keep_last: how many committed checkpoints retention keeps (``None``: keep all).
        dram_slots: how many checkpoints may be staged or in flight at once.
        on_busy: when every slot is in flight, ``"wait"`` (back-pressure, counted as
            stall) or ``"skip"`` (the save returns a skipped handle).
        hash_threads: BLAKE3 threads per rank (0: automatic).
        drain_streams: uploads each rank keeps in flight for its share of the drain to shared
            storage (default 4). One stream rarely fills a storage NIC, and an object store that
            handles an object only once its whole body has arrived leaves the link idle meanwhile
            unless another upload is under way.
        drain_pack_bytes: about how large each pack of the drain is (default 16 MiB): a rank's
            share is cut into packs of about this size, ``drain_streams`` of them in flight. Each
            pack costs two requests (the pack and its index); smaller packs shorten the idle tail
            of a store that handles an object after its body.
        balance_drain: balance the drain over the hosts' storage NICs (default). Off, each new
            chunk several ranks hold is drained by the lowest of those ranks, whatever its host
            already drains: for measuring what the balance is worth, not for production.
        host_id: this host's name; defaults to ``$SHOAL_HOST_ID`` or the hostname.
        storage_options: passed to fsspec for the shared tier (endpoint, credentials).
        event_log: JSON-lines event log path; defaults to ``events.jsonl`` in this run's directory
            of the local root (``<local>/<job>/<host>/runs/<run>/``).
        ranks_per_node: ranks per host when host names do not tell (simulations); by default
            ranks are grouped by ``host_id`` (``$SHOAL_HOST_ID``, else the hostname).
        close_timeout: seconds ``close()`` (and interpreter exit) waits for in-flight work.
        replicate_to: where a partner host keeps its copy: ``"local"`` (fsync'd node-local
            disk) or ``"dram"`` (its ``/dev/shm``; faster, lost with the host's power).
        partner_scheme: ``"ring"`` (host i's partner is host i+1) or ``"jump"`` (host i + n/2).
        failure_domain: this host's failure domain (rack, PDU); hosts of one domain are
            never partners. Defaults to the host itself.
        collective_timeout: seconds a background collective may wait for the other ranks
            before the checkpoint is failed.
        allow_pickle: load non-tensor items (plain Python objects saved in the state) with
            ``torch.load(weights_only=False)``. **Unsafe**: unpickling runs code chosen by whoever
            could write the checkpoint. Off by default: such items load with ``weights_only=True``
            (tensors, containers, numbers and strings), anything else is refused with a
            :class:`~shoal.errors.FormatError` naming the item.
        metrics_port: serve Prometheus metrics on this TCP port (``None``, the default: no metrics,
            nothing imported, nothing listening; ``0``: any free port). ``$SHOAL_METRICS_PORT``
            sets it when the field is unset. One endpoint per host, served by the host's first
            rank from the host's event log (``docs/observability.md``); needs ``shoal[metrics]``.
        metrics_addr: the address the metrics endpoint binds (default ``""``: every interface;
            ``"127.0.0.1"`` for this host alone).
    """

    shared: str
    local: str | None = None
    dram: str | None = None
    job: str = "default"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    path: str = "auto"
    keep_last: int | None = 3
    dram_slots: int = 2
    on_busy: str = "wait"
    hash_threads: int = 0
    drain_streams: int = 4
    drain_pack_bytes: int = 16 << 20
    balance_drain: bool = True
    host_id: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    event_log: str | None = None
    ranks_per_node: int | None = None
    close_timeout: float = 600.0
    replicate_to: str = "local"
    partner_scheme: str = "ring"
    failure_domain: str | None = None
    collective_timeout: float = 300.0
    allow_pickle: bool = False
    metrics_port: int | None = None
    metrics_addr: str = ""

    def __post_init__(self) -> None:
        for name in ("shared", "local", "dram", "event_log"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
        if not isinstance(self.shared, str) or not self.shared:
            raise ConfigError(f"Config.shared must be a non-empty path or URL, got {self.shared!r}")
        try:
            check_identifier(self.job, "Config.job")
            if self.host_id is not None:
                check_identifier(self.host_id, "Config.host_id")
            if self.failure_domain is not None:
                check_identifier(self.failure_domain, "Config.failure_domain")
        except InvalidName as e:
            raise ConfigError(str(e)) from e
        if not isinstance(self.chunk_size, int) or not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise ConfigError(
                f"Config.chunk_size must be an int in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}], "
                f"got {self.chunk_size!r}"
            )
        if self.path not in PATHS:
            raise ConfigError(f"Config.path must be one of {PATHS}, got {self.path!r}")
        if self.on_busy not in ON_BUSY:
            raise ConfigError(f"Config.on_busy must be one of {ON_BUSY}, got {self.on_busy!r}")
        if self.keep_last is not None and (not isinstance(self.keep_last, int) or self.keep_last < 1):
            raise ConfigError(f"Config.keep_last must be None or an int >= 1, got {self.keep_last!r}")
        if not isinstance(self.balance_drain, bool):
            raise ConfigError(f"Config.balance_drain must be True or False, got {self.balance_drain!r}")
        if (
            not isinstance(self.drain_pack_bytes, int)
            or isinstance(self.drain_pack_bytes, bool)
            or self.drain_pack_bytes < MIN_CHUNK_SIZE
        ):
            raise ConfigError(
                f"Config.drain_pack_bytes must be an int >= {MIN_CHUNK_SIZE}, got {self.drain_pack_bytes!r}"
            )
        if (
            not isinstance(self.drain_streams, int)
            or isinstance(self.drain_streams, bool)
            or not 1 <= self.drain_streams <= 64
        ):
            raise ConfigError(f"Config.drain_streams must be an int in [1, 64], got {self.drain_streams!r}")
        if not isinstance(self.dram_slots, int) or self.dram_slots < 1:
            raise ConfigError(f"Config.dram_slots must be an int >= 1, got {self.dram_slots!r}")
        if self.replicate_to not in REPLICATE_TO:
            raise ConfigError(f"Config.replicate_to must be one of {REPLICATE_TO}, got {self.replicate_to!r}")
        if self.partner_scheme not in PARTNER_SCHEMES:
            raise ConfigError(
                f"Config.partner_scheme must be one of {PARTNER_SCHEMES}, got {self.partner_scheme!r}"
            )
        if not isinstance(self.collective_timeout, int | float) or self.collective_timeout <= 0:
            raise ConfigError(
                f"Config.collective_timeout must be > 0 seconds, got {self.collective_timeout!r}"
            )
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ConfigError(f"Config.ranks_per_node must be >= 1, got {self.ranks_per_node!r}")
        if self.metrics_port is not None and (
            not isinstance(self.metrics_port, int)
            or isinstance(self.metrics_port, bool)
            or not 0 <= self.metrics_port <= 65535
        ):
            raise ConfigError(
                f"Config.metrics_port must be None or an int in [0, 65535], got {self.metrics_port!r}"
            )
        if not isinstance(self.metrics_addr, str):
            raise ConfigError(
                f"Config.metrics_addr must be a str (an address to bind), got {self.metrics_addr!r}"
            )

    def resolved(self, rank: int = 0) -> Config:
        """A copy with every default filled in for ``rank``, from the environment where needed.

        The host id is, first found: ``host_id``; ``$SHOAL_HOST_ID``; ``node<rank // ranks_per_node>``
        when ``ranks_per_node`` is set; the hostname (so torchrun's ranks of one node share it).
        This is the one place a host id is resolved. torchrun's ``$GROUP_RANK`` is deliberately
        not used: an elastic restart may give a node another group rank, and the host id names
        the node's own DRAM and disk, which must be found again after the restart.
        ``metrics_port``, when unset, is ``$SHOAL_METRICS_PORT`` if that is set.
        """
        host = self.host_id or os.environ.get(ENV_HOST_ID)
        if not host and self.ranks_per_node:
            host = f"node{rank // self.ranks_per_node}"
        host = host or _sanitize_host(socket.gethostname())
        local = self.local or default_local_root()
        dram = self.dram or default_dram_root()
        try:
            check_identifier(host, f"host id (from ${ENV_HOST_ID} or the hostname)")
        except InvalidName as e:
            raise ConfigError(str(e)) from e
        return replace(self, host_id=host, local=local, dram=dram, metrics_port=self._metrics_port())

    def _metrics_port(self) -> int | None:
        """``metrics_port``, else ``$SHOAL_METRICS_PORT`` (an int in [0, 65535]), else None."""
        if self.metrics_port is not None:
            return self.metrics_port
        text = os.environ.get(ENV_METRICS_PORT, "").strip()
        if not text:
            return None
        try:
            port = int(text)
        except ValueError:
            port = -1
        if not 0 <= port <= 65535:
            raise ConfigError(f"${ENV_METRICS_PORT} must be a TCP port in [0, 65535], got {text!r}")
        return port

    def shared_url(self) -> str:
        return f"{self.shared.rstrip('/')}/{self.job}"

    def host_url(self, root: str) -> str:
        if self.host_id is None:
            raise ConfigError("Config.host_id is not resolved; call Config.resolved() first")
        return os.path.join(root, self.job, self.host_id)


FIELDS = tuple(f.name for f in fields(Config))
"""Config's field names, in order."""


def unknown_fields_message(names: list[str]) -> str:
    """``Config has no field 'keep_lst'; did you mean 'keep_last'? (fields: ...)`` for ``names``."""
    close = {n: difflib.get_close_matches(n, FIELDS, n=1, cutoff=0.6) for n in names}
    listed = f"(fields: {', '.join(FIELDS)})"
    if len(names) == 1:
        (name,) = names
        guess = f"; did you mean {close[name][0]!r}?" if close[name] else ""
        return f"Config has no field {name!r}{guess} {listed}"
    parts = [f"{n!r}" + (f" (did you mean {close[n][0]!r}?)" if close[n] else "") for n in names]
    return f"Config has no fields {', '.join(parts)} {listed}"


def _checked_init(init: Any) -> Any:
    """``init`` (the dataclass's ``__init__``), refusing a keyword that is no field with the closest one.

    Wrapped after the class is made, so type checkers still see the dataclass's own signature;
    ``dataclasses.replace`` goes through it too.
    """

    @functools.wraps(init)
    def __init__(self: Config, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in FIELDS]
        if unknown:
            raise UnknownConfigField(unknown_fields_message(unknown))
        init(self, *args, **kwargs)

    return __init__


Config.__init__ = _checked_init(Config.__init__)  # type: ignore[method-assign]
