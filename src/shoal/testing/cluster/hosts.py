"""An emulated cluster on one machine: hosts with their own storage NIC and fabric link, and a real S3.

Linux network namespaces, veth pairs and ``tc`` token buckets, driven with ``ip``/``tc`` (root only)::

      host ns h0 .. h{H-1}                switch ns                     storage ns
      st0 (storage NIC, host_storage_mbit) --- bridge "brs" --- eth0 (storage_mbit) --- moto S3
      fb0 (fabric, fabric_mbit) ------------- bridge "brf"

Each host link is shaped in both directions (a token bucket on each end's egress), so a host's
uploads and downloads are each bound by its own NIC, and the storage namespace's link bounds
what the whole cluster gets from storage (``storage_mbit``: the aggregate it can buy). Host ``i``
has ``10.201.0.(10+i)`` on its storage NIC and ``10.202.0.(10+i)`` on the fabric; the S3 server
listens on ``10.201.0.2``. Every name carries the creating process's pid
(``shc-<pid>-<role>``), so a cluster left by a dead run is found and removed (its processes
killed) when the next one starts, and two live clusters never collide.

Use it as a context manager (:class:`Cluster`) or from the command line::

    python -m shoal.testing.cluster.hosts --hosts 2 --host-storage-mbit 200 -- python my_rank.py

which brings the cluster up, runs the command once per host inside that host's namespace (with
``SHOAL_HOST_ID``, ``SHOAL_CLUSTER_HOST``, ``SHOAL_CLUSTER_HOSTS``, ``SHOAL_S3_ENDPOINT``,
``SHOAL_FABRIC_ADDR`` of host 0 and fake AWS credentials in the environment), prints each host's
interface byte counts, and tears everything down, also on Ctrl-C or an error.

:meth:`Cluster.run_ranks` runs a scenario as one gloo job across the hosts (a few ranks per host,
started by :mod:`shoal.testing.cluster.ranks` in each host's namespace, joined over the fabric).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.testing.cluster.ranks import GRACE_S, result_path
from shoal.testing.multiproc import RankFailed

PREFIX = "shc-"
"""Every namespace this harness makes is named ``shc-<pid>-<role>``."""
VETH_PREFIX = "shx"
"""veth ends are made in the root namespace as ``shx<pid><tag>a/b`` (15 characters at most), then moved."""
STORAGE_NET = "10.201.0"
FABRIC_NET = "10.202.0"
S3_ADDR = f"{STORAGE_NET}.2"
FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}

RANK_PORT = 29500
"""The first port rank 0 serves the job's store on (host 0's fabric address); each run takes the next."""

__all__ = ["Cluster", "ClusterError", "ClusterSpec", "LinkCounters", "cannot_run", "remove_leftovers"]


class ClusterError(RuntimeError):
    """The emulated cluster could not be built or used; says which command failed and its output."""


@dataclass(frozen=True)
class ClusterSpec:
    """The shape of an emulated cluster. Rates are megabits per second (``tc``'s ``mbit``)."""

    hosts: int = 2
    host_storage_mbit: float = 200.0
    """Each host's storage NIC, each direction."""
    fabric_mbit: float = 400.0
    """Each host's fabric link, each direction."""
    storage_mbit: float = 400.0
    """The storage server's own link: what the whole cluster can get from or give to storage."""
    s3_port: int = 5000
    storage_cpus: tuple[int, ...] | None = None
    """CPUs the S3 server and the other tenants (:class:`~shoal.testing.cluster.load.BackgroundLoad`)
    run on; None: any. In a real cluster they are other machines, so they never take the job's CPUs:
    pinning them apart from ``job_cpus`` keeps the contention on the storage, where it belongs."""
    job_cpus: tuple[int, ...] | None = None
    """CPUs the job's ranks (:meth:`Cluster.run_ranks`) run on; None: any."""

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 200:
            raise ValueError(f"ClusterSpec.hosts must be in 1..200, got {self.hosts}")
        for name in ("host_storage_mbit", "fabric_mbit", "storage_mbit"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ClusterSpec.{name} must be > 0, got {getattr(self, name)!r}")
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        for name in ("storage_cpus", "job_cpus"):
            cpus = getattr(self, name)
            if cpus is not None and (not cpus or not set(cpus) <= usable):
                raise ValueError(
                    f"ClusterSpec.{name} must be a non-empty set of this process's CPUs "
                    f"{sorted(usable)}, got {cpus!r}"
                )


@dataclass(frozen=True)
class LinkCounters:
    """Bytes through one host's interfaces since the cluster started (read from the kernel)."""

    storage_tx: int
    storage_rx: int
    fabric_tx: int
    fabric_rx: int


def cannot_run() -> str | None:
    """Why the harness cannot run here (not root, no ``ip``/``tc``, no namespaces), or None."""
    if sys.platform != "linux":
        return "the emulated cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, veth pairs and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs the {tool!r} command (iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _sh(["ip", "netns", "add", probe])
        _sh(["ip", "netns", "del", probe])
    except ClusterError as e:
        return f"network namespaces cannot be made here: {e}"
    return None


def _sh(argv: Sequence[str], *, timeout: float = 30.0) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterError(f"{' '.join(argv)}: {e}") from e
    if done.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _namespaces() -> list[str]:
    out = _sh(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(ns: str) -> None:
    """Kill every process in ``ns``, then delete it."""
    with contextlib.suppress(ClusterError):
        for pid in _sh(["ip", "netns", "pids", ns]).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(ClusterError):
        _sh(["ip", "netns", "del", ns])


def remove_leftovers(*, keep_pid: int | None = None) -> list[str]:
    """Delete the namespaces (and their processes) of clusters whose creating process is gone."""
    removed = []
    for ns in _namespaces():
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX) :].split("-", 1)[0]
        if not owner.isdigit() or int(owner) == keep_pid or _pid_alive(int(owner)):
            continue
        _delete_namespace(ns)
        removed.append(ns)
    for line in _sh(["ip", "-o", "link", "show"]).splitlines():  # a veth a failed build left behind
        name = line.split(":", 2)[1].strip().split("@", 1)[0] if line.count(":") >= 2 else ""
        digits = name[len(VETH_PREFIX) :].split("h", 1)[0].split("s", 1)[0]
        dead = digits.isdigit() and int(digits) != keep_pid and not _pid_alive(int(digits))
        if name.startswith(VETH_PREFIX) and dead:
            with contextlib.suppress(ClusterError):
                _sh(["ip", "link", "del", name])
            removed.append(name)
    return removed


@dataclass
class Cluster:
    """One emulated cluster (see the module docstring); :meth:`start` / :meth:`stop`, or ``with``."""

    spec: ClusterSpec = field(default_factory=ClusterSpec)
    python: str = sys.executable
    """The interpreter for the S3 server (and for :meth:`python_in`)."""

    def __post_init__(self) -> None:
        self.run_id = str(os.getpid())
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._rank_runs = 0

    # -- names and addresses -----------------------------------------------------------------
    def ns(self, role: str) -> str:
        return f"{PREFIX}{self.run_id}-{role}"

    def host_ns(self, i: int) -> str:
        return self.ns(f"h{i}")

    @staticmethod
    def storage_addr(i: int) -> str:
        return f"{STORAGE_NET}.{10 + i}"

    @staticmethod
    def fabric_addr(i: int) -> str:
        return f"{FABRIC_NET}.{10 + i}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{S3_ADDR}:{self.spec.s3_port}"

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Build the namespaces and links, start the S3 server, wait until it answers."""
        why = cannot_run()
        if why is not None:
            raise ClusterError(why)
        remove_leftovers(keep_pid=os.getpid())
        try:
            self._build()
            self._start_s3()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every process started here and delete every namespace made here. Idempotent."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._procs.clear()
        for ns in reversed(self._made):
            _delete_namespace(ns)
        self._made.clear()

    def _add_ns(self, role: str) -> str:
        ns = self.ns(role)
        _sh(["ip", "netns", "add", ns])
        self._made.append(ns)
        _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        return ns

    def _build(self) -> None:
        sw = self._add_ns("sw")
        for bridge in ("brs", "brf"):
            _sh(["ip", "-n", sw, "link", "add", bridge, "type", "bridge"])
            _sh(["ip", "-n", sw, "link", "set", bridge, "up"])
        st = self._add_ns("st")
        self._link(st, "eth0", f"{S3_ADDR}/24", "brs", "st", self.spec.storage_mbit)
        for i in range(self.spec.hosts):
            h = self._add_ns(f"h{i}")
            self._link(h, "st0", f"{self.storage_addr(i)}/24", "brs", f"h{i}s", self.spec.host_storage_mbit)
            self._link(h, "fb0", f"{self.fabric_addr(i)}/24", "brf", f"h{i}f", self.spec.fabric_mbit)

    def _link(self, ns: str, name: str, addr: str, bridge: str, tag: str, mbit: float) -> None:
        """A veth from ``ns`` (as ``name``, with ``addr``) to ``bridge`` in the switch, shaped both ways."""
        sw = self.ns("sw")
        a, b = f"{VETH_PREFIX}{self.run_id}{tag}a", f"{VETH_PREFIX}{self.run_id}{tag}b"
        _sh(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
        _sh(["ip", "link", "set", a, "netns", ns])
        _sh(["ip", "link", "set", b, "netns", sw])
        _sh(["ip", "-n", ns, "link", "set", a, "name", name])
        _sh(["ip", "-n", ns, "addr", "add", addr, "dev", name])
        _sh(["ip", "-n", ns, "link", "set", name, "up"])
        _sh(["ip", "-n", sw, "link", "set", b, "master", bridge])
        _sh(["ip", "-n", sw, "link", "set", b, "up"])
        for where, dev in ((ns, name), (sw, b)):
            _sh(["tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                 "burst", "256kb", "latency", "100ms"])  # fmt: skip

    def _start_s3(self) -> None:
        code = (
            "import logging, time\n"
            "from moto.server import ThreadedMotoServer\n"
            "logging.getLogger('werkzeug').setLevel(logging.WARNING)\n"
            f"ThreadedMotoServer(ip_address={S3_ADDR!r}, port={self.spec.s3_port}, verbose=False).start()\n"
            "while True: time.sleep(3600)\n"
        )
        server = self.popen_in(
            self.ns("st"), [self.python, "-c", code], env=FAKE_AWS, cpus=self.spec.storage_cpus
        )
        deadline = time.monotonic() + 30
        probe = (
            "import socket, sys\n"
            f"s = socket.create_connection(({S3_ADDR!r}, {self.spec.s3_port}), timeout=1)\n"
            "s.close()\n"
        )
        while True:
            ok = subprocess.run(
                ["ip", "netns", "exec", self.host_ns(0), self.python, "-c", probe],
                capture_output=True,
                timeout=30,
                check=False,
            )
            if ok.returncode == 0:
                return
            if time.monotonic() > deadline or server.poll() is not None:
                raise ClusterError(f"the S3 server at {self.s3_endpoint} did not answer within 30 s")
            time.sleep(0.2)

    # -- using it ----------------------------------------------------------------------------
    def host_env(self, i: int) -> dict[str, str]:
        """What a process on host ``i`` is told about the cluster (added to its environment)."""
        return {
            **FAKE_AWS,
            "SHOAL_HOST_ID": f"h{i}",
            "SHOAL_CLUSTER_HOST": str(i),
            "SHOAL_CLUSTER_HOSTS": str(self.spec.hosts),
            "SHOAL_S3_ENDPOINT": self.s3_endpoint,
            "SHOAL_FABRIC_ADDR": self.fabric_addr(0),
        }

    def popen_in(
        self,
        ns: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cpus: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside namespace ``ns`` (with ``env`` added to this process's environment).

        ``cpus``: the CPUs it (and every process it starts) may run on; None: any."""
        full = {**os.environ, **(env or {})}
        if cpus is not None:
            kwargs["preexec_fn"] = _pin(cpus)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=full, **kwargs)
        self._procs.append(proc)
        return proc

    def run_on(
        self, i: int, argv: Sequence[str], *, timeout: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on host ``i`` to completion; its output is captured."""
        return subprocess.run(
            ["ip", "netns", "exec", self.host_ns(i), *argv],
            env={**os.environ, **self.host_env(i)},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def s3_pid(self) -> int | None:
        """The S3 server's pid (the one process of the storage namespace), or None if it is not one."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.ns("st")], capture_output=True, text=True, check=False
        ).stdout.split()
        return int(out[0]) if len(out) == 1 else None

    def counters(self, i: int) -> LinkCounters:
        """Bytes through host ``i``'s storage NIC and fabric link (both directions)."""
        stats = {}
        for dev in ("st0", "fb0"):
            (link,) = json.loads(_sh(["ip", "-n", self.host_ns(i), "-j", "-s", "link", "show", dev]))
            stats[dev] = link["stats64"]
        return LinkCounters(
            stats["st0"]["tx"]["bytes"],
            stats["st0"]["rx"]["bytes"],
            stats["fb0"]["tx"]["bytes"],
            stats["fb0"]["rx"]["bytes"],
        )

    def run_ranks(
        self,
        scenario: str | Callable[..., Any],
        ranks_per_host: int,
        args: Mapping[str, Any] | None = None,
        *,
        timeout: float = 120.0,
        grace: float | None = None,
        hosts: int | None = None,
    ) -> list[Any]:
        """Run ``scenario(rank, world_size, **args)`` on ``ranks_per_host`` gloo ranks on every host.

        ``scenario`` is ``"package.module:function"`` or a module-level function (each rank imports
        it). Host ``i`` runs :mod:`shoal.testing.cluster.ranks` in its namespace, which starts global
        ranks ``i * ranks_per_host ...``; they join over the fabric (rank 0's store at host 0's
        fabric address, gloo bound to ``fb0``). ``args`` and each rank's return value must be JSON;
        the values come back in rank order. When a rank fails the others get ``grace`` seconds
        (:data:`~shoal.testing.cluster.ranks.GRACE_S` by default: they may be failing too, over a
        collective they shared with it), then every rank still running is killed, and
        :class:`~shoal.testing.multiproc.RankFailed` carries each failed rank's traceback (and the
        end of the hosts' output); likewise after ``timeout`` seconds. ``hosts``: run on the first
        ``hosts`` hosts only (default: all of them); the others stay idle.
        """
        used = self.spec.hosts if hosts is None else hosts
        if not 1 <= used <= self.spec.hosts:
            raise ValueError(f"hosts must be in 1..{self.spec.hosts} (the cluster's hosts), got {hosts}")
        if not self._made:
            raise ClusterError("run_ranks needs a started cluster (use `with Cluster(...)` or start())")
        if ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {ranks_per_host}")
        if not isinstance(scenario, str):
            scenario = f"{scenario.__module__}:{scenario.__qualname__}"
        grace_s = GRACE_S if grace is None else grace
        world = used * ranks_per_host
        port = RANK_PORT + self._rank_runs
        self._rank_runs += 1
        out = tempfile.mkdtemp(prefix="shoal-cluster-ranks-")
        procs: list[subprocess.Popen[bytes]] = []
        timed_out = False
        try:
            for i in range(used):
                argv = [
                    self.python, "-m", "shoal.testing.cluster.ranks", "--scenario", scenario,
                    "--host", str(i), "--hosts", str(used),
                    "--ranks-per-host", str(ranks_per_host),
                    "--master", self.fabric_addr(0), "--port", str(port),
                    "--args", json.dumps(dict(args or {})), "--out", out,
                    "--timeout", str(timeout), "--grace", str(grace_s),
                ]  # fmt: skip
                with open(os.path.join(out, f"h{i}.log"), "wb") as log:
                    env = self.host_env(i)
                    launcher = self.popen_in(
                        self.host_ns(i),
                        argv,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        cpus=self.spec.job_cpus,
                    )
                    procs.append(launcher)
            timed_out = _wait_for_ranks(procs, out, world, timeout, grace_s)
        finally:
            _stop_launchers(procs)
            for p in procs:
                with contextlib.suppress(ValueError):
                    self._procs.remove(p)
            results, failures = _gather(out, world, ranks_per_host)
            logs = _log_tails(out, used)
            shutil.rmtree(out, ignore_errors=True)
        if timed_out:
            failures.insert(0, f"ranks timed out after {timeout} s; finished: {sorted(results)}")
        if failures:
            raise RankFailed("\n".join(failures) + logs)
        return [results[r] for r in range(world)]


def _pin(cpus: Sequence[int]) -> Callable[[], None]:
    """A ``preexec_fn`` that pins the child (and what it execs and forks) to ``cpus``."""
    chosen = set(cpus)

    def pin() -> None:
        os.sched_setaffinity(0, chosen)

    return pin


def _wait_for_ranks(
    procs: Sequence[subprocess.Popen[bytes]], out: str, world: int, timeout: float, grace_s: float
) -> bool:
    """Wait until every launcher exited, or ``grace_s`` after the first failure; True on a timeout."""
    deadline = time.monotonic() + timeout
    until: float | None = None  # once a rank failed: when the others are stopped
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if until is None and (any(p.returncode for p in procs) or _a_rank_failed(out, world)):
            until = now + grace_s
        if now > deadline:
            return True
        if until is not None and now > until:
            return False
        time.sleep(0.2)
    return False


def _stop_launchers(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Stop the hosts' launchers that still run, and their ranks: SIGTERM first (a launcher then
    kills and reaps its ranks), SIGKILL to each launcher's process group after 10 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)  # whatever of its group is left (its session's id is its pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def _a_rank_failed(out: str, world: int) -> bool:
    """Whether some rank already wrote a failure."""
    for r in range(world):
        path = result_path(out, r)
        if os.path.exists(path):
            with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as f:
                if not json.load(f).get("ok"):
                    return True
    return False


def _gather(out: str, world: int, ranks_per_host: int) -> tuple[dict[int, Any], list[str]]:
    """Each rank's value, and a line (or traceback) for each rank that failed or wrote nothing."""
    results: dict[int, Any] = {}
    failures: list[str] = []
    for r in range(world):
        where = f"rank {r} (host h{r // ranks_per_host})"
        try:
            with open(result_path(out, r), encoding="utf-8") as f:
                record = json.load(f)
        except FileNotFoundError:
            failures.append(f"{where} wrote no result (it died, hung or was killed)")
            continue
        except (OSError, ValueError) as e:
            failures.append(f"{where}: its result cannot be read: {e}")
            continue
        if record.get("ok"):
            results[r] = record.get("value")
        else:
            failures.append(f"{where} failed:\n{record.get('error', '(no error recorded)')}")
    return results, failures


def _log_tails(out: str, hosts: int, limit: int = 4000) -> str:
    """The end of each host's launcher output (the ranks' stdout and stderr)."""
    parts = []
    for i in range(hosts):
        with contextlib.suppress(OSError), open(os.path.join(out, f"h{i}.log"), "rb") as f:
            text = f.read().decode(errors="replace").strip()
            if text:
                parts.append(f"\n--- host h{i} output (last {limit} characters) ---\n{text[-limit:]}")
    return "".join(parts)


def _main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m shoal.testing.cluster.hosts",
        description="Bring an emulated cluster up, run a command once per host in it, tear it down.",
    )
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--host-storage-mbit", type=float, default=200.0)
    p.add_argument("--fabric-mbit", type=float, default=400.0)
    p.add_argument("--storage-mbit", type=float, default=400.0)
    p.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command to run on every host")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    spec = ClusterSpec(args.hosts, args.host_storage_mbit, args.fabric_mbit, args.storage_mbit)
    try:
        with Cluster(spec) as cluster:
            print(f"cluster up: {spec.hosts} hosts, S3 at {cluster.s3_endpoint}", flush=True)
            procs = [
                cluster.popen_in(cluster.host_ns(i), command, env=cluster.host_env(i))
                for i in range(spec.hosts)
                if command
            ]
            codes = [proc.wait() for proc in procs]
            for i in range(spec.hosts):
                print(f"h{i}: {cluster.counters(i)}")
    except ClusterError as e:
        print(f"shoal.testing.cluster.hosts: {e}", file=sys.stderr)
        return 2
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(_main())
