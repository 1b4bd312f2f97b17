"""Seeing a run: its event records as a timeline (Chrome trace) and an HTML report.

See ``docs/observability.md``.
"""
