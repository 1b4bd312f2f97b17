"""Shared-storage weather and background load for the emulated cluster (:mod:`shoal.testing.cluster.hosts`).

* :class:`Weather`: the storage link's rate (what the whole cluster can get from storage) changes
  over time, as a contended production file system's does: a list of regimes (rate, seconds),
  repeated, or a random walk between bounds from a seed. Both ends of the storage namespace's link
  are re-shaped (``tc qdisc change``), so uploads and downloads see the same weather. The applied
  timeline is kept (:attr:`Weather.timeline`): the harness's knobs are for evaluating a model,
  never its inputs.
* :class:`BackgroundLoad`: ``writers`` and ``readers`` processes of another tenant, on a host of
  the cluster set aside for them, putting and getting objects of ``object_mib`` on the same S3
  server in a loop, with ``pause`` seconds between requests (the intensity). A tenant host's own
  NIC bounds its load; use several tenant hosts for more.
"""

from __future__ import annotations

import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from shoal.testing.cluster.hosts import VETH_PREFIX, Cluster, ClusterError

__all__ = ["BackgroundLoad", "Weather"]


def _storage_devices(cluster: Cluster) -> list[tuple[str, str]]:
    """The two ends of the storage namespace's link: (namespace, device)."""
    return [(cluster.ns("st"), "eth0"), (cluster.ns("sw"), f"{VETH_PREFIX}{cluster.run_id}stb")]


def set_storage_rate(cluster: Cluster, mbit: float) -> None:
    """Re-shape the storage link (both directions) to ``mbit`` megabits per second."""
    if not mbit > 0:
        raise ValueError(f"the storage link's rate must be > 0 Mbit/s, got {mbit!r}")
    for ns, dev in _storage_devices(cluster):
        done = subprocess.run(
            ["tc", "-n", ns, "qdisc", "change", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
             "burst", "256kb", "latency", "100ms"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise ClusterError(f"tc qdisc change on {ns}/{dev} failed: {done.stderr.strip()}")


@dataclass
class Weather:
    """The storage link's rate over time (see the module docstring). ``start``/``stop``, or ``with``."""

    cluster: Cluster
    regimes: Sequence[tuple[float, float]] = ()
    """(Mbit/s, seconds) applied in turn, repeated; empty: the random walk below."""
    seed: int = 0
    low_mbit: float = 50.0
    high_mbit: float = 400.0
    step_seconds: float = 1.0
    step_factor: float = 1.5
    """A random-walk step multiplies or divides the rate by up to this factor."""
    timeline: list[tuple[float, float]] = field(default_factory=list)
    """(monotonic time, Mbit/s) of every change applied."""

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def __enter__(self) -> Weather:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def rates(self) -> list[tuple[float, float]]:
        """The first steps this weather would apply, (Mbit/s, seconds): deterministic from the seed."""
        if self.regimes:
            return list(self.regimes)
        rng = random.Random(self.seed)
        rate, out = (self.low_mbit * self.high_mbit) ** 0.5, []
        for _ in range(1000):
            rate *= self.step_factor ** rng.uniform(-1.0, 1.0)
            rate = min(self.high_mbit, max(self.low_mbit, rate))
            out.append((round(rate, 3), self.step_seconds))
        return out

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="shoal-weather", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        steps = self.rates()
        try:
            while not self._stop.is_set():
                for mbit, seconds in steps:
                    set_storage_rate(self.cluster, mbit)
                    self.timeline.append((time.monotonic(), mbit))
                    if self._stop.wait(seconds):
                        return
        except BaseException as e:  # reported by stop()
            self._error = e

    def stop(self) -> None:
        """Stop changing the rate (it stays as last applied); raise what went wrong, if anything."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._error is not None:
            raise ClusterError(f"the storage weather stopped: {self._error}") from self._error


_TENANT = """
import os, sys, time, s3fs
from shoal.testing.s3 import S3Admin, s3_storage_options
endpoint = os.environ["SHOAL_S3_ENDPOINT"]
role, index, mib, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
bucket = f"tenant-{os.environ['SHOAL_HOST_ID']}"
fs = s3fs.S3FileSystem(**s3_storage_options(endpoint))
key = f"{bucket}/{role}-{index}"
data = os.urandom(int(mib * (1 << 20)))
if not fs.exists(bucket):
    try:
        S3Admin(endpoint).create_bucket(bucket)
    except Exception:
        pass  # another tenant process made it
fs.pipe(key, data)
while True:
    if role == "w":
        fs.pipe(key, data)
    else:
        fs.cat(key)
    time.sleep(pause)
"""


@dataclass
class BackgroundLoad:
    """Another tenant's writers and readers on host ``host`` of ``cluster`` (see the module docstring)."""

    cluster: Cluster
    host: int
    writers: int = 1
    readers: int = 0
    object_mib: float = 8.0
    pause: float = 0.0
    _procs: list[tuple[subprocess.Popen[bytes], IO[bytes]]] = field(default_factory=list, repr=False)

    def __enter__(self) -> BackgroundLoad:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        env = self.cluster.host_env(self.host)
        ns = self.cluster.host_ns(self.host)
        for role, count in (("w", self.writers), ("r", self.readers)):
            for k in range(count):
                argv = [sys.executable, "-c", _TENANT, role, str(k), str(self.object_mib), str(self.pause)]
                err = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop(), after the process
                proc = self.cluster.popen_in(
                    ns,
                    argv,
                    env=env,
                    cpus=self.cluster.spec.storage_cpus,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
                self._procs.append((proc, err))

    def running(self) -> int:
        """How many of the tenant's processes are still running (one that died says why at stop)."""
        return sum(1 for p, _ in self._procs if p.poll() is None)

    def stop(self) -> None:
        """Stop every tenant process; a process that died on its own is reported."""
        errors = []
        for p, err in self._procs:
            if p.poll() is not None:
                err.seek(0)
                errors.append(err.read().decode(errors="replace")[-400:])
            else:
                p.kill()
            p.wait(timeout=10)
            err.close()
        self._procs.clear()
        if errors:
            raise ClusterError(f"{len(errors)} background-load process(es) died: {errors[0]}")
