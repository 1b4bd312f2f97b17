"""Retention passes: one over any tier (:func:`run_retention`), and the shared tier's, in the background.

The coordinator's pass over the shared tier lists the steps and the packs and deletes what
fell out of ``keep_last``: round trips to an object store, 0.5 s and more on a slow one. Run
between two checkpoints on the pipeline's worker, it held up the next checkpoint by that much
whenever saves came back to back. :class:`SharedRetention` runs it on a thread of its own,
beside the next checkpoint, and :class:`~shoal.records.catalog.PackPins` keeps the two apart: a
pack the next checkpoint reuses is never deleted under it, and a pack being deleted is never
reused. Host tiers' passes (fast: a local file system) stay on the worker.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection

from shoal.errors import WriterFenced
from shoal.records.fence import WriterFence
from shoal.records.packlist import StepSummaries, summarise
from shoal.records.retention import latest_step, pack_ids_on, plan_retention, retain
from shoal.tiers.base import Tier

from .protocol import PipelineContext

log = logging.getLogger(__name__)

__all__ = ["SharedRetention", "run_retention", "shared_writer"]

_FAILED = "retention on %s after step %d failed (nothing unsafe was deleted): %s"


def run_retention(
    tier: Tier,
    keep_last: int | None,
    horizon: int,
    *,
    manifests_are_commits: bool = False,
    writer: str | Collection[str] | None = None,
    summaries: StepSummaries | None = None,
    stop: Callable[[], bool] | None = None,
    drop: Collection[int] = (),
    claim: Callable[[tuple[str, ...]], tuple[str, ...]] | None = None,
) -> tuple[int, tuple[str, ...]]:
    """One retention pass over ``tier``: keep the ``keep_last`` newest committed checkpoints.

    Returns bytes freed and the pack ids deleted. Steps newer than ``horizon`` (in
    flight) and their packs are never touched. Host tiers hold no commit records:
    with ``manifests_are_commits`` a readable manifest counts as committed there.
    ``writer``: the id of the writer that holds the job (shared tier); the steps other
    writers committed are left alone. Damaged steps (unreadable manifest, a commit record
    without its manifest or not matching it) are removed when older than every kept step,
    and otherwise protect the packs they could reference. ``summaries``: each step's pack list
    kept from earlier passes (a manifest is decoded only when it is new or its files changed).
    ``stop``: asked before the listing and before each stage of deletes (:func:`retain`); when
    it says so the pass ends there, and the next one finds what is left. ``drop``: steps the user
    removed, deleted even when among the ``keep_last`` newest (:func:`plan_retention`).
    ``claim``: called, before any delete, with the packs the plan would delete; returns those that
    may go (:meth:`~shoal.records.catalog.PackPins.claim`: a checkpoint in flight may reuse others).
    """
    if stop is not None and stop():
        return 0, ()
    infos = summarise(tier, summaries)
    if manifests_are_commits:
        committed = [i.step for i in infos if i.summary is not None]
    else:
        committed = [i.step for i in infos if i.summary is not None and i.committed]
    plan = plan_retention(
        committed=committed,
        manifests={i.step: i.summary for i in infos},
        latest=latest_step(tier),
        keep_last=keep_last,
        pack_ids=pack_ids_on(tier),
        horizon=horizon,
        writer=writer,
        problems={i.step: i.problem for i in infos if i.problem},
        drop=drop,
    )
    if claim is not None and plan.delete_packs:
        plan = dataclasses.replace(plan, delete_packs=claim(plan.delete_packs))
    return retain(tier, plan, stop=stop)


def shared_writer(ctx: PipelineContext, step: int) -> frozenset[str] | None:
    """The writer ids retention on shared runs for (this writer's lineage), or None if fenced (warned)."""
    fence = ctx.writer
    if not isinstance(fence, WriterFence):
        log.warning(
            "retention on %s after step %d skipped: this process holds no writer claim", ctx.shared.url, step
        )
        return None
    try:
        fence.check(ctx.shared, "run retention")
    except WriterFenced as e:
        log.warning("retention on %s after step %d skipped (nothing deleted): %s", ctx.shared.url, step, e)
        return None
    except Exception as e:
        log.warning(
            "retention on %s after step %d skipped (nothing deleted): "
            "the writer record could not be read: %s",
            ctx.shared.url,
            step,
            e,
        )
        return None
    return fence.lineage


class SharedRetention:
    """The coordinator's retention passes over the shared tier, on a thread of their own.

    :meth:`request` asks for a pass after a commit (or a removal); requests that arrive while a
    pass runs are served by one pass after it, for the newest step. Each pass judges only steps
    up to the newest committed one and not in flight (``horizon``), claims the packs it deletes
    from ``context.shared_pins`` and drops them from the coordinator's catalog before deleting any.

    Args:
        context: the coordinator's pipeline context (tiers, catalog, writer claim, events).
        keep_last: retention's ``keep_last``.
        summaries: the step summaries kept between passes (thread-safe; shared with the worker).
        in_flight: the steps queued or being processed now.
        removed: the steps the user removed, now.
    """

    def __init__(
        self,
        context: PipelineContext,
        keep_last: int | None,
        summaries: StepSummaries,
        *,
        in_flight: Callable[[], Collection[int]],
        removed: Callable[[], Collection[int]],
    ) -> None:
        self.context = context
        self.keep_last = keep_last
        self.summaries = summaries
        self._in_flight = in_flight
        self._removed = removed
        self._cond = threading.Condition()
        self._wanted: int | None = None
        """The newest step a pass was requested for and has not started yet."""
        self._running = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.passes = 0
        """Passes run so far."""

    def request(self, step: int) -> None:
        """Ask for a pass judging steps up to ``step`` (a committed step, or a removed one)."""
        with self._cond:
            if self._closed:
                return
            self._wanted = step if self._wanted is None else max(self._wanted, step)
            if self._thread is None:
                name = f"shoal-retention-r{self.context.rank}"
                self._thread = threading.Thread(target=self._run, name=name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no pass is running or requested; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._running or self._wanted is not None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Finish what was requested (up to ``timeout`` seconds), then stop the thread."""
        finished = self.wait(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and finished:
            thread.join()
        return finished

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._wanted is None and not self._closed:
                    self._cond.wait()
                if self._wanted is None:
                    return
                step, self._wanted, self._running = self._wanted, None, True
            try:
                self._pass(step)
            except Exception:  # pragma: no cover - the pass logs its own failures
                log.exception(
                    "retention on %s after step %d failed unexpectedly", self.context.shared.url, step
                )
            finally:
                with self._cond:
                    self._running = False
                    self.passes += 1
                    self._cond.notify_all()

    def _pass(self, step: int) -> None:
        ctx = self.context
        writer = shared_writer(ctx, step)
        if writer is None:
            return
        horizon = min([step, *(s - 1 for s in self._in_flight() if s != step)])
        pins = ctx.shared_pins
        since = pins.mark()  # before anything is listed
        catalog = ctx.shared_catalog
        if catalog is not None:
            recent = catalog.recent_step(step)  # written by this process just now
            if recent is not None:
                self.summaries.prime(ctx.shared, *recent)
        claimed: list[str] = []

        def claim(packs: tuple[str, ...]) -> tuple[str, ...]:
            ok = pins.claim(packs, since)
            claimed.extend(ok)
            now = ctx.shared_catalog  # the catalog the next plan will read, whichever it is
            if now is not None:
                now.drop_packs(ok)
            return ok

        t0 = time.perf_counter()
        try:
            freed, dropped = run_retention(
                ctx.shared,
                self.keep_last,
                horizon,
                writer=writer,
                summaries=self.summaries,
                drop=sorted(self._removed()),
                claim=claim,
            )
        except Exception as e:
            log.warning(
                "retention on %s after step %d failed (nothing unsafe was deleted): %s",
                ctx.shared.url,
                step,
                e,
            )
            return
        finally:
            pins.deleted(claimed)
        if freed or dropped:
            ctx.events.emit(
                "retention",
                step,
                tier=ctx.shared.kind,
                freed_bytes=freed,
                packs=len(dropped),
                seconds=time.perf_counter() - t0,
            )
