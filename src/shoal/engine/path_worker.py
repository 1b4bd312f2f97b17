"""The completion-time model's updates, off the save's critical path (docs/design.md section 7).

After each checkpoint the ``auto`` path policy (:class:`shoal.engine.path.ModelPolicy`) updates
its model: a refit of each path's writers when due, each tier's present state, and both paths'
predictions for a checkpoint like the newest one. A fit is seconds of numpy and scipy under the
interpreter lock; run in a thread of the coordinator it would hold up the coordinator's own save
pipeline (its hashing, its messages, its copies) checkpoint after checkpoint. So the update runs
in a **process of its own** (:class:`ModelWorker`), started once per job on the coordinator:

* at the lowest priority (``nice 19``) and at most ``cpu_share`` of one core over each update
  (:class:`Pacer`: it sleeps inside the fit's likelihood evaluations whenever the update got
  ahead of its share), so the ranks on the same cores keep their CPU;
* fed and answered in JSON lines over a pipe (nothing is unpickled), each answer with what the
  update cost (:func:`run_update`'s ``cost``: seconds and CPU seconds of the fit, the state
  estimate and the predictions, and where they ran);
* gone with its parent: it exits at the end of its input, and between evaluations when its
  parent is no longer the process that started it.

The decision at plan time is then a lookup of the predictions the latest update made (scaled to
the checkpoint's bytes). Where the process cannot be started, the policy falls back to a thread
(``where: "thread"`` in the cost), saying why once in the log.

Run as ``python -m shoal.engine.path_worker`` by :class:`ModelWorker`; not a user command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from shoal.errors import ConfigError
from shoal.model.paths import PATHS, PathModel, PathTimes
from shoal.model.states import StateRule

log = logging.getLogger(__name__)

__all__ = ["ModelWorker", "Pacer", "run_update"]


class Pacer:
    """Keeps the work that calls it at most ``share`` of one core (CPU seconds over wall seconds).

    :meth:`start` opens a window (one update); each call then compares the calling thread's CPU
    time since the window opened with ``share`` times the wall time, and sleeps the difference
    when the work is ahead. ``share`` 1.0 never sleeps. ``alive``, when given, is asked on each
    check; a False ends the process (an orphaned worker).
    """

    def __init__(self, share: float, *, alive: Callable[[], bool] | None = None, every: int = 8) -> None:
        if not 0 < share <= 1:
            raise ConfigError(f"a CPU share must be in (0, 1], got {share!r}")
        self.share = share
        self.alive = alive
        self.every = every
        self.slept = 0.0
        self._calls = 0
        self._cpu0 = time.thread_time()
        self._wall0 = time.monotonic()

    def start(self) -> None:
        self.slept = 0.0
        self._calls = 0
        self._cpu0 = time.thread_time()
        self._wall0 = time.monotonic()

    def __call__(self) -> None:
        self._calls += 1
        if self._calls % self.every == 0:
            self.check()

    def check(self) -> None:
        """Sleep now if the work is ahead of its share (and end an orphaned worker)."""
        if self.alive is not None and not self.alive():
            os._exit(0)  # the coordinator is gone: nobody will read the answer
        if self.share >= 1.0:
            return
        cpu = time.thread_time() - self._cpu0
        behind = cpu / self.share - (time.monotonic() - self._wall0)
        if behind > 0.001:
            time.sleep(behind)
            self.slept += behind


def run_update(
    model: PathModel,
    history: Sequence[PathTimes],
    *,
    refit: bool,
    quantile: float,
    pacer: Pacer | None = None,
) -> dict[str, Any]:
    """One update of ``model`` after a checkpoint: refit when ``refit``, then, once both paths have
    a fit, each path's tier state and ``quantile`` prediction for a checkpoint like the newest.

    Returns JSON values: ``fits`` (per path), ``ahead`` (the newest checkpoint, its bytes and the
    predictions; None while a path has no fit) and ``cost`` (seconds and this thread's CPU seconds
    of each part, and the seconds ``pacer`` slept).
    """
    clock, cpu = time.perf_counter, time.thread_time
    if pacer is not None:
        pacer.start()
        model.pace = pacer
    cost: dict[str, Any] = {"after_checkpoint": history[-1].checkpoint if history else None, "refit": refit}
    w0, c0 = clock(), cpu()
    if refit:
        model.refit(history)
    w1, c1 = clock(), cpu()
    ahead: dict[str, Any] | None = None
    state_s = state_cpu = predict_s = predict_cpu = 0.0
    if history and all(model.ready(p) for p in PATHS):
        newest = history[-1]
        predictions = {}
        for path in PATHS:
            s0, sc0 = clock(), cpu()
            state = model.tier_state(path, history)
            s1, sc1 = clock(), cpu()
            predictions[path] = model.predict(path, quantile, newest.logical_bytes, history, state).to_json()
            state_s, state_cpu = state_s + s1 - s0, state_cpu + sc1 - sc0
            predict_s, predict_cpu = predict_s + clock() - s1, predict_cpu + cpu() - sc1
            if pacer is not None:
                pacer.check()  # a prediction is a few tens of ms: paced between them
        ahead = {
            "checkpoint": newest.checkpoint,
            "logical_bytes": newest.logical_bytes,
            "predictions": predictions,
        }
    cost.update(
        fit_s=w1 - w0, fit_cpu_s=c1 - c0, state_s=state_s, state_cpu_s=state_cpu,
        predict_s=predict_s, predict_cpu_s=predict_cpu, wall_s=clock() - w0, cpu_s=cpu() - c0,
        paced_s=0.0 if pacer is None else pacer.slept,
    )  # fmt: skip
    return {"fits": {p: f.to_json() for p, f in model.fits.items()}, "ahead": ahead, "cost": cost}


class ModelWorker:
    """The parent's end of one worker process: :meth:`submit` a request, ``on_answer`` gets the reply.

    ``on_answer(answer)`` runs on the worker's reader thread for each answer (a dict with the
    request's ``id`` and :func:`run_update`'s fields, or ``error``); ``on_exit(message)`` once,
    when the worker's output ends (it died, or :meth:`close`). :meth:`start` raises ``OSError``
    when the process cannot be started.
    """

    def __init__(
        self,
        *,
        min_checkpoints: int,
        state_rule: str,
        cpu_share: float,
        on_answer: Callable[[dict[str, Any]], None],
        on_exit: Callable[[str], None],
    ) -> None:
        self.args = [
            "--min-checkpoints", str(min_checkpoints),
            "--state-rule", state_rule,
            "--cpu-share", repr(cpu_share),
        ]  # fmt: skip
        self.on_answer = on_answer
        self.on_exit = on_exit
        self._proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()
        self.closing = False

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        # the worker imports this very shoal, wherever it was imported from here (<root>/shoal/engine/)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.engine.path_worker", *self.args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
            close_fds=True,
        )
        self._reader = threading.Thread(target=self._read, name="shoal-path-model-reader", daemon=True)
        self._reader.start()

    def submit(self, request: Mapping[str, Any]) -> None:
        """Send one request (raises ``OSError`` when the worker is gone)."""
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise OSError("the path model's worker is not running")
        line = json.dumps(request, allow_nan=False) + "\n"
        with self._lock:
            proc.stdin.write(line)
            proc.stdin.flush()

    def _read(self) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        for line in proc.stdout:
            try:
                answer = json.loads(line)
            except ValueError:
                log.warning("the path model's worker wrote a line that is not JSON: %.200r", line)
                continue
            if isinstance(answer, dict):
                self.on_answer(answer)
        proc.stdout.close()
        code = proc.wait()
        self.on_exit("closed" if self.closing else f"the worker process {proc.pid} exited with status {code}")

    def close(self, timeout: float = 5.0) -> None:
        """End the worker: its input closes, it exits (killed after ``timeout``)."""
        proc = self._proc
        if proc is None:
            return
        self.closing = True
        try:
            with self._lock:
                if proc.stdin is not None:
                    proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)


def serve(stdin: IO[str], stdout: IO[str], model: PathModel, pacer: Pacer) -> None:
    """The worker's loop: a request per line in, an answer per line out, until the input ends."""
    for line in stdin:
        answer: dict[str, Any] = {}
        try:
            request = json.loads(line)
            answer["id"] = request.get("id")
            history = [PathTimes.from_json(h) for h in request["history"]]
            answer.update(
                run_update(
                    model, history, refit=bool(request["refit"]), quantile=float(request["quantile"]),
                    pacer=pacer,
                )
            )  # fmt: skip
            answer["cost"].update(where="process", pid=os.getpid(), nice=_nice(), cpu_share=pacer.share)
        except Exception as e:  # the parent logs it and keeps its last fits
            answer["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
        stdout.write(json.dumps(answer, default=float) + "\n")
        stdout.flush()


def _nice() -> int | None:
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shoal.engine.path_worker")
    parser.add_argument("--min-checkpoints", type=int, required=True)
    parser.add_argument("--state-rule", required=True, help="the model's StateRule, as text")
    parser.add_argument("--cpu-share", type=float, required=True)
    args = parser.parse_args(argv)
    with contextlib.suppress(AttributeError, OSError):  # where it cannot, the share still bounds it
        os.nice(19)
    parent = os.getppid()
    pacer = Pacer(args.cpu_share, alive=lambda: os.getppid() == parent)
    model = PathModel(state_rule=StateRule.parse(args.state_rule), min_checkpoints=args.min_checkpoints)
    serve(sys.stdin, sys.stdout, model, pacer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
