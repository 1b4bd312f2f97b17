"""Observability: metrics, timeline and report, all derived from the event records.

Nothing here is a second source of truth: every number comes from the JSON-lines records of
:mod:`shoal.records.events` (``docs/events.md``), as they are emitted (a listener of the
:class:`~shoal.records.events.EventLog`), as a host's log grows, or read back afterwards.
:mod:`shoal.obs.metrics` turns them into Prometheus metrics (``docs/observability.md``); it imports
``prometheus_client`` (the ``shoal[metrics]`` extra) only when metrics are made.
"""
