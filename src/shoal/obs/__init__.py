"""Observability: metrics, a timeline and a report, all derived from the event records.

Nothing here is a second source of truth: every number comes from the JSON-lines records of
:mod:`shoal.records.events` (``docs/events.md``), as they are emitted (a listener of the
:class:`~shoal.records.events.EventLog`), as a host's log grows, or read back afterwards.
:mod:`shoal.obs.metrics` turns them into Prometheus metrics; it imports ``prometheus_client``
(the ``shoal[metrics]`` extra) only when metrics are made. :mod:`shoal.obs.runlogs` reads a run's
logs from every host onto one clock, :mod:`shoal.obs.timeline` writes them as a Chrome trace and
:mod:`shoal.obs.report` as one HTML page. See ``docs/observability.md``.
"""
