"""Seeing a run: its event records as a timeline (Chrome trace) and as an HTML report (``docs/observability.md``)."""
