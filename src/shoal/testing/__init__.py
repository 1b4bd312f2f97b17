"""Test helpers shipped with shoal: the tier conformance suite, the multi-process harness, scenarios
and a local S3 server.

Importing this package, and :mod:`shoal.testing.multiproc` (which ``shoal demo`` runs its ranks
with), needs only shoal's runtime dependencies. :class:`TierTests` (:mod:`shoal.testing.tiers`)
needs ``pytest``, imported the first time ``shoal.testing.TierTests`` is looked up;
:mod:`shoal.testing.s3` additionally needs ``moto[server]`` and ``boto3``, imported only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.testing.tiers import TierTests


def __getattr__(name: str) -> object:
    # The conformance suite is built on pytest fixtures and marks: import it (and pytest) on first use,
    # so that the demo and the multi-process harness run where pytest is not installed.
    if name == "TierTests":
        from shoal.testing.tiers import TierTests

        return TierTests
    raise AttributeError(f"module 'shoal.testing' has no attribute {name!r}")


__all__ = ["TierTests"]
